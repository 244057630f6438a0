"""Data-parallel training of a wide MLP (compute-bound: ~6 * params * tokens FLOPs a step),
one process per GPU (Chapter 11). Launched by cudabook.dist.torchrun, or by hand:

    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/ddp_train.py --width 8192

Modes, each on fresh weights, timed over --steps steps after --warmup (CUDA events, slowest
rank):
  single      world size 1 only: no communication, the baseline of the scaling efficiency
  ddp         torch DistributedDataParallel (25 MB buckets, all-reduce overlapped with backward)
  after       the same buckets all-reduced after the whole backward (no overlap)
  overlap     the chapter's own buckets and hooks (ex11.2 + ex11.3) on NCCL
Weak scaling: every rank has the same per-GPU batch, so efficiency = t(1 GPU) / t(N GPUs).
Rank 0 also records one profiled step of `ddp` and of `after`: the kernels of the compute stream
and of NCCL's stream, for the lesson's timeline. The script runs on several nodes unchanged.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"          # multicast off, also if the caller forgot

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def make_model(width: int, layers: int, dev) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16, device=dev))
        if i < layers - 1:
            mods.append(torch.nn.GELU(approximate="tanh"))
    for m in mods:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=width ** -0.5)
    return torch.nn.Sequential(*mods)


def buckets_of(params, cap_bytes):
    out, cur, size = [], [], 0
    for p in reversed(params):                  # backward order (ex11.2)
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


class Buckets:
    """ex11.3's answer on NCCL: each bucket all-reduced as soon as its last gradient is ready
    (overlap=True) or all after the backward (overlap=False); finish() averages and writes back."""

    def __init__(self, params, cap_bytes, world, overlap):
        self.buckets, self.world, self.overlap = buckets_of(params, cap_bytes), world, overlap
        self.where = {p: b for b, bk in enumerate(self.buckets) for p in bk}
        self.ready = [0] * len(self.buckets)
        self.pending = []
        for p in self.where:
            p.register_post_accumulate_grad_hook(self.hook)

    def launch(self, b):
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[b]])
        self.pending.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def hook(self, p):
        b = self.where[p]
        self.ready[b] += 1
        if self.overlap and self.ready[b] == len(self.buckets[b]):
            self.launch(b)

    def finish(self):
        if not self.overlap:
            for b in range(len(self.buckets)):
                self.launch(b)
        for b, flat, h in self.pending:
            h.wait()
            flat /= self.world
            off = 0
            for q in self.buckets[b]:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q.grad))
                off += q.numel()
        self.ready = [0] * len(self.buckets)
        self.pending = []


def kernels_of(prof) -> list:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f).get("traceEvents", [])
    os.unlink(path)
    ks = [e for e in evs if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return [{"name": e["name"][:60], "stream": (e.get("args") or {}).get("stream"),
             "ts": e["ts"], "dur": e["dur"]} for e in ks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8192, help="tokens per GPU per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--modes", default="ddp,after,overlap")
    ap.add_argument("--trace", type=int, default=1)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    modes = ["single"] if world == 1 else a.modes.split(",")
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    x = torch.randn(a.batch, a.width, generator=g, device=dev, dtype=torch.bfloat16)
    res, traces = {}, {}
    for mode in modes:
        model = make_model(a.width, a.layers, dev)
        hooks = None
        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[local], bucket_cap_mb=a.bucket_mb, gradient_as_bucket_view=True)
        else:
            net = model
            if mode in ("after", "overlap"):
                hooks = Buckets(list(model.parameters()), a.bucket_mb * 2**20, world,
                                overlap=(mode == "overlap"))
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = net(x).float().pow(2).mean()
            loss.backward()
            if hooks is not None:
                hooks.finish()
            opt.step()

        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.steps):
            step()
        e1.record()
        torch.cuda.synchronize()
        t = torch.tensor([e0.elapsed_time(e1) / a.steps], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[mode] = float(t.item())
        if a.trace and rank == 0 and mode in ("ddp", "after", "single"):
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:   # one step, nothing else
                step()
                torch.cuda.synchronize()
            traces[mode] = kernels_of(prof)
        elif a.trace and mode in ("ddp", "after", "single"):
            step()                                   # the other ranks join the profiled step
            torch.cuda.synchronize()
        net = model = opt = hooks = None  # noqa: F841  (free the memory before the next mode)
        torch.cuda.empty_cache()
    params = a.width * a.width * a.layers
    if rank == 0:
        out = {"world": world, "gpu": torch.cuda.get_device_name(dev), "ms": res,
               "params": params, "grad_bytes": 2 * params, "tokens_per_gpu": a.batch,
               "tflops_per_gpu": {m: 6 * params * a.batch / (v * 1e-3) / 1e12
                                  for m, v in res.items()},
               "traces": traces}
        path = os.environ.get("CUDABOOK_DIST_OUT")
        if path:
            with open(path, "w") as f:
                json.dump(out, f)
        else:
            print(json.dumps({k: v for k, v in out.items() if k != "traces"}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
