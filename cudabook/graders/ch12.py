"""Graders of the serving capstone (Chapter 12).

ex12_1  Numba: merge the split partials of flash-decoding into the attention output   simulator
ex12_2  Numba: attention scores of one query per request, keys read through a block table  simulator

The partials handed to the answer are computed from random scores and values, split by split,
as paged_decode_split writes them (kernels/paged_attention.py); the reference is their exact
merge in float64, checked against attention over all the keys at once. Besides ordinary ragged
cases, the graders use the partials that expose each mistake a first merge makes: splits whose
maxima differ by hundreds (a split not rescaled to the common maximum), scores near +1000 and
near -1000 (a maximum started at 0 overflows or underflows every weight), empty splits
(m = -inf, l = 0), one split, a head dimension larger than the block. A wrong output that
matches a known mistake (no rescaling, splits averaged) gets that mistake's hint.
"""

from __future__ import annotations

import numpy as np

from ..check import close, to_numpy
from ._core import GradeError, call, canary_ok, fresh_rng, guarded, passed, to_device
from ._static import refuse_stub
from .ch06 import _need_kernel

__all__ = ["ex12_1", "ex12_2", "merge_partials_case", "paged_scores_case", "MERGE_CASES",
           "PAGED_CASES"]

#: (atol, rtol) of a float32 merge against the float64 reference
MERGE_TOL = (1e-5, 1e-4)

#: case name -> (B, H, S, D, split lengths rule, score offset per split, scale of the scores)
MERGE_CASES = {
    "ragged: 3 requests, 5 heads, 4 splits, D = 17": (3, 5, 4, 17, "ragged", 0.0, 1.0),
    "one split, D = 8": (2, 3, 1, 8, "ragged", 0.0, 1.0),
    "D = 40, more than the 32 threads of a block": (1, 2, 3, 40, "ragged", 0.0, 1.0),
    "splits whose maxima differ by hundreds": (2, 2, 4, 8, "ragged", 300.0, 1.0),
    "empty splits (m = -inf, l = 0)": (2, 2, 5, 8, "empty", 0.0, 1.0),
    "scores near +1000": (1, 2, 3, 8, "ragged", 1000.0, 0.0),
    "scores near -1000": (1, 2, 3, 8, "ragged", -1000.0, 0.0),
}

_HINTS = {
    "splits whose maxima": "each split's o and l are sums of exp(s - m_s), relative to ITS OWN "
                           "maximum: rescale both by exp(m_s - M) to the common maximum M "
                           "before adding them",
    "empty splits": "an empty split has m = -inf and l = 0: its weight exp(m_s - M) is 0 "
                    "(never divide by its l, and do not let -inf into M)",
    "scores near +1000": "start the running maximum at -inf (-math.inf), not 0: exp(m_s - 0) "
                         "overflows for scores near 1000",
    "scores near -1000": "start the running maximum at -inf (-math.inf), not 0: exp(m_s - 0) "
                         "underflows to 0 for every split when the scores are near -1000",
    "D = 40": "the output has D = 40 columns and the block 32 threads: loop d over "
              "range(cuda.threadIdx.x, D, cuda.blockDim.x)",
}


def merge_partials_case(rng, B, H, S, D, rule, offset, spread):
    """(m, l, o, ref): float32 partials of S splits per (request, head) and the float64
    attention output over all their keys (the exact merge of the float32 partials, checked
    against attention computed from the scores directly). ``rule`` "ragged": splits of 1..9
    keys; "empty": some splits hold no key. ``offset``: split s's scores shifted by
    s * offset ("maxima differ"), or all by ``offset`` when ``spread`` is 0 (near +-1000)."""
    m = np.empty((B, H, S), np.float32)
    l_ = np.empty((B, H, S), np.float32)
    o = np.empty((B, H, S, D), np.float32)
    ref = np.empty((B, H, D))
    for b in range(B):
        for h in range(H):
            ns = rng.integers(1, 10, S)
            if rule == "empty":
                ns[rng.permutation(S)[:S // 2]] = 0
                ns[rng.integers(S)] = max(ns.max(), 1)
            scores, values = [], []
            for s in range(S):
                shift = s * offset if spread else offset
                sc = rng.standard_normal(ns[s]) * 2 + shift
                v = rng.standard_normal((ns[s], D))
                scores.append(sc)
                values.append(v)
                if ns[s] == 0:
                    m[b, h, s], l_[b, h, s], o[b, h, s] = -np.inf, 0.0, 0.0
                else:
                    p = np.exp(sc - sc.max())
                    m[b, h, s], l_[b, h, s], o[b, h, s] = sc.max(), p.sum(), p @ v
            sc, v = np.concatenate(scores), np.concatenate(values)
            p = np.exp(sc - sc.max())
            ref[b, h] = p @ v / p.sum()
    # the exact merge of the float32 partials (their rounding is not the answer's error)
    mf = m.astype(np.float64)
    w = np.exp(mf - mf.max(axis=2, keepdims=True))
    exact = (w[..., None] * o).sum(axis=2) / (w * l_).sum(axis=2)[..., None]
    assert np.allclose(exact, ref, atol=1e-3, rtol=1e-2), "partials inconsistent with scores"
    return m, l_, o, exact


def ex12_1(kernel) -> None:
    """``kernel(m, l, o, out)``: a @cuda.jit kernel launched [(H, B), 32], one block per
    (query head, request). m, l (B, H, S) float32: each split's maximum score and its sum of
    exp(s - m); o (B, H, S, D): each split's sum of exp(s_j - m) v_j. It writes out (B, H, D),
    the attention output over all the splits' keys. An empty split has m = -inf, l = 0, o = 0.
    The inputs must not change."""
    ex = "ex12.1"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    rng, seed = fresh_rng()
    for rep in range(2):
        for what, (B, H, S, D, rule, offset, spread) in MERGE_CASES.items():
            case = f"{what} (seed {seed}, call {rep + 1})"
            hint = next((h for k, h in _HINTS.items() if what.startswith(k)), None)
            m, l_, o, ref = merge_partials_case(rng, B, H, S, D, rule, offset, spread)
            md, ld, od = to_device(m), to_device(l_), to_device(o)
            out, buf = guarded((B, H, D))
            call(ex, case, lambda: kernel[(H, B), 32](md, ld, od, out))
            if not (np.array_equal(to_numpy(md), m) and np.array_equal(to_numpy(ld), l_)
                    and np.array_equal(to_numpy(od), o)):
                raise GradeError(f"{ex}: {case}: the kernel changed its inputs m, l or o: "
                                 "compute the weights in registers")
            if not canary_ok(buf, B * H * D):
                raise GradeError(f"{ex}: {case}: wrote past the end of out: index out by one "
                                 "row or head?")
            _judge(ex, case, to_numpy(out).astype(np.float64), ref,
                   hint or _which_mistake(to_numpy(out), m, l_, o))
    passed(ex)


def _which_mistake(got, m, l_, o) -> str | None:
    """The hint of the first-merge mistake whose output ``got`` matches, if any."""
    o64, l64 = o.astype(np.float64), l_.astype(np.float64)
    with np.errstate(all="ignore"):
        plain = o64.sum(axis=2) / l64.sum(axis=2)[..., None]          # no rescaling
        live = l64 > 0
        each = np.where(live[..., None], o64 / np.where(live, l64, 1)[..., None], 0)
        mean = each.sum(axis=2) / live.sum(axis=2)[..., None]          # splits averaged
    for cand, why in ((plain, _HINTS["splits whose maxima"]),
                      (mean, "the splits hold different numbers of keys: averaging each "
                             "split's normalised output weighs them equally; weigh split s by "
                             "l_s exp(m_s - M) and divide once by sum_s l_s exp(m_s - M)")):
        if np.isfinite(cand).all() and close(got, cand, *MERGE_TOL).all():
            return why
    return None


def _judge(ex: str, case: str, got: np.ndarray, ref: np.ndarray, hint: str | None) -> None:
    nan = np.isnan(got)
    if nan.all() and hint is None:
        raise GradeError(f"{ex}: {case}: out never written (all NaN): is the body still the stub?")
    if nan.any() or not np.isfinite(got).all():
        where = np.argwhere(~np.isfinite(got))[0]
        tail = hint or ("a column never written, or a division by zero (an empty split's l?)"
                        if nan.any() else "an exp that overflowed")
        raise GradeError(f"{ex}: {case}: out{tuple(int(i) for i in where)} is "
                         f"{got[tuple(where)]}: {tail}")
    bad = ~close(got, ref, *MERGE_TOL)
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        why = hint or ("the splits hold different numbers of keys: weigh split s by its share "
                       "l_s exp(m_s - M) of the total, then divide once by the total "
                       "sum_s l_s exp(m_s - M)")
        raise GradeError(f"{ex}: {case}: wrong at {i}: got {got[i]:.6g}, expected "
                         f"{ref[i]:.6g} ({int(bad.sum())} of {bad.size} wrong); {why}")


# ----------------------------------------------------------------------------- ex12.2
#: case name -> (requests' lengths, block size, blocks per row of the table, head dim)
PAGED_CASES = {
    "3 requests, lengths 1, 8 and 9 (block size 8: both sides of a boundary)": ((1, 8, 9), 8, 3,
                                                                                  16),
    "one request filling its whole row (4 blocks of 4)": ((16,), 4, 4, 8),
    "5 requests, ragged lengths, blocks of 16, D = 40": ((33, 1, 16, 17, 47), 16, 3, 40),
}


def paged_scores_case(rng, lens, BS, MB, D):
    """(q, k_pool, block_table, seq_lens, ref): a pool twice as large as needed, filled with
    noise, each request's blocks drawn from it in random order; ref (B, MB BS) float64 holds
    q[b] . K[b, t] / sqrt(D) for t < seq_lens[b] and -inf after."""
    B = len(lens)
    NB = 2 * sum(-(-n // BS) for n in lens) + 1
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        k = -(-n // BS)
        table[b, :k], ids = ids[:k], ids[k:]
    q = rng.standard_normal((B, D)).astype(np.float32)
    kp = rng.standard_normal((NB, BS, D)).astype(np.float32)
    ref = np.full((B, MB * BS), -np.inf)
    for b, n in enumerate(lens):
        t = np.arange(n)
        ref[b, :n] = kp[table[b, t // BS], t % BS].astype(np.float64) @ q[b] / np.sqrt(D)
    return q, kp, table, np.array(lens, np.int32), ref


def _paged_mistakes(q, kp, table, lens) -> dict[str, np.ndarray]:
    """The scores a wrong first answer computes, by mistake (an entry of -1 read as a block id
    wraps to the last block, as a Numba array indexed with -1 does)."""
    B, D = q.shape
    BS, MB = kp.shape[1], table.shape[1]
    out = {}
    for name, row, blk_of in (
            ("boundary", lambda b: b, lambda t: (t + 1) // BS),
            ("boundary-", lambda b: b, lambda t: np.maximum(t - 1, 0) // BS),
            ("row", lambda b: 0, lambda t: t // BS)):
        r = np.full((B, MB * BS), -np.inf)
        for b, n in enumerate(lens):
            t = np.arange(n)
            blk = table[row(b), np.minimum(blk_of(t), MB - 1)]     # -1 wraps, as Numba's does
            r[b, :n] = kp[blk, t % BS].astype(np.float64) @ q[b] / np.sqrt(D)
        out[name] = r
    return out


_PAGED_HINTS = {
    "boundary": "position t lives in logical block t // BS at slot t % BS: an index off by one "
                "reads the wrong block exactly at a block boundary",
    "boundary-": "position t lives in logical block t // BS at slot t % BS: an index off by one "
                 "reads the wrong block exactly at a block boundary",
    "row": "request b's blocks are in row b of the block table; reading another row gives "
           "request b another request's keys",
}


def ex12_2(kernel) -> None:
    """``kernel(q, k_pool, block_table, seq_lens, scores)``: a @cuda.jit kernel launched
    [(ceil(T / 32), B), 32] with T = MB * BS, a thread per (position, request). q (B, D)
    float32; k_pool (NB, BS, D): the pool of key blocks; block_table (B, MB) int32; seq_lens
    (B,) int32. It writes scores (B, T): q[b] . K[b, t] / sqrt(D) for t < seq_lens[b], where
    K[b, t] = k_pool[block_table[b, t // BS], t % BS], and -inf for t >= seq_lens[b] (a masked
    position a softmax ignores). Entries of the table past a request's blocks are -1."""
    ex = "ex12.2"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    rng, seed = fresh_rng()
    for rep in range(2):
        for what, (lens, BS, MB, D) in PAGED_CASES.items():
            case = f"{what} (seed {seed}, call {rep + 1})"
            q, kp, table, sl, ref = paged_scores_case(rng, lens, BS, MB, D)
            B, T = len(lens), MB * BS
            args = [to_device(a) for a in (q, kp, table, sl)]
            out, buf = guarded((B, T))
            call(ex, case, lambda: kernel[(-(-T // 32), B), 32](*args, out))
            if not canary_ok(buf, B * T):
                raise GradeError(f"{ex}: {case}: wrote past the end of scores: a guard on t < "
                                 "T (the grid rounds T up to whole blocks of 32)?")
            got = to_numpy(out).astype(np.float64)
            _judge_scores(ex, case, got, ref, _paged_mistakes(q, kp, table, sl), sl)
    passed(ex)


def _judge_scores(ex, case, got, ref, mistakes, lens) -> None:
    live = np.isfinite(ref)
    if np.isnan(got).all():
        raise GradeError(f"{ex}: {case}: scores never written (all NaN): is the body still the "
                         "stub?")
    dead = ~live & ~(got == -np.inf)
    if dead.any():
        b, t = (int(i) for i in np.argwhere(dead)[0])
        raise GradeError(f"{ex}: {case}: scores[{b}, {t}] is {got[b, t]:.6g}, but request {b} "
                         f"holds {int(lens[b])} tokens: a position past the end is -inf "
                         "(masked), never a score of stale or foreign keys")
    bad = live & ~close(got, ref, *MERGE_TOL)
    if bad.any():
        b, t = (int(i) for i in np.argwhere(bad)[0])
        why = next((_PAGED_HINTS[k] for k, m in mistakes.items()
                    if np.allclose(got[live], m[live], atol=1e-4, rtol=1e-4, equal_nan=True)),
                   "check the block (block_table[b, t // BS]), the slot (t % BS) and the "
                   "scale 1 / sqrt(D)")
        raise GradeError(f"{ex}: {case}: wrong at scores[{b}, {t}]: got {got[b, t]:.6g}, "
                         f"expected {ref[b, t]:.6g} ({int(bad.sum())} of {int(live.sum())} "
                         f"wrong); {why}")
