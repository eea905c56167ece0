"""ablations.py: each study on a tiny setting, end to end, and its results JSON."""
import json

import pytest

import ablations
import train_otl


def run(*argv):
    return ablations.main(ablations.get_args_parser().parse_args(list(argv)))


def test_label_bn_study(small_data, tmp_path):
    out = run("label-bn", "--data", str(small_data), "--output", str(tmp_path / "bn"), "--k", "16",
              "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    saved = json.loads((tmp_path / "bn" / "label_bn.json").read_text())
    assert saved["results"] == json.loads(json.dumps(out["results"]))
    assert (saved["n"], saved["k"], saved["width"], saved["img_size"]) == (160, 16, 8, 16)
    for bn in ("eval", "batch"):
        r = saved["results"][bn]
        assert 1 <= r["clusters_used_before"] <= 16
        # the labelers never end worse than where argmax alone left the counts
        assert r["std_published"] <= r["std_before"] + 1e-9 and r["std_ours"] <= r["std_before"] + 1e-9
        assert r["std_max"] == pytest.approx(160 / 16 * 15 ** 0.5)
    assert saved["command"] and saved["git_commit"]


def test_label_bn_measures_a_trained_network(small_data, tmp_path):
    """With a train_otl.py run in --output, its checkpoint is the network measured."""
    run_dir = tmp_path / "run"
    train_otl.main(train_otl.get_args_parser().parse_args(
        ["--data", str(small_data), "--output", str(run_dir), "--width", "8", "--img-size", "16",
         "--k", "16", "--batch-size", "32", "--epochs", "1", "--preset", "cpu", "--device", "cpu",
         "--no-progress"]))
    fresh = run("label-bn", "--data", str(small_data), "--output", str(tmp_path / "fresh"), "--k",
                "16", "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    trained = run("label-bn", "--data", str(small_data), "--output", str(run_dir), "--k", "16",
                  "--width", "8", "--img-size", "16", "--device", "cpu", "--no-progress")
    assert (run_dir / "label_bn.json").is_file()
    assert trained["results"]["batch"]["spread"] != fresh["results"]["batch"]["spread"]


def test_unknown_study_fails():
    with pytest.raises(SystemExit):
        ablations.get_args_parser().parse_args(["nope"])
