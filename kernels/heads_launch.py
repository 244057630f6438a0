"""Launching kernels/heads.cu (and its Numba twins): the matmuls' rows (B*T, P*H*D) <-> the
attention's heads (B*H, T, D), for bfloat16 (or float16) tensors, 16 bytes per copy.

    hl = cb.load_launch("heads")
    hl.split_qkv(qkv, B, T, H, q, k, v)        # qkv (B*T, 3*H*D) -> q, k, v (B*H, T, D)
    hl.merge_qkv(dq, dk, dv, B, T, H, dqkv)    # the inverse (the backward of split_qkv)
    hl.merge(o, B, T, H, out)                  # o (B*H, T, D) -> out (B*T, H*D)
    hl.split(x, B, T, H, out)                  # the inverse of merge (its backward)
    hl.split_numba(bits, B, T, H, P)           # the twins (simulator or GPU), uint16 NumPy
    hl.merge_numba(ys, B, T, H)

    VERSIONS, WHAT, DTYPES, THREADS
    config(version, n)   -> Launch(grid, block, kernel=version), n = elements / 8
    sanitize_targets()

The maps (P = 3 for qkv: columns [q heads | k heads | v heads], head h at h*D .. h*D + D - 1
within each third; P = 1 for o):

    q[b*H + h, t, d] = qkv[b*T + t, h*D + d],  k: + H*D,  v: + 2*H*D
    out[b*T + t, h*D + d] = o[b*H + h, t, d]

D is the head arrays' last dimension. Head arrays may also be given as (B, H, T, D) and row
arrays as (B, T, P*H*D) (the same memory). Refused before a launch (TypeError / ValueError
naming the argument): B, T, H not positive ints; dtypes other than bfloat16 / float16, or not
all one; shapes that disagree with B, T, H; D not a multiple of 8 (the 16-byte vectors);
strided views; a start not 16-byte aligned; host arrays; arrays on two GPUs; an output
overlapping an input or another output. Every launch runs on the first input's stream,
allocates nothing and never synchronises: capture-safe. Each entry point returns its output(s).
"""

from __future__ import annotations

import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "DTYPES", "THREADS", "config", "split_qkv", "merge_qkv",
           "merge", "split", "split_numba", "merge_numba", "sanitize_targets"]

VERSIONS = ("heads_split_v1", "heads_merge_v1")
WHAT = {"heads_split_v1": "rows -> heads, a thread per 16-byte vector, reads in row order",
        "heads_merge_v1": "heads -> rows, a thread per 16-byte vector, writes in row order"}
DTYPES = ("bfloat16", "float16")
THREADS = 256


def _module():
    return cb.module("heads")     # the whole file, compiled once per process


def config(version: str, n: int) -> Launch:
    """One thread per 16-byte vector: n = elements / 8."""
    version = version_name(VERSIONS, version, "heads")
    blocks = ceil_div(n, THREADS)
    if blocks > 2**31 - 1:
        raise LaunchError(f"heads: {n} vectors need more blocks than the grid holds")
    return Launch((max(1, blocks),), (THREADS,), kernel=version)


def _pos_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise TypeError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)






def _run(version: str, rows, rows_name: str, heads: tuple, head_names: tuple, B, T, H,
         to_heads: bool) -> None:
    """Check rows (B*T, P*H*D) and the P head arrays (B*H, T, D), then launch ``version``."""
    B, T, H = _pos_int(B, "B"), _pos_int(T, "T"), _pos_int(H, "H")
    P = len(heads)
    cb.expect(heads[0], head_names[0], device=False)
    dt = cb.describe(heads[0], head_names[0]).dtype
    if dt not in DTYPES:
        raise TypeError(f"{head_names[0]}: expected dtype bfloat16 (or float16), got {dt}")
    if len(heads[0].shape) not in (3, 4):
        raise ValueError(f"{head_names[0]}: expected shape (B*H, T, D), got "
                         f"{tuple(heads[0].shape)}")
    D = int(heads[0].shape[-1])
    if D < 8 or D % 8:
        raise ValueError(f"{head_names[0]}: head dimension D = {D} must be a multiple of 8 "
                         "(the kernels copy 16-byte vectors of 8 elements)")
    for a, name in zip(heads, head_names):
        cb.expect(a, name, dtype=dt, device=False)
        if tuple(a.shape) not in ((B * H, T, D), (B, H, T, D)):
            raise ValueError(f"{name}: expected shape (B*H, T, D) = {(B * H, T, D)} (or (B, H, "
                             f"T, D)) for B={B}, T={T}, H={H}, got {tuple(a.shape)}")
    cb.expect(rows, rows_name, dtype=dt, device=False)
    W = P * H * D
    if tuple(rows.shape) not in ((B * T, W), (B, T, W)):
        raise ValueError(f"{rows_name}: expected shape (B*T, {P}*H*D) = {(B * T, W)} (or (B, T, "
                         f"{W})) for B={B}, T={T}, H={H}, D={D}, got {tuple(rows.shape)}")
    arrays = ((rows, rows_name),) + tuple(zip(heads, head_names))
    for a, name in arrays:
        if not cb.expect_aligned(a, name, 16):
            raise ValueError(f"{name}: its first element is not 16-byte aligned (the kernels "
                             "copy 16-byte vectors); pass a tensor that starts its storage, or "
                             ".clone() it")
    infos = cb.validate.expect_one_gpu(*((name, a) for a, name in arrays))
    first = infos[0]
    outs = infos[1:] if to_heads else infos[:1]
    for o in outs:
        for x in infos:
            if x is not o and cb.validate.overlaps(o, x):
                raise ValueError(f"{o.name} overlaps {x.name}: every output needs its own "
                                 "memory (the copy does not run in place)")
    for what, v in (("B*T", B * T), ("B*H", B * H), ("P*H*D", W)):
        if v >= 2**31:
            raise LaunchError(f"heads: {what} = {v} must be below 2^31")
    n = B * T * W // 8
    cfg = config(version, n)
    ptrs = [np.uint64(i.ptr) for i in infos[1:]] + [np.uint64(0)] * (3 - P)
    ints = (np.int64(n), np.int32(P), np.int32(T), np.int32(H), np.int32(D))
    args = ((np.uint64(first.ptr), *ptrs) if to_heads else (*ptrs, np.uint64(first.ptr))) + ints
    with cb.arrays.launch_stream(rows if to_heads else heads[0]):
        cb.launch.run(_module().get(cfg.kernel), cfg, args)


def split_qkv(qkv, B: int, T: int, H: int, q, k, v):
    """q, k, v (B*H, T, D) = the heads of qkv (B*T, 3*H*D), all bfloat16; returns (q, k, v)."""
    _run("heads_split_v1", qkv, "qkv", (q, k, v), ("q", "k", "v"), B, T, H, True)
    return q, k, v


def merge_qkv(dq, dk, dv, B: int, T: int, H: int, dqkv):
    """dqkv (B*T, 3*H*D) = [dq | dk | dv] back in rows (split_qkv's inverse); returns dqkv."""
    _run("heads_merge_v1", dqkv, "dqkv", (dq, dk, dv), ("dq", "dk", "dv"), B, T, H, False)
    return dqkv


def merge(o, B: int, T: int, H: int, out):
    """out (B*T, H*D) = o (B*H, T, D) with the heads side by side in each row; returns out."""
    _run("heads_merge_v1", out, "out", (o,), ("o",), B, T, H, False)
    return out


def split(x, B: int, T: int, H: int, out):
    """out (B*H, T, D) = the heads of x (B*T, H*D) (merge's inverse); returns out."""
    _run("heads_split_v1", x, "x", (out,), ("out",), B, T, H, True)
    return out


def split_numba(x, B: int, T: int, H: int, P: int) -> np.ndarray:
    """The twin heads_split_chunk8 on x (B*T, P*H*D) uint16 bit patterns (NumPy): returns ys
    (P, B*H, T, D) uint16 NumPy, prefilled with 0xFFFF where nothing writes."""
    from numba import cuda

    bits = np.ascontiguousarray(cb.to_numpy(x))
    B, T, H, P = (_pos_int(v, n) for v, n in ((B, "B"), (T, "T"), (H, "H"), (P, "P")))
    if bits.dtype != np.uint16 or bits.shape[0] != B * T or bits.shape[1] % (P * H * 8):
        raise ValueError(f"x: expected uint16 (B*T, P*H*D) with D a multiple of 8, got "
                         f"{bits.dtype} {bits.shape}")
    D = bits.shape[1] // (P * H)
    ys = cuda.to_device(np.full((P, B * H, T, D), 0xFFFF, np.uint16))
    n = bits.size // 8
    cb.load_numba("heads").heads_split_chunk8[ceil_div(n, 64), 64](cuda.to_device(bits), ys, T, H)
    return ys.copy_to_host()


def merge_numba(ys, B: int, T: int, H: int) -> np.ndarray:
    """The twin heads_merge_chunk8 on ys (P, B*H, T, D) uint16 (NumPy): returns x
    (B*T, P*H*D) uint16 NumPy, prefilled with 0xFFFF where nothing writes."""
    from numba import cuda

    bits = np.ascontiguousarray(cb.to_numpy(ys))
    B, T, H = _pos_int(B, "B"), _pos_int(T, "T"), _pos_int(H, "H")
    if bits.dtype != np.uint16 or bits.ndim != 4 or bits.shape[1:3] != (B * H, T) or \
            bits.shape[3] % 8:
        raise ValueError(f"ys: expected uint16 (P, B*H, T, D) with D a multiple of 8, got "
                         f"{bits.dtype} {bits.shape}")
    P, D = bits.shape[0], bits.shape[3]
    x = cuda.to_device(np.full((B * T, P * H * D), 0xFFFF, np.uint16))
    n = bits.size // 8
    cb.load_numba("heads").heads_merge_chunk8[ceil_div(n, 64), 64](cuda.to_device(bits), x, T, H)
    return x.copy_to_host()


def sanitize_targets():
    """Every entry point on a small ragged case (T = 17, H = 3, D = 64; and D = 128)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    for B, T, H, D in ((2, 17, 3, 64), (1, 5, 2, 128)):
        qkv = torch.randn(B * T, 3 * H * D, device="cuda", generator=g).bfloat16()
        q, k, v = (torch.empty(B * H, T, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        dqkv = torch.empty_like(qkv)
        o = torch.empty(B * T, H * D, device="cuda", dtype=torch.bfloat16)
        tag = f"B={B} T={T} H={H} D={D}"
        yield f"heads_split_v1 split_qkv ({tag})", (
            lambda a=(qkv, B, T, H, q, k, v): split_qkv(*a))
        yield f"heads_merge_v1 merge_qkv ({tag})", (
            lambda a=(q, k, v, B, T, H, dqkv): merge_qkv(*a))
        yield f"heads_merge_v1 merge ({tag})", (lambda a=(q, B, T, H, o): merge(*a))
        yield f"heads_split_v1 split ({tag})", (lambda a=(o, B, T, H, k): split(*a))
