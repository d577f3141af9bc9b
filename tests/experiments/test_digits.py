"""The digits target: a trained EDM denoiser and classifier shipped with the package, end to end on CPU.

Checks: the shipped files match their table hashes and load through the checked loader (a tampered
copy is refused before unpickling); `python run.py model=digits metrics=[fid]` prints a speedup and
an FID computed by torch-fidelity with the registered classifier extractor; the classifier extractor
agrees with direct calls and scores real digits near zero; standard and speculative samples of the
trained network follow one law (KS on projections, chi-square on classified labels).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT, chi2_same_counts, run_digits_with_fid, two_sample_pvalues

from specsamp import DraftTree, Schedule, sample_speculative, sample_standard
from specsamp.hub import CheckpointTrustError, file_sha256
from specsamp.models import digits
from specsamp.models.edm import CHECKPOINTS, EDMConfig, EDMVelocity, uniform_labels

NAME = "edm-digits-8x8-cond"


def test_shipped_files_match_their_hashes():
    assert CHECKPOINTS[NAME].sha256 == file_sha256(digits.DENOISER_FILE)
    assert digits.CLASSIFIER_SHA256 == file_sha256(digits.CLASSIFIER_FILE)
    assert digits.REFERENCE_FILE.is_file()


def test_denoiser_loads_through_the_checked_loader_and_tampering_is_refused(tmp_path):
    model = EDMConfig(name=NAME, download=False, labels="uniform").build("cpu").model
    assert isinstance(model, EDMVelocity)
    assert model.label_dim == 10 and model.event_shape == (1, 8, 8)
    # the class was rebuilt from the source embedded in the pickle, not imported from the package
    assert type(model.net).__module__.startswith("_specsamp_persistent_")
    bad = tmp_path / digits.DENOISER_FILE.name
    blob = bytearray(digits.DENOISER_FILE.read_bytes())
    blob[-10] ^= 1
    bad.write_bytes(bytes(blob))
    with pytest.raises(CheckpointTrustError, match="SHA-256"):
        EDMConfig(name=NAME, path=str(bad), labels="uniform").build("cpu")
    # the classifier: a copy of the shipped file loads from anywhere, a modified one is refused
    copy = tmp_path / "copy.pkl"
    shutil.copy(digits.CLASSIFIER_FILE, copy)
    assert digits.load_classifier(copy).classes == 10
    blob = bytearray(copy.read_bytes())
    blob[-10] ^= 1
    copy.write_bytes(bytes(blob))
    with pytest.raises(CheckpointTrustError, match="SHA-256"):
        digits.load_classifier(copy)


def test_classifier_extractor_through_torch_fidelity_scores_real_digits_near_zero():
    pytest.importorskip("torch_fidelity")
    pytest.importorskip("sklearn")
    from specsamp.images import to_uint8
    from specsamp.metrics.fid import compute_fid, extract_features

    x, y = digits.load_digits_data()
    pics = to_uint8(x)  # [N, 8, 8, 1] uint8, as saved PNGs hold them
    feats = extract_features(pics, feature_extractor="digits-classifier", device="cpu")
    logits = extract_features(pics, feature_extractor="digits-classifier", feature_layer="logits", device="cpu")
    clf = digits.load_classifier()
    with torch.no_grad():
        direct = clf((torch.from_numpy(pics[..., 0]).float()[:, None] - 127.5) / 127.5)
    np.testing.assert_allclose(feats, direct[0].double().numpy(), rtol=1e-5, atol=1e-5)
    assert (logits.argmax(1) == y.numpy()).mean() > 0.95  # accuracy on the digits (held-out: training.json)
    fid_real = compute_fid(pics, "digits-8x8", feature_extractor="digits-classifier", device="cpu")["fid"]
    noise = to_uint8(torch.rand(len(x), 1, 8, 8) * 2 - 1)
    fid_noise = compute_fid(noise, "digits-8x8", feature_extractor="digits-classifier", device="cpu")["fid"]
    assert fid_real < 0.05 * fid_noise


def test_run_py_digits_prints_speedup_and_writes_a_float_fid(tmp_path):
    pytest.importorskip("torch_fidelity")
    stdout, rec = run_digits_with_fid(tmp_path, steps=20, n_samples=24)
    assert "speedup" in stdout and "FID" in stdout, stdout
    assert isinstance(rec["fid"], float) and np.isfinite(rec["fid"]) and rec["fid"] > 0
    assert rec["metrics"]["fid"] == rec["fid"]
    assert len(list((tmp_path / "images").glob("*.png"))) == 24


def _samples(model, rule, n, steps, seed):
    sched = Schedule.make(steps, 0.3)
    ids = torch.arange(n)
    cond = {"class_labels": uniform_labels(ids, seed, 10)}
    if rule == "standard":
        return sample_standard(model, sched, seed=seed, indices=ids, cond=cond).samples
    tree = DraftTree.chain(14) if rule == "rmc" else DraftTree.uniform(2, 3)
    return sample_speculative(model, sched, tree, rule, seed=seed, indices=ids, cond=cond).samples


def _agree(n, steps, rules):
    model = EDMConfig(name=NAME, labels="uniform").build("cpu").model
    clf = digits.load_classifier()
    a = _samples(model, "standard", n, steps, seed=0)
    for i, rule in enumerate(rules):
        b = _samples(model, rule, n, steps, seed=1 + i)
        assert min(two_sample_pvalues(a, b)) > 1e-3 / 3, rule
        with torch.no_grad():
            la, lb = clf(a.clamp(-1, 1))[1].argmax(1).numpy(), clf(b.clamp(-1, 1))[1].argmax(1).numpy()
        assert chi2_same_counts(la, lb, 10) > 1e-3, rule


def test_dgrs_samples_of_the_trained_net_follow_the_standard_law():
    """Independent sets (seed 0 standard, seed 1 D-GRS (2, 3)), n=300 images, T=16, eps=0.3.

    KS on 3 fixed random projections of the images (p > 1e-3 / 3 each) and chi-square on the
    classifier's predicted labels (p > 1e-3).
    """
    _agree(300, 16, ["dgrs"])


@pytest.mark.slow
def test_speculative_samples_of_the_trained_net_follow_the_standard_law_large():
    """As above with n=1000, T=50, for D-GRS (2, 3) and RMC on a chain of 14 (seeds 1 and 2)."""
    _agree(1000, 50, ["dgrs", "rmc"])


def test_figures_draw_from_the_committed_tables(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import experiments.digits as dx

    for name in ("fig4.csv", "levers.csv", "samples.npz"):
        assert (dx.OUT / name).is_file(), name
        shutil.copy(dx.OUT / name, tmp_path / name)
    monkeypatch.setattr(dx, "OUT", tmp_path)
    paths = dx.figures()
    assert sorted(p.name for p in paths) == ["fig4_speedup_vs_budget.png", "levers_frontier.png", "samples.png"]


def test_training_script_writes_checked_loadable_files(tmp_path):
    """`experiments.train_digits` at 3 steps: the pickles load by their printed hashes, classes from the embedded source."""
    pytest.importorskip("sklearn")
    from experiments import train_digits

    assert (
        train_digits.main(["--steps", "3", "--batch", "8", "--classifier-epochs", "1", "--out-dir", str(tmp_path)]) == 0
    )
    sha = file_sha256(tmp_path / digits.DENOISER_FILE.name)
    net = (
        EDMConfig(name="retrained", path=str(tmp_path / digits.DENOISER_FILE.name), sha256=sha, labels="uniform")
        .build("cpu")
        .model.net
    )
    assert type(net).__name__ == "EDMPrecond" and net.label_dim == 10
    clf = digits.load_classifier(
        tmp_path / digits.CLASSIFIER_FILE.name, sha256=file_sha256(tmp_path / digits.CLASSIFIER_FILE.name)
    )
    assert clf(torch.zeros(2, 1, 8, 8))[1].shape == (2, 10)
    assert (tmp_path / digits.REFERENCE_FILE.name).is_file()
    assert train_digits.main(["--steps", "0"]) == 2  # bad input: exit status 2, nothing written


@pytest.mark.slow  # 12-28 s: kept out of the default run's 15 minutes; CI runs it with -m slow
def test_sharded_fid_route_end_to_end(tmp_path):
    """Two shard jobs of the digits network (save_samples=true), merged at the end of the sweep, are scored by
    ``python -m specsamp.metrics.fid MERGED_DIR --ref digits-8x8`` and by its samples.pt; both equal the FID
    an unsharded run scores for itself (batch_size=3: the shards run the unsharded run's batches, so the images
    are the same bytes and the FIDs are equal to float64 rounding of one computation, 1e-12 relative)."""
    env = dict(
        os.environ,
        HYDRA_FULL_ERROR="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    common = ["model=digits", "steps=6", "n_samples=6", "batch_size=3", "save_samples=true", "progress=false"]

    def sh(*a):
        return subprocess.run([sys.executable, *a], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)

    single = sh(str(ROOT / "run.py"), *common, "metrics=[fid]", f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr
    want = json.loads((tmp_path / "single" / "result.json").read_text())["fid"]
    p = sh(str(ROOT / "run.py"), "-m", *common, "num_shards=2", "shard=0,1", "sweep_name=fd")
    assert p.returncode == 0, p.stderr
    merged = next(d for d in (tmp_path / "multirun" / "fd").iterdir() if (d / "samples.pt").is_file())
    assert sorted(f.name for f in (merged / "images").iterdir()) == [f"{i:06d}.png" for i in range(6)]
    assert (merged / "grid.png").read_bytes() == (tmp_path / "single" / "grid.png").read_bytes()
    for target in (merged, merged / "images", merged / "samples.pt"):
        f = sh(
            "-m",
            "specsamp.metrics.fid",
            str(target),
            "--ref",
            "digits-8x8",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "f.json"),
        )
        assert f.returncode == 0, f.stderr
        assert f.stdout.startswith("FID ") and "digits-classifier" in f.stdout  # the extractor comes from the record
        got = json.loads((tmp_path / "f.json").read_text())
        assert got["fid"] == pytest.approx(want, rel=1e-12) and got["n_samples"] == 6
    bare = sh("-m", "specsamp.metrics.fid", str(merged), "--device", "cpu")  # the reference, too, from the record
    assert bare.returncode == 0 and f"{want:.4f}" in bare.stdout and "reference digits-8x8" in bare.stdout, bare.stderr
    bad = sh("-m", "specsamp.metrics.fid", str(tmp_path / "nope"), "--ref", "digits-8x8")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
