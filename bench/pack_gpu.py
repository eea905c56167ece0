"""Pack the data the GPU checks need into .gpu/, in pieces that fit what one remote call carries.

    python bench/pack_gpu.py --eurosat ../shared/data/EuroSAT.zip --hmhr ../shared/data/HMHR.zip \
        --cifar10 ../shared/data/cifar10_jpg.zip --siri-whu raw/siri_whu --quality 95

The remote-run tool carries at most 64 MiB of the checkout a call (the tracked tree, about 3 MB,
included), and EuroSAT's archive is 96 MB, so it travels as pieces (`eu_part_aa`, `eu_part_ab`,
...: concatenated in name order they are the archive again, byte for byte). HMHR (8 MB) and
CIFAR-10's JPEG archive (62 MB) are copied as they are. SIRI-WHU's TIFFs are 281 MB, so each
image is re-encoded as a JPEG at --quality (95: about 40 MB; a lossy copy, which results made
from it must say), its class folder and file name kept but the extension. `manifest.json`
records each file's bytes and sha256, what it came from and the quality, so a result can name
the exact data it trained on.
bench/gpu_session.sh (its header) says which call carries which file.
"""
import os, sys  # noqa: E401  (run as bench/<name>.py: the repository root holds otl, utils)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import io
import json
import shutil
import zipfile

import numpy as np

import prepare_data
import utils

MB = 1_000_000


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".gpu", help="the folder to fill (git-ignored: add /.gpu/ to "
                   ".git/info/exclude)")
    p.add_argument("--eurosat", default=None, help="EuroSAT.zip, cut into --piece-mb pieces")
    p.add_argument("--piece-mb", type=float, default=60.0, help="the largest piece, in MB (10^6 "
                   "bytes); 60 leaves room for the tree in a 64 MiB call")
    p.add_argument("--small-per-class", type=int, default=40, help="with --eurosat: also "
                   "EuroSAT_small.zip, the first N images of each class in the archive's layout, "
                   "which stands in for ../shared/data/EuroSAT.zip in the CUDA tests (0: none)")
    p.add_argument("--hmhr", default=None, help="HMHR.zip, copied as it is")
    p.add_argument("--cifar10", default=None, help="cifar10_jpg.zip (62 MB: a call of its own), "
                   "copied as it is")
    p.add_argument("--siri-whu", default=None, help="the SIRI-WHU folder of class folders "
                   "(docs/datasets.md), re-encoded into siri_whu.zip")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality of the re-encoded images "
                   "(95: the highest that keeps SIRI-WHU near 40 MB)")
    return p


def split_file(src, out_dir, prefix, piece_bytes):
    """src cut into prefix + 'aa', 'ab', ... of at most piece_bytes each (as `split -b`)."""
    names = []
    with open(src, "rb") as fh:
        while True:
            block = fh.read(piece_bytes)
            if not block:
                break
            i = len(names)
            name = prefix + chr(ord("a") + i // 26) + chr(ord("a") + i % 26)
            with open(os.path.join(out_dir, name), "wb") as piece:
                piece.write(block)
            names.append(name)
    return names


def small_archive(src, dst, per_class):
    """The first per_class images of each class folder of zip src, into zip dst, same names."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        names = sorted(n for n in zin.namelist()
                       if not n.endswith("/") and n.lower().endswith(prepare_data.IMG_EXT))
        keep = prepare_data._first_per_class(len(names), [os.path.dirname(n) for n in names],
                                             [None] * len(names), per_class)
        for i in keep:
            zout.writestr(names[i], zin.read(names[i]))
    return len(keep)


def reencode_folder(src, dst_zip, quality):
    """Every image under src's class folders, as JPEG at quality, into dst_zip as
    <class>/<stem>.jpg (sorted, so the order and with it a seeded split stay the same); returns
    the count and the mean absolute pixel error of the copies (0 - 255)."""
    from PIL import Image
    classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    if not classes:
        raise SystemExit(f"{src} holds no class folders: give the folder whose sub-folders are "
                         "the classes (docs/datasets.md)")
    n, err = 0, 0.0
    with zipfile.ZipFile(dst_zip, "w", zipfile.ZIP_STORED) as z:
        for c in classes:
            for f in sorted(os.listdir(os.path.join(src, c))):
                if f.startswith(".") or not f.lower().endswith(prepare_data.IMG_EXT):
                    continue
                img = Image.open(os.path.join(src, c, f)).convert("RGB")
                buf = io.BytesIO()
                img.save(buf, "JPEG", quality=quality)
                z.writestr(f"{c}/{os.path.splitext(f)[0]}.jpg", buf.getvalue())
                back = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
                err += np.abs(np.asarray(back, np.float64) - np.asarray(img, np.float64)).mean()
                n += 1
    return n, err / max(n, 1)


def main(args):
    if not (args.eurosat or args.hmhr or args.cifar10 or args.siri_whu):
        raise SystemExit("nothing to pack: give --eurosat, --hmhr, --cifar10 and / or --siri-whu")
    os.makedirs(args.out, exist_ok=True)
    manifest = os.path.join(args.out, "manifest.json")
    files = {}
    if args.eurosat:
        whole = utils.sha256_file(args.eurosat)
        for name in split_file(args.eurosat, args.out, "eu_part_", int(args.piece_mb * MB)):
            files[name] = {"from": args.eurosat, "what": "a piece of the archive (cat eu_part_* "
                           "in name order)", "archive_sha256": whole}
        if args.small_per_class:
            n = small_archive(args.eurosat, os.path.join(args.out, "EuroSAT_small.zip"),
                              args.small_per_class)
            files["EuroSAT_small.zip"] = {"from": args.eurosat, "images": n, "what": f"the "
                                          f"first {args.small_per_class} images of each class"}
    for src, name in ((args.hmhr, "HMHR.zip"), (args.cifar10, "cifar10_jpg.zip")):
        if src:
            shutil.copyfile(src, os.path.join(args.out, name))
            files[name] = {"from": src, "what": "a copy"}
    if args.siri_whu:
        dst = os.path.join(args.out, "siri_whu.zip")
        n, err = reencode_folder(args.siri_whu, dst, args.quality)
        files["siri_whu.zip"] = {"from": args.siri_whu, "what": f"{n} images re-encoded as JPEG "
                                 f"at quality {args.quality} (lossy: mean absolute pixel error "
                                 f"{err:.2f} / 255)", "images": n, "quality": args.quality,
                                 "mean_abs_pixel_error": round(err, 3)}
    for name, rec in files.items():
        path = os.path.join(args.out, name)
        rec.update(bytes=os.path.getsize(path), sha256=utils.sha256_file(path))
        print(f"{path}: {rec['bytes'] / MB:.1f} MB, {rec['what']}")
    if os.path.isfile(manifest):             # what an earlier call packed stays recorded
        with open(manifest) as fh:
            files = {**json.load(fh), **files}
    with open(manifest, "w") as fh:
        json.dump(files, fh, indent=1)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
