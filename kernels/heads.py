"""Numba twins of kernels/heads.cu: rows (B*T, P*H*D) <-> P head arrays (B*H, T, D), for 16-bit
elements held as uint16 bit patterns (NumPy has no bfloat16, and the copy only moves bits).
The P head arrays are one stacked array ys (P, B*H, T, D) here (the CUDA kernels take P
pointers): ys[p, b*H + h, t, d] = x[b*T + t, p*H*D + h*D + d].

versions
  heads_split_chunk8  heads_split_v1's map (a thread per 8-element chunk of x, in x's order),
                      the chunk copied element by element: Numba has no 16-byte vectors
  heads_merge_chunk8  heads_merge_v1's map, likewise
Both: block (64,) or any, grid ceil_div(B*T*P*H*D / 8, block); D a multiple of 8.
"""

from numba import cuda


@cuda.jit(device=True)
def _where(i, W, T, H, D):
    """(m, col, p, head row b*H + h, t, d) of chunk i of the rows layout (W chunks per row)."""
    m = i // W                      # row b*T + t
    col = (i - m * W) * 8           # column p*H*D + h*D + d
    HD = H * D
    p = col // HD
    hd = col - p * HD
    h = hd // D
    d = hd - h * D
    b = m // T
    t = m - b * T
    return m, col, p, b * H + h, t, d


@cuda.jit
def heads_split_chunk8(x, ys, T, H):
    D = ys.shape[3]
    W = x.shape[1] // 8
    i = cuda.grid(1)
    if i < x.shape[0] * W:
        m, col, p, bh, t, d = _where(i, W, T, H, D)
        for q in range(8):
            ys[p, bh, t, d + q] = x[m, col + q]


@cuda.jit
def heads_merge_chunk8(ys, x, T, H):
    D = ys.shape[3]
    W = x.shape[1] // 8
    i = cuda.grid(1)
    if i < x.shape[0] * W:
        m, col, p, bh, t, d = _where(i, W, T, H, D)
        for q in range(8):
            x[m, col + q] = ys[p, bh, t, d + q]
