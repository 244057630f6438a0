"""The launch core's view of an array: whatever library made it, what a kernel launch needs.

A launcher receives CuPy arrays, PyTorch tensors, Numba device arrays (anything with
``__cuda_array_interface__``) and, in simulator mode, NumPy arrays. ``describe`` reads each
once into an ``ArrayInfo`` (library, device address, shape, dtype, contiguity, where it lives);
``cudabook.validate.expect`` is built on it. ``stream_for`` is the stream a launch on these
arrays belongs on (PyTorch's current stream when a tensor is involved, so the kernel is ordered
with the PyTorch work around it), ``as_cupy`` the zero-copy CuPy view a RawKernel takes, and
``empty_like_lib`` a new output from the library of the inputs.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ArrayInfo", "describe", "lib_of", "as_cupy", "stream_for", "launch_stream",
           "empty_like_lib"]


@dataclass(frozen=True)
class ArrayInfo:
    """What a kernel launch needs to know about an array, whatever library made it."""
    name: str
    lib: str                  # "cupy", "torch", "numba" (any __cuda_array_interface__), "numpy"
    ptr: int                  # address of the first element
    shape: tuple
    dtype: str                # numpy-style name: "float32", "float16", "bfloat16", "int8", ...
    contiguous: bool          # C order, no gaps
    on_device: bool           # lives in GPU memory
    device_id: int | None     # the CUDA device holding it (None: host or unknown)
    obj: Any

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype) or np.dtype(self.dtype).itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def lib_of(a: Any) -> str:
    """"torch", "cupy", "numpy", "numba" (another ``__cuda_array_interface__`` array) or the
    object's module name."""
    m = type(a).__module__
    if m.startswith("torch"):
        return "torch"
    if m.startswith("cupy"):
        return "cupy"
    if isinstance(a, np.ndarray):
        return "numpy"
    if hasattr(a, "__cuda_array_interface__"):
        return "numba"
    return m


def _dense(shape: tuple, strides, itemsize: int) -> bool:
    if strides is None:
        return True
    want, acc = [], itemsize
    for s in reversed(shape):
        want.append(acc)
        acc *= int(s)
    return all(int(st) == w for st, w, n in zip(strides, reversed(want), shape) if int(n) > 1)


_DT_STR: dict = {}


def _dt_str(dt: Any) -> str:
    """str(dt) without a "torch." prefix, looked up once per dtype (str of a numpy dtype takes
    microseconds, and every launch describes several arrays)."""
    try:
        return _DT_STR[dt]
    except KeyError:
        s = _DT_STR[dt] = str(dt).replace("torch.", "")
        return s
    except TypeError:
        return str(dt).replace("torch.", "")


def describe(a: Any, name: str = "array") -> ArrayInfo:
    """An ``ArrayInfo`` of ``a``; TypeError naming ``name`` if ``a`` is not an array."""
    lib = lib_of(a)
    if lib == "torch":
        dt = _dt_str(a.dtype)
        return ArrayInfo(name, lib, int(a.data_ptr()), tuple(int(s) for s in a.shape), dt,
                         bool(a.is_contiguous()), bool(a.is_cuda),
                         a.device.index if a.is_cuda else None, a)
    if lib == "cupy":
        return ArrayInfo(name, lib, int(a.data.ptr), tuple(a.shape), _dt_str(a.dtype),
                         bool(a.flags.c_contiguous), True, int(a.data.device_id), a)
    if lib == "numpy":
        return ArrayInfo(name, lib, int(a.ctypes.data), tuple(a.shape), _dt_str(a.dtype),
                         bool(a.flags.c_contiguous), False, None, a)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        if hasattr(a, "shape") and hasattr(a, "dtype"):      # the simulator's device arrays
            ok = a.is_c_contiguous() if hasattr(a, "is_c_contiguous") else \
                bool(getattr(a, "flags", {"C_CONTIGUOUS": True})["C_CONTIGUOUS"])
            return ArrayInfo(name, lib, 0, tuple(int(s) for s in a.shape), str(a.dtype), ok,
                             False, None, a)
        raise TypeError(f"{name}: expected an array (CuPy, PyTorch, Numba device array), got "
                        f"{type(a).__module__}.{type(a).__name__}")
    dt = np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    return ArrayInfo(name, "numba", int(cai["data"][0]), shape, str(dt),
                     _dense(shape, cai.get("strides"), dt.itemsize), True, None, a)


def as_cupy(a: Any, name: str = "array"):
    """The CuPy view of the GPU array ``a`` (no copy), for a RawKernel's argument list.

    TypeError, naming ``name``, for a host array or anything that is not an array."""
    import cupy

    if isinstance(a, cupy.ndarray):
        return a
    info = describe(a, name)
    if not info.on_device:
        how = ".to('cuda')" if info.lib == "torch" else "cupy.asarray(...)"
        raise TypeError(f"{name}: expected a GPU array, got a {info.lib} array on the host; "
                        f"move it with {how}")
    return cupy.asarray(a)


def _external(ptr: int):
    import cupy

    with warnings.catch_warnings():     # CuPy 14.2 deprecates ExternalStream; Colab's CuPy 14.0
        warnings.simplefilter("ignore", DeprecationWarning)        # lacks its successor
        return cupy.cuda.ExternalStream(ptr)


def stream_for(*arrays: Any):
    """The CuPy stream a kernel on these arrays is launched on: PyTorch's current stream (of the
    first tensor's device) when any of them is a torch tensor, else CuPy's current stream."""
    import cupy

    for a in arrays:
        if lib_of(a) == "torch":
            import torch

            return _external(torch.cuda.current_stream(a.device).cuda_stream)
    return cupy.cuda.get_current_stream()


def launch_stream(*arrays: Any):
    """A context manager making ``stream_for(*arrays)`` CuPy's current stream (a no-op when it
    already is)."""
    import cupy

    s = stream_for(*arrays)
    if s.ptr == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext()
    return s


def empty_like_lib(like: Any, shape: tuple, dtype: str):
    """An uninitialised GPU array of ``shape`` and ``dtype`` from the library of ``like`` (a
    torch tensor on its device, else a CuPy array on the current device)."""
    if lib_of(like) == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    return cupy.empty(shape, dtype=dtype)

