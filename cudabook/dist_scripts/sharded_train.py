"""Sharded data parallelism (ZeRO-1/2/3) against DDP and PyTorch's FSDP2, one process per GPU
(Chapter 11). Launched by cudabook.sharded.gpu_timing (cudabook.dist.torchrun), or by hand:

    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/sharded_train.py --width 8192

The model is ddp_train's (--layers square bf16 Linear layers of --width, tanh-GELU between,
ddp_train's loss), AdamW (foreach=False in every mode, so the optimizers do the same work).
Modes, each on fresh weights, timed over --steps steps after --warmup (CUDA events, slowest
rank):
  ddp        torch DistributedDataParallel (25 MB buckets, all-reduce overlapped with backward)
  allreduce  cudabook.sharded.DataParallel: one flat buffer all-reduced after the backward
  zero1      cudabook.sharded.Zero1: optimizer state sharded
  zero2      cudabook.sharded.Zero2: gradients reduce-scattered layer by layer too
  zero3      cudabook.sharded.Zero3: parameters gathered per layer ahead of use (prefetch)
  fsdp2      torch.distributed.fsdp.fully_shard on every Linear, then on the whole model
For each mode: ms per step, the peak of torch.cuda.max_memory_allocated over the timed steps
(largest rank: it includes the batch, the activations and the allocator's temporaries), the
engine's ledger (parameters + gradients + optimizer state at peak), the bytes a rank sends per
step, and the warm-up losses (every mode should follow ddp's). --device cpu runs the same on
gloo CPU processes (wall-clock timing, no memory figures): a check that runs anywhere.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"          # multicast off, also if the caller forgot

import torch  # noqa: E402
import torch.distributed as td  # noqa: E402

from cudabook import sharded  # noqa: E402
from cudabook.dist import script_done, script_rank  # noqa: E402

MODES = ("ddp", "allreduce", "zero1", "zero2", "zero3", "fsdp2")


def build(mode: str, a, dev, dtype, world: int):
    """The model of ``mode`` and its step function (forward, backward, optimizer step)."""
    model = sharded.make_model(a.width, a.layers, dtype=dtype, device=dev)
    if mode in ("allreduce", "zero1", "zero2", "zero3"):
        eng = sharded.shard(model, "ddp" if mode == "allreduce" else mode,
                            optimizer=a.optimizer, lr=a.lr)
        return eng, eng.step
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None,
            bucket_cap_mb=25, gradient_as_bucket_view=True)
    elif mode == "fsdp2":
        net = sharded.fsdp2(model, world, dev.type)
    else:
        raise SystemExit(f"unknown mode {mode!r}: the modes are {MODES}")
    opt = sharded._optimizer(list(net.parameters()), a.optimizer, a.lr)

    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = sharded._loss(net(x))
        loss.backward()
        opt.step()
        return loss.detach()

    return (net, opt), step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8192, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--optimizer", default="adamw", choices=sharded.OPTIMIZERS)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown modes {bad}: the modes are {MODES}")
    rank, world, dev, dtype = script_rank("sharded_train", a.device, torch.bfloat16)
    cuda = dev.type == "cuda"
    x = sharded._batch(rank, a.batch, a.width, dtype, dev)
    res = {}
    for mode in modes:
        held, step = build(mode, a, dev, dtype, world)
        losses = [float(step(x)) for _ in range(a.warmup)]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()     # the steady state: after the first steps
        td.barrier()
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(x)
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            ms = e0.elapsed_time(e1) / a.steps
        else:
            ms = (time.perf_counter() - t0) / a.steps * 1e3
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        t = torch.tensor([ms, float(peak)], dtype=torch.float64, device=dev)
        td.all_reduce(t, op=td.ReduceOp.MAX)
        row = {"ms": float(t[0]), "peak_mib": float(t[1]) / 2**20 if cuda else None,
               "losses": losses}
        if isinstance(held, sharded._Engine):
            rep = held.report()
            row.update(ledger=rep["memory"], bytes_per_step=rep["bytes_per_step"],
                       collectives=rep["collectives"])
        res[mode] = row
        held = step = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    paper = sharded.make_model(a.width, a.layers, dtype=dtype, device="meta")
    params = sum(p.numel() for p in paper.parameters())
    out = {"world": world, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "backend": td.get_backend(), "params": params, "tokens_per_rank": a.batch,
           "optimizer": a.optimizer, "modes": res,
           "tflops_per_rank": {m: 6 * params * a.batch / (r["ms"] * 1e-3) / 1e12
                               for m, r in res.items()},
           "memory_model": {s: sharded.memory_model(paper, s, world, a.optimizer)
                            for s in sharded.STAGES},
           "step_bytes": {s: sharded.step_bytes(paper, s, world) for s in sharded.STAGES}}
    script_done(out, rank)

if __name__ == "__main__":
    main()
