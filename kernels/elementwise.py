"""Numba twins of kernels/elementwise.cu: z = x + y for float32 vectors, and the roofline
probe (Chapter 2).

versions
  add_v1     one thread per element, guarded
  add_v2     grid-stride loop
  add_v4     4 elements per thread per step, blockDim apart (Numba has no float4 load)
  fma_chain  y = x after k steps of v = v * a + b (2 k flops per 8 bytes)
"""

from numba import cuda

UNROLL = 4


@cuda.jit
def add_v1(x, y, z):
    # launch: [ceil_div(n, 256), 256]
    i = cuda.grid(1)
    if i < z.size:
        z[i] = x[i] + y[i]


@cuda.jit
def add_v2(x, y, z):
    # launch: [8 * SMs, 256]
    for i in range(cuda.grid(1), z.size, cuda.gridsize(1)):
        z[i] = x[i] + y[i]


@cuda.jit
def add_v4(x, y, z):
    # launch: [ceil_div(n, 4 * 256), 256] (or fewer)
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
def fma_chain(x, y, k, a, b):
    # launch: [8 * SMs, 256]; a and b must be float32 scalars (numpy.float32)
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        for _ in range(k):
            v = v * a + b
        y[i] = v
