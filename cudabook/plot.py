"""Plots in the style of the Triton tutorials' perf reports: one line per kernel version, the
vendor baseline dashed, throughput against problem size."""

from __future__ import annotations

from typing import Sequence

from .bench import Sweep

__all__ = ["perf", "bars"]


def perf(sw: Sweep, title: str = "", logx: bool = True, ax=None, ceiling: float | None = None,
         ceiling_label: str = "measured peak"):
    """Throughput of every version against size; the baseline dashed and black."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    base = sw.baseline()
    for name, vals in sw.series().items():
        xs = [x for x, v in zip(sw.sizes, vals) if v is not None]
        ys = [v for v in vals if v is not None]
        if name == base:
            ax.plot(xs, ys, "k--", lw=2, label=f"{name} (baseline)")
        else:
            ax.plot(xs, ys, "o-", ms=4, label=name)
    if ceiling:
        ax.axhline(ceiling, color="gray", lw=1, ls=":", label=ceiling_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(sw.xlabel)
    ax.set_ylabel(sw.unit)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def bars(names: Sequence[str], values: Sequence[float], unit: str, title: str = "",
         baseline: float | None = None, baseline_label: str = "baseline", ax=None):
    """Horizontal bars, one per version, with the baseline as a vertical line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
    y = range(len(names))
    ax.barh(list(y), list(values), color="tab:blue")
    ax.set_yticks(list(y), list(names))
    ax.invert_yaxis()
    for i, v in zip(y, values):
        pct = f" ({100 * v / baseline:.0f}%)" if baseline else ""
        ax.text(v, i, f" {v:.1f}{pct}", va="center", fontsize=8)
    if baseline:
        ax.axvline(baseline, color="k", ls="--", label=f"{baseline_label} {baseline:.1f}")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel(unit)
    ax.set_title(title)
    return ax
