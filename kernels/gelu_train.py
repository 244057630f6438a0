"""Numba twins of kernels/gelu_train.cu: GELU (tanh approximation) forward and backward for the
training step, with the CUDA kernels' bf16 roundings.

Numba has no bfloat16. The twins take float32 arrays that hold bf16 values (inputs rounded to
bf16 beforehand, as the tests do) and round each result to bf16, nearest even, where the CUDA
kernels round (``bf16_round``, for values in bf16's normal range), so their outputs are bf16
values held in float32. The arithmetic between the roundings is float32 on a GPU and may be
wider on the simulator.

versions
  gelu_fwd_one      gelu_train_fwd_v1's schedule: one element per thread
  gelu_fwd_chunk8   gelu_train_fwd_v2's schedule: 8 elements per thread, the tail singly
  gelu_bwd_one      gelu_train_bwd_v1's schedule (dh may be dg: in place)
  gelu_bwd_chunk8   gelu_train_bwd_v2's schedule
device functions
  bf16_round(x)         x rounded to the nearest bf16 (ties to even), as __float2bfloat16_rn
  gelu_tanh_grad(z)     common.cuh's gelu_tanh_grad (GELU tanh's derivative)
  (gelu_tanh itself is activation.py's, the twin of common.cuh's)
"""

import math

from numba import cuda

from cudabook.compile import load_module

activation = load_module("activation")     # gelu_tanh, the twin of common.cuh's

SQRT_2_OVER_PI = 0.7978845608028654
CUBIC = 0.044715


@cuda.jit(device=True, inline=True)
def bf16_round(x):
    # x = f 2^e with 0.5 <= |f| < 1; bf16 keeps 8 significant bits: round f * 256 to an
    # integer, ties to even (0, inf and NaN pass through)
    if x == 0.0 or math.isinf(x) or math.isnan(x):
        return x
    f, e = math.frexp(x)
    s = f * 256.0
    r = math.floor(s)
    d = s - r
    if d > 0.5 or (d == 0.5 and r % 2.0 != 0.0):
        r += 1.0
    return math.ldexp(r / 256.0, e)


@cuda.jit(device=True, inline=True)
def gelu_tanh_grad(z):
    # 0.5 (1 + t) + 0.5 z (1 - t^2) k (1 + 3 c z^2), t = tanh(k (z + c z^3))
    t = math.tanh(SQRT_2_OVER_PI * (z + CUBIC * z * z * z))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * z * z)


@cuda.jit
def gelu_fwd_one(h, g):
    # launch: [ceil_div(n, 256), 256]; h, g 1D float32 holding bf16 values
    i = cuda.grid(1)
    if i < h.size:
        g[i] = bf16_round(activation.gelu_tanh(h[i]))


@cuda.jit
def gelu_fwd_chunk8(h, g):
    # launch: [ceil_div(ceil_div(n, 8), 256), 256]; thread t owns [8t, 8t + 8)
    i = 8 * cuda.grid(1)
    n = h.size
    if i + 8 <= n:
        for j in range(8):                  # the CUDA kernel: one 16-byte load, one store
            g[i + j] = bf16_round(activation.gelu_tanh(h[i + j]))
    else:
        while i < n:
            g[i] = bf16_round(activation.gelu_tanh(h[i]))
            i += 1


@cuda.jit
def gelu_bwd_one(dg, h, dh):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)
    if i < h.size:
        dh[i] = bf16_round(dg[i] * gelu_tanh_grad(h[i]))


@cuda.jit
def gelu_bwd_chunk8(dg, h, dh):
    # launch: [ceil_div(ceil_div(n, 8), 256), 256]; thread t owns [8t, 8t + 8)
    i = 8 * cuda.grid(1)
    n = h.size
    if i + 8 <= n:
        for j in range(8):
            dh[i + j] = bf16_round(dg[i + j] * gelu_tanh_grad(h[i + j]))
    else:
        while i < n:
            dh[i] = bf16_round(dg[i] * gelu_tanh_grad(h[i]))
            i += 1
