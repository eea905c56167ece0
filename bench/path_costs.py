"""What each special path of the tuned labeler (otl_scale.py) pays: the same inputs labelled by the
default labeler and by variants with one path switched off, and by otl.py's reference labeler.

    python bench/path_costs.py --out results/labeler_paths.json              # Gaussian inputs
    python bench/path_costs.py --inputs 'saved/*.pt' --out results/labeler_paths.json

A path whose removal costs less than 1.5x on every input is a candidate to go (docs/labeler.md).
The variants: "no numpy" (every numpy and scipy step replaced by its torch twin), "no path
solver" (the dense path's exact solve by the auction solver instead of shortest paths), "no
dense path" (k <= 128 by the streaming path), "no sample start" (k > 256 from the column
medians).  Each input: the variants taking turns, --reps calls each, the median seconds, after
one call of each to warm up.  Saved inputs come from bench_labeler.py --save-inputs.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import glob
import json
import statistics
import time

import torch

import otl
import otl_scale
import utils

VARIANTS = {
    "default": ({}, {}),
    "no numpy": ({"np": None, "_SCIPY": False}, {}),
    "no path solver": ({"_PATH_K": 0}, {}),
    "no dense path": ({}, {"dense": False}),
    "no sample start": ({}, {"sample_start": False}),
}
REFERENCE = "reference"


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="21600x10,21600x50,21600x128,50000x10,50000x128,20000x1000",
                   help="Gaussian inputs N x k, comma-separated (none: only --inputs)")
    p.add_argument("--inputs", default=None, metavar="GLOB", help="saved (N, k) outputs (torch.save)")
    p.add_argument("--reps", type=int, default=3, help="calls of each variant per input (median)")
    p.add_argument("--reference-up-to", type=int, default=20000 * 1000, help="time otl.translate "
                   "only on inputs of at most this many values (it holds them in float64)")
    p.add_argument("--out", default=None, help="JSON of every input's seconds and max - min")
    return p


def call(variant, O):
    """Seconds and max - min of otl_scale.translate(O) with the variant's settings."""
    attrs, kw = VARIANTS[variant]
    saved = {name: getattr(otl_scale, name) for name in attrs}
    for name, val in attrs.items():
        setattr(otl_scale, name, val)
    try:
        t0 = time.perf_counter()
        r = otl_scale.translate(O, **kw)
        return time.perf_counter() - t0, int(r.counts.max() - r.counts.min())
    finally:
        for name, val in saved.items():
            setattr(otl_scale, name, val)


def main(args):
    inputs = {}
    for shape in filter(None, args.shapes.split(",")):
        if shape != "none":
            n, k = map(int, shape.split("x"))
            inputs[f"gaussian_{n}x{k}"] = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    for path in sorted(glob.glob(args.inputs)) if args.inputs else []:
        inputs[os.path.basename(path)] = torch.load(path, weights_only=True)
    if not inputs:
        raise SystemExit("no inputs: give --shapes or --inputs")
    out = {"command": utils.command_line(), "git_commit": utils.git_commit(),
           "torch_threads": torch.get_num_threads(), "inputs": {}}
    for name, O in inputs.items():
        n, k = O.shape
        names = [v for v in VARIANTS if not (v == "no dense path" and k > 128)
                 and not (v == "no sample start" and k <= 256)]
        ref = n * k <= args.reference_up_to
        times, spread = {v: [] for v in names + [REFERENCE] * ref}, {}
        for rep in range(args.reps + 1):            # the first round warms up, untimed
            for v in names:
                dt, spread[v] = call(v, O)
                times[v] += [dt] * (rep > 0)
            if ref:
                t0 = time.perf_counter()
                r = otl.translate(O)
                times[REFERENCE] += [time.perf_counter() - t0] * (rep > 0)
                spread[REFERENCE] = int(r.counts.max() - r.counts.min())
        med = {v: statistics.median(t) for v, t in times.items()}
        out["inputs"][name] = {"n": n, "k": k, "seconds": med, "max_minus_min": spread,
                               "ratio": {v: med[v] / med["default"] for v in med}}
        print(f"{name}: " + ", ".join(f"{v} {med[v] * 1000:.1f} ms ({med[v] / med['default']:.2f}x)"
                                      for v in med), flush=True)
        if args.out:
            utils.write_json(out, args.out)
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
