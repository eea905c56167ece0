"""otl.py copied alone into an empty folder runs the method with only torch importable: numpy,
scipy, tqdm, torchvision and the project's other files are out of reach (imports of them fail as
if they were not installed)."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import importlib.abc, sys
BLOCKED = {"numpy", "scipy", "tqdm", "torchvision", "sklearn", "faiss", "PIL", "matplotlib", "utils"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

sys.meta_path.insert(0, Block())
import torch
import otl

g = torch.Generator().manual_seed(0)
for k in (20, 300):
    O = torch.randn(6000, k, generator=g) + torch.linspace(0, 1, k)
    for method in ("exact", "published"):
        r = otl.translate(O, method=method)
        spread = int(r.counts.max() - r.counts.min())
        assert spread <= (1 if method == "exact" else 5), (k, method, spread)
        print(k, method, spread)
    r = otl.translate(O)       # the exact labeler's labels are argmax(O - T), strictly
    assert torch.equal((O.double() - r.T).argmax(1), r.labels) and r.ties_left == 0
target = otl.uneven_target(6000, 20, 2)      # an uneven target: met exactly
r = otl.translate(torch.randn(6000, 20, generator=g), target=target)
assert torch.equal(r.counts.double(), target), r.counts
O = torch.randn(1, 10, generator=g).expand(1000, 10)     # collapsed: equal rows
r = otl.translate(O)
Z = O.double() - r.T
assert r.counts.tolist() == [100] * 10, r.counts
assert bool((Z.gather(1, r.labels[:, None]).squeeze(1) >= Z.max(1).values - 1e-9).all())
print("uneven and collapsed ok")
logits = torch.randn(2, 8, 5, requires_grad=True)
loss = otl.lct_loss(logits, torch.randint(0, 5, (2, 8), generator=g))
loss.backward()
labels, _, _ = otl.sinkhorn_knopp(torch.randn(100, 5, generator=g))
preds = otl.knn_classify(torch.randn(50, 4), torch.arange(50) % 3, torch.randn(7, 4), ks=(5,))
x = otl.augment(torch.randint(0, 256, (4, 3, 40, 40), dtype=torch.uint8), 32, strong=True)
assert x.shape == (4, 3, 32, 32)
assert all(m.split(".")[0] not in BLOCKED for m in sys.modules), "a blocked module was imported"
print("ok", float(loss))
'''


def test_otl_alone_with_only_torch(tmp_path):
    shutil.copy(os.path.join(ROOT, "otl.py"), tmp_path / "otl.py")
    assert os.listdir(tmp_path) == ["otl.py"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "ok" in p.stdout
    assert "20 exact 0" in p.stdout and "300 exact" in p.stdout
    assert "uneven and collapsed ok" in p.stdout
