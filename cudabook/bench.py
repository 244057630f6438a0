"""Timing kernels against the vendor baseline, in the same run.

``cupyx.profiler.benchmark`` warms each function up and measures the host time to issue it.
Then each repeat is timed with CUDA events bracketing exactly one call:

1. L2 is flushed by *reading* a buffer twice its size (written once, when it is made), so every
   repeat reads from HBM/DRAM, and the lines the previous call left dirty are written back
   during the flush, not inside the next timed call. A flush that writes (``fill(0)``) leaves L2
   full of dirty lines that the timed call then pays to write back, a cost that lands on a
   short memory-bound call (a GEMV) and can flatter or spoil a ratio between two of them;
2. a spin kernel keeps the GPU busy for longer than the host needs to launch the call
   (a Numba launch costs several times a CuPy launch in Python time; chapter 5 measures both).
   The start event therefore fires
   when the GPU, not the host, is ready, and launch overhead is not counted as kernel time;
3. the call runs between two events; the median over repeats is reported.

Every function is validated before it is timed (a wrong kernel is refused) and again after.

Numba kernels: convert CuPy/torch arrays once with ``numba.cuda.as_cuda_array`` and launch on
those. Launched on the CuPy arrays themselves, Numba synchronizes the producer's stream at every
launch (CUDA Array Interface semantics), which puts its host overhead back between the events.

Recording rows in the results file is ``cudabook.results``.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import env
from . import results as _results

__all__ = ["BenchError", "Row", "BenchTable", "Sweep", "bench", "sweep", "progress", "flush_l2"]


class BenchError(RuntimeError):
    """Refused to time: no GPU, or the output was wrong."""


_FLUSH = None
_SPIN = None


_READ_FLUSH = r'''
extern "C" __global__ void l2_read_flush(const int4* __restrict__ p, long long n, int* sink) {
    int acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x5eed) sink[0] = acc;   // never true (the buffer is zero): keeps the loads
}'''


def _flush_l2() -> None:
    """Evict L2 by reading a zeroed buffer of twice its size: clean lines, no writes pending."""
    global _FLUSH
    import cupy
    import numpy

    if _FLUSH is None:
        nbytes = max(int(env.info().l2_mb * 2**20) * 2, 64 * 2**20)
        buf = cupy.zeros(nbytes // 16 * 4, dtype=cupy.int32)
        kern = cupy.RawKernel(_READ_FLUSH, "l2_read_flush")
        sink = cupy.zeros(1, dtype=cupy.int32)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        _FLUSH = (kern, buf, sink, (4 * sms,))
    kern, buf, sink, grid = _FLUSH
    kern(grid, (256,), (buf, numpy.int64(buf.size // 4), sink))


def flush_l2() -> None:
    """Evict L2 the way ``bench`` does before each repeat (by reading a buffer twice its size,
    so no dirty lines are left to be written back inside the next timed call)."""
    _flush_l2()


def _spin(us: float) -> None:
    """Keep the GPU busy for about ``us`` microseconds (one thread reading clock64)."""
    global _SPIN
    import cupy

    if _SPIN is None:
        _SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}''', "spin")
    mhz = env.info().clock_mhz or 1500.0
    _SPIN((1,), (1,), (cupy.int64(int(us * mhz)),))


@dataclass
class Row:
    name: str
    time_us: float
    value: float | None          # throughput in `unit`
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    is_baseline: bool = False
    host_us: float | None = None   # host time to issue one call (launch overhead)
    alternative: bool = False      # a baseline that was given but was not the fastest

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline_value:
            return None
        return self.value / self.baseline_value


@dataclass
class BenchTable:
    rows: list[Row]
    size: Any = None
    extra: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        w = max(len(r.name) for r in self.rows)
        out = []
        for r in self.rows:
            s = f"{r.name:<{w}}  {r.time_us:10.1f} us"
            if r.value is not None:
                s += f"  {r.value:8.1f} {r.unit}"
            if r.is_baseline:
                s += "  (baseline)"
            elif r.ratio is not None:
                s += f"  = {100 * r.ratio:.0f}% of {r.baseline} ({r.baseline_value:.1f})"
            out.append(s)
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))

    def best(self) -> Row:
        cands = [r for r in self.rows if not r.is_baseline and not r.alternative]
        return min(cands, key=lambda r: r.time_us)

    def record(self, chapter: str, kernels: list[str] | None = None,
               path: str | os.PathLike | None = None) -> None:
        """Append these rows (all but the baselines, or ``kernels``) to the results file.

        The file is ``path``, else ``$CUDABOOK_RESULTS``; with neither, nothing is written.
        """
        _results.record(self.entries(chapter, kernels), path)

    def entries(self, chapter: str, kernels: list[str] | None = None) -> list[dict]:
        """The rows as results-file entries (see ``cudabook.results``)."""
        out = []
        for r in self.rows:
            if r.is_baseline or (kernels is None and r.alternative) or \
                    (kernels is not None and r.name not in kernels):
                continue
            out.append({"chapter": chapter, "kernel": r.name, "metric": r.unit,
                        "value": _round(r.value), "baseline": r.baseline,
                        "baseline_value": _round(r.baseline_value),
                        "ratio": _round(r.ratio, 3), "size": _jsonable(self.size),
                        "time_us": _round(r.time_us)})
        return out


def _round(x, nd=2):
    return None if x is None else round(float(x), nd)


def _jsonable(x):
    if x is None or isinstance(x, (int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return str(x)


def _torch_on_cupy_stream():
    """A context in which PyTorch launches on CuPy's current stream, where the events are recorded.

    The two libraries keep separate notions of the current stream. When they differ (a PyTorch
    side stream left current, CuPy switched to another stream), PyTorch work would run outside
    the events that time it and read as a few microseconds. Where they agree, or where PyTorch
    has not touched the GPU, nothing changes.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return contextlib.nullcontext()
    import cupy

    ptr = cupy.cuda.get_current_stream().ptr
    if torch.cuda.current_stream().cuda_stream == ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream() if ptr == 0
                             else torch.cuda.ExternalStream(ptr))


def _time(fn: Callable[[], Any], repeat: int, warmup: int, flush_l2: bool) -> tuple[float, float]:
    """(median GPU time of one call, median host time to issue it), in microseconds.

    ``cupyx.profiler.benchmark`` warms up and measures the host time of a call. It synchronizes
    the device before its first repeat, so it cannot keep the GPU busy through a slow launch; the
    GPU time therefore comes from our own events, recorded after the flush and the spin.
    """
    import cupy
    from cupyx.profiler import benchmark

    r = benchmark(fn, (), n_repeat=max(3, warmup), n_warmup=max(1, warmup))
    host_s = float(statistics.median(r.cpu_times))
    # spin for longer than the host needs to issue the call, so its overhead is hidden
    spin_us = min(20.0 + 2e6 * host_s, 20000.0)
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        if flush_l2:
            _flush_l2()
        _spin(spin_us)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))   # milliseconds
    return 1e3 * statistics.median(times), 1e6 * host_s


def _check_bench_args(fns, baseline, nbytes, flops, check, repeat, warmup) -> None:
    for what, m in (("fns", fns), ("baseline", baseline)):
        if m is None and what == "baseline":
            continue
        if not isinstance(m, Mapping):
            raise TypeError(f"bench: {what} must be a dict {{name: function}}, got "
                            f"{type(m).__name__}")
        for k, f in m.items():
            if not isinstance(k, str) or not callable(f):
                raise TypeError(f"bench: {what} maps names (str) to functions of no argument; "
                                f"got {k!r}: {type(f).__name__}")
    if baseline is not None and len(baseline) == 0:
        raise ValueError("bench: baseline is an empty dict: give at least one entry, or None")
    for what, v in (("bytes", nbytes), ("flops", flops)):
        if v is not None and (not isinstance(v, numbers.Real) or isinstance(v, bool) or v <= 0):
            raise TypeError(f"bench: {what} must be a positive number (the work of one call), "
                            f"got {v!r}")
    if nbytes is not None and flops is not None:
        raise ValueError("bench: give bytes (GB/s) or flops (TFLOP/s), not both")
    if check is not None and not callable(check):
        raise TypeError(f"bench: check must be a function check(name), got {type(check).__name__}")
    for what, v, lo in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
            raise TypeError(f"bench: {what} must be an int >= {lo}, got {v!r}")


def bench(fns: Mapping[str, Callable[[], Any]], *,
          baseline: Mapping[str, Callable[[], Any]] | None = None,
          bytes: float | None = None, flops: float | None = None,
          check: Callable[[str], Any] | None = None, repeat: int = 20, warmup: int = 2,
          flush_l2: bool = True, size: Any = None, quiet: bool = False) -> BenchTable:
    """Time each function in ``fns`` and the ``baseline`` in the same call.

    ``baseline`` holds one entry, or several ways a practitioner could run the same work (PyTorch
    captured, and compiled then captured, say): all are timed, and the fastest of them in this
    call is the baseline every ratio is taken against; the others stay in the table as rows with
    their own ratio to it (``Row.alternative``), and :meth:`BenchTable.record` leaves them out.
    ``bytes`` (moved through memory) gives GB/s; ``flops`` gives TFLOP/s. ``check(name)`` must
    raise if the output of the function called ``name`` is wrong; it runs before timing (a
    wrong kernel is refused) and after it.
    """
    _check_bench_args(fns, baseline, bytes, flops, check, repeat, warmup)
    if not env.HAS_GPU:
        raise BenchError("timing needs a CUDA GPU; this is simulator mode (cells marked %%gpu "
                         "are skipped)")
    unit, work = ("TFLOP/s", flops / 1e12) if flops else (("GB/s", bytes / 1e9) if bytes
                                                           else ("", None))
    with _torch_on_cupy_stream():
        rows = _bench_rows(fns, baseline, work, unit, check, repeat, warmup, flush_l2)
    table = BenchTable(rows, size=size)
    if not quiet:
        print(table)
    return table


def _bench_rows(fns, baseline, work, unit, check, repeat, warmup, flush_l2) -> list[Row]:
    base_items = list((baseline or {}).items())
    rows: list[Row] = []
    for i, (name, fn) in enumerate(base_items + list(fns.items())):
        is_base = i < len(base_items)
        if check is not None:
            try:
                fn()
                check(name)
            except Exception as e:  # noqa: BLE001
                raise BenchError(f"refusing to time {name}: its output is wrong:\n{e}") from None
        t, host_us = _time(fn, repeat, warmup, flush_l2)
        if check is not None:
            try:
                check(name)
            except Exception as e:  # noqa: BLE001
                raise BenchError(f"{name} was right before timing and wrong after it:\n{e}") \
                    from None
        val = work / (t * 1e-6) if work is not None else None
        rows.append(Row(name, t, val, unit, is_baseline=is_base, host_us=host_us))
    if base_items:
        # the strongest baseline: the fastest of those given, measured in this call
        k = min(range(len(base_items)), key=lambda j: rows[j].time_us)
        best = rows.pop(k)
        for r in rows[:len(base_items) - 1]:
            r.is_baseline, r.alternative = False, True
        rows.insert(0, best)
        bval = best.value
        for r in rows[1:]:
            r.baseline, r.baseline_value = best.name, bval
    return rows


@dataclass
class Sweep:
    """Bench tables over a range of sizes, for ``cudabook.plot.perf``."""
    sizes: list
    tables: list[BenchTable]
    xlabel: str = "size"

    def series(self) -> dict[str, list[float | None]]:
        names: list[str] = []
        for t in self.tables:
            for r in t.rows:
                if r.name not in names:
                    names.append(r.name)
        out = {}
        for n in names:
            vals = []
            for t in self.tables:
                try:
                    vals.append(t[n].value)
                except KeyError:
                    vals.append(None)
            out[n] = vals
        return out

    def baseline(self) -> str | None:
        for r in self.tables[0].rows:
            if r.is_baseline:
                return r.name
        return None

    @property
    def unit(self) -> str:
        return self.tables[0].rows[0].unit

    def record(self, chapter: str, kernels: list[str] | None = None) -> None:
        """Record every size's table (see ``BenchTable.record``)."""
        for t in self.tables:
            t.record(chapter, kernels)


def progress(items, desc: str):
    """``items`` with a text progress bar (stderr, no widget state in stored outputs); none when
    CUDABOOK_PROGRESS=0, which tools/gpu_execute.py sets so the book stores no bars."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False,
                disable=os.environ.get("CUDABOOK_PROGRESS", "1") == "0")


def sweep(sizes, setup: Callable[[Any], Mapping[str, Any]], *, xlabel: str = "size",
          desc: str = "sweep", **bench_kw) -> Sweep:
    """For each size, ``setup(size)`` returns ``bench`` keyword arguments; show progress."""
    if not callable(setup):
        raise TypeError(f"sweep: setup must be a function setup(size) -> dict of bench "
                        f"arguments, got {type(setup).__name__}")
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sweep: no sizes given")
    tables = []
    for n in progress(sizes, desc):
        kw = dict(bench_kw)
        got = setup(n)
        if not isinstance(got, Mapping):
            raise TypeError(f"sweep: setup({n!r}) returned {type(got).__name__}, not a dict of "
                            "bench arguments (fns=..., baseline=..., bytes=... or flops=...)")
        kw.update(got)
        tables.append(bench(quiet=True, size=n, **kw))
    return Sweep(sizes, tables, xlabel)


def __getattr__(name: str):
    """``record`` and ``RESULTS_ENV`` moved to ``cudabook.results``; old imports still work."""
    if name in ("record", "RESULTS_ENV"):
        return getattr(_results, name)
    raise AttributeError(f"module 'cudabook.bench' has no attribute {name!r}")
