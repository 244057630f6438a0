"""Numba twins of kernels/vector_add.cu: z = x + y for float32 vectors (Chapter 1).

versions
  vector_add_v1  one thread per element, guarded; grid = ceil(n / block)
  vector_add_v2  grid-stride loop; any grid covers any n
  who_am_i       records blockIdx.x and threadIdx.x per element, for the lesson's figure
"""

from numba import cuda


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
def who_am_i(block_of, thread_of):
    # launch: [ceil_div(n, threads), threads]
    i = cuda.grid(1)
    if i < block_of.size:
        block_of[i] = cuda.blockIdx.x
        thread_of[i] = cuda.threadIdx.x
