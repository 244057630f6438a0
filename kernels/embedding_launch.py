"""Launching kernels/embedding.cu: the token embedding gather.

    el = cb.load_launch("embedding")
    x = el.embedding(tok, wte)     # tok (M,) int32 or int64, wte (V, d) fp16 -> x (M, d) fp32

  embedding()   the entry point (embedding_v1, one block of 128 threads per token): check,
                launch, return x (CuPy float32, or the ``x`` given)

Refused before a launch: dtypes and shapes, no tokens, an odd width, ids outside the vocabulary
(``check_ids``). The kernel runs on CuPy's current stream.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch

__all__ = ["embedding"]


def embedding(tok, wte, x=None, check_ids: bool = True):
    """x[m] = float(wte[tok[m]]). ``check_ids`` reads the ids back to refuse one outside the
    vocabulary (a copy to the host: pass False for ids the GPU made, or inside a graph capture);
    unchecked, such an id gets a NaN row of x, never another token's row. PyTorch's int64 ids
    are converted to int32 once (a copy: pass int32 ids inside a graph capture)."""
    import cupy as cp

    if str(getattr(tok, "dtype", "")).replace("torch.", "") == "int64" and \
            cb.describe(tok, "tok").on_device:
        t64 = cb.as_cupy(tok, "tok")
        if check_ids and t64.size:
            lo, hi = int(t64.min()), int(t64.max())
            if lo < 0 or hi >= int(wte.shape[0]):
                raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                                 f"[0, {int(wte.shape[0])})")
        tok = cp.clip(t64, -1, 2**31 - 1).astype(cp.int32)   # any id past int32 stays invalid
    cb.expect(tok, "tok", dtype=np.int32, ndim=1)
    cb.expect(wte, "wte", dtype=np.float16, ndim=2)
    V, d = (int(s) for s in wte.shape)
    M = int(tok.shape[0])
    if M == 0:
        raise ValueError("no tokens: an empty prompt has nothing to embed")
    if d % 2:
        raise ValueError(f"embedding width {d} must be even (half2 loads)")
    tok, wte = cb.as_cupy(tok, "tok"), cb.as_cupy(wte, "wte")
    if check_ids:
        lo, hi = int(tok.min()), int(tok.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {V})")
    x = cp.empty((M, d), cp.float32) if x is None else x
    cb.expect(x, "x", dtype=np.float32, shape=(M, d))
    cb.launch.run(cb.module("embedding").get("embedding_v1"), Launch((M,), (128,)),
                  (tok, wte, cb.as_cupy(x, "x"), np.int32(M), np.int32(d), np.int32(V)))
    return x
