"""Numba twin of kernels/bias_grad.cu: db[j] = sum over rows of dz[:, j].

versions
  bias_grad_v1   one thread per column walks the rows (coalesced across the warp)
"""

from numba import cuda


@cuda.jit
def bias_grad_v1(dz, db):
    # launch: [ceil_div(N, 256), 256]; dz (M, N), db (N,)
    j = cuda.grid(1)
    if j < dz.shape[1]:
        s = 0.0
        for i in range(dz.shape[0]):
            s += dz[i, j]
        db[j] = s
