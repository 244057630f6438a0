// bias_grad.cu: the gradient of a bias, db[j] = sum over rows i of dz[i, j] (Chapter 6).
//
// Shapes: dz (M, N) row-major, contiguous (M = batch rows); db (N,). y = x @ W + b adds b[j] to
// every row, so the chain rule sums the rows of dz: a reduction over the batch, down each
// column. A sum, not a mean: the 1/M of a mean loss is already inside dz.
//
// kernels
//   bias_grad_v1    one thread per column walks the M rows: neighbouring threads read
//                   neighbouring columns (coalesced), but only N threads run: at N = 256 that
//                   is two blocks for the whole GPU, each thread adding M numbers in a row
//   bias_grad_v2    a block of 32 x 32 threads owns 32 columns; its 32 rows of threads split
//                   the M rows (thread row ty adds rows ty, ty + 32, ...), then a tree over the
//                   32 partial sums in shared memory: 32x more threads, M / 32 adds each
//   bias_grad_f64   bias_grad_v1 in double (torch.autograd.gradcheck runs in float64)
//
// traffic: reads 4 M N bytes, writes 4 N.
#include "common.cuh"

// launch: grid = ceil_div(N, 256), block = 256
extern "C" __global__ void bias_grad_v1(const float* __restrict__ dz, float* __restrict__ db,
                                        int M, int N) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= N) return;
    float s = 0.0f;
    for (int i = 0; i < M; i++) s += dz[(long long)i * N + j];
    db[j] = s;
}

// launch: grid = ceil_div(N, 32), block = (32, 32), 32 x 33 floats of static shared memory
extern "C" __global__ void bias_grad_v2(const float* __restrict__ dz, float* __restrict__ db,
                                        int M, int N) {
    __shared__ float part[32][33];                      // +1: no bank conflict on columns
    int tx = threadIdx.x, ty = threadIdx.y;
    int j = blockIdx.x * 32 + tx;
    float s = 0.0f;
    if (j < N)
        for (int i = ty; i < M; i += 32) s += dz[(long long)i * N + j];
    part[ty][tx] = s;
    __syncthreads();                                    // every partial is written
    for (int half = 16; half > 0; half >>= 1) {
        if (ty < half) part[ty][tx] += part[ty + half][tx];
        __syncthreads();                                // this level is done before the next
    }
    if (ty == 0 && j < N) db[j] = part[0][tx];
}

// launch: as bias_grad_v1
extern "C" __global__ void bias_grad_f64(const double* __restrict__ dz, double* __restrict__ db,
                                         int M, int N) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= N) return;
    double s = 0.0;
    for (int i = 0; i < M; i++) s += dz[(long long)i * N + j];
    db[j] = s;
}
