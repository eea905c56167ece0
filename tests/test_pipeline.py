"""The stages end to end on real EuroSAT images: train_otl (OTL and supervised) -> eval_knn ->
eval_linear -> report."""
import json
import os


import eval_knn
import eval_linear
import report
import utils
from test_train_otl import train


def test_end_to_end_train_evaluate_report(small_data, tmp_path):
    runs = tmp_path / "runs"
    train(small_data, runs / "eurosat", "--epochs", "2", "--views", "2", "--label-views", "2",
          "--aug", "strong", "--lct", "true")
    train(small_data, runs / "eurosat_supervised", "--epochs", "1", "--supervised")
    for run in ("eurosat", "eurosat_supervised"):
        for stem in ("checkpoint", "checkpoint0000"):
            ck = str(runs / run / f"{stem}.pth")
            k = eval_knn.main(eval_knn.get_args_parser().parse_args(
                ["--checkpoint", ck, "--device", "cpu", "--no-progress"]))
            lin = eval_linear.main(eval_linear.get_args_parser().parse_args(
                ["--checkpoint", ck, "--device", "cpu", "--no-progress"]))
            assert all(0 <= v <= 100 for v in k["knn_top1"].values())
            assert 0 <= lin["linear_top1"] <= 100
            assert os.path.isfile(runs / run / f"knn_{stem}.json")
            assert os.path.isfile(runs / run / f"linear_{stem}.json")
    sup = utils.load_checkpoint(str(runs / "eurosat_supervised" / "checkpoint.pth"))[0]
    assert sup.cfg.k == 10  # the supervised head has one output per class
    out = tmp_path / "results"
    report.main(report.get_args_parser().parse_args(["--runs", str(runs), "--out", str(out)]))
    md = (out / "eurosat.md").read_text()
    assert "OTL (ours)" in md and "supervised (ours)" in md and "random init (ours)" in md
    assert "94.4" in md  # the paper's row
    assert "random 20 % test split (40 images)" in md   # the split, from the data's manifest
    js = json.loads((out / "eurosat.json").read_text())
    assert js["otl"]["final"]["knn"] and js["otl"]["random_init"]["linear"] is not None
    # another run name (make eurosat-gpu's eurosat_fast): its supervised twin is <name>_supervised
    for run in ("eurosat", "eurosat_supervised"):
        os.rename(runs / run, runs / run.replace("eurosat", "eurosat_fast"))
    report.main(report.get_args_parser().parse_args(
        ["--runs", str(runs), "--out", str(out), "--otl-run", "eurosat_fast", "--name", "fast"]))
    fast = json.loads((out / "fast.json").read_text())
    assert fast["otl"]["final"] == js["otl"]["final"]
    assert fast["supervised"]["final"] == js["supervised"]["final"]
    for run in ("eurosat", "eurosat_supervised"):
        os.rename(runs / run.replace("eurosat", "eurosat_fast"), runs / run)
    # another run folder under another name: its own report, the same numbers
    report.main(report.get_args_parser().parse_args(
        ["--runs", str(runs), "--out", str(out), "--otl-run", "eurosat", "--name", "eurosat_again",
         "--machine", "a GPU elsewhere"]))
    again = json.loads((out / "eurosat_again.json").read_text())
    assert again["otl"]["final"] == js["otl"]["final"]
    md_again = (out / "eurosat_again.md").read_text()
    assert md_again.startswith("# eurosat_again: results")
    # runs made on another machine: the report names it, and where the report was made
    assert "Machine: a GPU elsewhere (the report made on" in md_again and "Machine: a GPU" not in md
    assert again["machine"]["runs_ran_on"] == "a GPU elsewhere" and js["machine"]["runs_ran_on"] is None


def test_feature_auto_and_the_overview_of_every_table(small_data, tmp_path):
    """eval_*.py --feature auto takes the embedding of a model that has one (files named _embed),
    report.py --feature auto reads them, and --overview writes every table of the paper: our run
    where one exists, a row that says why for every data set without one."""
    runs = tmp_path / "runs"
    train(small_data, runs / "a", "--epochs", "1", "--arch", "alexnet", "--width", "8",
          "--img-size", "64", "--embed", "16", "--heads", "2")
    ck = str(runs / "a" / "checkpoint.pth")
    k = eval_knn.main(eval_knn.get_args_parser().parse_args(
        ["--checkpoint", ck, "--device", "cpu", "--no-progress", "--feature", "auto", "--ks", "10", "50"]))
    lin = eval_linear.main(eval_linear.get_args_parser().parse_args(
        ["--checkpoint", ck, "--device", "cpu", "--no-progress", "--feature", "auto"]))
    saved = json.loads((runs / "a" / "knn_checkpoint_embed.json").read_text())
    assert saved["feat_dim"] == 16 and saved["knn_top1"] == k["knn_top1"]
    assert json.loads((runs / "a" / "linear_checkpoint_embed.json").read_text())["feat_dim"] == 16
    out = tmp_path / "results"
    report.main(report.get_args_parser().parse_args(
        ["--dataset", "cifar10", "--runs", str(runs), "--out", str(out), "--otl-run", "a",
         "--feature", "auto"]))
    js = json.loads((out / "cifar10.json").read_text())
    assert js["otl"]["feature"] == "embed"
    assert js["otl"]["final"]["linear"] == lin["linear_top1"]
    # the paper's natural-image layers: kNN on the embedding, the linear probe on conv5
    lin5 = eval_linear.main(eval_linear.get_args_parser().parse_args(
        ["--checkpoint", ck, "--device", "cpu", "--no-progress", "--feature", "conv5"]))
    report.main(report.get_args_parser().parse_args(
        ["--dataset", "cifar10", "--runs", str(runs), "--out", str(out), "--otl-run", "a",
         "--feature", "auto", "--linear-feature", "conv5"]))
    js5 = json.loads((out / "cifar10.json").read_text())
    assert js5["otl"]["final"]["knn"] == js["otl"]["final"]["knn"]
    assert js5["otl"]["final"]["linear"] == lin5["linear_top1"] and js5["otl"]["linear_feature"] == "conv5"
    assert "embed (kNN), conv5 (linear)" in (out / "cifar10.md").read_text()
    # the overview: every table of the paper, ours from the report JSONs in --results (here
    # cifar10.json of run a), the paper's misprints marked, a line for each table without a run
    report.main(report.get_args_parser().parse_args(["--overview", "--out", str(out)]))
    md = (out / "tables.md").read_text()
    tables = json.loads(open(os.path.join(utils.REPO, "paper_tables.json")).read())["tables"]
    for label, t in tables.items():
        assert f"## `{label}`: {t['caption']}" in md
    assert md.count(" misprint (") == sum(len(t["misprints"]) for t in tables.values())
    ev_knn = md.split("## `ev-knn`")[1].split("\n## ")[0]
    ours = [line for line in ev_knn.splitlines() if line.startswith("| OTL (ours) |")]
    assert len(ours) == 2 and f"| {k['knn_top1']['50']:.1f} |" in ours[0]
    assert "| linear | conv5 |" in ours[1] and f"| {lin5['linear_top1']:.1f} |" in ours[1]
    assert "no run of cifar100 here" in ev_knn and "no run of cifar10 here" not in ev_knn
    for ds in ("ucmerced", "siri_whu", "aid", "patternnet", "nwpu_resisc45", "imagenet"):
        assert f"no run of {ds} here" in md
    assert "| paper: OTL | 94.4 | 94.7 | 94.6 | 94.4 | 95.9 |  |" in md
    # the toy model's IND and DIS, computed by otl.py from the corrected cluster sizes
    assert "| Case 3 | 2 | 2 | 0 | 2†1 | 2 | 4 | 2, 4 |" in md


def _imbalanced_json(results, grid, ds):
    """A results/ablations/imbalanced.json as ablations.py writes it: seed means of the points
    in ds (a subset of grid), kNN@50 = d / 10 + 1 for the uneven subsets, + 2 for the even."""
    rows = [{"d": d, "subset": sub, "seeds": [0, 1, 2], "preset": "cpu", "epochs": 8,
             "knn50": d / 10 + (1 if sub == "uneven" else 2), "knn50_sd": 0.5, "knn_init50": 48.3}
            for d in ds for sub in ("uneven", "even")]
    (results / "ablations").mkdir(parents=True, exist_ok=True)
    (results / "ablations" / "imbalanced.json").write_text(json.dumps(
        {"study": "imbalanced", "data": "data/eurosat", "grid": grid, "rows": rows, "seed_means": rows}))


def test_overview_puts_a_scaled_imbalanced_grid_under_the_papers_columns(tmp_path):
    """EuroSAT's imbalanced study deletes d = 40 .. 200 where the paper's CIFAR-10 one deletes
    100 .. 500: the overview fills D_100 .. D_500 in order, says which d went where, and leaves
    '-' under the columns a partial study has not reached."""
    def imb_rows():
        report.main(report.get_args_parser().parse_args(
            ["--overview", "--out", str(tmp_path), "--results", str(tmp_path)]))
        sec = (tmp_path / "tables.md").read_text().split("## `imb-data`")[1].split("\n## ")[0]
        return {ln.split(" | ")[0]: ln.split(" | ") for ln in sec.splitlines() if ln.startswith("| ours")}
    grid = [40, 80, 120, 160, 200]
    _imbalanced_json(tmp_path, grid, grid)
    rows = imb_rows()
    assert rows["| ours: uneven, kNN@50"][1:6] == ["5.0 +- 0.5", "9.0 +- 0.5", "13.0 +- 0.5",
                                                  "17.0 +- 0.5", "21.0 +- 0.5"]
    assert rows["| ours: even, kNN@50"][1] == "6.0 +- 0.5"
    note = rows["| ours: uneven, kNN@50"][6]
    assert "d = 40, 80, 120, 160, 200 under the paper's columns" in note
    assert "preset cpu for 8 epochs" in note and "not the paper's CIFAR-10" in note
    _imbalanced_json(tmp_path, grid, [40, 80])        # partial: the grid recorded, two points in
    assert imb_rows()["| ours: uneven, kNN@50"][1:6] == ["5.0 +- 0.5", "9.0 +- 0.5", "-", "-", "-"]


def test_overview_takes_the_gpu_transfer_reports_beside_the_cpu_ones(tmp_path):
    """make hmhr-gpu's and siri_whu-gpu's reports are rows of the transfer tables, each saying
    where it ran; a table whose GPU report is missing keeps its
    CPU rows alone."""
    def rep(path, knn10, where=None):
        run = {"final": {"knn": {"10": knn10}, "linear": knn10 + 1},
               "train": {"preset": "transfer", "epochs": 64, "train_minutes": 0.4, "init_from": "bb"}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"dataset": "hmhr", "runs": {"OTL from EuroSAT OTL (ours)": run},
                                    "machine": {"cpus": 2, "runs_ran_on": where}}))
    rep(tmp_path / "hmhr_transfer.json", 70.0)
    rep(tmp_path / "hmhr_gpu_transfer.json", 81.5, "one NVIDIA H200")
    report.main(report.get_args_parser().parse_args(
        ["--overview", "--out", str(tmp_path), "--results", str(tmp_path)]))
    md = (tmp_path / "tables.md").read_text()
    hrs = md.split("## `hrs`")[1].split("\n## ")[0]
    ours = [ln for ln in hrs.splitlines() if ln.startswith("| ours: OTL from EuroSAT OTL |")]
    assert len(ours) == 2 and "| 70.0 |" in ours[0] and "on 2 CPU cores" in ours[0]
    assert "| 81.5 |" in ours[1] and "on one NVIDIA H200" in ours[1]
    assert "`results/hmhr_gpu_transfer.json`" in ours[1]
    whu = md.split("## `whu`")[1].split("\n## ")[0]
    assert "| ours:" not in whu and "no run of siri_whu here" in whu
