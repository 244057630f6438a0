"""Numba twins of kernels/vector_add.cu: z = x + y for float32 vectors (Chapters 1 and 2).

versions
  vector_add_v1       one thread per element, guarded; grid = ceil(n / block)
  vector_add_v2       grid-stride loop; any grid covers any n
  vector_add_unroll4  4 elements per thread per step, blockDim apart (Numba has no float4, so
                      this is not CUDA's vector_add_v3/v4)
  who_am_i       records blockIdx.x and threadIdx.x per element, for the lesson's figure
  add            a checked launcher: validates dtypes, shapes and devices, then launches a version
"""

import numpy as np
from numba import cuda

import cudabook as cb

UNROLL = 4


@cuda.jit
def vector_add_v1(x, y, z):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)                 # blockIdx.x * blockDim.x + threadIdx.x
    if i < z.size:                   # the last block may run past the end
        z[i] = x[i] + y[i]


@cuda.jit
def vector_add_v2(x, y, z):
    # launch: [4 * SMs, 256]; any grid size works
    start = cuda.grid(1)
    stride = cuda.gridsize(1)        # gridDim.x * blockDim.x
    for i in range(start, z.size, stride):
        z[i] = x[i] + y[i]


@cuda.jit
def vector_add_unroll4(x, y, z):
    # launch: [ceil_div(n, 4 * 256), 256] (or fewer); 4 elements per thread per step, blockDim.x
    # apart (all loads first, then the stores): Numba has no float4, so this is its way to keep
    # more loads in flight than vector_add_v2, and a different kernel from CUDA vector_add_v4
    n = z.size
    chunk = cuda.blockDim.x * UNROLL
    base = cuda.blockIdx.x * chunk
    while base < n:
        i0 = base + cuda.threadIdx.x
        i1 = i0 + cuda.blockDim.x
        i2 = i1 + cuda.blockDim.x
        i3 = i2 + cuda.blockDim.x
        a0 = x[i0] + y[i0] if i0 < n else 0.0
        a1 = x[i1] + y[i1] if i1 < n else 0.0
        a2 = x[i2] + y[i2] if i2 < n else 0.0
        a3 = x[i3] + y[i3] if i3 < n else 0.0
        if i0 < n:
            z[i0] = a0
        if i1 < n:
            z[i1] = a1
        if i2 < n:
            z[i2] = a2
        if i3 < n:
            z[i3] = a3
        base += cuda.gridDim.x * chunk


@cuda.jit
def who_am_i(block_of, thread_of):
    # launch: [ceil_div(n, threads), threads]
    i = cuda.grid(1)
    if i < block_of.size:
        block_of[i] = cuda.blockIdx.x
        thread_of[i] = cuda.threadIdx.x


def add(x, y, z, version=1, threads=256):
    """z = x + y with the Numba version ``version``, after checking the arguments."""
    for name, a in (("x", x), ("y", y), ("z", z)):
        cb.expect(a, name, dtype=np.float32, ndim=1)
    if not (x.shape == y.shape == z.shape):
        raise ValueError(f"x, y and z must have one shape, got {x.shape}, {y.shape}, {z.shape}")
    if version == 1:
        vector_add_v1[cb.ceil_div(z.shape[0], threads), threads](x, y, z)
    elif version == 2:
        vector_add_v2[4 * max(cb.env.info().sms, 1), threads](x, y, z)
    else:
        raise ValueError(f"vector_add has versions 1 and 2, not {version}")
