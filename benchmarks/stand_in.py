"""Networks of realistic size with random weights, built offline (diffusers ``UNet2DModel``).

They time a target call and everything around it faithfully; their acceptance rates (hence NFE
counts) are not a trained model's. The diffusers presets only approximate EDM's layouts; the preset
``ddpmpp-cifar10`` is EDM's CIFAR-10 network itself (:mod:`benchmarks.ddpmpp`, plain torch, 55.7M
parameters). Importing this module needs torch alone; diffusers is imported when a diffusers preset
is built.
"""

from __future__ import annotations

import torch

STAND_INS = {
    # DDPM++-like widths for CIFAR-10 32x32 (EDM: model_channels=128, channel_mult=[2,2,2], 4 blocks,
    # attention at 16x16): ~59M parameters vs ~56M for EDM's DDPM++ CIFAR-10 net
    "cifar10": dict(
        sample_size=32,
        block_out_channels=(256, 256, 256),
        layers_per_block=4,
        label_dim=10,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    ),
    # a ~36M-parameter CIFAR-sized net (2 blocks per level), cheaper on CPUs
    "cifar35m": dict(
        sample_size=32,
        block_out_channels=(256, 256, 256),
        layers_per_block=2,
        label_dim=10,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    ),
    # FFHQ 64x64 (EDM: channel_mult=[1,2,2,2], attention at 16x16), ~59M vs ~62M
    "ffhq64": dict(
        sample_size=64,
        block_out_channels=(128, 256, 256, 256),
        layers_per_block=4,
        label_dim=0,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    ),
    "tiny": dict(
        sample_size=4,
        block_out_channels=(8, 8),
        layers_per_block=1,
        label_dim=10,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    ),
}


class StandInPrecond(torch.nn.Module):
    """EDM preconditioning (Karras et al. 2022, Table 1) around a diffusers ``UNet2DModel``.

    ``D(x; s) = c_skip x + c_out F(c_in x; c_noise, label)`` with ``sigma_data = 0.5``; the forward
    signature is ``EDMPrecond``'s (``x [b, C, H, W]``, ``sigma [b]``, one-hot ``class_labels [b, label_dim]``).

    Args:
        preset: a key of :data:`STAND_INS`.
        sigma_data: EDM's data scale.
        seed: seed of the random weights.

    Raises:
        ValueError: unknown preset.
    """

    def __init__(self, preset: str = "cifar10", sigma_data: float = 0.5, seed: int = 0):
        super().__init__()
        from diffusers import UNet2DModel

        if preset not in STAND_INS:
            raise ValueError(f"preset={preset!r} is invalid; valid: {sorted(STAND_INS)}")
        cfg = dict(STAND_INS[preset])
        self.label_dim = int(cfg.pop("label_dim"))
        self.img_resolution = int(cfg["sample_size"])
        self.img_channels = 3
        self.sigma_data = float(sigma_data)
        torch.manual_seed(seed)
        self.unet = UNet2DModel(in_channels=3, out_channels=3, num_class_embeds=self.label_dim or None, **cfg)

    def forward(self, x, sigma, class_labels=None, **kwargs):
        x = x.to(torch.float32)
        s = sigma.to(torch.float32).reshape(-1, 1, 1, 1)
        sd = self.sigma_data
        c_skip = sd**2 / (s**2 + sd**2)
        c_out = s * sd / (s**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + s**2).sqrt()
        c_noise = s.reshape(-1).log() / 4
        labels = class_labels.argmax(1) if (self.label_dim and class_labels is not None) else None
        f = self.unet(c_in * x, c_noise, class_labels=labels).sample
        return c_skip * x + c_out * f.to(torch.float32)


DDPMPP = "ddpmpp-cifar10"  # EDM's CIFAR-10 layout (benchmarks.ddpmpp), no diffusers


def stand_in_velocity(preset: str = "cifar10", device="cpu", net_dtype=None, seed: int = 0):
    """The stand-in behind :class:`specsamp.models.edm.EDMVelocity` (the sampler's interface); returns ``(model, params)``.

    ``preset``: a key of :data:`STAND_INS` (diffusers) or ``"ddpmpp-cifar10"`` (plain torch).

    Raises:
        ValueError: an unknown preset.
    """
    from specsamp.models.edm import EDMVelocity

    if preset == DDPMPP:
        from benchmarks.ddpmpp import ddpmpp_cifar10

        net = ddpmpp_cifar10(seed=seed)
    else:
        net = StandInPrecond(preset, seed=seed).eval()
    params = sum(q.numel() for q in net.parameters())
    return EDMVelocity(net, net_dtype=net_dtype, device=torch.device(device)), params
