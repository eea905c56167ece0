"""The Makefile: its chains by dry runs (make -n: nothing is trained or prepared; the stages
themselves run end to end in test_pipeline.py), every target phony and listed by `make help`, no
Python in a recipe."""
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

# variables of the Makefile (and of a parent make) that the environment could set
_CLEAR = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PY", "RUNS", "DATA", "OUT", "DEVICE",
          "PRESET", "TRAIN_ARGS", "PREP_ARGS", "INIT", "TRANSFER_PRESET", "RUN_NAME", "SRC",
          "EUROSAT_SRC", "FEATURE", "REPORT", "GPU")


def make(*args, cwd=ROOT, dry=True, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    out = subprocess.run(["make", "--no-print-directory", *(["-n"] if dry else []), *args],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return out.stdout


def dry_run(*args):
    """The commands `make -n ARGS` prints (a recipe line continued with a backslash joined), each
    split as the shell would."""
    return [shlex.split(line) for line in make(*args).replace("\\\n", " ").splitlines()
            if line.strip()]


def stage(cmds, script, **flags):
    """The commands that run `script` with the given flag values (--data: data=...)."""
    return [c for c in cmds if len(c) > 1 and c[1] == script
            and all(flag(c, "--" + k.replace("_", "-")) == v for k, v in flags.items())]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_siri_whu_trains_by_the_transfer_protocol():
    cmds = dry_run("siri_whu", "SRC=x", "DEVICE=cpu")
    prep = stage(cmds, "prepare_data.py", dataset="siri_whu")
    assert prep and flag(prep[0], "--source") == "x" and flag(prep[0], "--out") == "data/siri_whu"
    t = stage(cmds, "train_otl.py", data="data/siri_whu")
    assert [flag(c, "--init") for c in t] == ["runs/eurosat/checkpoint.pth", None,
                                              "runs/eurosat/checkpoint.pth"]
    assert ["--supervised" in c for c in t] == [False, False, True]
    # auto: the data set's protocol, the transfer presets for the small sets (tests/test_presets.py)
    assert all(flag(c, "--preset") == "auto" and flag(c, "--device") == "cpu" for c in t)
    assert [flag(c, "--output") for c in t] == [
        "runs/siri_whu_from_eurosat", "runs/siri_whu_scratch", "runs/siri_whu_supervised_from_eurosat"]
    evals = [c for c in stage(cmds, "eval_knn.py") + stage(cmds, "eval_linear.py")
             if flag(c, "--checkpoint").startswith("runs/siri_whu_")]
    assert len(evals) == 12
    rep = stage(cmds, "report.py", dataset="siri_whu")
    assert len(rep) == 1 and flag(rep[0], "--name") == "siri_whu_transfer"
    assert rep[0][rep[0].index("--rows") + 1:] == [
        "OTL from EuroSAT OTL=siri_whu_from_eurosat", "OTL from random init=siri_whu_scratch",
        "supervised from EuroSAT OTL=siri_whu_supervised_from_eurosat"]
    assert cmds.index(prep[0]) < cmds.index(t[0]) and cmds.index(t[2]) < cmds.index(rep[0])


def test_a_transfer_set_takes_another_backbone_and_preset():
    t = stage(dry_run("ucmerced", "SRC=x", "INIT=other.pth", "TRANSFER_PRESET=transfer"),
              "train_otl.py", data="data/ucmerced")
    assert [flag(c, "--init") for c in t] == ["other.pth", None, "other.pth"]
    assert all(flag(c, "--preset") == "transfer" for c in t)


def test_hmhr_without_its_duplicates_in_folders_of_its_own():
    cmds = dry_run("hmhr", "DEVICE=cpu", "PREP_ARGS=--drop-duplicates", "RUN_NAME=hmhr_dedup",
                   "REPORT=hmhr_transfer_dedup", "INIT=b.pth")
    prep = stage(cmds, "prepare_data.py", dataset="hmhr")
    assert "--drop-duplicates" in prep[0] and flag(prep[0], "--out") == "data/hmhr_dedup"
    assert flag(prep[0], "--source") == "../shared/data/HMHR.zip"
    t = stage(cmds, "train_otl.py", data="data/hmhr_dedup")
    assert [flag(c, "--output") for c in t] == [
        "runs/hmhr_dedup_from_eurosat", "runs/hmhr_dedup_scratch",
        "runs/hmhr_dedup_supervised_from_eurosat"]
    rep = stage(cmds, "report.py", dataset="hmhr")
    assert flag(rep[0], "--name") == "hmhr_transfer_dedup"


def test_a_missing_backbone_is_trained_first_without_the_sets_own_variables():
    out = make("hmhr", "RUN_NAME=hmhr_dedup", "PREP_ARGS=--drop-duplicates", "RUNS=/nonexistent")
    assert "eurosat RUN_NAME= PREP_ARGS=" in out


def test_aid_trains_from_scratch_and_writes_the_overview():
    cmds = dry_run("aid", "SRC=x")
    t = stage(cmds, "train_otl.py", data="data/aid")
    assert len(t) == 1 and "--init" not in t[0] and "--supervised" not in t[0]
    assert flag(t[0], "--preset") == "auto" and flag(t[0], "--output") == "runs/aid"
    assert any(len(c) > 1 and c[1] == "report.py" and "--overview" in c for c in cmds)


def test_each_gpu_table_is_one_command():
    cmds = dry_run("eurosat-gpu")
    t = stage(cmds, "train_otl.py", data="data/eurosat")
    assert [flag(c, "--output") for c in t] == ["runs/eurosat_fast", "runs/eurosat_fast_supervised"]
    assert all(flag(c, "--preset") == "fast" and flag(c, "--device") == "cuda" for c in t)
    assert stage(cmds, "report.py", name="eurosat_fast", otl_run="eurosat_fast")
    t = stage(dry_run("hmhr-gpu"), "train_otl.py", data="data/hmhr_gpu")
    assert [flag(c, "--init") for c in t] == ["runs/eurosat_fast/checkpoint.pth", None,
                                              "runs/eurosat_fast/checkpoint.pth"]
    assert all(flag(c, "--preset") == "transfer" and flag(c, "--device") == "cuda" for c in t)
    t = stage(dry_run("cifar10-gpu"), "train_otl.py", data="data/cifar10")
    assert len(t) == 1 and flag(t[0], "--preset") == "cifar-fast"
    assert flag(t[0], "--output") == "runs/cifar10_fast"


def test_peers_transfer_chains_the_cpu_schedule_first():
    cmds = [c for c in dry_run("peers-transfer", "DEVICE=cpu") if len(c) > 2 and c[1] == "ablations.py"]
    assert [c[2] for c in cmds] == ["peers", "peers-transfer"]
    assert all(flag(c, "--preset") == "cpu" and flag(c, "--device") == "cpu" for c in cmds)


def _targets():
    """Every target of the Makefile, from make's own database."""
    db = subprocess.run(["make", "-pnq", "-f", str(ROOT / "Makefile")], cwd=ROOT,
                        capture_output=True, text=True, timeout=120).stdout
    phony = next(line for line in db.splitlines() if line.startswith(".PHONY:")).split()[1:]
    rules = {m.group(1) for m in re.finditer(r"^([a-zA-Z0-9_-]+):(?!=)", db, re.M)}
    return set(phony), rules - {"Makefile"}


def test_every_target_is_phony_and_in_the_help():
    phony, rules = _targets()
    real_files = {".venv/.installed"}
    assert rules - real_files <= phony, sorted(rules - phony)
    shown = make("help", dry=False)
    for target in phony:
        assert re.search(rf"(^|\s){re.escape(target)}(\s|$)", shown), target


def test_a_file_named_like_a_study_does_not_stop_it(tmp_path):
    for f in ("Makefile", "requirements.txt"):
        shutil.copy(ROOT / f, tmp_path / f)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text("")
    (tmp_path / "ablation-k").write_text("")
    (tmp_path / "eurosat").write_text("")
    assert "ablations.py k " in make("ablation-k", cwd=tmp_path)
    assert "train_otl.py" in make("eurosat", cwd=tmp_path)


def test_no_python_in_a_recipe():
    text = (ROOT / "Makefile").read_text()
    assert "python -c" not in text and "$(PY) -c" not in text and "$(shell" not in text


def _words(text, var):
    """A variable of the Makefile as its words, the $(VAR)s in it expanded."""
    value = re.search(rf"^{var}\s*\??=(.*)$", text, re.M).group(1).split()
    return [w for v in value for w in (_words(text, v[2:-1]) if v.startswith("$(") else [v])]


def test_every_study_has_a_target_that_runs_it():
    """ablations.STUDIES is the list of the studies: `make ablations` runs those in the Makefile's
    STUDIES (ablation-<study>), the others (peers, peers-transfer) have targets of their names,
    `make help` names each, and each runs `ablations.py <study>`."""
    import ablations
    text = (ROOT / "Makefile").read_text()
    listed = _words(text, "STUDIES")
    assert len(set(listed)) == len(listed) and set(listed) <= set(ablations.STUDIES)
    assert _words(text, "LABELER_STUDIES") == [n for n, s in ablations.STUDIES.items()
                                                if s.kind == "labeler"]
    every = [c[2] for c in dry_run("ablations", "DEVICE=cpu") if len(c) > 2 and c[1] == "ablations.py"]
    assert every == listed
    shown = make("help", dry=False)
    for name in ablations.STUDIES:
        target = f"ablation-{name}" if name in listed else name
        assert re.search(rf"(^|\s){re.escape(target)}(\s|$)", shown), target
        runs = [c[2] for c in dry_run(target, "DEVICE=cpu") if len(c) > 2 and c[1] == "ablations.py"]
        assert runs and runs[-1] == name, target
