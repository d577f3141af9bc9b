"""FID through torch-fidelity with a tiny feature extractor, against a direct numpy/scipy computation."""

from __future__ import annotations

import urllib.error

import numpy as np
import pytest
import scipy.linalg
import torch

pytest.importorskip("torch_fidelity")
from torch_fidelity.feature_extractor_base import FeatureExtractorBase  # noqa: E402
from torch_fidelity.metric_fid import fid_statistics_to_metric  # noqa: E402

from specsamp.images import save_images, to_uint8  # noqa: E402
from specsamp.metrics import fid as fid_mod  # noqa: E402
from specsamp.metrics.fid import (  # noqa: E402
    INCEPTION,
    INCEPTION_URL,
    Statistics,
    compute_fid,
    extract_features,
    feature_statistics,
    fid_rounding_bound,
    frechet_distance,
    frechet_distance_to_features,
    load_statistics,
    make_extractor,
)

_PROJ = torch.randn(48, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def tiny_features(x: torch.Tensor) -> torch.Tensor:
    """uint8 [b, 3, H, W] -> 4x4 average pool -> fixed projection + tanh -> [b, 8] float64."""
    pooled = torch.nn.functional.adaptive_avg_pool2d(x.double() / 127.5 - 1, 4).reshape(x.shape[0], -1)
    return torch.tanh(pooled @ _PROJ.to(x.device) / 48**0.5)


class TinyExtractor(FeatureExtractorBase):
    NAME = "specsamp-test-tiny"

    def __init__(self, name, features_list, **kwargs):
        super().__init__(name, features_list)

    @staticmethod
    def get_provided_features_list():
        return ("tiny",)

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return "tiny"

    @staticmethod
    def can_be_compiled():
        return False

    def forward(self, x):
        assert x.dtype == torch.uint8 and x.shape[1] == 3
        return (tiny_features(x),)


def direct_fid(a: np.ndarray, b: np.ndarray) -> float:
    """Textbook FID on features [N, F] with scipy.linalg.sqrtm (TTUR / EDM fid.py formula)."""
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def _images(n, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1, 1, 8)[None, None, :, None] * torch.linspace(-1, 1, 8)[None, None, None, :]
    x = 0.6 * torch.rand(n, 3, 1, 1, generator=g) * base + 0.4 * torch.randn(n, 3, 8, 8, generator=g) + shift
    return x.clamp(-1, 1)


def test_fid_end_to_end_matches_direct_computation(tmp_path):
    a, b = _images(40, seed=0), _images(36, seed=1, shift=0.2)
    ua, ub = to_uint8(a), to_uint8(b)
    save_images(ua[:25], tmp_path / "run")
    save_images(ua[25:], tmp_path / "run", start_index=25)
    save_images(b, tmp_path / "ref_png")
    res = compute_fid(
        tmp_path / "run", tmp_path / "ref_png", feature_extractor=TinyExtractor, device="cpu", batch_size=16
    )
    fa = tiny_features(torch.from_numpy(ua).permute(0, 3, 1, 2)).numpy()
    fb = tiny_features(torch.from_numpy(ub).permute(0, 3, 1, 2)).numpy()
    want = direct_fid(fa, fb)
    assert want > 1e-3
    assert res["fid"] == pytest.approx(want, rel=1e-8, abs=1e-10)
    assert res["n_samples"] == 40 and res["n_reference"] == 36
    assert res["feature_extractor"] == "specsamp-test-tiny" and res["feature_layer"] == "tiny"
    # per-image features come back in index order
    np.testing.assert_allclose(extract_features(tmp_path / "run", TinyExtractor, device="cpu"), fa, rtol=1e-12)
    # precomputed reference statistics (.npz with mu/sigma, EDM's format)
    ref = feature_statistics(fb).save(tmp_path / "ref.npz")
    res2 = compute_fid(ua, ref, feature_extractor=TinyExtractor, device="cpu")
    assert res2["fid"] == pytest.approx(want, rel=1e-8, abs=1e-10)
    # a plain callable as the extractor; identical sets give 0
    res3 = compute_fid(a, (fa.mean(0), np.cov(fa, rowvar=False)), feature_extractor=tiny_features, device="cpu")
    assert (
        0.0
        <= res3["fid"]
        <= fid_rounding_bound(np.cov(fa, rowvar=False), np.cov(fa, rowvar=False), fa.mean(0), fa.mean(0))
    )


def test_frechet_distance_against_scipy_and_torch_fidelity():
    g = np.random.default_rng(0)
    f = 6
    a, b = g.normal(size=(f, f)), g.normal(size=(f, f))
    s1, s2 = a @ a.T + 0.1 * np.eye(f), b @ b.T + 0.1 * np.eye(f)
    mu1, mu2 = g.normal(size=f), g.normal(size=f)
    ours = frechet_distance(mu1, s1, mu2, s2)
    ref = float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real))
    tf = fid_statistics_to_metric({"mu": mu1, "sigma": s1}, {"mu": mu2, "sigma": s2}, False)
    assert ours == pytest.approx(ref, rel=1e-10)
    assert ours == pytest.approx(tf["frechet_inception_distance"], rel=1e-10)
    assert 0.0 <= frechet_distance(mu1, s1, mu1, s1) <= fid_rounding_bound(s1, s1, mu1, mu1)
    # rank-deficient covariances (fewer samples than features) stay finite and real
    x, y = g.normal(size=(3, f)), g.normal(size=(4, f))
    st1, st2 = feature_statistics(x), feature_statistics(y)
    d = frechet_distance(st1.mu, st1.sigma, st2.mu, st2.sigma)
    assert np.isfinite(d) and d > 0
    with pytest.raises(ValueError, match="shapes"):
        frechet_distance(mu1, s1, mu2[:3], s2)
    with pytest.raises(ValueError, match="N >= 2"):
        feature_statistics(np.zeros((1, 3)))


def test_missing_inception_weights_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError) as e:
        make_extractor(INCEPTION, allow_download=False, device="cpu")
    msg = str(e.value)
    assert INCEPTION_URL in msg and str(tmp_path / "torch" / "hub" / "checkpoints") in msg and "weights_path" in msg

    def offline(*a, **k):
        raise urllib.error.URLError("Name or service not known")

    import torch_fidelity.feature_extractor_inceptionv3 as inc

    monkeypatch.setattr(inc, "load_state_dict_from_url", offline)
    with pytest.raises(RuntimeError, match="could not download the Inception weights"):
        make_extractor(INCEPTION, allow_download=True, device="cpu")
    with pytest.raises(FileNotFoundError, match="weights_path"):
        make_extractor(INCEPTION, weights_path=tmp_path / "missing.pth", device="cpu")
    with pytest.raises(ValueError, match="feature_extractor='nope'"):
        make_extractor("nope", device="cpu")


def test_reference_statistics_missing_or_malformed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError) as e:
        load_statistics("cifar10-32x32", download=False)
    assert fid_mod.REFERENCE_STATS["cifar10-32x32"] in str(e.value)
    assert str(tmp_path / "cache" / "fid-refs" / "cifar10-32x32.npz") in str(e.value)
    np.savez(tmp_path / "bad.npz", mu=np.zeros(3))
    with pytest.raises(KeyError, match="sigma"):
        load_statistics(tmp_path / "bad.npz")
    st = Statistics(np.ones(3), np.eye(3), 7)
    back = load_statistics(st.save(tmp_path / "ok.npz"))
    assert back.n == 7 and np.array_equal(back.sigma, np.eye(3))


@pytest.mark.slow
def test_inception_path_with_local_weights(tmp_path):
    """The real inception-v3-compat path (resize to 299, pool3 2048-d) with randomly initialised weights
    saved locally, so nothing is downloaded (~15 s on 2 CPU cores)."""
    from unittest import mock

    import torch_fidelity.feature_extractor_inceptionv3 as inc

    with (
        mock.patch.object(inc, "load_state_dict_from_url", lambda *a, **k: None),
        mock.patch.object(inc.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None),
    ):
        net = inc.FeatureExtractorInceptionV3(INCEPTION, ["2048"])
    weights = tmp_path / "inception.pth"
    torch.save(net.state_dict(), weights)
    imgs = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    feats = extract_features(imgs, weights_path=weights, device="cpu", batch_size=2)
    assert feats.shape == (4, 2048) and np.isfinite(feats).all()
    direct = net.eval()(torch.from_numpy(imgs).permute(0, 3, 1, 2))[0].double().numpy()
    np.testing.assert_allclose(feats, direct, rtol=1e-5, atol=1e-6)


def test_low_rank_distance_equals_the_general_one():
    """frechet_distance_to_features (N <= F: an [N, N] eigenproblem) equals frechet_distance of the
    fitted statistics to the float64 rounding of either (seed 0; the bound: fid_rounding_bound)."""
    g = np.random.default_rng(0)
    for n, f in ((3, 12), (12, 12), (30, 12)):
        x, a = g.normal(size=(n, f)), g.normal(size=(f, f))
        mu2, s2 = g.normal(size=f), a @ a.T / f
        st = feature_statistics(x)
        assert frechet_distance_to_features(x, mu2, s2) == pytest.approx(
            frechet_distance(st.mu, st.sigma, mu2, s2), rel=0, abs=2 * fid_rounding_bound(st.sigma, s2, st.mu, mu2)
        )
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance_to_features(np.zeros((1, 3)), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match="shapes"):
        frechet_distance_to_features(np.zeros((2, 3)), np.zeros(2), np.eye(3))


@pytest.mark.parametrize("n, f", [(6, 8), (3, 5), (40, 64), (200, 64), (50, 256)])
def test_fid_of_a_set_with_itself_is_zero_to_rounding(n, f):
    """A set against its own statistics: 0 <= FID <= fid_rounding_bound (a few F * eps * trace), for
    singular (N <= F) and regular covariances, through both routes; 20 seeds each. Without removing the
    eigenvalues' rounding before the square roots, the error is of order sqrt(eps) * trace, of either
    sign (-2.5e-9 at N=6, F=8; -7e-4 on singular sets of Inception size)."""
    for seed in range(20):
        x = np.tanh(np.random.default_rng(seed).normal(size=(n, f)))
        st = feature_statistics(x)
        bound = fid_rounding_bound(st.sigma, st.sigma, st.mu, st.mu)
        assert 0.0 <= frechet_distance(st.mu, st.sigma, st.mu, st.sigma) <= bound
        assert 0.0 <= frechet_distance_to_features(x, st.mu, st.sigma) <= bound
        # a near-copy is never negative either
        assert frechet_distance(st.mu, st.sigma, st.mu + 1e-12, st.sigma) >= 0.0


def test_extractor_from_a_config_string_an_instance_or_a_class(tmp_path):
    """A config names an extractor by registered name or by ``package.module:Class``; instances,
    classes and callables work from Python; bad names and layers are refused."""
    imgs = np.random.default_rng(1).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    want = tiny_features(torch.from_numpy(imgs).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(extract_features(imgs, "test_fid:TinyExtractor", device="cpu"), want, rtol=1e-12)
    np.testing.assert_allclose(
        extract_features(imgs, TinyExtractor("specsamp-test-tiny", ["tiny"]), device="cpu"), want, rtol=1e-12
    )
    st = feature_statistics(extract_features(imgs, feature_extractor=TinyExtractor, device="cpu"))
    assert st.n == 5 and st.mu.shape == (8,)
    gray = imgs[..., :1]  # one channel: repeated to three, as torch-fidelity expects
    np.testing.assert_allclose(
        extract_features(gray, tiny_features, device="cpu"),
        tiny_features(torch.from_numpy(np.repeat(gray, 3, -1)).permute(0, 3, 1, 2)).numpy(),
        rtol=1e-12,
    )
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        make_extractor("no_such_module:X", device="cpu")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        make_extractor("specsamp.images:Nope", device="cpu")
    with pytest.raises(ValueError, match="feature_layer='nope'"):
        make_extractor(TinyExtractor, "nope", device="cpu")

    class Impostor(TinyExtractor):
        NAME = "specsamp-test-tiny"

    with pytest.raises(ValueError, match="already registered"):
        make_extractor(Impostor, device="cpu")
    with pytest.raises(ValueError, match="batch_size=0"):
        extract_features(imgs, TinyExtractor, device="cpu", batch_size=0)


def test_compute_fid_references_and_saved_features(tmp_path, monkeypatch):
    from specsamp.hub import CheckpointTrustError, file_sha256

    imgs = np.random.default_rng(2).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    feats = tiny_features(torch.from_numpy(imgs).permute(0, 3, 1, 2)).numpy()
    st = feature_statistics(feats)
    kw = dict(feature_extractor=TinyExtractor, device="cpu")
    res = compute_fid(imgs, st, save_features=tmp_path / "f.npz", **kw)
    zero = fid_rounding_bound(st.sigma, st.sigma, st.mu, st.mu)  # the float64 rounding of the distance
    assert 0.0 <= res["fid"] <= zero and res["reference"] == "Statistics"
    with np.load(tmp_path / "f.npz") as z:
        np.testing.assert_allclose(z["features"], feats, rtol=1e-12)
    ref = st.save(tmp_path / "ref.npz")
    good = compute_fid(imgs, ref, reference_sha256=file_sha256(ref), **kw)
    assert 0.0 <= good["fid"] <= zero and good["n_reference"] == 6
    with pytest.raises(CheckpointTrustError, match="reference statistics"):
        compute_fid(imgs, ref, reference_sha256="0" * 64, **kw)
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="cifar10-32x32.npz"):  # a name: statistics, not images
        compute_fid(imgs, "cifar10-32x32", allow_download=False, **kw)
    with pytest.raises(FileNotFoundError, match="missing.npz"):  # a missing .npz: statistics too
        compute_fid(imgs, tmp_path / "missing.npz", **kw)
    with pytest.raises(ValueError, match="feature dimension 8.*3"):
        compute_fid(imgs, (np.zeros(3), np.eye(3)), **kw)


# ----------------------------------------------------------------------------------------------
# what scoring needs, checked before any image is made; how few images are too few

KEYS = {
    "reference": "model.fid_ref",
    "feature_extractor": "model.fid_extractor",
    "feature_layer": "model.fid_layer",
    "weights_path": "model.fid_weights",
}


def test_check_fid_inputs_names_the_key_its_value_and_what_is_valid(tmp_path, monkeypatch):
    from specsamp.metrics.fid import check_fid_inputs

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty-torch-home"))
    monkeypatch.setenv("SPECSAMP_OFFLINE", "1")
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    digits = dict(feature_extractor="digits-classifier", keys=KEYS)

    def refused(ref, needles, **kw):
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            check_fid_inputs(ref, **{**digits, **kw})
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg
        return msg

    names = "cifar10-32x32, digits-8x8, ffhq-64x64"
    refused("/nonexistent.npz", ["model.fid_ref='/nonexistent.npz' is invalid", "no such file", names])
    refused("digits", ["model.fid_ref='digits' is invalid", names, "folder of images"])
    refused("cifar10-32x32", ["model.fid_ref='cifar10-32x32' cannot be read", "cifar10-32x32.npz", "SPECSAMP_OFFLINE"])
    np.savez(tmp_path / "no-sigma.npz", mu=np.zeros(3))
    refused(tmp_path / "no-sigma.npz", ["lacks ['sigma']", "mu [F] and sigma [F, F]"])
    np.savez(tmp_path / "shapes.npz", mu=np.zeros(3), sigma=np.zeros((3, 4)))
    refused(tmp_path / "shapes.npz", ["sigma of shape (3, 4)"])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    refused(tmp_path / "junk.npz", ["is not a readable .npz"])
    (tmp_path / "empty-folder").mkdir()
    refused(tmp_path / "empty-folder", ["no images at"])
    ok = "digits-8x8"
    refused(
        ok,
        [
            "model.fid_extractor='nope.mod:Cls' is invalid",
            "cannot import module 'nope.mod'",
            "inception-v3-compat",
            "digits-classifier",
            "package.module:Class",
        ],
        feature_extractor="nope.mod:Cls",
    )
    refused(
        ok,
        ["model.fid_extractor='specsamp.images:Nope' is invalid", "no attribute 'Nope'"],
        feature_extractor="specsamp.images:Nope",
    )
    refused(ok, ["names a str"], feature_extractor="specsamp.metrics.fid:INCEPTION")
    refused(ok, ["model.fid_extractor='nope' is invalid", "inception-v3-compat"], feature_extractor="nope")
    refused(ok, ["model.fid_layer='2048' is invalid for digits-classifier", "features, logits"], feature_layer="2048")
    refused(ok, ["model.fid_weights='/nope.pth' is invalid", "no such file"], weights_path="/nope.pth")
    (tmp_path / "other.pkl").write_bytes(b"another classifier")
    refused(ok, ["model.fid_weights=", "SHA-256"], weights_path=tmp_path / "other.pkl")
    # Inception: its weights missing offline name the key (not torch-fidelity's weights_path=), the URL and the path
    msg = refused(
        ok,
        ["model.fid_weights is not set", INCEPTION_URL, str(tmp_path / "empty-torch-home"), "model.fid_weights=FILE"],
        feature_extractor=INCEPTION,
    )
    assert "weights_path" not in msg
    (tmp_path / "inception.pth").write_bytes(b"\x80weights")
    refused(
        ok,
        ["model.fid_ref='digits-8x8' is invalid with inception-v3-compat layer 2048", "64 dimensions"],
        feature_extractor=INCEPTION,
        weights_path=tmp_path / "inception.pth",
    )
    # what passes: the shipped reference and classifier, a folder of images, an extractor from an import path
    assert check_fid_inputs(ok, **digits) == {"dim": 64, "extractor": "digits-classifier", "layer": "features"}
    save_images(np.zeros((2, 8, 8, 3), np.uint8), tmp_path / "ref-images")
    assert check_fid_inputs(tmp_path / "ref-images", feature_extractor="test_fid:TinyExtractor")["dim"] is None
    assert check_fid_inputs(ok, feature_extractor=tiny_features)["extractor"] is None


def test_few_images_get_a_warning_with_the_minimum(tmp_path):
    """An FID of N <= F images (F feature dimensions) comes with a warning naming the minimum F + 1; one image is
    refused (its covariance is undefined)."""
    from specsamp.metrics.fid import MIN_IMAGES, few_images_warning

    assert MIN_IMAGES == 2
    w = few_images_warning(3, 2048)
    assert "3 images" in w and "at least 2049" in w and "rank 2 < 2048" in w
    assert few_images_warning(2049, 2048) is None and few_images_warning(5, None) is None
    imgs = np.random.default_rng(3).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    st = feature_statistics(tiny_features(torch.from_numpy(imgs).permute(0, 3, 1, 2)).numpy())
    res = compute_fid(imgs, st, feature_extractor=TinyExtractor, device="cpu")  # 5 images, 8 dimensions
    assert res["min_images"] == 9 and "at least 9" in res["warning"]
    with pytest.raises(ValueError, match="an FID needs at least 2 images"):
        compute_fid(imgs[:1], st, feature_extractor=TinyExtractor, device="cpu")


def test_fid_command_names_valid_references_and_warns_of_few_images(tmp_path, capsys):
    save_images(np.random.default_rng(4).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8), tmp_path / "images")
    assert fid_mod.main([str(tmp_path / "images"), "--ref", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ref 'digits' is invalid") and "digits-8x8" in err and err.count("\n") == 1
    assert fid_mod.main([str(tmp_path / "images"), "--ref", "digits-8x8", "--feature-extractor", "nope.mod:Cls"]) == 2
    assert "--feature-extractor 'nope.mod:Cls' is invalid" in capsys.readouterr().err
    assert (
        fid_mod.main(
            [
                str(tmp_path / "images"),
                "--ref",
                "digits-8x8",
                "--feature-extractor",
                "digits-classifier",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert out.out.startswith("FID ") and "(3 samples;" in out.out and "too few images" in out.out
    assert out.err.startswith("warning: an FID of 3 images is not a usable number") and "at least 65" in out.err
