"""Occupancy: how many blocks of a kernel fit on one SM at once, computed from the SM's limits.

The driver answers the same question with ``cudaOccupancyMaxActiveBlocksPerMultiprocessor``
(CuPy: ``cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor``). This module does the
arithmetic in the open, so a reader can see which limit binds, and it works without a GPU for
the architectures in ``ARCHS`` (sm_75 to sm_90). Chapter 5 checks it against the driver on every
configuration of a sweep.

A block of T threads is ceil(T / 32) warps. Four limits apply, and the smallest wins:

* **warps**: max_threads_per_sm / 32 warp slots, so floor(slots / warps_per_block) blocks;
* **blocks**: a fixed number of block slots per SM (16, 24 or 32);
* **registers**: registers are given to a warp in units of 256 (regs x 32 rounded up), and
  each of the SM's 4 sub-partitions (one warp scheduler each) has a quarter of the register
  file, so warps_per_sm = 4 * floor((regs_per_sm / 4) / regs_per_warp);
* **shared memory**: a block takes static + dynamic bytes plus the 1 KiB the driver reserves per
  block (sm_80 and later), rounded up to the allocation unit (256 B on sm_7x, 128 B after).
  The SM's shared memory is a carve-out of its L1: the largest configuration by default.

A configuration that cannot launch at all (too many threads, registers or bytes per block)
gets 0 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import env

__all__ = ["Limits", "Occupancy", "ARCHS", "limits", "device_limits", "occupancy",
           "blocks_per_sm", "kernel_occupancy", "driver_blocks_per_sm", "compare_with_driver"]

KiB = 1024


@dataclass(frozen=True)
class Limits:
    """What one SM of an architecture offers (the numbers the occupancy arithmetic needs)."""
    arch: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int                    # bytes, the largest shared-memory carve-out
    smem_per_block_optin: int           # bytes a block may use after opting in
    smem_reserved_per_block: int        # bytes the driver keeps per block (sm_80+: 1 KiB)
    smem_alloc_unit: int                # shared memory is allocated in units of this many bytes
    smem_configs_kib: tuple[int, ...]   # the carve-outs the SM can be configured with
    warp_size: int = 32
    max_threads_per_block: int = 1024
    smem_per_block: int = 48 * KiB      # without opting in (cudaFuncAttributeMaxDynamicShared...)
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256           # registers are given to a warp in units of 256
    sub_partitions: int = 4             # warp schedulers per SM, each with 1/4 of the registers

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size


# Values from the CUDA C++ Programming Guide (compute capabilities table) and the CUDA
# Occupancy Calculator; the ones a GPU reports (sm_90 on an H100) were checked against it.
_SMEM_CONFIGS_80 = (0, 8, 16, 32, 64, 100, 132, 164)
ARCHS: dict[str, Limits] = {
    "sm_75": Limits("sm_75", 1024, 16, 64 * KiB, 64 * KiB, 0, 256, (32, 64)),
    "sm_80": Limits("sm_80", 2048, 32, 164 * KiB, 163 * KiB, KiB, 128, _SMEM_CONFIGS_80),
    "sm_86": Limits("sm_86", 1536, 16, 100 * KiB, 99 * KiB, KiB, 128, _SMEM_CONFIGS_80[:6]),
    "sm_89": Limits("sm_89", 1536, 24, 100 * KiB, 99 * KiB, KiB, 128, _SMEM_CONFIGS_80[:6]),
    "sm_90": Limits("sm_90", 2048, 32, 228 * KiB, 227 * KiB, KiB, 128,
                    _SMEM_CONFIGS_80 + (196, 228)),
}


def limits(arch: str) -> Limits:
    """The limits of an architecture by name: ``"sm_75"``, ``"sm_80"``, ``"sm_86"``, ``"sm_89"``,
    ``"sm_90"``."""
    if arch not in ARCHS:
        raise ValueError(f"no occupancy limits for {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch]


def device_limits() -> Limits:
    """The limits of the current GPU: its reported properties, with the allocation units of its
    architecture (the nearest one in ``ARCHS`` at or below it)."""
    if not env.HAS_GPU:
        raise RuntimeError("device_limits() needs a CUDA GPU; use occupancy.limits('sm_90') "
                           "(or another architecture) in simulator mode")
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    major, minor = int(p["major"]), int(p["minor"])
    arch = f"sm_{major}{minor}"
    known = sorted(ARCHS, key=lambda a: int(a[3:]))
    base = ARCHS.get(arch) or ARCHS[max((a for a in known if int(a[3:]) <= 10 * major + minor),
                                        key=lambda a: int(a[3:]), default=known[0])]

    def prop(key: str, default: int) -> int:
        v = p.get(key)
        return int(v) if v is not None else default

    return replace(
        base, arch=arch,
        max_threads_per_sm=prop("maxThreadsPerMultiProcessor", base.max_threads_per_sm),
        max_blocks_per_sm=prop("maxBlocksPerMultiProcessor", base.max_blocks_per_sm),
        smem_per_sm=prop("sharedMemPerMultiprocessor", base.smem_per_sm),
        smem_per_block=prop("sharedMemPerBlock", base.smem_per_block),
        smem_per_block_optin=prop("sharedMemPerBlockOptin", base.smem_per_block_optin),
        smem_reserved_per_block=prop("reservedSharedMemPerBlock", base.smem_reserved_per_block),
        regs_per_sm=prop("regsPerMultiprocessor", base.regs_per_sm),
        regs_per_block=prop("regsPerBlock", base.regs_per_block),
        max_threads_per_block=prop("maxThreadsPerBlock", base.max_threads_per_block),
        warp_size=prop("warpSize", base.warp_size))


@dataclass
class Occupancy:
    """The answer, with the arithmetic behind it."""
    blocks: int                         # resident blocks per SM
    warps: int                          # resident warps per SM
    fraction: float                     # warps / max warps per SM (the "theoretical occupancy")
    limited_by: str                     # the binding limit ("registers", "shared memory", ...)
    per_limit: dict[str, int] = field(default_factory=dict)   # blocks each limit allows
    regs_per_warp: int = 0              # registers allocated per warp (rounded to the unit)
    smem_per_block: int = 0             # bytes allocated per block (reserved + rounding)

    def __str__(self) -> str:
        lim = ", ".join(f"{k} {v}" for k, v in self.per_limit.items())
        return (f"{self.blocks} blocks/SM = {self.warps} warps = {100 * self.fraction:.0f}% "
                f"occupancy, limited by {self.limited_by} ({lim})")


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _carveout(need: int, lim: Limits, carveout: int | None) -> int:
    """Shared memory the SM is configured with: the preference (or the largest configuration),
    grown to the smallest configuration that holds one block if the preference is too small."""
    configs = [c * KiB for c in lim.smem_configs_kib]
    want = lim.smem_per_sm if carveout is None or carveout < 0 else \
        lim.smem_per_sm * carveout // 100
    pref = next((c for c in configs if c >= want), configs[-1])
    if pref >= need:
        return pref
    return next((c for c in configs if c >= need), 0)


def occupancy(threads: int, regs: int, smem_static: int = 0, smem_dynamic: int = 0,
              dev: Limits | str | None = None, *, max_dynamic: int | None = None,
              max_threads: int | None = None, carveout: int | None = None) -> Occupancy:
    """Blocks of a kernel resident per SM, and which limit binds.

    ``threads`` per block, ``regs`` per thread (what the compiler used: ``kernel.attributes
    ["num_regs"]``), ``smem_static``/``smem_dynamic`` bytes of shared memory per block, ``dev``
    the SM's limits (default: the current GPU). ``max_dynamic`` is the kernel's
    ``max_dynamic_shared_size_bytes`` attribute (a launch may not ask for more; default: as
    much as fits, i.e. the kernel opted in); ``max_threads`` its ``__launch_bounds__`` (default
    the device's 1024); ``carveout`` its preferred shared-memory carve-out in percent.
    """
    lim = device_limits() if dev is None else (limits(dev) if isinstance(dev, str) else dev)
    for name, v in (("threads", threads), ("regs", regs), ("smem_static", smem_static),
                    ("smem_dynamic", smem_dynamic)):
        if not isinstance(v, (int,)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"occupancy: {name} must be a non-negative int, got {v!r}")
    if threads < 1:
        raise ValueError("occupancy: a block needs at least one thread")
    warps_per_block = -(-threads // lim.warp_size)
    max_threads = lim.max_threads_per_block if max_threads is None else max_threads
    inf = 1 << 30
    per: dict[str, int] = {}
    # warps
    per["warps"] = 0 if threads > min(max_threads, lim.max_threads_per_block) else \
        lim.max_warps_per_sm // warps_per_block
    # blocks
    per["blocks"] = lim.max_blocks_per_sm
    # registers
    regs_per_warp = _round_up(regs * lim.warp_size, lim.reg_alloc_unit)
    if regs > lim.max_regs_per_thread or \
            regs_per_warp * _round_up(warps_per_block, lim.sub_partitions) > lim.regs_per_block:
        per["registers"] = 0
    elif regs_per_warp == 0:
        per["registers"] = inf
    else:
        warps_per_part = (lim.regs_per_sm // lim.sub_partitions) // regs_per_warp
        per["registers"] = warps_per_part * lim.sub_partitions // warps_per_block
    # shared memory
    smem = _round_up(smem_static + smem_dynamic + lim.smem_reserved_per_block,
                     lim.smem_alloc_unit)
    too_big = smem_static + smem_dynamic > lim.smem_per_block_optin or \
        (max_dynamic is not None and smem_dynamic > max_dynamic)
    if too_big:
        per["shared memory"] = 0
    elif smem == 0:
        per["shared memory"] = inf
    else:
        per["shared memory"] = _carveout(smem, lim, carveout) // smem
    blocks = min(per.values())
    order = ("warps", "registers", "shared memory", "blocks")
    limited_by = next(k for k in order if per[k] == blocks)
    warps = blocks * warps_per_block
    shown = {k: (v if v < inf else "-") for k, v in per.items()}
    return Occupancy(blocks, warps, warps / lim.max_warps_per_sm, limited_by, shown,
                     regs_per_warp, smem)


def blocks_per_sm(threads: int, regs: int, smem: int = 0, dev: Limits | str | None = None
                  ) -> int:
    """Resident blocks per SM (``occupancy(...).blocks``), ``smem`` bytes per block in all."""
    return occupancy(threads, regs, 0, smem, dev).blocks


def kernel_occupancy(kernel, threads: int, smem_dynamic: int = 0,
                     dev: Limits | None = None) -> Occupancy:
    """Occupancy of a CuPy ``RawKernel`` (its registers, static shared memory, launch bounds and
    dynamic-shared-memory limit read from the compiled kernel) at ``threads`` per block."""
    a = kernel.attributes
    carve = a.get("preferred_shared_memory_carveout", -1)
    return occupancy(threads, int(a["num_regs"]), int(a["shared_size_bytes"]), smem_dynamic,
                     dev, max_dynamic=int(a["max_dynamic_shared_size_bytes"]),
                     max_threads=int(a["max_threads_per_block"]),
                     carveout=None if carve is None or carve < 0 else int(carve))


def driver_blocks_per_sm(kernel, threads: int, smem_dynamic: int = 0) -> int:
    """The driver's answer for a CuPy ``RawKernel``
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor``)."""
    import cupy

    return int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, threads, smem_dynamic))


def compare_with_driver(kernel, threads: list[int], smem_dynamic: list[int],
                        dev: Limits | None = None) -> list[tuple[int, int, int, int]]:
    """(threads, dynamic shared memory, calculator, driver) for every pair of the two lists.

    The driver's answer is -1 where it refuses the query (an error: the block cannot launch);
    the calculator's answer there should be 0.
    """
    import cupy

    dev = dev or device_limits()
    out = []
    for th in threads:
        for sm in smem_dynamic:
            ours = kernel_occupancy(kernel, th, sm, dev).blocks
            try:
                theirs = driver_blocks_per_sm(kernel, th, sm)
            except cupy.cuda.driver.CUDADriverError:
                theirs = -1
            out.append((th, sm, ours, theirs))
    return out
