// thin_matmul.cu: float32 products where one dimension is tiny (N = 1..16), Chapter 6.
//
// The last layer of a classifier has N = 10 outputs. Its three products in a training step:
//   forward   logits[M, N] = a[M, K] @ W[K, N]        thin_nn:  C[M, N] = A[M, K] @ B[K, N]
//   backward  dW[K, N]     = a[M, K]^T @ dz[M, N]     thin_tn:  C[K, N] = A[M, K]^T @ G[M, N]
//   backward  da[M, K]     = dz[M, N] @ W[K, N]^T     thin_nt:  C[M, K] = G[M, N] @ W[K, N]^T
// All row-major and contiguous. Chapter 4's 128 x 128 (or 256 x 128) block tile computes 118 of
// every 128 columns for nothing when N = 10, and thin_tn would need a transposed copy of A. The
// kernels here touch the large matrix once at full width: at M = K = 4096 that is 64 MiB (read
// by nn and tn, written by nt), about 22 us at 3 TB/s, for 0.34 GFLOP (2 M N K) of arithmetic.
// The small operands (K x N, M x N: 160 KiB at N = 10) stay in L1/L2.
//
// kernels (N is a template parameter; extern "C" names carry it: thin_nn_n10, ...; -DTHIN_N)
//   thin_nn_n{N}    a warp per THIN_NN_ROWS rows of A. Lane l reads float4 l, l + 32, ... of each
//                   row, and the 4 x N block of B under that float4 (4N consecutive floats: N
//                   float4 loads, coalesced across the warp, from L1 after the first warp), which
//                   it uses for all THIN_NN_ROWS rows; a warp_sum per output at the end.
//   thin_tn_n{N}    a thread per 4 columns of A walks down the rows, adding a[m, k..k+3] times
//                   g[m, 0..N-1] (the same g for the whole warp: a broadcast load); the block's
//                   warps split the rows and add their sums in shared memory. blockIdx.y splits
//                   M into slices whose partial results go to a workspace P[S, K, N], summed by
//                   thin_tn_reduce (with one slice the kernel writes C directly). No atomics: the
//                   result is the same on every run.
//   thin_tn_reduce  C[i] = sum over s of P[s, i], i < K N
//   thin_nt_n{N}    a thread per 4 columns k keeps W[k..k+3, 0..N-1] in registers (N float4) and
//                   writes THIN_NT_ROWS rows of C, one float4 store each.
//
// Numba twins (kernels/thin_matmul.py): the same three products, one thread per output.
//
// Assumptions (kernels/thin_matmul_launch.py checks them and refuses otherwise): K % 4 == 0,
// every float4 operand 16-byte aligned (A and B of nn, A of tn, W and C of nt), 1 <= N <= 16.
// Offsets are computed in size_t.
#include "common.cuh"

#define THIN_NN_ROWS 4      // rows of A per warp in thin_nn (B's registers reused 4 times)
#define THIN_TN_WARPS 4     // warps per block in thin_tn (they split the rows)
#define THIN_NT_ROWS 32     // rows of C per thread in thin_nt (W's registers reused 32 times)

// component i (0..3) of v; i is a compile-time constant after unrolling
__device__ __forceinline__ float thin_comp(const float4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// element e of the 4N floats held as N float4
template <int N>
__device__ __forceinline__ float thin_elem(const float4 (&v)[N], int e) {
    return thin_comp(v[e >> 2], e & 3);
}

// ------------------------------------------------------------------------------------ thin_nn
// launch: block 256 (8 warps), grid ceil(M / (8 * THIN_NN_ROWS)); no shared memory
template <int N>
__device__ __forceinline__ void thin_nn_body(const float* __restrict__ A,
                                             const float* __restrict__ B, float* __restrict__ C,
                                             int M, int K) {
    const int lane = threadIdx.x & 31;
    const int m0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * THIN_NN_ROWS;
    if (m0 >= M) return;                                    // the whole warp leaves together
    float acc[THIN_NN_ROWS][N];
#pragma unroll
    for (int r = 0; r < THIN_NN_ROWS; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[r][n] = 0.0f;
    const int K4 = K >> 2;
#pragma unroll 2
    for (int c = lane; c < K4; c += 32) {                   // float4 c of each row: k = 4c..4c+3
        float4 a[THIN_NN_ROWS];
#pragma unroll
        for (int r = 0; r < THIN_NN_ROWS; ++r) {
            a[r] = make_float4(0.f, 0.f, 0.f, 0.f);         // rows past M add zeros
            if (m0 + r < M)
                a[r] = __ldcs(reinterpret_cast<const float4*>(A + (size_t)(m0 + r) * K) + c);
        }
        float4 b[N];                                        // B[4c + j, n] = element j N + n
        const float4* bp = reinterpret_cast<const float4*>(B + (size_t)c * 4 * N);
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] = __ldg(bp + i);
#pragma unroll
        for (int r = 0; r < THIN_NN_ROWS; ++r)
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float s = acc[r][n];
                s = fmaf(a[r].x, thin_elem<N>(b, n), s);
                s = fmaf(a[r].y, thin_elem<N>(b, N + n), s);
                s = fmaf(a[r].z, thin_elem<N>(b, 2 * N + n), s);
                s = fmaf(a[r].w, thin_elem<N>(b, 3 * N + n), s);
                acc[r][n] = s;
            }
    }
#pragma unroll
    for (int r = 0; r < THIN_NN_ROWS; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float s = warp_sum(acc[r][n]);
            if (lane == 0 && m0 + r < M) C[(size_t)(m0 + r) * N + n] = s;
        }
}

// ------------------------------------------------------------------------------------ thin_tn
// launch: block (32, THIN_TN_WARPS), grid (ceil(K / 128), S); rows [y * rows, (y + 1) * rows)
// of A go to slice y; P is C itself when S == 1, else the workspace (S, K, N).
// static shared memory: THIN_TN_WARPS * N * 4 * 32 floats (2 KiB per unit of N)
template <int N>
__device__ __forceinline__ void thin_tn_body(const float* __restrict__ A,
                                             const float* __restrict__ G, float* __restrict__ P,
                                             int M, int K, int rows) {
    __shared__ float part[THIN_TN_WARPS][N][4][32];         // [warp][n][j][lane]: lanes adjacent
    const int lane = threadIdx.x, w = threadIdx.y;
    const int kb = blockIdx.x * 128;                        // the block's 128 columns
    const int k = kb + 4 * lane;                            // this thread's 4 columns
    const int m_end = min(M, (blockIdx.y + 1) * rows);
    float acc[4][N];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[j][n] = 0.0f;
    if (k < K) {                                            // K % 4 == 0: all 4 in, or all out
#pragma unroll 4
        for (int m = blockIdx.y * rows + w; m < m_end; m += THIN_TN_WARPS) {
            float4 a = __ldcs(reinterpret_cast<const float4*>(A + (size_t)m * K + k));
            const float* g = G + (size_t)m * N;             // one row of G, the same for the warp
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float gn = __ldg(g + n);
                acc[0][n] = fmaf(a.x, gn, acc[0][n]);
                acc[1][n] = fmaf(a.y, gn, acc[1][n]);
                acc[2][n] = fmaf(a.z, gn, acc[2][n]);
                acc[3][n] = fmaf(a.w, gn, acc[3][n]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int n = 0; n < N; ++n) part[w][n][j][lane] = acc[j][n];
    __syncthreads();                                        // every warp's sums are written
    // the block's output is rows kb..kb+127 of the K x N result: 128 N consecutive floats
    float* out = P + (size_t)blockIdx.y * K * N + (size_t)kb * N;
    const int t = w * 32 + lane;
    for (int e = t; e < 128 * N; e += 32 * THIN_TN_WARPS) { // coalesced stores
        int row = e / N, n = e - row * N;
        if (kb + row >= K) break;                           // e grows with row: the rest is out
        float s = 0.0f;
#pragma unroll
        for (int ww = 0; ww < THIN_TN_WARPS; ++ww) s += part[ww][n][row & 3][row >> 2];
        out[e] = s;
    }
}

// launch: block 256, grid ceil(total / 256); total = K N, P is (S, K N)
extern "C" __global__ void thin_tn_reduce(const float* __restrict__ P, float* __restrict__ C,
                                          int S, int total) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float s = 0.0f;
    for (int y = 0; y < S; ++y) s += P[(size_t)y * total + i];   // slices in order: deterministic
    C[i] = s;
}

// ------------------------------------------------------------------------------------ thin_nt
// launch: block 128, grid (ceil(K / 512), ceil(M / THIN_NT_ROWS)); no shared memory
template <int N>
__device__ __forceinline__ void thin_nt_body(const float* __restrict__ G,
                                             const float* __restrict__ W, float* __restrict__ C,
                                             int M, int K) {
    const int k = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (k >= K) return;
    float4 wv[N];                                           // W[k + j, n] = element j N + n
    const float4* wp = reinterpret_cast<const float4*>(W + (size_t)k * N);
#pragma unroll
    for (int i = 0; i < N; ++i) wv[i] = __ldg(wp + i);
    const int m0 = blockIdx.y * THIN_NT_ROWS;
#pragma unroll 4
    for (int r = 0; r < THIN_NT_ROWS; ++r) {
        const int m = m0 + r;
        if (m >= M) break;
        const float* g = G + (size_t)m * N;                 // broadcast to the warp
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float gn = __ldg(g + n);
            o.x = fmaf(gn, thin_elem<N>(wv, n), o.x);
            o.y = fmaf(gn, thin_elem<N>(wv, N + n), o.y);
            o.z = fmaf(gn, thin_elem<N>(wv, 2 * N + n), o.z);
            o.w = fmaf(gn, thin_elem<N>(wv, 3 * N + n), o.w);
        }
        __stcs(reinterpret_cast<float4*>(C + (size_t)m * K + k), o);   // written once: streaming
    }
}

// ------------------------------------------------------------------------------------ names
#define THIN_INSTANTIATE(N)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) thin_nn_n##N(                              \
        const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M,  \
        int K) { thin_nn_body<N>(A, B, C, M, K); }                                               \
    extern "C" __global__ void __launch_bounds__(32 * THIN_TN_WARPS) thin_tn_n##N(               \
        const float* __restrict__ A, const float* __restrict__ G, float* __restrict__ P, int M,  \
        int K, int rows) { thin_tn_body<N>(A, G, P, M, K, rows); }                               \
    extern "C" __global__ void __launch_bounds__(128) thin_nt_n##N(                              \
        const float* __restrict__ G, const float* __restrict__ W, float* __restrict__ C, int M,  \
        int K) { thin_nt_body<N>(G, W, C, M, K); }

// -DTHIN_N=n compiles the three kernels for that n alone (what the launcher does, one module per
// n, cached); without it the file builds n = 1, 10 and 16 (the CI compile of every kernel file).
#define THIN_INSTANTIATE_VALUE(N) THIN_INSTANTIATE(N)   // expands THIN_N before ## pastes it
#ifdef THIN_N
THIN_INSTANTIATE_VALUE(THIN_N)
#else
THIN_INSTANTIATE(1)
THIN_INSTANTIATE(10)
THIN_INSTANTIATE(16)
#endif
