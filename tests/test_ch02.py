"""Chapter 2 "Memory": kernels against numpy, and every grader against right and wrong answers.

Numba parts run in the simulator (CPU lane); CuPy / CUDA C++ parts are marked gpu. References
come from solutions/02_memory.ipynb; wrong answers are edits of them (tests/solution_cells.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from solution_cells import Solution, pencil_tests

import cudabook as cb
from cudabook import graders
from cudabook.graders import GradeError, ex02_1, ex02_2, ex02_3, ex02_4

gpu = pytest.mark.gpu
SOL = Solution("02")

# the two messages that say a barrier is missing: the value check saw a race, or racecheck did
RACE = r"racecheck found a race|a race on the shared tile|exposes races the GPU hid"


# ----------------------------------------------------------------------------- Numba kernels
def test_numba_copy_kernels():
    nb = cb.load_numba("copy")
    x = np.random.default_rng(0).standard_normal(1003).astype(np.float32)
    for name, grid in [("copy_v1", 8), ("copy_v2", 2), ("copy_unroll4", 1)]:
        y = np.full_like(x, np.nan)
        getattr(nb, name)[grid, 128](x, y)
        assert np.array_equal(x, y), name
    y = np.full(100, np.nan, np.float32)
    nb.copy_strided[1, 128](x, y, 3)
    assert np.array_equal(y, x[:300:3])
    nb.copy_offset[1, 128](x, y, 5)
    assert np.array_equal(y, x[5:105])


def test_numba_vector_add_and_fma_kernels():
    nv, nf = cb.load_numba("vector_add"), cb.load_numba("fma_chain")
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(1003).astype(np.float32) for _ in range(2))
    for name, grid in [("vector_add_v1", 4), ("vector_add_v2", 1), ("vector_add_unroll4", 1)]:
        z = np.full_like(x, np.nan)
        getattr(nv, name)[grid, 256](x, y, z)
        np.testing.assert_allclose(z, x + y, rtol=1e-6, err_msg=name)
    z = np.full_like(x, np.nan)
    nf.fma_chain[2, 128](x, z, 3, np.float32(0.5), np.float32(1.0))
    r = x.astype(np.float64)
    for _ in range(3):
        r = r * 0.5 + 1.0
    np.testing.assert_allclose(z, r, rtol=1e-5)


def test_numba_transpose_kernels():
    nt = cb.load_numba("transpose")
    a = np.random.default_rng(2).standard_normal((37, 70)).astype(np.float32)
    for name in ("transpose_v1", "transpose_v2", "transpose_v3"):
        o = np.full((70, 37), np.nan, np.float32)
        getattr(nt, name)[(3, 2), (32, 8)](a, o)
        assert np.array_equal(o, a.T), name


# ----------------------------------------------------------------------------- ex02.4 (sim)
def moving_average(*edits):
    return SOL.get("ex02.4", "moving_average", edits=edits)


NO_SYNC = ("    cuda.syncthreads()\n    if i < n:", "    if i < n:")
NO_GUARD = ("    if i < n:\n        acc = 0.0", "    if True:\n        acc = 0.0")
# a barrier, but before the halo is loaded: the halo entries are read before they are written
SYNC_BEFORE_HALO = [NO_SYNC, ("    if t < R:\n", "    cuda.syncthreads()\n    if t < R:\n")]
# the grader traces the failing launch (cb.trace) and names the threads and lines
TRACED_RACE = (r"cb\.trace of the launch moving_average\[\d, 64\] shows why: race on shared "
               r"tile\[1\] in block 0: thread 1 writes it \(line \d+: tile\[t\]\) and thread 0 "
               r"reads it \(line \d+: tile\[t \+ k\]\) with no cuda\.syncthreads\(\) between them")


@cuda.jit
def ma_no_shared(x, out):          # right values straight from global memory: breaks the rubric
    i = cuda.grid(1)
    if i < x.size:
        acc = 0.0
        for k in range(-2, 3):
            if 0 <= i + k < x.size:
                acc += x[i + k]
        out[i] = acc / 5


def test_ex02_4_reference_passes(capsys):
    ex02_4(moving_average())
    assert capsys.readouterr().out.strip() == "PASS ex02.4"


@pytest.mark.parametrize("edits, hint", [
    ([NO_SYNC], "never calls cuda.syncthreads|without cuda.syncthreads"),
    ([("tile[t] = x[j] if j >= 0 and j < n else 0.0", "tile[t] = 0.0"),
      ("tile[t + BLOCK + R] = x[j] if j < n else 0.0", "tile[t + BLOCK + R] = 0.0")],
     "the halo. Load the 2 elements"),
    ([NO_GUARD], "missing bounds guard"),
    # the barrier inside the guard: the threads past n never reach it (fine in the simulator)
    ([("    cuda.syncthreads()\n    if i < n:\n", "    if i < n:\n        cuda.syncthreads()\n")],
     "a barrier that not every thread of the block reaches: line \\d+: cuda.syncthreads\\(\\) "
     "inside the branch"),
    # NumPy inside the kernel: right in the simulator, no GPU code
    ([("        acc = 0.0\n        for k in range(2 * R + 1):\n            acc += tile[t + k]\n",
       "        acc = tile[t:t + 2 * R + 1].sum()\n")],
     "uses what runs only on the host: line \\d+: .sum"),
], ids=["no-barrier", "no-halo", "no-guard", "barrier-in-guard", "numpy-sum"])
def test_ex02_4_rejects(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_4(moving_average(*edits))


def test_ex02_4_barrier_before_the_halo_is_a_race():
    """The barrier is there (the source check passes) but the halo is loaded after it. The
    simulator reads the halo too early (which outputs come out wrong depends on how its
    threads interleave); the trace of the failing launch names the race, the same every time.
    On a GPU, where the numbers may come out right, the grader runs the kernel again in the
    simulator and says so."""
    with pytest.raises(GradeError, match=TRACED_RACE) as e:
        ex02_4(moving_average(*SYNC_BEFORE_HALO))
    if cb.HAS_GPU:
        assert "exposes races the GPU hid" in str(e.value) or "wrong only" in str(e.value)


def test_ex02_4_missing_barrier_is_traced():
    with pytest.raises(GradeError, match=r"(without|never calls) cuda\.syncthreads\(\).*"
                       + TRACED_RACE):
        ex02_4(moving_average(NO_SYNC))


def test_ex02_4_no_guard_names_the_thread():
    with pytest.raises(GradeError, match=r"n=1 .*missing bounds guard.* cb\.trace of the launch "
                       r"moving_average\[1, 64\] shows why: out\[1\] written out of bounds \(out "
                       r"has shape \(1,\)\) by thread 1 \(block 0, thread 1\), line \d+: out\[i\]"):
        ex02_4(moving_average(NO_GUARD))


def test_ex02_4_no_shared_and_stub_fail():
    with pytest.raises(GradeError, match="stage x through cuda.shared.array"):
        ex02_4(ma_no_shared)
    with pytest.raises(GradeError, match="not implemented"):
        ex02_4(SOL.stub("ex02.4", "moving_average"))


def test_ex02_4_rubric_ignores_comments():
    # a comment or a string that mentions the barrier does not count as one
    commented = moving_average(NO_SYNC, ("    if t < R:\n",
                                         "    # cuda.syncthreads()\n    if t < R:\n"))
    with pytest.raises(GradeError, match="syncthreads"):
        ex02_4(commented)


@pytest.mark.simulator
def test_cuda_graders_need_gpu_in_sim():
    for g, arg in [(ex02_1, SOL.get("ex02.1", "transpose_src")),
                   (ex02_2, SOL.get("ex02.2", "axpy_src")), (ex02_3, lambda *a: None)]:
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            g(arg)


# ----------------------------------------------------------------------------- ex02.1 (GPU)
def transpose(*edits):
    return SOL.get("ex02.1", "transpose_src", edits=edits)


TRANSPOSE_NO_SYNC = ("    __syncthreads();                             "
                     "// the whole tile is loaded\n", "")
TRANSPOSE_NAIVE = r'''
extern "C" __global__ void transpose_tiled(const float* in, float* out, int rows, int cols) {
    int c = blockIdx.x * 32 + threadIdx.x;
    for (int j = 0; j < 32; j += 8) {
        int r = blockIdx.y * 32 + threadIdx.y + j;
        if (r < rows && c < cols) out[(long long)c * rows + r] = in[(long long)r * cols + c];
    }
}
'''


@gpu
def test_ex02_1_reference_passes(capsys):
    ex02_1(transpose())
    assert capsys.readouterr().out.strip() == "PASS ex02.1"


@gpu
@pytest.mark.parametrize("src, hint", [
    ("stub", "never written"),
    ([TRANSPOSE_NO_SYNC], "__syncthreads"),
    ([("out[(long long)c * rows + r]", "out[(long long)c * cols + r]")], "wrong stride"),
    ([("if (c < cols && r < rows) ", "")], "missing bounds guard"),
    ([("[TILE + 1]", "[TILE]")], "bank conflicts"),
    (TRANSPOSE_NAIVE, "uncoalesced"),
    # a barrier, but before the tile is filled: racecheck sees the race the numbers may hide
    ([TRANSPOSE_NO_SYNC, ("    for (int j = 0; j < TILE; j += ROWS) {       // coalesced read",
                          "    __syncthreads();\n    for (int j = 0; j < TILE; j += ROWS) {"
                          "       // coalesced read")], RACE),
], ids=["stub", "no-barrier", "wrong-stride", "no-guard", "unpadded", "naive", "early-barrier"])
def test_ex02_1_rejects(src, hint):
    if src == "stub":
        src = SOL.stub("ex02.1", "transpose_src")
    elif isinstance(src, list):
        src = transpose(*src)
    with pytest.raises(GradeError, match=hint):
        ex02_1(src)


# ----------------------------------------------------------------------------- ex02.2 (GPU)
def axpy(*edits):
    return SOL.get("ex02.2", "axpy_src", edits=edits)


AXPY_SCALAR = r'''
extern "C" __global__ void axpy_vec(const float* x, const float* y, float* out, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = a * x[i] + y[i];
}
'''


@gpu
def test_ex02_2_reference_passes(capsys):
    ex02_2(axpy())
    assert capsys.readouterr().out.strip() == "PASS ex02.2"


@gpu
@pytest.mark.parametrize("src, hint", [
    ([("    for (int i = head + 4 * nv + tid; i < n; i += stride) out[i] = a * x[i] + y[i];"
       "   // tail\n", "")], "missing tail"),
    ([("int nv = (n - head) / 4;", "int nv = (n - head + 3) / 4;")], "wrote past the end"),
    ([("int head = (int)(((16 - ((unsigned long long)x & 15)) & 15) / 4);", "int head = 0;")],
     "misaligned address"),
    ([("for (int i = tid; i < nv; i += stride)", "for (int i = tid; i < nv; i += nv)")],
     "grid-stride loop"),
    (AXPY_SCALAR, "must move data as float4"),
], ids=["no-tail", "tail-as-vector", "assumes-aligned", "no-grid-stride", "scalar"])
def test_ex02_2_rejects(src, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_2(axpy(*src) if isinstance(src, list) else src)


# ----------------------------------------------------------------------------- ex02.3 (GPU)
def pipeline(*edits):
    return SOL.get("ex02.3", "run_pipeline", edits=edits)


@gpu
def test_ex02_3_reference_passes(capsys):
    ex02_3(pipeline())
    assert capsys.readouterr().out.strip() == "PASS ex02.3"


@gpu
@pytest.mark.parametrize("edit, hint", [
    (("    for s in streams:\n        s.synchronize()\n", ""), "synchronize the streams"),
    (("lo, hi = n * k // n_chunks, n * (k + 1) // n_chunks",
      "lo, hi = k * (n // n_chunks), (k + 1) * (n // n_chunks)"), "chunks must still cover"),
    (("cupy.cuda.Stream(non_blocking=True)", "cupy.cuda.Stream.null"),
     "ran on the default stream"),
    (("range(min(n_chunks, 3))", "range(1)"), "ran on one stream"),
], ids=["no-sync", "floor-chunks", "null-stream", "one-stream"])
def test_ex02_3_rejects(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_3(pipeline(edit))


@gpu
def test_ex02_3_serial_pipeline_fails_on_speed():
    """Right values, streams used, but a wait inside the loop that the source check cannot
    see (called through getattr): nothing overlaps, and the timing says so."""
    serial = pipeline(("rt.memcpyDeviceToHost, s.ptr)\n",
                       "rt.memcpyDeviceToHost, s.ptr)\n        getattr(s, 'synchronize')()\n"))
    with pytest.raises(GradeError, match="nothing overlaps"):
        ex02_3(serial)


# blocking calls inside the loop over chunks: refused from the source, before anything runs
# (so on a CPU too)
@pytest.mark.parametrize("edit, hint", [
    (("rt.memcpyDeviceToHost, s.ptr)\n",
      "rt.memcpyDeviceToHost, s.ptr)\n        s.synchronize()\n"), r"s\.synchronize\(\) \(waits"),
    (("        rt.memcpyAsync(x_dev[lo:].data.ptr, x_host.ctypes.data + 4 * lo, nbytes,\n"
      "                       rt.memcpyHostToDevice, s.ptr)\n",
      "        x_dev[lo:hi] = cupy.asarray(x_host[lo:hi])\n"),
     r"cupy\.asarray\(\) \(a synchronous host-to-device copy"),
    (("        rt.memcpyAsync(y_host.ctypes.data + 4 * lo, y_dev[lo:].data.ptr, nbytes,\n"
      "                       rt.memcpyDeviceToHost, s.ptr)\n",
      "        y_host[lo:hi] = y_dev[lo:hi].get()\n"), r"\.get\(\) \(a synchronous device-to-host"),
], ids=["sync-in-loop", "asarray-in-loop", "get-in-loop"])
def test_ex02_3_blocking_call_in_the_loop_fails(edit, hint):
    with pytest.raises(GradeError, match="waits for the GPU inside the loop over chunks.*" + hint):
        ex02_3(pipeline(edit))


def test_ex02_3_one_wait_after_the_loop_is_not_blocking():
    # the reference waits once per stream after the loop over chunks (a loop of its own, which
    # queues no chunk work): that is the wait the exercise asks for, found on a CPU too
    from cudabook.graders.ch02 import _blocking_in_loop

    assert "for s in streams:\n        s.synchronize()" in SOL.source("ex02.3")
    assert _blocking_in_loop("ex02.3", pipeline()) == []


@gpu
def test_ex02_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented"):
        ex02_3(SOL.stub("ex02.3", "run_pipeline"))


# ----------------------------------------------------------------------------- CuPy kernels
@gpu
def test_cuda_kernels_match_numpy():
    import cupy

    rng = np.random.default_rng(3)
    cl, vl, tl = (cb.load_launch(op) for op in ("copy", "vector_add", "transpose"))
    mf = cb.load_cuda("fma_chain")
    for n in [1, 3, 4, 5, 1023, 4097, (1 << 20) + 3]:
        x = cupy.asarray(rng.standard_normal(n + 1, dtype=np.float32))
        y = cupy.asarray(rng.standard_normal(n + 1, dtype=np.float32))
        for off in (0, 1):                            # whole arrays, and views 4 bytes in
            xv, yv = x[off:off + n], y[off:off + n]
            for v in cl.VERSIONS:
                out = cb.empty_nan(n, xp=cupy)
                cl.copy(xv, out, v)
                cb.check(out, xv, name=f"{v} n={n} offset {off}")
            for v in vl.VERSIONS:
                out = cb.empty_nan(n + 1, xp=cupy)[off:off + n]
                vl.vector_add(xv, yv, out, v)
                cb.check(out, xv.astype(np.float64) + yv, name=f"{v} n={n} offset {off}")
            out = cb.empty_nan(n, xp=cupy)
            mf.fma_chain((cb.ceil_div(n, 1024),), (256,), (xv, out, np.int32(n), np.int32(3),
                                                          np.float32(0.5), np.float32(1.0)))
            r = xv.astype(np.float64)
            for _ in range(3):
                r = r * 0.5 + 1.0
            cb.check(out, r, name=f"fma_chain n={n} offset {off}")
    for rows, cols in [(1, 1), (37, 70), (1025, 513), (65, 130)]:
        a = cupy.asarray(rng.standard_normal((rows, cols), dtype=np.float32))
        for v in tl.VERSIONS:
            out = cb.empty_nan((cols, rows), xp=cupy)
            tl.transpose(a, out, v)
            cb.check(out, a.T, name=f"{v} {rows}x{cols}")


def test_launch_helper_configs_take_both_spellings():
    """config() of copy / vector_add / transpose: launch records, "v2" or "copy_v2", the SM count
    given (no GPU needed)."""
    cl, vl, tl = (cb.load_launch(op) for op in ("copy", "vector_add", "transpose"))
    c = cl.config("v2", 1000, sms=132)
    assert c == cl.config("copy_v2", 1000, sms=132) == ((1056,), (256,))
    assert c.kernel == "copy_v2" and c.shared == 0
    assert vl.config("v4", 4097) == ((2,), (256,)) and vl.config("v2", 1, sms=10).grid == (40,)
    grid, block = tl.config("v5", 130, 65)
    assert (grid, block) == ((2, 3), (32, 8)) and tl.config("transpose_v5", 130, 65).kernel == \
        "transpose_v5"
    with pytest.raises(ValueError, match=r"unknown version 'v9'; copy has"):
        cl.config("v9", 10)


@gpu
def test_launch_helpers_refuse_bad_input():
    import cupy

    cl = cb.load_launch("copy")
    x = cupy.zeros(10, cupy.float32)
    with pytest.raises(TypeError, match="expected dtype float32"):
        cl.copy(x.astype(cupy.float64), x)
    with pytest.raises(ValueError, match=r"expected shape \(10,\)"):
        cl.copy(x, cupy.zeros(9, cupy.float32))
    with pytest.raises(TypeError, match="expected a GPU array"):
        cl.copy(np.zeros(10, np.float32), x)
    y = cl.copy(x + 1, version="v2")                  # y allocated, the short spelling
    assert y.dtype == cupy.float32 and bool((y == 1).all())


# ----------------------------------------------------------------------------- pencil and paper
(test_question_reference_passes, test_question_stub_fails,
 test_question_common_mistake_gets_its_hint) = pencil_tests(
    SOL, (graders.ex02_5, graders.ex02_6, graders.ex02_7), [
    ("ex02.5", "sectors_s1", 1, "32 bytes, not 128"),
    ("ex02.5", "sectors_s16", 64, "at most one sector per lane"),
    ("ex02.5", "used_s2", 1.0, "every other float"),
    ("ex02.5", "used_s2", 50, "not a percentage"),
    ("ex02.6", "deg_34", 1, "not every padding works"),
    ("ex02.6", "deg_32", 1, "= c for every lane"),
    ("ex02.7", "bytes_per_sm", 1_000_000, "divide by the 100 SMs"),
    ("ex02.7", "threads_float", 2048, "asks for more"),
    ("ex02.7", "threads_float4", 2500, "16 bytes in flight"),
])
