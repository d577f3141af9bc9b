"""One contract per pluggable part: couplings, drafts, tree rules and models each come from a registry
or a ``pkg.module:name``, library functions take the objects themselves, a coupling carries its
positional theory (``tree=optimal`` refuses one without it before any target call), a model config
needs no ``paper:`` block, and a user's model schema names its own keys. All checks are deterministic
(counts, equalities, messages)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from helpers import TINY
from hydra.errors import ConfigCompositionException

from specsamp import coupling as cp
from specsamp.drafts import DRAFTS, get_draft
from specsamp.errors import ConfigError
from specsamp.models import MODEL_SCHEMAS, GaussianMixture, register_model
from specsamp.models.base import Target
from specsamp.runner import build
from specsamp.runner.config import RUN_DEFAULTS, compose, load_config, unused_keys
from specsamp.runner.loop import run_config
from specsamp.runner.treerules import TREE_RULES, register_tree_rule
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A module ``contracts_user`` of the user's (on ``sys.path``): a draft, a tree rule, a coupling without
    theory; removed from the registries and ``sys.modules`` afterwards."""
    (tmp_path / "contracts_user.py").write_text(
        textwrap.dedent("""
        from specsamp.coupling import Coupling, dgrs
        from specsamp.drafts import Draft, get_draft
        from specsamp.runner.treerules import TreeRule
        from specsamp.trees import DraftTree

        velocity = get_draft("velocity")
        again = Draft("again", velocity.freeze, velocity.mean)      # not registered: named by pkg.module:name
        star = TreeRule("star", lambda run, coupling, horizon, profile, callback: (DraftTree.uniform(run.K, 1), run.K),
                        reads=("K",))
        plain = Coupling("plain", dgrs.verify)                       # D-GRS's rule, without its theory
        not_a_draft = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "contracts_user"
    sys.modules.pop("contracts_user", None)


def test_registry_names_the_valid_values_and_the_import_form():
    with pytest.raises(
        ConfigError, match=r"draft='nope' is not registered; valid: drift, velocity, .*pkg\.module:name"
    ):
        get_draft("nope")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_here'"):
        get_draft("no_such_module_here:x")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        get_draft("specsamp.drafts:nope")
    with pytest.raises(ConfigError, match="names a function, not a specsamp.drafts.Draft"):
        get_draft("specsamp.drafts:get_draft")
    assert get_draft(get_draft("x0")) is get_draft("x0")
    assert cp.get_coupling("specsamp.coupling:dgrs") is cp.get_coupling("dgrs")


def test_config_takes_draft_and_tree_by_import_path(user_module):
    run, recorded = load_config(compose([*TINY, f"draft={user_module}:again", f"tree={user_module}:star", "K=3"]))
    assert recorded["draft"] == f"{user_module}:again" and recorded["tree"] == f"{user_module}:star"
    tree, B = build.build_tree(run, build.build_coupling(run), run.steps - 2)
    assert (len(tree), B) == (4, 3)
    # the star reads K only: L and the search keys are hashed at their default
    assert set(unused_keys(run, build.build_coupling(run))) == {
        "match",
        "widths",
        "L",
        "budget",
        "delta_profile",
        "max_depth",
        "max_width",
    }


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("draft", "nope", r"draft='nope' is not registered; valid: drift, velocity, x0, .*pkg\.module:name"),
        (
            "tree",
            "nope",
            r"tree='nope' is not registered; valid: optimal, optimal_per_step, uniform, widths \(registered\), "
            r"or pkg\.module:name",
        ),
        ("draft", "{mod}:not_a_draft", r"names a int, not a specsamp.drafts.Draft"),
        ("tree", "{mod}:again", r"names a Draft, not a specsamp.runner.treerules.TreeRule"),
    ],
)
def test_an_unknown_draft_or_tree_names_key_value_and_valid(user_module, key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(compose([*TINY, f"{key}={value.format(mod=user_module)}"]))


def test_a_registered_tree_rule_declares_what_it_reads():
    @register_tree_rule("_contracts_fan", reads=("widths", "K"))
    def fan(run, coupling, horizon, profile, callback):
        return DraftTree.from_widths([run.K, *run.widths][:horizon]), 0

    try:
        run, _ = load_config(compose([*TINY, "tree=_contracts_fan", "widths=[2]", "K=3"]))
        tree, _ = build.build_tree(run, build.build_coupling(run), run.steps - 2)
        assert [int(w) for w in tree.num_children[:1]] == [3] and len(tree) == 1 + 3 + 6
        assert list(unused_keys(run, build.build_coupling(run))) == [
            "match",
            "L",
            "budget",
            "delta_profile",
            "max_depth",
            "max_width",
        ]
    finally:
        TREE_RULES._entries.pop("_contracts_fan")


def test_sample_speculative_takes_a_draft_object():
    model, sched, tree = (
        GaussianMixture(dim=8, components=3, layout_seed=1),
        Schedule.make(8, 0.3),
        DraftTree.uniform(2, 2),
    )
    by_name = sample_speculative(model, sched, tree, "dgrs", seed=3, n_samples=4, draft="x0")
    by_object = sample_speculative(model, sched, tree, "dgrs", seed=3, n_samples=4, draft=get_draft("x0"))
    assert torch.equal(by_name.samples, by_object.samples) and torch.equal(by_name.nfe, by_object.nfe)
    assert "x0" in DRAFTS


def test_builtin_couplings_carry_their_positional_theory():
    from specsamp import listcoupling, theory

    assert cp.get_coupling("dgrs").positional(1.0, 3).tolist() == theory.dgrs_positional(1.0, 3).tolist()
    assert cp.get_coupling("markmax").positional(1.0, 3).tolist() == listcoupling.markmax_positional(1.0, 3).tolist()
    assert cp.get_coupling("rmc").positional(1.0, 1).tolist() == [float(theory.rmc_acceptance(1.0))]


class _Counting:
    """A GMM velocity that counts its calls."""

    def __init__(self):
        self.inner = GaussianMixture(dim=16, components=5, layout_seed=0, dtype=torch.float64)
        self.event_shape, self.dtype, self.calls = self.inner.event_shape, self.inner.dtype, 0

    def __call__(self, x, sigma):
        self.calls += 1
        return self.inner(x, sigma)


@pytest.mark.parametrize("tree", ["optimal", "optimal_per_step"])
def test_searched_tree_without_theory_refuses_before_any_target_call(user_module, tree):
    counting = _Counting()
    cfg = compose([*TINY, f"tree={tree}", f"sampler.coupling.name={user_module}:plain"])
    with pytest.raises(
        ConfigError, match=f"tree={tree} is invalid with sampler=dgrs: coupling 'plain' has no positional theory"
    ):
        run_config(cfg, target=Target(counting))
    assert counting.calls == 0
    # with D-GRS's theory the same config calibrates (target calls) and runs
    run_config(compose([*TINY, f"tree={tree}"]), target=Target(counting))
    assert counting.calls > 0


def test_a_model_config_needs_no_paper_block(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gmm_plain.yaml").write_text("_target_: specsamp.models.gmm.GMMConfig\nname: plain\ndim: 4\n")
    run, recorded = load_config(compose(["model=gmm_plain", f"hydra.searchpath=[file://{tmp_path}]"]))
    assert {k: getattr(run, k) for k in RUN_DEFAULTS} == RUN_DEFAULTS
    assert run.model.paper is None and recorded["model"]["paper"] is None
    assert {k: d for k, d in unused_keys(run, None).items() if k in ("K", "L")} == {"K": 2, "L": 3}


def test_a_users_model_schema_names_its_own_keys(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_gmm.yaml").write_text("defaults: [contracts_tiny_schema, _self_]\nname: tiny\n")
    from dataclasses import dataclass

    from specsamp.models.gmm import GMMConfig

    @register_model("contracts_tiny")
    @dataclass
    class TinyGMM(GMMConfig):
        _target_: str = "specsamp.models.gmm.GMMConfig"
        width_of_mine: int = 3

    try:
        search = f"hydra.searchpath=[file://{tmp_path}]"
        cfg = compose(["model=tiny_gmm", "model.dim=4", "steps=8", "n_samples=2", search])
        assert cfg.model.width_of_mine == 3 and cfg.K == RUN_DEFAULTS["K"]  # typed by the schema; no paper block
        from specsamp.runner.explain import explain

        with pytest.raises(ConfigCompositionException) as e:
            compose(["model=tiny_gmm", "model.width_of_mines=4", search])
        text = explain(e.value)
        assert "not a key of TinyGMM" in text and "did you mean model.width_of_mine?" in text
        assert "model.label_dim" not in text  # not the built-in models' keys
    finally:
        MODEL_SCHEMAS.pop("contracts_tiny_schema")
