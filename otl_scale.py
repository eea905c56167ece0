"""The tuned exact labeler: `otl.translate`'s problem where the reference cannot go.

`otl.py` holds the method and a short reference exact labeler that needs the N x k outputs in
memory in one process.  This file solves the same problem, with the same guarantees, where the
outputs are streamed (never held whole) or spread over several processes (only k-vectors and
k x k tables travel), with one in-memory fast path for small k:

    res = otl_scale.translate(O)            # the same problem as otl.translate(O)
    st = otl_scale.StreamingTranslator(k)   # never holds the N x k outputs; torchrun-aware
    for batch in batches:
        st.add(net(batch))
    res = st.result(refetch=lambda rows: net(images[rows]))

Imports `otl` (never the other way), numpy and scipy (its Dijkstra finishes the solve).  In the
order a call runs them: each row's candidate clusters (`StreamingTranslator`, `_Store`), the
solver on them (`_Solver`: an ascending auction, then the exact finish by shortest paths in
`_Finish`, then strict ties), and the dense path for small k held in memory (`_Dense`: Newton
steps on the counts, then the solver on the rows near a boundary).  Design: docs/labeler.md."""
from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

import otl
from otl import (TranslateResult, check_finite, check_start, check_target, count_bounds, counts_std,
                 worst_std)

__all__ = ["translate", "StreamingTranslator", "sample_start_T", "ScaleResult"]

# ---- Tuning: the constants the labeler's speed rests on (docs/labeler.md says how each was set)
BLOCK = 8192            # rows per pass on the CPU, so that a pass's temporaries stay in cache
WINDOW_ROWS = 2048      # the candidates' window from the first this many rows
AUCTION_STALL = 6       # the auction stops when 6 rounds removed under a fifth of the excess
UNSURE_SHARE = 0.01     # rows unsure of their best past this share are read again before the finish
READS = 40              # rounds of reading rows again before the solve takes whole rows
APPROACH_SHARE, APPROACH_STEPS = 0.02, 8   # published steps (excess) and reverse rounds (deficit) over 2 %
DENSE_ROWS, DENSE_ROWS_PER_K = 1000, 32   # the dense path from N >= 1,000 and 32 k (below, streaming is cheaper)
DENSE_SHARE, DENSE_PER_MOVE = 0.02, 8   # dense path: the rows to solve (2 % of N, 8 a row to move)
SHED_AFTER = 0.9        # a Newton step keeping more of sum |counts - target| is followed by a shed
PAST_8 = 0.01           # full-row steps past 8 while sum |counts - target| > 1 % of N
COLLAPSE_SAMPLE, COLLAPSE_EVERY = 1.0, 4   # excess over N at the start: steps on every 4th row
KN_COPY_K_GPU, KN_COPY_K_CPU = 32, 63   # Newton passes on a k x N copy up to this k (GPU, host)
R_ROWS, H_ROWS = 4096, 2048   # dense path: R and the step's bandwidth h from strided margins
HOST_SOLVE = 1 << 18    # outputs on a GPU: the dense path's exact solve on the host up to rows x k
F32_INF = 2.0 ** 128 - 2.0 ** 103   # float64 values from here on round to inf in float32
BIG = torch.iinfo(torch.int64).max  # no row


@dataclass
class ScaleResult(TranslateResult):
    refetched: int = 0            # rows re-read in full (their candidate lists fell short)
    active: int = 0               # rows solved (the others kept their best cluster)


def _within(counts, lo, hi) -> bool:   # every count within its bounds (otl.count_bounds)
    return bool(((counts >= lo) & (counts <= hi)).all())


def translate(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
              patience: int = 10, max_iter: int = 10000, tie_eps=None, seed: int = 0,
              init: str = "median", method: str = "exact", candidates: int = 24,
              max_candidates: int = 48, full_rows_up_to: int = 128,
              full_rows_bytes: int = 1 << 30, start=None, sample_start: bool = True,
              dense: bool = True, n_init: int = 8192, distributed: bool = False,
              row_offset: int = 0) -> TranslateResult:
    """otl.translate's problem and guarantees: T with labels = argmax(O - T) and every count within
    1 of the target (even by default).  With dense, for 2 <= k <= full_rows_up_to, N >= DENSE_ROWS
    and N >= DENSE_ROWS_PER_K x k, the dense path runs first (`_Dense`); otherwise, or where it
    cannot finish, O is fed in chunks to `StreamingTranslator`, whose settings these are (tie_eps
    defaults to 2**-26).  start: a T to start from instead of the column medians (the other
    view's, the last epoch's).  sample_start: without a start, for k > 2 x full_rows_up_to and
    outputs far from balance at their medians, start from the exact T of a random quarter of the
    rows (`sample_start_T`).  distributed: `outputs` are this process's shard of torchrun's
    (its first row global number row_offset); only k-vectors and k x k tables travel.  Every
    labeler by one name: method="exact" this one, "reference" otl.translate_exact, "published"
    (beta, alpha0, patience, max_iter, tie_eps default 1e-6, seed, init), "sinkhorn" otl's."""
    if method not in ("exact", "reference", "published", "sinkhorn") or (
            distributed and method != "exact"):
        raise ValueError(f"method must be 'exact' (the one across processes), 'reference', "
                         f"'published' or 'sinkhorn', got {method!r}")
    if method == "reference":
        return otl.translate_exact(outputs, target=target, start=start)
    if method != "exact":
        pub = dict(beta=beta, alpha0=alpha0, patience=patience, max_iter=max_iter, seed=seed,
                   init=init, tie_eps=1e-6 if tie_eps is None else tie_eps)
        return otl.translate(outputs, target=target, method=method, start=start,
                             **(pub if method == "published" else {}))
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    if not distributed:     # a shard's checks are StreamingTranslator's (N >= k of them all)
        otl.check_outputs(outputs, finite=False)     # chunk by chunk, without an N x k copy
    (n, k), tie_eps = outputs.shape, 2.0 ** -26 if tie_eps is None else tie_eps
    if not distributed:     # a shard's span and medians are not the whole outputs'
        if start is not None:   # within median +- the outputs' span: past it a cluster empties
            T0, span = otl.check_start(start, k), float(outputs.max() - outputs.min())
            start = T0.clamp(T0.median() - span, T0.median() + span)   # (1e16 swamps O - T's bits)
        if dense and 2 <= k <= full_rows_up_to and n >= max(DENSE_ROWS, DENSE_ROWS_PER_K * k):
            res = _dense_translate(outputs, target, seed, tie_eps, start, n_init)
            if res is not None:
                return res
        if start is None and sample_start and k > 2 * full_rows_up_to:
            start = sample_start_T(outputs, target=target, seed=seed, candidates=candidates,
                                   max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                                   tie_eps=tie_eps)
    st = StreamingTranslator(k, target=target, seed=seed, candidates=candidates,
                             max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                             distributed=distributed, rows_hint=n, start=start, n_init=n_init,
                             row_offset=row_offset if distributed else None, tie_eps=tie_eps,
                             full_rows_bytes=full_rows_bytes)
    for s in range(0, n, st.chunk):
        st.add(outputs[s:s + st.chunk])
    off = row_offset if distributed else 0
    return st.result(refetch=lambda rows: outputs[(rows - off).to(outputs.device)])


def sample_start_T(outputs: torch.Tensor, target=None, every=None, probe: int = 2048, **kw):
    """A start T for the exact labeler on outputs held whole: the exact T of a seeded random
    1 / `every` of the rows (default 4; 8 on a GPU where N >= 8 k, as a round there costs its
    launches whatever its rows; random, as a stride can alias with rows in a cycle), the target
    scaled to them.  None where it would not pay: k <= 2 x full_rows_up_to, fewer than
    every x k rows, or the first `probe` rows near balance at their column medians (their mean
    squared deviation from the target at most 4 x the mean count, sampling noise being about 1).
    On real networks' outputs the medians are far from the answer and many candidate lists fall
    short and are read again; from the sample's T few do.  kw: translate's settings for it."""
    n, k = outputs.shape
    if every is None:
        every = 8 if _launch_bound(outputs.device) and n >= 8 * k else 4
    if k <= 2 * kw.get("full_rows_up_to", 128) or n < every * k:
        return None
    target = check_target(target, n, k)
    head = _working(outputs[:probe]).contiguous()    # (median is wrong on expanded rows)
    cnt = torch.bincount((head - _column_medians(head)).argmax(1), minlength=k).cpu()
    m = head.shape[0]
    if float(((cnt - target * (m / n)) ** 2).mean()) <= 4 * m / k:
        return None
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(kw.get("seed", 0)))
    sub = outputs.index_select(0, rows[:n // every].sort().values.to(outputs.device))
    kw = {key: val for key, val in kw.items() if val is not None}
    try:     # the target's shares of the sample's rows
        return translate(sub, target=target * (sub.shape[0] / n), sample_start=False, **kw).T
    except ValueError:     # bad outputs: the whole call says so, with its own row numbers
        return None


def _working(X):
    """X in the precision the labeler reads it in: float64 as it is, any other float as float32."""
    return X if X.dtype == torch.float64 else X.to(torch.float32)


def _column_medians(A):
    """A.median(dim=0).values (the lower middle value) of a float (n, k) tensor, by numpy's
    partition of a host copy's columns: several times cheaper than torch's median on a CPU."""
    i = (A.shape[0] - 1) // 2
    B = np.array(_working(A.detach()).cpu().numpy().T, order="C")
    B.partition(i, axis=-1)
    return torch.from_numpy(np.array(B[:, i])).to(A.device)


def _launch_bound(device):
    """A GPU: an op there costs its launch more than its work, so passes take all rows at once."""
    return torch.device(device).type != "cpu"


# ---- The tie-break: a fixed perturbation eps u(row, column) that splits equal outputs

def _tie_scale(head, tie_eps):
    """The tie-break's eps: tie_eps times the median over the first rows of a row's largest |O| (a
    median, so that one outlier cannot make the perturbation swamp real gaps; relative at every
    scale, as a fixed floor would swamp outputs smaller than it).  The dense and the
    streaming path take the same eps, so that they break ties alike."""
    top = head.abs().amax(1)
    med = float(top.median())
    if med == 0:    # over half of the rows all zero: the others' scale (none: any eps > 0 splits)
        top = top[top > 0]
        med = float(top.median()) if top.numel() else 1e-30
    return tie_eps * med


def _tie_jitter(rows: torch.Tensor, cols: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed uniform [0, 1) number per (global row, column) from integer hashing, so that every
    way of feeding the same outputs (dense, in batches, over ranks) perturbs them alike.  rows (r,),
    cols (r, m) int64 -> (r, m) float64, in place on one int64 block."""
    x = cols.to(torch.int64) * 0x85EBCA77
    x.add_(rows.to(torch.int64)[:, None] * 0x9E3779B1 + (int(seed) % 1000003) * 0xC2B2AE3D)
    t = torch.bitwise_right_shift(x, 16)
    x.bitwise_xor_(t.bitwise_and_(0xFFFFFFFFFFFF))
    x.mul_(0x27D4EB2F165667C5)          # wraps around in int64, as intended
    torch.bitwise_right_shift(x, 29, out=t)
    x.bitwise_xor_(t.bitwise_and_(0x7FFFFFFFF))
    x.bitwise_right_shift_(11).bitwise_and_(0x1FFFFFFFFFFFFF)
    return x.to(torch.float64).mul_(1.0 / float(1 << 53))


def _jittered(V, rows, cols, eps, seed):
    """V + eps u(rows, cols) in place: the one sum every stored candidate value is made by."""
    return V.add_(_tie_jitter(rows, cols, seed).mul_(eps))


class _Comm:
    """All-reduce over torch.distributed when it is initialised and asked for, else nothing.
    Tensors travel on the backend's device (CUDA for NCCL, else the CPU) and back."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist
        self.on = bool(distributed) and dist.is_available() and dist.is_initialized()
        self.dist = dist
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        nccl = self.on and dist.get_backend() == "nccl"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _on_backend(self, x, op):
        """The collective `op` in place on x, moved to the backend's device and back."""
        if not self.on:
            return x
        y = x.to(self.dev)
        if op == "broadcast":
            self.dist.broadcast(y, src=0)
        else:
            self.dist.all_reduce(y, op=getattr(self.dist.ReduceOp, op))
        return y if y is x else y.to(x.device)

    sum = functools.partialmethod(_on_backend, op="SUM")       # comm.sum(x), in place
    max = functools.partialmethod(_on_backend, op="MAX")
    min = functools.partialmethod(_on_backend, op="MIN")
    broadcast = functools.partialmethod(_on_backend, op="broadcast")    # rank 0's x

    def total(self, n: int) -> int:
        """A count summed over ranks."""
        return int(self.sum(torch.tensor([n]))[0])


# ---- Streaming: each row's candidates, then the solve

class _Store:
    """The candidate lists of the rows added, piece by piece: vals (n, w) O - T0 at each row's
    candidates (-inf in empty slots), cols (n, w) their clusters, theta (n,) a bound at T0 on the
    columns dropped (-inf: none).  Whole rows (w = k) keep every column in order; otherwise a row
    keeps the columns within `window` of its best at T0, or its best w of them by exact value with
    the tie-break where it has more (on collapsed outputs every column is that close)."""

    def __init__(self, k, width, T0, eps, window, seed):
        self.k, self.width, self.eps, self.window, self.seed = k, width, eps, window, seed
        self.T0, self.T0f, self.T0abs = T0, T0.to(torch.float32), float(T0.abs().max())
        self.cdtype = torch.int16 if k < 32768 else torch.int32
        self.parts, self.n, self._buf = [], 0, None

    def add(self, X, first):
        """The rows X (float32 or float64), whose global numbers start at `first`."""
        n, k = X.shape
        if self.width == k:
            check_finite(X, self.n)
            part = (X.to(torch.float64) - self.T0,
                    torch.arange(k, device=X.device).to(self.cdtype).expand(n, k),
                    torch.full((n,), -math.inf, dtype=torch.float64, device=X.device))
        else:
            part = self._cut(X, first)
        self.parts.append(part)
        self.n += n

    def _cut(self, X, first):
        """(vals, cols, theta) of the rows X: the hits S >= max(S) - window of S = X - T0, found in
        passes over a few rows at a time into a reused buffer (in cache), then listed in row
        order from the mask read 8 columns at a time as int64 words (almost every word is 0)."""
        n, k, w, dev = X.shape[0], self.k, self.width, X.device
        T0 = self.T0 if X.dtype == torch.float64 else self.T0f
        kp, step = (k + 7) // 8 * 8, n if _launch_bound(dev) else max(1, (4 << 20) // (4 * k))
        if (self._buf is None or self._buf[0].dtype != X.dtype or self._buf[1].shape[0] < n
                or self._buf[0].shape[0] < min(step, n)):
            m = max(n, BLOCK)
            self._buf = (torch.empty(min(step, m), k, dtype=X.dtype, device=dev),
                         torch.zeros(m, kp, dtype=torch.bool, device=dev))
        rmax = torch.empty(n, dtype=X.dtype, device=dev)
        for s in range(0, n, step):
            e = min(s + step, n)
            S = torch.sub(X[s:e], T0, out=self._buf[0][:e - s])
            torch.amax(S, 1, out=rmax[s:e])
            torch.ge(S, (rmax[s:e] - self.window)[:, None], out=self._buf[1][s:e, :k])
        if not bool(torch.isfinite(rmax).all()):   # NaN and +inf show here (amax keeps NaN);
            check_finite(X, self.n)                 # -inf never makes a candidate, so it may stay
        # fl(X - T0) errs by 2^-24 of |S| and |T0| in float32: theta bounds every dropped column
        thr = (rmax - self.window).to(torch.float64)
        rel = 2.0 ** -50 if X.dtype == torch.float64 else 2.0 ** -22
        theta = thr + rel * (thr.abs() + self.T0abs) + self.eps
        words = self._buf[1][:n].view(torch.int8).view(-1).view(torch.int64)
        fw = words.nonzero()[:, 0]                  # the words with a hit, ascending
        hit = words.index_select(0, fw).view(torch.int8).nonzero()[:, 0]   # word * 8 + byte
        g = fw.index_select(0, hit >> 3).mul_(8).add_(hit & 7)             # flat, ascending
        rr = torch.div(g, kp, rounding_mode="floor")
        cc = g.sub_(rr * kp)
        cnt = torch.bincount(rr, minlength=n)
        theta[cnt >= k] = -math.inf                 # nothing dropped
        pos = torch.arange(rr.numel(), device=dev) - (cnt.cumsum(0) - cnt).index_select(0, rr)
        val = (X.reshape(-1).index_select(0, rr * k + cc).to(torch.float64)
               - self.T0.index_select(0, cc))
        # flat (n * w + 1) tables, with a spare slot at the end for the hits past a row's w-th
        at = torch.where(pos < w, rr * w + pos, n * w)
        vals = torch.full((n * w + 1,), -math.inf, dtype=torch.float64, device=dev)
        cols = torch.zeros(n * w + 1, dtype=self.cdtype, device=dev)
        vals.index_copy_(0, at, val)
        cols.index_copy_(0, at, cc.to(self.cdtype))
        vals, cols, many = vals[:n * w].view(n, w), cols[:n * w].view(n, w), cnt > w
        if bool(many.any()):   # those rows' best w by exact value with the tie-break
            oi, e = many.nonzero()[:, 0], many.index_select(0, rr).nonzero()[:, 0]
            if e.numel() > 0.3 * oi.numel() * k:     # most of their columns: all of them
                Xo = X.index_select(0, oi)
                tv, ti = self.whole(Xo, oi + first).topk(w + 1, dim=1)
                ti = ti[:, :w]
                vals[oi] = Xo.gather(1, ti).to(torch.float64) - self.T0[ti]
                cols[oi] = ti.to(self.cdtype)
            else:                                     # a table of their hits
                at = ((torch.cumsum(many, 0) - 1).index_select(0, rr[e]), pos[e])
                P = torch.full((oi.numel(), int(cnt.max())), -math.inf, dtype=torch.float64,
                               device=dev)
                P0, PC = P.clone(), torch.zeros(P.shape, dtype=torch.int64, device=dev)
                P0[at], PC[at] = val[e], cc[e]
                P[at] = _jittered(val[e, None], rr[e] + first, cc[e, None], self.eps,
                                  self.seed)[:, 0]
                tv, ti = P.topk(w + 1, dim=1)
                vals[oi] = P0.gather(1, ti[:, :w])
                cols[oi] = PC.gather(1, ti[:, :w]).to(self.cdtype)
            theta[oi] = torch.maximum(theta[oi], tv[:, w])     # the rest
        return vals, cols, theta

    def whole(self, X, grows):
        """O - T0 + eps u for every column of the rows X (global numbers `grows`): the values the
        candidates hold once the tie-break is added."""
        cols = torch.arange(self.k, device=X.device).expand(X.shape[0], self.k)
        return _jittered(X.to(torch.float64) - self.T0, grows, cols, self.eps, self.seed)

    def take(self, offset):
        """The stored pieces, handed over (so that no row is held twice), the tie-break added now
        that this rank's first global row, `offset`, is known."""
        parts, self.parts, self._buf, s = self.parts, [], None, offset
        for vals, cols, _ in parts:
            _jittered(vals, torch.arange(s, s + vals.shape[0], device=vals.device), cols,
                      self.eps, self.seed)
            s += vals.shape[0]
        return parts

    def recut(self, X, grows, dT, force):
        """(vals, cols, theta) of the rows X (global numbers `grows`) read again, their best w
        chosen at the translation T0 + dT, with the clusters in the (k,) mask `force` (fewer than
        w) among them, theta bounding the rest there."""
        V = self.whole(X, grows)
        tv, ti = (V - dT).masked_fill_(force, math.inf).topk(self.width + 1, dim=1)
        ti = ti[:, :self.width]
        return V.gather(1, ti), ti.to(self.cdtype), tv[:, self.width]


class StreamingTranslator:
    """Output translation fed batch by batch, never holding the N x k outputs: `st.add(batch)` for
    each (n_b, k) batch in row order, then `st.result(refetch)` once; refetch(global rows) gives
    rows' outputs again where their candidate lists fell short.  The first `n_init` rows fix the
    start: T0 (their column medians, or `start`), the tie-break's size and the candidates' window.
    Rows are kept whole when k <= max(full_rows_up_to, 2 x max_candidates), or k <= 2 x
    full_rows_up_to, rows_hint x k x 10 bytes <= full_rows_bytes and the first rows are far from
    balance at T0 (their counts' mean squared deviation from N / k over 4 x N / k); else each
    keeps the columns within a window of its best at T0 (about `candidates`, at most
    `max_candidates`) and a bound on the rest.  Distributed: each rank adds its shard in rank
    order (row_offset: its first row's global number) and gets its rows' labels; only k-vectors
    and k x k tables travel.  NaN and +-inf raise.  Design: docs/labeler.md, 'Streaming'."""

    def __init__(self, k: int, target=None, seed: int = 0, candidates: int = 24,
                 max_candidates: int = 48, full_rows_up_to: int = 128, n_init: int = 8192,
                 tie_eps: float = 2.0 ** -26,
                 distributed: bool = True, chunk: int = 65536, row_offset=None,
                 rows_hint=None, full_rows_bytes: int = 1 << 30, start=None):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ValueError(f"k must be an integer (the number of clusters), got {k!r}")
        if k < 2:
            raise ValueError(f"need k >= 2 clusters, got k={k}")
        self.k, self.target_arg, self.seed = int(k), target, int(seed)
        self.candidates, self.max_candidates = int(candidates), int(max_candidates)
        if self.max_candidates < 2 or self.candidates < 1:
            raise ValueError("candidates must be >= 1 and max_candidates >= 2")
        self.n_init, self.tie_eps, self.chunk = int(n_init), float(tie_eps), int(chunk)
        self.comm = _Comm(distributed)
        # global number of this rank's first row (0 in one process); result() checks it
        self.row_offset = int(row_offset) if row_offset is not None else 0
        self.row_offset_given = row_offset is not None or not self.comm.on
        self.all_cols = self.k <= max(2 * self.max_candidates, int(full_rows_up_to))
        self.fits = rows_hint is not None and self.k <= 2 * int(full_rows_up_to) and (
            int(rows_hint) * self.k * 10 <= int(full_rows_bytes))     # whole rows, if far
        self.start = None if start is None else check_start(start, self.k)
        self.buffer, self.nbuf = [], 0
        self.store, self.device, self.t0, self.used = None, None, None, False

    # -- feeding ---------------------------------------------------------------------------
    def add(self, outputs: torch.Tensor) -> None:
        if self.used:
            raise RuntimeError("result() has been called: it consumes the stored candidates; "
                               "feed a new StreamingTranslator")
        if self.t0 is None:
            self.t0 = time.perf_counter()
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2 or outputs.shape[1] != self.k:
            raise ValueError(f"each batch must be an (n, k={self.k}) tensor, got "
                             f"{tuple(getattr(outputs, 'shape', ()))}")
        if not outputs.is_floating_point():
            raise ValueError(f"outputs must be floating point, got {outputs.dtype}")
        outputs = outputs.detach()
        if self.store is None:
            self.buffer.append(outputs)
            self.nbuf += outputs.shape[0]
            if self.nbuf >= self.n_init:
                self._start()
            return
        for s in range(0, outputs.shape[0], self.chunk):
            self._extract(outputs[s:s + self.chunk])

    def _start(self):
        """The start from the first n_init rows (rank 0's on every rank), then those rows stored:
        T0, the tie-break's size eps and the window, a typical row's `candidates`-th largest gap
        at T0 (at least 2 eps: columns within eps of a row's best can still win by the
        tie-break, so they must be candidates; on collapsed outputs the gaps are 0)."""
        pieces, self.buffer, self.nbuf = self.buffer, [], 0
        head = (_working(torch.cat([p[:self.n_init] for p in pieces])[:self.n_init]).contiguous()
                if pieces else torch.zeros(0, self.k))
        self.device, k = head.device, self.k
        T0, eps, window = torch.zeros(k, dtype=torch.float64, device=self.device), 0.0, 0.0
        if head.shape[0]:
            check_finite(head)
            T0 = (_column_medians(head).to(torch.float64) if self.start is None
                  else self.start.to(self.device))
            eps, m = _tie_scale(head, self.tie_eps), head.shape[0]
            if self.fits and not self.all_cols:
                cnt = torch.bincount((head - T0.to(head.dtype)).argmax(1), minlength=k)
                self.all_cols = float(((cnt - m / k) ** 2).mean()) > 4 * m / k
            if not self.all_cols:
                S = head[:WINDOW_ROWS] - T0.to(head.dtype)
                gaps = S.amax(1, keepdim=True) - S
                window = float(gaps.kthvalue(min(self.candidates, k), dim=1).values.median())
        v = self.comm.broadcast(torch.cat([T0.cpu(), torch.tensor(
            [eps, window, self.all_cols], dtype=torch.float64)]))
        T0, (eps, window, whole) = v[:k].to(self.device), v[k:].tolist()
        self.all_cols = whole > 0
        self.eps, width = eps, k if self.all_cols else self.max_candidates
        self.store = _Store(k, width, T0, eps, math.inf if self.all_cols else max(window, 2 * eps),
                            self.seed)
        for p in pieces:
            for i in range(0, p.shape[0], self.chunk):
                self._extract(p[i:i + self.chunk])

    def _extract(self, X: torch.Tensor):
        X, step = _working(X.to(self.device)), _rows_per_pass(self.device)
        for s in range(0, X.shape[0], step):
            self.store.add(X[s:s + step], self.store.n + self.row_offset)

    # -- solving ---------------------------------------------------------------------------
    def result(self, refetch=None, max_rounds: int = 200) -> TranslateResult:
        """The translation of every row added (this rank's rows).  Call it once: it moves the
        stored candidates into the solver (so they are not held twice) and adds the tie-break."""
        if self.used:
            raise RuntimeError("result() can be called once per StreamingTranslator (it consumes "
                               "the stored candidates); feed a new one")
        self.used = True
        if self.store is None:
            self._start()
        if self.t0 is None:
            self.t0 = time.perf_counter()
        comm, k, dev = self.comm, self.k, self.device
        sizes = torch.zeros(comm.world, dtype=torch.int64)
        sizes[comm.rank] = self.store.n
        sizes = comm.sum(sizes)
        n_total = int(sizes.sum())
        self.offset = int(sizes[:comm.rank].sum())
        if self.row_offset_given and self.row_offset != self.offset:
            raise ValueError(f"row_offset={self.row_offset}, but the ranks before this one hold "
                             f"{self.offset} rows: add shards in rank order")
        if n_total < k:
            raise ValueError(f"need at least as many outputs as clusters (N >= k), got N={n_total}, k={k}")
        target = check_target(self.target_arg, n_total, k)
        lo, hi = (b.to(dev) for b in count_bounds(target))
        rows = torch.arange(self.offset, self.offset + self.store.n, device=dev)
        solver = _Solver(self.store.take(self.offset), k, target.to(dev), lo, hi, comm, rows,
                         self.store.width)
        history = [solver.std()]
        solver, refetched = self._solve(solver, refetch, history, max_rounds)
        counts = solver.counts
        ok = _within(counts, lo, hi)
        if not ok:
            warnings.warn(
                f"the exact labeler ended with counts {int(counts.min())} - {int(counts.max())}, "
                "outside the target's bounds (stop_reason 'max_iter'); the labels are usable but "
                "not balanced.  With tie_eps=0 identical rows cannot be split; otherwise please "
                "report the outputs that did this", RuntimeWarning)
        return ScaleResult(labels=solver.labels, T=self.store.T0 + solver.dT, counts=counts,
                           target=target, iterations=solver.rounds + solver.phases,
                           std_history=history, std=counts_std(counts.cpu(), target),
                           std_max=worst_std(target, n_total),
                           seconds=time.perf_counter() - self.t0,
                           stop_reason="balanced" if ok else "max_iter", refetched=refetched,
                           ties=solver.ties, ties_left=solver.ties_left, active=self.store.n)

    def _solve(self, solver, refetch, history, max_rounds):
        """Published steps far from balance and the auction, then the finish once few rows are
        unsure of their best candidate (a dropped column could beat it at the current T).
        Candidates are chosen again at the current T from the rows read again: the unsure rows',
        and every row's, with (some of) the clusters that no move reached, where the finish finds
        no path to them (the lists, chosen around T0, miss them).  Where that happens twice, or
        after READS rounds, whole rows.  Returns (solver, rows read again)."""
        comm, n_total, refetched, failed = self.comm, int(solver.counts.sum()), 0, 0
        for attempt in range(READS + 1):
            if (attempt == READS or failed == 2) and not solver.whole:
                solver = self._whole_solver(solver, refetch)
                refetched += solver.labels.numel()
            solver.approach(history)
            solver.auction(max_rounds, history)
            rows = solver.unsure_rows()
            force = torch.zeros(self.k, dtype=torch.bool, device=self.device)
            n_unsure = comm.total(rows.numel())
            if n_unsure <= UNSURE_SHARE * n_total or attempt >= READS - 1:
                finish = _Finish(solver)     # (on stale lists it would be wasted)
                balanced = finish.run(history)
                rows = solver.unsure_rows()
                n_unsure = comm.total(rows.numel())
                if (balanced and not n_unsure) or solver.whole:
                    break
                if not balanced:     # up to w / 2 of the clusters that no move reached
                    failed, force = failed + 1, finish.unreached
                    rows, force = solver.all_rows, force & (force.cumsum(0) <= solver.width // 2)
            _need_refetch(refetch, n_unsure)
            if failed < 2:
                refetched += self._recut(solver, rows, refetch, force)
        solver.strictify(keep_balance=self.eps > 0)
        return solver, refetched

    def _read(self, rows_global, refetch):
        """The rows' outputs read again, in the labeler's precision, on this rank's device."""
        return _working(refetch(rows_global.cpu()).to(self.device))

    def _whole_solver(self, solver, refetch):
        """A solver on every row whole, read again, from `solver`'s translation."""
        parts, rows = [], solver.rows_global
        for s in range(0, rows.numel(), self.chunk):
            grows = rows[s:s + self.chunk]
            parts += _whole_parts(self.store.whole(self._read(grows, refetch), grows))
        return _Solver(parts, self.k, solver.target, solver.lo, solver.hi, self.comm, rows,
                       dT=solver.dT, rounds=solver.rounds, phases=solver.phases)

    def _recut(self, solver, pos, refetch, force):
        """Re-choose the candidates of the solver's rows `pos` at its dT from their outputs (read
        in pieces of at most 256 MB), the clusters in `force` among them; returns how many were
        read (every rank calls it)."""
        step = max(1, min(self.chunk, (1 << 28) // (8 * self.k)))
        for s in range(0, pos.numel(), step):
            grows = solver.rows_global.index_select(0, pos[s:s + step])
            solver.replace_rows(pos[s:s + step], *self.store.recut(
                self._read(grows, refetch), grows, solver.dT, force))
        solver.counts = solver.count()
        return pos.numel()


def _need_refetch(refetch, n_unsure):
    """Raise where the candidate lists fell short and no refetch was given."""
    if refetch is not None:
        return
    if n_unsure:
        raise RuntimeError(
            f"{n_unsure} rows' best candidate could be beaten by a column they dropped; pass "
            "refetch=fn(rows) -> outputs of those rows, or use more candidates")
    raise RuntimeError(
        "the candidate lists are too short for these outputs (no cheap move reaches an under-full "
        "cluster); pass refetch=fn(rows) -> outputs of those rows, or keep whole rows "
        "(full_rows_up_to >= k)")


# ---- The solver on candidate lists

def _rows_per_pass(device):
    """Rows a pass takes at once: BLOCK on the CPU (in cache), many more on a GPU (launches)."""
    return 65536 if _launch_bound(device) else BLOCK


def _whole_parts(vals):
    """Whole rows (n, k) as the solver's pieces: every column in order, no bound on others."""
    block, k = _rows_per_pass(vals.device), vals.shape[1]
    cols = torch.arange(k, device=vals.device).expand(block, k)
    return [(v, cols[:v.shape[0]], torch.full((v.shape[0],), -math.inf, dtype=torch.float64,
                                               device=v.device)) for v in vals.split(block)]


def _cat(parts):
    """torch.cat of tensors; one as it is (no copy or launch: a round is mostly one block)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _top2_(S):
    """(best value, its column as an (n, 1) index, runner-up) of each row of S, as topk(2) gives
    them (a tie for the best: the first column, and the runner-up equals it), by max and a scatter,
    which cost less than topk.  S is overwritten: its best entries become -inf."""
    best, arg = S.max(1, keepdim=True)
    best = best[:, 0]
    second = S.scatter_(1, arg, -math.inf).amax(1) if S.shape[1] > 1 else torch.full_like(best, -math.inf)
    return best, arg, second


class _Solver:
    """The translation solved on candidate lists: vals (n, w) O - T0 + eps u of each row's
    candidates, cols (n, w) their clusters, rows_global (n,) ascending, dT (k,) = T - T0.  theta
    (n,) bounds the dropped columns at the translation cuts[epoch[i]] the row's candidates were
    chosen at, so at any dT a dropped column scores at most theta_i - min(dT - cuts[epoch_i]).
    auction() comes near the target, `_Finish` ends it exactly, strictify() makes every label a
    strict argmax."""

    def __init__(self, parts, k, target, lo, hi, comm, rows_global, width=None, dT=None, rounds=0,
                 phases=0):
        self.parts, self.k, self.dev = parts, k, rows_global.device
        self.width = k if width is None else width     # (the same on every rank)
        self.whole = self.width >= k      # whole rows: no column dropped
        self.starts = torch.tensor([0] + [v.shape[0] for v, _, _ in parts]).cumsum(0).tolist()
        self.target, self.lo, self.hi, self.comm = target, lo, hi, comm
        self.rows_global, self.block = rows_global, _rows_per_pass(self.dev)
        self.epoch = torch.zeros(rows_global.numel(), dtype=torch.int64, device=self.dev)
        self.cuts = torch.zeros(1, k, dtype=torch.float64, device=self.dev)
        self.dT = torch.zeros(k, dtype=torch.float64, device=self.dev) if dT is None else dT
        self.rounds, self.phases, self.ties, self.ties_left = rounds, phases, 0, 0
        self.all_rows = torch.arange(rows_global.numel(), device=self.dev)
        self.labels = self.evaluate(self.all_rows)[1]
        self.counts = self.count()

    def count(self):
        return self.comm.sum(torch.bincount(self.labels, minlength=self.k))

    def std(self):
        return counts_std(self.counts.cpu(), self.target)

    def _split(self, rows):
        """(piece, rows of it as indices into it, the rows) for the ascending local `rows`."""
        starts = torch.tensor(self.starts, device=self.dev)
        cut = torch.searchsorted(rows.contiguous(), starts).tolist()
        for p, (a, b) in enumerate(zip(cut, cut[1:])):
            if b > a:
                yield p, rows[a:b] - self.starts[p], rows[a:b]

    def blocks(self, rows):
        """(rows, their vals, cols as int64, bound) of the ascending local `rows`, piece by piece
        (slices where rows are all rows); bound: the most a dropped column of the row scores at
        the current dT.  Whole rows' cols: every column in order, as an expanded view."""
        rise = (self.dT[None, :] - self.cuts).amin(1)    # (epochs,) how far T rose since each cut
        for p, r, rr in self._split(rows):
            v, c, t = self.parts[p]
            if rows is not self.all_rows:
                v, c, t = v.index_select(0, r), c.index_select(0, r), t.index_select(0, r)
            c = (torch.arange(self.k, device=self.dev).expand(v.shape[0], self.k) if self.whole
                 else c.long())
            yield rr, v, c, t - rise.index_select(0, self.epoch.index_select(0, rr))

    def at(self, cols):
        """dT at each entry of a block of cluster numbers (whole rows: dT itself, broadcast)."""
        return self.dT if self.whole else self.dT.index_select(0, cols.reshape(-1)).view(cols.shape)

    def evaluate(self, rows):
        """(best score, its column, the runner-up or the dropped columns' bound, unsure: the
        bound is not below the best) of `rows` at the current dT."""
        out = [[], [], [], []]
        for _, vr, cr, bound in self.blocks(rows):
            best, arg, second = _top2_(vr - self.at(cr))
            for o, x in zip(out, (best, cr.gather(1, arg)[:, 0], torch.maximum(second, bound),
                                  best <= bound)):
                o.append(x)
        if not out[0]:
            e = torch.zeros(0, dtype=torch.float64, device=self.dev)
            return e, torch.zeros(0, dtype=torch.int64, device=self.dev), e, e.bool()
        return tuple(_cat(o) for o in out)

    def unsure_rows(self):
        if self.whole:
            return torch.zeros(0, dtype=torch.int64, device=self.dev)
        return self.evaluate(self.all_rows)[3].nonzero()[:, 0]

    def replace_rows(self, rows, vals, cols, theta):
        """New candidates for `rows`, chosen at the current dT (theta: their bound there); the
        counts are stale until the caller counts again (on every rank: it sums over ranks)."""
        at = torch.searchsorted(rows, torch.tensor(self.starts, device=self.dev)).tolist()
        for p, r, _ in self._split(rows):
            for x, y in zip(self.parts[p], (vals, cols, theta)):
                x.index_copy_(0, r, y[at[p]:at[p + 1]].to(x.dtype))
        if not bool((self.cuts[-1] == self.dT).all()):
            self.cuts = torch.cat([self.cuts, self.dT[None, :]])
        self.epoch[rows] = self.cuts.shape[0] - 1
        self.labels[rows] = self.evaluate(rows)[1]

    def relabel(self, rows):
        """The labels of `rows` at the current dT, and the counts again."""
        self.labels[rows] = self.evaluate(rows)[1]
        self.counts = self.count()

    def approach(self, history):
        """Published steps (Algorithm 1's loop, otl.translation_steps, APPROACH_STEPS at most)
        while the excess is over APPROACH_SHARE of the rows: they move every cluster at once,
        where the auction, raising over-full clusters only, is slow (far from balance, with
        clusters that no row's best candidate is)."""
        n = int(self.counts.sum())
        if float((self.counts - self.hi).clamp(min=0).sum()) <= APPROACH_SHARE * n:
            return
        ends = [torch.zeros((), dtype=torch.float64, device=self.dev)] * 2
        for v, _, _ in self.parts:
            ends = [torch.maximum(ends[0], v.amax()),
                    torch.maximum(ends[1], -torch.where(torch.isfinite(v), v, math.inf).amin())]
        spread = float(self.comm.max(torch.stack(ends)).sum())    # the range of vals, at most
        dT = self.dT

        def assign(T):
            self.dT = T
            labels = self.evaluate(self.all_rows)[1]
            return labels, self.comm.sum(torch.bincount(labels, minlength=self.k))

        T, self.labels, self.counts, _, steps, _ = otl.translation_steps(
            assign, lambda T: spread + float(T.max() - T.min()), dT, self.labels, self.counts,
            self.target.to(self.dev), worst_std(self.target, n), history, patience=3,
            max_iter=APPROACH_STEPS)
        self.dT, self.rounds = T, self.rounds + steps

    def auction(self, max_rounds, history):
        """Ascending auction rounds: every over-full cluster raises T_j just past its excess_j-th
        smallest margin (`_shed`), so that that many of its rows would leave it if no other T
        rose, until 6 rounds removed under a fifth of the excess (the rest is a slow random walk,
        which the exact finish does faster)."""
        excesses, n = [], float(self.counts.sum())
        for _ in range(max_rounds):
            excess = (self.counts - self.hi).clamp(min=0)
            excesses.append(int(excess.sum()))
            if excesses[-1] == 0 or (len(excesses) > AUCTION_STALL and
                                     excesses[-1] > 0.8 * excesses[-1 - AUCTION_STALL]):
                return
            self.rounds += 1
            over = excess > 0
            rows = over.index_select(0, self.labels).nonzero()[:, 0]
            best, _, second, _ = self.evaluate(rows)
            # a row whose best a dropped column could beat (margin < 0) cannot be shed by moving
            # T: it counts as margin 0 here and is read again later
            margin = (best - second).clamp(min=0)
            lab = self.labels.index_select(0, rows)
            r = _shed(self, margin, lab, excess, over)
            self.dT = self.dT + r
            self.relabel(rows[margin < r.index_select(0, lab)])
            if self.whole and float((self.lo - self.counts).clamp(min=0).sum()) > APPROACH_SHARE * n:
                self.attract()      # (near balance the finish moves the last rows faster)
            history.append(self.std())

    def attract(self):
        """A reverse round: every under-full cluster j pulls in its deficit, T_j falling to the
        middle of the gap after the deficit_j-th smallest loss (a row's best score - its score in
        j) among the rows of clusters not under-full; done as a rise of every other T.  Where a
        network collapses onto few clusters, shedding alone hands rows among the used ones; the
        auction runs it on whole rows (candidate lists seldom hold the clusters that need rows)
        while the deficit is over APPROACH_SHARE of the rows."""
        deficit = (self.lo - self.counts).clamp(min=0)
        under = deficit > 0
        rows = (~under).index_select(0, self.labels).nonzero()[:, 0]
        out = [[torch.zeros(0, dtype=t, device=self.dev)] for t in (torch.float64, torch.int64,
                                                                     torch.int64)]
        for rr, vr, cr, _ in self.blocks(rows):
            S = vr - self.at(cr)
            loss = S.amax(1, keepdim=True) - S
            u = under if self.whole else under.index_select(0, cr.reshape(-1)).view(cr.shape)
            i, j = (u & (loss < math.inf)).nonzero(as_tuple=True)
            for o, x in zip(out, (loss[i, j], cr[i, j], rr.index_select(0, i))):
                o.append(x)
        loss, c, r = (torch.cat(o) for o in out)
        cnt = self.comm.sum(torch.bincount(c, minlength=self.k))
        d = _shed(self, loss, c, torch.minimum(deficit, cnt), under & (cnt > 0))
        self.dT = self.dT + (d.max() - d)
        self.rounds += 1
        mine = under.index_select(0, self.labels).nonzero()[:, 0]
        self.relabel(torch.cat([r[loss < d.index_select(0, c)], mine]).unique())

    def strictify(self, keep_balance=True):
        """Moved rows sit on exact ties.  Order the clusters so that every tie a -> b (a row of a
        with an equal score in b) has pi[b] > pi[a], and add eta * pi to T, eta under half of what
        keeps every other lead: ties resolve to the current labels, nothing else changes.  Only
        the rows near a tie are looked at column by column.  Equal is within 64 ulps of the
        largest |value| at first, raised while the shift would not clear it.  keep_balance: where
        the shift would unbalance balanced counts, keep the labels and T (ties_left)."""
        k, dev = self.k, self.dev
        # ties are equal up to float64 rounding of the values involved
        parts = [self.dT.abs().max()]    # one wait for the device, not two a block
        for v, _, _ in self.parts:
            parts += [v.amax(), -torch.where(torch.isfinite(v), v, 0.0).amin()]
        scale = float(torch.stack(parts).max())
        scale = float(self.comm.max(torch.tensor([scale], dtype=torch.float64))[0]) or 1.0
        tol = 64 * 2.0 ** -52 * scale
        best, arg, second, _ = self.evaluate(self.all_rows)
        margin = best - second          # over the runner-up and the dropped columns' bound
        for _ in range(64):
            key, tied, rmin, gap, near = self._ties(margin, arg, tol)
            self.ties = key.numel()
            if self.ties == 0:
                return
            pi, cycle = _tie_order(key // k, key % k, k)
            # (a cycle of ties, such as identical rows without the tie-break have, has no order:
            # the rows then take their argmax at the shift of k + 1 steps; gap is a margin over
            # a dropped column's bound, not a pair that could be a tie)
            if cycle or rmin >= gap or rmin > 4 * (float(pi.max()) + 1) * tol:   # (inf: no such)
                break
            tol = rmin      # the nearest pair that was not a tie is one now
        eta = self._eta(pi.to(dev), margin, tied, near, tol)
        if not math.isfinite(eta):     # no lead to keep: any shift
            eta = scale * 1e-6 / (float(pi.max()) + 1)
        dT, old = self.dT, self.labels.index_select(0, tied)
        balanced = _within(self.counts, self.lo, self.hi)   # (global counts: all ranks alike)
        self.dT = self.dT + eta / 2 * pi.to(dev)
        self.relabel(tied)      # a row outside `tied` loses at most half of its lead
        if keep_balance and balanced and not _within(self.counts, self.lo, self.hi):
            # Scores closer than float64 resolves at their size: no shift orders these ties.
            # Balance comes first: the rows keep their labels, on a tie.
            self.dT = dT
            self.labels[tied] = old
            self.counts = self.count()
            self.ties_left = self.comm.total(tied.numel())

    def _ties(self, margin, arg, tol):
        """strictify's look at the rows at tolerance tol: the tied pairs a * k + b (ascending, all
        ranks), the tied rows (local), the least score difference over tol to another candidate
        (rmin), the least lead over a dropped column's bound (gap), and the tied rows' labels,
        candidates, leads over them (inf: none) and over the dropped columns, for _eta."""
        k, dev = self.k, self.dev
        near = (margin <= tol) | (arg != self.labels)
        rmin = float(torch.where(near, math.inf, margin).amin()) if margin.numel() else math.inf
        tied = near.nonzero()[:, 0]     # the rest: every other score is more than tol below
        ta, tb, out = [], [], [[], [], [], []]
        for rows, vr, cr, thb in self.blocks(tied):
            lab = self.labels.index_select(0, rows)
            S = vr - self.at(cr)
            own = S.gather(1, (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            R = torch.where((cr != lab[:, None]) & torch.isfinite(S), own - S, math.inf)
            tight = R <= tol
            ta.append(lab[:, None].expand_as(R)[tight])
            tb.append(cr[tight])
            for o, x in zip(out, (lab, cr, torch.where(tight, math.inf, R), own[:, 0] - thb)):
                o.append(x)
        # the tied pairs a * k + b, ascending, of all ranks (across ranks as a k x k sum; in one
        # process without any k x k array)
        key = (torch.cat(ta) * k + torch.cat(tb) if ta else
               torch.zeros(0, dtype=torch.int64, device=dev))
        if self.comm.on:
            adj = torch.zeros(k * k, dtype=torch.int64, device=dev)
            adj[key] = 1
            key = (self.comm.sum(adj) > 0).nonzero()[:, 0]
        near = [torch.cat(o) for o in out] if ta else None
        if near is not None and near[2].numel():
            rmin = min(rmin, float(near[2].amin()))
        g = near[3][torch.isfinite(near[3])] if near is not None else near
        gmin = float(g.min()) if g is not None and g.numel() else math.inf
        rmin, gmin = self.comm.min(torch.tensor([rmin, gmin], dtype=torch.float64)).tolist()
        return key.unique().cpu(), tied, rmin, gmin, near

    def _eta(self, pi, margin, tied, near, tol):
        """The shift eta * pi keeps every lead that is not a tie while eta is under this, over all
        ranks: a row of cluster a loses eta (pi_a - pi_b) of its lead over b, at most eta pi_a
        of its lead over its runner-up or a dropped column."""
        free = margin.clone()
        free[tied] = math.inf       # the rows near a tie: column by column below
        pl = pi.index_select(0, self.labels)
        lims = [torch.where(pl > 0, free / pl, math.inf)]
        if near is not None:
            lab, cr, R, g = near
            pa = pi.index_select(0, lab)
            drop = pa[:, None] - pi.index_select(0, cr.reshape(-1)).view(cr.shape)
            lims += [torch.where((drop > 0) & (R > tol), R / drop, math.inf).view(-1),
                     torch.where(pa > 0, g / pa, math.inf)]
        lim = min((float(x.amin()) for x in lims if x.numel()), default=math.inf)
        return float(self.comm.min(torch.tensor([lim], dtype=torch.float64))[0])


def _tie_order(a, b, k):
    """(pi, cycle): pi (k,) float64 with pi[b[i]] > pi[a[i]] for every tie a[i] -> b[i], the longest
    chain of ties into each cluster; cycle: the ties form one (pi is then what k + 1 steps reached).
    a, b: int64 CPU tensors."""
    pi = torch.zeros(k, dtype=torch.float64)
    for _ in range(k + 1):
        new = pi.clone().scatter_reduce(0, b, pi[a] + 1, "amax")
        if torch.equal(new, pi):
            return pi, False
        pi = new
    return pi, True


def _shed(s, margin, lab, excess, over):
    """r_j for each over-full cluster j: the midpoint of the excess_j-th and the next smallest
    margin among its members (all ranks), so that excess_j of them lie below it; just past the
    largest (by 2^-10 of it) when all must go.  One process sorts the margins (_gap_after);
    several ranks find the same gap by bisection on global counts (_bisect_gap)."""
    if not s.comm.on and margin.numel():
        a, b = _gap_after(margin, lab, excess, s.k)
    else:
        a, b = _bisect_gap(s, margin, lab, excess, over)
    r = torch.where(torch.isinf(b), a + a.abs() * 2.0 ** -10 + 1e-300, (a + b) / 2)
    return torch.where(over, r, 0.0)


def _bisect_gap(s, margin, lab, excess, over):
    """Per cluster, (largest margin below the cut, smallest at or above it) for the cut that
    leaves exactly excess_j members of j below, by bisection on global counts."""
    k, comm, dev = s.k, s.comm, s.dev
    mmax = torch.zeros(k, dtype=torch.float64, device=dev).scatter_reduce(0, lab, margin, "amax")
    lo = torch.zeros(k, dtype=torch.float64, device=dev)
    hi = comm.max(mmax) * 2 + 1e-300
    r = torch.zeros_like(lo)
    done = ~over
    base = torch.zeros(k, dtype=torch.int64, device=dev)
    am, al = margin, lab
    zero = torch.zeros(k, dtype=torch.int64, device=dev)
    for step in range(120):
        mid = (lo + hi) / 2
        # a count without a boolean index: that would make a GPU wait at every step
        below = (am < mid.index_select(0, al)).to(torch.int64)
        cnt = base + comm.sum(zero.scatter_add(0, al, below))
        hit = (cnt == excess) & ~done
        r = torch.where(hit, mid, r)
        done = done | hit
        lo = torch.where(~done & (cnt < excess), mid, lo)
        hi = torch.where(~done & (cnt > excess), mid, hi)
        if step % 4 == 3:   # drop members that can no longer change any count; done ones
            if bool(done.all()):   # take no more steps
                break
            below = am < lo[al]
            base = base + comm.sum(torch.bincount(al[below & ~done[al]], minlength=k))
            keep = ~done[al] & ~below & (am < hi[al])
            am, al = am[keep], al[keep]
    cut = torch.where(done, r, lo).index_select(0, lab)   # unresolved: exact ties at the cut
    below = margin < cut
    a = comm.max(torch.full((k,), -math.inf, dtype=torch.float64, device=dev)
                 .scatter_reduce(0, lab[below], margin[below], "amax"))
    b = comm.min(torch.full((k,), math.inf, dtype=torch.float64, device=dev)
                 .scatter_reduce(0, lab[~below], margin[~below], "amin"))
    return torch.where(done, a, b), b


def _gap_after(margin, lab, excess, k):
    """(a, b) per cluster j with excess_j > 0: the excess_j-th smallest margin among the rows
    labelled j and the next one (b = inf where excess_j is not below its rows); the other entries
    are not for use.  On the CPU with up to 8 such clusters, each by a topk; else from the margins
    sorted by cluster, then by value (float32: one sort of int64 keys cluster << 32 | bits, as
    non-negative floats order as their bits)."""
    cnt = torch.bincount(lab, minlength=k)
    # (on a GPU the sort, whose launches do not grow with the clusters, and no wait to decide)
    few = None if _launch_bound(margin.device) else (excess > 0).nonzero()[:, 0]
    if few is not None and few.numel() <= 8 and bool((excess <= cnt).all()):
        a = torch.zeros(k, dtype=margin.dtype, device=margin.device)
        b = torch.full((k,), math.inf, dtype=margin.dtype, device=margin.device)
        for j, ej in zip(few.tolist(), excess.index_select(0, few).tolist()):
            mj = margin[lab == j]
            small = mj.topk(min(ej + 1, mj.numel()), largest=False).values    # ascending
            a[j] = small[ej - 1]
            if ej < mj.numel():
                b[j] = small[ej]
        return a, b
    if margin.dtype == torch.float32:
        key = (lab.to(torch.int64) << 32) | (margin.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
        ms = (torch.sort(key).values & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    else:
        order = torch.argsort(margin, stable=True)
        order = order.index_select(0, torch.argsort(lab.index_select(0, order), stable=True))
        ms = margin.index_select(0, order)
    first = torch.cumsum(cnt, 0) - cnt
    last = ms.numel() - 1
    a = ms.index_select(0, (first + excess - 1).clamp(0, last))
    nxt = ms.index_select(0, (first + excess).clamp(0, last))
    return a, torch.where(excess < cnt, nxt, math.inf)


class _Finish:
    """The exact finish: rounds of shortest paths from over- to under-full clusters.  Moving row i
    from its cluster a to b costs (V_ia - dT_a) - (V_ib - dT_b) >= 0.  The moves that cost at most
    tau are listed (a moved row's moves listed again from its new cluster), and each round the
    edge a -> b of the cluster graph is the cheapest listed move (the lowest global row id among
    equal ones, so that any split of the rows picks the same), searched by scipy's Dijkstra from
    the clusters that must give.  One row moves along each of disjoint paths, nearest first, and
    T of every cluster nearer the sources than the last path rises by how much nearer it is, so
    every lead stays >= 0.  T only rises, so a move left out costs at least trust = tau - how far
    any T_j rose since the list was made, and a distance up to trust is exact; tau doubles while
    the clusters that need rows lie beyond it."""

    def __init__(self, solver):
        s = self.s = solver
        # (k * k,) scratch for the edges' least moves and rows, left as found after each round
        self.W = torch.full((s.k * s.k,), math.inf, dtype=torch.float64, device=s.dev)
        self.arg = torch.full((s.k * s.k,), BIG, dtype=torch.int64, device=s.dev)

    def run(self, history):
        """True when balanced; False when no move reaches a cluster that needs rows (those are
        left in `unreached`).  First the clusters over ceil(t) give to those under it, then those
        over floor(t)."""
        s, k, pairs = self.s, self.s.k, None
        max_phases = s.phases + 2 * int(s.counts.sum()) + 1000      # a guard
        lo, hi = s.lo.cpu().numpy(), s.hi.cpu().numpy()
        best, _, second, _ = s.evaluate(s.all_rows[::max(1, s.labels.numel() // 4096)])
        lead = (best - second).clamp(min=0)     # tau at first: the 0.2 quantile of rows' leads
        tau = float(s.comm.max(lead.quantile(0.2).reshape(1) if lead.numel() else
                               torch.zeros(1, dtype=torch.float64, device=s.dev))[0])
        while s.phases < max_phases:
            counts = s.counts.cpu().numpy()
            if not ((counts > hi).any() or (counts < lo).any()):
                return True
            bound = hi if (counts > hi).any() else lo
            give, take = np.maximum(counts - bound, 0), np.maximum(bound - counts, 0)
            if pairs is None:
                pairs, built = self._listed(s.all_rows, tau), s.dT
            e, base, rid = self._edges(pairs)
            d, pred = _shortest_paths(e, base, s.dT, k, give > 0)
            at = torch.searchsorted(e, torch.from_numpy(pred).to(s.dev) * k
                                    + torch.arange(k, device=s.dev))
            row_of = (rid.index_select(0, at.clamp(max=e.numel() - 1)).cpu() if e.numel()
                      else torch.zeros(k, dtype=torch.int64))
            moves, D = _route(d, pred, row_of, give, take, tau - float((s.dT - built).max()))
            if D is None:
                needy = d[take > 0]
                if math.isinf(tau) or not len(needy):
                    self.unreached = torch.from_numpy((take > 0) & np.isinf(d)).to(s.dev)
                    return False
                near = float(needy.min())   # (its distance on the listed moves, or inf)
                grown = 2 * max(tau, near) if math.isfinite(near) else math.inf
                tau, pairs = (grown if grown > tau else math.inf), None  # (tau = 0: exact ties)
                continue
            moved = self._apply(moves, d, D)
            gone = torch.zeros(s.labels.numel(), dtype=torch.bool, device=s.dev)
            gone[moved] = True
            keep = ~gone.index_select(0, pairs[0])
            pairs = tuple(torch.cat([p[keep], q]) for p, q in zip(pairs, self._listed(moved, tau)))
            history.append(s.std())
        return False

    def _apply(self, moves, d, D):
        """Raise the potentials (every cluster closer than D by D - d: the tree edges become ties)
        and move the rows; returns the moved rows that live here (local, ascending)."""
        s, dev = self.s, self.s.dev
        s.phases += 1
        s.dT = s.dT + torch.from_numpy(np.where(d < D, D - d, 0.0)).to(dev)
        ids, _, to = zip(*moves)
        ids, to = (torch.tensor(x, dtype=torch.int64, device=dev) for x in (ids, to))
        li = torch.searchsorted(s.rows_global, ids).clamp(max=max(s.rows_global.numel() - 1, 0))
        here = ((s.rows_global.index_select(0, li) == ids) if s.rows_global.numel()
                else torch.zeros_like(ids, dtype=torch.bool))
        s.labels[li[here]] = to[here]
        s.counts = s.count()
        return li[here].unique()

    def _listed(self, rows, tau):
        """(row, pair a * k + b, V_ia - V_ib) of every move a -> b of the local `rows` that costs
        at most tau at the current dT."""
        s, out = self.s, [[], [], []]
        for r, vr, cr, _ in s.blocks(rows):
            lab = s.labels.index_select(0, r)
            at = (lab[:, None] if s.whole else
                  (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            base = vr.gather(1, at) - vr                    # +inf for empty slots (vals = -inf)
            cost = base + s.at(cr) - s.dT.index_select(0, lab)[:, None]
            i, j = ((cost <= tau) & (cr != lab[:, None]) & (base < math.inf)).nonzero(as_tuple=True)
            for o, x in zip(out, (r.index_select(0, i), lab.index_select(0, i) * s.k + cr[i, j],
                                  base[i, j])):
                o.append(x)
        if not out[0]:
            z = torch.zeros(0, dtype=torch.int64, device=s.dev)
            return z, z, torch.zeros(0, dtype=torch.float64, device=s.dev)
        return tuple(torch.cat(o) for o in out)

    def _edges(self, pairs):
        """The cluster graph on the listed moves, all ranks: its edges a * k + b (ascending), each
        one's cheapest V_ia - V_ib and, among equal ones, the lowest global row id."""
        s, W, arg = self.s, self.W, self.arg
        rows, key, base = pairs
        rid = s.rows_global.index_select(0, rows)
        W.scatter_reduce_(0, key, base, "amin")
        hit = base == W.index_select(0, key)
        arg.scatter_reduce_(0, key[hit], rid[hit], "amin")
        if s.comm.on:   # ranks agree on the global cheapest move, then its lowest row id
            W = s.comm.min(self.W.clone())
            arg = s.comm.min(torch.where(self.W == W, self.arg, BIG))
            e = torch.isfinite(W).nonzero()[:, 0]
        else:           # each edge's entry: its row's
            e = key[hit & (rid == arg.index_select(0, key))].sort().values
        out = e, W.index_select(0, e), arg.index_select(0, e)
        self.W[e], self.arg[e] = math.inf, BIG     # (every listed pair on this rank is an edge)
        return out


def _shortest_paths(e, base, dT, k, sources):
    """Distances from the nearest `sources` cluster and predecessors (-1: none), numpy (k,) each,
    by scipy's Dijkstra on the edges e = a * k + b (ascending) of k clusters, an edge costing
    max((base + dT[b]) - dT[a], 0)."""
    a, b = e // k, e % k
    cost = ((base + dT.index_select(0, b)) - dT.index_select(0, a)).clamp_(min=0)
    indptr = torch.zeros(k + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(a, minlength=k).cpu(), 0)
    graph = csr_matrix((cost.cpu().numpy(), b.cpu().numpy(), indptr.numpy()), shape=(k, k))
    d, pred, _ = dijkstra(graph, directed=True, indices=np.flatnonzero(sources), min_only=True,
                          return_predecessors=True)
    return d, np.where(pred < 0, -1, pred).astype(np.int64)


def _route(d, pred, row_of, give, take, trust):
    """One row along each path to a needy cluster, nearest first, no row on two paths: the moves
    (row id, from, to) and the distance D of the last path taken (None: no path within trust)."""
    dl, pl, rl = d.tolist(), pred.tolist(), row_of.tolist()
    gl, tl = give.tolist(), take.tolist()
    used, moves, D = set(), [], None
    for b in np.argsort(d, kind="stable").tolist():
        if not dl[b] <= trust:      # beyond it a move may be left out
            break
        if tl[b] <= 0 or pl[b] < 0:
            continue
        path, x, ok = [], b, True
        while pl[x] >= 0:
            a, i = pl[x], rl[x]
            if i in used:
                ok = False
                break
            path.append((i, a, x))
            x = a
        if not ok or gl[x] <= 0:
            continue
        gl[x] -= 1
        tl[b] -= 1
        used.update(i for i, _, _ in path)
        moves += path
        D = dl[b]
    return moves, D


# ---- The dense path: small k, outputs held whole in one process

def _newton_bufs(n, k, device, scratch=None):
    """Buffers for _newton_counts: (best column, margin, best score, scratch), scratch = (a block of
    scores, its runner-up scores, a dict for the k x N copy of the outputs and the passes'
    constants), shareable.  Reused pass after pass, so that fewer fresh pages are touched.  A
    block: about 4 MiB of float32 scores; 256 MiB on a GPU, where it costs its launches."""
    e = dict(device=device)
    if scratch is None:
        block = min(n, max(1024, (1 << (26 if _launch_bound(device) else 20)) // k))
        scratch = (torch.empty(block, k, dtype=torch.float32, **e),
                   torch.empty(block, dtype=torch.float32, **e), {})
    return (torch.empty(n, dtype=torch.int64, **e), torch.empty(n, dtype=torch.float32, **e),
            torch.empty(n, dtype=torch.float32, **e), scratch)


def _newton_pair(n, k, device):
    """Two _newton_bufs sharing one scratch block: a state and a trial (_newton_T's bufs)."""
    one = _newton_bufs(n, k, device)
    return [one, _newton_bufs(n, k, device, scratch=one[3])]


def _spare(bufs, at):
    """Of a _newton_pair (or [None, None]: fresh buffers), the one `at` does not live in."""
    return bufs[1] if bufs[0] is not None and at[0] is bufs[0][0] else bufs[0]


def _kn_copy(X):
    """X.T as a contiguous float32 k x N tensor; on the host copied in blocks of about 1 MiB of
    rows, which costs less there than one strided copy of all rows."""
    n, k = X.shape
    if _launch_bound(X.device) or X.dtype != torch.float32:
        return X.T.to(torch.float32).contiguous()
    out = torch.empty((k, n), dtype=torch.float32)
    step = max(1024, (1 << 18) // k)
    for s in range(0, n, step):
        out[:, s:s + step].copy_(X[s:s + step].T)
    return out


def _newton_counts(X, T, out=None):
    """(best column, best - runner-up, counts, best score) of X - T, in float32 passes over blocks
    of rows into one scratch block (no N x k temporary); out: _newton_bufs to write into.  For
    small k (KN_COPY_K) on a k x N copy of X kept in the scratch, so that a row's max is a max
    across k contiguous vectors.  The best column is the first at the max."""
    n, k = X.shape
    a1, m, best, (V, v2, keep) = _newton_bufs(n, k, X.device) if out is None else out
    block, T32, gpu = V.shape[0], T.to(torch.float32), _launch_bound(X.device)
    kn = k <= KN_COPY_K_GPU if gpu else k <= KN_COPY_K_CPU
    if kn and keep.get("of") is not X:
        keep.clear()
        keep.update(of=X, Xt=_kn_copy(X), at=torch.empty(block, dtype=torch.int64, device=X.device),
                    first=(k - torch.arange(k, device=X.device)).to(torch.float32)[:, None])
    elif not kn and "first" not in keep:
        keep.update(at=torch.empty(block, dtype=torch.int64, device=X.device),
                    first=(k - torch.arange(k, device=X.device)).to(torch.float32))
    d, Tb = (0, T32[:, None]) if kn else (1, T32)   # (the k x N copy: reduced along dim 0)
    at, first = keep["at"], keep["first"]
    for s in range(0, n, block):
        xb = keep["Xt"][:, s:s + block] if kn else X[s:s + block]
        r = xb.shape[1 - d]
        v = V.view(-1)[:k * r].view(k, r) if kn else V[:r]
        b1, bb = a1[s:s + r], best[s:s + r]
        if gpu:   # 5 launches a block: max with its column, which a scatter drops
            torch.max(torch.sub(xb, Tb, out=v), d, out=(bb, b1))
            v.scatter_(d, b1.unsqueeze(d), -math.inf)
            torch.sub(bb, torch.amax(v, d, out=v2[:r]), out=m[s:s + r])
            continue
        torch.amax(torch.sub(xb, Tb, out=v), d, out=bb)   # (casts float16 / float64 to float32)
        # the first column at the max, from a float32 mask in v's place (cheaper than a bool mask or
        # argmax), then v again without it for the runner-up
        torch.amax(v.eq_(bb if kn else bb[:, None]).mul_(first), d, out=v2[:r])
        b1.copy_(v2[:r]).neg_().add_(k)
        torch.sub(xb, Tb, out=v)
        # that column dropped by flat indices (a scatter along dim 0 costs more)
        flat = torch.arange(r, out=at[:r]).mul_(v.stride(1 - d)).add_(b1, alpha=v.stride(d))
        v.view(-1).index_fill_(0, flat, -math.inf)
        torch.amax(v, d, out=v2[:r])
        torch.sub(bb, v2[:r], out=m[s:s + r])
    return a1, m, torch.bincount(a1, minlength=k), best


def _join_costs(X, T32, lab, best, cols, scratch=None):
    """(clusters, rows) float32: what each row of X (labels `lab`, best scores `best` at T) gives up
    to join each cluster in `cols`, best - (X_j - T_j); inf on the cluster's own rows.  scratch:
    the _newton_bufs scratch, whose k x N copy and score block serve where they fit (the result
    then lives in that block)."""
    n, u = X.shape[0], cols.numel()
    Xt = out = None
    if scratch is not None:
        V, _, keep = scratch
        Xt = keep.get("Xt") if keep.get("of") is X else None
        out = V.view(-1)[:u * n].view(u, n) if V.numel() >= u * n else None
    src = X.T if Xt is None else Xt
    G = (torch.index_select(src, 0, cols) if out is None or src.dtype != torch.float32
         else torch.index_select(src, 0, cols, out=out)).to(torch.float32)
    G = torch.sub(best[None, :], G.sub_(T32.index_select(0, cols)[:, None]), out=G)
    return G.masked_fill_(lab[None, :] == cols[:, None], math.inf)


def _newton_step(X, T, at, e, frac, scratch=None):
    """The Newton step of _newton_T (see there) at T, whose _newton_counts are `at`; scratch:
    the _newton_bufs scratch of X's passes, for _join_costs."""
    k = X.shape[1]
    a1, m, cnt, best = at
    ms = m[::max(1, len(m) // max(H_ROWS, 64 * k))]     # (h from strided margins)
    h = max(float(ms.kthvalue(max(1, int(frac * len(ms)))).values), 1e-30)
    sel = (m < h).nonzero()[:, 0]
    b1 = a1[sel]
    v = X.index_select(0, sel).to(torch.float32) - T.to(torch.float32)
    v[torch.arange(len(sel), device=X.device), b1] = -math.inf
    W = torch.bincount(b1 * k + v.argmax(1), minlength=k * k).to(torch.float64).cpu()  # runner-ups
    W = W.reshape(k, k)
    W = (W + W.T) / (2 * h)
    deg, ec = W.sum(1), e.cpu()
    L = torch.diag(deg + (1e-6 * float(deg.sum()) / k + 1e-12)) - W
    d = torch.linalg.solve(L, ec).clip(-32 * h, 32 * h).to(T.device)
    # clusters whose boundary carries under a tenth of their imbalance (crowded outputs:
    # far from every other cluster): the shift that balances each alone (T_j up to the
    # e_j-th smallest margin of its rows; down to the |e_j|-th cheapest row to join it)
    iso = ((deg * 2 * h < 0.1 * abs(ec)) & (abs(ec) >= 1)).nonzero()[:, 0]
    over, under = iso[ec[iso] > 0], iso[ec[iso] < 0]
    if over.numel():      # each one's (e_j + 1)-th smallest margin, where it has the rows
        want = torch.zeros(k, dtype=torch.int64)
        want[over] = ec.index_select(0, over).to(torch.int64)
        _, b = _gap_after(m, a1, want.to(m.device), k)
        up = torch.zeros(k, dtype=torch.bool)
        up[over] = True
        up = up.to(b.device) & torch.isfinite(b)
        d[up] = b[up].to(torch.float64)
    n = X.shape[0]
    step = max(1, (1 << 24) // n)
    for c in range(0, under.numel(), step):     # their columns read together
        ud = under[c:c + step].to(X.device)
        want = (-ec.index_select(0, ud.cpu())).to(torch.int64).to(X.device)
        ok = ((n - cnt.index_select(0, ud)) > want).nonzero()[:, 0]
        if ok.numel():      # (ok: fewer than the rows of the others, so below n)
            ud, want = ud.index_select(0, ok), want.index_select(0, ok)
            G = _join_costs(X, T.to(torch.float32), a1, best, ud, scratch)
            top = int(want.max()) + 1     # each row's want-th smallest (0-based)
            small = G.topk(top, dim=1, largest=False).values
            d[ud.to(d.device)] = -small.gather(1, want[:, None])[:, 0].to(torch.float64).to(d.device)
    return d


def _shed_step(at, e):
    """An ascending auction round at T (`at` its _newton_counts): every over-full cluster's T_j
    rises to the middle of the gap after its e_j-th smallest margin, so that e_j of its rows would
    leave it if no other T rose; None when no cluster can shed."""
    a1, m, cnt, _ = at
    over = (e >= 1) & (cnt.to(torch.float64) > e)
    if not bool(over.any()):
        return None
    a, b = _gap_after(m, a1, torch.where(over, e.floor().to(torch.int64), 0), cnt.numel())
    return torch.where(over, (a.to(torch.float64) + b.to(torch.float64)) / 2, 0.0)


def _newton_T(X, T, target, max_steps, tol, errs=None, at=None, bufs=None, mode=None):
    """Steps on the counts of argmax(X - T) towards the target: Newton (`_newton_step`, halved up to
    twice while it does not help; h from the closest rows, 5 % up to k = 50, then k / 1000 up to
    20 %) or shedding (`_shed_step`), whichever helps; a Newton step that keeps over 90 % of
    sum |counts - target| is followed by shedding.  Stops at that sum <= tol, after max_steps, or
    when neither helps.  at: the counts at T if known; bufs: two _newton_bufs; mode: a dict kept
    across calls.  Returns (T, counts - target, _newton_counts at T, passes made); errs gets each
    step's error."""
    frac, passes = min(0.2, max(0.05, X.shape[1] / 1000)), 0
    bufs = [None, None] if bufs is None else bufs
    mode = {} if mode is None else mode
    if at is None:
        at, passes = _newton_counts(X, T, out=bufs[0]), 1
    e = at[2].to(torch.float64) - target
    errs = [] if errs is None else errs
    err0 = float(e.abs().sum())
    if not errs or errs[-1] != err0:
        errs.append(err0)
    for _ in range(max_steps):
        err = errs[-1]
        if err <= tol:
            break
        got = None
        for shed in ((True, False) if mode.get("shed") else (False, True)):
            d = (_shed_step(at, e) if shed else
                 _newton_step(X, T, at, e, frac, None if bufs[0] is None else bufs[0][3]))
            if d is None:
                continue
            spare = _spare(bufs, at)
            for s in ((1.0,) if shed else (1.0, 0.5, 0.25)):
                trial = _newton_counts(X, T + s * d, out=spare)
                passes += 1
                e2 = trial[2].to(torch.float64) - target
                if float(e2.abs().sum()) < err:
                    got = trial
                    break
            if got is not None:
                break
        if got is None:
            break       # neither kind helps
        mode["shed"] = not shed and float(e2.abs().sum()) > SHED_AFTER * err
        T = T + s * d
        at, e = got, e2
        errs.append(float(e.abs().sum()))
    return T, e, at, passes


def _near_rows(lab, margin, R, hi):
    """(rows with margin <= R, counts of the others); for a cluster the others would overfill, its
    rows nearest a boundary join too (twice its excess and 32 more).  None when that cannot
    prevent it."""
    k = hi.numel()
    inside = margin <= R
    cnt = torch.bincount(lab, minlength=k)
    ic = cnt - torch.bincount(lab[inside], minlength=k)
    for j in (ic > hi).nonzero()[:, 0].tolist():
        rows = (lab == j).nonzero()[:, 0]
        take = min(len(rows), 2 * int(cnt[j] - hi[j]) + 32)
        inside[rows[torch.sort(margin[rows], stable=True).indices[:take]]] = True
    B = inside.nonzero()[:, 0]
    ic = cnt - torch.bincount(lab[B], minlength=k)
    return None if bool((ic > hi).any()) else (B, ic)


def _dense_translate(outputs, target, seed, tie_eps, start, n_init=8192):
    """translate's fast path for small k on outputs held whole in one process, or None when it
    cannot finish cheaply (then the streaming path runs): Newton steps on the counts in float32
    passes (`_Dense.approach`), then the rows near a boundary solved exactly with the streaming
    path's tie-break (`_Dense.solve`).  Design: docs/labeler.md, 'The dense path'."""
    t0 = time.perf_counter()
    n, k = outputs.shape
    X = outputs.detach()      # read in float32, block by block (_newton_counts)
    start = None if start is None else check_start(start, k)
    # one pass for the largest |O| (the float32 slack below) and for non-finite values, also
    # float64 ones beyond float32 (NaN and +-inf show in the least and largest values)
    ends = [float(v) for s in range(0, n, 65536) for v in X[s:s + 65536].aminmax()]
    if not all(abs(v) < F32_INF for v in ends):
        return None     # the streaming path names the bad row
    head = X[:max(n_init, 1)].to(torch.float32).contiguous()   # (median is wrong on expanded rows)
    T = (_column_medians(head).to(torch.float64) if start is None
         else start.to(device=X.device, dtype=torch.float64).flatten())
    d = _Dense(X, check_target(target, n, k).to(X.device))
    if not d.approach(T):
        return None
    return d.solve(_tie_scale(head, tie_eps), seed, max(abs(v) for v in ends), t0)


class _Dense:
    """_dense_translate's state: the outputs X, the target, the passes' buffers, T, the counts'
    error e and the last _newton_counts `at`."""

    def __init__(self, X, target):
        self.X, self.target, (self.n, self.k), self.dev = X, target, X.shape, X.device
        self.lo, self.hi = count_bounds(target)
        self.passes, self.errs, self.mode = 0, [], {}
        self.tol = max(0.002 * self.n, self.k)

    def _steps(self, X, T, target, steps, tol, **kw):
        T, e, at, p = _newton_T(X, T, target, steps, tol, **kw)
        self.passes += p
        return T, e, at

    def _recount(self):
        """The counts at the current T, in one pass over all rows."""
        self.at = _newton_counts(self.X, self.T, out=_spare(self.bufs, self.at))
        self.passes += 1
        self.e = self.at[2].to(torch.float64) - self.target

    def approach(self, T):
        """Newton steps from T until the counts are near the target; False where they do not get
        near (a network collapsing onto few clusters: the streaming path's auction does better)."""
        X, n, k, target = self.X, self.n, self.k, self.target
        m_rows = max(8192, 64 * k)
        if n >= 4 * m_rows:     # a sample first: its steps cost a fraction of a pass over all rows
            sub = X[::n // m_rows].to(torch.float32)
            T = self._steps(sub, T, target * (sub.shape[0] / n), 8, 0.005 * sub.shape[0],
                            bufs=_newton_pair(*sub.shape, self.dev))[0]
        self.bufs = _newton_pair(n, k, self.dev)    # the passes over all rows write here
        at = None
        if 2 * m_rows <= n < 4 * m_rows:
            # outputs collapsed onto few clusters (more than half of the rows to move from the
            # start): the first steps on every 4th row, as larger inputs take them on a sample
            at = self._steps(X, T, target, 0, self.tol, errs=self.errs, bufs=self.bufs)[2]
            if self.errs[0] > COLLAPSE_SAMPLE * n:
                sub = X[::COLLAPSE_EVERY].to(torch.float32)
                # (down to about the sample's own noise, ~0.8 sqrt(rows k): steps past it do not help)
                T = self._steps(sub, T, target * (sub.shape[0] / n), 8,
                                max(0.005 * sub.shape[0], math.sqrt(sub.shape[0] * k)),
                                bufs=_newton_pair(*sub.shape, self.dev))[0]
                at, self.errs[:] = None, []
        self.T, self.e, self.at = self._steps(X, T, target, 2, self.tol, errs=self.errs,
                                                 bufs=self.bufs, mode=self.mode, at=at)
        if self.errs[-1] > 0.9 * self.errs[0] and self.errs[-1] > 0.1 * n:
            return False     # two steps removed under a tenth of sum |counts - target| > N / 10
        full_steps = 0
        while (self.errs[-1] > self.tol and full_steps < 24
               and (full_steps < 8 or self.errs[-1] > PAST_8 * n)):
            # (past 8 steps only while the error is over 1 % of N: the exact solve would be slow there)
            T1, self.e, self.at = self._steps(X, self.T, target, 1, self.tol, at=self.at,
                                                 errs=self.errs, bufs=self.bufs, mode=self.mode)
            full_steps += 1
            if T1 is self.T:
                break       # no step helped
            self.T = T1
        # the Newton steps did not get near: a network collapsing onto few clusters
        return float(self.e.clamp(min=0).sum()) <= 0.05 * self.n

    def _want(self):
        """How many rows to solve: 2 % of N, or 8 a row still to move and k."""
        return max(int(DENSE_SHARE * self.n),
                   int(DENSE_PER_MOVE * (float(self.e.clamp(min=0).sum()) + self.k)))

    def solve(self, eps, seed, top, t0):
        """The exact solve of the rows near a boundary (see _dense_translate), or None.  Where a
        row left out changes cluster at the solve's T (outputs collapsing onto few clusters, whose
        margins are small), again from that T with twice the rows, twice at most."""
        n, k, dev, history = self.n, self.k, self.dev, []
        for attempt in range(3):
            labels, margin = self.at[:2]
            want = min(self._want() << attempt, n)
            st = max(1, n // R_ROWS)     # (the margin of about `want` rows, from a strided sample)
            R = float(margin[::st].kthvalue(-(-want // st)).values) if want < n else math.inf
            got = _near_rows(labels, margin, R, self.hi)
            if got is None or got[0].numel() * k * 10 > (1 << 30):
                return None     # (the streaming path keeps candidate lists where rows do not fit)
            B, ic = got
            solver = self._solve_rows(B, ic, eps, seed, history)
            if solver is None:
                return None
            dT, sol_labels, sol_counts = (t.to(dev) for t in (solver.dT, solver.labels, solver.counts))
            self.T = self.T + dT
            slack = 2.0 ** -20 * (float(top) + float(self.T.abs().max())) + 4 * eps   # float32 margins
            if float(dT.max() - dT.min()) + slack < R:
                break
            # T moved further than the margin kept: one pass at the solve's T says whether a row
            # left out changed its column or came within float32's rounding of doing so
            labels = labels.clone()
            self._recount()
            out = torch.ones(n, dtype=torch.bool, device=dev)
            out[B] = False
            if not bool((out & ((self.at[0] != labels) | (self.at[1] <= slack))).any()):
                break
            if attempt == 2:
                return None     # (_recount set self.at and self.e at this T for the next try)
        labels[B] = sol_labels
        return self._result(labels, ic + sol_counts, solver, history, B.numel(), t0)

    def _solve_rows(self, B, ic, eps, seed, history):
        """The solver on the rows B (whole, with the tie-break) for target - ic; None where no
        move reaches a cluster that needs rows.  A small solve runs on the host where the outputs
        are on a GPU: its rounds are a few kernels on small arrays each, which the GPU runs no
        faster and waits for the host in."""
        k = self.k
        sdev = torch.device("cpu") if B.numel() * k <= HOST_SOLVE else self.dev
        Bs = B.to(sdev)
        vals = (self.X.index_select(0, B).to(sdev, torch.float64) - self.T.to(sdev)
                + eps * _tie_jitter(Bs, torch.arange(k, device=sdev).expand(B.numel(), k), seed))
        tB, loB, hiB = (t.to(sdev) for t in (self.target - ic, (self.lo - ic).clamp(min=0), self.hi - ic))
        solver = _Solver(_whole_parts(vals), k, tB, loB, hiB, _Comm(False), Bs)
        solver.auction(200, history)
        if not _Finish(solver).run(history):
            return None
        solver.strictify(keep_balance=eps > 0)
        return solver

    def _result(self, labels, counts, solver, history, active, t0):
        tc = self.target.cpu()
        return ScaleResult(labels=labels, T=self.T, counts=counts, target=tc,
                           iterations=self.passes + solver.rounds + solver.phases,
                           std_history=history, std=counts_std(counts.cpu(), tc),
                           std_max=worst_std(tc, self.n), seconds=time.perf_counter() - t0,
                           stop_reason="balanced", refetched=0, ties=solver.ties,
                           ties_left=solver.ties_left, active=active)
