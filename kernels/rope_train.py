"""RoPE for training (kernels/rope_train.cu), the Numba twin: forward and backward rotation of
x (BH, T, D) in place, row t of each (T, D) matrix at position t, half-split pairs (i, i + D/2).

Numba has no bf16: the twin works on float32 arrays and rounds nowhere; the CUDA kernels round
each output to bf16 once (the twin's result rounded to bf16 is what they write).

Numba
  rope_train   one thread per pair, like rope_train_v1; sign +1 forward, -1 backward
"""

from __future__ import annotations

import numpy as np
from numba import cuda

import cudabook as cb

TPB = 128


@cuda.jit
def rope_train(x, cos_t, sin_t, sign):
    BH, T, D = x.shape
    half = D // 2
    idx = cuda.grid(1)
    if idx < BH * T * half:
        i = idx % half
        t = (idx // half) % T
        bh = idx // (half * T)
        c, s = cos_t[t, i], sin_t[t, i]
        a, b = x[bh, t, i], x[bh, t, i + half]
        x[bh, t, i] = a * c - sign * (b * s)
        x[bh, t, i + half] = b * c + sign * (a * s)


def rope(x: np.ndarray, cos_t: np.ndarray, sin_t: np.ndarray, inverse: bool = False):
    """Rotate x (BH, T, D) float32 in place with the Numba twin (simulator or GPU); returns x."""
    BH, T, D = x.shape
    if D % 2:
        raise ValueError(f"head dimension {D} must be even")
    if cos_t.shape[0] < T or cos_t.shape[1] != D // 2 or sin_t.shape != cos_t.shape:
        raise ValueError(f"tables must be (>= {T}, {D // 2}), got {cos_t.shape}, {sin_t.shape}")
    n = BH * T * (D // 2)
    d = cuda.to_device(np.ascontiguousarray(x, np.float32))
    rope_train[cb.launch.ceil_div(max(n, 1), TPB), TPB](
        d, cuda.to_device(np.ascontiguousarray(cos_t, np.float32)),
        cuda.to_device(np.ascontiguousarray(sin_t, np.float32)), np.float32(-1 if inverse else 1))
    x[...] = d.copy_to_host()
    return x
