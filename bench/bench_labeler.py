"""The labelers on the same outputs, each by its one name (docs/labeler.md), each call timed by
utils.measure_labeler: exact (the tuned labeler training uses), published (Algorithm 1, run as
--published says), sinkhorn (SeLa's Sinkhorn-Knopp) and reference (otl.py's short exact one).

    make labeler-bench                  # python bench/bench_labeler.py --out results/labeler_bench.json
    make labeler-bench-gpu              # on a CUDA GPU (--device cuda)
    python bench/bench_labeler.py --n 2000 --ks 10,50 --skip-real --large-n 20000 --large-k 300 \\
        --ref-n 5000 --out /tmp/lb.json          # a smoke test: about a minute on 2 cores

Inputs, (N, k) float32 and the same for every labeler:
  gaussian          torch.randn (seeded per 8,192 rows), N = --n, k = each of --ks.
  random_net        --data's images (every one, then mirrored, up to --n; or the training
                    split's) through the --net preset's freshly initialised network
                    (utils.random_net_features) and a fresh k-way head for each of --real-ks.
  trained_net       those images' label-pass outputs of --checkpoint (its own head), and
  trained_backbone  its backbone's features through a fresh head for each of --trained-ks.
  gaussian_large    --large-n x --large-k (1.28M x 3000, 15 GB in float32): exact streamed 8,192
                    rows at a time (otl_scale.StreamingTranslator; rows made again for its
                    refetch), its seconds those inside the labeler; then every method on the
                    first --ref-n rows.  On a GPU all rows are held whole instead.
Each (input, k, method) runs in a fresh child process (of a server that imported torch alone;
on a GPU in this one, after a call on 65,536 rows has loaded the kernels) that calls the labeler
twice: seconds is the first call (a run's first epoch), seconds_warm the second (every later
one), on the CPU the first's result again.  A record is utils.measure_labeler's, with std_floor
= sqrt(f (1 - f)), f = (N mod k) / k (the least std the integers allow), and peak_mib, the first
call's peak memory above the memory in use before it (VmHWM reset through /proc/self/clear_refs,
so Linux only; on a GPU torch.cuda.max_memory_allocated).  --out is written after every
measurement; a failure is recorded with its error, never numbers, and the exit status is 1.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import concurrent.futures as cf
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
PUBLISHED = {"training": {}, "authors": {"init": "zero", "tie_eps": 0}}
CHUNK = 8192
SAME = ("iterations", "std", "max_minus_min", "stop_reason")    # a second call gives them again


def int_list(s):
    return [int(x) for x in s.split(",") if x]


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/labeler_bench.json", help="results JSON")
    p.add_argument("--methods", default="exact,published,sinkhorn", help=f"comma list from "
                   f"{', '.join(METHODS)} (reference: slow at large k, so not by default)")
    p.add_argument("--published", choices=list(PUBLISHED), default="training", help="how published "
                   "runs: training (as train_otl.py --labeler published: T from the column "
                   "medians, a 1e-6 tie-break; the default) or authors (the authors' code and the "
                   "studies: T from 0, no tie-break)")
    p.add_argument("--n", type=int, default=50_000, help="rows of gaussian, and the most images the "
                   "networks get with --real-split all")
    p.add_argument("--ks", type=int_list, default=list(range(50, 1001, 50)), help="gaussian's k, "
                   "comma-separated (50, 100, ..., 1000)")
    p.add_argument("--skip-real", action="store_true", help="leave out the networks' outputs")
    p.add_argument("--data", default="data/eurosat", help="prepared data of the networks' inputs")
    p.add_argument("--net", default="cpu", choices=list(presets.PRESETS), help="preset of "
                   "random_net's network: cpu (training's), or alexnet-cifar-cpu with --data "
                   "data/cifar10 (the studies')")
    p.add_argument("--real-ks", type=int_list, default=[10, 50, 100, 200, 500, 1000],
                   help="random_net's k, comma-separated")
    p.add_argument("--real-split", choices=["all", "train"], default="all", help="the networks' "
                   "images: all (mirrored too, up to --n) or train (the training split, once each)")
    p.add_argument("--checkpoint", default="runs/eurosat/checkpoint.pth", help="the trained network "
                   "of trained_net and trained_backbone (left out when missing)")
    p.add_argument("--trained-ks", type=int_list, default=[], help="cluster counts of "
                   "trained_backbone (e.g. 3000: a trained network's outputs at ImageNet's k)")
    p.add_argument("--save-inputs", metavar="DIR", help="keep each network input as DIR/<input>_<k>.pt "
                   "((N, k) float32, torch.save), for compare_labelers.py --pt")
    p.add_argument("--skip-large", action="store_true", help="leave out gaussian_large")
    p.add_argument("--large-n", type=int, default=1_280_000, help="rows of gaussian_large (ImageNet's)")
    p.add_argument("--large-k", type=int, default=3000, help="clusters of gaussian_large (3000)")
    p.add_argument("--ref-n", type=int, default=64_000, help="gaussian_large's first rows, held whole, "
                   "that every method gets (the published rules and Sinkhorn hold N x k float64 copies)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: inputs, networks and labelers there")
    p.add_argument("--seed", type=int, default=0, help="seeds the inputs, networks and heads")
    return p


def check_args(args):
    """The methods as a list; one line for what cannot work."""
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        raise SystemExit(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if not args.ks or min(args.ks) < 2 or max(args.ks) > args.n:
        raise SystemExit(f"--ks must lie in [2, --n={args.n}], got {args.ks}")
    if not args.skip_large and not args.large_k <= args.ref_n <= args.large_n:
        raise SystemExit(f"need --large-k <= --ref-n <= --large-n, got {args.large_k}, "
                         f"{args.ref_n}, {args.large_n}")
    args.device = str(utils.pick_device(args.device))


def gaussian_chunk(c, k, seed):
    """Rows c x 8192 ... of the gaussian input, from a generator seeded per chunk: any rows can
    be made again without the rows before them."""
    return torch.randn(CHUNK, k, generator=torch.Generator().manual_seed(seed * 1_000_003 + c))


def gaussian_rows(rows, k, seed):
    """The given rows (int64, any order) of the gaussian input, made chunk by chunk."""
    out = torch.empty(rows.numel(), k)
    for c in rows.div(CHUNK, rounding_mode="floor").unique().tolist():
        sel = (rows // CHUNK == c).nonzero()[:, 0]
        out[sel] = gaussian_chunk(c, k, seed)[rows[sel] - c * CHUNK]
    return out


def _vm(field):     # KiB
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+) kB", fh.read()).group(1))


def _start_peak():
    """The RSS now, and the peak (VmHWM) restarted from it."""
    rss = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return rss


def measure(spec):
    """One (input, method): make or load the input, then time the labeler on it twice."""
    torch.set_num_threads(spec["threads"])
    if [utils.sha256_file(f) for f in (otl.__file__, otl_scale.__file__)] != spec["sha256"]:
        raise RuntimeError("otl.py or otl_scale.py changed since the benchmark started")
    n, k, seed = spec["n"], spec["k"], spec["seed"]
    time.sleep(0.5)    # OpenBLAS's threads (scipy's import) spin a while and slow a call right after
    if spec["stream"]:  # exact never holding the rows whole; its seconds the labeler's alone
        rss, seconds = _start_peak(), 0.0
        st = otl_scale.StreamingTranslator(k, distributed=False)
        for c, s in enumerate(tqdm(range(0, n, CHUNK), desc="streaming", leave=False)):
            X = gaussian_chunk(c, k, seed)[:n - s]
            t0 = time.perf_counter()
            st.add(X)
            seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        res = st.result(refetch=lambda rows: gaussian_rows(rows, k, seed))
        seconds += time.perf_counter() - t0
        return {"method": "exact", "settings": {}, "seconds": round(seconds, 4),
                "iterations": int(res.iterations), "stop_reason": res.stop_reason, "std": res.std,
                "max_minus_min": int(res.counts.max() - res.counts.min()), "refetched": res.refetched,
                "active": res.active, "peak_mib": round((_vm("VmHWM") - rss) / 1024, 1), "streamed": True}
    dev, method, settings = torch.device(spec["device"]), spec["method"], spec["settings"]
    O = (torch.load(spec["path"], weights_only=True) if spec["path"] else
         gaussian_rows(torch.arange(n), k, seed)).to(dev)
    if dev.type == "cuda":
        utils.measure_labeler(O[:65536], method, **settings)
        torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev) / 1024 if dev.type == "cuda" else _start_peak()
    rec = utils.measure_labeler(O, method, **settings)
    peak = torch.cuda.max_memory_allocated(dev) / 1024 if dev.type == "cuda" else _vm("VmHWM")
    again = utils.measure_labeler(O, method, **settings)
    if dev.type == "cpu" and any(again[f] != rec[f] for f in SAME):   # (GPU sums may differ)
        raise RuntimeError(f"{SAME}: the second call's {[again[f] for f in SAME]}, the first's "
                           f"{[rec[f] for f in SAME]}")
    return {**rec, "seconds_warm": again["seconds"], "peak_mib": round((peak - before) / 1024, 1),
            "streamed": False}


def in_child(spec):
    """measure(spec) in a fresh child process (on a GPU in this one); a failure is recorded as
    {"error": ...}, never replaced by numbers."""
    try:
        if spec["device"] != "cpu":
            return measure(spec)
        ctx = mp.get_context("forkserver")      # children that need not import torch again
        ctx.set_forkserver_preload(["torch"])
        with cf.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            return ex.submit(measure, spec).result()
    except cf.process.BrokenProcessPool:
        return {"error": "the child process died (killed for memory?)"}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if spec["device"] != "cpu":
            torch.cuda.empty_cache()


def real_inputs(args, skipped):
    """(input, k, (N, k) outputs) of random_net, trained_net and trained_backbone; in `skipped`,
    why not where the data or the checkpoint is missing."""
    try:
        d, manifest = utils.load_prepared(args.data), utils.load_manifest(args.data)
    except (FileNotFoundError, ValueError) as e:
        skipped["real"] = str(e)
        print(f"skipping the networks' outputs: {e}", flush=True)
        return
    images = (d["images"][d["train_idx"]] if args.real_split == "train" else
              torch.cat([d["images"], d["images"].flip(3)])[:args.n])
    feats = utils.random_net_features(images, manifest, args.net, args.seed, args.device, progress=True)
    for k in args.real_ks:
        yield "random_net", k, utils.fresh_head_outputs(feats, k, args.seed).cpu()
    if not os.path.isfile(args.checkpoint):
        skipped["trained_net"] = f"no checkpoint at {args.checkpoint}"
        print(f"skipping trained_net: {skipped['trained_net']}", flush=True)
        return
    model, ckpt = utils.load_checkpoint(args.checkpoint, args.device)

    def label_pass(head):   # (N, k) or (N, d): BatchNorm on batch statistics, as training's
        torch.manual_seed(args.seed)
        return otl.label_pass(model, images, int(ckpt["args"]["img_size"]), 256, args.device,
                              bn="batch", head=head, progress=True,
                              generator=torch.Generator().manual_seed(args.seed))[0]

    yield "trained_net", model.cfg.k, label_pass(True).cpu()
    if args.trained_ks:
        with torch.no_grad():
            feats = label_pass(False)
            feats = (feats if model.embedding is None else model.embedding(feats)).cpu()
        for k in args.trained_ks:
            yield "trained_backbone", k, utils.fresh_head_outputs(feats, k, args.seed)


def machine(threads):
    with open("/proc/cpuinfo") as fh:
        cpu = (re.findall(r"model name\s*:\s*(.*)", fh.read()) or [platform.processor()])[0]
    return {"cpu": cpu, "cores": os.cpu_count(),
            "threads": threads, "torch": torch.__version__, "python": platform.python_version(),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


HEAD = (f"{'input':<17}{'N':>10}{'k':>6}  {'method':<10}{'seconds':>9}{'warm':>8}{'iters':>7}"
        f"{'std':>9}{'floor':>7}{'max-min':>8}{'peak MiB':>10}  stop")


def line(r):
    """A record as a line of the table the run prints."""
    head = f"{r['input']:<17}{r['n']:>10,}{r['k']:>6}  {r['method']:<10}"
    if "error" in r:
        return head + f"FAILED: {r['error']}"
    return head + (f"{r['seconds']:>9.3f}{r.get('seconds_warm', float('nan')):>8.3f}"
                   f"{r['iterations']:>7}{r['std']:>9.3f}{r['std_floor']:>7.3f}{r['max_minus_min']:>8}"
                   f"{r['peak_mib']:>10.1f}  {r['stop_reason']}" + ("  streamed" if r["streamed"] else ""))


def main(args):
    check_args(args)
    utils.print_run_header(args)
    threads = len(os.sched_getaffinity(0))      # torch on every core this process may use
    torch.set_num_threads(threads)
    sha = [utils.sha256_file(f) for f in (otl.__file__, otl_scale.__file__)]
    out = {"machine": machine(threads), "command": utils.command_line(),
           "git_commit": utils.git_commit(), "labelers_sha256": sha, "args": vars(args),
           "skipped": {}, "records": []}
    print(HEAD, flush=True)

    def run(name, n, k, path=None, methods=args.methods, stream=False):
        for m in methods:
            spec = dict(method=m, settings=PUBLISHED[args.published] if m == "published" else {},
                        n=n, k=k, seed=args.seed, path=path, threads=threads, stream=stream,
                        device=args.device, sha256=sha)
            f = (n % k) / k
            rec = {"input": name, "n": n, "k": k, "method": m, "std_floor": (f * (1 - f)) ** 0.5,
                   **in_child(spec)}
            out["records"].append(rec)
            utils.write_json(out, args.out)
            print(line(rec), flush=True)

    for k in args.ks:
        run("gaussian", args.n, k)
    if args.skip_real:
        out["skipped"]["real"] = "--skip-real"
    else:
        with tempfile.TemporaryDirectory(prefix="labeler_bench_") as tmp:
            where = args.save_inputs or tmp
            os.makedirs(where, exist_ok=True)
            for name, k, O in real_inputs(args, out["skipped"]):
                path = os.path.join(where, f"{name}_{k}.pt")    # loaded by each child
                torch.save(O.contiguous(), path)
                run(name, O.shape[0], k, path)
    if args.skip_large:
        out["skipped"]["gaussian_large"] = "--skip-large"
    else:
        run("gaussian_large", args.large_n, args.large_k, stream=args.device == "cpu",
            methods=[m for m in args.methods if m == "exact"])
        run("gaussian_large", args.ref_n, args.large_k)
    utils.write_json(out, args.out)
    print(f"results: {args.out}", flush=True)
    failed = [r for r in out["records"] if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(out['records'])} measurements failed (see {args.out})")
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
