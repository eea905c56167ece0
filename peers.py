"""The methods a user would pick instead of OTL, trained by `train_otl.py --method` in OTL's own
loop: SimCLR (contrastive, Chen et al. 2020), BYOL (no negatives, Grill et al. 2020) and SwAV
(online clustering with Sinkhorn-Knopp, Caron et al. 2020).  SeLa is OTL's loop with
`--labeler sinkhorn`.

Each peer trains the same backbone (otl.build_model's, its pooled features) with the same data,
image size and epochs as OTL, and adds only what its paper adds on top: a projection head (and
BYOL's predictor and momentum target, SwAV's prototypes and queue), its loss, and its
augmentation; its optimiser and schedule are OTL's, or with train_otl.py --recipe its published
ones (RECIPES).  The heads, losses, prototypes, queue and BYOL's momentum update are lightly's and
LARS is timm's (`pip install -r requirements-peers.txt`; imported here only, so nothing else
needs them); the augmentations are written here as batched tensor ops, so a peer's views cost
what OTL's do on the CPU and the GPU.  The checkpoint keeps the backbone as every run does
(eval_knn.py and eval_linear.py read it unchanged) and the peer's own modules beside it.  The
collapse signal every run logs (OTL's too) is at the end.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import otl
import utils

METHODS = ("otl", "simclr", "byol", "swav")


def need_lightly():
    """The lightly library's losses, heads and utilities; where it is missing, a stop with the
    install line."""
    try:
        import lightly.loss
        import lightly.models.modules
        import lightly.models.utils
    except ImportError:
        raise SystemExit("--method simclr, byol and swav use the lightly library: pip install -r "
                         "requirements-peers.txt (OTL itself does not need it)") from None
    return lightly


def need_timm():
    """timm's optimisers (its LARS, for --optimizer lars); where missing, a stop with the install
    line."""
    try:
        import timm.optim
    except ImportError:
        raise SystemExit("--optimizer lars uses timm's LARS: pip install -r requirements-peers.txt") from None
    return timm.optim


# ----------------------------------------------------------------------------------------------
# Augmentation: each method's published views, batched on the images' device
# ----------------------------------------------------------------------------------------------
# colour jitter (probability, brightness, contrast, saturation, hue), grayscale and blur
# probabilities, solarisation probability, the smallest crop area, by view recipe (--peer-aug):
# "own", each paper's ImageNet views (SimCLR's strength 1; BYOL's two views differ in blur and
# solarisation; SwAV's strength 1, 0.8 / 0.2 as in its code, and its 0.14 - 1 crops for the two
# full-size views); "cifar", the 32-px recipes: lightly's CIFAR-10 benchmark for SimCLR and SwAV
# (strength 0.5, no blur) and solo-learn's asymmetric CIFAR views for BYOL (no blur, the second
# view solarised)
VIEWS = {
    "own": {
        "simclr": [dict(jitter=(0.8, 0.8, 0.8, 0.8, 0.2), gray=0.2, blur=0.5, solarize=0.0,
                        scale=0.08)] * 2,
        "byol": [dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=1.0, solarize=0.0, scale=0.08),
                 dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=0.1, solarize=0.2, scale=0.08)],
        "swav": [dict(jitter=(0.8, 0.8, 0.8, 0.8, 0.2), gray=0.2, blur=0.5, solarize=0.0,
                      scale=0.14)] * 2},
    "cifar": {
        "simclr": [dict(jitter=(0.8, 0.4, 0.4, 0.4, 0.1), gray=0.2, blur=0.0, solarize=0.0,
                        scale=0.08)] * 2,
        "byol": [dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=0.0, solarize=0.0, scale=0.08),
                 dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=0.0, solarize=0.2, scale=0.08)],
        "swav": [dict(jitter=(0.8, 0.4, 0.4, 0.4, 0.1), gray=0.2, blur=0.0, solarize=0.0,
                      scale=0.14)] * 2},
}
VIEW_RECIPES = ("own", "cifar", "otl")      # --peer-aug: the two above, or OTL's own augmentation

# Each peer's published recipe at 32 px, which train_otl.py --recipe fills where a flag is not
# given: the optimiser, its lr at `batch` images (scaled linearly to --batch-size), weight decay,
# the warm-up as a share of the run, the loss's temperature, SwAV's prototypes and queue, and the
# views.  solo-learn: scripts/pretrain/cifar/<method>.yaml (LARS with trust coefficient 0.02,
# clipped, biases and norms unadapted; warmup_cosine with 10 of its 1,000 epochs warm-up).
# lightly: its CIFAR-10 benchmark (SGD, momentum 0.9, cosine, no warm-up, lr x batch / 128; SwAV
# with Adam and 512 prototypes).  "ours" (the default) is the preset's SGD for every method.
RECIPES = {
    "solo-learn": {
        "simclr": dict(optimizer="lars", lr=0.4, batch=256, wd=1e-4, warmup=0.01,
                       temperature=0.2, peer_aug="own"),
        "byol": dict(optimizer="lars", lr=1.0, batch=256, wd=1e-5, warmup=0.01, peer_aug="cifar"),
        "swav": dict(optimizer="lars", lr=0.6, batch=256, wd=1e-6, warmup=0.01, temperature=0.1,
                     prototypes=3000, queue=3840, peer_aug="own")},
    "lightly": {
        "simclr": dict(optimizer="sgd", lr=0.06, batch=128, wd=5e-4, warmup=0.0,
                       temperature=0.5, peer_aug="cifar"),
        "byol": dict(optimizer="sgd", lr=0.06, batch=128, wd=5e-4, warmup=0.0, peer_aug="cifar"),
        "swav": dict(optimizer="adam", lr=1e-3, batch=128, wd=0.0, warmup=0.0, temperature=0.1,
                     prototypes=512, queue=0, peer_aug="cifar")},
}
# the loss's own settings where no recipe sets them: lightly's defaults
TEMPERATURE = {"simclr": 0.5, "swav": 0.1}
# SwAV's queue joins after this share of the run (solo-learn: epoch 50 of 1,000)
QUEUE_START = 0.05


def views(x: torch.Tensor, size: int, method: str, rot90: bool = True, flip: bool = True,
          crop: float = 1.0, generator: torch.Generator | None = None, recipe: str = "own") -> list:
    """Two views of a uint8 batch (B, 3, H, W) by `method`'s augmentation in `recipe` ("own": its
    paper's, "cifar": the 32-px one; VIEWS): float [0, 1] (B, 3, size, size) each.  The crop,
    flips and (overhead images) 90-degree rotations are otl.augment's, without its mild colour
    jitter; then colour jitter (brightness, contrast, saturation, hue, in that order), grayscale,
    Gaussian blur and solarisation, each with its probability per image."""
    out = []
    for v in VIEWS[recipe][method]:
        y = otl.augment(x, size, scale=(v["scale"], 1.0), rot90=rot90, flip=flip, crop=crop,
                        jitter=False, generator=generator)
        out.append(_colour(y, generator, **{k: v[k] for k in ("jitter", "gray", "blur", "solarize")}))
    return out


def _colour(x, g, jitter, gray, blur, solarize):
    B, dev = x.shape[0], x.device

    def coin(p):
        return (torch.rand(B, device=dev, generator=g) < p).view(B, 1, 1, 1)

    def factor(w):
        return (1 + (torch.rand(B, device=dev, generator=g) * 2 - 1) * w).view(B, 1, 1, 1)
    p, b, c, s, h = jitter
    on = coin(p)
    lum = torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)
    y = (x * factor(b)).clamp(0, 1)                                                  # brightness
    m = (y * lum).sum(1, keepdim=True).mean((2, 3), keepdim=True)
    y = ((y - m) * factor(c) + m).clamp(0, 1)                                        # contrast
    grey = (y * lum).sum(1, keepdim=True)
    y = ((y - grey) * factor(s) + grey).clamp(0, 1)                                  # saturation
    y = _hue(y, (torch.rand(B, device=dev, generator=g) * 2 - 1) * h)
    x = torch.where(on, y, x)
    x = torch.where(coin(gray), (x * lum).sum(1, keepdim=True).expand_as(x), x)
    x = torch.where(coin(blur), _blur(x, torch.rand(B, device=dev, generator=g) * 1.9 + 0.1), x)
    return torch.where(coin(solarize), torch.where(x >= 0.5, 1 - x, x), x)


def _hue(x, shift):
    """Rotate each image's hue by shift (B,) turns: a rotation of the chroma plane in YIQ."""
    yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]],
                       device=x.device)
    a = shift * 2 * math.pi
    R = torch.zeros(x.shape[0], 3, 3, device=x.device)
    R[:, 0, 0] = 1
    R[:, 1, 1], R[:, 1, 2], R[:, 2, 1], R[:, 2, 2] = a.cos(), -a.sin(), a.sin(), a.cos()
    M = torch.linalg.inv(yiq) @ R @ yiq                                          # (B, 3, 3)
    return torch.einsum("bij,bjhw->bihw", M, x).clamp(0, 1)


def _blur(x, sigma):
    """Gaussian blur of each image with its own sigma (B,), on a kernel of about a tenth of the
    image's side (SimCLR's), by one grouped separable convolution."""
    B, C, H, W = x.shape
    r = max(1, H // 20)
    t = torch.arange(-r, r + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-t.view(1, -1) ** 2 / (2 * sigma.view(-1, 1) ** 2))
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(C, 0)                     # (B*C, 2r+1)
    y = x.reshape(1, B * C, H, W)
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="reflect"), k.view(B * C, 1, 1, -1), groups=B * C)
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="reflect"), k.view(B * C, 1, -1, 1), groups=B * C)
    return y.view(B, C, H, W)


# ----------------------------------------------------------------------------------------------
# The peers' heads and losses (lightly's), on the backbone's pooled features
# ----------------------------------------------------------------------------------------------

class Peer(nn.Module):
    """What `method` adds to the backbone: SimCLR a projection head and the NT-Xent loss; BYOL a
    projection head and a predictor sized to the backbone (hidden 2d, output d / 2: lightly's
    CIFAR-10 sizes for a 512-d ResNet-18), a momentum copy of the backbone and projection
    (momentum 0.99 rising to 1 on a cosine, as its paper), negative cosine similarity both ways;
    SwAV a projection head, prototypes on the unit sphere, frozen for the first epoch as its
    paper, an optional queue of earlier batches' projections, and the swapped-prediction loss
    with Sinkhorn-Knopp codes."""

    def __init__(self, method: str, model: otl.OTLNet, k: int = 128, size: int = 32,
                 own: dict | None = None, aug: dict | None = None, recipe: str = "own",
                 temperature: float | None = None, queue: int = 0, queue_start: int = 0):
        """k: SwAV's prototypes; size: the views' side; own: `views`' options (rot90, flip, crop)
        for the method's views of `recipe`, or aug: otl.augment's options to take OTL's views
        instead (--peer-aug otl); temperature: the loss's (TEMPERATURE where None); queue: SwAV's
        queue length in images (0: none), used from epoch `queue_start` on."""
        super().__init__()
        self.size, self.own, self.aug, self.recipe = size, own or {}, aug, recipe
        lightly = need_lightly()
        heads = lightly.models.modules
        d = model.feat_dim
        self.method, self.queue_start = method, queue_start
        self.temperature = TEMPERATURE.get(method) if temperature is None else temperature
        self.queues = None
        if method == "simclr":
            self.projection = heads.SimCLRProjectionHead(d, d, 128)
            self.criterion = lightly.loss.NTXentLoss(temperature=self.temperature)
        elif method == "byol":
            import copy
            self.projection = heads.BYOLProjectionHead(d, 2 * d, max(d // 2, 1))
            self.prediction = heads.BYOLPredictionHead(max(d // 2, 1), 2 * d, max(d // 2, 1))
            self.target = copy.deepcopy(model)
            self.target_projection = copy.deepcopy(self.projection)
            for m in (self.target, self.target_projection):
                lightly.models.utils.deactivate_requires_grad(m)
            self.criterion = lightly.loss.NegativeCosineSimilarity()
        elif method == "swav":
            self.projection = heads.SwaVProjectionHead(d, d, 128)
            self.prototypes = heads.SwaVPrototypes(128, k)
            self.criterion = lightly.loss.SwaVLoss(temperature=self.temperature)
            if queue:
                bank = lightly.models.modules.memory_bank.MemoryBankModule
                self.queues = _Queues(bank(size=(queue, 128), feature_dim_first=False)
                                      for _ in range(2))
        else:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS[1:])}")
        self._update_momentum = lightly.models.utils.update_momentum

    def trainable(self):
        """The parameters the optimiser trains (BYOL's target follows by momentum instead)."""
        return [p for p in self.parameters() if p.requires_grad]

    def step(self, model: otl.OTLNet, x: torch.Tensor, epoch: int, device,
             amp: bool | None = None) -> torch.Tensor:
        """A training step's loss on the uint8 batch x: its two views (the method's own or OTL's),
        the forward passes under otl.autocast(device, amp), the loss in float32."""
        xs = (views(x, self.size, self.method, recipe=self.recipe, **self.own) if self.aug is None else
              [otl.augment(x, self.size, **self.aug) for _ in range(2)])
        with otl.autocast(device, amp):
            return self.loss(model, [v.contiguous(memory_format=torch.channels_last) for v in xs],
                             epoch).float()

    def loss(self, model: otl.OTLNet, xs: list, epoch: int) -> torch.Tensor:
        """The method's loss on two views xs (each (B, 3, S, S) in [0, 1]) of a batch."""
        feats = [model.features(x) for x in xs]                                  # (B, d) each
        if self.method == "simclr":
            return self.criterion(*(self.projection(f) for f in feats))
        if self.method == "byol":
            p = [self.prediction(self.projection(f)) for f in feats]
            with torch.no_grad():
                z = [self.target_projection(self.target.features(x)) for x in xs]
            return 0.5 * (self.criterion(p[0], z[1]) + self.criterion(p[1], z[0]))
        self.prototypes.normalize()
        self.prototypes.requires_grad_(epoch > 0)          # frozen in the first epoch
        z = [F.normalize(self.projection(f), dim=1) for f in feats]
        queued = None
        if self.queues is not None:     # each view's earlier projections, then this batch's in
            banks = [q(zi.detach().float(), update=True)[1] for q, zi in zip(self.queues.banks, z)]
            if epoch >= self.queue_start:
                with torch.no_grad():
                    queued = [self.prototypes(b.to(zi.dtype)) for b, zi in zip(banks, z)]
        return self.criterion([self.prototypes(zi) for zi in z], [],
                              queue_outputs=queued).squeeze()           # (1,): a scalar

    def head_outputs(self, feats: torch.Tensor) -> torch.Tensor:
        """What the loss reads of each image's backbone features: SimCLR's projection, BYOL's
        prediction, SwAV's prototype scores (the collapse signal measures them)."""
        z = self.projection(feats)
        if self.method == "byol":
            return self.prediction(z)
        if self.method == "swav":
            return self.prototypes(F.normalize(z, dim=1))
        return z

    def after_step(self, model: otl.OTLNet, progress: float) -> None:
        """BYOL: the target moves toward the online network, momentum 0.99 -> 1 over the run."""
        if self.method == "byol":
            m = 1 - 0.01 * (math.cos(math.pi * min(progress, 1.0)) + 1) / 2
            self._update_momentum(model, self.target, m)
            self._update_momentum(self.projection, self.target_projection, m)


class _Queues(nn.Module):
    """SwAV's queue: lightly's memory banks, one a view, with their contents (which lightly does
    not save) in the checkpoint, so that a resumed run goes on with the queue it had."""

    def __init__(self, banks):
        super().__init__()
        self.banks = nn.ModuleList(banks)

    def get_extra_state(self):
        return [[b.bank.clone(), b.bank_ptr.clone()] for b in self.banks]

    def set_extra_state(self, state):
        for b, (bank, ptr) in zip(self.banks, state):
            b.bank.copy_(bank)
            b.bank_ptr.copy_(ptr)


# ----------------------------------------------------------------------------------------------
# The collapse signal every method logs
# ----------------------------------------------------------------------------------------------
# The thresholds under which a run is called collapsed: the spread of the normalised outputs (1
# is a spread like points uniform on the sphere; collapse to a point or a few points drives it to
# 0), their effective rank (1: every image on one line), and for a softmax loss (OTL, SeLa, SwAV)
# its mean within 1 % of ln k, a uniform prediction, once the first COLLAPSE_AFTER epochs are past
COLLAPSED, COLLAPSED_RANK, UNIFORM_LOSS, COLLAPSE_AFTER = 0.1, 1.5, 0.99, 2


def feature_spread(feats: torch.Tensor) -> float:
    """sqrt(d) times the std across images of the L2-normalised features, averaged over the d
    dimensions: about 1 for features spread over the sphere, 0 when every image maps to one
    point (Jing et al. 2022's collapse measure, scaled so that it does not depend on d)."""
    z = F.normalize(feats.float(), dim=1)
    return float(z.std(0).mean() * math.sqrt(z.shape[1]))


def effective_rank(feats: torch.Tensor) -> float:
    """exp of the entropy of the normalised singular values of the centred, L2-normalised
    features (Roy and Vetterli 2007): about d for outputs spread over every direction, 1 when
    they vary along one line, 0 when they do not vary at all (dimensional collapse, which the
    spread alone can miss)."""
    z = F.normalize(feats.double(), dim=1)
    s = torch.linalg.svdvals(z - z.mean(0))
    if float(s.sum()) <= 1e-9 * math.sqrt(z.shape[0]):
        return 0.0
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def collapse_verdict(row: dict, epoch: int, k: int | None) -> str | None:
    """Why the outputs of a log row (feat_ and head_ spread and rank, the epoch's mean loss) are
    collapsed, or None: a spread under COLLAPSED, a rank under COLLAPSED_RANK, or with k (a
    softmax over k outputs) the loss within 1 % of ln k after the first COLLAPSE_AFTER epochs."""
    why = []
    for part, name in (("feat", "the backbone's features"), ("head", "the outputs the loss reads")):
        if utils.is_number(row.get(f"{part}_spread")) and row[f"{part}_spread"] < COLLAPSED:
            why.append(f"{name}: spread {row[f'{part}_spread']:.3f} < {COLLAPSED}")
        if utils.is_number(row.get(f"{part}_rank")) and row[f"{part}_rank"] < COLLAPSED_RANK:
            why.append(f"{name}: effective rank {row[f'{part}_rank']:.2f} < {COLLAPSED_RANK}")
    if k and k > 1 and epoch > COLLAPSE_AFTER and utils.is_number(row.get("loss")) \
            and row["loss"] >= UNIFORM_LOSS * math.log(k):
        why.append(f"the loss {row['loss']:.4f} at ln {k} = {math.log(k):.4f} (a uniform prediction)")
    return "; ".join(why) or None

