"""Numba twins of kernels/matmul.cu, and the one launch description of every version (Chapter 4).

C[M, N] = A[M, K] @ B[K, N], float32, row-major, contiguous. Any M, N, K >= 1.

Numba versions (same names as their CUDA C++ counterparts)
  matmul_v1   naive, the grid's x index walks rows (uncoalesced)    [(ceil(M/16), ceil(N/16)), (16, 16)]
  matmul_v2   naive, the grid's x index walks columns (coalesced)   [(ceil(N/16), ceil(M/16)), (16, 16)]
  matmul_v3   shared-memory tiles of 16 x 16                         [(ceil(N/16), ceil(M/16)), (16, 16)]
  matmul_v5   2D register tiling: 128 x 128 block tile, BK = 8, 8 x 8 outputs per thread, A
              transposed and padded in shared memory, 4x4 pieces spaced so a warp's shared
              reads are conflict-free                                [(ceil(N/128), ceil(M/128)), 256]
  matmul_v6   the steps Numba can take after v5: the loop over the tile's k written out (an
              inlined device function called with a literal k, so shared addresses fold to
              constants), the next tiles' global loads issued into registers before this
              tile's FMAs, branch-free (clamped addresses), and BK = 16         [as v5]
  Numba has no float4 loads, no inline PTX (cp.async) and no launch bounds, so it stops here.

CuPy launch description (the lesson, the graders and the tests all use it)
  config(version, M, N, K, params)  -> {"grid", "block", "shared"}
  launch_cupy(mod, version, A, B, C)   validates the operands and launches mod.matmul_<version>
  load_tuned(params)                -> the module with matmul_v10 compiled for those tile sizes
  autotune(configs, n)              -> the sweep of the lesson (tqdm progress bar)
  launch_numba(version, A, B, C)       the same for the Numba kernels above
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

# ============================================================================ launch description

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10")
NUMBA_VERSIONS = ("v1", "v2", "v3", "v5", "v6")

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


def config(version: str, M: int, N: int, K: int, params: dict | None = None) -> dict:
    """Grid, block and dynamic shared memory of ``matmul_<version>`` for C[M, N] = A @ B."""
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; matmul.cu has {VERSIONS}")
    cd = lambda a, b: (a + b - 1) // b
    if version == "v1":
        return {"grid": (cd(M, 32), cd(N, 32)), "block": (32, 32), "shared": 0}
    if version in ("v2", "v3"):
        return {"grid": (cd(N, 32), cd(M, 32)), "block": (32, 32), "shared": 0}
    if version == "v10":
        p = tuned_params(params)
        return {"grid": (cd(N, p["BN"]), cd(M, p["BM"])), "block": (tuned_threads(p),),
                "shared": tuned_shared(p)}
    nt, (bm, bn), sh = _FIXED[version]
    return {"grid": (cd(N, bn), cd(M, bm)), "block": (nt,), "shared": sh}


def check_operands(A, B, C) -> tuple[int, int, int]:
    """(M, N, K) of C[M, N] = A[M, K] @ B[K, N], or a clear error about what does not fit."""
    for name, x in (("A", A), ("B", B), ("C", C)):
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"matmul: {name} must be a 2D matrix, got shape "
                             f"{getattr(x, 'shape', None)}")
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"matmul: {name} is {x.dtype}; these kernels are float32 only "
                            f"(use .astype(float32))")
        contiguous = x.flags["C_CONTIGUOUS"] if hasattr(x, "flags") else x.is_c_contiguous()
        if not contiguous:
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

    ``params`` (v10 only) defaults to the tile sizes ``mod`` was compiled with (``load_tuned``).
    """

    M, N, K = check_operands(A, B, C)
    if version == "v10" and params is None:
        params = mod.__dict__.get("params")
    cfg = config(version, M, N, K, params)
    kern = mod.get(f"matmul_{version}")
    if cfg["shared"] > MAX_STATIC_SHARED:
        kern.max_dynamic_shared_size_bytes = cfg["shared"]
    kern(cfg["grid"], cfg["block"], (A, B, C, np.int32(M), np.int32(N), np.int32(K)),
         shared_mem=cfg["shared"])
    return cfg


def load_tuned(params: dict | None = None, only_tuned: bool = True):
    """Compile matmul.cu with matmul_v10's tile sizes set by -D macros (alone, by default)."""
    import cudabook as cb

    p = tuned_params(params)
    mod = cb.load_cuda("matmul", options=tuned_options(p, only_tuned))
    mod.params = p
    return mod


def autotune(configs: list[dict], n: int = 4096, repeat: int = 10, vs_cublas: bool = True
             ) -> list[dict]:
    """Compile and time matmul_v10 for each tile configuration on n x n x n (tqdm progress bar).

    Each entry of the result: the parameters, threads, shared bytes, registers, spill bytes,
    time (us), TFLOP/s and ratio to cuBLAS (timed in the same call), or "error" for a
    configuration that does not compile, launch or check. Sorted best first.
    """
    import cupy
    from tqdm import tqdm

    import cudabook as cb

    rng = np.random.default_rng(0)
    A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = cupy.empty((n, n), dtype=cupy.float32)
    ref = A[:128].astype(cupy.float64) @ B.astype(cupy.float64)    # first rows only: fast
    work = 2.0 * n ** 3
    base = None
    if vs_cublas:
        base = cb.bench({}, baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)}, flops=work,
                        repeat=repeat, quiet=True).rows[0].value
    out = []
    for cfg in tqdm(configs, desc="autotune", leave=False):
        entry = {"params": {**TUNED_DEFAULT, **cfg}}
        try:
            entry["params"] = tuned_params(cfg)
            mod = load_tuned(cfg)
            res = mod.resources("matmul_v10")
            C.fill(np.nan)
            t = cb.bench({"v10": lambda: launch_cupy(mod, "v10", A, B, C)}, flops=work,
                         repeat=repeat, quiet=True,
                         check=lambda _: cb.check(C[:128], ref, **tolerance(n)))
            row = t.rows[0]
            entry.update(threads=tuned_threads(entry["params"]),
                         shared=tuned_shared(entry["params"]), registers=res["registers"],
                         spill_bytes=res["local_bytes"], time_us=row.time_us,
                         tflops=row.value, ratio=(row.value / base) if base else None)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        out.append(entry)
    out.sort(key=lambda e: -(e.get("tflops") or 0.0))
    return out


def params_label(p: dict) -> str:
    return (f"{p['BM']}x{p['BN']}x{p['BK']} warp {p['WM']}x{p['WN']} thread {p['TM']}x{p['TN']}"
            f" st{p['STAGES']}{' async' if p['ASYNC'] else ''}")


# ============================================================================ Numba kernels

NB_TILE = 16                           # matmul_v3
NB_BM, NB_BN, NB_BK = 128, 128, 8       # matmul_v5
NB_TM, NB_TN = 8, 8
NB_THREADS = (NB_BM // NB_TM) * (NB_BN // NB_TN)     # 256
NB_PAD = 4
NB_BMP = NB_BM + NB_PAD                # padded row of the transposed A tile (a literal for Numba)
NB6_BK = 16                            # matmul_v6: twice v5's BK, half the barriers per FMA
NB_LA = NB_BM * NB6_BK // NB_THREADS   # elements of an A tile each v6 thread loads (8): a global
NB_LB = NB6_BK * NB_BN // NB_THREADS   # constant, as local.array shapes must be; B likewise


@cuda.jit
def matmul_v1(A, B, C):
    # launch: [(ceil(M/16), ceil(N/16)), (16, 16)]; x walks rows -> neighbours 4K bytes apart
    row, col = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        acc = float32(0.0)
        for k in range(A.shape[1]):
            acc += A[row, k] * B[k, col]
        C[row, col] = acc


@cuda.jit
def matmul_v2(A, B, C):
    # launch: [(ceil(N/16), ceil(M/16)), (16, 16)]; x walks columns -> coalesced B and C
    col, row = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        acc = float32(0.0)
        for k in range(A.shape[1]):
            acc += A[row, k] * B[k, col]
        C[row, col] = acc


@cuda.jit
def matmul_v3(A, B, C):
    # launch: [(ceil(N/16), ceil(M/16)), (16, 16)]; 2 x 16 x 16 x 4 = 2 KiB shared
    As = cuda.shared.array((NB_TILE, NB_TILE), float32)
    Bs = cuda.shared.array((NB_TILE, NB_TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = B.shape[1]
    row = cuda.blockIdx.y * NB_TILE + ty
    col = cuda.blockIdx.x * NB_TILE + tx
    acc = float32(0.0)
    for k0 in range(0, K, NB_TILE):
        # load one element of each tile per thread, zero past the edges
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else float32(0.0)
        cuda.syncthreads()                       # the tiles are complete
        for k in range(NB_TILE):
            acc += As[ty, k] * Bs[k, tx]
        cuda.syncthreads()                       # everyone is done before they are refilled
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def matmul_v5(A, B, C):
    # launch: [(ceil(N/128), ceil(M/128)), 256]; shared (8 x 132 + 8 x 128) x 4 = 8.1 KiB
    As = cuda.shared.array((NB_BK, NB_BMP), float32)          # transposed: As[k, m]
    Bs = cuda.shared.array((NB_BK, NB_BN), float32)
    acc = cuda.local.array((NB_TM, NB_TN), float32)            # registers once unrolled
    ra = cuda.local.array(NB_TM, float32)
    rb = cuda.local.array(NB_TN, float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * NB_BM
    n0 = cuda.blockIdx.x * NB_BN
    tr = tid // (NB_BN // NB_TN)
    tc = tid % (NB_BN // NB_TN)
    for i in range(NB_TM):
        for j in range(NB_TN):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, NB_BK):
        for l in range(NB_BM * NB_BK // NB_THREADS):           # 4 elements of A per thread
            idx = tid + l * NB_THREADS
            r = idx // NB_BK
            c = idx % NB_BK
            As[c, r] = A[m0 + r, k0 + c] if m0 + r < M and k0 + c < K else float32(0.0)
        for l in range(NB_BK * NB_BN // NB_THREADS):           # 4 elements of B per thread
            idx = tid + l * NB_THREADS
            r = idx // NB_BN
            c = idx % NB_BN
            Bs[r, c] = B[k0 + r, n0 + c] if k0 + r < K and n0 + c < N else float32(0.0)
        cuda.syncthreads()
        for k in range(NB_BK):
            for i in range(4):                                 # rows tr*4.. and 64 + tr*4..
                ra[i] = As[k, tr * 4 + i]
                ra[4 + i] = As[k, NB_BM // 2 + tr * 4 + i]
                rb[i] = Bs[k, tc * 4 + i]
                rb[4 + i] = Bs[k, NB_BN // 2 + tc * 4 + i]
            for i in range(NB_TM):
                for j in range(NB_TN):
                    acc[i, j] += ra[i] * rb[j]
        cuda.syncthreads()
    for i in range(NB_TM):
        r = m0 + (i // 4) * (NB_BM // 2) + tr * 4 + i % 4
        for j in range(NB_TN):
            c = n0 + (j // 4) * (NB_BN // 2) + tc * 4 + j % 4
            if r < M and c < N:
                C[r, c] = acc[i, j]


@cuda.jit(device=True, inline="always")
def _v6_step(As, Bs, acc, ra, rb, k, ar, bc):
    # one k of the 8 x 8 outer product; k is a literal at each call site, so once this is
    # inlined the shared-memory addresses are constants plus ar / bc
    for i in range(4):
        ra[i] = As[k, ar + i]
        ra[4 + i] = As[k, NB_BM // 2 + ar + i]
        rb[i] = Bs[k, bc + i]
        rb[4 + i] = Bs[k, NB_BN // 2 + bc + i]
    for i in range(NB_TM):
        for j in range(NB_TN):
            acc[i, j] += ra[i] * rb[j]

@cuda.jit(device=True, inline="always")
def _v6_fetch(A, B, va, vb, tid, m0, n0, k0, M, N, K):
    # this thread's 8 elements of the next A tile and 8 of the next B tile, into registers. The
    # addresses are clamped into the matrices, so every load is unconditional and all eight can be
    # in flight at once; elements past an edge are zeroed afterwards (a branch around each load
    # would make each wait for the one before).
    for l in range(NB_LA):
        idx = tid + l * NB_THREADS
        r, c = m0 + idx // NB6_BK, k0 + idx % NB6_BK
        v = A[min(r, M - 1), min(c, K - 1)]
        va[l] = v if r < M and c < K else float32(0.0)
    for l in range(NB_LB):
        idx = tid + l * NB_THREADS
        r, c = k0 + idx // NB_BN, n0 + idx % NB_BN
        v = B[min(r, K - 1), min(c, N - 1)]
        vb[l] = v if r < K and c < N else float32(0.0)


@cuda.jit
def matmul_v6(A, B, C):
    # launch: as matmul_v5; shared (16 x 132 + 16 x 128) x 4 = 16.3 KiB. Three changes: the k loop
    # is written out (_v6_step with a literal k), the next tiles' global loads are issued before
    # the FMAs of this tile (into registers), so their latency hides behind 1024 FMAs, and BK = 16
    # halves the barriers per FMA.
    As = cuda.shared.array((NB6_BK, NB_BMP), float32)
    Bs = cuda.shared.array((NB6_BK, NB_BN), float32)
    acc = cuda.local.array((NB_TM, NB_TN), float32)
    ra = cuda.local.array(NB_TM, float32)
    rb = cuda.local.array(NB_TN, float32)
    va = cuda.local.array(NB_LA, float32)
    vb = cuda.local.array(NB_LB, float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * NB_BM
    n0 = cuda.blockIdx.x * NB_BN
    tr = tid // (NB_BN // NB_TN)
    tc = tid % (NB_BN // NB_TN)
    ar, bc = tr * 4, tc * 4
    for i in range(NB_TM):
        for j in range(NB_TN):
            acc[i, j] = float32(0.0)
    _v6_fetch(A, B, va, vb, tid, m0, n0, 0, M, N, K)
    for k0 in range(0, K, NB6_BK):
        for l in range(NB_LA):          # registers -> shared memory
            idx = tid + l * NB_THREADS
            As[idx % NB6_BK, idx // NB6_BK] = va[l]
        for l in range(NB_LB):
            idx = tid + l * NB_THREADS
            Bs[idx // NB_BN, idx % NB_BN] = vb[l]
        cuda.syncthreads()
        _v6_fetch(A, B, va, vb, tid, m0, n0, k0 + NB6_BK, M, N, K)  # next tiles, in flight now
        # a `for k in range(NB6_BK)` loop stays rolled in Numba, recomputing 64-bit addresses of
        # every shared read at each k (see the lesson's PTX count); written out, k is a literal
        _v6_step(As, Bs, acc, ra, rb, 0, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 1, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 2, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 3, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 4, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 5, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 6, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 7, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 8, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 9, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 10, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 11, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 12, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 13, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 14, ar, bc)
        _v6_step(As, Bs, acc, ra, rb, 15, ar, bc)
        cuda.syncthreads()
    for i in range(NB_TM):
        r = m0 + (i // 4) * (NB_BM // 2) + tr * 4 + i % 4
        for j in range(NB_TN):
            c = n0 + (j // 4) * (NB_BN // 2) + tc * 4 + j % 4
            if r < M and c < N:
                C[r, c] = acc[i, j]


def numba_config(version: str, M: int, N: int) -> tuple[tuple, tuple]:
    """(grid, block) of the Numba ``matmul_<version>``."""
    cd = lambda a, b: (a + b - 1) // b
    if version == "v1":
        return (cd(M, 16), cd(N, 16)), (16, 16)
    if version in ("v2", "v3"):
        return (cd(N, 16), cd(M, 16)), (16, 16)
    if version in ("v5", "v6"):
        return (cd(N, NB_BN), cd(M, NB_BM)), (NB_THREADS,)
    raise ValueError(f"unknown Numba version {version!r}; kernels/matmul.py has "
                     f"{NUMBA_VERSIONS}")


def launch_numba(version: str, A, B, C) -> None:
    """Launch the Numba ``matmul_<version>`` (device arrays, or NumPy in the simulator)."""
    M, N, _ = check_operands(A, B, C)
    grid, block = numba_config(version, M, N)
    globals()[f"matmul_{version}"][grid, block](A, B, C)


def flops(M: int, N: int, K: int) -> float:
    return 2.0 * M * N * K


def min_bytes(M: int, N: int, K: int) -> float:
    """Compulsory traffic: read A and B once, write C once (float32)."""
    return 4.0 * (M * K + K * N + M * N)


def intensity(M: int, N: int, K: int) -> float:
    return flops(M, N, K) / min_bytes(M, N, K)


def tolerance(K: int) -> dict:
    """atol/rtol for a float32 result of K-term dot products against a float64 reference.

    Rounding errors of a sequential float32 sum of K unit-size products grow like eps * K
    (about 6e-8 K); 5e-7 K leaves room for the largest of millions of elements.
    """
    return {"atol": max(1e-5, 5e-7 * K), "rtol": 1e-4}


__all__ = ["VERSIONS", "NUMBA_VERSIONS", "WHAT", "TUNED_DEFAULT", "config", "check_operands",
           "launch_cupy", "load_tuned", "autotune", "tuned_params", "tuned_options",
           "tuned_threads", "tuned_shared", "params_label", "numba_config", "launch_numba",
           "flops", "min_bytes", "intensity", "tolerance"]


def sanitize_targets():
    """(name, launch) pairs of v1..v9 on a ragged shape, for tools/sanitize.py (racecheck finds
    a missing __syncthreads() between tile loads; memcheck a missing bounds guard)."""
    import cupy as cp

    import cudabook as cb

    mod = cb.load_cuda("matmul")
    M, N, K = 131, 67, 45
    A = cp.random.rand(M, K, dtype=cp.float32)
    B = cp.random.rand(K, N, dtype=cp.float32)
    C = cp.empty((M, N), cp.float32)
    for v in VERSIONS[:-1]:
        yield f"matmul_{v}", (lambda v=v: launch_cupy(mod, v, A, B, C))
