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
//   paged_rope_append_v1  the QKV projection of each request's new token, qkv (B, H + 2 Hkv, D)
//                     (query heads, then key heads, then value heads): q and k rotated by RoPE
//                     at the request's own position seq_lens[b] - 1 (rope.cu's rope_qkv_v1 with
//                     a position per row), q to q_out (B, H, D), k and v into the pool; a thread
//                     per rotated pair. In a batch of requests at different positions this is
//                     what rope_qkv_v1 (one position for the batch) cannot do
//   paged_write_v1    a prompt's keys and values from prefill, k, v (Hkv, T, D) dense, into the
//                     blocks of its table row at positions 0..n-1 (n read from the GPU: rows past
//                     it are a padded prefill's padding); a thread per 16 bytes of K and of V
//   paged_decode_v1   one block per (KV head, request, split): the split's keys are read once
//                     for the G query heads that share them (GQA's saving: G times fewer bytes
//                     than one block per query head). A thread per key computes G scores; a warp
//                     per query head takes their max m and sum l of 2^(s - m); threads over D
//                     sum o = sum_j 2^(s_j - m) v_j. The split's (m, l, o) go to float32
//                     partials: no split waits for another
//   paged_decode_v2   the same split and partials, with the loads that v1 issues one at a time
//                     batched: a thread's K row is read as up to 8 independent 16-byte loads
//                     issued together (v1 waits on each before the next), and P V is computed by
//                     threads that own 8 consecutive columns (one 16-byte load of a V row per
//                     key, where v1 loads 2 bytes per key and thread), two keys in flight; the
//                     partial sums of a warp's key phases are combined by shuffles, then over
//                     the 4 warps in shared memory; instantiated per group size (1, 2, 4, 8
//                     query heads per KV head: v1 holds PAGED_GMAX sums whatever the group)
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
// common.cuh: warp_max, warp_sum, rope_angle
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

// qkv: (B, H + 2 Hkv, D); q_out: (B, H, D); launch: grid = ceil_div(B (H + Hkv) D / 2, 256),
// block = 256
extern "C" __global__ void paged_rope_append_v1(const __half* __restrict__ qkv, __half* q_out,
                                                __half* k_pool, __half* v_pool,
                                                const int* __restrict__ block_table,
                                                const int* __restrict__ seq_lens, int B, int H,
                                                int Hkv, int D, int NB, int BS, int MB,
                                                float log2_base) {
    const int half_d = D / 2, heads = H + Hkv;          // rotated heads: q's and k's
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * heads * half_d) return;
    int i = (int)(idx % half_d), j = (int)((idx / half_d) % heads);
    int b = (int)(idx / ((long long)half_d * heads));
    int t = seq_lens[b] - 1;
    const __half* row = qkv + (long long)b * (H + 2 * Hkv) * D;
    const __half* x = row + (long long)j * D;
    float c, s;
    rope_angle(max(t, 0), i, D, log2_base, &c, &s);
    float x1 = __half2float(x[i]), x2 = __half2float(x[i + half_d]);
    __half ya = __float2half(x1 * c - x2 * s), yb = __float2half(x2 * c + x1 * s);
    if (j < H) {                                        // a query head: out for attention
        long long o = ((long long)b * H + j) * D;
        q_out[o + i] = ya;
        q_out[o + i + half_d] = yb;
        return;
    }
    if (t < 0 || t >= MB * BS) return;                  // no slot: attention gives NaN
    int blk = block_table[(long long)b * MB + t / BS];
    if (blk < 0 || blk >= NB) return;
    int kvh = j - H;
    long long dst = (((long long)blk * Hkv + kvh) * BS + t % BS) * D;
    const __half* v = row + (long long)(H + Hkv + kvh) * D;
    k_pool[dst + i] = ya;
    k_pool[dst + i + half_d] = yb;
    v_pool[dst + i] = v[i];
    v_pool[dst + i + half_d] = v[i + half_d];
}

// k, v: (Hkv, T, D); row: (MB); n_dev: (1); launch: grid = ceil_div(Hkv T D / 8, 256), block = 256
extern "C" __global__ void paged_write_v1(const __half* __restrict__ k,
                                          const __half* __restrict__ v, __half* k_pool,
                                          __half* v_pool, const int* __restrict__ row,
                                          const int* __restrict__ n_dev, int T, int Hkv, int D,
                                          int NB, int BS, int MB) {
    const int C = D / 8;                                // 16-byte pieces of a row
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)Hkv * T * C) return;
    int c = (int)(i % C), t = (int)((i / C) % T), h = (int)(i / ((long long)C * T));
    if (t >= *n_dev || t >= MB * BS) return;            // padding, or past the table
    int blk = row[t / BS];
    if (blk < 0 || blk >= NB) return;
    long long src = ((long long)h * T + t) * D + c * 8;
    long long dst = (((long long)blk * Hkv + h) * BS + t % BS) * D + c * 8;
    *reinterpret_cast<uint4*>(k_pool + dst) = *reinterpret_cast<const uint4*>(k + src);
    *reinterpret_cast<uint4*>(v_pool + dst) = *reinterpret_cast<const uint4*>(v + src);
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

// launch: as paged_decode_v1, dynamic smem = 4 (G D + G TS + 4 G D) + 4 bps + 16 bytes; the
// instantiation paged_decode_v2_gGM with GM the power of two >= G (registers: GM x 8 sums)
template <int GM>
__device__ __forceinline__ void paged_decode_v2_body(
    const __half* __restrict__ q, const __half* __restrict__ k_pool,
    const __half* __restrict__ v_pool, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, float* __restrict__ m_part, float* __restrict__ l_part,
    float* __restrict__ o_part, int H, int Hkv, int D, int NB, int BS, int MB, int bps,
    float scale_log2) {
    const int kvh = blockIdx.x, b = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    const int G = H / Hkv, TS = bps * BS, tid = threadIdx.x, nt = blockDim.x;
    extern __shared__ float4 pd2_smem[];
    float* qs = reinterpret_cast<float*>(pd2_smem);        // (G, D) queries, scaled
    float* sc = qs + G * D;                             // (G, TS) scores, then 2^(s - m)
    float* part = sc + G * TS;                          // (4 warps, G, D) partial P V sums
    int* bt = reinterpret_cast<int*>(part + (nt >> 5) * G * D);   // (bps) the split's blocks
    __shared__ float ms[GM], ls[GM];

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

    // 1. scores: a thread per key; the row's D / 8 16-byte pieces loaded together, then G dots
    const int C = D / 8;
    int mybad = 0;
    for (int j = tid; j < n; j += nt) {
        int blk = bt[j / BS];
        float acc[GM] = {};
        if (blk < 0 || blk >= NB) {
            mybad = 1;
        } else {
            const uint4* kr = reinterpret_cast<const uint4*>(
                k_pool + (((long long)blk * Hkv + kvh) * BS + j % BS) * D);
            for (int c0 = 0; c0 < C; c0 += 8) {         // D <= 64: one pass; 128: two
                uint4 raw[8];
#pragma unroll
                for (int c = 0; c < 8; ++c)
                    if (c0 + c < C) raw[c] = kr[c0 + c];
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                if (c0 + c < C) {
                    const __half2* h2 = reinterpret_cast<const __half2*>(&raw[c]);
                    float kf[8];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float2 f = __half22float2(h2[i]);
                        kf[2 * i] = f.x;
                        kf[2 * i + 1] = f.y;
                    }
#pragma unroll
                    for (int g = 0; g < GM; ++g) {
                        if (g < G) {
                            const float* qg = qs + g * D + (c0 + c) * 8;
#pragma unroll
                            for (int i = 0; i < 8; ++i) acc[g] += qg[i] * kf[i];
                        }
                    }
                }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GM; ++g)
            if (g < G) sc[g * TS + j] = acc[g];
    }
    const int bad = __syncthreads_or(mybad) || len > MB * BS;

    // 2. per query head, a warp: m, p = 2^(s - m) in place, l (as v1)
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

    // 3. o = sum_j p_j v_j: lane owns columns 8 c .. 8 c + 7 of V (c = lane % C) for the keys
    //    of its phase (lane / C within the warp, then the warp): 32 / C phases per warp
    const int c = lane % C, ph = warp * (32 / C) + lane / C, nph = (nt >> 5) * (32 / C);
    float acc[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    for (int j = ph; j < n; j += 2 * nph) {
        int j2 = j + nph;
        int blk = bt[j / BS], blk2 = j2 < n ? bt[j2 / BS] : -1;
        uint4 r1 = make_uint4(0, 0, 0, 0), r2 = make_uint4(0, 0, 0, 0);
        bool ok1 = blk >= 0 && blk < NB, ok2 = blk2 >= 0 && blk2 < NB;
        if (ok1)
            r1 = reinterpret_cast<const uint4*>(
                v_pool + (((long long)blk * Hkv + kvh) * BS + j % BS) * D)[c];
        if (ok2)
            r2 = reinterpret_cast<const uint4*>(
                v_pool + (((long long)blk2 * Hkv + kvh) * BS + j2 % BS) * D)[c];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (u == 0 ? !ok1 : !ok2) continue;
            int jj = u == 0 ? j : j2;
            const __half2* h2 = reinterpret_cast<const __half2*>(u == 0 ? &r1 : &r2);
            float vf[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float2 f = __half22float2(h2[i]);
                vf[2 * i] = f.x;
                vf[2 * i + 1] = f.y;
            }
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                if (g < G) {
                    float p = sc[g * TS + jj];
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * vf[i];
                }
            }
        }
    }
    // the warp's phases (lanes c, c + C, c + 2C, ...) summed by shuffles, then the 4 warps
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (g < G) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float v = acc[g][i];
                for (int o = C; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                acc[g][i] = v;
            }
            if (lane < C) {
#pragma unroll
                for (int i = 0; i < 8; ++i) part[(warp * G + g) * D + c * 8 + i] = acc[g][i];
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += nt) {
        int g = e / D;
        float o = 0.0f;
        for (int w = 0; w < (nt >> 5); ++w) o += part[w * G * D + e];
        o_part[(head0 + (long long)g * S) * D + (e - g * D)] = o;
    }
    if (tid < G) {
        m_part[head0 + (long long)tid * S] = bad ? NAN : ms[tid];
        l_part[head0 + (long long)tid * S] = bad ? NAN : ls[tid];
    }
}

#define PAGED_DECODE_V2(GM)                                                                    \
    extern "C" __global__ void __launch_bounds__(PAGED_THREADS) paged_decode_v2_g##GM(           \
        const __half* __restrict__ q, const __half* __restrict__ k_pool,                         \
        const __half* __restrict__ v_pool, const int* __restrict__ block_table,                  \
        const int* __restrict__ seq_lens, float* __restrict__ m_part,                            \
        float* __restrict__ l_part, float* __restrict__ o_part, int H, int Hkv, int D, int NB,   \
        int BS, int MB, int bps, float scale_log2) {                                             \
        paged_decode_v2_body<GM>(q, k_pool, v_pool, block_table, seq_lens, m_part, l_part,       \
                                 o_part, H, Hkv, D, NB, BS, MB, bps, scale_log2);                \
    }
PAGED_DECODE_V2(1)
PAGED_DECODE_V2(2)
PAGED_DECODE_V2(4)
PAGED_DECODE_V2(8)

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
