"""prepare_data.py on the real EuroSAT archive and on folders: the cache, the split, the manifest,
reuse of a valid cache, bad images and bad sources, and --download."""
import json
import os
import shutil
import zipfile

import pytest
import torch

import prepare_data
import utils
from conftest import PER_CLASS, prep


def test_prepare_real_archive(small_data):
    man = json.loads((small_data / "manifest.json").read_text())
    assert man["n_images"] == 10 * PER_CLASS
    assert set(man["per_class_counts"].values()) == {PER_CLASS}
    assert man["classes"][0] == "AnnualCrop" and len(man["classes"]) == 10
    assert man["checksum"].startswith("sha256:") and man["image_size"] == 64
    d = utils.load_prepared(str(small_data))
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
    assert utils.load_prepared(str(tmp_path / "out"))["images"].shape[-1] == 32


def test_prepare_rejects_bad_source(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises((SystemExit, ValueError), match="neither a folder nor a zip"):
        prep(tmp_path / "x.txt", tmp_path / "out")
    with pytest.raises(SystemExit, match="does not exist"):
        prep(tmp_path / "nope.zip", tmp_path / "out")


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
