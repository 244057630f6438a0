"""Launching kernels/copy.cu: y = x for float32 vectors.

    cl = cb.load_launch("copy")
    cl.copy(x, y)                      # copy_v4 (float4 when x and y are 16-byte aligned)
    y = cl.copy(x, version="v2")       # y allocated; "copy_v2" or "v2"

    VERSIONS                       the ladder
    config(version, n, sms)        -> Launch(grid, block, kernel=version)
    copy(x, y=None, version)       the entry point: checks, config, launch, returns y
    sanitize_targets()

The checks, before anything is launched: x and y float32, 1D, C-contiguous, on the GPU, the same
length, fewer than 2^31 elements (y allocated by x's library when not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "copy", "config", "sanitize_targets"]

VERSIONS = ("copy_v1", "copy_v2", "copy_v3", "copy_v4")
#: elements per thread of the versions whose grid covers the vector (copy_v2: a grid-stride loop)
_PER_THREAD = {"copy_v1": 1, "copy_v3": 4, "copy_v4": 16}


def _module():
    return cb.module("copy")     # the whole file, compiled once per process


def config(version: str, n: int, sms: int | None = None) -> Launch:
    """Grid and block of ``version`` for n elements (copy_v2: 8 blocks per SM, ``sms``
    defaulting to this GPU's)."""
    version = version_name(VERSIONS, version, "copy")
    if version == "copy_v2":
        sms = cb.launch.device().sms if sms is None else sms
        return Launch((8 * max(sms, 1),), (256,), kernel=version)
    return Launch((max(1, ceil_div(n, 256 * _PER_THREAD[version])),), (256,), kernel=version)


def copy(x, y=None, version: str = "copy_v4"):
    """y = x (float32, 1D, same length, not overlapping); returns y."""
    version = version_name(VERSIONS, version, "copy")
    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    if y is None:
        y = cb.arrays.empty_like_lib(x, (n,), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=(n,))
    if n >= 2**31:
        raise LaunchError(f"copy: the kernels index with int; {n} >= 2^31 elements")
    cfg = config(version, n)
    cb.launch.run(mod.get(cfg.kernel), cfg,
                  (cb.as_cupy(x, "x"), cb.as_cupy(y, "y"), np.int32(n)),
                  stream=cb.stream_for(x, y))
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
