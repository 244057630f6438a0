// divergence.cu: what a branch costs when the 32 threads of a warp disagree (Chapter 1).
//
//   branch_split  every thread runs one of two arithmetic paths of k dependent FMAs, chosen by
//                 (threadIdx.x / width) % 2: width >= 32 puts whole warps on one path (no
//                 divergence); width < 32 splits every warp, which then runs both paths one
//                 after the other with half its lanes masked off (SIMT divergence)
//
// traffic: 8 bytes per element, 2 k flops per element; with k in the hundreds the kernel is
// compute-bound, so the time measures the arithmetic the warps issue, divergence included.
#include "common.cuh"

// the two paths: the same number of dependent FMAs with different operands, each a loop of
// k steps, so the compiler cannot turn the branch into one select
__device__ float path_a(float v, int k, float a, float b) {
    for (int j = 0; j < k; ++j) v = fmaf(v, a, b);
    return v;
}

__device__ float path_b(float v, int k, float a, float b) {
    for (int j = 0; j < k; ++j) v = fmaf(v, b, a);
    return v;
}

// launch: grid = ceil_div(n, 256), block = 256; width > 0
extern "C" __global__ void branch_split(const float* x, float* y, int n, int k, float a, float b,
                                        int width) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    if ((threadIdx.x / width) % 2 == 0) {    // width 1: odd and even lanes of one warp differ
        v = path_a(v, k, a, b);
    } else {
        v = path_b(v, k, a, b);
    }
    y[i] = v;
}
