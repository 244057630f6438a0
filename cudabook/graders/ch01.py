"""Graders of Chapter 1, "Your first kernel".

ex01_1  Numba: SAXPY kernel and its launcher (launch configuration, bounds guard)   simulator
ex01_2  CUDA C++ via CuPy: ReLU forward                                              GPU
ex01_3  Numba: add a bias to every row of a matrix (2D grid, row/column strides)     simulator
ex01_4  CUDA C++ via CuPy: SGD update with a grid-stride loop                        GPU
ex01_5  pencil and paper: blocks and idle threads of a launch                        CPU
ex01_6  pencil and paper: which warps diverge on a branch                            CPU
ex01_7  pencil and paper: a 2D grid, and the pixel one thread handles                CPU
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import env
from ..check import close, to_numpy
from ._core import (
    CANARY,
    ELEMENTWISE_TOL,
    GradeError,
    call,
    ceil_div,
    check_numbers,
    count_launches,
    diagnose_1d,
    fresh_rng,
    guarded,
    launched_kernels,
    need_gpu,
    need_launch,
    passed,
    poisoned_memory,
    ragged_sizes,
    to_device,
)
from ._core import compile_kernel as _compile
from ._race import explain, first_launch
from ._static import refuse_host_code

__all__ = ["ex01_1", "ex01_2", "ex01_3", "ex01_4", "ex01_5", "ex01_6"]


def ex01_1(launch_saxpy: Callable) -> None:
    """``launch_saxpy(a, x, y, out)`` computes out = a*x + y for float32 vectors of any length.

    Checked on ragged lengths (1, 255, 256, 257, 775, 1000, and 1<<20 + 3 on a GPU or 2051 in
    the simulator: more than one block of 1024) with a fresh seed, NaN-prefilled outputs
    followed by a NaN canary, and called twice per length with different data (an answer cached
    from the first call fails). It must launch a kernel: an array expression is refused.
    """
    ex = "ex01.1"
    rng, seed = fresh_rng()
    with poisoned_memory(), launched_kernels() as kernels:
        _saxpy_cases(ex, launch_saxpy, rng, seed, kernels)
    passed(ex)


def _saxpy_cases(ex: str, launch_saxpy: Callable, rng, seed: int, kernels: list) -> None:
    checked: set[int] = set()
    for n in ragged_sizes(256, big=(1 << 20) + 3):
        for rep in range(2):
            a = np.float32(rng.uniform(-2, 2))
            x = rng.standard_normal(n, dtype=np.float32)
            y = rng.standard_normal(n, dtype=np.float32)
            out, buf = guarded(n)
            case = f"n={n} (seed {seed}, call {rep + 1})"
            try:
                with count_launches() as launches:
                    call(ex, case, lambda: launch_saxpy(a, to_device(x), to_device(y), out))
                ref = np.float64(a) * x.astype(np.float64) + y
                diagnose_1d(ex, case, out, ref, buf, hint="is it a*x[i] + y[i]?")
            except GradeError as e:
                # the launch the answer makes for this n, traced: who wrote what (failures only)
                got = first_launch(lambda: launch_saxpy(a, to_device(x), to_device(y),
                                                        guarded(n)[0]))
                if got is None:
                    raise
                kernel, grid, block, shared, args = got
                # host-only code (NumPy arithmetic on whole arrays) is named from the source: a
                # trace would run the whole array in every simulated thread, n^2 steps
                refuse_host_code(ex, kernel, args)
                raise GradeError(explain(ex, case, str(e), kernel, grid, block, *args,
                                         shared=shared)) from None
            need_launch(ex, case, launches[0], "the @cuda.jit kernel saxpy, launched as "
                        "saxpy[blocks, threads](a, x, y, out)")
            # the kernels it launched, once each: GPU code, not NumPy run by every thread
            for kernel, args in kernels:
                if id(kernel) not in checked:
                    checked.add(id(kernel))
                    refuse_host_code(ex, kernel, args)


def ex01_2(src: str) -> None:
    """``src`` defines ``extern "C" __global__ void relu_forward(const float* x, float* y, int n)``.

    Launched with 256 threads per block and ceil(n / 256) blocks on ragged lengths; the output
    is NaN-prefilled and followed by a canary, so a missing bounds guard is caught.
    """
    ex = "ex01.2"
    need_gpu(ex)
    import cupy

    k = _compile(ex, src, "relu_forward")
    rng, seed = fresh_rng()
    sizes = ragged_sizes(256, big=(1 << 22) + 1)
    # n = 1 last: there a guard one short writes nothing at all, which looks like the stub
    for n in sizes[1:] + sizes[:1]:
        x = rng.standard_normal(n, dtype=np.float32)
        x[rng.random(n) < 0.05] = 0.0
        out, buf = guarded(n)
        case = f"n={n} (seed {seed})"
        call(ex, case, lambda: k((ceil_div(n, 256),), (256,), (cupy.asarray(x), out,
                                                               cupy.int32(n))))
        diagnose_1d(ex, case, out, np.maximum(x, 0), buf, atol=0, rtol=0,
                    hint="ReLU keeps x where x > 0 and writes 0 elsewhere")
    passed(ex)


def ex01_3(add_row_bias) -> None:
    """``add_row_bias`` is a @cuda.jit kernel: out[r, c] = x[r, c] + b[c] for x of shape (M, N).

    The grader launches it with 16x16 blocks and grid (ceil(N/16), ceil(M/16)): the x index of
    the grid walks columns (``col, row = cuda.grid(2)``), so neighbouring threads touch
    neighbouring addresses. Shapes are ragged and never square.
    """
    ex = "ex01.3"
    rng, seed = fresh_rng()
    with poisoned_memory():
        _row_bias_cases(ex, add_row_bias, rng, seed)
    passed(ex)


def _row_bias_cases(ex: str, add_row_bias, rng, seed: int) -> None:
    shapes = [(1, 1), (3, 17), (17, 3), (33, 65)] + ([(1000, 777), (129, 4099)]
                                                     if not env.SIM else [])
    for m, n in shapes:
        x = rng.standard_normal((m, n), dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32)
        case = f"M={m}, N={n} (seed {seed})"
        grid, block = (ceil_div(n, 16), ceil_div(m, 16)), (16, 16)
        refuse_host_code(ex, add_row_bias, (x, b, x))
        try:
            _row_bias_case(ex, case, add_row_bias, grid, block, x, b)
        except GradeError as e:   # explained by a trace of the same launch (failures only)
            raise GradeError(explain(ex, case, str(e), add_row_bias, grid, block, x, b,
                                     np.full((m, n), np.nan, np.float32))) from None


def _row_bias_case(ex: str, case: str, add_row_bias, grid, block, x: np.ndarray,
                   b: np.ndarray) -> None:
    m, n = x.shape
    out, buf = guarded((m, n))
    call(ex, case, lambda: add_row_bias[grid, block](to_device(x), to_device(b), out))
    o = to_numpy(out).astype(np.float64)
    ref = x.astype(np.float64) + b[None, :]
    if not np.isnan(to_numpy(buf[m * n:])).all():
        raise GradeError(f"{ex}: {case}: wrote past the end of the output: missing bounds "
                         "guard on row or column?")
    if np.isnan(o).all():
        raise GradeError(f"{ex}: {case}: output never written (all NaN): is the kernel body "
                         "still the stub (on a GPU a raise inside a kernel does nothing), or "
                         "was it launched with no threads?")
    if np.isnan(o).any():
        rows, cols = np.nonzero(np.isnan(o))
        hint = ("are row and col swapped? The grid's x index walks columns: "
                "col, row = cuda.grid(2)" if m != n else "wrong index?")
        raise GradeError(f"{ex}: {case}: {rows.size} elements never written, first at "
                         f"({rows[0]}, {cols[0]}): {hint}")
    bad = ~close(o, ref, *ELEMENTWISE_TOL)
    if bad.any():
        r, c = (int(v[0]) for v in np.nonzero(bad))
        hint = ""
        if r < n and close(o[r, c], np.float64(x[r, c]) + b[r], *ELEMENTWISE_TOL):
            hint = ": the bias is indexed by row; it belongs to the column (b[col])"
        raise GradeError(f"{ex}: {case}: wrong at ({r}, {c}): got {o[r, c]:.6g}, expected "
                         f"{ref[r, c]:.6g}{hint}")


def ex01_4(src: str) -> None:
    """``src`` defines ``sgd_update(float* w, const float* g, float lr, int n)``: w -= lr * g.

    It must use a grid-stride loop: the grader launches it with a grid far smaller than n (every
    element must still be updated exactly once) and with a grid far larger (the extra threads
    must do nothing). The update is in place, so an element updated twice is also caught.
    """
    ex = "ex01.4"
    need_gpu(ex)
    import cupy

    k = _compile(ex, src, "sgd_update")
    rng, seed = fresh_rng()
    sentinel = np.float32(12345.0)
    for n in [1, 127, 128, 129, 5000, (1 << 20) + 7]:
        for grid, block in [(3, 128), (max(1, n // 128 + 64), 128)]:
            w0 = rng.standard_normal(n, dtype=np.float32)
            g = rng.standard_normal(n, dtype=np.float32)
            lr = np.float32(rng.uniform(0.01, 0.5))
            wbuf = cupy.full(n + CANARY, sentinel, dtype=cupy.float32)
            gbuf = cupy.full(n + CANARY, 1.0, dtype=cupy.float32)
            wbuf[:n] = cupy.asarray(w0)
            gbuf[:n] = cupy.asarray(g)
            case = f"n={n}, grid={grid}x{block} (seed {seed})"
            call(ex, case, lambda: k((grid,), (block,), (wbuf, gbuf, lr, cupy.int32(n))))
            w = to_numpy(wbuf[:n]).astype(np.float64)
            if not (to_numpy(wbuf[n:]) == sentinel).all():
                raise GradeError(f"{ex}: {case}: wrote past the end of w: the loop must stop "
                                 "at i < n")
            ref = w0.astype(np.float64) - np.float64(lr) * g
            once = close(w, ref, *ELEMENTWISE_TOL)
            if once.all():
                continue
            untouched = w == w0
            twice = close(w, ref - np.float64(lr) * g, 1e-4, 1e-4)
            first = int(np.argmax(~once))
            if untouched[~once].all():
                raise GradeError(f"{ex}: {case}: elements from {first} on never updated: with "
                                 "a small grid each thread must loop, i += blockDim.x * "
                                 "gridDim.x (a grid-stride loop)")
            if (twice | once).all():
                raise GradeError(f"{ex}: {case}: some elements updated more than once, first at "
                                 f"{first}: the stride must be blockDim.x * gridDim.x, the "
                                 "threads of the whole grid")
            raise GradeError(f"{ex}: {case}: wrong at {first}: got {w[first]:.6g}, expected "
                             f"{ref[first]:.6g} (w[i] -= lr * g[i])")
    passed(ex)


def ex01_5(blocks, idle_threads) -> None:
    """n = 1000 elements, 256 threads per block, the grid rounded up: how many blocks, and how
    many of the launched threads fail the guard ``i < n`` (do nothing)?"""
    check_numbers("ex01.5", {"blocks": blocks, "idle_threads": idle_threads},
                  {"blocks": 4, "idle_threads": 24},
                  wrong={"blocks": {3: "1000 // 256 = 3 blocks cover only 768 elements: round "
                                       "up, (n + 255) // 256"},
                         "idle_threads": {232: "232 is what 3 blocks would leave uncovered; count "
                                               "the threads of the rounded-up grid past n",
                                          0: "the grid is rounded up to whole blocks: the last "
                                             "block has threads past n"}},
                  nudge={"blocks": "blocks = ceil(n / threads)",
                         "idle_threads": "launched threads minus n"})
    passed("ex01.5")


def ex01_6(div_even_odd, div_below_100) -> None:
    """A block of 256 threads (8 warps) branches on ``threadIdx.x % 2 == 0`` or on
    ``threadIdx.x < 100``: how many warps hold lanes on both sides of the branch (diverge)?"""
    check_numbers("ex01.6", {"div_even_odd": div_even_odd, "div_below_100": div_below_100},
                  {"div_even_odd": 8, "div_below_100": 1},
                  wrong={"div_even_odd": {4: "half the threads take each side, but in every "
                                             "warp: a warp diverges when its own 32 lanes "
                                             "disagree",
                                          0: "lanes 0 and 1 of each warp disagree"},
                         "div_below_100": {0: "100 is not a multiple of 32: which warp holds "
                                              "threads 96..127?",
                                           3: "warps whose 32 lanes all pass the test do not "
                                              "diverge",
                                           4: "warps whose 32 lanes all pass (or all fail) the "
                                              "test do not diverge",
                                           5: "warps whose 32 lanes all fail the test do not "
                                              "diverge"}},
                  nudge={"div_even_odd": "a warp is lanes 32w .. 32w + 31: do they agree?",
                         "div_below_100": "a warp is lanes 32w .. 32w + 31: do they agree?"})
    passed("ex01.6")


def ex01_7(grid_x, grid_y, row, col) -> None:
    """An image of 1000 rows x 1500 columns, blocks of (32, 8) threads, x walking columns and y
    rows, the grid rounded up: the grid's x and y sizes, and the row and column of thread
    (x=5, y=3) in block (x=2, y=4)."""
    check_numbers("ex01.7", {"grid_x": grid_x, "grid_y": grid_y, "row": row, "col": col},
                  {"grid_x": 47, "grid_y": 125, "row": 35, "col": 69},
                  wrong={"grid_x": {46: "1500 / 32 = 46.9: round up, or the last 28 columns "
                                        "get no thread",
                                    32: "x walks the columns: 1500 of them, 32 per block"},
                         "grid_y": {188: "y walks the rows: 1000 of them, 8 per block",
                                    32: "a block is 8 threads tall, not 32"},
                         "row": {69: "the row comes from the y indices: blockIdx.y * "
                                     "blockDim.y + threadIdx.y",
                                 19: "the row uses the block's y index (4), not its x (2)",
                                 131: "blockDim.y is 8, not 32"},
                         "col": {35: "the column comes from the x indices: blockIdx.x * "
                                     "blockDim.x + threadIdx.x",
                                 133: "the column uses the block's x index (2), not its y (4)",
                                 21: "blockDim.x is 32, not 8"}},
                  nudge={"grid_x": "columns / blockDim.x, rounded up",
                         "grid_y": "rows / blockDim.y, rounded up",
                         "row": "blockIdx.y * blockDim.y + threadIdx.y",
                         "col": "blockIdx.x * blockDim.x + threadIdx.x"})
    passed("ex01.7")
