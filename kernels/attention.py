"""Attention (Chapter 9): the Numba twin of the fp32 FlashAttention forward. The launch helpers of
the CUDA C++ kernels (attention_forward.cu, attention_backward.cu) and the PyTorch op live in
attention_launch.py.

Layout: Q (..., Nq, D), K and V (..., Nk, D), contiguous, the leading dimensions (batch, heads)
flattened into BH. lse (..., Nq) float32 is log sum_j exp(scale q_i . k_j). Causal masks are
top-left aligned as in torch's ``is_causal``: query i sees keys j <= i.

Numba
  flash_fwd_fp32     FlashAttention forward in fp32, one thread per query (CUDA attention_v2
                     gives each query 4 threads and joins their partial dot products with
                     shuffles, which the simulator lacks); K and V tiles of 32 keys in shared
                     memory, the online softmax per tile, tiles above the diagonal skipped
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

import cudabook as cb

NEG_INF = float32(-math.inf)
BR = 32        # Numba: queries per block, one thread each
BC = 32        # Numba: keys per tile
MAXD = 128     # Numba: largest head dimension (sizes the shared tiles and the accumulator)


# ============================================================================== Numba twin
@cuda.jit
def flash_fwd_fp32(q, k, v, o, lse, scale, causal):
    # launch: [(ceil(Nq / BR), BH), BR]; q, o: (BH, Nq, D), k, v: (BH, Nk, D), lse: (BH, Nq)
    Ks = cuda.shared.array((BC, MAXD), float32)
    Vs = cuda.shared.array((BC, MAXD), float32)
    acc = cuda.local.array(MAXD, float32)        # this query's unnormalised output
    s = cuda.local.array(BC, float32)            # this query's scores against the tile
    bh, tid = cuda.blockIdx.y, cuda.threadIdx.x
    Nq, D = q.shape[1], q.shape[2]
    Nk = k.shape[1]
    row = cuda.blockIdx.x * BR + tid
    qr = min(row, Nq - 1)                        # threads past the end still help load tiles
    for c in range(D):
        acc[c] = float32(0)
    m, l = NEG_INF, float32(0)
    kv_end = min(Nk, (cuda.blockIdx.x + 1) * BR) if causal else Nk   # skip tiles past the block
    for j0 in range(0, kv_end, BC):
        cuda.syncthreads()                       # everyone is done with the previous tile
        for e in range(tid, BC * D, BR):
            jj, c = e // D, e % D
            if j0 + jj < Nk:
                Ks[jj, c] = k[bh, j0 + jj, c]
                Vs[jj, c] = v[bh, j0 + jj, c]
            else:                                # past the end: zeros, never read unmasked
                Ks[jj, c] = float32(0)
                Vs[jj, c] = float32(0)
        cuda.syncthreads()
        mt = NEG_INF
        for jj in range(BC):
            key = j0 + jj
            x = NEG_INF
            if key < Nk and not (causal and key > row):
                x = float32(0)
                for c in range(D):
                    x += q[bh, qr, c] * Ks[jj, c]
                x *= scale
            s[jj] = x
            mt = max(mt, x)
        m_new = max(m, mt)
        if m_new > NEG_INF:                      # else nothing visible yet: (m, l, acc) stay
            alpha = math.exp(m - m_new)          # rescale what was summed against the old max
            l *= alpha
            for c in range(D):
                acc[c] *= alpha
            for jj in range(BC):
                p = math.exp(s[jj] - m_new)
                l += p
                for c in range(D):
                    acc[c] += p * Vs[jj, c]
            m = m_new
    if row < Nq:
        inv = float32(1) / l if l > 0 else float32(0)
        for c in range(D):
            o[bh, row, c] = acc[c] * inv
        lse[bh, row] = m + math.log(l) if l > 0 else NEG_INF


def launch_numba(q, k, v, o, lse, causal: bool = False, scale: float | None = None) -> None:
    """flash_fwd_fp32 on float32 (BH, Nq, D) q, o and (BH, Nk, D) k, v, lse (BH, Nq): NumPy
    arrays in the simulator, device arrays (Numba, CuPy, torch) on a GPU. D <= 128."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        cb.expect(a, name, dtype=np.float32, ndim=3)
    BH, Nq, D = (int(x) for x in q.shape)
    Nk = int(k.shape[1])
    if tuple(k.shape) != (BH, Nk, D) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must be ({BH}, Nk, {D}) like q {tuple(q.shape)}; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not 1 <= D <= MAXD or Nq < 1 or Nk < 1:
        raise ValueError(f"need 1 <= D <= {MAXD} and non-empty sequences; got D={D}, Nq={Nq}, "
                         f"Nk={Nk}")
    cb.expect(o, "o", dtype=np.float32, shape=(BH, Nq, D))
    cb.expect(lse, "lse", dtype=np.float32, shape=(BH, Nq))
    s = np.float32(1 / math.sqrt(D) if scale is None else scale)
    flash_fwd_fp32[(cb.ceil_div(Nq, BR), BH), BR](q, k, v, o, lse, s, bool(causal))
