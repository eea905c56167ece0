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

__all__ = [
    "TranslateResult", "translate", "uneven_target", "even_target", "sinkhorn_knopp", "lct_loss",
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


def _check_outputs(outputs: torch.Tensor) -> None:
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        raise ValueError(f"outputs must be an (N, k) tensor, got {type(outputs).__name__} "
                         f"of shape {tuple(getattr(outputs, 'shape', ()))}")
    n, k = outputs.shape
    if k < 2:
        raise ValueError(f"need k >= 2 clusters, got k={k}")
    if n < k:
        raise ValueError(f"need at least as many outputs as clusters (N >= k), got N={n}, k={k}")
    if not torch.isfinite(outputs).all():
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
    # population std of the deviations from the target (for an even target: the std of the counts)
    return (counts.to(torch.float64) - target).pow(2).mean().sqrt().item()


def translate(outputs: torch.Tensor, target=None, beta: float = 1.5, alpha0: float = 1e-15,
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
               cutout: int = 16, generator=None, progress: bool = True) -> torch.Tensor:
    """The network's outputs for every image: (views, N, k) float32 on `device`.  views = 1 uses
    the test-time transform; views > 1 uses random (simple or strong) augmentations.  bn="batch"
    normalises with batch statistics without touching running statistics (see batch_stats_mode);
    bn="eval" uses the running statistics.  Batches are shuffled so batch statistics do not depend
    on the order of the data set."""
    n = images.shape[0]
    perm = torch.randperm(n, generator=generator)
    out = torch.empty(views, n, model.cfg.k, device=device)
    ctx = batch_stats_mode(model) if bn == "batch" else _eval_mode(model)
    with ctx:
        for s in _batches(n, batch_size, "label pass", progress):
            idx = perm[s:s + batch_size]
            x = images[idx].to(device, non_blocking=True)
            for v in range(views):
                xv = resize_batch(x, size) if views == 1 else augment(x, size, strong, cutout=cutout)
                with _autocast(device):
                    out[v, idx.to(device)] = model(xv).float()
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
