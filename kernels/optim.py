"""Numba twins of kernels/optim.cu: the SGD and AdamW updates.

versions
  sgd_v1         p -= lr (g + wd p), one thread per element
  adamw_scalar_step   AdamW, the step count t passed as a number (the CUDA C++ adamw_v1
                      reads t from device memory, for CUDA graphs)
"""

import math

from numba import cuda


@cuda.jit
def sgd_v1(p, g, lr, wd):
    # launch: [ceil_div(n, 256), 256]; p, g 1D
    i = cuda.grid(1)
    if i < p.size:
        p[i] -= lr * (g[i] + wd * p[i])


@cuda.jit
def adamw_scalar_step(p, g, m, v, lr, beta1, beta2, eps, wd, t):
    # launch: [ceil_div(n, 256), 256]; p, g, m, v 1D; t = 1 at the first step
    i = cuda.grid(1)
    if i < p.size:
        step_size = lr / (1.0 - beta1 ** t)
        bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
        gi = g[i]
        pi = p[i] * (1.0 - lr * wd)
        mi = m[i] + (1.0 - beta1) * (gi - m[i])
        vi = beta2 * v[i] + (1.0 - beta2) * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] = pi - step_size * (mi / (math.sqrt(vi) / bc2_sqrt + eps))
