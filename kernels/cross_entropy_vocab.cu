// cross_entropy_vocab.cu: the language model's cross-entropy over the vocabulary, forward and
// backward fused, the gradient written in place of the logits (capstone: the training step).
//
// Shapes: logits (M, Vp) bf16, row-major, contiguous, 16-byte aligned, Vp a multiple of 8 (the
// padded vocabulary, 50304 for GPT-2: columns j >= V are not part of the softmax); targets (M,)
// int32 or int64, read as they are (a kernel for each: _i32, _i64); losses (M,) fp32; dlogits
// (M, Vp) bf16: the logits themselves (in place, so no second (M, Vp) tensor lives until the
// backward) or a separate buffer that does not overlap them. One block per row. With
// z = float(logits[i, :V]), m = max z, d = sum_j exp(z_j - m) and t = targets[i], in fp32:
//     losses[i]     = log d + m - z_t                    (= logsumexp(z) - z_t)
//     dlogits[i, j] = bf16((exp(z_j - m) / d - [j == t]) * scale)      j < V
//     dlogits[i, j] = 0                                                V <= j < Vp
// scale = 1/M is the gradient of the mean loss (1/count when rows are ignored).
// t == -1: an ignored row (PyTorch's ignore_index = -1): loss 0, gradient row 0, logits not read.
// t < -1 or t >= V: a kernel inside a CUDA graph cannot raise, so the row says so instead: its
// loss is NaN and its gradient NaN over j < V (0 in the padding), never a plausible number.
// In place is safe: each element is overwritten by the thread that read it, after its last read
// (the same loop iteration), and z_t is read before the first barrier, so before any write.
// Non-finite logits give a non-finite loss (a NaN logit: NaN loss and gradient row).
//
// kernels, simplest first (each line: what changed)
//   cross_entropy_vocab_v1_{i32,i64}   one block per row, three passes over the row (max, sum
//                                      of exp, gradient), one bf16 (2 bytes) per thread per load,
//                                      common.cuh's block_max / block_sum between the passes
//   cross_entropy_vocab_v2_{i32,i64}   online softmax: max and sum in ONE pass (a running (m, d)
//                                      per thread, rescaled when its max grows, merged over the
//                                      block with block_reduce + SumMaxOp), 16-byte loads of 8
//                                      bf16; then the gradient pass, 16-byte loads and stores:
//                                      the row is read twice instead of three times
//   cross_entropy_vocab_mean           out[0] = mean of losses (M,): one block; each thread sums
//                                      a fixed stride in double, then block_reduce (Sum<double>):
//                                      the same order on every run (no atomics), capture-safe
//
// traffic per row: each pass reads 2 Vp bytes, the gradient pass writes 2 Vp bytes. A GPT-2 row
// (Vp = 50304) is 100 KB: more than L1 keeps once several blocks share an SM, so every pass
// re-reads the row from L2, or from HBM when the rows in flight overflow L2 (8192 rows are
// 824 MB). v1 reads 3 x 100 KB per row and v2 2 x 100 KB, both write 100 KB: reading the row a
// second time is v2's cost (the gradient needs the final max and sum, known only after the
// whole row has been read once). The exponentials (two per element in v2) are __expf (MUFU).
#include <cuda_bf16.h>
#include "common.cuh"

// the row's target as a 64-bit integer, whichever width the caller stored it in
template <typename Tid>
__device__ __forceinline__ long long xent_target(const Tid* targets, size_t row) {
    return (long long)targets[row];
}

// An ignored row (loss 0, gradient 0) or a row with an invalid target (loss NaN, gradient NaN
// over j < V), one bf16 per thread per store; the padding j >= V stays 0 either way
__device__ __forceinline__ void xent_fill_row(__nv_bfloat16* g, float* loss, bool ignored, int V,
                                              int Vp) {
    float f = ignored ? 0.0f : NAN;
    __nv_bfloat16 b = __float2bfloat16_rn(f), zero = __float2bfloat16_rn(0.0f);
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) g[j] = j < V ? b : zero;
    if (threadIdx.x == 0) *loss = f;
}

// One row by the whole block, three passes over it (v1)
template <typename Tid>
__device__ void xent_v1_row(const __nv_bfloat16* logits, const Tid* targets, float* losses,
                            __nv_bfloat16* dlogits, int V, int Vp, float scale) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    size_t row = blockIdx.x;
    const __nv_bfloat16* z = logits + row * Vp;
    __nv_bfloat16* g = dlogits + row * Vp;
    long long t = xent_target(targets, row);          // the same for the whole block
    if (t < 0 || t >= V) {
        xent_fill_row(g, losses + row, t == -1, V, Vp);
        return;
    }
    float zt = threadIdx.x == 0 ? __bfloat162float(z[t]) : 0.0f;   // before any write
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, __bfloat162float(z[j]));
    m = block_max(m, sbuf);                           // pass 1: the max (common.cuh)
    float d = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) d += __expf(__bfloat162float(z[j]) - m);
    d = block_sum(d, sbuf);                           // pass 2: the sum of exp
    float inv = 1.0f / d;
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) {      // pass 3: the gradient
        float gj = 0.0f;
        if (j < V) gj = (__expf(__bfloat162float(z[j]) - m) * inv - (j == t ? 1.0f : 0.0f));
        g[j] = __float2bfloat16_rn(gj * scale);
    }
    if (threadIdx.x == 0) losses[row] = logf(d) + m - zt;
}

// the 8 bf16 of a 16-byte chunk starting at column j0, as floats; columns >= V become -inf
__device__ __forceinline__ void xent_unpack8(uint4 u, int j0, int V, float* v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = j0 + 2 * k < V ? f.x : -INFINITY;
        v[2 * k + 1] = j0 + 2 * k + 1 < V ? f.y : -INFINITY;
    }
}

// 8 floats rounded to bf16 (round to nearest even) and packed into 16 bytes
__device__ __forceinline__ uint4 xent_pack8(const float* v) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    return u;
}

// v2's ignored or invalid row, 16-byte stores (as xent_fill_row)
__device__ __forceinline__ void xent_fill_row8(uint4* g, float* loss, bool ignored, int V,
                                               int Vp) {
    float f = ignored ? 0.0f : NAN;
    for (int c = threadIdx.x; c < (Vp >> 3); c += blockDim.x) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = 8 * c + k < V ? f : 0.0f;
        g[c] = xent_pack8(v);
    }
    if (threadIdx.x == 0) *loss = f;
}

// One row by the whole block: the online pass for (m, d), then the gradient pass (v2)
template <typename Tid>
__device__ void xent_v2_row(const __nv_bfloat16* logits, const Tid* targets, float* losses,
                            __nv_bfloat16* dlogits, int V, int Vp, float scale) {
    __shared__ float sbuf[66];                        // SumMaxOp's partials, then the result
    float* sb = sbuf;
    size_t row = blockIdx.x;
    const uint4* z8 = reinterpret_cast<const uint4*>(logits + row * Vp);   // 16-byte rows
    uint4* g8 = reinterpret_cast<uint4*>(dlogits + row * Vp);
    int nc = Vp >> 3;                                 // 16-byte chunks of 8 bf16 per row
    long long t = xent_target(targets, row);
    if (t < 0 || t >= V) {
        xent_fill_row8(g8, losses + row, t == -1, V, Vp);
        return;
    }
    // z_t, before the first barrier and so before any write
    float zt = threadIdx.x == 0 ? __bfloat162float(logits[row * Vp + t]) : 0.0f;
    // pass 1: this thread's running max m and sum d of exp(z - m) over its chunks
    float m = -INFINITY, d = 0.0f;
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
        float v[8];
        xent_unpack8(z8[c], 8 * c, V, v);
        float cm = v[0];
#pragma unroll
        for (int k = 1; k < 8; ++k) cm = fmaxf(cm, v[k]);
        if (cm > m) {                                 // the max grew: rescale the sum so far
            d *= __expf(m - cm);
            m = cm;
        }
        float ms = safe_max(m);          // no valid value yet: exp(-inf - 0) = 0, not NaN
#pragma unroll
        for (int k = 0; k < 8; ++k) d += __expf(v[k] - ms);
    }
    // the block's (m, d): common.cuh's block_reduce with the online-softmax merge
    block_reduce(SumMax{d, m}, SumMaxOp{sb}, [=](SumMax r) {
        sb[64] = r.m;
        sb[65] = r.d;
    });
    m = sb[64];
    d = sb[65];
    float inv = 1.0f / d;
    // pass 2: the gradient, chunk by chunk, each written by the thread that read it
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
        float v[8];
        int j0 = 8 * c;
        xent_unpack8(z8[c], j0, V, v);
#pragma unroll
        for (int k = 0; k < 8; ++k)
            v[k] = j0 + k < V ? (__expf(v[k] - m) * inv - (j0 + k == t ? 1.0f : 0.0f)) * scale
                              : 0.0f;
        g8[c] = xent_pack8(v);
    }
    if (threadIdx.x == 0) losses[row] = logf(d) + m - zt;
}

// launch: grid = M, block = 256 (a multiple of 32, <= 1024), static shared memory 33 floats
extern "C" __global__ void cross_entropy_vocab_v1_i32(const __nv_bfloat16* logits,
                                                      const int* targets, float* losses,
                                                      __nv_bfloat16* dlogits, int V, int Vp,
                                                      float scale) {
    xent_v1_row<int>(logits, targets, losses, dlogits, V, Vp, scale);
}

// launch: as cross_entropy_vocab_v1_i32
extern "C" __global__ void cross_entropy_vocab_v1_i64(const __nv_bfloat16* logits,
                                                      const long long* targets, float* losses,
                                                      __nv_bfloat16* dlogits, int V, int Vp,
                                                      float scale) {
    xent_v1_row<long long>(logits, targets, losses, dlogits, V, Vp, scale);
}

// launch: grid = M, block = 32..512 threads (a multiple of 32: about 4 chunks of 8 per thread,
// at most 512), static shared memory 66 floats
extern "C" __global__ void cross_entropy_vocab_v2_i32(const __nv_bfloat16* logits,
                                                      const int* targets, float* losses,
                                                      __nv_bfloat16* dlogits, int V, int Vp,
                                                      float scale) {
    xent_v2_row<int>(logits, targets, losses, dlogits, V, Vp, scale);
}

// launch: as cross_entropy_vocab_v2_i32
extern "C" __global__ void cross_entropy_vocab_v2_i64(const __nv_bfloat16* logits,
                                                      const long long* targets, float* losses,
                                                      __nv_bfloat16* dlogits, int V, int Vp,
                                                      float scale) {
    xent_v2_row<long long>(logits, targets, losses, dlogits, V, Vp, scale);
}

// launch: grid = 1, block = 256 (a multiple of 32, <= 1024), static shared memory 33 doubles
extern "C" __global__ void cross_entropy_vocab_mean(const float* losses, float* out, int M) {
    __shared__ double sbuf[BLOCK_REDUCE_SMEM];
    double* sb = sbuf;
    double s = 0.0;
    for (int i = threadIdx.x; i < M; i += blockDim.x) s += (double)losses[i];
    block_reduce(s, Sum<double>{sb}, [=](double r) { sb[32] = r; });
    if (threadIdx.x == 0) out[0] = (float)(sb[32] / (double)M);
}
