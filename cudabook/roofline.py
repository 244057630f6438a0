"""Roofline arithmetic: the work and the compulsory memory traffic of an operation, and its
arithmetic intensity (flops per byte), from which the roofline bounds its speed; and the
roofline of the reader's GPU (``device_roof``), defined once for chapters 2-4."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["gemm_flops", "gemm_min_bytes", "intensity", "FP32_LANES", "fp32_lanes", "Roof",
           "copy_gbs", "l2_read_gbs", "device_roof", "draw"]


def gemm_flops(M: int, N: int, K: int) -> float:
    """Flops of C[M, N] = A[M, K] @ B[K, N]: one multiply and one add per term."""
    return 2.0 * M * N * K


def gemm_min_bytes(M: int, N: int, K: int, itemsize: int = 4) -> float:
    """Compulsory traffic of a GEMM: read A and B once, write C once."""
    return float(itemsize) * (M * K + K * N + M * N)


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity in flop/byte."""
    if nbytes <= 0:
        raise ValueError(f"intensity: bytes must be > 0, got {nbytes!r}")
    return flops / nbytes


# ---------------------------------------------------------------------------------------------
# The roofline of the reader's GPU: one definition for chapters 2-4.
#
# The compute roof is computed from the device's own numbers (SM count and clock, both asked from
# the driver) and the FP32 lanes per SM of its architecture; the memory roofs are measured: a
# device-to-device copy far larger than L2 for DRAM, and repeated reads of a buffer that fits in
# L2 (kernels/memprobe.cu) for the L2 roof. Nothing here is a hard-coded property of one GPU.
# ---------------------------------------------------------------------------------------------

#: FP32 FMA lanes per SM, by compute capability. sm_70/75/80 (V100, T4, A100) have 64; sm_86,
#: sm_89 and sm_90 (RTX 30xx/40xx, L4, H100) have 128 (CUDA C++ Programming Guide, "Arithmetic
#: Instructions" throughput table: 32-bit floating-point add, multiply, multiply-add per SM).
FP32_LANES = {(6, 0): 64, (7, 0): 64, (7, 5): 64, (8, 0): 64}
_DEFAULT_LANES = 128


def fp32_lanes(cc: tuple[int, int]) -> int:
    """FP32 FMA units per SM of compute capability ``cc``."""
    return FP32_LANES.get(tuple(cc), _DEFAULT_LANES)


@dataclass
class Roof:
    """The roofline of one device: compute peak (TFLOP/s) and memory roofs (GB/s)."""
    device: str
    sms: int
    lanes: int
    clock_ghz: float
    dram_gbs: float                  # measured: copy of 2 x 256 MiB, L2 flushed
    l2_gbs: float | None = None      # measured: repeated reads of a buffer that fits in L2

    @property
    def peak_tflops(self) -> float:
        """FP32 peak: SMs x lanes x 2 flops per FMA x clock."""
        return self.sms * self.lanes * 2 * self.clock_ghz / 1e3

    @property
    def ridge(self) -> float:
        """flop/byte above which a kernel that reads from DRAM is compute-bound."""
        return self.peak_tflops * 1e3 / self.dram_gbs

    @property
    def ridge_l2(self) -> float | None:
        """The same, for data served from L2."""
        return self.peak_tflops * 1e3 / self.l2_gbs if self.l2_gbs else None

    def bound_tflops(self, intensity_: float, l2: bool = False) -> float:
        """The roofline's limit at an intensity: min(peak, intensity x bandwidth)."""
        bw = self.l2_gbs if (l2 and self.l2_gbs) else self.dram_gbs
        return min(self.peak_tflops, intensity_ * bw / 1e3)

    def __str__(self) -> str:
        s = (f"{self.device}: {self.sms} SMs x {self.lanes} FP32 lanes x 2 flop x "
             f"{self.clock_ghz:.2f} GHz = {self.peak_tflops:.1f} TFLOP/s FP32 peak\n"
             f"DRAM (copy, measured) {self.dram_gbs:.0f} GB/s -> ridge point "
             f"{self.ridge:.1f} flop/byte")
        if self.l2_gbs:
            s += (f"\nL2 (repeated reads of a quarter of L2, measured) {self.l2_gbs:.0f} GB/s "
                  f"-> ridge {self.ridge_l2:.1f} flop/byte")
        return s


_ROOF: Roof | None = None


def _clock_ghz() -> float:
    import cupy

    dev = cupy.cuda.Device()
    khz = cupy.cuda.runtime.deviceGetAttribute(13, dev.id)   # cudaDevAttrClockRate, kHz
    return khz / 1e6


def copy_gbs(nbytes: int, flush_l2: bool = True, repeat: int = 20) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write counted)."""
    import cupy

    from .bench import bench

    a = cupy.ones(nbytes // 4, cupy.float32)
    b = cupy.empty_like(a)
    t = bench({"copy": lambda: cupy.copyto(b, a)}, bytes=2 * a.nbytes, flush_l2=flush_l2,
              repeat=repeat, quiet=True)
    return t["copy"].value


def l2_read_gbs(nbytes: int, reps: int = 40) -> float:
    """GB/s of reading ``nbytes`` over and over with ``read_repeat`` (kernels/memprobe.cu):
    with ``nbytes`` well under the L2 size, every read after the first is an L2 hit."""
    import cupy

    from . import env
    from .bench import bench
    from .compile import cuda_module

    k = cuda_module("memprobe").get("read_repeat")
    x = cupy.ones(nbytes // 16 * 4, cupy.float32)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    grid = env.info().sms * max(props["maxThreadsPerMultiProcessor"] // 256, 1)
    out = cupy.empty(grid * 256, cupy.float32)
    n4 = x.size // 4
    t = bench({"l2 read": lambda: k((grid,), (256,), (x, cupy.int32(n4), cupy.int32(reps), out))},
              bytes=16.0 * n4 * reps, flush_l2=False, repeat=10, quiet=True)
    return t["l2 read"].value


def device_roof(l2: bool = True) -> Roof:
    """Measure (once per process) and return the roofline of the current GPU."""
    global _ROOF
    from . import env

    if not env.HAS_GPU:
        raise RuntimeError("device_roof: the roofline is measured on a GPU; this is simulator "
                           "mode")
    if _ROOF is None or (l2 and _ROOF.l2_gbs is None):
        d = env.info()
        dram = copy_gbs(256 << 20)
        l2_gbs = None
        if l2:
            # a quarter of L2: resident after the first pass, whatever the L2's partitioning
            l2_gbs = l2_read_gbs(max(int(d.l2_mb * 2**20) // 4, 1 << 16))
        _ROOF = Roof(d.name, d.sms, fp32_lanes(d.cc), _clock_ghz(), dram, l2_gbs)
    return _ROOF


def draw(roof: Roof, ax=None, imin: float = 0.01, imax: float = 1000.0, l2: bool = False):
    """Draw the roofs (TFLOP/s against flop/byte, log-log) on ``ax``; returns ``ax``."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = np.logspace(np.log10(imin), np.log10(imax), 200)
    ax.loglog(xs, np.minimum(roof.peak_tflops, xs * roof.dram_gbs / 1e3), "k-", lw=2,
              label=f"DRAM roof {roof.dram_gbs:.0f} GB/s, FP32 peak {roof.peak_tflops:.1f}")
    if l2 and roof.l2_gbs:
        ax.loglog(xs, np.minimum(roof.peak_tflops, xs * roof.l2_gbs / 1e3), "k--", lw=1.2,
                  label=f"L2 roof {roof.l2_gbs:.0f} GB/s")
    ax.axvline(roof.ridge, color="gray", ls=":", lw=1)
    ax.set_xlabel("arithmetic intensity (flop / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    return ax
