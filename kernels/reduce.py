"""Numba twins of kernels/reduce.cu: the reduction ladder, sum and max (Chapter 3).

versions (block size TPB = 256 for v1-v3, fixed at compile time by the shared arrays)
  reduce_v1      shared-memory tree, interleaved addressing; one partial per block
  reduce_v2      sequential addressing
  reduce_v3      first add during load (grid = ceil_div(n, 2 * TPB))
  reduce_v4      warp shuffles for the last 32 partials (GPU only: the simulator has no shuffles)
  reduce_atomic_tree      grid-stride loop, shared-memory tree, one atomic add per block into
                         out[0] (CUDA's reduce_v5 adds float4 loads and a shuffle reduction:
                         a different kernel, hence the name)
  reduce_max_atomic_tree the same for the maximum (cuda.atomic.max; out[0] = -inf first)
"""

import math

from numba import cuda, float32

TPB = 256
NEG_INF = float32(-math.inf)


@cuda.jit
def reduce_v1(x, partial):
    # launch: [ceil_div(n, TPB), TPB]
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s[tid] = x[i] if i < x.size else float32(0)   # 0 past the end: the last block is partial
    cuda.syncthreads()
    stride = 1
    while stride < TPB:
        if tid % (2 * stride) == 0:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride *= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


@cuda.jit
def reduce_v2(x, partial):
    # launch: [ceil_div(n, TPB), TPB]
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    s[tid] = x[i] if i < x.size else float32(0)
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


@cuda.jit
def reduce_v3(x, partial):
    # launch: [ceil_div(n, 2 * TPB), TPB]
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * 2 * TPB + tid
    v = x[i] if i < x.size else float32(0)
    if i + TPB < x.size:
        v += x[i + TPB]                              # the first level, in registers
    s[tid] = v
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = s[0]


@cuda.jit
def reduce_v4(x, partial):
    # launch: [ceil_div(n, 2 * TPB), TPB]; GPU only (warp shuffles)
    warp_sums = cuda.shared.array(32, float32)
    tid = cuda.threadIdx.x
    lane, warp = tid % 32, tid // 32
    i = cuda.blockIdx.x * 2 * TPB + tid
    v = x[i] if i < x.size else float32(0)
    if i + TPB < x.size:
        v += x[i + TPB]
    o = 16
    while o > 0:
        v += cuda.shfl_down_sync(0xFFFFFFFF, v, o)
        o //= 2
    if lane == 0:
        warp_sums[warp] = v
    cuda.syncthreads()
    if warp == 0:
        v = warp_sums[lane] if lane < TPB // 32 else float32(0)
        o = 16
        while o > 0:
            v += cuda.shfl_down_sync(0xFFFFFFFF, v, o)
            o //= 2
        if lane == 0:
            partial[cuda.blockIdx.x] = v


@cuda.jit
def reduce_atomic_tree(x, out):
    # launch: [a few blocks per SM, TPB]; out[0] = 0 before the launch
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    acc = float32(0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):   # grid-stride loop
        acc += x[i]
    s[tid] = acc
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        cuda.atomic.add(out, 0, s[0])                # one atomic per block


@cuda.jit
def reduce_max_atomic_tree(x, out):
    # launch: as reduce_atomic_tree; out[0] = -inf before the launch
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    m = NEG_INF
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        m = max(m, x[i])
    s[tid] = m
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if tid < stride:
            s[tid] = max(s[tid], s[tid + stride])
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        cuda.atomic.max(out, 0, s[0])
