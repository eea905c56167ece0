"""The tuned exact labeler: `otl.translate`'s translation, found fast on large inputs.

`otl.py` holds the method and a short reference labeler; this file holds the labeler that training
uses, tuned for speed and memory and tested against that reference:

    res = otl_scale.translate(O)            # the same problem as otl.translate(O)
    st = otl_scale.StreamingTranslator(k)   # never holds the N x k outputs; torchrun-aware
    for batch in batches:
        st.add(net(batch))
    res = st.result(refetch=lambda rows: net(images[rows]))

Imports `otl` (never the other way).  numpy (cheaper small steps) and scipy (Dijkstra in C) are used
if installed; without them torch does the same work.  Design: docs/labeler.md."""
from __future__ import annotations

import heapq
import math
import numbers
import time
import warnings
from dataclasses import dataclass

import torch

import otl
from otl import (TranslateResult, even_target, _check_outputs, _check_outputs_finite,
                 _check_start, _check_target, _count_bounds, _std, _std_max)

try:
    import numpy as np
except ImportError:
    np = None

__all__ = ["translate", "StreamingTranslator", "sample_start_T", "ScaleResult"]


@dataclass
class ScaleResult(TranslateResult):
    refetched: int = 0            # rows re-read in full (their candidate lists fell short)
    active: int = 0               # rows solved (the others kept their best cluster)


def _within(counts, lo, hi) -> bool:
    """Whether every count is within its bounds [lo, hi] (_count_bounds)."""
    return bool(((counts >= lo) & (counts <= hi)).all())


def translation_steps(assign, range_of, T, labels, counts, target, std_max, history,
                      beta=1.5, alpha0=1e-15, patience=10, max_iter=10000, stop_std=0.0,
                      speed_up=False, stop=None, f0=1.0, std_fn=None):
    """Algorithm 1's loop with the published step rule, for any way of labelling:
    assign(T) -> (labels, counts) at O - T; range_of(T) -> max - min of O - T or a bound on it.  The
    std after each step tried is appended to `history`.  speed_up: after a step that removed under
    30 % of the std (ratio r), f *= max(1 - r, 0.5), as a linear response would need.
    stop() -> True ends the loop; the first steps are 1 / f0 of the rule's; std_fn defaults to _std.
    Returns (T, labels, counts, std, steps tried, stop reason) at the last accepted step."""
    target_d = target.to(T.device)
    std_fn = _std if std_fn is None else std_fn
    std, f, still, it, reason = std_fn(counts, target), float(f0), 0, 0, "max_iter"
    while it < max_iter:
        if std <= stop_std:
            reason = "balanced"
            break
        C = counts.to(torch.float64) - target_d      # > 0: the cluster wins too often
        C = C / C.max()
        alpha = (std / std_max) * range_of(T) / f
        if alpha <= alpha0:
            reason = "alpha0"
            break
        T_new = T + alpha * C
        labels_new, counts_new = assign(T_new)
        std_new = std_fn(counts_new, target)
        it += 1
        history.append(std_new)
        if stop is not None and stop():
            reason = "stop"
            break
        if std_new > std:                            # worse: undo, and take smaller steps
            f *= beta
            continue
        still = still + 1 if std_new == std else 0
        if speed_up and 0.7 < std_new / std < 1:
            f *= max(1 - std_new / std, 0.5)
        T, labels, counts, std = T_new, labels_new, counts_new, std_new
        if still >= patience:
            reason = "patience"
            break
    return T, labels, counts, std, it, reason


def translate(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
              patience: int = 10, max_iter: int = 10000, tie_eps=None, seed: int = 0,
              init: str = "median", method: str = "exact", candidates: int = 24,
              max_candidates: int = 48, full_rows_up_to: int = 128,
              full_rows_bytes: int = 1 << 30, warm_start: bool = True,
              start=None, sample_start: bool = True, dense: bool = True,
              n_init: int = 8192) -> TranslateResult:
    """A k-vector T such that labels = argmax(O - T) spread the N rows of O over the k clusters as
    the target asks (even by default, or any counts summing to N).  T only translates O, so every
    difference O[s] - O[t] is unchanged.

    method="exact" (default): counts end within 1 of the target, without an N x k copy.  With dense,
    for 2 <= k <= full_rows_up_to and N >= 64 k, the dense path runs first (`_dense_translate`:
    Newton steps on the counts, then an exact solve of the rows near a cluster boundary).
    Otherwise, or where it cannot finish, O is fed in chunks to `StreamingTranslator`, whose
    settings these are (N is its rows_hint; tie_eps defaults to 2**-26).  start: a T to start from
    instead of the column medians, such as the T of the other augmented view or of the last epoch.
    sample_start: without a start, for k > 2 x full_rows_up_to and outputs far from balance at their
    medians, start from the exact T of every 4th row (`sample_start_T`).
    method="published": Algorithm 1 as the authors' code runs it (`otl.translate_published`), with
    beta, alpha0, patience, max_iter, tie_eps (default 1e-6), seed and init."""
    if method == "published":
        if start is not None:
            raise ValueError("start= is the exact labeler's; the published rules start at 0")
        return otl.translate_published(outputs, target=target, beta=beta, alpha0=alpha0,
                                   patience=patience, max_iter=max_iter,
                                   tie_eps=1e-6 if tie_eps is None else tie_eps, seed=seed,
                                   init=init)
    if method != "exact":
        raise ValueError(f"method must be 'exact' or 'published', got {method!r}")
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    _check_outputs(outputs, finite=False)     # checked chunk by chunk, without an N x k copy
    n, k = outputs.shape
    if dense and 2 <= k <= full_rows_up_to and n >= 64 * k:
        res = _dense_translate(outputs, target, seed, 2.0 ** -26 if tie_eps is None else tie_eps,
                               start, n_init)
        if res is not None:
            return res
    if start is None and sample_start and k > 2 * full_rows_up_to:
        start = sample_start_T(outputs, target=target, seed=seed, candidates=candidates,
                               max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                               tie_eps=tie_eps)
    st = StreamingTranslator(k, target=target, seed=seed, candidates=candidates,
                             max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                             distributed=False, rows_hint=n, full_rows_bytes=full_rows_bytes,
                             tie_eps=2.0 ** -26 if tie_eps is None else tie_eps,
                             warm_start=warm_start, start=start, n_init=n_init)
    for s in range(0, n, st.chunk):
        st.add(outputs[s:s + st.chunk])
    return st.result(refetch=lambda rows: outputs[rows.to(outputs.device)])


def _median0(A):
    """A.median(dim=0).values (the lower middle value) of a float tensor; on the CPU by numpy's
    partition, which is cheaper there than torch's median."""
    if (np is None or A.device.type != "cpu" or A.shape[0] == 0
            or A.dtype not in (torch.float32, torch.float64)):
        return A.median(dim=0).values
    i = (A.shape[0] - 1) // 2
    B = np.array(A.detach().numpy().T, order="C")     # (columns as rows: partitioned faster)
    B.partition(i, axis=-1)
    return torch.from_numpy(np.array(B[..., i]))


def _tie_scale(head, tie_eps):
    """The tie-break's eps: tie_eps times the median over the first rows of a row's largest |O| (a
    median, so that one outlier cannot make the perturbation swamp real gaps; relative at every
    scale, as a fixed floor would swamp outputs smaller than it).  The dense and the
    streaming path take the same eps, so that they break ties alike."""
    if (np is not None and head.device.type == "cpu" and head.dtype == torch.float32
            and head.shape[1] <= 16):
        # (small k: numpy's max along short rows is slow, so take it down a transposed copy)
        top = torch.from_numpy(np.abs(np.array(head.numpy().T, order="C")).max(0))
    else:
        top = head.abs().amax(1)
    med = float(_median0(top))
    if med == 0:    # over half of the rows all zero: the others' scale (none: any eps > 0 splits)
        top = top[top > 0]
        med = float(top.median()) if top.numel() else 1e-30
    return tie_eps * med


def sample_start_T(outputs: torch.Tensor, target=None, every=None, probe: int = 2048,
                   **kw):
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
    cnt = torch.bincount((head - _median0(head)).argmax(1), minlength=k)
    if not StreamingTranslator._far(cnt.to(torch.float64), target):
        return None
    sub = outputs[::every]
    if target is not None:    # the same shares of the sample's rows
        target = _check_target(target, n, k).to(torch.float64) * (sub.shape[0] / n)
    kw = {key: val for key, val in kw.items() if val is not None}
    try:
        return translate(sub, target=target, sample_start=False, **kw).T
    except ValueError:     # bad outputs or target: the whole call says so, with its own row numbers
        return None


def _std_host(counts, target) -> float:
    """_std in numpy for k > 256 where numpy is installed: no torch operation (on a GPU each is a
    launch).  numpy sums in another order, so the last bits may differ: the exact labeler's rounds
    use it; the published rules keep _std, whose step sizes follow every bit of the std."""
    c, t = counts.cpu(), target.cpu()
    if c.numel() > 256 and np is not None and t.dtype == torch.float64:
        d = c.numpy().astype(np.float64) - t.numpy()
        return float(np.sqrt(np.mean(np.square(d))))
    return _std(c, t)


def _tie_jitter(rows: torch.Tensor, cols: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed uniform [0, 1) number per (global row, column) from integer hashing, so that every
    way of feeding the same outputs (dense, in batches, over ranks) perturbs them alike.  rows (r,),
    cols (r, m) int64 -> (r, m) float64.  Large blocks work in place; small ones on the CPU run the
    same integer steps in numpy (int64 wraps alike), which cost less per call."""
    if np is not None and cols.device.type == "cpu" and cols.numel() <= _JITTER_NP:
        x = cols.numpy().astype(np.int64) * 0x85EBCA77
        x += rows.numpy().astype(np.int64)[:, None] * 0x9E3779B1 + (int(seed) % 1000003) * 0xC2B2AE3D
        x ^= (x >> 16) & 0xFFFFFFFFFFFF
        x *= 0x27D4EB2F165667C5
        x ^= (x >> 29) & 0x7FFFFFFFF
        x = (x >> 11) & 0x1FFFFFFFFFFFFF
        return torch.from_numpy(x.astype(np.float64) * (1.0 / float(1 << 53)))
    x = cols.to(torch.int64) * 0x85EBCA77
    x.add_(rows.to(torch.int64)[:, None] * 0x9E3779B1 + (int(seed) % 1000003) * 0xC2B2AE3D)
    t = torch.bitwise_right_shift(x, 16)
    x.bitwise_xor_(t.bitwise_and_(0xFFFFFFFFFFFF))
    x.mul_(0x27D4EB2F165667C5)          # wraps around in int64, as intended
    torch.bitwise_right_shift(x, 29, out=t)
    x.bitwise_xor_(t.bitwise_and_(0x7FFFFFFFF))
    x.bitwise_right_shift_(11).bitwise_and_(0x1FFFFFFFFFFFFF)
    return x.to(torch.float64).mul_(1.0 / float(1 << 53))


_JITTER_NP = 1 << 16     # _tie_jitter in numpy up to this many values on the CPU


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

    def _reduce(self, x, op):
        return self._on_backend(x, lambda y: self.dist.all_reduce(y, op=op))

    def sum(self, x):
        return self._reduce(x, self.dist.ReduceOp.SUM)

    def max(self, x):
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def min(self, x):
        return self._reduce(x, self.dist.ReduceOp.MIN)

    def broadcast(self, x):
        return self._on_backend(x, lambda y: self.dist.broadcast(y, src=0))


class StreamingTranslator:
    """Output translation fed batch by batch, never holding the dense N x k outputs: `st.add(batch)`
    for each (n_b, k) batch in row order, then `st.result()` once.  `translate(O)` is this class fed
    O in chunks.

    The first `n_init` rows fix a start T0 (their column medians, or `start`), the tie-break's eps
    and a window.  Rows are kept whole when k <= full_rows_up_to, or when k <= 2 x full_rows_up_to,
    the outputs are far from balance (`_far`) and the rows fit (`_whole_rows_fit`); else each row
    keeps its candidates, the columns within `window` of its best at T0 (about `candidates`, at most
    `max_candidates`), and theta, a bound on the rest.  result() solves only the rows that lead at
    T0 by at most a radius (the others keep their cluster while T moves less), growing the radius
    until the solution fits, with `_ExactSolver`.  Counts end within 1 of the target.  Rows whose
    candidates fall short are read again whole through refetch(row_indices) -> their outputs.

    A fixed hash tie-break eps * u(row, column) splits identical outputs.  NaN and +-inf raise (with
    candidate lists a -inf after the first rows passes: it is never a candidate).  Distributed: each
    rank adds its shard in rank order (row_offset: its first row's global number); ranks exchange
    k-vectors and k x k tables.
    See docs/labeler.md, 'Large k or streamed rows: candidate lists, auction, shortest paths'."""

    def __init__(self, k: int, target=None, seed: int = 0, candidates: int = 24,
                 max_candidates: int = 48, full_rows_up_to: int = 128, n_init: int = 8192,
                 tie_eps: float = 2.0 ** -26,
                 distributed: bool = True, chunk: int = 65536, row_offset=None,
                 rows_hint=None, full_rows_bytes: int = 1 << 30, warm_start: bool = True,
                 start=None):
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
        self.all_cols = self.k <= max(2 * self.max_candidates, self.full_rows_up_to)
        self.small_k = self.all_cols    # whole rows by k alone, not by _far (_warm_start)
        # the rows this process will add, when known: with them whole rows may be kept (_start)
        self.rows_hint = None if rows_hint is None else int(rows_hint)
        self.full_rows_bytes = int(full_rows_bytes)
        self.warm_start, self.f0 = bool(warm_start), 1.0   # see _warm_start
        # a start translation instead of the first rows' column medians (rank 0's counts)
        self.start = None if start is None else _check_start(start, self.k)
        self.widen = 1      # 2: candidate lists twice as wide (_collapsed, decided in _start)
        self.width = self.k if self.all_cols else self.max_candidates
        self.cdtype = torch.int16 if self.k < 32768 else torch.int32
        self.buffer, self.nbuf = [], 0
        self.vals, self.cols, self.theta = [], [], []
        self.n, self.T0, self.device, self.t0 = 0, None, None, None
        self.kept, self.used = None, False   # local rows the store holds (None: all); result() ran
        # rows per pass: 8192 on the CPU, so a pass's temporaries stay in cache; `chunk` on a GPU
        self.block, self._diff, self._mask = 8192, None, None

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
        if self.T0 is None:
            self.buffer.append(outputs)
            self.nbuf += outputs.shape[0]
            if self.nbuf >= self.n_init:
                self._start()
            return
        for s in range(0, outputs.shape[0], self.chunk):
            self._extract(outputs[s:s + self.chunk])

    def _start(self):
        pieces, self.buffer, self.nbuf = self.buffer, [], 0
        parts, got = [], 0     # the head: a copy of the first n_init rows only
        for p in pieces:
            if got >= self.n_init:
                break
            parts.append(p[:self.n_init - got])
            got += parts[-1].shape[0]
        head = torch.cat(parts) if parts else torch.zeros(0, self.k)
        self.device = head.device
        head = head if head.dtype == torch.float64 else head.to(torch.float32)
        # T0, eps, window, radius0, keep whole rows (1 / 0), far (1 / 0), candidate list widening
        params = torch.zeros(self.k + 6, dtype=torch.float64, device=self.device)
        params[self.k + 5] = 1.0
        if head.shape[0] > 0:
            _check_outputs_finite(head)
            params[:self.k] = (_median0(head).to(torch.float64) if self.start is None
                               else self.start.to(self.device))             # values of O
            params[self.k] = _tie_scale(head, self.tie_eps)
            # the first rows' counts at the medians (_far, _collapsed)
            cnt = torch.bincount((head - params[:self.k].to(head.dtype)).argmax(1),
                                 minlength=self.k).to(torch.float64)
            far = self._far(cnt, self.target_arg)
            params[self.k + 4] = float(far)
            whole = self.all_cols or (far and self.k <= 2 * self.full_rows_up_to
                                      and self._whole_rows_fit())
            params[self.k + 3] = float(whole and not self.all_cols)
            if not whole:   # the window: a typical row's `candidates`-th largest gap
                if 4 * self.max_candidates <= self.k and self._collapsed(cnt):
                    params[self.k + 5] = 2.0
                wide = int(params[self.k + 5].item()) * self.candidates
                S = head[:2048] - params[:self.k].to(head.dtype)
                gaps = S.amax(1, keepdim=True) - S
                params[self.k + 1] = gaps.kthvalue(min(wide, self.k), dim=1).values.median().item()
            params[self.k + 2] = self._first_radius(head, params[:self.k]).item()
        if self.comm.on:   # rank 0's first rows decide, so every rank uses the same T0 and window
            params = self.comm.broadcast(params.cpu()).to(self.device)
        if _launch_bound(self.device):   # blocks sized for a CPU cache only cost launches there
            self.block = self.chunk
        if params[self.k + 3].item() > 0:
            self.all_cols, self.width = True, self.k
        self.widen = int(params[self.k + 5].item())
        if self.widen > 1 and not self.all_cols:
            self.candidates *= self.widen
            self.max_candidates *= self.widen
            self.width = self.max_candidates
        self.T0, self.eps = params[:self.k].clone(), params[self.k].item()
        self.T0f = self.T0.to(torch.float32)     # exact for float32 outputs (medians of them)
        self.T0abs = float(self.T0.abs().max())   # float64 outputs: T0f errs by 2^-24 of this
        # at least 2 eps: columns within eps of a row's best can still win by the tie-break, so they
        # must be candidates (on collapsed outputs the gaps, and so the window, are 0)
        self.window = math.inf if self.all_cols else max(params[self.k + 1].item(), 2 * self.eps)
        self.radius0 = max(params[self.k + 2].item(), self.eps)
        self.far = params[self.k + 4].item() > 0
        for p in pieces:
            for s in range(0, p.shape[0], self.chunk):
                self._extract(p[s:s + self.chunk])

    @staticmethod
    def _first_radius(rows, T):
        """The first radius: the 0.2 quantile of the leads (best - runner-up) of 2048 rows at T."""
        top2 = (rows[:2048] - T.to(rows.dtype)).topk(2, dim=1).values
        return (top2[:, 0] - top2[:, 1]).to(torch.float64).quantile(0.2)

    def _whole_rows_fit(self):
        """Whether the rows to come (rows_hint x k x 10 bytes) fit in `full_rows_bytes`.  Candidates
        hold a row's final cluster only while the translation stays within the window; on real
        networks' outputs it does not, and whole rows spare re-reading most rows."""
        return self.rows_hint is not None and self.rows_hint * self.k * 10 <= self.full_rows_bytes

    @staticmethod
    def _far(cnt, target_arg=None):
        """Whether the first rows' counts at the column medians are far from the target: their mean
        squared deviation over the mean count (about 1 for sampling noise) is over 4.  Far outputs
        also skip result()'s narrow first solve, as their translation moves most rows."""
        n, k = int(cnt.sum()), cnt.numel()
        target = StreamingTranslator._head_target(target_arg, n, k)
        return float(((cnt - target.to(cnt.device)) ** 2).mean()) > 4 * n / k

    @staticmethod
    def _head_target(target_arg, n, k):
        """The target's shares scaled to n rows (the even target without one; result() checks
        the target itself)."""
        if target_arg is not None:
            try:
                t = torch.as_tensor(target_arg, dtype=torch.float64).flatten().cpu()
                if t.numel() == k and bool(torch.isfinite(t).all()) and t.sum() > 0:
                    return t / t.sum() * n
            except (TypeError, ValueError, RuntimeError):
                pass
        return even_target(n, k)

    def _collapsed(self, cnt):
        """Whether the first rows at the column medians fill under a third of the clusters that rows
        drawn at the target would fill (a network collapsing onto a few clusters).  Most rows must
        then move deep into their lists, so the lists are made twice as wide."""
        used = cnt > 0
        target = self._head_target(self.target_arg, int(cnt.sum()), self.k).to(torch.float64)
        expected = float((1 - torch.exp(-target)).sum())   # clusters a Poisson sample fills
        return float(used.sum()) < expected / 3

    def _extract(self, X: torch.Tensor):
        X = X.to(self.device)
        if X.shape[0] == 0:
            return
        if X.dtype != torch.float64:
            X = X.to(torch.float32)
        if self.all_cols:
            _check_outputs_finite(X, self.n)
            n = X.shape[0]
            cols = torch.arange(self.k, device=self.device).expand(n, self.k)
            vals = X.to(torch.float64) - self.T0       # the tie-break is added in result()
            self.n += n
            self._store(vals, cols, torch.full((n,), -math.inf, dtype=torch.float64, device=self.device))
            return
        for s in range(0, X.shape[0], self.block):
            self._extract_block(X[s:s + self.block])

    def _extract_block(self, X: torch.Tensor):
        """Candidates of one block of rows, in passes that write nothing N x k sized: S = X - T0
        into a reused buffer, its row maxima, a reused int8 mask S >= max - window, read 8 columns
        at a time as int64 words (almost every word is 0)."""
        n, k, w, dev = X.shape[0], self.k, self.width, self.device
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
            _check_outputs_finite(X, self.n)        # -inf never makes a candidate, so it may stay
        thr = rmax - self.window
        # hits per row, from the mask read as int64 words: the words with a hit are listed, then the
        # hits in them.  Rows with a hit in 9 / 10 of their words or more ("dense") are counted by a
        # sum over their mask and listed only if not taken whole.  Rows with more than w hits keep
        # their best w by exact value with the tie-break; where those rows hold most of their
        # columns they are taken whole, unlisted (on collapsed outputs every column is a hit).
        W = M.view(-1).view(torch.int64)
        kw = kp // 8
        fw = W.nonzero()[:, 0]                                  # the words with a hit, ascending
        frow = torch.div(fw, kw, rounding_mode="floor")
        dense = torch.bincount(frow, minlength=n) * 10 >= 9 * kw
        di = dense.nonzero()[:, 0]
        if di.numel():
            fw = fw[~dense.index_select(0, frow)]
        rr, cc = self._hits(W, fw, kp)
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
            d_rr, d_cc = self._hits(W, (back[:, None] * kw + torch.arange(kw, device=dev)).view(-1), kp)
            order = torch.cat([rr * kp + cc, d_rr * kp + d_cc]).sort().indices
            rr, cc = torch.cat([rr, d_rr])[order], torch.cat([cc, d_cc])[order]
        listed = torch.bincount(rr, minlength=n)                # hits per row listed (none on rows taken whole)
        pos = torch.arange(rr.numel(), device=dev) - (torch.cumsum(listed, 0) - listed).index_select(0, rr)
        self.n += n
        # fl(X - T0) errs by at most 2^-24 |S| (float64 outputs: T0f errs by 2^-24 |T0| too): a
        # per-row allowance keeps theta a true bound on every dropped column, whatever the blocks
        thr64 = thr.to(torch.float64)
        t0abs = self.T0abs if X.dtype == torch.float64 else 0.0
        theta = thr64 + 2.0 ** -22 * (thr64.abs() + t0abs) + self.eps
        theta[cnt >= k] = -math.inf                             # nothing was dropped
        # flat (n * w) tables with one spare slot at the end for the entries not kept
        vals = torch.full((n * w + 1,), -math.inf, dtype=torch.float64, device=dev)
        cols = torch.zeros(n * w + 1, dtype=self.cdtype, device=dev)
        at = rr * w + pos

        def exact(r, c):   # O - T0 in float64 at rows r, columns c
            return X.reshape(-1).index_select(0, r * k + c).to(torch.float64) - self.T0.index_select(0, c)

        val = exact(rr, cc)
        if oi.numel() > 0:   # more than w near the top: keep the best w of them, bound the rest
            # exact values with the tie-break, so that exactly tied outputs (a collapsed network)
            # keep different columns on different rows
            first = self.n - n + self.row_offset                # global number of row 0 here
            if whole:                                           # most of these rows' columns
                PC = torch.arange(k, device=dev).expand(oi.numel(), k)
                P = self._whole_rows(X.index_select(0, oi), oi + first)
            else:
                e = many.index_select(0, rr).nonzero()[:, 0]    # their entries
                re, ce, pe = rr.index_select(0, e), cc.index_select(0, e), pos.index_select(0, e)
                slot = torch.cumsum(many, 0).index_select(0, re) - 1
                P = torch.full((oi.numel(), int(cnt.max())), -math.inf, dtype=torch.float64, device=dev)
                PC = torch.zeros(P.shape, dtype=torch.int64, device=dev)
                ae = slot * P.shape[1] + pe
                P.view(-1).index_copy_(0, ae, val.index_select(0, e) + self.eps * _tie_jitter(
                    re + first, ce[:, None], self.seed)[:, 0])
                PC.view(-1).index_copy_(0, ae, ce)
            tv, ti = P.topk(w + 1, dim=1)                      # (o, w + 1) among the candidates
            theta[oi] = torch.maximum(theta[oi], tv[:, w])    # the same sum as result() makes
            kept_cols = PC.gather(1, ti[:, :w]).reshape(-1)         # (o * w,)
            om = (oi[:, None] * w + torch.arange(w, device=dev)).view(-1)
            vals.index_copy_(0, om, exact(oi.repeat_interleave(w), kept_cols))
            cols.index_copy_(0, om, kept_cols.to(self.cdtype))
            if not whole:
                at = torch.where(many.index_select(0, rr), n * w, at)   # the rest: the spare slot
        vals.index_copy_(0, at, val)                                    # exact
        cols.index_copy_(0, at, cc.to(self.cdtype))
        vals, cols = vals[:n * w].view(n, w), cols[:n * w].view(n, w)
        self._store(vals, cols, theta)

    @staticmethod
    def _hits(W, fw, kp):
        """(rows, columns) of the hits in the int64 words fw (ascending) of the int8 mask W, in
        row-major order; kp columns a row."""
        hit = W.index_select(0, fw).view(torch.int8).nonzero()[:, 0]   # (c,) word * 8 + byte
        g = fw.index_select(0, hit >> 3).mul_(8).add_(hit & 7)  # flat positions in M, ascending
        rr = torch.div(g, kp, rounding_mode="floor")            # rows, ascending
        return rr, g.sub_(rr * kp)

    def _store(self, vals, cols, theta):
        self.vals.append(vals)
        self.cols.append(cols if cols.dtype == self.cdtype else cols.to(self.cdtype))
        self.theta.append(theta)

    # -- solving ---------------------------------------------------------------------------
    def result(self, refetch=None, max_rounds: int = 200) -> TranslateResult:
        """The translation of every row added (this rank's rows).  Call it once: it moves the
        stored candidates into the solver (so they are not held twice) and adds the tie-break."""
        if self.used:
            raise RuntimeError("result() can be called once per StreamingTranslator (it consumes "
                               "the stored candidates); feed a new one")
        self.used = True
        if self.T0 is None:
            self._start()
        if self.t0 is None:
            self.t0 = time.perf_counter()
        comm, k, dev = self.comm, self.k, self.device
        sizes = torch.zeros(comm.world, dtype=torch.int64)
        sizes[comm.rank] = self.n
        sizes = comm.sum(sizes)
        n_total = int(sizes.sum())
        self.offset = int(sizes[:comm.rank].sum())
        if self.row_offset_given and self.row_offset != self.offset:
            raise ValueError(f"row_offset={self.row_offset}, but the ranks before this one hold "
                             f"{self.offset} rows: add shards in rank order")
        if n_total < k:
            raise ValueError(f"need at least as many outputs as clusters (N >= k), got N={n_total}, k={k}")
        target = _check_target(self.target_arg, n_total, k)
        lo, hi = (b.to(dev) for b in _count_bounds(target))
        self._add_jitter(self.offset)   # now the global row numbers are known
        self._diff = self._mask = None        # the extraction buffers
        if (self.warm_start and self.start is None and self.small_k and self.far
                and n_total >= 4 * self._warm_rows()):
            self._warm_start(n_total, target)
        # Working set: at T0 every row leads by a margin over its runner-up (or theta).  While no
        # T_j moves by more than `radius` relative to another, rows with a larger margin keep their
        # column, so only the others are solved; the radius grows until the translation found fits.
        lab0 = torch.empty(self.n, dtype=torch.int64, device=dev)
        margin = torch.empty(self.n, dtype=torch.float64, device=dev)
        for s, vals, cols, theta in self._chunks():
            best, arg, second = _top2_(vals.clone())
            lab0[s:s + vals.shape[0]] = cols.long().gather(1, arg)[:, 0]
            margin[s:s + vals.shape[0]] = best - torch.maximum(second, theta)
        # Outputs far from the target (real networks') move most rows: one solve on all of them;
        # from a given start (near the answer) a narrow first solve, however far the counts are
        radius = math.inf if self.far and self.start is None else self.radius0
        dT, history, refetched, rounds, phases = None, [], 0, 0, 0
        solver = None
        while True:
            act = (margin <= radius).nonzero()[:, 0]
            n_act = int(comm.sum(torch.tensor([act.numel()]))[0])
            ic = comm.sum(torch.bincount(lab0[margin > radius], minlength=k))   # counts of the rest
            if n_act < n_total and bool((ic > hi).any()):
                # the rest already overfill a cluster: widen first, by at least one more row
                nxt = margin[margin > radius].min() if bool((margin > radius).any()) else torch.tensor(math.inf)
                radius = max(4 * radius, float(comm.min(nxt.to(torch.float64).reshape(1).cpu())[0]))
                continue
            # the rows to solve leave the store (those of an earlier, narrower solve come from
            # its solver); at T0 (first solve) their labels are known already
            prev = None if solver is None else (solver.rows_global - self.offset, solver)
            solver, got = self._solve(*self._take(act, prev), act, target.to(dev) - ic,
                                      (lo - ic).clamp(min=0), hi - ic, dT, refetch, history,
                                      max_rounds, rounds, phases,
                                      labels=lab0.index_select(0, act) if dT is None else None)
            refetched += got
            dT, rounds, phases = solver.dT, solver.rounds, solver.phases
            span = float(dT.max() - dT.min())
            if n_act == n_total or span < radius:
                break
            radius = max(2 * radius, 2 * span)
        labels = lab0
        labels[act] = solver.labels
        counts = ic + solver.counts
        std = _std_host(counts.cpu(), target)
        std_max = _std_max(target, n_total, _std_host)
        ok = _within(counts, lo, hi)
        if not ok:
            warnings.warn(
                f"the exact labeler ended with counts {int(counts.min())} - {int(counts.max())}, "
                "outside the target's bounds (stop_reason 'max_iter'); the labels are usable but "
                "not balanced.  With tie_eps=0 identical rows cannot be split; otherwise please "
                "report the outputs that did this", RuntimeWarning)
        res = ScaleResult(labels=labels, T=self.T0 + dT, counts=counts, target=target,
                              iterations=rounds + phases, std_history=history, std=std,
                              std_max=std_max, seconds=time.perf_counter() - self.t0,
                              stop_reason="balanced" if ok else "max_iter", refetched=refetched,
                              ties=solver.ties, ties_left=solver.ties_left, active=n_act)
        return res

    def _warm_rows(self):
        """Rows of the warm start's sample: 32 a cluster, at least 4096."""
        return max(4096, 32 * self.k)

    def _warm_start(self, n_total, target):
        """Re-centre the stored whole rows (T0 and O - T0) at the exact T of the global rows 0, s,
        2s, ... (s = N // _warm_rows()), solved by a StreamingTranslator of its own on rank 0 (the
        rows gathered by a sum over ranks, so any split gives the same start).  From the medians of
        outputs far from balance most of the step rule's time goes to getting near; from here the
        solve starts near, with steps f0 = 16 times smaller so that the first does not overshoot."""
        k, comm, dev = self.k, self.comm, self.device
        stride = n_total // self._warm_rows()
        n_sub = (n_total - 1) // stride + 1
        first = (-self.offset) % stride                # this rank's first sampled local row
        local = torch.arange(first, self.n, stride, device=dev)
        sub = torch.zeros(n_sub, k, dtype=torch.float64, device=dev)
        start = 0
        for vals in self.vals:     # O + eps u of the sampled rows (stored: O - T0 + eps u)
            end = start + vals.shape[0]
            lo, hi = torch.searchsorted(local, torch.tensor([start, end], device=dev)).tolist()
            r = local[lo:hi]
            sub.index_copy_(0, torch.div(r + self.offset, stride, rounding_mode="floor"),
                            vals.index_select(0, r - start) + self.T0)
            start = end
        params = torch.zeros(k + 1, dtype=torch.float64, device=dev)
        sub = comm.sum(sub)       # (one process: as it is)
        if comm.rank == 0:
            st = StreamingTranslator(k, target=target.to(torch.float64) * (n_sub / n_total),
                                     seed=self.seed, full_rows_up_to=k, n_init=self.n_init,
                                     distributed=False, chunk=self.chunk, rows_hint=n_sub,
                                     warm_start=False)
            for s in range(0, n_sub, st.chunk):
                st.add(sub[s:s + st.chunk])
            res = st.result()
            params[:k] = res.T.to(dev)
            params[k] = self._first_radius(sub, params[:k])   # at the new start
        del sub
        params = comm.broadcast(params)
        d = params[:k] - self.T0
        for vals in self.vals:     # whole rows: every column in order
            vals.sub_(d)
        self.T0 = params[:k].clone()
        self.T0f, self.T0abs = self.T0.to(torch.float32), float(self.T0.abs().max())
        self.radius0 = max(params[k].item(), self.eps)
        self.far, self.f0 = False, 16.0

    def _chunks(self):
        """(first row, vals, cols, theta) of every stored piece of at most `block` rows."""
        s = 0
        for vals, cols, theta in zip(self.vals, self.cols, self.theta):
            for t in range(0, vals.shape[0], self.block):
                yield s + t, vals[t:t + self.block], cols[t:t + self.block], theta[t:t + self.block]
            s += vals.shape[0]

    def _take(self, rows, prev=None):
        """vals, cols, theta, epoch and cuts (see _ExactSolver) of the local rows `rows`
        (ascending), moved out of the store piece by piece, so that they are never held twice.
        prev: (rows, solver) of an earlier solve on some of them, whose newer candidates are taken
        instead (cut back to the store's width if it took whole rows)."""
        w, dev, n_out = self.width, self.device, rows.numel()
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
                bound = sv.theta - sv._rise().index_select(0, sv.epoch)
                parts = self._cut(sv.vals, sv.dT, sv.cols, bound)
                cuts = torch.cat([sv.cuts, sv.dT[None, :]])
                ep = torch.full_like(sv.epoch, cuts.shape[0] - 1)
            for o, p in zip(out, parts):
                o.index_copy_(0, at, p.to(o.dtype))
            epoch.index_copy_(0, at, ep)
            new = torch.ones(n_out, dtype=torch.bool, device=dev)
            new[at] = False
            dst = new.nonzero()[:, 0]
            rows = rows.index_select(0, dst)
        pos = rows if self.kept is None else torch.searchsorted(self.kept, rows)   # in the store
        left = torch.ones(sum(v.shape[0] for v in self.vals), dtype=torch.bool, device=dev)
        left[pos] = False
        self.kept = (torch.arange(left.numel(), device=dev) if self.kept is None else self.kept)[left]
        pieces, self.vals, self.cols, self.theta = list(zip(self.vals, self.cols, self.theta)), [], [], []
        start = 0
        for i in range(len(pieces)):
            parts, pieces[i] = pieces[i], None       # each old piece is freed once split
            end = start + parts[0].shape[0]
            lo, hi = torch.searchsorted(pos, torch.tensor([start, end], device=dev)).tolist()
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
        return (*out, epoch, cuts)

    def _solve(self, vals, cols, theta, epoch, cuts, rows, target, lo, hi, dT, refetch, history,
               max_rounds, rounds, phases, labels=None):
        """The exact solver on the rows `rows` (local indices; vals, cols, theta are theirs), with
        refetching of rows whose candidates fall short.  Returns (solver, rows refetched)."""
        comm, k, dev = self.comm, self.k, self.device
        rows_global = rows + self.offset
        solver = _ExactSolver(vals, cols, theta, k, target, lo, hi, comm, self.block, rows_global, dT=dT,
                              rounds=rounds, phases=phases, labels=labels, epoch=epoch, cuts=cuts)
        # reverse auction rounds on candidate lists far from balance, once the rows are spread over
        # half of the clusters (an empty cluster is in few rows' candidates)
        solver.f0 = self.f0
        wide_far = self.far and vals.shape[1] < k
        solver.reverse = wide_far and int((solver.counts > 0).sum()) >= 0.5 * k
        pending = wide_far and not solver.reverse
        history.append(solver._std())
        # Rows whose candidates fell short are read again, their candidates chosen at the current T,
        # while that helps (past 6 times only while each solve gains a fifth).  Then every row's
        # candidates are chosen again once; only after that does the solver take whole rows.
        refetched, width, recut_all, rereads = 0, vals.shape[1], False, 0
        best, last_unsafe, progress = math.inf, math.inf, True
        for attempt in range(40):
            if pending and width < k and int((solver.counts > 0).sum()) >= 0.5 * k:
                solver.reverse, pending = True, False
            balanced = solver.run(max_rounds, history, self.radius0,
                                  check_rows=rereads < 6 or progress)
            unsafe = solver.unsafe_rows()
            n_unsafe = int(comm.sum(torch.tensor([unsafe.numel()]))[0])
            std = solver._std()
            progress = std < 0.8 * best or n_unsafe < 0.8 * last_unsafe
            best, last_unsafe = min(best, std), n_unsafe
            more = rereads < 6 or progress
            if (balanced and not n_unsafe) or width >= k:
                break
            if refetch is None:
                if n_unsafe:
                    raise RuntimeError(
                        f"{n_unsafe} rows' best candidate could be beaten by a column they "
                        "dropped; pass refetch=fn(rows) -> outputs of those rows, or use more "
                        "candidates")
                raise RuntimeError(
                    "the candidate lists are too short for these outputs (no cheap move reaches "
                    "an under-full cluster); pass refetch=fn(rows) -> outputs of those rows, or "
                    "keep whole rows (full_rows_up_to >= k)")
            if n_unsafe and more:
                rereads += 1
                refetched += self._recut(solver, unsafe, rows, refetch)
                continue
            if not recut_all:
                recut_all = True
                refetched += self._recut(solver, solver.all_rows, rows, refetch)
                continue
            vals = torch.empty(rows.numel(), k, dtype=torch.float64, device=dev)
            for s in range(0, rows.numel(), self.chunk):
                r = rows[s:s + self.chunk]
                X = refetch((r + self.offset).cpu()).to(dev)
                vals[s:s + r.numel()] = self._whole_rows(X, r + self.offset)
            refetched += rows.numel()
            width = k
            cols = torch.arange(k, device=dev).to(self.cdtype).expand(rows.numel(), k).contiguous()
            theta = torch.full((rows.numel(),), -math.inf, dtype=torch.float64, device=dev)
            solver = _ExactSolver(vals, cols, theta, k, target, lo, hi, comm, self.block,
                                  rows_global, dT=solver.dT, rounds=solver.rounds, phases=solver.phases)
        solver.strictify(keep_balance=self.eps > 0)
        return solver, refetched

    def _recut(self, solver, pos, rows, refetch):
        """Re-choose the candidates of the solver's rows `pos` at its dT from their outputs, read in
        pieces of at most 256 MB; returns how many were read (every rank calls it)."""
        step = max(1, min(self.chunk, (1 << 28) // (8 * self.k)))
        for s in range(0, pos.numel(), step):
            p = pos[s:s + step]
            X = refetch(solver.rows_global.index_select(0, p).cpu()).to(self.device)
            solver.replace_rows(p, *self._full_rows(X, rows.index_select(0, p), solver.dT))
        solver.recount()
        return pos.numel()

    def _add_jitter(self, offset):
        # stored values are O - T0; add eps * u(global row, col), the same sum in every mode
        start, step = 0, self.block
        for vals, cols in zip(self.vals, self.cols):
            for s in range(0, vals.shape[0], step):
                vs, cs = vals[s:s + step], cols[s:s + step].long()
                rows = torch.arange(start + s, start + s + vs.shape[0], device=self.device)
                vs.add_(_tie_jitter(rows + offset, cs, self.seed), alpha=self.eps)   # -inf stays
            start += vals.shape[0]

    def _whole_rows(self, X, grows):
        """O - T0 + eps u for every column of the rows X, whose global numbers are `grows`: the
        values the candidates hold once result() has added the tie-break."""
        cols = torch.arange(self.k, device=self.device).expand(X.shape[0], self.k)
        V = X.to(torch.float64).sub_(self.T0)     # in place: the same sums, fewer n x k buffers
        return V.add_(_tie_jitter(grows, cols, self.seed).mul_(self.eps))

    def _full_rows(self, X, rows, dT):
        """Candidates of `rows` (local indices) from their full outputs X, chosen against the
        current translation, so the dropped columns cannot win."""
        # the best `width` + 1 columns without the tie-break (hashing every column is costly), then
        # the kept columns' exact values; a dropped column scores at most the (w+1)-th plus eps
        w = self.width
        S = X.to(torch.float64) - (self.T0 + dT)
        tv, ti = S.topk(w + 1, dim=1)
        del S
        ti = ti[:, :w]
        vals = (X.gather(1, ti).to(torch.float64) - self.T0.index_select(0, ti.reshape(-1)).view(ti.shape)
                + self.eps * _tie_jitter(rows + self.offset, ti, self.seed))
        b, scale = tv[:, w], float(self.T0.abs().max()) + float(dT.abs().max()) + self.eps
        slack = 2.0 ** -50 * (b.abs() + scale)
        theta = torch.where(torch.isfinite(b), b + self.eps + slack, b)
        # Where the w-th best leads the (w+1)-th by more than eps, these are the best w with the
        # tie-break too.  Elsewhere (within eps, as on collapsed rows) the tie-break decides: those
        # rows' best w are chosen on their exact values with it, as the stream chose them
        tied = (tv[:, w - 1] - b <= self.eps + 2 * slack).nonzero()[:, 0]
        if tied.numel():
            V = self._whole_rows(X.index_select(0, tied), rows.index_select(0, tied) + self.offset)
            vals[tied], c2, b2 = self._cut(V, dT)
            ti[tied] = c2.long()
            theta[tied] = torch.where(torch.isfinite(b2), b2 + 2.0 ** -50 * (b2.abs() + scale), b2)
        return vals, ti.to(self.cdtype), theta

    def _cut(self, S, dT, cols=None, theta=None):
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


def _cat(parts):
    """torch.cat of a non-empty list of tensors; a single one as it is (no copy, and on a GPU no
    launch: the solver's rounds are mostly one block)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _host_vec(t):
    """A k-vector on the host for a round's bookkeeping: a numpy view where numpy is installed
    (cheaper small steps), else the CPU tensor."""
    t = t.cpu()
    return t.numpy() if np is not None else t


def _as_torch(x):
    """_host_vec's result as a CPU tensor (shared memory where it is numpy's)."""
    return torch.from_numpy(x) if np is not None and isinstance(x, np.ndarray) else x


def _pos(x):
    """max(x, 0), numpy's or torch's as x is."""
    return np.maximum(x, 0) if np is not None and isinstance(x, np.ndarray) else x.clamp(min=0)


def _arange_like(x):
    """0 .. len(x) - 1, numpy's or torch's as x is."""
    return np.arange(len(x)) if np is not None and isinstance(x, np.ndarray) else torch.arange(len(x))


def _top2_(S):
    """(best value, its column as an (n, 1) index, runner-up) of each row of S, as topk(2) gives
    them (a tie for the best: the first column, and the runner-up equals it), by max and a scatter,
    which cost less than topk.  S is overwritten: its best entries become -inf."""
    best, arg = S.max(1, keepdim=True)
    best = best[:, 0]
    second = S.scatter_(1, arg, -math.inf).amax(1) if S.shape[1] > 1 else torch.full_like(best, -math.inf)
    return best, arg, second


class _ExactSolver:
    """The translation solved on candidate lists (see StreamingTranslator).  vals (n, w): O - T0 of
    each row's candidates, cols (n, w) their clusters, rows_global (n,) the rows' global numbers
    (ascending); dT (k,) = T - T0, float64.  theta (n,) bounds the dropped columns at the
    translation the row's candidates were chosen at, cuts[epoch[i]] ((E, k); row 0: zeros, T0): at
    any dT a dropped column j of row i scores at most theta_i - min(dT - cuts[epoch_i]), so a row
    chosen again at the current dT (replace_rows) stays safe while T moves less than its lead.

    run() balances in three stages: far from balance, the published step rule on each row's best
    candidates (_approach); an ascending auction in which over-full clusters raise T_j just enough
    to shed their excess, with reverse rounds that pull rows into under-full ones (_attract); an
    exact finish by shortest augmenting paths on the cluster graph (_finish).  strictify() then
    nudges T so that every label is a strict argmax."""

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
        self.rounds, self.phases, self.ties, self._last_eval = rounds, phases, 0, None
        self._last_rise = None
        self.ties_left = 0    # rows strictify left on a tie (see there)
        self.f0 = 1.0     # the approach's first step is 1 / f0 of the published rule's
        self.reverse = False   # reverse auction rounds (_attract) on candidate lists
        self.all_rows = torch.arange(vals.shape[0], device=self.dev)
        self.natural = self._natural(cols)
        # labels: the rows' argmax at dT when the caller has it (the same _top2_ on the same values)
        self.labels = self._eval(self.all_rows)[1] if labels is None else labels
        self.counts = self._count()

    def _natural(self, cols):
        """Whether cols holds every column in order (whole rows): then a slot's column is its
        position, with no gathers of dT by column, and moves fill the k x k table by row."""
        k = self.k
        return cols.shape[1] == k and bool((cols == torch.arange(k, device=cols.device)
                                            .to(cols.dtype)).all())

    def _count(self):
        return self.comm.sum(torch.bincount(self.labels, minlength=self.k))

    def _std(self):
        return _std_host(self.counts.cpu(), self.target)

    def _gathered(self, d, cols):
        """d[cols] for a (n, w) block of cluster numbers, by index_select on int32 (cheaper than
        advanced indexing with int64)."""
        return d.index_select(0, cols.reshape(-1).to(torch.int32)).view(cols.shape)

    def _rise(self, d=None):
        """(E,) at least how far T has risen since each epoch's cut, min(d - cuts[e]): a row of
        epoch e bounds its dropped columns by theta - _rise(d)[e] at d (default: the current dT)."""
        d = self.dT if d is None else d
        last = self._last_rise    # (kept for the same d and cuts: a round's blocks share them)
        if last is None or last[0] is not d or last[1] is not self.cuts:
            self._last_rise = last = (d, self.cuts, (d[None, :] - self.cuts).amin(1))
        return last[2]

    def _blocks(self, rows):
        """(vals, cols, bound) of `rows` in pieces of at most `chunk` (slices when rows are all
        rows); bound: the most a dropped column of the row scores at the current dT."""
        m = self._rise()
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

    def _eval(self, rows):
        """best score, its column, the runner-up (or the bound on dropped columns), unsafe."""
        out = [[], [], [], []]
        for vr, cr, thb in self._blocks(rows):
            if self.natural:
                best, arg, second = _top2_(vr - self.dT)
                out[1].append(arg[:, 0])
            else:
                best, arg, second = _top2_(vr - self._gathered(self.dT, cr))
                out[1].append(cr.gather(1, arg)[:, 0].long())
            out[0].append(best)
            out[2].append(torch.maximum(second, thb))
            out[3].append(best <= thb)
        if not out[0]:
            e = torch.zeros(0, dtype=torch.float64, device=self.dev)
            return e, torch.zeros(0, dtype=torch.int64, device=self.dev), e, e.bool()
        return tuple(_cat(o) for o in out)

    def _eval_all(self):
        """_eval of every row, kept while dT and the rows stay (run(check_rows=True), then
        _solve's unsafe_rows(), then strictify() all look at the same dT)."""
        last = self._last_eval
        if last is None or last[0] is not self.dT:
            self._last_eval = last = (self.dT, self._eval(self.all_rows))
        return last[1]

    def unsafe_rows(self):
        if self.vals.shape[1] >= self.k:   # whole rows drop no column: none can be unsafe
            return torch.zeros(0, dtype=torch.int64, device=self.dev)
        return self._eval_all()[3].nonzero()[:, 0]

    def replace_rows(self, rows, vals, cols, theta):
        """New candidates for `rows`, chosen at the current dT (theta: their bound there); the
        counts are stale until recount() (on every rank: it sums over ranks)."""
        self._last_eval = None
        self.vals[rows], self.cols[rows], self.theta[rows] = vals, cols.to(self.cols.dtype), theta
        self.natural = self.natural and self._natural(cols)
        if not bool((self.cuts[-1] == self.dT).all()):
            self.cuts = torch.cat([self.cuts, self.dT[None, :]])
        self.epoch[rows] = self.cuts.shape[0] - 1
        self.labels[rows] = self._eval(rows)[1]

    def recount(self):
        self.counts = self._count()

    # -- 0. far from balance: the published step rule, on the candidates --------------------
    def _approach(self, history, beta=1.5, patience=3, max_iter=500, top=16):
        """The published step rule (`translation_steps`), which moves every cluster at once, where
        the auction, raising over-full clusters only, is slow: far from balance.  Each step is an
        argmax over float32 copies of every row's best `top` candidates, scaled by their scores'
        range plus dT's span; it stops at std <= 1, then takes the exact labels."""
        n_total = int(self.counts.sum())
        # float32 copies of each row's best `top` candidates at a reference T `ref`, the next one
        # and theta bounding the rest, in one reused scratch block (fresh blocks cost page faults).
        # Past 1 % of rows unsure, the copies are taken again at the current T; still past 1 %, the
        # candidates are stale: stop, the caller reads the rows again.
        def make_blocks(ref):
            out, moved = [], bool(ref.any())      # at T0 (ref = 0) the scores are vals itself
            rise = self._rise(ref)                 # theta's shift at ref, per epoch
            for v, c, th, ep in zip(self.vals.split(self.chunk), self.cols.split(self.chunk),
                                    self.theta.split(self.chunk), self.epoch.split(self.chunk)):
                v = v - self._gathered(ref, c) if moved else v
                b = th - rise.index_select(0, ep)       # the dropped columns, at ref
                if v.shape[1] > top + 1:
                    tv, i = v.topk(top + 1, dim=1)
                    v, c, b = tv[:, :top], c.gather(1, i[:, :top]), torch.maximum(tv[:, top], b)
                b = b.to(torch.float32) if bool(torch.isfinite(b).any()) else None
                out.append((v.to(torch.float32), c.to(torch.int32), b))
            return out, ref

        blocks, ref = make_blocks(self.dT)
        vmax = max((float(v.amax()) for v, _, _ in blocks), default=0.0)
        vmin = min((float(torch.where(torch.isfinite(v), v, math.inf).amin()) for v, _, _ in blocks),
                   default=0.0)
        vr = self.comm.max(torch.tensor([vmax, -vmin], dtype=torch.float64))
        scratch = torch.empty(min(self.chunk, self.vals.shape[0]) * self.vals.shape[1],
                              dtype=torch.float32, device=self.dev)

        def labels_at(dT):
            """(labels, rows whose truncated candidates may miss their argmax) at dT, all ranks"""
            d32, out = (dT - ref).to(torch.float32), []
            unsure, dmin = torch.zeros((), dtype=torch.int64, device=self.dev), d32.min()
            for v, c, b in blocks:
                S = scratch[:v.numel()].view(v.shape)
                torch.index_select(d32, 0, c.view(-1), out=S.view(-1))
                torch.sub(v, S, out=S)
                if b is not None:   # a dropped candidate scores at most b - min dT
                    best, arg = S.max(1, keepdim=True)   # (one launch: not argmax, gather)
                    unsure = unsure + (best[:, 0] < b - dmin).sum()
                else:
                    arg = S.argmax(1, keepdim=True)
                out.append(c.gather(1, arg)[:, 0])
            lab = (_cat(out).long() if out
                   else torch.zeros(0, dtype=torch.int64, device=self.dev))
            return lab, int(self.comm.sum(unsure.reshape(1))[0])

        stale, near, h0 = False, False, len(history)

        def assign(dT):
            nonlocal blocks, ref, stale, near
            lab, unsure = labels_at(dT)
            if unsure > 0.01 * n_total:
                blocks, ref = make_blocks(dT)
                lab, unsure = labels_at(dT)
                stale = unsure > 0.01 * n_total
            counts = self.comm.sum(torch.bincount(lab, minlength=self.k))
            near = float((counts - self.hi).clamp(min=0).sum()) <= 0.02 * n_total
            return lab, counts

        def crawls():
            """Whether the last 8 steps bettered the best std before them by under a tenth, near the
            target or with reverse rounds on: the auction and the finish do better there."""
            own = history[h0:]
            return (near or self.reverse) and len(own) > 8 and min(own[-8:]) > 0.9 * min(own[:-8])

        vr_sum = float(vr.sum())

        def range_of(dT):   # a bound on the range of the candidates' scores at dT
            lo, hi = torch.aminmax(dT)
            return vr_sum + float(hi - lo)

        dT, _, _, _, steps, _ = translation_steps(
            assign, range_of, self.dT, self.labels, self.counts, self.target,
            _std_max(self.target, n_total, _std_host), history, beta=beta, patience=patience,
            max_iter=max_iter, stop_std=1.0, speed_up=True, stop=lambda: stale or crawls(),
            f0=self.f0, std_fn=_std_host)
        self.rounds += steps
        if dT is not self.dT:   # exact labels at the T reached
            self.dT = dT
            self.labels = self._eval(self.all_rows)[1]
            self.counts = self._count()

    # -- 1. ascending auction ----------------------------------------------------------------
    def _shed(self, margin, lab, excess, over):
        """r_j for each over-full cluster j: the midpoint of the excess_j-th and the next smallest
        margin among its members (all ranks), so that excess_j of them lie below it; just past the
        largest (by 2^-10 of it) when all must go.  One process sorts the margins (_gap_after);
        several ranks find the same gap by bisection on global counts (_bisect_gap)."""
        if not self.comm.on and margin.numel():
            a, b = _gap_after(margin, lab, excess, self.k)
        else:
            a, b = self._bisect_gap(margin, lab, excess, over)
        return _midpoints(a, b, over)

    def _bisect_gap(self, margin, lab, excess, over):
        """Per cluster, (largest margin below the cut, smallest at or above it) for the cut that
        leaves exactly excess_j members of j below, by bisection on global counts."""
        k, comm = self.k, self.comm
        mmax = torch.zeros(k, dtype=torch.float64, device=self.dev).scatter_reduce(
            0, lab, margin, "amax")
        lo = torch.zeros(k, dtype=torch.float64, device=self.dev)
        hi = comm.max(mmax) * 2 + 1e-300
        r = torch.zeros_like(lo)
        done = ~over
        base = torch.zeros(k, dtype=torch.int64, device=self.dev)
        am, al = margin, lab
        zero = torch.zeros(k, dtype=torch.int64, device=self.dev)
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
        a = comm.max(torch.full((k,), -math.inf, dtype=torch.float64, device=self.dev)
                     .scatter_reduce(0, lab[below], margin[below], "amax"))
        b = comm.min(torch.full((k,), math.inf, dtype=torch.float64, device=self.dev)
                     .scatter_reduce(0, lab[~below], margin[~below], "amin"))
        return torch.where(done, a, b), b

    def _auction(self, max_rounds, history, stall=6):
        E_hist, start = [], self.rounds     # max_rounds of its own, after the approach's steps
        while self.rounds - start < max_rounds:
            excess = (self.counts - self.hi).clamp(min=0)
            over = excess > 0
            E_hist.append(int(excess.sum()))
            if E_hist[-1] == 0:     # (excess >= 0: no cluster over)
                return
            if len(E_hist) > stall and E_hist[-1] > 0.8 * E_hist[-1 - stall]:
                return     # the tail is a slow random walk: the exact finish is faster
            self.rounds += 1
            rows = over[self.labels].nonzero()[:, 0]
            best, _, second, _ = self._eval(rows)
            # a row whose best could be beaten by a dropped column (margin < 0) cannot be shed
            # by moving T; it counts as margin 0 here and is re-read in full later
            margin = (best - second).clamp(min=0)
            lab = self.labels[rows]
            r = self._shed(margin, lab, excess, over)
            self.dT = self.dT + r
            mv = rows[margin < r[lab]]
            self.labels[mv] = self._eval(mv)[1]
            self.counts = self._count()
            history.append(self._std())
            if self.reverse:
                self._attract()
                history.append(self._std())

    def _attract(self):
        """Reverse round: every under-full cluster c pulls in its deficit d_c, T_c falling to the
        middle of the gap after the d_c-th smallest loss (best - score in c) among rows of clusters
        not under-full; done as a rise of all the others, since T only rises."""
        deficit = (self.lo - self.counts).clamp(min=0)
        total = int(deficit.sum())      # (read once: each read is a wait on a GPU)
        if total == 0:
            return
        under = deficit > 0
        rows = (~under).index_select(0, self.labels).nonzero()[:, 0]
        gl, gc, gr = [], [], []
        for s, (vr, cr, _) in zip(range(0, rows.numel(), self.chunk), self._blocks(rows)):
            S = vr - self._gathered(self.dT, cr)
            loss = S.amax(1, keepdim=True) - S       # the row's own score (its label) - S
            # (below inf is isfinite in one operation, not four; loss >= 0 or NaN)
            m = self._gathered(under, cr) & (loss < math.inf)
            i, j = m.nonzero(as_tuple=True)
            gl.append(loss[i, j])
            gc.append(cr[i, j].long())
            gr.append(rows[s:s + self.chunk].index_select(0, i))
        if not gl:          # a rank may hold no such row
            e = torch.zeros(0, dtype=torch.int64, device=self.dev)
            gl, gc, gr = [e.to(torch.float64)], [e], [e]
        loss, c, r = (_cat(x) for x in (gl, gc, gr))
        # a cluster with fewer such rows than its deficit pulls in all of them; if that is under
        # half the deficit, the candidates are stale: the forward auction and re-reads go on alone
        cnt = self.comm.sum(torch.bincount(c, minlength=self.k))
        want = torch.minimum(deficit, cnt)
        if int(want.sum()) < 0.5 * total:
            self.reverse = False
            return
        d = self._shed(loss, c, want, under & (cnt > 0))   # (k,) how far each T_c falls, >= 0
        dmax = d.max()
        if not float(dmax) > 0:      # the same on every rank: the counts are global
            return
        self.rounds += 1
        self.dT = self.dT + (dmax - d)
        # the rows that can change: those with a loss below the fall, and every row of an
        # under-full cluster (another under-full cluster may have fallen further than its own)
        mine = under.index_select(0, self.labels).nonzero()[:, 0]
        mv = torch.cat([r[loss < d.index_select(0, c)], mine]).unique()
        self.labels[mv] = self._eval(mv)[1]
        self.counts = self._count()
        if int((self.lo - self.counts).clamp(min=0).sum()) >= total:
            self.reverse = False      # it did not help: the forward auction goes on alone

    # -- 2. exact finish: shortest augmenting paths ------------------------------------------
    # Moving row i from its cluster a to b costs (V_ia - dT_a) - (V_ib - dT_b) >= 0; the edge a -> b
    # of the cluster graph is the cheapest such row.  While few moves cost at most tau, a list keeps
    # them (_pairs, _list_edges); once most do, a k x k table of each pair's cheapest base
    # V_ia - V_ib and its row, redone only for clusters that gained or lost a row.
    def _moves(self, rows):
        """Every candidate move of `rows` (local, ascending, or self.all_rows), block by block:
        (rows, candidate clusters, labels, base V_ia - V_ib, valid: another cluster, finite)."""
        for s, (vr, cr, _) in zip(range(0, rows.numel(), self.chunk), self._blocks(rows)):
            r = rows[s:s + self.chunk]
            lab = self.labels.index_select(0, r)
            if self.natural:    # (cr: one (1, k) row of column numbers, broadcast)
                cr = torch.arange(self.k, device=self.dev)[None, :]
                own = vr.gather(1, lab[:, None])
            else:
                cr = cr.long()
                own = vr.gather(1, (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            base = own - vr                                  # +inf for empty slots (vals = -inf)
            # (base is finite or +inf: below inf is isfinite in one operation)
            yield r, cr.expand_as(base), lab, base, (cr != lab[:, None]) & (base < math.inf)

    def _pairs(self, rows, tau):
        """(row, cluster b, V_ia - V_ib) of every candidate move of `rows` (local, ascending, or
        self.all_rows) that costs at most tau at the current dT."""
        out = [[], [], []]
        for r, cr, lab, base, valid in self._moves(rows):
            dTc = self.dT[None, :] if self.natural else self._gathered(self.dT, cr)
            cost = base + dTc - self.dT.index_select(0, lab)[:, None]
            i, j = ((cost <= tau) & valid).nonzero(as_tuple=True)
            out[0].append(r.index_select(0, i))
            out[1].append(cr[i, j])
            out[2].append(base[i, j])
        if not out[0]:
            z = torch.zeros(0, dtype=torch.int64, device=self.dev)
            return z, z, torch.zeros(0, dtype=torch.float64, device=self.dev)
        return tuple(torch.cat(o) for o in out)

    def _list_edges(self, pairs, W0, arg):
        """The cluster graph on the kept moves: per edge a -> b its cheapest move and, among equal
        ones, the lowest global row id (the same row in any split or chunking); _graph's five
        arrays.  W0, arg: k*k scratch arrays (inf / max), left as they were found."""
        k, BIG = self.k, torch.iinfo(torch.int64).max
        prow, pb, pbase = pairs
        key = self.labels.index_select(0, prow) * k + pb
        W0.scatter_reduce_(0, key, pbase, "amin")
        rid = self.rows_global.index_select(0, prow)
        if self.comm.on:   # ranks agree on the global cheapest move first
            w = self.comm.min(W0.clone())
            hit = pbase == w.index_select(0, key)
            arg.scatter_reduce_(0, key[hit], rid[hit], "amin")
            a = self.comm.min(arg.clone())
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
        k = self.k
        return base + self.dT.index_select(0, e % k) - self.dT.index_select(0, e // k)

    def _graph(self, e, cost, er):
        """The cluster graph for _shortest_paths from its edges a * k + b (ascending), their costs
        and rows: (e, er) where they are (to look up the few edges on the paths) and, on the CPU,
        what the search reads: b (int32), cost (float64, >= 0), csr row pointers (int32), about 12
        bytes an edge to copy from a GPU each round."""
        k = self.k
        indptr = torch.searchsorted(e // k, torch.arange(k + 1, device=e.device))
        return (e, er, (e % k).to(torch.int32).cpu(), cost.clamp(min=0).cpu(),
                indptr.to(torch.int32).cpu())

    def _edge_table(self, W, arg, clusters=None):
        """Per move a -> b among this process's rows, the cheapest base V_ia - V_ib (W, k*k, inf:
        none) and its row (arg: the lowest global row id among equal ones), for the source clusters
        in the (k,) mask `clusters` (None: all), whose entries are reset first."""
        k, BIG = self.k, torch.iinfo(torch.int64).max
        if clusters is None:
            rows = self.all_rows
            W.fill_(math.inf)
            arg.fill_(BIG)
        else:
            rows = clusters.index_select(0, self.labels).nonzero()[:, 0]
            W.view(k, k)[clusters] = math.inf
            arg.view(k, k)[clusters] = BIG
        for second in (False, True):     # the minima first, then the lowest row id at each
            for r, cr, lab, base, ok in self._moves(rows):
                # every slot scattered, invalid ones as inf / BIG (no minimum changes): cheaper than
                # picking the valid ones; whole rows in order scatter along dim 0 of the k x k view
                key = None if self.natural else lab[:, None] * k + cr
                if not second:
                    src = torch.where(ok, base, math.inf)
                else:
                    least = (W.view(k, k).index_select(0, lab) if key is None else
                             W.index_select(0, key.view(-1)).view(key.shape))
                    rid = self.rows_global.index_select(0, r)[:, None].expand_as(base)
                    src = torch.where(ok & (base == least), rid, BIG)
                dst = arg if second else W
                if key is None:
                    dst.view(k, k).scatter_reduce_(0, lab[:, None].expand_as(src), src, "amin")
                else:
                    dst.scatter_reduce_(0, key.view(-1), src.reshape(-1), "amin")

    def _table_edges(self, W, arg, tau, keys):
        """The cluster graph at the current dT on the table's moves that cost at most tau (_graph's
        five arrays), costing only the finite entries `keys` (_table_keys; one process): on a sparse
        table cheaper than _table_paths' look at every entry."""
        cost = self._at_dT(keys, W.index_select(0, keys))
        sel = (cost <= tau).nonzero()[:, 0]
        e = keys.index_select(0, sel)
        return self._graph(e, cost.index_select(0, sel), arg.index_select(0, e))

    def _table_keys(self, W, keys=None, touched=None):
        """The ascending a * k + b of W's finite entries: all (keys None), or `keys` with the rows
        in `touched` (those _edge_table changed) redone, merged without a sort."""
        k = self.k
        if keys is None:
            return (W < math.inf).nonzero()[:, 0]    # (W: finite or +inf)
        old = keys[~touched.index_select(0, keys // k)]
        rows = touched.nonzero()[:, 0]
        i, b = (W.view(k, k).index_select(0, rows) < math.inf).nonzero(as_tuple=True)
        new = rows.index_select(0, i) * k + b                # ascending, disjoint from old
        pos = torch.searchsorted(old, new) + torch.arange(new.numel(), device=new.device)
        out = torch.empty(old.numel() + new.numel(), dtype=torch.int64, device=new.device)
        rest = torch.ones(out.numel(), dtype=torch.bool, device=new.device)
        rest[pos] = False
        out[pos] = new
        out[rest] = old
        return out

    def _finish(self, history, tau0, max_phases=None):
        """Rounds of shortest paths from over- to under-full clusters, on one of two graphs: a list
        of the moves that cost at most tau while they are few (a round re-reads only the moved rows;
        a distance is trusted below tau minus how far T moved since), or, once they are over a
        quarter of all candidate moves, the k x k table (exact below tau), searched on its finite
        entries where those are few (_table_edges), else on the table itself (_table_paths).  A
        round moves rows along disjoint paths; max_phases is a guard."""
        k, dev = self.k, self.dev
        if max_phases is None:
            max_phases = self.phases + 2 * int(self.counts.sum()) + 1000
        W = torch.full((k * k,), math.inf, dtype=torch.float64, device=dev)
        arg = torch.full((k * k,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
        pairs, tau, dT_built, table, keys = None, float(tau0), None, False, None
        n_moves = int(self.comm.sum(torch.tensor([self.vals.numel()]))[0])   # candidate slots, all ranks
        # (a round's k-vectors on the host: on numpy where installed, cheaper small steps)
        lo, hi = (_host_vec(t) for t in (self.lo, self.hi))
        while self.phases < max_phases:
            counts = _host_vec(self.counts)
            if bool((counts > hi).any()):
                give, take = _pos(counts - hi), _pos(hi - counts)
            elif bool((counts < lo).any()):
                give, take = _pos(counts - lo), _pos(lo - counts)
            else:
                return True
            sources, needs = _as_torch(give > 0), _as_torch(take > 0)
            if not table and pairs is None:
                # (whole rows in one process: the table at once where tau = inf keeps every move,
                # and at k > _TABLE_AT_ONCE, where listing the moves under a growing tau costs more)
                every = (self.vals.shape[1] == k and not self.comm.on
                         and (math.isinf(tau) or k > _TABLE_AT_ONCE))
                pairs, dT_built = (None, None) if every else \
                    (self._pairs(self.all_rows, tau), self.dT.clone())
                n_pairs = n_moves if every else int(self.comm.sum(torch.tensor([pairs[0].numel()]))[0])
                if n_pairs > n_moves // 4:      # most moves kept: the table is cheaper per round
                    table, pairs = True, None
                    self._edge_table(W, arg)
                    if not self.comm.on:     # (a sparse table: its finite entries' keys)
                        keys = self._table_keys(W)
                        keys = keys if keys.numel() * _TABLE_SPARSE <= k * k else None
            # (the table holds every move: a distance up to tau is exact; the list every move
            # cheaper than tau less how far T has moved since it was built)
            trust = tau if table else tau - float((self.dT - dT_built).max())
            if table and keys is None:
                # (the search reads every entry, dearer moves too: a distance up to tau runs over
                # cheaper moves only, so only those distances are routed)
                if self.comm.on:   # ranks agree on the global cheapest move, then its lowest row id
                    Wg = self.comm.min(W.clone())
                    ag = self.comm.min(torch.where(W == Wg, arg, torch.iinfo(torch.int64).max))
                else:
                    Wg, ag = W, arg
                # (on a GPU the table comes to the host each round: 8 bytes an entry, once)
                d, pred = _table_paths(Wg.view(k, k).cpu(), self.dT.cpu(), sources, needs)
                # the row of edge pred[x] -> x: the table's own
                ph = _host_vec(pred)
                at = _as_torch(_pos(ph) * k + _arange_like(ph))
                row_of = ag.index_select(0, at.to(dev)).cpu()
            else:
                ek, er, eb, ew, indptr = (self._table_edges(W, arg, tau, keys) if table
                                          else self._list_edges(pairs, W, arg))
                d, pred = _shortest_paths(k, eb, ew, indptr, sources)    # (k,) each, on the CPU
                if ek.numel():   # the row of edge pred[x] -> x, looked up where the edges are
                    at = torch.searchsorted(ek, pred.to(dev) * k + torch.arange(k, device=dev))
                    row_of = er.index_select(0, at.clamp(max=ek.numel() - 1)).cpu()
                else:
                    row_of = torch.zeros(k, dtype=torch.int64)
            # route one row along each path, nearest needy clusters first, no row on two paths
            dl, pl, rl = d.tolist(), pred.tolist(), row_of.tolist()
            gl, tl = give.tolist(), take.tolist()
            used, moves, D = set(), [], None
            dh = _host_vec(d)
            for b in (np.argsort(dh, kind="stable") if np is not None
                      else torch.argsort(d, stable=True)).tolist():
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
            if D is None:
                needy = dh[_host_vec(needs)]
                if math.isinf(tau) or not len(needy):
                    return False     # no move reaches a cluster that needs rows
                # the needy clusters lie beyond tau: let in costlier moves and try again
                near = float(needy.min())
                grown = 2 * max(tau, near) if math.isfinite(near) else math.inf
                tau = grown if grown > tau else math.inf     # tau = 0 (exact ties, no tie-break)
                pairs = None
                continue
            self.phases += 1
            # potentials: every cluster closer than D moves up by D - d; tree edges become ties
            shift = _as_torch((np if np is not None else torch).where(dh < D, D - dh, 0.0))
            self.dT = self.dT + shift.to(dev)
            ids = torch.tensor([i for i, _, _ in moves], dtype=torch.int64, device=dev)
            to = torch.tensor([b for _, _, b in moves], dtype=torch.int64, device=dev)
            li = torch.searchsorted(self.rows_global, ids).clamp(max=max(self.rows_global.numel() - 1, 0))
            here = ((self.rows_global[li] == ids) if self.rows_global.numel()
                    else torch.zeros_like(ids, dtype=torch.bool))
            moved = li[here].unique()            # the moved rows that live here (ascending ids)
            self.labels[li[here]] = to[here]
            self.counts = self._count()
            history.append(self._std())
            if table:   # the clusters that lost or gained a row (on any rank): their table rows
                touched = torch.zeros(k, dtype=torch.bool, device=dev)
                touched[torch.tensor([a for _, a, _ in moves] + [b for _, _, b in moves], device=dev)] = True
                self._edge_table(W, arg, touched)
                if keys is not None:
                    keys = self._table_keys(W, keys, touched)
                continue
            # the moved rows' moves are relative to their new cluster: replace them, kept up to tau
            # (from now on T only rises, so a move left out costs more than trust then too)
            gone = torch.zeros(self.vals.shape[0], dtype=torch.bool, device=dev)
            gone[moved] = True
            keep = ~gone.index_select(0, pairs[0])
            new = self._pairs(moved, tau)
            pairs = tuple(torch.cat([p[keep], q]) for p, q in zip(pairs, new))
        return False

    def run(self, max_rounds, history, tau0, check_rows=False):
        """Balance: True, or False when no cheap move reaches a cluster that needs rows.
        check_rows: None before the finish when over 1 % of the rows' candidates fell short (the
        caller reads them again; the finish on them would be mostly wasted)."""
        n = float(self.counts.sum())
        E = float((self.counts - self.hi).clamp(min=0).sum())
        if E > 0.02 * n:
            self._approach(history)
        self._auction(max_rounds, history)
        if check_rows and int(self.comm.sum(torch.tensor([self.unsafe_rows().numel()]))[0]) > 0.01 * n:
            return None
        return self._finish(history, tau0)

    # -- 3. strict argmax --------------------------------------------------------------------
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
        best, arg, second, _ = self._eval_all()
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
        self.labels[tied] = self._eval(tied)[1]
        self.counts = self._count()
        if keep_balance and balanced and not _within(self.counts, self.lo, self.hi):
            # Scores closer than float64 resolves at their size: no shift orders these ties.
            # Balance comes first: the rows keep their labels, on a tie.
            self.dT = dT
            self.labels[tied] = old
            self.counts = self._count()
            self.ties_left = int(self.comm.sum(torch.tensor([tied.numel()]))[0])

    def _ties(self, margin, arg, tol):
        """strictify's look at the rows at tolerance tol: the tied pairs a * k + b (ascending, all
        ranks), the tied rows (local), the least score difference over tol to another candidate
        (rmin) and the least margin over a dropped column's bound (gap)."""
        k, dev = self.k, self.dev
        near = (margin <= tol) | (arg != self.labels)
        rmin = float(torch.where(near, math.inf, margin).amin()) if margin.numel() else math.inf
        tied = near.nonzero()[:, 0]     # the rest: every other score is more than tol below
        ta, tb, gmin = [], [], math.inf
        for s, (vr, cr, thb) in zip(range(0, tied.numel(), self.chunk), self._blocks(tied)):
            cr, lab = cr.long(), self.labels.index_select(0, tied[s:s + self.chunk])
            S = vr - self._gathered(self.dT, cr)
            own = S.gather(1, (cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            valid = (cr != lab[:, None]) & torch.isfinite(S)
            R = own - S
            tight = valid & (R <= tol)
            ta.append(lab[:, None].expand_as(R)[tight])
            tb.append(cr[tight])
            if R.numel():
                rmin = min(rmin, float(torch.where(valid & ~tight, R, math.inf).amin()))
            # dropped columns: score <= thb
            g = (own[:, 0] - thb)
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
    a, b: int64 CPU tensors; numpy arrays inside where numpy is installed."""
    if np is not None:
        a, b, pi = a.numpy(), b.numpy(), np.zeros(k)
        for _ in range(k + 1):
            new = pi.copy()
            np.maximum.at(new, b, pi[a] + 1)
            if np.array_equal(new, pi):
                return torch.from_numpy(pi), False
            pi = new
        return torch.from_numpy(pi), True
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


# -- small k, outputs held whole: a Newton start and the rows near a boundary ------------------

def _newton_block(k, device=None):
    """Rows per block of _newton_counts: about 4 MiB of float32 scores; 256 MiB on a GPU, where a
    block costs its launches whatever its rows."""
    if device is not None and _launch_bound(device):
        return max(1024, (1 << 26) // k)
    return max(1024, (1 << 20) // k)


def _launch_bound(device):
    """Whether each torch operation on `device` costs a launch (and a wait where the host reads its
    result) more than its work at the labeler's sizes: a GPU.  There passes go over all rows at
    once, not over blocks sized for a CPU's cache."""
    return torch.device(device).type != "cpu"


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


def _newton_bufs(n, k, device, scratch=None):
    """Buffers for _newton_counts: (best column, margin, best score, scratch), scratch = (a block of
    scores, its runner-up scores, a dict for the k x N copy of the outputs and the passes'
    constants), shareable.  Reused pass after pass, so that fewer fresh pages are touched."""
    e = dict(device=device)
    if scratch is None:
        block = min(n, _newton_block(k, device))
        scratch = (torch.empty(block, k, dtype=torch.float32, **e),
                   torch.empty(block, dtype=torch.float32, **e), {})
    return (torch.empty(n, dtype=torch.int64, **e), torch.empty(n, dtype=torch.float32, **e),
            torch.empty(n, dtype=torch.float32, **e), scratch)


def _newton_counts(X, T, out=None):
    """(best column, best - runner-up, counts, best score) of X - T, in float32 passes over blocks
    of rows into one scratch block (no N x k temporary); out: _newton_bufs to write into.  For
    k <= _T_K (_T_K_CPU on the host) on a k x N copy of X kept in the scratch, so that a row's max
    is a max across k contiguous vectors.  The best column is the first at the max."""
    n, k = X.shape
    a1, m, best, (V, v2, keep) = _newton_bufs(n, k, X.device) if out is None else out
    block = V.shape[0]
    T32 = T.to(torch.float32)
    if _on_numpy(X, k) and n * k * torch.get_num_threads() <= _NP_PASS:
        return _newton_counts_np(X, T32.numpy(), a1, m, best, V, v2, keep)
    # (the k x N copy: rows are its columns, reduced along dim 0)
    gpu = _launch_bound(X.device)
    kn = k <= (_T_K if gpu else _T_K_CPU)
    if kn and keep.get("of") is not X:
        keep.clear()
        keep.update(of=X, Xt=_kn_copy(X),
                    at=torch.empty(block, dtype=torch.int64, device=X.device),
                    first=(k - torch.arange(k, device=X.device)).to(torch.float32)[:, None])
    elif not kn and "first" not in keep:
        keep.update(at=torch.empty(block, dtype=torch.int64, device=X.device),
                    first=(k - torch.arange(k, device=X.device)).to(torch.float32))
    d, Tb = (0, T32[:, None]) if kn else (1, T32)
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


def _newton_counts_np(X, T32, a1, m, best, V, v2, keep):
    """_newton_counts at k <= _T_K on the host where numpy is installed: the same k x N steps on
    numpy views of the same buffers, the same values to the bit, at less cost per call."""
    n, k = X.shape
    block = V.shape[0]
    if keep.get("of") is not X:
        keep.clear()
        keep.update(of=X, Xt=_kn_copy(X).numpy(),
                    at=np.empty(block, dtype=np.int64), ar=np.arange(block, dtype=np.int64),
                    first=(k - np.arange(k, dtype=np.float32))[:, None])
    Xt, at, ar, first = keep["Xt"], keep["at"], keep["ar"], keep["first"]
    a1n, mn, bn, Vn, v2n = (t.numpy() for t in (a1, m, best, V, v2))
    Tc = T32[:, None]
    for s in range(0, n, block):
        xb = Xt[:, s:s + block]
        r = xb.shape[1]
        v, b1, bb, w = Vn.reshape(-1)[:k * r].reshape(k, r), a1n[s:s + r], bn[s:s + r], v2n[:r]
        np.subtract(xb, Tc, out=v)
        v.max(0, out=bb)
        np.equal(v, bb, out=v)          # the first column at the max: as the torch steps
        v *= first
        v.max(0, out=w)
        np.subtract(k, w, out=w)
        b1[...] = w
        np.subtract(xb, Tc, out=v)
        i = np.multiply(b1, r, out=at[:r])
        i += ar[:r]
        v.reshape(-1)[i] = -math.inf
        v.max(0, out=w)
        np.subtract(bb, w, out=mn[s:s + r])
    return a1, m, torch.from_numpy(np.bincount(a1n, minlength=k)), best


def _spare(bufs, at):
    """Of a _newton_pair (or [None, None]: fresh buffers), the one `at` does not live in."""
    return bufs[1] if bufs[0] is not None and at[0] is bufs[0][0] else bufs[0]


def _newton_pair(n, k, device):
    """Two _newton_bufs sharing one scratch block: a state and a trial (_newton_T's bufs)."""
    one = _newton_bufs(n, k, device)
    return [one, _newton_bufs(n, k, device, scratch=one[3])]


def _gap_after(margin, lab, excess, k):
    """(a, b) per cluster j with excess_j > 0: the excess_j-th smallest margin among the rows
    labelled j and the next one (b = inf where excess_j is not below its rows); the other entries
    are not for use.  On the CPU with up to 8 such clusters, each by numpy's partition or topk; else
    from the margins sorted by cluster, then by value (_by_cluster_np on the host; float32: one sort
    of int64 keys cluster << 32 | bits, as non-negative floats order as their bits)."""
    cnt = torch.bincount(lab, minlength=k)
    # (on a GPU the sort, whose launches do not grow with the clusters, and no wait to decide)
    few = None if _launch_bound(margin.device) else (excess > 0).nonzero()[:, 0]
    if few is not None and few.numel() <= 8 and bool((excess <= cnt).all()):
        if np is not None and margin.dtype in (torch.float32, torch.float64):
            return _gap_after_few_np(margin.numpy(), lab.numpy(), few.tolist(),
                                     excess.index_select(0, few).tolist(), k)
        a = torch.zeros(k, dtype=margin.dtype, device=margin.device)
        b = torch.full((k,), math.inf, dtype=margin.dtype, device=margin.device)
        for j, ej in zip(few.tolist(), excess.index_select(0, few).tolist()):
            mj = margin[lab == j]
            small = mj.topk(min(ej + 1, mj.numel()), largest=False).values    # ascending
            a[j] = small[ej - 1]
            if ej < mj.numel():
                b[j] = small[ej]
        return a, b
    if (few is not None and np is not None and margin.numel() < (1 << 31)
            and margin.dtype in (torch.float32, torch.float64)):   # (on the host: few is not None)
        ms = torch.from_numpy(_by_cluster_np(margin.numpy(), lab.numpy()))
    elif margin.dtype == torch.float32:
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


def _gap_after_few_np(margin, lab, few, excess, k):
    """_gap_after's (a, b) for a few clusters `few` (each with 1 <= excess <= its rows) on numpy
    views of the host's margins and labels: each one's margins partitioned at its excess."""
    a = np.zeros(k, dtype=margin.dtype)
    b = np.full(k, math.inf, dtype=margin.dtype)
    for j, ej in zip(few, excess):
        mj = margin[lab == j]
        if ej < mj.size:
            part = np.partition(mj, ej)     # (part[ej] the (ej + 1)-th smallest, the smaller
            a[j], b[j] = part[:ej].max(), part[ej]      # ones before it in any order)
        else:
            a[j] = mj.max()
    return torch.from_numpy(a), torch.from_numpy(b)


def _by_cluster_np(margin, lab):
    """_gap_after's margins sorted by cluster, then by value, on numpy: the same values as its torch
    sorts, by one sort of int64 keys, cluster << 32 | bits for float32, cluster << 32 | rank (from
    one argsort by value) for float64."""
    key = lab.astype(np.int64) << 32
    if margin.dtype == np.float32:
        key |= margin.view(np.int32).astype(np.int64) & 0xFFFFFFFF
        key.sort()
        return (key & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    order = np.argsort(margin)
    key = key[order]
    key |= np.arange(order.size, dtype=np.int64)
    key.sort()
    return margin[order][key & 0xFFFFFFFF]


def _midpoints(a, b, over):
    """_ExactSolver._shed's r from each cluster's gap (a, b): (a + b) / 2, or just past a (by 2^-10
    of it) where b is inf; 0 where `over` is false.  On numpy where installed: no torch launches."""
    if np is not None:
        an, bn, on = (t.cpu().numpy() for t in (a, b, over))
        with np.errstate(all="ignore"):     # (entries not over are dropped)
            rn = np.where(np.isinf(bn), an + np.abs(an) * 2.0 ** -10 + 1e-300, (an + bn) / 2)
        return torch.from_numpy(np.where(on, rn, 0.0)).to(a.device)
    r = torch.where(torch.isinf(b), a + a.abs() * 2.0 ** -10 + 1e-300, (a + b) / 2)
    return torch.where(over, r, 0.0)


def _join_costs(X, T32, lab, best, cols, scratch=None):
    """(clusters, rows) float32: what each row of X (labels `lab`, best scores `best` at T) gives up
    to join each cluster in `cols`, best - (X_j - T_j); inf on the cluster's own rows.  A numpy
    array on the host where numpy is installed, else a tensor.  scratch: the _newton_bufs scratch,
    whose k x N copy and score block serve where they fit (the result then lives in that block)."""
    n, u = X.shape[0], cols.numel()
    Xt = out = None
    if scratch is not None:
        V, _, keep = scratch
        Xt = keep.get("Xt") if keep.get("of") is X else None
        out = V.view(-1)[:u * n].view(u, n) if V.numel() >= u * n else None
    if _np_ok(X):
        cn, T, labn = cols.numpy(), T32.numpy(), lab.numpy()
        if Xt is None:
            G = X.numpy().T[cn].astype(np.float32, copy=False)     # (a copy: the gather)
        else:
            Xt = Xt if isinstance(Xt, np.ndarray) else Xt.numpy()
            G = Xt.take(cn, 0) if out is None else np.take(Xt, cn, 0, out=out.numpy(), mode="clip")
        G -= T[cn, None]
        np.subtract(best.numpy()[None, :], G, out=G)
        # (inf on the clusters' own rows through each row's label: no clusters x rows mask)
        pos = np.full(X.shape[1], -1, dtype=np.int64)
        pos[cn] = np.arange(u)
        r = pos[labn]
        own = np.flatnonzero(r >= 0)
        G[r[own], own] = np.inf
        return G
    src = X.T if Xt is None else Xt
    G = (torch.index_select(src, 0, cols) if out is None or src.dtype != torch.float32
         else torch.index_select(src, 0, cols, out=out)).to(torch.float32)
    G = torch.sub(best[None, :], G.sub_(T32.index_select(0, cols)[:, None]), out=G)
    return G.masked_fill_(lab[None, :] == cols[:, None], math.inf)


def _kth_smallest(G, kth):
    """Row i's kth[i]-th smallest value (0-based, kth[i] < G's columns) of G (_join_costs),
    as a float64 tensor on the host: numpy's partition of each row, or a topk along the rows."""
    if np is not None and isinstance(G, np.ndarray):
        return torch.tensor([float(np.partition(g, j)[j]) for g, j in zip(G, kth.tolist())],
                            dtype=torch.float64)
    top = int(kth.max()) + 1
    small = G.topk(top, dim=1, largest=False).values
    return small.gather(1, kth.to(G.device)[:, None])[:, 0].to(torch.float64).cpu()


def _smallest(G, m):
    """The columns (row indices of X) of the m[i] smallest entries of each row i of G
    (_join_costs), all in one int64 tensor on G's device (or the host for a numpy G)."""
    if np is not None and isinstance(G, np.ndarray):
        return torch.from_numpy(np.concatenate([np.argpartition(g, j - 1)[:j] if j < len(g)
                                                else np.arange(len(g))
                                                for g, j in zip(G, m.tolist())]))
    top = G.topk(min(int(m.max()), G.shape[1]), dim=1, largest=False).indices
    return top[torch.arange(top.shape[1], device=G.device)[None, :] < m.to(G.device)[:, None]]


def _np_ok(X):
    """Whether numpy can view X: on the host, numpy installed, a dtype numpy has."""
    return (np is not None and X.device.type == "cpu"
            and X.dtype in (torch.float16, torch.float32, torch.float64))


def _on_numpy(X, k):
    """Whether the small-k steps on X (n, k) run on numpy views of it: on the host, k <= _T_K
    and numpy installed (numpy has no bfloat16)."""
    return k <= _T_K and _np_ok(X)


def _rows(X, idx, host):
    """X.index_select(0, idx); by numpy's indexing where `host` (_on_numpy): the same values, and no
    torch operation that would start torch's thread pool on a first call."""
    return torch.from_numpy(X.numpy()[idx.numpy()]) if host else X.index_select(0, idx)


def _put(x, idx, v, host):
    """x[idx] = v in place; by numpy's indexing where `host` (as _rows)."""
    if host:
        x.numpy()[idx.numpy()] = v.numpy()
    else:
        x[idx] = v


def _nz(x):
    """The indices of a bool vector's true entries, on numpy's or torch's array alike (the
    steps that run on numpy views at small k on the host, torch's elsewhere)."""
    if np is not None and isinstance(x, np.ndarray):
        return np.flatnonzero(x)
    return x.nonzero()[:, 0]


def _count(x, k):
    """bincount(x, minlength=k), numpy's or torch's as x is."""
    if np is not None and isinstance(x, np.ndarray):
        return np.bincount(x, minlength=k)
    return torch.bincount(x, minlength=k)


def _f32(x):
    """x as float32, numpy's or torch's as x is."""
    if np is not None and isinstance(x, np.ndarray):
        return x.astype(np.float32)
    return x.to(torch.float32)


def _newton_step(X, T, at, e, frac, scratch=None):
    """The Newton step of _newton_T (see there) at T, whose _newton_counts are `at`; scratch:
    the _newton_bufs scratch of X's passes, for _join_costs."""
    k = X.shape[1]
    a1, m, cnt, best = at
    host = _on_numpy(X, k)      # (numpy views: the same values, cheaper per call)
    mx, ax, Xx, Tx = (t.numpy() if host else t for t in (m, a1, X, T))
    ms = mx[::max(1, len(mx) // max(_H_ROWS, 64 * k))]     # (h from strided margins)
    j = max(1, int(frac * len(ms)))
    h = max(float(np.partition(ms, j - 1)[j - 1] if host else ms.kthvalue(j).values), 1e-30)
    sel = _nz(mx < h)
    b1 = ax[sel]
    v = _f32(Xx[sel] if host else X.index_select(0, sel)) - _f32(Tx)   # (cheaper than X[sel])
    v[np.arange(len(sel)) if host else torch.arange(len(sel), device=X.device), b1] = -math.inf
    W = _count(b1 * k + v.argmax(1), k * k)     # their runner-ups
    W = W.astype(np.float64) if host else W.to(torch.float64).cpu()
    xp, ec = torch, e.cpu()
    if np is not None and k <= _NP_SOLVE_K:    # (the solve on the host in numpy, any device)
        xp, W, ec = np, np.asarray(W), ec.numpy()
    else:
        W = torch.as_tensor(W)
    W = W.reshape(k, k)
    W = (W + W.T) / (2 * h)
    deg = W.sum(1)
    L = xp.diag(deg + (1e-6 * float(deg.sum()) / k + 1e-12)) - W
    # (numpy's solve only up to _NP_SOLVE_K: cheap on so small a system, while above it numpy's BLAS
    # wakes threads that slow torch's next operations)
    d = xp.linalg.solve(L, ec).clip(-32 * h, 32 * h)
    # clusters whose boundary carries under a tenth of their imbalance (crowded outputs:
    # far from every other cluster): the shift that balances each alone (T_j up to the
    # e_j-th smallest margin of its rows; down to the |e_j|-th cheapest row to join it)
    iso = (deg * 2 * h < 0.1 * abs(ec)) & (abs(ec) >= 1)
    if xp is np:    # (k-vectors on numpy, as the solve: no torch operation met the first time)
        if iso.any():
            _isolated_np(X, T, at, d, ec, np.flatnonzero(iso), scratch)
        return torch.from_numpy(d).to(T.device)
    d = d.to(T.device)
    if bool(iso.any()):
        iso = iso.nonzero()[:, 0]
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
                d[ud.to(d.device)] = -_kth_smallest(G, want.cpu()).to(d.device)
    return d


def _isolated_np(X, T, at, d, ec, iso, scratch):
    """_newton_step's shift for its isolated clusters `iso` where its k-vectors are numpy's
    (d, ec: float64; d is written): as its torch steps, the same values."""
    a1, m, cnt, best = at
    k, n = X.shape[1], X.shape[0]
    over, under = iso[ec[iso] > 0], iso[ec[iso] < 0]
    if over.size:     # each one's (e_j + 1)-th smallest margin, where it has the rows
        want = np.zeros(k, dtype=np.int64)
        want[over] = ec[over]
        b = _gap_after(m, a1, torch.from_numpy(want).to(m.device), k)[1].cpu().numpy()
        up = over[np.isfinite(b[over])]
        d[up] = b[up]
    cn = cnt.cpu().numpy()
    step = max(1, (1 << 24) // n)
    for c in range(0, under.size, step):     # their columns read together
        ud = under[c:c + step]
        want = (-ec[ud]).astype(np.int64)
        ok = n - cn[ud] > want      # (fewer than the rows of the others, so below n)
        ud, want = ud[ok], want[ok]
        if ud.size:
            G = _join_costs(X, T.to(torch.float32), a1, best, torch.from_numpy(ud).to(X.device),
                            scratch)
            d[ud] = -_kth_smallest(G, torch.from_numpy(want)).numpy()


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


def _frac(k):
    """The Newton step's share of rows for its bandwidth h: 5 % up to k = 50, then k / 1000 up to 20
    %, as the rows near each of the ~k^2 / 2 boundaries thin out with k."""
    return min(0.2, max(0.05, k / 1000))


def _newton_T(X, T, target, max_steps, tol, frac=None, errs=None, at=None, span_max=math.inf,
              bufs=None, mode=None):
    """Steps on the counts of argmax(X - T) towards the target, of two kinds.  Newton: the count of
    cluster a changes with T_a - T_b by about the rows on the a / b boundary (those within h, the
    margin of the `frac` closest rows) per unit of margin; that graph Laplacian, solved on the CPU
    (the same T on every device), gives the step (within 32 h; a cluster far from all others takes
    the shift that balances it alone; halved up to twice while it does not help).
    Shedding (`_shed_step`): an auction round.  A Newton step that removes under 10 % of sum
    |counts - target| is followed by shedding; a step that does not help, by the other kind.
    Stops at sum |counts - target| <= tol, after max_steps, when neither helps, or (escaped) before
    a step that would move T by a span over span_max.  at: the counts at T if known; bufs: two
    _newton_bufs (state, trial); mode: a dict kept across calls.  Returns (T, counts - target,
    _newton_counts at T, passes made, escaped); errs gets the error after each step."""
    T0 = T
    frac = _frac(X.shape[1]) if frac is None else frac
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
        mode["shed"] = not shed and float(e2.abs().sum()) > _SHED_AFTER * err
        T = T + s * d
        at, e = got, e2
        errs.append(float(e.abs().sum()))
    return T, e, at, passes, False


_DENSE_SHARE, _DENSE_PER_MOVE = 0.02, 8   # _dense_translate's first rows to solve (see there)
_SHED_AFTER = 0.9    # a Newton step keeping more of sum |counts - target| is followed by shedding
_PAST_8 = 0.01       # full-row steps past 8 while sum |counts - target| > this share of N
_FEW_CHANGED = 0.01   # (see the dense path's tries)
_COLLAPSE_SAMPLE = 1.0   # sum |counts - target| over this share of N at the start: collapsed
_COLLAPSE_EVERY = 4      # collapsed outputs: the first steps on every 4th row
_DENSE_POOL = 0.5    # Newton steps go on with the rows near a boundary once at most this share
_T_K = 32     # _newton_counts on a k x N copy of the outputs up to this k (4 k bytes a row)
_T_K_CPU = 63   # and on the host up to this k, where torch's max over rows costs more
_NP_PASS = 1 << 20  # and on numpy's (one thread) up to this N x k x torch's threads
_NP_SOLVE_K = 64   # the Newton step's k x k solve in numpy up to this k
_R_ROWS = 4096   # the rows to solve: a margin R from max(1, N // 4096)-strided margins
_H_ROWS = 2048   # the Newton step's bandwidth h from max(2048, 64 k) margins, strided
_PATH_K, _PATH_WORK = 64, 2048   # the exact solve by shortest paths (_PathSolver) up to k = 64
# and (rows to move) x (k + 10) <= 2048: a path's Dijkstra in Python grows with k
_TABLE_AT_ONCE = 256     # whole rows at larger k: the finish's table at once
_TABLE_SPARSE = 6        # a table with at most k * k / 6 moves is searched on them
_HOST_SOLVE = 1 << 18   # outputs on a GPU: the exact solve on the host up to this rows x k
_F32_INF = 2.0 ** 128 - 2.0 ** 103   # float64 values from here on round to inf in float32


def _joiners(X, T, at, B, ic, target, R, scratch=None):
    """B and ic with rows added for clusters short of them: a cluster j that needs d more rows than
    B holds (target - ic) and has fewer than 2 d rows in B within R of it gets the 2 d + 8 rows
    nearest to joining it (least best - (X_j - T_j) at T).  scratch: _join_costs'."""
    k = X.shape[1]
    lab, best = at[0], at[3]
    host = _on_numpy(X, k)      # (numpy views: fewer torch operations a first call meets)
    Bx, labx, bestx, Xx, Tx, tx, icx = (t.numpy() if host else t
                                        for t in (B, lab, best, X, T, target, ic))
    labB = labx[Bx]
    d = (tx - icx) - _count(labB, k)
    J = _nz(d >= 1)
    if not len(J):
        return B, ic
    gB = bestx[Bx][:, None] - (_f32(Xx[Bx][:, J]) - _f32(Tx)[J])
    F = J[((gB <= R) & (labB[:, None] != J)).sum(0) < 2 * d[J]]
    if not len(F):
        return B, ic
    if host:
        F, d = torch.from_numpy(F), torch.from_numpy(d)
    T32 = T.to(torch.float32)
    m = (2 * d.index_select(0, F) + 8).long()
    n, extra = X.shape[0], []
    step = max(1, (1 << 24) // n)           # N x step float32 at a time
    for s in range(0, F.numel(), step):
        f = F[s:s + step]
        extra.append(_smallest(_join_costs(X, T32, lab, best, f, scratch), m[s:s + f.numel()]))
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
    more).  None when that cannot prevent it.  On numpy views on the host."""
    k = hi.numel()
    host = np is not None and lab.device.type == "cpu"
    if host:
        lab, margin, cnt_out, hi = (t.numpy() for t in (lab, margin, cnt_out, hi))
        must = None if must is None else must.numpy()
    inside = margin <= R
    if must is not None:
        inside[must] = True
    cnt = _count(lab, k)
    ic = cnt_out + cnt - _count(lab[inside], k)
    for j in _nz(ic > hi).tolist():
        rows = _nz(lab == j)
        take = min(len(rows), 2 * int(cnt_out[j] + cnt[j] - hi[j]) + 32)
        near = (np.argsort(margin[rows], kind="stable") if host
                else torch.sort(margin[rows], stable=True).indices)
        inside[rows[near[:take]]] = True
    B = _nz(inside)
    ic = cnt_out + cnt - _count(lab[B], k)
    if bool((ic > hi).any()):
        return None
    return (torch.from_numpy(B), torch.from_numpy(ic)) if host else (B, ic)


class _PathSolver:
    """The exact solve of _dense_translate for k <= _PATH_K when few rows are left to move:
    successive shortest paths on the k clusters.  vals (n, k): O - T0 of the rows near a boundary;
    target, lo, hi: the counts they aim at and may end with.  A row s of a moves to b at cost
    D_sb - dT_a + dT_b >= 0 (D_sb = V_sa - V_sb), so the cheapest move a -> b is M_ab - dT_a + dT_b,
    and M_ab changes only when a gains or loses a row.  Each step runs Dijkstra on those costs from
    the clusters that must give a row to the nearest that can take one, raises T of every settled
    cluster by how much nearer the source it is (costs stay >= 0), and moves one row along each edge
    of the path.  Arrays are numpy's: its many small operations cost less per call."""

    def __init__(self, vals, k, target, lo, hi):
        self.k, self.target = k, target.cpu()
        self.vals = vals.cpu().numpy()
        self.lo, self.hi = lo.cpu(), hi.cpu()
        n = self.vals.shape[0]
        lab = self.vals.argmax(1)
        self.D = self.vals[np.arange(n), lab][:, None] - self.vals   # leads at T0, inf at the own column
        self.D[np.arange(n), lab] = math.inf
        self._lab = lab
        self.counts = torch.bincount(self.labels, minlength=k)
        self.dT = torch.zeros(k, dtype=torch.float64)
        self.rounds, self.phases, self.ties, self.ties_left = 0, 0, 0, 0

    @property
    def labels(self):
        """The rows' labels: a torch view of the numpy array the solve moves rows in."""
        return torch.from_numpy(self._lab)

    def _cheapest(self, a):
        """(M_a, its rows): the cheapest move of cluster a's rows into each cluster, the lowest
        row number among equal ones."""
        rows = np.flatnonzero(self._lab == a)
        if rows.size == 0:
            return [math.inf] * self.k, [-1] * self.k
        Da = self.D[rows]
        i = Da.argmin(0)
        return Da[i, np.arange(self.k)].tolist(), rows[i].tolist()

    def run(self, history):
        """True when balanced; False when no cluster that must give a row reaches one that can
        take it (then the streaming path solves)."""
        k = self.k
        M, A = map(list, zip(*(self._cheapest(a) for a in range(k))))
        D, lab = self.D, self._lab
        c, lo, hi = self.counts.tolist(), self.lo.tolist(), self.hi.tolist()
        dT = [0.0] * k
        for give, take in ((hi, hi), (lo, lo)):
            while True:
                src = [j for j in range(k) if c[j] > give[j]]
                if not src or all(c[j] >= take[j] for j in range(k)):
                    break
                dist, pred, done = [math.inf] * k, [-1] * k, [False] * k
                for j in src:
                    dist[j] = 0.0
                while True:     # dense Dijkstra (k^2, stopping at the first cluster that takes)
                    u, du = -1, math.inf
                    for j in range(k):
                        if not done[j] and dist[j] < du:
                            u, du = j, dist[j]
                    if u < 0:
                        return False
                    if c[u] < take[u]:
                        break
                    done[u] = True
                    Mu, tu = M[u], du - dT[u]
                    for v in range(k):
                        if not done[v]:
                            nd = tu + Mu[v] + dT[v]
                            if nd < dist[v]:
                                dist[v], pred[v] = max(nd, du), u
                for j in range(k):
                    if done[j]:
                        dT[j] += du - dist[j]
                v, lost = u, set()
                while pred[v] >= 0:     # one row along each edge of the path, b -> v
                    b = pred[v]
                    s = A[b][v]
                    lab[s] = v
                    D[s] = self.vals[s, v] - self.vals[s]
                    D[s, v] = math.inf
                    Mv, Av = M[v], A[v]
                    for j, d in enumerate(D[s].tolist()):      # v's cheapest moves with it
                        if d < Mv[j]:
                            Mv[j], Av[j] = d, s
                    lost.add(b)
                    v = b
                c[v] -= 1
                c[u] += 1
                for b in lost:          # the clusters that lost a row: their cheapest again
                    M[b], A[b] = self._cheapest(b)
                self.rounds += 1
        self.dT = torch.tensor(dT, dtype=torch.float64)
        self.counts = torch.tensor(c, dtype=torch.int64)
        history.append(_std_host(self.counts, self.target))
        return True

    def strictify(self, keep_balance=True):
        """Moved rows tie with the cluster they left: _ExactSolver.strictify's shift, on all
        rows at once (they are few); keep_balance as there."""
        V, lab, k = self.vals, self._lab, self.k
        dT = self.dT.numpy()
        S = V - dT
        ar = np.arange(V.shape[0])
        R = S[ar, lab][:, None] - S
        R[ar, lab] = math.inf
        scale = max(float(np.abs(V).max(initial=0.0)), float(np.abs(dT).max())) or 1.0
        tol = 64 * 2.0 ** -52 * scale      # (raised as _ExactSolver.strictify raises it)
        for _ in range(64):
            tight = R <= tol
            rmin = float(np.where(tight, math.inf, R).min(initial=math.inf))
            rows, cols = tight.nonzero()
            # (bincount for distinct values: numpy's unique imports numpy.ma on first use: slow)
            key = np.bincount(lab[rows] * k + cols, minlength=k * k).nonzero()[0]
            if not key.size:
                break
            pi, cycle = _tie_order(*(torch.from_numpy(x) for x in (key // k, key % k)), k)
            if _ties_clear(pi, cycle, rmin, tol):
                break
            tol = rmin
        self.ties = key.size
        if self.ties:
            dT, c0 = self.dT, self.counts
            self.dT = self.dT + _tie_shift(pi, rmin, scale)
            tied = np.bincount(rows, minlength=V.shape[0]).nonzero()[0]
            old = lab[tied].copy()
            lab[tied] = (V[tied] - self.dT.numpy()).argmax(1)
            self.counts = torch.bincount(self.labels, minlength=k)
            lo, hi = self.lo, self.hi
            if keep_balance and _within(c0, lo, hi) and not _within(self.counts, lo, hi):
                # (no shift orders these ties: _ExactSolver.strictify keeps the labels too)
                self.dT, self.counts = dT, c0
                lab[tied] = old
                self.ties_left = tied.size


def _dense_translate(outputs, target, seed, tie_eps, start, n_init=8192):
    """translate's exact labeler for small k on outputs held whole in one process, or None when it
    cannot finish cheaply (then the streaming path runs).  Steps on the counts (`_newton_T`) bring
    them near the target in float32 passes: first on a sample of about max(8192, 64 k) rows when N
    is at least 4 times that (on every 4th row at 2 to 4 times, when over half of the rows must
    move), then on all rows (8 steps, up to 24 while sum |counts - target| is over 1 % of N), then
    on the rows near a boundary only.  The rows within a margin R of their runner-up (about 2 % of
    them, or 8 times the rows to move and k) and, for a cluster short of them, the rows nearest to
    joining it (`_joiners`) are solved exactly with the streaming path's tie-break: by `_PathSolver`
    for k <= _PATH_K with few rows to move, else by `_ExactSolver`; small solves on the host.  The
    other rows keep their column when T moves less than R, or when one pass at the new T finds none
    changed; else the next try (up to four) adds the rows that changed.
    See docs/labeler.md, 'Small k, outputs held whole: the dense path'."""
    t0 = time.perf_counter()
    n, k = outputs.shape
    dev = outputs.device
    X = outputs.detach()      # read in float32, block by block (_newton_counts)
    host = _on_numpy(X, k)    # (rows taken and put by numpy's indexing: _rows)
    start = None if start is None else _check_start(start, k)
    # one pass for the largest |O| (the float32 slack below) and for non-finite values, also
    # float64 ones beyond float32 (NaN and +-inf show in the least and largest values)
    ends = ([float(f(X.numpy())) for f in (np.min, np.max)] if _on_numpy(X, k) else
            [float(v) for s in range(0, n, 65536) for v in X[s:s + 65536].aminmax()])
    if not all(abs(v) < _F32_INF for v in ends):
        return None     # the streaming path names the bad row
    top = max(abs(v) for v in ends)
    target = _check_target(target, n, k).to(dev)
    lo, hi = _count_bounds(target)
    head = X[:max(n_init, 1)].to(torch.float32).contiguous()   # (median is wrong on expanded rows)
    eps = _tie_scale(head, tie_eps)
    T = (_median0(head).to(torch.float64) if start is None
         else start.to(device=dev, dtype=torch.float64).flatten())
    passes = 0
    m_rows = max(8192, 64 * k)
    if n >= 4 * m_rows:     # a sample first: its steps cost a fraction of a pass over all rows
        sub = X[::n // m_rows].to(torch.float32)
        T, _, _, p, _ = _newton_T(sub, T, target * (sub.shape[0] / n), 8, 0.005 * sub.shape[0],
                                  bufs=_newton_pair(*sub.shape, dev))
        passes += p

    tol, errs = max(0.002 * n, k), []
    bufs = _newton_pair(n, k, dev)    # the passes over all rows write here

    mode = {}       # which kind of step goes first, kept from call to call
    at = None
    if 2 * m_rows <= n < 4 * m_rows:
        # outputs collapsed onto few clusters (more than half of the rows to move from the
        # start): the first steps on every 4th row, as larger inputs take them on a sample
        _, _, at, p, _ = _newton_T(X, T, target, 0, tol, errs=errs, bufs=bufs)   # one pass
        passes += p
        if errs[0] > _COLLAPSE_SAMPLE * n:
            sub = X[::_COLLAPSE_EVERY].to(torch.float32)
            # (down to about the sample's own noise, ~0.8 sqrt(rows k): steps past it do not help)
            T, _, _, p, _ = _newton_T(sub, T, target * (sub.shape[0] / n), 8,
                                      max(0.005 * sub.shape[0], math.sqrt(sub.shape[0] * k)),
                                      bufs=_newton_pair(*sub.shape, dev))
            passes += p
            at, errs[:] = None, []
    T, e, at, p, _ = _newton_T(X, T, target, 2, tol, errs=errs, bufs=bufs, mode=mode, at=at)
    passes += p
    if errs[-1] > 0.9 * errs[0] and errs[-1] > 0.1 * n:
        return None     # two steps removed under a tenth of sum |counts - target| > N / 10
    zero = torch.zeros(k, dtype=torch.int64, device=dev)
    pool = None     # (rows, their labels and margins at T, counts of the rest, their least margin)
    last, full_steps = math.inf, 0
    while errs[-1] > tol and full_steps < 24 and (full_steps < 8 or errs[-1] > _PAST_8 * n):
        # (past 8 steps only while the error is over 1 % of N: the exact solve would be slow there)
        want = max(int(_DENSE_SHARE * n), int(_DENSE_PER_MOVE * (float(e.clamp(min=0).sum()) + k)))
        margin = at[1]
        if last < math.inf:
            # T moves on by about its last step (the counts' error falls by half or more a
            # step): rows leading by more than 4 x that keep their column; once they are half
            # of the rows or more, the steps go on with the others only
            R1 = max(4 * last, float(margin.kthvalue(min(n, 2 * want)).values))
            if int((margin <= R1).sum()) <= _DENSE_POOL * n:
                got = _near_rows(at[0], margin, R1, zero, hi)
                if got is not None:
                    P, c_out = got
                    XP = _rows(X, P, host).to(torch.float32)
                    TP, eP, atP, p, escaped = _newton_T(
                        XP, T, target - c_out, 12, tol, frac=min(0.5, _frac(k) * n / P.numel()),
                        span_max=R1 / 2, bufs=_newton_pair(*XP.shape, dev), mode=dict(mode))
                    passes += p
                    if not escaped:
                        moved = TP - T
                        pool = (P, atP[0], atP[1], c_out, R1 - float(moved.max() - moved.min()))
                        T, e = TP, eP
                        break
                    if TP is not T:     # T would cross rows left out: all rows from here
                        T = TP
                        at, passes = _newton_counts(X, T, out=_spare(bufs, at)), passes + 1
                        e = at[2].to(torch.float64) - target
                        errs.append(float(e.abs().sum()))
        T1, e, at, p, _ = _newton_T(X, T, target, 1, tol, at=at, errs=errs, bufs=bufs, mode=mode)
        passes += p
        full_steps += 1
        step = T1 - T
        last, T = float(step.max() - step.min()), T1
        if last == 0:
            break       # no step helped
    to_move = float(e.clamp(min=0).sum())
    if to_move > 0.05 * n:
        return None     # the Newton steps did not get near (a network collapsing onto few clusters)
    scale = float(top) + float(T.abs().max())
    slack = 2.0 ** -20 * scale + 4 * eps      # float32 margins against the float64 ones
    want = max(int(_DENSE_SHARE * n), int(_DENSE_PER_MOVE * (to_move + k)))
    cols = torch.arange(k, device=dev, dtype=torch.int16)
    history = []
    must = None     # rows a try found to matter, solved in the next ones too
    tries = 0
    while tries < 4:
        if pool is None:
            P, labP, mP, c_out, outer = None, at[0], at[1], zero, math.inf
        else:
            P, labP, mP, c_out, outer = pool
        nP = labP.numel()
        w = min(want, nP)
        st = max(1, nP // _R_ROWS)     # (the margin of about w rows, from a strided sample)
        R = min(float(mP[::st].kthvalue(-(-w // st)).values) if w < nP else math.inf, outer)
        got = _near_rows(labP, mP, R, c_out, hi, must if P is None else None)
        if got is None and pool is not None:
            pool = None     # the rows near a boundary cannot balance a cluster: all rows
            at, passes = _newton_counts(X, T, out=_spare(bufs, at)), passes + 1
            continue
        if got is None:
            return None
        Bl, ic = got
        B = Bl if P is None else _rows(P, Bl, host)
        if P is None:
            B, ic = _joiners(X, T, at, B, ic, target, R, bufs[0][3])
        if B.numel() * k * 10 > (1 << 30):
            return None     # (the streaming path keeps candidate lists where whole rows do not fit)
        # a small solve runs on the host where the outputs are on a GPU: its rounds are a few
        # kernels on small arrays each, which the GPU runs no faster and waits for the host in
        sdev = torch.device("cpu") if B.numel() * k <= _HOST_SOLVE else dev
        Bs = B.to(sdev)
        XB = _rows(X, B, host).to(sdev, torch.float64)
        cb = cols.to(sdev).expand(B.numel(), k)
        vals = XB - T.to(sdev) + eps * _tie_jitter(Bs, cb, seed)
        tB, loB, hiB = (t.to(sdev) for t in (target - ic, (lo - ic).clamp(min=0), hi - ic))
        if (np is not None and k <= _PATH_K
                and float(e.clamp(min=0).sum()) * (k + 10) <= _PATH_WORK):
            solver = _PathSolver(vals, k, tB, loB, hiB)
            ok = solver.run(history)
        else:
            solver = _ExactSolver(vals, cb.contiguous(), torch.full((B.numel(),), -math.inf,
                                  dtype=torch.float64, device=sdev), k, tB, loB, hiB,
                                  _Comm(False), 8192, Bs)
            ok = solver.run(200, history, max(R / 8, eps))
        if not ok:
            return None
        solver.strictify(keep_balance=eps > 0)
        dT, sol_labels, sol_counts = (t.to(dev) for t in (solver.dT, solver.labels, solver.counts))
        span = float(dT.max() - dT.min())
        T_before, at_before = T, (at if P is None else None)
        if P is None:
            labels = labP
        else:
            labels = at[0]
            _put(labels, P, labP, host)
        T = T + dT
        safe = span + slack < R      # no row left out leads by less than T moved
        if not safe:
            # T moved further than the margin kept: one pass at the solve's T says whether a
            # row left out changed its column or came within float32's rounding of doing so
            labels = labels.clone()
            at, passes = _newton_counts(X, T, out=_spare(bufs, at)), passes + 1
            out = torch.ones(n, dtype=torch.bool, device=dev)
            out[B] = False
            unsafe = out & ((at[0] != labels) | (at[1] <= slack))
            safe = not bool(unsafe.any())
        if safe:
            _put(labels, B, sol_labels, host)
            counts = ic + sol_counts
            tc = target.cpu()
            return ScaleResult(labels=labels, T=T, counts=counts, target=tc,
                                   iterations=passes + solver.rounds + solver.phases,
                                   std_history=history, std=_std_host(counts.cpu(), tc),
                                   std_max=_std_max(tc, n, _std_host),
                                   seconds=time.perf_counter() - t0, stop_reason="balanced",
                                   refetched=0, ties=solver.ties, ties_left=solver.ties_left,
                                   active=B.numel())
        # next try: the rows solved and the rows that changed, from the solve's T where those are
        # under 1 % of the rows solved, else from the T before it (near balance, where from the
        # solve's T the rows that changed unbalance it again)
        changed = unsafe.nonzero()[:, 0]
        must = torch.cat([B, changed])
        pool = None
        if changed.numel() > _FEW_CHANGED * B.numel():
            T = T_before
            at = (at_before if at_before is not None
                  else _newton_counts(X, T, out=_spare(bufs, at)))
            passes += int(at_before is None)
        e = at[2].to(torch.float64) - target
        want = max(want, int(_DENSE_PER_MOVE * (float(e.clamp(min=0).sum()) + k)))
        tries += 1
    return None


def _table_paths(W, dT, sources, needy):
    """Dijkstra on the finish's k x k table itself (CPU tensors): W[a, b] the cheapest base of a
    move a -> b (inf: none), costing max((W[a, b] + dT[b]) - dT[a], 0) at dT; distances from the
    nearest `sources` cluster and predecessors (-1: none), as _shortest_paths.  A cluster's row of
    costs is computed as it settles (no edge list); it stops once every `needy` cluster is settled,
    the rest left at inf.  numpy where installed, else torch."""
    k = W.shape[0]
    use_np = np is not None
    if use_np:
        Wn, dTn = W.numpy(), dT.to(torch.float64).numpy()
        d = np.full(k, np.inf)
        pred = np.full(k, -1, dtype=np.int64)
        src, left = np.flatnonzero(sources.numpy()), needy.numpy().copy()
        row, better = np.empty(k), np.empty(k, dtype=bool)
    else:
        Wn, dTn = W, dT.to(torch.float64)
        d = torch.full((k,), math.inf, dtype=torch.float64)
        pred = torch.full((k,), -1, dtype=torch.int64)
        src, left = sources.nonzero()[:, 0], needy.clone()
        row = torch.empty(k, dtype=torch.float64)
    d[src] = 0.0
    todo = d.copy() if use_np else d.clone()     # the unsettled clusters' d, inf once settled
    settled = np.zeros(k, dtype=bool) if use_np else torch.zeros(k, dtype=torch.bool)
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
        if use_np:
            np.add(Wn[u], dTn, out=row)
            row -= dTn[u]
            np.maximum(row, 0.0, out=row)
            row += du
            np.less(row, d, out=better)
            np.copyto(d, row, where=better)
            np.copyto(todo, row, where=better)
            pred[better] = u
        else:
            torch.add(Wn[u], dTn, out=row)
            row -= dTn[u]
            row.clamp_(min=0.0)
            row += du
            better = row < d
            d[better] = row[better]
            todo[better] = row[better]
            pred[better] = u
    if use_np:
        d[~settled], pred[~settled] = np.inf, -1
        return torch.from_numpy(d), torch.from_numpy(pred)
    d[~settled], pred[~settled] = math.inf, -1
    return d, pred


def _shortest_paths(k, eb, ew, indptr, sources):
    """Distances from the nearest source cluster and predecessors (-1: none) on the csr graph
    (indptr, eb, ew >= 0; CPU tensors): scipy's Dijkstra in C for k > 64 where installed, else a
    heap in Python (few edges) or a dense Dijkstra in torch; the same distances, ties between equal
    paths aside.  Up to k = 64 a process never imports scipy."""
    sp = _scipy_csgraph() if k > 64 else None
    src = sources.nonzero()[:, 0]
    if sp is not None:   # explicit zero weights stay edges in a csr matrix
        csr_matrix, dijkstra = sp
        g = csr_matrix((ew.numpy(), eb.numpy(), indptr.numpy()), shape=(k, k))
        d, pred, _ = dijkstra(g, directed=True, indices=src.numpy(), min_only=True,
                              return_predecessors=True)
        return torch.from_numpy(d), torch.from_numpy(np.where(pred < 0, -1, pred).astype(np.int64))
    if eb.numel() <= 16384:     # few edges: a heap in Python, settling equal ones lowest first
        ebl, ewl, ipl = eb.tolist(), ew.tolist(), indptr.tolist()
        dl, pl = [math.inf] * k, [-1] * k
        heap = [(0.0, s) for s in src.tolist()]
        for s in src.tolist():
            dl[s] = 0.0
        done = [False] * k
        while heap:
            du, u = heapq.heappop(heap)
            if done[u]:
                continue
            done[u] = True
            for i in range(ipl[u], ipl[u + 1]):
                v, nd = ebl[i], du + ewl[i]
                if nd < dl[v]:
                    dl[v], pl[v] = nd, u
                    heapq.heappush(heap, (nd, v))
        return torch.tensor(dl, dtype=torch.float64), torch.tensor(pl, dtype=torch.int64)
    w = torch.full((k, k), math.inf, dtype=torch.float64)
    w[torch.arange(k).repeat_interleave(indptr.diff().long()), eb.long()] = ew
    d = torch.full((k,), math.inf, dtype=torch.float64)
    d[src] = 0.0
    pred = torch.full((k,), -1, dtype=torch.int64)
    open_ = torch.ones(k, dtype=torch.bool)
    dd = d.clone()          # d of the clusters still open, inf for the settled ones
    for _ in range(k):
        u = int(torch.argmin(dd))
        if not math.isfinite(float(dd[u])):
            break
        open_[u] = False
        dd[u] = math.inf
        nd = d[u] + w[u]
        better = open_ & (nd < d)
        d[better] = nd[better]
        dd[better] = nd[better]
        pred[better] = u
    return d, pred


_SCIPY = None   # (csr_matrix, dijkstra) once looked up; False without scipy


def _scipy_csgraph():
    """scipy's csr_matrix and Dijkstra, imported on first use; None when scipy is missing."""
    global _SCIPY
    if _SCIPY is None:
        try:
            from scipy.sparse import csr_matrix
            from scipy.sparse.csgraph import dijkstra
            _SCIPY = (csr_matrix, dijkstra)
        except ImportError:
            _SCIPY = False
    return _SCIPY or None
