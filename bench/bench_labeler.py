"""The labelers side by side on the same outputs: the tuned exact labeler (otl_scale.translate,
what training uses), the authors' published algorithm (otl.translate, method="published"), SeLa's
Sinkhorn-Knopp (otl.sinkhorn_knopp, lam = 25) and, with --methods ...,reference, otl.py's
reference exact labeler (otl.translate).

    python bench/bench_labeler.py --out results/labeler_bench.json --plot results/labeler_bench.png
    make labeler-bench                                       # the same
    python bench/bench_labeler.py --quick --out /tmp/lb.json # smoke test, about a minute on 2 cores
    make labeler-bench-gpu                                   # on a CUDA GPU (--device cuda)
    make labeler-matrix                                      # the matrix: real outputs, k = 10..3000
    python bench/bench_labeler.py --summary a.json b.json    # tables, and one over both

Inputs (every labeler gets exactly the same (N, k) float32 outputs):
  gaussian        torch.randn from --seed, N = --n (50,000), k = --ks (50, 100, ..., 1000).
  random_net      N = --n images of --data (each of the 27,000 EuroSAT images, then each again
                  mirrored left-right, up to 50,000) through the --net preset's network (cpu)
                  (presets.PRESETS), freshly initialised: backbone features computed once by
                  otl.label_pass(head=False) (BatchNorm on each shuffled batch's statistics,
                  running statistics untouched), then for each k in --real-ks a fresh k-way
                  nn.Linear head (default init, seed --seed + k).  Skipped without --data.
                  --real-split train: the prepared training split's images instead, each once
                  (N = the split's size: what a training run's label pass hands the labeler).
  trained_net     otl.label_pass outputs of --checkpoint (its own head, k = 128) on the same
                  N images.
  trained_backbone  the --checkpoint network's backbone features of the same images through a
                  fresh k-way head for each k in --trained-ks (a trained network at k = 3000).
                  With --views both are the second of two augmented views (the checkpoint's
                  training augmentation), and *_from_view0 is ours on it again, started from
                  the first view's translation (otl.translate(O, start=T)), as train_otl.py's
                  label pass does by default.
  gaussian_large  --large-n x --large-k (1,280,000 x 3000 float32, 15 GB as one array): ours is
                  fed it in chunks of 8192 rows made on the fly (StreamingTranslator, with a
                  refetch that makes rows again), so it is never held whole; its seconds are the
                  time inside the labeler.  Then all three labelers get the first --ref-n rows
                  (64,000) as one array: the published labeler and Sinkhorn hold several N x k
                  float64 copies, and this gives the side-by-side at equal N.
Measured for every (input, k, method), each in a fresh child process (forked from a server that
has imported torch and done nothing else, so no child pays torch's import) that first builds or
loads its input: wall seconds of the labeling call (scipy, which the exact labeler's finish
imports on first use, is imported before it: a cost a process pays once, not the labeler's), its
iterations, the std of the cluster sizes against the even target N/k (std_floor =
sqrt(f (1 - f)), f = (N mod k) / k, is the best any labeler can do), max - min of the sizes, and
the call's peak memory: the child resets its peak RSS (writes 5 to /proc/self/clear_refs), runs
the labeler, and reports VmHWM minus the RSS just before (MiB; the input itself is not counted).
Then, for inputs held whole (not streamed), the same call once more in the same process:
seconds_warm, what a training run pays in every epoch after its first (the process's memory
allocator and torch's kernels are warm by then; the first call pays for them, which is most of
ours at small k), and the labels must equal the first call's.  `streamed` tells the streamed
records.  With --fresh R (CPU, inputs held whole) each method is measured in R fresh children,
the methods taking turns (ours, published, ours, ...: a machine whose speed drifts slows both
alike), and the record keeps the median seconds and seconds_warm with every run's
(seconds_runs, seconds_warm_runs): one fresh process's first call can take several times its
usual time on a shared machine.  Torch uses every core the process may run on.  Linux only.
With --device cuda every measurement runs in this process on the GPU (see measure_gpu): the
Gaussian inputs come from a CUDA generator, the large case sits whole in GPU memory, the
EuroSAT inputs' networks run on the GPU.
Results go to --out as they come (a killed run keeps what it measured); a failed measurement is
recorded with its error and makes the script exit non-zero, and no numbers are made up for it.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import concurrent.futures as cf
import hashlib
import inspect
import json
import multiprocessing as mp
import platform
import re
import tempfile
import time

import torch
from tqdm import tqdm

import otl
import otl_scale
import presets
import utils

METHODS = ("exact", "published", "sinkhorn", "reference")
FULL = dict(n=50_000, ks=list(range(50, 1001, 50)), real_ks=[10, 50, 100, 200, 500, 1000],
            large_n=1_280_000, large_k=3000, ref_n=64_000, real_images=None)
QUICK = dict(n=2000, ks=[10, 50], real_ks=[10, 50], large_n=20_000, large_k=300, ref_n=10_000,
             real_images=2000)


def int_list(s):
    """'50,100' or 'start:stop:step' (stop included)."""
    if ":" in s:
        a, b, c = (int(x) for x in s.split(":"))
        return list(range(a, b + 1, c))
    return [int(x) for x in s.split(",") if x]


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-inputs", metavar="DIR", default=None, help="also keep each network "
                   "input (random_net, trained_net, trained_backbone: an (N, k) float32 tensor "
                   "saved by torch.save as DIR/<input>_<k>.pt) for compare_labelers.py --pt")
    p.add_argument("--summary", metavar="JSON", nargs="+", help="print the tables of results "
                   "JSONs written by this script and stop; with --plot (one JSON), draw its plot. "
                   "With several, also one table over all of them: for each set of outputs and "
                   "k, how many times faster ours is than the published rules (--goal)")
    p.add_argument("--goal", type=float, default=3.0, help="with --summary: the factor over the "
                   "published rules that the table over several JSONs marks cells against "
                   "(default 3: the matrix's bar)")
    p.add_argument("--matrix-plot", metavar="PNG", help="with --summary: draw that table's factors "
                   "against k, one line per set of outputs (needs matplotlib)")
    p.add_argument("--out", default="results/labeler_bench.json", help="results JSON (rewritten after "
                   "every measurement)")
    p.add_argument("--plot", default=None, help="PNG: std and wall time against k (needs matplotlib)")
    p.add_argument("--ks", type=int_list, help="cluster counts of the gaussian sweep: "
                   "'50,100' or '50:1000:50' (default 50:1000:50; --quick: 10,50)")
    p.add_argument("--real-ks", type=int_list, help="cluster counts of the random_net sweep (default "
                   "10,50,100,200,500,1000; --quick: 10,50)")
    p.add_argument("--n", type=int, help="rows of the gaussian sweep (default 50,000; --quick: 2000)")
    p.add_argument("--large-n", type=int, help="rows of the large case (default 1,280,000, ImageNet's "
                   "training set; --quick: 20,000)")
    p.add_argument("--large-k", type=int, help="clusters of the large case (default 3000; --quick: 300)")
    p.add_argument("--ref-n", type=int, help="rows the published labeler and Sinkhorn get in the large "
                   "case (default 64,000, about 1.5 GB per float64 copy at k = 3000; --quick: 10,000)")
    p.add_argument("--skip-large", action="store_true", help="leave out the large cases")
    p.add_argument("--large-inputs", default="gaussian", choices=["gaussian"],
                   help="the large case's input (gaussian, the only one: older commands name it)")
    p.add_argument("--skip-real", action="store_true", help="leave out random_net and trained_net")
    p.add_argument("--methods", default="exact,published,sinkhorn", help=f"comma list from {', '.join(METHODS)} "
                   "(reference: otl.py's reference exact labeler, not run by default)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test (the flags above "
                   "that you give still win); real inputs use a seeded subset of 2000 images")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: inputs made on the GPU, each "
                   "measurement in this process after a warm-up call, the median of --repeat calls, "
                   "GPU peak memory; the large case is held whole on the GPU (not streamed); the "
                   "EuroSAT inputs' networks run on the GPU too")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per measurement on a GPU "
                   "(default 3; the CPU takes one)")
    p.add_argument("--fresh", type=int, default=1, help="on the CPU: fresh child processes per "
                   "method and input held whole, the methods taking turns; the record keeps the "
                   "median seconds and seconds_warm and every run's (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the gaussian inputs, the network, heads "
                   "and label-pass batches")
    p.add_argument("--data", default="data/eurosat", help="prepared EuroSAT (prepare_data.py --out)")
    p.add_argument("--net", default="cpu", help="preset (presets.PRESETS) of random_net's network: cpu "
                   "(half-width ResNet-18, as training's cpu preset), or e.g. alexnet-cifar-cpu with "
                   "--data data/cifar10 (the inputs of ablations.py's labeler studies)")
    p.add_argument("--checkpoint", default="runs/eurosat/checkpoint.pth", help="trained network")
    p.add_argument("--trained-ks", type=int_list, default=[], help="also the --checkpoint "
                   "network's backbone features through fresh k-way heads, for these k "
                   "(trained_backbone; e.g. 3000: a trained network's outputs at ImageNet's k)")
    p.add_argument("--views", action="store_true", help="trained_net and trained_backbone as "
                   "training's label pass sees them: two augmented views (the checkpoint's "
                   "augmentation); the second is labelled, and ours also from the first view's "
                   "translation (*_from_view0: train_otl.py --labeler-start views)")
    p.add_argument("--real-split", choices=["all", "train"], default="all", help="the images of "
                   "random_net and trained_net: all (every image of --data, then each again "
                   "mirrored, up to --n) or train (the prepared training split, each image once: "
                   "what a training run's label pass hands the labeler; N = its size, --n ignored)")
    return p


def resolve_args(args):
    """Fill sizes not given from --quick or the full defaults; fail on sizes that cannot work."""
    for key, val in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        raise SystemExit(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if not args.ks or min(args.ks) < 2 or max(args.ks) > args.n:
        raise SystemExit(f"--ks must lie in [2, --n={args.n}], got {args.ks}")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: no CUDA GPU is visible to torch here; use --device cpu")
    if args.net not in presets.PRESETS:
        raise SystemExit(f"--net {args.net!r}: not a preset; choose from {', '.join(presets.PRESETS)}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    if args.fresh < 1:
        raise SystemExit(f"--fresh must be >= 1, got {args.fresh}")
    if not args.skip_large and not args.large_k <= args.ref_n <= args.large_n:
        raise SystemExit(f"need --large-k <= --ref-n <= --large-n, got {args.large_k}, {args.ref_n}, "
                         f"{args.large_n}")
    return args


GEN_CHUNK = 8192


def gaussian_chunk(c, k, seed):
    """Rows c * 8192 ... (c + 1) * 8192 - 1 of the gaussian input: torch.randn from a generator
    seeded per chunk, so any rows can be made again without the rows before them."""
    return torch.randn(GEN_CHUNK, k, generator=torch.Generator().manual_seed(seed * 1_000_003 + c))


def gaussian(n, k, seed, device="cpu"):
    """The first n rows of the gaussian input, (n, k) float32 (peak: the tensor + one chunk).
    On a GPU the chunks come from a CUDA generator with the same seeds (other numbers)."""
    out = torch.empty(n, k, device=device)
    for c, s in enumerate(range(0, n, GEN_CHUNK)):
        out[s:s + GEN_CHUNK] = (gaussian_chunk(c, k, seed) if device == "cpu" else torch.randn(
            GEN_CHUNK, k, device=device,
            generator=torch.Generator(device=device).manual_seed(seed * 1_000_003 + c)))[:n - s]
    return out


def gaussian_rows(rows, k, seed):
    """The given rows (int64, any order) of the gaussian input, made chunk by chunk."""
    out = torch.empty(rows.numel(), k)
    for c in rows.div(GEN_CHUNK, rounding_mode="floor").unique().tolist():
        sel = (rows // GEN_CHUNK == c).nonzero()[:, 0]
        out[sel] = gaussian_chunk(c, k, seed)[rows[sel] - c * GEN_CHUNK]
    return out


class GaussianRows:
    """The gaussian input as a source of rows: chunk(c) and rows(rows), for the stream."""

    def __init__(self, k, seed):
        self.k, self.seed = k, seed

    def chunk(self, c):
        return gaussian_chunk(c, self.k, self.seed)

    def rows(self, rows):
        return gaussian_rows(rows, self.k, self.seed)


def _mem_kib():
    with open("/proc/self/status") as fh:
        return {k: int(v) for k, v in re.findall(r"(VmRSS|VmHWM):\s+(\d+) kB", fh.read())}


def call_labeler(method, O, start=None):
    """(labels, iterations, stop_reason, the call as text, extra fields) of one labeler on O:
    exact (otl_scale.translate, the tuned labeler training uses), reference (otl.translate's
    reference exact labeler), published (Algorithm 1 as the authors run it) or sinkhorn; the
    tuned labeler's extra fields say how many rows it read again and solved.  start: an exact
    labeler's start translation (translate's start=)."""
    if method == "sinkhorn":
        labels, _, iters = otl.sinkhorn_knopp(O, lam=25.0)
        return labels, iters, None, "otl.sinkhorn_knopp(O, lam=25)", {}
    fn, name, kw = {"exact": (otl_scale.translate, "otl_scale.translate", {}),
                    "reference": (otl.translate, "otl.translate", {}),
                    "published": (otl.translate, "otl.translate", {"method": "published"})}[method]
    args = ", ".join(["O"] + [f"{a}={v!r}" for a, v in kw.items()])
    if start is not None:
        res = fn(O, start=start.to(O.device), **kw)
        call = f"{name}({args}, start=T of the first view)"
    else:
        res = fn(O, **kw)
        call = f"{name}({args})"
    extra = ({"refetched": res.refetched, "working_set": res.active} if method == "exact" else {})
    return res.labels, res.iterations, res.stop_reason, call, extra


def _start_peak():
    rss = _mem_kib()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM restarts from the current RSS
    return rss


def _record(labels, n, k, seconds, iters, reason, call, rss):
    peak = _mem_kib()["VmHWM"]
    counts = torch.bincount(labels.cpu(), minlength=k)
    f = (n % k) / k
    return {"seconds": round(seconds, 4), "iterations": int(iters),
            "std": (counts.double() - n / k).pow(2).mean().sqrt().item(), "std_floor": (f * (1 - f)) ** 0.5,
            "max_minus_min": int(counts.max() - counts.min()), "peak_mib": round((peak - rss) / 1024, 1),
            "rss_before_mib": round(rss / 1024, 1), "stop_reason": reason, "call": call}


def otl_sha256():
    """The sha256 of otl.py and otl_scale.py together: the labelers measured."""
    h = hashlib.sha256()
    for path in (otl.__file__, otl_scale.__file__):
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _import_scipy(settle=0.5):
    """Wait after importing otl_scale (which imports scipy's graph routines for its exact
    finish): numpy's and scipy's OpenBLAS start threads on import that spin for a while and slow
    a call timed right after, for both labelers."""
    import scipy.sparse.csgraph  # noqa: F401  (otl_scale's import; here for older versions too)
    time.sleep(settle)


def measure(spec):
    """Child process: build or load the input, then time one labeler and its peak memory."""
    torch.set_num_threads(spec["threads"])
    if otl_sha256() != spec["otl_sha256"]:   # each child imports otl.py afresh
        raise RuntimeError("otl.py changed since the benchmark started; its numbers would not "
                           "belong to the recorded commit")
    if spec.get("device", "cpu") != "cpu":
        return measure_gpu(spec)
    if spec.get("stream"):
        return measure_stream(spec)
    if spec["path"]:
        O = torch.load(spec["path"], weights_only=True)
    else:
        O = gaussian(spec["n"], spec["k"], spec["seed"])
    start = torch.load(spec["start"], weights_only=True) if spec.get("start") else None
    n, k = O.shape
    _import_scipy()        # a process imports scipy once, at its first exact finish: not timed
    rss = _start_peak()
    t0 = time.perf_counter()
    labels, iters, reason, call, extra = call_labeler(spec["method"], O, start)
    rec = _record(labels, n, k, time.perf_counter() - t0, iters, reason, call, rss)
    rec.update(extra, streamed=False)
    if spec.get("warm", True):   # the same call again: what every epoch after the first costs
        t0 = time.perf_counter()
        again = call_labeler(spec["method"], O, start)[0]
        rec["seconds_warm"] = round(time.perf_counter() - t0, 4)
        if not torch.equal(again, labels):
            raise RuntimeError("the second call gave other labels than the first")
    return rec


def measure_stream(spec):
    """Child process: ours fed the large gaussian input chunk by chunk, never holding it whole.
    The seconds are those spent inside
    the labeler (add and result); making the chunks is not counted.  The peak counts
    everything after the start, one made chunk (8192 x k float32) included."""
    n, k, seed = spec["n"], spec["k"], spec["seed"]
    src = GaussianRows(k, seed)
    _import_scipy()        # imported once per process: not the labeler's time
    rss = _start_peak()
    st = otl_scale.StreamingTranslator(k, distributed=False)
    seconds = 0.0
    for c, s in enumerate(tqdm(range(0, n, GEN_CHUNK), desc="streaming", leave=False)):
        X = src.chunk(c)[:n - s]
        t0 = time.perf_counter()
        st.add(X)
        seconds += time.perf_counter() - t0
        del X
    t0 = time.perf_counter()
    res = st.result(refetch=src.rows)
    seconds += time.perf_counter() - t0
    rec = _record(res.labels, n, k, seconds, res.iterations, res.stop_reason,
                  "otl_scale.StreamingTranslator(k).add(chunk) per 8192 rows, then .result(refetch=...)", rss)
    rec.update(refetched=res.refetched, working_set=res.active, streamed=True)
    return rec


def measure_gpu(spec):
    """In this process, on the GPU: the input is made there, one warm-up call on its first
    65,536 rows loads the kernels, then --repeat timed calls (torch.cuda.synchronize around
    each); seconds is their median.  Peak: torch.cuda.max_memory_allocated above what was
    allocated before the call (the input is not counted)."""
    dev = torch.device(spec["device"])
    O = (torch.load(spec["path"], weights_only=True).to(dev) if spec.get("path") else
         gaussian(spec["n"], spec["k"], spec["seed"], device=dev))
    n, k = O.shape
    start = torch.load(spec["start"], weights_only=True) if spec.get("start") else None
    call_labeler(spec["method"], O[:min(n, 65536)])
    times, peaks = [], []
    for _ in range(spec["repeat"]):
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        rss = _start_peak()
        t0 = time.perf_counter()
        labels, iters, reason, call, extra = call_labeler(spec["method"], O, start)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated(dev) - before) / 2 ** 20)
    rec = _record(labels, n, k, sorted(times)[len(times) // 2], iters, reason, call, rss)   # last call's labels
    rec.update(extra)
    rec.update(seconds_all=[round(t, 4) for t in times], gpu_peak_mib=round(max(peaks), 1),
               device=torch.cuda.get_device_name(dev))
    del O
    torch.cuda.empty_cache()
    return rec


def _child_context():
    """Children forked from a server that has imported torch and done nothing else (no tensor
    made; a fork carries only the forking thread): a fresh process for the labeler, without
    importing torch again in each one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def measure_in_child(spec):
    if spec.get("device", "cpu") != "cpu":   # GPU: in this process (see measure_gpu)
        try:
            return measure(spec)
        except Exception as e:  # recorded, never replaced by numbers
            torch.cuda.empty_cache()
            return {"error": f"{type(e).__name__}: {e}"}
    with cf.ProcessPoolExecutor(1, mp_context=_child_context()) as ex:
        try:
            return ex.submit(measure, spec).result()
        except cf.process.BrokenProcessPool:
            return {"error": "the child process died (killed for memory?)"}
        except Exception as e:  # recorded, never replaced by numbers
            return {"error": f"{type(e).__name__}: {e}"}


def median_run(runs):
    """One record of a method's fresh runs: the run of the median seconds (the upper middle one
    for an even count), seconds_warm the median of theirs, and every run's times where there
    were several; the first error where any run failed."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return {**bad[0], "failed_runs": len(bad), "fresh_runs": len(runs)}
    if len(runs) == 1:
        return runs[0]
    rec = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    rec.update(fresh_runs=len(runs), seconds_runs=[r["seconds"] for r in runs])
    warm = [r["seconds_warm"] for r in runs if "seconds_warm" in r]
    if warm:
        rec.update(seconds_warm=sorted(warm)[len(warm) // 2], seconds_warm_runs=warm)
    return rec


def real_inputs(args, skipped):
    """Yield (input name, k, (N, k) outputs) for random_net and trained_net, or note why not."""
    try:
        d = utils.load_prepared(args.data)
    except FileNotFoundError as e:
        skipped["random_net"] = skipped["trained_net"] = str(e)
        print(f"skipping the real outputs: {e}", flush=True)
        return
    images = d["images"]
    if args.real_split == "train":
        images = images[d["train_idx"]]
    if args.real_images:
        images = images[torch.randperm(len(images), generator=torch.Generator().manual_seed(args.seed))
                        [:args.real_images]]
    with open(os.path.join(args.data, "manifest.json")) as fh:
        manifest = json.load(fh)
    t0 = time.perf_counter()
    if args.real_split == "train":   # each training image once
        both = images
    else:                            # N = 50,000 from 27,000 images: each also mirrored
        both = torch.cat([images, images.flip(3)])[:min(args.n, 2 * len(images))]
    n_real = len(both)
    feats = utils.random_net_features(both, manifest, args.net, args.seed, device=args.device).cpu()
    print(f"random_net: features of {n_real:,} images in {time.perf_counter() - t0:.1f} s", flush=True)
    for k in args.real_ks:
        yield "random_net", k, utils.fresh_head_outputs(feats, k, args.seed)
    if not os.path.isfile(args.checkpoint):
        skipped["trained_net"] = f"no checkpoint at {args.checkpoint}"
        print(f"skipping trained_net: no checkpoint at {args.checkpoint}", flush=True)
        return
    model, ckpt = utils.load_checkpoint(args.checkpoint, args.device)
    size = int(ckpt["args"]["img_size"])
    # --views: two augmented views as training's label pass makes them (its augmentation, the
    # same draws in both passes); the second is labelled, from the medians and from the first's T
    aug = (dict(views=2, strong=ckpt["args"].get("aug", "strong") == "strong",
                cutout=int(ckpt["args"].get("cutout", 16)), rot90=bool(ckpt["args"].get("rot90", True)))
           if args.views else {})

    def label_pass(head):
        torch.manual_seed(args.seed)
        return otl.label_pass(model, both, size, 256, args.device, bn="batch", head=head,
                              generator=torch.Generator().manual_seed(args.seed), progress=False,
                              **aug)

    def views(outs):    # (V, N, k) -> the input, or (second view, first view's T) with --views
        if not args.views:
            return outs[0].cpu()
        return outs[1].cpu(), otl_scale.translate(outs[0]).T.cpu()

    outs = label_pass(True)
    yield "trained_net", model.cfg.k, views(outs)
    if args.trained_ks:   # the trained backbone's features through fresh k-way heads
        feats = label_pass(False)
        if model.embedding is not None:
            with torch.no_grad():
                feats = model.embedding(feats)
        for k in args.trained_ks:
            yield "trained_backbone", k, views(torch.stack([utils.fresh_head_outputs(f, k, args.seed)
                                                            for f in feats]))


def machine_info(threads):
    with open("/proc/cpuinfo") as fh:
        cpu = re.search(r"model name\s*:\s*(.*)", fh.read())
    with open("/proc/meminfo") as fh:
        ram_kib = int(re.search(r"MemTotal:\s+(\d+)", fh.read()).group(1))
    return {"cpu": cpu.group(1) if cpu else platform.processor(), "cores": os.cpu_count(),
            "torch_threads": threads, "ram_gib": round(ram_kib / 2 ** 20, 1),
            "torch": torch.__version__, "python": platform.python_version(), "os": platform.platform(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _pyplot(path):
    """matplotlib.pyplot on the Agg backend, or None (said, with `path` not written) without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot written to {path}: matplotlib is missing (.venv/bin/python -m pip install "
              "matplotlib)", flush=True)
        return None
    return plt


def _save_figure(fig, path):
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def plot(records, path):
    """std and wall time against k for the gaussian sweep (solid) and random_net (dashed)."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, (ax_std, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    colour = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for inp, style in (("gaussian", "o-"), ("random_net", "s--")):
        for m in METHODS:
            rs = sorted((r for r in records if r["input"] == inp and r["method"] == m and "std" in r),
                        key=lambda r: r["k"])
            if rs:
                ks, lab = [r["k"] for r in rs], f"{m}, {inp} (N = {rs[0]['n']:,})"
                ax_std.plot(ks, [r["std"] for r in rs], style, color=colour[m], ms=3, label=lab)
                ax_t.plot(ks, [r["seconds"] for r in rs], style, color=colour[m], ms=3, label=lab)
    floor = sorted({(r["k"], r["std_floor"]) for r in records if r["input"] == "gaussian" and "std" in r})
    if floor:
        ax_std.plot(*zip(*floor), ":", color="grey", label="integer floor (gaussian)")
    ax_std.set(xlabel="k", ylabel="std of cluster sizes vs N/k", title="balance")
    ax_std.set_yscale("symlog", linthresh=0.1)  # the integer floor lies in [0, 0.5]
    ax_t.set(xlabel="k", ylabel="wall seconds", yscale="log", title="time")
    for ax in (ax_std, ax_t):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    _save_figure(fig, path)


INPUT_ORDER = ["gaussian", "random_net", "trained_net", "trained_net_from_view0",
               "trained_backbone", "trained_backbone_from_view0", "gaussian_large"]


def summary(res):
    """Markdown tables of a results JSON's contents: per input and k, each method's seconds,
    max - min and std (floor), and how many times faster ours is than the published labeler."""
    recs = [r for r in res["records"] if "error" not in r]
    on = (f"{res['machine']['gpu']}" if res["args"].get("device", "cpu") != "cpu" else
          f"{res['machine']['cpu']} ({res['machine']['torch_threads']} threads")
    on += f"{', ' if '(' in on else ' ('}torch {res['machine']['torch']})"
    lines = [f"`{res['command']}` at commit `{res['git_commit'][:7]}` on {on}", ""]
    fresh = max((r.get("fresh_runs", 1) for r in recs), default=1)
    if fresh > 1:
        lines[-1:] = ["", f"Seconds: the median of {fresh} fresh processes per method, the "
                      "methods taking turns (every run's in the JSON).", ""]
    host = any("seconds_cpu" in r for r in recs)     # older GPU runs (--cpu-too): on the host too
    methods = [m for m in METHODS if m != "reference" or any(r["method"] == m for r in recs)]
    head = "| input | N | k | " + " | ".join(f"{m} s (max-min, std)" for m in methods) + \
        " | published / ours | second call: exact s, published s, published / ours |" + \
        (" on the host (--cpu-too): " + ", ".join(f"{m} s" for m in methods) + " |" if host else "")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    keys = sorted({(r["input"], r["n"], r["k"]) for r in recs},
                  key=lambda x: (INPUT_ORDER.index(x[0]) if x[0] in INPUT_ORDER else 9,
                                 -x[1] if x[0].endswith("_large") else x[1], x[2]))
    for inp, n, k in keys:
        by = {r["method"]: r for r in recs if (r["input"], r["n"], r["k"]) == (inp, n, k)}
        cells = [f"{by[m]['seconds']:.2f} ({by[m]['max_minus_min']}, {by[m]['std']:.2f})" if m in by
                 else "" for m in methods]
        if "published" not in by and inp.endswith("_from_view0"):   # the same outputs' published
            base = [r for r in recs if (r["input"], r["n"], r["k"], r["method"]) ==
                    (inp[:-len("_from_view0")], n, k, "published")]
            by = {**by, **({"published_base": base[0]} if base else {})}
        pub = by.get("published", by.get("published_base"))
        ratio = (f"{pub['seconds'] / by['exact']['seconds']:.1f}x" if pub and "exact" in by else "")
        warm = [by[m].get("seconds_warm") if m in by else None for m in ("exact", "published")]
        second = (", ".join("" if w is None else f"{w:.2f}" for w in warm)
                  + (f", {warm[1] / warm[0]:.1f}x" if None not in warm else ""))
        lines.append(f"| {inp} | {n:,} | {k} | " + " | ".join(cells) + f" | {ratio} | "
                     + (second if any(w is not None for w in warm) else "") + " |"
                     + (" " + ", ".join(f"{by[m]['seconds_cpu']:.2f}" if "seconds_cpu" in by.get(m, {})
                                        else "-" for m in methods) + " |" if host else ""))
    for r in recs:   # ours fed chunk by chunk (records before the field: told by their call)
        if r.get("streamed", "StreamingTranslator" in r.get("call", "")):
            lines.append(f"\n{r['input']} N = {r['n']:,}, k = {r['k']}, {r['method']} streamed: "
                         f"{r['seconds']:.2f} s, peak {r['peak_mib']:.0f} MiB above the "
                         f"{r['rss_before_mib']:.0f} MiB before it, {r['iterations']} iterations, "
                         f"max - min {r['max_minus_min']}, {r['working_set']:,} rows solved, "
                         f"{r['refetched']} re-read")
    return "\n".join(lines)


def _outputs_of(res, r):
    """The set of outputs a record's input belongs to: (data set, network, images, N); a random
    network's fresh heads at every k are one set, a trained network's own head (k = 128) and its
    backbone through fresh heads another."""
    a = res["args"]
    if r["input"] == "gaussian":
        return ("gaussian", "torch.randn", "", r["n"])
    data = os.path.basename(os.path.normpath(a.get("data", "")))
    images = "training split" if a.get("real_split") == "train" else "all images"
    if r["input"] == "random_net":
        return (data, f"random `{a.get('net', 'cpu')}` network", images, r["n"])
    if r["input"] in ("trained_net", "trained_backbone"):
        return (data, f"trained network (`{os.path.dirname(a.get('checkpoint', ''))}`)", images,
                r["n"])
    return None      # the large cases (not held whole) and the *_from_view0 variants


def _set_name(key):
    """A set of outputs (_outputs_of) as the table and the plot name it."""
    return key[0] if key[0] == "gaussian" else ", ".join(key[:3])


def matrix(results, goal=3.0):
    """One table over several results JSONs (the matrix): for each set of outputs
    (_outputs_of) and k, the published rules' seconds over ours, on the first call in a fresh
    process and on the second call in it (an epoch after the first), with ours' and their
    max - min; cells under `goal` end in ' <'.  A measurement in several JSONs (the Gaussian
    input every run makes) counts once: the one of most fresh processes, else the first.
    Returns (markdown, {set: {k: factor}})."""
    cells, ks = {}, set()
    for res in results:
        for r in res["records"]:
            key = _outputs_of(res, r) if "error" not in r else None
            if key is not None and r["method"] in ("exact", "published"):
                at = cells.setdefault(key, {}).setdefault(r["k"], {})
                if r.get("fresh_runs", 1) > at.get(r["method"], {}).get("fresh_runs", 0):
                    at[r["method"]] = r
                ks.add(r["k"])
    ks = sorted(ks)
    lines, factors, under, total = [], {}, [], 0
    for title, field in (("first call, in a fresh process", "seconds"),
                         ("second call in the same process (every epoch after the first)",
                          "seconds_warm")):
        lines += ["", f"Published rules' seconds / ours, {title} (max - min: ours / theirs):", "",
                  "| outputs | N | " + " | ".join(f"k = {k}" for k in ks) + " |",
                  "|---|---|" + "---|" * len(ks)]
        for key in sorted(cells, key=lambda x: (x[0] == "gaussian", x[0], x[1], -x[3])):
            row = []
            for k in ks:
                by = cells[key].get(k, {})
                e, p = by.get("exact", {}), by.get("published", {})
                if not (e.get(field) and p.get(field)):
                    row.append("")
                    continue
                f = p[field] / e[field]
                total += field == "seconds"
                if field == "seconds":
                    factors.setdefault(key, {})[k] = f
                    if f < goal:
                        under.append(f"{_set_name(key)}, k = {k}: {f:.1f}x")
                row.append(f"{f:.1f}x ({e['max_minus_min']} / {p['max_minus_min']})"
                           + (" <" if f < goal else ""))
            lines.append(f"| {_set_name(key)} | {key[3]:,} | " + " | ".join(row) + " |")
    lines += ["", f"First call: {total - len(under)} of {total} cells at or above {goal:g}x"
              + (": every one." if not under else "; under it (marked <): " + "; ".join(under) + ".")]
    return "\n".join(lines), factors


def plot_matrix(factors, path, goal=3.0):
    """The table's first-call factors against k, one line per set of outputs, the goal dashed."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, by_k in sorted(factors.items()):
        ks = sorted(by_k)
        ax.plot(ks, [by_k[k] for k in ks], "o-", ms=3,
                label=f"{_set_name(key)}, N = {key[3]:,}".replace("`", ""))
    ax.axhline(goal, color="grey", ls="--", label=f"{goal:g}x")
    ax.axhline(1, color="black", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="k", ylabel="published rules' seconds / ours",
           title="ours against the published rules, first call")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save_figure(fig, path)


def main(args):
    if args.summary:
        if args.plot and len(args.summary) > 1:
            raise SystemExit("--plot draws one JSON's plot; give one --summary JSON, or "
                             "--matrix-plot for the table over several")
        results, many = [], len(args.summary) > 1
        for path in args.summary:
            with open(path) as fh:
                results.append(json.load(fh))
            head = ("\n" if len(results) > 1 else "") + f"## {path}\n\n" if many else ""
            print(head + summary(results[-1]))
        if args.plot:       # the plot of a saved benchmark
            plot(results[0]["records"], args.plot)
        if len(results) > 1 or args.matrix_plot:
            table, factors = matrix(results, args.goal)
            print(table)
            if args.matrix_plot:
                plot_matrix(factors, args.matrix_plot, args.goal)
        return None
    args = resolve_args(args)
    utils.print_run_header(args)
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"torch threads: {threads} (the cores this process may use)", flush=True)
    out = {"machine": machine_info(threads), "command": utils.command_line(),
           "git_commit": utils.git_commit(), "otl_sha256": otl_sha256(),
           "translate_signature": str(inspect.signature(otl_scale.translate)),
           "args": vars(args), "inputs": {
               "gaussian": f"torch.randn(N, k) float32, seed {args.seed}, N = {args.n}",
               "random_net": f"images of {args.data} through the freshly initialised {args.net}-preset "
                             "network (BatchNorm on batch statistics) and a fresh k-way nn.Linear "
                             "head; images: "
                             + ("the training split" if args.real_split == "train" else "every image")
                             + (f", a seeded subset of {args.real_images}" if args.real_images else "")
                             + ("" if args.real_split == "train" else
                                f", each also mirrored, the first {args.n} of them"),
               "trained_net": f"label-pass outputs of {args.checkpoint} (its head), same images",
               "trained_backbone": f"{args.checkpoint}'s backbone features of the same images "
                                   "through a fresh k-way nn.Linear head (seed --seed + k)"
                                   + (", the second of two augmented views" if args.views else ""),
               "*_from_view0": "the same input, ours started from the first view's translation",
               "gaussian_large": f"torch.randn float32, N = {args.large_n} for exact; the published "
                                 f"labeler and sinkhorn get the first {args.ref_n} rows (their N is "
                                 "in each record)"},
           "skipped": {}, "records": []}
    print(f"{'input':<15}{'N':>10}{'k':>6}  {'method':<10}{'seconds':>9}{'iters':>7}{'std':>10}"
          f"{'floor':>7}{'max-min':>8}{'peak MiB':>10}  stop", flush=True)

    def run(name, n, k, path=None, methods=args.methods, stream=False, start=None):
        fresh = args.fresh if args.device == "cpu" and not stream else 1
        runs = {m: [] for m in methods}
        for _ in range(fresh):      # the methods take turns
            for m in methods:
                spec = {"method": m, "n": n, "k": k, "seed": args.seed, "path": path,
                        "threads": threads, "stream": stream, "otl_sha256": out["otl_sha256"],
                        "device": args.device, "repeat": args.repeat,
                        "start": start}
                runs[m].append(measure_in_child(spec))
        for m in methods:
            rec = {"input": name, "n": n, "k": k, "method": m, **median_run(runs[m])}
            out["records"].append(rec)
            utils.write_json(out, args.out)
            line = f"{name:<15}{n:>10,}{k:>6}  {m:<10}"
            print(line + (f"FAILED: {rec['error']}" if "error" in rec else
                          f"{rec['seconds']:>9.2f}{rec['iterations']:>7}{rec['std']:>10.3f}"
                          f"{rec['std_floor']:>7.3f}{rec['max_minus_min']:>8}{rec['peak_mib']:>10.1f}"
                          f"  {rec['stop_reason'] or ''}"), flush=True)

    exact_only = [m for m in args.methods if m == "exact"]
    for k in args.ks:
        run("gaussian", args.n, k)
    if args.skip_real:
        out["skipped"]["random_net"] = out["skipped"]["trained_net"] = "--skip-real"
    else:
        if args.save_inputs:
            os.makedirs(args.save_inputs, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="labeler_bench_") as tmp:
            where = args.save_inputs or tmp
            for name, k, outs in real_inputs(args, out["skipped"]):
                outs, T0 = outs if isinstance(outs, tuple) else (outs, None)
                path = os.path.join(where, f"{name}_{k}.pt")  # written once, loaded by each child
                torch.save(outs.contiguous(), path)
                run(name, outs.shape[0], k, path)
                if T0 is not None:   # --views: ours again, from the first view's translation
                    start = os.path.join(where, f"{name}_{k}_start.pt")
                    torch.save(T0, start)
                    run(f"{name}_from_view0", outs.shape[0], k, path, methods=exact_only, start=start)
                    if not args.save_inputs:
                        os.remove(start)
                if not args.save_inputs:
                    os.remove(path)
    if args.skip_large:
        out["skipped"]["gaussian_large"] = "--skip-large"
    else:   # ours streamed over all N rows; then all three, ours included, on the first ref_n rows
        run("gaussian_large", args.large_n, args.large_k, methods=exact_only,
            stream=args.device == "cpu")
        run("gaussian_large", args.ref_n, args.large_k)
    utils.write_json(out, args.out)
    print(f"results: {args.out}", flush=True)
    if args.plot:
        plot(out["records"], args.plot)
    failed = [r for r in out["records"] if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(out['records'])} measurements failed (see {args.out}); "
                         f"first: {failed[0]['input']} k={failed[0]['k']} {failed[0]['method']}: "
                         f"{failed[0]['error']}")
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
