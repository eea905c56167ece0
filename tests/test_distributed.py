"""Training across processes on the CPU (gloo), as torchrun runs it: the pseudo-labels of two
processes equal one process's, and a two-process run killed and resumed ends with the weights of
an uninterrupted one."""
import faulthandler
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import otl
import train_otl
import utils
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--width", "8", "--img-size", "16", "--k", "16", "--batch-size", "32", "--preset", "cpu",
        "--device", "cpu", "--no-progress"]


def _label_args(data, out):
    # test-time views (augmented ones are random per process) and running BatchNorm statistics
    # (batch statistics depend on how the images are batched, which differs between processes)
    return train_otl.resolve_args(train_otl.get_args_parser().parse_args(
        ["--data", str(data), "--output", str(out), *TINY, "--label-views", "1", "--views", "1",
         "--label-bn", "eval", "--label-head-rows", "64"]), torch.device("cpu"))


def _labels_of(data, ckpt, args, ranks):
    d = utils.load_prepared(str(data))
    n = len(d["train_idx"])
    lo, hi = ranks.shard(n)
    model = utils.load_checkpoint(ckpt)[0]
    gen = torch.Generator().manual_seed(ranks.rank)
    images = d["images"][d["train_idx"][lo:hi]]
    labels, log, first = train_otl.make_labels(model, images, args, torch.device("cpu"), gen, ranks, n)
    # again from a start near that translation (--labeler-start epochs): the same on every rank
    near = {0: first[0] + 0.05 * torch.randn(first[0].shape, dtype=torch.float64,
                                             generator=torch.Generator().manual_seed(1))}
    args.labeler_start = "epochs"
    again = train_otl.make_labels(model, images, args, torch.device("cpu"), gen, ranks, n, near)[0]
    args.labeler_start = "views"
    return labels, log, again


def _rank_main(rank, world, port, data, ckpt, out):
    # A crash in C++ (one CI run saw rank 1 end on SIGABRT, "terminate called without an active
    # exception", which 60 runs here did not repeat) prints every thread's Python stack to the
    # stderr that pytest shows, so the next one says where it happened.
    faulthandler.enable(all_threads=True)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = utils.Ranks("cpu")
    labels, log, again = _labels_of(data, ckpt, _label_args(data, out), ranks)
    torch.save({"labels": labels, "log": log, "again": again}, f"{out}/labels_{rank}.pt")
    ranks.close()
    utils.leave_torchrun()      # as train_otl.py does: no teardown around gloo's threads


def test_two_processes_label_like_one(small_data, tmp_path):
    torch.manual_seed(0)
    cfg = otl.ModelConfig(k=16, width=8, small_stem=False)
    ckpt = str(tmp_path / "net.pth")
    utils.save_checkpoint({"model": otl.build_model(cfg).state_dict(),
                           "model_cfg": utils.model_state(cfg), "args": {}, "epoch": 0}, ckpt)
    single, slog, single_again = _labels_of(small_data, ckpt, _label_args(small_data, tmp_path),
                                            utils.Ranks("cpu"))
    mp.start_processes(_rank_main, args=(2, free_port(), str(small_data), ckpt, str(tmp_path)),
                       nprocs=2, start_method="spawn")
    parts = [torch.load(tmp_path / f"labels_{r}.pt") for r in range(2)]
    both = torch.cat([p["labels"] for p in parts], 1)
    assert both.shape == single.shape == (1, 160)
    assert torch.equal(both, single)
    counts = torch.bincount(both[0], minlength=16)
    assert int(counts.max() - counts.min()) <= 1                     # balanced over both shards
    again = torch.cat([p["again"] for p in parts], 1)               # from a given start too
    assert torch.equal(again, single_again)
    counts = torch.bincount(again[0], minlength=16)
    assert int(counts.max() - counts.min()) <= 1
    for p in parts:                                                   # the log speaks for all rows
        assert p["log"]["pl_std"] == slog["pl_std"]
        assert p["log"]["clusters_used_before"] == slog["clusters_used_before"]


def _torchrun(out, data, epochs, *extra, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "train_otl.py", "--data", str(data), "--output",
           str(out), *TINY, "--epochs", str(epochs), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if wait:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)


def _descendants(pid):
    """Every process below `pid`, from /proc (children of each of its threads)."""
    out = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids = [int(c) for c in open(task).read().split()]
        except OSError:
            continue
        for c in kids:
            out += [c] + _descendants(c)
    return out


def test_two_process_run_resumes_after_a_kill(small_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    p = _torchrun(a, small_data, 6)
    assert p.returncode == 0, p.stderr[-3000:]
    ck = utils.load_file(a / "checkpoint.pth")
    assert ck["world_size"] == 2 and len(ck["rng_ranks"]) == 2
    assert ck["pseudo_labels"].shape == (2, 140)      # both shards' labels (train less val)
    # the same run, both processes killed once the first epoch is committed
    proc = _torchrun(b, small_data, 6, wait=False)
    deadline = time.time() + 300
    while not (b / "checkpoint.pth").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # torchrun may start its workers in sessions of their own: kill every descendant, not only
    # the group, or a worker lives on and writes beside the resumed run
    tree = [proc.pid] + _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    assert (b / "checkpoint.pth").exists() and not (b / "results.json").exists()
    p = _torchrun(b, small_data, 6)
    assert p.returncode == 0, p.stderr[-3000:]
    wa, wb = utils.load_file(a / "checkpoint.pth")["model"], utils.load_file(b / "checkpoint.pth")["model"]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    lines = (b / "log.jsonl").read_text().splitlines()
    assert len(lines) == 6
    # resumed by one process: said, and carried on from the weights and labels
    c = tmp_path / "c"
    shutil.copytree(a, c)
    os.remove(c / "results.json")
    p = subprocess.run([sys.executable, "train_otl.py", "--data", str(small_data), "--output",
                        str(c), *TINY, "--epochs", "7"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "written by 2 process(es), this run has 1" in p.stdout
    assert utils.load_file(c / "checkpoint.pth")["epoch"] == 7


@pytest.mark.parametrize("flags, says", [(("--labeler", "published"), "--labeler exact"),
                                         (("--labeler-device", "cpu"), "drop the flag")])
def test_one_process_labeler_flags_are_refused_across_processes(small_data, tmp_path, flags, says):
    p = _torchrun(tmp_path / "p", small_data, 1, *flags)
    assert p.returncode != 0 and says in p.stderr


def test_a_finished_torchrun_process_leaves_without_teardown():
    """utils.leave_torchrun: under torchrun (WORLD_SIZE > 1) the process exits 0 at once, its
    output flushed; nothing after it runs (so no teardown frees gloo's threads); alone, it returns."""
    code = ("import sys, utils; print('written', end=''); sys.stderr.write('said');"
            "utils.leave_torchrun(); print(' and after')")
    for world, out in (("2", "written"), ("1", "written and after")):
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "WORLD_SIZE": world}, timeout=120)
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, out, "said")
