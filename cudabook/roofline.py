"""Roofline arithmetic: the work and the compulsory memory traffic of an operation, and its
arithmetic intensity (flops per byte), from which the roofline bounds its speed; and the
roofline of the reader's GPU (``device_roof``), defined once for chapters 2-4."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["gemm_flops", "gemm_min_bytes", "intensity", "FP32_LANES", "fp32_lanes", "Roof",
           "copy_gbs", "l2_read_gbs", "device_roof", "draw", "PRECISIONS", "TC_FLOP_PER_CLK",
           "TC_DATASHEET", "ridge", "published_roofs", "measured_roof"]


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

    def __post_init__(self):
        if not self.dram_gbs > 0:
            raise ValueError(f"Roof: dram_gbs must be > 0 GB/s, got {self.dram_gbs!r}")
        if self.l2_gbs is not None and not self.l2_gbs > 0:
            raise ValueError(f"Roof: l2_gbs must be > 0 GB/s or None, got {self.l2_gbs!r}")

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


# ---------------------------------------------------------------------------------------------
# Tensor-core roofs: published dense peaks, and measured ones passed in by a lesson.
#
# TC_FLOP_PER_CLK holds dense (no 2:4 sparsity) tensor-core throughput per SM per clock. Each
# entry is NVIDIA's published per-GPU dense peak divided by that GPU's SM count and boost clock;
# TC_DATASHEET keeps those published figures, and tests/test_roofline.py checks that the two
# agree. The fp16/bf16 rows are with FP32 accumulate; int8 counts integer ops (TOPS), drawn on
# the same axis. Sources:
#   sm_75, Tesla T4 (40 SMs, 1590 MHz boost): 65 TFLOPS fp16 mixed precision, 130 TOPS int8.
#     NVIDIA Turing GPU Architecture whitepaper (2018), Tesla T4 table; NVIDIA T4 datasheet.
#   sm_80, A100 SXM4 (108 SMs, 1410 MHz boost): 312 TFLOPS fp16 and bf16, 156 TF32, 624 TOPS
#     int8. NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 1; A100 datasheet.
#   sm_90, H100 SXM5 (132 SMs): 989.4 TFLOPS fp16 and bf16, 494.7 TF32, 1978.9 fp8 and
#     1978.9 TOPS int8 (the datasheet prints twice these, "with sparsity"). NVIDIA H100 Tensor
#     Core GPU Architecture whitepaper (2022) and H100 datasheet; 989.4 = 132 SMs x 4096 flop/clk
#     x 1.83 GHz. H200 SXM is the same GH100 SM (H200 datasheet: 1,979 TFLOPS bf16 with sparsity).
# Left out: sm_70 (V100), and sm_86/sm_89 (RTX 30xx/40xx, A40, L4). One compute capability
# covers GeForce boards, whose FP32-accumulate tensor rate is half that of the professional
# and data-centre boards of the same chip, so a per-SM rate keyed by compute capability would
# be wrong for one of them; pass cuBLAS's measured peak (``measured_roof``) on those GPUs.
# ---------------------------------------------------------------------------------------------

#: Precisions a compute roof can be asked for.
PRECISIONS = ("fp16", "bf16", "tf32", "fp8", "int8")

#: Published dense tensor-core flop (int8: ops) per SM per clock, by compute capability.
TC_FLOP_PER_CLK: dict[tuple[int, int], dict[str, int]] = {
    (7, 5): {"fp16": 1024, "int8": 2048},
    (8, 0): {"fp16": 2048, "bf16": 2048, "tf32": 1024, "int8": 4096},
    (9, 0): {"fp16": 4096, "bf16": 4096, "tf32": 2048, "fp8": 8192, "int8": 8192},
}

#: The published figures the table is derived from: (GPU, SMs, boost GHz, dense TFLOP/s).
TC_DATASHEET: dict[tuple[int, int], tuple[str, int, float, dict[str, float]]] = {
    (7, 5): ("Tesla T4", 40, 1.59, {"fp16": 65.0, "int8": 130.0}),
    (8, 0): ("A100 SXM4", 108, 1.41, {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0,
                                      "int8": 624.0}),
    (9, 0): ("H100 SXM5", 132, 1.83, {"fp16": 989.4, "bf16": 989.4, "tf32": 494.7,
                                      "fp8": 1978.9, "int8": 1978.9}),
}


def ridge(tflops: float, gbs: float) -> float:
    """Ridge point (flop/byte) of a compute roof of ``tflops`` over a memory roof of ``gbs``."""
    if not tflops > 0:
        raise ValueError(f"ridge: the compute roof must be > 0 TFLOP/s, got {tflops!r}")
    if not gbs > 0:
        raise ValueError(f"ridge: the bandwidth must be > 0 GB/s, got {gbs!r}")
    return tflops * 1e3 / gbs


def published_roofs(precisions=None, cc: tuple[int, int] | None = None, sms: int | None = None,
                    clock_ghz: float | None = None) -> list[tuple[str, float]]:
    """Published dense tensor-core peaks as ``[(name, TFLOP/s), ...]``, every name ending in
    "(published peak)": SMs x TC_FLOP_PER_CLK x clock. ``cc``, ``sms`` and ``clock_ghz`` default
    to the current GPU's (the clock is the driver's maximum, which can exceed the boost clock
    NVIDIA's datasheet uses: H100 SXM reports 1.98 GHz, its datasheet peak uses 1.83). With
    ``precisions=None`` every precision published for ``cc`` is returned, and an empty list
    for a compute capability not in the table; a precision asked for by name must exist."""
    if isinstance(precisions, str):
        precisions = [precisions]
    for p in precisions or ():
        if p not in PRECISIONS:
            raise ValueError(f"published_roofs: unknown precision {p!r}; one of "
                             f"{', '.join(PRECISIONS)}")
    if cc is None or sms is None or clock_ghz is None:
        from . import env

        if not env.HAS_GPU:
            raise RuntimeError("published_roofs: no GPU; pass cc, sms and clock_ghz")
        d = env.info()
        cc = d.cc if cc is None else cc
        sms = d.sms if sms is None else sms
        clock_ghz = _clock_ghz() if clock_ghz is None else clock_ghz
    if not sms > 0 or not clock_ghz > 0:
        raise ValueError(f"published_roofs: sms and clock_ghz must be > 0, got {sms!r}, "
                         f"{clock_ghz!r}")
    table = TC_FLOP_PER_CLK.get(tuple(cc), {})
    if precisions is None:
        precisions = [p for p in PRECISIONS if p in table]
    out = []
    for p in precisions:
        if p not in table:
            have = ", ".join(table) or "none"
            raise ValueError(f"published_roofs: no published {p} tensor-core peak for "
                             f"sm_{cc[0]}{cc[1]} (published here: {have})")
        out.append((f"{p} tensor core (published peak)", sms * table[p] * clock_ghz / 1e3))
    return out


def measured_roof(name: str, tflops: float) -> tuple[str, float]:
    """A compute roof a lesson measured (for example ``cb.baselines.peak_tflops("bf16")``),
    named so that the plot says it was measured."""
    if not tflops > 0:
        raise ValueError(f"measured_roof: {name}: TFLOP/s must be > 0, got {tflops!r}")
    return (f"{name} (measured)", float(tflops))


def draw(roof: Roof, ax=None, imin: float = 0.01, imax: float = 1000.0, l2: bool = False,
         roofs=None):
    """Draw the roofs (TFLOP/s against flop/byte, log-log) on ``ax``; returns ``ax``.

    ``roofs``: extra compute roofs, ``[(name, TFLOP/s), ...]`` from ``published_roofs`` and
    ``measured_roof``, each drawn over the DRAM roof with its own ridge point. Without it the
    figure is the FP32 roofline alone, as before."""
    import matplotlib.pyplot as plt
    import numpy as np

    extra = list(roofs or ())
    for r in extra:
        if not (isinstance(r, tuple | list) and len(r) == 2 and isinstance(r[0], str)):
            raise ValueError(f"draw: each roof is (name, TFLOP/s), got {r!r}")
        ridge(r[1], roof.dram_gbs)      # refuses a roof <= 0
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = np.logspace(np.log10(imin), np.log10(imax), 200)
    ax.loglog(xs, np.minimum(roof.peak_tflops, xs * roof.dram_gbs / 1e3), "k-", lw=2,
              label=f"DRAM roof {roof.dram_gbs:.0f} GB/s, FP32 peak {roof.peak_tflops:.1f}")
    if l2 and roof.l2_gbs:
        ax.loglog(xs, np.minimum(roof.peak_tflops, xs * roof.l2_gbs / 1e3), "k--", lw=1.2,
                  label=f"L2 roof {roof.l2_gbs:.0f} GB/s")
    ax.axvline(roof.ridge, color="gray", ls=":", lw=1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, tf) in enumerate(extra):
        c = colors[i % len(colors)]
        ls = ":" if "measured" in name else "-."      # measured roofs dotted, published dash-dot
        x_r = ridge(tf, roof.dram_gbs)
        ax.loglog(xs, np.minimum(tf, xs * roof.dram_gbs / 1e3), color=c, ls=ls, lw=1.5,
                  label=f"{name} {tf:,.0f} TFLOP/s, ridge {x_r:,.0f} flop/B")
        ax.axvline(x_r, color=c, ls=":", lw=0.8)
    ax.set_xlabel("arithmetic intensity (flop / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    return ax
