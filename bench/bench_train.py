"""Training and label-pass throughput of OTL against a plain supervised ResNet-18 loop (the ceiling).

    python bench/bench_train.py --device cuda --sizes 224,112 --out results/train_throughput_gpu.json
    python bench/bench_train.py --device cpu --sizes 32,64 --width 32 --batch-size 256 --amp both \
        --only otl_train,label_pass,features --out results/train_throughput_cpu_bf16.json

For each image side, on the same uint8 images resident on the device (EuroSAT's 64 px, random
unless --data names prepared data):
  otl_train    train_otl.train_one_epoch as the trainer runs it: batched strong augmentation of
               --views views, bf16 autocast on CUDA, channels_last, fused SGD, LCT loss
  label_pass   otl.label_pass: 2 strong views per image, inference mode, batch statistics
  features     otl.extract_features: the test-time view, eval mode (the kNN monitor, evaluation)
  augment      otl.augment alone (strong, the views of one training step)
  supervised   the ceiling: torchvision's ResNet-18, a random crop and flip on the device, the same
               autocast, channels_last and fused SGD, plain cross-entropy
  otl_compiled (--compile) otl_train with torch.compile(model)
Figures are views (network inputs) per second, timed after --warmup steps, the device synchronised
before the clock is read.  --amp both measures the OTL figures in float32 and under bf16 autocast
(<figure>_fp32, <figure>_bf16 and their ratio): what train_otl.py --amp chooses between.  The
last line is a table; the JSON holds every figure.
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
    p.add_argument("--data", default=None, help="prepared data folder; default random uint8 images")
    p.add_argument("--compile", default="", help="comma list of the sizes at which to time "
                   "torch.compile(model) too (each compile takes a minute or so)")
    p.add_argument("--width", type=int, default=64, help="ResNet-18's first-stage width (64: "
                   "torchvision's; the cpu preset's: 32)")
    p.add_argument("--amp", default="auto", choices=["auto", "true", "false", "both"],
                   help="bf16 autocast of the OTL figures: auto (train_otl.py's choice for the "
                   "device), true, false, or both (each figure twice, and their ratio)")
    p.add_argument("--repeats", type=int, default=1, help="times each OTL figure is measured, "
                   "float32 and bf16 in turn; the best is kept, all are recorded (3 on a busy "
                   "machine)")
    p.add_argument("--only", default="otl_train,label_pass,features,augment,supervised",
                   help="comma list of the figures to measure")
    p.add_argument("--out", default=None, help="results JSON")
    return p


def _trainer_args(a, size, device, amp=None):
    args = train_otl.get_args_parser().parse_args(
        ["--data", "-", "--output", "-", "--preset", "paper", "--img-size", str(size),
         "--batch-size", str(a.batch_size), "--views", str(a.views), "--label-views",
         str(a.views), "--cutout", str(max(1, 16 * size // 224)), "--no-progress", "--epochs", "1",
         "--width", str(a.width)] + ([] if amp is None else ["--amp", str(amp).lower()]))
    return train_otl.resolve_args(args, device)


def otl_train(a, images, size, device, compile_=False, amp=None):
    args = _trainer_args(a, size, device, amp)
    model = otl.build_model(otl.ModelConfig(k=128, width=a.width)).to(device).to(
        memory_format=torch.channels_last)
    net = torch.compile(model) if compile_ else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          fused=True if device.type == "cuda" else None)
    ranks, gen = utils.Ranks(str(device)), torch.Generator().manual_seed(0)
    n_warm, n = a.batch_size * a.warmup, a.batch_size * a.steps
    labels = torch.randint(0, 128, (a.views, images.shape[0]), device=device)
    t = time.perf_counter()
    train_otl.train_one_epoch(net, opt, images[:n_warm], labels[:, :n_warm], 0, args, device, gen,
                              ranks, n_warm)
    first = time.perf_counter() - t
    row = train_otl.train_one_epoch(net, opt, images[:n], labels[:, :n], 0, args, device, gen,
                                    ranks, n)
    return {"views_per_s": row["img_per_s"], "warmup_s": round(first, 1)}, model


def label_pass(a, model, images, size, device, amp=None):
    n = min(images.shape[0], a.label_batch_size * max(a.steps // 4, 2))
    otl.label_pass(model, images[:a.label_batch_size], size, a.label_batch_size, device,
                   views=a.views, strong=True, progress=False, amp=amp)
    utils.synchronize(device)
    t = time.perf_counter()
    otl.label_pass(model, images[:n], size, a.label_batch_size, device, views=a.views, strong=True,
                   progress=False, amp=amp)
    utils.synchronize(device)
    return {"views_per_s": round(n * a.views / (time.perf_counter() - t), 1)}


def features(a, model, images, size, device, amp=None):
    n = min(images.shape[0], a.label_batch_size * max(a.steps // 4, 2))
    otl.extract_features(model, images[:a.label_batch_size], size, a.label_batch_size, device,
                         progress=False, amp=amp)
    utils.synchronize(device)
    t = time.perf_counter()
    otl.extract_features(model, images[:n], size, a.label_batch_size, device, progress=False, amp=amp)
    utils.synchronize(device)
    return {"views_per_s": round(n / (time.perf_counter() - t), 1)}


def augment(a, images, size, device):
    x = images[:a.batch_size]
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            utils.synchronize(device)
            t = time.perf_counter()
        for _ in range(a.views):
            otl.augment(x, size, strong=True, cutout=max(1, 16 * size // 224))
    utils.synchronize(device)
    return {"views_per_s": round(a.steps * a.views * a.batch_size / (time.perf_counter() - t), 1)}


def supervised(a, images, size, device):
    import torchvision
    model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          fused=True if device.type == "cuda" else None)
    y = torch.randint(0, 10, (images.shape[0],), device=device)
    b = a.batch_size * a.views      # as many network inputs per step as the OTL step
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1)
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            utils.synchronize(device)
            t = time.perf_counter()
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
    utils.synchronize(device)
    return {"views_per_s": round(a.steps * b / (time.perf_counter() - t), 1)}


def main(a):
    device = utils.pick_device(a.device)
    torch.backends.cudnn.benchmark = True       # as train_otl.py: fixed shapes, fastest kernels
    torch.manual_seed(0)
    if a.data:
        d = utils.load_prepared(a.data)
        images = d["images"][d["train_idx"]]
    else:
        images = torch.randint(0, 256, (21600, 3, 64, 64), dtype=torch.uint8)
    images = images.to(device)
    need = a.batch_size * max(a.steps, a.warmup)
    if images.shape[0] < need:
        images = images.repeat(-(-need // images.shape[0]), 1, 1, 1)
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
            got = {"otl_train": got}
            if "label_pass" in only:
                got["label_pass"] = label_pass(a, model, images, size, device, amp)
            if "features" in only:
                got["features"] = features(a, model, images, size, device, amp)
            for f, v in got.items():
                best = r.get(f + sfx, {"views_per_s": 0, "trials": []})
                r[f + sfx] = {**v, "views_per_s": max(best["views_per_s"], v["views_per_s"]),
                              "trials": best["trials"] + [v["views_per_s"]]}
        for f in ("otl_train", "label_pass", "features"):
            if len(amps) > 1 and f + "_fp32" in r:
                r[f + "_bf16_over_fp32"] = round(r[f + "_bf16"]["views_per_s"] /
                                                 r[f + "_fp32"]["views_per_s"], 3)
        if "augment" in only:
            r["augment"] = augment(a, images, size, device)
        if "supervised" in only:
            r["supervised"] = supervised(a, images, size, device)
        if str(size) in a.compile.split(","):
            r["otl_compiled"] = otl_train(a, images, size, device, compile_=True)[0]
        if "supervised" in r and "otl_train" in r:
            r["otl_over_supervised"] = round(r["otl_train"]["views_per_s"] / r["supervised"]["views_per_s"], 3)
        out["sizes"][str(size)] = r
        print(size, r, flush=True)
        if a.out:
            utils.write_json(out, a.out)
    names = [n for n in next(iter(out["sizes"].values())) if isinstance(
        next(iter(out["sizes"].values()))[n], dict)]
    print(f"{'size':>5} " + " ".join(f"{n:>16}" for n in names))
    for size, r in out["sizes"].items():
        print(f"{size:>5} " + " ".join(f"{r[n]['views_per_s']:>16.0f}" for n in names))
    return out


if __name__ == "__main__":
    main(get_args_parser().parse_args())
