"""The presets that stand for a paper protocol against paper_tables.json's "protocols": every value
utils.PRESET_SOURCES attributes to the paper equals the protocol entry it names, every protocol
setting a preset key can hold is taken, and every other key is marked as ours."""
import json
import math
import os

import pytest
import torch

import utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATURAL_PX = 32     # CIFAR-10/100's and SVHN's own size (prepare_data.py), ResNet-50's protocol
ARCH = {"ResNet-18": "resnet18", "ResNet-50": "resnet50", "AlexNet": "alexnet",
        "a larger AlexNet": "alexnet"}


@pytest.fixture(scope="module")
def protocols():
    with open(os.path.join(ROOT, "paper_tables.json")) as fh:
        return json.load(fh)["protocols"]


def entry(protocols, path):
    node = protocols
    for part in path.split("."):
        node = node[part]
    assert "value" in node and "line" in node, path
    return node


def paper_path(source):
    return source[len("paper: "):].split(" ")[0]


def expected(key, path, e, preset):
    """The preset value that the protocol entry `e` (at `path`) gives for `key`."""
    v, leaf = e["value"], path.rsplit(".", 1)[1]
    if key == "arch":
        return ARCH[v]
    if key == "img_size":
        return v["crop"] if isinstance(v, dict) else {"the data set's own size": NATURAL_PX}[v]
    if key == "schedule":
        assert leaf == "lr_drop_epochs" and v, path
        return "step"
    if key == "lr_values" and leaf == "lr_drop_factor":
        return [preset["lr"] * v ** (i + 1) for i in range(len(preset["lr_drops"]))]
    if key == "aug":
        return ("strong" if leaf == "strong_augmentation" or v == "strong augmentation in every run"
                else {"no strong augmentation, no LCT": "simple"}[v])
    if key == "cutout":
        return v["cutout_length"]
    if key == "n_ops":
        return v["augment_ops"]
    if key == "crop":
        return v["crop"] / v["resize"] if isinstance(v, dict) else {"the data set's own size": 1.0}[v]
    if key == "flip":
        return {"random cropping, color jitter, horizontal flipping and so on": True,
                "as CIFAR's without horizontal flipping": False}[v]
    if key == "lct":
        if leaf == "strong_augmentation":
            assert "LCT" in e["where"], path
            return True
        return {"no strong augmentation, no LCT": False}[v]
    return v


def same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


@pytest.mark.parametrize("name", utils.PAPER_PRESETS)
def test_paper_preset_values_are_the_papers(name, protocols):
    """Each key is the paper's (and equals the entry it names) or ours; no key is left out."""
    preset, sources = utils.PRESETS[name], utils.PRESET_SOURCES[name]
    assert set(sources) == set(preset), name
    for key, src in sources.items():
        if src.startswith("paper: "):
            path = paper_path(src)
            want = expected(key, path, entry(protocols, path), preset)
            assert same(preset[key], want), (name, key, preset[key], want, path)
        else:
            assert src == "ours" or src.startswith("ours ("), (name, key, src)


# Every protocol setting that a preset key can hold, by the preset that carries the protocol.
TAKEN = {
    "paper": ["resnet18_remote_sensing." + p for p in (
        "network", "k_clusters", "image_size", "strong_augmentation", "from_scratch.epochs",
        "from_scratch.lr", "from_scratch.lr_drop_epochs", "from_scratch.lr_after_drops")],
    "transfer": ["resnet18_remote_sensing." + p for p in (
        "network", "k_clusters", "image_size", "strong_augmentation", "pretrained_small_sets.epochs",
        "pretrained_small_sets.lr", "pretrained_small_sets.lr_drop_epochs",
        "pretrained_small_sets.lr_after_drops")],
    **{name: [f"{p}.{s}" for s in (
        "network", k, "image_size", "batch_size", "lr", "epochs", "label_update_every_epochs",
        "lr_drop_factor", "lr_drop_epochs", "strong_augmentation", "augmentation")]
       + ["all_experiments.embedding_size"]
       for name, p, k in (("alexnet-cifar", "alexnet_cifar", "k_clusters_cifar10"),
                          ("alexnet-cifar100", "alexnet_cifar", "k_clusters_cifar100"),
                          ("alexnet-svhn", "alexnet_svhn", "k_clusters"))},
    "alexnet-imagenet": ["alexnet_imagenet." + s for s in (
        "network", "k_clusters", "heads", "image_size", "augmentation", "batch_size", "lr",
        "epochs", "label_update_every_epochs", "lr_drop_factor", "lr_drop_epochs")],
    **{name: ["resnet50." + s for s in (
        "network", "k_clusters", "image_size", "augmentation", "epochs", "lr", "lr_after_drops",
        "lr_drop_epochs")] + [f"{p}.{s}" for s in ("batch_size", "label_update_every_epochs",
                                                     "strong_augmentation", "augmentation")]
       for name, p in (("resnet50-cifar", "alexnet_cifar"), ("resnet50-svhn", "alexnet_svhn"))},
}


def test_every_protocol_setting_is_taken(protocols):
    assert set(TAKEN) == set(utils.PAPER_PRESETS)
    for name, paths in TAKEN.items():
        cited = {paper_path(s) for s in utils.PRESET_SOURCES[name].values() if s.startswith("paper")}
        for path in paths:
            entry(protocols, path)
            assert path in cited, (name, path)


def test_auto_takes_the_data_sets_paper_preset():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for ds, name in (("cifar10", "alexnet-cifar"), ("cifar100", "alexnet-cifar100"),
                     ("svhn", "alexnet-svhn"), ("imagenet", "alexnet-imagenet"),
                     ("eurosat", "paper"), (None, "paper")):
        assert utils.preset_for("auto", cuda, ds) == name
    for ds in ("cifar10", "cifar100", "svhn"):
        assert utils.preset_for("auto", cpu, ds) == "cifar-cpu"
    assert utils.preset_for("auto", cpu, "imagenet") == "cpu"
