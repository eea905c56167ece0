"""The tuned exact labeler (otl_scale) through its public names: balance within 1 of the target,
labels that are argmax(O - T) for one T, the same labels as otl.py's reference where the answer is
unique, streaming = in memory, two gloo processes = one, a start, bad input refused."""
import io
import math
import os
import zipfile

import pytest
import torch
import torch.multiprocessing as mp

import otl
import otl_scale

from conftest import EUROSAT, free_port, gen


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


def same(a, b):
    return torch.equal(a.labels, b.labels) and torch.equal(a.T, b.T)


# ---------------------------------------------------------------------------------------------
# balance and translation-only labels, in memory (the dense path at k <= 128, candidates above)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, n", [(2, 5000), (10, 50_000), (50, 20_000), (128, 21_600),
                                  (200, 20_000), (500, 20_000), (1000, 30_000)])
def test_exact_balance_gaussian(k, n):
    O = torch.randn(n, k, generator=gen(k)) + torch.linspace(0, 2, k)
    r = exact(O)
    check_even(r)
    check_translation(O, r)


@pytest.mark.parametrize("k", [10, 64, 128])
def test_dense_path_equals_the_streaming_path_where_the_answer_is_unique(k):
    """N / k whole and distinct outputs: one balanced assignment is a translation's, so the
    in-memory fast path (dense=True, the default) and the streaming path give the same labels,
    each argmax(O - T) of its own T (outside the tie-break's size)."""
    n = 200 * k
    O = dominant(n, k, 21)
    a, b = exact(O), exact(O, dense=False)
    check_even(a)
    assert torch.equal(a.labels, b.labels)
    check_translation(O, a)
    check_translation(O, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_dense_path_other_dtypes(dtype):
    O = dominant(20_000, 50, 22).to(dtype)
    r = exact(O)
    check_even(r)
    check_translation(O, r)


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


@pytest.mark.parametrize("k", [10, 128, 300])
def test_float64_outputs_beyond_float32_range(k):
    """float64 outputs larger than float32's largest value, which otl.translate takes too: on each
    path (the dense path hands them to the streaming one) balanced, argmax(O - T), and the labels
    of the same outputs scaled down by a power of two where the answer is unique (N / k whole)."""
    n = 64 * k if k == 10 else 20 * k
    O = torch.randn(n, k, generator=gen(k), dtype=torch.float64) + torch.linspace(0, 1, k)
    big = O * 2.0 ** 1000       # about 1e301
    for kw in ({}, {"dense": False}):
        r = exact(big, **kw)
        check_even(r)
        check_translation(big, r)
        assert torch.equal(r.labels, exact(O, **kw).labels)


def test_exact_is_a_translation():
    O = torch.randn(3000, 20, generator=gen(6))
    r = exact(O)
    i, j = torch.randint(0, 3000, (2, 100), generator=gen(7))
    d_before = O.double()[i] - O.double()[j]
    d_after = (O.double() - r.T)[i] - (O.double() - r.T)[j]
    assert torch.allclose(d_before, d_after, atol=1e-12)


@pytest.mark.parametrize("k", [2, 20])
def test_dense_path_targets_with_one_cluster_taking_almost_all(k):
    """Targets far from even (one cluster takes all rows, or all but one row each of the
    others): exact, on real-like outputs."""
    n = max(64 * k * 4, 1024)      # (the dense path from 1,000 rows)
    O = dominant(n, k, 33)
    for fill in (1, 0):
        target = torch.full((k,), float(fill), dtype=torch.float64)
        target[0] = n - fill * (k - 1)
        r = exact(O, target=target)
        assert (r.counts.double() - target).abs().max() == 0
        check_translation(O, r)


def collapsing(n, k=128, rank=4, seed=0):
    """Outputs of a network collapsing onto few clusters: rank-4 logits (25 - 36 of the 128
    columns some row's best) with a little noise, so that most rows' margins are tiny."""
    g = gen(seed)
    Z, W = torch.randn(n, rank, generator=g), torch.randn(rank, k, generator=g)
    O = Z @ (W * torch.rand(k, generator=g) * 2) + 0.05 * torch.randn(n, k, generator=g)
    return O.contiguous()


def test_dense_path_finishes_on_collapsing_outputs():
    """The rows near a boundary, solved, move T past the margin that chose them: the dense path
    solves again from that T with more rows instead of handing the outputs to the streaming path
    (`active`: the rows solved exactly)."""
    O = collapsing(21_600)
    r = exact(O)
    check_even(r)
    check_translation(O, r)
    assert r.active < O.shape[0]


def test_streaming_equals_in_memory_on_collapsing_outputs():
    """Shedding from over-full clusters alone hands rows among the clusters already used; the
    reverse rounds pull rows into the empty ones.  N / k whole: one answer."""
    O = collapsing(128 * 169)
    a, b = exact(O), exact(O, dense=False)
    check_even(b)
    assert torch.equal(a.labels, b.labels)


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

# ---------------------------------------------------------------------------------------------
# streaming = in memory; candidate lists and re-reading; the translator's life cycle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, kw", [(300, {}), (300, {"full_rows_up_to": 0, "max_candidates": 24,
                                                    "candidates": 8}), (50, {"dense": False})])
def test_streaming_equals_in_memory(k, kw):
    """Fed in batches of any size, StreamingTranslator gives translate's labels and T."""
    n = 20_000
    O = torch.randn(n, k, generator=gen(8)) + torch.linspace(0, 1, k)
    dense = exact(O, **kw)
    kw.pop("dense", None)
    sizes = torch.randint(1, 3000, (12,), generator=gen(9)).tolist()
    stream = _stream(O, sizes, **kw)
    assert same(dense, stream)
    check_even(stream)


def test_result_once_and_add_after_result_refused():
    O = torch.randn(5000, 300, generator=gen(17))
    st = otl_scale.StreamingTranslator(300, distributed=False)
    st.add(O)
    r = st.result(refetch=lambda rows: O[rows])
    check_even(r)
    with pytest.raises(RuntimeError, match="once"):
        st.result()
    with pytest.raises(RuntimeError, match="new StreamingTranslator"):
        st.add(O[:10])


def test_far_outputs_read_again_only_the_rows_that_fell_short():
    """Real-like outputs far from balance at the medians, candidate lists (k > 256, no sample
    start): the rows whose candidates fall short are read again, far fewer than all; from the
    sample start fewer still.  Exact either way."""
    n = 20_000
    big = dominant(n, 300, 5)
    r = exact(big, sample_start=False)
    check_even(r)
    assert check_translation(big, r) <= 0.01 * n
    assert 0 < r.refetched < 0.1 * n
    assert exact(big).refetched < r.refetched


def test_identical_rows_in_shards_pick_what_one_process_picks():
    """Every row the same: the tie-break (a hash of the global row) decides, so a shard that says
    where it starts (row_offset) gets the labels one process gives those rows; alone it is
    refused (the ranks before it hold no rows)."""
    n, k, half = 24_000, 300, 12_000
    O = torch.randn(1, k, generator=gen(12)).expand(n, k).contiguous()
    whole = exact(O)
    check_even(whole)
    assert whole.labels[half:].unique().numel() > 250
    st = otl_scale.StreamingTranslator(k, distributed=False, row_offset=half)
    st.add(O[half:])
    with pytest.raises(ValueError, match="row_offset"):
        st.result(refetch=lambda rows: O[rows])


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


# ---------------------------------------------------------------------------------------------
# a start: another view's T, the last epoch's, or a sample's
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# a given start translation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [40, 300])
def test_start_near_the_answer_balances(k):
    """start=T of a similar input (another view of the same images, here the same outputs moved
    a little): exact balance and translation-only labels as from the medians; streamed in
    batches it gives the dense call's labels and T.  (How much time it saves is measured by
    compare_labelers.py --views, not here.)"""
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
    with pytest.raises(ValueError, match="the exact labeler.s"):
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


def test_sample_start_leaves_bad_outputs_to_the_whole_call():
    """A NaN in a sampled row: the error names its row in the whole input, not in the sample."""
    O = _clustered(6000, 300, 48)
    O[4000, 7] = math.nan
    with pytest.raises(ValueError, match=r"first: \[4000\]"):
        exact(O)


# ---------------------------------------------------------------------------------------------
# distributed: two gloo ranks on CPU = one process
# ---------------------------------------------------------------------------------------------

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

def _translate_rank(rank, world, port, O, kw, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        lo, hi = rank * O.shape[0] // world, (rank + 1) * O.shape[0] // world
        r = otl_scale.translate(O[lo:hi], distributed=True, row_offset=lo, **kw)
        torch.save({"labels": r.labels, "T": r.T}, f"{out}_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_translate_across_processes_is_one_call(tmp_path):
    """otl_scale.translate(shard, distributed=True, row_offset=...) on each rank, with candidate
    lists that fall short (rows read again from the rank's own shard): one process's labels."""
    n, k, kw = 20_000, 120, {"full_rows_up_to": 0, "max_candidates": 24, "candidates": 8}
    O = dominant(n, k, 12)
    st = otl_scale.StreamingTranslator(k, distributed=False, rows_hint=n // 2, **kw)
    st.add(O)
    single = st.result(refetch=lambda rows: O[rows])
    out = str(tmp_path / "t")
    mp.start_processes(_translate_rank, args=(2, free_port(), O, kw, out), nprocs=2,
                       start_method="spawn")
    parts = [torch.load(f"{out}_{r}.pt") for r in range(2)]
    assert single.refetched > 0
    assert torch.equal(torch.cat([p["labels"] for p in parts]), single.labels)
    assert all(torch.equal(p["T"], single.T) for p in parts)
    with pytest.raises(ValueError, match="across processes"):
        otl_scale.translate(O, method="published", distributed=True)


@pytest.mark.parametrize("k, kw, far", [(120, {}, False), (120, {}, True),
                                        (120, {"full_rows_up_to": 0, "max_candidates": 24,
                                               "candidates": 8}, False),
                                        (120, {"full_rows_up_to": 0, "max_candidates": 24,
                                               "candidates": 8}, True)])
def test_two_gloo_processes_equal_one(k, kw, far, tmp_path):
    """Whole rows and candidates, Gaussian and far from balance (where candidates fall short and
    are read again, and the auction's cut is found by bisection across ranks): the two ranks'
    labels are one process's, and both hold its T and counts."""
    n = 20_000   # rank 0 holds the first n_init = 8192 rows, as one process sees them
    O = dominant(n, k, 11) if far else torch.randn(n, k, generator=gen(11))
    st = otl_scale.StreamingTranslator(k, distributed=False, **kw)   # as the ranks: no rows_hint
    st.add(O)
    single = st.result(refetch=lambda rows: O[rows])
    check_even(single)
    out = str(tmp_path / "r")
    mp.start_processes(_rank_main, args=(2, free_port(), O, kw, out), nprocs=2,
                       start_method="spawn")
    parts = [torch.load(f"{out}_{r}.pt") for r in range(2)]
    assert torch.equal(torch.cat([p["labels"] for p in parts]), single.labels)
    for p in parts:
        assert torch.equal(p["T"], single.T)
        assert torch.equal(p["counts"], single.counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [10, 100, 300])
def test_exact_on_cuda_equals_cpu(k):
    O = dominant(20_000, k, 31)
    a, b = exact(O), exact(O.cuda())
    assert torch.equal(a.labels, b.labels.cpu()) and torch.equal(a.T, b.T.cpu())


# ---------------------------------------------------------------------------------------------
# the other methods through otl_scale.translate, and the exact finish's shortest paths
# ---------------------------------------------------------------------------------------------

def test_every_labeler_through_the_tuned_translate():
    """method="published" and "sinkhorn" are otl.translate's, with the published rules' tie_eps
    default (1e-6); "reference" is otl.translate_exact."""
    O = torch.randn(3000, 20, generator=gen(50))
    for method in ("published", "sinkhorn"):
        a, b = otl_scale.translate(O, method=method), otl.translate(O, method=method)
        assert torch.equal(a.labels, b.labels) and torch.equal(a.T, b.T)
    ref, exact = otl_scale.translate(O, method="reference"), otl.translate_exact(O)
    assert torch.equal(ref.labels, exact.labels) and torch.equal(ref.T, exact.T)
    with pytest.raises(ValueError, match="method"):
        otl_scale.translate(O, method="auction")


def _bellman_ford(k, W, src):
    d = torch.full((k,), math.inf, dtype=torch.float64)
    d[src] = 0.0
    for _ in range(k):
        d = torch.minimum(d, (d[:, None] + W).min(0).values)
    return d


@pytest.mark.parametrize("k, density", [(12, 0.3), (100, 0.2), (300, 0.05)])
def test_shortest_paths_against_bellman_ford(k, density):
    """The finish's search on every move gives Bellman-Ford's distances, each predecessor on a
    shortest path; on the moves up to tau, the distances up to tau."""
    g = gen(k)
    W = torch.rand(k, k, generator=g, dtype=torch.float64)
    W[torch.rand(k, k, generator=g) > density] = math.inf
    W.fill_diagonal_(math.inf)
    dT = torch.rand(k, generator=g, dtype=torch.float64) * 0.1
    cost = ((W + dT[None, :]) - dT[:, None]).clamp(min=0)
    src = torch.zeros(k, dtype=torch.bool)
    src[:3] = True
    want = _bellman_ford(k, cost, src)
    for tau in (math.inf, float(want[torch.isfinite(want)].median())):
        e = (cost.view(-1) <= min(tau, 1e308)).nonzero()[:, 0]     # the moves up to tau
        d, p = otl_scale._shortest_paths(e, W.view(-1)[e], dT, k, src.numpy())
        d, p = torch.from_numpy(d), torch.from_numpy(p)
        near = want <= tau
        assert torch.allclose(d[near], want[near], atol=1e-9) and bool((d[~near] > tau).all())
        fin = (p >= 0).nonzero()[:, 0]
        assert torch.allclose(d[p[fin]] + cost[p[fin], fin], d[fin], atol=1e-9)


# ------------------------------------------------------------------------------------------------
# the tuned labeler against otl.py's reference
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# the tuned labeler against otl.py's reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,x", [(6000, 10, 0), (6000, 50, 0), (5000, 100, 0), (6000, 20, 2),
                                   (6000, 300, 0), (1800, 600, 0)])
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



@pytest.mark.parametrize("big", [1e16, 1e30, -1e16])
@pytest.mark.parametrize("n", [600, 4000])      # the streaming and the dense path
def test_a_huge_start_still_gives_argmax_labels(big, n):
    """A start far outside the outputs' range would swamp O - T's precision: the labels are
    argmax(O - T) of the T returned, and the counts the target."""
    O = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    start = torch.zeros(8, dtype=torch.float64)
    start[0] = big
    r = otl_scale.translate(O, start=start)
    assert torch.equal(r.labels, (O.double() - r.T).argmax(1))
    assert r.counts.tolist() == [n // 8] * 8
