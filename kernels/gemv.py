"""Numba twins of kernels/gemv.cu (Chapter 10): y = x @ W^T for a few rows of x, float32 here.

  gemv_v1              one thread per output y[b, n] looping over K (gemv.cu's gemv_v1):
                       neighbouring threads read rows K elements apart (uncoalesced)
  gemv_block_per_row   one block of TPB threads per (row n, batch row b): threads stride over K
                       (coalesced) and the block sums in shared memory with a tree. gemv.cu's
                       v2-v4 reduce with warp shuffles instead, which the simulator lacks

Launch: gemv_v1 [(ceil(N / 128), B), 128]; gemv_block_per_row [(N, B), TPB].
"""

from numba import cuda, float32

TPB = 128


@cuda.jit
def gemv_v1(x, W, y):
    # x (B, K), W (N, K), y (B, N) float32
    n = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if n >= W.shape[0] or b >= x.shape[0]:
        return
    acc = float32(0)
    for k in range(W.shape[1]):
        acc += W[n, k] * x[b, k]
    y[b, n] = acc


@cuda.jit
def gemv_block_per_row(x, W, y):
    part = cuda.shared.array(TPB, float32)
    n = cuda.blockIdx.x
    b = cuda.blockIdx.y
    t = cuda.threadIdx.x
    acc = float32(0)
    for k in range(t, W.shape[1], TPB):      # thread t reads k = t, t + TPB, ...: coalesced
        acc += W[n, k] * x[b, k]
    part[t] = acc
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:                              # tree: TPB -> 1
        if t < s:
            part[t] += part[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        y[b, n] = part[0]
