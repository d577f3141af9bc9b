"""What a run leaves besides its record: images (PNG per image and a grid) and their FID / CLIP scores."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..models.base import Target
from ..sampler import SampleResult


def save_images(result: SampleResult, out_dir: Path) -> Path | None:
    """Decode an image model's samples; write one PNG per image (named by global index) and a grid.

    Returns:
        The images directory, or None for a target that is not an image model.
    """
    target: Target = result.extra["target"]
    if target.decode is None:
        return None
    from .. import images as img

    pics = target.decode(result.samples).cpu()
    ids = result.extra["indices"].cpu()
    img.save_images(pics, Path(out_dir) / "images", indices=ids.tolist())
    img.save_grid(pics[:64], Path(out_dir) / "grid.png")
    return Path(out_dir) / "images"


class MetricError(Exception):
    """A metric that could not be scored after sampling (the record and the images are already saved).

    Attributes:
        errors: metric name -> one-sentence reason.
        values: the metrics that were computed.
        user: True when every reason is the user's to fix (missing weights or reference, a bad metric
            setting): the runner then exits 2; otherwise 1.
    """

    def __init__(self, errors: dict[str, str], user: bool, values: dict | None = None):
        super().__init__(" ".join(errors.values()))
        self.errors = errors
        self.user = user
        self.values = values or {}


FID_KEYS = {
    "reference": "model.fid_ref",
    "feature_extractor": "model.fid_extractor",
    "feature_layer": "model.fid_layer",
    "weights_path": "model.fid_weights",
}
CLIP_KEYS = {
    "model_name": "model.clip.model",
    "pretrained": "model.clip.pretrained",
    "checkpoint": "model.clip.checkpoint",
    "quick_gelu": "model.clip.quick_gelu",
    "cache_dir": "model.clip.cache_dir",
}


def scoring_settings(model) -> tuple:
    """``(fid_ref, fid, clip)`` of a model config or a built :class:`Target`, as :func:`compute_metrics` will use them:
    the reference, :func:`specsamp.metrics.fid.compute_fid`'s keyword arguments, :func:`specsamp.metrics.clip.load_clip`'s
    (None where the model has none)."""
    if isinstance(model, Target):
        return model.fid_ref, model.fid, model.clip
    fid = model.fid_settings() if hasattr(model, "fid_settings") else None
    clip = getattr(model, "clip", None)
    return getattr(model, "fid_ref", None), fid, clip.load_kwargs() if hasattr(clip, "load_kwargs") else None


def check_metrics(names, fid_ref, fid: dict | None, clip: dict | None, n_images: int, count: str) -> list[str]:
    """Refuse, before anything is sampled, what scoring would fail on after it (:func:`compute_metrics`), and say
    what it would score badly.

    ``fid``: the reference (``model.fid_ref``), the extractor (``model.fid_extractor``: a registered name, or
    ``package.module:Class`` that imports and resolves), its layer and weights (``model.fid_weights``, or
    Inception's in the torch hub cache, downloaded now when missing and allowed), and at least
    :data:`specsamp.metrics.fid_inputs.MIN_IMAGES` images (:func:`specsamp.metrics.fid_inputs.check_fid_inputs`; no network is
    loaded). ``clip``: the open_clip model, tag, checkpoint and cached weights (``model.clip.*``,
    :func:`specsamp.metrics.clip.check_clip_inputs`). A model without the metric's inputs (no ``fid_ref``, no
    CLIP settings) is left to the runner's own check.

    Args:
        names: the ``metrics`` list.
        fid_ref, fid, clip: :func:`scoring_settings`.
        n_images: how many images the run will score.
        count: how the config sets that number, for messages (``n_samples=3``).

    Returns:
        Notes to print before sampling: an FID of no more images than feature dimensions
        (:func:`specsamp.metrics.fid_inputs.few_images_warning`), an Inception Score left out for want of images.

    Raises:
        ConfigError: one paragraph naming the key, its value and what is valid.
    """
    notes = []
    for name in names:
        if name == "fid" and fid_ref:
            from ..metrics.fid_inputs import INCEPTION, MIN_IMAGES, check_fid_inputs, few_images_warning
            from ..metrics.isc import SPLITS, isc_layer

            if n_images < MIN_IMAGES:
                raise ConfigError(
                    f"metrics=[fid] is invalid with {count}: an FID needs at least {MIN_IMAGES} images (the "
                    "covariance of one image is undefined), and a usable one more images than feature "
                    "dimensions (2049 for Inception); raise n_samples, or drop fid from metrics."
                )
            try:
                checked = ("feature_extractor", "feature_layer", "weights_path", "allow_download", "cache_dir")
                info = check_fid_inputs(
                    fid_ref, **{k: v for k, v in (fid or {}).items() if k in checked}, keys=FID_KEYS
                )
            except (FileNotFoundError, ValueError, ImportError) as e:
                raise ConfigError(f"metrics=[fid] cannot be scored: {e}") from None
            warning = few_images_warning(n_images, info["dim"])
            if warning is not None:
                notes.append(f"metrics=[fid] with {count}: {warning} It is scored and recorded with that warning.")
            if n_images < SPLITS and isc_layer((fid or {}).get("feature_extractor", INCEPTION)):
                notes.append(
                    f"metrics=[fid] with {count}: the Inception Score beside it needs at least {SPLITS} images "
                    f"(one per split), so the record will have no isc."
                )
        elif name == "clip" and clip is not None:
            from ..metrics.clip import check_clip_inputs

            try:
                check_clip_inputs(**clip, keys=CLIP_KEYS)
            except (OSError, ValueError, ImportError) as e:  # CLIPUnavailableError is an OSError
                raise ConfigError(f"metrics=[clip] cannot be scored: {e}") from None
    return notes


def check_scoring(run, model, n_images: int, shard: bool) -> list[str]:
    """:func:`check_metrics` of ``run.metrics`` for ``n_images`` images, with the settings of ``model`` (the
    config's model before it is built, or a given :class:`Target`; :func:`scoring_settings`).

    Args:
        run: the typed config.
        model: ``run.model`` or a built target.
        n_images: the images this run scores.
        shard: the run samples a subset of ``n_samples`` (a shard, ``indices``): the messages say so.

    Returns:
        The notes to print (none without metrics).
    """
    count = f"n_samples={run.n_samples}" + (f" (this shard scores {n_images})" if shard else "")
    settings = scoring_settings(model)
    return check_metrics(run.metrics, *settings, n_images, count) if run.metrics else []


def check_target_scores(run, target: Target) -> None:
    """Refuse, before sampling, a metric that the built target has no inputs for: images (``decode``) for every
    metric, prompts for ``clip``, reference statistics for ``fid``.

    Raises:
        ConfigError: names the metric, the model and the models that have it.
    """
    for m in run.metrics:
        if target.decode is None or (m == "clip" and target.prompts_for is None) or (m == "fid" and not target.fid_ref):
            need = (
                "images"
                if target.decode is None
                else "prompts"
                if m == "clip"
                else "model.fid_ref (reference statistics)"
            )
            raise ConfigError(
                f"metrics=[{m}] is invalid for model={run.model.name}: it needs {need}, which this model does not "
                "have (fid: model=digits, cifar10 or ffhq; clip: model=sd3)."
            )


def compute_metrics(names, result: SampleResult, image_dir: Path | None, device: str = "cpu") -> dict:
    """Score the saved images: ``fid`` (torch-fidelity against ``model.fid_ref``) and ``clip`` (per image).

    Both read the PNGs that :func:`save_images` wrote for this run's indices (uint8, named by global
    index; other files in the folder are ignored), so a run's scores are those of its files, and the
    expensive decode runs once. Every metric is attempted, whatever
    happens to the others.

    Args:
        names: metric names (``fid``, ``clip``).
        result: the run's result (``extra["target"]`` and ``extra["indices"]`` are used).
        image_dir: the folder :func:`save_images` wrote, or None for a target without images.
        device: where the scoring networks run.

    Returns:
        ``fid`` (float) and ``fid_detail`` (``compute_fid``'s other fields); beside the FID, when its
        extractor has class logits and there are at least 10 images, ``isc``, ``isc_se`` and
        ``isc_detail`` (:func:`specsamp.metrics.isc.inception_score`); ``clip_score``,
        ``clip_score_sem`` and ``clip_scores`` (per image, in index order).

    Raises:
        MetricError: after trying every metric, when one or more failed (``values`` holds the others).
    """
    out: dict = {}
    errors: dict[str, str] = {}
    user = True
    target: Target = result.extra["target"]
    ids = sorted(int(i) for i in result.extra["indices"])
    pixels = None
    from .. import images as img

    for name in names:
        try:
            if image_dir is None:
                raise ConfigError(f"metrics=[{name}] is invalid: this model has no images to score.")
            if name == "fid":
                from ..metrics.fid import compute_fid

                if not target.fid_ref:
                    raise ConfigError(
                        "metrics=[fid] needs model.fid_ref (reference statistics: name, URL or .npz path)."
                    )
                pixels = img.load_images(image_dir, indices=ids) if pixels is None else pixels  # this run's, by index
                res = compute_fid(pixels, target.fid_ref, device=device, **(target.fid or {}))
                res["samples"] = str(image_dir)
                out["fid"] = float(res.pop("fid"))
                out["fid_detail"] = res
                from ..metrics.isc import SPLITS, inception_score, isc_layer

                fid_kw = dict(target.fid or {})
                if isc_layer(fid_kw.get("feature_extractor", "inception-v3-compat")) and len(pixels) >= SPLITS:
                    fid_kw.pop("feature_layer", None)  # the FID's feature; the score reads the class logits
                    isc = inception_score(pixels, device=device, **fid_kw)
                    out.update(isc=isc["isc"], isc_se=isc["isc_se"], isc_detail=isc)
            elif name == "clip":
                from ..metrics import clip

                if target.prompts_for is None:
                    raise ConfigError("metrics=[clip] is invalid: the model has no prompts.")
                model, preprocess, tokenizer = clip.load_clip(**(target.clip or {}), device=device)
                pixels = img.load_images(image_dir, indices=ids) if pixels is None else pixels
                scores = clip.clip_scores(
                    pixels, target.prompts_for(ids), model=model, preprocess=preprocess, tokenizer=tokenizer
                )
                summ = clip.summarize(scores)
                out.update(clip_score=summ["mean"], clip_score_sem=summ["sem"], clip_scores=[float(x) for x in scores])
            else:
                raise ConfigError(f"metrics=[{name}] is invalid: valid entries are fid, clip.")
        except (ConfigError, OSError, ValueError, ImportError, KeyError) as e:
            errors[name] = (
                f"metrics=[{name}] could not be computed: {e}" if not str(e).startswith("metrics=") else str(e)
            )
        except (
            RuntimeError
        ) as e:  # a download that failed (fid.make_extractor) is the user's to fix; anything else is not
            if str(e).startswith("could not download"):
                errors[name] = f"metrics=[{name}] could not be computed: {e}"
            else:
                user = False
                errors[name] = f"metrics=[{name}] failed with {type(e).__name__}: {e}."
        except Exception as e:  # noqa: BLE001 - the samples are saved; report instead of losing the run
            user = False
            errors[name] = f"metrics=[{name}] failed with {type(e).__name__}: {e}."
    if errors:
        raise MetricError(errors, user, out)
    return out
