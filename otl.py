"""OTL: clustering-based self-supervised representation learning through output translation.

Li, Li, Garibaldi, Qiu, "Clustering-Based Representation Learning through Output Translation and
Its Application to Remote-Sensing Images", Remote Sensing 14(14):3361, 2022.  A CNN maps each image
s to k outputs O[s]; one k-vector T translates every output (O' = O - T) so that the clusters
argmax_i O'[s]_i spread the images as evenly as asked; those pseudo-labels train the network with
cross-entropy on the untranslated outputs, label-consistently across augmented views.  Copy this
file into a project (it needs torch alone; torchvision for the ResNets, tqdm for progress bars):

    res = translate(O)                  # O: (N, k) logits -> res.labels (N,), res.T (k,)
    loss = lct_loss(logits, labels)     # logits (V, B, k) of V views, labels (V, B)
    net = build_model(ModelConfig(k=128))

In the paper's order: 1. output translation, 2. Algorithm 1, 3. a reference exact labeler
(`translate`'s; otl_scale.py holds the tuned one), 4. Sinkhorn-Knopp (SeLa's, the baseline),
5. targets, 6. label-consistent training, 7. IND / DIS, 8. models, 9. augmentation and passes
over a data set, 10. weighted kNN, 11. the input checks.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["translate", "TranslateResult", "translate_published", "translate_exact", "sinkhorn_knopp",
           "even_target", "uneven_target", "lct_loss", "n_indistinguishable", "n_distinguishable",
           "ModelConfig", "OTLNet", "build_model", "augment", "resize_batch", "batch_stats_mode",
           "label_pass", "extract_features", "autocast", "knn_classify", "top1"]   # the copier's API

# ---- 1. Output translation (paper, Section 3): one T moves every output alike

@dataclass
class TranslateResult:
    labels: torch.Tensor          # (N,) int64, argmax of the translated outputs
    T: torch.Tensor               # (k,) float64, the translation: labels = argmax(O - T)
    counts: torch.Tensor          # (k,) int64, final cluster sizes
    target: torch.Tensor          # (k,) float64, the sizes aimed at
    iterations: int               # translation steps tried (accepted and undone) or paths
    std_history: list = field(default_factory=list)  # std of counts - target after each step
    std: float = 0.0              # final std of counts - target
    std_max: float = 0.0          # std when all N fall in one cluster
    seconds: float = 0.0
    stop_reason: str = ""
    ties: int = 0                 # exact: pairs of clusters tied by a moved row, made strict
    ties_left: int = 0            # exact: rows left tied that no translation separates (equal
                                  # rows in several clusters); their labels keep the balance


def translate(outputs: torch.Tensor, target=None, method: str = "exact", start=None,
              **settings) -> TranslateResult:
    """One k-vector T such that labels = argmax(O - T) spread the N rows of O over the k clusters
    as the target asks (even by default, or counts summing to N); T keeps every distance.
    method="exact" (default): `translate_exact`, every count within 1 of its target, from `start`
    (an earlier T) if given; "published": `translate_published` with its settings; "sinkhorn":
    `sinkhorn_knopp`'s labels (settings lam, tol, max_iter), T = 0 (it scales, not translates)."""
    if method not in ("exact", "published", "sinkhorn"):
        raise ValueError(f"method must be 'exact', 'published' or 'sinkhorn', got {method!r}")
    if start is not None and method != "exact":
        raise ValueError(f"start= is the exact labeler's; method={method!r} takes none (the "
                         "published rules start at the column medians or at 0)")
    if method == "published":
        return translate_published(outputs, target=target, **settings)
    if method == "sinkhorn":
        return _translate_sinkhorn(outputs, target, **settings)
    if settings:
        raise ValueError(f"{sorted(settings)} are settings of method='published' or 'sinkhorn'")
    return translate_exact(outputs, target=target, start=start)


def counts_std(counts, target) -> float:
    """Population std of the deviations from the target (for an even target: the std of the
    counts), in Python floats up to k = 256, where that costs less than torch's steps."""
    c, t = counts.cpu(), target.cpu()
    if c.numel() <= 256:
        return math.sqrt(sum((a - b) ** 2 for a, b in zip(c.tolist(), t.tolist())) / c.numel())
    return (c.to(torch.float64) - t).pow(2).mean().sqrt().item()


def worst_std(target: torch.Tensor, n: int) -> float:
    """The std when all n rows fall in the cluster with the smallest target: the largest."""
    t = target.cpu().to(torch.float64)
    worst = torch.zeros_like(t)
    worst[int(torch.argmin(t))] = n
    return max(counts_std(worst, t), 1e-12)


# ---- 2. Algorithm 1 (paper), as the authors' code runs it

def translate_published(outputs: torch.Tensor, target=None, beta: float = 1.5,
                        alpha0: float = 1e-15, patience: int = 10, max_iter: int = 10000,
                        tie_eps: float = 1e-6, seed: int = 0,
                        init: str = "median") -> TranslateResult:
    """Paper Algorithm 1: translate O by T (O' = O - T), T += alpha C with C the surplus of each
    cluster, until the counts are even.  As the authors' published code runs it, which departs
    from the printed pseudo-code in three ways that make it converge:
    * C = counts - target is scaled so that its largest entry is 1;
    * alpha = (std / std_max) * (max - min of O - T) / f is recomputed every step (std_max: the
      std with all N rows in one cluster; f starts at 1), so steps shrink as the counts even out;
    * a step that makes the std worse is undone and f is multiplied by beta.
    It stops at std 0, alpha <= alpha0, `patience` accepted steps with the same std, or max_iter
    steps.  Ours, for tied outputs (a collapsed network's): a seeded perturbation of at most
    tie_eps x (the median row's max - min) decides ties (tie_eps=0: none), and T starts at the
    column medians (init="median"; the published code: 0, init="zero").  Three N x k float64."""
    t0 = time.perf_counter()
    check_outputs(outputs)
    n, k = outputs.shape
    if beta <= 1:
        raise ValueError(f"beta must be > 1 (it shrinks the step), got {beta}")
    if init not in ("median", "zero"):
        raise ValueError(f"init must be 'median' or 'zero', got {init!r}")
    target = check_target(target, n, k)
    O = outputs.detach().to(torch.float64)                      # (N, k)
    spread = (O.amax(1) - O.amin(1)).median().item()            # a typical row's range
    if tie_eps > 0:
        u = torch.rand(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        O = O + u.to(O.device) * (tie_eps * (spread if spread > 0 else 1.0))
    col_max, col_min = O.max(0).values, O.min(0).values         # (k,): the range of O - T, cheaply
    std_max = worst_std(target, n)

    def assign(T):                                              # labels and counts at O - T
        labels = torch.argmax(O - T, dim=1)
        return labels, torch.bincount(labels, minlength=k)

    def range_of(T):                                            # max - min of O - T
        return ((col_max - T).max() - (col_min - T).min()).item()

    T = O.median(dim=0).values if init == "median" else torch.zeros_like(col_max)
    labels, counts = assign(T)
    history = [counts_std(counts, target)]
    T, labels, counts, std, it, reason = translation_steps(
        assign, range_of, T, labels, counts, target, std_max, history, beta=beta, alpha0=alpha0,
        patience=patience, max_iter=max_iter)
    return TranslateResult(labels=labels, T=T, counts=counts, target=target, iterations=it,
                           std_history=history, std=std, std_max=std_max,
                           seconds=time.perf_counter() - t0, stop_reason=reason)


def translation_steps(assign, range_of, T, labels, counts, target, std_max, history,
                      beta=1.5, alpha0=1e-15, patience=10, max_iter=10000):
    """Algorithm 1's step loop with translate_published's rule and stops, for any way of
    labelling: assign(T) -> (labels, counts) at O - T, range_of(T) -> max - min of O - T (or a
    bound on it); the std after each step tried goes into `history`.  Returns (T, labels, counts,
    std, steps tried, stop reason) at the last accepted step."""
    target_d = target.to(T.device)
    std, f, still, it, reason = counts_std(counts, target), 1.0, 0, 0, "max_iter"
    while it < max_iter:
        if std == 0:
            reason = "balanced"
            break
        C = counts.to(torch.float64) - target_d     # > 0: the cluster wins too often
        C = C / C.max()
        alpha = (std / std_max) * range_of(T) / f
        if alpha <= alpha0:
            reason = "alpha0"
            break
        T_new = T + alpha * C
        labels_new, counts_new = assign(T_new)
        std_new = counts_std(counts_new, target)
        it += 1
        history.append(std_new)
        if std_new > std:                           # worse: undo, and take smaller steps
            f *= beta
            continue
        still = still + 1 if std_new == std else 0
        T, labels, counts, std = T_new, labels_new, counts_new, std_new
        if still >= patience:
            reason = "patience"
            break
    return T, labels, counts, std, it, reason


# ---- 3. A reference exact labeler
# T are the prices of a capacitated assignment: every row s goes to a cluster that maximises
# O[s] - T, and the counts must lie within [lo, hi] = [floor, ceil] of the target.  A row of
# cluster a moves to b when T_a - T_b rises past its lead D[s, b] = (O - T)[s, a] - (O - T)[s, b].
# Newton steps on the counts come near; shortest paths on the k x k graph of cheapest moves end
# it exactly; a last shift orders the ties.  otl_scale.py holds the tuned labeler.

def translate_exact(outputs: torch.Tensor, target=None, start=None,
                    newton_steps: int = 30) -> TranslateResult:
    """T with every count of labels = argmax(O - T) within 1 of its target, from `start` (a
    k-vector; the column medians by default).  A row whose best clusters tie under every
    translation (equal rows in several clusters) keeps one and is counted in ties_left; every
    other row is strictly in its cluster.  Holds O in float64 and a few N x k temporaries."""
    t0 = time.perf_counter()
    top = max(abs(v) for v in check_outputs(outputs))          # the largest |O|
    n, k = outputs.shape
    target = check_target(target, n, k)
    X = outputs.detach().to(torch.float64 if top > 1e37 else torch.float32).contiguous()
    # (N, k): float64 beyond float32's range; contiguous: torch's median is wrong on expanded rows
    t = target.to(X.device)
    T = (X.median(dim=0).values.double() if start is None
         else check_start(start, k).to(X.device))
    lo, hi = (b.to(X.device) for b in count_bounds(target))
    history = []
    T, steps = _newton_approach(X, T, t, lo, hi, newton_steps, history)
    O = outputs.detach().to(torch.float64)                      # (N, k): the finish's, exact
    del X
    labels, T, paths = _path_finish(O, T, lo, hi)
    T, ties, ties_left = _strict_ties(O, T, labels, top)
    counts = torch.bincount(labels, minlength=k)
    history.append(counts_std(counts, target))
    return TranslateResult(labels=labels, T=T, counts=counts, target=target,
                           iterations=steps + paths, std_history=history, std=history[-1],
                           std_max=worst_std(target, n), seconds=time.perf_counter() - t0,
                           stop_reason="balanced", ties=ties, ties_left=ties_left)


def _newton_approach(O, T, t, lo, hi, max_steps, history):
    """Newton steps on counts(T) - t: rows within h of their runner-up estimate the rows per unit
    of T_a - T_b on each boundary a | b, whose graph Laplacian L is the Jacobian: L dT = counts - t.
    A step that does not lower sum |counts - t| is tried again from the best T with L + lam diag(L)
    (Levenberg-Marquardt, lam x 4, three times at most).  Returns (T, steps); stds into history."""
    n, k = O.shape
    T_best, err_best, lam, tries, steps = T, math.inf, 0.0, 0, 0
    while steps < max_steps:
        S = O - T.to(O.dtype)                                   # (N, k) scores
        top = S.topk(2, dim=1)
        lab = top.indices[:, 0]
        c = torch.bincount(lab, minlength=k)
        history.append(counts_std(c, t))
        err = float((c - t).abs().sum())
        if err < err_best:
            if bool(((c >= lo) & (c <= hi)).all()):
                return T, steps
            T_best, err_best, tries, lam = T, err, 0, lam / 4
            state = (S, lab, top.indices[:, 1],
                     (top.values[:, 0] - top.values[:, 1]).double(), c.to(torch.float64) - t,
                     top.values[:, 0])
        elif tries == 3:
            break
        else:
            tries, lam = tries + 1, max(4 * lam, 0.25)
        T = T_best + _newton_dT(*state, lam)
        steps += 1
    return T_best, steps


def _newton_dT(S, lab, ru, margin, e, best, lam):
    """_newton_approach's step from S = O - T, each row's best and second cluster lab, ru, its
    lead margin and best score, and e = counts - t.  A cluster no boundary row touches (an empty
    one) moves alone, to where its missing rows would join or its extra rows leave."""
    n, k = S.shape
    h = float(margin.kthvalue(min(n, max(n // 16, 16 * k))).values) + 1e-12   # N / 16 rows near
    near = margin <= h
    A = torch.zeros(k, k, dtype=torch.float64, device=S.device)
    A.index_put_((lab[near], ru[near]), torch.full_like(margin[near], 0.5 / h), accumulate=True)
    A = A + A.T                                                 # (k, k) boundary densities
    deg = A.sum(1)
    J = (deg > 0).nonzero().flatten()
    dT = torch.zeros(k, dtype=torch.float64, device=S.device)
    if J.numel() > 1:                      # L dT = e, with sum dT = 0 (the ones, at L's scale)
        L = torch.diag(deg[J] * (1 + lam + 1e-9)) - A[J][:, J] + deg[J].mean() / J.numel()
        try:
            dT[J] = torch.linalg.solve(L, e[J] - e[J].mean())
        except torch.linalg.LinAlgError:   # (singular in floating point: each cluster alone)
            dT[J] = (e[J] - e[J].mean()) / deg[J]
    for j in (deg == 0).nonzero().flatten().tolist():
        m = max(1, round(abs(float(e[j]))))
        if e[j] < 0:                            # the join cost of its last missing row
            dT[j] = -float((best - S[:, j]).kthvalue(min(n, int((lab == j).sum()) + m)).values)
        elif e[j] > 0:                          # the lead of its last extra row
            dT[j] = float(margin[lab == j].kthvalue(m).values)
    return dT


def _path_finish(O, T, lo, hi):
    """Successive shortest paths: each round, Dijkstra on the cheapest moves M[a, b] - dT_a + dT_b
    (M at the start's T, dT how far T moved since) from every cluster that must give a row to the
    nearest that can take one; T of every cluster settled before it rises by how much nearer the
    sources it is (leads stay >= 0, the path's moves cost 0); a row moves along each edge (equal
    rows together).  Clusters over hi give to those under hi, then over lo to under lo."""
    n, k = O.shape
    V = O - T                                                   # (N, k) scores at the start
    labels = V.argmax(1)
    D = V.gather(1, labels[:, None]) - V                        # (N, k) leads at the start
    D.scatter_(1, labels[:, None], math.inf)
    M = torch.full((k, k), math.inf, dtype=torch.float64, device=O.device)
    M.scatter_reduce_(0, labels[:, None].expand(n, k), D, "amin")   # (k, k) cheapest moves
    c = torch.bincount(labels, minlength=k)
    dT = torch.zeros(k, dtype=torch.float64, device=O.device)
    paths = 0
    for give, take in ((hi, hi), (lo, lo)):
        while bool((c > give).any()) and bool((c < take).any()):
            d = torch.where(c > give, 0.0, math.inf).to(torch.float64)
            pred = torch.full((k,), -1, dtype=torch.int64, device=O.device)
            done = torch.zeros(k, dtype=torch.bool, device=O.device)
            while True:                                         # dense Dijkstra, k x k costs
                u = int(torch.where(done, math.inf, d).argmin())
                du = float(d[u])
                if not math.isfinite(du):
                    raise RuntimeError("no path to balance the counts (non-finite outputs?)")
                if c[u] < take[u]:
                    break
                done[u] = True
                nd = du + (M[u] - dT[u] + dT).clamp(min=0)
                better = ~done & (nd < d)
                d = torch.where(better, nd, d)
                pred = torch.where(better, u, pred)
            dT = torch.where(done, dT + du - d, dT)
            path, v = [], u
            while int(pred[v]) >= 0:                            # the path's edges b -> v
                b = int(pred[v])
                rows = (labels == b).nonzero().flatten()
                path.append((b, v, rows, rows[D[rows, v] <= M[b, v]]))   # its cheapest rows
                v = b
            # as many rows as every edge has at its cheapest (equal rows move together)
            m = min([int(c[v] - give[v]), int(take[u] - c[u])] + [len(e[3]) for e in path])
            for b, dest, rows, move in path:
                move = move[:m]
                labels[move] = dest
                D[move] = V[move, dest][:, None] - V[move]
                D[move, dest] = math.inf
                M[dest] = torch.minimum(M[dest], D[move].amin(0))
                rows = rows[labels[rows] == b]
                M[b] = D[rows].amin(0) if rows.numel() else math.inf
            c[v] -= m
            c[u] += m
            paths += 1
    return labels, T + dT, paths


def _strict_ties(O, T, labels, top):
    """The paths leave each moved row tied with the cluster it left: a tie of a row of cluster a
    with b is made strict by a shift eta * pi of T, pi[b] > pi[a] (the longest chain of ties into
    each cluster), eta keeping every other lead.  Ties on a cycle (equal rows in several clusters)
    stay, counted.  top: the largest |O|.  Returns (T, ties made strict, rows left tied)."""
    n, k = O.shape
    S = O - T                                                   # (N, k)
    own = S.gather(1, labels[:, None])
    S.scatter_(1, labels[:, None], -math.inf)
    lead = own - S.max(1, keepdim=True).values                  # (N, 1) >= 0 up to rounding
    tol = 64 * 2.0 ** -52 * (top + float(T.abs().max()) + 1e-300)
    rows = (lead[:, 0] <= tol).nonzero().flatten()              # tied rows: few, the moved ones
    if rows.numel() == 0:
        return T, 0, 0
    L = own[rows] - S[rows]                                     # (r, k) their leads
    tied = L <= tol
    r, col = tied.nonzero(as_tuple=True)
    ra = labels[rows[r]]                                        # each tie: a row of ra, with col
    pairs = torch.bincount(ra * k + col, minlength=k * k).nonzero().flatten()
    a, b = pairs // k, pairs % k                                # the ties a -> b, once each
    R = torch.eye(k, device=O.device)                           # clusters joined by ties
    R[a, b] = 1.0
    for _ in range(max(1, math.ceil(math.log2(k)))):
        R = ((R @ R) > 0).float()                               # reachability, by squaring
    cyc = (R[a, b] > 0) & (R[b, a] > 0)                         # the tie lies on a cycle
    pi = torch.zeros(k, dtype=torch.float64, device=O.device)
    for _ in range(2 * k + 2):          # +1 along a tie, +0 around a cycle (shifted alike)
        new = pi.scatter_reduce(0, b, pi[a] + (~cyc).double(), "amax")
        if torch.equal(new, pi):
            break
        pi = new
    left = (R[ra, col] > 0) & (R[col, ra] > 0)
    free = lead[:, 0].clone()
    free[rows] = math.inf
    rmin = min(float(free.min()), float(L[~tied].min()) if bool((~tied).any()) else math.inf)
    rmin = rmin if math.isfinite(rmin) else 1.0
    T = T + rmin / (2 * (float(pi.max()) + 1)) * pi
    return T, int((~cyc).sum()), int(torch.unique(rows[r[left]]).numel())


# ---- 4. Sinkhorn-Knopp, SeLa's labeler (Asano et al., ICLR 2020): the paper's baseline

def sinkhorn_knopp(outputs: torch.Tensor, lam: float = 25.0, tol: float = 0.1,
                   max_iter: int = 10000):
    """SeLa's labeler as SeLa computes it (its optimize_L_sk): P = softmax(O)**lam once, in float64,
    then r (k) and c (N) by two matrix-vector products an iteration until sum_s |c_s / c'_s - 1|
    <= tol (checked every 10th); Q = diag(c) P diag(r), rows summing to 1/N, columns to about 1/k;
    labels = argmax of Q's rows.  Entries of P that underflow are raised to float64's smallest
    normal, so no column is all zero.  Returns (labels (N,), Q (N, k), iterations)."""
    check_outputs(outputs)
    n, k = outputs.shape
    P = F.softmax(outputs.detach().to(torch.float64), dim=1).pow_(lam).clamp_(min=2.0 ** -1022)
    c, err, it = torch.full((n,), 1 / n, dtype=torch.float64, device=outputs.device), math.inf, 0
    while it < max(max_iter, 1) and err > tol:
        r = (1 / k) / (P.T @ c)
        c_new = (1 / n) / (P @ r)
        err = (c / c_new - 1).abs().sum().item() if it % 10 == 0 else err
        c, it = c_new, it + 1
    Q = P.mul_(c[:, None]).mul_(r)
    return Q.argmax(1), Q, it


def _translate_sinkhorn(outputs, target, **settings) -> TranslateResult:
    """sinkhorn_knopp's labels as a TranslateResult: T = 0, the even target."""
    if target is not None:
        raise ValueError("method='sinkhorn' aims at the even target only (its marginals are "
                         "uniform); leave target=None")
    t0 = time.perf_counter()
    labels, _, iters = sinkhorn_knopp(outputs, **settings)
    n, k = outputs.shape
    counts, even = torch.bincount(labels, minlength=k).cpu(), even_target(n, k)
    return TranslateResult(labels=labels, T=torch.zeros(k, dtype=torch.float64), counts=counts,
                           target=even, iterations=iters, seconds=time.perf_counter() - t0,
                           std=(counts.double() - even).pow(2).mean().sqrt().item(),
                           std_max=n * (k - 1) ** 0.5 / k)


# ---- 5. Target distributions

def even_target(n: int, k: int) -> torch.Tensor:
    """The even target n_i = N / k (float: N need not be a multiple of k)."""
    return torch.full((k,), n / k, dtype=torch.float64)


def uneven_target(n: int, k: int, x: float, first: int = 0) -> torch.Tensor:
    """Integer counts n_i proportional to i**x that sum to N (paper, appendix on uneven pseudo-labels;
    x = 0: even), i = first .. first + k - 1, by largest remainders.  first=0 is the paper's indexing
    (cluster 0 gets no images for x > 0); first=1 gives i = 1 .. k and also allows x < 0."""
    if k < 2 or n < k:
        raise ValueError(f"uneven_target needs k >= 2 and N >= k, got N={n}, k={k}")
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"x must be a finite number (0 = even), got {x!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"first must be a non-negative integer (0: the paper's i = 0 .. k-1), got {first!r}")
    if first == 0 and x < 0:
        raise ValueError(f"x = {x} < 0 gives cluster 0 (i = 0) an infinite share; use first=1")
    i = torch.arange(first, first + k, dtype=torch.float64)
    w = i ** float(x)                            # 0 ** 0 = 1: x = 0 stays even
    if not torch.isfinite(w / w.sum()).all():    # i**x overflows: the same ratios, scaled by last**-x
        w = torch.exp(float(x) * (i.log() - math.log(first + k - 1)))
    exact = w / w.sum() * n
    counts = exact.floor()
    short = int(n - counts.sum().item())
    order = torch.argsort(exact - counts, descending=True)
    counts[order[:short]] += 1
    return counts


def count_bounds(target: torch.Tensor):
    """(lo, hi) int64: the counts the exact labeler accepts, floor and ceil of the target."""
    return (target + 1e-9).floor().long(), (target - 1e-9).ceil().long()


# ---- 6. Label-consistent training (LCT)

def lct_loss(logits: torch.Tensor, labels: torch.Tensor, consistent: bool = True,
             reduction: str = "mean") -> torch.Tensor:
    """Label-consistent training (paper, eq. for L_LCT): every view learns the pseudo-labels of
    every view of the same image, L = sum_a sum_b 1 / B sum_s CE(o_b(s), y_a(s)), o_b(s) the logits
    of view b of image s, y_a(s) the label of view a; logits (V, B, k), labels (V, B).
    reduction="sum" sums over the V^2 view pairs as the paper writes it; "mean" (default) divides
    by V^2, so the learning rate need not change with V.  consistent=False: plain cross-entropy,
    each view with its own labels, averaged ("mean") or summed ("sum")."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"need logits (V, B, k) and labels (V, B), got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    V, B, k = logits.shape
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer cluster numbers, got {labels.dtype}")
    if labels.numel() and not bool((labels.min() >= 0) & (labels.max() < k)):
        raise ValueError(f"labels must lie in [0, {k}) (the k = {k} outputs), got "
                         f"{int(labels.min())} ... {int(labels.max())}")
    logp = F.log_softmax(logits.float(), dim=2)  # (V, B, k)
    if not consistent:
        loss = F.nll_loss(logp.reshape(V * B, k), labels.reshape(V * B))
        return loss * V if reduction == "sum" else loss
    # picked[a, b, s] = log p_b(label_a(s)) for image s
    picked = torch.stack([logp.gather(2, labels[a][None, :, None].expand(V, B, 1)).squeeze(2)
                          for a in range(V)])  # (V, V, B)
    return -picked.mean() * (V * V if reduction == "sum" else 1)


# ---- 7. How discriminative a labelling is: the IND / DIS counts (paper, eqs. 1 and 2)

def n_indistinguishable(counts) -> int:
    """Paper eq. (1): pairs of images that fall in the same cluster, sum_i n_i (n_i - 1) / 2."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return int(round((c * (c - 1) / 2).sum().item()))


def n_distinguishable(counts) -> int:
    """Paper eq. (2): pairs of images in different clusters, sum_{i<j} n_i n_j."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return int(round(((c.sum() ** 2 - (c ** 2).sum()) / 2).item()))


# ---- 8. Models

@dataclass
class ModelConfig:
    arch: str = "resnet18"        # resnet18 | resnet50 | alexnet
    k: int = 128                  # clusters = outputs of each head
    small_stem: bool = False      # ResNets: 3x3 stride-1 first conv and no max-pool, for small images
    width: int = 64               # ResNet-18: channels of the first stage (torchvision's: 64);
                                  # AlexNet: of the first conv (the paper's: 96), all scaled alike
    mean: tuple = (0.5, 0.5, 0.5)  # per-channel normalisation of [0, 1] inputs, from the data
    std: tuple = (0.25, 0.25, 0.25)
    heads: int = 1                # h heads of k clusters, each labelled by its own translation
    embed: int = 0                # > 0: a linear layer of this size before the heads (the paper's 128-d)
    in_chans: int = 3             # bands of the input images (13 for Sentinel-2); mean, std: one each


class OTLNet(nn.Module):
    """A backbone that maps uint8 or [0, 1] images to pooled features, an optional embedding, and
    `heads` linear heads of k outputs (logits, no softmax).  forward gives (B, heads * k): head h
    is columns h*k .. (h+1)*k - 1.  `features(x, layer)` is what kNN and linear evaluation use."""

    def __init__(self, backbone: nn.Module, feat_dim: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.backbone, self.feat_dim = cfg, backbone, feat_dim
        self.embedding = nn.Linear(feat_dim, cfg.embed) if cfg.embed else None
        d = cfg.embed or feat_dim
        if cfg.heads == 1:
            self.head = nn.Linear(d, cfg.k)      # one head: the name stock checkpoints use
        else:
            self.heads = nn.ModuleList(nn.Linear(d, cfg.k) for _ in range(cfg.heads))
        self.out_dim = cfg.heads * cfg.k
        self.register_buffer("mean", torch.tensor(cfg.mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(cfg.std).view(1, -1, 1, 1))

    def _normalise(self, x):
        return (_unit(x) - self.mean) / self.std

    def features(self, x: torch.Tensor, layer: str = "pool") -> torch.Tensor:
        """(B, d) features of the images: "pool" the backbone's pooled output (default), "embed"
        the embedding, "convN" the N-th conv block's output averaged over space (ResNets: conv1 =
        the stem, conv2 .. conv5 = its four stages; AlexNet: its five convs)."""
        x = self._normalise(x)
        if layer == "pool":
            return self.backbone(x)
        if layer == "embed":
            if self.embedding is None:
                raise ValueError("--feature embed: this model has no embedding (ModelConfig.embed = 0)")
            return self.embedding(self.backbone(x))
        blocks = _conv_blocks(self.backbone, self.cfg.arch)
        if not (layer.startswith("conv") and layer[4:].isdigit() and 1 <= int(layer[4:]) <= len(blocks)):
            raise ValueError(f"unknown feature layer {layer!r}: pool, embed or conv1 .. conv{len(blocks)}")
        for blk in blocks[:int(layer[4:])]:
            x = blk(x)
        return x.mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.backbone(self._normalise(x))
        if self.embedding is not None:
            z = self.embedding(z)
        if self.cfg.heads == 1:
            return self.head(z)                               # (B, k)
        return torch.cat([h(z) for h in self.heads], 1)      # (B, heads * k)


def _conv_blocks(backbone, arch):
    """The backbone's conv blocks in order, each a module mapping the previous one's output."""
    if arch == "alexnet":
        return backbone.blocks
    stem = nn.Sequential(backbone.conv1, backbone.bn1, backbone.relu, backbone.maxpool)
    return [stem, backbone.layer1, backbone.layer2, backbone.layer3, backbone.layer4]


class AlexNet(nn.Module):
    """AlexNet with BatchNorm as SeLa and DeepCluster train it (conv 96-256-384-384-256, kernels
    11-5-3-3-3, three max-pools, two 4096-d layers), every width x width / 96; the conv output
    averaged to 6 x 6 (as torchvision's), so inputs of 63 px and more work."""

    def __init__(self, width: int = 96, in_chans: int = 3):
        super().__init__()
        c, fc = [max(1, round(n * width / 96)) for n in (96, 256, 384, 384, 256)], max(1, round(4096 * width / 96))

        def conv(i, o, kk, st, pad, pool):
            layers = [nn.Conv2d(i, o, kk, st, pad), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]
            return nn.Sequential(*layers, *([nn.MaxPool2d(3, 2)] if pool else []))
        self.blocks = nn.ModuleList([conv(in_chans, c[0], 11, 4, 2, True), conv(c[0], c[1], 5, 1, 2, True),
                                     conv(c[1], c[2], 3, 1, 1, False), conv(c[2], c[3], 3, 1, 1, False),
                                     conv(c[3], c[4], 3, 1, 1, True)])
        self.pool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(c[4] * 36, fc), nn.ReLU(inplace=True),
                                        nn.Dropout(0.5), nn.Linear(fc, fc), nn.ReLU(inplace=True))
        self.out_dim = fc
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.classifier(self.pool(x).flatten(1))


def build_model(cfg: ModelConfig) -> OTLNet:
    """The network for a ModelConfig: torchvision's ResNet-18 (a small-image stem, another width)
    or ResNet-50, or AlexNet; the classifier replaced by the heads (a ResNet's backbone loads into
    the stock torchvision model, its fc left out)."""
    import torchvision
    if cfg.heads < 1 or cfg.k < 2 or cfg.embed < 0:
        raise ValueError(f"need heads >= 1, k >= 2 and embed >= 0, got {cfg.heads}, {cfg.k}, {cfg.embed}")
    if cfg.arch == "alexnet":
        net = AlexNet(cfg.width, cfg.in_chans)
        return OTLNet(net, net.out_dim, cfg)
    if cfg.arch == "resnet50":
        if cfg.width != 64:
            raise ValueError("resnet50 comes at torchvision's width only (--width 64)")
        net = torchvision.models.resnet50(weights=None)
    elif cfg.arch == "resnet18":
        net = torchvision.models.resnet18(weights=None)
    else:
        raise ValueError(f"unknown arch {cfg.arch!r}; available: resnet18, resnet50, alexnet")
    if cfg.arch == "resnet18" and cfg.width != 64:
        from torchvision.models.resnet import BasicBlock, ResNet   # every stage x width / 64
        w, net = cfg.width, ResNet(BasicBlock, [2, 2, 2, 2])
        net.inplanes, net.conv1, net.bn1 = w, nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w)
        net.layer1 = net._make_layer(BasicBlock, w, 2)
        net.layer2 = net._make_layer(BasicBlock, 2 * w, 2, stride=2)
        net.layer3 = net._make_layer(BasicBlock, 4 * w, 2, stride=2)
        net.layer4 = net._make_layer(BasicBlock, 8 * w, 2, stride=2)
    if cfg.small_stem or cfg.in_chans != 3:
        kk, st = (3, 1) if cfg.small_stem else (7, 2)
        net.conv1 = nn.Conv2d(cfg.in_chans, cfg.width, kk, st, kk // 2, bias=False)
        net.maxpool = nn.Identity() if cfg.small_stem else net.maxpool
    if cfg.width != 64 or cfg.small_stem or cfg.in_chans != 3:
        for m in net.modules():  # torchvision's initialisation for the layers replaced above
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    feat_dim = net.fc.in_features if cfg.width == 64 else 8 * cfg.width
    net.fc = nn.Identity()
    return OTLNet(net, feat_dim, cfg)


# ---- 9. Batched augmentation of uint8 images on any device, and passes over a data set

def _unit(x):  # [0, 1]: uint8 / 255, uint16 / 65535 (multispectral bands keep their 16 bits)
    return x.float().div_(torch.iinfo(x.dtype).max) if x.dtype in (torch.uint8, torch.uint16) else x


def resize_batch(x: torch.Tensor, size: int, crop: float = 1.0) -> torch.Tensor:
    """uint8 or uint16 (B, C, H, W) -> float [0, 1] (B, C, size, size), antialiased: the test-time
    transform (the centre `crop` of each side first: 224 / 256 resizes to 256, then crops 224)."""
    x = _unit(x)
    if crop < 1:
        h, w = round(x.shape[-2] * crop), round(x.shape[-1] * crop)
        x = x[..., (x.shape[-2] - h) // 2:, (x.shape[-1] - w) // 2:][..., :h, :w]
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(0, 1)


def _blend(a, b, w):  # w: (B,) factor, 1 keeps a
    return (b + (a - b) * w.view(-1, 1, 1, 1)).clamp_(0, 1)


def augment(x: torch.Tensor, size: int, strong: bool = False, scale=(0.25, 1.0),
            cutout: int = 16, generator: torch.Generator | None = None, rot90: bool = True,
            n_ops: int = 2, flip: bool = True, crop: float = 1.0,
            jitter: bool = True) -> torch.Tensor:
    """Random views of a uint8 or uint16 batch (B, C, H, W), all on x's device: float [0, 1] (B, C,
    size, size).  All bands move alike; bands that are not colour (C != 3, or uint16) take contrast
    per band, brightness, blur and Cutout of each band's mean, not the ops that assume 8-bit colour.

    simple: random resized crop (area `scale` of a window of side `crop`: 224 / 256 crops 224 of
    images resized to 256, as the paper does), flips and 90-degree rotations (overhead images have
    no up; rot90=False: horizontal flips only; flip=False: none, for digits), mild colour jitter.
    strong: simple plus `n_ops` RandAugment-style ops per image at random magnitude (the paper's
    SCAN strategy: 10 on remote sensing, 8 on AlexNet) and Cutout of one hole of side `cutout`."""
    B, dev, g = x.shape[0], x.device, generator

    def U(lo, hi, *shape):
        return torch.rand(*(shape or (B,)), device=dev, generator=g) * (hi - lo) + lo

    xf, C, colour = _unit(x).float(), x.shape[1], x.shape[1] == 3 and x.dtype != torch.uint16
    # --- geometry: crop, flip, rot90 and (strong) rotate/shear/translate as one affine warp
    area, ar = U(*scale), U(math.log(3 / 4), math.log(4 / 3)).exp()     # area, aspect ratio
    sw = (area * ar).sqrt().clamp(max=1.0) * crop
    sh = (area / ar).sqrt().clamp(max=1.0) * crop
    cx, cy = U(-1, 1) * (1 - sw), U(-1, 1) * (1 - sh)
    theta = torch.zeros(B, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 1, 1] = sw, sh
    theta[:, 0, 2], theta[:, 1, 2] = cx, cy
    rot = torch.randint(0, 4, (B,), device=dev, generator=g)
    ang = rot.float() * (math.pi / 2) if rot90 else torch.zeros(B, device=dev)
    flip = torch.where(torch.rand(B, device=dev, generator=g) < 0.5 * flip, -1.0, 1.0)
    shear = torch.zeros(B, device=dev)
    if strong:
        ang = ang + U(-30, 30) * (math.pi / 180) * (torch.rand(B, device=dev, generator=g) < 0.3)
        shear = U(-0.3, 0.3) * (torch.rand(B, device=dev, generator=g) < 0.3)
    c, s = ang.cos(), ang.sin()
    R = torch.zeros(B, 2, 2, device=dev)
    R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1] = c * flip, -s + shear, s * flip, c
    theta = torch.cat([theta[:, :, :2] @ R, theta[:, :, 2:]], dim=2)
    grid = F.affine_grid(theta, (B, C, size, size), align_corners=False)
    if x.shape[-1] > 2 * size:  # downscale first so bilinear sampling does not alias
        xf = F.interpolate(xf, scale_factor=size / x.shape[-1] * 2, mode="bilinear",
                           antialias=True, align_corners=False)
    out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    # --- colour (jitter=False: the geometry alone, for a method with colour ops of its own)
    if jitter:
        mean = out.mean((1, 2, 3) if colour else (2, 3), keepdim=True)
        out = _blend(out, mean.expand_as(out), U(0.7, 1.3))                               # contrast
        out = (out * U(0.7, 1.3).view(-1, 1, 1, 1)).clamp_(0, 1)                        # brightness
        if colour:
            gray = (out * torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)).sum(1, True)
            out = _blend(out, gray.expand_as(out), U(0.6, 1.4))                         # saturation
    if strong:
        out = _rand_ops(out, U, g, n_ops, colour)
    if strong and cutout > 0:
        side = cutout
        cy_ = torch.randint(0, size, (B, 1, 1), device=dev, generator=g)
        cx_ = torch.randint(0, size, (B, 1, 1), device=dev, generator=g)
        ar_ = torch.arange(size, device=dev)
        hole = ((ar_.view(1, -1, 1) - cy_).abs() < side / 2) & ((ar_.view(1, 1, -1) - cx_).abs() < side / 2)
        out = (out.masked_fill(hole[:, None], 0.5) if colour else
               torch.where(hole[:, None], out.mean((2, 3), keepdim=True), out))
    return out


def _rand_ops(x, U, g, n_ops: int = 2, colour: bool = True):
    """n_ops random photometric ops per image (the geometric ones are in the warp): each round
    splits the batch into six random groups, one per op (op 5: identity), so nothing waits for the
    host; under 48 images every op runs on the whole batch, each image keeping its own."""
    B, dev = x.shape[0], x.device
    for _ in range(n_ops):
        m = U(0, 1)
        if B < 48:
            op = torch.randint(0, 6, (B,), device=dev, generator=g)
            y = x
            for i in range(5):
                y = torch.where((op == i).view(-1, 1, 1, 1), _photometric(i, x, m, colour), y)
        else:
            perm = torch.randperm(B, device=dev, generator=g)
            y = x.clone()
            for i in range(5):
                idx = perm[i * B // 6:(i + 1) * B // 6]
                y.index_copy_(0, idx, _photometric(i, x.index_select(0, idx), m.index_select(0, idx), colour))
        x = y
    return x


def _photometric(i, x, m, colour=True):
    """Photometric op i of images x (b, C, H, W) in [0, 1] at magnitudes m (b,) in [0, 1)."""
    m4 = m.view(-1, 1, 1, 1)
    if i > 0 and not colour:                            # only the blur suits other bands
        return x
    if i == 0:                                          # sharpness / blur
        blur = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, 1)
        return _blend(x, blur, 1 + (m * 2 - 1) * 0.9)
    if i == 1:                                          # posterize to 4..8 bits
        levels = 2 ** (4 + (m4 * 4).floor())
        return (x * (levels - 1)).round() / (levels - 1)
    if i == 2:                                          # solarize above a threshold
        return torch.where(x >= 1 - 0.5 * m4, 1 - x, x)
    if i == 3:                                          # autocontrast per channel
        lo, hi = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    else:                                               # equalise-like: stretch the 2-98 % range
        flat, qs = x.flatten(2).flatten(0, 1), torch.tensor([0.02, 0.98], device=x.device)
        rows = max(1, (1 << 24) // max(flat.shape[1], 1))   # torch.quantile takes 2^24 values at most
        q = torch.cat([torch.quantile(flat[r:r + rows], qs, dim=1)
                       for r in range(0, flat.shape[0], rows)], 1).view(2, x.shape[0], 3)
        lo, hi = q[0][..., None, None], q[1][..., None, None]
    return ((x - lo) / (hi - lo).clamp(min=1e-3)).clamp(0, 1)


@contextmanager
def batch_stats_mode(model: nn.Module):
    """BatchNorm normalises with each batch's own statistics (train mode) but leaves the running
    statistics untouched: the label pass must not move them.  Everything else in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.track_running_stats for m in bns]
    with _eval_mode(model):
        for m in bns:
            m.train()
            m.track_running_stats = False  # train mode without running-stat updates
        try:
            yield model
        finally:
            for m, t in zip(bns, saved):
                m.track_running_stats = t


def _progress(batches, desc: str, progress: bool):
    try:
        from tqdm import tqdm
    except ImportError:         # tqdm is optional: no bar without it
        return batches
    return tqdm(batches, desc=desc, unit="batch", leave=False, dynamic_ncols=True) if progress else batches


@torch.inference_mode()
def label_pass(model: OTLNet, images: torch.Tensor, size: int, batch_size: int = 256,
               device="cpu", bn: str = "batch", views: int = 1, generator=None,
               progress: bool = True, head: bool = True, batches: int | None = None,
               crop: float = 1.0, amp: bool | None = None, **aug) -> torch.Tensor:
    """The network's outputs for every image: (views, N, k) float32 on `device` (head=False: the
    backbone's features), under autocast(device, amp).  views = 1: the test-time transform; views
    > 1: random views (augment with crop and `aug`).  bn="batch": batch statistics, the running
    ones untouched (batch_stats_mode); "eval": the running ones.  Batches are shuffled so batch
    statistics do not depend on the data's order; `batches`: exactly this many near-equal ones
    (processes with synchronised BatchNorm must make the same number of forward passes)."""
    n = images.shape[0]
    perm = torch.randperm(n, generator=generator).to(images.device)
    bounds = ([(s, s + batch_size) for s in range(0, n, batch_size)] if batches is None else
              [(i * n // batches, (i + 1) * n // batches) for i in range(batches)])
    out = torch.empty(views, n, model.out_dim if head else model.feat_dim, device=device)
    fwd = model if head else model.features
    ctx = batch_stats_mode(model) if bn == "batch" else _eval_mode(model)
    with ctx:
        for s, e in _progress(bounds, "label pass", progress):
            idx = perm[s:e]
            x = images[idx].to(device, non_blocking=True)
            idx = idx.to(device, non_blocking=True)
            for v in range(views):
                xv = (resize_batch(x, size, crop) if views == 1 else
                      augment(x, size, crop=crop, **aug))
                with autocast(device, amp):
                    out[v, idx] = fwd(xv.contiguous(memory_format=torch.channels_last)).float()
    return out


@contextmanager
def _eval_mode(model):
    was = model.training
    try:
        yield model.eval()
    finally:
        model.train(was)


def autocast(device, enabled: bool | None = None):
    """bfloat16 autocast: enabled=None on CUDA only (it always pays there), True also on a CPU
    (where the processor has native bf16: emulated bf16 is slower), False never."""
    if enabled or (enabled is None and torch.device(device).type == "cuda"):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def extract_features(model: OTLNet, images: torch.Tensor, size: int, batch_size: int = 256,
                     device="cpu", progress: bool = True, layer: str = "pool",
                     crop: float = 1.0, amp: bool | None = None) -> torch.Tensor:
    """Frozen features (of `layer`, see OTLNet.features) of every image: the test-time transform
    (resize_batch with `crop`), eval mode, autocast(device, amp); (N, d) float32 on the CPU."""
    feats = []
    with _eval_mode(model):
        for s in _progress(range(0, images.shape[0], batch_size), "features", progress):
            x = resize_batch(images[s:s + batch_size].to(device, non_blocking=True), size, crop)
            with autocast(device, amp):
                feats.append(model.features(x, layer).float().cpu())
    return torch.cat(feats)


# ---- 10. Weighted kNN on frozen features (votes exp(sim / 0.1), Wu et al. 2018)

def knn_classify(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor,
                 ks=(10, 50, 100, 200), T: float = 0.1, num_classes: int | None = None,
                 chunk: int | None = None, search=None) -> dict:
    """Weighted kNN predictions for every k in `ks` from one search: {k: (M,) int64}.  On
    L2-normalised features each test row's max(ks) nearest training rows vote for their classes
    with weights exp(sim / T); ks above the training rows are clipped (a warning; the keys are the
    ks used).  num_classes: max(train label) + 1 by default; chunk: test rows per block.
    search(train, test, K) -> (sims, idx), (M, K) best first, replaces the brute-force search
    (e.g. a FAISS index, eval_knn.py)."""
    train, train_labels, test, ks, C = _knn_inputs(train_feats, train_labels, test_feats, ks, T,
                                                   num_classes)
    K = ks[-1]
    chunk = chunk or max(1, (1 << 26) // max(1, train.shape[0] + K + C))   # ~64 M floats a block
    if search is not None:
        sims, idx = search(train, test, K)
    else:
        blocks = [(test[s:s + chunk] @ train.T).topk(K, dim=1) for s in range(0, test.shape[0], chunk)]
        sims = torch.cat([b.values for b in blocks]) if blocks else torch.zeros(0, K)
        idx = torch.cat([b.indices for b in blocks]) if blocks else torch.zeros(0, K, dtype=torch.long)
    return _knn_vote(sims, idx.long(), train_labels, ks, T, C, chunk)


def _knn_vote(sims, idx, train_labels, ks, T, num_classes, chunk=4096) -> dict:
    """Weighted votes of the K = max(ks) neighbours (sims, idx: (M, K)) for every k in ks in one
    pass: {k: predictions (M,)}.  Deterministic ties: neighbours with equal similarity are taken
    in training-index order, and equal class scores go to the lowest class."""
    M, K = idx.shape
    # order neighbours by (-sim, index) so the first k do not depend on how the search broke ties
    o = torch.argsort(idx, dim=1, stable=True)
    sims, idx = sims.gather(1, o), idx.gather(1, o)
    o = torch.argsort(-sims, dim=1, stable=True)
    sims, idx = sims.gather(1, o), idx.gather(1, o)
    preds = {k: torch.empty(M, dtype=torch.long) for k in ks}
    for s in range(0, M, chunk):
        w = (sims[s:s + chunk].double() / T).exp()                       # (m, K) vote weights
        lab = train_labels[idx[s:s + chunk]]                             # (m, K)
        scores = torch.zeros(w.shape[0], num_classes, dtype=torch.float64)  # (m, C)
        prev = 0
        for k in ks:  # add the neighbours prev..k-1 to the running class scores
            scores.scatter_add_(1, lab[:, prev:k], w[:, prev:k])
            prev = k
            preds[k][s:s + chunk] = scores.argmax(1)  # first maximum: lowest class on a tie
    return preds


def top1(preds: dict, labels: torch.Tensor) -> dict:
    """{k: top-1 accuracy in percent} of {k: predictions}."""
    labels = torch.as_tensor(labels).long().flatten().cpu()
    if labels.numel() == 0:
        raise ValueError("no test labels")
    return {k: 100.0 * (p == labels).double().mean().item() for k, p in preds.items()}


# ---- 11. Input checks: what was wrong, and what to do

def check_outputs(outputs: torch.Tensor, finite: bool = True):
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        raise ValueError(f"outputs must be an (N, k) tensor, got {type(outputs).__name__} "
                         f"of shape {tuple(getattr(outputs, 'shape', ()))}")
    n, k = outputs.shape
    if k < 2:
        raise ValueError(f"need k >= 2 clusters, got k={k}")
    if n < k:
        raise ValueError(f"need at least as many outputs as clusters (N >= k), got N={n}, k={k}")
    if not outputs.is_floating_point():
        raise ValueError(f"outputs must be floating point (the network's logits), got {outputs.dtype}")
    if finite:
        return check_finite(outputs)    # (least, largest) value


def check_finite(X, row0: int = 0):
    if X.numel() == 0:
        return
    lo, hi = (v.item() for v in X.aminmax())   # one cheap pass; NaN and +-inf show in these
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = (~torch.isfinite(X)).any(1).nonzero().flatten() + row0
        raise ValueError(f"outputs contain NaN or infinite values in {bad.numel()} rows "
                         f"(first: {bad[:5].tolist()}); the network has probably diverged: "
                         "lower the learning rate or resume from an earlier checkpoint")
    return lo, hi


def check_start(start, k: int) -> torch.Tensor:
    """A start translation for the exact labeler as a (k,) float64 CPU tensor, or ValueError."""
    T = torch.as_tensor(start).detach().to(torch.float64).flatten().cpu()
    if T.numel() != k or not bool(torch.isfinite(T).all()):
        shape = tuple(torch.as_tensor(start).shape)
        raise ValueError(f"start must be k = {k} finite numbers (a translation T, "
                         f"e.g. an earlier result's .T), got shape {shape}")
    return T


def check_target(target, n: int, k: int) -> torch.Tensor:
    if target is None:
        return even_target(n, k)
    try:
        target = torch.as_tensor(target, dtype=torch.float64).flatten().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"target must be k = {k} numbers (counts summing to N = {n}), got "
                         f"{target!r:.80}") from e
    if target.numel() != k:
        raise ValueError(f"target has {target.numel()} entries but there are k={k} clusters")
    if not torch.isfinite(target).all() or (target < 0).any():
        raise ValueError("target counts must be finite and non-negative")
    if abs(target.sum().item() - n) > 1e-6 * max(n, 1):
        raise ValueError(f"target counts sum to {target.sum().item():g}, not to N={n}; "
                         "scale them, e.g. uneven_target(N, k, x)")
    return target


def _knn_inputs(train_feats, train_labels, test_feats, ks, T, num_classes):
    """Checked inputs: L2-normalised float32 features, int64 labels, sorted clipped ks, classes."""
    if (train_feats.dim() != 2 or test_feats.dim() != 2
            or train_feats.shape[1] != test_feats.shape[1]):
        raise ValueError(f"need train (N, D) and test (M, D) features, got "
                         f"{tuple(train_feats.shape)} and {tuple(test_feats.shape)}")
    n = train_feats.shape[0]
    if n == 0:
        raise ValueError("no training features")
    train_labels = torch.as_tensor(train_labels).long().flatten().cpu()
    if train_labels.numel() != n:
        raise ValueError(f"{n} training features but {train_labels.numel()} labels")
    if train_labels.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    for name, x in (("train", train_feats), ("test", test_feats)):
        if not torch.isfinite(x).all():
            raise ValueError(f"{name} features contain NaN or infinite values")
    if T <= 0:
        raise ValueError(f"temperature must be > 0, got {T}")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    if ks[-1] > n:
        warnings.warn(f"k = {[k for k in ks if k > n]} exceed the {n} training samples; "
                      f"clipped to k = {n}", stacklevel=3)
        ks = sorted({min(k, n) for k in ks})
    C = int(train_labels.max()) + 1 if num_classes is None else int(num_classes)
    if C <= int(train_labels.max()):
        raise ValueError(f"num_classes={C} but the labels go up to {int(train_labels.max())}")
    train, test = (F.normalize(x.detach().float().cpu(), dim=1) for x in (train_feats, test_feats))
    return train, train_labels, test, ks, C
