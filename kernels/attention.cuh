// attention.cuh: device code shared by attention_forward.cu and attention_backward.cu (Chapter 9).
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
//
// Layout of every tensor: (BH, N, D) row-major and contiguous, BH = batch x heads (a (B, H, N, D)
// tensor is the same memory). Scores are S = scale * Q K^T; the kernels work in log2 units
// (scale_log2 = scale * log2(e), exp2 instead of exp: one FFMA + MUFU.EX2 per element) and store
// the logsumexp in natural-log units, lse[i] = log(sum_j exp(S[i, j])), as PyTorch does.
// Causal masks are top-left aligned (torch's is_causal): query i sees keys j <= i.
#pragma once
#include "common.cuh"
#include "mma.cuh"

#ifndef INFINITY  // NVRTC (CuPy) has no math.h: build +inf from its bit pattern
#define INFINITY __int_as_float(0x7f800000)
#endif
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

// ----- the 4 lanes of a quad ------------------------------------------------------------------
// A row of an m16n8 accumulator (mma.cuh) lies in the 4 lanes of a quad, lanes 4g..4g+3, as does
// a query (or key) of the fp32 kernels, 4 threads each: two shuffles combine them, and every lane
// of the quad gets the result. R: an operator of common.cuh (Sum, Max).
template <typename R>
__device__ __forceinline__ float quad_reduce(float v) {
    v = R::combine(v, R::shfl(v, 1));
    v = R::combine(v, R::shfl(v, 2));
    return v;
}
__device__ __forceinline__ float quad_sum(float v) { return quad_reduce<Sum<float>>(v); }
__device__ __forceinline__ float quad_max(float v) { return quad_reduce<Max<float>>(v); }

// ----- shared-memory tiles of 16-bit values, swizzled -----------------------------------------
// A tile row of COLS 16-bit values is COLS / 8 chunks of 16 bytes. Rows of 64 or 128 values are a
// multiple of 128 bytes long, so the 8 rows one ldmatrix matrix reads would all start in the same
// bank: an 8-way conflict. Storing chunk c of row r at chunk position c ^ (r % 8) spreads those 8
// rows over 8 different 16-byte bank groups (conflict-free), for the cp.async writes too.
// Needs COLS >= 64 (at least 8 chunks to permute).
template <int COLS>
__device__ __forceinline__ int swz(int r, int c) {
    static_assert(COLS % 64 == 0, "swizzled tiles need rows of a multiple of 64 values");
    return r * COLS + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
}

// ROWS x COLS tile of src (rows of COLS contiguous values) from row0 on, into swizzled shared
// memory, with cp.async; rows at or past nrows are zero-filled (the ragged end of a sequence:
// nothing is read there). NT threads share the copy; each moves 16-byte chunks, neighbouring
// threads neighbouring chunks (coalesced). The caller commits and waits.
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile(T* dst, const T* __restrict__ src, int row0, int nrows) {
    constexpr int CH = COLS / 8;
    static_assert((ROWS * CH) % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int k = 0; k < ROWS * CH / NT; k++) {
        int i = threadIdx.x + k * NT;
        int r = i / CH, c = (i % CH) * 8;
        bool ok = row0 + r < nrows;
        const T* p = src + (size_t)(ok ? row0 + r : 0) * COLS + c;   // stays a valid address
        cp_async_16_zfill(dst + swz<COLS>(r, c), p, ok);
    }
}

// ----- the two 16-bit input types behind one name ---------------------------------------------
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static constexpr bool bf16 = false;
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
        mma_m16n8k16_f16(c, a, b);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        return pack_half2(lo, hi);
    }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct Mma<__nv_bfloat16> {
    static constexpr bool bf16 = true;
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
        mma_m16n8k16_bf16(c, a, b);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        return pack_bf162(lo, hi);
    }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) {
        return __bfloat162float(x);
    }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
        return __float2bfloat16_rn(x);
    }
};

// The accumulator of S = A B (16 x 8 per n-tile, c[0..3] as in mma.cuh) doubles as the A operand
// of the next product: two neighbouring n-tiles s0 (columns 0-7) and s1 (8-15) of a 16 x 16
// block of P, rounded to 16 bits, are exactly the registers a[0..3] of that block.
template <typename T>
__device__ __forceinline__ void acc_to_a(unsigned* a, const float* s0, const float* s1) {
    a[0] = Mma<T>::pack(s0[0], s0[1]);
    a[1] = Mma<T>::pack(s0[2], s0[3]);
    a[2] = Mma<T>::pack(s1[0], s1[1]);
    a[3] = Mma<T>::pack(s1[2], s1[3]);
}

// ----- Hopper (sm_90a): the wgmma forms the attention kernels use ------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d += A (64 x 16, K-major in shared) @ B (16 x N, B stored (N, K) in shared)
template <int N, typename T>
__device__ __forceinline__ void wg_ss(float* d, unsigned long long da, unsigned long long db) {
    static_assert(N == 64 || N == 128, "S tiles of 64 or 128 keys");
    if constexpr (Mma<T>::bf16) {
        if constexpr (N == 128) wgmma_m64n128k16_bf16(d, da, db);
        else wgmma_m64n64k16_bf16(d, da, db);
    } else {
        if constexpr (N == 128) wgmma_m64n128k16_f16(d, da, db);
        else wgmma_m64n64k16_f16(d, da, db);
    }
}
// d += A (64 x 16, registers) @ B (16 x N, stored (K, N) in shared)
template <int N, typename T>
__device__ __forceinline__ void wg_rs(float* d, const unsigned* a, unsigned long long db) {
    static_assert(N == 64 || N == 128, "head dimensions 64 or 128");
    if constexpr (Mma<T>::bf16) {
        if constexpr (N == 128) wgmma_m64n128k16_rs_bf16(d, a, db);
        else wgmma_m64n64k16_rs_bf16(d, a, db);
    } else {
        if constexpr (N == 128) wgmma_m64n128k16_rs_f16(d, a, db);
        else wgmma_m64n64k16_rs_f16(d, a, db);
    }
}
// d += A (64 x 16) @ B (16 x 64), both MN-major in shared (the backward's dQ = dS K)
template <typename T>
__device__ __forceinline__ void wg_tt(float* d, unsigned long long da, unsigned long long db) {
    if constexpr (Mma<T>::bf16) wgmma_m64n64k16_tt_bf16(d, da, db);
    else wgmma_m64n64k16_tt_f16(d, da, db);
}
// An empty asm that claims to change x: the compiler must keep x in its register until here, so
// registers an in-flight wgmma reads or writes are not reused before the wgmma_wait before it.
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void pin(unsigned& x) { asm volatile("" : "+r"(x) :: "memory"); }
template <int N, typename X>
__device__ __forceinline__ void pin_all(X* x) {
#pragma unroll
    for (int i = 0; i < N; i++) pin(x[i]);
}
// Named barriers 1 and 2, 256 threads: the two consumer warpgroups of a Hopper kernel (the
// forward's take turns issuing wgmma; the backward's meet where they exchange dS^T).
__device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory");
}
#endif
