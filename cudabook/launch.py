"""The launch core: launch arithmetic, the launch record, device facts, version names, launching.

Every kernel the book offers for reuse has a launch helper in ``kernels/<op>_launch.py``. The
helper keeps only what is the op's own: its ladder (``VERSIONS``, ``WHAT``, ``MIN_CC``),
``config()``, one entry point, the op's checks and ``sanitize_targets()``. Everything else comes
from the core:

* arrays: ``cudabook.arrays`` (``describe``, ``as_cupy``, ``stream_for``), and
  ``cudabook.validate.expect`` built on it, refusing a wrong dtype, shape, layout or device with
  a message that names the argument;
* modules: ``cudabook.compile.module`` compiles one ladder step of ``kernels/<op>.cu`` (or the
  whole file), once per process and once per machine (a disk cache), with the architecture rule
  (``arch_options``) written once;
* TMA descriptors: ``cudabook.tma.tensor_map``;
* here: ``ceil_div`` / ``grid_1d`` / ``grid_2d`` / ``row_block`` for grids; ``Launch``, the
  record every ``config()`` returns; ``device()``, the GPU's facts read once (compute
  capability, SM count, opt-in shared memory); ``need_cc`` and ``need_shared``, which refuse with
  ``LaunchError`` before anything is launched (never silently wrong, never a fault that kills
  the CUDA context); ``version_name``, one naming rule for versions; ``run``, which launches a
  kernel with a record (opting into more than 48 KiB of shared memory when it needs to, and
  launching in thread-block clusters when the record has a ``cluster`` size: CuPy has no cluster
  launch, so that one goes through ``cuLaunchKernelEx`` of ``libcuda`` by ``ctypes``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["LaunchError", "ceil_div", "round_up", "grid_1d", "grid_2d", "row_block", "need_cc",
           "smem_optin", "need_shared", "Launch", "DeviceFacts", "device", "version_name", "run",
           "returns_launch", "cluster_launch", "kernel_params", "row_split", "split_max_n",
           "SPLIT_CLUSTERS", "SPLIT_SLICE"]


class LaunchError(ValueError):
    """A kernel's assumptions do not hold for these arguments; nothing was launched."""


def _int(v, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise TypeError(f"{what} must be an int >= {lo}, got {v!r}")
    return int(v)


def ceil_div(a: int, b: int) -> int:
    """Blocks needed to cover ``a`` items with ``b`` per block."""
    a, b = _int(a, "ceil_div: a"), _int(b, "ceil_div: b", 1)
    return (a + b - 1) // b


def round_up(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is >= ``a``."""
    return ceil_div(a, b) * b


def grid_1d(n: int, block: int = 256, per_thread: int = 1) -> tuple[int]:
    """Grid of a 1D kernel in which each of ``block`` threads handles ``per_thread`` items."""
    return (max(1, ceil_div(n, _int(block, "block", 1) * _int(per_thread, "per_thread", 1))),)


def grid_2d(rows: int, cols: int, tile: tuple[int, int] | int) -> tuple[int, int]:
    """Grid (x over columns, y over rows) covering a rows x cols output with tiles of
    ``tile = (tile_rows, tile_cols)`` outputs per block (an int: square tiles)."""
    tr, tc = (tile, tile) if isinstance(tile, numbers.Integral) else tile
    return (max(1, ceil_div(cols, tc)), max(1, ceil_div(rows, tr)))


def row_block(n: int, per_thread: int = 16, warp: int = 32, max_threads: int = 1024) -> int:
    """Threads of a one-block-per-row kernel: enough that each holds at most ``per_thread``
    of the row's ``n`` elements, a multiple of ``warp``, between one warp and ``max_threads``."""
    t = ceil_div(_int(n, "row_block: n", 1), _int(per_thread, "per_thread", 1))
    return max(warp, min(max_threads, round_up(t, warp)))


def need_cc(major: int, minor: int = 0, what: str = "this kernel") -> None:
    """Raise ``LaunchError`` unless the GPU has compute capability >= major.minor.

    (``cudabook.require_cc`` prints and returns False instead, for skipping notebook cells.)
    """
    from . import env

    if not env.HAS_GPU:
        raise LaunchError(f"{what} needs a CUDA GPU (this is simulator mode)")
    if env.cc() < (major, minor):
        raise LaunchError(f"{what} needs compute capability {major}.{minor}+; this "
                          f"{env.info().name} is {env.cc()[0]}.{env.cc()[1]}")


class Launch(tuple):
    """A launch record: ``(grid, block)`` as a tuple, with the rest as attributes and keys.

    Every ``config()`` returns one, so ``grid, block = cfg``, ``kernel(*cfg, args)``,
    ``cfg.shared`` and ``cfg["kernel"]`` all work. Fields: ``grid``, ``block``, ``shared`` (bytes
    of dynamic shared memory), ``kernel`` (its name in the module, or None when the caller
    names it), and any op-specific extras (tile sizes, split counts) given as keywords.
    """

    def __new__(cls, grid, block, shared: int = 0, kernel: str | None = None, **extra):
        grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
        block = tuple(int(b) for b in (block if isinstance(block, (tuple, list)) else (block,)))
        self = super().__new__(cls, (grid, block))
        self._fields = {"grid": grid, "block": block, "shared": int(shared), "kernel": kernel,
                        **extra}
        return self

    def __getnewargs_ex__(self):
        f = dict(self._fields)
        return (f.pop("grid"), f.pop("block")), f

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(f"this launch record has no {name!r}; it has "
                                 f"{sorted(self._fields)}") from None

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return self._fields[key]
            except KeyError:
                raise KeyError(f"this launch record has no {key!r}; it has "
                               f"{sorted(self._fields)}") from None
        return super().__getitem__(key)

    def get(self, key: str, default=None):
        return self._fields.get(key, default)

    def __contains__(self, key) -> bool:
        if isinstance(key, str):                 # "fallback" in cfg: a field, as in a dict
            return key in self._fields
        return super().__contains__(key)

    def keys(self):
        return self._fields.keys()

    def as_dict(self) -> dict:
        return dict(self._fields)

    def replace(self, **changes) -> "Launch":
        """A copy with some fields changed."""
        f = {**self._fields, **changes}
        return Launch(f.pop("grid"), f.pop("block"), **f)

    @property
    def threads(self) -> int:
        n = 1
        for b in self._fields["block"]:
            n *= b
        return n

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self._fields.items()
                          if k not in ("grid", "block") and v not in (None, 0))
        return f"Launch(grid={self._fields['grid']}, block={self._fields['block']}" + \
            (f", {extra})" if extra else ")")


def as_launch(cfg) -> Launch:
    """``cfg`` as a launch record: a record stays one; ``(grid, block)``, ``(grid, block,
    shared)`` and a dict with ``grid`` and ``block`` keys become one."""
    if isinstance(cfg, Launch):
        return cfg
    if isinstance(cfg, dict):
        f = dict(cfg)
        return Launch(f.pop("grid"), f.pop("block"), **f)
    if isinstance(cfg, tuple) and len(cfg) in (2, 3):
        return Launch(cfg[0], cfg[1], shared=cfg[2] if len(cfg) == 3 else 0)
    raise TypeError(f"not a launch configuration: {cfg!r}")


def returns_launch(config):
    """Decorator of a ``config()`` that spells its grids as ``(grid, block)`` tuples or dicts:
    what it returns becomes a ``Launch`` record (so every ``config()`` of the book returns one)."""
    import functools

    @functools.wraps(config)
    def wrapped(*args, **kwargs):
        return as_launch(config(*args, **kwargs))

    return wrapped


@dataclass(frozen=True)
class DeviceFacts:
    """What launch helpers need to know about one GPU, read once per device."""
    id: int
    name: str
    cc: tuple[int, int]
    sms: int                  # streaming multiprocessors
    smem_optin: int           # dynamic shared memory one block may opt into (bytes)
    smem_per_sm: int          # shared memory per SM (bytes)
    max_threads_per_sm: int


_FACTS: dict[int, DeviceFacts] = {}


def device(dev: int | None = None) -> DeviceFacts:
    """The facts of GPU ``dev`` (default: CuPy's current device), read from the driver once.

    LaunchError without a GPU (simulator mode)."""
    from . import env

    if not env.HAS_GPU:
        raise LaunchError("no CUDA GPU here (simulator mode): there are no device facts to read")
    import cupy

    dev = cupy.cuda.Device().id if dev is None else int(dev)
    f = _FACTS.get(dev)
    if f is None:
        p = cupy.cuda.runtime.getDeviceProperties(dev)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        f = _FACTS[dev] = DeviceFacts(
            dev, name, (int(p["major"]), int(p["minor"])), int(p["multiProcessorCount"]),
            int(p.get("sharedMemPerBlockOptin", 48 * 1024)),
            int(p.get("sharedMemPerMultiprocessor", 0)),
            int(p.get("maxThreadsPerMultiProcessor", 0)))
    return f


def smem_optin() -> int | None:
    """The most dynamic shared memory one block may opt into on the current GPU, in bytes
    (``sharedMemPerBlockOptin``: 227 KiB on an H100, 163 on an A100, 99 on an L4 / A10 /
    RTX 30-40, 64 on a T4); None without a GPU. Launch helpers compare a kernel's dynamic shared
    memory with it before launching (and fall back or refuse)."""
    from . import env

    return device().smem_optin if env.HAS_GPU else None


def need_shared(shared: int, what: str = "this kernel", limit: int | None = None) -> None:
    """Raise ``LaunchError`` when ``shared`` bytes of dynamic shared memory per block exceed what
    this GPU allows (or ``limit``, when smaller); nothing to check without a GPU."""
    have = smem_optin()
    if limit is not None:
        have = limit if have is None else min(have, limit)
    if have is not None and shared > have:
        raise LaunchError(f"{what} needs {shared // 1024} KiB of shared memory per block, this "
                          f"GPU allows {have // 1024} KiB (per block: H100 227 KiB, A100 163, "
                          "L4 / A10 / RTX 30-40 99, T4 64)")


def version_name(versions, version: str, prefix: str) -> str:
    """The one spelling of a version: ``prefix + "_vN"`` as in the .cu file.

    Launchers take either spelling (``"v3"`` or ``"softmax_v3"``) and return the entry of
    ``versions`` it names; ValueError listing them for anything else."""
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as {versions[-1]!r}, got "
                        f"{type(version).__name__}")
    for cand in (version, f"{prefix}_{version}", version.removeprefix(f"{prefix}_")):
        if cand in versions:
            return cand
    raise ValueError(f"unknown version {version!r}; {prefix} has {tuple(versions)}")


def run(kernel, cfg: Launch, args: tuple, stream=None) -> None:
    """Launch the CuPy ``RawKernel`` ``kernel`` with the record ``cfg`` (its grid, block and
    dynamic shared memory; above 48 KiB the kernel opts in first) on ``stream`` (default: the
    current CuPy stream). A record with ``cluster=C`` (C > 1) launches clusters of C blocks
    along x (``cluster_launch``)."""
    shared = int(cfg.get("shared", 0) if isinstance(cfg, Launch) else 0)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    cluster = int(cfg.get("cluster", 0) or 0) if isinstance(cfg, Launch) else 0
    if cluster > 1:
        cluster_launch(kernel, cfg, args, cluster, stream)
        return
    if stream is None:
        kernel(cfg[0], cfg[1], args, shared_mem=shared)
    else:
        with stream:
            kernel(cfg[0], cfg[1], args, shared_mem=shared)


# ----------------------------------------------------------------------------- cluster launches
#: cuda.h's CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION and
#: CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
_ATTR_CLUSTER_DIMENSION, _FUNC_NON_PORTABLE_CLUSTER = 4, 14
#: the largest portable cluster; up to 16 on an H100 / H200 with the non-portable attribute
PORTABLE_CLUSTER = 8
_CLUSTERS_FIT: dict = {}


def _launch_structs():
    import ctypes

    class LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute: id, pad, 64-byte union
        _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4),
                    ("value", ctypes.c_uint32 * 16)]

    class LaunchConfig(ctypes.Structure):         # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32),
                    ("gridDimZ", ctypes.c_uint32), ("blockDimX", ctypes.c_uint32),
                    ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                    ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint32)]

    return LaunchAttribute, LaunchConfig


def kernel_params(args: tuple):
    """``void** kernelParams`` of a driver launch for ``args`` (CuPy arrays, passed as their
    device pointer, and NumPy scalars, passed by value as their dtype says), and the NumPy
    buffers that must stay alive until the launch is issued."""
    import ctypes

    import numpy as np

    keep = []
    for i, a in enumerate(args):
        ptr = getattr(getattr(a, "data", None), "ptr", None)     # a CuPy ndarray
        if ptr is not None and not isinstance(a, np.ndarray):
            keep.append(np.array(int(ptr), dtype=np.uint64))
        elif isinstance(a, np.generic):
            keep.append(np.array(a))
        else:
            raise TypeError(f"argument {i} of a cluster launch must be a CuPy array or a NumPy "
                            f"scalar (np.int32(...), np.float32(...)), got {type(a).__name__}")
    return (ctypes.c_void_p * max(1, len(keep)))(*[k.ctypes.data for k in keep]), keep


def cluster_launch(kernel, cfg: Launch, args: tuple, cluster: int, stream=None) -> None:
    """Launch ``kernel`` (a CuPy ``RawKernel``) with ``cfg``'s grid, block and dynamic shared
    memory in clusters of ``cluster`` blocks along x (sm_90; the kernel reads the size from
    ``%cluster_nctarank``), through ``cuLaunchKernelEx``. Above 8 blocks the kernel is allowed
    the non-portable size first. LaunchError, before launching, when the grid is not a multiple
    of the cluster or when no such cluster fits this GPU (``cuOccupancyMaxActiveClusters`` = 0:
    too much shared memory or too many threads for ``cluster`` SMs of one GPC)."""
    import ctypes

    import cupy

    from .tma import _libcuda

    grid = tuple(cfg[0]) + (1,) * (3 - len(cfg[0]))
    block = tuple(cfg[1]) + (1,) * (3 - len(cfg[1]))
    shared = int(cfg.get("shared", 0))
    if not 1 <= cluster <= 16 or grid[0] % cluster:
        raise LaunchError(f"a cluster of {cluster} blocks needs 1 <= {cluster} <= 16 and a grid "
                          f"whose x ({grid[0]}) is a multiple of it")
    need_cc(9, 0, f"a launch in clusters of {cluster} blocks")
    lib = _libcuda()
    f = ctypes.c_void_p(kernel.kernel.ptr)
    if cluster > PORTABLE_CLUSTER:
        err = lib.cuFuncSetAttribute(f, _FUNC_NON_PORTABLE_CLUSTER, ctypes.c_int(1))
        if err:
            raise LaunchError(f"this GPU refuses clusters of {cluster} blocks (non-portable "
                              f"sizes above {PORTABLE_CLUSTER}: CUresult {err})")
    Attr, Config = _launch_structs()
    attr = Attr()
    attr.id = _ATTR_CLUSTER_DIMENSION
    attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
    s = stream if stream is not None else cupy.cuda.get_current_stream()
    conf = Config(*grid, *block, shared, ctypes.c_void_p(s.ptr), ctypes.pointer(attr), 1)
    key = (kernel.kernel.ptr, cluster, block, shared)
    if key not in _CLUSTERS_FIT:
        n = ctypes.c_int(0)
        err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), f, ctypes.byref(conf))
        _CLUSTERS_FIT[key] = n.value if err == 0 else -err
    if _CLUSTERS_FIT[key] == 0 or _CLUSTERS_FIT[key] < 0:
        raise LaunchError(f"no cluster of {cluster} blocks of {block[0]} threads with "
                          f"{shared // 1024} KiB of shared memory each fits this GPU "
                          f"(cuOccupancyMaxActiveClusters: {_CLUSTERS_FIT[key]}); take a "
                          "smaller cluster or less shared memory")
    params, keep = kernel_params(args)
    err = lib.cuLaunchKernelEx(ctypes.byref(conf), f, params, None)
    del keep
    if err:
        raise LaunchError(f"cuLaunchKernelEx refused a launch in clusters of {cluster} "
                          f"(grid {grid}, block {block}, {shared} bytes shared): CUresult {err}")


# ----------------------------------------------------------------------------- rows over clusters
#: cluster sizes of a row split over a cluster (softmax_v6, layernorm_v6, rmsnorm_v3)
SPLIT_CLUSTERS = (2, 4, 8, 16)
#: floats of a row per block that the launcher aims at: 64 KiB of shared memory, so three blocks
#: share an SM (N = 262144 in clusters of 16)
SPLIT_SLICE = 16384
#: shared memory a block of those kernels keeps beside its slice (barriers, inbox, reductions)
SPLIT_RESERVE = 1024


def _split_slice(N: int, C: int) -> int:
    return round_up(ceil_div(N, C), 4)


def split_max_n(optin: int, cluster: int = 16) -> int:
    """The longest row a split over ``cluster`` blocks holds when a block may opt into
    ``optin`` bytes of shared memory."""
    return cluster * ((optin - SPLIT_RESERVE) // 16 * 4)


def row_split(M: int, N: int, kernel: str, cluster: int | None = None,
              optin: int | None = None, threads: int | None = None) -> Launch:
    """The launch record of a kernel that splits each of M rows of N floats over a cluster of C
    blocks (kernels/mma.cuh's cluster_row): grid C M, block T, dynamic shared memory 4 L bytes
    for L = round_up(ceil(N / C), 4) floats, ``cluster=C``, ``slice=L``. C: ``cluster``, or the
    smallest of SPLIT_CLUSTERS whose slice is at most SPLIT_SLICE floats (16 past 262144
    columns); T: ``threads``, or about 32 floats per thread, 128 to 512. ``optin``: the shared
    memory a block may opt into (default: this GPU's; 227 KiB without one). LaunchError naming
    the N this kernel takes when a slice does not fit."""
    M, N = _int(M, "M", 1), _int(N, "N", 1)
    if optin is None:
        optin = smem_optin() or 227 * 1024
    if cluster is None:
        cluster = next((c for c in SPLIT_CLUSTERS if ceil_div(N, c) <= SPLIT_SLICE),
                       SPLIT_CLUSTERS[-1])
    elif cluster not in SPLIT_CLUSTERS:
        raise LaunchError(f"{kernel}: cluster must be one of {SPLIT_CLUSTERS}, got {cluster!r}")
    L = _split_slice(N, cluster)
    if 4 * L > optin - SPLIT_RESERVE:
        raise LaunchError(f"{kernel} takes 1 <= N <= {split_max_n(optin, cluster)} in clusters "
                          f"of {cluster} (N <= {split_max_n(optin)} in clusters of 16) with "
                          f"{optin // 1024} KiB of shared memory per block; N = {N} needs "
                          f"{4 * L // 1024} KiB per block")
    if M * cluster >= 2**31:
        raise LaunchError(f"{kernel}: {M} rows in clusters of {cluster} is more blocks than one "
                          "grid dimension holds")
    T = threads if threads is not None else max(128, min(512, round_up(ceil_div(L, 32), 32)))
    if T % 32 or not cluster <= T <= 512:
        raise LaunchError(f"{kernel}: threads must be a multiple of 32 from {cluster} to 512, "
                          f"got {T}")
    return Launch((cluster * M,), (T,), shared=4 * L, kernel=kernel, cluster=cluster, slice=L)
