"""Quantization references (Chapter 10): what the quantization kernels are checked against.

Host numpy arrays in, numpy arrays out. The arithmetic is the kernels' own (float32 division,
round to nearest with ties to even, numpy.rint = CUDA's __float2int_rn), so quantized values
match the GPU bit for bit; matrix products are float64.

    q, s, z = quantize_reference(w, bits=8, group=K)              # per-channel symmetric int8
    q, s, z = quantize_reference(w, bits=4, group=128)            # int4, groups of 128
    q, s, z = quantize_reference(w, bits=8, group=None, symmetric=False)  # per-tensor, asym
    w2 = dequantize_reference(q, s, z, group)
    p = pack_int4_reference(q4)          # low nibble = even index; unpack_int4_reference(p, n)
    y = qgemv_reference(x, w2)           # float64 x @ w2.T
    e4 = fp8_reference(w, "e4m3")        # w rounded to fp8 (torch's float8 types) and back

Conventions (kernels/quant.cu says the same): w is (rows, K); a group is ``group`` consecutive
elements of a row (it must divide K; ``group=None`` is one scale for the whole tensor). Symmetric:
s = max|w| / qmax with qmax = 2^(bits-1) - 1, q = clamp(rint(w / s), -qmax, qmax). Asymmetric:
lo = min(w, 0), hi = max(w, 0), s = (hi - lo) / (2^bits - 1), z = rint(-lo / s),
q = clamp(rint(w / s) + z, 0, 2^bits - 1). A group of zeros gets s = 1: never 0, never NaN.
"""

from __future__ import annotations

import numpy as np

__all__ = ["quantize_reference", "dequantize_reference", "pack_int4_reference",
           "unpack_int4_reference", "qgemv_reference", "fp8_reference", "group_view",
           "FP8_MAX"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def group_view(w: np.ndarray, group: int | None) -> tuple[np.ndarray, int]:
    """``w`` (rows, K) reshaped to (groups, group) and the group size; ValueError if the group
    does not divide K. ``group=None``: the whole tensor is one group."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2D weight (rows, K), got shape {w.shape}")
    rows, K = w.shape
    if group is None:
        return w.reshape(1, -1), rows * K
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise TypeError(f"group must be a positive int (or None: per tensor), got {group!r}")
    if K % group:
        raise ValueError(f"group size {group} does not divide K = {K}: each row must split into "
                         "whole groups (pad K, or choose a group size that divides it)")
    return w.reshape(rows * (K // group), group), int(group)


def quantize_reference(w, bits: int = 8, group: int | None = None, symmetric: bool = True):
    """(q, scale, zero): q int8 (symmetric) or uint8 (asymmetric) of w's shape, scale and zero
    float32 of shape (rows, K // group) ((1, 1) per tensor); zero is all 0 when symmetric."""
    if bits not in (2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"bits must be 2..8, got {bits!r}")
    w = np.asarray(w, dtype=np.float32)
    g, _ = group_view(w, group)
    lo = np.minimum(g.min(axis=1), 0).astype(np.float32)
    hi = np.maximum(g.max(axis=1), 0).astype(np.float32)
    if symmetric:
        qmax = np.float32(2 ** (bits - 1) - 1)
        amax = np.maximum(hi, -lo)
        s = np.where(amax > 0, amax / qmax, np.float32(1)).astype(np.float32)
        z = np.zeros_like(s)
        q = np.clip(np.rint(g / s[:, None]), -qmax, qmax).astype(np.int8)
    else:
        levels = np.float32(2 ** bits - 1)
        s = np.where(hi > lo, (hi - lo) / levels, np.float32(1)).astype(np.float32)
        z = np.rint(-lo / s).astype(np.float32)
        q = np.clip(np.rint(g / s[:, None]) + z[:, None], 0, levels).astype(np.uint8)
    rows = w.shape[0]
    shape = (1, 1) if group is None else (rows, w.shape[1] // g.shape[1])
    return q.reshape(w.shape), s.reshape(shape), z.reshape(shape)


def dequantize_reference(q, scale, zero=None, group: int | None = None) -> np.ndarray:
    """(q - zero) * scale per group, in float64, of q's shape."""
    q = np.asarray(q)
    g, _ = group_view(q.astype(np.float64), group)
    s = np.asarray(scale, dtype=np.float64).reshape(-1, 1)
    z = 0.0 if zero is None else np.asarray(zero, dtype=np.float64).reshape(-1, 1)
    if s.shape[0] != g.shape[0]:
        raise ValueError(f"{s.shape[0]} scales for {g.shape[0]} groups")
    return ((g - z) * s).reshape(q.shape)


def pack_int4_reference(q) -> np.ndarray:
    """n int4 values (int8 in -8..7) -> ceil(n / 2) uint8: element 2i in the low nibble of byte
    i, 2i + 1 in the high nibble; an odd n leaves the last high nibble 0. Flattens q."""
    q = np.asarray(q).reshape(-1).astype(np.int64)
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in -8..7, got {q.min()}..{q.max()}")
    u = (q & 0xF).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def unpack_int4_reference(p, n: int) -> np.ndarray:
    """The first n int4 values of packed bytes p, sign-extended to int8."""
    p = np.asarray(p, dtype=np.uint8).reshape(-1)
    if not 0 <= n <= 2 * p.size:
        raise ValueError(f"{p.size} bytes hold at most {2 * p.size} values, asked for {n}")
    u = np.stack([p & 0xF, p >> 4], axis=1).reshape(-1)[:n].astype(np.int8)
    return np.where(u >= 8, u - 16, u).astype(np.int8)


def qgemv_reference(x, w_dequant) -> np.ndarray:
    """y = x @ w^T in float64 (x (B, K), w (N, K) dequantized)."""
    return np.asarray(x, dtype=np.float64) @ np.asarray(w_dequant, dtype=np.float64).T


def fp8_reference(w, fmt: str = "e4m3", scale: float = 1.0) -> np.ndarray:
    """w / scale rounded to fp8 ``fmt`` (e4m3: torch.float8_e4m3fn, saturating at 448; e5m2)
    and back to float32, times scale."""
    import torch

    if fmt not in FP8_MAX:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    t = torch.as_tensor(np.asarray(w, dtype=np.float32) / np.float32(scale))
    t = t.clamp(-FP8_MAX[fmt], FP8_MAX[fmt])
    return t.to(dt).to(torch.float32).numpy() * np.float32(scale)
