"""The KV cache (Chapter 7): the Numba twin of kvcache.cu's kv_append_v1. The launch helpers of
the CUDA C++ kernels (kv_append_v1, decode_attention_v1/v2, merge_heads_v1, advance_v1) live in
kvcache_launch.py.

Layout: the caches kc, vc are (B, H, L, D), L positions preallocated per sequence and head.

Numba
  kv_append_v1   k, v (B, T, H, D) -> kc, vc at positions pos0 .. pos0 + T - 1; one thread per
                 element
"""

from __future__ import annotations

import numpy as np
from numba import cuda

import cudabook as cb

TPB = 128      # threads per block


@cuda.jit
def kv_append_v1(k, v, kc, vc, pos0):
    B, T, H, D = k.shape
    i = cuda.grid(1)
    if i < B * T * H * D:
        e = i % D
        h = (i // D) % H
        t = (i // (D * H)) % T
        b = i // (D * H * T)
        kc[b, h, pos0 + t, e] = k[b, t, h, e]
        vc[b, h, pos0 + t, e] = v[b, t, h, e]


def kv_append(k, v, kc, vc, pos0: int):
    """Write k, v (B, T, H, D) float32 into the caches (B, H, L, D) at positions pos0.."""
    cb.expect(k, "k", dtype=np.float32, ndim=4)
    B, T, H, D = k.shape
    cb.expect(v, "v", dtype=np.float32, shape=(B, T, H, D))
    cb.expect(kc, "kc", dtype=np.float32, ndim=4)
    L = kc.shape[2]
    cb.expect(kc, "kc", dtype=np.float32, shape=(B, H, L, D))
    cb.expect(vc, "vc", dtype=np.float32, shape=(B, H, L, D))
    if not 0 <= pos0 <= L - T:
        raise cb.LaunchError(f"positions {pos0}..{pos0 + T - 1} do not fit the cache of {L} "
                             "positions")
    n = B * T * H * D
    if n:
        kv_append_v1[cb.ceil_div(n, TPB), TPB](k, v, kc, vc, pos0)
