"""CPU benchmarks of specsamp: ``python -m benchmarks.bench [--full] [--json PATH]`` (``make bench``).

Sections, each printed as soon as it is measured (timings are best-of-``repeats``
``time.perf_counter`` on one torch thread; nothing here is asserted anywhere):

1. **overhead**: sampler work per speculative round (drafting, noise, coupling, prefetch,
   bookkeeping; the network excluded) as a fraction of one batched network call, at B = 14, 62, 155
   (:mod:`benchmarks.overhead_tables`). The network is a parameter: :func:`benchmarks.overhead_tables.overhead_table`
   takes any velocity model; here the CIFAR-sized stand-in of :mod:`benchmarks.stand_in`.
2. **scaling**: per-round sampler cost against the state dimension (500, 3072, 16384) and the budget
   (14, 340), for the ``path`` and ``tree`` executions.
3. **grid**: section 5.1 cells (d = 500, T = 30, eps = 0.1, 100 trajectories) in our sampler and in the
   plain numpy implementation of the same lazy protocol (:mod:`benchmarks.numpy_lazy`): seconds per cell
   and their ratio, and both mean speedups (equal in law, not bit for bit).
4. **memory**: peak memory of a B = 155 round and of one coupling call (:mod:`benchmarks.memory`).
5. **coupling**: parent nodes per second of D-GRS (K = 7) and RMC at SD3's latent size (16x64x64).
6. **opcount** (load-free): ATen operations and host synchronisations per round outside the network,
   the coupling's own counted apart, per arm (standard; D-GRS (2,3), (2,5); RMC chains 14 and 62; the
   ``x0`` draft with the optimal tree at B = 14 and 62 from the shipped profiles; ``x0_extrap_gated`` with a
   tree per root step at B = 14), tree execution, at
   1 and 16 trajectories, on the digits network and the GMM (:mod:`benchmarks.opcount`); where
   ``torch.compile`` works here, also every speculative arm under ``compile=true`` at one image on the
   digits network (a fused kernel launch counted as one operation).
7. **compile**: where ``torch.compile`` works here, wall clock of ``compile=true`` against eager on the mixture at
   5,000 trajectories (d = 2, T = 8, D-GRS (2,3), tree execution, one thread), each arm in a fresh process: eager;
   compiled into an empty inductor cache (first run, which compiles, and second run); compiled from the warm
   cache; each with its ratio to eager and the CPU's model (:mod:`benchmarks.compile_batch`; about 2 minutes).

The default sizes run in about five minutes under 2 GB; ``--full`` runs every grid cell, 16
trajectories in the scaling table and a 1024-node coupling batch (several GB, several minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.common import best_of, in_subprocess, peak_rss_mib, table

GRID_QUICK = (("dgrs", 2, 3), ("dgrs", 5, 3), ("dgrs", 6, 6), ("rmc", 2, 3), ("rmc", 5, 3))


def grid_vs_numpy(cells, trajectories: int = 100, progress=print) -> list[dict]:
    """Seconds per section 5.1 cell in specsamp (``path`` execution) and in the numpy baseline."""
    from benchmarks.numpy_lazy import NumpyGMM, run_cell
    from specsamp.models import GaussianMixture
    from specsamp.sampler import sample_speculative
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree, budget

    gmm = GaussianMixture(dim=500, components=5, layout_seed=0, dtype=torch.float64)
    base = NumpyGMM(gmm.means.cpu().numpy(), gmm.stds.cpu().numpy())
    sch = Schedule.make(30, 0.1)
    rows = []
    for rule, K, L in cells:
        B = budget(K, L)
        tree = DraftTree.uniform(K, L) if rule == "dgrs" else DraftTree.chain(B)
        t_ours, res = best_of(
            lambda r, tree=tree, rule=rule: sample_speculative(
                gmm, sch, tree, rule, trajectories, execution="path", seed=r
            ),
            1,
        )
        t0 = time.perf_counter()
        sp = run_cell(base, 30, 0.1, K, L, rule, trajectories, seed=0)
        t_np = time.perf_counter() - t0
        rows.append(
            {
                "rule": rule,
                "K": K,
                "L": L,
                "budget": B,
                "ours_s": t_ours,
                "numpy_s": t_np,
                "ratio": t_ours / t_np,
                "ours_speedup": float(res.speedup.mean()),
                "ours_sem": float(res.speedup.std() / trajectories**0.5),
                "numpy_speedup": sp,
            }
        )
        if progress:
            progress(f"  grid {rule} ({K},{L}): ours {t_ours:.2f} s, numpy {t_np:.2f} s")
    tot_o, tot_n = sum(r["ours_s"] for r in rows), sum(r["numpy_s"] for r in rows)
    rows.append(
        {"rule": "all", "K": "", "L": "", "budget": "", "ours_s": tot_o, "numpy_s": tot_n, "ratio": tot_o / tot_n}
    )
    return rows


def coupling_throughput(n: int, K: int = 7, event=(16, 64, 64), repeats: int = 2, seed: int = 0) -> list[dict]:
    """Parent nodes per second of one batched D-GRS (``K`` children) and RMC (first child) verification, float32."""
    from specsamp import rng
    from specsamp.coupling import dgrs, rmc

    g = torch.Generator().manual_seed(seed)
    sigma = 0.05
    mean_p = torch.randn(n, *event, generator=g)
    d = torch.randn(n, *event, generator=g)
    d /= torch.linalg.vector_norm(d.reshape(n, -1), dim=1).reshape(-1, *([1] * len(event)))
    mean_q = mean_p + sigma * 1.5 * d
    del d
    kids = torch.randn(n, K, *event, generator=g).mul_(sigma).add_(mean_p[:, None])
    keys = rng.base_key(seed, torch.arange(n), "verify")
    rows = []
    for name, fn, c in (("dgrs", dgrs, kids), ("rmc", rmc, kids[:, :1])):
        t, v = best_of(lambda r, fn=fn, c=c: fn(c, mean_p, mean_q, sigma, rng.KeyedRows(rng.fold(keys, r))), repeats)
        rows.append(
            {
                "rule": name,
                "K": c.shape[1],
                "n": n,
                "event": "x".join(map(str, event)),
                "seconds": t,
                "nodes_per_s": n / t,
                "acceptance": float(v.accepted.float().mean()),
            }
        )
    return rows


def digits_velocity():
    """The shipped, trained digits denoiser behind the velocity interface, built as ``model=digits`` builds it."""
    from specsamp.runner import build_target, compose, load_config

    return build_target(load_config(compose(["model=digits"]))[0]).model


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="full sizes: every grid cell, bigger batches (several GB)")
    p.add_argument("--preset", default="cifar10", help="stand-in network of the overhead table (benchmarks.stand_in)")
    p.add_argument(
        "--only", default=None, help="comma-separated sections: overhead,scaling,grid,memory,coupling,opcount,compile"
    )
    p.add_argument("--json", default=None, help="also write every row here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    sections = (
        a.only.split(",") if a.only else ["overhead", "scaling", "grid", "memory", "coupling", "opcount", "compile"]
    )
    t0 = time.perf_counter()
    print(
        f"specsamp benchmarks: torch {torch.__version__}, 1 thread, {'full' if a.full else 'default'} sizes", flush=True
    )
    out = {}
    log = lambda s: print(s, flush=True)  # noqa: E731
    if "overhead" in sections:
        from benchmarks.overhead_tables import overhead_table
        from benchmarks.stand_in import stand_in_velocity

        model, params = stand_in_velocity(a.preset)
        name = f"stand-in {a.preset} ({params / 1e6:.0f}M)"
        log(f"[overhead] {name}, 1 trajectory, tree execution; call cost from a 2-row probe")
        out["overhead"] = overhead_table(model, name, trajectories=1, probe=2, progress=log)
        log("[overhead] the trained digits network (model=digits), same protocol")
        out["overhead"] += overhead_table(
            digits_velocity(), "digits (trained, 0.1M)", trajectories=1, probe=2, progress=log
        )
        print(
            table(
                out["overhead"],
                [
                    ("network", "network", "s"),
                    ("budget", "B", "d"),
                    ("overhead_s", "overhead s/round", ".4f"),
                    ("call_s", "network call s", ".2f"),
                    ("fraction", "fraction", ".2e"),
                ],
            ),
            flush=True,
        )
    if "scaling" in sections:
        from benchmarks.overhead_tables import scaling_table

        m = 16 if a.full else 4
        log(f"[scaling] {m} trajectories, proxy target v = -x (excluded), seconds per round")
        out["scaling"] = scaling_table(trajectories=m, progress=log)
        print(
            table(
                out["scaling"],
                [
                    ("dim", "dim", "d"),
                    ("budget", "B", "d"),
                    ("execution", "execution", "s"),
                    ("overhead_s", "s/round", ".4f"),
                    ("rounds", "rounds", "d"),
                ],
            ),
            flush=True,
        )
    if "grid" in sections:
        cells = (
            [(r, K, L) for r in ("rmc", "dgrs") for K in range(1, 8) for L in range(2, 8)]
            if a.full
            else list(GRID_QUICK)
        )
        log(f"[grid] {len(cells)} section 5.1 cells: specsamp (path) vs the numpy baseline")
        out["grid"] = grid_vs_numpy(cells, progress=log)
        print(
            table(
                out["grid"],
                [
                    ("rule", "rule", "s"),
                    ("K", "K", ""),
                    ("L", "L", ""),
                    ("ours_s", "ours s", ".2f"),
                    ("numpy_s", "numpy s", ".2f"),
                    ("ratio", "ours/numpy", ".2f"),
                    ("ours_speedup", "ours speedup", ".3f"),
                    ("numpy_speedup", "numpy speedup", ".3f"),
                ],
            ),
            flush=True,
        )
    if "memory" in sections:
        log("[memory] fresh process per row")
        txt = in_subprocess("benchmarks.memory")
        out["memory"] = txt
        print(txt, end="", flush=True)
    if "coupling" in sections:
        n = 1024 if a.full else 64
        log(f"[coupling] n={n} parent nodes, 16x64x64 float32")
        out["coupling"] = coupling_throughput(n)
        print(
            table(
                out["coupling"],
                [
                    ("rule", "rule", "s"),
                    ("K", "K", "d"),
                    ("n", "n", "d"),
                    ("seconds", "seconds", ".3f"),
                    ("nodes_per_s", "nodes/s", ".1f"),
                    ("acceptance", "acceptance", ".3f"),
                ],
            ),
            flush=True,
        )
    if "opcount" in sections:
        from benchmarks.opcount import COLUMNS, table_rows

        log("[opcount] ATen ops and host syncs per round outside the network (counted, load-free), tree execution")
        out["opcount"] = table_rows(progress=None)
        from specsamp.inductor import unavailable

        if unavailable("cpu") is None:  # the same arms under compile=true, one image on the digits network
            out["opcount"] += table_rows(("digits",), (1,), progress=None, compiled=True)
        print(table(out["opcount"], COLUMNS), flush=True)
    if "compile" in sections:
        from benchmarks.compile_batch import COLUMNS as COMPILE_COLUMNS, N, compile_rows
        from specsamp.inductor import unavailable

        why = unavailable("cpu")
        if why is not None:
            log(f"[compile] skipped: {why}")
        else:
            log(f"[compile] compile=true against eager, the mixture at {N} trajectories, D-GRS (2,3), fresh processes")
            out["compile"] = compile_rows(N, progress=log)
            print(table(out["compile"], COMPILE_COLUMNS), flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s, peak memory {peak_rss_mib():.0f} MiB (this process)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
