// conv.cu: direct convolution, "same" size with zero padding, stride 1 (Chapter 3).
//
// As in deep learning (torch.nn.functional.conv1d/conv2d) this is a cross-correlation: the
// filter is not flipped. K is odd and the output has the input's size; pad = K / 2.
//   1D: x (N,), w (K,), y (N,)         y[i]    = sum_k x[i + k - pad] w[k]
//   2D: x (H, W), w (K, K), y (H, W)   y[r, c] = sum_{a,b} x[r + a - pad, c + b - pad] w[a, b]
//   multi-channel (v4): x (B, C, H, W), w (CO, C, K, K), y (B, CO, H, W), NCHW like torch
// Pixels outside the image count as 0 (the border): a kernel that skips them, or that reads
// them anyway, is wrong on the outer pad rows and columns.
//
// kernels, simplest first (each line: what changed)
//   conv1d_v1  1D direct: one thread per output, K reads of x and w each
//   conv2d_v1  2D direct: one thread per output pixel, K*K reads of x from global memory
//              (each input pixel is read by K*K threads; the caches absorb part of that)
//   conv2d_v2  shared-memory tile with halo: a 16x16 block loads its (16+K-1)^2 input tile
//              once (zeros outside the image), then every output reads shared memory
//   conv2d_v3  v2 with the filter in __constant__ memory: all threads of a warp read the
//              same w[a, b] at the same time, which the constant cache broadcasts
//   conv2d_v4  multi-channel NCHW direct convolution (a real layer), one thread per output;
//              compared with cuDNN (torch.nn.functional.conv2d), which wins: see the lesson
#include "common.cuh"

#define CONV_TILE 16
#define CONV_MAX_K 7                        // odd filter sizes 1, 3, 5, 7
#define CONV_SMEM (CONV_TILE + CONV_MAX_K - 1)

// the filter of conv2d_v3; set from the host with RawModule.get_global("conv_filter")
__constant__ float conv_filter[CONV_MAX_K * CONV_MAX_K];

// launch: grid = ceil_div(N, 256), block = 256, no shared memory
extern "C" __global__ void conv1d_v1(const float* x, const float* w, float* y, int N, int K) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    int pad = K / 2;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) {
        int j = i + k - pad;
        if (j >= 0 && j < N) acc += x[j] * w[k];      // outside: zero padding
    }
    y[i] = acc;
}

// launch: grid = (ceil_div(W, 16), ceil_div(H, 16)), block = (16, 16), no shared memory
extern "C" __global__ void conv2d_v1(const float* x, const float* w, float* y, int H, int W,
                                     int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;   // x of the grid walks columns: coalesced
    int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= H || c >= W) return;
    int pad = K / 2;
    float acc = 0.0f;
    for (int a = 0; a < K; a++) {
        int rr = r + a - pad;
        if (rr < 0 || rr >= H) continue;
        for (int b = 0; b < K; b++) {
            int cc = c + b - pad;
            if (cc >= 0 && cc < W) acc += x[rr * W + cc] * w[a * K + b];
        }
    }
    y[r * W + c] = acc;
}

// load the (16 + K - 1)^2 input tile of this block, zero outside the image
__device__ __forceinline__ void load_tile(const float* x, float (*tile)[CONV_SMEM], int H, int W,
                                          int K) {
    int pad = K / 2, side = CONV_TILE + K - 1;
    int r0 = blockIdx.y * CONV_TILE - pad, c0 = blockIdx.x * CONV_TILE - pad;
    int tid = threadIdx.y * CONV_TILE + threadIdx.x;
    for (int t = tid; t < side * side; t += CONV_TILE * CONV_TILE) {   // 256 threads, > 256 cells
        int i = t / side, j = t % side;
        int rr = r0 + i, cc = c0 + j;
        tile[i][j] = (rr >= 0 && rr < H && cc >= 0 && cc < W) ? x[rr * W + cc] : 0.0f;
    }
}

// the tile holds filters up to CONV_MAX_K; a larger or even K would write past it
__device__ __forceinline__ bool conv_tile_fits(int K) {
    return K >= 1 && K <= CONV_MAX_K && (K & 1);
}

// launch: grid = (ceil_div(W, 16), ceil_div(H, 16)), block = (16, 16), static shared memory
// 22 * 22 floats (1936 bytes); K odd, K <= 7 (the launch helper refuses others; the kernel
// writes nothing for them rather than overrun its tile)
extern "C" __global__ void conv2d_v2(const float* x, const float* w, float* y, int H, int W,
                                     int K) {
    if (!conv_tile_fits(K)) return;
    __shared__ float tile[CONV_SMEM][CONV_SMEM];
    load_tile(x, tile, H, W, K);
    __syncthreads();                                  // the whole tile, halo included, is in
    int c = blockIdx.x * CONV_TILE + threadIdx.x;
    int r = blockIdx.y * CONV_TILE + threadIdx.y;
    if (r >= H || c >= W) return;                     // after the barrier: all threads loaded
    float acc = 0.0f;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++)
            acc += tile[threadIdx.y + a][threadIdx.x + b] * w[a * K + b];
    y[r * W + c] = acc;
}

// launch: as conv2d_v2; conv_filter[0 .. K*K) holds the filter (row-major K x K)
extern "C" __global__ void conv2d_v3(const float* x, float* y, int H, int W, int K) {
    if (!conv_tile_fits(K)) return;
    __shared__ float tile[CONV_SMEM][CONV_SMEM];
    load_tile(x, tile, H, W, K);
    __syncthreads();
    int c = blockIdx.x * CONV_TILE + threadIdx.x;
    int r = blockIdx.y * CONV_TILE + threadIdx.y;
    if (r >= H || c >= W) return;
    float acc = 0.0f;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++)
            acc += tile[threadIdx.y + a][threadIdx.x + b] * conv_filter[a * K + b];
    y[r * W + c] = acc;
}

// launch: grid = (ceil_div(W, 16), ceil_div(H, 16), B * CO), block = (16, 16), no shared memory
// Per output: C * K * K multiply-adds, each with a load of x (L1/L2) and of w (uniform per
// warp): about 2 loads per 2 flops, far below what the tensor cores need to be busy.
extern "C" __global__ void conv2d_v4(const float* x, const float* w, float* y, int B, int C,
                                     int CO, int H, int W, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y * blockDim.y + threadIdx.y;
    int b = blockIdx.z / CO, co = blockIdx.z % CO;
    if (r >= H || c >= W) return;
    int pad = K / 2;
    float acc = 0.0f;
    for (int ci = 0; ci < C; ci++) {
        const float* xc = x + ((size_t)b * C + ci) * H * W;
        const float* wc = w + ((size_t)co * C + ci) * K * K;
        for (int a = 0; a < K; a++) {
            int rr = r + a - pad;
            if (rr < 0 || rr >= H) continue;
            for (int bb = 0; bb < K; bb++) {
                int cc = c + bb - pad;
                if (cc >= 0 && cc < W) acc += xc[rr * W + cc] * wc[a * K + bb];
            }
        }
    }
    y[(((size_t)b * CO + co) * H + r) * W + c] = acc;
}
