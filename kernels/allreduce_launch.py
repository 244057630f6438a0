"""Launching kernels/allreduce.cu: all-reduce over the GPUs of one host from one process.

    ar = cb.load_launch("allreduce")
    g = ar.PeerGroup()                       # every visible GPU (at least 2), peer access on
    bufs = [g.zeros(n, d) for d in g.devices]
    g.ring(bufs)                             # in place: every bufs[r] = sum over r (ring)
    g.ring(grads)                            # PyTorch float32 or bf16 tensors, zero copy
    g.one_shot(ins, outs)                    # outs[r] = sum of ins (one kernel per GPU), v2
    g.one_shot(ins, outs, version="v1")      # the pull version with two flag barriers
    g.peer_copy(dst, src)                    # a kernel on dst's GPU reads src on another GPU
    us = g.device_time_us(lambda: g.ring(bufs), iters=20)

    ONE_SHOT_VERSIONS, KERNELS     one_shot_v1 (pull) / v2 (push); every kernel of allreduce.cu
    config(kernel, n, sms)         -> Launch(grid, block=256, kernel=kernel) on one GPU
    PeerGroup(devices)             the entry point: a stateful object (the GPUs, their streams,
                                   flags and receive areas live as long as the group), with
                                   ring(bufs), one_shot(ins, outs, version), peer_copy(dst, src)
    set_peer_access, memcpy_peer_us, sweep   the lesson's measurements
    sanitize_targets()             the ring's step kernels on every GPU of the host

Every call checks its buffers (float32, or bf16 PyTorch tensors for the ring; 1-D, contiguous,
on the GPU, one per GPU in device order, equal sizes, 16-byte aligned; one_shot v1's outputs
apart from its inputs, v2's messages at most ONE_SHOT_MAX_BYTES) and refuses with a message; a
machine with fewer than 2 GPUs, or a pair of GPUs without peer access, is refused when the group
is made. The group runs on streams of its own, ordered after the work already queued on each
GPU's current stream, and each GPU's current stream waits for the group's work: use the buffers
before and after as usual. NVLink multicast is never used. Versions are spelled "v2" or
"one_shot_v2".
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["PeerGroup", "ONE_SHOT_VERSIONS", "KERNELS", "MAX_ONE_SHOT_BLOCKS",
           "ONE_SHOT_MAX_BYTES", "config", "set_peer_access", "memcpy_peer_us", "sweep",
           "sanitize_targets"]

ONE_SHOT_VERSIONS = ("v1", "v2")
#: the kernels of allreduce.cu (the ring's steps, float32 and bf16, and the one-shots)
KERNELS = ("ring_step_add", "ring_step_copy", "one_shot_v1", "one_shot_v2", "ring_step_add_bf16",
           "ring_step_copy_bf16")

#: the one-shot grid's upper bound: its blocks wait for each other's peers, so all must be resident
MAX_ONE_SHOT_BLOCKS = 64

#: the largest message of one_shot_v2 (its receive areas: 2 x world x 2 x this many bytes per GPU)
ONE_SHOT_MAX_BYTES = 4 << 20


def config(kernel: str, n: int, sms: int) -> Launch:
    """Grid and block of ``kernel`` over n elements on a GPU of ``sms`` SMs: a ring step runs
    blocks of 256 threads, 4 float4 each, at most 4 per SM; a one-shot at most one block per SM
    and MAX_ONE_SHOT_BLOCKS in all, since its blocks wait for each other's peers (``sms``: the
    smallest SM count of the group)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; allreduce.cu has {KERNELS}")
    if kernel.startswith("one_shot"):
        return Launch((max(1, min(ceil_div(n, 256 * 4), MAX_ONE_SHOT_BLOCKS, sms)),), (256,),
                      kernel=kernel)
    return Launch((max(1, min(ceil_div(n, 4 * 256 * 4), 4 * sms)),), (256,), kernel=kernel)


class PeerGroup:
    """The GPUs ``devices`` (default: all), with peer access enabled between every pair, one
    stream, the module's kernels, one flag array and one receive area per GPU.

    A stateful object is right for a peer group, unlike the book's other launchers: peer access,
    the streams, the flags the one-shots wait on (and their epochs) and v2's receive areas are
    set up once and must outlive every call, so the group is made once and its methods launch."""

    def __init__(self, devices: Sequence[int] | None = None):
        import cupy as cp

        rt = cp.cuda.runtime
        have = rt.getDeviceCount() if cb.HAS_GPU else 0
        devices = list(range(have)) if devices is None else [int(d) for d in devices]
        if len(devices) < 2:
            raise LaunchError(f"PeerGroup needs 2 or more GPUs of one host; this machine has "
                              f"{have} (devices {devices})")
        if len(set(devices)) != len(devices) or not all(0 <= d < have for d in devices):
            raise LaunchError(f"PeerGroup: devices {devices} must be distinct, in 0..{have - 1}")
        for a in devices:
            for b in devices:
                if a != b and not rt.deviceCanAccessPeer(a, b):
                    raise LaunchError(f"PeerGroup: GPU {a} cannot access GPU {b}'s memory (no "
                                      "peer access between them: no NVLink and no PCIe P2P); "
                                      "use NCCL, which stages through host memory")
        self.devices, self.world = devices, len(devices)
        self.mods, self.streams, self.flags, self.sms, self.lines = [], [], [], [], []
        self.epoch, self.epoch2 = 1, 0
        self.cap = ONE_SHOT_MAX_BYTES // 8             # lines of 2 floats
        for a in devices:
            with cp.cuda.Device(a):
                for b in devices:
                    if a != b:
                        set_peer_access(a, b, True)
                mod = cb.module("allreduce")   # compiled once; each kernel loads on each GPU
                k = {n: mod.get(n) for n in KERNELS}
                k["spin"] = cb.module("profiling").get("spin")
                self.mods.append(k)
                self.streams.append(cp.cuda.Stream(non_blocking=True))
                self.flags.append(cp.zeros(self.world * MAX_ONE_SHOT_BLOCKS, cp.uint32))
                # one_shot_v2's receive area: 2 halves x world senders x cap lines of 16 bytes
                self.lines.append(cp.zeros(2 * self.world * self.cap * 4, cp.uint32))
                self.sms.append(cb.launch.device(a).sms)
        self.flag_ptrs, self.line_ptrs = [], []
        for a in devices:
            with cp.cuda.Device(a):
                self.flag_ptrs.append(cp.asarray(np.array([f.data.ptr for f in self.flags],
                                                          dtype=np.uint64)))
                self.line_ptrs.append(cp.asarray(np.array([f.data.ptr for f in self.lines],
                                                          dtype=np.uint64)))
                cp.cuda.Device(a).synchronize()        # the zeroed flags exist before any use

    # ------------------------------------------------------------------ helpers
    def zeros(self, n: int, device: int):
        import cupy as cp

        with cp.cuda.Device(device):
            return cp.zeros(n, cp.float32)

    def _check(self, bufs, what: str, dtype=np.float32) -> int:
        if len(bufs) != self.world:
            raise LaunchError(f"{what}: expected {self.world} buffers (one per GPU "
                              f"{self.devices}), got {len(bufs)}")
        n = None
        for r, (b, d) in enumerate(zip(bufs, self.devices)):
            cb.expect(b, f"{what}[{r}]", dtype=dtype, ndim=1)
            info = cb.describe(b, f"{what}[{r}]")
            if info.device_id is not None and info.device_id != d:
                raise LaunchError(f"{what}[{r}] is on GPU {info.device_id}; rank {r} is GPU {d}")
            if n is None:
                n = int(b.shape[0])
            elif int(b.shape[0]) != n:
                raise LaunchError(f"{what}: sizes differ across GPUs ({n} on GPU "
                                  f"{self.devices[0]}, {b.shape[0]} on GPU {d}): an all-reduce "
                                  "needs the same number of elements on every rank")
            if info.ptr % 16:
                raise LaunchError(f"{what}[{r}] is not 16-byte aligned (a view at an odd "
                                  "offset?): the kernels load float4")
        return n

    def barrier(self) -> None:
        """Every GPU's stream waits until every other GPU's stream reached this point."""
        import cupy as cp

        evs = []
        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                evs.append(s.record())
        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                for e in evs:
                    s.wait_event(e)

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()

    def _enter(self) -> None:
        """The group's streams wait for what is queued on each GPU's current stream."""
        import cupy as cp

        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                s.wait_event(cp.cuda.get_current_stream().record())

    def _leave(self) -> None:
        """Each GPU's current stream waits for the group's work."""
        import cupy as cp

        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                cp.cuda.get_current_stream().wait_event(s.record())

    # ------------------------------------------------------------------ collectives
    def _grid(self, r: int, count: int) -> tuple[int]:
        return config("ring_step_add", count, self.sms[r]).grid

    def ring(self, bufs, sync_start: bool = True, ordered: bool = True) -> None:
        """In-place ring all-reduce (sum): world - 1 reduce-scatter steps, a barrier, world - 1
        all-gather steps; step s on GPU r waits only for step s - 1 on its left neighbour.
        ``bufs``: one 1-D buffer per GPU, CuPy float32, or PyTorch float32 or bfloat16 tensors
        (zero copy; bf16 sums are rounded once per step, as NCCL's)."""
        import cupy as cp

        from cudabook.collectives import chunk_bounds

        bufs, suffix = self._ring_buffers(bufs)
        n, w = self._check(bufs, "ring", np.uint16 if suffix else np.float32), self.world
        if ordered:
            self._enter()
        if sync_start:
            self.barrier()          # no GPU may start before the previous call finished everywhere
        for phase, name in enumerate(("ring_step_add" + suffix, "ring_step_copy" + suffix)):
            for s in range(w - 1):
                evs = []
                for r, d in enumerate(self.devices):
                    c = (r - s - 1) % w if phase == 0 else (r - s) % w
                    lo, hi = chunk_bounds(n, w, c)
                    with cp.cuda.Device(d):
                        self.mods[r][name](self._grid(r, hi - lo), (256,),
                                           (bufs[r], bufs[(r - 1) % w], np.int64(lo), np.int64(hi)),
                                           stream=self.streams[r])
                        evs.append(self.streams[r].record())
                for r, d in enumerate(self.devices):          # the next step reads the left's
                    with cp.cuda.Device(d):
                        self.streams[r].wait_event(evs[(r - 1) % w])
            if phase == 0:
                self.barrier()      # no all-gather write before every reduce-scatter read
        if ordered:
            self._leave()

    @staticmethod
    def _ring_buffers(bufs):
        """CuPy float32 arrays as they are; PyTorch tensors (float32 or bfloat16, 1-D, contiguous)
        as zero-copy CuPy views through DLPack, bf16 as its 16-bit patterns. Returns (arrays,
        kernel suffix)."""
        import cupy as cp

        try:
            import torch
        except ImportError:       # no PyTorch: only CuPy arrays can come in
            return list(bufs), ""
        if not any(isinstance(b, torch.Tensor) for b in bufs):
            return list(bufs), ""
        if not all(isinstance(b, torch.Tensor) for b in bufs):
            raise LaunchError("ring: give all buffers as CuPy arrays or all as PyTorch tensors")
        dts = {b.dtype for b in bufs}
        if len(dts) != 1 or dts.pop() not in (torch.float32, torch.bfloat16):
            raise LaunchError(f"ring: PyTorch buffers must all be float32 or all bfloat16, got "
                              f"{sorted({str(b.dtype) for b in bufs})}")
        for r, b in enumerate(bufs):
            if b.dim() != 1 or not b.is_contiguous() or not b.is_cuda:
                raise LaunchError(f"ring: buffer {r} must be a 1-D contiguous CUDA tensor "
                                  f"(got shape {tuple(b.shape)}, device {b.device}); flatten it "
                                  "into one gradient buffer first")
        out = []
        for b in bufs:
            with cp.cuda.Device(b.device.index):   # DLPack orders on that GPU's current stream
                out.append(cp.from_dlpack(b) if b.dtype == torch.float32 else
                           cp.from_dlpack(b.view(torch.int16)).view(cp.uint16))
        return out, ("" if bufs[0].dtype == torch.float32 else "_bf16")

    def one_shot(self, ins, outs, version: str = "v2", ordered: bool = True) -> None:
        """outs[r] = ins[0] + ... + ins[world-1] (rank order, identical bits on every GPU), one
        kernel per GPU, no host synchronisation. v1 pulls (outs must not overlap any input);
        v2 pushes (outs may be ins; at most ONE_SHOT_MAX_BYTES). ``ordered=False`` skips the
        ordering with the current streams (for back-to-back calls after a synchronize)."""
        import cupy as cp

        version = version_name(ONE_SHOT_VERSIONS, version, "one_shot")   # "v2" or "one_shot_v2"
        n = self._check(ins, "one_shot ins")
        if self._check(outs, "one_shot outs") != n:
            raise LaunchError(f"one_shot: outs have {outs[0].shape[0]} elements, ins {n}")
        cfg = config(f"one_shot_{version}", n, min(self.sms))
        if ordered:
            self._enter()
        if version == "v2":
            if 4 * n > ONE_SHOT_MAX_BYTES:
                raise LaunchError(f"one_shot v2: {4 * n} bytes > ONE_SHOT_MAX_BYTES "
                                  f"({ONE_SHOT_MAX_BYTES}); use the ring for large messages")
            self.epoch2 += 1
            ep = np.uint32(self.epoch2)
            for r, d in enumerate(self.devices):
                with cp.cuda.Device(d):
                    self.mods[r]["one_shot_v2"](cfg.grid, cfg.block,
                                                (ins[r], outs[r], self.line_ptrs[r], np.int32(r),
                                                 np.int32(self.world), np.int64(n),
                                                 np.int64(self.cap), ep),
                                                stream=self.streams[r])
            if ordered:
                self._leave()
            return
        key = tuple(cb.describe(b).ptr for b in ins)
        for o in (cb.describe(b).ptr for b in outs):
            for i in key:
                if o < i + 4 * n and i < o + 4 * n:
                    raise LaunchError("one_shot v1: an output overlaps an input; the peers may "
                                      "still be reading it (use separate output buffers)")
        if getattr(self, "_in_key", None) != key:
            self._in_key, self._in_ptrs = key, []
            for d in self.devices:
                with cp.cuda.Device(d):
                    self._in_ptrs.append(cp.asarray(np.array(key, dtype=np.uint64)))
        ep = np.uint32(self.epoch)
        self.epoch += 2
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                self.mods[r]["one_shot_v1"](cfg.grid, cfg.block,
                                            (self._in_ptrs[r], outs[r], self.flag_ptrs[r],
                                             np.int32(r), np.int32(self.world), np.int64(n), ep),
                                            stream=self.streams[r])
        if ordered:
            self._leave()

    def peer_copy(self, dst, src, rank: int = 0) -> None:
        """dst = src by a kernel on dst's GPU (self.devices[rank]) reading src on another GPU."""
        import cupy as cp

        cb.expect(dst, "dst", dtype=np.float32, ndim=1)
        cb.expect(src, "src", dtype=np.float32, shape=dst.shape)
        n = int(dst.shape[0])
        self._enter()
        with cp.cuda.Device(self.devices[rank]):
            self.mods[rank]["ring_step_copy"](self._grid(rank, n), (256,),
                                              (dst, src, np.int64(0), np.int64(n)),
                                              stream=self.streams[rank])
        self._leave()

    # ------------------------------------------------------------------ timing
    def device_time_us(self, fn: Callable[[], None], iters: int = 20, warmup: int = 3,
                       spin_us: float | None = None) -> float:
        """Device time of one ``fn()`` (which launches on the group's streams): ``iters`` calls
        back to back, queued behind a spin kernel on every GPU so the host's launch cost is
        hidden (the spin lasts twice the host time of the warm-up calls); the slowest GPU's time
        between its two events, divided by ``iters``."""
        import cupy as cp

        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        host_us = (time.perf_counter() - t0) / max(warmup, 1) * 1e6
        self.synchronize()
        # the spin outlasts the host's queueing of all iters calls (measured above, x 2)
        spin_us = spin_us if spin_us is not None else 2.0 * host_us * iters + 300
        starts, ends = [], []
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                mhz = cp.cuda.Device(d).attributes["ClockRate"] / 1e3
                self.mods[r]["spin"]((1,), (1,), (np.int64(spin_us * mhz),), stream=self.streams[r])
                e = cp.cuda.Event()
                e.record(self.streams[r])
                starts.append(e)
        for _ in range(iters):
            fn()
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                e = cp.cuda.Event()
                e.record(self.streams[r])
                ends.append(e)
        self.synchronize()
        return max(cp.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)) * 1e3 / iters


def set_peer_access(a: int, b: int, on: bool) -> None:
    """Let GPU ``a`` access GPU ``b``'s memory directly (``on``) or not (copies are then staged
    through host memory by the driver)."""
    import cupy as cp

    rt = cp.cuda.runtime
    if on and (a, b) in _PEER_ON:
        return                # no call that fails with "already enabled" (memcheck reports those)
    with cp.cuda.Device(a):
        try:
            rt.deviceEnablePeerAccess(b) if on else rt.deviceDisablePeerAccess(b)
        except rt.CUDARuntimeError as e:
            msg = str(e).lower().replace("_", "")
            if "alreadyenabled" not in msg and "notenabled" not in msg:
                raise
    (_PEER_ON.add if on else _PEER_ON.discard)((a, b))


#: (a, b) pairs where this process turned GPU a's access to GPU b's memory on
_PEER_ON: set[tuple[int, int]] = set()


def memcpy_peer_us(dst_dev: int, src_dev: int, nbytes: int, iters: int = 20) -> float:
    """Device time (us) of one cudaMemcpyPeerAsync of ``nbytes`` from GPU src_dev to dst_dev,
    checked, timed with events on a stream of dst_dev (median of ``iters`` single copies)."""
    import cupy as cp

    with cp.cuda.Device(src_dev):
        src = cp.arange(max(nbytes // 4, 1), dtype=cp.float32)
        cp.cuda.Device(src_dev).synchronize()       # the copy runs on another device's stream
    with cp.cuda.Device(dst_dev):
        dst = cp.zeros(src.size, cp.float32)
        cp.cuda.Device(dst_dev).synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        rt = cp.cuda.runtime
        copy = lambda: rt.memcpyPeerAsync(dst.data.ptr, dst_dev, src.data.ptr, src_dev,
                                          4 * src.size, s.ptr)
        copy()
        s.synchronize()
        with cp.cuda.Device(src_dev):
            want = np.concatenate([src[:4].get(), src[-4:].get()])
        if not np.array_equal(np.concatenate([dst[:4].get(), dst[-4:].get()]), want):
            raise RuntimeError(f"memcpyPeer {src_dev} -> {dst_dev}: wrong data")
        ts = []
        for _ in range(iters):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            copy()
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(ts))


def sweep(group: PeerGroup, sizes: Sequence[int], one_shot_max: int = 1 << 20) -> list[dict]:
    """Own ring (every size) and one-shot v1/v2 (sizes <= one_shot_max bytes) all-reduce on the
    group: each checked against the exact sum, then timed (device time per call, host hidden)."""
    import cupy as cp

    w = group.world
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        bufs, outs = [], []
        for r, d in enumerate(group.devices):
            with cp.cuda.Device(d):
                # small integers times (r + 1): every partial sum is exact in float32
                bufs.append((cp.arange(n, dtype=cp.float32) % 61) * (r + 1))
                outs.append(cp.full(n, np.nan, cp.float32))
        want = float(w * (w + 1) // 2)

        def check(arrs, what):
            for r, d in enumerate(group.devices):
                with cp.cuda.Device(d):
                    if not bool(cp.all(arrs[r] == (cp.arange(n, dtype=cp.float32) % 61) * want)):
                        raise RuntimeError(f"{what}: wrong sum on GPU {d} at {nbytes} bytes")
                    arrs[r].fill(np.nan)
                    cp.cuda.Device(d).synchronize()   # timed calls skip the stream ordering

        row = {"bytes": nbytes, "world": w}
        if nbytes <= one_shot_max:
            for v in ("v1", "v2"):
                group.one_shot(bufs, outs, version=v)
                check(outs, f"one_shot {v}")
                iters = 200 if nbytes <= 1 << 20 else 50
                row[f"one_shot_{v}_us"] = group.device_time_us(
                    lambda v=v: group.one_shot(bufs, outs, version=v, ordered=False), iters=iters)
        group.ring(bufs)
        check(bufs, "ring")
        for r, d in enumerate(group.devices):
            with cp.cuda.Device(d):
                bufs[r].fill(1.0 / w)             # repeated sums stay finite
                cp.cuda.Device(d).synchronize()   # the timed calls below skip the ordering
        iters = 20 if nbytes <= 1 << 26 else 5
        row["ring_us"] = group.device_time_us(lambda: group.ring(bufs, ordered=False),
                                              iters=iters)
        for k in ("ring", "one_shot_v1", "one_shot_v2"):
            if f"{k}_us" in row:
                row[f"{k}_busbw"] = nbytes / (row[f"{k}_us"] * 1e-6) / 1e9 * 2 * (w - 1) / w
        rows.append(row)
    return rows


def sanitize_targets():
    """The ring's four step kernels (float32 and bf16) over every GPU of the host, at lengths
    with ragged heads and tails and chunks shorter than the world; none with fewer than 2 GPUs.
    The one-shots are left out: their blocks wait for flags written by the kernel on the other
    GPUs, and compute-sanitizer runs one kernel at a time, so they would wait forever."""
    import cupy as cp

    if not cb.HAS_GPU or cp.cuda.runtime.getDeviceCount() < 2:
        return []
    import torch

    def ring(n: int, bf16: bool):
        def go() -> None:
            g = PeerGroup()
            if bf16:
                bufs = [torch.ones(n, dtype=torch.bfloat16, device=f"cuda:{d}") for d in g.devices]
            else:
                bufs = []
                for d in g.devices:
                    with cp.cuda.Device(d):
                        bufs.append(cp.ones(n, cp.float32))
            g.ring(bufs)
            g.synchronize()
        return go

    return [(f"ring {'bf16' if bf16 else 'float32'} n={n}", ring(n, bf16))
            for n in (3, 1001, 40961) for bf16 in (False, True)]
