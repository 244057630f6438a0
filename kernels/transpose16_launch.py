"""Launching kernels/transpose16.cu (and its Numba twins): out (C, R) = a (R, C) transposed, for
16-bit elements (bfloat16 or float16, moved as bit patterns: an exact copy).

    t16 = cb.load_launch("transpose16")
    out = t16.transpose(a)                        # transpose16_v2; a (R, C) bf16 / fp16 on the GPU
    t16.transpose(a, out, version="v1")           # into the caller's out (C, R); "transpose16_v1"
    t16.transpose_numba(bits, version="v2")       # the twins (simulator or GPU), uint16 NumPy

    VERSIONS, WHAT, TILES, BLOCKS, DTYPES
    config(version, rows, cols)   -> Launch(grid (tiles,), block, kernel=version)
    transpose(a, out=None, version="v2")   the entry point: checks, config, launch, returns out
    sanitize_targets()

Any R, C >= 1: v2 takes 16-byte vectors where the rows allow it (C, resp. R, a multiple of 8
and a, resp. out, 16-byte aligned; the kernel decides) and goes element by element elsewhere.
Refused before a launch (TypeError / ValueError naming the argument): a dtype other than
bfloat16 / float16 (kernels/transpose.cu does float32), a shape that is not 2D or is empty, an
out of another dtype or shape, a strided view, a host array, arrays on two GPUs, an out that
overlaps a (a transpose cannot run in place). The launch runs on a's stream (PyTorch's current
stream for a tensor), allocates only when out is None, never synchronises: capture-safe with an
out given.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "TILES", "BLOCKS", "DTYPES", "config", "transpose",
           "transpose_numba", "sanitize_targets"]

VERSIONS = ("transpose16_v1", "transpose16_v2")
WHAT = {"transpose16_v1": "32 x 32 tile padded to 32 x 34, one element per access",
        "transpose16_v2": "64 x 64 tile as 32-bit pairs, 16-byte loads and stores where aligned"}
#: the edge of the square tile of the input each block covers
TILES = {"transpose16_v1": 32, "transpose16_v2": 64}
BLOCKS = {"transpose16_v1": (32, 8), "transpose16_v2": (256,)}
DTYPES = ("bfloat16", "float16")


def _module():
    return cb.module("transpose16")     # the whole file, compiled once per process


def config(version: str, rows: int, cols: int) -> Launch:
    """The 1D grid over the tiles of a rows x cols input, and the block of ``version``."""
    version = version_name(VERSIONS, version, "transpose16")
    t = TILES[version]
    tiles = ceil_div(rows, t) * ceil_div(cols, t)
    if tiles > 2**31 - 1:
        raise LaunchError(f"transpose16: {tiles} tiles exceed the grid's limit (2^31 - 1)")
    return Launch((max(1, tiles),), BLOCKS[version], kernel=version)






def transpose(a, out=None, version: str = "v2"):
    """out (C, R) = a (R, C)^T, a bfloat16 or float16, C-contiguous, on the GPU; out the same
    dtype (allocated by a's library when None). ``version``: "v1", "v2" (or "transpose16_v2").
    Returns out. Bitwise: a copy of 16-bit patterns."""
    version = version_name(VERSIONS, version, "transpose16")
    cb.expect(a, "a", ndim=2, device=False)
    dt = cb.describe(a, "a").dtype
    if dt not in DTYPES:
        raise TypeError(f"a: expected dtype bfloat16 or float16, got {dt} (transpose16 moves "
                        "16-bit elements; kernels/transpose.cu transposes float32)")
    R, C = (int(s) for s in a.shape)
    if R < 1 or C < 1:
        raise ValueError(f"a: shape {(R, C)} is empty; transpose16 needs R, C >= 1")
    if out is not None:
        cb.expect(out, "out", dtype=dt, shape=(C, R), device=False)
    cb.validate.expect_one_gpu(("a", a))
    if out is None:
        out = cb.arrays.empty_like_lib(a, (C, R), dt)
    ia, io = cb.validate.expect_one_gpu(("a", a), ("out", out))
    if cb.validate.overlaps(ia, io):
        raise ValueError("out overlaps a: a transpose cannot run in place; pass a separate out")
    cfg = config(version, R, C)
    with cb.arrays.launch_stream(a):
        cb.launch.run(_module().get(cfg.kernel), cfg,
                      (np.uint64(ia.ptr), np.uint64(io.ptr), np.int64(R), np.int64(C)))
    return out


def transpose_numba(a, version: str = "v2") -> np.ndarray:
    """The Numba twin of ``version`` (transpose16_v1, or transpose16_tile64 for v2) on a (R, C)
    uint16 array of bit patterns (NumPy, or anything cb.to_numpy reads); returns out (C, R)
    uint16 NumPy, prefilled with 0xFFFF where nothing writes."""
    from numba import cuda

    version = version_name(VERSIONS, version, "transpose16")
    bits = np.ascontiguousarray(cb.to_numpy(a))
    if bits.dtype != np.uint16 or bits.ndim != 2 or 0 in bits.shape:
        raise TypeError(f"a: expected a non-empty 2D uint16 array (bit patterns), got "
                        f"{bits.dtype} {bits.shape}")
    nb = cb.load_numba("transpose16")
    kern = nb.transpose16_v1 if version == "transpose16_v1" else nb.transpose16_tile64
    R, C = bits.shape
    out = cuda.to_device(np.full((C, R), 0xFFFF, np.uint16))
    grid, block = config(version, R, C)
    kern[grid, block](cuda.to_device(bits), out)
    return out.copy_to_host()


def sanitize_targets():
    """Both versions on ragged shapes (the element-by-element edges), a multiple of 64 (the
    vector path), and views that start 2 bytes in (the fallback of misaligned pointers)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    for R, C in ((67, 45), (1, 1), (128, 192)):
        a = torch.randn(R, C, device="cuda", generator=g).bfloat16()
        out = torch.empty(C, R, device="cuda", dtype=torch.bfloat16)
        for v in VERSIONS:
            yield f"{v} ({R} x {C})", (lambda a=a, out=out, v=v: transpose(a, out, v))
    buf = torch.randn(64 * 64 + 1, device="cuda", generator=g).half()
    ob = torch.empty(64 * 64 + 1, device="cuda", dtype=torch.float16)
    a, out = buf[1:].view(64, 64), ob[1:].view(64, 64)
    for v in VERSIONS:
        yield f"{v} (64 x 64 views at +2 bytes)", (lambda v=v: transpose(a, out, v))
