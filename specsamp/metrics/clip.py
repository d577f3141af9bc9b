"""CLIP score of generated images against their prompts (paper section 5.3, Table 1).

Per image, ``score = max(100 * cos(E_img(image), E_txt(prompt)), 0)`` -- the definition of Hessel et
al. (2021) with weight 100, as ``torchmetrics.multimodal.CLIPScore`` computes it -- with the paper's
model, ``openai/clip-vit-large-patch14``. In open_clip that is ``ViT-L-14-quickgelu`` with
``pretrained="openai"``: OpenAI trained CLIP with the QuickGELU activation ``x * sigmoid(1.702 x)``,
and the plain ``ViT-L-14`` config builds exact-GELU blocks, so loading the OpenAI weights into it gives
a silently different network (and different scores). :func:`load_clip` refuses that combination.

Scores are per image, so two sampling rules run on the same (prompt, noise) pairs
(:mod:`specsamp.prompts`) can be compared pairwise (:func:`paired_difference`, :func:`compare_rules`);
Table 1 reports the mean and the standard error of the mean over the 100 prompts
(:func:`summarize`). Images are quantised to uint8 before scoring, so scoring tensors in memory and
scoring the saved PNGs give the same numbers.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

DEFAULT_MODEL = "ViT-L-14-quickgelu"
DEFAULT_PRETRAINED = "openai"


class CLIPUnavailableError(OSError):
    """The CLIP weights could not be found locally or fetched."""


# ----------------------------------------------------------------------------------------------
# Loading


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face Hub opens within ``timeout`` s (True behind a proxy)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


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


def load_clip(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    *,
    checkpoint: str | os.PathLike | None = None,
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

    Args:
        model_name: open_clip model config name.
        pretrained: open_clip pretrained tag (ignored when ``checkpoint`` is given; None with no
            checkpoint = random init, for tests).
        checkpoint: local weights file.
        cache_dir: download/cache directory.
        device: model device.
        local_files_only: True = never download, False = may download, None = auto (see above).

    Returns:
        ``(model, preprocess, tokenizer)``: the model in eval mode; ``preprocess`` maps a PIL image to a
        ``[3, 224, 224]`` tensor (bicubic resize of the short side, centre crop, OpenAI mean/std);
        ``tokenizer`` maps a list of strings to ``[n, 77]`` int64 tokens (truncating long prompts).

    Raises:
        ValueError: an unknown model name or tag, or ``ViT-L-14`` with OpenAI (QuickGELU) weights.
        FileNotFoundError: ``checkpoint`` does not exist.
        CLIPUnavailableError: the weights are not cached and cannot be downloaded.
    """
    import open_clip

    if open_clip.get_model_config(model_name) is None:
        raise ValueError(f"model_name={model_name!r} is not an open_clip model; e.g. {DEFAULT_MODEL!r} (see open_clip.list_models())")
    quick = bool(open_clip.get_model_config(model_name).get("quick_gelu", False))
    tag_cfg = {}
    if checkpoint is not None:
        path = os.fspath(os.path.expanduser(os.fspath(checkpoint)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint={os.fspath(checkpoint)!r} does not exist (expected a local open_clip weights file)")
    elif pretrained:
        tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
        if not tag_cfg:
            raise ValueError(
                f"pretrained={pretrained!r} is not a tag of {model_name!r}; valid: "
                f"{open_clip.list_pretrained_tags_by_model(model_name)}"
            )
        if tag_cfg.get("quick_gelu", False) and not quick:
            raise ValueError(
                f"model_name={model_name!r} with pretrained={pretrained!r} is refused: those weights were trained "
                f"with QuickGELU but {model_name!r} builds GELU blocks (silently different scores); use "
                f"{model_name + '-quickgelu'!r}"
            )
        path = _cached_weights(tag_cfg, cache_dir)
        if path is None:
            offline = bool(local_files_only) if local_files_only is not None else (_env_true("HF_HUB_OFFLINE") or not _hub_reachable())
            source = tag_cfg.get("hf_hub") or tag_cfg.get("url")
            if offline:
                raise CLIPUnavailableError(
                    f"CLIP weights {model_name}/{pretrained} ({source}) are not in the cache (cache_dir={cache_dir!r}) and "
                    "this machine is offline: download them once on a connected machine (same call, or "
                    "huggingface-cli download) into that cache, or pass checkpoint=<local weights file>"
                )
            try:
                path = open_clip.download_pretrained(tag_cfg, cache_dir=cache_dir)
            except Exception as e:  # open_clip and the hub raise many types here
                raise CLIPUnavailableError(
                    f"could not download CLIP weights {model_name}/{pretrained} from {source}: {e}; pass "
                    "checkpoint=<local weights file> or cache_dir=<a cache holding them>"
                ) from e
    else:
        path = None
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

    if isinstance(images, (list, tuple)) and images and isinstance(images[0], Image.Image):
        return [im.convert("RGB") for im in images]
    arr = images.detach().cpu() if isinstance(images, torch.Tensor) else torch.as_tensor(np.asarray(images))
    if arr.ndim != 4:
        raise ValueError(f"images has shape {tuple(arr.shape)}: expected [n, 3, H, W] or [n, H, W, 3], or a list of PIL images")
    if arr.shape[1] != 3 and arr.shape[-1] == 3:
        arr = arr.permute(0, 3, 1, 2)
    if arr.shape[1] != 3:
        raise ValueError(f"images has shape {tuple(arr.shape)}: expected 3 colour channels")
    if arr.dtype != torch.uint8:
        arr = arr.float()
        if float(arr.min()) < 0 or float(arr.max()) > 1:
            raise ValueError("float images must lie in [0, 1] (or pass uint8)")
        arr = (arr * 255).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in arr]


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
        images: ``[n, 3, H, W]`` (or ``[n, H, W, 3]``) uint8, or floats in ``[0, 1]`` (quantised to uint8
            first, as a saved PNG would be), or a list of PIL images.
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
# Summaries and paired comparisons


def _as_1d(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    return a


def summarize(scores) -> dict:
    """Mean, std (ddof = 1) and standard error of the mean of per-image (or per-prompt) scores.

    Args:
        scores: ``[n]`` numbers.

    Returns:
        ``{"mean", "std", "sem", "n"}`` (std and sem are NaN when ``n = 1``).

    Raises:
        ValueError: empty ``scores``.
    """
    a = _as_1d("scores", scores)
    std = float(a.std(ddof=1)) if a.size > 1 else math.nan
    return {"mean": float(a.mean()), "std": std, "sem": std / math.sqrt(a.size) if a.size > 1 else math.nan, "n": int(a.size)}


def average_by_prompt(scores, prompt_index) -> np.ndarray:
    """Mean score per prompt (for several images per prompt): ``[num_prompts]``, prompts in index order.

    Raises:
        ValueError: lengths differ.
    """
    a = _as_1d("scores", scores)
    idx = np.asarray(prompt_index, dtype=np.int64).reshape(-1)
    if idx.size != a.size:
        raise ValueError(f"scores has {a.size} entries but prompt_index has {idx.size}")
    uniq, inv = np.unique(idx, return_inverse=True)
    return np.bincount(inv, weights=a) / np.bincount(inv)


def paired_difference(a, b) -> dict:
    """Paired comparison of two rules on the same (prompt, noise) pairs: statistics of ``a - b``.

    The pairing removes the prompt-to-prompt variance, so the standard error of the difference is much
    smaller than that of either mean.

    Args:
        a: ``[n]`` scores of one rule.
        b: ``[n]`` scores of the other, same order.

    Returns:
        ``{"mean", "std", "sem", "n"}`` of ``a - b`` (:func:`summarize`).

    Raises:
        ValueError: empty or of different lengths.
    """
    x, y = _as_1d("a", a), _as_1d("b", b)
    if x.size != y.size:
        raise ValueError(f"paired scores must have equal lengths, got {x.size} and {y.size}")
    return summarize(x - y)


def compare_rules(scores: Mapping[str, object], baseline: str) -> dict[str, dict]:
    """Every rule against ``baseline``, pairwise: ``{rule: paired_difference(scores[rule], scores[baseline])}``.

    Args:
        scores: rule name -> ``[n]`` per-image (or per-prompt) scores, all in the same order.
        baseline: the reference rule's name (e.g. ``"standard"``, the target sampler).

    Returns:
        one entry per rule other than ``baseline``.

    Raises:
        ValueError: ``baseline`` missing, or lengths that differ.
    """
    if baseline not in scores:
        raise ValueError(f"baseline={baseline!r} is not among the rules {sorted(scores)}")
    return {k: paired_difference(v, scores[baseline]) for k, v in scores.items() if k != baseline}
