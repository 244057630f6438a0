"""Launching kernels/matmul_f64.cu: C = A @ B in double for strided A and B (gradcheck path).

    mf = cb.load_launch("matmul_f64")
    C = mf.matmul_f64(A, B)        # A, B float64 CuPy arrays, any strides (A.T is fine)
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, grid_2d

__all__ = ["matmul_f64", "sanitize_targets"]


def matmul_f64(A, B, C=None):
    """A (M, K) @ B (K, N) into a new (or the given contiguous) float64 C (M, N)."""
    import cupy as cp

    cb.expect(A, "A", dtype=np.float64, ndim=2, contiguous=False)
    cb.expect(B, "B", dtype=np.float64, ndim=2, contiguous=False)
    (M, K), (K2, N) = A.shape, B.shape
    if K != K2:
        raise ValueError(f"matmul_f64: inner dimensions differ, A is {M}x{K} and B is {K2}x{N}")
    if min(M, N, K) < 1 or max(M, N) >= 2**31:
        raise LaunchError(f"matmul_f64: shapes {A.shape} @ {B.shape}")
    C = cp.empty((M, N), cp.float64) if C is None else C
    cb.expect(C, "C", dtype=np.float64, shape=(M, N))
    s = [np.int64(x // 8) for x in (*A.strides, *B.strides)]
    cb.module("matmul_f64").get("matmul_f64_v1")(
        grid_2d(M, N, 16), (16, 16), (A, B, C, np.int32(M), np.int32(N), np.int32(K), *s))
    return C


def sanitize_targets():
    """A transposed operand on a ragged shape (memcheck: the guards and the strides)."""
    import cupy as cp

    A = cp.random.standard_normal((45, 67))
    B = cp.random.standard_normal((45, 33))
    yield "matmul_f64_v1 (A.T, 67x45x33)", (lambda: matmul_f64(A.T, B))
