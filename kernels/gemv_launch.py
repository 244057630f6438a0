"""Launching kernels/gemv.cu: y = x @ W^T (+ bias) for a few rows of x (decode), fp16 in and out.

    gv = cb.load_launch("gemv")
    y = gv.gemv(x, W)                       # x (B, K) fp16, W (N, K) fp16 -> y (B, N) fp16
    y = gv.gemv(x, W, bias, out=y)          # bias (N,) fp16; out preallocated (B, N) fp16
    gv.gemv(x, W, version="gemv_v2")        # one rung of the ladder ("v2" works too)

  VERSIONS, WHAT      the ladder (gemv.cu's header), one line per step
  config()            a cb.Launch record: grid, block and the instantiation (kernel_name())
  gemv()              the entry point: check, pick the version, launch, return y
  sanitize_targets()  every version on ragged shapes, for tools/sanitize.py

The stable entry point is ``gemv(x, W, bias=None, out=None)``: fp32 accumulation, fp16 result,
B from 1 to 32 (one launch; batch tiles of up to 8 rows of x share each weight load), any K and
N (K % 8 == 0 with 16-byte aligned x and W takes the vectorised gemv_v4, anything else gemv_v2).
x may also be 1-D (K,), giving y of shape (N,). CuPy arrays and PyTorch CUDA tensors are
accepted (no copy; a torch x gives a torch y, launched on torch's current stream). Bad input is
refused before anything is launched: dtype, shape, contiguity, host arrays, B outside 1..32,
a vectorised version on unaligned operands.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "MAX_B", "gemv", "config", "kernel_name", "as_cupy",
           "sanitize_targets"]

VERSIONS = ("gemv_v1", "gemv_v2", "gemv_v3", "gemv_v4")
WHAT = {
    "gemv_v1": "one thread per output, uncoalesced",
    "gemv_v2": "one warp per row, coalesced 2-byte loads",
    "gemv_v3": "warp per row, 16-byte streamed loads, 4 in flight",
    "gemv_v4": "4 warps per R rows (split K), 8 loads in flight",
}
MAX_B = 32            #: the largest batch gemv() takes (beyond it a GEMM is the right kernel)
BATCH_TILES = (1, 2, 4, 8)
ROWS = (2, 4)         #: rows of W per block in gemv_v4
DEFAULT_ROWS = 2


def batch_tile(B: int) -> int:
    """Rows of x per block: the smallest tile >= B (8 for B > 8: several tiles in grid y)."""
    for bt in BATCH_TILES:
        if B <= bt:
            return bt
    return BATCH_TILES[-1]


def kernel_name(version: str, B: int, rows: int = DEFAULT_ROWS) -> str:
    """The instantiation of ``version`` for batch ``B`` (gemv_v3_b4, gemv_v4_b1_r2, ...)."""
    version = version_name(VERSIONS, version, "gemv")
    if version in ("gemv_v1", "gemv_v2"):
        return version
    if version == "gemv_v3":
        return f"gemv_v3_b{batch_tile(B)}"
    if rows not in ROWS:
        raise ValueError(f"gemv_v4: rows must be one of {ROWS}, got {rows!r}")
    return f"gemv_v4_b{batch_tile(B)}_r{rows}"


def config(version: str, B: int, N: int, rows: int = DEFAULT_ROWS) -> Launch:
    """The launch of ``version`` for batch B and N weight rows (gemv.cu's launch comment):
    grid, block and the kernel (its instantiation for B and ``rows``)."""
    version = version_name(VERSIONS, version, "gemv")
    if version == "gemv_v1":
        grid = (ceil_div(N, 128), B)
    elif version == "gemv_v2":
        grid = (ceil_div(N, 4), B)
    elif version == "gemv_v3":
        grid = (ceil_div(N, 4), ceil_div(B, batch_tile(B)))
    else:
        grid = (ceil_div(N, rows), ceil_div(B, batch_tile(B)))
    return Launch(grid, (128,), kernel=kernel_name(version, B, rows))


def as_cupy(a: Any, name: str):
    """(the CuPy view of ``a``, "torch" or "cupy"): no copy. Kept for callers of this shape; the
    launch core's ``cb.as_cupy`` is the view alone."""
    return cb.as_cupy(a, name), ("torch" if cb.arrays.lib_of(a) == "torch" else "cupy")


def gemv(x: Any, W: Any, bias: Any = None, out: Any = None, *, version: str = "auto",
         rows: int = DEFAULT_ROWS):
    """y = x @ W^T (+ bias): x (B, K) or (K,) fp16, W (N, K) fp16, bias (N,) fp16 or None;
    fp32 accumulation, y (B, N) (or (N,)) fp16, written into ``out`` when given and returned."""
    mod = cb.module("gemv")              # first: without a GPU this says so
    cb.expect(x, "x", dtype=np.float16)
    if len(x.shape) not in (1, 2):
        raise ValueError(f"x: expected (B, K) or (K,), got shape {tuple(x.shape)}")
    cb.expect(W, "W", dtype=np.float16, ndim=2)
    one_d = len(x.shape) == 1
    B, K = (1, int(x.shape[0])) if one_d else (int(x.shape[0]), int(x.shape[1]))
    N = int(W.shape[0])
    if int(W.shape[1]) != K:
        raise ValueError(f"x has K = {K} columns but W is {tuple(W.shape)}: W must be (N, K), "
                         "nn.Linear's weight layout (y = x @ W.T)")
    if not 1 <= B <= MAX_B:
        raise LaunchError(f"gemv: batch B = {B}; this kernel takes 1..{MAX_B} rows of x "
                          "(for more, a GEMM uses the tensor cores: cb.load_launch('hgemm'))")
    if N < 1 or K < 1:
        raise LaunchError(f"gemv: empty problem (N, K) = ({N}, {K})")
    if N >= 2**31 // 4 or N * K >= 2**62:
        raise LaunchError(f"gemv: N = {N} rows is more than one grid dimension holds")
    if bias is not None:
        cb.expect(bias, "bias", dtype=np.float16, shape=(N,))
    y_shape = (N,) if one_d else (B, N)
    if out is None:
        out = cb.arrays.empty_like_lib(x, y_shape, "float16")
    cb.expect(out, "out", dtype=np.float16, shape=y_shape)
    xc, Wc, oc = cb.as_cupy(x, "x"), cb.as_cupy(W, "W"), cb.as_cupy(out, "out")
    vec_ok = K % 8 == 0 and xc.data.ptr % 16 == 0 and Wc.data.ptr % 16 == 0
    version = ("gemv_v4" if vec_ok else "gemv_v2") if version == "auto" else \
        version_name(VERSIONS, version, "gemv")
    if version in ("gemv_v3", "gemv_v4") and not vec_ok:
        raise LaunchError(f"{version} reads 16 bytes at a time: it needs K % 8 == 0 (K = {K}) and "
                          "16-byte aligned x and W; use version='auto' (falls back to gemv_v2)")
    cfg = config(version, B, N, rows)
    args = (xc, Wc, np.uint64(0) if bias is None else cb.as_cupy(bias, "bias"), oc,
            np.int32(B), np.int32(N), np.int32(K))
    with cb.arrays.launch_stream(x):
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return out


def sanitize_targets():
    """Every version on a ragged shape (N not a multiple of the rows per block, K % 8 != 0 for
    the fallback) and batches that leave a tile partly empty."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    for B, N, K in ((1, 37, 264), (3, 19, 520), (11, 6, 1000), (2, 5, 97)):
        x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
        b = rng.standard_normal(N, dtype=cp.float32).astype(cp.float16)
        for v in VERSIONS:
            if v in ("gemv_v3", "gemv_v4") and K % 8:
                continue
            for r in (ROWS if v == "gemv_v4" else (DEFAULT_ROWS,)):
                yield (f"{v} r{r} ({B}x{N}x{K})",
                       (lambda v=v, r=r, x=x, W=W, b=b: gemv(x, W, b, version=v, rows=r)))
