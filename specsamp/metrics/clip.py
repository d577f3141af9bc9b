"""CLIP score of generated images against their prompts (paper section 5.3, Table 1).

Per image, ``score = max(100 * cos(E_img(image), E_txt(prompt)), 0)`` -- the definition of Hessel et
al. (2021) with weight 100, as ``torchmetrics.multimodal.CLIPScore`` computes it -- with the paper's
model, ``openai/clip-vit-large-patch14``. In open_clip that is ``ViT-L-14-quickgelu`` with
``pretrained="openai"``: OpenAI trained CLIP with the QuickGELU activation ``x * sigmoid(1.702 x)``,
and the plain ``ViT-L-14`` config builds exact-GELU blocks, so loading the OpenAI weights into it gives
a silently different network (and different scores). :func:`load_clip` refuses that combination.

Scores are per image, so two sampling rules run on the same (prompt, noise) pairs
(:mod:`specsamp.models.sd3.prompts`) can be compared image by image; Table 1 reports the mean and the
standard error of the mean over the 100 prompts (:func:`summarize`). Images follow the package's one convention
(:mod:`specsamp.images`): uint8 pixels, or floats in ``[-1, 1]`` quantised with :func:`specsamp.images.to_uint8`
before scoring, so scoring a target's decoded tensors in memory and scoring the PNGs the runner saved give the same
numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from ..hub import hub_offline, hub_offline_reason

DEFAULT_MODEL = "ViT-L-14-quickgelu"
DEFAULT_PRETRAINED = "openai"


class CLIPUnavailableError(OSError):
    """The CLIP weights could not be found locally or fetched."""


# ----------------------------------------------------------------------------------------------
# Loading


def _cached_weights(tag_cfg: Mapping, cache_dir: str | None) -> str | None:
    """Path of the tag's weights if already downloaded (hub cache or open_clip's URL cache), else None."""
    hub = tag_cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache

        repo, filename = os.path.split(hub.rstrip("/")) if not hub.endswith("/") else (hub.rstrip("/"), "")
        names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
        for fn in names:
            hit = try_to_load_from_cache(repo, fn, cache_dir=cache_dir)
            if isinstance(hit, str) and os.path.isfile(hit):
                return hit
    url = tag_cfg.get("url", "")
    if url:
        root = cache_dir or os.path.expanduser("~/.cache/clip")
        path = os.path.join(root, os.path.basename(urlparse(url).path))
        if os.path.isfile(path):
            return path
    return None


def _hub_repo_of(path: str) -> str | None:
    """``org/name`` when ``path`` lies in a Hugging Face cache folder ``models--org--name/``."""
    for part in reversed(os.path.normpath(os.path.abspath(path)).split(os.sep)):
        if part.startswith("models--") and part.count("--") >= 2:
            return "/".join(part[len("models--") :].split("--", 1))
    return None


def checkpoint_activation(path: str | os.PathLike) -> tuple[bool | None, str]:
    """Whether a CLIP weights file was trained with QuickGELU, as far as the file itself tells.

    A state dict holds no activation, so this looks at what surrounds the weights, in order:

    1. a TorchScript archive (a zip with ``code/`` and ``constants.pkl``): OpenAI's own release
       format, and OpenAI trained every CLIP with QuickGELU;
    2. an ``open_clip_config.json`` beside the file (the layout open_clip and the hub repositories
       use): its ``quick_gelu``;
    3. a Hugging Face cache folder ``models--org--name/``: the ``quick_gelu`` of the open_clip
       pretrained tags served from that repository (e.g. ``timm/vit_large_patch14_clip_224.openai``).

    Returns:
        ``(quick_gelu, how)``: True/False and where that came from, or ``(None, "")`` when the file
        does not tell.
    """
    import json
    import zipfile

    import open_clip

    path = os.fspath(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        if any(n.endswith("constants.pkl") for n in names) and any("/code/" in n for n in names):
            return True, "it is a TorchScript archive, OpenAI's release format (OpenAI trained CLIP with QuickGELU)"
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "open_clip_config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            cfg = cfg.get("model_cfg", cfg)
            return bool(
                cfg.get("quick_gelu", False)
            ), f"{cfg_path} says quick_gelu={bool(cfg.get('quick_gelu', False))}"
        except (OSError, ValueError, AttributeError):
            pass
    repo = _hub_repo_of(path)
    if repo is not None:
        flags = set()
        for name, tag in open_clip.list_pretrained():
            hub = open_clip.get_pretrained_cfg(name, tag).get("hf_hub", "")
            if hub.rstrip("/") == repo or hub.startswith(repo + "/"):
                flags.add(bool(open_clip.get_pretrained_cfg(name, tag).get("quick_gelu", False)))
        if len(flags) == 1:
            quick = flags.pop()
            return quick, f"it comes from the hub repository {repo}, whose open_clip tags have quick_gelu={quick}"
    return None, ""


def _check_file_activation(
    model_name: str, quick: bool, path: str, stated: bool | None, keys: dict | None = None
) -> None:
    """Refuse a weights file whose training activation differs from the model config's, or is unknown."""
    k = {"model_name": "model_name", "checkpoint": "checkpoint", "quick_gelu": "quick_gelu", **(keys or {})}
    detected, how = checkpoint_activation(path)
    if detected is not None and stated is not None and detected != stated:
        raise ValueError(
            f"{k['quick_gelu']}={stated} contradicts the checkpoint {path!r}: {how}. Drop {k['quick_gelu']} or fix the file."
        )
    trained = detected if detected is not None else stated
    if trained is None:
        raise ValueError(
            f"{k['checkpoint']}={path!r} is refused: a state dict does not say which activation its CLIP was trained "
            f"with, and a GELU network loaded with QuickGELU-trained weights (or the reverse) scores silently "
            f"differently (OpenAI's ViT-L/14: 0.404 instead of 0.338 on the same images). State it: "
            f"{k['quick_gelu']}=true for OpenAI's weights, false for GELU-trained ones (LAION, DataComp, ...); or keep "
            f"the file beside its open_clip_config.json."
        )
    if trained != quick:
        other = model_name.removesuffix("-quickgelu") if quick else model_name + "-quickgelu"
        why = how or f"{k['quick_gelu']}={stated} was stated"
        raise ValueError(
            f"{k['model_name']}={model_name!r} with {k['checkpoint']}={path!r} is refused: {model_name!r} builds "
            f"{'QuickGELU' if quick else 'GELU'} blocks but {why}; the scores would silently differ. Use "
            f"{k['model_name']}={other!r}."
        )


PYTHON_KEYS = {
    "model_name": "model_name",
    "pretrained": "pretrained",
    "checkpoint": "checkpoint",
    "quick_gelu": "quick_gelu",
    "cache_dir": "cache_dir",
}


def _resolve_weights(model_name, pretrained, checkpoint, quick_gelu, cache_dir, local_files_only, keys=None):
    """What :func:`load_clip` loads, checked and found (the tag's weights downloaded when missing and allowed),
    without building the model: ``(schema, weights path or None, the tag's config)``; ``schema`` is True for a
    ``local-dir:``/``hf-hub:`` name (open_clip reads that location itself). ``keys`` name the arguments in
    messages (default: the Python names)."""
    import open_clip

    k = {**PYTHON_KEYS, **(keys or {})}
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(
            f"{k['model_name']}={model_name!r} is invalid: name an open_clip model, e.g. {DEFAULT_MODEL!r}"
        )
    schema = model_name.startswith(("local-dir:", "hf-hub:"))
    if schema and checkpoint is None:
        if model_name.startswith("local-dir:") and not os.path.isfile(
            os.path.join(model_name[len("local-dir:") :], "open_clip_config.json")
        ):
            raise FileNotFoundError(
                f"{k['model_name']}={model_name!r}: no open_clip_config.json in that folder (open_clip's local-dir layout)"
            )
        return True, None, {}
    config = open_clip.get_model_config(model_name)
    if config is None:
        import difflib

        close = difflib.get_close_matches(model_name, open_clip.list_models(), n=4, cutoff=0.5)
        raise ValueError(
            f"{k['model_name']}={model_name!r} is not an open_clip model; e.g. {DEFAULT_MODEL!r}"
            + (f" (close: {', '.join(close)})" if close else "")
            + " (see open_clip.list_models()), or "
            "local-dir:/path/to/a/folder/with/open_clip_config.json"
        )
    quick = bool(config.get("quick_gelu", False))
    tag_cfg = {}
    if checkpoint is not None:
        path = os.fspath(os.path.expanduser(os.fspath(checkpoint)))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{k['checkpoint']}={os.fspath(checkpoint)!r} does not exist (expected a local open_clip weights file)"
            )
        _check_file_activation(model_name, quick, path, quick_gelu, k)
    elif pretrained:
        tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
        if not tag_cfg:
            raise ValueError(
                f"{k['pretrained']}={pretrained!r} is not a tag of {model_name!r}; valid: "
                f"{open_clip.list_pretrained_tags_by_model(model_name)}"
            )
        if tag_cfg.get("quick_gelu", False) and not quick:
            raise ValueError(
                f"{k['model_name']}={model_name!r} with {k['pretrained']}={pretrained!r} is refused: those weights were trained "
                f"with QuickGELU but {model_name!r} builds GELU blocks (silently different scores); use "
                f"{model_name + '-quickgelu'!r}"
            )
        if quick_gelu is not None and bool(tag_cfg.get("quick_gelu", False)) != bool(quick_gelu):
            raise ValueError(
                f"{k['quick_gelu']}={quick_gelu} contradicts {k['pretrained']}={pretrained!r}, whose weights were trained with "
                f"quick_gelu={bool(tag_cfg.get('quick_gelu', False))}; drop {k['quick_gelu']}"
            )
        path = _cached_weights(tag_cfg, cache_dir)
        if path is None:
            source = tag_cfg.get("hf_hub") or tag_cfg.get("url")
            if hub_offline(local_files_only):
                raise CLIPUnavailableError(
                    f"CLIP weights {model_name}/{pretrained} ({source}) are not in the cache "
                    f"({k['cache_dir']}={cache_dir!r}) and offline ({hub_offline_reason(local_files_only)}): download "
                    f"them once where the hub is reachable (same call, or huggingface-cli download) into that cache, "
                    f"or pass {k['checkpoint']}=<local weights file>"
                )
            try:
                path = open_clip.download_pretrained(tag_cfg, cache_dir=cache_dir)
            except Exception as e:  # open_clip and the hub raise many types here
                raise CLIPUnavailableError(
                    f"could not download CLIP weights {model_name}/{pretrained} from {source}: {e}; pass "
                    f"{k['checkpoint']}=<local weights file> or {k['cache_dir']}=<a cache holding them>"
                ) from e
    else:
        path = None
    return False, path, tag_cfg


def check_clip_inputs(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    *,
    checkpoint: str | os.PathLike | None = None,
    quick_gelu: bool | None = None,
    cache_dir: str | None = None,
    local_files_only: bool | None = None,
    keys: dict | None = None,
) -> str | None:
    """Check what :func:`load_clip` will need, before any image is made, without building the network: the model
    name, the tag, a checkpoint's presence and training activation, and the tag's weights in the cache
    (downloaded now when missing and the hub is reachable, so scoring later finds them).

    Args:
        model_name, pretrained, checkpoint, quick_gelu, cache_dir, local_files_only: as for :func:`load_clip`.
        keys: how the caller names each argument in messages (e.g. ``{"model_name": "model.clip.model"}``).

    Returns:
        The weights file that will be loaded (None for a ``local-dir:``/``hf-hub:`` name or random weights).

    Raises:
        ValueError, FileNotFoundError, CLIPUnavailableError: as :func:`load_clip` would, naming the keys.
    """
    return _resolve_weights(model_name, pretrained, checkpoint, quick_gelu, cache_dir, local_files_only, keys)[1]


def load_clip(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    *,
    checkpoint: str | os.PathLike | None = None,
    quick_gelu: bool | None = None,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
    local_files_only: bool | None = None,
):
    """Load an open_clip model, its eval preprocessing and its tokenizer, failing fast when offline.

    Default: ``ViT-L-14-quickgelu`` + ``openai`` = ``openai/clip-vit-large-patch14`` (the paper's). Do not
    use ``ViT-L-14`` with the OpenAI weights: it builds GELU blocks where the weights were trained with
    QuickGELU, and the scores silently change (refused here).

    Weights are looked up, in order: ``checkpoint`` (a local file: an open_clip state dict such as
    ``open_clip_model.safetensors`` from ``timm/vit_large_patch14_clip_224.openai``); the cache
    (``cache_dir``, default the Hugging Face cache); a download -- unless offline, meaning
    ``local_files_only=True``, or (``None``) ``HF_HUB_OFFLINE=1`` or a hub that does not answer a 3 s
    TCP probe, in which case the error comes at once instead of after minutes of retries.

    A weights file carries no activation, so the file route checks it as the tag route does: the
    activation the file was trained with is read from the file's surroundings
    (:func:`checkpoint_activation`) or from ``quick_gelu``, and a file for which neither tells, or
    that disagrees with ``model_name``'s config, is refused. Refusing rather than guessing: the wrong
    activation loads without any error and moves every score (0.338 vs 0.404 for OpenAI's ViT-L/14),
    so only a stated or detectable activation is accepted.

    ``model_name`` may also be open_clip's ``local-dir:/path`` (a folder holding
    ``open_clip_config.json`` and the weights: the config states the activation) or ``hf-hub:org/repo``.

    Args:
        model_name: open_clip model config name (or ``local-dir:`` / ``hf-hub:`` location).
        pretrained: open_clip pretrained tag (ignored when ``checkpoint`` is given or the name has a
            ``local-dir:``/``hf-hub:`` schema; None with no checkpoint = random init, for tests).
        checkpoint: local weights file.
        quick_gelu: whether ``checkpoint`` was trained with QuickGELU, when the file does not tell
            (None: it must tell, see above).
        cache_dir: download/cache directory.
        device: model device.
        local_files_only: True = never download, False = may download, None = auto (see above).

    Returns:
        ``(model, preprocess, tokenizer)``: the model in eval mode; ``preprocess`` maps a PIL image to a
        ``[3, 224, 224]`` tensor (bicubic resize of the short side, centre crop, OpenAI mean/std);
        ``tokenizer`` maps a list of strings to ``[n, 77]`` int64 tokens (truncating long prompts).

    Raises:
        ValueError: an unknown model name or tag; ``ViT-L-14`` with OpenAI (QuickGELU) weights, by
            tag or by file; a file whose training activation is unknown and not stated.
        FileNotFoundError: ``checkpoint`` (or a ``local-dir:`` folder) does not exist.
        CLIPUnavailableError: the weights are not cached and cannot be downloaded.
    """
    import open_clip

    schema, path, tag_cfg = _resolve_weights(
        model_name, pretrained, checkpoint, quick_gelu, cache_dir, local_files_only
    )
    if schema:
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(model_name, device=device)
            tokenizer = open_clip.get_tokenizer(model_name)
        except (OSError, ValueError) as e:
            raise CLIPUnavailableError(f"could not load CLIP {model_name!r}: {e}") from e
        return model.eval(), preprocess, tokenizer
    # a file path loses the tag's preprocessing settings: pass them explicitly (OpenAI mean/std, bicubic)
    model, _, preprocess = open_clip.create_model_and_transforms(
        model_name,
        pretrained=path,
        device=device,
        image_mean=tag_cfg.get("mean"),
        image_std=tag_cfg.get("std"),
        image_interpolation=tag_cfg.get("interpolation"),
        image_resize_mode=tag_cfg.get("resize_mode"),
    )
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(model_name)


# ----------------------------------------------------------------------------------------------
# Scores


def _to_pil_list(images) -> list:
    """Images as a list of RGB PIL images (uint8-quantised)."""
    from PIL import Image

    from ..images import as_pixels

    if isinstance(images, (list, tuple)) and images and isinstance(images[0], Image.Image):
        return [im.convert("RGB") for im in images]
    shape = tuple(getattr(images, "shape", np.shape(images)))
    if len(shape) != 4:
        raise ValueError(f"images has shape {shape}: expected [n, 3, H, W] or [n, H, W, 3], or a list of PIL images")
    arr = as_pixels(images)
    if arr.shape[-1] != 3:
        raise ValueError(f"images has shape {shape}: expected 3 colour channels")
    return [Image.fromarray(a) for a in arr]


def scores_from_embeddings(image_emb: torch.Tensor, text_emb: torch.Tensor) -> np.ndarray:
    """``max(100 cos(image_emb[i], text_emb[i]), 0)`` per row.

    Args:
        image_emb: ``[n, e]`` image embeddings (any norm).
        text_emb: ``[n, e]`` text embeddings (any norm).

    Returns:
        float64 ``[n]``.
    """
    a = torch.nn.functional.normalize(image_emb.double(), dim=-1)
    b = torch.nn.functional.normalize(text_emb.double(), dim=-1)
    return (100.0 * (a * b).sum(-1)).clamp_min(0.0).cpu().numpy()


def clip_scores(
    images,
    prompts: Sequence[str],
    *,
    model,
    preprocess,
    tokenizer,
    batch_size: int = 32,
    device: str | torch.device | None = None,
) -> np.ndarray:
    """Per-image CLIP scores ``max(100 cos(E_img(image_i), E_txt(prompt_i)), 0)``.

    Args:
        images: ``[n, 3, H, W]`` (or ``[n, H, W, 3]``) uint8, floats ``[n, 3, H, W]`` in ``[-1, 1]`` (a
            target's decoded images, quantised to uint8 first exactly as the saved PNG is:
            :func:`specsamp.images.as_pixels`), or a list of PIL images.
        prompts: ``n`` strings, ``prompts[i]`` belonging to image ``i``.
        model: open_clip model (``encode_image``, ``encode_text``), e.g. from :func:`load_clip`.
        preprocess: PIL image -> ``[3, s, s]`` tensor (the model's eval transform).
        tokenizer: list of strings -> ``[n, context_length]`` tokens.
        batch_size: images per forward pass.
        device: where to run (default the model's device).

    Returns:
        float64 ``[n]`` scores in ``[0, 100]``.

    Raises:
        ValueError: ``len(prompts) != n``, bad image shapes or ranges, ``batch_size < 1``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
    pil = _to_pil_list(images)
    prompts = list(prompts)
    if len(prompts) != len(pil):
        raise ValueError(f"got {len(pil)} images but {len(prompts)} prompts: need one prompt per image")
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    out = []
    with torch.no_grad():
        for i in range(0, len(pil), batch_size):
            x = torch.stack([preprocess(im) for im in pil[i : i + batch_size]]).to(device)
            t = tokenizer(prompts[i : i + batch_size]).to(device)
            out.append(scores_from_embeddings(model.encode_image(x).float(), model.encode_text(t).float()))
    return np.concatenate(out) if out else np.zeros(0)


# ----------------------------------------------------------------------------------------------
# Summaries


def _as_1d(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    return a


def summarize(scores) -> dict:
    """Mean, std (ddof = 1) and standard error of the mean of per-image scores.

    Args:
        scores: ``[n]`` numbers.

    Returns:
        ``{"mean", "std", "sem", "n"}`` (std and sem are NaN when ``n = 1``).

    Raises:
        ValueError: empty ``scores``.
    """
    a = _as_1d("scores", scores)
    std = float(a.std(ddof=1)) if a.size > 1 else math.nan
    return {
        "mean": float(a.mean()),
        "std": std,
        "sem": std / math.sqrt(a.size) if a.size > 1 else math.nan,
        "n": int(a.size),
    }
