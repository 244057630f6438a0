// matmul_f64.cu: C = A @ B in double for any strides: the float64 path of Chapter 6's autograd
// wrappers (torch.autograd.gradcheck differentiates numerically in float64). Not fast, exact.
//
// Shapes: A (M, K) with element (i, k) at A[i * sa0 + k * sa1] (strides in elements, so a
// transposed view is just swapped strides); B (K, N) likewise; C (M, N) row-major, contiguous.
//
// kernels
//   matmul_f64_v1   one thread per output, threadIdx.x along the columns of C
#include "common.cuh"

// launch: grid = (ceil_div(N, 16), ceil_div(M, 16)), block = (16, 16)
extern "C" __global__ void matmul_f64_v1(const double* A, const double* B, double* C, int M,
                                         int N, int K, long long sa0, long long sa1,
                                         long long sb0, long long sb1) {
    int j = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= M || j >= N) return;
    double s = 0.0;
    for (int k = 0; k < K; k++) s += A[i * sa0 + k * sa1] * B[k * sb0 + j * sb1];
    C[(long long)i * N + j] = s;
}
