// vector_add.cu: z = x + y for float32 vectors of length n (Chapter 1).
//
// versions, simplest first
//   vector_add_v1  one thread per element, guarded by `if (i < n)`; grid = ceil(n / block)
//   vector_add_v2  grid-stride loop: any grid size covers any n (grid = a few blocks per SM)
//
// traffic: reads 2 x 4 bytes and writes 4 bytes per element -> 12 n bytes; no reuse, so the
// kernel is memory-bound and its ceiling is the device's copy bandwidth.
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
