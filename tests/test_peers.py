"""The peers (peers.py, train_otl.py --method): each trains a tiny run end to end and its run folder
evaluates and resumes; each loss falls on a fixed batch (a broken loss or gradient would not);
their augmentations; the collapse signal flags a constant network."""
import argparse
import json
import math
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
    for recipe in ("own", "cifar"):
        for method in PEERS:
            a = peers.views(x, 24, method, generator=torch.Generator().manual_seed(1), recipe=recipe)
            b = peers.views(x, 24, method, generator=torch.Generator().manual_seed(1), recipe=recipe)
            assert len(a) == 2 and all(v.shape == (16, 3, 24, 24) for v in a)
            assert all(0 <= float(v.min()) and float(v.max()) <= 1 for v in a)
            assert all(torch.equal(u, v) for u, v in zip(a, b))
            assert not torch.equal(a[0], a[1])
    own, cifar = peers.VIEWS["own"], peers.VIEWS["cifar"]
    # BYOL's views differ by design: the first always blurred, only the second solarised
    assert own["byol"][0]["blur"] == 1.0 and own["byol"][1]["solarize"] == 0.2
    # SwAV's jitter is its code's strength 1 (0.8 / 0.2), not 0.8 applied twice
    assert own["swav"][0]["jitter"] == (0.8, 0.8, 0.8, 0.8, 0.2)
    # the 32-px recipes: no blur, strength 0.5 (SimCLR, SwAV), BYOL's second view solarised
    assert all(v["blur"] == 0 for m in PEERS for v in cifar[m])
    assert cifar["simclr"][0]["jitter"] == (0.8, 0.4, 0.4, 0.4, 0.1)
    assert cifar["byol"][1]["solarize"] == 0.2 and cifar["byol"][0]["solarize"] == 0
    # the recipe changes the pictures
    a = peers.views(x, 24, "simclr", generator=torch.Generator().manual_seed(1))
    c = peers.views(x, 24, "simclr", generator=torch.Generator().manual_seed(1), recipe="cifar")
    assert not torch.equal(a[0], c[0])


def test_the_collapse_measures():
    g = torch.Generator().manual_seed(0)
    assert peers.feature_spread(torch.ones(100, 32)) == 0
    assert 0.9 < peers.feature_spread(torch.randn(4000, 32, generator=g)) < 1.1
    assert peers.effective_rank(torch.ones(100, 32)) == 0
    line = torch.randn(500, 1, generator=g) * torch.randn(1, 32, generator=g)     # one direction
    assert peers.effective_rank(line) == pytest.approx(1.0, abs=1e-3)
    assert peers.effective_rank(line + 5) < peers.COLLAPSED_RANK     # off the origin: an arc
    assert 25 < peers.effective_rank(torch.randn(4000, 32, generator=g)) <= 32
    ok = {"feat_spread": 0.5, "feat_rank": 10, "head_spread": 0.5, "head_rank": 10, "loss": 2.0}
    assert peers.collapse_verdict(ok, 5, 16) is None
    assert "spread" in peers.collapse_verdict({**ok, "head_spread": 0.01}, 1, None)
    assert "effective rank" in peers.collapse_verdict({**ok, "feat_rank": 1.0}, 1, None)
    uniform = {**ok, "loss": math.log(128)}
    assert "uniform prediction" in peers.collapse_verdict(uniform, peers.COLLAPSE_AFTER + 1, 128)
    assert peers.collapse_verdict(uniform, peers.COLLAPSE_AFTER, 128) is None   # early: not yet
    assert peers.collapse_verdict(uniform, 10, None) is None                    # not a softmax loss


def test_the_collapse_signal_flags_a_constant_network(capsys):
    model = otl.build_model(otl.ModelConfig(k=16, width=8))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()                            # every image maps to the same features
    images = (torch.rand(64, 3, 16, 16) * 255).to(torch.uint8)
    args = argparse.Namespace(img_size=16, crop=1.0, amp=False, supervised=False, k=16,
                              method="otl", prototypes=None)
    row = train_otl.collapse_signal(model, None, images, args, torch.device("cpu"), {"loss": 1.0}, 1)
    assert row["feat_spread"] < peers.COLLAPSED and row["collapsed"] is True
    assert row["head_rank"] == 0 and "spread" in row["collapse_why"]
    assert "looks collapsed" in capsys.readouterr().err
    fresh = otl.build_model(otl.ModelConfig(k=16, width=8))
    row = train_otl.collapse_signal(fresh, None, images, args, torch.device("cpu"), {"loss": 1.0}, 1)
    assert "collapsed" not in row and row["head_rank"] > 1.5
    assert row["loss_over_ln_k"] == round(1.0 / math.log(16), 4)


def test_the_collapse_sample_is_stratified_and_fixed():
    labels = torch.arange(10).repeat_interleave(torch.tensor([500] * 5 + [100] * 5))  # sorted
    idx = train_otl.collapse_sample(labels, n=300)
    assert torch.equal(idx, train_otl.collapse_sample(labels, n=300))
    counts = torch.bincount(labels[idx], minlength=10)
    assert abs(int(idx.numel()) - 300) <= 5 and (counts[:5] > 3 * counts[5:]).all() and (counts > 0).all()
    assert torch.equal(train_otl.collapse_sample(labels[:50], n=300), torch.arange(50))


def test_a_run_that_ends_collapsed_is_marked_failed(small_data, tmp_path, monkeypatch, capsys):
    import ablations
    monkeypatch.setattr(peers, "collapse_verdict", lambda row, epoch, k: "forced by the test")
    res = train(small_data, tmp_path / "run", "--method", "simclr", "--epochs", "1")
    assert res["failed"] == "collapsed at epoch 1: forced by the test"
    log = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[0])
    assert log["collapsed"] is True and log["collapse_why"] == "forced by the test"
    assert "marks it failed" in capsys.readouterr().err
    monkeypatch.undo()          # the table's own check of the final loss is the real one
    row = ablations.training_row(str(tmp_path / "run"), {"method": "simclr"}, {})
    assert row["failed"] == res["failed"]
    lines = ablations.Peers().table([row, {**row, "failed": None, "method": "otl"}])
    assert lines[0].rstrip("| ").endswith("failed")
    assert lines[2].rstrip("| ").endswith("collapsed") and "collapsed" not in lines[3]


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


def resolved(data, tmp_path, *extra):
    args = train_otl.get_args_parser().parse_args(["--data", str(data), "--output",
                                                   str(tmp_path / "r"), *TINY, *extra])
    return train_otl.resolve_args(args, torch.device("cpu"))


def test_a_recipe_fills_what_is_not_given(small_data, tmp_path):
    a = resolved(small_data, tmp_path, "--method", "simclr", "--recipe", "solo-learn",
                 "--epochs", "20")
    assert (a.optimizer, a.wd, a.temperature, a.peer_aug) == ("lars", 1e-4, 0.2, "own")
    assert a.lr == pytest.approx(0.4 * 32 / 256) and a.warmup_epochs == pytest.approx(0.2)
    a = resolved(small_data, tmp_path, "--method", "swav", "--recipe", "solo-learn", "--lr", "0.1",
                 "--peer-aug", "cifar")
    assert (a.lr, a.peer_aug, a.prototypes, a.queue, a.temperature) == (0.1, "cifar", 3000, 3840, 0.1)
    a = resolved(small_data, tmp_path, "--method", "swav", "--recipe", "lightly")
    assert (a.optimizer, a.prototypes, a.queue) == ("adam", 512, 0)
    assert a.lr == pytest.approx(1e-3 * 32 / 128)
    a = resolved(small_data, tmp_path, "--method", "byol")        # ours: the preset's SGD
    assert (a.recipe, a.optimizer, a.wd, a.lr, a.peer_aug) == ("ours", "sgd", 5e-4, 0.05, "own")
    assert resolved(small_data, tmp_path, "--method", "swav").prototypes == 16     # --k


@pytest.mark.parametrize("extra, says", [
    (["--recipe", "solo-learn"], "is a peer's published optimisation"),
    (["--method", "byol", "--temperature", "0.2"], "--method byol does not use --temperature"),
    (["--method", "simclr", "--queue", "256", "--prototypes", "64"],
     "--method simclr does not use --prototypes, --queue"),
    (["--method", "swav", "--queue", "-1"], "--queue >= 0"),
    (["--method", "simclr", "--temperature", "0"], "--temperature must be > 0"),
])
def test_recipe_flags_in_the_wrong_place_are_refused(small_data, tmp_path, extra, says):
    with pytest.raises(SystemExit, match=says.replace("-", r"\-")):
        train(small_data, tmp_path / "run", *extra)
    assert not (tmp_path / "run").exists()


def test_lars_and_adam_leave_biases_and_norms_without_weight_decay():
    model = otl.build_model(otl.ModelConfig(k=16, width=8))
    params = list(model.parameters())
    for name in ("lars", "adam"):
        args = argparse.Namespace(optimizer=name, lr=0.1, momentum=0.9, wd=1e-4)
        opt = train_otl.optimizer(args, params, torch.device("cpu"))
        decayed, plain = opt.param_groups
        assert decayed["weight_decay"] == 1e-4 and plain["weight_decay"] == 0
        assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
        assert len(decayed["params"]) + len(plain["params"]) == len(params)
    lars = train_otl.optimizer(argparse.Namespace(optimizer="lars", lr=0.1, momentum=0.9, wd=1e-4),
                               params, torch.device("cpu"))
    assert lars.defaults["trust_coeff"] == 0.02 and lars.defaults["trust_clip"] is True
    sgd = train_otl.optimizer(argparse.Namespace(optimizer="sgd", lr=0.1, momentum=0.9, wd=1e-4),
                              params, torch.device("cpu"))
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1


def test_byols_heads_follow_the_backbone_and_swavs_queue_fills():
    model = otl.build_model(otl.ModelConfig(k=16, width=8))
    d = model.feat_dim
    byol = peers.Peer("byol", model, 16)
    assert byol.head_outputs(torch.randn(4, d)).shape == (4, d // 2)
    hidden = [m.out_features for m in byol.projection.modules() if isinstance(m, torch.nn.Linear)]
    assert hidden == [2 * d, d // 2]
    swav = peers.Peer("swav", model, 24, queue=64, queue_start=1)
    assert swav.head_outputs(torch.randn(4, d)).shape == (4, 24)
    x = (torch.rand(32, 3, 32, 32) * 255).to(torch.uint8)
    xs = peers.views(x, 32, "swav", generator=torch.Generator().manual_seed(0))
    before = swav.queues.banks[0].bank.clone()
    first = swav.loss(model, xs, epoch=0)               # the queue fills, unused before epoch 1
    assert int(swav.queues.banks[0].bank_ptr) == 32 and not torch.equal(before, swav.queues.banks[0].bank)
    state = swav.state_dict()                           # its contents saved, and restored
    other = peers.Peer("swav", model, 24, queue=64, queue_start=1)
    other.load_state_dict(state)
    assert torch.equal(other.queues.banks[0].bank, swav.queues.banks[0].bank)
    assert int(other.queues.banks[0].bank_ptr) == 32
    torch.manual_seed(0)
    with_queue = swav.loss(model, xs, epoch=1)
    swav.queue_start = 99
    torch.manual_seed(0)
    without = swav.loss(model, xs, epoch=1)
    assert torch.isfinite(first) and not torch.allclose(with_queue, without)


def test_a_solo_learn_swav_with_its_queue_trains_and_resumes(small_data, tmp_path):
    run = tmp_path / "swav"
    res = train(small_data, run, "--method", "swav", "--recipe", "solo-learn", "--prototypes", "32",
                "--queue", "64", "--epochs", "1")
    assert res["optimizer"] == "lars" and res["recipe"] == "solo-learn"
    ck = utils.load_file(run / "checkpoint.pth")
    assert ck["args"]["queue"] == 64
    queue = ck["peer"]["queues._extra_state"]         # the queue's contents go on after a resume
    assert queue[0][0].shape == (64, 128) and 0 <= int(queue[0][1]) < 64
    res = train(small_data, run, "--method", "swav", "--recipe", "solo-learn", "--prototypes", "32",
                "--queue", "64", "--epochs", "2")
    assert res["epochs"] == 2
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert all({"feat_rank", "head_rank", "head_spread", "loss_over_ln_k"} <= set(r) for r in log)
