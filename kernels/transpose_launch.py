"""Launching kernels/transpose.cu: out (cols, rows) = in (rows, cols) transposed, float32.

    tl = cb.load_launch("transpose")
    out = tl.transpose(a)                          # transpose_v5
    tl.transpose(a, out, version="transpose_v3")   # or version="v3"

    VERSIONS, TILES                the ladder, and the (rows, cols) of the input each block covers
    config(version, rows, cols)    -> Launch(grid, block=(32, 8), kernel=version)
    transpose(a, out=None, version)   the entry point: checks, config, launch, returns out
    sanitize_targets()

The checks, before anything is launched: a float32, 2D, C-contiguous, on the GPU, not empty;
out float32 (cols, rows) (allocated by a's library when not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, grid_2d, version_name

__all__ = ["VERSIONS", "TILES", "transpose", "config", "sanitize_targets"]

VERSIONS = ("transpose_v1", "transpose_v2", "transpose_v3", "transpose_v4", "transpose_v5")
#: (rows, cols) of the input each block of 32 x 8 threads covers
TILES = {"transpose_v1": (32, 32), "transpose_v2": (32, 32), "transpose_v3": (32, 32),
         "transpose_v4": (64, 32), "transpose_v5": (64, 64)}


def _module():
    return cb.module("transpose")     # the whole file, compiled once per process


def config(version: str, rows: int, cols: int) -> Launch:
    """Grid and block of ``version`` for a rows x cols input."""
    version = version_name(VERSIONS, version, "transpose")
    return Launch(grid_2d(rows, cols, TILES[version]), (32, 8), kernel=version)


def transpose(a, out=None, version: str = "transpose_v5"):
    """``a.T`` of the float32 matrix ``a`` into ``out`` (returned); ``version``: "transpose_v5"
    or "v5"."""
    version = version_name(VERSIONS, version, "transpose")
    mod = _module()
    cb.expect(a, "a", dtype=np.float32, ndim=2)
    rows, cols = (int(s) for s in a.shape)
    if rows * cols == 0:
        raise LaunchError(f"transpose: a has shape {(rows, cols)}")
    if rows * cols >= 2**62:
        raise LaunchError("transpose: the matrix is too large")
    if out is None:
        out = cb.arrays.empty_like_lib(a, (cols, rows), "float32")
    cb.expect(out, "out", dtype=np.float32, shape=(cols, rows))
    cfg = config(version, rows, cols)
    cb.launch.run(mod.get(cfg.kernel), cfg,
                  (cb.as_cupy(a, "a"), cb.as_cupy(out, "out"), np.int32(rows), np.int32(cols)),
                  stream=cb.stream_for(a, out))
    return out


def sanitize_targets():
    """Every version on a ragged shape (racecheck: the shared tiles; memcheck: the edges)."""
    import cupy as cp

    a = cp.random.rand(67, 45, dtype=cp.float32)
    out = cp.empty((45, 67), cp.float32)
    for v in VERSIONS:
        yield v, (lambda v=v: transpose(a, out, version=v))
