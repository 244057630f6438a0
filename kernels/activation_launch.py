"""Launching kernels/activation.cu: the activations and the fused bias + GELU.

    al = cb.load_launch("activation")
    y = al.bias_gelu(x, b)             # bias_gelu_v2: gelu_tanh(x + b[col]) for (M, N) x
    y = al.activation(x, "gelu_v2")    # relu_v1, gelu_v1 (tanh), gelu_v2 (erf)
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["ACTIVATIONS", "activation", "bias_gelu", "sanitize_targets"]

ACTIVATIONS = ("relu_v1", "gelu_v1", "gelu_v2")

def _module():
    return cb.cuda_module("activation")     # compiled once per process


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


def sanitize_targets():
    """The fused kernels on N % 4 != 0 (v2's scalar path) and N % 4 == 0 (memcheck)."""
    import cupy as cp

    for M, N in ((7, 33), (5, 64)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        b = cp.random.standard_normal(N, dtype=cp.float32)
        for v in ("bias_gelu_v1", "bias_gelu_v2"):
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, b=b: bias_gelu(x, b, version=v))
    x = cp.random.standard_normal(1003, dtype=cp.float32)
    for v in ACTIVATIONS:
        yield v, (lambda v=v: activation(x, v))
