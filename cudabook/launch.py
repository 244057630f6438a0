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
  kernel with a record (opting into more than 48 KiB of shared memory when it needs to).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["LaunchError", "ceil_div", "round_up", "grid_1d", "grid_2d", "row_block", "need_cc",
           "smem_optin", "need_shared", "Launch", "DeviceFacts", "device", "version_name", "run",
           "returns_launch"]


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
    current CuPy stream)."""
    shared = int(cfg.get("shared", 0) if isinstance(cfg, Launch) else 0)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    if stream is None:
        kernel(cfg[0], cfg[1], args, shared_mem=shared)
    else:
        with stream:
            kernel(cfg[0], cfg[1], args, shared_mem=shared)
