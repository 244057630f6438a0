"""Data-parallel training in one process over the GPUs of one host, the gradients summed by the
book's own P2P ring all-reduce (kernels/allreduce.cu, bf16) instead of NCCL (Chapter 11).

    from cudabook import dataparallel as dp
    r = dp.train_p2p([0, 1, 2, 3], steps=10)   # {"ms": ..., "ms_single": ..., "efficiency": ...}

The model, batch and optimizer are those of ``cudabook/dist_scripts/ddp_train.py`` (its
``make_model``: 8 bf16 linear layers of 8192 x 8192, 8192 tokens per GPU, SGD), so the time per
step compares with its DDP and "after" modes. One replica per GPU; the replicas' backward passes
run at the same time (PyTorch's autograd engine has a thread per device); each replica's
gradients live in one flat bf16 buffer (the parameters' ``.grad`` are views of it, as DDP's
``gradient_as_bucket_view``), which the ring sums in place after the whole backward, with no
overlap: the schedule of ddp_train's "after" mode. The ring is ordered after each GPU's default
stream and the optimizer step after the ring, so nothing synchronises with the host inside a step.
"""

from __future__ import annotations

import time
from typing import Sequence

__all__ = ["Replicas", "train_p2p"]


class Replicas:
    """One copy of ``ddp_train.make_model`` per GPU with flat bf16 gradient buffers, an SGD
    optimizer each, and a fixed random batch per GPU (a different one on each)."""

    def __init__(self, devices: Sequence[int], width: int = 8192, layers: int = 8,
                 tokens: int = 8192, lr: float = 1e-3):
        import torch

        from .dist_scripts.ddp_train import make_model

        self.devices = [int(d) for d in devices]
        self.models, self.flats, self.opts, self.xs = [], [], [], []
        for r, d in enumerate(self.devices):
            dev = torch.device("cuda", d)
            with torch.cuda.device(dev):
                m = make_model(width, layers, dev)            # the same weights on every GPU
                n = sum(p.numel() for p in m.parameters())
                flat = torch.zeros(n, dtype=torch.bfloat16, device=dev)
                off = 0
                for p in m.parameters():                       # .grad: views of the flat buffer
                    p.grad = flat[off:off + p.numel()].view_as(p)
                    off += p.numel()
                g = torch.Generator(device=dev).manual_seed(1000 + r)
                self.xs.append(torch.randn(tokens, width, generator=g, device=dev,
                                           dtype=torch.bfloat16))
                self.models.append(m)
                self.flats.append(flat)
                self.opts.append(torch.optim.SGD(m.parameters(), lr=lr))
        self.params, self.tokens = sum(p.numel() for p in self.models[0].parameters()), tokens

    def forward_backward(self) -> None:
        import torch

        losses = []
        for d, m, flat, x in zip(self.devices, self.models, self.flats, self.xs):
            with torch.cuda.device(d):
                flat.zero_()                                   # the backward accumulates into it
                losses.append(m(x).float().pow(2).mean())
        torch.autograd.backward(losses)                        # all GPUs at once

    def step(self, group=None) -> None:
        """Forward, backward, the gradient sum over the GPUs (``group.ring``, none with one
        GPU), the mean, and the optimizer step on every GPU."""
        import torch

        self.forward_backward()
        if group is not None:
            group.ring(self.flats)
        for d, flat, opt in zip(self.devices, self.flats, self.opts):
            with torch.cuda.device(d):
                if group is not None:
                    flat.mul_(1.0 / len(self.devices))
                opt.step()

    def synchronize(self) -> None:
        import torch

        for d in self.devices:
            torch.cuda.synchronize(d)

    def max_weight_spread(self) -> float:
        """The largest difference of any weight between GPU 0's copy and the others': 0 when
        every replica took the same steps (the all-reduce gave every GPU the same sum)."""
        worst = 0.0
        p0 = [p.detach().float().cpu() for p in self.models[0].parameters()]
        for m in self.models[1:]:
            for a, b in zip(p0, m.parameters()):
                worst = max(worst, float((a - b.detach().float().cpu()).abs().max()))
        return worst


def train_p2p(devices: Sequence[int], steps: int = 10, warmup: int = 3, **model) -> dict:
    """Time per step of data-parallel training over ``devices`` with the P2P ring, and of the
    same model alone on the first GPU; returns ms per step, the weak-scaling efficiency, the
    model's TFLOP/s per GPU and the largest weight difference between the replicas afterwards."""
    from .compile import load_launch

    devices = [int(d) for d in devices]

    def timed(rep: Replicas, group) -> float:
        for _ in range(warmup):
            rep.step(group)
        rep.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            rep.step(group)
        rep.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    one = Replicas(devices[:1], **model)
    ms_single = timed(one, None)
    params, tokens = one.params, one.tokens
    del one
    group = load_launch("allreduce").PeerGroup(devices)
    rep = Replicas(devices, **model)
    ms = timed(rep, group)
    spread = rep.max_weight_spread()
    del rep
    flops = 6 * params * tokens
    return {"world": len(devices), "ms": ms, "ms_single": ms_single,
            "efficiency": ms_single / ms, "tflops_per_gpu": flops / (ms * 1e-3) / 1e12,
            "params": params, "tokens_per_gpu": tokens, "max_weight_spread": spread}
