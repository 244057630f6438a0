"""Launching kernels/gelu_half.cu: GELU (tanh) in place on fp16.

    gl = cb.load_launch("gelu_half")
    gl.gelu_half(h)          # h fp16, any shape, an even number of elements, contiguous

  gelu_half()   the entry point (gelu_half_v1, one thread per half2): check, launch, return x

Refused before a launch: another dtype, a strided view, an odd size, a start that is not 4-byte
aligned. The kernel runs on CuPy's current stream.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, ceil_div

__all__ = ["gelu_half"]


def gelu_half(x):
    """x = gelu_tanh(x) in place (fp16, contiguous, even size, 4-byte aligned)."""
    cb.expect(x, "x", dtype=np.float16)
    n = int(x.size)
    if n % 2 or not cb.expect_aligned(x, "x", 4):
        raise ValueError(f"gelu_half_v1 reads half2: x needs an even size (got {n}) and a "
                         "4-byte aligned start")
    if n:
        cb.launch.run(cb.module("gelu_half").get("gelu_half_v1"),
                      Launch((ceil_div(n // 2, 256),), (256,)), (cb.as_cupy(x, "x"), np.int64(n)))
    return x
