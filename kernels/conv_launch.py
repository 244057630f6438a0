"""Launching kernels/conv.cu: 'same' cross-correlation with zero padding, float32.

    cl = cb.load_launch("conv")
    y = cl.conv2d(x, w)                        # conv2d_v2: (H, W) image, (K, K) filter, K odd <= 7
    y = cl.conv2d(x, w, version="conv2d_v3")   # the filter in __constant__ memory
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, grid_2d

__all__ = ["MAX_K", "conv2d", "sanitize_targets"]

MAX_K = 7                         # CONV_MAX_K of conv.cu: the shared tile's halo

def _module():
    return cb.module("conv")     # compiled once per process


def conv2d(x, w, y=None, version: str = "conv2d_v2"):
    """y[r, c] = sum_{a,b} x[r + a - K//2, c + b - K//2] w[a, b], zeros outside the image."""
    import cupy as cp

    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    cb.expect(w, "w", dtype=np.float32, ndim=2)
    H, W = (int(s) for s in x.shape)
    K = int(w.shape[0])
    if tuple(w.shape) != (K, K) or K % 2 == 0:
        raise LaunchError(f"conv2d: the filter must be K x K with K odd, got {tuple(w.shape)}")
    if version in ("conv2d_v2", "conv2d_v3") and K > MAX_K:
        raise LaunchError(f"conv2d: {version}'s shared tile holds filters up to {MAX_K} x "
                          f"{MAX_K}, got K = {K}; use version='conv2d_v1' (no tile)")
    y = cp.empty((H, W), cp.float32) if y is None else y
    cb.expect(y, "y", dtype=np.float32, shape=(H, W))
    grid, args = grid_2d(H, W, 16), (x, w, y, np.int32(H), np.int32(W), np.int32(K))
    if version == "conv2d_v3":
        filt = cp.ndarray((MAX_K * MAX_K,), cp.float32, mod.raw.get_global("conv_filter"))
        filt[: K * K] = w.ravel()
        args = (x, y, np.int32(H), np.int32(W), np.int32(K))
    elif version not in ("conv2d_v1", "conv2d_v2"):
        raise ValueError(f"unknown version {version!r}; conv2d_v1, conv2d_v2 or conv2d_v3")
    mod.get(version)(grid, (16, 16), args)
    return y


def sanitize_targets():
    """The 2D versions on a ragged image with each filter size (racecheck: the tile and its
    halo), the 1D and the multi-channel direct convolutions (memcheck)."""
    import cupy as cp

    mod = _module()
    x = cp.random.standard_normal((19, 35), dtype=cp.float32)
    for K in (1, 3, 7):
        w = cp.random.standard_normal((K, K), dtype=cp.float32)
        for v in ("conv2d_v1", "conv2d_v2", "conv2d_v3"):
            yield f"{v} K={K}", (lambda v=v, w=w: conv2d(x, w, version=v))
    x1, w1, y1 = (cp.random.standard_normal(n, dtype=cp.float32) for n in (300, 5, 300))
    yield "conv1d_v1", lambda: mod.conv1d_v1((2,), (256,), (x1, w1, y1, np.int32(300),
                                                            np.int32(5)))
    B, C, CO, H, W, K = 2, 3, 4, 19, 21, 3
    xc = cp.random.standard_normal((B, C, H, W), dtype=cp.float32)
    wc = cp.random.standard_normal((CO, C, K, K), dtype=cp.float32)
    yc = cp.empty((B, CO, H, W), cp.float32)
    yield "conv2d_v4", lambda: mod.conv2d_v4(
        (2, 2, B * CO), (16, 16), (xc, wc, yc, *(np.int32(v) for v in (B, C, CO, H, W, K))))
