"""Launching kernels/transpose.cu: out (cols, rows) = in (rows, cols) transposed, float32.

    tl = cb.load_launch("transpose")
    out = tl.transpose(a)                          # transpose_v5
    tl.transpose(a, out, version="transpose_v3")
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, grid_2d, returns_launch

__all__ = ["VERSIONS", "TILES", "transpose", "config", "sanitize_targets"]

VERSIONS = ("transpose_v1", "transpose_v2", "transpose_v3", "transpose_v4", "transpose_v5")
#: (rows, cols) of the input each block of 32 x 8 threads covers
TILES = {"transpose_v1": (32, 32), "transpose_v2": (32, 32), "transpose_v3": (32, 32),
         "transpose_v4": (64, 32), "transpose_v5": (64, 64)}

def _module():
    return cb.module("transpose")     # compiled once per process


@returns_launch
def config(version: str, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) of ``version`` for a rows x cols input."""
    if version not in TILES:
        raise ValueError(f"unknown version {version!r}; transpose.cu has {VERSIONS}")
    return grid_2d(rows, cols, TILES[version]), (32, 8)


def transpose(a, out=None, version: str = "transpose_v5"):
    """``a.T`` of the float32 matrix ``a`` into ``out`` (returned)."""
    import cupy as cp

    mod = _module()
    cb.expect(a, "a", dtype=np.float32, ndim=2)
    rows, cols = (int(s) for s in a.shape)
    if rows * cols == 0:
        raise LaunchError(f"transpose: a has shape {(rows, cols)}")
    if rows * cols >= 2**62:
        raise LaunchError("transpose: the matrix is too large")
    out = cp.empty((cols, rows), cp.float32) if out is None else out
    cb.expect(out, "out", dtype=np.float32, shape=(cols, rows))
    grid, block = config(version, rows, cols)
    mod.get(version)(grid, block, (a, out, np.int32(rows), np.int32(cols)))
    return out


def sanitize_targets():
    """Every version on a ragged shape (racecheck: the shared tiles; memcheck: the edges)."""
    import cupy as cp

    a = cp.random.rand(67, 45, dtype=cp.float32)
    out = cp.empty((45, 67), cp.float32)
    for v in VERSIONS:
        yield v, (lambda v=v: transpose(a, out, version=v))
