"""Training and label-pass throughput of OTL against a plain supervised ResNet-18 loop (the ceiling).

    python bench/bench_train.py --device cuda --sizes 224,112 --out results/train_throughput_gpu.json
    python bench/bench_train.py --device cpu --sizes 32,64 --width 32 --batch-size 256 --amp both \\
        --only otl_train,label_pass,features --out results/train_throughput_cpu_bf16.json

For each image side, on the same random uint8 images of EuroSAT's 64 px resident on the device:
  otl_train    train_otl.train_one_epoch as the trainer runs it: batched strong augmentation of
               --views views, bf16 autocast on CUDA, channels_last, fused SGD, LCT loss
  label_pass   otl.label_pass: 2 strong views per image, inference mode, batch statistics
  features     otl.extract_features: the test-time view, eval mode (the kNN monitor, evaluation)
  augment      otl.augment alone (strong, the views of one training step)
  per_image    what it replaces: torchvision's usual strong pipeline (RandAugment, crop, flips,
               colour jitter, erasing) image by image on the CPU, as a DataLoader worker runs it
  supervised   the ceiling: torchvision's ResNet-18, a random crop and flip on the device, the same
               autocast, channels_last and fused SGD, plain cross-entropy
Figures are views (network inputs) per second, timed after --warmup steps, the device synchronised
before the clock is read.  --amp both measures the OTL figures in float32 and under bf16 autocast
(<figure>_fp32, <figure>_bf16 and their ratio): what train_otl.py --amp chooses between.  The
last lines are a table; the JSON holds every figure.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import platform
import time

import torch
import torch.nn.functional as F

import otl
import train_otl
import utils


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--sizes", default="224,112", help="comma list of image sides")
    p.add_argument("--batch-size", type=int, default=512, help="images per training step")
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--label-batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="timed training steps per figure")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--width", type=int, default=64, help="ResNet-18's first-stage width (64: "
                   "torchvision's; the cpu preset's: 32)")
    p.add_argument("--amp", default="auto", choices=["auto", "true", "false", "both"],
                   help="bf16 autocast of the OTL figures: auto (train_otl.py's choice for the "
                   "device), true, false, or both (each figure twice, and their ratio)")
    p.add_argument("--repeats", type=int, default=1, help="times each OTL figure is measured, "
                   "float32 and bf16 in turn; the best is kept, all are recorded (3 on a busy "
                   "machine)")
    p.add_argument("--only", default="otl_train,label_pass,features,augment,per_image,supervised",
                   help="comma list of the figures to measure")
    p.add_argument("--out", default=None, help="results JSON")
    return p


def per_s(step, views, warmup, steps, device):
    """Views per second of step() run warmup untimed, then steps timed times (views each)."""
    for i in range(warmup + steps):
        if i == warmup:
            utils.synchronize(device)
            t = time.perf_counter()
        step()
    utils.synchronize(device)
    return {"views_per_s": round(steps * views / (time.perf_counter() - t), 1)}


def otl_train(a, images, size, device, amp=None):
    args = train_otl.resolve_args(train_otl.get_args_parser().parse_args(
        ["--data", "-", "--output", "-", "--preset", "paper", "--img-size", str(size),
         "--batch-size", str(a.batch_size), "--views", str(a.views), "--label-views",
         str(a.views), "--cutout", str(max(1, 16 * size // 224)), "--no-progress", "--epochs", "1",
         "--width", str(a.width)] + ([] if amp is None else ["--amp", str(amp).lower()])), device)
    model = otl.build_model(otl.ModelConfig(k=128, width=a.width)).to(device).to(
        memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          fused=True if device.type == "cuda" else None)
    ranks, gen = utils.Ranks(str(device)), torch.Generator().manual_seed(0)
    n_warm, n = a.batch_size * a.warmup, a.batch_size * a.steps
    labels = torch.randint(0, 128, (a.views, images.shape[0]), device=device)
    t = time.perf_counter()
    train_otl.train_one_epoch(model, opt, images[:n_warm], labels[:, :n_warm], 0, args, device, gen,
                              ranks, n_warm)
    first = time.perf_counter() - t
    row = train_otl.train_one_epoch(model, opt, images[:n], labels[:, :n], 0, args, device, gen,
                                    ranks, n)
    return {"views_per_s": row["img_per_s"], "warmup_s": round(first, 1)}, model


def passes(a, only, model, images, size, device, amp=None):
    """label_pass and features: one batch first (untimed), then a quarter of --steps' batches."""
    n = min(images.shape[0], a.label_batch_size * max(a.steps // 4, 2))
    out = {}
    for name, views, run in (
            ("label_pass", a.views, lambda x: otl.label_pass(
                model, x, size, a.label_batch_size, device, views=a.views, strong=True,
                progress=False, amp=amp)),
            ("features", 1, lambda x: otl.extract_features(
                model, x, size, a.label_batch_size, device, progress=False, amp=amp))):
        if name in only:
            x = iter((images[:a.label_batch_size], images[:n]))
            out[name] = per_s(lambda: run(next(x)), n * views, 1, 1, device)
    return out


def per_image(a, images, size, device):
    """torchvision's per-image strong pipeline on one batch, the views moved to the device."""
    from torchvision.transforms import v2 as T
    pipe = T.Compose([T.RandAugment(num_ops=2), T.RandomResizedCrop(size, scale=(0.25, 1.0)),
                      T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.ColorJitter(0.3, 0.3, 0.4),
                      T.ToDtype(torch.float32, scale=True),
                      T.RandomErasing(p=1.0, scale=(0.2, 0.3), ratio=(1, 1), value=0.5)])
    x = images[:a.batch_size].cpu()
    return per_s(lambda: torch.stack([pipe(im) for im in x]).to(device), len(x), 1, 3, device)


def supervised(a, images, size, device):
    import torchvision
    model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          fused=True if device.type == "cuda" else None)
    y = torch.randint(0, 10, (images.shape[0],), device=device)
    b = a.batch_size * a.views      # as many network inputs per step as the OTL step
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1)

    def step():
        idx = torch.randint(0, images.shape[0], (b,), device=device)
        x = images[idx].float().div_(255)
        x = F.interpolate(x, size=(size + size // 8,) * 2, mode="bilinear", align_corners=False)
        o = torch.randint(0, size // 8 + 1, (2,)).tolist()
        x = x[:, :, o[0]:o[0] + size, o[1]:o[1] + size]
        x = torch.where(torch.rand(b, 1, 1, 1, device=device) < 0.5, x, x.flip(3))
        x = ((x - mean) / 0.25).contiguous(memory_format=torch.channels_last)
        with otl.autocast(device):
            loss = F.cross_entropy(model(x).float(), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return per_s(step, b, a.warmup, a.steps, device)


def main(a):
    device = utils.pick_device(a.device)
    torch.backends.cudnn.benchmark = True       # as train_otl.py: fixed shapes, fastest kernels
    torch.manual_seed(0)
    need = a.batch_size * max(a.steps, a.warmup)
    images = torch.randint(0, 256, (max(21600, need), 3, 64, 64), dtype=torch.uint8).to(device)
    out = {"machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else platform.processor() or platform.machine(),
                       "torch": torch.__version__, "threads": torch.get_num_threads()},
           "command": utils.command_line(), "git_commit": utils.git_commit(), "args": vars(a),
           "unit": "views (network inputs) per second", "sizes": {}}
    only = set(a.only.split(","))
    amps = {"auto": [None], "true": [True], "false": [False], "both": [False, True]}[a.amp]
    out["amp"] = {"asked": a.amp, "auto_takes": utils.resolve_amp(None, device)}
    for size in [int(s) for s in a.sizes.split(",")]:
        r = {}
        # float32, then bf16, --repeats times in turn, each figure its best: other work on the
        # machine only slows a trial, so the fastest is the nearest to the machine's own speed
        for _, amp in ((i, amp) for i in range(a.repeats) for amp in amps):
            sfx = "" if len(amps) == 1 else "_bf16" if amp else "_fp32"
            got, model = otl_train(a, images, size, device, amp=amp)
            for f, v in {"otl_train": got, **passes(a, only, model, images, size, device, amp)}.items():
                best = r.get(f + sfx, {"views_per_s": 0, "trials": []})
                r[f + sfx] = {**v, "views_per_s": max(best["views_per_s"], v["views_per_s"]),
                              "trials": best["trials"] + [v["views_per_s"]]}
        for f in ("otl_train", "label_pass", "features"):
            if len(amps) > 1 and f + "_fp32" in r:
                r[f + "_bf16_over_fp32"] = round(r[f + "_bf16"]["views_per_s"] /
                                                 r[f + "_fp32"]["views_per_s"], 3)
        if "augment" in only:
            x, cut = images[:a.batch_size], max(1, 16 * size // 224)
            r["augment"] = per_s(lambda: [otl.augment(x, size, strong=True, cutout=cut)
                                          for _ in range(a.views)], a.views * a.batch_size,
                                 a.warmup, a.steps, device)
        if "per_image" in only:
            r["per_image"] = per_image(a, images, size, device)
        if "supervised" in only:
            r["supervised"] = supervised(a, images, size, device)
        if "supervised" in r and "otl_train" in r:
            r["otl_over_supervised"] = round(r["otl_train"]["views_per_s"]
                                             / r["supervised"]["views_per_s"], 3)
        out["sizes"][str(size)] = r
        print(size, r, flush=True)
        if a.out:
            utils.write_json(out, a.out)
    names = [n for n, v in next(iter(out["sizes"].values())).items() if isinstance(v, dict)]
    print(f"{'size':>5} " + " ".join(f"{n:>16}" for n in names))
    for size, r in out["sizes"].items():
        print(f"{size:>5} " + " ".join(f"{r[n]['views_per_s']:>16.0f}" for n in names))
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
