"""Collect the results of a data set's runs into results/<dataset>.md and .json, beside the paper.

    python report.py --dataset eurosat --runs runs --out results

Reads <runs>/<dataset>/ (OTL) and <runs>/<dataset>_supervised/ when present: knn_*.json and
linear_*.json for the final checkpoint and the random-init snapshot, log.jsonl and results.json.
--otl-run and --name report another run folder under another name, e.g. a run with other flags:

    python report.py --dataset eurosat --runs runs --otl-run eurosat_exact --name eurosat_exact
"""
import argparse
import json
import os
import platform

# The paper's numbers (Li et al. 2022, Table of remote-sensing results, ResNet-18, k = 128).
PAPER = {
    "eurosat": {"otl": {"knn": {"10": 94.4, "50": 94.7, "100": 94.6, "200": 94.4}, "linear": 95.9},
                "supervised": {"knn": {"10": 96.8, "50": 96.6, "100": 96.3, "200": 95.9},
                               "linear": 96.9}},
    # the small-set table: HMHR trained by OTL from a network pretrained by OTL on EuroSAT
    "hmhr": {"otl from eurosat": {"knn": {"10": 72.4, "50": 73.3, "100": 76.2, "200": 75.2},
                                  "linear": 81.9}},
}
KS = ("10", "50", "100", "200")


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="eurosat", choices=sorted(PAPER))
    p.add_argument("--runs", default="runs", help="folder holding the run folders")
    p.add_argument("--out", default="results", help="where <name>.md and <name>.json go")
    p.add_argument("--otl-run", default=None, help="the OTL run folder under --runs (default: "
                   "<dataset>)")
    p.add_argument("--name", default=None, help="the report's file name (default: <dataset>)")
    p.add_argument("--rows", nargs="+", metavar="LABEL=RUN", help="report these run folders under "
                   "--runs, one row each, instead of <dataset> and <dataset>_supervised (e.g. the "
                   "transfer runs: 'OTL from EuroSAT=hmhr_from_eurosat')")
    return p


def _load(path):
    if os.path.isfile(path):
        with open(path) as fh:
            return json.load(fh)
    return None


def run_summary(run_dir):
    """Accuracies of the final checkpoint and of the random-init snapshot of one run folder."""
    if not os.path.isdir(run_dir):
        return None
    out = {"run": run_dir, "train": _load(os.path.join(run_dir, "results.json"))}
    for tag, stem in (("final", "checkpoint"), ("random_init", "checkpoint0000")):
        knn = _load(os.path.join(run_dir, f"knn_{stem}.json"))
        lin = _load(os.path.join(run_dir, f"linear_{stem}.json"))
        out[tag] = {"knn": knn["knn_top1"] if knn else None,
                    "linear": lin["linear_top1"] if lin else None,
                    "epoch": (knn or lin or {}).get("epoch")}
    log = os.path.join(run_dir, "log.jsonl")
    if os.path.isfile(log):
        with open(log) as fh:
            out["log"] = [json.loads(line) for line in fh if line.strip()]
    return out


def _row(name, res, note=""):
    knn = res.get("knn") or {}
    cells = [f"{knn[k]:.1f}" if k in knn else "-" for k in KS]
    lin = f"{res['linear']:.1f}" if res.get("linear") is not None else "-"
    return f"| {name} | " + " | ".join(cells) + f" | {lin} | {note} |"


def main(args):
    paper = PAPER[args.dataset]
    report_name = args.name or args.dataset
    if args.rows:
        pairs = [r.split("=", 1) for r in args.rows]
        bad = [r for r, p in zip(args.rows, pairs) if len(p) != 2]
        if bad:
            raise SystemExit(f"--rows takes LABEL=RUN, got {bad}")
        runs = [(f"{label} (ours)", run_summary(os.path.join(args.runs, run))) for label, run in pairs]
        otl_run, sup_run = None, None
    else:
        otl_run = run_summary(os.path.join(args.runs, args.otl_run or args.dataset))
        sup_run = run_summary(os.path.join(args.runs, f"{args.dataset}_supervised"))
        runs = [("OTL (ours)", otl_run), ("supervised (ours)", sup_run)]
    lines = [f"# {report_name}: results", "",
             "Top-1 accuracy (%) on the test split (seeded random 20 %); kNN weighted by exp(sim/0.1).",
             "", "| model | kNN@10 | kNN@50 | kNN@100 | kNN@200 | linear | notes |",
             "|---|---|---|---|---|---|---|"]
    for name, run in runs:
        if run:
            tr = run.get("train") or {}
            note = (f"preset {tr.get('preset', '?')}, {tr.get('epochs', '?')} epochs, "
                    f"{tr.get('train_minutes', '?')} min on {tr.get('device', '?')}")
            if tr.get("init_from"):
                note += f", from {tr['init_from']['checkpoint']}"
            lines.append(_row(name, run["final"], note))
            if args.rows and run.get("random_init", {}).get("knn"):
                lines.append(_row(f"{name[:-7]}: its starting weights", run["random_init"],
                                  "epoch 0 of that run, before any training on this set"))
    rnd = (otl_run or sup_run or {}).get("random_init")
    if rnd:
        lines.append(_row("random init (ours)", rnd, "same architecture, untrained"))
    notes = {"otl": "ResNet-18, 300 epochs, 224 px", "supervised": "ResNet-18, 224 px",
             "otl from eurosat": "ResNet-18 pretrained by OTL on EuroSAT, then OTL, 224 px"}
    for key, val in paper.items():
        lines.append(_row(f"{key} (paper)".replace("otl", "OTL"), val, notes.get(key, "")))
    runs_out = {label: run for label, run in runs}
    lines += ["", f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{report_name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{report_name}.json"), "w") as fh:
        json.dump({"dataset": args.dataset, "otl": otl_run, "supervised": sup_run,
                   "runs": runs_out, "paper": paper,
                   "machine": {"machine": platform.machine(), "cpus": os.cpu_count(),
                               "platform": platform.platform()}}, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
