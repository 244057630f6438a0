"""What every grader shares: fresh seeds, ragged sizes, NaN-prefilled outputs with a canary
tail, and failure messages that name the case and the likely mistake.

A grader prints exactly ``PASS exNN.k`` on success and raises ``GradeError`` otherwise: nbval
compares the printed line with the one stored in the notebook, and a raised error fails the
cell whatever was stored.
"""

from __future__ import annotations

import secrets
import warnings
from typing import Any, Callable

import numpy as np

from .. import env
from ..check import to_numpy

__all__ = ["GradeError", "passed", "fresh_rng", "ragged_sizes", "guarded", "canary_ok",
           "call", "diagnose_1d", "xp", "to_device", "sync", "need_gpu", "compile_kernel"]

CANARY = 4096  # NaN elements after each output: a write past the end lands here


class GradeError(AssertionError):
    """The answer is wrong; the message says in which case and why, as far as we can tell."""


def passed(ex: str) -> None:
    print(f"PASS {ex}")


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator with a new seed each call (so answers cannot be memorised); seed reported."""
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def ragged_sizes(block: int, big: int | None = None) -> list[int]:
    """1, block +- 1, a non-power of two, several blocks with a tail; smaller in the simulator."""
    sizes = [1, block - 1, block, block + 1, 3 * block + 7, 1000]
    if big and not env.SIM:
        sizes.append(big)
    return sorted(set(s for s in sizes if s > 0))


def need_gpu(ex: str, what: str = "CUDA C++ runs through CuPy") -> None:
    """A CUDA C++ exercise cannot be graded in simulator mode: say so, as a failure."""
    if not env.HAS_GPU:
        raise GradeError(f"{ex}: needs a CUDA GPU ({what})")


def compile_kernel(ex: str, src: str, name: str):
    """The kernel ``name`` of the student's source; compile errors become a GradeError."""
    from ..compile import compile_source

    try:
        return compile_source(src, name=f"{ex} source").get(name)
    except AttributeError as e:
        raise GradeError(f"{ex}: {e}") from None
    except RuntimeError as e:
        raise GradeError(f"{ex}: does not compile:\n{e}") from None


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
        if nan[first:].all():
            raise GradeError(f"{ex}: {case}: elements {first}..{n - 1} never written: the grid "
                             "is too small or the loop stops early (round the block count up: "
                             "(n + threads - 1) // threads)?")
        raise GradeError(f"{ex}: {case}: {int(nan.sum())} elements never written, first at "
                         f"{first}: wrong index or stride?")
    bad = np.abs(o - r) > atol + rtol * np.abs(r)
    if bad.any():
        i = int(np.argmax(bad))
        raise GradeError(f"{ex}: {case}: wrong at {i}: got {o[i]:.6g}, expected {r[i]:.6g} "
                         f"({int(bad.sum())} of {n} wrong){'; ' + hint if hint else ''}")
