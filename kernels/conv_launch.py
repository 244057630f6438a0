"""Launching kernels/conv.cu: 'same' cross-correlation with zero padding, float32.

    cl = cb.load_launch("conv")
    y = cl.conv2d(x, w)                        # conv2d_v2: (H, W) image, (K, K) filter, K odd <= 7
    y = cl.conv2d(x, w, version="conv2d_v3")   # the filter in __constant__ memory ("v3")

    VERSIONS, MAX_K                the 2D ladder; the largest filter of v2 / v3's shared tile
    config(version, H, W)          -> Launch(grid, block=(16, 16), kernel=version)
    conv2d(x, w, y=None, version)  the entry point: checks, config, launch, returns y
    sanitize_targets()             the 2D versions, conv1d_v1 and the multi-channel conv2d_v4

The checks, before anything is launched: x float32 (H, W), w float32 (K, K) with K odd (at most
MAX_K for v2 and v3), C-contiguous, on the GPU; y float32 (H, W) (allocated by x's library when
not given).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, grid_2d, version_name

__all__ = ["VERSIONS", "MAX_K", "conv2d", "config", "sanitize_targets"]

VERSIONS = ("conv2d_v1", "conv2d_v2", "conv2d_v3")
MAX_K = 7                         # CONV_MAX_K of conv.cu: the shared tile's halo


def _module():
    return cb.module("conv")     # the whole file, compiled once per process


def config(version: str, H: int, W: int) -> Launch:
    """Grid and block of ``version`` for an H x W image: a 16 x 16 block per 16 x 16 outputs."""
    version = version_name(VERSIONS, version, "conv2d")
    return Launch(grid_2d(H, W, 16), (16, 16), kernel=version)


def conv2d(x, w, y=None, version: str = "conv2d_v2"):
    """y[r, c] = sum_{a,b} x[r + a - K//2, c + b - K//2] w[a, b], zeros outside the image;
    returns y. ``version``: "conv2d_v2" or "v2"."""
    version = version_name(VERSIONS, version, "conv2d")
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
    if y is None:
        y = cb.arrays.empty_like_lib(x, (H, W), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=(H, W))
    cfg = config(version, H, W)
    xc, yc = cb.as_cupy(x, "x"), cb.as_cupy(y, "y")
    dims = (np.int32(H), np.int32(W), np.int32(K))
    with cb.arrays.launch_stream(x, w, y):
        if version == "conv2d_v3":             # the filter goes to __constant__ memory first
            import cupy as cp

            filt = cp.ndarray((MAX_K * MAX_K,), cp.float32, mod.raw.get_global("conv_filter"))
            filt[: K * K] = cb.as_cupy(w, "w").ravel()
            args = (xc, yc, *dims)
        else:
            args = (xc, cb.as_cupy(w, "w"), yc, *dims)
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return y


def sanitize_targets():
    """The 2D versions on a ragged image with each filter size (racecheck: the tile and its
    halo), the 1D and the multi-channel direct convolutions (memcheck)."""
    import cupy as cp

    mod = _module()
    x = cp.random.standard_normal((19, 35), dtype=cp.float32)
    for K in (1, 3, 7):
        w = cp.random.standard_normal((K, K), dtype=cp.float32)
        for v in VERSIONS:
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
