"""Collect the results of a data set's runs into results/<dataset>.md and .json, beside the paper.

    python report.py --dataset eurosat --runs runs --out results

Reads <runs>/<dataset>/ (OTL) and <runs>/<dataset>_supervised/ when present: knn_*.json and
linear_*.json for the final checkpoint and the random-init snapshot, log.jsonl and results.json.
--otl-run and --name report another run folder under another name, e.g. a run with other flags:

    python report.py --dataset eurosat --runs runs --otl-run eurosat_exact --name eurosat_exact

--overview writes results/tables.md instead: the paper's three tables (ResNet-18 on remote
sensing, AlexNet and ResNet-50 on natural images), one row per data set, ours where a run
exists and an empty row that says why where none does.

    python report.py --overview --runs runs --out results
"""
import argparse
import json
import os
import platform

# The paper's numbers (Li et al. 2022), where this repository has them transcribed: EuroSAT's
# table (ResNet-18, k = 128) and HMHR's from a network pretrained on EuroSAT.  Every other data
# set of the paper has an entry with no numbers: its table is in the paper, not copied here yet.
PAPER = {
    "eurosat": {"otl": {"knn": {"10": 94.4, "50": 94.7, "100": 94.6, "200": 94.4}, "linear": 95.9},
                "supervised": {"knn": {"10": 96.8, "50": 96.6, "100": 96.3, "200": 95.9},
                               "linear": 96.9}},
    # the small-set table: HMHR trained by OTL from a network pretrained by OTL on EuroSAT
    "hmhr": {"otl from eurosat": {"knn": {"10": 72.4, "50": 73.3, "100": 76.2, "200": 75.2},
                                  "linear": 81.9}},
    "ucmerced": {}, "siri_whu": {}, "aid": {}, "patternnet": {}, "nwpu_resisc45": {},
    "cifar10": {}, "cifar100": {}, "svhn": {}, "imagenet": {},
}
# The paper's tables: (title, network, data sets, the run folder of a data set under --runs)
TABLES = [
    ("ResNet-18 on remote-sensing images (k = 128, seeded 80/20 split)", "resnet18",
     ("eurosat", "ucmerced", "siri_whu", "aid", "patternnet", "nwpu_resisc45", "hmhr"), "{}"),
    ("AlexNet on natural images (kNN on the 128-d embedding)", "alexnet",
     ("cifar10", "cifar100", "svhn", "imagenet"), "{}"),
    ("ResNet-50 on natural images", "resnet50", ("cifar10", "cifar100", "svhn"), "{}_resnet50"),
]
SHARED = {"eurosat": "EuroSAT.zip", "hmhr": "HMHR.zip", "cifar10": "cifar10_jpg.zip"}
DOWNLOADS = ("eurosat", "cifar10", "cifar100", "svhn")   # prepare_data.py --download works
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
    p.add_argument("--feature", default="pool", help="the evaluated layer (eval_knn.py --feature): "
                   "pool reads knn_<checkpoint>.json, another layer knn_<checkpoint>_<layer>.json, "
                   "auto the embedding's where the run has them, else pool's")
    p.add_argument("--machine", default=None, help="where the runs ran, when the report is made "
                   "elsewhere (e.g. 'NVIDIA H100 80GB HBM3'); default: this machine")
    p.add_argument("--overview", action="store_true", help="write <out>/tables.md: the paper's "
                   "three tables, every data set a row (--dataset is ignored)")
    p.add_argument("--run-for", nargs="+", default=[], metavar="TABLE:DATASET=RUN", help="with "
                   "--overview: take this run folder for a row instead of <dataset> "
                   "(<dataset>_resnet50 for ResNet-50), e.g. resnet18:eurosat=eurosat_exact")
    return p


def _load(path):
    if os.path.isfile(path):
        with open(path) as fh:
            return json.load(fh)
    return None


def _split_of(res):
    """What the evaluation's test split was, from its data set's manifest: 'official' or the
    seeded random fraction, and how many test images."""
    n = res.get("n_test")
    man = _load(os.path.join(res.get("data_dir") or "", "manifest.json")) or {}
    if man.get("split") == "official":
        return f"the official test split ({n:,} images)" if n else "the official test split"
    frac = man.get("test_frac") or 0.2
    what = f"a seeded, stratified random {round(100 * frac)} % test split"
    return f"{what} ({n:,} images)" if n else what


def run_summary(run_dir, feature="pool"):
    """Accuracies of the final checkpoint and of the random-init snapshot of one run folder."""
    if not os.path.isdir(run_dir):
        return None
    out = {"run": run_dir, "train": _load(os.path.join(run_dir, "results.json")), "feature": feature}
    if feature == "auto":   # as eval_*.py --feature auto: the embedding's results where there are
        feature = "embed" if os.path.isfile(os.path.join(run_dir, "knn_checkpoint_embed.json")) else "pool"
        out["feature"] = feature
    sfx = "" if feature == "pool" else f"_{feature}"
    for tag, stem in (("final", "checkpoint"), ("random_init", "checkpoint0000")):
        knn = _load(os.path.join(run_dir, f"knn_{stem}{sfx}.json"))
        lin = _load(os.path.join(run_dir, f"linear_{stem}{sfx}.json"))
        if tag == "final" and (knn or lin):
            out["test_split"] = _split_of(knn or lin)
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


def _note(run):
    tr = run.get("train") or {}
    note = (f"preset {tr.get('preset', '?')}, {tr.get('epochs', '?')} epochs, "
            f"{tr.get('train_minutes', '?')} min on {tr.get('device', '?')}")
    if run.get("feature", "pool") != "pool":
        note += f", features: {run['feature']}"
    if tr.get("init_from"):
        note += f", from {tr['init_from']['checkpoint']}"
    return note


def overview(args):
    """results/tables.md: the paper's tables, a row per data set, ours beside the paper's."""
    here = os.path.dirname(os.path.abspath(__file__))
    lines = ["# Every table of the paper: where this repository stands", "",
             "Top-1 accuracy (%) on the test split; kNN weighted by exp(sim/0.1).  Ours: the run "
             f"folder under `{args.runs}/` (its preset says how far from the paper's protocol it "
             "is); paper: the numbers transcribed in report.py (\"not transcribed\": in the paper, "
             "not copied here yet).  Written by `python report.py --overview`.", ""]
    chosen = {}
    for item in args.run_for:
        key, sep, run = item.partition("=")
        if not sep or ":" not in key:
            raise SystemExit(f"--run-for takes TABLE:DATASET=RUN (TABLE: resnet18, alexnet or "
                             f"resnet50), got {item!r}")
        chosen[key] = run
    for title, arch, sets, pattern in TABLES:
        lines += [f"## {title}", "", "| data set | who | kNN@10 | kNN@50 | kNN@100 | kNN@200 | linear "
                  "| notes |", "|---|---|---|---|---|---|---|---|"]
        for ds in sets:
            folder = chosen.get(f"{arch}:{ds}", pattern.format(ds))
            run = run_summary(os.path.join(args.runs, folder), "auto")
            tr = (run or {}).get("train") or {}
            if run and run["final"]["knn"] and tr.get("arch", arch) == arch:
                lines.append(_row(f"{ds} | ours", run["final"], _note(run)))
            else:
                src = SHARED.get(ds)
                why = (f"no run yet: `make {ds}` runs it from ../shared/data/{src}" if src and
                       os.path.exists(os.path.join(here, "..", "shared", "data", src)) else
                       f"no run: the data are not on this machine (`make {ds} SRC=<archive "
                       f"or folder>`{', or without SRC to download' if ds in DOWNLOADS else ''})")
                lines.append(f"| {ds} | ours | - | - | - | - | - | {why} |")
            paper = PAPER.get(ds, {})
            if ds == "hmhr" and paper:
                lines.append(_row(f"{ds} | paper", paper["otl from eurosat"],
                                  "pretrained by OTL on EuroSAT, then OTL"))
            elif paper and arch == "resnet18":
                lines.append(_row(f"{ds} | paper", paper["otl"], "ResNet-18, 300 epochs, 224 px"))
            else:
                lines.append(f"| {ds} | paper | - | - | - | - | - | not transcribed |")
        lines.append("")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tables.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


def main(args):
    if args.overview:
        return overview(args)
    paper = PAPER[args.dataset]
    report_name = args.name or args.dataset
    if args.rows:
        pairs = [r.split("=", 1) for r in args.rows]
        bad = [r for r, p in zip(args.rows, pairs) if len(p) != 2]
        if bad:
            raise SystemExit(f"--rows takes LABEL=RUN, got {bad}")
        runs = [(f"{label} (ours)", run_summary(os.path.join(args.runs, run), args.feature))
                for label, run in pairs]
        otl_run, sup_run = None, None
    else:
        otl_run = run_summary(os.path.join(args.runs, args.otl_run or args.dataset), args.feature)
        sup_run = run_summary(os.path.join(args.runs, f"{args.dataset}_supervised"), args.feature)
        runs = [("OTL (ours)", otl_run), ("supervised (ours)", sup_run)]
    split = next((r["test_split"] for _, r in runs if r and r.get("test_split")), "the test split")
    lines = [f"# {report_name}: results", "",
             f"Top-1 accuracy (%) on {split}; kNN weighted by exp(sim/0.1).",
             "", "| model | kNN@10 | kNN@50 | kNN@100 | kNN@200 | linear | notes |",
             "|---|---|---|---|---|---|---|"]
    for name, run in runs:
        if run:
            lines.append(_row(name, run["final"], _note(run)))
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
    here = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}"
    lines += ["", f"Machine: {args.machine} (the report made on {here})." if args.machine
              else f"Machine: {here}."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{report_name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{report_name}.json"), "w") as fh:
        json.dump({"dataset": args.dataset, "otl": otl_run, "supervised": sup_run,
                   "runs": runs_out, "paper": paper,
                   "machine": {"machine": platform.machine(), "cpus": os.cpu_count(),
                               "platform": platform.platform(), "runs_ran_on": args.machine}},
                  fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
