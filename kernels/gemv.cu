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
//   gemv_v5   the tensor cores for batches past a few rows: mma.sync m16n8k16 with the batch as M
//             (one or two tiles of 16 rows, the missing rows zero) and 8 weight rows as N. Each
//             lane loads 16 contiguous bytes of a weight row and of x and uses them as the
//             fragments of two k16 steps: the K order inside a chunk of 32 is permuted the same
//             way for x and W, so the products are unchanged and no shared memory or ldmatrix is
//             needed. 8 warps split K; NT tiles of 8 weight rows per block; a row of y is summed
//             the same way at every batch size (no cross-row reduction), so it is batch-invariant
//             among its own instantiations. Numba has no tensor-core instruction: no twin.
//   gemv_v6   v5 with K also split across KS blocks (KS from K alone: a row is summed the same way
//             at every batch size) and up to 64 weight rows a block (NT = 8: x, read once per
//             block, costs half the weights' bytes at batch 32 instead of four times). Warps meet
//             in a fixed tree; each block writes its fp32 partial tile to a workspace, and the last
//             of a tile's KS blocks (a ticket) adds the KS partials in order and writes y: the
//             result does not depend on which block finished first. The ticket resets itself.
//
//   gemv_v3/v4/v5/v6 need K % 8 == 0 and 16-byte aligned x and W (the launcher checks, else v2).
//   Each is instantiated per batch tile BT (1, 2, 4, 8: rows of x per block, blockIdx.y picks
//   the tile) and v4 per rows-per-block R (2, 4): gemv_v3_b{BT}, gemv_v4_b{BT}_r{R}; v5 per
//   M tiles (1: B <= 16, 2: B <= 32) and NT (1, 2, 4 tiles of 8 weight rows): gemv_v5_m{MT}_n{NT};
//   v6 per MT and NT (1, 2, 4, 8): gemv_v6_m{MT}_n{NT}, with the workspace (KS * B * N floats) and
//   ceil(N / 8) tickets (zero at rest) as two more arguments, and KS.
//
// Launches (kernels/gemv_launch.py, config()): v1 grid (ceil(N/128), B) x 128 threads; v2
// (ceil(N/4), B) x 128 (a warp per row); v3 (ceil(N/4), ceil(B/BT)) x 128; v4
// (ceil(N/R), ceil(B/BT)) x 128; v5 (ceil(N/(8 NT))) x 256; v6 (ceil(N/(8 NT)), KS) x 256. No dynamic shared
// memory.
#include <cuda_fp16.h>
// common.cuh: dot8, warp_sum, ld_stream16; mma.cuh: mma_m16n8k16_f16 (two m16n8k8 on sm_75)
#include "common.cuh"
#include "mma.cuh"

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

// ----------------------------------------------------------------------------- v5
// Lane (g = lane / 4, t4 = lane % 4) of warp w reads, for chunk c of 32 columns, the 16 bytes at
// column 32 c + 8 t4 of weight row n0 + 8 j + g (j < NT) and of x rows g, g + 8 (+16, +24).
// Physical columns 8 t4 + {0,1 | 2,3} are the k16 fragment columns {2 t4 | 2 t4 + 8} of the
// first mma, {4,5 | 6,7} those of the second: A (x) and B (W) are permuted alike, so the sum over
// the chunk is the same. Warp w takes chunks w, w + 8, ...; U chunks of NT rows in flight.
template <int MT, int NT>
__device__ __forceinline__ void gemv_v5_body(const __half* __restrict__ x,
                                             const __half* __restrict__ W,
                                             const __half* __restrict__ bias,
                                             __half* __restrict__ y, int B, int N, int K) {
    constexpr int WARPS = 8, U = NT >= 4 ? 1 : 4 / NT, M = 16 * MT, NC = 8 * NT;
    __shared__ float part[WARPS][M][NC + 1];      // +1: the fragments' columns in other banks
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = lane >> 2, t4 = lane & 3;
    int n0 = blockIdx.x * NC, nch = (K + 31) >> 5;
    const __half* wr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j)                  // rows past N read row N - 1 (never stored)
        wr[j] = W + (size_t)min(n0 + 8 * j + g, N - 1) * K + 8 * t4;
    const __half* xr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = 16 * mt + 8 * h + g;          // rows past B are zero
            xr[mt][h] = r < B ? x + (size_t)r * K + 8 * t4 : nullptr;
        }
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.0f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = warp; c < nch; c += WARPS * U) {
        uint4 wv[U][NT], xv[U][MT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int cc = c + WARPS * u, k = 32 * cc + 8 * t4;
            bool ok = cc < nch && k < K;          // K % 8 == 0: 16 bytes all in or all out
#pragma unroll
            for (int j = 0; j < NT; ++j) wv[u][j] = ok ? ld_stream16(wr[j] + 32 * cc) : zero;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    xv[u][mt][h] = (ok && xr[mt][h]) ?
                        __ldg(reinterpret_cast<const uint4*>(xr[mt][h] + 32 * cc)) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 &lo = xv[u][mt][0], &hi = xv[u][mt][1];
                unsigned a1[4] = {lo.x, hi.x, lo.y, hi.y}, a2[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    unsigned b1[2] = {wv[u][j].x, wv[u][j].y}, b2[2] = {wv[u][j].z, wv[u][j].w};
                    mma_m16n8k16_f16(acc[mt][j], a1, b1);
                    mma_m16n8k16_f16(acc[mt][j], a2, b2);
                }
            }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)               // C fragment: rows g, g + 8; columns 2 t4 + {0,1}
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                part[warp][16 * mt + g + 8 * (i >> 1)][8 * j + 2 * t4 + (i & 1)] = acc[mt][j][i];
    __syncthreads();                              // every warp's partial tile is written
    for (int o = t; o < M * NC; o += 32 * WARPS) {
        int m = o / NC, nn = o % NC, n = n0 + nn;
        if (m >= B || n >= N) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += part[w][m][nn];   // the same order at every B
        if (bias) s += __half2float(bias[n]);
        y[(size_t)m * N + n] = __float2half_rn(s);
    }
}

// ----------------------------------------------------------------------------- v6
// v5's loads and mma; warp w of split ks takes chunks 8 ks + w, then every 8 KS chunks after it.
// The 8 warps' tiles meet in a tree ((0+4)+(2+6))+((1+5)+(3+7)) in 4 warps' room of shared
// memory; warp 0's sum goes to smem, and the block writes it (KS = 1) or its partial (KS > 1).
template <int MT, int NT>
__device__ __forceinline__ void gemv_v6_body(const __half* __restrict__ x,
                                             const __half* __restrict__ W,
                                             const __half* __restrict__ bias,
                                             __half* __restrict__ y, int B, int N, int K,
                                             float* __restrict__ work,
                                             unsigned* __restrict__ tickets, int KS) {
    constexpr int WARPS = 8, U = NT >= 4 ? 1 : 4 / NT, M = 16 * MT, NC = 8 * NT;
    __shared__ float part[WARPS / 2][M][NC + 1];
    __shared__ int last;
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = lane >> 2, t4 = lane & 3;
    int n0 = blockIdx.x * NC, ks = blockIdx.y, nch = (K + 31) >> 5, step = WARPS * KS;
    const __half* wr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j)                  // rows past N read row N - 1 (never stored)
        wr[j] = W + (size_t)min(n0 + 8 * j + g, N - 1) * K + 8 * t4;
    const __half* xr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = 16 * mt + 8 * h + g;
            xr[mt][h] = r < B ? x + (size_t)r * K + 8 * t4 : nullptr;
        }
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.0f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = WARPS * ks + warp; c < nch; c += step * U) {
        uint4 wv[U][NT], xv[U][MT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int cc = c + step * u, k = 32 * cc + 8 * t4;
            bool ok = cc < nch && k < K;
#pragma unroll
            for (int j = 0; j < NT; ++j) wv[u][j] = ok ? ld_stream16(wr[j] + 32 * cc) : zero;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    xv[u][mt][h] = (ok && xr[mt][h]) ?
                        __ldg(reinterpret_cast<const uint4*>(xr[mt][h] + 32 * cc)) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 &lo = xv[u][mt][0], &hi = xv[u][mt][1];
                unsigned a1[4] = {lo.x, hi.x, lo.y, hi.y}, a2[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    unsigned b1[2] = {wv[u][j].x, wv[u][j].y}, b2[2] = {wv[u][j].z, wv[u][j].w};
                    mma_m16n8k16_f16(acc[mt][j], a1, b1);
                    mma_m16n8k16_f16(acc[mt][j], a2, b2);
                }
            }
    }
    // the tree: warps [4, 8) hand over to [0, 4), then [2, 4) to [0, 2), then 1 to 0
#pragma unroll
    for (int half = WARPS / 2; half >= 1; half >>= 1) {
        if (warp >= half && warp < 2 * half)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        part[warp - half][16 * mt + g + 8 * (i >> 1)][8 * j + 2 * t4 + (i & 1)] =
                            acc[mt][j][i];
        __syncthreads();                          // the upper half's tiles are written
        if (warp < half)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[mt][j][i] +=
                            part[warp][16 * mt + g + 8 * (i >> 1)][8 * j + 2 * t4 + (i & 1)];
        __syncthreads();                          // read before the next round overwrites them
    }
    if (warp == 0)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    part[0][16 * mt + g + 8 * (i >> 1)][8 * j + 2 * t4 + (i & 1)] = acc[mt][j][i];
    __syncthreads();                              // the block's tile is in part[0]
    if (KS > 1) {
        for (int o = t; o < M * NC; o += 32 * WARPS) {
            int m = o / NC, n = n0 + o % NC;
            if (m < B && n < N) work[((size_t)ks * B + m) * N + n] = part[0][m][o % NC];
        }
        __threadfence();                          // this block's partials before its ticket
        __syncthreads();
        if (t == 0) last = atomicAdd(tickets + blockIdx.x, 1u) == (unsigned)(KS - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();                          // the other blocks' partials are visible
    }
    for (int o = t; o < M * NC; o += 32 * WARPS) {
        int m = o / NC, nn = o % NC, n = n0 + nn;
        if (m >= B || n >= N) continue;
        float s = part[0][m][nn];
        if (KS > 1) {                             // the KS partials in order: 0, 1, ...
            s = 0.0f;
            for (int q = 0; q < KS; ++q) s += __ldcg(work + ((size_t)q * B + m) * N + n);
        }
        if (bias) s += __half2float(bias[n]);
        y[(size_t)m * N + n] = __float2half_rn(s);
    }
    if (KS > 1 && t == 0) tickets[blockIdx.x] = 0u;   // at rest again for the next launch
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
#define GEMV_V5(MT, NT)                                                                      \
extern "C" __global__ void __launch_bounds__(256) gemv_v5_m##MT##_n##NT(                     \
        const __half* __restrict__ x, const __half* __restrict__ W,                          \
        const __half* __restrict__ bias, __half* __restrict__ y, int B, int N, int K) {      \
    gemv_v5_body<MT, NT>(x, W, bias, y, B, N, K);                                            \
}
GEMV_V5(1, 1) GEMV_V5(1, 2) GEMV_V5(1, 4) GEMV_V5(2, 1) GEMV_V5(2, 2) GEMV_V5(2, 4)
#define GEMV_V6(MT, NT)                                                                      \
extern "C" __global__ void __launch_bounds__(256) gemv_v6_m##MT##_n##NT(                     \
        const __half* __restrict__ x, const __half* __restrict__ W,                          \
        const __half* __restrict__ bias, __half* __restrict__ y, int B, int N, int K,        \
        float* __restrict__ work, unsigned* __restrict__ tickets, int KS) {                  \
    gemv_v6_body<MT, NT>(x, W, bias, y, B, N, K, work, tickets, KS);                         \
}
GEMV_V6(1, 1) GEMV_V6(1, 2) GEMV_V6(1, 4) GEMV_V6(1, 8)
GEMV_V6(2, 1) GEMV_V6(2, 2) GEMV_V6(2, 4) GEMV_V6(2, 8)
#undef GEMV_V3
#undef GEMV_V4
#undef GEMV_V5
#undef GEMV_V6
