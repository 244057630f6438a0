"""Launching kernels/activation.cu: the activations and the fused bias + GELU.

    al = cb.load_launch("activation")
    y = al.bias_gelu(x, b)             # bias_gelu_v2: gelu_tanh(x + b[col]) for (M, N) x
    y = al.activation(x, "gelu_v2")    # relu_v1, gelu_v1 (tanh), gelu_v2 (erf)
    dh = al.gelu_backward(h, b, dy)    # Chapter 6: dy * gelu_tanh'(h + b[col]), the backward
    y = al.bias_add(x, b)              # x + b[col] (float32 or float64)
    y = al.bias_gelu_f64(x, b)         # bias_gelu in double (gradcheck)
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["ACTIVATIONS", "activation", "bias_gelu", "bias_add", "bias_gelu_f64",
           "gelu_backward", "sanitize_targets"]

ACTIVATIONS = ("relu_v1", "gelu_v1", "gelu_v2")

def _module():
    return cb.module("activation")     # compiled once per process


def activation(x, version: str = "gelu_v1", y=None):
    """y = f(x) elementwise for a float32 array of any shape (C-contiguous)."""
    import cupy as cp

    if version not in ACTIVATIONS:
        raise ValueError(f"unknown version {version!r}; activation.cu has {ACTIVATIONS}")
    mod = _module()
    cb.expect(x, "x", dtype=np.float32)
    n = int(np.prod(x.shape))
    y = cp.empty(x.shape, cp.float32) if y is None else y
    cb.expect(y, "y", dtype=np.float32, shape=tuple(x.shape))
    if n >= 2**31:
        raise LaunchError(f"{version}: the kernel indexes with int; {n} >= 2^31 elements")
    if n:
        mod.get(version)((ceil_div(n, 256),), (256,), (x, y, np.int32(n)))
    return y


def bias_gelu(x, b, y=None, version: str = "bias_gelu_v2"):
    """y = gelu_tanh(x + b[col]) for float32 x (M, N) and b (N,)."""
    import cupy as cp

    mod = _module()
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    cb.expect(b, "b", dtype=np.float32, shape=(N,))
    y = cp.empty((M, N), cp.float32) if y is None else y
    cb.expect(y, "y", dtype=np.float32, shape=(M, N))
    if M * N == 0:
        return y
    if version == "bias_gelu_v2":
        grid = (min(ceil_div(M * N // 4 or 1, 256), 8 * max(cb.env.info().sms, 1)),)
    elif version == "bias_gelu_v1":
        grid = (ceil_div(M * N, 256),)
    else:
        raise ValueError(f"unknown version {version!r}; bias_gelu_v1 or bias_gelu_v2")
    mod.get(version)(grid, (256,), (x, b, y, np.int32(M), np.int32(N)))
    return y


_F64 = {"bias_add_v1": "bias_add_f64", "bias_gelu_v1": "bias_gelu_f64",
        "gelu_backward_v1": "gelu_backward_f64"}


def _rowwise(version: str, x, b, extra, out, names: tuple[str, ...]):
    """Launch an (M, N) + bias (N,) kernel of activation.cu, float32 or float64 (Chapter 6)."""
    import cupy as cp

    cb.expect(x, names[0], ndim=2)
    dt = np.dtype(str(x.dtype).replace("torch.", ""))
    if dt == np.float64:
        version = _F64[version]
    elif dt != np.float32:
        raise TypeError(f"{names[0]}: expected float32 or float64, got {dt}")
    M, N = (int(s) for s in x.shape)
    cb.expect(b, "b", dtype=dt, shape=(N,))
    if extra is not None:
        cb.expect(extra, names[1], dtype=dt, shape=(M, N))
    out = cp.empty((M, N), dt) if out is None else out
    cb.expect(out, names[-1], dtype=dt, shape=(M, N))
    if M * N >= 2**62:
        raise LaunchError(f"{version}: too many elements")
    if M * N:
        args = (x, b) + ((extra,) if extra is not None else ()) + (out, np.int32(M), np.int32(N))
        _module().get(version)((ceil_div(M * N, 256),), (256,), args)
    return out


def bias_add(x, b, y=None):
    """y = x + b[col] (bias_add_v1; bias_add_f64 for float64)."""
    return _rowwise("bias_add_v1", x, b, None, y, ("x", "y"))


def bias_gelu_f64(x, b, y=None):
    """y = gelu_tanh(x + b[col]) in double (bias_gelu_f64), for gradcheck."""
    cb.expect(x, "x", dtype=np.float64, ndim=2)
    return _rowwise("bias_gelu_v1", x, b, None, y, ("x", "y"))


def gelu_backward(h, b, dy, dh=None):
    """dh = dy * gelu_tanh'(h + b[col]): the backward of bias_gelu from its input h (before the
    bias); gelu_backward_v1, or gelu_backward_f64 for float64."""
    return _rowwise("gelu_backward_v1", h, b, dy, dh, ("h", "dy", "dh"))


def sanitize_targets():
    """The fused kernels on N % 4 != 0 (v2's scalar path) and N % 4 == 0 (memcheck)."""
    import cupy as cp

    for M, N in ((7, 33), (5, 64)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        b = cp.random.standard_normal(N, dtype=cp.float32)
        for v in ("bias_gelu_v1", "bias_gelu_v2"):
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, b=b: bias_gelu(x, b, version=v))
    h = cp.random.standard_normal((7, 33), dtype=cp.float32)
    b = cp.random.standard_normal(33, dtype=cp.float32)
    yield "gelu_backward_v1 (7x33)", (lambda: gelu_backward(h, b, h))
    x = cp.random.standard_normal(1003, dtype=cp.float32)
    for v in ACTIVATIONS:
        yield v, (lambda v=v: activation(x, v))
