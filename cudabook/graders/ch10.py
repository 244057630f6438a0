"""Graders of Chapter 10, "Quantization".

ex10_1  Numba: per-row (per-channel) symmetric int8 quantizer, all-zero rows included  simulator
ex10_2  Numba: int4 pack and unpack kernels (signed values, odd lengths)               simulator
ex10_3  Numba: W4A16 GEMV with per-group scales (one thread per output)               simulator
ex10_4  choose a group size for an accuracy budget from a measured table              CPU

The conventions are cudabook.quant's (kernels/quant.cu): scale = max|w| / 127 per row (1 for an
all-zero row), q = clamp(round(w / scale), -127, 127) rounded to nearest (ties to even: Python's
and Numba's round); int4 packs element 2i in the low nibble of byte i, 2i + 1 in the high
nibble, two's complement, an odd length leaving the last high nibble 0.

The graders plant the inputs that only the exact rule gets right (weights exactly halfway between
two steps, weights where a multiplication by the reciprocal rounds the other way, a row whose
largest magnitude is negative, odd group sizes) and refuse library calls inside a kernel (the
simulator runs them; a GPU cannot compile them).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import env
from ..check import close, to_numpy
from ..quant import (
    dequantize_reference,
    pack_int4_reference,
    quantize_reference,
    unpack_int4_reference,
)
from ._core import (
    CANARY,
    GradeError,
    call,
    ceil_div,
    count_launches,
    error_summary,
    fresh_rng,
    need_launch,
    passed,
    to_device,
    xp,
)
from ._static import refuse_library as _refuse_library
from ._static import refuse_stub

__all__ = ["ex10_1", "ex10_2", "ex10_3", "ex10_4", "group_table", "GROUP_BUDGET",
           "GROUP_SIZES"]

TPB = 64          #: threads per block the graders launch with
NOT_WRITTEN = -128  #: int8 fill: no correct q is -128 (the symmetric range is -127..127)


def _grid(n: int) -> int:
    return max(1, ceil_div(n, TPB))


def _filled(n: int, dtype, fill):
    """(view of n elements, whole buffer): ``fill`` everywhere, CANARY elements after the view."""
    m = xp()
    buf = m.full(n + CANARY, fill, dtype=dtype)
    return buf[:n], buf


def _tail_ok(buf, n: int, fill) -> bool:
    t = to_numpy(buf[n:])
    return bool(np.isnan(t).all()) if np.isnan(fill) else bool((t == fill).all())


def _run(ex: str, case: str, fn: Callable[[], Any], nan_hint: str | None = None) -> int:
    """Launch, turning crashes into messages; returns the number of Numba launches."""
    try:
        with count_launches() as n:
            call(ex, case, fn)
    except GradeError as e:
        if nan_hint and ("NaN" in str(e) or "nan" in str(e)):
            raise GradeError(f"{ex}: {case}: {nan_hint} ({str(e).split(': ')[-1]})") from None
        raise
    return n[0]


def _heavy(rng, rows: int, K: int) -> np.ndarray:
    """Weights with heavy tails (Student t, 3 degrees of freedom), rows of different sizes."""
    w = rng.standard_t(3, (rows, K)) * rng.uniform(0.01, 0.1, (rows, 1))
    return w.astype(np.float32)


# ----------------------------------------------------------------------------- ex10.1
def _traps(rng, K: int) -> np.ndarray:
    """4 rows of K >= 16 weights that only the exact rule quantizes right: row 0 has the scale
    2^-6 and weights exactly halfway between two steps (round ties to even), rows 1 and 2
    weights where w / s and w * (1 / s) (or w * (127 / amax)) round to different integers, row 3
    its largest magnitude negative."""
    w = _heavy(rng, 4, K)
    s0 = np.float32(2.0 ** -6)
    half = (rng.integers(-126, 126, K) + 0.5).astype(np.float32) * s0
    half[0] = 127 * s0
    w[0] = half
    for r in (1, 2):
        amax = np.float32(np.abs(w[r]).max())
        s = np.float32(amax / np.float32(127))
        inv, mul = np.float32(np.float32(1) / s), np.float32(np.float32(127) / amax)
        cand = ((np.arange(-126, 126) + 0.5).astype(np.float32) * s).astype(np.float32)
        cand = np.concatenate([np.nextafter(cand, np.float32(np.inf) * k) for k in (1, -1)]
                              + [cand])
        cand = cand[np.abs(cand) < amax]
        exact = np.rint(cand / s)
        diff = cand[(np.rint(cand * inv) != exact) | (np.rint(cand * mul) != exact)]
        if diff.size:
            pick = rng.choice(diff, min(diff.size, K // 4), replace=False)
            w[r, 1:1 + pick.size] = pick
    w[3] = np.abs(w[3])
    w[3, K // 2] = -2 * np.abs(w[3]).max()
    return w


_ZERO_HINT = ("an all-zero row gives max|w| = 0, so scale = 0 and w / scale = 0 / 0 = NaN: "
              "use scale = 1 (any positive number) when the row's max|w| is 0")


def ex10_1(quantize_rows) -> None:
    """``quantize_rows`` is a @cuda.jit kernel ``(w, q, scale)``: w (rows, K) float32, q (rows, K)
    int8, scale (rows,) float32; one thread per row (launched [ceil(rows / 64), 64]).

    Each row r: scale[r] = max|w[r]| / 127 (1.0 for an all-zero row), q[r, k] =
    round(w[r, k] / scale[r]) to nearest, clamped to -127..127. Rows are ragged in number (more
    than two blocks), some are all zeros, values heavy-tailed; fresh seed, two calls per shape.
    """
    ex = "ex10.1"
    refuse_stub(ex, quantize_rows)
    _refuse_library(ex, quantize_rows, "two loops over the row, abs, max and round")
    rng, seed = fresh_rng()
    shapes = [(1, 5), (3, 64), (67, 33), (130, 17)] + ([(1000, 257)] if not env.SIM else [])
    for rows, K in shapes:
        for rep in range(2):
            w = _heavy(rng, rows, K)
            w[rng.random(rows) < 0.2] = 0.0
            if K >= 16 and rows >= 4:   # ties, reciprocal traps, a negative largest |w|
                w[:4] = _traps(rng, K)
            w[rows // 2] = 0.0                             # at least one all-zero row
            case = f"rows={rows}, K={K} (seed {seed}, call {rep + 1})"
            qv, qbuf = _filled(rows * K, np.int8, NOT_WRITTEN)
            sv, sbuf = _filled(rows, np.float32, np.nan)
            q, scale = qv.reshape(rows, K), sv
            launches = _run(ex, case, lambda: quantize_rows[_grid(rows), TPB](
                to_device(w), q, scale), nan_hint=_ZERO_HINT)
            need_launch(ex, case, launches, "the @cuda.jit kernel quantize_rows")
            _diagnose_10_1(ex, case, w, to_numpy(q), to_numpy(scale), qbuf, sbuf, rows * K, rows)
    passed(ex)


def _diagnose_10_1(ex, case, w, q, s, qbuf, sbuf, n, rows) -> None:
    qr, sr, _ = quantize_reference(w, 8, w.shape[1])
    sr = sr.reshape(-1)
    if not (_tail_ok(qbuf, n, NOT_WRITTEN) and _tail_ok(sbuf, rows, np.nan)):
        raise GradeError(f"{ex}: {case}: wrote past the end of q or scale: missing bounds guard "
                         "(if r < w.shape[0])?")
    zero = ~w.any(axis=1)
    if np.isnan(s).all() and (q == NOT_WRITTEN).all():
        raise GradeError(f"{ex}: {case}: nothing written (q and scale still hold their fill): "
                         "is the kernel body still the stub?")
    if np.isnan(s).any():
        r = int(np.argmax(np.isnan(s)))
        if zero[r]:
            raise GradeError(f"{ex}: {case}: scale[{r}] is NaN for an all-zero row: {_ZERO_HINT}")
        raise GradeError(f"{ex}: {case}: scale[{r}] never written (rows {int(np.isnan(s).sum())}"
                         " of {rows} missing): one thread per row, r = cuda.grid(1)?")
    if (s[zero] == 0).any():
        raise GradeError(f"{ex}: {case}: an all-zero row got scale 0: {_ZERO_HINT}")
    if rows > 1 and not np.array_equal(s, sr):
        per_tensor = np.abs(w).max() / np.float32(127)
        if np.allclose(s, per_tensor, rtol=1e-6):
            raise GradeError(f"{ex}: {case}: every row has the same scale {float(s[0]):.4g} = "
                             "max|w| of the whole matrix / 127: that is per-tensor; per-channel "
                             "takes max|w[r, :]| of each row r")
    if not np.array_equal(s, sr):
        pos = np.maximum(w.max(axis=1), 0) / np.float32(127)
        pos = np.where(pos > 0, pos, np.float32(1)).astype(np.float32)
        r = int(np.argmax(s != sr))
        if np.array_equal(s, pos):
            raise GradeError(f"{ex}: {case}: scale[{r}] = {float(s[r]):.6g} is the largest "
                             "weight of the row / 127, not the largest magnitude: row "
                             f"{r}'s largest |w| is negative; take max(amax, abs(w[r, k]))")
        raise GradeError(f"{ex}: {case}: scale[{r}] = {float(s[r]):.6g}, expected "
                         f"{float(sr[r]):.6g} = max|w[{r}, :]| / 127")
    if (q == NOT_WRITTEN).any():
        r, k = (int(v) for v in np.argwhere(q == NOT_WRITTEN)[0])
        raise GradeError(f"{ex}: {case}: q[{r}, {k}] never written: does the loop cover the "
                         "whole row (range(w.shape[1]))?")
    if np.array_equal(q, qr):
        return
    t = np.clip(np.trunc(w / sr[:, None].astype(np.float32)), -127, 127).astype(np.int8)
    if np.array_equal(q, t):
        raise GradeError(f"{ex}: {case}: q is rounded toward zero (int(v) drops the fraction: "
                         "2.7 -> 2): round to the nearest integer with round(v)")
    s32 = sr[:, None].astype(np.float32)
    amax = np.abs(w).max(1, keepdims=True)
    mul = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)),
                   np.float32(1)).astype(np.float32)
    for alt in (w * (np.float32(1) / s32), w * mul):
        if np.array_equal(q, np.clip(np.rint(alt.astype(np.float32)), -127, 127)):
            raise GradeError(f"{ex}: {case}: q is off by one step at a few weights that lie "
                             "almost halfway between two steps: it was computed as a "
                             "multiplication by a rounded reciprocal (w * (1 / s) or "
                             "w * (127 / amax)); divide, w[r, k] / s, so that q is exact")
    v = w / s32
    if np.array_equal(q, np.clip(np.trunc(v + np.float32(0.5)), -127, 127)):
        raise GradeError(f"{ex}: {case}: int(v + 0.5) rounds negative values the wrong way "
                         "(-2.7 + 0.5 = -2.2 -> -2): round to the nearest integer with round(v)")
    if np.array_equal(q, np.clip(np.floor(v + np.float32(0.5)), -127, 127)):
        raise GradeError(f"{ex}: {case}: weights exactly halfway between two steps (v = 2.5) "
                         "were rounded up; round(v) rounds ties to the even neighbour (2.5 -> "
                         "2, 3.5 -> 4), as the GPU's rint does")
    f = np.clip(np.floor(w / sr[:, None].astype(np.float32)), -127, 127).astype(np.int8)
    if np.array_equal(q, f):
        raise GradeError(f"{ex}: {case}: q is rounded down (floor): round to the nearest "
                         "integer with round(v)")
    bad = q != qr
    raise GradeError(f"{ex}: {case}: q wrong: "
                     f"{error_summary(q.astype(np.float64), qr.astype(np.float64), bad)}")


# ----------------------------------------------------------------------------- ex10.2
_SIGN_HINT = ("missing sign extension: a nibble 8..15 is the negative value nibble - 16 "
              "(-8..-1), so 0xF must unpack to -1, not 15")
_ORDER_HINT = ("nibble order swapped: element 2i goes in the LOW nibble of byte i (bits 0-3) "
               "and element 2i + 1 in the high nibble (bits 4-7)")


def ex10_2(pack_int4, unpack_int4) -> None:
    """Two @cuda.jit kernels. ``pack_int4(q, p)``: q (n,) int8 in -8..7, p (ceil(n / 2),) uint8,
    one thread per byte of p (launched [ceil(len(p) / 64), 64]). ``unpack_int4(p, q)``: the
    inverse, one thread per value of q (launched [ceil(n / 64), 64]).

    Byte i holds element 2i in its low nibble and 2i + 1 in its high nibble, each the low 4 bits
    of the two's complement value; for odd n the last byte's high nibble is 0. Unpacking extends
    the sign (0xF -> -1). Lengths 1, 2, odd, even, more than two blocks; each kernel graded on
    its own (unpack gets bytes from the reference packer).
    """
    ex = "ex10.2"
    refuse_stub(ex, pack_int4)
    refuse_stub(ex, unpack_int4)
    _refuse_library(ex, pack_int4, "& 0xF, << 4 and | on the two values of the byte")
    _refuse_library(ex, unpack_int4, ">>, & 0xF and the sign extension of one nibble")
    rng, seed = fresh_rng()
    for n in (1, 2, 7, 64, 127, 128, 129, 301, 1001):
        q = rng.integers(-8, 8, n).astype(np.int8)
        # every value at least once, -3 first: at n = 1 the usual unpacking mistakes (no
        # sign, swapped nibbles, nib - 15) give three different values
        q[: min(n, 16)] = np.roll(np.arange(-8, 8), -5)[: min(n, 16)]
        nb = (n + 1) // 2
        case = f"n={n} (seed {seed})"
        # pack
        pv, pbuf = _filled(nb, np.uint8, 0xAA)
        launches = _run(ex, f"pack_int4, {case}", lambda: pack_int4[_grid(nb), TPB](
            to_device(q), pv))
        need_launch(ex, case, launches, "the @cuda.jit kernel pack_int4")
        _diagnose_pack(ex, f"pack_int4, {case}", q, to_numpy(pv), pbuf, nb)
        # unpack, from the reference bytes
        p = pack_int4_reference(q)
        uv, ubuf = _filled(n, np.int8, NOT_WRITTEN)
        launches = _run(ex, f"unpack_int4, {case}", lambda: unpack_int4[_grid(n), TPB](
            to_device(p), uv))
        need_launch(ex, case, launches, "the @cuda.jit kernel unpack_int4")
        _diagnose_unpack(ex, f"unpack_int4, {case}", q, p, to_numpy(uv), ubuf, n)
    passed(ex)


def _diagnose_pack(ex, case, q, p, buf, nb) -> None:
    ref = pack_int4_reference(q)
    if not _tail_ok(buf, nb, 0xAA):
        raise GradeError(f"{ex}: {case}: wrote past the end of p: missing bounds guard "
                         "(if i < p.shape[0])?")
    if np.array_equal(p, ref):
        return
    n = q.size
    unwritten = (p == 0xAA) & (ref != 0xAA)
    if unwritten.all():
        raise GradeError(f"{ex}: {case}: p never written: is the kernel body still the stub?")
    swapped = ((ref & 0xF) << 4 | (ref >> 4)).astype(np.uint8)
    if n % 2:
        swapped[-1] = np.uint8((ref[-1] & 0xF) << 4)
    if np.array_equal(p, swapped):
        raise GradeError(f"{ex}: {case}: {_ORDER_HINT}")
    neg = q < 0
    if neg.any():
        qq = q.astype(np.int64)
        qq = np.append(qq, 0) if n % 2 else qq
        raw = ((qq[0::2] | (qq[1::2] << 4)) & 0xFF).astype(np.uint8)
        if np.array_equal(p, raw):
            raise GradeError(f"{ex}: {case}: negative values spill into the other nibble: mask "
                             "each value to its low 4 bits (q & 0xF) before combining (a "
                             "negative int8 has its high bits set)")
    if n % 2 and np.array_equal(p[:-1], ref[:-1]):
        raise GradeError(f"{ex}: {case}: the last byte is wrong (got 0x{int(p[-1]):02x}, "
                         f"expected 0x{int(ref[-1]):02x}): for odd n it holds element n - 1 "
                         "alone, in its low nibble, with a high nibble of 0")
    i = int(np.argmax(p != ref))
    raise GradeError(f"{ex}: {case}: byte {i} = 0x{int(p[i]):02x}, expected 0x{int(ref[i]):02x} "
                     f"(elements {2 * i} and {2 * i + 1} are {int(q[2 * i])}"
                     f"{', ' + str(int(q[2 * i + 1])) if 2 * i + 1 < n else ''}); "
                     f"{int((p != ref).sum())} of {nb} bytes wrong")


def _diagnose_unpack(ex, case, q, p, u, buf, n) -> None:
    if not _tail_ok(buf, n, NOT_WRITTEN):
        raise GradeError(f"{ex}: {case}: wrote past the end of q: missing bounds guard "
                         "(if i < q.shape[0])?")
    if np.array_equal(u, q):
        return
    if (u == NOT_WRITTEN).all():
        raise GradeError(f"{ex}: {case}: q never written: is the kernel body still the stub?")
    if (q != -8).any() and np.array_equal(u, np.where(q == -8, 8, q)):
        raise GradeError(f"{ex}: {case}: -8 came back as 8: nibble 8 is negative too (-8); "
                         "the sign extension covers every nibble >= 8 (nib - 16 if nib >= 8)")
    if np.array_equal(u, np.where(q < 0, q.astype(np.int64) + 16, q)):
        raise GradeError(f"{ex}: {case}: {_SIGN_HINT}")
    low = unpack_int4_reference(p, 2 * p.size)[0::2]
    if np.array_equal(u, np.repeat(low, 2)[:n]):
        raise GradeError(f"{ex}: {case}: both values of a byte came from its low nibble (the "
                         "shift is always 0): operator precedence, 4 * i % 2 is (4 * i) % 2 = 0; "
                         "write 4 * (i % 2)")
    sw = unpack_int4_reference(((p & 0xF) << 4 | (p >> 4)).astype(np.uint8), n)
    sw_nosign = np.where(sw < 0, sw.astype(np.int64) + 16, sw)
    if np.array_equal(u, sw) or np.array_equal(u, sw_nosign):
        raise GradeError(f"{ex}: {case}: {_ORDER_HINT}")
    if np.array_equal(u, np.where(q < 0, q.astype(np.int64) + 1, q)):
        raise GradeError(f"{ex}: {case}: every negative value came back one too large (-1 as "
                         "0): a nibble 8..15 stands for nib - 16, not nib - 15")
    if (u == NOT_WRITTEN).any():
        i = int(np.argmax(u == NOT_WRITTEN))
        raise GradeError(f"{ex}: {case}: q[{i}] never written: one thread per value, "
                         "i = cuda.grid(1), for every i < n?")
    i = int(np.argmax(u != q))
    raise GradeError(f"{ex}: {case}: q[{i}] = {int(u[i])}, expected {int(q[i])}; "
                     f"{int((u != q).sum())} of {n} wrong")


# ----------------------------------------------------------------------------- ex10.3
def ex10_3(w4_gemv) -> None:
    """``w4_gemv`` is a @cuda.jit kernel ``(x, p, scales, y, G)``: y[n] = sum over k of
    x[k] * q[n, k] * scales[n, k // G], with q[n, k] the signed int4 value packed in p (N, K // 2)
    uint8 (k = 2i in the low nibble of byte i). x (K,) float32, scales (N, K // G) float32,
    y (N,) float32; one thread per output row (launched [ceil(N / 64), 64]).

    Checked against float64 on ragged N (beyond two blocks), several group sizes, per-group
    scales that differ from group to group, fresh seed.
    """
    ex = "ex10.3"
    refuse_stub(ex, w4_gemv)
    _refuse_library(ex, w4_gemv, "a loop over the bytes of the row, two nibbles each, in "
                    "float32 scalars")
    rng, seed = fresh_rng()
    # N = 1 last: with one row, a per-tensor scale and a per-channel one are the same mistake;
    # odd G: the two weights of a byte fall in different groups
    cases = [(5, 64, 32), (67, 96, 32), (130, 128, 64), (7, 42, 7), (4, 18, 3), (3, 6, 1),
             (1, 8, 4)] + (
        [(1000, 1024, 128)] if not env.SIM else [])
    for N, K, G in cases:
        q = rng.integers(-8, 8, (N, K)).astype(np.int8)
        s = rng.uniform(0.01, 0.1, (N, K // G)).astype(np.float32)
        x = rng.standard_normal(K).astype(np.float32)
        p = pack_int4_reference(q).reshape(N, K // 2)
        case = f"N={N}, K={K}, G={G} (seed {seed})"
        yv, ybuf = _filled(N, np.float32, np.nan)
        launches = _run(ex, case, lambda: w4_gemv[_grid(N), TPB](
            to_device(x), to_device(p), to_device(s), yv, G))
        need_launch(ex, case, launches, "the @cuda.jit kernel w4_gemv")
        _diagnose_10_3(ex, case, x, q, s, G, to_numpy(yv), ybuf)
    passed(ex)


def _diagnose_10_3(ex, case, x, q, s, G, y, buf) -> None:
    N, K = q.shape
    x64 = x.astype(np.float64)

    def gemv(qq, ss):
        return dequantize_reference(qq, ss, None, G) @ x64

    ref = gemv(q, s)
    if not _tail_ok(buf, N, np.nan):
        raise GradeError(f"{ex}: {case}: wrote past the end of y: missing bounds guard "
                         "(if n < y.shape[0])?")
    nan = np.isnan(y)
    if nan.all():
        raise GradeError(f"{ex}: {case}: y never written (all NaN): is the kernel body still "
                         "the stub?")
    tol = dict(atol=1e-5 * np.sqrt(K) + 1e-6 * K, rtol=1e-4)
    ok = close(y, ref, **tol)
    if ok.all():
        return
    if nan.any():
        n = int(np.argmax(nan))
        raise GradeError(f"{ex}: {case}: y[{n}] never written ({int(nan.sum())} of {N}): one "
                         "thread per output row, n = cuda.grid(1)?")
    ng = K // G

    def same(v):
        return bool(close(y, v, **tol).all())
    if same(gemv(q, np.full_like(s, s[0, 0]))):
        raise GradeError(f"{ex}: {case}: every weight scaled by scales[0, 0]: that is one scale "
                         "per tensor; this weight has one per group: scales[n, k // G]")
    if ng > 1 and same(gemv(q, np.repeat(s[:, :1], ng, axis=1))):
        also = (" (or the group was taken from the byte index i, and i // G is 0 in this row)"
                if K // 2 <= G else "")
        raise GradeError(f"{ex}: {case}: each row uses scales[n, 0] for all its columns: that is "
                         f"per-channel{also}; the scale of column k is scales[n, k // G] (per "
                         "group)")
    p = pack_int4_reference(q).reshape(N, K // 2)
    sw = unpack_int4_reference(((p & 0xF) << 4 | (p >> 4)).astype(np.uint8), N * K)
    sw = sw.reshape(N, K)
    if same(gemv(sw, s)) or same(gemv(np.where(sw < 0, sw + 16, sw), s)):
        raise GradeError(f"{ex}: {case}: {_ORDER_HINT}")
    if same(gemv(np.where(q < 0, q.astype(np.int64) + 16, q), s)):
        raise GradeError(f"{ex}: {case}: {_SIGN_HINT}")
    k = np.arange(K)

    def by_col(col_group):        # y with the scale of column k taken from group col_group[k]
        return (q.astype(np.float64) * s.astype(np.float64)[:, col_group]) @ x64
    if G % 2 and same(by_col((k - k % 2) // G)):
        raise GradeError(f"{ex}: {case}: both weights of byte i were scaled by the group of "
                         "k = 2i: with an odd G the weights 2i and 2i + 1 can be in different "
                         "groups; take each weight's scale from its own column, "
                         "scales[n, k // G] and scales[n, (k + 1) // G]")
    if same(by_col((k // 2) // G)):
        raise GradeError(f"{ex}: {case}: the scale was indexed by the byte index i: the group "
                         "of a weight is its column k (2i or 2i + 1) // G")
    if K > 2 and same(gemv(np.concatenate([q[:, :-2], np.zeros_like(q[:, -2:])], 1), s)):
        raise GradeError(f"{ex}: {case}: the last byte of each row was left out: the loop "
                         "runs over all K // 2 bytes, range(p.shape[1])")
    bad = ~ok
    raise GradeError(f"{ex}: {case}: {error_summary(y.astype(np.float64), ref, bad)}")


# ----------------------------------------------------------------------------- ex10.4
#: the group sizes of the table, and the accuracy budget of ex10.4 (relative RMS weight error)
GROUP_SIZES = (16, 32, 64, 128, 256, 1024)
GROUP_BUDGET = 0.18


def group_table(seed: int = 10) -> dict[int, dict[str, float]]:
    """For each group size: the relative RMS error of int4 symmetric quantization of a seeded
    heavy-tailed (Student t, 3 d.o.f.) 256 x 1024 weight, and the bits stored per weight
    (4 + 16 / G: an fp16 scale per group)."""
    w = (np.random.default_rng(seed).standard_t(3, (256, 1024)) * 0.02).astype(np.float32)
    out = {}
    for G in GROUP_SIZES:
        q, s, z = quantize_reference(w, 4, G)
        d = dequantize_reference(q, s, z, G)
        err = float(np.sqrt(((d - w) ** 2).mean() / (w.astype(np.float64) ** 2).mean()))
        out[G] = {"rel_error": err, "bits_per_weight": 4 + 16 / G}
    return out


def ex10_4(group) -> None:
    """``group``: the group size of ``group_table()`` that keeps the relative error within
    ``GROUP_BUDGET`` while storing the fewest bits per weight."""
    ex = "ex10.4"
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)):
        raise GradeError(f"{ex}: give the group size as an int (one of {GROUP_SIZES}), got "
                         f"{type(group).__name__} {group!r}")
    table = group_table()
    if int(group) not in table:
        raise GradeError(f"{ex}: {group} is not in the table; choose one of {GROUP_SIZES}")
    ok = [G for G in GROUP_SIZES if table[G]["rel_error"] <= GROUP_BUDGET]
    best = min(ok, key=lambda G: table[G]["bits_per_weight"])
    row = table[int(group)]
    if row["rel_error"] > GROUP_BUDGET:
        raise GradeError(f"{ex}: group {group} has relative error {row['rel_error']:.3f}, over "
                         f"the budget {GROUP_BUDGET}: larger groups share one scale among more "
                         "weights, so an outlier stretches it for more of them")
    if int(group) != best:
        raise GradeError(f"{ex}: group {group} meets the budget ({row['rel_error']:.3f}) but "
                         f"stores {row['bits_per_weight']:.4g} bits per weight; a larger group "
                         "also meets it with fewer bits (the scales cost 16 / G bits per weight)")
    passed(ex)
