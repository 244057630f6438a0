// ch03_emu.h: a tiny CPU emulator of the CUDA features the Chapter 3 kernels use, to test their
// logic without a GPU (see ch03_emu.cpp for the build line). Not a general CUDA emulator.
// A tiny CPU emulator of the CUDA features Chapter 3's kernels use: one OS thread per CUDA
// thread, blocks run one after another, __syncthreads = block barrier, shuffles via a buffer and
// a warp barrier, atomics under a mutex.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#undef INFINITY
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __constant__
#define __launch_bounds__(x)
#define __restrict__
inline std::barrier<>* g_block_bar;
inline std::vector<std::barrier<>*> g_warp_bar;
inline float g_shfl[1024];
inline std::mutex g_atomic;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int emu_tid() { return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y; }
inline float emu_shfl(float v, int src_lane, bool valid) {
    int t = emu_tid(), w = t / 32;
    g_shfl[t] = v;
    g_warp_bar[w]->arrive_and_wait();
    float r = valid ? g_shfl[w * 32 + src_lane] : v;
    g_warp_bar[w]->arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { int l = emu_tid() % 32; return emu_shfl(v, l ^ o, true); }
inline float __shfl_down_sync(unsigned, float v, int o) { int l = emu_tid() % 32; return emu_shfl(v, l + o, l + o < 32); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float atomicAdd(float* a, float v) { std::lock_guard<std::mutex> g(g_atomic); float o = *a; *a += v; return o; }
inline int atomicCAS(int* a, int cmp, int v) { std::lock_guard<std::mutex> g(g_atomic); int o = *a; if (o == cmp) *a = v; return o; }
struct float4 { float x, y, z, w; };
struct alignas(16) float4a { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
#include <math.h>

template <class F> void launch(dim3 g, dim3 b, F f) {
    gridDim = g; blockDim = b;
    int nt = b.x * b.y * b.z;
    for (unsigned bz = 0; bz < g.z; bz++) for (unsigned by = 0; by < g.y; by++)
    for (unsigned bx = 0; bx < g.x; bx++) {
        std::barrier<> bar(nt);
        g_block_bar = &bar;
        std::vector<std::barrier<>*> wb;
        for (int w = 0; w < (nt + 31) / 32; w++) wb.push_back(new std::barrier<>(std::min(32, nt - 32 * w)));
        g_warp_bar = wb;
        std::vector<std::thread> th;
        for (int t = 0; t < nt; t++) th.emplace_back([=] {
            blockIdx = {bx, by, bz};
            threadIdx = {unsigned(t % b.x), unsigned((t / b.x) % b.y), unsigned(t / (b.x * b.y))};
            f();
        });
        for (auto& x : th) x.join();
        for (auto* p : wb) delete p;
    }
}
