"""A stand-in for CuPy, backed by numpy, for tests on machines without a GPU.

Put ``tests/standins`` first on ``PYTHONPATH`` and ``import cupy`` finds this package:
every ``--device cuda`` path of onnx2soap then runs (``make test`` runs the GPU tests
once more this way). It is a test tool: nothing in onnx2soap or the executor imports it.

It has the part of CuPy's API the project uses, with CuPy's signatures: arrays and
``asnumpy`` (``_core.py``: strict about host and device, as CuPy is), creation and math
functions and ufuncs, devices (``cuda.runtime``, ``cuda.Device``), streams and events
(``cuda.stream``), the memory pool and memory hooks (``_memory.py``), pinned host memory,
``cupy.cuda.nccl`` over mpi4py between ranks (``cuda/nccl.py``) and the one ``cupyx``
piece (``cupyx.scipy.special.erf``). Anything else is missing on purpose: an
``AttributeError`` here is a call to check against CuPy's documentation before adding it.
Arrays live in host memory, kernels run at once on the host; see ``cuda/stream.py`` for
what that means for streams.
"""

from __future__ import annotations

import numpy as _np

from cupy import _core
from cupy._core import ndarray
from cupy._memory import get_default_memory_pool

__version__ = "14.2.0+standin"  # the CuPy release whose API it follows

# numpy's scalar types and constants, as CuPy re-exports them
bool_, int8, int16, int32, int64 = _np.bool_, _np.int8, _np.int16, _np.int32, _np.int64
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
float16, float32, float64 = _np.float16, _np.float32, _np.float64
complex64, complex128 = _np.complex64, _np.complex128
dtype, generic, number, integer, floating = (
    _np.dtype,
    _np.generic,
    _np.number,
    _np.integer,
    _np.floating,
)
inf, nan, pi, e, newaxis = _np.inf, _np.nan, _np.pi, _np.e, _np.newaxis
finfo, iinfo, result_type, can_cast = _np.finfo, _np.iinfo, _np.result_type, _np.can_cast


def _function(np_function):
    def function(*args, **kwargs):
        return _core.call(np_function, args, kwargs)

    function.__name__ = np_function.__name__
    function.__doc__ = f"cupy.{np_function.__name__} (numpy's, on device arrays)"
    return function


# Functions of CuPy's that take device arrays (or none), as numpy's of the same name.
_FUNCTIONS = (
    "all", "amax", "amin", "any", "arange", "argmax", "argmin", "argsort",
    "array_equal", "broadcast_arrays", "broadcast_to", "clip", "concatenate",
    "count_nonzero", "cumprod", "cumsum", "diagonal", "dot", "einsum", "empty", "empty_like",
    "expand_dims", "eye", "flip", "full", "full_like", "hstack", "linspace", "max", "mean",
    "min", "moveaxis", "nonzero", "ones", "ones_like", "outer", "pad", "prod", "ravel",
    "repeat", "reshape", "round", "sort", "split", "squeeze", "stack", "std", "sum",
    "swapaxes", "take", "take_along_axis", "tensordot", "tile", "transpose", "tri", "tril",
    "triu", "var", "vstack", "where", "zeros", "zeros_like",
)  # fmt: skip
# CuPy's ufuncs: operands are device arrays or scalars, never host arrays.
_UFUNCS = (
    "absolute", "arctan", "bitwise_and", "bitwise_or", "bitwise_xor", "ceil", "copysign",
    "cos", "cosh", "divide", "equal", "exp", "expm1", "floor", "floor_divide", "fmax",
    "fmin", "greater", "greater_equal", "invert", "isfinite", "isinf", "isnan",
    "left_shift", "less", "less_equal", "log", "log10", "log1p", "log2", "logical_and",
    "logical_not", "logical_or", "logical_xor", "matmul", "maximum", "minimum", "multiply",
    "negative", "not_equal", "positive", "power", "reciprocal", "remainder", "right_shift",
    "rint", "sign", "signbit", "sin", "sinh", "sqrt", "square", "subtract", "tan", "tanh",
    "true_divide", "trunc",
)  # fmt: skip
for _name in _FUNCTIONS:
    globals()[_name] = _function(getattr(_np, _name))
for _name in _UFUNCS:
    globals()[_name] = _core.ufunc_type(getattr(_np, _name))
add = _core.add_ufunc_type(_np.add)
abs = globals()["absolute"]  # CuPy's alias of absolute


def asarray(a, dtype=None, order=None, *, blocking=False):
    """The array itself when it is one of this device's with that dtype; else a copy to
    the device (host data are copied explicitly, as CuPy does)."""
    if isinstance(a, ndarray):
        return a if dtype is None or _np.dtype(dtype) == a.dtype else a.astype(dtype)
    return array(a, dtype=dtype, order=order or "K")


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return _core.call(
            _np.array, (obj,), {"dtype": dtype, "copy": True, "order": order, "ndmin": ndmin}
        )
    host = _np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin)
    if host.dtype == object:
        raise ValueError(f"Unsupported dtype {host.dtype}")
    return _core.device_array(host)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(
            "Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
            f"got {type(a).__name__})"
        )
    return _core.call(_np.ascontiguousarray, (a,), {"dtype": dtype})


def copy(a, order="K"):
    return _core.call(_np.copy, (a,), {"order": order})


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    host = _np.asarray(a, order=order)
    if out is None:
        return host
    out[...] = host
    return out


def get_array_module(*args):
    import numpy

    import cupy

    return cupy if any(isinstance(a, ndarray) for a in args) else numpy


from cupy import cuda  # noqa: E402 (the subpackage needs the names above)

__all__ = ["asarray", "asnumpy", "cuda", "get_default_memory_pool", "ndarray"]
