"""Raw archive or folder -> a compact cache (uint8 images, labels, class names) and a saved split.

    python prepare_data.py --dataset eurosat --source ../shared/data/EuroSAT.zip --out data/eurosat
    python prepare_data.py --dataset eurosat_ms --source EuroSATallBands.zip --out data/eurosat_ms
    python prepare_data.py --dataset eurosat --download --out data/eurosat
    python prepare_data.py --dataset cifar10 --source ../shared/data/cifar10_jpg.zip --out data/cifar10
    python prepare_data.py --source my_images/ --out data/mine        # any class-per-folder tree

Multiband TIFFs (more than one band, other than 8-bit RGB: Sentinel-2's 13 bands of uint16) are
read with tifffile and kept as they are: every band, in the file's order, at its dtype (uint8 or
uint16), their mean and std per band in the manifest; --bands keeps some of them.

DATASETS below is the registry of the paper's data sets (class names, images per class, native
and cached size, split, official archive and checksum).  The output folder holds cache.pt,
split.json (the data set's official train / test split, or a seeded random one stratified by
class: the paper's 80/20 protocol) and manifest.json (source, checksum, per-class counts, split,
exact duplicates, skipped files, what differs from the registry).  Rerunning with the same
arguments and an unchanged source reuses the cache; anything else rebuilds it.  The format is
documented in utils.py above `load_prepared`.
"""
import argparse
import hashlib
import io
import json
import os
import pickle
import re
import stat
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch

import utils

IMG_EXT = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp")
# The most pixels an image may have (--max-pixels): a 12000 x 12000 scene would take over 2 GB
# to decode and resize to a cache side of at most 256, so a file this large is far more likely
# a wrong file (a whole scene or a mosaic among patches) than a sample; 50 million (about
# 7000 x 7000) is well above every data set in DATASETS.
MAX_PIXELS = 50_000_000

# ----------------------------------------------------------------------------------------------
# The paper's data sets.  classes: as the official archive's folders name them (compared
# ignoring case, spaces, '-' and '_'; empty where the data name them: ImageNet's WordNet ids);
# per_class: the images per class the data set's paper or page gives (for an official split,
# its training part); native: the side in pixels of its images; size: the side cached by default
# (the remote-sensing protocol resizes to 256 and crops 224, so no larger than 256, and never
# smaller than native unless asked with --size); split: "official" (the data set's own train /
# test, taken from the source) or "random" (the paper's seeded, stratified 80/20).  url and md5 /
# sha256 where an official archive and a published checksum exist; torchvision: the dataset
# class that downloads it (with its own checksums).
# ----------------------------------------------------------------------------------------------
_UCM = ("agricultural airplane baseballdiamond beach buildings chaparral denseresidential forest "
        "freeway golfcourse harbor intersection mediumresidential mobilehomepark overpass "
        "parkinglot river runway sparseresidential storagetanks tenniscourt")
_AID = dict(Airport=360, BareLand=310, BaseballField=220, Beach=400, Bridge=360, Center=260,
            Church=240, Commercial=350, DenseResidential=410, Desert=300, Farmland=370, Forest=250,
            Industrial=390, Meadow=280, MediumResidential=290, Mountain=340, Park=350, Parking=390,
            Playground=370, Pond=420, Port=380, RailwayStation=260, Resort=290, River=410,
            School=300, SparseResidential=300, Square=330, Stadium=290, StorageTanks=360,
            Viaduct=420)
_PATTERNNET = ("airplane baseball_field basketball_court beach bridge cemetery chaparral "
               "christmas_tree_farm closed_road coastal_mansion crosswalk dense_residential "
               "ferry_terminal football_field forest freeway golf_course harbor intersection "
               "mobile_home_park nursing_home oil_gas_field oil_well overpass parking_lot "
               "parking_space railway river runway runway_marking shipping_yard solar_panel "
               "sparse_residential storage_tank swimming_pool tennis_court transformer_station "
               "wastewater_treatment_plant")
_NWPU = ("airplane airport baseball_diamond basketball_court beach bridge chaparral church "
         "circular_farmland cloud commercial_area dense_residential desert forest freeway "
         "golf_course ground_track_field harbor industrial_area intersection island lake meadow "
         "medium_residential mobile_home_park mountain overpass palace parking_lot railway "
         "railway_station rectangular_farmland river roundabout runway sea_ice ship snowberg "
         "sparse_residential stadium storage_tank tennis_court terrace thermal_power_station "
         "wetland")
_CIFAR10 = "airplane automobile bird cat deer dog frog horse ship truck"
_CIFAR100 = ("apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge "
             "bus butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud "
             "cockroach couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox "
             "girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster "
             "man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter "
             "palm_tree pear pickup_truck pine_tree plain plate poppy porcupine possum rabbit "
             "raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail snake "
             "spider squirrel streetcar sunflower sweet_pepper table tank telephone television "
             "tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm")
_SVHN_TRAIN = [4948, 13861, 10585, 8497, 7458, 6882, 5727, 5595, 5045, 4659]   # digits 0 .. 9
_EUROSAT = ("AnnualCrop Forest HerbaceousVegetation Highway Industrial Pasture PermanentCrop "
            "Residential River SeaLake")
_EUROSAT_N = [3000, 3000, 3000, 2500, 2500, 2000, 2500, 3000, 2500, 3000]
# Sentinel-2's 13 bands in the order EuroSAT MS's GeoTIFFs hold them (they name none): B8A last,
# as the bands' file names sort, not after B08 as in Sentinel-2's own order.  The data say so:
# over the sample in ../shared/data the 10th band's mean is near 0 (B10, cirrus, 1375 nm), the
# 9th's a third of the 8th's (B09, water vapour) and the 13th's as high as the 8th's (B8A, NIR)
SENTINEL2 = tuple("B01 B02 B03 B04 B05 B06 B07 B08 B09 B10 B11 B12 B8A".split())
# band names that are red, green and blue (Sentinel-2's and Landsat 8's B04, B03, B02): train_otl.py
# --init gives them an RGB backbone's filters
RGB_NAMES = ({"b04", "b4", "red"}, {"b03", "b3", "green"}, {"b02", "b2", "blue"})


def _spec(classes, per_class, native, size, split, **more):
    classes = tuple(classes.split()) if isinstance(classes, str) else tuple(classes)
    if isinstance(per_class, int):
        per_class = {c: per_class for c in classes}
    elif isinstance(per_class, list):
        per_class = dict(zip(classes, per_class))
    return dict(classes=classes, per_class=dict(per_class), native=native, size=size,
                split=split, **more)


DATASETS = {
    # remote sensing: the paper's seeded 80/20 split
    "eurosat": _spec(_EUROSAT, _EUROSAT_N, 64, 64, "random", paper="Helber et al., IEEE JSTARS 2019 (EuroSAT RGB)", archive="EuroSAT.zip",
                     md5="c8fa014336c82ac7804f0398fcb19387",
                     url="https://huggingface.co/datasets/torchgeo/eurosat/resolve/"
                         "c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip"),
    # the same scenes with all 13 Sentinel-2 bands, uint16 GeoTIFFs (EuroSATallBands.zip holds
    # them under ds/images/remote_sensing/otherDatasets/sentinel_2/tif/<class>/)
    "eurosat_ms": _spec(_EUROSAT, _EUROSAT_N, 64, 64, "random", bands=SENTINEL2,
                        paper="Helber et al., IEEE JSTARS 2019 (EuroSAT MS: 13 Sentinel-2 bands)",
                        archive="EuroSATallBands.zip",
                        url="https://madm.dfki.de/files/sentinel/EuroSATallBands.zip"),
    "ucmerced": _spec(_UCM, 100, 256, 256, "random", archive="UCMerced_LandUse.zip",
                      paper="Yang and Newsam, ACM SIGSPATIAL 2010 (some images are not 256 x 256)",
                      url="http://weegee.vision.ucmerced.edu/datasets/UCMerced_LandUse.zip"),
    "siri_whu": _spec("agriculture commercial harbor idle_land industrial meadow overpass park "
                      "pond residential river water", 200, 200, 200, "random",
                      paper="Zhao et al., IEEE TGRS 2016 (SIRI-WHU, Google image set)"),
    "aid": _spec(list(_AID), _AID, 600, 256, "random", paper="Xia et al., IEEE TGRS 2017 (AID)"),
    "patternnet": _spec(_PATTERNNET, 800, 256, 256, "random",
                        paper="Zhou et al., ISPRS J. 2018 (PatternNet)"),
    "nwpu_resisc45": _spec(_NWPU, 700, 256, 256, "random",
                           paper="Cheng et al., Proc. IEEE 2017 (NWPU-RESISC45)"),
    "hmhr": _spec("Buildings Farmland Greenbelt Wasteland Water", [121, 106, 112, 93, 101], 256, 256,
                  "random", paper="'How to make high resolution remote sensing image dataset' "
                  "(533 files, of which 496 distinct; 4 images sit in two classes)"),
    # natural images: their official train / test split
    "cifar10": _spec(_CIFAR10, 5000, 32, 32, "official", torchvision="CIFAR10",
                     paper="Krizhevsky 2009 (CIFAR-10: 50,000 train + 10,000 test)"),
    "cifar100": _spec(_CIFAR100, 500, 32, 32, "official", torchvision="CIFAR100",
                      paper="Krizhevsky 2009 (CIFAR-100: 50,000 train + 10,000 test)"),
    "svhn": _spec([str(i) for i in range(10)], _SVHN_TRAIN, 32, 32, "official", torchvision="SVHN",
                  paper="Netzer et al., NIPS workshop 2011 (SVHN: 73,257 train + 26,032 test)"),
    "imagenet": _spec((), {}, 0, 64, "official",
                      paper="Russakovsky et al., IJCV 2015 (ILSVRC-12: 1,000 classes, 732 - 1,300 "
                      "train images each, the 50,000 validation images as test; cached at 64 px "
                      "by default: about 16 GB in memory, so a large machine)"),
    # anything else: a tree of class folders (optionally under train/ and test/ or val/)
    "folder": _spec((), {}, 0, 0, "random", paper="any class-per-folder tree"),
}


def get_args_parser():
    num, count = utils.finite_float, utils.positive_int     # nan, inf, 0 and -1 refused by name
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="folder", choices=list(DATASETS),
                   help="which data set the source holds: its classes and counts are checked, and "
                   "it sets the default --size and split; 'folder' (default) takes any tree of "
                   "class folders")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", help="a local archive or folder in the data set's official layout: "
                     "class folders (in a .zip or a folder; under train/ and test/ or val/ for an "
                     "official split), CIFAR's python pickles (the .tar.gz or its folder), or SVHN's "
                     "train_32x32.mat and test_32x32.mat (their folder)")
    src.add_argument("--download", action="store_true", help="download the official archive "
                     "(checksum verified) into --download-dir, then use it: eurosat, cifar10, "
                     "cifar100, svhn")
    p.add_argument("--download-dir", default="data/downloads", help="where --download puts the archive")
    p.add_argument("--out", required=True, help="output folder for cache.pt, split.json, manifest.json")
    p.add_argument("--size", type=count, default=None, help="side of the cached images in "
                   "pixels (default: the data set's, no larger than 256: 64 for EuroSAT, 256 for "
                   "UC Merced, 32 for CIFAR; 'folder': its images' most common shorter side, at most "
                   "256)")
    p.add_argument("--split", choices=["auto", "official", "random"], default="auto",
                   help="official: the source's own train / test (or val) folders or files; "
                   "random: the seeded, stratified split of --test-frac; auto: official when the "
                   "source has one, else random")
    p.add_argument("--test-frac", type=num, default=0.2, help="fraction of each class held out "
                   "for testing with a random split; 0.2 is the paper's 80/20 protocol")
    p.add_argument("--seed", type=int, default=0, help="seed of the random split")
    p.add_argument("--per-class", type=count, default=None, help="keep only the first N images of each "
                   "class (sorted by name; of each split part): for tests and quick trials, not for "
                   "reported results")
    p.add_argument("--drop-duplicates", action="store_true", help="keep one copy of images that "
                   "are identical (same bytes or same pixels) within a class, and drop every copy "
                   "of an image found in two classes; they are counted in the manifest either way")
    p.add_argument("--skip-bad", action="store_true", help="skip corrupt or unreadable images and list "
                   "them in the manifest (default: stop at the first one, naming it)")
    p.add_argument("--max-pixels", type=count, default=MAX_PIXELS, help="images with more "
                   "pixels (width x height) are refused before they are decoded, naming the file "
                   "(--skip-bad leaves them out): each costs about 3 bytes a pixel in memory per "
                   "worker; the default, 50 million (about 7000 x 7000), is far above any data "
                   "set listed here; raise it only for sources of large scenes")
    p.add_argument("--bands", default=None, help="multiband TIFFs: the bands to keep, in this "
                   "order, comma-separated: 0-based indices (3,2,1) or, where the bands have names "
                   "(--dataset eurosat_ms, or --band-names), names: B04,B03,B02 is RGB; default: "
                   "every band in the file's order (the extra bands are what multispectral data "
                   "adds)")
    p.add_argument("--band-names", default=None, help="multiband TIFFs of --dataset folder: the "
                   "names of the files' bands in order, comma-separated ('sentinel2': EuroSAT MS's "
                   "order, B01 .. B12 then B8A); named bands can be picked by name, and train_otl.py "
                   "--init gives red, green and blue (B04, B03, B02) an RGB backbone's filters")
    p.add_argument("--workers", type=count, default=min(4, os.cpu_count() or 1),
                   help="processes that decode images")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    return p


SPLIT_DIRS = {"train": "train", "test": "test", "val": "test"}


def _class_level(parts):
    """(index of the class folder in each split path, whether the level above it is an official
    split's train/ and test/ (or val/)): the folders all paths share are left out, and so is a
    train/test level."""
    shared = 0
    while (all(len(q) > shared + 1 for q in parts)
           and len({q[shared] for q in parts}) == 1):
        shared += 1
    while shared and any(len(q) - shared < 2 for q in parts):
        shared -= 1
    tops = {q[shared].lower() for q in parts}
    if "train" in tops and tops <= set(SPLIT_DIRS) and len(tops) > 1 and all(len(q) - shared >= 3 for q in parts):
        return shared + 1, True
    if len(tops) == 1 and shared:   # one class: keep its folder as the class
        shared -= 1
    return shared, False


def _classes_of(paths, source):
    """[(class, path, part)] for image paths ("a/b/c.jpg"): the folders all of them share are left
    out (EuroSAT's "2750/", HMHR's "RS Image Dataset/"), and the next folder is the class, or,
    when those are train/ and test/ (or val/), the part of the official split and the folder
    below it the class; images in deeper subfolders belong to that class.  An image with no class
    folder is an error."""
    parts = [p.split("/") for p in paths]
    level, split = _class_level(parts)
    if split:
        return sorted((q[level], p, SPLIT_DIRS[q[level - 1].lower()]) for p, q in zip(paths, parts))
    loose = [p for p, q in zip(paths, parts) if len(q) - level < 2]
    if loose:
        raise ValueError(f"{len(loose)} image(s) in {source} sit outside any class folder (first: "
                         f"{shown(loose[0])}); put each class's images in a folder named after "
                         "the class")
    return sorted((q[level], p, None) for p, q in zip(paths, parts))


def _empty_class_folders(paths, dirs):
    """The folders beside the class folders of `paths` that hold no image (a class folder left
    empty, or holding other files only), sorted: such a class would vanish without a word."""
    parts = [p.split("/") for p in paths]
    level, _ = _class_level(parts)
    parents = {"/".join(q[:level]) for q in parts}
    with_images = {"/".join(q[:i]) for q in parts for i in range(1, len(q))}
    return sorted(d for d in dirs if d.rpartition("/")[0] in parents and d not in with_images)


def shown(name):
    """A file name as messages and the manifest give it: names that are not UTF-8 (which Python
    carries as lone surrogates) with their odd bytes as \\xNN."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _unsafe_member(name):
    """Whether an archive member's path is absolute or climbs out ('..'): 'a/../b', '/etc/x',
    'C:\\x', '\\x'."""
    q = name.replace("\\", "/")
    return q.startswith("/") or re.match(r"^[A-Za-z]:", q) is not None or ".." in q.split("/")


def list_source(source):
    """([(class name, member path, split part or None)] sorted, a fingerprint of the source,
    [(file, why)] of image files that cannot be read as such (a name that is not UTF-8, a
    symlink loop or a dangling link, not a regular file), [folders beside the class folders that
    hold no image]).  Images may sit in subfolders of their class folder."""
    if os.path.isdir(source):
        paths, dirs, bad, fp = [], [], [], hashlib.sha256()
        for root, subdirs, files in os.walk(source):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            dirs += [os.path.relpath(os.path.join(root, d), source).replace(os.sep, "/")
                     for d in subdirs]
            for f in sorted(files):
                if f.lower().endswith(IMG_EXT) and not f.startswith("."):
                    rel = os.path.relpath(os.path.join(root, f), source).replace(os.sep, "/")
                    fp.update(rel.encode("utf-8", "surrogateescape"))
                    try:
                        rel.encode("utf-8")
                        st = os.stat(os.path.join(root, f))
                        if not stat.S_ISREG(st.st_mode):
                            raise OSError("not a regular file")
                    except UnicodeEncodeError:
                        bad.append((shown(rel), "its name is not UTF-8; rename it"))
                        continue
                    except OSError as e:
                        why = e.strerror or str(e)
                        bad.append((rel, f"{why}; replace it with the image or remove it"))
                        fp.update(b"\0bad\n")
                        continue
                    paths.append(rel)
                    fp.update(f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        items = _classes_of(paths, source) if paths else []
        empty = [shown(d) for d in _empty_class_folders(paths, dirs)] if paths else []
        return items, "folder-sha256:" + fp.hexdigest(), bad, empty
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            every = [n for n in z.namelist() if not n.startswith("__MACOSX/")]
        unsafe = [n for n in every if _unsafe_member(n)]
        if unsafe:      # their folders would name wrong classes ('..', '', merged ones)
            raise ValueError(f"{source} holds {len(unsafe)} member(s) whose path leaves the "
                             f"archive (first: {shown(unsafe[0])!r}: an absolute path or a '..' "
                             "part); such archives are refused: repack it with paths relative to "
                             "its top folder")
        names = [n for n in every if n.lower().endswith(IMG_EXT) and not n.endswith("/")]
        dirs = set()            # every folder of the archive, listed or implied by its members
        for n in every:
            q = n.rstrip("/").split("/")
            dirs.update("/".join(q[:i]) for i in range(1, len(q) + n.endswith("/")))
        items = _classes_of(names, source) if names else []
        empty = _empty_class_folders(names, dirs) if names else []
        return items, "sha256:" + utils.sha256_file(source), [], empty
    if tarfile.is_tarfile(source):
        return [], "sha256:" + utils.sha256_file(source), [], []     # CIFAR's pickles: load_arrays
    with open(source, "rb") as fh:
        head = fh.read(4)
    if head in (b"PK\x03\x04", b"PK\x05\x06") or head[:2] == b"\x1f\x8b":
        kind = "zip" if head[:2] == b"PK" else "gzip"
        raise ValueError(f"--source {source} starts as a {kind} archive but cannot be read as one: "
                         "it is cut short or damaged (a download that stopped early?); download "
                         "or copy it again")
    raise ValueError(f"--source {source} is neither a folder nor a zip or tar archive; pass the "
                     "official archive (e.g. ../shared/data/EuroSAT.zip) or a folder of class "
                     "subfolders")


def load_arrays(source):
    """Data sets stored as arrays, not image files: CIFAR-10 / 100's python pickles (the official
    .tar.gz or its unpacked folder) and SVHN's .mat files (their folder).  None when the source
    is neither; else dict(images (N, 3, H, W) uint8, classes, labels, parts, files)."""
    import pickle

    class Arrays(pickle.Unpickler):
        """The official files hold dicts of lists, bytes and numpy arrays: nothing else may be
        built (a crafted pickle would otherwise run code while it loads)."""
        def find_class(self, module, name):
            if module.split(".")[0] == "numpy" and name in ("_reconstruct", "ndarray", "dtype", "scalar"):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{source} holds a pickle that builds {module}.{name}; "
                                         "CIFAR's official files hold only arrays: refused")

    def unpickle(raw):
        return Arrays(io.BytesIO(raw), encoding="bytes").load()

    members = {}
    if os.path.isdir(source):
        for root, _, files in os.walk(source):
            for f in files:
                members[f] = os.path.join(root, f)
        read = lambda f: open(members[f], "rb").read()          # noqa: E731
    elif tarfile.is_tarfile(source):
        tf = tarfile.open(source)
        for m in tf.getmembers():
            if m.isfile():
                members[os.path.basename(m.name)] = m
        read = lambda f: tf.extractfile(members[f]).read()      # noqa: E731
    else:
        return None
    if {"data_batch_1", "test_batch", "batches.meta"} <= set(members):          # CIFAR-10
        meta = unpickle(read("batches.meta"))
        classes = [c.decode() for c in meta[b"label_names"]]
        parts = [(f"data_batch_{i}", "train") for i in range(1, 6)] + [("test_batch", "test")]
        key = b"labels"
    elif {"train", "test", "meta"} <= set(members):                                # CIFAR-100
        classes = [c.decode() for c in unpickle(read("meta"))[b"fine_label_names"]]
        parts, key = [("train", "train"), ("test", "test")], b"fine_labels"
    elif {"train_32x32.mat", "test_32x32.mat"} <= set(members):                   # SVHN
        from scipy.io import loadmat
        imgs, labels, part, files = [], [], [], []
        for f, pt in (("train_32x32.mat", "train"), ("test_32x32.mat", "test")):
            m = loadmat(io.BytesIO(read(f)))
            x = np.ascontiguousarray(m["X"].transpose(3, 2, 0, 1))               # (N, 3, 32, 32)
            y = m["y"].reshape(-1).astype(np.int64) % 10                           # label 10 is digit 0
            imgs.append(x)
            labels += y.tolist()
            part += [pt] * len(y)
            files += [f"{f}:{i}" for i in range(len(y))]
        return dict(images=np.concatenate(imgs), classes=[str(i) for i in range(10)],
                    labels=labels, parts=part, files=files)
    else:
        return None
    imgs, labels, part, files = [], [], [], []
    for f, pt in parts:
        if f not in members:
            raise ValueError(f"{source} lacks {f}: an incomplete copy of the official archive")
        d = unpickle(read(f))
        imgs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels += list(d[key])
        part += [pt] * len(d[key])
        files += [f"{f}:{i}" for i in range(len(d[key]))]
    return dict(images=np.concatenate(imgs), classes=classes, labels=labels, parts=part, files=files)


def _to_rgb(im):
    """A PIL image as 8-bit RGB.  16-bit and 32-bit single-band images (remote sensing's usual
    GeoTIFF and PNG bands) are scaled from their own min..max to 0..255: PIL's convert would clip
    them to 255, an all-white picture.  The range is that of the finite pixels; nan and -inf
    pixels become its low end, +inf its high end.  (image, True when it was scaled)."""
    from PIL import Image
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        finite = np.isfinite(a)     # a float band's nan or inf (no-data) must not set the range
        if not finite.any():
            raise ValueError("no pixel of it is a finite number (all nan or inf)")
        lo, hi = float(a[finite].min()), float(a[finite].max())
        a = np.nan_to_num(a, nan=lo, posinf=hi, neginf=lo)   # no-data as the darkest / brightest
        a = (a - lo) / (hi - lo) * 255 if hi > lo else np.zeros_like(a)
        return Image.fromarray(np.round(a).astype(np.uint8)).convert("RGB"), True
    return im.convert("RGB"), False


def max_file_bytes(max_pixels):
    """The largest image file read: 8 bytes a pixel of an image of max_pixels pixels (twice what
    the widest mode PIL decodes here takes uncompressed, RGBA or 32-bit) and 1 MiB of headers.
    A larger file is no image of this size; a zip member that claims more (a zip bomb) is refused
    from its listed size, before a byte of it is inflated."""
    return 8 * max_pixels + (1 << 20)


def read_image_file(source, z, name, max_pixels):
    """The bytes of image `name` of a folder or of the open zip `z`, its size checked first."""
    size = z.getinfo(name).file_size if z else os.path.getsize(os.path.join(source, name))
    if size > max_file_bytes(max_pixels):
        raise ValueError(f"{size:,} bytes, more than an image of --max-pixels {max_pixels:,} "
                         f"pixels takes ({max_file_bytes(max_pixels):,}): not an image of this "
                         "data set (a zip bomb, or a whole scene); remove it, or raise "
                         "--max-pixels")
    if z:
        return z.read(name)
    with open(os.path.join(source, name), "rb") as fh:
        return fh.read()


def _decode(job):
    """Decode a chunk of images in a worker: (uint8 arrays (3, s, s) or None, [bad (name, why)],
    number of images scaled from 16 or 32 bits, [(sha256 of the file, sha256 of its pixels)]).
    An image of more than max_pixels pixels is bad, found from its header before it is decoded."""
    from PIL import Image, ImageOps
    source, names, size, max_pixels = job
    # PIL's own guard (a warning past its limit, an error past twice that) gives way to this
    # one, which names the file and the flag; restored after (with one worker this is the
    # calling process)
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    z = zipfile.ZipFile(source) if not os.path.isdir(source) else None
    out, bad, scaled, hashes = [], [], 0, []
    try:
        for name in names:
            raw = b""           # (a file too large to read is not looked into below)
            try:
                raw = read_image_file(source, z, name, max_pixels)
                with Image.open(io.BytesIO(raw)) as im:
                    w, h = im.size
                    if w * h > max_pixels:
                        raise ValueError(f"{w} x {h} = {w * h:,} pixels, more than --max-pixels "
                                         f"{max_pixels:,} (decoding it would take about "
                                         f"{3 * w * h / 1e9:.1f} GB); crop or shrink it, or "
                                         "raise --max-pixels")
                    im = ImageOps.exif_transpose(im)   # as a viewer shows it: EXIF orientation
                    im, s = _to_rgb(im)
                    scaled += s
                    pix = np.asarray(im, dtype=np.uint8)
                    if im.size != (size, size):
                        im = im.resize((size, size), Image.BILINEAR, reducing_gap=None)
                    a = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
                out.append(a)
                hashes.append((hashlib.sha256(raw).hexdigest(), _pixel_hash(pix)))
            except Exception as e:  # PIL raises several types for broken files
                why = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", repr(name), str(e))
                bad.append((name, _multiband_among_rgb(name, raw) or f"{type(e).__name__}: {why}"))
                out.append(None)
                hashes.append(None)
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit
        if z:
            z.close()
    return out, bad, scaled, hashes


def _multiband_among_rgb(name, raw):
    """Why a TIFF that PIL cannot read is no image of an RGB set when it is a multiband one, else
    None."""
    try:
        a, _, rgb = tiff_bands(raw) if name.lower().endswith((".tif", ".tiff")) else (None, 0, 0)
    except Exception:       # not a TIFF tifffile reads either: PIL's reason stands
        return None
    if a is None or not is_multiband(a, rgb):
        return None
    return (f"a {a.shape[0]}-band {a.dtype} TIFF among RGB images: prepare multiband TIFFs as a "
            "set of their own (a folder of them alone, --dataset folder or eurosat_ms)")


def _die_with_parent():
    """In a decode worker: end when the process that started it ends, however it ends (kill -9
    gives it no chance to stop its pool, whose workers would otherwise wait for work for good,
    holding their memory).  Linux delivers SIGKILL at the parent's death; elsewhere a thread
    watches for the worker to be handed to another parent."""
    import ctypes
    import signal
    import threading
    parent = os.getppid()
    try:
        if ctypes.CDLL(None).prctl(1, signal.SIGKILL) == 0:     # PR_SET_PDEATHSIG
            if os.getppid() != parent:      # the parent died before the call
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _pixel_hash(a):
    """(H, W, 3) or (3, H, W) uint8 -> sha256 of its shape and pixels."""
    return hashlib.sha256(str(a.shape).encode() + np.ascontiguousarray(a).tobytes()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Multiband TIFFs (tifffile): every band kept at its dtype
# ----------------------------------------------------------------------------------------------
BAND_DTYPES = ("uint8", "uint16")


def tiff_bands(raw):
    """(bands (C, H, W) numpy at the file's dtype, its GDAL_NODATA value or None, whether its
    photometric interpretation is RGB) of a TIFF's bytes: its first image, bands as samples of a
    pixel (YXS) or as planes or pages (SYX)."""
    import tifffile
    with tifffile.TiffFile(io.BytesIO(raw)) as tf:
        series, page = tf.series[0], tf.pages[0]
        a = series.asarray()
        nodata = page.tags.get("GDAL_NODATA")
        rgb = page.photometric == tifffile.PHOTOMETRIC.RGB
        axes = series.axes
    if a.ndim == 2:
        a = a[None]
    elif a.ndim == 3 and axes.endswith("S"):
        a = a.transpose(2, 0, 1)
    elif a.ndim != 3:
        raise ValueError(f"it holds a {a.ndim}-d array ({axes}); a multiband image is one 2-d "
                         "image of bands: save each image as its own file")
    try:
        nodata = float(str(nodata.value).strip("\x00 ")) if nodata is not None else None
    except ValueError:
        nodata = None
    return np.ascontiguousarray(a), nodata, rgb


def is_multiband(a, rgb):
    """Whether a TIFF's bands are not an image PIL reads as colour: more than one band, unless
    they are 8-bit RGB(A).  One band (gray, or a 16-bit band scaled to 8 bits) stays PIL's."""
    return a.shape[0] > 1 and not (rgb and a.dtype == np.uint8)


def band_problem(a, nodata, first=None):
    """Why the bands a (C, H, W) of one image cannot join a multiband set whose first image is
    `first` ((C, H, W, dtype) or None for the first itself), or None: another band count, size or
    dtype, NaN pixels, no-data pixels (the file's GDAL_NODATA value in any band; without one, 0 in
    every band, Sentinel-2's fill value), or a dtype other than uint8 and uint16."""
    c, h, w = a.shape
    if first is not None and c != first[0]:
        return (f"it has {c} band(s) and the first image {first[0]}: every image of a multiband "
                "set needs the same bands; remove it or save it with the others' bands")
    if first is not None and (h, w) != first[1:3]:
        return (f"it is {w} x {h} pixels and the first image {first[2]} x {first[1]}: every "
                "image of a multiband set needs the same size; crop or resample it")
    if a.dtype.kind == "f" and np.isnan(a).any():
        return (f"{int(np.isnan(a).any(0).sum())} of its pixels are NaN (no data): the network "
                "would learn the fill; crop or fill them, or leave the image out (--skip-bad)")
    bad = (a == nodata).any(0) if nodata is not None else (a == 0).all(0)
    if bad.any():
        what = f"GDAL_NODATA {nodata:g}" if nodata is not None else "0 in every band"
        return (f"{int(bad.sum())} of its pixels are no-data ({what}): the network would learn "
                "the fill; crop or fill them, or leave the image out (--skip-bad)")
    if first is not None and a.dtype != first[3]:
        return f"its bands are {a.dtype} and the first image's {first[3]}: convert it to theirs"
    if a.dtype.name not in BAND_DTYPES:
        return (f"its bands are {a.dtype}; multiband images are kept as uint8 or uint16: store "
                "them so (reflectance x 10000 as uint16 is Sentinel-2's own convention)")
    return None


def _band_list(text):
    return [b.strip() for b in text.split(",") if b.strip()] if text else None


def multiband(args, spec, source, name):
    """None when the source's first image `name` is not a multiband TIFF (the RGB path reads it),
    else what prepare needs of the set: dict(shape (C, H, W, dtype) of the first image, pick
    (the kept bands' indices), names (of the kept bands, or None), rgb (indices of red, green and
    blue among the kept bands, or None)).  A named multiband set (eurosat_ms) must find one, an RGB
    set must not; every problem one line (SystemExit) naming the file and what to do."""
    tiff = name.lower().endswith((".tif", ".tiff"))
    a = None
    if tiff:
        try:
            with zipfile.ZipFile(source) if not os.path.isdir(source) else nullcontext() as z:
                a, nodata, rgb = tiff_bands(read_image_file(source, z, name, args.max_pixels))
        except Exception as e:          # tifffile raises several types for broken files
            if spec.get("bands"):
                raise SystemExit(f"cannot read {shown(name)} in {source} as a TIFF ({e}); "
                                 "replace the file") from None
    multi = a is not None and is_multiband(a, rgb)
    if not multi:
        if spec.get("bands"):
            raise SystemExit(f"{shown(name)} in {source} is not a multiband TIFF; --dataset "
                             f"{args.dataset} holds {len(spec['bands'])}-band GeoTIFFs: is "
                             "--source right?")
        if args.bands or args.band_names:
            raise SystemExit(f"--bands and --band-names pick bands of multiband TIFFs; "
                             f"{shown(name)} in {source} is not one (an RGB or gray image)")
        return None
    what = f"a {a.shape[0]}-band {a.dtype} TIFF"
    if args.dataset != "folder" and not spec.get("bands"):
        raise SystemExit(f"{shown(name)} in {source} is {what}, and --dataset {args.dataset} is "
                         "a set of RGB images: pass --dataset eurosat_ms for EuroSAT's 13 bands, "
                         "or --dataset folder for any multiband TIFFs")
    why = band_problem(a, nodata)
    if why:
        raise SystemExit(f"cannot use {shown(name)} in {source} ({what}): {why}")
    names = spec.get("bands")
    if args.band_names:
        if spec.get("bands"):
            raise SystemExit(f"--band-names: --dataset {args.dataset} names its bands "
                             f"({','.join(names)}); drop the flag")
        names = (SENTINEL2 if args.band_names.strip().lower() == "sentinel2"
                 else _band_list(args.band_names))
    if names is not None and len(names) != a.shape[0]:
        raise SystemExit(f"{shown(name)} in {source} is {what}; "
                         f"{'--band-names' if args.band_names else '--dataset ' + args.dataset} "
                         f"names {len(names)} bands ({','.join(names)}): is --source right?")
    pick = list(range(a.shape[0]))
    if args.bands:
        pick = []
        lower = [n.lower() for n in names] if names else []
        for b in _band_list(args.bands):
            if b.isdigit() and int(b) < a.shape[0]:
                pick.append(int(b))
            elif b.lower() in lower:
                pick.append(lower.index(b.lower()))
            else:
                have = (f"its bands are {','.join(names)} or 0 .. {a.shape[0] - 1}" if names else
                        f"its bands are 0 .. {a.shape[0] - 1} (they have no names: --band-names "
                        "names them)")
                raise SystemExit(f"--bands {args.bands}: {shown(name)} in {source} is {what} and "
                                 f"has no band {b!r}; {have}")
        if len(set(pick)) != len(pick):
            raise SystemExit(f"--bands {args.bands} names a band twice; name each once")
    kept = [names[i] for i in pick] if names else None
    rgb = None
    if kept:
        found = [[i for i, n in enumerate(kept) if n.lower() in want] for want in RGB_NAMES]
        rgb = [f[0] for f in found] if all(found) else None
    return {"shape": (a.shape[0], a.shape[1], a.shape[2], a.dtype.name), "pick": pick,
            "names": kept, "rgb": rgb}


def _resize_bands(a, size):
    """(C, H, W) integer bands -> (C, size, size) at the same dtype, antialiased bilinear."""
    if a.shape[1:] == (size, size):
        return a
    x = torch.from_numpy(a.astype(np.float32))[None]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                                        align_corners=False)[0]
    return x.round_().clamp_(0, np.iinfo(a.dtype).max).numpy().astype(a.dtype)


def _decode_tiffs(job):
    """_decode for multiband TIFFs: the kept bands (C', size, size) at the first image's dtype, or
    None with why (band_problem) for each image."""
    source, names, size, max_pixels, multi = job
    z = zipfile.ZipFile(source) if not os.path.isdir(source) else None
    out, bad, hashes = [], [], []
    try:
        for name in names:
            try:
                raw = read_image_file(source, z, name, max_pixels)
                a, nodata, _ = tiff_bands(raw)
                why = band_problem(a, nodata, tuple(multi["shape"]))
                if why:
                    raise ValueError(why)
                a = np.ascontiguousarray(a[multi["pick"]])
                hashes.append((hashlib.sha256(raw).hexdigest(), _pixel_hash(a)))
                out.append(_resize_bands(a, size))
            except Exception as e:  # tifffile raises several types for broken files
                bad.append((name, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
                out.append(None)
                hashes.append(None)
    finally:
        if z:
            z.close()
    return out, bad, 0, hashes


def decode_all(source, names, size, workers, progress=True, max_pixels=MAX_PIXELS, multi=None):
    """_decode (or, for a multiband set, `multi` from multiband(): _decode_tiffs) of every name, in
    chunks over `workers` processes."""
    from tqdm import tqdm
    chunk = 500
    jobs = [(source, names[i:i + chunk], size, max_pixels, *([multi] if multi else []))
            for i in range(0, len(names), chunk)]
    decode_chunk = _decode_tiffs if multi else _decode
    results = []
    bar = tqdm(total=len(names), desc="decoding", unit="img", disable=not progress, dynamic_ncols=True)
    if workers > 1:
        with ProcessPoolExecutor(workers, initializer=_die_with_parent) as ex:
            for r in ex.map(decode_chunk, jobs):
                results.append(r)
                bar.update(len(r[0]))
    else:
        for j in jobs:
            results.append(decode_chunk(j))
            bar.update(len(j[1]))
    bar.close()
    images = [a for r in results for a in r[0]]
    bad = [b for r in results for b in r[1]]
    hashes = [h for r in results for h in r[3]]
    return images, bad, sum(r[2] for r in results), hashes


def find_duplicates(files, classes_of, hashes):
    """Groups of identical images (same file bytes or same decoded pixels): {"files", "distinct",
    "groups" (lists of file names, each of 2 or more), "cross_class" (the groups whose files sit
    in more than one class)}.  hashes[i]: (byte hash or None, pixel hash) of files[i]."""
    parent = list(range(len(files)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for which in (0, 1):
        first = {}
        for i, h in enumerate(hashes):
            if h[which] is None:
                continue
            j = first.setdefault(h[which], i)
            if j != i:
                parent[root(i)] = root(j)
    groups = {}
    for i in range(len(files)):
        groups.setdefault(root(i), []).append(i)
    dup = [g for g in groups.values() if len(g) > 1]
    return {"files": len(files), "distinct": len(groups),
            "groups": [[files[i] for i in g] for g in dup],
            "cross_class": [[files[i] for i in g] for g in dup if len({classes_of[i] for i in g}) > 1],
            "_index_groups": dup}


def _normal(name):
    return re.sub(r"[\s_\-]", "", name).lower()


def check_against_registry(dataset, classes, counts, parts):
    """What differs from the data set's registry entry, as lines to print (empty: all as expected);
    counts None: the classes only (a --per-class subset)."""
    spec = DATASETS[dataset]
    if not spec["classes"]:
        return []
    notes = []
    want = {_normal(c): c for c in spec["classes"]}
    have = {_normal(c): c for c in classes}
    missing = [want[c] for c in want if c not in have]
    extra = [have[c] for c in have if c not in want]
    if missing or extra:
        notes.append(f"the classes differ from {dataset}'s {len(want)}: missing {missing[:5]}"
                     f"{'...' if len(missing) > 5 else ''}, not expected {extra[:5]}"
                     f"{'...' if len(extra) > 5 else ''} (is --dataset right? --dataset folder "
                     "takes any classes)")
    off = {c: (counts.get(have[_normal(c)], 0), n) for c, n in spec["per_class"].items()
           if counts is not None and _normal(c) in have and counts.get(have[_normal(c)], 0) != n}
    if off:
        c, (got, n) = next(iter(off.items()))
        notes.append(f"{len(off)} class(es) hold another number of {'training ' if parts else ''}"
                     f"images than {dataset} has (first: {c} {got}, expected {n})")
    return notes


FILES = ("cache.pt", "split.json")   # what the manifest vouches for, by checksum


def _check_folder(out, key):
    """(manifest, None) when the folder holds a complete cache made with `key` whose files are
    the ones its manifest names (sha256), else (manifest or None, why not)."""
    try:
        with open(os.path.join(out, "manifest.json")) as fh:
            man = json.load(fh)
    except (OSError, ValueError):
        return None, "incomplete (its manifest.json cannot be read)"
    if man.get("key") != key:
        return man, "stale (made from another source or with other flags)"
    sums = man.get("files_sha256", {})
    for f in FILES:
        path = os.path.join(out, f)
        if not os.path.isfile(path) or sums.get(f) != utils.sha256_file(path):
            return man, f"damaged ({f} is missing or not the file its manifest names)"
    return man, None


def download(dataset, dest):
    """The official archive, checksum verified, into dest; returns what --source would be.
    EuroSAT: the address torchvision's EuroSAT uses, md5 checked by torchvision's download_url;
    CIFAR-10 / 100 and SVHN: torchvision's own dataset classes (their md5s); the others have no
    checksummed official download, so they need --source."""
    info = DATASETS[dataset]
    os.makedirs(dest, exist_ok=True)
    if info.get("torchvision"):
        import torchvision.datasets as tvd
        cls = getattr(tvd, info["torchvision"])
        if dataset == "svhn":
            for part in ("train", "test"):
                cls(dest, split=part, download=True)
        else:
            for train in (True, False):
                cls(dest, train=train, download=True)
        return dest
    if not info.get("md5") or not info.get("url"):
        raise SystemExit(f"{dataset} has no official download with a published checksum; download "
                         f"it yourself{' from ' + info['url'] if info.get('url') else ''} and pass "
                         "--source")
    from torchvision.datasets.utils import download_url
    download_url(info["url"], dest, filename=info["archive"], md5=info["md5"])
    return os.path.join(dest, info["archive"])


def _common_side(source, names):
    """The 'folder' default size: the most common shorter side of the images (read from their
    headers), at most 256, so that one odd image does not set every image's size; the images of
    another side are named on stderr (they are resized to it)."""
    from PIL import Image
    sides = {}
    z = zipfile.ZipFile(source) if not os.path.isdir(source) else None
    try:
        for name in names:
            try:
                with Image.open(z.open(name) if z else os.path.join(source, name)) as im:
                    sides.setdefault(min(im.size), []).append(name)
            except Exception:   # a bad image is reported by the decoder, by name
                pass
    finally:
        if z:
            z.close()
    if not sides:
        return 64
    side = max(sides, key=lambda s: (len(sides[s]), s))
    odd = sorted((n, s) for s, ns in sides.items() if s != side for n in ns)
    if odd:
        print(f"{len(odd)} of {sum(map(len, sides.values()))} images are not {side} px on their "
              f"shorter side, the most common one, and are resized to it (first: "
              + ", ".join(f"{shown(n)} {s} px" for n, s in odd[:3])
              + "); pass --size to choose another", file=sys.stderr)
    return min(256, side)


def _resize_arrays(images, size):
    """uint8 (N, 3, H, W) numpy -> uint8 (N, 3, size, size), antialiased bilinear."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    out = []
    for s in range(0, len(images), 4096):
        x = torch.from_numpy(images[s:s + 4096]).float()
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)
        out.append(x.round_().clamp_(0, 255).to(torch.uint8).numpy())
    return np.concatenate(out)


def _first_per_class(n, classes_of, parts, per_class):
    """Indices (sorted) of the first per_class items of each (split part, class)."""
    seen, keep = {}, []
    for i in range(n):
        key = (parts[i], classes_of[i])
        if seen.get(key, 0) < per_class:
            seen[key] = seen.get(key, 0) + 1
            keep.append(i)
    return keep


def main(args):
    """prepare() in the --out folder, which this run holds (a second prepare_data.py on it stops at
    once, naming this one): two runs writing one folder would leave one's manifest beside the
    other's cache.  A folder made here and left empty (the source was wrong) is removed again."""
    t0 = time.time()
    utils.print_run_header(args)
    if not 0 < args.test_frac < 1:
        raise SystemExit(f"--test-frac must be between 0 and 1, got {args.test_frac}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"--out {args.out} is a file; pass a folder (it is created if missing)")
    made = not os.path.exists(args.out)
    utils.make_folder(args.out, "--out")
    release = utils.lock_run_folder(args.out, "--out", "prepare_data.py run")
    try:
        utils.remove_dead_temporaries(args.out)      # of a run killed mid-write
        return prepare(args, t0)
    except utils.CannotWrite as e:
        if os.path.isfile(os.path.join(args.out, "manifest.json")):
            raise
        raise SystemExit(f"cannot write {e.path}: {e.reason}; {args.out} is incomplete: without "
                         "its manifest.json (written last, and removed first by a rebuild) no "
                         f"stage takes it for prepared data; {e.fix}") from None
    finally:
        release()
        if made and os.path.isdir(args.out) and not os.listdir(args.out):
            os.rmdir(args.out)


def prepare(args, t0):
    """The source listed, decoded and split into args.out (main holds the folder): the manifest
    of the folder, reused when it is up to date."""
    spec = DATASETS[args.dataset]
    source = download(args.dataset, args.download_dir) if args.download else args.source
    if not os.path.exists(source):
        raise SystemExit(f"--source {source} does not exist; pass the official archive "
                         "(e.g. ../shared/data/EuroSAT.zip), a folder of class subfolders, or "
                         "--download")
    src = read_source(source, args.skip_bad)
    picked = list(range(len(src.names)))
    if args.per_class:
        picked = _first_per_class(len(src.names), src.classes_of, src.parts, args.per_class)
    has_parts = src.parts[0] is not None
    split = args.split if args.split != "auto" else ("official" if has_parts else "random")
    if split == "official" and not has_parts:
        raise SystemExit(f"--split official: {source} has no train / test parts (train/ and test/ "
                         "or val/ folders, or the official files); use --split random")
    multi = None if src.arrays is not None else multiband(args, spec, source, src.names[picked[0]])
    if src.arrays is not None and (args.bands or args.band_names):
        raise SystemExit(f"--bands and --band-names pick bands of multiband TIFFs; {source} holds "
                         "RGB arrays")
    size = args.size or spec["size"] or (32 if src.arrays is not None else
                                         min(256, *multi["shape"][1:3]) if multi else
                                         _common_side(source, [src.names[i] for i in picked]))
    key = {"dataset": args.dataset, "source": os.path.abspath(source),
           "fingerprint": src.fingerprint, "size": size, "test_frac": args.test_frac,
           "seed": args.seed, "per_class": args.per_class, "skip_bad": args.skip_bad,
           "split": split, "drop_duplicates": args.drop_duplicates, "max_pixels": args.max_pixels}
    if multi:           # (RGB sets keep the key they had, so their caches are reused)
        key.update(bands=multi["pick"], band_names=multi["names"])
    man_path = os.path.join(args.out, "manifest.json")
    if not args.force and os.path.isfile(man_path):
        old, why = _check_folder(args.out, key)
        if why is None:
            print(f"cache in {args.out} is up to date ({old['n_images']} images); reusing it")
            return old
        print(f"cache in {args.out} is {why}; rebuilding")
    if os.path.isfile(man_path):   # from here until the new manifest, the folder is incomplete
        os.remove(man_path)

    names, classes_of, parts = ([x[i] for i in picked] for x in (src.names, src.classes_of, src.parts))
    classes = sorted(set(classes_of)) if src.arrays is None else list(src.arrays["classes"])
    print(f"{args.dataset}: {len(names)} images in {len(set(classes_of))} classes from {source}, "
          f"at {size} px, {split} split" + (f", {len(multi['pick'])} of {multi['shape'][0]} "
                                            f"bands ({multi['shape'][3]})" if multi else ""))
    images, bad, scaled, hashes = decode(args, source, src, names, picked, size, multi)
    keep = [i for i, a in enumerate(images) if a is not None]
    if not keep:
        raise SystemExit(f"none of the {len(names)} images in {source} could be read (first: "
                         f"{bad[0][0]}: {bad[0][1]})")
    notes, warnings = findings(args, source, src, classes, classes_of, parts, keep)
    keep, dups = duplicates(args, names, classes_of, keep, hashes)

    labels = torch.tensor([classes.index(classes_of[i]) for i in keep], dtype=torch.long)
    imgs = torch.from_numpy(np.stack([images[i] for i in keep]))  # (N, C, size, size) uint8 / 16
    files = [names[i] for i in keep]
    if split == "official":
        train = [j for j, i in enumerate(keep) if parts[i] == "train"]
        test = [j for j, i in enumerate(keep) if parts[i] == "test"]
    else:
        train, test = (t.tolist() for t in utils.stratified_split(labels, args.test_frac, args.seed))
    if not train or not test:
        raise SystemExit(f"the {len(files)} images split into {len(train)} for training and "
                         f"{len(test)} for testing: every class needs at least 2 images "
                         f"(per class: {torch.bincount(labels).tolist()}); raise --per-class or "
                         "add images")
    warnings += one_sided_classes(classes, labels, train, test)
    if scaled:
        print(f"{scaled} images of 16 or 32 bits per pixel were scaled from their own range to "
              "8 bits", file=sys.stderr)
    manifest = {"key": key, "dataset": args.dataset, "about": spec.get("paper"),
                "source": utils.rel_path(source), "checksum": src.fingerprint, "image_size": size,
                "native_size": spec["native"] or None, "n_images": len(files),
                "classes": classes, "split": split, "n_train": len(train), "n_test": len(test),
                "test_frac": args.test_frac if split == "random" else None,
                "split_seed": args.seed if split == "random" else None,
                "duplicates": dups, "registry_notes": notes, "empty_class_folders": src.empty_dirs,
                "warnings": warnings, "skipped": [{"file": n, "error": w} for n, w in bad],
                "scaled_to_8_bit": scaled}
    if multi:           # absent: 3 bands of uint8 colour
        manifest.update(channels=len(multi["pick"]), dtype=multi["shape"][3],
                        bands=multi["names"], band_index=multi["pick"], rgb_bands=multi["rgb"],
                        source_bands=multi["shape"][0])
    write_folder(args.out, imgs, labels, files, train, test, manifest, t0)
    return manifest


class Source:
    """What a source holds: image files or arrays (CIFAR's, SVHN's), each with its class and split
    part (None without an official split), the source's fingerprint, image files that cannot be
    read as such (unlisted) and folders beside the class folders that hold no image."""

    def __init__(self, names, classes_of, parts, arrays, fingerprint, unlisted, empty_dirs):
        self.names, self.classes_of, self.parts, self.arrays = names, classes_of, parts, arrays
        self.fingerprint, self.unlisted, self.empty_dirs = fingerprint, unlisted, empty_dirs


def read_source(source, skip_bad):
    """A Source of `source` (a folder, a zip, CIFAR's tar or SVHN's folder); every problem one
    line (SystemExit) naming the file."""
    try:
        items, fingerprint, unlisted, empty_dirs = list_source(source)
        if unlisted and not skip_bad:
            name, why = unlisted[0]
            raise SystemExit(f"cannot read {name} in {source} ({why}); {len(unlisted)} such "
                             "file(s) in all: fix them, or pass --skip-bad to leave them out "
                             "(they are listed in manifest.json)")
        arrays = None if items or unlisted else load_arrays(source)
    except (ValueError, OSError, tarfile.TarError, pickle.UnpicklingError) as e:
        raise SystemExit(str(e)) from None
    if unlisted and not items:
        raise SystemExit(f"none of the {len(unlisted)} image files in {source} could be read "
                         f"(first: {unlisted[0][0]}: {unlisted[0][1]})")
    if not items and arrays is None:
        tar = os.path.isfile(source) and tarfile.is_tarfile(source)
        raise SystemExit(f"no images ({', '.join(IMG_EXT)}), CIFAR pickles or SVHN .mat files "
                         f"found in {source}" + (" (a tar archive is read for CIFAR's pickles "
                                                  "only: unpack other archives to a folder)"
                                                  if tar else ""))
    if arrays is None:
        classes_of, names, parts = (list(t) for t in zip(*items))
        return Source(names, classes_of, parts, None, fingerprint, unlisted, empty_dirs)
    if fingerprint.startswith("folder"):
        fingerprint = "arrays-" + fingerprint
    return Source(arrays["files"], [arrays["classes"][y] for y in arrays["labels"]],
                  arrays["parts"], arrays, fingerprint, unlisted, empty_dirs)


def decode(args, source, src, names, picked, size, multi=None):
    """(images: uint8 (3, size, size) arrays or None where bad, [(name, why)] of the bad and the
    unlisted, images scaled from 16 or 32 bits, [(file hash, pixel hash)]): the picked images,
    decoded (files) or taken (arrays) at the cached size.  A bad image stops the run, naming it,
    unless --skip-bad."""
    if src.arrays is None:
        images, bad, scaled, hashes = decode_all(source, names, size, args.workers,
                                                 max_pixels=args.max_pixels, multi=multi)
    else:
        raw = src.arrays["images"][picked]
        hashes = [(None, _pixel_hash(a)) for a in raw]
        images, bad, scaled = list(_resize_arrays(raw, size)), [], 0
    if bad and not args.skip_bad:
        name, why = bad[0]
        raise SystemExit(f"cannot read {name} in {source} ({why}); {len(bad)} bad image(s) in all. "
                         "Replace the file, or pass --skip-bad to leave such images out (they are "
                         "listed in manifest.json)")
    bad = src.unlisted + bad                       # (listed first: they were found first)
    for name, why in bad:
        print(f"skipped {name}: {why}", file=sys.stderr)
    return images, bad, scaled, hashes


def findings(args, source, src, classes, classes_of, parts, keep):
    """(notes, warnings), each printed: what differs from the registry, on the images as found
    (before any are dropped), and what the tree says of its classes (empty folders, one class)."""
    found = {}
    for i in keep:
        if parts[i] in (None, "train"):
            found[classes_of[i]] = found.get(classes_of[i], 0) + 1
    notes = check_against_registry(args.dataset, classes, None if args.per_class else found,
                                   parts[0] is not None)
    warnings = [f"{source}/{d} holds no image ({', '.join(IMG_EXT)}): it is not a class of this "
                "data set; put its images in it or remove the folder" for d in src.empty_dirs]
    if len({classes_of[i] for i in keep}) == 1:
        warnings.append(f"{source} holds one class ({classes_of[keep[0]]}): training works, but "
                        "kNN and linear evaluation need two or more classes (with one, every "
                        "classifier scores 100 %); is --source the folder of the class folders?")
    for line in notes + warnings:
        print(f"note: {line}", file=sys.stderr)
    return notes, warnings


def one_sided_classes(classes, labels, train, test):
    """Warnings (printed) for the classes with images in one split only: a class with no test
    image is never measured, one with no training image is never in the kNN's memory."""
    out = []
    for name, (a, b) in zip(classes, zip(torch.bincount(labels[train], minlength=len(classes)).tolist(),
                                         torch.bincount(labels[test], minlength=len(classes)).tolist())):
        if (a == 0) != (b == 0):
            out.append(f"class {name} has {a + b} image(s), all in the {'training' if a else 'test'} "
                       f"split: no {'test' if a else 'training'} image of it, so evaluation "
                       "cannot measure it; add images of it, or remove its folder")
            print(f"note: {out[-1]}", file=sys.stderr)
    return out


def duplicates(args, names, classes_of, keep, hashes):
    """(keep, the manifest's duplicates entry): exact duplicates counted always, dropped with
    --drop-duplicates (one copy kept within a class; every copy of an image in two classes)."""
    dups = find_duplicates([names[i] for i in keep], [classes_of[i] for i in keep],
                           [hashes[i] for i in keep])
    dropped = []
    if args.drop_duplicates:
        gone = set()
        for g in dups["_index_groups"]:
            cross = len({classes_of[keep[i]] for i in g}) > 1
            gone.update(g if cross else g[1:])       # cross-class: no label to trust
        dropped = [names[keep[i]] for i in sorted(gone)]
        keep = [k for j, k in enumerate(keep) if j not in gone]
    del dups["_index_groups"]
    if dups["groups"]:
        print(f"{dups['files'] - dups['distinct']} duplicate image(s) in {len(dups['groups'])} "
              f"group(s), {len(dups['cross_class'])} of them across classes"
              + (f"; dropped {len(dropped)}" if dropped else "; --drop-duplicates drops them"))
    return keep, {**dups, "dropped": dropped}


def band_stats(imgs):
    """([mean], [std]) of each band of uint8 or uint16 images (N, C, H, W) on the scale the model
    sees (value / 255, or / 65535 for uint16), as the manifest keeps them.  uint16 sets are
    summed in float64 a band and a chunk at a time (a float copy of all 27,000 EuroSAT MS images
    would take 5.7 GB)."""
    if imgs.dtype == torch.uint8:
        return (imgs.float() / 255).mean((0, 2, 3)).tolist(), (imgs.float() / 255).std((0, 2, 3)).tolist()
    top, n = float(torch.iinfo(imgs.dtype).max), imgs.shape[0] * imgs.shape[2] * imgs.shape[3]
    s = torch.zeros(imgs.shape[1], dtype=torch.float64)
    s2 = torch.zeros_like(s)
    for i in range(0, imgs.shape[0], 1024):
        x = imgs[i:i + 1024].to(torch.float64) / top
        s += x.sum((0, 2, 3))
        s2 += (x * x).sum((0, 2, 3))
    mean = s / n
    var = (s2 - n * mean * mean).clamp(min=0) / max(n - 1, 1)
    return mean.tolist(), var.sqrt().tolist()


def write_folder(out, imgs, labels, files, train, test, manifest, t0):
    """cache.pt, split.json, and last manifest.json (completed with the counts, the channels'
    mean and std and the two files' sha256), which vouches for both."""
    classes = manifest["classes"]
    utils.save_checkpoint({"images": imgs, "labels": labels, "classes": classes, "files": files},
                          os.path.join(out, "cache.pt"))
    # a random split records how it was drawn; an official one is the source's; both the
    # validation part of the training split that choices read (utils.VAL_FRAC)
    val = torch.tensor(train)[utils.val_positions({}, train, labels[train])].tolist()
    utils.write_json({**({"seed": manifest["split_seed"], "test_frac": manifest["test_frac"]}
                         if manifest["split"] == "random" else {"split": "official"}),
                      "train": train, "test": test, "val": val, "val_frac": utils.VAL_FRAC,
                      "val_seed": utils.VAL_SEED}, os.path.join(out, "split.json"))
    counts = torch.bincount(labels, minlength=len(classes)).tolist()
    mean, std = band_stats(imgs)
    manifest.update(per_class_counts=dict(zip(classes, counts)), channel_mean=mean, channel_std=std,
                    files_sha256={f: utils.sha256_file(os.path.join(out, f)) for f in FILES},
                    seconds=round(time.time() - t0, 1))
    utils.write_json(manifest, os.path.join(out, "manifest.json"))  # last: marks a complete cache
    print(f"wrote {out}: {len(files)} images, train {len(train)} (validation {len(val)} of "
          f"them) / test {len(test)}, "
          f"{len(manifest['skipped'])} skipped, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
