"""Tensor parallelism (Megatron-LM's column and row split) of the book's GPT (Chapter 11).

    from cudabook import tensor_parallel as tp
    ar = tp.TorchAllReduce()                                  # torch.distributed: gloo or NCCL
    mlp = tp.ParallelMLP(block.fc.weight, block.fc2.weight, rank, world, ar)
    att = tp.ParallelAttention(block.qkv.weight, block.proj.weight, n_head, rank, world, ar)
    blk = tp.ParallelBlock(block, rank, world, ar)            # LayerNorms + both, residuals
    net = tp.ParallelGPT(model, rank, world, ar)              # every block split, the rest copied
    y = net(ids); y.sum().backward()                          # same logits and gradients
    mlp.log                                   # [("forward g", elements, bytes), ...]

Shoeybi et al. 2019 (Megatron-LM, arXiv:1909.08053, section 3) split a transformer layer over N
ranks with two all-reduces in its forward pass and two in its backward pass:

* **MLP**: ``Y = GELU(X W1^T) W2^T``. W1 (4d x d, nn.Linear's (out, in) layout) is split by
  **rows** ("column-parallel" in the paper's X @ A notation: A = W1^T is split by columns): rank r
  holds W1[r 4d/N : (r+1) 4d/N] and computes its slice of the hidden layer, (.., 4d/N); GELU is
  elementwise, so it runs on the slice with no communication. W2 (d x 4d) is split by **columns**
  ("row-parallel"): rank r multiplies its hidden slice by W2[:, its 4d/N columns] and gets a
  (.., d) partial sum; one all-reduce adds the N partials.
* **Attention**: the QKV projection is split by **heads** (column-parallel: rank r holds the rows
  of W_qkv for its n_head/N heads of Q, of K and of V), each rank runs attention on its own heads
  (heads are independent), and the output projection is split by the matching columns
  (row-parallel), followed by one all-reduce.

The communication sits in two autograd functions (the paper's Figure 3):

* ``f``: identity in forward, **all-reduce in backward** (every rank's input gradient is only the
  part that flows through its own shards; the sum is the full gradient);
* ``g``: **all-reduce in forward** (the partial outputs), identity in backward (the output
  gradient is the same on every rank).

So a block costs 2 all-reduces of (tokens x d) in forward and 2 in backward, whatever N is; the
weights and the activations inside the MLP and attention are divided by N. The LayerNorms, the
embedding and the LM head are replicated: their gradients come out whole on every rank because
``f`` completed the gradient of their outputs. Every rank must feed the same input (the same
token ids): that is what "replicated" means, and nothing here can check it for free.

**The all-reduce is pluggable**: any callable ``ar(t)`` that sums the tensor ``t`` in place over
the ranks. ``TorchAllReduce`` is torch.distributed (gloo on CPU processes, NCCL on GPUs, a
process per rank). On the GPUs of one host the ranks can instead be **threads of one process**
(``ThreadGroup`` + ``run_threads``), which lets a single caller launch the book's own kernels
(``kernels/allreduce.cu``) on every GPU: ``one_host()`` sends messages up to ``threshold_bytes``
to ``one_shot_v2`` and larger ones to NCCL (CuPy's bindings, one communicator per GPU) or to
the book's ring. ``measure_crossover()`` measures where the one-shot stops winning on the GPUs at
hand (it prints why it skips on a machine without 2 GPUs).
"""

from __future__ import annotations

import copy
import threading
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TensorParallelError", "TorchAllReduce", "Threshold", "ThreadGroup", "run_threads",
           "local_sum", "PeerOneShot", "PeerRing", "CupyNccl", "one_host", "measure_crossover",
           "gpu_timing", "decode_timing", "compare_split", "ParallelDecoder", "split",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention",
           "ParallelBlock", "ParallelGPT", "ONE_SHOT_THRESHOLD"]

#: the default size (bytes) up to which ``one_host`` uses the book's one-shot kernel: the largest
#: size at which one_shot_v2 beat NCCL on 4 x H200 in lesson 11's earlier run (it won at 256 KB
#: and lost at 1 MB). ``measure_crossover()`` measures it on the machine at hand.
ONE_SHOT_THRESHOLD = 256 << 10


class TensorParallelError(ValueError):
    """A split that cannot be made (sizes, ranks) or an all-reduce that cannot run; the message
    says which and what to change."""


# ============================================================================ the all-reduces
class TorchAllReduce:
    """``ar(t)``: ``torch.distributed.all_reduce(t)`` (sum, in place) over ``group``; gloo on CPU
    processes, NCCL on GPUs. The process group must exist (``dist.spawn``, ``torchrun``)."""

    name = "torch.distributed"

    def __init__(self, group: Any = None):
        import torch.distributed as td

        if not td.is_available() or not td.is_initialized():
            raise TensorParallelError(
                "TorchAllReduce: torch.distributed is not initialised in this process; run the "
                "ranks with cudabook.dist.spawn (gloo) or torchrun, which call "
                "init_process_group, or pass another all-reduce")
        self.group = group
        self.world = td.get_world_size(group)
        self.rank = td.get_rank(group)

    def __call__(self, t: torch.Tensor) -> None:
        import torch.distributed as td

        td.all_reduce(t, group=self.group)


def _nbytes(x) -> int:
    t = x[0] if isinstance(x, (list, tuple)) else x
    return t.numel() * t.element_size()


class Threshold:
    """``small`` for messages of at most ``max_bytes`` bytes, ``large`` for the rest. Works for
    per-rank all-reduces (``ar(t)``) and for the list reducers of a ``ThreadGroup``
    (``reduce([t0, t1, ...])``): the size is that of one rank's tensor."""

    def __init__(self, small: Callable, large: Callable, max_bytes: int = ONE_SHOT_THRESHOLD):
        if not callable(small) or not callable(large):
            raise TensorParallelError("Threshold: small and large must be all-reduces "
                                      "(callables that sum in place)")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise TensorParallelError(f"Threshold: max_bytes must be an int >= 0, got "
                                      f"{max_bytes!r}")
        self.small, self.large, self.max_bytes = small, large, max_bytes
        self.world = getattr(small, "world", None) or getattr(large, "world", None)
        self.calls = {"small": 0, "large": 0}

    def __call__(self, x) -> None:
        which = "small" if _nbytes(x) <= self.max_bytes else "large"
        self.calls[which] += 1
        (self.small if which == "small" else self.large)(x)


def local_sum(ts: Sequence[torch.Tensor]) -> None:
    """The reference list reducer: every ``ts[r]`` = ts[0] + ... + ts[N-1], added in rank order on
    the first tensor's device (any devices; the CPU tests use it)."""
    total = ts[0].detach().clone()
    for t in ts[1:]:
        total += t.detach().to(total.device)
    for t in ts:
        t.copy_(total)


class ThreadGroup:
    """The ranks as ``world`` threads of one process: at each all-reduce every thread hands in its
    tensor and waits; the last to arrive runs ``reduce(list of the N tensors)`` (in place) for
    all, then all go on. ``member(r)`` is rank r's all-reduce. A rank that does not arrive within
    ``timeout`` seconds (it failed, or took another path) breaks the group: every waiting rank
    raises a ``TensorParallelError`` instead of hanging."""

    def __init__(self, world: int, reduce: Callable[[list], None], timeout: float = 60.0):
        if not isinstance(world, int) or world < 1:
            raise TensorParallelError(f"ThreadGroup: world must be an int >= 1, got {world!r}")
        if not callable(reduce):
            raise TensorParallelError("ThreadGroup: reduce must be a callable taking the list "
                                      "of the ranks' tensors")
        self.world, self.reduce, self.timeout = world, reduce, timeout
        self._slots: list = [None] * world
        self._error: BaseException | None = None
        self._count = 0
        self._barrier = threading.Barrier(world, action=self._run, timeout=timeout)

    def _run(self) -> None:
        self._count += 1
        ts = self._slots
        try:
            t0 = ts[0]
            for r, t in enumerate(ts):
                if t.shape != t0.shape or t.dtype != t0.dtype:
                    raise TensorParallelError(
                        f"all-reduce #{self._count}: rank {r} gave {tuple(t.shape)} "
                        f"{t.dtype}, rank 0 {tuple(t0.shape)} {t0.dtype}: every rank must "
                        "reduce a tensor of the same shape and dtype")
            self.reduce(ts)
            self._error = None
        except BaseException as e:  # noqa: BLE001  (every rank raises it, below)
            self._error = e
        finally:
            self._slots = [None] * self.world

    def abort(self) -> None:
        """Release every waiting rank with an error (a rank failed elsewhere). ``run_threads``
        makes the group usable again at its next call."""
        self._barrier.abort()

    def member(self, rank: int) -> Callable[[torch.Tensor], None]:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise TensorParallelError(f"ThreadGroup.member: rank {rank!r} is not in "
                                      f"0..{self.world - 1}")
        group = self

        class _Member:
            name = f"threads ({getattr(group.reduce, 'name', type(group.reduce).__name__)})"
            world = group.world

            def __call__(self, t: torch.Tensor) -> None:
                if not t.is_contiguous():
                    raise TensorParallelError(f"rank {rank}: the all-reduce needs a contiguous "
                                              "tensor")
                group._slots[rank] = t
                try:
                    group._barrier.wait()
                except threading.BrokenBarrierError:
                    raise TensorParallelError(
                        f"rank {rank}: the other ranks did not reach all-reduce "
                        f"#{group._count + 1} within {group.timeout:g} s (a rank failed, or "
                        "called the all-reduce a different number of times)") from None
                if group._error is not None:
                    raise TensorParallelError(f"rank {rank}: the all-reduce failed: "
                                              f"{group._error}") from group._error

        return _Member()


def run_threads(fn: Callable[..., Any], group: ThreadGroup, *args: Any,
                devices: Sequence[int] | None = None, timeout: float | None = None) -> list:
    """Run ``fn(rank, group.member(rank), *args)`` in ``group.world`` threads (rank r on CUDA
    device ``devices[r]`` when given) and return the results in rank order. An exception on one
    rank releases the others (``group.abort()``) and is raised here with that rank's traceback."""
    w = group.world
    if devices is not None and len(devices) != w:
        raise TensorParallelError(f"run_threads: {len(devices)} devices for {w} ranks")
    out: list = [None] * w
    errs: dict[int, str] = {}
    group._barrier.reset()                # usable again after an earlier run's failure
    group._slots, group._error = [None] * w, None

    def body(r: int) -> None:
        try:
            if devices is not None:
                torch.cuda.set_device(devices[r])          # per thread
            out[r] = fn(r, group.member(r), *args)
        except BaseException as e:  # noqa: BLE001
            errs[r] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout if timeout is not None else group.timeout * 4)
    if any(t.is_alive() for t in threads):
        group.abort()
        raise TensorParallelError(f"run_threads: ranks "
                                  f"{[r for r, t in enumerate(threads) if t.is_alive()]} did "
                                  "not finish (a hang outside the all-reduce?)")
    if errs:
        first = min(errs, key=lambda r: ("did not reach" in errs[r], r))   # the cause first
        raise TensorParallelError(f"rank {first} of {w} failed: {errs[first]}")
    return out


# -------------------------------------------------- list reducers on the GPUs of one host
def _cupy_views(ts, what: str, dtypes=(torch.float32,)):
    """Zero-copy CuPy 1-D views of contiguous CUDA tensors (DLPack)."""
    import cupy as cp

    out = []
    for r, t in enumerate(ts):
        if not t.is_cuda or not t.is_contiguous() or t.dtype not in dtypes:
            raise TensorParallelError(f"{what}: rank {r}'s tensor must be a contiguous CUDA "
                                      f"tensor of {[str(d) for d in dtypes]}, got {t.dtype} on "
                                      f"{t.device}")
        with cp.cuda.Device(t.device.index):
            out.append(cp.from_dlpack(t.view(-1)))
    return out


class PeerOneShot:
    """The book's ``one_shot_v2`` (push, flags in the data) over a ``PeerGroup``: float32, at
    most ``allreduce_launch.ONE_SHOT_MAX_BYTES`` per rank, in place, ordered after each GPU's
    current stream."""

    name = "one_shot_v2"

    def __init__(self, group):
        self.group = group
        self.world = group.world

    def __call__(self, ts) -> None:
        from .compile import load_launch

        cap = load_launch("allreduce").ONE_SHOT_MAX_BYTES
        if _nbytes(ts) > cap:
            raise TensorParallelError(f"PeerOneShot: {_nbytes(ts)} bytes per rank > "
                                      f"ONE_SHOT_MAX_BYTES ({cap}); put it behind a Threshold")
        xs = _cupy_views(ts, "PeerOneShot")
        self.group.one_shot(xs, xs, version="v2")


class PeerRing:
    """The book's P2P ring (``PeerGroup.ring``): float32 or bf16, any size, in place."""

    name = "P2P ring"

    def __init__(self, group):
        self.group = group
        self.world = group.world

    def __call__(self, ts) -> None:
        self.group.ring([t.view(-1) for t in ts])


class CupyNccl:
    """NCCL from one process (CuPy's bindings): one communicator per GPU, the N calls between
    ``groupStart`` and ``groupEnd``, each on the current PyTorch stream of its GPU (so it is
    ordered with the work around it)."""

    name = "NCCL (CuPy)"

    def __init__(self, devices: Sequence[int]):
        from . import dist

        nccl = dist.cupy_nccl()
        if nccl is None:
            raise TensorParallelError("CupyNccl: CuPy finds no NCCL library (see the message "
                                      "above); use PeerRing for large messages instead")
        self.nccl, self.devices = nccl, [int(d) for d in devices]
        self.world = len(self.devices)
        self.comms = nccl.NcclCommunicator.initAll(self.devices)
        self.types = {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            self.types[torch.bfloat16] = nccl.NCCL_BFLOAT16

    def __call__(self, ts) -> None:
        import cupy as cp

        nccl = self.nccl
        if ts[0].dtype not in self.types:
            raise TensorParallelError(f"CupyNccl: dtype {ts[0].dtype} is not one of "
                                      f"{[str(d) for d in self.types]}")
        for r, (t, d) in enumerate(zip(ts, self.devices)):
            if not t.is_cuda or t.device.index != d or not t.is_contiguous():
                raise TensorParallelError(f"CupyNccl: rank {r}'s tensor must be contiguous on "
                                          f"cuda:{d}, got {t.device}")
        nccl.groupStart()
        for t, d, c in zip(ts, self.devices, self.comms):
            with cp.cuda.Device(d):
                s = torch.cuda.current_stream(d).cuda_stream
                c.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self.types[t.dtype],
                            nccl.NCCL_SUM, s)
        nccl.groupEnd()


def one_host(devices: Sequence[int] | None = None, threshold_bytes: int = ONE_SHOT_THRESHOLD,
             large: str = "nccl", timeout: float = 60.0) -> ThreadGroup:
    """A ``ThreadGroup`` over the GPUs ``devices`` of this host (default: all): float32 messages
    up to ``threshold_bytes`` by the book's one-shot kernel, the rest by ``large`` ("nccl":
    CuPy's NCCL; "ring": the book's P2P ring). Run the ranks with
    ``run_threads(fn, group, devices=group.devices)``. Needs 2 or more GPUs with peer access."""
    from .compile import load_launch

    ar = load_launch("allreduce")
    if large not in ("nccl", "ring"):
        raise TensorParallelError(f"one_host: large is 'nccl' or 'ring', got {large!r}")
    if threshold_bytes > ar.ONE_SHOT_MAX_BYTES:
        raise TensorParallelError(f"one_host: threshold_bytes {threshold_bytes} > the one-shot's "
                                  f"largest message ({ar.ONE_SHOT_MAX_BYTES} bytes)")
    g = ar.PeerGroup(devices)                  # refuses fewer than 2 GPUs, or no peer access
    big = CupyNccl(g.devices) if large == "nccl" else PeerRing(g)
    small = PeerOneShot(g)

    def reduce(ts) -> None:
        use_small = ts[0].dtype == torch.float32 and _nbytes(ts) <= threshold_bytes
        reduce.calls["small" if use_small else "large"] += 1        # type: ignore[attr-defined]
        (small if use_small else big)(ts)

    reduce.name = f"one_shot_v2 <= {threshold_bytes} B < {big.name}"   # type: ignore[attr-defined]
    reduce.calls = {"small": 0, "large": 0}                           # type: ignore[attr-defined]
    tg = ThreadGroup(g.world, reduce, timeout)
    tg.devices = g.devices                     # type: ignore[attr-defined]
    tg.peer_group = g                          # type: ignore[attr-defined]
    return tg


def measure_crossover(devices: Sequence[int] | None = None,
                      sizes: Sequence[int] | None = None) -> dict | None:
    """On the GPUs of this host (default: all, at least 2): time the book's ``one_shot_v2`` and
    NCCL (CuPy, one process, the group's streams: the same harness) per message size, each checked
    first, and return ``{"world", "rows": [{"bytes", "one_shot_us", "nccl_us", "ring_us"}],
    "threshold_bytes"}``: the largest size up to which the one-shot won at every size (0 if it
    never won), the value to pass to ``one_host``. Prints the table. On a machine without 2 GPUs
    it prints why it skips and returns None."""
    from . import dist
    from .compile import load_launch

    if not dist.need_gpus(2, "the one-shot / NCCL crossover"):
        return None
    import cupy as cp

    ar = load_launch("allreduce")
    sizes = list(sizes or [4 << 10 << k for k in range(0, 11, 2)])   # 4 KB .. 4 MB
    if any(s % 16 or s > ar.ONE_SHOT_MAX_BYTES or s <= 0 for s in sizes):
        raise TensorParallelError(f"measure_crossover: sizes must be multiples of 16 bytes in "
                                  f"(0, {ar.ONE_SHOT_MAX_BYTES}], got {sizes}")
    g = ar.PeerGroup(devices)
    own = ar.sweep(g, sizes, one_shot_max=max(sizes))     # checked, then timed: one-shot, ring
    nccl = dist.cupy_nccl()
    comms = nccl.NcclCommunicator.initAll(g.devices) if nccl is not None else None
    rows = []
    for row in own:
        n = row["bytes"] // 4
        out = {"bytes": row["bytes"], "one_shot_us": row["one_shot_v2_us"],
               "ring_us": row["ring_us"], "nccl_us": None}
        if comms is not None:
            bufs = []
            for r, d in enumerate(g.devices):
                with cp.cuda.Device(d):
                    bufs.append(cp.full(n, r + 1, cp.float32))
                    cp.cuda.Device(d).synchronize()

            def call() -> None:
                nccl.groupStart()
                for d, c, b, s in zip(g.devices, comms, bufs, g.streams):
                    with cp.cuda.Device(d):
                        c.allReduce(b.data.ptr, b.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                    s.ptr)
                nccl.groupEnd()

            call()
            g.synchronize()
            want = g.world * (g.world + 1) // 2
            for d, b in zip(g.devices, bufs):
                with cp.cuda.Device(d):
                    if not bool((b == want).all()):
                        raise RuntimeError(f"NCCL (CuPy): wrong sum on GPU {d} at {row['bytes']} B")
                    b.fill(0.0)                   # sums of zeros: finite after any count
                    cp.cuda.Device(d).synchronize()
            out["nccl_us"] = g.device_time_us(call, iters=50)
        rows.append(out)
    if comms is not None:
        for c in comms:
            c.destroy()
    base = "nccl_us" if comms is not None else "ring_us"
    threshold = 0
    for r in rows:
        if r["one_shot_us"] >= r[base]:
            break
        threshold = r["bytes"]
    name = "NCCL (CuPy)" if comms is not None else "our ring (no NCCL library for CuPy)"
    print(f"{g.world} GPUs: us per all-reduce, one_shot_v2 against {name}")
    print(f"{'bytes':>9s} {'one-shot':>9s} {name.split(' (')[0]:>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['bytes']:9d} {r['one_shot_us']:9.1f} {r[base]:9.1f} "
              f"{r[base] / r['one_shot_us']:6.2f}")
    print(f"one-shot faster at every size up to {threshold} bytes: one_host(threshold_bytes="
          f"{threshold})")
    return {"world": g.world, "rows": rows, "threshold_bytes": threshold, "baseline": name}


class ParallelDecoder:
    """``decoder.StaticCacheDecoder``'s step (static KV cache, position on the GPU, capturable)
    with every block split over ``world`` ranks as in ``ParallelBlock``: rank r holds the Q, K, V
    rows and the cache of heads [r H/N, (r+1) H/N), the matching columns of the output
    projection, rows r of ``fc`` and columns r of ``fc2``; two all-reduces of one token's
    activation (B, 1, d) per block. The embedding, the LayerNorms and the LM head are replicated.

        dec = tp.ParallelDecoder(model, rank, world, tp.TorchAllReduce(), batch=1, length=1024)
        dec.prefill(ids)          # the unsplit model fills a full cache once; this rank keeps its
        dec.step()                # heads. tok at pos in; logits, next tok and pos + 1 out

    Every rank must run ``prefill`` and then the same number of steps (each step's all-reduces
    meet the other ranks'). ``world`` must divide the number of heads."""

    def __init__(self, model: nn.Module, rank: int, world: int, allreduce: Callable,
                 batch: int = 1, length: int | None = None):
        _check_rank(rank, world, "ParallelDecoder")
        cfg = self.cfg = model.cfg
        if cfg.n_head % world:
            raise TensorParallelError(f"ParallelDecoder: {cfg.n_head} heads cannot be split over "
                                      f"{world} ranks (world must divide n_head: one of "
                                      f"{_divisors(cfg.n_head)})")
        self.wire = _Wire(allreduce, world, "ParallelDecoder")
        self.model, self.rank, self.world = model, rank, world
        self.B, self.L = int(batch), int(length or cfg.ctx)
        if self.B < 1 or not 2 <= self.L <= cfg.ctx:
            raise TensorParallelError(f"ParallelDecoder: batch >= 1 and 2 <= length <= {cfg.ctx}, "
                                      f"got batch {batch}, length {length}")
        H, D, d = cfg.n_head, cfg.head_dim, cfg.d
        h, k4 = H // world, 4 * d // world
        self.h = h
        p = next(model.parameters())
        dev, dt = p.device, p.dtype
        self.w = []
        with torch.no_grad():
            for b in model.blocks:
                qkv = b.qkv.weight.reshape(3, H, D, d)[:, rank * h:(rank + 1) * h]
                self.w.append((qkv.reshape(3 * h * D, d).contiguous(),
                               b.proj.weight[:, rank * h * D:(rank + 1) * h * D].contiguous(),
                               b.fc.weight[rank * k4:(rank + 1) * k4].contiguous(),
                               b.fc2.weight[:, rank * k4:(rank + 1) * k4].contiguous()))
        shape = (cfg.n_layer, self.B, h, self.L, D)
        self.k = torch.zeros(shape, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.tok = torch.zeros(self.B, 1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(self.B, cfg.vocab, dtype=torch.float32, device=dev)
        self.ar = torch.arange(self.L, device=dev)
        self.host_pos = 0

    @property
    def log(self) -> list:
        return self.wire.log

    def prefill(self, ids) -> torch.Tensor:
        """The prompt ``ids`` (B, T) through the unsplit model (``StaticCacheDecoder.prefill``,
        a full cache made once); this rank keeps its heads' keys and values. Returns the
        logits (B, T, vocab)."""
        from .decoder import StaticCacheDecoder

        full = StaticCacheDecoder(self.model, self.B, self.L)
        lg = full.prefill(ids)
        r, h = self.rank, self.h
        self.k.copy_(full.cache.k[:, :, r * h:(r + 1) * h])
        self.v.copy_(full.cache.v[:, :, r * h:(r + 1) * h])
        self.tok.copy_(full.tok)
        self.logits.copy_(full.logits)
        self.reset(full.host_pos)
        return lg

    def reset(self, pos: int) -> None:
        self.pos.fill_(int(pos))
        self.host_pos = int(pos)

    def step(self) -> None:
        """One decode step, device work only (capturable), the same as StaticCacheDecoder.step
        on this rank's heads and slices, with the all-reduce after the projection and after
        fc2."""
        from .gpt import _rope

        m, B, cfg, h = self.model, self.B, self.cfg, self.h
        D = cfg.head_dim
        with torch.no_grad():
            p1 = self.pos.view(1)
            cos, sin = m.cos.index_select(0, p1), m.sin.index_select(0, p1)
            mask = (self.ar <= self.pos).view(1, 1, 1, self.L)
            x = m.wte(self.tok)                                         # (B, 1, d)
            for i, (b, (wqkv, wproj, wfc, wfc2)) in enumerate(zip(m.blocks, self.w)):
                qkv = F.linear(b.ln1(x), wqkv).view(B, 1, 3, h, D).permute(2, 0, 3, 1, 4)
                q, k = _rope(qkv[0], cos, sin), _rope(qkv[1], cos, sin)   # (B, h, 1, D)
                K, V = self.k[i], self.v[i]
                K.index_copy_(2, p1, k)
                V.index_copy_(2, p1, qkv[2])
                o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
                y = F.linear(o.transpose(1, 2).reshape(B, 1, h * D), wproj)
                self.wire(y, "decode proj")
                x = x + y
                y = F.linear(F.gelu(F.linear(b.ln2(x), wfc), approximate="tanh"), wfc2)
                self.wire(y, "decode fc2")
                x = x + y
            lg = m.head(m.ln_f(x)).float()[:, -1]
            self.logits.copy_(lg)
            self.tok.copy_(lg.argmax(-1, keepdim=True))
            self.pos.add_(1)


def compare_split(comm, cfg) -> dict:
    """One rank of ``dist.spawn(compare_split, N, cfg)``: the unsplit model and its split over the
    N ranks, the same weights and token ids on every rank; returns the largest difference of
    the logits and of rank's slice of the first block's ``fc`` gradient, that slice's shape, and
    the log of the all-reduces (where, elements, bytes)."""
    model = gpt_build(cfg)
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    net = ParallelGPT(model, comm.rank, comm.world, TorchAllReduce())
    y, ref = net(ids), model(ids)                     # split (all-reduces) and unsplit
    y.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    fc, k = net.blocks[0].mlp.fc.weight, net.blocks[0].mlp.fc.weight.shape[0]
    want = model.blocks[0].fc.weight.grad[comm.rank * k:(comm.rank + 1) * k]
    return {"logits": float((y - ref).abs().max()),
            "grad": float((fc.grad - want).abs().max()), "fc": tuple(fc.shape),
            "log": net.log}


def gpt_build(cfg):
    """``gpt.build(cfg, seed=0)``: the same weights on every rank."""
    from . import gpt

    return gpt.build(cfg, seed=0)


def gpu_timing(world: int, *, batch: int = 8, seq: int = 1024, parts: str = "mlp,block,gpt,comm",
               steps: int = 20, warmup: int = 5, device: str = "cuda", cfg=None,
               timeout: float = 600.0) -> dict | None:
    """Forward + backward times of the split MLP, block and model against one GPU and torch's
    ``parallelize_module`` at GPT-2-small shapes (or ``cfg``), ``batch`` x ``seq`` tokens on every
    rank: torchrun of ``dist_scripts/tp_train.py`` with ``world`` processes (NCCL, bf16; world 1
    times the unsplit modules). ``device="cpu"``: gloo processes in float32, a check that runs
    anywhere. None (after saying why) without the GPUs."""
    from . import dist
    from .gpt import GPT2_SMALL

    cfg = cfg or GPT2_SMALL
    if not isinstance(world, int) or world < 1:
        raise TensorParallelError(f"gpu_timing: world must be an int >= 1, got {world!r}")
    if cfg.n_head % world or (4 * cfg.d) % world:
        raise TensorParallelError(f"gpu_timing: {world} ranks cannot split {cfg.n_head} heads "
                                  f"(world must divide n_head: one of {_divisors(cfg.n_head)})")
    if device == "cuda" and not dist.need_gpus(world, "the tensor-parallel timing"):
        return None
    args = ["--batch", batch, "--seq", seq, "--dim", cfg.d, "--n-head", cfg.n_head,
            "--layers", cfg.n_layer, "--vocab", cfg.vocab, "--steps", steps, "--warmup", warmup,
            "--parts", parts, "--device", device]
    return dist.torchrun("tp_train", world, args=[str(a) for a in args], timeout=timeout)


def decode_timing(world: int, *, batch: int = 1, prompt: int = 512, steps: int = 100,
                  device: str = "cuda", cfg=None, timeout: float = 600.0) -> dict | None:
    """Microseconds per token of ``ParallelDecoder`` on ``world`` GPUs of this host (world 1:
    ``decoder.StaticCacheDecoder``, the book's PyTorch baseline), each captured in a CUDA graph,
    at GPT-2-small shapes (or ``cfg``) after a ``prompt``-token prefill: torchrun of
    ``dist_scripts/tp_decode.py``. ``device="cpu"``: gloo processes, the eager check only. None
    (after saying why) without the GPUs."""
    from . import dist
    from .gpt import GPT2_SMALL

    cfg = cfg or GPT2_SMALL
    if not isinstance(world, int) or world < 1 or cfg.n_head % world:
        raise TensorParallelError(f"decode_timing: world must be an int >= 1 that divides "
                                  f"n_head (one of {_divisors(cfg.n_head)}), got {world!r}")
    if device == "cuda" and not dist.need_gpus(world, "the tensor-parallel decode"):
        return None
    args = ["--batch", batch, "--prompt", prompt, "--length", cfg.ctx, "--steps", steps,
            "--dim", cfg.d, "--n-head", cfg.n_head, "--layers", cfg.n_layer, "--vocab",
            cfg.vocab, "--device", device]
    return dist.torchrun("tp_decode", world, args=[str(a) for a in args], timeout=timeout)


# ============================================================================ f and g
class _Wire:
    """What the split layers of one module share: the all-reduce and the log of its calls."""

    def __init__(self, allreduce: Callable, world: int, what: str):
        if not callable(allreduce):
            raise TensorParallelError(f"{what}: allreduce must be a callable that sums a tensor "
                                      f"in place over the ranks (TorchAllReduce(), a "
                                      f"ThreadGroup member, ...), got {type(allreduce).__name__}")
        w = getattr(allreduce, "world", None)
        if w is not None and w != world:
            raise TensorParallelError(f"{what}: world={world} but the all-reduce spans {w} "
                                      "ranks")
        self.allreduce, self.world = allreduce, world
        self.log: list[tuple[str, int, int]] = []

    def __call__(self, t: torch.Tensor, where: str) -> None:
        self.log.append((where, t.numel(), t.numel() * t.element_size()))
        if self.world > 1:
            self.allreduce(t)


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, wire):
        ctx.wire = wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.wire(grad, "backward f")
        return grad, None


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity backward."""

    @staticmethod
    def forward(ctx, x, wire):
        y = x.contiguous().clone()
        wire(y, "forward g")
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _check_rank(rank: int, world: int, what: str) -> None:
    if not isinstance(world, int) or world < 1:
        raise TensorParallelError(f"{what}: world must be an int >= 1, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise TensorParallelError(f"{what}: rank {rank!r} is not in 0..{world - 1}")


def _divisors(n: int) -> list[int]:
    """The world sizes that split ``n`` evenly (named in the refusals)."""
    return [k for k in range(1, n + 1) if n % k == 0]


def split(w: torch.Tensor, rank: int, world: int, dim: int, what: str = "split") -> torch.Tensor:
    """Rank ``rank``'s share of ``w`` along ``dim``: ``w.shape[dim] / world`` consecutive
    indices, as a new tensor (a copy). Refuses a size that ``world`` does not divide."""
    _check_rank(rank, world, what)
    n = w.shape[dim]
    if n % world:
        ok = _divisors(n)
        raise TensorParallelError(f"{what}: size {n} of dim {dim} cannot be split over {world} "
                                  f"ranks (each rank needs a whole share); world must divide "
                                  f"{n}: one of {ok[:12]}{' ...' if len(ok) > 12 else ''}")
    k = n // world
    return w.detach().narrow(dim, rank * k, k).clone()


def _weight(w, shape: tuple, what: str) -> torch.Tensor:
    if isinstance(w, nn.Linear):
        if w.bias is not None:
            raise TensorParallelError(f"{what}: the book's GPT has no biases; a Linear with a "
                                      "bias is not supported here")
        w = w.weight
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TensorParallelError(f"{what}: expected a 2-D weight (out, in) or an nn.Linear, "
                                  f"got {type(w).__name__}")
    if shape and tuple(w.shape) != shape:
        raise TensorParallelError(f"{what}: expected shape {shape}, got {tuple(w.shape)}")
    return w


def _check_x(x: torch.Tensor, d: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != d:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TensorParallelError(f"{what}: expects x of shape (..., {d}), got {shape}")


# ============================================================================ the layers
class ColumnParallelLinear(nn.Module):
    """y_r = f(x) @ W[r-th block of rows]^T: rank r's slice of the outputs (.., out/N). The input
    is replicated; its gradient is all-reduced in backward (f)."""

    def __init__(self, weight, rank: int, world: int, allreduce: Callable | None = None,
                 wire: _Wire | None = None):
        super().__init__()
        w = _weight(weight, (), "ColumnParallelLinear")
        self.wire = wire or _Wire(allreduce, world, "ColumnParallelLinear")
        self.weight = nn.Parameter(split(w, rank, world, 0, "ColumnParallelLinear (rows of W)"))
        self.rank, self.world, self.d_in = rank, world, w.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_x(x, self.d_in, "ColumnParallelLinear")
        return F.linear(_F.apply(x, self.wire), self.weight)


class RowParallelLinear(nn.Module):
    """y = g(x_r @ W[:, r-th block of columns]^T): the input is rank r's slice (.., in/N), the
    partial products are all-reduced in forward (g); the output is replicated."""

    def __init__(self, weight, rank: int, world: int, allreduce: Callable | None = None,
                 wire: _Wire | None = None):
        super().__init__()
        w = _weight(weight, (), "RowParallelLinear")
        self.wire = wire or _Wire(allreduce, world, "RowParallelLinear")
        self.weight = nn.Parameter(split(w, rank, world, 1, "RowParallelLinear (columns of W)"))
        self.rank, self.world = rank, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_x(x, self.weight.shape[1], "RowParallelLinear (this rank's slice)")
        return _G.apply(F.linear(x, self.weight), self.wire)


class ParallelMLP(nn.Module):
    """The GPT MLP ``fc2(GELU_tanh(fc(x)))`` split over ``world`` ranks: fc column-parallel (rows
    of its (4d, d) weight), GELU on the local slice, fc2 row-parallel (columns of its (d, 4d)
    weight), one all-reduce in forward (g) and one in backward (f). ``world`` must divide 4d."""

    def __init__(self, fc, fc2, rank: int, world: int, allreduce: Callable,
                 wire: _Wire | None = None):
        super().__init__()
        _check_rank(rank, world, "ParallelMLP")
        w1 = _weight(fc, (), "ParallelMLP fc")
        w2 = _weight(fc2, (w1.shape[1], w1.shape[0]), "ParallelMLP fc2")
        hidden = w1.shape[0]
        if hidden % world:
            raise TensorParallelError(f"ParallelMLP: the hidden size {hidden} is not divisible by "
                                      f"world={world}: each rank takes hidden/world whole rows "
                                      "of fc and columns of fc2")
        self.wire = wire or _Wire(allreduce, world, "ParallelMLP")
        self.fc = ColumnParallelLinear(w1, rank, world, wire=self.wire)
        self.fc2 = RowParallelLinear(w2, rank, world, wire=self.wire)
        self.d = w1.shape[1]

    @property
    def log(self) -> list:
        return self.wire.log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_x(x, self.d, "ParallelMLP")
        return self.fc2(F.gelu(self.fc(x), approximate="tanh"))


class ParallelAttention(nn.Module):
    """The GPT's causal multi-head attention with RoPE split by heads: rank r holds the Q, K and V
    rows of heads [r H/N, (r+1) H/N) of the (3d, d) QKV weight (column-parallel) and the matching
    columns of the (d, d) output projection (row-parallel); one all-reduce in forward (g), one in
    backward (f). ``world`` must divide the number of heads. ``forward(x, cos, sin)`` takes the
    rotary tables of ``gpt.rope_tables`` for the T positions of x (B, T, d); no KV cache."""

    def __init__(self, qkv, proj, n_head: int, rank: int, world: int, allreduce: Callable,
                 wire: _Wire | None = None):
        super().__init__()
        _check_rank(rank, world, "ParallelAttention")
        wq = _weight(qkv, (), "ParallelAttention qkv")
        d = wq.shape[1]
        _weight(qkv, (3 * d, d), "ParallelAttention qkv")
        wp = _weight(proj, (d, d), "ParallelAttention proj")
        if not isinstance(n_head, int) or n_head < 1 or d % n_head:
            raise TensorParallelError(f"ParallelAttention: n_head={n_head!r} must divide d={d}")
        if n_head % world:
            ok = _divisors(n_head)
            raise TensorParallelError(f"ParallelAttention: {n_head} heads cannot be split over "
                                      f"{world} ranks: each rank computes whole heads, so world "
                                      f"must divide n_head (one of {ok})")
        D = d // n_head
        self.wire = wire or _Wire(allreduce, world, "ParallelAttention")
        self.d, self.n_head, self.head_dim, self.local_heads = d, n_head, D, n_head // world
        # (3d, d) rows are [q | k | v], each [head, dim]: take this rank's heads of all three
        w3 = wq.detach().reshape(3, n_head, D, d)
        mine = split(w3, rank, world, 1, "ParallelAttention (heads)").reshape(-1, d)
        self.qkv = ColumnParallelLinear(mine, 0, 1, wire=self.wire)      # already this rank's
        self.qkv.rank, self.qkv.world = rank, world
        self.proj = RowParallelLinear(wp, rank, world, wire=self.wire)   # columns h*D + j

    @property
    def log(self) -> list:
        return self.wire.log

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from .gpt import _rope

        if x.dim() != 3 or x.shape[-1] != self.d:
            raise TensorParallelError(f"ParallelAttention: expects x of shape (B, T, {self.d}), "
                                      f"got {tuple(x.shape)}")
        B, T, _ = x.shape
        if cos.shape != (T, self.head_dim // 2) or sin.shape != cos.shape:
            raise TensorParallelError(f"ParallelAttention: cos and sin must be (T, head_dim/2) = "
                                      f"{(T, self.head_dim // 2)}, got {tuple(cos.shape)}, "
                                      f"{tuple(sin.shape)} (gpt.rope_tables(cfg, T))")
        h, D = self.local_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, h, D).permute(2, 0, 3, 1, 4)   # (B, h, T, D) each
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # this rank's heads
        return self.proj(o.transpose(1, 2).reshape(B, T, h * D))


class ParallelBlock(nn.Module):
    """One block of ``gpt.GPT`` split over ``world`` ranks: ``x + attn(ln1(x))`` then
    ``+ mlp(ln2(x))``, the LayerNorms replicated (copies), attention and MLP parallel: 2
    all-reduces in forward, 2 in backward."""

    def __init__(self, block: nn.Module, rank: int, world: int, allreduce: Callable):
        super().__init__()
        for name in ("ln1", "ln2", "qkv", "proj", "fc", "fc2", "cfg"):
            if not hasattr(block, name):
                raise TensorParallelError(f"ParallelBlock: expected a block of cudabook.gpt.GPT "
                                          f"(no attribute {name!r})")
        self.wire = _Wire(allreduce, world, "ParallelBlock")
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelAttention(block.qkv, block.proj, block.cfg.n_head, rank, world,
                                      allreduce, wire=self.wire)
        self.mlp = ParallelMLP(block.fc, block.fc2, rank, world, allreduce, wire=self.wire)

    @property
    def log(self) -> list:
        return self.wire.log

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """``gpt.GPT`` with every block split over ``world`` ranks; the embedding, the final
    LayerNorm and the LM head are replicated (copies). ``forward(idx)`` -> logits (B, T, vocab),
    the same on every rank; no KV cache. ``log`` lists every all-reduce of every block."""

    def __init__(self, model: nn.Module, rank: int, world: int, allreduce: Callable):
        super().__init__()
        if not all(hasattr(model, a) for a in ("cfg", "wte", "blocks", "ln_f", "head")):
            raise TensorParallelError("ParallelGPT: expected a cudabook.gpt.GPT model")
        self.cfg = model.cfg
        self.wte, self.ln_f = copy.deepcopy(model.wte), copy.deepcopy(model.ln_f)
        self.head = copy.deepcopy(model.head)
        self.blocks = nn.ModuleList(ParallelBlock(b, rank, world, allreduce)
                                    for b in model.blocks)
        self.register_buffer("cos", model.cos.detach().clone(), persistent=False)
        self.register_buffer("sin", model.sin.detach().clone(), persistent=False)

    @property
    def log(self) -> list:
        return [e for b in self.blocks for e in b.log]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from .gpt import _check_ids

        _check_ids(idx, self.cfg)
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.ln_f(x)).float()
