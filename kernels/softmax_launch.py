"""Launching kernels/softmax.cu: y = softmax(x) over the last dimension of a float32 (M, N) x.

    sm = cb.load_launch("softmax")
    y = sm.softmax(x)                      # softmax_v5, any N; y allocated (or pass y=...)
    sm.softmax(x, y, version="softmax_v3")  # or version="v3"
    sm.softmax(x, y, version="v6")          # sm_90: the row over a cluster of 2-16 blocks

    VERSIONS, MIN_CC               the ladder, softmax_v1..v6; softmax_v6 needs cc 9.0
    config(version, M, N, vec, cluster=None, optin=None)
                                   -> Launch(grid, block, kernel=version), once for the lesson,
                                   the tests and the helper (softmax_v6: also shared= and
                                   cluster=, cb.launch.row_split's choice of C from N)
    softmax(x, y=None, version, cluster=None)   the entry point: checks, config, launch, returns y
    sanitize_targets()             every version on each path of softmax_v5 (and of v6 on sm_90)

The checks, before anything is launched: x float32, two dimensions, C-contiguous, on the GPU;
y of x's shape (allocated by x's library when not given); N >= 1 and rows that fit one grid
dimension. softmax_v5 takes its float4 path when N % 4 == 0 and x and y are 16-byte aligned.
softmax_v6 needs compute capability 9.0 (thread-block clusters) and refuses below it, and a row
whose slice does not fit a block's shared memory (N past about 925k columns on an H100) with the
N it takes.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, row_block, row_split, version_name

__all__ = ["VERSIONS", "MIN_CC", "softmax", "config", "sanitize_targets"]

VERSIONS = ("softmax_v1", "softmax_v2", "softmax_v3", "softmax_v4", "softmax_v5", "softmax_v6")
#: the versions that need more than the book's minimum GPU
MIN_CC = {"softmax_v6": (9, 0)}


def config(version: str, M: int, N: int, vec: bool = False, cluster: int | None = None,
           optin: int | None = None) -> Launch:
    """Grid and block of ``version`` for an (M, N) input (see the launch comments in softmax.cu);
    ``vec``: softmax_v5 takes its float4 path. softmax_v6: ``cluster`` (2, 4, 8, 16; default:
    chosen from N) and ``optin`` (a block's shared memory limit; default: this GPU's) go to
    ``cb.launch.row_split``."""
    version = version_name(VERSIONS, version, "softmax")
    if version == "softmax_v6":     # the row over a cluster, each block's slice in shared memory
        return row_split(M, N, version, cluster=cluster, optin=optin)
    if version == "softmax_v1":
        return Launch((ceil_div(M, 128),), (128,), kernel=version)
    if version == "softmax_v3":
        return Launch((ceil_div(M, 4),), (128,), kernel=version)   # 4 warps, one row each
    if version == "softmax_v5":     # the row in registers: <= 16 per thread, 32 for long float4 rows
        return Launch((M,), (row_block(N, 32 if vec and N > 8192 else 16),), kernel=version)
    return Launch((M,), (256 if N <= 4096 else 512,), kernel=version)      # softmax_v2, v4


def softmax(x, y=None, version: str = "softmax_v5", cluster: int | None = None):
    """softmax over the last dimension of the float32 (M, N) ``x`` into ``y`` (returned);
    ``version``: "softmax_v3" or "v3"; ``cluster``: softmax_v6's cluster size (default: from
    N)."""
    version = version_name(VERSIONS, version, "softmax")
    if cluster is not None and version != "softmax_v6":
        raise ValueError(f"cluster= is softmax_v6's; {version} does not split a row")
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
    if version in MIN_CC:
        cb.need_cc(*MIN_CC[version], f"{version} (thread-block clusters)")
    cfg = config(version, M, N, vec, cluster=cluster)
    cb.launch.run(mod.get(cfg.kernel), cfg,
                  (cb.as_cupy(x, "x"), cb.as_cupy(y, "y"), np.int32(M), np.int32(N)),
                  stream=cb.stream_for(x, y))
    return y


def _module():
    return cb.module("softmax")     # the whole file, compiled once per process


def sanitize_targets():
    """Every version on shapes that take each path of softmax_v5: float4 (N % 4 == 0), scalar
    (N = 1001), and a row too long for the registers (streamed); on sm_90 softmax_v6 on the same
    shapes (bulk copies; scalar loads) and in clusters of 2, 4, 8 and 16 on small rows."""
    import cupy as cp

    sm90 = cb.env.cc() >= MIN_CC["softmax_v6"]
    for M, N in ((5, 256), (3, 1001), (2, 40_000)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        y = cp.empty_like(x)
        for v in VERSIONS:
            if v == "softmax_v1" and N > 1001:
                continue                                   # one thread per row: slow, same path
            if v in MIN_CC and not sm90:
                continue
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, y=y: softmax(x, y, version=v))
    if sm90:
        for C, N in ((2, 4), (4, 1001), (8, 4096), (16, 4100)):
            x = cp.random.standard_normal((3, N), dtype=cp.float32)
            y = cp.empty_like(x)
            yield f"softmax_v6 (3x{N}, clusters of {C})", (
                lambda x=x, y=y, C=C: softmax(x, y, version="softmax_v6", cluster=C))
