"""Launching kernels/kvcache.cu: the KV cache of decoding.

    kl = cb.load_launch("kvcache")
    kl.kv_append(k, v, kc, vc, pos0)               # k, v (B, T, H, D) views -> caches (B, H, L, D)
    kl.decode_attention(q, kc, vc, out, n_keys)     # one query per (b, h) over keys 0..n-1
    kl.merge_heads(o, y)                            # (B, H, T, D) -> (B*T, H*D)

  DECODE_ATTENTION         decode_attention's ladder ("v2" or "decode_attention_v2")
  kv_append(), decode_attention(), merge_heads(), advance()   the entry points: check, launch
  sanitize_targets()       decode_attention on a short and a ragged cache, for tools/sanitize.py

Arrays are CuPy fp16 on the GPU (the kernels run on CuPy's current stream: the decode step's,
or the stream a CUDA graph is captured on). ``pos_dev`` (a device int32 array of one element)
adds a position read on the GPU, for a step captured in a CUDA graph: kv_append writes at pos0 +
pos_dev[0] + t, decode_attention attends over n_keys + pos_dev[0] + 1 keys. Refused before a
launch: dtypes, shapes and layouts, positions outside the cache, a head dimension that is not a
multiple of 8 up to 256, a cache longer than the GPU's shared memory holds scores for.
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, grid_1d, version_name

__all__ = ["DECODE_ATTENTION", "kv_append", "decode_attention", "merge_heads", "advance",
           "sanitize_targets"]


DECODE_ATTENTION = ("decode_attention_v1", "decode_attention_v2")


def _module():
    """kernels/kvcache.cu through cb.module (once per process, kept in the kernel cache)."""
    return cb.module("kvcache")


def _ptr(a) -> np.uint64:
    """The device address of ``a`` (cb.describe), 0 for None: an optional pointer argument."""
    return np.uint64(0 if a is None else cb.describe(a).ptr)


def _cache(kc, vc) -> tuple[int, int, int, int]:
    cb.expect(kc, "kc", dtype=np.float16, ndim=4)
    B, H, L, D = (int(s) for s in kc.shape)
    cb.expect(vc, "vc", dtype=np.float16, shape=(B, H, L, D))
    return B, H, L, D


def _pos_dev(pos_dev) -> None:
    if pos_dev is not None:
        cb.expect(pos_dev, "pos_dev", dtype=np.int32, shape=(1,))


def kv_append(k, v, kc, vc, pos0: int = 0, pos_dev=None):
    """Write k, v (B, T, H, D) (views whose last two axes are dense, rows evenly strided) into
    the caches kc, vc (B, H, L, D) at positions pos0 + t (+ pos_dev[0])."""
    B, H, L, D = _cache(kc, vc)
    for a, nm in ((k, "k"), (v, "v")):
        cb.expect(a, nm, dtype=np.float16, ndim=4, contiguous=False)
    if tuple(k.shape) != tuple(v.shape) or tuple(k.strides) != tuple(v.strides):
        raise ValueError(f"k and v must have one shape and one layout, got {k.shape} "
                         f"{k.strides} and {v.shape} {v.strides}")
    Bk, T, Hk, Dk = (int(s) for s in k.shape)
    if (Bk, Hk, Dk) != (B, H, D):
        raise ValueError(f"k has shape {k.shape}; the cache {kc.shape} wants (B, T, H, D) = "
                         f"({B}, T, {H}, {D})")
    st = tuple(s // 2 for s in k.strides)
    if st[3] != 1 or st[2] != D or st[0] != T * st[1]:
        raise ValueError(f"k, v: rows (b, t) must be evenly strided with dense heads; got "
                         f"strides {k.strides}")
    _pos_dev(pos_dev)
    if pos_dev is None and not 0 <= pos0 <= L - T:
        raise LaunchError(f"positions {pos0}..{pos0 + T - 1} do not fit the cache of {L} "
                          "positions (prompt longer than the cache?)")
    cb.launch.run(_module().get("kv_append_v1"), Launch(grid_1d(B * T * H * D), (256,)),
                  (k, v, np.int64(st[1]), kc, vc, np.int32(B), np.int32(T), np.int32(H),
                   np.int32(D), np.int32(L), np.int32(pos0), _ptr(pos_dev)))


def decode_attention(q, kc, vc, out, n_keys: int = 0, pos_dev=None, scale: float | None = None,
                     version: str = "decode_attention_v2"):
    """out (B, H*D) = softmax(q k^T * scale) v for one query q (B, H, D) per sequence and head
    (a view whose last two axes are dense) over cached keys 0..n-1, n = n_keys (+ pos_dev[0] + 1)."""
    version = version_name(DECODE_ATTENTION, version, "decode_attention")
    B, H, L, D = _cache(kc, vc)
    cb.expect(q, "q", dtype=np.float16, shape=(B, H, D), contiguous=False)
    if q.strides[2] != 2 or q.strides[1] != 2 * D:
        raise ValueError(f"q: heads must be dense, got strides {q.strides}")
    cb.expect(out, "out", dtype=np.float16, shape=(B, H * D))
    if D % 8 or D > 256:
        raise LaunchError(f"head dimension {D}: decode_attention takes D a multiple of 8, <= 256")
    _pos_dev(pos_dev)
    if pos_dev is None and not 1 <= n_keys <= L:
        raise LaunchError(f"n_keys = {n_keys}: attention needs 1..{L} cached keys")
    s = 1 / math.sqrt(D) if scale is None else float(scale)
    kern = _module().get(version)
    _fit_scores(kern, version, L)
    cfg = Launch((H, B), (128 if version == "decode_attention_v1" else 256,), shared=4 * L)
    cb.launch.run(kern, cfg, (q, np.int64(q.strides[0] // 2), kc, vc, out, np.int32(H),
                              np.int32(D), np.int32(L), np.int32(n_keys), _ptr(pos_dev),
                              np.float32(s * math.log2(math.e))))
    return out


def _fit_scores(kern, version: str, L: int) -> None:
    """The L float scores live in dynamic shared memory beside the kernel's static arrays: past
    48 KiB in all the block must opt in (L > ~9,900), and past the GPU's opt-in limit (64 KiB on
    a T4, 99 on an L4, 227 on an H100) the cache is too long: LaunchError naming the longest."""
    static = int(kern.attributes["shared_size_bytes"])
    if 4 * L + static <= 48 * 1024:
        return
    optin = cb.launch.smem_optin() or 48 * 1024
    if 4 * L + static > optin:
        raise LaunchError(f"{version}: a cache of L = {L} positions needs {(4 * L + static) // 1024}"
                          f" KiB of shared memory per block (4 L bytes of scores + {static} static),"
                          f" this GPU allows {optin // 1024} KiB: at most L = {(optin - static) // 4}")
    kern.max_dynamic_shared_size_bytes = 4 * L


def merge_heads(o, y):
    """y (B*T, H*D) = o (B, H, T, D) with the head axis moved next to D."""
    cb.expect(o, "o", dtype=np.float16, ndim=4)
    B, H, T, D = (int(s) for s in o.shape)
    cb.expect(y, "y", dtype=np.float16, shape=(B * T, H * D))
    cb.launch.run(_module().get("merge_heads_v1"), Launch(grid_1d(B * H * T * D), (256,)),
                  (o, y, np.int32(B), np.int32(H), np.int32(T), np.int32(D)))
    return y


def advance(pos_dev, tok, history):
    """history[b, p + 1] = tok[b], then pos_dev[0] = p + 1 (on the GPU)."""
    _pos_dev(pos_dev)
    cb.expect(tok, "tok", dtype=np.int32, ndim=1)
    B = int(tok.shape[0])
    cb.expect(history, "history", dtype=np.int32, ndim=2)
    if int(history.shape[0]) != B:
        raise ValueError(f"history has {history.shape[0]} rows for {B} sequences")
    cb.launch.run(_module().get("advance_v1"), Launch((1,), (min(1024, 32 * ceil_div(B, 32)),)),
                  (pos_dev, tok, history, np.int32(B), np.int32(history.shape[1])))


def sanitize_targets():
    """decode_attention (shared scores, block reductions) on a short and a ragged cache."""
    import cupy as cp

    for B, H, L, D, n in ((2, 3, 40, 64, 37), (1, 2, 130, 128, 130)):
        kc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
        vc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
        q = cp.random.standard_normal((B, H, D), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((B, H * D), cp.float16)
        for v in DECODE_ATTENTION:
            yield (f"{v} B={B} L={L} D={D} n={n}",
                   lambda q=q, kc=kc, vc=vc, out=out, n=n, v=v: decode_attention(
                       q, kc, vc, out, n, version=v))
