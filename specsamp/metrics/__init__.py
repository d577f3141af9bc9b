"""Sample-quality metrics computed as a separate step over saved samples.

- :mod:`specsamp.metrics.fid`: Frechet Inception Distance with torch-fidelity's extractors
  (:func:`~specsamp.metrics.fid.compute_fid`, :func:`~specsamp.metrics.fid.frechet_distance`); what it reads
  and its checks before sampling in :mod:`specsamp.metrics.fid_inputs`.
- :mod:`specsamp.metrics.clip`: per-image CLIP scores with open_clip (paper section 5.3).

Both take images in the package's one convention (:func:`specsamp.images.as_pixels`: uint8 pixels or
floats in ``[-1, 1]``). Optional dependencies (torch-fidelity, open_clip) are imported only when a
metric is computed.
"""

__all__ = [
    "REFERENCE_STATS",
    "Statistics",
    "compute_fid",
    "extract_features",
    "feature_statistics",
    "frechet_distance",
    "frechet_distance_to_features",
    "load_statistics",
]


def __getattr__(name):
    """The FID names, imported from :mod:`specsamp.metrics.fid` on first use (so that
    ``python -m specsamp.metrics.fid`` runs the module once, as ``__main__``)."""
    if name in __all__:
        from . import fid

        return getattr(fid, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
