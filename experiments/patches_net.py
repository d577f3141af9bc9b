"""Network of the patches32 target, in NVIDIA's persistent-class form (its source travels in the pickle).

This module is the *embedded source* of ``specsamp/data/edm-patches-32x32-uncond.pkl``: pickling an
instance stores this file's text, and unpickling executes that text (``torch_utils.persistence``
format, see :mod:`specsamp.models.nvlabs_compat`). It therefore imports only ``torch`` and
``torch_utils.persistence``, like NVlabs/edm ``training/networks.py``. Import it through
:func:`experiments.train_patches.network_module`, which registers the ``torch_utils`` stand-in first.

- :class:`EDMPrecond`: ``D(x; sigma) = c_skip x + c_out F(c_in x; c_noise)`` with Karras et al. (2022)
  Table 1's preconditioning (``c_skip = sd^2 / (s^2 + sd^2)``, ``c_out = s sd / sqrt(s^2 + sd^2)``,
  ``c_in = 1 / sqrt(s^2 + sd^2)``, ``c_noise = ln(s) / 4``) on EDM's variance-exploding scale
  ``y = x0 + s xi``; same call signature as NVIDIA's ``EDMPrecond`` (class-unconditional).
- :class:`PatchesUNet`: ``F``, a small U-Net (Ronneberger et al. 2015; the DDPM/EDM layout of residual
  blocks with a noise-embedding scale and shift, Ho et al. 2020) over 32, 16, 8 and 4 pixel levels,
  narrow at full resolution so a network call stays cheap on a CPU.
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
    """GroupNorm-SiLU-conv twice, an embedding-driven scale and shift in between; residual (1x1 skip when widths differ)."""

    def __init__(self, in_channels, out_channels, emb_channels):
        super().__init__()
        self.norm0 = torch.nn.GroupNorm(min(8, in_channels // 4), in_channels)
        self.conv0 = torch.nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.affine = torch.nn.Linear(emb_channels, 2 * out_channels)
        self.norm1 = torch.nn.GroupNorm(min(8, out_channels // 4), out_channels)
        self.conv1 = torch.nn.Conv2d(out_channels, out_channels, 3, padding=1)
        torch.nn.init.zeros_(self.conv1.weight)
        torch.nn.init.zeros_(self.conv1.bias)
        self.skip = torch.nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x, emb):
        h = self.conv0(torch.nn.functional.silu(self.norm0(x)))
        scale, shift = self.affine(emb)[:, :, None, None].chunk(2, dim=1)
        h = torch.nn.functional.silu(self.norm1(h) * (1 + scale) + shift)
        skip = x if self.skip is None else self.skip(x)
        return (skip + self.conv1(h)) / math.sqrt(2)


@persistence.persistent_class
class PatchesUNet(torch.nn.Module):
    """``F(x_in [b, C, R, R], c_noise [b]) -> [b, C, R, R]``; ``R`` divisible by ``2^(len(widths) - 1)``.

    Encoder: one :class:`ResBlock` per level at ``widths[i]`` channels, 2x2 average pooling between
    levels; a second block at the coarsest level; decoder: nearest-neighbour up-sampling, the encoder's
    output at that level concatenated, one block back to ``widths[i]``.
    """

    def __init__(self, img_resolution, img_channels, widths=(16, 32, 64, 128), emb_channels=64):
        super().__init__()
        widths = tuple(int(w) for w in widths)
        self.widths = widths
        self.noise_emb = NoiseEmbedding(emb_channels)
        self.emb = torch.nn.Sequential(
            torch.nn.Linear(emb_channels, emb_channels), torch.nn.SiLU(), torch.nn.Linear(emb_channels, emb_channels)
        )
        self.conv_in = torch.nn.Conv2d(img_channels, widths[0], 3, padding=1)
        self.enc = torch.nn.ModuleList()
        prev = widths[0]
        for w in widths:
            self.enc.append(ResBlock(prev, w, emb_channels))
            prev = w
        self.mid = ResBlock(prev, prev, emb_channels)
        self.dec = torch.nn.ModuleList()
        for w in reversed(widths):
            self.dec.append(ResBlock(prev + w, w, emb_channels))
            prev = w
        self.norm_out = torch.nn.GroupNorm(min(8, widths[0] // 4), widths[0])
        self.conv_out = torch.nn.Conv2d(widths[0], img_channels, 3, padding=1)
        torch.nn.init.zeros_(self.conv_out.weight)
        torch.nn.init.zeros_(self.conv_out.bias)

    def forward(self, x, c_noise, class_labels=None):
        e = torch.nn.functional.silu(self.emb(self.noise_emb(c_noise)))
        h = self.conv_in(x)
        skips = []
        for i, block in enumerate(self.enc):
            if i:
                h = torch.nn.functional.avg_pool2d(h, 2)
            h = block(h, e)
            skips.append(h)
        h = self.mid(h, e)
        for i, block in enumerate(self.dec):
            if i:
                h = torch.nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1), e)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


@persistence.persistent_class
class EDMPrecond(torch.nn.Module):
    """EDM-preconditioned unconditional denoiser ``forward(x, sigma, class_labels=None) -> D(x; sigma)``.

    Args (constructor): ``img_resolution``, ``img_channels``, ``sigma_data`` (data standard
    deviation), further keywords for :class:`PatchesUNet`.

    Call: ``x [b, C, R, R]`` on EDM's scale ``x0 + sigma xi``; ``sigma`` scalar or ``[b]``;
    ``class_labels`` ignored (``label_dim = 0``). Returns float32 ``[b, C, R, R]``.
    """

    def __init__(self, img_resolution, img_channels, sigma_data=0.5, **model_kwargs):
        super().__init__()
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.label_dim = 0
        self.sigma_data = sigma_data
        self.model = PatchesUNet(img_resolution, img_channels, **model_kwargs)

    def forward(self, x, sigma, class_labels=None, force_fp32=False, **model_kwargs):
        x = x.to(torch.float32)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + sigma**2).sqrt()
        c_noise = sigma.log() / 4
        f = self.model(c_in * x, c_noise.flatten().expand(x.shape[0]), **model_kwargs)
        return c_skip * x + c_out * f.to(torch.float32)
