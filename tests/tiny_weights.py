"""Small weight files for the metrics' real networks, written offline where their libraries look.

- :func:`write_tiny_inception`: torch-fidelity's ``inception-v3-compat`` state dict under the real file
  name in the torch hub cache (``$TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth``),
  so torch-fidelity loads it as it would the downloaded file. Every tensor has the real shape but is a
  strided view of a short random storage (the file keeps only the storages: about 2 MB instead of
  95 MB); ``load_state_dict`` copies the views into the real network. The network is the real
  Inception graph (resize to 299, pool3 2048-d features), its weights random.
- :func:`write_tiny_clip`: an open_clip model folder (``open_clip_config.json`` + weights) with a
  one-layer ViT and text tower, random weights, for ``local-dir:`` model names or a ``checkpoint=`` file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"


def _strided_random(shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    """A ``shape`` view whose entries come from a storage of about ``sum(shape)`` random numbers."""
    if len(shape) == 0:
        return torch.randn((), generator=gen) * scale
    strides, acc = [], 1
    for _ in shape:  # small, distinct strides: entries repeat along diagonals, not rows
        strides.append(acc)
        acc = acc + 2
    strides = tuple(reversed(strides))
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    base = torch.randn(size, generator=gen) * scale
    return base.as_strided(tuple(shape), strides)


def tiny_inception_state_dict(seed: int = 0) -> dict:
    """The ``FeatureExtractorInceptionV3`` state dict with He-scaled random conv/linear weights and
    identity batch norms, every tensor a small strided view (:func:`_strided_random`)."""
    from unittest import mock

    import torch_fidelity.feature_extractor_inceptionv3 as inc

    with (
        torch.device("meta"),
        mock.patch.object(inc, "load_state_dict_from_url", lambda *a, **k: {}),
        mock.patch.object(inc.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None),
    ):
        net = inc.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])  # shapes only, nothing allocated
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in net.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("num_batches_tracked"):
            out[name] = torch.zeros((), dtype=torch.long)
        elif name.endswith("running_var") or (name.endswith(".weight") and t.ndim == 1):
            out[name] = torch.ones(1).expand(shape)
        elif name.endswith("running_mean") or name.endswith(".bias"):
            out[name] = torch.zeros(1).expand(shape)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            out[name] = _strided_random(shape, math.sqrt(2.0 / fan_in), gen)
    return out


def write_tiny_inception(torch_home: str | Path, seed: int = 0) -> Path:
    """Write :func:`tiny_inception_state_dict` where torch-fidelity looks: ``torch_home/hub/checkpoints/``
    under the real file name (set ``TORCH_HOME=torch_home`` for the process that scores). Returns the path."""
    path = Path(torch_home) / "hub" / "checkpoints" / INCEPTION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tiny_inception_state_dict(seed), path)
    return path


TINY_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def write_tiny_clip(directory: str | Path, quick_gelu: bool = True, seed: int = 1, config: bool = True) -> Path:
    """An open_clip model folder: ``open_clip_config.json`` (open_clip's hub layout: ``model_cfg`` and
    ``preprocess_cfg``) and ``open_clip_model.safetensors``, a one-layer CLIP with random weights whose
    text projection is flipped so that its scores are mostly positive. ``config=False`` leaves the
    config out (a bare state dict). Returns the weights file."""
    import open_clip
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_cfg = {**TINY_CLIP_CFG, "quick_gelu": quick_gelu}
    name = f"specsamp-tiny-{'quickgelu' if quick_gelu else 'gelu'}"
    if name not in open_clip.list_models():
        (directory / f"{name}.json").write_text(json.dumps(model_cfg))
        open_clip.add_model_config(directory / f"{name}.json")
        (directory / f"{name}.json").unlink()
    torch.manual_seed(seed)
    model = open_clip.create_model(name, pretrained=None)
    with torch.no_grad():
        model.text_projection.mul_(-1)
    weights = directory / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    if config:
        preprocess = {
            "mean": list(open_clip.OPENAI_DATASET_MEAN),
            "std": list(open_clip.OPENAI_DATASET_STD),
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        }
        (directory / "open_clip_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess})
        )
    return weights
