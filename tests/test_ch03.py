"""Chapter 3: the Numba kernels against numpy/torch (simulator), and the graders: the reference
passes, stubs and plausible wrong answers fail with the expected hint."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda, float32

import cudabook as cb
from cudabook.graders import GradeError, ex03_1, ex03_2, ex03_3, ex03_4, ex03_5, ex03_6
from cudabook.graders.ch03 import (
    conv2d_reference,
    gelu_tanh_reference,
    layernorm_reference,
    softmax_reference,
)

# Reading past the end of a small allocation is caught by the simulator (IndexError); on a GPU it
# may read anything or fault, and a missing barrier is a race that a given run may not show: those
# wrong answers are graded in the simulator only (ex03.2 tests the race on the GPU).
SIM_ONLY = pytest.mark.skipif(cb.HAS_GPU, reason="simulator-only wrong answer (see above)")

# ----------------------------------------------------------------------------- Numba kernels


def _nan(shape):
    return np.full(shape, np.nan, np.float32)


def test_activation_kernels():
    nb = cb.load_numba("activation")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(300).astype(np.float32)
    y = _nan(300)
    nb.relu_v1[2, 256](x, y)
    cb.check(y, np.maximum(x, 0))
    nb.gelu_v1[2, 256](x, y)
    cb.check(y, gelu_tanh_reference(x))
    nb.gelu_v2[2, 256](x, y)
    x64 = x.astype(np.float64)
    cb.check(y, 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2))))
    X = rng.standard_normal((5, 19)).astype(np.float32)
    b = rng.standard_normal(19).astype(np.float32)
    Y = _nan((5, 19))
    nb.bias_gelu_v1[(2, 1), (16, 16)](X, b, Y)
    cb.check(Y, gelu_tanh_reference(X.astype(np.float64) + b))
    nb.bias_add_v1[(2, 1), (16, 16)](X, b, Y)
    cb.check(Y, X.astype(np.float64) + b)


def test_reduce_kernels():
    nb = cb.load_numba("reduce")
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    ref = x.astype(np.float64).sum()
    for name in ("reduce_v1", "reduce_v2"):
        p = _nan(2)
        getattr(nb, name)[2, 256](x, p)
        assert abs(p.astype(np.float64).sum() - ref) < 1e-3, name
    p = _nan(1)
    nb.reduce_v3[1, 256](x, p)
    assert abs(p.astype(np.float64).sum() - ref) < 1e-3
    out = np.zeros(1, np.float32)
    nb.reduce_v5[2, 256](x, out)
    assert abs(out[0] - ref) < 1e-3
    out = np.full(1, -np.inf, np.float32)
    nb.reduce_max_v5[2, 256](x, out)
    assert out[0] == x.max()


def test_softmax_kernels():
    nb = cb.load_numba("softmax")
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((4, 150)) * 50).astype(np.float32)
    X[0, 3] = 3000.0
    X[1] = -np.inf
    X[2, :40] = -np.inf
    ref = softmax_reference(X)
    for name, cfg in (("softmax_v1", (1, 128)), ("softmax_v2", (4, 128)),
                      ("softmax_v4", (4, 128))):
        Y = _nan(X.shape)
        getattr(nb, name)[cfg](X, Y)
        cb.check(Y, ref, name=name)
    assert nb.v5_threads(1024) == 64 and nb.v5_threads(32768) == 1024


def test_layernorm_kernels():
    nb = cb.load_numba("layernorm")
    rng = np.random.default_rng(4)
    X = (rng.standard_normal((3, 130)) * 2 + 100).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 130).astype(np.float32)
    b = rng.standard_normal(130).astype(np.float32)
    ref = layernorm_reference(X, g, b, 1e-5)
    for name, cfg in (("layernorm_v1", (1, 128)), ("layernorm_v2", (3, 128))):
        Y = _nan(X.shape)
        getattr(nb, name)[cfg](X, g, b, np.float32(1e-5), Y)
        cb.check(Y, ref, name=name, atol=1e-4, rtol=1e-3)
    Y = _nan(X.shape)
    nb.rmsnorm_v1[3, 128](X, g, np.float32(1e-5), Y)
    x64 = X.astype(np.float64)
    cb.check(Y, x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-5) * g)


def test_conv_kernels():
    nb = cb.load_numba("conv")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(100).astype(np.float32)
    w = rng.standard_normal(5).astype(np.float32)
    y = _nan(100)
    nb.conv1d_v1[1, 256](x, w, y)
    ref1 = np.convolve(np.pad(x.astype(np.float64), 2), w[::-1].astype(np.float64), "valid")
    cb.check(y, ref1)
    X = rng.standard_normal((18, 20)).astype(np.float32)
    W = rng.standard_normal((3, 3)).astype(np.float32)
    ref = conv2d_reference(X, W)
    for k in (nb.conv2d_v1, nb.conv2d_v2):
        Y = _nan(X.shape)
        k[(2, 2), (16, 16)](X, W, Y)
        cb.check(Y, ref)
    Y = _nan(X.shape)
    nb.make_conv2d_v3(W)[(2, 2), (16, 16)](X, Y)
    cb.check(Y, ref)


def test_conv2d_reference_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 9))
    w = rng.standard_normal((5, 5))
    t = torch.nn.functional.conv2d(torch.from_numpy(x)[None, None], torch.from_numpy(w)[None, None],
                                   padding=2)[0, 0].numpy()
    np.testing.assert_allclose(conv2d_reference(x, w), t, atol=1e-12)


# ----------------------------------------------------------------------------- ex03.1
TPB = 128


@cuda.jit
def _block_sum(x, partial):
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s[tid] = x[i] if i < x.size else float32(0)
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


@cuda.jit
def _block_sum_no_guard(x, partial):
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    s[tid] = x[cuda.grid(1)]
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


@cuda.jit
def _block_sum_no_sync(x, partial):
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s[tid] = x[i] if i < x.size else float32(0)
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        stride //= 2                         # no barrier between levels: a race
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


def _sum_all(kernel, blocks_of=lambda n: (n + TPB - 1) // TPB):
    def sum_all(x):
        n = x.size
        while True:
            blocks = max(blocks_of(n), 1)
            partial = cuda.device_array(blocks, dtype=np.float32)
            kernel[blocks, TPB](x, partial)
            if blocks == 1:
                return partial.copy_to_host()[0]
            x, n = partial, blocks
    return sum_all


def test_ex03_1_reference_passes(capsys):
    ex03_1(_sum_all(_block_sum))
    assert capsys.readouterr().out == "PASS ex03.1\n"


def _one_level(x):
    blocks = (x.size + TPB - 1) // TPB
    partial = cuda.device_array(blocks, dtype=np.float32)
    _block_sum[blocks, TPB](x, partial)
    return partial.copy_to_host()[0]


@pytest.mark.parametrize("wrong, hint", [
    (_sum_all(_block_sum, lambda n: n // TPB), "last partial block"),      # floor, not ceil
    pytest.param(_sum_all(_block_sum_no_guard), "missing bounds guard", marks=SIM_ONLY),
    pytest.param(_sum_all(_block_sum_no_sync), "syncthreads", marks=SIM_ONLY),
    (_one_level, "launch again on the partial"),
])
def test_ex03_1_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_1(wrong)


def test_ex03_1_stub_fails():
    def stub(x):
        raise NotImplementedError("ex03.1")
    with pytest.raises(GradeError, match="not implemented yet"):
        ex03_1(stub)


# ----------------------------------------------------------------------------- ex03.3
NEG_INF = float32(-math.inf)


@cuda.jit
def _softmax_online(x, y):
    r = cuda.grid(1)
    if r < x.shape[0]:
        m, d = NEG_INF, float32(0)
        for j in range(x.shape[1]):
            v = x[r, j]
            if v > m:
                d = d * math.exp(m - v) + float32(1)
                m = v
            elif v != NEG_INF:
                d += math.exp(v - m)
        if m == NEG_INF:
            m = float32(0)
        inv = float32(1) / d if d > 0 else float32(0)
        for j in range(x.shape[1]):
            y[r, j] = math.exp(x[r, j] - m) * inv


@cuda.jit
def _softmax_no_max(x, y):
    r = cuda.grid(1)
    if r < x.shape[0]:
        d = float32(0)
        for j in range(x.shape[1]):
            d += math.exp(x[r, j])
        for j in range(x.shape[1]):
            y[r, j] = math.exp(x[r, j]) / d


@cuda.jit
def _softmax_nan_on_inf(x, y):             # the textbook update, no -inf guard
    r = cuda.grid(1)
    if r < x.shape[0]:
        m, d = NEG_INF, float32(0)
        for j in range(x.shape[1]):
            v = x[r, j]
            mn = max(m, v)
            d = d * math.exp(m - mn) + math.exp(v - mn)
            m = mn
        for j in range(x.shape[1]):
            y[r, j] = math.exp(x[r, j] - m) / d


@cuda.jit
def _softmax_no_rescale(x, y):
    r = cuda.grid(1)
    if r < x.shape[0]:
        m, d = NEG_INF, float32(0)
        for j in range(x.shape[1]):
            v = x[r, j]
            if v > m:
                m = v
            if v != NEG_INF:
                d += math.exp(v - m)           # old terms are never rescaled
        if m == NEG_INF:
            m = float32(0)
        inv = float32(1) / d if d > 0 else float32(0)
        for j in range(x.shape[1]):
            y[r, j] = math.exp(x[r, j] - m) * inv


@cuda.jit
def _softmax_no_guard(x, y):
    r = cuda.grid(1)
    m, d = NEG_INF, float32(0)
    for j in range(x.shape[1]):
        v = x[r, j]
        if v > m:
            d = d * math.exp(m - v) + float32(1)
            m = v
        elif v != NEG_INF:
            d += math.exp(v - m)
    if m == NEG_INF:
        m = float32(0)
    inv = float32(1) / d if d > 0 else float32(0)
    for j in range(x.shape[1]):
        y[r, j] = math.exp(x[r, j] - m) * inv


def test_ex03_3_reference_passes(capsys):
    ex03_3(_softmax_online)
    assert capsys.readouterr().out == "PASS ex03.3\n"


@pytest.mark.parametrize("wrong, hint", [
    (_softmax_no_max, "subtract the running max"),
    (_softmax_nan_on_inf, "-inf"),
    (_softmax_no_rescale, "rescaled"),
    pytest.param(_softmax_no_guard, "missing bounds guard", marks=SIM_ONLY),
])
def test_ex03_3_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_3(wrong)


def test_ex03_3_stub_fails():
    @cuda.jit
    def stub(x, y):
        pass                               # the exercise stub leaves y unwritten
    with pytest.raises(GradeError, match="never written"):
        ex03_3(stub)


# ----------------------------------------------------------------------------- ex03.4
LN = 64


def _make_layernorm(mode=0):
    @cuda.jit
    def layernorm(x, gamma, beta, eps, y):
        s1 = cuda.shared.array(LN, float32)
        s2 = cuda.shared.array(LN, float32)
        r, tid = cuda.blockIdx.x, cuda.threadIdx.x
        N = x.shape[1]
        a = float32(0)
        for j in range(tid, N, LN):
            a += x[r, j]
        s1[tid] = a
        cuda.syncthreads()
        stride = LN // 2
        while stride > 0:
            if tid < stride:
                s1[tid] += s1[tid + stride]
            cuda.syncthreads()
            stride //= 2
        mean = s1[0] / N
        q = float32(0)
        for j in range(tid, N, LN):
            if mode == 1:                # E[x^2] - E[x]^2
                q += x[r, j] * x[r, j]
            else:
                c = x[r, j] - mean
                q += c * c
        s2[tid] = q
        cuda.syncthreads()
        stride = LN // 2
        while stride > 0:
            if tid < stride:
                s2[tid] += s2[tid + stride]
            cuda.syncthreads()
            stride //= 2
        if mode == 1:
            var = s2[0] / N - mean * mean
        elif mode == 2:
            var = s2[0] / max(N - 1, 1)
        else:
            var = s2[0] / N
        rstd = float32(1) / math.sqrt(var + eps)
        for j in range(tid, N, LN):
            if mode == 3:
                y[r, j] = (x[r, j] - mean) * rstd
            else:
                y[r, j] = (x[r, j] - mean) * rstd * gamma[j] + beta[j]
    return layernorm


def test_ex03_4_reference_passes(capsys):
    ex03_4(_make_layernorm())
    assert capsys.readouterr().out == "PASS ex03.4\n"


@pytest.mark.parametrize("mode, hint", [
    (1, "cancels catastrophically"),
    (2, "N - 1"),
    (3, "gamma and beta"),
])
def test_ex03_4_wrong_answers_fail(mode, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_4(_make_layernorm(mode))


def test_ex03_4_stub_fails():
    @cuda.jit
    def stub(x, gamma, beta, eps, y):
        pass
    with pytest.raises(GradeError, match="never written"):
        ex03_4(stub)


# ----------------------------------------------------------------------------- CUDA C (GPU)
SUM_ATOMIC = r'''
extern "C" __global__ void sum_atomic(const float* x, float* out, int n) {
    __shared__ float warp_sums[32];
    float v = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        v += x[i];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (lane < blockDim.x / 32) ? warp_sums[lane] : 0.0f;
        for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0) atomicAdd(out, v);
    }
}
'''


@pytest.mark.gpu
def test_ex03_2_reference_passes(capsys):
    ex03_2(SUM_ATOMIC)
    assert capsys.readouterr().out == "PASS ex03.2\n"


@pytest.mark.gpu
@pytest.mark.parametrize("wrong, hint", [
    (SUM_ATOMIC.replace("i += blockDim.x * gridDim.x", "i += n"), "grid-stride"),
    (SUM_ATOMIC.replace("if (lane == 0) atomicAdd(out, v);", "atomicAdd(out, v);"),
     "one atomicAdd per block"),
    (SUM_ATOMIC.replace("__shfl_down_sync(0xffffffffu, v, o)", "0.0f"), "no warp shuffle"),
    (SUM_ATOMIC.replace("v += x[i]", "v += 2.0f * x[i]"), "expected"),
])
def test_ex03_2_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_2(wrong)


@pytest.mark.gpu
def test_ex03_2_race_is_caught_on_repeated_runs():
    # write the warp sums, then read them with no barrier in between; only some runs go wrong
    racy = SUM_ATOMIC.replace("    __syncthreads();\n", "")
    with pytest.raises(GradeError, match="race|expected|NaN|summed"):
        ex03_2(racy)


CONV = r'''
#define T 16
#define MAXK 7
extern "C" __global__ void conv2d_tiled(const float* x, const float* w, float* y, int H, int W,
                                        int K) {
    __shared__ float tile[T + MAXK - 1][T + MAXK - 1];
    int pad = K / 2, side = T + K - 1;
    int r0 = blockIdx.y * T - pad, c0 = blockIdx.x * T - pad;
    for (int t = threadIdx.y * T + threadIdx.x; t < side * side; t += T * T) {
        int i = t / side, j = t % side, rr = r0 + i, cc = c0 + j;
        tile[i][j] = (rr >= 0 && rr < H && cc >= 0 && cc < W) ? x[rr * W + cc] : 0.0f;
    }
    __syncthreads();
    int r = blockIdx.y * T + threadIdx.y, c = blockIdx.x * T + threadIdx.x;
    if (r < H && c < W) {
        float acc = 0.0f;
        for (int a = 0; a < K; a++)
            for (int b = 0; b < K; b++)
                acc += tile[threadIdx.y + a][threadIdx.x + b] * w[a * K + b];
        y[r * W + c] = acc;
    }
}
'''


@pytest.mark.gpu
def test_ex03_5_reference_passes(capsys):
    ex03_5(CONV)
    assert capsys.readouterr().out == "PASS ex03.5\n"


@pytest.mark.gpu
@pytest.mark.parametrize("wrong, hint", [
    (CONV.replace("if (r < H && c < W) {",
                  "if (r >= pad && r < H - pad && c >= pad && c < W - pad) {"), "border"),
    (CONV.replace("(rr >= 0 && rr < H && cc >= 0 && cc < W) ? x[rr * W + cc] : 0.0f",
                  "x[min(max(rr, 0), H - 1) * W + min(max(cc, 0), W - 1)]"), "border"),
    (CONV.replace("if (r < H && c < W) {", "{"), "past the end"),
    (CONV.replace("__shared__", "").replace("tile[T + MAXK", "static float tile[T + MAXK"),
     "shared"),
])
def test_ex03_5_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_5(wrong)


BIAS_GELU = r'''
extern "C" __global__ void bias_gelu(const float* x, const float* b, float* y, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) {
        float z = x[i] + b[i % N];
        y[i] = 0.5f * z * (1.0f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)));
    }
}
'''


@pytest.mark.gpu
def test_ex03_6_reference_passes(capsys):
    ex03_6(BIAS_GELU)
    assert capsys.readouterr().out == "PASS ex03.6\n"


@pytest.mark.gpu
@pytest.mark.parametrize("wrong, hint", [
    (BIAS_GELU.replace("0.5f * z * (1.0f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)))",
                       "0.5f * z * (1.0f + erff(z * 0.70710678f))"), "erf form"),
    (BIAS_GELU.replace("b[i % N]", "b[i / N]"), "indexed by row"),
    (BIAS_GELU.replace(" + b[i % N]", ""), "not added"),
    (BIAS_GELU.replace("if (i < (long long)M * N) {", "{"), "bounds guard"),
    (BIAS_GELU.replace("        y[i] =", "        // y[i] ="), "never written"),
])
def test_ex03_6_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_6(wrong)


@pytest.mark.parametrize("grader", [ex03_2, ex03_5, ex03_6])
def test_cuda_graders_say_they_need_a_gpu(grader):
    if cb.HAS_GPU:
        pytest.skip("GPU present")
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        grader("")
