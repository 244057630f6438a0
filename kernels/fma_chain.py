"""Numba twin of kernels/fma_chain.cu, the roofline probe (Chapter 2).

  fma_chain  y = x after k steps of v = v * a + b (2 k flops per 8 bytes)
"""

from numba import cuda


@cuda.jit
def fma_chain(x, y, k, a, b):
    # launch: [8 * SMs, 256]; a and b must be float32 scalars (numpy.float32)
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        for _ in range(k):
            v = v * a + b
        y[i] = v
