"""Numba twins of kernels/copy.cu: y = x for float32 vectors, and the coalescing probes
(Chapter 2).

versions
  copy_v1       one thread per element, guarded; grid = ceil(n / block)
  copy_v2       grid-stride loop; any grid covers any n
  copy_unroll4  4 elements per thread per step, blockDim apart (loads first, then stores);
                Numba has no float4 load, so this is not CUDA's copy_v3/copy_v4 but its own way
                to keep more loads in flight than copy_v2
  copy_strided  y[i] = x[i * stride]
  copy_offset   y[i] = x[i + offset]
"""

from numba import cuda

UNROLL = 4


@cuda.jit
def copy_v1(x, y):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)
    if i < y.size:
        y[i] = x[i]


@cuda.jit
def copy_v2(x, y):
    # launch: [8 * SMs, 256]; any grid size works
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = x[i]


@cuda.jit
def copy_unroll4(x, y):
    # launch: [ceil_div(n, 4 * 256), 256] (or fewer); 4 elements per thread per step
    n = y.size
    chunk = cuda.blockDim.x * UNROLL
    base = cuda.blockIdx.x * chunk
    while base < n:
        i0 = base + cuda.threadIdx.x
        i1 = i0 + cuda.blockDim.x
        i2 = i1 + cuda.blockDim.x
        i3 = i2 + cuda.blockDim.x
        # all loads first (independent, so they are in flight together), then the stores
        a0 = x[i0] if i0 < n else 0.0
        a1 = x[i1] if i1 < n else 0.0
        a2 = x[i2] if i2 < n else 0.0
        a3 = x[i3] if i3 < n else 0.0
        if i0 < n:
            y[i0] = a0
        if i1 < n:
            y[i1] = a1
        if i2 < n:
            y[i2] = a2
        if i3 < n:
            y[i3] = a3
        base += cuda.gridDim.x * chunk


@cuda.jit
def copy_strided(x, y, stride):
    # launch: [ceil_div(n, 256), 256]; x.size >= (n - 1) * stride + 1
    i = cuda.grid(1)
    if i < y.size:
        y[i] = x[i * stride]


@cuda.jit
def copy_offset(x, y, offset):
    # launch: [ceil_div(n, 256), 256]; x.size >= n + offset
    i = cuda.grid(1)
    if i < y.size:
        y[i] = x[i + offset]
