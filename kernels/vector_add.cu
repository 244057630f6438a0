// vector_add.cu: z = x + y for float32 vectors of length n (Chapter 1).
//
// versions, simplest first (Chapter 1 writes v1 and v2; Chapter 2 climbs to v4 as it does for
// the copy in copy.cu)
//   vector_add_v1  one thread per element, guarded by `if (i < n)`; grid = ceil(n / block)
//   vector_add_v2  grid-stride loop: any grid size covers any n (grid = a few blocks per SM)
//   vector_add_v3  float4 loads and stores, scalar tail
//   vector_add_v4  float4, 4 vectors per thread per step (8 independent 16-byte loads in flight)
//
// traffic: reads 2 x 4 bytes and writes 4 bytes per element -> 12 n bytes, 1 flop per element:
// 1/12 flop/byte, far below any GPU's ridge point; no reuse, so the kernel is memory-bound and
// its ceiling is the device's copy bandwidth. v3/v4 take their float4 path when x, y, z are
// 16-byte aligned (whole CuPy arrays are) and fall back to v2's scalar loop otherwise.
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void vector_add_v1(const float* x, const float* y, float* z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;   // global index of this thread
    if (i < n) {                                     // the last block may run past the end
        z[i] = x[i] + y[i];
    }
}

// launch: grid = 4 * SMs (any size works), block = 256
extern "C" __global__ void vector_add_v2(const float* x, const float* y, float* z, int n) {
    int stride = gridDim.x * blockDim.x;             // threads in the whole grid
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        z[i] = x[i] + y[i];
    }
}

// launch: grid = ceil_div(ceil_div(n, 4), 256) (or fewer), block = 256
extern "C" __global__ void vector_add_v3(const float* __restrict__ x, const float* __restrict__ y,
                                         float* __restrict__ z, int n) {
    if (!aligned16(x) || !aligned16(y) || !aligned16(z)) {   // a misaligned view: no float4
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
            z[i] = x[i] + y[i];
        return;
    }
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
#define VECTOR_ADD_V4_UNROLL 4
extern "C" __global__ void vector_add_v4(const float* __restrict__ x, const float* __restrict__ y,
                                         float* __restrict__ z, int n) {
    if (!aligned16(x) || !aligned16(y) || !aligned16(z)) {   // a misaligned view: no float4
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
            z[i] = x[i] + y[i];
        return;
    }
    int nv = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* y4 = reinterpret_cast<const float4*>(y);
    float4* z4 = reinterpret_cast<float4*>(z);
    int chunk = blockDim.x * VECTOR_ADD_V4_UNROLL;
    for (int base = blockIdx.x * chunk; base < nv; base += gridDim.x * chunk) {
        float4 a[VECTOR_ADD_V4_UNROLL], b[VECTOR_ADD_V4_UNROLL];
#pragma unroll
        for (int k = 0; k < VECTOR_ADD_V4_UNROLL; ++k) {     // all loads first ...
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) { a[k] = x4[i]; b[k] = y4[i]; }
        }
#pragma unroll
        for (int k = 0; k < VECTOR_ADD_V4_UNROLL; ++k) {     // ... then the adds and stores
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) z4[i] = make_float4(a[k].x + b[k].x, a[k].y + b[k].y,
                                            a[k].z + b[k].z, a[k].w + b[k].w);
        }
    }
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    if (tid < n - 4 * nv) z[4 * nv + tid] = x[4 * nv + tid] + y[4 * nv + tid];   // tail
}
