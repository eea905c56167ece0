"""The paper's studies, rerun: each a grid of runs of the stage scripts (train_otl.py, eval_knn.py,
eval_linear.py) or of the labelers alone, with our numbers beside the paper's.

    python ablations.py --help                  # the studies, each with what it varies
    python ablations.py beta                    # a labeler study: minutes on 2 CPU cores
    python ablations.py k                       # a training study: at most 2 h on 2 CPU cores
    python ablations.py k --preset paper        # the same grid at the paper's scale (a GPU)
    make ablation-k                             # the same; `make ablations` runs every study

Every study writes <out>/<study>.json (every grid point, the command and commit), <study>.md (the
table and whether our trend agrees with the paper's) and <study>.png (the plot).  The runs live in
<runs>/<preset>/<study>/<point>/; a run that has finished (its results.json and evaluation JSONs
are there) is skipped, an interrupted one resumes from its checkpoint, so rerunning the same
command after a crash or a Ctrl-C continues where it stopped; an evaluation of other weights than
the run's checkpoint is made again.  The labeler studies keep each
measurement in <runs>/<preset>/labeler/measurements.jsonl and skip the ones made.
The kNN monitor's curves and every choice read the validation split (train_otl.py's, from
`utils.VAL_FRAC`); each row's curve_split names the split its curve scored (test in runs from
before the validation split).

Below, what every study shares (flags, `Study` and its kinds, running a grid, the 2-sd rule, the
results files), then a section per study holding all of it (the paper's numbers, grid, points,
verdict, table, plot) and ending in its class.  STUDIES, which the classes register into, is the
one list of the studies; tests hold the Makefile's and docs/ablations.md's to it.
"""
import argparse
import functools
import inspect
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

import otl
import peers
import presets
import utils

HERE = os.path.dirname(os.path.abspath(__file__))


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="study", required=True, metavar="STUDY")
    for study in STUDIES.values():
        doc = inspect.getdoc(study)
        study.add_flags(sub.add_parser(study.name, help=doc, description=doc))
    return p


def main(args):
    return STUDIES[args.study].run(args)


# ==== Scales, the paper's tables, and what a study is =============================================
@dataclass(frozen=True)
class Scale:
    """What a training study trains with at one scale."""
    train: tuple            # train_otl.py flags of every training study's runs
    transfer: tuple         # ... of a study from a pretrained backbone (TransferStudy)
    data: str               # the training studies' prepared data
    seeds: tuple            # a grid point's training seeds (--seeds replaces them)
    labeler_net: str        # the preset of the labeler studies' random network
    otl: tuple = ()         # flags of OTL's loss and views: not given to a peer (--method)


# The paper ran its studies on CIFAR-10 (fewer epochs than its main runs, simple augmentation, no
# LCT).  "study" is sized for 2 CPU cores so that their effects can show: EuroSAT, the cpu preset
# cut to 8 epochs, three seeds a point; "paper" is the paper's data and networks with its studies'
# changes, at its presets' epochs (it does not say how many its studies trained); "cpu" is the cpu
# preset's whole schedule, one seed a point.  docs/ablations.md (Scales) says what each gives up.
SCALES = {
    "study": Scale(train=("--preset", "cpu", "--epochs", "8"), transfer=("--preset", "transfer-cpu"),
                   data="data/eurosat", seeds=(0, 1, 2), labeler_net="alexnet-cifar-cpu"),
    "cpu": Scale(train=("--preset", "cpu"), transfer=("--preset", "transfer-cpu"),
                 data="data/eurosat", seeds=(0,), labeler_net="alexnet-cifar-cpu"),
    "paper": Scale(train=("--preset", "alexnet-cifar"), transfer=("--preset", "transfer"),
                   otl=("--aug", "simple", "--views", "1", "--label-views", "1", "--lct", "false"),
                   data="data/cifar10", seeds=(0,), labeler_net="alexnet-cifar"),
}


# {label: the paper's table as paper_tables.json transcribes it: columns, rows with the numbers as
# printed, misprints}
PAPER_TABLES = utils.paper_tables()["tables"]


def _row_of(table, **match):
    return next(r for r in table["rows"] if all(r.get(k) == v for k, v in match.items()))


def _listed(d):
    return ", ".join(f"{g:g}: {v:.1f}" for g, v in d.items())


class Study:
    """One study, whole in its section below: its name, its kind ("labeler": the labelers on fixed
    outputs; "training": train_otl.py runs and their evaluations; "label-bn": one network's label
    pass), the paper's claim (its numbers where it gives them), its grid (--grid replaces it), its
    flags and how it runs (run(args)); its class docstring is its --help.  The labeler and
    training studies also give the three parts of their results files (write_results):
    verdict(rows), one line; table(rows), markdown lines; plot(axes, rows, grid), two panels."""
    name = kind = paper = ""
    grid = ()
    data = None             # the study's own prepared data, else its scale's

    def default_grid(self, preset="study"):
        """The grid at a scale (a study whose data want a grid of their own there overrides it)."""
        return list(self.grid)

    def add_flags(self, s):
        s.add_argument("--preset", default="study", choices=list(SCALES), help="study: sized for "
                       "2 CPU cores (see SCALES in ablations.py: what it gives up); cpu: the cpu "
                       "preset's whole schedule, one seed a point; paper: the "
                       "paper's networks and main-run schedules with its studies' changes (one "
                       "view, simple augmentation, no LCT), for a GPU; the paper trained its "
                       "studies for fewer epochs but does not say how many")
        s.add_argument("--runs", default="runs/ablations", help="folder of the study's runs "
                       "(<runs>/<preset>/<study>/<point>); a finished run there is skipped")
        s.add_argument("--out", default="results/ablations", help="folder of <study>.json, .md "
                       "and .png (<study>_<preset>.* with --preset cpu or paper)")
        data = self.data or f"{SCALES['study'].data}; --preset paper: {SCALES['paper'].data}"
        s.add_argument("--data", help=f"prepared data folder (default {data}; the labeler "
                       "studies use its training split as the network's input)")
        grid, paper = (",".join(map(str, self.default_grid(scale))) for scale in ("study", "paper"))
        s.add_argument("--grid", help="comma list replacing the study's grid, e.g. 16,32 (default "
                       f"{grid}{'' if paper == grid else f'; --preset paper: {paper}'})")
        s.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
        s.add_argument("--seed", type=int, default=0, help="seeds the inputs, the networks and "
                       "the training runs")
        s.add_argument("--no-plot", action="store_true", help="skip the PNG (needs matplotlib)")
        s.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")


STUDIES = {}


def register(cls):
    """A study's class into STUDIES, in the order of the sections (--help's)."""
    STUDIES[cls.name] = cls()
    return cls


NUMBER = "a number"     # a grid field of numbers (TrainingStudy.keys)


def parse_grid(study, text, preset="study"):
    """The study's grid (the scale's own where it has one), or --grid's comma list in the grid's
    own type."""
    if not text:
        return study.default_grid(preset)
    kind = type(study.grid[0])
    try:
        vals = [kind(v) if kind is not float else float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--grid {text!r}: {study.name}'s grid values are like "
                         f"{','.join(str(g) for g in study.grid[:3])}")
    bad = [v for v in vals if kind is str and v not in study.grid]
    if bad or not vals:
        raise SystemExit(f"--grid {text!r}: choose from {','.join(study.grid)}")
    return vals


# ==== Labeler studies: the labelers on fixed outputs, nothing trained =============================
class LabelerStudy(Study):
    """A labeler study: its `methods` measured on Gaussian outputs and on a random network's
    outputs for CIFAR-10's training split, at every grid value of `axis` (k, or beta at --k
    clusters)."""
    kind, data = "labeler", "data/cifar10"
    axis = "k"
    methods = ()

    def add_flags(self, s):
        super().add_flags(s)
        s.add_argument("--n", type=int, default=50_000, help="rows of each input (50,000: "
                       "the paper's, CIFAR-10's training split)")
        s.add_argument("--k", type=int, default=128, help="clusters (beta only; the paper's 128)")

    def run(self, args):
        utils.print_run_header(args)
        return write_results(self, args, labeler_study(self, args))

    def table(self, rows, steps=False):
        """Each method's final std, iterations and seconds per (input, k); steps: the published
        labeler's steps to its final std too."""
        by = {(r["input"], r["k"], r["method"]): r for r in rows}
        cols = [(m, c) for m in self.methods for c in ("std", "iters", *(
            ("steps to final",) if steps and m == "published" else ()), "s")]
        cell = {"std": lambda r: f"{r['std']:.2f}", "iters": lambda r: str(r["iterations"]),
                "steps to final": lambda r: str(steps_to_final(r)), "s": lambda r: f"{r['seconds']:.2f}"}
        return utils.md_table(["input", "k", *(f"{m} {c}" for m, c in cols)],
                              [[inp, str(k), *(cell[c](by[(inp, k, m)]) for m, c in cols)]
                               for inp, k in sorted({(r["input"], r["k"]) for r in rows})])

    def plot(self, axes, rows, grid=None, left="iterations"):
        """left: what the first panel gives against k (iterations or seconds); the second, the
        final std."""
        for inp, ls in (("gaussian", "-"), ("random_net", "--")):
            for m in self.methods:
                rs = sorted((r for r in rows if r["input"] == inp and r["method"] == m), key=lambda r: r["k"])
                ks = [r["k"] for r in rs]
                axes[0].plot(ks, [r[left] for r in rs], ls, label=f"{m}, {inp}")
                axes[1].plot(ks, [r["std"] for r in rs], ls, label=f"{m}, {inp}")
        axes[0].set(xlabel="k", ylabel=left)
        axes[1].set(xlabel="k", ylabel="final std of the counts")
        axes[0].legend(fontsize=7)


class Inputs:
    """The labeler studies' (N, k) outputs: "gaussian" (torch.randn, seeded per k) and
    "random_net" (the training split of the data through a freshly initialised network of the
    scale's labeler_net preset, a fresh k-way head per k: utils.random_net_features); the
    network's features are computed once and cached under the runs folder."""

    def __init__(self, args, data, folder):
        self.args, self.data, self.folder, self.feats = args, data, folder, None

    def get(self, name, k):
        n, seed = self.args.n, self.args.seed
        if name == "gaussian":
            return torch.randn(n, k, generator=torch.Generator().manual_seed(seed * 100_003 + k))
        if self.feats is None:
            self.feats = self._features()
        return utils.fresh_head_outputs(self.feats, k, seed)

    def _features(self):
        a, data = self.args, self.data
        net = SCALES[a.preset].labeler_net
        path = os.path.join(self.folder, f"features_{net}_{utils.data_identity(data)[:12]}"
                            f"_n{a.n}_seed{a.seed}.pt")
        if os.path.isfile(path):
            return utils.load_file(path)
        d = utils.load_prepared(data)
        images = d["images"][d["train_idx"]]
        if len(images) < a.n:
            raise SystemExit(f"{data}'s training split has {len(images):,} images, fewer than "
                             f"--n {a.n:,}")
        t0 = time.time()
        feats = utils.random_net_features(images[:a.n], utils.load_manifest(data), net, a.seed,
                                          utils.pick_device(a.device), not a.no_progress).cpu()
        print(f"random_net: {net} features of {a.n:,} images in {time.time() - t0:.0f} s", flush=True)
        os.makedirs(self.folder, exist_ok=True)
        torch.save(feats, path + ".tmp")
        os.replace(path + ".tmp", path)
        return feats


def measurement_ok(r):
    """Whether a line of measurements.jsonl holds every field the labeler studies read, each of
    its type."""
    history = r.get("std_history", []) if isinstance(r, dict) else None
    return (isinstance(r, dict) and all(isinstance(r.get(f), str) for f in ("key", "input", "method"))
            and all(utils.is_whole(r.get(f)) for f in ("k", "iterations", "max_minus_min"))
            and all(utils.is_number(r.get(f)) for f in ("beta", "std", "std_before", "std_max", "seconds"))
            and isinstance(history, list) and all(map(utils.is_number, history)))


def _measurements(store):
    """{key: measurement} of the store; its damaged lines dropped from it with a warning."""
    if not os.path.isfile(store):
        return {}
    good, bad = utils.jsonl_records(store, measurement_ok)
    if bad:     # out of the file, so that the measurements made again start on a line of their own
        print(f"warning: {store}: dropped damaged line(s) {utils.line_numbers(bad)}, not a whole "
              "measurement; they are measured again", flush=True)
        with open(store + ".tmp", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for _, r in good)
        os.replace(store + ".tmp", store)
    return {r["key"]: r for _, r in good}


def labeler_study(study, args):
    """Every (input, k, method, beta) of the grid measured once and kept in measurements.jsonl
    (so a rerun, or another study of the same inputs, skips what is there); its rows."""
    folder = os.path.join(args.runs, args.preset, "labeler")
    os.makedirs(folder, exist_ok=True)
    store = os.path.join(folder, "measurements.jsonl")
    done = _measurements(store)
    todo = [(inp, g if study.axis == "k" else args.k, m, g if study.axis == "beta" else 1.5)
            for inp in ("gaussian", "random_net") for g in parse_grid(study, args.grid, args.preset)
            for m in study.methods]
    bad = [k for _, k, _, _ in todo if not 2 <= k <= args.n]
    if bad:
        raise SystemExit(f"k must lie in [2, --n {args.n}], got {sorted(set(bad))}")
    torch.set_num_threads(os.cpu_count() or 1)   # every measurement on all cores, one at a time
    inputs, rows, made = Inputs(args, args.data or study.data, folder), [], 0
    device = utils.pick_device(args.device)
    if not args.no_progress:
        from tqdm import tqdm
        todo = tqdm(todo, desc=args.study, dynamic_ncols=True)
    for inp, k, method, beta in todo:
        key = f"{inp}|n{args.n}|seed{args.seed}|k{k}|{method}|beta{beta}|{device.type}"
        if key not in done:
            O = inputs.get(inp, k).to(device)
            rec = {"key": key, "input": inp, "n": args.n, "k": k, "method": method, "beta": beta,
                   "device": str(device), **utils.measure_labeler(O, method, **(
                       dict(beta=beta, init="zero", tie_eps=0) if method == "published" else {})),
                   "git_commit": utils.git_commit()}
            with open(store, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            done[key], made = rec, made + 1
        rows.append(done[key])
    print(f"{study.name}: {made} measured, {len(rows) - made} from {store}", flush=True)
    return rows


def steps_to_final(r):
    """Steps the published labeler tried before its std first reached its final value (its
    std_history holds the std after every step tried, undone ones included)."""
    h = r.get("std_history") or [r["std"]]
    return next(i for i, v in enumerate(h) if v <= round(r["std"], 4) + 1e-9)   # h is rounded


# ==== Training studies: a train_otl.py run and its evaluations per grid point and seed ============
class TrainingStudy(Study):
    """A training study: points(grid, data, args) -> [(run name, grid fields, data folder,
    train_otl.py flags)], one per grid point, each trained once per seed at the scale's flags and
    evaluated (evals: knn, linear; the _val ones score the validation split); keys: a row's grid
    fields (NUMBER or their values), which a rewrite checks; xkey: the panels' x axis.  A study
    overrides only what is its own: its flags (more_flags), a check before training, its runs,
    evaluations, rows, notes, table, plot or panel."""
    kind = "training"
    evals = ()
    keys = {}
    xkey = ""
    kept = ()       # fields of the results JSON a rewrite keeps as recorded (budget's timings)

    def add_flags(self, s):
        super().add_flags(s)
        s.add_argument("--train-args", default="", help="extra train_otl.py flags for every "
                       "run, e.g. \"--epochs 4\" (they win over the preset's)")
        s.add_argument("--max-runs", type=int, default=None, help="train at most this many "
                       "runs, then write every finished run (a partial results file) and stop: a "
                       "session that must end soon ends cleanly; the same command continues")
        s.add_argument("--rewrite", action="store_true", help="train nothing: write the "
                       "table, verdict and plot again from the rows of the study's results "
                       "JSON as they are (after a change to how studies are summarised)")
        self.more_flags(s)

    def more_flags(self, s):
        s.add_argument("--seeds", help="train every grid point once per seed (a comma "
                       "list, e.g. 0,1,2); the table gives the mean and the standard "
                       "deviation over them, the verdict weighs each difference against "
                       "2 sd (default: 0,1,2 at study scale, 0 at paper scale; --seed "
                       "other than 0: that seed alone)")

    def run(self, args):
        utils.print_run_header(args)
        return rewrite(self, args) if args.rewrite else self.train(args)

    def train(self, args):
        rows, ran = training_study(self, args)
        out = write_results(self, args, rows, self.notes(args, rows))
        out["ran"] = ran
        return out

    def runs(self, args):
        """[(run name, grid fields, data folder, train_otl.py flags)] of every run: each grid
        point of points(grid, data, args) once per seed; seed 0 keeps the point's name, another
        seed s adds _seed<s>."""
        scale = SCALES[args.preset]
        pts = self.points(parse_grid(self, args.grid, args.preset), study_data(self, args), args)
        return [(name if s == 0 else f"{name}_seed{s}", {**point, "point": name, "seed": s}, folder,
                 [*scale.train, *(() if "--method" in flags else scale.otl), *flags, "--seed", str(s)])
                for name, point, folder, flags in pts for s in self.seeds(args)]

    def seeds(self, args):
        """The training seeds of every grid point (parse_seeds: --seeds, else the scale's)."""
        return parse_seeds(args)

    def check(self, args):
        """Stop before training where what the runs start from is missing."""

    def evaluations(self, run, i):
        """{evaluation: its JSON in the run folder} of the study's i-th run; the first run's
        random network too (knn_init: the floor)."""
        outs = {e: os.path.join(run, f"{e}.json") for e in self.evals}
        if i == 0 and "knn" in self.evals:
            outs["knn_init"] = os.path.join(run, "knn_init.json")
        return outs

    def row(self, run, point, outs):
        return training_row(run, point, outs)

    def rows_notes(self, rows):
        """What the rows add to the notes (uneven: the targets' std)."""
        return {"notes": []}

    def notes(self, args, rows=()):
        """What the study's JSON and table add: how it trained, where its data differ from the
        paper's study."""
        out = self.rows_notes(rows)
        data = study_data(self, args)
        out["notes"] = [self.trained_how(args, data) + "."] + ([""] + out["notes"] if out["notes"] else [])
        out["data"] = utils.rel_path(data)
        return out

    def trained_how(self, args, data):
        """The notes' first line: the data, the scale's flags, the seeds, and what the levels
        mean where the data are not the paper's."""
        scale = SCALES[args.preset]
        note = (trained_on(data, (*scale.train, *scale.otl))
                + f", {len(self.seeds(args))} seed(s) a grid point")
        if not self.paper.startswith("not in the paper") and "cifar10" not in _base(data):
            note += ("; the paper's study trained AlexNet on CIFAR-10, so its numbers are its own "
                     "scale's: compare the directions and the differences beyond 2 sd, not the "
                     "levels")
        return note

    def table(self, rows, hide=("seed",), start="Random-init network", more=()):
        """Rows (one per run, or seed_means' one per grid point): grid fields but `hide`, metrics
        (mean +- sd over the seeds) and `more`, final loss and minutes; then the floor: the kNN@10
        of `start` (the first run's checkpoint0000.pth), where it was evaluated."""
        keys = [k for k in TABLE_KEYS if any(k in r for r in rows) and k not in hide]
        metrics = [m for m in METRICS if any(m in r for r in rows)] + list(more)
        cell = lambda r, m: (f"{r[m]:.1f} +- {r[m + '_sd']:.1f}" if m + "_sd" in r else f"{r[m]:.1f}") \
            if m in r else ""
        costs = [(key, name) for key, name in (("epoch_s", "s / epoch"), ("peak_mib", "peak MiB"))
                 if any(key in r for r in rows)]
        heads = [{"knn_init10": "knn10 before"}.get(m, m) for m in metrics]
        failed = any(r.get("failed") for r in rows)
        lines = utils.md_table(keys + heads + ["final loss", "minutes"] + [n for _, n in costs]
                               + ["failed"] * failed, [
            [",".join(map(str, r[k])) if k == "seeds" else str(r.get(k, "")) for k in keys]
            + [cell(r, m) for m in metrics]
            + [f"{r.get('final_loss', float('nan')):.3f}", f"{r.get('train_minutes') or 0:.1f}"]
            + [f"{r[key]:.0f}" if key in r else "" for key, _ in costs]
            + [failure(r)] * failed
            for r in rows])
        if failed:
            lines += ["", "failed: the run ended collapsed by train_otl.py's collapse signal (its "
                      "log says why; for a run from before the signal, its softmax loss at ln k); "
                      "its scores are those of a network that learned little."]
        if "seeds" in keys:
            lines += ["", "Each cell: the mean over the seeds +- their sample standard deviation; "
                      "minutes and loss are means."]
        init = [r for r in rows if "knn_init10" in r]
        if start and init:
            lines += ["", f"{start} (the first run's checkpoint0000.pth): kNN@10 "
                      f"{init[0]['knn_init10']:.1f}."]
        return lines

    def plot(self, axes, rows, grid):
        # a study without a linear probe shows kNN@200 beside kNN@10, not an empty panel
        second = "linear" if "linear" in self.evals else "knn200"
        for ax, metric in zip(axes, ("knn10", second)):
            self.panel(ax, rows, metric, grid)
            ax.set(xlabel=self.xkey, ylabel=f"{metric} top-1 (%)")

    def panel(self, ax, rows, metric, grid):
        """One metric against xkey, mean +- sd over the seeds."""
        ax.errorbar([r[self.xkey] for r in rows], [r.get(metric, float("nan")) for r in rows],
                    yerr=[r.get(metric + "_sd", 0.0) for r in rows], fmt="o-", capsize=3, label="ours")


class TransferStudy(TrainingStudy):
    """A training study from a pretrained backbone at the scale's transfer flags (the paper's
    protocol for its small sets): a grid point is one run, its seed among its own flags."""
    data = "data/siri_whu"

    def more_flags(self, s):
        """No --seeds."""

    def runs(self, args):
        scale = SCALES[args.preset]
        pts = self.points(parse_grid(self, args.grid, args.preset), study_data(self, args), args)
        return [(name, point, folder, [*scale.transfer, *flags]) for name, point, folder, flags in pts]


def trained_on(data, flags):
    return f"Trained on `{utils.rel_path(data)}` with `{' '.join(flags)}`"


def _base(path):
    return os.path.basename(os.path.normpath(path))


def study_data(study, args):
    return args.data or study.data or SCALES[args.preset].data


def parse_seeds(args):
    """The training seeds of every grid point: --seeds, else the scale's, else --seed alone."""
    text = getattr(args, "seeds", None)
    if text is None:
        return list(SCALES[args.preset].seeds) if args.seed == 0 else [args.seed]
    try:
        seeds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds {text!r}: a comma list of distinct integers, e.g. 0,1,2")
    return seeds


def run_name(point):
    """The run folder's name of a grid value whose name is its own (peers: simclr-otlaug ->
    simclr_otlaug)."""
    return str(point).replace("-", "_")


def derived_data(src, dst, train_idx, test_idx, note):
    """A prepared-data folder that shares src's image cache (a symbolic link) with another split:
    how the studies train on subsets and other splits without copying images."""
    split = {"seed": None, "train": sorted(int(i) for i in train_idx),
             "test": sorted(int(i) for i in test_idx), "derived_from": os.path.abspath(src),
             "note": note}
    path = os.path.join(dst, "split.json")
    if os.path.isfile(path):
        with open(path) as fh:
            if json.load(fh) == split:
                return dst
        raise SystemExit(f"{dst} holds another split than this study asks for; delete it (and "
                         "the runs trained on it) or use another --runs")
    os.makedirs(dst, exist_ok=True)
    link = os.path.join(dst, "cache.pt")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(os.path.join(src, "cache.pt")), link)
    man = utils.load_manifest(src)
    man["derived"] = note
    utils.write_json(man, os.path.join(dst, "manifest.json"))
    utils.write_json(split, path)
    return dst


def run_stage(cmd, log):
    """A stage script in a child process (its own memory and threads), its output to log."""
    print("  $ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "a") as fh:
        proc = subprocess.run(cmd, cwd=HERE, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log, errors="replace") as fh:     # the child's own last word: often the why
            last = ([ln.strip() for ln in fh.read().splitlines()[-50:] if ln.strip()] or [""])[-1]
        raise SystemExit(f"{os.path.basename(cmd[1])} failed (exit {proc.returncode}: {last[:300]}); "
                         f"its output is in {log}.  Rerunning the same ablations.py command "
                         "resumes here.")


def training_study(study, args, pts=None):
    """Train and evaluate every grid point not finished yet (pts: study.runs(args), made here
    when not given); one result row per run, and the runs trained or evaluated.

    A run folder remembers what it was trained with (study_point.json: the data and the
    train_otl.py flags), and a rerun that asks for other flags in the same folder stops instead of
    taking the old run for the new point.  A point whose run folder is gone (another machine, a
    later checkout) but whose row is in the study's results JSON with the same data and flags is
    taken from there: so a study spans interruptions and machines through its committed results.
    The results are written after every run made, marked partial until the last point is in;
    such a partial file holds every row finished so far, those of points further on included."""
    study.check(args)
    pts = study.runs(args) if pts is None else pts
    folder = os.path.join(args.runs, args.preset, study.name)
    extra = shlex.split(args.train_args)
    recorded = recorded_rows(args)
    ident = lambda data, flags: {"data": utils.rel_path(data), "train_flags": [*flags, *extra]}  # noqa: E731
    rows, ran, carried = [], [], []

    def keep_finished(after):       # a partial file: the rows so far and every later one finished
        later = [finished_row(study, recorded.get(n), os.path.join(folder, n), p, ident(d, f),
                              study.evaluations(os.path.join(folder, n), j))
                 for j, (n, p, d, f) in enumerate(pts) if j > after]
        done = rows + [r for r in later if r]
        write_results(study, args, done, study.notes(args, done), partial=len(pts))
    for i, (name, point, data, flags) in enumerate(pts):
        run = os.path.join(folder, name)
        outs, own = study.evaluations(run, i), ident(data, flags)
        old = carried_row(recorded.get(name), run, own, outs)
        if old:
            print(f"[{study.name}] {name}: taken from {utils.rel_path(results_stem(args))}.json "
                  f"(trained at commit {str(old.get('git_commit'))[:12]}; its run folder is not here)",
                  flush=True)
            rows.append(old)
            carried.append(name)
            continue
        left = getattr(args, "max_runs", None)      # runs --max-runs still allows, every pass's
        if left is not None and left <= 0 and not finished_row(study, None, run, point, own, outs):
            keep_finished(i - 1)
            raise SystemExit(f"[{study.name}] stopped before {name}: --max-runs reached; the same "
                             "command continues")
        made = make_run(args, run, data, own, outs, f"[{study.name}] {name} ({i + 1}/{len(pts)})")
        if made:
            ran.append(name)
            if left is not None:
                args.max_runs = left - 1
        rows.append({**study.row(run, point, outs), "study_point": own})
        if made and i + 1 < len(pts):   # nothing finished is lost if the study stops here
            keep_finished(i)
    skipped = [n for n, *_ in pts if n not in ran]
    print(f"{study.name}: {len(ran)} run(s) trained or evaluated, {len(skipped)} finished before"
          + (f" ({len(carried)} of them taken from the results JSON)" if carried else ""), flush=True)
    return rows, ran


def carried_row(old, run, ident, outs):
    """The results JSON's row `old` of a point whose run folder is gone, where it was made with
    the point's data and flags and holds every evaluation; else None."""
    if not os.path.isdir(run) and old and old.get("study_point") == ident and (all(
            (e if _kind(e) == "linear" else f"{e}10") in old for e in outs)
            or failure(old) == "diverged"):
        return old
    return None


def finished_row(study, old, run, point, ident, outs):
    """A later point's row for a partial results file, where it needs no more work: carried from
    the results JSON, or read from its run folder made for this point, trained and evaluated."""
    if carried_row(old, run, ident, outs):
        return old
    try:        # a damaged record waits for the loop to reach its point, which names it
        had = utils.read_json(os.path.join(run, "study_point.json"), "", error=ValueError)
    except ValueError:
        return None
    if had == ident and os.path.isfile(os.path.join(run, "results.json")) and (
            diverged(run) or evaluated(run, outs)):
        return {**study.row(run, point, outs), "study_point": ident}
    return None


def make_run(args, run, data, ident, outs, say):
    """Train and evaluate the run unless it has finished (saying `say` first); whether it did."""
    os.makedirs(os.path.dirname(run), exist_ok=True)
    foreign = claim_run(run, ident)
    todo = (foreign or not os.path.isfile(os.path.join(run, "results.json"))
            or not (diverged(run) or evaluated(run, outs)))
    if todo:
        print(say, flush=True)
        train_and_evaluate(args, run, data, ident["train_flags"] + ["--same-flags"] * foreign, outs,
                           run + ".log")
        if foreign:     # its checkpoint was trained with the point's flags: the run is the point's
            utils.write_json(ident, os.path.join(run, "study_point.json"))
    return todo


def train_and_evaluate(args, run, data, flags, outs, log):
    """train_otl.py in run (which resumes or finds it finished), then each evaluation of outs
    ({name: path}) not there or of other weights."""
    py = [sys.executable]
    try:
        run_stage(py + ["train_otl.py", "--data", data, "--output", run, "--device", args.device,
                        "--no-progress", *flags], log)
    except SystemExit:
        why = diverged(run)
        if not why:
            raise
        print(f"  {why}: a failed run, not evaluated (its log: {log})", flush=True)
        return
    evaluated(run, outs)    # those made before this training are of other weights
    for e, path in outs.items():
        if not os.path.isfile(path):
            script = f"eval_{_kind(e)}.py"
            split = ["--split", "val"] if e.endswith("_val") else []    # choosing: test unread
            run_stage(py + [script, "--checkpoint", _checkpoint_of(run, e), "--device",
                            args.device, "--feature", "auto", "--output", path, "--no-progress",
                            *split], log)


STUDY_ROWS = (lambda rows: isinstance(rows, list) and all(
    isinstance(r, dict) and all(utils.is_top1(v) for k, v in r.items() if k.startswith(("knn", "linear")))
    for r in rows), "a list of row objects, their accuracies numbers in [0, 100]")


STUDY_FIELDS = {"rows": STUDY_ROWS, "grid": (lambda v: isinstance(v, list), "a list"),
                "data": (lambda v: isinstance(v, str), "a path")}


def read_study(path):
    """A study's results JSON, its rows (and the grid and data a rewrite keeps) checked; None when
    there is none."""
    return utils.read_json(path, "restore it (git checkout), or delete it: the study then reads "
                            "its rows again from its run folders and trains those that are gone",
                            STUDY_FIELDS, ("rows",))


def results_stem(args):
    return os.path.join(args.out, args.study + ("" if args.preset == "study" else f"_{args.preset}"))


def recorded_rows(args):
    """{run name: row} of the study's results JSON, for the runs whose folders are gone."""
    rows = (read_study(results_stem(args) + ".json") or {}).get("rows", [])
    return {os.path.basename(r["run"]): r for r in rows if r.get("run") and r.get("study_point")}


POINT_FIELDS = {"data": (lambda v: isinstance(v, str), "a path"), "train_flags": (
    lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v), "a list of flags")}


def claim_run(run, ident):
    """Record what a run folder is for, or stop if it holds a run made with other flags.  True
    where the folder holds a checkpoint but no record (a run the study did not make): it is
    recorded only once train_otl.py --same-flags has found its checkpoint's flags the point's."""
    path = os.path.join(run, "study_point.json")
    had = utils.read_json(path, f"delete it (the run in {run} is then checked against this "
                           "point's flags) or delete that folder", POINT_FIELDS, tuple(POINT_FIELDS))
    if had is None and any(os.path.exists(os.path.join(run, f))
                           for f in ("checkpoint.pth", "checkpoint0000.pth", "results.json")):
        return True
    if had is None:
        os.makedirs(run, exist_ok=True)
        utils.write_json(ident, path)
    elif had != ident:
        raise SystemExit(
            f"{run} holds a run of {had['data']} with train_otl.py flags {' '.join(had['train_flags'])}"
            f", not {ident['data']} with {' '.join(ident['train_flags'])}; delete that folder, "
            "or keep it and give this grid another --runs")
    return False


def _kind(e):
    """The evaluation script of an evaluation's name: knn, knn_init, knn_val -> knn; linear,
    linear_val -> linear (the _val ones score the validation split: eval_*.py --split val)."""
    return "linear" if e.startswith("linear") else "knn"


def _checkpoint_of(run, e):
    return os.path.join(run, "checkpoint0000.pth" if e == "knn_init" else "checkpoint.pth")


def _read_eval(run, e, path):
    return utils.read_eval(path, _kind(e), _checkpoint_of(run, e),
                            remake=f"delete it and run the same ablations.py command again: it "
                            f"evaluates {_checkpoint_of(run, e)} again")


def diverged(run):
    """How the run's loss diverged, where its results.json says so (train_otl.py marks it): a
    failed run, nothing to evaluate; else None."""
    res = utils.read_results(run) or {}
    return res["failed"] if failure(res) == "diverged" else None


def evaluated(run, outs):
    """Whether every evaluation JSON of outs ({name: path}) is there and of the run's checkpoint
    as it is now.  One of other weights (the run trained again since) is deleted, with a line
    saying so, and so made again."""
    epochs = (utils.read_results(run) or {}).get("epochs")
    for e, path in outs.items():
        ev = _read_eval(run, e, path)
        why = ev and utils.stale(path, ev, _checkpoint_of(run, e), 0 if e == "knn_init" else epochs)
        if why:
            print(f"  {why}: deleted, it is evaluated again", flush=True)
            os.remove(path)
    return all(os.path.isfile(p) for p in outs.values())


def training_row(run, point, outs, trained=()):
    """One run's table row: its grid point, scores, final loss and labeler figures; trained:
    figures read from its checkpoint (uneven's)."""
    res = utils.read_results(run)
    row = {**point, "run": utils.rel_path(run), "train_minutes": res.get("train_minutes"),
           "epochs": res.get("epochs"), "preset": res.get("preset"),
           **({"amp": res["amp"]} if "amp" in res else {}),   # bf16 autocast or float32
           "git_commit": res.get("git_commit"), "command": res.get("command"), **dict(trained)}
    if res.get("failed"):           # ended collapsed (train_otl.py's collapse signal)
        row["failed"] = res["failed"]
    for e, path in outs.items():
        r = _read_eval(run, e, path)
        if r is None and failure(res) == "diverged":     # a failed run: no scores
            continue
        if _kind(e) == "linear":
            row[e] = round(r["linear_top1"], 2)
        else:
            for kk, v in r["knn_top1"].items():
                row[f"{e}{kk}"] = round(v, 2)
    row.update(log_figures(utils.read_log(os.path.join(run, "log.jsonl")), row.get("timed_epoch_s")))
    return row


def log_figures(log, timed_epoch_s=None):
    """A run's figures from its log.jsonl: final loss, the labeler's last std and mean seconds,
    the median epoch's seconds, peak memory, and the kNN monitor's curve."""
    out = {}
    if log and "loss" in log[-1]:
        out["final_loss"] = round(log[-1]["loss"], 4)
    lab = [r for r in log if "pl_std" in r]
    if lab:
        out["pl_std_last"] = round(lab[-1]["pl_std"], 3)
    secs = [r["labeler_s"] for r in lab if "labeler_s" in r]
    if secs:
        out["labeler_s_mean"] = round(sum(secs) / len(secs), 3)
    epoch_s = sorted(r["epoch_s"] for r in log if utils.is_number(r.get("epoch_s")))
    if epoch_s:
        out["epoch_s"] = round(epoch_s[len(epoch_s) // 2], 2)              # the median epoch
    peak = [r["peak_mib"] for r in log if utils.is_number(r.get("peak_mib"))]
    if peak:
        out["peak_mib"] = max(peak)
    # the kNN monitor against the minutes of training so far, at the epoch timed alone where the
    # study timed one (budget), else the run's median epoch (an epoch slowed by other work on the
    # machine does not shift the curve); the split it scored: val, or test in logs from before
    # the validation split (which name none)
    mon = [r for r in log if utils.is_number(r.get("knn10")) and utils.is_number(r.get("epoch"))]
    per = timed_epoch_s if timed_epoch_s is not None else out.get("epoch_s")
    curve = [[round(r["epoch"] * per / 60, 3), r["knn10"]] for r in mon if per is not None]
    if curve:
        out["curve"] = curve
        out["curve_split"] = "val" if all(r.get("knn_split") == "val" for r in mon) else "test"
    return out


METRICS = ("knn10", "knn50", "knn100", "knn200", "linear", "knn_val10", "knn_val50", "linear_val")


def precision(row) -> str:
    """A table's precision cell: bf16 (autocast) or fp32, a seed's each where they differ, blank
    for runs from before results.json recorded it."""
    name = {True: "bf16", False: "fp32", None: "?"}
    amp = row.get("amp")
    if isinstance(amp, list):
        return ", ".join(name.get(a, "?") for a in amp)
    return name.get(amp, "?") if "amp" in row else ""


def failure(row) -> str:
    """A table's failed cell: whether a run ended collapsed or diverged, or how many seeds of a
    point did."""
    f = row.get("failed") or ""
    return f if f.startswith("seed") else ("diverged" if f.startswith("diverged") else
                                           "collapsed" if f else "")


def trial_of(row):
    """The grid point a run row belongs to (its seeds share it): its point, else its run."""
    return row.get("point", row.get("run"))


def seed_means(rows):
    """The runs of each grid point averaged over their seeds (mean, and <metric>_sd the sample
    standard deviation), in grid order; None when every point has one run."""
    groups = {}
    for r in rows:
        groups.setdefault(trial_of(r), []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return None
    means = []
    for g in groups.values():
        m = {k: v for k, v in g[0].items() if k not in ("run", "seed", "git_commit", "command",
                                                          "study_point")}
        m["seeds"] = [r.get("seed") for r in g]
        if len({r.get("amp") for r in g}) > 1:      # seeds run on machines with and without bf16
            m["amp"] = [r.get("amp") for r in g]
        m.pop("failed", None)
        failed = [r for r in g if r.get("failed")]
        if failed:
            how = sorted({"diverged" if failure(r) == "diverged" else "ended collapsed" for r in failed})
            m["failed"] = (f"seed(s) {', '.join(str(r.get('seed')) for r in failed)} of {len(g)} "
                           + " or ".join(how))
        for key in (*METRICS, "final_loss", "train_minutes", "epoch_s", "peak_mib"):
            vals = [r[key] for r in g if r.get(key) is not None]
            if vals:
                mean, sd = utils.mean_sd(vals)
                m[key] = round(mean, 4 if key == "final_loss" else 2)
                if key in METRICS and len(vals) > 1:    # one run (a study's `once`): no sd
                    m[f"{key}_sd"] = round(sd, 2)
        by_seed = {key: {str(r.get("seed")): r[key] for r in g if r.get(key) is not None}
                   for key in METRICS if any(r.get(key) is not None for r in g)}
        if by_seed:         # each seed's own, for paired comparisons (peers)
            m["by_seed"] = by_seed
        means.append(m)
    return means


TABLE_KEYS = ("k", "x", "d", "subset", "n_train", "model", "seed", "seeds", "labeler", "views",
              "reduction", "method", "config")


# The verdicts: each difference the paper's claim rests on, as the difference of two grid points'
# means +- its sd over the seeds, counted only beyond 2 sd (kNN@50, the paper's k).
VERDICT_METRIC = "knn50"    # the paper's kNN votes with k = 50 (Section 4)


def _diff(a, b, metric):
    """(a - b, sd) of two grid points' means of `metric`: the sd of a difference of two means,
    sqrt(sd_a^2 / n_a + sd_b^2 / n_b) over their seeds; None with one seed a point."""
    d = a[metric] - b[metric]
    na, nb = len(a.get("seeds") or [0]), len(b.get("seeds") or [0])
    if na < 2 or nb < 2:
        return d, None
    return d, math.sqrt(a.get(metric + "_sd", 0.0) ** 2 / na + b.get(metric + "_sd", 0.0) ** 2 / nb)


def _judged(d, sd):
    """'+2.1 +- 0.6, beyond 2 sd' (the 2-sd rule), or the difference alone with one seed."""
    if sd is None:
        return f"{d:+.1f} (no sd)"
    return f"{d:+.1f} +- {sd:.1f}, {'beyond' if abs(d) > 2 * sd else 'within'} 2 sd"


def _word(d, sd, expected_sign):
    """The verdict on a difference the paper says has `expected_sign`: agrees or disagrees when it
    is beyond 2 sd, 'not shown' within them."""
    if sd is None:
        return "cannot tell (one seed)"
    if abs(d) <= 2 * sd:
        return "not shown (within 2 sd)"
    return "agrees" if (d > 0) == (expected_sign > 0) else "disagrees"


def _f_sd(r, m):
    return f"{r[m]:.1f}" + (f" +- {r[m + '_sd']:.1f}" if m + "_sd" in r else "")


def compares_on(metric):
    """A verdict over the grid points that have `metric`, or the line saying there is one."""
    def wrap(verdict):
        @functools.wraps(verdict)
        def judged(study, rows):
            rows = [r for r in rows if metric in r]
            return verdict(study, rows) if len(rows) >= 2 else "one grid point: nothing to compare"
        return judged
    return wrap


compares = compares_on(VERDICT_METRIC)


def bars_panel(ax, rows, metric, names):
    """One metric a bar, mean +- sd over the seeds, a bar a grid point."""
    ax.bar(names, [r.get(metric, float("nan")) for r in rows],
           yerr=[r.get(metric + "_sd", 0.0) for r in rows], capsize=3)


# ==== Results files: <study>.json, .md and .png ===================================================
def write_results(study, args, rows, extra=None, partial=None, grid=None):
    """<study>.json, .md and .png.  partial: the number of runs the whole grid has, when rows
    holds only the runs finished so far; grid: the grid to record (default: the one asked for)."""
    os.makedirs(args.out, exist_ok=True)
    stem = results_stem(args)
    means = seed_means(rows) if study.kind == "training" else None
    verdict = study.verdict(means or rows)
    if grid is None:
        grid = parse_grid(study, args.grid, args.preset)
    out = {"study": study.name, "preset": args.preset, "paper": study.paper,
           "verdict": verdict, **({"grid": grid} if grid else {}), "rows": rows,
           **({"seed_means": means} if means else {}),
           **({"partial": f"{len(rows)} of {partial} runs"} if partial else {}), **(extra or {}),
           "command": utils.command_line(), "git_commit": utils.git_commit(),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
    utils.write_json(out, stem + ".json")
    commits = sorted({str(r["git_commit"])[:12] for r in rows if r.get("git_commit")})
    made = f"Made by `{out['command']}` at commit {out['git_commit'][:12]}."
    if len(commits) > 1 or (commits and commits[0] != out["git_commit"][:12]):
        made += f" Its runs were trained at commit(s) {', '.join(commits)} (each row's in the JSON)."
    notes = (extra or {}).get("notes")
    md = [f"# Ablation `{study.name}` (preset {args.preset})", "",
          *([f"**Partial: {len(rows)} of the grid's {partial} runs are in**; the same command "
             "continues the study.", ""] if partial else []),
          f"Paper: {study.paper}.", "", *([*notes, ""] if notes else []),
          f"Ours: {verdict}.", "", *study.table(means or rows), "", made]
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(md) + "\n")
    if not args.no_plot:
        plot(study.name, means or rows, stem + ".png", grid)
    print(f"{study.name}: {verdict}\nwrote {stem}.json, .md" + ("" if args.no_plot else ", .png")
          + (f" (partial: {out['partial']})" if partial else ""), flush=True)
    return out


def plot(name, rows, path, grid=None):
    """<study>.png: the study's two panels, titled with the paper's claim."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)", flush=True)
        return None
    study = STUDIES[name]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    study.plot(axes, rows, grid)
    fig.suptitle(f"{study.name}: {study.paper}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rewrite(study, args):
    """The study's files again from the rows its results JSON holds, training nothing; the grid
    and data it recorded are kept (--grid, when given, is the grid recorded)."""
    path = results_stem(args) + ".json"
    recorded = read_study(path)
    if recorded is None:
        raise SystemExit(f"--rewrite: {path} is missing; run the study first")
    rows = recorded["rows"]
    check_rows(study, rows, path)
    partial = recorded.get("partial")
    total = re.fullmatch(r"(\d+) of (\d+) runs", str(partial)) if partial is not None else None
    if partial is not None and (not total or int(total[1]) != len(rows)):
        raise SystemExit(f'--rewrite: {path}: "partial" is {partial!r}, not "{len(rows)} of M '
                         'runs" for its rows; restore it (git checkout), or run the study to finish it')
    presets = sorted({str(r.get("preset")) for r in rows})
    data = sorted({str((r.get("study_point") or {}).get("data", "?")) for r in rows})
    extra = study.rows_notes(rows)
    extra["notes"] = [f"Rewritten from the {len(rows)} rows of `{utils.rel_path(path)}` as "
                      f"recorded (preset {', '.join(presets)}; data {', '.join(data)}), nothing "
                      "trained."] + ([""] + extra["notes"] if extra["notes"] else [])
    if recorded.get("data"):
        extra["data"] = recorded["data"]
    extra.update({k: recorded[k] for k in study.kept if k in recorded})
    grid = parse_grid(study, args.grid, args.preset) if args.grid else recorded.get("grid", [])
    return write_results(study, args, rows, extra, grid=grid, partial=total and int(total[2]))


ROW_NUMBERS = ("train_minutes", "epochs", "final_loss", "epoch_s", "peak_mib", "n_train",
               "k_clusters", "seed", "labeler_s_mean", "pl_std_last")


def check_rows(study, rows, path):
    """Stop, naming the row, at a hand-edited row a rewrite would misread: a grid field missing
    or not of the study's grid, a figure that is not a number, a run listed twice."""
    runs = set()
    for i, r in enumerate(rows):
        where = f"--rewrite: {path}: row {i + 1} (run {r.get('run')!r})"
        if not isinstance(r.get("run"), str):
            raise SystemExit(f"{where} has no run folder name; restore the row (git checkout)")
        if r["run"] in runs:
            raise SystemExit(f"{where} repeats an earlier row's run: delete one of them")
        runs.add(r["run"])
        for key, allowed in [*study.keys.items(), *((k, NUMBER) for k in ROW_NUMBERS if k in r)]:
            v = r.get(key)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  if allowed == NUMBER else v in allowed)
            if key in ROW_NUMBERS and key not in study.keys and v is None:
                continue                            # a figure the run did not record
            if not ok:
                want = allowed if allowed == NUMBER else "one of " + ", ".join(map(str, allowed))
                raise SystemExit(f"{where}: {key!r} is {v!r}, not {want}; restore the row (git "
                                 "checkout) or delete it")




# ==== beta: the published labeler's evenness against beta =========================================
@register
class Beta(LabelerStudy):
    """The published labeler's std of the counts against iteration for beta = 1.5 .. 6 and 5 ..
    50, k = 128 (paper: even for the whole range)."""
    name, axis, methods = "beta", "beta", ("published",)
    grid = (1.5, 2, 2.5, 3, 4, 5, 6, 10, 20, 30, 40, 50)
    paper = "even distributions for every beta from 1.5 to 50: the labeler is insensitive to beta"

    def verdict(self, rows):
        worst = max(rows, key=lambda r: r["std"])
        frac = worst["std"] / worst["std_max"]
        return (f"{'agrees' if frac < 0.01 else 'disagrees'}: the largest final std over every "
                f"beta and input is {worst['std']:.2f} ({100 * frac:.3f} % of the std with all "
                f"images in one cluster; {worst['input']}, beta {worst['beta']:g})")

    def table(self, rows):
        return utils.md_table(["input", "beta", "iterations", "final std", "max - min", "std before", "seconds"],
                              [[r["input"], f"{r['beta']:g}", str(r["iterations"]), f"{r['std']:.2f}",
                                str(r["max_minus_min"]), f"{r['std_before']:.1f}", f"{r['seconds']:.2f}"]
                               for r in rows])

    def plot(self, axes, rows, grid=None):
        import matplotlib.pyplot as plt
        for ax, inp in zip(axes, ("gaussian", "random_net")):
            rs = [r for r in rows if r["input"] == inp]
            for j, r in enumerate(rs):
                h = [max(v, 1e-2) for v in r["std_history"]]
                ax.semilogy(range(len(h)), h, label=f"beta {r['beta']:g}",
                            color=plt.cm.viridis(j / max(len(rs) - 1, 1)))
            ax.set(title=f"{inp}, k = {rows[0]['k']}", xlabel="iteration", ylabel="std of the counts")
        axes[1].legend(fontsize=7, ncol=2)


# ==== k-labeler: the published labeler's iterations against k =====================================
@register
class KLabeler(LabelerStudy):
    """Iterations and final std of the published labeler (and otl.py's reference exact labeler)
    for k = 50 .. 1000 (paper: about 20 iterations or fewer for every k)."""
    name, methods, grid = "k-labeler", ("published", "reference"), tuple(range(50, 1001, 50))
    paper = "about 20 iterations or fewer for every k of its figure (N = 50,000, beta = 1.5)"

    def verdict(self, rows):
        pub = [r for r in rows if r["method"] == "published"]
        most = max(pub, key=lambda r: r["iterations"])
        reach = [steps_to_final(r) for r in pub]
        over = sum(n > 20 for n in reach)
        return (f"{'agrees' if over == 0 else 'disagrees'}: the published labeler tries at most "
                f"{most['iterations']} steps ({most['input']}, k = {most['k']}; undone steps "
                f"and the 10 unchanged ones before it stops included) and first reaches its "
                f"final std after {min(reach)} to {max(reach)} steps; {over} of {len(pub)} "
                f"cases need more than 20")

    def table(self, rows):
        return super().table(rows, steps=True)


# ==== sinkhorn: OTL against Sinkhorn-Knopp ========================================================
@register
class Sinkhorn(LabelerStudy):
    """OTL (published, and otl.py's reference exact labeler) against Sinkhorn-Knopp for k = 50,
    100, .., 1000: final std and seconds (paper: OTL more even for every k)."""
    name, methods, grid = "sinkhorn", ("published", "reference", "sinkhorn"), tuple(range(50, 1001, 50))
    paper = "OTL gives more even clusters than Sinkhorn-Knopp for every k from 50 to 1000"

    def verdict(self, rows):
        by = {(r["input"], r["k"], r["method"]): r for r in rows}
        pairs = [(by[(i, k, 'published')], by[(i, k, 'reference')], by[(i, k, 'sinkhorn')])
                 for i, k in {(r["input"], r["k"]) for r in rows}]
        pub_better = sum(p["std"] < s["std"] for p, _, s in pairs)
        ex_better = sum(e["std"] < s["std"] for _, e, s in pairs)
        return (f"{'agrees' if pub_better == len(pairs) else 'partly agrees' if pub_better else 'disagrees'}: "
                f"the published labeler is more even than Sinkhorn-Knopp in {pub_better} of "
                f"{len(pairs)} cases, the reference exact labeler in {ex_better} of {len(pairs)}")

    def plot(self, axes, rows, grid=None):
        super().plot(axes, rows, grid, left="seconds")


# ==== k: accuracy against the number of clusters ==================================================
_K = PAPER_TABLES["diff-k-10"]
# {k: kNN} of CIFAR-10 (the paper's kNN is k = 50 where a table gives no k: Section 4's setting)
PAPER_K = dict(zip(_K["columns"], _row_of(_K, row="kNN")["values"]))


@register
class K(TrainingStudy):
    """k in 10 .. 1024: kNN and linear accuracy against k (the paper: 32 .. 1024)."""
    name, grid, evals = "k", (10, 32, 64, 128, 256, 512, 1024), ("knn", "linear")
    xkey, keys = "k", {"k": NUMBER}
    paper = f"kNN against k on CIFAR-10 (table diff-k-10, k: kNN): {_listed(PAPER_K)}"

    def points(self, grid, data, args):
        return [(f"k{k}", {"k": k}, data, ["--k", str(k)]) for k in grid]

    @compares
    def verdict(self, rows):
        """The best k against the worst, beside the paper's."""
        m = VERDICT_METRIC
        best, worst = max(rows, key=lambda r: r[m]), min(rows, key=lambda r: r[m])
        d, sd = _diff(best, worst, m)
        top, low = max(PAPER_K, key=PAPER_K.get), min(PAPER_K, key=PAPER_K.get)
        ours = (f"kNN@50 {best[m]:.1f} at every k ({', '.join(str(r['k']) for r in rows)}): no best"
                if best[m] == worst[m] else f"kNN@50 best at k = {best['k']} ({best[m]:.1f}), worst "
                f"at k = {worst['k']} ({worst[m]:.1f}): {_judged(d, sd)}")
        return (f"{ours}; the paper: best at k = {top} "
                f"({PAPER_K[top]:.1f}), worst at k = {low} ({PAPER_K[low]:.1f}), "
                f"{PAPER_K[top] - PAPER_K[low]:+.1f}")

    def panel(self, ax, rows, metric, grid):
        super().panel(ax, rows, metric, grid)
        ax.set_xscale("log", base=2)


# ==== uneven: accuracy against the target's evenness ==============================================
_UNEVEN = PAPER_TABLES["dis-com"]
PAPER_UNEVEN = dict(zip(_UNEVEN["x"], _row_of(_UNEVEN, dataset="cifar10", row="kNN")["values"]))


@register
class Uneven(TrainingStudy):
    """Target n_i ~ i^x, x = 0 .. 10, k = 128: kNN against the target's evenness."""
    name, grid, evals = "uneven", (0, 2, 4, 6, 8, 10), ("knn",)
    xkey, keys = "x", {"x": NUMBER}
    paper = ("accuracy falls as the target's evenness falls (table dis-com, CIFAR-10, x: kNN: "
             f"{_listed(PAPER_UNEVEN)})")

    def points(self, grid, data, args):
        return [(f"x{x:g}", {"x": x}, data, ["--target-x", str(x)]) for x in grid]

    def row(self, run, point, outs):
        """training_row, with the N and k the run's labeler balanced (from its checkpoint): the
        std of the targets it trained on is theirs."""
        ck, trained = os.path.join(run, "checkpoint.pth"), {}
        if os.path.isfile(ck):
            try:    # tensors and plain data only: a crafted checkpoint in a study folder runs nothing
                ck = utils.load_file(ck)
            except ValueError as e:
                raise SystemExit(f"{e}; or move {run} out of the study's folder") from None
            if ck.get("pseudo_labels") is not None and not ck["args"].get("supervised"):
                trained = {"n_train": len(ck["pseudo_labels"][0]), "k_clusters": ck["args"]["k"]}
        return training_row(run, point, outs, trained)

    def rows_notes(self, rows=(), n=50_000):
        """The std of the uneven targets under both indexings beside the paper's (table dis-com,
        CIFAR-10, N = n), to check the targets against the paper's; then the std of the targets the
        rows trained on (their n_train and k_clusters) where those differ."""
        row = _row_of(_UNEVEN, dataset="cifar10", row="std")
        k, printed = row["k_clusters"], row["values"]
        fixed = {m["column"]: m["right"] for m in _UNEVEN["misprints"]
                 if m.get("row") == _UNEVEN["rows"].index(row)}
        lines = []
        for j, x in enumerate(_UNEVEN["x"]):
            # the sample (n - 1) std over the k clusters: the paper's stds are reproduced by it
            s0 = otl.uneven_target(n, k, x, first=0).std().item()
            s1 = otl.uneven_target(n, k, x, first=1).std().item()
            su = utils.formula_std(n, k, x)                        # the unrounded targets
            paper = f"{printed[j]:g}" + (f" (misprint; {fixed[j]:g})" if j in fixed else "")
            agree = "yes" if round(su, 1) == printed[j] else "no"
            lines.append(f"| {x:g} | {su:.2f} | {paper} | {agree} | {s0:.1f} | {s1:.1f} |")
        notes = [
            f"Target std (N = {n:,}, k = {k}; the sample std over the clusters): the formula's "
            "unrounded targets n_i = N i^x / sum_i i^x (i = 0 .. k-1) beside the paper's printed "
            "stds (table dis-com, CIFAR-10; misprints as paper_tables.json marks them), then the "
            "integer targets `otl.uneven_target` makes of them, for i = 0 .. k-1 (the paper's "
            "indexing, what training uses) and i = 1 .. k:",
            "", "| x | formula | paper | printed = formula | integer, i = 0 .. k-1 | integer, i = 1 .. k |",
            "|---|---|---|---|---|---|", *lines]
        trained = {(r["n_train"], r["k_clusters"]) for r in rows if r.get("n_train") and r.get("k_clusters")}
        for nt, kt in sorted(trained - {(n, k)}):
            notes += ["", f"Trained here on N = {nt:,} images, k = {kt}: the integer targets' std, "
                      "i = 0 .. k-1: " + ", ".join(
                          f"x = {x:g}: {otl.uneven_target(nt, kt, x, first=0).std().item():.1f}"
                          for x in _UNEVEN["x"]) + "."]
        return {"target_std": lines, "notes": notes}

    @compares
    def verdict(self, rows):
        """The first x (the most even target) against the last: the paper's fall."""
        m, (even, last) = VERDICT_METRIC, (rows[0], rows[-1])
        d, sd = _diff(even, last, m)
        xs = list(PAPER_UNEVEN)
        return (f"{_word(d, sd, +1)}: kNN@50 at x = {even['x']:g} minus x = {last['x']:g}: "
                f"{_judged(d, sd)} (the paper, CIFAR-10: x = {xs[0]:g} minus x = {xs[-1]:g}: "
                f"{PAPER_UNEVEN[xs[0]] - PAPER_UNEVEN[xs[-1]]:+.1f})")


# ==== imbalanced: OTL on the paper's uneven subsets D_d against even ones of the same size ========
_IMB = PAPER_TABLES["imb-data"]
PAPER_IMBALANCED = dict(zip(_IMB["d"], _row_of(_IMB, row="Uneven")["values"]))     # {d: kNN}
PAPER_IMBALANCED_EVEN = dict(zip(_IMB["d"], _row_of(_IMB, row="Even")["values"]))


def imbalanced_indices(labels, train_idx, d, even, seed):
    """The paper's D_d: 0, d, 2d, .., (C-1) d training images deleted (at random, seeded) from
    classes 0 .. C-1; even: the same number deleted evenly over the classes (the remainder from
    the first classes).  Returns the kept training indices."""
    C = int(labels.max()) + 1
    train_idx = torch.as_tensor(train_idx)
    per_class = [train_idx[labels[train_idx] == c] for c in range(C)]
    total = d * C * (C - 1) // 2
    drop = ([d * c for c in range(C)] if not even else
            [total // C + (1 if c < total % C else 0) for c in range(C)])
    g = torch.Generator().manual_seed(seed)
    kept = []
    for c, idx in enumerate(per_class):
        if drop[c] >= len(idx):
            raise SystemExit(f"D_{d}: class {c} has {len(idx)} training images, fewer than the "
                             f"{drop[c]} to delete; use a smaller d (--grid)")
        kept.append(idx[torch.randperm(len(idx), generator=g)[drop[c]:]])
    return torch.cat(kept).sort().values


@register
class Imbalanced(TrainingStudy):
    """The paper's D_d subsets (0, d, .., 9d images deleted from classes 0 .. 9; d = 100 .. 500 on
    CIFAR-10, 40 .. 200 on EuroSAT) against even subsets of the same size: kNN."""
    name, grid, evals = "imbalanced", (100, 200, 300, 400, 500), ("knn",)
    xkey, keys = "d", {"d": NUMBER, "subset": ("even", "uneven")}
    paper = ("kNN of OTL trained on the uneven D_100 .. D_500 (table imb-data): "
             + ", ".join(f"{v:.1f}" for v in PAPER_IMBALANCED.values()))

    def default_grid(self, preset="study"):
        # EuroSAT's classes hold about 2,160 training images against CIFAR's 5,000: the study
        # scale's d is the paper's scaled by 0.4
        return [40, 80, 120, 160, 200] if preset == "study" else list(self.grid)

    def points(self, grid, data, args):
        """Per d, the paper's uneven D_d and an even subset of its size, each a derived data
        folder."""
        d, pts = utils.load_prepared(data), []
        for g in grid:
            for even in (False, True):
                kept = imbalanced_indices(d["labels"], d["train_idx"], int(g), even, args.seed)
                name = f"D{g}_{'even' if even else 'uneven'}"
                folder = derived_data(data, os.path.join(args.runs, "data", f"{_base(data)}_{name}"),
                                      kept, d["test_idx"], f"{'even subset of the size of ' if even else ''}"
                                      f"the paper's D_{g}: {len(kept)} training images")
                pts.append((name, {"d": int(g), "subset": "even" if even else "uneven",
                                   "n_train": len(kept)}, folder, []))
        return pts

    def trained_how(self, args, data):
        note = super().trained_how(args, data)
        return note if "cifar10" in _base(data) else (note + "; d is the paper's scaled to this set's "
                                               "class sizes (EuroSAT: about 2,160 training "
                                               "images a class, CIFAR-10: 5,000)")

    @compares
    def verdict(self, rows):
        """The uneven D_d at the smallest d against the largest, and each even subset against its
        uneven twin."""
        m = VERDICT_METRIC
        un = sorted((r for r in rows if r["subset"] == "uneven"), key=lambda r: r["d"])
        ev = {r["d"]: r for r in rows if r["subset"] == "even"}
        parts = []
        if len(un) > 1:
            d, sd = _diff(un[0], un[-1], m)
            ds = list(PAPER_IMBALANCED)
            parts.append(f"{_word(d, sd, +1)}: uneven D_{un[0]['d']} minus D_{un[-1]['d']}: "
                         f"{_judged(d, sd)} (the paper: D_{ds[0]} minus D_{ds[-1]}: "
                         f"{PAPER_IMBALANCED[ds[0]] - PAPER_IMBALANCED[ds[-1]]:+.1f})")
        gaps = [(r["d"], *_diff(ev[r["d"]], r, m)) for r in un if r["d"] in ev]
        if gaps:
            beyond = sum(sd is not None and abs(g) > 2 * sd for _, g, sd in gaps)
            parts.append("even minus uneven subset: " + ", ".join(
                f"D_{dd} {_judged(g, sd)}" for dd, g, sd in gaps)
                + f" ({beyond} of {len(gaps)} beyond 2 sd; the paper: "
                + ", ".join(f"{PAPER_IMBALANCED_EVEN[dd] - PAPER_IMBALANCED[dd]:+.1f}"
                            for dd in PAPER_IMBALANCED) + ")")
        return "; ".join(parts)

    def panel(self, ax, rows, metric, grid):
        for sub in ("uneven", "even"):
            rs = [r for r in rows if r["subset"] == sub]
            ax.errorbar([r["d"] for r in rs], [r.get(metric, float("nan")) for r in rs],
                        yerr=[r.get(metric + "_sd", 0.0) for r in rs], fmt="o-", capsize=3, label=sub)
        # the paper's D_100 .. D_500 at the study's scaled d (its whole grid, so a partial study
        # draws them where they belong), in order, when the grids match in length
        xs = grid if grid and len(grid) == len(PAPER_IMBALANCED) else list(PAPER_IMBALANCED)
        ax.plot(xs, list(PAPER_IMBALANCED.values()), "k:",
                label="uneven (paper" + (", its d scaled)" if xs != list(PAPER_IMBALANCED) else ")"))
        ax.legend(fontsize=8)


# ==== splits: five seeded divisions of SIRI-WHU, OTL and supervised from a pretrained backbone ====
_SPLITS = PAPER_TABLES["5whu"]
# {model: {knn10 | linear: the five divisions' accuracies}}
PAPER_SPLITS = {model: {m: [r["values"][_SPLITS["columns"].index(model)] for r in _SPLITS["rows"]
                           if r["evaluation"] == e and r["k"] == k]
                       for m, e, k in (("knn10", "kNN", 10), ("linear", "linear", None))}
                for model in ("OTL", "supervised")}


@register
class Splits(TransferStudy):
    """Five seeded 80/20 divisions of SIRI-WHU, OTL and supervised from a pretrained backbone
    (--init): mean and spread."""
    name, grid, evals = "splits", (0, 1, 2, 3, 4), ("knn", "linear")
    xkey, keys = "seed", {"seed": NUMBER, "model": ("OTL", "supervised")}
    paper = ("five random 80/20 divisions of SIRI-WHU, from a pretrained ResNet-18 (table 5whu): "
             + "; ".join(f"{m}: kNN@10 {{:.1f}} +- {{:.1f}}, linear {{:.1f}} +- {{:.1f}}".format(
                 *utils.mean_sd(PAPER_SPLITS[m]["knn10"]), *utils.mean_sd(PAPER_SPLITS[m]["linear"]))
                         for m in ("OTL", "supervised")))

    def more_flags(self, s):    # its grid is its seeds: no --seeds
        s.add_argument("--init", default="runs/eurosat/checkpoint.pth", help="the "
                       "pretrained backbone both models of every division start from "
                       "(train_otl.py --init; default: make eurosat's run, the only "
                       "pretraining set at hand; the paper's are PatternNet's)")

    def check(self, args):
        if not os.path.isfile(args.init):
            raise SystemExit(f"--init {args.init}: no such checkpoint; the {self.name} study starts "
                             "every division from a pretrained backbone: run `make eurosat` first, "
                             "or pass --init with another run's checkpoint.pth")

    def points(self, grid, data, args):
        """Per seed, a stratified 80/20 division: OTL and supervised, both from --init."""
        labels, pts = utils.load_prepared(data)["labels"], []
        for g in grid:
            train, test = utils.stratified_split(labels, 0.2, seed=int(g))
            folder = derived_data(data, os.path.join(args.runs, "data", f"{_base(data)}_split{g}"),
                                  train, test, f"stratified 80/20 split, seed {g}")
            for model, sfx, more in (("OTL", "", []), ("supervised", "_supervised", ["--supervised"])):
                pts.append((f"seed{g}{sfx}", {"seed": int(g), "model": model}, folder,
                            ["--seed", str(g), "--init", args.init, *more]))
        return pts

    def trained_how(self, args, data):
        return (trained_on(data, SCALES[args.preset].transfer)
                + f", OTL and supervised both from `{utils.rel_path(args.init)}`")

    def verdict(self, rows):
        """Each model's mean +- sd over its divisions beside the paper's five."""
        parts = []
        for model in ("OTL", "supervised"):
            rs = [r for r in rows if r.get("model", "OTL") == model]
            if rs:
                ours = [utils.mean_sd([r[k] for r in rs if k in r]) for k in ("knn10", "linear")]
                paper = [utils.mean_sd(PAPER_SPLITS[model][k]) for k in ("knn10", "linear")]
                parts.append(f"{model} over {len(rs)} divisions: kNN@10 {ours[0][0]:.1f} +- "
                             f"{ours[0][1]:.1f}, linear {ours[1][0]:.1f} +- {ours[1][1]:.1f} (the "
                             f"paper's: {paper[0][0]:.1f} +- {paper[0][1]:.1f}, {paper[1][0]:.1f} "
                             f"+- {paper[1][1]:.1f})")
        return "; ".join(parts) + " (mean +- sample sd)"

    def table(self, rows):      # its seed is a grid value: a column
        return super().table(rows, hide=(), start="The --init backbone before any training on this set")

    def panel(self, ax, rows, metric, grid):
        """Seeds are not an axis: one point each, the mean and +- sd as the table gives them."""
        for model, colour in (("OTL", "C0"), ("supervised", "C1")):
            rs = [r for r in rows if r.get("model", "OTL") == model]
            if not rs:
                continue
            xs = [r["seed"] for r in rs]
            ys = [r.get(metric, float("nan")) for r in rs]
            m, sd = utils.mean_sd([y for y in ys if not math.isnan(y)])
            ax.plot(xs, ys, "o", color=colour, label=f"{model}, one division each")
            ax.axhline(m, color=colour, lw=1, label=f"{model} mean {m:.1f} +- {sd:.1f} (sd)")
            ax.axhspan(m - sd, m + sd, color=colour, alpha=0.1)
            ax.set_xticks(sorted({r["seed"] for r in rows}))
        ax.legend(fontsize=7)


# ==== labeler-in-training (ours): the same training with each labeler =============================
@register
class LabelerInTraining(TrainingStudy):
    """The same training with the published labeler, ours and Sinkhorn-Knopp."""
    name, grid, evals = "labeler-in-training", ("published", "exact", "sinkhorn"), ("knn", "linear")
    keys = {"labeler": ("published", "exact", "sinkhorn")}
    paper = "not in the paper (ours)"

    def points(self, grid, data, args):
        return [(m, {"labeler": m}, data, ["--labeler", m]) for m in grid]

    @compares
    def verdict(self, rows):
        """The best labeler against each other one."""
        m = VERDICT_METRIC
        top, *rest = sorted(rows, key=lambda r: -r[m])
        gaps = [(r["labeler"], *_diff(top, r, m)) for r in rest]
        behind = [name for name, d, sd in gaps if sd is not None and abs(d) > 2 * sd]
        return (", ".join(f"{r['labeler']} {_f_sd(r, m)}" for r in rows) + " kNN@50; " + "; ".join(
            f"{top['labeler']} minus {name}: {_judged(d, sd)}" for name, d, sd in gaps)
            + ("" if any(sd is None for *_, sd in gaps) else
               f": {top['labeler']} measurably above {', '.join(behind)}" if behind else
               ": no labeler is measurably better"))

    def panel(self, ax, rows, metric, grid):
        bars_panel(ax, rows, metric, [r["labeler"] for r in rows])


# ==== lct (ours): LCT with 1, 2 and 4 views, its loss averaged or summed over view pairs ==========
@register
class Lct(TrainingStudy):
    """LCT with 1, 2 and 4 views, the loss averaged over view pairs or summed."""
    name, grid, evals = "lct", ("1-mean", "2-mean", "2-sum", "4-mean", "4-sum"), ("knn",)
    keys = {"views": NUMBER, "reduction": ("mean", "sum")}
    paper = "not in the paper (ours); the paper writes the LCT loss as a sum over view pairs"

    def points(self, grid, data, args):
        return [(f"views{v}_{red}", {"views": int(v), "reduction": red}, data,
                 ["--views", v, "--label-views", v, "--lct", "true", "--lct-reduction", red])
                for v, red in (g.split("-") for g in grid)]

    @compares
    def verdict(self, rows):
        """Each view count and reduction against the first point."""
        m, base = VERDICT_METRIC, rows[0]
        return (", ".join(f"{r['views']} view(s) {r['reduction']} {_f_sd(r, m)}" for r in rows)
                + f" kNN@50; against {base['views']} view(s) {base['reduction']}: " + "; ".join(
                    f"{r['views']} {r['reduction']} {_judged(*_diff(r, base, m))}" for r in rows[1:]))

    def panel(self, ax, rows, metric, grid):
        bars_panel(ax, rows, metric, [f"{r['views']}v {r['reduction']}" for r in rows])


# ==== peers (ours): OTL beside SeLa, SimCLR, BYOL and SwAV on the same backbone, data and schedule ====
# a method alone: equal epochs; <method>-time: its epochs set so that its minutes match OTL's;
# <peer>-otlaug: untuned with OTL's views (the comparison before tuning kept its rows)
PEERS = ("otl", "sela", "simclr", "byol", "swav", "simclr-otlaug", "byol-otlaug", "swav-otlaug",
         "sela-time", "simclr-time", "byol-time", "swav-time")
PEER_SEEDS = {"study": (0, 1, 2, 3, 4), "cpu": (0, 1, 2)}
UNTUNED = {"otl": [], "sela": ["--labeler", "sinkhorn"]}     # a peer: --method <peer>

# Published figures of the peers for scale, each from its own network, schedule and data: ResNet-18
# on CIFAR-10 in lightly's benchmark table (kNN, 200 epochs, batch 512, one GPU) and solo-learn's
# (linear, 1,000 epochs); on EuroSAT's RGB images, SeCo's ResNet-18 (linear, torchgeo's weights
# table) and our OTL `fast` run (results/gpu/fast208/eurosat_fast_h100.json)
PEER_ANCHORS = (("SimCLR", "84.8", "90.7"), ("BYOL", "86.8", "92.6"), ("SwAV", "84.2", "89.2"))
EUROSAT_ANCHORS = ("SeCo ResNet-18 93.1 linear; OTL `fast` (ResNet-18, 112 px, 208 epochs) "
                   "96.4 kNN@10 / 97.0 linear")


def peer_seeds(args):
    """--seeds, else the peers' own (5 at the study scale, 3 at the cpu preset's)."""
    if getattr(args, "seeds", None) is None and args.seed == 0 and args.preset in PEER_SEEDS:
        return list(PEER_SEEDS[args.preset])
    return parse_seeds(args)


def tuned_flags(args):
    """{method: train_otl.py flags} of the trials peers-tune selected (--tuned, default
    <--out>/peers-tune.json), less the preset and epochs the tuning ran at, or None with --tuned
    none (every method untuned)."""
    if args.tuned == "none":
        return None
    path = args.tuned or os.path.join(args.out, "peers-tune.json")
    rec = read_study(path) if os.path.isfile(path) else None
    if rec is None or not rec.get("selected"):
        raise SystemExit(f"{args.study} trains each method at the recipe peers-tune selected on the "
                         f"validation split, and {path} holds none: run `make peers-tune` first, "
                         "pass --tuned <its JSON>, or --tuned none for every method untuned")
    if rec.get("partial"):
        raise SystemExit(f"{path} is partial ({rec['partial']}): finish `make peers-tune` first")
    return {m: _drop(sel["flags"], "--preset", "--epochs") for m, sel in rec["selected"].items()}


def _drop(flags, *names):
    """flags less each of names and its value: a trial's recipe without the tuning's scale, which
    the comparison's own scale sets (the cpu preset's whole schedule, not the study's 8 epochs)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in names:
            skip = True
        else:
            out.append(f)
    return out


def paired(a, b, metric):
    """(mean of a - b over the seeds both have, the half-width of its 95 % t interval or None,
    the seeds' count): a paired comparison of two grid points' runs seed by seed."""
    va, vb = _by_seed(a, metric), _by_seed(b, metric)
    d = [va[s] - vb[s] for s in va if s in vb]
    if not d:
        return None, None, 0
    mean, sd = utils.mean_sd(d)
    if len(d) < 2:
        return mean, None, 1
    from scipy import stats
    return mean, float(stats.t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d)), len(d)


def _by_seed(row, metric):
    """{seed: the metric} of a row: a seed mean's per-seed values, or one run's."""
    if "by_seed" in row:
        return {int(s): v for s, v in row["by_seed"].get(metric, {}).items()}
    return {int(row.get("seed", 0)): row[metric]} if metric in row else {}


def _paired_text(d, half, n):
    if d is None:
        return "no common seed"
    if half is None:
        return f"{d:+.1f} (one seed: no interval)"
    verdict = "beyond 0" if abs(d) > half else "within its interval of 0"
    return f"{d:+.1f} (95% CI {d - half:+.1f} to {d + half:+.1f}, {n} paired seeds: {verdict})"


def _flags(row):
    return (row.get("study_point") or {}).get("train_flags") or []


def _uniform_loss(row):
    """A softmax method's run (OTL, SeLa, SwAV) whose final loss sits at ln k, a uniform
    prediction (peers.collapse_verdict on its last epoch), for rows whose runs predate the
    collapse signal in results.json; None otherwise."""
    if row["method"].partition("-")[0] not in ("otl", "sela", "swav") or "final_loss" not in row:
        return None
    f = _flags(row)
    k = int(f[f.index("--prototypes") + 1]) if "--prototypes" in f else (
        int(f[f.index("--k") + 1]) if "--k" in f else presets.PRESETS["cpu"]["k"])
    why = peers.collapse_verdict({"loss": row["final_loss"]}, row.get("epochs") or 0, k)
    return f"collapsed: {why}" if why else None


@register
class Peers(TrainingStudy):
    """OTL beside SeLa, SimCLR, BYOL and SwAV on the same backbone and data, each at the recipe
    peers-tune selected for it on the validation split: at equal epochs and at equal wall-clock
    (<method>-time: its epochs set so that its minutes match OTL's), 5 seeds at the study scale and
    3 at the cpu preset's; the test split read once a run, each method against OTL by a paired
    test over the same seeds (`make peers`, `make peers-cpu`)."""
    name, grid, evals, keys = "peers", PEERS, ("knn", "linear"), {"method": PEERS}
    paper = ("not in the paper, whose tables set OTL beside other methods' published numbers only "
             "(ours: the same backbone, data and tuning budget for every method, compared at equal "
             "epochs and at equal minutes; the published anchors are below the table)")
    once = ("simclr-otlaug", "byol-otlaug", "swav-otlaug")  # a check beside the comparison: one seed
    kept = ("equal_time_epochs", "timing")  # a rewrite keeps the epochs a resumed study trains to

    def more_flags(self, s):
        s.add_argument("--seeds", help="the seeds of every method (default 0,1,2,3,4 at the study "
                       "scale, 0,1,2 at the cpu preset's); each method against OTL is paired over them")
        s.add_argument("--tuned", help="the peers-tune results JSON whose selected trials give each "
                       "method's flags (default: <--out>/peers-tune.json); 'none': every method at "
                       "the preset's SGD and its own views, untuned (the comparison before tuning)")

    def default_grid(self, preset="study"):
        return ["otl", "sela", "simclr", "byol", "swav", "sela-time", "simclr-time", "byol-time",
                "swav-time"]

    def points(self, grid, data, args, monitor=2):
        """Each method at its tuned flags (untuned with --tuned none, and for a -otlaug point:
        OTL's views), the kNN monitor of the validation split every `monitor` epochs for the
        curves; a -time point at the epochs that match OTL's minutes (self.epochs), left out
        until they are known."""
        tuned = tuned_flags(args)
        out = []
        for g in grid:
            method, _, variant = g.partition("-")
            if tuned is None or variant == "otlaug":
                f = UNTUNED.get(method, ["--method", method] + (["--peer-aug", "otl"] if variant else []))
            elif method not in tuned:
                raise SystemExit(f"peers-tune selected no trial for {method} (every one failed or "
                                 "none ran): tune it first")
            else:
                f = list(tuned[method])
            if variant == "time":
                epochs = getattr(self, "epochs", {}).get(method)
                if epochs is None:
                    continue
                f = [*f, "--epochs", str(epochs)]
            elif getattr(args, "base_epochs", None):
                f = [*f, "--epochs", args.base_epochs]
            out.append((run_name(g), {"method": g}, data, [*f, "--knn-monitor", str(monitor)]))
        return out

    def seeds(self, args):
        return peer_seeds(args)

    def runs(self, args):
        first, once = self.seeds(args)[0], {run_name(g) for g in self.once}
        return [r for r in super().runs(args) if r[1]["point"] not in once or r[1]["seed"] == first]

    def train(self, args):
        """The methods at equal epochs, then each -time point at the epochs that match OTL's
        minutes: OTL's epochs times OTL's seconds an epoch over the method's, both from the timing
        pass (or the results JSON's epochs where a resumed study set them)."""
        grid = parse_grid(self, args.grid, args.preset)
        extra = shlex.split(args.train_args)
        if "--epochs" in extra[:-1]:    # the equal-epoch points' (a -time point's own must win)
            i = extra.index("--epochs")
            args.base_epochs, args.train_args = extra[i + 1], shlex.join(extra[:i] + extra[i + 2:])
        saved = read_study(results_stem(args) + ".json") or {}
        self.epochs = dict(saved.get("equal_time_epochs") or {})
        self.timed = dict(saved.get("timing") or {})
        rows, ran = training_study(self, args, self.runs(args))
        timed = [g.partition("-")[0] for g in grid if g.endswith("-time")]
        if timed and any(m not in self.epochs for m in timed):
            if not any(r["method"] == "otl" for r in rows):
                raise SystemExit("equal wall-clock points need OTL's runs: put otl in --grid")
            otl_epochs = next(r["epochs"] for r in rows if r["method"] == "otl")
            self.timed = self.timing(args, ["otl", *timed])
            t_otl = self.timed["otl"]["timed_epoch_s"]
            for m in timed:
                self.epochs.setdefault(m, max(1, round(otl_epochs * t_otl / self.timed[m]["timed_epoch_s"])))
            rows, ran2 = training_study(self, args, self.runs(args))
            ran += ran2
        out = write_results(self, args, rows, self.notes(args, rows))
        out["ran"] = ran
        return out

    def timing(self, args, methods, epochs=2):
        """{method: {timed_epoch_s, timed_load}}: each method at its study flags for `epochs`
        epochs, one after another in <runs>/<preset>/peers/timing/<method>, its last epoch timed
        (the first carries the start's warm-up) with the load average before it.  The equal-epoch
        runs may span sessions on machines of other speeds: ratios taken in one sitting keep that
        out of the -time points."""
        scale, data, extra = SCALES[args.preset], study_data(self, args), shlex.split(args.train_args)
        return {m: timed_run(self, args, m, data, [*scale.train, *self.points([m], data, args)[0][3],
                                                   *extra, "--knn-monitor", "0"], epochs)
                for m in methods}

    def notes(self, args, rows=()):
        out = super().notes(args, rows)
        epochs = getattr(self, "epochs", None) or {}
        if epochs:
            out["equal_time_epochs"] = epochs
            timed = getattr(self, "timed", None) or {}
            if timed:
                out["timing"] = timed
            out["notes"].append("")
            out["notes"].append("Equal wall-clock: each -time point trains " + ", ".join(
                f"{m} {e} epochs" for m, e in epochs.items()) + ", OTL's epochs times OTL's "
                "seconds an epoch over the method's, each method's epoch timed one after another "
                "in one sitting" + (" (" + ", ".join(f"{m} {t['timed_epoch_s']:.1f} s" for m, t in
                                                     timed.items()) + ")" if timed else "") + ".")
        return out

    def trained_how(self, args, data):
        tuned = "untuned, at the preset's SGD" if getattr(args, "tuned", None) == "none" else (
            "each method at the trial `peers-tune` selected on the validation split")
        return (super().trained_how(args, data) + f"; {tuned}; the half-width ResNet-18 of the cpu preset at 32 px for every method, "
            "where the published anchors train a full ResNet-18 at 32 px for 200 epochs: compare "
            "the methods here, not their levels with the anchors'")

    def table(self, rows):
        """The training table (test-split figures; a run that ended at a uniform prediction marked
        failed, rows from before the collapse signal included), then the published anchors beside
        it and what the scale gives up."""
        rows = [{**r, "failed": r.get("failed") or _uniform_loss(r)} for r in rows]
        tuned = all("--recipe" in _flags(r) or "--lr" in _flags(r) for r in rows)
        curves = sorted({r.get("curve_split", "test") for r in rows if r.get("curve")})
        how = ("after the recipes were chosen on the validation split (peers-tune)" if tuned else
               "every method untuned, at the preset's SGD, where OTL's preset was chosen on the "
               "test split: not a fair comparison")
        return [*super().table(rows), "", f"knn, linear: the test split, read once a run, {how}; "
                f"the curves: the {'/'.join(curves) or 'validation'} split.",
                "", "Published anchors, for scale only (other networks, "
                "schedules and data):", "", *utils.md_table(
                    ["method", "CIFAR-10 kNN, lightly (R18, 200 ep)", "CIFAR-10 linear, solo-learn "
                     "(R18, 1,000 ep)"], [list(a) for a in PEER_ANCHORS]), "",
                f"EuroSAT RGB: {EUROSAT_ANCHORS}. Every method here trains the cpu preset's half-width "
                "ResNet-18 at 32 px on 2 CPU cores for 8 or 20 epochs: that is what the levels give "
                "up; the methods' order at this budget is the finding."]

    @compares
    def verdict(self, rows):
        """OTL against each other method, paired over their common seeds (the difference and its
        95 % t interval), and the methods ranked."""
        m = VERDICT_METRIC
        base = next((r for r in rows if r["method"] == "otl"), None)
        if base is None:
            return "no OTL run to compare with"
        ranked = " > ".join(r["method"] for r in sorted(rows, key=lambda r: -r[m]))
        failed = [r["method"] for r in rows if r.get("failed") or _uniform_loss(r)]
        return (", ".join(f"{r['method']} {_f_sd(r, m)}" for r in rows) + " kNN@50; OTL minus "
                + "; ".join(f"{r['method']}: {_paired_text(*paired(base, r, m))}" for r in rows
                            if r is not base) + f"; ranked: {ranked}"
                + (f"; failed (collapsed): {', '.join(failed)}" if failed else ""))

    def plot(self, axes, rows, grid):
        """kNN@10 against the minutes of training (the kNN monitor of each method's first seed),
        and the final kNN@10 and linear probe of each method, mean +- sd over the seeds."""
        for r in rows:
            if r.get("curve"):
                axes[0].plot(*zip(*r["curve"]), "o-", label=r["method"])
        split = {r.get("curve_split", "test") for r in rows if r.get("curve")}
        axes[0].set(xlabel="minutes of training", ylabel=f"kNN@10 top-1 (%), {'/'.join(sorted(split))} split")
        if any(r.get("curve") for r in rows):
            axes[0].legend(fontsize=8)
        names, x = [r["method"] for r in rows], torch.arange(len(rows)).tolist()
        for off, metric in ((-0.2, "knn10"), (0.2, "linear")):
            axes[1].bar([i + off for i in x], [r.get(metric, float("nan")) for r in rows], width=0.4,
                        yerr=[r.get(metric + "_sd", 0.0) for r in rows], capsize=3, label=metric)
        axes[1].set_xticks(x, names, rotation=30, fontsize=8)
        axes[1].set(ylabel="top-1 (%), test split")
        axes[1].legend(fontsize=8)


# ==== peers-transfer (ours): each method on SIRI-WHU from its own peers run's backbone ============
@register
class PeersTransfer(TransferStudy):
    """Each method on SIRI-WHU from its own peers run's backbone, seed for seed (the transfer
    protocol; `make peers-transfer`): does EuroSAT's ranking hold?"""
    name, grid, evals, keys = ("peers-transfer", ("otl", "sela", "simclr", "byol", "swav"),
                               ("knn", "linear"), {"method": PEERS})
    paper = ("not in the paper (ours: the transfer protocol on SIRI-WHU from each method's own "
             "EuroSAT backbone, the paper's protocol for its small sets, each method training on "
             "with its own loss: is the ranking on EuroSAT the ranking on a set none of them was "
             "pretrained on?)")
    backbones = "peers"     # each point from its same-named run of this study at the same scale
    verdict, plot = Peers.verdict, Peers.plot

    def more_flags(self, s):
        """No --init: each point's backbone is its own, of the same seed."""
        s.add_argument("--seeds", help="the backbones' seeds, each trained on with the same seed "
                       "(default: the peers study's at this scale)")
        s.add_argument("--tuned", help="as the peers study's: the views each method trains on "
                       "with (its selected trial's, at the transfer preset's SGD)")

    def backbone(self, args, point, seed=0):
        name = run_name(point) + ("" if seed == 0 else f"_seed{seed}")
        return os.path.join(args.runs, args.preset, self.backbones, name, "checkpoint.pth")

    def check(self, args):
        missing = [f for g in parse_grid(self, args.grid, args.preset) for s in peer_seeds(args)
                   for f in [self.backbone(args, g, s)] if not os.path.isfile(f)]
        if missing:
            raise SystemExit(f"{self.name} starts each point from its {self.backbones} run at "
                             f"--preset {args.preset}, and these are not there: "
                             f"{', '.join(missing)}; run `python ablations.py {self.backbones} "
                             f"--preset {args.preset}` first (same --runs and --seeds)")

    def points(self, grid, data, args):
        """Each method from its own EuroSAT peers run of each seed, trained further by the same
        method (its tuned views, the transfer preset's SGD) with that seed; the kNN monitor every
        8 of its 64 epochs."""
        out = []
        for name, point, folder, flags in Peers.points(self, grid, data, args, monitor=8):
            keep, skip = [], False
            for f in flags:          # the recipe and lr are EuroSAT's; the transfer preset's here
                if skip or f in ("--lr", "--recipe"):
                    skip = not skip
                    continue
                keep.append(f)
            for s in peer_seeds(args):
                out.append((name if s == 0 else f"{name}_seed{s}", {**point, "point": name, "seed": s},
                            folder, [*keep, "--seed", str(s), "--init",
                                     self.backbone(args, point["method"], s)]))
        return out

    def evaluations(self, run, i):      # every point's backbone before training on this set
        return super().evaluations(run, 0)

    def trained_how(self, args, data):
        runs = utils.rel_path(os.path.join(args.runs, args.preset, self.backbones))
        return (trained_on(data, SCALES[args.preset].transfer) + f", each point from its own "
                f"`{self.backbones}` run's backbone of the same seed at this scale (`{runs}`)")

    def table(self, rows):
        return super().table(rows, hide=(), start=None, more=("knn_init10",)) + [
            "", f"knn10 before: each point's {self.backbones} backbone on this set before any "
            "training on it (its run's checkpoint0000.pth): the backbone transferred frozen."]


# ==== peers-tune (ours): every method's recipe chosen alike, on the validation split ===============
TUNE_METHODS = ("otl", "sela", "simclr", "byol", "swav")
TUNE_LR = (0.5, 1.0, 2.0, 4.0)      # times each method's reference lr
# three view recipes a method: OTL's and SeLa's the preset's strong augmentation (2 ops), the
# paper's 10 ops and the simple one; a peer's own (its paper's ImageNet views), cifar (32 px) and
# OTL's
TUNE_VIEWS = {"otl": {"strong2": ["--aug", "strong", "--n-ops", "2"],
                      "strong10": ["--aug", "strong", "--n-ops", "10"], "simple": ["--aug", "simple"]},
              "peer": {v: ["--peer-aug", v] for v in ("own", "cifar", "otl")}}
TUNE_SEEDS = (0, 1)     # each trial's; scored by their mean (PeersTune)
TUNE_RECIPE = "solo-learn"          # the peers' reference recipe: its optimiser, wd, warm-up ...
TUNE_GRID = tuple(f"{m}:{v}:{x:g}" for m in TUNE_METHODS
                  for v in TUNE_VIEWS["otl" if m in ("otl", "sela") else "peer"] for x in TUNE_LR)


def tune_point(g):
    """A peers-tune grid value, 'method:views:lr multiple', as its fields and train_otl.py flags:
    OTL and SeLa at the preset's SGD, a peer at its TUNE_RECIPE, the lr its reference's multiple
    (at the cpu preset's batch)."""
    method, views, x = g.split(":")
    ours = method in ("otl", "sela")
    ref = peers.RECIPES[TUNE_RECIPE].get(method)
    base = (presets.PRESETS["cpu"]["lr"] if ours else
            ref["lr"] * presets.PRESETS["cpu"]["batch_size"] / ref["batch"])
    lr = round(base * float(x), 6)
    flags = ({"otl": [], "sela": ["--labeler", "sinkhorn"]}[method] if ours else
             ["--method", method, "--recipe", TUNE_RECIPE])
    return ({"method": method, "views": views, "lr_x": float(x), "lr": lr},
            [*flags, *TUNE_VIEWS["otl" if ours else "peer"][views], "--lr", f"{lr:g}"])


@register
class PeersTune(TrainingStudy):
    """Every method tuned alike at the study scale: each of OTL, SeLa, SimCLR, BYOL and SwAV with
    its lr at 0.5, 1, 2 and 4 times its reference, times its three view recipes (12 trials a
    method), scored on the validation split, and one step beyond the lrs where a method's pick
    lies at their edge; the best trial a method by validation kNN@10 is its recipe for the
    comparison (`make peers-tune`; needs requirements-peers.txt).
    Each trial trains with TUNE_SEEDS and is scored by their mean: at the study scale one OTL
    run's validation kNN@10 moved by about 5 points from seed to seed, which one seed a trial
    would take for the lr's effect."""
    name, grid, evals, keys = "peers-tune", TUNE_GRID, ("knn_val", "linear_val"), {"method": TUNE_METHODS}
    paper = ("not in the paper (ours: the same tuning budget for every method, OTL and SeLa "
             "included, chosen on the validation split, so that no method's recipe is tuned where "
             "another's is not)")

    def more_flags(self, s):
        s.add_argument("--seeds", help="the seeds each trial trains with, scored by their mean "
                       f"(default {','.join(map(str, TUNE_SEEDS))})")

    def points(self, grid, data, args):
        """A trial a grid value, named method_views_multiple; then the steps beyond the grid's
        edge (self.beyond: train sets them once the grid's trials are scored)."""
        beyond = getattr(self, "beyond", [])
        out = []
        for g in [*grid, *beyond]:
            fields, flags = tune_point(g)
            out.append((g.replace(":", "_").replace(".", "p"),
                        {**fields, **({"beyond": True} if g in beyond else {})}, data, flags))
        return out

    def train(self, args):
        """The grid, then one step beyond its edge for each method whose pick lies there (its lr
        halved below the smallest multiple it tried, or doubled above the largest, on the picked
        views, every seed), and the pick made again over both: the same rule for every method, one
        step only, so that a pick still at the edge is said so by the verdict."""
        self.beyond = []
        rows, ran = training_study(self, args, self.runs(args))
        self.beyond = self.edge_steps(rows)
        if self.beyond:
            rows, more = training_study(self, args, self.runs(args))
            ran += more
        out = write_results(self, args, rows, self.notes(args, rows))
        out["ran"] = ran
        return out

    def edge_steps(self, rows):
        """The grid values one lr step beyond each method's pick where it is the smallest or the
        largest multiple the method tried (of several)."""
        trials = seed_means(rows) or rows
        steps = []
        for m, r in self.selected(trials).items():
            tried = {o["lr_x"] for o in trials if o["method"] == m}
            if len(tried) > 1 and r["lr_x"] in (min(tried), max(tried)):
                x = r["lr_x"] * 2 if r["lr_x"] == max(tried) else r["lr_x"] / 2
                steps.append(f"{m}:{r['views']}:{x:g}")
        return steps

    def seeds(self, args):
        """Every trial's seeds: --seeds, else TUNE_SEEDS."""
        return parse_seeds(args) if args.seeds is not None else list(TUNE_SEEDS)

    def selected(self, rows):
        """{method: its best trial by validation kNN@10} of the methods with a scored trial (rows:
        a row a trial, seed_means' where the trials have several seeds, as the verdict's)."""
        best = {}
        for r in rows:
            if "knn_val10" in r and not r.get("failed") and (
                    r["method"] not in best or r["knn_val10"] > best[r["method"]]["knn_val10"]):
                best[r["method"]] = r
        return best

    def rows_notes(self, rows):
        """The selected trials and what the tuning cost."""
        trials = seed_means(rows) or rows       # rows: the runs, a trial's seeds apart
        best = self.selected(trials)
        first = {}      # each trial's flags: its first seed's, less the seed
        for r in rows:
            flags, point = _flags(r), trial_of(r)
            if flags and point not in first:
                i = flags.index("--seed") if "--seed" in flags else len(flags)
                first[point] = flags[:i] + flags[i + 2:]
        hours = sum(r.get("train_minutes") or 0 for r in rows) / 60
        return {"notes": [f"{len(trials)} trial(s) in {len(rows)} run(s), {hours:.1f} hours of "
                          f"training on {os.cpu_count()} CPU core(s) ({hours * (os.cpu_count() or 1):.1f} "
                          "CPU hours), evaluations not counted."],
                "selected": {m: {"views": r["views"], "lr_x": r["lr_x"], "lr": r["lr"],
                                 "flags": first.get(trial_of(r)),
                                 "seeds": r.get("seeds", [r.get("seed")]),
                                 "knn_val10": r["knn_val10"]} for m, r in best.items()}}

    def notes(self, args, rows=()):
        out = super().notes(args, rows)
        seeds = self.seeds(args)
        first = out["notes"][0].rstrip(".").replace(f", {len(seeds)} seed(s) a grid point", "")
        out["notes"][0] = first + (
            f"; seeds {', '.join(map(str, seeds))} a trial, scored by their mean; every figure of the "
            "validation split (the training split less its validation part as kNN memory bank and "
            "probe set), the test split unread.")
        return out

    def verdict(self, rows):
        """Each method's selected trial, its margin over its second best, and a warning where its
        lr is the smallest or largest multiple tried (the best may lie beyond the grid); the
        failed trials counted, the diverged ones (no scores) among them."""
        failed = sum(bool(r.get("failed")) for r in rows)
        rows = [r for r in rows if "knn_val10" in r]
        if len(rows) < 2:
            return "one grid point: nothing to compare"
        out = []
        for m, r in self.selected(rows).items():
            rest = sorted((o["knn_val10"] for o in rows if o["method"] == m and o is not r
                           and "knn_val10" in o), reverse=True)
            tried = [o["lr_x"] for o in rows if o["method"] == m]
            edge = len(set(tried)) > 1 and r["lr_x"] in (min(tried), max(tried))
            out.append(f"{m} {r['views']} lr x{r['lr_x']:g} {r['knn_val10']:.1f}"
                       + (f" (+{r['knn_val10'] - rest[0]:.1f} over its next)" if rest else "")
                       + (", at the edge of the lrs tried" if edge else ""))
        return ("selected by validation kNN@10: " + "; ".join(out)
                + (f"; {failed} trial(s) failed (collapsed or diverged)" if failed else ""))

    def table(self, rows):
        """A row a trial: method, views, lr (its multiple), validation scores, loss, minutes, and
        whether it was selected or failed."""
        best = {id(r) for r in self.selected(rows).values()}
        metrics = [m for m in ("knn_val10", "knn_val50", "linear_val") if any(m in r for r in rows)]
        return utils.md_table(
            ["method", "views", "lr (x ref)", "seeds", *(m.replace("_val", " val") for m in metrics),
             "final loss", "minutes", "selected", "failed"],
            [[r["method"], r["views"], f"{r['lr']:g} (x{r['lr_x']:g}{', beyond' if r.get('beyond') else ''})",
              ",".join(map(str, r.get("seeds", [r.get("seed")]))),
              *(_f_sd(r, m) if m in r else "" for m in metrics),
              f"{r.get('final_loss', float('nan')):.3f}", f"{r.get('train_minutes') or 0:.1f}",
              "yes" if id(r) in best else "", failure(r)] for r in rows]) + [
            "", "val: the validation split; x ref: the multiple of the method's reference lr "
            f"(OTL's and SeLa's the cpu preset's, a peer's {TUNE_RECIPE}'s); beyond: a step past "
            "the grid's edge, tried where the method's pick on the grid lay there; failed: the run "
            "ended collapsed (train_otl.py's collapse signal) or its loss diverged, never selected."]

    def plot(self, axes, rows, grid):
        """Validation kNN@10 against the lr multiple, a line per method and view recipe; each
        method's selected trial."""
        for m in TUNE_METHODS:
            for v in dict.fromkeys(r["views"] for r in rows if r["method"] == m):
                pts = sorted((r["lr_x"], r["knn_val10"]) for r in rows
                             if r["method"] == m and r["views"] == v and "knn_val10" in r)
                if pts:
                    axes[0].plot(*zip(*pts), "o-", ms=3, label=f"{m} {v}")
        axes[0].set(xscale="log", xlabel="lr (x the method's reference)",
                    ylabel="validation kNN@10 top-1 (%)")
        axes[0].legend(fontsize=6, ncol=2)
        best = self.selected(rows)
        axes[1].bar(list(best), [r["knn_val10"] for r in best.values()])
        axes[1].set(ylabel="selected trial's validation kNN@10 (%)")


# ==== budget (ours): which network and image size the cpu preset's minutes on 2 CPU cores buy =====
BUDGET_MINUTES = 20     # the cpu preset's own training time on 2 cores (make eurosat's run)
BUDGET_FLAGS = ("--preset", "cpu", "--knn-monitor", "1")     # the validation kNN every epoch
PRESET_CONFIG = "32px-w32"   # the cpu preset's own size and network: what a winner must beat
BUDGET_GRID = ("32px-w32", "48px-w32", "64px-w32", "32px-w64", "48px-w64", "64px-w64",
               "32px-w32-small")


def budget_config(g):
    """A budget grid value, '<size>px-w<width>[-small]', as its fields."""
    size, width, *stem = g.split("-")
    return {"config": g, "img_size": int(size[:-2]), "width": int(width[1:]),
            "stem": "small" if stem else "imagenet"}


def budget_flags(c):
    """train_otl.py's flags of a configuration; Cutout keeps the cpu preset's 16 px at 32 px as
    the same share of the image at every size."""
    return ["--img-size", str(c["img_size"]), "--width", str(c["width"]), "--small-stem",
            str(c["stem"] == "small").lower(), "--cutout", str(16 * c["img_size"] // 32)]


def budget_timing(study, args, grid, data, extra):
    """{config: seconds of one epoch (label pass and training)}: the study's results JSON's where
    it has them (a resumed study keeps the epochs it set), else one epoch of each configuration
    timed alone, in <runs>/<preset>/budget/timing/<config>, with the load average before it (other
    work on the machine slows the epoch, and so shortens the epochs set from it)."""
    saved = read_study(results_stem(args) + ".json") or {}
    recorded = {**{g: t for g, t in saved.get("timing", {}).items() if isinstance(t, dict)
                   and utils.is_number(t.get("timed_epoch_s"))},   # every configuration's
                **{r["config"]: r for r in saved.get("rows", []) if r.get("timed_epoch_s")}}
    out = {}
    for g in grid:
        if g in recorded:
            out[g] = {k: recorded[g][k] for k in ("timed_epoch_s", "timed_load")}
            continue
        out[g] = timed_run(study, args, g, data,
                           [*BUDGET_FLAGS[:2], *budget_flags(budget_config(g)), *extra], epochs=1)
    return out


def timed_run(study, args, g, data, flags, epochs):
    """{timed_epoch_s, timed_load}: train_otl.py with flags for `epochs` epochs (seed 0) in
    <runs>/<preset>/<study>/timing/<g>, unless its log has them, its last epoch timed, with the
    1-minute load average before it (other work on the machine slows the epoch, and so skews the
    epochs set from it)."""
    run = os.path.join(args.runs, args.preset, study.name, "timing", run_name(g))
    log = os.path.join(run, "log.jsonl")
    if len(utils.read_log(log)) < epochs:
        load = round(os.getloadavg()[0], 2)
        if load > 0.5:
            print(f"note: load average {load} before timing {g} (the 1-minute average, which "
                  "still counts the run before it); other work on the machine would slow the "
                  "epoch, and so skew the epochs set from it", flush=True)
        os.makedirs(run, exist_ok=True)
        run_stage([sys.executable, "train_otl.py", "--data", data, "--output", run, "--device",
                   args.device, "--no-progress", *flags, "--epochs", str(epochs), "--seed", "0"],
                  os.path.join(run, "timing.log"))
        utils.write_json({"load_before": load}, os.path.join(run, "load.json"))
    with open(os.path.join(run, "load.json")) as fh:
        load = json.load(fh)["load_before"]
    return {"timed_epoch_s": utils.read_log(log)[-1]["epoch_s"], "timed_load": load}


def budget_points(grid, timing, seeds, data, args):
    """The budget study's runs, as TrainingStudy.runs gives them: each configuration with the
    epochs that fit --budget-minutes at its timed epoch (at least one), the validation kNN every
    epoch."""
    pts = []
    for g in grid:
        c, t = budget_config(g), timing[g]
        epochs = max(1, int(args.budget_minutes * 60 // t["timed_epoch_s"]))
        point = {**c, **t, "budget_minutes": args.budget_minutes, "epochs_fit": epochs}
        for s in seeds[g]:
            pts.append((run_name(g) if s == 0 else f"{run_name(g)}_seed{s}",
                        {**point, "point": run_name(g), "seed": s}, data,
                        [*BUDGET_FLAGS, *budget_flags(c), "--epochs", str(epochs), "--seed", str(s)]))
    return pts


@register
class Budget(TrainingStudy):
    """What the cpu preset's minutes on 2 cores buy: image size 32, 48, 64 px, width 32, 64 and
    the small stem, each for the epochs that fit (its epoch timed once), validation kNN@10
    against minutes; the best two with 3 seeds.  Chosen and reported on the validation split
    (`make ablation-budget`)."""
    name, grid, evals = "budget", BUDGET_GRID, ("knn_val", "linear_val")
    kept = ("timing",)      # a rewrite of a partial study keeps the timings of the runs to come
    paper = ("not in the paper (ours: within the cpu preset's minutes on 2 CPU cores, which image "
             "size, width and stem, at the epochs that fit, learn most? Chosen on the validation "
             "split, for the cpu preset)")

    def more_flags(self, s):
        s.add_argument("--budget-minutes", type=utils.finite_float, default=BUDGET_MINUTES,
                       help="minutes of training every configuration gets (default "
                       f"{BUDGET_MINUTES}: the cpu preset's on 2 cores); its epochs are these "
                       "over its epoch as timed once, so time on a machine doing nothing else")
        super().more_flags(s)

    def train(self, args):
        """Time an epoch of every configuration, train each once (seed 0) for the epochs that fit
        the budget, then the two best by validation kNN@10 and the cpu preset's own with the other
        seeds; the test split unread."""
        if args.preset == "paper":
            raise SystemExit("budget chooses the cpu preset's network within its minutes on 2 CPU "
                             "cores; run it with --preset study (or cpu)")
        if args.budget_minutes <= 0:
            raise SystemExit(f"--budget-minutes must be > 0, got {args.budget_minutes}")
        grid, data = parse_grid(self, args.grid, args.preset), study_data(self, args)
        seeds, extra = parse_seeds(args), shlex.split(args.train_args)
        timing = self.timing = budget_timing(self, args, grid, data, extra)
        first = {g: seeds[:1] for g in grid}
        rows, ran = training_study(self, args, budget_points(grid, timing, first, data, args))
        keep = {r["config"] for r in sorted(rows, key=lambda r: -r["knn_val10"])[:2]} | {PRESET_CONFIG}
        more = budget_points(grid, timing, {g: seeds if g in keep else seeds[:1] for g in grid},
                             data, args)
        if ran and len(more) > len(rows):     # the first pass's last run, kept before the next
            write_results(self, args, rows, self.notes(args, rows), partial=len(more))
        rows, ran2 = training_study(self, args, more)
        out = write_results(self, args, rows, self.notes(args, rows))
        out["ran"] = ran + ran2
        return out

    def notes(self, args, rows=()):
        """Where the epochs came from, and what the study reads."""
        note = self.protocol(utils.rel_path(study_data(self, args)), args.budget_minutes, rows,
                             parse_seeds(args)[1:], "no more seeds")
        # every configuration's timed epoch, so that a study resumed elsewhere (its run folders
        # gone, its rows in this JSON) keeps the epochs it set before training them all
        timing = {**getattr(self, "timing", {}), **{r["config"]: {
            k: r[k] for k in ("timed_epoch_s", "timed_load")} for r in rows if "timed_epoch_s" in r}}
        return {"notes": [note], "data": utils.rel_path(study_data(self, args)), "timing": timing}

    def rows_notes(self, rows):
        """The protocol note from the rows (a rewrite's), their budget and seeds."""
        data = {(r.get("study_point") or {}).get("data", "?") for r in rows}
        minutes = {r.get("budget_minutes") for r in rows}
        more = sorted({r.get("seed", 0) for r in rows} - {0})
        return {"notes": [self.protocol(", ".join(sorted(data)), ", ".join(
            f"{m:g}" for m in minutes if utils.is_number(m)), rows, more, "further seeds")]}

    @staticmethod
    def protocol(data, minutes, rows, more, none):
        """The note on how the configurations trained: the data, their budget in minutes, the
        load before the timings, the splits read and the seeds (more: the seeds after 0; none:
        what to say when there are none)."""
        more = f"seeds {', '.join(map(str, more))}" if more else none
        first = {r["config"]: r for r in rows if r.get("seed", 0) == 0}
        loads = [r["timed_load"] for r in first.values() if utils.is_number(r.get("timed_load"))]
        minutes = f"{minutes:g}" if utils.is_number(minutes) else minutes
        return (f"Trained on `{data}` with `{' '.join(BUDGET_FLAGS)}` and each configuration's "
                f"flags, for the epochs that fit {minutes} minutes of training (label passes "
                "included) at its epoch as timed once, alone, before its runs (1-minute load "
                "average before the timings, which still counts the timing before each: "
                + (f"{min(loads):g} to {max(loads):g}" if loads else "not recorded") + "). Every "
                "figure is of the validation split (the training split less its validation part as "
                "kNN memory bank and probe set); the test split is not read. Seed 0 of every "
                f"configuration, then {more} of the two best by its validation kNN@10 and of "
                f"the cpu preset's own ({PRESET_CONFIG}).")

    @compares_on("knn_val10")
    def verdict(self, rows):
        """The configurations ranked by validation kNN@10 after the budget, the best against the
        second by the 2-sd rule."""
        m = "knn_val10"
        top = sorted(rows, key=lambda r: -r[m])
        preset = next((r for r in top if r["config"] == PRESET_CONFIG), None)
        against = ("" if preset is None or preset is top[0] else f"; {top[0]['config']} minus the "
                   f"cpu preset's {PRESET_CONFIG}: {_judged(*_diff(top[0], preset, m))}")
        return (", ".join(f"{r['config']} {_f_sd(r, m)}" for r in top) + " validation kNN@10; "
                f"{top[0]['config']} minus {top[1]['config']}: {_judged(*_diff(top[0], top[1], m))}"
                + against)

    def table(self, rows):
        """A row a configuration: its size, width, stem, epochs, timed epoch, validation figures."""
        metrics = [m for m in ("knn_val10", "knn_val50", "linear_val") if any(m in r for r in rows)]
        cell = lambda r, m: _f_sd(r, m) if m in r else ""     # noqa: E731
        lines = utils.md_table(["config", "px", "width", "stem", "epochs", "s / epoch (timed)", "seeds",
                                *(m.replace("_val", " val") for m in metrics), "minutes",
                                "precision"], [
            [r["config"], str(r["img_size"]), str(r["width"]), r["stem"], str(r.get("epochs_fit", "")),
             f"{r.get('timed_epoch_s', float('nan')):.0f}",
             ",".join(map(str, r.get("seeds", [r.get("seed", 0)]))),
             *(cell(r, m) for m in metrics), f"{r.get('train_minutes') or 0:.1f}", precision(r)]
            for r in rows])
        return lines + ["", "Each cell: the mean over the seeds +- their sample standard deviation "
                        "where a configuration has more than one; val: the validation split; "
                        "minutes: the run's wall time, which other work sharing the machine or a "
                        "machine without bf16 stretches (its epochs were set by the epoch timed "
                        "alone); precision: the run's arithmetic, bf16 autocast where its machine "
                        "has native bf16, else fp32 (train_otl.py --amp), a seed's each where they "
                        "differ; blank, or ? for one seed, where the run predates its record."]

    def plot(self, axes, rows, grid):
        """Validation kNN@10 against the minutes of training, a curve a configuration (its seed 0
        run's monitor), and each configuration's final validation kNN@10."""
        for r in rows:
            if r.get("curve"):
                axes[0].plot(*zip(*r["curve"]), "o-", ms=3, label=r["config"])
        axes[0].set(xlabel="minutes of training", ylabel="validation kNN@10 top-1 (%)")
        if any(r.get("curve") for r in rows):
            axes[0].legend(fontsize=7)
        x = list(range(len(rows)))
        axes[1].bar(x, [r.get("knn_val10", float("nan")) for r in rows],
                    yerr=[r.get("knn_val10_sd", 0.0) for r in rows], capsize=3)
        axes[1].set_xticks(x, [r["config"] for r in rows], rotation=30, fontsize=8)
        axes[1].set(ylabel="validation kNN@10 after the budget (%)")


# ==== label-bn (ours; docs/label_bn.md): the label pass's BatchNorm mode ==========================
@register
class LabelBN(Study):
    """The label pass's BatchNorm mode (docs/label_bn.md): the counts' std before translating,
    after the published labeler as the authors run it and after ours, with BatchNorm in eval mode
    and on batch statistics; writes <output>/label_bn.json (flags of its own)."""
    name, kind, grid = "label-bn", "label-bn", ("eval", "batch")
    paper = "not in the paper (ours)"

    def add_flags(self, s):
        s.add_argument("--data", required=True, help="prepared data folder (prepare_data.py --out)")
        s.add_argument("--output", required=True, help="folder for label_bn.json; a checkpoint.pth "
                       "there (a train_otl.py run) is the network measured, else a fresh one")
        s.add_argument("--preset", default="cpu", choices=["auto", *presets.PRESETS],
                       help="the network's settings when --k, --width or --img-size are not given; "
                       "'cpu' is the preset whose label pass was measured")
        s.add_argument("--k", type=int, help="clusters (the preset's: 128)")
        s.add_argument("--width", type=int, help="ResNet-18's first-stage width (cpu preset: 32; 64 is "
                       "torchvision's)")
        s.add_argument("--img-size", type=int, help="image side in the label pass (cpu preset: 32)")
        s.add_argument("--seed", type=int, default=0, help="the network's initialisation and the "
                       "label pass's batch order")
        s.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
        s.add_argument("--no-progress", action="store_true", help="no tqdm bars (for logs)")

    def run(self, args):
        device = utils.pick_device(args.device)
        preset = presets.PRESETS[presets.preset_for(args.preset, device.type == "cuda")]
        for key in ("k", "width", "img_size"):
            if getattr(args, key) is None:
                setattr(args, key, preset[key])
        utils.print_run_header(args)
        d = utils.load_prepared(args.data, args.img_size)
        images = d["images"][d["train_idx"]]
        model = self.network(args, preset, device)
        gen = torch.Generator().manual_seed(args.seed)
        rows = {}
        for bn in self.grid:
            outs = otl.label_pass(model, images, args.img_size, 256, device, bn=bn, views=1,
                                  generator=gen, progress=not args.no_progress)[0][:, :args.k]   # head 0: (N, k)
            raw = torch.bincount(outs.argmax(1), minlength=outs.shape[1]).double()
            pub = otl.translate(outs, init="zero", tie_eps=0, method="published")
            ours = otl.translate(outs, method="published")
            rows[bn] = {"std_before": (raw - raw.mean()).pow(2).mean().sqrt().item(),
                        "clusters_used_before": int((raw > 0).sum()),
                        "spread": (outs.max() - outs.min()).item(),
                        # std over the N images of each output, averaged over the k outputs
                        "mean_row_std": outs.std(0).mean().item(),
                        "std_published": pub.std, "iters_published": pub.iterations,
                        "std_ours": ours.std, "iters_ours": ours.iterations, "std_max": ours.std_max}
            print(bn, json.dumps(rows[bn]), flush=True)
        out = {"n": images.shape[0], "k": args.k, "img_size": args.img_size, "arch": preset["arch"],
               "width": args.width, "small_stem": preset["small_stem"], "results": rows,
               "command": utils.command_line(), "git_commit": utils.git_commit()}
        utils.write_json(out, os.path.join(args.output, "label_bn.json"))
        return out

    def network(self, args, preset, device):
        """The run's network in --output, else the trainer's initialisation for the same seed (its
        checkpoint0000.pth)."""
        ckpt = os.path.join(args.output, "checkpoint.pth")
        if os.path.isfile(ckpt):
            model = utils.load_checkpoint(ckpt, device)[0]
        else:
            manifest = utils.load_manifest(args.data)
            torch.manual_seed(args.seed)
            model = otl.build_model(utils.model_config(preset, manifest, k=args.k,
                                                       width=args.width)).to(device)
        return model.to(memory_format=torch.channels_last) if device.type == "cpu" else model


if __name__ == "__main__":
    main(get_args_parser().parse_args())
