"""The digits target: a trained class-conditional EDM denoiser on scikit-learn's handwritten digits.

A real network that runs on any CPU in minutes, loaded exactly like NVIDIA's EDM checkpoints:
``python run.py model=digits`` resolves ``edm-digits-8x8-cond`` in :data:`specsamp.models.edm.CHECKPOINTS`
to the pickle shipped in ``specsamp/data/``, checks its SHA-256, unpickles it with the ``torch_utils``
stand-in (:mod:`specsamp.models.nvlabs_compat`) and wraps it in :class:`specsamp.models.edm.EDMVelocity`.

Data. ``sklearn.datasets.load_digits``: 1,797 grey 8x8 images, 10 classes, pixel values 0..16, mapped to
``[-1, 1]`` by ``x / 8 - 1``. They are kept at 8x8: the originals carry no more detail, an upsampled
copy lies on a 64-d subspace of the larger state (the extra directions hold only noise the network
must learn to remove), and every network call would cost four times more for no new information.

The networks are trained by ``experiments/train_digits.py`` (``make train-digits``); their source,
``experiments/digits_net.py``, travels inside the pickles, so loading them needs no import of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
DENOISER_FILE = DATA_DIR / "edm-digits-8x8-cond.pkl"
# the same network trained with label dropout 0.1 (null class: the all-zero one-hot), for classifier-free guidance
CFG_DENOISER_FILE = DATA_DIR / "edm-digits-8x8-cfg.pkl"
CLASSIFIER_FILE = DATA_DIR / "digits-classifier-8x8.pkl"
REFERENCE_FILE = DATA_DIR / "digits-8x8-classifier-stats.npz"
# SHA-256 of the committed classifier pickle (the denoiser's is in specsamp.models.edm.CHECKPOINTS)
CLASSIFIER_SHA256 = "bcc0cd6e681bd588350665ad6b771472ecd8eb0f9d60a61cddee2ae190615459"
RESOLUTION, CHANNELS, CLASSES = 8, 1, 10


def load_digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as images in ``[-1, 1]``.

    Returns:
        ``(images float32 [1797, 1, 8, 8], labels long [1797])``.

    Raises:
        ImportError: scikit-learn is not installed (``pip install specsamp[digits]``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "the digits data need scikit-learn: pip install 'specsamp[digits]' (or scikit-learn)"
        ) from err
    d = load_digits()
    x = torch.from_numpy(np.asarray(d.images, np.float32) / 8.0 - 1.0)[:, None]
    return x, torch.from_numpy(np.asarray(d.target, np.int64))


def load_classifier(
    path: str | Path | None = None,
    *,
    sha256: str | None = None,
    trust: bool = False,
    device: str | torch.device = "cpu",
):
    """The digits classifier (``forward(x [b, 1, 8, 8]) -> (features [b, 64], logits [b, 10])``).

    Loaded by :func:`specsamp.models.edm.load_edm` (checksum first, then unpickled) from ``path``
    (default: the shipped file), checked against ``sha256`` (default :data:`CLASSIFIER_SHA256`, so a
    copy of the shipped file loads anywhere and any other file needs its hash or ``trust=True``).

    Raises:
        FileNotFoundError, specsamp.hub.CheckpointTrustError: see :func:`load_edm`.
    """
    from .edm import load_edm

    p = Path(path) if path is not None else CLASSIFIER_FILE
    expected = sha256 if sha256 is not None else CLASSIFIER_SHA256
    return load_edm(p, sha256=expected, trust_checkpoint=trust, key="classifier", map_location=device)
