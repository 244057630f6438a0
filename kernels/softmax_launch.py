"""Launching kernels/softmax.cu: y = softmax(x) over the last dimension of a float32 (M, N) x.

    sm = cb.load_launch("softmax")
    y = sm.softmax(x)                      # softmax_v5, any N; y allocated (or pass y=...)
    sm.softmax(x, y, version="softmax_v3")  # or version="v3"

    VERSIONS                       the ladder, softmax_v1..v5
    config(version, M, N, vec)     -> Launch(grid, block, kernel=version), once for the lesson,
                                   the tests and the helper
    softmax(x, y=None, version)    the entry point: checks, config, launch, returns y
    sanitize_targets()             every version on each path of softmax_v5

The checks, before anything is launched: x float32, two dimensions, C-contiguous, on the GPU;
y of x's shape (allocated by x's library when not given); N >= 1 and rows that fit one grid
dimension. softmax_v5 takes its float4 path when N % 4 == 0 and x and y are 16-byte aligned.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, row_block, version_name

__all__ = ["VERSIONS", "softmax", "config", "sanitize_targets"]

VERSIONS = ("softmax_v1", "softmax_v2", "softmax_v3", "softmax_v4", "softmax_v5")


def config(version: str, M: int, N: int, vec: bool = False) -> Launch:
    """Grid and block of ``version`` for an (M, N) input (see the launch comments in softmax.cu);
    ``vec``: softmax_v5 takes its float4 path."""
    version = version_name(VERSIONS, version, "softmax")
    if version == "softmax_v1":
        return Launch((ceil_div(M, 128),), (128,), kernel=version)
    if version == "softmax_v3":
        return Launch((ceil_div(M, 4),), (128,), kernel=version)   # 4 warps, one row each
    if version == "softmax_v5":     # the row in registers: <= 16 per thread, 32 for long float4 rows
        return Launch((M,), (row_block(N, 32 if vec and N > 8192 else 16),), kernel=version)
    return Launch((M,), (256 if N <= 4096 else 512,), kernel=version)      # softmax_v2, v4


def softmax(x, y=None, version: str = "softmax_v5"):
    """softmax over the last dimension of the float32 (M, N) ``x`` into ``y`` (returned);
    ``version``: "softmax_v3" or "v3"."""
    version = version_name(VERSIONS, version, "softmax")
    mod = _module()                   # first: without a GPU this says so
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    if y is None:
        y = cb.arrays.empty_like_lib(x, (M, N), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=(M, N))
    if M == 0 or N == 0:
        raise LaunchError(f"softmax: x has shape {(M, N)}; a row needs at least one element")
    if M >= 2**31 or M * N >= 2**62:
        raise LaunchError(f"softmax: {M} rows is more than one grid dimension holds")
    vec = N % 4 == 0 and cb.expect_aligned(x, "x") and cb.expect_aligned(y, "y")   # v5's float4
    cfg = config(version, M, N, vec)
    cb.launch.run(mod.get(cfg.kernel), cfg,
                  (cb.as_cupy(x, "x"), cb.as_cupy(y, "y"), np.int32(M), np.int32(N)),
                  stream=cb.stream_for(x, y))
    return y


def _module():
    return cb.module("softmax")     # the whole file, compiled once per process


def sanitize_targets():
    """Every version on shapes that take each path of softmax_v5: float4 (N % 4 == 0), scalar
    (N = 1001), and a row too long for the registers (streamed)."""
    import cupy as cp

    for M, N in ((5, 256), (3, 1001), (2, 40_000)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        y = cp.empty_like(x)
        for v in VERSIONS:
            if v == "softmax_v1" and N > 1001:
                continue                                   # one thread per row: slow, same path
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, y=y: softmax(x, y, version=v))
