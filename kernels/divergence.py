"""Numba twin of kernels/divergence.cu (Chapter 1).

  branch_split  two paths of k FMAs chosen by (threadIdx.x // width) % 2: width >= 32 keeps
                every warp on one path, width < 32 makes every warp run both (divergence)
"""

from numba import cuda


@cuda.jit(device=True)
def path_a(v, k, a, b):
    for _ in range(k):
        v = v * a + b
    return v


@cuda.jit(device=True)
def path_b(v, k, a, b):
    for _ in range(k):
        v = v * b + a
    return v


@cuda.jit
def branch_split(x, y, k, a, b, width):
    # launch: [ceil_div(n, 256), 256]; a and b float32 scalars (numpy.float32), width > 0
    i = cuda.grid(1)
    if i >= y.size:
        return
    v = x[i]
    if (cuda.threadIdx.x // width) % 2 == 0:
        v = path_a(v, k, a, b)
    else:
        v = path_b(v, k, a, b)
    y[i] = v
