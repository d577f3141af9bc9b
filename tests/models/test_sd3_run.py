"""`python run.py model=sd3 ...` end to end, offline, on a tiny real ``StableDiffusion3Pipeline``.

The pipeline (``tests/tiny_sd3.py``: SD3.5's block types and geometry, 16 latent channels, VAE factor 8,
two CLIP text encoders with hand-written tokenizer files, no T5) is written once per module with
``save_pretrained`` and passed as ``model.model_id=<dir>``; every run has ``HF_HUB_OFFLINE=1`` and an
empty ``HF_HOME``. The runner subprocesses the selected tests need start together (each spends most
of its ~10 s of CPU importing torch, diffusers and transformers) and each test waits for its own. The
``sampler=rmc`` and ``sampler=standard`` runs are marked slow; by default those two rules run in process
(same target, same config) and only ``sampler=dgrs`` goes through a subprocess.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from helpers import ROOT  # noqa: E402
from tiny_sd3 import RESOLUTION, tiny_tokenizer, write_tiny_sd3  # noqa: E402

N = 2
BASE = [
    "model=sd3",
    "model.prompts.source=demo",
    f"n_samples={N}",
    "steps=4",
    "K=2",
    "L=2",
    f"model.resolution={RESOLUTION}",
    "device=cpu",
    "model.net_dtype=float32",
    "execution=tree",
    "progress=false",
]
TIMEOUT = 300


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3") / "pipeline")


def _env(root: Path) -> dict:
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_HOME=str(root / "hf-home"),  # an empty cache: no CLIP (or SD3) weights to find
        WANDB_MODE="offline",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )


class Run:
    """``python run.py BASE + args`` started in the background, output in ``out``."""

    def __init__(self, out: Path, env: dict, args):
        self.out = out
        out.mkdir(parents=True)
        self._stdout = open(out.parent / f"{out.name}.stdout", "w+")
        self._stderr = open(out.parent / f"{out.name}.stderr", "w+")
        cmd = [sys.executable, str(ROOT / "run.py"), *BASE, *args, f"hydra.run.dir={out}"]
        self.proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=self._stdout, stderr=self._stderr, text=True)
        self._done = None

    def result(self) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                rc = self.proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
            outs = []
            for f in (self._stdout, self._stderr):
                f.seek(0)
                outs.append(f.read())
                f.close()
            self._done = subprocess.CompletedProcess(self.proc.args, rc, *outs)
        return self._done


SAMPLERS = ("dgrs", "rmc", "standard")


class Runs:
    """The runner subprocesses of this module, by name, each started once (on first use or up front)."""

    def __init__(self, root: Path, sd3_dir: Path):
        self.root, self.env, self.model = root, _env(root), f"model.model_id={sd3_dir}"
        self.runs: dict[str, Run] = {}

    def args(self, name: str) -> list[str]:
        if name in SAMPLERS:
            return [self.model, f"sampler={name}", "save_samples=true"]
        if name == "clip":
            return [self.model, "sampler=dgrs", "metrics=[clip]"]
        if name == "clip_ok":  # a small open_clip model folder (config + random weights), open_clip's local-dir:
            from tiny_weights import write_tiny_clip

            weights = write_tiny_clip(self.root / "tiny-clip", quick_gelu=True)
            return [
                self.model,
                "sampler=dgrs",
                "metrics=[clip]",
                f"model.clip.model=local-dir:{weights.parent}",
                "save_samples=true",
            ]
        if name == "missing":
            return [f"model.model_id={self.root / 'no-such-dir'}"]
        raise KeyError(name)

    def start(self, name: str) -> Run:
        if name not in self.runs:
            self.runs[name] = Run(self.root / name, self.env, self.args(name))
        return self.runs[name]

    def __getitem__(self, name: str) -> Run:
        return self.start(name)

    def started(self, name: str) -> bool:
        return name in self.runs

    def close(self) -> None:
        for r in self.runs.values():  # a test that failed early must not leave processes behind
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


def _selected_runs(session) -> set[str]:
    """The runs the tests selected from this module need, so they can all start at once."""
    names = set()
    for item in session.items:
        if Path(str(item.fspath)) != Path(__file__):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "sampler" in params:
            names.add(params["sampler"])
        elif "clip_score_through_runner" in item.name:
            names.add("clip_ok")
        elif "clip" in item.name:
            names.add("clip")
        elif "missing" in item.name:
            names.add("missing")
        elif "same_prompt_and_noise" in item.name:
            names.add("dgrs")
    return names


@pytest.fixture(scope="module")
def runs(sd3_dir, tmp_path_factory, request):
    r = Runs(tmp_path_factory.mktemp("sd3-runs"), sd3_dir)
    for name in sorted(_selected_runs(request.session)):
        r.start(name)
    yield r
    r.close()


@pytest.mark.parametrize(
    "sampler", ["dgrs", pytest.param("rmc", marks=pytest.mark.slow), pytest.param("standard", marks=pytest.mark.slow)]
)
def test_sd3_run_writes_record_and_images(runs, sampler):
    r = runs[sampler]
    p = r.result()
    assert p.returncode == 0, p.stderr[-4000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"model=sd3 sampler={sampler}"), p.stdout
    assert "Traceback" not in p.stderr
    rec = json.loads((r.out / "result.json").read_text())
    assert rec["status"] == "ok" and rec["sampler"] == sampler and rec["n_samples"] == N
    assert rec["speedup"]["mean"] > 0 and rec["config"]["model"]["model_id"].endswith("pipeline")
    if sampler != "standard":  # a speculative round ran (T = 4: two speculative steps)
        assert sum(rec["attempts_per_depth"]) > 0 and rec["rounds"]["mean"] >= 1
    names = sorted(f.name for f in (r.out / "images").iterdir())
    assert names == [f"{i:06d}.png" for i in range(N)]
    assert (r.out / "grid.png").is_file()
    from PIL import Image

    for name in names:
        with Image.open(r.out / "images" / name) as im:
            assert im.size == (RESOLUTION, RESOLUTION) and im.mode == "RGB"
    samples = torch.load(r.out / "samples.pt")
    assert samples.shape == (N, 16, RESOLUTION // 8, RESOLUTION // 8) and torch.isfinite(samples).all()


def test_missing_local_directory_exits_2_with_how_to_get_weights(runs):
    p = runs["missing"].result()
    assert p.returncode == 2, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    err = p.stderr
    assert "no-such-dir" in err and "is not a directory" in err
    assert "huggingface-cli login" in err and "accept its licence" in err and "model.model_id" in err
    assert not (runs["missing"].out / "result.json").exists()


def test_clip_metric_offline_is_refused_before_sampling(runs):
    """The CLIP weights neither cached nor downloadable: exit 2 before anything is sampled (they were found
    missing only after every image was made), one paragraph naming model.clip.cache_dir and model.clip.checkpoint."""
    if (Path.home() / ".cache" / "clip" / "ViT-L-14.pt").is_file():
        pytest.skip("the CLIP weights are in open_clip's URL cache on this machine: not offline-unavailable")
    r = runs["clip"]
    p = r.result()
    assert p.returncode == 2, p.stderr[-4000:]
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert p.stderr.startswith("error: metrics=[clip] cannot be scored: CLIP weights") and "offline" in p.stderr
    assert "model.clip.cache_dir=None" in p.stderr and "model.clip.checkpoint=<local weights file>" in p.stderr
    assert p.stdout == "" and not (r.out / "result.json").exists() and not (r.out / "images").exists()


@pytest.mark.slow  # a runner subprocess of its own; scores guarded by tests/metrics/test_clip.py, the run by [dgrs] above
def test_clip_score_through_runner_with_local_weights(runs, sd3_dir, monkeypatch):
    """`run.py model=sd3 ... 'metrics=[clip]'` with a small open_clip model: the SD3 target's images
    ([-1, 1] floats, the package's one convention) are scored, per image, and the scores equal those of
    the saved PNGs and of the decoded tensors scored in memory."""
    import numpy as np

    from specsamp.images import as_pixels, load_images
    from specsamp.metrics.clip import clip_scores, load_clip
    from specsamp.models.sd3.prompts import demo_prompts

    r = runs["clip_ok"]
    p = r.result()
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    rec = json.loads((r.out / "result.json").read_text())
    assert rec["status"] == "ok" and "metrics_error" not in rec
    assert isinstance(rec["clip_score"], float) and len(rec["metrics"]["clip_scores"]) == N
    assert f"CLIP {rec['clip_score']:.2f}" in p.stdout
    model, pre, tok = load_clip(f"local-dir:{r.out.parent / 'tiny-clip'}")
    kw = dict(model=model, preprocess=pre, tokenizer=tok)
    pngs = load_images(r.out / "images")
    np.testing.assert_allclose(
        clip_scores(pngs, demo_prompts(N), **kw), rec["metrics"]["clip_scores"], rtol=1e-6, atol=1e-9
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    decoded = _target(_compose(f"model.model_id={sd3_dir}")).decode(torch.load(r.out / "samples.pt"))
    assert decoded.dtype == torch.float32 and decoded.min() >= -1 and decoded.max() <= 1 and decoded.min() < 0
    np.testing.assert_array_equal(as_pixels(decoded), pngs)
    np.testing.assert_allclose(
        clip_scores(decoded, demo_prompts(N), **kw), rec["metrics"]["clip_scores"], rtol=1e-6, atol=1e-9
    )


# ----------------------------------------------------------------------------------------------
# In process: the same target for every rule


def _compose(*overrides):
    from specsamp.runner import compose

    return compose([*BASE, *overrides])


def _target(cfg):
    from specsamp.runner import build_target, load_config

    return build_target(load_config(cfg)[0])


class Recorder:
    """The velocity model, recording the inputs of its first call (the initial noise at sigma_0)."""

    def __init__(self, model):
        self._model = model
        self.first = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, x, sigma, **cond):
        if self.first is None:
            self.first = {
                "x": x.clone(),
                "sigma": torch.as_tensor(sigma).clone(),
                **{k: v.clone() for k, v in cond.items()},
            }
        return self._model(x, sigma, **cond)


def test_every_rule_sees_the_same_prompt_and_noise_per_image(sd3_dir, runs, monkeypatch):
    """Same seed: image i gets the same prompt and the same initial latent under dgrs, rmc and standard,
    and the subprocess runs reproduce the in-process samples."""
    from specsamp.models.base import Target
    from specsamp.models.sd3.prompts import demo_prompts
    from specsamp.runner import run_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _compose(f"model.model_id={sd3_dir}")
    built = _target(cfg)
    ids = torch.arange(N)
    assert built.prompts_for(ids) == demo_prompts(N)
    first = {}
    for sampler in ("dgrs", "rmc", "standard"):
        rule_cfg = _compose(f"model.model_id={sd3_dir}", f"sampler={sampler}")
        rec = Recorder(built.model)
        target = Target(rec, cond_for=built.cond_for, decode=built.decode, prompts_for=built.prompts_for)
        record, res = run_config(rule_cfg, target=target)
        first[sampler] = rec.first
        assert record["sampler"] == sampler and rec.first["x"].shape == (N, 16, RESOLUTION // 8, RESOLUTION // 8)
        assert rec.first["prompt"].tolist() == list(range(N))  # image i <- prompt i
        if runs.started(sampler):  # bitwise the run the runner made in its own process (rmc, standard: -m slow)
            p = runs[sampler].result()
            assert p.returncode == 0, p.stderr[-4000:]
            saved = torch.load(runs[sampler].out / "samples.pt")
            torch.testing.assert_close(res.samples.cpu(), saved, rtol=0, atol=0)
    assert runs.started("dgrs")
    for sampler in ("rmc", "standard"):
        for key in ("x", "sigma", "prompt"):
            assert torch.equal(first[sampler][key], first["dgrs"][key]), (sampler, key)
    # and another seed changes the noise, not the prompts
    rec = Recorder(built.model)
    run_config(
        _compose(f"model.model_id={sd3_dir}", "seed=1"),
        target=Target(rec, cond_for=built.cond_for, decode=built.decode, prompts_for=built.prompts_for),
    )
    assert torch.equal(rec.first["prompt"], first["dgrs"]["prompt"]) and not torch.equal(
        rec.first["x"], first["dgrs"]["x"]
    )


def test_tiny_directory_loads_like_a_hub_checkout(sd3_dir, monkeypatch):
    """Hand-written tokenizer files tokenize as the in-memory tokenizer; a directory saved without T5
    loads with and without drop_t5; the embedding table is what StableDiffusion3Pipeline.__call__ uses."""
    from specsamp.models.sd3 import SD3Config, load_sd3

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_sd3(str(sd3_dir), device="cpu", dtype="float32")
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    assert load_sd3(str(sd3_dir), device="cpu", dtype="float32", drop_t5=True).text_encoder_3 is None
    for tok, ref in ((pipe.tokenizer, tiny_tokenizer()), (pipe.tokenizer_2, tiny_tokenizer("!"))):
        for text in ("a red bicycle leaning against the wall", "Two DOGS, running!", "naïve café ☃ 1234"):
            kw = dict(padding="max_length", max_length=77, truncation=True)
            assert tok(text, **kw).input_ids == ref(text, **kw).input_ids
    prompts = ["a red bicycle", "the sea"]
    target = SD3Config(
        resolution=RESOLUTION, net_dtype="float32", guidance=7.0, free_text_encoders=False, max_sequence_length=16
    ).build("cpu", pipeline=pipe, prompts=prompts)
    assert target.model.event_shape == (16, RESOLUTION // 8, RESOLUTION // 8)
    with torch.no_grad():
        pe, ne, pp, npool = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device="cpu",
            do_classifier_free_guidance=True,
            negative_prompt="",
            max_sequence_length=16,
        )
    m = target.model
    assert m.prompt_embeds.shape == (2, 77 + 16, 32)
    torch.testing.assert_close(m.prompt_embeds, pe)
    torch.testing.assert_close(m.pooled_prompt_embeds, pp)
    torch.testing.assert_close(m.negative_prompt_embeds.expand_as(ne), ne)
    torch.testing.assert_close(m.negative_pooled_prompt_embeds.expand_as(npool), npool)


def test_model_max_batch_reaches_the_sampler(sd3_dir, monkeypatch):
    """conf/model/sd3.yaml's max_batch (states per transformer forward) splits every batched call; the
    top-level max_batch, when set, wins. Before, the model's value was validated and then dropped."""
    from specsamp.models.base import Target
    from specsamp.runner import run_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = {}
    for label, overrides in (
        ("model=1", ["model.max_batch=1"]),
        ("model=null", ["model.max_batch=null"]),
        ("top=1", ["model.max_batch=null", "max_batch=1"]),
    ):
        cfg = _compose(f"model.model_id={sd3_dir}", *overrides)
        built = _target(cfg)
        seen = []
        inner = built.model

        class Spy:
            def __init__(self, inner, seen):
                self.inner, self.seen = inner, seen

            def __getattr__(self, name):
                return getattr(self.__dict__["inner"], name)

            def __call__(self, x, sigma, **cond):
                self.seen.append(x.shape[0])
                return self.inner(x, sigma, **cond)

        target = Target(
            Spy(inner, seen),
            cond_for=built.cond_for,
            decode=built.decode,
            prompts_for=built.prompts_for,
            max_batch=built.max_batch,
        )
        _, res = run_config(cfg, target=target)
        rows[label] = (max(seen), res.extra["max_batch"])
    assert rows["model=1"] == (1, 1)
    assert rows["model=null"][0] > 1 and rows["model=null"][1] is None
    assert rows["top=1"] == (1, 1)
