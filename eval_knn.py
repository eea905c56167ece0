"""Weighted kNN evaluation of frozen features (DINO-style, Wu et al. 2018 voting).

    python eval_knn.py --checkpoint runs/eurosat/checkpoint.pth

Features of the saved train/test split are extracted once with otl.checkpoint_features and cached
beside the checkpoint.  Each test image takes its max(ks) nearest training images by cosine
similarity (one exact FAISS search), and each neighbour votes for its class with weight
exp(sim / T); the top-1 accuracy is reported for every k from that one search.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import otl
from otl import git_commit, print_run_header, write_json  # noqa: F401  (re-exported for eval_linear)

__all__ = ["knn_classify", "knn_classify_torch", "knn_accuracy", "top1", "git_commit"]


# ----------------------------------------------------------------------------------------------
# Library
# ----------------------------------------------------------------------------------------------

def _prepare(train_feats, train_labels, test_feats, ks, T, num_classes):
    """Check the inputs; L2-normalised float32 features, int64 labels, clipped sorted ks, C."""
    if (train_feats.dim() != 2 or test_feats.dim() != 2
            or train_feats.shape[1] != test_feats.shape[1]):
        raise ValueError(f"need train (N, D) and test (M, D) features, got "
                         f"{tuple(train_feats.shape)} and {tuple(test_feats.shape)}")
    n = train_feats.shape[0]
    if n == 0:
        raise ValueError("no training features")
    train_labels = torch.as_tensor(train_labels).long().flatten().cpu()
    if train_labels.numel() != n:
        raise ValueError(f"{n} training features but {train_labels.numel()} labels")
    if train_labels.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    for name, x in (("train", train_feats), ("test", test_feats)):
        if not torch.isfinite(x).all():
            raise ValueError(f"{name} features contain NaN or infinite values")
    if T <= 0:
        raise ValueError(f"temperature must be > 0, got {T}")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    if ks[-1] > n:
        warnings.warn(f"k = {[k for k in ks if k > n]} exceed the {n} training samples; "
                      f"clipped to k = {n}", stacklevel=3)
        ks = sorted({min(k, n) for k in ks})
    C = int(train_labels.max()) + 1 if num_classes is None else int(num_classes)
    if C <= int(train_labels.max()):
        raise ValueError(f"num_classes={C} but the labels go up to {int(train_labels.max())}")
    train = F.normalize(train_feats.detach().float().cpu(), dim=1)
    test = F.normalize(test_feats.detach().float().cpu(), dim=1)
    return train, train_labels, test, ks, C


def _default_chunk(n_train: int, n_neighbours: int, num_classes: int) -> int:
    # test rows per block: keep a block's (rows x N_train) similarities and (rows x K) votes near
    # 64 M floats whatever the data set size
    return max(1, (1 << 26) // max(1, n_train + n_neighbours + num_classes))


def _vote(sims, idx, train_labels, ks, T, C, chunk):
    """Weighted votes of the K = max(ks) neighbours (sims, idx: (M, K), best first) for every k
    in ks in one pass: {k: predictions (M,)}.  Deterministic ties: neighbours with equal
    similarity are ordered by training index, and equal class scores go to the lowest class."""
    M, K = idx.shape
    # order neighbours by (-sim, index) so the first k do not depend on how the search broke ties
    o = torch.argsort(idx, dim=1, stable=True)
    sims, idx = sims.gather(1, o), idx.gather(1, o)
    o = torch.argsort(-sims, dim=1, stable=True)
    sims, idx = sims.gather(1, o), idx.gather(1, o)
    preds = {k: torch.empty(M, dtype=torch.long) for k in ks}
    for s in range(0, M, chunk):
        w = (sims[s:s + chunk].double() / T).exp()             # (m, K) vote weights exp(sim / T)
        lab = train_labels[idx[s:s + chunk]]                     # (m, K)
        scores = torch.zeros(w.shape[0], C, dtype=torch.float64)  # (m, C)
        prev = 0
        for k in ks:  # add the neighbours prev..k-1 to the running class scores
            scores.scatter_add_(1, lab[:, prev:k], w[:, prev:k])
            prev = k
            preds[k][s:s + chunk] = scores.argmax(1)  # first maximum: lowest class on a tie
    return preds


def _faiss_index(d: int, use_gpu, K: int):
    import faiss
    has_gpu = (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
               and torch.cuda.is_available())
    if use_gpu is True and not has_gpu:
        raise RuntimeError("use_gpu=True but this faiss build has no GPU support (or no GPU is "
                           "visible); install faiss-gpu or use the CPU index")
    # GPU faiss caps k at 2048; beyond that the exact CPU index is used
    if has_gpu and use_gpu in (True, "auto") and K <= 2048:
        res = faiss.StandardGpuResources()
        return faiss.GpuIndexFlatIP(res, d), res  # res must outlive the index
    return faiss.IndexFlatIP(d), None


def knn_classify(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor,
                 ks=(10, 50, 100, 200), T: float = 0.1, num_classes: int | None = None,
                 use_gpu="auto", chunk: int | None = None) -> dict:
    """Weighted kNN predictions for every k in `ks`: {k: (M,) int64}.  Features are L2-normalised
    (cosine similarity); one exact inner-product FAISS search (GPU index when faiss has GPU support
    and use_gpu is True or "auto", CPU otherwise) finds max(ks) neighbours, and each votes with
    weight exp(sim / T).  ks above the number of training samples are clipped (with a warning), so
    the keys are the ks actually used.  num_classes defaults to max(train label) + 1; chunk (test
    rows per voting block) defaults to a size derived from the data."""
    train, train_labels, test, ks, C = _prepare(train_feats, train_labels, test_feats, ks, T,
                                                num_classes)
    K = ks[-1]
    index, _res = _faiss_index(train.shape[1], use_gpu, K)
    index.add(train.numpy())
    sims, idx = index.search(test.numpy(), K)  # (M, K) each, best first
    sims, idx = torch.from_numpy(sims), torch.from_numpy(idx).long()
    chunk = chunk or _default_chunk(train.shape[0], K, C)
    return _vote(sims, idx, train_labels, ks, T, C, chunk)


@torch.no_grad()
def knn_classify_torch(train_feats: torch.Tensor, train_labels: torch.Tensor,
                       test_feats: torch.Tensor, ks=(10, 50, 100, 200), T: float = 0.1,
                       num_classes: int | None = None, chunk: int | None = None) -> dict:
    """Brute-force reference for knn_classify (same maths, matmul + topk on blocks of test rows,
    on the CPU): {k: (M,) int64}."""
    train, train_labels, test, ks, C = _prepare(train_feats, train_labels, test_feats, ks, T,
                                                num_classes)
    K = ks[-1]
    chunk = chunk or _default_chunk(train.shape[0], K, C)
    sims, idx = [], []
    for s in range(0, test.shape[0], chunk):
        v, i = (test[s:s + chunk] @ train.T).topk(K, dim=1)  # (m, N) -> (m, K)
        sims.append(v)
        idx.append(i)
    if not sims:
        return {k: torch.empty(0, dtype=torch.long) for k in ks}
    return _vote(torch.cat(sims), torch.cat(idx), train_labels, ks, T, C, chunk)


def top1(preds: dict, labels: torch.Tensor) -> dict:
    """{k: top-1 accuracy in percent} of {k: predictions}."""
    labels = torch.as_tensor(labels).long().flatten().cpu()
    if labels.numel() == 0:
        raise ValueError("no test labels")
    return {k: 100.0 * (p == labels).double().mean().item() for k, p in preds.items()}


def knn_accuracy(train_feats, train_labels, test_feats, test_labels, **kwargs) -> dict:
    """{k: weighted-kNN top-1 accuracy in percent}; kwargs as for knn_classify."""
    return top1(knn_classify(train_feats, train_labels, test_feats, **kwargs), test_labels)


def default_output(checkpoint: str, prefix: str) -> str:
    stem = os.path.splitext(os.path.basename(checkpoint))[0]
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"{prefix}_{stem}.json")


# ----------------------------------------------------------------------------------------------
# Program
# ----------------------------------------------------------------------------------------------

def add_checkpoint_args(p, prefix: str, device_use: str) -> None:
    """The flags every evaluation shares: which checkpoint, data, device, batch, output."""
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint written by train_otl.py; the model and the data set it was "
                        "trained on are rebuilt from it")
    p.add_argument("--data", default=None,
                   help="prepared data folder (prepare_data.py); only needed when the data "
                        "set has moved since training, otherwise the checkpoint's is used")
    p.add_argument("--device", default="auto",
                   help=f"device for {device_use}: auto (CUDA when present), cpu or cuda[:i]")
    p.add_argument("--batch-size", type=int, default=256,
                   help="images per batch for feature extraction; lower it if memory runs out "
                        "(it does not change the features: the model is in eval mode)")
    p.add_argument("--output", default=None,
                   help=f"results JSON; default <checkpoint dir>/{prefix}_<checkpoint stem>.json")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (for logs and batch jobs)")


def get_args_parser():
    p = argparse.ArgumentParser("eval_knn", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[10, 50, 100, 200],
                   help="numbers of neighbours, all answered from one search; 20 to 200 is the "
                        "usual range (DINO reports 20, InstDisc 200); ks above the training-set "
                        "size are clipped")
    p.add_argument("--temperature", type=float, default=0.1,
                   help="T in the vote weight exp(sim / T); 0.07 to 0.1 works well for "
                        "L2-normalised features, larger values approach plain majority voting")
    add_checkpoint_args(p, "knn", "feature extraction and the FAISS index")
    return p


def main(args):
    t0 = time.time()
    print_run_header(args)
    if args.temperature <= 0:
        raise SystemExit(f"--temperature must be > 0, got {args.temperature}")
    if min(args.ks) < 1:
        raise SystemExit(f"--ks must be positive, got {args.ks}")
    device = otl.pick_device(args.device)
    feats = otl.checkpoint_features(args.checkpoint, args.data, device=device,
                                    batch_size=args.batch_size, progress=not args.no_progress)
    preds = knn_classify(feats["train"], feats["train_labels"], feats["test"], ks=args.ks,
                         T=args.temperature, num_classes=len(feats["classes"]),
                         use_gpu="auto" if device.type == "cuda" else False)
    acc = top1(preds, feats["test_labels"])
    out = args.output or default_output(args.checkpoint, "knn")
    res = {"knn_top1": {str(k): a for k, a in acc.items()},
           "checkpoint": os.path.abspath(args.checkpoint), "epoch": feats["epoch"],
           "data_dir": os.path.abspath(feats["data_dir"]), "n_train": feats["train"].shape[0],
           "n_test": feats["test"].shape[0], "feat_dim": feats["train"].shape[1],
           "temperature": args.temperature, "command": shlex.join(sys.argv),
           "args": vars(args), "git_commit": git_commit(), "seconds": time.time() - t0}
    write_json(res, out)
    summary = "  ".join(f"k={k}: {a:.2f}" for k, a in acc.items())
    print(f"kNN top-1 (T={args.temperature:g}) {summary} | epoch {feats['epoch']}, "
          f"{res['n_train']} train / {res['n_test']} test -> {out}", flush=True)
    return res


if __name__ == "__main__":
    main(get_args_parser().parse_args())
