"""Raw archive or folder -> a compact cache (uint8 images, labels, class names) and a saved split.

    python prepare_data.py --dataset eurosat --source ../shared/data/EuroSAT.zip --out data/eurosat
    python prepare_data.py --dataset eurosat --download --out data/eurosat

The output folder holds cache.pt, split.json (a seeded random train/test split, stratified by
class: the paper's 80/20 protocol) and manifest.json (source, checksum, per-class counts, split
sizes, skipped files).  Rerunning with the same arguments and an unchanged source reuses the cache;
anything else rebuilds it.  The format is documented in utils.py above `load_prepared`.
"""
import argparse
import hashlib
import io
import json
import os
import re
import sys
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

import utils

IMG_EXT = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp")

# Data sets this script knows: how to download them and their native image size.  The official
# EuroSAT archive is the one torchvision downloads (and checks by md5).
DATASETS = {
    "eurosat": {"size": 64, "archive": "EuroSAT.zip", "md5": "c8fa014336c82ac7804f0398fcb19387",
                "url": "https://huggingface.co/datasets/torchgeo/eurosat/resolve/"
                       "c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip"},
}


def positive_int(v):
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {v}")
    return n


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="eurosat", choices=sorted(DATASETS),
                   help="which data set the source holds")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", help="a local archive in the official layout (.zip, e.g. "
                     "../shared/data/EuroSAT.zip) or a folder with one subfolder per class")
    src.add_argument("--download", action="store_true", help="download the official archive "
                     "(checksum verified) into --download-dir, then use it")
    p.add_argument("--download-dir", default="data/downloads", help="where --download puts the archive")
    p.add_argument("--out", required=True, help="output folder for cache.pt, split.json, manifest.json")
    p.add_argument("--size", type=positive_int, default=None, help="side of the cached images in pixels "
                   "(default: the data set's native size, 64 for EuroSAT; training can resize on the fly, "
                   "so keep the native size unless disk or memory is short)")
    p.add_argument("--test-frac", type=float, default=0.2, help="fraction of each class held out "
                   "for testing; 0.2 is the paper's 80/20 protocol")
    p.add_argument("--seed", type=int, default=0, help="seed of the random split")
    p.add_argument("--per-class", type=positive_int, default=None, help="keep only the first N images of each "
                   "class (sorted by name): for tests and quick trials, not for reported results")
    p.add_argument("--skip-bad", action="store_true", help="skip corrupt or unreadable images and list "
                   "them in the manifest (default: stop at the first one, naming it)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes that decode images")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    return p


def _classes_of(paths, source):
    """[(class, path)] for image paths ("a/b/c.jpg"): the folders all of them share are left out
    (EuroSAT's "2750/", HMHR's "RS Image Dataset/"), and the next folder is the class; images in
    deeper subfolders belong to that class.  An image with no class folder is an error."""
    parts = [p.split("/") for p in paths]
    shared = 0
    while (all(len(q) > shared + 1 for q in parts)
           and len({q[shared] for q in parts}) == 1):
        shared += 1
    while shared and any(len(q) - shared < 2 for q in parts):
        shared -= 1
    if len({q[shared] for q in parts}) == 1 and shared:   # one class: keep its folder as the class
        shared -= 1
    loose = [p for p, q in zip(paths, parts) if len(q) - shared < 2]
    if loose:
        raise ValueError(f"{len(loose)} image(s) in {source} sit outside any class folder (first: "
                         f"{loose[0]}); put each class's images in a folder named after the class")
    return sorted((q[shared], p) for p, q in zip(paths, parts))


def list_source(source):
    """[(class name, member path)] sorted, and a fingerprint of the source.  Images may sit in
    subfolders of their class folder."""
    if os.path.isdir(source):
        paths, fp = [], hashlib.sha256()
        for root, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in sorted(files):
                if f.lower().endswith(IMG_EXT) and not f.startswith("."):
                    rel = os.path.relpath(os.path.join(root, f), source).replace(os.sep, "/")
                    st = os.stat(os.path.join(root, f))
                    paths.append(rel)
                    fp.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return (_classes_of(paths, source) if paths else []), "folder-sha256:" + fp.hexdigest()
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            names = [n for n in z.namelist() if n.lower().endswith(IMG_EXT) and not n.endswith("/")
                     and not n.startswith("__MACOSX/")]
        return (_classes_of(names, source) if names else []), "sha256:" + utils.sha256_file(source)
    raise ValueError(f"--source {source} is neither a folder nor a zip archive; pass the official "
                     "archive (e.g. ../shared/data/EuroSAT.zip) or a folder of class subfolders")


def _to_rgb(im):
    """A PIL image as 8-bit RGB.  16-bit and 32-bit single-band images (remote sensing's usual
    GeoTIFF and PNG bands) are scaled from their own min..max to 0..255: PIL's convert would clip
    them to 255, an all-white picture.  (image, True when it was scaled)."""
    from PIL import Image
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) * 255 if hi > lo else np.zeros_like(a)
        return Image.fromarray(np.round(a).astype(np.uint8)).convert("RGB"), True
    return im.convert("RGB"), False


def _decode(job):
    """Decode a chunk of images in a worker: (uint8 arrays (3, s, s) or None, [bad (name, why)],
    number of images scaled from 16 or 32 bits)."""
    from PIL import Image
    source, names, size = job
    z = zipfile.ZipFile(source) if not os.path.isdir(source) else None
    out, bad, scaled = [], [], 0
    for name in names:
        try:
            raw = z.read(name) if z else open(os.path.join(source, name), "rb").read()
            with Image.open(io.BytesIO(raw)) as im:
                im, s = _to_rgb(im)
                scaled += s
                if im.size != (size, size):
                    im = im.resize((size, size), Image.BILINEAR, reducing_gap=None)
                a = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
            out.append(a)
        except Exception as e:  # PIL raises several types for broken files
            why = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", repr(name), str(e))
            bad.append((name, f"{type(e).__name__}: {why}"))
            out.append(None)
    if z:
        z.close()
    return out, bad, scaled


def decode_all(source, names, size, workers, progress=True):
    from tqdm import tqdm
    chunk = 500
    jobs = [(source, names[i:i + chunk], size) for i in range(0, len(names), chunk)]
    results = []
    bar = tqdm(total=len(names), desc="decoding", unit="img", disable=not progress, dynamic_ncols=True)
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            for r in ex.map(_decode, jobs):
                results.append(r)
                bar.update(len(r[0]))
    else:
        for j in jobs:
            results.append(_decode(j))
            bar.update(len(j[1]))
    bar.close()
    images = [a for r in results for a in r[0]]
    bad = [b for r in results for b in r[1]]
    return images, bad, sum(r[2] for r in results)


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
    """The official archive, from the address torchvision's EuroSAT uses, md5 checked by
    torchvision's download_url; returns its path."""
    from torchvision.datasets.utils import download_url
    info = DATASETS[dataset]
    if "url" not in info:
        raise ValueError(f"no download source known for {dataset}; pass --source")
    os.makedirs(dest, exist_ok=True)
    download_url(info["url"], dest, filename=info["archive"], md5=info["md5"])
    return os.path.join(dest, info["archive"])


def main(args):
    t0 = time.time()
    utils.print_run_header(args)
    if not 0 < args.test_frac < 1:
        raise SystemExit(f"--test-frac must be between 0 and 1, got {args.test_frac}")
    size = args.size if args.size is not None else DATASETS[args.dataset]["size"]
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"--out {args.out} is a file; pass a folder (it is created if missing)")
    source = download(args.dataset, args.download_dir) if args.download else args.source
    if not os.path.exists(source):
        raise SystemExit(f"--source {source} does not exist; pass the official archive "
                         "(e.g. ../shared/data/EuroSAT.zip), a folder of class subfolders, or --download")
    try:
        items, fingerprint = list_source(source)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not items:
        raise SystemExit(f"no images ({', '.join(IMG_EXT)}) found in {source}")
    if args.per_class:
        kept = {}
        for cls, name in items:
            kept.setdefault(cls, [])
            if len(kept[cls]) < args.per_class:
                kept[cls].append((cls, name))
        items = sorted(it for group in kept.values() for it in group)
    key = {"dataset": args.dataset, "source": os.path.abspath(source), "fingerprint": fingerprint,
           "size": size, "test_frac": args.test_frac, "seed": args.seed, "per_class": args.per_class,
           "skip_bad": args.skip_bad}
    man_path = os.path.join(args.out, "manifest.json")
    if not args.force and os.path.isfile(man_path):
        old, why = _check_folder(args.out, key)
        if why is None:
            print(f"cache in {args.out} is up to date ({old['n_images']} images); reusing it")
            return old
        print(f"cache in {args.out} is {why}; rebuilding")

    os.makedirs(args.out, exist_ok=True)
    if os.path.isfile(man_path):   # from here until the new manifest, the folder is incomplete
        os.remove(man_path)
    classes = sorted({c for c, _ in items})
    names = [n for _, n in items]
    print(f"{args.dataset}: {len(names)} images in {len(classes)} classes from {source}, at {size} px")
    images, bad, scaled = decode_all(source, names, size, args.workers)
    if bad and not args.skip_bad:
        name, why = bad[0]
        raise SystemExit(f"cannot read {name} in {source} ({why}); {len(bad)} bad image(s) in all. "
                         "Replace the file, or pass --skip-bad to leave such images out (they are "
                         "listed in manifest.json)")
    for name, why in bad:
        print(f"skipped {name}: {why}", file=sys.stderr)
    keep = [i for i, a in enumerate(images) if a is not None]
    if not keep:
        raise SystemExit(f"none of the {len(names)} images in {source} could be read (first: "
                         f"{bad[0][0]}: {bad[0][1]})")
    cls_idx = {c: i for i, c in enumerate(classes)}
    labels = torch.tensor([cls_idx[items[i][0]] for i in keep], dtype=torch.long)
    imgs = torch.from_numpy(np.stack([images[i] for i in keep]))  # (N, 3, size, size) uint8
    files = [names[i] for i in keep]
    train, test = (t.tolist() for t in utils.stratified_split(labels, args.test_frac, args.seed))
    if not train or not test:
        raise SystemExit(f"the {len(files)} images split into {len(train)} for training and "
                         f"{len(test)} for testing: every class needs at least 2 images "
                         f"(per class: {torch.bincount(labels).tolist()}); raise --per-class or "
                         "add images")

    utils.save_checkpoint({"images": imgs, "labels": labels, "classes": classes, "files": files},
                          os.path.join(args.out, "cache.pt"))
    utils.write_json({"seed": args.seed, "test_frac": args.test_frac, "train": train, "test": test},
                     os.path.join(args.out, "split.json"))
    if scaled:
        print(f"{scaled} images of 16 or 32 bits per pixel were scaled from their own range to "
              "8 bits", file=sys.stderr)
    counts = torch.bincount(labels, minlength=len(classes)).tolist()
    mean = (imgs.float() / 255).mean((0, 2, 3)).tolist()
    std = (imgs.float() / 255).std((0, 2, 3)).tolist()
    manifest = {"key": key, "dataset": args.dataset, "source": utils.rel_path(source),
                "checksum": fingerprint, "image_size": size, "n_images": len(files),
                "classes": classes, "per_class_counts": dict(zip(classes, counts)),
                "n_train": len(train), "n_test": len(test), "test_frac": args.test_frac,
                "split_seed": args.seed, "channel_mean": mean, "channel_std": std,
                "skipped": [{"file": n, "error": w} for n, w in bad], "scaled_to_8_bit": scaled,
                "files_sha256": {f: utils.sha256_file(os.path.join(args.out, f)) for f in FILES},
                "seconds": round(time.time() - t0, 1)}
    utils.write_json(manifest, man_path)  # written last: its presence marks a complete cache
    print(f"wrote {args.out}: {len(files)} images, train {len(train)} / test {len(test)}, "
          f"{len(bad)} skipped, {time.time() - t0:.0f} s")
    return manifest


if __name__ == "__main__":
    main(get_args_parser().parse_args())
