"""What Sentinel-2's 13 bands buy over RGB, measured on EuroSAT MS's sample (469 images).

    python bench/multispectral.py --init runs/eurosat/checkpoint.pth --out results/multispectral

Rows (--rows; --help lists them): a random 13-band network (train_otl.py --epochs 0), the RGB
backbone (--init) as it is, inflated to 13 bands (train_otl.py --init's rule), each trained on
with OTL (--preset) on 13 bands and on RGB, and supervised on 13 bands from the same start.

Protocol.  Every network's features of all the images (the test-time view, the model in eval
mode) are scored on --splits seeded stratified 80/20 splits (utils.stratified_split, seeds 0 ..
n - 1, the split prepare_data.py --seed draws): kNN@10 (weighted, T = 0.1, otl.knn_classify) and
the linear probe (eval_linear.linear_probe: its weight decay chosen on 10 % of the training
part); each row gives the mean and sd over the splits.  The OTL runs train without labels once,
on all but one image a class (prepare_data.py --test-frac 0.01, which holds out one per class):
like the RGB backbone, which saw these scenes' RGB images without labels, they see the images of
every split's test part, never a label.  The supervised run sees labels, so it trains once per
split, on that split's training part only.  Everything but the features runs through the stage
scripts; rerunning resumes (finished runs are not trained again).
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import platform
import subprocess
import time

import torch

import eval_linear
import otl
import utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RGB = "B04,B03,B02"
ROWS = {    # row: what it is, its run folder, its data, train_otl.py's flags (INIT: --init's path)
    "random-13": ("a random 13-band network", "random_13", "ms", ["--epochs", 0]),
    "rgb-backbone": ("the RGB backbone on the sample's B04,B03,B02 (untrained here)", "rgb_backbone",
                     "rgb", ["--init", "INIT", "--epochs", 0]),
    "inflated-13": ("that backbone inflated to 13 bands, untrained", "inflated_13", "ms",
                    ["--init", "INIT", "--epochs", 0]),
    "otl-13": ("the inflated backbone trained on with OTL, 13 bands", "otl_13", "ms", ["--init", "INIT"]),
    "otl-rgb": ("the RGB backbone trained on with OTL, B04,B03,B02 only", "otl_rgb", "rgb",
                ["--init", "INIT"]),
    "supervised-13": ("supervised from the inflated backbone, 13 bands (once per split)",
                      "supervised_13_split", "ms", ["--init", "INIT", "--supervised"]),
}


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows:\n" + "\n".join(f"  {r:<15} {v[0]}" for r, v in ROWS.items()))
    p.add_argument("--source", default=os.path.join(ROOT, "..", "shared", "data",
                                                    "EuroSAT_MS_sample.zip"),
                   help="EuroSAT MS (the sample, or the official EuroSATallBands.zip: 27,000 "
                   "images, far longer)")
    p.add_argument("--init", required=True, help="an RGB EuroSAT backbone: a run folder's "
                   "checkpoint.pth of train_otl.py --preset cpu (make eurosat on 2 CPU cores)")
    p.add_argument("--work", default="runs/multispectral", help="prepared data and runs (resumed "
                   "when there)")
    p.add_argument("--out", default="results/multispectral", help="writes OUT.json and OUT.md")
    p.add_argument("--preset", default="transfer-cpu", help="the trained rows' preset: "
                   "transfer-cpu matches a cpu backbone (half width, 32 px)")
    p.add_argument("--epochs", type=utils.positive_int, default=None, help="the trained rows' "
                   "epochs (default: the preset's, 64); fewer to fit a short budget, said in "
                   "the results")
    p.add_argument("--splits", type=utils.positive_int, default=5, help="seeded stratified "
                   "splits each network is scored on (5 or more for a mean and sd)")
    p.add_argument("--rows", default=",".join(ROWS), help="the rows to run, comma-separated")
    p.add_argument("--device", default="cpu", help="device of training and features")
    return p


def stage(script, *flags):
    """A stage script run as a user runs it, its output shown; a failure stops here."""
    cmd = [sys.executable, os.path.join(ROOT, script), *map(str, flags)]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def prepare(args, name, *flags):
    out = os.path.join(args.work, f"data_{name}")
    stage("prepare_data.py", "--dataset", "eurosat_ms", "--source", args.source, "--out", out,
          "--workers", "1", *flags)
    return out


def train(args, data, name, *flags):
    """The run's final checkpoint (trained when not yet there)."""
    out = os.path.join(args.work, name)
    epochs = ["--epochs", args.epochs] if args.epochs and "--epochs" not in flags else []
    stage("train_otl.py", "--data", data, "--output", out, "--preset", args.preset, "--device",
          args.device, "--no-progress", *epochs, *flags)
    return os.path.join(out, "checkpoint.pth")


def features(ckpt, data, device):
    """(N, D) features of every image of `data` (its cache's order) and the labels (N,)."""
    model, ck = utils.load_checkpoint(ckpt, device)
    run = ck["args"]
    d = utils.load_prepared(data, run["img_size"])
    f = otl.extract_features(model, d["images"], run["img_size"], 256, device, progress=False,
                             crop=run.get("crop", 1.0))
    return f, d["labels"]


def scored(work, ckpt, data, device, labels, splits):
    """[score of each split] of a checkpoint's features, kept in WORK/scores.json by the
    checkpoint's sha256 and the splits' seeds, so a rerun (or a row added later) scores only
    what is new."""
    path, key = os.path.join(work, "scores.json"), f"{utils.sha256_file(ckpt)}:{len(splits)}"
    done = json.load(open(path)) if os.path.isfile(path) else {}
    if key not in done:
        f, lab = features(ckpt, data, device)
        assert torch.equal(lab, labels), "the preparations list the images alike"
        done[key] = [score(f, labels, tr, te) for tr, te in splits]
        utils.write_json(done, path)
    return done[key]


def score(f, labels, train, test):
    """{"knn10", "linear"} top-1 % of features f on one split."""
    pred = otl.knn_classify(f[train], labels[train], f[test], ks=(10,), T=0.1,
                            num_classes=int(labels.max()) + 1)
    knn = otl.top1(pred, labels[test])[10]
    lin = eval_linear.linear_probe(f[train], labels[train], f[test], labels[test])["linear_top1"]
    return {"knn10": round(knn, 2), "linear": round(lin, 2)}


def summary(per_split):
    """{"knn10", "linear"}: {"mean", "sd"} over the splits."""
    return {m: dict(zip(("mean", "sd"), (round(v, 2) for v in utils.mean_sd([s[m] for s in per_split]))))
            for m in ("knn10", "linear")}


def runs_of(args, name, prepared, splits):
    """[(checkpoint, its data, the splits it is scored on)] of a row, trained when not yet."""
    _, folder, kind, flags = ROWS[name]
    flags = [args.init if f == "INIT" else f for f in flags]
    if name != "supervised-13":     # trained once, without labels; scored on every split
        return [(train(args, prepared[kind], folder, *flags), prepared[kind], splits)]
    runs = []                       # it sees labels: trained on each split's training part
    for s, (tr, te) in enumerate(splits):
        data = prepare(args, f"ms_split{s}", "--seed", s)
        assert torch.equal(utils.load_prepared(data)["train_idx"], tr), \
            "prepare_data's split is stratified_split's"
        runs.append((train(args, data, f"{folder}{s}", *flags), data, [(tr, te)]))
    return runs


def main(args):
    t0 = time.time()
    utils.print_run_header(args)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: no row {unknown[0]!r}; rows: {', '.join(ROWS)}")
    if not os.path.isfile(args.init):
        raise SystemExit(f"--init {args.init}: no such checkpoint; train an RGB EuroSAT backbone "
                         "first (make eurosat, or train_otl.py --preset cpu)")
    device = utils.pick_device(args.device)
    # OTL's data: every band, and RGB, each split 459 / 10 (one image a class held out)
    prepared = {"ms": prepare(args, "ms", "--test-frac", "0.01"),
                "rgb": prepare(args, "rgb", "--test-frac", "0.01", "--bands", RGB)}
    labels = utils.load_prepared(prepared["ms"])["labels"]
    splits = [utils.stratified_split(labels, 0.2, s) for s in range(args.splits)]
    results = {}
    for name in (r for r in ROWS if r in rows):
        runs = runs_of(args, name, prepared, splits)
        per = [x for ckpt, data, sp in runs for x in scored(args.work, ckpt, data, device, labels, sp)]
        ck = [utils.rel_path(c) for c, _, _ in runs]
        results[name] = {"what": ROWS[name][0], "checkpoint": ck if name == "supervised-13" else ck[0],
                         "per_split": per, **summary(per)}
        print(name, results[name]["knn10"], results[name]["linear"], flush=True)
    write(args, results, labels, time.time() - t0)


def verdict(results):
    """Whether the bands help: otl-13 against otl-rgb (and inflated-13 against rgb-backbone) on
    the same splits, their mean paired difference beside the sd of each row."""
    lines = []
    for a, b in (("otl-13", "otl-rgb"), ("inflated-13", "rgb-backbone")):
        if a not in results or b not in results:
            continue
        for m in ("knn10", "linear"):
            d = torch.tensor([x[m] - y[m] for x, y in zip(results[a]["per_split"],
                                                             results[b]["per_split"])],
                             dtype=torch.float64)
            sd = max(results[a][m]["sd"] or 0, results[b][m]["sd"] or 0)
            word = ("more than" if abs(d.mean()) > sd else "within")
            lines.append(f"{a} - {b}, {m}: {d.mean():+.2f} points (paired sd {d.std():.2f}; "
                         f"{word} the larger row sd, {sd:.2f}"
                         f"{'; beyond 2 sd' if abs(d.mean()) > 2 * sd else ''})")
    return lines


def write(args, results, labels, seconds):
    man = utils.load_manifest(os.path.join(args.work, "data_ms"))
    epochs = args.epochs or utils.PRESETS[args.preset]["epochs"]
    ck = utils.load_file(args.init)
    backbone = {"epoch": ck.get("epoch"), "of": ck["args"].get("epochs"),
                "preset": ck["args"].get("preset_used"), "git_commit": ck.get("git_commit"),
                "data": ck["args"].get("data")}
    rec = {"command": utils.command_line(), "git_commit": utils.git_commit(),
           "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
           "source": utils.rel_path(args.source), "n_images": int(labels.numel()),
           "bands": man.get("bands"), "init": utils.rel_path(args.init), "backbone": backbone,
           "preset": args.preset,
           "epochs": epochs, "splits": args.splits, "rows": results,
           "verdict": verdict(results), "seconds": round(seconds)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    utils.write_json(rec, args.out + ".json")
    md = ["# Multispectral: what 13 Sentinel-2 bands buy over RGB (EuroSAT MS sample)", "",
          f"`{rec['command']}` at `{rec['git_commit']}`; {rec['n_images']} images, "
          f"{args.splits} stratified 80/20 splits, mean +- sd of top-1 %. Trained rows: "
          f"`{args.preset}`, {epochs} epochs"
          + (f" (the preset's {utils.PRESETS[args.preset]['epochs']} cut to fit)"
             if epochs != utils.PRESETS[args.preset]["epochs"] else "")
          + f", from `{rec['init']}` ({backbone['preset']} preset on {backbone['data']}, epoch "
          f"{backbone['epoch']} of {backbone['of']}). bench/multispectral.py's docstring has the "
          "protocol. The RGB backbone saw these scenes' RGB images (EuroSAT's JPEGs of the same "
          "names) without labels; the OTL rows see the sample's images without labels.", "",
          "| row | what | kNN@10 | linear |", "|---|---|---|---|"]
    for name, r in results.items():
        md.append(f"| {name} | {r['what']} | {r['knn10']['mean']:.1f} +- {r['knn10']['sd']:.1f} "
                  f"| {r['linear']['mean']:.1f} +- {r['linear']['sd']:.1f} |")
    md += ["", *[f"- {line}" for line in rec["verdict"]], ""]
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
