// elementwise.cu: z = x + y for float32 vectors of length n, the copy ladder applied to an
// elementwise op (Chapter 2), and a roofline probe with adjustable arithmetic intensity.
//
// versions, simplest first
//   add_v1     one thread per element, guarded; grid = ceil(n / block)
//   add_v2     grid-stride loop; a fixed grid covers any n
//   add_v3     float4 loads and stores, scalar tail
//   add_v4     float4, 4 vectors per thread per step (8 independent 16-byte loads in flight)
// probe
//   fma_chain  y = x after k steps of v = v * a + b: 2 k flops per 8 bytes moved, so the
//              arithmetic intensity is k / 4 flop/byte; sweeping k walks along the roofline
//
// traffic of add: 2 x 4 bytes read + 4 bytes written per element -> 12 n bytes, 1 flop per
// element: 1/12 flop/byte, far below any GPU's ridge point, so it is memory-bound.
// add_v3/v4 and fma_chain need 16-byte aligned x, y, z (whole CuPy arrays are).
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void add_v1(const float* __restrict__ x, const float* __restrict__ y,
                                  float* __restrict__ z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = x[i] + y[i];
}

// launch: grid = a few blocks per SM (e.g. 8 * SMs), block = 256
extern "C" __global__ void add_v2(const float* __restrict__ x, const float* __restrict__ y,
                                  float* __restrict__ z, int n) {
    int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) z[i] = x[i] + y[i];
}

// launch: grid = ceil_div(ceil_div(n, 4), 256) (or fewer), block = 256
extern "C" __global__ void add_v3(const float* __restrict__ x, const float* __restrict__ y,
                                  float* __restrict__ z, int n) {
    int nv = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* y4 = reinterpret_cast<const float4*>(y);
    float4* z4 = reinterpret_cast<float4*>(z);
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    for (int i = tid; i < nv; i += stride) {
        float4 a = x4[i], b = y4[i];
        z4[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
    for (int i = 4 * nv + tid; i < n; i += stride) z[i] = x[i] + y[i];   // tail: 0..3
}

// launch: grid = ceil_div(ceil_div(n, 16), 256) (or fewer), block = 256
#define ADD_V4_UNROLL 4
extern "C" __global__ void add_v4(const float* __restrict__ x, const float* __restrict__ y,
                                  float* __restrict__ z, int n) {
    int nv = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* y4 = reinterpret_cast<const float4*>(y);
    float4* z4 = reinterpret_cast<float4*>(z);
    int chunk = blockDim.x * ADD_V4_UNROLL;
    for (int base = blockIdx.x * chunk; base < nv; base += gridDim.x * chunk) {
        float4 a[ADD_V4_UNROLL], b[ADD_V4_UNROLL];
#pragma unroll
        for (int k = 0; k < ADD_V4_UNROLL; ++k) {     // all loads first ...
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) { a[k] = x4[i]; b[k] = y4[i]; }
        }
#pragma unroll
        for (int k = 0; k < ADD_V4_UNROLL; ++k) {     // ... then the adds and stores
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) z4[i] = make_float4(a[k].x + b[k].x, a[k].y + b[k].y,
                                            a[k].z + b[k].z, a[k].w + b[k].w);
        }
    }
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    if (tid < n - 4 * nv) z[4 * nv + tid] = x[4 * nv + tid] + y[4 * nv + tid];   // tail
}

// launch: grid = ceil_div(ceil_div(n, 4), 256) (or fewer), block = 256
// Each float4 component runs its own dependent chain of k FMAs (4 chains per thread for
// instruction-level parallelism). a and b are kernel arguments, so the compiler cannot fold
// the chain away. flops = 2 k n, bytes = 8 n.
extern "C" __global__ void fma_chain(const float* __restrict__ x, float* __restrict__ y, int n,
                                     int k, float a, float b) {
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
