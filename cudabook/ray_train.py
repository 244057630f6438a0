"""The chapter's data-parallel training under Ray Train (optional: Ray is not a dependency).

    from cudabook import ray_train
    m = ray_train.fit(num_workers=2)            # TorchTrainer: gloo on CPU, NCCL on GPUs
    m["ms"], m["replicas_equal"]

``fit`` runs ``train_loop`` in ``num_workers`` Ray workers through
``ray.train.torch.TorchTrainer``, which starts the processes (on one machine, or on every node of a
Ray cluster: ``ray start --head`` on one node, ``ray start --address head:6379`` on the others,
then ``fit`` from any of them), creates the process group (``TorchConfig(backend="nccl")`` with
GPUs, ``"gloo"`` without) and calls the loop on each. The loop is that of
``cudabook/dist_scripts/ddp_train.py``: its ``make_model`` (bias-free linear layers with GELU
between them; bf16 on GPUs, float32 on CPUs), ``DistributedDataParallel``, SGD on the mean
square of the output, a different fixed batch per rank. It reports the time per step and whether
every replica ended with the same weights (DDP's all-reduce gave every rank the same sum).

``train_loop`` needs only an initialised ``torch.distributed`` group, so it also runs under
``cudabook.dist.spawn`` and ``torchrun`` (that is how the tests check it without Ray). Importing
this module needs no Ray; ``fit`` says how to install it when it is missing:
``pip install "ray[train]"``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

__all__ = ["train_loop", "fit", "need_ray", "RAY_HINT"]

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


def train_loop(config: dict | None = None, report: Callable[[dict], Any] | None = None) -> dict:
    """One rank of data-parallel training on the current ``torch.distributed`` group.

    ``config`` keys (defaults): ``width`` (1024), ``layers`` (4), ``tokens`` per rank (1024),
    ``steps`` (5), ``warmup`` (2), ``lr`` (1e-3). The device is this rank's GPU (``LOCAL_RANK``)
    when the group's backend is NCCL, else the CPU. Returns (and passes to ``report``, e.g.
    ``ray.train.report``) ``{"world", "backend", "device", "ms", "loss", "params",
    "tokens_per_rank", "replicas_equal"}``; ``ms`` is the slowest rank's time per step."""
    import torch
    import torch.distributed as td

    from .dist import SAFE_ENV
    from .dist_scripts.ddp_train import make_model

    os.environ.update(SAFE_ENV)            # before the first collective creates NCCL's communicator
    if not td.is_available() or not td.is_initialized():
        raise RuntimeError("train_loop: torch.distributed is not initialised; run it under "
                           "ray_train.fit, cudabook.dist.spawn or torchrun")
    cfg = {"width": 1024, "layers": 4, "tokens": 1024, "steps": 5, "warmup": 2, "lr": 1e-3,
           **(config or {})}
    for k in ("width", "layers", "tokens", "steps"):
        if not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"train_loop: {k} must be an int >= 1, got {cfg[k]!r}")
    rank, world = td.get_rank(), td.get_world_size()
    backend = str(td.get_backend())
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
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

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(cfg["warmup"]):
        step()
    sync()
    td.barrier()
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        loss = step()
    sync()
    ms = torch.tensor([(time.perf_counter() - t0) / cfg["steps"] * 1e3], dtype=torch.float64,
                      device=dev)
    td.all_reduce(ms, op=td.ReduceOp.MAX)                     # the slowest rank's time
    # the replicas agree when every rank's weights equal rank 0's
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    ref = flat.clone()
    td.broadcast(ref, 0)
    diff = torch.tensor([float((flat - ref).abs().max())], dtype=torch.float64, device=dev)
    td.all_reduce(diff, op=td.ReduceOp.MAX)
    out = {"world": world, "backend": backend, "device": str(dev), "ms": float(ms),
           "loss": loss, "params": sum(p.numel() for p in model.parameters()),
           "tokens_per_rank": cfg["tokens"], "replicas_equal": float(diff) == 0.0}
    if report is not None:
        report(out)
    return out


def _ray_worker(config: dict) -> None:
    """``train_loop`` in a Ray Train worker. Rank 0 reports its metrics with a checkpoint that
    holds them (``metrics.json``): Ray Train 2.x keeps only metrics that come with a checkpoint
    in its ``Result``; the other ranks report theirs without one."""
    import json
    import tempfile

    import ray.train

    m = train_loop(config)
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(m)
        return
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "metrics.json"), "w") as f:
            json.dump(m, f)
        ray.train.report(m, checkpoint=ray.train.Checkpoint.from_directory(d))


def fit(num_workers: int = 2, use_gpu: bool | None = None, config: dict | None = None,
        **run: Any) -> dict:
    """Run ``train_loop(config)`` on ``num_workers`` Ray Train workers
    (``ray.train.torch.TorchTrainer``: NCCL and one GPU per worker with ``use_gpu``, gloo on
    CPUs without; default: GPUs when this machine has any) and return rank 0's metrics.
    ``run`` goes to ``ray.train.RunConfig`` (``storage_path``: where Ray keeps the run and the
    checkpoint that carries the metrics back, default ``~/ray_results``; ``name``). Starts a
    local Ray (NVLink multicast off in its workers, as ``cudabook.dist.SAFE_ENV``) unless one is
    already running (``ray.init(address=...)`` first to use a cluster)."""
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"fit: num_workers must be an int >= 1, got {num_workers!r}")
    ray = need_ray()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .dist import SAFE_ENV

    if use_gpu is None:
        import torch

        use_gpu = torch.cuda.is_available()
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": dict(SAFE_ENV)})
    trainer = TorchTrainer(_ray_worker, train_loop_config=dict(config or {}),
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
