// transpose.cu: out = in^T for a row-major float32 matrix in of shape (rows, cols); out has
// shape (cols, rows), so out[c * rows + r] = in[r * cols + c] (Chapter 2).
//
// versions, simplest first
//   transpose_v1  naive: each thread moves one element; reads are coalesced (a warp reads 32
//                 neighbours of a row) but writes are strided by `rows` (32 different rows)
//   transpose_v2  a 32 x 32 tile goes through shared memory: coalesced reads AND writes, but
//                 reading a tile column hits one bank 32 times (32-way bank conflict)
//   transpose_v3  the same with the tile padded to 32 x 33: a column now spans 32 different
//                 banks, conflict-free
//   transpose_v4  padded, two 32 x 32 tiles per block (stacked): 8 loads in flight per thread
//                 before the barrier instead of 4
//   transpose_v5  padded 64 x 64 tile (64 x 65): 16 loads in flight per thread
//
// traffic: 4 bytes read + 4 written per element -> 8 rows cols bytes, like a copy; the best
// version's goal is the copy bandwidth.
#include "common.cuh"

#define TILE 32       // tile edge (one warp per tile row)
#define ROWS 8        // threads per block in y: each thread moves TILE / ROWS = 4 elements

// launch: block = (32, 8), grid = (ceil_div(cols, 32), ceil_div(rows, 32)), no shared memory
// The block covers a 32 x 32 tile; thread (tx, ty) moves elements (ty + 8 j, tx), j = 0..3.
extern "C" __global__ void transpose_v1(const float* __restrict__ in, float* __restrict__ out,
                                        int rows, int cols) {
    int c = blockIdx.x * TILE + threadIdx.x;
    int r0 = blockIdx.y * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS) {
        int r = r0 + j;
        if (r < rows && c < cols) out[(long long)c * rows + r] = in[(long long)r * cols + c];
    }
}

// launch: block = (32, 8), grid = (ceil_div(cols, 32), ceil_div(rows, 32)),
//         static shared memory 32 x 32 x 4 = 4 KiB
// Read the tile row by row (coalesced), sync, then write the transposed tile row by row
// (coalesced): a warp writes out row c with 32 consecutive r, reading tile column tx.
extern "C" __global__ void transpose_v2(const float* __restrict__ in, float* __restrict__ out,
                                        int rows, int cols) {
    __shared__ float tile[TILE][TILE];
    int bx = blockIdx.x * TILE, by = blockIdx.y * TILE;
    for (int j = 0; j < TILE; j += ROWS) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();                          // every element of the tile is loaded
    for (int j = 0; j < TILE; j += ROWS) {
        int c = bx + threadIdx.y + j, r = by + threadIdx.x;   // swapped roles
        // the 32 lanes read tile[tx][...]: addresses 32 floats apart -> the same bank
        if (c < cols && r < rows) out[(long long)c * rows + r] = tile[threadIdx.x][threadIdx.y + j];
    }
}

// launch: block = (32, 8), grid = (ceil_div(cols, 32), ceil_div(rows, 32)),
//         static shared memory 32 x 33 x 4 = 4224 bytes
// One padding column: element (i, j) sits in bank (33 i + j) % 32 = (i + j) % 32, so the 32
// lanes reading a column (i = 0..31, fixed j) hit 32 different banks.
extern "C" __global__ void transpose_v3(const float* __restrict__ in, float* __restrict__ out,
                                        int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    int bx = blockIdx.x * TILE, by = blockIdx.y * TILE;
    for (int j = 0; j < TILE; j += ROWS) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
    for (int j = 0; j < TILE; j += ROWS) {
        int c = bx + threadIdx.y + j, r = by + threadIdx.x;
        if (c < cols && r < rows) out[(long long)c * rows + r] = tile[threadIdx.x][threadIdx.y + j];
    }
}

// launch: block = (32, 8), grid = (ceil_div(cols, 32), ceil_div(rows, 64)),
//         static shared memory 64 x 33 x 4 = 8448 bytes
// Two stacked tiles per block: every thread issues 8 independent loads before the barrier,
// twice as many bytes in flight as transpose_v3, for the same number of threads.
extern "C" __global__ void transpose_v4(const float* __restrict__ in, float* __restrict__ out,
                                        int rows, int cols) {
    __shared__ float tile[2 * TILE][TILE + 1];
    int bx = blockIdx.x * TILE, by = blockIdx.y * 2 * TILE;
#pragma unroll
    for (int j = 0; j < 2 * TILE; j += ROWS) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {                 // the upper, then the lower tile
#pragma unroll
        for (int j = 0; j < TILE; j += ROWS) {
            int c = bx + threadIdx.y + j, r = by + h * TILE + threadIdx.x;
            if (c < cols && r < rows)
                out[(long long)c * rows + r] = tile[h * TILE + threadIdx.x][threadIdx.y + j];
        }
    }
}

// launch: block = (32, 8), grid = (ceil_div(cols, 64), ceil_div(rows, 64)),
//         static shared memory 64 x 65 x 4 = 16640 bytes
// A 64 x 64 tile: each thread moves 16 elements; element (i, j) is in bank (65 i + j) % 32 =
// (i + j) % 32, so a warp reading 32 consecutive i of one column is still conflict-free.
extern "C" __global__ void transpose_v5(const float* __restrict__ in, float* __restrict__ out,
                                        int rows, int cols) {
    __shared__ float tile[2 * TILE][2 * TILE + 1];
    int bx = blockIdx.x * 2 * TILE, by = blockIdx.y * 2 * TILE;
#pragma unroll
    for (int j = 0; j < 2 * TILE; j += ROWS) {
#pragma unroll
        for (int i = 0; i < 2 * TILE; i += TILE) {
            int r = by + threadIdx.y + j, c = bx + threadIdx.x + i;
            if (r < rows && c < cols)
                tile[threadIdx.y + j][threadIdx.x + i] = in[(long long)r * cols + c];
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2 * TILE; j += ROWS) {
#pragma unroll
        for (int i = 0; i < 2 * TILE; i += TILE) {
            int c = bx + threadIdx.y + j, r = by + threadIdx.x + i;
            if (c < cols && r < rows)
                out[(long long)c * rows + r] = tile[threadIdx.x + i][threadIdx.y + j];
        }
    }
}
