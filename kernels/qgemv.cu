// qgemv.cu: weight-only quantized GEMV, y = x @ dequant(Wq)^T (+ bias): W8A16 and W4A16.
//
//   x is (B, K) fp16, y is (B, N) fp16, bias (N,) fp16 or null. The weight of row n, column k is
//   q[n, k] * s[n, k / G]: q signed (symmetric quantization, kernels/quant.cu), s fp16 scales
//   of shape (N, K / G), G the group size (G = K: per-channel).
//     W8: q is (N, K) int8.
//     F8: q is (N, K) fp8 e4m3 bytes (uint8), q = e4m3(w / s).
//     W4: q is packed (N, K / 2) uint8: k = 2i in the low nibble of byte i, k = 2i + 1 in the
//         high nibble, each a two's complement 4-bit value (-8..7).
//   Partial sums are fp32; y is rounded to fp16 once. At B = 1 the bytes read per weight are
//   1 (W8) or 0.5 (W4) plus the scales (2 bytes per group): 2x and 4x fewer than fp16.
//
//   qgemv_w8_v1, qgemv_w4_v1   one warp per (row, batch row), one byte per lane per step,
//             shifts and int->float conversions, the scale multiplied into every weight
//   qgemv_w8_v2, qgemv_w4_v2   gemv_v4's layout (a block of 4 warps per R rows, split K, 16-byte
//             streamed loads, 2 per row in flight per thread, up to 16 rows of x per launch); dequantized in registers with the
//             magic-number trick (the integer's bits placed under a float exponent, one
//             subtraction leaves the value); fp32 products; the group's scale multiplies a
//             chunk's partial sum once
//   qgemv_f8_v2   qgemv_w8_v2 with fp8 e4m3 weights (the same bytes): each byte shifted under
//             an fp16 exponent and scaled by 2^8 (exact, subnormals included), fp32 products
//   qgemv_w4_v3   v2 with the products of 4 weights summed in fp16 (HFMA2: two per instruction)
//             before they join the fp32 sum: half the instructions per weight. The fp16 partial
//             of 4 products |q| <= 8 overflows when |x| > 2000 (the launcher documents it).
//   qgemv_w4_v4   v3's arithmetic with gemv_v3's layout: a warp per row, no split of K, no
//             shared memory; 8 loads of 16 bytes in flight per lane (B <= 4: qgemv_w4_v4_b{BT})
//   qgemv_w4_v5   B = 1: x stays in registers. v2-v4 read x again for every row or pair of rows
//             (64 bytes of fp16 x per 16 bytes of int4 weights: 2 to 4 times the weight bytes
//             through L1). Here a block of 256 threads keeps its columns of x in registers,
//             regrouped once, and walks R rows at a time over a grid of one wave (a multiple of
//             the SMs); the 8 warps' sums meet in a double-buffered shared array, one barrier
//             per step. qgemv_w4_v5_c{CPT}_r{R}: CPT chunks per thread (K <= 8192 CPT).
//             Correct, but lesson 10 times it behind v3: each step's barrier holds all 8 warps
//             until the slowest one's loads arrive, and no fresh block fills the gap; the next
//             step's rows are not prefetched before the barrier.
//   qgemv_w4_v6   sm_80+, B <= 8: the tensor cores as the dot-product engine. v3 spends 16 of
//             its ~20 instructions per 8 weights on HFMA2 products and their conversion to fp32
//             sums; here one mma.sync m16n8k16 (fp16 in, fp32 sums) takes 16 rows x 16 k of the
//             dequantized weights against x as its 8 columns (the rows of x, zeros beyond B), so
//             the products cost 1 instruction per 8 weights per lane and the batch is free up to
//             8. The k order inside an mma is free, so each lane feeds the (k, k + 4) pairs that
//             w4_to_half2 gives, with x regrouped to match. S warps per block split K, their
//             16 x 8 tiles added once in shared memory. qgemv_w4_v6_s{S}_u{U}_g{GQ}: U quads
//             (128 k, 2 loads of 16 bytes per lane, x loaded with them) per step; GQ = 1
//             (G % 128 == 0): the scale multiplies each quad's fp32 sum; GQ = 0: the weights
//             are scaled in fp16 first. At B = 1 both v3 and v6 wait on their loads; the gain
//             is at larger B, where v3 pays one more FMA per weight for every row of x.
//   qgemv_w4_v7   sm_80+, B <= 8, G % 128 == 0: v6's mma over a copy of the weight laid out for
//             it (qgemv_launch.QWeight.tiles(), built once): the 1 KiB that a warp reads for 16
//             rows x 128 k is stored contiguously, in the order its lanes load it, so every
//             load instruction of the warp reads 512 contiguous bytes (v6: 8 rows x 64 bytes
//             4 KiB apart) and a block's rows are one stream; the nibbles are stored offset by 8
//             and ordered k0 k2 k4 k6 k1 k3 k5 k7 in each 32-bit word, so the magic-number
//             conversion yields (k0, k1), (k2, k3), ... and x's halves pair as they are (no xor,
//             no regrouping: 9 of v6's 13 instructions per 8 weights); the two scales of a
//             lane's rows are one 4-byte load. qgemv_w4_v7_s{S}: S warps split K.
//
//   Chunks are 16 bytes of q: 16 weights (W8) or 32 (W4), inside one group: G % 16 == 0 (W8),
//   G % 32 == 0 (W4), and G divides K. q and x 16-byte aligned (the launcher checks).
//   Instantiated per batch tile BT (1, 2, 4, 8, 16) and rows per block R (2, 4):
//   qgemv_w8_v2_b{BT}_r{R}, qgemv_f8_v2_..., qgemv_w4_v2_..., qgemv_w4_v3_b{BT}_r{R}.
//
// Launches (kernels/qgemv_launch.py): v1 grid (ceil(N/4), B) x 128; v2/v3 (ceil(N/R),
// ceil(B/BT)) x 128; v4 (ceil(N/4), ceil(B/BT)) x 128; v5 (min(ceil(N/R), SMs x resident
// blocks per SM)) x 256; v6 (ceil(N/16)) x 32 S; v7 (ceil(N/16)) x 32 S. No dynamic
// shared memory.
//
// Each version's kernels sit inside #if !defined(CB_ONLY) || defined(CB_ONLY_<version>): the
// launcher compiles the one version it launches (cudabook.compile.module(..., only=...)).
#include <cuda_fp16.h>
#include "common.cuh"

// ----------------------------------------------------------------------------- v1
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w8_v1)
extern "C" __global__ void qgemv_w8_v1(const __half* __restrict__ x,
                                       const signed char* __restrict__ q,
                                       const __half* __restrict__ s,
                                       const __half* __restrict__ bias, __half* __restrict__ y,
                                       int B, int N, int K, int G) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), b = blockIdx.y;
    if (n >= N || b >= B) return;
    const signed char* qr = q + (size_t)n * K;
    const __half* sr = s + (size_t)n * (K / G);
    const __half* xb = x + (size_t)b * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32)
        acc += (float)qr[k] * __half2float(sr[k / G]) * __half2float(xb[k]);
    acc = warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += __half2float(bias[n]);
        y[(size_t)b * N + n] = __float2half_rn(acc);
    }
}
#endif

#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v1)
extern "C" __global__ void qgemv_w4_v1(const __half* __restrict__ x,
                                       const unsigned char* __restrict__ q,
                                       const __half* __restrict__ s,
                                       const __half* __restrict__ bias, __half* __restrict__ y,
                                       int B, int N, int K, int G) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), b = blockIdx.y;
    if (n >= N || b >= B) return;
    const unsigned char* qr = q + (size_t)n * (K / 2);
    const __half* sr = s + (size_t)n * (K / G);
    const __half* xb = x + (size_t)b * K;
    float acc = 0.0f;
    for (int i = lane; i < K / 2; i += 32) {      // byte i holds k = 2i (low), 2i + 1 (high)
        int v = qr[i];
        int lo = (v << 28) >> 28, hi = (v << 24) >> 28;   // sign-extended nibbles
        int k = 2 * i;
        acc += (float)lo * __half2float(sr[k / G]) * __half2float(xb[k]);
        acc += (float)hi * __half2float(sr[(k + 1) / G]) * __half2float(xb[k + 1]);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += __half2float(bias[n]);
        y[(size_t)b * N + n] = __float2half_rn(acc);
    }
}
#endif

// ----------------------------------------------------------------------------- dequantizers
// int8: bytes biased to unsigned (q + 128) placed under the exponent of 2^23: the float
// 0x4B0000bb is 2^23 + bb exactly, so one subtraction of 2^23 + 128 leaves q.
__device__ __forceinline__ void w8_to_float(unsigned word, float* f) {
    unsigned u = word ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        f[i] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u | i)) - 8388736.0f;
}

// fp8 e4m3 (s eeee mmm, bias 7) -> fp16 (s eeeee mmmmmmmmmm, bias 15): the 7 magnitude bits
// moved to bits 7..13 of the half read as 2^-8 times the value (normal and subnormal alike, as
// both formats put the exponent field right above the mantissa), so one multiply by 256 is exact.
// Returns the 4 bytes of word as floats, in order.
__device__ __forceinline__ void f8_to_float(unsigned word, float* f) {
    const __half2 k256 = __float2half2_rn(256.0f);
    unsigned h01 = __byte_perm(word, 0u, 0x1404u), h23 = __byte_perm(word, 0u, 0x3424u);
    h01 = ((h01 >> 1) & 0x3F803F80u) | (h01 & 0x80008000u);
    h23 = ((h23 >> 1) & 0x3F803F80u) | (h23 & 0x80008000u);
    float2 a = __half22float2(__hmul2(*reinterpret_cast<__half2*>(&h01), k256));
    float2 b = __half22float2(__hmul2(*reinterpret_cast<__half2*>(&h23), k256));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

// int4: nibbles biased (q + 8); a nibble under the fp16 exponent of 1024 (0x6400 | n) is
// 1024 + n. Masking two nibbles 16 bits apart gives a half2 at once: (n0, n4), (n1, n5)...
// The high nibble of each byte is masked in place (16 n) and scaled back by 1/16.
// Returns q as half2 pairs in the order (k, k+4) for k = 0, 1, 2, 3.
__device__ __forceinline__ void w4_to_half2(unsigned word, __half2* h) {
    unsigned u = word ^ 0x88888888u, u8 = u >> 8;
    unsigned a = (u & 0x000F000Fu) | 0x64006400u, b = (u & 0x00F000F0u) | 0x64006400u;
    unsigned c = (u8 & 0x000F000Fu) | 0x64006400u, d = (u8 & 0x00F000F0u) | 0x64006400u;
    const __half2 off = __float2half2_rn(1032.0f);            // 1024 + 8
    const __half2 sixteenth = __float2half2_rn(0.0625f), off16 = __float2half2_rn(-72.0f);
    h[0] = __hsub2(*reinterpret_cast<__half2*>(&a), off);                       // k0, k4
    h[1] = __hfma2(*reinterpret_cast<__half2*>(&b), sixteenth, off16);          // k1, k5
    h[2] = __hsub2(*reinterpret_cast<__half2*>(&c), off);                       // k2, k6
    h[3] = __hfma2(*reinterpret_cast<__half2*>(&d), sixteenth, off16);          // k3, k7
}

// The 8 halves of x (x0..x7, one uint4) regrouped in the pairs w4_to_half2 gives:
// (x0, x4), (x1, x5), (x2, x6), (x3, x7).
__device__ __forceinline__ void x_pairs_k4(uint4 v, __half2* p) {
    unsigned r0 = __byte_perm(v.x, v.z, 0x5410), r1 = __byte_perm(v.x, v.z, 0x7632);
    unsigned r2 = __byte_perm(v.y, v.w, 0x5410), r3 = __byte_perm(v.y, v.w, 0x7632);
    p[0] = *reinterpret_cast<__half2*>(&r0);
    p[1] = *reinterpret_cast<__half2*>(&r1);
    p[2] = *reinterpret_cast<__half2*>(&r2);
    p[3] = *reinterpret_cast<__half2*>(&r3);
}

__device__ __forceinline__ void x_to_float8(uint4 v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __half22float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// ----------------------------------------------------------------------------- v2, v3
// MODE 8: W8 fp32; MODE 9: fp8 e4m3 fp32; MODE 4: W4 fp32 products; MODE 5: W4 fp16
// products of 4 (v3).
// Thread t of the block's 128 reads 16-byte chunks t, t + 128, ... of each of the R rows.
template <int MODE, int BT, int R>
__device__ __forceinline__ void qgemv_body(const __half* __restrict__ x,
                                           const unsigned char* __restrict__ q,
                                           const __half* __restrict__ s,
                                           const __half* __restrict__ bias,
                                           __half* __restrict__ y, int B, int N, int K, int G) {
    constexpr int T = 128;
    constexpr int WPC = (MODE == 8 || MODE == 9) ? 16 : 32;   // weights per 16-byte chunk
    constexpr int U = 2;                          // chunks per row in flight per thread
    __shared__ float part[4][R * BT];
    int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int n0 = blockIdx.x * R, b0 = blockIdx.y * BT;
    int nb = min(BT, B - b0), nr = min(R, N - n0);
    int nc = K / WPC, ng = K / G;
    const uint4* qv = reinterpret_cast<const uint4*>(q);   // row n: chunks n * nc .. + nc - 1
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)b0 * K);
    float acc[R][BT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < BT; ++b) acc[r][b] = 0.0f;
    for (int c0 = t; c0 < nc; c0 += T * U) {
        uint4 wvu[U][R];                          // U chunks of each row in flight at once
        float scu[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int cu = c0 + T * u < nc ? c0 + T * u : c0;   // past the row: chunk c0 again, unused
#pragma unroll
            for (int r = 0; r < R; ++r) {         // rows past N re-read row n0 (never stored)
                size_t row = (size_t)(n0 + (r < nr ? r : 0));
                wvu[u][r] = ld_stream16(qv + row * nc + cu);
                scu[u][r] = __half2float(s[row * ng + (cu * WPC) / G]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
        const int c = c0 + T * u;
        if (c >= nc) break;
        const uint4* wv = wvu[u];
        const float* sc = scu[u];
#pragma unroll
        for (int b = 0; b < BT; ++b) {
            if (b >= nb) continue;
            const uint4* xc = xv + (size_t)b * (K / 8) + (size_t)c * (WPC / 8);
            float ps[R];
#pragma unroll
            for (int r = 0; r < R; ++r) ps[r] = 0.0f;
            if constexpr (MODE == 8 || MODE == 9) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {     // 8 weights (2 words) per 8 halves of x
                    float xf[8];
                    x_to_float8(__ldg(xc + h), xf);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const unsigned* wq = reinterpret_cast<const unsigned*>(&wv[r]);
                        float f[8];
                        if constexpr (MODE == 8) {
                            w8_to_float(wq[2 * h], f);
                            w8_to_float(wq[2 * h + 1], f + 4);
                        } else {
                            f8_to_float(wq[2 * h], f);
                            f8_to_float(wq[2 * h + 1], f + 4);
                        }
#pragma unroll
                        for (int i = 0; i < 8; ++i) ps[r] = fmaf(f[i], xf[i], ps[r]);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {     // word j: 8 weights, 8 halves of x
                    __half2 xp[4];
                    x_pairs_k4(__ldg(xc + j), xp);
                    float2 xf[4];
                    if constexpr (MODE == 4) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) xf[i] = __half22float2(xp[i]);
                    }
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        __half2 qh[4];
                        w4_to_half2(reinterpret_cast<const unsigned*>(&wv[r])[j], qh);
                        if constexpr (MODE == 4) {
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                float2 qf = __half22float2(qh[i]);
                                ps[r] = fmaf(qf.x, xf[i].x, ps[r]);
                                ps[r] = fmaf(qf.y, xf[i].y, ps[r]);
                            }
                        } else {
                            __half2 p = __hmul2(qh[0], xp[0]);
                            p = __hfma2(qh[1], xp[1], p);
                            p = __hfma2(qh[2], xp[2], p);
                            p = __hfma2(qh[3], xp[3], p);
                            float2 pf = __half22float2(p);
                            ps[r] += pf.x + pf.y;
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] = fmaf(sc[r], ps[r], acc[r][b]);
        }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < BT; ++b) {
            float v = warp_sum(acc[r][b]);
            if (lane == 0) part[warp][r * BT + b] = v;
        }
    __syncthreads();                              // every warp's partial sums are written
    for (int i = t; i < R * BT; i += T) {
        int r = i / BT, b = i % BT;
        if (r < nr && b < nb) {
            float v = part[0][i] + part[1][i] + part[2][i] + part[3][i];
            if (bias) v += __half2float(bias[n0 + r]);
            y[(size_t)(b0 + b) * N + n0 + r] = __float2half_rn(v);
        }
    }
}

// ----------------------------------------------------------------------------- v4 (W4)
// One warp per weight row (4 rows per block of 128 threads), no split of K and so no
// shared-memory sum: lane l reads chunks l, l + 32, ..., U = 8 of them in flight at once (128
// bytes per lane), then dequantizes them as v3 does. At K = 8192 a row is 256 chunks: one
// round of 8 loads per lane.
template <int BT>
__device__ __forceinline__ void qgemv_w4_v4_body(const __half* __restrict__ x,
                                                 const unsigned char* __restrict__ q,
                                                 const __half* __restrict__ s,
                                                 const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int B, int N, int K,
                                                 int G) {
    constexpr int U = 8;
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * 4 + (threadIdx.x >> 5), b0 = blockIdx.y * BT;
    if (n >= N) return;                           // the whole warp leaves together
    int nb = min(BT, B - b0), nc = K / 32, ng = K / G;
    const uint4* qv = reinterpret_cast<const uint4*>(q) + (size_t)n * nc;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)b0 * K);
    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.0f;
    for (int c0 = lane; c0 < nc; c0 += 32 * U) {
        uint4 wv[U];
        float sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {             // all U loads issued before any math
            int c = c0 + 32 * u < nc ? c0 + 32 * u : c0;
            wv[u] = ld_stream16(qv + c);
            sc[u] = __half2float(s[(size_t)n * ng + (c * 32) / G]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int c = c0 + 32 * u;
            if (c >= nc) break;
#pragma unroll
            for (int b = 0; b < BT; ++b) {
                if (b >= nb) continue;
                const uint4* xc = xv + (size_t)b * (K / 8) + (size_t)c * 4;
                float ps = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    __half2 xp[4], qh[4];
                    x_pairs_k4(__ldg(xc + j), xp);
                    w4_to_half2(reinterpret_cast<const unsigned*>(&wv[u])[j], qh);
                    __half2 p = __hmul2(qh[0], xp[0]);
                    p = __hfma2(qh[1], xp[1], p);
                    p = __hfma2(qh[2], xp[2], p);
                    p = __hfma2(qh[3], xp[3], p);
                    float2 pf = __half22float2(p);
                    ps += pf.x + pf.y;
                }
                acc[b] = fmaf(sc[u], ps, acc[b]);
            }
        }
    }
    float bn = (bias && lane == 0) ? __half2float(bias[n]) : 0.0f;
#pragma unroll
    for (int b = 0; b < BT; ++b) {
        float v = warp_sum(acc[b]);
        if (lane == 0 && b < nb) y[(size_t)(b0 + b) * N + n] = __float2half_rn(v + bn);
    }
}

// ----------------------------------------------------------------------------- v5 (W4, B = 1)
// Thread t of 256 owns the 16-byte chunk columns t, t + 256, ... (CPT of them) of every row and
// keeps the 32 halves of x under each, regrouped as w4_to_half2 pairs them (16 half2), for the
// whole kernel. The block walks rows n0 = blockIdx.x * R, += gridDim.x * R: R * CPT loads of 16
// bytes in flight per thread, then a warp_sum per row and the 8 warps' sums added from shared
// memory by thread r of the block.
template <int CPT, int R>
__device__ __forceinline__ void qgemv_w4_v5_body(const __half* __restrict__ x,
                                                 const unsigned char* __restrict__ q,
                                                 const __half* __restrict__ s,
                                                 const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int N, int K, int G) {
    constexpr int T = 256, NW = T / 32;
    __shared__ float part[2][NW][R];              // two buffers: one barrier per step suffices
    int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int nc = K / 32, ng = K / G;
    const uint4* qv = reinterpret_cast<const uint4*>(q);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    __half2 xp[CPT][16];                          // x of chunk j, word w: xp[j][4w .. 4w + 3]
    bool has[CPT];                                // chunk column t + 256 j exists (K may be short)
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        int c = t + T * j;
        has[j] = c < nc;
#pragma unroll
        for (int w = 0; w < 4; ++w)
            x_pairs_k4(has[j] ? __ldg(xv + (size_t)c * 4 + w) : make_uint4(0u, 0u, 0u, 0u),
                       &xp[j][4 * w]);
    }
    int buf = 0;
    for (int n0 = blockIdx.x * R; n0 < N; n0 += gridDim.x * R, buf ^= 1) {
        uint4 wv[R][CPT];
        float sc[R][CPT];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            size_t row = (size_t)min(n0 + r, N - 1);   // rows past N re-read row N - 1, unused
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                int c = t + T * j;
                wv[r][j] = has[j] ? ld_stream16(qv + row * nc + c) : make_uint4(0u, 0u, 0u, 0u);
                sc[r][j] = has[j] ? __half2float(s[row * ng + (c * 32) / G]) : 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float ps = 0.0f;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    __half2 qh[4];
                    w4_to_half2(reinterpret_cast<const unsigned*>(&wv[r][j])[w], qh);
                    __half2 p = __hmul2(qh[0], xp[j][4 * w]);
                    p = __hfma2(qh[1], xp[j][4 * w + 1], p);
                    p = __hfma2(qh[2], xp[j][4 * w + 2], p);
                    p = __hfma2(qh[3], xp[j][4 * w + 3], p);
                    float2 pf = __half22float2(p);
                    ps += pf.x + pf.y;
                }
                acc = fmaf(sc[r][j], ps, acc);    // a missing chunk: scale 0 (and x 0)
            }
            acc = warp_sum(acc);
            if (lane == 0) part[buf][warp][r] = acc;
        }
        // Every warp's sums of this step are written. The other buffer, written next step, was
        // last read before this barrier (by thread r, in the step before).
        __syncthreads();
        if (t < R && n0 + t < N) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; ++w) v += part[buf][w][t];
            if (bias) v += __half2float(bias[n0 + t]);
            y[n0 + t] = __float2half_rn(v);
        }
    }
}

#define QGEMV_V5(CPT, R)                                                                     \
extern "C" __global__ void __launch_bounds__(256) qgemv_w4_v5_c##CPT##_r##R(                 \
        const __half* __restrict__ x, const unsigned char* __restrict__ q,                   \
        const __half* __restrict__ s, const __half* __restrict__ bias,                       \
        __half* __restrict__ y, int B, int N, int K, int G) {                                \
    qgemv_w4_v5_body<CPT, R>(x, q, s, bias, y, N, K, G);                                     \
}
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v5)
QGEMV_V5(1, 4) QGEMV_V5(1, 8) QGEMV_V5(2, 2) QGEMV_V5(2, 4) QGEMV_V5(4, 2)
#endif
#undef QGEMV_V5

#define QGEMV_V4(BT)                                                                         \
extern "C" __global__ void __launch_bounds__(128) qgemv_w4_v4_b##BT(                         \
        const __half* __restrict__ x, const unsigned char* __restrict__ q,                   \
        const __half* __restrict__ s, const __half* __restrict__ bias,                       \
        __half* __restrict__ y, int B, int N, int K, int G) {                                \
    qgemv_w4_v4_body<BT>(x, q, s, bias, y, B, N, K, G);                                      \
}
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v4)
QGEMV_V4(1) QGEMV_V4(2) QGEMV_V4(4)
#endif
#undef QGEMV_V4

#define QGEMV(NAME, MODE, BT, R)                                                             \
extern "C" __global__ void __launch_bounds__(128) NAME##_b##BT##_r##R(                       \
        const __half* __restrict__ x, const unsigned char* __restrict__ q,                   \
        const __half* __restrict__ s, const __half* __restrict__ bias,                       \
        __half* __restrict__ y, int B, int N, int K, int G) {                                \
    qgemv_body<MODE, BT, R>(x, q, s, bias, y, B, N, K, G);                                   \
}
#define QGEMV_ALL(NAME, MODE)                                                                \
    QGEMV(NAME, MODE, 1, 2) QGEMV(NAME, MODE, 2, 2) QGEMV(NAME, MODE, 4, 2)                  \
    QGEMV(NAME, MODE, 8, 2) QGEMV(NAME, MODE, 16, 2) QGEMV(NAME, MODE, 1, 4)
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w8_v2)
QGEMV_ALL(qgemv_w8_v2, 8)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_f8_v2)
QGEMV_ALL(qgemv_f8_v2, 9)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v2)
QGEMV_ALL(qgemv_w4_v2, 4)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v3)
QGEMV_ALL(qgemv_w4_v3, 5)
#endif
#undef QGEMV_ALL
#undef QGEMV

// ----------------------------------------------------------------------------- v6 (W4, sm_80+)
// The tensor cores as the dot-product engine. One mma.sync m16n8k16 (fp16 in, fp32 accumulate)
// multiplies 16 rows of W by 16 values of k for 8 columns of x: at B <= 8 the columns are the
// rows of x (the others zero), so the batch costs nothing and the products and their fp32 sums
// take one instruction per 256 weights. Lane (g, t) = (lane / 4, lane % 4) of a warp holds, in
// the mma's A operand, weights of rows g and g + 8 of its 16-row tile; in B, x of batch row g.
// The order of k inside one mma is free as long as A and B use the same one: lane t takes
// 16-byte chunk 4j + t of both rows (quad j = 128 values of k, 64 contiguous bytes per row) and
// feeds the (k, k + 4) pairs that w4_to_half2 gives, with x regrouped to the same pairs. 8 mma
// per quad, into a fresh fp32 sum that is then scaled by the group's scale (GQ: G % 128 == 0,
// one group per quad); else each chunk's weights are scaled in fp16 before the mma (q * s
// rounded once to fp16: exact to 2^-11). S warps of a block split K (warp w: quads w U + u,
// += S U); each step issues its 2 U weight loads and its x loads (lanes g < B) before any math,
// then the S partial 16 x 8 tiles are added in shared memory once, at the end. Instantiated
// with U = 1 and S = 8 (N >= 6144) or 16 (smaller N: more warps per row of blocks); U = 2, with
// x read inside the math, was tried and not kept (qgemv_launch.V6_DEFAULT).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_16816(float (&c)[4], __half2 a0, __half2 a1, __half2 a2,
                                          __half2 a3, __half2 b0, __half2 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(*reinterpret_cast<unsigned*>(&a0)), "r"(*reinterpret_cast<unsigned*>(&a1)),
          "r"(*reinterpret_cast<unsigned*>(&a2)), "r"(*reinterpret_cast<unsigned*>(&a3)),
          "r"(*reinterpret_cast<unsigned*>(&b0)), "r"(*reinterpret_cast<unsigned*>(&b1)));
}
#endif

template <int S, int U, bool GQ>
__device__ __forceinline__ void qgemv_w4_v6_body(const __half* __restrict__ x,
                                                 const unsigned char* __restrict__ q,
                                                 const __half* __restrict__ s,
                                                 const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int B, int N, int K,
                                                 int G) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __shared__ float part[S][4][32];              // each warp's 16 x 8 tile, lane-major
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, nc = K / 32, nq = (nc + 3) / 4, ng = K / G;
    const unsigned cpg = (unsigned)(G / 32);      // chunks per group
    const unsigned mg = cpg == 1 ? 0u : 0xFFFFFFFFu / cpg + 1u;   // ceil(2^32 / cpg)
    const size_t ra = (size_t)min(n0 + g, N - 1), rb = (size_t)min(n0 + g + 8, N - 1);
    const uint4* qa = reinterpret_cast<const uint4*>(q) + ra * nc;  // rows past N: never stored
    const uint4* qb = reinterpret_cast<const uint4*>(q) + rb * nc;
    const __half* sa = s + ra * ng;
    const __half* sb = s + rb * ng;
    const bool hx = g < B;                        // lane g carries batch row g of x
    const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)(hx ? g : 0) * (K / 8);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = warp * U; j0 < nq; j0 += S * U) {
        uint4 wa[U], wb[U], xr[U][4];
        __half2 s2a[U], s2b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {             // all 2 U loads before any math
            int c = 4 * (j0 + u) + t;
            bool ok = c < nc;
            unsigned cc = ok ? (unsigned)c : 0u;
            wa[u] = ok ? ld_stream16(qa + cc) : make_uint4(0u, 0u, 0u, 0u);
            wb[u] = ok ? ld_stream16(qb + cc) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int w = 0; w < 4; ++w)           // x too (lanes g < B): no load in the math
                xr[u][w] = (ok && hx) ? __ldg(xg + (size_t)c * 4 + w)
                                      : make_uint4(0u, 0u, 0u, 0u);
            unsigned cg = GQ ? 4u * (unsigned)min(j0 + u, nq - 1) : cc;  // GQ: the quad's group
            unsigned gi = cpg == 1 ? cg : __umulhi(cg, mg);
            // past K (GQ = 0 only): scale 0, so the zero bytes (q = -8) give 0, never inf
            s2a[u] = __half2half2(ok || GQ ? sa[gi] : __float2half(0.0f));
            s2b[u] = __half2half2(ok || GQ ? sb[gi] : __float2half(0.0f));
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u >= nq) break;              // the same for the whole warp
            float cf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                __half2 pa[4], pb[4], xp[4];
                w4_to_half2(reinterpret_cast<const unsigned*>(&wa[u])[w], pa);
                w4_to_half2(reinterpret_cast<const unsigned*>(&wb[u])[w], pb);
                if constexpr (!GQ) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        pa[i] = __hmul2(pa[i], s2a[u]);
                        pb[i] = __hmul2(pb[i], s2b[u]);
                    }
                }
                x_pairs_k4(xr[u][w], xp);              // zero past K and for lanes g >= B
                mma_16816(cf, pa[0], pb[0], pa[1], pb[1], xp[0], xp[1]);
                mma_16816(cf, pa[2], pb[2], pa[3], pb[3], xp[2], xp[3]);
            }
            if constexpr (GQ) {
                float fa = __low2float(s2a[u]), fb = __low2float(s2b[u]);
                acc[0] = fmaf(fa, cf[0], acc[0]);
                acc[1] = fmaf(fa, cf[1], acc[1]);
                acc[2] = fmaf(fb, cf[2], acc[2]);
                acc[3] = fmaf(fb, cf[3], acc[3]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] += cf[i];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][i][lane] = acc[i];
    __syncthreads();                              // every warp's partial tile is written
    if (warp == 0) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = 0.0f;
#pragma unroll
            for (int w = 0; w < S; ++w) v[i] += part[w][i][lane];
        }
        // c0: (row g, batch 2t), c1: (g, 2t + 1), c2: (g + 8, 2t), c3: (g + 8, 2t + 1)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int n = n0 + g + (i >> 1) * 8, b = 2 * t + (i & 1);
            if (n < N && b < B) {
                float bn = bias ? __half2float(bias[n]) : 0.0f;
                y[(size_t)b * N + n] = __float2half_rn(v[i] + bn);
            }
        }
    }
#else
    __trap();                                     // the launcher refuses below sm_80
#endif
}

#define QGEMV_V6(S, U, GQ, MINB)                                                             \
extern "C" __global__ void __launch_bounds__(32 * S, MINB) qgemv_w4_v6_s##S##_u##U##_g##GQ(   \
        const __half* __restrict__ x, const unsigned char* __restrict__ q,                   \
        const __half* __restrict__ s, const __half* __restrict__ bias,                       \
        __half* __restrict__ y, int B, int N, int K, int G) {                                \
    qgemv_w4_v6_body<S, U, GQ>(x, q, s, bias, y, B, N, K, G);                                \
}
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v6)
QGEMV_V6(8, 1, 1, 4) QGEMV_V6(8, 1, 0, 4) QGEMV_V6(16, 1, 1, 2) QGEMV_V6(16, 1, 0, 2)
#endif
#undef QGEMV_V6

// ----------------------------------------------------------------------------- v7 (W4, sm_80+)
// v6's arithmetic over a weight stored for it. Tile (nb, j) = rows 16 nb .. 16 nb + 15 (rows past
// N zero) x quad j (128 values of k): 1024 bytes as [row half h][g][t][16 bytes], lane (g, t)
// loading uint4 lane (rows g: chunk 4j + t) and lane + 32 (row g + 8), so the warp's two load
// instructions each read 512 contiguous bytes; tiles of one row block are contiguous in j.
// Each byte holds two nibbles n = q + 8 (0..15), and word w of a chunk holds k = 8w..8w+7 in the
// nibble order k0 k2 k4 k6 k1 k3 k5 k7, which w4o_to_half2 turns into (k0, k1), (k2, k3), (k4, k5),
// (k6, k7): the pairs in which x's halves already sit. Scales: one fp16 pair (row g, row g + 8)
// per (tile, g), the group's scale for that quad (G % 128 == 0). Launch: grid ceil(N/16), block
// 32 S; the launcher picks S so the blocks fit in one wave where they can.
__device__ __forceinline__ void w4o_to_half2(unsigned u, __half2* h) {
    unsigned u8 = u >> 8;
    unsigned a = (u & 0x000F000Fu) | 0x64006400u, b = (u & 0x00F000F0u) | 0x64006400u;
    unsigned c = (u8 & 0x000F000Fu) | 0x64006400u, d = (u8 & 0x00F000F0u) | 0x64006400u;
    const __half2 off = __float2half2_rn(1032.0f);            // 1024 + the offset 8
    const __half2 sixteenth = __float2half2_rn(0.0625f), off16 = __float2half2_rn(-72.0f);
    h[0] = __hsub2(*reinterpret_cast<__half2*>(&a), off);                       // k0, k1
    h[1] = __hfma2(*reinterpret_cast<__half2*>(&b), sixteenth, off16);          // k2, k3
    h[2] = __hsub2(*reinterpret_cast<__half2*>(&c), off);                       // k4, k5
    h[3] = __hfma2(*reinterpret_cast<__half2*>(&d), sixteenth, off16);          // k6, k7
}

template <int S>
__device__ __forceinline__ void qgemv_w4_v7_body(const __half* __restrict__ x,
                                                 const uint4* __restrict__ tiles,
                                                 const __half2* __restrict__ sq,
                                                 const __half* __restrict__ bias,
                                                 __half* __restrict__ y, int B, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __shared__ float part[S][4][32];              // each warp's 16 x 8 tile, lane-major
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nq = K / 128, nb = blockIdx.x, n0 = nb * 16;
    // lane g carries batch row g of x; lanes g >= B load row 0: the mma's columns g >= B are
    // never stored, and no select is spent zeroing them (16 instructions per step)
    const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)(g < B ? g : 0) * (K / 8);
    const uint4* tb = tiles + (size_t)nb * nq * 64 + lane;
    const __half2* sb = sq + (size_t)nb * nq * 8 + g;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = warp; j < nq; j += S) {
        uint4 wa = ld_stream16(tb + (size_t)j * 64), wb = ld_stream16(tb + (size_t)j * 64 + 32);
        float2 s2 = __half22float2(sb[(size_t)j * 8]);
        uint4 xr[4];
        const int c = 4 * j + t;
#pragma unroll
        for (int w = 0; w < 4; ++w) xr[w] = __ldg(xg + (size_t)c * 4 + w);
        float cf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            __half2 pa[4], pb[4];
            const __half2* xp = reinterpret_cast<const __half2*>(&xr[w]);
            w4o_to_half2(reinterpret_cast<const unsigned*>(&wa)[w], pa);
            w4o_to_half2(reinterpret_cast<const unsigned*>(&wb)[w], pb);
            mma_16816(cf, pa[0], pb[0], pa[1], pb[1], xp[0], xp[1]);
            mma_16816(cf, pa[2], pb[2], pa[3], pb[3], xp[2], xp[3]);
        }
        acc[0] = fmaf(s2.x, cf[0], acc[0]);
        acc[1] = fmaf(s2.x, cf[1], acc[1]);
        acc[2] = fmaf(s2.y, cf[2], acc[2]);
        acc[3] = fmaf(s2.y, cf[3], acc[3]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][i][lane] = acc[i];
    __syncthreads();                              // every warp's partial tile is written
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < S; ++w) v += part[w][i][lane];
            int n = n0 + g + (i >> 1) * 8, b = 2 * t + (i & 1);
            if (n < N && b < B) {
                float bn = bias ? __half2float(bias[n]) : 0.0f;
                y[(size_t)b * N + n] = __float2half_rn(v + bn);
            }
        }
    }
#else
    __trap();                                     // the launcher refuses below sm_80
#endif
}

#define QGEMV_V7(S)                                                                          \
extern "C" __global__ void __launch_bounds__(32 * S, 32 / S) qgemv_w4_v7_s##S(               \
        const __half* __restrict__ x, const uint4* __restrict__ tiles,                       \
        const __half2* __restrict__ sq, const __half* __restrict__ bias,                     \
        __half* __restrict__ y, int B, int N, int K, int G) {                                \
    qgemv_w4_v7_body<S>(x, tiles, sq, bias, y, B, N, K);                                     \
}
#if !defined(CB_ONLY) || defined(CB_ONLY_qgemv_w4_v7)
QGEMV_V7(4) QGEMV_V7(8) QGEMV_V7(16)
#endif
#undef QGEMV_V7
