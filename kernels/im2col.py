"""Numba twins of kernels/im2col.cu: a convolution's patches as matrix rows, and the gradient.

x is NHWC (B, H, W, C); a K x K filter, stride 1, zero padding ``pad``; Ho = H + 2 pad - K + 1,
Wo = W + 2 pad - K + 1; cols (B Ho Wo, K K C) with column (a, e, c) = a K C + e C + c.

versions
  im2col_v1   one thread per cols element
  col2im_v1   one thread per dx element, gathering its K*K terms (no atomics, deterministic)
"""

from numba import cuda


@cuda.jit
def im2col_v1(x, cols, K, pad):
    # launch: [ceil_div(cols.size, 256), 256]; x (B, H, W, C), cols (B*Ho*Wo, K*K*C)
    t = cuda.grid(1)
    B, H, W, C = x.shape
    n_rows, KC = cols.shape
    if t >= n_rows * KC:
        return
    Wo = W + 2 * pad - K + 1
    Ho = H + 2 * pad - K + 1
    row, col = t // KC, t % KC
    j, i, b = row % Wo, (row // Wo) % Ho, row // (Ho * Wo)
    c, e, a = col % C, (col // C) % K, col // (C * K)
    h, w = i + a - pad, j + e - pad
    if 0 <= h < H and 0 <= w < W:
        cols[row, col] = x[b, h, w, c]
    else:
        cols[row, col] = 0                     # the zero border


@cuda.jit
def col2im_v1(dcols, dx, K, pad):
    # launch: [ceil_div(dx.size, 256), 256]; dcols (B*Ho*Wo, K*K*C), dx (B, H, W, C)
    t = cuda.grid(1)
    B, H, W, C = dx.shape
    if t >= B * H * W * C:
        return
    Wo = W + 2 * pad - K + 1
    Ho = H + 2 * pad - K + 1
    c, p = t % C, t // C
    w, h, b = p % W, (p // W) % H, p // (H * W)
    s = 0.0
    for a in range(K):
        i = h - a + pad                        # the output row whose patch row a holds x row h
        if 0 <= i < Ho:
            for e in range(K):
                j = w - e + pad
                if 0 <= j < Wo:
                    s += dcols[(b * Ho + i) * Wo + j, (a * K + e) * C + c]
    dx[b, h, w, c] = s
