"""train_otl.py's presets: each one a base plus the values it changes, every value beside where it
comes from.

A preset fills every training flag the user does not give.  `paper(value, entry)` is a value the
paper gives, `entry` the place in paper_tables.json's "protocols" that says so (tests/test_presets.py
holds each such value to its entry); `ours(value, why)` is one the paper does not give.  A preset
made with `but(base, ...)` keeps the base's values, and where they come from, for every key it
does not change.  docs/presets.md has the runs that chose our values and what each CPU or
one-GPU preset gives up against the paper's protocol.
"""
RS, AX, SV, IN, R50 = ("resnet18_remote_sensing", "alexnet_cifar", "alexnet_svhn",
                       "alexnet_imagenet", "resnet50")


def paper(value, entry: str):
    return value, f"paper: {entry}"


def ours(value, why: str = ""):
    return value, "ours" + (f" ({why})" if why else "")


def but(base: dict, **changes) -> dict:
    return {**base, **changes}


# ---- ResNet-18 on remote-sensing images (the paper's Section 4 protocol)
PAPER = dict(
    arch=paper("resnet18", f"{RS}.network"), k=paper(128, f"{RS}.k_clusters"),
    heads=ours(1), embed=ours(0), width=ours(64, "torchvision's ResNet-18"),
    small_stem=ours(False, "the ImageNet stem"), img_size=paper(224, f"{RS}.image_size"),
    epochs=paper(300, f"{RS}.from_scratch.epochs"), batch_size=ours(256),
    lr=paper(0.03, f"{RS}.from_scratch.lr"),
    schedule=paper("step", f"{RS}.from_scratch.lr_drop_epochs"),
    lr_drops=paper([160, 240], f"{RS}.from_scratch.lr_drop_epochs"),
    lr_values=paper([0.003, 0.0006], f"{RS}.from_scratch.lr_after_drops"),
    views=ours(2), lct=ours(True), aug=paper("strong", f"{RS}.strong_augmentation"),
    cutout=paper(16, f"{RS}.strong_augmentation"), label_every=ours(1), label_views=ours(2),
    warmup_epochs=ours(0), rot90=ours(True, "overhead images have no up"),
    n_ops=paper(10, f"{RS}.strong_augmentation"), flip=ours(True),
    crop=paper(224 / 256, f"{RS}.image_size"))

# a small set started from another run's backbone (train_otl.py --init)
TRANSFER = but(PAPER, epochs=paper(64, f"{RS}.pretrained_small_sets.epochs"),
               lr=paper(0.03, f"{RS}.pretrained_small_sets.lr"),
               schedule=paper("step", f"{RS}.pretrained_small_sets.lr_drop_epochs"),
               lr_drops=paper([32, 48], f"{RS}.pretrained_small_sets.lr_drop_epochs"),
               lr_values=paper([0.003, 0.0006], f"{RS}.pretrained_small_sets.lr_after_drops"))

# `make eurosat` (prepare, train, evaluate) within 30 minutes on 2 CPU cores: 32 px instead of
# 224 (49x less compute), half width (about 3x faster again): the budget study's choice on the
# validation split (docs/presets.md); 34 epochs on a cosine schedule, which suits a short run,
# fit the 30 minutes on the slower of two 2-core machines; 2 strong ops (the paper's 10 cost 11
# kNN points at 32 px), no crop
_SHORT = dict(schedule=ours("cosine", "suits a short run"), lr_drops=ours([]), lr_values=ours([]),
              n_ops=ours(2, "10 cost kNN points at small sizes"), crop=ours(1.0))
CPU = but(PAPER, **_SHORT, width=ours(32, "half width: 2 CPU cores"),
          img_size=ours(32, "2 CPU cores"), epochs=ours(34, "30 minutes of make eurosat on 2 CPU cores"), lr=ours(0.05))

# the paper's network on one GPU in minutes: 112 px (4x less compute than 224; the last stage
# still sees 4 x 4), batch 512 at a larger lr, a short warm-up, Cutout scaled with the image;
# 208 epochs met the paper's EuroSAT figures (100 fell short)
FAST = but(PAPER, **_SHORT, img_size=ours(112, "one GPU in minutes"), epochs=ours(208),
           batch_size=ours(512), lr=ours(0.1), cutout=ours(8, "scaled with the image"),
           warmup_epochs=ours(2))

# the transfer protocol from a `cpu` backbone (half width, 32 px), which its backbone fixes
TRANSFER_CPU = but(TRANSFER, width=CPU["width"], img_size=CPU["img_size"], n_ops=CPU["n_ops"],
                   crop=CPU["crop"])


# ---- AlexNet and ResNet-50 on natural images (the paper's Appendix D protocols)
def alexnet(p: str, k: int, k_entry: str, epochs: int, drops: list, values: list,
            label_every: int, flip: bool = True) -> dict:
    """The paper's AlexNet protocol `p`.  Ours where it is silent: 10 heads and the weight decay
    (train_otl.py's default) as in SeLa's public CIFAR script (github.com/yukimasano/self-label),
    AlexNet's own width, two views, and no 90-degree rotations on natural images."""
    return dict(
        arch=paper("alexnet", f"{p}.network"), k=paper(k, f"{p}.{k_entry}"),
        heads=ours(10, "SeLa's CIFAR script"), embed=paper(128, "all_experiments.embedding_size"),
        width=ours(96, "AlexNet's"), small_stem=ours(False), img_size=paper(224, f"{p}.image_size"),
        epochs=paper(epochs, f"{p}.epochs"), batch_size=paper(128, f"{p}.batch_size"),
        lr=paper(0.05, f"{p}.lr"), schedule=paper("step", f"{p}.lr_drop_epochs"),
        lr_drops=paper(drops, f"{p}.lr_drop_epochs"), lr_values=paper(values, f"{p}.lr_drop_factor"),
        views=ours(2), lct=paper(True, f"{p}.strong_augmentation"),
        aug=paper("strong", f"{p}.strong_augmentation"), cutout=paper(16, f"{p}.strong_augmentation"),
        label_every=paper(label_every, f"{p}.label_update_every_epochs"), label_views=ours(2),
        warmup_epochs=ours(0), rot90=ours(False, "natural images have an up"),
        n_ops=paper(8, f"{p}.strong_augmentation"), flip=paper(flip, f"{p}.augmentation"),
        crop=paper(224 / 256, f"{p}.image_size"))


ALEXNET_CIFAR = alexnet(AX, 128, "k_clusters_cifar10", 1600, [960, 1280], [0.005, 0.0005], 2)
ALEXNET_CIFAR100 = but(ALEXNET_CIFAR, k=paper(512, f"{AX}.k_clusters_cifar100"))
ALEXNET_SVHN = alexnet(SV, 128, "k_clusters", 400, [240, 320], [0.005, 0.0005], 1, flip=False)
# "a larger AlexNet" (its width is not given: ours is AlexNet's), 3000 clusters in one head, no
# strong augmentation and no LCT; one view (ours)
ALEXNET_IMAGENET = but(
    alexnet(IN, 3000, "k_clusters", 450, [160, 300, 380], [0.005, 0.0005, 0.00005], 1),
    heads=paper(1, f"{IN}.heads"), views=ours(1), lct=paper(False, f"{IN}.augmentation"),
    aug=paper("simple", f"{IN}.augmentation"), cutout=ours(0), label_views=ours(1),
    n_ops=ours(8), flip=ours(True))


def resnet50(p: str) -> dict:
    """ResNet-50 at the images' own 32 px; "as on AlexNet" (protocol p) for what it does not give.
    Its small stem (3x3, no max-pool) is ours."""
    other = " (resnet50.other_settings: as on AlexNet)"
    alex = ALEXNET_CIFAR if p == AX else ALEXNET_SVHN
    return but(alex, arch=paper("resnet50", f"{R50}.network"), k=paper(128, f"{R50}.k_clusters"),
               embed=ours(0), width=ours(64, "torchvision's"), small_stem=ours(True),
               img_size=paper(32, f"{R50}.image_size"), epochs=paper(300, f"{R50}.epochs"),
               batch_size=paper(128, f"{p}.batch_size" + other), lr=paper(0.01, f"{R50}.lr"),
               schedule=paper("step", f"{R50}.lr_drop_epochs"),
               lr_drops=paper([160, 240], f"{R50}.lr_drop_epochs"),
               lr_values=paper([0.001, 0.0005], f"{R50}.lr_after_drops"),
               lct=paper(True, f"{p}.strong_augmentation" + other),
               aug=paper("strong", f"{R50}.augmentation"),
               cutout=paper(16, f"{p}.strong_augmentation" + other),
               label_every=paper(alex["label_every"][0], f"{p}.label_update_every_epochs" + other),
               n_ops=paper(8, f"{p}.strong_augmentation" + other),
               flip=paper(alex["flip"][0], f"{p}.augmentation" + other),
               crop=paper(1.0, f"{R50}.image_size"))


# ---- their CPU and one-GPU twins
# make cifar10 on 2 CPU cores: the cpu preset's network at CIFAR's own 32 px, 16 epochs
CIFAR_CPU = but(CPU, epochs=ours(16, "2 CPU cores"), rot90=ours(False, "natural images"))
# CIFAR-10 in one short GPU run, as FAST is EuroSAT's: full width with the small stem at 32 px,
# 64 epochs sized from FAST's measured throughput
CIFAR_FAST = but(FAST, small_stem=ours(True, "keeps resolution at 32 px"), img_size=ours(32),
                 epochs=ours(64, "about 10 minutes of one GPU"), cutout=ours(16),
                 rot90=ours(False, "natural images"))
# the labeler studies' random network: AlexNet at half width on 64 px, one head and view, no LCT
ALEXNET_CIFAR_CPU = but(ALEXNET_CIFAR, **_SHORT, heads=ours(1), width=ours(48, "half width"),
                        img_size=ours(64, "2 CPU cores"), epochs=ours(8), batch_size=ours(256),
                        views=ours(1), lct=ours(False), cutout=ours(5, "scaled with the image"),
                        label_every=ours(1), label_views=ours(1))

_ALL = {"paper": PAPER, "cpu": CPU, "fast": FAST, "transfer": TRANSFER,
        "transfer-cpu": TRANSFER_CPU, "alexnet-cifar": ALEXNET_CIFAR,
        "alexnet-cifar100": ALEXNET_CIFAR100, "alexnet-svhn": ALEXNET_SVHN,
        "alexnet-imagenet": ALEXNET_IMAGENET, "resnet50-cifar": resnet50(AX),
        "resnet50-svhn": resnet50(SV), "alexnet-cifar-cpu": ALEXNET_CIFAR_CPU,
        "cifar-cpu": CIFAR_CPU, "cifar-fast": CIFAR_FAST}
PRESETS = {name: {key: v for key, (v, _) in p.items()} for name, p in _ALL.items()}
SOURCES = {name: {key: src for key, (_, src) in p.items()} for name, p in _ALL.items()}

# `--preset auto`: the paper's protocol for the data set on CUDA, its CPU twin elsewhere
AUTO = {  # data set: (on CUDA, on the CPU); any other data set: (paper, cpu)
    "cifar10": ("alexnet-cifar", "cifar-cpu"), "cifar100": ("alexnet-cifar100", "cifar-cpu"),
    "svhn": ("alexnet-svhn", "cifar-cpu"), "imagenet": ("alexnet-imagenet", "cpu"),
    **{small: ("transfer", "transfer-cpu") for small in ("hmhr", "siri_whu", "ucmerced")},
    # EuroSAT MS: its bands start from an RGB EuroSAT backbone (train_otl.py --init inflates it)
    "eurosat_ms": ("transfer", "transfer-cpu")}


def preset_for(name: str, cuda: bool, dataset: str | None = None) -> str:
    """The preset `name` stands for: 'auto' is AUTO's for the data set (the small sets the paper
    starts from another run's backbone take the transfer protocol), other names as given."""
    if name == "auto":
        return AUTO.get(dataset, ("paper", "cpu"))[0 if cuda else 1]
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from auto, {', '.join(PRESETS)}")
    return name
