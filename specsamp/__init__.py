"""specsamp: exact speculative sampling of diffusion models with draft trees.

Core modules (torch/numpy/scipy only): :mod:`~specsamp.coupling` (the :class:`Coupling` contract,
RMC, D-GRS and the registry), :mod:`~specsamp.listcoupling` (markmax), :mod:`~specsamp.theory`,
:mod:`~specsamp.trees`, :mod:`~specsamp.treesearch`, :mod:`~specsamp.schedule`,
:mod:`~specsamp.drafts`, :mod:`~specsamp.sampler`, :mod:`~specsamp.testing` (the exactness test of a
coupling), :mod:`~specsamp.models`. The protocol they implement: ``docs/protocol.md``.
"""

__version__ = "0.1.0"

from . import coupling, drafts, listcoupling, schedule, theory, trees  # noqa: E402,F401
from .coupling import COUPLINGS, Coupling, Verdict, register_coupling  # noqa: E402,F401
from .sampler import sample_speculative, sample_standard  # noqa: E402,F401
from .schedule import Schedule  # noqa: E402,F401
from .trees import DraftTree  # noqa: E402,F401
