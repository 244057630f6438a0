"""Graders of Chapter 10, "Quantization".

ex10_1  Numba: per-row (per-channel) symmetric int8 quantizer, all-zero rows included  simulator
ex10_2  Numba: int4 pack and unpack kernels (signed values, odd lengths)               simulator
ex10_3  Numba: W4A16 GEMV with per-group scales (one thread per output)               simulator
ex10_4  choose a group size for an accuracy budget from a measured table              CPU
ex10_5  NumPy: int4 -> fp16 with the magic number 0x6400 (bit operations, one fp16
        subtraction, qgemv_w4_v7's nibble order), checked statically and on values   CPU
ex10_6  CUDA C++: a W8A8 GEMM, one warp per 16x8 tile, int8 mma.sync m16n8k32 with the  GPU sm_80+
        fragments loaded by hand, per-row and per-column scales dequantised to fp32
        (its rubric is read from NVRTC's PTX on a CPU too: the int8 mma, no scalar loop)

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
from ._static import python_tree, refuse_stub
from ._static import refuse_library as _refuse_library

__all__ = ["ex10_1", "ex10_2", "ex10_3", "ex10_4", "ex10_5", "ex10_6", "group_table",
           "GROUP_BUDGET", "GROUP_SIZES", "W4O_SLOT", "w4o_pack_reference", "w4o_unpack_reference",
           "W8A8_CASES"]

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
        full = n // 2          # whole pairs: where a spill cannot be a read past the end
        if np.array_equal(p, raw) and not np.array_equal(raw[:full], ref[:full]):
            raise GradeError(f"{ex}: {case}: negative values spill into the other nibble: mask "
                             "each value to its low 4 bits (q & 0xF) before combining (a "
                             "negative int8 has its high bits set)")
    if n % 2 and np.array_equal(p[:-1], ref[:-1]):
        spill = ("; or, that element being negative: negative values spill into the other "
                 "nibble unless each is masked with & 0xF") if q[-1] < 0 else ""
        raise GradeError(f"{ex}: {case}: the last byte is wrong (got 0x{int(p[-1]):02x}, "
                         f"expected 0x{int(ref[-1]):02x}): for odd n it holds element n - 1 "
                         "alone, in its low nibble, with a high nibble of 0: element n is out "
                         f"of range, never read{spill}")
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


# ----------------------------------------------------------------------------- ex10.5
#: the nibble slot (bits 4 s .. 4 s + 3 of a 32-bit word) that holds k = 0..7 in the format of
#: qgemv_w4_v7 (kernels/qgemv.cu): from bit 0 up the word holds k0 k2 k4 k6 k1 k3 k5 k7, so a
#: mask of two nibbles 16 bits apart, (w >> 4 j) & 0x000F000F, gives the pair (k 2j, k 2j + 1)
W4O_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


def _words(name: str, words) -> np.ndarray:
    if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.ndim not in (1, 2):
        what = (f"{words.dtype} array of {words.ndim} dimensions"
                if isinstance(words, np.ndarray) else type(words).__name__)
        raise TypeError(f"{name}: expected a uint32 NumPy array of shape (n,) or (rows, cols), "
                        f"got a {what}")
    return words


def w4o_unpack_reference(words: np.ndarray) -> np.ndarray:
    """int8 values q (-8..7) of uint32 words in qgemv_w4_v7's format: 8 nibbles per word,
    each q + 8, k0 k2 k4 k6 k1 k3 k5 k7 from bit 0 up. (..., cols) -> (..., 8 cols)."""
    w = _words("w4o_unpack_reference", words)
    shifts = 4 * np.array(W4O_SLOT, np.uint32)
    n = (w[..., None] >> shifts) & np.uint32(0xF)
    return (n.astype(np.int8) - 8).reshape(w.shape[:-1] + (8 * w.shape[-1],))


def w4o_pack_reference(q: np.ndarray) -> np.ndarray:
    """The inverse: int values -8..7 of shape (..., 8 cols) -> uint32 words (..., cols)."""
    q = np.asarray(q)
    if q.dtype.kind not in "iu" or q.ndim not in (1, 2) or q.shape[-1] % 8:
        raise TypeError("w4o_pack_reference: expected integers of shape (8 n,) or (rows, 8 cols), "
                        f"got {q.dtype} {q.shape}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError("w4o_pack_reference: int4 values must lie in -8..7")
    n = (q.astype(np.int64) + 8).astype(np.uint32).reshape(q.shape[:-1] + (-1, 8))
    shifts = 4 * np.array(W4O_SLOT, np.uint32)
    return np.bitwise_or.reduce(n << shifts, axis=-1).astype(np.uint32)


_FLOAT_NAMES = frozenset({"float16", "half", "float32", "single", "float64", "double", "float",
                          "float_", "longdouble", "float128", "float96"})
_FLOAT_STRINGS = frozenset({"float16", "f2", "e", "half", "float32", "f4", "f", "single",
                            "float64", "f8", "d", "double", "float", "<f2", "<f4", "<f8"})
_WIDE = frozenset({"float32", "single", "float64", "double", "float_", "longdouble", "float128",
                   "float96", "f4", "f", "f8", "d", "<f4", "<f8"})
_TRICK = ("the trick builds the float16 from bits instead: OR the nibble into 0x6400 (the fp16 "
          "bit pattern of 1024), .view(np.float16) reads 1024 + n, and one float16 subtraction "
          "of 1024 + 8 leaves q")
_LOOP_CALLS = frozenset({"vectorize", "frompyfunc", "nditer", "ndenumerate", "ndindex",
                         "apply_along_axis", "tolist", "item", "map", "fromiter"})
_ARITH_CALLS = frozenset({"multiply", "divide", "true_divide", "ldexp", "float_power", "power",
                          "cast", "can_cast"})


def _dtype_name(node) -> str | None:
    """The float dtype a node names (np.float16, float, "f4"), else None."""
    import ast

    if isinstance(node, ast.Attribute) and node.attr in _FLOAT_NAMES:
        return node.attr
    if isinstance(node, ast.Name) and node.id in _FLOAT_NAMES:
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and node.value in _FLOAT_STRINGS:
        return node.value
    return None


def _constant(node) -> bool:
    """A number written in the code (1032, -8.0, 0x6408, 1024 + 8)."""
    import ast

    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant(node.left) and _constant(node.right)
    return False


def _static_10_5(ex: str, fn) -> None:
    """The rules of ex10.5, read from the function's syntax tree (comments and strings do not
    count): no int -> float conversion, nothing wider than float16, no float scale, no Python
    loop over the elements."""
    import ast

    tree = python_tree(ex, fn)
    nodes = list(ast.walk(tree))
    wide = [n for n in nodes if _dtype_name(n) in _WIDE]
    for n in wide + nodes:
        line = getattr(n, "lineno", None) or getattr(getattr(n, "iter", n), "lineno", 1)
        where = f"line {line - tree.lineno + 1} of {tree.name}"
        if isinstance(n, ast.While):
            raise GradeError(f"{ex}: a while loop ({where}): the answer must work on whole "
                             "arrays (a few array operations; a Python loop over the elements "
                             "is what the vectorised version replaces)")
        if isinstance(n, (ast.For, ast.comprehension)):
            it = n.iter
            ok = isinstance(it, (ast.Tuple, ast.List)) and all(_constant(e) for e in it.elts) \
                or (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                    and it.func.id == "range" and all(_constant(a) for a in it.args))
            if not ok:
                raise GradeError(f"{ex}: a Python loop over the data ({where}): work on whole "
                                 "arrays; a loop may run over the 4 shifts (a tuple or range of "
                                 "constants), never over the words or their elements")
        if isinstance(n, ast.Attribute) and n.attr == "flat":
            raise GradeError(f"{ex}: .flat ({where}) walks the elements one by one in Python: "
                             "work on whole arrays")
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            args = list(n.args) + [k.value for k in n.keywords]
            named = [d for d in map(_dtype_name, args) if d]
            if name in _LOOP_CALLS:
                raise GradeError(f"{ex}: {name}() ({where}) runs Python per element: work on "
                                 "whole arrays with NumPy's bit operators (& | >> <<)")
            if name in _ARITH_CALLS:
                raise GradeError(f"{ex}: np.{name}() ({where}): the rule is integer bit "
                                 "operations and one float16 subtraction; " + _TRICK)
            if name == "astype" and named:
                _refuse_float(ex, where, named[0], "astype")
            if _dtype_name(f) and not all(_constant(a) for a in args):
                _refuse_float(ex, where, _dtype_name(f), "call")
            if named and name not in ("view", "frombuffer"):
                _refuse_float(ex, where, named[0], name)
        if _dtype_name(n) in _WIDE:
            _refuse_float(ex, where, _dtype_name(n), "wide")
        if isinstance(n, (ast.BinOp, ast.AugAssign)):
            op = n.op
            if isinstance(op, (ast.Div, ast.Pow, ast.MatMult)):
                sym = {ast.Div: "/", ast.Pow: "**", ast.MatMult: "@"}[type(op)]
                raise GradeError(f"{ex}: the operator {sym} ({where}): the rule "
                                 "is integer bit operations and one float16 subtraction; "
                                 + _TRICK)
            if isinstance(op, (ast.Mult, ast.FloorDiv)):
                pair = (n.left, n.right) if isinstance(n, ast.BinOp) else (n.target, n.value)
                if not any(isinstance(p, ast.Constant) and type(p.value) is int for p in pair):
                    raise GradeError(f"{ex}: a multiplication ({where}) by something other "
                                     "than an integer constant: multiplying integers by a "
                                     "float scale (or by np.float16(1)) converts them to "
                                     "floats; " + _TRICK)


def _refuse_float(ex: str, where: str, dtype: str, how: str) -> None:
    if dtype in _WIDE:
        raise GradeError(f"{ex}: {dtype} ({where}): subtracting in float32 (or float64) and "
                         "casting back gives the right values, but the rule is one float16 "
                         "subtraction (the kernel's __hsub2 on a half2): keep the array float16 "
                         "from .view(np.float16) to the result")
    what = {"astype": f".astype({dtype})", "call": f"{dtype}(...) of a variable"}.get(
        how, f"{how}(..., {dtype})")
    raise GradeError(f"{ex}: {what} ({where}) converts integers to floats (a conversion "
                     "instruction per value, which is what the magic number avoids): " + _TRICK
                     + ". Only .view(np.float16) may name the float type, and np.float16 of a "
                     "constant such as 1032")


def _per_word(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, 8)


def _diagnose_10_5(ex: str, case: str, words: np.ndarray, out, ref: np.ndarray) -> None:
    if not isinstance(out, np.ndarray):
        raise GradeError(f"{ex}: {case}: returned {type(out).__name__}; return a NumPy array")
    if out.dtype != np.float16:
        raise GradeError(f"{ex}: {case}: returned {out.dtype}, expected float16 (view the "
                         "words' bits as np.float16 and subtract in float16)")
    if out.shape != ref.shape:
        raise GradeError(f"{ex}: {case}: returned shape {out.shape}, expected {ref.shape} (8 "
                         "values per word, k = 8 w + j at [..., 8 w + j]: reshape the last two "
                         "axes into one)")
    o = out.astype(np.float64)
    r = ref.astype(np.float64)
    if (o == r).all():
        return
    n = r + 8                                   # the stored nibbles, in k order
    k = out.shape[-1]
    if (o == r + 8).all():
        raise GradeError(f"{ex}: {case}: the values are 0..15, the stored nibbles q + 8: "
                         "forgot the offset; subtract 1024 + 8 = 1032, not 1024")
    if (o == r + 1032).all():
        raise GradeError(f"{ex}: {case}: the values are 1024 + n: the subtraction is missing")
    if (o == np.where(n >= 8, n - 16, n)).all():
        raise GradeError(f"{ex}: {case}: each nibble was read as two's complement (nibbles "
                         "8..15 as -8..-1, or an xor with 0x88888888 as qgemv_w4_v2 does on "
                         "its format): here the nibbles are stored as q + 8, so subtracting "
                         "1024 + 8 alone gives q")
    if k and (np.sort(_per_word(o), axis=1) == np.sort(_per_word(r), axis=1)).all():
        slot = _per_word(r)[:, np.argsort(W4O_SLOT)]              # slot order, bit 0 up
        swap = _per_word(r)[:, [1, 0, 3, 2, 5, 4, 7, 6]]
        if (_per_word(o) == slot).all():
            raise GradeError(f"{ex}: {case}: the values come out in the order of the nibbles "
                             "from bit 0 up (k0 k2 k4 k6 k1 k3 k5 k7): the interleave of the "
                             "format was ignored. Nibbles 16 bits apart are (k0, k1), (k2, k3)...: "
                             "mask them in pairs, (w >> 4 j) & 0x000F000F")
        if (_per_word(o) == swap).all():
            raise GradeError(f"{ex}: {case}: the two values of each pair are swapped (k1 k0 "
                             "k3 k2 ...): .view(np.float16) puts the low 16 bits of a uint32 "
                             "first (little-endian), and k 2j sits in the low half")
        raise GradeError(f"{ex}: {case}: the right values of each word in the wrong order: the "
                         "word holds k0 k2 k4 k6 k1 k3 k5 k7 from bit 0 up, and the result must "
                         "be k0 k1 ... k7")
    if ((o == r) | (o == 16 * n - 8)).all():
        raise GradeError(f"{ex}: {case}: some values are 16 n - 8: a nibble masked in place in "
                         "bits 4..7 of its half reads as 1024 + 16 n. Shift it down to bits "
                         "0..3 first (the kernel undoes the 16 with an FMA by 1/16; the rule "
                         "here is one subtraction)")
    if not np.isfinite(o).all() or (o < -8).any() or (o > 15).any() or (o != np.round(o)).any():
        magic = ("0x4B00 is the top half of fp32's magic 0x4B000000 (2^23); "
                 if (np.abs(o + 1018) < 2).any() else "")
        raise GradeError(f"{ex}: {case}: values that are not the integers -8..7 (e.g. "
                         f"{o.flat[np.argmax(o != r)]:g}): the float16 you built is not "
                         f"1024 + n. Check the magic number: {magic}fp16 has 5 exponent bits "
                         "and 10 mantissa bits, and the bit pattern of 1024 = 2^10 is 0x6400, "
                         "with the nibble in the lowest mantissa bits")
    i = np.unravel_index(int(np.argmax(o != r)), o.shape)
    w = words[i[:-1] + (i[-1] // 8,)]
    raise GradeError(f"{ex}: {case}: wrong at {tuple(int(t) for t in i)} (word 0x{int(w):08X}, "
                     f"k = {i[-1] % 8}): got {o[i]:g}, expected {r[i]:g}")


def ex10_5(dequant_magic) -> None:
    """``dequant_magic(words)``: uint32 words of int4 weights in qgemv_w4_v7's format ->
    float16 values, by the magic number 0x6400 (bit operations and one fp16 subtraction)."""
    ex = "ex10.5"
    if not callable(dequant_magic):
        raise GradeError(f"{ex}: expected the function dequant_magic, got "
                         f"{type(dequant_magic).__name__}")
    _static_10_5(ex, dequant_magic)
    rng, seed = fresh_rng()
    n = int(rng.integers(50, 400)) | 1
    every = np.array([[(v + j) % 16 for j in range(8)] for v in range(16)]
                     + [[v] * 8 for v in range(16)], np.int64) - 8
    cases = [
        ("every nibble value 0..15 in every position of a word", w4o_pack_reference(every.ravel())),
        ("the example of the specification", np.array([0x75316420], np.uint32)),
        (f"random words, n = {n} (seed {seed})",
         rng.integers(0, 2 ** 32, n, dtype=np.uint32)),
        (f"random words of shape (7, 13) (seed {seed})",
         rng.integers(0, 2 ** 32, (7, 13), dtype=np.uint32)),
        ("an empty input of shape (0,)", np.zeros(0, np.uint32)),
        ("an empty input of shape (3, 0)", np.zeros((3, 0), np.uint32)),
    ]
    for case, words in cases:
        ref = w4o_unpack_reference(words).astype(np.float16)
        keep = words.copy()
        box: list[Any] = []
        call(ex, case, lambda words=words: box.append(dequant_magic(words)))
        if not np.array_equal(words, keep):
            raise GradeError(f"{ex}: {case}: the input words were modified; leave them as "
                             "they are")
        _diagnose_10_5(ex, case, words, box[0], ref)
    passed(ex)


# ============================================================================ ex10.6
#: ex10_6: (M, N, K, what): one tile; odd numbers of tiles in every direction; a long K; the
#: largest magnitudes (every product +-127 * 127 or -128 * -128, sums past float32's 2^24)
W8A8_CASES = ((16, 8, 32, "one tile"), (48, 24, 96, "3 x 3 tiles, 3 k-steps"),
              (112, 104, 160, "7 x 13 tiles"), (16, 40, 2048, "K = 2048"),
              (32, 16, 4096, "values of largest magnitude, K = 4096"))
_W8A8 = "w8a8_gemm"


def _frag_a(g: int, t: int, i: int) -> tuple[int, int]:
    """(row, first k) of A register i (4 int8, k .. k + 3) of lane 4 g + t: m16n8k32, .row."""
    return g + 8 * (i % 2), 4 * t + 16 * (i // 2)


def _frag_b(g: int, t: int, i: int) -> tuple[int, int]:
    """(first k, column n) of B register i (4 int8)."""
    return 4 * t + 16 * i, g


def _frag_c(g: int, t: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator i."""
    return g + 8 * (i // 2), 2 * t + i % 2


def _mma_with(A, B, a_map=_frag_a, b_map=_frag_b, c_map=_frag_c):
    """A (M, K) @ B (N, K)^T in int64, tile by tile, as a warp does it when its fragments are
    loaded by ``a_map``/``b_map`` and its accumulators stored by ``c_map`` while the tensor cores
    read them by the true layout: what a kernel with that mapping computes."""
    M, K = A.shape
    N = B.shape[0]
    C = np.zeros((M, N), np.int64)
    for m0 in range(0, M, 16):
        for n0 in range(0, N, 8):
            acc = np.zeros((16, 8), np.int64)
            for k0 in range(0, K, 32):
                a = np.zeros((16, 32), np.int64)
                b = np.zeros((32, 8), np.int64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for i in range(4):
                        (tr, tk), (sr, sk) = _frag_a(g, t, i), a_map(g, t, i)
                        a[tr, tk:tk + 4] = A[m0 + sr, k0 + sk:k0 + sk + 4]
                    for i in range(2):
                        (tk, tn), (sk, sn) = _frag_b(g, t, i), b_map(g, t, i)
                        b[tk:tk + 4, tn] = B[n0 + sn, k0 + sk:k0 + sk + 4]
                acc += a @ b
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i in range(4):
                    (tr, tc), (sr, sc) = _frag_c(g, t, i), c_map(g, t, i)
                    C[m0 + sr, n0 + sc] = acc[tr, tc]
    return C


#: ex10_6: fragment mappings a reader gets wrong, each as (a_map, b_map, c_map, hint)
_FRAG_MISTAKES = (
    (lambda g, t, i: (g + 8 * (i // 2), 4 * t + 16 * (i % 2)), _frag_b, _frag_c,
     "A's registers 1 and 2 are exchanged: register 1 holds row g + 8 (k = 4t .. 4t + 3), "
     "register 2 row g with k = 16 + 4t .. 16 + 4t + 3"),
    (lambda g, t, i: (g + 8 * (i % 2), 4 * t + 8 * (i // 2)),
     lambda g, t, i: (4 * t + 8 * i, g), _frag_c,
     "the second half of k starts at 16, not 8: in m16n8k32 registers 2 and 3 of A and "
     "register 1 of B hold k = 16 + 4t .. 16 + 4t + 3 (fp16's m16n8k16 has +8 elements: the "
     "same 16 bytes)"),
    (lambda g, t, i: (g + 8 * (i % 2), 4 * t + 8 * (i // 2)), _frag_b, _frag_c,
     "A's registers 2 and 3 start at k = 8 + 4t: they hold k = 16 + 4t .. 16 + 4t + 3 (the "
     "second half of the 32 k of the step)"),
    (_frag_a, lambda g, t, i: (4 * t + 8 * i, g), _frag_c,
     "B's register 1 starts at k = 8 + 4t: it holds k = 16 + 4t .. 16 + 4t + 3"),
    (lambda g, t, i: (g + 8 * (i % 2), 2 * t + 16 * (i // 2)),
     lambda g, t, i: (2 * t + 16 * i, g), _frag_c,
     "a register holds 4 int8 values, so lane t's k start at 4t (fp16's layout has 2 per "
     "register, 2t): k = 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3"),
    (_frag_a, _frag_b, lambda g, t, i: (g + 8 * (i % 2), 2 * t + i // 2),
     "the accumulators are stored in the wrong places: c[i] is row g + 8 (i / 2), column "
     "2t + (i % 2) (c[0], c[1] a pair of columns of row g; c[2], c[3] of row g + 8)"),
)


def _w8a8_rubric(ex: str, src: str) -> None:
    """Before anything runs (on a CPU too): C written; NVRTC's PTX (sm_80) holds the int8
    mma.sync and no int8 arithmetic on the CUDA cores (dp4a, int8 values widened one by one)."""
    import re

    from ._static import cuda_code, cuda_ptx, ptx_instructions

    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    if not re.search(r"\bC\s*(\[|\+(?!=))", cuda_code(src)):
        raise GradeError(f"{ex}: not implemented yet: the kernel never writes C (is its body "
                         "still the stub?)")
    ptx = cuda_ptx(ex, src, "compute_80")
    if ptx is None:
        return
    ins = ptx_instructions(ex, ptx, _W8A8)
    ops = [i.split()[0] for i in ins]
    if not any(op.startswith("mma.sync") and ".s8" in op for op in ops):
        raise GradeError(f"{ex}: the compiled kernel has no int8 tensor-core instruction (no "
                         "mma.sync ... .s8.s8 in its PTX): call mma_s8 (the asm of the cell) "
                         "once per 32-deep step of k")
    if any(op.startswith("dp4a") for op in ops):
        raise GradeError(f"{ex}: the kernel's PTX holds dp4a, the CUDA cores' 4-way int8 dot "
                         "product (igemm_v1 of the chapter; the compiler also makes it of a "
                         "scalar loop over k of int8 products): the products belong on the tensor "
                         "cores, mma_s8 once per 32-deep step of k, and nothing else")
    scalar = [op for op in ops if re.match(r"(ld(\.\w+)*\.s8|cvt(\.\w+)*\.s8)$", op)]
    if scalar:
        raise GradeError(f"{ex}: the kernel widens int8 values one at a time ({scalar[0]} in its "
                         "PTX): a scalar loop over k on the CUDA cores. The tensor cores take "
                         "the int8 values packed, 4 to a 32-bit register: load each fragment "
                         "register as one 32-bit word, 4 consecutive k of one row")


def ex10_6(src: str) -> None:
    """``src`` defines ``w8a8_gemm(A, B, sa, sb, C, M, N, K)``: C (M, N) float32 = (A @ B^T) *
    sa[row] * sb[col], A (M, K) and B (N, K) int8 row-major, sa (M,), sb (N,) float32 (per-row
    and per-output-channel scales: W8A8), the int32 products by mma.sync m16n8k32. One warp per
    16x8 tile: grid (N / 8, M / 16), block 32; M % 16 == N % 8 == K % 32 == 0. The rubric from
    the PTX first (on a CPU too); then, on a GPU of compute capability 8.0 or more, odd numbers
    of tiles, K up to 4096 and the largest magnitudes, NaN-filled C with a canary, two calls."""
    import cupy

    from .. import env
    from ._core import canary_ok, compile_kernel, guarded, need_gpu

    ex = "ex10.6"
    _w8a8_rubric(ex, src)
    need_gpu(ex)
    if env.cc() < (8, 0):
        raise GradeError(f"{ex}: needs a GPU of compute capability 8.0 or more (int8 mma.sync "
                         f"m16n8k32); this one is {env.cc()[0]}.{env.cc()[1]}")
    kern = compile_kernel(ex, src, _W8A8)
    rng, seed = fresh_rng()
    for M, N, K, what in W8A8_CASES:
        for rep in range(2):
            if "largest" in what:
                A = rng.choice(np.array([-128, -127, 127], np.int8), (M, K))
                B = rng.choice(np.array([-128, -127, 127], np.int8), (N, K))
            else:
                A = rng.integers(-127, 128, (M, K), dtype=np.int8)
                B = rng.integers(-127, 128, (N, K), dtype=np.int8)
            sa = rng.uniform(0.001, 0.02, M).astype(np.float32)
            sb = rng.uniform(0.001, 0.02, N).astype(np.float32)
            acc = A.astype(np.int64) @ B.astype(np.int64).T
            ref = acc * sa.astype(np.float64)[:, None] * sb.astype(np.float64)[None, :]
            C, buf = guarded((M, N))
            case = f"M={M}, N={N}, K={K}, {what} (seed {seed}, call {rep + 1})"
            call(ex, case, lambda: kern((N // 8, M // 16), (32,), (
                cupy.asarray(A), cupy.asarray(B), cupy.asarray(sa), cupy.asarray(sb), C,
                np.int32(M), np.int32(N), np.int32(K))))
            if not canary_ok(buf, M * N):
                raise GradeError(f"{ex}: {case}: wrote past the end of C: row m0 + g + 8 (i / 2) "
                                 "< M and column n0 + 2t + (i % 2) < N for every accumulator")
            got = to_numpy(C).astype(np.float64)
            # (float)acc rounds once (past 2^24), then two float32 products: a few ulps
            bad = ~(np.abs(got - ref) <= 1e-30 + 4e-7 * np.abs(ref))
            if not bad.any():
                continue
            raise GradeError(f"{ex}: {case}: C is wrong ({error_summary(got, ref, bad)}): "
                             + _w8a8_hint(got, ref, acc, A, B, sa, sb))
    passed(ex)


def _w8a8_hint(got, ref, acc, A, B, sa, sb) -> str:
    def near(x) -> bool:
        return bool(np.allclose(got, x, rtol=1e-5, atol=1e-30))

    if np.isnan(got).all():
        return "C is never written (NaN everywhere): is the kernel body still the stub?"
    if np.isnan(got).any():
        return ("some elements of C are never written: each lane stores its 4 accumulators, "
                "c[i] at row m0 + g + 8 (i / 2), column n0 + 2t + (i % 2)")
    s64a, s64b = sa.astype(np.float64)[:, None], sb.astype(np.float64)[None, :]
    if near(acc.astype(np.float64)):
        return ("C holds the int32 sums in quantised units: dequantise, C = acc * sa[row] * "
                "sb[col] (the scale of the activation's row and of the weight's output channel)")
    if near(acc * s64a) or near(acc * s64b):
        return ("only one of the two scales: C = acc * sa[row] * sb[col], one per row of A and "
                "one per row of B (column of C)")
    for a_map, b_map, c_map, hint in _FRAG_MISTAKES:
        if near(_mma_with(A, B, a_map, b_map, c_map) * s64a * s64b):
            return hint
    return ("lane 4 g + t holds A's rows g, g + 8 at k = 4t .. 4t + 3 (registers 0, 1) and "
            "16 + 4t .. 16 + 4t + 3 (registers 2, 3), B's row (column of B^T) g at the same two "
            "k ranges, and C's rows g, g + 8 at columns 2t, 2t + 1; C = acc * sa[row] * sb[col]")
