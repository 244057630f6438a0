"""Launch arithmetic and the launch-helper pattern: block counts, grids, row-kernel block sizes.

Every kernel the book offers for reuse has a launch helper in ``kernels/<op>_launch.py`` that

1. checks its arguments with ``cudabook.validate.expect`` (array, dtype, shape, contiguity,
   device) and refuses with a message that names the argument and what was expected;
2. checks what the kernel assumes (``need_cc`` for the architecture, sizes that fit, alignment
   for vector paths via ``validate.expect_aligned``) and refuses with ``LaunchError`` before
   anything is launched: never silently wrong, never a fault that kills the CUDA context;
3. computes the grid with ``ceil_div`` / ``grid_1d`` / ``grid_2d`` and launches.
"""

from __future__ import annotations

import numbers

__all__ = ["LaunchError", "ceil_div", "round_up", "grid_1d", "grid_2d", "row_block", "need_cc",
           "smem_optin"]


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


_OPTIN: dict[int, int] = {}      # device id -> opt-in shared memory per block (bytes)


def smem_optin() -> int | None:
    """The most dynamic shared memory one block may opt into on the current GPU, in bytes
    (``sharedMemPerBlockOptin``: 227 KiB on an H100, 163 on an A100, 99 on an L4 / A10 /
    RTX 30-40, 64 on a T4); None without a GPU. Read once per device. Launch helpers compare a
    kernel's dynamic shared memory with it before launching (and fall back or refuse)."""
    from . import env

    if not env.HAS_GPU:
        return None
    import cupy

    dev = cupy.cuda.Device().id
    if dev not in _OPTIN:
        _OPTIN[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)
                          .get("sharedMemPerBlockOptin", 48 * 1024))
    return _OPTIN[dev]
