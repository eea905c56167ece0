"""Where the exact labeler's time goes on one input: wall time per otl function (cProfile: on a
GPU a function's time includes its waits for the device) and per device kernel (torch.profiler).

    python profile_labeler.py --device cuda --n 1280000 --k 3000 --out results/labeler_profile_gpu.txt
    python profile_labeler.py --checkpoint runs/eurosat/checkpoint.pth --out prof.txt

The input is bench_labeler's gaussian (the same seeds), or with --checkpoint the outputs that
training hands the labeler: a label pass of that network over its training split (one strong
view, BatchNorm on batch statistics, as train_otl.py), through its own head or, with --head-k, a
fresh K-way head on its features.  --method published profiles the published rules instead.
One warm-up call, --repeat timed calls (their median is printed), then one profiled call.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import bench_labeler
import otl
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


def main(a):
    dev = utils.pick_device(a.device)
    if a.checkpoint:
        O = network_outputs(a, dev)
        what = f"label-pass outputs of {a.checkpoint}" + (f", fresh {a.head_k}-way head" if a.head_k else "")
    else:
        O = bench_labeler.gaussian(a.n, a.k, a.seed, device=str(dev) if dev.type == "cuda" else "cpu")
        what = "gaussian"
    n, k = O.shape

    def call():
        return otl.translate(O, method=a.method)
    otl.translate(O[:65536], method=a.method)
    times = []
    for _ in range(a.repeat):
        utils.synchronize(dev)
        t = time.perf_counter()
        res = call()
        utils.synchronize(dev)
        times.append(time.perf_counter() - t)
    counts = torch.bincount(res.labels, minlength=k)
    lines = [f"commit {utils.git_commit()}  device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
             f"  N {n}  k {k}  input: {what}  method {a.method}",
             f"seconds {sorted(times)[len(times) // 2]:.4f} (median of {[round(t, 4) for t in times]})"
             f"  iterations {res.iterations}  max-min {int(counts.max() - counts.min())}"
             f"  stop {res.stop_reason}"]
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
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
