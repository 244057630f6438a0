"""The strongest baseline a practitioner would run, and the physical bound beside it.

A speed claim in this book is a same-run ratio against what a reader would actually use instead:
PyTorch with its launches captured in one CUDA graph, and ``torch.compile``d then captured, not
eager PyTorch (which measures Python and launch overhead as much as the GPU). Beside that ratio
stands the physical bound: the bytes a step must move at the copy bandwidth measured in the same
run, or its FLOPs at the dense peak measured in the same run.

    step = cb.baselines.torch_graph(fn)           # fn's launches captured once; step() replays
    comp, why = cb.baselines.torch_compiled(fn)   # torch.compile(fn) after a trial call, or
                                                  # (None, the reason it cannot run here)
    b = cb.baselines.Bound("decode, batch 1", own_us=557.0, nbytes=267e6, gbs=4230.0)
    print(b)                                      # the bound, and the fraction of it reached
    b.record("ch07", size=1)                      # a results row with baseline "memory bound"

``fn`` takes no argument and reads and writes tensors that live as long as the graph: a graph
replays the same kernels on the same memory, so new data goes *into* those tensors.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["TorchGraph", "torch_graph", "torch_compiled", "quiet_compiler", "Bound",
           "peak_tflops"]


class TorchGraph:
    """A ``torch.cuda.CUDAGraph`` of one call of ``fn``. ``g()`` replays it on the current
    stream (asynchronously, like a launch); ``g.graph`` is the captured graph."""

    def __init__(self, graph: Any, name: str):
        self.graph = graph
        self.__name__ = name

    def __call__(self) -> None:
        self.graph.replay()


def torch_graph(fn: Callable[[], Any], *, warmup: int = 3, name: str | None = None,
                capture_error_mode: str = "global") -> TorchGraph:
    """Capture one call of ``fn`` (PyTorch work on the current device) in a CUDA graph.

    What PyTorch's documentation prescribes: ``warmup`` calls on a side stream first (lazy
    initialisation, cuBLAS workspaces, autotuning and the caching allocator all settle there, none
    of it inside the graph), then one call captured. An optimizer made with ``capturable=True``
    keeps its step count on the GPU, so the whole training step captures. ``capture_error_mode``
    is ``torch.cuda.graph``'s: "thread_local" where other threads of the process keep calling
    CUDA during the capture (NCCL's watchdog, when the step holds torch.distributed
    collectives), which the default "global" forbids.
    """
    import torch

    if not callable(fn):
        raise TypeError(f"torch_graph: fn must be a function of no argument, got "
                        f"{type(fn).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("torch_graph: CUDA graphs need a CUDA GPU and PyTorch built for it")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"torch_graph: warmup must be an int >= 1 (the warm-up is what keeps "
                         f"one-time work out of the graph), got {warmup!r}")
    prev = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(prev)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    prev.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
            fn()
    finally:
        # a capture that fails inside torch.cuda.graph leaves its capture stream current: every
        # later PyTorch launch would then run beside, not inside, the events that time it
        torch.cuda.set_stream(prev)
    torch.cuda.synchronize()
    return TorchGraph(g, name or f"CUDA graph of {getattr(fn, '__name__', 'fn')}")


def torch_compiled(fn: Callable[[], Any], *, mode: str = "max-autotune-no-cudagraphs",
                   ) -> tuple[Callable[[], Any] | None, str | None]:
    """``(torch.compile(fn, mode=mode), None)`` after one trial call, or ``(None, why)``: the
    pattern lesson 3 writes out when it first meets ``torch.compile``, kept here for later chapters.

    The default mode autotunes the generated kernels and leaves CUDA graphs to
    :func:`torch_graph`, so that the compiled step is captured whole, the way fast PyTorch
    decoders and training loops run it. Without Triton (a CPU-only PyTorch, an unsupported GPU)
    or when the compiler fails, the reason comes back instead and the caller prints it.
    """
    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        return None, "torch.compile's GPU code generator needs Triton (pip install triton)"
    f = torch.compile(fn, mode=mode)
    try:
        with quiet_compiler():       # the compiler runs (and autotunes) on this first call
            f()
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any compiler failure means: no compiled row here
        first = (str(err).splitlines() or [""])[0][:200]
        return None, f"torch.compile failed here ({type(err).__name__}: {first})"
    return f, None


@contextlib.contextmanager
def quiet_compiler() -> Iterator[None]:
    """While ``torch.compile`` generates and autotunes code: no autotuning tables, no notice
    about a candidate configuration it drops (Triton tiles that need more shared memory than the
    GPU has are tried and discarded on every GPU: "Runtime error during autotuning ... Ignoring
    this choice"), no deprecation warning from inside the compiler. A real failure still raises.
    Every setting is restored on exit."""
    import torch._inductor.config as ic

    patch = {k: v for k, v in (("max_autotune_report_choices_stats", False),
                               ("autotune_num_choices_displayed", 0)) if hasattr(ic, k)}
    loggers = [logging.getLogger(n) for n in ("torch._inductor", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with ic.patch(patch), warnings.catch_warnings(), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


_PEAK: dict[str, float] = {}


def peak_tflops(dtype: str = "bf16", n: int = 8192) -> float:
    """Dense matrix-multiply TFLOP/s measured once per process with cuBLAS through PyTorch
    (``n`` x ``n`` x ``n``, random data): the compute roof a tensor-core kernel is held to."""
    import torch

    from .bench import bench

    if dtype not in _PEAK:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "tf32": torch.float32}.get(dtype)
        if dt is None:
            raise ValueError(f"peak_tflops: dtype is one of bf16, fp16, fp32, tf32, got "
                             f"{dtype!r}")
        a = torch.randn(n, n, device="cuda", dtype=dt)
        b = torch.randn(n, n, device="cuda", dtype=dt)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        try:
            t = bench({"cuBLAS": lambda: a @ b}, flops=2.0 * n ** 3, repeat=10, quiet=True)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        _PEAK[dtype] = t["cuBLAS"].value
    return _PEAK[dtype]


@dataclass
class Bound:
    """The physical bound of one piece of work, and how close a measured time comes to it.

    Give ``nbytes`` and ``gbs`` (bytes that must move, at the copy bandwidth measured in the same
    run) for memory-bound work, or ``flops`` and ``tflops`` (at the dense peak measured in the
    same run) for compute-bound work. ``fraction`` is bound time / measured time: 1.0 is the wall.
    """
    name: str
    own_us: float
    nbytes: float | None = None
    gbs: float | None = None
    flops: float | None = None
    tflops: float | None = None

    def __post_init__(self):
        mem = self.nbytes is not None or self.gbs is not None
        comp = self.flops is not None or self.tflops is not None
        if mem == comp:
            raise ValueError("Bound: give nbytes and gbs (memory bound) or flops and tflops "
                             "(compute bound), one pair")
        pair = (self.nbytes, self.gbs) if mem else (self.flops, self.tflops)
        for v in (*pair, self.own_us):
            if v is None or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Bound {self.name!r}: every quantity must be a positive "
                                 f"number, got own_us={self.own_us!r}, pair={pair!r}")

    @property
    def kind(self) -> str:
        return "memory bound" if self.nbytes is not None else "compute bound"

    @property
    def bound_us(self) -> float:
        if self.nbytes is not None:
            return self.nbytes / (self.gbs * 1e3)
        return self.flops / (self.tflops * 1e6)

    @property
    def fraction(self) -> float:
        return self.bound_us / self.own_us

    def __str__(self) -> str:
        if self.nbytes is not None:
            how = f"{self.nbytes / 1e6:,.1f} MB at the {self.gbs:,.0f} GB/s copy"
        else:
            how = f"{self.flops / 1e9:,.1f} GFLOP at the {self.tflops:,.0f} TFLOP/s dense peak"
        return (f"{self.name}: {self.own_us:,.1f} us; {self.kind} {self.bound_us:,.1f} us "
                f"({how}) = {100 * self.fraction:.0f}% of the bound")

    def entry(self, chapter: str, size: Any = None) -> dict:
        """This bound as a results-file row: baseline "memory bound" or "compute bound"."""
        return {"chapter": chapter, "kernel": self.name, "metric": f"fraction of {self.kind}",
                "value": round(self.fraction, 3), "baseline": self.kind,
                "baseline_value": round(self.bound_us, 2), "ratio": round(self.fraction, 3),
                "size": size, "time_us": round(self.own_us, 2)}

    def record(self, chapter: str, size: Any = None) -> None:
        from . import results

        results.record([self.entry(chapter, size)])
