"""Where the book runs: a real GPU, or the Numba CUDA simulator.

Importing this module decides the mode once, before ``numba.cuda`` is imported:

* a CUDA device that CuPy can use  -> GPU mode; CuPy and Numba cells run for real;
* no usable device                 -> simulator mode: ``NUMBA_ENABLE_CUDASIM=1`` is set so the
  Numba cells run on the CPU, and cells that need CuPy (CUDA C++) are skipped with a message.

``NUMBA_ENABLE_CUDASIM=1`` set by the reader forces simulator mode even on a GPU machine.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata

__all__ = ["SIM", "HAS_GPU", "info", "report", "pick", "require_gpu", "require_cc", "cc"]


def _probe_gpu() -> tuple[bool, str]:
    """Return (usable, why-not). Never raises."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import problem means no CuPy
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return False, f"CuPy sees no CUDA device ({e})"
    if n == 0:
        return False, "no CUDA device"
    return True, ""


# Small grids are deliberate in this book (ragged-size tests, demos); Numba's low-occupancy
# warning would print into graded outputs, which must be exactly one line.
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
# Lessons pass host arrays to Numba on purpose where they teach implicit copies (and say so in the
# text); the per-launch NumbaPerformanceWarning would repeat that in every stored output.
os.environ.setdefault("NUMBA_CUDA_WARN_ON_IMPLICIT_COPY", "0")

_forced_sim = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
if _forced_sim:
    HAS_GPU, _why_no_gpu = False, "NUMBA_ENABLE_CUDASIM=1 is set"
else:
    HAS_GPU, _why_no_gpu = _probe_gpu()
    if not HAS_GPU:
        if "numba.cuda" in sys.modules:
            print("cudabook: numba.cuda was imported before cudabook; restart the kernel and "
                  "import cudabook first so it can switch Numba to the simulator.")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

#: True when Numba runs on the CUDA simulator (no GPU, or forced).
SIM: bool = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cupy_dist() -> str | None:
    for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        if _version(d):
            return d
    return None


@dataclass
class DeviceInfo:
    name: str = "CUDA simulator (CPU)"
    cc: tuple[int, int] = (0, 0)
    sms: int = 0
    mem_gb: float = 0.0
    l2_mb: float = 0.0
    clock_mhz: float = 0.0
    driver: str = "-"
    runtime: str = "-"
    packages: dict[str, str | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"


def _fmt_cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _collect() -> DeviceInfo:
    d = DeviceInfo()
    cupy_dist = _cupy_dist()
    d.packages = {
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba-cuda": _version("numba-cuda"),
        cupy_dist or "cupy": _version(cupy_dist) if cupy_dist else None,
        "torch": _version("torch"),
    }
    np_v = d.packages["numpy"] or "0"
    nc_v = d.packages["numba-cuda"] or "0"
    if _vtuple(np_v) >= (2, 5) and _vtuple(nc_v) < (0, 31):
        d.problems.append(
            f"numpy {np_v} breaks numba-cuda {nc_v} (np.row_stack was removed). "
            "Fix: pip install 'numpy<2.5' and restart the kernel.")
    if d.packages["numba-cuda"] is None:
        d.problems.append("numba-cuda is missing (the old numba.cuda target is deprecated). "
                          "Fix: pip install numba-cuda")
    if HAS_GPU:
        import cupy

        dev = cupy.cuda.Device()
        p = cupy.cuda.runtime.getDeviceProperties(dev.id)
        d.name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        d.cc = (int(p["major"]), int(p["minor"]))
        d.sms = int(p["multiProcessorCount"])
        d.mem_gb = p["totalGlobalMem"] / 2**30
        d.l2_mb = p["l2CacheSize"] / 2**20
        # cudaDeviceProp.clockRate is gone in CUDA 13; the device attribute remains
        d.clock_mhz = (p.get("clockRate") or dev.attributes.get("ClockRate", 0)) / 1000
        drv = cupy.cuda.runtime.driverGetVersion()
        rt = cupy.cuda.runtime.runtimeGetVersion()
        d.driver, d.runtime = _fmt_cuda_version(drv), _fmt_cuda_version(rt)
        if drv // 1000 < rt // 1000:   # minor-version compatibility covers 13.0 vs 13.2
            d.problems.append(
                f"the driver supports CUDA {d.driver} but CuPy was built for {d.runtime}. "
                "Fix: install the CuPy wheel for your driver (cupy-cuda12x for CUDA 12).")
    else:
        if "google.colab" in sys.modules:
            d.problems.append("this Colab runtime has no GPU. Fix: Runtime > Change runtime type "
                              "> T4 GPU, then run the notebook again.")
    return d


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        num = "".join(ch for ch in part if ch.isdigit())
        out.append(int(num) if num else 0)
    return tuple(out)


_INFO: DeviceInfo | None = None


def info() -> DeviceInfo:
    """Device facts (cached)."""
    global _INFO
    if _INFO is None:
        _INFO = _collect()
    return _INFO


def cc() -> tuple[int, int]:
    """Compute capability of the current device, (0, 0) in simulator mode."""
    return info().cc


def _no_nvidia_gpu() -> bool:
    """True when the machine has no NVIDIA driver or the driver sees no GPU (as opposed to a GPU
    that CuPy cannot use, whose reason report() prints as it is)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    n = ctypes.c_int(0)
    try:
        return lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0
    except AttributeError:
        return True


def report() -> DeviceInfo:
    """Print what the book will run on, and the fix for any environment problem found."""
    d = info()
    if HAS_GPU:
        print(f"GPU      : {d.name} ({d.arch}, {d.sms} SMs, {d.mem_gb:.0f} GiB, "
              f"L2 {d.l2_mb:.0f} MiB)")
        print(f"CUDA     : driver {d.driver}, runtime {d.runtime}")
    elif not _forced_sim and _no_nvidia_gpu():
        print("mode     : SIMULATOR - no NVIDIA GPU found: simulator mode.")
        print("           Numba kernels run on the CPU under the CUDA simulator, with small "
              "problem sizes;")
        print("           cells marked %%gpu (CuPy/CUDA C++, timings) are skipped with a message.")
        print("           For a GPU: on Colab, Runtime > Change runtime type > T4 GPU, then run "
              "the notebook again;")
        print("           elsewhere, a machine with an NVIDIA GPU and its driver (nvidia-smi "
              "lists the GPU).")
    else:
        print("mode     : SIMULATOR - no usable GPU "
              f"({_why_no_gpu}).")
        print("           Numba kernels run on the CPU under NUMBA_ENABLE_CUDASIM=1, with small "
              "problem sizes;")
        print("           cells marked %%gpu (CuPy/CUDA C++, timings) are skipped.")
    pk = ", ".join(f"{k} {v}" for k, v in d.packages.items() if v)
    print(f"packages : {pk}")
    for p in d.problems:
        print(f"PROBLEM  : {p}")
    return d


def pick(gpu, sim):
    """Problem-size knob: ``gpu`` on a real device, ``sim`` under the simulator.

    The simulator runs about 0.3 ms per simulated thread, so a million-element launch that
    takes microseconds on a GPU would take minutes there.
    """
    return sim if SIM else gpu


def require_gpu(what: str = "this cell") -> bool:
    """True on a GPU; otherwise print why ``what`` is skipped and return False."""
    if HAS_GPU:
        return True
    print(f"skipped: {what} needs a CUDA GPU (simulator mode).")
    return False


def require_cc(major: int, minor: int = 0, what: str = "this section") -> bool:
    """True if the device has compute capability >= major.minor, else explain and skip."""
    if not require_gpu(what):
        return False
    if cc() >= (major, minor):
        return True
    print(f"skipped: {what} needs compute capability {major}.{minor}+; "
          f"this {info().name} is {cc()[0]}.{cc()[1]}.")
    return False
