// mma.cuh: warp-level tensor-core wrappers shared by chapters 8-10 (hgemm, attention).
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
//
//   smem_u32(p)                         shared-space address of a __shared__ pointer
//   ldmatrix_x1/x2/x4(r, addr)          load 1/2/4 8x8 b16 matrices from shared memory (sm_75+)
//   ldmatrix_x1/x2/x4_trans(r, addr)    the same, each 8x8 matrix transposed on the way (sm_75+)
//   mma_m16n8k8_f16(c, a, b)            c += a @ b, 16x8x8, f16 in, f32 accumulate (sm_75+)
//   mma_m16n8k16_f16(c, a, b)           c += a @ b, 16x8x16, f16 in, f32 accumulate
//                                       (sm_80+ one instruction; sm_75: two m16n8k8)
//   mma_m16n8k16_bf16(c, a, b)          the same with bf16 inputs (sm_80+; traps below)
//   cp_async_16(dst, src)               16-byte global -> shared copy, L1 bypassed (cp.async.cg)
//   cp_async_16_zfill(dst, src, ok)     the same, writing 16 zero bytes when !ok (ragged edges)
//   cp_async_commit(), cp_async_wait<N>()   close a group; wait until <= N groups are in flight
//   pack_half2(lo, hi), pack_bf162(lo, hi)  two floats -> one 32-bit register of two 16-bit values
//
// cp.async exists from sm_80. Below that the cp_async_* functions are plain synchronous 16-byte
// copies (and wait/commit do nothing), so code that uses them still compiles and stays correct
// for sm_75; the launch helpers refuse the pipelined kernels below cc 8.0 all the same.
//
// ---------------------------------------------------------------------------------------------
// Fragment layouts of mma.sync.aligned.m16n8k16 (f16/bf16 in, f32 accumulate). PTX ISA,
// "Matrix fragments for mma.m16n8k16". For lane l of the warp:
//     g = l / 4  (the "group", 0..7)        t = l % 4  (the thread in the group, 0..3)
// Each 32-bit register of A or B holds two 16-bit values: the lower half first (lower column of
// A, lower k of B). "(r, c)" is (row, column) of the operand as the maths names it.
//
//   A, 16x16 (M x K), 4 registers a[0..3]:
//     a[0] = A(g,     2t), A(g,     2t+1)        a[2] = A(g,     2t+8), A(g,     2t+9)
//     a[1] = A(g + 8, 2t), A(g + 8, 2t+1)        a[3] = A(g + 8, 2t+8), A(g + 8, 2t+9)
//   B, 16x8 (K x N), 2 registers b[0..1]:
//     b[0] = B(2t,     g), B(2t + 1, g)          b[1] = B(2t + 8, g), B(2t + 9, g)
//   C and D, 16x8 (M x N), 4 floats c[0..3]:
//     c[0] = C(g, 2t)   c[1] = C(g, 2t+1)        c[2] = C(g + 8, 2t)   c[3] = C(g + 8, 2t+1)
//
//   m16n8k8 (sm_75) is the left half: A has a[0], a[1] (k = 0..7), B has b[0]; C is the same.
//   So one m16n8k16 equals m16n8k8 on (a[0], a[1], b[0]) followed by m16n8k8 on (a[2], a[3], b[1]).
//
// ldmatrix: the warp loads up to four 8x8 matrices of 16-bit values. Lanes 8i..8i+7 give the
// shared addresses of rows 0..7 of matrix i (each row 16 contiguous bytes, 16-byte aligned; for
// .x1 and .x2 only the first 8 or 16 lanes' addresses are used, but every lane must pass a valid
// one). Afterwards lane l holds, in register i, row l/4 and columns 2(l%4), 2(l%4)+1 of matrix i:
// exactly the layout of one A register above. With .trans it holds column l/4, rows 2(l%4),
// 2(l%4)+1: the layout of one B register when B is stored with N contiguous.
//
//   A tile 16x16, row-major in shared (K contiguous): ldmatrix_x4 with lane l pointing at row
//     l % 16, column 8 * (l / 16) gives a[0..3] in order (matrices: rows 0-7/8-15 x cols 0-7/8-15).
//   B stored as (N, K), K contiguous (nn.Linear's weight): ldmatrix_x2 with lane l pointing at
//     row n = l % 8, column k = 8 * ((l / 8) % 2) gives b[0..1]; ldmatrix_x4 with row
//     n = (l % 8) + 8 * (l / 16), column k = 8 * ((l / 8) % 2) gives b[0..1] of two n8 tiles.
//   B stored as (K, N), N contiguous: the .trans forms, lane l pointing at row
//     k = (l % 8) + 8 * ((l / 8) % 2), column n = 8 * (l / 16).
// ---------------------------------------------------------------------------------------------
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The 32-bit shared-memory address (the .shared state space) of a pointer into __shared__ data.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ----- ldmatrix (sm_75+) ----------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x1(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ----- mma.sync: D = A @ B + C, accumulated in place in c (fragments as drawn above) -----------
// a: 2 registers, b: 1 register, c: 4 floats.
__device__ __forceinline__ void mma_m16n8k8_f16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
}

// a: 4 registers, b: 2 registers, c: 4 floats.
__device__ __forceinline__ void mma_m16n8k16_f16(float* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // sm_75 has only m16n8k8 for f16: the k16 step is two of them (see the layout note above)
    mma_m16n8k8_f16(c, a, b);
    mma_m16n8k8_f16(c, a + 2, b + 1);
#endif
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // bf16 tensor-core instructions start at sm_80; the launch helpers refuse before this.
    __trap();
#endif
}

// ----- cp.async (sm_80+; synchronous fallback below) -------------------------------------------
// dst: shared, src: global, both 16-byte aligned. .cg caches in L2 only (the tile is read once
// per block, so L1 would only be polluted).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"(smem_u32(dst)), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

// As cp_async_16, but when ok is false nothing is read (src may point anywhere) and the 16
// destination bytes become zero: the predication for tiles that hang over a ragged edge.
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = ok ? *reinterpret_cast<const uint4*>(src)
                                        : make_uint4(0u, 0u, 0u, 0u);
#endif
}

// Close the group of cp.async issued by this thread since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight. Only this thread's
// copies are covered: a __syncthreads() must follow before other threads read the tile.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}

// ----- packing ---------------------------------------------------------------------------------
// Two floats rounded to nearest into one register: lo in bits 0-15, hi in bits 16-31 (the order
// of the pairs in the fragments above).
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
