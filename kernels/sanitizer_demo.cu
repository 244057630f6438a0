// sanitizer_demo.cu: four bugs compute-sanitizer finds, each beside its fixed twin (Chapter 5).
// Not an op ladder: every *_bug kernel is wrong on purpose and runs only under compute-sanitizer,
// in a subprocess (kernels/sanitizer_demo_launch.py; sanitize_targets() yields the *_fix
// kernels alone, so the GPU lane's sanitizer step stays clean).
//
// kernels (bug, fix), the tool that finds the bug, and the bug
//   shift_bug    shift_fix    memcheck   y[i + 1] = x[i] guarded by i < n: thread n - 1 writes
//                                        y[n], one float past the end of y
//   reverse_bug  reverse_fix  racecheck  each block reverses its 256 elements through shared
//                                        memory; the bug reads the tile without the
//                                        __syncthreads() that waits for the other warps' writes
//   rowmax_bug   rowmax_fix   initcheck  out[row] = max over the row, taken with fmaxf(out[row],
//                                        ...) on an out that nobody initialised; the fix keeps
//                                        the running max in a register, from -inf
//   smooth_bug   smooth_fix   synccheck  3-point moving average through a shared tile, tile by
//                                        tile; the bug puts the loads and the first
//                                        __syncthreads() under if (i < n), so in the last tile
//                                        the threads past n wait at the loop's second barrier
//                                        while the others wait at the first
//
// Every bug is a plausible one-line slip, and on a GPU three of them usually give the right
// numbers anyway (the lesson shows it): that is why the book runs the sanitizer on every kernel.
#include "common.cuh"

// ---------------------------------------------------------------------------- memcheck
// x, y: float32, n elements. y[0] = 0, y[i + 1] = x[i]: the sequence shifted right by one (as a
// language model's labels are shifted against its inputs).

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void shift_bug(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) y[0] = 0.0f;
    if (i < n) y[i + 1] = x[i];            // BUG: i = n - 1 writes y[n]
}

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void shift_fix(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) y[0] = 0.0f;
    if (i + 1 < n) y[i + 1] = x[i];        // the guard is on the index written
}

// ---------------------------------------------------------------------------- racecheck
// x, y: float32, n elements. Block b reverses elements [256 b, 256 b + 256), the part past n
// read as 0: y[256 b + t] = x[256 b + 255 - t] (0 where that index is >= n).

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 1 KiB
extern "C" __global__ void reverse_bug(const float* x, float* y, int n) {
    __shared__ float tile[256];
    int t = threadIdx.x, i = blockIdx.x * 256 + t;
    tile[t] = (i < n) ? x[i] : 0.0f;
    // BUG: no __syncthreads(): tile[255 - t] is written by another warp, maybe not yet
    if (i < n) y[i] = tile[255 - t];
}

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 1 KiB
extern "C" __global__ void reverse_fix(const float* x, float* y, int n) {
    __shared__ float tile[256];
    int t = threadIdx.x, i = blockIdx.x * 256 + t;
    tile[t] = (i < n) ? x[i] : 0.0f;
    __syncthreads();                       // every warp's write lands before any warp reads
    if (i < n) y[i] = tile[255 - t];
}

// ---------------------------------------------------------------------------- initcheck
// x: float32 (M, N) row-major; out: float32 (M,), out[row] = max_j x[row, j]. One thread per
// row (a demonstration, not a fast row reduction: see ex05.5 for that).

// launch: grid = ceil_div(M, 128), block = 128
extern "C" __global__ void rowmax_bug(const float* x, float* out, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M) return;
    for (int j = 0; j < N; ++j)            // BUG: the first fmaxf reads out[row], never written
        out[row] = fmaxf(out[row], x[(size_t)row * N + j]);
}

// launch: grid = ceil_div(M, 128), block = 128
extern "C" __global__ void rowmax_fix(const float* x, float* out, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M) return;
    float m = -INFINITY;                   // the max of no elements; kept in a register
    for (int j = 0; j < N; ++j) m = fmaxf(m, x[(size_t)row * N + j]);
    out[row] = m;                          // one write, nothing read from out
}

// ---------------------------------------------------------------------------- synccheck
// x, y: float32, n elements. y[i] = (x[i - 1] + x[i] + x[i + 1]) / 3, x read as 0 outside
// [0, n). Block b stages x[256 b - 1 .. 256 b + 256] (its 256 elements and one halo element on
// each side) in a shared tile of 258 floats.

// launch: grid = ceil_div(n, 256) or fewer, block = 256, static shared memory 258 floats
extern "C" __global__ void smooth_bug(const float* x, float* y, int n) {
    __shared__ float tile[258];
    int t = threadIdx.x;
    for (int base = blockIdx.x * 256; base < n; base += gridDim.x * 256) {   // tile by tile
        int i = base + t;
        if (i < n) {                       // BUG: the first barrier below is inside this branch
            tile[t + 1] = x[i];
            if (t == 0) tile[0] = (i > 0) ? x[i - 1] : 0.0f;
            if (t == 255 || i == n - 1) tile[t + 2] = (i + 1 < n) ? x[i + 1] : 0.0f;
            __syncthreads();               // threads with i >= n never arrive here ...
            y[i] = (tile[t] + tile[t + 1] + tile[t + 2]) * (1.0f / 3.0f);
        }
        __syncthreads();                   // ... they wait here, at another barrier
    }
}

// launch: grid = ceil_div(n, 256) or fewer, block = 256, static shared memory 258 floats
extern "C" __global__ void smooth_fix(const float* x, float* y, int n) {
    __shared__ float tile[258];
    int t = threadIdx.x;
    for (int base = blockIdx.x * 256; base < n; base += gridDim.x * 256) {
        int i = base + t;
        tile[t + 1] = (i < n) ? x[i] : 0.0f;   // every thread loads (0 past the end) ...
        if (t == 0) tile[0] = (i > 0 && i - 1 < n) ? x[i - 1] : 0.0f;
        if (t == 255) tile[257] = (i + 1 < n) ? x[i + 1] : 0.0f;
        __syncthreads();                       // ... and every thread reaches both barriers
        if (i < n) y[i] = (tile[t] + tile[t + 1] + tile[t + 2]) * (1.0f / 3.0f);   // the guard
        __syncthreads();                       // the tile is written again in the next round
    }
}
