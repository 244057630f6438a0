"""Graders of Chapter 6, "A complete training pipeline on your own kernels".

ex06_1  Numba: softmax cross-entropy forward + backward fused, one thread per row   simulator
ex06_2  Numba: the bias gradient, a column sum with a shared-memory block            simulator
ex06_3  Numba: the AdamW update (weight decay, bias correction) for arrays of any strides  simulator
ex06_4  Python: a linear layer as a torch.autograd.Function through DLPack (gradcheck)  CPU or GPU
ex06_5  CUDA C++ via CuPy: the LayerNorm backward, dx by rows and dgamma, dbeta by columns  GPU

Every reference is PyTorch autograd (or torch.optim.AdamW) in float64. Besides the values, the
graders check that the answer is the reader's own work of the kind asked: a @cuda.jit kernel and
not one of the book's (``_need_kernel``, ``_book_file``); an AdamW update written by a kernel, not
by array code around one (``_watch_launches``); a Function that computes on the DLPack arrays, not
with torch (``_Bridge``, a TorchFunctionMode). In the simulator, shared memory starts NaN-filled
in every block and every barrier must be reached by every thread (``_strict_simulator``).

ex06_5 reads the answer's code first (``_cuda_ch06_07.rubric``, so on a CPU too): no library,
shared memory and a barrier. On a GPU it compares both kernels with the float64 reference
(``layernorm_backward_reference``) on ragged shapes, many rows and x near 1e4 with a spread of
1e-2, names the mistake a wrong answer's values match (a term of dx missing, sums scaled by
1/rows, a half-precision accumulator, ...) and ends with compute-sanitizer racecheck.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .. import env
from ..check import close, to_numpy
from ._core import (
    GradeError,
    call,
    canary_ok,
    ceil_div,
    error_summary,
    fresh_rng,
    guarded,
    need_gpu,
    need_launch,
    padded,
    passed,
    to_device,
    xp,
)
from ._cuda_ch06_07 import rubric
from ._race import simulate
from ._static import calls, mentions, python_code, refuse_stub

__all__ = ["ex06_1", "ex06_2", "ex06_3", "ex06_4", "ex06_5", "layernorm_backward_reference",
           "LN_THREADS", "LN_BLOCK", "LN_CASES"]

#: (atol, rtol) of a float32 gradient against the float64 reference
GRAD_TOL = (1e-6, 1e-4)


def _torch():
    import torch

    return torch


def _same(o: np.ndarray, r: np.ndarray, atol: float, rtol: float) -> bool:
    return o.shape == r.shape and bool(close(o, r, atol, rtol).all())


# ----------------------------------------------------------------------------- shared checks
def _need_kernel(ex: str, kernel) -> None:
    """GradeError unless ``kernel`` is a Numba @cuda.jit kernel of the reader's own: not a plain
    function, and not one of the book's kernels (kernels/*.py) handed in as the answer."""
    if not (hasattr(kernel, "py_func") and hasattr(kernel, "__getitem__")):
        raise GradeError(f"{ex}: expected a @cuda.jit kernel, got {type(kernel).__name__} "
                         f"{getattr(kernel, '__name__', '')!r}: decorate it with @cuda.jit")
    book = _book_file(kernel)
    if book:
        raise GradeError(f"{ex}: this is the book's own kernel {kernel.__name__} ({book}): the "
                         "exercise asks for a kernel you write")


def _book_file(fn) -> str | None:
    """The file under kernels/ or cudabook/ that defines ``fn`` (a kernel or function), else
    None: an answer that is, or launches, a kernel of the book itself."""
    f = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    code = getattr(f, "__code__", None)
    if code is None:
        return None
    from ..compile import KERNELS_DIR

    path = Path(code.co_filename).resolve()
    for top in (Path(KERNELS_DIR).resolve(), Path(__file__).resolve().parents[1]):
        if path.is_relative_to(top):
            return f"{top.name}/{path.relative_to(top)}"
    return None


class _SimFinding(GradeError):
    """A hazard the strict simulator found during a launch (the grader adds the case)."""


_SHARED_LOCK = threading.Lock()


@contextlib.contextmanager
def _strict_simulator(fill: float = np.nan) -> Iterator[None]:
    """In the CUDA simulator (nothing elsewhere): every block gets shared arrays of its own,
    filled with ``fill`` (NaN: a read of shared memory no thread wrote gives NaN, where a GPU
    gives whatever the last kernel left), and every block is checked to have reached the same
    barriers in the same order with all of its threads (a cuda.syncthreads() inside a branch
    that some threads skip is undefined behaviour on a GPU; the simulator would just let the
    others through). A violation raises ``_SimFinding`` from the launch."""
    if not env.SIM:
        yield
        return
    from numba import types
    from numba.cuda.simulator import kernel as simk
    from numba.cuda.simulator import kernelapi as api
    from numba.np import numpy_support

    orig_array, orig_sync, orig_run = (api.FakeCUDAShared.array, simk.BlockThread.syncthreads,
                                       simk.BlockManager.run)

    def array(self, shape, dtype):
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:                       # dynamic shared memory: as the simulator has it
            return orig_array(self, shape, dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        key = (caller, tuple(threading.current_thread().blockIdx))
        with _SHARED_LOCK:
            res = self._allocations.get(key)
            if res is None:
                res = np.empty(shape, dtype)
                if res.dtype.kind in "fc":
                    res.fill(fill)
                self._allocations[key] = res
        return res

    def syncthreads(self):
        where = sys._getframe(2)             # the kernel's line that called cuda.syncthreads()
        sites = self._manager.__dict__.setdefault("_cb_sites", {})
        sites.setdefault(self.thread_id, []).append(where.f_lineno)
        return orig_sync(self)

    def run(self, grid_point, *args):
        out = orig_run(self, grid_point, *args)
        sites = self.__dict__.pop("_cb_sites", {})
        n = int(np.prod(self._block_dim))
        if sites and (len(sites) < n or len({tuple(v) for v in sites.values()}) > 1):
            most = max(len(v) for v in sites.values())
            full = sum(1 for v in sites.values() if len(v) == most)
            raise _SimFinding(f"in block {tuple(int(v) for v in grid_point)} only {full} of the "
                              f"block's {n} threads reached every cuda.syncthreads(): a barrier "
                              "inside a branch that some threads skip (or leave early)")
        return out

    api.FakeCUDAShared.array, simk.BlockThread.syncthreads = array, syncthreads
    simk.BlockManager.run = run
    try:
        yield
    finally:
        api.FakeCUDAShared.array, simk.BlockThread.syncthreads = orig_array, orig_sync
        simk.BlockManager.run = orig_run


class _LaunchLog:
    """What an answer's launcher did: the kernels it launched, and whether the watched arrays
    changed outside those launches (array code between, before or after them)."""

    def __init__(self, arrays: dict[str, Any]):
        self.arrays = arrays
        self.kernels: list[Any] = []
        self.outside: list[str] = []          # names of arrays changed outside a launch
        self._last = self._state()

    def _state(self) -> dict[str, np.ndarray]:
        return {k: np.array(to_numpy(a), copy=True) for k, a in self.arrays.items()}

    def _compare(self) -> dict[str, np.ndarray]:
        now = self._state()
        for k, a in now.items():
            if not np.array_equal(a, self._last[k], equal_nan=True) and k not in self.outside:
                self.outside.append(k)
        return now

    def before(self, kernel) -> None:
        self.kernels.append(kernel)
        self._last = self._compare()

    def after(self) -> None:
        self._last = self._state()

    def finish(self) -> None:
        self._last = self._compare()


@contextlib.contextmanager
def _watch_launches(arrays: dict[str, Any]) -> Iterator[_LaunchLog]:
    """Log every Numba kernel launch made inside the block, with the state of ``arrays`` before
    and after each, on a GPU and in the simulator (as ``count_launches`` counts them)."""
    log = _LaunchLog(arrays)
    if env.SIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel as cls

        attr = "__call__"
    else:
        from numba.cuda.dispatcher import CUDADispatcher as cls

        attr = "call"
    orig = getattr(cls, attr)

    def logged(self, *a, **k):
        if getattr(self, "_device", False):
            return orig(self, *a, **k)
        log.before(self)
        try:
            return orig(self, *a, **k)
        finally:
            if not env.SIM:
                import cupy

                cupy.cuda.Device().synchronize()
            log.after()

    setattr(cls, attr, logged)
    try:
        yield log
    finally:
        setattr(cls, attr, orig)
    log.finish()


# ----------------------------------------------------------------------------- ex06.1
CE_THREADS = 32
_EPS32 = float(np.finfo(np.float32).eps)


def _ce_reference(z: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    torch = _torch()
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(zt, torch.tensor(labels, dtype=torch.int64))
    (dz,) = torch.autograd.grad(loss, zt)
    return float(loss.detach()), dz.numpy()


#: ex06.1's cases at extreme values, each with the mistake it exposes (in this order: an answer
#: with that mistake passes every case before its own)
_CE_EXTREME = {
    "logits near 1000": "exp overflowed: subtract the row's maximum before exp (z - max <= 0), "
                        "and use the same max in the loss, log(sum) + max - z[y]",
    "one logit 1000 above the rest, the labels elsewhere": "the label's probability underflows "
                        "to 0 there (its logit is 1000 below the row's maximum), and log(0) is "
                        "-inf: compute the loss as log(s) + m - z[r, y], never as log(p_y)",
    "every logit near -1000": "with every logit near -1000, a maximum started at 0 (instead of "
                        "z[r, 0]) stays 0, every exp(z - 0) underflows to 0 and s = 0: start "
                        "the maximum from the row's first logit",
}


def _ce_cases(rng) -> list[tuple[str, np.ndarray, np.ndarray]]:
    out = []
    for M, C in ((3, 7), (37, 13), (CE_THREADS + 1, 10), (1, 40)):
        z = (rng.standard_normal((M, C)) * 3).astype(np.float32)
        out.append((f"M={M}, C={C}", z, rng.integers(0, C, M).astype(np.int32)))
    M, C = 5, 20
    for what in _CE_EXTREME:
        z = rng.standard_normal((M, C)) * 3
        labels = rng.integers(0, C, M)
        if what == "logits near 1000":
            z += 1000.0                       # exp(1000) overflows float32 and float64
        elif what.startswith("one logit"):
            z[:, 3] += 1000.0
            labels = (3 + rng.integers(1, C, M)) % C          # never column 3
        else:
            z -= 1000.0                       # exp(-1000) underflows to 0
        out.append((f"{what} (M={M}, C={C})", z.astype(np.float32), labels.astype(np.int32)))
    return out


def _ce_hint(what: str) -> str | None:
    """The mistake an extreme case exposes (None for the ordinary cases)."""
    return next((h for k, h in _CE_EXTREME.items() if what.startswith(k)), None)


def ex06_1(kernel) -> None:
    """``kernel(z, labels, loss, dz)``: a @cuda.jit kernel, one thread per row of the (M, C)
    float32 logits ``z``, launched [ceil(M / 32), 32]. It adds the row's loss divided by M to
    ``loss[0]`` (zeroed by the grader) with ``cuda.atomic.add`` and writes the gradient of the
    MEAN loss, (softmax(z_r) - onehot(y_r)) / M, to ``dz``. ``z`` must not change.

    Ordinary cases (ragged M and C, one row, more rows than a block), then extreme logits: near
    1000 (exp overflows), one logit 1000 above the label's (its probability underflows), all near
    -1000 (a maximum started at 0 makes every exp underflow).
    """
    ex = "ex06.1"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    code = python_code(ex, kernel)
    if not calls(code, "atomic.add"):
        raise GradeError(f"{ex}: the kernel never calls cuda.atomic.add: every row's thread adds "
                         "its share to loss[0], and a plain loss[0] += ... (or =) from many "
                         "threads loses updates; use cuda.atomic.add(loss, 0, value)")
    rng, seed = fresh_rng()
    m = xp()
    for rep in range(2):
        for what, z, labels in _ce_cases(rng):
            M, C = z.shape
            case = f"{what} (seed {seed}, call {rep + 1})"
            hint = _ce_hint(what)
            ref_loss, ref_dz = _ce_reference(z, labels)
            # padded to the rows the launch covers: a kernel without its guard reads zeros
            # (labels 0) on a GPU instead of faulting; its writes land in dz's canary
            extra = ceil_div(M, CE_THREADS) * CE_THREADS - M
            z_d, y_d = padded(z, extra * C), padded(labels, extra)
            loss = m.zeros(1, dtype=np.float32)
            dz, buf = guarded((M, C))

            def run(z_d=z_d, loss=loss, dz=dz, y_d=y_d, M=M, case=case, hint=hint):
                try:
                    kernel[ceil_div(M, CE_THREADS), CE_THREADS](z_d, y_d, loss, dz)
                except OverflowError:   # the simulator's math.exp raises where a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: subtract the row's maximum "
                                     "before exp (z - max <= 0), and use the same max in the "
                                     "loss, log(sum) + max - z[y]") from None
                except (ValueError, ZeroDivisionError) as e:   # log(0), x / 0 in the simulator
                    if hint is None:
                        raise
                    raise GradeError(f"{ex}: {case}: raised {type(e).__name__} ({e}): "
                                     f"{hint}") from None
            call(ex, case, run)
            if not np.array_equal(to_numpy(z_d), z):
                raise GradeError(f"{ex}: {case}: the logits z changed: the kernel writes into "
                                 "its input (in place). dz is a separate output; z must stay "
                                 "as it was (autograd may still need it, and the gradient of "
                                 "a row is computed from all of its z)")
            if not canary_ok(buf, M * C):
                raise GradeError(f"{ex}: {case}: wrote past the end of dz: missing bounds guard "
                                 "(if r < M)?")
            o = to_numpy(dz).astype(np.float64)
            lv = float(to_numpy(loss)[0])
            nan = np.isnan(o)
            if nan.all() and hint is None:
                raise GradeError(f"{ex}: {case}: dz never written (all NaN): the stub's body, "
                                 "or no thread reached the write?")
            if (nan.any() or not np.isfinite(o).all() or not np.isfinite(lv)) and hint:
                raise GradeError(f"{ex}: {case}: inf or NaN in the result: {hint}")
            if nan.any():
                r, j = (int(v) for v in np.argwhere(nan)[0])
                raise GradeError(f"{ex}: {case}: dz[{r}, {j}] never written ({int(nan.sum())} "
                                 "of dz's elements): every element of the row gets "
                                 "p - [j == y], the label's column too")
            if not np.isfinite(o).all() or not np.isfinite(lv):
                raise GradeError(f"{ex}: {case}: inf or NaN in the result: a division by a zero "
                                 "sum?")
            atol, rtol = GRAD_TOL
            if not _same(o, ref_dz, atol, rtol):
                if M > 1 and _same(o, ref_dz * M, atol * M, rtol):
                    raise GradeError(f"{ex}: {case}: dz is {M}x the reference: the gradient of "
                                     "the SUM of the row losses; the loss is the mean over the "
                                     f"M = {M} rows, so scale by 1/M")
                if M > 1 and _same(o, ref_dz / M, atol / M, rtol):
                    raise GradeError(f"{ex}: {case}: dz is 1/{M} of the reference: divided by "
                                     "M twice?")
                if _same(-o, ref_dz, atol, rtol):
                    raise GradeError(f"{ex}: {case}: dz has the wrong sign: it is "
                                     "(p - onehot) / M, softmax minus the one-hot label")
                bad = ~close(o, ref_dz, atol, rtol)
                raise GradeError(f"{ex}: {case}: dz wrong: {error_summary(o, ref_dz, bad)}; "
                                 "dz[r, j] = (exp(z[r, j] - max) / sum - [j == y[r]]) / M")
            # float32 rounds log(s) + m at the logits' magnitude (6e-5 near 1000)
            tol = 1e-6 + 1e-5 * abs(ref_loss) + 2 * _EPS32 * float(np.abs(z).max())
            if abs(lv - ref_loss) > tol:
                if M > 1 and abs(lv - M * ref_loss) <= M * tol:
                    raise GradeError(f"{ex}: {case}: loss {lv:.6g} is the SUM of the row losses "
                                     f"(the mean is {ref_loss:.6g}): add each row's loss / M")
                shift = float(z.astype(np.float64).max(1).mean())
                if abs(shift) > 10 * tol and abs(lv - (ref_loss - shift)) <= tol + 1e-5 * abs(
                        shift):
                    raise GradeError(f"{ex}: {case}: loss {lv:.6g}, expected {ref_loss:.6g}: off "
                                     "by the mean of the rows' maxima; a row's loss is "
                                     "log(sum of exp(z - m)) + m - z[y]: add m back")
                raise GradeError(f"{ex}: {case}: loss {lv:.6g}, expected {ref_loss:.6g}: a row "
                                 "adds (log(sum of exp(z - max)) + max - z[y]) / M to loss[0] "
                                 "with cuda.atomic.add (a plain += races between threads)")
    passed(ex)


# ----------------------------------------------------------------------------- ex06.2
BG_BLOCK = (32, 4)      # (columns, row groups) of ex06.2's block
_BG_SYNC_HINT = ("a cuda.syncthreads() between writing the partial sums to shared memory and "
                 "reading them")


_BG_BARRIER_HINT = ("every thread of the block must reach every cuda.syncthreads(): keep it "
                    "outside `if j < N` (a thread of a column past N writes a partial of 0)")
_BG_UNINIT_HINT = ("the sums are right only if shared memory starts at 0, and it does not (the "
                   "grader fills it with NaN; a GPU leaves whatever was there): start each "
                   "partial from 0 in a register, or set part[ty, tx] = 0 before adding to it")
_BG_EARLY_HINT = ("thread row 0 reads partials before the other rows have written them (the grader "
                  "fills shared memory with NaN; a GPU leaves whatever was there): is "
                  f"{_BG_SYNC_HINT} missing, or placed after the reads?")


def ex06_2(kernel) -> None:
    """``kernel(dz, db)``: a @cuda.jit kernel launched [ceil(N / 32), (32, 4)] on the (M, N)
    float32 ``dz``: db[j] = sum over the M rows of dz[:, j]. Thread (tx, ty) of block bx owns
    column j = 32 bx + tx and rows ty, ty + 4, ...; the 4 partial sums meet in shared memory.

    In the simulator, shared memory starts NaN-filled in every block and every barrier must be
    reached by all of the block's threads (``_strict_simulator``); on a GPU the same checks run
    in a simulator subprocess after the value checks (``simulate``).
    """
    ex = "ex06.2"
    _need_kernel(ex, kernel)
    refuse_stub(ex, kernel)
    code = python_code(ex, kernel)
    if not mentions(code, "shared.array"):
        raise GradeError(f"{ex}: the kernel has no shared array: the 4 thread rows of a block "
                         "add their partial sums of a column through part = "
                         "cuda.shared.array((4, 32), float32), not through atomics on db or "
                         "one thread walking the whole column")
    if not calls(code, "syncthreads"):
        raise GradeError(f"{ex}: the kernel never calls cuda.syncthreads(): thread row 0 would "
                         f"read partials the other rows have not written yet; add "
                         f"{_BG_SYNC_HINT}")
    atomics = calls(code, "atomic.add") > 0
    rng, seed = fresh_rng()
    # square first: a transposed index gives the row sums there (on other shapes it reads out
    # of range); then non-square shapes, more columns than one block, a single row
    sizes = [(33, 33), (37, 45), (45, 37), (6, 70), (1, 5)]
    if not env.SIM:
        sizes += [(1000, 33), (4096, 1024)]
    for rep in range(2):
        for M, N in sizes:
            case = f"dz of M={M} rows x N={N} columns (seed {seed}, call {rep + 1})"
            dz = rng.standard_normal((M, N)).astype(np.float32)
            ref = dz.astype(np.float64).sum(0)
            # a missing column guard or a transposed index reads the zero tail on a GPU
            big = max(M, N)
            dz_d = padded(dz, big * (big + BG_BLOCK[0]))

            def launch(fill: float, dz_d=dz_d, N=N, case=case):
                db, buf = guarded((N,))

                def run():
                    try:
                        with _strict_simulator(fill):
                            kernel[ceil_div(N, BG_BLOCK[0]), BG_BLOCK](dz_d, db)
                    except _SimFinding as e:
                        raise GradeError(f"{ex}: {case}: {e}; {_BG_BARRIER_HINT}") from None
                    except IndexError as e:
                        raise GradeError(f"{ex}: {case}: index out of range ({e}): missing "
                                         "guard (j < N) on the column, or dz indexed [column, "
                                         "row]? dz is (M, N): dz[i, j] with i the row, j = the "
                                         "column") from None
                call(ex, case, run)
                return db, buf

            db, buf = launch(np.nan)
            if not canary_ok(buf, N):
                raise GradeError(f"{ex}: {case}: wrote past the end of db: missing guard "
                                 "(if j < N) before the write?")
            o = to_numpy(db).astype(np.float64)
            nan = np.isnan(o)
            if nan.any() and env.SIM:
                zero = to_numpy(launch(0.0)[0]).astype(np.float64)
                if not np.isnan(zero).any():
                    j = int(np.argmax(nan))
                    why = (_BG_UNINIT_HINT if _same(zero, ref, 1e-4 * max(1.0, np.sqrt(M)), 1e-5)
                           else _BG_EARLY_HINT)
                    raise GradeError(f"{ex}: {case}: db[{j}] is NaN, but not when shared memory "
                                     f"starts at 0: {why}")
            if nan.all() and atomics:
                raise GradeError(f"{ex}: {case}: db stays NaN: cuda.atomic.add adds to what db "
                                 "holds, and db is not zeroed (the grader fills it with NaN; a "
                                 "GPU buffer holds garbage). Let thread row 0 write db[j] = the "
                                 "sum of the 4 partials")
            if nan.all():
                raise GradeError(f"{ex}: {case}: db never written (all NaN)")
            if nan.any():
                j = int(np.argmax(nan))
                raise GradeError(f"{ex}: {case}: db[{j}] never written: is every column covered "
                                 "(the grid has ceil(N / 32) blocks of 32 columns)?")
            atol, rtol = 1e-4 * max(1.0, np.sqrt(M)), 1e-5
            if _same(o, ref, atol, rtol):
                continue
            if M > 1 and _same(o, ref / M, atol / M, rtol):
                raise GradeError(f"{ex}: {case}: db is the MEAN of each column (1/{M} of the sum): "
                                 "a bias gradient is the SUM over the batch rows (the 1/M of a "
                                 "mean loss is already inside dz)")
            rows = dz.astype(np.float64).sum(1)
            if N <= M and _same(o, rows[:N], atol, rtol):
                raise GradeError(f"{ex}: {case}: db holds the sums of the ROWS of dz (a "
                                 "transposition): db[j] sums column j, dz[:, j], over the M rows")
            bad = ~close(o, ref, atol, rtol)
            part = [dz[t::BG_BLOCK[1]].astype(np.float64).sum(0) for t in range(BG_BLOCK[1])]
            if any(_same(o, p, atol, rtol) for p in part):
                raise GradeError(f"{ex}: {case}: db is the partial sum of one thread row only: "
                                 "add the 4 partials from shared memory before writing; or is "
                                 f"{_BG_SYNC_HINT} missing?")
            if M > 1 and _same(o, ref + part[0], atol, rtol):
                raise GradeError(f"{ex}: {case}: db counts the partial of thread row 0 twice: "
                                 "the total starts from part[0, tx] and the loop over the "
                                 "partials starts at 0 again?")
            raise GradeError(f"{ex}: {case}: db wrong: {error_summary(o, ref, bad)}. Rows "
                             "skipped or counted twice (thread row ty adds rows ty, ty + 4, ...), "
                             "shared memory read before it was written, or "
                             f"{_BG_SYNC_HINT} missing?")
    simulate(ex, "ex06_2", [("bias_grad", kernel)], hint=_BG_SYNC_HINT)
    passed(ex)


# ----------------------------------------------------------------------------- ex06.3
ADAMW_HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _adamw_torch(p0: np.ndarray, grads: list[np.ndarray], **hp) -> list[np.ndarray]:
    torch = _torch()
    p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], **hp, foreach=False)
    out = []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def _adamw_variant(p0, grads, *, correct=True, decoupled=True, decay=True, keep=True,
                   eps_at="after", lr, betas, eps, weight_decay):
    """AdamW by hand with one thing changed (the mistakes ex06.3 names). ``eps_at``: where eps
    goes, "after" the bias-corrected square root (torch), "inside" it, or "before" the
    correction."""
    b1, b2 = betas
    p, m, v, out = p0.copy(), np.zeros_like(p0), np.zeros_like(p0), []
    wd = weight_decay if decay else 0.0
    for t, g in enumerate(grads, start=1):
        if not keep:
            m, v = np.zeros_like(p0), np.zeros_like(p0)
        if not decoupled:
            g = g + wd * p
        else:
            p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if correct:
            bc2 = 1 - b2 ** t
            denom = {"after": np.sqrt(v) / np.sqrt(bc2) + eps,
                     "inside": np.sqrt(v / bc2 + eps),
                     "before": (np.sqrt(v) + eps) / np.sqrt(bc2)}[eps_at]
            p = p - lr / (1 - b1 ** t) * m / denom
        else:
            p = p - lr * m / (np.sqrt(v) + eps)
        out.append(p)
    return out


#: ex06.3's cases: (rows, columns, layout, gradient scale); "mixed" draws each gradient element
#: from 1e-9 to 1e3, where sqrt(v) falls below eps and the place of eps decides the step
_ADAMW_CASES = [(7, 5, "contiguous", "normal"), (3, 40, "transposed view", "normal"),
                (5, 18, "contiguous", "mixed")]

_ADAMW_HINTS = [
    (dict(correct=False), "no bias correction: divide m by 1 - beta1^t and v by 1 - beta2^t (at "
     "step 1 m is 10x too small without it)"),
    (dict(decoupled=False), "the weight decay is added to the gradient (Adam + L2); AdamW decays "
     "the parameter itself: p *= 1 - lr * weight_decay"),
    (dict(decay=False), "no weight decay: p *= 1 - lr * weight_decay first"),
    (dict(eps_at="inside"), "eps is inside the square root: torch adds it after, to "
     "sqrt(v) / sqrt(1 - beta2^t) (it matters where sqrt(v) is below eps)"),
    (dict(eps_at="before"), "eps is added before the bias correction: torch divides sqrt(v) by "
     "sqrt(1 - beta2^t) first and adds eps to the result (it matters where sqrt(v) is below "
     "eps)"),
]


def _grads(rng, shape, scale: str) -> np.ndarray:
    g = rng.standard_normal(shape)
    return g * 10.0 ** rng.uniform(-9, 3, shape) if scale == "mixed" else g


def ex06_3(adamw_update: Callable) -> None:
    """``adamw_update(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay)`` updates the 2D
    float64 arrays p, m, v in place at step t (1 at the first step), as torch.optim.AdamW
    does, with a Numba kernel that writes p, m and v itself (array code in the launcher that
    changes them, a copy written back included, does not count; nor does a kernel of the book);
    the arrays may be views with any strides (a transposed weight). Three steps from the same
    start, step 1 included, against torch.optim.AdamW in float64, on gradients of ordinary size
    and on gradients from 1e-9 to 1e3 (where the place of eps matters).
    """
    ex = "ex06.3"
    rng, seed = fresh_rng()
    hp = ADAMW_HP
    args = dict(lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                weight_decay=hp["weight_decay"])
    for R, C, layout, scale in _ADAMW_CASES:
        case = f"{R}x{C} parameters, {layout}" + (
            ", gradients from 1e-9 to 1e3" if scale == "mixed" else "") + f" (seed {seed})"
        p0 = rng.standard_normal((R, C))
        grads = [_grads(rng, (R, C), scale) for _ in range(3)]
        ref = _adamw_torch(p0, grads, **hp)
        if layout == "contiguous":
            views = [to_device(a.copy()) for a in (p0, np.zeros((R, C)), np.zeros((R, C)))]
        else:   # arrays stored (C, R), handed over as their transposes: (R, C) views
            dev = [to_device(np.ascontiguousarray(a.T)) for a in
                   (p0, np.zeros((R, C)), np.zeros((R, C)))]
            views = [a.T for a in dev]
        p, m, v = views
        for t, g in enumerate(grads, start=1):
            gd = to_device(g) if layout == "contiguous" else \
                to_device(np.ascontiguousarray(g.T)).T
            where = f"{case}, step {t}"

            def run(t=t, gd=gd, where=where):
                try:
                    adamw_update(p, gd, m, v, t, **args)
                except ZeroDivisionError:
                    raise GradeError(f"{ex}: {where}: division by zero: at step t = 1 the "
                                     "corrections are 1 - beta^1, not 1 - beta^0 = 0: t counts "
                                     "from 1") from None
            with _watch_launches({"p": p, "m": m, "v": v}) as log:
                call(ex, where, run)
            if not log.kernels and "p" not in log.outside:
                raise GradeError(f"{ex}: {where}: p did not change, and no kernel was launched: "
                                 "launch adamw_kernel on a 2D grid that covers p")
            need_launch(ex, where, len(log.kernels), "a Numba kernel that updates p, m and v "
                        "(one element per thread)")
            book = next((f for f in map(_book_file, log.kernels) if f), None)
            if book:
                raise GradeError(f"{ex}: {where}: the update launches a kernel of the book "
                                 f"({book}): the exercise asks for a kernel you write")
            o = to_numpy(p).astype(np.float64)
            r = ref[t - 1]
            if _same(o, r, 1e-12, 1e-9):
                if log.outside:
                    raise GradeError(f"{ex}: {where}: {', '.join(log.outside)} changed outside "
                                     "the kernel (array code in the launcher, or a copy written "
                                     "back): the kernel must update p, m and v itself, in place "
                                     "on the 2D views (cuda.grid(2), p[i, j]), which works for "
                                     "any strides")
                continue
            before = p0 if t == 1 else ref[t - 2]
            if np.array_equal(o, before):
                if layout != "contiguous":
                    raise GradeError(f"{ex}: {where}: p did not change. It is a transposed "
                                     "view (not C-contiguous): p.ravel() / reshape(-1) of it "
                                     "is a COPY, and the update went into the copy. Index "
                                     "the 2D arrays (cuda.grid(2), p[i, j]), which works for "
                                     "any strides")
                raise GradeError(f"{ex}: {where}: p did not change: is the kernel launched, "
                                 "and does it write p in place?")
            if not np.isfinite(o).all():
                raise GradeError(f"{ex}: {where}: inf or NaN in p: at step t = 1 the "
                                 "corrections are 1 - beta^1 (not 1 - beta^0 = 0): t "
                                 "counts from 1")
            hist = grads[:t]
            fits = [hint for kw, hint in _ADAMW_HINTS
                    if _same(o, _adamw_variant(p0, hist, **kw, **hp)[-1], 1e-12, 1e-9)]
            if len(fits) == 1:
                raise GradeError(f"{ex}: {where}: {fits[0]}")
            if len(fits) > 1:
                # at step 1 Adam's step is about lr * sign(g), so Adam + L2 and no decay can
                # give the same p; the moments they carry differ, and so does the next step
                if t < len(grads):
                    continue
                raise GradeError(f"{ex}: {where}: one of: " + "; or ".join(fits))
            if t > 1 and _same(o, _adamw_variant(p0, hist, keep=False, **hp)[-1], 1e-12,
                               1e-9):
                raise GradeError(f"{ex}: {where}: p is what AdamW gives when m and v restart "
                                 "from zero at every step: are m and v updated in place "
                                 "(the moments carry over between steps)?")
            bad = ~close(o, r, 1e-12, 1e-9)
            raise GradeError(f"{ex}: {where}: p wrong: {error_summary(o, r, bad)}")
    passed(ex)


# ----------------------------------------------------------------------------- ex06.4
#: torch functions that compute (the Function must compute on arrays), by name without
#: underscores: torch.matmul, Tensor.__matmul__ (shown as matmul), x.sum(), a + b ...
_TORCH_COMPUTE = {"matmul", "rmatmul", "imatmul", "mm", "addmm", "bmm", "baddbmm", "mv", "addmv",
                  "dot", "vdot", "einsum", "tensordot", "linear", "outer", "inner", "add", "radd",
                  "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "div", "truediv",
                  "rtruediv", "itruediv", "neg", "sum", "nansum", "mean", "cumsum", "addcmul",
                  "addcdiv", "chainmatmul", "multidot"}
#: torch functions that copy a tensor out of torch (the Function must see it through DLPack)
_TORCH_COPY = {"numpy", "tolist", "cpu", "array", "item"}


class _Bridge:
    """While active: every call of torchops.as_array / as_tensor (their arguments and results),
    and every torch function the answer calls outside them (a TorchFunctionMode on this
    thread)."""

    def __init__(self):
        self.arrays_of: list[Any] = []       # the tensors handed to as_array
        self.made: list[Any] = []            # the tensors as_tensor returned
        self.compute: list[str] = []         # torch functions that compute, in call order
        self.copies: list[str] = []          # torch functions that copy out of torch
        self._inside = 0

    def saw(self, t) -> bool:
        """as_array was called on ``t`` (or on a tensor equal to it)."""
        torch = _torch()
        return any(a is t or (tuple(a.shape) == tuple(t.shape) and a.device == t.device
                              and torch.equal(a.detach(), t.detach())) for a in self.arrays_of)

    def made_by_as_tensor(self, t) -> bool:
        return any(m.data_ptr() == t.data_ptr() and m.numel() == t.numel() for m in self.made)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from torch.overrides import TorchFunctionMode

        from .. import torchops

        bridge = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if not bridge._inside:
                    name = getattr(func, "__name__", "").strip("_").rstrip("_").lower()
                    if name in _TORCH_COMPUTE:
                        bridge.compute.append(name)
                    elif name in _TORCH_COPY:
                        bridge.copies.append(name)
                return func(*args, **(kwargs or {}))

        orig = {k: getattr(torchops, k) for k in ("as_array", "as_tensor")}

        def as_array(t, *a, **kw):
            self.arrays_of.append(t)
            self._inside += 1
            try:
                return orig["as_array"](t, *a, **kw)
            finally:
                self._inside -= 1

        def as_tensor(arr, *a, **kw):
            self._inside += 1
            try:
                out = orig["as_tensor"](arr, *a, **kw)
            finally:
                self._inside -= 1
            self.made.append(out)
            return out

        torchops.as_array, torchops.as_tensor = as_array, as_tensor
        try:
            with Mode():
                yield
        finally:
            torchops.as_array, torchops.as_tensor = orig["as_array"], orig["as_tensor"]


def _bridge_rubric(ex: str, case: str, where: str, br: _Bridge, need: dict[str, Any],
                   results: dict[str, Any]) -> None:
    """GradeError unless ``where`` (forward or backward) computed on arrays: no torch arithmetic,
    no copies out of torch, as_array on each tensor of ``need``, and each tensor of ``results``
    made by as_tensor."""
    if br.compute:
        ops = ", ".join(dict.fromkeys(br.compute))
        raise GradeError(f"{ex}: {case}: {where} computes with torch operations ({ops}): the "
                         "exercise asks for the arithmetic on the arrays torchops.as_array "
                         "gives (NumPy or CuPy: xa @ Wa + ba, d.sum(0)); calling as_array as "
                         "well does not make torch arithmetic count")
    if br.copies:
        ops = ", ".join(f".{c}()" if c != "array" else "np.asarray" for c in
                        dict.fromkeys(br.copies))
        raise GradeError(f"{ex}: {case}: {where} copies tensors out of torch ({ops}): see "
                         "their memory through DLPack with torchops.as_array (no copy; "
                         ".numpy() cannot even read a GPU tensor)")
    missing = [k for k, t in need.items() if not br.saw(t)]
    if missing:
        raise GradeError(f"{ex}: {case}: {where} never called torchops.as_array on "
                         f"{', '.join(missing)}: compute on arrays seen through DLPack "
                         "(as_array), not with torch operations")
    for k, t in results.items():
        if t is not None and isinstance(t, _torch().Tensor) and not br.made_by_as_tensor(t):
            raise GradeError(f"{ex}: {case}: {where}'s {k} is not a tensor made by "
                             "torchops.as_tensor from your array (torch.from_numpy, "
                             "torch.tensor or torch.as_tensor copy or bypass the bridge): "
                             "return torchops.as_tensor(result)")


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def ex06_4(Linear: Any) -> None:
    """``Linear``: a torch.autograd.Function with forward(ctx, x, W, b) = x @ W + b for x (M, K),
    W (K, N), b (N,), computed on arrays from ``torchops.as_array`` (DLPack, no copy) and
    returned with ``torchops.as_tensor``; backward returns dx, dW, db, computed the same way.
    Checked against autograd in float64 on non-square shapes (with transposed inputs and a
    non-contiguous grad_output), inputs and grad_output unchanged, the bridge used for real (no
    torch arithmetic and no copies out of torch inside the Function, as_array on x, W, b and
    dy, results from as_tensor), and torch.autograd.gradcheck.
    """
    ex = "ex06.4"
    torch = _torch()
    dev = "cuda" if env.HAS_GPU else "cpu"
    kw = dict(dtype=torch.float64, device=dev)
    apply = getattr(Linear, "apply", None)
    if apply is None:
        raise GradeError(f"{ex}: Linear must be a torch.autograd.Function subclass (it has no "
                         ".apply)")
    g = torch.Generator().manual_seed(int(fresh_rng()[1]) % 2**31)
    for M, K, N, layout in ((5, 3, 4, "contiguous"), (6, 7, 2, "x transposed"),
                            (4, 4, 4, "square")):
        case = f"x {M}x{K}, W {K}x{N} ({layout})"
        x0 = torch.randn(M, K, generator=g, dtype=torch.float64)
        if layout == "x transposed":
            x0 = torch.randn(K, M, generator=g, dtype=torch.float64).t()
        W0 = torch.randn(K, N, generator=g, dtype=torch.float64)
        b0 = torch.randn(N, generator=g, dtype=torch.float64)
        gy = torch.randn(N, M, generator=g, dtype=torch.float64).t()      # non-contiguous
        x = x0.to(dev).requires_grad_()
        W, b = W0.to(dev).requires_grad_(), b0.to(dev).requires_grad_()
        keep = [t.detach().clone() for t in (x, W, b)]
        gyd = gy.to(dev) if dev == "cpu" else gy.to(dev).t().contiguous().t()
        gy_keep = gyd.clone()
        fwd = _Bridge()
        try:
            with fwd.active():
                y = apply(x, W, b)
        except NotImplementedError:
            raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                             "NotImplementedError)") from None
        except Exception as e:  # noqa: BLE001
            if fwd.compute or fwd.copies:     # .numpy() of a GPU tensor raises: say why
                _bridge_rubric(ex, case, "forward", fwd, {}, {})
            raise GradeError(f"{ex}: {case}: forward raised {type(e).__name__}: "
                             f"{_first_line(e)}") from None
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (M, N):
            raise GradeError(f"{ex}: {case}: forward returned "
                             f"{tuple(getattr(y, 'shape', ())) or type(y).__name__}, "
                             f"expected a tensor of shape ({M}, {N})")
        if any(not torch.equal(a.detach(), k) for a, k in zip((x, W, b), keep)):
            raise GradeError(f"{ex}: {case}: forward changed one of its inputs in place "
                             "(x, W or b): compute the result into a new array "
                             "(xa @ Wa + ba), never xa += ... on the input's memory")
        _bridge_rubric(ex, case, "forward", fwd, {"x": x, "W": W, "b": b}, {"result": y})
        ref_y = x0 @ W0 + b0
        if not torch.allclose(y.detach().cpu(), ref_y, atol=1e-12, rtol=1e-10):
            raise GradeError(f"{ex}: {case}: forward wrong: expected x @ W + b")
        if y.grad_fn is None:
            raise GradeError(f"{ex}: {case}: the result has no grad_fn: return it from forward "
                             "(Linear.apply records the backward)")
        bwd = _Bridge()
        try:
            with bwd.active():   # the Function's backward, called as autograd would call it
                grads = y.grad_fn.apply(gyd)
        except NotImplementedError:
            raise GradeError(f"{ex}: backward not implemented yet (the stub still raises "
                             "NotImplementedError)") from None
        except Exception as e:  # noqa: BLE001
            if bwd.compute or bwd.copies:
                _bridge_rubric(ex, case, "backward", bwd, {}, {})
            msg = _first_line(e)
            if any(w in msg for w in ("shape", "mismatch", "dimension", "aligned")):
                raise GradeError(f"{ex}: {case}: backward raised {type(e).__name__} ({msg}): "
                                 f"a wrong shape, a transposition? dx = dy @ W^T is ({M}, {K}), "
                                 f"dW = x^T @ dy is ({K}, {N}), db = the column sums of dy "
                                 f"({N},)") from None
            raise GradeError(f"{ex}: {case}: backward raised {type(e).__name__}: {msg}") \
                from None
        if not torch.equal(gyd, gy_keep):
            raise GradeError(f"{ex}: {case}: backward changed grad_output in place: autograd "
                             "may hand the same tensor to other Functions; compute new arrays")
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        if len(grads) != 3:
            raise GradeError(f"{ex}: {case}: backward returned {len(grads)} value(s); it "
                             "returns one gradient per input of forward: dx, dW, db")
        named = dict(zip(("dx", "dW", "db"), grads))
        _bridge_rubric(ex, case, "backward", bwd, {"dy": gyd}, named)
        dx_r, dW_r, db_r = gy @ W0.t(), x0.t() @ gy, gy.sum(0)
        for name, got, want in (("dx", named["dx"], dx_r), ("dW", named["dW"], dW_r),
                                ("db", named["db"], db_r)):
            if got is None:
                raise GradeError(f"{ex}: {case}: backward returned None for {name}")
            got = got.detach().cpu()
            if tuple(got.shape) != tuple(want.shape):
                raise GradeError(f"{ex}: {case}: backward returned {name} of shape "
                                 f"{tuple(got.shape)}, expected {tuple(want.shape)}: a wrong "
                                 f"shape, a transposition? dx = dy @ W^T is ({M}, {K}), "
                                 f"dW = x^T @ dy is ({K}, {N}), db = the column sums of dy "
                                 f"({N},)")
            if torch.allclose(got, want, atol=1e-12, rtol=1e-10):
                continue
            if name == "db" and torch.allclose(got, want / M, atol=1e-12, rtol=1e-10):
                raise GradeError(f"{ex}: {case}: db is the MEAN of dy over the rows; the bias "
                                 "gradient is the SUM (dy already carries the loss's 1/M)")
            if name in ("dx", "dW") and got.shape[0] == got.shape[1] and \
                    torch.allclose(got.t(), want, atol=1e-12, rtol=1e-10):
                raise GradeError(f"{ex}: {case}: {name} is the transpose of the right answer "
                                 "(on a square layer the shape cannot tell): dx = dy @ W^T, "
                                 "dW = x^T @ dy")
            raise GradeError(f"{ex}: {case}: {name} wrong: dx = dy @ W^T, dW = x^T @ dy, "
                             "db = dy summed over the rows")
    xs = torch.randn(3, 4, **kw, requires_grad=True)
    Ws = torch.randn(4, 2, **kw, requires_grad=True)
    bs = torch.randn(2, **kw, requires_grad=True)
    try:
        ok = torch.autograd.gradcheck(apply, (xs, Ws, bs), eps=1e-6, atol=1e-7,
                                      raise_exception=False)
    except Exception as e:  # noqa: BLE001
        raise GradeError(f"{ex}: gradcheck raised {type(e).__name__}: {e}") from None
    if not ok:
        raise GradeError(f"{ex}: torch.autograd.gradcheck failed (float64): the backward does "
                         "not match finite differences of the forward")
    passed(ex)


# ----------------------------------------------------------------------------- ex06.5
LN_THREADS = 128        # layernorm_bwd_dx: one block of 128 threads per row
LN_BLOCK = (32, 8)      # layernorm_bwd_params: 32 columns x 8 thread rows per block
LN_EPS = 1e-5           # the forward's eps, inside rstd = 1 / sqrt(var + eps)
#: ex06.5's cases (rows, C, kind), in this order: one row of one column; C below, at and past a
#: warp and past the block of 128; a row many blocks long; many rows, where a column sum kept in
#: half precision loses digits; x near 1e4 with a spread of 1e-2 ("extreme")
LN_CASES = ((1, 1, "plain"), (1, 77, "plain"), (3, 31, "plain"), (37, 33, "plain"),
            (130, 129, "plain"), (5, 1000, "plain"), (64, 4099, "plain"),
            (4096, 77, "many rows"), (7, 200, "extreme"))
#: (atol, rtol) of dx, rtol relative to the magnitude of its terms (``_ln_parts``)
LN_DX_TOL = (1e-6, 3e-5)
#: (atol, rtol) of dgamma and dbeta, rtol relative to the column's sum of |terms|: a float32
#: sum of 4096 terms in any order stays near 1e-6 of it
LN_SUM_TOL = (1e-6, 1e-5)
#: column sums off by less than this fraction of their sum of |terms|, in most columns: the
#: rounding of a half-precision accumulator (a race or a lost row misses by a whole term or more)
LN_ROUNDING = 0.02

_LN_LIBRARY = ("the row sums of dx and the column sums of dgamma and dbeta written out in the "
               "kernels' own loops")
_LN_SHARED = ("the 128 threads of a row add their partial sums of g and g * xhat through shared "
              "memory, and the 8 thread rows of a column block their partial column sums; each "
              "needs a barrier between writing the partials and reading them")
_LN_SYNC_DX = ("in layernorm_bwd_dx: a __syncthreads() after every thread has written its "
               "partials to shared memory, and one after each step of the tree reduction "
               "(outside the if, so that every thread reaches it)")
_LN_SYNC_PARAMS = ("in layernorm_bwd_params: a __syncthreads() between writing the partial "
                   "column sums to shared memory and thread row 0 reading them")
_LN_FORMULA = ("dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, xhat = "
               "(x - mean[r]) * rstd[r], the means over the row's C columns")
_LN_EXTREME = ("right for ordinary rows, wrong where x is near 1e4 with a spread of 1e-2: form "
               "xhat = (x - mean[r]) * rstd[r] element by element from the saved mean and rstd "
               "before any sum. An expanded form such as sum(g * x) - mean * sum(g) (or a "
               "variance recomputed as E[x^2] - E[x]^2) subtracts two numbers near 1e4 * sum(g) "
               "and cancels every significant digit")
_LN_HALF = ("the errors fit half precision (fp16): the columns off by about its rounding (a "
            "part in 2000 of each term) and more as the rows grow. fp16 keeps 11 significant "
            "bits (past 2048, adding 1 changes nothing): accumulate the column sums in float "
            "and convert nothing to half")
_LN_NAN_PARAMS = ("the grader fills dgamma and dbeta with NaN and does not zero them: the kernel "
                  "writes each element once, with = (a += into the output, or an atomicAdd, adds "
                  "to the NaN); or is the body of layernorm_bwd_params still the stub?")


def layernorm_backward_reference(dy, x, gamma, mean, rstd):
    """(dx, dgamma, dbeta) in float64 of the LayerNorm y = gamma * xhat + beta, xhat = (x -
    mean[r]) * rstd[r], from the forward's saved mean and rstd (rows,), for dy, x (rows, C) and
    gamma (C,). Equal to torch autograd of F.layer_norm where mean and rstd are x's own."""
    p = _ln_parts(dy, x, gamma, mean, rstd)
    return p["dx"], p["dgamma"], p["dbeta"]


def _ln_parts(dy, x, gamma, mean, rstd) -> dict[str, np.ndarray]:
    """The reference, the magnitudes its float32 rounding scales with, and the answers of the
    mistakes ex06.5 names, all float64."""
    dy, x, gamma = (np.asarray(a, np.float64) for a in (dy, x, gamma))
    mean, rstd = (np.asarray(a, np.float64)[:, None] for a in (mean, rstd))
    rows, C = dy.shape
    xh = (x - mean) * rstd
    g = dy * gamma

    def dx_of(g, n=C, lead=True, mean_g=True, xhat_term=True):
        d = g - (g.sum(1, keepdims=True) / n if mean_g else 0.0)
        if xhat_term:
            d = d - xh * (g * xh).sum(1, keepdims=True) / n
        return rstd * d if lead else d

    dx = dx_of(g)
    return {
        "dx": dx, "dgamma": (dy * xh).sum(0), "dbeta": dy.sum(0),
        "mag_dx": rstd * (np.abs(g) + np.abs(g).mean(1, keepdims=True)
                          + np.abs(xh) * np.abs(g * xh).mean(1, keepdims=True)),
        "mag_dgamma": np.abs(dy * xh).sum(0), "mag_dbeta": np.abs(dy).sum(0),
        "dx_no_mean_g": dx_of(g, mean_g=False), "dx_no_xhat_term": dx_of(g, xhat_term=False),
        "dx_no_gamma": dx_of(dy), "dx_no_rstd": dx_of(g, lead=False),
        "dx_by_threads": dx_of(g, n=LN_THREADS), "dx_by_rows": dx / rows,
        "dgamma_of_x": (dy * x).sum(0), "dgamma_with_gamma": (dy * xh * gamma).sum(0),
    }


def _ln_inputs(rng, rows: int, C: int, kind: str):
    """dy, x, gamma, mean, rstd (float32) of one case; mean and rstd are x's own, computed in
    float64 and rounded, as a forward saves them. dy has a mean of 0.5 (1 with many rows), so
    that mean(g) matters and the column sums grow with the rows."""
    if kind == "extreme":
        x = (1e4 + 1e-2 * rng.standard_normal((rows, C))).astype(np.float32)
    else:
        x = (2 * rng.standard_normal((rows, C)) + 0.5).astype(np.float32)
    x64 = x.astype(np.float64)
    mean = x64.mean(1)
    rstd = 1 / np.sqrt(x64.var(1) + LN_EPS)
    gamma = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    dy = (rng.standard_normal((rows, C)) + (1.0 if kind == "many rows" else 0.5))
    return dy.astype(np.float32), x, gamma, mean.astype(np.float32), rstd.astype(np.float32)


def _ln_launch_dx(kern, dy, x, gamma, mean, rstd, dx, rows: int, C: int) -> None:
    kern((rows,), (LN_THREADS,), (dy, x, gamma, mean, rstd, dx, np.int32(rows), np.int32(C)))


def _ln_launch_params(kern, dy, x, mean, rstd, dgamma, dbeta, rows: int, C: int) -> None:
    kern((ceil_div(C, LN_BLOCK[0]),), LN_BLOCK, (dy, x, mean, rstd, dgamma, dbeta,
                                                  np.int32(rows), np.int32(C)))


def _compile(ex: str, src: str, name: str):
    """The kernel ``name`` of a CUDA C++ answer (a GradeError if it does not compile)."""
    from ._core import compile_kernel

    return compile_kernel(ex, src, name)


def _racecheck(ex: str, src: str, kernel: str, driver: str, hint: str) -> None:
    from ._race import racecheck

    racecheck(ex, src, kernel, f"cudabook.graders.ch06:{driver}", hint=hint)


def ex06_5(src: str) -> None:
    """``src`` defines two kernels of the LayerNorm backward, for dy, x, dx (rows, C) float32,
    gamma, dgamma, dbeta (C,), and the forward's saved mean, rstd (rows,):

    * ``layernorm_bwd_dx(dy, x, gamma, mean, rstd, dx, rows, C)``, launched with grid ``rows``
      and 128 threads: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma;
    * ``layernorm_bwd_params(dy, x, mean, rstd, dgamma, dbeta, rows, C)``, launched with grid
      ``ceil(C / 32)`` and block (32, 8): dgamma = sum over the rows of dy * xhat, dbeta = sum
      of dy. The grader does not zero dgamma and dbeta (it fills them with NaN): the kernel
      writes them.

    Static rubric first (on a CPU too): no library, a __shared__ array and a barrier. Then, on a
    GPU, each case of ``LN_CASES`` twice with fresh data against the float64 reference, outputs
    NaN-filled with a canary; then compute-sanitizer racecheck of both kernels.
    """
    ex = "ex06.5"
    code = rubric(ex, src, _LN_LIBRARY, why_shared=_LN_SHARED)
    need_gpu(ex)
    kdx = _compile(ex, src, "layernorm_bwd_dx")
    kpar = _compile(ex, src, "layernorm_bwd_params")
    rng, seed = fresh_rng()
    plain_ok = False                      # an ordinary case has passed
    for rows, C, kind in LN_CASES:
        for rep in range(2):
            dy, x, gamma, mean, rstd = _ln_inputs(rng, rows, C, kind)
            parts = _ln_parts(dy, x, gamma, mean, rstd)
            what = {"plain": "", "many rows": ", many rows",
                    "extreme": ", x near 1e4 with a spread of 1e-2"}[kind]
            case = f"rows={rows}, C={C}{what} (seed {seed}, call {rep + 1})"
            # a missing column guard reads the zero tail on a GPU instead of faulting
            dy_d, x_d, g_d = (padded(a, 2 * LN_THREADS) for a in (dy, x, gamma))
            mean_d, rstd_d = to_device(mean), to_device(rstd)
            dx, dx_buf = guarded((rows, C))
            dg, dg_buf = guarded((C,))
            db, db_buf = guarded((C,))
            call(ex, case, lambda: _ln_launch_dx(kdx, dy_d, x_d, g_d, mean_d, rstd_d, dx,
                                                 rows, C))
            call(ex, case, lambda: _ln_launch_params(kpar, dy_d, x_d, mean_d, rstd_d, dg, db,
                                                     rows, C))
            if not (np.array_equal(to_numpy(dy_d), dy) and np.array_equal(to_numpy(x_d), x)):
                raise GradeError(f"{ex}: {case}: dy or x changed: a kernel writes into its "
                                 "inputs; dx, dgamma and dbeta are separate outputs")
            for name, buf, n in (("dx", dx_buf, rows * C), ("dgamma", dg_buf, C),
                                 ("dbeta", db_buf, C)):
                if not canary_ok(buf, n):
                    raise GradeError(f"{ex}: {case}: wrote past the end of {name}: guard the "
                                     "column index (c < C) before every load and store")
            _ln_check_dx(ex, case, kind, src, to_numpy(dx).astype(np.float64), parts, rows, C,
                         plain_ok)
            _ln_check_params(ex, case, src, code, to_numpy(dg).astype(np.float64),
                             to_numpy(db).astype(np.float64), parts, rows)
            plain_ok |= kind == "plain"
    _racecheck(ex, src, "layernorm_bwd_dx", "_race_ex06_5_dx", _LN_SYNC_DX)
    _racecheck(ex, src, "layernorm_bwd_params", "_race_ex06_5_params", _LN_SYNC_PARAMS)
    passed(ex)


def _ln_near(got: np.ndarray, alt: np.ndarray, mag: np.ndarray) -> bool:
    """``got`` is the answer of a mistake ``alt`` (far looser than the check: the mistakes
    differ from the reference by whole terms)."""
    with np.errstate(invalid="ignore"):
        return bool((np.abs(got - alt) <= 1e-5 + 1e-3 * (mag + np.abs(alt))).all())


def _ln_check_dx(ex, case, kind, src, got, parts, rows, C, plain_ok) -> None:
    ref, mag = parts["dx"], parts["mag_dx"]
    atol, rtol = LN_DX_TOL
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(got - ref) <= atol + rtol * mag)
    if not bad.any():
        return
    msg = f"{ex}: {case}: dx is wrong ({error_summary(got, ref, bad)})"
    nan = np.isnan(got)
    if nan.all():
        raise GradeError(f"{ex}: {case}: dx never written (all NaN): is the body of "
                         "layernorm_bwd_dx still the stub?")
    if nan.any():
        cols = np.nonzero(nan)[1]
        if C > LN_THREADS and cols.min() >= LN_THREADS:
            raise GradeError(f"{msg}: the columns past the first {LN_THREADS} never written: C "
                             "is longer than the block, so each thread loops c = threadIdx.x, "
                             "c + blockDim.x, ... while c < C")
        raise GradeError(f"{msg}: {int(nan.sum())} elements never written: block r writes "
                         "every column c < C of row r")
    # the ordinary cases ran first and passed, so the formula is right: an answer wrong only here
    # loses digits to cancellation, whatever known mistake its noise happens to resemble
    if kind == "extreme" and plain_ok:
        raise GradeError(f"{msg}: {_LN_EXTREME}")
    hints = [("dx_no_mean_g", "the term -mean(g) is missing, the gradient through the row's "
              "mean (every x of the row moves it): " + _LN_FORMULA),
             ("dx_no_xhat_term", "the term -xhat * mean(g * xhat) is missing, the gradient "
              "through rstd (every x of the row moves the variance): " + _LN_FORMULA),
             ("dx_no_gamma", "dy was used where g = dy * gamma belongs (y = gamma * xhat + "
              "beta, so the gradient reaching xhat is dy * gamma): " + _LN_FORMULA),
             ("dx_no_rstd", "the leading factor rstd is missing: " + _LN_FORMULA),
             ("dx_by_threads", f"the means divide by the {LN_THREADS} threads of the block; "
              f"they are means over the row's C = {C} columns"),
             ("dx_by_rows", f"dx is divided by rows = {rows}: dy is already the gradient of "
              "the loss (the 1/rows of a mean loss is inside it); dx has no further factor")]
    for key, hint in hints:
        if key == "dx_by_rows" and rows == 1:
            continue
        if _ln_near(got, parts[key], mag):
            raise GradeError(f"{msg}: {hint}")
    # values of no known mistake: a race on the row sums gives such numbers, so racecheck has
    # the first word (it raises when it finds one)
    _racecheck(ex, src, "layernorm_bwd_dx", "_race_ex06_5_dx", _LN_SYNC_DX)
    raise GradeError(f"{msg}: {_LN_FORMULA}")


def _ln_check_params(ex, case, src, code, dg, db, parts, rows) -> None:
    atol, rtol = LN_SUM_TOL
    got = {"dgamma": dg, "dbeta": db}
    if np.isnan(dg).all() and np.isnan(db).all():
        raise GradeError(f"{ex}: {case}: dgamma and dbeta are all NaN: {_LN_NAN_PARAMS}")
    for name in ("dbeta", "dgamma"):
        o, ref, mag = got[name], parts[name], parts[f"mag_{name}"]
        with np.errstate(invalid="ignore"):
            err = np.abs(o - ref)
            bad = ~(err <= atol + rtol * mag)
        if not bad.any():
            continue
        msg = f"{ex}: {case}: {name} is wrong ({error_summary(o, ref, bad)})"
        nan = np.isnan(o)
        if nan.all():
            raise GradeError(f"{msg}: {name} is all NaN: {_LN_NAN_PARAMS}")
        if nan.any():
            c = int(np.argmax(nan))
            raise GradeError(f"{msg}: {name}[{c}] never written: block b owns columns 32 b .. "
                             "32 b + 31, and thread row 0 writes each of them (c < C)")
        other = "dgamma" if name == "dbeta" else "dbeta"
        mistakes = [(rows > 1 and _ln_near(o, ref / rows, mag / rows),
                     f"{name} is the MEAN over the rows (1/{rows} of the sum); dgamma and dbeta "
                     "are SUMS: dgamma[c] = sum_r dy[r, c] * xhat[r, c], dbeta[c] = sum_r "
                     "dy[r, c] (the 1/rows of a mean loss is already inside dy)"),
                    (_ln_near(o, parts[other], parts[f"mag_{other}"]),
                     "dgamma and dbeta are swapped: dgamma sums dy * xhat, dbeta sums dy"),
                    (name == "dgamma" and _ln_near(o, parts["dgamma_of_x"], mag),
                     "dgamma summed dy * x: it sums dy * xhat, xhat = (x - mean[r]) * rstd[r]"),
                    (name == "dgamma" and _ln_near(o, parts["dgamma_with_gamma"], mag),
                     "dgamma summed dy * xhat * gamma: gamma multiplies xhat in the forward, so "
                     "its gradient is what multiplies it there, dy * xhat")]
        for hit, hint in mistakes:
            if hit:
                raise GradeError(f"{msg}: {hint}")
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = err / np.maximum(mag, 1e-30)
        if np.isfinite(o).all() and bad.mean() >= 0.3 and float(rel.max()) < LN_ROUNDING:
            if not any(mentions(code, w) for w in ("half", "__half", "__float2half", "__hadd")):
                _racecheck(ex, src, "layernorm_bwd_params", "_race_ex06_5_params",
                           _LN_SYNC_PARAMS)
            raise GradeError(f"{msg}: {_LN_HALF}")
        _racecheck(ex, src, "layernorm_bwd_params", "_race_ex06_5_params", _LN_SYNC_PARAMS)
        raise GradeError(f"{msg}: dgamma[c] = sum over the rows r of dy[r, c] * xhat[r, c], "
                         "dbeta[c] = sum of dy[r, c]; thread row ty adds rows ty, ty + 8, ..., "
                         "and thread row 0 adds the 8 partials of its column")


def _race_ex06_5_dx(kern) -> None:
    """racecheck driver: layernorm_bwd_dx on a row shorter and one longer than the block."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for rows, C in ((3, 77), (2, 300)):
        dy, x, gamma, mean, rstd = (cupy.asarray(a) for a in _ln_inputs(rng, rows, C, "plain"))
        dx = cupy.empty((rows, C), cupy.float32)
        _ln_launch_dx(kern, dy, x, gamma, mean, rstd, dx, rows, C)


def _race_ex06_5_params(kern) -> None:
    """racecheck driver: layernorm_bwd_params on ragged column blocks."""
    import cupy

    rng = np.random.default_rng(0)
    for rows, C in ((37, 45), (9, 70)):
        dy, x, _, mean, rstd = (cupy.asarray(a) for a in _ln_inputs(rng, rows, C, "plain"))
        dg, db = cupy.empty(C, cupy.float32), cupy.empty(C, cupy.float32)
        _ln_launch_params(kern, dy, x, mean, rstd, dg, db, rows, C)
