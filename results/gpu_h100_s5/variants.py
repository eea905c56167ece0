"""GPU session 5, call 3: ours with and without the sample start (and a sample of every 8th
row) on the training split's real outputs at k = 500 - 3000, beside the published rules."""
import json, os, statistics, sys, time
import torch
import otl, utils

dev = torch.device("cuda")
F = ".gpu/feat_eu_train"
feats = {n: torch.load(f"{F}/{n}_features.pt", weights_only=True) for n in ("random_net", "trained_backbone")}
orig = otl.sample_start_T
def every8(*a, **kw):
    kw["every"] = 8
    return orig(*a, **kw)
variants = {"default": {}, "no_sample": {"sample_start": False}, "every8": "every8"}
out = []
def timed(X, v):
    otl.sample_start_T = every8 if v == "every8" else orig
    kw = variants.get(v) if isinstance(variants.get(v), dict) else {}
    torch.cuda.synchronize(); t = time.perf_counter()
    r = otl.translate(X, **kw) if v != "published" else otl.translate(X, method="published")
    torch.cuda.synchronize()
    c = r.counts
    return time.perf_counter() - t, int(c.max() - c.min())
for k in (500, 1000, 3000):
    for name, f in feats.items():
        X = utils.fresh_head_outputs(f, k, 0).to(dev).contiguous()
        names = list(variants) + ["published"]
        for v in names:
            timed(X, v)           # warm-up
        times = {v: [] for v in names}
        mm = {}
        for _ in range(3):
            for v in names:
                t, m = timed(X, v)
                times[v].append(round(t, 4)); mm[v] = m
        row = {"input": name, "k": k, "n": X.shape[0],
               **{v: {"median_s": statistics.median(times[v]), "all_s": times[v], "max_minus_min": mm[v]} for v in names}}
        out.append(row)
        print(name, k, " ".join(f"{v} {statistics.median(times[v]):.3f} ({mm[v]})" for v in names), flush=True)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "labeler_sample_start_gpu.json"), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "otl_sha256": utils.sha256_file("otl.py"),
                       "command": "python3 .gpu/variants.py (results/gpu_h100_s5/variants.py)",
                       "rows": out}, fh, indent=1)
