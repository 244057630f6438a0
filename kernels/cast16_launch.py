"""Launching kernels/cast16.cu (and its Numba twins): bfloat16 <-> float32, elementwise.

    c16 = cb.load_launch("cast16")
    c16.to_f32(src, dst)                    # dst (fp32) = float(src (bf16)), exact
    c16.to_f32(src, dst, accumulate=True)   # dst += float(src): a bf16 weight gradient summed
                                            # into the fp32 one (one fp32 add, deterministic)
    c16.to_bf16(src, dst)                   # dst (bf16) = src (fp32), round to nearest even
    c16.to_f32_numba(bits, dst, accumulate) # the twins (simulator or GPU), NumPy
    c16.to_bf16_numba(x)

    VERSIONS, WHAT, THREADS
    config(version, n)   -> Launch(grid, block, kernel=version)
    sanitize_targets()

src and dst may have any shapes with the same number of elements n (a flat gradient buffer and
a weight's shape, say); both C-contiguous, 16-byte aligned, on one GPU. Refused before a launch
(TypeError / ValueError naming the argument): dtypes, element counts, strided views, misaligned
starts, host arrays, arrays on two GPUs, dst overlapping src, an accumulate that is not a bool.
n = 0 launches nothing. Every launch runs on src's stream, allocates nothing and never
synchronises: capture-safe. to_bf16 rounds as PyTorch's ``.bfloat16()`` on the GPU (a NaN
becomes 0x7fff).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "THREADS", "config", "to_f32", "to_bf16", "to_f32_numba",
           "to_bf16_numba", "sanitize_targets"]

VERSIONS = ("bf16_to_f32_v1", "f32_to_bf16_v1")
WHAT = {"bf16_to_f32_v1": "8 elements per thread (16-byte load, two 16-byte stores), "
                          "optional fp32 accumulate",
        "f32_to_bf16_v1": "8 elements per thread (two 16-byte loads, one 16-byte store), RNE"}
THREADS = 256


def _module():
    return cb.module("cast16")     # the whole file, compiled once per process


def config(version: str, n: int) -> Launch:
    """A thread per 8 elements, and one more for the n % 8 tail."""
    version = version_name(VERSIONS, version, "cast16")
    blocks = ceil_div(n // 8 + 1, THREADS)
    if blocks > 2**31 - 1:
        raise LaunchError(f"cast16: {n} elements need more blocks than the grid holds")
    return Launch((blocks,), (THREADS,), kernel=version)




def _check(src, sdt: str, dst, ddt: str) -> tuple:
    """(src info, dst info, n) after every check of the module docstring."""
    for a, name, dt in ((src, "src", sdt), (dst, "dst", ddt)):
        cb.expect(a, name, device=False)
        got = cb.describe(a, name).dtype
        if got != dt:
            raise TypeError(f"{name}: expected dtype {dt}, got {got}")
    n, nd = cb.describe(src).size, cb.describe(dst).size
    if nd != n:
        raise ValueError(f"dst has {nd} elements, src {n}: they must hold the same number "
                         f"(shapes may differ: src {tuple(src.shape)}, dst {tuple(dst.shape)})")
    for a, name in ((src, "src"), (dst, "dst")):
        if not cb.expect_aligned(a, name, 16):
            raise ValueError(f"{name}: its first element is not 16-byte aligned (the kernels "
                             "move 16-byte vectors); pass a tensor that starts its storage, or "
                             ".clone() it")
    s, d = cb.validate.expect_one_gpu(("src", src), ("dst", dst))
    if n and s.ptr < d.ptr + n * d.itemsize and d.ptr < s.ptr + n * s.itemsize:
        raise ValueError("dst overlaps src: the conversion does not run in place; pass a "
                         "separate dst")
    return s, d, n


def to_f32(src, dst, accumulate: bool = False):
    """dst (float32) = float(src (bfloat16)), or dst += float(src) with ``accumulate``; any
    shapes of n elements each. Returns dst."""
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate must be a bool, got {accumulate!r}")
    s, d, n = _check(src, "bfloat16", dst, "float32")
    if n:
        cfg = config("bf16_to_f32_v1", n)
        with cb.arrays.launch_stream(src):
            cb.launch.run(_module().get(cfg.kernel), cfg,
                          (np.uint64(s.ptr), np.uint64(d.ptr), np.int64(n),
                           np.int32(bool(accumulate))))
    return dst


def to_bf16(src, dst):
    """dst (bfloat16) = src (float32) rounded to nearest even; any shapes of n elements each.
    Returns dst."""
    s, d, n = _check(src, "float32", dst, "bfloat16")
    if n:
        cfg = config("f32_to_bf16_v1", n)
        with cb.arrays.launch_stream(src):
            cb.launch.run(_module().get(cfg.kernel), cfg,
                          (np.uint64(s.ptr), np.uint64(d.ptr), np.int64(n)))
    return dst


def to_f32_numba(bits, dst=None, accumulate: bool = False) -> np.ndarray:
    """The twin bf16_to_f32 on uint16 bit patterns (NumPy, any shape): returns float32 NumPy of
    the same shape, ``dst`` (float32, as many elements) + it when accumulating, else it."""
    from numba import cuda

    b = np.ascontiguousarray(cb.to_numpy(bits))
    if b.dtype != np.uint16:
        raise TypeError(f"bits: expected uint16 bit patterns of bfloat16, got {b.dtype}")
    n = b.size
    d0 = np.full(n, np.nan, np.float32) if dst is None else \
        np.ascontiguousarray(cb.to_numpy(dst), np.float32).reshape(-1)
    if d0.size != n:
        raise ValueError(f"dst has {d0.size} elements, bits {n}")
    d = cuda.to_device(d0)
    if n:
        cb.load_numba("cast16").bf16_to_f32[ceil_div(n, 64), 64](
            cuda.to_device(b.reshape(-1)), d, bool(accumulate))
    return d.copy_to_host().reshape(b.shape)


def to_bf16_numba(x) -> np.ndarray:
    """The twin f32_to_bf16_rn on float32 NumPy (any shape): returns the uint16 bit patterns of
    the bfloat16 values, same shape."""
    from numba import cuda

    a = np.ascontiguousarray(cb.to_numpy(x))
    if a.dtype != np.float32:
        raise TypeError(f"x: expected float32, got {a.dtype}")
    n = a.size
    d = cuda.to_device(np.full(n, 0xFFFF, np.uint16))
    if n:
        cb.load_numba("cast16").f32_to_bf16_rn[ceil_div(n, 64), 64](
            cuda.to_device(a.reshape(-1).view(np.uint32)), d)
    return d.copy_to_host().reshape(a.shape)


def sanitize_targets():
    """Both kernels at lengths with and without a tail (1, 8, 1003)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 8, 1003):
        x = torch.randn(n, device="cuda", generator=g)
        h = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        f = torch.zeros(n, device="cuda")
        yield f"f32_to_bf16_v1 (n = {n})", (lambda x=x, h=h: to_bf16(x, h))
        yield f"bf16_to_f32_v1 accumulate (n = {n})", (lambda h=h, f=f: to_f32(h, f, True))
