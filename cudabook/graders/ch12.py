"""Graders of the serving capstone (Chapter 12).

ex12_1  Numba: merge the split partials of flash-decoding into the attention output   simulator
ex12_2  Numba: attention scores of one query per request, keys read through a block table  simulator
ex12_3  CUDA C++ via CuPy: ex12_1's merge as the kernel paged_merge (fp16 output)           GPU
ex12_4  CUDA C++ via CuPy: ex12_2's scores as the kernel paged_scores (fp16 q and pool)     GPU

The partials handed to the answer are computed from random scores and values, split by split,
as paged_decode_split writes them (kernels/paged_attention.py); the reference is their exact
merge in float64, checked against attention over all the keys at once. Besides ordinary ragged
cases, the graders use the partials that expose each mistake a first merge makes: splits whose
maxima differ by hundreds (a split not rescaled to the common maximum), scores near +1000 and
near -1000 (a maximum started at 0 overflows or underflows every weight), empty splits
(m = -inf, l = 0), one split, a head dimension larger than the block. A wrong output that
matches a known mistake (no rescaling, splits averaged, base-2 weights) gets that mistake's hint.

The CUDA C++ graders (ex12_3, ex12_4) take the answer's source as a str and grade it on the
same cases and mistakes as their Numba twins, with the hints in C++ terms. Before anything is
compiled (so on a CPU too) they refuse a source that is not a str, that is still the stub (it
writes no element of its output), that includes a library or calls into one
(``_cuda_ch06_07.rubric``), or that is the book's own kernel (an include of a file of kernels/,
a book kernel named, or the body of paged_merge_v1 pasted). On a GPU the inputs of ex12_4 sit
inside zero padding (a block id of -1 reads zeros before the pool, an index past the table
reads zeros after it: a wrong index gives known numbers, never a fault), and an answer that uses
shared memory ends with compute-sanitizer (racecheck, synccheck, initcheck).
"""

from __future__ import annotations

import re

import numpy as np

from ..check import close, to_numpy
from ._core import (
    GradeError,
    call,
    canary_ok,
    ceil_div,
    compile_kernel,
    fresh_rng,
    guarded,
    need_gpu,
    padded,
    passed,
    to_device,
)
from ._cuda_ch06_07 import rubric
from ._static import cuda_code, mentions, refuse_stub
from .ch06 import _need_kernel

__all__ = ["ex12_1", "ex12_2", "ex12_3", "ex12_4", "merge_partials_case", "paged_scores_case",
           "MERGE_CASES", "PAGED_CASES", "MERGE_CUDA_CASES", "PAGED_CUDA_CASES"]

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
            _inputs_kept_and_canary(ex, case, (md, ld, od), (m, l_, o), buf, B * H * D,
                                    "index out by one row or head?")
            _judge(ex, case, to_numpy(out).astype(np.float64), ref,
                   hint or _which_mistake(to_numpy(out), m, l_, o))
    passed(ex)


_EXP2 = ("the weights are powers of 2, 2^(m_s - M) (exp2f, as in the book's kernels, whose "
         "scores are kept in the log2 domain): these partials are sums of e^(s - m_s), so split "
         "s weighs e^(m_s - M)")


def _inputs_kept_and_canary(ex, case, devs, hosts, buf, n, past_hint) -> None:
    """The merge read m, l, o without writing them, and wrote nothing past out's n elements."""
    if not all(np.array_equal(to_numpy(d), h) for d, h in zip(devs, hosts)):
        raise GradeError(f"{ex}: {case}: the kernel changed its inputs m, l or o: compute the "
                         "weights in registers")
    if not canary_ok(buf, n):
        raise GradeError(f"{ex}: {case}: wrote past the end of out: {past_hint}")


def _which_mistake(got, m, l_, o, tol=MERGE_TOL, hints=None) -> str | None:
    """The hint of the first-merge mistake whose output ``got`` matches within ``tol``, if any
    (``hints``: the case hints of the answer's language, ``_HINTS`` or ``_HINTS_CUDA``)."""
    hints = hints or _HINTS
    o64, l64, m64 = o.astype(np.float64), l_.astype(np.float64), m.astype(np.float64)
    with np.errstate(all="ignore"):
        plain = o64.sum(axis=2) / l64.sum(axis=2)[..., None]          # no rescaling
        live = l64 > 0
        each = np.where(live[..., None], o64 / np.where(live, l64, 1)[..., None], 0)
        mean = each.sum(axis=2) / live.sum(axis=2)[..., None]          # splits averaged
        w2 = np.exp2(m64 - m64.max(axis=2, keepdims=True))              # base-2 weights
        base2 = (w2[..., None] * o64).sum(axis=2) / (w2 * l64).sum(axis=2)[..., None]
    for cand, why in ((plain, hints["splits whose maxima"]),
                      (mean, "the splits hold different numbers of keys: averaging each "
                             "split's normalised output weighs them equally; weigh split s by "
                             "l_s exp(m_s - M) and divide once by sum_s l_s exp(m_s - M)"),
                      (base2, _EXP2)):
        if np.isfinite(cand).all() and close(got, cand, *tol).all():
            return why
    return None


def _judge(ex: str, case: str, got: np.ndarray, ref: np.ndarray, hint: str | None,
           tol=MERGE_TOL) -> None:
    nan = np.isnan(got)
    if nan.all() and hint is None:
        raise GradeError(f"{ex}: {case}: out never written (all NaN): is the body still the stub?")
    if nan.any() or not np.isfinite(got).all():
        where = np.argwhere(~np.isfinite(got))[0]
        tail = hint or ("a column never written, or a division by zero (an empty split's l?)"
                        if nan.any() else "an exp that overflowed")
        raise GradeError(f"{ex}: {case}: out{tuple(int(i) for i in where)} is "
                         f"{got[tuple(where)]}: {tail}")
    bad = ~close(got, ref, *tol)
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


def paged_scores_case(rng, lens, BS, MB, D, dtype=np.float32):
    """(q, k_pool, block_table, seq_lens, ref): a pool twice as large as needed, filled with
    noise, each request's blocks drawn from it in random order; ref (B, MB BS) float64 holds
    q[b] . K[b, t] / sqrt(D) for t < seq_lens[b] and -inf after. q and k_pool are ``dtype``
    (float32 for the Numba exercise, float16 for the CUDA C++ one); ref is computed from
    their rounded values."""
    B = len(lens)
    NB = 2 * sum(-(-n // BS) for n in lens) + 1
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        k = -(-n // BS)
        table[b, :k], ids = ids[:k], ids[k:]
    q = rng.standard_normal((B, D)).astype(np.float32).astype(dtype)
    kp = rng.standard_normal((NB, BS, D)).astype(np.float32).astype(dtype)
    ref = np.full((B, MB * BS), -np.inf)
    for b, n in enumerate(lens):
        t = np.arange(n)
        ref[b, :n] = kp[table[b, t // BS], t % BS].astype(np.float64) @ q[b] / np.sqrt(D)
    return q, kp, table, np.array(lens, np.int32), ref


def _paged_mistakes(q, kp, table, lens, flat: bool = False) -> dict[str, np.ndarray]:
    """The scores a wrong first answer computes, by mistake. Numba (``flat`` False): an entry
    of -1 read as a block id wraps to the last block, as a Numba array indexed with -1 does.
    CUDA C++ (``flat``): the table is read flat, ``block_table[b * MB + j]``, so j = MB reads
    the next row's first entry (the last row: the zeros after the table), and block -1 reads
    the zeros before the pool, as ex12_4 lays them out (``_scores_device``)."""
    B, D = q.shape
    BS, MB = kp.shape[1], table.shape[1]
    if flat:
        ext = np.concatenate([table.ravel(), np.zeros(MB, table.dtype)])
        kpz = np.concatenate([kp, np.zeros((1, BS, D), kp.dtype)])     # index -1: zeros
    out = {}
    for name, row, blk_of, scale in (
            ("boundary", lambda b: b, lambda t: (t + 1) // BS, 1 / np.sqrt(D)),
            ("boundary-", lambda b: b, lambda t: np.maximum(t - 1, 0) // BS, 1 / np.sqrt(D)),
            ("row", lambda b: 0, lambda t: t // BS, 1 / np.sqrt(D)),
            ("scale", lambda b: b, lambda t: t // BS, 1.0)):
        r = np.full((B, MB * BS), -np.inf)
        for b, n in enumerate(lens):
            t = np.arange(n)
            if flat:
                keys = kpz[ext[row(b) * MB + blk_of(t)], t % BS]
            else:
                keys = kp[table[row(b), np.minimum(blk_of(t), MB - 1)], t % BS]   # -1 wraps
            r[b, :n] = keys.astype(np.float64) @ q[b].astype(np.float64) * scale
        out[name] = r
    return out


_PAGED_HINTS = {
    "boundary": "position t lives in logical block t // BS at slot t % BS: an index off by one "
                "reads the wrong block exactly at a block boundary",
    "boundary-": "position t lives in logical block t // BS at slot t % BS: an index off by one "
                 "reads the wrong block exactly at a block boundary",
    "row": "request b's blocks are in row b of the block table; reading another row gives "
           "request b another request's keys",
    "scale": "the scores are not multiplied by the scale 1 / sqrt(D): s = q . k / sqrt(D)",
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


def _judge_scores(ex, case, got, ref, mistakes, lens, tol=MERGE_TOL,
                  low_precision: str | None = None) -> None:
    """GradeError naming the likely mistake unless ``got`` matches ``ref``; ``low_precision``:
    the hint for errors that fit half-precision arithmetic (CUDA C++), None not to look."""
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
    bad = live & ~close(got, ref, *tol)
    if bad.any():
        b, t = (int(i) for i in np.argwhere(bad)[0])
        why = next((_PAGED_HINTS[k] for k, m in mistakes.items()
                    if np.allclose(got[live], m[live], atol=1e-4, rtol=1e-4, equal_nan=True)),
                   None)
        if why is None and low_precision and np.isfinite(got[live]).all():
            # a wrong key or block gives errors of the scores' own size; rounding to half
            # precision, errors of a few thousandths of them
            err = np.abs(got - ref)[live]
            if err.max() < 2e-2 * max(float(np.abs(ref[live]).mean()), 1e-3):
                why = low_precision
        why = why or ("check the block (block_table[b, t // BS]), the slot (t % BS) and the "
                      "scale 1 / sqrt(D)")
        raise GradeError(f"{ex}: {case}: wrong at scores[{b}, {t}]: got {got[b, t]:.6g}, "
                         f"expected {ref[b, t]:.6g} ({int(bad.sum())} of {int(live.sum())} "
                         f"wrong); {why}")


# ----------------------------------------------------------------------------- CUDA C++ shared
def _book_kernel_files() -> set[str]:
    from ..compile import KERNELS_DIR

    return {p.name for p in KERNELS_DIR.iterdir() if p.suffix in (".cu", ".cuh")}


def _squash(code: str) -> str:
    return re.sub(r"\s+", "", code)


def _book_body(kernel: str) -> str:
    """The squashed body of one kernel of kernels/paged_attention.cu (from its first ``{``)."""
    from ..source import kernel_source

    text = cuda_code(kernel_source("paged_attention.cu", kernel))
    return _squash(text[text.index("{"):])


def _cuda_static(ex: str, src: str, out: str, what: str, book: tuple[str, ...]) -> str:
    """The rubric of ex12_3 and ex12_4 that needs no GPU; returns the code without comments.
    ``out``: the output the kernel must write; ``book``: kernels of paged_attention.cu whose
    body pasted in is refused."""
    code = rubric(ex, src, what, shared=False)       # a str, no library header or namespace
    for inc in re.findall(r"#\s*include\s*[<\"]([^>\"]+)[>\"]", code):
        name = inc.replace("\\", "/").rsplit("/", 1)[-1]
        if name in _book_kernel_files():
            raise GradeError(f"{ex}: the source includes {inc}, the book's own kernels "
                             f"(kernels/{name}): the exercise asks for {what}")
    named = re.search(r"\bpaged_(merge|decode|append|write|rope_append)_v\d\w*", code)
    if named:
        raise GradeError(f"{ex}: the code names {named.group(0)}, the book's own kernel "
                         f"(kernels/paged_attention.cu): the exercise asks for {what}")
    squashed = _squash(code)
    for k in book:
        if _book_body(k) in squashed:
            raise GradeError(f"{ex}: this is the body of the book's own kernel {k} "
                             f"(kernels/paged_attention.cu), pasted in: the exercise asks for "
                             f"{what}")
    if not re.search(rf"\b{out}\s*(\[|\+(?!=)|\))", code):   # out[i], out + i, (out): written
        raise GradeError(f"{ex}: not implemented yet: the kernel writes no element of {out} (is "
                         "its body still the stub?)")
    return code


def _cuda_racecheck(ex: str, src: str, code: str, kernel: str, hint: str) -> None:
    """compute-sanitizer on an answer that uses shared memory (neither exercise needs it, so
    an answer without is not run under the tools: a global-memory kernel has no barrier to
    miss)."""
    if not mentions(code, "__shared__"):
        return
    from ._race import racecheck

    racecheck(ex, src, kernel, f"cudabook.graders.ch12:_race_{ex.replace('.', '_')}", hint=hint)


_CUDA_SYNC = ("a __syncthreads() after the threads fill the shared array and before any "
              "thread reads it, reached by every thread of the block (no return before it)")


# ----------------------------------------------------------------------------- ex12.3
#: threads of a block of paged_merge (as ex12_1: D = 40 has more columns than threads)
MERGE_THREADS = 32
#: (atol, rtol) of the merge written as fp16 (rounding: 2^-11 of the value) against float64
MERGE_HALF_TOL = (1e-3, 2e-3)
#: ex12_1's cases, and one of a real decode step's size (the GPU is not the simulator)
MERGE_CUDA_CASES = {**MERGE_CASES,
                    "16 requests, 12 heads, 8 splits, D = 64": (16, 12, 8, 64, "ragged", 0.0,
                                                                 1.0)}
#: ex12_1's hints, those that name code in C++ terms
_HINTS_CUDA = {
    **_HINTS,
    "scores near +1000": "start the running maximum at -infinity (NEG_INF, "
                         "__int_as_float(0xff800000)), not 0: expf(m_s - 0) overflows for "
                         "scores near 1000",
    "scores near -1000": "start the running maximum at -infinity (NEG_INF, "
                         "__int_as_float(0xff800000)), not 0: expf(m_s - 0) underflows to 0 for "
                         "every split when the scores are near -1000",
    "D = 40": "the output has D = 40 columns and the block 32 threads: loop "
              "for (int d = threadIdx.x; d < D; d += blockDim.x)",
}
_MERGE_WHAT = ("the merge in the kernel's own loops over the splits and the columns (no CUB, "
               "CUTLASS, cuBLAS, Thrust or PyTorch, and not the book's paged_merge_v1)")


def _merge_launch(kern, m, l_, o, out, B: int, H: int, S: int, D: int) -> None:
    kern((H, B), (MERGE_THREADS,), (m, l_, o, out, np.int32(H), np.int32(D), np.int32(S)))


def ex12_3(src: str) -> None:
    """``src`` defines ``paged_merge(const float* m, const float* l, const float* o, __half*
    out, int H, int D, int S)``, ex12_1's merge in CUDA C++: m, l (B, H, S) float32, each
    split's maximum score and its sum of e^(s - m); o (B, H, S, D) float32, each split's sum of
    e^(s_j - m) v_j; out (B, H, D) fp16, the attention output over all the splits' keys. An
    empty split is (-inf, 0, 0). Launched with grid (H, B) and 32 threads: block (h, b) merges
    head h of request b. The inputs must not change.

    Static rubric first (on a CPU too): a str, not the stub, no library, not the book's
    paged_merge_v1. Then, on a GPU, each case of ``MERGE_CUDA_CASES`` twice with fresh
    partials, out NaN-filled with a canary, against the float64 merge; the hint of a known
    mistake (ex12_1's, in C++ terms); compute-sanitizer where the answer uses shared memory."""
    ex = "ex12.3"
    code = _cuda_static(ex, src, "out", _MERGE_WHAT, ("paged_merge_v1",))
    need_gpu(ex)
    kern = compile_kernel(ex, src, "paged_merge")
    rng, seed = fresh_rng()
    for rep in range(2):
        for what, (B, H, S, D, rule, offset, spread) in MERGE_CUDA_CASES.items():
            case = f"{what} (seed {seed}, call {rep + 1})"
            hint = next((h for k, h in _HINTS_CUDA.items() if what.startswith(k)), None)
            m, l_, o, ref = merge_partials_case(rng, B, H, S, D, rule, offset, spread)
            # a loop one split or column too far reads the zero tail instead of faulting
            md, ld, od = padded(m, 4 * D), padded(l_, 4 * D), padded(o, 4 * D)
            out, buf = guarded((B, H, D), np.float16)
            call(ex, case, lambda: _merge_launch(kern, md, ld, od, out, B, H, S, D))
            _inputs_kept_and_canary(ex, case, (md, ld, od), (m, l_, o), buf, B * H * D,
                                    "index out by one row or head, or a column loop that runs "
                                    "to d <= D?")
            got = to_numpy(out).astype(np.float64)
            _judge(ex, case, got, ref,
                   hint or _which_mistake(got, m, l_, o, MERGE_HALF_TOL, _HINTS_CUDA),
                   tol=MERGE_HALF_TOL)
    _cuda_racecheck(ex, src, code, "paged_merge", _CUDA_SYNC)
    passed(ex)


def _race_ex12_3(kern) -> None:
    """racecheck driver: paged_merge on D = 40 (more columns than threads), empty splits."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for B, H, S, D, rule in ((2, 3, 4, 40, "ragged"), (1, 2, 5, 8, "empty")):
        m, l_, o, _ = merge_partials_case(rng, B, H, S, D, rule, 0.0, 1.0)
        out = cupy.empty((B, H, D), cupy.float16)
        _merge_launch(kern, cupy.asarray(m), cupy.asarray(l_), cupy.asarray(o), out, B, H, S, D)


# ----------------------------------------------------------------------------- ex12.4
#: threads of a block of paged_scores (as ex12_2)
SCORES_THREADS = 32
#: (atol, rtol) of float32 scores from fp16 q and keys against float64 from the same values
SCORES_TOL = (1e-4, 1e-4)
#: ex12_2's cases, and one of a longer cache at a real head dimension
PAGED_CUDA_CASES = {**PAGED_CASES,
                    "8 requests of up to 300 tokens, blocks of 16, D = 128":
                        ((300, 1, 16, 17, 256, 129, 64, 200), 16, 19, 128)}
_SCORES_WHAT = ("the scores in the kernel's own loop over the head dimension (no CUB, CUTLASS, "
                "cuBLAS, Thrust or PyTorch, and not the book's paged_decode kernels)")
_SCORES_HALF = ("the errors fit half-precision arithmetic: convert q and the key to float as "
                "they are loaded (__half2float) and accumulate the dot product in float")


def _scores_device(q, kp, table, sl):
    """q, k_pool, block_table, seq_lens on the device. The pool sits between one block of
    zeros before it and two after it, the table before BS zeros: a block id of -1 (a read past
    the request's end) or one past the pool reads zeros, and so does a table index past the
    last row, instead of faulting (which would end the CUDA context of every later cell)."""
    NB, BS, D = kp.shape
    flat = np.zeros((NB + 3) * BS * D, kp.dtype)
    flat[BS * D:(NB + 1) * BS * D] = kp.ravel()
    pool = to_device(flat)[BS * D:(NB + 1) * BS * D].reshape(kp.shape)
    return to_device(q), pool, padded(table, table.shape[1]), to_device(sl)


def _scores_launch(kern, q, kp, table, sl, scores, B: int, MB: int, BS: int, D: int) -> None:
    T = MB * BS
    kern((ceil_div(T, SCORES_THREADS), B), (SCORES_THREADS,),
         (q, kp, table, sl, scores, np.int32(B), np.int32(MB), np.int32(BS), np.int32(D),
          np.int32(T)))


def ex12_4(src: str) -> None:
    """``src`` defines ``paged_scores(const __half* q, const __half* k_pool, const int*
    block_table, const int* seq_lens, float* scores, int B, int MB, int BS, int D, int T)``,
    ex12_2's kernel in CUDA C++: q (B, D) fp16; k_pool (NB, BS, D) fp16, the pool of key
    blocks; block_table (B, MB) int32, -1 past a request's blocks; seq_lens (B,) int32; scores
    (B, T) float32, T = MB * BS: q[b] . K[b, t] / sqrt(D) for t < seq_lens[b], with K[b, t] =
    k_pool[block_table[b * MB + t / BS], t % BS], and -inf for t >= seq_lens[b]. Launched with
    grid (ceil(T / 32), B) and 32 threads: a thread per (position, request). D is a multiple
    of 8.

    Static rubric first (on a CPU too): a str, not the stub, no library, not the book's
    kernels. Then, on a GPU, each case of ``PAGED_CUDA_CASES`` twice with a fresh pool and
    table, scores NaN-filled with a canary, against float64 scores from the same fp16 values;
    the hint of a known mistake (ex12_2's, the table read flat as C++ reads it); compute-
    sanitizer where the answer uses shared memory."""
    ex = "ex12.4"
    code = _cuda_static(ex, src, "scores", _SCORES_WHAT, ())
    need_gpu(ex)
    kern = compile_kernel(ex, src, "paged_scores")
    rng, seed = fresh_rng()
    for rep in range(2):
        for what, (lens, BS, MB, D) in PAGED_CUDA_CASES.items():
            case = f"{what} (seed {seed}, call {rep + 1})"
            q, kp, table, sl, ref = paged_scores_case(rng, lens, BS, MB, D, np.float16)
            B, T = len(lens), MB * BS
            args = _scores_device(q, kp, table, sl)
            out, buf = guarded((B, T))
            call(ex, case, lambda: _scores_launch(kern, *args, out, B, MB, BS, D))
            if not canary_ok(buf, B * T):
                raise GradeError(f"{ex}: {case}: wrote past the end of scores: a guard on t < "
                                 "T (the grid rounds T up to whole blocks of 32)?")
            if not (np.array_equal(to_numpy(args[1]), kp)
                    and np.array_equal(to_numpy(args[2]), table)):
                raise GradeError(f"{ex}: {case}: the kernel changed k_pool or block_table: "
                                 "they are inputs, shared by every request")
            got = to_numpy(out).astype(np.float64)
            _judge_scores(ex, case, got, ref, _paged_mistakes(q, kp, table, sl, flat=True), sl,
                          tol=SCORES_TOL, low_precision=_SCORES_HALF)
    _cuda_racecheck(ex, src, code, "paged_scores", _CUDA_SYNC)
    passed(ex)


def _race_ex12_4(kern) -> None:
    """racecheck driver: paged_scores on a boundary case and a row longer than one block."""
    rng = np.random.default_rng(0)
    for lens, BS, MB, D in (((1, 8, 9), 8, 3, 16), ((33, 47), 16, 3, 40)):
        q, kp, table, sl, _ = paged_scores_case(rng, lens, BS, MB, D, np.float16)
        out, _ = guarded((len(lens), MB * BS))
        _scores_launch(kern, *_scores_device(q, kp, table, sl), out, len(lens), MB, BS, D)
