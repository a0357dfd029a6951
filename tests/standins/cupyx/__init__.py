"""The stand-in's cupyx: ``scatter_add`` (and ``cupyx.scipy.special.erf``)."""

from __future__ import annotations

from cupyx import scipy


def scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` with repeated indices accumulating; CuPy's goes through the
    deprecated ``ndarray.scatter_add``, and warns as it does."""
    a.scatter_add(slices, value)


__all__ = ["scatter_add", "scipy"]
