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

__all__ = ["VERSIONS", "WHAT", "MAX_B", "V5_TILES", "V6_TILES", "MAX_KS", "gemv", "config",
           "kernel_name", "v5_tiles", "v6_splits", "v6_tiles", "workspace",
           "as_cupy",
           "sanitize_targets"]

VERSIONS = ("gemv_v1", "gemv_v2", "gemv_v3", "gemv_v4", "gemv_v5", "gemv_v6")
WHAT = {
    "gemv_v1": "one thread per output, uncoalesced",
    "gemv_v2": "one warp per row, coalesced 2-byte loads",
    "gemv_v3": "warp per row, 16-byte streamed loads, 4 in flight",
    "gemv_v4": "4 warps per R rows (split K), 8 loads in flight",
    "gemv_v5": "tensor cores (mma m16n8k16, the batch as M), 8 warps split K, no shared operands",
    "gemv_v6": "v5 with K split across blocks too (the last block adds the splits in order) and "
               "up to 64 weight rows a block",
}
MAX_B = 32            #: the largest batch gemv() takes (beyond it a GEMM is the right kernel)
BATCH_TILES = (1, 2, 4, 8)
ROWS = (2, 4)         #: rows of W per block in gemv_v4
DEFAULT_ROWS = 2
V5_TILES = (1, 2, 4)  #: tiles of 8 weight rows per block in gemv_v5 (NT)
V6_TILES = (1, 2, 4, 8)
MAX_KS = 8            #: gemv_v6's largest split of K across blocks


def batch_tile(B: int) -> int:
    """Rows of x per block: the smallest tile >= B (8 for B > 8: several tiles in grid y)."""
    for bt in BATCH_TILES:
        if B <= bt:
            return bt
    return BATCH_TILES[-1]


def v5_tiles(N: int) -> int:
    """gemv_v5's NT for N weight rows: the most tiles of 8 rows per block that still leave at
    least 256 blocks (a function of N alone, so a row's sums do not depend on the batch)."""
    for nt in V5_TILES[::-1]:
        if ceil_div(N, 8 * nt) >= 256:
            return nt
    return 1


def v6_splits(K: int) -> int:
    """gemv_v6's KS: K's chunks of 32 columns split so that each warp of a block gets at least 4
    (one round of loads in flight; at most MAX_KS splits). A function of K alone: a row's sums are added in the same order at
    every batch size."""
    return max(1, min(MAX_KS, ceil_div(K, 32) // (8 * 4)))


def v6_tiles(N: int, ks: int, sms: int) -> int:
    """gemv_v6's NT: the most tiles of 8 weight rows a block that still leaves two blocks per SM
    (the sums of a row do not depend on NT, only how many rows share a block's x loads)."""
    for nt in V6_TILES[::-1]:
        if ceil_div(N, 8 * nt) * ks >= 2 * sms:
            return nt
    return 1


def kernel_name(version: str, B: int, rows: int = DEFAULT_ROWS, N: int | None = None,
                nt: int | None = None) -> str:
    """The instantiation of ``version`` for batch ``B`` (gemv_v3_b4, gemv_v4_b1_r2,
    gemv_v5_m2_n4, ...); gemv_v5 takes its tiles from ``nt`` or from N (v5_tiles)."""
    version = version_name(VERSIONS, version, "gemv")
    if version in ("gemv_v1", "gemv_v2"):
        return version
    if version == "gemv_v5":
        if nt is None:
            if N is None:
                raise ValueError("gemv_v5: give N (or nt) to pick the instantiation")
            nt = v5_tiles(N)
        if nt not in V5_TILES:
            raise ValueError(f"gemv_v5: nt must be one of {V5_TILES}, got {nt!r}")
        return f"gemv_v5_m{1 if B <= 16 else 2}_n{nt}"
    if version == "gemv_v6":
        if nt not in V6_TILES:
            raise ValueError(f"gemv_v6: nt must be one of {V6_TILES}, got {nt!r}")
        return f"gemv_v6_m{1 if B <= 16 else 2}_n{nt}"
    if version == "gemv_v3":
        return f"gemv_v3_b{batch_tile(B)}"
    if rows not in ROWS:
        raise ValueError(f"gemv_v4: rows must be one of {ROWS}, got {rows!r}")
    return f"gemv_v4_b{batch_tile(B)}_r{rows}"


def config(version: str, B: int, N: int, rows: int = DEFAULT_ROWS,
           nt: int | None = None, K: int | None = None, ks: int | None = None,
           sms: int | None = None) -> Launch:
    """The launch of ``version`` for batch B and N weight rows (gemv.cu's launch comment):
    grid, block and the kernel (its instantiation for B and ``rows``, or v5's ``nt``; v6 also
    takes K, or its split ``ks``, and the GPU's SM count)."""
    version = version_name(VERSIONS, version, "gemv")
    if version == "gemv_v6":
        if ks is None:
            if K is None:
                raise ValueError("gemv_v6: give K (or ks) to pick the split")
            ks = v6_splits(K)
        if not (isinstance(ks, int) and 1 <= ks <= MAX_KS):
            raise ValueError(f"gemv_v6: ks must be an int in 1..{MAX_KS}, got {ks!r}")
        if nt is None:
            nt = v6_tiles(N, ks, sms or 132)
        name = kernel_name(version, B, nt=nt)
        return Launch((ceil_div(N, 8 * nt), ks), (256,), kernel=name, ks=ks)
    if version == "gemv_v5":
        name = kernel_name(version, B, N=N, nt=nt)
        return Launch((ceil_div(N, 8 * int(name[-1])),), (256,), kernel=name)
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


_WORK: dict = {}      # device -> (workspace, tickets): gemv_v6's split partials, grown on demand


def workspace(floats: int, tiles: int):
    """gemv_v6's fp32 workspace (at least ``floats``) and tickets (at least ``tiles``, zero at rest)
    on the current device: one pair per device, grown when a call needs more (the old arrays are
    kept: a captured graph may still use them). Calls of gemv_v6 on two streams at the same time
    must not share it: pass each its own ``work=(cp.empty(...), cp.zeros(..., cp.uint32))``."""
    import cupy as cp

    dev = cp.cuda.Device().id
    old = _WORK.get(dev)
    if old is None or old[0].size < floats or old[1].size < tiles:
        keep = old[2] if old else []
        w = cp.empty(max(floats, 0 if old is None else old[0].size), cp.float32)
        t = cp.zeros(max(tiles, 0 if old is None else old[1].size), cp.uint32)
        _WORK[dev] = (w, t, keep + ([old[:2]] if old else []))
    return _WORK[dev][0], _WORK[dev][1]


def gemv(x: Any, W: Any, bias: Any = None, out: Any = None, *, version: str = "auto",
         rows: int = DEFAULT_ROWS, nt: int | None = None, ks: int | None = None,
         work: tuple | None = None):
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
    if version in ("gemv_v3", "gemv_v4", "gemv_v5", "gemv_v6") and not vec_ok:
        raise LaunchError(f"{version} reads 16 bytes at a time: it needs K % 8 == 0 (K = {K}) and "
                          "16-byte aligned x and W; use version='auto' (falls back to gemv_v2)")
    if version == "gemv_v6":
        cfg = config(version, B, N, nt=nt, K=K, ks=ks, sms=cb.env.info().sms)
    else:
        cfg = config(version, B, N, rows, nt)
    args = (xc, Wc, np.uint64(0) if bias is None else cb.as_cupy(bias, "bias"), oc,
            np.int32(B), np.int32(N), np.int32(K))
    if version == "gemv_v6":
        need, tiles = cfg.ks * B * N, cfg.grid[0]
        if work is None:
            wk, tk = workspace(need, tiles)
        else:
            wk, tk = (cb.as_cupy(a, n) for a, n in zip(work, ("work[0]", "work[1]")))
            if wk.dtype != np.float32 or wk.size < need or tk.dtype != np.uint32 or \
                    tk.size < tiles:
                raise LaunchError(f"gemv_v6: work must be (float32 of >= {need}, uint32 of >= "
                                  f"{tiles} zeros)")
        args += (wk, tk, np.int32(cfg.ks))
    with cb.arrays.launch_stream(x):
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return out


def sanitize_targets():
    """Every version on a ragged shape (N not a multiple of the rows per block, K % 8 != 0 for
    the fallback) and batches that leave a tile partly empty."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    for B, N, K in ((1, 37, 264), (3, 19, 520), (11, 6, 1000), (2, 5, 97), (17, 45, 776),
                    (32, 9, 40)):
        x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
        b = rng.standard_normal(N, dtype=cp.float32).astype(cp.float16)
        for v in VERSIONS:
            if v in ("gemv_v3", "gemv_v4", "gemv_v5", "gemv_v6") and K % 8:
                continue
            if v == "gemv_v6":
                for nt, ks in ((1, 1), (2, 3), (8, 2), (4, 8)):
                    yield (f"{v} nt{nt} ks{ks} ({B}x{N}x{K})",
                           (lambda nt=nt, ks=ks, x=x, W=W, b=b: gemv(x, W, b, version="gemv_v6",
                                                                      nt=nt, ks=ks)))
                continue
            if v == "gemv_v5":
                for nt in V5_TILES:
                    yield (f"{v} nt{nt} ({B}x{N}x{K})",
                           (lambda nt=nt, x=x, W=W, b=b: gemv(x, W, b, version="gemv_v5",
                                                               nt=nt)))
                continue
            for r in (ROWS if v == "gemv_v4" else (DEFAULT_ROWS,)):
                yield (f"{v} r{r} ({B}x{N}x{K})",
                       (lambda v=v, r=r, x=x, W=W, b=b: gemv(x, W, b, version=v, rows=r)))
