"""Linear probe on frozen features: multinomial logistic regression on the backbone features.

    python eval_linear.py --checkpoint runs/eurosat/checkpoint.pth

Features of the saved train/test split come from utils.checkpoint_features (cached beside the
checkpoint, shared with eval_knn.py).  The L2 weight decay is chosen on a seeded, stratified
held-out part of the TRAIN split; the probe is then refitted on the whole train split with that
value and scored once on the test split, which plays no part in the choice.  --split val: the
same with the training split less its validation part as the train split and that part as the
test split (for choices: a preset, a study's pick).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import utils

__all__ = ["linear_probe", "fit_logistic", "DEFAULT_WD_GRID"]

# decades from nearly unregularised (sklearn C ~ 5 at N = 20k) to strong (C ~ 5e-4), for
# standardised features and a mean loss; weak features (early epochs) want the strong end
DEFAULT_WD_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


# ----------------------------------------------------------------------------------------------
# Library
# ----------------------------------------------------------------------------------------------

def _standardise(train: torch.Tensor, *others: torch.Tensor):
    # statistics of the training rows only; constant features get std 1 (they stay 0)
    mean = train.mean(0, keepdim=True)
    std = train.std(0, keepdim=True).nan_to_num(1.0).clamp(min=1e-6)
    return [(x - mean) / std for x in (train, *others)]


def fit_logistic(X: torch.Tensor, y: torch.Tensor, num_classes: int, weight_decay: float,
                 max_iter: int = 500):
    """Multinomial logistic regression, mean cross-entropy + weight_decay / 2 * ||W||^2 (bias not
    decayed), fitted with full-batch L-BFGS from zero on X's device and dtype.  Returns (W, b).

    Why L-BFGS on the whole feature tensor: the problem is convex and small (21,600 x 512 x 10 is
    a few ms per gradient), so a quasi-Newton method reaches the optimum in a few hundred steps
    with no learning rate or schedule to tune, the result is deterministic, and it runs unchanged
    on a GPU; SGD/Adam would need a learning-rate search on top of the weight-decay search."""
    W = torch.zeros(num_classes, X.shape[1], dtype=X.dtype, device=X.device, requires_grad=True)
    b = torch.zeros(num_classes, dtype=X.dtype, device=X.device, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=max_iter, max_eval=max_iter * 5 // 4,
                            tolerance_grad=1e-6, tolerance_change=1e-10, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(X @ W.T + b, y) + 0.5 * weight_decay * W.pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return W.detach(), b.detach()


def _accuracy(W, b, X, y) -> float:
    return 100.0 * ((X @ W.T + b).argmax(1) == y).double().mean().item()


def linear_probe(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor,
                 test_labels: torch.Tensor, grid=DEFAULT_WD_GRID, val_frac: float = 0.1,
                 seed: int = 0, device="cpu", max_iter: int = 500) -> dict:
    """Linear probe with the weight decay chosen on held-out TRAIN data: for each value in `grid`
    fit on (1 - val_frac) of the train split and score the rest (stratified, seeded); refit on the
    whole train split with the best value (ties go to the larger weight decay) and score the test
    split.  Features are standardised with the statistics of the rows being fitted.  Returns
    {"linear_top1", "val_top1", "chosen": {"weight_decay"}, "grid": {value: val top-1}}
    (accuracies in percent).  A grid of one value is nothing to choose: no validation part is
    held out, and val_top1 is None."""
    grid = sorted({float(v) for v in grid})
    if not grid or grid[0] < 0:
        raise ValueError(f"the weight-decay grid must be non-negative values, got {grid}")
    for name, x in (("train", train_feats), ("test", test_feats)):
        if x.dim() != 2 or not torch.isfinite(x).all():
            raise ValueError(f"{name} features must be a finite (N, D) tensor")
    dev = torch.device(device)
    # float64: the problem is tiny, and it makes L-BFGS's stopping tests meaningful
    Xtr = train_feats.detach().to(dev, torch.float64)
    ytr = torch.as_tensor(train_labels).long().flatten().to(dev)
    C = int(ytr.max()) + 1  # classes from the training labels, never a constant

    if test_feats.shape[0] == 0:
        raise ValueError("the test split is empty: nothing to score")
    scores, n_fit, n_val = {grid[0]: None}, ytr.numel(), 0
    if len(grid) > 1:
        per_class = torch.bincount(ytr.cpu(), minlength=C)
        if int(per_class[per_class > 0].min()) < 2:
            raise ValueError("choosing the weight decay needs at least 2 training images of every "
                             f"class (one to fit, one to validate); counts per class: "
                             f"{per_class.tolist()}; pass a single --wd-grid value to skip the choice")
        fit, held = utils.stratified_split(ytr.cpu(), val_frac, seed)
        fit, held = fit.to(dev), held.to(dev)
        n_fit, n_val = int(fit.numel()), int(held.numel())
        Xf, Xv = _standardise(Xtr[fit], Xtr[held])
        for wd in grid:
            W, b = fit_logistic(Xf, ytr[fit], C, wd, max_iter)
            scores[wd] = _accuracy(W, b, Xv, ytr[held])
    # highest validation accuracy; on a tie the stronger regularisation
    best = max(grid, key=lambda v: (scores[v] or 0.0, v))

    Xs, Xte = _standardise(Xtr, test_feats.detach().to(dev, torch.float64))
    W, b = fit_logistic(Xs, ytr, C, best, max_iter)
    yte = torch.as_tensor(test_labels).long().flatten().to(dev)
    return {"linear_top1": _accuracy(W, b, Xte, yte), "val_top1": scores[best],
            "chosen": {"weight_decay": best}, "grid": {f"{v:g}": scores[v] for v in grid},
            "n_fit": n_fit, "n_val": n_val}


# ----------------------------------------------------------------------------------------------
# Program
# ----------------------------------------------------------------------------------------------

def get_args_parser():
    num, count = utils.finite_float, utils.positive_int     # nan, inf, 0 and -1 refused by name
    p = argparse.ArgumentParser("eval_linear", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--val-frac", type=num, default=0.1,
                   help="fraction of the TRAIN split held out (stratified) to choose the weight "
                        "decay; 0.1 leaves a few hundred images per class on EuroSAT-sized data")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split")
    p.add_argument("--wd-grid", type=num, nargs="+", default=list(DEFAULT_WD_GRID),
                   help="L2 weight decays tried (loss = mean CE + wd / 2 ||W||^2 on standardised "
                        "features); decades from 1e-5 to 1e-1 cover weak to strong "
                        "regularisation; if the choice lands on an end, extend the grid that way")
    p.add_argument("--max-iter", type=count, default=500,
                   help="most L-BFGS iterations per fit; 500 is ample: fits usually stop on "
                        "their tolerance well before (under 100 for 21,600 x 512 features)")
    utils.add_checkpoint_args(p, "linear", "feature extraction and the probe (the whole probe, "
                        "6 fits, takes about 20 s on one CPU core for 21,600 x 512 features)")
    return p


def main(args):
    t0 = time.time()
    utils.print_run_header(args)
    if not 0 < args.val_frac < 1:
        raise SystemExit(f"--val-frac must be in (0, 1), got {args.val_frac}")
    if min(args.wd_grid) < 0:
        raise SystemExit(f"--wd-grid values must be >= 0, got {args.wd_grid}")
    device, feats = utils.eval_features(args)
    try:
        probe = linear_probe(feats["train"], feats["train_labels"], feats["test"],
                             feats["test_labels"], grid=args.wd_grid, val_frac=args.val_frac,
                             seed=args.seed, device=device, max_iter=args.max_iter)
    except ValueError as e:
        raise SystemExit(f"linear probe of {args.checkpoint}: {e}") from None
    out = args.output or utils.default_output(args.checkpoint, "linear", args.feature, args.split)
    res = {**probe, **utils.eval_record(args, feats, time.time() - t0)}
    utils.write_json(res, out)
    wd = res["chosen"]["weight_decay"]
    if len(set(args.wd_grid)) > 1 and wd in (min(args.wd_grid), max(args.wd_grid)):
        print(f"note: the chosen weight decay is at an end of --wd-grid {args.wd_grid}; "
              "a wider grid may do better")
    val = "none" if res["val_top1"] is None else f"{res['val_top1']:.2f}"
    print(f"linear top-1 {res['linear_top1']:.2f} (val {val}, weight decay "
          f"{res['chosen']['weight_decay']:g}) | epoch {feats['epoch']}, {res['n_train']} train / "
          f"{res['n_test']} {args.split} -> {out}", flush=True)
    return res


if __name__ == "__main__":
    main(get_args_parser().parse_args())
