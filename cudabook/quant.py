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

Activations and outliers (W8A8; references for a CPU study, no kernel of the chapter uses them):

    q, s = quantize_activations(x, per="token")    # int8, one scale per row (token) of x (T, K)
    y = w8a8_reference(x, w, per="token")           # int8 x per token, int8 w per output channel
    s = smooth_scales(np.abs(x_cal).max(0), w, alpha=0.5)   # SmoothQuant's per-channel scales
    xs, ws = smooth(x, w, s)                        # x / s and w * s: xs @ ws.T == x @ w.T
    s, a = awq_scales(x_cal, w, bits=4, group=128)  # AWQ's activation-aware scale search (W4)

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
           "FP8_MAX", "quantize_activations", "w8a8_reference", "smooth_scales", "smooth",
           "awq_scales", "relative_error"]

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


# ============================================================================ activations (W8A8)
def _matrix(a, name: str) -> np.ndarray:
    """``a`` as a finite 2D float64 array, or a ValueError naming ``name``."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2D, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} holds NaN or inf: a scale taken from its max would be too")
    return a


def quantize_activations(x, bits: int = 8, per: str = "token") -> tuple[np.ndarray, np.ndarray]:
    """Dynamic symmetric quantization of activations x (T, K): (q int8 (T, K), scale float32).

    ``per="token"``: one scale per row, max|x[t]| / qmax, shape (T, 1): a token with a huge value
    gets a coarse grid, the other tokens keep theirs. ``per="tensor"``: one scale, shape (1, 1).
    Dynamic: the scales come from x itself, as a kernel computes them on the fly. The rounding is
    ``quantize_reference``'s (float32 division, ties to even)."""
    x = _matrix(x, "x").astype(np.float32)
    if per not in ("token", "tensor"):
        raise ValueError(f"per must be 'token' or 'tensor', got {per!r}")
    q, s, _ = quantize_reference(x, bits, x.shape[1] if per == "token" else None)
    return q, s


def w8a8_reference(x, w, per: str = "token", bits: int = 8) -> np.ndarray:
    """What a W8A8 GEMM computes, in float64: y (T, N) = (qx @ qw^T) * sx * sw^T.

    x (T, K) activations quantized dynamically ``per`` token or tensor; w (N, K) per output
    channel (one scale per row). The integer products are summed exactly (in float64 while
    K * qmax^2 < 2^53, as the int32 accumulator of the kernels holds them up to K = 133,000
    for int8), then scaled, as the epilogue of an int8 GEMM does."""
    x, w = _matrix(x, "x"), _matrix(w, "w")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} channels, w has K = {w.shape[1]}: "
                         "y = x @ w.T needs the same K")
    qx, sx = quantize_activations(x, bits, per)
    qw, sw, _ = quantize_reference(w, bits, w.shape[1])
    acc = qx.astype(np.float64) @ qw.astype(np.float64).T
    return acc * sx.astype(np.float64) * sw.astype(np.float64).T


def smooth_scales(act_absmax, w, alpha: float = 0.5) -> np.ndarray:
    """SmoothQuant's per-input-channel scales (Xiao et al., 2023), float64 of shape (K,):

        s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

    ``act_absmax`` (K,) is max|X_j| over calibration tokens; max|W_j| is over w's column j (w is
    (N, K), so column j meets activation channel j). alpha = 0 leaves the weights' range alone,
    alpha = 1 makes every activation channel's max 1; the paper uses 0.5 and up to 0.75-0.85 for
    models with larger outliers. A channel whose activation or weight max is 0 gets s = 1."""
    w = _matrix(w, "w")
    a = np.asarray(act_absmax, dtype=np.float64)
    if a.shape != (w.shape[1],):
        raise ValueError(f"act_absmax must have one entry per input channel, shape "
                         f"({w.shape[1]},), got {a.shape}")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ValueError("act_absmax must be finite and >= 0 (a max of |x|)")
    if isinstance(alpha, bool) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    wmax = np.abs(w).max(axis=0)
    ok = (a > 0) & (wmax > 0)
    s = np.ones_like(a)
    s[ok] = a[ok] ** alpha / wmax[ok] ** (1.0 - alpha)
    return s


def smooth(x, w, s) -> tuple[np.ndarray, np.ndarray]:
    """(x / s, w * s) in float64: each activation channel j divided by s_j, the weight's input
    channel j multiplied by it. (x / s) @ (w * s)^T = x @ w^T in exact arithmetic (to rounding
    in float64); in a model the division folds into the LayerNorm before the layer."""
    x, w = _matrix(x, "x"), _matrix(w, "w")
    s = np.asarray(s, dtype=np.float64)
    if x.shape[1] != w.shape[1] or s.shape != (w.shape[1],):
        raise ValueError(f"x (T, K), w (N, K) and s (K,) must share K; got {x.shape}, "
                         f"{w.shape}, {s.shape}")
    if not np.isfinite(s).all() or (s <= 0).any():
        raise ValueError("smoothing scales must be finite and > 0")
    return x / s, w * s


def relative_error(y, ref) -> float:
    """||y - ref||_F / ||ref||_F, in float64."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"shapes differ: {y.shape} and {ref.shape}")
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def awq_scales(x_cal, w, bits: int = 4, group: int | None = 128,
               grid: int = 20) -> tuple[np.ndarray, float]:
    """AWQ's activation-aware scale search for weight-only quantization (Lin et al., 2024):
    (s (K,), alpha). Weights stay round-to-nearest (``quantize_reference``, symmetric, ``group``);
    before rounding, input channel j of w is multiplied by s_j = mean|X_j|^alpha (normalised by
    sqrt(max s * min s)), and x by 1 / s_j. alpha is chosen on the grid 0, 1/grid, .., 1 to
    minimise the output error ||x_cal (Q(w s) / s)^T - x_cal w^T||_F on calibration tokens; alpha
    = 0 (s = 1) is plain rounding, so the search never does worse on x_cal."""
    x, w = _matrix(x_cal, "x_cal"), _matrix(w, "w")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x_cal has K = {x.shape[1]}, w has K = {w.shape[1]}")
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")
    mean = np.maximum(np.abs(x).mean(axis=0), 1e-12)
    ref = x @ w.T
    best = (np.inf, np.ones(w.shape[1]), 0.0)
    for alpha in np.linspace(0.0, 1.0, grid + 1):
        s = mean ** alpha
        s = s / np.sqrt(s.max() * s.min())
        q, sc, z = quantize_reference(w * s, bits, group)
        err = np.linalg.norm(x @ (dequantize_reference(q, sc, z, group) / s).T - ref)
        if err < best[0]:
            best = (err, s, float(alpha))
    return best[1], best[2]
