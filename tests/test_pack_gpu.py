"""bench/pack_gpu.py: the pieces join back into the archive byte for byte, the small archive
takes the first images of each class, the re-encoded copy keeps names and order, and the
manifest says what each file is."""
import hashlib
import io
import json
import os
import sys
import zipfile

import pytest
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import pack_gpu  # noqa: E402


def pack(*argv):
    return pack_gpu.main(pack_gpu.get_args_parser().parse_args(list(argv)))


@pytest.fixture
def archive(eurosat_zip, tmp_path):
    """A small archive in EuroSAT's layout: the real archive's first 3 images of 4 classes."""
    path = tmp_path / "EuroSAT_part.zip"
    taken = {}
    with zipfile.ZipFile(eurosat_zip) as zin, zipfile.ZipFile(path, "w") as zout:
        for name in sorted(zin.namelist()):
            cls = os.path.dirname(name)
            if name.endswith(".jpg") and (cls in taken or len(taken) < 4) and taken.get(cls, 0) < 3:
                zout.writestr(name, zin.read(name))
                taken[cls] = taken.get(cls, 0) + 1
    return path


def test_pieces_join_into_the_archive_and_the_small_archive_takes_each_class_first(archive, tmp_path):
    out = tmp_path / "g"
    pack("--out", str(out), "--eurosat", str(archive), "--piece-mb", "0.012", "--small-per-class", "2")
    pieces = sorted(p for p in os.listdir(out) if p.startswith("eu_part_"))
    assert len(pieces) >= 2 and pieces[:2] == ["eu_part_aa", "eu_part_ab"]
    assert all(os.path.getsize(out / p) <= 12_000 for p in pieces)
    assert b"".join((out / p).read_bytes() for p in pieces) == archive.read_bytes()
    with zipfile.ZipFile(archive) as z:
        want = {}
        for n in sorted(z.namelist()):
            want.setdefault(os.path.dirname(n), []).append(n)
    with zipfile.ZipFile(out / "EuroSAT_small.zip") as z:
        assert sorted(z.namelist()) == sorted(n for names in want.values() for n in names[:2])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["EuroSAT_small.zip"]["images"] == 8
    assert manifest["eu_part_aa"]["archive_sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert manifest["eu_part_ab"]["sha256"] == hashlib.sha256((out / "eu_part_ab").read_bytes()).hexdigest()


def test_reencoded_copy_keeps_classes_names_and_order_and_records_its_loss(archive, tmp_path):
    src = tmp_path / "siri"                       # class folders of TIFFs, as SIRI-WHU's
    with zipfile.ZipFile(archive) as z:
        for i, name in enumerate(sorted(z.namelist())[:6]):
            cls = src / ("b_class" if i < 3 else "a_class")
            cls.mkdir(parents=True, exist_ok=True)
            Image.open(io.BytesIO(z.read(name))).save(cls / f"{i:04d}.tif")
    (src / "a_class" / ".DS_Store").write_bytes(b"")
    out = tmp_path / "g"
    pack("--out", str(out), "--siri-whu", str(src), "--quality", "90")
    with zipfile.ZipFile(out / "siri_whu.zip") as z:
        names = z.namelist()
        assert names == ["a_class/0003.jpg", "a_class/0004.jpg", "a_class/0005.jpg",
                         "b_class/0000.jpg", "b_class/0001.jpg", "b_class/0002.jpg"]
        back = Image.open(io.BytesIO(z.read(names[0])))
        assert back.format == "JPEG" and back.size == Image.open(src / "a_class" / "0003.tif").size
    rec = json.loads((out / "manifest.json").read_text())["siri_whu.zip"]
    assert rec["images"] == 6 and rec["quality"] == 90 and 0 < rec["mean_abs_pixel_error"] < 5
    # a later call adds to the manifest and keeps what the earlier one recorded
    pack("--out", str(out), "--hmhr", str(archive), "--cifar10", str(archive))
    assert (out / "cifar10_jpg.zip").read_bytes() == archive.read_bytes()
    assert set(json.loads((out / "manifest.json").read_text())) == {
        "siri_whu.zip", "HMHR.zip", "cifar10_jpg.zip"}


def test_nothing_to_pack_and_a_folder_without_classes_fail(tmp_path):
    with pytest.raises(SystemExit, match="nothing to pack"):
        pack("--out", str(tmp_path / "g"))
    (tmp_path / "flat").mkdir()
    with pytest.raises(SystemExit, match="no class folders"):
        pack("--out", str(tmp_path / "g"), "--siri-whu", str(tmp_path / "flat"))
