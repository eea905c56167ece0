"""Recovery paths and user errors, each found by trying the code as a hostile user would: stale
features after the data are prepared again, two trainings on one run folder, a damaged log line,
file names that are not UTF-8 and symlink loops, a full disk, --epochs 0, damaged or missing
checkpoints beside their snapshots, user errors that must be one line, empty or lone classes and
huge images.  Every case here failed before it was fixed.  Tiny synthetic folders and networks:
each test takes seconds."""
import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib

import pytest
import torch

import eval_knn
import eval_linear
import train_otl
import utils
from conftest import prep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
TINY = ["--width", "8", "--img-size", "16", "--k", "4", "--batch-size", "8", "--preset", "cpu",
        "--device", "cpu", "--no-progress", "--schedule", "step", "--lr-drops", "--lr-values"]


def _fill_the_disk(error=None):
    """A torch.save that writes part of the file, then fails as on a full disk: ENOSPC from a
    Python file object, torch's own short-write error when it writes a file by name (or
    `error`)."""
    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                fh.write(b"x" * 1000)
            raise error or RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                        "pos 1000 vs 898")
        f.write(b"x" * 1000)
        raise error or OSError(errno.ENOSPC, "No space left on device")
    return save


def _png(path, array):
    from PIL import Image
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path)


def _colour_folder(root, colours=COLOURS, n=8, size=16, seed=0):
    """A class folder per colour, n noisy images of that colour in each."""
    g = torch.Generator().manual_seed(seed)
    for c, rgb in colours.items():
        for i in range(n):
            noise = torch.randint(-25, 26, (size, size, 3), generator=g)
            x = torch.tensor(rgb).view(1, 1, 3) + noise
            _png(os.path.join(root, c, f"{i}.png"), x.clamp(0, 255).to(torch.uint8).numpy())
    return root


def _train(data, out, *extra):
    args = train_otl.get_args_parser().parse_args(["--data", str(data), "--output", str(out),
                                                   *TINY, *extra])
    return train_otl.main(args)


def _eval(module, ckpt, *extra):
    return module.main(module.get_args_parser().parse_args(
        ["--checkpoint", str(ckpt), "--device", "cpu", "--no-progress", *extra]))


def _log(run):
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory):
    """A prepared folder of 3 colour classes, 8 images each (19 train / 5 test)."""
    root = tmp_path_factory.mktemp("colours")
    prep(_colour_folder(root / "src"), root / "data")
    return root / "data"


# ------------------------------------------------------------------------------------------------
# 1. the feature cache follows the images, not only the checkpoint and the split
# ------------------------------------------------------------------------------------------------

def test_features_follow_images_prepared_again(tmp_path, capsys):
    """prepare -> train -> kNN and linear -> the source's images change and prepare_data.py
    rebuilds -> both evaluations give what they give with no feature cache, not the old numbers."""
    src, data, run = _colour_folder(tmp_path / "src"), tmp_path / "data", tmp_path / "run"
    prep(src, data)
    _train(data, run, "--epochs", "1")
    ckpt = run / "checkpoint.pth"
    _eval(eval_knn, ckpt, "--ks", "3")
    _eval(eval_linear, ckpt, "--wd-grid", "1e-3")
    cache = run / "features_checkpoint.pt"
    old = utils.load_file(cache)["train"]
    # the classes swap colours: same names, counts and split, other images
    _colour_folder(src, {"red": COLOURS["green"], "green": COLOURS["blue"], "blue": COLOURS["red"]},
                   seed=1)
    capsys.readouterr()
    prep(src, data)
    assert "stale" in capsys.readouterr().out
    knn = _eval(eval_knn, ckpt, "--ks", "3")
    lin = _eval(eval_linear, ckpt, "--wd-grid", "1e-3")
    out = capsys.readouterr().out
    cached = utils.load_file(cache)["train"]
    os.remove(cache)                                    # the truth: features of the images now
    fresh_knn = _eval(eval_knn, ckpt, "--ks", "3")
    fresh_lin = _eval(eval_linear, ckpt, "--wd-grid", "1e-3")
    fresh = utils.load_file(cache)["train"]
    assert not torch.equal(old, fresh)                  # the images did change
    assert torch.equal(cached, fresh)
    assert knn["knn_top1"] == fresh_knn["knn_top1"]
    assert lin["linear_top1"] == fresh_lin["linear_top1"]
    assert "prepared again since" in out         # and the evaluation says the images changed


# ------------------------------------------------------------------------------------------------
# 2. one training per run folder
# ------------------------------------------------------------------------------------------------

def test_lock_run_folder(tmp_path):
    release = utils.lock_run_folder(str(tmp_path))
    lock = json.loads((tmp_path / ".lock").read_text())
    assert lock["pid"] == os.getpid() and lock["host"]
    with pytest.raises(SystemExit, match=f"--output {tmp_path} is in use by another training "
                                         f"\\(process {os.getpid()} on "):
        utils.lock_run_folder(str(tmp_path))
    release()
    release()                                   # twice is harmless
    assert not (tmp_path / ".lock").exists()
    utils.lock_run_folder(str(tmp_path))()      # free again


def test_a_second_training_on_a_folder_in_use_stops_at_once(colour_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import utils; "
         "utils.lock_run_folder(sys.argv[2]); print('held', flush=True); sys.stdin.read()",
         ROOT, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (run / "checkpoint.pth.tmp99999").write_bytes(b"the other run's write in progress")
        with pytest.raises(SystemExit) as e:
            _train(colour_data, run, "--epochs", "1")
        msg = str(e.value.code)
        assert str(run) in msg and f"process {holder.pid} on " in msg and "\n" not in msg
        # stopped before touching anything: the other run's files are as they were
        assert sorted(os.listdir(run)) == [".lock", "checkpoint.pth.tmp99999"]
        holder.send_signal(signal.SIGKILL)               # kill -9: its lock file stays behind
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=30)
    assert (run / ".lock").exists()
    res = _train(colour_data, run, "--epochs", "1")       # a dead holder's lock is taken over
    assert res["epochs"] == 1 and [r["epoch"] for r in _log(run)] == [1]
    assert not (run / ".lock").exists()                   # released at the end of the run


# ------------------------------------------------------------------------------------------------
# 3. a damaged last line of log.jsonl
# ------------------------------------------------------------------------------------------------

def test_resume_after_a_damaged_last_log_line(colour_data, tmp_path, capsys):
    """A last line cut short (bytes that are not text, then JSON cut off): each resume drops it
    with a warning, and the run goes on from its checkpoint."""
    run = tmp_path / "run"
    flags = ["--epochs", "3", "--max-minutes", "1e-9"]          # one epoch per call
    assert _train(colour_data, run, *flags) is None
    for epoch, damage in ((1, b"\xff\xfe{\"epo"), (2, b"{\"epoch\": 3, \"lo")):
        with open(run / "log.jsonl", "ab") as fh:
            fh.write(damage)
        capsys.readouterr()
        _train(colour_data, run, *flags)
        assert "log.jsonl: dropped 1 damaged line(s)" in capsys.readouterr().out
        assert [r["epoch"] for r in _log(run)] == list(range(1, epoch + 2))
    assert utils.load_file(run / "checkpoint.pth")["epoch"] == 3


def test_trim_log_drops_every_damaged_line(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"epoch": 1}\n[1, 2]\n{"epoch": 2}\n\xff\n{"epoch": 3}\n{"epoch": "x"}\n{"ep')
    utils.trim_log(str(log), 2)
    assert log.read_text() == '{"epoch": 1}\n{"epoch": 2}\n'
    out = capsys.readouterr().out
    assert "dropped 4 damaged line(s)" in out and str(log) in out
    assert ("line 2 (TypeError), line 4 (UnicodeDecodeError), line 6 (TypeError), line 7 "
            "(JSONDecodeError)") in out


# ------------------------------------------------------------------------------------------------
# 4. file names that are not UTF-8, symlink loops
# ------------------------------------------------------------------------------------------------

def test_names_not_utf8_and_symlink_loops_are_bad_files(tmp_path):
    src = _colour_folder(tmp_path / "src", n=3)
    shutil.copy(src / "red" / "0.png", os.path.join(os.fsencode(src / "red"), b"\xff\xfe.png"))
    with pytest.raises(SystemExit) as e:
        prep(src, tmp_path / "out")
    msg = str(e.value.code)
    assert "red/\\xff\\xfe.png" in msg and "not UTF-8" in msg and "--skip-bad" in msg
    os.symlink("loop.png", src / "blue" / "loop.png")              # a link to itself
    with pytest.raises(SystemExit, match="blue/loop.png .*symbolic links.*2 such file"):
        prep(src, tmp_path / "out")
    man = prep(src, tmp_path / "out", "--skip-bad")
    assert man["n_images"] == 9
    assert sorted(s["file"] for s in man["skipped"]) == ["blue/loop.png", "red/\\xff\\xfe.png"]
    json.loads((tmp_path / "out" / "manifest.json").read_text())


# ------------------------------------------------------------------------------------------------
# 5. a full disk
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")])
def test_a_full_disk_says_so_and_removes_its_temporary_file(tmp_path, monkeypatch, error):
    path = tmp_path / "checkpoint.pth"
    utils.save_checkpoint({"epoch": 1}, str(path))
    real = torch.save
    monkeypatch.setattr(torch, "save", _fill_the_disk(error))
    with pytest.raises(SystemExit) as e:
        utils.save_checkpoint({"epoch": 2}, str(path))
    msg = str(e.value.code)
    assert f"cannot write {path}: the disk is full" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == ["checkpoint.pth"]          # the temporary file is gone
    monkeypatch.setattr(torch, "save", real)
    assert utils.load_file(path) == {"epoch": 1}                # the old one is intact


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_for_json_and_logs(tmp_path):
    """/dev/full: every write to it fails with ENOSPC, as on a disk that is full."""
    path = tmp_path / "results.json"
    utils.write_json({"x": 1}, str(path))
    os.symlink("/dev/full", f"{path}.tmp{os.getpid()}")       # the write lands on a full disk
    with pytest.raises(SystemExit, match="results.json: the disk is full"):
        utils.write_json({"x": 2}, str(path))
    assert sorted(os.listdir(tmp_path)) == ["results.json"]
    assert json.loads(path.read_text()) == {"x": 1}
    os.symlink("/dev/full", tmp_path / "log.jsonl")
    with pytest.raises(SystemExit, match="log.jsonl: the disk is full"):
        utils.append_line(str(tmp_path / "log.jsonl"), "{}")


def test_a_full_disk_during_training_stops_cleanly_and_resumes(colour_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "1")
    real = torch.save
    monkeypatch.setattr(torch, "save", _fill_the_disk())
    with pytest.raises(SystemExit, match="the disk is full"):
        _train(colour_data, run, "--epochs", "2")
    monkeypatch.setattr(torch, "save", real)
    assert not [f for f in os.listdir(run) if ".tmp" in f]
    assert utils.load_file(run / "checkpoint.pth")["epoch"] == 1
    assert _train(colour_data, run, "--epochs", "2")["epochs"] == 2
    assert [r["epoch"] for r in _log(run)] == [1, 2]


# ------------------------------------------------------------------------------------------------
# 6. --epochs 0
# ------------------------------------------------------------------------------------------------

def test_zero_epochs_names_a_checkpoint_that_exists(colour_data, tmp_path):
    res = _train(colour_data, tmp_path / "run", "--epochs", "0")
    assert res["untrained"] is True     # a report cannot take it for a trained run
    model, ck = utils.load_checkpoint(res["checkpoint"])
    assert ck["epoch"] == 0
    w0 = utils.load_file(tmp_path / "run" / "checkpoint0000.pth")["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k


# ------------------------------------------------------------------------------------------------
# 7. damaged or missing checkpoint.pth beside snapshots
# ------------------------------------------------------------------------------------------------

def test_damaged_checkpoint_of_a_finished_run_is_restored(colour_data, tmp_path, capsys):
    run = tmp_path / "run"
    done = _train(colour_data, run, "--epochs", "2")
    ck = run / "checkpoint.pth"
    data = ck.read_bytes()
    ck.write_bytes(data[:len(data) // 2])
    capsys.readouterr()
    assert _train(colour_data, run, "--epochs", "2") == done       # finished: nothing to train
    assert ck.read_bytes() == (run / "checkpoint0002.pth").read_bytes()
    utils.load_checkpoint(str(ck))
    out = capsys.readouterr().out
    assert "checkpoint0002.pth (epoch 2), copied over checkpoint.pth" in out
    assert f"resumed from {run / 'checkpoint0002.pth'} at epoch 2" in out


def test_missing_checkpoint_resumes_from_the_newest_snapshot(colour_data, tmp_path, capsys):
    flags = ["--epochs", "3", "--snapshot-every", "1"]
    _train(colour_data, tmp_path / "a", *flags)
    run = tmp_path / "b"
    _train(colour_data, run, *flags, "--max-minutes", "1e-9")           # stops after epoch 1
    _train(colour_data, run, *flags, "--max-minutes", "1e-9")           # and after epoch 2
    before = _log(run)
    os.remove(run / "checkpoint.pth")
    capsys.readouterr()
    _train(colour_data, run, *flags)
    out = capsys.readouterr().out
    assert "checkpoint.pth is missing; resuming from the newest intact snapshot" in out
    assert f"resumed from {run / 'checkpoint0002.pth'} at epoch 2" in out
    log = _log(run)
    assert log[:2] == before and [r["epoch"] for r in log] == [1, 2, 3]
    wa = utils.load_file(tmp_path / "a" / "checkpoint.pth")["model"]
    wb = utils.load_file(run / "checkpoint.pth")["model"]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# ------------------------------------------------------------------------------------------------
# 8. user errors: one line naming the file or flag and what to do
# ------------------------------------------------------------------------------------------------

CASES = ["no cache.pt", "no split.json", "no --data", "--data is a file", "cut-off manifest.json",
         "--device cuda without CUDA"]


def _break(case, data, tmp_path, monkeypatch):
    """Damage a copy of a prepared folder as `case` says; (the --data to pass, what the message
    must name, what it must advise)."""
    if case == "no cache.pt":
        os.remove(data / "cache.pt")
        return data, str(data / "cache.pt"), "prepare_data.py"
    if case == "no split.json":
        os.remove(data / "split.json")
        return data, str(data / "split.json"), "prepare_data.py"
    if case == "no --data":
        return tmp_path / "nowhere", f"--data {tmp_path / 'nowhere'}", "prepare_data.py"
    if case == "--data is a file":
        return data / "manifest.json", f"--data {data / 'manifest.json'}", "prepare_data.py"
    if case == "cut-off manifest.json":
        text = (data / "manifest.json").read_text()
        (data / "manifest.json").write_text(text[:len(text) // 2])
        return data, str(data / "manifest.json"), "prepare_data.py"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return data, "--device cuda", "--device cpu"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("script", ["train_otl", "eval_knn", "eval_linear"])
def test_user_errors_are_one_line(colour_data, tmp_path, monkeypatch, case, script):
    data = tmp_path / "data"
    shutil.copytree(colour_data, data)
    ckpt = None
    if script != "train_otl":                   # a checkpoint of the intact data, made first
        from evalkit import untrained_checkpoint
        ckpt = untrained_checkpoint(tmp_path / "ck")[0]
    given, names, advice = _break(case, data, tmp_path, monkeypatch)
    device = "cuda" if "cuda" in case else "cpu"
    if script == "train_otl":
        argv = ["--data", str(given), "--output", str(tmp_path / "run"),
                *TINY[:TINY.index("--device")], "--device", device, "--epochs", "1"]
        run = train_otl.main
        parser = train_otl.get_args_parser
    else:
        module = eval_knn if script == "eval_knn" else eval_linear
        argv = ["--checkpoint", ckpt, "--data", str(given), "--device", device, "--no-progress"]
        run, parser = module.main, module.get_args_parser
    with pytest.raises(SystemExit) as e:
        run(parser().parse_args(argv))
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg, msg
    assert names in msg and advice in msg, msg
    assert not (tmp_path / "run").exists()      # a typo in --data makes no run folder


def test_user_errors_print_no_traceback(colour_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(colour_data, data)
    (data / "manifest.json").write_text('{"key": {"dataset": "fol')
    p = subprocess.run([sys.executable, "train_otl.py", "--data", str(data), "--output",
                        str(tmp_path / "run"), "--device", "cpu"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and str(data / "manifest.json") in p.stderr
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "eval_knn.py", "--checkpoint", str(tmp_path / "x.pth"),
                        "--device", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "--device cuda" in p.stderr


# ------------------------------------------------------------------------------------------------
# 9. empty class folders, a lone class, huge images
# ------------------------------------------------------------------------------------------------

def test_an_empty_class_folder_is_named(tmp_path, capsys):
    src = _colour_folder(tmp_path / "src", n=3)
    os.makedirs(src / "yellow")
    (src / "grey").mkdir()
    (src / "grey" / "notes.txt").write_text("no images here")
    man = prep(src, tmp_path / "out")
    err = capsys.readouterr().err
    assert f"{src}/yellow holds no image" in err and f"{src}/grey holds no image" in err
    assert man["empty_class_folders"] == ["grey", "yellow"] and man["classes"] == sorted(COLOURS)


def test_a_single_class_tree_is_named_and_not_evaluated(tmp_path, capsys):
    src = _colour_folder(tmp_path / "src", {"red": COLOURS["red"]}, n=8)
    man = prep(src, tmp_path / "data")
    assert "holds one class (red)" in capsys.readouterr().err
    assert any("one class" in w for w in man["warnings"])
    _train(tmp_path / "data", tmp_path / "run", "--epochs", "1")       # training works
    for module in (eval_knn, eval_linear):
        with pytest.raises(SystemExit, match="holds one class \\(red\\)"):
            _eval(module, tmp_path / "run" / "checkpoint.pth")


def _blank_png(path, side):
    """A real side x side 8-bit grey PNG, all black, written row by row (it compresses to a few
    hundred KB; decoded it would be side^2 bytes, and side^2 * 3 as RGB)."""
    z, rows = zlib.compressobj(1), []
    row = bytes(side + 1)                                 # filter byte + a row of zeros
    for _ in range(side):
        rows.append(z.compress(row))
    idat = b"".join(rows) + z.flush()

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    with open(path, "wb") as fh:
        header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)      # 8-bit grey
        fh.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
                 + chunk(b"IEND", b""))


def test_an_image_above_the_pixel_limit_is_refused_before_decoding(tmp_path):
    src = _colour_folder(tmp_path / "src", n=3)
    _blank_png(src / "red" / "huge.png", 12000)
    with pytest.raises(SystemExit, match="red/huge.png .*12000 x 12000 = 144,000,000 pixels, more "
                                         "than --max-pixels"):
        prep(src, tmp_path / "out", "--size", "16")
    man = prep(src, tmp_path / "out", "--size", "16", "--skip-bad")
    assert man["n_images"] == 9 and [s["file"] for s in man["skipped"]] == ["red/huge.png"]
    # the limit is a flag: a small one refuses the 16 x 16 images too
    with pytest.raises(SystemExit, match="16 x 16 = 256 pixels, more than --max-pixels 100"):
        prep(src, tmp_path / "out2", "--size", "16", "--max-pixels", "100")


# ------------------------------------------------------------------------------------------------
# 10. the second pass: concurrent and stale files
# ------------------------------------------------------------------------------------------------

def test_a_second_prepare_on_a_folder_in_use_is_refused(tmp_path):
    src, out = _colour_folder(tmp_path / "src", n=4), tmp_path / "data"
    first = prep(src, out)
    cache = (out / "cache.pt").read_bytes()
    release = utils.lock_run_folder(str(out), "--out", "prepare_data.py run")   # as a run would
    try:
        with pytest.raises(SystemExit) as e:
            prep(src, out, "--seed", "2", "--per-class", "3")
        msg = str(e.value.code)
        assert f"--out {out} is in use by another prepare_data.py run (process {os.getpid()}" in msg
        assert "\n" not in msg
    finally:
        release()
    assert (out / "cache.pt").read_bytes() == cache         # the folder is as the first run left it
    assert prep(src, out) == first and not (out / ".lock").exists()


def test_resuming_on_data_prepared_with_another_split_is_refused(tmp_path):
    src, data, run = _colour_folder(tmp_path / "src"), tmp_path / "data", tmp_path / "run"
    prep(src, data)
    _train(data, run, "--epochs", "1")
    prep(src, data, "--seed", "1")                          # the same images, another split
    with pytest.raises(SystemExit) as e:
        _train(data, run, "--epochs", "2")
    msg = str(e.value.code)
    assert f"{run / 'checkpoint.pth'} was trained on other data than {data} holds now" in msg
    assert "then 24 images of 16 px in 3 classes, split seed 0" in msg
    assert "now 24 images of 16 px in 3 classes, split seed 1" in msg and "\n" not in msg
    assert utils.load_file(run / "checkpoint.pth")["epoch"] == 1       # nothing was trained
    prep(src, data, "--seed", "0")                          # prepared as it was: it goes on
    assert _train(data, run, "--epochs", "2")["epochs"] == 2


def test_features_are_keyed_on_the_checkpoint_they_were_extracted_from(colour_data, tmp_path,
                                                                         monkeypatch):
    """An evaluation that loads checkpoint.pth while a training replaces it: the features of the
    file it loaded must not be cached under the newer file's hash."""
    import otl
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "2", "--snapshot-every", "1")
    ckpt = run / "checkpoint.pth"
    shutil.copy(run / "checkpoint0001.pth", ckpt)           # the training is at epoch 1 ...
    build = otl.build_model

    def build_then_replace(cfg):                            # ... and writes epoch 2 meanwhile
        shutil.copy(run / "checkpoint0002.pth", ckpt)
        return build(cfg)
    monkeypatch.setattr(otl, "build_model", build_then_replace)
    first = _eval(eval_knn, ckpt, "--ks", "3")
    monkeypatch.setattr(otl, "build_model", build)
    assert first["epoch"] == 1                              # what it loaded, and says so
    assert first["checkpoint_sha256"] == utils.sha256_file(run / "checkpoint0001.pth")
    again = _eval(eval_knn, ckpt, "--ks", "3")              # the file now holds epoch 2
    assert again["epoch"] == 2
    assert again["checkpoint_sha256"] == utils.sha256_file(run / "checkpoint0002.pth")


def _dead_pid():
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    return int(p.stdout)


def test_temporaries_of_killed_writers_are_removed(colour_data, tmp_path):
    """kill -9 mid-write leaves <file>.tmp<pid>: the next write of that file (or the next prepare
    of that folder) removes it; a live writer's temporary stays."""
    src, out = _colour_folder(tmp_path / "src", n=4), tmp_path / "data"
    prep(src, out)
    dead, alive = f".tmp{_dead_pid()}", f".tmp{os.getppid()}"
    for f in ("cache.pt", "split.json", "manifest.json"):
        (out / (f + dead)).write_bytes(b"cut short")
    (out / ("cache.pt" + alive)).write_bytes(b"still being written")
    prep(src, out)                                         # up to date: nothing rewritten, yet
    assert sorted(os.listdir(out)) == ["cache.pt", "cache.pt" + alive, "manifest.json",
                                       "split.json"]
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "1")
    (run / ("features_checkpoint.pt" + dead)).write_bytes(b"cut short")
    _eval(eval_knn, run / "checkpoint.pth", "--ks", "3")
    assert not [f for f in os.listdir(run) if ".tmp" in f]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_prepare_ends_its_decode_workers(eurosat_zip, tmp_path):
    p = subprocess.Popen([sys.executable, "prepare_data.py", "--source", eurosat_zip, "--out",
                          str(tmp_path / "data"), "--workers", "2", "--per-class", "1000"],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children():
        try:
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as fh:
                return [int(c) for c in fh.read().split()]
        except OSError:
            return []
    try:
        for _ in range(600):                                # the pool starts after the listing
            if len(children()) >= 2 or p.poll() is not None:
                break
            time.sleep(0.1)
        workers = children()
        assert len(workers) >= 2 and p.poll() is None, "the decode pool never started"
    finally:
        p.kill()                                            # kill -9
        p.wait(timeout=30)
    for _ in range(100):
        if not any(os.path.exists(f"/proc/{w}") and _alive(w) for w in workers):
            break
        time.sleep(0.1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and _alive(w)]


def _alive(pid):
    """Running, not a zombie waiting for its (dead) parent to be reaped by init."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# 11. the second pass: numbers that must not be silent
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script,argv,flag", [
    ("eval_knn", ["--temperature", "nan"], "--temperature"),
    ("eval_knn", ["--temperature", "inf"], "--temperature"),
    ("eval_knn", ["--batch-size", "0"], "--batch-size"),
    ("eval_linear", ["--wd-grid", "1e-3", "nan"], "--wd-grid"),
    ("eval_linear", ["--max-iter", "0"], "--max-iter"),
    ("train_otl", ["--lr", "nan"], "--lr"),
    ("train_otl", ["--wd", "nan"], "--wd")])
def test_nan_and_out_of_range_flags_are_refused_before_any_work(script, argv, flag, capsys):
    module = {"eval_knn": eval_knn, "eval_linear": eval_linear, "train_otl": train_otl}[script]
    base = (["--data", "d", "--output", "o"] if script == "train_otl" else ["--checkpoint", "c"])
    with pytest.raises(SystemExit) as e:
        module.get_args_parser().parse_args(base + argv)
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--lr", "-0.1"], "--lr must be >= 0, got -0.1"),
    (["--k", "1"], "--k must be at least 2, got 1"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1)")])
def test_training_flags_out_of_range_are_one_line(colour_data, tmp_path, argv, says):
    with pytest.raises(SystemExit) as e:
        _train(colour_data, tmp_path / "run", "--epochs", "1", *argv)
    assert says in str(e.value.code) and "\n" not in str(e.value.code)
    assert not (tmp_path / "run").exists()


def _float_tiff(path, a):
    from PIL import Image
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(a.astype("float32"), mode="F").save(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_pixel_does_not_blacken_a_float_image(tmp_path, bad):
    import numpy as np
    ramp = np.tile(np.linspace(0, 1000, 16, dtype="float32"), (16, 1))
    holed = ramp.copy()
    holed[3, 5] = bad
    for c in ("a", "b"):
        for i in range(2):
            _float_tiff(str(tmp_path / "src" / c / f"{i}.tif"), holed if i == 0 else ramp)
    prep(tmp_path / "src", tmp_path / "data")
    d = utils.load_prepared(str(tmp_path / "data"))
    files = list(d["files"])
    img, ref = d["images"][files.index("a/0.tif")], d["images"][files.index("a/1.tif")]
    assert img.max() == 255 and img.min() == 0              # scaled over its finite range
    keep = torch.ones(16, 16, dtype=torch.bool)
    keep[3, 5] = False
    assert torch.equal(img[:, keep], ref[:, keep])          # every finite pixel as without the hole
    assert int(img[0, 3, 5]) == (255 if bad == float("inf") else 0)


# ------------------------------------------------------------------------------------------------
# 12. the second pass: archives that are hostile or broken
# ------------------------------------------------------------------------------------------------

def _zip(path, members):
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _png_bytes(rgb, size=16):
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def _colour_members(n=3):
    return {f"set/{c}/{i}.png": _png_bytes(tuple(v + i for v in rgb))
            for c, rgb in COLOURS.items() for i in range(n)}


def test_a_zip_bomb_is_refused_from_its_listed_size(tmp_path, monkeypatch):
    import zipfile
    members = _colour_members()
    members["set/red/bomb.png"] = bytes(3 << 20)           # 3 MiB of zeros: a few KB zipped
    src = _zip(tmp_path / "bomb.zip", members)
    assert os.path.getsize(src) < 100_000
    read = zipfile.ZipFile.read

    def watched(self, name, *a, **k):
        assert not name.endswith("bomb.png"), "the bomb was inflated"
        return read(self, name, *a, **k)
    monkeypatch.setattr(zipfile.ZipFile, "read", watched)
    with pytest.raises(SystemExit, match=r"set/red/bomb.png .*3,145,728 bytes, more than an "
                                         r"image of --max-pixels 1,000 pixels takes"):
        prep(src, tmp_path / "data", "--max-pixels", "1000")
    man = prep(src, tmp_path / "data", "--max-pixels", "1000", "--skip-bad")
    assert man["n_images"] == 9 and man["skipped"][0]["file"] == "set/red/bomb.png"


@pytest.mark.parametrize("evil", ["../escape/x.png", "set/../../x.png", "/abs/red/x.png"])
def test_a_zip_whose_entries_leave_it_is_refused(tmp_path, evil):
    members = _colour_members()
    members[evil] = _png_bytes((1, 2, 3))
    src = _zip(tmp_path / "evil.zip", members)
    with pytest.raises(SystemExit) as e:
        prep(src, tmp_path / "data")
    msg = str(e.value.code)
    assert f"whose path leaves the archive (first: {evil!r}" in msg and "\n" not in msg
    assert not (tmp_path / "data").exists()


def test_a_first_member_that_fails_its_crc_is_a_bad_image(tmp_path):
    members = _colour_members()
    src = tmp_path / "crc.zip"
    import zipfile
    with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as z:   # stored: the bytes are the image's
        for name, data in members.items():
            z.writestr(name, data)
    raw = bytearray(src.read_bytes())
    first = sorted(members)[0]
    at = raw.index(members[first]) + 40                     # inside the first image's data
    raw[at] ^= 0xFF
    src.write_bytes(bytes(raw))
    with pytest.raises(SystemExit) as e:
        prep(src, tmp_path / "data")
    assert f"cannot read {first}" in str(e.value.code) and "CRC" in str(e.value.code)
    man = prep(src, tmp_path / "data", "--skip-bad")
    assert man["n_images"] == 8 and man["skipped"][0]["file"] == first


def test_a_truncated_zip_is_called_cut_short(eurosat_zip, tmp_path):
    cut = tmp_path / "EuroSAT.zip"
    with open(eurosat_zip, "rb") as fh:
        cut.write_bytes(fh.read(200_000))
    with pytest.raises(SystemExit) as e:
        prep(cut, tmp_path / "data")
    msg = str(e.value.code)
    assert "starts as a zip archive but cannot be read as one: it is cut short" in msg
    assert "neither a folder nor a zip" not in msg


def test_force_on_a_full_disk_says_the_folder_is_incomplete(tmp_path, monkeypatch):
    src, out = _colour_folder(tmp_path / "src", n=4), tmp_path / "data"
    prep(src, out)
    monkeypatch.setattr(torch, "save", _fill_the_disk())
    with pytest.raises(SystemExit) as e:
        prep(src, out, "--force")
    msg = str(e.value.code)
    assert f"cannot write {out / 'cache.pt'}: the disk is full" in msg
    assert f"{out} is incomplete" in msg and "intact" not in msg and "\n" not in msg
    assert not (out / "manifest.json").exists()             # as the message says


# ------------------------------------------------------------------------------------------------
# 13. the second pass: user mistakes that were tracebacks
# ------------------------------------------------------------------------------------------------

def _one_line(e, *parts):
    msg = str(e.value.code)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


def test_an_output_under_a_file_or_in_a_read_only_folder_is_one_line(colour_data, tmp_path,
                                                                      monkeypatch, capsys):
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "1")
    ckpt = run / "checkpoint.pth"
    (tmp_path / "afile").write_text("x")
    under = tmp_path / "afile" / "knn.json"
    with pytest.raises(SystemExit) as e:
        _eval(eval_knn, ckpt, "--output", str(under))
    _one_line(e, f"cannot write {tmp_path / 'afile'}", "a part of its path is a file")
    with pytest.raises(SystemExit) as e:
        _train(colour_data, tmp_path / "afile" / "run", "--epochs", "1")
    _one_line(e, "--output", "a part of its path is a file")
    # a run folder that cannot be written (root ignores modes: the refusal is simulated)
    os.remove(run / "features_checkpoint.pt")               # (the first evaluation cached them)
    real_open = open

    def read_only(path, mode="r", *a, **k):
        if "w" in mode and str(path).startswith(str(run)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(utils, "open", read_only, raising=False)
    with pytest.raises(SystemExit) as e:
        _eval(eval_knn, ckpt, "--ks", "3")
    _one_line(e, f"cannot write {run}", "permission denied")
    # with --output elsewhere the evaluation runs: only its feature cache is not written
    capsys.readouterr()
    res = _eval(eval_knn, ckpt, "--ks", "3", "--output", str(tmp_path / "knn.json"))
    assert 0 <= res["knn_top1"]["3"] <= 100 and (tmp_path / "knn.json").is_file()
    assert "the features are not cached" in capsys.readouterr().out
    assert not (run / "features_checkpoint.pt").exists()


@pytest.mark.parametrize("device", ["mps", "xla", "meta"])
def test_devices_other_than_cpu_and_cuda_are_one_line(device):
    with pytest.raises(SystemExit) as e:
        utils.pick_device(device)
    _one_line(e, f"--device {device}", "use auto, cpu, cuda")


def test_files_that_are_not_training_checkpoints_are_one_line(colour_data, tmp_path):
    import dataclasses
    import otl
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "1")
    good = utils.load_file(run / "checkpoint.pth")
    other = tmp_path / "other.pth"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(SystemExit) as e:
        _eval(eval_knn, other)
    _one_line(e, str(other), "not a checkpoint of train_otl.py")
    wrong = tmp_path / "wrong.pth"
    torch.save({**good, "model_cfg": dataclasses.asdict(otl.ModelConfig(k=4, width=16))}, wrong)
    with pytest.raises(SystemExit) as e:
        _eval(eval_linear, wrong)
    _one_line(e, str(wrong), "weights do not fit the model its config describes")
    for bad in (other, wrong):                              # as --init
        with pytest.raises(SystemExit) as e:
            _train(colour_data, tmp_path / f"init_{bad.stem}", "--epochs", "1", "--init", str(bad))
        _one_line(e, f"--init {bad}")


def test_resume_or_init_from_a_crafted_or_damaged_file_is_one_line(colour_data, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))
    run = tmp_path / "run"
    _train(colour_data, run, "--epochs", "1")
    crafted = tmp_path / "crafted.pth"
    torch.save({**utils.load_file(run / "checkpoint.pth"), "args": Payload()}, crafted)
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes((run / "checkpoint.pth").read_bytes()[:5000])
    for bad, says in ((crafted, "refusing to load"), (damaged, "damaged or incomplete")):
        with pytest.raises(SystemExit) as e:
            _train(colour_data, tmp_path / f"init_{bad.stem}", "--epochs", "1", "--init", str(bad))
        _one_line(e, f"--init {bad}", says)
    shutil.copy(crafted, run / "checkpoint.pth")            # resume: a crafted checkpoint.pth
    with pytest.raises(SystemExit) as e:
        _train(colour_data, run, "--epochs", "2")
    _one_line(e, str(run / "checkpoint.pth"), "refusing to load")
    torch.save({"epoch": 1}, run / "checkpoint.pth")        # resume: not a training checkpoint
    with pytest.raises(SystemExit) as e:
        _train(colour_data, run, "--epochs", "2")
    _one_line(e, str(run / "checkpoint.pth"), "not a checkpoint of train_otl.py")
    assert not (tmp_path / "ran").exists()
