"""Run plumbing shared by the stage scripts (prepare_data, train_otl, eval_knn, eval_linear,
ablations, the benchmarks): devices, the commit and run headers, JSON and checkpoint files, resuming a run, the prepared-data format and its loader, cached features, the
one stratified split, and the flags every evaluation takes.  The method itself is in otl.py.
"""
from __future__ import annotations

import argparse
import errno
import glob
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import otl
from presets import PRESETS

# ----------------------------------------------------------------------------------------------
# Devices and processes
# ----------------------------------------------------------------------------------------------

def pick_device(name: str = "auto") -> torch.device:
    """'auto' takes CUDA when present, else the CPU.  A device this machine lacks, or a name
    torch does not know, stops the program with one line naming --device (SystemExit: a user's
    error, not a fault of the code)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name}: not a device name; use auto, cpu, cuda or "
                         "cuda:<index>") from None
    if dev.type not in ("cpu", "cuda"):     # mps, xla, meta ...: the stages run on these two only
        raise SystemExit(f"--device {name}: this project runs on the CPU or on CUDA GPUs; use "
                         "auto, cpu, cuda or cuda:<index>")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name} asked for, but CUDA is not available on this machine; "
                         "use --device cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), numbered from 0; use --device cuda:0 .. "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return dev


def cpu_bf16() -> bool:
    """Whether this processor computes bfloat16 natively (avx512_bf16 or amx_bf16 among its
    flags, and torch's oneDNN able to use them): there bf16 autocast speeds up a CPU's convolutions;
    elsewhere bf16 is emulated and slower than float32."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(re.findall(r"\b(avx512_bf16|amx_bf16)\b", fh.read()))
    except OSError:             # not Linux: no flags to read, so no bf16 on the CPU
        return False
    mkldnn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(flags) and torch.backends.mkldnn.is_available() and bool(mkldnn and mkldnn())


def resolve_amp(amp, device) -> bool:
    """--amp: given (true or false), as given; not given (None), bf16 autocast on CUDA and on a
    CPU with native bf16 (cpu_bf16), float32 elsewhere."""
    if amp is not None:
        return bool(amp)
    return torch.device(device).type == "cuda" or cpu_bf16()


def bf16_shapes_ok(model, size: int) -> bool:
    """Whether `model` on `size`-px images has no strided convolution of a 1 x 1 input: there
    oneDNN's bf16 kernels give garbage weight gradients on the CPU (from uninitialised memory, so
    not on every step; ResNet-18 with the ImageNet stem at 16 px or less has one in its last
    stage), so bf16 autocast is for networks and sizes without one.  One forward pass of two
    images in eval mode, which records each convolution's input."""
    bad = []

    def seen(m, inputs, _):       # (a hook that returns something would replace the output)
        if max(m.stride) > 1 and min(inputs[0].shape[-2:]) == 1:
            bad.append(m)
    hooks = [m.register_forward_hook(seen) for m in model.modules()
             if isinstance(m, torch.nn.Conv2d)]
    was = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.rand(2, model.cfg.in_chans, size, size,
                                    device=next(model.parameters()).device))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return not bad


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ranks:
    """This process's place among the processes torchrun started: rank 0 of 1 without torchrun,
    so a single process runs the same code.  NCCL on CUDA, gloo on the CPU."""

    def __init__(self, device_name: str = "auto"):
        import torch.distributed as dist
        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank, self.local = 0, 0
        if self.world > 1:
            self.local = int(os.environ.get("LOCAL_RANK", "0"))
            cuda = device_name != "cpu" and torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(self.local)
            dist.init_process_group("nccl" if cuda else "gloo")
            self.rank = dist.get_rank()
            self.device = torch.device("cuda", self.local) if cuda else torch.device("cpu")
        else:
            self.device = pick_device(device_name)
        self.main = self.rank == 0

    def shard(self, n: int):
        """This rank's rows [lo, hi) of n: contiguous, in rank order, sizes within one."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.dist.all_reduce(x, op=self.dist.ReduceOp.SUM)
        return x

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (so all ranks take the same branch)."""
        return bool(self.sum(torch.tensor([int(flag)], device=self.device))[0])

    def close(self):
        """Every process here, then the group gone (a DistributedDataParallel still holding it
        keeps gloo's threads until it is freed: leave_torchrun)."""
        if self.world > 1 and self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()


def leave_torchrun() -> None:
    """For a torchrun process whose work is done and written (its group closed): exit at once.
    The interpreter's teardown would free what still holds the group (a DistributedDataParallel's
    reducer in a reference cycle) while gloo's threads run, which can abort the process after its
    results are saved ("terminate called without an active exception", SIGABRT).  Nothing
    happens in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------------------------
# What made a result: the commit, the command, the arguments
# ----------------------------------------------------------------------------------------------

def git_commit() -> str:
    """The commit of the code being run ("<sha>", "<sha>+dirty" with uncommitted changes to
    tracked files, or "unknown" outside a repository or before the first commit).  Changes under
    results/ do not count: they are what runs write (a study rewrites its results file after
    every run), not the code that ran."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    return sha + ("+dirty" if dirty else "")


REPO = os.path.dirname(os.path.abspath(__file__))


def command_line() -> str:
    """The command that is running, as the user would type it again (python, not the path of
    the interpreter of this machine)."""
    return shlex.join(["python"] + sys.argv)


def rel_path(path: str) -> str:
    """A path as results files record it: relative to the repository when inside it (so no file
    names this machine's folders), absolute otherwise."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else full


def print_run_header(args) -> None:
    """The commit and the sorted arguments, so a log says what made it."""
    print(f"git commit: {git_commit()}")
    print("\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())), flush=True)


def finite_float(v):
    """argparse type: a finite number (nan and inf are refused: every range check passes nan)."""
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {v!r}")
    return x


def positive_int(v):
    """argparse type: a whole number >= 1."""
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {v}")
    return n


def str2bool(v):
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


# ----------------------------------------------------------------------------------------------
# Files: JSON and checkpoints, written atomically
# ----------------------------------------------------------------------------------------------

class CannotWrite(SystemExit):
    """A file a stage must write cannot be written (a full disk, a read-only folder, a path under
    a file): one line naming it, what became of the file, and what to do.  A SystemExit, so a
    stage script ends with that line and no traceback; its parts (path, reason, kept, fix) let a
    caller say more (prepare_data.py) or go on without the file (a feature cache)."""

    def __init__(self, path: str, reason: str, fix: str, kept: str = ""):
        super().__init__(f"cannot write {path}: {reason}; {kept + '; ' if kept else ''}{fix}")
        self.path, self.reason, self.kept, self.fix = path, reason, kept, fix


def _disk_full(e: BaseException) -> bool:
    """Whether a failed write ran out of space: ENOSPC or EDQUOT from Python's own writes, or the
    short write torch reports when it writes a file by name ("unexpected pos")."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and any(m in str(e) for m in (
        "unexpected pos", "No space left", "file write failed"))


def _full(path: str, appended: bool = False) -> CannotWrite:
    """CannotWrite for a write that ran out of space, naming the file and what to do."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(folder).free / 2 ** 20:.0f} MiB free there now"
    except OSError:
        free = "its free space unknown"
    kept = ("its lines before this one are intact" if appended else "the unfinished file removed, "
            f"the previous {os.path.basename(path)}, if there was one, intact")
    return CannotWrite(path, f"the disk is full (or over its quota; {free})",
                       "free some space and run the same command again", kept)


def _unwritable(path: str, e: OSError) -> CannotWrite:
    """CannotWrite for an OSError that is the user's to fix: no permission, a read-only file
    system, a path whose folder is a file."""
    why = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
           errno.EROFS: "the file system is read-only",
           errno.ENOTDIR: "a part of its path is a file, not a folder",
           errno.EEXIST: "a part of its path is a file, not a folder"}.get(e.errno)
    if why is None:
        raise e
    return CannotWrite(path, why, "pass an output path in a folder you can write to")


def make_folder(folder: str, flag: str = "") -> None:
    """os.makedirs(folder, exist_ok=True), with a path under a file or a folder without write
    permission one line (CannotWrite) naming `flag` (the flag that gave it) and the folder."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise _unwritable(f"{flag} {folder}".strip(), e) from None


def remove_dead_temporaries(path: str) -> None:
    """Remove the temporary files that writers killed mid-write left (kill -9 leaves them no
    chance to clean up): `path`.tmp<pid>, or every *.tmp<pid> in `path` when it is a folder,
    whose process no longer runs on this machine.  A live writer's file stays."""
    pattern = (os.path.join(glob.escape(path), "*") if os.path.isdir(path) else glob.escape(path))
    for tmp in glob.glob(pattern + ".tmp[0-9]*"):
        pid = tmp.rpartition(".tmp")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue                    # that writer still runs
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue                    # another user's live process, or not a pid here
        try:
            os.remove(tmp)
        except OSError:
            pass


def _atomic_write(path: str, write) -> None:
    """write(file object) into a temporary file beside `path`, then rename it over `path`: a crash
    mid-write leaves the previous file intact.  A failed write removes its temporary file (a full
    disk is not left fuller), and temporaries of killed writers go on the next write; a full disk
    or a folder that cannot be written stops the program with one line saying so (CannotWrite)."""
    tmp = f"{path}.tmp{os.getpid()}"
    remove_dead_temporaries(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if _disk_full(e):
            raise _full(path) from None
        if isinstance(e, OSError):
            raise _unwritable(path, e) from None
        raise


def write_json(obj: dict, path: str) -> None:
    """Write atomically: a crash mid-write never leaves a half-written results file."""
    make_folder(os.path.dirname(os.path.abspath(path)))
    text = json.dumps(obj, indent=2) + "\n"      # before the file opens: bad data leave no file
    _atomic_write(path, lambda fh: fh.write(text.encode()))


def save_checkpoint(state: dict, path: str) -> None:
    """torch.save, atomically: a crash mid-write leaves the previous file intact.  Through a
    Python file object, so that a full disk is reported as ENOSPC (torch's own writer says only
    "unexpected pos")."""
    _atomic_write(path, lambda fh: torch.save(state, fh))


def append_line(path: str, line: str) -> None:
    """Append one line to a log; a full disk stops the program with one line saying so (a line
    cut short there is dropped by trim_log on the next resume)."""
    try:
        with open(path, "a") as fh:
            fh.write(line + "\n")
    except OSError as e:
        if _disk_full(e):
            raise _full(path, appended=True) from None
        raise _unwritable(path, e) from None


class DamagedFile(ValueError):
    """A file cut short or corrupted (a write killed half-way)."""


def load_file(path: str, with_sha256: bool = False):
    """What save_checkpoint wrote (checkpoints, caches), on the CPU: tensors and plain data only.
    Anything else is refused, never unpickled: a crafted file could run code.  with_sha256:
    (object, sha256 of the bytes it was loaded from): the file is read once, so a file replaced
    meanwhile (a training overwriting checkpoint.pth) cannot pair one file's contents with the
    other's hash."""
    import pickle
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e})") from None
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        built = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise ValueError(f"refusing to load {path}: it holds objects other than tensors and plain "
                         f"data{f' ({built.group(1)})' if built else ''}, which loading would run "
                         "as code; recreate it with this project's scripts") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError, KeyError) as e:
        raise DamagedFile(f"{path} is damaged or incomplete ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None
    return (obj, hashlib.sha256(raw).hexdigest()) if with_sha256 else obj


def model_state(cfg: otl.ModelConfig) -> dict:
    """A ModelConfig as plain types, as checkpoints store it."""
    return asdict(cfg)


CHECKPOINT_KEYS = {"model": dict, "model_cfg": dict}


def checkpoint_problem(ckpt) -> str | None:
    """Why a loaded object is not a checkpoint of train_otl.py (None when it is one): a dict with
    the model's weights and its ModelConfig."""
    if not isinstance(ckpt, dict):
        return f"it holds a {type(ckpt).__name__}, not a training checkpoint"
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(ckpt.get(key), kind):
            return f"it has no {key!r} entry, so it is not a checkpoint of train_otl.py"
    return None


def load_checkpoint(path: str, device="cpu", with_sha256: bool = False):
    """(model, checkpoint dict): the model rebuilt from the ModelConfig saved in the checkpoint;
    with_sha256, (model, checkpoint, sha256 of the file read).  ValueError, one line naming the
    file, for a file that is crafted, damaged, not a training checkpoint, or whose weights do not
    fit its config."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one with train_otl.py (its run "
                                "folder's checkpoint0000.pth is the untrained network, the baseline)")
    ckpt, sha = load_file(path, with_sha256=True)
    why = checkpoint_problem(ckpt)
    try:
        if why is None:
            model = otl.build_model(otl.ModelConfig(**ckpt["model_cfg"]))
            model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        why = (f"its weights do not fit the model its config describes "
               f"({(str(e).splitlines() or [''])[0][:200]})")
    if why:
        raise ValueError(f"{path}: {why}; pass a checkpoint.pth (or checkpointNNNN.pth) that "
                         "train_otl.py wrote")
    model = model.to(device)
    return (model, ckpt, sha) if with_sha256 else (model, ckpt)


def inflate_first_conv(w: torch.Tensor, bands: int, rgb=None, names=None):
    """(weights (out, bands, kh, kw), one line saying what was done) of an RGB first conv w
    (out, 3, kh, kw) for `bands` input bands: the bands at rgb (their indices of red, green and
    blue, known from the bands' names) take the R, G and B filters, every other band the mean of
    the three, and all are scaled by 3 / bands, so that an input equal in every band gives the
    RGB network's response (the sum over bands is the sum of the three filters)."""
    out = w.mean(1, keepdim=True).repeat(1, bands, 1, 1)
    for i, j in enumerate(rgb or []):
        out[:, j] = w[:, i]
    out *= 3 / bands
    named = [names[j] if names else str(j) for j in rgb] if rgb else []
    rest = bands - len(named)
    line = (f"first conv inflated from RGB to {bands} bands: "
            + (f"{','.join(named)} take the R,G,B filters, " if named else "no band is named red, "
               "green or blue, so ")
            + (f"the other {rest} the mean of the three, " if rest else "")
            + f"all scaled by 3/{bands}")
    return out, line


def init_backbone(model, path: str, rgb=None, names=None) -> dict:
    """Start `model` from the backbone of another run's checkpoint (OTL or supervised, any data
    set: the transfer protocol); its head stays freshly initialised for this run's k.  An RGB
    backbone (3 bands) starts a model of other bands (or of RGB in another order) through
    inflate_first_conv, given the indices `rgb` of this data's red, green and blue bands and the
    bands' `names` (the manifest's rgb_bands and bands), saying so on stderr.  Returns what the
    run records of its start: the checkpoint, its sha256, epoch and data set."""
    if not os.path.isfile(path):
        raise SystemExit(f"--init {path}: no such checkpoint (a run folder's checkpoint.pth)")
    try:        # the hash of the very bytes loaded, not of the file read again
        src, ck, sha = load_checkpoint(path, with_sha256=True)
    except ValueError as e:          # crafted, damaged, or not a training checkpoint
        raise SystemExit(f"--init {path}: {e}") from None
    diff = {k: (ck["model_cfg"].get(k), getattr(model.cfg, k)) for k in ("arch", "width", "small_stem")
            if ck["model_cfg"].get(k) != getattr(model.cfg, k)}
    if diff:
        raise SystemExit(f"--init {path} holds another backbone (its, this run's): {diff}; pass "
                         "this run the same --arch, --width and --small-stem")
    state, was, now = src.backbone.state_dict(), src.cfg.in_chans, model.cfg.in_chans
    inflated = None
    if was != now or (rgb is not None and was == 3 and list(rgb) != [0, 1, 2]):
        if was != 3:
            raise SystemExit(f"--init {path} takes {was} bands and this run's data {now}: a "
                             "backbone starts other bands only from RGB (3 bands); pass an RGB "
                             "run's checkpoint, or one of the same bands")
        key = "blocks.0.0.weight" if model.cfg.arch == "alexnet" else "conv1.weight"
        state[key], inflated = inflate_first_conv(state[key], now, rgb, names)
        print(f"--init {path}: {inflated}", file=sys.stderr, flush=True)
    model.backbone.load_state_dict(state)
    src_args = ck.get("args") if isinstance(ck.get("args"), dict) else {}
    supervised = bool(src_args.get("supervised"))
    return {"checkpoint": rel_path(path), "sha256": sha, "epoch": ck.get("epoch"),
            "data": src_args.get("data"), "supervised": supervised,
            "method": "supervised" if supervised else ck.get("method") or "otl",
            **({"inflated": inflated} if inflated else {})}


def lock_run_folder(folder: str, flag: str = "--output", what: str = "training"):
    """Hold `folder`/.lock for this process, so that a second training on the same run folder
    stops at once (SystemExit naming the folder and the process that holds it) instead of both
    writing the same log and checkpoints (`what`: the kind of process, for that message; a
    prepare_data.py run holds its --out the same way).  Returns a function that releases the
    lock (and removes the file).  The lock is an flock on the file, which the kernel drops when
    the process ends however it ends (kill -9 too), so a lock file left behind by a dead process
    is taken over without a word; the file's text (pid, host, start, command) is there to name
    the holder.  Where the file system cannot lock, a warning says so and the run goes on
    unlocked."""
    try:
        import fcntl
    except ImportError:                         # not a POSIX system
        print(f"warning: {folder} is not locked (no fcntl here): make sure no other training "
              "uses it", flush=True)
        return lambda: None
    import socket
    import time
    path = os.path.join(folder, ".lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SystemExit(f"{flag} {folder}: cannot write there ({e.strerror}); pass a folder "
                             "you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 1 << 16).decode() or "{}")
            except ValueError:
                holder = {}
            os.close(fd)
            who = (f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
                   f"{holder.get('started', '?')}: {holder.get('command', '?')}" if holder
                   else "another process, starting now")
            raise SystemExit(f"{flag} {folder} is in use by another {what} ({who}); wait for "
                             f"it to end, or pass another {flag}") from None
        except OSError as e:                    # e.g. ENOLCK on some network file systems
            os.close(fd)
            print(f"warning: {path} cannot be locked ({e}): make sure no other training uses "
                  f"{folder}", flush=True)
            return lambda: None
        try:        # the last holder may have removed the file between our open and flock
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line()}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())

    held = [fd]

    def release():
        if not held:            # released already
            return
        try:                    # removed before it is unlocked: a waiter then sees a new file
            os.remove(path)
        except FileNotFoundError:
            pass
        os.close(held.pop())
    return release


# flags that may change when a run is resumed, without a warning
RESUMABLE_FLAGS = ("epochs", "max_minutes", "no_progress", "device", "knn_monitor", "compile",
                   "labeler_device", "same_flags")


def _newest_intact_snapshot(folder: str):
    """(checkpoint dict, path) of the newest numbered snapshot in `folder` that loads, or
    (None, None)."""
    pattern = os.path.join(folder, "checkpoint[0-9][0-9][0-9][0-9].pth")
    for snap in sorted(glob.glob(pattern), reverse=True):
        try:
            return load_file(snap), snap
        except DamagedFile:
            continue
    return None, None


def _resumable(path: str, folder: str, rank: int, fix: str):
    """(checkpoint dict, the file it came from) to resume from: `path`, or where it is damaged or
    missing the newest intact numbered snapshot, which the first process copies over `path`;
    (None, None) for a new run.  A crafted file stops the run (SystemExit), as does a damaged
    `path` with no intact snapshot beside it."""
    src, why = path, None
    try:
        if os.path.isfile(path):
            try:
                ck = load_file(path)
            except DamagedFile as e:
                why = str(e)
        else:
            why = f"{path} is missing"
        if why is not None:
            ck, src = _newest_intact_snapshot(folder)
    except ValueError as e:                                 # crafted: refused, never unpickled
        raise SystemExit(f"{e}; or {fix}") from None
    if why is None:
        return ck, src
    if ck is None and os.path.isfile(path):
        raise SystemExit(f"{why}, and no intact snapshot is beside it; delete it to start over")
    if ck is None or (not os.path.isfile(path) and ck.get("epoch") == 0):
        return None, None       # a new run (from the random-init snapshot alone: the same start)
    if rank == 0:
        _atomic_write(path, lambda fh: _copy_into(src, fh))
        print(f"warning: {why}; resuming from the newest intact snapshot, {src} (epoch "
              f"{ck.get('epoch')}), copied over {os.path.basename(path)}", flush=True)
    return ck, src


def saved_run_args(folder: str) -> dict | None:
    """The arguments a run folder's checkpoint was trained with (checkpoint.pth, else its newest
    intact snapshot), None for a new run or one whose checkpoints do not read: a resumed run keeps
    the choices it started with where a flag's default has changed since."""
    path = os.path.join(folder, "checkpoint.pth")
    try:
        ck = load_file(path) if os.path.isfile(path) else None
    except ValueError:          # damaged (the newest snapshot below) or crafted (resume says so)
        ck = None
    if ck is None:
        try:
            ck = _newest_intact_snapshot(folder)[0]
        except ValueError:
            ck = None
    args = ck.get("args") if isinstance(ck, dict) else None
    return args if isinstance(args, dict) else None


def _copy_into(src: str, fh) -> None:
    with open(src, "rb") as f:
        shutil.copyfileobj(f, fh, 1 << 20)


def restart_from_checkpoint(path: str, model, optimizer, generator, device, model_cfg: dict, args,
                            ranks=None, extras=None, data: dict | None = None):
    """Resume a run from `path` if it exists: the weights, the optimizer, the random states and
    the pseudo-labels.  Returns (epoch reached, pseudo-labels or None); (0, None) with no
    checkpoint.  extras: a dict whose keys get the checkpoint's values of the same names (None
    where it has none).  A damaged checkpoint (a write cut short), or a missing one beside
    numbered snapshots, gives way to the newest intact snapshot, which the first process then
    copies over `path` (so a finished run's checkpoint.pth is whole again); half-written
    temporary files are removed (by the first process only: the run folder is its, under
    lock_run_folder).  A checkpoint of another model is refused, and so is one trained on other
    data than `data` (data_record(--data) of this run: the pseudo-labels follow the image order
    and split they were made on); other changed flags are warned about.  A crafted or foreign
    file stops the run with one line naming it."""
    folder = os.path.dirname(os.path.abspath(path))
    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    if rank == 0:       # save_checkpoint's, cut short (an evaluation's, still writing, stay)
        remove_dead_temporaries(folder)
    fix = "delete it (or pass another --output) to start a new run"
    ck, src = _resumable(path, folder, rank, fix)
    if ck is None:
        return 0, None
    resumable = (("optimizer", dict), ("args", dict), ("epoch", int))
    problem = checkpoint_problem(ck) or next(
        (f"it has no {key!r} entry, so it is not a checkpoint of train_otl.py"
         for key, kind in resumable if not isinstance(ck.get(key), kind)), None)
    if problem:
        raise SystemExit(f"{src}: {problem}; {fix}")
    then, now = ck.get("method") or "otl", getattr(args, "method", "otl")
    if then != now:     # before the weights: a peer's optimiser state does not fit OTL's, and so on
        raise SystemExit(f"{src} is a run of --method {then}, not {now}: resume it with --method "
                         f"{then}, or pass another --output to train {now}")
    if ck["model_cfg"] != model_cfg:
        diff = {k: (v, model_cfg.get(k)) for k, v in ck["model_cfg"].items() if model_cfg.get(k) != v}
        raise SystemExit(f"{src} holds a different model (checkpoint vs now: {diff}); use another "
                         "--output, or the flags of that run to resume it")
    if data is not None:
        stale = data_change(ck, data)
        if stale:
            raise SystemExit(f"{src} was trained on other data than {args.data} holds now: "
                             f"{stale}. Its pseudo-labels and split are of those images, so it cannot go on "
                             "here: prepare the data as it was for that run, or pass another "
                             "--output to train afresh")
    changed = {k: (v, getattr(args, k)) for k, v in ck["args"].items()
               if k not in RESUMABLE_FLAGS and getattr(args, k, v) != v}
    strict = {k: v for k, v in changed.items() if k not in ("output", "data")}  # the data: by content
    if strict and getattr(args, "same_flags", False):
        raise SystemExit(f"{src} was trained with other flags: " + ", ".join(
            f"--{k.replace('_', '-')} {then} there, {now} here" for k, (then, now) in strict.items())
            + "; delete that run folder (or pass another --output) to train with these flags")
    if changed:
        print(f"warning: resuming with flags that differ from the checkpoint's (checkpoint, now): "
              f"{changed}", flush=True)
    try:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{src}: its weights or optimizer state do not fit the model its config "
                         f"describes ({(str(e).splitlines() or [''])[0][:200]}); {fix}") from None
    if ck["args"].get("init_from"):     # where the run's weights came from stays in its record
        args.init_from = ck["args"]["init_from"]
    saved_world = ck.get("world_size", 1)
    if saved_world == world:   # each rank's random streams, as they were
        ranked = ck["rng_ranks"]
        torch.set_rng_state(ranked[rank]["cpu"])
        generator.set_state(ranked[rank]["gen"])
        if device.type == "cuda" and ranked[rank].get("cuda") is not None:
            torch.cuda.set_rng_state(ranked[rank]["cuda"].cpu())
    elif rank == 0:
        print(f"warning: {src} was written by {saved_world} process(es), this run has {world}: "
              "the weights, optimizer and pseudo-labels are resumed, but the random streams "
              "(batch order, augmentation) start afresh from --seed, so the run will not repeat an "
              f"uninterrupted {saved_world}-process run exactly", flush=True)
    labels = ck.get("pseudo_labels")
    if extras is not None:
        extras.update({key: ck.get(key) for key in extras})
    if rank == 0:
        print(f"resumed from {src} at epoch {ck['epoch']}", flush=True)
    return ck["epoch"], labels.to(device) if labels is not None else None


def trim_log(path: str, epoch: int) -> None:
    """Keep the lines of a log.jsonl up to `epoch`: lines of epochs a resumed run will redo go,
    and so do lines that are not a JSON record of an epoch (a write cut short by a kill or a full
    disk, bytes that are not text), each named in a warning: the checkpoint, not the log, is
    what a run resumes from."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as fh:
        raw = fh.read().split(b"\n")
    kept, damaged = [], []
    for i, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
            ep = row["epoch"]
            if not isinstance(ep, int) or isinstance(ep, bool):
                raise TypeError(f"epoch {ep!r} is not a whole number")
        except (ValueError, TypeError, KeyError) as e:   # UnicodeDecodeError is a ValueError
            damaged.append(f"line {i} ({type(e).__name__})")
            continue
        if ep <= epoch:
            kept.append(line + b"\n")
    if damaged:
        print(f"warning: {path}: dropped {len(damaged)} damaged line(s), not a JSON record of an "
              f"epoch: {', '.join(damaged[:5])}{' ...' if len(damaged) > 5 else ''}", flush=True)
    _atomic_write(path, lambda fh: fh.writelines(kept))


# ----------------------------------------------------------------------------------------------
# Prepared data sets (written by prepare_data.py) and cached features (read by eval_*.py)
# ----------------------------------------------------------------------------------------------
# A prepared data set is a folder holding
#   cache.pt       {"images": uint8 (N, 3, H, W), "labels": int64 (N,), "classes": [str],
#                   "files": [str] (path of each image inside its source); multiband images
#                   are (N, C, H, W) uint8 or uint16, the manifest saying which}
#   split.json     {"seed": int, "test_frac": float, "train": [int], "test": [int], "val": [int]
#                   (part of train: see VAL_FRAC), "val_frac", "val_seed"}
#   manifest.json  source, its sha256, image size, per-class counts, split sizes, channel mean
#                  and std (of value / 255, or / 65535 for uint16), skipped files; multiband sets
#                  add channels, dtype, bands (names or null), band_index (in the source's
#                  files), rgb_bands (where red, green and blue are, or null); written last, so
#                  its presence marks a complete folder

PREPARED_FILES = ("manifest.json", "cache.pt", "split.json")


def prepared_problem(data_dir: str, flag: str = "--data") -> str | None:
    """What keeps `data_dir` from being a prepared data set, as one line naming the folder (after
    `flag`, the flag that gave it, when there is one) or the file, and what to do; None when its
    three files are there and its JSON files read."""
    again = f"run prepare_data.py --out {data_dir} (with the --source it was made from) again"
    name = f"{flag} {data_dir}" if flag else data_dir
    if not os.path.exists(data_dir):
        return (f"{name}: no such folder; pass the folder that prepare_data.py --out wrote, or "
                "make it with prepare_data.py")
    if not os.path.isdir(data_dir):
        return (f"{name} is a file, not a prepared data folder; pass the folder that "
                "prepare_data.py --out wrote (it holds cache.pt, split.json and manifest.json)")
    for f in PREPARED_FILES:
        if not os.path.isfile(os.path.join(data_dir, f)):
            return f"{os.path.join(data_dir, f)} is missing: {again}"
    for f in ("manifest.json", "split.json"):
        try:
            _read_json(os.path.join(data_dir, f), again)
        except ValueError as e:
            return str(e)
    return None


def _read_json(path: str, again: str) -> dict:
    """A JSON file of a prepared data set; ValueError naming it when it is cut short or not
    JSON (prepare_data.py writes them atomically, so that is damage from elsewhere)."""
    obj = read_json(path, again, error=ValueError)
    if obj is None:
        raise FileNotFoundError(f"{path} is missing: {again}")
    return obj


def working_size(side: int, size: int) -> int:
    """The side a stage keeps images of `side` px at for a network that sees `size` px: twice
    `size` when the images are larger than that (a random crop then still upsamples no more than
    2x, and the augmentation and test-time transform never resize from the full cache), else
    `side` as prepared."""
    return 2 * size if side > 2 * size else side


def working_images(images: torch.Tensor, size: int, chunk: int = 512) -> torch.Tensor:
    """uint8 or uint16 (N, C, H, W) resized once, antialiased, to working_size(W, size)
    (unchanged when that is W): a CPU epoch's cost then follows the network, not the cache's 256 px."""
    side = working_size(images.shape[-1], size)
    if side == images.shape[-1] and side == images.shape[-2]:
        return images
    out = torch.empty(*images.shape[:2], side, side, dtype=images.dtype)
    for s in range(0, images.shape[0], chunk):
        x = images[s:s + chunk].float()
        out[s:s + chunk] = F.interpolate(x, size=(side, side), mode="bilinear", antialias=True,
                                         align_corners=False).round_().clamp_(0, torch.iinfo(images.dtype).max)
    return out


# The validation split: a seeded, stratified VAL_FRAC of the training split that every choice (a
# preset, a study's pick, the kNN monitor) reads, so the test split is read only to report a
# finished run.  prepare_data.py records it in split.json ("val"); a folder prepared before it
# did gets the same rows derived here.
VAL_FRAC, VAL_SEED = 0.1, 0


def val_positions(split: dict, train_idx: torch.Tensor, train_labels) -> torch.Tensor:
    """Positions within the training split (train_idx, its labels in that order) of its
    validation part, sorted: split.json's "val" where it records one, else stratified_split of
    the training labels (VAL_FRAC, VAL_SEED), the rows prepare_data.py records.  ValueError when
    a recorded "val" names images outside the training split."""
    if split.get("val") is None:
        return stratified_split(train_labels, VAL_FRAC, VAL_SEED)[1] if len(train_idx) else \
            torch.zeros(0, dtype=torch.long)
    try:
        val = torch.tensor(split["val"], dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("split.json's \"val\" is not a list of image indices") from None
    pos = torch.isin(torch.as_tensor(train_idx), val).nonzero().flatten()
    if pos.numel() != val.unique().numel():
        raise ValueError("split.json's \"val\" names images outside its training split")
    return pos


def load_prepared(data_dir: str, size: int | None = None) -> dict:
    """The prepared data set in `data_dir`: images, labels, classes, train and test indices, and
    the training split's two parts: val_idx (its validation part, val_positions) and fit_idx (the
    rest, what a run trains on unless told otherwise); with `size` (the network's input side),
    the images at working_images(images, size).
    FileNotFoundError or ValueError (a damaged file), each one line naming the file and what to
    run."""
    again = f"run prepare_data.py --out {data_dir} first"
    cache, split = os.path.join(data_dir, "cache.pt"), os.path.join(data_dir, "split.json")
    for p in (cache, split):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} is missing: {again}")
    d = load_file(cache)
    sp = _read_json(split, again)
    try:
        d["train_idx"] = torch.tensor(sp["train"], dtype=torch.long)
        d["test_idx"] = torch.tensor(sp["test"], dtype=torch.long)
    except (KeyError, TypeError, ValueError, RuntimeError):
        raise ValueError(f"{split} does not hold lists of train and test indices: "
                         f"{again}") from None
    n = d["images"].shape[0]
    for part in ("train_idx", "test_idx"):
        if d[part].numel() and not (0 <= int(d[part].min()) and int(d[part].max()) < n):
            raise ValueError(f"{split} names images past the {n} of {cache} (the two files are "
                             f"of different preparations): {again}")
    d["split_seed"] = sp.get("seed")
    try:
        val = val_positions(sp, d["train_idx"], d["labels"][d["train_idx"]])
    except ValueError as e:
        raise ValueError(f"{split}: {e}: {again}") from None
    keep = torch.ones(len(d["train_idx"]), dtype=torch.bool)
    keep[val] = False
    d["val_idx"], d["fit_idx"] = d["train_idx"][val], d["train_idx"][keep]
    if size is not None:
        d["images"] = working_images(d["images"], int(size))
    return d


def model_config(p: dict, manifest: dict, **over) -> otl.ModelConfig:
    """The one builder of a network's config: a preset's or a run's flags (vars(args)) for the data
    of `manifest` (its bands, their mean and std), with `over` replacing fields (k, say)."""
    fields = {key: p[key] for key in ("arch", "k", "small_stem", "width", "heads", "embed")}
    return otl.ModelConfig(**{**fields, "mean": tuple(manifest["channel_mean"]),
                              "std": tuple(manifest["channel_std"]),
                              "in_chans": len(manifest["channel_mean"]), **over})


def augment_options(p: dict) -> dict:
    """otl.augment's keywords (and label_pass's) from a preset or a run's flags (vars(args))."""
    return dict(strong=p["aug"] == "strong", cutout=p["cutout"], rot90=p["rot90"],
                n_ops=p["n_ops"], flip=p["flip"], crop=p["crop"])


def random_net_features(images: torch.Tensor, manifest: dict, preset: str = "cpu", seed: int = 0,
                        device="cpu", progress: bool = False, augmented: bool = False) -> torch.Tensor:
    """(N, d) features of the images through a freshly initialised (seeded) network of `preset`,
    as its heads see them (after the embedding when it has one): the test-time view (augmented:
    one random view of the preset's augmentation per image instead, seeded), BatchNorm on each
    shuffled batch's statistics as in training's label pass.  With fresh_head_outputs, the
    labeler's realistic input (bench_labeler.py, ablations.py)."""
    pre = PRESETS[preset]
    torch.manual_seed(seed)
    model = otl.build_model(model_config(pre, manifest, heads=1)).to(device)   # its features
    if augmented:   # otl.augment draws from the global generator
        torch.manual_seed(seed + 1)
    # label_pass augments only when views > 1: then the second view is made and dropped
    feats = otl.label_pass(model, images, pre["img_size"], 256, device, bn="batch", head=False,
                           views=2 if augmented else 1, **augment_options(pre),
                           generator=torch.Generator().manual_seed(seed), progress=progress)[0]
    if model.embedding is not None:
        with torch.no_grad():
            feats = model.embedding(feats)
    return feats


def fresh_head(d: int, k: int, seed: int = 0):
    """A fresh k-way nn.Linear head on d features (default init, seeded by seed + k)."""
    import torch.nn as nn
    torch.manual_seed(seed + k)
    return nn.Linear(d, k)


def fresh_head_outputs(feats: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """(N, k) outputs of fresh_head(d, k, seed)."""
    with torch.no_grad():
        return fresh_head(feats.shape[1], k, seed).to(feats.device)(feats)


def measure_labeler(O: torch.Tensor, method: str, **settings) -> dict:
    """One labeler by its name (exact, reference, published, sinkhorn: otl_scale.translate's
    method) on outputs O, timed, as the benchmarks and the labeler studies record it: the call's
    seconds (the device synchronised around it), iterations, stop_reason, std (of the counts
    against the target, N / k unless settings give one) and max - min, std_before (argmax alone),
    std_max (every row in one cluster), the std after each step where the labeler keeps them
    (std_history), exact's rows read again and solved; and the method and the settings given
    (the rest translate's defaults), so published as the authors run it (init="zero",
    tie_eps=0) is told from it as train_otl.py runs it."""
    import otl_scale    # here: it imports scipy, which no other helper needs (not timed)
    k = O.shape[1]
    synchronize(O.device)
    t0 = time.perf_counter()
    res = otl_scale.translate(O, method=method, **settings)
    synchronize(O.device)
    seconds = time.perf_counter() - t0
    counts, before = res.counts.cpu(), torch.bincount(O.argmax(1).cpu(), minlength=k)
    rec = {"method": method, "settings": settings, "seconds": round(seconds, 4),
           "iterations": int(res.iterations), "stop_reason": res.stop_reason, "std": res.std,
           "max_minus_min": int(counts.max() - counts.min()),
           "std_before": otl.counts_std(before, res.target), "std_max": res.std_max}
    if res.std_history:
        rec["std_history"] = [round(h, 4) for h in res.std_history]
    if method == "exact":
        rec.update(refetched=res.refetched, active=res.active)
    return rec


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def data_identity(data_dir: str) -> str:
    """What a prepared data set is, not where: its classes, counts, image size and split (a copy
    of the folder, or the same archive prepared again, has the same identity)."""
    man = load_manifest(data_dir)
    keys = ("classes", "per_class_counts", "image_size", "n_images")
    ident = {k: man.get(k) for k in keys}
    if man.get("channels"):         # multiband: which bands (RGB sets keep the identity they had)
        ident.update(bands=man.get("bands"), band_index=man.get("band_index"), dtype=man.get("dtype"))
    ident["split_sha256"] = sha256_file(os.path.join(data_dir, "split.json"))
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def data_record(data_dir: str) -> dict:
    """What a checkpoint records of the prepared data it was trained on: data_identity, the
    sha256 of its cache.pt (images_identity) and a readable summary of both (data_change names
    them when the data have changed since)."""
    man = load_manifest(data_dir)
    split = (f"split seed {man.get('split_seed')}, test fraction {man.get('test_frac')}"
             if man.get("split") == "random" else f"{man.get('split')} split")
    summary = (f"{man.get('n_images')} images of {man.get('image_size')} px in "
               f"{len(man.get('classes') or [])} classes, {split}, {man.get('n_train')} train / "
               f"{man.get('n_test')} test")
    if man.get("channels"):
        summary = summary.replace(" px", f" px, {man['channels']} bands of {man.get('dtype')}", 1)
    return {"data_identity": data_identity(data_dir),
            "images_sha256": images_identity(data_dir)["sha256"], "data_summary": summary,
            **({"data_bands": band_format(man)} if man.get("channels") else {})}


def band_format(man: dict) -> str:
    """The images' bands as a manifest gives them: "3 x uint8" for RGB (a manifest without
    channels), e.g. "13 x uint16" for Sentinel-2's bands."""
    return f"{man.get('channels') or 3} x {man.get('dtype') or 'uint8'}"


def data_change(ckpt: dict, now: dict) -> str | None:
    """How the data a checkpoint was trained on (its data_record entries) differ from `now`
    (data_record of the data at hand), naming both sides; None when they are the same or the
    checkpoint does not record them."""
    for key, what in (("data_identity", "classes, counts, image size or split"),
                      ("images_sha256", "the images (cache.pt)")):
        then = ckpt.get(key)
        if then and now.get(key) and then != now[key]:
            before = ckpt.get("data_summary") or f"{key} {str(then)[:12]}"
            return (f"{what} differ: then {before}; now {now['data_summary']} ({key} "
                    f"{str(then)[:12]} then, {str(now[key])[:12]} now)")
    return None


def images_identity(data_dir: str) -> dict:
    """Which preparation of the images `data_dir` holds: the sha256 of cache.pt that its
    manifest records (prepare_data.py writes it) and the file's size and modification time
    (which change on every rebuild, also where the manifest has no sha256).  Cheap: cache.pt is
    not read."""
    st = os.stat(os.path.join(data_dir, "cache.pt"))
    try:
        sha = (load_manifest(data_dir).get("files_sha256") or {}).get("cache.pt")
    except (OSError, ValueError):
        sha = None
    return {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def load_manifest(data_dir: str) -> dict:
    """manifest.json of a prepared data set; FileNotFoundError or ValueError naming the file."""
    path = os.path.join(data_dir, "manifest.json")
    again = f"run prepare_data.py --out {data_dir} (with the --source it was made from) again"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {again}")
    return _read_json(path, again)


def open_prepared(data_dir: str, flag: str = "--data", size: int | None = None):
    """(data, manifest) of a prepared data set for a stage script: load_prepared (with `size`)
    and load_manifest, with every problem (a missing or damaged file, a path that is not a prepared
    folder) one line naming the flag or file and what to do (SystemExit)."""
    why = prepared_problem(data_dir, flag)
    if why:
        raise SystemExit(why)
    try:
        return load_prepared(data_dir, size), load_manifest(data_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None


def stratified_split(labels, frac: float, seed: int = 0):
    """(kept, held out): a seeded random `frac` of every class held out, round(frac * n_c) images
    of a class of n_c, at least one of every class that has two or more and never all of them.
    Both sorted int64 tensors.  The paper's 80/20 split (prepare_data.py) and the linear probe's
    validation part (eval_linear.py) are this split."""
    if not 0 < frac < 1:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {frac}")
    labels = torch.as_tensor(labels).long().flatten().cpu()
    g = torch.Generator().manual_seed(seed)
    kept, held = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    for c in torch.unique(labels).tolist():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_held = min(max(1, round(frac * idx.numel())), idx.numel() - 1)
        held.append(idx[:n_held])
        kept.append(idx[n_held:])
    return torch.cat(kept).sort().values, torch.cat(held).sort().values


def checkpoint_features(ckpt_path: str, data_dir: str | None = None, device="cpu",
                        batch_size: int = 256, progress: bool = True, layer: str = "pool",
                        amp: bool | None = None) -> dict:
    """Frozen features (of `layer`: otl.OTLNet.features) of the train and test split for a
    checkpoint, extracted once (under otl.autocast(device, amp)) and cached beside it as
    features_<checkpoint name>.pt (or features_<name>_<layer>.pt; reused while the checkpoint,
    data and precision are unchanged).  layer "auto" is the embedding when the model has one,
    else "pool".  Returns {"train": (Ntr, D), "test": (Nte, D), "train_labels", "test_labels",
    "val_pos" (the positions in "train" of the validation split: val_positions), "classes",
    "data_dir", "img_size", "checkpoint", "epoch", "layer" (the layer taken)}."""
    model, ckpt, ckpt_sha256 = load_checkpoint(ckpt_path, device, with_sha256=True)
    args = ckpt.get("args") if isinstance(ckpt.get("args"), dict) else {}
    given, data_dir = data_dir, data_dir or args.get("data")
    if not data_dir:
        raise ValueError(f"{ckpt_path} does not say which data set it was trained on: pass --data")
    if not os.path.exists(data_dir) and not given:
        raise FileNotFoundError(f"no prepared data set at {data_dir} that {ckpt_path} was trained "
                                "on (paths are relative to the folder you run from, now "
                                f"{os.getcwd()}); pass --data with the folder prepare_data.py "
                                "wrote")
    why = prepared_problem(data_dir, "--data" if given else "")
    if why:
        raise FileNotFoundError(why)
    then, now = ckpt.get("data_bands", "3 x uint8"), band_format(load_manifest(data_dir))
    if then != now or model.cfg.in_chans != int(now.split()[0]):
        raise ValueError(f"{ckpt_path} was trained on {then} bands and {data_dir} holds {now}: "
                         "a network reads the bands it was trained on; evaluate it on data "
                         "prepared like its own, or start a run on these bands from it "
                         "(train_otl.py --init, which adapts an RGB backbone to other bands)")
    stale = data_change({k: v for k, v in ckpt.items() if k != "images_sha256"},
                        data_record(data_dir))
    if stale:   # (images prepared again with the same split: a note below, the features are new)
        raise ValueError(f"{data_dir} is not the data set {ckpt_path} was trained on ({stale}); "
                         "pass --data with the folder it was trained on")
    size, crop = int(args.get("img_size", 64)), float(args.get("crop", 1.0))
    if layer == "auto":                     # the embedding when the model has one
        layer = "embed" if model.embedding is not None else "pool"
    stem = os.path.splitext(os.path.basename(ckpt_path))[0]
    if layer != "pool":
        stem += f"_{layer}"
    cache = os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), f"features_{stem}.pt")
    # keyed on content: a checkpoint or split replaced in place (same size, same mtime) is seen,
    # and so are images prepared again (prepare_data.py rebuilding cache.pt from a changed source);
    # the checkpoint's hash is of the bytes the model was loaded from, not of the file as it is
    # now (a training may have replaced it since)
    key = {"checkpoint_sha256": ckpt_sha256, "data": os.path.abspath(data_dir),
           "split_sha256": sha256_file(os.path.join(data_dir, "split.json")), "img_size": size,
           "images": images_identity(data_dir)}
    if crop != 1:
        key["crop"] = crop
    side = load_manifest(data_dir).get("image_size")
    if side and working_size(int(side), size) != int(side):
        key["working_size"] = working_size(int(side), size)   # images resized once (load_prepared)
    if layer != "pool":
        key["layer"] = layer
    bf16 = amp if amp is not None else torch.device(device).type == "cuda"   # as otl.autocast
    if bf16 != (torch.device(device).type == "cuda"):    # caches made before --amp keep their key
        key["bf16"] = bf16
    if os.path.isfile(cache):
        try:
            saved = load_file(cache)
        except DamagedFile as e:        # a cache: extracted again (a crafted one is refused)
            print(f"note: {e}; extracting the features again", flush=True)
            saved = None
        if isinstance(saved, dict) and saved.get("key") == key:
            return {**saved, "layer": layer, "val_pos": _val_of(data_dir, saved)}
    trained_on, now = ckpt.get("images_sha256"), key["images"]["sha256"]
    if trained_on and now and trained_on != now:
        print(f"note: the images of {data_dir} were prepared again since {ckpt_path} was trained "
              "(its cache.pt is another file than then): the features are of the images as they "
              "are now", flush=True)
    d = load_prepared(data_dir, size)
    feats = otl.extract_features(model, d["images"], size, batch_size, device, progress,
                                 layer=layer, crop=crop, amp=amp)                                 # (N, D)
    out = {"train": feats[d["train_idx"]], "test": feats[d["test_idx"]],
           "train_labels": d["labels"][d["train_idx"]], "test_labels": d["labels"][d["test_idx"]],
           "classes": list(d["classes"]), "data_dir": data_dir, "img_size": size,
           "checkpoint": os.path.abspath(ckpt_path), "epoch": ckpt.get("epoch"), "key": key}
    try:
        save_checkpoint(out, cache)
    except CannotWrite as e:      # a cache: the evaluation goes on without it
        print(f"note: the features are not cached ({e}); the next evaluation extracts them again",
              flush=True)
    return {**out, "layer": layer, "val_pos": _val_of(data_dir, out)}


def _val_of(data_dir: str, feats: dict) -> torch.Tensor:
    """val_positions of the data set whose features these are (split.json and the training
    labels: cache.pt is not read)."""
    sp = _read_json(os.path.join(data_dir, "split.json"), f"run prepare_data.py --out {data_dir} again")
    return val_positions(sp, torch.tensor(sp["train"], dtype=torch.long), feats["train_labels"])


# ----------------------------------------------------------------------------------------------
# Flags every evaluation script takes
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
    p.add_argument("--batch-size", type=positive_int, default=256,
                   help="images per batch for feature extraction; lower it if memory runs out "
                        "(it does not change the features: the model is in eval mode)")
    p.add_argument("--feature", default="pool", help="the layer evaluated: pool (the backbone's "
                   "pooled output, default), embed (the embedding, for models with one: the "
                   "paper's 128-d AlexNet layer), conv1 .. conv5 (a conv block averaged over "
                   "space), or auto (embed when the model has an embedding, else pool)")
    p.add_argument("--split", default="test", choices=["test", "val"], help="test (default): "
                   "fit on the whole training split, score the test split, once per finished "
                   "run, to report it; val: fit on the training split less its validation part "
                   "and score that part, for choosing (a preset, a study's pick) without reading "
                   "the test split")
    p.add_argument("--amp", type=str2bool, default=None, help="bfloat16 autocast in the feature "
                   "extraction; default: on for CUDA and for a CPU with native bf16 (avx512_bf16 "
                   "or amx_bf16), where it is faster; false: float32")
    p.add_argument("--output", default=None,
                   help=f"results JSON; default <checkpoint dir>/{prefix}_<checkpoint stem>.json "
                   "(_<feature> added for another --feature, val_ after the prefix for --split val)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (for logs and batch jobs)")


def eval_features(args):
    """(device, features) for an evaluation script's flags (add_checkpoint_args)."""
    device = pick_device(args.device)
    args.amp = resolve_amp(getattr(args, "amp", None), device)
    try:
        feats = checkpoint_features(args.checkpoint, args.data, device=device,
                                    batch_size=args.batch_size, progress=not args.no_progress,
                                    layer=getattr(args, "feature", "pool"), amp=args.amp)
    except (OSError, ValueError) as e:       # missing, damaged or unreadable files: one line
        raise SystemExit(str(e)) from None
    if hasattr(args, "feature"):
        args.feature = feats["layer"]        # "auto" resolved, so output names say which layer
    if getattr(args, "split", "test") == "val":     # the training split's two parts, test unread
        keep = torch.ones(len(feats["train"]), dtype=torch.bool)
        keep[feats["val_pos"]] = False
        feats = {**feats, "test": feats["train"][~keep], "test_labels": feats["train_labels"][~keep],
                 "train": feats["train"][keep], "train_labels": feats["train_labels"][keep]}
    for part in ("train", "test"):
        if feats[part].shape[0] == 0:
            if getattr(args, "split", "test") == "val":
                raise SystemExit(f"--split val: the validation part of {feats['data_dir']}'s "
                                 "training split is empty (a class needs 2 training images to "
                                 "give it one); use --split test")
            raise SystemExit(f"the {part} split of {feats['data_dir']} is empty: nothing to "
                             f"{'fit' if part == 'train' else 'score'}; prepare the data again "
                             "with a --test-frac that leaves images on both sides")
    if feats["train_labels"].unique().numel() < 2:
        names = sorted({feats["classes"][i] for i in feats["train_labels"].unique().tolist()})
        raise SystemExit(f"{feats['data_dir']} holds one class ({', '.join(names)}): every "
                         "classifier scores 100 % on it, whatever the features; evaluate on a data "
                         "set of two or more classes (prepare_data.py --source <folder of class "
                         "folders>)")
    return device, feats


def eval_record(args, feats: dict, seconds: float) -> dict:
    """What every evaluation's results JSON records besides its scores."""
    return {"split": getattr(args, "split", "test"), "amp": getattr(args, "amp", None),
            "checkpoint": rel_path(args.checkpoint), "epoch": feats["epoch"],
            "checkpoint_sha256": feats["key"]["checkpoint_sha256"],
            "data_dir": rel_path(feats["data_dir"]), "n_train": feats["train"].shape[0],
            "n_test": feats["test"].shape[0], "feat_dim": feats["train"].shape[1],
            "command": command_line(), "args": vars(args), "git_commit": git_commit(),
            "seconds": seconds}


def default_output(checkpoint: str, prefix: str, layer: str = "pool", split: str = "test") -> str:
    """<checkpoint dir>/<prefix>_<checkpoint stem>.json (_<layer> added for another layer,
    <prefix>_val_... for the validation split's)"""
    stem = os.path.splitext(os.path.basename(checkpoint))[0] + ("" if layer == "pool" else f"_{layer}")
    prefix += "" if split == "test" else f"_{split}"
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"{prefix}_{stem}.json")


# ----------------------------------------------------------------------------------------------
# Results files: reading them checked (every stage script's and report's), tables, the paper
# ----------------------------------------------------------------------------------------------

def is_number(v):
    """A finite JSON number (not a bool, which Python counts as an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_whole(v):
    """A whole number >= 0 (an epoch, a count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_top1(v):
    """A top-1 accuracy in percent."""
    return is_number(v) and 0 <= v <= 100


WHOLE = (is_whole, "a whole number >= 0")
TOP1 = (is_top1, "a top-1 accuracy: a number in [0, 100]")
EVAL_FIELDS = {
    "epoch": WHOLE, "n_test": WHOLE, "linear_top1": TOP1,
    "knn_top1": (lambda v: isinstance(v, dict) and v and all(map(is_top1, v.values())),
                 "{k: top-1 accuracy in [0, 100]}"),
    "checkpoint_sha256": (lambda v: isinstance(v, str) and len(v) == 64, "a sha256 in hex"),
    "data_dir": (lambda v: isinstance(v, str), "a path")}
RESULTS_FIELDS = {
    "epochs": WHOLE, "train_minutes": (lambda v: is_number(v) and v >= 0, "a number >= 0"),
    "init_from": (lambda v: v is None or isinstance(v, dict) and isinstance(v.get("checkpoint"), str),
                  'null or {"checkpoint": path, ...}')}
MANIFEST_FIELDS = {"test_frac": (lambda v: v is None or is_number(v) and 0 < v < 1,
                                  "a fraction in (0, 1)")}
LOG_NUMBERS = ("loss", "pl_std", "labeler_s")     # the log's fields that reports and studies read


def _shown(v, n=60):
    text = json.dumps(v)
    return text if len(text) <= n else text[:n] + "..."


def read_json(path, remake, fields=None, required=(), error=SystemExit):
    """The JSON object in `path`, None when there is no such file.  A file that is damaged (cut
    short, not UTF-8), not an object, without a `required` field, or with a field of `fields`
    ({name: (test, what it must be)}) that fails its test raises `error` (a stage script stops;
    the data loaders raise ValueError) with one line naming the file, what is wrong and `remake`:
    what to do to make it again."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            obj = json.loads(fh.read().decode("utf-8"))
    except OSError as e:
        raise error(f"cannot read {path} ({e.strerror or e}); {remake}") from None
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError
        raise error(f"{path} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                    f"{remake}") from None
    if not isinstance(obj, dict):
        raise error(f"{path} holds {_shown(obj)}, not a JSON object; {remake}")
    for name in required:
        if name not in obj:
            raise error(f'{path} has no "{name}"; {remake}')
    for name, (test, what) in (fields or {}).items():
        if name in obj and not test(obj[name]):
            raise error(f'{path}: "{name}" is {_shown(obj[name])}, not {what}; {remake}')
    return obj


def eval_command(kind, checkpoint, feature="pool"):
    """The command that writes the evaluation JSON of `kind` ("knn" or "linear") of a checkpoint
    where report.py reads it."""
    script = "eval_linear.py" if kind == "linear" else "eval_knn.py"
    return f"python {script} --checkpoint {checkpoint}" + ("" if feature == "pool" else
                                                          f" --feature {feature}")


def read_eval(path, kind, checkpoint, feature="pool", remake=None):
    """The evaluation JSON at `path` of `kind` ("knn": eval_knn.py's, "linear": eval_linear.py's)
    of `checkpoint`, its fields checked; None when there is none."""
    return read_json(path, remake or f"run {eval_command(kind, checkpoint, feature)} again",
                     EVAL_FIELDS, ("epoch", f"{kind}_top1"))


def read_results(run_dir):
    """A run folder's results.json (written when the run finished), its fields checked; None when
    there is none."""
    # a finished run given its train_otl.py command again writes only results.json
    return read_json(os.path.join(run_dir, "results.json"), "delete it and run the run's "
                     f"train_otl.py command (--output {run_dir}) again: it writes it anew",
                     RESULTS_FIELDS, ("epochs",))


def jsonl_records(path, valid):
    """([(line number, record)] of the lines of a JSON-lines file that `valid` accepts, [line
    numbers of the others]); blank lines are neither."""
    good, bad = [], []
    with open(path, "rb") as fh:
        for i, line in enumerate(fh.read().split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                rec = None
            (good if valid(rec) else bad).append((i, rec))
    return good, [i for i, _ in bad]


def line_numbers(nums, most=10):
    return ", ".join(map(str, nums[:most])) + (" ..." if len(nums) > most else "")


def read_log(path):
    """The epochs' records of a log.jsonl ([] when there is none).  A line that is not a JSON
    object with a whole-number "epoch" (a write cut short) is skipped, and a field of LOG_NUMBERS
    that is not a finite number is left out, each with a warning naming the file and lines: the
    log only adds figures to a table."""
    if not os.path.isfile(path):
        return []
    good, bad = jsonl_records(path, lambda r: isinstance(r, dict) and is_whole(r.get("epoch")))
    if bad:
        print(f"warning: {path}: skipped damaged line(s) {line_numbers(bad)}, not a JSON record of "
              "an epoch (train_otl.py drops them when the run resumes)", flush=True)
    out, typed = [], []
    for i, rec in good:
        wrong = [k for k in LOG_NUMBERS if k in rec and not is_number(rec[k])]
        if wrong:
            typed.append(f"{i} ({', '.join(wrong)})")
        out.append({k: v for k, v in rec.items() if k not in wrong})
    if typed:
        print(f"warning: {path}: left out fields that are not finite numbers, line(s) "
              f"{line_numbers(typed)}", flush=True)
    return out


def stale(path, ev, checkpoint, epochs, command=None):
    """None when the evaluation `ev` (read from `path`) is of the run's `checkpoint`, which is of
    epoch `epochs` (None: not known); else one line naming both sides and what to do (command:
    what evaluates it again).  The sha256 decides where the evaluation and the file both give
    one, the epoch where it is known."""
    had = ev.get("checkpoint_sha256")
    sha = sha256_file(checkpoint) if had and os.path.isfile(checkpoint) else None
    if sha in (None, had) and epochs in (None, ev["epoch"]):
        return None
    if sha is not None and sha == had:      # the evaluation is of this file: results.json is older
        return (f"{os.path.join(os.path.dirname(checkpoint), 'results.json')} says {epochs} "
                f"epochs, but {checkpoint}, evaluated in {path}, is of epoch {ev['epoch']}: the "
                "run has not finished; run its train_otl.py command again, then evaluate it again")
    why = (f"{path} is an evaluation of epoch {ev['epoch']}" + (f" (sha256 {had[:12]})" if had else "")
           + f", but the run's {checkpoint} is of epoch {'?' if epochs is None else epochs}"
           + (f" (sha256 {sha[:12]})" if sha else ""))
    return why + (f"; evaluate it again: {command}" if command else "")


def mean_sd(vals):
    """(mean, sample sd) of a list of numbers; sd 0 for one number: every table's +- sd."""
    m = math.fsum(vals) / len(vals)
    sd = (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
    return m, sd


def formula_std(n, k, x):
    """The sample std over the clusters of the paper's unrounded uneven target,
    n_i = N i^x / sum_i i^x with i = 0 .. k-1 (table dis-com's stds)."""
    w = torch.arange(k, dtype=torch.float64) ** float(x)
    return (n * w / w.sum()).std().item()


def md_table(header, rows):
    """Markdown table lines of a header and rows of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def write_text(text: str, path: str) -> None:
    """A text file (a report's markdown) written atomically: a crash leaves the old one whole."""
    _atomic_write(path, lambda fh: fh.write(text.encode()))


def paper_tables(path=os.path.join(REPO, "paper_tables.json")):
    """The paper's tables (by LaTeX label) and protocols, as paper_tables.json transcribes them."""
    with open(path) as fh:
        return json.load(fh)
