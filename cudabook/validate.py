"""Clear errors for bad input to a kernel launcher: wrong dtype, shape, layout, alignment or device.

A kernel does not check its arguments: a float64 array passed where float32 is expected is read
as garbage, a host array is copied on every launch, a strided view is read as if it were
contiguous, and a float4 access to an address that is not a multiple of 16 ends the CUDA context.
Launchers call ``expect`` (and ``expect_aligned`` where they take a vector path) first. It reads
the array once with ``cudabook.arrays.describe`` (the launch core's view of an array, whatever
library made it); see ``cudabook.launch`` for the rest of the launch core.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import env
from .arrays import describe

__all__ = ["expect", "expect_aligned", "expect_one_gpu", "overlaps", "data_ptr", "dtype_name"]


_DTYPES: dict = {}                   # dtype-like (numpy, torch, type, name) -> its name


def dtype_name(dt: Any) -> str:
    """``dt`` (a numpy dtype, a numpy scalar type, a torch dtype or a name) as a numpy-style
    name ("float32", "bfloat16", ...); looked up once per distinct value (launchers check
    several arrays on every launch)."""
    try:
        r = _DTYPES.get(dt)              # numpy's dtype.name takes microseconds: ask it once
    except TypeError:                    # unhashable: named below, not kept
        r = None
    if r is None and isinstance(dt, np.dtype):
        r = _DTYPES[dt] = dt.name
    if r is None:
        s = str(dt).replace("torch.", "")
        try:
            r = np.dtype(dt if isinstance(dt, type) else s).name
        except TypeError:
            r = s                    # bfloat16, float8_*: names numpy does not know
        _DTYPES[dt] = r
    return r


def data_ptr(a: Any) -> int | None:
    """The device (or host) address of the first element of ``a``, or None if unknown."""
    try:
        p = describe(a).ptr
    except TypeError:
        return None
    return p or None


def expect_aligned(a: Any, name: str, nbytes: int = 16) -> bool:
    """True when ``a``'s first element sits at a multiple of ``nbytes`` (16 for float4).

    A helper that has a vector path uses it to choose that path; it never raises.
    """
    p = data_ptr(a)
    return p is not None and p % nbytes == 0


def expect(a: Any, name: str, *, dtype=None, ndim: int | None = None,
           shape: tuple | None = None, device: bool = True, contiguous: bool = True) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``a`` is what the kernel needs.

    ``shape`` may hold None for a free dimension. With ``device=True`` the array must live on the
    GPU (CuPy, PyTorch CUDA, Numba device array); in simulator mode host arrays are accepted.
    """
    if not isinstance(name, str):
        raise TypeError(f"expect: name must be a str (the argument's name), got "
                        f"{type(name).__name__}")
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(a).__name__}")
    info = describe(a, name)
    if device and env.HAS_GPU and not info.on_device:
        raise TypeError(f"{name}: expected a GPU array (cupy, torch on 'cuda', numba device "
                        f"array), got {type(a).__module__}.{type(a).__name__} on the host; "
                        "move it with cupy.asarray(...) or .to('cuda')")
    dt = dtype_name(a.dtype)
    if dtype is not None and dt != dtype_name(dtype):
        raise TypeError(f"{name}: expected dtype {dtype_name(dtype)}, got {dt}")
    shp = info.shape
    if ndim is not None and len(shp) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {shp}")
    if shape is not None:
        if len(shp) != len(shape) or any(w is not None and s != w for s, w in zip(shp, shape)):
            want = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name}: expected shape {want}, got {shp}")
    if contiguous and not info.contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (a strided view would be "
                         "read as if it were dense); pass a contiguous copy")


def expect_one_gpu(*pairs: tuple[str, Any]) -> list:
    """The ``ArrayInfo`` of each (name, array) pair, after checking that every one lives in GPU
    memory (TypeError naming the first on the host, and how to move it) and that all live on the
    same GPU (ValueError naming two that do not)."""
    infos = [describe(a, name) for name, a in pairs]
    for info in infos:
        if not info.on_device:
            how = ".to('cuda')" if info.lib == "torch" else "cupy.asarray(...)"
            raise TypeError(f"{info.name}: expected a GPU array (a torch tensor on 'cuda' or a "
                            f"CuPy array), got a {info.lib} array on the host; move it with {how}")
    first = infos[0] if infos else None
    for info in infos[1:]:
        if None not in (first.device_id, info.device_id) and first.device_id != info.device_id:
            raise ValueError(f"{info.name} is on GPU {info.device_id}, {first.name} on GPU "
                             f"{first.device_id}: put them on one device")
    return infos


def overlaps(a: Any, b: Any, nbytes: int | None = None) -> bool:
    """Whether the memory of a and b (arrays or ``ArrayInfo``s) shares a byte: their whole
    extents, or the ``nbytes`` from each start."""
    x, y = (v if hasattr(v, "ptr") and hasattr(v, "on_device") else describe(v) for v in (a, b))
    nx = nbytes if nbytes is not None else x.size * x.itemsize
    ny = nbytes if nbytes is not None else y.size * y.itemsize
    return x.ptr < y.ptr + ny and y.ptr < x.ptr + nx
