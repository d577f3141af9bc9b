"""Shared statistical checks for exactness tests."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats


def law_pvalues(sample: torch.Tensor, mean_q: torch.Tensor, sigma, e: torch.Tensor, seed: int = 0) -> dict:
    """p-values that ``sample ~ N(mean_q, sigma^2 I)``.

    Three KS tests: the standardised projection on ``e`` against N(0, 1) (i.e. the output projection
    against N(delta, 1) once the target mean is removed), the projection on a fixed random unit vector
    orthogonal to ``e`` against N(0, 1), and the squared norm of the orthogonal part against
    chi^2(d - 1).
    """
    z = ((sample.double() - mean_q.double()) / torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, *([1] * (sample.ndim - 1)))).reshape(sample.shape[0], -1)
    e = e.double().reshape(-1)
    d = z.shape[1]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    w = w - (w @ e) * e
    w = w / w.norm()
    par = z @ e
    orth = z - par[:, None] * e[None]
    return {
        "parallel": stats.kstest(par.numpy(), "norm").pvalue,
        "orthogonal": stats.kstest((orth @ w).numpy(), "norm").pvalue,
        "orth_norm": stats.kstest((orth**2).sum(1).numpy(), stats.chi2(d - 1).cdf).pvalue,
    }


def two_sample_pvalues(a: torch.Tensor, b: torch.Tensor, directions: int = 3, seed: int = 0) -> list[float]:
    """Two-sample KS p-values on projections of ``a`` and ``b`` (``[n, d]``) onto fixed random directions."""
    g = torch.Generator().manual_seed(seed)
    a = a.double().reshape(a.shape[0], -1)
    b = b.double().reshape(b.shape[0], -1)
    out = []
    for _ in range(directions):
        w = torch.randn(a.shape[1], generator=g, dtype=torch.float64)
        out.append(stats.ks_2samp((a @ w).numpy(), (b @ w).numpy()).pvalue)
    return out


def chi2_same_counts(a: np.ndarray, b: np.ndarray, bins: int) -> float:
    """p-value of a chi-square test that two label samples come from the same categorical law."""
    ca = np.bincount(a, minlength=bins)
    cb = np.bincount(b, minlength=bins)
    keep = (ca + cb) > 0
    return stats.chi2_contingency(np.stack([ca[keep], cb[keep]])).pvalue if keep.sum() > 1 else 1.0
