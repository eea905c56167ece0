"""The peers (peers.py, train_otl.py --method): each trains a tiny run end to end and its run folder
evaluates and resumes; each loss falls on a fixed batch (a broken loss or gradient would not);
their augmentations; the collapse signal flags a constant network."""
import argparse
import json
import os

import pytest
import torch

import eval_knn
import otl
import train_otl
import utils

pytest.importorskip("lightly")
import peers  # noqa: E402

TINY = ["--width", "8", "--img-size", "16", "--k", "16", "--batch-size", "32", "--preset", "cpu",
        "--device", "cpu", "--no-progress"]
PEERS = ["simclr", "byol", "swav"]


def train(data, out, *extra):
    args = train_otl.get_args_parser().parse_args(["--data", str(data), "--output", str(out),
                                                   *TINY, *extra])
    return train_otl.main(args)


@pytest.mark.parametrize("method", PEERS)
def test_a_peer_trains_evaluates_and_resumes(small_data, tmp_path, method):
    run = tmp_path / method
    res = train(small_data, run, "--method", method, "--epochs", "1")
    assert res["method"] == method and res["epochs"] == 1
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert "pl_std" not in log[0] and 0 <= log[0]["feat_spread"] <= 2 and log[0]["loss"] == log[0]["loss"]
    assert ("clusters_used" in log[0]) == (method == "swav")
    ck = utils.load_file(run / "checkpoint.pth")
    assert ck["method"] == method and ck["peer"] and ck["pseudo_labels"] is None
    knn = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", str(run / "checkpoint.pth"), "--device", "cpu", "--no-progress"]))
    assert all(0 <= v <= 100 for v in knn["knn_top1"].values())
    # resumed to two epochs: the peer's own modules (BYOL's target, SwAV's prototypes) go on
    res = train(small_data, run, "--method", method, "--epochs", "2")
    assert res["epochs"] == 2
    assert [json.loads(x)["epoch"] for x in (run / "log.jsonl").read_text().splitlines()] == [1, 2]
    later = utils.load_file(run / "checkpoint.pth")["peer"]
    assert any(not torch.equal(later[k], ck["peer"][k]) for k in later if later[k].is_floating_point())


def test_a_peer_with_otls_augmentation_and_a_method_change_refused(small_data, tmp_path):
    run = tmp_path / "simclr_otl_aug"
    assert train(small_data, run, "--method", "simclr", "--peer-aug", "otl", "--epochs", "1")
    with pytest.raises(SystemExit, match="simclr|optimizer"):
        train(small_data, run, "--method", "byol", "--epochs", "2")
    with pytest.raises(SystemExit, match="--supervised are two different trainings"):
        train(small_data, tmp_path / "x", "--method", "swav", "--supervised", "--epochs", "1")


@pytest.mark.parametrize("method", PEERS)
def test_each_peers_loss_falls_on_a_fixed_batch(method):
    torch.manual_seed(0)
    x = (torch.rand(32, 3, 32, 32) * 255).to(torch.uint8)
    model = otl.build_model(otl.ModelConfig(k=16, width=8))
    peer = peers.Peer(method, model, 16)
    opt = torch.optim.SGD(list(model.parameters()) + peer.trainable(), lr=0.05, momentum=0.9)
    xs = peers.views(x, 32, method, generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(10):
        loss = peer.loss(model, xs, epoch=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        peer.after_step(model, step / 10)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1, losses


def test_the_views_are_each_methods_and_seeded():
    x = (torch.rand(16, 3, 48, 48) * 255).to(torch.uint8)
    for method in PEERS:
        a = peers.views(x, 24, method, generator=torch.Generator().manual_seed(1))
        b = peers.views(x, 24, method, generator=torch.Generator().manual_seed(1))
        assert len(a) == 2 and all(v.shape == (16, 3, 24, 24) for v in a)
        assert all(0 <= float(v.min()) and float(v.max()) <= 1 for v in a)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert not torch.equal(a[0], a[1])
    # BYOL's views differ by design: the first always blurred, only the second solarised
    assert peers.VIEWS["byol"][0]["blur"] == 1.0 and peers.VIEWS["byol"][1]["solarize"] == 0.2


def test_the_collapse_signal_flags_a_constant_network(capsys):
    assert peers.feature_spread(torch.ones(100, 32)) == 0
    assert 0.9 < peers.feature_spread(torch.randn(4000, 32, generator=torch.Generator().manual_seed(0))) < 1.1
    model = otl.build_model(otl.ModelConfig(k=16, width=8))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()                            # every image maps to the same features
    images = (torch.rand(64, 3, 16, 16) * 255).to(torch.uint8)
    args = argparse.Namespace(img_size=16, crop=1.0, amp=False)
    row = train_otl.collapse_signal(model, None, images, args, torch.device("cpu"))
    assert row["feat_spread"] < peers.COLLAPSED and row["collapsed"] is True
    assert "collapsing" in capsys.readouterr().err
    fresh = otl.build_model(otl.ModelConfig(k=16, width=8))
    assert "collapsed" not in train_otl.collapse_signal(fresh, None, images, args, torch.device("cpu"))


def test_otl_runs_log_the_collapse_signal_too(small_data, tmp_path):
    train(small_data, tmp_path / "otl", "--epochs", "1")
    row = json.loads((tmp_path / "otl" / "log.jsonl").read_text().splitlines()[0])
    assert 0 < row["feat_spread"] and row["clusters_used_before"] >= 1
    assert os.path.isfile(tmp_path / "otl" / "results.json")


@pytest.mark.parametrize("extra, says", [
    (["--method", "simclr", "--views", "4", "--label-views", "4", "--labeler", "sinkhorn", "--heads", "3",
      "--label-every", "5", "--lct", "false"],
     "--method simclr does not use --views, --label-views, --labeler, --heads, --label-every, --lct"),
    (["--method", "byol", "--aug", "simple"], "--peer-aug otl takes OTL's --aug"),
    (["--peer-aug", "otl"], "--peer-aug chooses a peer's views"),
])
def test_flags_a_method_does_not_use_are_refused(small_data, tmp_path, extra, says):
    with pytest.raises(SystemExit, match=says.replace("-", r"\-")):
        train(small_data, tmp_path / "run", *extra)
    assert not (tmp_path / "run").exists()


def test_simclr_needs_no_more_images_than_k(small_data, tmp_path):
    """SimCLR reads no k: a k above the training split's size is OTL's limit, not its."""
    res = train(small_data, tmp_path / "run", "--method", "simclr", "--k", "500", "--epochs", "1")
    assert res["epochs"] == 1
    with pytest.raises(SystemExit, match="fewer than --k 500"):
        train(small_data, tmp_path / "otl", "--k", "500", "--epochs", "1")


def test_otl_views_are_taken_with_peer_aug_otl(small_data, tmp_path):
    res = train(small_data, tmp_path / "run", "--method", "byol", "--peer-aug", "otl", "--aug",
                "simple", "--epochs", "1")
    assert res["epochs"] == 1


def test_resuming_with_another_method_names_both(small_data, tmp_path):
    train(small_data, tmp_path / "run", "--epochs", "1")
    with pytest.raises(SystemExit, match=r"is a run of --method otl, not byol: resume it with "
                                         r"--method otl"):
        train(small_data, tmp_path / "run", "--method", "byol", "--epochs", "2")


def test_init_from_a_peer_records_its_method(small_data, tmp_path):
    train(small_data, tmp_path / "byol", "--method", "byol", "--epochs", "1")
    src = tmp_path / "byol" / "checkpoint.pth"
    res = train(small_data, tmp_path / "otl", "--init", str(src), "--epochs", "1")
    assert res["init_from"]["method"] == "byol" and res["init_from"]["supervised"] is False
    assert res["init_from"]["sha256"] == utils.sha256_file(str(src))
