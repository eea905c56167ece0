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


def transfer_tree(tmp_path, sets=("HMHR.zip", "siri_whu.zip"), backbone=True):
    """What the transfer stage reads: the archives the call carried (G) and the run folders (R)."""
    g, r = tmp_path / "g", tmp_path / "runs"
    g.mkdir(parents=True, exist_ok=True)
    for name in sets:
        (g / name).write_bytes(b"")
    if backbone:
        (r / "eurosat_fast").mkdir(parents=True)
        (r / "eurosat_fast" / "results.json").write_text("{}")     # the backbone's run is done
    return dict(D="300", G=str(g), R=str(r), DATA=str(tmp_path / "data")), g, r


def test_transfer_stage_runs_each_sets_three_runs_from_the_backbone_and_reports_them(tmp_path):
    env, g, r = transfer_tree(tmp_path)
    out = dry("transfer", tmp_path, **env).stdout
    assert "--preset fast" not in out                   # the backbone is there: not trained again
    assert (f"prepare_data.py --dataset hmhr --source {g}/HMHR.zip --out {tmp_path}/data/hmhr_dedup "
            "--drop-duplicates") in out
    assert f"--out {tmp_path}/data/hmhr\n" in out and f"--out {tmp_path}/data/siri_whu\n" in out
    init = f"--init {r}/eurosat_fast/checkpoint.pth"
    for folder, ds, rep in (("hmhr", "hmhr", "hmhr_transfer"), ("hmhr_dedup", "hmhr", "hmhr_transfer_dedup"),
                            ("siri_whu", "siri_whu", "siri_whu_transfer")):
        logs = {run: (r / f"{folder}_{run}" / "train.log").read_text()
                for run in ("from_eurosat", "scratch", "supervised_from_eurosat")}
        assert init in logs["from_eurosat"] and "--supervised" not in logs["from_eurosat"]
        assert "--init" not in logs["scratch"] and "--supervised" not in logs["scratch"]
        assert init in logs["supervised_from_eurosat"] and "--supervised" in logs["supervised_from_eurosat"]
        for run, log in logs.items():
            assert (f"train_otl.py --data {tmp_path}/data/{folder} --output {r}/{folder}_{run} "
                    "--preset transfer --device cuda") in log
            for ck in ("checkpoint.pth", "checkpoint0000.pth"):      # its end and its start
                for ev in ("eval_knn.py", "eval_linear.py"):
                    assert f"{ev} --checkpoint {r}/{folder}_{run}/{ck} --device cuda" in log
        assert (f"report.py --dataset {ds} --runs {r} --out {r}/reports --name {rep}_gpu --rows "
                f"OTL from EuroSAT OTL={folder}_from_eurosat OTL from random init={folder}_scratch "
                f"supervised from EuroSAT OTL={folder}_supervised_from_eurosat") in out


def test_transfer_stage_skips_a_reported_set_and_trains_a_missing_backbone_first(tmp_path):
    env, g, r = transfer_tree(tmp_path, sets=("HMHR.zip",))
    (r / "reports").mkdir()
    for rep in ("hmhr_transfer_gpu", "hmhr_transfer_dedup_gpu"):
        (r / "reports" / f"{rep}.json").write_text("{}")
    out = dry("transfer", tmp_path, **env).stdout
    assert "prepare_data.py" not in out and "no transfer set left" in out
    # no backbone: EuroSAT is prepared and the fast preset trained for E_BACKBONE epochs; here
    # (PY=echo) none appears, and the stage says so and stops
    env2, _, r2 = transfer_tree(tmp_path / "b", sets=(), backbone=False)
    res = dry("transfer", tmp_path, **env2, E_BACKBONE="60")
    assert (f"train_otl.py --data data/eurosat --output {r2}/eurosat_fast --preset fast --epochs 60 "
            "--no-progress --max-minutes") in res.stdout
    assert res.returncode == 3 and f"the backbone at {r2}/eurosat_fast is not done" in res.stdout


def test_stash_stage_needs_the_first_piece(tmp_path):
    res = dry("stash", tmp_path, G=str(tmp_path / "empty"))
    assert res.returncode == 3 and "bench/pack_gpu.py makes it" in res.stdout


def test_cifar_stage_times_the_papers_protocol_once_trains_until_done_then_evaluates(tmp_path):
    r = tmp_path / "runs"
    env = dict(D="590", R=str(r), G=str(tmp_path / "g"), DATA=str(tmp_path / "data"))
    c = tmp_path / "data" / "cifar10"
    out = dry("cifar", tmp_path, **env).stdout
    assert f"prepare_data.py --dataset cifar10 --source {tmp_path}/g/cifar10_jpg.zip --out {c}" in out
    assert (f"train_otl.py --data {c} --output {r}/cifar10_alexnet_timing --preset alexnet-cifar "
            "--max-minutes 0.5") in out
    assert f"train_otl.py --data {c} --output {r}/cifar10_fast --preset cifar-fast --knn-monitor 20" in out
    assert "eval_knn.py" not in out and "is not done: run this stage again at once" in out
    # done (results.json), timed before, prepared: only the evaluations at start and end and the report
    (r / "cifar10_fast").mkdir(parents=True)
    (r / "cifar10_fast" / "results.json").write_text("{}")
    (r / "cifar10_alexnet_timing").mkdir()
    (r / "cifar10_alexnet_timing" / "log.jsonl").write_text("{}")
    c.mkdir(parents=True)
    (c / "manifest.json").write_text("{}")
    out = dry("cifar", tmp_path, **env, CIFAR_EPOCHS="40").stdout
    assert "train_otl.py" not in out and "prepare_data.py" not in out
    for ck in ("checkpoint.pth", "checkpoint0000.pth"):
        assert f"eval_knn.py --checkpoint {r}/cifar10_fast/{ck} --device cuda --no-progress --feature auto" in out
        assert f"eval_linear.py --checkpoint {r}/cifar10_fast/{ck} --device cuda --no-progress --feature conv5" in out
    assert (f"report.py --dataset cifar10 --runs {r} --out {r}/reports --otl-run cifar10_fast "
            "--name cifar10_fast_gpu --feature auto --linear-feature conv5") in out
    (r / "cifar10_fast" / "results.json").unlink()          # not done: resumed, with other epochs
    assert "--preset cifar-fast --epochs 40 --knn-monitor 20" in dry("cifar", tmp_path, **env,
                                                                     CIFAR_EPOCHS="40").stdout
