"""train_otl.py on 200 real EuroSAT images at a tiny size: checkpoints, resume (bit-identical to an
uninterrupted run), the random-init snapshot, bad flags, and a checkpoint of another model."""
import json
import os

import pytest
import torch

import train_otl
import utils


TINY = ["--width", "8", "--img-size", "16", "--k", "16", "--batch-size", "32", "--preset", "cpu",
        "--device", "cpu", "--no-progress", "--schedule", "step", "--lr-drops", "--lr-values"]


def train(data, out, *extra):
    args = train_otl.get_args_parser().parse_args(["--data", str(data), "--output", str(out), *TINY, *extra])
    return train_otl.main(args)


def _weights(path):
    return utils.load_file(path)["model"]


@pytest.mark.parametrize("start", ["views", "epochs"])
def test_resume_equals_uninterrupted_run(small_data, tmp_path, start):
    # --labeler-start epochs: the second epoch's labeler starts from the first's translation,
    # which the checkpoint keeps
    flags = ["--labeler-start", start]
    train(small_data, tmp_path / "a", "--epochs", "2", *flags)
    # the same run stopped after its first epoch (as a crash would), then the same command again
    assert train(small_data, tmp_path / "b", "--epochs", "2", "--max-minutes", "1e-9", *flags) is None
    ck = utils.load_file(tmp_path / "b" / "checkpoint.pth")
    assert ck["epoch"] == 1 and ck["labeler_starts"][0].shape == (16,)
    train(small_data, tmp_path / "b", "--epochs", "2", "--max-minutes", "1e-9", *flags)
    wa, wb = _weights(tmp_path / "a" / "checkpoint.pth"), _weights(tmp_path / "b" / "checkpoint.pth")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2]
    for r in log:
        # the label pass spread the pseudo-labels: std far below all-in-one-cluster
        assert r["pl_std"] < 0.05 * r["pl_std_max"]
        assert r["loss"] > 0 and r["img_per_s"] > 0


def test_checkpoint_rebuilds_model_and_random_init_snapshot(small_data, tmp_path):
    train(small_data, tmp_path / "r", "--epochs", "1")
    model, ck = utils.load_checkpoint(str(tmp_path / "r" / "checkpoint.pth"))
    assert ck["epoch"] == 1 and ck["args"]["k"] == 16 and ck["model_cfg"]["width"] == 8
    assert model(torch.zeros(2, 3, 16, 16, dtype=torch.uint8)).shape == (2, 16)
    # one row per labelled view, one column per training image less the validation split's 20
    assert ck["pseudo_labels"].shape == (ck["args"]["label_views"], 140)
    m0, ck0 = utils.load_checkpoint(str(tmp_path / "r" / "checkpoint0000.pth"))
    assert ck0["epoch"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(m0.state_dict().values(), model.state_dict().values()))
    assert os.path.isfile(tmp_path / "r" / "checkpoint0001.pth")
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert res["epochs"] == 1 and res["preset"] == "cpu"


def test_bad_flags_fail_loudly(small_data, tmp_path):
    with pytest.raises(SystemExit, match="label-views"):
        train(small_data, tmp_path / "x", "--epochs", "1", "--label-views", "3")
    with pytest.raises(SystemExit, match="fewer than --k"):
        train(small_data, tmp_path / "y", "--epochs", "1", "--k", "500")
    with pytest.raises(SystemExit, match="even target only"):
        train(small_data, tmp_path / "z", "--epochs", "1", "--labeler", "sinkhorn", "--target-x", "2")


def test_sinkhorn_labeler_and_summed_lct(small_data, tmp_path):
    """--labeler sinkhorn trains on Sinkhorn-Knopp's labels; --lct-reduction sum multiplies the
    LCT loss by views^2 (same labels, same first batch: the first epoch's loss is 4x)."""
    train(small_data, tmp_path / "s", "--epochs", "1", "--labeler", "sinkhorn")
    row = json.loads((tmp_path / "s" / "log.jsonl").read_text().splitlines()[0])
    assert row["labeler_iters"] > 0 and 0 <= row["pl_std"] < row["pl_std_max"]
    ck = utils.load_file(tmp_path / "s" / "checkpoint.pth")
    assert ck["args"]["labeler"] == "sinkhorn" and ck["pseudo_labels"].shape[1] == 140
    mean = train(small_data, tmp_path / "m", "--epochs", "1", "--lr", "0")
    summed = train(small_data, tmp_path / "u", "--epochs", "1", "--lr", "0", "--lct-reduction", "sum")
    lm, lu = (json.loads((tmp_path / r / "log.jsonl").read_text().splitlines()[0])["loss"] for r in "mu")
    assert mean and summed and lu == pytest.approx(4 * lm, rel=1e-4)


def test_reference_labeler_trains_to_the_exact_ones_balance(small_data, tmp_path):
    """--labeler reference (otl.py's exact labeler) trains, with the counts of the tuned exact
    labeler's problem: every count within 1 of the target, so the same std."""
    stds = {}
    for lab in ("reference", "exact"):
        train(small_data, tmp_path / lab, "--epochs", "1", "--labeler", lab)
        stds[lab] = json.loads((tmp_path / lab / "log.jsonl").read_text().splitlines()[0])["pl_std"]
        assert utils.load_file(tmp_path / lab / "checkpoint.pth")["args"]["labeler"] == lab
    assert stds["reference"] == pytest.approx(stds["exact"]) and stds["exact"] < 1


def test_resume_with_another_model_fails_loudly(small_data, tmp_path):
    train(small_data, tmp_path / "m", "--epochs", "1")
    with pytest.raises(SystemExit, match="different model"):
        train(small_data, tmp_path / "m", "--epochs", "2", "--k", "20")


def test_finished_run_is_not_rewritten_or_shortened(small_data, tmp_path):
    first = train(small_data, tmp_path / "f", "--epochs", "2")
    res = tmp_path / "f" / "results.json"
    saved = res.read_text()
    assert first["train_minutes"] > 0
    # the same command again: the run is complete, nothing is trained or rewritten
    assert train(small_data, tmp_path / "f", "--epochs", "2") == json.loads(saved)
    assert res.read_text() == saved
    with pytest.raises(SystemExit, match="at epoch 2, past --epochs 1"):
        train(small_data, tmp_path / "f", "--epochs", "1")
    assert res.read_text() == saved
    assert utils.load_file(tmp_path / "f" / "checkpoint.pth")["epoch"] == 2


def test_results_record_the_runs_arithmetic(small_data, tmp_path):
    # a study's rows say which runs had bf16 autocast (machines differ), so results.json does
    assert train(small_data, tmp_path / "p", "--epochs", "1", "--amp", "false")["amp"] is False


def test_truncated_checkpoint_falls_back_to_the_newest_snapshot(small_data, tmp_path):
    train(small_data, tmp_path / "a", "--epochs", "3")
    b = tmp_path / "b"
    # stopped after epoch 2, with snapshots every epoch; then checkpoint.pth cut in half and a
    # half-written temporary file left behind, as a kill during a write would
    train(small_data, b, "--epochs", "3", "--snapshot-every", "1")
    ck = b / "checkpoint.pth"
    os.remove(b / "checkpoint0003.pth")
    os.remove(b / "results.json")       # the kill came during epoch 3's checkpoint write
    utils.save_checkpoint(utils.load_file(b / "checkpoint0002.pth"), str(ck))
    data = ck.read_bytes()
    ck.write_bytes(data[:len(data) // 2])
    (b / "checkpoint.pth.tmp1234").write_bytes(data[:100])
    res = train(small_data, b, "--epochs", "3", "--snapshot-every", "1")
    assert not (b / "checkpoint.pth.tmp1234").exists()
    log = [json.loads(x) for x in (b / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2, 3]
    assert res["train_minutes"] > 0
    wa, wb = _weights(tmp_path / "a" / "checkpoint.pth"), _weights(ck)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_a_kill_right_after_the_checkpoint_loses_nothing(small_data, tmp_path, monkeypatch):
    """Killed just after the last epoch's checkpoint.pth is written: its log line, the final
    snapshot and (on the rerun) a true results.json are all there."""
    save = utils.save_checkpoint

    def save_then_die(state, path):
        save(state, path)
        if path.endswith("checkpoint.pth") and state["epoch"] == 2:
            raise KeyboardInterrupt("killed")
    monkeypatch.setattr(utils, "save_checkpoint", save_then_die)
    run = tmp_path / "k"
    with pytest.raises(KeyboardInterrupt):
        train(small_data, run, "--epochs", "2")
    monkeypatch.setattr(utils, "save_checkpoint", save)
    assert os.path.isfile(run / "checkpoint0002.pth")
    res = train(small_data, run, "--epochs", "2")
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2]
    assert res["train_minutes"] == pytest.approx(sum(r["epoch_s"] for r in log) / 60, abs=0.01)
    assert res["train_minutes"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trains_labels_and_resumes_on_cuda(small_data, tmp_path):
    # the CUDA path: data resident on the GPU, sync-free augmentation, bf16 autocast, fused SGD
    i = TINY.index("--device") + 1
    cuda = [*TINY[:i], "cuda", *TINY[i + 1:]]          # the device only: "--preset cpu" stays
    args = ["--data", str(small_data), "--output", str(tmp_path / "g"), *cuda]
    assert train_otl.main(train_otl.get_args_parser().parse_args([*args, "--epochs", "1"]))
    res = train_otl.main(train_otl.get_args_parser().parse_args([*args, "--epochs", "2"]))
    assert res["device"].startswith("cuda")
    log = [json.loads(x) for x in (tmp_path / "g" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2]
    for r in log:
        assert r["pl_std"] < 0.05 * r["pl_std_max"] and r["loss"] > 0
    ck = utils.load_file(tmp_path / "g" / "checkpoint.pth")
    assert ck["epoch"] == 2 and ck["args"]["amp"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_labeler_on_the_host_gives_the_labels_of_cuda(small_data, tmp_path, monkeypatch):
    """--labeler-device cpu: the label pass's outputs on the GPU are labelled on the host, and the
    labels (back on the GPU) are those the exact labeler gives on the GPU."""
    i = TINY.index("--device") + 1
    cuda = [*TINY[:i], "cuda", *TINY[i + 1:]]
    args = train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(tmp_path / "h"), *cuda, "--epochs", "1"])
    train_otl.main(args)                          # a trained network's outputs, fixed once
    model, _ = utils.load_checkpoint(str(tmp_path / "h" / "checkpoint.pth"), "cuda")
    d = utils.load_prepared(str(small_data))
    images = d["images"][d["train_idx"]].cuda()
    outs = train_otl.otl.label_pass(model, images, 16, device="cuda", views=2, strong=True,
                                    progress=False)
    monkeypatch.setattr(train_otl.otl, "label_pass", lambda *a, **kw: outs)
    got = {}
    for where in ("same", "cpu"):
        args.labeler_device = where
        got[where] = train_otl.make_labels(model, images, args, torch.device("cuda"), None,
                                           utils.Ranks("cuda"), len(images))
    assert got["cpu"][0].device.type == "cuda" and got["cpu"][0].shape == (2, len(images))
    assert torch.equal(got["cpu"][0], got["same"][0])
    assert got["cpu"][1]["pl_std"] == pytest.approx(got["same"][1]["pl_std"])


def test_compiled_training_matches_eager_and_saves_plain_weights(small_data, tmp_path, monkeypatch):
    """--compile true trains through torch.compile: the same pseudo-labels and about the same
    loss as the eager run (float32 gradients of this BatchNorm network already differ from
    float64 ones by several per cent at some parameters, so weights are not compared), a
    checkpoint an uncompiled model loads, and a resume without the flag.  The graphs are captured
    and differentiated as with the default backend but run by aot_eager: what train_otl.py meets
    (the wrapped module, its state dict, the steps) is the same, and inductor's C++ code
    generation, torch's to test, would take a minute of the suite on 2 cores."""
    compiled = []

    def compile_(model, **kw):
        compiled.append(model)
        return real(model, **{**kw, "backend": "aot_eager"})
    real = torch.compile
    monkeypatch.setattr(torch, "compile", compile_)
    train(small_data, tmp_path / "e", "--epochs", "1")
    assert compiled == []
    comp = train(small_data, tmp_path / "c", "--epochs", "1", "--compile", "true")
    assert comp["epochs"] == 1 and len(compiled) == 1
    le, lc = [json.loads((tmp_path / r / "log.jsonl").read_text()) for r in ("e", "c")]
    assert lc["view_agreement"] == le["view_agreement"] and lc["pl_std"] == le["pl_std"]
    assert lc["loss"] == pytest.approx(le["loss"], rel=1e-2)
    we, wc = _weights(tmp_path / "e" / "checkpoint.pth"), _weights(tmp_path / "c" / "checkpoint.pth")
    assert we.keys() == wc.keys()                       # no "_orig_mod." prefixes
    w0 = _weights(tmp_path / "c" / "checkpoint0000.pth")          # the random init: it trained
    assert not all(torch.equal(w0[k], wc[k]) for k in wc if wc[k].is_floating_point())
    utils.load_checkpoint(str(tmp_path / "c" / "checkpoint.pth"))
    assert train(small_data, tmp_path / "c", "--epochs", "2")["epochs"] == 2


def test_a_diverging_loss_stops_before_its_checkpoint(small_data, tmp_path):
    """The epoch whose loss is not finite commits nothing, and results.json marks the run failed
    with the epochs it finished, so that a study records it and goes on."""
    with pytest.raises(SystemExit, match="lower --lr"):
        train(small_data, tmp_path / "d", "--epochs", "1", "--lr", "1e30")
    assert not (tmp_path / "d" / "checkpoint.pth").exists()
    res = utils.read_results(str(tmp_path / "d"))
    assert res["failed"].startswith("diverged: the loss became") and "in epoch 1" in res["failed"]
    assert res["epochs"] == 0


def test_init_takes_another_runs_backbone_and_a_fresh_head(small_data, tmp_path):
    train(small_data, tmp_path / "src", "--epochs", "1")
    src = tmp_path / "src" / "checkpoint.pth"
    # another k: the head cannot come from the source, the backbone does
    res = train(small_data, tmp_path / "t", "--epochs", "1", "--k", "12", "--init", str(src))
    m_src, _ = utils.load_checkpoint(str(src))
    m0, ck0 = utils.load_checkpoint(str(tmp_path / "t" / "checkpoint0000.pth"))
    for (name, a), b in zip(m_src.backbone.state_dict().items(), m0.backbone.state_dict().values()):
        assert torch.equal(a, b), name
    assert m0.head.out_features == 12
    # with the source's own k the head is still fresh, not the source's
    train(small_data, tmp_path / "same_k", "--epochs", "1", "--init", str(src))
    m1, _ = utils.load_checkpoint(str(tmp_path / "same_k" / "checkpoint0000.pth"))
    assert m1.head.weight.shape == m_src.head.weight.shape
    assert not torch.equal(m1.head.weight, m_src.head.weight)
    assert ck0["args"]["init_from"]["sha256"] == utils.sha256_file(str(src))
    assert res["init_from"]["epoch"] == 1 and res["init_from"]["checkpoint"].endswith("checkpoint.pth")
    # the weights were trained from there, and a resumed run keeps the record
    train(small_data, tmp_path / "t2", "--epochs", "2", "--init", str(src), "--max-minutes", "1e-9")
    res2 = train(small_data, tmp_path / "t2", "--epochs", "2")
    assert res2["init_from"]["sha256"] == ck0["args"]["init_from"]["sha256"]


def test_init_from_another_backbone_is_refused(small_data, tmp_path):
    train(small_data, tmp_path / "src", "--epochs", "1")
    with pytest.raises(SystemExit, match="another backbone"):
        train(small_data, tmp_path / "t", "--epochs", "1", "--width", "16",
              "--init", str(tmp_path / "src" / "checkpoint.pth"))
    with pytest.raises(SystemExit, match="no such checkpoint"):
        train(small_data, tmp_path / "u", "--epochs", "1", "--init", str(tmp_path / "none.pth"))


def test_multi_head_run_labels_every_head_evenly(small_data, tmp_path):
    train(small_data, tmp_path / "h", "--epochs", "1", "--heads", "3", "--k", "8")
    ck = utils.load_file(tmp_path / "h" / "checkpoint.pth")
    pl = ck["pseudo_labels"]                     # (label_views * heads, n): view-major
    assert pl.shape == (ck["args"]["label_views"] * 3, 140)
    for row in pl:
        counts = torch.bincount(row, minlength=8)
        assert int(counts.max() - counts.min()) <= 1
    assert len({tuple(r.tolist()) for r in pl[:3]}) == 3   # each head its own labelling
    model, _ = utils.load_checkpoint(str(tmp_path / "h" / "checkpoint.pth"))
    assert model(torch.zeros(2, 3, 16, 16, dtype=torch.uint8)).shape == (2, 24)


def test_alexnet_with_an_embedding_trains_and_is_evaluated_on_it(small_data, tmp_path):
    import eval_knn
    with pytest.raises(SystemExit, match="img-size >= 63"):
        train(small_data, tmp_path / "x", "--epochs", "1", "--arch", "alexnet")
    train(small_data, tmp_path / "a", "--epochs", "1", "--arch", "alexnet", "--width", "8",
          "--img-size", "64", "--embed", "16")
    ckpt = str(tmp_path / "a" / "checkpoint.pth")
    res = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ckpt, "--feature", "embed", "--ks", "5", "--device", "cpu", "--no-progress"]))
    saved = json.loads((tmp_path / "a" / "knn_checkpoint_embed.json").read_text())
    assert saved["feat_dim"] == 16 and saved["knn_top1"] == res["knn_top1"]
    assert (tmp_path / "a" / "features_checkpoint_embed.pt").is_file()


def test_a_peer_without_lightly_stops_before_making_its_run_folder(small_data, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "lightly", None)      # as if it were not installed
    with pytest.raises(SystemExit, match="pip install -r requirements-peers.txt"):
        train(small_data, tmp_path / "run", "--method", "simclr")
    assert not (tmp_path / "run").exists()


def test_validation_split_is_held_out_monitored_and_kept_on_resume(small_data, tmp_path):
    """A new run trains on the training split less its validation part, and its kNN monitor
    scores that part (knn_split "val"); a run from before the validation split (no hold_out_val in
    its checkpoint) resumes on the whole training split, and asking it otherwise is one line."""
    train(small_data, tmp_path / "v", "--epochs", "1", "--knn-monitor", "1")
    row = json.loads((tmp_path / "v" / "log.jsonl").read_text().splitlines()[0])
    assert row["knn_split"] == "val" and 0 <= row["knn10"] <= 100
    assert utils.load_file(tmp_path / "v" / "checkpoint.pth")["args"]["hold_out_val"] is True
    old = tmp_path / "old"
    train(small_data, old, "--epochs", "1", "--hold-out-val", "false")
    for name in ("checkpoint.pth", "checkpoint0001.pth"):     # as a run made before the flag
        ck = utils.load_file(old / name)
        del ck["args"]["hold_out_val"]
        utils.save_checkpoint(ck, str(old / name))
    with pytest.raises(SystemExit, match="trained on the whole training split; resume it with "
                                         "--hold-out-val false"):
        train(small_data, old, "--epochs", "2", "--hold-out-val", "true")
    train(small_data, old, "--epochs", "2")
    ck = utils.load_file(old / "checkpoint.pth")
    assert ck["epoch"] == 2 and ck["pseudo_labels"].shape[1] == 160 and not ck["args"]["hold_out_val"]
