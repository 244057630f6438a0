"""What every grader shares: fresh seeds, ragged sizes, NaN-prefilled outputs with a canary
tail, and failure messages that name the case and the likely mistake.

A grader prints exactly ``PASS exNN.k`` on success and raises ``GradeError`` otherwise: nbval
compares the printed line with the one stored in the notebook, and a raised error fails the
cell whatever was stored.

Also here: ``count_launches`` (did the answer launch a Numba kernel at all?), ``close`` and
the named tolerances, and ``error_summary`` (what is known about a wrong output, when no
specific mistake can be named). Static source checks are ``_static``; race checks ``_race``.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

import numpy as np

from .. import env
from ..check import close, to_numpy
from ..launch import ceil_div

__all__ = ["GradeError", "passed", "fresh_rng", "ragged_sizes", "guarded", "canary_ok",
           "call", "diagnose_1d", "xp", "to_device", "sync", "need_gpu", "compile_kernel",
           "count_launches", "need_launch", "close", "error_summary", "looks_like_low_precision",
           "ceil_div", "CANARY", "check_numbers", "padded",
           "ELEMENTWISE_TOL", "SIM_BEYOND_ONE_BLOCK", "poisoned_memory", "launched_kernels",
           "POISON_INT"]

CANARY = 4096  # NaN elements after each output: a write past the end lands here

#: (atol, rtol) of graders that check one float32 operation per element
ELEMENTWISE_TOL = (1e-5, 1e-5)

#: a length every simulator run includes: more than two blocks of 1024 threads and more than
#: eight of 256, so a launcher that assumes one block (or a fixed grid) fails in the simulator too
SIM_BEYOND_ONE_BLOCK = 2 * 1024 + 3


class GradeError(AssertionError):
    """The answer is wrong; the message says in which case and why, as far as we can tell."""


def passed(ex: str) -> None:
    print(f"PASS {ex}")


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator with a new seed each call (so answers cannot be memorised); seed reported."""
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def ragged_sizes(block: int, big: int | None = None,
                 sim_big: int | None = SIM_BEYOND_ONE_BLOCK) -> list[int]:
    """1, block +- 1, a non-power of two, several blocks with a tail; ``big`` on a GPU only.

    In the simulator ``sim_big`` (cheap, but beyond one block of 1024 threads) replaces ``big``,
    so a launcher with sizes hard-coded for small inputs fails there too.
    """
    sizes = [1, block - 1, block, block + 1, 3 * block + 7, 1000]
    if big and not env.SIM:
        sizes.append(big)
    if sim_big and env.SIM:
        sizes.append(sim_big)
    return sorted(set(s for s in sizes if s > 0))


def need_gpu(ex: str, what: str = "CUDA C++ runs through CuPy") -> None:
    """A CUDA C++ exercise cannot be graded in simulator mode: say so, as a failure."""
    if not env.HAS_GPU:
        raise GradeError(f"{ex}: needs a CUDA GPU ({what})")


def compile_kernel(ex: str, src: str, name: str, options: tuple[str, ...] = ()):
    """The kernel ``name`` of the student's source; compile errors become a GradeError."""
    from ..compile import compile_source

    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got "
                         f"{type(src).__name__}")
    try:
        return compile_source(src, options, name=f"{ex} source").get(name)
    except AttributeError as e:
        raise GradeError(f"{ex}: {e}") from None
    except RuntimeError as e:
        raise GradeError(f"{ex}: does not compile:\n{e}") from None


@contextlib.contextmanager
def count_launches() -> Iterator[list[int]]:
    """Count the Numba kernel launches made inside the block: ``with count_launches() as n:``
    then ``n[0]`` is the number (on a GPU and in the simulator)."""
    n = [0]
    if env.SIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel as cls

        attr = "__call__"
    else:
        from numba.cuda.dispatcher import CUDADispatcher as cls

        attr = "call"
    orig = getattr(cls, attr)

    def counted(self, *a, **k):
        if not getattr(self, "_device", False):
            n[0] += 1
        return orig(self, *a, **k)

    setattr(cls, attr, counted)
    try:
        yield n
    finally:
        setattr(cls, attr, orig)


def need_launch(ex: str, case: str, launches: int, what: str) -> None:
    """GradeError unless the answer launched at least one kernel."""
    if launches == 0:
        raise GradeError(f"{ex}: {case}: the output is filled, but no kernel was launched (an "
                         f"array expression in NumPy or CuPy?): the exercise asks for {what}")


def error_summary(o: np.ndarray, r: np.ndarray, bad: np.ndarray) -> str:
    """What is known about a wrong output: how many, the first, how large the errors are."""
    idx = np.argwhere(bad)
    first = tuple(int(v) for v in idx[0])
    at = first if len(first) > 1 else first[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(o - r)[bad]
        rel = err / np.maximum(np.abs(r[bad]), 1e-30)
    finite = np.isfinite(err)
    size = (f"largest error {err[finite].max():.3g} (relative {rel[finite].max():.2g})"
            if finite.any() else "the wrong values are NaN or inf")
    return (f"{int(bad.sum())} of {r.size} wrong, first at {at}: got {o[first]:.6g}, expected "
            f"{r[first]:.6g}; {size}")


def looks_like_low_precision(o: np.ndarray, r: np.ndarray, bad: np.ndarray) -> bool:
    """Errors in most elements, all small next to the values (under 2% typically): half-precision
    arithmetic or accumulation. A wrong index or a race gives errors of the values' own size.
    Fewer than 16 wrong elements cannot tell rounding from one stale value that happened to be
    small (a 1x1 output, say), so they never get this verdict."""
    if bad.sum() < 16 or bad.mean() < 0.2 or not np.isfinite(o[bad]).all():
        return False
    scale = float(np.abs(r).mean()) or 1.0
    err = np.abs(o - r)[bad]
    return float(np.median(err)) < 2e-2 * scale and float(err.max()) < 0.2 * scale


def xp():
    """The array module the graders use: CuPy on a GPU, NumPy in the simulator."""
    if env.HAS_GPU:
        import cupy

        return cupy
    return np


def to_device(a: np.ndarray):
    return xp().asarray(a)


def sync() -> None:
    if env.HAS_GPU:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def guarded(shape, dtype=np.float32):
    """(out, buffer): ``out`` of ``shape`` is NaN-filled and followed in memory by a NaN canary.

    A kernel that writes past the end of ``out`` changes the canary (on a GPU) or raises an
    IndexError (in the simulator, where arrays are bounds-checked).
    """
    m = xp()
    n = int(np.prod(shape))
    buf = m.empty(n + CANARY, dtype=dtype)
    buf.fill(np.nan if np.dtype(dtype).kind == "f" else -1)
    return buf[:n].reshape(shape), buf


def padded(a: np.ndarray, tail: int):
    """``a`` on the device as a view of a buffer with ``tail`` zero elements after it.

    An input the student's kernel may read past its end (a missing guard, a transposed index):
    on a GPU the read stays inside the allocation and returns 0 instead of faulting, which would
    end the CUDA context for every later cell. In the simulator the view is bounds-checked as
    before (an IndexError names the missing guard).
    """
    a = np.ascontiguousarray(a)
    flat = np.zeros(a.size + max(int(tail), 0), dtype=a.dtype)
    flat[:a.size] = a.ravel()
    return to_device(flat)[:a.size].reshape(a.shape)


def canary_ok(buf, n: int) -> bool:
    tail = to_numpy(buf[n:])
    return bool(np.isnan(tail).all()) if tail.dtype.kind == "f" else bool((tail == -1).all())


def call(ex: str, case: str, fn: Callable[[], Any]) -> None:
    """Run the student's code; turn the usual crashes into a message about the likely cause."""
    try:
        with warnings.catch_warnings():   # a grader prints one line; Numba's hints would add more
            warnings.simplefilter("ignore")
            fn()
            sync()
    except NotImplementedError:
        raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                         "NotImplementedError)") from None
    except IndexError as e:
        raise GradeError(f"{ex}: {case}: index out of range ({e}): missing bounds guard "
                         "(if i < n)?") from None
    except GradeError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        if "grid values must be >= 1" in msg or "invalid configuration argument" in msg:
            # Numba on a GPU refuses a grid of 0 blocks (the simulator runs nothing)
            raise GradeError(f"{ex}: {case}: launched with no threads (a grid of 0 blocks: "
                             f"{msg}): round the block count up, ceil_div(n, threads) = "
                             "(n + threads - 1) // threads") from None
        raise GradeError(f"{ex}: {case}: raised {type(e).__name__}: {msg}") from None


def diagnose_1d(ex: str, case: str, out, ref: np.ndarray, buf=None, *, atol=1e-5,
                rtol=1e-5, hint: str = "") -> None:
    """Compare a 1D output with the reference and explain the first kind of error found."""
    o = to_numpy(out).astype(np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    n = r.size
    if buf is not None and not canary_ok(buf, n):
        raise GradeError(f"{ex}: {case}: wrote past the end of the output (n={n}): missing "
                         "bounds guard (if i < n)?")
    nan = np.isnan(o) & ~np.isnan(r)
    if nan.all():
        raise GradeError(f"{ex}: {case}: output never written (all NaN): is the kernel body "
                         "still the stub, or was it launched with no threads?")
    if nan.any():
        first = int(np.argmax(nan))
        if first == n - 1 and n > 1:
            raise GradeError(f"{ex}: {case}: element {n - 1}, the last, never written: does "
                             "the guard stop one short (i < n - 1 instead of i < n)?")
        if nan[first:].all():
            raise GradeError(f"{ex}: {case}: elements {first}..{n - 1} never written: the grid "
                             "is too small or the loop stops early (round the block count up: "
                             "ceil_div(n, threads) = (n + threads - 1) // threads)?")
        raise GradeError(f"{ex}: {case}: {int(nan.sum())} elements never written, first at "
                         f"{first}: wrong index or stride?")
    bad = ~close(o, r, atol, rtol)
    if bad.any():
        i = int(np.argmax(bad))
        raise GradeError(f"{ex}: {case}: wrong at {i}: got {o[i]:.6g}, expected {r[i]:.6g} "
                         f"({int(bad.sum())} of {n} wrong){'; ' + hint if hint else ''}")


def check_numbers(ex: str, got: dict[str, Any], want: dict[str, float],
                  wrong: dict[str, dict[float, str]] | None = None,
                  nudge: dict[str, str] | None = None, rel: float = 1e-3) -> None:
    """A pencil-and-paper answer: each number of ``got`` against ``want`` (within ``rel``).

    A value listed in ``wrong[name]`` (a mistake a reader makes) gets that hint; any other wrong
    value gets ``nudge[name]`` (a pointer, never the answer). Every wrong number is reported in
    one GradeError, the first line counting them.
    """
    wrong, nudge = wrong or {}, nudge or {}
    msgs = []

    def same(a: float, b: float) -> bool:   # a count is exact, a ratio within ``rel``
        return a == b if float(b).is_integer() else abs(a - b) <= rel * abs(b)

    for name, w in want.items():
        v = got.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            msgs.append(f"{name} should be a number, got {type(v).__name__} {v!r}")
            continue
        v = float(v)
        if same(v, w):
            continue
        if not math.isfinite(v):
            msgs.append(f"{name} = {v}: a count or a ratio is a finite number")
            continue
        hint = next((h for bad, h in wrong.get(name, {}).items() if same(v, bad)), None)
        if hint is None and 0 < abs(w) < 1 and same(v, 100 * w):
            hint = "give it as a fraction (0.25), not a percentage"
        msgs.append(f"{name} = {v:g} is not right: "
                    f"{hint or nudge.get(name, 'work it through again')}")
    if msgs:
        raise GradeError(f"{ex}: {len(msgs)} of {len(want)} answers wrong\n  "
                         + "\n  ".join(msgs))


#: what ``poisoned_memory`` fills a new integer shared or local array with
POISON_INT = -1_000_003


class _PoisonedNumpy:
    """NumPy, except that ``empty`` fills the array: NaN (floats) or ``POISON_INT`` (ints)."""

    def __init__(self, np_module):
        self._np = np_module

    def __getattr__(self, name):
        return getattr(self._np, name)

    def empty(self, shape, dtype=float, *a, **k):
        out = self._np.empty(shape, dtype, *a, **k)
        kind = out.dtype.kind
        if kind in "fc":
            out.fill(self._np.nan)
        elif kind in "iu":
            out.fill(POISON_INT if kind == "i" else self._np.iinfo(out.dtype).max // 2)
        return out


@contextlib.contextmanager
def poisoned_memory() -> Iterator[None]:
    """Simulator only (elsewhere it does nothing): every ``cuda.shared.array`` and
    ``cuda.local.array`` made inside the block starts as NaN (ints: ``POISON_INT``) instead of
    whatever ``np.empty`` left there. A kernel that reads an element before any thread wrote it
    then gives the same wrong answer on every run and every seed, instead of a verdict that
    depends on leftover memory."""
    if not env.SIM:
        yield
        return
    from numba.cuda.simulator import kernelapi

    orig = kernelapi.np
    if isinstance(orig, _PoisonedNumpy):      # nested: already poisoned
        yield
        return
    global _ORIG_SHARED_ARRAY
    shared = kernelapi.FakeCUDAShared
    orig_array = _ORIG_SHARED_ARRAY = shared.array
    kernelapi.np = _PoisonedNumpy(orig)
    shared.array = _shared_array_locked
    try:
        yield
    finally:
        kernelapi.np = orig
        shared.array = orig_array


_SHARED_LOCK = threading.Lock()
_ORIG_SHARED_ARRAY: Callable | None = None      # the simulator's, while poisoned_memory patches it


def _shared_array_locked(self, shape, dtype, alignment=None):
    """The simulator's ``cuda.shared.array`` (one array per block and source line, made by the
    first thread that reaches the line), with its look-up and creation under a lock. The
    simulator's own checks for the array and then stores it without one: two threads can both
    find none and each make its own, and the one whose array is replaced writes where no other
    thread reads. Filling the new array with NaN widens that window enough to fail a grader now
    and then on a loaded machine, with a race that is the simulator's, not the student's."""
    if shape == 0 or alignment is not None:       # dynamic shared memory, or the refusal
        return _ORIG_SHARED_ARRAY(self, shape, dtype, alignment)
    from numba.cuda.simulator import kernelapi

    # the simulator's own types and numpy_support: their modules moved between numba-cuda releases
    if isinstance(dtype, kernelapi.types.Type):
        dtype = kernelapi.numpy_support.as_dtype(dtype)
    f = sys._getframe(1)                          # the kernel's line, as the simulator keys it
    caller = (f.f_code.co_filename, f.f_lineno)
    with _SHARED_LOCK:
        res = self._allocations.get(caller)
        if res is None:
            res = kernelapi.np.empty(shape, dtype)
            self._allocations[caller] = res
    return res


@contextlib.contextmanager
def launched_kernels() -> Iterator[list[tuple[Any, tuple]]]:
    """Record the Numba kernels launched inside the block: ``with launched_kernels() as k:``
    then ``k`` holds ``(kernel, args)`` per launch (on a GPU and in the simulator). Device
    functions are not recorded."""
    got: list[tuple[Any, tuple]] = []
    if env.SIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel as cls

        attr = "__call__"
    else:
        from numba.cuda.dispatcher import CUDADispatcher as cls

        attr = "call"
    orig = getattr(cls, attr)

    def recorded(self, *a, **k):
        if not getattr(self, "_device", False):
            got.append((self, tuple(a) if env.SIM else tuple(a[0] if a else k.get("args", ()))))
        return orig(self, *a, **k)

    setattr(cls, attr, recorded)
    try:
        yield got
    finally:
        setattr(cls, attr, orig)
