"""A/B of two otl.py versions' exact labeler on one GPU, the same inputs, calls alternating.

The script that made this session's labeler_ab_s3_head_gpu.json (and, with SIZES, results/
labeler_extract_v27.json), kept as run; compare_labelers.py at the top of the repository is the
maintained comparison (bit-for-bit checks, more inputs, --device cuda): use that one.

    python .gpu/ab/ab.py OUT.json name=path.py [name=path.py ...]

Inputs: Gaussian 1.28M x 3000, 64,000 x 3000 and 50,000 x 1000 (torch.randn on the GPU, seed 0;
SIZES=640000x3000,... others; on a machine without CUDA, on the CPU: 5,000 x 300 unless SIZES)
and every saved (N, k) float32 output in PT (a glob, default .gpu/ab/*.pt; PT= none), moved
to the device.  Each version: one
warm-up call, then `REPS` calls, versions alternating; the published rules once warm on the
.pt inputs (the first version's module) for reference.
"""
import glob, importlib.util, json, os, statistics, sys, time

import torch

REPS = int(os.environ.get("REPS", 3))


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, X):
    sync()
    t = time.perf_counter()
    r = fn(X)
    sync()
    dt = time.perf_counter() - t
    c = torch.bincount(r.labels.to(X.device), minlength=X.shape[1])
    return dt, r.iterations, int(c.max() - c.min()), r.stop_reason


def main():
    out = sys.argv[1]
    versions = [(a.split("=")[0], load("otl_" + a.split("=")[0], a.split("=")[1]))
                for a in sys.argv[2:]]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = []
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = ((1_280_000, 3000), (64_000, 3000), (50_000, 1000)) if dev.type == "cuda" else ((5000, 300),)
    if os.environ.get("SIZES"):
        sizes = [tuple(int(v) for v in s.split("x")) for s in os.environ["SIZES"].split(",")]
    for n, k in sizes:
        inputs.append((f"gaussian_{n}x{k}", lambda n=n, k=k: torch.randn(n, k, device=dev,
                                                                       generator=g)))
    pattern = os.environ.get("PT", os.path.join(os.path.dirname(__file__), "*.pt"))
    for p in sorted(glob.glob(pattern)) if pattern else []:
        inputs.append((os.path.basename(p)[:-3],
                       lambda p=p: torch.load(p, weights_only=True).to(dev, torch.float32)))
    rec = {"command": " ".join(["python"] + sys.argv), "sizes": os.environ.get("SIZES"),
           "threads": torch.get_num_threads(), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "reps": REPS, "versions": [v for v, _ in versions], "inputs": {}}
    for name, make in inputs:
        X = make()
        row = {"shape": list(X.shape)}
        for v, mod in versions:     # warm-up
            timed(lambda X, mod=mod: mod.translate(X, method="exact"), X)
        runs = {v: [] for v, _ in versions}
        for _ in range(REPS):
            for v, mod in versions:
                runs[v].append(timed(lambda X, mod=mod: mod.translate(X, method="exact"), X))
        for v, _ in versions:
            ts = [r[0] for r in runs[v]]
            row[v] = {"seconds": ts, "median": statistics.median(ts),
                      "iterations": runs[v][0][1], "max_minus_min": runs[v][0][2],
                      "stop": runs[v][0][3]}
        if not name.startswith("gaussian"):
            mod = versions[0][1]
            f = lambda X: mod.translate(X, method="published")
            timed(f, X)
            ts = [timed(f, X) for _ in range(REPS)]
            row["published"] = {"seconds": [t[0] for t in ts],
                                "median": statistics.median(t[0] for t in ts),
                                "iterations": ts[0][1], "max_minus_min": ts[0][2]}
        rec["inputs"][name] = row
        print(name, tuple(X.shape), "  ".join(
            f"{v} {row[v]['median']:.4f} s ({row[v]['iterations']} it, {row[v]['max_minus_min']})"
            for v in [v for v, _ in versions] + (["published"] if "published" in row else [])),
            flush=True)
        del X
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
