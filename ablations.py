"""The paper's studies and our own experiments, each a command that writes a results JSON.

    python ablations.py label-bn --data data/eurosat --output runs/bn

Studies:
  label-bn   the label pass's BatchNorm mode: label the training split once with running
             statistics (eval) and once with batch statistics, and translate each with the
             published rules as the authors' code runs them (start at 0, no tie-break) and with
             ours; writes <output>/label_bn.json.  docs/label_bn.md has the recorded runs.
"""
import argparse
import json
import os

import torch

import otl
import utils


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="study", required=True, metavar="STUDY")
    s = sub.add_parser("label-bn", help="BatchNorm statistics in the label pass: eval or batch")
    s.add_argument("--data", required=True, help="prepared data folder (prepare_data.py --out)")
    s.add_argument("--output", required=True, help="folder for label_bn.json; a checkpoint.pth "
                   "there (a train_otl.py run) is the network measured, else a fresh one")
    s.add_argument("--preset", default="cpu", choices=["auto", *utils.PRESETS],
                   help="the network's settings when --k, --width or --img-size are not given; "
                   "'cpu' is the preset whose label pass was measured")
    s.add_argument("--k", type=int, help="clusters (the preset's: 128)")
    s.add_argument("--width", type=int, help="ResNet-18's first-stage width (cpu preset: 32; 64 is "
                   "torchvision's)")
    s.add_argument("--img-size", type=int, help="image side in the label pass (cpu preset: 32)")
    s.add_argument("--seed", type=int, default=0, help="the network's initialisation and the "
                   "label pass's batch order")
    s.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    s.add_argument("--no-progress", action="store_true", help="no tqdm bars (for logs)")
    return p


def label_bn(args):
    """Counts' std before translating, after the published labeler as the authors run it and
    after ours, for eval-mode and batch-statistics BatchNorm in the label pass."""
    device = utils.pick_device(args.device)
    preset = utils.PRESETS[utils.preset_for(args.preset, device)]
    for key in ("k", "width", "img_size"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    utils.print_run_header(args)
    d = utils.load_prepared(args.data)
    manifest = utils.load_manifest(args.data)
    images = d["images"][d["train_idx"]]
    ckpt = os.path.join(args.output, "checkpoint.pth")
    if os.path.isfile(ckpt):
        model = utils.load_checkpoint(ckpt, device)[0]
    else:   # the trainer's initialisation for the same seed (its checkpoint0000.pth)
        torch.manual_seed(args.seed)
        model = otl.build_model(otl.ModelConfig(
            arch=preset["arch"], k=args.k, small_stem=preset["small_stem"], width=args.width,
            mean=tuple(manifest["channel_mean"]), std=tuple(manifest["channel_std"]))).to(device)
    if device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {}
    for bn in ("eval", "batch"):
        outs = otl.label_pass(model, images, args.img_size, 256, device, bn=bn, views=1,
                              generator=gen, progress=not args.no_progress)[0]   # (N, k)
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
    out = {"n": images.shape[0], "k": args.k, "img_size": args.img_size, "arch": preset["arch"],
           "width": args.width, "small_stem": preset["small_stem"], "results": rows,
           "command": utils.command_line(), "git_commit": utils.git_commit()}
    utils.write_json(out, os.path.join(args.output, "label_bn.json"))
    return out


STUDIES = {"label-bn": label_bn}


def main(args):
    return STUDIES[args.study](args)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
