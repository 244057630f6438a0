"""Launching kernels/sampling.cu: choosing the next token on the GPU.

    sl = cb.load_launch("sampling")
    tok = sl.sample(logits, u, temperature=0.8, top_k=40, top_p=0.95)   # logits (B, V) fp16/fp32
    tok = sl.sample(logits, u, temperature=0)                           # greedy (argmax)

``u`` (B,) float32 holds one uniform number in [0, 1) per row: the random source, so a fixed seed
gives a fixed choice (``cupy.random.default_rng(seed).random(B, dtype=cupy.float32)``).

  sample()             the entry point (sample_topk_v1, one block of 1024 threads per row):
                       check, launch, return the token ids (CuPy int32)
  sanitize_targets()   ties and a ragged vocabulary, for tools/sanitize.py

Refused before a launch: dtypes and shapes, temperature < 0, top_k outside 1..min(KMAX, V), top_p
outside (0, 1], float32 logits beyond fp16's range. The kernel runs on CuPy's current stream.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch

__all__ = ["KMAX", "sample", "sanitize_targets"]

KMAX = 64     # SAMPLE_KMAX of sampling.cu: the winners live in shared memory


def sample(logits, u, out=None, temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0):
    """Token ids (B,) int32 drawn from softmax(logits / temperature) cut to the top_k largest
    and then to the top_p nucleus; temperature 0 means greedy (top_k = 1).

    The kernel reads fp16 logits. float32 logits (what a PyTorch model's head usually returns)
    are converted once, and refused if a finite value lies beyond fp16's range (+-65504) (both
    a copy and a read-back: pass fp16 logits inside a CUDA graph capture)."""
    import cupy as cp

    if str(getattr(logits, "dtype", "")).replace("torch.", "") == "float32" and \
            cb.describe(logits, "logits").on_device:
        cb.expect(logits, "logits", ndim=2)
        l32 = cb.as_cupy(logits, "logits")
        big = cp.isfinite(l32) & (cp.abs(l32) > 65504)
        if bool(big.any()):
            raise ValueError(f"logits: {int(big.sum())} finite float32 values lie beyond fp16's "
                             "range (+-65504), where the fp16 kernel would read infinity")
        logits = l32.astype(cp.float16)
    cb.expect(logits, "logits", dtype=np.float16, ndim=2)
    B, V = (int(s) for s in logits.shape)
    cb.expect(u, "u", dtype=np.float32, shape=(B,))
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    k = 1 if temperature == 0 else int(top_k)
    if not 1 <= k <= min(KMAX, V):
        raise ValueError(f"top_k = {top_k} must be in 1..{min(KMAX, V)}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    out = cp.empty(B, cp.int32) if out is None else out
    cb.expect(out, "out", dtype=np.int32, shape=(B,))
    inv_t = 1.0 if temperature == 0 else 1.0 / temperature
    cb.launch.run(cb.module("sampling").get("sample_topk_v1"), Launch((B,), (1024,)),
                  (cb.as_cupy(logits, "logits"), np.int32(V), np.float32(inv_t), np.int32(k),
                   np.float32(top_p), cb.as_cupy(u, "u"), cb.as_cupy(out, "out")))
    return out


def sanitize_targets():
    import cupy as cp

    z = cp.random.standard_normal((3, 1001), dtype=cp.float32).astype(cp.float16)
    z[:, 7:12] = 4.0                                       # ties
    u = cp.asarray([0.1, 0.5, 0.99], cp.float32)
    yield "sample_topk_v1 k=8 with ties", lambda: sample(z, u, temperature=0.7, top_k=8, top_p=0.9)
