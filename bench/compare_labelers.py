"""Two versions of the exact labeler on the same inputs: do they give the same labels and T to
the bit, and which is faster?  Run it before committing a change to the labeler (on real outputs
alone a slowdown on other inputs can pass unseen).

    python bench/compare_labelers.py HEAD otl_scale.py              # the last commit against the tree
    python bench/compare_labelers.py HEAD~5 otl_scale.py --inputs large   # at 320,000 x 3000
    python bench/compare_labelers.py HEAD otl_scale.py --pt 'saved/*.pt' --expect-same
    python bench/compare_labelers.py f95442e otl_scale.py --inputs none --views runs/eurosat/checkpoint.pth

A and B, each called as translate(O, method="exact"): a path to an otl_scale.py (with the otl.py
beside it) or to an otl.py (an older one held the tuned labeler; today's is the reference), or a
git revision (its otl_scale.py and otl.py, or its otl.py alone).
Input sets (--inputs, comma-separated; default small,stream):
  small   Gaussian with a drift across columns, k = 2 - 100, N = 600 - 20,000 (the dense path)
  stream  k = 200 - 3000 (the streaming path): Gaussian with and without a drift, identical rows,
          half of the rows one identical row, 10 tight groups, a few dominant columns
  large   Gaussian --large-n x --large-k (320,000 x 3000)
  --pt    saved (N, k) outputs (bench_labeler.py --save-inputs), each whole and as four subsets
          (--whole-only: whole); a saved (V, N, k) stack is one case of V views, as --views
  --views a checkpoint's label pass over --data's training split, two augmented views labelled
          as train_otl.py labels them: the first from the column medians, the second from the
          first's T (what a training epoch's label call costs)
Each case: a call of each version (the results compared), then --reps calls alternating A, B
(the median time).  B's results are checked: counts within 1 of the target, labels argmax(O - T)
outside the tie-break's size (`valid`).  Labels and T are compared apart: where N / k is not
whole, which clusters take the extra rows is not unique (labels may differ, both valid).
A line a case, a summary, and --out JSON (written after every case); with --expect-same the
exit status is 1 when any case differs or B is invalid.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import glob
import importlib.util
import statistics
import subprocess
import tempfile
import time

import torch

import utils

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(spec, name, tmp):
    """The labeler module at `spec` (see the docstring's A and B), copied under tmp/name."""
    if os.path.isfile(spec):
        files = {os.path.basename(spec): open(spec).read()}
        if "otl_scale.py" in files:
            files["otl.py"] = open(os.path.join(os.path.dirname(os.path.abspath(spec)), "otl.py")).read()
    else:
        shown = {f: subprocess.run(["git", "show", f"{spec}:{f}"], capture_output=True, text=True,
                                   cwd=HERE) for f in ("otl.py", "otl_scale.py")}
        files = {f: r.stdout for f, r in shown.items() if r.returncode == 0}
        if "otl.py" not in files:
            raise SystemExit(f"{spec!r} is neither a file nor a git revision with an otl.py; give "
                             "a path to an otl_scale.py (or an older otl.py) or a commit")
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    for f, text in files.items():
        with open(os.path.join(d, f if f == "otl_scale.py" else "otl.py"), "w") as fh:
            fh.write(text)
    base = _load_file(os.path.join(d, "otl.py"), f"otl_{name}")
    if "otl_scale.py" not in files:
        return base
    saved, sys.modules["otl"] = sys.modules.get("otl"), base     # its otl_scale imports its otl
    try:
        return _load_file(os.path.join(d, "otl_scale.py"), f"otl_scale_{name}")
    finally:
        if saved is None:
            del sys.modules["otl"]
        else:
            sys.modules["otl"] = saved


def cases(which, args):
    """(name, outputs) pairs of the chosen sets, made from fixed seeds."""
    if "small" in which:
        g = torch.Generator().manual_seed(0)
        for k in (2, 5, 10, 20, 37, 64, 100):
            for n in (600, 5000, 20000):
                yield f"drift_{n}x{k}", torch.randn(n, k, generator=g) + torch.linspace(0, 2, k)
    if "stream" in which:
        g = torch.Generator().manual_seed(1)
        for k, n in ((200, 20000), (500, 20000), (1000, 30000), (3000, 30000), (257, 9000),
                     (1000, 3000)):
            yield f"gauss_{n}x{k}", torch.randn(n, k, generator=g)
            yield f"drift_{n}x{k}", torch.randn(n, k, generator=g) + torch.linspace(0, 3, k)
        for k, n in ((300, 6000), (1000, 20000)):
            yield f"identical_{n}x{k}", torch.randn(1, k, generator=g).expand(n, k).contiguous()
        for k, n in ((200, 4000), (300, 3000)):
            half = torch.randn(1, k, generator=g).expand(n // 2, k)
            rest = torch.randn(n - n // 2, k, generator=g)
            yield f"half_{n}x{k}", torch.cat([half, rest])[torch.randperm(n, generator=g)].contiguous()
        base = torch.randn(10, 300, generator=g)
        yield "groups10_6000x300", (base[torch.arange(6000) % 10]
                                    + 0.01 * torch.randn(6000, 300, generator=g)).contiguous()
        X = torch.randn(20000, 1000, generator=g) * 0.1
        X[:, :5] += 3.0
        yield "dominant_20000x1000", X
    if "large" in which:
        g = torch.Generator().manual_seed(2)
        yield (f"gauss_{args.large_n}x{args.large_k}",
               torch.randn(args.large_n, args.large_k, generator=g))
    if args.views:
        yield f"views:{os.path.basename(os.path.dirname(os.path.abspath(args.views)))}", \
            views_of(args.views, args.data, args.seed)
    for p in sorted(glob.glob(args.pt)) if args.pt else []:
        X = torch.load(p, weights_only=True)
        if X.dim() == 3:
            yield os.path.basename(p), X
            continue
        if X.dim() != 2:
            print(f"skipped {p}: not an (N, k) or (V, N, k) tensor", file=sys.stderr)
            continue
        n, name = X.shape[0], os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))),
                                           os.path.basename(p))     # (folder/file: names repeat)
        yield name, X
        for tag, sub in (() if args.whole_only else (
                ("[:80%]", X[:int(0.8 * n)]), ("[n/3:]", X[n // 3:]), ("[::2]", X[::2]),
                ("[:-777]", X[:-777]))):
            if sub.shape[0] > 0:
                yield name + tag, sub


def views_of(checkpoint, data, seed):
    """(2, N, k) outputs of the checkpoint's network on the data's training split: two augmented
    views, as train_otl.py's label pass makes them (BatchNorm on batch statistics)."""
    import otl
    model, ckpt = utils.load_checkpoint(checkpoint, "cpu")
    a = ckpt["args"]
    d = utils.load_prepared(data)
    torch.manual_seed(seed)
    return otl.label_pass(model, d["images"][d["train_idx"]], int(a["img_size"]),
                          batch_size=int(a["label_batch_size"]), device="cpu", bn=a["label_bn"],
                          views=2, **utils.augment_options(a), progress=False,
                          generator=torch.Generator().manual_seed(seed)).contiguous()


def call(mod, X):
    """(seconds, results): one call on (N, k) outputs; on a (V, N, k) stack, view 0 from the
    medians and each other view from view 0's T, with make_labels' seeds and settings."""
    tuned = hasattr(mod, "StreamingTranslator")       # (otl.py's reference takes no seed)
    kw = (lambda v: dict(seed=1 + v, n_init=8192) if tuned else {})
    t = time.perf_counter()
    if X.dim() == 2:
        res = [mod.translate(X, method="exact")]
    else:
        res = [mod.translate(X[0], method="exact", **kw(0))]
        res += [mod.translate(X[v], method="exact", start=res[0].T, **kw(v))
                for v in range(1, X.shape[0])]
    return time.perf_counter() - t, res


def valid(X, r, tie_eps=2.0 ** -26):
    """Counts within 1 of the target, and labels argmax(O - T) outside the tie-break's size."""
    lo, hi = (r.target + 1e-9).floor(), (r.target - 1e-9).ceil()
    c = r.counts.cpu().double()
    S = X.double().cpu() - r.T.cpu()
    own = S.gather(1, r.labels.cpu()[:, None])[:, 0]
    eps = tie_eps * float(X[:8192].abs().max()) * 2
    return bool(((c >= lo) & (c <= hi)).all()) and bool((S.max(1).values - own <= eps).all())


def compare(name, X, A, B, reps):
    """One case's record: A's and B's results compared, B's checked, --reps times of each."""
    _, RA = call(A, X)
    _, RB = call(B, X)
    same = {f: all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()) for a, b in zip(RA, RB))
            for f in ("labels", "T", "counts")}
    ra, rb = RA[-1], RB[-1]
    ta, tb = [], []
    for _ in range(reps):
        ta.append(call(A, X)[0])
        tb.append(call(B, X)[0])
    row = {"case": name, "shape": list(X.shape), "same": all(same.values()),
           "labels_same": same["labels"], "T_same": same["T"],
           "valid_b": all(valid(X if X.dim() == 2 else X[v], r) for v, r in enumerate(RB)),
           "seconds_a": ta, "seconds_b": tb, "iterations_a": sum(r.iterations for r in RA),
           "iterations_b": sum(r.iterations for r in RB),
           "max_minus_min_a": int(ra.counts.max() - ra.counts.min()),
           "max_minus_min_b": int(rb.counts.max() - rb.counts.min())}
    if not row["same"]:
        row["labels_differ"] = int((ra.labels.cpu() != rb.labels.cpu()).sum())
        row["T_max_abs_diff"] = float((ra.T.cpu() - rb.T.cpu()).abs().max())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("a", help="version A: a path to an otl_scale.py or otl.py, or a git revision")
    p.add_argument("b", help="version B: likewise")
    p.add_argument("--inputs", default="small,stream",
                   help="input sets, comma-separated: small, stream, large, none (default small,stream)")
    p.add_argument("--pt", help="a glob of saved (N, k) outputs to compare on as well")
    p.add_argument("--views", metavar="CHECKPOINT", help="a trained network: its two augmented "
                   "views of --data's training split, labelled as a training epoch labels them")
    p.add_argument("--data", default="data/eurosat", help="prepared data for --views (data/eurosat)")
    p.add_argument("--seed", type=int, default=0, help="seeds --views' augmentation (0)")
    p.add_argument("--whole-only", action="store_true",
                   help="the saved outputs whole only, not also as four subsets")
    p.add_argument("--reps", type=int, default=1, help="timed calls of each version a case (default 1)")
    p.add_argument("--large-n", type=int, default=320_000, help="rows of the large set (320,000)")
    p.add_argument("--large-k", type=int, default=3000, help="columns of the large set (3000)")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--expect-same", action="store_true",
                   help="exit with status 1 if any case gives other labels, T or counts, or B is invalid")
    args = p.parse_args(argv)
    which = {w.strip() for w in args.inputs.split(",")} - {"", "none"}
    if which - {"small", "stream", "large"}:
        p.error(f"unknown input set(s) {sorted(which - {'small', 'stream', 'large'})}: choose "
                "from small, stream, large, none")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    rec = {"command": " ".join(["python", "bench/compare_labelers.py"] + (argv or sys.argv[1:])),
           "a": args.a, "b": args.b, "threads": torch.get_num_threads(), "cases": []}
    print(f"{'case':32s} {'same':5s} {'A s':>8s} {'B s':>8s} {'B/A':>5s}  iterations A / B")
    with tempfile.TemporaryDirectory() as tmp:
        A, B = load(args.a, "A", tmp), load(args.b, "B", tmp)
        for name, X in cases(which, args):
            row = compare(name, X, A, B, args.reps)
            rec["cases"].append(row)
            if args.out:        # after every case: a long comparison cut short keeps what it did
                utils.write_json(rec, args.out)
            ma, mb = statistics.median(row["seconds_a"]), statistics.median(row["seconds_b"])
            flag = "yes" if row["same"] else ("lab" if row["labels_same"] else "NO")
            print(f"{name:32s} {flag:5s} {ma:8.3f} {mb:8.3f} {mb / ma:5.2f}  {row['iterations_a']} / "
                  f"{row['iterations_b']}{'' if row['valid_b'] else '  B INVALID'}", flush=True)
    cs = rec["cases"]
    differ, invalid = sum(not c["same"] for c in cs), sum(not c["valid_b"] for c in cs)
    if cs:
        ratios = [statistics.median(c["seconds_b"]) / statistics.median(c["seconds_a"]) for c in cs]
        rec["summary"] = {"cases": len(cs), "differ": differ, "invalid_b": invalid,
                          "labels_differ": sum(not c["labels_same"] for c in cs),
                          "b_over_a_median": statistics.median(ratios), "b_over_a_max": max(ratios)}
        print(f"{len(cs)} cases, {differ} differ ({rec['summary']['labels_differ']} in labels), "
              f"{invalid} invalid in B; B / A time: median {statistics.median(ratios):.2f}, "
              f"largest {max(ratios):.2f}")
    else:
        print("no cases: choose --inputs or --pt")
    if args.out:
        utils.write_json(rec, args.out)
    return 1 if args.expect_same and (differ or invalid) else 0


if __name__ == "__main__":
    sys.exit(main())
