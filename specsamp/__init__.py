"""specsamp: exact speculative sampling of diffusion models with draft trees.

The core imports with torch, numpy and scipy only (``tests/core/test_standalone.py`` holds it to that):
:mod:`~specsamp.coupling` (the :class:`Coupling` contract, RMC, D-GRS and the registry; the GRS scalar
machinery in :mod:`~specsamp.grs`), :mod:`~specsamp.listcoupling` (markmax; its parameters in
:mod:`~specsamp.markmax_params`), :mod:`~specsamp.theory`, :mod:`~specsamp.trees`,
:mod:`~specsamp.treesearch`, :mod:`~specsamp.schedule`, :mod:`~specsamp.rng`, :mod:`~specsamp.drafts`,
:mod:`~specsamp.sampler` (the samplers; their rounds in :mod:`~specsamp.round.sparse` and :mod:`~specsamp.round.dense`,
what those share in :mod:`~specsamp.round.context`, the result in :mod:`~specsamp.result`),
:mod:`~specsamp.batching` and :mod:`~specsamp.testing` (the exactness test of a coupling). Importing
``specsamp`` loads only the core; the model adapters (:mod:`~specsamp.models`) and the command-line runner
(:mod:`~specsamp.runner`) load when imported. The protocol they implement: ``docs/protocol.md``.
"""

__version__ = "0.1.0"

from . import coupling, drafts, listcoupling, schedule, theory, trees  # noqa: E402,F401
from .coupling import COUPLINGS, Coupling, Verdict, register_coupling  # noqa: E402,F401
from .sampler import sample_speculative, sample_standard  # noqa: E402,F401
from .schedule import Schedule  # noqa: E402,F401
from .trees import DraftTree  # noqa: E402,F401
