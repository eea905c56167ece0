"""presets.py against paper_tables.json's "protocols": every value a preset attributes to the paper
equals the protocol entry it names, every setting of the protocol a preset carries is taken, every
other key is marked as ours; and how `--preset auto` picks."""
import json
import math
import os

import pytest
import torch

import otl
import presets

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


# the presets that stand for a protocol of the paper; the others are its CPU and one-GPU twins
PROTOCOLS = [name for name in presets.PRESETS if not name.endswith(("cpu", "fast"))]


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_preset_values_are_the_papers_or_ours(name, protocols):
    """Each key is the paper's (and equals the entry it names) or ours; no key is left out."""
    preset, sources = presets.PRESETS[name], presets.SOURCES[name]
    assert set(sources) == set(preset) == set(presets.PRESETS["paper"]), name
    for key, src in sources.items():
        if src.startswith("paper: "):
            path = paper_path(src)
            want = expected(key, path, entry(protocols, path), preset)
            assert same(preset[key], want), (name, key, preset[key], want, path)
        else:
            assert src == "ours" or src.startswith("ours ("), (name, key, src)


# the protocol settings a preset key holds, by their names in paper_tables.json (k_clusters_*:
# the number of clusters of one data set; a drop factor or the rates after the drops: lr_values)
SETTINGS = {"network": "arch", "k_clusters": "k", "heads": "heads", "image_size": "img_size",
            "batch_size": "batch_size", "lr": "lr", "epochs": "epochs",
            "lr_after_drops": "lr_values", "lr_drop_factor": "lr_values",
            "lr_drop_epochs": "lr_drops", "label_update_every_epochs": "label_every",
            "strong_augmentation": "aug", "augmentation": "aug_basic",
            "embedding_size": "embed"}


def _settings(protocols, root):
    """{path: setting} of every protocol entry under `root` that a preset key can hold."""
    out = {}

    def walk(node, path):
        if "value" in node:
            leaf = path.rsplit(".", 1)[1]
            name = "k_clusters" if leaf.startswith("k_clusters") else leaf
            if name in SETTINGS:
                out[path] = SETTINGS[name]
            return
        for key, sub in node.items():
            if isinstance(sub, dict):
                walk(sub, f"{path}.{key}")
    walk(protocols[root], root)
    return out


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_setting_of_a_presets_protocol_is_taken(name, protocols):
    """A preset whose network is a protocol's carries every setting of that protocol (of its own
    branch, e.g. from_scratch or pretrained_small_sets; one k_clusters of a data set) and, from
    a protocol it borrows from ("as on AlexNet"), the settings its own does not give."""
    cited = {paper_path(s) for s in presets.SOURCES[name].values() if s.startswith("paper: ")}
    own = paper_path(presets.SOURCES[name]["arch"]).split(".")[0]
    mine = _settings(protocols, own)
    for root in {p.split(".")[0] for p in cited}:
        for path, setting in _settings(protocols, root).items():
            parent = path.rsplit(".", 1)[0]
            if root != own and setting in mine.values():
                continue                        # the preset's own protocol gives it
            if parent != root and not any(c.startswith(parent + ".") for c in cited):
                continue                        # another preset's branch of the protocol
            assert any(c.rsplit(".", 1)[0] == parent and _settings(protocols, root).get(c) ==
                       setting for c in cited), (name, path)


def test_auto_takes_the_data_sets_protocol():
    for ds, gpu, cpu in (("cifar10", "alexnet-cifar", "cifar-cpu"),
                         ("cifar100", "alexnet-cifar100", "cifar-cpu"),
                         ("svhn", "alexnet-svhn", "cifar-cpu"), ("imagenet", "alexnet-imagenet", "cpu"),
                         ("eurosat", "paper", "cpu"), ("aid", "paper", "cpu"), (None, "paper", "cpu"),
                         ("folder", "paper", "cpu"), ("hmhr", "transfer", "transfer-cpu"),
                         ("siri_whu", "transfer", "transfer-cpu"),
                         ("ucmerced", "transfer", "transfer-cpu")):
        assert presets.preset_for("auto", True, ds) == gpu
        assert presets.preset_for("auto", False, ds) == cpu
    assert presets.preset_for("fast", False) == "fast"
    with pytest.raises(ValueError, match="unknown preset"):
        presets.preset_for("quick", False)


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_builds_and_runs_at_its_size(name):
    p = presets.PRESETS[name]
    natural = name.startswith(("alexnet", "resnet50", "cifar"))
    assert p["rot90"] == (not natural), name
    if p["schedule"] == "step":
        assert len(p["lr_drops"]) == len(p["lr_values"]), name
    cfg = otl.ModelConfig(arch=p["arch"], k=p["k"], heads=p["heads"], embed=p["embed"],
                          width=p["width"], small_stem=p["small_stem"])
    model = otl.build_model(cfg).eval()
    with torch.no_grad():
        out = model(torch.zeros(2, 3, p["img_size"], p["img_size"], dtype=torch.uint8))
    assert out.shape == (2, p["heads"] * p["k"]), name
