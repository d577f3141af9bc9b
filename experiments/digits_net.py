"""Networks of the digits target, in NVIDIA's persistent-class form (their source travels in the pickle).

This module is the *embedded source* of ``specsamp/data/edm-digits-8x8-cond.pkl`` and
``specsamp/data/digits-classifier-8x8.pkl``: pickling an instance stores this file's text, and
unpickling executes that text (``torch_utils.persistence`` format, see :mod:`specsamp.models.nvlabs_compat`).
It therefore imports only ``torch`` and ``torch_utils.persistence``, like NVlabs/edm ``training/networks.py``.
Import it through :func:`experiments.train_digits.network_module`, which registers the ``torch_utils``
stand-in first.

- :class:`EDMPrecond`: ``D(x; sigma) = c_skip x + c_out F(c_in x; c_noise, labels)`` with Karras et al.
  (2022) Table 1's preconditioning (``c_skip = sd^2 / (s^2 + sd^2)``, ``c_out = s sd / sqrt(s^2 + sd^2)``,
  ``c_in = 1 / sqrt(s^2 + sd^2)``, ``c_noise = ln(s) / 4``), on EDM's variance-exploding scale
  ``y = x0 + s xi``; same call signature as NVIDIA's ``EDMPrecond``.
- :class:`DigitsNet`: ``F``, a residual conv net at 8x8 (no down-sampling: 8 convolutions see the whole image).
- :class:`DigitsClassifier`: a small conv classifier (FID features and the two-sample tests).
"""

import math

import torch
from torch_utils import persistence


@persistence.persistent_class
class NoiseEmbedding(torch.nn.Module):
    """Sinusoidal embedding of ``c_noise [b]`` -> ``[b, channels]`` (transformer-style frequencies)."""

    def __init__(self, channels, max_positions=10000):
        super().__init__()
        self.channels = channels
        self.max_positions = max_positions

    def forward(self, c):
        half = self.channels // 2
        freqs = torch.arange(half, dtype=torch.float32, device=c.device) / half
        freqs = (1.0 / self.max_positions) ** freqs
        arg = c.to(torch.float32)[:, None] * freqs[None, :]
        return torch.cat([arg.cos(), arg.sin()], dim=1)


@persistence.persistent_class
class ResBlock(torch.nn.Module):
    """GroupNorm-SiLU-conv twice, with an embedding-driven scale and shift in between; residual."""

    def __init__(self, channels, emb_channels, groups=8):
        super().__init__()
        self.norm0 = torch.nn.GroupNorm(groups, channels)
        self.conv0 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.affine = torch.nn.Linear(emb_channels, 2 * channels)
        self.norm1 = torch.nn.GroupNorm(groups, channels)
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        torch.nn.init.zeros_(self.conv1.weight)
        torch.nn.init.zeros_(self.conv1.bias)

    def forward(self, x, emb):
        h = self.conv0(torch.nn.functional.silu(self.norm0(x)))
        scale, shift = self.affine(emb)[:, :, None, None].chunk(2, dim=1)
        h = torch.nn.functional.silu(self.norm1(h) * (1 + scale) + shift)
        return (x + self.conv1(h)) / math.sqrt(2)


@persistence.persistent_class
class DigitsNet(torch.nn.Module):
    """``F(x_in [b, C, R, R], c_noise [b], labels [b, label_dim] | None) -> [b, C, R, R]``."""

    def __init__(self, img_resolution, img_channels, label_dim=0, channels=32, blocks=4, emb_channels=64):
        super().__init__()
        self.label_dim = label_dim
        self.noise_emb = NoiseEmbedding(emb_channels)
        self.label_emb = torch.nn.Linear(label_dim, emb_channels, bias=False) if label_dim else None
        self.emb = torch.nn.Sequential(
            torch.nn.Linear(emb_channels, emb_channels), torch.nn.SiLU(), torch.nn.Linear(emb_channels, emb_channels)
        )
        self.conv_in = torch.nn.Conv2d(img_channels, channels, 3, padding=1)
        self.pos = torch.nn.Parameter(
            torch.zeros(1, channels, img_resolution, img_resolution)
        )  # digits are not translation invariant
        self.blocks = torch.nn.ModuleList([ResBlock(channels, emb_channels) for _ in range(blocks)])
        self.norm_out = torch.nn.GroupNorm(8, channels)
        self.conv_out = torch.nn.Conv2d(channels, img_channels, 3, padding=1)
        torch.nn.init.zeros_(self.conv_out.weight)
        torch.nn.init.zeros_(self.conv_out.bias)

    def forward(self, x, c_noise, class_labels=None):
        e = self.noise_emb(c_noise)
        if self.label_emb is not None:
            e = e + self.label_emb(class_labels) * math.sqrt(self.label_emb.in_features)
        e = torch.nn.functional.silu(self.emb(e))
        h = self.conv_in(x) + self.pos
        for block in self.blocks:
            h = block(h, e)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


@persistence.persistent_class
class EDMPrecond(torch.nn.Module):
    """EDM-preconditioned denoiser ``forward(x, sigma, class_labels=None) -> D(x; sigma)``.

    Args (constructor): ``img_resolution``, ``img_channels``, ``label_dim`` (0: unconditional),
    ``sigma_data`` (data standard deviation), further keywords for :class:`DigitsNet`.

    Call: ``x [b, C, R, R]`` on EDM's scale ``x0 + sigma xi``; ``sigma`` scalar or ``[b]``;
    ``class_labels [b, label_dim]`` one-hot (zeros when omitted). Returns float32 ``[b, C, R, R]``.
    """

    def __init__(self, img_resolution, img_channels, label_dim=0, sigma_data=0.5, **model_kwargs):
        super().__init__()
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.label_dim = label_dim
        self.sigma_data = sigma_data
        self.model = DigitsNet(img_resolution, img_channels, label_dim, **model_kwargs)

    def forward(self, x, sigma, class_labels=None, force_fp32=False, **model_kwargs):
        x = x.to(torch.float32)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
        if self.label_dim == 0:
            class_labels = None
        elif class_labels is None:
            class_labels = torch.zeros([x.shape[0], self.label_dim], device=x.device)
        else:
            class_labels = class_labels.to(torch.float32).reshape(-1, self.label_dim)
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + sigma**2).sqrt()
        c_noise = sigma.log() / 4
        f = self.model(c_in * x, c_noise.flatten().expand(x.shape[0]), class_labels, **model_kwargs)
        return c_skip * x + c_out * f.to(torch.float32)


@persistence.persistent_class
class DigitsClassifier(torch.nn.Module):
    """``forward(x [b, 1, 8, 8] in [-1, 1]) -> (features [b, feature_dim], logits [b, classes])``."""

    def __init__(self, img_resolution=8, img_channels=1, classes=10, channels=32, feature_dim=64):
        super().__init__()
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.classes = classes
        self.feature_dim = feature_dim
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(img_channels, channels, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.Conv2d(channels, channels, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * channels * (img_resolution // 4) ** 2, feature_dim),
            torch.nn.SiLU(),
        )
        self.head = torch.nn.Linear(feature_dim, classes)

    def forward(self, x):
        f = self.body(x.to(torch.float32))
        return f, self.head(f)
