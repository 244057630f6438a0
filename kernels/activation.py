"""Numba twins of kernels/activation.cu: activations and the fused bias+GELU (Chapter 3).

versions
  relu_v1        y = max(x, 0), one thread per element
  gelu_v1        GELU, tanh approximation
  gelu_v2        GELU, exact erf form
  bias_add_v1    y = x + b[col] for (M, N) x: the first of the unfused pair
  bias_gelu_v1   fused y = gelu_tanh(x + b[col]): x + b never goes to memory
"""

import math

from numba import cuda

GELU_SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


@cuda.jit(device=True, inline=True)
def gelu_tanh(v):
    return 0.5 * v * (1.0 + math.tanh(GELU_SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v * v)))


@cuda.jit
def relu_v1(x, y):
    # launch: [ceil_div(n, 256), 256]; x, y 1D
    i = cuda.grid(1)
    if i < y.size:
        y[i] = max(x[i], 0.0)


@cuda.jit
def gelu_v1(x, y):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)
    if i < y.size:
        y[i] = gelu_tanh(x[i])


@cuda.jit
def gelu_v2(x, y):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)
    if i < y.size:
        v = x[i]
        y[i] = 0.5 * v * (1.0 + math.erf(v * 0.7071067811865476))


@cuda.jit
def bias_add_v1(x, b, y):
    # launch: [(ceil_div(N, 16), ceil_div(M, 16)), (16, 16)]; x, y (M, N); b (N,)
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        y[row, col] = x[row, col] + b[col]


@cuda.jit
def bias_gelu_v1(x, b, y):
    # launch: [(ceil_div(N, 16), ceil_div(M, 16)), (16, 16)]
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        y[row, col] = gelu_tanh(x[row, col] + b[col])
