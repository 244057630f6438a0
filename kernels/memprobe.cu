// memprobe.cu: two probes of the memory system, for Little's law (Chapter 2) and the L2 roof of
// the roofline (cudabook.roofline, Chapters 2-4).
//
//   pointer_chase  one thread follows a chain j = next[j] for `steps` steps: every load needs
//                  the result of the one before, so nothing overlaps and the kernel's time
//                  divided by `steps` is the latency of one load (from DRAM when the chain is
//                  spread over far more bytes than L2 holds, from L2 when it fits)
//   read_repeat    every thread reads float4s grid-stride over x, `reps` times, and sums them:
//                  with x small enough to stay in L2, 16 n4 reps bytes / time is L2 bandwidth
//
// __ldcg loads through L2 only (no L1), so a short chain or a repeated read measures L2, not L1.
#include "common.cuh"

// launch: grid = 1, block = 1 (one thread, on purpose)
extern "C" __global__ void pointer_chase(const unsigned int* __restrict__ next, int steps,
                                         unsigned int* __restrict__ out) {
    unsigned int j = 0;
    for (int s = 0; s < steps; ++s) j = __ldcg(next + j);
    out[0] = j;                                   // keeps the chain alive
}

// launch: grid = SMs x (resident threads per SM / 256), block = 256; out has grid x block floats
extern "C" __global__ void read_repeat(const float4* __restrict__ x, int n4, int reps,
                                       float* __restrict__ out) {
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = 0; r < reps; ++r) {
#pragma unroll 4
        for (int i = tid; i < n4; i += stride) {
            float4 v = __ldcg(x + i);
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
    }
    out[tid] = acc.x + acc.y + acc.z + acc.w;     // one value per thread: nothing is dead code
}
