"""The Makefile's data-set chains, by dry runs (make -n: nothing is trained or prepared).

ucmerced and siri_whu train by the paper's transfer protocol, as make hmhr does: OTL from the
EuroSAT run's backbone (INIT), OTL from random init, supervised from the same backbone, then
report.py --rows; the other sets keep their from-scratch chain."""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

# variables of the Makefile (and of a parent make) that the environment could set
_CLEAR = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PY", "RUNS", "DEVICE", "PRESET",
          "TRAIN_ARGS", "INIT", "TRANSFER_PRESET", "RUN_NAME", "SRC", "FEATURE", "EUROSAT_SRC",
          "HMHR_INIT", "HMHR_PRESET", "HMHR_PREP", "HMHR_DATA", "HMHR_REPORT")


def dry_run(*args):
    """The commands `make -n ARGS` prints, each split as the shell would."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    out = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines()
            if line.strip() and not line.rstrip().endswith("\\") and "print(" not in line]


def trains(cmds, data):
    """The train_otl.py commands on `data` (not those of a make eurosat the chain may start)."""
    return [c for c in cmds if len(c) > 1 and c[1] == "train_otl.py"
            and c[c.index("--data") + 1] == data]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_siri_whu_trains_by_the_transfer_protocol():
    cmds = dry_run("siri_whu", "SRC=x", "DEVICE=cpu")
    prep = [c for c in cmds if len(c) > 1 and c[1] == "prepare_data.py"
            and flag(c, "--dataset") == "siri_whu"]
    assert prep and flag(prep[0], "--source") == "x" and flag(prep[0], "--out") == "data/siri_whu"
    t = trains(cmds, "data/siri_whu")
    assert len(t) == 3, t
    assert [flag(c, "--init") for c in t] == ["runs/eurosat/checkpoint.pth", None,
                                              "runs/eurosat/checkpoint.pth"]
    assert ["--supervised" in c for c in t] == [False, False, True]
    assert all(flag(c, "--preset") == "transfer-cpu" and flag(c, "--device") == "cpu" for c in t)
    assert [flag(c, "--output") for c in t] == [
        "runs/siri_whu_from_eurosat", "runs/siri_whu_scratch", "runs/siri_whu_supervised_from_eurosat"]
    rep = [c for c in cmds if len(c) > 1 and c[1] == "report.py" and flag(c, "--dataset") == "siri_whu"]
    assert len(rep) == 1 and "--rows" in rep[0], rep
    assert flag(rep[0], "--name") == "siri_whu_transfer"
    assert rep[0][rep[0].index("--rows") + 1:] == [
        "OTL from EuroSAT OTL=siri_whu_from_eurosat", "OTL from random init=siri_whu_scratch",
        "supervised from EuroSAT OTL=siri_whu_supervised_from_eurosat"]
    # the prepare step comes first, the report last
    assert cmds.index(prep[0]) < cmds.index(t[0]) and cmds.index(t[2]) < cmds.index(rep[0])


def test_ucmerced_takes_another_backbone():
    t = trains(dry_run("ucmerced", "SRC=x", "INIT=other.pth"), "data/ucmerced")
    assert [flag(c, "--init") for c in t] == ["other.pth", None, "other.pth"]


def test_transfer_preset_follows_the_device():
    t = trains(dry_run("siri_whu", "SRC=x", "DEVICE=cuda"), "data/siri_whu")
    assert len(t) == 3 and all(flag(c, "--preset") == "transfer" for c in t)
    t = trains(dry_run("siri_whu", "SRC=x", "DEVICE=cpu", "TRANSFER_PRESET=transfer"), "data/siri_whu")
    assert all(flag(c, "--preset") == "transfer" for c in t)


def test_aid_still_trains_from_scratch():
    cmds = dry_run("aid", "SRC=x")
    t = trains(cmds, "data/aid")
    assert len(t) == 1 and "--init" not in t[0] and "--supervised" not in t[0]
    assert flag(t[0], "--preset") == "auto" and flag(t[0], "--output") == "runs/aid"
    assert any(len(c) > 1 and c[1] == "report.py" and "--overview" in c for c in cmds)


def test_hmhr_keeps_its_variables():
    cmds = dry_run("hmhr", "DEVICE=cpu", "HMHR_DATA=data/hmhr_dedup", "HMHR_PREP=--drop-duplicates",
                   "HMHR_INIT=b.pth", "HMHR_PRESET=transfer", "HMHR_REPORT=hmhr_transfer_dedup")
    prep = [c for c in cmds if len(c) > 1 and c[1] == "prepare_data.py" and flag(c, "--dataset") == "hmhr"]
    assert prep and "--drop-duplicates" in prep[0] and flag(prep[0], "--out") == "data/hmhr_dedup"
    t = trains(cmds, "data/hmhr_dedup")
    assert [flag(c, "--init") for c in t] == ["b.pth", None, "b.pth"]
    assert ["--supervised" in c for c in t] == [False, False, True]
    assert [flag(c, "--output") for c in t] == [
        "runs/hmhr_from_eurosat", "runs/hmhr_scratch", "runs/hmhr_supervised_from_eurosat"]
    assert all(flag(c, "--preset") == "transfer" for c in t)
    rep = [c for c in cmds if len(c) > 1 and c[1] == "report.py" and flag(c, "--dataset") == "hmhr"]
    assert len(rep) == 1 and "--rows" in rep[0] and flag(rep[0], "--name") == "hmhr_transfer_dedup"
