"""Plots in the style of the Triton tutorials' perf reports: one line per kernel version, the
vendor baseline dashed, throughput against problem size.

Styles (``styles``): the baseline is black and dashed; CUDA C++ (CuPy) versions are solid
lines with filled markers; Numba versions (a series named ``numba ...``) are dash-dotted with
hollow markers, so the two languages read apart even in grey. No two series share a colour.
Legends sit outside the data: right of the axes when nothing is drawn to their right, below
them in the last row of a grid of plots.
"""

from __future__ import annotations

import re
from typing import Sequence

from .bench import Sweep

__all__ = ["perf", "bars", "styles", "is_numba", "PALETTE"]

#: distinct colours, in the order series take them (tab10, then tab20's light shades, then
#: Dark2): 28 series before a colour repeats
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
           "#c7c7c7", "#dbdb8d", "#9edae5",
           "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
           "#666666")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
_NUMBA = re.compile(r"\bnumba\b", re.IGNORECASE)


def is_numba(name: str) -> bool:
    """A series of a Numba kernel: its name says ``numba`` (``numba v1``, ``Numba copy_v2``)."""
    return bool(_NUMBA.search(name))


def styles(names: Sequence[str], baseline: str | None = None) -> dict[str, dict]:
    """matplotlib keyword arguments of each series: the baseline black and dashed, CUDA C++
    solid with filled markers, Numba dash-dotted with hollow markers; every other series gets
    a colour of its own (``PALETTE``, then evenly spaced hues if there are more series)."""
    out: dict[str, dict] = {}
    others = [n for n in names if n != baseline]
    if len(others) > len(PALETTE):
        import matplotlib

        cmap = matplotlib.colormaps["hsv"]
        colours = [matplotlib.colors.to_hex(cmap(i / len(others))) for i in range(len(others))]
    else:
        colours = list(PALETTE)
    k_cuda = k_numba = 0
    for i, name in enumerate(others):
        if is_numba(name):
            mk = _MARKERS[k_numba % len(_MARKERS)]
            k_numba += 1
            out[name] = dict(color=colours[i], ls="-.", lw=1.5, marker=mk, ms=5,
                             mfc="white", mew=1.3)
        else:
            mk = _MARKERS[k_cuda % len(_MARKERS)]
            k_cuda += 1
            out[name] = dict(color=colours[i], ls="-", lw=1.5, marker=mk, ms=4)
    if baseline is not None:
        out[baseline] = dict(color="black", ls="--", lw=2, marker=None)
    return out


def _legend_outside(ax, fontsize: int = 8, n: int = 1) -> None:
    """The legend outside the data: right of the axes when nothing is drawn to their right,
    below them when they are in the last row of a grid, inside only when boxed in."""
    spec = ax.get_subplotspec() if hasattr(ax, "get_subplotspec") else None
    right_free = spec is None or spec.is_last_col()
    below_free = spec is None or spec.is_last_row()
    if right_free:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1),
                  borderaxespad=0)
    elif below_free:
        ax.legend(fontsize=fontsize, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=min(4, max(1, n)), borderaxespad=0)
    else:
        ax.legend(fontsize=fontsize, framealpha=0.9)


def perf(sw: Sweep, title: str = "", logx: bool = True, ax=None, ceiling: float | None = None,
         ceiling_label: str = "measured peak"):
    """Throughput of every version against size (styles: ``styles``); the legend outside."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8.5, 4))
    base = sw.baseline()
    series = sw.series()
    st = styles(list(series), base)
    for name, vals in series.items():
        xs = [x for x, v in zip(sw.sizes, vals) if v is not None]
        ys = [v for v in vals if v is not None]
        ax.plot(xs, ys, label=f"{name} (baseline)" if name == base else name, **st[name])
    if ceiling:
        ax.axhline(ceiling, color="gray", lw=1, ls=":", label=ceiling_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(sw.xlabel)
    ax.set_ylabel(sw.unit)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend_outside(ax, n=len(series) + bool(ceiling))
    return ax


def bars(names: Sequence[str], values: Sequence[float], unit: str, title: str = "",
         baseline: float | None = None, baseline_label: str = "baseline", ax=None):
    """Horizontal bars, one per version (Numba's hatched), the baseline a vertical line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    y = list(range(len(names)))
    hatches = ["//" if is_numba(n) else "" for n in names]
    ax.barh(y, list(values), color=["white" if h else "tab:blue" for h in hatches],
            edgecolor="tab:blue", hatch=hatches)
    ax.set_yticks(y, list(names))
    ax.invert_yaxis()
    for i, v in zip(y, values):
        pct = f" ({100 * v / baseline:.0f}%)" if baseline else ""
        ax.text(v, i, f" {v:.1f}{pct}", va="center", fontsize=8)
    if baseline:
        ax.axvline(baseline, color="k", ls="--", label=f"{baseline_label} {baseline:.1f}")
        _legend_outside(ax)
    ax.set_xlabel(unit)
    ax.set_title(title)
    return ax
