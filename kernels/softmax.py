"""Numba twins of kernels/softmax.cu: row-wise softmax of a float32 (M, N) matrix (Chapter 3).

Rows of -inf give 0 (see softmax.cu). The warp-per-row v3 and the register-resident v5 have no
twin here (v3 needs warp shuffles, which the simulator lacks; v5 needs float4 registers).

versions (TPB = 128 threads per block for the block-per-row kernels)
  softmax_v1   one thread per row, three passes
  softmax_v2   one block per row, shared-memory tree reductions for max and sum
  softmax_v4   online softmax: one pass for (max, sum), one pass to write
"""

import math

from numba import cuda, float32

from cudabook.compile import load_module

common = load_module("common")           # tree_sum / tree_max, the twins of common.cuh's

TPB = 128
NEG_INF = float32(-math.inf)


@cuda.jit
def softmax_v1(x, y):
    # launch: [ceil_div(M, 128), 128]
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    N = x.shape[1]
    m = NEG_INF
    for j in range(N):
        m = max(m, x[r, j])
    if m == NEG_INF:
        m = float32(0)                       # a row of -inf: write zeros, not NaN
    d = float32(0)
    for j in range(N):
        d += math.exp(x[r, j] - m)
    inv = float32(1) / d if d > 0 else float32(0)
    for j in range(N):
        y[r, j] = math.exp(x[r, j] - m) * inv


@cuda.jit
def softmax_v2(x, y):
    # launch: [M, TPB]
    s = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    N = x.shape[1]
    m = NEG_INF
    for j in range(tid, N, TPB):
        m = max(m, x[r, j])
    s[tid] = m
    m = common.tree_max(s, tid)              # common.py, the twin of common.cuh's block_max
    if m == NEG_INF:
        m = float32(0)
    d = float32(0)
    for j in range(tid, N, TPB):
        d += math.exp(x[r, j] - m)
    s[tid] = d
    d = common.tree_sum(s, tid)
    inv = float32(1) / d if d > 0 else float32(0)
    for j in range(tid, N, TPB):
        y[r, j] = math.exp(x[r, j] - m) * inv


@cuda.jit(device=True, inline=True)
def merge(m, d, m2, d2):
    """Combine two running (max, sum) pairs."""
    mn = max(m, m2)
    if mn == NEG_INF:
        return m, d
    return mn, d * math.exp(m - mn) + d2 * math.exp(m2 - mn)


@cuda.jit
def softmax_v4(x, y):
    # launch: [M, TPB]
    sm = cuda.shared.array(TPB, float32)
    sd = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    N = x.shape[1]
    m, d = NEG_INF, float32(0)
    for j in range(tid, N, TPB):             # one pass: running max and rescaled sum
        v = x[r, j]
        if v > m:
            d = d * math.exp(m - v) + float32(1)
            m = v
        elif v != NEG_INF:
            d += math.exp(v - m)
    sm[tid], sd[tid] = m, d
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            sm[tid], sd[tid] = merge(sm[tid], sd[tid], sm[tid + stride], sd[tid + stride])
        cuda.syncthreads()
        stride //= 2
    m, d = sm[0], sd[0]
    if m == NEG_INF:
        m = float32(0)
    inv = float32(1) / d if d > 0 else float32(0)
    for j in range(tid, N, TPB):
        y[r, j] = math.exp(x[r, j] - m) * inv
