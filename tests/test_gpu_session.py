"""bench/gpu_session.sh, the GPU checks' script, dry: every Python command it would run is
echoed (PY=echo), so the stages' command lines are checked here without a GPU or the data."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dry(stage, tmp_path, **env):
    e = {**os.environ, "PY": "echo", "OUT": str(tmp_path / "out"), "ZIP": __file__, **env}
    return subprocess.run(["bash", "bench/gpu_session.sh", stage], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=60)


def test_supervised_stage_trains_the_twin_evaluates_it_and_profiles_the_labeler(tmp_path):
    out = dry("supervised", tmp_path, D="400").stdout
    twin = ("train_otl.py --data data/eurosat --output runs/gpu/eurosat_fast_supervised "
            "--supervised --preset fast --no-progress")
    assert twin in out
    for ev in ("eval_knn.py", "eval_linear.py"):
        assert f"{ev} --checkpoint runs/gpu/eurosat_fast_supervised/checkpoint.pth --device cuda" in out
    assert "--preset fast --epochs 10" in out
    assert "bench/profile_labeler.py --device cuda --data data/eurosat --checkpoint " \
           "runs/gpu/eurosat_fast10/checkpoint.pth --phases" in out
    assert "bench/bench_labeler.py --device cuda" in out and "--cpu-too" in out
    assert out.index(twin) < out.index("eval_knn.py") < out.index("profile_labeler.py")
    fewer = dry("supervised", tmp_path, D="400", E_SUP="50").stdout
    assert "--supervised --preset fast --epochs 50 --no-progress" in fewer
    # no time for the labeler's part (D = 80: the twin gets D - 60 s less what has passed, and
    # at D = 60 a second's tick made that -1 and timeout refused it)
    short = dry("supervised", tmp_path, D="80").stdout
    assert twin in short and "profile_labeler.py" not in short
    none = dry("supervised", tmp_path, D="50").stdout      # not even the twin: said, not attempted
    assert "no time left for the supervised twin" in none and twin not in none


def test_eval_stage_evaluates_the_fast_run_and_profiles_its_head_on_request(tmp_path):
    out = dry("eval", tmp_path).stdout
    for ev in ("eval_knn.py", "eval_linear.py"):
        assert f"{ev} --checkpoint runs/gpu/eurosat_fast/checkpoint.pth --device cuda" in out
    assert "profile_labeler.py" not in out and "train_otl.py" not in out
    assert "--checkpoint runs/gpu/eurosat_fast/checkpoint.pth --phases" in \
        dry("eval", tmp_path, PHASES="1").stdout


def test_unknown_stage_says_how_to_call_it(tmp_path):
    r = dry("nonsense", tmp_path)
    assert r.returncode == 2 and "usage: bash bench/gpu_session.sh bench" in r.stderr


def test_labeler_stage_runs_the_matrix_the_tests_and_counts_kernels(tmp_path):
    out = dry("labeler", tmp_path).stdout
    assert "bench/bench_labeler.py --device cuda --features .gpu/feat_eu_train --skip-large" in out
    assert "bench/compare_labelers.py .gpu/ab/otl_old.py otl_scale.py --device cuda" in out
    assert "-m pytest -q -p no:cacheprovider -k cuda" in out
    for name in ("tb_100", "tb_500", "trained_net_outputs"):     # on the GPU, with its seconds
        assert f"--kernels --repeat 3 --json {tmp_path}/out/labeler_kernels_gpu_{name}.json" in out
    assert out.index("bench_labeler.py") < out.index("-m pytest") < out.index("--kernels")
