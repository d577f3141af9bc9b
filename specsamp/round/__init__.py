"""The round of Algorithm 1 (lines 3--24) and the loop over rounds: what :mod:`specsamp.sampler` runs.

- :mod:`~specsamp.round.context`: the run's frozen :class:`Context`, the batch between rounds (:class:`Chains`), the
  counts (:class:`Tally`) and the round's policy both layouts share (masks, prefetch, commit);
- :mod:`~specsamp.round.loop`: the first step, the loop over rounds (:func:`run_rounds`), the last step;
- :mod:`~specsamp.round.layouts`: the loop's two layouts (:class:`DenseLayout`, :class:`SparseLayout`);
- :mod:`~specsamp.round.dense`: the dense round (the tree execution) as an object, :class:`DenseRound`, over a tree's
  dense tables (:mod:`~specsamp.round.tables`);
- :mod:`~specsamp.round.sparse`: the sparse round (the path execution) and the checked walk;
- :mod:`~specsamp.round.draws`: every keyed draw of a round, both layouts;
- :mod:`~specsamp.round.compiled`: the dense round under ``torch.compile``.

Design: ``docs/architecture.md``.
"""

from .compiled import compiled_round, for_compile
from .context import Chains, Context, Tally, Velocity, build_context
from .layouts import DenseLayout, SparseLayout
from .loop import first_step, initial_noise, initial_state, run_rounds

__all__ = [
    "Chains",
    "Context",
    "DenseLayout",
    "SparseLayout",
    "Tally",
    "Velocity",
    "build_context",
    "compiled_round",
    "first_step",
    "for_compile",
    "initial_noise",
    "initial_state",
    "run_rounds",
]
