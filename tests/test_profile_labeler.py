"""bench/profile_labeler.py: --phases (the exact labeler's stages, timed, beside the published rules)
on an input saved by bench_labeler.py --save-inputs, --kernels (the torch operations a call
launches, per stage), and its argument checks."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if os.path.join(ROOT, "bench") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "bench"))

import otl_scale  # noqa: E402
import profile_labeler  # noqa: E402


def run(script, *args):
    return subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def far_outputs(n, k, seed):
    """Crowded outputs (positive features through a random head), far from balance at the
    column medians: translate takes its warm start on them (k <= 128, N >= 4 x 4096)."""
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(n, 32, generator=g).relu() + 0.5 * torch.randn(1, 32, generator=g).relu()
    return (F @ (torch.randn(32, k, generator=g) / 8)).float()


def _labeler_functions():
    return (otl_scale._ExactSolver._approach, otl_scale._ExactSolver._auction, otl_scale._ExactSolver._finish,
            otl_scale._ExactSolver.strictify, otl_scale.StreamingTranslator._warm_start, otl_scale.sample_start_T,
            otl_scale._dense_translate, otl_scale._newton_T)


def test_stage_timer_records_each_solve_and_restores_the_labeler():
    O = far_outputs(20_000, 20, 0)
    originals = _labeler_functions()
    # the streaming path: the warm start's sample, then the main solve
    plain = otl_scale.translate(O, dense=False)
    with profile_labeler.stage_timer(torch.device("cpu")) as records:
        timed = otl_scale.translate(O, dense=False)
    assert torch.equal(timed.labels, plain.labels) and torch.equal(timed.T, plain.T)
    assert {solve[0] for solve, _, _, _, _ in records} == {"warm start", "main"}
    main = [r for r in records if r[0][0] == "main"]
    assert {stage for _, stage, _, _, _ in main} >= {"auction", "finish", "strict argmax"}
    assert all(sec >= 0 and steps >= 0 and counted == (0, 0, False)
               for _, _, sec, steps, counted in records)     # (no KernelCount open)
    # the main solve's steps add up to the call's iterations; the warm start took steps too
    assert sum(steps for _, _, _, steps, _ in main) == timed.iterations
    assert sum(steps for s, _, _, steps, _ in records if s[0] == "warm start") >= 1
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
        dense = otl_scale.translate(O)
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


def test_kernel_count_counts_launches_and_host_reads_not_views():
    a = torch.arange(6, dtype=torch.float32)
    with profile_labeler.KernelCount() as c:
        a.view(2, 3).t()[0]                 # views: nothing launched
    assert c.kernels == 0 and c.reads == 0
    with profile_labeler.KernelCount() as c:
        b = a + 1                           # one kernel
    assert (c.kernels, c.reads) == (1, 0) and c.by_op == {"add": 1}
    with profile_labeler.KernelCount() as c:
        float(b.sum())                      # a kernel, then a read of its result
        (b > 3).nonzero()                   # a comparison, then a read (the count of rows)
        b[b > 3]                            # a mask as an index: a read
    assert c.reads == 3 and c.kernels >= 6
    assert c.by_op["_local_scalar_dense"] == 1 and c.by_op["nonzero"] == 1


def test_stage_timer_counts_kernels_per_stage_and_keeps_the_labels():
    """With a KernelCount open, each stage's record carries the kernels launched in it (none in
    a solve on numpy), together at most the call's; the dense path's small solve is marked
    as the host's on a GPU.  Counting changes no label."""
    O = far_outputs(20_000, 20, 0)
    plain = otl_scale.translate(O)
    with profile_labeler.KernelCount() as c, profile_labeler.stage_timer(torch.device("cpu"), c) as records:
        counted = otl_scale.translate(O)
    assert torch.equal(counted.labels, plain.labels)
    assert all(0 <= reads <= kern for _, _, _, _, (kern, reads, _) in records)
    assert all(r[4][0] >= 1 for r in records if r[1] == "newton")   # (a numpy solve: none)
    assert sum(r[4][0] for r in records) <= c.kernels
    solve = [r for r in records if r[1] != "newton"]
    assert solve and all(r[4][2] == (r[0][2] * 20 <= otl_scale._HOST_SOLVE) for r in solve)
    assert profile_labeler.host_kernels(records) == sum(r[4][0] for r in solve if r[4][2])
    lines = profile_labeler.kernels_report(records, c)
    assert lines[0].startswith("| solve | rows | newton: kernels (reads) [steps]")
    rest = lines[-1].split("|")[3].split()[0]
    assert int(rest.replace(",", "")) == c.kernels - sum(r[4][0] for r in records)


def test_kernels_as_gpu_json(tmp_path):
    """--kernels --as-gpu --json: the counts of one call of ours (per stage) and of the
    published rules, readable by a program; the GPU's block sizes leave the labels alone."""
    O = far_outputs(12_000, 40, 5)
    saved = tmp_path / "far.pt"
    torch.save(O, saved)
    js, out = tmp_path / "k.json", tmp_path / "k.md"
    p = run("profile_labeler.py", "--input", str(saved), "--kernels", "--as-gpu", "--repeat", "1",
            "--json", str(js), "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    d = json.loads(js.read_text())
    assert d["as_gpu"] is True and (d["n"], d["k"]) == (12_000, 40) and d["otl"] == "working tree"
    ex = d["exact"]
    assert ex["kernels"] == sum(ex["by_op"].values()) and 0 < ex["reads"] < ex["kernels"]
    assert 0 < sum(s["kernels"] for s in ex["stages"]) <= ex["kernels"]
    assert 0 <= ex["host_on_gpu"] <= ex["kernels"]
    assert d["published"]["kernels"] == sum(d["published"]["by_op"].values()) > 0
    text = out.read_text()
    assert "with the GPU's block sizes (--as-gpu)" in text and "published rules:" in text


def test_kernels_refuses_an_otl_without_launch_bound_and_bad_flags(tmp_path):
    old = tmp_path / "otl_old.py"
    old.write_text(open(os.path.join(ROOT, "otl_scale.py")).read().replace("_launch_bound", "_lb_renamed"))
    good = tmp_path / "good.pt"
    torch.save(torch.randn(2000, 12), good)
    p = run("profile_labeler.py", "--input", str(good), "--kernels", "--as-gpu", "--otl", str(old))
    assert p.returncode != 0 and "has no _launch_bound" in p.stderr
    p = run("profile_labeler.py", "--input", str(good), "--kernels", "--otl", str(old), "--repeat", "1")
    assert p.returncode == 0 and "exact: " in p.stdout, p.stderr[-2000:]
    for args, says in ((["--json", "k.json"], "go with --kernels"), (["--as-gpu"], "go with --kernels"),
                       (["--kernels", "--phases"], "without --phases"),
                       (["--kernels", "--method", "published"], "without --phases")):
        p = run("profile_labeler.py", "--input", str(good), *args)
        assert p.returncode != 0 and says in p.stderr, (args, p.stderr[-500:])
