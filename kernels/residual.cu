// residual.cu: the residual stream of a transformer: x += f(x) and the LayerNorm that follows.
//
//   x (M, N) fp32 is the residual stream; the matmuls write their outputs dx in fp16 and read
//   their inputs y in fp16. Between two matmuls come an add and a LayerNorm:
//
//   residual_add_v1   x += dx (fp16 -> fp32). One thread per element.
//   to_half_v1        y = half(x): the cast needed after chapter 3's fp32 layernorm_v3.
//   add_layernorm_v1  fused: x += dx (skipped when dx is null), then y = LayerNorm(x) * gamma +
//                     beta in fp16, one block per row with the row in registers (N <= 16 *
//                     blockDim.x): x read once and written once, where residual_add_v1 +
//                     layernorm_v3 + to_half_v1 read x three times, write it twice (3 launches).
//
// Launches (kernels/residual_launch.py): elementwise grid ceil(n / 256) x 256; add_layernorm_v1
// grid (M) x cudabook.row_block(N) threads (a multiple of 32, N / 16 <= threads <= 1024).
#include <cuda_fp16.h>
#include "common.cuh"

extern "C" __global__ void residual_add_v1(float* x, const __half* dx, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += __half2float(dx[i]);
}

extern "C" __global__ void to_half_v1(const float* x, __half* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(x[i]);
}

extern "C" __global__ void __launch_bounds__(1024) add_layernorm_v1(
        float* x, const __half* dx, const float* gamma, const float* beta, __half* y, int N,
        float eps) {
    __shared__ float red[BLOCK_REDUCE_SMEM];
    float v[16];
    float* row = x + (long long)blockIdx.x * N;
    const __half* drow = dx ? dx + (long long)blockIdx.x * N : nullptr;
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < 16; c++) {
        int i = threadIdx.x + c * blockDim.x;
        v[c] = 0.0f;
        if (i < N) {
            v[c] = row[i] + (drow ? __half2float(drow[i]) : 0.0f);
            if (drow) row[i] = v[c];
            sum += v[c];
        }
    }
    float mean = block_sum(sum, red) / N;
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < 16; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < N) sq += (v[c] - mean) * (v[c] - mean);
    }
    float rstd = rsqrtf(block_sum(sq, red) / N + eps);
    __half* yrow = y + (long long)blockIdx.x * N;
#pragma unroll
    for (int c = 0; c < 16; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < N) yrow[i] = __float2half((v[c] - mean) * rstd * gamma[i] + beta[i]);
    }
}
