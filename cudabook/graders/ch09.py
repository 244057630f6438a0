"""Graders of Chapter 9, "Flash Attention".

ex09_1  NumPy: merge two partial softmax results (max, sum, unnormalised output)        CPU
ex09_2  CUDA C++ via CuPy: merge S partial results per row (the split-KV combine)       GPU
ex09_3  Numba: tiled fp32 FlashAttention forward (online softmax, ragged lengths)       simulator
ex09_4  Numba: the causal version, tiles past the diagonal skipped                      simulator
ex09_5  Numba: the backward of one key tile, dV and dP, from the saved logsumexp        simulator
ex09_6  Numba: sliding-window attention, tiles outside the window skipped on both sides  simulator
ex09_7  Numba: the rest of one key tile's backward, dK and its share of dQ (dS from D_i)  simulator
ex09_8  CUDA C++ via CuPy: the whole backward of one Br x Bc tile in one block, all five     GPU
        products from shared memory (P, dP, dS; dV, dK and the tile's share of dQ)
ex09_9  Numba: one step of FlashAttention-2's backward loop in one block: dS written,   simulator
        dV, dK and dQ added to the sums of the earlier steps (P and dS in shared memory)

Scores are S = scale * Q K^T; a partial result over a set of keys is (m, l, o) with m the max
score, l = sum exp(s - m) and o = sum exp(s - m) v (not yet divided by l). Every grader runs
sizes that are no multiple of a tile, scores large enough that exp(s) overflows, and compares
with float64 references (the backward with PyTorch autograd).

The Numba graders first refuse a kernel that hands the work to a library (NumPy, PyTorch, the @
operator: the simulator runs a kernel as Python, so that would pass there and fail to compile
on a GPU). After the values, ex09_3 and ex09_4 check the structure the exercise asks for with
``cb.trace`` of two small launches (a simulator subprocess, on a GPU too): every K and V element
read from global memory once per block (through the shared tiles, in one pass: the online
softmax), tile by tile, no shared element read before it is written (the zero-filled tail), and
every barrier reached by every thread.

ex09_8 reads the answer's code first (comments and strings removed, so on a CPU too): no library
header, a ``__shared__`` tile and a barrier. On a GPU it tries square and non-square tiles (a
product over the wrong axis has the wrong shape or, square, recognisable values), blocks of 256
then 128 threads, and names the mistake its values match (no D_i term, no scale, P normalised over
the tile instead of by the saved lse, ...); values of no pattern are handed to racecheck first.

ex09_9 is ex09_8's tile as one step of the loop, in Numba: graded in the simulator without a GPU,
with shared and local memory NaN-filled (``poisoned_memory``), so a missing barrier gives NaN the
same way on every run (and ``cb.trace`` of the launch names the race). The accumulated outputs
come holding random earlier sums; each wrong output is matched against the answers of the known
mistakes (no D term, no scale, the wrong axis, P not from the saved lse, dV forgotten, an output
overwritten instead of added to, a fixed stride); a whole loop over 2 x 2 tiles ends the grading,
its sums against autograd's dQ, dK and dV. On a GPU the answer is graded again in the simulator.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np

from .. import env
from ..check import to_numpy
from ..launch import ceil_div
from . import _race
from ._core import (
    GradeError,
    call,
    canary_ok,
    error_summary,
    fresh_rng,
    guarded,
    need_gpu,
    passed,
    poisoned_memory,
    sync,
    to_device,
)
from ._core import compile_kernel as _compile
from ._race import explain, racecheck, simulate
from ._static import calls, cuda_code, mentions, refuse_host_code, refuse_stub
from ._static import refuse_library as _refuse_library
from .ch06 import _need_kernel

__all__ = ["ex09_1", "ex09_2", "ex09_3", "ex09_4", "ex09_5", "ex09_6", "ex09_7", "ex09_8",
           "ex09_9", "attention_reference", "partial_softmax", "merge_reference", "BR", "BC",
           "TILE_BR", "TILE_BC", "TILE_D", "STEP_CASES", "STEP_THREADS", "STEP_LOOP"]

BR = 16        # ex09_3, ex09_4: queries per block (one thread each)
BC = 16        # ex09_3, ex09_4: keys per tile
#: ex09_3, ex09_4: the launches traced for the structure check, (BH, Nq, Nk, D): before the
#: values, a sequence shorter than one tile (one block: cheap, and it finds most mistakes of
#: structure); after them, three key tiles (the last partial) over two blocks of queries
TRACED = ((1, 3, 5, 8), (1, 20, 37, 8))
RTOL = 1e-4    # float32 results against float64 references
ATOL = 1e-5


# ----------------------------------------------------------------------------- references
def attention_reference(q, k, v, causal: bool = False, scale: float | None = None,
                        shift: int = 0, window: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(o, lse) of softmax(scale q k^T) v in float64, for (..., Nq, D) q and (..., Nk, D) k, v.

    causal: query i sees keys j <= i + shift (shift = 0 is torch's is_causal; the graders use
    shift = -1 and +1 to recognise a mask that is off by one). window (with causal): only the
    last ``window`` of those, j > i + shift - window (a sliding window). A row that sees no
    key gives o = 0 and lse = -inf.
    """
    if window is not None and (not causal or int(window) < 1):
        raise ValueError(f"attention_reference: window needs causal=True and window >= 1, got "
                         f"causal={causal}, window={window!r}")
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        i = np.arange(q.shape[-2])[:, None]
        j = np.arange(k.shape[-2])[None, :]
        seen = j <= i + shift
        if window is not None:
            seen &= j > i + shift - int(window)
        s = np.where(seen, s, -np.inf)
    m = s.max(-1, keepdims=True)
    mb = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - mb)
    ll = e.sum(-1, keepdims=True)
    o = np.where(ll > 0, (e @ v) / np.where(ll > 0, ll, 1.0), 0.0)
    lse = np.where(ll[..., 0] > 0, mb[..., 0] + np.log(np.where(ll[..., 0] > 0, ll[..., 0], 1)),
                   -np.inf)
    return o, lse


def partial_softmax(s: np.ndarray, v: np.ndarray):
    """(m, l, o) of scores s (R, n) and values v (n, D) in float64; n = 0 gives (-inf, 0, 0)."""
    s = np.asarray(s, np.float64)
    v = np.asarray(v, np.float64)
    R, D = s.shape[0], v.shape[-1]
    if s.shape[1] == 0:
        return np.full(R, -np.inf), np.zeros(R), np.zeros((R, D))
    m = s.max(1)
    e = np.exp(s - m[:, None])
    return m, e.sum(1), e @ v


def _bad(o, r, rtol=RTOL, atol=ATOL) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return ~((np.abs(o - r) <= atol + rtol * np.abs(r)) | ((o == r) & np.isinf(r)))


# ----------------------------------------------------------------------------- ex09.1
def merge_reference(m1, l1, o1, m2, l2, o2):
    """The merged partial result in float64 (the exact answer for these float32 inputs)."""
    m1, l1, o1, m2, l2, o2 = (np.asarray(x, np.float64) for x in (m1, l1, o1, m2, l2, o2))
    m = np.maximum(m1, m2)
    base = np.where(np.isneginf(m), 0.0, m)
    a1, a2 = np.exp(m1 - base), np.exp(m2 - base)
    return m, a1 * l1 + a2 * l2, a1[:, None] * o1 + a2[:, None] * o2


def _merge_cases(rng):
    """(what, partial 1, partial 2, merged reference): each partial from real scores."""
    cases = []
    R, D = 7, 5
    for what, lo, hi, n1, n2 in [("large scores (near 1000: exp overflows)", 900, 1100, 4, 7),
                                 ("normal scores", -3, 3, 6, 9),
                                 ("maxima far apart (one side 40 larger)", 0, 40, 5, 5)]:
        s1 = rng.uniform(lo, hi, (R, n1))
        s2 = rng.uniform(lo, hi, (R, n2)) + (40 if "apart" in what else 0)
        v1, v2 = rng.standard_normal((n1, D)), rng.standard_normal((n2, D))
        cases.append((what, partial_softmax(s1, v1), partial_softmax(s2, v2)))
    s1 = rng.uniform(-3, 3, (R, 4))
    p1 = partial_softmax(s1, rng.standard_normal((4, D)))
    empty = partial_softmax(np.zeros((R, 0)), np.zeros((0, D)))
    cases.append(("second partial empty (m = -inf, l = 0: all its keys masked)", p1, empty))
    cases.append(("both partials empty", empty, empty))
    out = []
    for what, a, b in cases:
        a, b = (tuple(x.astype(np.float32) for x in p) for p in (a, b))
        out.append((what, a, b, merge_reference(*a, *b)))
    return out


def ex09_1(merge: Callable) -> None:
    """``merge(m1, l1, o1, m2, l2, o2)`` returns ``(m, l, o)``, the partial result over the keys
    of both: float32 arrays, m and l of shape (R,), o of shape (R, D)."""
    ex = "ex09.1"
    rng, seed = fresh_rng()
    for what, a, b, ref in _merge_cases(rng):
        case = f"{what} (seed {seed})"
        got: list = []
        try:
            with np.errstate(all="ignore"):
                call(ex, case, lambda: got.append(merge(*a, *b)))
        except GradeError as e:
            if "broadcast" not in str(e):
                raise
            raise GradeError(f"{e}: a factor per row, shape (R,), scales o of shape (R, D) only as "
                             "a column: a1[:, None] * o1") from None
        res = got[0]
        if not isinstance(res, tuple) or len(res) != 3:
            raise GradeError(f"{ex}: {case}: return the tuple (m, l, o), got "
                             f"{type(res).__name__}")
        m, ll, o = (np.asarray(to_numpy(x), np.float64) for x in res)
        for name, x, r in (("m", m, ref[0]), ("l", ll, ref[1]), ("o", o, ref[2])):
            if x.shape != r.shape:
                raise GradeError(f"{ex}: {case}: {name} has shape {x.shape}, expected {r.shape}")
        bad_m = _bad(m, ref[0])
        if bad_m.any():
            raise GradeError(f"{ex}: {case}: m is wrong ({error_summary(m, ref[0], bad_m)}): the "
                             "merged maximum is max(m1, m2)")
        bad_l, bad_o = _bad(ll, ref[1], 1e-5), _bad(o, ref[2], 1e-5)
        if not (bad_l.any() or bad_o.any()):
            continue
        if "empty" in what and (np.isnan(ll).any() or np.isnan(o).any()):
            hint = ("an empty partial has m = -inf, and exp(m1 - m) with m1 = m = -inf is "
                    "exp(nan): when the merged max is -inf, rescale against 0 instead (its l "
                    "and o are 0 anyway)")
        elif not (np.isfinite(ll).all() and np.isfinite(o).all()):
            hint = ("inf or NaN: exp of a large score overflows (float32 exp(89) is inf). Never "
                    "exponentiate a maximum itself: scale each side by exp(m_i - m) <= 1, with "
                    "m = max(m1, m2)")
        elif np.allclose(ll, a[1] + b[1], rtol=1e-5):
            hint = ("l1 + l2 adds sums taken against different maxima: rescale each side by "
                    "exp(m_i - m) with m = max(m1, m2) first (the running-max rescale)")
        elif bad_l.any():
            hint = "l = exp(m1 - m) l1 + exp(m2 - m) l2 with m = max(m1, m2)"
        else:
            hint = ("o must be rescaled exactly as l: o = exp(m1 - m) o1 + exp(m2 - m) o2 (one "
                    "factor per row, the same for every column)")
        which, x, r, bad = ("l", ll, ref[1], bad_l) if bad_l.any() else ("o", o, ref[2], bad_o)
        raise GradeError(f"{ex}: {case}: {which} is wrong ({error_summary(x, r, bad)}): {hint}")
    passed(ex)


# ----------------------------------------------------------------------------- ex09.2
def _splits(rng, R, S, D, what):
    """S partial results per row (m, l: (S, R); o: (S, R, D), float32) from real scores, and
    the merged (out, lse) computed in float64 from those float32 partials."""
    n = rng.integers(0, 6, (S, R))                    # keys per split and row
    if "empty" not in what:
        n = np.maximum(n, 1)
    else:
        n[:, 0] = 0                                   # row 0: every split empty
    shift = 1000.0 if "large" in what else 0.0
    m = np.full((S, R), -np.inf)
    ll = np.zeros((S, R))
    o = np.zeros((S, R, D))
    for s_ in range(S):
        for r in range(R):
            sc = rng.uniform(-4, 4, (1, n[s_, r])) + shift + 30 * s_ * ("apart" in what)
            vv = rng.standard_normal((n[s_, r], D))
            m[s_, r], ll[s_, r], o[s_, r] = (x[0] for x in partial_softmax(sc, vv))
    m, ll, o = (x.astype(np.float32) for x in (m, ll, o))
    M = m.astype(np.float64).max(0)
    base = np.where(np.isneginf(M), 0.0, M)
    a = np.exp(m - base)                              # (S, R)
    L = (a * ll).sum(0)
    out = np.where(L[:, None] > 0, (a[..., None] * o).sum(0) / np.where(L > 0, L, 1)[:, None],
                   0.0)
    lse = np.where(L > 0, base + np.log(np.where(L > 0, L, 1)), -np.inf)
    return (m, ll, o), out, lse


def ex09_2(src: str) -> None:
    """``src`` defines ``merge_splits(const float* m, const float* l, const float* o, float* out,
    float* lse, int R, int S, int D)``: for each of R rows, S partial results (m, l: (S, R);
    o: (S, R, D), unnormalised) are merged into out (R, D) = the normalised attention output and
    lse (R) = M + log(L). Launched with one block of 128 threads per row; a row whose splits are
    all empty gives out = 0, lse = -inf."""
    ex = "ex09.2"
    need_gpu(ex)
    import cupy

    k = _compile(ex, src, "merge_splits")
    rng, seed = fresh_rng()
    cases = [(1, 1, 1, "normal"), (5, 2, 64, "normal"), (33, 3, 100, "maxima far apart"),
             (7, 7, 129, "large scores (near 1000)"), (9, 4, 128, "empty splits"),
             (300, 5, 257, "normal")]
    for R, S, D, what in cases:
        for rep in range(2):
            (m, ll, o), ref_out, ref_lse = _splits(rng, R, S, D, what)
            out, buf = guarded((R, D))
            lse, lbuf = guarded((R,))
            case = f"R={R}, S={S}, D={D}, {what} (seed {seed}, call {rep + 1})"
            call(ex, case, lambda: k((R,), (128,), (cupy.asarray(m), cupy.asarray(ll),
                                                    cupy.asarray(o), out, lse, np.int32(R),
                                                    np.int32(S), np.int32(D))))
            if not canary_ok(buf, R * D) or not canary_ok(lbuf, R):
                raise GradeError(f"{ex}: {case}: wrote past the end of out or lse: loop over "
                                 "the columns while c < D, and write lse once per row")
            got, gl = to_numpy(out).astype(np.float64), to_numpy(lse).astype(np.float64)
            bad, badl = _bad(got, ref_out), _bad(gl, ref_lse)
            if not (bad.any() or badl.any()):
                continue
            if np.isnan(got).all():
                hint = "out never written: is the kernel body still the stub?"
            elif "empty" in what and (np.isnan(got[0]).any() or np.isnan(gl[0])):
                hint = ("row 0 has only empty splits (m = -inf, l = 0): exp(-inf - (-inf)) is "
                        "NaN; rescale against 0 when the max is -inf and write out = 0, "
                        "lse = -inf")
            elif not np.isfinite(got[~np.isnan(ref_out)]).all():
                hint = ("inf or NaN: subtract the maximum over the splits before exp (exp(1000) "
                        "overflows), and divide by L = sum exp(m_s - M) l_s")
            elif np.isnan(got).any():
                hint = "some columns never written: loop c = threadIdx.x, + blockDim.x, ... < D"
            elif badl.any() and not bad.any():
                hint = "lse = M + log(L), M the largest split max, L = sum exp(m_s - M) l_s"
            else:
                hint = ("each split's o and l were summed against its own max m_s: weight both "
                        "by exp(m_s - M) (the same factor), then out = O / L")
            which, x, r, b = ("out", got, ref_out, bad) if bad.any() else ("lse", gl, ref_lse,
                                                                            badl)
            raise GradeError(f"{ex}: {case}: {which} is wrong ({error_summary(x, r, b)}): {hint}")
    sync()
    passed(ex)


# ----------------------------------------------------------------------------- ex09.3, ex09.4
def _views(x: np.ndarray, pad: int):
    """x (BH, N, D) on the device as a view of a (BH, N + pad, D) buffer whose extra rows are
    NaN: a kernel that reads past the end of a sequence reads NaN there (on a GPU, where device
    arrays are not bounds-checked; the simulator raises IndexError instead)."""
    BH, N, D = x.shape
    full = np.full((BH, N + pad, D), np.nan, np.float32)
    full[:, :N] = x
    if env.SIM:
        return np.ascontiguousarray(x)
    from numba import cuda

    return cuda.to_device(full)[:, :N]


def _to_dev(x):
    if env.SIM:
        return x
    from numba import cuda

    return cuda.to_device(x)


def _fwd_cases(rng, causal: bool):
    """(what, q, k, v) of the forward graders, the cheap and telling ones first (a wrong answer
    fails early, and the graders' tests stay fast)."""
    cases = []
    D = 16                  # scores near 256 (exp overflows past 88 in float32): q_0 = k_0 = 32
    q, k = rng.standard_normal((1, 20, D)), rng.standard_normal((1, 37, D))
    q[..., 0] = k[..., 0] = 32.0                      # exact, so float32 keeps the rest accurate
    large = ("large scores (near 256)", q, k, rng.standard_normal((1, 37, D)))
    for BH, Nq, Nk, D in [(1, 1, 1, 8), (2, 17, 17, 16), (1, 40, 33, 32), (2, 5, 50, 16),
                          (1, 33, 16, 64), (1, 7, 19, 5)]:
        if causal and Nk < Nq:
            Nk = Nq + 3
        q = rng.standard_normal((BH, Nq, D)) * 1.5
        cases.append((f"BH={BH}, Nq={Nq}, Nk={Nk}, D={D}", q, rng.standard_normal((BH, Nk, D)),
                      rng.standard_normal((BH, Nk, D))))
    cases.insert(1, large)
    return [(w, *(x.astype(np.float32) for x in (q, k, v))) for w, q, k, v in cases]


def _grade_fwd(ex: str, kernel, causal: bool, windows: tuple[int, ...] = ()) -> None:
    """The value checks of ex09.3/4/6. ``windows``: a sliding window per case, cycled (ex09.6:
    the kernel takes the window as a last argument)."""
    rng, seed = fresh_rng()
    cases = _fwd_cases(rng, causal)
    if causal and not windows:                        # keys no query can see: poisoned
        D = 16
        q = rng.standard_normal((1, 20, D)).astype(np.float32)
        k = rng.standard_normal((1, 100, D)).astype(np.float32)
        v = rng.standard_normal((1, 100, D)).astype(np.float32)
        cases.insert(4, ("Nq=20 < Nk=100: keys from 32 on (tiles past every block's diagonal) "
                         "are NaN", q, k, v))          # after Nq != Nk: a mask's own hint first
    for rep in range(2):
        for n_case, (what, q, k, v) in enumerate(cases):
            BH, Nq, D = q.shape
            Nk = k.shape[1]
            scale = np.float32(1 / math.sqrt(D))
            W = windows[n_case % len(windows)] if windows else None
            extra = (np.int32(W),) if windows else ()
            case = f"{what}{f', window W={W}' if windows else ''} (seed {seed}, call {rep + 1})"
            o, buf = guarded((BH, Nq, D))
            lse, lbuf = guarded((BH, Nq))
            kk, vv = _views(k, 7), _views(v, 7)
            poisoned = "NaN" in what
            if poisoned:
                kk, vv = k.copy(), v.copy()
                kk[:, 32:] = np.nan
                vv[:, 32:] = np.nan
                kk, vv = _to_dev(kk), _to_dev(vv)

            def run():
                try:
                    kernel[(ceil_div(Nq, BR), BH), BR](_to_dev(q), kk, vv, o, lse, scale,
                                                       *extra)
                except OverflowError:      # the simulator's math.exp raises where a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: subtract the running max "
                                     "before exp (s - m <= 0), and rescale acc and l by "
                                     "exp(m_old - m_new) when the max grows") from None
                except ValueError as e:    # the simulator's math.log(0); a GPU gives -inf
                    if "domain" not in str(e):
                        raise
                    raise GradeError(f"{ex}: {case}: log(l) with l = 0: a query saw no key at "
                                     "all" + (" (is the diagonal masked? a query sees itself, "
                                              "j <= i; and does the tile loop reach the block's "
                                              "own diagonal tile? it ends at min(Nk, q0 + BR), "
                                              "q0 = blockIdx.x * BR)" if causal else "")) \
                        from None
                except IndexError as e:
                    raise GradeError(f"{ex}: {case}: {_index_hint(str(e), Nq, Nk, D)}") \
                        from None
            call(ex, case, run)
            if not (canary_ok(buf, BH * Nq * D) and canary_ok(lbuf, BH * Nq)):
                raise GradeError(f"{ex}: {case}: wrote past the end of o or lse: write only "
                                 "when the query row < Nq")
            got, gl = to_numpy(o).astype(np.float64), to_numpy(lse).astype(np.float64)
            ref, rl = attention_reference(q, k, v, causal, window=W)
            # scores near 256 carry float32 rounding of 256 * 2^-24 per term: looser there
            rt, at = (1e-3, 2e-4) if "large" in what else (2e-4, 2e-5)
            bad_o = _bad(got, ref, rt, at)
            if not (bad_o.any() or _bad(gl, rl, 2e-5, 2e-5).any()):
                continue
            msg = (f"{ex}: {case}: {_fwd_hint(got, gl, ref, q, k, v, causal, what, W)} "
                   f"({error_summary(got, ref, bad_o)})" if bad_o.any() else
                   f"{ex}: {case}: lse is wrong ({error_summary(gl, rl, _bad(gl, rl))}): "
                   "lse = m + log(l), natural log, of the scaled scores")
            # a race on the K/V tile gives wrong values that look like other mistakes (a row never
            # written, NaN from past the end): a trace of the same launch names it (failures only)
            raise GradeError(explain(ex, case, msg, kernel, (ceil_div(Nq, BR), BH), BR, q,
                                     to_numpy(kk), to_numpy(vv), np.full((BH, Nq, D), np.nan,
                                                                         np.float32),
                                     np.full((BH, Nq), np.nan, np.float32), scale, *extra))


def _index_hint(err: str, Nq: int, Nk: int, D: int) -> str:
    """What an IndexError of the simulator (``index 8 is out of bounds for axis 2 with size
    8``) says about a forward kernel."""
    m = re.search(r"axis (\d) with size (\d+)", err)
    axis, size = (int(m.group(1)), int(m.group(2))) if m else (1, Nk)
    if axis == 2:
        return (f"an index past the head dimension ({err}): loop over c < D = q.shape[2] (D = "
                f"{D} here; it need not be a multiple of anything, nor MAXD)")
    if axis == 1 and size == Nq and Nq != Nk:
        return (f"read past the last query ({err}): a thread past Nq = {Nq} still helps load the "
                "tiles but reads its query at row min(row, Nq - 1), and writes nothing")
    return (f"read past the end of a sequence ({err}): Nk = {Nk} is no multiple of the tile; "
            "load a key only when j0 + jj < Nk (zeros otherwise) and mask its score to -inf")


def _no_rescale(q, k, v, causal: bool):
    """The output of the online softmax with BC-key tiles whose old sums are never rescaled."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    Nq, D = q.shape[1:]
    Nk = k.shape[1]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(D)
    if causal:
        s = np.where(np.arange(Nk)[None] <= np.arange(Nq)[:, None], s, -np.inf)
    out = np.zeros(q.shape)
    m = np.full(q.shape[:-1], -np.inf)
    ll = np.zeros(q.shape[:-1])
    with np.errstate(all="ignore"):
        for j0 in range(0, Nk, BC):
            t = s[..., j0:j0 + BC]
            m = np.maximum(m, t.max(-1))
            p = np.exp(t - np.where(np.isfinite(m), m, 0)[..., None])
            ll += p.sum(-1)
            out += p @ v[:, j0:j0 + BC]
        return out / ll[..., None]


def _fwd_hint(got, gl, ref, q, k, v, causal, what, window: int | None = None) -> str:
    if window is not None:
        return _window_hint(got, q, k, v, window, what)
    # the value check's tolerance: scores near 256 carry more float32 rounding
    tol = dict(rtol=1e-3, atol=2e-4) if "large" in what else dict(rtol=2e-4, atol=2e-5)
    if "large" in what and not np.isfinite(got).all():
        return ("inf or NaN with large scores: exp(s) overflows. Subtract the running max "
                "(s - m <= 0) and rescale acc and l by exp(m_old - m_new) when it grows")
    if "NaN" in what and np.isnan(got).any():
        return ("NaN where keys no query can see were poisoned: the kernel still loads the K/V "
                "tiles past the diagonal. A causal block of queries [q0, q0 + BR) needs keys "
                "< min(Nk, q0 + BR) only: stop the tile loop there (those tiles are skipped, not "
                "loaded and masked)")
    if np.isnan(got).all():
        if causal:                  # 0 / 0 where a query sees no key, as with the diagonal masked
            return ("output all NaN: never written (is the kernel body still the stub?), or no "
                    "query saw a key: is the diagonal masked? a query sees itself, j <= i; and "
                    "does the tile loop reach the block's own diagonal tile? it ends at "
                    "min(Nk, q0 + BR), q0 = blockIdx.x * BR")
        return "output never written: is the kernel body still the stub?"
    if causal:
        for shift, msg in ((-1, "the diagonal is masked (j < i): a query sees itself, j <= i"),
                           (1, "the mask lets query i see key i + 1: j <= i, not j <= i + 1")):
            r, rl = attention_reference(q, k, v, True, shift=shift)
            # rows that see a key under that mask, and (shift = 1) whose extra key lies in a
            # tile the block loads: most of them match when the mask is off by one
            same = np.isclose(got, r, **tol).all(-1) & np.isfinite(rl)
            if same.sum() >= 0.7 * np.isfinite(rl).sum() > 0:
                return f"mask off by one on the diagonal: {msg}"
        r, _ = attention_reference(q, k, v, False)
        if np.allclose(got, r, **tol):
            return "this is the non-causal result: mask the scores of keys j > i to -inf"
        nq, nk = q.shape[1], k.shape[1]
        if nq != nk:
            r, _ = attention_reference(q, k, v, True, shift=nk - nq)
            if np.allclose(got, r, **tol, equal_nan=True):
                return (f"this is the bottom-right aligned mask (j <= i + Nk - Nq, Nk - Nq = "
                        f"{nk - nq}), the one a decode step needs; the exercise's is top-left, "
                        "torch's is_causal: query i sees keys j <= i whatever Nk is")
    if np.isnan(got).any():
        rows = np.unique(np.nonzero(np.isnan(got))[1])
        return (f"NaN in rows {rows[:5].tolist()}: read past the end of a sequence (the keys "
                "after Nk are NaN here), a row never written, or exp(-inf - (-inf)) while every "
                "key seen so far is masked")
    if np.allclose(got, _no_rescale(q, k, v, causal), **tol):
        return ("right for one tile, wrong across tiles: when the max grows, acc and l "
                "(summed against the old max) must be rescaled by exp(m_old - m_new)")
    return ("wrong values: per tile, m_new = max(m, tile max), acc and l times exp(m - m_new), "
            "then p = exp(s - m_new) added to l and p * v to acc; o = acc / l. Values that "
            "change from run to run point at a missing cuda.syncthreads() around the tile load")


def _window_hint(got, q, k, v, W: int, what: str = "") -> str:
    """ex09.6: what a wrong sliding-window output looks like."""
    if np.isnan(got).all():
        return "output never written: is the kernel body still the stub?"
    if np.isnan(got).any():
        rows = np.unique(np.nonzero(np.isnan(got))[1])
        return (f"NaN in rows {rows[:5].tolist()}: a tile whose keys all lie outside a query's "
                "window leaves its max, and m_new, at -inf, and exp(m - m_new) = "
                "exp(-inf + inf) is NaN: skip the update while m_new is -inf (or read past "
                "the end of a sequence: the keys after Nk are NaN here)")

    tol = dict(rtol=1e-3, atol=2e-4) if "large" in what else dict(rtol=2e-4, atol=2e-5)

    def same(r) -> bool:
        return np.allclose(got, r, **tol)
    for w, msg in ((W + 1, f"it lets query i see W + 1 = {W + 1} keys: i - W < j <= i, the "
                    "W keys ending at the diagonal"),
                   (W - 1, f"it lets query i see only W - 1 = {W - 1} keys: i - W < j <= i")):
        if w >= 1 and same(attention_reference(q, k, v, True, window=w)[0]):
            return f"window off by one: {msg}"
    if same(attention_reference(q, k, v, True)[0]):
        return (f"this is causal attention without the window: mask the keys j <= i - W "
                f"(W = {W}) too")
    if same(attention_reference(q, k, v, True, shift=-1, window=W)[0]):
        return "the diagonal is masked: a query sees itself, j <= i"
    return ("wrong values: per tile, the scores of keys outside i - W < j <= i are -inf; "
            "m_new = max(m, tile max), and only when it is finite: acc and l times "
            "exp(m - m_new), then p = exp(s - m_new) added")


_FWD_SYNC = ("a cuda.syncthreads() after loading the K/V tile (before anyone reads it) and one "
             "before the next tile overwrites it")
_NO_LIBRARY_FWD = ("loops over the tile's keys and the head dimension, with math.exp and float32 "
                   "scalars")


def _tiling(ex: str, kernel, launches=TRACED, window: int | None = None) -> None:
    """The structure ex09.3 and ex09.4 ask for, read from ``cb.trace`` of ``launches``: every
    barrier reached by every thread, no shared element read before it is written, no race,
    each K and V element read from global memory at most once per block (the block shares one
    load through the shared tiles, and one pass over the keys: the online softmax), and K read
    tile by tile (in several barrier phases, when a block needs several tiles). A kernel that
    raises in the trace is left to the value checks, which name its error better. With
    ``window`` (ex09.6, passed to the kernel), a block must read no key outside the tiles that
    hold its queries' windows, below or above."""
    from ..tracer import TraceError, trace

    rng = np.random.default_rng(0)
    for BH, Nq, Nk, D in launches:
        q, k, v = (rng.standard_normal((BH, n, D)).astype(np.float32) for n in (Nq, Nk, Nk))
        o, lse = np.full((BH, Nq, D), np.nan, np.float32), np.full((BH, Nq), np.nan, np.float32)
        grid = (ceil_div(Nq, BR), BH)
        case = f"BH={BH}, Nq={Nq}, Nk={Nk}, D={D}, traced by cb.trace"
        try:
            tr = trace(kernel, grid, BR, q, k, v, o, lse, np.float32(1 / math.sqrt(D)),
                       *((np.int32(window),) if window else ()), timeout=120)
        except TraceError as e:
            raise GradeError(f"{ex}: the check of the tiling (cb.trace) could not run: "
                             f"{str(e).splitlines()[0]} (define the kernel in a notebook cell or "
                             "a .py file)") from None
        except Exception:  # noqa: BLE001 - the kernel's own error: the value checks explain it
            return
        if tr.oob:                 # reads past an array: the value checks name the index
            return
        f = tr.findings(["o", "lse"])
        where = f"{ex}: {case}: "
        if f.uneven_barriers:
            raise GradeError(where + f.messages(limit=1, only=["uneven_barriers"])[0] + ": every "
                             "thread of the block, those past Nq too, must reach every "
                             "cuda.syncthreads(); keep the barriers out of branches (and loops) "
                             "whose condition depends on the thread")
        if f.uninitialized:
            found = f.messages(limit=1, only=["uninitialized"])[0]
            found = re.sub(r" \(does the block have [^)]*\)", "", found)   # not this kernel's
            raise GradeError(where + found + ": fill "
                             "the rows of the tile past Nk with zeros (V's are read there, times "
                             "p = 0, and 0 * garbage is NaN when the garbage is NaN or inf)")
        if f.races:
            raise GradeError(where + f.messages(limit=1, only=["races"])[0] + f": {_FWD_SYNC}")
        for name in ("k", "v"):
            info = tr.array(name)
            for b in range(tr.nblocks):
                r = tr.accesses(name, "read", block=b)
                if not len(r):
                    continue
                cnt = np.bincount(r["index"], minlength=info.size)
                worst = int(cnt.argmax())
                if cnt[worst] <= 1:
                    continue
                readers = np.unique(r["thread"][r["index"] == worst])
                el = f"{name}{list(info.index(worst))}"
                if len(readers) > 1:
                    raise GradeError(
                        f"{where}every thread reads {name.upper()} from global memory "
                        f"itself: {el} is read {cnt[worst]} times by block {b}, by "
                        f"{len(readers)} of its threads. The exercise is the tiled "
                        "kernel: the block loads each tile of BC = 16 keys of K and V into the "
                        "shared arrays once (every thread a share of it), and the threads read "
                        "the tile there")
                raise GradeError(
                    f"{where}{el} is read {cnt[worst]} times from global memory by one "
                    f"thread of block {b}: several passes over the keys (one for the max, "
                    "another for the sums)? The online softmax reads each tile once: per tile, "
                    "m_new = max(m, tile max), l and acc times exp(m - m_new), then the tile's "
                    "p = exp(s - m_new) added")
        for b in range(tr.nblocks):
            r = tr.accesses("k", "read", block=b)
            keys = np.unravel_index(r["index"], tr.array("k").shape)[1]
            q0 = tr.block_index(b)[0] * BR
            lo, hi = max(0, q0 - (window or 0) + 1) // BC * BC, min(Nk, q0 + BR)
            if window and len(keys) and (keys.min() < lo or keys.max() >= hi):
                j = int(keys.min() if keys.min() < lo else keys.max())
                raise GradeError(f"{where}block {b} (queries {q0}..{q0 + BR - 1}) reads key {j} "
                                 "of K, in a tile none of its queries sees (their windows span "
                                 f"keys {max(0, q0 - window + 1)}..{hi - 1}): the tile loop runs "
                                 "from the tile that holds key q0 - W + 1 to the one that holds "
                                 "q0 + BR - 1; the tiles outside are skipped, not loaded and "
                                 "masked")
            if len(keys) and keys.max() >= BC and len(np.unique(r["phase"])) < 2:
                raise GradeError(f"{where}block {b} reads keys 0.."
                                 f"{keys.max()} of K all between the same two barriers: load "
                                 "K and V tile by tile (BC = 16 keys, the shared tiles), "
                                 "looping over the key tiles")


def ex09_3(flash_fwd) -> None:
    """``flash_fwd(q, k, v, o, lse, scale)`` is a @cuda.jit kernel, launched
    [(ceil(Nq / BR), BH), BR] with BR = 16 threads, one query each: q, o (BH, Nq, D), k, v
    (BH, Nk, D), lse (BH, Nq), float32, D <= 64. K and V go through shared memory in tiles of
    BC = 16 keys; the online softmax keeps (m, l, acc) per query. Not causal. Checked: no
    library inside the kernel, the values (ragged lengths, head dims 5 to 64, scores near 256),
    then the tiling from a trace (``_tiling``), then (on a GPU) the simulator's second opinion."""
    ex = "ex09.3"
    _refuse_library(ex, flash_fwd, _NO_LIBRARY_FWD)
    _tiling(ex, flash_fwd, TRACED[:1])
    _grade_fwd(ex, flash_fwd, causal=False)
    _tiling(ex, flash_fwd, TRACED[1:])
    simulate(ex, "ex09_3", [("flash_fwd", flash_fwd)], hint=_FWD_SYNC)
    passed(ex)


def ex09_4(flash_fwd_causal) -> None:
    """``flash_fwd_causal`` is ex09_3's kernel with a causal mask (query i sees keys j <= i) that
    loads only the K/V tiles its block of queries can see (the rest are skipped)."""
    ex = "ex09.4"
    _refuse_library(ex, flash_fwd_causal, _NO_LIBRARY_FWD)
    _tiling(ex, flash_fwd_causal, TRACED[:1])
    _grade_fwd(ex, flash_fwd_causal, causal=True)
    _tiling(ex, flash_fwd_causal, TRACED[1:])
    simulate(ex, "ex09_4", [("flash_fwd_causal", flash_fwd_causal)], hint=_FWD_SYNC)
    passed(ex)


# ----------------------------------------------------------------------------- ex09.5
_BWD_EXP = ("P = exp(scale q.k - lse[i]) is at most 1 and never overflows; exp(scale q.k) / "
            "exp(lse[i]) overflows once the scores pass 88 (float32), and exp(s) alone too: "
            "subtract lse inside the exp")
def _bwd_reference(q, K, V, do, j0: int, n: int):
    """dV of keys j0..j0+n and dP[:, j0:j0+n] of full attention, by torch autograd (float64)."""
    import torch

    Q, Kt, Vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, K, V))
    S = Q @ Kt.T / math.sqrt(q.shape[1])
    P = torch.softmax(S, -1)
    P.retain_grad()
    O = P @ Vt
    O.backward(torch.tensor(do, dtype=torch.float64))
    lse = torch.logsumexp(S, -1).detach().numpy()
    return Vt.grad.numpy()[j0:j0 + n], P.grad.numpy()[:, j0:j0 + n], lse


def ex09_5(bwd_tile) -> None:
    """``bwd_tile(q, k, v, do, lse, dv, dp, scale)`` is a @cuda.jit kernel launched [1, 16], one
    thread per key of a tile of at most 16 keys: q, do (N, D); k, v (n, D) the tile; lse (N,)
    the logsumexp of each query's scores over ALL keys (saved by the forward); outputs dv (n, D)
    = P^T dO restricted to the tile and dp (N, n) = dO V^T, P = exp(scale q k^T - lse).
    Ragged tiles and sequences, and scores near 800, whose exp overflows even in float64."""
    ex = "ex09.5"
    _refuse_library(ex, bwd_tile, "loops over the queries and the head dimension, with "
                    "math.exp")
    rng, seed = fresh_rng()
    seen_ok = False                 # a case at ordinary scores passed: the outputs are written
    for rep in range(2):
        for N, D, Nk, j0, n, big in [(1, 4, 10, 0, 10, False), (9, 16, 40, 16, 16, False),
                                     (23, 8, 40, 32, 8, False), (40, 16, 33, 16, 16, False),
                                     (7, 16, 20, 16, 4, True)]:
            q = (rng.standard_normal((N, D)) * 1.5).astype(np.float32)
            K = (rng.standard_normal((Nk, D)) * 1.5).astype(np.float32)
            if big:                 # scale q.k near 812: exp(s) is inf in float32 and float64
                q[:, 0] = K[:, 0] = 57.0
            V = rng.standard_normal((Nk, D)).astype(np.float32)
            do = rng.standard_normal((N, D)).astype(np.float32)
            dv_ref, dp_ref, lse = _bwd_reference(q, K, V, do, j0, n)
            case = (f"N={N}, D={D}, tile keys {j0}..{j0 + n - 1} of {Nk}"
                    f"{', scores near 800' if big else ''} (seed {seed}, call {rep + 1})")
            dv, buf = guarded((n, D))
            dp, pbuf = guarded((N, n))
            k, v = K[j0:j0 + n].copy(), V[j0:j0 + n].copy()

            def run():
                try:
                    bwd_tile[1, 16](to_device(q), to_device(k), to_device(v), to_device(do),
                                    to_device(lse.astype(np.float32)), dv, dp,
                                    np.float32(1 / math.sqrt(D)))
                except OverflowError:      # the simulator's math.exp; a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: {_BWD_EXP}") from None
                except IndexError as e:
                    raise GradeError(f"{ex}: {case}: index out of range ({e}): dv is (n, D) "
                                     "and dp (N, n), dp[i, j] for query i and key j; a thread "
                                     "j >= n = k.shape[0] does nothing (guard with "
                                     "j < k.shape[0])") from None
            call(ex, case, run)
            if not (canary_ok(buf, n * D) and canary_ok(pbuf, N * n)):
                raise GradeError(f"{ex}: {case}: wrote past the end of dv or dp: the tile has "
                                 f"{n} keys and 16 threads run; guard with j < k.shape[0]")
            got_dv, got_dp = (to_numpy(x).astype(np.float64) for x in (dv, dp))
            bad_p = _bad(got_dp, dp_ref, 1e-4, 1e-5)
            if bad_p.any():
                hint = ("dp never written" if np.isnan(got_dp).all() else
                        "dP = dO V^T: dp[i, j] = sum_c do[i, c] v[j, c] (no P and no scale in it)")
                raise GradeError(f"{ex}: {case}: dp is wrong "
                                 f"({error_summary(got_dp, dp_ref, bad_p)}): {hint}")
            # scores near 800 carry float32 rounding of 800 * 2^-24 per term: looser there
            bad_v = _bad(got_dv, dv_ref, *((1e-3, 2e-4) if big else (2e-4, 1e-5)))
            if not bad_v.any():
                seen_ok = seen_ok or not big
                continue
            s = q.astype(np.float64) @ k.T.astype(np.float64) / math.sqrt(D)
            no_lse = np.exp(s).T @ do
            local = np.exp(s - s.max(1, keepdims=True))
            local = (local / local.sum(1, keepdims=True)).T @ do
            if big and not np.isfinite(got_dv).all() and seen_ok:
                hint = _BWD_EXP          # right at ordinary scores: written, but overflowing
            elif np.isnan(got_dv).all():
                hint = ("dv is NaN everywhere: never written (is the kernel body still the "
                        "stub?), or summed with += into dv without setting it to 0 first (the "
                        "grader fills the outputs with NaN)")
            elif big and not np.isfinite(got_dv).all():
                hint = _BWD_EXP
            elif np.allclose(got_dv, no_lse, rtol=1e-3, atol=1e-4):
                hint = ("P = exp(s) ignores the logsumexp: the forward saved lse so that "
                        "P = exp(scale q.k - lse[i]) is the normalised softmax")
            elif np.allclose(got_dv, local, rtol=1e-3, atol=1e-4) and n < Nk:
                hint = ("a softmax over the tile's keys only: the other tiles' keys share the "
                        "normalisation, which is what the saved lse carries: P = exp(s - lse[i])")
            else:
                hint = ("dv[j] = sum_i P[i, j] do[i] with P[i, j] = exp(scale q_i . k_j - lse[i]) "
                        "(scale before subtracting lse)")
            raise GradeError(f"{ex}: {case}: dv is wrong ({error_summary(got_dv, dv_ref, bad_v)})"
                             f": {hint}")
    passed(ex)


# ----------------------------------------------------------------------------- ex09.6
#: ex09_6: the windows of the value cases (cycled, in _fwd_cases' order): only the diagonal,
#: narrower than a tile (the large-score case then has queries 18 and 19 with tile 0 wholly
#: outside their windows: the guard), about a tile, wider than two tiles
WINDOWS = (1, 3, 16, 5, 37, 20, 7)
#: ex09_6: the traced launches, (BH, Nq, Nk, D, W): one block first; then three blocks whose
#: windows start in different tiles (block 2 needs keys 27..47 only: tile 0 is skipped)
TRACED_WINDOW = ((1, 3, 5, 8, 2), (1, 40, 45, 8, 6))


def ex09_6(flash_fwd_window) -> None:
    """``flash_fwd_window(q, k, v, o, lse, scale, W)``: ex09_4's kernel with a sliding window of
    ``W`` keys (query i sees keys i - W < j <= i, as in Mistral's local attention), launched
    like ex09_3's. A block of queries [q0, q0 + BR) needs keys q0 - W + 1 .. q0 + BR - 1 only:
    the tiles outside are skipped on both sides, and a tile can be fully masked for a query (its
    max stays -inf: the update must be skipped)."""
    ex = "ex09.6"
    _refuse_library(ex, flash_fwd_window, _NO_LIBRARY_FWD)
    for BH, Nq, Nk, D, W in TRACED_WINDOW[:1]:
        _tiling(ex, flash_fwd_window, [(BH, Nq, Nk, D)], window=W)
    _grade_fwd(ex, flash_fwd_window, causal=True, windows=WINDOWS)
    for BH, Nq, Nk, D, W in TRACED_WINDOW[1:]:
        _tiling(ex, flash_fwd_window, [(BH, Nq, Nk, D)], window=W)
    simulate(ex, "ex09_6", [("flash_fwd_window", flash_fwd_window)], hint=_FWD_SYNC)
    passed(ex)


# ----------------------------------------------------------------------------- ex09.7
#: ex09_7: (N, D, Nk, j0, n, big): ragged sequences, odd head dims, tiles of 1 to 16 keys; the
#: first tiles miss keys (a D_i taken over the tile alone is wrong there); big: scores near 800
BWD_DKDQ_CASES = ((5, 5, 11, 8, 3, False), (7, 9, 20, 16, 4, True), (1, 3, 1, 0, 1, False),
                  (23, 7, 37, 16, 16, False), (18, 4, 30, 0, 13, False))
_DKDQ_NO_LIBRARY = "loops over the queries, the tile's keys and the head dimension, with math.exp"
_DKDQ_OWN = ("thread j writes only dk[j], and the threads own the queries i = tid, tid + 16, ... "
             "for dq: no element is written by two threads, no atomics and no barrier needed")


def _autograd(q, K, V, do, scale: float):
    """Full attention softmax(scale q K^T) V by torch autograd in float64: (lse, delta, dS,
    dK, dV) with delta = rowsum(dO * O) and dS the gradient of the scaled scores."""
    import torch

    Q, Kt, Vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, K, V))
    S = scale * (Q @ Kt.T)
    S.retain_grad()
    O = torch.softmax(S, -1) @ Vt
    dO = torch.tensor(do, dtype=torch.float64)
    O.backward(dO)
    delta = (dO * O.detach()).sum(1).numpy()
    lse = torch.logsumexp(S, -1).detach().numpy()
    return lse, delta, S.grad.numpy(), Kt.grad.numpy(), Vt.grad.numpy()


def _dkdq_reference(q, K, V, do, j0: int, n: int):
    """(lse, delta, dS[:, tile], dK[tile]) of full attention (scale 1 / sqrt(D)), float64."""
    lse, delta, dS, dK, _ = _autograd(q, K, V, do, 1 / math.sqrt(q.shape[1]))
    return lse, delta, dS[:, j0:j0 + n], dK[j0:j0 + n]


def _dkdq_hint(which: str, got, ref, dq0, q, k, v, do, lse, delta, scale) -> str:
    """The likely mistake behind a wrong dk or dq (``which``), from the answers it matches."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    P = np.exp(scale * (q @ k.T) - lse.astype(np.float64)[:, None])
    dP = do @ v.T

    def out(dS, sc=scale, base=dq0):
        return sc * dS.T @ q if which == "dk" else base + sc * dS @ k

    def near(x):
        return np.allclose(got, x, rtol=1e-2, atol=1e-3 * float(np.abs(ref).max()))

    dS = P * (dP - delta.astype(np.float64)[:, None])
    if np.isnan(got).all():
        return (f"{which} is NaN everywhere: never written (is the kernel body still the stub?)"
                + (", or summed with += without setting it to 0 first (the grader fills the "
                   "outputs with NaN)" if which == "dk" else ""))
    if which == "dq" and near(out(dS, base=0)):
        return ("dq holds only this tile's contribution: dq comes in holding the sum over the "
                "tiles before this one; add to it (dq[i, c] += ...), as the loop over key tiles "
                "of the FlashAttention-2 backward does")
    if near(out(dS, 1.0)):
        return (f"the scale is missing: S = scale Q K^T, so {which} = scale * "
                + ("sum_i dS[i, j] q_i" if which == "dk" else "sum_j dS[i, j] k_j"))
    if near(out(P * dP)):
        return "dS = P * dP forgets the softmax's second term: dS[i, j] = P[i, j] (dP[i, j] - D_i)"
    if near(out(P * (dP - (P * dP).sum(1, keepdims=True)))):
        return ("D_i is summed over this tile's keys only: sum_j P[i, j] dP[i, j] needs every "
                "key of the row, which one tile does not see; use the delta passed in "
                "(rowsum(dO * O), equal to the sum over every key)")
    return (f"{which} = scale * sum of dS times " + ("q_i" if which == "dk" else "k_j")
            + ", dS[i, j] = P[i, j] (dP[i, j] - delta[i]), P[i, j] = exp(scale q_i . k_j - "
            "lse[i]) and dP[i, j] = do_i . v_j")


def ex09_7(bwd_dkdq) -> None:
    """``bwd_dkdq(q, k, v, do, lse, delta, dk, dq, scale)`` is a @cuda.jit kernel launched
    [1, 16] for one tile of n <= 16 keys: q, do (N, D); k, v (n, D); lse (N,) the logsumexp over
    ALL keys and delta (N,) = rowsum(dO * O), both from the forward. With P = exp(scale q k^T -
    lse), dP = dO V^T and dS = P (dP - delta): dk (n, D) = scale dS^T Q (written) and dq (N, D)
    += scale dS K (dq holds the previous tiles' sum). Graded against torch autograd in float64
    on ragged sizes, odd D and scores near 800; the outputs come filled (dk with NaN) and
    followed by a canary."""
    ex = "ex09.7"
    _refuse_library(ex, bwd_dkdq, _DKDQ_NO_LIBRARY)
    rng, seed = fresh_rng()
    for rep in range(2):
        for N, D, Nk, j0, n, big in BWD_DKDQ_CASES:
            q = (rng.standard_normal((N, D)) * 1.5).astype(np.float32)
            K = (rng.standard_normal((Nk, D)) * 1.5).astype(np.float32)
            scale = 1 / math.sqrt(D)
            if big:                 # scale q.k near 800: exp(s) is inf in float32 and float64
                q[:, 0] = K[:, 0] = math.sqrt(800 / scale)
            V = rng.standard_normal((Nk, D)).astype(np.float32)
            do = rng.standard_normal((N, D)).astype(np.float32)
            lse, delta, dS, dk_ref = _dkdq_reference(q, K, V, do, j0, n)
            k, v = K[j0:j0 + n].copy(), V[j0:j0 + n].copy()
            dq0 = rng.standard_normal((N, D)).astype(np.float32)     # the previous tiles' sum
            dq_ref = dq0 + scale * dS @ k.astype(np.float64)
            lse32, delta32 = lse.astype(np.float32), delta.astype(np.float32)
            case = (f"N={N}, D={D}, tile keys {j0}..{j0 + n - 1} of {Nk}"
                    f"{', scores near 800' if big else ''} (seed {seed}, call {rep + 1})")
            dk, kbuf = guarded((n, D))
            dq, qbuf = guarded((N, D))
            dq[...] = to_device(dq0)

            def run():
                try:
                    bwd_dkdq[1, 16](to_device(q), to_device(k), to_device(v), to_device(do),
                                    to_device(lse32), to_device(delta32), dk, dq,
                                    np.float32(scale))
                except OverflowError:      # the simulator's math.exp; a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: {_BWD_EXP}") from None
                except IndexError as e:
                    raise GradeError(f"{ex}: {case}: index out of range ({e}): k, v and dk have "
                                     "n = k.shape[0] rows and 16 threads run: a thread j >= n "
                                     "owns no key (guard with j < k.shape[0]), and the queries "
                                     "end at N = q.shape[0]") from None
            call(ex, case, run)
            if not (canary_ok(kbuf, n * D) and canary_ok(qbuf, N * D)):
                raise GradeError(f"{ex}: {case}: wrote past the end of dk or dq: the tile has {n} "
                                 "keys and 16 threads run; guard with j < k.shape[0] (and "
                                 "i < q.shape[0] for the queries)")
            # each output is a sum of terms that cancel: its float32 error is relative to the
            # sum of their magnitudes (mag); scores near 800 carry rounding of 800 * 2^-24 in
            # the exponent (and in lse): looser there
            rtol = 2e-3 if big else 1e-4
            adS = np.abs(dS)
            mag_k = scale * adS.T @ np.abs(q.astype(np.float64))
            mag_q = np.abs(dq0) + scale * adS @ np.abs(k.astype(np.float64))
            hint_args = (q, k, v, do, lse32, delta32, scale)
            for which, out, ref, mag in (("dk", dk, dk_ref, mag_k), ("dq", dq, dq_ref, mag_q)):
                got = to_numpy(out).astype(np.float64)
                with np.errstate(invalid="ignore"):
                    bad = ~(np.abs(got - ref) <= 1e-6 + rtol * mag)
                if big and not np.isfinite(got).all():
                    hint = _BWD_EXP
                elif bad.any():
                    hint = _dkdq_hint(which, got, ref, dq0, *hint_args)
                else:
                    continue
                raise GradeError(f"{ex}: {case}: {which} is wrong "
                                 f"({error_summary(got, ref, bad)}): {hint}")
    simulate(ex, "ex09_7", [("bwd_dkdq", bwd_dkdq)], hint=_DKDQ_OWN)
    passed(ex)


# ----------------------------------------------------------------------------- ex09.8
#: ex09_8: the largest tile the kernel takes (the constants BR_MAX, BC_MAX, D_MAX of its source)
TILE_BR, TILE_BC, TILE_D = 32, 32, 64
#: ex09_8: (H, Br, Bc, D, Nk, j0, big): H tiles, one block each; the tile is keys j0..j0+Bc-1 of a
#: sequence of Nk. Square first (a product summed over the wrong axis still has the right shape
#: there, and its values name it), then Br != Bc both ways (the shapes of dS Q and dS^T Q
#: differ), one query and one key, a tile that holds every key (a softmax over the tile is then
#: right), scores near 800 (exp of a score alone overflows), and the largest tile
TILE_CASES = ((2, 16, 16, 16, 40, 16, False), (1, 5, 32, 7, 45, 0, False),
              (3, 32, 3, 64, 11, 6, False), (1, 1, 1, 1, 1, 0, False),
              (2, 9, 20, 33, 20, 0, False), (1, 17, 29, 33, 60, 29, True),
              (2, 32, 32, 64, 100, 64, True))
#: ex09_8: blocks of this many threads on the first call of each case, of the second on the other
TILE_THREADS = (256, 128)
#: ex09_8: headers of libraries that would do the products for the kernel
_TILE_LIBRARIES = ("cub", "cutlass", "cute", "cublas", "thrust", "cudnn")
_TILE_SYNC = ("a __syncthreads() after the tiles are loaded (before any thread reads them) and "
              "one after P and dS are in shared memory (before dV, dK and dQ read them)")


def _tile_reference(q, K, V, do, j0: int, n: int, scale: float):
    """(lse, delta, dQ, dK, dV) of one tile, keys j0..j0+n-1, by torch autograd in float64:
    lse and delta = rowsum(dO * O) over ALL keys; dK, dV the tile's rows of autograd's
    gradients; dQ the tile's share, scale dS[:, tile] K[tile] (autograd's dQ sums them)."""
    lse, delta, dS, dK, dV = _autograd(q, K, V, do, scale)
    dq = scale * dS[:, j0:j0 + n] @ K[j0:j0 + n].astype(np.float64)
    return lse, delta, dq, dK[j0:j0 + n], dV[j0:j0 + n]


def _tile_rubric(ex: str, src: str) -> None:
    """Before anything runs (so on a CPU too): no library header, shared memory and a barrier."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = cuda_code(src)
    if not re.search(r"\bd[QKV]\s*(\[|\+(?!=))", code):      # dQ[e] or dQ + e: written
        raise GradeError(f"{ex}: not implemented yet: the kernel writes none of dQ, dK and dV "
                         "(is its body still the stub?)")
    for inc in re.findall(r"#\s*include\s*[<\"]([^>\"]+)[>\"]", code):
        if any(re.search(rf"(^|/){lib}", inc, re.I) for lib in _TILE_LIBRARIES):
            raise GradeError(f"{ex}: the source includes <{inc}>, a library: the exercise asks "
                             "for the five products written out in the kernel's own loops over "
                             "the shared tiles (no CUB, CUTLASS, cuBLAS or Thrust)")
    if not mentions(code, "__shared__"):
        raise GradeError(f"{ex}: no __shared__ array in the code: the block loads the tile (Q, "
                         "dO, K, V) into shared memory once and computes every product from "
                         "there (and keeps P and dS there for the last three products)")
    if calls(code, "__syncthreads") == 0:
        raise GradeError(f"{ex}: no __syncthreads() in the code: the threads of the block fill "
                         "the shared tiles together and read each other's elements, so they "
                         f"need {_TILE_SYNC}")


def _tile_terms(q, k, v, do, lse, delta, scale: float):
    """One tile's inputs in float64 (lse and delta as columns) and the terms of its backward: the
    scores s = q k^T, P = exp(scale s - lse), dP = do v^T, dS = P (dP - delta), and the softmax
    over this tile's keys alone with its unnormalised numerator loc (what a kernel ignoring lse
    would use)."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    lse, delta = lse.astype(np.float64)[:, None], delta.astype(np.float64)[:, None]
    s = q @ k.T
    with np.errstate(over="ignore", invalid="ignore"):
        P = np.exp(scale * s - lse)
        dP = do @ v.T
        dS = P * (dP - delta)
        loc = np.exp(scale * (s - s.max(1, keepdims=True)))
        soft = loc / loc.sum(1, keepdims=True)
    return q, k, v, do, lse, delta, s, P, dP, dS, loc, soft


def _tile_hint(which: str, got, q, k, v, do, lse, delta, scale: float, square: bool,
               partial_tile: bool) -> str | None:
    """The mistake behind a wrong ``which`` (dV, dK or dQ) of one tile, when its values match
    one, or None. Inputs are one head's float32 arrays; the candidates are in float64."""
    q, k, v, do, lse, delta, s, P, dP, dS, loc, soft = _tile_terms(q, k, v, do, lse, delta,
                                                                   scale)
    with np.errstate(over="ignore", invalid="ignore"):
        no_lse = np.exp(scale * s)
        unscaled_p = np.exp(s - lse)

    def near(x) -> bool:
        if x.shape != got.shape or not np.isfinite(x).all():
            return False
        return bool(np.allclose(got, x, rtol=1e-2, atol=1e-3 * max(float(np.abs(x).max()),
                                                                     1e-30)))

    if which == "dV":
        if partial_tile and (near(loc.T @ do) or near(soft.T @ do)):
            return ("P was recomputed from a maximum (and sum) over this tile's keys: that is "
                    "the softmax of the tile alone, right only when the tile holds every key. "
                    "The other tiles' keys share the normalisation, which is what the saved lse "
                    "carries: P[i][j] = exp(scale q_i . k_j - lse[i]), no max and no sum")
        if near(no_lse.T @ do):
            return ("P = exp(scale q.k) ignores the saved logsumexp: P[i][j] = exp(scale q_i . "
                    "k_j - lse[i]) is the normalised softmax")
        if near(unscaled_p.T @ do):
            return ("the scale is missing inside the exponent: the scores are scale q.k, so "
                    "P[i][j] = exp(scale * (q_i . k_j) - lse[i])")
        if near(scale * P.T @ do):
            return "dV = P^T dO has no scale in it (the scale belongs to dS's products only)"
        if square and near(P @ do):
            return ("dV = P^T dO sums over the queries: dV[j][c] = sum_i P[i][j] dO[i][c] "
                    "(P read as P[j][i] is P dO, the other axis)")
        return None
    A, B = (q, dS) if which == "dK" else (k, dS.T)      # dK = scale dS^T Q, dQ = scale dS K
    with np.errstate(over="ignore", invalid="ignore"):
        tile_d = P * (dP - (P * dP).sum(1, keepdims=True))
    if near(scale * ((P * dP).T if which == "dK" else P * dP) @ A):
        return ("dS = P * dP leaves out the softmax's second term: dS[i][j] = P[i][j] (dP[i][j] "
                "- Di[i]), with the Di passed in (rowsum(dO * O))")
    if near(B.T @ A):
        return (f"the scale is missing: the scores are scale Q K^T, so {which} = scale * "
                + ("dS^T Q" if which == "dK" else "dS K") + " (and P = exp(scale q.k - lse) "
                "keeps its own scale)")
    if near(scale * scale * B.T @ A):
        return (f"the scale is applied twice: {which} = scale * "
                + ("dS^T Q" if which == "dK" else "dS K") + ", once")
    if partial_tile and near(scale * (tile_d.T if which == "dK" else tile_d) @ A):
        return ("Di is summed over this tile's keys only: sum_j P[i][j] dP[i][j] needs every key "
                "of the row, which one tile does not see; use the Di passed in (rowsum(dO * O), "
                "equal to the sum over every key)")
    if square and near(scale * (B @ A)):
        return (("dK = scale dS^T Q sums over the queries: dK[j][c] = scale sum_i dS[i][j] "
                 "Q[i][c]; dS Q (dS read as dS[j][i]) sums over the keys, the wrong axis")
                if which == "dK" else
                ("dQ = scale dS K sums over the keys: dQ[i][c] = scale sum_j dS[i][j] K[j][c]; "
                 "dS read as dS[j][i] sums over the wrong axis"))
    return None


def ex09_8(src: str) -> None:
    """``src`` defines ``attn_bwd_tile(Q, K, V, dO, lse, Di, dQ, dK, dV, Br, Bc, D, scale)``:
    the backward of one Br x Bc tile of attention per block (H tiles, grid H; Q, dO, dQ (H, Br,
    D); K, V, dK, dV (H, Bc, D); lse, Di (H, Br); float32, Br, Bc <= 32, D <= 64): P = exp(scale
    Q K^T - lse), dV = P^T dO, dP = dO V^T, dS = P (dP - Di), dQ = scale dS K, dK = scale dS^T Q,
    all three outputs written. Static rubric first (no library header; shared memory, a
    barrier); then ragged tiles, Br != Bc, scores near 800, blocks of 256 then 128 threads, NaN
    outputs with a canary, against torch autograd in float64; then racecheck."""
    ex = "ex09.8"
    _tile_rubric(ex, src)
    need_gpu(ex)
    import cupy

    kern = _compile(ex, src, "attn_bwd_tile")
    rng, seed = fresh_rng()
    ok_first = set()                # cases whose first call (256 threads) passed
    for n_case, (H, Br, Bc, D, Nk, j0, big) in enumerate(TILE_CASES):
        for rep, threads in enumerate(TILE_THREADS):
            scale = 1 / math.sqrt(D)
            q = (rng.standard_normal((H, Br, D)) * 1.5).astype(np.float32)
            K = (rng.standard_normal((H, Nk, D)) * 1.5).astype(np.float32)
            if big:                 # scale q.k near 800: exp(s) is inf in float32 and float64
                q[..., 0] = K[..., 0] = math.sqrt(800 / scale)
            V = rng.standard_normal((H, Nk, D)).astype(np.float32)
            do = rng.standard_normal((H, Br, D)).astype(np.float32)
            refs = [_tile_reference(q[h], K[h], V[h], do[h], j0, Bc, scale) for h in range(H)]
            lse = np.stack([r[0] for r in refs]).astype(np.float32)
            delta = np.stack([r[1] for r in refs]).astype(np.float32)
            ref = {name: np.stack([r[i] for r in refs]) for i, name in
                   ((2, "dQ"), (3, "dK"), (4, "dV"))}
            k, v = K[:, j0:j0 + Bc].copy(), V[:, j0:j0 + Bc].copy()
            case = (f"H={H} tiles of Br={Br} queries x Bc={Bc} keys (keys {j0}..{j0 + Bc - 1} "
                    f"of {Nk}), D={D}{', scores near 800' if big else ''}, {threads} threads "
                    f"(seed {seed}, call {rep + 1})")
            out = {"dQ": guarded((H, Br, D)), "dK": guarded((H, Bc, D)),
                   "dV": guarded((H, Bc, D))}
            args = tuple(cupy.asarray(x) for x in (q, k, v, do, lse, delta))
            call(ex, case, lambda: kern((H,), (threads,), (
                *args, out["dQ"][0], out["dK"][0], out["dV"][0], np.int32(Br), np.int32(Bc),
                np.int32(D), np.float32(scale))))
            for name, (o, buf) in out.items():
                if not canary_ok(buf, o.size):
                    raise GradeError(f"{ex}: {case}: wrote past the end of {name}: {name} has "
                                     f"{o.shape[1]} rows of D = {D}; loop while e < "
                                     f"{'Br' if name == 'dQ' else 'Bc'} * D")
            # float32 error is relative to the sum of the terms' magnitudes (mag): dS is a
            # difference of near-equal terms; scores near 800 carry rounding of 800 * 2^-24 in
            # the exponent (and in lse): looser there
            rtol = 2e-3 if big else 1e-4
            s64 = np.einsum("hid,hjd->hij", q.astype(np.float64), k.astype(np.float64))
            P = np.exp(scale * s64 - lse.astype(np.float64)[..., None])
            dP = np.einsum("hid,hjd->hij", do.astype(np.float64), v.astype(np.float64))
            mag_ds = P * (np.abs(dP) + np.abs(delta.astype(np.float64))[..., None])
            mag = {"dV": np.einsum("hij,hid->hjd", P, np.abs(do)),
                   "dK": scale * np.einsum("hij,hid->hjd", mag_ds, np.abs(q)),
                   "dQ": scale * np.einsum("hij,hjd->hid", mag_ds, np.abs(k))}
            for name in ("dV", "dK", "dQ"):
                got = to_numpy(out[name][0]).astype(np.float64)
                with np.errstate(invalid="ignore"):
                    bad = ~(np.abs(got - ref[name]) <= 1e-6 + rtol * mag[name])
                if not bad.any():
                    continue
                hint, named = None, True
                if np.isnan(got).all():
                    hint = (f"{name} is NaN everywhere: never written (is the kernel body still "
                            "the stub?), or summed with += into the output without setting it "
                            "first (the grader fills the outputs with NaN)")
                elif big and not np.isfinite(got).all() and ok_first:
                    hint = _BWD_EXP
                elif rep == 1 and n_case in ok_first and np.isnan(got).any():
                    hint = (f"right with blocks of {TILE_THREADS[0]} threads, but {threads} leave "
                            f"elements of {name} unwritten: stride the loops by blockDim.x, not "
                            "by a fixed number of threads")
                elif np.isnan(got).any():
                    rows = sorted(set(int(r) for r in np.argwhere(np.isnan(got))[:, 1]))
                    named = False
                    hint = (f"elements of {name} never written (rows {rows[:6]}"
                            f"{' ...' if len(rows) > 6 else ''}): each element (row, c) of the "
                            "output is one e = row * D + c of a loop e = threadIdx.x, "
                            "+ blockDim.x, ... < rows * D")
                else:
                    h0 = int(np.argwhere(bad)[0][0])
                    hint = _tile_hint(name, got[h0], q[h0], k[h0], v[h0], do[h0], lse[h0],
                                      delta[h0], scale, Br == Bc, Bc < Nk)
                    if hint is None:
                        named = False
                        hint = ("P[i][j] = exp(scale q_i . k_j - lse[i]), dP[i][j] = dO_i . v_j, "
                                "dS = P (dP - Di); dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K"
                                if all(bad[h].any() for h in range(H)) else
                                "some tiles are right and others wrong: block h works on tile h "
                                "only (the cell offsets the pointers by blockIdx.x)")
                msg = f"{ex}: {case}: {name} is wrong ({error_summary(got, ref[name], bad)})"
                if not named:
                    # values that name no mistake (or NaN where a race read shared memory nobody
                    # had written yet): racecheck has the first word
                    _tile_race(ex, src, msg)
                raise GradeError(f"{msg}: {hint}")
            if rep == 0:
                ok_first.add(n_case)
    racecheck(ex, src, "attn_bwd_tile", "cudabook.graders.ch09:_race_ex09_8", hint=_TILE_SYNC)
    passed(ex)


def _tile_race(ex: str, src: str, msg: str) -> None:
    """After wrong values (``msg``): GradeError naming a race if racecheck finds one."""
    try:
        racecheck(ex, src, "attn_bwd_tile", "cudabook.graders.ch09:_race_ex09_8",
                  hint=_TILE_SYNC)
    except GradeError as e:
        found = str(e).split("racecheck found a race", 1)
        if len(found) < 2:
            raise
        raise GradeError(f"{msg}, and compute-sanitizer racecheck found a race{found[1]}") \
            from None


def _race_ex09_8(kern) -> None:
    """racecheck driver: small ragged tiles of ex09.8's kernel, Br != Bc both ways."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for H, Br, Bc, D in ((1, 5, 12, 7), (2, 13, 3, 20)):
        q, do = (cupy.asarray(rng.standard_normal((H, Br, D)).astype(np.float32))
                 for _ in range(2))
        k, v = (cupy.asarray(rng.standard_normal((H, Bc, D)).astype(np.float32))
                for _ in range(2))
        lse = cupy.asarray(np.full((H, Br), 3.0, np.float32))
        di = cupy.asarray(rng.standard_normal((H, Br)).astype(np.float32))
        dq = cupy.empty((H, Br, D), cupy.float32)
        dk, dv = cupy.empty((H, Bc, D), cupy.float32), cupy.empty((H, Bc, D), cupy.float32)
        kern((H,), (128,), (q, k, v, do, lse, di, dq, dk, dv, np.int32(Br), np.int32(Bc),
                            np.int32(D), np.float32(1 / math.sqrt(D))))


# ----------------------------------------------------------------------------- ex09.9
#: ex09_9: single steps of the backward loop, (what, Br, Bc, D, Nq, Nk, i0, j0, big): the query
#: tile is rows i0..i0+Br-1 of Nq queries, the key tile keys j0..j0+Bc-1 of Nk. Square first (dS Q
#: and dS^T Q have the same shape there, and their values name the axis), then 65 pairs (one more
#: than the first call's 64 threads: one thread takes a second pair) with d = 64, a tile wider
#: than tall with an odd d that holds every key, one query and one key, and scores near 800
STEP_CASES = (("a square tile of 8 queries x 8 keys, d = 16", 8, 8, 16, 20, 24, 8, 8, False),
              ("13 queries x 5 keys (65 pairs), d = 64", 13, 5, 64, 13, 17, 0, 10, False),
              ("3 queries x 16 keys (every key), d = 7", 3, 16, 7, 9, 16, 6, 0, False),
              ("one query and one key, d = 1", 1, 1, 1, 1, 3, 0, 2, False),
              ("6 queries x 9 keys, d = 8, scores near 800", 6, 9, 8, 6, 20, 0, 9, True))
#: ex09_9: threads of the block on the first call of each case, and on the second
STEP_THREADS = (64, 96)
#: ex09_9: the whole backward loop (Nq, Nk, D, Br, Bc): 2 x 2 steps, the last tile of each ragged
STEP_LOOP = (11, 13, 8, 8, 8)
_STEP_SYNC = ("a cuda.syncthreads() after the loop that writes Ps and dSs and before the loops "
              "that read them (outside any if, so that every thread reaches it)")
_STEP_FORMULA = ("P[i, j] = exp(scale q_i . k_j - lse[i]), dP[i, j] = do_i . v_j, dS = P (dP - "
                 "delta[i]); dv += P^T dO, dk += scale dS^T Q, dq += scale dS K")
_STEP_NAN = ("holds NaN that the kernel computed: a thread read an element of Ps or dSs that no "
             "thread had written yet (the simulator fills shared and local arrays with NaN and "
             "runs a block's threads one at a time between barriers), or an accumulator that was "
             "never set to 0: ")
#: ex09_9: the rows each output is indexed by, for the index message
_STEP_SHAPES = ("ds is (Br, Bc), dq (Br, d), dk and dv (Bc, d), with Br = q.shape[0] and "
                "Bc = k.shape[0]")


def _step_inputs(rng, Nq: int, Nk: int, D: int, big: bool):
    """(q, K, V, do, scale): float32 inputs of a sequence; big: scale q.k near 800."""
    scale = 1 / math.sqrt(D)
    q = (rng.standard_normal((Nq, D)) * 1.5).astype(np.float32)
    K = (rng.standard_normal((Nk, D)) * 1.5).astype(np.float32)
    if big:                         # exp(s) is inf in float32 and float64 there
        q[:, 0] = K[:, 0] = math.sqrt(800 / scale)
    V = rng.standard_normal((Nk, D)).astype(np.float32)
    do = rng.standard_normal((Nq, D)).astype(np.float32)
    return q, K, V, do, scale


def _step_candidates(name: str, q, k, v, do, lse, delta, scale: float, square: bool,
                     partial_tile: bool) -> list[tuple[np.ndarray, str]]:
    """(what the kernel wrote, or added to ``name``, under a known mistake; that mistake's hint),
    in float64 from the float32 inputs the kernel got."""
    q, k, v, do, lse, delta, s, P, dP, dS, loc, soft = _tile_terms(q, k, v, do, lse, delta,
                                                                   scale)
    with np.errstate(over="ignore", invalid="ignore"):
        tile_d = P * (dP - (P * dP).sum(1, keepdims=True))
    no_d = ("dS = P * dP leaves out the softmax's second term: dS[i, j] = P[i, j] (dP[i, j] - "
            "delta[i]), with the delta passed in (rowsum(dO * O), the sum over every key)")
    if name == "ds":
        out = [(P * dP, no_d),
               (np.exp(scale * s) * (dP - delta),
                "P = exp(scale q.k) ignores the saved logsumexp: P[i, j] = exp(scale q_i . k_j - "
                "lse[i]) is the softmax normalised over every key"),
               (np.exp(s - lse) * (dP - delta),
                "the scale is missing inside the exponent: the scores are scale q.k, so P[i, j] "
                "= exp(scale * (q_i . k_j) - lse[i])"),
               (-dS, "dS has the wrong sign: dS[i, j] = P[i, j] (dP[i, j] - delta[i])"),
               (scale * dS, "ds holds dS times the scale: ds is dS itself, and the scale stands "
                            "in front of the sums of dk and dq")]
        if partial_tile:
            out += [(soft * (dP - delta), "P was normalised over this tile's keys (a max and a "
                                          "sum over the tile): the other tiles' keys share the "
                                          "normalisation, which the saved lse carries: P[i, j] = "
                                          "exp(scale q_i . k_j - lse[i]), no max and no sum"),
                    (loc * (dP - delta), "P was taken against a maximum over this tile's keys: "
                                         "P[i, j] = exp(scale q_i . k_j - lse[i]), with the saved "
                                         "lse, no max"),
                    (tile_d, "delta summed over this tile's keys (sum_j P dP): that sum needs "
                             "every key of the row, which one tile does not see; use the delta "
                             "passed in")]
        if square:
            out.append((dS.T, "ds is transposed: ds[i, j] is query i's row and key j's column "
                              "(Br x Bc)"))
        return out
    if name == "dv":
        out = [(scale * P.T @ do, "dv += P^T dO has no scale in it (the scale belongs to the sums "
                                  "of dk and dq)"),
               (dS.T @ do, "dv sums P, not dS: dv[j, c] += sum_i P[i, j] dO[i, c]")]
        if square:
            out.append((P @ do, "dV = P^T dO sums over the queries: dv[j, c] += sum_i P[i, j] "
                                "dO[i, c]; P read as Ps[j, i] sums over the keys, the wrong "
                                "axis"))
        return out
    A = q if name == "dk" else k
    prod = (lambda X: X.T @ A) if name == "dk" else (lambda X: X @ A)
    what = "dS^T Q" if name == "dk" else "dS K"
    out = [(prod(dS), f"dS without the scale: the scores are scale Q K^T, so {name} += scale * "
                      f"{what} (P = exp(scale q.k - lse) keeps its own scale as well)"),
           (scale * scale * prod(dS), f"the scale is applied twice: {name} += scale * {what}, "
                                      "once"),
           (scale * prod(P * dP), no_d)]
    if square:
        out.append((scale * (dS @ A if name == "dk" else dS.T @ A),
                    "dK = scale dS^T Q sums over the queries: dk[j, c] += scale sum_i dS[i, j] "
                    "q[i, c]; dS Q (dS read as dSs[j, i]) sums over the keys, the wrong axis"
                    if name == "dk" else
                    "dQ = scale dS K sums over the keys: dq[i, c] += scale sum_j dS[i, j] "
                    "k[j, c]; dS^T K (dS read as dSs[j, i]) sums over the queries, the wrong "
                    "axis"))
    return out


def _step_near(got: np.ndarray, x: np.ndarray) -> bool:
    """``got`` is a mistake's answer ``x`` (the mistakes differ by whole terms or factors)."""
    if x.shape != got.shape or not np.isfinite(x).all() or not np.isfinite(got).all():
        return False
    return bool(np.allclose(got, x, rtol=1e-2, atol=1e-3 * max(float(np.abs(x).max()), 1e-30)))


def _step_hint(ex: str, case: str, msg: str, name: str, got, base, share, cands, first_ok: bool,
               threads: int, kernel, explain_args) -> str:
    """The hint for a wrong ``name`` (base: what it held before, None for ds; share: the right
    result of this step, what is added to base)."""
    if np.isnan(got).any():
        if name == "ds":
            if np.isnan(got).all():
                return ("ds is NaN everywhere: never written (is the kernel body still the "
                        "stub?), or summed into with += (ds comes in filled with NaN: it is "
                        "written, not added to)")
            if first_ok:
                return (f"right with blocks of {STEP_THREADS[0]} threads, but with {threads} "
                        "pairs are left unwritten: stride the loops by cuda.blockDim.x, not by "
                        "a fixed number of threads")
            ij = tuple(int(x) for x in np.argwhere(np.isnan(got))[0])
            return (f"{int(np.isnan(got).sum())} of {got.size} pairs never written, first "
                    f"(i, j) = {ij}: one pair e = i * Bc + j per step of e = t, t + "
                    "cuda.blockDim.x, ... while e < Br * Bc")
        if env.SIM:
            more = explain(ex, case, msg, kernel, (1,), (threads,), *explain_args)
            traced = more.find("cb.trace of the launch")   # the race, when the trace shows one
            return (f"{name} {_STEP_NAN}{_STEP_SYNC}"
                    + (f"; {more[traced:]}" if traced >= 0 else ""))
        return (f"{name} holds NaN: shared memory read before it was written (a missing "
                f"barrier: {_STEP_SYNC}), or an accumulator never set to 0?")
    if base is not None:
        if np.array_equal(got, base):
            return (f"{name} is unchanged: this step adds nothing to it"
                    + (" (dV forgotten: dv[j, c] += sum_i P[i, j] dO[i, c])" if name == "dv"
                       else f" ({_STEP_FORMULA})"))
        if _step_near(got, share):
            return (f"{name} holds only this step's share: it comes in holding the sums of the "
                    f"earlier steps of the loop; add to it ({name}[..., c] += ...), never set it "
                    "or start it at 0")
    if first_ok:
        return (f"right with blocks of {STEP_THREADS[0]} threads, wrong with {threads}: stride "
                "the loops by cuda.blockDim.x, not by a fixed number of threads (a fixed stride "
                "adds some elements twice, or leaves some out)")
    inc = got if base is None else got - base
    for cand, hint in cands:
        if _step_near(inc, cand):
            return hint
    return ""


def ex09_9(bwd_step) -> None:
    """``bwd_step(q, k, v, do, lse, delta, ds, dq, dk, dv, scale)`` is a @cuda.jit kernel
    launched [1, T] (any T; the grader: 64, then 96) for one step of FlashAttention-2's backward
    loop, a tile of Br queries and Bc keys (Br, Bc <= 16, d <= 64, float32): q, do (Br, d); k, v
    (Bc, d); lse (Br,) the logsumexp over ALL keys and delta (Br,) = rowsum(dO * O), both from
    the forward. With P = exp(scale q k^T - lse), dP = dO V^T and dS = P (dP - delta): ds (Br,
    Bc) = dS written (it comes NaN-filled); dv += P^T dO, dk += scale dS^T Q, dq += scale dS K
    (they come holding earlier steps' sums). Each case of ``STEP_CASES`` twice (64, then 96
    threads) against torch autograd in float64, shared and local memory NaN-filled in the
    simulator; then the whole loop of ``STEP_LOOP`` against autograd's dQ, dK, dV; on a GPU the
    answer is graded again in the simulator."""
    ex = "ex09.9"
    _need_kernel(ex, bwd_step)
    refuse_stub(ex, bwd_step)
    z2, z1 = np.zeros((2, 2), np.float32), np.zeros(2, np.float32)
    refuse_host_code(ex, bwd_step, (z2,) * 4 + (z1, z1) + (z2,) * 4 + (np.float32(1),))
    rng, seed = fresh_rng()
    ok_first = set()                # cases whose first call (64 threads) passed
    with poisoned_memory():
        for n_case, (what, Br, Bc, D, Nq, Nk, i0, j0, big) in enumerate(STEP_CASES):
            for rep, threads in enumerate(STEP_THREADS):
                q, K, V, do, scale = _step_inputs(rng, Nq, Nk, D, big)
                case = (f"{what} (queries {i0}..{i0 + Br - 1} of {Nq}, keys {j0}..{j0 + Bc - 1} "
                        f"of {Nk}), {threads} threads (seed {seed}, call {rep + 1})")
                first_ok = rep == 1 and n_case in ok_first
                _step_case(ex, case, bwd_step, rng, q, K, V, do, scale, i0, Br, j0, Bc, threads,
                           big, first_ok, n_case > 0)
                if rep == 0:
                    ok_first.add(n_case)
        _step_loop(ex, bwd_step, rng, seed)
    simulate(ex, "ex09_9", [("bwd_step", bwd_step)], hint=_STEP_SYNC)
    passed(ex)


def _step_launch(kernel, threads: int, args, outs, scale: float) -> None:
    kernel[1, threads](*args, *outs, np.float32(scale))


def _step_case(ex, case, kernel, rng, q, K, V, do, scale, i0, Br, j0, Bc, threads, big,
               first_ok, seen_ok) -> None:
    """One step, keys j0.. of the query tile i0..; every output checked against autograd."""
    lse, delta, dS, _, _ = _autograd(q, K, V, do, scale)
    qt, dot = q[i0:i0 + Br].copy(), do[i0:i0 + Br].copy()
    kt, vt = K[j0:j0 + Bc].copy(), V[j0:j0 + Bc].copy()
    lse32, delta32 = (x[i0:i0 + Br].astype(np.float32) for x in (lse, delta))
    D = q.shape[1]
    base = {"dq": rng.standard_normal((Br, D)).astype(np.float32),    # the earlier steps' sums
            "dk": rng.standard_normal((Bc, D)).astype(np.float32),
            "dv": rng.standard_normal((Bc, D)).astype(np.float32)}
    q64, k64, do64 = (x.astype(np.float64) for x in (qt, kt, dot))
    ds_ref = dS[i0:i0 + Br, j0:j0 + Bc]
    P = np.exp(scale * q64 @ k64.T - lse[i0:i0 + Br, None])
    share = {"ds": ds_ref, "dv": P.T @ do64, "dk": scale * ds_ref.T @ q64,
             "dq": scale * ds_ref @ k64}
    # float32 error is relative to the sum of the terms' magnitudes: dS is a difference of
    # near-equal terms; scores near 800 carry rounding of 800 * 2^-24 in the exponent and in lse
    mag_ds = P * (np.abs(do64 @ vt.astype(np.float64).T) + np.abs(delta[i0:i0 + Br, None]))
    mag = {"ds": mag_ds, "dv": np.abs(base["dv"]) + P.T @ np.abs(do64),
           "dk": np.abs(base["dk"]) + scale * mag_ds.T @ np.abs(q64),
           "dq": np.abs(base["dq"]) + scale * mag_ds @ np.abs(k64)}
    rtol = 2e-3 if big else 1e-4
    outs = {"ds": guarded((Br, Bc))}
    for name in ("dq", "dk", "dv"):
        o, buf = guarded(base[name].shape)
        o[...] = to_device(base[name])
        outs[name] = (o, buf)
    args = tuple(to_device(x) for x in (qt, kt, vt, dot, lse32, delta32))

    def run():
        try:
            _step_launch(kernel, threads, args, [outs[n][0] for n in ("ds", "dq", "dk", "dv")],
                         scale)
        except OverflowError:       # the simulator's math.exp; a GPU gives inf
            raise GradeError(f"{ex}: {case}: exp overflowed: {_BWD_EXP}") from None
        except IndexError as e:
            raise GradeError(f"{ex}: {case}: index out of range ({e}): {_STEP_SHAPES}; the "
                             "loops stop at Br * Bc pairs, Bc * d elements of dk and dv, Br * d "
                             "of dq") from None
    call(ex, case, run)
    for name, (o, buf) in outs.items():
        if not canary_ok(buf, o.size):
            raise GradeError(f"{ex}: {case}: wrote past the end of {name}: {_STEP_SHAPES}")
    explain_args = (qt, kt, vt, dot, lse32, delta32, np.full((Br, Bc), np.nan, np.float32),
                    *(base[n].copy() for n in ("dq", "dk", "dv")), np.float32(scale))
    for name in ("ds", "dv", "dk", "dq"):
        got = to_numpy(outs[name][0]).astype(np.float64)
        b = base.get(name)
        ref = share[name] if b is None else b + share[name]
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(got - ref) <= 1e-6 + rtol * mag[name])
        if not bad.any():
            continue
        msg = f"{ex}: {case}: {name} is wrong ({error_summary(got, ref, bad)})"
        if big and not np.isfinite(got).all() and seen_ok:
            raise GradeError(f"{msg}: {_BWD_EXP}")
        cands = _step_candidates(name, qt, kt, vt, dot, lse32, delta32, scale, Br == Bc,
                                 Bc < K.shape[0])
        hint = _step_hint(ex, case, msg, name, got, b, share[name], cands, first_ok, threads,
                          kernel, explain_args)
        if not hint:
            _step_simulator_first(ex, msg, kernel)
            hint = f"{_STEP_FORMULA}; or a race on Ps and dSs: {_STEP_SYNC}"
        raise GradeError(f"{msg}: {hint}")


def _step_loop(ex: str, kernel, rng, seed: int) -> None:
    """The whole backward as FlashAttention-2 runs it: for each key tile, every query tile, one
    launch each, dq, dk, dv starting at 0; their sums against autograd's dQ, dK, dV."""
    import torch

    Nq, Nk, D, Br, Bc = STEP_LOOP
    q, K, V, do, scale = _step_inputs(rng, Nq, Nk, D, False)
    lse, delta, _, dK, dV = _autograd(q, K, V, do, scale)
    Q = torch.tensor(q, dtype=torch.float64, requires_grad=True)
    O = torch.softmax(scale * Q @ torch.tensor(K, dtype=torch.float64).T, -1) @ \
        torch.tensor(V, dtype=torch.float64)
    O.backward(torch.tensor(do, dtype=torch.float64))
    ref = {"dq": Q.grad.numpy(), "dk": dK, "dv": dV}
    sums = {"dq": to_device(np.zeros((Nq, D), np.float32)),
            "dk": to_device(np.zeros((Nk, D), np.float32)),
            "dv": to_device(np.zeros((Nk, D), np.float32))}
    case = (f"the whole backward of Nq={Nq} queries and Nk={Nk} keys, d = {D}, in tiles of "
            f"{Br} x {Bc}: {ceil_div(Nq, Br) * ceil_div(Nk, Bc)} steps, dq, dk and dv starting "
            f"at 0 (seed {seed})")
    for j0 in range(0, Nk, Bc):
        for i0 in range(0, Nq, Br):
            i1, j1 = min(i0 + Br, Nq), min(j0 + Bc, Nk)
            args = tuple(to_device(np.ascontiguousarray(x)) for x in (
                q[i0:i1], K[j0:j1], V[j0:j1], do[i0:i1], lse[i0:i1].astype(np.float32),
                delta[i0:i1].astype(np.float32)))
            ds, _ = guarded((i1 - i0, j1 - j0))
            outs = (ds, sums["dq"][i0:i1], sums["dk"][j0:j1], sums["dv"][j0:j1])
            call(ex, case, lambda: _step_launch(kernel, STEP_THREADS[0], args, outs, scale))
    for name in ("dq", "dk", "dv"):
        got = to_numpy(sums[name]).astype(np.float64)
        bad = _bad(got, ref[name], 1e-3, 1e-5)
        if bad.any():
            raise GradeError(f"{ex}: {case}: {name} summed over the steps is not autograd's "
                             f"({error_summary(got, ref[name], bad)}): every single step was "
                             f"right, so look at what the kernel keeps between launches, or "
                             f"assumes of its output's rows; {_STEP_FORMULA}")


def _step_simulator_first(ex: str, msg: str, kernel) -> None:
    """On a GPU, values that fit no known mistake (a race gives such values): the answer graded
    again in the CUDA simulator first, where a missing barrier shows the same way every run."""
    if env.SIM or not _race._enabled():
        return
    err = _race._simulate_run(ex, "ex09_9", [("bwd_step", kernel)])
    if err:
        raise GradeError(f"{msg}; graded again in the CUDA simulator (which runs a block's "
                         f"threads one at a time between barriers): {err}")
