"""Self-supervised training with output translation (OTL), or supervised training of the same
network for the paper's "supervised" column.

    python train_otl.py --data data/eurosat --output runs/eurosat --preset auto
    python train_otl.py --data data/eurosat --output runs/eurosat_sup --preset auto --supervised
    torchrun --nproc_per_node=2 train_otl.py --data data/eurosat --output runs/eurosat_2p

With torchrun, every process holds a contiguous shard of the training images, labels it, and the
exact labeler balances all shards together (only k-vectors travel between processes); the
network trains with DistributedDataParallel (NCCL on GPUs, gloo on the CPU), --batch-size is the
global batch, and the first process alone writes checkpoints and logs.  Resume needs the same
number of processes to repeat an uninterrupted run exactly (another number is resumed, with a
warning, from the weights and pseudo-labels).

A run trains on the training split less its validation part (utils.VAL_FRAC of it, seeded and
stratified, which prepare_data.py records in split.json): the kNN monitor scores that part, so
choices made from it never read the test split, which eval_knn.py and eval_linear.py score once
the run has finished (their memory bank and probe: the whole training split).

Each epoch that is due (--label-every), a label pass puts the training images through the network,
`otl.translate` spreads the outputs evenly over the k clusters, and the labels it gives become the
targets of the next epochs' cross-entropy (label-consistent across views with --lct).  The output
folder gets checkpoint.pth (overwritten every epoch, atomically), numbered snapshots, log.jsonl (one
JSON line per epoch) and results.json.  Rerunning the same command resumes from checkpoint.pth
(or, when it is damaged or missing, from the newest intact snapshot).  One training at a time
holds the folder (its .lock): a second one on it stops at once, naming the first.
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
import otl_scale
import peers
import presets
import utils


def get_args_parser():
    num, count = utils.finite_float, utils.positive_int     # nan, inf, 0 and -1 refused by name
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="prepared data folder (prepare_data.py --out)")
    p.add_argument("--output", required=True, help="run folder: checkpoints, log.jsonl, results.json; "
                   "an existing checkpoint there is resumed")
    p.add_argument("--preset", default="auto", choices=["auto", *presets.PRESETS],
                   help="defaults for every flag below that you do not give (presets.py says "
                   "which values are the paper's): 'paper' (the paper's remote-sensing protocol "
                   "from scratch, for a GPU), 'fast' (its network at 112 px for 208 epochs: "
                   "minutes on one GPU), 'cpu' (make eurosat in 30 min on 2 cores), 'transfer' / "
                   "'transfer-cpu' (a small set from another run's backbone, with --init), "
                   "'alexnet-cifar' / 'alexnet-cifar100' / 'alexnet-svhn' / 'alexnet-imagenet' and "
                   "'resnet50-cifar' / 'resnet50-svhn' (the paper's natural-image protocols), "
                   "'cifar-cpu' (make cifar10's CPU twin), 'cifar-fast' (CIFAR-10 on one GPU), "
                   "'alexnet-cifar-cpu' (the labeler studies' network); 'auto': the data set's "
                   "protocol on CUDA and its CPU twin otherwise (the transfer presets for HMHR, "
                   "SIRI-WHU, UC Merced and EuroSAT MS, whose bands start from an RGB "
                   "backbone). docs/presets.md says what each gives up")
    model_flags(p.add_argument_group("model (preset values when not given)"), count)
    optimisation_flags(p.add_argument_group("optimisation"), num)
    otl_flags(p.add_argument_group("OTL"), num)
    run_flags(p.add_argument_group("run"), num)
    return p


def model_flags(g, count):
    """The network: train_otl.py's --arch .. --img-size."""
    g.add_argument("--arch", choices=["resnet18", "resnet50", "alexnet"])
    g.add_argument("--k", type=int, help="clusters = outputs of the head; the paper uses 128 (remote "
                   "sensing, CIFAR-10, SVHN, ResNet-50), 512 for CIFAR-100 with AlexNet, 3000 for "
                   "ImageNet")
    g.add_argument("--heads", type=count, help="heads of --k clusters each, every "
                   "one labelled by its own translation, the loss summed over them (the paper's "
                   "ImageNet model: 1 head of 3000; 10 heads for CIFAR and SVHN are ours)")
    g.add_argument("--embed", type=int, help="size of a linear embedding between the features "
                   "and the heads (0: none; 128 for AlexNet, the paper's embedding size for kNN, evaluated with "
                   "--feature embed)")
    g.add_argument("--width", type=count, help="channels of ResNet-18's first stage (64 is "
                   "torchvision's) or of AlexNet's first conv (96 is AlexNet's; the paper gives no width), the rest "
                   "scaled alike")
    g.add_argument("--small-stem", type=utils.str2bool, help="3x3 stride-1 stem without max-pool: "
                   "keeps resolution for small images but costs ~16x the compute")
    g.add_argument("--img-size", type=count, help="side of the training and test images (a cache "
                   "over twice this side is resized once to twice it, then each view on the fly)")


def optimisation_flags(g, num):
    """SGD and its schedule."""
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int, help="images per step (each gives --views views)")
    g.add_argument("--lr", type=num, help="SGD learning rate: the paper's 0.03 for ResNet-18 "
                   "(remote sensing), 0.05 for AlexNet at batch 128, 0.01 for ResNet-50")
    g.add_argument("--schedule", choices=["step", "cosine"], help="step: set lr to --lr-values at "
                   "epochs --lr-drops (the paper's); cosine: decay to 0, better for short runs")
    g.add_argument("--lr-drops", type=int, nargs="*", help="epochs at which the lr changes (step)")
    g.add_argument("--lr-values", type=num, nargs="*", help="the lr from each of --lr-drops on")
    g.add_argument("--warmup-epochs", type=num, help="linear lr warm-up")
    g.add_argument("--momentum", type=num, default=0.9, help="SGD's and LARS's momentum (0.9 in "
                   "the paper)")
    g.add_argument("--wd", type=num, help="weight decay (default 5e-4: ours, as in SeLa's CIFAR "
                   "script; the paper does not give one; a peer's --recipe sets its own)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="sgd (default), lars (timm's, trust "
                   "coefficient 0.02, clipped: solo-learn's; needs requirements-peers.txt) or adam; "
                   "lars and adam leave biases and BatchNorm's weights without weight decay, and "
                   "lars leaves them unadapted, as solo-learn does")


def otl_flags(g, num):
    """Views, augmentation and the labeler."""
    g.add_argument("--views", type=int, help="augmented views of each image per step")
    g.add_argument("--lct", type=utils.str2bool, help="label-consistent training: every view learns "
                   "the labels of every view (true), or only its own (false)")
    g.add_argument("--lct-reduction", default="mean", choices=["mean", "sum"], help="mean "
                   "(default): the loss averaged over the views' label pairs, so the learning "
                   "rate needs no change with --views; sum: summed over the pairs as the paper "
                   "writes it (--views^2 times larger with --lct)")
    g.add_argument("--aug", choices=["simple", "strong"], help="strong = --n-ops RandAugment-style "
                   "ops per image + Cutout (--cutout)")
    g.add_argument("--n-ops", type=int, help="random ops per image in strong augmentation (the "
                   "paper, SCAN's strategy: Augment = 10 on remote sensing, 8 on AlexNet)")
    g.add_argument("--flip", type=utils.str2bool, help="random flips (false for digits: the paper "
                   "drops horizontal flips on SVHN)")
    g.add_argument("--crop", type=num, help="side of the window a view is cropped from, as a "
                   "fraction of the image: 0.875 resizes to 256 and crops 224 as the paper does "
                   "(training: random crops within it; test: the centre)")
    g.add_argument("--rot90", type=utils.str2bool, help="random 90-degree rotations in the "
                   "augmentation: true for overhead (remote-sensing) images, which have no up; "
                   "false for natural images (CIFAR, SVHN, ImageNet)")
    g.add_argument("--cutout", type=int, help="side in pixels (of the --img-size image) of the "
                   "Cutout hole in strong augmentation (one hole); 16 in the paper, 0 for none")
    g.add_argument("--label-every", type=int, help="epochs between label passes (the paper: "
                   "about every two epochs for CIFAR, every epoch for SVHN and ImageNet)")
    g.add_argument("--label-views", type=int, help="views labelled per image in a label pass: 1 = "
                   "the test-time view (cheapest); V = V augmented views, one label each, which is "
                   "what makes --lct differ from plain cross-entropy")
    g.add_argument("--label-bn", default="batch", choices=["batch", "eval"], help="BatchNorm in the "
                   "label pass: batch statistics (default, ours; running statistics are left "
                   "untouched) or running statistics; docs/label_bn.md has the measurement")
    g.add_argument("--beta", type=num, default=1.5, help="decay rate of the translation step "
                   "(--labeler published); the paper finds any value from 1.5 to 50 works")
    g.add_argument("--labeler", choices=("exact", "reference", "published", "sinkhorn"), default="exact",
                   help="exact (default: otl.translate's problem, by otl_scale's tuned labeler): "
                   "counts within 1 of the target in every epoch; reference: the same problem by "
                   "otl.py's short reference labeler (otl.translate_exact), slower; published: the "
                   "paper's Algorithm 1 as the authors run it, which "
                   "stops short of balance and is faster on some outputs (docs/labeler.md, 'Which "
                   "labeler by default', has the measurement); sinkhorn: SeLa's Sinkhorn-Knopp "
                   "(lam 25), the baseline the paper compares with (even target only)")
    g.add_argument("--labeler-start", choices=("medians", "views", "epochs"), default="views",
                   help="where the exact labeler starts: medians (each call from its outputs' "
                   "column medians), views (default: every other view from the first view's "
                   "translation, the same network's outputs; the first view, in one process, "
                   "from every 4th row's when k > 256 and the outputs are far from balance, as "
                   "otl_scale.translate does) or epochs (the first view too, from the last label "
                   "pass's; kept in the checkpoint). The labels are exactly balanced either way; "
                   "a start near the answer saves most of the work at large k (docs/labeler.md, "
                   "'Where the solve starts')")
    g.add_argument("--labeler-device", choices=("same", "cpu"), default="same", help="where the "
                   "labeler runs: same (default: where the outputs are) or cpu (the outputs are "
                   "copied to the host first, the copy counted in the log's labeler_s; one process "
                   "only). On a GPU the exact labeler's many short steps on a small input can wait "
                   "on the host more than they compute (docs/labeler.md, 'On a GPU')")
    g.add_argument("--label-batch-size", type=int, help="images per forward pass of the label pass "
                   "(BatchNorm's batch with --label-bn batch); default: the larger of --batch-size "
                   "and 256 on the CPU, 1024 on CUDA")
    g.add_argument("--label-head-rows", type=int, default=8192, help="the first rows of the label "
                   "pass that fix the exact labeler's start translation (with torchrun: of the "
                   "first process's shard); the labels of N processes equal one process's when "
                   "every shard holds at least this many rows")
    g.add_argument("--target-x", type=num, default=0.0, help="uneven target n_i ~ i^x "
                   "(0 = even, the method's default)")
    g.add_argument("--init", metavar="CHECKPOINT", help="start from the backbone of another run "
                   "(OTL or supervised, any data set), with a fresh head for this run's k: the "
                   "paper's transfer protocol for small data sets; recorded in the run.  An RGB "
                   "backbone starts multiband data too: its first conv is inflated (the bands "
                   "named red, green and blue, e.g. Sentinel-2's B04, B03, B02, take the R, G, B "
                   "filters, every other band their mean, all scaled by 3 / bands), said on "
                   "stderr; use the transfer presets, whose network matches the backbone's")
    g.add_argument("--supervised", action="store_true", help="train on the true labels instead "
                   "(same network and schedule): the supervised baseline")
    g.add_argument("--method", choices=peers.METHODS, default="otl", help="otl (default), or a "
                   "method a user would pick instead, trained by this loop on the same backbone, "
                   "data and schedule: simclr, byol, swav (peers.py; needs requirements-peers.txt). "
                   "SeLa is otl with --labeler sinkhorn")
    g.add_argument("--peer-aug", choices=peers.VIEW_RECIPES, help="a peer's views: its paper's "
                   "ImageNet augmentation (own, default), the 32-px recipe (cifar: lightly's "
                   "CIFAR-10 views, solo-learn's for BYOL) or OTL's (otl: the preset's --aug, "
                   "--n-ops, --cutout), to tell the method apart from its augmentation")
    g.add_argument("--recipe", choices=RECIPES, help="a peer's optimisation as published, filling "
                   "--optimizer, --lr (scaled to --batch-size), --wd, --warmup-epochs, "
                   "--temperature, --prototypes, --queue and --peer-aug where not given: ours "
                   "(default: the preset's SGD, for every method), solo-learn (its CIFAR configs: "
                   "LARS, 1%% warm-up) or lightly (its CIFAR-10 benchmark); peers.RECIPES lists them")
    g.add_argument("--temperature", type=num, help="SimCLR's NT-Xent and SwAV's softmax "
                   "temperature (default 0.5 and 0.1, lightly's)")
    g.add_argument("--prototypes", type=int, help="SwAV's prototypes (default --k)")
    g.add_argument("--queue", type=int, help="SwAV's queue of earlier projections, in images (default "
                   "0: none), used after the first 5%% of the epochs (solo-learn's 50 of 1,000)")


def run_flags(g, num):
    """Seed, device, checkpoints, monitoring."""
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    g.add_argument("--sync-bn", type=utils.str2bool, default=False, help="with torchrun on GPUs: "
                   "BatchNorm statistics over every process's batch (SyncBatchNorm), for small "
                   "per-GPU batches; off, each process normalises its own batch")
    g.add_argument("--compile", type=utils.str2bool, default=False, help="train through "
                   "torch.compile(model) (default false): faster steps after a compile at the "
                   "start, so it can pay in long runs (not yet timed in a training run); "
                   "checkpoints, the label pass and evaluation use the uncompiled model, which "
                   "shares its weights")
    g.add_argument("--amp", type=utils.str2bool, default=None, help="bfloat16 autocast in the "
                   "training steps, the label pass and the feature passes (the logits reach the "
                   "labeler and the loss in float32); default: on for CUDA and for a CPU with "
                   "native bf16 (avx512_bf16 or amx_bf16), where it is faster, float32 elsewhere "
                   "(a resumed run keeps its own); false: float32 throughout")
    g.add_argument("--snapshot-every", type=int, default=0, help="keep checkpointNNNN.pth every N "
                   "epochs (0: only the random-init snapshot and the final one)")
    g.add_argument("--knn-monitor", type=int, default=0, help="every N epochs, log kNN@10/50 of the "
                   "validation split against the rest of the training split (uses labels, for "
                   "monitoring and choosing; the test split is left for eval_knn.py; 0 = off)")
    g.add_argument("--hold-out-val", type=utils.str2bool, default=None, help="train on the "
                   "training split less its validation part (utils.VAL_FRAC, seeded, stratified; "
                   "default true for a new run), so that the kNN monitor and every choice read "
                   "images the run never saw; false: the whole training split (a run that "
                   "started before the validation split resumes so)")
    g.add_argument("--max-minutes", type=num, default=0, help="stop cleanly (checkpoint saved) "
                   "after this many minutes; rerun to continue")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars (for logs)")
    g.add_argument("--same-flags", action="store_true", help="refuse to resume a checkpoint in "
                   "--output trained with other flags (naming them) instead of warning; "
                   "ablations.py passes it before taking a run folder it did not make")


# OTL's own flags, which a peer (--method) never reads, and OTL's views, which a peer reads only
# with --peer-aug otl (--k stays: SwAV's prototypes, and the size of the unused head otherwise)
OTL_ONLY = ("views", "label_views", "labeler", "heads", "label_every", "lct", "lct_reduction",
            "label_bn", "beta", "labeler_start", "labeler_device", "label_batch_size",
            "label_head_rows", "target_x")
OTL_VIEWS = ("aug", "n_ops", "cutout")
# a peer's own flags, by the methods that read them
PEER_ONLY = {"peer_aug": ("simclr", "byol", "swav"), "temperature": ("simclr", "swav"),
             "prototypes": ("swav",), "queue": ("swav",)}
OPTIMIZERS = ("sgd", "lars", "adam")
RECIPES = ("ours", *peers.RECIPES)


def unused_flags(args):
    """The flags given (not at their default) that the chosen training never reads, or a reason
    that they contradict the method: one line, or None."""
    p = get_args_parser()
    given = lambda names: [f"--{n.replace('_', '-')}" for n in names
                           if getattr(args, n, None) != p.get_default(n)]
    if args.method == "otl" and args.peer_aug is not None:
        return "--peer-aug chooses a peer's views (--method simclr, byol or swav); OTL's are --aug"
    if args.method == "otl" and args.recipe not in (None, "ours"):
        return (f"--recipe {args.recipe} is a peer's published optimisation (--method simclr, byol "
                "or swav); OTL's is its preset's")
    foreign = [f"--{n.replace('_', '-')}" for n, who in PEER_ONLY.items()
               if getattr(args, n, None) is not None and args.method not in who]
    if foreign:
        return f"--method {args.method} does not use {', '.join(foreign)}: drop them"
    if args.method == "otl":
        return None
    unused = given(OTL_ONLY + (OTL_VIEWS if args.peer_aug != "otl" else ()))
    if unused:
        why = (" (its views are its own: --peer-aug otl takes OTL's --aug, --n-ops, --cutout)"
               if set(unused) & {"--aug", "--n-ops", "--cutout"} else "")
        return (f"--method {args.method} does not use {', '.join(unused)}: those are OTL's "
                f"labeler and loss{why}; drop them")
    return None


def fill_recipe(args, preset):
    """--recipe's values (peers.RECIPES) for the flags not given, its lr scaled linearly from its
    batch to this run's and its warm-up a share of this run's epochs."""
    args.recipe = args.recipe or "ours"
    r = peers.RECIPES.get(args.recipe, {}).get(args.method, {})
    batch = args.batch_size if args.batch_size is not None else preset["batch_size"]
    epochs = args.epochs if args.epochs is not None else preset["epochs"]
    fill = {"optimizer": r.get("optimizer"), "wd": r.get("wd"), "temperature": r.get("temperature"),
            "prototypes": r.get("prototypes"), "queue": r.get("queue"), "peer_aug": r.get("peer_aug"),
            "lr": r["lr"] * batch / r["batch"] if r else None,
            "warmup_epochs": r["warmup"] * epochs if r else None}
    for key, val in fill.items():
        if getattr(args, key) is None and val is not None:
            setattr(args, key, val)


def fill_defaults(args):
    """The defaults of the flags no preset holds, after the preset (SwAV's prototypes are --k)."""
    defaults = {"optimizer": "sgd", "wd": 5e-4, "queue": 0, "peer_aug": "own",
                "temperature": peers.TEMPERATURE.get(args.method),
                "prototypes": args.k if args.method == "swav" else None}
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)


def resolve_args(args, device):
    """Fill the flags not given from the preset; say which preset was taken."""
    why = unused_flags(args)
    if why:
        raise SystemExit(why)
    if args.method != "otl":
        peers.need_lightly()        # before the run folder is made
    try:
        dataset = utils.load_manifest(args.data).get("dataset")
    except (OSError, ValueError):
        dataset = None                  # no prepared data there: load_prepared says so later
    args.preset_used = presets.preset_for(args.preset, device.type == "cuda", dataset)
    preset = presets.PRESETS[args.preset_used]
    fill_recipe(args, preset)
    for key, val in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    fill_defaults(args)
    saved = utils.saved_run_args(args.output) if os.path.isdir(args.output) else None
    if args.amp is None and saved is not None and "amp" in saved:
        args.amp = saved["amp"]             # a resumed run keeps its precision
    args.amp = utils.resolve_amp(args.amp, device)
    if args.hold_out_val is None:           # a run from before the validation split: the whole
        args.hold_out_val = saved.get("hold_out_val", False) if saved else True  # training split
    if args.label_batch_size is None:
        args.label_batch_size = max(args.batch_size, 1024 if device.type == "cuda" else 256)
    if args.schedule == "step" and len(args.lr_drops) != len(args.lr_values):
        raise SystemExit(f"--lr-drops {args.lr_drops} and --lr-values {args.lr_values} must have "
                         "the same length")
    for name in ("k", "epochs", "batch_size", "views", "label_every", "label_views", "img_size"):
        least = 2 if name == "k" else 0 if name == "epochs" else 1     # k: one cluster is no split
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least {least}, got "
                             f"{getattr(args, name)}")
    if args.optimizer == "lars":
        peers.need_timm()
    if (args.temperature is not None and args.temperature <= 0) or args.queue < 0 or (
            args.prototypes is not None and args.prototypes < 2):
        raise SystemExit(f"--temperature must be > 0, --queue >= 0 and --prototypes >= 2, got "
                         f"{args.temperature}, {args.queue}, {args.prototypes}")
    for name in ("lr", "wd", "warmup_epochs", "max_minutes"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if any(v < 0 for v in args.lr_values or ()):
        raise SystemExit(f"--lr-values must be >= 0, got {args.lr_values}")
    if not 0 <= args.momentum < 1 or args.beta <= 1:
        raise SystemExit(f"--momentum must be in [0, 1) and --beta > 1 (it shrinks the step), got "
                         f"{args.momentum}, {args.beta}")
    if args.arch == "alexnet" and args.img_size < 63:
        raise SystemExit(f"--arch alexnet needs --img-size >= 63 (its three max-pools), got "
                         f"{args.img_size}; the paper upsamples CIFAR and SVHN to 224")
    if args.n_ops < 0 or not 0 < args.crop <= 1:
        raise SystemExit(f"--n-ops must be >= 0 and --crop in (0, 1], got {args.n_ops}, {args.crop}")
    if args.heads < 1 or args.embed < 0:
        raise SystemExit(f"--heads must be >= 1 and --embed >= 0, got {args.heads}, {args.embed}")
    if args.method != "otl" and args.supervised:
        raise SystemExit(f"--method {args.method} and --supervised are two different trainings; "
                         "pass one")
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


def make_labels(model, images, args, device, gen, ranks, n_total, starts=None):
    """Label pass + translation of this rank's images: pseudo-labels (label_views, n_rank),
    statistics of all ranks for the log, and each head's translation of the first view (the
    exact labeler's start next time with --labeler-start epochs; `starts` holds the last ones).
    Every labeler by its name through otl_scale.translate; across ranks the exact one runs on
    every rank's outputs at once (only k-vectors and k x k matrices travel)."""
    t0 = time.time()
    batches, bs = None, args.label_batch_size
    if ranks.world > 1:   # the same number of forward passes on every rank (SyncBatchNorm)
        per_rank = -(-n_total // ranks.world)                       # ceil(n_total / world)
        batches = -(-per_rank // bs)
    outs = otl.label_pass(model, images, args.img_size, batch_size=bs, amp=args.amp,
                          device=device, bn=args.label_bn, views=args.label_views,
                          **utils.augment_options(vars(args)), generator=gen, progress=not args.no_progress and ranks.main, batches=batches)  # (V, n, k)
    t_pass = time.time() - t0
    k = outs.shape[2] // args.heads
    lo = ranks.shard(n_total)[0]
    target = otl.uneven_target(n_total, k, args.target_x) if args.target_x else None
    labels, stats, first = [], [], {}
    for v, h in ((v, h) for v in range(outs.shape[0]) for h in range(args.heads)):
        o = outs[v][:, h * k:(h + 1) * k]      # head h's outputs of view v: labels row v * heads + h
        seed = args.seed + v + 1000 * h
        t_copy = time.perf_counter()
        if args.labeler_device == "cpu":
            o = o.cpu()
        t_copy = time.perf_counter() - t_copy
        start = None
        if args.labeler == "exact":   # the other view's T, or the last epoch's
            start = (first.get(h) if v > 0 and args.labeler_start != "medians" else
                     (starts or {}).get(h) if args.labeler_start == "epochs" else None)
        res = otl_scale.translate(o, target=target, method=args.labeler, seed=seed, start=start,
                                  beta=args.beta, sample_start=args.labeler_start != "medians",
                                  n_init=args.label_head_rows, distributed=ranks.world > 1,
                                  row_offset=lo)
        if v == 0 and args.labeler == "exact":
            first[h] = res.T.cpu()
        labels.append(res.labels)
        raw_counts = ranks.sum(torch.bincount(o.argmax(1), minlength=k))
        hi_lo = ranks.gather((o.max().item(), o.min().item()))
        stats.append({"std": res.std, "std_max": res.std_max, "iterations": res.iterations,
                      "seconds": res.seconds + t_copy,
                      "spread": max(h for h, _ in hi_lo) - min(m for _, m in hi_lo),
                      "std_before": (raw_counts.double() - res.target.to(raw_counts.device)
                                     ).pow(2).mean().sqrt().item(),
                      "clusters_used_before": int((raw_counts > 0).sum())})
    log = {"label_pass_s": round(t_pass, 2),
           "pl_std": sum(s["std"] for s in stats) / len(stats),
           "pl_std_before": sum(s["std_before"] for s in stats) / len(stats),
           "pl_std_max": stats[0]["std_max"],
           "pl_spread": sum(s["spread"] for s in stats) / len(stats),
           "labeler_iters": sum(s["iterations"] for s in stats),
           "labeler_s": round(sum(s["seconds"] for s in stats), 3),
           "clusters_used_before": stats[0]["clusters_used_before"]}
    if outs.shape[0] > 1:     # head 0's labels of view 0 against those of view 1
        same = ranks.sum(torch.tensor([float((labels[0] == labels[args.heads]).sum())], device=device))
        log["view_agreement"] = same.item() / n_total
    return torch.stack(labels).to(device), log, first


def train_one_epoch(net, opt, images, targets, epoch, args, device, gen, ranks, n_total,
                    peer=None, model=None):
    """One pass over this rank's training images in random batches of batch_size / world, each
    batch's loss by batch_loss; net is the model, or its DistributedDataParallel wrapper, which
    averages the gradients over ranks.  Returns the log row's training figures, over all ranks."""
    n, b = images.shape[0], args.batch_size // ranks.world
    steps = math.ceil((n_total // ranks.world) / b)     # the same on every rank
    opts = utils.augment_options(vars(args))
    net.train()
    if peer is not None:
        peer.train()
    # the order on the data's device, and the running loss summed there: the loop never waits for
    # the GPU (the bar reads the loss every 25 steps, a non-finite loss stops the run at the end
    # of the epoch, before its checkpoint is written)
    perm = torch.randperm(n, generator=gen).to(images.device)
    tot, seen, lr = torch.zeros((), dtype=torch.float64, device=device), 0, args.lr
    it = range(steps)
    if not args.no_progress and ranks.main:
        from tqdm import tqdm
        it = tqdm(it, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, dynamic_ncols=True)
    t0 = time.time()
    for step in it:
        lr = lr_at(args, epoch + step / steps)
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = perm[step * b:(step + 1) * b]
        x = images[idx].to(device, non_blocking=True)
        if peer is not None:
            loss = peer.step(model, x, epoch, device, args.amp)
        else:
            lab = targets[..., idx.to(targets.device)].to(device)   # (B,) true or (L * H, B) pseudo
            loss = batch_loss(net, x, lab, args, opts, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if peer is not None:
            peer.after_step(model, (epoch + (step + 1) / steps) / max(args.epochs, 1))
        tot += loss.detach() * len(idx)
        seen += len(idx)
        if not args.no_progress and ranks.main and (step % 25 == 0 or step == steps - 1):
            it.set_postfix(loss=f"{tot.item() / seen:.3f}", lr=f"{lr:.4f}")
    tot, seen = ranks.sum(torch.stack([tot, torch.tensor(float(seen), dtype=torch.float64,
                                                         device=device)])).tolist()
    train_s = time.time() - t0
    return {"loss": tot / seen, "lr": lr, "train_s": round(train_s, 1),
            "img_per_s": round(seen * args.views / train_s, 1)}


def batch_loss(net, x, lab, args, opts, device):
    """The loss of a uint8 batch x (B, C, H, W) over its --views augmented views: LCT on the
    pseudo-labels lab (label_views * heads, B), or cross-entropy on the true labels lab (B,)
    with --supervised; summed over the heads."""
    xs = torch.cat([otl.augment(x, args.img_size, **opts) for _ in range(args.views)])
    xs = xs.contiguous(memory_format=torch.channels_last)
    with otl.autocast(device, args.amp):
        logits = net(xs).float().view(args.views, x.shape[0], args.heads, -1)   # (V, B, H, k)
    loss = 0.0
    for h in range(args.heads):
        if args.supervised:
            loss = loss + F.cross_entropy(logits[:, :, h].flatten(0, 1), lab.repeat(args.views))
        else:
            lab_h = lab[h::args.heads]                             # (label_views, B) of head h
            lab_h = lab_h.expand(args.views, -1) if lab_h.shape[0] == 1 else lab_h
            loss = loss + otl.lct_loss(logits[:, :, h], lab_h, consistent=args.lct,
                                        reduction=args.lct_reduction)
    return loss


def peak_mib(device) -> float:
    """The most memory the run has held so far, in MiB: the GPU's allocations on CUDA, else the
    process's resident set (its high-water mark)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1)
    import resource
    unit = 2 ** 20 if sys.platform == "darwin" else 1024       # macOS counts bytes, Linux KiB
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / unit, 1)


def collapse_sample(labels, n: int = 1024):
    """The images the collapse signal reads: a fixed (seed 0) stratified random n of the training
    images, every class in its share (all of them where there are no more than n)."""
    if len(labels) <= n:
        return torch.arange(len(labels))
    return utils.stratified_split(labels, n / len(labels), seed=0)[1]


def collapse_signal(model, peer, images, args, device, row: dict, epoch: int) -> dict:
    """The collapse signal of an epoch on `images` (collapse_sample's): the spread
    (peers.feature_spread) and effective rank (peers.effective_rank) of the backbone's features
    (feat_) and of what the loss reads (head_: OTL's logits of its first head, a peer's
    Peer.head_outputs), for a softmax loss the epoch's loss over ln k, SwAV's prototypes in use
    (its head's argmax),
    and the verdict (peers.collapse_verdict): a collapsed epoch says why in its log row and on
    stderr."""
    feats = otl.extract_features(model, images, args.img_size, 256, device, progress=False,
                                 crop=args.crop, amp=args.amp)
    with torch.no_grad():
        f = feats.to(device)
        if peer is not None:
            peer.eval()                  # (the training loop sets train mode again)
            head = peer.head_outputs(f)
        else:
            z = model.embedding(f) if model.embedding is not None else f
            head = model.head(z) if model.cfg.heads == 1 else model.heads[0](z)
    head = head.float().cpu()
    out = {"feat_spread": round(peers.feature_spread(feats), 4),
           "feat_rank": round(peers.effective_rank(feats), 2),
           "head_spread": round(peers.feature_spread(head), 4),
           "head_rank": round(peers.effective_rank(head), 2)}
    k = (None if args.supervised else args.k if peer is None
         else args.prototypes if args.method == "swav" else None)
    if k and utils.is_number(row.get("loss")):
        out["loss_over_ln_k"] = round(float(row["loss"]) / math.log(k), 4)
    if args.method == "swav":       # the prototypes in use, each image on its nearest
        out["clusters_used"] = int(head.argmax(1).unique().numel())
    why = peers.collapse_verdict({**row, **out}, epoch, k)
    if why:
        out["collapsed"], out["collapse_why"] = True, why
        print(f"warning: epoch {epoch} looks collapsed: {why}; the run learns little from here "
              "and is marked failed if it ends so", file=sys.stderr, flush=True)
    return out


def knn_monitor(model, d, args, device):
    """kNN@10 / 50 of the validation split, the rest of the training split the memory bank
    (monitoring and choosing: it uses the labels; the test split is not read)."""
    fit, val = d["fit_idx"], d["val_idx"]
    if len(val) == 0:
        return {}
    feats = otl.extract_features(model, d["images"][torch.cat([fit, val])], args.img_size, 512,
                                 device, progress=False, crop=args.crop, amp=args.amp)
    preds = otl.knn_classify(feats[:len(fit)], d["labels"][fit], feats[len(fit):], ks=(10, 50))
    return {**{f"knn{k}": round(v, 2) for k, v in otl.top1(preds, d["labels"][val]).items()},
            "knn_split": "val"}


def main(args):
    ranks = utils.Ranks(args.device)      # torchrun's processes, or this one alone
    device = ranks.device
    why = utils.prepared_problem(args.data)     # before the run folder is made: a typo makes none
    if why:
        raise SystemExit(why)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise SystemExit(f"--output {args.output} is a file; pass a folder for the run (it is "
                         "created if missing)")
    args = resolve_args(args, device)
    if ranks.world > 1 and args.labeler_device != "same":
        raise SystemExit("--labeler-device cpu works in one process; across processes the exact "
                         "labeler's k-vectors travel on the training device (drop the flag)")
    if ranks.world > 1 and args.method != "otl":
        raise SystemExit(f"--method {args.method} trains in one process here; with torchrun "
                         "use --method otl")
    if ranks.world > 1 and args.labeler != "exact" and not args.supervised:
        raise SystemExit(f"--labeler {args.labeler} needs every output in one process; across "
                         "processes use --labeler exact (the default)")
    if args.labeler == "sinkhorn" and args.target_x:
        raise SystemExit("--labeler sinkhorn balances to the even target only; drop --target-x "
                         "or use --labeler exact")
    if args.sync_bn and device.type != "cuda":
        raise SystemExit("--sync-bn needs CUDA (torch's SyncBatchNorm has no CPU kernel)")
    if args.batch_size < ranks.world:
        raise SystemExit(f"--batch-size {args.batch_size} is the global batch: it needs at least "
                         f"one image for each of the {ranks.world} processes")
    if ranks.main:
        print(f"*** preset: {args.preset_used} (device {device}, {ranks.world} process(es)) ***",
              flush=True)
        utils.print_run_header(args)
    # ---- one training per run folder: the first process holds its lock until the run ends
    utils.make_folder(args.output, "--output")
    release, busy = None, None
    if ranks.main:
        try:
            release = utils.lock_run_folder(args.output)
        except SystemExit as e:
            busy = e
    if ranks.any(busy is not None):                 # every process stops; the first says why
        raise busy or SystemExit(f"--output {args.output} is in use by another training")
    try:
        return run(args, ranks, device)
    finally:
        if release is not None:
            release()


def run(args, ranks, device):
    """The training of main, in a run folder this process holds: data, model, resume, the epochs,
    results.json."""
    torch.manual_seed(args.seed)
    commit = utils.git_commit()     # the code this run started from: later edits are not what ran
    torch.backends.cudnn.benchmark = device.type == "cuda"   # a step's shapes repeat: fastest kernels
    gen = torch.Generator().manual_seed(args.seed + ranks.rank)
    d, manifest, images, true_labels, n_total, lo = training_split(args, ranks, device)
    data_record = utils.data_record(args.data)  # checked on resume and when evaluated
    cfg, model, net, peer, opt = build(args, len(d["classes"]), manifest, ranks, device)
    if args.amp and device.type == "cpu" and not utils.bf16_shapes_ok(model, args.img_size):
        args.amp = False
        if ranks.main:
            print(f"note: float32, not bf16: this network at {args.img_size} px has a strided "
                  "convolution of a 1 x 1 input, whose bf16 gradients are wrong on the CPU "
                  "(utils.bf16_shapes_ok); a larger --img-size avoids it", flush=True)

    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    start_epoch, labels, starts = resume(args, ranks, device, model, opt, gen, cfg, peer,
                                         data_record, slice(lo, lo + images.shape[0]))
    log_path = os.path.join(args.output, "log.jsonl")
    done = finished(args, ranks, start_epoch)
    if done is not None:
        ranks.close()
        return done
    if ranks.main:
        utils.trim_log(log_path, start_epoch)    # epochs past the checkpoint are done again

    def state(epoch):
        """The run's state at the end of `epoch` (on every rank: it gathers from all)."""
        rng = {"cpu": torch.get_rng_state(), "gen": gen.get_state(),
               "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}
        parts = ranks.gather((rng, labels.cpu() if labels is not None else None))
        return {"model": model.state_dict(), "model_cfg": utils.model_state(cfg),
                "optimizer": opt.state_dict(), "epoch": epoch, "args": vars(args),
                "pseudo_labels": torch.cat([p[1] for p in parts], 1) if labels is not None else None,
                "rng_ranks": [p[0] for p in parts], "world_size": ranks.world,
                "labeler_starts": starts, "git_commit": commit, **data_record,
                "peer": peer.state_dict() if peer is not None else None, "method": args.method}

    if start_epoch == 0 and args.init:     # the transfer protocol: another run's backbone
        args.init_from = utils.init_backbone(model, args.init, manifest.get("rgb_bands"),
                                             manifest.get("bands"))
        if ranks.main:
            print(f"backbone from {args.init} (epoch {args.init_from['epoch']}); fresh head", flush=True)
    if start_epoch == 0:
        first = state(0)
        if ranks.main:
            utils.save_checkpoint(first, os.path.join(args.output, "checkpoint0000.pth"))  # baseline
            if args.epochs == 0:     # the untrained network is the run: results.json names it
                utils.save_checkpoint(first, ckpt_path)
                print("--epochs 0: nothing is trained; the run is the network as initialised "
                      "(results.json says untrained)", file=sys.stderr, flush=True)

    # ---- the loop: label pass when due, one epoch, then its log line and snapshot, and last the
    # checkpoint, which commits the epoch (a kill before it redoes the epoch, after it loses nothing);
    # only the first process writes
    sample = collapse_sample(true_labels.cpu())
    t_start = time.time()
    for epoch in range(start_epoch, args.epochs):
        t_epoch = time.time()
        row = {"epoch": epoch + 1}
        otl_labels = not args.supervised and peer is None
        if otl_labels and (labels is None or epoch % args.label_every == 0):
            labels, label_log, starts = make_labels(model, images, args, device, gen, ranks,
                                                    n_total, starts)
            row.update(label_log)
        row.update(train_one_epoch(net, opt, images, true_labels if args.supervised else labels,
                                   epoch, args, device, gen, ranks, n_total, peer, model))
        if not math.isfinite(row["loss"]):  # diverged: results.json says so, so a study records
            why = f"the loss became {row['loss']} in epoch {epoch + 1}"   # a failed run and goes on
            if ranks.main:
                write_results(args, ranks, device, commit, diverged=why)
            raise SystemExit(f"{why}: lower --lr; the last good checkpoint is in {args.output} "
                             "(results.json marks the run failed; rerunning resumes from it)")
        row["epoch_s"] = round(time.time() - t_epoch, 3)
        row["peak_mib"] = peak_mib(device)
        if ranks.main:          # every method's collapse signal (not counted in epoch_s)
            row.update(collapse_signal(model, peer, images[sample], args, device, row, epoch + 1))
        if args.knn_monitor and (epoch + 1) % args.knn_monitor == 0 and ranks.main:
            row.update(knn_monitor(model, d, args, device))
        st = state(epoch + 1)
        if ranks.main:
            utils.append_line(log_path, json.dumps(row))
            if (args.snapshot_every and (epoch + 1) % args.snapshot_every == 0) or epoch + 1 == args.epochs:
                utils.save_checkpoint(st, os.path.join(args.output, f"checkpoint{epoch + 1:04d}.pth"))
            utils.save_checkpoint(st, ckpt_path)
            print(json.dumps(row), flush=True)
        late = args.max_minutes and (time.time() - t_start) / 60 > args.max_minutes
        if ranks.any(ranks.main and late and epoch + 1 < args.epochs):   # every rank stops
            if ranks.main:
                print(f"--max-minutes {args.max_minutes} reached after epoch {epoch + 1}; rerun the "
                      "same command to continue", flush=True)
            ranks.close()
            return None
    results = write_results(args, ranks, device, commit) if ranks.main else None
    ranks.close()
    return results


def resume(args, ranks, device, model, opt, gen, cfg, peer, data_record, rows):
    """(epoch reached, this process's pseudo-labels (its `rows` of them) or None, the exact
    labeler's last translations) from the run folder's checkpoint, the model, optimiser, random
    streams and a peer's own modules restored; (0, None, None) for a new run."""
    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    extras = {"labeler_starts": None,   # the exact labeler's last translations (per head)
              "peer": None,             # a peer's own modules
              "method": None, "args": None}
    start_epoch, labels = utils.restart_from_checkpoint(ckpt_path, model, opt, gen, device,
                                                        utils.model_state(cfg), args, ranks, extras,
                                                        data=data_record)
    held = (extras["args"] or {}).get("hold_out_val", False)
    if start_epoch and held != args.hold_out_val:     # its pseudo-labels are of other images
        what = "the training split less its validation part" if held else "the whole training split"
        raise SystemExit(f"{ckpt_path} trained on {what}; resume it with --hold-out-val "
                         f"{str(held).lower()}, or pass another --output")
    if peer is not None and extras["peer"] is not None:
        peer.load_state_dict(extras["peer"])
    if start_epoch > args.epochs:
        raise SystemExit(f"{ckpt_path} is at epoch {start_epoch}, past --epochs {args.epochs}: a "
                         "run cannot be shortened; use another --output, or --epochs "
                         f">= {start_epoch} to continue it")
    return start_epoch, labels[:, rows] if labels is not None else None, extras["labeler_starts"]


def finished(args, ranks, start_epoch):
    """The run's results.json when it has finished its epochs (nothing to do), else None (also
    where results.json was damaged since: the run writes it again)."""
    path = os.path.join(args.output, "results.json")
    if start_epoch != args.epochs or start_epoch == 0 or not os.path.isfile(path):
        return None
    if ranks.main:
        print(f"{args.output} has finished its {args.epochs} epochs; nothing to do", flush=True)
    try:
        with open(path) as fh:
            return json.load(fh)
    except ValueError:
        return None


def training_split(args, ranks, device):
    """(data, manifest, this process's training images (n, C, H, W) uint8 / 16 and true labels,
    on the GPU when there is one, the number of images trained on (the training split, less its
    validation part with --hold-out-val), the first row of this process's contiguous shard)."""
    d, manifest = utils.open_prepared(args.data, size=args.img_size)   # resized once if large
    rows = d["fit_idx"] if args.hold_out_val else d["train_idx"]
    n_total = len(rows)
    lo, hi = ranks.shard(n_total)
    images = d["images"][rows[lo:hi]]                       # (n, C, H, W) uint8 or uint16
    true_labels = d["labels"][rows[lo:hi]]   # --supervised's, and the collapse sample's strata
    if device.type == "cuda":
        images, true_labels = images.to(device), true_labels.to(device)
    if not args.supervised and args.method == "otl" and n_total < args.k:
        raise SystemExit(f"the training split has {n_total} images"
                         + (" less its validation part" if args.hold_out_val else "")
                         + f", fewer than --k {args.k} clusters")
    return d, manifest, images, true_labels, n_total, lo


def build(args, n_classes, manifest, ranks, device):
    """(config, model, the network the steps run through (DistributedDataParallel across
    processes, compiled with --compile), the peer's own modules (--method; None for OTL), SGD on
    both, one kernel a step on CUDA)."""
    cfg = utils.model_config(vars(args), manifest, k=n_classes if args.supervised else args.k)
    if args.method != "otl" and cfg.in_chans != 3 and args.peer_aug == "own":
        raise SystemExit(f"--method {args.method}: its own augmentation is of RGB images and "
                         f"{args.data} holds {cfg.in_chans} bands; pass --peer-aug otl (OTL's, "
                         "which takes any bands) or prepare RGB bands (prepare_data.py --bands)")
    model = otl.build_model(cfg).to(device).to(memory_format=torch.channels_last)
    net = model
    if ranks.world > 1:
        torch.manual_seed(args.seed + 1 + ranks.rank)   # each process its own augmentations
        if args.sync_bn:
            model = net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ranks.local] if device.type == "cuda" else None)
    if args.compile:   # the training steps only (a label pass's other batch sizes would recompile)
        net = torch.compile(net)
    peer = None if args.method == "otl" else peers.Peer(
        args.method, model, args.prototypes or args.k, args.img_size,
        own=dict(rot90=args.rot90, flip=args.flip, crop=args.crop),
        aug=utils.augment_options(vars(args)) if args.peer_aug == "otl" else None,
        recipe=args.peer_aug, temperature=args.temperature, queue=args.queue,
        queue_start=math.ceil(peers.QUEUE_START * args.epochs)).to(device)
    params = list(model.parameters()) + (peer.trainable() if peer is not None else [])
    return cfg, model, net, peer, optimizer(args, params, device)


def optimizer(args, params, device):
    """--optimizer over params: SGD as ever; LARS (timm's, solo-learn's trust coefficient and
    clipping) and Adam with the biases and BatchNorm's weights (the 1-d parameters) in a group
    without weight decay, which timm's LARS also leaves unadapted (solo-learn's
    exclude_bias_n_norm)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.wd,
                               nesterov=False, fused=True if device.type == "cuda" else None)
    groups = [{"params": [p for p in params if p.ndim > 1]},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if args.optimizer == "lars":
        return peers.need_timm().Lars(groups, lr=args.lr, momentum=args.momentum,
                                      weight_decay=args.wd, trust_coeff=0.02, trust_clip=True)
    return torch.optim.Adam(groups, lr=args.lr, weight_decay=args.wd)


def write_results(args, ranks, device, commit, diverged=None):
    """results.json of a finished run: what ran, where, and its minutes of training (every
    epoch's, resumed or not); of a run whose loss diverged (diverged: how), marked failed with the
    epochs it finished."""
    log_path = os.path.join(args.output, "log.jsonl")
    log = []
    if os.path.isfile(log_path):
        with open(log_path) as fh:
            log = [json.loads(line) for line in fh if line.strip()]
    epoch_s = [r.get("epoch_s", 0) for r in log]
    results = {"epochs": args.epochs, "preset": args.preset_used, "method": args.method,
               **({"untrained": True} if args.epochs == 0 else {}),    # --epochs 0: the baseline
               "arch": args.arch,
               "device": str(device), "amp": bool(args.amp), "processes": ranks.world,
               "checkpoint": utils.rel_path(os.path.join(args.output, "checkpoint.pth")),
               "init_from": getattr(args, "init_from", None),
               "train_minutes": round(sum(epoch_s) / 60, 4),   # tiny runs must not round to 0
               "command": utils.command_line(), "git_commit": commit}
    if args.method != "otl" or args.optimizer != "sgd":
        results.update(recipe=args.recipe, optimizer=args.optimizer, lr=args.lr, wd=args.wd)
    if diverged:
        results.update(epochs=log[-1]["epoch"] if log else 0, failed=f"diverged: {diverged}")
    elif log and log[-1].get("collapsed"):     # ended collapsed (collapse_signal): a failed run
        results["failed"] = f"collapsed at epoch {log[-1].get('epoch')}: {log[-1].get('collapse_why')}"
        print(f"warning: the run ended collapsed; results.json marks it failed ({results['failed']})",
              file=sys.stderr, flush=True)
    utils.write_json(results, os.path.join(args.output, "results.json"))
    return results


if __name__ == "__main__":
    main(get_args_parser().parse_args())
    utils.leave_torchrun()
