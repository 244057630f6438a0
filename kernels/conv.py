"""Numba twins of kernels/conv.cu: direct "same" convolution with zero padding (Chapter 3).

Cross-correlation as in torch (the filter is not flipped); K odd, pad = K // 2.

versions
  conv1d_v1          1D direct, one thread per output
  conv2d_v1          2D direct, one thread per output pixel
  conv2d_v2          shared-memory tile (TILE x TILE outputs) with a halo of K - 1
  make_conv2d_v3(w)  v2 with the filter in constant memory. Numba's constant arrays are fixed
                     when the kernel is compiled, so this builds one kernel per filter.
"""

from numba import cuda, float32

TILE = 16
MAX_K = 7
SIDE = TILE + MAX_K - 1


@cuda.jit
def conv1d_v1(x, w, y):
    # launch: [ceil_div(N, 256), 256]
    i = cuda.grid(1)
    N, K = x.size, w.size
    if i >= N:
        return
    pad = K // 2
    acc = float32(0)
    for k in range(K):
        j = i + k - pad
        if 0 <= j < N:                       # outside: zero padding
            acc += x[j] * w[k]
    y[i] = acc


@cuda.jit
def conv2d_v1(x, w, y):
    # launch: [(ceil_div(W, 16), ceil_div(H, 16)), (16, 16)]
    c, r = cuda.grid(2)
    H, W = x.shape
    K = w.shape[0]
    if r >= H or c >= W:
        return
    pad = K // 2
    acc = float32(0)
    for a in range(K):
        rr = r + a - pad
        if 0 <= rr < H:
            for b in range(K):
                cc = c + b - pad
                if 0 <= cc < W:
                    acc += x[rr, cc] * w[a, b]
    y[r, c] = acc


@cuda.jit(device=True, inline=True)
def _load_tile(x, tile, K):
    H, W = x.shape
    pad = K // 2
    side = TILE + K - 1
    r0 = cuda.blockIdx.y * TILE - pad
    c0 = cuda.blockIdx.x * TILE - pad
    t = cuda.threadIdx.y * TILE + cuda.threadIdx.x
    while t < side * side:                   # 256 threads load up to 22 * 22 cells
        i, j = t // side, t % side
        rr, cc = r0 + i, c0 + j
        if 0 <= rr < H and 0 <= cc < W:
            tile[i, j] = x[rr, cc]
        else:
            tile[i, j] = float32(0)          # the halo outside the image is zero padding
        t += TILE * TILE


@cuda.jit
def conv2d_v2(x, w, y):
    # launch: [(ceil_div(W, 16), ceil_div(H, 16)), (16, 16)]; K odd, K <= 7
    tile = cuda.shared.array((SIDE, SIDE), float32)
    K = w.shape[0]
    _load_tile(x, tile, K)
    cuda.syncthreads()
    H, W = x.shape
    c = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    r = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    if r < H and c < W:                      # no early return before the barrier
        acc = float32(0)
        for a in range(K):
            for b in range(K):
                acc += tile[cuda.threadIdx.y + a, cuda.threadIdx.x + b] * w[a, b]
        y[r, c] = acc


def make_conv2d_v3(w_host):
    """conv2d_v2 with the (K, K) numpy filter ``w_host`` baked into constant memory."""
    K = w_host.shape[0]
    w_const = w_host.astype("float32").copy()

    @cuda.jit
    def conv2d_v3(x, y):
        # launch: as conv2d_v2
        w = cuda.const.array_like(w_const)
        tile = cuda.shared.array((SIDE, SIDE), float32)
        _load_tile(x, tile, K)
        cuda.syncthreads()
        H, W = x.shape
        c = cuda.blockIdx.x * TILE + cuda.threadIdx.x
        r = cuda.blockIdx.y * TILE + cuda.threadIdx.y
        if r < H and c < W:
            acc = float32(0)
            for a in range(K):
                for b in range(K):
                    acc += tile[cuda.threadIdx.y + a, cuda.threadIdx.x + b] * w[a, b]
            y[r, c] = acc

    return conv2d_v3
