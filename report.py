"""Collect the results of a data set's runs into results/<dataset>.md and .json, beside the paper.

    python report.py --dataset eurosat --runs runs --out results

Reads <runs>/<dataset>/ (OTL; --otl-run names another) and its supervised twin <run>_supervised/
when present: knn_*.json and linear_*.json for the final checkpoint and the random-init snapshot,
log.jsonl and results.json.
Each evaluation must be of the run's checkpoint as it is now (the same sha256, or without one the
same epoch as results.json's): a stale one stops the report with the command that redoes it.
--otl-run and --name report another run folder under another name, e.g. a run with other flags:

    python report.py --dataset eurosat --runs runs --otl-run eurosat_exact --name eurosat_exact

--overview writes results/tables.md instead: every table of the paper as paper_tables.json
transcribes it (misprints marked), and beside it our rows, read from the report JSONs under
--results (these reports and ablations.py's studies), each with its preset and what it gives up;
a table without a run says what would make one.  It needs no run folders.

    python report.py --overview --out results
"""
import argparse
import os
import platform
import sys

import otl
import utils



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


PAPER = paper_numbers(utils.paper_tables())
KS = ("10", "50", "100", "200")
COLUMNS = [*(f"kNN@{k}" for k in KS), "linear", "notes"]     # every table of runs: a row each


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
    p.add_argument("--overview", action="store_true", help="write <out>/tables.md: every table "
                   "of the paper, as printed, and our rows from the report JSONs under --results "
                   "(--dataset is ignored)")
    p.add_argument("--results", default=None, help="with --overview: the folder of the report "
                   "JSONs (default: --out)")
    return p


# ----------------------------------------------------------------------------------------------
# Reading run folders: every file checked, a user's mistake one line naming the file
# ----------------------------------------------------------------------------------------------

def _manifest_of(res):
    """The manifest of the data an evaluation read ({} where it is not there)."""
    data = res.get("data_dir")
    man = data and utils.read_json(os.path.join(data, "manifest.json"), f"run prepare_data.py --out "
                             f"{data} (with the --source it was made from) again", utils.MANIFEST_FIELDS)
    return man or {}


def _split_of(man, n):
    """What the evaluation's test split was, from its data set's manifest: 'official' or the
    seeded random fraction, and how many test images."""
    if man.get("split") == "official":
        return f"the official test split ({n:,} images)" if n else "the official test split"
    frac = man.get("test_frac") or 0.2
    what = f"a seeded, stratified random {round(100 * frac)} % test split"
    return f"{what} ({n:,} images)" if n else what


def data_problems(run, dataset):
    """(refusal or None, notes): a run evaluated on another data set than the report's is refused;
    a --per-class subset, or images that differ from the data set's registry, are named."""
    data = run.get("data") or {}
    if not data.get("dataset"):
        return None, []
    where = f"{run['run']} was evaluated on {data['dir']}"
    notes = []
    if data["dataset"] == "folder":     # any tree: its classes were not checked against the set's
        notes.append(f"prepared as --dataset folder ({data['n_classes']} classes), not checked "
                     f"against {dataset}'s classes as --dataset {dataset} does")
    elif data["dataset"] != dataset:
        return (f"{where}, prepared as --dataset {data['dataset']}, not {dataset}: its numbers do "
                f"not go beside the paper's {dataset} rows; pass --dataset {data['dataset']} where "
                "the paper has it, or a run of the data set asked for"), []
    if data.get("per_class"):
        notes.append(f"a --per-class {data['per_class']} subset ({data['n_images']:,} images in "
                     f"{data['n_classes']} classes)")
    notes += [f"its images differ from {dataset}'s: {n}" for n in data.get("registry_notes") or ()]
    return None, notes


def run_summary(run_dir, feature="pool", linear_feature=None):
    """Accuracies of the final checkpoint and of the random-init snapshot of one run folder: kNN
    on `feature`, the linear probe on `linear_feature` (default: the same).  An evaluation of
    other weights than the run's checkpoint as it is now (made before the run went on, say)
    stops the report with a line naming both and the command that evaluates it again."""
    if not os.path.isdir(run_dir):
        return None
    train = utils.read_results(run_dir)
    out = {"run": run_dir, "train": train, "feature": feature}
    if feature == "auto":   # as eval_*.py --feature auto: the embedding's results where there are
        feature = "embed" if os.path.isfile(os.path.join(run_dir, "knn_checkpoint_embed.json")) else "pool"
        out["feature"] = feature
    lin_feature = feature if linear_feature in (None, "auto") else linear_feature
    if lin_feature != feature:
        out["linear_feature"] = lin_feature
    sfx, lin_sfx = ("" if f == "pool" else f"_{f}" for f in (feature, lin_feature))
    for tag, stem in (("final", "checkpoint"), ("random_init", "checkpoint0000")):
        ckpt = os.path.join(run_dir, f"{stem}.pth")
        epochs = (train or {}).get("epochs") if tag == "final" else 0
        evs = {}
        for kind, f, path in (("knn", feature, os.path.join(run_dir, f"knn_{stem}{sfx}.json")),
                              ("linear", lin_feature, os.path.join(run_dir, f"linear_{stem}{lin_sfx}.json"))):
            evs[kind] = utils.read_eval(path, kind, ckpt, f)
            why = evs[kind] and utils.stale(path, evs[kind], ckpt, epochs, utils.eval_command(kind, ckpt, f))
            if why:
                raise SystemExit(why)
        knn, lin = evs["knn"], evs["linear"]
        if tag == "final" and (knn or lin):
            man = _manifest_of(knn or lin)
            out["test_split"] = _split_of(man, (knn or lin).get("n_test"))
            out["data"] = {"dir": (knn or lin).get("data_dir"), "dataset": man.get("dataset"),
                           "per_class": (man.get("key") or {}).get("per_class"),
                           "n_images": man.get("n_images"), "n_classes": len(man.get("classes") or ()),
                           "registry_notes": man.get("registry_notes") or []}
        out[tag] = {"knn": knn["knn_top1"] if knn else None,
                    "linear": lin["linear_top1"] if lin else None,
                    "epoch": (knn or lin or {}).get("epoch")}
    log = utils.read_log(os.path.join(run_dir, "log.jsonl"))
    if log:
        out["log"] = log
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
    if tr.get("untrained"):
        note = "**untrained** (--epochs 0: the network as initialised), " + note
    if run.get("feature", "pool") != "pool" or run.get("linear_feature"):
        note += f", features: {run.get('feature', 'pool')}"
        note += f" (kNN), {run['linear_feature']} (linear)" if run.get("linear_feature") else ""
    if tr.get("init_from"):
        note += f", from {tr['init_from']['checkpoint']}"
    return note + "".join(f"; **{n}**" for n in run.get("data_notes", ()))


# ----------------------------------------------------------------------------------------------
# --overview: every table of the paper, ours beside it
# ----------------------------------------------------------------------------------------------
# Our rows of each table: the report JSONs under --results whose runs are rows of it (report.py's
# per-data-set reports, ablations.py's studies); a table without one says what would make it.
OURS = {
    "ev-knn": ["cifar10.json", "cifar100.json", "svhn.json", "cifar10_fast.json"],
    "ev-res": ["cifar10_resnet50.json", "cifar100_resnet50.json", "svhn_resnet50.json"],
    "img-eval": ["imagenet.json"], "dis-com": ["ablations/uneven.json"],
    "imb-data": ["ablations/imbalanced.json"],
    "hrs": ["hmhr_transfer.json", "hmhr_transfer_dedup.json", "hmhr_gpu_transfer.json",
            "hmhr_gpu_transfer_dedup.json"],
    "eur": ["eurosat.json", "gpu/fast208/eurosat_fast_h100.json", "eurosat_fast.json"],
    "whu": ["siri_whu_transfer.json", "siri_whu_gpu_transfer.json"],
    "uc": ["ucmerced_transfer.json", "ucmerced_gpu_transfer.json"], "aid": ["aid.json"],
    "pat": ["patternnet.json"], "npu": ["nwpu_resisc45.json"], "5whu": ["ablations/splits.json"],
    "diff-k-10": ["ablations/k.json"], "diff-k-100": ["ablations/k_cifar100.json"],
}
# What a run here gives up against the paper's protocol, by preset (docs/presets.md measures it)
SHORT = {
    "cpu": "compute: 2 CPU cores, so 32 px instead of 224, half width, tens of epochs instead of 300 "
           "(the paper's network on one GPU, preset fast, meets the paper: table eur)",
    "transfer-cpu": "compute: the cpu preset's backbone (32 px, half width), pretrained on "
                    "EuroSAT (the paper's best: PatternNet, NWPU-RESISC45, not at hand)",
    "alexnet-cifar-cpu": "compute: AlexNet at half width on 64 px, 8 epochs instead of 1600 at 224",
    "cifar-cpu": "compute: ResNet-18 at half width on 32 px instead of AlexNet at 224, 16 epochs "
                 "instead of 1600",
    "cifar-fast": "compute: ResNet-18 (small stem) on 32 px instead of AlexNet at 224, 64 epochs "
                  "instead of 1600",
}
MISSING = {   # how a table's data set would be run, where no report exists
    "cifar10": "`make cifar10` (from ../shared/data)", "eurosat": "`make eurosat`",
    "hmhr": "`make hmhr`", "siri_whu": "`make siri_whu SRC=<folder>` (docs/datasets.md)",
    "ucmerced": "`make ucmerced SRC=<UCMerced_LandUse.zip>`",
    "aid": "`make aid SRC=<folder>` (docs/datasets.md)",
    "patternnet": "`make patternnet SRC=<folder>`", "nwpu_resisc45": "`make nwpu_resisc45 SRC=<folder>`",
    "cifar100": "`make cifar100` (downloads it)", "svhn": "`make svhn` (downloads it)",
    "imagenet": "`make data DATASET=imagenet SRC=<folder>`, then train_otl.py",
}


def _f(v, sd=None):
    return "-" if v is None else f"{v:.1f}" + (f" +- {sd:.1f}" if sd is not None else "")


def _marks(t):
    """{(row, column): '†n'} for the table's misprinted cells, and the footnote lines."""
    marks, notes = {}, []
    for i, m in enumerate(t.get("misprints", []), 1):
        if "row" in m and "column" in m:
            marks[(m["row"], m["column"])] = f"†{i}"
        where = (f"row {m['row'] + 1}, column {t['columns'][m['column']]}" if "column" in m
                 else f"row {m['row'] + 1}, {m['where']}" if "row" in m else m.get("where", ""))
        notes.append(f"†{i} misprint ({where}): printed {m['printed']}, right "
                     f"{m['right'] if m['right'] is not None else 'unknown'}: {m['why']}.")
    return marks, notes


def _printed(t, skip=()):
    """The paper's table as printed: one markdown row per row, misprints marked."""
    marks, _ = _marks(t)
    keys = [k for k in ("dataset", "division", "method", "row", "evaluation", "feature", "k",
                        "k_clusters") if any(k in r for r in t["rows"]) and k not in skip]
    return utils.md_table(keys + [str(c) for c in t["columns"]], (
        ["" if r.get(k) is None else str(r[k]) for k in keys]
        + ["-" if v is None else f"{v:g}{marks.get((i, j), '')}" for j, v in enumerate(r["values"])]
        for i, r in enumerate(t["rows"])))


def _reports(results, names):
    out = []
    for name in names:
        js = utils.read_json(os.path.join(results, name), "write it again with the command that made "
                       "it (results/README.md names each)")
        if js:
            out.append((name, js))
    return out


def _runs_of(js):
    """[(label, run)] of a report JSON: its rows (--rows), else its OTL and supervised runs."""
    if js.get("runs"):
        return [(k, v) for k, v in js["runs"].items() if v]
    return [(k, js[key]) for k, key in (("OTL (ours)", "otl"), ("supervised (ours)", "supervised"))
            if js.get(key)]


def _where(js, run):
    tr = run.get("train") or {}
    mach = (js.get("machine") or {})
    where = mach.get("runs_ran_on") or f"{mach.get('cpus', '?')} CPU cores"
    return (f"preset {tr.get('preset', '?')}, {tr.get('epochs', '?')} epochs, "
            f"{tr.get('train_minutes', '?')} min on {where}")


def _model_rows(t, results):
    """A remote-sensing table as rows of models: | who | kNN@10 .. @200 | linear | notes |, the
    paper's columns first, then every run of our reports, each with its preset and, where the
    paper's OTL is higher, what the run gives up."""
    lines = utils.md_table(["who", *COLUMNS], [])
    paper_otl = {}
    for j, col in enumerate(t["columns"]):
        sc = _scores(t["rows"], j)
        lines.append(_row(f"paper: {col}", sc, ""))
        if col.startswith("OTL"):
            paper_otl[col] = sc
    for name, js in _reports(results, OURS.get(t.get("label"), [])):
        shown = False
        for label, run in _runs_of(js):
            tr = run.get("train") or {}
            note = _where(js, run) + f" (`results/{name}`)"
            # the paper's OTL run to hold it to: the same pretraining set, or the one OTL column
            col = next((c for c in paper_otl if c != "OTL" and c.split(" from ")[-1] in label),
                       "OTL" if "OTL" in paper_otl else None)
            ours = (run["final"].get("knn") or {}).get("10")
            paper = ((paper_otl.get(col) or {}).get("knn") or {}).get("10")
            if "supervised" not in label and ours is not None and paper and ours < paper:
                why = SHORT.get(tr.get("preset"))
                note += (f"; {paper - ours:.1f} below the paper's {col} at kNN@10"
                         + (f": {why}" if why else ""))
            lines.append(_row(f"ours: {label.replace(' (ours)', '')}", run["final"], note))
            init = run.get("random_init") or {}
            if init.get("knn") and not tr.get("init_from") and not shown:
                lines.append(_row("ours: random init", init, "the same network untrained (its "
                                  "epoch-0 snapshot)"))
                shown = True
    return lines


def _natural_rows(t, results):
    """ev-knn / ev-res: the printed table, then ours: kNN@50 and the linear probe per data set."""
    lines = _printed(t)
    cols = t["datasets"]
    found = {}
    for name, js in _reports(results, OURS.get(t["label"], [])):
        found.setdefault(js.get("dataset"), []).append((name, js))
    for ds, reps in found.items():
        for name, js in reps:
            for label, run in _runs_of(js):
                for ev, val in (("kNN (k = 50)", (run["final"].get("knn") or {}).get("50")),
                                ("linear", run["final"].get("linear"))):
                    cells = [_f(val) if c == ds else "" for c in cols]
                    feat = run.get("linear_feature") if ev == "linear" else None
                    lines.append(f"| {label} | {ev} | {feat or run.get('feature', 'pool')} | "
                                 + " | ".join(cells) + f" | {_where(js, run)} (`results/{name}`) |")
    if lines and found:
        lines[0] = lines[0] + " notes |"
        lines[1] = lines[1] + "---|"
    return lines, [c for c in cols if c not in found]


def _study_rows(t, results, key, values, nkeys, metric="knn50", by_rank=False):
    """Ours under a printed table whose columns are a study's grid (values; nkeys label cells
    before them): mean +- sd over the seeds of each point, '-' where the grid has none.
    by_rank: a grid of the paper's length but other values (the imbalanced study's d, scaled to
    the data's class sizes) fills the columns in order, and the note says which value went where."""
    lines = []
    for name, js in _reports(results, OURS.get(t["label"], [])):
        rows = js.get("seed_means") or js["rows"]
        groups = {}
        for r in rows:
            groups.setdefault(r.get("subset", ""), {})[r.get(key)] = r
        seeds = max(len(r.get("seeds", [0])) for r in rows)
        grid = (js.get("grid") or sorted({r.get(key) for r in rows})) if by_rank else values
        mapped = by_rank and len(grid) == len(values) and set(grid) != set(values)
        col = dict(zip(values, grid)) if mapped else {v: v for v in values}
        for sub, by in groups.items():
            cells = [_f(by[col[v]][metric], by[col[v]].get(metric + "_sd"))
                     if col[v] in by and metric in by[col[v]] else "-" for v in values]
            pre = rows[0].get("preset")
            shown = pre + (f" for {rows[0]['epochs']} epochs" if rows[0].get("epochs") else "")
            if mapped:
                shown += f", {key} = {', '.join(str(g) for g in grid)} under the paper's columns"
            init = rows[0].get(metric.replace("knn", "knn_init"))
            data = js.get("data") or "data/cifar10"     # studies before they recorded it: CIFAR-10
            why = (SHORT.get(pre, "") if "cifar10" in data else
                   f"trained on {data}, not the paper's CIFAR-10: compare directions, not levels")
            label = f"ours: {sub + ', ' if sub else ''}{metric.replace('knn', 'kNN@')}"
            lines.append(f"| {label} | " + "| " * (nkeys - 1) + " | ".join(cells) + f" | preset {shown}, {seeds} seed(s) "
                         f"a point{' (mean +- sd)' if seeds > 1 else ''}"
                         + (f", random init {init:.1f}" if init is not None else "")
                         + f"; {why} (`results/{name}`) |")
    return lines


def _mean_row(name, scores, note):
    """A row of mean +- sd over a list of {"knn", "linear"} scores."""
    def ms(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        m, sd = utils.mean_sd(vals)
        return _f(m, sd)
    cells = [ms([(s.get("knn") or {}).get(k) for s in scores]) for k in KS]
    return f"| {name} | " + " | ".join(cells) + f" | {ms([s.get('linear') for s in scores])} | {note} |"


def _splits_rows(t, results):
    """5whu as rows of models: the paper's five divisions and their mean +- sd, then every run of
    ablations.py splits on SIRI-WHU and their mean +- sd."""
    lines = utils.md_table(["who", *COLUMNS], [])
    paper = {c: [] for c in t["columns"]}
    for d in sorted({r["division"] for r in t["rows"]}):
        rows = [r for r in t["rows"] if r["division"] == d]
        for j, col in enumerate(t["columns"]):
            paper[col].append(_scores(rows, j))
            lines.append(_row(f"paper: division {d}, {col}", paper[col][-1], ""))
    for col, sc in paper.items():
        lines.append(_mean_row(f"paper: {col}, mean +- sd", sc, f"over its {len(sc)} divisions"))
    for name, js in _reports(results, OURS["5whu"]):
        runs = [r for r in js["rows"] if "siri_whu" in str((r.get("study_point") or {}).get("data"))]
        ours = {}
        for r in runs:
            sc = {"knn": {k: r.get(f"knn{k}") for k in KS}, "linear": r.get("linear")}
            model = r.get("model", "OTL")
            ours.setdefault(model, []).append(sc)
            lines.append(_row(f"ours: seed {r['seed']}, {model}", sc, f"preset {r.get('preset')}, "
                              f"{r.get('epochs')} epochs, {r.get('train_minutes')} min "
                              f"(`results/{name}`)"))
        for model, sc in ours.items():
            lines.append(_mean_row(f"ours: {model}, mean +- sd", sc, f"over {len(sc)} divisions; "
                                   + SHORT.get(runs[0].get("preset"), "")))
    return lines


def _table_section(label, t, results):
    sec = t["section"] if t["section"].startswith("Appendix") else f"Section {t['section']}"
    lines = [f"## `{label}`: {t['caption']}", "", f"In the paper: {sec}."
             + (f" Notes: {'; '.join(t['notes'])}." if t.get("notes") else ""), ""]
    t = {**t, "label": label}
    missing = []
    if label in ("hrs", "eur", "whu", "uc", "aid", "pat", "npu"):
        body = _model_rows(t, results)
        if not _reports(results, OURS[label]):
            missing = [t["dataset"]]
    elif label in ("ev-knn", "ev-res"):
        body, missing = _natural_rows(t, results)
    elif label == "img-eval":
        body = _printed(t)
        missing = [] if _reports(results, OURS[label]) else ["imagenet"]
    elif label == "5whu":
        body = _splits_rows(t, results)
        if not any(line.startswith("| ours") for line in body):
            missing = ["siri_whu"]
    elif label == "dis-com":
        body = _printed(t)
        for ds, k in (("cifar10", 128), ("cifar100", 512)):   # the targets' std, unrounded
            std = [utils.formula_std(50_000, k, x) for x in t["x"]]
            body.append(f"| {ds} | std, the formula n_i = N i^x / sum i^x (ours) | {k} | "
                        + " | ".join(f"{v:.1f}" for v in std) + " |")
        body += _study_rows(t, results, "x", t["x"], 3)
    elif label == "imb-data":
        body = _printed(t) + _study_rows(t, results, "d", t["d"], 1, by_rank=True)
    elif label in ("diff-k-10", "diff-k-100"):
        body = _printed(t)
        body.append("| n_bar = 50,000 / k (ours) | " + " | ".join(f"{50_000 / k:.1f}" for k in t["columns"]) + " |")
        body += _study_rows(t, results, "k", t["columns"], 1)
        if not _reports(results, OURS[label]):
            missing = [t["dataset"]]
    else:   # the toy model's tables: IND and DIS of each row's cluster sizes, computed here
        body = _printed(t)
        n = len(t["columns"]) - 2
        body[0] += " IND, DIS (otl.py, of the corrected sizes) |"
        body[1] += "---|"
        right = {(m["row"], m["column"]): m["right"] for m in t.get("misprints", [])
                 if "column" in m and m["right"] is not None}
        for i, r in enumerate(t["rows"]):       # the sizes with their misprints corrected
            sizes = [right.get((i, j), v) for j, v in enumerate(r["values"][:n])]
            body[2 + i] += f" {otl.n_indistinguishable(sizes)}, {otl.n_distinguishable(sizes)} |"
    lines += body
    for ds in missing:
        lines.append("")
        lines.append(f"Ours: no run of {ds} here; {MISSING.get(ds, 'see the README')} makes one.")
    lines += [""] + _marks(t)[1] + [""]
    return lines


def overview(args):
    """results/tables.md: every table of the paper (paper_tables.json), as printed, with our rows
    from the report JSONs under --results."""
    results = args.results or args.out
    tables = utils.paper_tables()["tables"]
    lines = ["# Every table of the paper, and ours beside it", "",
             "The paper's tables as paper_tables.json transcribes them (top-1 % on the test split; "
             "† marks a misprint, explained under its table), then our runs: each row names its "
             "preset and, where it falls short of the paper, what it gives up.  kNN votes "
             "exp(sim / 0.1); the paper's natural-image kNN is k = 50.  Written by `python "
             f"report.py --overview --results {utils.rel_path(results)}` from the report JSONs there.", ""]
    lines += [f"- [`{label}`](#{label}): {t['caption'][:90]}" for label, t in tables.items()] + [""]
    for label, t in tables.items():
        lines += _table_section(label, t, results)
    os.makedirs(args.out, exist_ok=True)
    utils.write_text("\n".join(lines).rstrip() + "\n", os.path.join(args.out, "tables.md"))
    print(f"wrote {os.path.join(args.out, 'tables.md')}: {len(tables)} tables")


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
        name = args.otl_run or args.dataset
        sup_run = run_summary(os.path.join(args.runs, f"{name}_supervised"), args.feature,
                              args.linear_feature)
        runs = [("OTL (ours)", otl_run), ("supervised (ours)", sup_run)]
    for _, run in runs:
        refused, notes = data_problems(run or {}, args.dataset)
        if refused:
            raise SystemExit(refused)
        if notes:
            run["data_notes"] = notes
            print(f"note: {run['run']}: " + "; ".join(notes), file=sys.stderr)
    split = next((r["test_split"] for _, r in runs if r and r.get("test_split")), "the test split")
    lines = [f"# {report_name}: results", "",
             f"Top-1 accuracy (%) on {split}; kNN weighted by exp(sim/0.1).",
             "", *utils.md_table(["model", *COLUMNS], [])]
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
    utils.write_text("\n".join(lines) + "\n", os.path.join(args.out, f"{report_name}.md"))
    utils.write_json({"dataset": args.dataset, "otl": otl_run, "supervised": sup_run,
                      "runs": runs_out, "paper": paper,
                      "machine": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                  "platform": platform.platform(), "runs_ran_on": args.machine}},
                     os.path.join(args.out, f"{report_name}.json"))
    print("\n".join(lines))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
