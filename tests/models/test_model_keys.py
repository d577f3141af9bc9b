"""Every key of every ``conf/model/*.yaml`` reaches the code that uses it, or is rejected.

For each leaf key of each model config (walked from the YAML files, so a new key without an entry
here fails :func:`test_every_model_key_has_a_probe`), the key is changed and the run's *outcome* is
compared with the unchanged run's, in the same context: the resolved top-level config (``paper.*``
feeds ``steps``, ``eps``, ...), the error of a refused config, or a fingerprint of what was built and
sampled (samples, decoded pixels, prompts, the record's model name and ``max_batch``, the metric
settings the scorer reads, the arguments the loaders received). A key is consumed when the outcome
changes; a refused value must name the key or the value. All in process, on a tiny EDM pickle, a
tiny SD3 pipeline directory and a small GMM.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from helpers import ROOT
from omegaconf import OmegaConf
from tiny_edm import TINY_SRC, tiny_precond, write_persistent_pickle

MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def leaf_keys(node: dict, prefix="") -> list[str]:
    out = []
    for k, v in node.items():
        out += leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def yaml_keys(model: str) -> list[str]:
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"), resolve=False)
    node.pop("defaults", None)  # Hydra's directive (the schema), not a key
    if "model" in node:  # package _global_ (a model that selects its kernel): its keys sit under model:
        node = node["model"]
    return leaf_keys(node)


# (model, key) -> (context overrides, perturbed value); "{...}" names are filled from the fixtures
EDM_COMMON = {
    "_target_": ([], "specsamp.models.nope.Config"),
    "name": ([], "another-name"),
    "url": (["model.path=null", "model.url=file://{ckpt}"], "file://{missing}"),
    "path": ([], "{missing}"),
    "sha256": ([], "0" * 64),
    "cache_dir": (["model.path=null"], "{tmp}/elsewhere"),
    "trust_checkpoint": (["model.sha256=null"], True),
    "download": (["model.path=null"], False),
    "key": ([], "nope"),
    "dtype": ([], "float64"),
    "net_dtype": ([], "bfloat16"),
    "shift": ([], 2.0),
    "fid_ref": ([], "{tmp}/other.npz"),
    "fid_extractor": ([], "dinov2-vit-s-14"),
    "fid_layer": ([], "768"),
    "fid_weights": ([], "{tmp}/inception.pth"),
    "paper.steps": ([], 7),
    "paper.eps": ([], 0.5),
    "paper.n_samples": ([], 3),
    "paper.K": ([], 3),
    "paper.L": ([], 4),
}
PROBES = {
    "gmm": {
        "_target_": ([], "specsamp.models.nope.Config"),
        "name": ([], "another-name"),
        "dim": ([], 5),
        "components": ([], 3),
        "layout_seed": ([], 1),
        "dtype": ([], "float32"),
        "shift": ([], 2.0),
        **{k: v for k, v in EDM_COMMON.items() if k.startswith("paper.")},
    },
    "cifar10": {**EDM_COMMON, "label_dim": ([], 5), "labels": ([], "none")},
    "ffhq": {**EDM_COMMON, "label_dim": ([], 3), "labels": ([], "uniform")},
    # the shipped file needs no cache or download: digits.yaml has neither key
    "digits": {
        **{k: v for k, v in EDM_COMMON.items() if k not in ("cache_dir", "download")},
        "label_dim": ([], 5),
        "labels": ([], "none"),
    },
    "digits_cfg": {
        **{k: v for k, v in EDM_COMMON.items() if k not in ("cache_dir", "download")},
        "label_dim": ([], 5),
        "labels": ([], "none"),
        "guidance": ([], -1.0),  # the tiny net ignores its labels: a refused scale shows the key is read
    },
    "patches32": {
        **{
            k: v
            for k, v in EDM_COMMON.items()
            if k
            in (
                "_target_",
                "name",
                "url",
                "path",
                "sha256",
                "trust_checkpoint",
                "key",
                "dtype",
                "net_dtype",
                "shift",
                "fid_ref",
            )
            or k.startswith("paper.")
        },
        "label_dim": ([], 3),
        "labels": ([], "uniform"),
    },
    "sd3": {
        "_target_": ([], "specsamp.models.nope.Config"),
        "name": ([], "another-name"),
        "model_id": ([], "{missing}"),
        "local_files_only": ([], True),
        "cache_dir": ([], "{tmp}/hf-cache"),
        "drop_t5": ([], True),
        "resolution": ([], 32),
        "guidance": ([], 3.0),
        "negative_prompt": ([], "blurry"),
        "max_sequence_length": ([], 8),
        "encode_batch": ([], 1),
        "free_text_encoders": ([], False),
        "dtype": ([], "float64"),
        "net_dtype": ([], "bfloat16"),
        "max_batch": ([], 1),
        "decode_chunk": ([], 1),
        "images_per_prompt": ([], 2),
        "prompts.source": ([], "file"),
        "prompts.captions_json": (
            ["model.prompts.source=coco", "model.prompts.captions_json={captions}"],
            "{tmp}/none.json",
        ),
        "prompts.n": ([], 1),
        "prompts.seed": (["model.prompts.source=coco", "model.prompts.captions_json={captions}"], 7),
        "prompts.path": (["model.prompts.source=file", "model.prompts.path={prompt_file}"], "{prompt_file2}"),
        "clip.model": ([], "ViT-B-32-quickgelu"),
        "clip.pretrained": ([], "laion400m_e32"),
        "clip.checkpoint": ([], "{tmp}/clip.safetensors"),
        "clip.quick_gelu": ([], True),
        "clip.cache_dir": ([], "{tmp}/clip-cache"),
        "shift": ([], 1.0),
        **{k: v for k, v in EDM_COMMON.items() if k.startswith("paper.")},
    },
    # a saved tiny StableDiffusionPipeline (tests/tiny_diffusers.py); max_sequence_length on the tiny SD3 folder
    "diffusers": {
        "_target_": ([], "specsamp.models.nope.Config"),
        "name": ([], "another-name"),
        "path": ([], "{missing}"),
        "dtype": ([], "float64"),
        "net_dtype": ([], "bfloat16"),
        "guidance": ([], 3.0),
        "negative_prompt": ([], "blurry"),
        "resolution": ([], 32),
        "max_sequence_length": (["model.path={sd3_dir}", "kernel=flow_stochastic", "model.resolution=64"], 8),
        "max_batch": ([], 1),
        "decode_chunk": ([], 0),
        "images_per_prompt": ([], 2),
        "prompts.source": ([], "file"),
        "prompts.captions_json": (
            ["model.prompts.source=coco", "model.prompts.captions_json={captions}"],
            "{tmp}/none.json",
        ),
        "prompts.n": ([], 1),
        "prompts.seed": (["model.prompts.source=coco", "model.prompts.captions_json={captions}"], 7),
        "prompts.path": (["model.prompts.source=file", "model.prompts.path={prompt_file}"], "{prompt_file2}"),
        "clip.model": ([], "ViT-B-32-quickgelu"),
        "clip.pretrained": ([], "laion400m_e32"),
        "clip.checkpoint": ([], "{tmp}/clip.safetensors"),
        "clip.quick_gelu": ([], True),
        "clip.cache_dir": ([], "{tmp}/clip-cache"),
    },
}
# what every run of a model adds (small and fast); top-level keys, so paper.* is compared without them
BASE = {
    "gmm": ["model.dim=4"],
    "cifar10": ["model.path={ckpt}", "model.sha256={sha}"],
    "ffhq": ["model.path={ckpt}", "model.sha256={sha}"],
    "digits": ["model.path={ckpt}", "model.sha256={sha}"],
    "digits_cfg": ["model.path={ckpt}", "model.sha256={sha}"],
    "patches32": ["model.path={ckpt}", "model.sha256={sha}"],
    "sd3": [
        "model.model_id={sd3_dir}",
        "model.prompts.source=demo",
        "model.resolution=64",
        "model.net_dtype=float32",
        "model.max_sequence_length=16",
        "model.encode_batch=2",
    ],
    "diffusers": ["model.path={diffusers_dir}", "kernel=auto"],
}
RUN = ["steps=4", "n_samples=2", "K=2", "L=2", "device=cpu", "progress=false", "execution=tree"]


def test_every_model_key_has_a_probe():
    for model in MODELS:
        assert model in PROBES, f"conf/model/{model}.yaml has no probes in tests/models/test_model_keys.py"
        missing = sorted(set(yaml_keys(model)) - set(PROBES[model]))
        assert not missing, f"keys of conf/model/{model}.yaml without a probe: {missing}"


# ----------------------------------------------------------------------------------------------
# fixtures: the tiny targets


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    out = {"tmp": str(tmp), "missing": str(tmp / "no-such-file")}
    for model, label_dim in (("cifar10", 10), ("ffhq", 0), ("digits", 10), ("digits_cfg", 10), ("patches32", 0)):
        path = tmp / f"{model}.pkl"
        out[f"{model}:ckpt"] = str(path)
        net = tiny_precond(img_channels=3, label_dim=label_dim)
        out[f"{model}:sha"] = write_persistent_pickle(path, net, TINY_SRC, "TinyPrecond")
    caps = {"annotations": [{"image_id": i, "id": 100 + i, "caption": f"caption number {i}"} for i in range(12)]}
    (tmp / "captions.json").write_text(json.dumps(caps))
    out["captions"] = str(tmp / "captions.json")
    (tmp / "p1.txt").write_text("a red bicycle\na bowl of fruit\n")
    (tmp / "p2.txt").write_text("a blue car\nthe sea at night\n")
    out["prompt_file"], out["prompt_file2"] = str(tmp / "p1.txt"), str(tmp / "p2.txt")
    return out


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    pytest.importorskip("diffusers")
    from tiny_sd3 import write_tiny_sd3

    return str(write_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3") / "pipeline"))


@pytest.fixture(scope="module")
def diffusers_dir(tmp_path_factory):
    pytest.importorskip("diffusers")
    from tiny_diffusers import save_pipeline, tiny_sd

    return str(save_pipeline(tiny_sd(), tmp_path_factory.mktemp("tiny-diffusers") / "pipeline"))


def _runner_takes_kernels() -> bool:
    try:
        from specsamp.runner.config import brings_scheduler  # noqa: F401  (the runner's kernel= wiring)
    except ImportError:
        return False
    return True


def _fill(value, model, files, sd3_dir, diffusers_dir=""):
    if not isinstance(value, str):
        return value
    subs = {
        **{k.split(":")[1]: v for k, v in files.items() if k.startswith(model + ":")},
        **{k: v for k, v in files.items() if ":" not in k},
        "sd3_dir": sd3_dir,
        "diffusers_dir": diffusers_dir,
    }
    return value.format(**subs)


def _compose(model, overrides):
    from specsamp.runner.config import compose

    cfg = OmegaConf.to_container(compose([f"model={model}", *overrides]), resolve=True)
    cfg.pop("sweep_name")  # a timestamp
    return cfg


class LoaderSpy:
    """Records what the SD3 loader and prompt encoder receive; serves copies of one loaded pipeline."""

    def __init__(self, sd3):
        self.sd3, self.calls, self.cache, self.pipes = sd3, [], {}, []
        self.load, self.encode = sd3.load_sd3, sd3.encode_prompts

    def load_sd3(self, *args, **kwargs):
        self.calls.append(("load", args, sorted(kwargs.items())))
        key = repr((args, sorted(kwargs.items())))
        if key not in self.cache:
            self.cache[key] = self.load(*args, **kwargs)
        pipe = copy.deepcopy(self.cache[key])
        self.pipes.append(pipe)
        return pipe

    def encode_prompts(self, *args, **kwargs):
        self.calls.append(("encode", kwargs.get("batch_size")))
        return self.encode(*args, **kwargs)


def _digest(t) -> str:
    return (
        hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
        + str(t.dtype)
        + str(tuple(t.shape))
    )


def outcome(model, overrides, spy) -> tuple:
    """(resolved top-level config, error message or fingerprint) of one configuration (cached)."""
    from specsamp.runner import ConfigError, run_config

    key = (model, tuple(overrides))
    if key in _OUTCOMES:
        return _OUTCOMES[key]
    top = {k: v for k, v in _compose(model, overrides).items() if k != "model"}
    cfg = _compose(model, [*overrides, *RUN])
    spy.calls.clear()
    spy.pipes.clear()
    try:
        rec, res = run_config(cfg)
        target, ids = res.extra["target"], res.extra["indices"]
        rows = []
        if target.decode is not None:
            hook = None
            if spy.pipes:
                hook = spy.pipes[-1].vae.decoder.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
            pixels = _digest(target.decode(res.samples))
            if hook is not None:
                hook.remove()
        else:
            pixels = None
        pipe = spy.pipes[-1] if spy.pipes else None
        out = (
            top,
            (
                "ok",
                rec["model"],
                res.extra["max_batch"],
                _digest(res.samples),
                pixels,
                tuple(rows),
                target.prompts_for(ids) if target.prompts_for else None,
                target.fid_ref,
                json.dumps(target.fid, sort_keys=True),
                json.dumps(target.clip, sort_keys=True),
                repr(spy.calls),
                None if pipe is None else pipe.text_encoder is None,
            ),
        )
    except ConfigError as e:
        out = top, ("error", str(e))
    _OUTCOMES[key] = out
    return out


_OUTCOMES: dict = {}


CASES = [(m, k) for m in MODELS for k in sorted(PROBES.get(m, {}))]


@pytest.mark.parametrize(
    "model,key",
    [
        pytest.param(m, k, marks=pytest.mark.slow)
        if m in ("sd3", "digits", "digits_cfg", "patches32", "diffusers")
        else (m, k)
        for m, k in CASES
    ],
)
def test_model_key_is_used_or_rejected(model, key, files, request, monkeypatch, tmp_path_factory):
    from specsamp.models import sd3 as sd3_mod

    if model == "diffusers" and not _runner_takes_kernels():
        pytest.skip("the runner has no kernel= key here: model=diffusers needs its scheduler plan")
    sd3_dir = request.getfixturevalue("sd3_dir") if model in ("sd3", "diffusers") else ""
    diffusers_dir = request.getfixturevalue("diffusers_dir") if model == "diffusers" else ""
    monkeypatch.setenv("SPECSAMP_OFFLINE", "1")
    home = Path(files["tmp"])  # one environment for the module, so that unchanged runs can be cached
    monkeypatch.setenv("SPECSAMP_CACHE", str(home / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home / "hf-home"))
    spy = LoaderSpy(sd3_mod)
    monkeypatch.setattr(sd3_mod, "load_sd3", spy.load_sd3)
    monkeypatch.setattr(sd3_mod, "encode_prompts", spy.encode_prompts)
    context, value = PROBES[model][key]
    base = [_fill(o, model, files, sd3_dir, diffusers_dir) for o in (*BASE[model], *context)]
    value = _fill(value, model, files, sd3_dir, diffusers_dir)
    literal = json.dumps(value) if not isinstance(value, str) else value
    before = outcome(model, base, spy)
    after = outcome(model, [*base, f"model.{key}={literal}"], spy)
    assert after != before, f"model.{key}={value!r} changed nothing: the key is dropped before the code that uses it"
    if after[1][0] == "error" and after[0] == before[0]:
        leaf = key.split(".")[-1]
        assert leaf in after[1][1] or str(value) in after[1][1], after[1][1]
