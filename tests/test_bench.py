"""bench/bench_labeler.py: a tiny run end to end (children, JSON, summary), and its argument checks."""
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
    out = tmp_path / "lb.json"
    p = run_bench("--n", "600", "--ks", "30", "--skip-real", "--large-n", "3000", "--large-k", "20",
                  "--ref-n", "1000", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    recs = res["records"]
    # every method on every gaussian k, ours streamed on the large case, all three on its head
    assert sorted((r["input"], r["n"], r["k"], r["method"]) for r in recs) == sorted(
        [("gaussian", 600, 30, m) for m in ("exact", "published", "sinkhorn")]
        + [("gaussian_large", 3000, 20, "exact")]
        + [("gaussian_large", 1000, 20, m) for m in ("exact", "published", "sinkhorn")])
    for r in recs:
        assert "error" not in r, r
        assert r["seconds"] > 0 and r["peak_mib"] >= 0
        if r["method"] == "exact":   # ours: the integer floor
            assert r["max_minus_min"] <= 1
            assert r["std"] == pytest.approx(r["std_floor"], abs=1e-9)
    streamed = [r for r in recs if r["streamed"]]
    assert len(streamed) == 1 and streamed[0]["n"] == 3000
    assert all(("StreamingTranslator" in r["call"]) == r["streamed"] for r in recs)
    for r in recs:   # held whole: the same call again in the same process (an epoch after the first)
        assert ("seconds_warm" in r) != r["streamed"]
        assert r.get("seconds_warm", 1) > 0
    for r in recs:   # ours says how many rows it solved and read again, streamed or not
        assert ("working_set" in r and "refetched" in r) == (r["method"] == "exact")
        if r["method"] == "exact":
            assert r["working_set"] <= r["n"] and r["refetched"] >= 0
    assert res["skipped"]["random_net"] == "--skip-real"
    table = run_bench("--summary", str(out))
    assert table.returncode == 0, table.stderr
    assert "| gaussian | 600 | 30 |" in table.stdout and "streamed" in table.stdout
    row = next(x for x in table.stdout.splitlines() if x.startswith("| gaussian | 600 | 30 |"))
    assert row.count("|") == 9 and row.rstrip(" |").endswith("x")   # second call's ratio


def test_bench_labeler_large_streamed(tmp_path):
    """The large case: ours streamed over all its rows (read again through the same generator)
    at exact balance, all methods on its first rows; the summary table and the plot of a saved
    run."""
    out = tmp_path / "lb.json"
    p = run_bench("--n", "300", "--ks", "10", "--skip-real", "--large-n", "3000", "--large-k", "40",
                  "--ref-n", "1000", "--methods", "exact,published", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    large = sorted((r["n"], r["method"]) for r in res["records"] if r["input"] == "gaussian_large")
    assert large == [(1000, "exact"), (1000, "published"), (3000, "exact")]
    for r in res["records"]:
        assert "error" not in r, r
        if r["method"] == "exact":
            assert r["max_minus_min"] <= 1
    streamed = [r for r in res["records"] if r["streamed"]]
    assert [(r["input"], r["n"]) for r in streamed] == [("gaussian_large", 3000)]
    table = run_bench("--summary", str(out))
    assert "| gaussian_large | 3,000 | 40 |" in table.stdout
    pytest.importorskip("matplotlib")
    png = tmp_path / "again.png"
    table = run_bench("--summary", str(out), "--plot", str(png))     # the plot of a saved run
    assert table.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_labeler_training_split(small_data, tmp_path):
    """--real-split train: the real outputs are the training split's images, each once (N = its
    size, whatever --n says), as a training run's label pass hands them to the labeler."""
    out = tmp_path / "lb.json"
    p = run_bench("--n", "300", "--ks", "10", "--real-ks", "10", "--data", str(small_data),
                  "--real-split", "train", "--skip-large", "--methods", "exact,published",
                  "--checkpoint", str(tmp_path / "none.pth"), "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    n_train = len(json.loads((small_data / "split.json").read_text())["train"])
    real = [r for r in res["records"] if r["input"] == "random_net"]
    assert sorted(r["method"] for r in real) == ["exact", "published"]
    assert all(r["n"] == n_train for r in real) and n_train != 300
    assert next(r for r in real if r["method"] == "exact")["max_minus_min"] <= 1
    assert "the training split" in res["inputs"]["random_net"]


@pytest.mark.parametrize("views", [False, True])
def test_bench_labeler_trained_backbone(small_data, tmp_path, views):
    """--checkpoint with --trained-ks: its own head's outputs (trained_net, k = its k) and its
    backbone's features through fresh heads at each asked k (trained_backbone), each balanced;
    with --views, the second of two augmented views, and ours on it again from the first
    view's translation (*_from_view0), as balanced."""
    ckpt = fresh_checkpoint(small_data, tmp_path)
    out = tmp_path / "lb.json"
    # (each record costs a child process: with --views, one fresh head and both methods;
    # without, two heads and ours only)
    p = run_bench("--n", "300", "--ks", "10", "--real-ks", "10", "--data", str(small_data),
                  "--real-split", "train", "--skip-large",
                  "--methods", "exact,published" if views else "exact",
                  "--checkpoint", ckpt, "--trained-ks", "30" if views else "12,30",
                  "--out", str(out), *(["--views"] if views else []))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    n_train = len(json.loads((small_data / "split.json").read_text())["train"])
    got = {(r["input"], r["k"], r["method"]): r for r in res["records"]}
    want = [("trained_net", 8), ("trained_backbone", 30)] + ([] if views else [("trained_backbone", 12)])
    if views:
        want += [(f"{name}_from_view0", k) for name, k in want]
        assert ("trained_backbone", 30, "published") in got
        assert ("trained_net_from_view0", 8, "published") not in got      # ours only
    assert {(name, k, "exact") for name, k in want} <= set(got)
    for name, k in want:
        assert got[name, k, "exact"]["n"] == n_train and got[name, k, "exact"]["max_minus_min"] <= 1
    if views:
        assert "start=T of the first view" in got["trained_backbone_from_view0", 30, "exact"]["call"]
    table = run_bench("--summary", str(out)).stdout
    assert "| trained_backbone |" in table and ("| trained_net_from_view0 |" in table) == views


def test_bench_labeler_rejects_bad_sizes(tmp_path):
    p = run_bench("--n", "100", "--ks", "200", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "--ks must lie in" in p.stderr
    p = run_bench("--methods", "exact,nope", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "unknown" in p.stderr
    p = run_bench("--repeat", "0", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "--repeat must be >= 1" in p.stderr
    p = run_bench("--fresh", "0", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "--fresh must be >= 1" in p.stderr


def test_bench_labeler_fresh_runs(tmp_path):
    """--fresh 3: each method in three fresh children; the record keeps every run's seconds and
    the median ones."""
    out = tmp_path / "lb.json"
    p = run_bench("--n", "600", "--ks", "10", "--skip-real", "--skip-large", "--fresh", "3",
                  "--methods", "exact,published", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    recs = json.loads(out.read_text())["records"]
    assert sorted(r["method"] for r in recs) == ["exact", "published"]
    for r in recs:
        assert r["fresh_runs"] == 3 and len(r["seconds_runs"]) == len(r["seconds_warm_runs"]) == 3
        assert r["seconds"] == sorted(r["seconds_runs"])[1]
        assert r["seconds_warm"] == sorted(r["seconds_warm_runs"])[1]


def test_median_run_keeps_the_middle_run_and_errors():
    import bench_labeler
    runs = [{"seconds": s, "seconds_warm": w, "iterations": i}
            for s, w, i in ((0.3, 0.1, 5), (0.1, 0.3, 6), (0.2, 0.2, 7), (0.5, 0.4, 8))]
    rec = bench_labeler.median_run(runs)
    assert rec["seconds"] == 0.3 and rec["iterations"] == 5      # the upper middle of four
    assert rec["seconds_warm"] == 0.3 and rec["seconds_runs"] == [0.3, 0.1, 0.2, 0.5]
    assert bench_labeler.median_run(runs[:1]) == runs[0]
    bad = bench_labeler.median_run(runs[:2] + [{"error": "boom"}])
    assert bad["error"] == "boom" and bad["failed_runs"] == 1 and "seconds" not in bad


def _fake_results(data, split, records):
    """A results JSON as bench_labeler.py writes it, with only what --summary reads."""
    recs = [dict(input=i, n=n, k=k, method=m, seconds=s, seconds_warm=s / 2, max_minus_min=d,
                 std=0.1, streamed=False) for i, n, k, m, s, d in records]
    return {"machine": {"cpu": "test cpu", "torch_threads": 2, "torch": "x"}, "command": "cmd",
            "git_commit": "abcdef0", "records": recs,
            "args": {"data": data, "real_split": split, "net": "cpu", "device": "cpu",
                     "checkpoint": "runs/eurosat/checkpoint.pth"}}


def test_matrix_over_several_results(tmp_path):
    """--summary A B: one table over both, a row per set of outputs (a trained network's own
    head and its backbone's fresh heads one row), a column per k, the published rules' seconds
    over ours with both max - mins, cells under --goal marked and counted; streamed and
    from-view0 records left out."""
    import bench_labeler
    a = _fake_results("data/eurosat", "all", [
        ("random_net", 50000, 10, "exact", 0.1, 0), ("random_net", 50000, 10, "published", 0.5, 3),
        ("random_net", 50000, 3000, "exact", 10.0, 1), ("random_net", 50000, 3000, "published", 20.0, 9),
        ("trained_net", 50000, 128, "exact", 0.2, 1), ("trained_net", 50000, 128, "published", 2.0, 6),
        ("trained_backbone", 50000, 3000, "exact", 5.0, 1),
        ("trained_backbone", 50000, 3000, "published", 50.0, 4),
        ("trained_backbone_from_view0", 50000, 3000, "exact", 0.5, 1)])
    b = _fake_results("data/cifar10", "train", [
        ("random_net", 50000, 10, "exact", 0.1, 1), ("random_net", 50000, 10, "published", 0.4, 2),
        ("gaussian_large", 64000, 10, "exact", 1.0, 1), ("gaussian_large", 64000, 10, "published", 1.5, 2)])
    for res, s_exact, fresh in ((a, 0.1, 5), (b, 0.2, 1)):   # one measurement in both JSONs
        res["records"] += [dict(input="gaussian", n=600, k=10, method=m, seconds=s, seconds_warm=s,
                                max_minus_min=0, std=0.0, streamed=False, fresh_runs=fresh)
                           for m, s in (("exact", s_exact), ("published", 0.6))]
    table, factors = bench_labeler.matrix([a, b], goal=3.0)
    assert "| gaussian | 600 | 6.0x (0 / 0) |" in table     # the one of most fresh processes
    lines = table.splitlines()
    head = next(x for x in lines if x.startswith("| outputs |"))
    assert head == "| outputs | N | k = 10 | k = 128 | k = 3000 |"
    rows = [x for x in lines if x.startswith("| eurosat, random")]
    assert rows[0] == "| eurosat, random `cpu` network, all images | 50,000 | 5.0x (0 / 3) |  | 2.0x (1 / 9) < |"
    assert rows[1].endswith("| 5.0x (0 / 3) |  | 2.0x (1 / 9) < |")    # the second calls: halves
    trained = next(x for x in lines if x.startswith("| eurosat, trained network (`runs/eurosat`)"))
    assert trained.endswith("|  | 10.0x (1 / 6) | 10.0x (1 / 4) |")
    assert "| cifar10, random `cpu` network, training split | 50,000 | 4.0x (1 / 2) |" in table
    assert "gaussian_large" not in table and "from_view0" not in table
    assert "First call: 5 of 6 cells at or above 3x; under it (marked <): eurosat, random `cpu` " \
        "network, all images, k = 3000: 2.0x." in table
    assert factors[("eurosat", "random `cpu` network", "all images", 50000)] == {10: 5.0, 3000: 2.0}
    assert "every one" in bench_labeler.matrix([a, b], goal=1.5)[0]
    # the command line: each JSON's tables, then the one over both, and its plot
    for name, res in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(res))
    args = ["--summary", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    p = run_bench(*args)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("## ") == 2 and p.stdout.index("b.json") < p.stdout.index("First call: 5 of 6")
    assert run_bench(*args, "--plot", str(tmp_path / "x.png")).returncode != 0   # one JSON's plot only
    pytest.importorskip("matplotlib")
    p = run_bench(*args, "--matrix-plot", str(tmp_path / "m.png"), "--goal", "4.5")
    assert p.returncode == 0 and "First call: 4 of 6 cells at or above 4.5x" in p.stdout
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_labeler_gpu_flag_without_a_gpu(tmp_path):
    p = run_bench("--device", "cuda", "--quick", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "no CUDA GPU is visible" in p.stderr
    assert not (tmp_path / "x.json").exists()


def test_bench_train_measures_float32_and_bf16(tmp_path):
    """bench_train.py --amp both: every OTL figure in float32 and under bf16 autocast, their
    ratio, and what train_otl.py's --amp would take here, in the JSON."""
    import bench_train
    out = tmp_path / "t.json"
    res = bench_train.main(bench_train.get_args_parser().parse_args(
        ["--device", "cpu", "--sizes", "32", "--width", "8", "--batch-size", "16", "--steps", "2",
         "--warmup", "1", "--label-batch-size", "16", "--amp", "both", "--only",
         "otl_train,features", "--out", str(out)]))
    r = json.loads(out.read_text())["sizes"]["32"]
    assert r == res["sizes"]["32"] and "label_pass_fp32" not in r and "supervised" not in r
    for f in ("otl_train", "features"):
        assert r[f + "_fp32"]["views_per_s"] > 0 and r[f + "_bf16"]["views_per_s"] > 0
        assert r[f + "_bf16_over_fp32"] == pytest.approx(
            r[f + "_bf16"]["views_per_s"] / r[f + "_fp32"]["views_per_s"], abs=1e-3)
    import utils
    assert res["amp"] == {"asked": "both", "auto_takes": utils.cpu_bf16()}
