"""Where the exact labeler's time goes on one input: wall time per otl function (cProfile: on a
GPU a function's time includes its waits for the device) and per device kernel (torch.profiler).

    python bench/profile_labeler.py --device cuda --n 1280000 --k 3000 --out results/labeler_profile_gpu.txt
    python bench/profile_labeler.py --checkpoint runs/eurosat/checkpoint.pth --out prof.txt

    python bench/profile_labeler.py --input inputs/random_net_10.pt --phases
    python bench/profile_labeler.py --input inputs/random_net_500.pt --kernels --as-gpu --json k.json

The input is bench_labeler's gaussian (the same seeds), or with --checkpoint the outputs that
training hands the labeler: a label pass of that network over its training split (one strong
view, BatchNorm on batch statistics, as train_otl.py), through its own head or, with --head-k, a
fresh K-way head on its features, or with --input an (N, k) tensor saved by torch.save (such as
bench_labeler.py --save-inputs writes).  --method published profiles the published rules instead.
One warm-up call, --repeat timed calls (their median is printed), then one profiled call.

--phases replaces the profiles by a table of the exact labeler's stages in one call (after the
warm-up): each solve (the sample start's, the warm start's sample, the dense path's, the main
one; its rows) with the time and the steps of its approach (the published step rule), its
auction rounds, its exact finish's rounds (the dense path's solve by shortest paths at
k <= 64, otl_scale._PathSolver: those paths, one row moved along each) and its strict argmax, the
dense path's Newton steps (time and passes over the rows, per call), and the rest of the call
(reading the outputs into the store, the tie-break, taking rows out of it); then the published
rules' median time on the same input and the ratio.  On a GPU a stage's time includes its
waits for the device.

--kernels replaces them by counts of the torch operations one call dispatches (after the
warm-up): kernels (operations that launch work on a GPU: not views), of them reads by the host
(.item(), nonzero, masks used as indices: each a wait on a GPU), per stage as --phases, and the
same for the published rules.  On a GPU ours costs about the same per kernel from k = 100 up,
whatever the rows (launches and host syncs dominate), so the count predicts its time there
from a CPU.  With --as-gpu a CPU run takes the GPU's block sizes.  What the
count misses on the CPU: the steps numpy runs on the host there (the dense path's passes and
Newton steps at small k, join costs, the rows near a boundary, the tie-break), which a GPU runs
as torch operations, and copies to and from the host (.cpu(), .to(device)); --as-gpu also gives
the dense path's small solves, which a GPU runs on its host, the GPU's choices.

--variants replaces them by the exact labeler and the published rules on four variants of the
input, as real outputs come in other sizes and orders: its first 80 % of rows, its last two
thirds, all but its last 777 rows (every second row from N = 40,000), and the input with
Gaussian noise of 1 % of its std (seed 1); per variant the medians of --repeat calls of each
(after a warm-up), their ratio, max - min, the rows ours solved exactly and whether its dense
path (translate, k <= 128) finished or the streaming path ran.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import cProfile
import hashlib
import io
import json
import pstats
import shlex
import time
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_labeler
import otl
import otl_scale
import utils


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--n", type=int, default=1_280_000)
    p.add_argument("--k", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--checkpoint", default=None, help="profile on this network's label-pass outputs")
    p.add_argument("--data", default=None, help="its prepared data (default: the checkpoint's)")
    p.add_argument("--head-k", type=int, default=None, help="a fresh head of this many outputs on "
                   "the network's features instead of its own head")
    p.add_argument("--input", default=None, metavar="PT", help="profile on this (N, k) tensor "
                   "(torch.save; e.g. bench_labeler.py --save-inputs DIR writes DIR/random_net_10.pt)")
    p.add_argument("--phases", action="store_true", help="a table of the exact labeler's stages "
                   "(time and steps of each solve's approach, auction, finish, strict argmax; the "
                   "rest) and the published rules' time on the same input, instead of the profiles")
    p.add_argument("--save-input", default=None, metavar="PT", help="also save the (N, k) input "
                   "profiled here (torch.save), for --input in a later run (another commit's "
                   "script, say): a label pass is not repeatable bit for bit")
    p.add_argument("--variants", action="store_true", help="ours and the published rules on four "
                   "variants of the input (subsets of its rows, a little noise), instead of the "
                   "profiles")
    p.add_argument("--kernels", action="store_true", help="count the torch operations a call "
                   "dispatches (each a kernel launch on a GPU), per stage as --phases, for ours "
                   "and the published rules, instead of the profiles")
    p.add_argument("--as-gpu", action="store_true", help="with --kernels on the CPU: take the "
                   "passes' GPU block sizes (otl_scale._launch_bound), so the count is the one a GPU's "
                   "call would launch (within the limits the docstring gives)")
    p.add_argument("--json", default=None, metavar="PATH", help="with --kernels: the counts as "
                   "JSON here too (per stage, per operation, the call's seconds)")
    p.add_argument("--otl", default=None, metavar="SPEC", help="profile this tuned labeler "
                   "instead of the working tree's otl_scale.py: a path or a git revision, as "
                   "compare_labelers.py takes them")
    p.add_argument("--method", default="exact", choices=["exact", "published"])
    p.add_argument("--out", default=None, help="write the report here too")
    return p


def network_outputs(a, dev):
    """(N, k) label-pass outputs of a trained network on its training split, one strong view."""
    import torch.nn as nn
    model, ck = utils.load_checkpoint(a.checkpoint, dev)
    d = utils.load_prepared(a.data or ck["args"]["data"])
    imgs = d["images"][d["train_idx"]]
    args = ck["args"]
    gen = torch.Generator().manual_seed(a.seed)
    outs = otl.label_pass(model, imgs, int(args["img_size"]), 256, dev, bn="batch", views=2,
                          strong=args.get("aug") == "strong", cutout=int(args.get("cutout", 16)),
                          generator=gen, progress=False, head=a.head_k is None)[0]
    if a.head_k:
        torch.manual_seed(a.seed)
        with torch.no_grad():
            outs = nn.Linear(outs.shape[1], a.head_k).to(dev)(outs)
    return outs


STAGES = ("newton", "approach", "auction", "finish", "strict argmax")
_METHODS = {"_approach": "approach", "_auction": "auction", "_finish": "finish",
            "strictify": "strict argmax"}
_PATH_METHODS = {"run": "finish", "strictify": "strict argmax"}   # otl_scale._PathSolver's


_VIEWS = {"view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand",
          "lift_fresh", "alias", "detach", "t", "transpose", "permute", "_reshape_alias",
          "as_strided", "split", "split_with_sizes", "unbind", "diagonal", "narrow", "unfold",
          "view_as_real", "view_as_complex"}
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
          "unique_consecutive"}


class KernelCount(TorchDispatchMode):
    """Counts the torch operations dispatched while open: `kernels` (not views, which launch
    nothing) and of them `reads`, whose result the host waits for on a GPU (.item(), nonzero,
    a bool mask used as an index, unique); `by_op` per operation."""

    def __init__(self):
        super().__init__()
        self.kernels = self.reads = 0
        self.by_op = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.kernels += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
            index = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
            if name in _READS or (name in ("index", "index_put_", "index_put") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)):
                self.reads += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def as_gpu():
    """otl's passes with a GPU's block sizes (otl_scale._launch_bound true) on any device."""
    if not hasattr(otl_scale, "_launch_bound"):
        raise SystemExit("--as-gpu: this labeler has no _launch_bound (an older labeler): it picks "
                         "its block sizes by device inline, so a CPU run cannot take a GPU's")
    saved = otl_scale._launch_bound
    otl_scale._launch_bound = lambda device: True
    try:
        yield
    finally:
        otl_scale._launch_bound = saved


@contextmanager
def stage_timer(dev, counter=None):
    """Records (solve, stage, seconds, steps, (kernels, reads)) for every stage the exact
    labeler runs while the context is open; a solve is (where, rows): where is 'sample start'
    (otl_scale.sample_start_T), 'warm start' (StreamingTranslator._warm_start's own solve), 'dense'
    (translate's dense path: its Newton steps on the counts, one record per call of
    otl_scale._newton_T with the rows it read, and its solve of the rows near a boundary) or 'main'.
    kernels and reads: what an open KernelCount `counter` counted in the stage (else 0); host:
    whether a GPU runs the stage on the host (the dense path's small solves, otl_scale._HOST_SOLVE;
    as a CPU run with --as-gpu decides it, from the solve's size)."""
    records, where = [], ["main"]
    solvers = ((otl_scale._ExactSolver, _METHODS), (otl_scale._PathSolver, _PATH_METHODS))
    saved = [(cls, name, getattr(cls, name), stage) for cls, names in solvers
             for name, stage in names.items()]
    saved_warm, saved_sample = otl_scale.StreamingTranslator._warm_start, otl_scale.sample_start_T
    saved_dense, saved_newton = otl_scale._dense_translate, otl_scale._newton_T

    def counted():
        return (counter.kernels, counter.reads) if counter is not None else (0, 0)

    def since(c0, host=False):
        c1 = counted()
        return c1[0] - c0[0], c1[1] - c0[1], host

    def newton(X, *args, **kw):
        utils.synchronize(dev)
        t, c0 = time.perf_counter(), counted()
        out = saved_newton(X, *args, **kw)
        utils.synchronize(dev)
        records.append(((where[-1], "newton", X.shape[0]), "newton", time.perf_counter() - t,
                        out[3], since(c0)))
        return out

    def timed(fn, stage):
        def wrapper(self, *args, **kw):
            steps0 = self.rounds + self.phases
            utils.synchronize(dev)
            t, c0 = time.perf_counter(), counted()
            try:
                return fn(self, *args, **kw)
            finally:
                utils.synchronize(dev)
                v = self.vals     # (otl_scale._PathSolver's: a numpy array, on the host always)
                host = not isinstance(v, torch.Tensor) or (v.device.type == "cpu" and (
                    dev.type != "cpu" or where[-1] == "dense" and v.numel() <= otl_scale._HOST_SOLVE))
                records.append(((where[-1], id(self), self.vals.shape[0]), stage,
                                time.perf_counter() - t, self.rounds + self.phases - steps0,
                                since(c0, host)))
        return wrapper

    def inside(label, fn):
        def wrapper(*args, **kw):
            where.append(label)
            try:
                return fn(*args, **kw)
            finally:
                where.pop()
        return wrapper

    for cls, name, fn, stage in saved:
        setattr(cls, name, timed(fn, stage))
    otl_scale.StreamingTranslator._warm_start = inside("warm start", saved_warm)
    otl_scale.sample_start_T = inside("sample start", saved_sample)
    otl_scale._dense_translate = inside("dense", saved_dense)
    otl_scale._newton_T = newton
    try:
        yield records
    finally:
        for cls, name, fn, _ in saved:
            setattr(cls, name, fn)
        otl_scale.StreamingTranslator._warm_start = saved_warm
        otl_scale.sample_start_T = saved_sample
        otl_scale._dense_translate, otl_scale._newton_T = saved_dense, saved_newton


def phases_report(records, total):
    """Lines of a markdown table: one row per solve, its stages' seconds (and steps), and the
    rest of the call."""
    solves = {}
    for solve, stage, sec, steps, _ in records:
        row = solves.setdefault(solve, {st: [0.0, 0] for st in STAGES})
        row[stage][0] += sec
        row[stage][1] += steps
    lines = ["| solve | rows | " + " | ".join(f"{st} s" + (" (steps)" if st != "strict argmax" else "")
                                           for st in STAGES) + " |",
             "|---|---|" + "---|" * len(STAGES)]
    for (where, _, rows), row in solves.items():
        lines.append(f"| {where} | {rows:,} | "
                     + " | ".join("" if not row[st][0] and not row[st][1] else
                                  f"{row[st][0]:.4f} ({row[st][1]})" if st != "strict argmax"
                                  else f"{row[st][0]:.4f}" for st in STAGES) + " |")
    staged = sum(sec for _, _, sec, _, _ in records)
    lines.append(f"| rest of the call (store, tie-break, taking rows, counts; the warm start's too) | | {total - staged:.4f} |"
                 + " |" * (len(STAGES) - 1))
    return lines


def kernels_report(records, counter):
    """Lines of a markdown table as phases_report's, with each stage's kernels (and of them
    host reads) in place of its seconds, and the rest of the call's."""
    solves, hosts = {}, set()
    for solve, stage, _, steps, (kern, reads, host) in records:
        row = solves.setdefault(solve, {st: [0, 0, 0] for st in STAGES})
        row[stage][0] += kern
        row[stage][1] += reads
        row[stage][2] += steps
        if host:
            hosts.add(solve)
    lines = ["| solve | rows | " + " | ".join(f"{st}: kernels (reads) [steps]" for st in STAGES)
             + " |", "|---|---|" + "---|" * len(STAGES)]
    for (where, i, rows), row in solves.items():
        on = " (on the host on a GPU)" if (where, i, rows) in hosts else ""
        lines.append(f"| {where}{on} | {rows:,} | " + " | ".join(
            f"{row[st][0]:,} ({row[st][1]:,}) [{row[st][2]}]" if row[st][0] or row[st][2] else ""
            for st in STAGES) + " |")
    kern = sum(r[4][0] for r in records)
    reads = sum(r[4][1] for r in records)
    lines.append(f"| rest of the call | | {counter.kernels - kern:,} ({counter.reads - reads:,}) |"
                 + " |" * (len(STAGES) - 1))
    return lines


def host_kernels(records):
    """The kernels counted in stages a GPU runs on the host (stage_timer's host)."""
    return sum(r[4][0] for r in records if r[4][2])


def top_ops(counter, n=12):
    """The counter's n most frequent operations, as one line."""
    top = sorted(counter.by_op.items(), key=lambda kv: -kv[1])[:n]
    return "most launched: " + ", ".join(f"{name} {c:,}" for name, c in top)


def timed_calls(fn, repeat, dev):
    """(seconds of each of `repeat` calls of fn, waited for on dev; the last call's result)."""
    times, res = [], None
    for _ in range(repeat):
        utils.synchronize(dev)
        t = time.perf_counter()
        res = fn()
        utils.synchronize(dev)
        times.append(time.perf_counter() - t)
    return times, res


def median(times):
    return sorted(times)[len(times) // 2]


def header(dev, n, k, what):
    """The first words of a report: commit, device, the input."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return f"commit {utils.git_commit()}  device {name}  N {n}  k {k}  input: {what}"


def input_variants(O, seed=1):
    """{name: tensor}: subsets of O's rows and O with a little noise (see --variants)."""
    n = O.shape[0]
    g = torch.Generator(device=O.device).manual_seed(seed)
    noise = torch.randn(O.shape, generator=g, device=O.device, dtype=torch.float32)
    third = ("every 2nd row", O[1::2]) if n >= 40_000 else ("all but 777", O[:n - 777])
    return {"first 80 %": O[:int(0.8 * n)], "last two thirds": O[n // 3:], third[0]: third[1],
            "noise 1 %": O + 0.01 * O.float().std() * noise.to(O.dtype)}


def variants_report(O, repeat, dev):
    """Markdown lines: ours and the published rules on input_variants(O)."""
    lines = ["| variant | N | ours s | published s | published / ours | max-min ours / published "
             "| rows solved | path |", "|---|---|---|---|---|---|---|---|"]
    saved, used = otl_scale._dense_translate, []

    def dense(*args, **kw):
        r = saved(*args, **kw)
        used.append(r is not None)
        return r
    otl_scale._dense_translate = dense
    try:
        for name, V in input_variants(O).items():
            V = V.contiguous()
            med, res = {}, {}
            for method in ("exact", "published"):
                otl_scale.translate(V, method=method)
                used.clear()
                times, res[method] = timed_calls(lambda: otl_scale.translate(V, method=method), repeat, dev)
                med[method] = median(times)
                if method == "exact":
                    path = "dense" if used and used[-1] else "streaming"
            mm = [int(c.max() - c.min()) for c in
                  (torch.bincount(res[m].labels, minlength=V.shape[1]) for m in ("exact", "published"))]
            lines.append(f"| {name} | {V.shape[0]:,} | {med['exact']:.4f} | {med['published']:.4f} | "
                         f"{med['published'] / med['exact']:.2f}x | {mm[0]} / {mm[1]} | "
                         f"{res['exact'].active:,} | {path} |")
    finally:
        otl_scale._dense_translate = saved
    return lines


def report(lines, out):
    """Print the report's lines, and write them to `out` too where given."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")


def main(a):
    global otl_scale
    if (a.as_gpu or a.json) and not a.kernels:
        raise SystemExit("--as-gpu and --json go with --kernels")
    if a.kernels and (a.phases or a.variants or a.method != "exact"):
        raise SystemExit("--kernels counts ours and the published rules in one report: give it "
                         "without --phases, --variants or --method")
    dev = utils.pick_device(a.device)
    if a.as_gpu and dev.type != "cpu":
        raise SystemExit("--as-gpu is for a CPU run (a GPU takes its own block sizes)")
    if a.otl:
        import tempfile
        import compare_labelers
        otl_scale = compare_labelers.load(a.otl, "profiled", tempfile.mkdtemp())
    if a.input:
        O = torch.load(a.input, weights_only=True)
        if not isinstance(O, torch.Tensor) or O.dim() != 2:
            raise SystemExit(f"--input {a.input}: expected an (N, k) tensor saved by torch.save, "
                             f"got {type(O).__name__} {tuple(getattr(O, 'shape', ()))}")
        O = O.to(dev)
        what = a.input
    elif a.checkpoint:
        O = network_outputs(a, dev)
        what = f"label-pass outputs of {a.checkpoint}" + (f", fresh {a.head_k}-way head" if a.head_k else "")
    else:
        O = bench_labeler.gaussian(a.n, a.k, a.seed, device=str(dev) if dev.type == "cuda" else "cpu")
        what = "gaussian"
    n, k = O.shape
    if a.save_input:
        torch.save(O.detach().cpu().contiguous(), a.save_input)
    if a.variants:
        lines = [header(dev, n, k, what), "", f"medians of {a.repeat} calls each", ""]
        report(lines + variants_report(O, a.repeat, dev), a.out)
        return

    def call():
        return otl_scale.translate(O, method=a.method)
    otl_scale.translate(O[:65536], method=a.method)
    times, res = timed_calls(call, a.repeat, dev)
    counts = torch.bincount(res.labels, minlength=k)
    lines = [f"{header(dev, n, k, what)}  method {a.method}",
             f"seconds {median(times):.4f} (median of {[round(t, 4) for t in times]})"
             f"  iterations {res.iterations}  max-min {int(counts.max() - counts.min())}"
             f"  stop {res.stop_reason}"]
    if a.kernels:
        blocks = " with the GPU's block sizes (--as-gpu)" if a.as_gpu else ""
        lines += ["", f"kernels: the torch operations of one call (not views){blocks}; "
                      "reads: of them, those the host waits for on a GPU", ""]
        with (as_gpu() if a.as_gpu else contextlib.nullcontext()):
            call()
            with KernelCount() as counter, stage_timer(dev, counter) as records:
                call()
            on_host = host_kernels(records)
            lines += [f"exact: {counter.kernels:,} kernels ({counter.reads:,} reads); "
                      f"{counter.kernels - on_host:,} where a GPU runs its small solves on the "
                      f"host (otl_scale._HOST_SOLVE: {on_host:,} there)", ""]
            lines += kernels_report(records, counter) + ["", top_ops(counter), ""]
            otl_scale.translate(O, method="published")
            with KernelCount() as pub:
                otl_scale.translate(O, method="published")
        lines += [f"published rules: {pub.kernels:,} kernels ({pub.reads:,} reads); "
                  f"ours / theirs {counter.kernels / max(pub.kernels, 1):.2f}", "", top_ops(pub)]
        report(lines, a.out)
        if a.json:
            stages = [{"solve": where, "rows": rows, "stage": stage, "steps": steps,
                       "kernels": kern, "reads": reads, "host_on_gpu": host}
                      for (where, _, rows), stage, _, steps, (kern, reads, host) in records]
            out = dict(command="python " + " ".join(map(shlex.quote, sys.argv)),
                       git_commit=utils.git_commit(), otl=a.otl or "working tree",
                       otl_sha256=hashlib.sha256(open(otl_scale.__file__, "rb").read()).hexdigest(),
                       device=str(dev), as_gpu=a.as_gpu, input=what, n=n, k=k,
                       exact=dict(seconds=median(times), kernels=counter.kernels,
                                  reads=counter.reads, host_on_gpu=on_host, stages=stages,
                                  by_op=counter.by_op),
                       published=dict(kernels=pub.kernels, reads=pub.reads, by_op=pub.by_op))
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return
    if a.phases:
        if a.method != "exact":
            raise SystemExit("--phases is for the exact labeler (--method exact)")
        with stage_timer(dev) as records:
            utils.synchronize(dev)
            t = time.perf_counter()
            call()
            utils.synchronize(dev)
            total = time.perf_counter() - t
        lines += ["", f"one call with its stages timed: {total:.4f} s", ""] + phases_report(records, total)
        otl_scale.translate(O, method="published")
        pub, _ = timed_calls(lambda: otl_scale.translate(O, method="published"), a.repeat, dev)
        med, ours = median(pub), median(times)
        lines += ["", f"published rules: {med:.4f} s (median of {[round(t, 4) for t in pub]}); "
                      f"published / ours {med / ours:.2f}x"]
        report(lines, a.out)
        return
    prof = cProfile.Profile()
    utils.synchronize(dev)
    prof.enable()
    call()
    utils.synchronize(dev)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    lines += ["", "cProfile, cumulative", s.getvalue()]
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    lines += ["", "cProfile, own time", s.getvalue()]
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as p:
        call()
        utils.synchronize(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    lines += ["", f"torch.profiler by {key}",
              p.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=50)]
    report(lines, a.out)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
