"""Launching kernels/allreduce.cu: all-reduce over the GPUs of one host from one process.

    ar = cb.load_launch("allreduce")
    g = ar.PeerGroup()                       # every visible GPU (at least 2), peer access on
    bufs = [g.zeros(n, d) for d in g.devices]
    g.ring(bufs)                             # in place: every bufs[r] = sum over r (ring)
    g.one_shot(ins, outs)                    # outs[r] = sum of ins (one kernel per GPU)
    g.peer_copy(dst, src)                    # a kernel on dst's GPU reads src on another GPU
    us = g.device_time_us(lambda: g.ring(bufs), iters=20)

Every call checks its buffers (float32, 1-D, contiguous, one per GPU in device order, equal
sizes) and refuses with a message; a machine with fewer than 2 GPUs, or a pair of GPUs without
peer access, is refused when the group is made. NVLink multicast is never used.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["PeerGroup", "MAX_ONE_SHOT_BLOCKS", "set_peer_access", "memcpy_peer_us", "sweep"]

#: the one-shot grid's upper bound: its blocks wait for each other's peers, so all must be resident
MAX_ONE_SHOT_BLOCKS = 64


class PeerGroup:
    """The GPUs ``devices`` (default: all), with peer access enabled between every pair, one
    stream, one compiled module and one flag array per GPU."""

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
        self.mods, self.streams, self.flags, self.sms = [], [], [], []
        self.epoch = 1
        for a in devices:
            with cp.cuda.Device(a):
                for b in devices:
                    if a != b:
                        try:
                            rt.deviceEnablePeerAccess(b)
                        except rt.CUDARuntimeError as e:
                            if "alreadyenabled" not in str(e).lower().replace("_", ""):
                                raise
                mod = cb.load_cuda("allreduce")            # one module per GPU, loaded there
                k = {n: mod.get(n) for n in ("ring_step_add", "ring_step_copy", "one_shot")}
                k["spin"] = cb.load_cuda("profiling").get("spin")
                self.mods.append(k)
                self.streams.append(cp.cuda.Stream(non_blocking=True))
                self.flags.append(cp.zeros(self.world * MAX_ONE_SHOT_BLOCKS, cp.uint32))
                self.sms.append(cp.cuda.Device(a).attributes["MultiProcessorCount"])
        self.flag_ptrs = []
        for a in devices:
            with cp.cuda.Device(a):
                self.flag_ptrs.append(cp.asarray(np.array([f.data.ptr for f in self.flags],
                                                          dtype=np.uint64)))

    # ------------------------------------------------------------------ helpers
    def zeros(self, n: int, device: int):
        import cupy as cp

        with cp.cuda.Device(device):
            return cp.zeros(n, cp.float32)

    def _check(self, bufs, what: str) -> int:
        if len(bufs) != self.world:
            raise LaunchError(f"{what}: expected {self.world} buffers (one per GPU "
                              f"{self.devices}), got {len(bufs)}")
        n = None
        for r, (b, d) in enumerate(zip(bufs, self.devices)):
            cb.expect(b, f"{what}[{r}]", dtype=np.float32, ndim=1)
            if b.device.id != d:
                raise LaunchError(f"{what}[{r}] is on GPU {b.device.id}; rank {r} is GPU {d}")
            if n is None:
                n = int(b.shape[0])
            elif int(b.shape[0]) != n:
                raise LaunchError(f"{what}: sizes differ across GPUs ({n} on GPU "
                                  f"{self.devices[0]}, {b.shape[0]} on GPU {d}): an all-reduce "
                                  "needs the same number of elements on every rank")
            if b.data.ptr % 16:
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

    # ------------------------------------------------------------------ collectives
    def _grid(self, r: int, count: int) -> tuple[int]:
        return (max(1, min(ceil_div(count, 4 * 256 * 4), 4 * self.sms[r])),)

    def ring(self, bufs, sync_start: bool = True) -> None:
        """In-place ring all-reduce (sum): world - 1 reduce-scatter steps, a barrier, world - 1
        all-gather steps; step s on GPU r waits only for step s - 1 on its left neighbour."""
        import cupy as cp

        from cudabook.collectives import chunk_bounds

        n, w = self._check(bufs, "ring"), self.world
        if sync_start:
            self.barrier()          # no GPU may start before the previous call finished everywhere
        for phase, name in enumerate(("ring_step_add", "ring_step_copy")):
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

    def one_shot(self, ins, outs) -> None:
        """outs[r] = ins[0] + ... + ins[world-1] (rank order, identical bits), one kernel per GPU
        synchronised by flags; outs must not be (or overlap) any input."""
        import cupy as cp

        n = self._check(ins, "one_shot ins")
        if self._check(outs, "one_shot outs") != n:
            raise LaunchError(f"one_shot: outs have {outs[0].shape[0]} elements, ins {n}")
        for o in outs:
            for i in ins:
                if o.data.ptr < i.data.ptr + 4 * n and i.data.ptr < o.data.ptr + 4 * n:
                    raise LaunchError("one_shot: an output overlaps an input; the peers may "
                                      "still be reading it (use separate output buffers)")
        blocks = max(1, min(ceil_div(n, 256 * 4), MAX_ONE_SHOT_BLOCKS, *self.sms))
        if not hasattr(self, "_in_ptrs") or self._in_key != tuple(b.data.ptr for b in ins):
            self._in_key = tuple(b.data.ptr for b in ins)
            self._in_ptrs = []
            for d in self.devices:
                with cp.cuda.Device(d):
                    self._in_ptrs.append(cp.asarray(np.array(self._in_key, dtype=np.uint64)))
        ep = np.uint32(self.epoch)
        self.epoch += 2
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                self.mods[r]["one_shot"]((blocks,), (256,),
                                         (self._in_ptrs[r], outs[r], self.flag_ptrs[r],
                                          np.int32(r), np.int32(self.world), np.int64(n), ep),
                                         stream=self.streams[r])

    def peer_copy(self, dst, src, rank: int = 0) -> None:
        """dst = src by a kernel on dst's GPU (self.devices[rank]) reading src on another GPU."""
        import cupy as cp

        cb.expect(dst, "dst", dtype=np.float32, ndim=1)
        cb.expect(src, "src", dtype=np.float32, shape=dst.shape)
        n = int(dst.shape[0])
        with cp.cuda.Device(self.devices[rank]):
            self.mods[rank]["ring_step_copy"](self._grid(rank, n), (256,),
                                              (dst, src, np.int64(0), np.int64(n)),
                                              stream=self.streams[rank])

    # ------------------------------------------------------------------ timing
    def device_time_us(self, fn: Callable[[], None], iters: int = 20, warmup: int = 3,
                       spin_us: float | None = None) -> float:
        """Device time of one ``fn()`` (which launches on the group's streams): ``iters`` calls
        back to back, queued behind a spin kernel on every GPU so the host's launch cost is
        hidden; the slowest GPU's time between its two events, divided by ``iters``."""
        import cupy as cp

        for _ in range(warmup):
            fn()
        self.synchronize()
        spin_us = spin_us if spin_us is not None else 40.0 * iters * self.world + 200
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
    with cp.cuda.Device(a):
        try:
            rt.deviceEnablePeerAccess(b) if on else rt.deviceDisablePeerAccess(b)
        except rt.CUDARuntimeError as e:
            msg = str(e).lower().replace("_", "")
            if "alreadyenabled" not in msg and "notenabled" not in msg:
                raise


def memcpy_peer_us(dst_dev: int, src_dev: int, nbytes: int, iters: int = 20) -> float:
    """Device time (us) of one cudaMemcpyPeerAsync of ``nbytes`` from GPU src_dev to dst_dev,
    checked, timed with events on a stream of dst_dev (median of ``iters`` single copies)."""
    import cupy as cp

    with cp.cuda.Device(src_dev):
        src = cp.arange(max(nbytes // 4, 1), dtype=cp.float32)
    with cp.cuda.Device(dst_dev):
        dst = cp.zeros(src.size, cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        rt = cp.cuda.runtime
        copy = lambda: rt.memcpyPeerAsync(dst.data.ptr, dst_dev, src.data.ptr, src_dev,
                                          4 * src.size, s.ptr)
        copy()
        s.synchronize()
        if float(dst[-1]) != src.size - 1:
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


def sweep(group: PeerGroup, sizes: Sequence[int], one_shot_max: int = 4 << 20) -> list[dict]:
    """Own ring (every size) and one-shot (sizes <= one_shot_max bytes) all-reduce on the group:
    each checked against the exact sum, then timed (device time per call, host hidden)."""
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
        cp.cuda.Device(group.devices[0]).synchronize()
        row = {"bytes": nbytes, "world": w}
        if nbytes <= one_shot_max:
            group.one_shot(bufs, outs)
            group.synchronize()
            for r, d in enumerate(group.devices):
                with cp.cuda.Device(d):
                    ok = bool(cp.all(outs[r] == (cp.arange(n, dtype=cp.float32) % 61) * want))
                if not ok:
                    raise RuntimeError(f"one_shot: wrong sum on GPU {d} at {nbytes} bytes")
            iters = 200 if nbytes <= 1 << 20 else 50
            row["one_shot_us"] = group.device_time_us(lambda: group.one_shot(bufs, outs),
                                                      iters=iters)
        group.ring(bufs)
        group.synchronize()
        for r, d in enumerate(group.devices):
            with cp.cuda.Device(d):
                ok = bool(cp.all(bufs[r] == (cp.arange(n, dtype=cp.float32) % 61) * want))
            if not ok:
                raise RuntimeError(f"ring: wrong sum on GPU {d} at {nbytes} bytes")
        for r, d in enumerate(group.devices):
            with cp.cuda.Device(d):
                bufs[r].fill(1.0 / w)             # repeated sums stay finite
        iters = 50 if nbytes <= 1 << 20 else 20 if nbytes <= 1 << 26 else 5
        row["ring_us"] = group.device_time_us(lambda: group.ring(bufs), iters=iters)
        for k in ("ring", "one_shot"):
            if f"{k}_us" in row:
                row[f"{k}_busbw"] = nbytes / (row[f"{k}_us"] * 1e-6) / 1e9 * 2 * (w - 1) / w
        rows.append(row)
    return rows
