"""Graders of Chapter 13, training the GPT on the book's kernels.

ex13_1  Numba: LayerNorm's backward dx, one block of 128 threads per row, rows strided   simulator
        over a grid of G <= M blocks, the two row sums reduced in shared memory
ex13_2  Numba: the cross-entropy over a padded vocabulary, each row's loss and its        simulator
        gradient written over the logits (in place), a target of -1 ignoring its row

Both draw fresh random inputs on every call, run each case twice, fill the outputs with NaN
followed by a NaN canary, and compare with float64 references; a wrong answer whose values
match a known mistake gets that mistake's hint, and the answer is never printed.

ex13_1 takes the LayerNorm backward's reference and the answers of its known mistakes from
ex06.5 (``ch06._ln_parts``: each term of dx left out, rstd missing, the means divided by the
block's 128 threads or by the rows), with the inputs ex06.5 uses (``ch06._ln_inputs``: dy with
a non-zero mean, so that mean_c(w dy) matters; rows near 1e4 with a spread of 1e-2, where an
expanded sum cancels), and adds the mistakes of a row loop: partial sums not restarted for each
row, rows left out when the grid is smaller than M, and the race on the shared totals when a
block moves on to its next row. In the simulator shared memory starts NaN-filled
(``poisoned_memory``) and a block's threads run one at a time between barriers, so a missing
``cuda.syncthreads()`` gives NaN (a partial read before it was written) or the wrong row's
totals, the same on every run. On a GPU, values that fit no known mistake are graded again in
the simulator before the grader guesses (a race gives such values), and an answer that passed
ends there too (``_race.simulate``), where the race the GPU hid shows. A barrier inside a branch
that only some threads take is refused before anything runs (``refuse_host_code``).

ex13_2's logits are a (M, Vp) float32 buffer followed by a NaN canary: the kernel reads them
and overwrites them with the gradient. The padding columns j >= V hold noise, so a softmax over
them or a padding column left unwritten shows; cases near +1000 (exp overflows without the
row's maximum subtracted) and near -1000 (a maximum started at 0 makes every exp underflow);
rows whose target is -1 (loss 0, gradient 0). A loss read from the target's logit after the
gradient overwrote it, a loss of the wrong sign, a gradient without its one-hot term or its
scale: each has its hint.
"""

from __future__ import annotations

import numpy as np

from .. import env
from ..check import close, to_numpy
from . import _race
from ._core import (
    GradeError,
    call,
    canary_ok,
    ceil_div,
    error_summary,
    fresh_rng,
    guarded,
    padded,
    passed,
    poisoned_memory,
    to_device,
)
from ._race import simulate
from ._static import refuse_host_code, refuse_stub
from .ch06 import _LN_EXTREME, LN_DX_TOL, LN_THREADS, _ln_inputs, _ln_near, _ln_parts, _need_kernel

__all__ = ["ex13_1", "ex13_2", "LN13_THREADS", "LN13_CASES", "LN13_GPU_CASES", "XENT_THREADS",
           "XENT_CASES", "layernorm_rows_not_reset", "xent_reference"]

# ----------------------------------------------------------------------------- ex13.1
#: threads per block of ex13.1 (as ex06.5's layernorm_bwd_dx, whose mistakes _ln_parts makes)
LN13_THREADS = LN_THREADS
#: case name -> (M rows, C columns, G blocks, kind of ch06._ln_inputs). Small: a simulator
#: barrier costs about 30 ms, and a row of the tree reduction has nine
LN13_CASES = {
    "one row of one column": (1, 1, 1, "plain"),
    "C = 31, fewer columns than the 128 threads, a block per row": (2, 31, 2, "plain"),
    "C = 200, more columns than threads; 3 rows on 2 blocks": (3, 200, 2, "plain"),
    "x near 1e4 with a spread of 1e-2, C = 129; 2 rows on 1 block": (2, 129, 1, "extreme"),
}
#: cases added on a GPU (the simulator would take minutes)
LN13_GPU_CASES = {
    "37 rows of 33 columns, 5 blocks": (37, 33, 5, "plain"),
    "300 rows of 1000 columns, 64 blocks": (300, 1000, 64, "plain"),
    "64 rows of 4099 columns, 16 blocks": (64, 4099, 16, "plain"),
    "4096 rows of 77 columns, 132 blocks": (4096, 77, 132, "many rows"),
}

_LN13_FORMULA = ("dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)) with g = w * dy and "
                 "xhat = (x - mean[row]) * rstd[row], both means over the row's C columns")
_LN13_SYNC = ("a cuda.syncthreads() after every thread has written its partials to s1 and s2, "
              "one after each level of the tree (outside the if, so that every thread reaches "
              "it), and one after the dx loop, before the block's next row writes s1 and s2 "
              "again")
_LN13_REUSE = ("a block's last row is right and its earlier rows wrong: the block moved on to "
               "its next row and wrote its new partials into s1[0] and s2[0] while other "
               "threads had not yet read the totals of the row before: a cuda.syncthreads() at "
               "the end of the row loop, after the dx loop")
_LN13_NAN = ("dx holds NaN that the kernel computed: a thread read an element of s1 or s2 that "
             "no thread had written yet (the simulator fills shared memory with NaN and runs a "
             "block's threads one at a time between barriers): ")


def layernorm_rows_not_reset(dy, x, w, mean, rstd, G: int) -> np.ndarray:
    """dx (float64) when a thread's partial sums start from 0 once, before the row loop,
    instead of for every row: block b's totals for its k-th row (rows b, b + G, ...) add the
    totals of its k - 1 rows before."""
    dy, x, w = (np.asarray(a, np.float64) for a in (dy, x, w))
    mean, rstd = (np.asarray(a, np.float64)[:, None] for a in (mean, rstd))
    M, C = x.shape
    xh = (x - mean) * rstd
    g = dy * w
    t1, t2 = g.sum(1), (g * xh).sum(1)
    c1, c2 = np.empty(M), np.empty(M)
    for b in range(G):
        c1[b::G], c2[b::G] = np.cumsum(t1[b::G]), np.cumsum(t2[b::G])
    return rstd * (g - c1[:, None] / C - xh * c2[:, None] / C)


def ex13_1(kernel) -> None:
    """``kernel(dy, x, w, mean, rstd, dx)``: a @cuda.jit kernel launched [G, 128] with G <= M
    (fewer blocks than rows in some cases): block b takes rows b, b + G, b + 2G, ..., its 128
    threads share the row's C columns. dy, x, dx (M, C) float32, w (C,), mean and rstd (M,) the
    forward's saved statistics. It writes dx = rstd * (g - mean_c(g) - xhat * mean_c(g xhat)),
    g = w * dy, xhat = (x - mean) * rstd, the two row sums reduced in shared memory. The
    inputs must not change.

    Each case of ``LN13_CASES`` (and ``LN13_GPU_CASES`` on a GPU) twice, with fresh inputs,
    against the float64 reference (tolerance relative to the size of dx's terms); shared memory
    NaN-filled in the simulator; on a GPU, the answer graded again in the simulator."""
    ex = "ex13.1"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    z2, z1 = np.zeros((2, 3), np.float32), np.zeros(3, np.float32)
    refuse_host_code(ex, kernel, (z2, z2, z1, z1[:2], z1[:2], z2))  # a barrier in a branch too
    rng, seed = fresh_rng()
    cases = {**LN13_CASES, **({} if env.SIM else LN13_GPU_CASES)}
    plain_ok = False                      # an ordinary case has passed
    with poisoned_memory():
        for rep in range(2):
            for what, (M, C, G, kind) in cases.items():
                case = f"{what} (M={M}, C={C}, grid {G}; seed {seed}, call {rep + 1})"
                dy, x, w, mean, rstd = _ln_inputs(rng, M, C, kind)
                _ln13_case(ex, case, kernel, dy, x, w, mean, rstd, G, kind, plain_ok)
                plain_ok |= kind == "plain"
    simulate(ex, "ex13_1", [("layernorm_backward", kernel)], hint=_LN13_SYNC)
    passed(ex)


def _ln13_launch(kernel, args, dx, G: int) -> None:
    kernel[G, LN13_THREADS](*args, dx)


def _ln13_case(ex, case, kernel, dy, x, w, mean, rstd, G, kind, plain_ok) -> None:
    M, C = x.shape
    # a column loop without its guard reads the zero tail on a GPU instead of faulting
    args = tuple(padded(a, 2 * LN13_THREADS) for a in (dy, x, w)) + (padded(mean, G),
                                                                      padded(rstd, G))
    dx, buf = guarded((M, C))
    call(ex, case, lambda: _ln13_launch(kernel, args, dx, G))
    if not all(np.array_equal(to_numpy(d), h) for d, h in zip(args, (dy, x, w, mean, rstd))):
        raise GradeError(f"{ex}: {case}: the kernel changed its inputs (dy, x, w, mean or rstd): "
                         "keep the partial sums in registers and shared memory, and write dx "
                         "only")
    if not canary_ok(buf, M * C):
        raise GradeError(f"{ex}: {case}: wrote past the end of dx: guard the columns (j < C) "
                         "and the rows (row < M)")
    got = to_numpy(dx).astype(np.float64)
    parts = _ln_parts(dy, x, w, mean, rstd)
    ref, mag = parts["dx"], parts["mag_dx"]
    atol, rtol = LN_DX_TOL
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(got - ref) <= atol + rtol * mag)
    if not bad.any():
        return
    msg = f"{ex}: {case}: dx is wrong ({error_summary(got, ref, bad)})"
    if np.isnan(got).any():
        _ln13_nan(ex, case, msg, kernel, args, got, G)
    # the ordinary cases ran first and passed, so the formula is right: an answer wrong only here
    # loses digits to cancellation, whatever known mistake its noise happens to resemble
    if kind == "extreme" and plain_ok:
        raise GradeError(f"{msg}: {_LN_EXTREME}")
    hints = [("dx_no_mean_g", "the term -mean_c(w dy) is missing, the gradient through the "
              "row's mean (every x of the row moves it): " + _LN13_FORMULA),
             ("dx_no_xhat_term", "the term -xhat * mean_c(w dy xhat) is missing, the gradient "
              "through rstd (every x of the row moves the variance): " + _LN13_FORMULA),
             ("dx_no_gamma", "dy was used where g = w * dy belongs (y = w * xhat + b, so the "
              "gradient reaching xhat is w * dy): " + _LN13_FORMULA),
             ("dx_no_rstd", "the leading factor rstd is missing: " + _LN13_FORMULA),
             ("dx_by_threads", f"the means divide by the {LN13_THREADS} threads of the block; "
              f"they are means over the row's C = {C} columns"),
             ("dx_by_rows", f"dx is divided by M = {M}: dy is already the gradient of the loss "
              "(the 1/M of a mean loss is inside it); the means are over the columns only")]
    for key, hint in hints:
        if key == "dx_by_rows" and M == 1:
            continue
        if _ln_near(got, parts[key], mag):
            raise GradeError(f"{msg}: {hint}")
    if M > G and _ln_near(got, layernorm_rows_not_reset(dy, x, w, mean, rstd, G), mag):
        raise GradeError(f"{msg}: a block's first row is right and its later rows carry the "
                         "sums of the rows before: start each thread's partial sums from 0 "
                         "for every row (inside the row loop)")
    last = np.zeros(M, bool)
    last[max(M - G, 0):] = True           # the last row of each block: rows M - G .. M - 1
    rows_bad = bad.any(1)
    if M > G and rows_bad.any() and not rows_bad[last].any():
        raise GradeError(f"{msg}: {_LN13_REUSE}")
    _ln13_simulator_first(ex, msg, kernel)
    raise GradeError(f"{msg}: {_LN13_FORMULA}; or a race on s1 and s2: {_LN13_SYNC}")


def _ln13_nan(ex, case, msg, kernel, args, got, G) -> None:
    """NaN in dx: elements never written (which: rows past the grid, columns past the block),
    or NaN the kernel computed from shared memory nobody wrote. A second launch into a buffer
    filled with a number tells them apart."""
    M, C = got.shape
    again, _ = guarded((M, C))
    again.fill(1234.5)
    try:
        _ln13_launch(kernel, args, again, G)
        unwritten = to_numpy(again) == np.float32(1234.5)
    except Exception:  # noqa: BLE001 - the first run's NaN is the finding
        unwritten = np.isnan(got)
    if unwritten.all():
        raise GradeError(f"{ex}: {case}: dx never written (all NaN): is the body still the "
                         "stub?")
    if unwritten.any():
        rows = np.nonzero(unwritten.any(1))[0]
        cols = np.nonzero(unwritten.any(0))[0]
        if M > G and rows.min() >= G and unwritten[rows].all():
            raise GradeError(f"{msg}: rows {rows.min()}..{rows.max()} never written: the grid "
                             f"has G = {G} blocks for M = {M} rows, so block b takes rows b, "
                             "b + G, b + 2G, ...: for row in range(cuda.blockIdx.x, M, "
                             "cuda.gridDim.x)")
        if C > LN13_THREADS and cols.min() >= LN13_THREADS:
            raise GradeError(f"{msg}: the columns past the first {LN13_THREADS} never written: "
                             f"C = {C} is more than the block's threads, so each thread loops "
                             "j = tid, tid + 128, ... while j < C")
        raise GradeError(f"{msg}: {int(unwritten.sum())} elements never written (rows "
                         f"{rows.tolist()[:5]}): every column j < C of every row is written")
    if env.SIM:
        raise GradeError(f"{msg}: {_LN13_NAN}{_LN13_SYNC}")
    _ln13_simulator_first(ex, msg, kernel)
    raise GradeError(f"{msg}: dx holds NaN that the kernel computed: shared memory read before "
                     f"it was written (a missing barrier: {_LN13_SYNC}), or a division by 0?")


def _ln13_simulator_first(ex: str, msg: str, kernel) -> None:
    """On a GPU, values that fit no known mistake (a race gives such numbers, different on each
    run): the answer is graded again in the CUDA simulator, where a missing barrier shows the
    same way on every run, and its verdict, when it has one, becomes the message."""
    if env.SIM or not _race._enabled():
        return
    err = _race._simulate_run(ex, "ex13_1", [("layernorm_backward", kernel)])
    if err:
        raise GradeError(f"{msg}; graded again in the CUDA simulator (which runs a block's "
                         f"threads one at a time between barriers): {err}")


# ----------------------------------------------------------------------------- ex13.2
#: threads per block of ex13.2 (a thread per row)
XENT_THREADS = 32
#: case name -> (M rows, V words, Vp padded columns, kind)
XENT_CASES = {
    "37 rows (more than a block of 32), V = 50 words padded to Vp = 56": (37, 50, 56, "plain"),
    "one row of one word (V = 1) padded to 8": (1, 1, 8, "plain"),
    "no padding (V = Vp = 40)": (5, 40, 40, "plain"),
    "9 rows, 3 of them ignored (target -1), V = 21 padded to 24": (9, 21, 24, "ignored"),
    "logits near +1000": (4, 30, 32, "high"),
    "logits near -1000": (4, 30, 32, "low"),
}
_XENT_OVERFLOW = ("exp overflowed: subtract the row's maximum m before exp (z_j - m <= 0), and "
                  "add it back in the loss, log(sum_j exp(z_j - m)) + m - z_t")
_XENT_UNDERFLOW = ("every logit of the row is near -1000, so exp of it underflows to 0 (a sum "
                   "of 0, then log(0) or 0 / 0): start the running maximum at -inf "
                   "(-math.inf), not 0, so that z_j - m is 0 for the row's largest logit")
_XENT_CASE_HINTS = {"logits near +1000": _XENT_OVERFLOW, "logits near -1000": _XENT_UNDERFLOW}
_XENT_GRAD = "the gradient is g_j = scale * (p_j - [j == t]) with p_j = exp(z_j - m) / sum"
_XENT_PAD_SOFTMAX = ("the padding columns j >= V took part in the softmax: they are not words "
                     "(noise here, whatever the matmul left in a real step): the max, the sum "
                     "and p_j run over j < V only")
_XENT_IGNORED = ("a target of -1 marks an ignored row (PyTorch's ignore_index): its loss is 0 "
                 "and its whole gradient row 0, and it reads no logit (as an index, -1 reads the "
                 "row's last column)")


def xent_reference(z: np.ndarray, t: np.ndarray, V: int, scale: float,
                   over: int | None = None, onehot: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(losses, gradient) in float64 of logits ``z`` (M, Vp) and targets ``t`` (M,): the softmax
    over the first ``over`` columns (V; Vp for the padding-included mistake), loss
    logsumexp - z_t, gradient scale * (p - onehot) for j < V (``onehot`` False: scale * p, a
    mistake) and 0 after; rows with t == -1 give 0 and 0."""
    over = V if over is None else over
    z = np.asarray(z, np.float64)
    M, Vp = z.shape
    live = t >= 0
    zs = z[:, :over]
    m = zs.max(1, keepdims=True)
    e = np.exp(zs - m)
    d = e.sum(1, keepdims=True)
    rows = np.arange(M)
    zt = z[rows, np.where(live, t, 0)]
    loss = np.where(live, np.log(d[:, 0]) + m[:, 0] - zt, 0.0)
    g = np.zeros((M, Vp))
    g[:, :V] = (e / d)[:, :V]
    if onehot:
        g[rows[live], t[live]] -= 1.0
    g *= scale
    g[~live] = 0.0
    return loss, g


def _xent_inputs(rng, M: int, V: int, Vp: int, kind: str):
    """logits (M, Vp) float32 (noise in the padding), targets (M,) int32, scale float32."""
    z = 3 * rng.standard_normal((M, Vp))
    if kind in ("high", "low"):
        z[:, :V] += 1000.0 if kind == "high" else -1000.0
    t = rng.integers(0, V, M).astype(np.int32)
    if kind == "ignored":
        t[rng.permutation(M)[:3]] = -1
    scale = np.float32(1.0 / max(int((t >= 0).sum()), 1))
    return z.astype(np.float32), t, scale


def _near(got: np.ndarray, alt: np.ndarray) -> bool:
    """``got`` is a mistake's answer ``alt`` (the mistakes differ by whole terms)."""
    with np.errstate(invalid="ignore"):
        return bool(np.isfinite(alt).all() and (np.abs(got - alt) <= 1e-5 + 1e-3 * np.abs(alt))
                    .all())


def ex13_2(kernel) -> None:
    """``kernel(logits, targets, V, scale, losses)``: a @cuda.jit kernel launched
    [ceil(M / 32), 32], a thread per row i. logits (M, Vp) float32, of which columns j < V are
    the words and j >= V padding; targets (M,) int32 in [-1, V); scale float32; losses (M,)
    float32. It writes losses[i] = logsumexp(logits[i, :V]) - logits[i, t] and overwrites
    logits[i, j] with scale * (softmax_j - [j == t]) for j < V and 0 for j >= V; a row with
    t == -1 gets loss 0 and a gradient row of 0.

    Each case of ``XENT_CASES`` twice with fresh logits (a NaN canary after the logits and
    after losses), against float64; the hint of the mistake a wrong answer's values match."""
    ex = "ex13.2"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    z0 = np.zeros((2, 8), np.float32)
    refuse_host_code(ex, kernel, (z0, np.zeros(2, np.int32), 8, np.float32(1),
                                  np.zeros(2, np.float32)))
    rng, seed = fresh_rng()
    for rep in range(2):
        for what, (M, V, Vp, kind) in XENT_CASES.items():
            case = f"{what} (M={M}; seed {seed}, call {rep + 1})"
            z, t, scale = _xent_inputs(rng, M, V, Vp, kind)
            _xent_case(ex, case, kernel, z, t, V, scale, _XENT_CASE_HINTS.get(what))
    passed(ex)


def _xent_case(ex, case, kernel, z, t, V, scale, hint) -> None:
    M, Vp = z.shape
    lg, lbuf = guarded((M, Vp))
    lg[...] = to_device(z)
    # targets padded with zeros to the rows the grid covers: on a GPU a thread past the last row
    # without its guard reads target 0 instead of faulting, and its writes land in the canaries
    tg = padded(t, ceil_div(M, XENT_THREADS) * XENT_THREADS - M)
    losses, sbuf = guarded((M,))

    def run():
        try:
            kernel[ceil_div(M, XENT_THREADS), XENT_THREADS](lg, tg, V, scale, losses)
        except OverflowError:        # the simulator's math.exp raises where a GPU gives inf
            raise GradeError(f"{ex}: {case}: {_XENT_OVERFLOW}") from None
        except (ValueError, ZeroDivisionError) as e:   # log(0), 0 / 0 in the simulator
            if hint is None:
                raise
            raise GradeError(f"{ex}: {case}: raised {type(e).__name__} ({e}): {hint}") from None
    call(ex, case, run)
    if not canary_ok(lbuf, M * Vp):
        raise GradeError(f"{ex}: {case}: wrote past the end of logits: the guard i < M (the "
                         "grid rounds M up to whole blocks of 32), and j < Vp")
    if not canary_ok(sbuf, M):
        raise GradeError(f"{ex}: {case}: wrote past the end of losses: the guard i < M (the grid "
                         "rounds M up to whole blocks of 32)")
    if not np.array_equal(to_numpy(tg), t):
        raise GradeError(f"{ex}: {case}: the kernel changed targets: it is an input")
    g = to_numpy(lg).astype(np.float64)
    loss = to_numpy(losses).astype(np.float64)
    ref_loss, ref_g = xent_reference(z, t, V, float(scale))
    if np.isnan(loss).all() and np.array_equal(g, z):
        raise GradeError(f"{ex}: {case}: nothing written (losses all NaN, logits unchanged): is "
                         "the body still the stub?")
    z64 = z.astype(np.float64)
    if not (np.isfinite(g).all() and np.isfinite(loss).all()):
        if hint:
            raise GradeError(f"{ex}: {case}: inf or NaN in the result: {hint}")
        nan = np.isnan(loss)
        if nan.any():
            raise GradeError(f"{ex}: {case}: losses[{int(np.argmax(nan))}] never written "
                             f"({int(nan.sum())} of {M} rows): every row i < M writes its loss, "
                             "an ignored one 0")
        raise GradeError(f"{ex}: {case}: inf or NaN in the result: a sum of 0 (a maximum "
                         "started at 0), or a log of 0?")
    live = t >= 0
    ign = ~live
    if (loss[ign] != 0).any() or (g[ign] != 0).any():
        i = int(np.nonzero(ign & ((loss != 0) | (g != 0).any(1)))[0][0])
        left = " (its logits were left in place)" if np.array_equal(g[i], z64[i]) else ""
        raise GradeError(f"{ex}: {case}: row {i}, whose target is -1, has loss {loss[i]:.6g} "
                         f"and a gradient row that is not 0{left}: {_XENT_IGNORED}")
    pad = g[live][:, V:]
    if pad.size and (pad != 0).any():
        if np.array_equal(pad, z64[live][:, V:]):
            why = ("the padding columns j >= V still hold their logits: write 0 there (the "
                   "matmul of the backward reads the whole (M, Vp) gradient)")
        elif _near(pad, xent_reference(z, t, Vp, float(scale), over=Vp)[1][live][:, V:]):
            why = _XENT_PAD_SOFTMAX + ", and their gradient is 0"
        else:
            why = "the gradient of a padding column j >= V is 0"
        raise GradeError(f"{ex}: {case}: padding columns of the gradient are not 0: {why}")
    gl, rl = g[live][:, :V], ref_g[live][:, :V]
    gtol = (1e-6 * float(scale), 1e-4)
    if not close(gl, rl, *gtol).all():
        bad = ~close(g, ref_g, *gtol)
        p_only = xent_reference(z, t, V, float(scale), onehot=False)[1]
        for cand, why in (
                (xent_reference(z, t, V, float(scale), over=Vp)[1], _XENT_PAD_SOFTMAX),
                (p_only, "the one-hot term is missing: the target's column gets p_t - 1, the "
                         "others p_j (times scale)"),
                (ref_g / float(scale), f"the gradient is not multiplied by scale = "
                                       f"{float(scale):.6g} (the gradient of the mean loss)"),
                (-ref_g, "the gradient has the wrong sign: " + _XENT_GRAD)):
            if _near(gl, cand[live][:, :V]):
                raise GradeError(f"{ex}: {case}: gradient wrong ({error_summary(g, ref_g, bad)})"
                                 f": {why}")
        raise GradeError(f"{ex}: {case}: gradient wrong ({error_summary(g, ref_g, bad)}): "
                         f"{_XENT_GRAD}")
    mag = np.abs(z64).max(1) + np.abs(ref_loss)
    lbad = ~(np.abs(loss - ref_loss) <= 1e-5 + 3e-7 * mag)
    if lbad.any():
        rows = np.arange(M)
        after = np.where(live, ref_loss + z64[rows, np.maximum(t, 0)]
                         - ref_g[rows, np.maximum(t, 0)], 0.0)
        for cand, why in (
                (-ref_loss, "the loss has the wrong sign: it is logsumexp(z) - z_t = -log p_t, "
                            "never negative"),
                (after, "the loss read logits[i, t] after the gradient loop had overwritten it "
                        "with the target's gradient: read z_t into a register before the row "
                        "is written"),
                (xent_reference(z, t, V, float(scale), over=Vp)[0], _XENT_PAD_SOFTMAX),
                (ref_loss * float(scale), "the loss is multiplied by scale: scale belongs to "
                                          "the gradient only (losses holds each row's own "
                                          "loss)")):
            if _near(loss, cand):
                raise GradeError(f"{ex}: {case}: losses wrong "
                                 f"({error_summary(loss, ref_loss, lbad)}): {why}")
        raise GradeError(f"{ex}: {case}: losses wrong ({error_summary(loss, ref_loss, lbad)}): "
                         "losses[i] = log(sum_j<V exp(z_j - m)) + m - z_t")
