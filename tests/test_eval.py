"""kNN and linear-probe evaluation: the pure functions on toy features, then both programs on a
tiny prepared data set and an untrained checkpoint."""
import dataclasses
import json
import math
import os

import pytest
import torch

import eval_knn  # the repository root is on sys.path through tests/conftest.py
import eval_linear
import otl


def _clusters(n_per, centres, noise, seed):
    g = torch.Generator().manual_seed(seed)
    C, D = centres.shape
    y = torch.arange(C).repeat_interleave(n_per)
    return centres[y] + noise * torch.randn(C * n_per, D, generator=g), y


# ----------------------------------------------------------------------------------------------
# kNN
# ----------------------------------------------------------------------------------------------

def test_faiss_knn_matches_bruteforce_torch():
    g = torch.Generator().manual_seed(0)
    C, D = 5, 16
    # overlapping classes so that k changes the answer; 12 images per class, so k = 30 > a class
    centres = torch.randn(C, D, generator=g) * 0.6
    train, ytr = _clusters(12, centres, 1.0, seed=1)
    test, yte = _clusters(8, centres, 1.0, seed=2)
    ks = (1, 5, 10, 30)
    for T in (0.07, 0.5):
        fa = eval_knn.knn_classify(train, ytr, test, ks=ks, T=T, use_gpu=False)
        br = eval_knn.knn_classify_torch(train, ytr, test, ks=ks, T=T, chunk=7)
        assert list(fa) == list(br) == list(ks)
        for k in ks:
            assert torch.equal(fa[k], br[k]), (T, k)
        assert eval_knn.top1(fa, yte) == eval_knn.top1(br, yte)
    # the answers do differ between k (the comparison above is not trivially of constants)
    assert len({tuple(fa[k].tolist()) for k in ks}) > 1


def test_weighted_vote_by_hand():
    # cosine similarities to the query [1, 0]: 1.0 (class 1), 0.8, 0.8 (class 0), -1 (class 1)
    train = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.8, -0.6], [-1.0, 0.0]])
    ytr = torch.tensor([1, 0, 0, 1])
    q = torch.tensor([[2.0, 0.0]])  # not unit length: features are L2-normalised first
    # T = 0.1: exp(10) = 22026 for class 1 beats 2 exp(8) = 5962 for class 0 (the minority wins)
    # T = 1:   e = 2.72 loses to 2 e^0.8 = 4.45 (the majority wins)
    assert math.exp(1 / 0.1) > 2 * math.exp(0.8 / 0.1) and math.exp(1) < 2 * math.exp(0.8)
    for fn in (eval_knn.knn_classify, eval_knn.knn_classify_torch):
        assert fn(train, ytr, q, ks=(1, 3), T=0.1) == {1: torch.tensor([1]), 3: torch.tensor([1])}
        assert fn(train, ytr, q, ks=(1, 3), T=1.0) == {1: torch.tensor([1]), 3: torch.tensor([0])}
        # a tie of class scores goes to the lowest class: two neighbours at equal similarity
        tie = fn(train[1:3], torch.tensor([1, 0]), q, ks=(2,), T=0.1)
        assert tie[2].tolist() == [0]
        # neighbours at equal similarity are taken in training order: with k = 1 of two
        # duplicates the first one votes, whatever order the search returned them in
        dup = torch.tensor([[0.6, 0.8], [0.6, 0.8], [0.0, 1.0]])
        assert fn(dup, torch.tensor([2, 0, 1]), q, ks=(1,))[1].tolist() == [2]


def test_knn_separated_clusters_and_num_classes_from_data():
    centres = torch.eye(6, 32) * 10
    train, ytr = _clusters(20, centres, 0.3, seed=3)
    test, yte = _clusters(10, centres, 0.3, seed=4)
    acc = eval_knn.knn_accuracy(train, ytr, test, yte, ks=(1, 10, 20, 50), T=0.1, use_gpu=False)
    assert acc == {1: 100.0, 10: 100.0, 20: 100.0, 50: 100.0}
    # the class count comes from the labels; a num_classes that contradicts them is rejected
    with pytest.raises(ValueError):
        eval_knn.knn_classify(train, ytr, test, ks=(5,), num_classes=3)


def test_knn_clips_large_k_with_warning():
    train, ytr = _clusters(3, torch.eye(2, 4), 0.1, seed=5)
    with pytest.warns(UserWarning, match="clipped"):
        preds = eval_knn.knn_classify(train, ytr, train, ks=(2, 100), use_gpu=False)
    assert sorted(preds) == [2, 6]


# ----------------------------------------------------------------------------------------------
# Linear probe
# ----------------------------------------------------------------------------------------------

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
    fit, held = eval_linear.stratified_split(ytr, 0.2, seed=0)
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


# ----------------------------------------------------------------------------------------------
# Both programs on a tiny prepared data set and an untrained checkpoint
# ----------------------------------------------------------------------------------------------

def _tiny_dataset(root, n_per=10, classes=("a", "b", "c")):
    g = torch.Generator().manual_seed(0)
    C = len(classes)
    labels = torch.arange(C).repeat_interleave(n_per)
    base = torch.tensor([[200, 30, 30], [30, 200, 30], [30, 30, 200]])[labels]  # (N, 3)
    images = (base[:, :, None, None] + torch.randint(-25, 26, (C * n_per, 3, 16, 16), generator=g))
    images = images.clamp(0, 255).to(torch.uint8)
    os.makedirs(root)
    torch.save({"images": images, "labels": labels, "classes": list(classes),
                "files": [f"{classes[y]}/{i}.png" for i, y in enumerate(labels.tolist())]},
               os.path.join(root, "cache.pt"))
    perm = torch.randperm(C * n_per, generator=g).tolist()
    n_test = C * n_per // 3
    with open(os.path.join(root, "split.json"), "w") as fh:
        json.dump({"seed": 0, "test_frac": n_test / (C * n_per), "train": sorted(perm[n_test:]),
                   "test": sorted(perm[:n_test])}, fh)
    with open(os.path.join(root, "manifest.json"), "w") as fh:
        json.dump({"source": "synthetic", "image_size": 16, "classes": list(classes)}, fh)
    return C * n_per - n_test, n_test


def test_programs_end_to_end(tmp_path, monkeypatch):
    torch.manual_seed(0)
    data_dir = tmp_path / "data"
    n_train, n_test = _tiny_dataset(str(data_dir))
    cfg = otl.ModelConfig(k=8, width=8)
    model = otl.build_model(cfg)
    run = tmp_path / "run"
    run.mkdir()
    ckpt = str(run / "checkpoint.pth")
    otl.save_checkpoint({"model": model.state_dict(), "model_cfg": dataclasses.asdict(cfg),
                         "args": {"data": str(data_dir), "img_size": 16}, "epoch": 0}, ckpt)

    args = eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--ks", "3", "5", "--device", "cpu", "--no-progress"])
    res = eval_knn.main(args)
    cache = run / "features_checkpoint.pt"
    assert cache.is_file()
    stamp = cache.stat().st_mtime_ns
    out = run / "knn_checkpoint.json"
    saved = json.loads(out.read_text())
    assert saved["knn_top1"] == {k: v for k, v in res["knn_top1"].items()}
    assert set(saved["knn_top1"]) == {"3", "5"}
    assert all(0 <= a <= 100 for a in saved["knn_top1"].values())
    assert (saved["n_train"], saved["n_test"], saved["feat_dim"], saved["epoch"]) == \
        (n_train, n_test, 64, 0)
    for key in ("checkpoint", "data_dir", "temperature", "command", "git_commit", "seconds"):
        assert key in saved

    # the second program must reuse the cached features, not run the network again
    def no_extraction(*a, **k):
        raise AssertionError("features were extracted again instead of read from the cache")
    monkeypatch.setattr(otl, "extract_features", no_extraction)
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
