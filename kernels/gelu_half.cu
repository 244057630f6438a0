// gelu_half.cu: GELU (tanh approximation) in place on fp16, between the MLP's two matmuls.
//
//   gelu_half_v1  x = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), fp32 math, two halves per
//                 thread (half2 loads; n even, x 4-byte aligned: the launcher checks).
//                 chapter 3's gelu_v1 is the same function on fp32.
//
// Launch (kernels/gelu_half_launch.py): grid ceil(n / 512) x 256.
#include <cuda_fp16.h>
// common.cuh: gelu_tanh
#include "common.cuh"

extern "C" __global__ void gelu_half_v1(__half* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * i >= n) return;
    __half2* p = reinterpret_cast<__half2*>(x) + i;
    float2 f = __half22float2(*p);
    *p = __floats2half2_rn(gelu_tanh(f.x), gelu_tanh(f.y));
}
