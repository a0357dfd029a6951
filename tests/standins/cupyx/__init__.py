"""The stand-in's cupyx: ``cupyx.scipy.special.erf`` only."""

from __future__ import annotations

from cupyx import scipy

__all__ = ["scipy"]
