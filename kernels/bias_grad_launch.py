"""Launching kernels/bias_grad.cu: the bias gradient, db = dz summed over the rows.

    bg = cb.load_launch("bias_grad")
    db = bg.bias_grad(dz)                        # bias_grad_v2 (float32) or bias_grad_f64
    bg.bias_grad(dz, db, version="bias_grad_v1") # the one-thread-per-column version ("v1")

    VERSIONS                       the float32 ladder (float64 runs bias_grad_f64)
    config(version, M, N)          -> Launch(grid, block, kernel=version)
    bias_grad(dz, db=None, version)   the entry point: checks, config, launch, returns db
    sanitize_targets()

The checks, before anything is launched: dz float32 or float64, 2D, C-contiguous, on the GPU,
not empty; db of dz's dtype, (N,) (allocated by dz's library when not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name
from cudabook.validate import dtype_name

__all__ = ["VERSIONS", "bias_grad", "config", "sanitize_targets"]

VERSIONS = ("bias_grad_v1", "bias_grad_v2")


def _module():
    return cb.module("bias_grad")     # the whole file, compiled once per process


def config(version: str, M: int, N: int) -> Launch:
    """Grid and block of ``version`` (or "bias_grad_f64") for an (M, N) ``dz``: a column per
    thread (v1, f64), or 32 columns per block of 32 x 32 threads (v2)."""
    version = version_name(VERSIONS + ("bias_grad_f64",), version, "bias_grad")
    if version == "bias_grad_v2":
        return Launch((ceil_div(N, 32),), (32, 32), kernel=version)
    return Launch((ceil_div(N, 256),), (256,), kernel=version)


def bias_grad(dz, db=None, version: str = "bias_grad_v2"):
    """db[j] = sum_i dz[i, j] for a contiguous (M, N) ``dz`` (returned); float64 runs
    bias_grad_f64. ``version``: "bias_grad_v2" or "v2"."""
    cb.expect(dz, "dz", ndim=2)
    dt = dtype_name(dz.dtype)
    if dt == "float64":
        version = "bias_grad_f64"                  # whatever was asked: one float64 kernel
    elif dt != "float32":
        raise TypeError(f"dz: expected float32 or float64, got {dt}")
    else:
        version = version_name(VERSIONS, version, "bias_grad")
    M, N = (int(s) for s in dz.shape)
    if M * N == 0 or M * N >= 2**62:
        raise LaunchError(f"bias_grad: dz has shape {(M, N)}")
    if db is None:
        db = cb.arrays.empty_like_lib(dz, (N,), dt)
    cb.expect(db, "db", dtype=dt, shape=(N,))
    cfg = config(version, M, N)
    cb.launch.run(_module().get(cfg.kernel), cfg,
                  (cb.as_cupy(dz, "dz"), cb.as_cupy(db, "db"), np.int32(M), np.int32(N)),
                  stream=cb.stream_for(dz, db))
    return db


def sanitize_targets():
    """Both versions on a ragged shape (racecheck: v2's shared tree; memcheck: the guards)."""
    import cupy as cp

    dz = cp.random.standard_normal((67, 45), dtype=cp.float32)
    for v in VERSIONS:
        yield f"{v} (67x45)", (lambda v=v: bias_grad(dz, version=v))
