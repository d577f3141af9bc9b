"""EDM's CIFAR-10 network layout (DDPM++), in plain torch, with random weights: a faithful per-call cost.

Karras et al. (2022), "Elucidating the Design Space of Diffusion-Based Generative Models", use for
CIFAR-10 at 32x32 the DDPM++ U-Net of Song et al. (2021) with their preconditioning (Table 1). Its
published configuration (the ``ddpmpp`` network of their training script):

- ``model_channels = 128``, ``channel_mult = (2, 2, 2)`` (256 channels at 32x32, 16x16 and 8x8),
  ``num_blocks = 4`` residual blocks per level, self-attention (one head) at 16x16 only;
- ``channel_mult_emb = 4`` (a 512-wide embedding), positional noise embedding of 128 channels,
  class labels (10) and augmentation labels (9) added to it by linear maps;
- "standard" encoder and decoder, resampling by the box filter ``[1, 1]`` with a 1x1 projection on
  the skip path, group normalisation (32 groups, eps 1e-6), skip scale ``sqrt(1/2)``, the embedding
  added (a shift, no scale) to every block's features before its second normalisation;
- decoder: at the coarsest level two blocks (the first with attention), elsewhere an up-sampling
  block; then ``num_blocks + 1`` blocks per level fed by the encoder's skips (attention in the last
  block of the 16x16 level); output by GroupNorm-SiLU-conv 3x3 at 32x32.

The paper states 55.7M parameters for this network; :func:`ddpmpp_cifar10` builds 55.7M (the test
counts them). Weights are random (timing needs no trained weights); the acceptance of a speculative
sampler on it means nothing, so the GPU check only times its calls. Written from that description:
module names follow it, not any published source.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

SKIP_SCALE = math.sqrt(0.5)


def _norm(channels: int) -> nn.GroupNorm:
    """Group normalisation with at most 32 groups and at least 4 channels per group (eps 1e-6)."""
    return nn.GroupNorm(min(32, channels // 4), channels, eps=1e-6)


class PositionalEmbedding(nn.Module):
    """``c_noise [b] -> [b, channels]``: cosines then sines at ``channels / 2`` geometric frequencies in
    ``[1, 1 / max_positions]`` (both ends included)."""

    def __init__(self, channels: int, max_positions: int = 10000):
        super().__init__()
        self.channels, self.max_positions = channels, max_positions

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        half = self.channels // 2
        freqs = torch.arange(half, dtype=torch.float32, device=c.device) / (half - 1)
        arg = c.float()[:, None] * (1.0 / self.max_positions) ** freqs[None, :]
        return torch.cat([arg.cos(), arg.sin()], dim=1)


class Block(nn.Module):
    """DDPM++ residual block: GN-SiLU-conv, plus a linear map of the embedding, GN-SiLU-conv, skip;
    optional one-head self-attention after it; optional 2x down- or up-sampling (box filter) first.

    ``forward(x [b, c_in, r, r], emb [b, emb_channels]) -> [b, c_out, r', r']``.
    """

    def __init__(
        self, c_in: int, c_out: int, emb_channels: int, *, up: bool = False, down: bool = False, attention: bool = False
    ):
        super().__init__()
        self.c_in, self.c_out, self.up, self.down = c_in, c_out, up, down
        self.norm0 = _norm(c_in)
        self.conv0 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.affine = nn.Linear(emb_channels, c_out)
        self.norm1 = _norm(c_out)
        self.conv1 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if (c_in != c_out or up or down) else None
        self.attention = attention
        if attention:
            self.norm2 = _norm(c_out)
            self.qkv = nn.Conv2d(c_out, 3 * c_out, 1)
            self.proj = nn.Conv2d(c_out, c_out, 1)

    def _resample(self, x: torch.Tensor) -> torch.Tensor:
        if self.up:
            return F.interpolate(x, scale_factor=2, mode="nearest")
        if self.down:
            return F.avg_pool2d(x, 2)
        return x

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        orig = x
        h = self.conv0(self._resample(F.silu(self.norm0(x))))
        h = F.silu(self.norm1(h + self.affine(emb)[:, :, None, None]))
        h = self.conv1(h)
        s = self._resample(orig)
        h = (h + (self.skip(s) if self.skip is not None else s)) * SKIP_SCALE
        if self.attention:
            b, c, r1, r2 = h.shape
            q, k, v = self.qkv(self.norm2(h)).reshape(b, c, 3, r1 * r2).unbind(2)
            w = torch.softmax(torch.einsum("bcq,bck->bqk", q, k / math.sqrt(c)), dim=2)
            a = torch.einsum("bqk,bck->bcq", w, v).reshape(b, c, r1, r2)
            h = (self.proj(a) + h) * SKIP_SCALE
        return h


class DDPMpp(nn.Module):
    """The DDPM++ U-Net ``F(x [b, C, R, R], c_noise [b], class_labels [b, label_dim] | None) -> [b, C, R, R]``.

    Args:
        img_resolution: ``R``; img_channels: ``C``; label_dim: classes (0: unconditional);
        augment_dim: augmentation labels (their embedding exists; this check passes none).
        model_channels, channel_mult, channel_mult_emb, num_blocks, attn_resolutions: the layout
        (module docstring).
    """

    def __init__(
        self,
        img_resolution: int = 32,
        img_channels: int = 3,
        label_dim: int = 10,
        augment_dim: int = 9,
        model_channels: int = 128,
        channel_mult=(2, 2, 2),
        channel_mult_emb: int = 4,
        num_blocks: int = 4,
        attn_resolutions=(16,),
    ):
        super().__init__()
        emb_ch = model_channels * channel_mult_emb
        self.map_noise = PositionalEmbedding(model_channels)
        self.map_label = nn.Linear(label_dim, model_channels) if label_dim else None
        self.map_augment = nn.Linear(augment_dim, model_channels, bias=False) if augment_dim else None
        self.map_layer0 = nn.Linear(model_channels, emb_ch)
        self.map_layer1 = nn.Linear(emb_ch, emb_ch)
        self.enc = nn.ModuleDict()
        c = img_channels
        skips = []
        for level, mult in enumerate(channel_mult):
            res = img_resolution >> level
            if level == 0:
                self.enc[f"r{res}_conv"] = nn.Conv2d(c, model_channels, 3, padding=1)
                c = model_channels
            else:
                self.enc[f"r{res}_down"] = Block(c, c, emb_ch, down=True)
            skips.append(c)
            for i in range(num_blocks):
                self.enc[f"r{res}_block{i}"] = Block(
                    c, model_channels * mult, emb_ch, attention=res in attn_resolutions
                )
                c = model_channels * mult
                skips.append(c)
        self.dec = nn.ModuleDict()
        for level, mult in reversed(list(enumerate(channel_mult))):
            res = img_resolution >> level
            if level == len(channel_mult) - 1:
                self.dec[f"r{res}_in0"] = Block(c, c, emb_ch, attention=True)
                self.dec[f"r{res}_in1"] = Block(c, c, emb_ch)
            else:
                self.dec[f"r{res}_up"] = Block(c, c, emb_ch, up=True)
            for i in range(num_blocks + 1):
                cin = c + skips.pop()
                c = model_channels * mult
                self.dec[f"r{res}_block{i}"] = Block(
                    cin, c, emb_ch, attention=(i == num_blocks and res in attn_resolutions)
                )
        self.out_norm = _norm(c)
        self.out_conv = nn.Conv2d(c, img_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.map_noise(c_noise)
        emb = emb.reshape(emb.shape[0], 2, -1).flip(1).reshape(emb.shape)  # sines first
        if self.map_label is not None and class_labels is not None:
            emb = emb + self.map_label(class_labels * math.sqrt(self.map_label.in_features))
        emb = F.silu(self.map_layer1(F.silu(self.map_layer0(emb))))
        skips = []
        for block in self.enc.values():
            x = block(x, emb) if isinstance(block, Block) else block(x)
            skips.append(x)
        for block in self.dec.values():
            if x.shape[1] != block.c_in:
                x = torch.cat([x, skips.pop()], dim=1)
            x = block(x, emb)
        return self.out_conv(F.silu(self.out_norm(x)))


class Precond(nn.Module):
    """EDM's preconditioning around :class:`DDPMpp` (Karras et al. 2022, Table 1), ``sigma_data = 0.5``:
    ``D(x; s) = c_skip x + c_out F(c_in x; ln(s) / 4, labels)``. Same call as NVIDIA's ``EDMPrecond``
    (``x [b, C, R, R]``, ``sigma [b]``, one-hot ``class_labels [b, label_dim]``), so
    :class:`specsamp.models.edm.EDMVelocity` drives it like a loaded checkpoint. The network runs in
    float32 (or under the caller's autocast); the output is float32.
    """

    def __init__(self, model: DDPMpp, img_resolution: int, img_channels: int, label_dim: int, sigma_data: float = 0.5):
        super().__init__()
        self.model = model
        self.img_resolution, self.img_channels, self.label_dim = img_resolution, img_channels, label_dim
        self.sigma_data = sigma_data

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        x = x.float()
        s = sigma.float().reshape(-1, 1, 1, 1)
        sd = self.sigma_data
        c_skip = sd**2 / (s**2 + sd**2)
        c_out = s * sd / (s**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + s**2).sqrt()
        f = self.model(c_in * x, s.reshape(-1).log() / 4, class_labels)
        return c_skip * x + c_out * f.float()


def ddpmpp_cifar10(seed: int = 0, tiny: bool = False) -> Precond:
    """EDM's class-conditional CIFAR-10 network (DDPM++ layout, 55.7M parameters), random weights from ``seed``.

    ``tiny=True``: the same layout at 16 base channels, one block per level (a CPU rehearsal of the code path).
    """
    torch.manual_seed(seed)
    kw = dict(model_channels=16, num_blocks=1) if tiny else {}
    return Precond(DDPMpp(32, 3, 10, **kw), 32, 3, 10).eval()
