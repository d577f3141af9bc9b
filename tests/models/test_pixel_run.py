"""`python run.py model=cifar10 ...` end to end on a tiny network pickled in NVIDIA's persistence format.

No download: the pickle is written by the test (tests/tiny_edm.py), its SHA-256 configured.
FID runs through torch-fidelity's real Inception graph with a small random weights file at the real
file name in a private torch hub cache (tests/tiny_weights.py), against a ``model.fid_ref`` ``.npz``.
"""

import json
import os
import sys

import pytest
import torch
from helpers import ROOT, python
from tiny_edm import TINY_SRC, tiny_precond, write_persistent_pickle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-cifar.pkl"
    sha = write_persistent_pickle(path, tiny_precond(img_channels=3, label_dim=10), TINY_SRC, "TinyPrecond")
    return path, sha


def run(tmp_path, *args, **env_extra):
    env = dict(
        os.environ, SPECSAMP_OFFLINE="1", SPECSAMP_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline", **env_extra
    )
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "model=cifar10",
        "steps=5",
        "n_samples=6",
        "K=2",
        "L=2",
        "device=cpu",
        f"hydra.run.dir={tmp_path}",
        *args,
    ]
    return python(cmd, cwd=tmp_path, env=env)


@pytest.mark.parametrize("sampler", ["dgrs", "rmc", "standard"])
def test_cifar10_run_saves_images_by_index(tmp_path, checkpoint, sampler):
    path, sha = checkpoint
    p = run(
        tmp_path,
        f"sampler={sampler}",
        f"model.path={path}",
        f"model.sha256={sha}",
        "execution=tree",
        "save_samples=true",
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"model=cifar10 model.path={path} sampler={sampler}")
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["n_samples"] == 6 and rec["speedup"]["mean"] > 0
    names = sorted(f.name for f in (tmp_path / "images").iterdir())
    assert names == [f"{i:06d}.png" for i in range(6)]
    assert (tmp_path / "grid.png").exists()


def test_wrong_checksum_is_refused_with_exit_2(tmp_path, checkpoint):
    path, _ = checkpoint
    p = run(tmp_path, f"model.path={path}", "model.sha256=" + "0" * 64)
    assert p.returncode == 2, p.stderr
    assert "trust_checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "result.json").exists()


def test_unknown_checksum_needs_trust_flag(tmp_path, checkpoint):
    path, _ = checkpoint
    p = run(tmp_path, f"model.path={path}")
    assert p.returncode == 2 and "trust_checkpoint" in p.stderr
    p = run(tmp_path, f"model.path={path}", "model.trust_checkpoint=true")
    assert p.returncode == 0, p.stderr


def test_missing_checkpoint_names_url_and_path(tmp_path):
    p = run(tmp_path)
    assert p.returncode == 2, p.stderr
    assert "edm-cifar10-32x32-cond-vp.pkl" in p.stderr and str(tmp_path / "cache") in p.stderr
    assert "Traceback" not in p.stderr


# ----------------------------------------------------------------------------------------------
# metrics=[fid]: the record first, then the score; a scoring failure loses nothing


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory):
    from tiny_weights import write_tiny_inception

    home = tmp_path_factory.mktemp("torch-home")
    write_tiny_inception(home)
    return home


@pytest.fixture(scope="module")
def fid_ref(tmp_path_factory):
    """Reference statistics in EDM's format: mu [2048], sigma [2048, 2048]."""
    import numpy as np

    from specsamp.metrics.fid import Statistics

    g = np.random.default_rng(0)
    a = g.normal(size=(2048, 8)) * 0.01
    return Statistics(mu=g.normal(size=2048) * 0.01, sigma=a @ a.T, n=8).save(
        tmp_path_factory.mktemp("ref") / "ref.npz"
    )


@pytest.fixture(scope="module")
def fid_run(tmp_path_factory, checkpoint, torch_home, fid_ref):
    path, sha = checkpoint
    out = tmp_path_factory.mktemp("fid-run")
    p = run(
        out,
        "sampler=dgrs",
        f"model.path={path}",
        f"model.sha256={sha}",
        "metrics=[fid]",
        f"model.fid_ref={fid_ref}",
        "n_samples=4",
        TORCH_HOME=str(torch_home),
    )
    return out, p


def test_fid_metric_through_runner_is_a_float_in_the_record(fid_run, torch_home, fid_ref, monkeypatch):
    out, p = fid_run
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    rec = json.loads((out / "result.json").read_text())
    assert isinstance(rec["fid"], float) and isinstance(rec["metrics"]["fid"], float)
    assert rec["metrics"]["fid_detail"]["n_samples"] == 4
    assert rec["metrics"]["fid_detail"]["feature_extractor"] == "inception-v3-compat"
    assert f"FID {rec['fid']:.3f}" in p.stdout  # printed on the summary line
    # the same number from the saved PNGs, scored here with the same weights file
    from specsamp.metrics.fid import compute_fid

    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    again = compute_fid(out / "images", fid_ref, device="cpu", allow_download=False)
    assert again["fid"] == pytest.approx(rec["fid"], rel=1e-6)


def test_pixel_fid_command_fills_the_table_with_a_float(fid_run, torch_home, fid_ref, tmp_path, monkeypatch, capsys):
    import pandas as pd

    from experiments import pixel

    out, p = fid_run
    assert p.returncode == 0, p.stderr[-3000:]
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    table = tmp_path / "fid.csv"
    assert (
        pixel.main(
            [
                "fid",
                "--dataset",
                "cifar10",
                "--sampler",
                "dgrs",
                "--images",
                str(out / "images"),
                "--ref",
                str(fid_ref),
                "--device",
                "cpu",
                "--table",
                str(table),
            ]
        )
        == 0
    )
    df = pd.read_csv(table)
    row = df[(df["dataset"] == "cifar10") & (df["sampler"] == "dgrs")].iloc[0]
    rec = json.loads((out / "result.json").read_text())
    assert row["fid"] == pytest.approx(rec["fid"], rel=1e-5) and row["fid_paper"] == 1.824
    assert df["fid"].isna().sum() == len(df) - 1
    # a missing images folder: one line, exit 2, the table untouched
    before = table.read_bytes()
    assert (
        pixel.main(
            [
                "fid",
                "--sampler",
                "rmc",
                "--images",
                str(tmp_path / "none"),
                "--ref",
                str(fid_ref),
                "--table",
                str(table),
            ]
        )
        == 2
    )
    assert "no images at" in capsys.readouterr().err and table.read_bytes() == before


def _compose(*overrides):
    from specsamp.runner import compose

    return compose(
        ["model=cifar10", "steps=5", "n_samples=3", "K=2", "L=2", "device=cpu", "progress=false", *overrides]
    )


def test_fid_scoring_failure_keeps_record_and_images(tmp_path, checkpoint, fid_ref, monkeypatch, capsys):
    """The runner's task in process (Hydra compose + run_task): what no check can foresee fails inside the scorer
    (a callable that is no feature extractor): sampling finishes, the record and the PNGs are written, then the
    scoring error is one paragraph, exit 1."""
    from tiny_weights import write_tiny_inception

    from specsamp.runner.task import run_task

    path, sha = checkpoint
    monkeypatch.chdir(tmp_path)
    write_tiny_inception(tmp_path / "torch-home")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setenv("SPECSAMP_OFFLINE", "1")
    cfg = _compose(
        f"model.path={path}",
        f"model.sha256={sha}",
        "metrics=[fid]",
        f"model.fid_ref={fid_ref}",
        "model.fid_extractor=builtins:len",
    )
    with pytest.raises(SystemExit) as e:
        run_task(cfg)
    err = capsys.readouterr()
    assert e.value.code == 1
    *notes, last = err.err.splitlines()  # notes before sampling (3 images are too few for a usable FID), then the error
    assert (
        "Traceback" not in err.err
        and last.startswith("error: metrics=[fid]")
        and all(n.startswith("note: ") for n in notes)
    )
    assert "at least 2049" in err.err
    assert str(tmp_path) in last  # says where the samples are
    assert err.out.startswith(f"model=cifar10 model.path={path} sampler=dgrs")  # the summary line came first
    rec = json.loads((tmp_path / "result.json").read_text())
    assert (
        rec["status"] == "ok"
        and rec["n_samples"] == 3
        and "fid" not in rec
        and "AttributeError" in rec["metrics_error"]
    )
    assert sorted(f.name for f in (tmp_path / "images").iterdir()) == [f"{i:06d}.png" for i in range(3)]


@pytest.mark.parametrize("case", ["fid_ref", "fid_extractor", "missing-weights", "bad-reference", "one-image"])
def test_what_scoring_needs_is_refused_before_sampling(tmp_path, checkpoint, fid_ref, monkeypatch, capsys, case):
    """A reference, an extractor or weights that scoring could not use, or too few images, exit 2 before anything
    is sampled (they were reported after every image was made, and missing weights exited 1): one paragraph
    naming the model.* key, its value and what is valid."""
    import numpy as np
    from tiny_weights import write_tiny_inception

    from specsamp.runner.task import run_task

    path, sha = checkpoint
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setenv("SPECSAMP_OFFLINE", "1")
    if case != "missing-weights":
        write_tiny_inception(tmp_path / "torch-home")
    ref, extra = fid_ref, []
    if case == "fid_ref":
        ref = "/nonexistent.npz"
    if case == "fid_extractor":
        extra = ["model.fid_extractor=nope.mod:Cls"]
    if case == "bad-reference":  # 3-d statistics against Inception's 2048-d features
        ref = tmp_path / "ref3.npz"
        np.savez(ref, mu=np.zeros(3), sigma=np.eye(3))
    if case == "one-image":
        extra = ["n_samples=1"]
    with pytest.raises(SystemExit) as e:
        run_task(_compose(f"model.path={path}", f"model.sha256={sha}", "metrics=[fid]", f"model.fid_ref={ref}", *extra))
    err = capsys.readouterr()
    assert e.value.code == 2 and err.err.count("\n") == 1 and "Traceback" not in err.err, err.err
    assert {
        "fid_ref": "model.fid_ref='/nonexistent.npz' is invalid: no such file or folder",
        "fid_extractor": "model.fid_extractor='nope.mod:Cls' is invalid: cannot import module 'nope.mod'",
        "missing-weights": "model.fid_weights is not set and the FID's Inception weights are not in the torch hub cache",
        "bad-reference": "statistics have 3 dimensions and the features 2048",
        "one-image": "metrics=[fid] is invalid with n_samples=1: an FID needs at least 2 images",
    }[case] in err.err
    assert "weights_path" not in err.err
    assert err.out == "" and not (tmp_path / "result.json").exists()  # nothing sampled


# ----------------------------------------------------------------------------------------------
# the image convention, per target


def test_edm_target_images_follow_the_one_convention(tmp_path, checkpoint, monkeypatch):
    """EDM's decode gives floats in [-1, 1]; the saved PNGs are exactly their pixels; the metrics take
    the decoded tensors and the saved files alike (same features)."""
    import numpy as np

    from specsamp.images import as_pixels, load_images
    from specsamp.metrics.fid import extract_features
    from specsamp.runner import run_config
    from specsamp.runner.outputs import save_images

    path, sha = checkpoint
    record, res = run_config(_compose(f"model.path={path}", f"model.sha256={sha}"))
    decoded = res.extra["target"].decode(res.samples)
    assert decoded.dtype == torch.float32 and decoded.shape == (3, 3, 4, 4)
    assert float(decoded.min()) >= -1 and float(decoded.max()) <= 1
    images = save_images(res, tmp_path)
    np.testing.assert_array_equal(load_images(images), as_pixels(decoded))

    def feats(x):
        return x.double().mean(dim=(2, 3))

    np.testing.assert_array_equal(
        extract_features(decoded, feats, device="cpu"), extract_features(images, feats, device="cpu")
    )


def test_gmm_target_has_no_images_and_refuses_metrics(tmp_path, monkeypatch, capsys):
    """The GMM target is not an image model: no decode, no images written, and metrics are refused up front."""
    from specsamp.runner import compose, run_config
    from specsamp.runner.outputs import save_images
    from specsamp.runner.task import run_task

    cfg = compose(["model.dim=4", "n_samples=2", "steps=4", "progress=false"])
    bad = compose(["model.dim=4", "n_samples=2", "metrics=[fid]"])
    _, res = run_config(cfg)
    assert res.extra["target"].decode is None and save_images(res, tmp_path) is None
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_task(bad)
    assert e.value.code == 2 and "metrics=[fid] is invalid for model=gmm: it needs images" in capsys.readouterr().err
    assert not (tmp_path / "result.json").exists()


# ----------------------------------------------------------------------------------------------
# trusted checkpoints that cannot be unpickled: one paragraph, exit 2


@pytest.mark.parametrize("kind", ["empty", "truncated", "zip"])
def test_broken_trusted_checkpoint_is_one_paragraph(tmp_path, checkpoint, monkeypatch, capsys, kind):
    from specsamp.runner.task import run_task

    path, _ = checkpoint
    bad = tmp_path / f"{kind}.pkl"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "truncated":
        bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        torch.save({"ema": torch.zeros(2)}, bad)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_task(_compose(f"model.path={bad}", "model.trust_checkpoint=true"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(bad) in err and {"empty": "is empty", "truncated": "truncated", "zip": "zip archive"}[kind] in err
    assert not (tmp_path / "result.json").exists()


def test_checkpoint_refusal_names_the_real_overrides(tmp_path, checkpoint, monkeypatch, capsys):
    from specsamp.runner.task import run_task

    path, sha = checkpoint
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run_task(_compose(f"model.path={path}"))
    err = capsys.readouterr().err
    assert f"model.sha256={sha}" in err and "model.trust_checkpoint=true" in err
    with pytest.raises(SystemExit):
        run_task(_compose(f"model.path={path}", "model.sha256=" + "0" * 64))
    assert "model.trust_checkpoint=true" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # `no` is OmegaConf's false: still untrusted
        run_task(_compose(f"model.path={path}", "model.trust_checkpoint=no"))
    assert "model.trust_checkpoint=true" in capsys.readouterr().err
    with pytest.raises(Exception, match="trust_checkpoint"):  # a value that is no boolean at all: Hydra refuses it
        _compose(f"model.path={path}", "model.trust_checkpoint=maybe")


def test_metrics_score_exactly_this_runs_images(tmp_path, checkpoint, fid_ref):
    """A stale PNG left in the run's folder (another index, another size) is not scored: the metrics
    read the files of this run's indices."""
    import numpy as np

    from specsamp.images import as_pixels, save_images as save_pngs
    from specsamp.metrics.fid import Statistics
    from specsamp.runner import run_config
    from specsamp.runner.outputs import compute_metrics, save_images

    path, sha = checkpoint
    _, res = run_config(_compose(f"model.path={path}", f"model.sha256={sha}"))
    images = save_images(res, tmp_path)
    save_pngs(np.zeros((1, 9, 9, 3), np.uint8), images, start_index=99)

    def feats(x):
        return x.double().mean(dim=(2, 3))

    target = res.extra["target"]
    target.fid = {"feature_extractor": feats}
    target.fid_ref = Statistics(np.zeros(3), np.eye(3))
    out = compute_metrics(["fid"], res, images, "cpu")
    f = feats(torch.from_numpy(as_pixels(target.decode(res.samples))).permute(0, 3, 1, 2)).numpy()
    from specsamp.metrics.fid import frechet_distance_to_features

    assert out["fid"] == pytest.approx(frechet_distance_to_features(f, np.zeros(3), np.eye(3)), rel=1e-12)
    assert out["fid_detail"]["n_samples"] == 3


@pytest.mark.parametrize("metric,need", [("clip", "prompts"), ("fid", "model.fid_ref")])
def test_metric_the_model_cannot_serve_is_refused_before_sampling(
    tmp_path, checkpoint, monkeypatch, capsys, metric, need
):
    from specsamp.runner.task import run_task

    path, sha = checkpoint
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_task(_compose(f"model.path={path}", f"model.sha256={sha}", f"metrics=[{metric}]", "model.fid_ref=null"))
    err = capsys.readouterr()
    assert e.value.code == 2 and f"metrics=[{metric}] is invalid" in err.err and need in err.err
    assert err.out == "" and not (tmp_path / "result.json").exists()  # nothing sampled


def test_pixel_fid_without_reachable_inception_weights_is_one_paragraph(tmp_path, monkeypatch, capsys):
    """Downloads allowed but the weights' URL unreachable: exit 2 with the URL and where to put the file
    (it was a RuntimeError traceback, exit 1); a RuntimeError of another kind is still a bug."""
    import numpy as np

    from experiments import pixel
    from specsamp.images import save_images
    from specsamp.metrics import fid as fid_mod

    save_images(np.zeros((2, 8, 8, 3), dtype=np.uint8), tmp_path / "images")

    def offline(*a, **k):
        raise RuntimeError(f"could not download the Inception weights from {fid_mod.INCEPTION_URL} (no network).")

    monkeypatch.setattr(fid_mod, "make_extractor", offline)
    args = [
        "fid",
        "--sampler",
        "dgrs",
        "--images",
        str(tmp_path / "images"),
        "--ref",
        "cifar10-32x32",
        "--table",
        str(tmp_path / "fid.csv"),
    ]
    assert pixel.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: fid") and "could not download the Inception weights" in err and "\n" not in err

    def bug(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(fid_mod, "make_extractor", bug)
    with pytest.raises(RuntimeError, match="something else"):
        pixel.main(args)
