"""Launching kernels/rope.cu: rotary position embedding, half-split pairs (i, i + D/2).

    rl = cb.load_launch("rope")
    rl.rope(x, pos0=5)                      # in place on x (R, H, D) fp16; row r at position 5 + r
    rl.rope_qkv(qkv, q, kc, vc, pos0=0)     # split + rotate + append to the KV cache, one launch

  rope(), rope_qkv()   the entry points (rope_v1, rope_qkv_v1): check, launch, return the result
  dev_ptr()            an optional pointer argument (cb.describe's address, 0 for None)

Arrays are CuPy fp16 on the GPU (the kernels run on CuPy's current stream). ``rope`` takes a view
whose last two axes are dense (the q or k part of a QKV matmul's output:
``qkv.reshape(M, 3, H, D)[:, 0]``). ``pos_dev`` (a device int32 array of one element) adds a
position read on the GPU, for a step captured in a CUDA graph. Refused before a launch: dtypes,
shapes and layouts, an odd head dimension, positions outside the cache.
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, grid_1d, version_name

__all__ = ["VERSIONS", "rope", "rope_qkv", "dev_ptr"]

VERSIONS = ("rope_v1",)     #: rope's ladder (rope_qkv_v1 is rope_v1 fused with the QKV split)


def dev_ptr(a) -> np.uint64:
    """The device address of ``a``'s first element (cb.describe; 0 for None: a null pointer)."""
    return np.uint64(0 if a is None else cb.describe(a).ptr)


def _check_pos_dev(pos_dev) -> None:
    if pos_dev is not None:
        cb.expect(pos_dev, "pos_dev", dtype=np.int32, shape=(1,))


def _heads_view(x, name: str) -> tuple[int, int, int, int]:
    """(R, H, D, row stride in elements) of x (R, H, D) whose last two axes are dense."""
    cb.expect(x, name, dtype=np.float16, ndim=3, contiguous=False)
    R, H, D = (int(s) for s in x.shape)
    if x.strides[2] != 2 or x.strides[1] != 2 * D or x.strides[0] % 2:
        raise ValueError(f"{name}: the last two axes (heads, head dim) must be dense; got "
                         f"strides {x.strides} for shape {x.shape}")
    if D % 2:
        raise ValueError(f"{name}: head dimension {D} must be even (pairs i, i + D/2)")
    return R, H, D, x.strides[0] // 2


def rope(x, pos0: int = 0, T: int | None = None, pos_dev=None, base: float = 10000.0,
         version: str = "rope_v1"):
    """Rotate x (R, H, D) fp16 in place: row r at position pos0 + r % T (+ pos_dev[0])."""
    version = version_name(VERSIONS, version, "rope")
    R, H, D, stride = _heads_view(x, "x")
    T = R if T is None else int(T)
    if T < 1 or R % T:
        raise LaunchError(f"T = {T} must divide the {R} rows (rows are (batch, time))")
    if pos0 < 0:
        raise LaunchError(f"pos0 = {pos0} must be >= 0")
    _check_pos_dev(pos_dev)
    n = R * H * (D // 2)
    if n:
        cb.launch.run(cb.module("rope").get(version), Launch((ceil_div(n, 256),), (256,)),
                      (x, np.int32(R), np.int32(T), np.int32(H), np.int32(D), np.int64(stride),
                       np.int32(pos0), dev_ptr(pos_dev), np.float32(math.log2(base))))
    return x


def rope_qkv(qkv, q, kc, vc, pos0: int = 0, pos_dev=None, k_out=None, v_out=None,
             base: float = 10000.0):
    """qkv (B*T, 3*H*D) -> q (B, H, T, D) rotated; k rotated and v into kc, vc (B, H, L, D) at
    positions pos0.. (+ pos_dev[0]); also into k_out, v_out (B, H, T, D) when given."""
    cb.expect(q, "q", dtype=np.float16, ndim=4)
    B, H, T, D = (int(s) for s in q.shape)
    cb.expect(qkv, "qkv", dtype=np.float16, shape=(B * T, 3 * H * D))
    cb.expect(kc, "kc", dtype=np.float16, ndim=4)
    L = int(kc.shape[2])
    cb.expect(kc, "kc", dtype=np.float16, shape=(B, H, L, D))
    cb.expect(vc, "vc", dtype=np.float16, shape=(B, H, L, D))
    if (k_out is None) != (v_out is None):
        raise ValueError("give both k_out and v_out, or neither")
    for a, nm in ((k_out, "k_out"), (v_out, "v_out")):
        if a is not None:
            cb.expect(a, nm, dtype=np.float16, shape=(B, H, T, D))
    if D % 2:
        raise ValueError(f"head dimension {D} must be even")
    _check_pos_dev(pos_dev)
    if pos_dev is None and not 0 <= pos0 <= L - T:
        raise LaunchError(f"positions {pos0}..{pos0 + T - 1} do not fit the cache of {L} "
                          "positions (prompt longer than the cache?)")
    cb.launch.run(cb.module("rope").get("rope_qkv_v1"),
                  Launch(grid_1d(B * T * H * (D // 2)), (256,)),
                  (qkv, q, kc, vc, dev_ptr(k_out), dev_ptr(v_out), np.int32(B), np.int32(T),
                   np.int32(H), np.int32(D), np.int32(L), np.int32(pos0), dev_ptr(pos_dev),
                   np.float32(math.log2(base))))
    return q
