"""bench/bench_labeler.py: tiny runs end to end (children, JSON, the table), its argument checks;
bench/bench_train.py's float32 and bf16 figures."""
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def run_bench(*args):
    return subprocess.run([sys.executable, "bench/bench_labeler.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def fresh_checkpoint(small_data, tmp_path):
    """A freshly initialised k = 8, width-8 network saved as a checkpoint trained on small_data
    at 16 px: what --checkpoint needs, without a training run."""
    import dataclasses
    import otl
    import utils
    torch.manual_seed(0)
    cfg = otl.ModelConfig(k=8, width=8)
    ckpt = str(tmp_path / "checkpoint.pth")
    utils.save_checkpoint({"model": otl.build_model(cfg).state_dict(),
                           "model_cfg": dataclasses.asdict(cfg),
                           "args": {"data": str(small_data), "img_size": 16, "cutout": 4},
                           "epoch": 0}, ckpt)
    return ckpt


def test_bench_labeler_tiny_run(tmp_path):
    """Every labeler by its name on the same Gaussian outputs, exact also streamed over the large
    case's rows (made again for its refetch) and every one on its first rows; each record
    utils.measure_labeler's with the memory and a second call's seconds; a line each."""
    out = tmp_path / "lb.json"
    p = run_bench("--n", "600", "--ks", "30", "--skip-real", "--large-n", "3000", "--large-k", "20",
                  "--ref-n", "1000", "--methods", "exact,published,sinkhorn,reference", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    recs = res["records"]
    methods = ("exact", "published", "sinkhorn", "reference")
    assert sorted((r["input"], r["n"], r["k"], r["method"]) for r in recs) == sorted(
        [("gaussian", 600, 30, m) for m in methods] + [("gaussian_large", 3000, 20, "exact")]
        + [("gaussian_large", 1000, 20, m) for m in methods])
    for r in recs:
        assert "error" not in r, r
        assert r["seconds"] > 0 and r["peak_mib"] >= 0 and r["settings"] == {}
        f = (r["n"] % r["k"]) / r["k"]
        assert r["std_floor"] == pytest.approx((f * (1 - f)) ** 0.5)
        if r["method"] in ("exact", "reference"):    # the integer floor
            assert r["max_minus_min"] <= 1 and r["std"] == pytest.approx(r["std_floor"], abs=1e-9)
        assert ("active" in r and "refetched" in r) == (r["method"] == "exact")
        assert ("seconds_warm" in r) != r["streamed"] and r.get("seconds_warm", 1) > 0
    streamed, = [r for r in recs if r["streamed"]]
    assert (streamed["n"], streamed["active"]) == (3000, 3000) and streamed["refetched"] >= 0
    assert res["skipped"] == {"real": "--skip-real"} and res["args"]["published"] == "training"
    lines = p.stdout.splitlines()                    # the table: a line a record, as it came
    assert [x.split()[:4] for x in lines if x.startswith("gaussian")] == [
        [r["input"], f"{r['n']:,}", str(r["k"]), r["method"]] for r in recs]
    assert sum(x.endswith("  streamed") for x in lines) == 1


def test_bench_labeler_published_as_the_authors_run_it(tmp_path):
    """--published authors: T from 0 and no tie-break, as the studies run it, in the record."""
    out = tmp_path / "lb.json"
    p = run_bench("--n", "600", "--ks", "30", "--skip-real", "--skip-large", "--methods",
                  "published", "--published", "authors", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    r, = json.loads(out.read_text())["records"]
    assert r["settings"] == {"init": "zero", "tie_eps": 0} and len(r["std_history"]) > 1


def test_bench_labeler_networks_outputs(small_data, tmp_path):
    """--real-split train: a random network's outputs on the training split (N = its size,
    whatever --n says), a checkpoint's own head (trained_net, k = its k) and its backbone through
    fresh heads (trained_backbone), each kept by --save-inputs for compare_labelers.py --pt."""
    ckpt, out, saved = fresh_checkpoint(small_data, tmp_path), tmp_path / "lb.json", tmp_path / "in"
    p = run_bench("--n", "300", "--ks", "10", "--real-ks", "10", "--data", str(small_data),
                  "--real-split", "train", "--skip-large", "--methods", "exact,published",
                  "--checkpoint", ckpt, "--trained-ks", "30", "--save-inputs", str(saved),
                  "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    n_train = len(json.loads((small_data / "split.json").read_text())["train"])
    got = {(r["input"], r["k"], r["method"]): r for r in json.loads(out.read_text())["records"]}
    nets = [("random_net", 10), ("trained_net", 8), ("trained_backbone", 30)]
    assert set(got) == {(i, k, m) for i, k in nets + [("gaussian", 10)]
                        for m in ("exact", "published")}
    for name, k in nets:
        assert got[name, k, "exact"]["n"] == n_train != 300
        assert got[name, k, "exact"]["max_minus_min"] <= 1
        assert torch.load(saved / f"{name}_{k}.pt").shape == (n_train, k)
    assert sorted(os.listdir(saved)) == sorted(f"{name}_{k}.pt" for name, k in nets)


def bench_labeler_main(*args):
    """bench_labeler.py's main in this process (its argument checks run before any work)."""
    import bench_labeler
    return bench_labeler.main(bench_labeler.get_args_parser().parse_args(list(args)))


def test_bench_labeler_rejects_bad_arguments(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    for args, said in ((["--n", "100", "--ks", "200"], "--ks must lie in"),
                       (["--methods", "exact,nope"], r"unknown \['nope'\]"),
                       (["--large-k", "50", "--ref-n", "20"], "need --large-k <= --ref-n")):
        with pytest.raises(SystemExit, match=said):
            bench_labeler_main(*args, "--out", out)
    with pytest.raises(SystemExit):
        bench_labeler_main("--net", "nope", "--out", out)
    assert "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_labeler_gpu_flag_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="CUDA is not available"):
        bench_labeler_main("--device", "cuda", "--out", str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()


def test_bench_train_measures_float32_and_bf16(tmp_path):
    """bench_train.py --amp both: every OTL figure in float32 and under bf16 autocast, their
    ratio, and what train_otl.py's --amp would take here, in the JSON; the batched augmentation
    beside torchvision's per image."""
    import bench_train
    out = tmp_path / "t.json"
    res = bench_train.main(bench_train.get_args_parser().parse_args(
        ["--device", "cpu", "--sizes", "32", "--width", "8", "--batch-size", "16", "--steps", "2",
         "--warmup", "1", "--label-batch-size", "16", "--amp", "both", "--only",
         "otl_train,features,augment,per_image", "--out", str(out)]))
    r = json.loads(out.read_text())["sizes"]["32"]
    assert r == res["sizes"]["32"] and "label_pass_fp32" not in r and "supervised" not in r
    assert r["augment"]["views_per_s"] > 0 and r["per_image"]["views_per_s"] > 0
    for f in ("otl_train", "features"):
        assert r[f + "_fp32"]["views_per_s"] > 0 and r[f + "_bf16"]["views_per_s"] > 0
        assert r[f + "_bf16_over_fp32"] == pytest.approx(
            r[f + "_bf16"]["views_per_s"] / r[f + "_fp32"]["views_per_s"], abs=1e-3)
    import utils
    assert res["amp"] == {"asked": "both", "auto_takes": utils.cpu_bf16()}
