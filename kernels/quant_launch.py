"""Launching kernels/quant.cu: quantize and dequantize weights, pack and unpack int4.

    qt = cb.load_launch("quant")
    q, s, z = qt.quantize(w, bits=8, group=K)          # per-channel symmetric int8 (cupy)
    q, s, z = qt.quantize(w, bits=4, group=128)        # int4 values in int8, groups of 128
    q, s, z = qt.quantize(w, bits=8, symmetric=False)  # per tensor (group=None), asymmetric
    w2 = qt.dequantize(q, s, z, group)                 # float32
    p = qt.pack_int4(q4)                               # any length; unpack_int4(p, n)

  quantize(), dequantize()    the entry points (CuPy results; group_scales, quantize and
                              dequantize kernels)
  pack_int4(), unpack_int4()  int4 values two per byte and back
  sanitize_targets()          every kernel on ragged sizes, for tools/sanitize.py

w is a float32 (rows, K) CuPy array (a torch CUDA tensor works too: read in place through
cb.as_cupy); the conventions and the float64 references are cudabook.quant's. The kernels run on
CuPy's current stream. Bad input is refused: group sizes that do not divide K, bits outside
2..8; int4 values outside -8..7 are the caller's to avoid (pack keeps the low nibble).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div

__all__ = ["quantize", "dequantize", "pack_int4", "unpack_int4", "sanitize_targets"]


def _grid_stride(n: int) -> Launch:
    """256 threads per block, one element each, grid-stride beyond 65535 x 8 blocks."""
    return Launch((max(1, min(ceil_div(n, 256), 65535 * 8)),), (256,))


def _group(K: int, n: int, group: int | None) -> int:
    if group is None:
        return n
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise TypeError(f"group must be a positive int (or None: per tensor), got {group!r}")
    if K % group:
        raise LaunchError(f"group size {group} does not divide K = {K}: each row must split into "
                          "whole groups (pad K, or choose a group size that divides it)")
    return int(group)


def quantize(w: Any, bits: int = 8, group: int | None = None, symmetric: bool = True):
    """(q, scale, zero) of the float32 (rows, K) ``w``: q int8 (symmetric) or uint8, scale and
    zero float32 (rows, K // group), or (1, 1) for ``group=None`` (per tensor)."""
    import cupy as cp

    mod = cb.module("quant")
    cb.expect(w, "w", dtype=np.float32, ndim=2)
    w = cb.as_cupy(w, "w")
    if bits not in range(2, 9):
        raise LaunchError(f"bits must be 2..8, got {bits!r}")
    rows, K = (int(s) for s in w.shape)
    n = rows * K
    if n == 0:
        raise LaunchError(f"w is empty: shape {(rows, K)}")
    G = _group(K, n, group)
    if group is None:                      # per tensor: one reduction by CuPy, float32 arithmetic
        lo = cp.minimum(w.min(), cp.float32(0)).reshape(1, 1)
        hi = cp.maximum(w.max(), cp.float32(0)).reshape(1, 1)
        if symmetric:
            amax = cp.maximum(hi, -lo)
            s = cp.where(amax > 0, amax / cp.float32(2 ** (bits - 1) - 1), cp.float32(1))
            z = cp.zeros_like(s)
        else:
            s = cp.where(hi > lo, (hi - lo) / cp.float32(2 ** bits - 1), cp.float32(1))
            z = cp.rint(-lo / s)
        s, z = s.astype(cp.float32), z.astype(cp.float32)
        Kg, Gk = n, n                      # the kernel sees one row of one group
    else:
        ng = rows * (K // G)
        s = cp.empty((rows, K // G), cp.float32)
        z = cp.empty((rows, K // G), cp.float32)
        cb.launch.run(mod.get("group_scales"), Launch((ceil_div(ng, 4),), (128,)),
                      (w, s, z, np.int32(rows), np.int32(K), np.int32(G), np.int32(bits),
                       np.int32(0 if symmetric else 1)))
        Kg, Gk = K, G
    if symmetric:
        q = cp.empty((rows, K), cp.int8)
        qmin, qmax = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    else:
        q = cp.empty((rows, K), cp.uint8)
        qmin, qmax = 0, 2 ** bits - 1
    cb.launch.run(mod.get("quantize"), _grid_stride(n),
                  (w, s, z if not symmetric else np.uint64(0), q, np.int64(n), np.int32(Kg),
                   np.int32(Gk), np.int32(qmin), np.int32(qmax)))
    return q, s, z


def dequantize(q: Any, scale: Any, zero: Any = None, group: int | None = None):
    """float32 (q - zero) * scale per group; q int8 (signed) or uint8 (rows, K)."""
    import cupy as cp

    mod = cb.module("quant")
    cb.expect(q, "q", ndim=2)
    q = cb.as_cupy(q, "q")
    if q.dtype not in (cp.int8, cp.uint8):
        raise TypeError(f"q: expected int8 or uint8, got {q.dtype}")
    rows, K = (int(v) for v in q.shape)
    n = rows * K
    G = _group(K, n, group)
    ng = 1 if group is None else rows * (K // G)
    cb.expect(scale, "scale", dtype=np.float32)
    scale = cb.as_cupy(scale, "scale")
    if scale.size != ng:
        raise LaunchError(f"scale has {scale.size} values for {ng} groups")
    zp = np.uint64(0)
    if zero is not None:
        cb.expect(zero, "zero", dtype=np.float32)
        zero = cb.as_cupy(zero, "zero")
        if zero.size != ng:
            raise LaunchError(f"zero has {zero.size} values for {ng} groups")
        zp = zero
    Kg, Gk = (n, n) if group is None else (K, G)
    w = cp.empty((rows, K), cp.float32)
    cb.launch.run(mod.get("dequantize"), _grid_stride(n),
                  (q, scale, zp, w, np.int64(n), np.int32(Kg), np.int32(Gk),
                   np.int32(q.dtype == cp.int8)))
    return w


def pack_int4(q: Any):
    """n int4 values (int8, -8..7, any shape: flattened) -> ceil(n / 2) uint8 bytes."""
    import cupy as cp

    mod = cb.module("quant")
    cb.expect(q, "q", dtype=np.int8)
    q = cb.as_cupy(q, "q")
    n = int(q.size)
    p = cp.empty((n + 1) // 2, cp.uint8)
    if n:
        cb.launch.run(mod.get("pack_int4"), _grid_stride(p.size), (q, p, np.int64(n)))
    return p


def unpack_int4(p: Any, n: int):
    """The first n int4 values of the packed bytes p, as int8 (-8..7)."""
    import cupy as cp

    mod = cb.module("quant")
    cb.expect(p, "p", dtype=np.uint8)
    p = cb.as_cupy(p, "p")
    if not 0 <= n <= 2 * int(p.size):
        raise LaunchError(f"{p.size} bytes hold at most {2 * p.size} int4 values, asked for {n}")
    q = cp.empty(n, cp.int8)
    if n:
        cb.launch.run(mod.get("unpack_int4"), _grid_stride(n), (p, q, np.int64(n)))
    return q


def sanitize_targets():
    """Every kernel on ragged sizes: odd lengths, a group that is the whole row, zeros."""
    import cupy as cp

    w = cp.random.default_rng(0).standard_normal((5, 96), dtype=cp.float32)
    w[2] = 0
    yield "quantize int8 per-channel", lambda: quantize(w, 8, 96)
    yield "quantize int4 g32 asym", lambda: quantize(w, 4, 32, symmetric=False)
    yield "quantize per-tensor", lambda: quantize(w, 8, None)
    q, s, z = quantize(w, 4, 32)
    yield "dequantize g32", lambda: dequantize(q, s, z, 32)
    q7 = cp.arange(-8, 7, dtype=cp.int8)
    yield "pack_int4 (15 values)", lambda: pack_int4(q7)
    yield "unpack_int4 (15 values)", lambda: unpack_int4(pack_int4(q7), 15)
