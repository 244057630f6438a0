// common.cuh: device code shared by the kernels of every chapter, defined once.
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
//
//   ceil_div(n, b)          blocks needed to cover n items with b per block
//   aligned16(p)            p is a multiple of 16 bytes (a float4 access is allowed)
//   warp_sum(v), warp_max(v)      over the 32 lanes of a warp; every lane gets the result
//   block_sum(v, sbuf), block_max(v, sbuf)
//                           over the whole block: THE block-reduction contract of the book:
//                           * every thread of the block must call it (it has barriers);
//                           * blockDim.x is a multiple of 32, up to 1024 (whole warps: the
//                             shuffles use the full mask);
//                           * sbuf is BLOCK_REDUCE_SMEM floats of shared memory;
//                           * every thread gets the result, and sbuf may be reused (even by
//                             the next block_sum) as soon as the call returns.
//   safe_max(m)             a row maximum usable in exp(x - m): 0 for a row of only -inf
//   ld_stream16(p)          16 bytes read once (streamed weights): bypass L1 allocation
//   ld_keep16(p)            16 bytes that every row reads again (gamma, beta): kept in L1 longest
//   INFINITY                for NVRTC, which has no math.h
//
// Ladder steps that teach a reduction (reduce_v1..v4 in reduce.cu) keep their own code on
// purpose; every other kernel reduces a block through block_sum / block_max.
#pragma once

#ifndef INFINITY  // NVRTC (CuPy) has no math.h: build +inf from its bit pattern
#define INFINITY __int_as_float(0x7f800000)
#endif

// blocks needed to cover n items with b per block
__host__ __device__ inline int ceil_div(int n, int b) { return (n + b - 1) / b; }

// p is 16-byte aligned: float4 loads and stores from it are allowed
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// sum of v over the 32 lanes of a warp; every lane gets the total
__device__ inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// max of v over the 32 lanes of a warp; every lane gets the result
__device__ inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// shared memory (floats) that block_sum / block_max need: one slot per warp and the result
#define BLOCK_REDUCE_SMEM 33

// sum of v over the block, returned to every thread (the contract above)
__device__ __forceinline__ float block_sum(float v, float* sbuf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) sbuf[warp] = v;
    __syncthreads();                 // every warp's sum is written
    if (warp == 0) {
        float w = (lane < nw) ? sbuf[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) sbuf[32] = w;
    }
    __syncthreads();                 // the total is written
    float r = sbuf[32];
    __syncthreads();                 // everyone has read it: sbuf may be reused
    return r;
}

// max of v over the block, returned to every thread (the contract above)
__device__ __forceinline__ float block_max(float v, float* sbuf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) sbuf[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = (lane < nw) ? sbuf[lane] : -INFINITY;
        w = warp_max(w);
        if (lane == 0) sbuf[32] = w;
    }
    __syncthreads();
    float r = sbuf[32];
    __syncthreads();
    return r;
}

// the maximum to subtract before exp: a row of only -inf (fully masked) uses 0, so every
// exp(-inf - 0) is 0 instead of exp(-inf - (-inf)) = NaN
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

// 16 bytes (p 16-byte aligned) that this thread reads once, such as a weight matrix streamed
// by a GEMV: read-only path without allocating in L1, so L1 keeps what is reused (activations)
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16 bytes (p 16-byte aligned) that the same block reads again and again, such as the gamma and
// beta of a norm applied row after row: read-only path, allocated in L1 with eviction priority
// evict_last, so streamed data is evicted before them
__device__ __forceinline__ float4 ld_keep16(const void* p) {
    float4 r;
    asm("ld.global.nc.L1::evict_last.v4.f32 {%0, %1, %2, %3}, [%4];\n"
        : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}
