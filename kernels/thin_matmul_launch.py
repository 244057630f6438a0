"""Launching kernels/thin_matmul.cu: float32 products with one tiny dimension N (1..16).

    th = cb.load_launch("thin_matmul")
    C = th.nn(A, B)              # C[M, N] = A[M, K] @ B[K, N]     (a layer's logits)
    C = th.tn(A, G)              # C[K, N] = A[M, K]^T @ G[M, N]   (its weight gradient)
    C = th.nt(G, W)              # C[M, K] = G[M, N] @ W[K, N]^T   (the gradient of its input)
    th.why_not("nn", A, B)       # None when the kernel fits these operands, else the reason

Each takes an optional output ``C`` (and ``tn`` a workspace ``work`` of ``tn_workspace(M, K, N)``
floats, so nothing is allocated inside a CUDA graph capture). The kernels need float32,
C-contiguous operands, K % 4 == 0, 16-byte aligned float4 operands and 1 <= N <= 16; anything
else is refused with the reason (``why_not`` says it without raising, for a caller that falls
back to Chapter 4's tiled matmul). One module is compiled per N (``-DTHIN_N``), once per process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["MAX_N", "KINDS", "why_not", "nn", "tn", "nt", "tn_slices", "tn_workspace",
           "sanitize_targets"]

MAX_N = 16
KINDS = ("nn", "tn", "nt")
NN_ROWS, TN_WARPS, NT_ROWS = 4, 4, 32        # THIN_NN_ROWS, THIN_TN_WARPS, THIN_NT_ROWS in the .cu


def _module(N: int):
    return cb.module("thin_matmul", (f"-DTHIN_N={N}",))


def _dims(kind: str, X, Y) -> tuple[int, int, int]:
    """(M, K, N) of the product ``kind`` on operands X, Y (shapes only; ValueError if they
    do not fit together)."""
    if kind not in KINDS:
        raise ValueError(f"thin_matmul: unknown product {kind!r}; one of {KINDS}")
    for name, a in (("first operand", X), ("second operand", Y)):
        if len(getattr(a, "shape", ())) != 2:
            raise ValueError(f"thin_matmul.{kind}: the {name} must be 2D, got shape "
                             f"{getattr(a, 'shape', None)}")
    (r0, c0), (r1, c1) = (tuple(int(s) for s in a.shape) for a in (X, Y))
    if kind == "nn":            # A (M, K) @ B (K, N)
        if c0 != r1:
            raise ValueError(f"thin_matmul.nn: A is {r0}x{c0} and B is {r1}x{c1}: the inner "
                             "dimensions differ")
        return r0, c0, c1
    if kind == "tn":            # A (M, K)^T @ G (M, N)
        if r0 != r1:
            raise ValueError(f"thin_matmul.tn: A is {r0}x{c0} and G is {r1}x{c1}: A^T @ G needs "
                             "the same number of rows")
        return r0, c0, c1
    if c0 != c1:                # G (M, N) @ W (K, N)^T
        raise ValueError(f"thin_matmul.nt: G is {r0}x{c0} and W is {r1}x{c1}: G @ W^T needs the "
                         "same number of columns")
    return r0, r1, c0


def why_not(kind: str, X, Y) -> str | None:
    """None when the thin kernel ``kind`` ("nn", "tn", "nt") can run on X, Y; else the reason.
    An unknown ``kind`` raises ValueError (a mistake of the caller, not of the operands)."""
    if kind not in KINDS:
        raise ValueError(f"thin_matmul: unknown product {kind!r}; one of {KINDS}")
    try:
        M, K, N = _dims(kind, X, Y)
        for name, a in (("first operand", X), ("second operand", Y)):
            cb.expect(a, f"thin_matmul.{kind}: {name}", dtype=np.float32)
    except (TypeError, ValueError) as e:
        return str(e)
    if not 1 <= N <= MAX_N:
        return f"N = {N}: the thin kernels handle 1 <= N <= {MAX_N} (use the tiled matmul)"
    if min(M, K) < 1:
        return f"empty product (M, K, N) = {(M, K, N)}"
    if K % 4:
        return f"K = {K} is not a multiple of 4 (the float4 loads need it)"
    if max(M * K, M * N, K * N) >= 2**31:
        return "a matrix with 2^31 or more elements (32-bit row and column indices)"
    vec = {"nn": (X, Y), "tn": (X,), "nt": (Y,)}[kind]
    if not all(cb.expect_aligned(a, "operand") for a in vec):
        return "an operand read with float4 is not 16-byte aligned (a sliced view?)"
    return None


def _check(kind: str, X, Y) -> tuple[int, int, int]:
    reason = why_not(kind, X, Y)
    if reason:
        raise LaunchError(f"thin_matmul.{kind}: {reason}")
    return _dims(kind, X, Y)


def _out(C, shape: tuple[int, int], kind: str, aligned: bool = False):
    import cupy as cp

    if C is None:
        return cp.empty(shape, cp.float32)
    cb.expect(C, f"thin_matmul.{kind}: C", dtype=np.float32, shape=shape)
    if aligned and not cb.expect_aligned(C, "C"):
        raise LaunchError(f"thin_matmul.{kind}: C must be 16-byte aligned (float4 stores)")
    return C


def nn(A, B, C=None):
    """C[M, N] = A[M, K] @ B[K, N] for a tiny N: a warp per 4 rows of A (grid ceil(M / 32))."""
    M, K, N = _check("nn", A, B)
    C = _out(C, (M, N), "nn")
    _module(N).get(f"thin_nn_n{N}")((ceil_div(M, 8 * NN_ROWS),), (256,),
                                    (A, B, C, np.int32(M), np.int32(K)))
    return C


def tn_slices(M: int, K: int) -> int:
    """How many slices of rows thin_tn splits M into: about four blocks per SM in all, each
    slice at least 64 rows (1: no workspace, the kernel writes C)."""
    sms = cb.env.info().sms or 132
    blocks_x = ceil_div(K, 128)
    want = ceil_div(4 * sms, blocks_x)
    return int(max(1, min(want, M // 64)))


def tn_workspace(M: int, K: int, N: int) -> int:
    """Floats of workspace ``tn`` needs for these sizes (0 when it writes C directly)."""
    S = tn_slices(M, K)
    return 0 if S == 1 else S * K * N


def tn(A, G, C=None, work=None):
    """C[K, N] = A[M, K]^T @ G[M, N] for a tiny N, without transposing A: slices of rows summed
    in a workspace (``work``: at least ``tn_workspace(M, K, N)`` float32, allocated if None)."""
    import cupy as cp

    M, K, N = _check("tn", A, G)
    C = _out(C, (K, N), "tn")
    S = tn_slices(M, K)
    rows = ceil_div(M, S)
    S = ceil_div(M, rows)                       # no empty slice
    mod = _module(N)
    if S == 1:
        P = C
    else:
        need = S * K * N
        if work is None:
            work = cp.empty(need, cp.float32)
        cb.expect(work, "thin_matmul.tn: work", dtype=np.float32, ndim=1)
        if work.size < need:
            raise LaunchError(f"thin_matmul.tn: work holds {work.size} floats, {need} needed "
                              "(tn_workspace(M, K, N))")
        P = work
    mod.get(f"thin_tn_n{N}")((ceil_div(K, 128), S), (32, TN_WARPS),
                             (A, G, P, np.int32(M), np.int32(K), np.int32(rows)))
    if S > 1:
        mod.get("thin_tn_reduce")((ceil_div(K * N, 256),), (256,),
                                  (P, C, np.int32(S), np.int32(K * N)))
    return C


def nt(G, W, C=None):
    """C[M, K] = G[M, N] @ W[K, N]^T for a tiny N: each thread writes 4 columns of 32 rows."""
    M, K, N = _check("nt", G, W)
    C = _out(C, (M, K), "nt", aligned=True)
    _module(N).get(f"thin_nt_n{N}")((ceil_div(K, 512), ceil_div(M, NT_ROWS)), (128,),
                                    (G, W, C, np.int32(M), np.int32(K)))
    return C


def reference(kind: str, X: Any, Y: Any) -> np.ndarray:
    """The product in float64 on the host (for checks)."""
    x, y = (np.asarray(cb.to_numpy(a), np.float64) for a in (X, Y))
    return {"nn": lambda: x @ y, "tn": lambda: x.T @ y, "nt": lambda: x @ y.T}[kind]()


def sanitize_targets():
    """The three products on ragged shapes (memcheck: the row and column guards; racecheck:
    tn's shared-memory sum), tn with several slices."""
    import cupy as cp

    M, K, N = 203, 132, 10
    A = cp.random.standard_normal((M, K), dtype=cp.float32)
    B = cp.random.standard_normal((K, N), dtype=cp.float32)
    G = cp.random.standard_normal((M, N), dtype=cp.float32)
    yield "thin_nn_n10 (203x132x10)", lambda: nn(A, B)
    yield "thin_tn_n10 (203x132x10)", lambda: tn(A, G)
    yield "thin_nt_n10 (203x132x10)", lambda: nt(G, B)
