"""A tiny EDM network pickled in NVIDIA's persistence format (``torch_utils.persistence``, version 6), offline.

:data:`TINY_SRC` is the module source stored in the pickle (a ``TinyPrecond`` with EDM's
``forward(x, sigma, class_labels=None, ...)`` signature), :func:`tiny_precond` builds the object without
running that source's ``torch_utils`` import, and :func:`write_persistent_pickle` writes ``{'ema': obj, ...}``
as NVIDIA's checkpoints are written, returning the file's SHA-256 for ``model.sha256``.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import types

import torch

TINY_SRC = """
import torch
from torch_utils import persistence

@persistence.persistent_class
class TinyPrecond(torch.nn.Module):
    def __init__(self, img_resolution=4, img_channels=2, label_dim=0):
        super().__init__()
        self.img_resolution, self.img_channels, self.label_dim = img_resolution, img_channels, label_dim
        self.proj = torch.nn.Linear(img_channels, img_channels)

    def forward(self, x, sigma, class_labels=None, force_fp32=False, **model_kwargs):
        x = x.to(torch.float32)
        s = sigma.to(torch.float32).reshape(-1, 1, 1, 1)
        h = self.proj(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x / (1 + s ** 2) + h * s / (1 + s)
"""


def tiny_precond(img_channels: int = 2, label_dim: int = 0, img_resolution: int = 4):
    """A ``TinyPrecond`` built from a benign copy of :data:`TINY_SRC` (``torch.manual_seed(0)`` first).

    The writer never runs a file's module source; its images are ``[img_channels, img_resolution,
    img_resolution]``, with ``label_dim`` classes (0: unconditional).
    """
    mod = types.ModuleType("_tiny_writer")
    mod.persistence = types.SimpleNamespace(persistent_class=lambda cls: cls)
    exec(TINY_SRC.replace("from torch_utils import persistence", ""), mod.__dict__)
    torch.manual_seed(0)
    return mod.TinyPrecond(img_resolution=img_resolution, img_channels=img_channels, label_dim=label_dim)


def write_persistent_pickle(path, obj, module_src, class_name):
    """Pickle ``{'ema': obj, ...}`` with ``obj`` reduced to ``_reconstruct_persistent_obj(meta)``.

    The global is written by name through a stub ``torch_utils.persistence`` that is present only while
    pickling (whatever was registered under those names before is restored).
    """
    names = ("torch_utils", "torch_utils.persistence")
    saved = {n: sys.modules.get(n) for n in names}

    def _reconstruct_persistent_obj(meta):  # pragma: no cover - never called by the writer
        raise AssertionError

    _reconstruct_persistent_obj.__module__ = "torch_utils.persistence"
    _reconstruct_persistent_obj.__qualname__ = "_reconstruct_persistent_obj"
    pkg, sub = types.ModuleType("torch_utils"), types.ModuleType("torch_utils.persistence")
    sub._reconstruct_persistent_obj = _reconstruct_persistent_obj
    pkg.persistence = sub
    meta = dict(type="class", version=6, module_src=module_src, class_name=class_name, state=dict(obj.__dict__))

    class Writer(pickle.Pickler):
        def reducer_override(self, o):
            return (_reconstruct_persistent_obj, (meta,)) if o is obj else NotImplemented

    sys.modules.update({"torch_utils": pkg, "torch_utils.persistence": sub})
    try:
        with open(path, "wb") as f:
            Writer(f, protocol=4).dump({"ema": obj, "dataset_kwargs": {"resolution": 4}})
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return hashlib.sha256(path.read_bytes()).hexdigest()
