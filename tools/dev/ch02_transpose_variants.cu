// Candidate padded transposes (dev only, Chapter 2): which shape gets closest to the copy?
// All: in (rows x cols) row-major -> out (cols x rows). grid/block noted per kernel.

// block (32, 16), grid (ceil(cols/32), ceil(rows/32)): 2 elements per thread
extern "C" __global__ void tp_b16(const float* __restrict__ in, float* __restrict__ out,
                                  int rows, int cols) {
    __shared__ float tile[32][33];
    int bx = blockIdx.x * 32, by = blockIdx.y * 32;
    for (int j = 0; j < 32; j += 16) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
    for (int j = 0; j < 32; j += 16) {
        int c = bx + threadIdx.y + j, r = by + threadIdx.x;
        if (c < cols && r < rows) out[(long long)c * rows + r] = tile[threadIdx.x][threadIdx.y + j];
    }
}

// block (32, 8), grid (ceil(cols/32), ceil(rows/64)): two 32x32 tiles stacked, 8 loads in flight
extern "C" __global__ void tp_2tiles(const float* __restrict__ in, float* __restrict__ out,
                                     int rows, int cols) {
    __shared__ float tile[64][33];
    int bx = blockIdx.x * 32, by = blockIdx.y * 64;
#pragma unroll
    for (int j = 0; j < 64; j += 8) {
        int r = by + threadIdx.y + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[threadIdx.y + j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 32; j += 8) {
            int c = bx + threadIdx.y + j, r = by + 32 * h + threadIdx.x;
            if (c < cols && r < rows)
                out[(long long)c * rows + r] = tile[32 * h + threadIdx.x][threadIdx.y + j];
        }
    }
}

// block (32, 8), grid (ceil(cols/64), ceil(rows/64)): a 64x64 tile, 16 elements per thread
extern "C" __global__ void tp_64(const float* __restrict__ in, float* __restrict__ out,
                                 int rows, int cols) {
    __shared__ float tile[64][65];
    int bx = blockIdx.x * 64, by = blockIdx.y * 64;
#pragma unroll
    for (int j = 0; j < 64; j += 8) {
#pragma unroll
        for (int i = 0; i < 64; i += 32) {
            int r = by + threadIdx.y + j, c = bx + threadIdx.x + i;
            if (r < rows && c < cols)
                tile[threadIdx.y + j][threadIdx.x + i] = in[(long long)r * cols + c];
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 64; j += 8) {
#pragma unroll
        for (int i = 0; i < 64; i += 32) {
            int c = bx + threadIdx.y + j, r = by + threadIdx.x + i;
            if (c < cols && r < rows)
                out[(long long)c * rows + r] = tile[threadIdx.x + i][threadIdx.y + j];
        }
    }
}

// block (32, 8), grid (ceil(cols/32), ceil(rows/32)), like transpose_v3 but loads unrolled
// into registers first (all 4 in flight), then stored to shared memory
extern "C" __global__ void tp_regs(const float* __restrict__ in, float* __restrict__ out,
                                   int rows, int cols) {
    __shared__ float tile[32][33];
    int bx = blockIdx.x * 32, by = blockIdx.y * 32;
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int r = by + threadIdx.y + 8 * k, c = bx + threadIdx.x;
        v[k] = (r < rows && c < cols) ? __ldg(in + (long long)r * cols + c) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[threadIdx.y + 8 * k][threadIdx.x] = v[k];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int c = bx + threadIdx.y + 8 * k, r = by + threadIdx.x;
        if (c < cols && r < rows) out[(long long)c * rows + r] = tile[threadIdx.x][threadIdx.y + 8 * k];
    }
}
