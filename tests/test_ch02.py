"""Chapter 2 "Memory": kernels against numpy, and every grader against right and wrong answers.

Numba parts run in the simulator (CPU lane); CuPy / CUDA C++ parts are marked gpu.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudabook as cb
from cudabook import env
from cudabook.graders import GradeError, ex02_1, ex02_2, ex02_3, ex02_4

gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------- Numba kernels
def test_numba_copy_kernels():
    nb = cb.load_numba("copy")
    x = np.random.default_rng(0).standard_normal(1003).astype(np.float32)
    for name, grid in [("copy_v1", 8), ("copy_v2", 2), ("copy_v4", 1)]:
        y = np.full_like(x, np.nan)
        getattr(nb, name)[grid, 128](x, y)
        assert np.array_equal(x, y), name
    y = np.full(100, np.nan, np.float32)
    nb.copy_strided[1, 128](x, y, 3)
    assert np.array_equal(y, x[:300:3])
    nb.copy_offset[1, 128](x, y, 5)
    assert np.array_equal(y, x[5:105])


def test_numba_elementwise_kernels():
    ne = cb.load_numba("elementwise")
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(1003).astype(np.float32) for _ in range(2))
    for name, grid in [("add_v1", 4), ("add_v2", 1), ("add_v4", 1)]:
        z = np.full_like(x, np.nan)
        getattr(ne, name)[grid, 256](x, y, z)
        np.testing.assert_allclose(z, x + y, rtol=1e-6, err_msg=name)
    z = np.full_like(x, np.nan)
    ne.fma_chain[2, 128](x, z, 3, np.float32(0.5), np.float32(1.0))
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
from numba import cuda, float32  # noqa: E402  (after cudabook decided the mode)

BLOCK, R = 64, 2
TILE_LEN = BLOCK + 2 * R     # shared.array needs a constant: a global int, not an expression


@cuda.jit
def ma_ref(x, out):
    tile = cuda.shared.array(TILE_LEN, float32)
    n = x.size
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    tile[t + R] = x[i] if i < n else 0.0
    if t < R:
        j = i - R
        tile[t] = x[j] if j >= 0 and j < n else 0.0
        j = i + BLOCK
        tile[t + BLOCK + R] = x[j] if j < n else 0.0
    cuda.syncthreads()
    if i < n:
        acc = 0.0
        for k in range(2 * R + 1):
            acc += tile[t + k]
        out[i] = acc / (2 * R + 1)


@cuda.jit
def ma_no_sync(x, out):
    tile = cuda.shared.array(TILE_LEN, float32)
    n = x.size
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    tile[t + R] = x[i] if i < n else 0.0
    if t < R:
        j = i - R
        tile[t] = x[j] if j >= 0 and j < n else 0.0
        j = i + BLOCK
        tile[t + BLOCK + R] = x[j] if j < n else 0.0
    if i < n:
        acc = 0.0
        for k in range(2 * R + 1):
            acc += tile[t + k]
        out[i] = acc / (2 * R + 1)


@cuda.jit
def ma_no_halo(x, out):
    tile = cuda.shared.array(TILE_LEN, float32)
    n = x.size
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    tile[t + R] = x[i] if i < n else 0.0
    if t < R:
        tile[t] = 0.0
        tile[t + BLOCK + R] = 0.0
    cuda.syncthreads()
    if i < n:
        acc = 0.0
        for k in range(2 * R + 1):
            acc += tile[t + k]
        out[i] = acc / (2 * R + 1)


@cuda.jit
def ma_no_guard(x, out):
    tile = cuda.shared.array(TILE_LEN, float32)
    n = x.size
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    tile[t + R] = x[i] if i < n else 0.0
    if t < R:
        j = i - R
        tile[t] = x[j] if j >= 0 and j < n else 0.0
        j = i + BLOCK
        tile[t + BLOCK + R] = x[j] if j < n else 0.0
    cuda.syncthreads()
    acc = 0.0
    for k in range(2 * R + 1):
        acc += tile[t + k]
    out[i] = acc / (2 * R + 1)


@cuda.jit
def ma_no_shared(x, out):
    i = cuda.grid(1)
    n = x.size
    if i < n:
        acc = 0.0
        for k in range(-R, R + 1):
            if 0 <= i + k < n:
                acc += x[i + k]
        out[i] = acc / (2 * R + 1)


@cuda.jit
def ma_stub(x, out):
    tile = cuda.shared.array(TILE_LEN, float32)  # noqa: F841
    raise NotImplementedError("ex02.4")


def test_ex02_4_reference_passes(capsys):
    ex02_4(ma_ref)
    assert capsys.readouterr().out.strip() == "PASS ex02.4"


@pytest.mark.parametrize("kernel, hint", [
    (ma_stub, "not implemented"),
    (ma_no_sync, "syncthreads"),
    (ma_no_halo, "halo"),
    (ma_no_guard, "bounds guard"),
    (ma_no_shared, "shared.array"),
])
def test_ex02_4_rejects(kernel, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_4(kernel)


def test_cuda_graders_need_gpu_in_sim():
    if env.HAS_GPU:
        pytest.skip("GPU present")
    for g, arg in [(ex02_1, TRANSPOSE_REF), (ex02_2, AXPY_REF), (ex02_3, lambda *a: None)]:
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            g(arg)


# ----------------------------------------------------------------------------- ex02.1 (GPU)
TRANSPOSE_REF = r'''
#define TILE 32
#define ROWS 8
extern "C" __global__ void transpose_tiled(const float* in, float* out, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    int bx = blockIdx.x * TILE, by = blockIdx.y * TILE;
    for (int j = 0; j < TILE; j += ROWS) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
    for (int j = 0; j < TILE; j += ROWS) {
        int c = bx + threadIdx.y + j, r = by + threadIdx.x;
        if (c < cols && r < rows) out[(long long)c * rows + r] = tile[threadIdx.x][threadIdx.y + j];
    }
}
'''
TRANSPOSE_STUB = r'''
extern "C" __global__ void transpose_tiled(const float* in, float* out, int rows, int cols) {
    // TODO ex02.1
}
'''
TRANSPOSE_NO_SYNC = TRANSPOSE_REF.replace("__syncthreads();", "")
TRANSPOSE_WRONG_STRIDE = TRANSPOSE_REF.replace("out[(long long)c * rows + r]",
                                               "out[(long long)c * cols + r]")
TRANSPOSE_NO_GUARD = TRANSPOSE_REF.replace("if (c < cols && r < rows) ", "")
TRANSPOSE_UNPADDED = TRANSPOSE_REF.replace("[TILE + 1]", "[TILE]")
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
    ex02_1(TRANSPOSE_REF)
    assert capsys.readouterr().out.strip() == "PASS ex02.1"


@gpu
@pytest.mark.parametrize("src, hint", [
    (TRANSPOSE_STUB, "never written"),
    (TRANSPOSE_NO_SYNC, "__syncthreads"),
    (TRANSPOSE_WRONG_STRIDE, "stride"),
    (TRANSPOSE_NO_GUARD, "bounds guard"),
    (TRANSPOSE_UNPADDED, "bank conflicts"),
    (TRANSPOSE_NAIVE, "uncoalesced"),
])
def test_ex02_1_rejects(src, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_1(src)


# ----------------------------------------------------------------------------- ex02.2 (GPU)
AXPY_REF = r'''
extern "C" __global__ void axpy_vec(const float* x, const float* y, float* out, float a, int n) {
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    // elements before the first 16-byte boundary (x, y, out share the misalignment)
    int head = (int)(((16 - ((unsigned long long)x & 15)) & 15) / 4);
    if (head > n) head = n;
    if (tid < head) out[tid] = a * x[tid] + y[tid];
    int nv = (n - head) / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x + head);
    const float4* y4 = reinterpret_cast<const float4*>(y + head);
    float4* o4 = reinterpret_cast<float4*>(out + head);
    for (int i = tid; i < nv; i += stride) {
        float4 u = x4[i], v = y4[i];
        o4[i] = make_float4(a * u.x + v.x, a * u.y + v.y, a * u.z + v.z, a * u.w + v.w);
    }
    for (int i = head + 4 * nv + tid; i < n; i += stride) out[i] = a * x[i] + y[i];
}
'''
AXPY_NO_TAIL = AXPY_REF.replace(
    "for (int i = head + 4 * nv + tid; i < n; i += stride) out[i] = a * x[i] + y[i];", "")
AXPY_TAIL_AS_VECTOR = AXPY_REF.replace("int nv = (n - head) / 4;", "int nv = (n - head + 3) / 4;")
AXPY_ASSUMES_ALIGNED = AXPY_REF.replace(
    "int head = (int)(((16 - ((unsigned long long)x & 15)) & 15) / 4);", "int head = 0;")
AXPY_NO_GRID_STRIDE = AXPY_REF.replace("for (int i = tid; i < nv; i += stride)",
                                       "for (int i = tid; i < nv; i += nv)")
AXPY_SCALAR = r'''
extern "C" __global__ void axpy_vec(const float* x, const float* y, float* out, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = a * x[i] + y[i];
}
'''


@gpu
def test_ex02_2_reference_passes(capsys):
    ex02_2(AXPY_REF)
    assert capsys.readouterr().out.strip() == "PASS ex02.2"


@gpu
@pytest.mark.parametrize("src, hint", [
    (AXPY_NO_TAIL, "missing tail"),
    (AXPY_TAIL_AS_VECTOR, "past the end"),
    (AXPY_ASSUMES_ALIGNED, "misaligned"),
    (AXPY_NO_GRID_STRIDE, "grid-stride"),
    (AXPY_SCALAR, "float4"),
])
def test_ex02_2_rejects(src, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_2(src)


# ----------------------------------------------------------------------------- ex02.3 (GPU)
def _pipeline(x_host, y_host, n_chunks, compute, *, n_streams=3, sync=True, floor=False,
              null=False):
    import cupy

    rt = cupy.cuda.runtime
    n = x_host.size
    x_dev = cupy.empty(n, dtype=cupy.float32)
    y_dev = cupy.empty(n, dtype=cupy.float32)
    streams = [cupy.cuda.Stream.null if null else cupy.cuda.Stream(non_blocking=True)
               for _ in range(n_streams)]
    if floor:
        step = n // n_chunks
        bounds = [k * step for k in range(n_chunks + 1)]
    else:
        bounds = [n * k // n_chunks for k in range(n_chunks + 1)]
    for k in range(n_chunks):
        lo, hi = bounds[k], bounds[k + 1]
        s = streams[k % n_streams]
        nb = (hi - lo) * 4
        rt.memcpyAsync(x_dev[lo:].data.ptr, x_host.ctypes.data + 4 * lo, nb,
                       rt.memcpyHostToDevice, s.ptr)
        with s:
            compute(x_dev[lo:hi], y_dev[lo:hi])
        rt.memcpyAsync(y_host.ctypes.data + 4 * lo, y_dev[lo:].data.ptr, nb,
                       rt.memcpyDeviceToHost, s.ptr)
    if sync:
        for s in streams:
            s.synchronize()


@gpu
def test_ex02_3_reference_passes(capsys):
    ex02_3(_pipeline)
    assert capsys.readouterr().out.strip() == "PASS ex02.3"


@gpu
@pytest.mark.parametrize("kw, hint", [
    (dict(sync=False), "synchronize"),
    (dict(floor=True), "cover"),
    (dict(null=True), "stream"),
    (dict(n_streams=1), "stream"),
])
def test_ex02_3_rejects(kw, hint):
    with pytest.raises(GradeError, match=hint):
        ex02_3(lambda *a: _pipeline(*a, **kw))


def test_ex02_3_stub_fails():
    def stub(*a):
        raise NotImplementedError("ex02.3")
    if not env.HAS_GPU:
        pytest.skip("needs a GPU")
    with pytest.raises(GradeError, match="not implemented"):
        ex02_3(stub)


def test_ex02_4_static_checks_name_the_mistake():
    # on a GPU a race in ma_no_sync may not show up; the source check still rejects it
    with pytest.raises(GradeError, match="syncthreads"):
        ex02_4(ma_no_sync)


# ----------------------------------------------------------------------------- CuPy kernels
@gpu
def test_cuda_kernels_match_numpy():
    import cupy

    rng = np.random.default_rng(3)
    mc, me, mt = cb.load_cuda("copy"), cb.load_cuda("elementwise"), cb.load_cuda("transpose")
    for n in [1, 3, 4, 5, 1023, 4097, (1 << 20) + 3]:
        x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        y = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        for name in ("copy_v1", "copy_v2", "copy_v3", "copy_v4"):
            for grid in (1, cb.ceil_div(n, 256)):
                out = cb.empty_nan(n, xp=cupy)
                mc.get(name)((grid if name != "copy_v1" else cb.ceil_div(n, 256),), (256,),
                             (x, out, np.int32(n)))
                cb.check(out, x, name=f"{name} n={n} grid={grid}")
        for name in ("add_v1", "add_v2", "add_v3", "add_v4"):
            for grid in (1, cb.ceil_div(n, 256)):
                out = cb.empty_nan(n, xp=cupy)
                me.get(name)((grid if name != "add_v1" else cb.ceil_div(n, 256),), (256,),
                             (x, y, out, np.int32(n)))
                cb.check(out, x.astype(np.float64) + y, name=f"{name} n={n}")
        out = cb.empty_nan(n, xp=cupy)
        me.fma_chain((cb.ceil_div(n, 1024),), (256,), (x, out, np.int32(n), np.int32(3),
                                                      np.float32(0.5), np.float32(1.0)))
        r = x.astype(np.float64)
        for _ in range(3):
            r = r * 0.5 + 1.0
        cb.check(out, r, name=f"fma_chain n={n}")
    for rows, cols in [(1, 1), (37, 70), (1025, 513), (65, 130)]:
        a = cupy.asarray(rng.standard_normal((rows, cols), dtype=np.float32))
        for name, tc, tr in [("transpose_v1", 32, 32), ("transpose_v2", 32, 32),
                             ("transpose_v3", 32, 32), ("transpose_v4", 32, 64),
                             ("transpose_v5", 64, 64)]:
            out = cb.empty_nan((cols, rows), xp=cupy)
            mt.get(name)((cb.ceil_div(cols, tc), cb.ceil_div(rows, tr)), (32, 8),
                         (a, out, np.int32(rows), np.int32(cols)))
            cb.check(out, a.T, name=f"{name} {rows}x{cols}")
