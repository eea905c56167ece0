"""The stage scripts on real EuroSAT images: prepare_data, train_otl (checkpoints, resume,
supervised), eval_knn, eval_linear and report, end to end at a tiny size."""
import json
import os
import shutil
import zipfile

import pytest
import torch

import eval_knn
import eval_linear
import otl
import prepare_data
import report
import train_otl

HERE = os.path.dirname(os.path.abspath(__file__))
EUROSAT = os.path.join(HERE, "..", "..", "shared", "data", "EuroSAT.zip")
PER_CLASS = 20  # 200 real images: 160 train, 40 test


@pytest.fixture(scope="session")
def eurosat_zip():
    if not os.path.isfile(EUROSAT):
        msg = f"the real EuroSAT archive is missing at {os.path.abspath(EUROSAT)}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI must have ../shared/data beside the checkout)")
        pytest.skip(msg)
    return EUROSAT


def prep(src, out, *extra):
    args = prepare_data.get_args_parser().parse_args(
        ["--source", str(src), "--out", str(out), "--workers", "1", *extra])
    return prepare_data.main(args)


@pytest.fixture(scope="session")
def small_data(eurosat_zip, tmp_path_factory):
    out = tmp_path_factory.mktemp("eurosat") / "data"
    prep(eurosat_zip, out, "--per-class", str(PER_CLASS))
    return out


# ------------------------------------------------------------------------------------ prepare_data

def test_prepare_real_archive(small_data):
    man = json.loads((small_data / "manifest.json").read_text())
    assert man["n_images"] == 10 * PER_CLASS
    assert set(man["per_class_counts"].values()) == {PER_CLASS}
    assert man["classes"][0] == "AnnualCrop" and len(man["classes"]) == 10
    assert man["checksum"].startswith("sha256:") and man["image_size"] == 64
    d = otl.load_prepared(str(small_data))
    assert d["images"].dtype == torch.uint8 and d["images"].shape == (200, 3, 64, 64)
    assert len(d["train_idx"]) == man["n_train"] == 160 and len(d["test_idx"]) == man["n_test"] == 40
    assert not set(d["train_idx"].tolist()) & set(d["test_idx"].tolist())
    # stratified: 4 test images of every class
    assert torch.bincount(d["labels"][d["test_idx"]]).tolist() == [4] * 10
    # file names agree with labels
    for f, y in zip(d["files"], d["labels"].tolist()):
        assert f.split("/")[-2] == d["classes"][y]
    assert d["images"].float().std() > 10  # real pictures, not blanks


def test_prepare_is_idempotent_and_rebuilds_when_stale(eurosat_zip, tmp_path):
    out = tmp_path / "d"
    prep(eurosat_zip, out, "--per-class", "3")
    cache = out / "cache.pt"
    m1 = cache.stat().st_mtime_ns
    prep(eurosat_zip, out, "--per-class", "3")
    assert cache.stat().st_mtime_ns == m1, "a valid cache must be reused"
    split1 = json.loads((out / "split.json").read_text())
    prep(eurosat_zip, out, "--per-class", "3", "--seed", "1")
    split2 = json.loads((out / "split.json").read_text())
    assert cache.stat().st_mtime_ns != m1 and split2["seed"] == 1
    assert split1["test"] != split2["test"]


def _folder_copy(eurosat_zip, dest, n=3, classes=("Forest", "River")):
    with zipfile.ZipFile(eurosat_zip) as z:
        for c in classes:
            names = sorted(x for x in z.namelist() if f"/{c}/" in x and x.endswith(".jpg"))[:n]
            os.makedirs(dest / c, exist_ok=True)
            for x in names:
                (dest / c / os.path.basename(x)).write_bytes(z.read(x))
    return dest


def test_prepare_folder_source_and_bad_images(eurosat_zip, tmp_path):
    src = _folder_copy(eurosat_zip, tmp_path / "src")
    (src / "River" / "River_broken.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(SystemExit, match="River_broken.jpg"):
        prep(src, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    man = prep(src, tmp_path / "out", "--skip-bad", "--size", "32")
    assert man["n_images"] == 6 and man["image_size"] == 32
    assert [s["file"] for s in man["skipped"]] == [os.path.join("River", "River_broken.jpg")]
    assert otl.load_prepared(str(tmp_path / "out"))["images"].shape[-1] == 32


def test_prepare_rejects_bad_source(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises((SystemExit, ValueError), match="neither a folder nor a zip"):
        prep(tmp_path / "x.txt", tmp_path / "out")
    with pytest.raises(SystemExit, match="does not exist"):
        prep(tmp_path / "nope.zip", tmp_path / "out")


# ------------------------------------------------------------------------------------ train_otl

TINY = ["--width", "8", "--img-size", "16", "--k", "16", "--batch-size", "32", "--preset", "cpu",
        "--device", "cpu", "--no-progress", "--schedule", "step", "--lr-drops", "--lr-values"]


def train(data, out, *extra):
    args = train_otl.get_args_parser().parse_args(["--data", str(data), "--output", str(out), *TINY, *extra])
    return train_otl.main(args)


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_resume_equals_uninterrupted_run(small_data, tmp_path):
    train(small_data, tmp_path / "a", "--epochs", "2")
    # the same run stopped after its first epoch (as a crash would), then the same command again
    assert train(small_data, tmp_path / "b", "--epochs", "2", "--max-minutes", "1e-9") is None
    assert torch.load(tmp_path / "b" / "checkpoint.pth", weights_only=False)["epoch"] == 1
    train(small_data, tmp_path / "b", "--epochs", "2", "--max-minutes", "1e-9")
    wa, wb = _weights(tmp_path / "a" / "checkpoint.pth"), _weights(tmp_path / "b" / "checkpoint.pth")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2]
    for r in log:
        # the label pass spread the pseudo-labels: std far below all-in-one-cluster
        assert r["pl_std"] < 0.05 * r["pl_std_max"]
        assert r["loss"] > 0 and r["img_per_s"] > 0


def test_checkpoint_rebuilds_model_and_random_init_snapshot(small_data, tmp_path):
    train(small_data, tmp_path / "r", "--epochs", "1")
    model, ck = otl.load_checkpoint(str(tmp_path / "r" / "checkpoint.pth"))
    assert ck["epoch"] == 1 and ck["args"]["k"] == 16 and ck["model_cfg"]["width"] == 8
    assert model(torch.zeros(2, 3, 16, 16, dtype=torch.uint8)).shape == (2, 16)
    assert ck["pseudo_labels"].shape == (ck["args"]["label_views"], 160)  # one row per labelled view
    m0, ck0 = otl.load_checkpoint(str(tmp_path / "r" / "checkpoint0000.pth"))
    assert ck0["epoch"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(m0.state_dict().values(), model.state_dict().values()))
    assert os.path.isfile(tmp_path / "r" / "checkpoint0001.pth")
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert res["epochs"] == 1 and res["preset"] == "cpu"


def test_bad_flags_fail_loudly(small_data, tmp_path):
    with pytest.raises(SystemExit, match="label-views"):
        train(small_data, tmp_path / "x", "--epochs", "1", "--label-views", "3")
    with pytest.raises(SystemExit, match="fewer than --k"):
        train(small_data, tmp_path / "y", "--epochs", "1", "--k", "500")


# ------------------------------------------------------------------------------------ end to end

def test_end_to_end_train_evaluate_report(small_data, tmp_path):
    runs = tmp_path / "runs"
    train(small_data, runs / "eurosat", "--epochs", "2", "--views", "2", "--label-views", "2",
          "--aug", "strong", "--lct", "true")
    train(small_data, runs / "eurosat_supervised", "--epochs", "1", "--supervised")
    for run in ("eurosat", "eurosat_supervised"):
        for stem in ("checkpoint", "checkpoint0000"):
            ck = str(runs / run / f"{stem}.pth")
            k = eval_knn.main(eval_knn.get_args_parser().parse_args(
                ["--checkpoint", ck, "--device", "cpu", "--no-progress"]))
            lin = eval_linear.main(eval_linear.get_args_parser().parse_args(
                ["--checkpoint", ck, "--device", "cpu", "--no-progress"]))
            assert all(0 <= v <= 100 for v in k["knn_top1"].values())
            assert 0 <= lin["linear_top1"] <= 100
            assert os.path.isfile(runs / run / f"knn_{stem}.json")
            assert os.path.isfile(runs / run / f"linear_{stem}.json")
    sup = otl.load_checkpoint(str(runs / "eurosat_supervised" / "checkpoint.pth"))[0]
    assert sup.cfg.k == 10  # the supervised head has one output per class
    out = tmp_path / "results"
    report.main(report.get_args_parser().parse_args(["--runs", str(runs), "--out", str(out)]))
    md = (out / "eurosat.md").read_text()
    assert "OTL (ours)" in md and "supervised (ours)" in md and "random init (ours)" in md
    assert "94.4" in md  # the paper's row
    js = json.loads((out / "eurosat.json").read_text())
    assert js["otl"]["final"]["knn"] and js["otl"]["random_init"]["linear"] is not None


def test_download_uses_official_source_with_checksum(eurosat_zip, tmp_path, monkeypatch):
    """--download fetches the official archive through torchvision with its md5 (no network here:
    the fetch is replaced by a copy of the local archive), then prepares it like --source."""
    import torchvision.datasets.utils as tvu
    calls = []

    def fake_download(url, root, filename=None, md5=None):
        calls.append((url, filename, md5))
        shutil.copy(eurosat_zip, os.path.join(root, filename))

    monkeypatch.setattr(tvu, "download_url", fake_download)
    man = prep_download(tmp_path)
    (url, filename, md5), = calls
    assert url.startswith("https://") and filename == "EuroSAT.zip" and len(md5) == 32
    assert md5 == prepare_data.DATASETS["eurosat"]["md5"]
    assert man["n_images"] == 10 and man["source"].endswith("EuroSAT.zip")


def prep_download(tmp_path):
    args = prepare_data.get_args_parser().parse_args(
        ["--download", "--download-dir", str(tmp_path / "dl"), "--out", str(tmp_path / "out"),
         "--per-class", "1", "--workers", "1"])
    return prepare_data.main(args)


def test_resume_with_another_model_fails_loudly(small_data, tmp_path):
    train(small_data, tmp_path / "m", "--epochs", "1")
    with pytest.raises(SystemExit, match="different model"):
        train(small_data, tmp_path / "m", "--epochs", "2", "--k", "20")
