"""Launching kernels/thin_matmul.cu: float32 products with one tiny dimension N (1..16).

    th = cb.load_launch("thin_matmul")
    C = th.nn(A, B)              # C[M, N] = A[M, K] @ B[K, N]     (a layer's logits)
    C = th.tn(A, G)              # C[K, N] = A[M, K]^T @ G[M, N]   (its weight gradient)
    C = th.nt(G, W)              # C[M, K] = G[M, N] @ W[K, N]^T   (the gradient of its input)
    th.why_not("nn", A, B)       # None when the kernel fits these operands, else the reason

    KINDS, MAX_N                 the three products; the largest N
    config(kind, M, K, N, sms)   -> Launch(grid, block, kernel="thin_<kind>_n<N>"); for tn with
                                 several slices a plan {"main": ..., "reduce": ...}
    nn(A, B, C=None), tn(A, G, C=None, work=None), nt(G, W, C=None)
                                 the entry points (one per product): checks, config, launch,
                                 return C
    why_not(kind, X, Y)          the op's checks, as a reason instead of an exception
    tn_slices(M, K, sms), tn_workspace(M, K, N, sms)   tn's row slices and their workspace
    sanitize_targets()

Each takes an optional output ``C`` (allocated by the first operand's library when not given;
and ``tn`` a workspace ``work`` of ``tn_workspace(M, K, N)`` floats, so nothing is allocated
inside a CUDA graph capture). The kernels need float32, C-contiguous operands on the GPU,
K % 4 == 0, 16-byte aligned float4 operands, 1 <= N <= 16 and fewer than 2^31 elements per
matrix; anything else is refused with the reason (``why_not`` says it without raising, for a
caller that falls back to Chapter 4's tiled matmul). One module is compiled per N
(``-DTHIN_N``), once per process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div

__all__ = ["MAX_N", "KINDS", "why_not", "nn", "tn", "nt", "config", "tn_slices", "tn_workspace",
           "sanitize_targets"]

MAX_N = 16
KINDS = ("nn", "tn", "nt")
NN_ROWS, TN_WARPS, NT_ROWS = 4, 4, 32        # THIN_NN_ROWS, THIN_TN_WARPS, THIN_NT_ROWS in the .cu


def _module(N: int):
    return cb.module("thin_matmul", (f"-DTHIN_N={N}",))     # the whole file for this N


def config(kind: str, M: int, K: int, N: int, sms: int | None = None):
    """The launch of the product ``kind`` for (M, K, N): nn a warp per NN_ROWS rows of A (blocks
    of 8 warps); nt a thread per 4 columns of NT_ROWS rows of C (blocks of 128); tn a block of
    TN_WARPS warps per 128 columns of A and per slice of rows (``tn_slices``; ``sms`` defaults
    to this GPU's), and with several slices a plan {"main": ..., "reduce": ...} whose reduce
    sums the slices into C."""
    if kind not in KINDS:
        raise ValueError(f"thin_matmul: unknown product {kind!r}; one of {KINDS}")
    if kind == "nn":
        return Launch((ceil_div(M, 8 * NN_ROWS),), (256,), kernel=f"thin_nn_n{N}")
    if kind == "nt":
        return Launch((ceil_div(K, 512), ceil_div(M, NT_ROWS)), (128,), kernel=f"thin_nt_n{N}")
    S = tn_slices(M, K, sms)
    rows = ceil_div(M, S)
    S = ceil_div(M, rows)                       # no empty slice
    main = Launch((ceil_div(K, 128), S), (32, TN_WARPS), kernel=f"thin_tn_n{N}", rows=rows,
                  slices=S)
    if S == 1:
        return main
    return {"main": main, "reduce": Launch((ceil_div(K * N, 256),), (256,),
                                           kernel="thin_tn_reduce", slices=S)}


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


def _out(C, like, shape: tuple[int, int], kind: str, aligned: bool = False):
    if C is None:
        return cb.arrays.empty_like_lib(like, shape, "float32")
    cb.expect(C, f"thin_matmul.{kind}: C", dtype=np.float32, shape=shape)
    if aligned and not cb.expect_aligned(C, "C"):
        raise LaunchError(f"thin_matmul.{kind}: C must be 16-byte aligned (float4 stores)")
    return C


def _run(N: int, cfg: Launch, arrays: tuple, scalars: tuple) -> None:
    args = tuple(cb.as_cupy(a) for a in arrays) + tuple(np.int32(v) for v in scalars)
    cb.launch.run(_module(N).get(cfg.kernel), cfg, args)


def nn(A, B, C=None):
    """C[M, N] = A[M, K] @ B[K, N] for a tiny N: a warp per 4 rows of A (grid ceil(M / 32))."""
    M, K, N = _check("nn", A, B)
    C = _out(C, A, (M, N), "nn")
    with cb.arrays.launch_stream(A, B, C):
        _run(N, config("nn", M, K, N), (A, B, C), (M, K))
    return C


def tn_slices(M: int, K: int, sms: int | None = None) -> int:
    """How many slices of rows thin_tn splits M into: about four blocks per SM in all (``sms``:
    default this GPU's), each slice at least 64 rows (1: no workspace, the kernel writes C)."""
    most = M // 64
    if most <= 1:
        return 1
    sms = cb.launch.device().sms if sms is None else sms
    blocks_x = ceil_div(K, 128)
    want = ceil_div(4 * sms, blocks_x)
    return int(max(1, min(want, most)))


def tn_workspace(M: int, K: int, N: int, sms: int | None = None) -> int:
    """Floats of workspace ``tn`` needs for these sizes (0 when it writes C directly)."""
    S = tn_slices(M, K, sms)
    return 0 if S == 1 else S * K * N


def tn(A, G, C=None, work=None):
    """C[K, N] = A[M, K]^T @ G[M, N] for a tiny N, without transposing A: slices of rows summed
    in a workspace (``work``: at least ``tn_workspace(M, K, N)`` float32, allocated if None)."""
    M, K, N = _check("tn", A, G)
    C = _out(C, A, (K, N), "tn")
    plan = config("tn", M, K, N)
    main = plan if isinstance(plan, Launch) else plan["main"]
    P = C
    if main.slices > 1:
        need = main.slices * K * N
        if work is None:
            work = cb.arrays.empty_like_lib(A, (need,), "float32")
        cb.expect(work, "thin_matmul.tn: work", dtype=np.float32, ndim=1)
        have = int(work.shape[0])
        if have < need:
            raise LaunchError(f"thin_matmul.tn: work holds {have} floats, {need} needed "
                              "(tn_workspace(M, K, N))")
        P = work
    with cb.arrays.launch_stream(A, G, C):
        _run(N, main, (A, G, P), (M, K, main.rows))
        if main.slices > 1:
            _run(N, plan["reduce"], (P, C), (main.slices, K * N))
    return C


def nt(G, W, C=None):
    """C[M, K] = G[M, N] @ W[K, N]^T for a tiny N: each thread writes 4 columns of 32 rows."""
    M, K, N = _check("nt", G, W)
    C = _out(C, G, (M, K), "nt", aligned=True)
    with cb.arrays.launch_stream(G, W, C):
        _run(N, config("nt", M, K, N), (G, W, C), (M, K))
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
