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
    assert man["n_images"] == 20 and man["source"].endswith("EuroSAT.zip")


def prep_download(tmp_path):
    args = prepare_data.get_args_parser().parse_args(
        ["--dataset", "eurosat", "--download", "--download-dir", str(tmp_path / "dl"), "--out", str(tmp_path / "out"),
         "--per-class", "2", "--workers", "1"])
    return prepare_data.main(args)


# ------------------------------------------------------------------------------------------------
# bad input and damaged caches (each failed before it was fixed)
# ------------------------------------------------------------------------------------------------

def _png(path, array, mode=None):
    from PIL import Image
    import numpy as np
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.asarray(array), mode=mode).save(path)


def _rgb_folder(root, classes=("a", "b"), n=3, size=8):
    g = torch.Generator().manual_seed(0)
    for c in classes:
        for i in range(n):
            _png(root / c / f"{i}.png", torch.randint(0, 256, (size, size, 3), generator=g,
                                                      dtype=torch.uint8).numpy())
    return root


def test_16_bit_images_are_scaled_not_white(tmp_path):
    import numpy as np
    src = tmp_path / "src"
    for c in ("a", "b"):
        for i in range(3):
            grad = (np.arange(64, dtype=np.uint16).reshape(8, 8) * (60 + 10 * i)).astype(np.uint16)
            _png(src / c / f"{i}.png", grad)        # uint16: PIL writes a 16-bit PNG
    man = prep(src, tmp_path / "out")
    imgs = utils.load_prepared(str(tmp_path / "out"))["images"]
    assert man["scaled_to_8_bit"] == 6
    assert int(imgs.min()) == 0 and int(imgs.max()) == 255         # the range is used, not clipped
    assert (imgs == 255).float().mean() < 0.05
    assert torch.equal(imgs[:, 0], imgs[:, 1]) and torch.equal(imgs[:, 1], imgs[:, 2])  # gray


def test_every_image_bad(tmp_path):
    src = tmp_path / "src"
    for c in ("a", "b"):
        os.makedirs(src / c)
        (src / c / "x.png").write_bytes(b"not an image")
    with pytest.raises(SystemExit, match="none of the 2 images"):
        prep(src, tmp_path / "out", "--skip-bad")
    with pytest.raises(SystemExit) as e:
        prep(src, tmp_path / "out")
    assert "BytesIO" not in str(e.value) and "x.png" in str(e.value)


@pytest.mark.parametrize("flag,value", [("--per-class", "0"), ("--per-class", "-1"), ("--size", "0")])
def test_non_positive_sizes_are_refused(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit):
        prep(_rgb_folder(tmp_path / "src"), tmp_path / "out", flag, value)
    assert "positive whole number" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_one_image_per_class_leaves_no_test_split(tmp_path):
    with pytest.raises(SystemExit, match="every class needs at least 2 images"):
        prep(_rgb_folder(tmp_path / "src"), tmp_path / "out", "--per-class", "1")


def test_out_is_a_file_and_source_is_text(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        prep(_rgb_folder(tmp_path / "src"), tmp_path / "f")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SystemExit, match="neither a folder nor a zip"):
        prep(tmp_path / "notes.txt", tmp_path / "out")


def test_zip_with_top_level_images_and_nested_folders(tmp_path):
    src = _rgb_folder(tmp_path / "src")
    z = tmp_path / "loose.zip"
    with zipfile.ZipFile(z, "w") as fh:
        fh.write(src / "a" / "0.png", "0.png")
        fh.write(src / "b" / "0.png", "b/0.png")
    with pytest.raises(SystemExit, match="outside any class folder.*0.png"):
        prep(z, tmp_path / "out")
    # images in subfolders of a class folder belong to that class
    os.makedirs(src / "a" / "more")
    shutil.copy(src / "a" / "1.png", src / "a" / "more" / "9.png")
    man = prep(src, tmp_path / "out2")
    assert man["per_class_counts"] == {"a": 4, "b": 3}


def test_damaged_or_mixed_cache_is_rebuilt(tmp_path):
    src, out = _rgb_folder(tmp_path / "src"), tmp_path / "out"
    prep(src, out)
    cache = out / "cache.pt"
    data = cache.read_bytes()
    cache.write_bytes(data[:len(data) // 2])                 # truncated to half
    prep(src, out)
    assert cache.read_bytes() == data                         # rebuilt, not "up to date"
    split0 = (out / "split.json").read_text()
    # a rebuild with another seed killed after split.json but before the manifest
    import prepare_data
    real = utils.write_json

    def die_at_manifest(obj, path):
        if path.endswith("manifest.json"):
            raise KeyboardInterrupt("killed")
        real(obj, path)
    prepare_data.utils.write_json = die_at_manifest
    try:
        with pytest.raises(KeyboardInterrupt):
            prep(src, out, "--seed", "1")
    finally:
        prepare_data.utils.write_json = real
    assert (out / "split.json").read_text() != split0
    prep(src, out)                                            # seed 0 again: the right split
    assert (out / "split.json").read_text() == split0


def test_a_tiny_first_image_does_not_set_every_images_size(tmp_path, capsys):
    """'folder' takes its images' most common side, not the first file's, and names the odd one."""
    src = _rgb_folder(tmp_path / "src", n=3, size=24)
    _png(src / "a" / "0000_tiny.png", torch.zeros(1, 1, 3, dtype=torch.uint8).numpy())
    man = prep(src, tmp_path / "out")
    assert man["image_size"] == 24 and man["n_images"] == 7
    err = capsys.readouterr().err
    assert "1 of 7 images are not 24 px" in err and "0000_tiny.png 1 px" in err


def test_a_class_in_one_split_only_is_warned_about(tmp_path, capsys):
    src = _rgb_folder(tmp_path / "src", n=4)
    _png(src / "lonely" / "0.png", torch.zeros(8, 8, 3, dtype=torch.uint8).numpy())
    man = prep(src, tmp_path / "out")
    assert any("class lonely has 1 image(s), all in the training split" in w for w in man["warnings"])
    assert "class lonely has 1 image(s)" in capsys.readouterr().err


def test_exif_orientation_is_applied(tmp_path):
    """A photo stored sideways with an EXIF orientation tag is cached as a viewer shows it."""
    from PIL import Image
    import numpy as np
    src = tmp_path / "src"
    top_white = np.zeros((16, 16, 3), dtype=np.uint8)
    top_white[:8] = 255
    for c in ("a", "b"):
        for i in range(2):
            os.makedirs(src / c, exist_ok=True)
            exif = Image.Exif()
            exif[0x0112] = 6        # orientation: rotate 90 degrees clockwise to show
            Image.fromarray(top_white).save(src / c / f"{i}.jpg", exif=exif, quality=95)
    prep(src, tmp_path / "out")
    img = utils.load_prepared(str(tmp_path / "out"))["images"][0].float()   # (3, 16, 16)
    # rotated clockwise, the white top half is the right half
    assert img[:, :, 8:].mean() > 200 and img[:, :, :8].mean() < 50
