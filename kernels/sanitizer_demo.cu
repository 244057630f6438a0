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
//   blocksum_bug blocksum_fix synccheck  each block sums its 256 elements by Chapter 3's tree in
//                                        shared memory; the bug puts the step's __syncthreads()
//                                        inside if (t < s), so the threads t >= s skip it:
//                                        undefined behaviour, which synccheck reports as "Barrier
//                                        error detected. Divergent thread(s) in warp"
//
// Every bug is a plausible one-line slip that can still give the right numbers on some GPU or in
// some run (the lesson shows which): that is why the book runs the sanitizer on every kernel.
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
// x: float32, n elements; y: float32, ceil_div(n, 256) elements. y[b] = x[256 b] + ... +
// x[256 b + 255], x read as 0 past n: Chapter 3's tree sum (reduce_v2) in a shared buffer, 128
// sums, then 64, ..., then 1, with a barrier between the steps.
//
// A __syncthreads() must be reached by every thread of the block (the CUDA C++ Programming Guide
// allows one in conditional code only where the condition is the same across the whole block).
// The bug's barrier sits inside if (t < s): at each step the threads t >= s skip it, so the block
// waits at a barrier that part of it never reaches. Nothing defines what the block does then: it
// may hang, or go on with the barrier not doing its job; and since the threads that skip have no
// work left, the sums can come out right on some GPUs. From s = 16 down the branch splits warp 0,
// and compute-sanitizer --tool synccheck reports "Barrier error detected. Divergent thread(s) in
// warp" at the barrier's line (seen on an H200).

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 1 KiB
extern "C" __global__ void blocksum_bug(const float* x, float* y, int n) {
    __shared__ float buf[256];
    int t = threadIdx.x, i = blockIdx.x * 256 + t;
    buf[t] = (i < n) ? x[i] : 0.0f;        // 0 past the end: the last block is partial
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (t < s) {
            buf[t] += buf[t + s];
            __syncthreads();               // BUG: the threads t >= s never reach this barrier
        }
    }
    if (t == 0) y[blockIdx.x] = buf[0];
}

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 1 KiB
extern "C" __global__ void blocksum_fix(const float* x, float* y, int n) {
    __shared__ float buf[256];
    int t = threadIdx.x, i = blockIdx.x * 256 + t;
    buf[t] = (i < n) ? x[i] : 0.0f;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];   // only the add is guarded ...
        __syncthreads();                   // ... every thread reaches the barrier, every step
    }
    if (t == 0) y[blockIdx.x] = buf[0];
}
