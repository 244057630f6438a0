"""TMA descriptors: the one builder of the book's Hopper kernels (hgemm, igemm, attention).

A Hopper kernel that loads tiles with the Tensor Memory Accelerator reads a 128-byte
``CUtensorMap`` that describes the global matrix (address, sizes, row pitch), the box one
``cp.async.bulk.tensor`` copies, the shared-memory swizzle and what an out-of-bounds element
reads as. The driver encodes it (``cuTensorMapEncodeTiled``); this module calls that one symbol
of ``libcuda`` through ``ctypes`` (the library CuPy already runs on: no extra package), and
returns the descriptor as a NumPy ``np.void`` that CuPy passes by value to a
``const __grid_constant__ TmaDesc`` kernel parameter.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from .launch import LaunchError

__all__ = ["tensor_map", "DTYPES", "SWIZZLES"]

#: element type name -> (CUtensorMapDataType, bytes per element)   (cuda.h enums)
DTYPES = {"uint8": (0, 1), "int8": (0, 1), "float8_e4m3fn": (0, 1), "float8_e5m2": (0, 1),
          "float16": (6, 2), "bfloat16": (9, 2), "float32": (7, 4)}
#: swizzle width in bytes -> CUtensorMapSwizzle (NONE 0, 32B 1, 64B 2, 128B 3)
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_256B, _INTERLEAVE_NONE, _OOB_FILL_ZEROS = 3, 0, 0

_CACHE: dict = {}
_CUDA = None


def _libcuda():
    global _CUDA
    if _CUDA is None:
        _CUDA = ctypes.CDLL("nvcuda.dll" if sys.platform.startswith("win") else "libcuda.so.1")
        _CUDA.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return _CUDA


def tensor_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int,
               dtype: str = "float16", swizzle: int = 128) -> np.void:
    """A TMA descriptor of the row-major (rows, cols) matrix of ``dtype`` at ``ptr``: boxes of
    ``box_rows`` x ``box_cols`` elements, ``swizzle``-byte shared-memory swizzle, elements
    outside the matrix read as zeros (the edge tiles).

    LaunchError for what TMA cannot describe: a start address or row pitch that is not a
    multiple of 16 bytes, a box over 256 elements a side, a swizzled box row wider than the
    swizzle. Descriptors are cached by their arguments (a launch builds them on every call)."""
    key = (int(ptr), int(rows), int(cols), int(box_rows), int(box_cols), dtype, int(swizzle))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if dtype not in DTYPES:
        raise LaunchError(f"tensor_map: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if swizzle not in SWIZZLES:
        raise LaunchError(f"tensor_map: swizzle is 0, 32, 64 or 128 bytes, got {swizzle}")
    code, size = DTYPES[dtype]
    if ptr % 16 or cols * size % 16:
        raise LaunchError("TMA needs 16-byte aligned rows and start address: the matrix starts "
                          f"at {ptr:#x} with rows of {cols * size} bytes")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
        raise LaunchError(f"tensor_map: a TMA box is 1..256 elements a side, got "
                          f"{box_rows} x {box_cols}")
    if swizzle and box_cols * size > swizzle:
        raise LaunchError(f"tensor_map: a box row of {box_cols * size} bytes is wider than the "
                          f"{swizzle}-byte swizzle")
    if rows < 1 or cols < 1:
        raise LaunchError(f"tensor_map: an empty matrix ({rows} x {cols})")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    buf = np.zeros(128 + 64, np.uint8)                  # CUtensorMap is 64-byte aligned
    at = buf.ctypes.data + (-buf.ctypes.data) % 64
    err = _libcuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(at), code, u32(2), ctypes.c_void_p(ptr), (u64 * 2)(cols, rows),
        (u64 * 1)(cols * size), (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1),
        _INTERLEAVE_NONE, SWIZZLES[swizzle], _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if err != 0:
        raise LaunchError(f"cuTensorMapEncodeTiled failed: CUresult {err}")
    off = at - buf.ctypes.data
    val = np.frombuffer(buf[off:off + 128].tobytes(), dtype=np.dtype((np.void, 128)))[0]
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = val
    return val
