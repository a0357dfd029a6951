"""The stand-in's cupyx.scipy: ``special`` only."""

from __future__ import annotations

from cupyx.scipy import special

__all__ = ["special"]
