"""prepare_data.py's registry of the paper's data sets: each entry prepared from a small source made
here in that data set's real layout (class folders in a zip or a folder, train/ and test/ or val/
folders, CIFAR's pickles, SVHN's .mat files), the real CIFAR-10 and HMHR archives, exact
duplicates, and the refusals."""
import json
import os
import pickle
import tarfile
import zipfile

import numpy as np
import pytest
import torch

import prepare_data
import utils
from conftest import ROOT, prep

SHARED = os.path.join(ROOT, "..", "shared", "data")
REG = prepare_data.DATASETS


def _img(path, size, seed, fmt=None):
    from PIL import Image
    os.makedirs(os.path.dirname(path), exist_ok=True)
    w, h = size if isinstance(size, tuple) else (size, size)
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(a).save(path, format=fmt)


def _tree(root, layout, classes, n, size, ext):
    """n images per class at root/layout.format(cls=class, i=index) + ext; returns root."""
    seed = 0
    for c in classes:
        for i in range(n):
            seed += 1
            _img(os.path.join(root, layout.format(cls=c, i=i) + ext), size, seed)
    return root


def _zip(folder, path):
    with zipfile.ZipFile(path, "w") as z:
        for r, _, files in os.walk(folder):
            for f in files:
                full = os.path.join(r, f)
                z.write(full, os.path.relpath(full, folder))
    return path


def _prep_ds(dataset, src, out, *extra):
    return prep(src, out, "--dataset", dataset, *extra)


def test_registry_counts_agree_with_the_data_sets_totals():
    totals = {"eurosat": 27000, "ucmerced": 2100, "siri_whu": 2400, "aid": 10000,
              "patternnet": 30400, "nwpu_resisc45": 31500, "hmhr": 533, "cifar10": 50000,
              "cifar100": 50000, "svhn": 73257}
    for name, spec in REG.items():
        assert set(spec["per_class"]) == set(spec["classes"]), name
        assert spec["split"] in ("official", "random")
        if name in totals:
            assert sum(spec["per_class"].values()) == totals[name], name
            assert len(set(map(prepare_data._normal, spec["classes"]))) == len(spec["classes"])
    assert len(REG["cifar100"]["classes"]) == 100 and len(REG["nwpu_resisc45"]["classes"]) == 45


# each remote-sensing entry in the layout of its official archive (folders as the archive has
# them), 2 images per class, at the data set's native size (UC Merced with one odd-sized image)
RS_LAYOUTS = {
    "ucmerced": ("UCMerced_LandUse/Images/{cls}/{cls}{i:02d}", ".tif", "zip"),
    "siri_whu": ("Google dataset of SIRI-WHU_earth_im_tiff/12class_tif/{cls}/{i:04d}", ".tif", "dir"),
    "aid": ("AID/{cls}/{cls}_{i}", ".jpg", "dir"),
    "patternnet": ("PatternNet/images/{cls}/{cls}{i:03d}", ".jpg", "zip"),
    "nwpu_resisc45": ("NWPU-RESISC45/{cls}/{cls}_{i:03d}", ".jpg", "dir"),
}


@pytest.mark.parametrize("name", list(RS_LAYOUTS))
def test_remote_sensing_entries_in_their_layout(name, tmp_path):
    layout, ext, kind = RS_LAYOUTS[name]
    spec = REG[name]
    side = min(spec["native"], 48)      # small pictures: the layout is what is tested
    src = _tree(tmp_path / "src", layout, spec["classes"], 2, side, ext)
    if name == "ucmerced":               # UC Merced has images that are not square
        _img(os.path.join(src, layout.format(cls=spec["classes"][0], i=2) + ext), (side, side - 5), 99)
    if kind == "zip":
        src = _zip(src, tmp_path / "src.zip")
    man = _prep_ds(name, src, tmp_path / "out")
    assert man["classes"] == sorted(spec["classes"]) and man["split"] == "random"
    assert man["image_size"] == spec["size"] and man["native_size"] == spec["native"]
    # the classes are the registry's; only the counts differ from the real set's
    assert not any("classes differ" in n for n in man["registry_notes"])
    assert any("another number" in n for n in man["registry_notes"])
    d = utils.load_prepared(str(tmp_path / "out"))
    assert d["images"].shape[1:] == (3, spec["size"], spec["size"])
    assert len(d["train_idx"]) + len(d["test_idx"]) == man["n_images"]


def test_wrong_dataset_is_named_in_the_notes(tmp_path, capsys):
    src = _tree(tmp_path / "src", "{cls}/{i}", ["cats", "dogs"], 2, 16, ".png")
    man = _prep_ds("ucmerced", src, tmp_path / "out")
    assert any("classes differ" in n and "--dataset folder" in n for n in man["registry_notes"])
    assert "classes differ" in capsys.readouterr().err


def test_official_split_from_train_and_val_folders_imagenet_layout(tmp_path):
    src = tmp_path / "ILSVRC"
    for part, n in (("train", 3), ("val", 2)):
        _tree(src, part + "/{cls}/{cls}_{i}", ["n01440764", "n01443537"], n, 40, ".JPEG")
    man = _prep_ds("imagenet", src, tmp_path / "out")
    assert man["split"] == "official" and man["n_train"] == 6 and man["n_test"] == 4
    assert man["classes"] == ["n01440764", "n01443537"] and man["image_size"] == 64
    d = utils.load_prepared(str(tmp_path / "out"))
    assert all(d["files"][i].startswith("train/") for i in d["train_idx"].tolist())
    assert all(d["files"][i].startswith("val/") for i in d["test_idx"].tolist())
    split = json.loads((tmp_path / "out" / "split.json").read_text())
    assert split["split"] == "official"
    # the same tree, split at random on request
    man = _prep_ds("imagenet", src, tmp_path / "out2", "--split", "random")
    assert man["split"] == "random" and man["n_train"] + man["n_test"] == 10


def test_official_split_asked_of_a_source_without_one(tmp_path):
    src = _tree(tmp_path / "src", "{cls}/{i}", ["a", "b"], 3, 16, ".png")
    with pytest.raises(SystemExit, match="no train / test parts"):
        prep(src, tmp_path / "out", "--split", "official")


def _cifar_files(root, classes, hundred=False, n=4):
    """CIFAR's python pickles in their official names (n images per class in each part)."""
    rng = np.random.default_rng(0)
    key = b"fine_labels" if hundred else b"labels"

    def batch(m):
        y = [i % len(classes) for i in range(m)]
        return {key: y, b"data": rng.integers(0, 256, (m, 3072), dtype=np.uint8)}
    os.makedirs(root)
    if hundred:
        files = {"train": batch(n * len(classes)), "test": batch(n * len(classes)),
                 "meta": {b"fine_label_names": [c.encode() for c in classes]}}
    else:
        files = {f"data_batch_{i}": batch(n * len(classes) // 5 * 5 // 5) for i in range(1, 6)}
        files.update(test_batch=batch(n * len(classes)),
                     **{"batches.meta": {b"label_names": [c.encode() for c in classes]}})
    for f, obj in files.items():
        with open(os.path.join(root, f), "wb") as fh:
            pickle.dump(obj, fh)
    return root


def test_cifar10_pickles_in_the_official_tar_gz(tmp_path):
    folder = _cifar_files(tmp_path / "cifar-10-batches-py", REG["cifar10"]["classes"])
    tgz = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(folder, arcname="cifar-10-batches-py")
    man = _prep_ds("cifar10", tgz, tmp_path / "out")
    assert man["split"] == "official" and man["image_size"] == 32
    assert man["n_train"] == 5 * 8 and man["n_test"] == 40
    assert man["classes"] == list(REG["cifar10"]["classes"])      # the pickles' order kept
    d = utils.load_prepared(str(tmp_path / "out"))
    raw = pickle.load(open(folder / "test_batch", "rb"))
    first_test = d["test_idx"][0].item()
    assert torch.equal(d["images"][first_test], torch.from_numpy(raw[b"data"][0].reshape(3, 32, 32)))
    assert d["labels"][first_test].item() == raw[b"labels"][0]


def test_cifar100_pickles_folder_and_a_larger_size(tmp_path):
    folder = _cifar_files(tmp_path / "cifar-100-python", REG["cifar100"]["classes"], hundred=True, n=1)
    man = _prep_ds("cifar100", folder, tmp_path / "out", "--size", "40")
    assert man["split"] == "official" and man["n_train"] == 100 and man["n_test"] == 100
    assert len(man["classes"]) == 100 and man["image_size"] == 40
    assert not any("classes differ" in n for n in man["registry_notes"])


def test_a_crafted_pickle_is_refused(tmp_path):
    folder = _cifar_files(tmp_path / "cifar-10-batches-py", REG["cifar10"]["classes"])

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    with open(folder / "data_batch_1", "wb") as fh:
        pickle.dump({b"labels": [0], b"data": Payload()}, fh)
    with pytest.raises(SystemExit, match="builds posix.system|builds os.system"):
        _prep_ds("cifar10", folder, tmp_path / "out")
    assert not (tmp_path / "pwned").exists()


def test_svhn_mat_files(tmp_path):
    from scipy.io import savemat
    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "svhn")
    for f, m in (("train_32x32.mat", 30), ("test_32x32.mat", 20)):
        y = (np.arange(m) % 10 + 1).reshape(-1, 1)            # SVHN's labels: 1 .. 10, 10 is '0'
        savemat(tmp_path / "svhn" / f, {"X": rng.integers(0, 256, (32, 32, 3, m), dtype=np.uint8),
                                        "y": y.astype(np.uint8)})
    man = _prep_ds("svhn", tmp_path / "svhn", tmp_path / "out")
    assert man["split"] == "official" and man["n_train"] == 30 and man["n_test"] == 20
    d = utils.load_prepared(str(tmp_path / "out"))
    assert d["classes"] == [str(i) for i in range(10)]
    assert sorted(set(d["labels"].tolist())) == list(range(10))
    x = d["images"][d["test_idx"][0]]
    assert x.shape == (3, 32, 32) and x.dtype == torch.uint8


def test_generic_folder_takes_its_own_size(tmp_path):
    src = _tree(tmp_path / "src", "{cls}/{i}", ["x", "y", "z"], 3, 24, ".bmp")
    man = _prep_ds("folder", src, tmp_path / "out")
    assert man["image_size"] == 24 and man["classes"] == ["x", "y", "z"]
    assert man["registry_notes"] == []


def test_duplicates_counted_and_dropped(tmp_path):
    src = _tree(tmp_path / "src", "{cls}/{i}", ["a", "b"], 4, 16, ".png")
    import shutil
    shutil.copy(src / "a" / "0.png", src / "a" / "9.png")            # same bytes, one class
    _img(str(src / "a" / "8.png"), 16, 1, fmt="BMP")                 # a/0's pixels as BMP... (seed 1)
    os.rename(src / "a" / "8.png", src / "a" / "8.bmp")
    shutil.copy(src / "b" / "1.png", src / "a" / "7.png")            # the same image in two classes
    man = _prep_ds("folder", src, tmp_path / "out")
    dup = man["duplicates"]
    assert dup["files"] == 11 and dup["distinct"] == 8 and man["n_images"] == 11
    assert sorted(map(sorted, dup["groups"])) == [["a/0.png", "a/8.bmp", "a/9.png"],
                                                   ["a/7.png", "b/1.png"]]
    assert dup["cross_class"] == [["a/7.png", "b/1.png"]] or dup["cross_class"] == [["b/1.png", "a/7.png"]]
    man = _prep_ds("folder", src, tmp_path / "out2", "--drop-duplicates")
    # one copy of a/0 stays; both copies of the cross-class image go
    assert man["n_images"] == 11 - 2 - 2 and sorted(man["duplicates"]["dropped"]) == [
        "a/7.png", "a/8.bmp", "a/9.png", "b/1.png"]


@pytest.fixture
def shared(name):
    path = os.path.join(SHARED, name)
    if not os.path.isfile(path):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing (CI must have ../shared/data beside the checkout)")
        pytest.skip(f"{path} is missing")
    return path


@pytest.mark.parametrize("name", ["HMHR.zip"])
def test_real_hmhr_archive_and_its_duplicates(shared, tmp_path):
    man = _prep_ds("hmhr", shared, tmp_path / "out")
    assert man["n_images"] == 533 and man["image_size"] == 256 and man["registry_notes"] == []
    dup = man["duplicates"]
    assert dup["distinct"] == 496 and len(dup["cross_class"]) == 4
    assert all({f.split("/")[-2] for f in g} == {"Greenbelt", "Water"} for g in dup["cross_class"])
    man = _prep_ds("hmhr", shared, tmp_path / "out2", "--drop-duplicates")
    assert man["n_images"] == 533 - 33 - 8


@pytest.mark.parametrize("name", ["cifar10_jpg.zip"])
def test_real_cifar10_archive_official_split(shared, tmp_path):
    man = _prep_ds("cifar10", shared, tmp_path / "out", "--per-class", "5")
    assert man["split"] == "official" and man["n_train"] == 50 and man["n_test"] == 50
    assert man["classes"] == sorted(REG["cifar10"]["classes"]) and man["image_size"] == 32
    d = utils.load_prepared(str(tmp_path / "out"))
    assert all(d["files"][i].startswith("train/") for i in d["train_idx"].tolist())
    assert d["images"].float().std() > 10


def test_download_without_a_checksummed_source_is_refused(tmp_path):
    args = prepare_data.get_args_parser().parse_args(
        ["--dataset", "ucmerced", "--download", "--download-dir", str(tmp_path), "--out",
         str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="no official download with a published checksum"):
        prepare_data.main(args)


def test_grayscale_palette_cmyk_and_four_band_images_become_rgb(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    for c in ("a", "b"):
        os.makedirs(src / c)
        rgb = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
        rgb.convert("L").save(src / c / "gray.png")
        rgb.convert("P").save(src / c / "palette.png")
        rgb.convert("CMYK").save(src / c / "cmyk.jpg")
        rgb.convert("RGBA").save(src / c / "four_band.tif")
    man = prep(src, tmp_path / "out")
    assert man["n_images"] == 8 and man["skipped"] == []
    imgs = utils.load_prepared(str(tmp_path / "out"))["images"]
    assert imgs.shape == (8, 3, 20, 20) and imgs.float().std() > 10


def test_registry_counts_are_checked_before_duplicates_are_dropped(tmp_path):
    spec = REG["hmhr"]
    src = _tree(tmp_path / "src", "RS Image Dataset/{cls}/{cls}{i}", spec["classes"], 2, 16, ".jpg")
    import shutil
    first = os.path.join(src, "RS Image Dataset", "Water", "Water0.jpg")
    shutil.copy(first, os.path.join(src, "RS Image Dataset", "Water", "Water9.jpg"))
    a = _prep_ds("hmhr", src, tmp_path / "a")
    b = _prep_ds("hmhr", src, tmp_path / "b", "--drop-duplicates")
    assert a["registry_notes"] == b["registry_notes"]          # the same source, the same notes
    assert b["n_images"] == a["n_images"] - 1


def test_a_tar_of_images_says_to_unpack_it(tmp_path):
    src = _tree(tmp_path / "src", "{cls}/{i}", ["a", "b"], 2, 16, ".png")
    with tarfile.open(tmp_path / "imgs.tar", "w") as t:
        t.add(src, arcname="imgs")
    with pytest.raises(SystemExit, match="unpack other archives"):
        prep(tmp_path / "imgs.tar", tmp_path / "out")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no images"):
        prep(tmp_path / "empty", tmp_path / "out2")
