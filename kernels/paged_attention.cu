// paged_attention.cu: decode attention over a paged KV cache, split over the keys
// (flash-decoding), with grouped-query heads (Chapter 12).
//
// The cache is one pool of fixed-size blocks shared by every request (vLLM's layout idea):
//   k_pool, v_pool  (NB, Hkv, BS, D) fp16: block p holds BS consecutive positions of one request
//                   for every KV head; position t of request b lives in block
//                   block_table[b, t / BS], slot t % BS.
//   block_table     (B, MB) int32: each request's physical blocks in order (-1 past its end).
//   seq_lens        (B,) int32: the tokens in the cache of each request, the new one included.
//   q               (B, H, D) fp16: one new query per request; H = G Hkv and query head h reads
//                   KV head h / G (grouped-query attention; G = 1 is multi-head attention).
//   out             (B, H, D) fp16.
// Scores are kept in the exp2 domain: q is scaled by scale_log2 = log2(e) / sqrt(D) on loading.
//
// kernels
//   paged_append_v1   k, v (B, Hkv, D) of the new token -> the pool at position seq_lens[b] - 1;
//                     one thread per element
//   paged_decode_v1   one block per (KV head, request, split): the split's keys are read once
//                     for the G query heads that share them (GQA's saving: G times fewer bytes
//                     than one block per query head). A thread per key computes G scores; a warp
//                     per query head takes their max m and sum l of 2^(s - m); threads over D
//                     sum o = sum_j 2^(s_j - m) v_j. The split's (m, l, o) go to float32
//                     partials: no split waits for another
//   paged_merge_v1    per (request, query head): M = max_s m_s and
//                     out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
//                     (an empty split has m = -inf, l = 0, o = 0 and weighs nothing)
//
// Splits: split s of a request covers its logical blocks [s bps, (s + 1) bps); a short request
// leaves its later splits empty. Why split at all: at batch 1 there are only Hkv blocks of work
// without it, a few SMs of 132; splitting the keys puts Hkv B S blocks on the GPU, and the merge
// costs S (D + 2) floats per query head.
//
// A kernel cannot raise: a block id outside [0, NB) or a sequence longer than the table makes
// that query head's output NaN (never another request's data, never an out-of-bounds read);
// paged_attention_launch.py checks the table on the host when asked.
// traffic per split: its keys and values once (2 BS D bytes per block and KV head), the G
// queries, and S (D + 2) floats of partials per query head written and read once.
// common.cuh: warp_max, warp_sum
#include <cuda_fp16.h>
#include "common.cuh"

#define PAGED_GMAX 8        // query heads per KV head (the group), at most
#define PAGED_THREADS 128

// k, v: (B, Hkv, D); launch: grid = ceil_div(B Hkv D, 256), block = 256
extern "C" __global__ void paged_append_v1(const __half* __restrict__ k,
                                           const __half* __restrict__ v, __half* k_pool,
                                           __half* v_pool, const int* __restrict__ block_table,
                                           const int* __restrict__ seq_lens, int B, int Hkv,
                                           int D, int NB, int BS, int MB) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * Hkv * D) return;
    int d = (int)(i % D), kvh = (int)((i / D) % Hkv), b = (int)(i / ((long long)D * Hkv));
    int t = seq_lens[b] - 1;
    if (t < 0 || t >= MB * BS) return;                // no slot: the launcher refuses this
    int blk = block_table[(long long)b * MB + t / BS];
    if (blk < 0 || blk >= NB) return;
    long long dst = (((long long)blk * Hkv + kvh) * BS + t % BS) * D + d;
    k_pool[dst] = k[i];
    v_pool[dst] = v[i];
}

// launch: grid = (Hkv, B, S), block = PAGED_THREADS (a multiple of D: D in {16, 32, 64, 128}),
//         dynamic smem = 4 (G D + G TS + (PAGED_THREADS / D) G D) + 4 bps + 16 bytes,
//         TS = bps BS (the split's most keys)
// m_part, l_part: (B, H, S) float32; o_part: (B, H, S, D) float32
extern "C" __global__ void __launch_bounds__(PAGED_THREADS) paged_decode_v1(
    const __half* __restrict__ q, const __half* __restrict__ k_pool,
    const __half* __restrict__ v_pool, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, float* __restrict__ m_part, float* __restrict__ l_part,
    float* __restrict__ o_part, int H, int Hkv, int D, int NB, int BS, int MB, int bps,
    float scale_log2) {
    const int kvh = blockIdx.x, b = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    const int G = H / Hkv, TS = bps * BS, tid = threadIdx.x, nt = blockDim.x;
    const int nph = nt / D;                             // key phases of the P V sum
    extern __shared__ float4 smem4[];
    float* qs = reinterpret_cast<float*>(smem4);        // (G, D) queries, scaled
    float* sc = qs + G * D;                             // (G, TS) scores, then 2^(s - m)
    float* part = sc + G * TS;                          // (nph, G, D) partial P V sums
    int* bt = reinterpret_cast<int*>(part + nph * G * D);   // (bps) the split's block ids
    __shared__ float ms[PAGED_GMAX], ls[PAGED_GMAX];

    int len = seq_lens[b];
    int t0 = s * TS, n = min(len, min(MB * BS, t0 + TS)) - t0;   // keys of this split
    long long head0 = ((long long)b * H + (long long)kvh * G) * S + s;   // (b, h0, s)
    if (n <= 0) {                                       // an empty split (uniform per block)
        for (int e = tid; e < G * D; e += nt) {
            int g = e / D;
            o_part[(head0 + (long long)g * S) * D + (e - g * D)] = 0.0f;
        }
        if (tid < G) {
            m_part[head0 + (long long)tid * S] = -INFINITY;
            l_part[head0 + (long long)tid * S] = len > MB * BS || len <= 0 ? NAN : 0.0f;
        }
        return;
    }
    for (int e = tid; e < G * D; e += nt) {
        int g = e / D;
        qs[e] = __half2float(q[((long long)b * H + kvh * G + g) * D + (e - g * D)]) * scale_log2;
    }
    for (int i = tid; i < bps; i += nt) {
        int lb = s * bps + i;
        bt[i] = lb < MB ? block_table[(long long)b * MB + lb] : -1;
    }
    __syncthreads();

    // 1. scores: a thread per key, its K row in 16-byte pieces, G dot products
    int mybad = 0;
    for (int j = tid; j < n; j += nt) {
        int blk = bt[j / BS];
        float acc[PAGED_GMAX] = {};
        if (blk < 0 || blk >= NB) {
            mybad = 1;
        } else {
            const uint4* kr = reinterpret_cast<const uint4*>(
                k_pool + (((long long)blk * Hkv + kvh) * BS + j % BS) * D);
            for (int c = 0; c < D / 8; ++c) {
                uint4 raw = kr[c];
                const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
                float kf[8];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float2 f = __half22float2(h2[i]);
                    kf[2 * i] = f.x;
                    kf[2 * i + 1] = f.y;
                }
#pragma unroll
                for (int g = 0; g < PAGED_GMAX; ++g) {
                    if (g < G) {
                        const float* qg = qs + g * D + c * 8;
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[g] += qg[i] * kf[i];
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < PAGED_GMAX; ++g)
            if (g < G) sc[g * TS + j] = acc[g];
    }
    // a bad block id anywhere in the split, or a sequence longer than the table: NaN below
    const int bad = __syncthreads_or(mybad) || len > MB * BS;

    // 2. per query head, a warp: m = max of its scores, p = 2^(s - m) in place, l = sum of p
    const int lane = tid & 31, warp = tid >> 5;
    for (int g = warp; g < G; g += nt >> 5) {
        float m = -INFINITY;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g * TS + j]);
        m = warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float p = exp2f(sc[g * TS + j] - m);
            sc[g * TS + j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ms[g] = m;
            ls[g] = l;
        }
    }
    __syncthreads();

    // 3. o = sum_j p_j v_j: a thread per (phase, d); phase ph takes keys ph, ph + nph, ...
    const int d = tid % D, ph = tid / D;
    float acc[PAGED_GMAX] = {};
    if (ph < nph) {
        for (int j = ph; j < n; j += nph) {
            int blk = bt[j / BS];
            if (blk < 0 || blk >= NB) continue;
            float vv = __half2float(v_pool[(((long long)blk * Hkv + kvh) * BS + j % BS) * D + d]);
#pragma unroll
            for (int g = 0; g < PAGED_GMAX; ++g)
                if (g < G) acc[g] += sc[g * TS + j] * vv;
        }
#pragma unroll
        for (int g = 0; g < PAGED_GMAX; ++g)
            if (g < G) part[(ph * G + g) * D + d] = acc[g];
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += nt) {
        int g = e / D;
        float o = 0.0f;
        for (int p = 0; p < nph; ++p) o += part[p * G * D + e];
        o_part[(head0 + (long long)g * S) * D + (e - g * D)] = o;
    }
    if (tid < G) {
        m_part[head0 + (long long)tid * S] = bad ? NAN : ms[tid];
        l_part[head0 + (long long)tid * S] = bad ? NAN : ls[tid];
    }
}

// launch: grid = (H, B), block = 128; out (B, H, D) fp16
extern "C" __global__ void paged_merge_v1(const float* __restrict__ m_part,
                                          const float* __restrict__ l_part,
                                          const float* __restrict__ o_part, __half* out, int H,
                                          int D, int S) {
    const int h = blockIdx.x, b = blockIdx.y;
    const long long head = ((long long)b * H + h) * S;
    float M = -INFINITY;
    bool nan = false;
    for (int s = 0; s < S; ++s) {
        float m = m_part[head + s];
        nan |= isnan(m) || isnan(l_part[head + s]);
        M = fmaxf(M, m);
    }
    float den = 0.0f;
    for (int s = 0; s < S; ++s) den += exp2f(m_part[head + s] - M) * l_part[head + s];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < S; ++s) num += exp2f(m_part[head + s] - M) * o_part[(head + s) * D + d];
        out[((long long)b * H + h) * D + d] = __float2half(nan ? NAN : num / den);
    }
}
