// kvcache.cu: the KV cache of decoding: append the new keys/values, attend over the cache.
//
//   The caches kc, vc are (B, H, L, D) fp16 for one layer: L positions preallocated, position p
//   of sequence b and head h at ((b * H + h) * L + p) * D. A decode step appends one token per
//   sequence at its position p and attends over positions 0..p: the new query sees every
//   earlier token and itself, never a later one (there is none in the cache yet).
//
//   kv_append_v1        k, v (B*T, H, D) rows with a row stride -> kc, vc at positions
//                       pos..pos+T-1 (pos = pos0 + *pos_dev). One thread per element.
//   decode_attention_v1 one query per (sequence, head) against n cached keys: one block of 4
//                       warps per (h, b); a warp per key for the scores (lanes split D, 4-byte
//                       loads, a warp sum), softmax in shared memory, then each warp sums p_j v_j
//                       over its keys and the 4 partial outputs are added. O(n D) reads, no tiles.
//                       Latency-bound: a warp's next key waits for the shuffles of the last one.
//   decode_attention_v2 a thread per key for the scores (16-byte loads, 8 of them in flight,
//                       no shuffles in the loop), 8 warps; the p_j v_j sum unrolled by 4 keys
//                       per warp so 4 rows of V are in flight.
//   merge_heads_v1      o (B, H, T, D) -> y (B*T, H*D): the attention output back in rows for
//                       the output projection (a transpose of the middle axes).
//   advance_v1          the step counter of a captured decode step: history[b, p+1] = tok[b],
//                       then *pos = p + 1 (one block; a CUDA graph replays it with the step).
//
// Launches (kernels/kvcache_launch.py): kv_append and merge_heads one thread per element
// (grid ceil(n / 256) x 256); decode_attention grid (H, B) x 128 (v1) or 256 (v2) threads with
// L floats of dynamic shared memory; advance 1 block of 32 * ceil(B / 32) threads.
#include <cuda_fp16.h>
#include "common.cuh"

// k, v: (B*T, H, D) with row stride `stride` (elements); kc, vc: (B, H, L, D)
extern "C" __global__ void kv_append_v1(const __half* k, const __half* v, long long stride,
                                        __half* kc, __half* vc, int B, int T, int H, int D,
                                        int L, int pos0, const int* pos_dev) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * T * H * D) return;
    int e = (int)(idx % D);
    int h = (int)((idx / D) % H);
    int t = (int)((idx / ((long long)D * H)) % T);
    int b = (int)(idx / ((long long)D * H * T));
    int p = pos0 + t + (pos_dev ? *pos_dev : 0);
    if (p >= L) return;                       // the launcher refuses this; never write past the cache
    long long src = ((long long)b * T + t) * stride + (long long)h * D + e;
    long long dst = (((long long)b * H + h) * L + p) * D + e;
    kc[dst] = k[src];
    vc[dst] = v[src];
}

// q: (B, H, D) rows with stride q_stride between sequences; kc, vc: (B, H, L, D);
// out: (B, H * D). Keys 0..n-1 with n = n_keys + (pos_dev ? *pos_dev + 1 : 0).
// scale_log2 = log2(e) / sqrt(D): scores in the exp2 domain. D even, D <= 256.
extern "C" __global__ void __launch_bounds__(128) decode_attention_v1(
        const __half* q, long long q_stride, const __half* kc, const __half* vc, __half* out,
        int H, int D, int L, int n_keys, const int* pos_dev, float scale_log2) {
    extern __shared__ float s[];                   // n scores (L floats reserved)
    __shared__ float qs[256];
    __shared__ float part[4][256];                 // each warp's partial output
    __shared__ float red[BLOCK_REDUCE_SMEM];
    int h = blockIdx.x, b = blockIdx.y, H_ = H;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = n_keys + (pos_dev ? *pos_dev + 1 : 0);
    if (n > L) n = L;                              // the launcher refuses this
    const __half* qrow = q + b * q_stride + (long long)h * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) qs[e] = __half2float(qrow[e]) * scale_log2;
    __syncthreads();
    const __half* K = kc + ((long long)b * H_ + h) * L * D;
    const __half* V = vc + ((long long)b * H_ + h) * L * D;
    // scores: a warp per key, lanes over D in pairs (half2)
    float m = -INFINITY;
    for (int j = warp; j < n; j += 4) {
        const __half2* kr = reinterpret_cast<const __half2*>(K + (long long)j * D);
        float acc = 0.0f;
        for (int e = lane; e < D / 2; e += 32) {
            float2 kv = __half22float2(kr[e]);
            acc += qs[2 * e] * kv.x + qs[2 * e + 1] * kv.y;
        }
        acc = warp_sum(acc);
        if (lane == 0) s[j] = acc;
        m = fmaxf(m, acc);
    }
    m = block_max(m, red);                         // its barriers also publish s[]
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float p = exp2f(s[j] - m);
        s[j] = p;
        l += p;
    }
    l = block_sum(l, red);                         // and publish the probabilities
    // output: a warp per key again, lanes over D in pairs, partial sums per warp
    float acc[4][2];                                // D <= 256: up to 4 pairs per lane
#pragma unroll
    for (int c = 0; c < 4; c++) acc[c][0] = acc[c][1] = 0.0f;
    for (int j = warp; j < n; j += 4) {
        const __half2* vr = reinterpret_cast<const __half2*>(V + (long long)j * D);
        float p = s[j];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int e = lane + 32 * c;
            if (e < D / 2) {
                float2 vv = __half22float2(vr[e]);
                acc[c][0] += p * vv.x;
                acc[c][1] += p * vv.y;
            }
        }
    }
#pragma unroll
    for (int c = 0; c < 4; c++) {
        int e = lane + 32 * c;
        if (e < D / 2) {
            part[warp][2 * e] = acc[c][0];
            part[warp][2 * e + 1] = acc[c][1];
        }
    }
    __syncthreads();
    __half* orow = out + ((long long)b * H_ + h) * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x)
        orow[e] = __float2half((part[0][e] + part[1][e] + part[2][e] + part[3][e]) / l);
}

// the same contract as v1; D a multiple of 8, D <= 256; 256 threads
extern "C" __global__ void __launch_bounds__(256) decode_attention_v2(
        const __half* q, long long q_stride, const __half* kc, const __half* vc, __half* out,
        int H, int D, int L, int n_keys, const int* pos_dev, float scale_log2) {
    extern __shared__ float s[];                   // n scores (L floats reserved)
    __shared__ float qs[256];
    __shared__ float part[8][256];                 // each warp's partial output
    __shared__ float red[BLOCK_REDUCE_SMEM];
    int h = blockIdx.x, b = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = n_keys + (pos_dev ? *pos_dev + 1 : 0);
    if (n > L) n = L;                              // the launcher refuses this
    const __half* qrow = q + b * q_stride + (long long)h * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) qs[e] = __half2float(qrow[e]) * scale_log2;
    __syncthreads();
    const __half* K = kc + ((long long)b * H + h) * L * D;
    const __half* V = vc + ((long long)b * H + h) * L * D;
    // scores: a thread per key, its row in 16-byte pieces (all independent loads)
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const uint4* kr = reinterpret_cast<const uint4*>(K + (long long)j * D);
        float acc = 0.0f;
        for (int c0 = 0; c0 < D / 8; c0 += 8) {    // 64 elements: 8 loads issued, then used
            uint4 raw[8];
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (c0 + c < D / 8) raw[c] = kr[c0 + c];
#pragma unroll
            for (int c = 0; c < 8; c++) {
                if (c0 + c >= D / 8) break;
                const __half2* k2 = reinterpret_cast<const __half2*>(&raw[c]);
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    float2 kv = __half22float2(k2[t]);
                    int e = 8 * (c0 + c) + 2 * t;
                    acc += qs[e] * kv.x + qs[e + 1] * kv.y;
                }
            }
        }
        s[j] = acc;
        m = fmaxf(m, acc);
    }
    m = block_max(m, red);                         // its barriers also publish s[]
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float p = exp2f(s[j] - m);
        s[j] = p;
        l += p;
    }
    l = block_sum(l, red);                         // and publish the probabilities
    float acc[4][2];
#pragma unroll
    for (int c = 0; c < 4; c++) acc[c][0] = acc[c][1] = 0.0f;
#pragma unroll 4
    for (int j = warp; j < n; j += 8) {
        const __half2* vr = reinterpret_cast<const __half2*>(V + (long long)j * D);
        float p = s[j];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int e = lane + 32 * c;
            if (e < D / 2) {
                float2 vv = __half22float2(vr[e]);
                acc[c][0] += p * vv.x;
                acc[c][1] += p * vv.y;
            }
        }
    }
#pragma unroll
    for (int c = 0; c < 4; c++) {
        int e = lane + 32 * c;
        if (e < D / 2) {
            part[warp][2 * e] = acc[c][0];
            part[warp][2 * e + 1] = acc[c][1];
        }
    }
    __syncthreads();
    __half* orow = out + ((long long)b * H + h) * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) o += part[w][e];
        orow[e] = __float2half(o / l);
    }
}

// o: (B, H, T, D) -> y: (B*T, H*D)
extern "C" __global__ void merge_heads_v1(const __half* o, __half* y, int B, int H, int T, int D) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * H * T * D) return;
    int e = (int)(idx % D);
    int h = (int)((idx / D) % H);
    int t = (int)((idx / ((long long)D * H)) % T);
    int b = (int)(idx / ((long long)D * H * T));
    y[idx] = o[(((long long)b * H + h) * T + t) * D + e];
}

// tok: (B,) the tokens just chosen; history: (B, n_hist); pos: the step counter
extern "C" __global__ void advance_v1(int* pos, const int* tok, int* history, int B, int n_hist) {
    int p = *pos;
    __syncthreads();                               // everyone has read pos before it changes
    for (int b = threadIdx.x; b < B; b += blockDim.x)
        if (p + 1 < n_hist) history[(long long)b * n_hist + p + 1] = tok[b];
    if (threadIdx.x == 0) *pos = p + 1;
}
