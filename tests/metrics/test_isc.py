"""Inception Score beside FID (specsamp.metrics.isc): torch-fidelity's arithmetic, its standard error, the
digits classifier's logits, and the runner recording ``isc`` / ``isc_se`` next to ``fid``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch_fidelity")
from helpers import run_digits_with_fid  # noqa: E402

from specsamp.metrics.isc import inception_score, isc_from_logits, isc_layer  # noqa: E402


def _reference_is(logits: np.ndarray, splits: int) -> tuple[float, float]:
    """Salimans et al.'s formula in numpy, on torch-fidelity's shuffle (RandomState(2020))."""
    x = logits[np.random.RandomState(2020).permutation(len(logits))].astype(np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    n = len(x)
    scores = []
    for i in range(splits):
        c = p[i * n // splits : (i + 1) * n // splits]
        q = c.mean(0, keepdims=True)
        scores.append(np.exp((c * (np.log(c) - np.log(q))).sum(1).mean()))
    return float(np.mean(scores)), float(np.std(scores, ddof=1) / np.sqrt(splits))


def test_isc_equals_the_formula_and_its_standard_error():
    """Random logits (seed 0, 503 images, 7 classes, 10 splits): mean and s.e. agree with numpy to 1e-10
    (float64 arithmetic on both sides; the only difference is summation order)."""
    logits = 3 * np.random.default_rng(0).standard_normal((503, 7))
    got = isc_from_logits(logits)
    want, se = _reference_is(logits, 10)
    assert got["isc"] == pytest.approx(want, rel=1e-10)
    assert got["isc_se"] == pytest.approx(se, rel=1e-10)
    assert got["n_samples"] == 503 and got["isc_splits"] == 10
    # equal rows carry no information: IS = 1 exactly, no spread
    flat = isc_from_logits(np.tile([[1.0, 2.0, 3.0]], (40, 1)))
    assert flat["isc"] == pytest.approx(1.0, abs=1e-12) and flat["isc_se"] == pytest.approx(0.0, abs=1e-12)


def test_isc_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="splits"):
        isc_from_logits(np.zeros((20, 3)), splits=1)
    with pytest.raises(ValueError, match="too few"):
        isc_from_logits(np.zeros((5, 3)))
    with pytest.raises(ValueError, match="shape"):
        isc_from_logits(np.zeros(5))
    assert isc_layer("inception-v3-compat") == "logits_unbiased"
    assert isc_layer("digits-classifier") == "logits"
    assert isc_layer(lambda x: x) is None
    with pytest.raises(ValueError, match="no class logits"):
        inception_score(np.zeros((10, 8, 8, 1), np.uint8), feature_extractor=lambda x: x)


def test_one_registry_lookup_serves_the_fid_and_the_inception_score():
    """`registered_extractor` registers the shipped digits classifier on first use and answers None for an
    unknown name; make_extractor refuses that name with the registered ones listed."""
    from specsamp.metrics.fid import make_extractor, registered_extractor

    cls = registered_extractor("digits-classifier")
    assert cls is not None and "logits" in cls.get_provided_features_list()
    assert registered_extractor("no-such-extractor") is None and isc_layer("no-such-extractor") is None
    with pytest.raises(ValueError, match="no-such-extractor.*registered"):
        make_extractor("no-such-extractor", device="cpu")


def test_isc_of_real_digits_is_near_the_number_of_classes():
    """All 1,797 digits through the shipped classifier (98.7% held-out accuracy, classes near balanced):
    p(y|x) is nearly one-hot and p(y) nearly uniform, so IS is close to 10 (above 8); uniform noise
    images are classified into few classes, far lower."""
    pytest.importorskip("sklearn")
    import torch

    from specsamp.images import to_uint8
    from specsamp.models.digits import load_digits_data

    x, _ = load_digits_data()
    real = inception_score(to_uint8(x), feature_extractor="digits-classifier", device="cpu")
    assert real["feature_layer"] == "logits" and 8 < real["isc"] <= 10
    noise = inception_score(
        to_uint8(torch.rand(len(x), 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1),
        feature_extractor="digits-classifier",
        device="cpu",
    )
    assert noise["isc"] < 0.5 * real["isc"]


def test_runner_records_isc_beside_fid(tmp_path):
    pytest.importorskip("sklearn")
    stdout, rec = run_digits_with_fid(tmp_path, steps=10, n_samples=20)
    assert "IS " in stdout, stdout
    assert 1 <= rec["isc"] <= 10 and rec["isc_se"] >= 0
    assert rec["metrics"]["isc_detail"]["feature_layer"] == "logits" and rec["metrics"]["fid"] == rec["fid"]
