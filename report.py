"""Collect the results of a data set's runs into results/<dataset>.md and .json, beside the paper.

    python report.py --dataset eurosat --runs runs --out results

Reads <runs>/<dataset>/ (OTL) and <runs>/<dataset>_supervised/ when present: knn_*.json and
linear_*.json for the final checkpoint and the random-init snapshot, log.jsonl and results.json.
--otl-run and --name report another run folder under another name, e.g. a run with other flags:

    python report.py --dataset eurosat --runs runs --otl-run eurosat_exact --name eurosat_exact

--overview writes results/tables.md instead: the paper's results by network (ResNet-18 on remote
sensing, AlexNet and ResNet-50 on natural images), our row per data set where a run exists (an
empty row that says why where none does) beside the paper's OTL rows.  The paper's numbers come
from paper_tables.json, the transcription of every table of the paper.

    python report.py --overview --runs runs --out results
"""
import argparse
import json
import os
import platform

HERE = os.path.dirname(os.path.abspath(__file__))


def paper_tables(path=os.path.join(HERE, "paper_tables.json")):
    """The paper's tables (by LaTeX label) and protocols, as paper_tables.json transcribes them."""
    with open(path) as fh:
        return json.load(fh)


def _scores(rows, j, knn_k=None):
    """Column j of a table's kNN and linear rows: {"knn": {k: top-1}, "linear": top-1}."""
    knn = {str(r.get("k", knn_k)): r["values"][j] for r in rows if r["evaluation"] == "kNN"}
    lin = [r["values"][j] for r in rows if r["evaluation"] == "linear"]
    return {"knn": knn, "linear": lin[0] if lin else None}


def paper_numbers(paper):
    """{data set: {entry: {"knn", "linear", "network", "table", "note"}}}: the paper's OTL and
    supervised rows of every data set, from its result tables."""
    tables, proto = paper["tables"], paper["protocols"]
    knn_k = proto["all_experiments"]["knn_k"]["value"]     # the natural-image tables' kNN
    rs = proto["resnet18_remote_sensing"]
    crop, small = rs["image_size"]["value"]["crop"], rs["pretrained_small_sets"]
    out = {}
    for label in rs["tables"]:
        t = tables[label]
        if label == "5whu":     # its division 1 is whu; ablations.py splits reads the five
            continue
        for j, col in enumerate(t["columns"]):
            who, _, src = col.partition(" from ")
            note = (f"ResNet-18 pretrained by OTL on {src}, then {small['epochs']['value']} epochs "
                    f"{'supervised' if who == 'supervised' else 'of OTL'}, {crop} px" if src else
                    f"ResNet-18, {rs['from_scratch']['epochs']['value']} epochs, {crop} px"
                    if who == "OTL" else f"ResNet-18, {crop} px")
            out.setdefault(t["dataset"], {})[col] = {**_scores(t["rows"], j), "network": t["network"],
                                                     "table": label, "note": note}
    for label in ("ev-knn", "ev-res"):
        t = tables[label]
        for j, ds in enumerate(t["datasets"]):
            p = next(v for v in proto.values() if label in v.get("tables", ()) and ds in v["datasets"])
            for m in dict.fromkeys(r["method"] for r in t["rows"]):
                if m != "Supervised" and not m.startswith("OTL"):
                    continue
                rows = [r for r in t["rows"] if r["method"] == m]
                feat = {r["evaluation"]: r["feature"] for r in rows}
                run = t["network"] if m == "Supervised" else f"{t['network']}, {p['epochs']['value']} epochs"
                out.setdefault(ds, {})[f"{m}, {t['network']}"] = {
                    **_scores(rows, j, knn_k), "network": t["network"], "table": label,
                    "note": f"{run}; kNN (k = {knn_k}) on {feat['kNN']}, linear on {feat['linear']}"}
    t, p = tables["img-eval"], proto["alexnet_imagenet"]
    conv5, fc = t["columns"].index("conv5"), t["columns"].index("FC")
    for r in t["rows"]:
        if r["method"] != "Supervised" and not r["method"].startswith("OTL"):
            continue
        knn = r["values"][fc]
        run = (f"{p['network']['value']}, {p['epochs']['value']} epochs"
               if r["method"].endswith("*") else t["network"])      # * marks the larger AlexNet
        convs = ", ".join(str(v) for v in r["values"][:fc])
        out.setdefault(t["dataset"], {})[f"{r['method'].rstrip(' *')}, {t['network']}"] = {
            "knn": {} if knn is None else {str(knn_k): knn}, "linear": r["values"][conv5],
            "network": t["network"], "table": "img-eval",
            "note": f"{run}; linear on conv5 (conv1 - conv5: {convs})"
                    + ("" if knn is None else f", kNN (k = {knn_k}) on FC")}
    return out


PAPER = paper_numbers(paper_tables())
# The overview's tables, one per network of the paper's result tables: (title, network, data
# sets, the run folder of a data set under --runs)
TABLES = [
    ("ResNet-18 on remote-sensing images (k = 128, random 80/20 split)", "resnet18",
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
    p.add_argument("--linear-feature", default=None, help="the linear probe's layer when it is "
                   "another than --feature's (the paper's natural-image tables: kNN on the "
                   "embedding, --feature auto, and the linear probe on conv5)")
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


def run_summary(run_dir, feature="pool", linear_feature=None):
    """Accuracies of the final checkpoint and of the random-init snapshot of one run folder: kNN
    on `feature`, the linear probe on `linear_feature` (default: the same)."""
    if not os.path.isdir(run_dir):
        return None
    out = {"run": run_dir, "train": _load(os.path.join(run_dir, "results.json")), "feature": feature}
    if feature == "auto":   # as eval_*.py --feature auto: the embedding's results where there are
        feature = "embed" if os.path.isfile(os.path.join(run_dir, "knn_checkpoint_embed.json")) else "pool"
        out["feature"] = feature
    lin_feature = feature if linear_feature in (None, "auto") else linear_feature
    if lin_feature != feature:
        out["linear_feature"] = lin_feature
    sfx, lin_sfx = ("" if f == "pool" else f"_{f}" for f in (feature, lin_feature))
    for tag, stem in (("final", "checkpoint"), ("random_init", "checkpoint0000")):
        knn = _load(os.path.join(run_dir, f"knn_{stem}{sfx}.json"))
        lin = _load(os.path.join(run_dir, f"linear_{stem}{lin_sfx}.json"))
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
    if run.get("feature", "pool") != "pool" or run.get("linear_feature"):
        note += f", features: {run.get('feature', 'pool')}"
        note += f" (kNN), {run['linear_feature']} (linear)" if run.get("linear_feature") else ""
    if tr.get("init_from"):
        note += f", from {tr['init_from']['checkpoint']}"
    return note


def overview(args):
    """results/tables.md: the paper's tables, a row per data set, ours beside the paper's."""
    lines = ["# Every table of the paper: where this repository stands", "",
             "Top-1 accuracy (%) on the test split; kNN weighted by exp(sim/0.1).  Ours: the run "
             f"folder under `{args.runs}/` (its preset says how far from the paper's protocol it "
             "is); paper: the paper's OTL rows from paper_tables.json (natural images: kNN with "
             "k = 50, in the kNN@50 column).  Written by `python report.py --overview`.", ""]
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
            run = run_summary(os.path.join(args.runs, folder), "auto",   # the paper's layers
                              "conv5" if arch == "alexnet" else None)
            tr = (run or {}).get("train") or {}
            if run and run["final"]["knn"] and tr.get("arch", arch) == arch:
                lines.append(_row(f"{ds} | ours", run["final"], _note(run)))
            else:
                src = SHARED.get(ds)
                why = (f"no run yet: `make {ds}` runs it from ../shared/data/{src}" if src and
                       os.path.exists(os.path.join(HERE, "..", "shared", "data", src)) else
                       f"no run yet: `make {ds} SRC=raw/{ds}` runs it from the images in raw/{ds}"
                       if os.path.isdir(os.path.join(HERE, "raw", ds)) else
                       f"no run: the data are not on this machine (`make {ds} SRC=<archive "
                       f"or folder>`{', or without SRC to download' if ds in DOWNLOADS else ''})")
                lines.append(f"| {ds} | ours | - | - | - | - | - | {why} |")
            for key, val in PAPER.get(ds, {}).items():
                if key.startswith("OTL") and val["network"].lower().replace("-", "") == arch:
                    lines.append(_row(f"{ds} | paper", val, f"{key}: {val['note']} "
                                      f"(table {val['table']})"))
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
        runs = [(f"{label} (ours)", run_summary(os.path.join(args.runs, run), args.feature,
                                                args.linear_feature)) for label, run in pairs]
        otl_run, sup_run = None, None
    else:
        otl_run = run_summary(os.path.join(args.runs, args.otl_run or args.dataset), args.feature,
                              args.linear_feature)
        sup_run = run_summary(os.path.join(args.runs, f"{args.dataset}_supervised"), args.feature,
                              args.linear_feature)
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
    for key, val in paper.items():
        lines.append(_row(f"{key} (paper)", val, f"{val['note']} (table {val['table']})"))
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
