"""Launching kernels/vector_add.cu: z = x + y for float32 vectors (CUDA C++; the Numba twins
have their checked launcher ``add`` in kernels/vector_add.py, written in Chapter 1).

    vl = cb.load_launch("vector_add")
    vl.vector_add(x, y, z)             # vector_add_v4 (float4 when all three are aligned)
    z = vl.vector_add(x, y, version="v2")   # z allocated; "vector_add_v2" or "v2"

    VERSIONS                       the ladder
    config(version, n, sms)        -> Launch(grid, block, kernel=version)
    vector_add(x, y, z=None, version)   the entry point: checks, config, launch, returns z
    sanitize_targets()

The checks, before anything is launched: x, y and z float32, 1D, C-contiguous, on the GPU, one
length, fewer than 2^31 elements (z allocated by x's library when not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "vector_add", "config", "sanitize_targets"]

VERSIONS = ("vector_add_v1", "vector_add_v2", "vector_add_v3", "vector_add_v4")
#: elements per thread of the versions whose grid covers the vector (v2: a grid-stride loop)
_PER_THREAD = {"vector_add_v1": 1, "vector_add_v3": 4, "vector_add_v4": 16}


def _module():
    return cb.module("vector_add")     # the whole file, compiled once per process


def config(version: str, n: int, sms: int | None = None) -> Launch:
    """Grid and block of ``version`` for n elements (vector_add_v2: 4 blocks per SM, ``sms``
    defaulting to this GPU's)."""
    version = version_name(VERSIONS, version, "vector_add")
    if version == "vector_add_v2":
        sms = cb.launch.device().sms if sms is None else sms
        return Launch((4 * max(sms, 1),), (256,), kernel=version)
    return Launch((max(1, ceil_div(n, 256 * _PER_THREAD[version])),), (256,), kernel=version)


def vector_add(x, y, z=None, version: str = "vector_add_v4"):
    """z = x + y (float32, 1D, one length); returns z."""
    version = version_name(VERSIONS, version, "vector_add")
    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    cb.expect(y, "y", dtype=np.float32, shape=(n,))
    if z is None:
        z = cb.arrays.empty_like_lib(x, (n,), "float32")
    cb.expect(z, "z", dtype=np.float32, shape=(n,))
    if n >= 2**31:
        raise LaunchError(f"vector_add: the kernels index with int; {n} >= 2^31 elements")
    cfg = config(version, n)
    cb.launch.run(mod.get(cfg.kernel), cfg,
                  (cb.as_cupy(x, "x"), cb.as_cupy(y, "y"), cb.as_cupy(z, "z"), np.int32(n)),
                  stream=cb.stream_for(x, y, z))
    return z


def sanitize_targets():
    """Every version on a ragged length, whole and as views 4 bytes in (memcheck)."""
    import cupy as cp

    x, y, z = (cp.random.rand(1003, dtype=cp.float32) for _ in range(3))
    for v in VERSIONS:
        yield v, (lambda v=v: vector_add(x, y, z, v))
        yield f"{v} (views at +4 bytes)", (lambda v=v: vector_add(x[1:], y[1:], z[1:], v))
