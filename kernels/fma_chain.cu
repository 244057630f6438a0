// fma_chain.cu: a roofline probe with adjustable arithmetic intensity (Chapter 2).
//
//   fma_chain  y = x after k steps of v = v * a + b: 2 k flops per 8 bytes moved, so the
//              arithmetic intensity is k / 4 flop/byte; sweeping k walks along the roofline
//
// float4 when x and y are 16-byte aligned (whole CuPy arrays are), scalars otherwise.
#include "common.cuh"

// launch: grid = ceil_div(ceil_div(n, 4), 256) (or fewer), block = 256
// Each float4 component runs its own dependent chain of k FMAs (4 chains per thread for
// instruction-level parallelism). a and b are kernel arguments, so the compiler cannot fold
// the chain away. flops = 2 k n, bytes = 8 n.
extern "C" __global__ void fma_chain(const float* __restrict__ x, float* __restrict__ y, int n,
                                     int k, float a, float b) {
    if (!aligned16(x) || !aligned16(y)) {             // a misaligned view: no float4
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            float v = x[i];
            for (int j = 0; j < k; ++j) v = fmaf(v, a, b);
            y[i] = v;
        }
        return;
    }
    int nv = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    for (int i = tid; i < nv; i += stride) {
        float4 v = x4[i];
        for (int j = 0; j < k; ++j) {
            v.x = fmaf(v.x, a, b); v.y = fmaf(v.y, a, b);
            v.z = fmaf(v.z, a, b); v.w = fmaf(v.w, a, b);
        }
        y4[i] = v;
    }
    for (int i = 4 * nv + tid; i < n; i += stride) {   // tail: 0..3
        float v = x[i];
        for (int j = 0; j < k; ++j) v = fmaf(v, a, b);
        y[i] = v;
    }
}
