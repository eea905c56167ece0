"""Behavioural tests for otl.py through its public names (CPU only, small and fast); the tuned
labeler of otl_scale.py, against this reference, is in test_otl_scale.py."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import otl
from conftest import clusters, gen

torch.set_num_threads(1)

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs CUDA"))


def collapsed(n, k, seed=0):
    return torch.randn(1, k, generator=gen(seed)).expand(n, k)


def near_collapsed(n, k, seed=0, noise=1e-5):
    return collapsed(n, k, seed) + noise * torch.randn(n, k, generator=gen(seed + 1))


def even_std_max(n, k):
    # all N in one cluster, even target N/k: sqrt(((N - N/k)^2 + (k-1)(N/k)^2) / k)
    return n / k * math.sqrt(k - 1)


def pop_std(counts, target):
    return (counts.double() - target.double()).pow(2).mean().sqrt().item()


# ------------------------------------------------------------------------------------------------
# translate: the reference exact labeler (default) and Algorithm 1 as published
# ------------------------------------------------------------------------------------------------

SHAPES = [(5000, 50), (21600, 128)]
KINDS = {
    "random": lambda n, k: torch.randn(n, k, generator=gen(1)),
    "collapsed": lambda n, k: collapsed(n, k, seed=2),
    "near_collapsed": lambda n, k: near_collapsed(n, k, seed=3),
}
METHODS = ["published", "exact"]
# max - min of the counts each method reaches on these inputs: the exact one the integer floor
# (N/k is whole here, so 0 ... 1), the published rules within a few images
SPREAD = {"published": 3, "exact": 1}
_CACHE = {}


def run_translate(kind, n, k, method):
    key = (kind, n, k, method)
    if key not in _CACHE:
        O = KINDS[kind](n, k)
        _CACHE[key] = (O, otl.translate(O, method=method))
    return _CACHE[key]


def assert_argmax(O, r, tol=1e-9):
    """Every label is a best cluster of O - T; rows not counted as tied are strictly in it."""
    Z = O.double() - r.T.to(O.device)
    own = Z.gather(1, r.labels[:, None].to(O.device)).squeeze(1)
    assert bool((own >= Z.max(1).values - tol).all())
    strict = Z.argmax(1) == r.labels.to(O.device)
    assert int((~strict).sum()) <= r.ties_left


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_translate_balances(kind, n, k, method):
    O, r = run_translate(kind, n, k, method)
    assert r.std_max == pytest.approx(even_std_max(n, k), rel=1e-9)
    assert r.std < 0.01 * r.std_max
    assert int(r.counts.sum()) == n
    # close to the integer floor: every cluster within SPREAD images of the others
    assert int(r.counts.max() - r.counts.min()) <= SPREAD[method]
    assert (r.counts - n / k).abs().max().item() <= SPREAD[method]
    if method == "exact":
        assert r.stop_reason == "balanced"
        assert_argmax(O, r)
    # the reported std is the std of the returned counts
    assert r.std == pytest.approx(pop_std(r.counts, r.target), abs=1e-9)


def test_translate_default_method_is_the_trainers():
    import inspect

    import train_otl
    default = inspect.signature(otl.translate).parameters["method"].default
    assert default in METHODS
    assert train_otl.get_args_parser().get_default("labeler") == default


def test_exact_labels_are_strict_argmax_of_translated_outputs():
    # distinct outputs: every row strictly in its cluster, no row left tied
    for n, k in [(5000, 50), (3000, 7), (4000, 300)]:
        O = torch.randn(n, k, generator=gen(n + k))
        r = otl.translate(O)
        assert r.ties_left == 0
        assert torch.equal((O.double() - r.T).argmax(1), r.labels)
        assert int(r.counts.max() - r.counts.min()) <= 1


def test_exact_ties_between_equal_rows_are_counted():
    # equal rows cannot be told apart by any T: the counts are still balanced, every label is
    # one of the row's best clusters, and the rows left tied are counted
    n, k = 500, 10
    O = collapsed(n, k, seed=9)
    r = otl.translate(O)
    assert r.counts.tolist() == [n // k] * k
    assert r.ties_left > 0
    assert_argmax(O, r)
    # half equal rows, half random: the random half stays strict
    O = torch.cat([collapsed(n, k, seed=9), torch.randn(n, k, generator=gen(4))])
    r = otl.translate(O)
    assert int(r.counts.max() - r.counts.min()) <= 1
    assert_argmax(O, r)
    assert torch.equal((O[n:].double() - r.T).argmax(1), r.labels[n:])


@pytest.mark.parametrize("kind", ["random", "collapsed"])
def test_published_labels_are_argmax_of_translated_outputs(kind):
    n, k = SHAPES[0]
    O, r = run_translate(kind, n, k, "published")
    assert r.T.shape == (k,)
    assert r.labels.shape == (n,) and r.labels.dtype == torch.int64
    Z = O.double() - r.T
    top = Z.topk(2, dim=1).values
    gap = top[:, 0] - top[:, 1]
    # ties are broken by a perturbation of at most 1e-6 x the spread of O: outside it the
    # label is the argmax of O - T
    clear = gap > 1e-6 * (O.max() - O.min()).item()
    assert torch.equal(Z.argmax(1)[clear], r.labels[clear])
    if kind == "random":
        # on random outputs near-ties are rare: almost every row is decided by O - T alone
        assert clear.float().mean().item() > 0.99


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_translate_counts_are_bincount_of_labels(kind, method):
    n, k = SHAPES[0]
    _, r = run_translate(kind, n, k, method)
    assert r.counts.dtype == torch.int64
    assert torch.equal(r.counts, torch.bincount(r.labels, minlength=k))
    assert r.labels.min() >= 0 and r.labels.max() < k


@pytest.mark.parametrize("method", METHODS)
def test_translate_keeps_pairwise_differences(method):
    n, k = SHAPES[0]
    O, r = run_translate("random", n, k, method)
    O = O.double()[:300]
    Z = O - r.T  # the translation applies one k-vector to every row
    dO = O[:, None, :] - O[None, :, :]
    dZ = Z[:, None, :] - Z[None, :, :]
    torch.testing.assert_close(dZ, dO, rtol=0, atol=1e-9)
    torch.testing.assert_close(dZ.norm(dim=2), dO.norm(dim=2), rtol=0, atol=1e-9)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_translate_dtypes_and_device(dtype, device, method):
    n, k = 2000, 20
    O = torch.randn(n, k, generator=gen(5)).to(device=device, dtype=dtype)
    before = O.clone()
    r = otl.translate(O, method=method)
    assert torch.equal(O, before)  # input untouched
    assert r.labels.device.type == torch.device(device).type
    assert r.T.device.type == torch.device(device).type
    assert r.counts.device.type == torch.device(device).type
    assert r.T.dtype == torch.float64
    assert r.std < 0.01 * r.std_max
    assert int(r.counts.max() - r.counts.min()) <= SPREAD[method]
    Z = O.double() - r.T
    top = Z.topk(2, dim=1).values
    clear = (top[:, 0] - top[:, 1]) > 1e-6 * (O.max() - O.min()).item()
    assert torch.equal(Z.argmax(1)[clear], r.labels[clear])
    if method == "exact":
        assert_argmax(O, r)


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30, 1e300])
def test_exact_at_any_scale(scale):
    # the Newton steps' linear system and the ties' tolerance follow the outputs' scale, and
    # values beyond float32's range are approached in float64
    O = torch.randn(5000, 20, generator=gen(5), dtype=torch.float64) * scale
    r = otl.translate(O)
    assert r.counts.tolist() == [250] * 20 and r.ties_left == 0
    assert torch.equal((O - r.T).argmax(1), r.labels)


def test_exact_on_half_precision_ties():
    # bfloat16 outputs tie often: balanced, every label one of its row's best
    O = torch.randn(20000, 64, generator=gen(4)).bfloat16()
    r = otl.translate(O)
    assert int(r.counts.max() - r.counts.min()) <= 1
    assert_argmax(O, r)


def test_translate_does_not_modify_float64_input_without_jitter():
    O = torch.randn(500, 10, generator=gen(6), dtype=torch.float64)
    before = O.clone()
    otl.translate(O, tie_eps=0, method="published")
    otl.translate(O)
    assert torch.equal(O, before)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("x", [0.5, 1, 2])
def test_translate_uneven_target(x, method):
    n, k = 5000, 50
    target = otl.uneven_target(n, k, x)
    r = otl.translate(torch.randn(n, k, generator=gen(7)), target=target, method=method)
    assert torch.equal(r.target, target.double())
    # std_max: all N in the cluster with the smallest target
    worst = torch.zeros(k, dtype=torch.float64)
    worst[torch.argmin(target)] = n
    assert r.std_max == pytest.approx(pop_std(worst, target), rel=1e-9)
    assert r.std == pytest.approx(pop_std(r.counts, target), abs=1e-9)
    assert r.std < 0.01 * r.std_max
    if method == "exact":   # integer targets: met exactly
        assert torch.equal(r.counts.double(), target)
    # the counts follow the target's shape, not an even split
    even = otl.translate(torch.randn(n, k, generator=gen(7)), method=method)
    assert pop_std(r.counts, target) < pop_std(even.counts, target) / 10


def test_exact_fractional_target_within_one():
    # targets that are not whole: every count within 1 of its target (floor or ceil)
    n, k = 3001, 7
    target = torch.tensor([0.5, 1, 1.5, 2, 2.5, 3, 3.5], dtype=torch.float64)
    target = target / target.sum() * n
    r = otl.translate(torch.randn(n, k, generator=gen(17)), target=target)
    assert int(r.counts.sum()) == n
    assert bool(((r.counts.double() - target).abs() < 1).all())


@pytest.mark.parametrize("method", METHODS)
def test_translate_custom_target(method):
    n = 2000
    target = [100, 300, 600, 1000]  # a plain list is accepted
    r = otl.translate(torch.randn(n, 4, generator=gen(8)), target=target, method=method)
    assert r.target.tolist() == [float(t) for t in target]
    assert r.std < 0.01 * r.std_max
    assert (r.counts.double() - r.target).abs().max().item() <= (0 if method == "exact" else 0.01 * n)


def test_published_collapsed_without_tie_break_cannot_split():
    # the docstring: without the perturbation, identical rows stay identical whatever T is
    n, k = 500, 10
    r = otl.translate(collapsed(n, k, seed=9), tie_eps=0, method="published")
    assert int((r.counts > 0).sum()) == 1
    assert r.std == pytest.approx(r.std_max)


@pytest.mark.parametrize("method", METHODS)
def test_translate_small_problems(method):
    # few rows per cluster: still within a couple of images of the even split
    for n, k, seed in [(12, 12, 10), (30, 30, 11), (50, 10, 12), (7, 2, 13)]:
        for O in (torch.randn(n, k, generator=gen(seed)), collapsed(n, k, seed)):
            r = otl.translate(O, method=method)
            assert int(r.counts.sum()) == n
            bound = 1 if method == "exact" else 2
            assert int(r.counts.max() - r.counts.min()) <= bound, (n, k, seed, r.counts.tolist())


def test_translate_result_fields():
    n, k = 5000, 50
    r = otl.translate(torch.randn(n, k, generator=gen(1)), method="published")
    assert isinstance(r.iterations, int) and r.iterations >= 1
    assert isinstance(r.std_history, list)
    assert len(r.std_history) == r.iterations + 1  # initial std, then one per step tried
    # the first entry is the std of the starting point (max_iter=0 returns that point)
    r0 = otl.translate(torch.randn(n, k, generator=gen(1)), max_iter=0, method="published")
    assert r0.iterations == 0 and r0.std_history == [r0.std]
    assert r0.stop_reason == "max_iter"
    assert r.std_history[0] == pytest.approx(r0.std)
    # undone steps are worse, so the final std is the best one seen, and never above the start
    assert r.std == pytest.approx(min(r.std_history))
    assert r.std <= r.std_history[0]
    assert r.stop_reason in {"balanced", "alpha0", "patience", "max_iter"}
    assert r.seconds >= 0
    r3 = otl.translate(torch.randn(n, k, generator=gen(1)), max_iter=3, method="published")
    assert r3.iterations == 3 and len(r3.std_history) == 4 and r3.stop_reason == "max_iter"
    # the exact labeler: the std after each Newton step, then the final one
    e = otl.translate(torch.randn(n, k, generator=gen(1)))
    assert e.std_history[0] == pytest.approx(r0.std) and e.std_history[-1] == e.std
    assert e.iterations >= 1 and e.seconds >= 0


@pytest.mark.parametrize("method", METHODS)
def test_translate_balanced_stop_reason(method):
    # outputs whose argmax is already perfectly even (after the median start): nothing to do
    n, k = 600, 12
    O = 10 * F.one_hot(torch.arange(n) % k, k).float() + 0.01 * torch.randn(n, k, generator=gen(13))
    r = otl.translate(O, method=method)
    assert r.std == 0.0 and r.stop_reason == "balanced"
    assert r.iterations == 0 and r.std_history[0] == 0.0
    assert torch.equal(r.labels, torch.arange(n) % k)
    assert r.counts.tolist() == [n // k] * k


def test_exact_start_is_used():
    # from an earlier result's T the labeler has nothing left to do; a bad start is refused
    O = torch.randn(4000, 40, generator=gen(18))
    r = otl.translate(O)
    again = otl.translate(O, start=r.T)
    assert again.iterations <= 1 and torch.equal(again.labels, r.labels)
    with pytest.raises(ValueError, match="start"):
        otl.translate(O, start=torch.zeros(3))
    with pytest.raises(ValueError, match="start"):
        otl.translate(O, start=r.T, method="published")


def test_translate_deterministic():
    O = torch.randn(3000, 30, generator=gen(14))
    for method in METHODS:
        a, b = otl.translate(O, method=method), otl.translate(O.clone(), method=method)
        assert torch.equal(a.labels, b.labels) and torch.equal(a.T, b.T)
    # the published rules' tie-break on tied outputs: the seed decides
    C = collapsed(3000, 30, seed=15)
    a, b = (otl.translate(C, seed=3, method="published") for _ in range(2))
    assert torch.equal(a.labels, b.labels)
    c = otl.translate(C, seed=4, method="published")
    assert not torch.equal(a.labels, c.labels)


@pytest.mark.parametrize("make,match", [
    (lambda: torch.tensor([[0.0, float("nan")], [1.0, 2.0], [3.0, 4.0]]), "NaN"),
    (lambda: torch.tensor([[0.0, float("inf")], [1.0, 2.0], [3.0, 4.0]]), "infinite"),
    (lambda: torch.tensor([[0.0, 1.0], [1.0, -float("inf")]]), "infinite"),
    (lambda: torch.randn(10, 1), "k >= 2"),
    (lambda: torch.randn(3, 5), "N >= k"),
    (lambda: torch.randn(10), r"\(N, k\)"),
    (lambda: torch.randn(2, 3, 4), r"\(N, k\)"),
])
@pytest.mark.parametrize("method", METHODS)
def test_translate_bad_outputs(make, match, method):
    with pytest.raises(ValueError, match=match):
        otl.translate(make(), method=method)


@pytest.mark.parametrize("method", METHODS)
def test_translate_nan_message_names_rows(method):
    O = torch.randn(20, 4)
    O[7, 2] = float("nan")
    with pytest.raises(ValueError, match=r"1 rows.*\[7\]"):
        otl.translate(O, method=method)


def test_translate_bad_target_beta_and_method():
    O = torch.randn(100, 4, generator=gen(16))
    with pytest.raises(ValueError, match="sum to"):
        otl.translate(O, target=[10, 20, 30, 39])
    with pytest.raises(ValueError, match="entries"):
        otl.translate(O, target=[25, 25, 50])
    with pytest.raises(ValueError, match="non-negative"):
        otl.translate(O, target=[-10, 40, 35, 35])
    with pytest.raises(ValueError, match="finite"):
        otl.translate(O, target=[float("nan"), 40, 30, 30])
    for beta in (1.0, 0.5, 0.0, -2.0):
        with pytest.raises(ValueError, match="beta"):
            otl.translate(O, beta=beta, method="published")
    with pytest.raises(ValueError, match="published"):
        otl.translate(O, beta=2.0)          # a setting of the published rules only
    with pytest.raises(ValueError, match="method"):
        otl.translate(O, method="auction")


def test_translate_sinkhorn_is_sinkhorn_knopp_in_the_same_result():
    """method="sinkhorn": SeLa's labels in a TranslateResult like the other methods' (T = 0, the
    even target, counts = bincount of the labels, the std of those counts), so a caller switches
    labelers by name; a target or a start is refused, its own settings pass through."""
    O = torch.randn(3000, 20, generator=gen(17)) + torch.linspace(0, 1, 20)
    r = otl.translate(O, method="sinkhorn", lam=10.0)
    labels, _, iters = otl.sinkhorn_knopp(O, lam=10.0)
    assert torch.equal(r.labels, labels) and r.iterations == iters
    assert torch.equal(r.T, torch.zeros(20, dtype=torch.float64))
    assert torch.equal(r.counts, torch.bincount(labels, minlength=20))
    assert torch.equal(r.target, otl.even_target(3000, 20))
    assert r.std == pytest.approx(pop_std(r.counts, r.target), abs=1e-9)
    assert r.std_max == pytest.approx(even_std_max(3000, 20), rel=1e-9)
    with pytest.raises(ValueError, match="even target"):
        otl.translate(O, method="sinkhorn", target=otl.uneven_target(3000, 20, 1.0))
    with pytest.raises(ValueError, match="start"):
        otl.translate(O, method="sinkhorn", start=torch.zeros(20))
    with pytest.raises(TypeError):
        otl.translate(O, method="sinkhorn", beta=2.0)


def test_translation_steps_is_the_published_rules_loop():
    """The step loop on its own (otl_scale runs it on candidate lists): with the published
    rules' assign and range it gives translate_published's T, labels and history."""
    O = torch.randn(2000, 8, generator=gen(18)).double() + torch.linspace(0, 2, 8).double()
    ref = otl.translate_published(O, tie_eps=0, init="zero")
    target = otl.even_target(2000, 8)

    def assign(T):
        lab = (O - T).argmax(1)
        return lab, torch.bincount(lab, minlength=8)

    T0 = torch.zeros(8, dtype=torch.float64)
    lab, cnt = assign(T0)
    history = [otl.counts_std(cnt, target)]
    T, labels, counts, std, steps, reason = otl.translation_steps(
        assign, lambda T: ((O.max(0).values - T).max() - (O.min(0).values - T).min()).item(),
        T0, lab, cnt, target, otl.worst_std(target, 2000), history)
    assert torch.equal(T, ref.T) and torch.equal(labels, ref.labels)
    assert history == ref.std_history and steps == ref.iterations and reason == ref.stop_reason


# ------------------------------------------------------------------------------------------------
# uneven_target / even_target
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(5000, 50), (21600, 128), (1001, 7), (10, 10), (11, 2)])
@pytest.mark.parametrize("x", [0, 0.5, 1, 2, 3.7])
@pytest.mark.parametrize("first", [0, 1])
def test_uneven_target_properties(n, k, x, first):
    t = otl.uneven_target(n, k, x, first=first)
    assert t.shape == (k,)
    assert t.sum().item() == n
    assert torch.equal(t, t.round())
    assert (t >= 0).all()
    if x > 0:
        assert (t[1:] >= t[:-1]).all()
    # proportional to i**x up to rounding, i = first .. first + k - 1
    w = torch.arange(first, first + k, dtype=torch.float64) ** x
    assert (t - w / w.sum() * n).abs().max().item() < 1 + 1e-9
    if first == 0 and x > 0:
        assert t[0] == 0      # the paper's indexing: i = 0 gets no share


def test_uneven_target_default_is_the_papers_indexing():
    assert torch.equal(otl.uneven_target(5000, 50, 2), otl.uneven_target(5000, 50, 2, first=0))
    assert not torch.equal(otl.uneven_target(5000, 50, 2), otl.uneven_target(5000, 50, 2, first=1))
    # by hand for k = 3, x = 1: shares 0, 1/3, 2/3 of N = 300 (i = 0, 1, 2)
    assert otl.uneven_target(300, 3, 1).tolist() == [0.0, 100.0, 200.0]
    assert otl.uneven_target(300, 3, 1, first=1).tolist() == [50.0, 100.0, 150.0]


def test_uneven_target_is_uneven_and_x0_even():
    t = otl.uneven_target(1000, 7, 0)
    assert int(t.max() - t.min()) <= 1
    t = otl.uneven_target(5000, 50, 0)
    assert t.tolist() == [100.0] * 50
    t = otl.uneven_target(5000, 50, 1)
    assert t[-1] > 10 * t[0]
    t = otl.uneven_target(1000, 7, -1, first=1)
    assert (t[1:] <= t[:-1]).all() and t.sum().item() == 1000
    with pytest.raises(ValueError, match="use first=1"):
        otl.uneven_target(1000, 7, -1)
    with pytest.raises(ValueError, match="first must be a non-negative integer"):
        otl.uneven_target(1000, 7, 1, first=-1)


@pytest.mark.parametrize("n,k", [(10, 1), (5, 0), (3, 5)])
def test_uneven_target_errors(n, k):
    with pytest.raises(ValueError, match="k >= 2 and N >= k"):
        otl.uneven_target(n, k, 1.0)


def test_even_target():
    t = otl.even_target(1000, 7)
    assert t.dtype == torch.float64 and t.shape == (7,)
    assert t.sum().item() == pytest.approx(1000)
    assert torch.allclose(t, torch.full((7,), 1000 / 7, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------
# sinkhorn_knopp
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [0.0, 5.0])
def test_sinkhorn_marginals_and_labels(bias):
    """SeLa's scaling: the rows of Q sum to 1/N exactly (c is updated last), the columns to 1/k
    within the stopping rule's slack; the labels are the argmax of Q's rows."""
    n, k = 2000, 20
    O = torch.randn(n, k, generator=gen(20))
    O[:, 0] += bias
    labels, Q, iters = otl.sinkhorn_knopp(O)
    assert Q.shape == (n, k) and labels.shape == (n,) and Q.dtype == torch.float64
    assert isinstance(iters, int) and 1 <= iters <= 10000
    torch.testing.assert_close(Q.sum(1), torch.full((n,), 1 / n, dtype=Q.dtype), rtol=1e-9, atol=0)
    torch.testing.assert_close(Q.sum(0), torch.full((k,), 1 / k, dtype=Q.dtype), rtol=1e-2, atol=0)
    assert torch.equal(labels, Q.argmax(1))


def test_sinkhorn_stops_by_selas_rule_and_survives_underflow():
    """A tighter tol takes more iterations and evens the columns further; outputs so peaked that
    softmax(O)**25 underflows in whole columns still give finite scalings and every cluster used."""
    O = torch.randn(1000, 10, generator=gen(22))
    (_, Qa, ia), (_, Qb, ib) = otl.sinkhorn_knopp(O, tol=0.1), otl.sinkhorn_knopp(O, tol=1e-6)
    col = [(Q.sum(0) * 10 - 1).abs().max().item() for Q in (Qa, Qb)]
    assert ib > ia and col[1] < col[0]
    peaked = torch.randn(1000, 10, generator=gen(23)) * 50
    peaked[:, 3] -= 1000                            # no image near cluster 3: its column underflows
    labels, Q, _ = otl.sinkhorn_knopp(peaked)
    assert torch.isfinite(Q).all() and torch.bincount(labels, minlength=10).min() > 0


def test_sinkhorn_more_even_than_argmax_on_skewed_outputs():
    n, k = 2000, 20
    O = torch.randn(n, k, generator=gen(21))
    O[:, 3] += 5.0
    plain = torch.bincount(O.argmax(1), minlength=k).double()
    labels, _, _ = otl.sinkhorn_knopp(O)
    sk = torch.bincount(labels, minlength=k).double()
    assert plain[3] > 0.9 * n  # the skew really collapses plain argmax
    assert sk.std() < plain.std() / 20
    assert sk.max() < 2 * n / k


def test_sinkhorn_input_checks():
    with pytest.raises(ValueError):
        otl.sinkhorn_knopp(torch.randn(10))
    with pytest.raises(ValueError):
        otl.sinkhorn_knopp(torch.tensor([[float("nan"), 0.0], [0.0, 1.0]]))


# ------------------------------------------------------------------------------------------------
# lct_loss
# ------------------------------------------------------------------------------------------------

def hand_lct(logits, labels):
    V = logits.shape[0]
    total = 0.0
    for a in range(V):
        for b in range(V):
            total = total + F.cross_entropy(logits[b].float(), labels[a])
    return total / (V * V)


@pytest.mark.parametrize("V", [1, 2, 3])
def test_lct_loss_matches_hand_computation(V):
    B, k = 16, 7
    g = gen(30 + V)
    logits = torch.randn(V, B, k, generator=g) * 3
    labels = torch.randint(0, k, (V, B), generator=g)
    got = otl.lct_loss(logits, labels)
    torch.testing.assert_close(got, hand_lct(logits, labels), rtol=1e-5, atol=1e-6)
    plain = otl.lct_loss(logits, labels, consistent=False)
    own = sum(F.cross_entropy(logits[v], labels[v]) for v in range(V)) / V
    torch.testing.assert_close(plain, own, rtol=1e-5, atol=1e-6)
    if V == 1:
        torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-7)
    else:
        # views with different labels: the consistent loss really mixes views
        assert not torch.allclose(got, plain)
    # the paper's sum over view pairs: V^2 times the mean (V times for plain cross-entropy)
    summed = otl.lct_loss(logits, labels, reduction="sum")
    torch.testing.assert_close(summed, hand_lct(logits, labels) * V * V, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(otl.lct_loss(logits, labels, consistent=False, reduction="sum"),
                               own * V, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reduction must be"):
        otl.lct_loss(logits, labels, reduction="none")


def test_lct_loss_gradients_flow():
    V, B, k = 2, 8, 5
    logits = torch.randn(V, B, k, generator=gen(40), requires_grad=True)
    labels = torch.randint(0, k, (V, B), generator=gen(41))
    loss = otl.lct_loss(logits, labels)
    assert loss.dim() == 0 and loss.requires_grad
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    # d/dlogits of the mean of pairwise CE, by autograd on the hand version
    ref = logits.detach().clone().requires_grad_(True)
    hand_lct(ref, labels).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_lct_loss_half_precision_logits():
    logits = torch.randn(2, 8, 5, generator=gen(42)).half()
    labels = torch.randint(0, 5, (2, 8), generator=gen(43))
    got = otl.lct_loss(logits, labels)
    torch.testing.assert_close(got, hand_lct(logits.float(), labels), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("logit_shape,label_shape", [
    ((8, 5), (8,)),
    ((2, 8, 5), (8,)),
    ((2, 8, 5), (2, 7)),
    ((2, 8, 5), (3, 8)),
    ((2, 8, 5, 1), (2, 8)),
])
def test_lct_loss_shape_errors(logit_shape, label_shape):
    with pytest.raises(ValueError, match="logits"):
        otl.lct_loss(torch.randn(*logit_shape), torch.zeros(label_shape, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# discriminativeness measure
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts,ind,dis", [
    ((2, 1, 1), 1, 5),
    ((4,), 6, 0),
    ((1, 1, 1, 1), 0, 6),
    ((4, 0, 0), 6, 0),
])
def test_paper_examples(counts, ind, dis):
    assert otl.n_indistinguishable(counts) == ind
    assert otl.n_distinguishable(counts) == dis
    assert otl.n_indistinguishable(torch.tensor(counts)) == ind
    assert otl.n_distinguishable(list(counts)) == dis


def test_ind_plus_dis_is_all_pairs():
    g = gen(50)
    for _ in range(20):
        k = int(torch.randint(1, 200, (1,), generator=g))
        counts = torch.randint(0, 500, (k,), generator=g)
        n = int(counts.sum())
        ind, dis = otl.n_indistinguishable(counts), otl.n_distinguishable(counts)
        assert isinstance(ind, int) and isinstance(dis, int)
        assert ind + dis == n * (n - 1) // 2
        # brute force on the definition
        brute_ind = sum(int(c) * (int(c) - 1) // 2 for c in counts)
        assert ind == brute_ind


def test_even_split_maximises_distinguishable_pairs():
    n, k = 1000, 10
    even = otl.n_distinguishable([100] * 10)
    skew = otl.n_distinguishable(otl.uneven_target(n, k, 2).long())
    assert even > skew


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------

def small_cfg(**kw):
    kw.setdefault("k", 10)
    kw.setdefault("width", 16)
    kw.setdefault("small_stem", True)
    return otl.ModelConfig(**kw)


def test_build_model_default_width_logits_and_features():
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=12)).eval()
    assert model.feat_dim == 512
    x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=gen(60))
    with torch.no_grad():
        out_u8 = model(x)
        out_f = model(x.float() / 255)
        feats = model.features(x)
    assert out_u8.shape == (2, 12) and out_u8.dtype == torch.float32
    assert feats.shape == (2, 512)
    torch.testing.assert_close(out_u8, out_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.head(feats), out_u8, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [8, 16, 32])
@pytest.mark.parametrize("small_stem", [True, False])
def test_build_model_width_and_stem(width, small_stem):
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=7, width=width, small_stem=small_stem)).eval()
    assert model.feat_dim == 8 * width
    assert model.backbone.conv1.out_channels == width
    if small_stem:
        assert model.backbone.conv1.kernel_size == (3, 3) and model.backbone.conv1.stride == (1, 1)
        assert isinstance(model.backbone.maxpool, nn.Identity)
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=gen(61))
    with torch.no_grad():
        assert model(x).shape == (2, 7)
        assert model(x.float() / 255).shape == (2, 7)
        assert model.features(x).shape == (2, 8 * width)


def test_build_model_small_stem_default_width_at_32px():
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=5, small_stem=True)).eval()
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=gen(62))
    with torch.no_grad():
        assert model(x).shape == (2, 5)
        assert model.features(x).shape == (2, 512)


def test_build_model_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch"):
        otl.build_model(otl.ModelConfig(arch="vgg11"))


def test_model_normalisation_buffers_follow_config():
    model = otl.build_model(small_cfg(mean=(0.1, 0.2, 0.3), std=(0.5, 0.6, 0.7)))
    assert model.mean.flatten().tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert model.std.flatten().tolist() == pytest.approx([0.5, 0.6, 0.7])


# ------------------------------------------------------------------------------------------------
# batch_stats_mode
# ------------------------------------------------------------------------------------------------

def bn_state(model):
    return {name: b.clone() for name, b in model.named_buffers()
            if name.endswith(("running_mean", "running_var", "num_batches_tracked"))}


@pytest.mark.parametrize("start_training", [True, False])
def test_batch_stats_mode(start_training):
    torch.manual_seed(0)
    model = otl.build_model(small_cfg())
    model.train(start_training)
    x = torch.rand(8, 3, 32, 32, generator=gen(70))
    before = bn_state(model)
    assert len(before) > 0
    with torch.no_grad():
        eval_out = copy.deepcopy(model).eval()(x)
        train_out = copy.deepcopy(model).train()(x)
        with otl.batch_stats_mode(model) as m:
            assert m is model
            assert not model.training
            bns = [mod for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)]
            assert bns and all(b.training for b in bns)
            out = model(x)
    # batch statistics, not running statistics
    assert not torch.allclose(out, eval_out, atol=1e-3)
    torch.testing.assert_close(out, train_out, rtol=1e-4, atol=1e-5)
    after = bn_state(model)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert model.training == start_training
    assert all(m.training == start_training for m in model.modules())
    assert all(m.track_running_stats for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_batch_stats_mode_restores_on_error():
    model = otl.build_model(small_cfg()).train()
    with pytest.raises(RuntimeError, match="boom"):
        with otl.batch_stats_mode(model):
            raise RuntimeError("boom")
    assert model.training
    assert all(m.track_running_stats for m in model.modules() if isinstance(m, nn.BatchNorm2d))


# ------------------------------------------------------------------------------------------------
# augment / resize_batch
# ------------------------------------------------------------------------------------------------

def images(b=4, side=48, seed=80):
    return torch.randint(0, 256, (b, 3, side, side), dtype=torch.uint8, generator=gen(seed))


@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("side,size", [(48, 32), (96, 32), (32, 32), (24, 40)])
def test_augment_shape_range_device(strong, side, size):
    x = images(side=side)
    before = x.clone()
    out = otl.augment(x, size, strong=strong)
    assert out.shape == (4, 3, size, size)
    assert out.dtype == torch.float32
    assert out.device == x.device
    assert torch.isfinite(out).all()
    assert out.min() >= 0 and out.max() <= 1
    assert torch.equal(x, before)


def test_augment_float_input():
    x = images().float() / 255
    before = x.clone()
    out = otl.augment(x, 32, strong=True)
    assert out.shape == (4, 3, 32, 32) and out.min() >= 0 and out.max() <= 1
    assert torch.equal(x, before)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("b", [4, 64])      # per-image ops, and ops on sixths of the batch
def test_augment_on_cuda(device, b):
    x = images(b=b).to(device)
    out = otl.augment(x, 32, strong=True, generator=torch.Generator(device=device).manual_seed(0))
    assert out.device.type == "cuda" and out.shape == (b, 3, 32, 32)
    assert 0 <= out.min() and out.max() <= 1
    again = otl.augment(x, 32, strong=True, generator=torch.Generator(device=device).manual_seed(0))
    assert torch.equal(out, again)


@pytest.mark.parametrize("strong", [False, True])
def test_augment_random_and_reproducible(strong):
    x = images()
    a, b = otl.augment(x, 32, strong=strong), otl.augment(x, 32, strong=strong)
    assert not torch.equal(a, b)
    g1, g2 = gen(123), gen(123)
    c, d = otl.augment(x, 32, strong=strong, generator=g1), otl.augment(x, 32, strong=strong, generator=g2)
    assert torch.equal(c, d)
    e = otl.augment(x, 32, strong=strong, generator=gen(124))
    assert not torch.equal(c, e)
    # views of one image differ from each other within a batch too
    same = images(b=1).expand(4, 3, 48, 48).contiguous()
    v = otl.augment(same, 32, strong=strong, generator=gen(5))
    assert not torch.equal(v[0], v[1])


def test_augment_strong_has_cutout_hole():
    # a constant image becomes non-constant only through the grey (0.5) Cutout patch
    x = torch.full((8, 3, 32, 32), 255, dtype=torch.uint8)
    out = otl.augment(x, 32, strong=True, generator=gen(7))
    assert ((out == 0.5).all(1)).flatten(1).any(1).all()


@pytest.mark.parametrize("side,size", [(64, 32), (32, 32), (20, 48)])
def test_resize_batch(side, size):
    x = images(side=side)
    out = otl.resize_batch(x, size)
    assert out.shape == (4, 3, size, size) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 1
    const = torch.full((2, 3, side, side), 100, dtype=torch.uint8)
    torch.testing.assert_close(otl.resize_batch(const, size),
                               torch.full((2, 3, size, size), 100 / 255), rtol=0, atol=1e-5)
    if side == size:
        torch.testing.assert_close(out, x.float() / 255)


# ------------------------------------------------------------------------------------------------
# label_pass / extract_features
# ------------------------------------------------------------------------------------------------

def test_label_pass_and_extract_features_order():
    torch.manual_seed(0)
    model = otl.build_model(small_cfg(k=6))
    imgs = images(b=10, side=32, seed=90)
    before = bn_state(model)
    out = otl.label_pass(model, imgs, 32, batch_size=4, bn="eval", progress=False,
                         generator=gen(1))
    assert out.shape == (1, 10, 6)
    with torch.no_grad():
        ref = copy.deepcopy(model).eval()(otl.resize_batch(imgs, 32))
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)  # rows in data set order
    out = otl.label_pass(model, imgs, 32, batch_size=16, bn="batch", progress=False,
                         generator=gen(1))
    with torch.no_grad():
        ref = copy.deepcopy(model).train()(otl.resize_batch(imgs, 32))
    torch.testing.assert_close(out[0], ref, rtol=1e-3, atol=1e-4)
    out = otl.label_pass(model, imgs, 32, batch_size=4, views=2, strong=True, progress=False)
    assert out.shape == (2, 10, 6) and not torch.equal(out[0], out[1])
    for name, b in bn_state(model).items():
        assert torch.equal(b, before[name]), name
    assert model.training
    feats = otl.extract_features(model, imgs, 32, batch_size=3, progress=False)
    assert feats.shape == (10, 8 * 16) and feats.device.type == "cpu"
    with torch.no_grad():
        ref = copy.deepcopy(model).eval().features(otl.resize_batch(imgs, 32))
    torch.testing.assert_close(feats, ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# weighted kNN (the search is brute force here; eval_knn.py's FAISS search is tested there)
# ------------------------------------------------------------------------------------------------

def test_knn_weighted_vote_by_hand():
    # cosine similarities to the query [1, 0]: 1.0 (class 1), 0.8, 0.8 (class 0), -1 (class 1)
    train = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.8, -0.6], [-1.0, 0.0]])
    ytr = torch.tensor([1, 0, 0, 1])
    q = torch.tensor([[2.0, 0.0]])  # not unit length: features are L2-normalised first
    # T = 0.1: exp(10) = 22026 for class 1 beats 2 exp(8) = 5962 for class 0 (the minority wins)
    # T = 1:   e = 2.72 loses to 2 e^0.8 = 4.45 (the majority wins)
    assert math.exp(1 / 0.1) > 2 * math.exp(0.8 / 0.1) and math.exp(1) < 2 * math.exp(0.8)
    fn = otl.knn_classify
    assert fn(train, ytr, q, ks=(1, 3), T=0.1) == {1: torch.tensor([1]), 3: torch.tensor([1])}
    assert fn(train, ytr, q, ks=(1, 3), T=1.0) == {1: torch.tensor([1]), 3: torch.tensor([0])}
    # a tie of class scores goes to the lowest class: two neighbours at equal similarity
    assert fn(train[1:3], torch.tensor([1, 0]), q, ks=(2,), T=0.1)[2].tolist() == [0]
    # neighbours at equal similarity are taken in training order: with k = 1 of two duplicates
    # the first one votes, whatever order the search returned them in
    dup = torch.tensor([[0.6, 0.8], [0.6, 0.8], [0.0, 1.0]])
    assert fn(dup, torch.tensor([2, 0, 1]), q, ks=(1,))[1].tolist() == [2]
    reversed_search = lambda tr, te, K: tuple(x.flip(1) for x in (te @ tr.T).topk(K, dim=1))  # noqa: E731
    got = fn(dup, torch.tensor([2, 0, 1]), q, ks=(1, 2), search=reversed_search)
    assert got[1].tolist() == [2]   # the search gave index 1 first; the vote took index 0


def test_knn_separated_clusters_and_num_classes_from_data():
    centres = torch.eye(6, 32) * 10
    train, ytr = clusters(20, centres, 0.3, seed=3)
    test, yte = clusters(10, centres, 0.3, seed=4)
    preds = otl.knn_classify(train, ytr, test, ks=(1, 10, 20, 50), T=0.1, chunk=7)
    assert otl.top1(preds, yte) == {1: 100.0, 10: 100.0, 20: 100.0, 50: 100.0}
    # the class count comes from the labels; a num_classes that contradicts them is rejected
    with pytest.raises(ValueError):
        otl.knn_classify(train, ytr, test, ks=(5,), num_classes=3)
    with pytest.raises(ValueError, match="no test labels"):
        otl.top1(preds, torch.zeros(0))


def test_knn_clips_large_k_with_warning():
    train, ytr = clusters(3, torch.eye(2, 4), 0.1, seed=5)
    with pytest.warns(UserWarning, match="clipped"):
        preds = otl.knn_classify(train, ytr, train, ks=(2, 100))
    assert sorted(preds) == [2, 6]


# ----------------------------------------------------------------------------------------------
# the networks: ResNet-18, ResNet-50, AlexNet; heads, embedding, feature layers
# ----------------------------------------------------------------------------------------------

NETS = [otl.ModelConfig(k=6, width=8), otl.ModelConfig(arch="resnet50", k=6),
        otl.ModelConfig(arch="alexnet", k=6, width=8, heads=3, embed=16),
        otl.ModelConfig(k=5, width=8, small_stem=True, heads=2)]


@pytest.mark.parametrize("cfg", NETS, ids=lambda c: f"{c.arch}-h{c.heads}-e{c.embed}")
def test_networks_train_a_step_and_load_back(cfg, tmp_path):
    import utils
    torch.manual_seed(0)
    model = otl.build_model(cfg)
    x = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)
    out = model(x)
    assert out.shape == (4, cfg.heads * cfg.k) and model.out_dim == cfg.heads * cfg.k
    # one step of LCT summed over the heads, as train_otl takes it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.randint(0, cfg.k, (cfg.heads, 4))
    loss = sum(otl.lct_loss(out.view(1, 4, cfg.heads, cfg.k)[:, :, h], labels[h:h + 1])
               for h in range(cfg.heads))
    before = [p.detach().clone() for p in model.parameters()]
    loss.backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    path = str(tmp_path / "m.pth")
    utils.save_checkpoint({"model": model.state_dict(), "model_cfg": utils.model_state(cfg),
                           "args": {}, "epoch": 1}, path)
    back, _ = utils.load_checkpoint(path)
    model.eval(), back.eval()
    assert torch.equal(back(x), model(x))
    assert back.features(x).shape == (4, back.feat_dim)
    if cfg.embed:
        assert back.features(x, "embed").shape == (4, cfg.embed)
    else:
        with pytest.raises(ValueError, match="no embedding"):
            back.features(x, "embed")
    dims = [back.features(x, f"conv{i}").shape[1] for i in range(1, 6)]
    assert dims[-1] == (back.feat_dim if cfg.arch != "alexnet" else dims[-1]) and len(set(dims)) > 1
    with pytest.raises(ValueError, match="unknown feature layer"):
        back.features(x, "conv9")


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_resnet_backbone_loads_into_stock_torchvision(arch):
    import torchvision
    model = otl.build_model(otl.ModelConfig(arch=arch, k=10))
    stock = getattr(torchvision.models, arch)(weights=None)
    missing, unexpected = stock.load_state_dict(model.backbone.state_dict(), strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and unexpected == []
    stock.fc = nn.Identity()
    model.eval(), stock.eval()
    x = torch.rand(2, 3, 64, 64)
    assert torch.allclose(stock((x - model.mean) / model.std), model.features(x), atol=1e-5)


def test_bad_network_configs_are_refused():
    with pytest.raises(ValueError, match="unknown arch"):
        otl.build_model(otl.ModelConfig(arch="vgg"))
    with pytest.raises(ValueError, match="heads >= 1"):
        otl.build_model(otl.ModelConfig(heads=0))
    with pytest.raises(ValueError, match="torchvision's width"):
        otl.build_model(otl.ModelConfig(arch="resnet50", width=32))


def _ops_drawn(B, side, seed):
    """One round of otl._rand_ops on random images at known magnitudes: which op (0 - 4, 5 for
    identity) each output image is, found by comparing it with every op's result."""
    x = torch.rand(B, 3, side, side, generator=gen(1))
    m = torch.rand(B, generator=gen(2))
    out = otl._rand_ops(x.clone(), lambda lo, hi, *shape: m, gen(seed), n_ops=1)
    cand = [otl._photometric(i, x, m) for i in range(5)] + [x]
    drawn = []
    for b in range(B):
        hits = [i for i, c in enumerate(cand) if torch.equal(out[b], c[b])]
        assert len(hits) == 1, (b, hits)      # each output is exactly one op's image
        drawn.append(hits[0])
    return torch.tensor(drawn)


@pytest.mark.parametrize("B", [300, 50])
def test_photometric_ops_split_the_batch_evenly(B):
    """From 48 images on, each round gives each of the six ops (identity included) a random sixth
    of the batch, and each image is that op's result on it; another seed, other images."""
    a = _ops_drawn(B, 24, seed=7)
    sizes = [(i + 1) * B // 6 - i * B // 6 for i in range(6)]
    assert torch.bincount(a, minlength=6).tolist() == sizes
    assert torch.equal(a, _ops_drawn(B, 24, seed=7))
    assert not torch.equal(a, _ops_drawn(B, 24, seed=8))


def test_photometric_ops_of_a_small_batch_are_drawn_per_image():
    """Under 48 images each image draws its own op, so every op turns up even in tiny batches."""
    seen = torch.cat([_ops_drawn(3, 16, seed=s) for s in range(12)])
    assert set(seen.tolist()) == set(range(6))


def assert_same_stream(x, **off):
    """augment with a feature turned off (off) draws as many random numbers as with it on."""
    g = gen(6)
    otl.augment(x, 32, generator=g, **off)
    after_off = torch.rand(1, generator=g)
    g = gen(6)
    otl.augment(x, 32, generator=g)
    assert torch.equal(after_off, torch.rand(1, generator=g))


def test_augment_rot90_off_keeps_images_upright():
    """rot90=False (natural images): the bright top half stays on top in every view; with the
    default (overhead images) some views are turned; the random stream is the same either way."""
    x = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    x[:, :, :16] = 220
    def top_minus_bottom(out):
        return out[:, :, :8].mean((1, 2, 3)) - out[:, :, -8:].mean((1, 2, 3))
    up = otl.augment(x, 32, scale=(1.0, 1.0), generator=gen(5), rot90=False)
    assert (top_minus_bottom(up) > 0.3).all()
    turned = otl.augment(x, 32, scale=(1.0, 1.0), generator=gen(5))
    assert (top_minus_bottom(turned) < 0.3).sum() >= 16      # about 3 in 4 are turned
    assert_same_stream(x, rot90=False)


def test_augment_flip_off_keeps_left_and_right():
    """flip=False (digits: the paper's SVHN protocol): the bright left half stays left in every
    upright view; with flips some views are mirrored; the random stream is the same either way."""
    x = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    x[..., :16] = 220
    def left_minus_right(out):
        return out[..., :8].mean((1, 2, 3)) - out[..., -8:].mean((1, 2, 3))
    kept = otl.augment(x, 32, scale=(1.0, 1.0), generator=gen(5), rot90=False, flip=False)
    assert (left_minus_right(kept) > 0.3).all()
    mirrored = otl.augment(x, 32, scale=(1.0, 1.0), generator=gen(5), rot90=False)
    assert (left_minus_right(mirrored) < -0.3).sum() >= 16     # about half are mirrored
    assert_same_stream(x, flip=False)


def test_augment_n_ops_sets_how_far_strong_views_go():
    """The same geometry (one generator seed) with 0, 2 and 10 random ops per image: more ops
    take the views further from the op-free ones, on average over the batch."""
    x = images(b=96, side=32, seed=3)
    base = otl.augment(x, 32, strong=True, cutout=0, n_ops=0, generator=gen(9))
    gap = {n: (otl.augment(x, 32, strong=True, cutout=0, n_ops=n, generator=gen(9)) - base)
           .abs().mean().item() for n in (2, 10)}
    assert 0 < gap[2] < gap[10]


def test_crop_takes_views_from_a_smaller_window():
    """crop = 224 / 256: the test-time transform is the centre 224 of a 256 image, and training
    views come from windows of at most that side: on vertical stripes, a view of a half-side
    window holds about half the stripes of a full one."""
    x = torch.randint(0, 256, (2, 3, 256, 256), dtype=torch.uint8, generator=gen(1))
    torch.testing.assert_close(otl.resize_batch(x, 224, 224 / 256), x[..., 16:240, 16:240] / 255)
    stripes = ((torch.arange(256) // 8) % 2 * 200).to(torch.uint8).expand(64, 3, 256, 256)

    def edges(crop):
        out = otl.augment(stripes, 64, scale=(1.0, 1.0), generator=gen(2), rot90=False, crop=crop)
        row = out[:, 0, 32]
        sign = row > row.mean(1, keepdim=True)
        return (sign[:, 1:] != sign[:, :-1]).sum(1).double().mean().item()
    full, half = edges(1.0), edges(0.5)
    assert 25 <= full <= 33 and 0.4 * full <= half <= 0.6 * full


def test_bf16_autocast_on_the_cpu_agrees_with_float32():
    """otl.autocast(device, True) takes bf16 on the CPU too (None: CUDA only, the old default);
    one forward of a half-width ResNet-18 at 32 px gives features within 5 % of float32's largest
    (cosine >= 0.999 for every image), float32 logits from the label pass within 10 %, and an
    LCT loss within 1 % -- and not float32's bit for bit, so bf16 did run."""
    assert isinstance(otl.autocast("cpu"), type(otl.autocast("cpu", False)))    # nullcontext
    torch.manual_seed(0)
    model = otl.build_model(otl.ModelConfig(k=16, width=16)).to(memory_format=torch.channels_last)
    imgs = images(b=64, side=32, seed=7)
    f32, f16 = (otl.extract_features(model, imgs, 32, progress=False, amp=a) for a in (False, True))
    assert f16.dtype == torch.float32 and not torch.equal(f16, f32)
    assert (f16 - f32).abs().max() <= 0.05 * f32.abs().max()
    assert F.cosine_similarity(f16, f32).min() >= 0.999
    o32, o16 = (otl.label_pass(model, imgs, 32, 32, progress=False, generator=gen(0), amp=a)
                for a in (False, True))
    assert o16.dtype == torch.float32 and (o16 - o32).abs().max() <= 0.1 * o32.abs().max()
    x = otl.resize_batch(imgs, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 16, (2, 32), generator=gen(1))
    loss = []
    for amp in (False, True):
        with otl.autocast("cpu", amp):
            logits = model(x).float().view(2, 32, 16)          # (V, B, k), float32 for the loss
        loss.append(otl.lct_loss(logits, labels).item())
    assert loss[0] != loss[1] and abs(loss[1] - loss[0]) <= 0.01 * loss[0]
