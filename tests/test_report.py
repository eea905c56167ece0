"""report.py reading run folders: an evaluation of other weights than the run's checkpoint is
refused naming both, and a damaged or wrongly typed results.json, evaluation JSON or log.jsonl
is one line naming the file (or a warning and the line skipped), never a traceback or an absurd
number in the table."""
import hashlib
import json
import shutil

import pytest

import eval_knn
import eval_linear
import report
from test_train_otl import train


def make_report(runs, out, *extra):
    report.main(report.get_args_parser().parse_args(["--runs", str(runs), "--out", str(out), *extra]))
    return json.loads((out / "eurosat.json").read_text())


def refused(runs, out, *extra):
    """The one-line message that stops the report."""
    with pytest.raises(SystemExit) as e:
        make_report(runs, out, *extra)
    msg = str(e.value.code)
    assert "\n" not in msg
    return msg


def evaluate(run, stem="checkpoint"):
    ck = str(run / f"{stem}.pth")
    for script in (eval_knn, eval_linear):
        script.main(script.get_args_parser().parse_args(
            ["--checkpoint", ck, "--device", "cpu", "--no-progress"]))


def fake_run(runs, epochs=2):
    """A run folder as train_otl.py and eval_*.py leave it, without the checkpoints (a report made
    on another machine than the runs): results.json, a log and the four evaluation JSONs."""
    run = runs / "eurosat"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(
        {"epochs": epochs, "preset": "cpu", "train_minutes": 0.5, "device": "cpu",
         "checkpoint": str(run / "checkpoint.pth"), "init_from": None}))
    (run / "log.jsonl").write_text("".join(json.dumps({"epoch": e, "loss": 2.0 / e, "pl_std": 0.5,
                                                       "labeler_s": 0.1}) + "\n"
                                           for e in range(1, epochs + 1)))
    for stem, ep in (("checkpoint", epochs), ("checkpoint0000", 0)):
        common = {"epoch": ep, "checkpoint": str(run / f"{stem}.pth"), "n_test": 40}
        (run / f"knn_{stem}.json").write_text(json.dumps(
            {"knn_top1": {"10": 60.0 + ep, "50": 55.0}, **common}))
        (run / f"linear_{stem}.json").write_text(json.dumps({"linear_top1": 70.0 + ep, **common}))
    return run


def edit(path, **fields):
    js = json.loads(path.read_text())
    js.update(fields)
    path.write_text(json.dumps(js))


def test_a_stale_evaluation_is_refused_naming_both_sides(small_data, tmp_path):
    """Evaluated at epoch 2, then the run continued to 4 epochs: the report stops, naming the
    evaluation and its epoch and hash, the checkpoint and its epoch and hash, and the command that
    evaluates it again; once it has run, the report gives the 4-epoch run's numbers."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = runs / "eurosat"
    train(small_data, run, "--epochs", "2")
    evaluate(run)
    evaluate(run, "checkpoint0000")
    assert make_report(runs, out)["otl"]["final"]["epoch"] == 2
    # other weights of the same epoch in checkpoint.pth: only the hash tells them apart
    kept = (run / "checkpoint.pth").read_bytes()
    shutil.copy(run / "checkpoint0000.pth", run / "checkpoint.pth")
    msg = refused(runs, out)
    knn = json.loads((run / "knn_checkpoint.json").read_text())
    assert msg.startswith(f"{run / 'knn_checkpoint.json'} is an evaluation of epoch 2 (sha256 "
                          f"{knn['checkpoint_sha256'][:12]})")
    assert f"the run's {run / 'checkpoint.pth'} is of epoch 2 (sha256 " in msg
    (run / "checkpoint.pth").write_bytes(kept)
    train(small_data, run, "--epochs", "4")
    msg = refused(runs, out)
    assert f"{run / 'knn_checkpoint.json'} is an evaluation of epoch 2" in msg
    assert f"the run's {run / 'checkpoint.pth'} is of epoch 4 (sha256 " in msg
    assert msg.endswith(f"evaluate it again: python eval_knn.py --checkpoint {run / 'checkpoint.pth'}")
    # an evaluation JSON from before they recorded the hash: the epochs tell
    js = json.loads((run / "knn_checkpoint.json").read_text())
    del js["checkpoint_sha256"]
    (run / "knn_checkpoint.json").write_text(json.dumps(js))
    assert "is an evaluation of epoch 2, but the run's" in refused(runs, out)
    evaluate(run)
    js = make_report(runs, out)
    assert js["otl"]["final"]["epoch"] == 4
    assert js["otl"]["final"]["knn"] == json.loads((run / "knn_checkpoint.json").read_text())["knn_top1"]
    assert "4 epochs" in (out / "eurosat.md").read_text()


def test_stale_by_epoch_without_the_checkpoint(tmp_path):
    """Run folders copied without their checkpoints: results.json's epochs against the
    evaluation's, and the random-init evaluation must be of epoch 0."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs)
    assert make_report(runs, out)["otl"]["final"]["knn"]["10"] == 62.0
    edit(run / "results.json", epochs=4)
    msg = refused(runs, out)
    assert msg.startswith(f"{run / 'knn_checkpoint.json'} is an evaluation of epoch 2, but the "
                          f"run's {run / 'checkpoint.pth'} is of epoch 4")
    edit(run / "results.json", epochs=2)
    edit(run / "linear_checkpoint0000.json", epoch=3)
    msg = refused(runs, out)
    assert f"{run / 'linear_checkpoint0000.json'} is an evaluation of epoch 3" in msg
    assert msg.endswith(f"python eval_linear.py --checkpoint {run / 'checkpoint0000.pth'}")


def test_an_evaluation_past_results_json_says_the_run_has_not_finished(tmp_path):
    """The evaluation is of checkpoint.pth as it is (the same sha256), but of a later epoch than
    results.json's: the run was continued and stopped before it finished."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs)
    (run / "checkpoint.pth").write_bytes(b"the weights of epoch 3")
    edit(run / "knn_checkpoint.json", epoch=3,
         checkpoint_sha256=hashlib.sha256(b"the weights of epoch 3").hexdigest())
    assert refused(runs, out) == (
        f"{run / 'results.json'} says 2 epochs, but {run / 'checkpoint.pth'}, evaluated in "
        f"{run / 'knn_checkpoint.json'}, is of epoch 3: the run has not finished; run its "
        "train_otl.py command again, then evaluate it again")


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],            # a write cut short
    lambda text: "\udcff" + text,                    # bytes that are not UTF-8
    lambda text: "[1, 2]",
])
def test_a_damaged_evaluation_json_is_named(tmp_path, damage):
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs)
    path = run / "knn_checkpoint.json"
    path.write_bytes(damage(path.read_text()).encode("utf-8", "surrogateescape"))
    msg = refused(runs, out)
    assert msg.startswith(str(path)) and ("damaged" in msg or "not a JSON object" in msg)
    assert msg.endswith(f"run python eval_knn.py --checkpoint {run / 'checkpoint.pth'} again")


@pytest.mark.parametrize("file, field, value", [
    ("knn_checkpoint.json", "knn_top1", "x"),
    ("knn_checkpoint.json", "knn_top1", {"10": 1e9}),
    ("linear_checkpoint.json", "linear_top1", 1e9),
    ("linear_checkpoint.json", "linear_top1", -5),
    ("linear_checkpoint0000.json", "linear_top1", float("nan")),
    ("linear_checkpoint.json", "linear_top1", None),
    ("knn_checkpoint.json", "epoch", 2.5),
    ("results.json", "epochs", "4"),
    ("results.json", "train_minutes", "soon"),
])
def test_a_wrongly_typed_field_is_refused_naming_file_and_field(tmp_path, file, field, value):
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs)
    edit(run / file, **{field: value})
    msg = refused(runs, out)
    assert msg.startswith(f'{run / file}: "{field}" is ')
    assert ("train_otl.py" if file == "results.json" else "eval_") in msg
    assert not (out / "eurosat.md").exists()


def test_missing_fields_and_a_damaged_results_json(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs)
    js = json.loads((run / "linear_checkpoint.json").read_text())
    del js["linear_top1"]
    (run / "linear_checkpoint.json").write_text(json.dumps(js))
    assert refused(runs, out).startswith(f'{run / "linear_checkpoint.json"} has no "linear_top1"')
    shutil.rmtree(runs)
    run = fake_run(runs)
    (run / "results.json").write_text('{"epochs": 2, "pre')
    msg = refused(runs, out)
    assert msg.startswith(f"{run / 'results.json'} is damaged (")
    assert msg.endswith(f"delete it and run the run's train_otl.py command (--output {run}) "
                        "again: it writes it anew")


def test_damaged_log_lines_are_skipped_with_a_warning(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "out"
    run = fake_run(runs, epochs=4)
    lines = (run / "log.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]                                         # cut short
    lines[2] = json.dumps({"epoch": 3, "loss": "x", "pl_std": None, "labeler_s": 0.2})
    lines.insert(3, "[3]")
    lines.append(json.dumps({"loss": 0.1}))                          # no epoch
    (run / "log.jsonl").write_text("\n".join(lines) + "\n")
    js = make_report(runs, out)
    printed = capsys.readouterr().out
    assert f"warning: {run / 'log.jsonl'}: skipped damaged line(s) 2, 4, 6," in printed
    assert f"warning: {run / 'log.jsonl'}: left out fields that are not finite numbers, line(s) " \
           "3 (loss, pl_std)" in printed
    assert [r["epoch"] for r in js["otl"]["log"]] == [1, 3, 4]
    assert js["otl"]["log"][1] == {"epoch": 3, "labeler_s": 0.2}


def test_a_damaged_report_json_stops_the_overview(tmp_path):
    (tmp_path / "eurosat.json").write_text('{"dataset": "eurosat", "ot')
    with pytest.raises(SystemExit, match=r"eurosat\.json is damaged .*results/README\.md"):
        report.main(report.get_args_parser().parse_args(["--overview", "--out", str(tmp_path)]))


def test_a_run_of_other_data_is_refused_and_a_subset_is_named(tmp_path):
    """report.py --dataset eurosat reads the manifest of the data each run was evaluated on: another
    data set is refused, a --per-class subset or classes unlike EuroSAT's are said in its row."""
    run = fake_run(tmp_path / "runs")
    data = tmp_path / "data"
    data.mkdir()
    for f in run.glob("*_checkpoint*.json"):
        edit(f, data_dir=str(data))
    man = {"dataset": "hmhr", "classes": ["a", "b", "c", "d"], "n_images": 240, "split": "random",
           "test_frac": 0.2, "key": {"per_class": 60}, "registry_notes": []}
    (data / "manifest.json").write_text(json.dumps(man))
    msg = refused(tmp_path / "runs", tmp_path / "out")
    assert "prepared as --dataset hmhr, not eurosat" in msg and str(data) in msg
    (data / "manifest.json").write_text(json.dumps({**man, "dataset": "folder"}))
    make_report(tmp_path / "runs", tmp_path / "out")
    md = (tmp_path / "out" / "eurosat.md").read_text()
    assert "prepared as --dataset folder (4 classes), not checked against eurosat's classes" in md
    diff = "the classes differ from eurosat's 10: missing ['AnnualCrop']"
    (data / "manifest.json").write_text(json.dumps({**man, "dataset": "eurosat", "registry_notes": [diff]}))
    make_report(tmp_path / "runs", tmp_path / "out")
    md = (tmp_path / "out" / "eurosat.md").read_text()
    assert "a --per-class 60 subset (240 images in 4 classes)" in md and diff in md
