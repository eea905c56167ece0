"""ablations.py: each study on a tiny grid, end to end (runs, JSON, table, plot), the rule that a
rerun skips finished runs, and the label-bn experiment."""
import json
import os
import re
import runpy
import shutil
import sys

import pytest
import torch

import ablations
import otl
import train_otl
import utils

TINY_TRAIN = "--width 8 --img-size 16 --epochs 1 --batch-size 32 --k 16"


@pytest.fixture
def inline(monkeypatch):
    """The stage scripts run in this process (runpy, as `python script.py ...` would), which
    saves importing torch again in each child; test_failed_run_says_where_its_log_is
    keeps the real child processes."""
    calls = []

    def run_inline(cmd, log):
        calls.append(os.path.basename(cmd[1]))
        argv = sys.argv
        sys.argv = [cmd[1], *cmd[2:]]
        try:
            runpy.run_path(os.path.join(ablations.HERE, cmd[1]), run_name="__main__")
        finally:
            sys.argv = argv
    monkeypatch.setattr(ablations, "run_stage", run_inline)
    return calls


def run(*argv):
    return ablations.main(ablations.get_args_parser().parse_args(list(argv)))


def study(name, tmp_path, data, *extra):
    return run(name, "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--data",
               str(data), "--device", "cpu", "--no-progress", *extra)


def saved(tmp_path, name):
    stem = tmp_path / "out" / name
    out = json.loads(stem.with_suffix(".json").read_text())
    md = stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").stat().st_size > 1000
    assert out["command"] and out["git_commit"] and out["verdict"] in md
    return out, md


# ------------------------------------------------------------------------------------------------
# labeler studies
# ------------------------------------------------------------------------------------------------

def test_beta_study(small_data, tmp_path):
    study("beta", tmp_path, small_data, "--n", "150", "--k", "16", "--grid", "1.5,5")
    out, md = saved(tmp_path, "beta")
    rows = out["rows"]
    assert {(r["input"], r["beta"]) for r in rows} == {(i, b) for i in ("gaussian", "random_net")
                                                       for b in (1.5, 5.0)}
    for r in rows:
        assert r["method"] == "published" and r["k"] == 16 and r["n"] == 150
        # the history starts at argmax's std and ends at the final one; the labeler never ends worse
        assert r["std_history"][0] == pytest.approx(r["std_before"], abs=1e-3)
        assert r["std"] <= r["std_before"] + 1e-9
        assert len(r["std_history"]) == r["iterations"] + 1
    assert "| random_net | 5 |" in md


def test_k_labeler_and_sinkhorn_share_measurements(small_data, tmp_path):
    study("k-labeler", tmp_path, small_data, "--n", "150", "--grid", "10,20")
    out, _ = saved(tmp_path, "k-labeler")
    assert {(r["input"], r["k"], r["method"]) for r in out["rows"]} == {
        (i, k, m) for i in ("gaussian", "random_net") for k in (10, 20) for m in ("published", "reference")}
    for r in out["rows"]:
        if r["method"] == "reference":      # otl.py's exact labeler: as even as the integers allow
            assert r["max_minus_min"] <= 1
    store = tmp_path / "runs" / "study" / "labeler" / "measurements.jsonl"
    before = store.read_text().count("\n")
    study("sinkhorn", tmp_path, small_data, "--n", "150", "--grid", "10,20")
    out, _ = saved(tmp_path, "sinkhorn")
    # only the Sinkhorn-Knopp measurements were new; OTL's came from the store
    assert store.read_text().count("\n") == before + 4
    assert {r["method"] for r in out["rows"]} == {"published", "reference", "sinkhorn"}
    # the same input for every method: one (input, k) gives one std before labelling
    for i in ("gaussian", "random_net"):
        assert len({r["std_before"] for r in out["rows"] if r["input"] == i and r["k"] == 10}) == 1


def test_damaged_measurements_are_measured_again(small_data, tmp_path, capsys):
    """A line of measurements.jsonl cut short or with a field of the wrong type is dropped from
    the store with a warning naming it, and measured again."""
    study("k-labeler", tmp_path, small_data, "--n", "150", "--grid", "10")
    before = {r["key"]: r["std"] for r in saved(tmp_path, "k-labeler")[0]["rows"]}
    store = tmp_path / "runs" / "study" / "labeler" / "measurements.jsonl"
    lines = store.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "iterations": "x"})
    lines[3] = lines[3][:20]                    # a write cut short: no newline either
    store.write_text("\n".join(lines))
    capsys.readouterr()
    study("k-labeler", tmp_path, small_data, "--n", "150", "--grid", "10")
    printed = capsys.readouterr().out
    assert (f"warning: {store}: dropped damaged line(s) 2, 4, not a whole measurement; they are "
            "measured again") in printed
    assert f"k-labeler: 2 measured, 2 from {store}" in printed
    records = [json.loads(line) for line in store.read_text().splitlines()]
    assert len(records) == 4 and all(map(ablations.measurement_ok, records))
    assert {r["key"]: r["std"] for r in saved(tmp_path, "k-labeler")[0]["rows"]} == before


def test_labeler_study_rejects_k_above_n(small_data, tmp_path):
    with pytest.raises(SystemExit, match="k must lie in"):
        study("k-labeler", tmp_path, small_data, "--n", "100", "--grid", "200")


# ------------------------------------------------------------------------------------------------
# training studies: a grid of train_otl.py + eval runs
# ------------------------------------------------------------------------------------------------

def test_k_study_and_resume(small_data, tmp_path, inline):
    out = study("k", tmp_path, small_data, "--grid", "8,16", "--seeds", "0", "--train-args",
                TINY_TRAIN.replace(" --k 16", ""))
    assert out["ran"] == ["k8", "k16"]
    saved_out, md = saved(tmp_path, "k")
    assert [r["k"] for r in saved_out["rows"]] == [8, 16]
    for r in saved_out["rows"]:
        assert 0 <= r["knn10"] <= 100 and 0 <= r["linear"] <= 100 and r["epochs"] == 1
        assert r["preset"] == "cpu"
    run_dir = tmp_path / "runs" / "study" / "k" / "k16"
    ck = utils.load_file(run_dir / "checkpoint.pth")
    # the study scale: the cpu preset cut to 8 epochs (here 1, from --train-args)
    assert ck["model_cfg"]["k"] == 16 and ck["args"]["aug"] == "strong" and ck["args"]["views"] == 2
    assert "knn_init10" in saved_out["rows"][0]     # the random-init floor
    # n_train and k_clusters serve uneven's notes only: no constant n_train column here
    assert not any("n_train" in r or "k_clusters" in r for r in saved_out["rows"])
    assert "| k | knn10 |" in md
    assert inline == ["train_otl.py", "eval_knn.py", "eval_linear.py", "eval_knn.py"] + \
        ["train_otl.py", "eval_knn.py", "eval_linear.py"]
    # a rerun trains nothing and gives the same rows
    del inline[:]
    again = study("k", tmp_path, small_data, "--grid", "8,16", "--seeds", "0", "--train-args",
                  TINY_TRAIN.replace(" --k 16", ""))
    assert again["ran"] == [] and again["rows"] == saved_out["rows"] and inline == []
    # a run whose evaluation is missing is evaluated again, not retrained
    stamp = os.path.getmtime(run_dir / "results.json")
    os.remove(run_dir / "knn.json")
    third = study("k", tmp_path, small_data, "--grid", "8,16", "--seeds", "0", "--train-args",
                  TINY_TRAIN.replace(" --k 16", ""))
    assert third["ran"] == ["k16"] and (run_dir / "knn.json").is_file()
    assert inline == ["train_otl.py", "eval_knn.py"]    # train_otl.py finds the run finished
    assert os.path.getmtime(run_dir / "results.json") == stamp
    assert third["rows"] == saved_out["rows"]


K8 = ("--grid", "8", "--seeds", "0", "--train-args", TINY_TRAIN.replace(" --k 16", ""))


def test_a_stale_evaluation_of_a_study_run_is_made_again(small_data, tmp_path, inline, capsys):
    """An evaluation JSON of other weights than the run's checkpoint (its hash, or without one
    its epoch, says so) is deleted with a line naming both, and evaluated again."""
    first = study("k", tmp_path, small_data, *K8)
    run_dir = tmp_path / "runs" / "study" / "k" / "k8"
    knn = run_dir / "knn.json"
    js = json.loads(knn.read_text())
    sha = js["checkpoint_sha256"]
    knn.write_text(json.dumps({**js, "checkpoint_sha256": "0" * 64, "knn_top1": {"10": 99.0}}))
    init = run_dir / "knn_init.json"
    js = json.loads(init.read_text())
    del js["checkpoint_sha256"]                 # as written before evaluations recorded it
    init.write_text(json.dumps({**js, "epoch": 1}))
    capsys.readouterr()
    del inline[:]
    again = study("k", tmp_path, small_data, *K8)
    printed = capsys.readouterr().out
    assert inline == ["train_otl.py", "eval_knn.py", "eval_knn.py"]
    assert (f"{knn} is an evaluation of epoch 1 (sha256 000000000000), but the run's "
            f"{run_dir / 'checkpoint.pth'} is of epoch 1 (sha256 {sha[:12]}): deleted, it is "
            "evaluated again") in printed
    assert (f"{init} is an evaluation of epoch 1, but the run's {run_dir / 'checkpoint0000.pth'} "
            "is of epoch 0: deleted, it is evaluated again") in printed
    assert json.loads(knn.read_text())["checkpoint_sha256"] == sha
    assert json.loads(init.read_text())["epoch"] == 0
    assert again["ran"] == ["k8"] and again["rows"] == first["rows"]


def test_damaged_files_of_a_study_run_are_named(small_data, tmp_path, inline, capsys):
    """A damaged or wrongly typed evaluation JSON, results.json or study results JSON stops the
    study with one line naming it and what to do; a damaged log line is skipped with a warning."""
    first = study("k", tmp_path, small_data, *K8)["rows"]
    run_dir = tmp_path / "runs" / "study" / "k" / "k8"
    for path, text, expect in (
            (run_dir / "linear.json", '{"linear_top1": 5', r"linear\.json is damaged \(.*\); delete "
             r"it and run the same ablations\.py command again: it evaluates .*checkpoint\.pth again$"),
            (run_dir / "knn.json", '{"knn_top1": {"10": -5}, "epoch": 1}',
             r'knn\.json: "knn_top1" is \{"10": -5\}, not \{k: top-1 accuracy in \[0, 100\]\}'),
            (run_dir / "results.json", '{"epochs": "x"}', r'results\.json: "epochs" is "x", not a '
             r"whole number >= 0; delete it and run the run's train_otl\.py command"),
            (tmp_path / "out" / "k.json", '{"rows": [{"knn10": "x"}]}', r'k\.json: "rows" is .*; '
             r"restore it \(git checkout\), or delete it")):
        kept = path.read_text()
        path.write_text(text)
        with pytest.raises(SystemExit, match=expect) as e:
            study("k", tmp_path, small_data, *K8)
        assert "\n" not in str(e.value.code)
        path.write_text(kept)
    log = run_dir / "log.jsonl"
    log.write_text(log.read_text() + '{"epoch": 2, "lo\n')
    capsys.readouterr()
    assert study("k", tmp_path, small_data, *K8)["rows"] == first
    assert f"warning: {log}: skipped damaged line(s) 2, not a JSON record" in capsys.readouterr().out


def test_k_study_with_seeds(small_data, tmp_path, inline):
    study("k", tmp_path, small_data, "--grid", "8,16", "--seeds", "0,1", "--train-args",
          TINY_TRAIN.replace(" --k 16", ""))
    out, md = saved(tmp_path, "k")
    assert [(m["k"], m["seeds"]) for m in out["seed_means"]] == [(8, [0, 1]), (16, [0, 1])]
    v = out["verdict"]      # (tiny runs can tie: test_the_k_verdict_on_a_tie_names_no_best)
    assert ("kNN@50 best at k = " in v and " 2 sd" in v) or "at every k (8, 16): no best" in v
    assert "Trained on `" in md and "the paper's study trained AlexNet on CIFAR-10" in md


def test_uneven_study(small_data, tmp_path, inline):
    study("uneven", tmp_path, small_data, "--grid", "0,2", "--seeds", "0,1", "--train-args", TINY_TRAIN)
    out, md = saved(tmp_path, "uneven")
    assert [(r["x"], r["seed"]) for r in out["rows"]] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert "kNN@50 at x = 0 minus x = 2" in out["verdict"] and " 2 sd" in out["verdict"]
    ck = utils.load_file(tmp_path / "runs" / "study" / "uneven" / "x2" / "checkpoint.pth")
    assert ck["args"]["target_x"] == 2
    # the x = 2 run's pseudo-labels follow the uneven target: cluster 0 (i = 0) is empty
    counts = torch.bincount(ck["pseudo_labels"][0], minlength=16)
    assert torch.equal(counts.double(), otl.uneven_target(counts.sum().item(), 16, 2))
    assert "i = 0 .. k-1" in md
    # and the std of the targets this grid trained on: its own N and k, not the paper's
    n = len(ck["pseudo_labels"][0])
    assert {(r["n_train"], r["k_clusters"]) for r in out["rows"]} == {(n, 16)}
    std2 = otl.uneven_target(n, 16, 2, first=0).std().item()
    assert f"Trained here on N = {n:,} images, k = 16" in md and f"x = 2: {std2:.1f}" in md
    # the formula's stds beside the paper's printed ones: equal but for its two misprints
    std_rows = [r.split(" | ") for r in out["target_std"]]
    assert [r[3] for r in std_rows] == ["yes", "yes", "yes", "no", "no", "yes"]
    assert std_rows[4][1] == "762.63" and "654.3 (misprint; 762.6)" in std_rows[4][2]
    # a crafted checkpoint.pth in a finished run folder: the rerun reads its row, runs nothing
    marker = tmp_path / "ran"
    torch.save({"args": _Payload(marker), "pseudo_labels": None},
               tmp_path / "runs" / "study" / "uneven" / "x2" / "checkpoint.pth")
    with pytest.raises(SystemExit, match="refusing to load .*x2"):
        study("uneven", tmp_path, small_data, "--grid", "0,2", "--seeds", "0,1", "--train-args",
              TINY_TRAIN)
    assert not marker.exists()


class _Payload:
    """Unpickling this runs a command that writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_imbalanced_study(small_data, tmp_path, inline):
    study("imbalanced", tmp_path, small_data, "--grid", "0,1", "--seeds", "0,1", "--train-args",
          TINY_TRAIN)
    out, md = saved(tmp_path, "imbalanced")
    assert len(out["rows"]) == 8 and len(out["seed_means"]) == 4
    assert "uneven D_0 minus D_1" in out["verdict"] and "even minus uneven subset: D_0 " in out["verdict"]
    assert "d is the paper's scaled" in md and out["grid"] == [0, 1]
    rows = {r["subset"]: r for r in out["rows"] if r["d"] == 1 and r["seed"] == 0}
    # D_1 deletes 0 + 1 + ... + 9 = 45 of the 160 training images; the even subset is as large
    assert rows["uneven"]["n_train"] == rows["even"]["n_train"] == 160 - 45
    data = tmp_path / "runs" / "data"
    import utils
    d_un = utils.load_prepared(str(data / "data_D1_uneven"))
    d_ev = utils.load_prepared(str(data / "data_D1_even"))
    per_un = torch.bincount(d_un["labels"][d_un["train_idx"]], minlength=10)
    per_ev = torch.bincount(d_ev["labels"][d_ev["train_idx"]], minlength=10)
    assert per_un.tolist() == [16 - c for c in range(10)]
    assert int(per_ev.max() - per_ev.min()) <= 1
    assert torch.equal(d_un["test_idx"], utils.load_prepared(str(small_data))["test_idx"])


def test_splits_study(small_data, tmp_path, inline):
    """Each division: OTL and supervised from the --init backbone, on its own seeded 80/20
    split; the verdict gives both models' mean +- sd beside the paper's five divisions."""
    with pytest.raises(SystemExit, match="make eurosat"):
        study("splits", tmp_path, small_data, "--grid", "0", "--init", str(tmp_path / "none.pth"))
    pre = tmp_path / "pretrained"
    train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(pre), "--device", "cpu", "--no-progress",
         "--preset", "transfer-cpu", *TINY_TRAIN.split()]))
    study("splits", tmp_path, small_data, "--grid", "0,1", "--train-args", TINY_TRAIN,
          "--init", str(pre / "checkpoint.pth"))
    out, md = saved(tmp_path, "splits")
    assert [(r["seed"], r["model"]) for r in out["rows"]] == [
        (0, "OTL"), (0, "supervised"), (1, "OTL"), (1, "supervised")]
    for r in out["rows"]:
        flags = r["study_point"]["train_flags"]
        assert flags[flags.index("--init") + 1] == str(pre / "checkpoint.pth")
        assert ("--supervised" in flags) == (r["model"] == "supervised")
    assert "OTL over 2 divisions" in out["verdict"] and "supervised over 2 divisions" in out["verdict"]
    assert "(the paper's: 88.8 +- 2.0, 91.6 +- 1.7)" in out["verdict"]
    import utils
    a = utils.load_prepared(str(tmp_path / "runs" / "data" / "data_split0"))
    b = utils.load_prepared(str(tmp_path / "runs" / "data" / "data_split1"))
    assert not torch.equal(a["test_idx"], b["test_idx"])
    assert len(a["test_idx"]) == len(b["test_idx"]) == 40
    assert "+-" in out["verdict"]


def test_labeler_in_training_study(small_data, tmp_path, inline):
    """With two seeds a labeler the table gives mean +- sd, and the verdict weighs the gap between
    the labelers against 2 sd of the difference."""
    study("labeler-in-training", tmp_path, small_data, "--grid", "published,sinkhorn",
          "--seeds", "0,1", "--train-args", TINY_TRAIN)
    out, md = saved(tmp_path, "labeler-in-training")
    assert [(r["labeler"], r["seed"]) for r in out["rows"]] == [
        ("published", 0), ("published", 1), ("sinkhorn", 0), ("sinkhorn", 1)]
    runs = tmp_path / "runs" / "study" / "labeler-in-training"
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == [
        "published", "published_seed1", "sinkhorn", "sinkhorn_seed1"]
    log = (runs / "sinkhorn" / "log.jsonl").read_text()
    assert json.loads(log.splitlines()[0])["pl_std"] >= 0
    ck = utils.load_file(runs / "published_seed1" / "checkpoint.pth")
    assert ck["args"]["seed"] == 1 and ck["args"]["labeler"] == "published"
    means = out["seed_means"]
    assert [(m["labeler"], m["seeds"]) for m in means] == [("published", [0, 1]), ("sinkhorn", [0, 1])]
    for m in means:
        pair = [r["knn10"] for r in out["rows"] if r["labeler"] == m["labeler"]]
        assert m["knn10"] == pytest.approx(sum(pair) / 2, abs=0.01)
        assert m["knn10_sd"] == pytest.approx(abs(pair[0] - pair[1]) / 2 ** 0.5, abs=0.01)
        assert f"{m['knn10']:.1f} +- {m['knn10_sd']:.1f}" in md
    assert "published minus sinkhorn" in out["verdict"] or "sinkhorn minus published" in out["verdict"]
    assert " 2 sd" in out["verdict"]


def test_seeds_flag(small_data, tmp_path):
    parse = ablations.get_args_parser().parse_args
    assert ablations.parse_seeds(parse(["k"])) == [0, 1, 2]      # three a point at study scale
    assert ablations.parse_seeds(parse(["k", "--seed", "3"])) == [3]
    assert ablations.parse_seeds(parse(["labeler-in-training"])) == [0, 1, 2]
    assert ablations.parse_seeds(parse(["labeler-in-training", "--preset", "paper"])) == [0]
    assert ablations.parse_seeds(parse(["uneven", "--seeds", "2,5"])) == [2, 5]
    for bad in ("1,1", "a", ""):
        with pytest.raises(SystemExit, match="distinct integers"):
            ablations.parse_seeds(parse(["k", "--seeds", bad]))
    with pytest.raises(SystemExit):     # the splits study's grid is its seeds
        parse(["splits", "--seeds", "0,1"])


def test_a_run_made_with_other_flags_is_not_taken(small_data, tmp_path, inline):
    study("uneven", tmp_path, small_data, "--grid", "0", "--seeds", "0", "--train-args", TINY_TRAIN)
    with pytest.raises(SystemExit, match="holds a run of .* --epochs 1 .*delete that folder"):
        study("uneven", tmp_path, small_data, "--grid", "0", "--seeds", "0", "--train-args",
              TINY_TRAIN + " --lr 0.1")


def test_a_foreign_run_at_a_point_is_checked_against_its_flags(small_data, tmp_path, inline):
    """A run folder the study did not make (no study_point.json) is the point's only when its
    checkpoint was trained with the point's flags; otherwise the study stops naming each flag."""
    args = ["--grid", "16", "--seeds", "0", "--train-args", TINY_TRAIN]
    k16 = tmp_path / "runs" / "study" / "k" / "k16"
    train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(k16), "--device", "cpu", "--no-progress",
         "--preset", "cpu", "--epochs", "8", *TINY_TRAIN.split(), "--lr", "0.5", "--wd", "0"]))
    with pytest.raises(SystemExit, match=r"trained with other flags: --lr 0\.5 there, 0\.05 here, "
                                         r"--wd 0\.0 there, 0\.0005 here; delete that run folder"):
        study("k", tmp_path, small_data, *args)
    assert not (k16 / "study_point.json").exists()      # a rerun checks it again
    with pytest.raises(SystemExit, match="other flags"):
        study("k", tmp_path, small_data, *args)
    # the same flags: the run is taken (resumed, not trained anew) and recorded as the point's
    import shutil
    shutil.rmtree(k16)
    train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(k16), "--device", "cpu", "--no-progress",
         "--preset", "cpu", "--epochs", "8", *TINY_TRAIN.split()]))
    stamp = os.path.getmtime(k16 / "checkpoint.pth")
    out = study("k", tmp_path, small_data, *args)
    assert out["ran"] == ["k16"] and os.path.getmtime(k16 / "checkpoint.pth") == stamp
    assert (k16 / "study_point.json").is_file()


def test_partial_results_and_resume_from_results_json(small_data, tmp_path, inline, monkeypatch):
    """A study stopped after its first run has that run in its results (marked partial); a later
    session without the run folders takes finished runs from the results JSON instead of
    training them again, and trains only what is missing."""
    real = ablations.run_stage

    def fail_second_training(cmd, log):
        if os.path.basename(cmd[1]) == "train_otl.py" and "x2" in cmd[cmd.index("--output") + 1]:
            raise SystemExit("stopped")
        real(cmd, log)
    monkeypatch.setattr(ablations, "run_stage", fail_second_training)
    with pytest.raises(SystemExit, match="stopped"):
        study("uneven", tmp_path, small_data, "--grid", "0,2", "--seeds", "0", "--train-args", TINY_TRAIN)
    out, md = saved(tmp_path, "uneven")
    assert out["partial"] == "1 of 2 runs" and [r["x"] for r in out["rows"]] == [0]
    assert "Partial: 1 of the grid's 2 runs" in md
    first = out["rows"][0]

    # another machine: the runs are gone, the results JSON is there
    import shutil
    shutil.rmtree(tmp_path / "runs")
    monkeypatch.setattr(ablations, "run_stage", real)
    del inline[:]
    done = study("uneven", tmp_path, small_data, "--grid", "0,2", "--seeds", "0", "--train-args", TINY_TRAIN)
    assert done["ran"] == ["x2"] and inline == ["train_otl.py", "eval_knn.py"]
    assert done["rows"][0] == first and "partial" not in done
    assert not (tmp_path / "runs" / "study" / "uneven" / "x0").exists()
    # other flags do not take the recorded row: x0 is trained again
    del inline[:]
    again = study("uneven", tmp_path, small_data, "--grid", "0", "--seeds", "0", "--train-args", TINY_TRAIN + " --lr 0.1",
                  "--out", str(tmp_path / "out"))
    assert again["ran"] == ["x0"]


def partial_writes(monkeypatch):
    """[(rows' run names, partial)] of every partial results file the study writes."""
    calls, real = [], ablations.write_results

    def spy(st, args, rows, extra=None, partial=None, grid=None):
        if partial:
            calls.append(([os.path.basename(r["run"]) for r in rows], partial))
        return real(st, args, rows, extra, partial, grid)
    monkeypatch.setattr(ablations, "write_results", spy)
    return calls


def test_a_partial_results_file_keeps_the_rows_of_points_further_on(small_data, tmp_path, inline,
                                                                    monkeypatch):
    """A run made before points that are finished (their run folders here, or their rows in the
    results JSON) writes a partial file that keeps those later rows: a study stopped there loses
    none of them; --max-runs stops a study cleanly with such a file."""
    args = ["--grid", "0,2", "--seeds", "0", "--train-args", TINY_TRAIN]
    # --max-runs: a session that must end trains that many, writes what is finished and stops
    with pytest.raises(SystemExit, match="stopped before x2: --max-runs reached"):
        study("uneven", tmp_path, small_data, *args, "--max-runs", "1")
    out, _ = saved(tmp_path, "uneven")
    assert out["partial"] == "1 of 2 runs" and [r["x"] for r in out["rows"]] == [0]
    assert study("uneven", tmp_path, small_data, *args, "--max-runs", "1")["ran"] == ["x2"]
    path, writes = tmp_path / "out" / "uneven.json", partial_writes(monkeypatch)
    # x2's run folder is here and finished; x0's folder and the results file are gone
    shutil.rmtree(tmp_path / "runs" / "study" / "uneven" / "x0")
    path.unlink()
    assert study("uneven", tmp_path, small_data, *args)["ran"] == ["x0"]
    assert writes == [(["x0", "x2"], 2)]
    # another machine: no run folders, and the results file holds x2's row but not x0's
    shutil.rmtree(tmp_path / "runs")
    rec = json.loads(path.read_text())
    rec["rows"], rec["partial"] = [r for r in rec["rows"] if r["x"] == 2], "1 of 2 runs"
    path.write_text(json.dumps(rec))
    del writes[:]
    assert study("uneven", tmp_path, small_data, *args)["ran"] == ["x0"]
    assert writes == [(["x0", "x2"], 2)]


def test_lct_study(small_data, tmp_path, inline):
    study("lct", tmp_path, small_data, "--grid", "1-mean,2-sum", "--seeds", "0,1", "--train-args",
          TINY_TRAIN)
    out, _ = saved(tmp_path, "lct")
    assert [(r["views"], r["reduction"]) for r in out["rows"]] == [(1, "mean")] * 2 + [(2, "sum")] * 2
    assert "against 1 view(s) mean: 2 sum " in out["verdict"] and " 2 sd" in out["verdict"]
    ck = utils.load_file(tmp_path / "runs" / "study" / "lct" / "views2_sum" / "checkpoint.pth")
    assert ck["args"]["lct_reduction"] == "sum" and ck["args"]["views"] == 2 and ck["args"]["lct"]


def test_peers_study(small_data, tmp_path, inline):
    pytest.importorskip("lightly")
    study("peers", tmp_path, small_data, "--grid", "otl,simclr-otlaug", "--seeds", "0,1",
          "--tuned", "none", "--train-args", TINY_TRAIN + " --epochs 2")
    out, md = saved(tmp_path, "peers")
    # a peer with OTL's augmentation is a check beside the comparison: its first seed only
    assert [(r["method"], r["seed"]) for r in out["rows"]] == [("otl", 0), ("otl", 1),
                                                              ("simclr-otlaug", 0)]
    assert "OTL minus simclr-otlaug" in out["verdict"]
    for r in out["rows"]:
        assert r["epoch_s"] > 0 and r["peak_mib"] > 0 and r["curve"][0][1] >= 0
    assert "| method |" in md and "s / epoch" in md and "peak MiB" in md
    ck = utils.load_file(tmp_path / "runs" / "study" / "peers" / "simclr_otlaug" / "checkpoint.pth")
    assert ck["args"]["method"] == "simclr" and ck["args"]["peer_aug"] == "otl"


def test_peers_tune_tries_every_method_alike_and_selects_on_validation(small_data, tmp_path, inline):
    """A trial a grid value (method, view recipe, multiple of its reference lr), each trained with
    two seeds and scored on the validation split by their mean; each method's best trial by that
    mean selected, with its flags less the seed; what the tuning cost; a rerun trains nothing."""
    pytest.importorskip("lightly")
    pytest.importorskip("timm")
    grid = "otl:strong2:1,otl:simple:1,sela:simple:2,simclr:cifar:0.5,simclr:otl:1"
    args = ["--grid", grid, "--train-args", TINY_TRAIN]
    study("peers-tune", tmp_path, small_data, *args)
    out, md = saved(tmp_path, "peers-tune")
    rows = {(r["method"], r["views"], r["lr_x"], r["seed"]): r for r in out["rows"]}
    trials = [("otl", "strong2", 1), ("otl", "simple", 1), ("sela", "simple", 2),
              ("simclr", "cifar", 0.5), ("simclr", "otl", 1)]   # grid order: a tie goes to the first
    mean = {t: (rows[(*t, 0)]["knn_val10"] + rows[(*t, 1)]["knn_val10"]) / 2 for t in trials}
    ok = lambda t: not any(rows[(*t, s)].get("failed") for s in (0, 1))   # noqa: E731 (collapsed: never picked)
    # simclr tried x0.5 and x1, so its pick lies at an edge: one step past it on its views, both
    # seeds; otl and sela tried one lr each, no edge
    grid_pick = max((t for t in trials if t[0] == "simclr" and ok(t)), key=mean.get)
    step = ("simclr", grid_pick[1], 2.0 if grid_pick[2] == 1 else 0.25)
    assert set(rows) == {(*t, s) for t in [*trials, step] for s in (0, 1)}
    assert rows[(*step, 1)]["beyond"] and not any(rows[(*t, 0)].get("beyond") for t in trials)
    trials.append(step)
    runs = tmp_path / "runs" / "study" / "peers-tune"
    ck = utils.load_file(runs / "simclr_cifar_0p5_seed1" / "checkpoint.pth")["args"]
    assert (ck["optimizer"], ck["peer_aug"], ck["recipe"], ck["seed"]) == ("lars", "cifar", "solo-learn", 1)
    assert ck["lr"] == pytest.approx(0.4 * 0.5) and ck["wd"] == 1e-4     # solo-learn's, at batch 256
    ck = utils.load_file(runs / "sela_simple_2" / "checkpoint.pth")["args"]
    assert (ck["labeler"], ck["aug"], ck["optimizer"]) == ("sinkhorn", "simple", "sgd")
    assert ck["lr"] == pytest.approx(2 * 0.05)                            # the cpu preset's x 2
    for r in out["rows"]:
        assert 0 <= r["knn_val10"] <= 100 and 0 <= r["linear_val"] <= 100 and "knn10" not in r
    sel = out["selected"]
    assert set(sel) == {"otl", "sela", "simclr"}
    for method in sel:      # the best mean over the two seeds, not the best single run
        mine = {t: (rows[(*t, 0)]["knn_val10"] + rows[(*t, 1)]["knn_val10"]) / 2
                for t in trials if t[0] == method and ok(t)}
        best = max(mine, key=mine.get)
        assert (sel[method]["views"], sel[method]["lr_x"]) == best[1:]
        assert sel[method]["knn_val10"] == pytest.approx(mine[best], abs=0.01)
        assert sel[method]["seeds"] == [0, 1] and "--seed" not in sel[method]["flags"]
    assert "--lr" in sel["simclr"]["flags"]
    assert out["verdict"].startswith(f"selected by validation kNN@10: otl {sel['otl']['views']} "
                                     f"lr x{sel['otl']['lr_x']:g}")
    # still at the edge where the step beyond won; otl tried x1 alone
    simclr_part = out["verdict"].split("simclr ")[1].split(";")[0]
    assert ("at the edge of the lrs tried" in simclr_part) == (sel["simclr"]["lr_x"] == step[2])
    assert "at the edge" not in out["verdict"].split("otl ")[1].split(";")[0]
    assert "CPU hours" in md and "test split unread" in md and "| selected |" in md
    assert "6 trial(s) in 12 run(s)" in md and f"(x{step[2]:g}, beyond)" in md
    assert "seeds 0, 1 a trial, scored by their mean" in md and "a grid point" not in md
    assert study("peers-tune", tmp_path, small_data, *args)["ran"] == []


def test_a_diverged_trial_is_a_failed_row_and_the_tune_goes_on(small_data, tmp_path, inline,
                                                               monkeypatch):
    """A trial whose loss diverges (here SeLa's, its lr made absurd) is recorded failed, without
    scores, never selected; the trials after it train; a rerun neither trains nor evaluates it."""
    point = ablations.tune_point
    monkeypatch.setattr(ablations, "tune_point", lambda g: (lambda f: (
        f[0], f[1] + ["--lr", "1e30"] * g.startswith("sela")))(point(g)))
    grid = "sela:simple:1,otl:simple:1,otl:strong2:1"
    args = ["--grid", grid, "--train-args", TINY_TRAIN]
    study("peers-tune", tmp_path, small_data, *args)
    out, md = saved(tmp_path, "peers-tune")
    rows = {(r["method"], r["views"], r["seed"]): r for r in out["rows"]}
    trials = [("sela", "simple"), ("otl", "simple"), ("otl", "strong2")]
    assert set(rows) == {(*t, s) for t in trials for s in (0, 1)} and "partial" not in out
    for s in (0, 1):
        assert rows[("sela", "simple", s)]["failed"].startswith("diverged: the loss became")
        assert "knn_val10" not in rows[("sela", "simple", s)]
        assert all("knn_val10" in rows[(*t, s)] for t in trials[1:])
    collapsed = sum(any(rows[(*t, s)].get("failed") for s in (0, 1)) for t in trials[1:])
    assert set(out["selected"]) == ({"otl"} if collapsed < 2 else set())
    assert f"{1 + collapsed} trial(s) failed (collapsed or diverged)" in out["verdict"]
    assert "| seed(s) 0, 1 of 2 diverged |" in md
    assert study("peers-tune", tmp_path, small_data, *args)["ran"] == []


def test_peers_at_their_tuned_recipes_at_equal_epochs_and_equal_time(small_data, tmp_path, inline):
    """Each method at the trial peers-tune selected, a -time point at the epochs that match OTL's
    minutes, OTL against each method paired over the seeds; then SIRI-WHU's protocol from each
    seed's own backbone."""
    pytest.importorskip("lightly")
    pytest.importorskip("timm")
    with pytest.raises(SystemExit, match="run `make peers-tune` first"):
        study("peers", tmp_path, small_data, "--grid", "otl,simclr")
    study("peers-tune", tmp_path, small_data, "--grid", "otl:strong2:2,simclr:cifar:0.5",
          "--seeds", "0", "--train-args", TINY_TRAIN)
    # at the cpu preset, a selected trial keeps its recipe but not the tuning's preset and epochs
    args = ablations.get_args_parser().parse_args(
        ["peers", "--preset", "cpu", "--out", str(tmp_path / "out"), "--data", str(small_data),
         "--grid", "otl,simclr"])
    for name, _, _, flags in ablations.STUDIES["peers"].runs(args):
        assert flags[:2] == ["--preset", "cpu"] and flags.count("--preset") == 1, name
        assert "--epochs" not in flags and "--lr" in flags, name
    study("peers", tmp_path, small_data, "--grid", "otl,simclr,simclr-time", "--seeds", "0,1",
          "--train-args", TINY_TRAIN.replace("--epochs 1", "--epochs 2"))
    out, md = saved(tmp_path, "peers")
    runs = tmp_path / "runs" / "study" / "peers"
    ck = utils.load_file(runs / "simclr_seed1" / "checkpoint.pth")["args"]
    assert (ck["recipe"], ck["optimizer"], ck["peer_aug"], ck["seed"]) == ("solo-learn", "lars", "cifar", 1)
    assert ck["lr"] == pytest.approx(0.2) and ck["epochs"] == 2
    assert utils.load_file(runs / "otl" / "checkpoint.pth")["args"]["lr"] == pytest.approx(0.1)
    means = {r["method"]: r for r in out["seed_means"]}
    # the epochs of equal minutes: from OTL's and SimCLR's epochs timed one after another, each
    # at its tuned flags, not from the equal-epoch runs
    sec = {}
    for m in ("otl", "simclr"):
        log = utils.read_log(runs / "timing" / m / "log.jsonl")
        assert len(log) == 2 and out["timing"][m]["timed_epoch_s"] == log[-1]["epoch_s"]
        sec[m] = log[-1]["epoch_s"]
    assert utils.load_file(runs / "timing" / "simclr" / "checkpoint.pth")["args"]["lr"] == pytest.approx(0.2)
    assert out["equal_time_epochs"] == {"simclr": max(1, round(2 * sec["otl"] / sec["simclr"]))}
    timed = utils.load_file(runs / "simclr_time" / "checkpoint.pth")["args"]
    assert timed["epochs"] == out["equal_time_epochs"]["simclr"]
    assert "simclr " in md.split("Equal wall-clock")[1].split("\n")[0]
    assert "OTL minus simclr: " in out["verdict"] and "2 paired seeds" in out["verdict"]
    assert set(means["otl"]["by_seed"]["knn50"]) == {"0", "1"}
    assert "the test split, read once a run" in md and "Equal wall-clock" in md
    assert study("peers", tmp_path, small_data, "--grid", "otl,simclr,simclr-time", "--seeds", "0,1",
                 "--train-args", TINY_TRAIN.replace("--epochs 1", "--epochs 2"))["ran"] == []
    study("peers-transfer", tmp_path, small_data, "--grid", "simclr", "--seeds", "0,1",
          "--train-args", TINY_TRAIN)
    out, _ = saved(tmp_path, "peers-transfer")
    for r in out["rows"]:       # each seed from its own backbone, the recipe's lr left behind
        name = "simclr" if r["seed"] == 0 else "simclr_seed1"
        ck = utils.load_file(tmp_path / "runs" / "study" / "peers-transfer" / name / "checkpoint.pth")["args"]
        assert ck["init"].endswith(os.path.join("peers", name, "checkpoint.pth")) and ck["seed"] == r["seed"]
        assert ck["peer_aug"] == "cifar" and ck["recipe"] == "ours" and ck["optimizer"] == "sgd"
        assert ck["preset"] == "transfer-cpu"       # not the tuning's cpu preset


def test_peers_at_the_cpu_scale_then_on_another_set_from_each_backbone(small_data, tmp_path, inline):
    pytest.importorskip("lightly")
    with pytest.raises(SystemExit, match="run `python ablations.py peers --preset cpu` first"):
        study("peers-transfer", tmp_path, small_data, "--preset", "cpu", "--grid", "otl,byol",
              "--tuned", "none", "--seeds", "0")
    study("peers", tmp_path, small_data, "--preset", "cpu", "--grid", "otl,byol", "--train-args",
          TINY_TRAIN, "--tuned", "none", "--seeds", "0")
    out, _ = saved(tmp_path, "peers_cpu")
    assert [r["method"] for r in out["rows"]] == ["otl", "byol"] and out["rows"][1]["seed"] == 0
    assert "(one seed: no interval)" in out["verdict"] and "ranked: " in out["verdict"]
    runs = tmp_path / "runs" / "cpu"
    assert utils.load_file(runs / "peers" / "otl" / "checkpoint.pth")["args"]["epochs"] == 1
    study("peers-transfer", tmp_path, small_data, "--preset", "cpu", "--grid", "otl,byol",
          "--train-args", TINY_TRAIN, "--tuned", "none", "--seeds", "0")
    out, md = saved(tmp_path, "peers-transfer_cpu")
    for r in out["rows"]:       # each method from its own backbone, trained on by its own loss
        ck = utils.load_file(runs / "peers-transfer" / r["method"] / "checkpoint.pth")
        assert ck["args"]["init"].endswith(os.path.join("cpu", "peers", r["method"], "checkpoint.pth"))
        assert ck["args"]["method"] == r["method"] and ck["args"]["preset"] == "transfer-cpu"
        assert 0 <= r["knn_init10"] <= 100      # the backbone frozen, before training on this set
    assert "knn10 before" in md and "each point from its own `peers` run" in md


def test_bad_grid_fails(small_data, tmp_path):
    with pytest.raises(SystemExit, match="choose from"):
        study("labeler-in-training", tmp_path, small_data, "--grid", "kmeans")
    with pytest.raises(SystemExit, match="grid values are like"):
        study("k", tmp_path, small_data, "--grid", "ten")


def test_failed_run_says_where_its_log_is(small_data, tmp_path):
    with pytest.raises(SystemExit, match="resumes here"):
        study("k", tmp_path, small_data, "--grid", "8", "--seeds", "0", "--train-args", TINY_TRAIN + " --lr -1")


def test_imbalanced_d_too_large(small_data, tmp_path):
    with pytest.raises(SystemExit, match="use a smaller d"):
        study("imbalanced", tmp_path, small_data, "--grid", "2", "--seeds", "0", "--train-args", TINY_TRAIN)


# ------------------------------------------------------------------------------------------------
# label-bn
# ------------------------------------------------------------------------------------------------

def test_label_bn_study(small_data, tmp_path):
    out = run("label-bn", "--data", str(small_data), "--output", str(tmp_path / "bn"), "--k", "16",
              "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    saved_bn = json.loads((tmp_path / "bn" / "label_bn.json").read_text())
    assert saved_bn["results"] == json.loads(json.dumps(out["results"]))
    assert (saved_bn["n"], saved_bn["k"], saved_bn["width"], saved_bn["img_size"]) == (160, 16, 8, 16)
    for bn in ("eval", "batch"):
        r = saved_bn["results"][bn]
        assert 1 <= r["clusters_used_before"] <= 16
        # the labelers never end worse than where argmax alone left the counts
        assert r["std_published"] <= r["std_before"] + 1e-9 and r["std_ours"] <= r["std_before"] + 1e-9
        assert r["std_max"] == pytest.approx(160 / 16 * 15 ** 0.5)
    assert saved_bn["command"] and saved_bn["git_commit"]


def test_label_bn_measures_a_trained_network(small_data, tmp_path):
    """With a train_otl.py run in --output, its checkpoint is the network measured."""
    run_dir = tmp_path / "run"
    train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(run_dir), "--width", "8", "--img-size", "16",
         "--k", "16", "--batch-size", "32", "--epochs", "1", "--preset", "cpu", "--device", "cpu",
         "--no-progress"]))
    fresh = run("label-bn", "--data", str(small_data), "--output", str(tmp_path / "fresh"), "--k",
                "16", "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    trained = run("label-bn", "--data", str(small_data), "--output", str(run_dir), "--k", "16",
                  "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    assert (run_dir / "label_bn.json").is_file()
    assert trained["results"]["batch"]["spread"] != fresh["results"]["batch"]["spread"]


def test_the_docs_list_every_study():
    """docs/ablations.md's table of the studies is STUDIES, in its order (the Makefile's targets:
    tests/test_makefile.py)."""
    with open(os.path.join(ablations.HERE, "docs", "ablations.md")) as fh:
        assert re.findall(r"^\| `([\w-]+)` \|", fh.read(), re.M) == list(ablations.STUDIES)


def test_unknown_study_fails():
    with pytest.raises(SystemExit):
        ablations.get_args_parser().parse_args(["nope"])


def test_plot_has_no_empty_panel(tmp_path, monkeypatch):
    """A study without a linear probe (lct, uneven, imbalanced) shows kNN@200 beside kNN@10;
    one with it shows the linear probe."""
    plt = pytest.importorskip("matplotlib.pyplot")
    made, real = [], plt.subplots

    def spy(*a, **kw):
        fig, axes = real(*a, **kw)
        made.append(axes)
        return fig, axes

    monkeypatch.setattr(plt, "subplots", spy)
    ablations.plot("lct", [{"views": 1, "reduction": "mean", "knn10": 30.0, "knn200": 31.0}],
                   tmp_path / "a.png")
    assert made[-1][1].get_ylabel() == "knn200 top-1 (%)"
    assert made[-1][1].patches[0].get_height() == 31.0
    ablations.plot("splits", [{"seed": 0, "knn10": 30.0, "knn200": 31.0, "linear": 40.0, "model": "OTL"},
                              {"seed": 3, "knn10": 34.0, "knn200": 33.0, "linear": 42.0, "model": "OTL"}],
                   tmp_path / "b.png")
    assert made[-1][1].get_ylabel() == "linear top-1 (%)"
    # seeds are not an axis: integer ticks at the seeds, and the mean as a line
    knn = made[-1][0]
    assert list(knn.get_xticks()) == [0, 3]
    assert any(list(line.get_ydata()) == [32.0, 32.0] for line in knn.get_lines())


def test_the_two_sd_rule():
    """A difference of two grid points' means counts when it exceeds 2 sd of the difference,
    sqrt(sd_a^2 / n_a + sd_b^2 / n_b) over their seeds; one seed a point gives no verdict."""
    uneven, labelers = (ablations.STUDIES[s].verdict for s in ("uneven", "labeler-in-training"))

    def pt(x, m, sd, n=3):
        return {"x": x, "knn50": m, "knn50_sd": sd, "seeds": list(range(n))}
    d, sd = ablations._diff(pt(0, 70.0, 1.0), pt(10, 66.0, 2.0), "knn50")
    assert d == 4.0 and sd == pytest.approx((1 / 3 + 4 / 3) ** 0.5)
    clear = uneven([pt(0, 70.0, 1.0), pt(10, 66.0, 2.0)])
    assert clear.startswith("agrees") and "+4.0 +- 1.3, beyond 2 sd" in clear
    noisy = uneven([pt(0, 70.0, 3.0), pt(10, 66.0, 3.0)])
    assert noisy.startswith("not shown (within 2 sd)") and "+4.0 +- 2.4, within 2 sd" in noisy
    wrong = uneven([pt(0, 60.0, 1.0), pt(10, 66.0, 1.0)])
    assert wrong.startswith("disagrees")
    one = uneven([pt(0, 70.0, 0.0, 1), pt(10, 66.0, 0.0, 1)])
    assert one.startswith("cannot tell (one seed)")
    assert uneven([pt(0, 70.0, 1.0)]) == "one grid point: nothing to compare"
    # labeler-in-training: the best labeler against each other one, each by the same rule
    def lab(name, m, sd):
        return {**pt(0, m, sd), "labeler": name}
    rows = [lab("published", 66.0, 1.0), lab("exact", 70.0, 1.0), lab("sinkhorn", 69.0, 1.0)]
    v = labelers(rows)
    assert "exact minus published: +4.0 +- 0.8, beyond 2 sd" in v
    assert "exact minus sinkhorn: +1.0 +- 0.8, within 2 sd" in v
    assert v.endswith("exact measurably above published")
    rows[0] = lab("published", 69.5, 1.0)
    assert labelers(rows).endswith(
        ": no labeler is measurably better")


def test_rewrite_trains_nothing(small_data, tmp_path, inline):
    """--rewrite writes the table, verdict and plot again from the results JSON's rows alone."""
    study("uneven", tmp_path, small_data, "--grid", "0,2", "--seeds", "0", "--train-args", TINY_TRAIN)
    first, _ = saved(tmp_path, "uneven")
    import shutil
    shutil.rmtree(tmp_path / "runs")
    del inline[:]
    study("uneven", tmp_path, small_data, "--rewrite")
    again, md = saved(tmp_path, "uneven")
    assert inline == [] and again["rows"] == first["rows"] and again["verdict"] == first["verdict"]
    assert "Rewritten from the 2 rows of" in md and "nothing trained" in md
    # the grid and data the JSON recorded, not the study's defaults: report.py reads both
    assert again["grid"] == first["grid"] == [0, 2] and again["data"] == first["data"] == str(small_data)
    (tmp_path / "out" / "uneven.json").write_text(json.dumps({**again, "grid": 5}))
    with pytest.raises(SystemExit, match=r'uneven\.json: "grid" is 5, not a list; restore it'):
        study("uneven", tmp_path, small_data, "--rewrite")
    with pytest.raises(SystemExit, match="run the study first"):
        study("k", tmp_path, small_data, "--rewrite")


def _committed(name):
    """(stem, scale) of each committed results JSON of the study: results/ablations/<study> (make
    ablation-<study>) or results/<study> (make peers), at any scale (<study>_<scale>)."""
    return [(stem, scale) for folder in (os.path.join("results", "ablations"), "results")
            for scale in ablations.SCALES
            for stem in [os.path.join(ablations.HERE, folder, name + ("" if scale == "study" else f"_{scale}"))]
            if os.path.isfile(stem + ".json")]


@pytest.mark.parametrize("name", sorted(ablations.STUDIES))
def test_committed_results_are_what_their_rows_give(name, tmp_path):
    """Each committed results JSON of a study: its verdict, table and the .md from its verdict on
    are what the study makes of its rows again (training studies by --rewrite, the labeler
    studies from a measurement store of their rows), so a change to how a study is summarised
    shows here until its results are written again."""
    found = _committed(name)
    if not found:
        pytest.skip(f"no committed {name}.json")
    for src, scale in found:
        with open(src + ".json") as fh:
            committed = json.load(fh)
        out = tmp_path / scale / "out"
        out.mkdir(parents=True)
        if ablations.STUDIES[name].kind == "labeler":   # every measurement from the store
            store = tmp_path / scale / "runs" / "study" / "labeler"
            store.mkdir(parents=True)
            (store / "measurements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in committed["rows"]))
            made = run(name, "--runs", str(tmp_path / scale / "runs"), "--out", str(out), "--device",
                       "cpu", "--no-plot", "--no-progress")
        else:
            (out / (os.path.basename(src) + ".json")).write_text(json.dumps(committed))
            made = run(name, "--rewrite", "--preset", scale, "--out", str(out), "--no-plot",
                       "--no-progress")
        assert made["rows"] == committed["rows"] and made["verdict"] == committed["verdict"], src
        assert made.get("grid") == committed.get("grid") or ablations.STUDIES[name].kind == "labeler"
        with open(src + ".md") as fh:
            want = fh.read().splitlines()
        got = (out / (os.path.basename(src) + ".md")).read_text().splitlines()
        ours = f"Ours: {committed['verdict']}."
        assert got[got.index(ours):-1] == want[want.index(ours):-1], src   # all but Made by


def _rewrite_of(tmp_path, name, edit):
    """--rewrite of the committed results/ablations/<name>.json after `edit` changed its dict."""
    with open(os.path.join(ablations.HERE, "results", "ablations", name + ".json")) as fh:
        js = json.load(fh)
    edit(js)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / (name + ".json")).write_text(json.dumps(js))
    made = run(name, "--rewrite", "--out", str(out), "--no-plot", "--no-progress")
    return made, (out / (name + ".md")).read_text()


def test_rewrite_keeps_a_partial_study_partial(tmp_path):
    def cut(js):
        js["rows"] = js["rows"][:12]
        js["partial"] = "12 of 21 runs"
    made, md = _rewrite_of(tmp_path, "k", cut)
    assert made["partial"] == "12 of 21 runs" and "Partial: 12 of the grid's 21 runs" in md
    with pytest.raises(SystemExit, match=r'"partial" is \'5 of 21 runs\', not "12 of M runs"'):
        _rewrite_of(tmp_path, "k", lambda js: (cut(js), js.update(partial="5 of 21 runs")))


def test_rewrite_of_peers_keeps_the_epochs_a_resumed_study_trains_to(tmp_path):
    """A resumed `make peers` reads its -time points' epochs and their timing from the results
    JSON; a --rewrite in between must not drop them, or the resumed study would time anew."""
    with open(os.path.join(ablations.HERE, "results", "peers.json")) as fh:
        js = json.load(fh)
    epochs, timing = {"simclr": 6}, {"otl": {"timed_epoch_s": 9.0}, "simclr": {"timed_epoch_s": 12.0}}
    js.update(equal_time_epochs=epochs, timing=timing)
    out = tmp_path / "out"
    out.mkdir()
    (out / "peers.json").write_text(json.dumps(js))
    made = run("peers", "--rewrite", "--out", str(out), "--no-plot", "--no-progress")
    again = json.loads((out / "peers.json").read_text())
    assert made["equal_time_epochs"] == again["equal_time_epochs"] == epochs
    assert again["timing"] == timing and again["rows"] == js["rows"]


@pytest.mark.parametrize("name, edit, says", [
    ("k", lambda rows: rows[3].pop("k"), r"row 4 \(run '.*'\): 'k' is None, not a number"),
    ("k", lambda rows: rows[0].update(k="16"), r"row 1 .*'k' is '16', not a number"),
    ("k", lambda rows: rows[2].update(train_minutes="x"), r"row 3 .*'train_minutes' is 'x', not a number"),
    ("imbalanced", lambda rows: rows.append(dict(rows[5])), r"row 31 .* repeats an earlier row's run"),
    ("imbalanced", lambda rows: rows[0].update(subset="odd"),
     r"row 1 .*'subset' is 'odd', not one of even, uneven"),
    ("k", lambda rows: rows[1].pop("run"), r"row 2 \(run None\) has no run folder name"),
])
def test_rewrite_refuses_a_hand_edited_row_naming_it(tmp_path, name, edit, says):
    with pytest.raises(SystemExit, match=says):
        _rewrite_of(tmp_path, name, lambda js: edit(js["rows"]))


def test_the_k_verdict_on_a_tie_names_no_best():
    verdict = ablations.STUDIES["k"].verdict
    rows = [{"k": k, "knn50": 60.0, "knn50_sd": 1.0, "seeds": [0, 1, 2]} for k in (16, 32)]
    v = verdict(rows)
    assert v.startswith("kNN@50 60.0 at every k (16, 32): no best") and "worst at k = 16" not in v
    rows[1]["knn50"] = 65.0
    assert verdict(rows).startswith("kNN@50 best at k = 32 (65.0), worst at k = 16 (60.0)")


def test_budget_study(small_data, tmp_path, inline, monkeypatch):
    """Each configuration's epoch timed once, its epochs set to fit the budget, trained with the
    validation kNN logged every epoch; then the two best by validation kNN@10 and the cpu preset's
    own with the other seeds; every figure of the validation split, the test split unread; a rerun trains nothing."""
    # a budget near the tiny network's epoch, so each run trains an epoch or two (the rule keeps one)
    args = ["--grid", "32px-w32,48px-w32,32px-w32-small", "--seeds", "0,1", "--budget-minutes",
            "0.01", "--train-args",
            "--width 8 --batch-size 64 --k 16 --views 1 --label-views 1 --lct false --aug simple"]
    writes = partial_writes(monkeypatch)
    study("budget", tmp_path, small_data, *args)
    out, md = saved(tmp_path, "budget")
    seed0 = {r["config"]: r for r in out["rows"] if r["seed"] == 0}
    # every partial file holds every run finished so far, the first pass's last one included
    names = [os.path.basename(r["run"]) for r in out["rows"]]
    assert ([n for n in names if "seed" not in n], len(names)) in writes
    assert all(p in (3, len(names)) and set(w) <= set(names) for w, p in writes)
    assert [len(w) for w, _ in writes] == sorted(len(w) for w, _ in writes)
    assert set(seed0) == {"32px-w32", "48px-w32", "32px-w32-small"}
    best = sorted(seed0.values(), key=lambda r: -r["knn_val10"])[:2]
    more = {r["config"] for r in best} | {"32px-w32"}       # and the cpu preset's own
    assert sorted(r["config"] for r in out["rows"] if r["seed"] == 1) == sorted(more)
    runs = tmp_path / "runs" / "study" / "budget"
    for r in out["rows"]:
        assert r["epochs"] == r["epochs_fit"] == max(1, int(0.01 * 60 // r["timed_epoch_s"]))
        assert r["curve_split"] == "val" and len(r["curve"]) == r["epochs"]
        assert 0 <= r["knn_val10"] <= 100 and 0 <= r["linear_val"] <= 100 and "knn10" not in r
        ev = json.loads((runs / os.path.basename(r["run"]) / "knn_val.json").read_text())
        assert ev["split"] == "val" and ev["n_test"] == 20          # 2 of each class's 16
    ck = utils.load_file(runs / "48px_w32" / "checkpoint.pth")
    assert ck["args"]["img_size"] == 48 and ck["args"]["cutout"] == 24 and ck["args"]["knn_monitor"] == 1
    assert (runs / "timing" / "32px_w32_small" / "log.jsonl").is_file()
    assert "validation kNN@10" in out["verdict"] and "| 48px-w32 | 48 | 32 | imagenet |" in md
    first = out["verdict"].split(" ")[0]                     # the best by its seeds' mean
    assert ("minus the cpu preset's 32px-w32" in out["verdict"]) == (first != "32px-w32")
    assert "test split is not read" in md
    amp = {r["config"]: r["amp"] for r in out["rows"]}      # each run's arithmetic, recorded
    assert all(isinstance(a, bool) for a in amp.values()) and " precision |" in md
    assert f"| {ablations.precision({'amp': amp['32px-w32']})} |" in md
    assert study("budget", tmp_path, small_data, *args)["ran"] == []
    assert set(out["timing"]) == set(seed0)       # every configuration's timed epoch, kept
    shutil.rmtree(runs / "timing")                # elsewhere: the JSON's timings, none again
    assert study("budget", tmp_path, small_data, *args)["ran"] == []
    assert not (runs / "timing").exists()
    # a partial study written again (--rewrite) keeps the timings of the runs still to come
    path = tmp_path / "out" / "budget.json"
    part = json.loads(path.read_text())
    part["rows"] = [r for r in part["rows"] if r["config"] != "48px-w32"]
    part["partial"] = f"{len(part['rows'])} of {len(out['rows'])} runs"
    path.write_text(json.dumps(part))
    again = study("budget", tmp_path, small_data, *args, "--rewrite", "--no-plot")
    assert again["timing"] == out["timing"] and again["partial"] == part["partial"]
    assert any(n.startswith("Trained on") and "0.01 minutes" in n for n in again["notes"])


def test_precision_cell_names_each_seeds_arithmetic():
    rows = [{"point": "p", "run": f"r{s}", "seed": s, "knn_val10": 70.0 + s, "amp": a}
            for s, a in enumerate([True, False, False])]
    mean = ablations.seed_means(rows)[0]
    assert mean["amp"] == [True, False, False]
    assert ablations.precision(mean) == "bf16, fp32, fp32"
    same = ablations.seed_means([dict(r, amp=False) for r in rows])[0]
    assert same["amp"] is False and ablations.precision(same) == "fp32"
    assert ablations.precision({"knn10": 1.0}) == ""        # a run from before the record


def test_budget_study_refuses_what_it_cannot_time(small_data, tmp_path):
    with pytest.raises(SystemExit, match="--budget-minutes must be > 0"):
        study("budget", tmp_path, small_data, "--budget-minutes", "0")
    with pytest.raises(SystemExit, match="run it with --preset study"):
        study("budget", tmp_path, small_data, "--preset", "paper")
    with pytest.raises(SystemExit, match="choose from 32px-w32"):
        study("budget", tmp_path, small_data, "--grid", "40px-w48")
