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
           "bus_bandwidth", "bus_factor", "AlphaBeta", "fit_alpha_beta", "ring_cost",
           "NodeBound", "internode_bus_bound", "multinode_ring_cost", "NVLINK4_GBS",
           "CONNECTX7_GBIT"]


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


# ============================================================================ across nodes
#: published: NVLink 4 of one H100 SXM or H200 SXM GPU, GB/s in ONE direction. NVIDIA's datasheets
#: give "NVLink: 900GB/s", the two directions together (18 links of 25 GB/s each way): NVIDIA,
#: "NVIDIA H100 Tensor Core GPU" datasheet, 2023, https://www.nvidia.com/en-us/data-center/h100/;
#: "NVIDIA H200 Tensor Core GPU" datasheet, 2024, https://www.nvidia.com/en-us/data-center/h200/
NVLINK4_GBS = 450.0
#: published: one NVIDIA ConnectX-7 adapter port, 400 Gb/s (NDR InfiniBand or 400GbE), i.e.
#: 50 GB/s each way: NVIDIA, "ConnectX-7 400G Adapters" datasheet, 2022,
#: https://www.nvidia.com/en-us/networking/ethernet/connectx-7/ . A DGX H100 / H200 node has
#: eight of them for its compute network, one next to each GPU: NVIDIA, "DGX H100 User Guide",
#: Network Connections, https://docs.nvidia.com/dgx/dgxh100-user-guide/
CONNECTX7_GBIT = 400.0


@dataclass
class NodeBound:
    """The bus-bandwidth bound of an all-reduce across nodes (GB/s, one direction, per GPU, in
    nccl-tests' sense): ``bus_gbs = min(nvlink_gbs, network_gbs)``; ``limit`` names the side that
    binds."""

    nvlink_gbs: float
    network_gbs: float
    nics_per_node: int
    nic_gbs: float
    bus_gbs: float
    limit: str

    def __str__(self) -> str:
        nics = f"{self.nics_per_node} NIC{'s' if self.nics_per_node > 1 else ''}"
        return (f"bus <= min(NVLink {self.nvlink_gbs:.0f}, {nics} x "
                f"{self.nic_gbs:.0f} = {self.network_gbs:.0f}) = {self.bus_gbs:.0f} GB/s "
                f"({self.limit}-bound)")


def internode_bus_bound(nvlink_gbs: float, nics_per_node: int,
                        nic_gbit: float = CONNECTX7_GBIT) -> NodeBound:
    """Upper bound on the bus bandwidth of a ring all-reduce across nodes whose GPUs talk over
    NVLink inside a node and over ``nics_per_node`` network cards of ``nic_gbit`` Gb/s each
    between nodes (GPUDirect RDMA: each card reads and writes GPU memory directly):

        bus <= min(nvlink_gbs, nics_per_node * nic_gbit / 8)          (GB/s)

    Derivation. Take N = nodes x G ranks, S bytes per rank. Bus bandwidth is
    ``bus = S / t * 2 (N - 1) / N`` (nccl-tests' PERFORMANCE.md), so ``t = 2 (N - 1)/N * S / bus``:
    a bound on the bytes some link must carry in time t is a bound on ``bus``.

    * NVLink: in a ring every rank sends ``2 (N - 1)/N * S`` bytes (2 (N - 1) steps of S / N), most
      of them over its own NVLink ports: ``bus <= nvlink_gbs``, as on one host.
    * Network: NCCL runs k rings at once (its channels), each carrying S / k of the buffer. A ring
      enters and leaves every node once, so per step it sends S / (k N) bytes out of each node:
      ``2 (N - 1)/N * S / k`` per ring, ``2 (N - 1)/N * S`` over all k rings, however many there
      are. That is the same number of bytes as one rank sends; the difference is who carries it.
      With one card per node all of it goes through that card: ``bus <= nic``. With a card next
      to each GPU, NCCL makes each ring leave the node through a different GPU and its card
      (k >= cards), so the node's cards share the bytes: ``bus <= nics_per_node * nic``.

    The one-card reading ("the network card is the bottleneck") holds only for a node with a
    single card. This is the bound of the ring. A hierarchical all-reduce (reduce-scatter over
    NVLink, an all-reduce of S / G per GPU between the n nodes over that GPU's own card,
    all-gather over NVLink) sends ``2 (n - 1)/n * S`` bytes out of a node instead of
    ``2 (N - 1)/N * S``: fewer at a few nodes (about half at n = 2), the same as n grows, so at
    scale the bound above holds for it too (its NVLink phases then cost extra time).

    Worked example (published numbers, ``NVLINK4_GBS``, ``CONNECTX7_GBIT``): an 8-GPU H100 or
    H200 node with 8 ConnectX-7 cards of 400 Gb/s has 8 x 50 = 400 GB/s of network against
    450 GB/s of NVLink per GPU: ``min(450, 400) = 400 GB/s``, network-bound but within 11% of
    NVLink. The same node with one 400 Gb/s card: ``min(450, 50) = 50 GB/s``, 8 times less.
    """
    for name, v in (("nvlink_gbs", nvlink_gbs), ("nic_gbit", nic_gbit)):
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"internode_bus_bound: {name} must be a positive number, got {v!r}")
    if not isinstance(nics_per_node, int) or nics_per_node < 1:
        raise ValueError(f"internode_bus_bound: nics_per_node must be an int >= 1, got "
                         f"{nics_per_node!r} (a node without a network card cannot join)")
    nic = nic_gbit / 8.0
    net = nics_per_node * nic
    bus = min(float(nvlink_gbs), net)
    return NodeBound(float(nvlink_gbs), net, nics_per_node, nic, bus,
                     "network" if net < nvlink_gbs else "NVLink")


def multinode_ring_cost(nbytes: float, nodes: int, gpus_per_node: int, alpha_us: float,
                        nvlink_gbs: float, nics_per_node: int,
                        nic_gbit: float = CONNECTX7_GBIT) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` per rank over ``nodes`` x ``gpus_per_node``
    GPUs by the alpha-beta model (``ring_cost``), each step's link bandwidth being the bound of
    ``internode_bus_bound`` (NVLink alone when ``nodes == 1``):
    ``2 (N - 1) (alpha + S / N / bus)``."""
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"multinode_ring_cost: nodes must be an int >= 1, got {nodes!r}")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"multinode_ring_cost: gpus_per_node must be an int >= 1, got "
                         f"{gpus_per_node!r}")
    if nbytes < 0 or alpha_us < 0:
        raise ValueError("multinode_ring_cost: nbytes and alpha_us must be >= 0")
    bound = internode_bus_bound(nvlink_gbs, nics_per_node, nic_gbit)
    bw = bound.bus_gbs if nodes > 1 else bound.nvlink_gbs
    return ring_cost(nbytes, nodes * gpus_per_node, alpha_us, bw)
