"""conf/model/*.yaml against their schemas: each merges onto its config dataclass, which refuses unknown keys
and wrong types, instantiates through Hydra and builds a Target (gmm and digits offline)."""

from __future__ import annotations

import hydra.utils
import pytest
import torch
from helpers import ROOT
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from specsamp.errors import ConfigError
from specsamp.models import MODEL_SCHEMAS, EDMConfig, GMMConfig, Paper, SD3Config

CONF = ROOT / "conf" / "model"


def _config(name: str, **overrides):
    """``conf/model/<name>.yaml`` merged onto its schema (as Hydra composes it), under a root with n_samples."""
    y = OmegaConf.load(CONF / f"{name}.yaml")
    defaults = y.pop("defaults")
    if "model" in y:  # package _global_ (a model that selects its kernel): its keys sit under model:
        defaults = [d.removeprefix("/model/").removesuffix("@model") for d in defaults if "override" not in str(d)]
        y = y.model
    schema, self_ = defaults
    assert self_ == "_self_"
    root = OmegaConf.create({"n_samples": 3})
    root.model = OmegaConf.merge(OmegaConf.structured(MODEL_SCHEMAS[schema]), y, overrides)
    return root.model


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_model_yaml_merges_onto_its_schema(name):
    mandatory = {"path": "/a/pipeline/folder"} if name == "diffusers" else {}  # its one key without a default
    cfg = hydra.utils.instantiate(_config(name, **mandatory), _convert_="object")
    assert (
        type(cfg)
        is MODEL_SCHEMAS[
            str(OmegaConf.load(CONF / f"{name}.yaml").defaults[0]).removeprefix("/model/").removesuffix("@model")
        ]
    )
    assert cfg._target_ == f"{type(cfg).__module__}.{type(cfg).__name__}"
    if name == "diffusers":  # any pipeline: no protocol of the paper's (the run's defaults apply)
        assert cfg.paper is None and cfg.prompts.n == 3
        return
    assert isinstance(cfg.paper, Paper) and cfg.paper.steps >= 3
    if isinstance(cfg, SD3Config):
        assert cfg.prompts.n == 3 and cfg.clip.model == "ViT-L-14-quickgelu"  # ${n_samples} resolved


def test_unknown_keys_and_wrong_types_are_refused():
    with pytest.raises(ConfigKeyError, match="dimm"):
        _config("gmm", dimm=3)
    with pytest.raises(ValidationError):
        _config("gmm", dim="abc")
    with pytest.raises(ValidationError):
        _config("cifar10", trust_checkpoint="maybe")
    with pytest.raises(ConfigKeyError, match="quick_gleu"):
        _config("sd3", clip={"quick_gleu": True})
    with pytest.raises(ValidationError):
        _config("sd3", guidance=True)
    assert _config("sd3", resolution=[256, 512]).resolution == [256, 512]  # int or [H, W]: Any, checked in build


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="model.dtype='float8'"):
        GMMConfig(name="gmm", dtype="float8").build("cpu")
    with pytest.raises(ConfigError, match="model.dim=0"):
        GMMConfig(name="gmm", dim=0).build("cpu")
    with pytest.raises(
        ConfigError,
        match="model.dtype='bfloat16' is invalid for an EDM network: .*float32 or float64.*model.net_dtype=bfloat16",
    ):
        EDMConfig(name="edm-digits-8x8-cond", dtype="bfloat16").build("cpu")
    with pytest.raises(ConfigError, match="model.labels='some'"):
        EDMConfig(name="edm-digits-8x8-cond", labels="some").build("cpu")
    with pytest.raises(ConfigError, match="model.labels='none' is invalid for a class-conditional net"):
        EDMConfig(name="edm-digits-8x8-cond").build("cpu")


@pytest.mark.parametrize("name", ["gmm", "digits"])
def test_offline_targets_build_and_give_one_velocity(name, monkeypatch):
    monkeypatch.setenv("SPECSAMP_OFFLINE", "1")
    target = hydra.utils.instantiate(_config(name), _convert_="object").build("cpu")
    ids = torch.arange(3)
    x = torch.randn(3, *target.model.event_shape, dtype=target.model.dtype)
    cond = target.cond_for(ids, 0) if target.cond_for is not None else {}
    v = target.model(x, torch.full((3,), 0.5), **cond)
    assert v.shape == x.shape and v.dtype == x.dtype and torch.isfinite(v).all()
    if name == "digits":
        assert cond["class_labels"].shape == (3,) and target.fid_ref == "digits-8x8"
        assert target.fid == {"feature_extractor": "digits-classifier"}
        assert target.decode(x).min() >= -1
    else:
        assert target.decode is None and target.fid is None


def test_sd3_builds_from_a_local_pipeline_directory(tmp_path):
    pytest.importorskip("diffusers")
    from tiny_sd3 import RESOLUTION, write_tiny_sd3

    directory = write_tiny_sd3(tmp_path / "pipeline")
    node = _config(
        "sd3", model_id=str(directory), net_dtype="float32", resolution=RESOLUTION, prompts={"source": "demo"}
    )
    target = hydra.utils.instantiate(node, _convert_="object").build("cpu")
    ids = torch.arange(3)
    assert target.indices.tolist() == [0, 1, 2] and len(target.prompts_for(ids)) == 3
    x = torch.randn(3, *target.model.event_shape)
    v = target.model(x, torch.full((3,), 0.5), **target.cond_for(ids, 0))
    assert v.shape == x.shape and torch.isfinite(v).all()
    images = target.decode(x)
    assert images.shape == (3, 3, RESOLUTION, RESOLUTION) and images.abs().max() <= 1
