"""Launching kernels/matmul.cu and its Numba twins: the one launch description of every version
(the lesson, the tests and the sanitizer all use it), and the compile options of matmul_v10.

    VERSIONS, NUMBA_VERSIONS, WHAT    the ladder (CUDA C++, the Numba twins), one line per step
    config(version, M, N, K, params)  -> Launch(grid, block, shared=, kernel="matmul_<version>")
    matmul(A, B, C=None, version="v10", params=None, mod=None)
                                      the entry point: checks, picks the config, launches, returns C
    check_operands(A, B, C, device)   the op's checks: 2D float32 C-contiguous matrices (on the GPU
                                      with device=True), inner dimensions that agree, C of M x N,
                                      no empty matrix, 32-bit indices -> (M, N, K)
    launch_cupy(mod, version, A, B, C)   the lessons' call shape of matmul() (returns the record;
                                      launch(...) is the same, hgemm_launch's name for it)
    launch_ladder(n)                  every version once: the run Nsight Compute profiles
    tuned_params / tuned_options / load_tuned   matmul_v10 (and v11) compiled for chosen tile sizes
    numba_config / launch_numba       the same for the Numba twins (kernels/matmul.py)
    tolerance(K)                      atol/rtol of a K-term float32 dot product
    sanitize_targets()                v1..v11 on a ragged shape, for tools/sanitize.py

Versions are spelled "v3" or "matmul_v3". The tile-size sweep is kernels/matmul_tune.py; flops and
traffic are cudabook.roofline.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.check import dot_tolerance
from cudabook.launch import Launch, ceil_div, grid_2d, version_name

__all__ = ["VERSIONS", "NUMBA_VERSIONS", "WHAT", "TUNED_DEFAULT", "config", "check_operands",
           "matmul", "launch", "launch_cupy", "launch_ladder", "load_tuned", "tuned_params",
           "tuned_options", "tuned_threads", "tuned_shared", "numba_config", "launch_numba",
           "tolerance", "sanitize_targets"]

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


def config(version: str, M: int, N: int, K: int, params: dict | None = None) -> Launch:
    """Grid, block and dynamic shared memory of ``matmul_<version>`` for C[M, N] = A @ B."""
    version = version_name(VERSIONS, version, "matmul")          # "v3" or "matmul_v3"
    kernel = f"matmul_{version}"
    if version == "v1":
        return Launch((ceil_div(M, 32), ceil_div(N, 32)), (32, 32), kernel=kernel)
    if version in ("v2", "v3"):
        return Launch((ceil_div(N, 32), ceil_div(M, 32)), (32, 32), kernel=kernel)
    if version in _TUNED:
        p = tuned_params(params)
        shared = tuned_shared(p if version == "v10" else {**p, "STAGES": 2})   # v11: 2 stages
        return Launch((ceil_div(N, p["BN"]), ceil_div(M, p["BM"])), (tuned_threads(p),),
                      shared=shared, kernel=kernel)
    nt, (bm, bn), sh = _FIXED[version]
    return Launch((ceil_div(N, bn), ceil_div(M, bm)), (nt,), shared=sh, kernel=kernel)


def check_operands(A, B, C=None, device: bool = False) -> tuple[int, int, int]:
    """(M, N, K) of C[M, N] = A[M, K] @ B[K, N], or a clear error about what does not fit
    (``C`` None: A and B alone). ``device``: the arrays must also live on the GPU (what the
    CUDA C++ launch reads; the Numba twins also take host arrays, which Numba copies)."""
    for name, x in (("A", A), ("B", B), ("C", C)):
        if x is None and name == "C":
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"matmul: {name} must be an array (CuPy, PyTorch, Numba), got "
                            f"{type(x).__name__}")
        info = cb.describe(x, name)
        if len(info.shape) != 2:
            raise ValueError(f"matmul: {name} must be a 2D matrix, got shape {info.shape}")
        if info.dtype != "float32":
            raise TypeError(f"matmul: {name} is {info.dtype}; these kernels are float32 only "
                            f"(use .astype(float32))")
        if device and cb.HAS_GPU and not info.on_device:
            raise TypeError(f"matmul: {name} is a {info.lib} array on the host; the kernels read "
                            "GPU memory: move it with cupy.asarray(...)")
        if not info.contiguous:
            raise ValueError(f"matmul: {name} must be C-contiguous (row-major) - a transposed "
                             "view or a slice is not; use cupy.ascontiguousarray")
    (M, K), (K2, N) = (tuple(int(s) for s in x.shape) for x in (A, B))
    if K != K2:
        raise ValueError(f"matmul: inner dimensions differ, A is {M}x{K} and B is {K2}x{N}")
    if C is not None and tuple(C.shape) != (M, N):
        raise ValueError(f"matmul: C must be {M}x{N} for A {M}x{K} @ B {K}x{N}, got "
                         f"{tuple(C.shape)}")
    if min(M, N, K) < 1:
        raise ValueError(f"matmul: empty matrix (M, N, K) = {(M, N, K)}")
    if max(M * K, K * N, M * N) >= 2**31:
        raise ValueError("matmul: the kernels index with 32-bit int; each matrix must have "
                         "fewer than 2^31 elements")
    return M, N, K


def _launch(A, B, C, version: str, params: dict | None, mod) -> tuple:
    """(C, launch record): check, compile if needed, launch on the operands' stream."""
    version = version_name(VERSIONS, version, "matmul")
    M, N, K = check_operands(A, B, C, device=True)
    if version in _TUNED:
        if params is None and mod is not None:
            params = getattr(mod, "__dict__", {}).get("params")   # load_tuned's tile sizes
        if mod is None:
            mod = load_tuned(params)
    elif mod is None:
        mod = cb.module("matmul")                   # the whole ladder, once per process
    cfg = config(version, M, N, K, params)
    if C is None:
        C = cb.arrays.empty_like_lib(A, (M, N), "float32")
    args = (cb.as_cupy(A, "A"), cb.as_cupy(B, "B"), cb.as_cupy(C, "C"), np.int32(M),
            np.int32(N), np.int32(K))
    cb.launch.run(mod.get(cfg.kernel), cfg, args, stream=cb.stream_for(A, B, C))
    return C, cfg


def matmul(A, B, C=None, version: str = "v10", params: dict | None = None, mod=None):
    """C[M, N] = A[M, K] @ B[K, N] (float32, row-major, on the GPU) by ``matmul_<version>``
    ("v10" or "matmul_v10"); returns C (allocated by A's library when not given).

    ``mod``: a module of matmul.cu (``load_tuned(params)`` for v10 / v11 with other tile sizes),
    or None: v10 and v11 compile alone with the tile sizes ``params`` (default TUNED_DEFAULT),
    the other versions with the whole file, once per process. ``params`` (v10, v11) defaults to
    the tile sizes ``mod`` was compiled with. Launched on PyTorch's current stream when an
    operand is a torch tensor, else on CuPy's.
    """
    return _launch(A, B, C, version, params, mod)[0]


def launch_cupy(mod, version: str, A, B, C, params: dict | None = None) -> Launch:
    """The lessons' call shape of ``matmul(A, B, C, version, params, mod)``: returns the launch
    record used."""
    return _launch(A, B, C, version, params, mod)[1]


def launch(mod, version: str, A, B, C, params: dict | None = None) -> Launch:
    """``launch_cupy`` under the name hgemm_launch uses for the same call shape."""
    return _launch(A, B, C, version, params, mod)[1]


def launch_ladder(n: int = 2048, versions: tuple[str, ...] = VERSIONS) -> None:
    """Launch each CUDA version once on n x n float32 matrices: the run that Nsight Compute
    profiles, one launch per ladder step (Chapters 4 and 5)."""
    import cupy as cp

    mod = cb.module("matmul")
    A = cp.random.rand(n, n, dtype=cp.float32)
    B = cp.random.rand(n, n, dtype=cp.float32)
    C = cp.empty((n, n), cp.float32)
    for v in versions:
        matmul(A, B, C, version=v, mod=mod)
    cp.cuda.Device().synchronize()


def load_tuned(params: dict | None = None, only_tuned: bool = True):
    """matmul.cu compiled with the tile sizes of matmul_v10 and v11 set by -D macros (those two
    kernels alone, by default), once per process; ``mod.params`` holds the tile sizes."""
    p = tuned_params(params)
    mod = cb.module("matmul", tuned_options(p, only_tuned))
    mod.params = p
    return mod


def tolerance(K: int) -> dict:
    """atol/rtol for a float32 result of K-term dot products (cudabook.check.dot_tolerance)."""
    return dot_tolerance(K)


def _numba():
    return cb.load_numba("matmul")


def numba_config(version: str, M: int, N: int) -> Launch:
    """Grid and block of the Numba ``matmul_<version>`` ("reg8x8" or "matmul_reg8x8")."""
    version = version_name(NUMBA_VERSIONS, version, "matmul")
    nb = _numba()
    kernel = f"matmul_{version}"
    if version == "v1":
        return Launch((ceil_div(M, 16), ceil_div(N, 16)), (16, 16), kernel=kernel)
    if version == "v2":
        return Launch(grid_2d(M, N, 16), (16, 16), kernel=kernel)
    if version == "smem16":
        return Launch(grid_2d(M, N, nb.SMEM16_TILE), (nb.SMEM16_TILE, nb.SMEM16_TILE),
                      kernel=kernel)
    return Launch(grid_2d(M, N, (nb.REG_BM, nb.REG_BN)), (nb.REG_THREADS,), kernel=kernel)


def launch_numba(version: str, A, B, C) -> None:
    """Launch the Numba ``matmul_<version>`` (device arrays, or NumPy in the simulator)."""
    M, N, _ = check_operands(A, B, C)
    cfg = numba_config(version, M, N)
    getattr(_numba(), cfg.kernel)[cfg.grid, cfg.block](A, B, C)


def sanitize_targets():
    """(name, launch) pairs of v1..v11 on a ragged shape, for tools/sanitize.py (racecheck finds
    a missing __syncthreads() between tile loads; memcheck a missing bounds guard)."""
    import cupy as cp

    mod = cb.module("matmul")
    M, N, K = 131, 67, 45
    A = cp.random.rand(M, K, dtype=cp.float32)
    B = cp.random.rand(K, N, dtype=cp.float32)
    C = cp.empty((M, N), cp.float32)
    for v in VERSIONS:
        yield f"matmul_{v}", (lambda v=v: matmul(A, B, C, version=v, mod=mod))
    # v11 on a shape with one block wholly inside A and B (its unguarded float4 path) and edges
    A2 = cp.random.rand(300, 45, dtype=cp.float32)
    B2 = cp.random.rand(45, 140, dtype=cp.float32)
    C2 = cp.empty((300, 140), cp.float32)
    yield "matmul_v11 (inner block)", (lambda: matmul(A2, B2, C2, version="v11", mod=mod))
