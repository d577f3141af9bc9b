"""Inception Score beside FID, computed by torch-fidelity from the same feature extractor.

``IS = exp(E_x KL(p(y | x) || p(y)))`` (Salimans et al. 2016), with ``p(y | x)`` the softmax of the
extractor's class logits and ``p(y)`` their mean over a split; the images are cut into ``splits``
equal splits (torch-fidelity shuffles them with its fixed seed 2020) and the score is the mean over
splits. torch-fidelity's ``isc_features_to_metric`` does the arithmetic; its ``inception_score_std``
is the population standard deviation of the split scores, so the standard error of their mean is
``std / sqrt(splits - 1)`` (the sample standard deviation over ``sqrt(splits)``), recorded as ``isc_se``.

The logits come from :func:`specsamp.metrics.fid.extract_features` with the extractor's own default
layer for the ``isc`` metric: ``logits_unbiased`` for Inception (``inception-v3-compat``, as
torch-fidelity and the paper's authors use), ``logits`` for the digits classifier. That is a second
pass over the images with the same network the FID uses (the FID pass keeps only its pooled features).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from .fid import INCEPTION, extract_features, registered_extractor

SPLITS = 10  # torch-fidelity's and Salimans et al.'s default


def isc_layer(feature_extractor=INCEPTION) -> str | None:
    """The extractor's class-logit feature for the Inception Score, or ``None`` when it has none.

    ``feature_extractor``: a torch-fidelity registry name (``inception-v3-compat``, ``digits-classifier``);
    anything else (classes, instances, callables, import paths) gives ``None``.
    """
    if not isinstance(feature_extractor, str):
        return None
    cls = registered_extractor(feature_extractor)
    if cls is None:
        return None
    try:
        layer = cls.get_default_feature_layer_for_metric("isc")
    except Exception:  # noqa: BLE001 - extractors without a classification head refuse the metric
        return None
    return layer if layer in cls.get_provided_features_list() and "logits" in str(layer) else None


def isc_from_logits(logits, splits: int = SPLITS) -> dict:
    """Inception Score of class logits ``[N, C]`` (any float dtype), by torch-fidelity's ``isc_features_to_metric``.

    Returns:
        ``{"isc": mean over splits, "isc_std": torch-fidelity's std over splits, "isc_se": std / sqrt(splits - 1),
        "isc_splits": splits, "n_samples": N}``.

    Raises:
        ValueError: ``logits`` not 2-d, ``splits < 2``, or fewer images than splits.
    """
    from torch_fidelity.metric_isc import KEY_METRIC_ISC_MEAN, KEY_METRIC_ISC_STD, isc_features_to_metric

    t = torch.as_tensor(np.asarray(logits))
    if t.ndim != 2:
        raise ValueError(f"logits of shape {tuple(t.shape)} are invalid: need [N, classes]")
    if isinstance(splits, bool) or int(splits) < 2:
        raise ValueError(f"splits={splits!r} is invalid: must be an integer >= 2 (the s.e. needs two splits)")
    if t.shape[0] < splits:
        raise ValueError(f"{t.shape[0]} images are too few for splits={splits}: need at least one image per split")
    res = isc_features_to_metric(t, splits=int(splits))
    std = float(res[KEY_METRIC_ISC_STD])
    return {
        "isc": float(res[KEY_METRIC_ISC_MEAN]),
        "isc_std": std,
        "isc_se": std / math.sqrt(int(splits) - 1),
        "isc_splits": int(splits),
        "n_samples": int(t.shape[0]),
    }


def inception_score(
    samples,
    *,
    feature_extractor=INCEPTION,
    feature_layer: str | None = None,
    weights_path: str | os.PathLike | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    allow_download: bool = True,
    splits: int = SPLITS,
) -> dict:
    """Inception Score of saved samples (a folder, or uint8 / ``[-1, 1]`` images as :func:`extract_features` takes).

    Args:
        samples: the images.
        feature_extractor, weights_path, batch_size, device, allow_download: as for
            :func:`specsamp.metrics.fid.compute_fid` (the same extractor the FID used).
        feature_layer: the logit feature (default :func:`isc_layer`).
        splits: number of splits (10).

    Returns:
        :func:`isc_from_logits`'s dict plus ``feature_extractor`` and ``feature_layer``.

    Raises:
        ValueError: the extractor has no class logits (e.g. DINOv2), or see :func:`isc_from_logits`.
        FileNotFoundError, RuntimeError: see :func:`specsamp.metrics.fid.make_extractor`.
    """
    layer = feature_layer or isc_layer(feature_extractor)
    if layer is None:
        raise ValueError(
            f"feature_extractor={feature_extractor!r} has no class logits: the Inception Score needs a "
            f"classifier's logits (inception-v3-compat or digits-classifier)"
        )
    logits = extract_features(
        samples,
        feature_extractor,
        layer,
        weights_path=weights_path,
        batch_size=batch_size,
        device=device,
        allow_download=allow_download,
    )
    return {**isc_from_logits(logits, splits), "feature_extractor": str(feature_extractor), "feature_layer": layer}
