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
    p.add_argument("--size", type=int, default=None, help="side of the cached images in pixels "
                   "(default: the data set's native size, 64 for EuroSAT; training can resize on the fly, "
                   "so keep the native size unless disk or memory is short)")
    p.add_argument("--test-frac", type=float, default=0.2, help="fraction of each class held out "
                   "for testing; 0.2 is the paper's 80/20 protocol")
    p.add_argument("--seed", type=int, default=0, help="seed of the random split")
    p.add_argument("--per-class", type=int, default=None, help="keep only the first N images of each "
                   "class (sorted by name): for tests and quick trials, not for reported results")
    p.add_argument("--skip-bad", action="store_true", help="skip corrupt or unreadable images and list "
                   "them in the manifest (default: stop at the first one, naming it)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes that decode images")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    return p


def list_source(source):
    """[(class name, member path)] sorted, and a fingerprint of the source."""
    if os.path.isdir(source):
        items, fp = [], hashlib.sha256()
        for cls in sorted(os.listdir(source)):
            cdir = os.path.join(source, cls)
            if not os.path.isdir(cdir) or cls.startswith("."):
                continue
            for f in sorted(os.listdir(cdir)):
                if f.lower().endswith(IMG_EXT):
                    rel = os.path.join(cls, f)
                    st = os.stat(os.path.join(source, rel))
                    items.append((cls, rel))
                    fp.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return items, "folder-sha256:" + fp.hexdigest()
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            names = [n for n in z.namelist() if n.lower().endswith(IMG_EXT) and not n.endswith("/")]
        # the class is the image's parent folder: <top>/<class>/<file> in the official layout
        items = sorted((n.split("/")[-2], n) for n in names if n.count("/") >= 1)
        return items, "sha256:" + utils.sha256_file(source)
    raise ValueError(f"--source {source} is neither a folder nor a zip archive; pass the official "
                     "archive (e.g. ../shared/data/EuroSAT.zip) or a folder of class subfolders")


def _decode(job):
    """Decode a chunk of images in a worker: returns (uint8 array (n, 3, s, s), [bad (name, why)])."""
    from PIL import Image
    source, names, size = job
    z = zipfile.ZipFile(source) if not os.path.isdir(source) else None
    out, bad = [], []
    for name in names:
        try:
            raw = z.read(name) if z else open(os.path.join(source, name), "rb").read()
            with Image.open(io.BytesIO(raw)) as im:
                im = im.convert("RGB")
                if im.size != (size, size):
                    im = im.resize((size, size), Image.BILINEAR, reducing_gap=None)
                a = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
            out.append(a)
        except Exception as e:  # PIL raises several types for broken files
            bad.append((name, f"{type(e).__name__}: {e}"))
            out.append(None)
    if z:
        z.close()
    return out, bad


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
    return images, bad


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
    size = args.size or DATASETS[args.dataset]["size"]
    source = download(args.dataset, args.download_dir) if args.download else args.source
    if not os.path.exists(source):
        raise SystemExit(f"--source {source} does not exist; pass the official archive "
                         "(e.g. ../shared/data/EuroSAT.zip), a folder of class subfolders, or --download")
    items, fingerprint = list_source(source)
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
        with open(man_path) as fh:
            old = json.load(fh)
        ok = all(os.path.isfile(os.path.join(args.out, f)) for f in ("cache.pt", "split.json"))
        if ok and old.get("key") == key:
            print(f"cache in {args.out} is up to date ({old['n_images']} images); reusing it")
            return old
        print(f"cache in {args.out} is stale or incomplete; rebuilding")

    os.makedirs(args.out, exist_ok=True)
    classes = sorted({c for c, _ in items})
    names = [n for _, n in items]
    print(f"{args.dataset}: {len(names)} images in {len(classes)} classes from {source}, at {size} px")
    images, bad = decode_all(source, names, size, args.workers)
    if bad and not args.skip_bad:
        name, why = bad[0]
        raise SystemExit(f"cannot read {name} in {source} ({why}); {len(bad)} bad image(s) in all. "
                         "Replace the file, or pass --skip-bad to leave such images out (they are "
                         "listed in manifest.json)")
    for name, why in bad:
        print(f"skipped {name}: {why}", file=sys.stderr)
    keep = [i for i, a in enumerate(images) if a is not None]
    cls_idx = {c: i for i, c in enumerate(classes)}
    labels = torch.tensor([cls_idx[items[i][0]] for i in keep], dtype=torch.long)
    imgs = torch.from_numpy(np.stack([images[i] for i in keep]))  # (N, 3, size, size) uint8
    files = [names[i] for i in keep]
    train, test = (t.tolist() for t in utils.stratified_split(labels, args.test_frac, args.seed))

    utils.save_checkpoint({"images": imgs, "labels": labels, "classes": classes, "files": files},
                          os.path.join(args.out, "cache.pt"))
    utils.write_json({"seed": args.seed, "test_frac": args.test_frac, "train": train, "test": test},
                     os.path.join(args.out, "split.json"))
    counts = torch.bincount(labels, minlength=len(classes)).tolist()
    mean = (imgs.float() / 255).mean((0, 2, 3)).tolist()
    std = (imgs.float() / 255).std((0, 2, 3)).tolist()
    manifest = {"key": key, "dataset": args.dataset, "source": os.path.abspath(source),
                "checksum": fingerprint, "image_size": size, "n_images": len(files),
                "classes": classes, "per_class_counts": dict(zip(classes, counts)),
                "n_train": len(train), "n_test": len(test), "test_frac": args.test_frac,
                "split_seed": args.seed, "channel_mean": mean, "channel_std": std,
                "skipped": [{"file": n, "error": w} for n, w in bad],
                "seconds": round(time.time() - t0, 1)}
    utils.write_json(manifest, man_path)  # written last: its presence marks a complete cache
    print(f"wrote {args.out}: {len(files)} images, train {len(train)} / test {len(test)}, "
          f"{len(bad)} skipped, {time.time() - t0:.0f} s")
    return manifest


if __name__ == "__main__":
    main(get_args_parser().parse_args())
