"""Graders of Chapter 2, "Memory".

ex02_1  CUDA C++ via CuPy: coalesced, bank-conflict-free tiled transpose            GPU
ex02_2  CUDA C++ via CuPy: vectorised (float4) a*x + y with head, tail, grid-stride  GPU
ex02_3  CuPy streams: chunked copy-in / compute / copy-out pipeline                  GPU
ex02_4  Numba: moving average (radius 2) through a shared-memory tile with halo      simulator
ex02_5  pencil and paper: 32-byte sectors a warp touches at a stride                CPU
ex02_6  pencil and paper: bank-conflict degree of a padded shared tile              CPU
ex02_7  pencil and paper: Little's law, bytes and threads in flight per SM          CPU
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

import numpy as np

from ..check import close, to_numpy
from ._core import (
    CANARY,
    ELEMENTWISE_TOL,
    GradeError,
    call,
    canary_ok,
    ceil_div,
    check_numbers,
    error_summary,
    fresh_rng,
    guarded,
    need_gpu,
    passed,
    poisoned_memory,
    ragged_sizes,
    sync,
    to_device,
)
from ._core import compile_kernel as _compile
from ._race import explain, racecheck, simulate
from ._static import calls, cuda_code, mentions, python_code, refuse_host_code

__all__ = ["ex02_1", "ex02_2", "ex02_3", "ex02_4", "ex02_5", "ex02_6", "axpy_speed",
           "pipeline_times"]

#: ex02.1 fails when the student's transpose takes longer than this times the book's padded
#: tiled transpose (kernels/transpose.cu, transpose_v3) on a 4096 x 4096 matrix.
TRANSPOSE_SLOWDOWN = 1.3


def _need_gpu(ex: str) -> None:
    need_gpu(ex, "CUDA C++ and streams run through CuPy")


# ----------------------------------------------------------------------------- ex02.1
_TILE_SYNC_HINT = ("put __syncthreads() between writing the shared tile and reading it, so no "
                   "warp reads an element another warp has not written yet")


def _race_ex02_1(k) -> None:
    """racecheck driver: ragged shapes, several tiles each, block (32, 8)."""
    import cupy

    for rows, cols in ((33, 70), (64, 40)):
        x = cupy.random.standard_normal((rows, cols), dtype=cupy.float32)
        out = cupy.empty((cols, rows), cupy.float32)
        k((ceil_div(cols, 32), ceil_div(rows, 32)), (32, 8), (x, out, cupy.int32(rows),
                                                              cupy.int32(cols)))


def _transpose_diagnose(ex: str, case: str, out, buf, x: np.ndarray) -> str | None:
    """None if right, else the message."""
    rows, cols = x.shape
    n = rows * cols
    o = to_numpy(out).astype(np.float64).ravel()
    ref = x.T.astype(np.float64).ravel()
    if np.array_equal(o, ref):
        return None if canary_ok(buf, n) else (
            f"{ex}: {case}: wrote past the end of the output: missing bounds guard (a tile at "
            "the edge of the matrix is only partly inside it)?")
    # the transposed element (c, r) written at c * cols + r instead of c * rows + r
    if rows != cols:
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        wrong = (c * cols + r).ravel()
        # positions where the wrong stride lands inside out and differs from the right place
        inside = (wrong < n) & (wrong != (c * rows + r).ravel())
        if inside.sum() >= 8 and np.mean(o[wrong[inside]] == x.ravel()[inside]) > 0.9:
            return (f"{ex}: {case}: the output is written with the wrong stride: out has shape "
                    f"(cols, rows) = ({cols}, {rows}), so element (c, r) lives at "
                    "out[c * rows + r], not out[c * cols + r]")
        if np.mean(o == x.ravel()) > 0.9:
            return (f"{ex}: {case}: the output equals the input in memory: copied without "
                    "transposing (swap the roles of row and column when writing)?")
    if not canary_ok(buf, n):
        return (f"{ex}: {case}: wrote past the end of the output: missing bounds guard, or a "
                "wrong stride (out has shape (cols, rows) and row stride rows)?")
    nan = np.isnan(o)
    if nan.all():
        return (f"{ex}: {case}: output never written (all NaN): is the kernel body still the "
                "stub?")
    if nan.any():
        k = int(np.argmax(nan))
        return (f"{ex}: {case}: {int(nan.sum())} elements never written, first at out"
                f"[{k // rows}, {k % rows}]: a tile at the right or bottom edge skipped, or a "
                "wrong guard (guard the write with the swapped indices)?")
    bad = o != ref
    k = int(np.argmax(bad))
    return (f"{ex}: {case}: {int(bad.sum())} of {n} elements wrong, first at out[{k // rows}, "
            f"{k % rows}]: got {o[k]:.6g}, expected {ref[k]:.6g}")


def ex02_1(src: str) -> None:
    """``src`` defines ``extern "C" __global__ void transpose_tiled(const float* in, float* out,
    int rows, int cols)``: out (cols x rows) = in (rows x cols) transposed, row-major.

    Launched with block (32, 8) and grid (ceil(cols / 32), ceil(rows / 32)) on ragged, non-square
    shapes; large shapes run several times with fresh data (a race on the shared tile shows up
    as results that change between runs); then timed against the book's padded tiled transpose
    (an uncoalesced or bank-conflicted version is too slow).
    """
    ex = "ex02.1"
    _need_gpu(ex)
    import cupy

    k = _compile(ex, src, "transpose_tiled")
    code = cuda_code(src)
    uses_tile = mentions(code, "__shared__")
    has_sync = calls(code, "__syncthreads") > 0
    rng, seed = fresh_rng()
    shapes = [(1, 1), (1, 33), (33, 1), (31, 33), (32, 32), (33, 31), (100, 37), (64, 96),
              (1000, 777), (2049, 4099)]
    for rows, cols in shapes:
        reps = 4 if rows * cols > 100_000 else 1
        for rep in range(reps):
            x = rng.standard_normal((rows, cols), dtype=np.float32)
            out, buf = guarded((cols, rows))
            case = f"rows={rows}, cols={cols} (seed {seed}, run {rep + 1})"
            grid = (ceil_div(cols, 32), ceil_div(rows, 32))
            xd = cupy.asarray(x)
            call(ex, case, lambda: k(grid, (32, 8), (xd, out, cupy.int32(rows),
                                                     cupy.int32(cols))))
            msg = _transpose_diagnose(ex, case, out, buf, x)
            if msg is None:
                continue
            if uses_tile and "past the end" not in msg:
                # wrong values from a tile read before it was filled look like other mistakes:
                # racecheck names the race (failures only; a clean run changes nothing)
                try:
                    racecheck(ex, src, "transpose_tiled", "cudabook.graders.ch02:_race_ex02_1",
                              hint=_TILE_SYNC_HINT)
                except GradeError as race:
                    # "... compute-sanitizer racecheck found ..." (or synccheck, initcheck)
                    why = str(race).split("compute-sanitizer ", 1)[-1]
                    raise GradeError(f"{msg}; compute-sanitizer {why}") from None
            racy = uses_tile and not has_sync
            if ("elements wrong" in msg and rep > 0) or (racy and "past the end" not in msg):
                msg += ("; the same shape passed before with other data" if rep > 0 else "")
                msg += (": a race on the shared tile? Results that change from run to run "
                        "mean a warp read the tile before the others wrote it: "
                        + _TILE_SYNC_HINT)
            raise GradeError(msg)
    if uses_tile and not has_sync:
        raise GradeError(f"{ex}: the kernel fills a __shared__ tile and reads it back without "
                         "__syncthreads(): a race (a warp may read elements another warp has "
                         "not written yet), even if it happened to pass this time")
    if uses_tile:
        racecheck(ex, src, "transpose_tiled", "cudabook.graders.ch02:_race_ex02_1",
                  hint=_TILE_SYNC_HINT)
    # rubric: coalesced both ways and conflict-free -> as fast as the book's padded version
    from ..bench import bench
    from ..compile import load_cuda

    refk = load_cuda("transpose").get("transpose_v3")
    m = 4096
    xd = cupy.asarray(rng.standard_normal((m, m), dtype=np.float32))
    od = cupy.empty_like(xd)
    args = (xd, od, cupy.int32(m), cupy.int32(m))
    g = (m // 32, m // 32)
    t = bench({"yours": lambda: k(g, (32, 8), args)},
              baseline={"transpose_v3": lambda: refk(g, (32, 8), args)}, bytes=8 * m * m,
              repeat=15, quiet=True)
    t_ref, t_you = t["transpose_v3"].time_us, t["yours"].time_us
    if t_you > TRANSPOSE_SLOWDOWN * t_ref:
        raise GradeError(f"{ex}: correct, but {t_you:.0f} us for 4096 x 4096 against "
                         f"{t_ref:.0f} us for the padded tiled transpose ({t_you / t_ref:.2f}x, "
                         f"limit {TRANSPOSE_SLOWDOWN}x): uncoalesced writes (go through a "
                         "shared tile) or bank conflicts (pad the tile to [32][33])?")
    passed(ex)


# ----------------------------------------------------------------------------- ex02.2
def _axpy_cases(ex: str, k, cases, seed: int) -> str | None:
    """Run ``k`` on (n, offset, grid) cases; return the first error message, or None."""
    import cupy

    rng = np.random.default_rng(seed)
    for n, off, grid in cases:
        a = np.float32(rng.uniform(-2, 2))
        x = rng.standard_normal(n, dtype=np.float32)
        y = rng.standard_normal(n, dtype=np.float32)
        # x, y and out all start `off` floats after a 256-byte aligned allocation
        # finite values after x and y: a float4 that runs past n writes numbers into the canary
        xb = cupy.full(off + n + 8, 1.0, dtype=cupy.float32)
        yb = cupy.full(off + n + 8, 1.0, dtype=cupy.float32)
        xb[off:off + n] = cupy.asarray(x)
        yb[off:off + n] = cupy.asarray(y)
        ob = cupy.full(off + n + CANARY, np.nan, dtype=cupy.float32)
        xd, yd, od = xb[off:off + n], yb[off:off + n], ob[off:off + n]
        case = f"n={n}, offset={off} floats ({4 * off} bytes past a 16-byte boundary), " \
               f"grid={grid}x256 (seed {seed})"
        try:
            k((grid,), (256,), (xd, yd, od, a, cupy.int32(n)))
            cupy.cuda.get_current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            s = str(e)
            if "misaligned" in s.lower():
                return (f"{ex}: {case}: misaligned address: a float4 access needs a 16-byte "
                        "aligned address; do the first (16 - address % 16) / 4 elements one at a "
                        "time (the head), then float4 from there")
            return f"{ex}: {case}: raised {type(e).__name__}: {s.splitlines()[0] if s else ''}"
        o = to_numpy(od).astype(np.float64)
        ref = np.float64(a) * x + y
        head = off and (4 - off % 4) % 4
        pre = to_numpy(ob[:off])
        if off and not np.isnan(pre).all():
            return (f"{ex}: {case}: wrote before the start of out: the head must start at "
                    "element 0 of the view, not at the aligned address below it")
        if not np.isnan(to_numpy(ob[off + n:])).all():
            return (f"{ex}: {case}: wrote past the end of out: the tail (the last elements after "
                    "the last whole float4) must be done one element at a time, with i < n")
        nan = np.isnan(o)
        if nan.all() and n >= 8:
            return f"{ex}: {case}: output never written (all NaN): still the stub?"
        if nan.any():
            idx = np.flatnonzero(nan)
            if off and idx[-1] < min(head, n):
                return (f"{ex}: {case}: the first {len(idx)} elements (the head, before the "
                        "first 16-byte boundary) never written: handle the head one element "
                        "at a time")
            body = n - min(head, n)
            if idx[0] >= n - (body % 4) and len(idx) <= 3:
                return (f"{ex}: {case}: the last {len(idx)} elements never written: missing "
                        "tail (n - head is not a multiple of 4; do the remainder one element "
                        "at a time)")
            return (f"{ex}: {case}: {len(idx)} elements never written, first at {idx[0]}: with "
                    f"a small grid every thread must loop (a grid-stride loop, i += blockDim.x "
                    "* gridDim.x)")
        bad = ~close(o, ref, *ELEMENTWISE_TOL)
        if bad.any():
            i = int(np.argmax(bad))
            return (f"{ex}: {case}: wrong at {i}: got {o[i]:.6g}, expected {ref[i]:.6g} "
                    f"({int(bad.sum())} of {n} wrong): out = a * x + y, elementwise")
    return None


def _axpy_worker(src_path: str, seed: int) -> None:
    """Subprocess entry: the misaligned cases (a misaligned float4 access kills the CUDA
    context of the process that makes it, so it must not be the notebook's)."""
    src = open(src_path).read()
    k = _compile("ex02.2", src, "axpy_vec")
    cases = [(n, off, g) for off in (1, 2, 3) for n, g in
             [(1, 1), (2, 1), (3, 1), (5, 1), (6, 1), (7, 1), (1023, 2), (1025, 300),
              ((1 << 20) + 1, 1024)]]   # n < 8: only a head and a tail, or no whole vector
    msg = _axpy_cases("ex02.2", k, cases, seed)
    print(json.dumps({"error": msg}))


def ex02_2(src: str) -> None:
    """``src`` defines ``extern "C" __global__ void axpy_vec(const float* x, const float* y,
    float* out, float a, int n)``: out = a * x + y with float4 loads and stores.

    Launched with 256 threads per block and grids both small (threads must loop) and large, on
    lengths that are not multiples of 4, then on views that start 4, 8 or 12 bytes past a
    16-byte boundary (x, y and out share the offset). The misaligned cases run in a separate
    process, because a misaligned float4 access ends the CUDA context that makes it.
    """
    ex = "ex02.2"
    _need_gpu(ex)
    code = cuda_code(src)
    if not mentions(code, "float4"):
        raise GradeError(f"{ex}: the kernel must move data as float4 (16-byte) vectors; no "
                         "float4 in the source")
    k = _compile(ex, src, "axpy_vec")
    rng, seed = fresh_rng()
    for rep in range(2):   # twice, with different data: an answer cached from a warm-up fails
        cases = [(n, 0, g) for n, g in [(4099, 64), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1),
                                        (6, 1), (7, 1), (9, 1), (255, 1), (1023, 1), (1025, 2),
                                        (4099, 5),
                                        ((1 << 20) + 3, 1024), ((1 << 22) + 2, 8)]]
        msg = _axpy_cases(ex, k, cases, seed + rep)
        if msg:
            raise GradeError(msg)
    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
        f.write(src)
        path = f.name
    try:
        pyexe = sys.executable
        r = subprocess.run([pyexe, "-c", "import sys; from cudabook.graders.ch02 import "
                            "_axpy_worker; _axpy_worker(sys.argv[1], int(sys.argv[2]))",
                            path, str(seed)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [p for p in sys.path if p])})
    finally:
        os.unlink(path)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        if "misaligned" in r.stderr.lower():
            tail = ("misaligned address: a float4 access needs a 16-byte aligned address; do "
                    "the first elements one at a time up to the boundary")
        raise GradeError(f"{ex}: misaligned views (offset 1..3 floats): {tail}")
    msg = json.loads(lines[-1])["error"]
    if msg:
        raise GradeError(msg)
    ratio, yours, base = _axpy_ratio(k)
    if ratio < AXPY_MIN_RATIO:
        raise GradeError(f"{ex}: correct, but on 2^25 floats it moves {yours:.0f} GB/s, "
                         f"{ratio:.2f}x CuPy's fused a * x + y ({base:.0f} GB/s); the goal is "
                         f"{AXPY_MIN_RATIO}x. Are the float4 loop's accesses coalesced (thread i "
                         "takes vector i, then i + stride)?")
    passed(ex)


#: ex02.2 on a GPU: at least this fraction of CuPy's fused ``a * x + y`` (GB/s, same run)
AXPY_MIN_RATIO = 0.8
AXPY_N = 1 << 25


def _axpy_ratio(kern, n: int = AXPY_N, quiet: bool = True) -> tuple[float, float, float]:
    """(ratio, your GB/s, CuPy's GB/s): ``axpy_vec`` against CuPy's fused elementwise
    ``a * x + y`` on ``n`` floats (12 bytes an element), timed in the same call."""
    import cupy

    from ..bench import bench

    x = cupy.random.standard_normal(n, dtype=cupy.float32)
    y = cupy.random.standard_normal(n, dtype=cupy.float32)
    out = cupy.empty_like(x)
    a = np.float32(1.5)
    ref = cupy.ElementwiseKernel("float32 a, float32 x, float32 y", "float32 o",
                                 "o = a * x + y", "cudabook_axpy_ref")
    grid = (ceil_div(n // 4, 256),)
    t = bench({"axpy_vec (yours)": lambda: kern(grid, (256,), (x, y, out, a, np.int32(n)))},
              baseline={"CuPy a * x + y": lambda: ref(a, x, y, out)}, bytes=12.0 * n,
              repeat=10, quiet=quiet)
    row, base = t["axpy_vec (yours)"], t["CuPy a * x + y"]
    return row.ratio, row.value, base.value


def axpy_speed(src: str) -> float:
    """Print ex02.2's kernel against CuPy's ``a * x + y`` in GB/s; return the ratio."""
    ratio, yours, base = _axpy_ratio(_compile("ex02.2", src, "axpy_vec"))
    print(f"axpy_vec: {yours:.0f} GB/s, CuPy's fused a * x + y: {base:.0f} GB/s, ratio "
          f"{ratio:.2f} (the grader asks for at least {AXPY_MIN_RATIO})")
    return ratio


# ----------------------------------------------------------------------------- ex02.3
def ex02_3(run_pipeline: Callable) -> None:
    """``run_pipeline(x_host, y_host, n_chunks, compute)`` fills the pinned host array y_host
    with compute(x) in n_chunks chunks, each copied in, computed and copied out on a stream.

    ``compute(x_dev, y_dev)`` is given by the grader (a kernel on the current CuPy stream,
    with fresh coefficients per call). Checked: the result, read as soon as run_pipeline
    returns (so it must synchronise); chunk sizes that cover all n elements when n_chunks
    does not divide n; that the chunks' kernels ran on at least two non-default streams. Before
    anything runs (so on a CPU too) the source is searched for calls that block the host inside
    the loop over chunks (a synchronize, cupy.asarray, .get() without a stream).
    """
    ex = "ex02.3"
    blocking = _blocking_in_loop(ex, run_pipeline)
    if blocking:
        raise GradeError(f"{ex}: a call that waits for the GPU inside the loop over chunks: "
                         + "; ".join(blocking[:3]) + ". The host then stops at every chunk "
                         "until the copies before it are done, so nothing overlaps. Queue "
                         "every chunk's copies (cupy.cuda.runtime.memcpyAsync on the chunk's "
                         "stream, from pinned memory) and its kernel inside the loop; wait for "
                         "the streams once, after the loop")
    _need_gpu(ex)
    import cupy
    import cupyx

    kern = cupy.RawKernel(r'''
extern "C" __global__ void affine(const float* x, float* y, int n, float a, float b) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = a * x[i] + b;
}''', "affine")
    rng, seed = fresh_rng()
    for n, chunks in [(1, 1), (10, 3), (1000, 1), (1000, 7), (4096, 4), ((1 << 20) + 3, 4),
                      ((1 << 22) + 5, 6), ((1 << 24) + 1, 8)]:
        for rep in range(2):
            a, b = (np.float32(v) for v in rng.uniform(-2, 2, 2))
            seen: list[tuple[int, int]] = []

            def compute(xd, yd, a=a, b=b, seen=seen):
                if xd.shape != yd.shape or xd.dtype != np.float32:
                    raise GradeError(f"{ex}: compute(x_dev, y_dev) needs two float32 device "
                                     "arrays of the same length")
                m = xd.size
                if m:
                    kern((min(ceil_div(m, 256), 1024),), (256,),
                         (xd, yd, np.int32(m), a, b))
                seen.append((cupy.cuda.get_current_stream().ptr, m))

            x_host = cupyx.empty_pinned(n, dtype=np.float32)
            x_host[:] = rng.standard_normal(n, dtype=np.float32)
            y_host = cupyx.empty_pinned(n, dtype=np.float32)
            y_host.fill(np.nan)
            case = f"n={n}, n_chunks={chunks} (seed {seed}, call {rep + 1})"
            try:
                run_pipeline(x_host, y_host, chunks, compute)
                last = float(y_host[-1])     # read at once: the grader does not synchronize
            except NotImplementedError:
                raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                                 "NotImplementedError)") from None
            except GradeError:
                raise
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0] if str(e) else ""
                raise GradeError(f"{ex}: {case}: raised {type(e).__name__}: {msg}") from None
            got = np.array(y_host, dtype=np.float64)
            got[-1] = last
            cupy.cuda.Device().synchronize()
            late = np.array(y_host, dtype=np.float64)
            ref = np.float64(a) * x_host + np.float64(b)
            sizes = [m for _, m in seen]
            if len(seen) != chunks or sum(sizes) != n:
                hint = ""
                if sum(sizes) < n:
                    hint = (f": {n - sum(sizes)} elements in no chunk; when n_chunks does not "
                            "divide n the chunks must still cover all of it (e.g. bounds "
                            "n * k // n_chunks)")
                raise GradeError(f"{ex}: {case}: compute ran {len(seen)} times on chunks of "
                                 f"sizes {sizes[:8]}{'...' if len(sizes) > 8 else ''}; expected "
                                 f"{chunks} chunks covering {n} elements{hint}")
            ok = close(got, ref, *ELEMENTWISE_TOL)
            if not ok.all():
                ok_late = close(late, ref, *ELEMENTWISE_TOL)
                i = int(np.argmax(~ok))
                if ok_late.all():
                    raise GradeError(f"{ex}: {case}: y_host was not ready when run_pipeline "
                                     "returned (it was right a moment later): synchronize the "
                                     "streams before returning")
                if np.isnan(late[i]):
                    raise GradeError(f"{ex}: {case}: y_host[{i}] never written: is every chunk "
                                     "copied back (device to host) into its own slice?")
                raise GradeError(f"{ex}: {case}: wrong at {i}: got {got[i]:.6g}, expected "
                                 f"{ref[i]:.6g}: is the chunk copied in before compute runs "
                                 "on it, on the same stream?")
            streams = {p for p, _ in seen}
            if chunks >= 2 and (len(streams - {0}) < 2):
                raise GradeError(f"{ex}: {case}: every chunk's kernel ran on "
                                 f"{'the default stream' if streams == {0} else 'one stream'}:"
                                 " nothing can overlap. Issue each chunk on its own stream "
                                 "(with stream: ...), cycling over two or more streams")
    t1, t8 = pipeline_times(run_pipeline)
    if t8 > PIPELINE_MAX_RATIO * t1:
        raise GradeError(f"{ex}: correct, but nothing overlaps: on 2^24 floats 8 chunks take "
                         f"{t8:.2f} ms and 1 chunk {t1:.2f} ms (ratio {t8 / t1:.2f}; the goal is "
                         f"at most {PIPELINE_MAX_RATIO}). Is there a synchronize (or a "
                         "synchronous copy such as cupy.asarray) inside the loop? Queue every "
                         "chunk's copies and kernel first, wait for the streams after the loop")
    passed(ex)


#: calls that make the host wait for the GPU (or copy synchronously), and why
_BLOCKING = {"synchronize": "waits for the GPU", "asarray": "a synchronous host-to-device copy",
             "array": "a synchronous host-to-device copy", "asnumpy": "a synchronous "
             "device-to-host copy", "get": "a synchronous device-to-host copy (no stream=)",
             "memcpy": "a synchronous copy (memcpyAsync takes a stream)",
             "deviceSynchronize": "waits for the whole GPU",
             "copy_to_host": "a synchronous device-to-host copy (no stream=)",
             "to_device": "a synchronous host-to-device copy (no stream=)"}


#: calls that queue a chunk's work: its copies in or out, or the computation itself
_CHUNK_WORK = frozenset({"compute", "memcpyAsync", "memcpy", "set", "get", "asarray", "array",
                         "copy_from_host_async", "copy_to_host_async", "copy_from_host",
                         "copy_to_host", "to_device", "copy_from_device_async"})


def _blocking_in_loop(ex: str, fn) -> list[str]:
    """The calls inside a ``for`` or ``while`` loop of ``fn`` that queues chunk work (a copy or
    ``compute``) and that block the host (each as ``"line N: what"``): a synchronize,
    cupy.asarray / cupy.array, .get() or .copy_to_host() without a stream, runtime.memcpy.
    Empty list: none, or the source cannot be read."""
    import ast

    try:
        tree = ast.parse(python_code(ex, fn))
    except (GradeError, SyntaxError):
        return []
    def called(n) -> str:
        return n.func.attr if isinstance(n.func, ast.Attribute) else (
            n.func.id if isinstance(n.func, ast.Name) else "")

    found: list[str] = []
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.While)):
            continue
        body = [m for st in loop.body for m in ast.walk(st)]
        # only a loop that queues chunk work (a copy or the computation) is the loop over
        # chunks: `for s in streams: s.synchronize()` after it is the one wait it should have
        if not any(isinstance(n, ast.Call) and called(n) in _CHUNK_WORK for n in body):
            continue
        for n in body:
            if not isinstance(n, ast.Call):
                continue
            name = called(n)
            if name not in _BLOCKING:
                continue
            if name in ("get", "copy_to_host", "to_device") and any(
                    k.arg == "stream" for k in n.keywords):
                continue
            if name == "get" and (n.args or not isinstance(n.func, ast.Attribute)):
                continue                  # dict.get(key): not a device array's .get()
            if name in ("asarray", "array") and not (
                    isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                    and n.func.value.id in ("cupy", "cp")):
                continue                  # np.asarray: no copy to the device
            item = f"line {n.lineno}: {ast.unparse(n.func)}() ({_BLOCKING[name]})"
            if item not in found:
                found.append(item)
    return found


#: ex02.3 on a GPU: 8 chunks must take at most this fraction of the time of 1 chunk
PIPELINE_MAX_RATIO = 0.85


def pipeline_times(run_pipeline: Callable, n: int = 1 << 24) -> tuple[float, float]:
    """(ms with 1 chunk, ms with 8 chunks) of ``run_pipeline`` on ``n`` pinned floats and a
    copy-dominated kernel (y = 2 x), best of 3 each. One chunk cannot overlap anything; with 8
    a pipeline overlaps copy-in, compute and copy-out of different chunks."""
    import time

    import cupy
    import cupyx

    double = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "cudabook_double")
    xh = cupyx.empty_pinned(n, dtype=np.float32)
    xh[:] = 1.0
    yh = cupyx.empty_pinned(n, dtype=np.float32)
    out = []
    for chunks in (1, 8):
        run_pipeline(xh, yh, chunks, lambda a, b: double(a, b))   # warm-up (pool, compile)
        ts = []
        for _ in range(3):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            run_pipeline(xh, yh, chunks, lambda a, b: double(a, b))
            ts.append(time.perf_counter() - t0)
        out.append(1e3 * min(ts))
    return out[0], out[1]


# ----------------------------------------------------------------------------- ex02.4
MA_BLOCK, MA_RADIUS = 64, 2      # threads per block, and the halo on each side

_MA_SYNC_HINT = ("cuda.syncthreads() between loading the tile (and its halo) and reading it, so "
                 "no thread reads a tile element before its owner has written it")


def ex02_4(moving_average) -> None:
    """``moving_average`` is a @cuda.jit kernel: out[i] = mean of x[i-2 .. i+2], zero outside
    the array, that stages x through a shared-memory tile of BLOCK + 2 R = 68 floats.

    Launched with 64 threads per block and ceil(n / 64) blocks on ragged lengths, twice with
    different data. In the simulator a missing cuda.syncthreads() shows up as values read from
    the tile before they were written.
    """
    ex = "ex02.4"
    rng, seed = fresh_rng()
    code = python_code(ex, moving_average)
    uses_tile = mentions(code, "shared.array")
    has_sync = calls(code, "syncthreads") > 0
    if "raise NotImplementedError" in code:
        # on a GPU a raise inside a kernel is not propagated: say it here
        raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                         "NotImplementedError)")
    x0 = np.zeros(2 * MA_BLOCK + 7, np.float32)
    refuse_host_code(ex, moving_average, (x0, x0))    # before running: a GPU may hang on it
    with poisoned_memory():
        _ma_cases(ex, moving_average, rng, seed, uses_tile, has_sync)
    if not uses_tile:
        raise GradeError(f"{ex}: the kernel must stage x through cuda.shared.array (the rubric "
                         "of this exercise); no shared array in its source")
    if not has_sync:
        n = 2 * MA_BLOCK + 7         # three blocks, traced: which thread reads whose element
        raise GradeError(explain(
            ex, f"n={n}", f"{ex}: the kernel reads the shared tile without cuda.syncthreads(): "
            "a race (a thread may read a tile element another thread has not written yet), "
            "even if it happened to pass this time", moving_average, ceil_div(n, MA_BLOCK),
            MA_BLOCK, rng.standard_normal(n, dtype=np.float32), np.full(n, np.nan, np.float32)))
    simulate(ex, "ex02_4", [("moving_average", moving_average)], hint=_MA_SYNC_HINT)
    passed(ex)


def _ma_cases(ex: str, moving_average, rng, seed: int, uses_tile: bool, has_sync: bool) -> None:
    sizes = ragged_sizes(MA_BLOCK, big=(1 << 20) + 5, sim_big=None)   # the grader launches
    for n in sizes:
        for rep in range(2):
            x = rng.standard_normal(n, dtype=np.float32)
            case = f"n={n} (seed {seed}, call {rep + 1})"
            grid = ceil_div(n, MA_BLOCK)
            try:
                _ma_case(ex, case, moving_average, x, uses_tile, has_sync)
            except GradeError as e:   # explained by a trace of the same launch (failures only)
                raise GradeError(explain(ex, case, str(e), moving_average, grid, MA_BLOCK, x,
                                         np.full(n, np.nan, np.float32))) from None


def _ma_case(ex: str, case: str, moving_average, x: np.ndarray, uses_tile: bool,
             has_sync: bool) -> None:
    """One launch of ex02.4's kernel on ``x``, checked; GradeError says what is wrong."""
    n = x.size
    out, buf = guarded(n)
    grid = ceil_div(n, MA_BLOCK)
    call(ex, case, lambda: moving_average[grid, MA_BLOCK](to_device(x), out))
    xp = np.pad(x.astype(np.float64), MA_RADIUS)
    ref = sum(xp[k:k + n] for k in range(2 * MA_RADIUS + 1)) / (2 * MA_RADIUS + 1)
    if not canary_ok(buf, n):
        raise GradeError(f"{ex}: {case}: wrote past the end of out: missing bounds "
                         "guard (if i < n) on the write?")
    o = to_numpy(out).astype(np.float64)
    bad = ~close(o, ref, *ELEMENTWISE_TOL)
    if not bad.any():
        return
    idx = np.flatnonzero(bad)
    nan = np.isnan(o)
    if uses_tile and not has_sync:
        raise GradeError(f"{ex}: {case}: {idx.size} of {n} wrong, first at {idx[0]}, "
                         "and the kernel never calls cuda.syncthreads(): values read "
                         "from the tile before another thread wrote them (a race)")
    if nan.any():                 # written as NaN (a tile entry nobody loaded), or not written?
        again, _ = guarded(n)
        again.fill(1234.5)
        try:
            moving_average[grid, MA_BLOCK](to_device(x), again)
            sync()
            computed = nan & np.isnan(to_numpy(again))
        except Exception:  # noqa: BLE001 - the first run's diagnosis stands
            computed = np.zeros(n, bool)
        if computed.any():
            first = int(np.argmax(computed))
            why = ("load every entry of the tile, the halo included (0.0 outside the array), "
                   "before the barrier")
            raise GradeError(f"{ex}: {case}: out[{first}] was written but is NaN "
                             f"({int(computed.sum())} of {n}): the kernel read shared-memory "
                             f"entries that no thread had written (uninitialised memory): {why}")
    if nan.all():
        raise GradeError(f"{ex}: {case}: output never written (all NaN): still the "
                         "stub?")
    if nan.any():
        raise GradeError(f"{ex}: {case}: {int(nan.sum())} outputs never written, first "
                         f"at {int(np.argmax(nan))}: grid or guard wrong?")
    t = idx % MA_BLOCK
    at_edge_of_array = (idx < MA_RADIUS) | (idx >= n - MA_RADIUS)
    if at_edge_of_array.all():
        raise GradeError(f"{ex}: {case}: wrong only at the ends of the array (first at "
                         f"{idx[0]}): outside the array x counts as 0 (load 0.0 into "
                         "the halo there)")
    near_block_edge = (t < MA_RADIUS) | (t >= MA_BLOCK - MA_RADIUS)
    if (near_block_edge | at_edge_of_array).all() and n > MA_BLOCK:
        raise GradeError(f"{ex}: {case}: wrong only within {MA_RADIUS} of a block's "
                         f"edge (first at {idx[0]}): the halo. Load the {MA_RADIUS} "
                         "elements left and right of the block into the tile too, "
                         "before the barrier that precedes reading the tile")
    raise GradeError(f"{ex}: {case}: {error_summary(o, ref, bad)}. out[i] is the sum "
                     "of the 5 tile entries tile[t] .. tile[t + 4] divided by 5: check "
                     "the window, the divisor, and that each entry is loaded before "
                     "the barrier")


def ex02_5(sectors_s1, sectors_s2, sectors_s16, used_s2) -> None:
    """A warp reads float32 ``x[lane * s]`` from a 128-byte-aligned array: 32-byte sectors
    touched for s = 1, 2, 16, and the fraction of fetched bytes used at s = 2."""
    sectors = "sectors = the distinct 32-byte pieces the 32 addresses fall in"
    check_numbers("ex02.5", {"sectors_s1": sectors_s1, "sectors_s2": sectors_s2,
                             "sectors_s16": sectors_s16, "used_s2": used_s2},
                  {"sectors_s1": 4, "sectors_s2": 8, "sectors_s16": 32, "used_s2": 0.5},
                  wrong={"sectors_s1": {1: "a sector is 32 bytes, not 128: the warp's 128 "
                                            "bytes span several",
                                        32: "neighbouring lanes share a sector: 8 floats fit "
                                            "in one"},
                         "sectors_s2": {4: "the lanes now span 256 bytes",
                                        16: "each sector still serves 4 lanes at stride 2"},
                         "sectors_s16": {16: "lanes 16 floats apart are 64 bytes apart: no two "
                                             "share a 32-byte sector",
                                         64: "a lane's 4 bytes lie in one sector: at most one "
                                             "sector per lane"},
                         "used_s2": {1.0: "every other float of each fetched sector is not "
                                          "asked for",
                                     0.25: "count bytes used over bytes fetched: 128 of ..."}},
                  nudge={"sectors_s1": sectors, "sectors_s2": sectors, "sectors_s16": sectors,
                         "used_s2": "bytes the warp asked for / bytes in the sectors fetched"})
    passed("ex02.5")


def ex02_6(deg_32, deg_33, deg_34) -> None:
    """Lane t reads ``tile[t][c]`` of ``float tile[32][W]`` (32 banks of 4 bytes): the conflict
    degree (most lanes in one bank) for W = 32, 33, 34."""
    bank = "bank of tile[t][c] = (W t + c) mod 32; count lanes per bank"
    check_numbers("ex02.6", {"deg_32": deg_32, "deg_33": deg_33, "deg_34": deg_34},
                  {"deg_32": 32, "deg_33": 1, "deg_34": 2},
                  wrong={"deg_32": {1: "bank = (32 t + c) mod 32 = c for every lane",
                                    0: "bank = (32 t + c) mod 32 = c for every lane"},
                         "deg_33": {32: "bank = (33 t + c) mod 32 = (t + c) mod 32: all "
                                        "different?"},
                         "deg_34": {1: "not every padding works: (34 t) mod 32 = 2 t mod 32 "
                                       "reaches only the even banks",
                                    16: "2 t mod 32 takes 16 values over 32 lanes: how many "
                                        "lanes per value?",
                                    32: "2 t mod 32 takes 16 different values"}},
                  nudge={"deg_32": bank, "deg_33": bank, "deg_34": bank})
    passed("ex02.6")


def ex02_7(bytes_per_sm, threads_float, threads_float4) -> None:
    """2000 GB/s from DRAM, 500 ns per load, 100 SMs of at most 2048 threads: bytes each SM must
    keep in flight (Little's law, shared evenly), and the threads per SM that this takes with one
    outstanding 4-byte load each, or one 16-byte (float4) load each."""
    law = "bytes in flight = bandwidth x latency = 2000e9 B/s x 500e-9 s, shared by 100 SMs"
    check_numbers("ex02.7", {"bytes_per_sm": bytes_per_sm, "threads_float": threads_float,
                             "threads_float4": threads_float4},
                  {"bytes_per_sm": 10_000, "threads_float": 2500, "threads_float4": 625},
                  wrong={"bytes_per_sm": {1_000_000: "that is the whole GPU: divide by the "
                                                     "100 SMs",
                                          1000: "GB/s x ns: 2000e9 B/s x 500e-9 s = 1e6 bytes "
                                                "in all, then per SM",
                                          10: "GB/s x ns: 2000e9 B/s x 500e-9 s = 1e6 bytes in "
                                              "all, then per SM"},
                         "threads_float": {250_000: "per SM: 10,000 bytes / 4 bytes a thread",
                                           2048: "2048 is the most an SM holds; Little's law "
                                                 "asks for more than that",
                                           625: "a float keeps 4 bytes in flight, not 16"},
                         "threads_float4": {2500: "a float4 load keeps 16 bytes in flight, not 4",
                                            156.25: "10,000 bytes / 16 bytes a thread"}},
                  nudge={"bytes_per_sm": law,
                         "threads_float": "bytes per SM / bytes each thread has in flight",
                         "threads_float4": "bytes per SM / bytes each thread has in flight"})
    passed("ex02.7")
