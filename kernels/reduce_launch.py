"""Launching kernels/reduce.cu: the sum and the maximum of a float32 vector.

    rl = cb.load_launch("reduce")
    s = rl.total(x)                    # reduce_v5: a one-element device array with the sum
    m = rl.maximum(x)                  # reduce_max_v1
    s = rl.ladder(x, "reduce_v2")      # v1..v4: launched again on the partials until one is left

The helpers check x (float32, 1D, C-contiguous, on the GPU, at least one element, and for
the float4 kernels 16-byte aligned) before anything is launched.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["LADDER", "ladder", "total", "maximum", "sanitize_targets"]

#: the versions that write one partial per block, and the elements each thread loads
LADDER = {"reduce_v1": 1, "reduce_v2": 1, "reduce_v3": 2, "reduce_v4": 2}

def _module():
    return cb.module("reduce")     # compiled once per process


def _vector(x, what: str, aligned: bool) -> int:
    _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    if n == 0:
        raise LaunchError(f"{what}: x is empty")
    if n >= 2**31:
        raise LaunchError(f"{what}: the kernels index with int; x has {n} >= 2^31 elements")
    if aligned and not cb.expect_aligned(x, "x"):
        raise LaunchError(f"{what}: reduce_v5 / reduce_max_v1 read float4, and x does not start "
                          "at a 16-byte boundary (a view such as x[1:]); pass a contiguous copy "
                          "(cupy.ascontiguousarray does not realign: use x.copy()) or use "
                          "ladder(x, 'reduce_v4')")
    return n


def _grid() -> int:
    return 4 * max(cb.env.info().sms, 1)


def ladder(x, version: str = "reduce_v4", block: int = 256):
    """The sum by ``version`` (v1..v4), launched again on the partial sums until one is left."""
    import cupy as cp

    if version not in LADDER:
        raise ValueError(f"unknown version {version!r}; the ladder has {tuple(LADDER)}")
    if version in ("reduce_v1", "reduce_v2", "reduce_v3") and block != 256:
        raise LaunchError(f"{version} has a static tree of 256 floats: block must be 256")
    n = _vector(x, "ladder", aligned=False)
    k = _module().get(version)
    while True:
        blocks = ceil_div(n, block * LADDER[version])
        partial = cp.empty(blocks, cp.float32)
        k((blocks,), (block,), (x, partial, np.int32(n)))
        if blocks == 1:
            return partial
        x, n = partial, blocks


def total(x, out=None, grid: int | None = None, block: int = 512):
    """The sum of ``x`` by reduce_v5 into the one-element ``out`` (returned)."""
    import cupy as cp

    n = _vector(x, "total", aligned=True)
    out = cp.zeros(1, cp.float32) if out is None else out
    cb.expect(out, "out", dtype=np.float32, shape=(1,))
    out.fill(0)
    _module().reduce_v5((grid or _grid(),), (block,), (x, out, np.int32(n)))
    return out


def maximum(x, out=None, grid: int | None = None, block: int = 512):
    """The maximum of ``x`` (NaNs ignored) by reduce_max_v1 into ``out`` (returned)."""
    import cupy as cp

    n = _vector(x, "maximum", aligned=True)
    out = cp.empty(1, cp.float32) if out is None else out
    cb.expect(out, "out", dtype=np.float32, shape=(1,))
    out.fill(-np.inf)
    _module().reduce_max_v1((grid or _grid(),), (block,), (x, out, np.int32(n)))
    return out


def sanitize_targets():
    """Every version on a ragged length (racecheck: the trees and the warp-sum slots; memcheck:
    the tails)."""
    import cupy as cp

    n = 3 * 512 + 77
    x = cp.random.rand(n, dtype=cp.float32)
    for v in LADDER:
        yield v, (lambda v=v: ladder(x, v))
    yield "reduce_v5", lambda: total(x, grid=4)
    yield "reduce_max_v1", lambda: maximum(x, grid=4)
