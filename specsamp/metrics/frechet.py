"""Gaussian statistics of a feature set, and the Frechet distance between two Gaussians (numpy only).

    d^2 = ||mu_1 - mu_2||^2 + tr(S_1 + S_2 - 2 (S_1 S_2)^{1/2})     (Heusel et al. 2017, eq. 6)

The FID is this distance between the Gaussians fitted to two sets of Inception features
(:mod:`specsamp.metrics.fid` extracts them and reads the reference files). Rounding is handled so that a
set scored against itself gives 0 to within :func:`fid_rounding_bound`, never a negative number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Statistics:
    """Gaussian statistics of a feature set.

    Attributes:
        mu: ``[F]`` float64 mean.
        sigma: ``[F, F]`` float64 covariance (unbiased, ``np.cov``).
        n: number of images (0 when loaded from a file that does not say).
    """

    mu: np.ndarray
    sigma: np.ndarray
    n: int = 0

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``mu``, ``sigma`` (and ``n``) to an ``.npz`` atomically (EDM's reference format)."""
        from ..io import atomic_write as _atomic_write

        path = Path(path)
        _atomic_write(path, lambda f: np.savez(f, mu=self.mu, sigma=self.sigma, n=np.int64(self.n)))
        return path


def _psd_eigvalsh(m: np.ndarray) -> tuple[np.ndarray, float]:
    """Eigenvalues of the symmetric part of ``m`` with their rounding removed, and the rounding bound.

    A symmetric eigensolver returns each eigenvalue to within about ``n * eps * ||m||_2`` (``n`` the
    order, ``eps`` float64's machine epsilon; Golub and Van Loan, "Matrix Computations", sec. 8.1).
    An eigenvalue whose magnitude is below that bound is rounding of a null direction, whatever its
    sign; it is set to 0 before any square root is taken, since ``sqrt`` would turn rounding of size
    ``eps`` into an error of size ``sqrt(eps)`` (a null eigenvalue computed as 1.6e-18 contributes
    1.3e-9 to a trace of square roots).

    Returns:
        ``(w, tol)``: float64 eigenvalues ``[n]``, all ``>= 0``, and ``tol``.
    """
    w = np.linalg.eigvalsh((m + m.T) / 2)
    tol = ROUNDING_FACTOR * m.shape[0] * np.finfo(np.float64).eps * (float(np.abs(w).max()) if w.size else 0.0)
    return np.where(w > tol, w, 0.0), tol


# the constant in front of n * eps * ||m|| in _psd_eigvalsh's bound (LAPACK's dsyevd stays well inside it)
ROUNDING_FACTOR = 8.0


def fid_rounding_bound(sigma1, sigma2, mu1=None, mu2=None) -> float:
    """An upper bound on the float64 rounding of :func:`frechet_distance` for these inputs.

    ``ROUNDING_FACTOR * F * eps * (tr sigma1 + tr sigma2 + ||mu1||^2 + ||mu2||^2)``: each term of the
    distance is a sum of ``F`` (or ``N``) float64 numbers no larger than that scale, the eigenvalues
    carry the solver's ``F * eps * ||.||`` error, and the square roots of the rounding are removed
    (:func:`_psd_eigvalsh`). The FID of a set with itself is within this bound of 0 (and never negative).
    """
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    scale = abs(np.trace(s1)) + abs(np.trace(s2))
    for mu in (mu1, mu2):
        if mu is not None:
            mu = np.asarray(mu, np.float64)
            scale += float(mu @ mu)
    return ROUNDING_FACTOR * s1.shape[0] * np.finfo(np.float64).eps * scale


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Frechet distance between ``N(mu1, sigma1)`` and ``N(mu2, sigma2)``.

    ``||mu1 - mu2||^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^{1/2})``, with the trace of the
    matrix square root computed as ``sum sqrt(eig(A^{1/2} sigma2 A^{1/2}))``, ``A = sigma1`` (same
    eigenvalues as ``sigma1 sigma2``, but a symmetric PSD problem: no complex parts, no ``sqrtm``
    failures on singular covariances). Eigenvalues within the solver's rounding of 0 count as 0
    before their square roots are taken (:func:`_psd_eigvalsh`), and a total below 0 (rounding of
    equal inputs) is returned as 0: the FID of a set with itself is 0 to within
    :func:`fid_rounding_bound`, on any BLAS, and never negative.

    Args:
        mu1, mu2: ``[F]`` means.
        sigma1, sigma2: ``[F, F]`` symmetric PSD covariances.

    Returns:
        The distance (float64, ``>= 0``).

    Raises:
        ValueError: shapes that do not match ``[F]`` / ``[F, F]``.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    f = mu1.shape[0]
    if mu1.shape != (f,) or mu2.shape != (f,) or s1.shape != (f, f) or s2.shape != (f, f):
        raise ValueError(
            f"shapes mu1 {mu1.shape}, sigma1 {s1.shape}, mu2 {mu2.shape}, sigma2 {s2.shape} are invalid: need [F], [F, F]"
        )
    s1 = (s1 + s1.T) / 2
    s2 = (s2 + s2.T) / 2
    w, v = np.linalg.eigh(s1)
    tol = ROUNDING_FACTOR * f * np.finfo(np.float64).eps * (float(np.abs(w).max()) if w.size else 0.0)
    root = (v * np.sqrt(np.where(w > tol, w, 0.0))) @ v.T
    tr_covmean = np.sqrt(_psd_eigvalsh(root @ s2 @ root)[0]).sum()
    diff = mu1 - mu2
    return max(0.0, float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean))


def frechet_distance_to_features(features, mu2, sigma2) -> float:
    """:func:`frechet_distance` between the Gaussian fitted to ``features [N, F]`` and ``N(mu2, sigma2)``.

    Exact, and cheap when ``N <= F``: with ``X`` the centred features, ``sigma1 = X^T X / (N - 1)``, and
    ``sigma1 sigma2`` has the nonzero eigenvalues of the ``[N, N]`` matrix ``X sigma2 X^T / (N - 1)``
    (``AB`` and ``BA`` share them), so no ``[F, F]`` eigenproblem is solved. With ``N > F`` this is
    :func:`frechet_distance` of :func:`feature_statistics`. Rounding is handled as there: never
    negative, 0 to within :func:`fid_rounding_bound` for a set against its own statistics.

    Raises:
        ValueError: not ``[N, F]`` with ``N >= 2``, or shapes that do not match.
    """
    x = np.asarray(features.cpu() if hasattr(features, "cpu") else features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"features of shape {x.shape} are invalid: need [N, F] with N >= 2")
    n, f = x.shape
    if n > f:
        st = feature_statistics(x)
        return frechet_distance(st.mu, st.sigma, mu2, sigma2)
    mu2 = np.atleast_1d(np.asarray(mu2, np.float64))
    s2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu2.shape != (f,) or s2.shape != (f, f):
        raise ValueError(
            f"shapes features {x.shape}, mu2 {mu2.shape}, sigma2 {s2.shape} are invalid: need [N, F], [F], [F, F]"
        )
    mu1 = x.mean(0)
    xc = (x - mu1) / np.sqrt(n - 1)
    s2 = (s2 + s2.T) / 2
    tr_covmean = np.sqrt(_psd_eigvalsh(xc @ s2 @ xc.T)[0]).sum()
    diff = mu1 - mu2
    return max(0.0, float(diff @ diff + (xc * xc).sum() + np.trace(s2) - 2.0 * tr_covmean))


def feature_statistics(features) -> Statistics:
    """Mean and unbiased covariance of features ``[N, F]`` (``N >= 2``).

    Raises:
        ValueError: not 2-D or fewer than 2 rows.
    """
    x = np.asarray(features.cpu() if hasattr(features, "cpu") else features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"features of shape {x.shape} are invalid: need [N, F] with N >= 2")
    return Statistics(mu=x.mean(0), sigma=np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1]), n=x.shape[0])
