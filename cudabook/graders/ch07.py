"""Graders of Chapter 7, "Transformer inference".

ex07_1  Numba: rotary position embedding (RoPE), half-split pairs (i, i + D/2)          simulator
ex07_2  Numba: append one token to the KV cache and attend over the cache               simulator
ex07_3  Numba: top-k sampling with temperature, inverse CDF of a given uniform number   simulator
ex07_4  CUDA C++ via CuPy: decode attention over a KV cache of any length, ragged lengths  GPU

Every grader compares with a float64 NumPy reference, runs ragged sizes twice with a fresh seed,
fills outputs with NaN (a canary after them), and, when an answer is wrong, compares it with the
answers of the usual mistakes to name the one it made. ex07_2 and ex07_3 also run extreme inputs
(scores near +-1000, logits x 1/T beyond float32's exp range), where only a softmax that
subtracts the maximum stays finite; every grader refuses library calls inside the kernel (the
simulator runs them, a GPU cannot compile them) and ex07_2 a barrier that not every thread
reaches.

ex07_4 reads the answer's code first (``_cuda_ch06_07.rubric``, so on a CPU too): no library, no
dynamic shared memory (the grader launches with none), a __shared__ array and a barrier. On a
GPU it runs caches from 1 to 16411 keys with ragged lengths per head, scores near +-1000, D = 64
and 128, names the mistake a wrong answer's values match (keys past the head's length, no scale,
no normalisation, ...) and ends with compute-sanitizer racecheck.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..check import to_numpy
from ..launch import ceil_div
from ._core import (
    GradeError,
    call,
    canary_ok,
    error_summary,
    fresh_rng,
    guarded,
    looks_like_low_precision,
    need_gpu,
    padded,
    passed,
    to_device,
)
from ._cuda_ch06_07 import rubric
from ._race import simulate
from ._static import calls, python_code, refuse_stub, thread_divergent_barriers
from ._static import refuse_library as _refuse_library

__all__ = ["ex07_1", "ex07_2", "ex07_3", "ex07_4", "rope_reference", "decode_reference",
           "topk_reference", "decode_attention_reference", "TPB", "KMAX", "ATTN_THREADS",
           "ATTN_CASES"]

TPB = 32       # threads per block of the launches of ex07_1 and ex07_3
KMAX = 16      # ex07_3: the largest k
RTOL = 1e-4    # float32 results against float64 references
ATOL = 1e-5


def _bad(o, r, rtol=RTOL, atol=ATOL) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return ~(np.abs(o - r) <= atol + rtol * np.abs(r))


def _close(o, r, rtol=RTOL, atol=ATOL) -> bool:
    return not _bad(o, r, rtol, atol).any()


# ----------------------------------------------------------------------------- ex07.1
def rope_reference(x, pos, base: float = 10000.0, pairs: str = "half", sign: float = 1.0,
                   freq: float = 2.0, inv=None, chained: bool = False):
    """RoPE of x (R, H, D) with row r at position pos[r], in float64. ``pairs="half"`` rotates
    (i, i + D/2) (the book's convention), ``"interleaved"`` (2i, 2i + 1); ``sign`` -1 rotates
    the other way and ``freq`` replaces the 2 of theta_i = base^(-2i/D); ``inv`` (D/2,) replaces
    theta_i altogether; ``chained`` computes y[i + D/2] from the rotated y[i] instead of x[i]
    (all mistakes the grader recognises)."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    h = D // 2
    if inv is None:
        inv = base ** (-freq * np.arange(h) / D)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None]          # (R, D/2)
    c, s = np.cos(ang)[:, None], sign * np.sin(ang)[:, None]
    if pairs == "half":
        a, b = x[..., :h], x[..., h:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ya = a * c - b * s
    yb = b * c + (ya if chained else a) * s
    y = np.empty_like(x)
    if pairs == "half":
        y[..., :h], y[..., h:] = ya, yb
    else:
        y[..., 0::2], y[..., 1::2] = ya, yb
    return y


def _rope_hint(got, x, pos, base) -> str:
    R = x.shape[0]
    if np.isnan(got).all():
        return "nothing was written to out"
    nan = np.isnan(got)
    if nan.any():
        D = x.shape[2]
        upper = nan[..., D // 2:].any()
        lower = nan[..., :D // 2].any()
        if upper and not lower:
            return ("the second half of each head (i >= D/2) was never written: each thread "
                    "owns the pair (i, i + D/2) and writes both")
        return (f"{int(nan.sum())} of {got.size} elements never written: one thread per pair, "
                f"grid covering R * H * D/2 pairs?")
    mistakes = [
        (rope_reference(x, pos, base, pairs="interleaved"),
         "rotated the interleaved pairs (2i, 2i+1); this book's RoPE pairs i with i + D/2 "
         "(the half-split convention)"),
        (rope_reference(x, pos, base, sign=-1.0),
         "rotated by -angle: y[i] = x[i] cos - x[i + D/2] sin, y[i + D/2] = x[i + D/2] cos + "
         "x[i] sin"),
        (rope_reference(x, pos, base, freq=1.0),
         "theta_i = base^(-i/D): the exponent is -2i/D"),
        (rope_reference(x, pos, base, freq=4.0),
         "theta_i = base^(-2i/(D/2)): the exponent is -2i/D, with D the whole head dimension "
         "(not D/2)"),
        (rope_reference(x, pos, base, inv=base ** np.floor(-2 * np.arange(x.shape[2] // 2)
                                                            / x.shape[2])),
         "the exponent is an integer division (-2 * i // D is 0 or -1): divide as floats, "
         "-2.0 * i / D"),
        (rope_reference(x, pos, base, chained=True),
         "y[i + D/2] was computed from the already rotated y[i] (a variable overwritten "
         "before its second use): keep both x values until both outputs are computed"),
        (rope_reference(x, np.arange(R) % max(1, R), base),
         "the angle uses the row index, not pos[row]"),
        (rope_reference(x, np.zeros(R), base), "no rotation at all (angle 0): pos * theta_i"),
        (x.astype(np.float64), "out is a copy of x: nothing rotated"),
    ]
    for ref, hint in mistakes:
        if _close(got, ref, 1e-3, 1e-4):
            return hint
    return "compare with the formulas of the specification"


def ex07_1(rope) -> None:
    """``rope(x, pos, out, base)`` is a @cuda.jit kernel launched [ceil(R * H * (D/2) / 32), 32],
    one thread per pair: x, out (R, H, D) float32, pos (R,) int32, base a float. Row r's head
    vectors are at position pos[r]; pairs (i, i + D/2) rotate by pos[r] * base^(-2i/D)."""
    ex = "ex07.1"
    refuse_stub(ex, rope)
    _refuse_library(ex, rope, "one thread per pair, math.cos and math.sin of its angle")
    rng, seed = fresh_rng()
    for rep in range(2):
        for R, H, D, base in [(1, 1, 2, 10000.0), (3, 2, 6, 10000.0), (5, 3, 16, 10000.0),
                              (7, 2, 64, 500.0), (2, 1, 128, 10000.0)]:
            pos = rng.choice(np.arange(1, 4096, 2), R).astype(np.int32)   # odd positions
            pos[0] = 1
            x = rng.standard_normal((R, H, D)).astype(np.float32)
            ref = rope_reference(x, pos, base)
            case = (f"R={R}, H={H}, D={D}, base={base:g}, positions {pos.tolist()[:4]} "
                    f"(seed {seed}, call {rep + 1})")
            out, buf = guarded((R, H, D))
            n = R * H * (D // 2)
            grid = ceil_div(n, TPB)
            call(ex, case, lambda: rope[grid, TPB](to_device(x), to_device(pos), out,
                                                    np.float32(base)))
            if not canary_ok(buf, R * H * D):
                raise GradeError(f"{ex}: {case}: wrote past the end of out: guard the thread "
                                 "index (the grid has more threads than pairs)")
            got = to_numpy(out).astype(np.float64)
            # angles of up to 4096 rad in float32: allow the rounding of the angle itself
            bad = _bad(got, ref, 2e-3, 2e-3)
            if bad.any():
                raise GradeError(f"{ex}: {case}: out is wrong ({error_summary(got, ref, bad)}): "
                                 f"{_rope_hint(got, x, pos, base)}")
    passed(ex)


# ----------------------------------------------------------------------------- ex07.2
def decode_reference(q, kc, vc, k_new, v_new, pos: int, scale: float, see: int | None = None):
    """(out, kc', vc') of one decode step in float64: k_new, v_new written at position pos of
    each (b, h), then softmax(scale q k^T) v over positions 0..pos (0..see-1 if ``see``)."""
    kc, vc = np.array(kc, np.float64), np.array(vc, np.float64)
    kc[:, :, pos], vc[:, :, pos] = k_new, v_new
    n = pos + 1 if see is None else see
    s = np.einsum("bhd,bhjd->bhj", np.asarray(q, np.float64), kc[:, :, :n]) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhj,bhjd->bhd", p, vc[:, :, :n]), kc, vc


_DECODE_GENERIC = "softmax over the scores of keys 0..pos, then the weighted sum of their values"
_DECODE_SYNC = ("cuda.syncthreads() after writing the new row into the cache and before "
                "reading the cache: other threads read the row this thread wrote")
_DECODE_OVERFLOW = ("exp of a large score overflowed (the scores here are near +1000): subtract "
                    "the largest score m before exp, p = exp(s * scale - m)")
_DECODE_UNDERFLOW = ("every exp(s * scale - m) underflowed to 0, so the softmax sum is 0 (the "
                     "scores here are all near -1000): m must be the largest score itself; "
                     "start it at -inf, not at 0")
#: (B, H, L, D, pos, sign) of the extreme cases: scores 10 * (sign * 100 + 0.3 N(0, 1))
_DECODE_EXTREME = [(2, 2, 7, 8, 4, 1.0), (1, 3, 6, 4, 5, -1.0)]


def _decode_inputs(rng, B, H, L, D, pos, sign=None):
    """q, k_new, v_new, kc, vc, scale. With ``sign`` the scores of keys 0..pos are all near
    sign * 1000 (q is a multiple of e_0, the keys' element 0 near sign * 100)."""
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    kn = rng.standard_normal((B, H, D)).astype(np.float32)
    vn = rng.standard_normal((B, H, D)).astype(np.float32)
    kc = rng.standard_normal((B, H, L, D)).astype(np.float32)
    vc = rng.standard_normal((B, H, L, D)).astype(np.float32)
    kc[:, :, pos:] = 3.0 * rng.standard_normal((B, H, L - pos, D))   # the future: large
    vc[:, :, pos:] = 5.0 + rng.standard_normal((B, H, L - pos, D))   # and different
    scale = 1 / math.sqrt(D)
    if sign is not None:
        q[:] = 0.0
        q[..., 0] = np.float32(10.0 / scale)
        kc[:, :, :pos, 0] = sign * 100.0 + 0.3 * rng.standard_normal((B, H, pos))
        kn[..., 0] = sign * 100.0 + 0.3 * rng.standard_normal((B, H))
    return q, kn, vn, kc, vc, scale


def ex07_2(decode_step) -> None:
    """``decode_step(q, k_new, v_new, kc, vc, pos, out, scale)`` is a @cuda.jit kernel launched
    [(H, B), D]: block (h, b), thread t owns element t of the head vector. q, k_new, v_new, out
    are (B, H, D), the caches kc, vc (B, H, L, D), float32; pos (an int) is the new token's
    position. It writes k_new, v_new into the caches at pos, then out = softmax(scale q k^T) v
    over the cached positions 0..pos (the new token included, nothing after it)."""
    ex = "ex07.2"
    refuse_stub(ex, decode_step)
    _refuse_library(ex, decode_step, "loops over the keys and the head dimension, with "
                    "math.exp and scalars")
    found = thread_divergent_barriers(ex, decode_step)
    if found:
        raise GradeError(f"{ex}: {found[0]}. Every thread of the block must reach "
                         "cuda.syncthreads(): on a GPU a barrier that some threads skip is "
                         "undefined (a hang, or a barrier that waits for nobody). Let every "
                         "thread write its own element, then call cuda.syncthreads() outside "
                         "any if")
    rng, seed = fresh_rng()
    cases = [(B, H, L, D, pos, None, rep) for rep in range(2)
             for B, H, L, D, pos in [(1, 1, 4, 2, 0), (2, 3, 9, 8, 5), (1, 2, 13, 16, 11),
                                     (3, 1, 20, 6, 19)]]
    cases += [(B, H, L, D, pos, sign, 0) for B, H, L, D, pos, sign in _DECODE_EXTREME]
    for B, H, L, D, pos, sign, rep in cases:
        q, kn, vn, kc, vc, scale = _decode_inputs(rng, B, H, L, D, pos, sign)
        ref, kref, vref = decode_reference(q, kc, vc, kn, vn, pos, scale)
        case = f"B={B}, H={H}, L={L}, D={D}, pos={pos} (seed {seed}, call {rep + 1})"
        if sign is not None:
            case = (f"B={B}, H={H}, L={L}, D={D}, pos={pos}, every score near "
                    f"{sign * 1000:+.0f} (seed {seed})")
        out, buf = guarded((B, H, D))
        dkc, dvc = to_device(kc), to_device(vc)
        try:
            call(ex, case, lambda: decode_step[(H, B), D](to_device(q), to_device(kn),
                                                          to_device(vn), dkc, dvc, pos, out,
                                                          np.float32(scale)))
        except GradeError as e:
            if sign is not None and ("OverflowError" in str(e)
                                     or "math range error" in str(e)):
                raise GradeError(f"{ex}: {case}: {_DECODE_OVERFLOW}") from None
            if "division by zero" in str(e):
                if sign is not None:
                    raise GradeError(f"{ex}: {case}: division by zero: "
                                     f"{_DECODE_UNDERFLOW}") from None
                raise GradeError(f"{ex}: {case}: division by zero: the softmax sum is 0, so "
                                 "no key was attended; keys 0..pos: the new token must "
                                 "also see itself") from None
            raise
        if not canary_ok(buf, B * H * D):
            raise GradeError(f"{ex}: {case}: wrote past the end of out")
        gk, gv = to_numpy(dkc).astype(np.float64), to_numpy(dvc).astype(np.float64)
        _check_cache(ex, case, gk, gv, kref, vref, kc, kn, vn, pos)
        got = to_numpy(out).astype(np.float64)
        # extreme scores: float32 rounding of scores near 1000 moves the weights by ~1e-4
        bad = _bad(got, ref, 1e-4, 1e-5) if sign is None else _bad(got, ref, 2e-3, 2e-3)
        if bad.any() and sign is not None:
            hint = (_DECODE_OVERFLOW if sign > 0 else _DECODE_UNDERFLOW) \
                if not np.isfinite(got).all() else \
                _decode_hint(got, q, kc, vc, kn, vn, pos, L, scale)
            raise GradeError(f"{ex}: {case}: out is wrong ({error_summary(got, ref, bad)}): "
                             f"{hint}")
        if bad.any():
            hint = _decode_hint(got, q, kc, vc, kn, vn, pos, L, scale)
            if hint == _DECODE_GENERIC and not calls(python_code(ex, decode_step),
                                                     "cuda.syncthreads"):
                hint = "the cache is right but out is not: " + _DECODE_SYNC
            raise GradeError(f"{ex}: {case}: out is wrong ({error_summary(got, ref, bad)}): "
                             f"{hint}")
    simulate(ex, "ex07_2", [("decode_step", decode_step)], hint=_DECODE_SYNC)
    passed(ex)


def _check_cache(ex, case, gk, gv, kref, vref, kc, kn, vn, pos) -> None:
    ok_k, ok_v = np.allclose(gk, kref, 0, 0), np.allclose(gv, vref, 0, 0)
    if ok_k and ok_v:
        return
    L = kc.shape[2]
    for what, g, new in (("k", gk, kn), ("v", gv, vn)):
        where = [p for p in range(L) if np.array_equal(g[:, :, p], new.astype(np.float64))]
        if where and pos not in where:
            raise GradeError(f"{ex}: {case}: the new {what} was written at position {where[0]} "
                             f"of the cache, not at pos = {pos}: cache write at the wrong "
                             "position")
    changed = ~np.isclose(gk, kc.astype(np.float64), 0, 0)
    changed[:, :, pos] = False
    if changed.any():
        p = int(np.argwhere(changed)[0][2])
        raise GradeError(f"{ex}: {case}: the key cache changed at position {p}: only position "
                         f"pos = {pos} may be written")
    raise GradeError(f"{ex}: {case}: the cache does not hold k_new and v_new at pos = {pos} "
                     f"(k {'ok' if ok_k else 'wrong'}, v {'ok' if ok_v else 'wrong'}): write "
                     "kc[b, h, pos, t] = k_new[b, h, t] and the same for v")


def _decode_hint(got, q, kc, vc, kn, vn, pos, L, scale) -> str:
    if np.isnan(got).all():
        return ("nothing was written to out" if pos else "out is NaN at pos = 0: nothing "
                "written, or 0/0 because no key was attended (the new token must also see "
                "itself)")
    if np.isnan(got).any():
        return "some elements of out never written (one thread per element t < D writes it)"
    fits = []
    for see, hint in [(L, "attention over the whole cache lets the token see the future "
                          "(positions after pos hold no token yet): keys 0..pos only"),
                      (pos + 2, "keys 0..pos+1: one key too many, the token sees the future"),
                      (pos, "keys 0..pos-1: the new token must also see itself (its own key "
                            "at pos)")]:
        if 1 <= see <= L:
            alt = decode_reference(q, kc, vc, kn, vn, pos, scale, see)[0]
            if _close(got, alt, 1e-4, 1e-5):
                fits.append((float(np.abs(got - alt).max()), hint))
    if fits:     # two windows can agree when the extra keys get ~0 weight: the closer one wins
        return min(fits, key=lambda f: f[0])[1]
    old = decode_reference(q, kc, vc, kc[:, :, pos], vc[:, :, pos], pos, scale)[0]
    if _close(got, old, 1e-4, 1e-5):
        return ("attended over the old row at pos: the new key/value were not in the cache "
                "when it was read (write first, cuda.syncthreads(), then read)")
    D = q.shape[2]
    seen = np.empty_like(got)         # thread t saw only elements 0..t of the new row (no barrier)
    for t in range(D):
        kp, vp = kc[:, :, pos].copy(), vc[:, :, pos].copy()
        kp[..., :t + 1], vp[..., :t + 1] = kn[..., :t + 1], vn[..., :t + 1]
        seen[..., t] = decode_reference(q, kc, vc, kp, vp, pos, scale)[0][..., t]
    if _close(got, seen, 1e-4, 1e-5):
        return ("thread t read the new row before the other threads wrote it: "
                + _DECODE_SYNC)
    nos = decode_reference(q, kc, vc, kn, vn, pos, 1.0)[0]
    if _close(got, nos, 1e-4, 1e-5):
        return "scores not multiplied by scale"
    return _DECODE_GENERIC


# ----------------------------------------------------------------------------- ex07.3
def topk_reference(z, u, inv_temp: float, k: int, ties: str = "low"):
    """The token of each row: the k largest logits in order (larger first, equal ones by lower
    id; ``ties="high"`` by higher id; ``ties="drop"`` keeps one token per distinct value, a
    mistake), p_r ~ exp((z_r - z_max) inv_temp), the first r whose cumulative probability
    exceeds u * total. Also returns the (ids, probabilities) of row 0."""
    z = np.asarray(z, np.float64)
    out = np.empty(z.shape[0], np.int64)
    info = None
    for b in range(z.shape[0]):
        ids = np.arange(z.shape[1])
        key = -ids if ties == "high" else ids
        order = np.lexsort((key, -z[b]))
        if ties == "drop":
            order = order[np.r_[True, np.diff(z[b, order]) != 0]]
        order = order[:k]
        p = np.exp((z[b, order] - z[b, order[0]]) * inv_temp)
        c = np.cumsum(p)
        r = int(np.searchsorted(c, u[b] * c[-1], side="right"))
        out[b] = order[min(r, len(order) - 1)]
        if b == 0:
            info = (order, p / c[-1])
    return out, info


def _boundaries_ok(z, u, inv_temp, k, margin=1e-4) -> bool:
    """No u within ``margin`` of a cumulative-probability boundary (float32 sums may differ)."""
    for b in range(z.shape[0]):
        _, (order, p) = topk_reference(z[b:b + 1], u[b:b + 1], inv_temp, k)
        if np.min(np.abs(np.cumsum(p)[:-1] - u[b]), initial=1.0) < margin:
            return False
    return True


def ex07_3(sample_topk) -> None:
    """``sample_topk(z, u, inv_temp, k, out)`` is a @cuda.jit kernel launched
    [ceil(B / 32), 32], one thread per row: z (B, V) float32 logits, u (B,) float32 uniform
    numbers in [0, 1), inv_temp = 1 / temperature, k <= 16, out (B,) int32 the chosen ids."""
    ex = "ex07.3"
    refuse_stub(ex, sample_topk)
    _refuse_library(ex, sample_topk, "k passes over the row, then the cumulative weights, in "
                    "scalars and the local arrays ids and p")
    rng, seed = fresh_rng()
    cases = [(B, V, k, temp, tied, 0.0, rep) for rep in range(2)
             for B, V, k, temp, tied in [(1, 5, 1, 1.0, False), (33, 40, 4, 0.7, False),
                                         (40, 50, 8, 2.0, True), (5, 16, 16, 1.3, True),
                                         (37, 23, 3, 0.5, True)]]
    # extreme logits: z * inv_temp near +-1200, beyond float32's (and float64's) exp range
    cases += [(9, 30, 6, 0.25, True, 300.0, 0), (9, 30, 6, 0.25, False, -300.0, 0)]
    for B, V, k, temp, tied, shift, rep in cases:
        z = (rng.standard_normal((B, V)) * (2 if not shift else 0.5) + shift)
        z = z.astype(np.float32)
        if tied:                       # ties inside the top k and across its boundary
            top = np.sort(z, 1)[:, -1]
            z[:, 3] = z[:, 7] = z[:, 11 % V] = top
        while True:
            u = rng.random(B).astype(np.float32)
            if _boundaries_ok(z, u, 1 / temp, k):
                break
        ref, _ = topk_reference(z, u, 1 / temp, k)
        case = (f"B={B}, V={V}, k={k}, temperature={temp}{', tied logits' if tied else ''}"
                f"{f', logits near {shift:+g}' if shift else ''} (seed {seed}, call {rep + 1})")
        out, buf = guarded((B,), np.int32)
        grid = ceil_div(B, TPB)
        try:
            call(ex, case, lambda: sample_topk[grid, TPB](to_device(z), to_device(u),
                                                           np.float32(1 / temp), k, out))
        except GradeError as e:
            if shift and ("OverflowError" in str(e) or "math range error" in str(e)
                          or "division by zero" in str(e)):
                raise GradeError(f"{ex}: {case}: {_TOPK_RANGE}") from None
            raise
        if not canary_ok(buf, B):
            raise GradeError(f"{ex}: {case}: wrote past the end of out: guard the row "
                             "index (the last block has more threads than rows)")
        got = to_numpy(out).astype(np.int64)
        bad = got != ref
        if bad.any():
            b = int(np.argmax(bad))
            hint = _topk_hint(got, z, u, temp, k, V)
            if shift and hint == _TOPK_GENERIC:
                hint = _TOPK_RANGE
            raise GradeError(f"{ex}: {case}: row {b} chose token {got[b]}, expected "
                             f"{ref[b]} ({int(bad.sum())} of {B} rows wrong): {hint}")
    passed(ex)


_TOPK_GENERIC = "compare with the specification's order and inverse CDF"
_TOPK_RANGE = ("the logits times inv_temp here reach about +-1200, beyond the range of exp (it "
               "overflows to inf or underflows to 0): subtract the largest logit first, "
               "w_r = exp((z_r - z_max) * inv_temp)")


def _topk_hint(got, z, u, temp, k, V) -> str:
    if (got == -1).all():
        return "nothing was written to out"
    if (got == -1).any():
        return "some rows never written: one thread per row, every row < B"
    ignored = np.array_equal(got, topk_reference(z, u, 1.0, k)[0])
    divided = np.array_equal(got, topk_reference(z, u, temp, k)[0])
    if ignored and divided:          # these rows give both mistakes the same tokens
        return ("sampling ignores temperature, or divided by inv_temp (these rows cannot tell "
                "which): p_r ~ exp((z_r - z_max) * inv_temp), and inv_temp is already 1 / T, "
                "so multiply")
    for alt, hint in [
            (topk_reference(z, u, 1.0, k)[0],
             "sampling ignores temperature: p_r ~ exp((z_r - z_max) * inv_temp)"),
            (topk_reference(z, u, temp, k)[0],
             "divided by inv_temp: it is already 1 / T, so multiply, (z_r - z_max) * inv_temp"),
            (topk_reference(z, u, 1 / temp, k, ties="drop")[0],
             "equal logits were skipped: each tied token is a candidate of its own; a token "
             "comes after the previous winner (lv, li) when v < lv or (v == lv and j > li)"),
            (topk_reference(z, u, 1 / temp, k, ties="high")[0],
             "equal logits must be ordered by the lower id first"),
            (topk_reference(z, u, 1 / temp, V)[0],
             "sampled from all V tokens: keep only the k largest logits"),
            (topk_reference(z, 1 - u, 1 / temp, k)[0],
             "the inverse CDF runs from the largest logit down: the first r whose cumulative "
             "probability exceeds u * total"),
            (topk_reference(z, np.zeros_like(u), 1 / temp, 1)[0],
             "always the argmax: that is greedy decoding, not sampling"),
    ]:
        if np.array_equal(got, alt):
            return hint
    return _TOPK_GENERIC


# ----------------------------------------------------------------------------- ex07.4
ATTN_THREADS = 128      # ex07_4: the block of decode_attn, one block per (batch * head)
#: ex07_4's cases (BH, L, D, kind), in this order: ragged lengths (head 0 the whole cache, the
#: last of three or more a single key) of a cache of 17; a cache of one key; caches of 1000 and
#: 4097; many heads; every score near +1000 (an exp without the max overflows) and near -1000
#: (a max started at 0 underflows every exp); a cache of 16411, longer than a buffer of one
#: float score per key in shared memory can hold
ATTN_CASES = ((3, 17, 128, "plain"), (1, 1, 64, "plain"), (5, 1000, 64, "plain"),
              (2, 4097, 128, "plain"), (48, 300, 128, "plain"), (4, 300, 128, "+1000"),
              (3, 77, 64, "-1000"), (2, 16411, 64, "long"))
#: (atol, rtol) of o, rtol relative to sum_j p_j |v_j|; scores near 1000 carry float32's
#: rounding of 1000 (6e-5) into every weight
ATTN_TOL = {"plain": (1e-5, 2e-4), "long": (1e-5, 2e-4), "+1000": (1e-5, 2e-3),
            "-1000": (1e-5, 2e-3)}

_ATTN_LIBRARY = ("the scores, the softmax and the weighted sum of the values in the kernel's own "
                 "loops")
_ATTN_SHARED = ("the warps of the block split the keys, and their partial results (max, sum, "
                "output) meet in shared memory after a barrier")
_ATTN_SYNC = ("a __syncthreads() between the warps writing their (m, l, acc) to shared memory and "
              "any thread reading another warp's")
_ATTN_FORMULA = ("o = softmax(scale q K^T) V over the keys 0..lens[bh]-1. When a warp's running "
                 "max grows from m to m', rescale its sum l and output acc by exp(m - m') before "
                 "adding the new key; the warps' results combine with the weights exp(m_w - M), "
                 "M the largest m_w: o = sum_w acc_w exp(m_w - M) / sum_w l_w exp(m_w - M)")
_ATTN_OVERFLOW = ("every score here is near +1000 and exp(1000) overflows float32 (inf / inf is "
                  "NaN): subtract the running max before exp, p = exp(s - m)")
_ATTN_UNDERFLOW = ("every score here is near -1000, so exp(s - 0) underflows to 0 and the sum is "
                   "0: the max must be the largest score itself; start it at -INFINITY, not at 0 "
                   "(a warp that saw no key keeps m = -inf and l = 0, and its weight exp(-inf - "
                   "M) is 0)")


def decode_attention_reference(q, kc, vc, lens, scale: float, n=None):
    """(o, mag) in float64 of one decode step: head bh's query q[bh] (BH, D) attends over its
    keys and values kc[bh, j], vc[bh, j] (BH, L, D), j < n[bh] (``n`` defaults to ``lens``):
    o = softmax(scale q k^T) v. ``mag`` = sum_j p_j |v_j| (what float32 rounding scales with).
    A head with n[bh] = 0 gives NaN."""
    q, kc, vc = (np.asarray(a, np.float64) for a in (q, kc, vc))
    n = np.asarray(lens if n is None else n)
    L = kc.shape[1]
    s = np.einsum("bd,bjd->bj", q, kc) * scale
    keep = np.arange(L)[None, :] < n[:, None]
    s = np.where(keep, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(keep, np.exp(s - s.max(1, keepdims=True)), 0.0)
        l = p.sum(1, keepdims=True)
        return (np.einsum("bj,bjd->bd", p, vc) / l, np.einsum("bj,bjd->bd", p, np.abs(vc)) / l)


def _attn_inputs(rng, BH: int, L: int, D: int, kind: str):
    """q (BH, D), kc, vc (BH, L, D) fp16, lens (BH,) int32, scale. Head 0 uses the whole cache,
    the last of three or more a single key. The positions past a head's length hold keys and
    values of another kind (larger keys, values near 5), so that reading them shows. With
    kind "+1000" / "-1000" the scores of the attended keys are all near that value."""
    lens = rng.integers(1, L + 1, BH)
    lens[0] = L
    if BH >= 3:
        lens[-1] = 1
    q = rng.standard_normal((BH, D))
    kc = rng.standard_normal((BH, L, D))
    vc = rng.standard_normal((BH, L, D))
    past = np.arange(L)[None, :] >= lens[:, None]
    kc[past] = 3 * rng.standard_normal((int(past.sum()), D))
    vc[past] = 5 + rng.standard_normal((int(past.sum()), D))
    scale = 1 / math.sqrt(D)
    if kind in ("+1000", "-1000"):
        sign = 1.0 if kind == "+1000" else -1.0
        q[:] = 0.0
        q[:, 0] = 10 / scale                          # score = 10 * k[0]
        k0 = sign * 100 + 0.3 * rng.standard_normal((BH, L))
        kc[..., 0] = np.where(past, kc[..., 0], k0)
    return (q.astype(np.float16), kc.astype(np.float16), vc.astype(np.float16),
            lens.astype(np.int32), scale)


def _attn_launch(kern, q, kc, vc, lens, o, L: int, D: int, scale: float) -> None:
    kern((q.shape[0],), (ATTN_THREADS,), (q, kc, vc, lens, o, np.int32(L), np.int32(D),
                                          np.float32(scale)))


def _compile(ex: str, src: str, name: str):
    """The kernel ``name`` of a CUDA C++ answer (a GradeError if it does not compile)."""
    from ._core import compile_kernel

    return compile_kernel(ex, src, name)


def _racecheck(ex: str, src: str) -> None:
    from ._race import racecheck

    racecheck(ex, src, "decode_attn", "cudabook.graders.ch07:_race_ex07_4", hint=_ATTN_SYNC)


def ex07_4(src: str) -> None:
    """``src`` defines ``decode_attn(q, kc, vc, lens, o, L, D, scale)``: one decode step of
    attention for BH = batch * heads, launched with grid BH, 128 threads and no dynamic shared
    memory. q (BH, D), the caches kc, vc (BH, L, D) are fp16; lens (BH,) int32, 1 <= lens[bh]
    <= L; o (BH, D) float32 = softmax(scale q K^T) V over keys 0..lens[bh]-1; D is 64 or 128.

    Static rubric first (on a CPU too): no library, no dynamic shared memory, a __shared__ array
    and a barrier. Then, on a GPU, each case of ``ATTN_CASES`` twice with fresh data against
    the float64 reference, o NaN-filled with a canary; then compute-sanitizer racecheck.
    """
    ex = "ex07.4"

    code = rubric(ex, src, _ATTN_LIBRARY, why_shared=_ATTN_SHARED)
    if re.search(r"\bextern\s+__shared__", code):
        raise GradeError(f"{ex}: the code declares an extern __shared__ array, but the grader "
                         "launches decode_attn with no dynamic shared memory (and a cache of any "
                         "length L would not fit it): stream the keys instead, with a running "
                         "max, sum and output per warp (no buffer of scores), and static "
                         "__shared__ arrays for the warps' results")
    need_gpu(ex)
    kern = _compile(ex, src, "decode_attn")
    rng, seed = fresh_rng()
    plain_ok = False                      # a case of ordinary scores has passed
    for BH, L, D, kind in ATTN_CASES:
        for rep in range(2):
            q, kc, vc, lens, scale = _attn_inputs(rng, BH, L, D, kind)
            ref, mag = decode_attention_reference(q, kc, vc, lens, scale)
            what = {"plain": "", "long": "", "+1000": ", every score near +1000",
                    "-1000": ", every score near -1000"}[kind]
            lens_s = (f"lens {lens.tolist()}" if BH <= 5 else
                      f"lens from {int(lens.min())} to {int(lens.max())}")
            case = f"BH={BH}, L={L}, D={D}, {lens_s}{what} (seed {seed}, call {rep + 1})"
            # a loop one key too far reads the zero tail on a GPU instead of faulting
            q_d, kc_d, vc_d = to_device(q), padded(kc, 4 * D), padded(vc, 4 * D)
            o, buf = guarded((BH, D))
            call(ex, case, lambda: _attn_launch(kern, q_d, kc_d, vc_d, to_device(lens), o, L, D,
                                                scale))
            if not canary_ok(buf, BH * D):
                raise GradeError(f"{ex}: {case}: wrote past the end of o: head bh writes "
                                 "o[bh * D + e] for e < D only")
            got = to_numpy(o).astype(np.float64)
            atol, rtol = ATTN_TOL[kind]
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(got - ref) <= atol + rtol * mag)
            if bad.any():
                hint = _attn_hint(ex, src, kind, got, ref, bad, q, kc, vc, lens, scale,
                                  plain_ok)
                raise GradeError(f"{ex}: {case}: o is wrong ({error_summary(got, ref, bad)}): "
                                 f"{hint}")
            plain_ok |= kind == "plain"
    _racecheck(ex, src)
    passed(ex)


def _attn_hint(ex, src, kind, got, ref, bad, q, kc, vc, lens, scale, plain_ok) -> str:
    """The likely mistake behind a wrong o."""
    nan, finite = np.isnan(got), np.isfinite(got)
    if kind == "+1000" and not finite.all() and plain_ok:
        return _ATTN_OVERFLOW
    if kind == "-1000" and not finite.all() and plain_ok:
        return _ATTN_UNDERFLOW
    if nan.all():
        return "o never written (all NaN): is the body of decode_attn still the stub?"
    BH, L, D = kc.shape
    one = lens == 1
    if nan.any() and one.any() and nan[one].all() and not nan[~one].any():
        return ("the heads with a single key (lens[bh] = 1) are NaN, 0 / 0: no key was "
                "attended. The keys are 0..lens[bh]-1, the last one included")

    def near(alt) -> bool:
        a, m = alt
        with np.errstate(invalid="ignore"):
            same = (np.abs(got - a) <= 1e-4 + 1e-3 * m) | (np.isnan(got) & np.isnan(a))
        return bool(same.all())

    # one key past a head's length: a full head reads the next head's key 0 (the last head
    # the zero tail after the cache), as the memory is laid out
    kx, vx = (np.concatenate([a, np.concatenate([a[1:, :1], np.zeros((1, 1, D), a.dtype)])], 1)
              for a in (kc, vc))
    for k_, v_, n, hint in ((kc, vc, np.full_like(lens, L), "every head attended over the "
                             "whole cache of L keys: the positions from lens[bh] on hold no "
                             "token of this sequence; keys 0..lens[bh]-1 only"),
                            (kx, vx, lens + 1, "one key too many: keys 0..lens[bh]-1, so the "
                             "loop runs while j < lens[bh]"),
                            (kc, vc, lens - 1, "one key too few: keys 0..lens[bh]-1, the last "
                             "one included")):
        if not np.array_equal(n, lens) and near(decode_attention_reference(q, k_, v_, lens,
                                                                           scale, n)):
            return hint
    if near(decode_attention_reference(q, kc, vc, lens, 1.0)):
        return "the scores are not multiplied by scale: s = scale * (q . k_j)"
    if near(decode_attention_reference(q, kc, vc, lens, scale * scale)):
        return "scale is applied twice: s = scale * (q . k_j), once"
    if nan.any():
        return (f"{int(nan.sum())} elements of o never written: head bh writes o[bh * D + e] "
                "for every e < D")
    if not finite.all():
        return "inf in o: subtract the running max before exp, and divide by a sum that is > 0"
    # a race between the warps can give any of the numbers below (stale sums make each head a
    # multiple of the right one), so racecheck has the first word (it raises when it finds one)
    _racecheck(ex, src)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = (got * ref).sum(1) / (ref * ref).sum(1)          # per head: got = c * ref?
        scaled = np.abs(got - c[:, None] * ref) <= 1e-4 + 1e-3 * np.abs(c[:, None] * ref)
    if scaled.all() and (np.abs(c - 1) > 1e-2).any():
        return ("each head's o is a multiple of the right one: divide by the softmax sum, "
                "o = sum_j p_j v_j / sum_j p_j (with p_j = exp(s_j - m) from the same m)")
    if looks_like_low_precision(got, ref, bad):
        return ("the errors fit half-precision arithmetic: convert q, k and v to float as they "
                "are loaded, and keep the scores, sums and outputs in float")
    if kind == "long" and plain_ok:
        return (f"right for caches up to 4097 keys, wrong for L = {L}: a buffer sized for a "
                "shorter cache (one score per key in shared memory does not fit here)? Stream "
                "the keys with a running max, sum and output per warp (online softmax)")
    return _ATTN_FORMULA


def _race_ex07_4(kern) -> None:
    """racecheck driver: decode_attn on short ragged caches, D = 64 and 128."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for BH, L, D in ((3, 37, 64), (2, 9, 128)):
        q, kc, vc, lens, scale = _attn_inputs(rng, BH, L, D, "plain")
        o = cupy.empty((BH, D), cupy.float32)
        _attn_launch(kern, cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc),
                     cupy.asarray(lens), o, L, D, scale)
