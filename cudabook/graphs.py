"""CUDA graphs from CuPy: capture a chain of launches once, replay it with one launch.

    g = cb.graphs.capture(layer)        # layer() launches many kernels on the current stream
    g()                                 # replays all of them on the current stream, no waiting
    cb.graphs.wall_us(g)                # wall-clock microseconds per replay, GPU work included

Every launch from Python costs host time (CuPy: a few microseconds, Numba: tens). A chain of
small kernels is then limited by the host, and the GPU idles between kernels. Capture records
the launches of one call into a graph; a replay submits the whole graph at once.

What capture needs: every kernel compiled and every buffer allocated *before* capture (``capture``
runs ``fn`` once first, for that), no synchronisation and no host-device copies inside ``fn``,
and every launch on the capturing stream (CuPy launches on the current stream, which ``capture``
sets). A graph replays the same kernels on the same buffers with the same scalar arguments:
change the data *in* the buffers, not the buffers.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any, Callable

from . import env

__all__ = ["CapturedGraph", "capture", "graph_nodes", "wall_us"]


def graph_nodes(graph: Any) -> int | None:
    """Number of nodes (kernels, copies, ...) in a captured ``cupy.cuda.graph.Graph`` (driver
    call ``cuGraphGetNodes``); None where the driver library cannot be reached."""
    handle = getattr(graph, "graph", None)
    if not handle:
        return None
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return None
    n = ctypes.c_size_t(0)
    rc = cuda.cuGraphGetNodes(ctypes.c_void_p(int(handle)), None, ctypes.byref(n))
    return int(n.value) if rc == 0 else None


class CapturedGraph:
    """A captured graph. ``g()`` launches it on the current stream (asynchronously, ordered with
    the other work of that stream, like a kernel launch); ``g(stream)`` on another one."""

    def __init__(self, graph: Any, nodes: int | None):
        self.graph, self.nodes = graph, nodes
        self.__name__ = f"graph of {nodes if nodes is not None else '?'} nodes"  # for timers

    def __call__(self, stream: Any = None) -> None:
        import cupy

        self.graph.launch(stream if stream is not None else cupy.cuda.get_current_stream())

    def synchronize(self) -> None:
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def replay_us(self, repeat: int = 50) -> float:
        """Microseconds per replay on the current stream: one replay to warm up, then
        ``repeat`` back to back between two CUDA events (GPU time, no host gaps counted)."""
        import cupy

        t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
        self()
        t0.record()
        for _ in range(repeat):
            self()
        t1.record()
        t1.synchronize()
        return 1e3 * cupy.cuda.get_elapsed_time(t0, t1) / repeat

    def __repr__(self) -> str:
        return f"CapturedGraph({self.nodes if self.nodes is not None else '?'} nodes)"


def capture(fn: Callable[[], Any], *, warmup: int = 1, stream: Any = None) -> CapturedGraph:
    """Capture the launches of one call of ``fn()`` into a CUDA graph (CuPy stream capture).

    ``fn`` runs ``warmup`` times first (compiles kernels, fills caches and memory pools), then
    once under capture on ``stream`` (a new non-blocking stream by default). The capturing stream
    first waits for the work already queued on the caller's current stream, so the warm-up runs
    after it, not beside it (a non-blocking stream is not ordered with the others by itself).
    Refuses a graph with no nodes: ``fn`` launched nothing on the capturing stream.
    """
    if not env.HAS_GPU:
        raise RuntimeError("capture needs a CUDA GPU (simulator mode)")
    import cupy

    s = stream or cupy.cuda.Stream(non_blocking=True)
    caller = cupy.cuda.get_current_stream()
    if s != caller:
        s.wait_event(caller.record())
    with s:
        for _ in range(warmup):
            fn()
        s.synchronize()
        s.begin_capture()
        try:
            fn()
        except Exception as e:
            try:
                s.end_capture()
            except Exception:  # noqa: BLE001 - the capture is already broken; report the cause
                pass
            raise RuntimeError(f"capture failed while running fn: {type(e).__name__}: {e}. "
                               "Inside a capture: no allocation, no synchronize, no copy to or "
                               "from the host, no kernel compiled for the first time.") from None
        graph = s.end_capture()
    nodes = graph_nodes(graph)
    if nodes == 0:
        raise RuntimeError("capture: the graph is empty - fn launched nothing on the capturing "
                           "stream (did it launch on another stream?)")
    return CapturedGraph(graph, nodes)


def wall_us(fn: Callable[[], Any], repeat: int = 50, warmup: int = 3) -> float:
    """Median wall-clock microseconds of ``fn()`` followed by a device synchronize: what one call
    costs the program, host launch overhead and GPU work together."""
    if not env.HAS_GPU:
        raise RuntimeError("wall_us needs a CUDA GPU (simulator mode)")
    import cupy

    dev = cupy.cuda.Device()
    for _ in range(warmup):
        fn()
    dev.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)
