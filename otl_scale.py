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

Imports `otl` (never the other way), numpy and scipy (its Dijkstra finishes the solve).  The
stages in the order a call runs them: the start and candidate lists (`StreamingTranslator`), the
solver on them (`_ExactSolver`: the published step far from balance, an ascending auction, the
exact finish by shortest paths in `_Finish`, strict ties), and the dense path for small k held in
memory (`_dense_translate`: Newton steps on the counts, then the solver on the rows near a
boundary).  Design and measurements: docs/labeler.md."""
from __future__ import annotations

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
RADIUS_ROWS = 2048      # the first radius and the window from the first this many rows
APPROACH_SHARE = 0.02   # the published step first while the excess is over this share of the rows
AUCTION_STALL = 6       # the auction stops when 6 rounds removed under a fifth of the excess
TABLE_AT_ONCE = 256     # whole rows at larger k: the finish's k x k table at once, no move list
DENSE_SHARE, DENSE_PER_MOVE = 0.02, 8   # dense path: the rows to solve (2 % of N, 8 a row to move)
DENSE_POOL = 0.5        # Newton steps go on with the rows near a boundary once at most half of N
SHED_AFTER = 0.9        # a Newton step keeping more of sum |counts - target| is followed by a shed
PAST_8 = 0.01           # full-row steps past 8 while sum |counts - target| > 1 % of N
FEW_CHANGED = 0.01      # a failed dense solve retries from its own T when under 1 % of rows changed
COLLAPSE_SAMPLE, COLLAPSE_EVERY = 1.0, 4   # excess over N at the start: steps on every 4th row
KN_COPY_K_GPU, KN_COPY_K_CPU = 32, 63   # Newton passes on a k x N copy up to this k (GPU, host)
R_ROWS, H_ROWS = 4096, 2048   # dense path: R and the step's bandwidth h from strided margins
HOST_SOLVE = 1 << 18    # outputs on a GPU: the dense path's exact solve on the host up to rows x k
F32_INF = 2.0 ** 128 - 2.0 ** 103   # float64 values from here on round to inf in float32


@dataclass
class ScaleResult(TranslateResult):
    refetched: int = 0            # rows re-read in full (their candidate lists fell short)
    active: int = 0               # rows solved (the others kept their best cluster)


def _within(counts, lo, hi) -> bool:
    """Whether every count is within its bounds [lo, hi] (otl.count_bounds)."""
    return bool(((counts >= lo) & (counts <= hi)).all())


def translate(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
              patience: int = 10, max_iter: int = 10000, tie_eps=None, seed: int = 0,
              init: str = "median", method: str = "exact", candidates: int = 24,
              max_candidates: int = 48, full_rows_up_to: int = 128,
              full_rows_bytes: int = 1 << 30, start=None, sample_start: bool = True,
              dense: bool = True, n_init: int = 8192) -> TranslateResult:
    """otl.translate's problem and guarantees: T with labels = argmax(O - T) and every count within
    1 of the target (even by default).  With dense, for 2 <= k <= full_rows_up_to and N >= 64 k,
    the dense path runs first (`_dense_translate`); otherwise, or where it cannot finish, O is fed
    in chunks to `StreamingTranslator`, whose settings these are (tie_eps defaults to 2**-26).
    start: a T to start from instead of the column medians (the other view's, the last epoch's).
    sample_start: without a start, for k > 2 x full_rows_up_to and outputs far from balance at
    their medians, start from the exact T of every 4th row (`sample_start_T`).  method=
    "published" (beta, alpha0, patience, max_iter, tie_eps default 1e-6, seed, init) and
    "sinkhorn" are otl.translate's."""
    if method in ("published", "sinkhorn"):
        if method == "sinkhorn":
            return otl.translate(outputs, target=target, method="sinkhorn", start=start)
        return otl.translate(outputs, target=target, method="published", start=start, beta=beta,
                             alpha0=alpha0, patience=patience, max_iter=max_iter,
                             tie_eps=1e-6 if tie_eps is None else tie_eps, seed=seed, init=init)
    if method != "exact":
        raise ValueError(f"method must be 'exact', 'published' or 'sinkhorn', got {method!r}")
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    otl.check_outputs(outputs, finite=False)     # checked chunk by chunk, without an N x k copy
    n, k = outputs.shape
    tie_eps = 2.0 ** -26 if tie_eps is None else tie_eps
    if dense and 2 <= k <= full_rows_up_to and n >= 64 * k:
        res = _dense_translate(outputs, target, seed, tie_eps, start, n_init)
        if res is not None:
            return res
    if start is None and sample_start and k > 2 * full_rows_up_to:
        start = sample_start_T(outputs, target=target, seed=seed, candidates=candidates,
                               max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                               tie_eps=tie_eps)
    st = StreamingTranslator(k, target=target, seed=seed, candidates=candidates,
                             max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                             distributed=False, rows_hint=n, full_rows_bytes=full_rows_bytes,
                             tie_eps=tie_eps, start=start, n_init=n_init)
    for s in range(0, n, st.chunk):
        st.add(outputs[s:s + st.chunk])
    return st.result(refetch=lambda rows: outputs[rows.to(outputs.device)])


def sample_start_T(outputs: torch.Tensor, target=None, every=None, probe: int = 2048, **kw):
    """A start T for the exact labeler on outputs held whole: the exact T of every `every`-th row
    (default 4; 8 on a GPU where N >= 8 k, as a round there costs its launches whatever its rows),
    the target scaled to them.  None where it would not pay: k <= 2 x full_rows_up_to, fewer than
    every x k rows, or the first `probe` rows near balance at their column medians (`_far`).  On
    real networks' outputs the medians are far from the answer and many candidate lists fall short
    and are read again; from the sample's T few do.  kw: translate's settings for the sample."""
    n, k = outputs.shape
    if every is None:
        every = 8 if _launch_bound(outputs.device) and n >= 8 * k else 4
    if k <= 2 * kw.get("full_rows_up_to", 128) or n < every * k:
        return None
    head = outputs[:probe].to(torch.float32).contiguous()    # (median is wrong on expanded rows)
    cnt = torch.bincount((head - _column_medians(head)).argmax(1), minlength=k)
    if not _far(cnt.to(torch.float64), target):
        return None
    sub = outputs[::every]
    if target is not None:    # the same shares of the sample's rows
        target = check_target(target, n, k).to(torch.float64) * (sub.shape[0] / n)
    kw = {key: val for key, val in kw.items() if val is not None}
    try:
        return translate(sub, target=target, sample_start=False, **kw).T
    except ValueError:     # bad outputs or target: the whole call says so, with its own row numbers
        return None


def _column_medians(A):
    """A.median(dim=0).values (the lower middle value) of a float (n, k) tensor, by numpy's
    partition of a host copy's columns: several times cheaper than torch's median on a CPU."""
    i = (A.shape[0] - 1) // 2
    B = np.array(A.detach().cpu().to(torch.float64 if A.dtype == torch.float64 else torch.float32)
                 .numpy().T, order="C")
    B.partition(i, axis=-1)
    return torch.from_numpy(np.array(B[:, i])).to(A.device)


def _launch_bound(device):
    """Whether each torch operation on `device` costs a launch (and a wait where the host reads its
    result) more than its work at the labeler's sizes: a GPU.  There passes go over all rows at
    once, not over blocks sized for a CPU's cache."""
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

    def _on_backend(self, x, collective):
        """collective(y) in place on x, moved to the backend's device and back."""
        if not self.on:
            return x
        y = x.to(self.dev)
        collective(y)
        return y if y is x else y.to(x.device)

    def sum(self, x):
        return self._on_backend(x, lambda y: self.dist.all_reduce(y, op=self.dist.ReduceOp.SUM))

    def max(self, x):
        return self._on_backend(x, lambda y: self.dist.all_reduce(y, op=self.dist.ReduceOp.MAX))

    def min(self, x):
        return self._on_backend(x, lambda y: self.dist.all_reduce(y, op=self.dist.ReduceOp.MIN))

    def broadcast(self, x):
        return self._on_backend(x, lambda y: self.dist.broadcast(y, src=0))

    def total(self, n: int) -> int:
        """A count summed over ranks."""
        return int(self.sum(torch.tensor([n]))[0])


# ---- Streaming: the start, the candidate lists, the working set

@dataclass
class _Start:
    """What the first rows fix, rank 0's for every rank."""
    T0: torch.Tensor              # (k,) float64, the start translation (column medians or start=)
    eps: float = 0.0              # the tie-break's size (_tie_scale)
    window: float = 0.0           # a row keeps the columns within this of its best at T0
    radius0: float = 0.0          # the first solve's radius (_first_radius)
    whole: bool = False           # keep whole rows though k > full_rows_up_to (far outputs)
    far: bool = False             # the first rows' counts far from the target (_far)

    def broadcast(self, comm):
        """Rank 0's start on every rank: T0 and the numbers after it in one broadcast."""
        if not comm.on:
            return self
        k = self.T0.numel()
        v = torch.cat([self.T0.cpu(), torch.tensor(
            [self.eps, self.window, self.radius0, self.whole, self.far],
            dtype=torch.float64)])
        v = comm.broadcast(v)
        eps, window, radius0, whole, far = v[k:].tolist()
        return _Start(v[:k].to(self.T0.device), eps, window, radius0, whole > 0, far > 0)


def _first_radius(rows, T):
    """The first radius: the 0.2 quantile of the leads (best - runner-up) of 2048 rows at T."""
    top2 = (rows[:RADIUS_ROWS] - T.to(rows.dtype)).topk(2, dim=1).values
    return (top2[:, 0] - top2[:, 1]).to(torch.float64).quantile(0.2)


def _head_target(target_arg, n, k):
    """The target's shares scaled to n rows (the even target without one; result() checks the
    target itself)."""
    if target_arg is not None:
        try:
            t = torch.as_tensor(target_arg, dtype=torch.float64).flatten().cpu()
            if t.numel() == k and bool(torch.isfinite(t).all()) and t.sum() > 0:
                return t / t.sum() * n
        except (TypeError, ValueError, RuntimeError):
            pass
    return otl.even_target(n, k)


def _far(cnt, target_arg=None):
    """Whether the first rows' counts at the column medians are far from the target: their mean
    squared deviation over the mean count (about 1 for sampling noise) is over 4.  Far outputs
    also skip result()'s narrow first solve, as their translation moves most rows."""
    n, k = int(cnt.sum()), cnt.numel()
    target = _head_target(target_arg, n, k)
    return float(((cnt - target.to(cnt.device)) ** 2).mean()) > 4 * n / k


def _hits(W, fw, kp):
    """(rows, columns) of the hits in the int64 words fw (ascending) of the int8 mask W, in
    row-major order; kp columns a row."""
    hit = W.index_select(0, fw).view(torch.int8).nonzero()[:, 0]   # (c,) word * 8 + byte
    g = fw.index_select(0, hit >> 3).mul_(8).add_(hit & 7)  # flat positions in M, ascending
    rr = torch.div(g, kp, rounding_mode="floor")            # rows, ascending
    return rr, g.sub_(rr * kp)


class _Store:
    """The candidate lists of the rows added: per stored piece vals (n, w) O - T0 of each row's
    candidates (-inf in empty slots), cols (n, w) their clusters, theta (n,) a bound at T0 on the
    columns dropped.  `kept`: the local rows still stored (None: all), once the rows to solve
    have been taken out (`take`), so that no row is held twice."""

    def __init__(self, k, width, cdtype, start: _Start, seed, device, block):
        self.k, self.width, self.cdtype, self.seed = k, width, cdtype, seed
        self.dev, self.block = device, block
        self.vals, self.cols, self.theta, self.n, self.kept = [], [], [], 0, None
        self._diff = self._mask = None      # extraction buffers, reused block after block
        self.recentre(start.T0)
        self.eps, self.window = start.eps, start.window

    def recentre(self, T0):
        """T0 as float64, float32 (exact for float32 outputs: medians of them) and its largest
        |entry| (float64 outputs: the float32 T0 errs by 2^-24 of it)."""
        self.T0, self.T0f, self.T0abs = T0, T0.to(torch.float32), float(T0.abs().max())

    def append(self, vals, cols, theta):
        self.vals.append(vals)
        self.cols.append(cols if cols.dtype == self.cdtype else cols.to(self.cdtype))
        self.theta.append(theta)
        self.n += vals.shape[0]

    def add_whole(self, X):
        """Rows kept whole: every column, in order (the tie-break is added in add_jitter)."""
        check_finite(X, self.n)
        n = X.shape[0]
        cols = torch.arange(self.k, device=self.dev).expand(n, self.k)
        self.append(X.to(torch.float64) - self.T0, cols,
                    torch.full((n,), -math.inf, dtype=torch.float64, device=self.dev))

    def add_block(self, X, first):
        """Candidates of one block of rows X (float32 or float64; global row numbers from
        `first`), in passes that write nothing N x k sized."""
        n, w, k = X.shape[0], self.width, self.k
        thr, M, rr, cc, pos, cnt, many, oi, whole = self._window_hits(X)
        # fl(X - T0) errs by at most 2^-24 |S| (float64 outputs: T0f errs by 2^-24 |T0| too): a
        # per-row allowance keeps theta a true bound on every dropped column, whatever the blocks
        thr64 = thr.to(torch.float64)
        t0abs = self.T0abs if X.dtype == torch.float64 else 0.0
        theta = thr64 + 2.0 ** -22 * (thr64.abs() + t0abs) + self.eps
        theta[cnt >= k] = -math.inf                             # nothing was dropped
        # flat (n * w) tables with one spare slot at the end for the entries not kept
        vals = torch.full((n * w + 1,), -math.inf, dtype=torch.float64, device=self.dev)
        cols = torch.zeros(n * w + 1, dtype=self.cdtype, device=self.dev)
        at = rr * w + pos

        def exact(r, c):   # O - T0 in float64 at rows r, columns c
            return X.reshape(-1).index_select(0, r * k + c).to(torch.float64) - self.T0.index_select(0, c)

        val = exact(rr, cc)
        if oi.numel() > 0:   # more than w near the top: keep the best w of them, bound the rest
            # exact values with the tie-break, so that exactly tied outputs (a collapsed network)
            # keep different columns on different rows
            if whole:                                           # most of these rows' columns
                PC = torch.arange(k, device=self.dev).expand(oi.numel(), k)
                P = self.whole_rows(X.index_select(0, oi), oi + first)
            else:
                P, PC = self._crowded(val, rr, cc, pos, cnt, many, oi, first)
            tv, ti = P.topk(w + 1, dim=1)                      # (o, w + 1) among the candidates
            theta[oi] = torch.maximum(theta[oi], tv[:, w])    # the same sum as result() makes
            kept_cols = PC.gather(1, ti[:, :w]).reshape(-1)         # (o * w,)
            om = (oi[:, None] * w + torch.arange(w, device=self.dev)).view(-1)
            vals.index_copy_(0, om, exact(oi.repeat_interleave(w), kept_cols))
            cols.index_copy_(0, om, kept_cols.to(self.cdtype))
            if not whole:
                at = torch.where(many.index_select(0, rr), n * w, at)   # the rest: the spare slot
        vals.index_copy_(0, at, val)                                    # exact
        cols.index_copy_(0, at, cc.to(self.cdtype))
        self.append(vals[:n * w].view(n, w), cols[:n * w].view(n, w), theta)

    def _window_hits(self, X):
        """The columns within the window of each row's best at T0: S = X - T0 into a reused
        buffer, its row maxima, a reused int8 mask S >= max - window, read 8 columns at a time as
        int64 words (almost every word is 0).  Returns (threshold, mask, rows and columns of the
        listed hits, each hit's place in its row, hits per row, rows with over `width` hits,
        their indices, whether those are taken whole)."""
        n, k, w, dev = X.shape[0], self.k, self.width, self.dev
        kp = (k + 7) // 8 * 8
        # S = X - T0 a few rows at a time (on the CPU small enough to stay in cache), then
        # D = S - (row max - window) in place; the mask D >= 0 is int8 -1 / 0 from D's sign bit,
        # cheaper than a comparison writing bool.  fl(S - thr) >= 0 exactly when S >= thr.
        sub = n if _launch_bound(dev) else max(1, (4 << 20) // (4 * kp))
        if self._mask is None or self._mask.shape[0] < n:
            self._diff = torch.full((min(max(n, self.block), sub), kp), -math.inf,
                                    dtype=torch.float32, device=dev)   # columns >= k stay -inf
            self._mask = torch.empty((max(n, self.block), kp), dtype=torch.int8, device=dev)
        M, rmax = self._mask[:n], torch.empty(n, dtype=torch.float32, device=dev)
        for s in range(0, n, sub):
            e = min(s + sub, n)
            D = self._diff[:e - s]
            torch.sub(X[s:e], self.T0f, out=D[:, :k])
            torch.amax(D, 1, out=rmax[s:e])
            torch.sub(D, (rmax[s:e] - self.window)[:, None], out=D)
            M[s:e].copy_(D.view(torch.int32).bitwise_right_shift_(31)).bitwise_not_()
            if kp > k:   # the shift turned the -inf padding into NaN
                D[:, k:] = -math.inf
        if not bool(torch.isfinite(rmax).all()):   # NaN and +inf show here (amax keeps NaN);
            check_finite(X, self.n)                 # -inf never makes a candidate, so it may stay
        # Rows with a hit in 9 / 10 of their words or more ("dense") are counted by a sum over
        # their mask and listed only if not taken whole.  Rows with more than w hits keep their
        # best w by exact value with the tie-break; where those rows hold most of their columns
        # they are taken whole, unlisted (on collapsed outputs every column is a hit).
        W = M.view(-1).view(torch.int64)
        kw = kp // 8
        fw = W.nonzero()[:, 0]                                  # the words with a hit, ascending
        frow = torch.div(fw, kw, rounding_mode="floor")
        dense = torch.bincount(frow, minlength=n) * 10 >= 9 * kw
        di = dense.nonzero()[:, 0]
        if di.numel():
            fw = fw[~dense.index_select(0, frow)]
        rr, cc = _hits(W, fw, kp)
        cnt = torch.bincount(rr, minlength=n)                   # hits per row
        if di.numel():
            cnt.index_copy_(0, di, M.index_select(0, di).sum(1, dtype=torch.int32).neg_().long())
        many = cnt > w
        oi = many.nonzero()[:, 0]
        whole = oi.numel() > 0 and int(cnt.index_select(0, oi).sum()) > 0.3 * oi.numel() * k
        if whole:                                               # rows taken whole: not listed
            keep = ~many.index_select(0, rr)
            if not bool(keep.all()):
                rr, cc = rr[keep], cc[keep]
        back = di if not whole else di[~many.index_select(0, di)]   # dense rows still to list
        if back.numel():
            d_rr, d_cc = _hits(W, (back[:, None] * kw + torch.arange(kw, device=dev)).view(-1), kp)
            order = torch.cat([rr * kp + cc, d_rr * kp + d_cc]).sort().indices
            rr, cc = torch.cat([rr, d_rr])[order], torch.cat([cc, d_cc])[order]
        listed = torch.bincount(rr, minlength=n)                # hits per row listed
        pos = torch.arange(rr.numel(), device=dev) - (torch.cumsum(listed, 0) - listed).index_select(0, rr)
        return rmax - self.window, M, rr, cc, pos, cnt, many, oi, whole

    def _crowded(self, val, rr, cc, pos, cnt, many, oi, first):
        """The listed hits of the rows with over `width` of them, with the tie-break, as an
        (o, most hits) table of values (-inf in empty slots) and one of their columns."""
        e = many.index_select(0, rr).nonzero()[:, 0]    # their entries
        re, ce, pe = rr.index_select(0, e), cc.index_select(0, e), pos.index_select(0, e)
        slot = torch.cumsum(many, 0).index_select(0, re) - 1
        P = torch.full((oi.numel(), int(cnt.max())), -math.inf, dtype=torch.float64, device=self.dev)
        PC = torch.zeros(P.shape, dtype=torch.int64, device=self.dev)
        ae = slot * P.shape[1] + pe
        P.view(-1).index_copy_(0, ae, val.index_select(0, e) + self.eps * _tie_jitter(
            re + first, ce[:, None], self.seed)[:, 0])
        PC.view(-1).index_copy_(0, ae, ce)
        return P, PC

    def add_jitter(self, offset):
        """The tie-break eps * u(global row, column) added to every stored value (-inf stays)."""
        start = 0
        for vals, cols in zip(self.vals, self.cols):
            for s in range(0, vals.shape[0], self.block):
                vs, cs = vals[s:s + self.block], cols[s:s + self.block].long()
                rows = torch.arange(start + s, start + s + vs.shape[0], device=self.dev)
                vs.add_(_tie_jitter(rows + offset, cs, self.seed), alpha=self.eps)
            start += vals.shape[0]

    def chunks(self):
        """(first row, vals, cols, theta) of every stored piece of at most `block` rows."""
        s = 0
        for vals, cols, theta in zip(self.vals, self.cols, self.theta):
            for t in range(0, vals.shape[0], self.block):
                yield s + t, vals[t:t + self.block], cols[t:t + self.block], theta[t:t + self.block]
            s += vals.shape[0]

    def take(self, rows, prev=None):
        """vals, cols, theta, epoch and cuts (see _ExactSolver) of the local rows `rows`
        (ascending), moved out of the store piece by piece, so that they are never held twice.
        prev: (rows, solver) of an earlier solve on some of them, whose newer candidates are taken
        instead (cut back to the store's width if it took whole rows)."""
        w, dev, n_out = self.width, self.dev, rows.numel()
        out = (torch.empty(n_out, w, dtype=torch.float64, device=dev),
               torch.empty(n_out, w, dtype=self.cdtype, device=dev),
               torch.empty(n_out, dtype=torch.float64, device=dev))
        epoch = torch.zeros(n_out, dtype=torch.int64, device=dev)    # the store's rows: chosen at T0
        cuts = torch.zeros(1, self.k, dtype=torch.float64, device=dev)
        dst = None                       # where the store's rows go in `out` (None: in order)
        if prev is not None:
            prows, sv = prev
            at = torch.searchsorted(rows, prows)
            parts, cuts, ep = (sv.vals, sv.cols, sv.theta), sv.cuts, sv.epoch
            if sv.vals.shape[1] != w:       # whole rows (the fallback): their best w at its T
                bound = sv.theta - sv.rise().index_select(0, sv.epoch)
                parts = self.cut(sv.vals, sv.dT, sv.cols, bound)
                cuts = torch.cat([sv.cuts, sv.dT[None, :]])
                ep = torch.full_like(sv.epoch, cuts.shape[0] - 1)
            for o, p in zip(out, parts):
                o.index_copy_(0, at, p.to(o.dtype))
            epoch.index_copy_(0, at, ep)
            new = torch.ones(n_out, dtype=torch.bool, device=dev)
            new[at] = False
            dst = new.nonzero()[:, 0]
            rows = rows.index_select(0, dst)
        self._move_out(rows, out, dst)
        return (*out, epoch, cuts)

    def _move_out(self, rows, out, dst):
        """The stored rows `rows` into `out` (at dst, or in order), each piece freed once split."""
        pos = rows if self.kept is None else torch.searchsorted(self.kept, rows)   # in the store
        left = torch.ones(sum(v.shape[0] for v in self.vals), dtype=torch.bool, device=self.dev)
        left[pos] = False
        self.kept = (torch.arange(left.numel(), device=self.dev) if self.kept is None
                     else self.kept)[left]
        pieces, self.vals, self.cols, self.theta = list(zip(self.vals, self.cols, self.theta)), [], [], []
        start = 0
        for i in range(len(pieces)):
            parts, pieces[i] = pieces[i], None
            end = start + parts[0].shape[0]
            lo, hi = torch.searchsorted(pos, torch.tensor([start, end], device=self.dev)).tolist()
            idx = pos[lo:hi] - start
            for o, p in zip(out, parts):
                if dst is None:
                    torch.index_select(p, 0, idx, out=o[lo:hi])
                else:
                    o.index_copy_(0, dst[lo:hi], p.index_select(0, idx))
            if hi - lo < parts[0].shape[0]:          # the rows that stay
                keep = left[start:end]
                for store, p in zip((self.vals, self.cols, self.theta), parts):
                    store.append(p if hi == lo else p[keep])
            start = end

    def whole_rows(self, X, grows):
        """O - T0 + eps u for every column of the rows X, whose global numbers are `grows`: the
        values the candidates hold once the tie-break is added."""
        cols = torch.arange(self.k, device=self.dev).expand(X.shape[0], self.k)
        V = X.to(torch.float64).sub_(self.T0)     # in place: the same sums, fewer n x k buffers
        return V.add_(_tie_jitter(grows, cols, self.seed).mul_(self.eps))

    def full_rows(self, X, grows, dT):
        """Candidates of the rows X (global numbers `grows`) from their full outputs, chosen
        against the current translation T0 + dT, so that the dropped columns cannot win."""
        # the best `width` + 1 columns without the tie-break (hashing every column is costly), then
        # the kept columns' exact values; a dropped column scores at most the (w+1)-th plus eps
        w = self.width
        S = X.to(torch.float64) - (self.T0 + dT)
        tv, ti = S.topk(w + 1, dim=1)
        del S
        ti = ti[:, :w]
        vals = (X.gather(1, ti).to(torch.float64) - self.T0.index_select(0, ti.reshape(-1)).view(ti.shape)
                + self.eps * _tie_jitter(grows, ti, self.seed))
        b, scale = tv[:, w], float(self.T0.abs().max()) + float(dT.abs().max()) + self.eps
        slack = 2.0 ** -50 * (b.abs() + scale)
        theta = torch.where(torch.isfinite(b), b + self.eps + slack, b)
        # Where the w-th best leads the (w+1)-th by more than eps, these are the best w with the
        # tie-break too.  Elsewhere (within eps, as on collapsed rows) the tie-break decides: those
        # rows' best w are chosen on their exact values with it, as the stream chose them
        tied = (tv[:, w - 1] - b <= self.eps + 2 * slack).nonzero()[:, 0]
        if tied.numel():
            V = self.whole_rows(X.index_select(0, tied), grows.index_select(0, tied))
            vals[tied], c2, b2 = self.cut(V, dT)
            ti[tied] = c2.long()
            theta[tied] = torch.where(torch.isfinite(b2), b2 + 2.0 ** -50 * (b2.abs() + scale), b2)
        return vals, ti.to(self.cdtype), theta

    def cut(self, S, dT, cols=None, theta=None):
        """(vals, cols, theta) of each row's best `width` entries of S at the translation dT, theta
        a bound on the rest at dT.  cols: the columns of S's entries (None: every column); theta: an
        earlier bound, at dT, on the columns S lacks."""
        w = self.width
        dT_at = dT if cols is None else dT.index_select(0, cols.reshape(-1).long()).view(cols.shape)
        tv, ti = (S - dT_at).topk(w + 1, dim=1)
        ti = ti[:, :w]
        bound = tv[:, w]
        return (S.gather(1, ti), (ti if cols is None else cols.gather(1, ti)).to(self.cdtype),
                bound if theta is None else torch.maximum(theta, bound))


class StreamingTranslator:
    """Output translation fed batch by batch, never holding the N x k outputs: `st.add(batch)` for
    each (n_b, k) batch in row order, then `st.result(refetch)` once; refetch(global rows) gives
    rows' outputs again where their candidate lists fell short.  The first `n_init` rows fix the
    start (`_Start`).  Rows are kept whole when k <= full_rows_up_to (or k <= 2 x that, far from
    balance, and rows_hint x k x 10 bytes <= full_rows_bytes); else each keeps the columns within
    a window of its best at T0 (about `candidates`, at most `max_candidates`) and a bound on the
    rest.  Distributed: each rank adds its shard in rank order (row_offset: its first row's global
    number) and gets its rows' labels; only k-vectors and k x k tables travel.  NaN and +-inf
    raise.  Design: docs/labeler.md, 'Streaming'."""

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
        self.full_rows_up_to = int(full_rows_up_to)
        # whole rows by k alone, or by _far (_start_from)
        self.small_k = self.k <= max(2 * self.max_candidates, self.full_rows_up_to)
        self.rows_hint = None if rows_hint is None else int(rows_hint)
        self.full_rows_bytes = int(full_rows_bytes)
        self.start = None if start is None else check_start(start, self.k)
        self.buffer, self.nbuf = [], 0
        self.store, self.s, self.device, self.t0, self.used = None, None, None, None, False

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
        """The start from the first n_init rows (rank 0's on every rank), then those rows stored."""
        pieces, self.buffer, self.nbuf = self.buffer, [], 0
        parts, got = [], 0     # the head: a copy of the first n_init rows only
        for p in pieces:
            if got >= self.n_init:
                break
            parts.append(p[:self.n_init - got])
            got += parts[-1].shape[0]
        head = torch.cat(parts).contiguous() if parts else torch.zeros(0, self.k)
        self.device = head.device
        head = head if head.dtype == torch.float64 else head.to(torch.float32)
        s = (self._start_from(head) if head.shape[0] > 0 else
             _Start(torch.zeros(self.k, dtype=torch.float64, device=self.device)))
        self.s = s = s.broadcast(self.comm)
        self.all_cols = self.small_k or s.whole
        # at least 2 eps: columns within eps of a row's best can still win by the tie-break, so they
        # must be candidates (on collapsed outputs the gaps, and so the window, are 0)
        s.window = math.inf if self.all_cols else max(s.window, 2 * s.eps)
        s.radius0 = max(s.radius0, s.eps)
        width = self.k if self.all_cols else self.max_candidates
        cdtype = torch.int16 if self.k < 32768 else torch.int32
        # rows per pass: BLOCK on the CPU, so a pass's temporaries stay in cache; `chunk` on a GPU
        block = self.chunk if _launch_bound(self.device) else BLOCK
        self.store = _Store(self.k, width, cdtype, s, self.seed, self.device, block)
        for p in pieces:
            for i in range(0, p.shape[0], self.chunk):
                self._extract(p[i:i + self.chunk])

    def _start_from(self, head):
        """This rank's start from its first rows `head` (float32, or float64 as given)."""
        k = self.k
        check_finite(head)
        T0 = (_column_medians(head).to(torch.float64) if self.start is None
              else self.start.to(self.device))
        cnt = torch.bincount((head - T0.to(head.dtype)).argmax(1), minlength=k).to(torch.float64)
        far = _far(cnt, self.target_arg)
        whole = self.small_k or (far and k <= 2 * self.full_rows_up_to and self.rows_hint is not None
                                 and self.rows_hint * k * 10 <= self.full_rows_bytes)
        window = 0.0
        if not whole:   # the window: a typical row's `candidates`-th largest gap
            S = head[:RADIUS_ROWS] - T0.to(head.dtype)
            gaps = S.amax(1, keepdim=True) - S
            window = gaps.kthvalue(min(self.candidates, k), dim=1).values.median().item()
        return _Start(T0, _tie_scale(head, self.tie_eps), window, _first_radius(head, T0).item(),
                      whole and not self.small_k, far)

    def _extract(self, X: torch.Tensor):
        X = X.to(self.device)
        if X.shape[0] == 0:
            return
        if X.dtype != torch.float64:
            X = X.to(torch.float32)
        if self.all_cols:
            return self.store.add_whole(X)
        for s in range(0, X.shape[0], self.store.block):
            self.store.add_block(X[s:s + self.store.block], self.store.n + self.row_offset)

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
        self.store.add_jitter(self.offset)   # now the global row numbers are known
        self.store._diff = self.store._mask = None        # the extraction buffers
        solver, ic, n_act, refetched, history = self._solve_growing(
            n_total, target, lo, hi, refetch, max_rounds)
        labels = solver.lab0
        labels[solver.act] = solver.labels
        counts = ic + solver.counts
        ok = _within(counts, lo, hi)
        if not ok:
            warnings.warn(
                f"the exact labeler ended with counts {int(counts.min())} - {int(counts.max())}, "
                "outside the target's bounds (stop_reason 'max_iter'); the labels are usable but "
                "not balanced.  With tie_eps=0 identical rows cannot be split; otherwise please "
                "report the outputs that did this", RuntimeWarning)
        return ScaleResult(labels=labels, T=self.store.T0 + solver.dT, counts=counts, target=target,
                           iterations=solver.rounds + solver.phases, std_history=history,
                           std=counts_std(counts.cpu(), target), std_max=worst_std(target, n_total),
                           seconds=time.perf_counter() - self.t0,
                           stop_reason="balanced" if ok else "max_iter", refetched=refetched,
                           ties=solver.ties, ties_left=solver.ties_left, active=n_act)

    def _solve_growing(self, n_total, target, lo, hi, refetch, max_rounds):
        """The working set: at T0 every row leads by a margin over its runner-up (or theta).  While
        no T_j moves by more than `radius` relative to another, rows with a larger margin keep their
        column, so only the others are solved; the radius grows until the translation found fits.
        Returns (solver, counts of the rows not solved, rows solved, rows refetched, history)."""
        comm, k, dev, n = self.comm, self.k, self.device, self.store.n
        lab0 = torch.empty(n, dtype=torch.int64, device=dev)
        margin = torch.empty(n, dtype=torch.float64, device=dev)
        for s, vals, cols, theta in self.store.chunks():
            best, arg, second = _top2_(vals.clone())
            lab0[s:s + vals.shape[0]] = cols.long().gather(1, arg)[:, 0]
            margin[s:s + vals.shape[0]] = best - torch.maximum(second, theta)
        # Outputs far from the target (real networks') move most rows: one solve on all of them;
        # from a given start (near the answer) a narrow first solve, however far the counts are
        radius = math.inf if self.s.far and self.start is None else self.s.radius0
        history, refetched, solver = [], 0, None
        while True:
            act = (margin <= radius).nonzero()[:, 0]
            n_act = comm.total(act.numel())
            ic = comm.sum(torch.bincount(lab0[margin > radius], minlength=k))   # counts of the rest
            if n_act < n_total and bool((ic > hi).any()):
                # the rest already overfill a cluster: widen first, by at least one more row
                nxt = margin[margin > radius].min() if bool((margin > radius).any()) else torch.tensor(math.inf)
                radius = max(4 * radius, float(comm.min(nxt.to(torch.float64).reshape(1).cpu())[0]))
                continue
            # the rows to solve leave the store (those of an earlier, narrower solve come from
            # its solver); at T0 (first solve) their labels are known already
            prev = None if solver is None else (solver.rows_global - self.offset, solver)
            got = self.store.take(act, prev)
            solver, more = self._solve(*got, act, target.to(dev) - ic, (lo - ic).clamp(min=0),
                                       hi - ic, solver, refetch, history, max_rounds,
                                       labels=lab0.index_select(0, act) if solver is None else None)
            refetched += more
            span = float(solver.dT.max() - solver.dT.min())
            if n_act == n_total or span < radius:
                solver.lab0, solver.act = lab0, act
                return solver, ic, n_act, refetched, history
            radius = max(2 * radius, 2 * span)

    def _solve(self, vals, cols, theta, epoch, cuts, rows, target, lo, hi, prev, refetch, history,
               max_rounds, labels=None):
        """The exact solver on the rows `rows` (local indices; vals, cols, theta are theirs), from
        the earlier solver `prev`'s translation, reading again the rows whose candidates fall short.
        Returns (solver, rows refetched)."""
        k, comm = self.k, self.comm
        rows_global = rows + self.offset
        carry = {} if prev is None else dict(dT=prev.dT, rounds=prev.rounds, phases=prev.phases)
        solver = _ExactSolver(vals, cols, theta, k, target, lo, hi, comm, self.store.block,
                              rows_global, labels=labels, epoch=epoch, cuts=cuts, **carry)
        # reverse auction rounds on candidate lists far from balance, once the rows are spread over
        # half of the clusters (an empty cluster is in few rows' candidates)
        wide_far = self.s.far and vals.shape[1] < k
        solver.reverse = wide_far and int((solver.counts > 0).sum()) >= 0.5 * k
        pending = wide_far and not solver.reverse
        history.append(solver.std())
        # Rows whose candidates fell short are read again, their candidates chosen at the current T,
        # while that helps (past 6 times only while each solve gains a fifth).  Then every row's
        # candidates are chosen again once; only after that does the solver take whole rows.
        refetched, width, recut_all, rereads = 0, vals.shape[1], False, 0
        best, last_unsafe, progress = math.inf, math.inf, True
        for attempt in range(40):
            if pending and width < k and int((solver.counts > 0).sum()) >= 0.5 * k:
                solver.reverse, pending = True, False
            balanced = solver.run(max_rounds, history, self.s.radius0,
                                  check_rows=rereads < 6 or progress)
            unsafe = solver.unsafe_rows()
            n_unsafe = comm.total(unsafe.numel())
            std = solver.std()
            progress = std < 0.8 * best or n_unsafe < 0.8 * last_unsafe
            best, last_unsafe = min(best, std), n_unsafe
            if (balanced and not n_unsafe) or width >= k:
                break
            _need_refetch(refetch, n_unsafe)
            if n_unsafe and (rereads < 6 or progress):
                rereads += 1
                refetched += self._recut(solver, unsafe, refetch)
            elif not recut_all:
                recut_all = True
                refetched += self._recut(solver, solver.all_rows, refetch)
            else:   # whole rows: the candidates could not hold the answer
                solver, width = self._whole_solver(solver, rows, target, lo, hi, refetch), k
                refetched += rows.numel()
        solver.strictify(keep_balance=self.s.eps > 0)
        return solver, refetched

    def _whole_solver(self, solver, rows, target, lo, hi, refetch):
        """A solver on the whole rows of `rows`, read again, from `solver`'s translation."""
        k, dev = self.k, self.device
        vals = torch.empty(rows.numel(), k, dtype=torch.float64, device=dev)
        for s in range(0, rows.numel(), self.chunk):
            r = rows[s:s + self.chunk]
            X = refetch((r + self.offset).cpu()).to(dev)
            vals[s:s + r.numel()] = self.store.whole_rows(X, r + self.offset)
        cols = torch.arange(k, device=dev).to(self.store.cdtype).expand(rows.numel(), k).contiguous()
        theta = torch.full((rows.numel(),), -math.inf, dtype=torch.float64, device=dev)
        return _ExactSolver(vals, cols, theta, k, target, lo, hi, self.comm, self.store.block,
                            solver.rows_global, dT=solver.dT, rounds=solver.rounds,
                            phases=solver.phases)

    def _recut(self, solver, pos, refetch):
        """Re-choose the candidates of the solver's rows `pos` at its dT from their outputs, read in
        pieces of at most 256 MB; returns how many were read (every rank calls it)."""
        step = max(1, min(self.chunk, (1 << 28) // (8 * self.k)))
        for s in range(0, pos.numel(), step):
            grows = solver.rows_global.index_select(0, pos[s:s + step])
            X = refetch(grows.cpu()).to(self.device)
            solver.replace_rows(pos[s:s + step], *self.store.full_rows(X, grows, solver.dT))
        solver.recount()
        return pos.numel()


def _need_refetch(refetch, n_unsafe):
    """Raise where the candidate lists fell short and no refetch was given."""
    if refetch is not None:
        return
    if n_unsafe:
        raise RuntimeError(
            f"{n_unsafe} rows' best candidate could be beaten by a column they dropped; pass "
            "refetch=fn(rows) -> outputs of those rows, or use more candidates")
    raise RuntimeError(
        "the candidate lists are too short for these outputs (no cheap move reaches an under-full "
        "cluster); pass refetch=fn(rows) -> outputs of those rows, or keep whole rows "
        "(full_rows_up_to >= k)")


# ---- The solver on candidate lists

def _cat(parts):
    """torch.cat of a non-empty list of tensors; a single one as it is (no copy, and on a GPU no
    launch: the solver's rounds are mostly one block)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _top2_(S):
    """(best value, its column as an (n, 1) index, runner-up) of each row of S, as topk(2) gives
    them (a tie for the best: the first column, and the runner-up equals it), by max and a scatter,
    which cost less than topk.  S is overwritten: its best entries become -inf."""
    best, arg = S.max(1, keepdim=True)
    best = best[:, 0]
    second = S.scatter_(1, arg, -math.inf).amax(1) if S.shape[1] > 1 else torch.full_like(best, -math.inf)
    return best, arg, second


class _ExactSolver:
    """The translation solved on candidate lists: vals (n, w) O - T0 of each row's candidates, cols
    (n, w) their clusters, rows_global (n,) ascending, dT (k,) = T - T0.  theta (n,) bounds the
    dropped columns at the translation cuts[epoch[i]] the row's candidates were chosen at: at any
    dT a dropped column scores at most theta_i - min(dT - cuts[epoch_i]).  run(): the published
    step far from balance (`_Approach`), an ascending auction with reverse rounds (`_auction`,
    `_attract`), the exact finish (`_Finish`); strictify() makes every label a strict argmax."""

    def __init__(self, vals, cols, theta, k, target, lo, hi, comm, chunk, rows_global, dT=None,
                 rounds=0, phases=0, labels=None, epoch=None, cuts=None):
        if _launch_bound(vals.device) and cols.dtype != torch.int32:
            # int32 once: gathers of dT by column take int32 indices, and on a GPU a conversion per
            # round is a launch (the CPU keeps int16's memory)
            cols = cols.to(torch.int32)
        self.vals, self.cols, self.theta, self.k = vals, cols, theta, k
        self.epoch = (torch.zeros(vals.shape[0], dtype=torch.int64, device=vals.device)
                      if epoch is None else epoch)
        self.cuts = torch.zeros(1, k, dtype=torch.float64, device=vals.device) if cuts is None else cuts
        self.rows_global = rows_global
        self.target, self.lo, self.hi, self.comm, self.chunk = target, lo, hi, comm, chunk
        self.dev = vals.device
        self.dT = torch.zeros(k, dtype=torch.float64, device=self.dev) if dT is None else dT
        self.rounds, self.phases, self.ties, self.ties_left = rounds, phases, 0, 0
        self.reverse = False   # reverse auction rounds (_attract) on candidate lists
        self._last_eval = self._last_rise = None
        self.all_rows = torch.arange(vals.shape[0], device=self.dev)
        self.natural = self._natural(cols)
        # labels: the rows' argmax at dT when the caller has it (the same _top2_ on the same values)
        self.labels = self.evaluate(self.all_rows)[1] if labels is None else labels
        self.counts = self.count()

    def _natural(self, cols):
        """Whether cols holds every column in order (whole rows): then a slot's column is its
        position, with no gathers of dT by column, and moves fill the k x k table by row."""
        k = self.k
        return cols.shape[1] == k and bool((cols == torch.arange(k, device=cols.device)
                                            .to(cols.dtype)).all())

    def count(self):
        return self.comm.sum(torch.bincount(self.labels, minlength=self.k))

    def std(self):
        return counts_std(self.counts.cpu(), self.target)

    def gathered(self, d, cols):
        """d[cols] for a (n, w) block of cluster numbers, by index_select on int32 (cheaper than
        advanced indexing with int64)."""
        return d.index_select(0, cols.reshape(-1).to(torch.int32)).view(cols.shape)

    def rise(self, d=None):
        """(E,) at least how far T has risen since each epoch's cut, min(d - cuts[e]): a row of
        epoch e bounds its dropped columns by theta - rise(d)[e] at d (default: the current dT)."""
        d = self.dT if d is None else d
        last = self._last_rise    # (kept for the same d and cuts: a round's blocks share them)
        if last is None or last[0] is not d or last[1] is not self.cuts:
            self._last_rise = last = (d, self.cuts, (d[None, :] - self.cuts).amin(1))
        return last[2]

    def blocks(self, rows):
        """(vals, cols, bound) of `rows` in pieces of at most `chunk` (slices when rows are all
        rows); bound: the most a dropped column of the row scores at the current dT."""
        m = self.rise()
        one = self.cuts.shape[0] == 1      # one epoch (no row read again): m[0] for every row
        for s in range(0, rows.numel(), self.chunk):
            if rows is self.all_rows:
                sl = slice(s, s + self.chunk)
                yield self.vals[sl], self.cols[sl], self.theta[sl] - (
                    m if one else m.index_select(0, self.epoch[sl]))
            else:
                r = rows[s:s + self.chunk]
                yield (self.vals.index_select(0, r), self.cols.index_select(0, r),
                       self.theta.index_select(0, r) - (
                           m if one else m.index_select(0, self.epoch.index_select(0, r))))

    def evaluate(self, rows):
        """best score, its column, the runner-up (or the bound on dropped columns), unsafe."""
        out = [[], [], [], []]
        for vr, cr, thb in self.blocks(rows):
            if self.natural:
                best, arg, second = _top2_(vr - self.dT)
                out[1].append(arg[:, 0])
            else:
                best, arg, second = _top2_(vr - self.gathered(self.dT, cr))
                out[1].append(cr.gather(1, arg)[:, 0].long())
            out[0].append(best)
            out[2].append(torch.maximum(second, thb))
            out[3].append(best <= thb)
        if not out[0]:
            e = torch.zeros(0, dtype=torch.float64, device=self.dev)
            return e, torch.zeros(0, dtype=torch.int64, device=self.dev), e, e.bool()
        return tuple(_cat(o) for o in out)

    def evaluate_all(self):
        """evaluate() of every row, kept while dT and the rows stay (run(check_rows=True), then
        unsafe_rows(), then strictify() all look at the same dT)."""
        last = self._last_eval
        if last is None or last[0] is not self.dT:
            self._last_eval = last = (self.dT, self.evaluate(self.all_rows))
        return last[1]

    def unsafe_rows(self):
        if self.vals.shape[1] >= self.k:   # whole rows drop no column: none can be unsafe
            return torch.zeros(0, dtype=torch.int64, device=self.dev)
        return self.evaluate_all()[3].nonzero()[:, 0]

    def replace_rows(self, rows, vals, cols, theta):
        """New candidates for `rows`, chosen at the current dT (theta: their bound there); the
        counts are stale until recount() (on every rank: it sums over ranks)."""
        self._last_eval = None
        self.vals[rows], self.cols[rows], self.theta[rows] = vals, cols.to(self.cols.dtype), theta
        self.natural = self.natural and self._natural(cols)
        if not bool((self.cuts[-1] == self.dT).all()):
            self.cuts = torch.cat([self.cuts, self.dT[None, :]])
        self.epoch[rows] = self.cuts.shape[0] - 1
        self.labels[rows] = self.evaluate(rows)[1]

    def recount(self):
        self.counts = self.count()

    def relabel(self, rows=None):
        """The labels of `rows` (all: None) at the current dT, and the counts again."""
        if rows is None:
            self.labels = self.evaluate(self.all_rows)[1]
        else:
            self.labels[rows] = self.evaluate(rows)[1]
        self.counts = self.count()

    def run(self, max_rounds, history, tau0, check_rows=False):
        """Balance: True, or False when no cheap move reaches a cluster that needs rows.
        check_rows: None before the finish when over 1 % of the rows' candidates fell short (the
        caller reads them again; the finish on them would be mostly wasted)."""
        n = float(self.counts.sum())
        E = float((self.counts - self.hi).clamp(min=0).sum())
        if E > APPROACH_SHARE * n:
            _approach(self, history)
        _auction(self, max_rounds, history)
        if check_rows and self.comm.total(self.unsafe_rows().numel()) > 0.01 * n:
            return None
        return _Finish(self).run(history, tau0)

    def strictify(self, keep_balance=True):
        """Moved rows sit on exact ties.  Order the clusters so that every tie a -> b (a row of a
        with an equal score in b) has pi[b] > pi[a], and add eta * pi to T with eta under half of
        every other margin over (max pi + 1): ties resolve to the current labels, nothing else
        changes.  Only the rows near a tie are looked at column by column.  Equal is within 64 ulps
        of the largest |value| at first, raised while eta would not clear it.  keep_balance: where
        the shift would unbalance balanced counts, keep the labels and T (ties_left)."""
        k, dev = self.k, self.dev
        # ties are equal up to float64 rounding of the values involved
        parts = [self.dT.abs().max()]    # one wait for the device, not two a block
        for v in self.vals.split(self.chunk):
            parts += [v.amax(), -torch.where(torch.isfinite(v), v, 0.0).amin()]
        scale = float(torch.stack(parts).max())
        scale = float(self.comm.max(torch.tensor([scale], dtype=torch.float64))[0]) or 1.0
        tol = 64 * 2.0 ** -52 * scale
        best, arg, second, _ = self.evaluate_all()
        margin = best - second          # over the runner-up and the dropped columns' bound
        for _ in range(64):
            key, tied, rmin, gap = self._ties(margin, arg, tol)
            self.ties = key.numel()
            if self.ties == 0:
                return
            pi, cycle = _tie_order(key // k, key % k, k)
            r = min(rmin, gap)
            # (gap is a margin over a dropped column's bound, not a pair that could be a tie)
            if rmin >= gap or _ties_clear(pi, cycle, rmin, tol):
                break
            tol = rmin      # the nearest pair that was not a tie is one now
        # (a cycle of ties, such as identical rows without the tie-break have, has no order:
        # the rows then take their argmax at the shift of k + 1 steps)
        dT, old = self.dT, self.labels.index_select(0, tied)
        balanced = _within(self.counts, self.lo, self.hi)   # (global counts: all ranks alike)
        self.dT = self.dT + _tie_shift(pi, r, scale).to(dev)
        # a row outside `tied` leads by at least r > 2 eta max(pi): it keeps its label
        self.relabel(tied)
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
        (rmin) and the least margin over a dropped column's bound (gap)."""
        k, dev = self.k, self.dev
        near = (margin <= tol) | (arg != self.labels)
        rmin = float(torch.where(near, math.inf, margin).amin()) if margin.numel() else math.inf
        tied = near.nonzero()[:, 0]     # the rest: every other score is more than tol below
        ta, tb, gmin = [], [], math.inf
        for s, (vr, cr, thb) in zip(range(0, tied.numel(), self.chunk), self.blocks(tied)):
            cr, lab = cr.long(), self.labels.index_select(0, tied[s:s + self.chunk])
            S = vr - self.gathered(self.dT, cr)
            own = S.gather(1, (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            valid = (cr != lab[:, None]) & torch.isfinite(S)
            R = own - S
            tight = valid & (R <= tol)
            ta.append(lab[:, None].expand_as(R)[tight])
            tb.append(cr[tight])
            if R.numel():
                rmin = min(rmin, float(torch.where(valid & ~tight, R, math.inf).amin()))
            g = (own[:, 0] - thb)          # over the dropped columns: score <= thb
            g = g[torch.isfinite(g)]
            if g.numel():
                gmin = min(gmin, float(g.min()))
        # the tied pairs a * k + b, ascending, of all ranks (across ranks as a k x k sum; in one
        # process without any k x k array)
        key = (torch.cat(ta) * k + torch.cat(tb) if ta else
               torch.zeros(0, dtype=torch.int64, device=dev))
        if self.comm.on:
            adj = torch.zeros(k * k, dtype=torch.int64, device=dev)
            adj[key] = 1
            key = (self.comm.sum(adj) > 0).nonzero()[:, 0]
        rmin, gmin = self.comm.min(torch.tensor([rmin, gmin], dtype=torch.float64)).tolist()
        return key.unique().cpu(), tied, rmin, gmin


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


def _ties_clear(pi, cycle, rmin, tol):
    """strictify's test that tol may stay: the shift eta = rmin / (2 (max pi + 1)) clears the ties'
    rounding tol with room, or raising tol would not help (a cycle, or no margin that is a tie)."""
    return cycle or not math.isfinite(rmin) or rmin > 4 * (float(pi.max()) + 1) * tol


def _tie_shift(pi, r, scale):
    """The shift eta * pi of T that resolves the ties _tie_order ordered: eta = r / (2 (max pi +
    1)), r the least margin that is not a tie (any shift where there is none)."""
    if not math.isfinite(r):
        r = scale * 1e-6
    return r / (2 * (float(pi.max()) + 1)) * pi


# ---- The solver's stages: the published step far from balance, the auction, the finish

class _Approach:
    """The published step rule (`otl.translation_steps`), which moves every cluster at once, where
    the auction, raising over-full clusters only, is slow: far from balance.  Each step is an
    argmax over float32 copies of every row's best `top` candidates at a reference T `ref` and
    theta bounding the rest, in one reused scratch block (fresh blocks cost page faults), scaled by
    their scores' range plus dT's span.  Past 1 % of rows unsure, the copies are taken again at the
    current T; still past 1 %, the candidates are stale: it stops, the caller reads the rows again.
    It stops at std <= 1 too, then takes the exact labels."""

    def __init__(self, solver, top=16):
        s = self.s = solver
        self.top, self.n_total = top, int(s.counts.sum())
        self.blocks, self.ref = self._blocks(s.dT), s.dT
        vmax = max((float(v.amax()) for v, _, _ in self.blocks), default=0.0)
        vmin = min((float(torch.where(torch.isfinite(v), v, math.inf).amin())
                    for v, _, _ in self.blocks), default=0.0)
        self.vr_sum = float(s.comm.max(torch.tensor([vmax, -vmin], dtype=torch.float64)).sum())
        self.scratch = torch.empty(min(s.chunk, s.vals.shape[0]) * s.vals.shape[1],
                                   dtype=torch.float32, device=s.dev)
        self.stale = self.near = False

    def _blocks(self, ref):
        s, top, out = self.s, self.top, []
        moved = bool(ref.any())      # at T0 (ref = 0) the scores are vals itself
        rise = s.rise(ref)           # theta's shift at ref, per epoch
        for v, c, th, ep in zip(s.vals.split(s.chunk), s.cols.split(s.chunk),
                                s.theta.split(s.chunk), s.epoch.split(s.chunk)):
            v = v - s.gathered(ref, c) if moved else v
            b = th - rise.index_select(0, ep)       # the dropped columns, at ref
            if v.shape[1] > top + 1:
                tv, i = v.topk(top + 1, dim=1)
                v, c, b = tv[:, :top], c.gather(1, i[:, :top]), torch.maximum(tv[:, top], b)
            b = b.to(torch.float32) if bool(torch.isfinite(b).any()) else None
            out.append((v.to(torch.float32), c.to(torch.int32), b))
        return out

    def _labels_at(self, dT):
        """(labels, rows whose truncated candidates may miss their argmax) at dT, all ranks."""
        s = self.s
        d32, out = (dT - self.ref).to(torch.float32), []
        unsure, dmin = torch.zeros((), dtype=torch.int64, device=s.dev), d32.min()
        for v, c, b in self.blocks:
            S = self.scratch[:v.numel()].view(v.shape)
            torch.index_select(d32, 0, c.view(-1), out=S.view(-1))
            torch.sub(v, S, out=S)
            if b is not None:   # a dropped candidate scores at most b - min dT
                best, arg = S.max(1, keepdim=True)   # (one launch: not argmax, gather)
                unsure = unsure + (best[:, 0] < b - dmin).sum()
            else:
                arg = S.argmax(1, keepdim=True)
            out.append(c.gather(1, arg)[:, 0])
        lab = _cat(out).long() if out else torch.zeros(0, dtype=torch.int64, device=s.dev)
        return lab, int(s.comm.sum(unsure.reshape(1))[0])

    def assign(self, dT):
        lab, unsure = self._labels_at(dT)
        if unsure > 0.01 * self.n_total:
            self.blocks, self.ref = self._blocks(dT), dT
            lab, unsure = self._labels_at(dT)
            self.stale = unsure > 0.01 * self.n_total
        counts = self.s.comm.sum(torch.bincount(lab, minlength=self.s.k))
        self.near = float((counts - self.s.hi).clamp(min=0).sum()) <= 0.02 * self.n_total
        return lab, counts

    def range_of(self, dT):
        """A bound on the range of the candidates' scores at dT."""
        lo, hi = torch.aminmax(dT)
        return self.vr_sum + float(hi - lo)

    def run(self, history, beta=1.5, patience=3, max_iter=500):
        s, h0 = self.s, len(history)

        def stop():
            """Stale candidates, or the last 8 steps bettered the best std before them by under a
            tenth, near the target or with reverse rounds on: the auction and finish do better."""
            own = history[h0:]
            return self.stale or ((self.near or s.reverse) and len(own) > 8
                                  and min(own[-8:]) > 0.9 * min(own[:-8]))

        dT, _, _, _, steps, _ = otl.translation_steps(
            self.assign, self.range_of, s.dT, s.labels, s.counts, s.target,
            worst_std(s.target, self.n_total), history, beta=beta, patience=patience,
            max_iter=max_iter, stop_std=1.0, speed_up=True, stop=stop)
        s.rounds += steps
        if dT is not s.dT:   # exact labels at the T reached
            s.dT = dT
            s.relabel()


def _approach(solver, history):
    _Approach(solver).run(history)


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


def _auction(s, max_rounds, history):
    """Ascending auction rounds: every over-full cluster raises T_j just past its excess_j-th
    smallest margin (`_shed`), until 6 rounds removed under a fifth of the excess; with
    s.reverse, a reverse round after each (`_attract`)."""
    E_hist, start = [], s.rounds     # max_rounds of its own, after the approach's steps
    while s.rounds - start < max_rounds:
        excess = (s.counts - s.hi).clamp(min=0)
        over = excess > 0
        E_hist.append(int(excess.sum()))
        if E_hist[-1] == 0:     # (excess >= 0: no cluster over)
            return
        if len(E_hist) > AUCTION_STALL and E_hist[-1] > 0.8 * E_hist[-1 - AUCTION_STALL]:
            return     # the tail is a slow random walk: the exact finish is faster
        s.rounds += 1
        rows = over[s.labels].nonzero()[:, 0]
        best, _, second, _ = s.evaluate(rows)
        # a row whose best could be beaten by a dropped column (margin < 0) cannot be shed
        # by moving T; it counts as margin 0 here and is re-read in full later
        margin = (best - second).clamp(min=0)
        lab = s.labels[rows]
        r = _shed(s, margin, lab, excess, over)
        s.dT = s.dT + r
        s.relabel(rows[margin < r[lab]])
        history.append(s.std())
        if s.reverse:
            _attract(s)
            history.append(s.std())


def _attract(s):
    """Reverse round: every under-full cluster c pulls in its deficit d_c, T_c falling to the
    middle of the gap after the d_c-th smallest loss (best - score in c) among rows of clusters
    not under-full; done as a rise of all the others, since T only rises."""
    deficit = (s.lo - s.counts).clamp(min=0)
    total = int(deficit.sum())      # (read once: each read is a wait on a GPU)
    if total == 0:
        return
    under = deficit > 0
    rows = (~under).index_select(0, s.labels).nonzero()[:, 0]
    gl, gc, gr = [], [], []
    for i0, (vr, cr, _) in zip(range(0, rows.numel(), s.chunk), s.blocks(rows)):
        S = vr - s.gathered(s.dT, cr)
        loss = S.amax(1, keepdim=True) - S       # the row's own score (its label) - S
        # (below inf is isfinite in one operation, not four; loss >= 0 or NaN)
        m = s.gathered(under, cr) & (loss < math.inf)
        i, j = m.nonzero(as_tuple=True)
        gl.append(loss[i, j])
        gc.append(cr[i, j].long())
        gr.append(rows[i0:i0 + s.chunk].index_select(0, i))
    if not gl:          # a rank may hold no such row
        e = torch.zeros(0, dtype=torch.int64, device=s.dev)
        gl, gc, gr = [e.to(torch.float64)], [e], [e]
    loss, c, r = (_cat(x) for x in (gl, gc, gr))
    # a cluster with fewer such rows than its deficit pulls in all of them; if that is under
    # half the deficit, the candidates are stale: the forward auction and re-reads go on alone
    cnt = s.comm.sum(torch.bincount(c, minlength=s.k))
    want = torch.minimum(deficit, cnt)
    if int(want.sum()) < 0.5 * total:
        s.reverse = False
        return
    d = _shed(s, loss, c, want, under & (cnt > 0))   # (k,) how far each T_c falls, >= 0
    dmax = d.max()
    if not float(dmax) > 0:      # the same on every rank: the counts are global
        return
    s.rounds += 1
    s.dT = s.dT + (dmax - d)
    # the rows that can change: those with a loss below the fall, and every row of an
    # under-full cluster (another under-full cluster may have fallen further than its own)
    mine = under.index_select(0, s.labels).nonzero()[:, 0]
    s.relabel(torch.cat([r[loss < d.index_select(0, c)], mine]).unique())
    if int((s.lo - s.counts).clamp(min=0).sum()) >= total:
        s.reverse = False      # it did not help: the forward auction goes on alone


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
    from its cluster a to b costs (V_ia - dT_a) - (V_ib - dT_b) >= 0; the edge a -> b is the
    cheapest such row.  The graph: a list of the moves that cost at most tau while they are few
    (scipy's Dijkstra), or, once they are over a quarter of all moves, the k x k table of each
    pair's cheapest move and its row (`_table_paths`), whose rows are redone only for clusters
    that gained or lost a row.  A round moves one row along each of disjoint paths."""

    def __init__(self, solver):
        s = self.s = solver
        k, BIG = s.k, torch.iinfo(torch.int64).max
        self.W = torch.full((k * k,), math.inf, dtype=torch.float64, device=s.dev)
        self.arg = torch.full((k * k,), BIG, dtype=torch.int64, device=s.dev)
        self.pairs, self.dT_built, self.table = None, None, False
        self.n_moves = s.comm.total(s.vals.numel())   # candidate slots, all ranks

    def run(self, history, tau0):
        """True when balanced; False when no move reaches a cluster that needs rows."""
        s = self.s
        max_phases = s.phases + 2 * int(s.counts.sum()) + 1000      # a guard
        lo, hi, tau = s.lo.cpu().numpy(), s.hi.cpu().numpy(), float(tau0)
        while s.phases < max_phases:
            counts = s.counts.cpu().numpy()
            if bool((counts > hi).any()):
                give, take = np.maximum(counts - hi, 0), np.maximum(hi - counts, 0)
            elif bool((counts < lo).any()):
                give, take = np.maximum(counts - lo, 0), np.maximum(lo - counts, 0)
            else:
                return True
            if not self.table and self.pairs is None:
                self._build(tau)
            # (the table holds every move: a distance up to tau is exact; the list every move
            # cheaper than tau less how far T has moved since it was built)
            trust = tau if self.table else tau - float((s.dT - self.dT_built).max())
            d, pred, row_of = self._search(give > 0, take > 0, tau)
            moves, D = _route(d, pred, row_of, give, take, trust, self.table)
            if D is None:
                needy = d[take > 0]
                if math.isinf(tau) or not len(needy):
                    return False     # no move reaches a cluster that needs rows
                # the needy clusters lie beyond tau: let in costlier moves and try again
                near = float(needy.min())
                grown = 2 * max(tau, near) if math.isfinite(near) else math.inf
                tau = grown if grown > tau else math.inf     # tau = 0 (exact ties, no tie-break)
                self.pairs = None
                continue
            self._apply(moves, d, D, tau)
            history.append(s.std())
        return False

    def _build(self, tau):
        """The list of moves up to tau, or the table where most moves are kept (whole rows in one
        process: the table at once where tau = inf keeps every move, and at k > TABLE_AT_ONCE,
        where listing the moves under a growing tau costs more)."""
        s, k = self.s, self.s.k
        every = s.vals.shape[1] == k and not s.comm.on and (math.isinf(tau) or k > TABLE_AT_ONCE)
        if not every:
            self.pairs, self.dT_built = self._pairs(s.all_rows, tau), s.dT.clone()
        n_pairs = self.n_moves if every else s.comm.total(self.pairs[0].numel())
        if n_pairs > self.n_moves // 4:      # most moves kept: the table is cheaper per round
            self.table, self.pairs = True, None
            self._edge_table()

    def _search(self, sources, needs, tau):
        """Dijkstra from the clusters that give: (d, pred) numpy (k,) and the row of each edge
        pred[x] -> x, (k,) int64."""
        s, k = self.s, self.s.k
        if self.table:
            # (the search reads every entry, dearer moves too: a distance up to tau runs over
            # cheaper moves only, so only those distances are routed)
            W, arg = self.W, self.arg
            if s.comm.on:   # ranks agree on the global cheapest move, then its lowest row id
                W = s.comm.min(self.W.clone())
                arg = s.comm.min(torch.where(self.W == W, self.arg, torch.iinfo(torch.int64).max))
            # (on a GPU the table comes to the host each round: 8 bytes an entry, once)
            d, pred = _table_paths(W.view(k, k).cpu().numpy(), s.dT.cpu().numpy(), sources, needs)
            at = torch.from_numpy(np.maximum(pred, 0) * k + np.arange(k))
            return d, pred, arg.index_select(0, at.to(s.dev)).cpu()
        ek, er, eb, ew, indptr = self._list_edges()
        d, pred = _shortest_paths(k, eb, ew, indptr, sources)
        if not ek.numel():
            return d, pred, torch.zeros(k, dtype=torch.int64)
        # the row of edge pred[x] -> x, looked up where the edges are
        at = torch.searchsorted(ek, torch.from_numpy(pred).to(s.dev) * k + torch.arange(k, device=s.dev))
        return d, pred, er.index_select(0, at.clamp(max=ek.numel() - 1)).cpu()

    def _apply(self, moves, d, D, tau):
        """Raise the potentials (every cluster closer than D by D - d: the tree edges become ties)
        and move the rows; then update the table rows or the list of the clusters touched."""
        s, k, dev = self.s, self.s.k, self.s.dev
        s.phases += 1
        s.dT = s.dT + torch.from_numpy(np.where(d < D, D - d, 0.0)).to(dev)
        ids = torch.tensor([i for i, _, _ in moves], dtype=torch.int64, device=dev)
        to = torch.tensor([b for _, _, b in moves], dtype=torch.int64, device=dev)
        li = torch.searchsorted(s.rows_global, ids).clamp(max=max(s.rows_global.numel() - 1, 0))
        here = ((s.rows_global[li] == ids) if s.rows_global.numel()
                else torch.zeros_like(ids, dtype=torch.bool))
        moved = li[here].unique()            # the moved rows that live here (ascending ids)
        s.labels[li[here]] = to[here]
        s.counts = s.count()
        if self.table:   # the clusters that lost or gained a row (on any rank): their table rows
            touched = torch.zeros(k, dtype=torch.bool, device=dev)
            touched[torch.tensor([a for _, a, _ in moves] + [b for _, _, b in moves], device=dev)] = True
            self._edge_table(touched)
            return
        # the moved rows' moves are relative to their new cluster: replace them, kept up to tau
        # (from now on T only rises, so a move left out costs more than trust then too)
        gone = torch.zeros(s.vals.shape[0], dtype=torch.bool, device=dev)
        gone[moved] = True
        keep = ~gone.index_select(0, self.pairs[0])
        new = self._pairs(moved, tau)
        self.pairs = tuple(torch.cat([p[keep], q]) for p, q in zip(self.pairs, new))

    def _moves(self, rows):
        """Every candidate move of `rows` (local, ascending, or all rows), block by block:
        (rows, candidate clusters, labels, base V_ia - V_ib, valid: another cluster, finite)."""
        s = self.s
        for i0, (vr, cr, _) in zip(range(0, rows.numel(), s.chunk), s.blocks(rows)):
            r = rows[i0:i0 + s.chunk]
            lab = s.labels.index_select(0, r)
            if s.natural:    # (cr: one (1, k) row of column numbers, broadcast)
                cr = torch.arange(s.k, device=s.dev)[None, :]
                own = vr.gather(1, lab[:, None])
            else:
                cr = cr.long()
                own = vr.gather(1, (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            base = own - vr                                  # +inf for empty slots (vals = -inf)
            # (base is finite or +inf: below inf is isfinite in one operation)
            yield r, cr.expand_as(base), lab, base, (cr != lab[:, None]) & (base < math.inf)

    def _pairs(self, rows, tau):
        """(row, cluster b, V_ia - V_ib) of every candidate move of `rows` that costs at most tau
        at the current dT."""
        s, out = self.s, [[], [], []]
        for r, cr, lab, base, valid in self._moves(rows):
            dTc = s.dT[None, :] if s.natural else s.gathered(s.dT, cr)
            cost = base + dTc - s.dT.index_select(0, lab)[:, None]
            i, j = ((cost <= tau) & valid).nonzero(as_tuple=True)
            out[0].append(r.index_select(0, i))
            out[1].append(cr[i, j])
            out[2].append(base[i, j])
        if not out[0]:
            z = torch.zeros(0, dtype=torch.int64, device=s.dev)
            return z, z, torch.zeros(0, dtype=torch.float64, device=s.dev)
        return tuple(torch.cat(o) for o in out)

    def _list_edges(self):
        """The cluster graph on the listed moves: per edge a -> b its cheapest move and, among
        equal ones, the lowest global row id (the same row in any split or chunking); _graph's
        five arrays.  W, arg serve as scratch and are left as they were found."""
        s, k, BIG = self.s, self.s.k, torch.iinfo(torch.int64).max
        W0, arg = self.W, self.arg
        prow, pb, pbase = self.pairs
        key = s.labels.index_select(0, prow) * k + pb
        W0.scatter_reduce_(0, key, pbase, "amin")
        rid = s.rows_global.index_select(0, prow)
        if s.comm.on:   # ranks agree on the global cheapest move first
            w = s.comm.min(W0.clone())
            hit = pbase == w.index_select(0, key)
            arg.scatter_reduce_(0, key[hit], rid[hit], "amin")
            a = s.comm.min(arg.clone())
            W0[key], arg[key] = math.inf, BIG
            e = torch.isfinite(w).nonzero()[:, 0]
            ew, er = w.index_select(0, e), a.index_select(0, e)
        else:
            hit = pbase == W0.index_select(0, key)
            arg.scatter_reduce_(0, key[hit], rid[hit], "amin")
            one = hit & (rid == arg.index_select(0, key))   # one entry per edge
            e, ew, er = key[one], pbase[one], rid[one]
            W0[key], arg[key] = math.inf, BIG
        e, order = e.sort()                       # row-major: a csr matrix as it stands
        ew, er = ew.index_select(0, order), er.index_select(0, order)
        return self._graph(e, self._at_dT(e, ew), er)

    def _at_dT(self, e, base):
        """The cost at the current dT of moves e = a * k + b with base `base`:
        (base + dT[b]) - dT[a], summed in that order wherever the finish costs a move."""
        dT, k = self.s.dT, self.s.k
        return base + dT.index_select(0, e % k) - dT.index_select(0, e // k)

    def _graph(self, e, cost, er):
        """The cluster graph for _shortest_paths from its edges a * k + b (ascending), their costs
        and rows: (e, er) where they are (to look up the few edges on the paths) and, on the host,
        what the search reads: b (int32), cost (float64, >= 0), csr row pointers (int32)."""
        k = self.s.k
        indptr = torch.searchsorted(e // k, torch.arange(k + 1, device=e.device))
        return (e, er, (e % k).to(torch.int32).cpu().numpy(), cost.clamp(min=0).cpu().numpy(),
                indptr.to(torch.int32).cpu().numpy())

    def _edge_table(self, clusters=None):
        """Per move a -> b among this process's rows, the cheapest base V_ia - V_ib (W, k*k, inf:
        none) and its row (arg: the lowest global row id among equal ones), for the source clusters
        in the (k,) mask `clusters` (None: all), whose entries are reset first."""
        s, k, BIG, W, arg = self.s, self.s.k, torch.iinfo(torch.int64).max, self.W, self.arg
        if clusters is None:
            rows = s.all_rows
            W.fill_(math.inf)
            arg.fill_(BIG)
        else:
            rows = clusters.index_select(0, s.labels).nonzero()[:, 0]
            W.view(k, k)[clusters] = math.inf
            arg.view(k, k)[clusters] = BIG
        for second in (False, True):     # the minima first, then the lowest row id at each
            for r, cr, lab, base, ok in self._moves(rows):
                # every slot scattered, invalid ones as inf / BIG (no minimum changes): cheaper than
                # picking the valid ones; whole rows in order scatter along dim 0 of the k x k view
                key = None if s.natural else lab[:, None] * k + cr
                if not second:
                    src = torch.where(ok, base, math.inf)
                else:
                    least = (W.view(k, k).index_select(0, lab) if key is None else
                             W.index_select(0, key.view(-1)).view(key.shape))
                    rid = s.rows_global.index_select(0, r)[:, None].expand_as(base)
                    src = torch.where(ok & (base == least), rid, BIG)
                dst = arg if second else W
                if key is None:
                    dst.view(k, k).scatter_reduce_(0, lab[:, None].expand_as(src), src, "amin")
                else:
                    dst.scatter_reduce_(0, key.view(-1), src.reshape(-1), "amin")


def _route(d, pred, row_of, give, take, trust, table):
    """One row along each path to a needy cluster, nearest first, no row on two paths: the moves
    (row id, from, to) and the distance D of the last path taken (None: no path within trust)."""
    dl, pl, rl = d.tolist(), pred.tolist(), row_of.tolist()
    gl, tl = give.tolist(), take.tolist()
    used, moves, D = set(), [], None
    for b in np.argsort(d, kind="stable").tolist():
        if not (dl[b] <= trust if table else dl[b] < trust):   # beyond: an edge may be left out
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


def _table_paths(W, dT, sources, needy):
    """Dijkstra on the finish's k x k table itself (numpy): W[a, b] the cheapest base of a move
    a -> b (inf: none), costing max((W[a, b] + dT[b]) - dT[a], 0) at dT; distances from the
    nearest `sources` cluster and predecessors (-1: none), as _shortest_paths.  A cluster's row of
    costs is computed as it settles (no edge list); it stops once every `needy` cluster is settled,
    the rest left at inf."""
    k = W.shape[0]
    d = np.full(k, np.inf)
    pred = np.full(k, -1, dtype=np.int64)
    src, left = np.flatnonzero(sources), needy.copy()
    row, better = np.empty(k), np.empty(k, dtype=bool)
    d[src] = 0.0
    todo = d.copy()     # the unsettled clusters' d, inf once settled
    settled = np.zeros(k, dtype=bool)
    n_left = int(left.sum())
    for _ in range(k):
        u = int(todo.argmin())
        du = float(todo[u])
        if not math.isfinite(du):
            break
        todo[u] = math.inf
        settled[u] = True
        if left[u]:
            n_left -= 1
            if n_left == 0:
                break
        np.add(W[u], dT, out=row)
        row -= dT[u]
        np.maximum(row, 0.0, out=row)
        row += du
        np.less(row, d, out=better)
        np.copyto(d, row, where=better)
        np.copyto(todo, row, where=better)
        pred[better] = u
    d[~settled], pred[~settled] = np.inf, -1
    return d, pred


def _shortest_paths(k, eb, ew, indptr, sources):
    """Distances from the nearest source cluster and predecessors (-1: none), numpy (k,) each, on
    the csr graph (indptr, eb, ew >= 0) by scipy's Dijkstra (explicit zero weights stay edges in a
    csr matrix)."""
    g = csr_matrix((ew, eb, indptr), shape=(k, k))
    d, pred, _ = dijkstra(g, directed=True, indices=np.flatnonzero(sources), min_only=True,
                          return_predecessors=True)
    return d, np.where(pred < 0, -1, pred).astype(np.int64)


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


def _newton_T(X, T, target, max_steps, tol, frac=None, errs=None, at=None, span_max=math.inf,
              bufs=None, mode=None):
    """Steps on the counts of argmax(X - T) towards the target: Newton (`_newton_step`, halved up to
    twice while it does not help; h from the `frac` closest rows, 5 % up to k = 50, then k / 1000
    up to 20 %) or shedding (`_shed_step`), whichever helps; a Newton step that keeps over 90 % of
    sum |counts - target| is followed by shedding.  Stops at that sum <= tol, after max_steps, when
    neither helps, or (escaped) before a step that would move T by a span over span_max.  at: the
    counts at T if known; bufs: two _newton_bufs; mode: a dict kept across calls.  Returns (T,
    counts - target, _newton_counts at T, passes made, escaped); errs gets each step's error."""
    T0 = T
    frac = min(0.2, max(0.05, X.shape[1] / 1000)) if frac is None else frac
    passes = 0
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
            if span_max < math.inf:
                moved = T + d - T0
                if float(moved.max() - moved.min()) > span_max:
                    return T, e, at, passes, True
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
    return T, e, at, passes, False


def _joiners(X, T, at, B, ic, target, R, scratch=None):
    """B and ic with rows added for clusters short of them: a cluster j that needs d more rows than
    B holds (target - ic) and has fewer than 2 d rows in B within R of it gets the 2 d + 8 rows
    nearest to joining it (least best - (X_j - T_j) at T).  scratch: _join_costs'."""
    k = X.shape[1]
    lab, best = at[0], at[3]
    labB = lab[B]
    d = (target - ic) - torch.bincount(labB, minlength=k)
    J = (d >= 1).nonzero()[:, 0]
    if not len(J):
        return B, ic
    gB = best[B][:, None] - (X[B][:, J].to(torch.float32) - T.to(torch.float32)[J])
    F = J[((gB <= R) & (labB[:, None] != J)).sum(0) < 2 * d[J]]
    if not len(F):
        return B, ic
    T32 = T.to(torch.float32)
    m = (2 * d.index_select(0, F) + 8).long()
    n, extra = X.shape[0], []
    step = max(1, (1 << 24) // n)           # N x step float32 at a time
    for s in range(0, F.numel(), step):
        f = F[s:s + step]
        G = _join_costs(X, T32, lab, best, f, scratch)
        mf = m[s:s + f.numel()]            # each cluster's mf smallest join costs' rows
        top = G.topk(min(int(mf.max()), G.shape[1]), dim=1, largest=False).indices
        extra.append(top[torch.arange(top.shape[1], device=G.device)[None, :] < mf.to(G.device)[:, None]])
    extra = torch.cat(extra).to(X.device)
    inB = torch.zeros(X.shape[0], dtype=torch.bool, device=X.device)
    inB[B] = True
    extra = extra[~inB.index_select(0, extra)].unique()
    if not extra.numel():
        return B, ic
    ic = ic - torch.bincount(lab.index_select(0, extra), minlength=k)
    return torch.cat([B, extra]).sort().values, ic


def _near_rows(lab, margin, R, cnt_out, hi, must=None):
    """(rows with margin <= R plus the rows `must`, counts of the others plus cnt_out); for a
    cluster the others would overfill, its rows nearest a boundary join too (twice its excess and 32
    more).  None when that cannot prevent it."""
    k = hi.numel()
    inside = margin <= R
    if must is not None:
        inside[must] = True
    cnt = torch.bincount(lab, minlength=k)
    ic = cnt_out + cnt - torch.bincount(lab[inside], minlength=k)
    for j in (ic > hi).nonzero()[:, 0].tolist():
        rows = (lab == j).nonzero()[:, 0]
        take = min(len(rows), 2 * int(cnt_out[j] + cnt[j] - hi[j]) + 32)
        inside[rows[torch.sort(margin[rows], stable=True).indices[:take]]] = True
    B = inside.nonzero()[:, 0]
    ic = cnt_out + cnt - torch.bincount(lab[B], minlength=k)
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
    error e and the last _newton_counts `at`, and `pool`: (rows near a boundary, their labels and
    margins at T, counts of the others, their least margin) once the steps go on with them only."""

    def __init__(self, X, target):
        self.X, self.target, (self.n, self.k), self.dev = X, target, X.shape, X.device
        self.lo, self.hi = count_bounds(target)
        self.passes, self.errs, self.mode, self.pool = 0, [], {}, None
        self.tol = max(0.002 * self.n, self.k)

    def _steps(self, X, T, target, steps, tol, **kw):
        T, e, at, p, escaped = _newton_T(X, T, target, steps, tol, **kw)
        self.passes += p
        return T, e, at, escaped

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
        self.T, self.e, self.at, _ = self._steps(X, T, target, 2, self.tol, errs=self.errs,
                                                 bufs=self.bufs, mode=self.mode, at=at)
        if self.errs[-1] > 0.9 * self.errs[0] and self.errs[-1] > 0.1 * n:
            return False     # two steps removed under a tenth of sum |counts - target| > N / 10
        last, full_steps = math.inf, 0
        while (self.errs[-1] > self.tol and full_steps < 24
               and (full_steps < 8 or self.errs[-1] > PAST_8 * n)):
            # (past 8 steps only while the error is over 1 % of N: the exact solve would be slow there)
            if last < math.inf and self._pool_steps(last):
                break
            T1, self.e, self.at, _ = self._steps(X, self.T, target, 1, self.tol, at=self.at,
                                                 errs=self.errs, bufs=self.bufs, mode=self.mode)
            full_steps += 1
            step = T1 - self.T
            last, self.T = float(step.max() - step.min()), T1
            if last == 0:
                break       # no step helped
        # the Newton steps did not get near: a network collapsing onto few clusters
        return float(self.e.clamp(min=0).sum()) <= 0.05 * self.n

    def _want(self):
        """How many rows to solve: 2 % of N, or 8 a row still to move and k."""
        return max(int(DENSE_SHARE * self.n),
                   int(DENSE_PER_MOVE * (float(self.e.clamp(min=0).sum()) + self.k)))

    def _pool_steps(self, last):
        """T moves on by about its last step (the counts' error falls by half or more a step):
        rows leading by more than 4 x that keep their column; once they are half of the rows or
        fewer, the steps go on with the others only (True: then the pool is set)."""
        n, k, margin = self.n, self.k, self.at[1]
        R1 = max(4 * last, float(margin.kthvalue(min(n, 2 * self._want())).values))
        if int((margin <= R1).sum()) > DENSE_POOL * n:
            return False
        got = _near_rows(self.at[0], margin, R1, torch.zeros(k, dtype=torch.int64, device=self.dev), self.hi)
        if got is None:
            return False
        P, c_out = got
        XP = self.X.index_select(0, P).to(torch.float32)
        frac = min(0.5, min(0.2, max(0.05, k / 1000)) * n / P.numel())
        TP, eP, atP, escaped = self._steps(XP, self.T, self.target - c_out, 12, self.tol, frac=frac,
                                           span_max=R1 / 2, bufs=_newton_pair(*XP.shape, self.dev),
                                           mode=dict(self.mode))
        if not escaped:
            moved = TP - self.T
            self.pool = (P, atP[0], atP[1], c_out, R1 - float(moved.max() - moved.min()))
            self.T, self.e = TP, eP
            return True
        if TP is not self.T:     # T would cross rows left out: all rows from here
            self.T = TP
            self._recount()
            self.errs.append(float(self.e.abs().sum()))
        return False

    def _rows_to_solve(self, want, must):
        """(rows to solve B, counts of the others ic, the margin R kept, the pool's rows P or None,
        their labels labP or all labels), or None."""
        zero = torch.zeros(self.k, dtype=torch.int64, device=self.dev)
        while True:
            if self.pool is None:
                P, labP, mP, c_out, outer = None, self.at[0], self.at[1], zero, math.inf
            else:
                P, labP, mP, c_out, outer = self.pool
            nP = labP.numel()
            w = min(want, nP)
            st = max(1, nP // R_ROWS)     # (the margin of about w rows, from a strided sample)
            R = min(float(mP[::st].kthvalue(-(-w // st)).values) if w < nP else math.inf, outer)
            got = _near_rows(labP, mP, R, c_out, self.hi, must if P is None else None)
            if got is None and P is not None:
                self.pool = None     # the rows near a boundary cannot balance a cluster: all rows
                self._recount()
                continue
            if got is None:
                return None
            B, ic = got
            if P is not None:
                B = P.index_select(0, B)
            else:
                B, ic = _joiners(self.X, self.T, self.at, B, ic, self.target, R, self.bufs[0][3])
            return B, ic, R, P, labP

    def solve(self, eps, seed, top, t0):
        """The exact solve of the rows near a boundary, up to four tries (see _dense_translate)."""
        n, k, dev = self.n, self.k, self.dev
        slack = 2.0 ** -20 * (float(top) + float(self.T.abs().max())) + 4 * eps   # float32 margins
        want = self._want()
        history, must = [], None     # must: rows a try found to matter, solved in the next ones too
        for _ in range(4):
            got = self._rows_to_solve(want, must)
            if got is None:
                return None
            B, ic, R, P, labels = got
            if B.numel() * k * 10 > (1 << 30):
                return None     # (the streaming path keeps candidate lists where whole rows do not fit)
            solver = self._solve_rows(B, ic, R, eps, seed, history)
            if solver is None:
                return None
            dT, sol_labels, sol_counts = (t.to(dev) for t in (solver.dT, solver.labels, solver.counts))
            T_before, at_before = self.T, (self.at if P is None else None)
            if P is not None:
                labP, labels = labels, self.at[0]
                labels[P] = labP
            self.T = self.T + dT
            unsafe = None
            if float(dT.max() - dT.min()) + slack >= R:
                # T moved further than the margin kept: one pass at the solve's T says whether a
                # row left out changed its column or came within float32's rounding of doing so
                labels = labels.clone()
                self._recount()
                out = torch.ones(n, dtype=torch.bool, device=dev)
                out[B] = False
                unsafe = out & ((self.at[0] != labels) | (self.at[1] <= slack))
            if unsafe is None or not bool(unsafe.any()):
                labels[B] = sol_labels
                return self._result(labels, ic + sol_counts, solver, history, B.numel(), t0)
            # next try: the rows solved and the rows that changed, from the solve's T where those
            # are under 1 % of the rows solved, else from the T before it (near balance, where from
            # the solve's T the rows that changed unbalance it again)
            changed = unsafe.nonzero()[:, 0]
            must, self.pool = torch.cat([B, changed]), None
            if changed.numel() > FEW_CHANGED * B.numel():
                self.T = T_before
                if at_before is not None:
                    self.at, self.e = at_before, at_before[2].to(torch.float64) - self.target
                else:
                    self._recount()
            else:
                self.e = self.at[2].to(torch.float64) - self.target
            want = max(want, self._want())
        return None

    def _solve_rows(self, B, ic, R, eps, seed, history):
        """The solver on the rows B (whole, with the tie-break) for target - ic; None where no
        move reaches a cluster that needs rows.  A small solve runs on the host where the outputs
        are on a GPU: its rounds are a few kernels on small arrays each, which the GPU runs no
        faster and waits for the host in."""
        k = self.k
        sdev = torch.device("cpu") if B.numel() * k <= HOST_SOLVE else self.dev
        Bs = B.to(sdev)
        cb = torch.arange(k, device=sdev, dtype=torch.int16).expand(B.numel(), k)
        vals = (self.X.index_select(0, B).to(sdev, torch.float64) - self.T.to(sdev)
                + eps * _tie_jitter(Bs, cb, seed))
        tB, loB, hiB = (t.to(sdev) for t in (self.target - ic, (self.lo - ic).clamp(min=0), self.hi - ic))
        solver = _ExactSolver(vals, cb.contiguous(), torch.full((B.numel(),), -math.inf,
                              dtype=torch.float64, device=sdev), k, tB, loB, hiB,
                              _Comm(False), BLOCK, Bs)
        if not solver.run(200, history, max(R / 8, eps)):
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
