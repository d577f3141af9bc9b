"""CLIP score: the scoring path on a tiny randomly initialised open_clip model (built offline) equals a
direct computation from its embeddings; summaries and loader errors."""

import json
import math

import numpy as np
import pytest
import torch

open_clip = pytest.importorskip("open_clip")
from PIL import Image  # noqa: E402

from specsamp.metrics.clip import (  # noqa: E402
    CLIPUnavailableError,
    checkpoint_activation,
    clip_scores,
    load_clip,
    scores_from_embeddings,
    summarize,
)

TINY = "specsamp-test-tiny-quickgelu"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A 1-layer ViT/text CLIP registered as an open_clip config, and a saved checkpoint of it."""
    root = tmp_path_factory.mktemp("clip")
    cfg = {
        "embed_dim": 16,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (root / f"{TINY}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(root / f"{TINY}.json")
    torch.manual_seed(1)
    model = open_clip.create_model(TINY, pretrained=None)
    with torch.no_grad():  # random towers disagree (negative cosines); flipping the text side gives
        model.text_projection.mul_(-1)  # positive scores to compare (this seed also has one clamped to 0)
    ckpt = root / "tiny.pt"
    torch.save(model.state_dict(), ckpt)
    return model, ckpt


def _images(n=3, h=40, w=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)


PROMPTS = ["a red bicycle", "two dogs on a beach at sunset", "a bowl of oranges"]


def test_clip_scores_equal_direct_computation(tiny_clip):
    ref_model, ckpt = tiny_clip
    model, preprocess, tokenizer = load_clip(TINY, pretrained=None, checkpoint=ckpt, quick_gelu=True)
    for (k, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k  # the checkpoint was loaded
    images = _images()
    scores = clip_scores(images, PROMPTS, model=model, preprocess=preprocess, tokenizer=tokenizer, batch_size=2)
    assert scores.shape == (3,) and scores.dtype == np.float64
    with torch.no_grad():
        x = torch.stack([preprocess(Image.fromarray(im.permute(1, 2, 0).numpy())) for im in images])
        e_img = model.encode_image(x).double()
        e_txt = model.encode_text(tokenizer(PROMPTS)).double()
    cos = (e_img * e_txt).sum(1) / (e_img.norm(dim=1) * e_txt.norm(dim=1))
    np.testing.assert_allclose(scores, (100 * cos).clamp_min(0).numpy(), rtol=1e-6, atol=1e-9)
    assert (scores > 1).any()  # not everything clamped
    # the same images as floats in [-1, 1] (the package's image convention), channels last, or PIL give
    # the same scores
    kw = dict(model=model, preprocess=preprocess, tokenizer=tokenizer)
    np.testing.assert_allclose(clip_scores(images.float() / 127.5 - 1, PROMPTS, **kw), scores, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(
        clip_scores(images.permute(0, 2, 3, 1).numpy(), PROMPTS, **kw), scores, rtol=1e-6, atol=1e-9
    )
    pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images]
    np.testing.assert_allclose(clip_scores(pil, PROMPTS, **kw), scores, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="3 images but 2 prompts"):
        clip_scores(images, PROMPTS[:2], **kw)
    with pytest.raises(ValueError, match=r"span \[0, 255\].*\[-1, 1\]"):
        clip_scores(images.float(), PROMPTS, **kw)


def test_scores_from_embeddings_cosine_times_100_clamped():
    img = torch.tensor([[3.0, 4.0], [1.0, 0.0], [2.0, 0.0]])
    txt = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 5.0]])
    np.testing.assert_allclose(scores_from_embeddings(img, txt), [60.0, 0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(scores_from_embeddings(7 * img[:1], txt[:1] / 3), [60.0], atol=1e-12)


def test_summaries():
    a = np.array([30.0, 31.0, 29.5, 33.0])
    s = summarize(a)
    assert s["n"] == 4 and math.isclose(s["mean"], a.mean())
    assert math.isclose(s["std"], a.std(ddof=1)) and math.isclose(s["sem"], a.std(ddof=1) / 2)
    assert math.isnan(summarize([1.0])["sem"])
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_load_clip_errors_are_immediate(tmp_path):
    with pytest.raises(ValueError, match="QuickGELU.*ViT-L-14-quickgelu"):
        load_clip("ViT-L-14", "openai", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pretrained='nope'"):
        load_clip(pretrained="nope", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="model_name='ViT-Nope'"):
        load_clip("ViT-Nope")
    with pytest.raises(FileNotFoundError, match="checkpoint="):
        load_clip(checkpoint=tmp_path / "missing.safetensors")
    with pytest.raises(CLIPUnavailableError, match="offline.*checkpoint="):
        load_clip(cache_dir=str(tmp_path), local_files_only=True)


def test_cached_openai_weights_are_found_without_network(tmp_path):
    """A hub-cache layout holding the ViT-L/14 OpenAI weights is used directly (no hub request)."""
    from specsamp.metrics.clip import _cached_weights

    repo = tmp_path / "models--timm--vit_large_patch14_clip_224.openai"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "open_clip_model.safetensors").write_bytes(b"not really weights")
    cfg = open_clip.get_pretrained_cfg("ViT-L-14-quickgelu", "openai")
    assert _cached_weights(cfg, str(tmp_path)) == str(snap / "open_clip_model.safetensors")
    assert _cached_weights(cfg, str(tmp_path / "empty")) is None


# ----------------------------------------------------------------------------------------------
# the file route: the activation a weights file was trained with is detected, or must be stated

TINY_GELU = "specsamp-test-tiny"
OPENAI_REPO = "models--timm--vit_large_patch14_clip_224.openai"


@pytest.fixture(scope="module")
def tiny_gelu(tiny_clip, tmp_path_factory):
    root = tmp_path_factory.mktemp("clip-gelu")
    cfg = json.loads(json.dumps(open_clip.get_model_config(TINY)))
    cfg.pop("quick_gelu")
    (root / f"{TINY_GELU}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(root / f"{TINY_GELU}.json")
    return TINY_GELU


def _hub_copy(src, root, repo=OPENAI_REPO):
    """``src`` placed as the hub cache holds a repository's file: ``<root>/<repo>/snapshots/<rev>/...``."""
    snap = root / repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True, exist_ok=True)
    dst = snap / "open_clip_pytorch_model.bin"
    dst.write_bytes(src.read_bytes())
    return dst


def test_file_route_refuses_an_activation_mismatch(tiny_clip, tiny_gelu, tmp_path):
    """OpenAI's QuickGELU weights as a file into a GELU config (``ViT-L-14``) are refused, as the tag
    route refuses them; so is a file whose activation cannot be told and is not stated."""
    _, ckpt = tiny_clip
    openai_file = _hub_copy(ckpt, tmp_path / "hub")
    assert checkpoint_activation(openai_file)[0] is True
    # the case of the paper's metric: ViT-L-14 (GELU) with the OpenAI file from the hub cache, refused
    # before any network is built
    with pytest.raises(ValueError, match="ViT-L-14-quickgelu") as e:
        load_clip("ViT-L-14", pretrained=None, checkpoint=openai_file)
    assert "timm/vit_large_patch14_clip_224.openai" in str(e.value)
    with pytest.raises(ValueError, match=f"{TINY_GELU}-quickgelu"):
        load_clip(TINY_GELU, pretrained=None, checkpoint=openai_file)
    model, _, _ = load_clip(TINY, pretrained=None, checkpoint=openai_file)  # the matching config loads
    assert model.visual.transformer.resblocks[0].mlp.gelu.__class__.__name__ == "QuickGELU"
    with pytest.raises(ValueError, match="contradicts"):
        load_clip(TINY, pretrained=None, checkpoint=openai_file, quick_gelu=False)
    # a bare file: nothing tells, so the activation must be stated, and must match the config
    assert checkpoint_activation(ckpt) == (None, "")
    with pytest.raises(ValueError, match="does not say which activation.*quick_gelu=true"):
        load_clip(TINY, pretrained=None, checkpoint=ckpt)
    with pytest.raises(ValueError, match="builds GELU blocks but quick_gelu=True"):
        load_clip(TINY_GELU, pretrained=None, checkpoint=ckpt, quick_gelu=True)
    load_clip(TINY_GELU, pretrained=None, checkpoint=ckpt, quick_gelu=False)
    # a file beside open_clip's config: the config tells
    from tiny_weights import write_tiny_clip

    gelu_file = write_tiny_clip(tmp_path / "gelu-dir", quick_gelu=False)
    assert checkpoint_activation(gelu_file)[0] is False
    with pytest.raises(ValueError, match="open_clip_config.json says quick_gelu=False"):
        load_clip(TINY, pretrained=None, checkpoint=gelu_file)
    # the tag route: a stated activation that contradicts the tag is refused too
    with pytest.raises(ValueError, match="contradicts pretrained='openai'"):
        load_clip(quick_gelu=False, local_files_only=True, cache_dir=str(tmp_path))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save: how OpenAI's files were written
def test_torchscript_archive_is_openai_quickgelu(tmp_path):
    """OpenAI's own release files are TorchScript archives: recognised as QuickGELU-trained."""
    path = tmp_path / "ViT-tiny.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    quick, how = checkpoint_activation(path)
    assert quick is True and "TorchScript" in how
    plain = tmp_path / "state.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), plain)  # a zip too, but no TorchScript code
    assert checkpoint_activation(plain) == (None, "")


def test_activation_mismatch_changes_scores(tiny_clip, tiny_gelu):
    """Why the refusal: the same weights under GELU and QuickGELU give different scores (as OpenAI's
    ViT-L/14 weights do: 0.338 vs 0.404)."""
    _, ckpt = tiny_clip
    images = _images()
    got = {}
    for name, quick in ((TINY, True), (TINY_GELU, False)):
        m, pre, tok = load_clip(name, pretrained=None, checkpoint=ckpt, quick_gelu=quick)
        got[name] = clip_scores(images, PROMPTS, model=m, preprocess=pre, tokenizer=tok)
    assert np.abs(got[TINY] - got[TINY_GELU]).max() > 1e-3


def test_local_dir_model_loads_config_and_weights(tmp_path):
    from tiny_weights import write_tiny_clip

    weights = write_tiny_clip(tmp_path / "tiny", quick_gelu=True)
    model, preprocess, tokenizer = load_clip(f"local-dir:{weights.parent}")
    from safetensors.torch import load_file

    saved = load_file(weights)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    s = clip_scores(_images(), PROMPTS, model=model, preprocess=preprocess, tokenizer=tokenizer)
    assert s.shape == (3,) and np.isfinite(s).all()
    with pytest.raises(FileNotFoundError, match="open_clip_config.json"):
        load_clip(f"local-dir:{tmp_path / 'nothing'}")


def test_loader_edges(tiny_clip, tmp_path, monkeypatch):
    """Random init for tests (no tag, no file); the tag route's download failure and its offline probe;
    open_clip's URL cache; an unreadable config beside a file; a local-dir that cannot load."""
    import specsamp.metrics.clip as clip_mod
    from specsamp import hub

    model, _, _ = load_clip(TINY, pretrained=None)  # random weights: allowed only without a tag or file
    assert sum(p.numel() for p in model.parameters()) > 0
    cfg = open_clip.get_pretrained_cfg("ViT-L-14-quickgelu", "openai")
    (tmp_path / "url-cache").mkdir()
    name = cfg["url"].rsplit("/", 1)[1]
    (tmp_path / "url-cache" / name).write_bytes(b"x")
    assert clip_mod._cached_weights({"url": cfg["url"]}, str(tmp_path / "url-cache")) == str(
        tmp_path / "url-cache" / name
    )
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert hub.hub_reachable() is True  # behind a proxy the probe trusts it
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.env_true("HF_HUB_OFFLINE") and hub.hub_offline()
    with pytest.raises(CLIPUnavailableError, match="HF_HUB_OFFLINE is set"):
        load_clip(cache_dir=str(tmp_path / "empty"))

    def fail(*a, **k):
        raise OSError("connection reset")

    monkeypatch.setattr(open_clip, "download_pretrained", fail)
    with pytest.raises(CLIPUnavailableError, match="could not download.*connection reset"):
        load_clip(cache_dir=str(tmp_path / "empty"), local_files_only=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "open_clip_config.json").write_text("{not json")
    (broken / "w.bin").write_bytes(b"")
    assert checkpoint_activation(broken / "w.bin") == (None, "")
    with pytest.raises(CLIPUnavailableError, match="could not load CLIP"):
        load_clip(f"local-dir:{broken}")


def test_score_input_errors(tiny_clip):
    _, ckpt = tiny_clip
    model, pre, tok = load_clip(TINY, pretrained=None, checkpoint=ckpt, quick_gelu=True)
    kw = dict(model=model, preprocess=pre, tokenizer=tok)
    with pytest.raises(ValueError, match="expected \\[n, 3, H, W\\]"):
        clip_scores(_images()[0], PROMPTS, **kw)
    with pytest.raises(ValueError, match="3 colour channels"):
        clip_scores(torch.zeros(2, 1, 8, 8, dtype=torch.uint8), PROMPTS[:2], **kw)
    with pytest.raises(ValueError, match="batch_size=0"):
        clip_scores(_images(), PROMPTS, batch_size=0, **kw)


CLIP_KEYS = {
    "model_name": "model.clip.model",
    "pretrained": "model.clip.pretrained",
    "checkpoint": "model.clip.checkpoint",
    "quick_gelu": "model.clip.quick_gelu",
    "cache_dir": "model.clip.cache_dir",
}


def test_check_clip_inputs_names_the_config_keys_without_building_a_network(tiny_clip, tmp_path, monkeypatch):
    """What load_clip would refuse after sampling is refused by check_clip_inputs first, with the runner's keys; what
    it would load passes and is returned (no network is built: create_model is never called)."""
    from specsamp.metrics.clip import check_clip_inputs

    def never(*a, **k):
        raise AssertionError("a network was built")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", never)

    def refused(needles, error=(ValueError, OSError), **kw):
        with pytest.raises(error) as e:
            check_clip_inputs(**{"cache_dir": str(tmp_path / "empty"), "keys": CLIP_KEYS, **kw})
        assert all(n in str(e.value) for n in needles), str(e.value)

    refused(["model.clip.model='ViT-Nope' is not an open_clip model", "ViT-L-14-quickgelu"], model_name="ViT-Nope")
    refused(["model.clip.pretrained='nope' is not a tag of"], pretrained="nope")
    refused(["model.clip.model='ViT-L-14' with model.clip.pretrained='openai' is refused"], model_name="ViT-L-14")
    refused(["model.clip.quick_gelu=False contradicts model.clip.pretrained='openai'"], quick_gelu=False)
    refused(
        ["model.clip.checkpoint=", "does not exist"], FileNotFoundError, checkpoint=tmp_path / "missing.safetensors"
    )
    refused(
        ["model.clip.model='local-dir:", "no open_clip_config.json"],
        FileNotFoundError,
        model_name=f"local-dir:{tmp_path}",
    )
    refused(
        ["not in the cache (model.clip.cache_dir=", "offline", "model.clip.checkpoint=<local weights file>"],
        CLIPUnavailableError,
        local_files_only=True,
    )
    _, ckpt = tiny_clip  # a bare state dict: its activation must be stated
    refused(["model.clip.checkpoint=", "model.clip.quick_gelu=true"], model_name=TINY, checkpoint=ckpt)
    assert check_clip_inputs(TINY, checkpoint=ckpt, quick_gelu=True, keys=CLIP_KEYS) == str(ckpt)
