"""NCCL all-reduce through torch.distributed, one process per GPU: device time per call and bus
bandwidth from 4 KB to 1 GB (Chapter 11). Launched by cudabook.dist.torchrun, or by hand:

    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/allreduce_sweep.py --max-bytes 1G
    torchrun --standalone --nproc_per_node 8 cudabook/dist_scripts/allreduce_sweep.py --cpu \
             --max-bytes 4M

With --cpu it runs gloo over CPU processes (wall-clock time per call): the simulation of how
the cost of a ring grows with the number of ranks, on any machine.

Each size: the result is checked (every rank holds the sum), then `iters` calls are queued
behind a sleep kernel so the host's launch cost is hidden, and timed with CUDA events on the
current stream (which waits for NCCL's stream); the slowest rank's time per call is reported.
The same script runs on several nodes unchanged (torchrun --nnodes ... --rdzv_endpoint ...),
NCCL then crossing InfiniBand or RoCE between them. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"          # multicast off, also if the caller forgot

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_bytes(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="1G")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world < 2:
        raise SystemExit("allreduce_sweep: an all-reduce needs 2 or more ranks "
                         "(--nproc_per_node 2 or more)")
    if a.cpu:
        return cpu_sweep(a, rank, world)
    if torch.cuda.device_count() <= local:
        raise SystemExit(f"allreduce_sweep: rank {rank} wants GPU {local}, this node has "
                         f"{torch.cuda.device_count()}")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rows = []
    nbytes = parse_bytes(a.min_bytes)
    big = torch.empty(parse_bytes(a.max_bytes) // 4, dtype=torch.float32, device=dev)
    while nbytes <= parse_bytes(a.max_bytes):
        x = big[: nbytes // 4]
        x.fill_(rank + 1)
        dist.all_reduce(x)
        want = world * (world + 1) / 2
        ok = bool(torch.all(x == want).item())
        iters = 50 if nbytes <= 2**20 else 20 if nbytes <= 2**26 else 5
        for _ in range(3):
            x.fill_(1.0 / world)                    # stays 1 / world^(1-k): never overflows
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(40e3 * iters * 2))    # ~40 us per queued call at ~2 GHz
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end) * 1e3 / iters], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        us = float(t.item())
        alg = nbytes / (us * 1e-6) / 1e9
        rows.append({"bytes": nbytes, "us": us, "algbw": alg,
                     "busbw": alg * 2 * (world - 1) / world, "correct": ok})
        nbytes *= a.factor
    okall = torch.tensor([all(r["correct"] for r in rows)], device=dev, dtype=torch.int32)
    dist.all_reduce(okall, op=dist.ReduceOp.MIN)
    if rank == 0:
        out = {"world": world, "gpu": torch.cuda.get_device_name(dev),
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows,
               "all_correct": bool(okall.item())}
        emit(out)
    dist.destroy_process_group()


def emit(out: dict) -> None:
    path = os.environ.get("CUDABOOK_DIST_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f)
    else:
        print(json.dumps(out, indent=1))


def cpu_sweep(a, rank: int, world: int) -> None:
    import time

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    nbytes = parse_bytes(a.min_bytes)
    while nbytes <= parse_bytes(a.max_bytes):
        x = torch.full((nbytes // 4,), 1.0 / world)
        iters = 20 if nbytes <= 2**20 else 5
        for _ in range(2):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        t = torch.tensor([(time.perf_counter() - t0) * 1e6 / iters])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        us = float(t.item())
        alg = nbytes / (us * 1e-6) / 1e9
        rows.append({"bytes": nbytes, "us": us, "algbw": alg,
                     "busbw": alg * 2 * (world - 1) / world, "correct": True})
        nbytes *= a.factor
    if rank == 0:
        emit({"world": world, "gpu": "CPU (gloo)", "rows": rows, "all_correct": True})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
