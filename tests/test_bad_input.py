"""Bad input and crafted files, each found by trying the code: every case here failed (ran a
payload, crashed with another library's error, or went on silently) before it was fixed."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

import otl
import otl_scale
import utils
from evalkit import untrained_checkpoint
from conftest import gen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------
# loading never runs code
# ------------------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this runs a command that writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo ran > {self.marker}",))


def _crafted(path, marker, base=None):
    obj = dict(base or {})
    obj["x"] = _Payload(str(marker))
    with open(path, "wb") as fh:
        pickle.dump(obj, fh)


def _eval_knn(*argv):
    return subprocess.run([sys.executable, "eval_knn.py", *argv, "--device", "cpu", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def _eval_main(script, *argv):
    """eval_knn.py's or eval_linear.py's main in this process, as its command line would call it
    (a refusal is a SystemExit carrying the message a user sees, never another exception)."""
    mod = __import__(script)
    return mod.main(mod.get_args_parser().parse_args([*argv, "--device", "cpu", "--no-progress"]))


def test_crafted_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "evil.pth"
    _crafted(ckpt, marker)
    p = _eval_knn("--checkpoint", str(ckpt))
    assert p.returncode != 0 and not marker.exists()
    assert "refusing to load" in p.stderr
    with pytest.raises(ValueError, match="refusing to load"):
        utils.load_checkpoint(str(ckpt))
    assert not marker.exists()


def test_crafted_data_cache_and_feature_cache_are_refused(tmp_path):
    ckpt, data_dir, _, _ = untrained_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    # a feature file beside a clean checkpoint, made to match the cache key
    feats = tmp_path / "run" / "features_checkpoint.pt"
    _crafted(feats, marker)
    with pytest.raises(SystemExit, match="refusing to load"):
        _eval_main("eval_knn", "--checkpoint", ckpt)
    assert not marker.exists()
    os.remove(feats)
    cache = data_dir / "cache.pt"
    _crafted(cache, marker)
    with pytest.raises(SystemExit, match="refusing to load"):
        _eval_main("eval_knn", "--checkpoint", ckpt)
    assert not marker.exists()


def test_clean_files_still_load(tmp_path):
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    model, ck = utils.load_checkpoint(ckpt)
    assert ck["epoch"] == 0 and isinstance(model, otl.OTLNet)
    d = utils.load_prepared(str(data_dir))
    assert d["images"].shape[0] == n_train + n_test


# ------------------------------------------------------------------------------------------------
# otl's inputs
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x", [1000.0, 1e6])
def test_uneven_target_extreme_exponent(x):
    t = otl.uneven_target(5000, 50, x)
    assert int(t.sum()) == 5000 and torch.isfinite(t).all()
    assert t[-1] == 5000      # i**x for huge x: everything in the last cluster


@pytest.mark.parametrize("x", [float("nan"), float("inf"), "2"])
def test_uneven_target_bad_exponent(x):
    with pytest.raises(ValueError, match="x must be a finite number"):
        otl.uneven_target(5000, 50, x)


@pytest.mark.parametrize("translate", [otl.translate, otl_scale.translate])
@pytest.mark.parametrize("method", ["exact", "published"])
@pytest.mark.parametrize("target", ["abc", {"a": 1}, [[1, 2], [3, 4]]])
def test_translate_target_not_numbers(target, method, translate):
    with pytest.raises(ValueError, match="target"):
        translate(torch.randn(100, 4, generator=gen(0)), target=target, method=method)


@pytest.mark.parametrize("k", [2.5, "10", True, None])
def test_streaming_translator_k_must_be_an_integer(k):
    with pytest.raises(ValueError, match="k must be an integer"):
        otl_scale.StreamingTranslator(k, distributed=False)


@pytest.mark.parametrize("bad", [5, -1])
def test_lct_loss_label_out_of_range(bad):
    logits = torch.randn(2, 4, 5)
    labels = torch.zeros(2, 4, dtype=torch.long)
    labels[1, 2] = bad
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        otl.lct_loss(logits, labels)
    with pytest.raises(ValueError, match="integer"):
        otl.lct_loss(logits, labels.float())


@pytest.mark.parametrize("method", ["exact", "published"])
def test_translate_refuses_integer_outputs(method):
    with pytest.raises(ValueError, match="floating point"):
        otl.translate(torch.randint(0, 10, (100, 4), generator=gen(1)), method=method)


@pytest.mark.parametrize("method", ["exact", "published"])
def test_one_huge_outlier_does_not_swamp_the_tie_break(method):
    """A single 1e8 among randn outputs: the tie-break must stay below the gaps that matter, so
    labels are argmax(O - T) outside near-ties, as without the outlier."""
    O = torch.randn(2000, 20, generator=gen(2))
    O[17, 3] = 1e8
    r = otl.translate(O, method=method)
    Z = O.double() - r.T
    top = Z.topk(2, dim=1).values
    clear = top[:, 0] - top[:, 1] > 1e-4
    assert clear.float().mean() > 0.95
    assert torch.equal(Z.argmax(1)[clear], r.labels[clear])


# ------------------------------------------------------------------------------------------------
# evaluation on degenerate splits
# ------------------------------------------------------------------------------------------------

def test_linear_probe_one_training_image_per_class():
    import eval_linear
    X, y = torch.randn(3, 4, generator=gen(3)), torch.arange(3)
    with pytest.raises(ValueError, match="at least 2 training images of every class"):
        eval_linear.linear_probe(X, y, torch.randn(3, 4), torch.arange(3))
    # one weight decay: nothing to choose, so no validation part is needed
    r = eval_linear.linear_probe(X, y, X, y, grid=(1e-3,))
    assert r["linear_top1"] == 100.0 and r["val_top1"] is None
    json.dumps(r, allow_nan=False)


def test_empty_test_split_says_so(tmp_path):
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    split = json.loads((data_dir / "split.json").read_text())
    split["train"], split["test"] = sorted(split["train"] + split["test"]), []
    (data_dir / "split.json").write_text(json.dumps(split))
    for script in ("eval_knn", "eval_linear"):
        with pytest.raises(SystemExit, match="test split.*empty|empty.*test split"):
            _eval_main(script, "--checkpoint", ckpt)


def test_feature_cache_follows_the_checkpoint_content(tmp_path):
    """A checkpoint replaced by another of the same size and mtime must not reuse the cache."""
    ckpt, data_dir, _, _ = untrained_checkpoint(tmp_path)
    a = utils.checkpoint_features(ckpt, progress=False)
    st = os.stat(ckpt)
    ck = utils.load_file(ckpt)
    for v in ck["model"].values():
        if v.is_floating_point():
            v.mul_(-1.0)        # same size, other weights
    utils.save_checkpoint(ck, ckpt)
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(ckpt) == st.st_size
    b = utils.checkpoint_features(ckpt, progress=False)
    assert not torch.equal(a["train"], b["train"])


# ------------------------------------------------------------------------------------------------
# which data a checkpoint is evaluated on; what results files record
# ------------------------------------------------------------------------------------------------

def _train_tiny(data, out, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_otl.py"), "--data", data,
                           "--output", out, "--width", "8", "--img-size", "16", "--k", "16",
                           "--batch-size", "32", "--epochs", "1", "--preset", "cpu", "--device",
                           "cpu", "--no-progress"], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_checkpoint_knows_its_data_set(small_data, tmp_path, monkeypatch):
    work = tmp_path / "work"
    os.makedirs(work)
    shutil.copytree(small_data, work / "data")
    p = _train_tiny("data", "run", work)                       # a relative --data
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((work / "run" / "results.json").read_text())
    assert res["command"].startswith("python ") and "--data data" in res["command"]

    def knn(cwd, *extra):
        monkeypatch.chdir(cwd)
        return _eval_main("eval_knn", "--checkpoint", str(work / "run" / "checkpoint.pth"), *extra)
    # run from elsewhere: the relative data path leads nowhere; the message says to pass --data
    with pytest.raises(SystemExit, match="pass --data"):
        knn(tmp_path)
    assert knn(tmp_path, "--data", str(work / "data"))["n_test"] > 0
    # another data set at the same relative path is refused, not silently evaluated
    other = tmp_path / "other"
    os.makedirs(other)
    _, _, _, _ = untrained_checkpoint(other)           # a 3-class prepared set in other/data
    shutil.rmtree(work / "data")
    shutil.copytree(other / "data", work / "data")
    with pytest.raises(SystemExit, match="is not the data set"):
        knn(work)


def test_results_paths_are_relative_to_the_repository():
    assert utils.rel_path(os.path.join(ROOT, "runs", "x", "checkpoint.pth")) == \
        os.path.join("runs", "x", "checkpoint.pth")
    assert utils.rel_path("/elsewhere/ckpt.pth") == "/elsewhere/ckpt.pth"
    assert utils.command_line().startswith("python ")
    assert sys.executable not in utils.command_line()
