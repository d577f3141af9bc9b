"""The digits classifier as a torch-fidelity feature extractor (``digits-classifier``).

FID on the digits target is the Frechet distance between Gaussian fits of the classifier's 64-d
penultimate features (Heusel et al. 2017, with a domain classifier in place of Inception, as is usual
for small image sets), computed by :func:`specsamp.metrics.fid.compute_fid` through torch-fidelity's
own machinery (``create_feature_extractor``, ``get_featuresdict_from_dataset``). The reference
statistics (``digits-8x8`` in :data:`specsamp.metrics.fid_inputs.REFERENCE_STATS`) are the same features of
all 1,797 images of scikit-learn's digits.

:func:`register` adds the extractor to torch-fidelity's registry (once); :mod:`specsamp.metrics.fid`
calls it when the name ``digits-classifier`` is asked for.
"""

from __future__ import annotations

import torch
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

NAME = "digits-classifier"
FEATURES = ("features", "logits")


class DigitsClassifierExtractor(FeatureExtractorBase):
    """torch-fidelity extractor: uint8 ``[b, 3, 8, 8]`` (or ``[b, 1, 8, 8]``) -> classifier features / logits.

    Pixels ``p`` map back to ``[-1, 1]`` as ``(p - 127.5) / 127.5`` (inverse of
    :func:`specsamp.images.to_uint8` up to its rounding); colour inputs use their first channel (the
    images are grey, saved as identical channels). Other sizes are resized to 8x8 by area averaging.

    Args:
        name: registry name (``digits-classifier``).
        features_list: requested features, a subset of ``("features", "logits")``.
        feature_extractor_weights_path: a copy of the shipped classifier pickle elsewhere (its SHA-256
            must equal :data:`specsamp.models.digits.CLASSIFIER_SHA256`; any other file is refused
            before unpickling, see :func:`specsamp.models.digits.load_classifier`).
        **kwargs: torch-fidelity's other options (ignored).
    """

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        from ..models.digits import load_classifier

        self.net = load_classifier(feature_extractor_weights_path)

    @staticmethod
    def get_provided_features_list():
        return FEATURES

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return "logits" if metric == "isc" else "features"

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)

    def forward(self, x):
        x = x[:, :1].to(torch.float32).sub(127.5).div(127.5)
        if tuple(x.shape[-2:]) != (8, 8):
            x = torch.nn.functional.adaptive_avg_pool2d(x, (8, 8))
        feats, logits = self.net(x)
        out = {"features": feats, "logits": logits}
        return tuple(out[name] for name in self.features_list)


def register() -> str:
    """Register :class:`DigitsClassifierExtractor` with torch-fidelity under ``digits-classifier`` (idempotent)."""
    if FEATURE_EXTRACTORS_REGISTRY.get(NAME) is not DigitsClassifierExtractor:
        if NAME not in FEATURE_EXTRACTORS_REGISTRY:
            register_feature_extractor(NAME, DigitsClassifierExtractor)
    return NAME
