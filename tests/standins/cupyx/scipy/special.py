"""cupyx.scipy.special.erf: a ufunc on device arrays (math.erf per element here)."""

from __future__ import annotations

import math

import numpy as np
from cupy._core import ufunc_type

_erf = np.frompyfunc(math.erf, 1, 1)


class _Erf(ufunc_type):
    """erf in the input's float dtype (float64 for integers), as CuPy's ufunc gives it."""

    def __init__(self) -> None:
        self.__name__, self.nin, self.nout = "erf", 1, 1

    def _ufunc(self, x, out=None):
        x = np.asarray(x)
        dtype = x.dtype if x.dtype.kind == "f" else np.dtype(np.float64)
        result = _erf(x).astype(dtype)
        if out is None:
            return result
        out[...] = result
        return out


erf = _Erf()

__all__ = ["erf"]
