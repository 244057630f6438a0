"""Sharded data parallelism in three steps (ZeRO-1, ZeRO-2, ZeRO-3 / FSDP) on the chapter's model,
for any number of ranks, on gloo (CPU) and NCCL (GPU) (Chapter 11).

    from cudabook import sharded
    res = sharded.compare(3)                   # DDP and the three stages on 3 gloo CPU processes
    sharded.memory_model(model, "zero3", 8)    # bytes per rank held at peak, on paper
    sharded.step_bytes(model, "zero3", 8)      # bytes each rank sends per step, on paper
    eng = sharded.shard(model, "zero3", comm)  # inside a rank: eng.step(x) -> loss
    sharded.gpu_timing(4)                      # torchrun dist_scripts/sharded_train.py (GPUs)

What each stage keeps on a rank (N ranks, P parameters; the AdamW state is 2 P, SGD momentum's P):

  ddp    the all-reduce baseline: all parameters, all gradients (one flat buffer, all-reduced
         after the backward and divided by N), the whole optimizer state
  zero1  optimizer state sharded: parameters and gradients as ddp, but each rank keeps the
         optimizer state of its 1/N slice of the flat parameter buffer, updates only that slice
         and all-gathers the parameters after the step
  zero2  gradients sharded too: each layer's gradient is reduce-scattered as soon as the
         backward has made it, and the rank keeps only its shard (one layer's full gradient
         exists at a time)
  zero3  parameters sharded too (FSDP): a layer's weights are all-gathered just ahead of its
         forward and again ahead of its backward, the next layer's gather issued before this
         layer computes (prefetch), and freed right after use; gradients as zero2

The flat buffers are padded with zeros to a multiple of N (per layer for zero2 / zero3, for the
whole model in zero1), so every rank's shard has the same length whatever N and the parameter
count; the padding stays zero (its gradient is zero, so AdamW and SGD leave it at zero).

Every stage gives the baseline's result to float32 rounding (same losses, same parameters) and
bit-identical parameters on every rank (an all-gather copies bits). ``memory_model`` and
``step_bytes`` are the arithmetic; an engine's ``report()`` gives what it held (a ledger of
the bytes of every parameter, gradient and optimizer-state tensor it allocates and frees, read
from the tensors themselves) and the bytes its collectives sent.

Collectives (``algo``): ``"native"`` calls torch.distributed's ``all_reduce``,
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (NCCL's ring; PyTorch 2.13's gloo has
all three, but its reduce-scatter is an all-reduce and a slice, twice the traffic; where a
backend lacks one the engine falls back to all-reduce + slice or ``all_gather`` and says so in
``report()["collectives"]``). ``"ring"`` (gloo only) runs the chapter's ring
(``collectives.ring_schedule``) over ``dist.Comm.sendrecv``, so the bytes it sends can be counted
from the messages. Byte counts are those of a ring: (N - 1) / N of the buffer per rank for a
reduce-scatter or an all-gather, twice that for an all-reduce.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .dist import DistError

__all__ = ["STAGES", "make_model", "Layout", "Ledger", "Collectives", "shard", "DataParallel",
           "Zero1", "Zero2", "Zero3", "memory_model", "step_bytes", "compare", "fsdp2",
           "gpu_timing"]

STAGES = ("ddp", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adamw", "sgd")
ALGOS = ("native", "ring")
_LIMIT_RANKS = 64                 # the book runs up to 8 GPUs per host, on a few hosts


# ============================================================================ the model

def make_model(width: int = 8192, layers: int = 8, *, bias: bool = False,
               dtype: torch.dtype = torch.bfloat16, device: Any = "cpu",
               seed: int = 0) -> torch.nn.Sequential:
    """The chapter's model (``dist_scripts/ddp_train.make_model``: ``layers`` square Linear layers
    with tanh-GELU between them, weights N(0, 1/width)), with its size, dtype, bias and seed as
    arguments; the defaults give ddp_train's weights exactly."""
    if not isinstance(width, int) or not isinstance(layers, int) or width < 1 or layers < 1:
        raise ValueError(f"make_model: width and layers must be ints >= 1, got {width!r}, "
                         f"{layers!r}")
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width, bias=bias, dtype=dtype, device=device))
        if i < layers - 1:
            mods.append(torch.nn.GELU(approximate="tanh"))
    for m in mods:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=width ** -0.5)
            if bias:
                torch.nn.init.zeros_(m.bias)
    return torch.nn.Sequential(*mods)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()             # ddp_train's loss


# ============================================================================ layout

@dataclass(frozen=True)
class Unit:
    """One flat buffer: ``tensors`` (name, shape) concatenated, ``numel`` elements, zero-padded to
    ``padded`` (a multiple of the world size); rank r owns ``[r * shard, (r + 1) * shard)``."""

    name: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    numel: int
    padded: int
    offset: int                                   # where it starts in the whole flat buffer
    shard: int
    shard_offset: int                             # where its shard starts in a rank's shard


class Layout:
    """How a model's parameters lie in flat buffers split over ``world`` ranks: one unit per
    Linear layer (``per_layer``, zero2 / zero3: the unit is what is gathered or
    reduce-scattered at once) or one unit for the whole model (ddp, zero1)."""

    def __init__(self, model: torch.nn.Module, world: int, per_layer: bool = True):
        _check_world(world)
        self.world = world
        groups: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
        if per_layer:
            if not isinstance(model, torch.nn.Sequential):
                raise TypeError("a per-layer layout (zero2, zero3) needs an nn.Sequential of "
                                "nn.Linear and parameter-free layers (the chapter's model); "
                                "shard other models with torch's fully_shard (sharded.fsdp2)")
            for i, m in enumerate(model):
                own = list(m.named_parameters())
                if isinstance(m, torch.nn.Linear):
                    groups.append((str(i), own))
                elif own:
                    raise TypeError(f"layer {i} ({type(m).__name__}) has parameters but is not "
                                    "nn.Linear: zero2 / zero3 here shard Linear layers only")
        else:
            groups.append(("model", list(model.named_parameters())))
        self.units: list[Unit] = []
        off = soff = 0
        for name, ps in groups:
            n = sum(p.numel() for _, p in ps)
            padded = -(-n // world) * world if n else 0
            self.units.append(Unit(name, tuple((k, tuple(p.shape)) for k, p in ps), n, padded,
                                   off, padded // world, soff))
            off, soff = off + padded, soff + padded // world
        if off == 0:
            raise ValueError("the model has no parameters to shard")
        self.total, self.shard_total = off, soff
        self.numel = sum(u.numel for u in self.units)

    def shard_range(self, u: int, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s part of unit ``u`` in the whole flat buffer."""
        un = self.units[u]
        lo = un.offset + rank * un.shard
        return lo, lo + un.shard

    def unit(self, flat: torch.Tensor, u: int) -> torch.Tensor:
        """Unit ``u``'s padded part of a whole flat buffer (``total`` elements)."""
        un = self.units[u]
        return flat[un.offset:un.offset + un.padded]

    def tensors(self, flat: torch.Tensor, u: int) -> list[torch.Tensor]:
        """Unit ``u``'s tensors as views of a whole flat buffer."""
        return self.views(self.unit(flat, u), u)

    def views(self, buf: torch.Tensor, u: int) -> list[torch.Tensor]:
        """Unit ``u``'s tensors (their shapes) as views of ``buf``, the unit's own buffer of
        ``padded`` elements (``unit(flat, u)`` of a whole buffer)."""
        un = self.units[u]
        if buf.numel() != un.padded:
            raise ValueError(f"unit {un.name}: a buffer of {buf.numel()} elements, not "
                             f"{un.padded}")
        out, o = [], 0
        for _, shape in un.tensors:
            n = 1
            for s in shape:
                n *= s
            out.append(buf[o:o + n].view(shape))
            o += n
        return out


def _check_world(world: Any) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= _LIMIT_RANKS:
        raise ValueError(f"world size must be an int in 1..{_LIMIT_RANKS}, got {world!r}")


# ============================================================================ ledger

class Ledger:
    """Bytes held by kind ("params", "grads", "optimizer"), and the most ever held at once with
    its breakdown. Activations are not counted: they do not depend on the stage."""

    KINDS = ("params", "grads", "optimizer")

    def __init__(self) -> None:
        self.now = dict.fromkeys(self.KINDS, 0)
        self.peak, self.at_peak = 0, dict(self.now)

    def hold(self, kind: str, nbytes: int) -> None:
        self.now[kind] += int(nbytes)
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.now)

    def drop(self, kind: str, nbytes: int) -> None:
        self.now[kind] -= int(nbytes)
        if self.now[kind] < 0:
            raise AssertionError(f"ledger: {kind} freed more than was held")

    def as_dict(self) -> dict:
        return {"peak": self.peak, **{f"peak_{k}": v for k, v in self.at_peak.items()},
                "now": sum(self.now.values())}


# ============================================================================ collectives

class _Done:
    def wait(self) -> None:
        pass


class _Pending:
    """A running collective: ``wait()`` waits for torch's ``Work`` and lets go of it (the Work
    holds the collective's buffers: an all-gather's output is a layer's full weights). A plain
    class at module level on purpose: a class defined per call is a reference cycle (a class
    refers to itself through ``__mro__``), so a handle whose ``wait`` closed over the Work kept
    the Work, and the buffer, alive until Python's cyclic collector ran, long after ``release``:
    zero3 held every layer's gathered weights of a step or more at once."""

    __slots__ = ("work", "coll", "op", "what")

    def __init__(self, coll: "Collectives", op: str, what: str, work: Any):
        self.work, self.coll, self.op, self.what = work, coll, op, what

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as e:
            raise self.coll._fail(self.op, self.what, e) from None


class Collectives:
    """Sum-all-reduce, reduce-scatter and all-gather over equal shards, for one rank, counting
    the bytes it sends as a ring does (``sent``, by op). ``algo="native"``: torch.distributed
    (falls back to all-reduce + slice / ``all_gather`` where the backend lacks an op);
    ``"ring"``: the chapter's ring over ``comm.sendrecv`` (a ``dist.Comm``, gloo). Every failure
    is a ``DistError`` naming the rank, the op and the buffer."""

    def __init__(self, rank: int, world: int, algo: str = "native", comm: Any = None):
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        if algo == "ring" and world > 1 and comm is None:
            raise ValueError("algo='ring' sends over a cudabook.dist.Comm (dist.spawn gives each "
                             "rank one): pass comm")
        self.rank, self.world, self.algo, self.comm = rank, world, algo, comm
        self.sent = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
        self.counting = True
        self.used: dict[str, str] = {}
        self._rs_native = self._ag_native = True

    def _count(self, op: str, nbytes: int) -> None:
        if self.counting and self.world > 1:
            self.sent[op] += _ring_bytes(op, nbytes, self.world)

    def _fail(self, op: str, what: str, e: BaseException) -> DistError:
        return DistError(f"rank {self.rank}: {op} of {what} failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}): a peer stopped, or the "
                         "ranks disagree on the buffer sizes")

    def _wrap(self, op: str, what: str, work: Any) -> Any:
        return _Done() if work is None else _Pending(self, op, what, work)

    def all_reduce(self, t: torch.Tensor, what: str = "a buffer") -> None:
        """Sum ``t`` over the ranks, in place."""
        if self.world == 1:
            return
        self._count("all_reduce", t.nbytes)
        if self.algo == "ring":
            s = t.numel() // self.world
            if s * self.world != t.numel():
                raise ValueError(f"ring all-reduce of {what}: {t.numel()} elements do not split "
                                 f"into {self.world} equal shards (pad the buffer)")
            self.counting, was = False, self.counting
            try:
                self._ring_rs(t, what)
                self._ring_ag(t, what)
            finally:
                self.counting = was
            self.used["all_reduce"] = "ring reduce-scatter + ring all-gather (Comm.sendrecv)"
            return
        import torch.distributed as td

        try:
            td.all_reduce(t)
        except RuntimeError as e:
            raise self._fail("all_reduce", what, e) from None
        self.used["all_reduce"] = f"torch all_reduce ({td.get_backend()})"

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, what: str = "a buffer") -> None:
        """``out`` = the sum over the ranks of ``t``'s slice ``[rank * s, (rank + 1) * s)``,
        s = len(out) = len(t) / world. ``t`` may be overwritten."""
        if t.numel() != out.numel() * self.world:
            raise ValueError(f"reduce_scatter of {what}: {t.numel()} elements are not "
                             f"{self.world} x {out.numel()}")
        if self.world == 1:
            out.copy_(t)
            return
        self._count("reduce_scatter", t.nbytes)
        if self.algo == "ring":
            self._ring_rs(t, what)
            out.copy_(t[self.rank * out.numel():(self.rank + 1) * out.numel()])
            self.used["reduce_scatter"] = ("ring over Comm.sendrecv "
                                           "(collectives.ring_schedule)")
            return
        import torch.distributed as td

        be = td.get_backend()
        try:
            if self._rs_native:
                try:
                    td.reduce_scatter_tensor(out, t)
                    self.used["reduce_scatter"] = f"torch reduce_scatter_tensor ({be})" + (
                        ": gloo runs it as an all-reduce and a slice" if be == "gloo" else "")
                    return
                except (RuntimeError, NotImplementedError) as e:
                    if "support" not in str(e).lower():
                        raise
                    self._rs_native = False
            td.all_reduce(t)
            out.copy_(t[self.rank * out.numel():(self.rank + 1) * out.numel()])
            self.used["reduce_scatter"] = f"all_reduce + slice ({be} has no reduce_scatter)"
        except RuntimeError as e:
            raise self._fail("reduce_scatter", what, e) from None

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, what: str = "a buffer",
                   async_op: bool = False) -> Any:
        """``out`` = the ranks' ``t`` one after the other (``t`` may be ``out``'s own slice:
        in place). With ``async_op`` returns a handle to ``wait()`` on (the ring runs now)."""
        if out.numel() != t.numel() * self.world:
            raise ValueError(f"all_gather of {what}: {out.numel()} elements are not "
                             f"{self.world} x {t.numel()}")
        s = t.numel()
        if self.world == 1:
            if out.data_ptr() != t.data_ptr():
                out.copy_(t)
            return _Done()
        self._count("all_gather", out.nbytes)
        mine = out[self.rank * s:(self.rank + 1) * s]
        if self.algo == "ring":
            if mine.data_ptr() != t.data_ptr():
                mine.copy_(t)
            self._ring_ag(out, what)
            self.used["all_gather"] = "ring over Comm.sendrecv (collectives.ring_schedule)"
            return _Done()
        import torch.distributed as td

        be = td.get_backend()
        try:
            if self._ag_native:
                try:
                    w = td.all_gather_into_tensor(out, t, async_op=async_op)
                    self.used["all_gather"] = f"torch all_gather_into_tensor ({be})"
                    return self._wrap("all_gather", what, w)
                except (RuntimeError, NotImplementedError) as e:
                    if "support" not in str(e).lower():
                        raise
                    self._ag_native = False
            parts = list(out.split(s))
            w = td.all_gather(parts, t.clone(), async_op=async_op)
            self.used["all_gather"] = f"all_gather into a list ({be})"
            return self._wrap("all_gather", what, w)
        except RuntimeError as e:
            raise self._fail("all_gather", what, e) from None

    # the chapter's ring: rank r sends to r + 1; collectives.ring_schedule's chunk c is shard
    # (c - 1) % N here, so that after the reduce-scatter rank r holds the sum of shard r
    def _ring_rs(self, t: torch.Tensor, what: str) -> None:
        from .collectives import ring_schedule

        w, r = self.world, self.rank
        s = t.numel() // w
        sched = ring_schedule(w)
        tmp = torch.empty(s, dtype=t.dtype, device=t.device)
        for step in sched[:w - 1]:
            send_c = (step[r][2] - 1) % w
            recv_c = (step[(r - 1) % w][2] - 1) % w
            try:
                self.comm.sendrecv(t[send_c * s:(send_c + 1) * s], (r + 1) % w, tmp, (r - 1) % w)
            except RuntimeError as e:
                raise self._fail("ring reduce-scatter", what, e) from None
            t[recv_c * s:(recv_c + 1) * s] += tmp

    def _ring_ag(self, t: torch.Tensor, what: str) -> None:
        from .collectives import ring_schedule

        w, r = self.world, self.rank
        s = t.numel() // w
        sched = ring_schedule(w)
        for step in sched[w - 1:]:
            send_c = (step[r][2] - 1) % w
            recv_c = (step[(r - 1) % w][2] - 1) % w
            try:
                self.comm.sendrecv(t[send_c * s:(send_c + 1) * s], (r + 1) % w,
                                   t[recv_c * s:(recv_c + 1) * s], (r - 1) % w)
            except RuntimeError as e:
                raise self._fail("ring all-gather", what, e) from None


# ============================================================================ engines

def _group(comm: Any) -> tuple[int, int]:
    """(rank, world) of ``comm`` (a dist.Comm), of torch.distributed's default group, or (0, 1)."""
    import torch.distributed as td

    if comm is not None:
        rank, world = comm.rank, comm.world
        if td.is_initialized() and td.get_world_size() != world:
            raise DistError(f"rank {rank}: comm says world size {world}, torch.distributed's "
                            f"group has {td.get_world_size()}")
        return rank, world
    if td.is_available() and td.is_initialized():
        return td.get_rank(), td.get_world_size()
    return 0, 1


def _optimizer(params: list[torch.Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    # foreach=False: one elementwise loop per tensor, so a slice of a tensor is updated exactly
    # as the same elements of the whole tensor (the sharded update equals the baseline's)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _check_same_model(model: torch.nn.Module, rank: int, world: int, device: Any,
                      setup: tuple[str, str, str]) -> None:
    """Refuse (DistError) unless every rank runs the same ``setup`` (stage, optimizer, algo) on
    the same parameter shapes and dtypes with the same initial weights (compared on a sample of up
    to 4096 values per tensor: cheap for any model)."""
    if world == 1:
        return
    import zlib

    import torch.distributed as td

    ps = list(model.parameters())
    shapes = repr([(tuple(p.shape), str(p.dtype)) for p in ps]).encode()
    s1 = s2 = 0.0
    with torch.no_grad():
        for p in ps:
            v = p.detach().reshape(-1)
            v = v[::max(1, v.numel() // 4096)].double()
            s1 += float(v.sum())
            s2 += float((v * torch.arange(1, v.numel() + 1, device=v.device).sqrt()).sum())
    code = [STAGES.index(setup[0]), OPTIMIZERS.index(setup[1]), ALGOS.index(setup[2])]
    mine = torch.tensor([*code, len(ps), sum(p.numel() for p in ps), zlib.crc32(shapes), s1, s2],
                        dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    try:
        td.all_gather(every, mine)
    except RuntimeError as e:
        raise DistError(f"rank {rank}: comparing the model with the other ranks failed: {e}") \
            from None
    for r, v in enumerate(every):
        theirs = (STAGES[int(v[0])], OPTIMIZERS[int(v[1])], ALGOS[int(v[2])])
        if theirs != setup:
            raise DistError(f"rank {rank}: the ranks run different engines: rank {r} runs "
                            f"{theirs[0]} with {theirs[1]} over the {theirs[2]} collectives, rank "
                            f"{rank} {setup[0]} with {setup[1]} over {setup[2]}: every rank must "
                            "call shard() alike")
        v, v0 = v[3:], every[0][3:]
        if not torch.equal(v[:3], v0[:3]):
            raise DistError(f"rank {rank}: the model differs between ranks: rank {r} has "
                            f"{int(v[0])} parameter tensors of {int(v[1])} elements, rank 0 "
                            f"{int(v0[0])} of {int(v0[1])} (or other shapes): "
                            "every rank must build the same model")
        if not torch.equal(v[3:], v0[3:]):
            raise DistError(f"rank {rank}: the initial weights differ between rank 0 and rank "
                            f"{r}: build the model with the same seed on every rank (or "
                            "broadcast rank 0's weights first)")


class _Engine:
    """What every stage shares: the rank's place, the collectives, the ledger, the step."""

    stage = ""
    per_layer = True

    def __init__(self, model: torch.nn.Module, comm: Any = None, *, optimizer: str = "adamw",
                 lr: float = 1e-2, algo: str = "native"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        self.rank, self.world = _group(comm)
        ps = list(model.parameters())
        if not ps:
            raise ValueError("the model has no parameters to train")
        self.device, self.dtype = ps[0].device, ps[0].dtype
        if any(p.dtype != self.dtype or p.device != self.device for p in ps):
            raise ValueError("every parameter must have one dtype and device (one flat buffer)")
        _check_same_model(model, self.rank, self.world, self.device,
                          (self.stage, optimizer, algo))
        self.model, self.optimizer_name, self.lr = model, optimizer, lr
        self.layout = Layout(model, self.world if self.stage != "ddp" else 1, self.per_layer)
        self.coll = Collectives(self.rank, self.world, algo, comm)
        self.ledger = Ledger()
        self.steps = 0
        self.elem = ps[0].element_size()

    def _held(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        self.ledger.hold(kind, t.nbytes)
        return t

    def _flat_params(self) -> torch.Tensor:
        """The model's parameters copied into one zero-padded flat buffer (the layout's)."""
        flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for u, un in enumerate(self.layout.units):
                prefix = "" if un.name == "model" else un.name + "."   # a layer's own names
                for (k, _), v in zip(un.tensors, self.layout.tensors(flat, u)):
                    v.copy_(named[prefix + k])
        return flat

    def _track_state(self) -> None:
        if self.steps == 0:                      # the optimizer made its state in its first step
            self.ledger.hold("optimizer", _state_bytes(self.opt))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One training step on this rank's batch ``x``; returns the (local) loss, detached."""
        loss = self._forward_backward(x)
        self._update()
        self._track_state()
        self.steps += 1
        return loss.detach()

    def report(self) -> dict:
        """Memory held at peak (bytes: ledger), bytes sent per step by op, which collectives
        ran, the layout's sizes."""
        per = {k: v // max(self.steps, 1) for k, v in self.coll.sent.items()}
        return {"stage": self.stage, "rank": self.rank, "world": self.world,
                "memory": self.ledger.as_dict(),
                "bytes_per_step": {**per, "total": sum(per.values())},
                "collectives": dict(self.coll.used), "numel": self.layout.numel,
                "padded": self.layout.total, "elem_bytes": self.elem}


class DataParallel(_Engine):
    """The all-reduce baseline (ddp_train's "after" mode): one flat gradient buffer that the
    parameters' ``.grad`` are views of, summed over the ranks after the backward, divided by N;
    every rank updates every parameter."""

    stage, per_layer = "ddp", False

    def __init__(self, model, comm=None, **kw):
        super().__init__(model, comm, **kw)
        self.flat_p = self._held("params", self._flat_params())
        self.flat_g = self._held("grads", torch.zeros_like(self.flat_p))
        views = zip(self.layout.views(self.flat_p, 0), self.layout.views(self.flat_g, 0))
        for p, (v, g) in zip(model.parameters(), views):
            p.data = v                               # the parameters live in the flat buffer
            p.grad = g
        self.opt = _optimizer(self._opt_params(), self.optimizer_name, self.lr)

    def _opt_params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def _forward_backward(self, x):
        self.flat_g.zero_()                          # the backward accumulates into the views
        loss = _loss(self.model(x))
        loss.backward()
        self.coll.all_reduce(self.flat_g, "the gradients")
        return loss

    def _update(self):
        self.flat_g.div_(self.world)
        self.opt.step()

    def gathered(self) -> torch.Tensor:
        """Every parameter, flat, in the model's order, unpadded."""
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


class Zero1(DataParallel):
    """ZeRO-1: as the baseline, but the optimizer state of only this rank's 1/N slice of the flat
    (padded) parameter buffer; the rank updates that slice, then the parameters are all-gathered
    (the optimizer's parameter is a view of the slice, so the update lands in place)."""

    stage, per_layer = "zero1", False

    def _opt_params(self):
        lo, hi = self.layout.shard_range(0, self.rank)
        p = torch.nn.Parameter(self.flat_p[lo:hi])   # a view: the step writes the flat buffer
        p.grad = self.flat_g[lo:hi]
        return [p]

    def _update(self):
        lo, hi = self.layout.shard_range(0, self.rank)
        self.flat_g[lo:hi].div_(self.world)          # only this rank's slice is used
        self.opt.step()
        self.coll.all_gather(self.layout.unit(self.flat_p, 0), self.flat_p[lo:hi],
                             "the parameters")


class _ShardedLinear(torch.autograd.Function):
    """y = x W^T (+ b) with W owned by the engine: the forward asks the engine for the full
    weights and hands them back; the backward asks again, computes dx, hands the weights back,
    writes dW (and db) into a padded flat buffer and gives that to the engine to
    reduce-scatter. ``anchor`` (a scalar that requires grad) makes autograd call the backward
    also for the first layer, whose input needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, eng, u):
        w, b = eng.weights(u, backward=False)
        y = F.linear(x, w, b)
        del w, b                                      # views of the gathered buffer
        eng.release(u)
        ctx.save_for_backward(x)
        ctx.eng, ctx.u = eng, u
        return y

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        eng, u = ctx.eng, ctx.u
        w, b = eng.weights(u, backward=True)
        g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])   # (T, out), (T, in)
        gx = (g2 @ w).view(x.shape) if ctx.needs_input_grad[0] else None      # (T, in)
        has_b = b is not None
        del w, b                                      # views of the gathered buffer: let it go
        eng.release(u)                                # the weights go before dW is made
        buf = eng.grad_buffer(u)                      # (padded,) zeros
        gs = eng.layout.views(buf, u)                 # dW (out, in) [, db (out,)] in buf
        torch.mm(g2.t(), x2, out=gs[0])               # dW = gy^T x: (out, in)
        if has_b:
            torch.sum(g2, 0, out=gs[1])
        eng.grad_ready(u, buf)
        return gx, None, None, None


class Zero2(_Engine):
    """ZeRO-2: parameters replicated (one padded flat buffer, one unit per Linear), but each
    layer's gradient reduce-scattered as soon as the backward made it: the rank keeps its 1/N
    gradient shard and the optimizer state of its 1/N parameter shard; after the step the
    parameters are all-gathered layer by layer."""

    stage = "zero2"

    def __init__(self, model, comm=None, **kw):
        super().__init__(model, comm, **kw)
        self._setup_params()
        self.g_shard = self._held("grads", torch.zeros(self.layout.shard_total, dtype=self.dtype,
                                                       device=self.device))
        opt_ps = []
        for u, un in enumerate(self.layout.units):
            p = torch.nn.Parameter(self._shard_view(u))
            p.grad = self.g_shard[un.shard_offset:un.shard_offset + un.shard]
            opt_ps.append(p)
        self.opt = _optimizer(opt_ps, self.optimizer_name, self.lr)
        self.anchors = [torch.zeros((), requires_grad=True, device=self.device)
                        for _ in self.layout.units]
        self.linears = {i: u for u, i in enumerate(int(un.name) for un in self.layout.units)}
        self.scattered = 0

    def _setup_params(self):
        self.flat_p = self._held("params", self._flat_params())
        for u, un in enumerate(self.layout.units):   # the Linear layers' storage: the flat buffer
            mod = self.model[int(un.name)]
            for (k, _), v in zip(un.tensors, self.layout.tensors(self.flat_p, u)):
                getattr(mod, k).data = v

    def _shard_view(self, u):
        lo, hi = self.layout.shard_range(u, self.rank)
        return self.flat_p[lo:hi]

    # --- what _ShardedLinear asks for
    def weights(self, u, backward):
        ws = self.layout.tensors(self.flat_p, u)
        return ws[0], (ws[1] if len(ws) > 1 else None)

    def release(self, u):
        pass

    def grad_buffer(self, u):
        return self._held("grads", torch.zeros(self.layout.units[u].padded, dtype=self.dtype,
                                               device=self.device))

    def grad_ready(self, u, buf):
        un = self.layout.units[u]
        self.coll.reduce_scatter(self.g_shard[un.shard_offset:un.shard_offset + un.shard], buf,
                                 f"layer {un.name}'s gradient")
        self.ledger.drop("grads", buf.nbytes)        # the full gradient is gone
        self.scattered += 1

    def _forward(self, x):
        for i, m in enumerate(self.model):
            x = _ShardedLinear.apply(x, self.anchors[self.linears[i]], self, self.linears[i]) \
                if i in self.linears else m(x)
        return x

    def _forward_backward(self, x):
        self.scattered = 0
        loss = _loss(self._forward(x))
        loss.backward()
        if self.scattered != len(self.layout.units):
            raise RuntimeError(f"rank {self.rank}: {self.scattered} of "
                               f"{len(self.layout.units)} layers' gradients were reduce-scattered")
        return loss

    def _update(self):
        self.g_shard.div_(self.world)
        self.opt.step()
        for u, un in enumerate(self.layout.units):
            self.coll.all_gather(self.layout.unit(self.flat_p, u),
                                 self._shard_view(u), f"layer {un.name}'s parameters")

    def gathered(self) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for u in range(len(self.layout.units))
                          for v in self.layout.tensors(self.flat_p, u)]).detach()


class Zero3(Zero2):
    """ZeRO-3 / FSDP: parameters sharded too. Ahead of a layer's forward its weights are
    all-gathered (waiting for the gather issued one layer earlier) and the next layer's gather is
    issued (prefetch), then the full weights are freed; the backward gathers them again (the
    layer after it prefetched them), prefetches the layer before, and reduce-scatters the
    gradient as zero2. At most two layers' full weights (or one weight and one gradient) exist
    at a time. The optimizer updates the shard in place; nothing is gathered after the step."""

    stage = "zero3"

    def _setup_params(self):
        flat = self._flat_params()                   # (a transient full copy, at setup only)
        mine = [self.layout.shard_range(u, self.rank) for u in range(len(self.layout.units))]
        self.p_shard = self._held("params", torch.cat([flat[lo:hi] for lo, hi in mine]))
        del flat
        for un in self.layout.units:                 # the module keeps no weights of its own
            mod = self.model[int(un.name)]
            for k, _ in un.tensors:
                getattr(mod, k).data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.full: dict[int, list] = {}              # unit -> [gathered buffer, pending handle]

    def _shard_view(self, u):
        un = self.layout.units[u]
        return self.p_shard[un.shard_offset:un.shard_offset + un.shard]

    def _gather(self, u):
        """Issue the all-gather of unit ``u`` (nothing if out of range or already there)."""
        if not 0 <= u < len(self.layout.units) or u in self.full:
            return
        un = self.layout.units[u]
        buf = self._held("params", torch.empty(un.padded, dtype=self.dtype, device=self.device))
        h = self.coll.all_gather(buf, self._shard_view(u), f"layer {un.name}'s parameters",
                                 async_op=True)
        self.full[u] = [buf, h]

    def weights(self, u, backward):
        self._gather(u)                              # no-op when prefetched
        entry = self.full[u]
        if entry[1] is not None:
            entry[1].wait()
            entry[1] = None
        self._gather(u - 1 if backward else u + 1)   # prefetch the layer that runs next
        ws = self.layout.views(entry[0], u)
        return ws[0], (ws[1] if len(ws) > 1 else None)

    def release(self, u):
        buf, h = self.full.pop(u)
        if h is not None:
            h.wait()
        self.ledger.drop("params", buf.nbytes)

    def _forward_backward(self, x):
        loss = super()._forward_backward(x)
        for u in list(self.full):                    # a prefetch nobody used (never, in order)
            self.release(u)
        return loss

    def _update(self):
        self.g_shard.div_(self.world)
        self.opt.step()                              # the shard is the parameters' only copy

    def gathered(self) -> torch.Tensor:
        was, self.coll.counting = self.coll.counting, False
        try:
            out = []
            for u, un in enumerate(self.layout.units):
                buf = torch.empty(un.padded, dtype=self.dtype, device=self.device)
                self.coll.all_gather(buf, self._shard_view(u), "the parameters").wait()
                out.append(buf[:un.numel])
            return torch.cat(out)
        finally:
            self.coll.counting = was


_ENGINES = {"ddp": DataParallel, "zero1": Zero1, "zero2": Zero2, "zero3": Zero3}


def shard(model: torch.nn.Module, stage: str, comm: Any = None, **kw) -> _Engine:
    """The engine of ``stage`` ("ddp", "zero1", "zero2", "zero3") over ``model`` on this rank
    (``comm``: a ``dist.Comm``; None: torch.distributed's default group, or one rank). The
    engine takes over the model's parameter storage. Keywords: optimizer ("adamw" | "sgd"), lr,
    algo ("native" | "ring")."""
    if stage not in _ENGINES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return _ENGINES[stage](model, comm, **kw)


# ============================================================================ on paper

def _opt_state(numels: Sequence[int], optimizer: str, elem: int) -> int:
    if optimizer == "adamw":                     # exp_avg, exp_avg_sq, a float32 step each
        return sum(2 * n * elem + 4 for n in numels)
    if optimizer == "sgd":                       # momentum_buffer
        return sum(n * elem for n in numels)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def memory_model(model: torch.nn.Module, stage: str, world: int, optimizer: str = "adamw",
                 elem: int | None = None) -> dict:
    """Bytes of parameters + gradients + optimizer state a rank holds at its peak in ``stage`` on
    ``world`` ranks (the engines' schedule, replayed on paper through a ``Ledger``), with the
    baseline's bytes, ``bound`` = baseline / N + one layer's worth (its parameters, gradient and
    optimizer state in the baseline) and whether the stage is within it."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    _check_world(world)
    ps = list(model.parameters())
    e = elem or ps[0].element_size()
    led = Ledger()
    if stage in ("ddp", "zero1"):
        lay = Layout(model, 1 if stage == "ddp" else world, per_layer=False)
        led.hold("params", lay.total * e)
        led.hold("grads", lay.total * e)
        numels = [p.numel() for p in ps] if stage == "ddp" else [lay.units[0].shard]
        led.hold("optimizer", _opt_state(numels, optimizer, e))
    else:
        lay = Layout(model, world, per_layer=True)
        units = lay.units
        led.hold("params", (lay.total if stage == "zero2" else lay.shard_total) * e)
        led.hold("grads", lay.shard_total * e)
        led.hold("optimizer", _opt_state([un.shard for un in units], optimizer, e))
        full: set[int] = set()

        def gather(u):
            if 0 <= u < len(units) and u not in full and stage == "zero3":
                full.add(u)
                led.hold("params", units[u].padded * e)

        def release(u):
            if u in full:
                full.discard(u)
                led.drop("params", units[u].padded * e)

        gather(0)
        for u in range(len(units)):                  # forward
            gather(u)
            gather(u + 1)
            release(u)
        for u in reversed(range(len(units))):        # backward
            gather(u)
            gather(u - 1)
            release(u)
            led.hold("grads", units[u].padded * e)
            led.drop("grads", units[u].padded * e)
    base = memory_model(model, "ddp", world, optimizer, e)["peak"] if stage != "ddp" else led.peak
    layer = max(_layer_bytes(model, optimizer, e))
    bound = base / world + layer
    return {**led.as_dict(), "ddp": base, "layer_bytes": layer, "bound": bound,
            "within_bound": led.peak <= bound, "ratio_to_ddp": led.peak / base}


def _layer_bytes(model: torch.nn.Module, optimizer: str, e: int) -> list[int]:
    """Each Linear layer's bytes in the baseline: parameters, gradients, optimizer state."""
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            ns = [p.numel() for p in m.parameters(recurse=False)]
            out.append(2 * sum(ns) * e + _opt_state(ns, optimizer, e))
    return out or [0]


def _ring_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring ``op`` over a buffer of ``nbytes``: (N - 1) / N of it for a
    reduce-scatter or an all-gather, twice that for an all-reduce (nccl-tests' bus factor)."""
    return (2 if op == "all_reduce" else 1) * (world - 1) * int(nbytes) // world


def step_bytes(model: torch.nn.Module, stage: str, world: int, elem: int | None = None) -> dict:
    """Bytes one rank sends per training step in ``stage`` on ``world`` ranks, by op, as a ring
    sends them (``_ring_bytes``). ddp: the gradients all-reduced (2 x (N-1)/N of the model's
    bytes); zero1: that plus the parameters all-gathered (3 x); zero2: gradients reduce-scattered
    and parameters all-gathered, layer by layer (2 x, as ddp); zero3: parameters gathered twice
    (forward and backward) and gradients reduce-scattered (3 x). Padding counts (it is sent)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    _check_world(world)
    e = elem or next(model.parameters()).element_size()
    lay = Layout(model, 1 if stage == "ddp" else world, per_layer=stage in ("zero2", "zero3"))
    per_unit = [un.padded * e for un in lay.units]
    rs = sum(_ring_bytes("reduce_scatter", n, world) for n in per_unit)
    ag = sum(_ring_bytes("all_gather", n, world) for n in per_unit)
    ar = sum(_ring_bytes("all_reduce", n, world) for n in per_unit)
    out = {"ddp": {"all_reduce": ar, "reduce_scatter": 0, "all_gather": 0},
           "zero1": {"all_reduce": ar, "reduce_scatter": 0, "all_gather": ag},
           "zero2": {"all_reduce": 0, "reduce_scatter": rs, "all_gather": ag},
           "zero3": {"all_reduce": 0, "reduce_scatter": rs, "all_gather": 2 * ag}}[stage]
    return {**out, "total": sum(out.values())}


# ============================================================================ PyTorch FSDP2

def fsdp2(model: torch.nn.Module, world: int, device_type: str = "cpu") -> torch.nn.Module:
    """PyTorch's FSDP2 on the same model (``torch.distributed.fsdp.fully_shard`` on every Linear,
    then on the whole): the baseline the stages are timed against on GPUs. Needs an initialised
    default process group of ``world`` ranks (gloo on the CPU works too)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise RuntimeError(f"this PyTorch ({torch.__version__}) has no FSDP2 "
                           "(torch.distributed.fsdp.fully_shard, PyTorch >= 2.6)") from e
    mesh = init_device_mesh(device_type, (world,))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ============================================================================ gloo runs

def _batch(rank: int, tokens: int, width: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + rank)     # ddp_train's per-rank batch
    return torch.randn(tokens, width, generator=g, device=device, dtype=dtype)


def _rank_compare(comm, cfg: dict) -> dict:
    import torch.distributed as td

    out: dict[str, Any] = {}
    x = _batch(comm.rank, cfg["tokens"], cfg["width"])
    mk = dict(bias=cfg["bias"], dtype=torch.float32)
    for name in cfg["runs"]:
        stage, _, algo = name.partition("/")
        model = make_model(cfg["width"], cfg["layers"], **mk)
        if stage in _ENGINES:
            eng = shard(model, stage, comm, optimizer=cfg["optimizer"], lr=cfg["lr"],
                        algo=algo or "native")
            comm.events.clear()                  # Comm logs every message the ring sends
            losses = [float(eng.step(x)) for _ in range(cfg["steps"])]
            rep = eng.report()
            if algo == "ring":                   # what the ring's messages really carried
                sent = [n for _, op, _, n in comm.events if op == "send"]
                rep["ring_sent_bytes_per_step"] = sum(sent) * eng.elem // cfg["steps"]
            out[name] = {"losses": losses, "params": eng.gathered().numpy().copy(), **rep}
        else:                                    # PyTorch's own DDP and FSDP2, same model
            if stage == "torch_ddp":
                net = torch.nn.parallel.DistributedDataParallel(model)
                params = list(net.parameters())
            elif stage == "fsdp2":
                net = fsdp2(model, comm.world)
                params = list(net.parameters())
            else:
                raise ValueError(f"unknown run {name!r}: stages are {STAGES} (with '/ring'), "
                                 "baselines 'torch_ddp' and 'fsdp2'")
            opt = _optimizer(params, cfg["optimizer"], cfg["lr"])
            losses = []
            for _ in range(cfg["steps"]):
                opt.zero_grad(set_to_none=True)
                loss = _loss(net(x))
                loss.backward()
                opt.step()
                losses.append(float(loss))
            with torch.no_grad():
                full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
                flat = torch.cat([p.detach().reshape(-1) for p in full])
            out[name] = {"losses": losses, "params": flat.numpy().copy(), "stage": stage}
            del net
        td.barrier()
    return out


def compare(world: int, runs: Sequence[str] = STAGES, *, steps: int = 3, width: int = 7,
            layers: int = 5, bias: bool = False, tokens: int = 8, optimizer: str = "adamw",
            lr: float = 1e-2, timeout: float = 60.0) -> dict:
    """Train the chapter's model (float32, ``width`` x ``width`` x ``layers``: 7 x 7 x 5 = 245
    parameters, 49 per layer, which none of N = 2, 3, 4, 6, 8 divides) for ``steps`` steps with
    every run of ``runs`` on ``world`` forked gloo CPU processes (``dist.spawn``, once for all
    runs; each rank its own batch of ``tokens`` rows). A run is a stage ("ddp", "zero1", "zero2",
    "zero3"), a sharded stage over the chapter's ring ("zero2/ring"), or PyTorch's "torch_ddp" or
    "fsdp2". Returns ``{"world", "params", "model" (a fresh copy, for memory_model and
    step_bytes), "optimizer", "runs": {name: [one dict per rank: "losses", "params" (gathered,
    flat, unpadded) and, for the stages, report()'s keys]}}``."""
    from . import dist

    _check_world(world)
    if world > max(8, os.cpu_count() or 1):
        raise ValueError(f"compare: {world} CPU processes on {os.cpu_count()} cores: the chapter "
                         "runs 1..8 ranks on one host")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"compare: steps must be an int >= 2 (the optimizer state exists from "
                         f"the first step on, so the peak is reached in the second), got {steps!r}")
    for name in runs:
        stage, _, algo = name.partition("/")
        if stage not in (*STAGES, "torch_ddp", "fsdp2") or algo not in ("", "native", "ring") \
                or (algo and stage not in ("zero1", "zero2", "zero3")):
            raise ValueError(f"unknown run {name!r}: stages are {STAGES} (zero1..3 also over "
                             "the chapter's ring: 'zero2/ring'), baselines 'torch_ddp', 'fsdp2'")
    cfg = dict(runs=list(runs), steps=steps, width=width, layers=layers, bias=bias,
               tokens=tokens, optimizer=optimizer, lr=lr)
    # import here what the ranks would each import (an optimizer imports torch._dynamo: ~1 s):
    # the forked ranks inherit it
    _optimizer([torch.zeros(1, requires_grad=True)], optimizer, lr)
    if "fsdp2" in runs:
        importlib.import_module("torch.distributed.fsdp")
    per_rank = dist.spawn(_rank_compare, world, cfg, timeout=timeout)
    model = make_model(width, layers, bias=bias, dtype=torch.float32)
    return {"world": world, "params": sum(p.numel() for p in model.parameters()),
            "model": model, "optimizer": optimizer,
            "runs": {name: [r[name] for r in per_rank] for name in runs}}


# ============================================================================ GPUs

def gpu_timing(world: int, *, width: int = 8192, layers: int = 8, batch: int = 8192,
               steps: int = 10, warmup: int = 3,
               modes: str = "ddp,allreduce,zero1,zero2,zero3,fsdp2", optimizer: str = "adamw",
               timeout: float = 600.0) -> dict | None:
    """Time per step and peak memory of every mode on ``world`` GPUs of this host: torchrun of
    ``dist_scripts/sharded_train.py`` (NCCL, bf16). None (after saying why) without the GPUs."""
    from . import dist

    _check_world(world)
    if not dist.need_gpus(world, "the sharded training timing"):
        return None
    args = ["--width", width, "--layers", layers, "--batch", batch, "--steps", steps,
            "--warmup", warmup, "--modes", modes, "--optimizer", optimizer]
    return dist.torchrun("sharded_train", world, args=[str(a) for a in args], timeout=timeout)
