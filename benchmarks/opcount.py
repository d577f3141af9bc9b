"""Counting ATen operations and host synchronisations (a ``TorchDispatchMode``): load-free costs.

Every ATen call made while :class:`OpCounter` is active counts once in :attr:`OpCounter.ops` (calls
made by a kernel's own implementation are not seen: the mode sees what Python asks for). The calls
that make the host wait for a value (:data:`SYNC_OPS`, and indexing with a boolean mask, whose output
shape depends on the mask's values) count in :attr:`OpCounter.syncs` as well. Counts are
deterministic for a fixed program and input shape, so tests can assert them and benchmarks report
them without depending on the machine's load.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
            "is_nonzero", "equal", "masked_select", "item", "allclose", "_assert_async"}


def _is_mask_index(func, args) -> bool:
    if func.__name__.split(".")[0] not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    idx = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (idx or ()))


class OpCounter(TorchDispatchMode):
    """Context manager: ``with OpCounter() as c: ...`` then read ``c.ops``, ``c.syncs``, ``c.by_name``."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.by_name: Counter[str] = Counter()
        self.sync_names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.ops += 1
        self.by_name[name] += 1
        if name in SYNC_OPS or _is_mask_index(func, args):
            self.syncs += 1
            self.sync_names[name] += 1
        return func(*args, **(kwargs or {}))
