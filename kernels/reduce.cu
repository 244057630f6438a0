// reduce.cu: sum (and max) of a float32 vector, the reduction ladder (Chapter 3).
//
// x: float32, n elements, contiguous. v1-v4 write one partial result per block to
// partial[blockIdx.x]; the host launches again on the partials until one value is left
// (two or three launches). v5 adds each block's result into out[0] with one atomic per block.
//
// kernels, simplest first (each line: what changed)
//   reduce_v1      shared-memory tree, interleaved addressing (tid % (2s) == 0): divergent warps
//   reduce_v2      sequential addressing (tid < s): active threads stay packed in few warps,
//                  and the shared-memory accesses are conflict-free
//   reduce_v3      first add during load: each thread loads two elements, half the blocks
//   reduce_v4      warp shuffles (__shfl_down_sync) for the last 32 partials: no shared memory
//                  and no __syncthreads inside a warp
//   reduce_v5      grid-stride loop with float4 loads over the whole vector, one block-level
//                  shuffle reduction (block_sum), then ONE atomicAdd per block into out[0]
//                  (out zeroed first)
//   reduce_max_v1  the maximum, the way reduce_v5 sums: grid-stride float4 loop, block_max,
//                  one atomic per block (there is no float atomicMax: a compare-and-swap loop)
//
// v1-v4 teach the block reduction step by step, so each writes its tree (or its shuffles) out in
// full, on purpose. v5 and reduce_max_v1 use block_sum / block_max of common.cuh, the one block
// reduction every other kernel of the book uses.
//
// traffic: 4 n bytes read, nothing written but the partials: the ceiling is read bandwidth.
// Order: a float32 sum's rounding depends on the order of the additions. v1-v4 are
// deterministic (fixed tree); v5's atomics add the block results in arrival order, so its last
// bits can change from run to run.
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 256 floats
// (the block size must be 256, a power of two)
extern "C" __global__ void reduce_v1(const float* x, float* partial, int n) {
    __shared__ float s[256];
    int tid = threadIdx.x;
    int i = blockIdx.x * blockDim.x + tid;
    s[tid] = (i < n) ? x[i] : 0.0f;                    // 0 past the end: the last block is partial
    __syncthreads();
    for (int stride = 1; stride < blockDim.x; stride *= 2) {
        if (tid % (2 * stride) == 0) s[tid] += s[tid + stride];   // half the warp idles
        __syncthreads();                               // every level reads the previous one
    }
    if (tid == 0) partial[blockIdx.x] = s[0];
}

// launch: grid = ceil_div(n, 256), block = 256, static shared memory 256 floats
extern "C" __global__ void reduce_v2(const float* x, float* partial, int n) {
    __shared__ float s[256];
    int tid = threadIdx.x;
    int i = blockIdx.x * blockDim.x + tid;
    s[tid] = (i < n) ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) s[tid] += s[tid + stride];   // threads 0..stride-1: whole warps work
        __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = s[0];
}

// launch: grid = ceil_div(n, 2 * 256), block = 256, static shared memory 256 floats
extern "C" __global__ void reduce_v3(const float* x, float* partial, int n) {
    __shared__ float s[256];
    int tid = threadIdx.x;
    int i = blockIdx.x * (2 * blockDim.x) + tid;
    float v = (i < n) ? x[i] : 0.0f;
    if (i + blockDim.x < n) v += x[i + blockDim.x];    // the first level of the tree, in registers
    s[tid] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) s[tid] += s[tid + stride];
        __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = s[0];
}

// launch: grid = ceil_div(n, 2 * 256), block = 256 (any multiple of 32 up to 1024),
// static shared memory 32 floats
// Two levels of shuffles: each warp sums its 32 values in registers (lane 0 gets the sum),
// the warp sums meet in shared memory, and the first warp sums those.
extern "C" __global__ void reduce_v4(const float* x, float* partial, int n) {
    __shared__ float warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int i = blockIdx.x * (2 * blockDim.x) + threadIdx.x;
    float v = (i < n) ? x[i] : 0.0f;
    if (i + blockDim.x < n) v += x[i + blockDim.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);  // lane 0 has it
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();                                   // all warp sums written before reading
    if (warp == 0) {
        v = (lane < (int)(blockDim.x >> 5)) ? warp_sums[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0) partial[blockIdx.x] = v;
    }
}

// launch: grid = 2 * SMs .. 8 * SMs (a few resident blocks per SM), block = 512 (a multiple
// of 32), static shared memory 33 floats; out[0] must be 0 before the launch; x 16-byte aligned
// (the launch helper, kernels/reduce_launch.py, checks it).
// Each thread sums a strided slice with float4 loads (4 independent accumulators keep several
// loads in flight), then the block reduces with shuffles and adds once to out[0].
extern "C" __global__ void reduce_v5(const float* x, float* out, int n) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n4 = n / 4;
    int stride = gridDim.x * blockDim.x;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + stride < n4; i += 2 * stride) {         // two float4 loads in flight per thread
        float4 p = x4[i], q = x4[i + stride];
        a0 += p.x + q.x; a1 += p.y + q.y; a2 += p.z + q.z; a3 += p.w + q.w;
    }
    if (i < n4) { float4 p = x4[i]; a0 += p.x; a1 += p.y; a2 += p.z; a3 += p.w; }
    float v = (a0 + a1) + (a2 + a3);
    int t = 4 * n4 + blockIdx.x * blockDim.x + threadIdx.x;   // the n % 4 tail elements
    if (t < n) v += x[t];
    v = block_sum(v, sbuf);                            // common.cuh: every thread gets it
    if (threadIdx.x == 0) atomicAdd(out, v);           // one atomic per block
}

// There is no atomicMax for float: compare-and-swap until our value is in or a larger one is.
__device__ __forceinline__ void atomic_max_float(float* addr, float v) {
    int* a = reinterpret_cast<int*>(addr);
    int old = *a;
    while (v > __int_as_float(old)) {
        int assumed = old;
        old = atomicCAS(a, assumed, __float_as_int(v));
        if (old == assumed) break;
    }
}

// launch: as reduce_v5; out[0] must be -inf before the launch. NaNs are ignored.
extern "C" __global__ void reduce_max_v1(const float* x, float* out, int n) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n4 = n / 4;
    float m = -INFINITY;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += gridDim.x * blockDim.x) {
        float4 p = x4[i];
        m = fmaxf(m, fmaxf(fmaxf(p.x, p.y), fmaxf(p.z, p.w)));
    }
    int t = 4 * n4 + blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) m = fmaxf(m, x[t]);
    m = block_max(m, sbuf);
    if (threadIdx.x == 0) atomic_max_float(out, m);
}
