"""Multispectral images from prepare to evaluation: real EuroSAT MS GeoTIFFs (13 bands of uint16)
from ../shared/data kept as they are, bands picked by name and index, C-band models and
augmentation, an RGB backbone inflated to 13 bands, and each kind of bad input stopped with one
line naming the file."""
import io
import zipfile

import numpy as np
import pytest
import torch

import eval_knn
import otl
import prepare_data
import train_otl
import utils
from conftest import prep

tifffile = pytest.importorskip("tifffile")

TINY = ["--width", "8", "--img-size", "16", "--k", "8", "--batch-size", "16", "--preset", "cpu",
        "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def ms(eurosat_ms_zip, tmp_path_factory):
    """4 real EuroSAT MS images a class, every band."""
    out = tmp_path_factory.mktemp("ms") / "all"
    prep(eurosat_ms_zip, out, "--dataset", "eurosat_ms", "--per-class", "4")
    return out


def train(data, out, *extra):
    return train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(data), "--output", str(out), *TINY, *extra]))


def test_the_bands_are_kept_at_16_bits_with_their_statistics(ms, eurosat_ms_zip):
    d, man = utils.open_prepared(str(ms))
    x = d["images"]
    assert x.shape == (40, 13, 64, 64) and x.dtype == torch.uint16
    assert man["channels"] == 13 and man["dtype"] == "uint16" and man["rgb_bands"] == [3, 2, 1]
    assert man["bands"] == list(prepare_data.SENTINEL2) and man["bands"][-1] == "B8A"
    with zipfile.ZipFile(eurosat_ms_zip) as z:
        raw = tifffile.imread(io.BytesIO(z.read(d["files"][0])))          # (64, 64, 13) uint16
    assert torch.equal(x[0], torch.from_numpy(raw.transpose(2, 0, 1).copy()))
    assert int(x.int().max()) > 255                              # not squeezed into 8 bits
    v = x.double() / 65535
    assert torch.allclose(torch.tensor(man["channel_mean"], dtype=torch.float64), v.mean((0, 2, 3)),
                          atol=1e-9)
    assert torch.allclose(torch.tensor(man["channel_std"], dtype=torch.float64), v.std((0, 2, 3)),
                          atol=1e-6)


def test_bands_by_name_and_by_index(ms, eurosat_ms_zip, tmp_path):
    full = utils.load_prepared(str(ms))["images"]
    prep(eurosat_ms_zip, tmp_path / "rgb", "--dataset", "eurosat_ms", "--per-class", "4",
         "--bands", "B04,B03,B02")
    prep(eurosat_ms_zip, tmp_path / "idx", "--per-class", "4", "--bands", "3,2,1")   # folder
    for name in ("rgb", "idx"):
        got = utils.load_prepared(str(tmp_path / name))["images"]
        assert torch.equal(got, full[:, [3, 2, 1]])
    assert utils.load_manifest(str(tmp_path / "rgb"))["rgb_bands"] == [0, 1, 2]
    assert utils.load_manifest(str(tmp_path / "idx"))["bands"] is None


def test_augment_moves_every_band_alike_and_models_take_c_bands():
    x = torch.randint(1, 4000, (4, 1, 24, 24), dtype=torch.int32).to(torch.uint16).repeat(1, 13, 1, 1)
    for strong in (False, True):
        y = otl.augment(x, 16, strong=strong, generator=torch.Generator().manual_seed(0))
        assert y.shape == (4, 13, 16, 16) and torch.isfinite(y).all()
    y = otl.augment(x, 16, jitter=False, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y, y[:, :1].expand_as(y))                 # one warp for all bands
    # bands that are not colour keep their level: no stretch to [0, 1], no posterize to zero
    y = otl.augment(x, 16, strong=True, n_ops=4, cutout=0, generator=torch.Generator().manual_seed(1))
    assert y.max() < 0.2 and (y > 0).float().mean() > 0.9
    for arch, width in (("resnet18", 8), ("alexnet", 8)):
        m = otl.build_model(otl.ModelConfig(arch=arch, width=width, k=4, in_chans=13,
                                            mean=(0.03,) * 13, std=(0.01,) * 13))
        assert m(otl.resize_batch(x, 64)).shape == (4, 4)


def test_old_checkpoints_without_a_band_count_load_as_rgb(tmp_path):
    cfg = otl.ModelConfig(width=8, k=4)
    model = otl.build_model(cfg)
    state = utils.model_state(cfg)
    del state["in_chans"]
    utils.save_checkpoint({"model": model.state_dict(), "model_cfg": state}, str(tmp_path / "c.pth"))
    back, _ = utils.load_checkpoint(str(tmp_path / "c.pth"))
    assert back.cfg.in_chans == 3


def test_inflating_keeps_rgb_on_the_rgb_bands_and_the_sum_over_bands():
    w = torch.randn(8, 3, 3, 3)
    out, line = utils.inflate_first_conv(w, 13, [3, 2, 1], list(prepare_data.SENTINEL2))
    assert out.shape == (8, 13, 3, 3)
    assert torch.allclose(out[:, 3], w[:, 0] * 3 / 13) and torch.allclose(out[:, 1], w[:, 2] * 3 / 13)
    assert torch.allclose(out[:, 0], w.mean(1) * 3 / 13)
    assert torch.allclose(out.sum(1), w.sum(1), atol=1e-6)
    assert "B04,B03,B02 take the R,G,B filters" in line and "3/13" in line
    unnamed, line = utils.inflate_first_conv(w, 5)
    assert torch.allclose(unnamed.sum(1), w.sum(1), atol=1e-6) and "no band is named" in line


def test_train_transfer_and_evaluate_13_bands(ms, small_data, tmp_path, capfd):
    # an RGB backbone (untrained: its weights are what is checked), then 13 bands from it
    train(small_data, tmp_path / "rgb", "--epochs", "0")
    capfd.readouterr()
    train(ms, tmp_path / "ms", "--epochs", "1", "--init", str(tmp_path / "rgb" / "checkpoint.pth"),
          "--label-batch-size", "16")
    err = capfd.readouterr().err
    assert "first conv inflated from RGB to 13 bands: B04,B03,B02 take the R,G,B filters" in err
    src, _ = utils.load_checkpoint(str(tmp_path / "rgb" / "checkpoint.pth"))
    start, ck = utils.load_checkpoint(str(tmp_path / "ms" / "checkpoint0000.pth"))
    assert ck["model_cfg"]["in_chans"] == 13 and ck["data_bands"] == "13 x uint16"
    w, w0 = start.backbone.conv1.weight, src.backbone.conv1.weight
    assert torch.allclose(w[:, 3], w0[:, 0] * 3 / 13) and torch.allclose(w.sum(1), w0.sum(1), atol=1e-5)
    knn = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", str(tmp_path / "ms" / "checkpoint.pth"), "--device", "cpu", "--no-progress",
         "--ks", "10"]))
    assert knn["feat_dim"] == 64 and knn["n_test"] == 10
    # an RGB network on 13 bands: one line saying which bands each has
    with pytest.raises(SystemExit) as e:
        eval_knn.main(eval_knn.get_args_parser().parse_args(
            ["--checkpoint", str(tmp_path / "rgb" / "checkpoint.pth"), "--data", str(ms),
             "--device", "cpu", "--no-progress"]))
    assert "3 x uint8" in str(e.value) and "13 x uint16" in str(e.value)


def _tiffs(folder, arrays):
    """A class-per-folder tree of TIFFs: {"a/x.tif": (H, W, C) array}."""
    for name, a in arrays.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        tifffile.imwrite(folder / name, a, photometric="minisblack", planarconfig="contig")
    return folder


def _good(seed):
    return np.random.default_rng(seed).integers(1, 5000, (8, 8, 13)).astype(np.uint16)


def _stops(src, out, *flags):
    with pytest.raises(SystemExit) as e:
        prep(src, out, *flags)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("bad, words", [
    (np.ones((8, 8, 2), np.uint16), ["a/bad.tif", "2 band(s)", "13"]),
    (np.ones((9, 8, 13), np.uint16), ["a/bad.tif", "8 x 9 pixels"]),
    (np.full((8, 8, 13), np.nan, np.float32), ["a/bad.tif", "64 of its pixels are NaN"]),
    (np.zeros((8, 8, 13), np.uint16), ["a/bad.tif", "no-data", "0 in every band"]),
])
def test_a_bad_tiff_is_one_line_naming_it(tmp_path, bad, words):
    src = _tiffs(tmp_path / "src", {"a/a0.tif": _good(0), "a/bad.tif": bad,
                                    "b/b0.tif": _good(1), "b/b1.tif": _good(2)})
    msg = _stops(src, tmp_path / "out")
    for w in words:
        assert w in msg, msg
    prep(src, tmp_path / "out", "--skip-bad")               # or left out, and listed
    man = utils.load_manifest(str(tmp_path / "out"))
    assert [s["file"] for s in man["skipped"]] == ["a/bad.tif"] and man["channels"] == 13


def test_wrong_data_set_and_missing_band_are_one_line(eurosat_ms_zip, tmp_path):
    msg = _stops(eurosat_ms_zip, tmp_path / "o", "--dataset", "eurosat")
    assert "13-band uint16 TIFF" in msg and "--dataset eurosat_ms" in msg
    msg = _stops(eurosat_ms_zip, tmp_path / "o", "--dataset", "eurosat_ms", "--bands", "B04,B13")
    assert "no band 'B13'" in msg and "B8A" in msg
    msg = _stops(eurosat_ms_zip, tmp_path / "o", "--bands", "B04")          # folder: no names
    assert "no band 'B04'" in msg and "--band-names" in msg
