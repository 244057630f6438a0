"""Numba twins of kernels/thin_matmul.cu's three products, one thread per output (the simple
form of each: the CUDA kernels' float4 loads, warp sums and row slices have no Numba
counterpart here, and these kernels are the reference for what each product computes).

kernels
  thin_nn_per_output   C[m, n] = sum_k A[m, k] B[k, n]   a thread per (m, n), looping over K
  thin_tn_per_output   C[k, n] = sum_m A[m, k] G[m, n]   a thread per (k, n), looping over M
  thin_nt_per_output   C[m, k] = sum_n G[m, n] W[k, n]   a thread per (m, k), looping over N
"""

from numba import cuda, float32


@cuda.jit
def thin_nn_per_output(A, B, C):
    # launch: [(ceil_div(M, 16), ceil_div(N, 16)), (16, 16)]; A (M, K), B (K, N), C (M, N)
    m, n = cuda.grid(2)
    if m < C.shape[0] and n < C.shape[1]:
        s = float32(0.0)
        for k in range(A.shape[1]):
            s += A[m, k] * B[k, n]
        C[m, n] = s


@cuda.jit
def thin_tn_per_output(A, G, C):
    # launch: [(ceil_div(K, 16), ceil_div(N, 16)), (16, 16)]; A (M, K), G (M, N), C (K, N)
    k, n = cuda.grid(2)
    if k < C.shape[0] and n < C.shape[1]:
        s = float32(0.0)
        for m in range(A.shape[0]):
            s += A[m, k] * G[m, n]
        C[k, n] = s


@cuda.jit
def thin_nt_per_output(G, W, C):
    # launch: [(ceil_div(M, 16), ceil_div(K, 16)), (16, 16)]; G (M, N), W (K, N), C (M, K)
    m, k = cuda.grid(2)
    if m < C.shape[0] and k < C.shape[1]:
        s = float32(0.0)
        for n in range(G.shape[1]):
            s += G[m, n] * W[k, n]
        C[m, k] = s
