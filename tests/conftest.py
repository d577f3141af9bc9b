import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)  # tests/helpers.py
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: experiments/, hydra_plugins/ (our sweeper)

import specsamp.runner.config  # noqa: E402,F401  (Hydra's ConfigStore knows the schemas before any compose)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Small tensors: one intra-op thread avoids OpenMP oversubscription on small CPU machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
