"""Split one large sampling job into shards by trajectory index, and merge the shards back.

A job with ``num_shards=S`` and ``shard=k`` runs one contiguous block of the trajectory ids
``0 .. n_samples-1`` (see :func:`~specsamp.runner.jobs.shard_indices`) and writes, atomically, ``shard.pt`` (its samples and
per-trajectory statistics) and then ``result.json`` (the statistics of its block). Sweep over ``shard``
to run every block as its own job::

    python run.py -m sweep_name=fid_cifar10 n_samples=50000 batch_size=500 num_shards=8 'shard=range(8)'
    python -m specsamp.runner.shards merge multirun/fid_cifar10

``merge`` groups the shard files under a directory by their unsharded configuration, checks that every
shard ``0 .. S-1`` of a group is present (a missing one is named and the group is left unmerged), and
writes ``samples.pt``, the shards' images (``images/``, hard-linked where possible, and ``grid.png``) and
``result.json`` of the whole run into the directory an unsharded job of the
same sweep would use (the one its overrides, those of the shards without ``num_shards``/``shard``, name:
:func:`specsamp.runner.jobs.job_dirname`). The merged record
has the configuration hash of the unsharded run, so a later unsharded launch finds it and skips. Score
the merged run with ``python -m specsamp.metrics.fid MERGED_DIR --ref REF`` (its images, or its
``samples.pt`` when no shard saved images).

Trajectory ``i``'s randomness is keyed by ``(seed, i)``, so the merged samples are those of one
unsharded run. They are equal *bitwise* when every batch is the same in both runs: with ``batch_size``
set, shards are cut at batch boundaries, so that holds. With ``batch_size=null`` (one batch per job)
the shards' batches are smaller than the unsharded run's, and BLAS may round a matrix product of
another shape differently in the last bit (~1e-16 relative); the law is unaffected.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..io import torch_save_atomic, write_json_atomic
from .jobs import RESULT as RESULT_FILE, SHARD as SHARD_FILE, job_dirname, shard_indices  # noqa: F401 (shard_indices: its former home)

SAMPLES_FILE = "samples.pt"
SHARD_KEYS = ("shard", "num_shards")


def unsharded_config(cfg: Mapping) -> dict:
    """The config of the whole run a shard belongs to: ``cfg`` without ``shard`` and ``num_shards``."""
    return {k: v for k, v in cfg.items() if k not in SHARD_KEYS}


def save_shard(out_dir: str | os.PathLike, result, indices: Sequence[int], record: Mapping) -> Path:
    """Write one shard's samples and per-trajectory statistics atomically to ``out_dir/shard.pt``.

    Args:
        out_dir: the shard job's output directory.
        result: its :class:`specsamp.sampler.SampleResult`.
        indices: the trajectory ids it ran, in the order of ``result``'s rows.
        record: its record (``config``, ``config_hash``, ``wall_seconds``, ... are kept).

    Returns:
        The path written.
    """
    import torch

    data = {name: getattr(result, name).detach().cpu() for name in result.PER_TRAJECTORY}
    data["indices"] = torch.as_tensor(list(indices), dtype=torch.long)
    data["speculative_steps"] = int(result.speculative_steps)
    data["batch_speedups"] = [float(b) for b in result.extra.get("batch_speedups", [result.batch_speedup])]
    data["record"] = json.dumps(record, default=str)  # JSON text: loadable with weights_only=True
    path = Path(out_dir) / SHARD_FILE
    torch_save_atomic(path, data)
    return path


def load_shard(path: str | os.PathLike) -> dict:
    """Read a ``shard.pt`` written by :func:`save_shard` (tensors and plain Python values only)."""
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    data["record"] = json.loads(data["record"])
    return data


def _job_overrides_of(job: Path) -> tuple[list[str], list[str]] | None:
    """``(task overrides, override_dirname exclude keys)`` of a job directory, from Hydra's ``.hydra/``."""
    try:
        from omegaconf import OmegaConf

        overrides = [str(o) for o in OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "overrides.yaml"))]
        hydra_cfg = OmegaConf.load(job / ".hydra" / "hydra.yaml")
        exclude = OmegaConf.select(hydra_cfg, "hydra.job.config.override_dirname.exclude_keys", default=[]) or []
        return overrides, [str(k) for k in exclude]
    except Exception:
        return None


def _is_shard_key(line: str) -> bool:
    return line.partition("=")[0].lstrip("+~") in SHARD_KEYS


def merged_dir_for(shard_dir: Path) -> Path | None:
    """Where an unsharded job of the same sweep writes: the directory its overrides name
    (:func:`specsamp.runner.jobs.job_dirname` of the shard's overrides without ``num_shards``/``shard``).

    ``multirun/x/K=2,num_shards=4,shard=1`` -> ``multirun/x/K=2``; ``.../num_shards=4,shard=1`` -> ``multirun/x``.
    None when the job has no ``shard=`` override (not a directory named by its overrides).
    """
    found = _job_overrides_of(shard_dir)
    if found is None:  # no .hydra/: a plain directory named like Hydra names plain overrides
        name = shard_dir.name
        if not re.search(r"(^|,)shard=", name):
            return None
        rest = re.sub(r"(^|,)(num_shards|shard)=[^,]*", "", name).strip(",")
        return shard_dir.parent / rest if rest else shard_dir.parent
    overrides, exclude = found
    if not any(_is_shard_key(o) for o in overrides):
        return None
    name = job_dirname([o for o in overrides if not _is_shard_key(o)], exclude)
    return shard_dir.parent / name if name else shard_dir.parent


@dataclass
class ShardGroup:
    """The shards found for one unsharded configuration."""

    config_hash: str
    num_shards: int
    found: dict[int, Path] = field(default_factory=dict)  # shard -> its job directory

    @property
    def missing(self) -> list[int]:
        """Shard numbers with no ``shard.pt`` + ``result.json`` yet."""
        return [k for k in range(self.num_shards) if k not in self.found]

    def target_dir(self, root: Path) -> Path:
        """The merged run's directory (see :func:`merged_dir_for`; ``root/merged-HASH`` otherwise)."""
        dirs = {merged_dir_for(d) for d in self.found.values()}
        if len(dirs) == 1 and None not in dirs:
            return dirs.pop()
        return root / f"merged-{self.config_hash}"

    def expected_dir(self, k: int) -> str:
        """A best guess of shard ``k``'s directory, for messages."""
        d = next(iter(self.found.values()))
        found = _job_overrides_of(d)
        if found is not None:
            overrides, exclude = found
            swapped = [f"shard={k}" if o.partition("=")[0].lstrip("+~") == "shard" else o for o in overrides]
            if swapped != overrides:
                return str(d.parent / job_dirname(swapped, exclude))
        name = re.sub(r"(^|,)shard=[^,]*", lambda m: f"{m.group(1)}shard={k}", d.name)
        return str(d.parent / name) if name != d.name else f"a job with shard={k} num_shards={self.num_shards}"


def find_shards(root: str | os.PathLike) -> list[ShardGroup]:
    """Group every finished shard under ``root`` (``shard.pt`` next to an ok ``result.json``).

    Raises:
        FileNotFoundError: ``root`` does not exist.
    """
    from .loop import record_hash

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    groups: dict[tuple[str, int], ShardGroup] = {}
    for path in sorted(root.rglob(SHARD_FILE)):
        job = path.parent
        try:
            rec = json.loads((job / RESULT_FILE).read_text())
        except (OSError, ValueError):
            continue  # written shard.pt, killed before result.json: not finished
        if rec.get("status") != "ok" or "config" not in rec:
            continue
        cfg = rec["config"]
        n = int(cfg.get("num_shards", 1))
        h = record_hash(unsharded_config(cfg))[2]
        g = groups.setdefault((h, n), ShardGroup(h, n))
        g.found[int(cfg.get("shard", 0))] = job
    return list(groups.values())


def _pad_cat(tensors: list):
    """Concatenate ``[M_i, R_i]`` tensors along rows, zero-padding columns to the widest."""
    import torch

    width = max(t.shape[1] for t in tensors)
    out = [torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], 1) for t in tensors]
    return torch.cat(out)


def merge_group(group: ShardGroup, out_dir: Path) -> dict:
    """Merge a complete group into ``out_dir`` (``samples.pt``, the images, then ``result.json``; each atomic).

    The record is built by :func:`specsamp.runner.records.make_record`, the function that builds an
    unsharded run's record, over the concatenated per-trajectory arrays: the same keys (``unused``, the
    tree's fields, ``calibration`` included) and the same statistics over all trajectories.
    ``wall_seconds`` is the sum over shards, ``batch_speedup`` the mean over every shard's batches; its job
    fields (:class:`~specsamp.runner.records.Job`) are the merged directory, ``merged_from`` (the shards'
    directories), the shards' overrides without ``num_shards``/``shard``, and their sweep.

    Returns:
        The merged record.

    Raises:
        ValueError: the group is incomplete or its shards disagree (ids not a partition of ``0..n-1``).
    """
    import torch

    from ..sampler import SampleResult
    from .loop import prepare
    from .records import TREE_FIELDS, Job, Sampled, make_record

    if group.missing:
        raise ValueError(f"shards {group.missing} of {group.num_shards} are missing")
    parts = [load_shard(group.found[k] / SHARD_FILE) for k in range(group.num_shards)]
    ids = torch.cat([p["indices"] for p in parts])
    base = unsharded_config(parts[0]["record"]["config"])
    n = int(base["n_samples"])
    if not torch.equal(ids, torch.arange(n)):
        raise ValueError(
            f"the shards' trajectory ids are not 0..{n - 1} in order; were they run with different batch_size?"
        )
    cat = {
        name: torch.cat([p[name] for p in parts]) for name in ("samples", "nfe", "nfe_total", "target_rows", "rounds")
    }
    merged = SampleResult(
        **cat,
        committed=_pad_cat([p["committed"] for p in parts]),
        attempts=torch.cat([p["attempts"] for p in parts]),
        accepts=torch.cat([p["accepts"] for p in parts]),
        speculative_steps=parts[0]["speculative_steps"],
    )
    first = parts[0]["record"]
    job = Job(
        str(out_dir.resolve()),
        [o for o in first.get("overrides") or [] if o.partition("=")[0].lstrip("+~") not in SHARD_KEYS],
        merged_from=[str(group.found[k].resolve()) for k in range(group.num_shards)],
        sweep=first.get("sweep"),
    )
    prepared = dataclasses.replace(prepare(base), recorded=base, job=job)  # the shards' own recorded config, as written
    record = make_record(
        prepared,
        Sampled(
            merged,
            [b for p in parts for b in p["batch_speedups"]],
            {k: first[k] for k in TREE_FIELDS if k in first},
            # every shard calibrates alike (same seed, same config); the unsharded run pays one calibration
            calibration=first.get("calibration"),
            wall_seconds=float(sum(p["record"].get("wall_seconds", 0.0) for p in parts)),
            versions=first.get("versions"),
            kernel=first.get("kernel"),
        ),
    )
    torch_save_atomic(out_dir / SAMPLES_FILE, cat["samples"])
    merge_images([group.found[k] for k in range(group.num_shards)], out_dir)
    write_json_atomic(out_dir / RESULT_FILE, record)  # last: a record means every file of the set is there
    return record


IMAGES_DIR = "images"


def merge_images(shard_dirs: Sequence[Path], out_dir: Path) -> int:
    """Gather the shards' ``images/NNNNNN.png`` into ``out_dir/images`` (hard links where the file system
    allows, else copies, each file placed atomically) and write ``out_dir/grid.png`` of the first 64, as an
    unsharded run does. Shards that saved no images contribute none.

    Returns:
        The number of images gathered (0: no shard had images; nothing is written).

    Raises:
        ValueError: two shards hold an image of the same index.
    """
    import shutil

    from .. import images as img

    files = {}
    for d in shard_dirs:
        folder = Path(d) / IMAGES_DIR
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if f.suffix.lower() == ".png" and f.stem.isdigit():
                if f.name in files:
                    raise ValueError(f"image {f.name} is in two shards: {files[f.name].parent} and {folder}")
                files[f.name] = f
    if not files:
        return 0
    dest = out_dir / IMAGES_DIR
    dest.mkdir(parents=True, exist_ok=True)
    for name, src in sorted(files.items()):
        tmp = dest / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dest / name)
    first = sorted(files, key=lambda n: int(Path(n).stem))[:64]
    img.save_grid(img.load_images(dest, indices=[int(Path(n).stem) for n in first]), out_dir / "grid.png")
    return len(files)


@dataclass
class MergeReport:
    """What :func:`merge` did: merged and already-merged directories, and incomplete groups."""

    merged: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    incomplete: list[tuple[ShardGroup, list[int]]] = field(default_factory=list)

    def lines(self) -> list[str]:
        """Human-readable lines, one per group."""
        out = [f"merged: {d}" for d in self.merged] + [f"skipped (already merged): {d}" for d in self.skipped]
        for g, missing in self.incomplete:
            names = "; ".join(f"shard {k} ({g.expected_dir(k)})" for k in missing)
            out.append(
                f"incomplete: {len(g.found)} of {g.num_shards} shards of config {g.config_hash}; missing {names}"
            )
        return out


def merge(root: str | os.PathLike, *, force: bool = False) -> MergeReport:
    """Merge every complete shard group under ``root``; name the missing shards of the others.

    A group whose merged ``result.json`` already exists with the same config hash (and ``samples.pt``)
    is skipped unless ``force``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
    """
    from .records import existing_record

    root = Path(root)
    report = MergeReport()
    for g in find_shards(root):
        if g.missing:
            report.incomplete.append((g, g.missing))
            continue
        out = g.target_dir(root)
        if not force and existing_record(out, g.config_hash) is not None and (out / SAMPLES_FILE).exists():
            report.skipped.append(out)
            continue
        merge_group(g, out)
        report.merged.append(out)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m specsamp.runner.shards merge DIR [--force]``: exit 0 when every group is merged, 1 when a
    shard is missing (named on stderr), 2 on a usage error (no such directory, no shard files)."""
    ap = argparse.ArgumentParser(prog="python -m specsamp.runner.shards", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the finished shards under DIR (a sweep directory)")
    m.add_argument("dir", help="directory holding shard jobs (searched recursively)")
    m.add_argument("--force", action="store_true", help="merge again even when a merged record exists")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: DIR={args.dir!r} is invalid: no such directory.", file=sys.stderr)
        return 2
    try:
        report = merge(root, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not (report.merged or report.skipped or report.incomplete):
        print(
            f"error: DIR={args.dir!r} holds no finished shard ({SHARD_FILE} next to result.json): run the shard jobs "
            "first, e.g. python run.py -m num_shards=4 'shard=range(4)'.",
            file=sys.stderr,
        )
        return 2
    for line in report.lines():
        print(line, file=sys.stderr if line.startswith("incomplete") else sys.stdout)
    return 1 if report.incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
