"""Sample-quality metrics computed as a separate step over saved samples.

- :mod:`specsamp.metrics.fid`: Frechet Inception Distance with torch-fidelity's extractors
  (:func:`~specsamp.metrics.fid.compute_fid`, :func:`~specsamp.metrics.fid.frechet_distance`).

Optional dependencies (torch-fidelity) are imported only when a metric is computed.
"""

from .fid import REFERENCE_STATS, Statistics, compute_fid, extract_features, feature_statistics, frechet_distance, load_statistics

__all__ = [
    "REFERENCE_STATS",
    "Statistics",
    "compute_fid",
    "extract_features",
    "feature_statistics",
    "frechet_distance",
    "load_statistics",
]
