"""Launching kernels/copy.cu: y = x for float32 vectors.

    cl = cb.load_launch("copy")
    cl.copy(x, y)                      # copy_v4 (float4 when x and y are 16-byte aligned)
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div, returns_launch

__all__ = ["VERSIONS", "copy", "config", "sanitize_targets"]

VERSIONS = ("copy_v1", "copy_v2", "copy_v3", "copy_v4")

def _module():
    return cb.module("copy")     # compiled once per process


@returns_launch
def config(version: str, n: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of ``version`` for n elements."""
    per_thread = {"copy_v1": 1, "copy_v3": 4, "copy_v4": 16}
    if version == "copy_v2":
        return (8 * max(cb.launch.device().sms, 1),), (256,)
    if version not in per_thread:
        raise ValueError(f"unknown version {version!r}; copy.cu has {VERSIONS}")
    return (max(1, ceil_div(n, 256 * per_thread[version])),), (256,)


def copy(x, y, version: str = "copy_v4"):
    """y = x (float32, 1D, same length, not overlapping)."""
    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    cb.expect(y, "y", dtype=np.float32, shape=(n,))
    if n >= 2**31:
        raise LaunchError(f"copy: the kernels index with int; {n} >= 2^31 elements")
    grid, block = config(version, n)
    mod.get(version)(grid, block, (x, y, np.int32(n)))
    return y


def sanitize_targets():
    """Every version on a ragged length, whole and as views that start 4 bytes in (memcheck:
    the tails and the scalar fallback of a misaligned view)."""
    import cupy as cp

    x = cp.random.rand(1003, dtype=cp.float32)
    y = cp.empty_like(x)
    for v in VERSIONS:
        yield v, (lambda v=v: copy(x, y, v))
        yield f"{v} (views at +4 bytes)", (lambda v=v: copy(x[1:], y[1:], v))
