"""The paper's studies, rerun: each a grid of runs of the stage scripts (train_otl.py, eval_knn.py,
eval_linear.py) or of the labelers alone, with our numbers beside the paper's.

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

Labeler studies (no training; N = 50,000; inputs: Gaussian outputs, for the paper's randomly
created matrices, whose distribution it does not give, and the outputs of a randomly initialised
network on CIFAR-10's training split, the paper's other input):
  beta              the published labeler's std of the counts against iteration for beta = 1.5 ..
                    6 and 5 .. 50, k = 128 (paper: even for the whole range)
  k-labeler         iterations and final std of the published labeler (and ours) for k = 50 ..
                    1000 (paper: about 20 iterations or fewer for every k)
  sinkhorn          OTL (published and ours) against Sinkhorn-Knopp for k = 50, 100, .., 1000:
                    final std and seconds (paper: OTL more even for every k)
Training studies (--preset study: EuroSAT, 8-epoch cpu runs, 3 seeds a point, sized for 2 CPU
cores; --preset cpu: the cpu preset's whole schedule, one seed a point; --preset paper: the
paper's CIFAR-10 and AlexNet, for a GPU; see SCALES):
  k                 k in 10 .. 1024: kNN and linear accuracy against k (the paper: 32 .. 1024)
  uneven            target n_i ~ i^x, x = 0 .. 10, k = 128: kNN against the target's evenness
  imbalanced        the paper's D_d subsets (0, d, .., 9d images deleted from classes 0 .. 9;
                    d = 100 .. 500 on CIFAR-10, 40 .. 200 on EuroSAT) against even subsets of the
                    same size: kNN
  splits            five seeded 80/20 divisions of SIRI-WHU, OTL and supervised from a
                    pretrained backbone (--init): mean and spread
  labeler-in-training  the same training with the published labeler, ours and Sinkhorn-Knopp
  lct               LCT with 1, 2 and 4 views, the loss averaged over view pairs or summed
  peers             OTL beside SeLa, SimCLR, BYOL and SwAV on the same backbone, data and
                    schedule (each peer also once with OTL's augmentation): kNN, linear,
                    seconds an epoch, peak memory, and kNN@10 against the minutes of training
                    (`make peers`; `make peers-cpu`: the whole cpu schedule, each method once)
  peers-transfer    each method on SIRI-WHU from its own peers run's backbone (the transfer
                    protocol; `make peers-transfer`): does EuroSAT's ranking hold?
  budget            what the cpu preset's minutes on 2 cores buy: image size 32, 48, 64 px,
                    width 32, 64 and the small stem, each for the epochs that fit (its epoch
                    timed once), validation kNN@10 against minutes; the best two with 3 seeds.
                    Chosen and reported on the validation split (`make ablation-budget`)
The kNN monitor's curves and every choice read the validation split (train_otl.py's, from
`utils.VAL_FRAC`); each row's curve_split names the split its curve scored (test in runs from
before the validation split).
Other:
  label-bn          the label pass's BatchNorm mode (docs/label_bn.md): writes
                    <output>/label_bn.json; its own flags (ablations.py label-bn --help)
"""
import argparse
import functools
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import otl
import presets
import utils

HERE = os.path.dirname(os.path.abspath(__file__))


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="study", required=True, metavar="STUDY")
    for study in STUDIES.values():
        _study_flags(sub.add_parser(study.name, help=study.paper), study)
    _label_bn_flags(sub.add_parser("label-bn", help="BatchNorm statistics in the label pass: eval "
                                   "or batch"))
    return p


def _study_flags(s, study):
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
    data = study.data or f"{SCALES['study'].data}; --preset paper: {SCALES['paper'].data}"
    s.add_argument("--data", help=f"prepared data folder (default {data}; the labeler "
                   "studies use its training split as the network's input)")
    grid, paper = (",".join(map(str, default_grid(study, scale))) for scale in ("study", "paper"))
    s.add_argument("--grid", help="comma list replacing the study's grid, e.g. 16,32 (default "
                   f"{grid}{'' if paper == grid else f'; --preset paper: {paper}'})")
    s.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    s.add_argument("--seed", type=int, default=0, help="seeds the inputs, the networks and "
                   "the training runs")
    s.add_argument("--no-plot", action="store_true", help="skip the PNG (needs matplotlib)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    if study.kind == "labeler":
        s.add_argument("--n", type=int, default=50_000, help="rows of each input (50,000: "
                       "the paper's, CIFAR-10's training split)")
        s.add_argument("--k", type=int, default=128, help="clusters (beta only; the paper's 128)")
        return
    s.add_argument("--train-args", default="", help="extra train_otl.py flags for every "
                   "run, e.g. \"--epochs 4\" (they win over the preset's)")
    s.add_argument("--rewrite", action="store_true", help="train nothing: write the "
                   "table, verdict and plot again from the rows of the study's results "
                   "JSON as they are (after a change to how studies are summarised)")
    if study.runner is budget_study:
        s.add_argument("--budget-minutes", type=utils.finite_float, default=BUDGET_MINUTES,
                       help="minutes of training every configuration gets (default "
                       f"{BUDGET_MINUTES}: the cpu preset's on 2 cores); its epochs are these "
                       "over its epoch as timed once, so time on a machine doing nothing else")
    if study.backbones:     # each grid point from its own run of another study: one run each
        return
    if study.pretrained:    # its grid is its seeds: no --seeds
        s.add_argument("--init", default="runs/eurosat/checkpoint.pth", help="the "
                       "pretrained backbone both models of every division start from "
                       "(train_otl.py --init; default: make eurosat's run, the only "
                       "pretraining set at hand; the paper's are PatternNet's)")
        return
    s.add_argument("--seeds", help="train every grid point once per seed (a comma "
                   "list, e.g. 0,1,2); the table gives the mean and the standard "
                   "deviation over them, the verdict weighs each difference against "
                   "2 sd (default: 0,1,2 at study scale, 0 at paper scale; --seed "
                   "other than 0: that seed alone)")


def _label_bn_flags(s):
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


def main(args):
    if args.study == "label-bn":
        return label_bn(args)
    utils.print_run_header(args)
    study = STUDIES[args.study]
    if study.kind == "labeler":
        return write_results(study, args, labeler_study(study, args))
    if args.rewrite:
        return rewrite(study, args)
    if study.runner is not None:        # a study of several phases (budget)
        return study.runner(study, args)
    rows, ran = training_study(study, args)
    out = write_results(study, args, rows, study_notes(study, args, rows))
    out["ran"] = ran
    return out


# ==============================================================================================
# Scales, the paper's numbers, and what a study is
# ==============================================================================================

@dataclass(frozen=True)
class Scale:
    """What a training study trains with at one scale."""
    train: tuple            # train_otl.py flags of every training study's runs
    transfer: tuple         # ... of a study from a pretrained backbone (splits)
    data: str               # the training studies' prepared data
    seeds: tuple            # a grid point's training seeds (--seeds replaces them)
    labeler_net: str        # the preset of the labeler studies' random network
    otl: tuple = ()         # flags of OTL's loss and views: not given to a peer (--method)


# The paper ran its studies on CIFAR-10 with fewer epochs than its main runs, simple augmentation
# and no LCT.  "study" is sized for 2 CPU cores so that its effects can show: on CIFAR-10 at that
# size OTL gained under 10 kNN points over its random network, less than the 3-4 points the
# studies compare plus their seed noise; on EuroSAT the cpu preset cut to 8 epochs gains about 18
# (strong augmentation and LCT kept: ours, simple augmentation learned less; docs/ablations.md),
# three seeds a point, every grid within about 4 hours.  "paper" is the paper's data and networks
# (CIFAR-10, alexnet-cifar) with the studies' changes; the paper says its studies trained for
# fewer epochs but not for how many, so its presets' epochs stand (--train-args "--epochs N"
# changes them).  "cpu" is the cpu preset's whole schedule (`make eurosat`'s run), one seed a
# point: the scale where a study's finding is checked once at a user's length of training.
SCALES = {
    "study": Scale(train=("--preset", "cpu", "--epochs", "8"), transfer=("--preset", "transfer-cpu"),
                   data="data/eurosat", seeds=(0, 1, 2), labeler_net="alexnet-cifar-cpu"),
    "cpu": Scale(train=("--preset", "cpu"), transfer=("--preset", "transfer-cpu"),
                 data="data/eurosat", seeds=(0,), labeler_net="alexnet-cifar-cpu"),
    "paper": Scale(train=("--preset", "alexnet-cifar"), transfer=("--preset", "transfer"),
                   otl=("--aug", "simple", "--views", "1", "--label-views", "1", "--lct", "false"),
                   data="data/cifar10", seeds=(0,), labeler_net="alexnet-cifar"),
}


_TABLES = utils.paper_tables()["tables"]


def paper_table(label):
    """The paper's table `label` as paper_tables.json transcribes it: columns, rows with the
    numbers as printed, misprints."""
    return _TABLES[label]


def _row_of(table, **match):
    return next(r for r in table["rows"] if all(r.get(k) == v for k, v in match.items()))


# The paper's numbers for the studies (its kNN is k = 50 where the table gives no k: Section 4's
# setting): {grid value: kNN} of CIFAR-10, and SIRI-WHU's five divisions of OTL
_K, _UNEVEN, _IMB = paper_table("diff-k-10"), paper_table("dis-com"), paper_table("imb-data")
PAPER_K = dict(zip(_K["columns"], _row_of(_K, row="kNN")["values"]))
PAPER_UNEVEN = dict(zip(_UNEVEN["x"], _row_of(_UNEVEN, dataset="cifar10", row="kNN")["values"]))
PAPER_IMBALANCED = dict(zip(_IMB["d"], _row_of(_IMB, row="Uneven")["values"]))
PAPER_IMBALANCED_EVEN = dict(zip(_IMB["d"], _row_of(_IMB, row="Even")["values"]))
_SPLITS = paper_table("5whu")
PAPER_SPLITS = {model: {m: [r["values"][_SPLITS["columns"].index(model)] for r in _SPLITS["rows"]
                           if r["evaluation"] == e and r["k"] == k]
                       for m, e, k in (("knn10", "kNN", 10), ("linear", "linear", None))}
                for model in ("OTL", "supervised")}



def _listed(d):
    return ", ".join(f"{g:g}: {v:.1f}" for g, v in d.items())


@dataclass(frozen=True)
class Study:
    """One study: its grid, how each grid point runs, the paper's claim, the verdict's rule, its
    table and its plot.  kind "labeler": labeler_study measures `methods` on fixed outputs at
    every grid value of `axis`; kind "training": training_study trains and evaluates the runs
    `points` makes of the grid, once per seed.  STUDIES holds them all."""
    name: str
    kind: str                   # "labeler" or "training"
    paper: str                  # the paper's claim, its numbers where it gives them
    grid: tuple                 # the default grid, the paper's (--grid replaces it)
    verdict: Callable           # rows (a training study's: seed means) -> one line
    table: Callable             # (study, rows) -> markdown lines
    plot: Callable              # (study, axes, rows, grid): the PNG's two panels
    data: Optional[str] = None  # the study's own data (else its scale's)
    # labeler studies
    axis: str = "k"             # what the grid varies: k, or beta at --k clusters
    methods: tuple = ()         # the labelers measured at every grid value
    # training studies
    points: Optional[Callable] = None  # (grid, data, args) -> [(run name, grid fields, data, flags)]
    evals: tuple = ()           # each run's evaluations: knn, linear
    scale_grid: dict = field(default_factory=dict)  # {scale: grid} where its data need their own
    pretrained: bool = False    # from --init at the scale's transfer flags; the grid is the seeds
    once: tuple = ()            # grid points trained with the first seed only (a check beside
                                # the comparison, not a point of it)
    backbones: str = ""         # pretrained from this study's same-named runs at the same scale
                                # (each grid point its own backbone), not from one --init
    note: str = ""              # added to the table's note where the data are not CIFAR-10
    # rows -> notes on the targets the labeler balanced; each row then keeps the N and k it
    # balanced (read from its checkpoint)
    balanced: Optional[Callable] = None
    panel: Optional[Callable] = None      # (study, ax, rows, metric, grid): one metric's panel
    xkey: str = ""              # the panels' x axis
    keys: dict = field(default_factory=dict)  # a row's grid fields: NUMBER or their values
    runner: Optional[Callable] = None     # (study, args) -> results, instead of training_study
    notes: Optional[Callable] = None      # (study, args, rows) -> study_notes' dict, instead


def default_grid(study, preset="study"):
    return list(study.scale_grid.get(preset, study.grid))


def parse_grid(study, text, preset="study"):
    """The study's grid (the scale's own where it has one), or --grid's comma list in the grid's
    own type."""
    if not text:
        return default_grid(study, preset)
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


def _bar(items, args):
    if args.no_progress:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=args.study, dynamic_ncols=True)


# ==============================================================================================
# Labeler studies: the labelers on fixed outputs, nothing trained
# ==============================================================================================

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


def measure_labeler(O, method, beta=1.5):
    """One labeler on O: final std against the even target, max - min, iterations, seconds, and
    the std after every step (published)."""
    n, k = O.shape
    try:    # the exact finish imports scipy once per process: not timed
        import scipy.sparse.csgraph  # noqa: F401
    except ImportError:
        pass
    t0 = time.perf_counter()
    history = None
    if method == "sinkhorn":
        labels, _, iters = otl.sinkhorn_knopp(O)
    elif method == "published":    # Algorithm 1 as the authors' code runs it: T from 0, no tie-break
        res = otl.translate(O, method="published", beta=beta, init="zero", tie_eps=0)
        labels, iters, history = res.labels, res.iterations, res.std_history
    else:
        res = otl.translate(O, method="exact")
        labels, iters = res.labels, res.iterations
    seconds = time.perf_counter() - t0
    counts = torch.bincount(labels.cpu(), minlength=k).double()
    raw = torch.bincount(O.argmax(1).cpu(), minlength=k).double()     # argmax alone
    rec = {"std": (counts - n / k).pow(2).mean().sqrt().item(), "max_minus_min": int(counts.max() - counts.min()),
           "iterations": int(iters), "seconds": round(seconds, 4),
           "std_max": n * math.sqrt(k - 1) / k, "std_before": (raw - n / k).pow(2).mean().sqrt().item()}
    if history is not None:
        rec["std_history"] = [round(h, 4) for h in history]
    return rec


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
    for inp, k, method, beta in _bar(todo, args):
        key = f"{inp}|n{args.n}|seed{args.seed}|k{k}|{method}|beta{beta}|{device.type}"
        if key not in done:
            O = inputs.get(inp, k).to(device)
            rec = {"key": key, "input": inp, "n": args.n, "k": k, "method": method, "beta": beta,
                   "device": str(device), **measure_labeler(O, method, beta),
                   "git_commit": utils.git_commit()}
            with open(store, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            done[key], made = rec, made + 1
        rows.append(done[key])
    print(f"{study.name}: {made} measured, {len(rows) - made} from {store}", flush=True)
    return rows


def beta_table(study, rows):
    return utils.md_table(["input", "beta", "iterations", "final std", "max - min", "std before", "seconds"],
                    [[r["input"], f"{r['beta']:g}", str(r["iterations"]), f"{r['std']:.2f}",
                      str(r["max_minus_min"]), f"{r['std_before']:.1f}", f"{r['seconds']:.2f}"]
                     for r in rows])


def beta_verdict(rows):
    worst = max(rows, key=lambda r: r["std"])
    frac = worst["std"] / worst["std_max"]
    return (f"{'agrees' if frac < 0.01 else 'disagrees'}: the largest final std over every "
            f"beta and input is {worst['std']:.2f} ({100 * frac:.3f} % of the std with all "
            f"images in one cluster; {worst['input']}, beta {worst['beta']:g})")


def steps_to_final(r):
    """Steps the published labeler tried before its std first reached its final value (its
    std_history holds the std after every step tried, undone ones included)."""
    h = r.get("std_history") or [r["std"]]
    return next(i for i, v in enumerate(h) if v <= round(r["std"], 4) + 1e-9)   # h is rounded


def labelers_table(study, rows, steps=False):
    """Each method's final std, iterations and seconds per (input, k); steps: the published
    labeler's steps to its final std too."""
    by = {(r["input"], r["k"], r["method"]): r for r in rows}
    cols = [(m, c) for m in study.methods for c in ("std", "iters", *(
        ("steps to final",) if steps and m == "published" else ()), "s")]
    cell = {"std": lambda r: f"{r['std']:.2f}", "iters": lambda r: str(r["iterations"]),
            "steps to final": lambda r: str(steps_to_final(r)), "s": lambda r: f"{r['seconds']:.2f}"}
    return utils.md_table(["input", "k", *(f"{m} {c}" for m, c in cols)],
                    [[inp, str(k), *(cell[c](by[(inp, k, m)]) for m, c in cols)]
                     for inp, k in sorted({(r["input"], r["k"]) for r in rows})])


def k_labeler_verdict(rows):
    pub = [r for r in rows if r["method"] == "published"]
    most = max(pub, key=lambda r: r["iterations"])
    reach = [steps_to_final(r) for r in pub]
    over = sum(n > 20 for n in reach)
    return (f"{'agrees' if over == 0 else 'disagrees'}: the published labeler tries at most "
            f"{most['iterations']} steps ({most['input']}, k = {most['k']}; undone steps "
            f"and the 10 unchanged ones before it stops included) and first reaches its "
            f"final std after {min(reach)} to {max(reach)} steps; {over} of {len(pub)} "
            f"cases need more than 20")


def sinkhorn_verdict(rows):
    by = {(r["input"], r["k"], r["method"]): r for r in rows}
    pairs = [(by[(i, k, 'published')], by[(i, k, 'exact')], by[(i, k, 'sinkhorn')])
             for i, k in {(r["input"], r["k"]) for r in rows}]
    pub_better = sum(p["std"] < s["std"] for p, _, s in pairs)
    ex_better = sum(e["std"] < s["std"] for _, e, s in pairs)
    return (f"{'agrees' if pub_better == len(pairs) else 'partly agrees' if pub_better else 'disagrees'}: "
            f"the published labeler is more even than Sinkhorn-Knopp in {pub_better} of "
            f"{len(pairs)} cases, ours in {ex_better} of {len(pairs)}")


def beta_plot(study, axes, rows, grid=None):
    import matplotlib.pyplot as plt
    for ax, inp in zip(axes, ("gaussian", "random_net")):
        rs = [r for r in rows if r["input"] == inp]
        for j, r in enumerate(rs):
            h = [max(v, 1e-2) for v in r["std_history"]]
            ax.semilogy(range(len(h)), h, label=f"beta {r['beta']:g}",
                        color=plt.cm.viridis(j / max(len(rs) - 1, 1)))
        ax.set(title=f"{inp}, k = {rows[0]['k']}", xlabel="iteration", ylabel="std of the counts")
    axes[1].legend(fontsize=7, ncol=2)


def labelers_plot(study, axes, rows, grid=None, left="iterations"):
    """left: what the first panel gives against k (iterations or seconds); the second, the final
    std."""
    for inp, ls in (("gaussian", "-"), ("random_net", "--")):
        for m in study.methods:
            rs = sorted((r for r in rows if r["input"] == inp and r["method"] == m), key=lambda r: r["k"])
            ks = [r["k"] for r in rs]
            axes[0].plot(ks, [r[left] for r in rs], ls, label=f"{m}, {inp}")
            axes[1].plot(ks, [r["std"] for r in rs], ls, label=f"{m}, {inp}")
    axes[0].set(xlabel="k", ylabel=left)
    axes[1].set(xlabel="k", ylabel="final std of the counts")
    axes[0].legend(fontsize=7)


# ==============================================================================================
# Training studies: a train_otl.py run and its evaluations per grid point and seed
# ==============================================================================================

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


def _base(path):
    return os.path.basename(os.path.normpath(path))


def imbalanced_points(grid, data, args):
    """Per d, the paper's uneven D_d and an even subset of its size, each a derived data folder."""
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


def splits_points(grid, data, args):
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


def training_points(study, args):
    """[(run name, grid fields, data folder, train_otl.py flags)] of every run of the study."""
    scale = SCALES[args.preset]
    pts = study.points(parse_grid(study, args.grid, args.preset), study_data(study, args), args)
    if study.pretrained:
        return [(name, point, folder, [*scale.transfer, *flags]) for name, point, folder, flags in pts]
    # one run per seed: seed 0 keeps the point's plain folder name, another seed s adds _seed<s>
    seeds, once = parse_seeds(args), {run_name(g) for g in study.once}
    return [(name if s == 0 else f"{name}_seed{s}", {**point, "point": name, "seed": s}, folder,
             [*scale.train, *(() if "--method" in flags else scale.otl), *flags, "--seed", str(s)])
            for name, point, folder, flags in pts for s in (seeds[:1] if name in once else seeds)]


def run_name(point):
    """The run folder's name of a grid value whose name is its own (peers: simclr-otlaug ->
    simclr_otlaug), which `once` and `backbones` name by grid value."""
    return str(point).replace("-", "_")


def backbone_of(study, args, point):
    """The checkpoint a `backbones` study's grid point starts from: the same-named run of that
    study at the same scale."""
    return os.path.join(args.runs, args.preset, study.backbones, run_name(point), "checkpoint.pth")


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
    """Train and evaluate every grid point not finished yet (pts: training_points' runs, made
    here when not given); one result row per run, and the runs trained or evaluated.

    A run folder remembers what it was trained with (study_point.json: the data and the
    train_otl.py flags), and a rerun that asks for other flags in the same folder stops instead of
    taking the old run for the new point.  A point whose run folder is gone (another machine, a
    later checkout) but whose row is in the study's results JSON with the same data and flags is
    taken from there: so a study spans interruptions and machines through its committed results.
    The results are written after every run made, marked partial until the last point is in."""
    if study.backbones:
        missing = [f for f in (backbone_of(study, args, g)
                               for g in parse_grid(study, args.grid, args.preset))
                   if not os.path.isfile(f)]
        if missing:
            raise SystemExit(f"{study.name} starts each point from its {study.backbones} run at "
                             f"--preset {args.preset}, and these are not there: "
                             f"{', '.join(missing)}; run `python ablations.py {study.backbones} "
                             f"--preset {args.preset}` first (same --runs)")
    elif study.pretrained and not os.path.isfile(args.init):
        raise SystemExit(f"--init {args.init}: no such checkpoint; the {study.name} study starts every "
                         "division from a pretrained backbone: run `make eurosat` first, or pass "
                         "--init with another run's checkpoint.pth")
    pts = training_points(study, args) if pts is None else pts
    folder = os.path.join(args.runs, args.preset, study.name)
    extra = shlex.split(args.train_args)
    recorded = recorded_rows(study, args)
    rows, ran, carried = [], [], []
    for i, (name, point, data, flags) in enumerate(pts):
        run = os.path.join(folder, name)
        ident = {"data": utils.rel_path(data), "train_flags": [*flags, *extra]}
        outs = {e: os.path.join(run, f"{e}.json") for e in study.evals}
        if (i == 0 or study.backbones) and "knn" in study.evals:  # the first point's random or
            outs["knn_init"] = os.path.join(run, "knn_init.json")  # --init network: the floor
        old = recorded.get(name)
        if (not os.path.isdir(run) and old and old["study_point"] == ident
                and all((e if _kind(e) == "linear" else f"{e}10") in old for e in outs)):
            print(f"[{study.name}] {name}: taken from {utils.rel_path(results_stem(args))}.json "
                  f"(trained at commit {str(old.get('git_commit'))[:12]}; its run folder is not here)",
                  flush=True)
            rows.append(old)
            carried.append(name)
            continue
        os.makedirs(folder, exist_ok=True)
        foreign = claim_run(run, ident)
        todo = (foreign or not os.path.isfile(os.path.join(run, "results.json"))
                or not evaluated(run, outs))
        if todo:
            print(f"[{study.name}] {name} ({i + 1}/{len(pts)})", flush=True)
            ran.append(name)
            train_and_evaluate(args, run, data, ident["train_flags"] + ["--same-flags"] * foreign,
                               outs, os.path.join(folder, f"{name}.log"))
            if foreign:     # its checkpoint was trained with the point's flags: the run is the point's
                utils.write_json(ident, os.path.join(run, "study_point.json"))
        rows.append({**training_row(run, point, outs, balanced=study.balanced is not None),
                     "study_point": ident})
        if todo and i + 1 < len(pts):   # nothing finished is lost if the study stops here
            write_results(study, args, rows, study_notes(study, args, rows), partial=len(pts))
    skipped = [n for n, *_ in pts if n not in ran]
    print(f"{study.name}: {len(ran)} run(s) trained or evaluated, {len(skipped)} finished before"
          + (f" ({len(carried)} of them taken from the results JSON)" if carried else ""), flush=True)
    return rows, ran


def train_and_evaluate(args, run, data, flags, outs, log):
    """train_otl.py in run (which resumes or finds it finished), then each evaluation of outs
    ({name: path}) not there or of other weights."""
    py = [sys.executable]
    run_stage(py + ["train_otl.py", "--data", data, "--output", run, "--device", args.device,
                    "--no-progress", *flags], log)
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


def recorded_rows(study, args):
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


def training_row(run, point, outs, balanced=False):
    """One run's table row: its grid point, scores, final loss and labeler figures; with
    balanced, also the N and k its labeler balanced (read from the checkpoint), which the
    uneven study needs for the std of the targets it trained on."""
    res = utils.read_results(run)
    row = {**point, "run": utils.rel_path(run), "train_minutes": res.get("train_minutes"),
           "epochs": res.get("epochs"), "preset": res.get("preset"),
           "git_commit": res.get("git_commit"), "command": res.get("command")}
    ck = os.path.join(run, "checkpoint.pth")
    if balanced and os.path.isfile(ck):
        try:        # tensors and plain data only: a crafted checkpoint in a study folder runs nothing
            ck = utils.load_file(ck)
        except ValueError as e:
            raise SystemExit(f"{e}; or move {run} out of the study's folder") from None
        if ck.get("pseudo_labels") is not None and not ck["args"].get("supervised"):
            row.setdefault("n_train", len(ck["pseudo_labels"][0]))
            row["k_clusters"] = ck["args"]["k"]
    for e, path in outs.items():
        r = _read_eval(run, e, path)
        if _kind(e) == "linear":
            row[e] = round(r["linear_top1"], 2)
        else:
            for kk, v in r["knn_top1"].items():
                row[f"{e}{kk}"] = round(v, 2)
    log = utils.read_log(os.path.join(run, "log.jsonl"))
    if log and "loss" in log[-1]:
        row["final_loss"] = round(log[-1]["loss"], 4)
    lab = [r for r in log if "pl_std" in r]
    if lab:
        row["pl_std_last"] = round(lab[-1]["pl_std"], 3)
    secs = [r["labeler_s"] for r in lab if "labeler_s" in r]
    if secs:
        row["labeler_s_mean"] = round(sum(secs) / len(secs), 3)
    epoch_s = sorted(r["epoch_s"] for r in log if utils.is_number(r.get("epoch_s")))
    if epoch_s:
        row["epoch_s"] = round(epoch_s[len(epoch_s) // 2], 2)              # the median epoch
    peak = [r["peak_mib"] for r in log if utils.is_number(r.get("peak_mib"))]
    if peak:
        row["peak_mib"] = max(peak)
    # the kNN monitor against the minutes of training so far, at the epoch timed alone where the
    # study timed one (budget), else the run's median epoch (an epoch slowed by other work on the
    # machine does not shift the curve); the split it scored: val, or test in logs from before
    # the validation split (which name none)
    mon = [r for r in log if utils.is_number(r.get("knn10")) and utils.is_number(r.get("epoch"))]
    per = row.get("timed_epoch_s", row.get("epoch_s"))
    curve = [[round(r["epoch"] * per / 60, 3), r["knn10"]] for r in mon if per is not None]
    if curve:
        row["curve"] = curve
        row["curve_split"] = "val" if all(r.get("knn_split") == "val" for r in mon) else "test"
    return row


METRICS = ("knn10", "knn50", "knn100", "knn200", "linear", "knn_val10", "knn_val50", "linear_val")


def seed_means(rows):
    """The runs of each grid point averaged over their seeds (mean, and <metric>_sd the sample
    standard deviation), in grid order; None when every point has one run."""
    groups = {}
    for r in rows:
        groups.setdefault(r.get("point", r["run"]), []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return None
    means = []
    for g in groups.values():
        m = {k: v for k, v in g[0].items() if k not in ("run", "seed", "git_commit", "command",
                                                          "study_point")}
        m["seeds"] = [r.get("seed") for r in g]
        for key in (*METRICS, "final_loss", "train_minutes", "epoch_s", "peak_mib"):
            vals = [r[key] for r in g if r.get(key) is not None]
            if vals:
                mean, sd = utils.mean_sd(vals)
                m[key] = round(mean, 4 if key == "final_loss" else 2)
                if key in METRICS and len(vals) > 1:    # one run (a study's `once`): no sd
                    m[f"{key}_sd"] = round(sd, 2)
        means.append(m)
    return means


TABLE_KEYS = ("k", "x", "d", "subset", "n_train", "model", "seed", "seeds", "labeler", "views",
              "reduction", "method", "config")


def training_table(study, rows):
    """Rows (one per run, or seed_means' one per grid point): grid fields, metrics (mean +- sd
    over the seeds), final loss and minutes; then the random-init floor."""
    keys = [k for k in TABLE_KEYS if any(k in r for r in rows) and (k != "seed" or study.pretrained)]
    metrics = [m for m in METRICS if any(m in r for r in rows)]
    if study.backbones:     # each point's backbone on this set before any training on it
        metrics.append("knn_init10")
    cell = lambda r, m: (f"{r[m]:.1f} +- {r[m + '_sd']:.1f}" if m + "_sd" in r else f"{r[m]:.1f}") \
        if m in r else ""
    costs = [(key, name) for key, name in (("epoch_s", "s / epoch"), ("peak_mib", "peak MiB"))
             if any(key in r for r in rows)]
    heads = [{"knn_init10": "knn10 before"}.get(m, m) for m in metrics]
    lines = utils.md_table(keys + heads + ["final loss", "minutes"] + [n for _, n in costs], [
        [",".join(map(str, r[k])) if k == "seeds" else str(r.get(k, "")) for k in keys]
        + [cell(r, m) for m in metrics]
        + [f"{r.get('final_loss', float('nan')):.3f}", f"{r.get('train_minutes') or 0:.1f}"]
        + [f"{r[key]:.0f}" if key in r else "" for key, _ in costs]
        for r in rows])
    if "seeds" in keys:
        lines += ["", "Each cell: the mean over the seeds +- their sample standard deviation; "
                  "minutes and loss are means."]
    init = [r for r in rows if "knn_init10" in r]
    if study.backbones:
        lines += ["", f"knn10 before: each point's {study.backbones} backbone on this set before "
                  "any training on it (its run's checkpoint0000.pth): the backbone transferred "
                  "frozen."]
    elif init:
        what = ("The --init backbone before any training on this set" if study.pretrained
                else "Random-init network")
        lines += ["", f"{what} (the first run's checkpoint0000.pth): kNN@10 "
                  f"{init[0]['knn_init10']:.1f}."]
    return lines


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
        def judged(rows):
            rows = [r for r in rows if metric in r]
            return verdict(rows) if len(rows) >= 2 else "one grid point: nothing to compare"
        judged.__doc__ = verdict.__doc__
        return judged
    return wrap


compares = compares_on(VERDICT_METRIC)


@compares
def k_verdict(rows):
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


@compares
def uneven_verdict(rows):
    """The first x (the most even target) against the last: the paper's fall."""
    m, (even, last) = VERDICT_METRIC, (rows[0], rows[-1])
    d, sd = _diff(even, last, m)
    xs = list(PAPER_UNEVEN)
    return (f"{_word(d, sd, +1)}: kNN@50 at x = {even['x']:g} minus x = {last['x']:g}: "
            f"{_judged(d, sd)} (the paper, CIFAR-10: x = {xs[0]:g} minus x = {xs[-1]:g}: "
            f"{PAPER_UNEVEN[xs[0]] - PAPER_UNEVEN[xs[-1]]:+.1f})")


@compares
def imbalanced_verdict(rows):
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


def splits_verdict(rows):
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


@compares
def labelers_verdict(rows):
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


@compares
def lct_verdict(rows):
    """Each view count and reduction against the first point."""
    m, base = VERDICT_METRIC, rows[0]
    return (", ".join(f"{r['views']} view(s) {r['reduction']} {_f_sd(r, m)}" for r in rows)
            + f" kNN@50; against {base['views']} view(s) {base['reduction']}: " + "; ".join(
                f"{r['views']} {r['reduction']} {_judged(*_diff(r, base, m))}" for r in rows[1:]))


@compares
def peers_verdict(rows):
    """OTL against each other method by the 2-sd rule (one seed a point: the differences alone),
    and the methods ranked."""
    m = VERDICT_METRIC
    base = next((r for r in rows if r["method"] == "otl"), None)
    if base is None:
        return "no OTL run to compare with"
    ranked = " > ".join(r["method"] for r in sorted(rows, key=lambda r: -r[m]))
    return (", ".join(f"{r['method']} {_f_sd(r, m)}" for r in rows) + " kNN@50; OTL minus "
            + "; ".join(f"{r['method']}: {_judged(*_diff(base, r, m))}" for r in rows
                        if r is not base) + f"; ranked: {ranked}")


# Published figures of the peers for scale, each from its own network, schedule and data: ResNet-18
# on CIFAR-10 in lightly's benchmark table (kNN, 200 epochs, batch 512, one GPU) and solo-learn's
# (linear, 1,000 epochs); on EuroSAT's RGB images, SeCo's ResNet-18 (linear, torchgeo's weights
# table) and our OTL `fast` run (results/gpu/fast208/eurosat_fast_h100.json)
PEER_ANCHORS = (("SimCLR", "84.8", "90.7"), ("BYOL", "86.8", "92.6"), ("SwAV", "84.2", "89.2"))
EUROSAT_ANCHORS = ("SeCo ResNet-18 93.1 linear; OTL `fast` (ResNet-18, 112 px, 208 epochs) "
                   "96.4 kNN@10 / 97.0 linear")


def peers_table(study, rows):
    """The training table, then the published anchors beside it and what the scale gives up."""
    return [*training_table(study, rows), "", "Published anchors, for scale only (other networks, "
            "schedules and data):", "", *utils.md_table(
                ["method", "CIFAR-10 kNN, lightly (R18, 200 ep)", "CIFAR-10 linear, solo-learn "
                 "(R18, 1,000 ep)"], [list(a) for a in PEER_ANCHORS]), "",
            f"EuroSAT RGB: {EUROSAT_ANCHORS}. Every method here trains the cpu preset's half-width "
            "ResNet-18 at 32 px on 2 CPU cores for 8 or 20 epochs: that is what the levels give "
            "up; the methods' order at this budget is the finding."]


def peers_plot(study, axes, rows, grid):
    """kNN@10 against the minutes of training (the kNN monitor of each method's first seed),
    and the final kNN@10 and linear probe of each method, mean +- sd over the seeds."""
    for r in rows:
        if r.get("curve"):
            ax = axes[0]
            ax.plot(*zip(*r["curve"]), "o-", label=r["method"])
    split = {r.get("curve_split", "test") for r in rows if r.get("curve")}
    axes[0].set(xlabel="minutes of training", ylabel=f"kNN@10 top-1 (%), {'/'.join(sorted(split))} split")
    if any(r.get("curve") for r in rows):
        axes[0].legend(fontsize=8)
    names, x = [r["method"] for r in rows], torch.arange(len(rows)).tolist()
    for off, metric in ((-0.2, "knn10"), (0.2, "linear")):
        axes[1].bar([i + off for i in x], [r.get(metric, float("nan")) for r in rows], width=0.4,
                    yerr=[r.get(metric + "_sd", 0.0) for r in rows], capsize=3, label=metric)
    axes[1].set_xticks(x, names, rotation=30, fontsize=8)
    axes[1].set(ylabel="top-1 (%)")
    axes[1].legend(fontsize=8)


def peers_points(grid, data, args, monitor=2):
    """OTL, SeLa (OTL's loop with Sinkhorn-Knopp's labels) and the peers (train_otl.py --method),
    a peer-otlaug point with OTL's augmentation instead of its own; the kNN monitor every
    `monitor` epochs for the curves."""
    flags = {"otl": [], "sela": ["--labeler", "sinkhorn"]}
    out = []
    for g in grid:
        method, _, aug = g.partition("-")
        f = flags.get(method, ["--method", method] + (["--peer-aug", "otl"] if aug else []))
        out.append((run_name(g), {"method": g}, data, [*f, "--knn-monitor", str(monitor)]))
    return out


def peers_transfer_points(grid, data, args):
    """Each method on SIRI-WHU from its own EuroSAT peers run, trained further by the same method
    at the transfer flags (the paper's protocol for a small set); the kNN monitor every 8 of its
    64 epochs."""
    study = STUDIES["peers-transfer"]
    return [(name, point, folder, [*flags, "--init", backbone_of(study, args, point["method"])])
            for name, point, folder, flags in peers_points(grid, data, args, monitor=8)]


# The training studies' panels: (study, ax, rows, metric, grid), one metric on one axis.

def curve_panel(study, ax, rows, metric, grid):
    ax.errorbar([r[study.xkey] for r in rows], [r.get(metric, float("nan")) for r in rows],
                yerr=[r.get(metric + "_sd", 0.0) for r in rows], fmt="o-", capsize=3, label="ours")
    if study.xkey == "k":
        ax.set_xscale("log", base=2)


def bars_panel(study, ax, rows, metric, grid):
    names = [r.get("labeler") or f"{r['views']}v {r['reduction']}" for r in rows]
    ax.bar(names, [r.get(metric, float("nan")) for r in rows],
           yerr=[r.get(metric + "_sd", 0.0) for r in rows], capsize=3)


def imbalanced_panel(study, ax, rows, metric, grid):
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


def splits_panel(study, ax, rows, metric, grid):
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


def training_plot(study, axes, rows, grid):
    # a study without a linear probe shows kNN@200 beside kNN@10, not an empty panel
    second = "linear" if "linear" in study.evals else "knn200"
    for ax, metric in zip(axes, ("knn10", second)):
        study.panel(study, ax, rows, metric, grid)
        ax.set(xlabel=study.xkey, ylabel=f"{metric} top-1 (%)")


# ==============================================================================================
# The budget study: which network and image size a fixed number of minutes on 2 CPU cores buys
# ==============================================================================================

BUDGET_MINUTES = 20     # the cpu preset's own training time on 2 cores (make eurosat's run)
BUDGET_FLAGS = ("--preset", "cpu", "--knn-monitor", "1")     # the validation kNN every epoch
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
    recorded = {r["config"]: r for r in (read_study(results_stem(args) + ".json") or {}).get("rows", [])
                if r.get("timed_epoch_s")}
    out = {}
    for g in grid:
        if g in recorded:
            out[g] = {k: recorded[g][k] for k in ("timed_epoch_s", "timed_load")}
            continue
        run = os.path.join(args.runs, args.preset, study.name, "timing", run_name(g))
        log = os.path.join(run, "log.jsonl")
        if not utils.read_log(log):
            load = round(os.getloadavg()[0], 2)
            if load > 0.5:
                print(f"note: load average {load} before timing {g}: other work on the machine "
                      "slows the epoch, and the epochs set from it are fewer", flush=True)
            os.makedirs(run, exist_ok=True)
            run_stage([sys.executable, "train_otl.py", "--data", data, "--output", run, "--device",
                       args.device, "--no-progress", *BUDGET_FLAGS[:2],
                       *budget_flags(budget_config(g)), *extra, "--epochs", "1", "--seed", "0"],
                      os.path.join(run, "timing.log"))
            utils.write_json({"load_before": load}, os.path.join(run, "load.json"))
        with open(os.path.join(run, "load.json")) as fh:
            load = json.load(fh)["load_before"]
        out[g] = {"timed_epoch_s": utils.read_log(log)[0]["epoch_s"], "timed_load": load}
    return out


def budget_points(grid, timing, seeds, data, args):
    """training_points' runs of the budget study: each configuration with the epochs that fit
    BUDGET_MINUTES at its timed epoch (at least one), the validation kNN every epoch."""
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


def budget_study(study, args):
    """Time an epoch of every configuration, train each once (seed 0) for the epochs that fit the
    budget, then the two best by validation kNN@10 with the other seeds; the test split unread."""
    if args.preset == "paper":
        raise SystemExit("budget chooses the cpu preset's network within its minutes on 2 CPU "
                         "cores; run it with --preset study (or cpu)")
    if args.budget_minutes <= 0:
        raise SystemExit(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    grid, data = parse_grid(study, args.grid, args.preset), study_data(study, args)
    seeds, extra = parse_seeds(args), shlex.split(args.train_args)
    timing = budget_timing(study, args, grid, data, extra)
    first = {g: seeds[:1] for g in grid}
    rows, ran = training_study(study, args, budget_points(grid, timing, first, data, args))
    best = sorted(rows, key=lambda r: -r["knn_val10"])[:2]
    more = {g: seeds if g in {r["config"] for r in best} else seeds[:1] for g in grid}
    rows, ran2 = training_study(study, args, budget_points(grid, timing, more, data, args))
    out = write_results(study, args, rows, study_notes(study, args, rows))
    out["ran"] = ran + ran2
    return out


def budget_notes(study, args, rows):
    """Where the epochs came from, and what the study reads."""
    first = {r["config"]: r for r in rows if r.get("seed", 0) == 0}
    loads = [r["timed_load"] for r in first.values() if utils.is_number(r.get("timed_load"))]
    note = (f"Trained on `{utils.rel_path(study_data(study, args))}` with `{' '.join(BUDGET_FLAGS)}` "
            f"and each configuration's flags, for the epochs that fit {args.budget_minutes:g} "
            "minutes of training (label passes included) at its epoch as timed once, alone, "
            "before its runs (load average before the timings: "
            + (f"{min(loads):g} to {max(loads):g}" if loads else "not recorded") + "). Every "
            "figure is of the validation split (the training split less its validation part as "
            "kNN memory bank and probe set); the test split is not read. Seed 0 of every "
            f"configuration, then seeds {', '.join(map(str, parse_seeds(args)[1:])) or 'none'} of "
            "the two best by its validation kNN@10.")
    return {"notes": [note], "data": utils.rel_path(study_data(study, args))}


@compares_on("knn_val10")
def budget_verdict(rows):
    """The configurations ranked by validation kNN@10 after the budget, the best against the
    second by the 2-sd rule."""
    m = "knn_val10"
    top = sorted(rows, key=lambda r: -r[m])
    return (", ".join(f"{r['config']} {_f_sd(r, m)}" for r in top) + " validation kNN@10; "
            f"{top[0]['config']} minus {top[1]['config']}: {_judged(*_diff(top[0], top[1], m))}")


def budget_table(study, rows):
    """A row a configuration: its size, width, stem, epochs, timed epoch, validation figures."""
    metrics = [m for m in ("knn_val10", "knn_val50", "linear_val") if any(m in r for r in rows)]
    cell = lambda r, m: _f_sd(r, m) if m in r else ""     # noqa: E731
    lines = utils.md_table(["config", "px", "width", "stem", "epochs", "s / epoch (timed)", "seeds",
                      *(m.replace("_val", " val") for m in metrics), "minutes"], [
        [r["config"], str(r["img_size"]), str(r["width"]), r["stem"], str(r.get("epochs_fit", "")),
         f"{r.get('timed_epoch_s', float('nan')):.0f}", ",".join(map(str, r.get("seeds", [r.get("seed", 0)]))),
         *(cell(r, m) for m in metrics), f"{r.get('train_minutes') or 0:.1f}"] for r in rows])
    return lines + ["", "Each cell: the mean over the seeds +- their sample standard deviation "
                    "where a configuration has more than one; val: the validation split."]


def budget_plot(study, axes, rows, grid):
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


# ==============================================================================================
# The studies
# ==============================================================================================

def uneven_notes(rows=(), n=50_000):
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


NUMBER = "a number"     # a grid field of numbers (Study.keys)
PEERS = ("otl", "sela", "simclr", "byol", "swav", "simclr-otlaug", "byol-otlaug", "swav-otlaug")


def _labeler(name, **fields):
    """A labeler study: its methods measured on Gaussian outputs and on a random network's outputs
    for CIFAR-10's training split."""
    return Study(**{"name": name, "kind": "labeler", "data": "data/cifar10",
                    "table": labelers_table, "plot": labelers_plot, **fields})


def _training(name, **fields):
    """A training study: its points trained once per seed at the scale's flags (the
    pretrained ones: once, from --init), evaluated, and shown one metric a panel."""
    return Study(**{"name": name, "kind": "training", "table": training_table,
                    "plot": training_plot, "panel": curve_panel, **fields})


STUDIES = {s.name: s for s in (
    _labeler("beta", axis="beta", methods=("published",), grid=(1.5, 2, 2.5, 3, 4, 5, 6, 10, 20, 30, 40, 50),
             table=beta_table, plot=beta_plot, verdict=beta_verdict,
             paper="even distributions for every beta from 1.5 to 50: the labeler is insensitive to beta"),
    _labeler("k-labeler", methods=("published", "exact"), grid=tuple(range(50, 1001, 50)),
             table=functools.partial(labelers_table, steps=True), verdict=k_labeler_verdict,
             paper="about 20 iterations or fewer for every k of its figure (N = 50,000, beta = 1.5)"),
    _labeler("sinkhorn", methods=("published", "exact", "sinkhorn"), grid=tuple(range(50, 1001, 50)),
             plot=functools.partial(labelers_plot, left="seconds"), verdict=sinkhorn_verdict,
             paper="OTL gives more even clusters than Sinkhorn-Knopp for every k from 50 to 1000"),
    _training("k", grid=(10, 32, 64, 128, 256, 512, 1024), evals=("knn", "linear"), xkey="k",
              points=lambda grid, data, args: [(f"k{k}", {"k": k}, data, ["--k", str(k)]) for k in grid],
              verdict=k_verdict, keys={"k": NUMBER},
              paper=f"kNN against k on CIFAR-10 (table diff-k-10, k: kNN): {_listed(PAPER_K)}"),
    _training("uneven", grid=(0, 2, 4, 6, 8, 10), evals=("knn",), xkey="x",
              points=lambda grid, data, args: [(f"x{x:g}", {"x": x}, data, ["--target-x", str(x)])
                                               for x in grid],
              balanced=uneven_notes, verdict=uneven_verdict, keys={"x": NUMBER},
              paper="accuracy falls as the target's evenness falls (table dis-com, CIFAR-10, x: kNN: "
                    f"{_listed(PAPER_UNEVEN)})"),
    # EuroSAT's classes hold about 2,160 training images against CIFAR's 5,000: the study
    # scale's d is the paper's scaled by 0.4
    _training("imbalanced", grid=(100, 200, 300, 400, 500), scale_grid={"study": (40, 80, 120, 160, 200)},
              points=imbalanced_points, evals=("knn",), panel=imbalanced_panel, xkey="d",
              verdict=imbalanced_verdict, keys={"d": NUMBER, "subset": ("even", "uneven")},
              note="; d is the paper's scaled to this set's class sizes (EuroSAT: about 2,160 "
                   "training images a class, CIFAR-10: 5,000)",
              paper="kNN of OTL trained on the uneven D_100 .. D_500 (table imb-data): "
                    + ", ".join(f"{v:.1f}" for v in PAPER_IMBALANCED.values())),
    _training("splits", grid=(0, 1, 2, 3, 4), data="data/siri_whu", pretrained=True,
              points=splits_points, evals=("knn", "linear"), panel=splits_panel, xkey="seed",
              verdict=splits_verdict, keys={"seed": NUMBER, "model": ("OTL", "supervised")},
              paper="five random 80/20 divisions of SIRI-WHU, from a pretrained ResNet-18 (table "
                    "5whu): " + "; ".join(
                        f"{m}: kNN@10 {{:.1f}} +- {{:.1f}}, linear {{:.1f}} +- {{:.1f}}".format(
                            *utils.mean_sd(PAPER_SPLITS[m]["knn10"]), *utils.mean_sd(PAPER_SPLITS[m]["linear"]))
                        for m in ("OTL", "supervised"))),
    _training("labeler-in-training", grid=("published", "exact", "sinkhorn"), evals=("knn", "linear"),
              points=lambda grid, data, args: [(m, {"labeler": m}, data, ["--labeler", m]) for m in grid],
              panel=bars_panel, verdict=labelers_verdict,
              keys={"labeler": ("published", "exact", "sinkhorn")},
              paper="not in the paper (ours)"),
    _training("lct", grid=("1-mean", "2-mean", "2-sum", "4-mean", "4-sum"), evals=("knn",),
              points=lambda grid, data, args: [
                  (f"views{v}_{red}", {"views": int(v), "reduction": red}, data,
                   ["--views", v, "--label-views", v, "--lct", "true", "--lct-reduction", red])
                  for v, red in (g.split("-") for g in grid)],
              panel=bars_panel, verdict=lct_verdict,
              keys={"views": NUMBER, "reduction": ("mean", "sum")},
              paper="not in the paper (ours); the paper writes the LCT loss as a sum over view pairs"),
    _training("peers", grid=PEERS, evals=("knn", "linear"),
              once=("simclr-otlaug", "byol-otlaug", "swav-otlaug"),
              scale_grid={"cpu": ("otl", "sela", "simclr", "byol", "swav")},
              points=peers_points, plot=peers_plot, verdict=peers_verdict, table=peers_table,
              keys={"method": PEERS},
              note="; every method alike (the cpu preset's half-width ResNet-18 at 32 px), where "
                   "the published anchors train a full ResNet-18 at 32 px for 200 epochs: "
                   "compare the methods here, not their levels with the anchors'",
              paper="not in the paper, whose tables set OTL beside other methods' published "
                    "numbers only (ours: the same backbone, data, epochs and schedule for every "
                    "method; the published anchors are below the table)"),
    _training("budget", grid=BUDGET_GRID, evals=("knn_val", "linear_val"), runner=budget_study,
              notes=budget_notes, table=budget_table, plot=budget_plot, verdict=budget_verdict,
              paper="not in the paper (ours: within the cpu preset's minutes on 2 CPU cores, "
                    "which image size, width and stem, at the epochs that fit, learn most? Chosen "
                    "on the validation split, for the cpu preset)"),
    _training("peers-transfer", grid=("otl", "sela", "simclr", "byol", "swav"),
              data="data/siri_whu", pretrained=True, backbones="peers", evals=("knn", "linear"),
              points=peers_transfer_points, plot=peers_plot, verdict=peers_verdict,
              keys={"method": PEERS},
              note="; every method alike, as in the peers study",
              paper="not in the paper (ours: the transfer protocol on SIRI-WHU from each "
                    "method's own EuroSAT backbone, the paper's protocol for its small sets, "
                    "each method training on with its own loss: is the ranking on EuroSAT the "
                    "ranking on a set none of them was pretrained on?)"),
)}


# ==============================================================================================
# Results files: <study>.json, .md and .png
# ==============================================================================================

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
          f"Ours: {verdict}.", "", *study.table(study, means or rows), "", made]
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
    study.plot(study, axes, rows, grid)
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
    extra = study.balanced(rows) if study.balanced else {"notes": []}
    extra["notes"] = [f"Rewritten from the {len(rows)} rows of `{utils.rel_path(path)}` as "
                      f"recorded (preset {', '.join(presets)}; data {', '.join(data)}), nothing "
                      "trained."] + ([""] + extra["notes"] if extra["notes"] else [])
    if recorded.get("data"):
        extra["data"] = recorded["data"]
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


def study_notes(study, args, rows=()):
    """What the study's JSON and table add: where its data differ from the paper's study, and
    (uneven) the targets' std beside the paper's."""
    if study.notes is not None:
        return study.notes(study, args, rows)
    out = study.balanced(rows) if study.balanced else {"notes": []}
    data = study_data(study, args)
    scale = SCALES[args.preset]
    flags = " ".join(scale.transfer if study.pretrained else (*scale.train, *scale.otl))
    note = f"Trained on `{utils.rel_path(data)}` with `{flags}`"
    if study.backbones:
        note += (f", each point from its own `{study.backbones}` run's backbone at this scale "
                 f"(`{utils.rel_path(os.path.join(args.runs, args.preset, study.backbones))}`)")
    elif study.pretrained:
        note += f", OTL and supervised both from `{utils.rel_path(args.init)}`"
    else:
        note += f", {len(parse_seeds(args))} seed(s) a grid point"
        if study.paper.startswith("not in the paper"):     # ours: nothing of the paper to scale
            note += study.note
        elif "cifar10" not in os.path.basename(os.path.normpath(data)):
            note += ("; the paper's study trained AlexNet on CIFAR-10, so its numbers are its own "
                     "scale's: compare the directions and the differences beyond 2 sd, not the "
                     "levels" + study.note)
    out["notes"] = [note + "."] + ([""] + out["notes"] if out["notes"] else [])
    out["data"] = utils.rel_path(data)
    return out


# ==============================================================================================
# label-bn (docs/label_bn.md)
# ==============================================================================================

def label_bn(args):
    """Counts' std before translating, after the published labeler as the authors run it and
    after ours, for eval-mode and batch-statistics BatchNorm in the label pass."""
    device = utils.pick_device(args.device)
    preset = presets.PRESETS[presets.preset_for(args.preset, device.type == "cuda")]
    for key in ("k", "width", "img_size"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    utils.print_run_header(args)
    d = utils.load_prepared(args.data, args.img_size)
    manifest = utils.load_manifest(args.data)
    images = d["images"][d["train_idx"]]
    ckpt = os.path.join(args.output, "checkpoint.pth")
    if os.path.isfile(ckpt):
        model = utils.load_checkpoint(ckpt, device)[0]
    else:   # the trainer's initialisation for the same seed (its checkpoint0000.pth)
        torch.manual_seed(args.seed)
        model = otl.build_model(otl.ModelConfig(
            arch=preset["arch"], k=args.k, small_stem=preset["small_stem"], width=args.width,
            mean=tuple(manifest["channel_mean"]), std=tuple(manifest["channel_std"]))).to(device)
    if device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {}
    for bn in ("eval", "batch"):
        outs = otl.label_pass(model, images, args.img_size, 256, device, bn=bn, views=1,
                              generator=gen, progress=not args.no_progress)[0]   # (N, k)
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


if __name__ == "__main__":
    main(get_args_parser().parse_args())
