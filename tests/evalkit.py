"""Shared helpers of the evaluation tests: a tiny prepared data set and an untrained checkpoint."""
import dataclasses
import json
import os

import torch

import otl
import utils


def _tiny_dataset(root, n_per=10, classes=("a", "b", "c")):
    g = torch.Generator().manual_seed(0)
    C = len(classes)
    labels = torch.arange(C).repeat_interleave(n_per)
    base = torch.tensor([[200, 30, 30], [30, 200, 30], [30, 30, 200]])[labels]  # (N, 3)
    images = (base[:, :, None, None] + torch.randint(-25, 26, (C * n_per, 3, 16, 16), generator=g))
    images = images.clamp(0, 255).to(torch.uint8)
    os.makedirs(root)
    torch.save({"images": images, "labels": labels, "classes": list(classes),
                "files": [f"{classes[y]}/{i}.png" for i, y in enumerate(labels.tolist())]},
               os.path.join(root, "cache.pt"))
    perm = torch.randperm(C * n_per, generator=g).tolist()
    n_test = C * n_per // 3
    with open(os.path.join(root, "split.json"), "w") as fh:
        json.dump({"seed": 0, "test_frac": n_test / (C * n_per), "train": sorted(perm[n_test:]),
                   "test": sorted(perm[:n_test])}, fh)
    with open(os.path.join(root, "manifest.json"), "w") as fh:
        json.dump({"source": "synthetic", "image_size": 16, "classes": list(classes)}, fh)
    return C * n_per - n_test, n_test


def untrained_checkpoint(tmp_path):
    """(checkpoint path, data folder, n_train, n_test) of a fresh k = 8 network on _tiny_dataset."""
    torch.manual_seed(0)
    data_dir = tmp_path / "data"
    n_train, n_test = _tiny_dataset(str(data_dir))
    cfg = otl.ModelConfig(k=8, width=8)
    model = otl.build_model(cfg)
    run = tmp_path / "run"
    run.mkdir()
    ckpt = str(run / "checkpoint.pth")
    utils.save_checkpoint({"model": model.state_dict(), "model_cfg": dataclasses.asdict(cfg),
                           "args": {"data": str(data_dir), "img_size": 16}, "epoch": 0}, ckpt)
    return ckpt, data_dir, n_train, n_test
