"""Launching kernels/vector_add.cu: z = x + y for float32 vectors (CUDA C++; the Numba twins
have their checked launcher ``add`` in kernels/vector_add.py, written in Chapter 1).

    vl = cb.load_launch("vector_add")
    vl.vector_add(x, y, z)             # vector_add_v4 (float4 when all three are aligned)
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div, returns_launch

__all__ = ["VERSIONS", "vector_add", "config", "sanitize_targets"]

VERSIONS = ("vector_add_v1", "vector_add_v2", "vector_add_v3", "vector_add_v4")

def _module():
    return cb.module("vector_add")     # compiled once per process


@returns_launch
def config(version: str, n: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of ``version`` for n elements."""
    per_thread = {"vector_add_v1": 1, "vector_add_v3": 4, "vector_add_v4": 16}
    if version == "vector_add_v2":
        return (4 * max(cb.launch.device().sms, 1),), (256,)
    if version not in per_thread:
        raise ValueError(f"unknown version {version!r}; vector_add.cu has {VERSIONS}")
    return (max(1, ceil_div(n, 256 * per_thread[version])),), (256,)


def vector_add(x, y, z, version: str = "vector_add_v4"):
    """z = x + y (float32, 1D, one length)."""
    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    cb.expect(y, "y", dtype=np.float32, shape=(n,))
    cb.expect(z, "z", dtype=np.float32, shape=(n,))
    if n >= 2**31:
        raise LaunchError(f"vector_add: the kernels index with int; {n} >= 2^31 elements")
    grid, block = config(version, n)
    mod.get(version)(grid, block, (x, y, z, np.int32(n)))
    return z


def sanitize_targets():
    """Every version on a ragged length, whole and as views 4 bytes in (memcheck)."""
    import cupy as cp

    x, y, z = (cp.random.rand(1003, dtype=cp.float32) for _ in range(3))
    for v in VERSIONS:
        yield v, (lambda v=v: vector_add(x, y, z, v))
        yield f"{v} (views at +4 bytes)", (lambda v=v: vector_add(x[1:], y[1:], z[1:], v))
