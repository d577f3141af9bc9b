"""Finished batches of a sweep job, kept in its directory so that an interrupted job continues where it stopped.

A run with more than one batch (``batch_size`` below ``n_samples``, or below a shard's block) writes each
finished batch atomically to ``batches/<first id>-<last id>.pt`` in its job directory: its trajectory
ids, the per-trajectory arrays of its :class:`~specsamp.sampler.SampleResult` and ``batch_nfe``, with
the config hash (and ``max_batch``) it was computed under. When the job runs again (a requeue after
SLURM's time-limit or preemption signal, a relaunch after a kill), :func:`specsamp.runner.loop.sample`
takes every batch whose file matches the hash, the ``max_batch`` and the exact ids from disk and samples
only the others. Trajectory ``i``'s randomness is keyed by ``(seed, i)`` and a batch is the same set of
ids in both attempts, so the resumed run's counts and samples are bitwise those of an uninterrupted one
(docs/architecture.md, "What is equal across splits"); nothing is counted twice, since each batch enters the record once,
from its file or from the sampler. The files are removed once ``result.json`` is written.

While such a run samples, :func:`active` returns its store, so that the SLURM launcher's signal handler
knows that the job can resume (and requeues it through submitit's checkpointing) rather than restart.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ..io import torch_save_atomic
from ..result import SampleResult

BATCHES = "batches"  # the directory, inside the job's, of its finished batches
_PER_TRAJECTORY = SampleResult.PER_TRAJECTORY
_PER_ROOT = SampleResult.PER_ROOT

_ACTIVE: BatchStore | None = None


def active() -> BatchStore | None:
    """The store of the batch-wise run sampling in this process now, or None (one batch, or not sampling)."""
    return _ACTIVE


class BatchStore:
    """The finished batches of one job, under ``out_dir/batches/``.

    Args:
        out_dir: the job's directory.
        config_hash: the run's config hash (:func:`specsamp.runner.records.config_hash`); a file written
            under another hash is not used (and is overwritten when its batch is sampled again).
    """

    def __init__(self, out_dir: str | Path, config_hash: str) -> None:
        self.dir = Path(out_dir) / BATCHES
        self.key = {"config_hash": str(config_hash)}
        self.total = 0  # batches of the run (set by :meth:`running`)
        self.loaded = 0  # batches taken from disk in this attempt
        self.saved = 0  # batches sampled and written in this attempt

    def path(self, ids: torch.Tensor) -> Path:
        """``batches/<first>-<last>.pt`` of the batch of trajectory ids ``ids`` (``[b]`` int64)."""
        return self.dir / f"{int(ids[0]):09d}-{int(ids[-1]):09d}.pt"

    def finished(self) -> int:
        """Batch files on disk now (of any attempt)."""
        return len(list(self.dir.glob("*.pt"))) if self.dir.is_dir() else 0

    @contextlib.contextmanager
    def running(self, total: int, **key) -> Iterator[BatchStore]:
        """While the batch loop of a run of ``total`` batches runs: :func:`active` returns this store.

        Args:
            total: the run's number of batches.
            **key: further values a file must match (``max_batch``: the model's evaluation chunks change
                the rounding of its batched products).
        """
        global _ACTIVE
        self.total = int(total)
        self.key.update({k: (None if v is None else int(v) if isinstance(v, int) else str(v)) for k, v in key.items()})
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    def load(self, ids: torch.Tensor):
        """The :class:`~specsamp.sampler.SampleResult` of the batch ``ids`` (``[b]`` int64, on the run's device)
        if its file exists with the same key and ids, else None (also for a file torch cannot read)."""
        path = self.path(ids)
        if not path.is_file():
            return None
        try:
            data = torch.load(path, map_location=ids.device, weights_only=True)
        except Exception:  # noqa: BLE001 (another torch version, a foreign file): sample the batch again
            return None
        if data.get("key") != self.key or not torch.equal(data["ids"].to(ids.device), ids):
            return None
        self.loaded += 1
        return SampleResult(
            **{n: data[n] for n in _PER_TRAJECTORY},
            speculative_steps=int(data["speculative_steps"]),
            batch_nfe=int(data["batch_nfe"]),
            **{n: data.get(n) for n in _PER_ROOT},
        )

    def save(self, ids: torch.Tensor, result) -> Path:
        """Write the batch ``ids``'s ``result`` atomically (the old file, if any, is replaced whole).

        Raises:
            OSError: the file cannot be written (full disk, read-only directory).
        """
        data = {n: getattr(result, n).detach() for n in _PER_TRAJECTORY}
        data.update({n: getattr(result, n).detach() for n in _PER_ROOT if getattr(result, n, None) is not None})
        data.update(
            ids=ids.detach(),
            key=dict(self.key),
            speculative_steps=int(result.speculative_steps),
            batch_nfe=int(result.batch_nfe),
        )
        path = self.path(ids)
        torch_save_atomic(path, data)
        self.saved += 1
        return path

    def clear(self) -> None:
        """Remove ``batches/`` (once the job's record is written)."""
        shutil.rmtree(self.dir, ignore_errors=True)
