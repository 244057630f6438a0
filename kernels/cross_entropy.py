"""Numba twin of kernels/cross_entropy.cu: softmax cross-entropy, forward and backward fused.

versions
  cross_entropy_thread_per_row   one thread per row (the CUDA C++ cross_entropy_v1 gives each
                                 row a warp): max, sum of exp, the row's loss added to loss[0]
                                 with an atomic, then the row's gradient; any float dtype;
                                 a label outside [0, C) gives a NaN loss and NaN gradient row
"""

import math

from numba import cuda


@cuda.jit
def cross_entropy_thread_per_row(z, labels, loss, dz, scale):
    # launch: [ceil_div(M, 64), 64]; z, dz (M, C); labels (M,) int; loss (1,), zeroed before
    r = cuda.grid(1)
    if r >= z.shape[0]:
        return
    C = z.shape[1]
    m = z[r, 0]
    for j in range(1, C):
        m = max(m, z[r, j])
    s = 0.0
    for j in range(C):
        s += math.exp(z[r, j] - m)
    y = labels[r]
    if y < 0 or y >= C:          # a bad label: NaN loss and gradient (z[r, -1] would wrap)
        cuda.atomic.add(loss, 0, math.nan)
        for j in range(C):
            dz[r, j] = math.nan
        return
    cuda.atomic.add(loss, 0, scale * (math.log(s) + m - z[r, y]))
    for j in range(C):
        p = math.exp(z[r, j] - m) / s
        dz[r, j] = scale * (p - (1.0 if j == y else 0.0))
