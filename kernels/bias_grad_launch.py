"""Launching kernels/bias_grad.cu: the bias gradient, db = dz summed over the rows.

    bg = cb.load_launch("bias_grad")
    db = bg.bias_grad(dz)                        # bias_grad_v2 (float32) or bias_grad_f64
    bg.bias_grad(dz, db, version="bias_grad_v1") # the one-thread-per-column version
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["VERSIONS", "bias_grad", "sanitize_targets"]

VERSIONS = ("bias_grad_v1", "bias_grad_v2")


def _module():
    return cb.module("bias_grad")     # compiled once per process


def bias_grad(dz, db=None, version: str = "bias_grad_v2"):
    """db[j] = sum_i dz[i, j] for a contiguous (M, N) ``dz``; float64 runs bias_grad_f64."""
    import cupy as cp

    cb.expect(dz, "dz", ndim=2)
    dt = np.dtype(str(dz.dtype).replace("torch.", ""))
    if dt == np.float64:
        version = "bias_grad_f64"
    elif dt != np.float32:
        raise TypeError(f"dz: expected float32 or float64, got {dt}")
    elif version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; bias_grad.cu has {VERSIONS}")
    M, N = (int(s) for s in dz.shape)
    if M * N == 0 or M * N >= 2**62:
        raise LaunchError(f"bias_grad: dz has shape {(M, N)}")
    db = cp.empty(N, dt) if db is None else db
    cb.expect(db, "db", dtype=dt, shape=(N,))
    k = _module().get(version)
    if version == "bias_grad_v2":
        k((ceil_div(N, 32),), (32, 32), (dz, db, np.int32(M), np.int32(N)))
    else:
        k((ceil_div(N, 256),), (256,), (dz, db, np.int32(M), np.int32(N)))
    return db


def sanitize_targets():
    """Both versions on a ragged shape (racecheck: v2's shared tree; memcheck: the guards)."""
    import cupy as cp

    dz = cp.random.standard_normal((67, 45), dtype=cp.float32)
    for v in VERSIONS:
        yield f"{v} (67x45)", (lambda v=v: bias_grad(dz, version=v))
