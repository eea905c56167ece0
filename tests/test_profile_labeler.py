"""profile_labeler.py: --phases (the exact labeler's stages, timed, beside the published rules)
on an input saved by bench_labeler.py --save-inputs, and its argument checks."""
import os
import subprocess
import sys

import pytest
import torch

import otl
import profile_labeler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(script, *args):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def far_outputs(n, k, seed):
    """Crowded outputs (positive features through a random head), far from balance at the
    column medians: translate takes its warm start on them (k <= 128, N >= 4 x 4096)."""
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(n, 32, generator=g).relu() + 0.5 * torch.randn(1, 32, generator=g).relu()
    return (F @ (torch.randn(32, k, generator=g) / 8)).float()


def _labeler_functions():
    return (otl._ExactSolver._approach, otl._ExactSolver._auction, otl._ExactSolver._finish,
            otl._ExactSolver.strictify, otl.StreamingTranslator._warm_start, otl.sample_start_T,
            otl._dense_translate, otl._newton_T)


def test_stage_timer_records_each_solve_and_restores_the_labeler():
    O = far_outputs(20_000, 20, 0)
    originals = _labeler_functions()
    # the streaming path: the warm start's sample, then the main solve
    plain = otl.translate(O, dense=False)
    with profile_labeler.stage_timer(torch.device("cpu")) as records:
        timed = otl.translate(O, dense=False)
    assert torch.equal(timed.labels, plain.labels) and torch.equal(timed.T, plain.T)
    assert {solve[0] for solve, _, _, _ in records} == {"warm start", "main"}
    main = [r for r in records if r[0][0] == "main"]
    assert {stage for _, stage, _, _ in main} >= {"auction", "finish", "strict argmax"}
    assert all(sec >= 0 and steps >= 0 for _, _, sec, steps in records)
    # the main solve's steps add up to the call's iterations; the warm start took steps too
    assert sum(steps for _, _, _, steps in main) == timed.iterations
    assert sum(steps for s, _, _, steps in records if s[0] == "warm start") >= 1
    assert _labeler_functions() == originals
    lines = profile_labeler.phases_report(records, total=10.0)
    assert lines[0].startswith("| solve | rows | newton s (steps) | approach s (steps)")
    assert any(x.startswith("| warm start | ") for x in lines)
    assert any(x.startswith("| main | ") for x in lines)
    rest = float(lines[-1].split("|")[3])
    assert 0 < rest < 10.0
    # the dense path (k <= 128): its Newton steps on the sample-free 20,000 rows (then perhaps
    # on the rows near a boundary only), then one solve
    with profile_labeler.stage_timer(torch.device("cpu")) as records:
        dense = otl.translate(O)
    assert dense.active < 20_000
    newton = [r for r in records if r[1] == "newton"]
    assert newton and newton[0][0] == ("dense", "newton", 20_000)
    assert all(r[0][0] == "dense" and r[0][2] <= 20_000 for r in newton)
    solved = {r[0] for r in records if r[1] != "newton"}
    assert solved == {("dense", next(iter(solved))[1], dense.active)}
    assert sum(r[3] for r in records) == dense.iterations      # passes + the solve's steps
    assert _labeler_functions() == originals
    lines = profile_labeler.phases_report(records, total=10.0)
    assert any(x.startswith("| dense | 20,000 | ") for x in lines)
    assert any(x.startswith(f"| dense | {dense.active:,} | ") for x in lines)


def test_phases_on_a_saved_bench_input(small_data, tmp_path):
    """bench_labeler --save-inputs keeps its network input; profile_labeler --input --phases
    reads it and prints the stages and the published rules' time on it."""
    saved = tmp_path / "inputs"
    p = run("bench_labeler.py", "--n", "300", "--ks", "10", "--real-ks", "10", "--data",
            str(small_data), "--real-split", "train", "--skip-large", "--methods", "exact",
            "--checkpoint", str(tmp_path / "none.pth"), "--save-inputs", str(saved),
            "--out", str(tmp_path / "lb.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    O = torch.load(saved / "random_net_10.pt", weights_only=True)
    assert O.dim() == 2 and O.shape[1] == 10 and O.dtype == torch.float32
    out = tmp_path / "phases.md"
    p = run("profile_labeler.py", "--input", str(saved / "random_net_10.pt"), "--phases",
            "--repeat", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    text = out.read_text()
    assert f"N {O.shape[0]}  k 10" in text and "max-min 0" in text
    assert "| main | " in text and "| rest of the call" in text
    assert "published / ours" in text


def test_profile_labeler_bad_input(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save(torch.zeros(5), bad)
    p = run("profile_labeler.py", "--input", str(bad), "--phases")
    assert p.returncode != 0 and "expected an (N, k) tensor" in p.stderr
    good = tmp_path / "good.pt"
    torch.save(torch.randn(200, 4), good)
    p = run("profile_labeler.py", "--input", str(good), "--phases", "--method", "published")
    assert p.returncode != 0 and "--phases is for the exact labeler" in p.stderr


def test_variants_of_a_saved_input(tmp_path):
    """--variants: ours and the published rules on subsets of the input's rows and on it with a
    little noise, one table row each, ours exactly balanced on each."""
    O = far_outputs(12_000, 20, 3)
    saved = tmp_path / "far.pt"
    torch.save(O, saved)
    out = tmp_path / "variants.md"
    again = tmp_path / "again.pt"
    p = run("profile_labeler.py", "--input", str(saved), "--variants", "--repeat", "1",
            "--out", str(out), "--save-input", str(again))
    assert p.returncode == 0, p.stderr[-2000:]
    assert torch.equal(torch.load(again, weights_only=True), O)      # --save-input: what it ran on
    rows = [r for r in out.read_text().splitlines() if r.startswith("| ") and "---" not in r][1:]
    sizes = {"first 80 %": 9_600, "last two thirds": 8_000, "all but 777": 11_223, "noise 1 %": 12_000}
    assert [r.split(" | ")[0][2:] for r in rows] == list(sizes)
    for r in rows:
        cells = r.strip("| ").split(" | ")
        assert int(cells[1].replace(",", "")) == sizes[cells[0]]
        assert cells[5].split(" / ")[0] in ("0", "1")          # ours: max - min
        assert cells[7] in ("dense", "streaming")
        assert float(cells[4][:-1]) == pytest.approx(float(cells[3]) / float(cells[2]), rel=0.02)


def test_input_variants_are_subsets_and_noise():
    O = torch.arange(50_000 * 3, dtype=torch.float32).view(50_000, 3)
    v = profile_labeler.input_variants(O)
    assert torch.equal(v["every 2nd row"], O[1::2])
    assert torch.equal(v["first 80 %"], O[:40_000]) and torch.equal(v["last two thirds"], O[16_666:])
    assert v["noise 1 %"].shape == O.shape and not torch.equal(v["noise 1 %"], O)
    assert torch.equal(profile_labeler.input_variants(O)["noise 1 %"], v["noise 1 %"])   # seeded
