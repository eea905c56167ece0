"""bench/compare_labelers.py: two versions of the exact labeler on the same inputs, bit for bit."""
import json
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "bench") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "bench"))

import compare_labelers  # noqa: E402

OTL = os.path.join(ROOT, "otl_scale.py")   # the tuned labeler


@pytest.fixture
def saved(tmp_path):
    p = tmp_path / "outputs.pt"
    torch.save(torch.randn(3000, 20, generator=torch.Generator().manual_seed(3)), p)
    return str(p)


def test_same_version_is_the_same_on_every_case(tmp_path, saved, capsys):
    copy = tmp_path / "otl_copy.py"
    shutil.copy(OTL, copy)
    out = tmp_path / "cmp.json"
    rc = compare_labelers.main([OTL, str(copy), "--inputs", "none", "--pt", saved, "--reps", "2",
                                "--out", str(out), "--expect-same"])
    assert rc == 0
    rec = json.loads(out.read_text())
    folder = os.path.basename(os.path.dirname(saved))
    assert [c["case"] for c in rec["cases"]] == [f"{folder}/outputs.pt{s}" for s in
                                                ("", "[:80%]", "[n/3:]", "[::2]", "[:-777]")]
    assert all(c["same"] and len(c["seconds_a"]) == len(c["seconds_b"]) == 2 for c in rec["cases"])
    assert all(c["max_minus_min_a"] <= 1 for c in rec["cases"])
    assert rec["summary"]["differ"] == 0
    assert "5 cases, 0 differ" in capsys.readouterr().out
    assert compare_labelers.main([OTL, str(copy), "--inputs", "none", "--pt", saved, "--whole-only",
                                  "--out", str(out)]) == 0
    assert [c["case"] for c in json.loads(out.read_text())["cases"]] == [f"{folder}/outputs.pt"]


def test_a_change_in_T_is_reported_and_fails_expect_same(tmp_path, saved, capsys):
    """B shifts T by a constant (the same labels, another T): every case differs."""
    changed = tmp_path / "otl_changed.py"
    changed.write_text(open(OTL).read() + "\n\n_translate = translate\n\n\n"
                       "def translate(outputs, **kw):\n"
                       "    r = _translate(outputs, **kw)\n"
                       "    r.T = r.T + 1.0\n"
                       "    return r\n")
    out = tmp_path / "cmp.json"
    rc = compare_labelers.main([OTL, str(changed), "--inputs", "none", "--pt", saved,
                                "--out", str(out), "--expect-same"])
    assert rc == 1
    rec = json.loads(out.read_text())
    assert not any(c["same"] for c in rec["cases"])
    assert all(c["labels_differ"] == 0 and c["T_max_abs_diff"] == pytest.approx(1.0)
               for c in rec["cases"])
    assert "5 cases, 5 differ" in capsys.readouterr().out
    # without --expect-same the differences are reported, not an error
    assert compare_labelers.main([OTL, str(changed), "--inputs", "none", "--pt", saved]) == 0


def test_views_are_one_case_and_invalid_labels_fail(tmp_path, capsys):
    """A saved (2, N, k) stack is one case labelled as a training epoch labels its two views (the
    second from the first's T); B whose labels are not argmax(O - T) is reported invalid."""
    p = tmp_path / "views.pt"
    O = torch.randn(3000, 20, generator=torch.Generator().manual_seed(4))
    torch.save(torch.stack([O, O + 0.01 * torch.randn(O.shape)]), p)
    out = tmp_path / "cmp.json"
    assert compare_labelers.main([OTL, OTL, "--inputs", "none", "--pt", str(p), "--out", str(out),
                                  "--expect-same"]) == 0
    case, = json.loads(out.read_text())["cases"]
    assert case["case"] == "views.pt" and case["same"] and case["valid_b"]
    broken = tmp_path / "otl_broken.py"
    broken.write_text(open(OTL).read() + "\n\n_translate = translate\n\n\n"
                      "def translate(outputs, **kw):\n"
                      "    r = _translate(outputs, **kw)\n"
                      "    r.labels = r.labels.roll(1)\n"
                      "    return r\n")
    assert compare_labelers.main([OTL, str(broken), "--inputs", "none", "--pt", str(p),
                                  "--expect-same"]) == 1
    assert "1 invalid in B" in capsys.readouterr().out


def test_a_git_revision_and_bad_arguments(tmp_path, saved):
    if not os.path.exists(os.path.join(ROOT, ".git")):     # (a worktree's .git is a file)
        pytest.skip("not a git checkout")
    assert compare_labelers.main(["HEAD", OTL, "--inputs", "none", "--pt", saved]) == 0
    with pytest.raises(SystemExit, match="neither a file nor a git revision"):
        compare_labelers.main(["no-such-revision-xyz", OTL, "--inputs", "none"])
    with pytest.raises(SystemExit):
        compare_labelers.main([OTL, OTL, "--inputs", "tiny"])
