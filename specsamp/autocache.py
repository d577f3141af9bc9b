"""What ``auto`` keeps between runs (:class:`AutoCache`): cost curves, profiles per root step, host costs and plans,
in the process and in a cache folder, and the keys they are filed under."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .auto import HostCost, Plan, plan_from_json, plan_to_json
from .cost import CostCache
from .profiles import check_profile
from .schedule import Schedule


def model_key(model) -> str:
    """The name a model's curve and profile are cached under: its ``cache_key`` attribute where it has one (the
    k-diffusion driver sets the user's denoiser's class), else its ``name``, else its class's qualified name."""
    key = getattr(model, "cache_key", None) or getattr(model, "name", None)
    return str(key) if key else f"{type(model).__module__}.{type(model).__qualname__}"


def profile_key(key: str, schedule: Schedule, draft: str) -> str:
    """The cache key of a profile: the model's key, the kernel and its options, ``T``, ``eps``, a digest of the grid
    and the draft (a profile measured on one grid says nothing certain of another)."""
    grid = hashlib.sha1(schedule.sigmas.detach().double().cpu().numpy().tobytes()).hexdigest()[:12]
    opts = ",".join(f"{k}={v!r}" for k, v in sorted(schedule.kernel_options.items()))
    return f"{key}|{schedule.kernel_name}({opts})|T={schedule.steps}|eps={schedule.eps!r}|{grid}|{draft}"


class AutoCache:
    """What ``auto`` keeps between runs: cost curves (:class:`specsamp.cost.CostCache`), profiles per root and plans.

    Curves and profiles live in the process and, with ``path`` (a directory), in ``call_costs.json`` and
    ``profiles.json`` there, read at construction and rewritten atomically on each new entry. Plans are kept in the
    process and in ``profiles.json`` too, under a digest of everything a plan is computed from."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.costs = CostCache(self.path / "call_costs.json" if self.path is not None else None)
        self.profiles: dict[str, list[list[float]]] = {}
        self.hosts: dict[str, HostCost] = {}
        self.pilot_hosts: dict[str, list[float]] = {}  # [seconds a round outside the network, drafted states]
        self.plans: dict[str, Plan] = {}
        if self.path is not None and (self.path / "profiles.json").is_file():
            try:
                data = json.loads((self.path / "profiles.json").read_text())
            except (OSError, ValueError):
                data = {}  # an unreadable cache is a miss: the pilot runs again
            data = data if isinstance(data, dict) else {}
            for k, rows in (data.get("profiles") or {}).items():
                try:
                    self.profiles[k] = [[float(d) for d in check_profile(r)] for r in rows]
                except (TypeError, ValueError):
                    continue
            for k, h in (data.get("hosts") or {}).items():
                try:
                    self.hosts[k] = HostCost(*(float(v) for v in h))
                except (TypeError, ValueError):
                    continue
            for k, v in (data.get("pilot_hosts") or {}).items():
                if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
                    self.pilot_hosts[k] = [float(v[0]), float(v[1])]
            for k, plan in (data.get("plans") or {}).items():
                try:
                    self.plans[k] = plan_from_json(plan)
                except (KeyError, TypeError, ValueError):
                    continue

    def put_profile(self, key: str, rows: list[list[float]], host: tuple[float, float] | None = None) -> None:
        """Keep a piloted profile, and the host seconds a pilot's round took at its drafted states, in the process
        and the file."""
        self.profiles[key] = rows
        if host is not None:
            self.pilot_hosts[key] = [float(host[0]), float(host[1])]
        self._write()

    def put_plan(self, key: str, plan: Plan) -> None:
        """Keep a plan, in the process and the file (a later run with the same inputs searches nothing)."""
        self.plans[key] = plan
        self._write()

    def put_host(self, key: str, host: HostCost) -> None:
        """Keep a measured host cost, in the process and the file."""
        self.hosts[key] = host
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = self.path / f"profiles.json.{os.getpid()}.tmp"  # one per process: no two write one file
            hosts = {k: [h.fixed, h.per_row, h.loop_step] for k, h in self.hosts.items()}
            plans = {k: plan_to_json(p) for k, p in self.plans.items()}
            data = {"profiles": self.profiles, "hosts": hosts, "pilot_hosts": self.pilot_hosts, "plans": plans}
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self.path / "profiles.json")


_PROCESS_CACHE: dict[str, AutoCache] = {}


def default_cache(persist: bool = False) -> AutoCache:
    """The process's cache: file-backed in ``$SPECSAMP_CACHE_DIR`` when that is set; else, with ``persist`` (what
    ``run.py`` asks), in ``$XDG_CACHE_HOME/specsamp/auto`` (``~/.cache/specsamp/auto``); else in memory only."""
    where = os.environ.get("SPECSAMP_CACHE_DIR", "")
    if not where and persist:
        where = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specsamp" / "auto")
    if where not in _PROCESS_CACHE:
        _PROCESS_CACHE[where] = AutoCache(where or None)
    return _PROCESS_CACHE[where]
