"""Rotary position embedding (Chapter 7): the Numba twin of rope.cu's rope_v1. The launch helpers
of the CUDA C++ kernels (rope_v1, rope_qkv_v1) live in rope_launch.py.

Half-split pairs: element i of a head vector (dimension D) rotates with element i + D/2 by the
angle pos * base^(-2i/D).

Numba
  rope_v1   in place on x (R, H, D) float32, row r at position pos[r]; one thread per pair
            (rope.cu's rope_v1 takes pos0 + r % T instead of a position array)
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

import cudabook as cb

TPB = 128      # threads per block


@cuda.jit
def rope_v1(x, pos, log2_base):
    R, H, D = x.shape
    half = D // 2
    t = cuda.grid(1)
    if t < R * H * half:
        i = t % half
        h = (t // half) % H
        r = t // (half * H)
        ang = pos[r] * 2.0 ** (-2.0 * i / D * log2_base)     # pos * base^(-2i/D)
        c, s = math.cos(ang), math.sin(ang)
        a, b = x[r, h, i], x[r, h, i + half]
        x[r, h, i] = a * c - b * s
        x[r, h, i + half] = b * c + a * s


def rope(x, pos, base: float = 10000.0):
    """Rotate x (R, H, D) float32 in place (a Numba device array, or host in the simulator)."""
    cb.expect(x, "x", dtype=np.float32, ndim=3)
    cb.expect(pos, "pos", dtype=np.int32, shape=(x.shape[0],))
    R, H, D = x.shape
    if D % 2:
        raise ValueError(f"head dimension {D} must be even (pairs i, i + D/2)")
    n = R * H * (D // 2)
    if n:
        rope_v1[cb.ceil_div(n, TPB), TPB](x, pos, np.float64(math.log2(base)))
    return x
