"""Self-supervised training with output translation (OTL), or supervised training of the same
network for the paper's "supervised" column.

    python train_otl.py --data data/eurosat --output runs/eurosat --preset auto
    python train_otl.py --data data/eurosat --output runs/eurosat_sup --preset auto --supervised

Each epoch that is due (--label-every), a label pass puts the training images through the network,
`otl.translate` spreads the outputs evenly over the k clusters, and the labels it gives become the
targets of the next epochs' cross-entropy (label-consistent across views with --lct).  The output
folder gets checkpoint.pth (overwritten every epoch, atomically), numbered snapshots, log.jsonl (one
JSON line per epoch) and results.json.  Rerunning the same command resumes from checkpoint.pth.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import otl

# Presets fill every flag the user did not give.  "paper" is the paper's remote-sensing protocol;
# "cpu" is sized so that `make eurosat` (prepare, train, evaluate) ends within 30 minutes on 2 CPU
# cores: it gives up image size (32 px instead of 224 px: 49x less compute), half of ResNet-18's
# width (about 3x faster again), and epochs (20 instead of 300), and uses a cosine schedule, which
# suits a short run better than the paper's steps.  Everything else is the paper's: k = 128, two
# views with label-consistent training, strong augmentation with a 16-px Cutout, SGD.
PRESETS = {
    "paper": dict(arch="resnet18", k=128, width=64, small_stem=False, img_size=224, epochs=300,
                  batch_size=256, lr=0.03, schedule="step", lr_drops=[160, 240],
                  lr_values=[0.003, 0.0006], views=2, lct=True, aug="strong", cutout=16, label_every=1,
                  label_views=2, warmup_epochs=0),
    "cpu": dict(arch="resnet18", k=128, width=32, small_stem=False, img_size=32, epochs=20,
                batch_size=256, lr=0.05, schedule="cosine", lr_drops=[], lr_values=[], views=2,
                lct=True, aug="strong", cutout=16, label_every=1, label_views=2, warmup_epochs=0),
}
DEFAULTS = PRESETS["cpu"]


def str2bool(v):
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="prepared data folder (prepare_data.py --out)")
    p.add_argument("--output", required=True, help="run folder: checkpoints, log.jsonl, results.json; "
                   "an existing checkpoint there is resumed")
    p.add_argument("--preset", default="auto", choices=["auto", "paper", "cpu"],
                   help="defaults for every flag below that you do not give: 'paper' (the paper's "
                   "protocol, for a GPU), 'cpu' (fits make eurosat into 30 min on 2 cores), 'auto' "
                   "(paper on CUDA, cpu otherwise)")
    g = p.add_argument_group("model (preset values when not given)")
    g.add_argument("--arch", choices=["resnet18"])
    g.add_argument("--k", type=int, help="clusters = outputs of the head; the paper uses 128 for "
                   "remote-sensing sets (about 10x the classes works well)")
    g.add_argument("--width", type=int, help="channels of ResNet-18's first stage (64 is torchvision's)")
    g.add_argument("--small-stem", type=str2bool, help="3x3 stride-1 stem without max-pool: keeps "
                   "resolution for small images but costs ~16x the compute")
    g.add_argument("--img-size", type=int, help="side of the training and test images (the cache "
                   "is resized on the fly)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int, help="images per step (each gives --views views)")
    g.add_argument("--lr", type=float, help="SGD learning rate (0.03 in the paper at batch 256)")
    g.add_argument("--schedule", choices=["step", "cosine"], help="step: set lr to --lr-values at "
                   "epochs --lr-drops (the paper's); cosine: decay to 0, better for short runs")
    g.add_argument("--lr-drops", type=int, nargs="*", help="epochs at which the lr changes (step)")
    g.add_argument("--lr-values", type=float, nargs="*", help="the lr from each of --lr-drops on")
    g.add_argument("--warmup-epochs", type=float, help="linear lr warm-up")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--wd", type=float, default=5e-4, help="weight decay (5e-4 in the paper)")
    g = p.add_argument_group("OTL")
    g.add_argument("--views", type=int, help="augmented views of each image per step")
    g.add_argument("--lct", type=str2bool, help="label-consistent training: every view learns the "
                   "labels of every view (true), or only its own (false)")
    g.add_argument("--aug", choices=["simple", "strong"], help="strong = RandAugment-style ops + "
                   "Cutout 16, as in the paper")
    g.add_argument("--cutout", type=int, help="side in pixels (of the --img-size image) of the "
                   "Cutout hole in strong augmentation; 16 in the paper at 224 px, 0 for none")
    g.add_argument("--label-every", type=int, help="epochs between label passes")
    g.add_argument("--label-views", type=int, help="views labelled per image in a label pass: 1 = "
                   "the test-time view (cheapest); V = V augmented views, one label each, which is "
                   "what makes --lct differ from plain cross-entropy")
    g.add_argument("--label-bn", default="batch", choices=["batch", "eval"], help="BatchNorm in the "
                   "label pass: batch statistics (the authors' choice; running statistics are left "
                   "untouched) or running statistics; see README for the measurement")
    g.add_argument("--beta", type=float, default=1.5, help="decay rate of the translation step "
                   "(--labeler published)")
    g.add_argument("--labeler", choices=("published", "exact"), default="published",
                   help="published: the authors' rules plus our tie-breaking (what the recorded "
                   "runs used; fastest at this size); exact: counts within 1 of the target "
                   "(otl.translate's default, slower on k = 128 EuroSAT outputs: see README)")
    g.add_argument("--target-x", type=float, default=0.0, help="uneven target n_i ~ i^x "
                   "(0 = even, the method's default)")
    g.add_argument("--supervised", action="store_true", help="train on the true labels instead "
                   "(same network and schedule): the supervised baseline")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    g.add_argument("--amp", type=str2bool, default=None, help="bfloat16 autocast; default: on for CUDA")
    g.add_argument("--snapshot-every", type=int, default=0, help="keep checkpointNNNN.pth every N "
                   "epochs (0: only the random-init snapshot and the final one)")
    g.add_argument("--knn-monitor", type=int, default=0, help="every N epochs, log kNN@10/50 of the "
                   "test split (uses labels, for monitoring only; 0 = off)")
    g.add_argument("--max-minutes", type=float, default=0, help="stop cleanly (checkpoint saved) "
                   "after this many minutes; rerun to continue")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars (for logs)")
    g.add_argument("--measure-label-bn", action="store_true", help="instead of training: label the "
                   "training set once with each BatchNorm mode (eval, batch) using the model in "
                   "--output (random init if none), translate with the published rules and with "
                   "ours, and write label_bn.json there")
    return p


def resolve_args(args, device):
    """Fill the flags not given from the preset; say which preset was taken."""
    preset = args.preset
    if preset == "auto":
        preset = "paper" if device.type == "cuda" else "cpu"
    for key, val in PRESETS[preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    args.preset_used = preset
    if args.amp is None:
        args.amp = device.type == "cuda"
    if args.schedule == "step" and len(args.lr_drops) != len(args.lr_values):
        raise SystemExit(f"--lr-drops {args.lr_drops} and --lr-values {args.lr_values} must have "
                         "the same length")
    for name in ("k", "epochs", "batch_size", "views", "label_every", "label_views", "img_size"):
        if getattr(args, name) < (2 if name == "k" else 1) and not (name == "epochs" and args.epochs == 0):
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.label_views not in (1, args.views):
        raise SystemExit(f"--label-views must be 1 or equal to --views ({args.views})")
    return args


def lr_at(args, epoch_float):
    if args.warmup_epochs and epoch_float < args.warmup_epochs:
        return args.lr * epoch_float / args.warmup_epochs
    if args.schedule == "cosine":
        return 0.5 * args.lr * (1 + math.cos(math.pi * min(epoch_float / max(args.epochs, 1), 1.0)))
    lr = args.lr
    for drop, val in zip(args.lr_drops, args.lr_values):
        if epoch_float >= drop:
            lr = val
    return lr


def make_labels(model, images, args, device, gen):
    """Label pass + translation: pseudo-labels (label_views, N) and statistics for the log."""
    t0 = time.time()
    outs = otl.label_pass(model, images, args.img_size, batch_size=max(args.batch_size, 256),
                          device=device, bn=args.label_bn, views=args.label_views,
                          strong=args.aug == "strong", cutout=args.cutout, generator=gen,
                          progress=not args.no_progress)  # (V, N, k)
    t_pass = time.time() - t0
    n, k = outs.shape[1], outs.shape[2]
    target = otl.uneven_target(n, k, args.target_x) if args.target_x else None
    labels, stats = [], []
    for v in range(outs.shape[0]):
        res = otl.translate(outs[v], target=target, beta=args.beta, seed=args.seed + v,
                            method=getattr(args, "labeler", "published"))
        labels.append(res.labels)
        raw_counts = torch.bincount(outs[v].argmax(1), minlength=k)
        stats.append({"std": res.std, "std_max": res.std_max, "iterations": res.iterations,
                      "seconds": res.seconds, "spread": (outs[v].max() - outs[v].min()).item(),
                      "std_before": (raw_counts.double() - res.target.to(raw_counts.device)).pow(2).mean().sqrt().item(),
                      "clusters_used_before": int((raw_counts > 0).sum())})
    log = {"label_pass_s": round(t_pass, 2),
           "pl_std": sum(s["std"] for s in stats) / len(stats),
           "pl_std_before": sum(s["std_before"] for s in stats) / len(stats),
           "pl_std_max": stats[0]["std_max"],
           "pl_spread": sum(s["spread"] for s in stats) / len(stats),
           "labeler_iters": sum(s["iterations"] for s in stats),
           "labeler_s": round(sum(s["seconds"] for s in stats), 3),
           "clusters_used_before": stats[0]["clusters_used_before"]}
    if outs.shape[0] > 1:
        log["view_agreement"] = (labels[0] == labels[1]).float().mean().item()
    return torch.stack(labels).to(device), log


def measure_label_bn(model, images, args, device, gen, path):
    """The label pass's BatchNorm mode, measured: counts' std before translating, after the
    published labeler (start at 0, no tie-breaking) and after ours, for eval and batch statistics."""
    rows = {}
    for bn in ("eval", "batch"):
        outs = otl.label_pass(model, images, args.img_size, 256, device, bn=bn, views=1,
                              generator=gen, progress=not args.no_progress)[0]  # (N, k)
        raw = torch.bincount(outs.argmax(1), minlength=outs.shape[1]).double()
        pub = otl.translate(outs, init="zero", tie_eps=0, method="published")
        ours = otl.translate(outs, method="published")
        rows[bn] = {"std_before": (raw - raw.mean()).pow(2).mean().sqrt().item(),
                    "clusters_used_before": int((raw > 0).sum()),
                    "spread": (outs.max() - outs.min()).item(),
                    # std over the N images of each output, averaged over the k outputs
                    "mean_row_std": outs.std(0).mean().item(),
                    "std_published": pub.std, "iters_published": pub.iterations,
                    "std_ours": ours.std, "iters_ours": ours.iterations, "std_max": ours.std_max}
        print(bn, json.dumps(rows[bn]), flush=True)
    out = {"n": images.shape[0], "k": args.k, "img_size": args.img_size, "arch": args.arch,
           "width": args.width, "small_stem": args.small_stem, "results": rows,
           "command": " ".join([sys.executable] + sys.argv), "git_commit": otl.git_commit()}
    otl.write_json(out, path)
    return out


def knn_monitor(model, d, args, device):
    from eval_knn import knn_accuracy
    feats = otl.extract_features(model, d["images"], args.img_size, 512, device, progress=False)
    tr, te = d["train_idx"], d["test_idx"]
    acc = knn_accuracy(feats[tr], d["labels"][tr], feats[te], d["labels"][te], ks=(10, 50))
    return {f"knn{k}": round(v, 2) for k, v in acc.items()}


def main(args):
    device = otl.pick_device(args.device)
    args = resolve_args(args, device)
    print(f"*** preset: {args.preset_used} (device {device}) ***", flush=True)
    otl.print_run_header(args)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    os.makedirs(args.output, exist_ok=True)

    d = otl.load_prepared(args.data)
    with open(os.path.join(args.data, "manifest.json")) as fh:
        manifest = json.load(fh)
    images = d["images"][d["train_idx"]]        # (N, 3, H, W) uint8; labels only for --supervised
    true_labels = d["labels"][d["train_idx"]]
    if device.type == "cuda":
        images, true_labels = images.to(device), true_labels.to(device)
    n = images.shape[0]
    if not args.supervised and n < args.k:
        raise SystemExit(f"the training split has {n} images, fewer than --k {args.k} clusters")
    n_classes = len(d["classes"])
    cfg = otl.ModelConfig(arch=args.arch, k=n_classes if args.supervised else args.k,
                          small_stem=args.small_stem, width=args.width,
                          mean=tuple(manifest["channel_mean"]), std=tuple(manifest["channel_std"]))
    model = otl.build_model(cfg).to(device)
    if device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.wd, nesterov=False)

    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    start_epoch, labels = 0, None
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ck["model_cfg"] != otl.model_cfg_dict(cfg):
            diff = {k: (v, otl.model_cfg_dict(cfg)[k]) for k, v in ck["model_cfg"].items()
                    if otl.model_cfg_dict(cfg).get(k) != v}
            raise SystemExit(f"{ckpt_path} holds a different model (checkpoint vs now: {diff}); "
                             "use another --output, or the flags of that run to resume it")
        changed = {k: (v, getattr(args, k)) for k, v in ck["args"].items()
                   if k not in ("epochs", "max_minutes", "no_progress", "device", "knn_monitor")
                   and getattr(args, k, v) != v}
        if changed:
            print(f"warning: resuming with flags that differ from the checkpoint's "
                  f"(checkpoint, now): {changed}", flush=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start_epoch, labels = ck["epoch"], ck.get("pseudo_labels")
        labels = labels.to(device) if labels is not None else None
        torch.set_rng_state(ck["rng_cpu"])
        gen.set_state(ck["rng_gen"])
        if device.type == "cuda" and ck.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(ck["rng_cuda"].cpu())
        print(f"resumed from {ckpt_path} at epoch {start_epoch}", flush=True)

    def state(epoch):
        return {"model": model.state_dict(), "model_cfg": otl.model_cfg_dict(cfg),
                "optimizer": opt.state_dict(), "epoch": epoch, "args": vars(args),
                "pseudo_labels": labels.cpu() if labels is not None else None,
                "rng_cpu": torch.get_rng_state(), "rng_gen": gen.get_state(),
                "rng_cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
                "git_commit": otl.git_commit()}

    if args.measure_label_bn:
        return measure_label_bn(model, images, args, device, gen, os.path.join(args.output, "label_bn.json"))
    if start_epoch == 0:
        otl.save_checkpoint(state(0), os.path.join(args.output, "checkpoint0000.pth"))  # baseline
    log_path = os.path.join(args.output, "log.jsonl")
    t_start, steps_per_epoch = time.time(), math.ceil(n / args.batch_size)
    for epoch in range(start_epoch, args.epochs):
        t_epoch = time.time()
        row = {"epoch": epoch + 1}
        if not args.supervised and (labels is None or epoch % args.label_every == 0):
            labels, lstats = make_labels(model, images, args, device, gen)
            row.update(lstats)
        model.train()
        perm = torch.randperm(n, generator=gen)
        tot, seen = 0.0, 0
        it = range(steps_per_epoch)
        if not args.no_progress:
            from tqdm import tqdm
            it = tqdm(it, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, dynamic_ncols=True)
        t_train = time.time()
        for step in it:
            lr = lr_at(args, epoch + step / steps_per_epoch)
            for grp in opt.param_groups:
                grp["lr"] = lr
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            x = images[idx.to(images.device)].to(device, non_blocking=True)
            xs = torch.cat([otl.augment(x, args.img_size, args.aug == "strong", cutout=args.cutout) for _ in range(args.views)])
            if device.type == "cpu":
                xs = xs.contiguous(memory_format=torch.channels_last)
            with otl._autocast(device) if args.amp else torch.autocast(device.type, enabled=False):
                logits = model(xs).float().view(args.views, len(idx), -1)  # (V, B, k)
            if args.supervised:
                y = true_labels[idx.to(true_labels.device)].to(device)
                loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(args.views))
            else:
                lab = labels[:, idx.to(labels.device)]                     # (label_views, B)
                lab = lab.expand(args.views, -1) if lab.shape[0] == 1 else lab
                loss = otl.lct_loss(logits, lab, consistent=args.lct)
            if not torch.isfinite(loss):
                raise SystemExit(f"loss is {loss.item()} at epoch {epoch + 1} step {step}: lower --lr; "
                                 f"the last good checkpoint is {ckpt_path}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item() * len(idx)
            seen += len(idx)
            if not args.no_progress:
                it.set_postfix(loss=f"{tot / seen:.3f}", lr=f"{lr:.4f}")
        train_s = time.time() - t_train
        row.update({"loss": tot / seen, "lr": lr, "train_s": round(train_s, 1),
                    "img_per_s": round(seen * args.views / train_s, 1),
                    "epoch_s": round(time.time() - t_epoch, 1)})
        if args.knn_monitor and (epoch + 1) % args.knn_monitor == 0:
            row.update(knn_monitor(model, d, args, device))
        otl.save_checkpoint(state(epoch + 1), ckpt_path)
        if (args.snapshot_every and (epoch + 1) % args.snapshot_every == 0) or epoch + 1 == args.epochs:
            otl.save_checkpoint(state(epoch + 1), os.path.join(args.output, f"checkpoint{epoch + 1:04d}.pth"))
        with open(log_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        if args.max_minutes and (time.time() - t_start) / 60 > args.max_minutes and epoch + 1 < args.epochs:
            print(f"--max-minutes {args.max_minutes} reached after epoch {epoch + 1}; rerun the same "
                  "command to continue", flush=True)
            return None
    results = {"epochs": args.epochs, "preset": args.preset_used, "device": str(device),
               "checkpoint": os.path.abspath(ckpt_path), "train_minutes": round((time.time() - t_start) / 60, 2),
               "command": " ".join([sys.executable] + sys.argv), "git_commit": otl.git_commit()}
    otl.write_json(results, os.path.join(args.output, "results.json"))
    return results


if __name__ == "__main__":
    main(get_args_parser().parse_args())
