"""The compiled round's pieces are capturable: each traces into one graph, with no graph break.

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so a piece it captures must have static shapes
and must not make the host wait for a value (``item()``, a boolean mask, ``nonzero``): under TorchDynamo each of
these is a graph break. Here every piece of :class:`specsamp.round.compiled.Stages` (the drafting, a verification
chunk, the walk and commit) is handed to ``torch._dynamo.explain`` at its first call of a run (``torch.compile``
recorded, not applied: nothing is built by inductor), for RMC on a chain of 4 and D-GRS on the (2, 3) tree of the
law tests' Gaussian mixture (``dim=4``, 3 components, ``Schedule.make(8, 1.0)``), and the chain drafted in closed form
(``draft_form="closed"``), 4 trajectories, seed 3: one graph each, no break. Skipped, as the other compile tests,
where this machine cannot compile.
"""

from __future__ import annotations

import pytest
import torch

from specsamp import inductor, sampler
from specsamp.models import GaussianMixture
from specsamp.round import compiled
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

needs_inductor = pytest.mark.skipif(
    inductor.unavailable("cpu") is not None, reason=f"torch.compile unavailable: {inductor.unavailable('cpu')}"
)


@needs_inductor
@pytest.mark.parametrize(
    "coupling,K,L,form",
    [("rmc", 1, 4, "loop"), ("dgrs", 2, 3, "loop"), ("rmc", 1, 4, "closed")],
    ids=["rmc-chain4", "dgrs-2x3", "rmc-chain4-closed"],
)
def test_compiled_round_pieces_trace_without_graph_breaks(monkeypatch, coupling, K, L, form):
    explained = {}

    def explain_first(fn, **kw):
        def call(*args, **kwargs):
            if fn.__name__ not in explained:  # the piece runs under explain (its side effects are the round's own)
                explained[fn.__name__] = torch._dynamo.explain(fn)(*args, **kwargs)
            return fn(*args, **kwargs)  # then as the round runs it: the same inputs, so the same outputs

        return call

    monkeypatch.setattr(compiled, "ROUND", {})
    monkeypatch.setattr(torch, "compile", explain_first)
    model, sch = GaussianMixture(dim=4, components=3, layout_seed=1), Schedule.make(8, 1.0)
    tree = DraftTree.uniform(K, L)
    sampler.sample_speculative(model, sch, tree, coupling, 4, seed=3, execution="tree", compile=True, draft_form=form)
    assert sorted(explained) == ["draft", "finish", "verify_chunk"]
    for name, ex in explained.items():
        assert ex.graph_count == 1 and ex.graph_break_count == 0, (name, ex.break_reasons)
