"""Launching kernels/softmax.cu: y = softmax(x) over the last dimension of a float32 (M, N) x.

    sm = cb.load_launch("softmax")
    y = sm.softmax(x)                      # softmax_v5, any N; y allocated (or pass y=...)
    sm.softmax(x, y, version="softmax_v3")

Each version's grid and block are here, once (the lesson and the tests use them). The helper
checks the arguments before anything is launched: float32, two dimensions, C-contiguous,
on the GPU, y of x's shape, and N >= 1.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div, returns_launch, row_block, version_name

__all__ = ["VERSIONS", "softmax", "config", "sanitize_targets"]

VERSIONS = ("softmax_v1", "softmax_v2", "softmax_v3", "softmax_v4", "softmax_v5")


@returns_launch
def config(version: str, M: int, N: int, vec: bool = False) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of ``version`` for an (M, N) input (see the launch comments in softmax.cu)."""
    if version == "softmax_v1":
        return (ceil_div(M, 128),), (128,)
    if version == "softmax_v3":
        return (ceil_div(M, 4),), (128,)           # 4 warps per block, one row each
    if version == "softmax_v5":                    # the row in registers: <= 16 per thread,
        return (M,), (row_block(N, 32 if vec and N > 8192 else 16),)   # 32 for long float4 rows
    if version in ("softmax_v2", "softmax_v4"):
        return (M,), (256 if N <= 4096 else 512,)
    raise ValueError(f"unknown version {version!r}; softmax.cu has {VERSIONS}")


def softmax(x, y=None, version: str = "softmax_v5"):
    """softmax over the last dimension of the float32 (M, N) ``x`` into ``y`` (returned);
    ``version``: "softmax_v3" or "v3"."""
    import cupy as cp

    version = version_name(VERSIONS, version, "softmax")
    mod = _module()                   # first: without a GPU this says so
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    if y is None:
        y = cp.empty((M, N), cp.float32)
    cb.expect(y, "y", dtype=np.float32, shape=(M, N))
    if M == 0 or N == 0:
        raise LaunchError(f"softmax: x has shape {(M, N)}; a row needs at least one element")
    if M >= 2**31 or M * N >= 2**62:
        raise LaunchError(f"softmax: {M} rows is more than one grid dimension holds")
    vec = N % 4 == 0 and x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0   # softmax_v5's float4 path
    grid, block = config(version, M, N, vec)
    mod.get(version)(grid, block, (x, y, np.int32(M), np.int32(N)))
    return y


def _module():
    return cb.module("softmax")     # compiled once per process


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
