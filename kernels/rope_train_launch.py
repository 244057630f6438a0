"""Launching kernels/rope_train.cu: RoPE on (BH, T, D) bf16 heads for training, both directions.

    rl = cb.load_launch("rope_train")
    cos, sin = gpt.rope_tables(cfg, T, "cuda")
    rl.rope(q, cos, sin)                 # forward, in place: row t of each (T, D) at position t
    rl.rope(dq, cos, sin, inverse=True)  # backward: the transposed rotation, in place

  rope()   the entry point (rope_train_v1, rope_train_v2): check, launch on the inputs' stream
           (a torch.cuda.graph captures it), return x

Refused before a launch: dtypes, shapes, an odd head dimension, tables shorter than T or of the
wrong width, non-contiguous or misaligned arrays, arrays on the host.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, ceil_div, version_name

__all__ = ["VERSIONS", "rope", "config", "sanitize_targets"]

VERSIONS = ("rope_train_v1", "rope_train_v2")
THREADS = 256


def config(version: str, rows: int, D: int) -> dict:
    """Grid and block of ``version`` for ``rows`` head vectors of dimension D."""
    version = version_name(VERSIONS, version, "rope_train")
    per = 8 if version == "rope_train_v2" else 1
    work = rows * (D // 2) // per
    return {"kernel": version, "grid": (max(1, ceil_div(work, THREADS)),), "block": (THREADS,)}


def rope(x, cos, sin, inverse: bool = False, version: str | None = None):
    """Rotate x (BH, T, D) bf16 in place by the angles of positions 0..T-1 (``inverse``: the
    transposed rotation, the backward of the forward one). cos, sin: (Tmax, D/2) float32."""
    cb.expect(x, "x", dtype="bfloat16", ndim=3)
    BH, T, D = (int(s) for s in x.shape)
    if D % 2 or D < 2:
        raise ValueError(f"x: head dimension {D} must be even (pairs i, i + D/2)")
    for t, name in ((cos, "cos"), (sin, "sin")):
        cb.expect(t, name, dtype=np.float32, ndim=2)
        if int(t.shape[1]) != D // 2:
            raise ValueError(f"{name}: expected {D // 2} columns (D/2), got {int(t.shape[1])}")
        if int(t.shape[0]) < T:
            raise ValueError(f"{name}: the table covers {int(t.shape[0])} positions, x has T = "
                             f"{T}: build it for at least T positions")
    if version is None:
        version = "rope_train_v2" if (D // 2) % 8 == 0 else "rope_train_v1"
    version = version_name(VERSIONS, version, "rope_train")
    if version == "rope_train_v2":
        if (D // 2) % 8:
            raise ValueError(f"rope_train_v2 needs D/2 a multiple of 8, got D = {D}: use v1")
        for t, name in ((x, "x"), (cos, "cos"), (sin, "sin")):
            if cb.describe(t).ptr % 16:
                raise ValueError(f"{name}: not 16-byte aligned (a view at an odd offset?): "
                                 "pass a fresh tensor or use rope_train_v1")
    if BH == 0 or T == 0:
        return x
    cfg = config(version, BH * T, D)
    mod = cb.module("rope_train")
    args = tuple(np.uint64(cb.describe(t).ptr) for t in (x, cos, sin)) + (
        np.int64(BH * T), np.int32(T), np.int32(D), np.float32(-1.0 if inverse else 1.0))
    with cb.arrays.launch_stream(x):
        cb.launch.run(mod.get(cfg["kernel"]), Launch(cfg["grid"], cfg["block"]), args)
    return x


def sanitize_targets():
    """(name, fn) pairs the sanitizer lane runs: both versions, both directions, a ragged T."""
    def run(version):
        def f():
            import torch

            from cudabook import gpt
            cfg = gpt.GPTConfig(vocab=256, d=128, n_layer=1, n_head=2, ctx=64)
            cos, sin = gpt.rope_tables(cfg, 37, "cuda")
            x = torch.randn(3, 37, 64, device="cuda").bfloat16()
            rope(x, cos, sin, version=version)
            rope(x, cos, sin, inverse=True, version=version)
            torch.cuda.synchronize()
        return f
    return [(v, run(v)) for v in VERSIONS]
