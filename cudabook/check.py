"""Correctness: compare a kernel's output with a float64 reference.

Outputs are prefilled with NaN (``empty_nan``) before a launch, so an element the kernel never
wrote fails the check instead of passing on leftover memory. The tolerance is
``atol + rtol * |ref|`` with defaults chosen per dtype of the output.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["CheckError", "check", "to_numpy", "empty_nan", "TOL", "dot_tolerance", "close"]

#: (atol, rtol) per output dtype. float32 sums of ~1e4 terms stay well inside 1e-4 relative.
TOL: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-4),
    "float16": (1e-3, 1e-2),
    "bfloat16": (1e-2, 2e-2),
    "int32": (0, 0),
    "int64": (0, 0),
    "int8": (0, 0),
    "uint8": (0, 0),
}


class CheckError(AssertionError):
    """A kernel's output differs from the reference."""


def dot_tolerance(K: int) -> dict[str, float]:
    """atol/rtol for a float32 result of K-term dot products against a float64 reference.

    Rounding errors of a sequential float32 sum of K unit-size products grow like eps * K
    (about 6e-8 K); 5e-7 K leaves room for the largest of millions of elements.
    """
    return {"atol": max(1e-5, 5e-7 * K), "rtol": 1e-4}


def close(out, ref, atol: float, rtol: float) -> np.ndarray:
    """Elementwise ``|out - ref| <= atol + rtol * |ref|`` in float64 (NaN is never close)."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.abs(o - r) <= atol + rtol * np.abs(r)


_ARRAY_HINT = "numpy, cupy, torch or a Numba device array"


def _as_real_array(a: Any, what: str) -> np.ndarray:
    """``a`` on the host as a real-valued numpy array, or a TypeError that says what it is."""
    if a is None or isinstance(a, (str, bytes, dict, set)):
        raise TypeError(f"check: {what} is {type(a).__name__}, not an array ({_ARRAY_HINT}); "
                        "was the kernel's output buffer passed?")
    try:
        arr = to_numpy(a)
    except Exception as e:  # noqa: BLE001 - to_numpy of an unknown object: say what it is
        raise TypeError(f"check: {what} ({type(a).__name__}) cannot be read as an array: "
                        f"{e}") from None
    if arr.dtype == object:
        raise TypeError(f"check: {what} is an array of Python objects ({type(a).__name__}), "
                        f"not numbers ({_ARRAY_HINT})")
    if arr.dtype.kind == "c":
        raise TypeError(f"check: {what} is complex ({arr.dtype}); compare the real and "
                        "imaginary parts separately")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"check: {what} has dtype {arr.dtype}; expected numbers")
    return arr


def _tol_arg(v, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v) or v < 0:
        raise TypeError(f"check: {name} must be a number >= 0, got {v!r}")
    return float(v)


def to_numpy(a: Any) -> np.ndarray:
    """cupy / torch / numba device array / numpy -> numpy (on the host)."""
    if isinstance(a, np.ndarray):
        return a
    mod = type(a).__module__
    if mod.startswith("cupy"):
        return a.get()
    if mod.startswith("torch"):
        t = a.detach()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.cpu().numpy()
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    return np.asarray(a)


def _dtype_name(a: Any) -> str:
    d = getattr(a, "dtype", None)
    s = str(d).replace("torch.", "")
    return s


def empty_nan(shape, dtype=np.float32, xp=np):
    """An output buffer filled with NaN (or -1 for integers): unwritten elements show up."""
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    if not isinstance(dims, (tuple, list)) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise TypeError(f"empty_nan: shape must be an int or a tuple of ints >= 0, got {shape!r}")
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        raise TypeError(f"empty_nan: {dtype!r} is not a dtype") from None
    if kind not in "biuf":
        raise TypeError(f"empty_nan: dtype {np.dtype(dtype)} is not a real number type")
    if not hasattr(xp, "empty"):
        raise TypeError(f"empty_nan: xp must be an array module (numpy or cupy), got {xp!r}")
    out = xp.empty(shape, dtype=dtype)
    out.fill(np.nan if np.dtype(dtype).kind == "f" else -1)
    return out


def check(out: Any, ref: Any, *, atol: float | None = None, rtol: float | None = None,
          name: str = "output", show: int = 5, quiet: bool = True) -> float:
    """Raise ``CheckError`` unless ``|out - ref| <= atol + rtol*|ref|`` everywhere.

    ``ref`` should be computed in float64. NaN in ``out`` where ``ref`` is finite always fails
    (an unwritten element of a NaN-prefilled buffer). Returns the largest relative error.
    With ``quiet=False`` it prints the largest absolute error, the tolerance that decided and
    the share of its tolerance the closest element used.
    """
    if not isinstance(name, str):
        raise TypeError(f"check: name must be a str, got {type(name).__name__}")
    if isinstance(show, bool) or not isinstance(show, numbers.Integral) or show < 0:
        raise TypeError(f"check: show must be an int >= 0, got {show!r}")
    atol, rtol = _tol_arg(atol, "atol"), _tol_arg(rtol, "rtol")
    o = _as_real_array(out, "out")
    r = _as_real_array(ref, "ref").astype(np.float64)
    if o.shape != r.shape:
        raise CheckError(f"{name}: shape {o.shape} != reference shape {r.shape}")
    d_atol, d_rtol = TOL.get(_dtype_name(out), TOL["float32"])
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    o64 = o.astype(np.float64)
    same_inf = np.isinf(r) & (o64 == r)
    both_nan = np.isnan(r) & np.isnan(o64)
    with np.errstate(invalid="ignore"):
        err = np.abs(o64 - r)
        close = (err <= atol + rtol * np.abs(r)) & np.isfinite(r)
    bad = ~(close | same_inf | both_nan)
    if bad.any():
        idx = np.argwhere(bad)
        n_bad, n_nan = int(bad.sum()), int((np.isnan(o64) & ~np.isnan(r)).sum())
        lines = [f"{name}: {n_bad} of {r.size} elements wrong "
                 f"(tolerance {atol:g} + {rtol:g}*|ref|)"]
        if n_nan:
            lines.append(f"  {n_nan} are NaN: never written (the buffer was NaN-prefilled)")
        for k in idx[:show]:
            t = tuple(int(v) for v in k)
            at = t if len(t) > 1 else t[0]
            lines.append(f"  at {at}: got {o64[t]:.7g}, expected {r[t]:.7g}")
        raise CheckError("\n".join(lines))
    finite = np.isfinite(r)
    rel = float((err[finite] / (np.abs(r[finite]) + atol + 1e-300)).max()) if finite.any() else 0.0
    if not quiet:
        # what decided: the largest absolute error, the tolerance, and how close the worst
        # element came to its own limit (a relative error alone misleads near zero, where the
        # absolute part of the tolerance decides)
        lim = atol + rtol * np.abs(r[finite])
        abs_err = float(err[finite].max()) if finite.any() else 0.0
        with np.errstate(invalid="ignore", divide="ignore"):
            used = float(np.max(np.where(lim > 0, err[finite] / lim, 0.0))) if finite.any() \
                else 0.0
        print(f"{name}: OK ({r.size} elements; max abs err {abs_err:.1e}, tolerance "
              f"{atol:g} + {rtol:g}*|ref|; the closest element used {100 * used:.0f}% of it)")
    return rel
