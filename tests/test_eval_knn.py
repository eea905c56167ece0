"""eval_knn.py: the FAISS search against otl.knn_classify's brute force, and the program on a tiny
prepared data set (features cached beside the checkpoint, results JSON)."""
import json
import sys

import torch

import eval_knn  # the repository root is on sys.path through tests/conftest.py
import otl
import utils
from evalkit import untrained_checkpoint
from conftest import clusters


def test_faiss_knn_matches_bruteforce_torch():
    g = torch.Generator().manual_seed(0)
    C, D = 5, 16
    # overlapping classes so that k changes the answer; 12 images per class, so k = 30 > a class
    centres = torch.randn(C, D, generator=g) * 0.6
    train, ytr = clusters(12, centres, 1.0, seed=1)
    test, yte = clusters(8, centres, 1.0, seed=2)
    ks = (1, 5, 10, 30)
    for T in (0.07, 0.5):
        fa = otl.knn_classify(train, ytr, test, ks=ks, T=T,
                              search=lambda tr, te, K: eval_knn.faiss_search(tr, te, K, use_gpu=False))
        br = otl.knn_classify(train, ytr, test, ks=ks, T=T, chunk=7)
        assert list(fa) == list(br) == list(ks)
        for k in ks:
            assert torch.equal(fa[k], br[k]), (T, k)
        assert otl.top1(fa, yte) == otl.top1(br, yte)
    # the answers do differ between k (the comparison above is not trivially of constants)
    assert len({tuple(fa[k].tolist()) for k in ks}) > 1


def test_eval_knn_program(tmp_path):
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    res = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--ks", "3", "5", "--device", "cpu", "--no-progress"]))
    run = tmp_path / "run"
    assert (run / "features_checkpoint.pt").is_file()
    saved = json.loads((run / "knn_checkpoint.json").read_text())
    assert saved["knn_top1"] == {k: v for k, v in res["knn_top1"].items()}
    assert set(saved["knn_top1"]) == {"3", "5"}
    assert all(0 <= a <= 100 for a in saved["knn_top1"].values())
    assert (saved["n_train"], saved["n_test"], saved["feat_dim"], saved["epoch"]) == \
        (n_train, n_test, 64, 0)
    for key in ("checkpoint", "data_dir", "temperature", "command", "git_commit", "seconds"):
        assert key in saved


def test_eval_knn_program_without_faiss(tmp_path, monkeypatch, capsys):
    """Where faiss is not installed (some GPU images lack it) the program falls back to the
    brute-force search, says so, and gives the FAISS index's accuracies."""
    ckpt, _, _, _ = untrained_checkpoint(tmp_path)
    argv = ["--checkpoint", ckpt, "--ks", "3", "5", "--device", "cpu", "--no-progress"]
    with_faiss = eval_knn.main(eval_knn.get_args_parser().parse_args(argv))
    monkeypatch.setitem(sys.modules, "faiss", None)        # import faiss -> ImportError
    assert not eval_knn.have_faiss()
    without = eval_knn.main(eval_knn.get_args_parser().parse_args(argv))
    assert "faiss is not installed" in capsys.readouterr().out
    assert without["knn_top1"] == with_faiss["knn_top1"]


def test_a_k_above_the_training_rows_keeps_the_k_asked_for(tmp_path):
    """kNN@k for k above the training rows votes with them all, stored under the k asked for
    (so a table's kNN@200 column finds it) with the k taken beside."""
    ckpt, _, n_train, _ = untrained_checkpoint(tmp_path)
    res = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--ks", "3", str(n_train), "500", "--device", "cpu", "--no-progress"]))
    assert list(res["knn_top1"]) == ["3", str(n_train), "500"]
    assert res["knn_top1"]["500"] == res["knn_top1"][str(n_train)]
    assert res["knn_clipped"] == {"500": n_train}


def test_eval_knn_on_the_validation_split(tmp_path):
    """--split val: the training split's validation part against the rest of it, the test split
    unread; its own results file beside the test split's."""
    ckpt, data_dir, n_train, n_test = untrained_checkpoint(tmp_path)
    res = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--ks", "3", "--device", "cpu", "--no-progress", "--split", "val"]))
    saved = json.loads((tmp_path / "run" / "knn_val_checkpoint.json").read_text())
    assert saved["split"] == "val" and saved["knn_top1"] == res["knn_top1"]
    n_val = len(utils.load_prepared(str(data_dir))["val_idx"])        # derived: 1 of a class
    assert n_val == 3 and (saved["n_train"], saved["n_test"]) == (n_train - n_val, n_val)
    assert not (tmp_path / "run" / "knn_checkpoint.json").exists()
