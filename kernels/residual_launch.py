"""Launching kernels/residual.cu: the residual stream (fp32) and the LayerNorm after each add.

    rl = cb.load_launch("residual")
    rl.add_layernorm(x, dx, gamma, beta, y, eps)    # x += dx; y = LN(x) (fp16), one launch
    rl.add_layernorm(x, None, gamma, beta, y, eps)  # y = LN(x) only
    rl.residual_add(x, dx); rl.to_half(x, y)        # the unfused pieces

  add_layernorm(), residual_add(), to_half()   the entry points (add_layernorm_v1: one block
                                               per row, cb.row_block threads): check, launch
  sanitize_targets()                           add_layernorm_v1 on ragged rows

Arrays are CuPy on the GPU (the kernels run on CuPy's current stream). Refused before a launch:
dtypes and shapes, eps <= 0, rows longer than 16384 (a row is held in registers).
"""

from __future__ import annotations

import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, row_block

__all__ = ["add_layernorm", "residual_add", "to_half", "sanitize_targets"]


def add_layernorm(x, dx, gamma, beta, y, eps: float = 1e-5):
    """x (M, N) fp32 += dx (fp16, or None); y (M, N) fp16 = LayerNorm(x) * gamma + beta."""
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    if dx is not None:
        cb.expect(dx, "dx", dtype=np.float16, shape=(M, N))
    cb.expect(gamma, "gamma", dtype=np.float32, shape=(N,))
    cb.expect(beta, "beta", dtype=np.float32, shape=(N,))
    cb.expect(y, "y", dtype=np.float16, shape=(M, N))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise TypeError(f"eps must be a number > 0, got {eps!r}")
    if N > 16 * 1024 or M == 0 or N == 0:
        raise LaunchError(f"add_layernorm_v1 holds a row in registers: 1 <= N <= 16384, M >= 1; "
                          f"got {(M, N)}")
    cb.launch.run(cb.module("residual").get("add_layernorm_v1"), Launch((M,), (row_block(N),)),
                  (x, np.uint64(0) if dx is None else dx, gamma, beta, y, np.int32(N),
                   np.float32(eps)))
    return y


def residual_add(x, dx):
    """x (fp32) += dx (fp16), elementwise."""
    cb.expect(x, "x", dtype=np.float32)
    cb.expect(dx, "dx", dtype=np.float16, shape=tuple(x.shape))
    n = int(x.size)
    if n:
        cb.launch.run(cb.module("residual").get("residual_add_v1"),
                      Launch((ceil_div(n, 256),), (256,)), (x, dx, np.int64(n)))
    return x


def to_half(x, y):
    """y (fp16) = x (fp32), elementwise."""
    cb.expect(x, "x", dtype=np.float32)
    cb.expect(y, "y", dtype=np.float16, shape=tuple(x.shape))
    n = int(x.size)
    if n:
        cb.launch.run(cb.module("residual").get("to_half_v1"),
                      Launch((ceil_div(n, 256),), (256,)), (x, y, np.int64(n)))
    return y


def sanitize_targets():
    import cupy as cp

    for M, N in ((3, 256), (2, 1001)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        dx = cp.random.standard_normal((M, N), dtype=cp.float32).astype(cp.float16)
        g, b = cp.ones(N, cp.float32), cp.zeros(N, cp.float32)
        y = cp.empty((M, N), cp.float16)
        yield f"add_layernorm_v1 {M}x{N}", lambda x=x, dx=dx, g=g, b=b, y=y: add_layernorm(
            x, dx, g, b, y)
