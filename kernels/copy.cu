// copy.cu: y = x for float32 vectors of length n, and two access-pattern probes (Chapter 2).
//
// versions, simplest first
//   copy_v1  one thread per element, guarded by `if (i < n)`; grid = ceil(n / block)
//   copy_v2  grid-stride loop: a fixed grid (a few waves of blocks per SM) covers any n
//   copy_v3  float4: 16-byte loads and stores (4 elements per instruction), scalar tail
//   copy_v4  float4, 4 vectors per thread per step: 4 independent 16-byte loads in flight
// probes (coalescing experiments; scalar loads)
//   copy_strided  y[i] = x[i * stride]   read addresses `stride` elements apart, writes dense
//   copy_offset   y[i] = x[i + offset]   reads shifted by `offset` elements (misaligned)
//
// traffic: 4 bytes read + 4 bytes written per element -> 8 n bytes; no arithmetic at all, so
// the best version is as fast as the memory system: its GB/s is the bandwidth peak we use
// for the roofline. x and y must not overlap. copy_v3/v4 take their float4 path when x and y
// are 16-byte aligned (CuPy and cudaMalloc allocations are 256-byte aligned; a view starting
// at x[1] is NOT) and fall back to copy_v2's scalar loop otherwise.
//
// The Numba twins are in copy.py; Numba has no float4, so its unrolled version is a different
// kernel with its own name (copy_unroll4).
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void copy_v1(const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

// launch: grid = a few blocks per SM (e.g. 8 * SMs), block = 256
extern "C" __global__ void copy_v2(const float* __restrict__ x, float* __restrict__ y, int n) {
    int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = x[i];
}

// launch: grid = ceil_div(ceil_div(n, 4), 256) (or fewer: the loop strides), block = 256
// Each thread moves one float4 (16 bytes) per step: a warp moves 512 contiguous bytes with
// one load instruction (4 x 128-byte lines). The last n % 4 elements are copied one by one.
extern "C" __global__ void copy_v3(const float* __restrict__ x, float* __restrict__ y, int n) {
    if (!aligned16(x) || !aligned16(y)) {             // a misaligned view: no float4
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
            y[i] = x[i];
        return;
    }
    int nv = n / 4;                                   // whole float4 vectors
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    for (int i = tid; i < nv; i += stride) y4[i] = x4[i];
    for (int i = 4 * nv + tid; i < n; i += stride) y[i] = x[i];   // tail: 0..3 elements
}

// launch: grid = ceil_div(ceil_div(n, 16), 256) (or fewer), block = 256
// Each thread loads 4 float4 that lie blockDim.x vectors apart (so every load instruction of a
// warp is still contiguous), issues all 4 loads before the first store: 64 bytes in flight per
// thread instead of 16, which hides more DRAM latency with the same number of threads.
#define COPY_V4_UNROLL 4
extern "C" __global__ void copy_v4(const float* __restrict__ x, float* __restrict__ y, int n) {
    if (!aligned16(x) || !aligned16(y)) {             // a misaligned view: no float4
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
            y[i] = x[i];
        return;
    }
    int nv = n / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    int chunk = blockDim.x * COPY_V4_UNROLL;          // vectors per block per step
    for (int base = blockIdx.x * chunk; base < nv; base += gridDim.x * chunk) {
        float4 v[COPY_V4_UNROLL];
#pragma unroll
        for (int k = 0; k < COPY_V4_UNROLL; ++k) {    // all loads first ...
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) v[k] = x4[i];
        }
#pragma unroll
        for (int k = 0; k < COPY_V4_UNROLL; ++k) {    // ... then all stores
            int i = base + k * blockDim.x + threadIdx.x;
            if (i < nv) y4[i] = v[k];
        }
    }
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    if (tid < n - 4 * nv) y[4 * nv + tid] = x[4 * nv + tid];   // tail: 0..3 elements
}

// launch: grid = ceil_div(n, 256), block = 256; x holds at least (n - 1) * stride + 1 elements
// A warp reads 32 floats that are 4 * stride bytes apart: stride 1 touches 4 sectors of 32
// bytes, stride 8 or more touches 32 sectors (one per thread) and uses 4 of every 32 bytes.
extern "C" __global__ void copy_strided(const float* __restrict__ x, float* __restrict__ y,
                                        int n, int stride) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[(long long)i * stride];
}

// launch: grid = ceil_div(n, 256), block = 256; x holds at least n + offset elements
// offset % 8 != 0 makes every warp's 128-byte read straddle 5 sectors instead of 4.
extern "C" __global__ void copy_offset(const float* __restrict__ x, float* __restrict__ y,
                                       int n, int offset) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i + offset];
}
