// rope_train.cu: rotary position embedding for training, bf16 heads, forward and backward.
//
//   x (BH, T, D) bf16, the layout the attention kernels read (one (T, D) matrix per batch and
//   head); row t of each matrix is at position t. cos, sin (Tmax, D/2) float32 tables with
//   Tmax >= T (cudabook.gpt.rope_tables: the angles of PyTorch's model, computed in float64 and
//   rounded once, so both sides rotate by the same numbers). Half-split pairs (i, i + D/2):
//       forward   y[i] = x[i] c - x[i + D/2] s      y[i + D/2] = x[i + D/2] c + x[i] s
//       backward  the transpose of that rotation (the angle negated), applied to the gradient:
//                 dx[i] = dy[i] c + dy[i + D/2] s   dx[i + D/2] = dy[i + D/2] c - dy[i] s
//   Both in place, computed in fp32 and rounded to bf16 once, which is what PyTorch's
//   x.float() ... .to(bf16) in cudabook.gpt._rope and its autograd do.
//
//   rope_train_v1   one thread per pair: 2 bf16 loads and 2 stores of 2 bytes each
//   rope_train_v2   one thread per 8 pairs: 16-byte loads of x[i..i+7] and x[i+D/2..], the
//                   tables read as float4 pairs (D/2 a multiple of 8)
//
// Launches (kernels/rope_train_launch.py): grid ceil(work / 256) x 256; work = BH T D/2 pairs
// (v1) or BH T D/16 groups of 8 (v2).
#include <cuda_bf16.h>
#include "common.cuh"

__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float sign,
                                          float* ya, float* yb) {
    // sign = +1: the forward rotation; -1: its transpose (the backward). Each product rounded
    // on its own (__fmul_rn: no fused multiply-add), as PyTorch's elementwise kernels round them
    *ya = __fmul_rn(a, c) - sign * __fmul_rn(b, s);
    *yb = __fmul_rn(b, c) + sign * __fmul_rn(a, s);
}

// launch: grid ceil(BH * T * D/2 / 256), block 256
extern "C" __global__ void rope_train_v1(__nv_bfloat16* x, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, long long rows, int T,
                                         int D, float sign) {
    const int half = D / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * half) return;
    const int i = (int)(idx % half);
    const long long r = idx / half;                  // row of (BH T): position r % T
    const int t = (int)(r % T);
    __nv_bfloat16* row = x + r * D;
    float c = cos_t[(long long)t * half + i], s = sin_t[(long long)t * half + i];
    float ya, yb;
    rope_pair(__bfloat162float(row[i]), __bfloat162float(row[i + half]), c, s, sign, &ya, &yb);
    row[i] = __float2bfloat16_rn(ya);
    row[i + half] = __float2bfloat16_rn(yb);
}

// launch: grid ceil(BH * T * D/16 / 256), block 256; D/2 a multiple of 8
extern "C" __global__ void rope_train_v2(__nv_bfloat16* x, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, long long rows, int T,
                                         int D, float sign) {
    const int half = D / 2, groups = half / 8;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * groups) return;
    const int i = (int)(idx % groups) * 8;
    const long long r = idx / groups;
    const int t = (int)(r % T);
    __nv_bfloat16* row = x + r * D;
    uint4 va = *reinterpret_cast<const uint4*>(row + i);
    uint4 vb = *reinterpret_cast<const uint4*>(row + i + half);
    const float* ct = cos_t + (long long)t * half + i;
    const float* st = sin_t + (long long)t * half + i;
    float c[8], s[8];
    *reinterpret_cast<float4*>(c) = *reinterpret_cast<const float4*>(ct);
    *reinterpret_cast<float4*>(c + 4) = *reinterpret_cast<const float4*>(ct + 4);
    *reinterpret_cast<float4*>(s) = *reinterpret_cast<const float4*>(st);
    *reinterpret_cast<float4*>(s + 4) = *reinterpret_cast<const float4*>(st + 4);
    __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(&va);
    __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(&vb);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float ya, yb;
        rope_pair(__bfloat162float(a[j]), __bfloat162float(b[j]), c[j], s[j], sign, &ya, &yb);
        a[j] = __float2bfloat16_rn(ya);
        b[j] = __float2bfloat16_rn(yb);
    }
    *reinterpret_cast<uint4*>(row + i) = va;
    *reinterpret_cast<uint4*>(row + i + half) = vb;
}
