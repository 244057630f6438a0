// adamw_flat.cu: the optimizer step of the training step, over ONE flat fp32 buffer:
// the global gradient norm, clipping (torch.nn.utils.clip_grad_norm_) and AdamW
// (torch.optim.AdamW), with the bf16 copy of the weights that the matmuls read written in the
// same pass.
//
// Shapes: p, g, m, v are float32 (n,), contiguous, n < 2^31: every parameter of the model in one
// buffer, ordered so that the n_decay parameters that get weight decay (the matrices) come first
// and the rest (LayerNorm gains and biases) after. shadow is bf16 (n,): bf16(p) after the update.
// state is int32 (ADAMW_STATE_INTS,) on the device (below): the step count lives there, so a
// CUDA graph that replays the step sees it grow, and lr may be read from device memory, so a
// schedule can change it between replays.
//
// One step, all on one stream, no host reads:
//   grad_norm_vN + grad_norm_finish   norm = sqrt(sum g^2) (skipped when the caller has it or
//                                     there is no clipping)
//   adamw_flat_count_step             t += 1; the step's scalars (bias corrections, lr, clip)
//   adamw_flat_vN                     for each i: gc = g * clip;  AdamW on (p, gc, m, v) with
//                                     wd for i < n_decay, 0 after;  shadow = bf16(p)
// Clipping as torch.nn.utils.clip_grad_norm_: clip = min(1, max_norm / (norm + 1e-6)), applied
// to g as it is read (g itself is not rewritten). AdamW as torch.optim.AdamW: see optim.cu and
// common.cuh's adamw_param (decoupled decay p *= 1 - lr wd, then the bias-corrected update).
//
// The norm is deterministic: each block writes one partial sum of squares (a fixed grid for a
// given n, a fixed order inside the block), then ONE block adds the partials in a fixed order in
// double: no atomics, the same bits on every run.
//
// kernels
//   grad_norm_v1           one element per thread; each block's sum of squares (block_sum) to
//                          partial[blockIdx.x]: ceil_div(n, 256) partials
//   grad_norm_v2           float4 loads, a grid-stride loop over a grid of at most
//                          GRAD_NORM_V2_BLOCKS blocks (a fixed number, not the GPU's SM count,
//                          so the sum's order depends on n only); the last n % 4 elements by
//                          block 0
//   grad_norm_finish       one block of 1024: the partials summed in double in a fixed order,
//                          out[0] = sqrt(sum)
//   adamw_flat_count_step  one thread: t += 1, then step_size, bc2_sqrt (adamw_coef), lr, clip
//   adamw_flat_v1          one element per thread
//   adamw_flat_v2          4 elements per thread: 16-byte loads and stores of p, g, m, v, an
//                          8-byte store of shadow; the thread owning the last n % 4 elements
//                          does them one at a time (p, g, m, v 16-byte aligned, shadow 8-byte
//                          aligned: the launcher checks)
//
// traffic: the norm reads 4n bytes; the update reads p, g, m, v (16n) and writes p, m, v and
// shadow (14n): 30n bytes, memory-bound.
// common.cuh: block_sum, block_reduce/Sum<double>, adamw_coef, adamw_param
#include <cuda_bf16.h>
#include "common.cuh"

// state (int32 words): [0] the step count t (0 before the first step); the float32 scalars of
// the current step, as bits: [1] step_size = lr / (1 - b1^t), [2] bc2_sqrt = sqrt(1 - b2^t),
// [3] lr, [4] clip (1 without clipping); [5..7] unused
#define ADAMW_STATE_INTS 8
// the most blocks grad_norm_v2 launches (the partials grad_norm_finish adds)
#define GRAD_NORM_V2_BLOCKS 1024

// launch: grid = ceil_div(n, 256), block = 256, BLOCK_REDUCE_SMEM floats of static shared memory
extern "C" __global__ void grad_norm_v1(const float* __restrict__ g, float* __restrict__ partial,
                                        int n) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float x = i < n ? g[i] : 0.0f;
    float s = block_sum(x * x, sbuf);                 // common.cuh
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// launch: grid = min(ceil_div(ceil_div(n, 4), 256), GRAD_NORM_V2_BLOCKS), block = 256,
// BLOCK_REDUCE_SMEM floats of static shared memory
extern "C" __global__ void grad_norm_v2(const float* __restrict__ g, float* __restrict__ partial,
                                        int n) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    long long n4 = n / 4;
    const float4* g4 = reinterpret_cast<const float4*>(g);
    float acc = 0.0f;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n4;
         c += (long long)gridDim.x * blockDim.x) {
        float4 x = g4[c];
        acc = fmaf(x.x, x.x, acc);
        acc = fmaf(x.y, x.y, acc);
        acc = fmaf(x.z, x.z, acc);
        acc = fmaf(x.w, x.w, acc);
    }
    if (blockIdx.x == 0 && threadIdx.x < n - 4 * n4) {    // the tail: at most 3 elements
        float x = g[4 * n4 + threadIdx.x];
        acc = fmaf(x, x, acc);
    }
    float s = block_sum(acc, sbuf);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// launch: grid = 1, block = 1024, 33 doubles of static shared memory
// thread j adds partials j, j + 1024, ... in that order; then the block's fixed tree
extern "C" __global__ void grad_norm_finish(const float* __restrict__ partial, int nparts,
                                            float* __restrict__ out) {
    __shared__ double sbuf[33];
    double acc = 0.0;
    for (int j = threadIdx.x; j < nparts; j += blockDim.x) acc += (double)partial[j];
    block_reduce(acc, Sum<double>{sbuf}, [=](double r) { sbuf[32] = r; });   // common.cuh
    if (threadIdx.x == 0) out[0] = (float)sqrt(sbuf[32]);
}

// launch: grid = 1, block = 1 (before adamw_flat_vN, after the norm, on the same stream)
// lr_dev: the learning rate in device memory (a schedule's), or null for the lr argument.
// norm: the gradient norm, or null for no clipping.
extern "C" __global__ void adamw_flat_count_step(int* state, const float* lr_dev, float lr,
                                                 float beta1, float beta2,
                                                 const float* norm, float max_norm) {
    float* f = reinterpret_cast<float*>(state);
    int t = state[0] + 1;
    state[0] = t;
    float lr_t = lr_dev ? lr_dev[0] : lr;
    float coef[2];
    adamw_coef(t, lr_t, beta1, beta2, coef);           // common.cuh: in double, once
    f[1] = coef[0];
    f[2] = coef[1];
    f[3] = lr_t;
    // clip_grad_norm_ forms max_norm / (norm + 1e-6) as (norm + 1e-6).reciprocal() * max_norm
    // (Tensor.__rtruediv__) and clamps it at 1; a NaN norm gives a NaN coefficient there too
    float c = norm ? (1.0f / (norm[0] + 1e-6f)) * max_norm : 1.0f;
    f[4] = c > 1.0f ? 1.0f : c;
}

// the step's scalars, read from the state once per thread
struct StepScalars { float step_size, bc2_sqrt, lr, clip; };

__device__ __forceinline__ StepScalars step_scalars(const int* state) {
    const float* f = reinterpret_cast<const float*>(state);
    return {f[1], f[2], f[3], f[4]};
}

// one element: the clipped gradient, then AdamW (common.cuh) in place on p, m, v
__device__ __forceinline__ void adamw_flat_one(float& p, float g, float& m, float& v, float wd,
                                               float beta1, float beta2, float eps,
                                               const StepScalars& s) {
    adamw_param(p, g * s.clip, m, v, s.lr, beta1, beta2, eps, wd, s.step_size, s.bc2_sqrt);
}

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void adamw_flat_v1(float* __restrict__ p, const float* __restrict__ g,
                                         float* __restrict__ m, float* __restrict__ v,
                                         __nv_bfloat16* __restrict__ shadow,
                                         const int* __restrict__ state, int n, int n_decay,
                                         float beta1, float beta2, float eps, float wd) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    StepScalars s = step_scalars(state);
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_flat_one(pi, g[i], mi, vi, i < n_decay ? wd : 0.0f, beta1, beta2, eps, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    shadow[i] = __float2bfloat16_rn(pi);
}

// launch: grid = ceil_div(ceil_div(n, 4), 256), block = 256, no shared memory
// thread t owns elements [4t, 4t + 4); the one whose 4 pass the end does the rest singly
extern "C" __global__ void adamw_flat_v2(float* __restrict__ p, const float* __restrict__ g,
                                         float* __restrict__ m, float* __restrict__ v,
                                         __nv_bfloat16* __restrict__ shadow,
                                         const int* __restrict__ state, int n, int n_decay,
                                         float beta1, float beta2, float eps, float wd) {
    long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    StepScalars s = step_scalars(state);
    if (i + 4 <= n) {
        float4 P = *reinterpret_cast<const float4*>(p + i);
        float4 G = *reinterpret_cast<const float4*>(g + i);
        float4 M = *reinterpret_cast<const float4*>(m + i);
        float4 V = *reinterpret_cast<const float4*>(v + i);
        float pp[4] = {P.x, P.y, P.z, P.w}, gg[4] = {G.x, G.y, G.z, G.w};
        float mm[4] = {M.x, M.y, M.z, M.w}, vv[4] = {V.x, V.y, V.z, V.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)           // n_decay may fall inside these 4
            adamw_flat_one(pp[j], gg[j], mm[j], vv[j], i + j < n_decay ? wd : 0.0f, beta1,
                           beta2, eps, s);
        *reinterpret_cast<float4*>(p + i) = make_float4(pp[0], pp[1], pp[2], pp[3]);
        *reinterpret_cast<float4*>(m + i) = make_float4(mm[0], mm[1], mm[2], mm[3]);
        *reinterpret_cast<float4*>(v + i) = make_float4(vv[0], vv[1], vv[2], vv[3]);
        uint2 b;
        reinterpret_cast<__nv_bfloat162*>(&b)[0] = __floats2bfloat162_rn(pp[0], pp[1]);
        reinterpret_cast<__nv_bfloat162*>(&b)[1] = __floats2bfloat162_rn(pp[2], pp[3]);
        *reinterpret_cast<uint2*>(shadow + i) = b;
    } else {
        for (; i < n; ++i) {
            float pi = p[i], mi = m[i], vi = v[i];
            adamw_flat_one(pi, g[i], mi, vi, i < n_decay ? wd : 0.0f, beta1, beta2, eps, s);
            p[i] = pi;
            m[i] = mi;
            v[i] = vi;
            shadow[i] = __float2bfloat16_rn(pi);
        }
    }
}
