"""``model=digits_cfg``: the label-dropout digits network under classifier-free guidance, one call of 2b rows."""

from __future__ import annotations

import pytest
import torch

from specsamp.errors import ConfigError


def build(*overrides):
    from specsamp.runner import build_target, compose, load_config

    return build_target(load_config(compose(["model=digits_cfg", *overrides]))[0])


def test_guided_digits_velocity_is_the_affine_combination_from_one_call_of_twice_the_rows():
    target = build("model.guidance=5")
    model = target.model
    cond = target.cond_for(torch.arange(6), 0)
    assert cond["class_labels"].shape == (6, 10) and torch.equal(cond["class_labels"].sum(1), torch.ones(6))
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    s = torch.full((6,), 0.4, dtype=torch.float64)
    rows = []
    inner = model.model
    model.model = lambda x_, s_, **c: (rows.append(x_.shape[0]), inner(x_, s_, **c))[1]
    v = model(x, s, **cond)
    model.model = inner
    assert rows == [12] and model.rows_per_state == 2
    v_c = inner(x, s, class_labels=cond["class_labels"])
    v_u = inner(x, s, class_labels=torch.zeros(6, 10))
    torch.testing.assert_close(v, v_u + 5.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    assert build("model.guidance=1").model.rows_per_state == 1


@pytest.mark.parametrize("value", [-1, "nan", "inf"])
def test_guided_digits_refuses_a_bad_scale_naming_key_value_and_range(value):
    with pytest.raises(ConfigError, match=r"model\.guidance=.*is invalid: valid values are finite numbers >= 0"):
        build(f"model.guidance={value}")


def test_guided_checkpoint_is_in_the_table_and_the_existing_digits_config_is_unchanged():
    from specsamp.hub import file_sha256
    from specsamp.models.digits import CFG_DENOISER_FILE
    from specsamp.models.edm import CHECKPOINTS
    from specsamp.runner import compose, load_config

    assert file_sha256(CFG_DENOISER_FILE) == CHECKPOINTS["edm-digits-8x8-cfg"].sha256
    run, recorded = load_config(compose(["model=digits"]))[:2]
    assert "guidance" not in recorded["model"] and run.model.name == "edm-digits-8x8-cond"
