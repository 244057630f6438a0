// gemv.cu: y = x @ W^T (+ bias) for a few rows of x: the decode step of a transformer.
//
//   x is (B, K) fp16, W is (N, K) fp16 (nn.Linear's weight layout), bias (N,) fp16 or null,
//   y is (B, N) fp16; all row-major and contiguous. Products are accumulated in fp32 and y is
//   rounded to fp16 once. B is small (1..32): each weight is used B times, so at B = 1 the
//   kernel reads 2NK bytes to do 2NK flops (1 flop per byte) and the memory bus decides the time.
//
//   gemv_v1   one thread per output y[b, n], looping over K: neighbouring threads read rows K
//             elements apart, so each warp load touches 32 different sectors (uncoalesced)
//   gemv_v2   one warp per output row, lanes stride over K (coalesced 2-byte loads), warp_sum;
//             any K, any alignment: the fallback of the launch helper
//   gemv_v3   one warp per weight row for all batch rows at once (W read once for up to 8 rows
//             of x), 16-byte loads, four in flight per lane, weights streamed past L1
//   gemv_v4   v3 with a block of 4 warps per R weight rows splitting K (a shared-memory sum at
//             the end): 4 chunks of each of the R rows in flight per thread, enough blocks to
//             fill every SM at N = 4096; x's 16 bytes loaded once and used for R rows
//
//   gemv_v3/v4 need K % 8 == 0 and 16-byte aligned x and W (the launcher checks, else v2).
//   Each is instantiated per batch tile BT (1, 2, 4, 8: rows of x per block, blockIdx.y picks
//   the tile) and v4 per rows-per-block R (2, 4): gemv_v3_b{BT}, gemv_v4_b{BT}_r{R}.
//
// Launches (kernels/gemv_launch.py, config()): v1 grid (ceil(N/128), B) x 128 threads; v2
// (ceil(N/4), B) x 128 (a warp per row); v3 (ceil(N/4), ceil(B/BT)) x 128; v4
// (ceil(N/R), ceil(B/BT)) x 128. No dynamic shared memory.
#include <cuda_fp16.h>
// common.cuh: dot8, warp_sum, ld_stream16
#include "common.cuh"

// ----------------------------------------------------------------------------- v1
extern "C" __global__ void gemv_v1(const __half* __restrict__ x, const __half* __restrict__ W,
                                   const __half* __restrict__ bias, __half* __restrict__ y,
                                   int B, int N, int K) {
    int n = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
    if (n >= N || b >= B) return;
    const __half* w = W + (size_t)n * K;          // this thread's row: K * 2 bytes from the next
    const __half* xb = x + (size_t)b * K;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += __half2float(w[k]) * __half2float(xb[k]);
    if (bias) acc += __half2float(bias[n]);
    y[(size_t)b * N + n] = __float2half_rn(acc);
}

// ----------------------------------------------------------------------------- v2
extern "C" __global__ void gemv_v2(const __half* __restrict__ x, const __half* __restrict__ W,
                                   const __half* __restrict__ bias, __half* __restrict__ y,
                                   int B, int N, int K) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), b = blockIdx.y;
    if (n >= N || b >= B) return;                 // a whole warp leaves together
    const __half* w = W + (size_t)n * K;
    const __half* xb = x + (size_t)b * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32)            // lane l reads w[l], w[l + 32], ...: coalesced
        acc += __half2float(w[k]) * __half2float(xb[k]);
    acc = warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += __half2float(bias[n]);
        y[(size_t)b * N + n] = __float2half_rn(acc);
    }
}

// ----------------------------------------------------------------------------- v3
// One warp per weight row n; the block's 4 warps take 4 consecutive rows. Lane l reads 16-byte
// chunks l, l + 32, ... of the row, four chunks in flight before any math.
template <int BT>
__device__ __forceinline__ void gemv_v3_body(const __half* __restrict__ x,
                                             const __half* __restrict__ W,
                                             const __half* __restrict__ bias,
                                             __half* __restrict__ y, int B, int N, int K) {
    constexpr int U = 4;                          // chunks in flight per lane
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * 4 + (threadIdx.x >> 5), b0 = blockIdx.y * BT;
    if (n >= N) return;
    int nb = min(BT, B - b0), nc = K >> 3;        // batch rows of this tile, chunks per row
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)n * K);
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)b0 * K);
    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.0f;
    int c = lane;
    for (; c + 32 * (U - 1) < nc; c += 32 * U) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) wv[u] = ld_stream16(w + c + 32 * u);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int b = 0; b < BT; ++b)
                if (b < nb) acc[b] = dot8(wv[u], __ldg(xv + (size_t)b * nc + c + 32 * u), acc[b]);
    }
    for (; c < nc; c += 32) {                     // the last < 4 chunks of this lane
        uint4 wv = ld_stream16(w + c);
#pragma unroll
        for (int b = 0; b < BT; ++b)
            if (b < nb) acc[b] = dot8(wv, __ldg(xv + (size_t)b * nc + c), acc[b]);
    }
    float bn = (bias && lane == 0) ? __half2float(bias[n]) : 0.0f;
#pragma unroll
    for (int b = 0; b < BT; ++b) {
        float s = warp_sum(acc[b]);
        if (lane == 0 && b < nb) y[(size_t)(b0 + b) * N + n] = __float2half_rn(s + bn);
    }
}

// ----------------------------------------------------------------------------- v4
// A block of 128 threads owns R consecutive weight rows; thread t reads chunks t, t + 128, ...
// of each of the R rows (U per row in flight), so a row is read by 4 warps at once. The partial
// sums meet in shared memory: each warp reduces with shuffles, then thread i < R * BT adds the
// 4 warps' values of output i.
template <int BT, int R>
__device__ __forceinline__ void gemv_v4_body(const __half* __restrict__ x,
                                             const __half* __restrict__ W,
                                             const __half* __restrict__ bias,
                                             __half* __restrict__ y, int B, int N, int K) {
    constexpr int T = 128, U = 4;                  // R * U loads of 16 bytes in flight
    __shared__ float part[4][R * BT];
    int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int n0 = blockIdx.x * R, b0 = blockIdx.y * BT;
    int nb = min(BT, B - b0), nr = min(R, N - n0), nc = K >> 3;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)n0 * K);
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)b0 * K);
    float acc[R][BT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < BT; ++b) acc[r][b] = 0.0f;
    int c = t;
    for (; c + T * (U - 1) < nc; c += T * U) {
        uint4 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r)           // rows past N read row n0 again (never stored)
                wv[u][r] = ld_stream16(w + (size_t)(r < nr ? r : 0) * nc + c + T * u);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int b = 0; b < BT; ++b) {
                if (b >= nb) continue;
                uint4 xx = __ldg(xv + (size_t)b * nc + c + T * u);  // used for all R rows
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][b] = dot8(wv[u][r], xx, acc[r][b]);
            }
    }
    for (; c < nc; c += T) {
        uint4 wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = ld_stream16(w + (size_t)(r < nr ? r : 0) * nc + c);
#pragma unroll
        for (int b = 0; b < BT; ++b) {
            if (b >= nb) continue;
            uint4 xx = __ldg(xv + (size_t)b * nc + c);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] = dot8(wv[r], xx, acc[r][b]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < BT; ++b) {
            float s = warp_sum(acc[r][b]);
            if (lane == 0) part[warp][r * BT + b] = s;
        }
    __syncthreads();                              // every warp's partial sums are written
    if (t < R * BT) {
        int r = t / BT, b = t % BT;
        if (r < nr && b < nb) {
            float s = part[0][t] + part[1][t] + part[2][t] + part[3][t];
            if (bias) s += __half2float(bias[n0 + r]);
            y[(size_t)(b0 + b) * N + n0 + r] = __float2half_rn(s);
        }
    }
}

#define GEMV_V3(BT)                                                                          \
extern "C" __global__ void __launch_bounds__(128) gemv_v3_b##BT(                             \
        const __half* __restrict__ x, const __half* __restrict__ W,                          \
        const __half* __restrict__ bias, __half* __restrict__ y, int B, int N, int K) {      \
    gemv_v3_body<BT>(x, W, bias, y, B, N, K);                                                \
}
#define GEMV_V4(BT, R)                                                                       \
extern "C" __global__ void __launch_bounds__(128) gemv_v4_b##BT##_r##R(                      \
        const __half* __restrict__ x, const __half* __restrict__ W,                          \
        const __half* __restrict__ bias, __half* __restrict__ y, int B, int N, int K) {      \
    gemv_v4_body<BT, R>(x, W, bias, y, B, N, K);                                             \
}
GEMV_V3(1) GEMV_V3(2) GEMV_V3(4) GEMV_V3(8)
GEMV_V4(1, 2) GEMV_V4(2, 2) GEMV_V4(4, 2) GEMV_V4(8, 2)
GEMV_V4(1, 4) GEMV_V4(2, 4) GEMV_V4(4, 4) GEMV_V4(8, 4)
#undef GEMV_V3
#undef GEMV_V4
