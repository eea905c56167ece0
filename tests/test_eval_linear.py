"""eval_linear.py: the probe on toy features (weight decay chosen on validation data only), and
the program on a tiny prepared data set, reading the features eval_knn.py cached."""
import json

import torch

import eval_knn
import eval_linear
import utils
from evalkit import untrained_checkpoint


def _separable(n, seed, D=8):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D, generator=g) * 3 + 5  # offset and scale: standardisation must cope
    Wt = torch.zeros(3, D)
    Wt[0, 0], Wt[1, 1], Wt[2, :2] = 1.0, 1.0, -1.0  # three classes split by two directions
    y = ((X - 5) @ Wt.T).argmax(1)
    return X, y


def test_linear_probe_separable_and_split():
    Xtr, ytr = _separable(600, seed=0)
    Xte, yte = _separable(300, seed=1)
    r = eval_linear.linear_probe(Xtr, ytr, Xte, yte, grid=(1e-4, 1e-2, 1.0), val_frac=0.2,
                                 seed=0, max_iter=200)
    assert r["linear_top1"] > 95 and r["val_top1"] > 90
    assert r["chosen"]["weight_decay"] in (1e-4, 1e-2, 1.0)
    assert set(r["grid"]) == {"0.0001", "0.01", "1"}
    assert r["n_fit"] + r["n_val"] == 600 and 100 <= r["n_val"] <= 140
    fit, held = utils.stratified_split(ytr, 0.2, seed=0)
    assert len(set(fit.tolist()) & set(held.tolist())) == 0 and fit.numel() + held.numel() == 600
    for c in range(3):  # stratified: each class keeps its share in the held-out part
        frac = (ytr[held] == c).sum().item() / (ytr == c).sum().item()
        assert abs(frac - 0.2) < 0.02


def test_linear_probe_choice_ignores_test_split():
    # noisy labels so that the weight decays really score differently on validation data
    Xtr, ytr = _separable(400, seed=2)
    g = torch.Generator().manual_seed(3)
    flip = torch.rand(400, generator=g) < 0.25
    ytr = torch.where(flip, torch.randint(0, 3, (400,), generator=g), ytr)
    Xte, yte = _separable(200, seed=4)
    kw = dict(grid=(1e-4, 1e-2, 1.0), val_frac=0.25, seed=0, max_iter=200)
    a = eval_linear.linear_probe(Xtr, ytr, Xte, yte, **kw)
    b = eval_linear.linear_probe(Xtr, ytr, -3 * Xte + 7, yte.flip(0), **kw)  # other test data
    c = eval_linear.linear_probe(Xtr, ytr, Xte[:10] * 0, yte[:10], **kw)
    assert a["chosen"] == b["chosen"] == c["chosen"]
    assert a["grid"] == b["grid"] == c["grid"] and a["val_top1"] == b["val_top1"]
    assert len(set(a["grid"].values())) > 1  # the choice was a real one
    # best validation score, ties to the larger weight decay
    best = max(a["grid"].values())
    assert a["chosen"]["weight_decay"] == max(float(v) for v, s in a["grid"].items() if s == best)
    assert a["linear_top1"] != b["linear_top1"]  # the test data is used, for scoring only


def test_eval_linear_program_reuses_cached_features(tmp_path, monkeypatch):
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--ks", "3", "--device", "cpu", "--no-progress"]))
    run = tmp_path / "run"
    cache = run / "features_checkpoint.pt"
    stamp = cache.stat().st_mtime_ns

    # the second program must reuse the cached features, not run the network again
    def no_extraction(*a, **k):
        raise AssertionError("features were extracted again instead of read from the cache")
    monkeypatch.setattr(utils.otl, "extract_features", no_extraction)
    out_lin = tmp_path / "elsewhere" / "lin.json"
    args = eval_linear.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--data", str(data_dir), "--device", "cpu", "--val-frac", "0.2",
         "--max-iter", "50", "--output", str(out_lin), "--no-progress"])
    eval_linear.main(args)
    assert cache.stat().st_mtime_ns == stamp
    saved = json.loads(out_lin.read_text())
    assert 0 <= saved["linear_top1"] <= 100 and 0 <= saved["val_top1"] <= 100
    assert saved["chosen"]["weight_decay"] in eval_linear.DEFAULT_WD_GRID
    assert len(saved["grid"]) == len(eval_linear.DEFAULT_WD_GRID)
    for key in ("checkpoint", "epoch", "data_dir", "n_train", "n_test", "command", "git_commit",
                "seconds"):
        assert key in saved
    assert not (run / "linear_checkpoint.json").exists()  # --output was honoured


def test_eval_linear_on_the_validation_split(tmp_path):
    """--split val: the probe fitted on the training split less its validation part and scored
    on that part; the results say which split they are of."""
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    res = eval_linear.main(eval_linear.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--device", "cpu", "--max-iter", "50", "--wd-grid", "1e-3",
         "--no-progress", "--split", "val"]))
    saved = json.loads((tmp_path / "run" / "linear_val_checkpoint.json").read_text())
    n_val = len(utils.load_prepared(str(data_dir))["val_idx"])
    assert saved["split"] == "val" and (saved["n_train"], saved["n_test"]) == (n_train - n_val, n_val)
    assert saved["linear_top1"] == res["linear_top1"] and 0 <= res["linear_top1"] <= 100
