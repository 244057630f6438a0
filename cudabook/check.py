"""Correctness: compare a kernel's output with a float64 reference.

Outputs are prefilled with NaN (``empty_nan``) before a launch, so an element the kernel never
wrote fails the check instead of passing on leftover memory. The tolerance is
``atol + rtol * |ref|`` with defaults chosen per dtype of the output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CheckError", "check", "to_numpy", "empty_nan", "TOL"]

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
    out = xp.empty(shape, dtype=dtype)
    out.fill(np.nan if np.dtype(dtype).kind == "f" else -1)
    return out


def check(out: Any, ref: Any, *, atol: float | None = None, rtol: float | None = None,
          name: str = "output", show: int = 5, quiet: bool = True) -> float:
    """Raise ``CheckError`` unless ``|out - ref| <= atol + rtol*|ref|`` everywhere.

    ``ref`` should be computed in float64. NaN in ``out`` where ``ref`` is finite always fails
    (an unwritten element of a NaN-prefilled buffer). Returns the largest relative error.
    """
    o = to_numpy(out)
    r = np.asarray(to_numpy(ref), dtype=np.float64)
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
        print(f"{name}: OK ({r.size} elements, max rel err {rel:.1e})")
    return rel
