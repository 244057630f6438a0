// common.cuh: small helpers shared by the kernels of every chapter.
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
#pragma once

// blocks needed to cover n items with b per block
__host__ __device__ inline int ceil_div(int n, int b) { return (n + b - 1) / b; }

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
