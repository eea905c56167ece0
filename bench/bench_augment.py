"""Batched uint8 augmentation (otl.augment) against torchvision's per-image transforms.

    python bench/bench_augment.py --out results/augment_bench.json

Times both on the same 256 EuroSAT-sized images (64 px uint8) producing 32 px views, simple and
strong, on the chosen device; writes images/s for each.  The per-image pipeline is the usual
torchvision one: RandomResizedCrop, flips, ColorJitter (+ RandAugment and RandomErasing for
strong), applied image by image as a DataLoader worker would.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import platform
import time

import torch

import otl
import utils


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=32, help="output side (the cpu preset's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p


def per_image_pipeline(size, strong):
    from torchvision.transforms import v2 as T
    ops = [T.RandomResizedCrop(size, scale=(0.25, 1.0), antialias=True), T.RandomHorizontalFlip(),
           T.RandomVerticalFlip(), T.ColorJitter(0.3, 0.3, 0.4)]
    if strong:
        ops.insert(0, T.RandAugment(num_ops=2))
    ops.append(T.ToDtype(torch.float32, scale=True))
    if strong:
        ops.append(T.RandomErasing(p=1.0, scale=(0.2, 0.3), ratio=(1, 1), value=0.5))
    return T.Compose(ops)


def timeit(fn, repeats, device):
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main(args):
    device = utils.pick_device(args.device)
    x = torch.randint(0, 256, (args.batch, 3, 64, 64), dtype=torch.uint8)
    xd = x.to(device)
    rows = {}
    for strong in (False, True):
        name = "strong" if strong else "simple"
        pipe = per_image_pipeline(args.size, strong)
        t_img = timeit(lambda: torch.stack([pipe(im) for im in x]).to(device), args.repeats, device)
        t_batch = timeit(lambda: otl.augment(xd, args.size, strong), args.repeats, device)
        rows[name] = {"per_image_img_per_s": round(args.batch / t_img, 1),
                      "batched_img_per_s": round(args.batch / t_batch, 1),
                      "speedup": round(t_img / t_batch, 2)}
        print(name, rows[name], flush=True)
    out = {"device": str(device), "torch_threads": torch.get_num_threads(), "batch": args.batch,
           "size": args.size, "results": rows, "machine": platform.platform(),
           "cpus": os.cpu_count(), "command": "python bench/bench_augment.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
