// ch09_emu.h: a CPU emulator of the CUDA features Chapter 9's attention kernels use, so that their
// indexing, masking, barriers and tensor-core fragment handling can be tested with no GPU
// (driven by ch09_emulate.py, which also swaps kernels/mma.cuh for the emulated one below).
//
// One OS thread per CUDA thread, blocks one after another; __syncthreads is a block barrier;
// warp-wide operations (shuffles, ldmatrix, mma.sync) exchange values through per-warp slots
// between two warp barriers, and each lane computes its own part exactly as the PTX ISA lays the
// fragments out. 16-bit types round to nearest even. cp.async is a synchronous copy. Not a
// general CUDA emulator; performance means nothing here.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__
using std::min;
using std::max;

inline std::barrier<>* g_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
struct EmuSlot { unsigned char b[64]; };
inline EmuSlot g_slot[32][32];                       // [warp][lane]
alignas(1024) inline unsigned char emu_dyn_smem[232 * 1024];
inline std::mutex g_atomic;

inline int emu_tid() { return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y; }
inline int emu_warp() { return emu_tid() / 32; }
inline int emu_lane() { return emu_tid() % 32; }
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void emu_warp_sync() { g_warp_bar[emu_warp()]->arrive_and_wait(); }
template <class T> void emu_put(const T& v) { static_assert(sizeof(T) <= 64); std::memcpy(g_slot[emu_warp()][emu_lane()].b, &v, sizeof(T)); }
template <class T> T emu_get(int lane) { T v; std::memcpy(&v, g_slot[emu_warp()][lane].b, sizeof(T)); return v; }

inline float __shfl_xor_sync(unsigned, float v, int o) {
    emu_put(v); emu_warp_sync();
    float r = emu_get<float>(emu_lane() ^ o);
    emu_warp_sync();
    return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
inline float atomicAdd(float* a, float v) { std::lock_guard<std::mutex> g(g_atomic); float o = *a; *a += v; return o; }
inline void __trap() { std::abort(); }

// ----- 16-bit floating-point types -----------------------------------------------------------
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline __half __float2half_rn(float f) { _Float16 h = (_Float16)f; __half r; std::memcpy(&r.x, &h, 2); return r; }
inline float __half2float(__half h) { _Float16 v; std::memcpy(&v, &h.x, 2); return (float)v; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if (std::isnan(f)) { r.x = 0x7fc0; return r; }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.x = (uint16_t)(u >> 16);
    return r;
}
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; std::memcpy(&f, &u, 4); return f; }

// ----- the kernels/mma.cuh interface ----------------------------------------------------------
inline unsigned smem_u32(const void* p) {
    std::ptrdiff_t d = (const unsigned char*)p - emu_dyn_smem;
    if (d < 0 || d >= (std::ptrdiff_t)sizeof(emu_dyn_smem)) std::abort();  // not dynamic shared memory
    return (unsigned)d;
}
inline uint16_t emu_ld16(unsigned addr) {
    if (addr + 2 > sizeof(emu_dyn_smem)) std::abort();
    uint16_t v; std::memcpy(&v, emu_dyn_smem + addr, 2); return v;
}
// lanes 8i..8i+7 give the row addresses of matrix i; lane l gets row l/4, columns 2(l%4), +1
// (trans: column l/4, rows 2(l%4), +1)
inline void emu_ldmatrix(unsigned* r, unsigned addr, int n, bool trans) {
    emu_put(addr); emu_warp_sync();
    int l = emu_lane();
    for (int i = 0; i < n; i++) {
        uint16_t lo, hi;
        if (!trans) {
            unsigned row = emu_get<unsigned>(8 * i + l / 4);
            if (row % 16) std::abort();                          // rows must be 16-byte aligned
            lo = emu_ld16(row + 2 * (2 * (l % 4)));
            hi = emu_ld16(row + 2 * (2 * (l % 4) + 1));
        } else {
            lo = emu_ld16(emu_get<unsigned>(8 * i + 2 * (l % 4)) + 2 * (l / 4));
            hi = emu_ld16(emu_get<unsigned>(8 * i + 2 * (l % 4) + 1) + 2 * (l / 4));
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    emu_warp_sync();
}
inline void ldmatrix_x1(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 1, false); }
inline void ldmatrix_x2(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 2, false); }
inline void ldmatrix_x4(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 4, false); }
inline void ldmatrix_x1_trans(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 1, true); }
inline void ldmatrix_x2_trans(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 2, true); }
inline void ldmatrix_x4_trans(unsigned* r, unsigned a) { emu_ldmatrix(r, a, 4, true); }

struct EmuFrag { unsigned a[4], b[2]; };
template <class F>  // F: 16-bit pattern -> float
inline void emu_mma(float* c, const unsigned* a, const unsigned* b, int K, F cvt) {
    EmuFrag f{};
    for (int i = 0; i < (K == 16 ? 4 : 2); i++) f.a[i] = a[i];
    for (int i = 0; i < (K == 16 ? 2 : 1); i++) f.b[i] = b[i];
    emu_put(f); emu_warp_sync();
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        EmuFrag x = emu_get<EmuFrag>(L);
        int g = L / 4, t = L % 4;
        auto lo = [&](unsigned v) { return cvt((uint16_t)(v & 0xffff)); };
        auto hi = [&](unsigned v) { return cvt((uint16_t)(v >> 16)); };
        A[g][2 * t] = lo(x.a[0]);     A[g][2 * t + 1] = hi(x.a[0]);
        A[g + 8][2 * t] = lo(x.a[1]); A[g + 8][2 * t + 1] = hi(x.a[1]);
        B[2 * t][g] = lo(x.b[0]);     B[2 * t + 1][g] = hi(x.b[0]);
        if (K == 16) {
            A[g][2 * t + 8] = lo(x.a[2]);     A[g][2 * t + 9] = hi(x.a[2]);
            A[g + 8][2 * t + 8] = lo(x.a[3]); A[g + 8][2 * t + 9] = hi(x.a[3]);
            B[2 * t + 8][g] = lo(x.b[1]);     B[2 * t + 9][g] = hi(x.b[1]);
        }
    }
    int l = emu_lane(), g = l / 4, t = l % 4;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; e++) {
        float acc = c[e];
        for (int k = 0; k < K; k++) acc += A[rows[e]][k] * B[k][cols[e]];
        c[e] = acc;
    }
    emu_warp_sync();
}
inline float emu_h2f(uint16_t v) { __half h{v}; return __half2float(h); }
inline float emu_b2f(uint16_t v) { __nv_bfloat16 h{v}; return __bfloat162float(h); }
inline void mma_m16n8k8_f16(float* c, const unsigned* a, const unsigned* b) { emu_mma(c, a, b, 8, emu_h2f); }
inline void mma_m16n8k16_f16(float* c, const unsigned* a, const unsigned* b) { emu_mma(c, a, b, 16, emu_h2f); }
inline void mma_m16n8k16_bf16(float* c, const unsigned* a, const unsigned* b) { emu_mma(c, a, b, 16, emu_b2f); }

inline void cp_async_16(void* dst, const void* src) {
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) std::abort();
    std::memcpy(dst, src, 16);
}
inline void cp_async_16_zfill(void* dst, const void* src, bool ok) {
    if ((uintptr_t)dst % 16) std::abort();
    if (ok) cp_async_16(dst, src); else std::memset(dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline unsigned pack_half2(float lo, float hi) { return (unsigned)__float2half_rn(lo).x | ((unsigned)__float2half_rn(hi).x << 16); }
inline unsigned pack_bf162(float lo, float hi) { return (unsigned)__float2bfloat16_rn(lo).x | ((unsigned)__float2bfloat16_rn(hi).x << 16); }

// ----- launch: blocks one after another, one thread per CUDA thread ---------------------------
template <class F> void emu_launch(dim3 g, dim3 b, F f) {
    gridDim = g; blockDim = b;
    int nt = b.x * b.y * b.z, nw = (nt + 31) / 32;
    if (nt % 32) std::abort();                             // whole warps only
    for (unsigned bz = 0; bz < g.z; bz++) for (unsigned by = 0; by < g.y; by++)
    for (unsigned bx = 0; bx < g.x; bx++) {
        std::barrier<> bar(nt);
        g_block_bar = &bar;
        g_warp_bar.clear();
        for (int w = 0; w < nw; w++) g_warp_bar.emplace_back(new std::barrier<>(32));
        std::memset(emu_dyn_smem, 0xff, sizeof(emu_dyn_smem));   // NaN-ish garbage
        std::vector<std::thread> ts;
        for (int t = 0; t < nt; t++)
            ts.emplace_back([&, t, bx, by, bz] {
                threadIdx = {(unsigned)(t % b.x), (unsigned)((t / b.x) % b.y), (unsigned)(t / (b.x * b.y))};
                blockIdx = {bx, by, bz};
                f();
            });
        for (auto& th : ts) th.join();
    }
}
