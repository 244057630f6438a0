// gelu_train.cu: GELU (tanh approximation) forward and backward on bf16, for the training step
// (the MLP's activation between its two matmuls, as PyTorch autocast runs it).
//
// Shapes: h, g, dg, dh are bf16, contiguous, n elements (n = M * 4C in the GPT: the fc output).
// Every value is computed in fp32 and rounded to bf16 once, as torch's gelu(approximate="tanh")
// and its autograd backward do on bf16 tensors:
//     g  = bf16(gelu_tanh(float(h)))
//     dh = bf16(float(dg) * gelu_tanh'(float(h)))      from the saved input h (nothing else kept)
// dh may be dg (in place): each thread reads its dg before it writes the same elements of dh, so
// dg and dh carry no __restrict__.
//
// kernels
//   gelu_train_fwd_v1   one element per thread
//   gelu_train_fwd_v2   8 elements per thread: one 16-byte load of h, one 16-byte store of g;
//                       the thread owning the last n % 8 elements does them one at a time
//                       (h, g 16-byte aligned: the launcher checks)
//   gelu_train_bwd_v1   one element per thread
//   gelu_train_bwd_v2   8 elements per thread, 16-byte loads of dg and h, a 16-byte store of dh,
//                       the same tail
//
// traffic: forward reads 2n and writes 2n bytes, backward reads 4n and writes 2n: memory-bound
// (a few dozen flops per element). v2 moves the same bytes in 8x fewer load instructions.
// bf16 arithmetic exists from sm_80; the conversions used here (through float) exist on sm_75.
#include <cuda_bf16.h>
// common.cuh: gelu_tanh, gelu_tanh_grad
#include "common.cuh"

// 8 bf16 (16 bytes) to 8 floats, and back rounded to nearest even
__device__ __forceinline__ void bf16x8_to_float(uint4 u, float* f) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float2 t = __bfloat1622float2(b[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float* f) {
    uint4 u;
    __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return u;
}

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void gelu_train_fwd_v1(const __nv_bfloat16* __restrict__ h,
                                             __nv_bfloat16* __restrict__ g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = __float2bfloat16_rn(gelu_tanh(__bfloat162float(h[i])));
}

// launch: grid = ceil_div(ceil_div(n, 8), 256), block = 256, no shared memory
// thread t owns elements [8t, 8t + 8); the one whose 8 pass the end does the rest singly
extern "C" __global__ void gelu_train_fwd_v2(const __nv_bfloat16* __restrict__ h,
                                             __nv_bfloat16* __restrict__ g, long long n) {
    long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 8 <= n) {
        float f[8];
        bf16x8_to_float(*reinterpret_cast<const uint4*>(h + i), f);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = gelu_tanh(f[j]);
        *reinterpret_cast<uint4*>(g + i) = float_to_bf16x8(f);
    } else {
        for (; i < n; ++i) g[i] = __float2bfloat16_rn(gelu_tanh(__bfloat162float(h[i])));
    }
}

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void gelu_train_bwd_v1(const __nv_bfloat16* dg,
                                             const __nv_bfloat16* __restrict__ h,
                                             __nv_bfloat16* dh, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        dh[i] = __float2bfloat16_rn(__bfloat162float(dg[i]) *
                                    gelu_tanh_grad(__bfloat162float(h[i])));
}

// launch: grid = ceil_div(ceil_div(n, 8), 256), block = 256, no shared memory
// the same ownership as gelu_train_fwd_v2
extern "C" __global__ void gelu_train_bwd_v2(const __nv_bfloat16* dg,
                                             const __nv_bfloat16* __restrict__ h,
                                             __nv_bfloat16* dh, long long n) {
    long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 8 <= n) {
        float d[8], z[8];
        bf16x8_to_float(*reinterpret_cast<const uint4*>(dg + i), d);
        bf16x8_to_float(*reinterpret_cast<const uint4*>(h + i), z);
#pragma unroll
        for (int j = 0; j < 8; ++j) d[j] *= gelu_tanh_grad(z[j]);
        *reinterpret_cast<uint4*>(dh + i) = float_to_bf16x8(d);
    } else {
        for (; i < n; ++i)
            dh[i] = __float2bfloat16_rn(__bfloat162float(dg[i]) *
                                        gelu_tanh_grad(__bfloat162float(h[i])));
    }
}
