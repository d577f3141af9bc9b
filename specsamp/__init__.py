"""specsamp: exact speculative sampling of diffusion models with draft trees.

Core modules (torch/numpy/scipy only): :mod:`~specsamp.coupling` (RMC, D-GRS and the registry),
:mod:`~specsamp.theory`, :mod:`~specsamp.trees`, :mod:`~specsamp.schedule`, :mod:`~specsamp.drafts`,
:mod:`~specsamp.sampler`, :mod:`~specsamp.models`.
"""

__version__ = "0.1.0"

from . import coupling, drafts, listcoupling, schedule, theory, trees  # noqa: E402,F401
from .coupling import COUPLINGS, Verdict, register_coupling  # noqa: E402,F401
from .sampler import sample_speculative, sample_standard  # noqa: E402,F401
from .schedule import Schedule  # noqa: E402,F401
from .trees import DraftTree  # noqa: E402,F401
