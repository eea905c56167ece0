"""OTL: clustering-based self-supervised representation learning through output translation.

Li, Li, Garibaldi, Qiu, "Self-supervised learning through output translation", Remote Sensing
14(14):3361, 2022.  This file is the method and stands alone (torch and torchvision only): copy it
into another project and call

    res = translate(outputs)                 # (N, k) logits -> res.labels (N,), res.T (k,)
    loss = lct_loss(logits_views, labels_views)

Contents: the output-translation labeler (`translate`), target distributions (`uneven_target`),
the Sinkhorn-Knopp baseline of SeLa (`sinkhorn_knopp`), label-consistent training (`lct_loss`),
the paper's discriminativeness measure (`n_indistinguishable`, `n_distinguishable`), the models
(`ModelConfig`, `build_model`), batched uint8 augmentation on any device (`augment`), and the small
helpers the stage scripts share (label pass, feature extraction, checkpoints).  Importing it has no
side effects.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional: the exact labeler's shortest paths in C; a numpy Dijkstra otherwise
    from scipy.sparse import csr_matrix as _csr_matrix
    from scipy.sparse.csgraph import dijkstra as _sp_dijkstra
except ImportError:
    _csr_matrix = _sp_dijkstra = None

__all__ = [
    "TranslateResult", "translate", "translate_published", "StreamingTranslator", "uneven_target", "even_target", "sinkhorn_knopp", "lct_loss",
    "n_indistinguishable", "n_distinguishable", "ModelConfig", "OTLNet", "build_model", "augment",
    "resize_batch", "label_pass", "extract_features", "batch_stats_mode", "save_checkpoint",
    "load_checkpoint", "pick_device", "load_prepared", "checkpoint_features", "git_commit",
    "write_json", "print_run_header",
]


# ----------------------------------------------------------------------------------------------
# Output translation (paper, Section 3 and Algorithm 1, as the authors' published code runs it)
# ----------------------------------------------------------------------------------------------

@dataclass
class TranslateResult:
    labels: torch.Tensor          # (N,) int64, argmax of the translated outputs
    T: torch.Tensor               # (k,) float64, the translation: labels = argmax(O - T)
    counts: torch.Tensor          # (k,) int64, final cluster sizes
    target: torch.Tensor          # (k,) float64, the sizes aimed at
    iterations: int               # translation steps tried (accepted and undone)
    std_history: list = field(default_factory=list)  # std of counts - target after each step
    std: float = 0.0              # final std of counts - target
    std_max: float = 0.0          # std when all N fall in one cluster
    seconds: float = 0.0
    stop_reason: str = ""
    refetched: int = 0            # exact method: rows re-read in full (their candidates fell short)
    ties: int = 0                 # exact method: tied moves made strict at the end
    active: int = 0               # exact method: rows solved (the others kept their best cluster)


def even_target(n: int, k: int) -> torch.Tensor:
    """The even target n_i = N / k (float: N need not be a multiple of k)."""
    return torch.full((k,), n / k, dtype=torch.float64)


def uneven_target(n: int, k: int, x: float) -> torch.Tensor:
    """Integer counts n_i proportional to i**x (i = 1..k) that sum to N (paper, appendix on
    unevenly distributed pseudo-labels; x = 0 is the even target).  Largest-remainder rounding."""
    if k < 2 or n < k:
        raise ValueError(f"uneven_target needs k >= 2 and N >= k, got N={n}, k={k}")
    w = torch.arange(1, k + 1, dtype=torch.float64) ** float(x)
    exact = w / w.sum() * n
    counts = exact.floor()
    short = int(n - counts.sum().item())
    order = torch.argsort(exact - counts, descending=True)
    counts[order[:short]] += 1
    return counts


def _check_outputs(outputs: torch.Tensor, finite: bool = True) -> None:
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        raise ValueError(f"outputs must be an (N, k) tensor, got {type(outputs).__name__} "
                         f"of shape {tuple(getattr(outputs, 'shape', ()))}")
    n, k = outputs.shape
    if k < 2:
        raise ValueError(f"need k >= 2 clusters, got k={k}")
    if n < k:
        raise ValueError(f"need at least as many outputs as clusters (N >= k), got N={n}, k={k}")
    if finite and not torch.isfinite(outputs).all():
        bad = (~torch.isfinite(outputs)).any(1).nonzero().flatten()
        raise ValueError(f"outputs contain NaN or infinite values in {bad.numel()} rows "
                         f"(first: {bad[:5].tolist()}); the network has probably diverged: "
                         "lower the learning rate or resume from an earlier checkpoint")


def _check_target(target, n: int, k: int) -> torch.Tensor:
    if target is None:
        return even_target(n, k)
    target = torch.as_tensor(target, dtype=torch.float64).flatten().cpu()
    if target.numel() != k:
        raise ValueError(f"target has {target.numel()} entries but there are k={k} clusters")
    if not torch.isfinite(target).all() or (target < 0).any():
        raise ValueError("target counts must be finite and non-negative")
    if abs(target.sum().item() - n) > 1e-6 * max(n, 1):
        raise ValueError(f"target counts sum to {target.sum().item():g}, not to N={n}; "
                         "scale them, e.g. uneven_target(N, k, x)")
    return target


def _std(counts: torch.Tensor, target: torch.Tensor) -> float:
    # population std of the deviations from the target (for an even target: the std of the counts);
    # on the CPU, wherever the two live (a k-vector: the copy is nothing next to the .item())
    return (counts.cpu().to(torch.float64) - target.cpu()).pow(2).mean().sqrt().item()


def translate(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
              patience: int = 10, max_iter: int = 10000, tie_eps=None, seed: int = 0,
              init: str = "median", method: str = "exact", candidates: int = 24,
              max_candidates: int = 48, full_rows_up_to: int = 128) -> TranslateResult:
    """Output translation: one k-vector T such that labels = argmax(O - T) spread the N rows of
    O over the k clusters as the target asks (even by default, or any counts summing to N).
    T only translates O, so every difference O[s] - O[t] (and every distance) is unchanged.

    method="exact" (default): counts end within 1 of the target (for an even target
    max - min <= 1, the most even integers allow), fast at scale and never making an N x k
    copy; see `StreamingTranslator`, which it runs on row chunks of `outputs` (same labels).
    `candidates`, `max_candidates`, `tie_eps` (default 2**-26) and `seed` are its settings.

    method="published": the authors' published algorithm (`translate_published`, the dense
    reference), which uses `beta`, `alpha0`, `patience`, `max_iter`, `tie_eps` (default 1e-6)
    and `init`.
    """
    if method == "published":
        return translate_published(outputs, target=target, beta=beta, alpha0=alpha0,
                                   patience=patience, max_iter=max_iter,
                                   tie_eps=1e-6 if tie_eps is None else tie_eps, seed=seed,
                                   init=init)
    if method != "exact":
        raise ValueError(f"method must be 'exact' or 'published', got {method!r}")
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    _check_outputs(outputs, finite=False)     # checked chunk by chunk, without an N x k copy
    n, k = outputs.shape
    st = StreamingTranslator(k, target=target, seed=seed, candidates=candidates,
                             max_candidates=max_candidates, full_rows_up_to=full_rows_up_to,
                             distributed=False,
                             tie_eps=2.0 ** -26 if tie_eps is None else tie_eps)
    for s in range(0, n, st.chunk):
        st.add(outputs[s:s + st.chunk])
    return st.result(refetch=lambda rows: outputs[rows.to(outputs.device)])


def translate_published(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
                        patience: int = 10, max_iter: int = 10000, tie_eps: float = 1e-6,
                        seed: int = 0, init: str = "median") -> TranslateResult:
    """Output translation: find one k-vector T so that argmax(O - T) spreads the N rows of O over
    the k clusters as the target asks (even by default).  Paper Algorithm 1, as the authors'
    published code runs it, which differs from the pseudo-code in three ways that make it converge:

    * the indicator C = counts - target is scaled so that its largest entry is 1;
    * the step alpha = (std / std_max) * (max - min of O - T) / f is recomputed every iteration,
      where std_max is the std when all N rows fall in one cluster and f starts at 1;
    * a step that makes the std worse is undone and f is multiplied by `beta`.

    It stops when the std is 0, alpha <= alpha0, `patience` steps in a row leave the std
    unchanged, or after `max_iter` steps.  T only ever translates O, so every difference
    O[s] - O[t] between two outputs (and every distance) is unchanged: neighbourhoods are kept.

    Two additions of ours, both for tied outputs, which a translation cannot separate (a collapsed
    network gives every image nearly the same output, so all rows move together):

    * tie-breaking: a fixed, seeded perturbation of at most `tie_eps` x (spread of O) is added to
      every output (in float64) before translating.  It decides argmax only between outputs that
      differ by less than that, i.e. (numerically) tied ones; `tie_eps=0` turns it off.
    * T starts at the column medians of O (`init="median"`; the published code starts at 0).
      Each cluster then wins about its share from the first step, and the step size, which follows
      the range of O - T, is set by the differences between rows instead of by a per-column
      offset.  Starting at 0, collapsed outputs put all N rows in one cluster, every step moves
      them all to another cluster, and the published rules stop on `patience` at std_max (measured:
      N = 21,600, k = 128, std 1902 = std_max); from the medians they reach the integer floor
      (std 0.43).  Without the perturbation, identical rows stay identical whatever T is.
      A translation by the medians is still a translation, so nothing above changes.

    `outputs` is (N, k) on any device and of any float dtype; the work is done in float64 on that
    device.  Memory: about three N x k float64 arrays.
    """
    t0 = time.perf_counter()
    _check_outputs(outputs)
    n, k = outputs.shape
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    device = outputs.device
    target = _check_target(target, n, k)
    target_d = target.to(device)
    O = outputs.detach().to(torch.float64)  # (N, k)
    spread = (O.max() - O.min()).item()
    if tie_eps > 0:
        g = torch.Generator(device="cpu").manual_seed(seed)
        jitter = torch.rand(n, k, generator=g, dtype=torch.float64).to(device)
        O = O + jitter * (tie_eps * (spread if spread > 0 else 1.0))
    col_max, col_min = O.max(0).values, O.min(0).values  # (k,) each: range of O - T without a pass
    # all N rows in the cluster with the smallest target gives the largest std
    std_max = max(_std(F.one_hot(torch.argmin(target), k).to(torch.float64) * n, target), 1e-12)

    def assign(T):
        labels = torch.argmax(O - T, dim=1)
        return labels, torch.bincount(labels, minlength=k)

    # start from the column medians: each cluster then wins about its share from the outset, and
    # the step size (which follows the range of O - T) is set by the differences between rows
    # rather than by a constant offset per column; a collapsed network's outputs become
    # jitter-sized and the steps with them.
    T = O.median(dim=0).values if init == "median" else torch.zeros(k, dtype=torch.float64, device=device)
    labels, counts = assign(T)
    std = _std(counts.cpu(), target)
    history, f, still, it, reason = [std], 1.0, 0, 0, "max_iter"
    while it < max_iter:
        if std == 0:
            reason = "balanced"
            break
        C = counts.to(torch.float64) - target_d  # > 0: the cluster wins too often
        C = C / C.max()
        alpha = (std / std_max) * ((col_max - T).max() - (col_min - T).min()).item() / f
        if alpha <= alpha0:
            reason = "alpha0"
            break
        T_new = T + alpha * C
        labels_new, counts_new = assign(T_new)
        std_new = _std(counts_new.cpu(), target)
        it += 1
        history.append(std_new)
        if std_new > std:            # worse: undo and take smaller steps
            f *= beta
            continue
        still = still + 1 if std_new == std else 0
        T, labels, counts, std = T_new, labels_new, counts_new, std_new
        if still >= patience:
            reason = "patience"
            break
    return TranslateResult(labels=labels, T=T, counts=counts, target=target, iterations=it,
                           std_history=history, std=std, std_max=std_max,
                           seconds=time.perf_counter() - t0, stop_reason=reason)


# ----------------------------------------------------------------------------------------------
# Exact, fast, streaming and distributed translation (method="exact", the default)
# ----------------------------------------------------------------------------------------------

def _tie_jitter(rows: torch.Tensor, cols: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed uniform [0, 1) number per (global row, column), from integer hashing, so that every
    way of feeding the same outputs (dense, in batches, split over ranks) perturbs them alike.
    rows: (r,) and cols: (r, m) int64 -> (r, m) float64.  In place after the first sum: on a
    big block, allocation costs more than the arithmetic."""
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
    """All-reduce over torch.distributed when it is initialised (and asked for), else nothing.
    Tensors travel on the device the backend needs (CUDA for NCCL, else the CPU) and come back
    on their own device."""

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
    """Output translation fed batch by batch: never holds the dense N x k outputs.

        st = StreamingTranslator(k)
        for batch in batches:           # (n_b, k) outputs, in row order
            st.add(batch)
        res = st.result()               # TranslateResult for all rows added (this rank's rows);
                                        # once: it consumes the stored candidates

    `translate(O)` is this class fed with O in chunks, so both give the same labels and T.

    Rows are kept whole (every column, 10 bytes each) when k <= `full_rows_up_to` (128);
    beyond that only their candidates are kept (below).  The candidate lists are what make
    N = 1.28M, k = 3000 fit in memory and fast; on outputs whose balancing translation is large
    compared with the gaps between a row's best outputs (real networks far from balance) they
    can fall short, and those rows are re-read in full (`refetch`).

    How it works.  The first `n_init` rows (buffered) fix a start T0 (their column medians), a
    window `delta` and the tie-break size.  Every row then keeps only its candidates: the columns
    whose O - T0 is within `delta` of the row's best (about `candidates` of them, at most
    `max_candidates`), plus a bound `theta` on everything it dropped.  Memory: about 10 bytes per
    candidate (1.28M rows x 48 = 0.6 GB; result() moves the rows it solves out of this store, so
    none is held twice).  The translation is solved on the candidates, and
    only on the rows that can change cluster: every row's lead at T0 (its best minus its
    runner-up) is known, and while the translation moves no T_j by more than R relative to
    another, a row that leads by more than R keeps its best cluster; so the rows leading by at
    most R are solved with the others' counts fixed, and R grows (and the solve repeats from
    where it stopped) until the translation found fits within it:

    1. an ascending auction: every over-full cluster raises its T_j to the middle of the gap
       that leaves just its excess below (far from balance, global steps of the published
       rules come first; ranks exchange only k-vectors);
    2. an exact finish: shortest augmenting paths between over- and under-full clusters (a
       Dijkstra on the k clusters over the moves that cost at most tau, edge a -> b the
       cheapest row of a to move to b), with T moved by the path lengths so every row stays at
       its argmax; several disjoint paths per round;
    3. strict argmax: moved rows sit exactly on a tie; T is nudged along the order of those ties
       by less than half of any other margin, so each row's label becomes its strict argmax.

    The counts end within 1 of the target (floor or ceil of it; for an even target, max - min
    <= 1).  A row whose best candidate could be beaten by a dropped column (theta) is re-read in
    full: `translate` does that itself; here `result(refetch=fn)` needs fn(row_indices) ->
    outputs of those rows, and raises if it is needed and missing (it is rare: raise
    `candidates` to make it rarer).

    Outputs must be finite: NaN and +-inf raise ValueError, except that with candidate lists
    (k > full_rows_up_to) a -inf after the first n_init rows is let through unchecked: it can
    never be a row's best or a candidate, so it changes nothing (the check rides on the row
    maxima, which saves a pass over the outputs).

    Ties.  Exactly equal outputs (a collapsed network) cannot be separated by any translation, so
    every output gets a fixed perturbation eps * u(row, column), u uniform in [0, 1) from a hash,
    eps = tie_eps * max|O| of the first rows (default 2**-26, below float32 resolution).  Labels
    are argmax(O + eps u - T): they equal argmax(O - T) except where two entries of a row of
    O - T are within eps of each other.

    Distributed.  With torch.distributed initialised and distributed=True, each rank adds its own
    shard (rows in rank order, rank 0 holding at least the first n_init rows, or all of them, to
    match a single process exactly; pass `row_offset`, the global number of the shard's first
    row, so that rows with more than `max_candidates` exactly tied outputs break their ties as
    in one process, and result() checks it); ranks exchange k-vectors (counts, bisection counts) in the
    auction and, in the exact finish, the k x k cheapest-move matrix per round, never outputs.
    """

    def __init__(self, k: int, target=None, seed: int = 0, candidates: int = 24,
                 max_candidates: int = 48, full_rows_up_to: int = 128, n_init: int = 8192,
                 tie_eps: float = 2.0 ** -26,
                 distributed: bool = True, chunk: int = 65536, row_offset=None):
        if k < 2:
            raise ValueError(f"need k >= 2 clusters, got k={k}")
        self.k, self.target_arg, self.seed = int(k), target, int(seed)
        self.m, self.mcap = int(candidates), int(max_candidates)
        if self.mcap < 2 or self.m < 1:
            raise ValueError("candidates must be >= 1 and max_candidates >= 2")
        self.n_init, self.tie_eps, self.chunk = int(n_init), float(tie_eps), int(chunk)
        self.comm = _Comm(distributed)
        # global number of this rank's first row (0 in one process); only exact ties among more
        # than max_candidates outputs of a row need it before result(), which checks it
        self.row_offset = int(row_offset) if row_offset is not None else 0
        self.row_offset_given = row_offset is not None or not self.comm.on
        self.all_cols = self.k <= max(2 * self.mcap, int(full_rows_up_to))
        self.width = self.k if self.all_cols else self.mcap
        self.cdtype = torch.int16 if self.k < 32768 else torch.int32
        self.buffer, self.nbuf = [], 0
        self.V, self.C, self.theta = [], [], []
        self.n, self.T0, self.device, self.t0 = 0, None, None, None
        self.kept, self.used = None, False   # local rows the store holds (None: all); result() ran
        # rows per pass (candidate extraction, the solver): on the CPU 8192, so that a pass's
        # temporaries stay in cache and are reused rather than mapped afresh; `chunk` on a GPU
        self.block, self._S, self._M = 8192, None, None

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
        params = torch.zeros(self.k + 3, dtype=torch.float64, device=self.device)
        if head.shape[0] > 0:
            _check_outputs_finite(head)
            params[:self.k] = head.median(dim=0).values.to(torch.float64)   # values of O
            params[self.k] = self.tie_eps * max(head.abs().max().item(), 1e-30)
            if not self.all_cols:   # the window: the m-th largest gap of a typical row
                S = head[:2048] - params[:self.k].to(head.dtype)
                gaps = S.amax(1, keepdim=True) - S
                params[self.k + 1] = gaps.kthvalue(min(self.m, self.k), dim=1).values.median().item()
            # the first working-set width: a fifth of the rows have a smaller lead at T0
            top2 = (head[:2048] - params[:self.k].to(head.dtype)).topk(2, dim=1).values
            params[self.k + 2] = (top2[:, 0] - top2[:, 1]).to(torch.float64).quantile(0.2).item()
        if self.comm.on:   # rank 0's first rows decide, so every rank uses the same T0 and window
            params = self.comm.broadcast(params.cpu()).to(self.device)
        if self.device.type != "cpu":   # blocks sized for a CPU cache only cost launches there
            self.block = self.chunk
        self.T0, self.eps = params[:self.k].clone(), params[self.k].item()
        self.T0f = self.T0.to(torch.float32)     # exact for float32 outputs (medians of them)
        self.T0abs = float(self.T0.abs().max())   # float64 outputs: T0f errs by 2^-24 of this
        self.delta = math.inf if self.all_cols else params[self.k + 1].item()
        self.R0 = max(params[self.k + 2].item(), self.eps)
        for p in pieces:
            for s in range(0, p.shape[0], self.chunk):
                self._extract(p[s:s + self.chunk])

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
            V = X.to(torch.float64) - self.T0       # the tie-break is added in result()
            self.n += n
            self._store(V, cols, torch.full((n,), -math.inf, dtype=torch.float64, device=self.device))
            return
        for s in range(0, X.shape[0], self.block):
            self._extract_block(X[s:s + self.block])

    def _extract_block(self, X: torch.Tensor):
        """Candidates of one block of rows in a few passes that write nothing N x k sized: S = X - T0
        into a reused buffer, its row maxima, a reused int8 mask S >= max - delta, and the
        mask read 8 columns at a time as int64 words (a row keeps ~m of k columns, so almost
        every word is 0)."""
        n, k, w, dev = X.shape[0], self.k, self.width, self.device
        kp = (k + 7) // 8 * 8
        # S = X - T0 a few rows at a time (on the CPU: small enough to stay in cache between its
        # passes), then D = S - (row max - delta) in place; the mask of all n rows is D >= 0 as
        # int8 -1 / 0, from D's sign bit: integer shifts and a narrowing copy are several times
        # faster than a comparison writing bool.  fl(S - thr) >= 0 exactly when S >= thr.
        sub = n if dev.type != "cpu" else max(1, (4 << 20) // (4 * kp))
        if self._M is None or self._M.shape[0] < n:
            self._S = torch.full((min(max(n, self.block), sub), kp), -math.inf, dtype=torch.float32,
                                 device=dev)                    # columns >= k stay -inf
            self._M = torch.empty((max(n, self.block), kp), dtype=torch.int8, device=dev)
        M, rmax = self._M[:n], torch.empty(n, dtype=torch.float32, device=dev)
        for s in range(0, n, sub):
            e = min(s + sub, n)
            D = self._S[:e - s]
            torch.sub(X[s:e], self.T0f, out=D[:, :k])
            torch.amax(D, 1, out=rmax[s:e])
            torch.sub(D, (rmax[s:e] - self.delta)[:, None], out=D)
            M[s:e].copy_(D.view(torch.int32).bitwise_right_shift_(31)).bitwise_not_()
            if kp > k:   # the shift turned the -inf padding into NaN
                D[:, k:] = -math.inf
        if not bool(torch.isfinite(rmax).all()):   # NaN and +inf show here (amax keeps NaN);
            _check_outputs_finite(X, self.n)        # -inf never makes a candidate, so it may stay
        thr = rmax - self.delta
        W = M.view(-1).view(torch.int64)
        fw = W.nonzero()[:, 0]                                  # the words with a hit, ascending
        hit = W.index_select(0, fw).view(torch.int8).nonzero()[:, 0]   # (c,) word * 8 + byte
        g = fw.index_select(0, hit >> 3).mul_(8).add_(hit & 7)  # flat positions in M, ascending
        rr = torch.div(g, kp, rounding_mode="floor")            # rows, ascending
        cc = g.sub_(rr * kp)
        cnt = torch.bincount(rr, minlength=n)
        pos = torch.arange(rr.numel(), device=dev) - (torch.cumsum(cnt, 0) - cnt).index_select(0, rr)
        self.n += n
        # fl(X - T0) errs by at most 2^-24 |S| (float64 outputs: T0f errs by 2^-24 |T0| too): a
        # per-row allowance keeps theta a true bound on every dropped column, whatever the blocks
        thr64 = thr.to(torch.float64)
        t0abs = self.T0abs if X.dtype == torch.float64 else 0.0
        theta = thr64 + 2.0 ** -22 * (thr64.abs() + t0abs) + self.eps
        theta[cnt >= k] = -math.inf                             # nothing was dropped
        many = cnt > w
        # flat (n * w) tables with one spare slot at the end for the entries not kept
        V = torch.full((n * w + 1,), -math.inf, dtype=torch.float64, device=dev)
        C = torch.zeros(n * w + 1, dtype=self.cdtype, device=dev)
        at = rr * w + pos

        def exact(r, c):   # O - T0 in float64 at rows r, columns c
            return X.reshape(-1).index_select(0, r * k + c).to(torch.float64) - self.T0.index_select(0, c)

        val = exact(rr, cc)
        if many.any():   # more than w near the top: keep the best w of them, bound the rest
            oi = many.nonzero()[:, 0]
            e = many.index_select(0, rr).nonzero()[:, 0]        # their entries
            # exact values with the tie-break, so that exactly tied outputs (a collapsed network)
            # keep different columns on different rows
            first = self.n - n + self.row_offset                # global number of row 0 here
            if e.numel() > 0.3 * oi.numel() * k:                # most of these rows: take them whole
                PC = torch.arange(k, device=dev).expand(oi.numel(), k)
                P = self._whole_rows(X.index_select(0, oi), oi + first)
            else:
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
            cols = PC.gather(1, ti[:, :w]).reshape(-1)         # (o * w,)
            om = (oi[:, None] * w + torch.arange(w, device=dev)).view(-1)
            V.index_copy_(0, om, exact(oi.repeat_interleave(w), cols))
            C.index_copy_(0, om, cols.to(self.cdtype))
            at = torch.where(many.index_select(0, rr), n * w, at)   # the rest: the spare slot
        V.index_copy_(0, at, val)                                    # exact
        C.index_copy_(0, at, cc.to(self.cdtype))
        V, C = V[:n * w].view(n, w), C[:n * w].view(n, w)
        self._store(V, C, theta)

    def _store(self, V, C, theta):
        self.V.append(V)
        self.C.append(C if C.dtype == self.cdtype else C.to(self.cdtype))
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
        lo = (target + 1e-9).floor().long().to(dev)
        hi = (target - 1e-9).ceil().long().to(dev)
        self._add_jitter(self.offset)   # now the global row numbers are known
        self._S = self._M = None        # the extraction buffers
        # Working set.  At T = T0 every row has a best column and a margin over everything else
        # (runner-up or theta).  While the translation found moves no T_j by more than R
        # relative to another (span of dT < R), rows with margin > R keep their best column, so
        # only the rows with margin <= R are solved (about half of them for gaussian outputs at
        # N = 1.28M, k = 3000); R grows until the span fits.
        lab0 = torch.empty(self.n, dtype=torch.int64, device=dev)
        margin = torch.empty(self.n, dtype=torch.float64, device=dev)
        for s, V, C, theta in self._chunks():
            best, arg, second = _top2_(V.clone())
            lab0[s:s + V.shape[0]] = C.long().gather(1, arg)[:, 0]
            margin[s:s + V.shape[0]] = best - torch.maximum(second, theta)
        R, dT, history, refetched, rounds, phases = self.R0, None, [], 0, 0, 0
        solver = None
        while True:
            act = (margin <= R).nonzero()[:, 0]
            n_act = int(comm.sum(torch.tensor([act.numel()]))[0])
            ic = comm.sum(torch.bincount(lab0[margin > R], minlength=k))   # counts of the rest
            if n_act < n_total and bool((ic > hi).any()):
                # the rest already overfill a cluster: widen first, by at least one more row
                nxt = margin[margin > R].min() if bool((margin > R).any()) else torch.tensor(math.inf)
                R = max(4 * R, float(comm.min(nxt.to(torch.float64).reshape(1).cpu())[0]))
                continue
            # the rows to solve leave the store (those of an earlier, narrower solve come from
            # its solver); at T0 (first solve) their labels are known already
            prev = None if solver is None else (solver.gid - self.offset, solver)
            solver, got = self._solve(*self._take(act, prev), act, target.to(dev) - ic,
                                      (lo - ic).clamp(min=0), hi - ic, dT, refetch, history,
                                      max_rounds, rounds, phases,
                                      labels=lab0.index_select(0, act) if dT is None else None)
            refetched += got
            dT, rounds, phases = solver.dT, solver.rounds, solver.phases
            span = float(dT.max() - dT.min())
            if n_act == n_total or span < R:
                break
            R = max(2 * R, 2 * span)
        labels = lab0
        labels[act] = solver.labels
        counts = ic + solver.counts
        std = _std(counts.cpu(), target)
        std_max = max(_std(F.one_hot(torch.argmin(target), k).to(torch.float64) * n_total, target), 1e-12)
        ok = bool(((counts >= lo) & (counts <= hi)).all())
        res = TranslateResult(labels=labels, T=self.T0 + dT, counts=counts, target=target,
                              iterations=rounds + phases, std_history=history, std=std,
                              std_max=std_max, seconds=time.perf_counter() - self.t0,
                              stop_reason="balanced" if ok else "max_iter", refetched=refetched,
                              ties=solver.ties, active=n_act)
        return res

    def _chunks(self):
        """(first row, V, C, theta) of every stored piece of at most `block` rows."""
        s = 0
        for V, C, theta in zip(self.V, self.C, self.theta):
            for t in range(0, V.shape[0], self.block):
                yield s + t, V[t:t + self.block], C[t:t + self.block], theta[t:t + self.block]
            s += V.shape[0]

    def _take(self, rows, prev=None):
        """V, C and theta of the local rows `rows` (ascending), moved out of the store: it keeps
        only the other rows, piece by piece, so the solver's copy is never held twice (at
        N = 1.28M, k = 3000 the rows solved take about 0.35 GB).  prev: (rows, solver) of an
        earlier solve on a subset of `rows`; those rows come from that solver, whose candidates
        are newer (refetched rows), cut back to the store's width if it took whole rows."""
        w, dev, n_out = self.width, self.device, rows.numel()
        out = (torch.empty(n_out, w, dtype=torch.float64, device=dev),
               torch.empty(n_out, w, dtype=self.cdtype, device=dev),
               torch.empty(n_out, dtype=torch.float64, device=dev))
        dst = None                       # where the store's rows go in `out` (None: in order)
        if prev is not None:
            prows, sv = prev
            at = torch.searchsorted(rows, prows)
            parts = (sv.V, sv.C, sv.theta)
            if sv.V.shape[1] != w:       # whole rows (the fallback): their best w at its T
                parts = self._cut(sv.V, sv.dT, sv.C, sv.theta)
            for o, p in zip(out, parts):
                o.index_copy_(0, at, p.to(o.dtype))
            new = torch.ones(n_out, dtype=torch.bool, device=dev)
            new[at] = False
            dst = new.nonzero()[:, 0]
            rows = rows.index_select(0, dst)
        pos = rows if self.kept is None else torch.searchsorted(self.kept, rows)   # in the store
        left = torch.ones(sum(v.shape[0] for v in self.V), dtype=torch.bool, device=dev)
        left[pos] = False
        self.kept = (torch.arange(left.numel(), device=dev) if self.kept is None else self.kept)[left]
        pieces, self.V, self.C, self.theta = list(zip(self.V, self.C, self.theta)), [], [], []
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
                for store, p in zip((self.V, self.C, self.theta), parts):
                    store.append(p if hi == lo else p[keep])
            start = end
        return out

    def _solve(self, V, C, theta, rows, target, lo, hi, dT, refetch, history, max_rounds,
               rounds, phases, labels=None):
        """The exact solver on the rows `rows` (local indices; V, C, theta are theirs), with
        refetching of rows whose candidates fall short.  Returns (solver, rows refetched)."""
        comm, k, dev = self.comm, self.k, self.device
        gid = rows + self.offset
        solver = _ExactSolver(V, C, theta, k, target, lo, hi, comm, self.block, gid, dT=dT,
                              rounds=rounds, phases=phases, labels=labels)
        history.append(solver._std())
        refetched, width = 0, V.shape[1]
        for attempt in range(8):
            balanced = solver.run(max_rounds, history, self.R0)
            unsafe = solver.unsafe_rows()
            n_unsafe = int(comm.sum(torch.tensor([unsafe.numel()]))[0])
            if n_unsafe and attempt < 2:
                if refetch is None:
                    raise RuntimeError(
                        f"{n_unsafe} rows' best candidate could be beaten by a column they "
                        "dropped; pass refetch=fn(rows) -> outputs of those rows, or use more "
                        "candidates")
                X = refetch(gid[unsafe].cpu()) if unsafe.numel() else torch.zeros(0, k)
                solver.replace_rows(unsafe, *self._full_rows(X.to(dev), rows[unsafe], solver.dT))
                refetched += unsafe.numel()
                continue
            if (balanced and not n_unsafe) or width >= k:
                break
            if refetch is None:
                raise RuntimeError(
                    f"the candidate lists are too short for these outputs ({n_unsafe} rows' "
                    "best candidate could be beaten by a column they dropped, or no cheap move "
                    "reaches an under-full cluster); pass refetch=fn(rows) -> outputs of those "
                    "rows, or keep whole rows (full_rows_up_to >= k)")
            # no cheap path reaches a cluster that needs rows: the candidate lists are too short
            # for these outputs; take every column of these rows (memory rows x k x 10 bytes)
            V = torch.empty(rows.numel(), k, dtype=torch.float64, device=dev)
            for s in range(0, rows.numel(), self.chunk):
                r = rows[s:s + self.chunk]
                X = refetch((r + self.offset).cpu()).to(dev)
                V[s:s + r.numel()] = self._whole_rows(X, r + self.offset)
            refetched += rows.numel()
            width = k
            C = torch.arange(k, device=dev).to(self.cdtype).expand(rows.numel(), k).contiguous()
            theta = torch.full((rows.numel(),), -math.inf, dtype=torch.float64, device=dev)
            solver = _ExactSolver(V, C, theta, k, target, lo, hi, comm, self.block, gid,
                                  dT=solver.dT, rounds=solver.rounds, phases=solver.phases)
        solver.strictify()
        return solver, refetched

    def _add_jitter(self, offset):
        # stored values are O - T0; add eps * u(global row, col), the same sum in every mode
        start, step = 0, self.block
        for V, C in zip(self.V, self.C):
            for s in range(0, V.shape[0], step):
                Vs, Cs = V[s:s + step], C[s:s + step].long()
                rows = torch.arange(start + s, start + s + Vs.shape[0], device=self.device)
                Vs.add_(_tie_jitter(rows + offset, Cs, self.seed), alpha=self.eps)   # -inf stays
            start += V.shape[0]

    def _whole_rows(self, X, grows):
        """O - T0 + eps u for every column of the rows X, whose global numbers are `grows`: the
        values the candidates hold once result() has added the tie-break."""
        cols = torch.arange(self.k, device=self.device).expand(X.shape[0], self.k)
        return X.to(torch.float64) - self.T0 + self.eps * _tie_jitter(grows, cols, self.seed)

    def _full_rows(self, X, rows, dT):
        """Candidates of `rows` (local indices) from their full outputs X, chosen against the
        current translation, so the dropped columns cannot win."""
        return self._cut(self._whole_rows(X, rows + self.offset), dT)

    def _cut(self, S, dT, C=None, theta=None):
        """(V, C, theta) of each row's best `width` entries of S at the translation dT, with a
        bound on the rest: a dropped column j has S_j - dT_j <= tv[w], so S_j <= tv[w] + max dT.
        C: the columns of S's entries (None: S holds every column); theta: an earlier bound."""
        w = self.width
        tv, ti = (S - (dT if C is None else dT.index_select(0, C.reshape(-1).long()).view(C.shape))
                  ).topk(w + 1, dim=1)
        ti = ti[:, :w]
        bound = tv[:, w] + dT.max()
        return (S.gather(1, ti), (ti if C is None else C.gather(1, ti)).to(self.cdtype),
                bound if theta is None else torch.maximum(theta, bound))


def _top2_(S):
    """(best value, its column as an (n, 1) index, runner-up) of each row of S, like topk(2)
    (a tie for the best: the first column, and the runner-up equals the best); several times
    faster than topk(2) on the CPU.  S is overwritten: its best entries become -inf."""
    arg = S.argmax(1, keepdim=True)
    best = S.gather(1, arg)[:, 0]
    second = S.scatter_(1, arg, -math.inf).amax(1) if S.shape[1] > 1 else torch.full_like(best, -math.inf)
    return best, arg, second


def _check_outputs_finite(X, row0: int = 0):
    if X.numel() == 0:
        return
    lo, hi = X.aminmax()      # one cheap pass, no N x k mask; NaN and +-inf show in these
    if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
        bad = (~torch.isfinite(X)).any(1).nonzero().flatten() + row0
        raise ValueError(f"outputs contain NaN or infinite values in {bad.numel()} rows "
                         f"(first: {bad[:5].tolist()}); the network has probably diverged: "
                         "lower the learning rate or resume from an earlier checkpoint")


class _ExactSolver:
    """The translation solved on candidate lists (see StreamingTranslator).  All float64."""

    def __init__(self, V, C, theta, k, target, lo, hi, comm, chunk, gid, dT=None, rounds=0,
                 phases=0, labels=None):
        self.V, self.C, self.theta, self.k, self.gid = V, C, theta, k, gid   # gid: global row ids
        self.target, self.lo, self.hi, self.comm, self.chunk = target, lo, hi, comm, chunk
        self.dev = V.device
        self.dT = torch.zeros(k, dtype=torch.float64, device=self.dev) if dT is None else dT
        self.rounds, self.phases, self.ties, self._last = rounds, phases, 0, None
        self.all = torch.arange(V.shape[0], device=self.dev)
        # labels: the rows' argmax at dT when the caller has it (the same _top2_ on the same values)
        self.labels = self._eval(self.all)[1] if labels is None else labels
        self.counts = self._count()

    def _count(self):
        return self.comm.sum(torch.bincount(self.labels, minlength=self.k))

    def _std(self):
        return _std(self.counts.cpu(), self.target)

    def _gathered(self, d, C):
        """d[C] for a (n, w) block of cluster numbers: index_select on int32 is several times
        faster than advanced indexing with int64."""
        return d.index_select(0, C.reshape(-1).to(torch.int32)).view(C.shape)

    def _blocks(self, rows):
        """(V, C, theta) of `rows` in pieces of at most `chunk`: slices when rows are all rows."""
        for s in range(0, rows.numel(), self.chunk):
            if rows is self.all:
                sl = slice(s, s + self.chunk)
                yield self.V[sl], self.C[sl], self.theta[sl]
            else:
                r = rows[s:s + self.chunk]
                yield self.V.index_select(0, r), self.C.index_select(0, r), self.theta.index_select(0, r)

    def _eval(self, rows):
        """best score, its column, the runner-up (or the bound on dropped columns), unsafe."""
        out = [[], [], [], []]
        tmin = self.dT.min()
        for Vr, Cr, th in self._blocks(rows):
            best, arg, second = _top2_(Vr - self._gathered(self.dT, Cr))
            thb = th - tmin
            out[0].append(best)
            out[1].append(Cr.gather(1, arg)[:, 0].long())
            out[2].append(torch.maximum(second, thb))
            out[3].append(best <= thb)
        if not out[0]:
            e = torch.zeros(0, dtype=torch.float64, device=self.dev)
            return e, torch.zeros(0, dtype=torch.int64, device=self.dev), e, e.bool()
        return tuple(torch.cat(o) for o in out)

    def unsafe_rows(self):
        ev = self._eval(self.all)
        self._last = (self.dT, ev)     # strictify() reuses it while dT and the rows stay
        return ev[3].nonzero()[:, 0]

    def replace_rows(self, rows, V, C, theta):
        self._last = None
        self.V[rows], self.C[rows], self.theta[rows] = V, C, theta
        self.labels[rows] = self._eval(rows)[1]
        self.counts = self._count()

    # -- 1. ascending auction ----------------------------------------------------------------
    def _shed(self, margin, lab, excess, over):
        """r_j for each over-full cluster j: the midpoint of the excess_j-th and the next smallest
        margin among its members (all ranks), so that exactly excess_j of them lie below it
        (fewer where those two are equal); twice the largest when all must go.  One process on
        a GPU sorts the margins; otherwise a bisection on global counts finds the gap and two
        all-reduced k-vectors its ends, the same numbers (a GPU would wait at every step)."""
        k = self.k
        if self.dev.type != "cpu" and not self.comm.on and margin.numel():
            order = torch.argsort(margin, stable=True)
            order = order.index_select(0, torch.argsort(lab.index_select(0, order), stable=True))
            ms = margin.index_select(0, order)
            cnt = torch.bincount(lab, minlength=k)
            first = torch.cumsum(cnt, 0) - cnt
            last = ms.numel() - 1
            a = ms.index_select(0, (first + excess - 1).clamp(0, last))
            nxt = ms.index_select(0, (first + excess).clamp(0, last))
            b = torch.where(excess < cnt, nxt, math.inf)
        else:
            a, b = self._bisect_gap(margin, lab, excess, over)
        r = torch.where(torch.isinf(b), 2 * a + 1e-300, (a + b) / 2)
        return torch.where(over, r, 0.0)

    def _bisect_gap(self, margin, lab, excess, over):
        """(largest margin below the cut, smallest at or above it) per cluster, where the cut
        leaves exactly excess_j members of j below it (found by bisection on global counts; for
        exactly equal margins at the cut, both ends are that value)."""
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
        E_hist = []
        while self.rounds < max_rounds:
            excess = (self.counts - self.hi).clamp(min=0)
            over = excess > 0
            E_hist.append(int(excess.sum()))
            if not bool(over.any()):
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

    # -- 2. exact finish: shortest augmenting paths ------------------------------------------
    # Moving row i from its cluster a to b costs r_ib = (V_ia - dT_a) - (V_ib - dT_b) >= 0 of
    # score; the edge a -> b of the cluster graph is the cheapest such row.  A phase needs only
    # the edges shorter than the paths it routes, so the solver keeps the moves whose cost is at
    # most tau (a short list, built in one pass), and trusts a distance found on them only below
    # tau minus how far T has moved since (a cost can fall by at most that much).
    def _pairs(self, rows, tau):
        """(row, cluster b, V_ia - V_ib) of every candidate move of `rows` (local, ascending, or
        self.all) that costs at most tau at the current dT."""
        out = [[], [], []]
        for s, (Vr, Cr, _) in zip(range(0, rows.numel(), self.chunk), self._blocks(rows)):
            r = rows[s:s + self.chunk]
            Cr, lab = Cr.long(), self.labels[r]
            own = Vr.gather(1, (Cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            base = own - Vr                                  # +inf for empty slots (V = -inf)
            cost = base + self._gathered(self.dT, Cr) - self.dT.index_select(0, lab)[:, None]
            i, j = ((cost <= tau) & (Cr != lab[:, None]) & torch.isfinite(base)).nonzero(as_tuple=True)
            out[0].append(r.index_select(0, i))
            out[1].append(Cr[i, j])
            out[2].append(base[i, j])
        if not out[0]:
            z = torch.zeros(0, dtype=torch.int64, device=self.dev)
            return z, z, torch.zeros(0, dtype=torch.float64, device=self.dev)
        return tuple(torch.cat(o) for o in out)

    def _edges(self, pairs, W0, arg):
        """The cluster graph on the kept moves: (a, b, cost at the current dT, row id) per edge
        a -> b, its cheapest move and, among equal ones, the lowest global row id (the same row on
        every rank and in every chunking).  W0 and arg are k*k scratch arrays (inf / max), left
        as they were found."""
        k, BIG = self.k, torch.iinfo(torch.int64).max
        prow, pb, pbase = pairs
        key = self.labels.index_select(0, prow) * k + pb
        W0.scatter_reduce_(0, key, pbase, "amin")
        rid = self.gid.index_select(0, prow)
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
        ea, eb = e // k, e % k
        ew = ew + self.dT.index_select(0, eb) - self.dT.index_select(0, ea)
        indptr = torch.searchsorted(ea, torch.arange(k + 1, device=ea.device))
        return (e.cpu().numpy(), eb.cpu().numpy(), ew.clamp(min=0).cpu().numpy(), er.cpu().numpy(),
                indptr.cpu().numpy())

    @staticmethod
    def _dijkstra(k, ek, eb, ew, indptr, sources):
        """Shortest distances from the nearest source, and predecessors (-1: none), on the graph
        of edges ek // k -> eb (weights ew >= 0, sorted by ek, row pointers indptr).  scipy's C
        Dijkstra when scipy is there, else a dense one in numpy (k vector steps)."""
        import numpy as np
        src = np.flatnonzero(sources)
        if _sp_dijkstra is not None:   # explicit zero weights stay edges in a csr matrix
            g = _csr_matrix((ew, eb, indptr), shape=(k, k))
            d, pred, _ = _sp_dijkstra(g, directed=True, indices=src, min_only=True,
                                      return_predecessors=True)
            return d, np.where(pred < 0, -1, pred).astype(np.int64)
        w = np.full((k, k), np.inf)
        w[ek // k, eb] = ew
        d = np.full(k, np.inf)
        d[src] = 0.0
        pred = np.full(k, -1, dtype=np.int64)
        open_ = np.ones(k, dtype=bool)
        dd = d.copy()
        for _ in range(k):
            u = int(np.argmin(dd))
            if not np.isfinite(dd[u]):
                break
            open_[u] = False
            dd[u] = np.inf
            nd = d[u] + w[u]
            better = open_ & (nd < d)
            d[better] = nd[better]
            dd[better] = nd[better]
            pred[better] = u
        return d, pred

    def _finish(self, history, tau0, max_phases=10000):
        import numpy as np
        k, dev = self.k, self.dev
        W0 = torch.full((k * k,), math.inf, dtype=torch.float64, device=dev)
        arg = torch.full((k * k,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
        pairs, tau, dT_built = None, float(tau0), None
        while self.phases < max_phases:
            counts = self.counts.cpu()
            lo, hi = self.lo.cpu(), self.hi.cpu()
            if bool((counts > hi).any()):
                give, take = (counts - hi).clamp(min=0), (hi - counts).clamp(min=0)
            elif bool((counts < lo).any()):
                give, take = (counts - lo).clamp(min=0), (lo - counts).clamp(min=0)
            else:
                return True
            give, take = give.numpy().copy(), take.numpy().copy()
            if pairs is None:
                pairs, dT_built = self._pairs(self.all, tau), self.dT.clone()
            trust = tau - float((self.dT - dT_built).max())   # every move cheaper than this is kept
            ek, eb, ew, er, indptr = self._edges(pairs, W0, arg)
            d, pred = self._dijkstra(k, ek, eb, ew, indptr, give > 0)
            at = np.searchsorted(ek, pred * k + np.arange(k)).clip(max=max(ek.size - 1, 0))
            row_of = er[at] if ek.size else np.zeros(k, dtype=np.int64)   # edge pred[x] -> x
            used, moves, D = set(), [], None
            for b in np.argsort(d, kind="stable").tolist():   # nearest needy clusters first
                if not d[b] < trust:
                    break
                if take[b] <= 0 or pred[b] < 0:
                    continue
                path, x, ok = [], b, True
                while pred[x] >= 0:
                    a = int(pred[x])
                    i = int(row_of[x])
                    if i in used:
                        ok = False
                        break
                    path.append((i, a, x))
                    x = a
                if not ok or give[x] <= 0:
                    continue
                give[x] -= 1
                take[b] -= 1
                used.update(i for i, _, _ in path)
                moves += path
                D = float(d[b])
            if D is None:
                needy = d[take > 0]
                if math.isinf(tau) or not needy.size:
                    return False     # no cheap move reaches a cluster that needs rows
                # the needy clusters lie beyond the kept moves: keep more and try again
                near = float(needy.min())
                grown = 2 * max(tau, near) if math.isfinite(near) else math.inf
                tau = grown if grown > tau else math.inf     # tau = 0 (exact ties, no tie-break)
                pairs = None
                continue
            self.phases += 1
            # potentials: every cluster closer than D moves up by D - d; tree edges become ties
            dt = torch.from_numpy(d)
            shift = torch.where(torch.isfinite(dt) & (dt < D), D - dt, torch.zeros_like(dt))
            self.dT = self.dT + shift.to(dev)
            ids = torch.tensor([i for i, _, _ in moves], dtype=torch.int64, device=dev)
            to = torch.tensor([b for _, _, b in moves], dtype=torch.int64, device=dev)
            li = torch.searchsorted(self.gid, ids).clamp(max=max(self.gid.numel() - 1, 0))
            here = (self.gid[li] == ids) if self.gid.numel() else torch.zeros_like(ids, dtype=torch.bool)
            moved = li[here].unique()            # the moved rows that live here (gid is ascending)
            self.labels[li[here]] = to[here]
            self.counts = self._count()
            history.append(self._std())
            # the moved rows' moves are relative to their new cluster: replace them, kept up to tau
            # (from now on T only rises, so a move left out costs more than trust then too)
            gone = torch.zeros(self.V.shape[0], dtype=torch.bool, device=dev)
            gone[moved] = True
            keep = ~gone.index_select(0, pairs[0])
            new = self._pairs(moved, tau)
            pairs = tuple(torch.cat([p[keep], q]) for p, q in zip(pairs, new))
        return False

    # -- 0. far from balance: the published rules, on the candidates -------------------------
    def _published(self, history, beta=1.5, patience=3, max_iter=500, top=16):
        """Global steps alpha * C (C = counts - target, scaled to max 1), alpha = (std / std_max)
        x (range of the scores) / f, undone and f *= beta when the std gets worse.  Far from
        balance (real networks' outputs) this moves every cluster at once, which the auction
        below, raising over-full clusters only, does slowly.  One change: after a step that
        removed less than 30 % of the std (ratio r = new / old), f is multiplied by 1 - r, at
        least 0.5 (a linear response would need 1 / (1 - r) times the step); the published rule
        shrinks the std by a few per cent per step.  The range of the scores is that of the
        rows' best `top` candidates: a smaller first step than with the range of all of them,
        which took 46 rounds in all instead of 36 on gaussian outputs at N = 1.28M, k = 3000.
        Only the approach: each step is an argmax on float32 copies of those candidates; the
        exact labels are taken again at the end."""
        n_total = int(self.counts.sum())
        std_max = max(_std(F.one_hot(torch.argmin(self.target), self.k).to(torch.float64)
                           * n_total, self.target), 1e-12)
        # float32 copies with int32 cluster numbers, chunk by chunk, and one reused scratch block:
        # on the CPU a fresh (chunk, w) tensor per step costs more in page faults than the work.
        # Only each row's best `top` candidates at a reference translation Tr, with the next one
        # as a bound on the rest: a step counts the rows whose best of those could lose to the
        # rest, and past 1 % of all rows (T has moved far from Tr) the candidates are chosen
        # again at the current T.
        def make_blocks(ref):
            out, moved = [], bool(ref.any())      # at T0 (ref = 0) the scores are V itself
            for v, c in zip(self.V.split(self.chunk), self.C.split(self.chunk)):
                v = v - self._gathered(ref, c) if moved else v
                b = None
                if v.shape[1] > top + 1:
                    tv, i = v.topk(top + 1, dim=1)
                    v, c, b = tv[:, :top], c.gather(1, i[:, :top]), tv[:, top].to(torch.float32)
                out.append((v.to(torch.float32), c.to(torch.int32), b))
            return out, ref

        blocks, ref = make_blocks(self.dT)
        vmax = max((float(v.amax()) for v, _, _ in blocks), default=0.0)
        vmin = min((float(torch.where(torch.isfinite(v), v, math.inf).amin()) for v, _, _ in blocks),
                   default=0.0)
        vr = self.comm.max(torch.tensor([vmax, -vmin], dtype=torch.float64))
        target = self.target.to(self.dev)
        scratch = torch.empty(min(self.chunk, self.V.shape[0]) * self.V.shape[1], dtype=torch.float32,
                              device=self.dev)

        def labels_at(dT):
            """(labels, rows whose truncated candidates may miss their argmax) at dT, all ranks"""
            d32, out = (dT - ref).to(torch.float32), []
            unsure, dmin = torch.zeros((), dtype=torch.int64, device=self.dev), d32.min()
            for v, c, b in blocks:
                S = scratch[:v.numel()].view(v.shape)
                torch.index_select(d32, 0, c.view(-1), out=S.view(-1))
                torch.sub(v, S, out=S)
                arg = S.argmax(1, keepdim=True)
                if b is not None:   # a dropped candidate scores at most b - min dT
                    unsure = unsure + (S.gather(1, arg)[:, 0] < b - dmin).sum()
                out.append(c.gather(1, arg)[:, 0])
            lab = torch.cat(out).long() if out else torch.zeros(0, dtype=torch.int64, device=self.dev)
            return lab, int(self.comm.sum(unsure.reshape(1))[0])

        dT0, std, f, still = self.dT, self._std(), 1.0, 0
        for _ in range(max_iter):
            if std <= 1.0:
                break
            C = self.counts.to(torch.float64) - target
            C = C / C.max()
            alpha = (std / std_max) * (float(vr.sum()) + float(self.dT.max() - self.dT.min())) / f
            if alpha <= 1e-15:
                break
            dT_new = self.dT + alpha * C
            lab, unsure = labels_at(dT_new)
            if unsure > 0.01 * n_total:
                blocks, ref = make_blocks(dT_new)
                lab = labels_at(dT_new)[0]
            counts = self.comm.sum(torch.bincount(lab, minlength=self.k))
            self.rounds += 1
            new = _std(counts.cpu(), self.target)
            history.append(new)
            if new > std:
                f *= beta
                continue
            still = still + 1 if new == std else 0
            if 0.7 < new / std < 1:   # a linear response would need 1 / (1 - ratio) times the step
                f *= max(1 - new / std, 0.5)
            self.dT, self.counts, std = dT_new, counts, new
            if still >= patience:
                break
        if self.dT is not dT0:   # exact labels at the T reached
            self.labels = self._eval(self.all)[1]
            self.counts = self._count()

    def run(self, max_rounds, history, tau0):
        E = float((self.counts - self.hi).clamp(min=0).sum())
        if E > 0.02 * float(self.counts.sum()):
            self._published(history)
        self._auction(max_rounds, history)
        return self._finish(history, tau0)

    # -- 3. strict argmax --------------------------------------------------------------------
    def strictify(self):
        """Moved rows sit on exact ties.  Order the clusters so that every tie a -> b (a row of a
        with equal score in b) has pi[b] > pi[a], and add eta * pi to T with eta below half of
        every other margin over (max pi + 1): ties resolve to the current labels, nothing else
        changes.  One look at every row (its best, runner-up and margin) finds the few rows
        with a tie; only those are looked at column by column, and only they can change."""
        k, dev = self.k, self.dev
        # ties are equal up to float64 rounding of the values involved
        scale = float(self.dT.abs().max())
        for v in self.V.split(self.chunk):
            scale = max(scale, float(v.amax()), -float(torch.where(torch.isfinite(v), v, 0.0).amin()))
        scale = float(self.comm.max(torch.tensor([scale], dtype=torch.float64))[0]) or 1.0
        tol = 64 * 2.0 ** -52 * scale
        last = self._last
        best, arg, second, _ = last[1] if last is not None and last[0] is self.dT else self._eval(self.all)
        margin = best - second          # over the runner-up and the dropped columns' bound
        near = (margin <= tol) | (arg != self.labels)
        rmin = float(torch.where(near, math.inf, margin).amin()) if margin.numel() else math.inf
        tied = near.nonzero()[:, 0]     # the rest: every other score is more than tol below
        ta, tb = [], []
        for s, (Vr, Cr, th) in zip(range(0, tied.numel(), self.chunk), self._blocks(tied)):
            Cr, lab = Cr.long(), self.labels.index_select(0, tied[s:s + self.chunk])
            S = Vr - self._gathered(self.dT, Cr)
            own = S.gather(1, (Cr == lab[:, None]).to(torch.uint8).argmax(1, keepdim=True))
            valid = (Cr != lab[:, None]) & torch.isfinite(S)
            R = own - S
            tight = valid & (R <= tol)
            ta.append(lab[:, None].expand_as(R)[tight])
            tb.append(Cr[tight])
            if R.numel():
                rmin = min(rmin, float(torch.where(valid & ~tight, R, math.inf).amin()))
            # dropped columns: score <= theta - min dT
            thb = th - self.dT.min()
            gap = (own[:, 0] - thb)
            gap = gap[torch.isfinite(gap)]
            if gap.numel():
                rmin = min(rmin, float(gap.min()))
        adj = torch.zeros(k, k, dtype=torch.int64)
        if ta:
            a, b = torch.cat(ta).cpu(), torch.cat(tb).cpu()
            adj.view(-1).index_put_((a * k + b,), torch.ones_like(a), accumulate=True)
        adj = self.comm.sum(adj.to(dev)).cpu() > 0
        rmin = float(self.comm.min(torch.tensor([rmin], dtype=torch.float64))[0])
        self.ties = int(adj.sum())
        if self.ties == 0:
            return
        a, b = adj.nonzero(as_tuple=True)
        pi = torch.zeros(k, dtype=torch.float64)
        for _ in range(k + 1):
            new = pi.clone().scatter_reduce(0, b, pi[a] + 1, "amax")
            if torch.equal(new, pi):
                break
            pi = new
        if not math.isfinite(rmin):
            rmin = scale * 1e-6
        eta = rmin / (2 * (float(pi.max()) + 1))
        self.dT = self.dT + eta * pi.to(dev)
        # a row outside `tied` leads by at least rmin > 2 eta max(pi): it keeps its label
        self.labels[tied] = self._eval(tied)[1]
        self.counts = self._count()


# ----------------------------------------------------------------------------------------------
# Sinkhorn-Knopp labeler of SeLa (Asano et al., ICLR 2020): the baseline the paper compares with
# ----------------------------------------------------------------------------------------------

def sinkhorn_knopp(outputs: torch.Tensor, lam: float = 25.0, tol: float = 1e-3,
                   max_iter: int = 1000):
    """SeLa's labeler: P = softmax(O)**lam, scaled alternately along rows and columns until its
    marginals are uniform (rows 1/N, columns 1/k); labels = argmax of the scaled P.  Works in the
    log domain (lam = 25 overflows float32 otherwise).  Returns (labels (N,), log_P (N, k), iters);
    tol is the largest relative error of the row marginals (the columns are exact after each
    column update)."""
    _check_outputs(outputs)
    n, k = outputs.shape
    logP = lam * F.log_softmax(outputs.detach().to(torch.float64), dim=1)  # (N, k)
    log_r = torch.full((n,), -math.log(n), dtype=torch.float64, device=outputs.device)
    log_c = torch.full((k,), -math.log(k), dtype=torch.float64, device=outputs.device)
    u = torch.zeros(n, dtype=torch.float64, device=outputs.device)
    v = torch.zeros(k, dtype=torch.float64, device=outputs.device)
    it = 0
    for it in range(1, max_iter + 1):
        u = log_r - torch.logsumexp(logP + v[None, :], dim=1)
        v = log_c - torch.logsumexp(logP + u[:, None], dim=0)
        if it % 10 == 0 or it == max_iter:
            # columns are exact after the v update; check how far rows have drifted
            row = torch.logsumexp(logP + u[:, None] + v[None, :], dim=1)
            if (row - log_r).exp().sub(1).abs().max().item() < tol:
                break
    logQ = logP + u[:, None] + v[None, :]
    return torch.argmax(logQ, dim=1), logQ, it


# ----------------------------------------------------------------------------------------------
# Label-consistent training and the discriminativeness measure
# ----------------------------------------------------------------------------------------------

def lct_loss(logits: torch.Tensor, labels: torch.Tensor, consistent: bool = True) -> torch.Tensor:
    """Label-consistent training (paper, L_LCT): the mean over every pair (a, b) of augmented
    views of CE(logits of view b, pseudo-labels of view a).  logits (V, B, k), labels (V, B).
    The mean (not the paper's sum) keeps the learning rate independent of V.
    consistent=False gives plain cross-entropy, each view with its own labels (pairs a == b)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"need logits (V, B, k) and labels (V, B), got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    V, B, k = logits.shape
    logp = F.log_softmax(logits.float(), dim=2)  # (V, B, k)
    if not consistent:
        return F.nll_loss(logp.reshape(V * B, k), labels.reshape(V * B))
    # picked[a, b, s] = log p_b(label_a(s)) for image s
    picked = torch.stack([logp.gather(2, labels[a][None, :, None].expand(V, B, 1)).squeeze(2)
                          for a in range(V)])  # (V, V, B)
    return -picked.mean()


def n_indistinguishable(counts) -> int:
    """Paper eq. (1): pairs of images that fall in the same cluster, sum_i n_i (n_i - 1) / 2."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return int(round((c * (c - 1) / 2).sum().item()))


def n_distinguishable(counts) -> int:
    """Paper eq. (2): pairs of images in different clusters, sum_{i<j} n_i n_j."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return int(round(((c.sum() ** 2 - (c ** 2).sum()) / 2).item()))


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    arch: str = "resnet18"        # resnet18 (AlexNet and ResNet-50 slot in through build_model)
    k: int = 128                  # clusters = head outputs
    small_stem: bool = False      # 3x3 stride-1 first conv and no max-pool, for images <= 64 px
    width: int = 64               # channels of the first stage (torchvision's ResNet-18: 64)
    mean: tuple = (0.5, 0.5, 0.5)  # per-channel normalisation of [0, 1] inputs, from the data
    std: tuple = (0.25, 0.25, 0.25)


class OTLNet(nn.Module):
    """A backbone that maps uint8 or [0, 1] images to pooled features, and a k-way linear head
    (logits, no softmax).  `features(x)` is what kNN and linear evaluation use."""

    def __init__(self, backbone: nn.Module, feat_dim: int, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = backbone
        self.feat_dim = feat_dim
        self.head = nn.Linear(feat_dim, cfg.k)
        self.register_buffer("mean", torch.tensor(cfg.mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(cfg.std).view(1, 3, 1, 1))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255)
        return self.backbone((x - self.mean) / self.std)  # (B, feat_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, k)


def build_model(cfg: ModelConfig) -> OTLNet:
    """The network for a ModelConfig: torchvision's ResNet-18 (optionally with a small-image stem
    and another width), its fc replaced by the k-way head."""
    import torchvision
    if cfg.arch != "resnet18":
        raise ValueError(f"unknown arch {cfg.arch!r}; available: resnet18")
    net = torchvision.models.resnet18(weights=None)
    if cfg.width != 64:
        # same block structure, every stage scaled by width / 64
        from torchvision.models.resnet import BasicBlock, ResNet

        class _Wide(ResNet):
            def __init__(self, w):
                super().__init__(BasicBlock, [2, 2, 2, 2])
                self.inplanes = w
                self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
                self.bn1 = nn.BatchNorm2d(w)
                self.layer1 = self._make_layer(BasicBlock, w, 2)
                self.layer2 = self._make_layer(BasicBlock, 2 * w, 2, stride=2)
                self.layer3 = self._make_layer(BasicBlock, 4 * w, 2, stride=2)
                self.layer4 = self._make_layer(BasicBlock, 8 * w, 2, stride=2)
        net = _Wide(cfg.width)
    if cfg.small_stem:
        net.conv1 = nn.Conv2d(3, cfg.width, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
    if cfg.width != 64 or cfg.small_stem:
        for m in net.modules():  # torchvision's initialisation for the layers replaced above
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    feat_dim = net.fc.in_features if cfg.width == 64 else 8 * cfg.width
    net.fc = nn.Identity()
    return OTLNet(net, feat_dim, cfg)


# ----------------------------------------------------------------------------------------------
# Batched augmentation of uint8 images on any device (one affine warp + colour ops per batch)
# ----------------------------------------------------------------------------------------------

def resize_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float [0, 1] (B, 3, size, size), antialiased: the test-time transform."""
    x = x.float().div_(255) if x.dtype == torch.uint8 else x
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(0, 1)


def _blend(a, b, w):  # w: (B,) factor, 1 keeps a
    return (b + (a - b) * w.view(-1, 1, 1, 1)).clamp_(0, 1)


def augment(x: torch.Tensor, size: int, strong: bool = False, scale=(0.25, 1.0),
            cutout: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random views of a uint8 batch (B, 3, H, W), all on x's device: float [0, 1] (B, 3, size, size).

    simple: random resized crop (area `scale`, aspect 3/4..4/3), random flips and 90-degree
    rotations (overhead images have no up), mild colour jitter.
    strong: simple plus two RandAugment-style ops per image at random magnitude (rotate, shear,
    translate, brightness, contrast, saturation, sharpness, posterize, solarize, autocontrast,
    equalise-like histogram stretch) and Cutout with one hole of side `cutout` pixels of the
    output (16 in the paper; 0 for none)."""
    B, dev = x.shape[0], x.device
    g = generator

    def U(lo, hi, *shape):
        return torch.rand(*(shape or (B,)), device=dev, generator=g) * (hi - lo) + lo

    xf = x.float().div_(255) if x.dtype == torch.uint8 else x.float()
    # --- geometry: crop, flip, rot90 and (strong) rotate/shear/translate as one affine warp
    area = U(*scale)
    logr = U(math.log(3 / 4), math.log(4 / 3))
    ar = logr.exp()
    sw = (area * ar).sqrt().clamp(max=1.0)
    sh = (area / ar).sqrt().clamp(max=1.0)
    cx = (U(-1, 1) * (1 - sw))
    cy = (U(-1, 1) * (1 - sh))
    theta = torch.zeros(B, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 1, 1] = sw, sh
    theta[:, 0, 2], theta[:, 1, 2] = cx, cy
    rot = torch.randint(0, 4, (B,), device=dev, generator=g)
    ang = rot.float() * (math.pi / 2)
    flip = torch.where(torch.rand(B, device=dev, generator=g) < 0.5, -1.0, 1.0)
    shear = torch.zeros(B, device=dev)
    if strong:
        ang = ang + U(-30, 30) * (math.pi / 180) * (torch.rand(B, device=dev, generator=g) < 0.3)
        shear = U(-0.3, 0.3) * (torch.rand(B, device=dev, generator=g) < 0.3)
    c, s = ang.cos(), ang.sin()
    R = torch.zeros(B, 2, 2, device=dev)
    R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1] = c * flip, -s + shear, s * flip, c
    theta = torch.cat([theta[:, :, :2] @ R, theta[:, :, 2:]], dim=2)
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)
    if x.shape[-1] > 2 * size:  # downscale first so bilinear sampling does not alias
        xf = F.interpolate(xf, scale_factor=size / x.shape[-1] * 2, mode="bilinear",
                           antialias=True, align_corners=False)
    out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    # --- colour
    out = _blend(out, out.mean((1, 2, 3), keepdim=True).expand_as(out), U(0.7, 1.3))   # contrast
    out = (out * U(0.7, 1.3).view(-1, 1, 1, 1)).clamp_(0, 1)                          # brightness
    gray = (out * torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)).sum(1, True)
    out = _blend(out, gray.expand_as(out), U(0.6, 1.4))                               # saturation
    if strong:
        out = _rand_ops(out, U, g)
    if strong and cutout > 0:
        side = cutout
        cy_ = torch.randint(0, size, (B, 1, 1), device=dev, generator=g)
        cx_ = torch.randint(0, size, (B, 1, 1), device=dev, generator=g)
        ar_ = torch.arange(size, device=dev)
        hole = ((ar_.view(1, -1, 1) - cy_).abs() < side / 2) & ((ar_.view(1, 1, -1) - cx_).abs() < side / 2)
        out = out.masked_fill(hole[:, None], 0.5)
    return out


def _rand_ops(x, U, g, n_ops: int = 2):
    """Two random photometric ops per image (the geometric ones are folded into the warp)."""
    B, dev = x.shape[0], x.device
    for _ in range(n_ops):
        op = torch.randint(0, 6, (B,), device=dev, generator=g)
        m = U(0, 1)
        y = x.clone()
        sel = op == 0                                   # sharpness / blur
        if sel.any():
            blur = F.avg_pool2d(F.pad(x[sel], (1, 1, 1, 1), mode="replicate"), 3, 1)
            y[sel] = _blend(x[sel], blur, 1 + (m[sel] * 2 - 1) * 0.9)
        sel = op == 1                                   # posterize to 4..8 bits
        if sel.any():
            levels = (2 ** (4 + (m[sel] * 4).floor())).view(-1, 1, 1, 1)
            y[sel] = (x[sel] * (levels - 1)).round() / (levels - 1)
        sel = op == 2                                   # solarize above a threshold
        if sel.any():
            th = (1 - 0.5 * m[sel]).view(-1, 1, 1, 1)
            y[sel] = torch.where(x[sel] >= th, 1 - x[sel], x[sel])
        sel = op == 3                                   # autocontrast per channel
        if sel.any():
            lo = x[sel].amin((2, 3), keepdim=True)
            hi = x[sel].amax((2, 3), keepdim=True)
            y[sel] = ((x[sel] - lo) / (hi - lo).clamp(min=1e-3)).clamp(0, 1)
        sel = op == 4                                   # equalise-like: stretch the 2-98 % range
        if sel.any():
            flat = x[sel].flatten(2)
            q = torch.quantile(flat, torch.tensor([0.02, 0.98], device=dev), dim=2)  # (2, b, 3)
            lo, hi = q[0][..., None, None], q[1][..., None, None]
            y[sel] = ((x[sel] - lo) / (hi - lo).clamp(min=1e-3)).clamp(0, 1)
        # op 5: identity
        x = y
    return x


# ----------------------------------------------------------------------------------------------
# Passes over a data set held as one uint8 tensor
# ----------------------------------------------------------------------------------------------

@contextmanager
def batch_stats_mode(model: nn.Module):
    """BatchNorm normalises with each batch's own statistics (train mode) but leaves the running
    statistics untouched: the label pass must not move them.  Everything else in eval mode."""
    was_training = model.training
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.track_running_stats for m in bns]
    model.eval()
    for m in bns:
        m.train()
        m.track_running_stats = False  # train mode without running-stat updates
    try:
        yield model
    finally:
        for m, t in zip(bns, saved):
            m.track_running_stats = t
        model.train(was_training)


def _batches(n: int, batch_size: int, desc: str, progress: bool):
    idx = range(0, n, batch_size)
    if progress:
        from tqdm import tqdm
        idx = tqdm(idx, desc=desc, unit="batch", leave=False, dynamic_ncols=True)
    return idx


@torch.no_grad()
def label_pass(model: OTLNet, images: torch.Tensor, size: int, batch_size: int = 256,
               device="cpu", bn: str = "batch", views: int = 1, strong: bool = False,
               cutout: int = 16, generator=None, progress: bool = True,
               head: bool = True) -> torch.Tensor:
    """The network's outputs for every image: (views, N, k) float32 on `device` (head=False: the
    backbone's features, (views, N, feat_dim), e.g. to try several heads).  views = 1 uses
    the test-time transform; views > 1 uses random (simple or strong) augmentations.  bn="batch"
    normalises with batch statistics without touching running statistics (see batch_stats_mode);
    bn="eval" uses the running statistics.  Batches are shuffled so batch statistics do not depend
    on the order of the data set."""
    n = images.shape[0]
    perm = torch.randperm(n, generator=generator)
    out = torch.empty(views, n, model.cfg.k if head else model.feat_dim, device=device)
    fwd = model if head else model.features
    ctx = batch_stats_mode(model) if bn == "batch" else _eval_mode(model)
    with ctx:
        for s in _batches(n, batch_size, "label pass", progress):
            idx = perm[s:s + batch_size]
            x = images[idx].to(device, non_blocking=True)
            for v in range(views):
                xv = resize_batch(x, size) if views == 1 else augment(x, size, strong, cutout=cutout)
                with _autocast(device):
                    out[v, idx.to(device)] = fwd(xv).float()
    return out


@contextmanager
def _eval_mode(model):
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def _autocast(device):
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def extract_features(model: OTLNet, images: torch.Tensor, size: int, batch_size: int = 256,
                     device="cpu", progress: bool = True) -> torch.Tensor:
    """Frozen backbone features of every image with the test-time transform and the model in eval
    mode: (N, feat_dim) float32 on the CPU."""
    feats = []
    with _eval_mode(model):
        for s in _batches(images.shape[0], batch_size, "features", progress):
            x = resize_batch(images[s:s + batch_size].to(device, non_blocking=True), size)
            with _autocast(device):
                feats.append(model.features(x).float().cpu())
    return torch.cat(feats)


# ----------------------------------------------------------------------------------------------
# Checkpoints and devices
# ----------------------------------------------------------------------------------------------

def save_checkpoint(state: dict, path: str) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, device="cpu"):
    """(model, checkpoint dict): the model rebuilt from the ModelConfig saved in the checkpoint."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one with train_otl.py (its run "
                                "folder's checkpoint0000.pth is the untrained network, the baseline)")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model = build_model(ModelConfig(**ckpt["model_cfg"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device), ckpt


def git_commit() -> str:
    """The commit of the code being run ("<sha>", "<sha>+dirty" with uncommitted changes to
    tracked files, or "unknown" outside a repository or before the first commit)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    return sha + ("+dirty" if dirty else "")


def print_run_header(args) -> None:
    """The commit and the sorted arguments, so a log says what made it."""
    print(f"git commit: {git_commit()}")
    print("\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())), flush=True)


def write_json(obj: dict, path: str) -> None:
    """Write atomically: a crash mid-write never leaves a half-written results file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def model_cfg_dict(cfg: ModelConfig) -> dict:
    return asdict(cfg)


def pick_device(name: str = "auto") -> torch.device:
    """'auto' takes CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name} asked for, but CUDA is not available; use --device cpu")
    return dev


# ----------------------------------------------------------------------------------------------
# Prepared data sets (written by prepare_data.py) and cached features (read by eval_*.py)
# ----------------------------------------------------------------------------------------------
# A prepared data set is a folder holding
#   cache.pt       {"images": uint8 (N, 3, H, W), "labels": int64 (N,), "classes": [str],
#                   "files": [str] (path of each image inside its source)}
#   split.json     {"seed": int, "test_frac": float, "train": [int], "test": [int]}
#   manifest.json  source, its sha256, image size, per-class counts, split sizes, skipped files

def load_prepared(data_dir: str) -> dict:
    """The prepared data set in `data_dir`: images, labels, classes, train and test indices."""
    import json
    cache, split = os.path.join(data_dir, "cache.pt"), os.path.join(data_dir, "split.json")
    for p in (cache, split):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} is missing: run prepare_data.py --out {data_dir} first")
    d = torch.load(cache, map_location="cpu", weights_only=False)
    with open(split) as fh:
        sp = json.load(fh)
    d["train_idx"] = torch.tensor(sp["train"], dtype=torch.long)
    d["test_idx"] = torch.tensor(sp["test"], dtype=torch.long)
    d["split_seed"] = sp.get("seed")
    return d


def checkpoint_features(ckpt_path: str, data_dir: str | None = None, device="cpu",
                        batch_size: int = 256, progress: bool = True) -> dict:
    """Frozen features of the train and test split for a checkpoint, extracted once and cached
    beside it as features_<checkpoint name>.pt (reused while the checkpoint and data are
    unchanged).  Returns {"train": (Ntr, D), "test": (Nte, D), "train_labels", "test_labels",
    "classes", "data_dir", "img_size", "checkpoint", "epoch"}."""
    model, ckpt = load_checkpoint(ckpt_path, device)
    args = ckpt.get("args", {})
    data_dir = data_dir or args.get("data")
    if not data_dir:
        raise ValueError(f"{ckpt_path} does not say which data set it was trained on: pass --data")
    size = int(args.get("img_size", 64))
    stem = os.path.splitext(os.path.basename(ckpt_path))[0]
    cache = os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), f"features_{stem}.pt")
    key = {"ckpt_mtime": os.path.getmtime(ckpt_path), "ckpt_size": os.path.getsize(ckpt_path),
           "data": os.path.abspath(data_dir), "split_mtime":
           os.path.getmtime(os.path.join(data_dir, "split.json")), "img_size": size}
    if os.path.isfile(cache):
        saved = torch.load(cache, map_location="cpu", weights_only=False)
        if saved.get("key") == key:
            return saved
    d = load_prepared(data_dir)
    feats = extract_features(model, d["images"], size, batch_size, device, progress)  # (N, D)
    out = {"train": feats[d["train_idx"]], "test": feats[d["test_idx"]],
           "train_labels": d["labels"][d["train_idx"]], "test_labels": d["labels"][d["test_idx"]],
           "classes": list(d["classes"]), "data_dir": data_dir, "img_size": size,
           "checkpoint": os.path.abspath(ckpt_path), "epoch": ckpt.get("epoch"), "key": key}
    save_checkpoint(out, cache)
    return out
