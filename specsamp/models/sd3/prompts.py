"""Prompt sets for text-to-image runs, and the (prompt, noise) pairing every sampling rule shares.

Section 5.3 of the paper conditions SD3 on 100 captions "drawn uniformly without replacement from the
COCO 2014 validation set" and generates one image per caption for every rule. This module draws such
a set reproducibly (:func:`coco_prompts`), ships a small set of our own captions for smoke runs and
tests (:func:`demo_prompts`), and lays out the images of a run (:func:`image_plan`): image ``i`` gets
the pair ``(prompt_index[i], noise_id[i])``. Pass ``noise_id`` as the sampler's ``indices`` (its
initial noise and every later random number are keyed by ``(seed, noise_id)``, :mod:`specsamp.rng`)
and ``prompt_index`` as conditioning, with the same run seed for every rule, and each rule sees
identical pairs: per-image scores can then be compared pairwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

COCO_CAPTIONS_URL = "http://images.cocodataset.org/annotations/annotations_trainval2014.zip"
"""Archive holding ``annotations/captions_val2014.json`` (COCO 2014, CC BY 4.0 annotations)."""

DEMO_PROMPTS = "data/prompts_demo.txt"
SOURCES = ("coco", "demo", "file")


def _check_count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}={n!r} is invalid: must be an integer >= 1")
    return int(n)


def _rank(seed: int, *key) -> bytes:
    """A seed-keyed pseudo-random sort key: SHA-256 of ``seed`` and ``key`` (platform and version stable)."""
    return hashlib.sha256(":".join(map(str, (int(seed),) + key)).encode()).digest()


def _clean(caption: str) -> str:
    """Collapse the stray whitespace and newlines COCO captions carry."""
    return " ".join(str(caption).split())


def coco_prompt_records(captions_json_path: str | os.PathLike, n: int = 100, seed: int = 0) -> list[dict]:
    """Draw ``n`` COCO captions of ``n`` distinct images, without replacement, keyed by ``seed``.

    Choice (the paper does not pin it): the unit drawn is the *image*, so no two prompts describe the
    same picture. Images are ordered by ``sha256(seed:image_id)`` and the first ``n`` are taken (a
    uniformly random ``n``-subset for a random seed, and prefix-stable: the ``n = 64`` draw is the
    first 64 of the ``n = 100`` draw); each image then contributes the caption minimising
    ``sha256(seed:image_id:annotation_id)`` (a uniform pick among its ~5 captions). The draw depends
    only on the file's content and ``seed`` -- not on the order of the annotations in the file, on
    numpy's random streams, or on the platform.

    Args:
        captions_json_path: path to ``captions_val2014.json`` (inside ``annotations_trainval2014.zip``,
            :data:`COCO_CAPTIONS_URL`), format ``{"annotations": [{"image_id", "id", "caption"}, ...]}``
            (an annotation without ``"id"`` is identified by its position among its image's captions).
        n: number of prompts, ``1 <= n <=`` number of captioned images (40,504 for val2014).
        seed: selection seed.

    Returns:
        ``n`` dicts ``{"image_id": int, "annotation_id": int, "caption": str}`` in draw order; captions
        have their whitespace collapsed.

    Raises:
        FileNotFoundError: no file at ``captions_json_path``.
        ValueError: the file is not a COCO captions file, ``n < 1``, or ``n`` exceeds the number of images.
    """
    n = _check_count("n", n)
    path = os.fspath(captions_json_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"captions_json_path={path!r} does not exist: download {COCO_CAPTIONS_URL} and pass the path of "
            "annotations/captions_val2014.json"
        )
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    anns = data.get("annotations") if isinstance(data, Mapping) else None
    if not isinstance(anns, list) or not anns:
        raise ValueError(
            f"captions_json_path={path!r} is not a COCO captions file: need a non-empty 'annotations' list"
        )
    by_image: dict[int, list[tuple[int, str]]] = {}
    for pos, a in enumerate(anns):
        try:
            image_id = int(a["image_id"])
            caption = _clean(a["caption"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"captions_json_path={path!r}: annotation {pos} lacks an integer 'image_id' or a 'caption'"
            ) from e
        lst = by_image.setdefault(image_id, [])
        lst.append((int(a.get("id", len(lst))), caption))
    if n > len(by_image):
        raise ValueError(f"n={n} is invalid: {path!r} has captions for only {len(by_image)} distinct images")
    images = sorted(by_image, key=lambda i: _rank(seed, "image", i))[:n]
    out = []
    for image_id in images:
        ann_id, caption = min(by_image[image_id], key=lambda c: _rank(seed, "caption", image_id, c[0]))
        out.append({"image_id": image_id, "annotation_id": ann_id, "caption": caption})
    return out


def coco_prompts(captions_json_path: str | os.PathLike, n: int = 100, seed: int = 0) -> list[str]:
    """``n`` COCO-2014 captions of distinct images, drawn without replacement (section 5.3).

    See :func:`coco_prompt_records` for the draw and the errors raised.

    Returns:
        ``n`` caption strings.
    """
    return [r["caption"] for r in coco_prompt_records(captions_json_path, n, seed)]


def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """Prompts from a text file: one per line; blank lines and lines starting with ``#`` are skipped.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file holds no prompt.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"prompt file {p!r} does not exist")
    with open(p, encoding="utf-8") as f:
        out = _parse_lines(f.read())
    if not out:
        raise ValueError(f"prompt file {p!r} holds no prompt (one per line; '#' starts a comment line)")
    return out


def _parse_lines(text: str) -> list[str]:
    return [_clean(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def demo_prompts(n: int | None = None, *, n_key: str = "n") -> list[str]:
    """The first ``n`` prompts of the packaged demo file (20 short captions written for this project).

    For smoke runs and tests; the paper's protocol uses :func:`coco_prompts`.

    Args:
        n: how many (``None``: all).
        n_key: the name of ``n`` in the messages (``n_samples`` from a run's config).

    Returns:
        ``n`` prompt strings.

    Raises:
        ValueError: ``n < 1`` or more than the file holds (the message names ``n_key`` and the largest valid value).
    """
    text = resources.files("specsamp").joinpath(DEMO_PROMPTS).read_text(encoding="utf-8")
    prompts = _parse_lines(text)
    if n is None:
        return prompts
    n = _check_count(n_key, n)
    if n > len(prompts):
        raise ValueError(
            f"{n_key}={n} is invalid with the demo prompts (model.prompts.source=demo): the demo prompt "
            f"file holds {len(prompts)} prompts, one image each; use {n_key}<={len(prompts)}, or another "
            "source (model.prompts.source=coco or file)"
        )
    return prompts[:n]


def load_prompts(
    source: str = "coco",
    n: int = 100,
    seed: int = 0,
    *,
    captions_json: str | os.PathLike | None = None,
    path: str | os.PathLike | None = None,
    prompts: Sequence[str] | None = None,
    n_key: str = "n",
) -> list[str]:
    """Prompts from a config: ``source`` is ``coco``, ``demo`` or ``file`` (or give ``prompts`` directly).

    Args:
        source: ``coco`` (:func:`coco_prompts` on ``captions_json``), ``demo`` (:func:`demo_prompts`),
            ``file`` (the first ``n`` lines of ``path``, :func:`read_prompt_file`).
        n: number of prompts.
        seed: COCO selection seed (unused by the other sources).
        captions_json: path of ``captions_val2014.json`` (``coco``).
        path: prompt file (``file``).
        prompts: an explicit list; overrides ``source``.
        n_key: the name of ``n`` in the messages (``n_samples`` from a run's config, where ``model.prompts.n``
            follows it).

    Returns:
        ``n`` prompt strings (all of ``prompts`` when given).

    Raises:
        ValueError: unknown ``source``, a missing path for it, ``n`` out of range.
        FileNotFoundError: a path that does not exist.
    """
    if prompts is not None:
        out = [_clean(p) for p in prompts]
        if not out or not all(out):
            raise ValueError("prompts must be a non-empty list of non-empty strings")
        return out
    if source not in SOURCES:
        raise ValueError(f"prompts.source={source!r} is invalid; valid: {', '.join(SOURCES)}")
    if source == "coco":
        if not captions_json:
            raise ValueError(
                "model.prompts.captions_json (captions_json= in Python) is required for "
                "model.prompts.source='coco': the path of COCO's captions_val2014.json; or choose "
                "model.prompts.source=demo (built-in prompts) or file (model.prompts.path=...)"
            )
        return coco_prompts(captions_json, n, seed)
    if source == "demo":
        return demo_prompts(n, n_key=n_key)
    if not path:
        raise ValueError(
            "model.prompts.path (path= in Python) is required for model.prompts.source='file': "
            "a text file of one prompt per line"
        )
    out = read_prompt_file(path)
    n = _check_count(n_key, n)
    if n > len(out):
        raise ValueError(
            f"{n_key}={n} is invalid: the prompt file {os.fspath(path)!r} holds {len(out)} prompts, one "
            f"image each; use {n_key}<={len(out)}, or a file with more lines"
        )
    return out[:n]


@dataclass(frozen=True)
class ImagePlan:
    """Which prompt and which noise each image of a run gets; identical for every sampling rule.

    Attributes:
        prompts: the prompt strings, indexed by ``prompt_index``.
        prompt_index: int64 ``[N]``, image ``i``'s prompt.
        noise_id: int64 ``[N]``, image ``i``'s trajectory id: pass it as the sampler's ``indices``; its
            initial noise and all later randomness are keyed by ``(run seed, noise_id)``.
    """

    prompts: tuple[str, ...]
    prompt_index: np.ndarray
    noise_id: np.ndarray

    def __len__(self) -> int:
        return int(self.prompt_index.size)


def image_plan(prompts: Sequence[str], images_per_prompt: int = 1) -> ImagePlan:
    """Lay out ``len(prompts) * images_per_prompt`` images, prompt-major.

    Image ``i`` gets prompt ``i // images_per_prompt`` and noise id ``i``. With one
    image per prompt (the paper), image ``i`` is ``(prompt i, noise i)``.

    Args:
        prompts: the prompt strings.
        images_per_prompt: images per prompt, ``>= 1``.

    Returns:
        :class:`ImagePlan`.

    Raises:
        ValueError: no prompts or ``images_per_prompt < 1``.
    """
    prompts = tuple(prompts)
    if not prompts:
        raise ValueError("prompts must be non-empty")
    r = _check_count("images_per_prompt", images_per_prompt)
    n = len(prompts) * r
    return ImagePlan(
        prompts=prompts,
        prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int64), r),
        noise_id=np.arange(n, dtype=np.int64),
    )
