"""Chapter 1 graders: the reference passes, stubs and plausible wrong answers fail with a hint."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import cudabook as cb
from cudabook.graders import GradeError, ex01_1, ex01_2, ex01_3, ex01_4


@cuda.jit
def _saxpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


@cuda.jit
def _saxpy_no_guard(a, x, y, out):
    i = cuda.grid(1)
    out[i] = a * x[i] + y[i]


def _launch(kernel, blocks_of=lambda n: cb.ceil_div(n, 256)):
    return lambda a, x, y, out: kernel[blocks_of(out.size), 256](a, x, y, out)


def test_ex01_1_reference_passes(capsys):
    ex01_1(_launch(_saxpy))
    assert capsys.readouterr().out == "PASS ex01.1\n"


@pytest.mark.parametrize("wrong, hint", [
    (_launch(_saxpy_no_guard), "missing bounds guard"),
    (_launch(_saxpy, lambda n: n // 256), "never written"),                 # floor, not ceil
    (lambda a, x, y, out: _saxpy[cb.ceil_div(out.size, 256), 256](a, y, x, out), "wrong at"),
    (lambda a, x, y, out: None, "output never written"),                    # no launch at all
])
def test_ex01_1_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_1(wrong)


def test_ex01_1_stub_fails():
    def stub(a, x, y, out):
        raise NotImplementedError("ex01.1")
    with pytest.raises(GradeError, match="not implemented yet"):
        ex01_1(stub)


def test_ex01_1_cached_answer_fails():
    cache = {}

    def cached(a, x, y, out):           # computes once per length, then replays the first answer
        n = out.size
        if n not in cache:
            _saxpy[cb.ceil_div(n, 256), 256](a, x, y, out)
            cache[n] = cb.to_numpy(out).copy()
        out[:] = cache[n] if not cb.HAS_GPU else __import__("cupy").asarray(cache[n])
    with pytest.raises(GradeError, match="wrong at"):
        ex01_1(cached)


@cuda.jit
def _bias(x, b, out):
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = x[row, col] + b[col]


@cuda.jit
def _bias_swapped(x, b, out):
    row, col = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = x[row, col] + b[col]


@cuda.jit
def _bias_by_row(x, b, out):
    col, row = cuda.grid(2)
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = x[row, col] + b[row % b.size]


@cuda.jit
def _bias_col_guard_only(x, b, out):
    col, row = cuda.grid(2)
    if col < out.shape[1]:
        out[row, col] = x[row, col] + b[col]


def test_ex01_3_reference_passes(capsys):
    ex01_3(_bias)
    assert capsys.readouterr().out == "PASS ex01.3\n"


@pytest.mark.parametrize("wrong, hint", [
    (_bias_swapped, "swapped"),
    (_bias_by_row, "indexed by row"),
    (_bias_col_guard_only, "bounds guard"),
])
def test_ex01_3_wrong_answers_fail(wrong, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_3(wrong)


# ----------------------------------------------------------------------------- CUDA C (GPU)
RELU = r'''extern "C" __global__ void relu_forward(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    %s
}'''


@pytest.mark.gpu
def test_ex01_2_reference_and_wrong_answers():
    ex01_2(RELU % "if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;")
    for body, hint in [("y[i] = x[i] > 0.0f ? x[i] : 0.0f;", "bounds guard"),   # no guard
                       ("if (i < n) y[i] = x[i];", "wrong at"),
                       ("", "never written"),                                    # the stub
                       ("if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f", "does not compile"),
                       ("if (i < n - 1) y[i] = fmaxf(x[i], 0.0f);", "never written")]:
        with pytest.raises(GradeError, match=hint):
            ex01_2(RELU % body)


SGD = r'''extern "C" __global__ void sgd_update(float* w, const float* g, float lr, int n) {
    %s
}'''


@pytest.mark.gpu
def test_ex01_4_reference_and_wrong_answers():
    ex01_4(SGD % "for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; "
                 "i += blockDim.x * gridDim.x) w[i] -= lr * g[i];")
    for body, hint in [
        ("int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) w[i] -= lr * g[i];",
         "never updated"),                                                   # no loop
        ("for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x) "
         "w[i] -= lr * g[i];", "more than once"),                            # block stride
        ("for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n + 200; "
         "i += blockDim.x * gridDim.x) w[i] -= lr * g[i];", "past the end"),
        ("", "never updated"),                                               # the stub
    ]:
        with pytest.raises(GradeError, match=hint):
            ex01_4(SGD % body)


def test_cuda_graders_refuse_in_simulator():
    if cb.HAS_GPU:
        pytest.skip("GPU machine")
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        ex01_2(RELU % "")
    np.testing.assert_equal(cb.SIM, True)
