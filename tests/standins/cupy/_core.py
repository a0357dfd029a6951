"""``cupy.ndarray`` backed by a numpy array in "device" memory, strict where CuPy is.

What CuPy refuses, this refuses, with CuPy's exception and words:

- no implicit device-to-host conversion: ``numpy.asarray``, ``numpy.array`` and every
  numpy function that would read the data raise ``TypeError`` (``__array__``); only
  ``get``, ``cupy.asnumpy``, ``item``, ``tolist`` and Python's ``float``/``int``/``bool``
  of one element move data to the host;
- no implicit host-to-device conversion in kernels: a ``numpy.ndarray`` operand of a
  ufunc, an operator or a cupy function is ``TypeError: Unsupported type`` (numpy and
  Python scalars are fine); assigning a non-scalar numpy array to a basic slice is
  CuPy's ``ValueError`` (``non-scalar numpy.ndarray cannot be used for fill``);
  ``cupy.asarray``/``cupy.array`` (and advanced indexing) copy host data explicitly;
- arrays of another device than the current one are refused (as CuPy without peer
  access);
- ``set``/``get(out=...)`` check type, dtype, shape and contiguity as CuPy does.

Numpy functions called on stand-in arrays dispatch to the stand-in's function of the
same name (``__array_function__``/``__array_ufunc__``, as CuPy's do) and are refused
where the stand-in has none. Reductions return 0-d arrays, not scalars, as CuPy's do.
"""

from __future__ import annotations

import numbers

import numpy as np

from cupy import _devices, _memory
from cupy.cuda import stream as _stream

_SCALARS = (bool, int, float, complex, np.generic)


def _current_device() -> int:
    return _devices.get_device()


def _check_device(x: ndarray) -> None:
    device, current = x._mem.device, _current_device()
    if device != current:
        raise ValueError(
            f"The device where the array resides ({device}) is different from the current "
            f"device ({current}). Peer access is unavailable between these devices."
        )


def operand(x):
    """A kernel's operand: a device array, or a Python or numpy scalar."""
    if isinstance(x, ndarray):
        _check_device(x)
        return x._a
    if isinstance(x, _SCALARS) or x is None:
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def argument(x):
    """Any other argument of a cupy function: device arrays unwrapped (also inside
    lists and tuples); host arrays refused."""
    if isinstance(x, ndarray):
        _check_device(x)
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, list | tuple):
        return type(x)(argument(v) for v in x)
    return x


def device_array(a: np.ndarray) -> ndarray:
    """A numpy result as a device array: a view of the allocation it lies in, or a new
    allocation for a fresh array."""
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if owner.base is not None:  # a view of host bytes numpy does not own: copy them in
        a = np.array(a, copy=True)
    out = object.__new__(ndarray)
    out._a, out._mem = a, _memory.adopt(a)
    return out


def wrap(result):
    if isinstance(result, np.ndarray):
        return device_array(result)
    if isinstance(result, np.generic):  # CuPy's reductions and indexing give 0-d arrays
        return device_array(np.array(result))
    if isinstance(result, tuple):
        return tuple(wrap(r) for r in result)
    if isinstance(result, list):
        return [wrap(r) for r in result]
    return result


def call(function, args, kwargs, unwrap=argument):
    """Run ``function`` (a numpy one) as a kernel on the current device."""
    _stream.before_kernel()
    out = kwargs.get("out")
    result = function(*(unwrap(a) for a in args), **{k: unwrap(v) for k, v in kwargs.items()})
    if isinstance(out, ndarray) and isinstance(result, np.ndarray) and result is out._a:
        return out
    return wrap(result)


def _advanced(key) -> bool:
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(p, list | np.ndarray | ndarray | bool | np.bool_) for p in parts)


def _index(key):
    """An index: device arrays unwrapped; host index arrays (lists, numpy) are copied
    to the device by CuPy, which numpy's own indexing stands for here."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, ndarray):
        _check_device(key)
        return key._a
    return key


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.base is None

    def __getitem__(self, name: str) -> bool:
        return {
            "C_CONTIGUOUS": self.c_contiguous,
            "F_CONTIGUOUS": self.f_contiguous,
            "OWNDATA": self.owndata,
        }[name]


class ndarray:
    """cupy.ndarray on numpy: ``_a`` is the data, ``_mem`` the allocation it lies in."""

    __slots__ = ("__weakref__", "_a", "_mem")

    def __init__(self, shape, dtype=float, *, order: str = "C") -> None:
        _stream.before_kernel()
        self._a = np.empty(shape, dtype=dtype, order=order)
        self._mem = _memory.adopt(self._a)

    # --- what an array is ---------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    T = property(lambda self: call(np.transpose, (self,), {}))
    real = property(lambda self: wrap(self._a.real))
    imag = property(lambda self: wrap(self._a.imag))

    @property
    def data(self) -> _memory.MemoryPointer:
        return _memory.MemoryPointer(self._mem, self._a.__array_interface__["data"][0])

    @property
    def device(self):
        from cupy.cuda.device import Device

        return Device(self._mem.device)

    @property
    def base(self):
        return None if self._a.base is None else wrap(self._a.base)

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "descr": [("", a.dtype.str)],
            "data": (a.__array_interface__["data"][0], False),
            "strides": None if a.flags.c_contiguous else a.strides,
            "version": 3,
            "stream": None,
        }

    # --- no implicit conversion to the host -----------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def get(self, stream=None, order: str = "C", out=None, blocking: bool = True):
        stream = _stream.get_current_stream() if stream is None else stream
        stream.synchronize()  # the copy runs after the stream's queued work
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if self.dtype != out.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if self.shape != out.shape:
                raise ValueError(
                    f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}"
                )
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError(
                    "`out` cannot be specified when copying to non-contiguous ndarray"
                )
            np.copyto(out, self._a)
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        stream = _stream.get_current_stream() if stream is None else stream
        stream.synchronize()
        np.copyto(self._a, arr)

    def item(self):
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def __int__(self) -> int:
        return int(self.get())

    def __float__(self) -> float:
        return float(self.get())

    def __complex__(self) -> complex:
        return complex(self.get())

    def __bool__(self) -> bool:
        return bool(self.get())

    def __repr__(self) -> str:
        return repr(self.get())

    def __str__(self) -> str:
        return str(self.get())

    def __format__(self, spec: str) -> str:
        return format(self.get(), spec)

    def __reduce__(self):
        return (_rebuild, (self.get(),))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # --- containers -----------------------------------------------------------------------
    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, key):
        _check_device(self)
        _stream.before_kernel()
        return wrap(self._a[_index(key)])

    def __setitem__(self, key, value) -> None:
        _check_device(self)
        _stream.before_kernel()
        if isinstance(value, ndarray):
            _check_device(value)
            value = value._a
        elif not _advanced(key) and not isinstance(value, _SCALARS):
            # CuPy fills a basic slice from a host value: one number only (gh-2079).
            host = np.asarray(value)
            if host.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = host[()]
        self._a[_index(key)] = value

    def fill(self, value) -> None:
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value.get()[()]
        else:
            host = np.asarray(value, dtype=self.dtype)
            if host.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        _stream.before_kernel()
        self._a.fill(value)

    # --- numpy interoperation, as CuPy dispatches it -------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        import cupy

        if "out" in kwargs:
            (kwargs["out"],) = kwargs["out"]
        func = getattr(cupy, ufunc.__name__, None)
        if not isinstance(func, ufunc_type):
            return NotImplemented
        if method != "__call__":
            func = getattr(func, method, None)
            if func is None:
                return NotImplemented
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        import cupy

        module = cupy
        for part in func.__module__.split(".")[1:]:
            module = getattr(module, part, None)
        mine = getattr(module, func.__name__, None) if module is not None else None
        if mine is None or mine is func:
            return NotImplemented
        if not all(issubclass(t, ndarray | np.ndarray) for t in types):
            return NotImplemented
        return mine(*args, **kwargs)


def _rebuild(host: np.ndarray) -> ndarray:
    return device_array(np.array(host, copy=True))


def _scatter_add(a: ndarray, slices, value) -> None:
    """``cupy.add.at``: with index arrays CuPy copies host values over (``core.array``),
    with basic slices it adds them as a kernel operand (host arrays refused)."""
    _check_device(a)
    _stream.before_kernel()
    value = operand(value) if isinstance(value, ndarray) or not _advanced(slices) else value
    np.add.at(a._a, _index(slices), value)


class ufunc_type:
    """A cupy ufunc: numpy's, run on device operands only."""

    def __init__(self, np_ufunc: np.ufunc) -> None:
        self._ufunc = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args, **kwargs):
        return call(self._ufunc, args, kwargs, unwrap=operand)

    def __repr__(self) -> str:
        return f"<ufunc 'cupy_{self.__name__}'>"


class add_ufunc_type(ufunc_type):
    """``cupy.add``, with ``at`` (numpy's ``add.at``: repeated indices accumulate), the
    only ufunc ``at`` the project uses."""

    def at(self, a, indices, b=None) -> None:
        _scatter_add(a, indices, b)


# The operators: numpy's ufuncs on the operands, so host arrays are refused alike.
_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "matmul": np.matmul,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
}
_COMPARE = {
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}
_UNARY = {"neg": np.negative, "pos": np.positive, "abs": np.absolute, "invert": np.invert}


def _binary(f):
    def forward(self, other):
        if not isinstance(other, ndarray | np.ndarray | numbers.Number | np.generic):
            return NotImplemented
        return call(f, (self, other), {}, unwrap=operand)

    def reflected(self, other):
        if not isinstance(other, ndarray | np.ndarray | numbers.Number | np.generic):
            return NotImplemented
        return call(f, (other, self), {}, unwrap=operand)

    def inplace(self, other):
        call(f, (self, other), {"out": self}, unwrap=operand)
        return self

    return forward, reflected, inplace


for _name, _f in _BINARY.items():
    _fwd, _ref, _inp = _binary(_f)
    setattr(ndarray, f"__{_name}__", _fwd)
    setattr(ndarray, f"__r{_name}__", _ref)
    setattr(ndarray, f"__i{_name}__", _inp)
for _name, _f in _COMPARE.items():
    setattr(ndarray, f"__{_name}__", _binary(_f)[0])
for _name, _f in _UNARY.items():
    setattr(ndarray, f"__{_name}__", lambda self, _f=_f: call(_f, (self,), {}, unwrap=operand))
ndarray.__hash__ = None  # type: ignore[assignment]


# The methods of cupy.ndarray the stand-in has: numpy's, on device arguments.
METHODS = (
    "all", "any", "argmax", "argmin", "argsort", "astype", "clip", "conj", "copy",
    "cumsum", "diagonal", "dot", "flatten", "max", "mean", "min", "nonzero", "prod",
    "ravel", "repeat", "reshape", "round", "sort", "squeeze", "std", "sum", "swapaxes",
    "take", "trace", "transpose", "var", "view",
)  # fmt: skip


def _method(name: str):
    def method(self, *args, **kwargs):
        _check_device(self)
        return call(getattr(self._a, name), args, kwargs)

    method.__name__ = name
    return method


for _name in METHODS:
    setattr(ndarray, _name, _method(_name))
