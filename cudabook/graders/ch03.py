"""Graders of Chapter 3, "Neural-network building blocks".

ex03_1  Numba: shared-memory tree sum of a block and its launcher (ragged n, last block)   simulator
ex03_2  CUDA C++ via CuPy: grid-stride sum, warp shuffles, one atomicAdd per block        GPU
ex03_3  Numba: online softmax, one thread per row (large magnitudes, -inf, all -inf rows) simulator
ex03_4  Numba: LayerNorm forward, one block per row, checked against torch layer_norm     simulator
ex03_5  CUDA C++ via CuPy: 2D convolution with a shared-memory tile and halo              GPU
ex03_6  CUDA C++ via CuPy: fused bias + GELU (tanh form)                                  GPU
ex03_7  pencil and paper: divergent warps at the levels of a reduction tree                CPU
ex03_8  pencil and paper: partial sums and launches of a multi-pass reduction              CPU
ex03_9  pencil and paper: bytes per element of three softmax kernels                       CPU
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np

from .. import env
from ..check import close, to_numpy
from ..reference import (
    conv2d_reference,
    gelu_erf_reference,
    gelu_tanh_reference,
    layernorm_reference,
    softmax_reference,
)
from ._core import (
    CANARY,
    GradeError,
    call,
    canary_ok,
    ceil_div,
    check_numbers,
    count_launches,
    error_summary,
    fresh_rng,
    guarded,
    launched_kernels,
    need_gpu,
    passed,
    poisoned_memory,
    ragged_sizes,
    sync,
    to_device,
)
from ._core import compile_kernel as _compile
from ._race import racecheck, simulate
from ._static import cuda_code, mentions, refuse_host_code, refuse_stub

__all__ = ["ex03_1", "ex03_2", "ex03_3", "ex03_4", "ex03_5", "ex03_6", "ex03_7", "ex03_8",
           "fusion_speed",
           # the references moved to cudabook.reference; still importable from here
           "softmax_reference", "layernorm_reference", "conv2d_reference", "gelu_tanh_reference"]

_gelu_erf = gelu_erf_reference


def _scalar(ex: str, case: str, v) -> float:
    try:
        a = np.asarray(to_numpy(v), dtype=np.float64).ravel()
    except Exception as e:  # noqa: BLE001 - whatever it returned, say what it was
        raise GradeError(f"{ex}: {case}: returned {type(v).__name__}, not a number ({e})") \
            from None
    if a.size != 1:
        raise GradeError(f"{ex}: {case}: returned {a.size} values; return the single total "
                         "(launch again on the partial sums until one is left)")
    return float(a[0])


# ----------------------------------------------------------------------------- ex03.1
SUM_TPB = 128                                  # the block size of ex03.1 (TPB in the notebook)
SUM_PASSES_N = SUM_TPB ** 3 + 1                # needs four passes: a fixed number of launches fails
_SUM_SYNC_HINT = ("a cuda.syncthreads() after loading the shared array and after every level "
                  "of the tree, so no level reads a partial before it is written")


def _passes(n: int) -> int:
    """Launches of a 128-thread tree until one value is left: n -> ceil(n / 128), at least 1."""
    p = 1
    while n > SUM_TPB:
        n, p = ceil_div(n, SUM_TPB), p + 1
    return p


def _sum_tol(ref: float) -> float:
    return 1e-5 * ref + 1e-4


@contextlib.contextmanager
def _exact_block_sums():
    """Simulator only: every kernel launch in the block computes partial[b] = the sum of
    x[b * blockDim : (b + 1) * blockDim] exactly, in NumPy, instead of running the kernel.
    (The launcher's logic is then tested at sizes the simulator is too slow to run.)"""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    orig = FakeCUDAKernel.__call__

    def host(a):
        return np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else a)

    def exact(self, *args):
        if getattr(self, "_device", False):
            return orig(self, *args)
        (blocks,), (threads,) = self.grid_dim[:1], self.block_dim[:1]
        x = host(args[0]).astype(np.float64)
        sums = np.add.reduceat(x, np.arange(0, x.size, threads))[:blocks]
        part = np.zeros(blocks, np.float32)
        part[:sums.size] = sums
        args[1][:blocks] = part
    FakeCUDAKernel.__call__ = exact
    try:
        yield
    finally:
        FakeCUDAKernel.__call__ = orig


def _sum_case(ex: str, sum_all: Callable, x: np.ndarray, case: str,
              prev: dict[int, float]) -> float:
    """Run sum_all on x; GradeError with the diagnosis, or the value. ``prev`` holds the sums of
    the lengths that passed (and, under -1, whether a length with a partial last block did)."""
    n = x.size
    got: list = []
    with count_launches() as launches:
        call(ex, case, lambda: got.append(sum_all(to_device(x))))
    s = _scalar(ex, case, got[0])
    ref = float(x.astype(np.float64).sum())
    tol = _sum_tol(ref)
    cached = n in prev and abs(s - prev[n]) <= _sum_tol(prev[n]) and abs(s - ref) > tol
    if launches[0] == 0 and not cached:
        raise GradeError(f"{ex}: {case}: returned {s:.6g} without launching a kernel (NumPy, "
                         "CuPy or a prefix sum on the host?): the exercise asks for the "
                         "shared-memory tree kernel block_sum, launched until one value is left")
    if math.isnan(s):
        raise GradeError(f"{ex}: {case}: the sum is NaN: a partial read before it was "
                         "written, or elements past the end read (load 0 when i >= n)?")
    if abs(s - ref) <= tol:
        if launches[0] < _passes(n):
            raise GradeError(f"{ex}: {case}: the sum is right, but {launches[0]} launch"
                             f"{'es' if launches[0] != 1 else ''} of the kernel made it where "
                             f"{_passes(n)} are needed to bring {n} values down to one: the "
                             "last partial sums were added on the host (NumPy, CuPy, sum() or a "
                             "Python loop). The exercise asks for the kernel to be launched "
                             "again on the partial sums until one value is left")
        prev[n] = ref
        if n % SUM_TPB and n > SUM_TPB:
            prev[-1] = 1.0                      # the grid rounds up: partial blocks are summed
        return s
    if cached:
        raise GradeError(f"{ex}: {case}: returned {s:.7g}, the sum of the previous call's data "
                         f"(this call's is {ref:.7g}): an answer kept from an earlier call? "
                         "Compute the sum of the x passed each time")
    for passes in (2, 3):                       # a launcher with a fixed number of passes
        k = SUM_TPB ** passes
        if k < n and abs(s - float(x[:k].astype(np.float64).sum())) <= tol and -1 in prev:
            raise GradeError(f"{ex}: {case}: got {s:.7g}, the sum of the first {k} elements "
                             f"only: {passes} passes of {SUM_TPB}-thread blocks cover at most "
                             f"{k}; launch again on the partial sums until one value is left "
                             "(a fixed number of launches fails for large n)")
    # first: a running float32 total lands within a few elements' worth of the truth at large n,
    # where a dropped partial block of 3 elements would too; its value is exactly the sequential
    # float32 sum, which no tree sum matches
    rel = abs(s - ref) / ref
    sequential = float(np.cumsum(x, dtype=np.float32)[-1])
    if abs(s - sequential) <= 1e-6 * abs(sequential):
        raise GradeError(f"{ex}: {case}: got {s:.7g}, expected {ref:.7g}: close, but a "
                         f"relative error of {rel:.1e} is more than float32 pairwise sums "
                         "give (1e-5), and it is what a running float32 total gives (a "
                         "sequential loop or a prefix sum loses precision as it grows); sum in "
                         "a tree of pairs, as block_sum does")
    full = (n // SUM_TPB) * SUM_TPB
    first = abs(s - float(x[:SUM_TPB].astype(np.float64).sum())) <= tol and n > SUM_TPB
    dropped = full < n and abs(s - float(x[:full].astype(np.float64).sum())) <= tol
    if dropped and first:
        raise GradeError(f"{ex}: {case}: got {s:.6g}, expected {ref:.6g}, the sum of the "
                         f"first {SUM_TPB} elements: either the last partial block is dropped "
                         f"(round the grid up, ceil_div(n, {SUM_TPB}), and load 0 past the end) "
                         "or only the first block's partial is returned (launch again on the "
                         "partial sums until one value is left)")
    if dropped:
        raise GradeError(f"{ex}: {case}: got {s:.6g}, expected {ref:.6g}: the last partial "
                         f"block ({n - full} elements) is dropped: round the grid up, "
                         f"ceil_div(n, {SUM_TPB}), and load 0 past the end")
    if first:
        raise GradeError(f"{ex}: {case}: got the sum of the first block only: launch again "
                         "on the partial sums until one value is left")
    again = [_scalar(ex, case, sum_all(to_device(x))) for _ in range(3)]
    if max(again + [s]) - min(again + [s]) > tol:
        past = (" Or values past the end read: a missing bounds guard (load 0 when i >= n; what "
                "lies past the end of x changes from call to call)" if n % SUM_TPB else "")
        raise GradeError(f"{ex}: {case}: got {s:.7g}, expected {ref:.7g}; the same data gave "
                         f"sums from {min(again + [s]):.7g} to {max(again + [s]):.7g} on "
                         f"repeated calls: a race. Is {_SUM_SYNC_HINT} missing?{past}")
    mean = float(x.mean())
    missing = (ref - s) / mean
    what = (f"about {missing:.0f} elements' worth missing" if missing > 0 else
            f"about {-missing:.0f} elements' worth too much")
    hint = (f"{_SUM_SYNC_HINT}; a tree level that skips half of the partials; or blocks not "
            "summed?" if missing > 0 else
            "elements added twice (overlapping blocks or levels), or values past the end read "
            "(load 0 when i >= n)?")
    raise GradeError(f"{ex}: {case}: got {s:.7g}, expected {ref:.7g} ({what}): {hint}")


#: ex03.1 on a GPU: a vector of ones this long, which a running float32 total cannot sum
SUM_ONES_N = 1 << 25


def ex03_1(sum_all: Callable) -> None:
    """``sum_all(x)`` returns the sum of the float32 device vector ``x`` (any length >= 1).

    It must use the student's Numba kernel: a shared-memory tree with 128 threads per block,
    one partial sum per block, launched again on the partials until one value is left. The
    values are positive, so a dropped block (grid = n // 128 instead of rounding up) changes
    the total; every length is run twice with different data. Lengths that need three or four
    passes run on a GPU; in the simulator (too slow for them) the launcher is run once more at
    128^3 + 1 elements with every launch computing exact block sums in NumPy, so a launcher
    with a fixed number of passes fails there too. The launches are counted (a sum finished on
    the host makes too few), and the kernel's source must be GPU code with every barrier
    reached by the whole block; shared memory starts as NaN in the simulator.
    """
    ex = "ex03.1"
    rng, seed = fresh_rng()
    sizes = ragged_sizes(SUM_TPB, big=(1 << 20) + 3, sim_big=None) + \
        ([SUM_TPB * SUM_TPB + 1] if not env.SIM else [])
    prev: dict[int, float] = {}
    checked: set[int] = set()
    with poisoned_memory(), launched_kernels() as kernels:
        for n in sorted(set(sizes)):
            for rep in range(2):
                x = rng.uniform(0.5, 1.5, n).astype(np.float32)
                _sum_case(ex, sum_all, x, f"n={n} (seed {seed}, call {rep + 1})", prev)
                for kernel, args in kernels:      # each kernel it launched, once: GPU code?
                    if id(kernel) not in checked:
                        checked.add(id(kernel))
                        refuse_host_code(ex, kernel, args)
        if not env.SIM:      # 2^25 ones: a tree sums them exactly, a running float32
            x = np.ones(SUM_ONES_N, np.float32)        # total stops at 2^24 (1 + 2^24 rounds
            _sum_case(ex, sum_all, x, f"n=2^25 ones (seed {seed})", prev)   # back to 2^24)
    if env.SIM:
        x = rng.uniform(0.5, 1.5, SUM_PASSES_N).astype(np.float32)
        case = (f"n={SUM_PASSES_N} (4 passes; each launch computed as exact block sums, the "
                "simulator being too slow for this size)")
        with _exact_block_sums():
            _sum_case(ex, sum_all, x, case, prev)
    simulate(ex, "ex03_1", [("sum_all", sum_all)], hint=_SUM_SYNC_HINT)
    passed(ex)


# ----------------------------------------------------------------------------- ex03.2
SUM_ATOMIC_BLOCK = 256
_WARP_SUMS_SYNC_HINT = ("a __syncthreads() between writing the warp sums to shared memory and "
                        "reading them")

# Compiled in front of the student's source to count the atomicAdd calls a launch makes.
_COUNT_ATOMICS = r'''
__device__ unsigned int cb_atomic_adds;
__device__ __forceinline__ float cb_atomicAdd(float* a, float v) {
    atomicAdd(&cb_atomic_adds, 1u); return atomicAdd(a, v); }
__device__ __forceinline__ double cb_atomicAdd(double* a, double v) {
    atomicAdd(&cb_atomic_adds, 1u); return atomicAdd(a, v); }
__device__ __forceinline__ int cb_atomicAdd(int* a, int v) {
    atomicAdd(&cb_atomic_adds, 1u); return atomicAdd(a, v); }
__device__ __forceinline__ unsigned int cb_atomicAdd(unsigned int* a, unsigned int v) {
    atomicAdd(&cb_atomic_adds, 1u); return atomicAdd(a, v); }
#define atomicAdd(...) cb_atomicAdd(__VA_ARGS__)
#line 1 "ex03.2 source"
'''


def _atomics_per_launch(ex: str, src: str, grid: int, n: int) -> int:
    """How many atomicAdd calls one launch of the student's kernel makes."""
    import cupy

    from ..compile import compile_source

    try:
        mod = compile_source(_COUNT_ATOMICS + src, name=f"{ex} source (atomics counted)")
    except RuntimeError as e:
        raise GradeError(f"{ex}: the source does not compile with its atomicAdd calls counted "
                         f"(the grader wraps them):\n{e}") from None
    count = cupy.ndarray((1,), cupy.uint32, mod.raw.get_global("cb_atomic_adds"))
    count.fill(0)
    x = cupy.ones(n, cupy.float32)
    out = cupy.zeros(1, cupy.float32)
    mod.get("sum_atomic")((grid,), (SUM_ATOMIC_BLOCK,), (x, out, cupy.int32(n)))
    return int(count.get()[0])


def _race_ex03_2(k) -> None:
    """racecheck driver: a few blocks, a ragged length."""
    import cupy

    n = 3 * SUM_ATOMIC_BLOCK + 5
    x = cupy.random.uniform(0.5, 1.5, n, dtype=cupy.float32)
    out = cupy.zeros(1, cupy.float32)
    k((3,), (SUM_ATOMIC_BLOCK,), (x, out, cupy.int32(n)))


def ex03_2(src: str) -> None:
    """``src`` defines ``sum_atomic(const float* x, float* out, int n)``.

    Launched with 256 threads per block and grids of several sizes (smaller and larger than
    n / 256): a grid-stride loop sums x, the block reduces with warp shuffles, and one thread
    per block adds the block's sum to out[0] (zeroed by the grader) with atomicAdd. Repeated
    runs with new data catch races that show (a missing __syncthreads shows up on some runs
    only); compute-sanitizer racecheck catches the rest; the atomicAdd calls of a launch are
    counted (one per block).
    """
    ex = "ex03.2"
    need_gpu(ex)
    import cupy

    code = cuda_code(src) if isinstance(src, str) else ""
    if not mentions(code, "__shfl"):
        raise GradeError(f"{ex}: the kernel uses no warp shuffle (__shfl_down_sync or "
                         "__shfl_xor_sync): reduce each warp in registers first")
    k = _compile(ex, src, "sum_atomic")
    B = SUM_ATOMIC_BLOCK
    grid = 7
    adds = _atomics_per_launch(ex, src, grid, grid * B * 3)
    if adds not in (0, grid):                  # 0: nothing added at all; the values say more
        per = ("per warp" if adds == grid * B // 32 else "per thread" if adds == grid * B
               else "per thread of one warp" if adds == grid * 32 else "")
        raise GradeError(f"{ex}: one launch of {grid} blocks made {adds} atomicAdd calls"
                         + (f" (one {per})" if per else "") + ": the rule is one per block. "
                         "Combine the warp sums in shared memory first, then thread 0 alone "
                         "adds the block's total to out[0]")
    rng, seed = fresh_rng()
    sizes = ragged_sizes(B) + [(1 << 22) + 5]
    for n in sizes:
        grids = sorted({1, 7, 264, ceil_div(n, B), ceil_div(n, B) + 50})
        reps = 6 if n > 4096 else 1
        for grid in grids:  # noqa: B007 - the lambda below uses this grid
            for rep in range(reps):
                x = rng.uniform(0.5, 1.5, n).astype(np.float32)
                buf = cupy.full(1 + CANARY, np.nan, dtype=cupy.float32)
                out = buf[:1]
                out.fill(0)
                case = f"n={n}, grid={grid}x{B} (seed {seed}, run {rep + 1} of {reps})"
                call(ex, case, lambda: k((grid,), (B,), (cupy.asarray(x), out,
                                                         cupy.int32(n))))
                if not canary_ok(buf, 1):
                    raise GradeError(f"{ex}: {case}: wrote past out[0]: only out[0] is the "
                                     "result")
                s = float(out.get()[0])
                ref = float(x.astype(np.float64).sum())
                tol = 2e-5 * ref + 1e-3
                if abs(s - ref) <= tol:
                    continue
                if math.isnan(s):
                    raise GradeError(f"{ex}: {case}: result is NaN: a shared-memory slot read "
                                     "before it was written?")
                again = []                 # the same data again: a race changes the answer
                for _ in range(4):
                    out.fill(0)
                    k((grid,), (B,), (cupy.asarray(x), out, cupy.int32(n)))
                    again.append(float(out.get()[0]))
                spread = max(again + [s]) - min(again + [s])
                if spread > tol:
                    raise GradeError(f"{ex}: {case}: got {s:.7g}, expected {ref:.7g}; the same "
                                     f"data gave sums from {min(again + [s]):.7g} to "
                                     f"{max(again + [s]):.7g} on repeated runs: a race. Is "
                                     f"{_WARP_SUMS_SYNC_HINT} missing?")
                if grid < ceil_div(n, B) and abs(s - float(x[:grid * B].sum(
                        dtype=np.float64))) <= tol:
                    raise GradeError(f"{ex}: {case}: only the first grid*{B} elements were "
                                     "summed: loop over the vector, i += blockDim.x * "
                                     "gridDim.x (grid-stride)")
                ratio = s / ref if ref else 0.0
                if abs(ratio - round(ratio)) < 0.02 and round(ratio) >= 2:
                    hint = (f"exactly {round(ratio)}x the answer with one atomicAdd per block: "
                            f"every element is counted {round(ratio)} times (a loop that "
                            "visits elements twice, or a factor in the sum)?")
                elif ratio > 1:
                    hint = (f"{ratio:.3f}x the answer: elements added twice (a loop bound past "
                            "n, or overlapping threads)?")
                else:
                    hint = (f"{ratio:.3f}x the answer: elements or warps missed (does the block "
                            "combine every warp's sum, and is the loop bound i < n?)")
                raise GradeError(f"{ex}: {case}: got {s:.7g}, expected {ref:.7g}, the same on "
                                 f"every run: {hint}")
    racecheck(ex, src, "sum_atomic", "cudabook.graders.ch03:_race_ex03_2",
              hint=_WARP_SUMS_SYNC_HINT)
    passed(ex)


# ----------------------------------------------------------------------------- ex03.3
def _softmax_cases(rng):
    cases = []
    for m, n in [(1, 1), (3, 7), (33, 40), (5, 300)]:
        cases.append((f"M={m}, N={n}, normal data", rng.standard_normal((m, n)) * 3))
    big = rng.standard_normal((6, 50)) * 30
    big[:, 5] = 1000.0 + rng.uniform(0, 50, 6)   # exp(1000) overflows float32 (and float64)
    cases.append(("large magnitudes (values near 1000)", big))
    low = rng.standard_normal((3, 17)) * 3 - 1000.0   # exp(x) underflows to 0 in any precision
    cases.append(("very negative scores (values near -1000)", low))
    neg = rng.standard_normal((5, 20)) * 3
    neg[:, :4] = -np.inf                      # the running max starts at -inf for 4 elements
    neg[2, 10:] = -np.inf
    cases.append(("rows starting with -inf (masked entries)", neg))
    allinf = rng.standard_normal((4, 9))
    allinf[1] = -np.inf
    cases.append(("a row of only -inf (fully masked: expect zeros)", allinf))
    return [(c, a.astype(np.float32)) for c, a in cases]


def ex03_3(softmax_online) -> None:
    """``softmax_online`` is a @cuda.jit kernel ``(x, y)``: one thread per row of the (M, N)
    float32 ``x``, launched [ceil(M / 32), 32]. One pass keeps a running max and a running sum
    rescaled when the max grows; a second pass writes y = exp(x - m) / d. A row of only -inf
    must give zeros.
    """
    ex = "ex03.3"
    refuse_stub(ex, softmax_online)
    x0 = np.zeros((3, 5), np.float32)
    refuse_host_code(ex, softmax_online, (x0, x0))
    rng, seed = fresh_rng()
    with poisoned_memory():
        _softmax_online_cases(ex, softmax_online, rng, seed)
    passed(ex)


def _softmax_online_cases(ex: str, softmax_online, rng, seed: int) -> None:
    for rep in range(2):
        for what, x in _softmax_cases(rng):
            M, N = x.shape
            case = f"{what}, M={M}, N={N} (seed {seed}, call {rep + 1})"
            out, buf = guarded((M, N))

            def run():
                try:
                    softmax_online[ceil_div(M, 32), 32](to_device(x), out)
                except OverflowError:      # the simulator's math.exp raises where a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: subtract the running max "
                                     "before exp (x - m <= 0), and rescale the sum by "
                                     "exp(m_old - m_new) when the max grows") from None
            call(ex, case, run)
            if not canary_ok(buf, M * N):
                raise GradeError(f"{ex}: {case}: wrote past the end of y: missing bounds guard "
                                 "(if r < M)?")
            o = to_numpy(out).astype(np.float64)
            ref = softmax_reference(x)
            bad = ~close(o, ref, 1e-6, 1e-4)
            if not bad.any():
                continue
            r, c = (int(v[0]) for v in np.nonzero(bad))
            row_nan = np.isnan(o[r]).all()
            if "large" in what and (np.isnan(o[r, c]) or np.isinf(o[r, c])):
                hint = ("exp overflowed: subtract the running max before exp (x - m <= 0), and "
                        "rescale the sum by exp(m_old - m_new) when the max grows")
            elif "very negative" in what:
                hint = ("every score of the row is very negative, and exp of it underflows to 0 "
                        "(a sum of 0, then 0 or NaN): the running max must start at -inf (not "
                        "0 or another constant), so x - m is 0 for the row's largest element")
            elif "only -inf" in what and r == 1:
                hint = ("a row of only -inf must give zeros: when the max is -inf use 0 instead "
                        "(exp(-inf - (-inf)) is NaN), and write 0 when the sum is 0")
            elif "-inf" in what and (np.isnan(o[r, c]) or (o[r] == 0).all()):
                hint = ("NaN from exp(-inf - (-inf)) (a NaN sum, or a whole row of 0 when the "
                        "NaN sum fails d > 0): while the running max is still -inf, a -inf "
                        "element must add nothing (skip it, or guard the rescale)")
            elif row_nan and np.isnan(o).all():
                hint = "output never written: is the kernel body still the stub?"
            elif row_nan:
                hint = "row never written: wrong row index or missing rows?"
            else:
                hint = ("wrong value: is the old sum rescaled by exp(m_old - m_new) when a new "
                        "max appears, and y = exp(x - m) / d?")
            raise GradeError(f"{ex}: {case}: wrong at ({r}, {c}): got {o[r, c]:.6g}, expected "
                             f"{ref[r, c]:.6g}: {hint}")


# ----------------------------------------------------------------------------- ex03.4
_LN_SYNC_HINT = ("a cuda.syncthreads() between the levels of each tree, and one after every "
                 "thread has read the shared total (the mean) before the array is reused for "
                 "the variance")


def ex03_4(layernorm) -> None:
    """``layernorm`` is a @cuda.jit kernel ``(x, gamma, beta, eps, y)`` for a float32 (M, N)
    ``x``: one block of 64 threads per row, launched [M, 64], shared memory for the block's
    statistics. Checked against torch.nn.functional.layer_norm (float64, CPU), including rows
    whose mean is large compared with their spread.
    """
    ex = "ex03.4"
    refuse_stub(ex, layernorm)
    x0, g0 = np.zeros((2, 5), np.float32), np.zeros(5, np.float32)
    refuse_host_code(ex, layernorm, (x0, g0, g0, np.float32(1e-5), x0))
    rng, seed = fresh_rng()
    with poisoned_memory():
        _layernorm_cases(ex, layernorm, rng, seed)
    simulate(ex, "ex03_4", [("layernorm", layernorm)], hint=_LN_SYNC_HINT)
    passed(ex)


def _layernorm_cases(ex: str, layernorm, rng, seed: int) -> None:
    shapes = [(1, 1), (3, 7), (2, 65), (2, 200)] + ([(4, 64), (300, 1000), (64, 4099)]
                                                    if not env.SIM else [])
    for rep in range(2):
        cases = [(f"M={m}, N={n}", rng.standard_normal((m, n)) * rng.uniform(0.5, 3))
                 for m, n in shapes]
        cases.append(("large mean (1000) and small spread",
                      1000.0 + rng.standard_normal((2, 129))))
        for what, x in cases:
            x = x.astype(np.float32)
            M, N = x.shape
            g = rng.uniform(0.5, 1.5, N).astype(np.float32)
            b = rng.standard_normal(N).astype(np.float32)
            eps = np.float32(1e-5 if rep == 0 else 1e-3)
            case = f"{what}, eps={float(eps):g} (seed {seed}, call {rep + 1})"
            out, buf = guarded((M, N))

            def run():
                try:
                    layernorm[M, 64](to_device(x), to_device(g), to_device(b), eps, out)
                except ValueError as e:    # the simulator's math.sqrt of a negative number
                    raise GradeError(f"{ex}: {case}: {e}: a negative variance? var = E[x^2] - "
                                     "E[x]^2 cancels catastrophically in float32 when the mean "
                                     "is large: use two passes or Welford") from None
            call(ex, case, run)
            if not canary_ok(buf, M * N):
                raise GradeError(f"{ex}: {case}: wrote past the end of y: loop while j < N?")
            o = to_numpy(out).astype(np.float64)
            ref = layernorm_reference(x, g, b, float(eps))
            # float32 rounding of a mean near 1000 alone moves y by ~1e-4: a looser atol there
            atol = 1e-3 if "large mean" in what else 2e-4
            bad = ~close(o, ref, atol, 1e-3)
            if not bad.any():
                continue
            r, c = (int(v[0]) for v in np.nonzero(bad))
            x64 = x.astype(np.float64)
            mean = x64.mean(-1, keepdims=True)
            var = x64.var(-1, keepdims=True)
            unbiased = (x64 - mean) / np.sqrt(x64.var(-1, ddof=1, keepdims=True) + eps) * g + b \
                if N > 1 else None
            no_eps = (x64 - mean) / np.sqrt(var) * g + b if (var > 0).all() else None
            no_affine = (x64 - mean) / np.sqrt(var + eps)
            matches = lambda a: a is not None and np.allclose(o, a, atol=atol, rtol=1e-3)
            computed_nan = False                 # NaN written by the kernel, not left unwritten
            if np.isnan(o).any():
                again, _ = guarded((M, N))
                again.fill(1234.5)
                try:
                    layernorm[M, 64](to_device(x), to_device(g), to_device(b), eps, again)
                    sync()
                    computed_nan = bool(np.isnan(to_numpy(again)).any())
                except Exception:  # noqa: BLE001 - the first run's diagnosis stands
                    pass
            nan_rows = np.isnan(o).any(-1)
            if computed_nan and (var[nan_rows] == 0).all():
                hint = ("NaN in the rows whose variance is 0: eps is missing (1 / sqrt(var + eps) "
                        "keeps a constant row finite)")
            elif computed_nan:
                hint = ("the kernel computes NaN (not just leaves elements unwritten): a negative "
                        "variance under the square root, or 0 / 0?")
            elif np.isnan(o).all() and "large mean" not in what:
                hint = "output never written: is the kernel body still the stub?"
            elif "large mean" in what and not (matches(unbiased) or matches(no_eps)
                                               or matches(no_affine)):
                hint = ("var = E[x^2] - E[x]^2 cancels catastrophically in float32 when the mean "
                        "is large (it can even go negative: NaN): use two passes (mean first, "
                        "then (x - mean)^2) or Welford")
            elif np.isnan(o[r, c]):
                hint = ("NaN: element never written (does the write loop cover j = tid, tid + "
                        "64, ... < N?) or a negative variance under the square root")
            elif matches(unbiased):
                hint = "the variance divides by N - 1; LayerNorm uses the biased one (/ N)"
            elif matches(no_eps):
                hint = "eps is missing: 1 / sqrt(var + eps)"
            elif matches(no_affine):
                hint = "gamma and beta are not applied: y = x_hat * gamma[j] + beta[j]"
            else:
                hint = (f"{error_summary(o, ref, bad)}. The row's statistics are wrong: are all "
                        "64 partial sums combined, with " + _LN_SYNC_HINT + "?")
                raise GradeError(f"{ex}: {case}: {hint}")
            raise GradeError(f"{ex}: {case}: wrong at ({r}, {c}): got {o[r, c]:.6g}, expected "
                             f"{ref[r, c]:.6g}: {hint}")


# ----------------------------------------------------------------------------- ex03.5
def _race_ex03_5(k) -> None:
    """racecheck driver: a ragged image with partial tiles, K = 5."""
    import cupy

    H, W, K = 20, 35, 5
    x = cupy.random.standard_normal((H, W), dtype=cupy.float32)
    w = cupy.random.standard_normal((K, K), dtype=cupy.float32)
    y = cupy.empty((H, W), cupy.float32)
    k((ceil_div(W, 16), ceil_div(H, 16)), (16, 16), (x, w, y, cupy.int32(H), cupy.int32(W),
                                                     cupy.int32(K)))


def ex03_5(src: str) -> None:
    """``src`` defines ``conv2d_tiled(const float* x, const float* w, float* y, int H, int W,
    int K)``: 'same' 2D cross-correlation with zero padding (K odd, K <= 7), launched with
    16x16 blocks and grid (ceil(W / 16), ceil(H / 16)); each block loads its input tile and
    halo into shared memory. Sizes are not multiples of 16; the border pixels are checked.
    """
    ex = "ex03.5"
    need_gpu(ex)
    import cupy

    if not isinstance(src, str) or not mentions(cuda_code(src), "__shared__"):
        raise GradeError(f"{ex}: no __shared__ tile: load the block's (16 + K - 1)^2 inputs into "
                         "shared memory once, then compute from there")
    k = _compile(ex, src, "conv2d_tiled")
    rng, seed = fresh_rng()
    # a ragged image with an interior first: the stub and a border-only mistake differ there
    shapes = [(33, 70), (1, 1), (16, 16), (17, 15), (5, 40), (100, 129), (517, 1029)]
    for K in (3, 1, 5, 7):
        for H, W in shapes:
            for rep in range(2 if H * W > 1000 else 1):
                x = rng.standard_normal((H, W)).astype(np.float32)
                w = rng.standard_normal((K, K)).astype(np.float32)
                out, buf = guarded((H, W))
                grid = (ceil_div(W, 16), ceil_div(H, 16))
                case = f"H={H}, W={W}, K={K} (seed {seed}, run {rep + 1})"
                call(ex, case, lambda: k(grid, (16, 16), (cupy.asarray(x), cupy.asarray(w), out,
                                                          cupy.int32(H), cupy.int32(W),
                                                          cupy.int32(K))))
                if not canary_ok(buf, H * W):
                    raise GradeError(f"{ex}: {case}: wrote past the end of y: guard the store "
                                     "with if (r < H && c < W)")
                o = to_numpy(out).astype(np.float64)
                ref = conv2d_reference(x, w)
                bad = ~close(o, ref, 1e-4, 1e-4)
                if not bad.any():
                    continue
                r, c = (int(v[0]) for v in np.nonzero(bad))
                p = K // 2
                border = np.zeros((H, W), bool)
                if p:
                    border[:p], border[-p:], border[:, :p], border[:, -p:] = True, True, True, \
                        True
                if np.isnan(o).all():
                    hint = "output never written: is the kernel body still the stub?"
                elif bad[border].any() and not bad[~border].any():
                    hint = ("only the border is wrong: pixels outside the image count as 0 "
                            "(zero padding). Load 0 into the halo where the input index is "
                            "outside 0..H-1 / 0..W-1, and still write the border outputs")
                elif np.isnan(o).any():
                    hint = ("some outputs never written: the grid covers all pixels only if every "
                            "thread that is inside the image writes (tail blocks are partial)")
                elif H % 16 or W % 16:
                    hint = ("wrong inside the image with sizes not multiples of 16: is the tile "
                            "loaded with all (16 + K - 1)^2 cells (a loop over the cells, not one "
                            "per thread), and is there a __syncthreads() before computing?")
                else:
                    hint = ("wrong values: tile[ty + a][tx + b] * w[a * K + b], the halo of K / "
                            "2 on every side, and __syncthreads() after loading?")
                raise GradeError(f"{ex}: {case}: wrong at ({r}, {c}): got {o[r, c]:.6g}, "
                                 f"expected {ref[r, c]:.6g} ({int(bad.sum())} of {H * W} wrong): "
                                 f"{hint}")
    racecheck(ex, src, "conv2d_tiled", "cudabook.graders.ch03:_race_ex03_5",
              hint="a __syncthreads() between loading the tile (and its halo) and reading it")
    passed(ex)


# ----------------------------------------------------------------------------- ex03.6
#: ex03.6 on a GPU: the fused kernel must be this many times faster than the unfused pair
FUSION_MIN_SPEEDUP = 1.3


def ex03_6(src: str, min_speedup: float = FUSION_MIN_SPEEDUP) -> None:
    """``src`` defines ``bias_gelu(const float* x, const float* b, float* y, int M, int N)``:
    y = gelu_tanh(x + b[col]) for (M, N) row-major x, in one kernel (the fusion), launched with
    256 threads per block and ceil(M * N / 256) blocks. On a GPU the fusion is measured: at
    least ``min_speedup`` times faster than the unfused pair (x + b, then GELU), same run.
    """
    ex = "ex03.6"
    need_gpu(ex)
    import cupy

    k = _compile(ex, src, "bias_gelu")
    rng, seed = fresh_rng()
    shapes = [(1, 1), (1, 255), (3, 7), (7, 3), (33, 65), (256, 1000), (1025, 4097)]
    for M, N in shapes:
        for rep in range(2):
            x = (rng.standard_normal((M, N)) * 3).astype(np.float32)
            b = rng.standard_normal(N).astype(np.float32)
            out, buf = guarded((M, N))
            n = M * N
            case = f"M={M}, N={N} (seed {seed}, call {rep + 1})"
            call(ex, case, lambda: k((ceil_div(n, 256),), (256,), (cupy.asarray(x),
                                                                    cupy.asarray(b), out,
                                                                    cupy.int32(M),
                                                                    cupy.int32(N))))
            if not canary_ok(buf, n):
                raise GradeError(f"{ex}: {case}: wrote past the end of y: missing bounds guard "
                                 "(if i < M * N)?")
            o = to_numpy(out).astype(np.float64)
            z = x.astype(np.float64) + b[None, :]
            ref = gelu_tanh_reference(z)
            bad = ~close(o, ref, 1e-5, 1e-4)
            if not bad.any():
                continue
            r, c = (int(v[0]) for v in np.nonzero(bad))
            if np.isnan(o).all():
                hint = "output never written: is the kernel body still the stub?"
            elif np.isnan(o).any():
                hint = "some elements never written: wrong index or too few threads?"
            elif np.allclose(o, _gelu_erf(z), atol=1e-5, rtol=1e-4):
                hint = "this is the erf form of GELU; the exercise asks for the tanh approximation"
            elif M <= N and np.allclose(o, gelu_tanh_reference(
                    x.astype(np.float64) + b[:M, None]), atol=1e-5, rtol=1e-4):
                hint = "the bias is indexed by row; it belongs to the column: b[i % N]"
            elif np.allclose(o, gelu_tanh_reference(x), atol=1e-5, rtol=1e-4):
                hint = "the bias is not added: y = gelu(x + b[i % N])"
            else:
                hint = ("wrong values: 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))) with "
                        "z = x + b[col]")
            raise GradeError(f"{ex}: {case}: wrong at ({r}, {c}): got {o[r, c]:.6g}, expected "
                             f"{ref[r, c]:.6g}: {hint}")
    speedup, fused_us, pair_us = _fusion_speedup(k)
    if speedup < min_speedup:
        raise GradeError(f"{ex}: correct, but not measurably fused: on 4096 x 4096 it takes "
                         f"{fused_us:.0f} us against {pair_us:.0f} us for the unfused pair (x + b, "
                         f"then GELU): {speedup:.2f}x, the goal is {min_speedup}x. One read of x "
                         "and one write of y per element, z in a register, float (not double) "
                         "arithmetic")
    passed(ex)


_GELU_TANH = "0.5f * z * (1.0f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)))"


def _fusion_speedup(kern, M: int = 4096, N: int = 4096,
                    quiet: bool = True) -> tuple[float, float, float]:
    """(speedup, fused us, unfused-pair us): ex03.6's kernel against CuPy's ``x + b`` followed by
    the same tanh GELU as a second kernel (16 bytes an element against 8), same run."""
    import cupy

    from ..bench import bench

    x = cupy.random.standard_normal((M, N), dtype=cupy.float32)
    b = cupy.random.standard_normal(N, dtype=cupy.float32)
    y = cupy.empty_like(x)
    z = cupy.empty_like(x)
    gelu = cupy.ElementwiseKernel("float32 z", "float32 y", f"y = {_GELU_TANH}",
                                  "cudabook_gelu_tanh")

    def pair():
        cupy.add(x, b, out=z)
        gelu(z, y)

    n = M * N
    t = bench({"fused (yours)": lambda: kern((ceil_div(n, 256),), (256,),
                                             (x, b, y, np.int32(M), np.int32(N)))},
              baseline={"unfused pair": pair}, bytes=8.0 * n, repeat=10, quiet=quiet)
    fused, base = t["fused (yours)"], t["unfused pair"]
    return fused.ratio, fused.time_us, base.time_us


def fusion_speed(src: str) -> float:
    """Print ex03.6's kernel against the unfused pair; return the speedup."""
    speedup, fused_us, pair_us = _fusion_speedup(_compile("ex03.6", src, "bias_gelu"))
    print(f"bias_gelu (fused, yours): {fused_us:.0f} us; x + b then GELU (two kernels): "
          f"{pair_us:.0f} us; speedup {speedup:.2f}x (the grader asks for at least "
          f"{FUSION_MIN_SPEEDUP}x)")
    return speedup


def ex03_7(interleaved_s4, interleaved_s32, sequential_s64, sequential_s16) -> None:
    """A 256-thread block (8 warps) reduces in shared memory. Interleaved addressing: at stride s
    thread t works if ``t % (2 s) == 0``; sequential: if ``t < s``. Divergent warps (some lanes
    work, some do not) at the given levels."""
    lanes = "count warps whose 32 lanes disagree: a warp with no working lane does not diverge"
    check_numbers("ex03.7", {"interleaved_s4": interleaved_s4,
                             "interleaved_s32": interleaved_s32,
                             "sequential_s64": sequential_s64, "sequential_s16": sequential_s16},
                  {"interleaved_s4": 8, "interleaved_s32": 4, "sequential_s64": 0,
                   "sequential_s16": 1},
                  wrong={"interleaved_s4": {1: "32 threads work, but one in 8 lanes of every "
                                                "warp, not one whole warp",
                                            0: "one in 8 lanes of each warp works"},
                         "interleaved_s32": {8: "threads 64 apart: every other warp has no "
                                                 "working lane at all, and does not diverge",
                                             0: "one lane of warps 0, 2, 4, 6 works, the other "
                                                "31 do not"},
                         "sequential_s64": {2: "warps 0 and 1 work with all 32 lanes: they do "
                                                "not diverge"},
                         "sequential_s16": {0: "16 < 32: half of warp 0 works",
                                            0.5: "a warp diverges or not: count whole warps"}},
                  nudge={"interleaved_s4": lanes, "interleaved_s32": lanes,
                         "sequential_s64": lanes, "sequential_s16": lanes})
    passed("ex03.7")


def ex03_8(first_partials, launches) -> None:
    """``sum_all`` of ex03.1 (TPB = 128) on n = 1,000,000: the partial sums the first launch
    writes, and the number of launches until one value is left."""
    check_numbers("ex03.8", {"first_partials": first_partials, "launches": launches},
                  {"first_partials": 7813, "launches": 3},
                  wrong={"first_partials": {7812: "round up: the last block has the last 64 "
                                                  "elements"},
                         "launches": {2: "the second launch leaves ceil(7813 / 128) = 62 "
                                         "partial sums, not one",
                                      4: "62 partial sums fit in one block of 128: that launch "
                                         "is the last"}},
                  nudge={"first_partials": "one partial sum per block: ceil(n / 128)",
                         "launches": "repeat n -> ceil(n / 128) until n is 1"})
    passed("ex03.8")


def ex03_9(bytes_v2, bytes_v4, bytes_v5, speedup_v5_v2) -> None:
    """Global-memory bytes per float32 element of x, every read going to DRAM: softmax_v2 (max
    pass, sum pass, write pass), softmax_v4 (online max-and-sum pass, write pass), softmax_v5 (the
    row in registers); and the time of v2 over v5 when both run at the same bandwidth."""
    count = "4 bytes for every read of x and 4 for the write of y"
    check_numbers("ex03.9", {"bytes_v2": bytes_v2, "bytes_v4": bytes_v4, "bytes_v5": bytes_v5,
                             "speedup_v5_v2": speedup_v5_v2},
                  {"bytes_v2": 16, "bytes_v4": 12, "bytes_v5": 8, "speedup_v5_v2": 2.0},
                  wrong={"bytes_v2": {12: "the write of y counts too: three reads of x and one "
                                          "write",
                                      3: "in bytes: a float32 is 4 of them"},
                         "bytes_v4": {16: "the online pass finds the max and the sum together: "
                                          "x is read twice, not three times",
                                      8: "the write pass reads x again to compute exp(x - m)"},
                         "bytes_v5": {4: "y is still written: 4 bytes read and 4 written",
                                      0: "x must be read once and y written once"},
                         "speedup_v5_v2": {1.5: "that is v2 over v4 (16 / 12); v5 moves 8 bytes",
                                           3.0: "count the write in both: 16 / 8",
                                           0.5: "the time of v2 over the time of v5: v5 is the "
                                                "faster"}},
                  nudge={"bytes_v2": count, "bytes_v4": count, "bytes_v5": count,
                         "speedup_v5_v2": "at the same bandwidth, time is proportional to bytes"})
    passed("ex03.9")
