"""Tensor parallelism (Megatron's split, cudabook.tensor_parallel) of the GPT at GPT-2-small
shapes against one GPU and against PyTorch's own tensor parallelism, one process per GPU
(Chapter 11). Launched by cudabook.tensor_parallel.gpu_timing (cudabook.dist.torchrun), or by hand:

    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/tp_train.py --batch 8

Every rank builds the same model (cudabook.gpt.build, seed 0, bf16) and feeds the same token ids
(tensor parallelism splits the layers, not the batch). Parts, each timed over --steps iterations
after --warmup (CUDA events, the slowest rank), forward + backward (no optimizer step):
  mlp     one block's MLP on (batch x seq, d) activations. World 1: the unsplit fc / GELU / fc2
          (the baseline). World N: ParallelMLP, its two all-reduces by NCCL (torch.distributed),
          and torch's parallelize_module (ColwiseParallel fc, RowwiseParallel fc2) on the same
          weights: what a practitioner would use.
  block   one whole block (LayerNorms, attention with RoPE, MLP): ParallelBlock, or the block.
  gpt     the whole model, loss = cross entropy of the next token: ParallelGPT, or the model.
  graph   (CUDA) the mlp and block parts also captured in a CUDA graph after warm-up (NCCL's
          all-reduces inside), the way a latency-bound step is run: the host's launch cost is
          gone, what remains is the GPU's. Host time per call is recorded for every part.
  comm    one NCCL all-reduce of a (batch x seq, d) bf16 activation alone: the message every
          split layer sends (the mlp part sends 2 of them, a block 4, the model 4 per layer).
Before timing, rank 0 compares the split outputs and the fc gradient with the unsplit model
(same rank, same weights): the largest differences are returned (bf16 rounding, not zero).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"          # multicast off, also if the caller forgot

import torch  # noqa: E402
import torch.distributed as td  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from cudabook import gpt  # noqa: E402
from cudabook import tensor_parallel as tp  # noqa: E402
from cudabook.dist import script_done, script_rank  # noqa: E402

PARTS = ("mlp", "block", "gpt", "comm")


class MLP(nn.Module):
    """fc2(GELU_tanh(fc(x))) with copies of a block's weights: the unsplit baseline, and the
    module torch's parallelize_module splits."""

    def __init__(self, block, dev, dtype):
        super().__init__()
        d = block.fc.weight.shape[1]
        # skip_init: no random draw (the weights are copied below), so a failed CUDA graph
        # capture earlier in the script, which leaves PyTorch's CUDA generator unusable, cannot
        # stop this module being built
        self.fc = nn.utils.skip_init(nn.Linear, d, 4 * d, bias=False, device=dev, dtype=dtype)
        self.fc2 = nn.utils.skip_init(nn.Linear, 4 * d, d, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            self.fc.weight.copy_(block.fc.weight)
            self.fc2.weight.copy_(block.fc2.weight)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc(x), approximate="tanh"))


def timed(fn, steps: int, warmup: int, dev) -> tuple[float, float]:
    """(ms per call of ``fn``, host ms per call), the slowest rank's. The first is CUDA events
    on this rank's stream (wall clock on the CPU); the second the time the host took to issue
    the calls (before the final synchronisation): where it equals the first, the host, not the
    GPU, sets the pace."""
    for _ in range(warmup):
        fn()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    td.barrier()
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / steps
    if cuda:
        e1.record()
        torch.cuda.synchronize(dev)
        ms = e0.elapsed_time(e1) / steps
    else:
        ms = host
    t = torch.tensor([ms, host], dtype=torch.float64, device=dev)
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def graphed(fn, dev):
    """``fn`` (a forward + backward) captured once in a CUDA graph after warm-up calls on a side
    stream (``cudabook.baselines.torch_graph``: PyTorch's recipe, and the current stream restored
    if the capture fails); returns the replay. The NCCL all-reduces inside are captured too:
    every rank replays its graph, and the captured collectives meet as the eager ones do."""
    from cudabook.baselines import torch_graph

    td.barrier()
    g = torch_graph(fn, name="forward + backward", capture_error_mode="thread_local")
    torch.cuda.synchronize(dev)
    return g


def fwd_bwd(net, x_or_ids, loss_of):
    """One forward + backward; the gradients are dropped (set_to_none) before the next."""
    for p in net.parameters():
        p.grad = None
    if x_or_ids.is_floating_point():
        x_or_ids.grad = None
    loss_of(net(x_or_ids)).backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (every rank the same)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: gloo processes in float32, a check that runs anywhere")
    a = ap.parse_args()
    parts = a.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"unknown parts {bad}: the parts are {PARTS}")
    world = int(os.environ["WORLD_SIZE"])
    cfg = gpt.GPTConfig(vocab=a.vocab, d=a.dim, n_layer=a.layers, n_head=a.n_head, ctx=a.seq)
    if cfg.n_head % world or (4 * cfg.d) % world:
        raise SystemExit(f"tp_train: {world} ranks cannot split {cfg.n_head} heads and a hidden "
                         f"size of {4 * cfg.d} evenly (world must divide both)")
    rank, world, dev, dtype = script_rank("tp_train", a.device, torch.bfloat16)
    cuda = dev.type == "cuda"
    model = gpt.build(cfg, seed=0, device=dev, dtype=dtype).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (a.batch, a.seq), generator=g).to(dev)
    x = (torch.randn(a.batch, a.seq, cfg.d, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    blk = model.blocks[0]
    cos, sin = model.cos[:a.seq], model.sin[:a.seq]
    tokens = a.batch * a.seq
    out = {"world": world, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "backend": td.get_backend(), "tokens": tokens,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "d": cfg.d, "n_head": cfg.n_head, "layers": cfg.n_layer, "vocab": cfg.vocab,
           "message_bytes": tokens * cfg.d * (torch.finfo(dtype).bits // 8), "ms": {}, "check": {}}
    ar = tp.TorchAllReduce()

    out["host_ms"], out["graph_errors"] = {}, {}

    def T(name: str, fn, graph: bool = False) -> None:
        """out["ms"][name] (and out["host_ms"][name]): fn timed, eagerly or as a CUDA graph
        (CUDA only; a capture that fails is reported in out["graph_errors"], not raised)."""
        if graph:
            if not cuda:
                return
            try:
                fn = graphed(fn, dev)
            except Exception as e:  # noqa: BLE001  (the eager numbers still stand)
                out["graph_errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize(dev)
                return
        out["ms"][name], out["host_ms"][name] = timed(fn, a.steps, a.warmup, dev)

    mean_sq = lambda y: y.float().pow(2).mean()                         # noqa: E731
    gap = lambda y, r: float((y.detach().float() - r.detach().float()).abs().max())  # noqa: E731

    def gpt_loss(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab), ids[:, 1:].reshape(-1))

    if "mlp" in parts:
        base = MLP(blk, dev, dtype)
        if world == 1:
            T("mlp unsplit", lambda: fwd_bwd(base, x, mean_sq))
            T("mlp unsplit graph", lambda: fwd_bwd(base, x, mean_sq), graph=True)
        else:
            mine = tp.ParallelMLP(blk.fc, blk.fc2, rank, world, ar)
            y, ref = mine(x), base(x)
            mean_sq(y).backward()
            mean_sq(ref).backward()
            k = mine.fc.weight.shape[0]
            out["check"]["mlp output"] = gap(y, ref)
            out["check"]["mlp fc grad"] = float((mine.fc.weight.grad.float() - base.fc.weight.grad[
                rank * k:(rank + 1) * k].float()).abs().max())
            out["check"]["mlp scale"] = float(ref.detach().float().abs().max())
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )
            mesh = init_device_mesh(dev.type, (world,))
            theirs = parallelize_module(MLP(blk, dev, dtype), mesh,
                                        {"fc": ColwiseParallel(), "fc2": RowwiseParallel()})
            yt = theirs(x)
            out["check"]["mlp torch TP output"] = gap(yt, ref)
            # the checks' outputs hold their autograd graphs, and with them the AccumulateGrad
            # node of x made on this (default) stream: alive, it would be reused inside the
            # capture, on the wrong stream, and break it
            del y, ref, yt
            T("mlp book", lambda: fwd_bwd(mine, x, mean_sq))
            T("mlp torch TP", lambda: fwd_bwd(theirs, x, mean_sq))
            T("mlp book graph", lambda: fwd_bwd(mine, x, mean_sq), graph=True)
            del mine, theirs
        del base
    if "block" in parts:
        if world == 1:
            T("block unsplit", lambda: _block_step(blk, x, cos, sin))
            T("block unsplit graph", lambda: _block_step(blk, x, cos, sin), graph=True)
        else:
            pb = tp.ParallelBlock(blk, rank, world, ar)
            y, ref = pb(x, cos, sin), blk(x, cos, sin)
            out["check"]["block output"] = gap(y, ref)
            out["check"]["block scale"] = float(ref.detach().float().abs().max())
            del y, ref                       # as in the mlp part: no graph kept alive
            T("block book", lambda: _block_step(pb, x, cos, sin))
            T("block book graph", lambda: _block_step(pb, x, cos, sin), graph=True)
            del pb
    if "gpt" in parts:
        if world == 1:
            T("gpt unsplit", lambda: fwd_bwd(model, ids, gpt_loss))
        else:
            pg = tp.ParallelGPT(model, rank, world, ar)
            with torch.no_grad():
                lp, lr = gpt_loss(pg(ids)), gpt_loss(model(ids))
            out["check"]["gpt loss"] = [float(lp), float(lr)]
            T("gpt book", lambda: fwd_bwd(pg, ids, gpt_loss))
            del pg
    if "comm" in parts and world > 1:
        buf = torch.ones(tokens, cfg.d, device=dev, dtype=dtype)

        def reduce() -> None:
            td.all_reduce(buf)
            buf.fill_(1.0)                     # stays finite; the fill is timed too (small)

        T("all-reduce", reduce)
        out["ms"]["all-reduce"] -= timed(lambda: buf.fill_(1.0), a.steps, a.warmup, dev)[0]
    out["params"] = sum(p.numel() for p in model.parameters())
    out["peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None
    script_done(out, rank)

def _block_step(block, x, cos, sin) -> None:
    for p in block.parameters():
        p.grad = None
    x.grad = None
    block(x, cos, sin).float().pow(2).mean().backward()


if __name__ == "__main__":
    main()
