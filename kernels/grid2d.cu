// grid2d.cu: a 2D grid over a row-major matrix, the pattern of every 2D kernel (Chapter 1).
//
//   who_am_i_2d  records, for every element (row, col) of a rows x cols matrix, the block
//                (blockIdx.x, blockIdx.y) and thread (threadIdx.x, threadIdx.y) that wrote it
//
// x walks columns: consecutive threadIdx.x are consecutive columns, i.e. consecutive addresses
// of a row-major matrix, so the 32 threads of a warp touch neighbouring words (Chapter 2 calls
// this coalescing).
#include "common.cuh"

// a __device__ function: called from kernels, runs on the GPU, cannot be launched from the host
__device__ int flat_index(int row, int col, int cols) { return row * cols + col; }

// launch: grid = (ceil_div(cols, bx), ceil_div(rows, by)), block = (bx, by)
// who is int[rows * cols * 4]: block x, block y, thread x, thread y of each element's writer
extern "C" __global__ void who_am_i_2d(int* who, int rows, int cols) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;   // x: the fast (contiguous) index
    int row = blockIdx.y * blockDim.y + threadIdx.y;   // y: the slow one
    if (row < rows && col < cols) {                    // both guards: the grid is rounded up twice
        int i = 4 * flat_index(row, col, cols);
        who[i] = blockIdx.x;
        who[i + 1] = blockIdx.y;
        who[i + 2] = threadIdx.x;
        who[i + 3] = threadIdx.y;
    }
}
