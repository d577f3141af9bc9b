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
                    raise ConfigError("metrics=[fid] needs model.fid_ref (reference statistics: name, URL or .npz path).")
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
                scores = clip.clip_scores(pixels, target.prompts_for(ids), model=model, preprocess=preprocess, tokenizer=tokenizer)
                summ = clip.summarize(scores)
                out.update(clip_score=summ["mean"], clip_score_sem=summ["sem"], clip_scores=[float(x) for x in scores])
            else:
                raise ConfigError(f"metrics=[{name}] is invalid: valid entries are fid, clip.")
        except (ConfigError, OSError, ValueError, ImportError, KeyError) as e:
            errors[name] = f"metrics=[{name}] could not be computed: {e}" if not str(e).startswith("metrics=") else str(e)
        except Exception as e:  # noqa: BLE001 - the samples are saved; report instead of losing the run
            user = False
            errors[name] = f"metrics=[{name}] failed with {type(e).__name__}: {e}."
    if errors:
        raise MetricError(errors, user, out)
    return out
