// decode_gemv.cu: the GEMV of a decode step with the work around it fused in (Chapter 12, the
// decode ladder's first step): y = epilogue(prologue(x) @ W^T) for B = 1..32 rows of x.
//
//   W (N, K) fp16, nn.Linear's layout, K % 8 == 0, 16-byte aligned. The sums are gemv_v4's
//   (kernels/gemv.cu): a block of 4 warps owns R = 2 weight rows and a tile of BT rows of x, the
//   warps split K, fp32 multiply-adds in a fixed order; so a row's result does not depend on the
//   batch, and each epilogue rounds exactly where the unfused kernels it replaces round.
//
//   prologues
//     plain     x (B, K) fp16, read as it is
//     ln        x (B, K) fp32, the residual stream: every block normalises its BT rows into
//               shared memory, fp16 (x - mean) * rstd * gamma + beta, computed as
//               add_layernorm_v1 (residual.cu) computes it with row_block(K) threads (ln_threads:
//               the other threads add zeros), so the GEMV reads the values that kernel would have
//               written. A step's separate LayerNorm launches go; each block pays for its rows'
//               statistics (two block sums over K floats from L2). K <= 16 * 128.
//   epilogues (s: a row's fp32 sum)
//     store     y = half(s), (B, N)
//     gelu      y = half(gelu_tanh(half(s))): the MLP's up-projection with gelu_half_v1's rounding
//     residual  r[b, n] += half(s), r (B, N) fp32: a projection back into the residual stream
//               (add_layernorm_v1's add, done where the sum is); one writer per element
//     rope      the QKV projection, RoPE and the paged append (paged_rope_append_v1's work; its
//               products may be contracted into fused multiply-adds differently from that kernel's,
//               so q and k can differ from it by one fp16 ulp): W's
//               rows are permuted (decode_gemv_launch.rope_order) so that block p's two rows are
//               the pair (i, i + D/2) of head j = p / (D/2), with q heads, then k heads, then v
//               heads; q is rotated into q_out (B, H, D), k rotated and v copied into the pools
//               (NB, Hkv, BS, D) at the row's position seq_lens[b] - 1 through block_table
//
// Instantiations dgemv_<prologue>_<epilogue>_b<BT>, BT in {1, 2, 4, 8}, for the four a GPT layer
// uses: ln_rope (QKV), plain_residual (output and down projections), ln_gelu (up projection),
// ln_store (the LM head). Launch (kernels/decode_gemv_launch.py): grid (N / 2, ceil(B / BT)),
// 128 threads, dynamic shared memory BT K 2 bytes for the ln prologue.
//
// Measured (reports/): a step built on these kernels saves no time at batch 1 and loses from batch
// 2 on: the ln prologue makes every one of the N / 2 blocks of a launch normalise its BT rows
// again (two block sums per row, serial in the rows), work that grows with the batch while one
// LayerNorm launch does it once. A prologue that reads statistics computed once would keep the
// fusion's saved launch without that cost.
#include <cuda_fp16.h>
// common.cuh: dot8, warp_sum, block_sum, ld_stream16, gelu_tanh, rope_angle
#include "common.cuh"

#define DG_PLAIN 0
#define DG_LN 1
#define DG_STORE 0
#define DG_GELU 1
#define DG_RESIDUAL 2
#define DG_ROPE 3

template <int BT, int PRO, int EPI>
__device__ __forceinline__ void dgemv_body(
    const void* __restrict__ x, const __half* __restrict__ W, __half* y, float* res,
    const float* __restrict__ gamma, const float* __restrict__ beta, float eps, int ln_threads,
    int B, int N, int K, __half* q_out, __half* k_pool, __half* v_pool,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, int H, int Hkv,
    int D, int NB, int BS, int MB, float log2_base) {
    constexpr int T = 128, U = 4, R = 2;
    extern __shared__ uint4 dg_xs[];                // ln: (BT, K) fp16, the normalised rows
    __shared__ float part[4][R * BT];
    __shared__ float red[BLOCK_REDUCE_SMEM];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n0 = blockIdx.x * R, b0 = blockIdx.y * BT;
    const int nb = min(BT, B - b0), nr = min(R, N - n0), nc = K >> 3;

    if (PRO == DG_LN) {                             // add_layernorm_v1's arithmetic, row by row
        const float* xr = reinterpret_cast<const float*>(x);
        __half* xs = reinterpret_cast<__half*>(dg_xs);
        for (int b = 0; b < nb; ++b) {
            const float* row = xr + (size_t)(b0 + b) * K;
            float v[16], sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int i = t + c * ln_threads;
                v[c] = 0.0f;
                if (t < ln_threads && i < K) {
                    v[c] = row[i];
                    sum += v[c];
                }
            }
            float mean = block_sum(sum, red) / K;
            float sq = 0.0f;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int i = t + c * ln_threads;
                if (t < ln_threads && i < K) sq += (v[c] - mean) * (v[c] - mean);
            }
            float rstd = rsqrtf(block_sum(sq, red) / K + eps);
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int i = t + c * ln_threads;
                if (t < ln_threads && i < K)
                    xs[(size_t)b * K + i] = __float2half((v[c] - mean) * rstd * gamma[i] + beta[i]);
            }
        }
        __syncthreads();                            // the tile's rows are in shared memory
    }
    const uint4* xg = reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(x) +
                                                     (size_t)b0 * K);
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)n0 * K);
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
            for (int r = 0; r < R; ++r)
                wv[u][r] = ld_stream16(w + (size_t)(r < nr ? r : 0) * nc + c + T * u);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int b = 0; b < BT; ++b) {
                if (b >= nb) continue;
                uint4 xx = PRO == DG_LN ? dg_xs[(size_t)b * nc + c + T * u]
                                        : __ldg(xg + (size_t)b * nc + c + T * u);
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
            uint4 xx = PRO == DG_LN ? dg_xs[(size_t)b * nc + c] : __ldg(xg + (size_t)b * nc + c);
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
    __syncthreads();                                // every warp's partial sums are written

    if (EPI == DG_ROPE) {                           // thread b: both rows of the pair, row b
        if (t >= nb) return;
        const int bb = b0 + t, half_d = D / 2, p = blockIdx.x, j = p / half_d, i = p % half_d;
        float s0 = part[0][t] + part[1][t] + part[2][t] + part[3][t];
        float s1 = part[0][BT + t] + part[1][BT + t] + part[2][BT + t] + part[3][BT + t];
        float x1 = __half2float(__float2half_rn(s0)), x2 = __half2float(__float2half_rn(s1));
        const int tpos = seq_lens[bb] - 1;
        __half ya, yb;
        if (j < H + Hkv) {                          // q or k: rotated at the row's position
            float cs, sn;
            rope_angle(max(tpos, 0), i, D, log2_base, &cs, &sn);
            ya = __float2half(x1 * cs - x2 * sn);
            yb = __float2half(x2 * cs + x1 * sn);
        } else {
            ya = __float2half(x1);
            yb = __float2half(x2);
        }
        if (j < H) {
            long long o = ((long long)bb * H + j) * D;
            q_out[o + i] = ya;
            q_out[o + i + half_d] = yb;
            return;
        }
        if (tpos < 0 || tpos >= MB * BS) return;    // no slot: attention gives NaN
        int blk = block_table[(long long)bb * MB + tpos / BS];
        if (blk < 0 || blk >= NB) return;
        int kvh = j < H + Hkv ? j - H : j - H - Hkv;
        __half* pool = j < H + Hkv ? k_pool : v_pool;
        long long dst = (((long long)blk * Hkv + kvh) * BS + tpos % BS) * D;
        pool[dst + i] = ya;
        pool[dst + i + half_d] = yb;
        return;
    }
    if (t < R * BT) {
        int r = t / BT, b = t % BT;
        if (r < nr && b < nb) {
            float s = part[0][t] + part[1][t] + part[2][t] + part[3][t];
            size_t o = (size_t)(b0 + b) * N + n0 + r;
            if (EPI == DG_STORE) y[o] = __float2half_rn(s);
            if (EPI == DG_GELU) y[o] = __float2half_rn(gelu_tanh(__half2float(__float2half_rn(s))));
            if (EPI == DG_RESIDUAL) res[o] += __half2float(__float2half_rn(s));
        }
    }
}

#define DGEMV(NAME, PRO, EPI, BT)                                                              \
    extern "C" __global__ void __launch_bounds__(128) dgemv_##NAME##_b##BT(                    \
        const void* __restrict__ x, const __half* __restrict__ W, __half* y, float* res,        \
        const float* __restrict__ gamma, const float* __restrict__ beta, float eps,             \
        int ln_threads, int B, int N, int K, __half* q_out, __half* k_pool, __half* v_pool,     \
        const int* __restrict__ block_table, const int* __restrict__ seq_lens, int H, int Hkv,  \
        int D, int NB, int BS, int MB, float log2_base) {                                       \
        dgemv_body<BT, PRO, EPI>(x, W, y, res, gamma, beta, eps, ln_threads, B, N, K, q_out,    \
                                 k_pool, v_pool, block_table, seq_lens, H, Hkv, D, NB, BS, MB,  \
                                 log2_base);                                                    \
    }
#define DGEMV_ALL(NAME, PRO, EPI) \
    DGEMV(NAME, PRO, EPI, 1) DGEMV(NAME, PRO, EPI, 2) DGEMV(NAME, PRO, EPI, 4) DGEMV(NAME, PRO, EPI, 8)
DGEMV_ALL(ln_rope, DG_LN, DG_ROPE)
DGEMV_ALL(plain_residual, DG_PLAIN, DG_RESIDUAL)
DGEMV_ALL(ln_gelu, DG_LN, DG_GELU)
DGEMV_ALL(ln_store, DG_LN, DG_STORE)
#undef DGEMV_ALL
#undef DGEMV
