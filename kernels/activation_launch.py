"""Launching kernels/activation.cu: the activations and the fused bias + GELU.

    al = cb.load_launch("activation")
    y = al.bias_gelu(x, b)             # bias_gelu_v2: gelu_tanh(x + b[col]) for (M, N) x
    y = al.activation(x, "gelu_v2")    # relu_v1, gelu_v1 (tanh), gelu_v2 (erf)
    dh = al.gelu_backward(h, b, dy)    # Chapter 6: dy * gelu_tanh'(h + b[col]), the backward
    y = al.bias_add(x, b)              # x + b[col] (float32 or float64)
    y = al.bias_gelu_f64(x, b)         # bias_gelu in double (gradcheck)

    ACTIVATIONS, BIAS_GELU_VERSIONS    the element-wise kernels; the fused bias + GELU ladder
    config(kernel, M, N, sms)          -> Launch(grid, block=256, kernel=kernel) of any kernel of
                                       the file (n = M * N elements; bias_gelu_v2: a grid-stride
                                       loop of at most 8 blocks per SM)
    activation(x, version, y=None)     the element-wise entry point (any shape)
    bias_gelu(x, b, y=None, version), bias_add(x, b, y=None), bias_gelu_f64(x, b, y=None),
    gelu_backward(h, b, dy, dh=None)   the row-wise entry points ((M, N) and a bias (N,))
    sanitize_targets()

The checks, before anything is launched: float32 arrays (the row-wise kernels but bias_gelu also
float64), C-contiguous, on the GPU; b of shape (N,), the other arrays of x's shape; outputs
allocated by x's library when not given; fewer than 2^31 elements for the element-wise kernels.
Versions are spelled "bias_gelu_v2" or "v2" (the activations by their full names).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name
from cudabook.validate import dtype_name

__all__ = ["ACTIVATIONS", "BIAS_GELU_VERSIONS", "activation", "bias_gelu", "bias_add",
           "bias_gelu_f64", "gelu_backward", "config", "sanitize_targets"]

ACTIVATIONS = ("relu_v1", "gelu_v1", "gelu_v2")
BIAS_GELU_VERSIONS = ("bias_gelu_v1", "bias_gelu_v2")
#: the row-wise kernels: float32 name -> float64 twin
_F64 = {"bias_add_v1": "bias_add_f64", "bias_gelu_v1": "bias_gelu_f64",
        "gelu_backward_v1": "gelu_backward_f64"}
_KERNELS = ACTIVATIONS + BIAS_GELU_VERSIONS + tuple(_F64) + tuple(_F64.values())


def _module():
    return cb.module("activation")     # the whole file, compiled once per process


def config(kernel: str, M: int, N: int = 1, sms: int | None = None) -> Launch:
    """Grid and block of ``kernel`` over M * N elements (an activation: N = 1, M = the size):
    a thread per element in blocks of 256; bias_gelu_v2 moves 16 bytes per thread in a
    grid-stride loop of at most 8 blocks per SM (``sms``: default this GPU's)."""
    if kernel not in _KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; activation.cu has {_KERNELS}")
    n = M * N
    if kernel == "bias_gelu_v2":
        sms = cb.launch.device().sms if sms is None else sms
        return Launch((min(ceil_div(n // 4 or 1, 256), 8 * max(sms, 1)),), (256,), kernel=kernel)
    return Launch((ceil_div(n, 256),), (256,), kernel=kernel)


def _run(cfg: Launch, arrays: tuple, scalars: tuple) -> None:
    args = tuple(cb.as_cupy(a) for a in arrays) + scalars
    cb.launch.run(_module().get(cfg.kernel), cfg, args, stream=cb.stream_for(*arrays))


def activation(x, version: str = "gelu_v1", y=None):
    """y = f(x) elementwise for a float32 array of any shape (C-contiguous); returns y."""
    version = version_name(ACTIVATIONS, version, "activation")
    _module()
    cb.expect(x, "x", dtype=np.float32)
    n = int(np.prod(x.shape))
    if y is None:
        y = cb.arrays.empty_like_lib(x, tuple(x.shape), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=tuple(x.shape))
    if n >= 2**31:
        raise LaunchError(f"{version}: the kernel indexes with int; {n} >= 2^31 elements")
    if n:
        _run(config(version, n), (x, y), (np.int32(n),))
    return y


def bias_gelu(x, b, y=None, version: str = "bias_gelu_v2"):
    """y = gelu_tanh(x + b[col]) for float32 x (M, N) and b (N,); returns y. ``version``:
    "bias_gelu_v2" or "v2"."""
    version = version_name(BIAS_GELU_VERSIONS, version, "bias_gelu")
    _module()
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    cb.expect(b, "b", dtype=np.float32, shape=(N,))
    if y is None:
        y = cb.arrays.empty_like_lib(x, (M, N), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=(M, N))
    if M * N:
        _run(config(version, M, N), (x, b, y), (np.int32(M), np.int32(N)))
    return y


def _rowwise(version: str, x, b, extra, out, names: tuple[str, ...]):
    """Launch an (M, N) + bias (N,) kernel of activation.cu, float32 or float64 (Chapter 6)."""
    cb.expect(x, names[0], ndim=2)
    dt = dtype_name(x.dtype)
    if dt == "float64":
        version = _F64[version]
    elif dt != "float32":
        raise TypeError(f"{names[0]}: expected float32 or float64, got {dt}")
    M, N = (int(s) for s in x.shape)
    cb.expect(b, "b", dtype=dt, shape=(N,))
    if extra is not None:
        cb.expect(extra, names[1], dtype=dt, shape=(M, N))
    if out is None:
        out = cb.arrays.empty_like_lib(x, (M, N), dt)
    cb.expect(out, names[-1], dtype=dt, shape=(M, N))
    if M * N >= 2**62:
        raise LaunchError(f"{version}: too many elements")
    if M * N:
        arrays = (x, b) + ((extra,) if extra is not None else ()) + (out,)
        _run(config(version, M, N), arrays, (np.int32(M), np.int32(N)))
    return out


def bias_add(x, b, y=None):
    """y = x + b[col] (bias_add_v1; bias_add_f64 for float64); returns y."""
    return _rowwise("bias_add_v1", x, b, None, y, ("x", "y"))


def bias_gelu_f64(x, b, y=None):
    """y = gelu_tanh(x + b[col]) in double (bias_gelu_f64), for gradcheck; returns y."""
    cb.expect(x, "x", dtype=np.float64, ndim=2)
    return _rowwise("bias_gelu_v1", x, b, None, y, ("x", "y"))


def gelu_backward(h, b, dy, dh=None):
    """dh = dy * gelu_tanh'(h + b[col]): the backward of bias_gelu from its input h (before the
    bias); gelu_backward_v1, or gelu_backward_f64 for float64; returns dh."""
    return _rowwise("gelu_backward_v1", h, b, dy, dh, ("h", "dy", "dh"))


def sanitize_targets():
    """The fused kernels on N % 4 != 0 (v2's scalar path) and N % 4 == 0 (memcheck)."""
    import cupy as cp

    for M, N in ((7, 33), (5, 64)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        b = cp.random.standard_normal(N, dtype=cp.float32)
        for v in BIAS_GELU_VERSIONS:
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, b=b: bias_gelu(x, b, version=v))
    h = cp.random.standard_normal((7, 33), dtype=cp.float32)
    b = cp.random.standard_normal(33, dtype=cp.float32)
    yield "gelu_backward_v1 (7x33)", (lambda: gelu_backward(h, b, h))
    x = cp.random.standard_normal(1003, dtype=cp.float32)
    for v in ACTIVATIONS:
        yield v, (lambda v=v: activation(x, v))
