"""Launching kernels/reduce.cu: the sum and the maximum of a float32 vector.

    rl = cb.load_launch("reduce")
    s = rl.reduce(x)                   # reduce_v5: a one-element array with the sum (or out=...)
    s = rl.reduce(x, version="v2")     # v1..v4: launched again on the partials until one is left
    m = rl.maximum(x)                  # reduce_max_v1
    s = rl.total(x)                    # = reduce(x), version reduce_v5 (grid / block to choose)
    s = rl.ladder(x, "reduce_v2")      # = reduce(x, version="reduce_v2")

    VERSIONS, LADDER                   the sum's ladder; LADDER: the versions that write one
                                       partial per block, and the elements each thread loads
    config(version, n, block, grid, sms)   -> Launch(grid, block, kernel=version) of one pass
    reduce(x, out=None, version)       the entry point: checks, config, launches, returns out
    maximum(x, out=None)               the maximum's entry point (NaNs ignored)
    sanitize_targets()

The checks, before anything is launched: x float32, 1D, C-contiguous, on the GPU, at least one
element, fewer than 2^31, and for the float4 kernels (reduce_v5, reduce_max_v1) 16-byte aligned;
out float32 (1,); v1..v3 have a static tree of 256 floats, so block must be 256. Versions are
spelled "reduce_v3" or "v3".
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "LADDER", "reduce", "ladder", "total", "maximum", "config",
           "sanitize_targets"]

#: the versions that write one partial per block, and the elements each thread loads
LADDER = {"reduce_v1": 1, "reduce_v2": 1, "reduce_v3": 2, "reduce_v4": 2}
VERSIONS = (*LADDER, "reduce_v5")
#: the one-pass kernels: a grid-stride loop over float4, one atomic per block
_ONE_PASS = ("reduce_v5", "reduce_max_v1")


def _module():
    return cb.module("reduce")     # the whole file, compiled once per process


def config(version: str, n: int, block: int | None = None, grid: int | None = None,
           sms: int | None = None) -> Launch:
    """Grid and block of one pass of ``version`` (or "reduce_max_v1") over n elements: a block
    per ``block * LADDER[version]`` elements for the ladder (block 256 by default), ``grid``
    blocks (default four per SM: ``sms``, default this GPU's) of ``block`` (512) threads for
    reduce_v5 and reduce_max_v1."""
    version = "reduce_max_v1" if version == "reduce_max_v1" else \
        version_name(VERSIONS, version, "reduce")
    if version in _ONE_PASS:
        if grid is None:
            grid = 4 * (cb.launch.device().sms if sms is None else sms)
        return Launch((grid,), (block or 512,), kernel=version)
    block = block or 256
    return Launch((ceil_div(n, block * LADDER[version]),), (block,), kernel=version)


def _vector(x, what: str, aligned: bool) -> int:
    _module()
    cb.expect(x, "x", dtype=np.float32, ndim=1)
    n = int(x.shape[0])
    if n == 0:
        raise LaunchError(f"{what}: x is empty")
    if n >= 2**31:
        raise LaunchError(f"{what}: the kernels index with int; x has {n} >= 2^31 elements")
    if aligned and not cb.expect_aligned(x, "x"):
        raise LaunchError(f"{what}: reduce_v5 / reduce_max_v1 read float4, and x does not start "
                          "at a 16-byte boundary (a view such as x[1:]); pass a contiguous copy "
                          "(cupy.ascontiguousarray does not realign: use x.copy()) or use "
                          "ladder(x, 'reduce_v4')")
    return n


def _out(out, x):
    if out is None:
        out = cb.arrays.empty_like_lib(x, (1,), "float32")
    cb.expect(out, "out", dtype=np.float32, shape=(1,))
    return out


def _one_pass(version: str, x, out, start: float, grid, block):
    n = _vector(x, "total" if version == "reduce_v5" else "maximum", aligned=True)
    out = _out(out, x)
    cfg = config(version, n, block, grid)
    with cb.arrays.launch_stream(x, out):
        o = cb.as_cupy(out, "out")
        o.fill(start)
        cb.launch.run(_module().get(version), cfg, (cb.as_cupy(x, "x"), o, np.int32(n)))
    return out


def reduce(x, out=None, version: str = "reduce_v5", block: int | None = None,
           grid: int | None = None):
    """The sum of ``x`` into the one-element ``out`` (returned; allocated by x's library when
    not given). reduce_v5: one pass (``grid`` blocks of ``block`` threads, see config());
    v1..v4: launched again on the partial sums until one is left (``block`` threads, 256)."""
    version = version_name(VERSIONS, version, "reduce")
    if version == "reduce_v5":
        return _one_pass(version, x, out, 0.0, grid, block or 512)
    block = block or 256
    if version in ("reduce_v1", "reduce_v2", "reduce_v3") and block != 256:
        raise LaunchError(f"{version} has a static tree of 256 floats: block must be 256")
    n = _vector(x, "ladder", aligned=False)
    if out is not None:
        cb.expect(out, "out", dtype=np.float32, shape=(1,))
    k = _module().get(version)
    with cb.arrays.launch_stream(x, *(() if out is None else (out,))):
        while True:
            cfg = config(version, n, block)
            blocks = cfg.grid[0]
            partial = out if blocks == 1 and out is not None else \
                cb.arrays.empty_like_lib(x, (blocks,), "float32")
            cb.launch.run(k, cfg, (cb.as_cupy(x, "x"), cb.as_cupy(partial, "partial"),
                                   np.int32(n)))
            if blocks == 1:
                return partial
            x, n = partial, blocks


def ladder(x, version: str = "reduce_v4", block: int = 256):
    """The sum by ``version`` (v1..v4), launched again on the partial sums until one is left:
    ``reduce(x, version=version, block=block)``."""
    version = version_name(VERSIONS, version, "reduce")
    if version not in LADDER:
        raise ValueError(f"unknown version {version!r}; the ladder has {tuple(LADDER)}")
    return reduce(x, version=version, block=block)


def total(x, out=None, grid: int | None = None, block: int = 512):
    """The sum of ``x`` by reduce_v5 into the one-element ``out`` (returned):
    ``reduce(x, out, "reduce_v5", block, grid)``."""
    return reduce(x, out, "reduce_v5", block, grid)


def maximum(x, out=None, grid: int | None = None, block: int = 512):
    """The maximum of ``x`` (NaNs ignored) by reduce_max_v1 into ``out`` (returned)."""
    return _one_pass("reduce_max_v1", x, out, -np.inf, grid, block)


def sanitize_targets():
    """Every version on a ragged length (racecheck: the trees and the warp-sum slots; memcheck:
    the tails)."""
    import cupy as cp

    n = 3 * 512 + 77
    x = cp.random.rand(n, dtype=cp.float32)
    for v in LADDER:
        yield v, (lambda v=v: ladder(x, v))
    yield "reduce_v5", lambda: total(x, grid=4)
    yield "reduce_max_v1", lambda: maximum(x, grid=4)
