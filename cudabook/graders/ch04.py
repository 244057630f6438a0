"""Graders of Chapter 4, "Tiling: the matrix-multiplication ladder".

ex04_1  Numba: shared-memory tiled C = A @ Bt.T (16x16 tiles, B given transposed)      simulator
ex04_2  CUDA C++ via CuPy: 2D register tiling (64x64 block tile, 4x4 outputs/thread)      GPU
ex04_3  Numba: boundary handling: make a register-tiled kernel correct for any M, N, K   simulator
ex04_4  CUDA C++ via CuPy: one optimisation step that reaches FAST_FRACTION of cuBLAS     GPU
ex04_5  pencil and paper: blocks per SM and occupancy from the registers per thread    CPU
ex04_6  pencil and paper: FLOP per byte of a block tile                                CPU
ex04_7  pencil and paper: blocks, waves and the last wave of a GEMM grid               CPU

Every grader checks sizes that are not multiples of the tile (and tall-skinny ones), fills the
output with NaN (an element never written fails) followed by a NaN canary (a write past the end
fails), calls the answer twice with different data, and explains the first kind of error.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from .. import env
from ..check import dot_tolerance, to_numpy
from ._core import (
    GradeError,
    call,
    canary_ok,
    ceil_div,
    check_numbers,
    error_summary,
    fresh_rng,
    guarded,
    looks_like_low_precision,
    need_gpu,
    passed,
    poisoned_memory,
    sync,
    to_device,
)
from ._core import compile_kernel as _compile
from ._race import racecheck, simulate
from ._static import calls, cuda_code, python_code, refuse_host_code, refuse_stub

__all__ = ["ex04_1", "ex04_2", "ex04_3", "ex04_4", "ex04_5", "ex04_6", "FAST_FRACTION",
           "diagnose_2d"]

#: ex04_4: the fraction of cuBLAS (same run, n = FAST_N) the optimised kernel must reach
FAST_FRACTION = 0.5
FAST_N = 2048


def _tol(K: int) -> float:
    return dot_tolerance(K)["atol"]


def _count_syncs(ex: str, fn) -> int:
    """How many barriers the source of a Numba kernel or a CUDA C string calls."""
    if isinstance(fn, str):
        return calls(cuda_code(fn), "__syncthreads")
    return calls(python_code(ex, fn), "syncthreads")


def _returns_before_barrier(ex: str, fn) -> bool:
    """The kernel has a ``return`` before its first barrier (threads that leave early no longer
    load their part of the tiles, and skip barriers the others wait at)."""
    code, barrier = (cuda_code(fn), "__syncthreads") if isinstance(fn, str) else \
        (python_code(ex, fn), "syncthreads")
    ret = re.search(r"\breturn\b", code)
    bar = re.search(rf"\b{barrier}\s*\(", code)
    return ret is not None and bar is not None and ret.start() < bar.start()


_EARLY_RETURN = ("a thread returns before the tile loop, so it no longer loads its part of "
                 "the tiles (they hold stale values) and skips the barriers the others wait at: "
                 "keep every thread in the loop; guard only the loads (zero past the edges) "
                 "and the store")


SENTINEL = 1234.5   # second-run fill: tells "never written" from "written as NaN"

_TILE_SYNC = ("a barrier after filling the tiles (before anyone reads them) and one after "
              "the products (before anyone overwrites them): two per tile step")


def _race_launch(k, tile: tuple[int, int], shapes) -> None:
    import cupy

    for M, N, K in shapes:
        A = cupy.random.standard_normal((M, K), dtype=cupy.float32)
        B = cupy.random.standard_normal((K, N), dtype=cupy.float32)
        C = cupy.empty((M, N), cupy.float32)
        k((ceil_div(N, tile[1]), ceil_div(M, tile[0])), (256,),
          (A, B, C, np.int32(M), np.int32(N), np.int32(K)))


def _race_ex04_2(k) -> None:
    """racecheck driver: edge tiles in M, N and K, several tile steps."""
    _race_launch(k, (64, 64), [(70, 66, 20)])


def _race_ex04_4(k) -> None:
    """racecheck driver: edge tiles in M, N and K, several tile steps."""
    _race_launch(k, (128, 128), [(130, 131, 20)])

_SYNC_HINT = ("missing __syncthreads()/cuda.syncthreads()? A tile must be complete before it is "
              "read, and read by everyone before it is overwritten (two barriers per tile step)")


def diagnose_2d(ex: str, case: str, out, ref: np.ndarray, buf=None, *, tile: tuple[int, int],
                K: int, ktile: int, syncs: int | None = None,
                rerun: Callable[[float], object] | None = None,
                early_return: bool = False) -> None:
    """Compare C with the float64 reference; raise GradeError naming the likely mistake.

    ``tile`` is the (rows, cols) of C per block, ``ktile`` the k-step of the tiles, ``syncs``
    the number of barriers in the source (None: unknown). ``rerun(fill)`` launches again into an
    output filled with ``fill`` and returns it: NaN elements of the first run that the second
    run overwrote were *computed* as NaN (uninitialised shared memory), not left unwritten.
    """
    o = to_numpy(out).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    M, N = r.shape
    if buf is not None and not canary_ok(buf, M * N):
        raise GradeError(f"{ex}: {case}: wrote past the end of C: missing bounds guard on the "
                         "store (if row < M and col < N)?")
    nan = np.isnan(o) & ~np.isnan(r)
    full_m, full_n = (M // tile[0]) * tile[0], (N // tile[1]) * tile[1]
    if nan.any() and rerun is not None:
        o2 = to_numpy(rerun(SENTINEL)).astype(np.float64)
        garbage = nan & (o2 != SENTINEL)
        if garbage.any():
            i, j = (int(v[0]) for v in np.nonzero(garbage))
            why = _SYNC_HINT if syncs is not None and syncs < 2 else (
                "zero-fill every tile element that lies outside A or B (k >= K, row >= M, "
                "col >= N) instead of skipping it, so no stale value is read")
            raise GradeError(f"{ex}: {case}: C[{i}, {j}] was written but is NaN: the kernel "
                             "read shared-memory entries that no thread loaded in this tile "
                             f"step (uninitialised memory): {why}")
        nan = nan & (o2 == SENTINEL)
        o = np.where(nan, np.nan, o)
    interior = full_m > 0 and full_n > 0        # at least one whole tile, away from the edges
    if nan.all() and (full_m == 0 or full_n == 0):
        raise GradeError(f"{ex}: {case}: C never written (all NaN); C is smaller than one "
                         f"{tile[0]}x{tile[1]} tile, so its only blocks are edge tiles: a "
                         "store guard that drops partial tiles (guard each element instead: "
                         "row < M and col < N), or the stub?")
    if nan.all():
        raise GradeError(f"{ex}: {case}: C never written (all NaN): is the kernel still the "
                         "stub, or does every thread return before its store?")
    if (o == 0).all() and (np.abs(r) > _tol(K)).any():
        raise GradeError(f"{ex}: {case}: C is all zeros: the products are never accumulated "
                         "(does the loop over k run, and does it add into the accumulators that "
                         "are stored?)")
    wrong = nan | (np.abs(o - r) > _tol(K) + 1e-4 * np.abs(r))
    if wrong.any() and early_return:
        raise GradeError(f"{ex}: {case}: {error_summary(o, r, wrong)}: {_EARLY_RETURN}")
    # with a barrier missing from the source, a few slightly-off values are a race, not rounding
    few = syncs is not None and syncs < 2 and int(wrong.sum()) < 16
    if wrong.any() and not nan.any() and not few and looks_like_low_precision(o, r, wrong):
        raise GradeError(f"{ex}: {case}: {error_summary(o, r, wrong)}: small errors spread "
                         "over the whole of C, not the edges: lower-precision arithmetic (a "
                         "float16/bfloat16 product or accumulator, or TF32)? Keep the products "
                         "and the sum in float32")
    if wrong.any() and syncs is not None and syncs < 2:
        i, j = (int(v[0]) for v in np.nonzero(wrong))
        raise GradeError(f"{ex}: {case}: wrong at ({i}, {j}): got {o[i, j]:.6g}, expected "
                         f"{r[i, j]:.6g} ({int(wrong.sum())} of {M * N} wrong): {_SYNC_HINT}")
    if nan.any():
        rows, cols = np.nonzero(nan)
        where = f"{rows.size} of {M * N} elements of C never written, first at " \
                f"({rows[0]}, {cols[0]})"
        if interior and ((rows >= full_m) | (cols >= full_n)).all():
            raise GradeError(f"{ex}: {case}: {where}, all in the edge tiles: a store guard "
                             "that drops whole tiles, or a grid rounded down instead of up?")
        raise GradeError(f"{ex}: {case}: {where}: only part of C is written - does each "
                         "thread store all of its outputs (every row and column it owns)?")
    bad = np.abs(o - r) > _tol(K) + 1e-4 * np.abs(r)
    if not bad.any():
        return
    rows, cols = np.nonzero(bad)
    i, j = int(rows[0]), int(cols[0])
    msg = (f"{ex}: {case}: wrong at ({i}, {j}): got {o[i, j]:.6g}, expected {r[i, j]:.6g} "
           f"({rows.size} of {M * N} wrong)")
    edge = interior and ((rows >= full_m) | (cols >= full_n)).all()
    if K % ktile and edge:
        raise GradeError(f"{msg}: errors only in the edge tiles (M={M}, N={N} are not "
                         "multiples of the tile): zero-fill the tile loads past row M / "
                         "column N?")
    if K % ktile:
        raise GradeError(f"{msg}: K={K} is not a multiple of the k-step {ktile}: load zeros "
                         "for k >= K (A[row, k0 + c] only if k0 + c < K), or the last partial "
                         "tile adds garbage")
    if edge:
        raise GradeError(f"{msg}: errors only in the edge tiles: zero-fill the tile loads "
                         "past row M / column N?")
    raise GradeError(f"{ex}: {case}: {error_summary(o, r, bad)}; M, N, K are multiples of the "
                     "tile here, so the edges are not the cause: check which rows of A and "
                     "columns of B each thread's products take (the tile indices)")


class _HeldBack:
    """Wrong values on a C of fewer than 16 elements say little about *which* mistake made them
    (one stale shared-memory value can look like rounding, a missing zero-fill like a race), so
    that verdict is held back while the larger cases run: the first of those to fail is reported
    instead, and the held one only if all of them pass. Launch errors are never held back."""

    def __init__(self):
        self.error: GradeError | None = None

    def check(self, size: int, diagnose: Callable[[], None]) -> None:
        try:
            diagnose()
        except GradeError as e:
            if size >= 16:
                raise
            self.error = self.error or e

    def raise_if_any(self) -> None:
        if self.error is not None:
            raise self.error


def _rerun(launch: Callable, shape: tuple[int, int]) -> Callable[[float], object]:
    """A second launch into a fresh output (with its own canary) filled with ``fill``."""
    def run(fill: float):
        out, buf = guarded(shape)
        buf.fill(fill)
        try:
            launch(out)
            sync()
        except Exception:  # noqa: BLE001 - the first run's error is the one reported
            pass
        return out
    return run


def _mats(rng, M, N, K, bt=False):
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((N, K) if bt else (K, N), dtype=np.float32)
    ref = A.astype(np.float64) @ (B.astype(np.float64).T if bt else B.astype(np.float64))
    return A, B, ref


def _sim_shapes(small, big):
    return small + ([] if env.SIM else big)


# --------------------------------------------------------------------------------- ex04_1

def ex04_1(matmul_abt) -> None:
    """``matmul_abt`` is a @cuda.jit kernel: C[M, N] = A[M, K] @ Bt[N, K].T, 16x16 shared tiles.

    Launched with block (16, 16) and grid (ceil(N/16), ceil(M/16)): ``threadIdx.x`` walks the
    columns of C. Ragged shapes (not multiples of 16, K too), tall-skinny ones, two calls with
    different data per shape; the big shapes run only on a GPU.
    """
    ex = "ex04.1"
    refuse_stub(ex, matmul_abt)
    a0 = np.zeros((3, 4), np.float32)
    # before running (a GPU may hang on a divergent barrier); an early return has its own hint
    refuse_host_code(ex, matmul_abt, (a0, a0, a0),
                     barriers=not _returns_before_barrier(ex, matmul_abt))
    with poisoned_memory():
        _matmul_abt_cases(ex, matmul_abt)
    simulate(ex, "ex04_1", [("matmul_abt", matmul_abt)], hint=_TILE_SYNC)
    passed(ex)


def _matmul_abt_cases(ex: str, matmul_abt) -> None:
    rng, seed = fresh_rng()
    shapes = _sim_shapes([(1, 1, 1), (16, 16, 16), (17, 33, 20), (35, 3, 40)],
                         [(1000, 777, 129), (4096, 17, 300), (123, 2049, 1000)])
    syncs = _count_syncs(ex, matmul_abt)
    early = _returns_before_barrier(ex, matmul_abt)
    held = _HeldBack()
    for n_case, (M, N, K) in enumerate(shapes):
        for rep in range(2 if n_case in (1, 2) or not env.SIM else 1):
            A, Bt, ref = _mats(rng, M, N, K, bt=True)
            out, buf = guarded((M, N))
            case = f"M={M}, N={N}, K={K} (seed {seed}, call {rep + 1})"
            grid, block = (ceil_div(N, 16), ceil_div(M, 16)), (16, 16)
            dA, dBt = to_device(A), to_device(Bt)
            call(ex, case, lambda: matmul_abt[grid, block](dA, dBt, out))
            held.check(M * N, lambda: diagnose_2d(
                ex, case, out, ref, buf, tile=(16, 16), K=K, ktile=16, syncs=syncs,
                rerun=_rerun(lambda o: matmul_abt[grid, block](dA, dBt, o), (M, N)),
                early_return=early))
    held.raise_if_any()


# --------------------------------------------------------------------------------- CUDA C


def _run_cuda(ex, kern, shapes, tile, threads, ktile, rng, seed, syncs, repeats=2,
              early_return=False):
    import cupy

    held = _HeldBack()
    for M, N, K in shapes:
        for rep in range(repeats):
            A, B, ref = _mats(rng, M, N, K)
            out, buf = guarded((M, N))
            case = f"M={M}, N={N}, K={K} (seed {seed}, call {rep + 1})"
            grid = (ceil_div(N, tile[1]), ceil_div(M, tile[0]))
            dA, dB = cupy.asarray(A), cupy.asarray(B)
            launch = lambda o: kern(grid, (threads,), (dA, dB, o, np.int32(M), np.int32(N),
                                                       np.int32(K)))
            call(ex, case, lambda: launch(out))
            held.check(M * N, lambda: diagnose_2d(
                ex, case, out, ref, buf, tile=tile, K=K, ktile=ktile, syncs=syncs,
                rerun=_rerun(launch, (M, N)), early_return=early_return))
    held.raise_if_any()


_CUDA_SHAPES = [(1, 1, 1), (64, 64, 8), (65, 63, 9), (1023, 1025, 517), (4096, 24, 64),
                (7, 3000, 130), (512, 512, 512), (2048, 2048, 2048)]


def ex04_2(src: str) -> None:
    """``src`` defines ``matmul_reg2d(const float* A, const float* B, float* C, int M, int N,
    int K)``: 64x64 block tile, BK = 8, 256 threads, each thread a 4x4 block of C.

    Launched with block 256 and grid (ceil(N/64), ceil(M/64)) on ragged and tall-skinny shapes,
    twice each with new data; the 2048^3 case, with thousands of blocks in flight, exposes races.
    """
    ex = "ex04.2"
    need_gpu(ex)
    kern = _compile(ex, src, "matmul_reg2d")
    rng, seed = fresh_rng()
    _run_cuda(ex, kern, _CUDA_SHAPES, (64, 64), 256, 8, rng, seed, _count_syncs(ex, src),
              early_return=_returns_before_barrier(ex, src))
    racecheck(ex, src, "matmul_reg2d", "cudabook.graders.ch04:_race_ex04_2", hint=_TILE_SYNC)
    passed(ex)


def ex04_4(src: str, fraction: float = FAST_FRACTION) -> None:
    """``src`` defines ``matmul_fast(const float* A, const float* B, float* C, int M, int N,
    int K)`` for a 128x128 block tile and 256 threads: grid (ceil(N/128), ceil(M/128)).

    It must be correct on ragged shapes, then reach ``fraction`` of cuBLAS (cupy.matmul, fp32,
    TF32 off) at M = N = K = FAST_N, timed in the same run.
    """
    ex = "ex04.4"
    if not env.HAS_GPU:
        raise GradeError(f"{ex}: needs a CUDA GPU (timed against cuBLAS on your device)")
    import cupy

    from ..bench import bench

    kern = _compile(ex, src, "matmul_fast")
    rng, seed = fresh_rng()
    _run_cuda(ex, kern, _CUDA_SHAPES, (128, 128), 256, 1, rng, seed, _count_syncs(ex, src),
              early_return=_returns_before_barrier(ex, src))
    racecheck(ex, src, "matmul_fast", "cudabook.graders.ch04:_race_ex04_4", hint=_TILE_SYNC)
    n = FAST_N
    A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = cupy.empty((n, n), dtype=cupy.float32)
    grid = (ceil_div(n, 128), ceil_div(n, 128))
    t = bench({"yours": lambda: kern(grid, (256,), (A, B, C, np.int32(n), np.int32(n),
                                                    np.int32(n)))},
              baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)}, flops=2.0 * n ** 3,
              repeat=10, quiet=True)
    ratio = t["yours"].ratio
    if ratio < fraction:
        raise GradeError(f"{ex}: correct, but at {n}^3 it reaches {t['yours'].value:.1f} "
                         f"TFLOP/s = {100 * ratio:.0f}% of cuBLAS ({t['cuBLAS'].value:.1f}); "
                         f"the goal is {100 * fraction:.0f}%. Try float4 loads with A "
                         "transposed in shared memory, padding, or double buffering.")
    passed(ex)


def fast_ratio(src: str, n: int = FAST_N) -> float:
    """The ratio to cuBLAS that ex04_4 measures (for the notebook to print)."""
    import cupy

    from ..bench import bench

    kern = _compile("ex04.4", src, "matmul_fast")
    A = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    B = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    C = cupy.empty((n, n), dtype=cupy.float32)
    grid = (ceil_div(n, 128), ceil_div(n, 128))
    t = bench({"yours": lambda: kern(grid, (256,), (A, B, C, np.int32(n), np.int32(n),
                                                    np.int32(n)))},
              baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)}, flops=2.0 * n ** 3,
              repeat=10, quiet=False)
    return t["yours"].ratio


# --------------------------------------------------------------------------------- ex04_3

def ex04_3(matmul_ragged) -> None:
    """``matmul_ragged`` is a @cuda.jit register-tiled kernel: 32x32 block tile, BK = 8,
    64 threads (8 x 8), 4x4 outputs per thread; it must be right for every M, N, K >= 1.

    Launched with block 64 and grid (ceil(N/32), ceil(M/32)). Shapes: exact multiples first
    (so a problem elsewhere is told apart), then ragged M, N, K and tall-skinny ones.
    """
    ex = "ex04.3"
    refuse_stub(ex, matmul_ragged)
    a0 = np.zeros((3, 4), np.float32)
    refuse_host_code(ex, matmul_ragged, (a0, a0, a0),
                     barriers=not _returns_before_barrier(ex, matmul_ragged))
    with poisoned_memory():
        _matmul_ragged_cases(ex, matmul_ragged)
    simulate(ex, "ex04_3", [("matmul_ragged", matmul_ragged)], hint=_TILE_SYNC)
    passed(ex)


def _matmul_ragged_cases(ex: str, matmul_ragged) -> None:
    rng, seed = fresh_rng()
    shapes = _sim_shapes([(32, 32, 8), (1, 1, 1), (33, 31, 9), (5, 70, 17), (70, 3, 3)],
                         [(1023, 1025, 517), (4096, 20, 36), (3, 4099, 100)])
    syncs = _count_syncs(ex, matmul_ragged)
    early = _returns_before_barrier(ex, matmul_ragged)
    for n_case, (M, N, K) in enumerate(shapes):
        for rep in range(2 if n_case == 2 or not env.SIM else 1):
            A, B, ref = _mats(rng, M, N, K)
            out, buf = guarded((M, N))
            case = f"M={M}, N={N}, K={K} (seed {seed}, call {rep + 1})"
            grid = (ceil_div(N, 32), ceil_div(M, 32))
            dA, dB = to_device(A), to_device(B)
            call(ex, case, lambda: matmul_ragged[grid, 64](dA, dB, out))
            diagnose_2d(ex, case, out, ref, buf, tile=(32, 32), K=K, ktile=8, syncs=syncs,
                        rerun=_rerun(lambda o: matmul_ragged[grid, 64](dA, dB, o), (M, N)),
                        early_return=early)


def ex04_5(blocks_127, blocks_130, occupancy_130) -> None:
    """256-thread blocks, no shared memory, an SM of 65,536 registers given out per warp in
    units of 256, at most 64 warps and 32 blocks: blocks per SM at 127 and 130 registers per
    thread, and the fraction of the 64 warp slots in use at 130."""
    regs = ("registers per warp = {r} x 32 rounded up to a multiple of 256; then 65,536 / "
            "(8 warps x that), rounded down")
    check_numbers("ex04.5", {"blocks_127": blocks_127, "blocks_130": blocks_130,
                             "occupancy_130": occupancy_130},
                  {"blocks_127": 2, "blocks_130": 1, "occupancy_130": 0.125},
                  wrong={"blocks_127": {8: "the 64-warp limit allows 8, the registers fewer",
                                        2.015: "a block fits whole or not at all: round down"},
                         "blocks_130": {2: "130 x 32 = 4160 registers a warp, rounded up to "
                                           "4352; 8 warps need 34,816 of the 65,536",
                                        1.97: "a block fits whole or not at all: round down",
                                        8: "the 64-warp limit allows 8, the registers fewer"},
                         "occupancy_130": {0.25: "that is two blocks' worth (16 warps): how "
                                                 "many blocks fit at 130?",
                                           0.5: "occupancy = resident warps / 64"}},
                  nudge={"blocks_127": regs.format(r=127), "blocks_130": regs.format(r=130),
                         "occupancy_130": "resident warps / 64"})
    passed("ex04.5")


def ex04_6(intensity_64, intensity_128) -> None:
    """A block computes a BM x BN tile of C = A B (float32), each k-step loading a BM x BK tile of
    A and a BK x BN tile of B and doing BM BN BK multiply-adds: FLOP per byte loaded from global
    memory for BM = BN = 64 and 128."""
    rule = "2 BM BN BK FLOPs / ((BM + BN) BK x 4 bytes); BK cancels"
    check_numbers("ex04.6", {"intensity_64": intensity_64, "intensity_128": intensity_128},
                  {"intensity_64": 16, "intensity_128": 32},
                  wrong={"intensity_64": {8: "a multiply-add is two FLOPs",
                                          64: "per byte, not per float: a float is 4 bytes",
                                          32: "count both: two FLOPs per multiply-add, four "
                                              "bytes per float"},
                         "intensity_128": {16: "a multiply-add is two FLOPs (or: the tile's "
                                               "FLOPs grow as BM BN, its loads as BM + BN)",
                                           128: "per byte, not per float: a float is 4 bytes",
                                           64: "count both: two FLOPs per multiply-add, four "
                                               "bytes per float"}},
                  nudge={"intensity_64": rule, "intensity_128": rule})
    passed("ex04.6")


def ex04_7(blocks, waves, last_wave_sms, efficiency) -> None:
    """C = A B with M = N = 4096, block tiles of 256 x 128 (BM x BN), one block per SM on 132 SMs:
    blocks in the grid, waves (rounds of at most 132 blocks), SMs busy in the last wave, and the
    fraction of SM time that does work, blocks / (waves x 132)."""
    check_numbers("ex04.7", {"blocks": blocks, "waves": waves, "last_wave_sms": last_wave_sms,
                             "efficiency": efficiency},
                  {"blocks": 512, "waves": 4, "last_wave_sms": 116, "efficiency": 512 / 528},
                  wrong={"blocks": {1024: "the tile is 256 x 128, not 128 x 128",
                                    256: "the tile is 256 x 128, not 256 x 256: 16 x 32 tiles"},
                         "waves": {3: "3 waves run 396 blocks; the other 116 need a fourth",
                                   3.879: "a partial wave takes a round of its own: round up"},
                         "last_wave_sms": {16: "16 SMs are idle in the last wave: how many are "
                                               "busy?",
                                           132: "the last wave is not full: 512 - 3 x 132"},
                         "efficiency": {116 / 132: "that is the last wave alone: count all "
                                                   "four"}},
                  nudge={"blocks": "ceil(M / BM) x ceil(N / BN)",
                         "waves": "ceil(blocks / 132)",
                         "last_wave_sms": "blocks - (waves - 1) x 132",
                         "efficiency": "blocks / (waves x 132)"})
    passed("ex04.7")
