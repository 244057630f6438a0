"""Launching kernels/im2col.cu (and its Numba twins): a convolution as im2col + matmul.

    ic = cb.load_launch("im2col")
    cols = ic.im2col(x, K=3)                   # x (B, H, W, C) NHWC -> cols (B Ho Wo, K K C)
    dx = ic.col2im(dcols, x.shape, K=3)        # the gradient: the adjoint of im2col
    ic.im2col_numba(x, cols, K=3)              # the Numba twins (simulator or GPU)
    ic.col2im_numba(dcols, dx, K=3)
    Ho, Wo = ic.out_size(H, W, K, pad)

    KERNELS                        im2col_v1 / col2im_v1 (float32), the _f64 twins
    config(kernel, n)              -> Launch(grid, block=256, kernel=kernel): a thread per output
    im2col(x, K, pad=None, cols=None), col2im(dcols, x_shape, K, pad=None, dx=None)
                                   the entry points: checks, config, launch, return the output
    im2col_numba / col2im_numba    the Numba twins, with the same checks
    out_size(H, W, K, pad)         the output's size, or the reason there is none
    sanitize_targets()

Stride 1, zero padding ``pad`` (default K // 2: the output has the input's size), 0 <= pad < K.
float32 runs im2col_v1 / col2im_v1, float64 the _f64 kernels. The checks, before anything is
launched: float32 or float64, C-contiguous (a strided view, an NCHW tensor permuted to NHWC say,
is refused, not read as if it were dense), on the GPU; x 4D NHWC, not empty; K and pad that give
an output; outputs of the input's dtype and the right shape (allocated by the input's library
when not given); sizes that 32-bit indices reach.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div
from cudabook.validate import dtype_name

__all__ = ["KERNELS", "out_size", "im2col", "col2im", "im2col_numba", "col2im_numba", "config",
           "sanitize_targets"]

_BY_DTYPE = {"float32": ("im2col_v1", "col2im_v1"), "float64": ("im2col_f64", "col2im_f64")}
KERNELS = tuple(k for pair in _BY_DTYPE.values() for k in pair)
_THREADS = 256


def _module():
    return cb.module("im2col")     # the whole file, compiled once per process


def config(kernel: str, n: int) -> Launch:
    """Grid and block of ``kernel`` writing n outputs: a thread each, blocks of 256 (im2col:
    n = B Ho Wo K K C; col2im, a gather: n = B H W C)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; im2col.cu has {KERNELS}")
    return Launch((ceil_div(n, _THREADS),), (_THREADS,), kernel=kernel)


def _dtype(a: Any, name: str) -> str:
    dt = dtype_name(a.dtype)
    if dt not in _BY_DTYPE:
        raise TypeError(f"{name}: expected float32 or float64, got {dt} (use .astype(float32))")
    return dt


def out_size(H: int, W: int, K: int, pad: int | None = None) -> tuple[int, int]:
    """(Ho, Wo) of a K x K filter, stride 1, zero padding ``pad`` (default K // 2), on H x W.
    Refuses a K, pad or image that gives no output, with the reason."""
    for name, v in (("H", H), ("W", W), ("K", K)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"im2col: {name} must be a positive int, got {v!r}")
    pad = K // 2 if pad is None else pad
    if not isinstance(pad, (int, np.integer)) or isinstance(pad, bool) or not 0 <= pad < K:
        raise ValueError(f"im2col: pad must be an int with 0 <= pad < K = {K}, got {pad!r} "
                         "(pad = K // 2 keeps the image size)")
    Ho, Wo = H + 2 * pad - K + 1, W + 2 * pad - K + 1
    if Ho < 1 or Wo < 1:
        raise ValueError(f"im2col: a {K}x{K} filter with pad {pad} does not fit a {H}x{W} image "
                         f"(output {Ho}x{Wo}); use a smaller K or more padding")
    return int(Ho), int(Wo)


def _dims(shape: Any, K: int, pad: int | None) -> tuple[int, int, int, int, int, int, int, int]:
    shp = tuple(int(s) for s in shape)
    if len(shp) != 4:
        raise ValueError(f"im2col: the image must be 4D NHWC (B, H, W, C), got shape {shp}; a batch of "
                         "single-channel images (B, H, W) is x[..., None]")
    B, H, W, C = shp
    if B < 1 or C < 1:
        raise ValueError(f"im2col: empty input, shape {shp}")
    pad = K // 2 if pad is None else pad
    Ho, Wo = out_size(H, W, K, pad)
    if K * K * C >= 2**31 or B * max(H * W * C, Ho * Wo * K * K * C) >= 2**62:
        raise LaunchError(f"im2col: shape {shp} with K = {K} is too large to index")
    return B, H, W, C, K, pad, Ho, Wo


def _run(cfg: Launch, src, dst, dims: tuple) -> None:
    cb.launch.run(_module().get(cfg.kernel), cfg,
                  (cb.as_cupy(src), cb.as_cupy(dst), *(np.int32(v) for v in dims)),
                  stream=cb.stream_for(src, dst))


def im2col(x: Any, K: int, pad: int | None = None, cols: Any = None) -> Any:
    """cols (B Ho Wo, K K C) of a contiguous NHWC ``x`` (B, H, W, C), float32 or float64."""
    cb.expect(x, "x")
    dt = _dtype(x, "x")
    B, H, W, C, K, pad, Ho, Wo = _dims(x.shape, K, pad)
    shape = (B * Ho * Wo, K * K * C)
    if cols is None:
        cols = cb.arrays.empty_like_lib(x, shape, dt)
    cb.expect(cols, "cols", dtype=dt, shape=shape)
    _run(config(_BY_DTYPE[dt][0], shape[0] * shape[1]), x, cols, (B, H, W, C, K, pad, Ho, Wo))
    return cols


def col2im(dcols: Any, x_shape: tuple, K: int, pad: int | None = None, dx: Any = None) -> Any:
    """dx (B, H, W, C): the gradient of im2col's input from ``dcols`` (B Ho Wo, K K C)."""
    B, H, W, C, K, pad, Ho, Wo = _dims(x_shape, K, pad)
    cb.expect(dcols, "dcols", shape=(B * Ho * Wo, K * K * C))
    dt = _dtype(dcols, "dcols")
    if dx is None:
        dx = cb.arrays.empty_like_lib(dcols, (B, H, W, C), dt)
    cb.expect(dx, "dx", dtype=dt, shape=(B, H, W, C))
    _run(config(_BY_DTYPE[dt][1], B * H * W * C), dcols, dx, (B, H, W, C, K, pad, Ho, Wo))
    return dx


def im2col_numba(x: Any, cols: Any, K: int, pad: int | None = None) -> None:
    """The Numba twin im2col_v1 into ``cols`` (the same checks as ``im2col``)."""
    cb.expect(x, "x")
    dt = _dtype(x, "x")
    B, H, W, C, K, pad, Ho, Wo = _dims(x.shape, K, pad)
    cb.expect(cols, "cols", dtype=dt, shape=(B * Ho * Wo, K * K * C))
    n = B * Ho * Wo * K * K * C
    cb.load_numba("im2col").im2col_v1[ceil_div(n, _THREADS), _THREADS](x, cols, K, pad)


def col2im_numba(dcols: Any, dx: Any, K: int, pad: int | None = None) -> None:
    """The Numba twin col2im_v1 into ``dx`` (B, H, W, C)."""
    cb.expect(dx, "dx")
    B, H, W, C, K, pad, Ho, Wo = _dims(dx.shape, K, pad)
    dt = _dtype(dx, "dx")
    cb.expect(dcols, "dcols", dtype=dt, shape=(B * Ho * Wo, K * K * C))
    n = B * H * W * C
    cb.load_numba("im2col").col2im_v1[ceil_div(n, _THREADS), _THREADS](dcols, dx, K, pad)


def sanitize_targets():
    """Both kernels on ragged shapes, with and without padding (memcheck: the border guards)."""
    import cupy as cp

    x = cp.random.standard_normal((3, 7, 5, 3), dtype=cp.float32)
    for K, pad in ((3, 1), (5, 2), (3, 0)):
        Ho, Wo = out_size(7, 5, K, pad)
        d = cp.random.standard_normal((3 * Ho * Wo, K * K * 3), dtype=cp.float32)
        yield f"im2col_v1 (3x7x5x3, K={K}, pad={pad})", (lambda K=K, pad=pad: im2col(x, K, pad))
        yield f"col2im_v1 (3x7x5x3, K={K}, pad={pad})", \
            (lambda d=d, K=K, pad=pad: col2im(d, x.shape, K, pad))
