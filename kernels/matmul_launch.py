"""Launching kernels/matmul.cu and its Numba twins: the one launch description of every version
(the lesson, the tests and the sanitizer all use it), and the compile options of matmul_v10.

    config(version, M, N, K, params)  -> {"grid", "block", "shared"}
    check_operands(A, B, C, device)   -> (M, N, K), or a clear error about what does not fit
    launch_cupy(mod, version, A, B, C)   validates the operands and launches mod.matmul_<version>
    tuned_params / tuned_options / load_tuned   matmul_v10 (and v11) compiled for chosen tile sizes
    numba_config / launch_numba       the same for the Numba twins (kernels/matmul.py)
    sanitize_targets()                v1..v11 on a ragged shape, for tools/sanitize.py

The tile-size sweep is kernels/matmul_tune.py; flops and traffic are cudabook.roofline.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.check import dot_tolerance
from cudabook.launch import ceil_div, grid_2d, returns_launch

__all__ = ["VERSIONS", "NUMBA_VERSIONS", "WHAT", "TUNED_DEFAULT", "config", "check_operands",
           "launch_cupy", "load_tuned", "tuned_params", "tuned_options", "tuned_threads",
           "tuned_shared", "numba_config", "launch_numba", "tolerance", "sanitize_targets"]

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11")
#: the Numba twins, matmul_<name> in kernels/matmul.py
NUMBA_VERSIONS = ("v1", "v2", "smem16", "reg8x8", "reg8x8_prefetch", "reg8x8_unsigned")

#: what each step changes (one line each, for tables and plots)
WHAT = {
    "v1": "naive, uncoalesced",
    "v2": "naive, coalesced",
    "v3": "shared-memory tiles 32x32",
    "v4": "1D register tiling (8 outputs/thread)",
    "v5": "2D register tiling (8x8 outputs/thread)",
    "v6": "float4 loads, A transposed in smem",
    "v7": "bank-conflict-free (padding, 4x4 pieces)",
    "v8": "warp tiling, BK=16",
    "v9": "double buffering (cp.async on sm_80+)",
    "v10": "tuned tile sizes (-D macros)",
    "v11": "fragments double-buffered, barrier before the last k-step",
}

#: the default tile sizes of matmul_v10 (the same as the #define defaults in matmul.cu)
TUNED_DEFAULT = dict(BM=256, BN=128, BK=8, WM=128, WN=32, TM=16, TN=8, STAGES=2, ASYNC=0, MINB=1)

_FIXED = {  # version: (block threads, (block tile rows, cols) of C, dynamic shared bytes)
    "v4": (512, (64, 64), 0),
    "v5": (256, (128, 128), 0),
    "v6": (256, (128, 128), 0),
    "v7": (256, (128, 128), 0),
    "v8": (256, (128, 128), 16 * (128 + 4 + 128) * 4),
    "v9": (256, (128, 128), 2 * 16 * (128 + 4 + 128) * 4),
}

MAX_STATIC_SHARED = 48 * 1024
#: the versions whose tile sizes are the MM_* macros (compiled by load_tuned, launched with its params)
_TUNED = ("v10", "v11")


def tuned_params(params: dict | None = None) -> dict:
    """TUNED_DEFAULT updated with ``params``, validated (ValueError with the rule broken)."""
    p = {**TUNED_DEFAULT, **(params or {})}
    unknown = set(p) - set(TUNED_DEFAULT)
    if unknown:
        raise ValueError(f"unknown tile parameter(s) {sorted(unknown)}; known: "
                         f"{sorted(TUNED_DEFAULT)}")
    bm, bn, bk, wm, wn, tm, tn = (p[k] for k in ("BM", "BN", "BK", "WM", "WN", "TM", "TN"))
    rules = [
        (bm % wm == 0 and bn % wn == 0, "the warp tile WMxWN must divide the block tile BMxBN"),
        (tm % 4 == 0 and tn % 4 == 0 and bk % 4 == 0, "TM, TN and BK must be multiples of 4"),
        (wm % tm == 0 and wn % tn == 0 and (wm // tm) * (wn // tn) == 32,
         "a warp tile must hold exactly 32 lanes: (WM/TM) * (WN/TN) == 32"),
    ]
    for ok, why in rules:
        if not ok:
            raise ValueError(f"tile parameters {p}: {why}")
    nt = tuned_threads(p)
    if nt > 1024:
        raise ValueError(f"tile parameters {p}: {nt} threads per block (at most 1024)")
    if (bm * bk // 4) % nt or (bk * bn // 4) % nt or bm * bk // 4 < nt or bk * bn // 4 < nt:
        raise ValueError(f"tile parameters {p}: the {nt} threads must share the float4 of each "
                         f"tile evenly (BM*BK/4 = {bm * bk // 4}, BK*BN/4 = {bk * bn // 4})")
    if p["STAGES"] < 1 or (p["STAGES"] > 2 and not p["ASYNC"]):
        raise ValueError(f"tile parameters {p}: STAGES must be 1 or 2 (3+ needs ASYNC=1)")
    return p


def tuned_threads(p: dict) -> int:
    return (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32


def tuned_shared(p: dict) -> int:
    """Dynamic shared memory of matmul_v10 in bytes: STAGES x BK x (BM + 4 + BN) floats."""
    return p["STAGES"] * p["BK"] * (p["BM"] + 4 + p["BN"]) * 4


def tuned_options(params: dict | None = None, only_tuned: bool = False) -> tuple[str, ...]:
    """NVRTC options that compile matmul_v10 with these tile sizes."""
    p = tuned_params(params)
    opts = tuple(f"-DMM_{k}={v}" for k, v in p.items())
    return opts + (("-DMM_ONLY_TUNED",) if only_tuned else ())


@returns_launch
def config(version: str, M: int, N: int, K: int, params: dict | None = None) -> dict:
    """Grid, block and dynamic shared memory of ``matmul_<version>`` for C[M, N] = A @ B."""
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; matmul.cu has {VERSIONS}")
    if version == "v1":
        return {"grid": (ceil_div(M, 32), ceil_div(N, 32)), "block": (32, 32), "shared": 0}
    if version in ("v2", "v3"):
        return {"grid": (ceil_div(N, 32), ceil_div(M, 32)), "block": (32, 32), "shared": 0}
    if version in _TUNED:
        p = tuned_params(params)
        shared = tuned_shared(p if version == "v10" else {**p, "STAGES": 2})   # v11: 2 stages
        return {"grid": (ceil_div(N, p["BN"]), ceil_div(M, p["BM"])),
                "block": (tuned_threads(p),), "shared": shared}
    nt, (bm, bn), sh = _FIXED[version]
    return {"grid": (ceil_div(N, bn), ceil_div(M, bm)), "block": (nt,), "shared": sh}


def check_operands(A, B, C, device: bool = False) -> tuple[int, int, int]:
    """(M, N, K) of C[M, N] = A[M, K] @ B[K, N], or a clear error about what does not fit;
    ``device``: the arrays must also live on the GPU (what the CUDA C++ launch reads)."""
    for name, x in (("A", A), ("B", B), ("C", C)):
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"matmul: {name} must be a 2D matrix, got shape "
                             f"{getattr(x, 'shape', None)}")
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"matmul: {name} is {x.dtype}; these kernels are float32 only "
                            f"(use .astype(float32))")
        info = cb.describe(x, name)
        if device and cb.HAS_GPU and not info.on_device:
            raise TypeError(f"matmul: {name} is a {info.lib} array on the host; the kernels read "
                            "GPU memory: move it with cupy.asarray(...)")
        if not info.contiguous:
            raise ValueError(f"matmul: {name} must be C-contiguous (row-major) - a transposed "
                             "view or a slice is not; use cupy.ascontiguousarray")
    (M, K), (K2, N) = A.shape, B.shape
    if K != K2:
        raise ValueError(f"matmul: inner dimensions differ, A is {M}x{K} and B is {K2}x{N}")
    if tuple(C.shape) != (M, N):
        raise ValueError(f"matmul: C must be {M}x{N} for A {M}x{K} @ B {K}x{N}, got "
                         f"{tuple(C.shape)}")
    if min(M, N, K) < 1:
        raise ValueError(f"matmul: empty matrix (M, N, K) = {(M, N, K)}")
    if max(M * K, K * N, M * N) >= 2**31:
        raise ValueError("matmul: the kernels index with 32-bit int; each matrix must have "
                         "fewer than 2^31 elements")
    return M, N, K


def launch_cupy(mod, version: str, A, B, C, params: dict | None = None) -> dict:
    """Launch ``mod.matmul_<version>`` on CuPy arrays; returns the launch configuration used.

    ``params`` (v10, v11 only) defaults to the tile sizes ``mod`` was compiled with (``load_tuned``).
    """
    M, N, K = check_operands(A, B, C, device=True)
    if version in _TUNED and params is None:
        params = mod.__dict__.get("params")
    cfg = config(version, M, N, K, params)
    kern = mod.get(f"matmul_{version}")
    if cfg["shared"] > MAX_STATIC_SHARED:
        kern.max_dynamic_shared_size_bytes = cfg["shared"]
    kern(cfg["grid"], cfg["block"], (A, B, C, np.int32(M), np.int32(N), np.int32(K)),
         shared_mem=cfg["shared"])
    return cfg


def launch_ladder(n: int = 2048, versions: tuple[str, ...] = VERSIONS) -> None:
    """Launch each CUDA version once on n x n float32 matrices: the run that Nsight Compute
    profiles, one launch per ladder step (Chapters 4 and 5)."""
    import cupy as cp

    mod = cb.load_cuda("matmul")
    A = cp.random.rand(n, n, dtype=cp.float32)
    B = cp.random.rand(n, n, dtype=cp.float32)
    C = cp.empty((n, n), cp.float32)
    for v in versions:
        launch_cupy(mod, v, A, B, C)
    cp.cuda.Device().synchronize()


def load_tuned(params: dict | None = None, only_tuned: bool = True):
    """Compile matmul.cu with the tile sizes of matmul_v10 and v11 set by -D macros (those two
    kernels alone, by default)."""
    p = tuned_params(params)
    mod = cb.load_cuda("matmul", options=tuned_options(p, only_tuned))
    mod.params = p
    return mod


def tolerance(K: int) -> dict:
    """atol/rtol for a float32 result of K-term dot products (cudabook.check.dot_tolerance)."""
    return dot_tolerance(K)


def _numba():
    return cb.load_numba("matmul")


def numba_config(version: str, M: int, N: int) -> tuple[tuple, tuple]:
    """(grid, block) of the Numba ``matmul_<version>``."""
    nb = _numba()
    if version == "v1":
        return (ceil_div(M, 16), ceil_div(N, 16)), (16, 16)
    if version == "v2":
        return grid_2d(M, N, 16), (16, 16)
    if version == "smem16":
        return grid_2d(M, N, nb.SMEM16_TILE), (nb.SMEM16_TILE, nb.SMEM16_TILE)
    if version in ("reg8x8", "reg8x8_prefetch", "reg8x8_unsigned"):
        return grid_2d(M, N, (nb.REG_BM, nb.REG_BN)), (nb.REG_THREADS,)
    raise ValueError(f"unknown Numba version {version!r}; kernels/matmul.py has "
                     f"{NUMBA_VERSIONS}")


def launch_numba(version: str, A, B, C) -> None:
    """Launch the Numba ``matmul_<version>`` (device arrays, or NumPy in the simulator)."""
    M, N, _ = check_operands(A, B, C)
    grid, block = numba_config(version, M, N)
    getattr(_numba(), f"matmul_{version}")[grid, block](A, B, C)


def sanitize_targets():
    """(name, launch) pairs of v1..v11 on a ragged shape, for tools/sanitize.py (racecheck finds
    a missing __syncthreads() between tile loads; memcheck a missing bounds guard)."""
    import cupy as cp

    mod = cb.load_cuda("matmul")
    M, N, K = 131, 67, 45
    A = cp.random.rand(M, K, dtype=cp.float32)
    B = cp.random.rand(K, N, dtype=cp.float32)
    C = cp.empty((M, N), cp.float32)
    for v in VERSIONS:
        yield f"matmul_{v}", (lambda v=v: launch_cupy(mod, v, A, B, C))
    # v11 on a shape with one block wholly inside A and B (its unguarded float4 path) and edges
    A2 = cp.random.rand(300, 45, dtype=cp.float32)
    B2 = cp.random.rand(45, 140, dtype=cp.float32)
    C2 = cp.empty((300, 140), cp.float32)
    yield "matmul_v11 (inner block)", (lambda: launch_cupy(mod, "v11", A2, B2, C2))
