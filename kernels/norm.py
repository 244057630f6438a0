"""Numba twins of kernels/norm.cu: LayerNorm and RMSNorm forward, float32 (M, N) (Chapter 3).

versions (TPB = 128 threads per block for the block-per-row kernels)
  layernorm_v1  one thread per row, two-pass statistics, then the affine write
  layernorm_v2  one block per row, Welford per thread merged in a shared-memory tree (Chan),
                then one fused normalise + affine pass
  rmsnorm_v1    RMSNorm, one block per row
"""

import math

from numba import cuda, float32

from cudabook.compile import load_module

common = load_module("common")           # tree_sum, the twin of common.cuh's block_sum

TPB = 128


@cuda.jit
def layernorm_v1(x, gamma, beta, eps, y):
    # launch: [ceil_div(M, 128), 128]
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    N = x.shape[1]
    s = float32(0)
    for j in range(N):
        s += x[r, j]
    mean = s / N
    q = float32(0)
    for j in range(N):
        c = x[r, j] - mean
        q += c * c
    rstd = float32(1) / math.sqrt(q / N + eps)
    for j in range(N):
        y[r, j] = (x[r, j] - mean) * rstd * gamma[j] + beta[j]


@cuda.jit
def layernorm_v2(x, gamma, beta, eps, y):
    # launch: [M, TPB]
    sn = cuda.shared.array(TPB, float32)
    smean = cuda.shared.array(TPB, float32)
    sm2 = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    N = x.shape[1]
    n, mean, m2 = float32(0), float32(0), float32(0)
    for j in range(tid, N, TPB):             # Welford: one pass, numerically stable
        v = x[r, j]
        n += float32(1)
        delta = v - mean
        mean += delta / n
        m2 += delta * (v - mean)
    sn[tid], smean[tid], sm2[tid] = n, mean, m2
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:                     # Chan et al.: merge two (n, mean, M2)
            na, nb = sn[tid], sn[tid + stride]
            nt = na + nb
            if nt > 0:
                delta = smean[tid + stride] - smean[tid]
                smean[tid] = smean[tid] + delta * nb / nt
                sm2[tid] = sm2[tid] + sm2[tid + stride] + delta * delta * na * nb / nt
                sn[tid] = nt
        cuda.syncthreads()
        stride //= 2
    mean = smean[0]
    rstd = float32(1) / math.sqrt(sm2[0] / N + eps)
    for j in range(tid, N, TPB):             # fused: normalise and affine in one pass
        y[r, j] = (x[r, j] - mean) * rstd * gamma[j] + beta[j]


@cuda.jit
def rmsnorm_v1(x, gamma, eps, y):
    # launch: [M, TPB]
    s = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    N = x.shape[1]
    q = float32(0)
    for j in range(tid, N, TPB):
        q += x[r, j] * x[r, j]
    s[tid] = q
    rrms = float32(1) / math.sqrt(common.tree_sum(s, tid) / N + eps)   # common.py's block sum
    for j in range(tid, N, TPB):
        y[r, j] = x[r, j] * rrms * gamma[j]
