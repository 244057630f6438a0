"""The chapter's data-parallel and sharded training under Ray Train (optional: Ray is not a
dependency).

    from cudabook import ray_train
    m = ray_train.fit(num_workers=2)            # TorchTrainer: gloo on CPU, NCCL on GPUs
    m["ms"], m["replicas_equal"]
    z = ray_train.fit(num_workers=2, loop="sharded", config={"mode": "zero3"})

``fit`` runs ``train_loop`` (``loop="ddp"``) or ``sharded_loop`` (``loop="sharded"``) in
``num_workers`` Ray workers through ``ray.train.torch.TorchTrainer``, which starts the processes
(on one machine, or on every node of a Ray cluster: ``ray start --head`` on one node,
``ray start --address head:6379`` on the others, then ``fit`` from any of them), creates the
process group (``TorchConfig(backend="nccl")`` with GPUs, ``"gloo"`` without) and calls the loop
on each. ``train_loop`` is the loop of ``cudabook/dist_scripts/ddp_train.py``: its ``make_model``
(bias-free linear layers with GELU between them; bf16 on GPUs, float32 on CPUs),
``DistributedDataParallel``, SGD on the mean square of the output, a different fixed batch per
rank. ``sharded_loop`` is the step of ``cudabook/dist_scripts/sharded_train.py`` (its ``build``:
PyTorch's DDP, the all-reduce baseline, ZeRO-1, 2, 3 of ``cudabook.sharded``, or FSDP2) on the
same model with AdamW. Both report the time per step, every loss of this rank, and whether every
replica ended with the same weights.

The loops need only an initialised ``torch.distributed`` group, so they also run under
``cudabook.dist.spawn`` and ``torchrun`` (that is how the tests check them without Ray). Importing
this module needs no Ray; ``fit`` says how to install it when it is missing:
``pip install "ray[train]"``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

__all__ = ["train_loop", "sharded_loop", "fit", "need_ray", "RAY_HINT", "LOOPS"]

RAY_HINT = ('Ray Train is not installed: pip install "ray[train]" (Ray is optional; nothing '
            "else in the book needs it)")


def need_ray():
    """``ray`` with ``ray.train.torch`` importable, or ImportError naming the pip command."""
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{RAY_HINT} ({e})") from e
    return ray


def _place(who: str) -> tuple[int, int, str, Any]:
    """(rank, world, backend, device) of this rank in the current ``torch.distributed`` group:
    its GPU (``LOCAL_RANK``) under NCCL, else the CPU."""
    import torch
    import torch.distributed as td

    from .dist import SAFE_ENV

    os.environ.update(SAFE_ENV)            # before the first collective creates NCCL's communicator
    if not td.is_available() or not td.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised; run it under "
                           "ray_train.fit, cudabook.dist.spawn or torchrun")
    rank, world = td.get_rank(), td.get_world_size()
    backend = str(td.get_backend())
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    return rank, world, backend, dev


def _config(config: dict | None, defaults: dict, who: str) -> dict:
    cfg = {**defaults, **(config or {})}
    for k in ("width", "layers", "tokens", "steps"):
        if not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"{who}: {k} must be an int >= 1, got {cfg[k]!r}")
    return cfg


def _timed(step: Callable[[], float], cfg: dict, dev: Any) -> tuple[list[float], float]:
    """``warmup`` then ``steps`` calls of ``step`` (each returns the loss): every loss, and the
    slowest rank's ms per timed step."""
    import torch
    import torch.distributed as td

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    losses = [step() for _ in range(cfg["warmup"])]
    sync()
    td.barrier()
    t0 = time.perf_counter()
    losses += [step() for _ in range(cfg["steps"])]
    sync()
    ms = torch.tensor([(time.perf_counter() - t0) / cfg["steps"] * 1e3], dtype=torch.float64,
                      device=dev)
    td.all_reduce(ms, op=td.ReduceOp.MAX)                     # the slowest rank's time
    return losses, float(ms)


def _same_on_every_rank(flat: Any, dev: Any) -> bool:
    """True when every rank's ``flat`` holds rank 0's bits (the replicas agree)."""
    import torch
    import torch.distributed as td

    flat = flat.detach().reshape(-1).double()
    ref = flat.clone()
    td.broadcast(ref, 0)
    diff = torch.tensor([float((flat - ref).abs().max()) if flat.numel() else 0.0],
                        dtype=torch.float64, device=dev)
    td.all_reduce(diff, op=td.ReduceOp.MAX)
    return float(diff) == 0.0


def train_loop(config: dict | None = None, report: Callable[[dict], Any] | None = None) -> dict:
    """One rank of data-parallel training on the current ``torch.distributed`` group.

    ``config`` keys (defaults): ``width`` (1024), ``layers`` (4), ``tokens`` per rank (1024),
    ``steps`` (5), ``warmup`` (2), ``lr`` (1e-3). The device is this rank's GPU (``LOCAL_RANK``)
    when the group's backend is NCCL, else the CPU. Returns (and passes to ``report``, e.g.
    ``ray.train.report``) ``{"world", "backend", "device", "ms", "loss", "losses", "params",
    "tokens_per_rank", "replicas_equal"}``; ``ms`` is the slowest rank's time per step, ``losses``
    this rank's loss at every step (warm-up included), ``loss`` the last of them."""
    import torch

    from .dist_scripts.ddp_train import make_model

    rank, world, backend, dev = _place("train_loop")
    cfg = _config(config, {"width": 1024, "layers": 4, "tokens": 1024, "steps": 5, "warmup": 2,
                           "lr": 1e-3}, "train_loop")
    model = make_model(cfg["width"], cfg["layers"], dev)     # the same seed on every rank
    if dev.type == "cpu":
        model = model.float()                                 # bf16 matmuls are slow on CPUs
    dtype = next(model.parameters()).dtype
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
    g = torch.Generator(device=dev).manual_seed(1000 + rank)  # a different batch per rank
    x = torch.randn(cfg["tokens"], cfg["width"], generator=g, device=dev, dtype=dtype)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = net(x).float().pow(2).mean()
        loss.backward()                                       # DDP all-reduces the gradients
        opt.step()
        return float(loss.detach())

    losses, ms = _timed(step, cfg, dev)
    # the replicas agree when every rank's weights equal rank 0's
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = {"world": world, "backend": backend, "device": str(dev), "ms": ms,
           "loss": losses[-1], "losses": losses,
           "params": sum(p.numel() for p in model.parameters()),
           "tokens_per_rank": cfg["tokens"], "replicas_equal": _same_on_every_rank(flat, dev)}
    if report is not None:
        report(out)
    return out


def sharded_loop(config: dict | None = None,
                 report: Callable[[dict], Any] | None = None) -> dict:
    """One rank of the chapter's sharded training (``cudabook/dist_scripts/sharded_train.py``:
    its ``build``) on the current ``torch.distributed`` group.

    ``config`` keys (defaults): ``mode`` ("zero3"; one of ``sharded_train.MODES``: "ddp"
    (PyTorch's DDP), "allreduce", "zero1", "zero2", "zero3" (``cudabook.sharded``'s engines),
    "fsdp2" (``fully_shard``)), ``width`` (1024), ``layers`` (4), ``tokens`` per rank (1024),
    ``steps`` (5), ``warmup`` (2), ``optimizer`` ("adamw" or "sgd"), ``lr`` (1e-4). bf16 on GPUs,
    float32 on CPUs; each rank its own batch (``sharded._batch``). Returns (and passes to
    ``report``) ``{"world", "backend", "device", "mode", "ms", "losses", "params",
    "tokens_per_rank", "replicas_equal", "bytes_per_step", "peak_bytes"}``: the last two are
    the engine's count of the bytes it sent per step and its ledger's peak of parameters +
    gradients + optimizer state (None for "ddp" and "fsdp2", which keep no ledger);
    ``replicas_equal`` compares every rank's gathered parameters with rank 0's bits."""
    import types

    import torch

    from . import sharded
    from .dist_scripts import sharded_train

    rank, world, backend, dev = _place("sharded_loop")
    cfg = _config(config, {"mode": "zero3", "width": 1024, "layers": 4, "tokens": 1024,
                           "steps": 5, "warmup": 2, "optimizer": "adamw", "lr": 1e-4},
                  "sharded_loop")
    if cfg["mode"] not in sharded_train.MODES:
        raise ValueError(f"sharded_loop: mode must be one of {sharded_train.MODES}, "
                         f"got {cfg['mode']!r}")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = types.SimpleNamespace(width=cfg["width"], layers=cfg["layers"],
                              optimizer=cfg["optimizer"], lr=cfg["lr"])
    held, step = sharded_train.build(cfg["mode"], a, dev, dtype, world)
    x = sharded._batch(rank, cfg["tokens"], cfg["width"], dtype, dev)
    losses, ms = _timed(lambda: float(step(x)), cfg, dev)
    if isinstance(held, sharded._Engine):
        flat = held.gathered()                                # a collective: every rank calls it
        rep = held.report()
        sent, peak = rep["bytes_per_step"]["total"], rep["memory"]["peak"]
    else:                                                     # (net, opt) of DDP or FSDP2
        with torch.no_grad():
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p
                    for p in held[0].parameters()]
            flat = torch.cat([p.detach().reshape(-1) for p in full])
        sent = peak = None
    out = {"world": world, "backend": backend, "device": str(dev), "mode": cfg["mode"],
           "ms": ms, "losses": losses, "params": int(flat.numel()),
           "tokens_per_rank": cfg["tokens"], "replicas_equal": _same_on_every_rank(flat, dev),
           "bytes_per_step": sent, "peak_bytes": peak}
    if report is not None:
        report(out)
    return out


def _ray_report(m: dict) -> None:
    """In a Ray Train worker: rank 0 reports its metrics with a checkpoint that holds them
    (``metrics.json``): Ray Train 2.x keeps only metrics that come with a checkpoint in its
    ``Result``; the other ranks report theirs without one."""
    import json
    import tempfile

    import ray.train

    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(m)
        return
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "metrics.json"), "w") as f:
            json.dump(m, f)
        ray.train.report(m, checkpoint=ray.train.Checkpoint.from_directory(d))


def _ray_ddp_worker(config: dict) -> None:
    """``train_loop`` in a Ray Train worker."""
    _ray_report(train_loop(config))


def _ray_sharded_worker(config: dict) -> None:
    """``sharded_loop`` in a Ray Train worker."""
    _ray_report(sharded_loop(config))


LOOPS = ("ddp", "sharded")


def fit(num_workers: int = 2, use_gpu: bool | None = None, config: dict | None = None,
        loop: str = "ddp", **run: Any) -> dict:
    """Run ``train_loop(config)`` (``loop="ddp"``) or ``sharded_loop(config)``
    (``loop="sharded"``; ``config["mode"]`` picks the stage) on ``num_workers`` Ray Train workers
    (``ray.train.torch.TorchTrainer``: NCCL and one GPU per worker with ``use_gpu``, gloo on
    CPUs without; default: GPUs when this machine has any) and return rank 0's metrics.
    ``run`` goes to ``ray.train.RunConfig`` (``storage_path``: where Ray keeps the run and the
    checkpoint that carries the metrics back, default ``~/ray_results``; ``name``). Starts a
    local Ray (NVLink multicast off in its workers, as ``cudabook.dist.SAFE_ENV``) unless one is
    already running (``ray.init(address=...)`` first to use a cluster)."""
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"fit: num_workers must be an int >= 1, got {num_workers!r}")
    if loop not in LOOPS:
        raise ValueError(f"fit: loop must be one of {LOOPS}, got {loop!r}")
    if loop == "sharded":
        from .dist_scripts.sharded_train import MODES

        mode = (config or {}).get("mode", "zero3")
        if mode not in MODES:
            raise ValueError(f"fit: config['mode'] must be one of {MODES}, got {mode!r}")
    ray = need_ray()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .dist import SAFE_ENV

    if use_gpu is None:
        import torch

        use_gpu = torch.cuda.is_available()
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": dict(SAFE_ENV)})
    worker = _ray_ddp_worker if loop == "ddp" else _ray_sharded_worker
    trainer = TorchTrainer(worker, train_loop_config=dict(config or {}),
                           scaling_config=ScalingConfig(num_workers=num_workers,
                                                        use_gpu=bool(use_gpu)),
                           torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
                           run_config=RunConfig(**run) if run else None)
    result = trainer.fit()
    if getattr(result, "error", None):
        raise RuntimeError(f"Ray Train failed: {result.error}")
    if result.checkpoint is not None:
        import json

        with result.checkpoint.as_directory() as d:
            with open(os.path.join(d, "metrics.json")) as f:
                return json.load(f)
    if result.metrics:
        return dict(result.metrics)
    raise RuntimeError("Ray Train finished without rank 0's metrics (no checkpoint came back)")
