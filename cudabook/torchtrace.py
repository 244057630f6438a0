"""Read a PyTorch profiler trace (Chrome trace JSON) as tables and a timeline.

    with torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        with torch.profiler.record_function("step"):
            model(x)
    evs = cb.torchtrace.events(prof)             # or a path to the exported .json
    print(cb.torchtrace.summary(evs, within="step"))
    cb.torchtrace.timeline(evs, within="step")

The profiler records host events (Python ops, ``record_function`` ranges, CUDA runtime and driver
calls such as ``cudaLaunchKernel``/``cuLaunchKernel``) and device events (kernels, copies)
through CUPTI, for every kernel of the process: CuPy's and Numba's launches appear next to
PyTorch's. A device event carries the ``correlation`` id of the host call that launched it;
``within`` uses it to keep the work of one annotated range.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["events", "select", "summary", "timeline", "TraceSummary"]

HOST_API = ("cuda_runtime", "cuda_driver")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def events(source: Any) -> list[dict]:
    """Complete ('X') events of a trace: from a profiler object, a path, or loaded JSON."""
    if hasattr(source, "export_chrome_trace"):
        fd, path = tempfile.mkstemp(suffix=".json", prefix="cudabook-trace-")
        os.close(fd)
        try:
            source.export_chrome_trace(path)
            with open(path) as f:
                data = json.load(f)
        finally:
            os.unlink(path)
    elif isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            data = json.load(f)
    elif isinstance(source, dict):
        data = source
    elif isinstance(source, list):
        data = {"traceEvents": source}
    else:
        raise TypeError(f"events: expected a profiler, a path or trace JSON, got "
                        f"{type(source).__name__}")
    evs = data.get("traceEvents", [])
    return [e for e in evs if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _corr(e: dict) -> Any:
    return (e.get("args") or {}).get("correlation")


def select(evs: list[dict], within: str | None) -> list[dict]:
    """Events of the host ranges named ``within`` (``record_function``) and the device work
    launched from inside them; all events if ``within`` is None."""
    if within is None:
        return list(evs)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in evs
             if e.get("cat") == "user_annotation" and e.get("name") == within]
    if not spans:
        have = sorted({e.get("name") for e in evs if e.get("cat") == "user_annotation"})
        raise KeyError(f"no record_function range {within!r} in the trace; it has {have[:10]}")
    inside = lambda e: any(a <= e["ts"] <= b for a, b in spans)
    host = [e for e in evs if e.get("cat") not in DEVICE + ("gpu_user_annotation",)
            and inside(e)]
    ids = {_corr(e) for e in host if e.get("cat") in HOST_API and _corr(e) is not None}
    dev = [e for e in evs if e.get("cat") in DEVICE and _corr(e) in ids]
    # device work whose launching call the trace lacks (a profiler without driver-API events):
    # kept when it starts inside a range, or before the range's own device work has finished
    known = {_corr(e) for e in evs if e.get("cat") in HOST_API}
    end = max([e["ts"] + e["dur"] for e in dev] + [b for _, b in spans])
    dev += [e for e in evs if e.get("cat") in DEVICE and _corr(e) not in known
            and any(a <= e["ts"] <= max(b, end) for a, b in spans)]
    return host + dev


@dataclass
class TraceSummary:
    """What a trace says: hot kernels, launch calls, copies, and how busy the GPU was."""
    kernels: list[tuple[str, str, int, float, float]]   # name, origin, calls, total us, mean us
    api: list[tuple[str, int, float]]                   # host API call, calls, mean us
    copies: list[tuple[str, int, float, float, float]]  # kind, calls, MB, total us, GB/s
    window_us: float = 0.0       # first device event start to last device event end
    busy_us: float = 0.0         # time with at least one kernel or copy running
    gaps: list[float] = field(default_factory=list)     # idle intervals between device events
    host_us: float = 0.0         # length of the host range(s)

    @property
    def busy_pct(self) -> float:
        return 100 * self.busy_us / self.window_us if self.window_us else 0.0

    def __str__(self) -> str:
        out = []
        if self.kernels:
            w = min(42, max(len(k[0]) for k in self.kernels))
            out.append(f"{'GPU kernel':<{w}} {'origin':>8s} {'calls':>5s} {'total us':>9s} "
                       f"{'mean us':>8s} {'share':>6s}")
            tot = sum(k[3] for k in self.kernels) or 1.0
            for name, origin, n, t, m in self.kernels:
                out.append(f"{name[:w]:<{w}} {origin:>8s} {n:5d} {t:9.1f} {m:8.2f} "
                           f"{100 * t / tot:5.1f}%")
        if self.copies:
            out.append("")
            out.append(f"{'copy':<36s} {'calls':>5s} {'MB':>8s} {'total us':>9s} {'GB/s':>7s}")
            for kind, n, mb, t, gbs in self.copies:
                out.append(f"{kind[:36]:<36s} {n:5d} {mb:8.1f} {t:9.1f} {gbs:7.1f}")
        if self.api:
            out.append("")
            out.append(f"{'host API call':<36s} {'calls':>5s} {'mean us':>8s}")
            for name, n, m in self.api:
                out.append(f"{name[:36]:<36s} {n:5d} {m:8.2f}")
        if self.window_us:
            g = self.gaps
            out.append("")
            out.append(f"host range {self.host_us:.1f} us; GPU window {self.window_us:.1f} us, "
                       f"busy {self.busy_us:.1f} us ({self.busy_pct:.0f}%); {len(g)} idle gaps, "
                       f"median {statistics.median(g) if g else 0:.1f} us, "
                       f"largest {max(g) if g else 0:.1f} us")
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


def _busy(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Union length of intervals, and the gaps between consecutive busy stretches."""
    busy, gaps, end = 0.0, [], None
    for a, b in sorted(intervals):
        if end is None:
            busy, end = b - a, b
        elif a > end:
            gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps


def summary(evs: list[dict], within: str | None = None,
            origin: Callable[[str], str] | None = None, top: int = 10,
            api_top: int = 6) -> TraceSummary:
    """Tables of a trace (or of the range ``within``): kernels by total time, host API calls by
    count, copies by kind; and the GPU's busy fraction and idle gaps. ``origin(name)`` labels a
    kernel (e.g. "CuPy" or "PyTorch")."""
    sel = select(evs, within)
    origin = origin or (lambda name: "")
    by: dict[str, list[float]] = {}
    for e in sel:
        if e.get("cat") == "kernel":
            by.setdefault(e["name"], []).append(e["dur"])
    kernels = sorted(((n, origin(n), len(d), sum(d), sum(d) / len(d)) for n, d in by.items()),
                     key=lambda k: -k[3])[:top]
    api: dict[str, list[float]] = {}
    for e in sel:
        if e.get("cat") in HOST_API:
            api.setdefault(e["name"], []).append(e["dur"])
    api_rows = sorted(((n, len(d), sum(d) / len(d)) for n, d in api.items()),
                      key=lambda a: -a[1] * a[2])[:api_top]
    cp: dict[str, list[tuple[float, float]]] = {}
    for e in sel:
        if e.get("cat") == "gpu_memcpy":
            cp.setdefault(e["name"], []).append((float((e.get("args") or {}).get("bytes", 0)),
                                                 e["dur"]))
    copies = []
    for kind, v in cp.items():
        nbytes, t = sum(b for b, _ in v), sum(d for _, d in v)
        copies.append((kind, len(v), nbytes / 1e6, t, nbytes / (t * 1e3) if t else 0.0))
    dev = [(e["ts"], e["ts"] + e["dur"]) for e in sel if e.get("cat") in DEVICE]
    host = [e for e in sel if e.get("cat") == "user_annotation" and e.get("name") == within]
    s = TraceSummary(kernels, api_rows, sorted(copies, key=lambda c: -c[3]))
    if dev:
        s.window_us = max(b for _, b in dev) - min(a for a, _ in dev)
        s.busy_us, s.gaps = _busy(dev)
    s.host_us = sum(e["dur"] for e in host)
    return s


def timeline(evs: list[dict], within: str | None = None, ax=None,
             origin: Callable[[str], str] | None = None, title: str = ""):
    """A Gantt chart of the range ``within``: host ranges and ops, CUDA API calls, GPU kernels
    (coloured by ``origin``) and copies, on one time axis in microseconds."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sel = select(evs, within)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 2.8))
    t0 = min((e["ts"] for e in sel), default=0.0)
    rows = [("host: ops", lambda e: e.get("cat") in ("cpu_op", "user_annotation")),
            ("host: CUDA API", lambda e: e.get("cat") in HOST_API),
            ("GPU: kernels", lambda e: e.get("cat") == "kernel"),
            ("GPU: copies", lambda e: e.get("cat") in ("gpu_memcpy", "gpu_memset"))]
    origin = origin or (lambda name: "")
    palette = ["tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown"]
    colours: dict[str, str] = {}
    for y, (label, keep) in enumerate(rows):
        for e in sel:
            if not keep(e):
                continue
            if label == "GPU: kernels":
                o = origin(e["name"]) or "kernel"
                c = colours.setdefault(o, palette[len(colours) % len(palette)])
            elif label == "GPU: copies":
                c = "tab:red" if "Pageable" in e["name"] else "tab:pink"
            else:
                c = "0.6" if e.get("cat") != "user_annotation" else "0.85"
            ax.broken_barh([(e["ts"] - t0, max(e["dur"], 0.3))], (len(rows) - 1 - y - 0.4, 0.8),
                           facecolors=c, edgecolor="none")
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)])
    ax.set_xlabel("time (us)")
    if colours:
        ax.legend(handles=[Patch(color=c, label=o) for o, c in colours.items()], fontsize=8,
                  loc="upper right")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return ax
