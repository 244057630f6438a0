"""All-reduce, on paper and over ``cudabook.dist.Comm``: chunking, the ring's schedule, the
simple algorithms, bus bandwidth and the alpha-beta cost model.

    lo, hi = chunk_bounds(n, world, c)       # chunk c of n elements split over world ranks
    sched = ring_schedule(world)             # who sends which chunk at each step of the ring
    one_shot_allreduce(x, comm)              # every rank sends its whole buffer to every other
    bus = bus_bandwidth(nbytes, seconds, world)
    fit = fit_alpha_beta(sizes, seconds)     # t = alpha + bytes / bandwidth

The ring all-reduce itself is the chapter's first exercise (``solutions/11_multi_gpu.ipynb``);
the GPU versions are ``kernels/allreduce.cu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["chunk_bounds", "ring_schedule", "naive_allreduce", "one_shot_allreduce",
           "bus_bandwidth", "bus_factor", "AlphaBeta", "fit_alpha_beta", "ring_cost"]


def chunk_bounds(n: int, world: int, c: int) -> tuple[int, int]:
    """Elements [lo, hi) of chunk ``c``: n split into ``world`` chunks whose sizes differ by at
    most one (the first n % world chunks get one more), so no element is dropped."""
    base, extra = divmod(n, world)
    lo = c * base + min(c, extra)
    return lo, lo + base + (1 if c < extra else 0)


def ring_schedule(world: int) -> list[list[tuple[int, int, int]]]:
    """The ring all-reduce's 2 (world - 1) steps; each a list of (sender, receiver, chunk).

    Steps 0 .. world-2 are the reduce-scatter (the receiver adds the chunk to its own), the
    rest the all-gather (the receiver overwrites its chunk). Rank r sends to (r + 1) % world;
    at reduce-scatter step s it sends chunk (r - s) % world, at all-gather step s it sends
    chunk (r + 1 - s) % world, so after the reduce-scatter rank r owns the sum of chunk
    (r + 1) % world.
    """
    steps = []
    for s in range(world - 1):
        steps.append([(r, (r + 1) % world, (r - s) % world) for r in range(world)])
    for s in range(world - 1):
        steps.append([(r, (r + 1) % world, (r + 1 - s) % world) for r in range(world)])
    return steps


def naive_allreduce(x, comm, root: int = 0) -> None:
    """Reduce to ``root`` then broadcast from it, in place (sum). The root receives and sends
    (world - 1) whole buffers: its link carries 2 (world - 1) n elements, the others 2 n."""
    import torch

    if comm.world == 1:
        return
    if comm.rank == root:
        buf = torch.empty_like(x)
        for r in range(comm.world):
            if r != root:
                comm.recv(buf, r)
                x += buf
        for r in range(comm.world):
            if r != root:
                comm.send(x, r)
    else:
        comm.send(x, root)
        comm.recv(x, root)


def one_shot_allreduce(x, comm) -> None:
    """Every rank sends its whole buffer to every other and adds what it receives, in place
    (sum). One round of messages (the lowest latency), world - 1 buffers in and out per rank.
    The order of the sum is the rank order on every rank, so all ranks get identical bits."""
    import torch

    w, r = comm.world, comm.rank
    if w == 1:
        return
    parts = [None] * w
    parts[r] = x.clone()
    for k in range(1, w):            # round k: send to r + k, receive from r - k (a shift)
        buf = torch.empty_like(x)
        comm.sendrecv(x, (r + k) % w, buf, (r - k) % w)
        parts[(r - k) % w] = buf
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    x.copy_(total)


def bus_factor(world: int, op: str = "all_reduce") -> float:
    """NCCL's bus-bandwidth factor: 2 (n - 1) / n for all-reduce, (n - 1) / n for
    reduce-scatter and all-gather. bus = algorithm bandwidth x factor = the bytes each rank's
    link must carry per unit time, whatever the algorithm (nccl-tests' PERFORMANCE.md)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    f = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}
    if op not in f:
        raise ValueError(f"op must be one of {sorted(f)}, got {op!r}")
    return f[op] * (world - 1) / world


def bus_bandwidth(nbytes: float, seconds: float, world: int, op: str = "all_reduce") -> float:
    """GB/s of bus bandwidth of one all-reduce of ``nbytes`` per rank taking ``seconds``."""
    return nbytes / seconds * bus_factor(world, op) / 1e9


@dataclass
class AlphaBeta:
    """t(n) = alpha + n / bandwidth, fitted per world size (alpha in us, bandwidth in GB/s)."""

    alpha_us: float
    gbs: float

    def seconds(self, nbytes) -> np.ndarray:
        return self.alpha_us * 1e-6 + np.asarray(nbytes, dtype=np.float64) / (self.gbs * 1e9)

    def __str__(self) -> str:
        return f"t = {self.alpha_us:.1f} us + bytes / ({self.gbs:.0f} GB/s)"


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least squares of t = alpha + beta n, weighted by 1 / t (relative error), so the small
    sizes fix alpha and the large ones beta. Bandwidth here is algorithm bandwidth (n / t)."""
    n = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or n.size < 2:
        raise ValueError("fit_alpha_beta: need two or more (bytes, seconds) pairs of equal length")
    w = 1.0 / t
    a = np.stack([np.ones_like(n), n], 1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    alpha, beta = max(alpha, 0.0), max(beta, 1e-30)
    return AlphaBeta(alpha * 1e6, 1 / beta / 1e9)


def ring_cost(nbytes: float, world: int, alpha_us: float, link_gbs: float) -> float:
    """Seconds of a ring all-reduce by the alpha-beta model: 2 (w - 1) steps, each one latency
    plus n / w bytes over one link (Patarasuk and Yuan 2009; Thakur et al. 2005)."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) * (alpha_us * 1e-6 + nbytes / world / (link_gbs * 1e9))
