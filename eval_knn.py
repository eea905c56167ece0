"""Weighted kNN evaluation of frozen features (the paper's protocol; DINO-style voting, Wu et al.
2018).

    python eval_knn.py --checkpoint runs/eurosat/checkpoint.pth

Features of the saved train/test split are extracted once (utils.checkpoint_features) and cached
beside the checkpoint.  --split val scores the training split's validation part against the rest
of it instead (for choices; the test split is for reporting a finished run).  Each test image takes its max(ks) nearest training images by cosine
similarity (one exact FAISS search; without faiss installed, the same exact search as blocks of
matrix products on the feature device), and each neighbour votes for its class with weight
exp(sim / T) (otl.knn_classify); the top-1 accuracy is reported for every k from that one search.
"""
from __future__ import annotations

import argparse
import time

import otl
import utils


def have_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def faiss_search(train, test, K: int, use_gpu="auto"):
    """(sims, idx), both (M, K) best first: the K largest inner products of each test row with
    the training rows (L2-normalised: cosine similarity), from one exact FAISS index (on the GPU
    when this faiss build has GPU support and use_gpu is True or "auto")."""
    import faiss
    import torch
    has_gpu = (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
               and torch.cuda.is_available())
    if use_gpu is True and not has_gpu:
        raise RuntimeError("use_gpu=True but this faiss build has no GPU support (or no GPU is "
                           "visible); install faiss-gpu or use the CPU index")
    res = None   # must outlive the index
    if has_gpu and use_gpu in (True, "auto") and K <= 2048:   # GPU faiss caps k at 2048
        res = faiss.StandardGpuResources()
        index = faiss.GpuIndexFlatIP(res, train.shape[1])
    else:
        index = faiss.IndexFlatIP(train.shape[1])
    index.add(train.numpy())
    sims, idx = index.search(test.numpy(), K)
    return torch.from_numpy(sims), torch.from_numpy(idx).long()


def get_args_parser():
    num, count = utils.finite_float, utils.positive_int     # nan, inf, 0 and -1 refused by name
    p = argparse.ArgumentParser("eval_knn", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ks", type=count, nargs="+", default=[10, 50, 100, 200],
                   help="numbers of neighbours, all answered from one search; 20 to 200 is the "
                        "usual range (DINO reports 20, InstDisc 200); ks above the training-set "
                        "size are clipped")
    p.add_argument("--temperature", type=num, default=0.1,
                   help="T in the vote weight exp(sim / T); 0.07 to 0.1 works well for "
                        "L2-normalised features, larger values approach plain majority voting")
    utils.add_checkpoint_args(p, "knn", "feature extraction and the FAISS index")
    return p


def main(args):
    t0 = time.time()
    utils.print_run_header(args)
    if args.temperature <= 0:
        raise SystemExit(f"--temperature must be > 0, got {args.temperature}")
    if min(args.ks) < 1:
        raise SystemExit(f"--ks must be positive, got {args.ks}")
    device, feats = utils.eval_features(args)
    use_gpu = "auto" if device.type == "cuda" else False
    search = lambda tr, te, K: faiss_search(tr, te, K, use_gpu)   # noqa: E731
    if not have_faiss():
        print("faiss is not installed: exact search by blocks of matrix products (the same "
              "neighbours; pip install faiss-cpu for the FAISS index)", flush=True)
        search = None
    preds = otl.knn_classify(feats["train"], feats["train_labels"], feats["test"], ks=args.ks,
                             T=args.temperature, num_classes=len(feats["classes"]), search=search)
    used = otl.top1(preds, feats["test_labels"])
    # a k above the training rows votes with all of them: kept under the k asked for (a table's
    # kNN@200 column), the k it took said beside
    n_train = len(feats["train_labels"])
    acc = {k: used[min(k, n_train)] for k in sorted(set(args.ks))}
    out = args.output or utils.default_output(args.checkpoint, "knn", args.feature, args.split)
    res = {"knn_top1": {str(k): a for k, a in acc.items()}, "temperature": args.temperature,
           **({"knn_clipped": {str(k): n_train for k in acc if k > n_train}}
              if max(acc) > n_train else {}),
           **utils.eval_record(args, feats, time.time() - t0)}
    utils.write_json(res, out)
    summary = "  ".join(f"k={k}: {a:.2f}" for k, a in acc.items())
    print(f"kNN top-1 (T={args.temperature:g}) {summary} | epoch {feats['epoch']}, "
          f"{res['n_train']} train / {res['n_test']} {args.split} -> {out}", flush=True)
    return res


if __name__ == "__main__":
    main(get_args_parser().parse_args())
