"""Launching kernels/matmul_f64.cu: C = A @ B in double for strided A and B (gradcheck path).

    mf = cb.load_launch("matmul_f64")
    C = mf.matmul_f64(A, B)        # A, B float64 arrays on the GPU, any strides (A.T is fine)

    VERSIONS                       matmul_f64_v1, the one kernel
    config(M, N, version)          -> Launch(grid, block=(16, 16), kernel=version)
    matmul_f64(A, B, C=None, version)   the entry point: checks, config, launch, returns C
    sanitize_targets()

The checks, before anything is launched: A (M, K) and B (K, N) float64 on the GPU (any strides:
the kernel reads them), inner dimensions that agree, no empty product, M and N below 2^31; C
float64 (M, N) C-contiguous (allocated by A's library when not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, grid_2d, version_name

__all__ = ["VERSIONS", "matmul_f64", "config", "sanitize_targets"]

VERSIONS = ("matmul_f64_v1",)


def config(M: int, N: int, version: str = "matmul_f64_v1") -> Launch:
    """Grid and block of ``version`` for an (M, N) C: a 16 x 16 block per 16 x 16 outputs."""
    version = version_name(VERSIONS, version, "matmul_f64")
    return Launch(grid_2d(M, N, 16), (16, 16), kernel=version)


def matmul_f64(A, B, C=None, version: str = "matmul_f64_v1"):
    """A (M, K) @ B (K, N) into a new (or the given contiguous) float64 C (M, N); returns C."""
    version = version_name(VERSIONS, version, "matmul_f64")
    cb.expect(A, "A", dtype=np.float64, ndim=2, contiguous=False)
    cb.expect(B, "B", dtype=np.float64, ndim=2, contiguous=False)
    (M, K), (K2, N) = (tuple(int(s) for s in x.shape) for x in (A, B))
    if K != K2:
        raise ValueError(f"matmul_f64: inner dimensions differ, A is {M}x{K} and B is {K2}x{N}")
    if min(M, N, K) < 1 or max(M, N) >= 2**31:
        raise LaunchError(f"matmul_f64: shapes {tuple(A.shape)} @ {tuple(B.shape)}")
    if C is None:
        C = cb.arrays.empty_like_lib(A, (M, N), "float64")
    cb.expect(C, "C", dtype=np.float64, shape=(M, N))
    a, b = cb.as_cupy(A, "A"), cb.as_cupy(B, "B")
    s = [np.int64(x // 8) for x in (*a.strides, *b.strides)]       # strides in elements
    cfg = config(M, N, version)
    cb.launch.run(cb.module("matmul_f64").get(cfg.kernel), cfg,
                  (a, b, cb.as_cupy(C, "C"), np.int32(M), np.int32(N), np.int32(K), *s),
                  stream=cb.stream_for(A, B, C))
    return C


def sanitize_targets():
    """A transposed operand on a ragged shape (memcheck: the guards and the strides)."""
    import cupy as cp

    A = cp.random.standard_normal((45, 67))
    B = cp.random.standard_normal((45, 33))
    yield "matmul_f64_v1 (A.T, 67x45x33)", (lambda: matmul_f64(A.T, B))
