"""The methods a user would pick instead of OTL, trained by `train_otl.py --method` in OTL's own
loop: SimCLR (contrastive, Chen et al. 2020), BYOL (no negatives, Grill et al. 2020) and SwAV
(online clustering with Sinkhorn-Knopp, Caron et al. 2020).  SeLa is OTL's loop with
`--labeler sinkhorn`.

Each peer trains the same backbone (otl.build_model's, its pooled features) with the same data,
image size, epochs, optimiser and schedule as OTL, and adds only what its paper adds on top: a
projection head (and BYOL's predictor and momentum target, SwAV's prototypes), its loss, and its
augmentation.  The heads, losses, prototypes and BYOL's momentum update are lightly's
(`pip install -r requirements-peers.txt`; imported here only, so nothing else needs it); the
augmentations are written here as batched tensor ops, so a peer's views cost what OTL's do on the
CPU and the GPU.  The checkpoint keeps the backbone as every run does (eval_knn.py and
eval_linear.py read it unchanged) and the peer's own modules beside it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import otl

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


# ----------------------------------------------------------------------------------------------
# Augmentation: each method's published views, batched on the images' device
# ----------------------------------------------------------------------------------------------
# colour jitter (probability, brightness, contrast, saturation, hue), grayscale and blur
# probabilities, solarisation probability, the smallest crop area; lightly's transforms hold the
# same values from the papers (SimCLR's strength 1; BYOL's two views differ in blur and
# solarisation; SwAV's strength 0.8 and its 0.14 - 1 crops for the two full-size views)
VIEWS = {
    "simclr": [dict(jitter=(0.8, 0.8, 0.8, 0.8, 0.2), gray=0.2, blur=0.5, solarize=0.0, scale=0.08)] * 2,
    "byol": [dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=1.0, solarize=0.0, scale=0.08),
             dict(jitter=(0.8, 0.4, 0.4, 0.2, 0.1), gray=0.2, blur=0.1, solarize=0.2, scale=0.08)],
    "swav": [dict(jitter=(0.8, 0.64, 0.64, 0.64, 0.16), gray=0.2, blur=0.5, solarize=0.0,
                  scale=0.14)] * 2,
}


def views(x: torch.Tensor, size: int, method: str, rot90: bool = True, flip: bool = True,
          crop: float = 1.0, generator: torch.Generator | None = None) -> list:
    """Two views of a uint8 batch (B, 3, H, W) by `method`'s published augmentation: float [0, 1]
    (B, 3, size, size) each.  The crop, flips and (overhead images) 90-degree rotations are
    otl.augment's, without its mild colour jitter; then colour jitter (brightness, contrast,
    saturation, hue, in that order), grayscale, Gaussian blur and solarisation, each with its
    probability per image."""
    out = []
    for v in VIEWS[method]:
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
    """What `method` adds to the backbone: SimCLR a projection head and the NT-Xent loss
    (temperature 0.5); BYOL a projection head, a predictor and a momentum copy of the backbone and
    projection (momentum 0.99 rising to 1 on a cosine, as its paper), negative cosine similarity
    both ways; SwAV a projection head, k prototypes on the unit sphere, frozen for the first
    epoch as its paper, and the swapped-prediction loss with Sinkhorn-Knopp codes."""

    def __init__(self, method: str, model: otl.OTLNet, k: int = 128, size: int = 32,
                 own: dict | None = None, aug: dict | None = None):
        """size: the views' side; own: `views`' options (rot90, flip, crop) for the method's own
        augmentation, or aug: otl.augment's options to take OTL's views instead (--peer-aug otl)."""
        super().__init__()
        self.size, self.own, self.aug = size, own or {}, aug
        lightly = need_lightly()
        heads = lightly.models.modules
        d = model.feat_dim
        self.method = method
        if method == "simclr":
            self.projection = heads.SimCLRProjectionHead(d, d, 128)
            self.criterion = lightly.loss.NTXentLoss(temperature=0.5)
        elif method == "byol":
            import copy
            self.projection = heads.BYOLProjectionHead(d, 4096, 256)
            self.prediction = heads.BYOLPredictionHead(256, 4096, 256)
            self.target = copy.deepcopy(model)
            self.target_projection = copy.deepcopy(self.projection)
            for m in (self.target, self.target_projection):
                lightly.models.utils.deactivate_requires_grad(m)
            self.criterion = lightly.loss.NegativeCosineSimilarity()
        elif method == "swav":
            self.projection = heads.SwaVProjectionHead(d, d, 128)
            self.prototypes = heads.SwaVPrototypes(128, k)
            self.criterion = lightly.loss.SwaVLoss()
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
        xs = (views(x, self.size, self.method, **self.own) if self.aug is None else
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
        return self.criterion([self.prototypes(zi) for zi in z], []).squeeze()   # (1,): a scalar

    def after_step(self, model: otl.OTLNet, progress: float) -> None:
        """BYOL: the target moves toward the online network, momentum 0.99 -> 1 over the run."""
        if self.method == "byol":
            m = 1 - 0.01 * (math.cos(math.pi * min(progress, 1.0)) + 1) / 2
            self._update_momentum(model, self.target, m)
            self._update_momentum(self.projection, self.target_projection, m)

    def clusters(self, feats: torch.Tensor) -> int | None:
        """SwAV: the prototypes in use, each image on its nearest; None for the others."""
        if self.method != "swav":
            return None
        self.eval()                  # (the training loop sets train mode again)
        with torch.no_grad():
            z = F.normalize(self.projection(feats), dim=1)
            return int(self.prototypes(z).argmax(1).unique().numel())


# ----------------------------------------------------------------------------------------------
# The collapse signal every method logs
# ----------------------------------------------------------------------------------------------
# the spread of the normalised features below which a run is called collapsed: 1 is a spread like
# points uniform on the sphere; collapse to a point or a few points drives it to 0
COLLAPSED = 0.1


def feature_spread(feats: torch.Tensor) -> float:
    """sqrt(d) times the std across images of the L2-normalised features, averaged over the d
    dimensions: about 1 for features spread over the sphere, 0 when every image maps to one
    point (Jing et al. 2022's collapse measure, scaled so that it does not depend on d)."""
    z = F.normalize(feats.float(), dim=1)
    return float(z.std(0).mean() * math.sqrt(z.shape[1]))
