"""utils.py: checkpoints and JSON written atomically, the model rebuilt from a checkpoint, resume
checks, the one stratified split, presets and devices, the commit and the argparse helpers."""
import argparse
import dataclasses
import json
import os
import re

import pytest
import torch

import otl
import utils
from conftest import gen


def small_cfg(**kw):
    return otl.ModelConfig(**{"k": 9, "width": 8, "small_stem": True, **kw})


# ------------------------------------------------------------------------------------------------
# checkpoints and JSON
# ------------------------------------------------------------------------------------------------

def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    cfg = small_cfg(mean=(0.4, 0.45, 0.5), std=(0.2, 0.21, 0.22))
    model = otl.build_model(cfg)
    # move the BatchNorm running statistics away from their defaults
    with torch.no_grad():
        model.train()(torch.rand(6, 3, 32, 32, generator=gen(100)))
    model.eval()
    path = str(tmp_path / "ckpt.pt")
    state = {"model": model.state_dict(), "model_cfg": utils.model_state(cfg),
             "args": {"img_size": 32, "data": "somewhere"}, "epoch": 3}
    utils.save_checkpoint(state, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left behind
    loaded, ckpt = utils.load_checkpoint(path)
    assert isinstance(loaded, otl.OTLNet)
    assert ckpt["epoch"] == 3 and ckpt["args"] == {"img_size": 32, "data": "somewhere"}
    assert loaded.cfg == cfg
    x = torch.rand(4, 3, 32, 32, generator=gen(101))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), model(x), rtol=0, atol=0)
        # a fresh network of the same config gives other outputs: the weights were restored
        other = otl.build_model(cfg).eval()
        assert not torch.allclose(other(x), model(x))
    # overwriting keeps a single, updated file
    state["epoch"] = 4
    utils.save_checkpoint(state, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    assert utils.load_checkpoint(path)[1]["epoch"] == 4


def test_load_checkpoint_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nope.pt"):
        utils.load_checkpoint(str(tmp_path / "nope.pt"))


def test_model_state_is_plain_and_rebuilds():
    cfg = small_cfg()
    d = utils.model_state(cfg)
    assert d == dataclasses.asdict(cfg) and otl.ModelConfig(**d) == cfg


def test_write_json_atomic_and_creates_folders(tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    utils.write_json({"x": 1, "y": [1.5, "z"]}, str(path))
    assert json.loads(path.read_text()) == {"x": 1, "y": [1.5, "z"]}
    utils.write_json({"x": 2}, str(path))
    assert json.loads(path.read_text()) == {"x": 2}
    assert sorted(os.listdir(path.parent)) == ["r.json"]
    with pytest.raises(TypeError):              # not JSON: the old file stays whole
        utils.write_json({"x": object()}, str(path))
    assert json.loads(path.read_text()) == {"x": 2}


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------

def _run_state(model, opt, gen_, cfg, args, epoch=2):
    return {"model": model.state_dict(), "model_cfg": utils.model_state(cfg),
            "optimizer": opt.state_dict(), "epoch": epoch, "args": vars(args),
            "pseudo_labels": torch.arange(10).view(1, 10), "world_size": 1,
            "rng_ranks": [{"cpu": torch.get_rng_state(), "gen": gen_.get_state(), "cuda": None}]}


def test_restart_from_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = small_cfg()
    model = otl.build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = gen(3)
    args = argparse.Namespace(k=9, lr=0.1, epochs=5, device="cpu")
    path = str(tmp_path / "checkpoint.pth")
    dev = torch.device("cpu")
    assert utils.restart_from_checkpoint(path, model, opt, g, dev, utils.model_state(cfg), args) == (0, None)
    utils.save_checkpoint(_run_state(model, opt, g, cfg, args), path)
    expect = g.get_state()
    fresh = otl.build_model(cfg)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    g2 = gen(99)
    later = argparse.Namespace(k=9, lr=0.2, epochs=8, device="cpu")   # lr changed: a warning
    epoch, labels = utils.restart_from_checkpoint(path, fresh, opt2, g2, dev,
                                                  utils.model_state(cfg), later)
    assert epoch == 2 and torch.equal(labels, torch.arange(10).view(1, 10))
    assert torch.equal(g2.get_state(), expect)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    out = capsys.readouterr().out
    assert "warning" in out and "'lr': (0.1, 0.2)" in out and "epochs" not in out.split("warning")[1]
    # a checkpoint of another model is refused, saying what differs
    with pytest.raises(SystemExit, match="different model.*'k': \\(9, 12\\)"):
        utils.restart_from_checkpoint(path, fresh, opt2, g2, dev,
                                      utils.model_state(small_cfg(k=12)), later)


# ------------------------------------------------------------------------------------------------
# the stratified split
# ------------------------------------------------------------------------------------------------

def test_stratified_split_properties():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 2 + [3] * 1 + [4] * 7)
    kept, held = utils.stratified_split(labels, 0.2, seed=0)
    assert kept.dtype == held.dtype == torch.long
    assert torch.equal(torch.cat([kept, held]).sort().values, torch.arange(labels.numel()))
    assert torch.equal(kept, kept.sort().values) and torch.equal(held, held.sort().values)
    per = torch.bincount(labels[held], minlength=5).tolist()
    # round(0.2 n) per class, at least one of a class of two or more, never a whole class
    assert per == [10, 6, 1, 0, 1]
    again = utils.stratified_split(labels, 0.2, seed=0)
    other = utils.stratified_split(labels, 0.2, seed=1)
    assert torch.equal(again[1], held) and not torch.equal(other[1], held)
    for frac in (0, 1, -0.5):
        with pytest.raises(ValueError, match="fraction"):
            utils.stratified_split(labels, frac)


# ------------------------------------------------------------------------------------------------
# presets, devices, the commit, flags
# ------------------------------------------------------------------------------------------------

def test_devices():
    cpu = torch.device("cpu")
    assert utils.pick_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert utils.pick_device("auto") == cpu
        with pytest.raises(SystemExit, match="--device cuda asked for, but CUDA is not available"):
            utils.pick_device("cuda")
    with pytest.raises(SystemExit, match="--device gpu: not a device name"):
        utils.pick_device("gpu")


def test_git_commit_and_command_line():
    sha = utils.git_commit()
    assert sha == "unknown" or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", sha)
    assert utils.command_line()


def test_git_commit_is_dirty_for_code_not_for_results(tmp_path, monkeypatch):
    """A study rewrites its tracked results file after every run; the runs after it still ran
    committed code, so only changes outside results/ make the commit "+dirty"."""
    import subprocess

    def git(*cmd):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *cmd], cwd=tmp_path,
                       check=True, capture_output=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "study.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    monkeypatch.setattr(utils, "REPO", str(tmp_path))
    clean = utils.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    (tmp_path / "results" / "study.json").write_text('{"rows": []}')
    assert utils.git_commit() == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert utils.git_commit() == clean + "+dirty"


def test_str2bool():
    assert [utils.str2bool(v) for v in ("true", "1", "Yes", "off", "0", "FALSE")] == \
        [True, True, True, False, False, False]
    with pytest.raises(argparse.ArgumentTypeError):
        utils.str2bool("maybe")


def test_load_prepared_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="run prepare_data.py --out"):
        utils.load_prepared(str(tmp_path))


def test_working_images_resize_a_large_cache_once(small_data):
    """A stage whose network sees `size` px keeps images over twice that at twice it, resized once
    (antialiased), and the rest as prepared; load_prepared(size=...) hands out those images."""
    full = utils.load_prepared(str(small_data))["images"]           # EuroSAT's 64 px
    assert utils.working_size(64, 16) == 32 and utils.working_size(64, 32) == 64
    small = utils.load_prepared(str(small_data), size=16)["images"]
    assert small.shape == (full.shape[0], 3, 32, 32) and small.dtype == torch.uint8
    assert torch.equal(small, utils.working_images(full, 16))
    assert utils.working_images(full, 32) is full
    assert torch.equal(utils.load_prepared(str(small_data), size=40)["images"], full)
    # the test-time view of a resized image is close to the one of the full cache
    gap = (otl.resize_batch(small, 16) - otl.resize_batch(full, 16)).abs()
    assert gap.mean() < 0.01 and gap.max() < 0.1


# ------------------------------------------------------------------------------------------------
# the validation split and bf16 on the CPU
# ------------------------------------------------------------------------------------------------

def test_validation_split_is_recorded_and_derived_alike(small_data, tmp_path):
    """prepare_data.py records a stratified 10 % of the training split as "val"; a folder prepared
    before it did (no "val" in split.json) gets the same rows; a "val" outside the training split
    is one line naming split.json."""
    d = utils.load_prepared(str(small_data))
    sp = json.loads((small_data / "split.json").read_text())
    assert sp["val"] == d["val_idx"].tolist() and sp["val_frac"] == utils.VAL_FRAC
    assert set(sp["val"]) <= set(sp["train"])
    assert torch.bincount(d["labels"][d["val_idx"]]).tolist() == [2] * 10   # 10 % of 16 a class
    assert sorted(d["fit_idx"].tolist() + d["val_idx"].tolist()) == d["train_idx"].tolist()
    old = tmp_path / "old"
    old.mkdir()
    for f in ("cache.pt", "manifest.json"):
        (old / f).symlink_to(small_data / f)
    (old / "split.json").write_text(json.dumps({k: v for k, v in sp.items()
                                                if not k.startswith("val")}))
    assert torch.equal(utils.load_prepared(str(old))["val_idx"], d["val_idx"])
    (old / "split.json").write_text(json.dumps({**sp, "val": sp["test"][:3]}))
    with pytest.raises(ValueError, match=r"split\.json: .*outside its training split"):
        utils.load_prepared(str(old))


def test_bf16_is_refused_where_the_cpus_kernels_are_wrong():
    """ResNet-18 with the ImageNet stem at 16 px gives its last stage a 1 x 1 input to a strided
    convolution, whose bf16 weight gradients oneDNN gets wrong; at 32 px (the cpu preset) none."""
    model = otl.build_model(otl.ModelConfig(k=8, width=8))
    assert not utils.bf16_shapes_ok(model, 16) and utils.bf16_shapes_ok(model, 32)
    assert utils.bf16_shapes_ok(otl.build_model(small_cfg()), 16)     # the small stem keeps 2 x 2
    assert model.training                                              # the check left it so
    assert utils.resolve_amp(None, "cpu") == utils.cpu_bf16() and not utils.resolve_amp(False, "cpu")


def test_measure_labeler_records_each_labeler_by_its_name():
    """utils.measure_labeler, the one timed call of the benchmarks and the studies: each name's
    record on the same Gaussian outputs (N / k not whole): the exact labelers within one of the
    target, the published rules' std after each step, the settings given in the record (the
    authors' published run told from training's), exact's rows solved and read again."""
    n, k = 2001, 20
    O = torch.randn(n, k, generator=gen(5))
    floor = ((n % k) / k * (1 - (n % k) / k)) ** 0.5     # the least std the integers allow
    before = torch.bincount(O.argmax(1), minlength=k).double()
    authors = dict(init="zero", tie_eps=0)
    recs = {m: utils.measure_labeler(O, m) for m in ("exact", "reference", "published", "sinkhorn")}
    recs["authors"] = utils.measure_labeler(O, "published", **authors)
    for name, r in recs.items():
        assert r["method"] == ("published" if name == "authors" else name)
        assert r["settings"] == (authors if name == "authors" else {})
        assert r["seconds"] > 0 and r["iterations"] >= 1 and isinstance(r["stop_reason"], str)
        assert r["std_before"] == pytest.approx((before - n / k).pow(2).mean().sqrt().item())
        assert r["std_max"] == pytest.approx(n * (k - 1) ** 0.5 / k)
        assert r["std"] < r["std_before"]
        assert ("refetched" in r and "active" in r) == (name == "exact")
        json.dumps(r)                                  # a record is JSON as it is
    for name in ("exact", "reference"):
        assert recs[name]["max_minus_min"] <= 1 and recs[name]["std"] == pytest.approx(floor)
    assert 0 < recs["exact"]["active"] <= n and recs["exact"]["refetched"] >= 0
    for name in ("published", "authors"):             # the std after every step, the best kept
        hist = recs[name]["std_history"]
        assert len(hist) >= recs[name]["iterations"] > 1
        assert min(hist) == pytest.approx(recs[name]["std"], abs=1e-4)
    assert recs["authors"]["std_history"] != recs["published"]["std_history"]    # T from 0
    assert "std_history" not in recs["sinkhorn"]
    with pytest.raises(ValueError, match="method must be"):
        utils.measure_labeler(O, "exactly")
