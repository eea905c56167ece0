"""The exact labeler (otl.translate, method="exact"): balance within 1 of the target, labels
that are argmax(O - T) for one T, streaming = dense, and two gloo ranks = one process."""
import io
import math
import os
import socket
import zipfile

import pytest
import torch
import torch.multiprocessing as mp

import otl
import otl_scale

from conftest import EUROSAT


def gen(seed):
    return torch.Generator().manual_seed(seed)


def exact(O, **kw):
    return otl_scale.translate(O, method="exact", **kw)


def check_translation(O, r, tie_eps=2.0 ** -26):
    """labels are argmax(O - T), except between entries of a row within the tie-break size."""
    n, k = O.shape
    assert torch.equal(torch.bincount(r.labels, minlength=k), r.counts)
    S = O.double() - r.T
    top = S.topk(2, dim=1)
    eps = tie_eps * O[:8192].abs().max().item()
    wrong = top.indices[:, 0] != r.labels
    assert not (wrong & (top.values[:, 0] - top.values[:, 1] > eps)).any()
    # the label's score is within eps of the best one everywhere
    own = S.gather(1, r.labels[:, None])[:, 0]
    assert (top.values[:, 0] - own <= eps).all()
    return int(wrong.sum())


def check_even(r):
    assert int(r.counts.max() - r.counts.min()) <= 1, r.counts
    assert r.stop_reason == "balanced"


# ---------------------------------------------------------------------------------------------
# exact balance
# ---------------------------------------------------------------------------------------------

KS = [10] + list(range(50, 1001, 50))


@pytest.mark.parametrize("k", KS)
def test_exact_balance_gaussian_50k(k):
    O = torch.randn(50_000, k, generator=gen(k))
    r = exact(O)
    check_even(r)
    wrong = check_translation(O, r)
    assert wrong <= 0.01 * O.shape[0]   # only rows within eps, where the tie-break decides


@pytest.mark.parametrize("k, n", [(10, 50_000), (128, 50_000), (1000, 20_000)])
def test_exact_balance_collapsed(k, n):
    """Every row the same (a dead network: its bias alone), where the tie-break alone decides
    (k = 1000 on 20,000 rows)."""
    O = torch.randn(1, k, generator=gen(k)).expand(n, k).contiguous()
    r = exact(O)
    check_even(r)
    check_translation(O, r)   # every row is a tie: the perturbation decides
    if k > 128:
        # candidate lists: they hold the columns the tie-break ranks first, so no row is read
        # again (from sample_start_T's T a row could be, many times over)
        assert r.refetched == 0


@pytest.mark.parametrize("k, n", [(200, 4000), (300, 3000)])
def test_exact_balance_half_collapsed(k, n):
    """Half of the rows the same, the others Gaussian: the shared row must end tied over most
    clusters, its copies spread by the tie-break at scores closer than float64 can order at
    their size; balance is kept (strictify's shift along the ties alone would leave these counts
    up to 5 apart, reported as stop_reason "max_iter"), and the rows left on a tie are counted."""
    g = gen(0)
    half = torch.randn(1, k, generator=g).expand(n // 2, k)
    O = torch.cat([half, torch.randn(n - n // 2, k, generator=g)])
    O = O[torch.randperm(n, generator=g)].contiguous()
    r = exact(O)
    check_even(r)
    assert 0 <= r.ties_left <= r.active
    check_translation(O, r)


@pytest.mark.parametrize("x", [0.5, 1.0, 2.0])
def test_exact_uneven_target_within_one(x):
    n, k = 20_000, 100
    target = otl.uneven_target(n, k, x)
    O = torch.randn(n, k, generator=gen(3))
    r = exact(O, target=target)
    assert (r.counts.double() - target).abs().max() <= 1
    check_translation(O, r)


def test_exact_fractional_target_within_one():
    n, k = 10_000, 7
    target = torch.rand(k, generator=gen(4)) + 0.5
    target = target / target.sum() * n
    O = torch.randn(n, k, generator=gen(5))
    r = exact(O, target=target)
    assert ((r.counts.double() - target).abs() < 1).all()


def _eurosat_images(n):
    if not os.path.isfile(EUROSAT):
        msg = f"the real EuroSAT archive is missing at {os.path.abspath(EUROSAT)}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI must have ../shared/data beside the checkout)")
        pytest.skip(msg)
    from PIL import Image
    imgs = []
    with zipfile.ZipFile(EUROSAT) as z:
        names = sorted(x for x in z.namelist() if x.lower().endswith(".jpg"))
        step = max(1, len(names) // n)
        for name in names[::step][:n]:
            im = Image.open(io.BytesIO(z.read(name))).convert("RGB")
            imgs.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
                        .view(im.size[1], im.size[0], 3).permute(2, 0, 1))
    return torch.stack(imgs)


@pytest.mark.parametrize("bn", ["batch", "eval"])
def test_exact_balance_resnet18_eurosat(bn):
    """Outputs of a randomly initialised ResNet-18 on real EuroSAT images (eval-mode BatchNorm
    gives nearly collapsed outputs)."""
    images = _eurosat_images(600)
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=50, width=32))
    O = otl.label_pass(model, images, 32, 200, "cpu", bn=bn, generator=gen(0),
                       progress=False)[0]
    r = exact(O)
    check_even(r)
    check_translation(O, r)


@pytest.fixture(scope="module")
def resnet18_features():
    """Backbone features of a randomly initialised ResNet-18 for N = 50,000 EuroSAT images (25,000
    images and their mirror images), BatchNorm on batch statistics as in training's label pass."""
    images = _eurosat_images(25_000)
    images = torch.cat([images, images.flip(3)])
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=10, width=32))
    return otl.label_pass(model, images, 32, 500, "cpu", bn="batch", head=False, generator=gen(0),
                          progress=False)[0]


FULL_N = (10, 100, 500, 1000)   # these at N = 50,000; the others on its first 20,000 rows
# k on both sides of each of the labeler's switches: the dense path (k <= 128), candidate lists
# (k > 128), the sample start (k > 256)
RESNET_KS = [10, 50, 100, 128, 150, 250, 300, 500, 750, 1000]


@pytest.mark.parametrize("k", RESNET_KS)
def test_exact_balance_resnet18_heads(resnet18_features, k):
    """k from 10 to 1000 on real network outputs: a fresh k-way head on the features, all
    50,000 rows for the k in FULL_N and the first 20,000 for the others, which keeps the suite
    within its time."""
    torch.manual_seed(k)
    n = 50_000 if k in FULL_N else 20_000
    with torch.no_grad():
        O = torch.nn.Linear(resnet18_features.shape[1], k)(resnet18_features[:n])
    assert O.shape == (n, k)
    r = exact(O)
    check_even(r)
    check_translation(O, r)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_exact_other_dtypes(dtype):
    """Candidates (k > 128) from float64 and half-precision outputs: balanced, and labels are
    argmax(O - T) of those outputs."""
    O = torch.randn(4000, 200, generator=gen(13)).to(dtype)
    r = exact(O)
    check_even(r)
    check_translation(O, r)


def test_exact_is_a_translation():
    O = torch.randn(3000, 20, generator=gen(6))
    r = exact(O)
    i, j = torch.randint(0, 3000, (2, 100), generator=gen(7))
    d_before = O.double()[i] - O.double()[j]
    d_after = (O.double() - r.T)[i] - (O.double() - r.T)[j]
    assert torch.allclose(d_before, d_after, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# streaming = dense
# ---------------------------------------------------------------------------------------------

def _stream(O, sizes, **kw):
    st = otl_scale.StreamingTranslator(O.shape[1], distributed=False, **kw)
    s = 0
    for b in sizes:
        st.add(O[s:s + b])
        s += b
    st.add(O[s:])
    return st.result(refetch=lambda rows: O[rows])


@pytest.mark.parametrize("full", [True, False])
def test_streaming_equals_dense(full):
    n, k = 20_000, 300
    O = torch.randn(n, k, generator=gen(8))
    kw = {} if full else {"full_rows_up_to": 0, "max_candidates": 24, "candidates": 8}
    dense = exact(O, **kw)
    sizes = torch.randint(1, 3000, (12,), generator=gen(9)).tolist()
    stream = _stream(O, sizes, **kw)
    assert torch.equal(dense.labels, stream.labels)
    assert torch.equal(dense.T, stream.T)
    check_even(stream)
    if not full:
        # the candidate lists are small: much less memory than the dense outputs
        st = otl_scale.StreamingTranslator(k, distributed=False, **kw)
        assert st.width == 24


@pytest.mark.parametrize("k, shift", [(300, 0.0), (50, 0.0), (200, 2.0)])
def test_result_holds_each_row_once(monkeypatch, k, shift):
    """result() moves the rows it solves out of the store (the solver's copy is not held
    twice), also when the working set widens and a second solve takes more rows (here k = 50
    and k = 200 do); the result is the same as translate's, and the translator is spent."""
    O = torch.randn(20_000, k, generator=gen(17)) + torch.linspace(0, shift, k)
    seen, solve = [], otl_scale.StreamingTranslator._solve

    def checked(self, vals, cols, theta, epoch, cuts, rows, *a, **kw):
        seen.append(rows.numel())
        assert sum(v.shape[0] for v in self.vals) + vals.shape[0] == self.n   # each row once
        rest = sorted(set(range(self.n)) - set(rows.tolist()))
        assert torch.equal(self.kept, torch.tensor(rest, dtype=torch.long))
        return solve(self, vals, cols, theta, epoch, cuts, rows, *a, **kw)

    monkeypatch.setattr(otl_scale.StreamingTranslator, "_solve", checked)
    st = otl_scale.StreamingTranslator(k, distributed=False)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    assert seen and seen[-1] == r.active
    if k != 300:
        assert len(seen) > 1                  # the widening path ran
    monkeypatch.setattr(otl_scale.StreamingTranslator, "_solve", solve)
    ref = exact(O, dense=False)       # translate's streaming path (k <= 128: dense by default)
    assert torch.equal(r.labels, ref.labels) and torch.equal(r.T, ref.T)
    check_even(r)
    with pytest.raises(RuntimeError, match="once"):
        st.result()
    with pytest.raises(RuntimeError, match="new StreamingTranslator"):
        st.add(O[:10])


def test_recut_bound_holds_wherever_T_moves():
    """Candidates chosen again at a translation dT (replace_rows) carry their bound on the
    dropped columns from there: exact at dT, never below a dropped column's score wherever T
    goes next (up or down), for them and for the rows still chosen at T0."""
    n, k, w = 400, 60, 8
    O = torch.randn(n, k, generator=gen(3), dtype=torch.float64)

    def cut(dT):   # each row's best w at dT, and the (w + 1)-th score there
        tv, ti = (O - dT).topk(w + 1, dim=1)
        return O.gather(1, ti[:, :w]), ti[:, :w].to(torch.int16), tv[:, w]

    vals, cols, theta = cut(torch.zeros(k, dtype=torch.float64))
    t = torch.full((k,), n / k, dtype=torch.float64)
    solver = otl_scale._ExactSolver(vals.clone(), cols.clone(), theta.clone(), k, t, t.floor().long(),
                              t.ceil().long(), otl_scale._Comm(False), 128, torch.arange(n))
    dT1 = torch.rand(k, generator=gen(4), dtype=torch.float64) * 3
    solver.dT = dT1.clone()
    again = torch.arange(0, n, 2)
    v2, c2, th2 = cut(dT1)
    solver.replace_rows(again, v2[again], c2[again], th2[again])
    bound = torch.cat([b for _, _, b in solver._blocks(solver.all_rows)])
    assert torch.equal(bound[again], th2[again])              # exact where they were chosen
    for seed in range(6):
        solver.dT = dT1 + (torch.rand(k, generator=gen(10 + seed), dtype=torch.float64) - 0.5) * 4
        bound = torch.cat([b for _, _, b in solver._blocks(solver.all_rows)])
        kept = torch.zeros(n, k, dtype=torch.bool).scatter_(1, solver.cols.long(), True)
        dropped = (O - solver.dT).masked_fill(kept, -math.inf).amax(1)
        assert bool((dropped <= bound + 1e-12).all())


def test_reread_rows_keep_exact_values_and_a_true_bound():
    """Rows read again (_full_rows) choose their best columns without hashing the tie-break of
    every column: the kept columns and their values are those the whole jittered rows give
    (_cut of _whole_rows), and theta bounds every dropped column's jittered score at dT, within
    a few eps of the jittered cut's own bound; rows whose dropped columns are all -inf get -inf,
    not NaN."""
    n, k = 3000, 300
    O = torch.randn(n, k, generator=gen(21)) * torch.linspace(0.5, 2.0, k)
    O[-40:, 30:] = -math.inf                    # fewer finite columns than the width
    st = otl_scale.StreamingTranslator(k, distributed=False, full_rows_up_to=0, n_init=1000,
                                 tie_eps=2.0 ** -10)       # a tie-break large enough to matter
    st.add(O[:1000])
    st.offset = 0
    rows = torch.arange(n)
    for seed in range(3):
        dT = torch.randn(k, generator=gen(30 + seed), dtype=torch.float64) * 0.3
        vals, cols, theta = st._full_rows(O, rows, dT)
        whole = st._whole_rows(O, rows)
        v0, c0, t0 = st._cut(whole, dT)
        assert cols.dtype == c0.dtype and vals.shape == v0.shape == (n, st.width)
        cs, o = cols.long().sort(1)
        c0s, o0 = c0.long().sort(1)
        same = (cs == c0s).all(1)                # the same columns, maybe in another order
        assert int(same.sum()) > 0.95 * n        # only near-ties at the cut may differ
        assert torch.equal(vals.gather(1, o)[same], v0.gather(1, o0)[same])
        assert torch.equal(vals, whole.gather(1, cols.long()))   # exact values, every row
        kept = torch.zeros(n, k, dtype=torch.bool).scatter_(1, cols.long(), True)
        dropped = (whole - dT).masked_fill(kept, -math.inf).amax(1)
        assert not bool(theta.isnan().any())
        assert bool((dropped <= theta).all())
        assert torch.equal(theta[-40:], torch.full((40,), -math.inf, dtype=torch.float64))
        fin = torch.isfinite(t0)
        assert bool(((theta - t0)[fin] <= 2 * st.eps).all())


@pytest.mark.parametrize("dense_rows", [1, 10])
def test_extraction_counts_dense_rows_apart_and_lists_them_unless_whole(monkeypatch, dense_rows):
    """A block's candidates where some rows have 95 % of their columns tied at their best
    (counted by a sum over their mask, not listed hit by hit) beside rows with a few more hits
    than the width, and rows with one clear best: with one such row it is listed after the
    others (the rows over the width hold under 3 / 10 of their columns on average: not whole),
    with ten the block's rows over the width are taken whole.  Either way every row keeps exact
    values, theta bounds every dropped column, and a row with more hits than the width keeps
    the best `width` columns that its whole row gives."""
    n0, k = 1000, 300
    st = otl_scale.StreamingTranslator(k, distributed=False, full_rows_up_to=0, n_init=n0)
    st.add(torch.randn(n0, k, generator=gen(40)))
    w = st.width
    T0 = st.T0.to(torch.float32)
    X = torch.randn(64, k, generator=gen(41)) + T0
    X[torch.arange(64), torch.arange(64) * 4] += 6.0                  # one clear best a row
    tied = int(0.95 * k)
    X[20:20 + dense_rows, :tied] = T0[:tied] + 8.0                    # dense: tied at the top
    many = torch.arange(40, 50)
    X[many, :w + 4] = T0[:w + 4] + 8.0 + torch.randn(10, w + 4, generator=gen(43)) * 1e-3
    calls = []
    hits = otl_scale.StreamingTranslator._hits
    monkeypatch.setattr(otl_scale.StreamingTranslator, "_hits",
                        staticmethod(lambda *a: calls.append(1) or hits(*a)))
    first = st.n + st.row_offset
    st._extract_block(X)
    vals, cols, theta = st.vals[-1], st.cols[-1].long(), st.theta[-1]
    whole = dense_rows * tied + 10 * (w + 4) > 0.3 * (dense_rows + 10) * k
    assert whole == (dense_rows == 10)
    assert len(calls) == (1 if whole else 2)     # the dense rows listed apart unless taken whole
    S = X.double() - st.T0
    kept = torch.isfinite(vals)
    assert torch.equal(vals[kept], S.gather(1, cols)[kept])               # exact values
    mask = torch.zeros(64, k, dtype=torch.bool)
    mask[kept.nonzero()[:, 0], cols[kept]] = True
    dropped = S.masked_fill(mask, -math.inf).amax(1)
    assert bool((dropped <= theta).all())
    over = torch.cat([torch.arange(20, 20 + dense_rows), many])           # more hits than w
    _, ref_cols, _ = st._cut(st._whole_rows(X[over], over + first),
                             torch.zeros(k, dtype=torch.float64))
    assert bool(kept[over].all())
    assert torch.equal(cols[over].sort(1).values, ref_cols.long().sort(1).values)


def test_auction_has_its_own_rounds_after_a_long_approach():
    """The approach's steps count in the solver's rounds; the auction still gets its own
    max_rounds after them, not none once the approach has taken max_rounds."""
    n, k = 4000, 40
    O = torch.randn(n, k, generator=gen(22), dtype=torch.float64) + torch.linspace(0, 1, k)
    t = torch.full((k,), n / k, dtype=torch.float64)
    cols = torch.arange(k, dtype=torch.int16).expand(n, k).contiguous()
    solver = otl_scale._ExactSolver(O.clone(), cols, torch.full((n,), -math.inf, dtype=torch.float64),
                              k, t, t.floor().long(), t.ceil().long(), otl_scale._Comm(False), 1024,
                              torch.arange(n), rounds=500)
    excess = int((solver.counts - solver.hi).clamp(min=0).sum())
    solver._auction(200, [])
    assert solver.rounds > 500
    assert int((solver.counts - solver.hi).clamp(min=0).sum()) < excess


def test_reverse_round_pulls_in_deficits_and_keeps_labels_argmax():
    """_attract, the auction's reverse round: under-full clusters fall (done as a rise of every
    other cluster: T only rises), the total deficit at least halves, and every row's label is
    still its argmax at the new T (rows of under-full clusters too, whose own cluster fell less
    than another's).  Whole rows here for a direct check; the solver uses it on candidates."""
    n, k = 4000, 40
    O = torch.randn(n, k, generator=gen(24), dtype=torch.float64) - torch.linspace(0, 1.5, k)
    t = torch.full((k,), n / k, dtype=torch.float64)
    cols = torch.arange(k, dtype=torch.int16).expand(n, k).contiguous()
    solver = otl_scale._ExactSolver(O.clone(), cols, torch.full((n,), -math.inf, dtype=torch.float64),
                              k, t, t.floor().long(), t.ceil().long(), otl_scale._Comm(False), 1024,
                              torch.arange(n))
    deficit = (solver.lo - solver.counts).clamp(min=0)
    assert int((deficit > 0).sum()) > 10                # many under-full clusters at once
    dT = solver.dT.clone()
    solver._attract()
    assert (solver.dT >= dT).all()
    assert torch.equal(solver.labels, (O - solver.dT).argmax(1))
    assert torch.equal(solver.counts, torch.bincount(solver.labels, minlength=k))
    after = (solver.lo - solver.counts).clamp(min=0)
    assert int(after.sum()) < 0.5 * int(deficit.sum())
    # the deepest deficit is pulled in (clusters that fell less can lose rows to those that
    # fell more: a round is a simultaneous step, the next rounds go on from there)
    j = int(deficit.argmax())
    assert int(solver.counts[j]) > int(solver.lo[j] - deficit[j])


def test_reverse_round_pulls_all_it_can_reach_just_past_the_dearest():
    """A reverse round in which an under-full cluster can reach fewer rows than its deficit (it
    is in few rows' candidates) pulls them all in, and falls just past the dearest one's loss,
    not twice as far: the fall also makes the cluster beat every row that has dropped it, so
    doubling it round after round blows up T's span and sends every row into one cluster (as on
    a trained backbone's outputs at k = 3000; docs/labeler.md, 'Large k or streamed rows:
    candidate lists, auction, shortest paths')."""
    n, k = 400, 4
    O = torch.randn(n, k, generator=gen(31), dtype=torch.float64)
    O[torch.arange(n), torch.arange(n) * 3 // n] += 10   # 134 / 133 / 133 rows in clusters 0 - 2
    O[:, 3] = -math.inf                                  # cluster 3: in two rows' candidates only
    O[0, 3], O[1, 3] = O[0, 0] - 0.5, O[1, 0] - 0.7
    t = torch.tensor([132.0, 132.0, 133.0, 3.0], dtype=torch.float64)   # only cluster 3 is short
    cols = torch.arange(k, dtype=torch.int16).expand(n, k).contiguous()
    solver = otl_scale._ExactSolver(O.clone(), cols, torch.full((n,), -math.inf, dtype=torch.float64),
                              k, t, t.floor().long(), t.ceil().long(), otl_scale._Comm(False), 1024,
                              torch.arange(n))
    assert int(solver.counts[3]) == 0
    solver._attract()
    fall = solver.dT[:3] - solver.dT[3]                   # the others rose; cluster 3 did not
    assert torch.allclose(fall, fall[0].expand(3), rtol=0, atol=1e-12)
    assert 0.7 < float(fall[0]) <= 0.7 * (1 + 2 ** -9)
    assert solver.labels[0] == 3 and solver.labels[1] == 3 and int(solver.counts[3]) == 2


def test_warm_start_from_a_sample(monkeypatch):
    """With whole rows (k <= 128), N >= 4 x max(4096, 32 k) and outputs far from balance at
    the column medians, result() first balances the rows 0, s, 2s, ... exactly and starts the
    whole solve there: far nearer the target than the medians, and exact either way.  Fewer
    rows, or outputs near balance at the medians (Gaussian): no warm start."""
    n, k = 20_000, 10
    O = dominant(n, k, 8)
    calls, warm = [], otl_scale.StreamingTranslator._warm_start

    def spy(self, *a):
        calls.append(self.n)
        warm(self, *a)

    monkeypatch.setattr(otl_scale.StreamingTranslator, "_warm_start", spy)
    r = exact(O, dense=False)     # the streaming path (translate's dense one has no warm start)
    assert calls == [n]
    check_even(r)
    assert check_translation(O, r) <= 0.01 * n
    cold = exact(O, warm_start=False, dense=False)
    assert calls == [n]
    check_even(cold)
    assert r.std_history[0] < 0.25 * cold.std_history[0]
    small = exact(O[:4 * 4096 - 1], dense=False)
    assert calls == [n]                  # too few rows for a sample of 4096
    check_even(small)
    G = torch.randn(n, k, generator=gen(9))
    check_even(exact(G, dense=False))
    assert calls == [n]                  # outputs near balance at the medians start there


def test_far_outputs_stay_on_candidates(monkeypatch):
    """Outputs like a random network's far from balance with candidate lists (rows nearly equal,
    columns of very different spread, so few clusters win at T0): the approach stops where the
    rows' candidates go stale instead of stepping on them, and the rows that fell short are
    read again for as long as that keeps helping. The solve ends exact on candidates, never by
    reading every row again and falling back to whole rows."""
    n, k = 6000, 300
    g = gen(23)
    scale = torch.exp(torch.randn(k, generator=g) * 0.6) * 0.05
    O = torch.randn(k, generator=g) * 0.05 + torch.randn(n, k, generator=g) * scale
    assert int((torch.bincount(O.argmax(1), minlength=k) > 0).sum()) < k // 3
    widths, init = [], otl_scale._ExactSolver.__init__

    def spy(self, vals, *a, **kw):
        widths.append(vals.shape[1])
        init(self, vals, *a, **kw)

    monkeypatch.setattr(otl_scale._ExactSolver, "__init__", spy)
    st = otl_scale.StreamingTranslator(k, distributed=False, full_rows_up_to=0)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    assert widths == [st.width]            # one solver, on candidates
    assert r.refetched < 3 * n
    check_even(r)
    check_translation(O, r)


def test_widening_after_whole_rows(monkeypatch):
    """A solve that fell back to whole rows, then a wider one: the rows of the first come from
    its solver cut back to their best candidates (with a true bound on the rest), and the
    result is still exact and translation-only."""
    O = torch.randn(20_000, 200, generator=gen(17)) + torch.linspace(0, 2.0, 200)
    run, take, widths = otl_scale._ExactSolver.run, otl_scale.StreamingTranslator._take, []
    forced, rows = [], []

    def fail_twice(self, *a, **kw):    # as if no cheap move reached a needy cluster, also after
        ok = run(self, *a)              # every row's candidates were chosen again: whole rows
        forced.append(self.vals.shape[1])
        rows.append(self.vals.shape[0])
        return ok and len(forced) > 2

    def spy(self, rows, prev=None):
        if prev is not None:
            widths.append(prev[1].vals.shape[1])
        return take(self, rows, prev)

    monkeypatch.setattr(otl_scale._ExactSolver, "run", fail_twice)
    monkeypatch.setattr(otl_scale.StreamingTranslator, "_take", spy)
    st = otl_scale.StreamingTranslator(200, distributed=False, full_rows_up_to=0)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    assert forced[:3] == [48, 48, 200] and 200 in widths    # the cut-back path ran
    assert r.refetched >= 2 * rows[0]      # every row chosen again once, then taken whole
    check_even(r)
    check_translation(O, r)


def test_streaming_needs_refetch_when_candidates_fall_short():
    n, k = 5000, 200
    O = torch.randn(n, k, generator=gen(10)) + torch.linspace(0, 3, k)   # far from balance
    st = otl_scale.StreamingTranslator(k, distributed=False, full_rows_up_to=0, max_candidates=4,
                                 candidates=2)
    st.add(O)
    with pytest.raises(RuntimeError, match="refetch"):
        st.result()
    st = otl_scale.StreamingTranslator(k, distributed=False, full_rows_up_to=0, max_candidates=4,
                                 candidates=2)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    assert r.refetched > 0
    check_even(r)
    check_translation(O, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k, kw, host", [(10, {}, 1 << 18), (40, {}, 1 << 18), (100, {}, 1 << 18),
                                         (100, {}, 0), (40, {}, 0), (300, {}, 1 << 18),
                                         (200, {"full_rows_up_to": 0, "max_candidates": 8,
                                                "candidates": 3}, 1 << 18)])
def test_exact_on_cuda_equals_cpu(k, kw, host, monkeypatch):
    """The same labels and T on a GPU as on the CPU: the dense path (k = 10 and 40: passes on
    the k x N copy, the solve by shortest paths; k = 100: row passes, _ExactSolver; its solve on
    the host, or with host = 0 on the GPU), candidates (k = 300), and candidate lists so short
    that rows are re-read."""
    monkeypatch.setattr(otl_scale, "_HOST_SOLVE", host)
    O = torch.randn(30_000, k, generator=gen(14))
    cpu = exact(O, **kw)
    gpu = exact(O.cuda(), **kw)
    assert gpu.labels.device.type == "cuda" and gpu.T.device.type == "cuda"
    assert torch.equal(cpu.labels, gpu.labels.cpu())
    torch.testing.assert_close(cpu.T, gpu.T.cpu(), rtol=0, atol=1e-12)
    assert gpu.refetched == cpu.refetched
    check_even(gpu)


@pytest.mark.parametrize("k, shape", [(10, "gaussian"), (50, "gaussian"), (100, "gaussian"),
                                      (100, "dominant"), (300, "gaussian"), (300, "clustered")])
def test_gpu_block_sizes_keep_labels_and_T(monkeypatch, k, shape):
    """A GPU's passes go over all rows at once (otl_scale._launch_bound): the candidate extraction,
    the solver's blocks and the Newton passes (one block of 30,000 rows where the CPU takes 3
    at k = 100; rows of k, not the k x N copy, at k = 50).  Taken on the CPU, they give the
    CPU's labels and T to the bit: the blocks split rows, never a row's values.  Far outputs
    at k > 256 start there from every 8th row, not every 4th: the CPU's labels from that
    start.  The exact solver holds its candidates' clusters as int32 there.  (CI has no GPU;
    test_exact_on_cuda_equals_cpu compares the devices themselves.)"""
    n = 30_000 if k <= 100 else 6000
    O = {"gaussian": lambda: torch.randn(n, k, generator=gen(15)),
         "dominant": lambda: dominant(n, k, 16),
         "clustered": lambda: _clustered(n, k, 17)}[shape]()
    # far outputs at k > 256 start from a sample: on a GPU every 8th row (n >= 8 k), not 4th
    T8 = otl_scale.sample_start_T(O, every=8)
    assert (T8 is not None) == (shape == "clustered")
    cpu = exact(O, start=T8) if T8 is not None else exact(O)
    if k == 100:     # blocks on the CPU, one on a GPU
        assert otl_scale._newton_block(k) < n <= otl_scale._newton_block(k, "cuda")
    monkeypatch.setattr(otl_scale, "_launch_bound", lambda device: True)
    blocks, col_types = [], set()
    bufs = otl_scale._newton_bufs
    monkeypatch.setattr(otl_scale, "_newton_bufs", lambda *a, **kw: blocks.append(a) or bufs(*a, **kw))
    init = otl_scale._ExactSolver.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        col_types.add(self.cols.dtype)

    monkeypatch.setattr(otl_scale._ExactSolver, "__init__", spy)
    gpu = exact(O)
    # the solver holds its candidates' clusters as int32 on a GPU (a gather needs no conversion)
    assert col_types <= {torch.int32} and (k <= 128 or col_types)
    if T8 is not None:
        assert torch.equal(otl_scale.sample_start_T(O), T8)
    if k <= 100:      # the dense path's passes: one block of every row
        assert blocks and all(min(a[0], otl_scale._newton_block(a[1], "cuda")) == a[0] for a in blocks)
    assert torch.equal(cpu.labels, gpu.labels)
    assert torch.equal(cpu.T, gpu.T)
    check_even(gpu)


@pytest.mark.parametrize("k", [100, 300])
def test_exact_without_scipy(monkeypatch, k):
    """otl.py stands alone: without scipy the exact finish runs its torch Dijkstra, with the
    same balance and the same translation-only labels."""
    O = torch.randn(6000, k, generator=gen(15)) + torch.linspace(0, 1, k)   # needs the finish
    with_scipy = exact(O)
    assert otl_scale._scipy_csgraph() is not None      # scipy is a requirement: the C path ran above
    monkeypatch.setattr(otl_scale, "_SCIPY", False)    # as if scipy were not installed
    calls, paths = [], otl_scale._shortest_paths
    monkeypatch.setattr(otl_scale, "_shortest_paths", lambda *a: calls.append(1) or paths(*a))
    r = exact(O)
    assert calls                                 # the finish ran, on the torch Dijkstra
    check_even(r)
    check_translation(O, r)
    check_even(with_scipy)


def test_small_k_finishes_without_scipy(monkeypatch):
    """Up to k = 64 the finish takes the torch Dijkstra (as fast there, and no scipy import on a
    process's first call); above, scipy's (the streaming path's finish: the dense one solves
    k <= 64 by _PathSolver)."""
    looked_up = []
    lookup = otl_scale._scipy_csgraph
    monkeypatch.setattr(otl_scale, "_scipy_csgraph", lambda: looked_up.append(1) or lookup())
    calls, paths = [], otl_scale._shortest_paths
    monkeypatch.setattr(otl_scale, "_shortest_paths", lambda *a: calls.append(a[0]) or paths(*a))
    for k in (20, 64):
        O = torch.randn(6000, k, generator=gen(15)) + torch.linspace(0, 1, k)   # needs the finish
        r = exact(O, dense=False)
        check_even(r)
        check_translation(O, r)
    assert 20 in calls and max(calls) <= 64 and not looked_up
    exact(torch.randn(6000, 100, generator=gen(15)) + torch.linspace(0, 1, 100), dense=False)
    assert looked_up


def _graph(k, density, seed, ties):
    """A random cluster graph in _shortest_paths' csr form (with ties and zero weights)."""
    g = gen(seed)
    edge = torch.rand(k, k, generator=g) < density
    edge.fill_diagonal_(False)
    W = (torch.randint(0, 4, (k, k), generator=g).double() if ties
         else torch.rand(k, k, generator=g, dtype=torch.float64))
    e = edge.view(-1).nonzero()[:, 0]
    indptr = torch.searchsorted(e // k, torch.arange(k + 1)).to(torch.int32)
    src = torch.rand(k, generator=g) < 0.2
    src[0] = True
    return (e % k).to(torch.int32), W.view(-1)[e], indptr, src, W, edge


@pytest.mark.parametrize("k, density, scipy", [(12, 0.3, True), (50, 0.2, True), (64, 0.9, True),
                                                (100, 0.5, True), (150, 0.9, False)])
def test_shortest_paths_against_bellman_ford(monkeypatch, k, density, scipy):
    """The finish's Dijkstra (a heap in Python up to 16,384 edges, else torch vector steps
    without scipy, scipy's above k = 64): Bellman-Ford's distances, and each predecessor on a
    shortest path."""
    if not scipy:
        monkeypatch.setattr(otl_scale, "_SCIPY", False)
    for seed in range(8):
        eb, ew, indptr, src, W, edge = _graph(k, density, seed, ties=seed % 2 == 0)
        d, pred = otl_scale._shortest_paths(k, eb, ew, indptr, src)
        ref = torch.where(src, 0.0, math.inf).double()
        Wm = torch.where(edge, W, math.inf)
        for _ in range(k):
            ref = torch.minimum(ref, (ref[:, None] + Wm).amin(0))
        assert torch.equal(d, ref)
        for v in range(k):
            if math.isfinite(float(d[v])) and not src[v]:
                u = int(pred[v])
                assert edge[u, v] and float(d[u] + W[u, v]) == float(d[v])


def test_streaming_bad_batches():
    st = otl_scale.StreamingTranslator(10, distributed=False)
    with pytest.raises(ValueError, match="k=10"):
        st.add(torch.randn(5, 9))
    bad = torch.randn(20, 10)
    bad[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        st.add(bad)
        st.result()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_streaming_bad_values_with_candidate_lists(bad):
    """k > 128 (candidate lists): NaN or +inf in a row after the first batch is still caught,
    with its global row number."""
    O = torch.randn(20_000, 300, generator=gen(16))
    O[15_000, 7] = bad
    st = otl_scale.StreamingTranslator(300, distributed=False)
    with pytest.raises(ValueError, match=r"NaN or infinite values in 1 rows \(first: \[15000\]\)"):
        for s in range(0, 20_000, 4096):
            st.add(O[s:s + 4096])
    with pytest.raises(ValueError, match="NaN or infinite"):
        exact(O)


def test_streaming_collapsed_rows_break_ties_by_global_row():
    """More than max_candidates exactly tied outputs per row: the tie-break, not the column
    order, picks each row's candidates, so the rows spread over all clusters; a shard that says
    where it starts (row_offset) picks exactly what one process picks for the same rows."""
    n, k, half = 24_000, 300, 12_000        # each part holds more than n_init rows: extracted now
    O = torch.randn(1, k, generator=gen(12)).expand(n, k).contiguous()
    dense = exact(O)
    check_even(dense)
    st = otl_scale.StreamingTranslator(k, distributed=False, row_offset=half)
    st.add(O[half:])
    X = torch.cat(st.cols).long()                    # candidates of the second half
    one = otl_scale.StreamingTranslator(k, distributed=False)
    one.add(O)
    assert torch.equal(X, torch.cat(one.cols)[half:].long())
    assert X[:, 0].unique().numel() > 50             # not the same first candidate everywhere
    with pytest.raises(ValueError, match="row_offset"):
        st.result(refetch=lambda rows: O[rows])      # alone, this shard starts at row 0


@pytest.mark.parametrize("r, m, dtype", [(5, 3, torch.int64), (435, 10, torch.int16),
                                         (1000, 48, torch.int64), (3, 3000, torch.int16)])
def test_tie_jitter_numpy_and_torch_agree(monkeypatch, r, m, dtype):
    """_tie_jitter takes small CPU blocks in numpy and the rest in torch: the same numbers to the
    bit (its integer hash wraps around in int64 alike), also on expanded column blocks."""
    rows = torch.randint(0, 2 ** 40, (r,), generator=gen(5))
    for cols in (torch.randint(0, 3000, (r, m), generator=gen(6)).to(dtype),
                 torch.arange(m, dtype=dtype).expand(r, m)):
        for seed in (0, 7, 123_456_789):
            small = otl_scale._tie_jitter(rows, cols, seed)
            monkeypatch.setattr(otl_scale, "_JITTER_NP", -1)
            big = otl_scale._tie_jitter(rows, cols, seed)
            monkeypatch.setattr(otl_scale, "_JITTER_NP", 1 << 16)
            assert small.dtype == big.dtype == torch.float64
            assert torch.equal(small, big)
            assert ((small >= 0) & (small < 1)).all()
    assert small.unique().numel() == r * m           # distinct (row, column) pairs: no collision


def test_tie_shift_and_dense_path_without_numpy(monkeypatch):
    """Without numpy (otl.py needs torch alone) _tie_order's torch steps give the same order
    (and say so for a cycle of ties), and the dense path at small k solves by the auction instead
    of the numpy paths: the same labels (N / k whole)."""
    a = torch.tensor([0, 1, 2, 0, 5])
    b = torch.tensor([1, 2, 3, 4, 4])               # chains 0 -> 1 -> 2 -> 3, 0 / 5 -> 4
    with_np = otl_scale._tie_shift(otl_scale._tie_order(a, b, 6)[0], 1e-3, 1.0)
    assert with_np.tolist() == pytest.approx([0, 1e-3 / 8, 2e-3 / 8, 3e-3 / 8, 1e-3 / 8, 0])
    cycle = (torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]))
    assert otl_scale._tie_order(*cycle, 6)[1] and not otl_scale._tie_order(a, b, 6)[1]
    O = dominant(19_980, 20, 42)
    solves = _solver_spy(monkeypatch)
    r = exact(O)
    monkeypatch.setattr(otl_scale, "np", None)
    assert torch.equal(otl_scale._tie_shift(otl_scale._tie_order(a, b, 6)[0], 1e-3, 1.0), with_np)
    assert otl_scale._tie_order(*cycle, 6)[1] and not otl_scale._tie_order(a, b, 6)[1]
    r2 = exact(O)
    assert [name for name, _ in solves] == ["_PathSolver", "_ExactSolver"]
    assert torch.equal(r.labels, r2.labels)
    check_even(r2)
    check_translation(O, r2)


# ---------------------------------------------------------------------------------------------
# distributed: two gloo ranks on CPU = one process
# ---------------------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, O, kw, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        n = O.shape[0]
        lo, hi = rank * n // world, (rank + 1) * n // world
        shard = O[lo:hi]
        st = otl_scale.StreamingTranslator(O.shape[1], row_offset=lo, **kw)
        for s in range(0, shard.shape[0], 1000):
            st.add(shard[s:s + 1000])
        r = st.result(refetch=lambda rows: O[rows])   # global row numbers
        torch.save({"labels": r.labels, "T": r.T, "counts": r.counts}, f"{out}_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("full,far", [(True, False), (True, True), (False, False), (False, True)])
def test_distributed_equals_single_process(full, far, tmp_path, monkeypatch):
    """Whole rows and candidates, on Gaussian outputs and on outputs far from balance: whole
    rows far from balance take the warm start (its sample, every 4th row, spans both ranks'
    shards), candidates far from balance the auction's reverse rounds (whose cut ranks find by
    bisection where one process sorts)."""
    n, k = 20_000, 120   # rank 0 holds the first n_init = 8192 rows, as one process sees them
    assert n >= 4 * otl_scale.StreamingTranslator(k)._warm_rows()
    O = dominant(n, k, 11) if far else torch.randn(n, k, generator=gen(11))
    kw = {} if full else {"full_rows_up_to": 0, "max_candidates": 24, "candidates": 8}
    rounds, attract = [], otl_scale._ExactSolver._attract
    monkeypatch.setattr(otl_scale._ExactSolver, "_attract", lambda self: rounds.append(1) or attract(self))
    st = otl_scale.StreamingTranslator(k, distributed=False, **kw)   # as the ranks: no rows_hint
    st.add(O)
    assert st.far == far and st.all_cols == full
    single = st.result(refetch=lambda rows: O[rows])
    assert bool(rounds) == (far and not full)     # reverse rounds ran (candidates, far)
    assert single.refetched > 0 if far and not full else single.refetched == 0
    assert (st.f0 == 16.0) == (full and far)       # the warm start ran (whole rows, far)
    out = str(tmp_path / "r")
    mp.start_processes(_rank_main, args=(2, _free_port(), O, kw, out), nprocs=2,
                       start_method="spawn")
    parts = [torch.load(f"{out}_{r}.pt") for r in range(2)]
    assert torch.equal(torch.cat([p["labels"] for p in parts]), single.labels)
    for p in parts:
        assert torch.equal(p["T"], single.T)
        assert torch.equal(p["counts"], single.counts)


# ---------------------------------------------------------------------------------------------
# whole rows or candidates (k > full_rows_up_to)
# ---------------------------------------------------------------------------------------------

def dominant(n, k, seed):
    """Outputs shaped like a real network's: positive features through a random head, so that a
    few clusters take most rows at the column medians and the balancing translation is wider
    than the candidates' window."""
    g = gen(seed)
    F = torch.randn(n, 64, generator=g).relu() + 0.5 * torch.randn(1, 64, generator=g).relu()
    return (F @ (torch.randn(64, k, generator=g) / 8)).float()


def _keeps_whole(O, **kw):
    """Whether a StreamingTranslator keeps O's rows whole, decided once its first rows are in."""
    st = otl_scale.StreamingTranslator(O.shape[1], distributed=False, **kw)
    st.add(O)
    assert st.T0 is not None
    return st.all_cols


def test_real_like_outputs_keep_whole_rows_when_they_fit():
    """Far from balance at the medians, with the number of rows known (translate knows it) and
    rows x k x 10 bytes within full_rows_bytes, every column is kept up to k = 256, so nothing is
    re-read; above, candidates (re-read where they fall short).  Exact either way."""
    n, k = 20_000, 200
    O = dominant(n, k, 5)
    assert _keeps_whole(O, rows_hint=n)
    assert not _keeps_whole(O)                                           # rows not known
    assert not _keeps_whole(O, rows_hint=n, full_rows_bytes=n * k * 10 - 1)   # over the budget
    assert not _keeps_whole(O, rows_hint=n, full_rows_up_to=99)          # k > 2 x full_rows_up_to
    # above k = 256 candidates, even when whole rows would fit (passes over them cost more)
    big = dominant(n, 300, 5)
    st = otl_scale.StreamingTranslator(300, distributed=False, rows_hint=n)
    st.add(big)
    assert st.far and not st.all_cols
    r = exact(O)
    assert r.refetched == 0
    check_even(r)
    assert check_translation(O, r) <= 0.01 * n
    # candidates (k > 256), from the medians (no sample start), re-read where they fall short
    r = exact(big, sample_start=False)
    check_even(r)
    assert check_translation(big, r) <= 0.01 * n
    # only the rows that fell short are read again: their new candidates, chosen at the
    # translation reached, carry a bound from there (an epoch), not from T0 (then every row
    # was read again, some several times: 58,232 rows re-read here)
    assert 0 < r.refetched < 0.1 * n
    assert exact(big).refetched < r.refetched     # from a sample's T fewer fall short


@pytest.mark.parametrize("k", [10, 300])
def test_far_outputs_are_solved_in_one_pass(k):
    """Outputs far from balance at the medians (real networks') need a translation that moves
    most rows, so result() solves every row at once instead of first the rows that lead by
    little (a solve that was then thrown away); Gaussian outputs still start narrow.  Exact
    either way, whole rows (k = 10) or candidates (k = 300, rows not known)."""
    n = 20_000
    O = dominant(n, k, 6)
    st = otl_scale.StreamingTranslator(k, distributed=False, warm_start=False)   # (it re-centres)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    assert st.far and r.active == n
    check_even(r)
    assert check_translation(O, r) <= 0.01 * n
    G = torch.randn(n, k, generator=gen(7))
    st = otl_scale.StreamingTranslator(k, distributed=False)
    st.add(G)
    r = st.result()
    assert not st.far and r.active < n
    check_even(r)
    check_translation(G, r)


def test_gaussian_outputs_keep_candidates():
    """Even at the medians up to sampling noise: candidates, as before (they are several times
    faster there); an uneven target is far from the medians' counts, so rows are kept whole
    (k <= 256)."""
    n, k = 20_000, 200
    O = torch.randn(n, k, generator=gen(4))
    assert not _keeps_whole(O, rows_hint=n)
    target = otl.uneven_target(n, k, 2, first=1)
    assert _keeps_whole(O, rows_hint=n, target=target)
    r = exact(O, target=target)
    assert bool(((r.counts >= target.floor()) & (r.counts <= target.ceil())).all())
    assert check_translation(O, r) <= 0.01 * n


def _collapsing(n, k, popular, seed):
    """Outputs of a network collapsing onto `popular` of its k clusters: each row leads by 8 in
    one of them (unit noise elsewhere, so almost no row strays), and the column medians do not
    cancel the collapse."""
    g = gen(seed)
    O = torch.randn(n, k, generator=g)
    O[torch.arange(n), torch.randint(0, popular, (n,), generator=g)] += 8.0
    return O


def test_collapsed_outputs_widen_the_candidate_lists():
    """At the medians the first rows fill a fifth of the clusters (a third of what an even spread
    fills is the cut): the lists are twice as wide (candidates 48, at most 96), balance is still
    exact and the labels translation-only.  Random outputs and 60 % filled keep the usual width."""
    n, k = 12_000, 400
    O = _collapsing(n, k, 80, seed=21)
    st = otl_scale.StreamingTranslator(k, distributed=False, rows_hint=n)
    st.add(O)
    assert (st.widen, st.width, st.candidates) == (2, 96, 48) and not st.all_cols
    r = exact(O)
    check_even(r)
    assert check_translation(O, r) <= 0.01 * n
    for O2 in (torch.randn(n, k, generator=gen(22)), _collapsing(n, k, 240, seed=23)):
        st = otl_scale.StreamingTranslator(k, distributed=False, rows_hint=n)
        st.add(O2)
        assert (st.widen, st.width) == (1, 48)
    # the expectation follows the target: n_i ~ i^6 leaves many clusters nearly empty, so its
    # first 8192 rows would fill about 234 of them, and 80 filled is not under a third of that
    target = otl.uneven_target(n, k, 6, first=1)
    st = otl_scale.StreamingTranslator(k, target=target, distributed=False, rows_hint=n)
    st.add(O)
    assert st.widen == 1


def test_reverse_rounds_start_once_a_collapsed_solve_has_spread(monkeypatch):
    """A solve that starts with most clusters empty has no reverse auction rounds; once re-reads
    and the approach have spread the rows over half of the clusters, they are turned on (here
    with short candidate lists, so that the first solve falls short).  Balance stays exact."""
    calls = []
    attract = otl_scale._ExactSolver._attract
    monkeypatch.setattr(otl_scale._ExactSolver, "_attract",
                        lambda self: calls.append(1) or attract(self))
    O = _collapsing(12_000, 400, 80, seed=21)
    r = exact(O, candidates=6, max_candidates=16)
    check_even(r)
    assert check_translation(O, r) <= 0.01 * O.shape[0]
    assert r.refetched > 0 and len(calls) >= 1


def test_sparse_table_keys_and_edges_search_as_the_table_itself():
    """The finish's sparse k x k table (candidate lists): the finite entries' keys kept up to
    date row by row (as rounds touch clusters) equal a fresh scan, and Dijkstra on the edges
    costed from them alone gives _table_paths' distances on the whole table."""
    k, g = 60, gen(31)
    W = torch.randn(k * k, generator=g, dtype=torch.float64).abs()
    W[torch.rand(k * k, generator=g) < 0.7] = math.inf
    arg = torch.randint(0, 10_000, (k * k,), generator=g)
    s = object.__new__(otl_scale._ExactSolver)
    s.k, s.comm = k, otl_scale._Comm(False)
    keys = s._table_keys(W)
    for step in range(5):
        touched = torch.rand(k, generator=g) < 0.2
        rows = W.view(k, k)[touched]
        rows[:] = torch.where(torch.rand(rows.shape, generator=g) < 0.5, math.inf,
                              torch.rand(rows.shape, generator=g, dtype=torch.float64))
        W.view(k, k)[touched] = rows
        keys = s._table_keys(W, keys, touched)
        assert torch.equal(keys, torch.isfinite(W).nonzero()[:, 0]), step
        s.dT = torch.rand(k, generator=g, dtype=torch.float64) * 0.1
        ek, er, eb, ew, indptr = s._table_edges(W, arg, math.inf, keys)
        assert torch.equal(ek, keys) and torch.equal(er, arg[keys])
        src = torch.rand(k, generator=g) < 0.1
        src[0] = True
        d, _ = otl_scale._shortest_paths(k, eb, ew, indptr, src)
        assert torch.equal(d, otl_scale._table_paths(W.view(k, k), s.dT, src, ~src)[0]), step
        ek, _, _, ew, _ = s._table_edges(W, arg, 0.5, keys)     # only the moves up to tau
        cost = (W + s.dT.repeat(k) - s.dT.repeat_interleave(k))[keys]
        assert torch.equal(ek, keys[cost <= 0.5]) and (ew <= 0.5).all()


@pytest.mark.parametrize("numpy_steps", [True, False])
def test_table_paths_against_bellman_ford(monkeypatch, numpy_steps):
    """The finish's Dijkstra on the k x k table itself (costs max(W[a, b] + dT[b] - dT[a], 0),
    inf: no move; ties and zero costs included): Bellman-Ford's distances, each predecessor on
    a shortest path; stopped at the last needy cluster, every cluster nearer than it exact and
    the rest left at inf; numpy's steps and torch's alike."""
    if not numpy_steps:
        monkeypatch.setattr(otl_scale, "np", None)
    k = 70
    for seed in range(6):
        g = gen(100 + seed)
        W = torch.randint(0, 4, (k, k), generator=g).double() if seed % 2 else \
            torch.rand(k, k, generator=g, dtype=torch.float64)
        W[torch.rand(k, k, generator=g) < 0.6] = math.inf
        W.fill_diagonal_(math.inf)
        dT = torch.rand(k, generator=g, dtype=torch.float64) * 0.5
        W = W + dT[:, None] - dT[None, :]     # costs at dT: W again (a bit rounded), so >= 0 mostly
        src = torch.rand(k, generator=g) < 0.1
        src[0] = True
        C = (W + dT[None, :] - dT[:, None]).clamp(min=0)
        ref = torch.where(src, 0.0, math.inf).double()
        for _ in range(k):
            ref = torch.minimum(ref, (ref[:, None] + C).amin(0))
        needy = ~src & torch.isfinite(ref) & (torch.rand(k, generator=g) < 0.15)
        for want in (~src, needy):
            d, pred = otl_scale._table_paths(W, dT, src, want)
            far = float(ref[want].max()) if want.any() else math.inf
            done = torch.isfinite(d)
            assert torch.equal(d[done], ref[done]) and (ref[~done] >= far).all(), seed
            assert done[want].all() and (done | (ref >= far)).all()
            for v in done.nonzero()[:, 0].tolist():
                if not src[v]:
                    u = int(pred[v])
                    assert done[u] and float(d[u] + C[u, v]) == float(d[v])
            assert (pred[~done] == -1).all()


# ---------------------------------------------------------------------------------------------
# a given start translation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [40, 300])
def test_start_near_the_answer_balances(k):
    """start=T of a similar input (another view of the same images, here the same outputs moved
    a little): exact balance and translation-only labels as from the medians; streamed in
    batches it gives the dense call's labels and T.  (How much time it saves is measured by
    bench_labeler.py --views, not here.)"""
    g = gen(41)
    O = torch.randn(12000, k, generator=g) + torch.linspace(0, 2, k)     # far from balance
    other = O + 0.1 * torch.randn(O.shape, generator=g)
    cold = exact(O)
    warm = exact(O, start=exact(other).T)             # k = 40: the dense path, from the start
    T1 = exact(other, dense=False).T
    stream_path = exact(O, start=T1, dense=False)
    for r in (cold, warm, stream_path):
        check_even(r)
        check_translation(O, r)
    st = otl_scale.StreamingTranslator(k, distributed=False, start=T1)
    for s in range(0, 12000, 2500):
        st.add(O[s:s + 2500])
    streamed = st.result(refetch=lambda rows: O[rows])
    assert torch.equal(streamed.labels, stream_path.labels) and torch.equal(streamed.T, stream_path.T)
    # N / k = 300 rows each: one assignment is balanced and a translation's, whatever the path
    assert torch.equal(warm.labels, stream_path.labels) and torch.equal(cold.labels, warm.labels)


def test_start_far_from_the_answer_still_balances():
    """A poor start (far off, as the last epoch's translation early in training can be) costs
    time, never balance."""
    O = torch.randn(8000, 200, generator=gen(42))
    r = exact(O, start=torch.linspace(-3, 3, 200))
    check_even(r)
    check_translation(O, r)


def test_start_bad_values():
    O = torch.randn(500, 10, generator=gen(43))
    with pytest.raises(ValueError, match="k = 10 finite numbers"):
        exact(O, start=torch.zeros(9))
    with pytest.raises(ValueError, match="k = 10 finite numbers"):
        exact(O, start=torch.tensor([math.nan] + [0.0] * 9))
    with pytest.raises(ValueError, match="published rules start at 0"):
        otl_scale.translate(O, method="published", start=torch.zeros(10))


def _clustered(n, k, seed):
    """Outputs of rows drawn around a dozen centres: far from balance at their column medians,
    as a real network's are."""
    g = gen(seed)
    C = torch.randn(12, k, generator=g) * 2
    return C[torch.randint(0, 12, (n,), generator=g)] + torch.randn(n, k, generator=g)


def test_sample_start_on_far_outputs():
    """k > 256 and far from balance at the medians: translate first solves every 4th row and
    starts from its T (the same labels as start= that T); balanced, translation-only labels,
    also for an uneven target (scaled to the sample)."""
    O = _clustered(6000, 300, 44)
    T = otl_scale.sample_start_T(O)
    assert T is not None and T.shape == (300,)
    r = exact(O)
    assert torch.equal(r.labels, exact(O, start=T).labels)
    check_even(r)
    check_translation(O, r)
    target = otl.uneven_target(6000, 300, 1.0)
    ru = exact(O, target=target)
    assert bool(((ru.counts - target).abs() < 1).all()) and ru.stop_reason == "balanced"
    check_translation(O, ru)


def test_sample_start_only_where_it_pays():
    """No sample where the medians are a good start (Gaussian outputs), where rows are too few
    (under 4 k), or with whole rows by k (k <= 256: the warm start's ground)."""
    assert otl_scale.sample_start_T(torch.randn(6000, 300, generator=gen(45))) is None
    assert otl_scale.sample_start_T(_clustered(1000, 300, 46)) is None
    assert otl_scale.sample_start_T(_clustered(6000, 200, 47)) is None             # whole rows by k
    assert otl_scale.sample_start_T(_clustered(6000, 300, 47), full_rows_up_to=150) is None
    calls = []
    real = otl_scale.sample_start_T
    try:
        otl_scale.sample_start_T = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        exact(_clustered(6000, 200, 47))
        assert not calls
        exact(_clustered(6000, 300, 47))
        assert calls
        exact(_clustered(6000, 300, 47), sample_start=False)
        assert len(calls) == 1
    finally:
        otl_scale.sample_start_T = real


def test_sample_start_leaves_bad_outputs_to_the_whole_call():
    """A NaN in a sampled row: the error names its row in the whole input, not in the sample."""
    O = _clustered(6000, 300, 48)
    O[4000, 7] = math.nan                # row 4000 is the sample's row 1000
    with pytest.raises(ValueError, match=r"first: \[4000\]"):
        exact(O)


# ---------------------------------------------------------------------------------------------
# small k, outputs held whole: Newton steps, then the rows near a boundary (translate's default)
# ---------------------------------------------------------------------------------------------

def _dense_spy(monkeypatch, rows=None):
    """Records, for each translate call, whether the dense path gave the result and the rows of
    each exact solve it made (by either solver: the tie-break of the rows solved is drawn
    right before each); rows (a list): each solve's rows appended."""
    calls, solves = [], []
    dense, jitter = otl_scale._dense_translate, otl_scale._tie_jitter

    def spy(*a):
        solves.clear()
        r = dense(*a)
        calls.append((r is not None, list(solves)))
        return r

    def counted(B, cols, seed):
        solves.append(B.numel())
        if rows is not None:
            rows.append(B.clone())
        return jitter(B, cols, seed)

    monkeypatch.setattr(otl_scale, "_dense_translate", spy)
    monkeypatch.setattr(otl_scale, "_tie_jitter", counted)
    return calls


@pytest.mark.parametrize("k, dtype", [(10, torch.float32), (50, torch.float64), (128, torch.float16)])
def test_dense_path_on_real_like_outputs(monkeypatch, k, dtype):
    """k <= 128, N >= 64 k: translate solves only the rows near a cluster boundary after Newton
    steps; exact balance, a translation's labels, and (N / k whole: one balanced assignment is
    a translation's) the streaming path's labels."""
    n = 20_000 - 20_000 % k
    O = dominant(n, k, 21).to(dtype)
    calls = _dense_spy(monkeypatch)
    r = exact(O)
    assert calls[-1][0] and len(calls[-1][1]) == 1
    assert r.active == calls[-1][1][0] < 0.5 * n          # most rows kept their best column
    check_even(r)
    check_translation(O, r)
    ref = exact(O, dense=False)
    assert len(calls) == 1                                 # dense=False: the streaming path
    assert torch.equal(r.labels, ref.labels)


def test_dense_path_widens_when_T_moves_past_the_rows_kept(monkeypatch):
    """A first set of rows far too narrow: the solve moves T by more than the margin of the rows
    left out, one pass finds rows that changed, and the next try solves those with the rows
    solved, until none change; still exact, the streaming path's labels."""
    n, k = 20_000, 40
    O = dominant(n, k, 22)
    solved = []
    calls = _dense_spy(monkeypatch, solved)
    monkeypatch.setattr(otl_scale, "_DENSE_SHARE", 0.0)
    monkeypatch.setattr(otl_scale, "_DENSE_PER_MOVE", 2)      # (8 by default)
    musts = []
    near = otl_scale._near_rows

    def spy(lab, margin, R, cnt_out, hi, must=None):
        musts.append(None if must is None else must.clone())
        return near(lab, margin, R, cnt_out, hi, must)

    monkeypatch.setattr(otl_scale, "_near_rows", spy)
    r = exact(O)
    used, sizes = calls[-1]
    assert used and len(sizes) >= 2 and sizes[-1] > sizes[0]
    assert len(solved) == len(sizes)
    # a try after one that failed solves that one's rows again (with the rows that changed)
    for must, before in zip(musts[-len(sizes) + 1:], solved):
        assert must is not None and set(before.tolist()) <= set(must.tolist())
    check_even(r)
    check_translation(O, r)
    assert torch.equal(r.labels, exact(O, dense=False).labels)


@pytest.mark.parametrize("x", [0.5, 2.0])
def test_dense_path_uneven_target(monkeypatch, x):
    n, k = 12_345, 30
    target = otl.uneven_target(n, k, x)
    O = dominant(n, k, 23)
    calls = _dense_spy(monkeypatch)
    r = exact(O, target=target)
    assert calls[-1][0]
    assert (r.counts.double() - target).abs().max() <= 1
    check_translation(O, r)


def _solve_by_paths(vals, target):
    lo, hi = otl._count_bounds(target)
    s = otl_scale._PathSolver(vals, vals.shape[1], target, lo, hi)
    history = []
    assert s.run(history) and len(history) == 1
    s.strictify()
    return s, lo, hi


@pytest.mark.parametrize("k, kind", [(10, "whole"), (37, "fractions"), (20, "uneven"),
                                     (2, "whole")])
def test_path_solver_balances_with_strict_argmax_labels(k, kind):
    """_PathSolver (the dense path's solve at k <= 64): counts within [floor, ceil] of the
    target, every row's label its strict argmax at the returned dT (the moved rows' ties
    resolved), one path per row to move at least; with whole targets (one balanced assignment
    is a translation's) _ExactSolver's labels."""
    n = 600
    vals = (torch.randn(n, k, generator=gen(41)) + torch.linspace(0, 2, k)).double()
    target = {"whole": otl.even_target(n, k), "fractions": otl.even_target(n, k),
              "uneven": otl.uneven_target(n, k, 1.0, first=1).double()}[kind]
    s, lo, hi = _solve_by_paths(vals, target)
    c = torch.bincount(s.labels, minlength=k)
    assert torch.equal(c, s.counts) and ((c >= lo) & (c <= hi)).all()
    start = torch.bincount(vals.argmax(1), minlength=k)
    assert s.rounds >= int((start - hi).clamp(min=0).sum()) > 0
    S = vals - s.dT
    own = S.gather(1, s.labels[:, None])[:, 0]
    S[torch.arange(n), s.labels] = -math.inf
    assert (own > S.amax(1)).all() and s.ties > 0
    if torch.equal(lo, hi):
        cols = torch.arange(k, dtype=torch.int16).expand(n, k).contiguous()
        ref = otl_scale._ExactSolver(vals, cols, torch.full((n,), -math.inf, dtype=torch.float64), k,
                               target, lo, hi, otl_scale._Comm(False), 8192, torch.arange(n))
        assert ref.run(200, [], 1e-3)
        ref.strictify()
        assert torch.equal(ref.labels, s.labels)


@pytest.mark.parametrize("solver", ["exact", "paths", "exact_lists"])
def test_strictify_counts_near_ties_past_rounding_as_ties(solver):
    """A tie that rounding left 70 ulps off (beyond the 64 of a first look) next to a pair 70
    ulps apart the other way: a shift sized by that pair would not clear the tie, and the row
    would change cluster (counts off balance, as on a CIFAR-10 network's outputs at k = 3000).
    strictify counts the near pair as a tie too: the labels stay, each its strict argmax."""
    u = 2.0 ** -52                      # an ulp of the largest |value|, 1
    vals = torch.tensor([[0.0, 70 * u, -1.0],      # labelled 0, 70 ulps better in 1: a tie
                         [-1.0, 0.0, -70 * u],     # labelled 1, 70 ulps ahead of 2
                         [-1.0, -1.0, 0.0]], dtype=torch.float64)
    labels, target = torch.tensor([0, 1, 2]), otl.even_target(3, 3)
    lo, hi = otl._count_bounds(target)
    if solver == "paths":
        s = otl_scale._PathSolver(vals.clone(), 3, target, lo, hi)
        s._lab[:] = labels.numpy()
        s.dT, s.counts = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.int64)
    else:     # whole rows in order, or each row's columns in another order (candidate lists)
        order = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 2, 0]]) if solver == "exact_lists" \
            else torch.arange(3).expand(3, 3)
        s = otl_scale._ExactSolver(vals.gather(1, order), order.to(torch.int16).contiguous(),
                             torch.full((3,), -math.inf, dtype=torch.float64), 3, target, lo,
                             hi, otl_scale._Comm(False), 8192, torch.arange(3), labels=labels.clone())
    s.strictify()
    assert s.labels.tolist() == [0, 1, 2] and s.counts.tolist() == [1, 1, 1]
    S = vals - s.dT
    assert torch.equal(S.argmax(1), labels) and s.ties == 2
    S[torch.arange(3), labels] = -math.inf
    assert ((vals - s.dT).gather(1, labels[:, None])[:, 0] > S.amax(1)).all()


@pytest.mark.parametrize("solver", ["exact", "paths"])
def test_strictify_keeps_balance_when_no_shift_orders_the_ties(solver):
    """Two equal rows in two clusters tie both ways (a cycle: no shift of T orders them, as
    with rows whose tie-break values float64 cannot tell apart at their size).  The shift would
    send both to one cluster; strictify keeps the balanced labels instead and counts the rows
    left on a tie (not counts [2, 0])."""
    vals = torch.zeros(2, 2, dtype=torch.float64)
    labels, target = torch.tensor([0, 1]), otl.even_target(2, 2)
    lo, hi = otl._count_bounds(target)
    if solver == "paths":
        s = otl_scale._PathSolver(vals.clone(), 2, target, lo, hi)
        s._lab[:] = labels.numpy()
        s.counts = torch.ones(2, dtype=torch.int64)
    else:
        s = otl_scale._ExactSolver(vals.clone(), torch.arange(2, dtype=torch.int16).expand(2, 2).contiguous(),
                             torch.full((2,), -math.inf, dtype=torch.float64), 2, target, lo,
                             hi, otl_scale._Comm(False), 8192, torch.arange(2), labels=labels.clone())
    s.strictify()
    assert s.labels.tolist() == [0, 1] and s.counts.tolist() == [1, 1]
    assert s.ties == 2 and s.ties_left == 2
    assert torch.equal(s.dT, torch.zeros(2, dtype=torch.float64))


def _solver_spy(monkeypatch):
    """The dense path's solves, recorded as they start: (solver class name, rows) each."""
    solves = []
    for cls in (otl_scale._PathSolver, otl_scale._ExactSolver):
        monkeypatch.setattr(cls, "__init__", lambda self, vals, *a, _i=cls.__init__, _c=cls, **kw:
                            solves.append((_c.__name__, vals.shape[0])) or _i(self, vals, *a, **kw))
    return solves


def test_dense_path_solves_few_moves_by_paths_and_many_by_the_auction(monkeypatch):
    """At k <= _PATH_K with few rows to move ((k + 10) x their number at most _PATH_WORK) the
    dense path's exact solve is _PathSolver's; above either, _ExactSolver's; the same labels
    (N / k whole)."""
    solves = _solver_spy(monkeypatch)
    O = dominant(19_980, 20, 42)
    r = exact(O)
    assert [name for name, _ in solves] == ["_PathSolver"]
    monkeypatch.setattr(otl_scale, "_PATH_WORK", 0)
    solves.clear()
    r2 = exact(O)
    assert [name for name, _ in solves] == ["_ExactSolver"]
    assert torch.equal(r.labels, r2.labels)
    check_even(r)
    check_translation(O, r)


def _counts_reference(X, T):
    """_newton_counts by its definition, on one float32 N x k matrix."""
    S = X.to(torch.float32) - T.to(torch.float32)
    best = S.amax(1)
    col = (S == best[:, None]).to(torch.float32).argmax(1)     # the first column at the max
    S[torch.arange(S.shape[0]), col] = -math.inf
    return col, best - S.amax(1), torch.bincount(col, minlength=X.shape[1]), best


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("k", [20, 40, 70])
def test_newton_counts_match_their_definition(monkeypatch, dtype, k):
    """Every way of a pass (numpy's and torch's steps on a k x N copy up to k = _T_K, torch's
    on it up to _T_K_CPU on the host, torch's over the rows, and a GPU's fewer launches on
    either) gives the definition's best
    columns (the first of tied ones), margins, counts and best scores, over several blocks; the
    copy is made again for other outputs handed the same buffers.  (float16 and float64
    outputs with float32 values: the passes read float32.)"""
    n = 5000
    monkeypatch.setattr(otl_scale, "_newton_block", lambda k, device=None: 1024)   # 4 whole blocks and a short one
    O = dominant(n, k, 43)
    for rows in (slice(0, 50), slice(2100, 2150), slice(4990, 5000)):
        O[rows, 3] = O[rows, 7] = O[rows].amax(1) + 1          # two columns tied at the max
    O = O.to(dtype)
    O2 = dominant(n, k, 45).to(dtype)
    T = torch.randn(k, generator=gen(44), dtype=torch.float64) * 0.1
    T[7] = T[3]
    gpu = lambda device: True     # noqa: E731  (a GPU's passes: max with its column, a scatter)
    ways = [{}, {"_NP_PASS": 0}, {"_T_K": 0}, {"_T_K": 0, "_T_K_CPU": 0},
            {"_launch_bound": gpu, "_NP_PASS": 0}, {"_launch_bound": gpu, "_NP_PASS": 0, "_T_K": 0}]
    for way in ways:
        with monkeypatch.context() as mp:
            for name, value in way.items():
                mp.setattr(otl_scale, name, value)
            bufs = otl_scale._newton_bufs(n, k, O.device)
            for X in (O, O2, O):
                got = otl_scale._newton_counts(X, T, out=bufs)
                for a, b in zip(got, _counts_reference(X, T)):
                    assert torch.equal(a, b), way
            tied = torch.zeros(n, dtype=torch.bool)
            tied[:50] = tied[2100:2150] = tied[4990:] = True
            assert (got[0][tied] == 3).all() and (got[1][tied] == 0).all()
            assert got[1][~tied].min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_kn_copy_is_the_transpose_in_float32(dtype):
    """_kn_copy (the passes' k x N copy, on the host in blocks of rows): X.T in float32,
    contiguous, to the bit, over several blocks and a short last one, on strided rows (a
    sample's) and on columns cut from wider outputs."""
    O = torch.randn(5000, 300, generator=gen(90)).to(dtype)   # 1,024 rows a block at k = 300
    for X in (O, O[::3], O[:, 5:12], O[:1]):
        got = otl_scale._kn_copy(X)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, X.T.to(torch.float32))


@pytest.mark.parametrize("k, numpy_solve", [(12, True), (50, True), (64, True), (100, False)])
def test_newton_step_solves_in_numpy_up_to_k_64(monkeypatch, k, numpy_solve):
    """The Newton step's k x k solve runs in numpy up to k = _NP_SOLVE_K = 64 (above, numpy's
    BLAS starts threads that slow torch's next operations), with torch's solve's step there
    (to float64's rounding), and where the rows are read through numpy views (k <= _T_K) the
    same step as through torch's operations."""
    n = 6000
    O = dominant(n, k, 91)
    T = torch.randn(k, generator=gen(92), dtype=torch.float64) * 0.1
    at = otl_scale._newton_counts(O, T)
    e = at[2].to(torch.float64) - otl.even_target(n, k)
    calls = []
    solve = otl_scale.np.linalg.solve

    def counted(*a):
        calls.append(a[0].shape)
        return solve(*a)
    monkeypatch.setattr(otl_scale.np.linalg, "solve", counted)
    d = otl_scale._newton_step(O, T, at, e, 0.05)
    assert bool(calls) == numpy_solve and all(c == (k, k) for c in calls)
    with monkeypatch.context() as mp:
        mp.setattr(otl_scale, "_NP_SOLVE_K", 0)
        ref = otl_scale._newton_step(O, T, at, e, 0.05)
    assert torch.allclose(d, ref, rtol=1e-9, atol=1e-12) and d.abs().max() > 0
    if otl_scale._on_numpy(O, k):     # (above _T_K the step reads through torch either way)
        with monkeypatch.context() as mp:
            mp.setattr(otl_scale, "_on_numpy", lambda X, k: False)
            assert torch.equal(otl_scale._newton_step(O, T, at, e, 0.05), d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_newton_step_numpy_and_torch_agree(monkeypatch, dtype):
    """The Newton step's rows near a boundary on numpy views (k <= _T_K, on the host) and on
    torch's operations: the same step to the bit, also on strided rows (a sample's)."""
    n, k = 6000, 12
    O = dominant(n, k, 46).to(dtype)
    T = torch.randn(k, generator=gen(47), dtype=torch.float64) * 0.1
    target = otl.even_target(n, k)
    for X in (O, O[::3]):
        at = otl_scale._newton_counts(X, T)
        e = at[2].to(torch.float64) - target * (X.shape[0] / n)
        d = otl_scale._newton_step(X, T, at, e, 0.05)
        with monkeypatch.context() as mp:
            mp.setattr(otl_scale, "_on_numpy", lambda X, k: False)
            assert torch.equal(otl_scale._newton_step(X, T, at, e, 0.05), d)
        assert d.abs().max() > 0


def test_join_costs_and_their_order_statistics_on_numpy_match_torch(monkeypatch):
    """_join_costs (what each row gives up to join a cluster; inf on its own rows), its rows'
    kth smallest values (_kth_smallest) and their m smallest rows (_smallest): numpy's steps
    on the host and torch's give the same values and rows, float16 / float64 outputs read as
    float32, with or without a pass's scratch; and the definition's values."""
    n, k = 3000, 30
    g = gen(52)
    O = torch.randn(n, k, generator=g)
    T = torch.randn(k, generator=g, dtype=torch.float64) * 0.1
    at = otl_scale._newton_counts(O, T)
    lab, best = at[0], at[3]
    cols = torch.tensor([4, 0, 17, 29])
    kth = torch.tensor([0, 5, 2999 - int((lab == 17).sum()), 40])
    m = torch.tensor([1, 7, n, 300])
    S = O.to(torch.float32) - T.to(torch.float32)
    ref = best[None, :] - S[:, cols].T
    ref[lab[None, :] == cols[:, None]] = math.inf
    for dtype in (torch.float32, torch.float16, torch.float64):
        X = O.to(dtype)
        got = []
        for numpy_steps in (True, False):
            with monkeypatch.context() as mp:
                if not numpy_steps:
                    mp.setattr(otl_scale, "np", None)
                G = otl_scale._join_costs(X, T.to(torch.float32), lab, best, cols)
                got.append((torch.as_tensor(G), otl_scale._kth_smallest(G, kth),
                            otl_scale._smallest(G, m)))
                # through a pass's scratch (its k x N copy of X, its block of scores): the
                # same values, written into that block; a block too small, or a copy of
                # other outputs, is not used
                bufs = otl_scale._newton_bufs(n, k, X.device)
                otl_scale._newton_counts(X, T, out=bufs)
                V, _, keep = bufs[3]
                assert keep["of"] is X
                Gs = otl_scale._join_costs(X, T.to(torch.float32), lab, best, cols, bufs[3])
                assert torch.equal(torch.as_tensor(Gs), got[-1][0])
                assert torch.as_tensor(Gs).data_ptr() == V.data_ptr()
                small = (V[:10], bufs[3][1], keep)
                Gt = otl_scale._join_costs(X, T.to(torch.float32), lab, best, cols, small)
                assert torch.equal(torch.as_tensor(Gt), got[-1][0])
                other = otl_scale._newton_bufs(n, k, X.device)
                otl_scale._newton_counts(X + 1, T, out=other)
                Go = otl_scale._join_costs(X, T.to(torch.float32), lab, best, cols, other[3])
                assert torch.equal(torch.as_tensor(Go), got[-1][0])
        (Ga, ka, sa), (Gb, kb, sb) = got
        assert torch.equal(Ga, Gb) and torch.equal(ka, kb) and ka.dtype == torch.float64
        if dtype == torch.float32:
            assert torch.equal(Ga, ref)
        assert torch.equal(ka, Ga.sort(1).values.gather(1, kth[:, None])[:, 0].double())
        assert sa.numel() == sb.numel() == int(m.sum())
        ends = torch.cumsum(m, 0) - m
        for i in range(len(cols)):
            a, b = sa[ends[i]:ends[i] + m[i]], sb[ends[i]:ends[i] + m[i]]
            assert torch.equal(a.sort().values, b.sort().values)
            assert torch.equal(Ga[i, a].sort().values, Ga[i].sort().values[:int(m[i])])


@pytest.mark.parametrize("own", [397, 800])
def test_newton_step_on_an_isolated_cluster_numpy_and_torch_agree(monkeypatch, own):
    """A Newton step that shifts a cluster far from every boundary alone (isolated outputs: an
    under-full one down past its cheapest joiners, as many as it lacks; an over-full one up
    past as many of its rows' margins as it has too many): the same step with numpy's steps
    (k-vectors, join costs, margins) and with torch's (numpy absent), with or without a pass's
    scratch, to the bit, the definition's shift."""
    O = isolated(0, own=own)
    n, k = O.shape
    T = torch.zeros(k, dtype=torch.float64)
    at = otl_scale._newton_counts(O, T)
    e = at[2].to(torch.float64) - otl.even_target(n, k)
    assert (e[0] < -1) if own < n / k else (e[0] > 1)   # none near cluster 0's boundary
    d = otl_scale._newton_step(O, T, at, e, 0.05)
    bufs = otl_scale._newton_bufs(n, k, O.device)
    otl_scale._newton_counts(O, T, out=bufs)      # (the scratch with its k x N copy of O)
    assert torch.equal(otl_scale._newton_step(O, T, at, e, 0.05, bufs[3]), d)
    with monkeypatch.context() as mp:
        mp.setattr(otl_scale, "np", None)
        assert torch.equal(otl_scale._newton_step(O, T, at, e, 0.05), d)
        bufs = otl_scale._newton_bufs(n, k, O.device)
        otl_scale._newton_counts(O, T, out=bufs)
        assert torch.equal(otl_scale._newton_step(O, T, at, e, 0.05, bufs[3]), d)
    lab, best = at[0], at[3]
    if e[0] < 0:
        cost = (best - (O[:, 0] - T[0]).to(torch.float32))[lab != 0].sort().values
        assert float(d[0]) == -float(cost[int(-e[0])])
    else:   # T_0 up to its (e_0 + 1)-th smallest margin: e_0 of its rows then leave
        assert float(d[0]) == float(at[1][lab == 0].sort().values[int(e[0])])


def test_small_helpers_on_numpy_match_torch():
    """_count_bounds, _std_max and _tie_scale's numpy and Python steps give torch's values."""
    for t in (otl.even_target(21_600, 10), otl.even_target(50_000, 128),
              otl.uneven_target(1000, 7, 0.5), otl.uneven_target(5000, 300, 1.0)):
        lo, hi = otl._count_bounds(t)
        assert lo.dtype == hi.dtype == torch.int64
        assert torch.equal(lo, (t + 1e-9).floor().long()) and torch.equal(hi, (t - 1e-9).ceil().long())
        n = int(round(float(t.sum())))
        worst = torch.zeros_like(t)
        worst[int(torch.argmin(t))] = n
        assert otl._std_max(t, n) == max(otl._std(worst, t), 1e-12)
    for k in (10, 40):          # numpy's steps up to k = 16, torch's above
        H = torch.randn(8192, k, generator=gen(51)) * 3
        assert otl_scale._tie_scale(H, 2.0 ** -26) == 2.0 ** -26 * float(H.abs().amax(1).median())


def test_median0_on_numpy_is_torchs_median():
    """_median0 by numpy's partition: torch's median (the lower middle value) per column, the
    input left as it was."""
    for A in (torch.randn(8191, 7, generator=gen(48)), torch.randn(64, 3, dtype=torch.float64),
              torch.randn(101, generator=gen(49)), torch.randn(6, 1, generator=gen(50))):
        before = A.clone()
        assert torch.equal(otl_scale._median0(A), A.median(dim=0).values)
        assert torch.equal(A, before)


@pytest.mark.parametrize("k", [2, 20])
def test_dense_path_targets_with_one_cluster_taking_almost_all(k):
    """Targets far from even (one cluster takes all rows, or all but one row each of the
    others): exact, on real-like outputs."""
    n = 64 * k * 4
    O = dominant(n, k, 33)
    for fill in (1, 0):
        target = torch.full((k,), float(fill), dtype=torch.float64)
        target[0] = n - fill * (k - 1)
        r = exact(O, target=target)
        assert (r.counts.double() - target).abs().max() == 0
        check_translation(O, r)


def test_dense_path_leaves_what_it_cannot_do_to_the_streaming_path(monkeypatch):
    """Collapsed rows (every row the same output: Newton steps cannot separate them) fall back
    and balance there; bad values and a bad start get the streaming path's errors."""
    calls = _dense_spy(monkeypatch)
    O = torch.randn(1, 20, generator=gen(24)).expand(10_000, 20).contiguous()
    r = exact(O)
    assert calls[-1] == (False, [])
    check_even(r)
    check_translation(O, r)
    bad = torch.randn(10_000, 20, generator=gen(25))
    bad[7_777, 3] = float("nan")
    with pytest.raises(ValueError, match="7777"):
        exact(bad)
    late = torch.randn(70_000, 10, generator=gen(25))     # past the first 65,536-row block
    late[69_999, 0] = float("inf")
    with pytest.raises(ValueError, match="69999"):
        exact(late)
    with pytest.raises(ValueError, match="start must be k = 20"):
        exact(torch.randn(10_000, 20, generator=gen(26)), start=torch.zeros(19))


def test_dense_path_from_a_start():
    """start= (another view's T): the dense path from there, as balanced, the same labels."""
    n, k = 20_000, 50
    g = gen(27)
    O = dominant(n, k, 28)
    other = O + 0.05 * torch.randn(O.shape, generator=g)
    warm = exact(O, start=exact(other).T)
    check_even(warm)
    check_translation(O, warm)
    assert torch.equal(warm.labels, exact(O).labels)


def _newton_spy(monkeypatch, force_span_max=None):
    """Records (rows, escaped) of each _newton_T call; force_span_max replaces the span_max of
    the calls on the rows near a boundary."""
    calls, newton = [], otl_scale._newton_T

    def spy(X, *a, **kw):
        if force_span_max is not None and "span_max" in kw:
            kw["span_max"] = force_span_max
        out = newton(X, *a, **kw)
        calls.append((X.shape[0], out[4]))
        return out

    monkeypatch.setattr(otl_scale, "_newton_T", spy)
    return calls


def test_dense_path_newton_steps_on_the_rows_near_a_boundary(monkeypatch):
    """Once T can cross at most half of the rows, the Newton steps go on with the rows near a
    boundary only (the others keep their column); still exact, and (N / k whole) the
    streaming path's labels."""
    n, k = 20_000, 50
    O = dominant(n, k, 31)
    calls = _newton_spy(monkeypatch)
    r = exact(O)
    assert calls[0][0] == n and any(rows < n / 2 for rows, _ in calls)
    assert not any(esc for _, esc in calls)
    check_even(r)
    check_translation(O, r)
    assert torch.equal(r.labels, exact(O, dense=False).labels)


def test_dense_path_steps_that_would_cross_the_rows_left_out_go_back_to_all_rows(monkeypatch):
    """A Newton step on the rows near a boundary that would move T by more than their margin
    allows is not taken there (escaped): the steps go on with all rows; still exact."""
    n, k = 20_000, 50
    O = dominant(n, k, 31)
    calls = _newton_spy(monkeypatch, force_span_max=0.0)
    r = exact(O)
    assert any(esc and rows < n for rows, esc in calls)
    i = next(i for i, (rows, esc) in enumerate(calls) if esc)
    assert calls[i + 1][0] == n            # the next steps read all rows
    check_even(r)
    check_translation(O, r)
    assert torch.equal(r.labels, exact(O, dense=False).labels)


def collapsed(n, k, seed, protos=3, noise=0.5):
    """Outputs of a network collapsing onto a few clusters: every row near one of `protos`
    prototypes, so that at the column medians more than half of the rows must move."""
    g = gen(seed)
    P = torch.randn(protos, 64, generator=g)
    F = P[torch.randint(0, protos, (n,), generator=g)] + noise * torch.randn(n, 64, generator=g)
    return (F @ (torch.randn(64, k, generator=g) / 8)).float()


def test_dense_path_collapsed_outputs_take_their_first_steps_on_every_4th_row(monkeypatch):
    """2 x 8,192 <= N < 4 x 8,192 and more than half of the rows to move at the start: the
    first steps run on every 4th row (larger inputs take theirs on a sample anyway); on
    outputs not collapsed, all rows from the start.  Exact, the streaming path's labels."""
    n, k = 20_000, 50
    assert otl_scale._COLLAPSE_EVERY == 4
    for O, sampled in ((collapsed(n, k, 34), True), (dominant(n, k, 34), False)):
        calls = _newton_spy(monkeypatch)
        r = exact(O)
        rows = [r for r, _ in calls]        # a first pass over all rows tells which
        assert rows[0] == n and (rows[1] == n // 4) == sampled and rows[1 + sampled] == n
        check_even(r)
        check_translation(O, r)
        assert torch.equal(r.labels, exact(O, dense=False).labels)


def test_dense_path_collapsed_outputs_sample_steps_stop_at_the_samples_noise(monkeypatch):
    """The steps on every 4th row of collapsed outputs stop once sum |counts - target| there is
    within sqrt(rows k) (about what rows drawn at random are off by; below it they no longer
    help all rows), or after 8; then all rows, exact."""
    n, k = 20_000, 50
    O = collapsed(n, k, 35)
    seen, newton = [], otl_scale._newton_T

    def spy(X, T, target, max_steps, tol, **kw):
        kw.setdefault("errs", [])
        out = newton(X, T, target, max_steps, tol, **kw)
        seen.append((X.shape[0], tol, list(kw["errs"])))
        return out

    monkeypatch.setattr(otl_scale, "_newton_T", spy)
    r = exact(O)
    m = n // 4
    (rows, tol, errs), = [c for c in seen if c[0] == m]
    assert tol == max(0.005 * m, math.sqrt(m * k)) > 0.005 * m
    assert all(e > tol for e in errs[:-1]) and (errs[-1] <= tol or len(errs) == 9)
    assert len(errs) > 2        # (it took steps)
    check_even(r)
    check_translation(O, r)


def test_exact_finish_rounds_numpy_and_torch_agree(monkeypatch):
    """The exact finish's rounds keep their k-vectors on numpy where it is installed (many
    small steps cost less on numpy arrays):
    on outputs collapsing onto a few prototypes at k = 200, whose finish takes rounds on the
    list of cheap moves and on the k x k table both, the same labels and T as without numpy
    (and scipy, which needs it): exact and balanced either way."""
    O = collapsed(3000, 200, 2, protos=8, noise=0.05)
    seen = []
    for fn in ("_table_paths", "_shortest_paths"):
        real = getattr(otl_scale, fn)
        monkeypatch.setattr(otl_scale, fn, lambda *a, _f=real, _n=fn, **kw: seen.append(_n) or _f(*a, **kw))
    r = exact(O)
    assert {"_table_paths", "_shortest_paths"} <= set(seen)
    with monkeypatch.context() as mp:
        mp.setattr(otl_scale, "np", None)
        mp.setattr(otl_scale, "_SCIPY", False)
        r2 = exact(O)
    assert torch.equal(r.labels, r2.labels) and torch.equal(r.T, r2.T)
    check_even(r)
    check_translation(O, r)


def isolated(seed, n=20_000, k=50, own=397):
    """Outputs where cluster 0 wins only its `own` rows (6 against N(0, 1) elsewhere) and every
    other row scores about -6 there: the rows that must join it to fill it lie far from any
    boundary."""
    g = gen(seed)
    O = torch.randn(n, k, generator=g)
    O[:, 0] = -6 + 0.5 * torch.randn(n, generator=g)
    O[:own, 0] = 6
    return O


def isolated_at_zero():
    """isolated(0), T = 0, its _newton_counts and the margin R of its 2 % of rows nearest a
    boundary."""
    O = isolated(0)
    T = torch.zeros(O.shape[1], dtype=torch.float64)
    at = otl_scale._newton_counts(O, T)
    return O, T, at, float(at[1].kthvalue(O.shape[0] // 50).values)


def test_joiners_adds_the_rows_nearest_to_joining_a_cluster_short_of_rows():
    """_joiners: cluster 0 needs 3 more rows than the rows near a boundary give it, none of
    which is near it: the 2 x 3 + 8 rows of other clusters nearest to joining it are added, and
    the counts of the rows left out follow; rows near no short cluster's boundary are not."""
    O, T, at, R = isolated_at_zero()
    n, k = O.shape
    lab, margin = at[0], at[1]
    B = (margin <= R).nonzero()[:, 0]
    ic = torch.bincount(lab, minlength=k) - torch.bincount(lab[B], minlength=k)
    target = torch.full((k,), n // k, dtype=torch.int64)
    assert int((lab[B] == 0).sum()) == 0 and int(ic[0]) == 397     # cluster 0: 3 short, far
    B2, ic2 = otl_scale._joiners(O, T, at, B, ic, target, R)
    assert torch.equal(B2, B2.unique()) and set(B.tolist()) <= set(B2.tolist())
    out = torch.ones(n, dtype=torch.bool)
    out[B2] = False
    assert torch.equal(ic2, torch.bincount(lab[out], minlength=k))
    d = target - ic - torch.bincount(lab[B], minlength=k)         # rows each cluster needs
    nearest = {}
    for j in (d >= 1).nonzero()[:, 0].tolist():
        gap = at[3] - O[:, j]
        gap[lab == j] = math.inf
        nearest[j] = set(gap.topk(2 * int(d[j]) + 8, largest=False).indices.tolist())
    assert nearest[0] <= set(B2.tolist())
    assert set(B2.tolist()) - set(B.tolist()) <= set().union(*nearest.values())
    everything = torch.arange(n)                                  # all rows in B: nothing to add
    B3, ic3 = otl_scale._joiners(O, T, at, everything, torch.zeros(k, dtype=torch.int64), target, R)
    assert torch.equal(B3, everything) and not ic3.any()


def test_near_rows_and_joiners_numpy_and_torch_agree(monkeypatch):
    """_near_rows and _joiners on numpy views and on torch's operations: the same rows and
    counts, with rows a try found to matter, a cluster the others would overfill, and a
    cluster short of rows near it (isolated outputs)."""
    O, T, at, R = isolated_at_zero()
    n, k = O.shape
    lab, margin = at[0], at[1]
    target = otl.even_target(n, k)
    lo, hi = otl._count_bounds(target)
    cases = [(torch.zeros(k, dtype=torch.int64), hi, None),
             (torch.zeros(k, dtype=torch.int64), hi, torch.arange(0, n, 97)),
             (torch.bincount(lab, minlength=k) // 2, hi - 5, None)]      # others overfill
    def both():
        got = [otl_scale._near_rows(lab, margin, R, c, h, must) for c, h, must in cases]
        B, ic = got[0]
        return got, otl_scale._joiners(O, T, at, B, ic, target, R), otl_scale._joiners(
            O, T, at, torch.arange(n), torch.zeros(k, dtype=torch.int64), target, R)
    a = both()
    with monkeypatch.context() as mp:
        mp.setattr(otl_scale, "np", None)
        b = both()
    assert a[0][2] is not None and a[1][0].numel() > a[0][0][0].numel()   # the cases happened
    for x, y in zip(a[0] + [a[1], a[2]], b[0] + [b[1], b[2]]):
        assert (x is None) == (y is None)
        if x is not None:
            assert all(torch.equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("seed", [0, 2])
def test_dense_path_solves_once_with_the_rows_that_join_a_far_cluster(monkeypatch, seed):
    """On outputs where a cluster's joiners are far from every boundary (isolated), the rows
    solved include them from the first try: one solve (without _joiners: two), exact, the
    streaming path's labels."""
    O = isolated(seed)
    solves = _solver_spy(monkeypatch)
    r = exact(O)
    assert len(solves) == 1
    check_even(r)
    check_translation(O, r)
    assert torch.equal(r.labels, exact(O, dense=False).labels)
    solves.clear()
    monkeypatch.setattr(otl_scale, "_joiners", lambda X, T, at, B, ic, target, R, scratch=None: (B, ic))
    assert torch.equal(exact(O).labels, r.labels) and len(solves) == 2


@pytest.mark.parametrize("at_once", [False, True])
def test_finish_on_whole_rows_takes_the_table_without_listing_every_move(monkeypatch, at_once):
    """When the finish's radius grows to inf on whole rows (one process), it builds the k x k
    table of cheapest moves straight away: no list of all rows' k - 1 moves first; exact.  At
    k > _TABLE_AT_ONCE (at_once: the threshold lowered to 0) it lists no moves at all."""
    if at_once:
        monkeypatch.setattr(otl_scale, "_TABLE_AT_ONCE", 0)
    taus, tables = [], []
    pairs, table = otl_scale._ExactSolver._pairs, otl_scale._ExactSolver._edge_table
    monkeypatch.setattr(otl_scale._ExactSolver, "_pairs",
                        lambda self, rows, tau: (taus.append(tau), pairs(self, rows, tau))[1])
    monkeypatch.setattr(otl_scale._ExactSolver, "_edge_table", lambda self, W, arg, clusters=None: (
        tables.append(clusters is None and self.vals.shape[1] == self.k),
        table(self, W, arg, clusters))[1])
    O = isolated(0)
    r = exact(O)
    assert any(tables) and not any(math.isinf(t) for t in taus)
    assert not taus if at_once else taus
    check_even(r)
    check_translation(O, r)


@pytest.mark.parametrize("sparse", [True, False])
def test_table_finish_on_candidate_lists_sparse_or_dense(monkeypatch, sparse):
    """Candidate lists whose finish takes the k x k table search it on its finite entries'
    edges (_table_edges) where they are at most k * k / _TABLE_SPARSE, else on the table
    itself (_table_paths): both exact, the labels a translation's."""
    monkeypatch.setattr(otl_scale, "_TABLE_SPARSE", 0 if sparse else 10 ** 9)
    used = []
    edges, paths = otl_scale._ExactSolver._table_edges, otl_scale._table_paths
    monkeypatch.setattr(otl_scale._ExactSolver, "_table_edges",
                        lambda self, *a: used.append("sparse") or edges(self, *a))
    monkeypatch.setattr(otl_scale, "_table_paths", lambda *a: used.append("dense") or paths(*a))
    O = isolated(0, k=300)
    r = exact(O, dense=False)
    assert used and set(used) == {"sparse" if sparse else "dense"}
    check_even(r)
    check_translation(O, r)


@pytest.mark.parametrize("tau0", [0.01, math.inf])
def test_exact_solver_on_whole_rows_in_order_equals_it_on_shuffled_columns(tau0):
    """Whole rows with their columns in order (the dense path's solve) take the solver's
    shortcuts (the own column is the label; the k x k table filled by row): the same labels and
    translation as on the same rows with each row's columns shuffled; tau0 = inf builds the
    table at once, 0.01 lists the cheap moves first."""
    n, k = 3000, 70
    O = dominant(n, k, 48).double()
    perm = torch.stack([torch.randperm(k, generator=gen(49 + i)) for i in range(n)])
    t = otl.even_target(n, k)
    got = []
    for vals, cols in ((O, torch.arange(k).expand(n, k)), (O.gather(1, perm), perm)):
        solver = otl_scale._ExactSolver(vals.clone(), cols.to(torch.int16).contiguous(),
                                  torch.full((n,), -math.inf, dtype=torch.float64), k, t,
                                  t.floor().long(), t.ceil().long(), otl_scale._Comm(False), 1024,
                                  torch.arange(n))
        assert solver.natural == (vals is O)
        assert solver.run(200, [], tau0)
        solver.strictify()      # (moved rows sit on ties until then)
        got.append((solver.labels.clone(), solver.dT.clone(), solver.phases))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][2] > 0        # the finish ran
    counts = torch.bincount(got[0][0], minlength=k)
    assert int(counts.max() - counts.min()) <= 1
    assert torch.equal(got[0][0], (O - got[0][1]).argmax(1))


def test_shed_step_moves_exactly_the_excess_out_of_each_over_full_cluster():
    n, k = 20_000, 50
    O = dominant(n, k, 32)
    target = otl.even_target(n, k).double()
    T = O[:8192].median(dim=0).values.double()
    at = otl_scale._newton_counts(O, T)
    e = at[2].double() - target
    d = otl_scale._shed_step(at, e)
    over = e >= 1
    assert over.any() and (d[~over] == 0).all() and (d[over] > 0).all()
    lab, margin = at[0], at[1]
    for j in over.nonzero()[:, 0].tolist():     # its excess lies below its rise, alone
        assert int((margin[lab == j] < d[j]).sum()) == int(e[j])
    new = otl_scale._newton_counts(O, T + d)
    left = lab != new[0]
    assert not (left & ~over[lab]).any()        # T rose for over-full clusters only
    assert int(left.sum()) <= int(e.clamp(min=0).floor().sum())   # (a runner-up rising too keeps some)
    assert float((new[2].double() - target).abs().sum()) < float(e.abs().sum())
    # no cluster can shed (all at or under the target): None
    assert otl_scale._shed_step(at, torch.zeros(k, dtype=torch.float64) - 1) is None


def test_newton_T_sheds_where_the_newton_step_does_not_help(monkeypatch):
    """A Newton step that does not lower sum |counts - target| is followed in the same step
    by a round of shedding (here every Newton step is useless: only shedding moves T)."""
    n, k = 20_000, 50
    O = dominant(n, k, 32)
    target = otl.even_target(n, k).double()
    T0 = O[:8192].median(dim=0).values.double()
    monkeypatch.setattr(otl_scale, "_newton_step", lambda X, T, at, e, frac, scratch=None: torch.zeros_like(T))
    errs = []
    T, e, at, passes, escaped = otl_scale._newton_T(O, T0, target, 6, 0.0, errs=errs)
    assert len(errs) >= 4 and all(b < a for a, b in zip(errs, errs[1:]))
    assert (T >= T0).all()          # shedding only raises T
    assert torch.equal(at[0], (O - T.float()).argmax(1))


def test_newton_step_past_span_max_is_not_taken():
    n, k = 20_000, 50
    O = dominant(n, k, 31)
    target = otl.even_target(n, k).double()
    T0 = O[:8192].median(dim=0).values.double()
    T, e, at, passes, escaped = otl_scale._newton_T(O, T0, target, 8, 0.0, span_max=1e-9)
    assert escaped and passes == 1 and torch.equal(T, T0)
    assert torch.equal(at[0], (O - T0.float()).argmax(1))
    assert float(e.abs().sum()) == float((at[2].double() - target).abs().sum())
    # from the state it returned (no first pass), without the bound: steps are taken
    T2, _, _, passes2, escaped2 = otl_scale._newton_T(O, T, target, 1, 0.0, at=at)
    assert not escaped2 and passes2 >= 1 and not torch.equal(T2, T0)


def test_newton_steps_bring_the_counts_near_the_target():
    """The dense path's start: on crowded outputs (k = 128; some clusters far from every other,
    which take the shift that balances them alone) each accepted step lowers sum |counts -
    target| and eight steps remove almost all of it; the float32 labels it returns are the
    argmax at its T."""
    n, k = 19_968, 128
    O = dominant(n, k, 21)
    target = otl.even_target(n, k).double()
    T0 = O[:8192].median(dim=0).values.double()
    errs = []
    T, e, at, passes, escaped = otl_scale._newton_T(O, T0, target, 8, 0.0, errs=errs)
    lab, margin = at[0], at[1]
    assert not escaped
    assert all(b < a for a, b in zip(errs, errs[1:])) and len(errs) >= 4
    assert errs[-1] < 0.05 * errs[0]
    assert passes >= len(errs)
    assert float(e.abs().sum()) == errs[-1]
    S = O - T.float()
    assert torch.equal(lab, S.argmax(1)) and (margin >= 0).all()


def test_gap_after_float32_keys_match_the_stable_sorts():
    """_gap_after on float32 margins (one sort of cluster << 32 | bits) gives the values of the
    two stable argsorts it uses for float64 ones: zeros, ties, excess past a cluster's rows."""
    g = gen(46)
    for n, k in ((5000, 10), (20_000, 128), (300, 3)):
        m = torch.rand(n, generator=g)
        m[:50] = 0
        m[50:60] = m[60:70]
        lab = torch.randint(0, k, (n,), generator=g)
        excess = torch.randint(0, int(1.5 * n / k), (k,), generator=g)
        excess[0] = n
        a, b = otl_scale._gap_after(m, lab, excess, k)
        a64, b64 = otl_scale._gap_after(m.double(), lab, excess, k)
        assert torch.equal(a.double(), a64) and torch.equal(b.double(), b64)
        assert torch.isinf(b[0])                # the excess is not below the cluster's rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gap_after_numpy_sort_matches_torch_sorts_and_the_definition(monkeypatch, dtype):
    """On the host _gap_after sorts on numpy (_by_cluster_np: one sort of int64 keys, float64
    ranked by value first); the same values as its torch sorts (without numpy) and as sorting
    each cluster's margins alone: zeros, repeated values, inf, excess past a cluster's rows."""
    g = gen(63)
    n, k = 30_000, 500
    m = (torch.rand(n, generator=g, dtype=torch.float64) ** 3).to(dtype)
    m[::5] = 0.0
    m[1::3] = m[0]
    m[::17] = math.inf
    lab = torch.randint(0, k, (n,), generator=g)
    cnt = torch.bincount(lab, minlength=k)
    excess = torch.randint(0, 2 * n // k, (k,), generator=g)
    excess[:3] = cnt[:3]                                # all of their rows
    excess[3] = cnt[3] + 5                              # more than its rows
    ms = otl_scale._by_cluster_np(m.numpy(), lab.numpy())
    assert ms.dtype == m.numpy().dtype and ms.size == n
    for j in (0, 4, 77, 499):
        assert torch.equal(torch.from_numpy(ms[int(cnt[:j].sum()):int(cnt[:j + 1].sum())]),
                           torch.sort(m[lab == j]).values)
    a, b = otl_scale._gap_after(m, lab, excess, k)
    monkeypatch.setattr(otl_scale, "np", None)
    a0, b0 = otl_scale._gap_after(m, lab, excess, k)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert bool(torch.isinf(b[:4]).all())
    inside = ((excess >= 1) & (excess < cnt)).nonzero()[:, 0].tolist()
    assert len(inside) > 100
    for j in inside:
        mj, e = torch.sort(m[lab == j]).values, int(excess[j])
        assert float(a[j]) == float(mj[e - 1]) and float(b[j]) == float(mj[e])


@pytest.mark.parametrize("k", [10, 100])
def test_expanded_outputs_label_as_their_contiguous_copy(k):
    """Outputs handed as an expanded view (stride 0 over rows, every row alike: torch's median
    over such a view returns garbage, so the dense path's column medians read a contiguous
    copy of the first rows): the same labels and T as the same values laid out whole."""
    C = torch.randn(1, k, generator=gen(47)).expand(64 * k + 40, k)
    r = exact(C)
    check_even(r)
    ref = exact(C.contiguous())
    assert torch.equal(r.labels, ref.labels) and torch.equal(r.T, ref.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numpy_steps", [True, False])
def test_gap_after_few_clusters_as_many(monkeypatch, dtype, numpy_steps):
    """_gap_after for the clusters with excess > 0, up to 8 of them one cluster at a time (on
    numpy views where numpy is installed, else torch's topk), more by the sort of every row:
    each one's excess-th smallest margin and the next (inf where the excess takes all its
    rows), as sorting that cluster's margins gives, in the margins' dtype."""
    if not numpy_steps:
        monkeypatch.setattr(otl_scale, "np", None)
    g = gen(48)
    n, k = 4000, 20
    m = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    m[:40] = 0
    m[40:80] = m[80:120]                                  # repeated values
    lab = torch.randint(0, k, (n,), generator=g)
    cnt = torch.bincount(lab, minlength=k)
    for asked in (torch.tensor([1, 5, 7]), torch.arange(k)):
        excess = torch.zeros(k, dtype=torch.int64)
        excess[asked] = torch.randint(1, 60, (asked.numel(),), generator=g)
        excess[asked[0]] = cnt[asked[0]]                  # all of its rows
        a, b = otl_scale._gap_after(m, lab, excess, k)
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (k,)
        for j in asked.tolist():
            ms = torch.sort(m[lab == j]).values
            e = int(excess[j])
            assert float(a[j]) == float(ms[e - 1])
            assert float(b[j]) == (float(ms[e]) if e < ms.numel() else math.inf)


@pytest.mark.parametrize("k", [10, 256, 300, 3000])
def test_std_on_numpy_torch_and_python_floats_is_the_definition(monkeypatch, k):
    """_std_host (the exact labeler's): Python floats up to k = 256, numpy above (no torch
    operation: on a GPU each one is a launch or a host operation), _std
    without numpy.  _std (the published rules'): torch above k = 256, the bits they had."""
    g = gen(61)
    counts = torch.randint(0, 90, (k,), generator=g)
    target = torch.full((k,), 21_600 / k, dtype=torch.float64)
    want = math.sqrt(sum((float(c) - float(t)) ** 2 for c, t in zip(counts, target)) / k)
    assert otl_scale._std_host(counts, target) == pytest.approx(want, rel=1e-12)
    if k > 256:
        assert otl._std(counts, target) == (counts.double() - target).pow(2).mean().sqrt().item()
    monkeypatch.setattr(otl_scale, "np", None)
    assert otl_scale._std_host(counts, target) == otl._std(counts, target) == pytest.approx(want, rel=1e-12)


def test_top2_takes_the_first_of_tied_best_columns():
    S = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, -math.inf, 5.0, 4.0], [0.0, 1.0, 2.0, 7.0]],
                     dtype=torch.float64)
    best, arg, second = otl_scale._top2_(S.clone())
    assert arg[:, 0].tolist() == [1, 0, 3]
    assert best.tolist() == [3.0, 5.0, 7.0] and second.tolist() == [3.0, 5.0, 2.0]


def test_shed_midpoints_on_numpy_and_torch_agree(monkeypatch):
    """_midpoints (the auction's rises): numpy's and torch's the same to the bit, inf gaps just
    past a, clusters not over at 0."""
    g = gen(62)
    a = torch.rand(500, generator=g, dtype=torch.float64) * 3
    b = a + torch.rand(500, generator=g, dtype=torch.float64)
    b[::7] = math.inf
    a[::11] = 0.0
    over = torch.rand(500, generator=g) < 0.6
    got = otl_scale._midpoints(a, b, over)
    monkeypatch.setattr(otl_scale, "np", None)
    want = otl_scale._midpoints(a, b, over)
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    assert bool((got[~over] == 0).all())
    inf = over & torch.isinf(b)
    assert bool((got[inf] > a[inf]).all())
    mid = over & ~torch.isinf(b)
    assert torch.equal(got[mid], (a[mid] + b[mid]) / 2)


def test_sample_start_takes_every_8th_row_on_a_gpu(monkeypatch):
    """sample_start_T's default: every 4th row; on a GPU (otl_scale._launch_bound) every 8th where
    the rows are at least 8 k, else every 4th (at fewer than 8 k rows a sample of every 8th
    would be refused, and the call would start from the medians)."""
    O, small = _clustered(6000, 300, 44), _clustered(2000, 300, 45)
    assert torch.equal(otl_scale.sample_start_T(O), otl_scale.sample_start_T(O, every=4))
    monkeypatch.setattr(otl_scale, "_launch_bound", lambda device: True)
    T8 = otl_scale.sample_start_T(O)
    assert torch.equal(T8, otl_scale.sample_start_T(O, every=8))
    assert not torch.equal(T8, otl_scale.sample_start_T(O, every=4))
    assert otl_scale.sample_start_T(small, every=8) is None
    assert torch.equal(otl_scale.sample_start_T(small), otl_scale.sample_start_T(small, every=4))


# ------------------------------------------------------------------------------------------------
# the tuned labeler against otl.py's reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,x", [(6000, 10, 0), (6000, 50, 0), (5000, 100, 0), (6000, 20, 2),
                                   (6000, 300, 0), (3000, 1000, 0)])
def test_tuned_labeler_equals_the_reference(n, k, x):
    """Where the balanced assignment is unique (distinct outputs, whole targets) the tuned labeler
    and otl.py's reference give the same labels; both meet the target and both labellings are
    argmax(O - T) of their own T."""
    O = torch.randn(n, k, generator=gen(n + k)) + torch.linspace(0, 1, k)
    target = otl.uneven_target(n, k, x) if x else None
    ref, tuned = otl.translate(O, target=target), otl_scale.translate(O, target=target)
    want = otl.uneven_target(n, k, x) if x else torch.full((k,), n / k, dtype=torch.float64)
    for r in (ref, tuned):
        assert torch.equal(r.counts.double(), want)
        assert torch.equal((O.double() - r.T).argmax(1), r.labels)
    assert torch.equal(ref.labels, tuned.labels)


@pytest.mark.parametrize("n,k", [(4000, 300), (5001, 64), (2000, 7)])
def test_tuned_labeler_and_reference_within_one_on_fractional_targets(n, k):
    """N / k not whole: which clusters take the extra rows is not unique, so only the bounds
    are compared: every count of both within 1 of N / k."""
    O = torch.randn(n, k, generator=gen(n * k))
    for r in (otl.translate(O), otl_scale.translate(O)):
        assert int(r.counts.sum()) == n
        assert bool(((r.counts.double() - n / k).abs() < 1).all())


@pytest.mark.parametrize("scale", [1e-38, 1e-36])
@pytest.mark.parametrize("n,k", [(2000, 10), (2048, 128), (1200, 300)])
def test_tiny_outputs_labels_are_argmax_of_T(n, k, scale):
    """Outputs far below 1 (at 1e-38 many float32 values are subnormal) on each path: dense
    (k = 10), whole rows (k = 128), candidate lists (k = 300).  The problem does not change with
    the outputs' scale, so neither may the answer: labels argmax(O - T) under the tie rule, as
    otl.translate's, with no row off its argmax by more than the tie-break while ties_left says
    none is on a tie."""
    O = torch.randn(n, k, generator=gen(k)) * scale
    r, ref = otl_scale.translate(O), otl.translate(O)
    check_even(r)
    assert 0 <= r.ties_left <= r.active
    check_translation(O, r)
    assert torch.equal((O.double() - ref.T).argmax(1), ref.labels)
    assert torch.equal(r.labels, ref.labels)
