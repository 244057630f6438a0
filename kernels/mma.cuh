// mma.cuh: warp-level tensor-core wrappers shared by chapters 8-10 (hgemm, attention).
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
//
//   smem_u32(p)                         shared-space address of a __shared__ pointer
//   align_1024(base)                    the first 1024-byte boundary at or after base (shared)
//   tile_of<GROUP>(b, tm, tn, bm, bn)   tile (bm, bn) of C for block b, GROUP tile rows at a time
//   ldmatrix_x1/x2/x4(r, addr)          load 1/2/4 8x8 b16 matrices from shared memory (sm_75+)
//   ldmatrix_x1/x2/x4_trans(r, addr)    the same, each 8x8 matrix transposed on the way (sm_75+)
//   mma_m16n8k8_f16(c, a, b)            c += a @ b, 16x8x8, f16 in, f32 accumulate (sm_75+)
//   mma_m16n8k16_f16(c, a, b)           c += a @ b, 16x8x16, f16 in, f32 accumulate
//                                       (sm_80+ one instruction; sm_75: two m16n8k8)
//   mma_m16n8k16_bf16(c, a, b)          the same with bf16 inputs (sm_80+; traps below)
//   mma_m16n8k32_s8(c, a, b)            c += a @ b, 16x8x32, int8 in, int32 accumulate (sm_80+;
//                                       traps below). Fragments: the f16 layout below with each
//                                       register holding 4 int8 (k = 4t..4t+3) instead of 2 f16
//   mma_m16n8k32_e4m3(c, a, b)          the same with fp8 e4m3 in, f32 accumulate (sm_89+)
//   cp_async_16(dst, src)               16-byte global -> shared copy, L1 bypassed (cp.async.cg)
//   cp_async_16_zfill(dst, src, ok)     the same, writing 16 zero bytes when !ok (ragged edges)
//   cp_async_16_s(dst, src)             cp_async_16 to a shared-space address (u32, smem_u32)
//   cp_async_16_part(dst, src, bytes)   16 bytes of floats, the first `bytes` from src, the rest 0
//   cp_async_4_zfill(dst, src, ok)      one float (cp.async.ca), 0 when !ok
//   cp_async_commit(), cp_async_wait<N>()   close a group; wait until <= N groups are in flight
//   (the cp.async wrappers of the book: hgemm, igemm, attention, matmul_v9-v11)
//   pack_half2(lo, hi), pack_bf162(lo, hi)  two floats -> one 32-bit register of two 16-bit values
//   sm_90 only: mbar_* (mbarriers), tma_load_2d, bulk copies, and the thread-block cluster
//   primitives (cluster_rank, cluster_sync, cluster_map, st_async16, ...: the Hopper list below)
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

// The first 1024-byte boundary at or after base, a pointer into dynamic shared memory: the
// 128-byte swizzle repeats every 1024 bytes and TMA and wgmma compute it from the address, so
// the launches add 1024 bytes of slack (hgemm v7-v9, igemm's fp8gemm_v3).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* base) {
    return base + ((1024u - (smem_u32(base) & 1023u)) & 1023u);
}

// Tile (bm, bn) of C computed by block b of a 1D grid. GROUP = 1: row by row. GROUP > 1: blocks
// walk down GROUP tile rows before moving right, so blocks running together share their A rows
// and B columns in L2.
template <int GROUP>
__device__ __forceinline__ void tile_of(int b, int tiles_m, int tiles_n, int& bm, int& bn) {
    if (GROUP == 1) {
        bm = b / tiles_n;
        bn = b % tiles_n;
        return;
    }
    const int per_group = GROUP * tiles_n, first = (b / per_group) * GROUP;
    const int rows = min(tiles_m - first, GROUP), i = b % per_group;
    bm = first + i % rows;
    bn = i / rows;
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

// 8-bit inputs, k32: a 4 registers, b 2 registers (4 values each), c 4 accumulators.
__device__ __forceinline__ void mma_m16n8k32_s8(int* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();   // int8 m16n8k32 starts at sm_80; the launch helpers refuse before this
#endif
}
__device__ __forceinline__ void mma_m16n8k32_e4m3(float* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();   // fp8 tensor-core instructions start at sm_89; the launch helpers refuse before
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

// As cp_async_16, to a shared-space address (smem_u32) instead of a pointer: for copy addresses
// kept as one 32-bit register plus immediates (hgemm_v10).
__device__ __forceinline__ void cp_async_16_s(unsigned dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(__cvta_shared_to_generic(dst)) =
        *reinterpret_cast<const uint4*>(src);
#endif
}

// 16 bytes, of which the first `bytes` (0, 4, 8, 12 or 16) come from src and the rest are zero:
// the last chunk of a row of floats that ends inside it (matmul_v9-v11). src 16-byte aligned.
__device__ __forceinline__ void cp_async_16_part(float* dst, const float* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes) : "memory");
#else
    for (int e = 0; e < 4; ++e) dst[e] = e * 4 < bytes ? src[e] : 0.f;
#endif
}

// One float, zero when !ok (src may then point anywhere): element-wise copies, such as a tile
// transposed on its way into shared memory (matmul_v9-v11). 4-byte copies exist only as .ca
// (cached in L1 too).
__device__ __forceinline__ void cp_async_4_zfill(float* dst, const float* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(ok ? 4 : 0) : "memory");
#else
    *dst = ok ? *src : 0.f;
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

// ===== Hopper (sm_90): mbarrier, TMA, wgmma, setmaxnreg =======================================
//
//   TmaDesc                             a CUtensorMap's 128 bytes, passed by value as a
//                                       `const __grid_constant__ TmaDesc` kernel parameter
//   mbar_init(bar, n), mbar_expect_tx(bar, bytes), mbar_arrive(bar), mbar_wait(bar, parity)
//   fence_barrier_init(), fence_proxy_async()
//   warpgroup_sync(id)                  bar.sync id over one warpgroup's 128 threads
//   tma_load_2d(dst, &desc, bar, x, y)  copy the box at column x, row y of the tensor map into
//                                       shared dst; bar's transaction count drops by its bytes
//   bulk_load(dst, src, bytes, bar)     the same for `bytes` contiguous bytes (no tensor map)
//   tma_store_2d(&desc, src, x, y)      shared src to the box at column x, row y (bulk group)
//   bulk_reduce_add_f32(dst, src, bytes), bulk_commit(), bulk_wait_read<N>(), bulk_wait<N>()
//                                       global dst += shared src (floats) by the copy engine
//   cluster_rank(), cluster_size()      this block's rank in its cluster, the cluster's blocks
//   cluster_sync() = cluster_arrive() + cluster_wait()   the barrier of all the cluster's threads
//   cluster_map(p, rank), st_async16(raddr, v, rbar)     another block's shared memory; a 16-byte
//                                       store into it that completes on its mbarrier
//   cluster_allgather16(mine, inbox, bar, parity)   every block's 16 bytes in every block
//   slice_load(buf, src, n, vec, pad, bar)          n floats of global memory into shared buf
//   cluster_row(N), cluster_row_start(src, n, C, vec, pad, slice, bars)   a row split over a
//                                       cluster: this block's columns; its barriers and load
//   (sm_90a only, the "a" features: compile with -arch=sm_90a / compute_90a)
//   wgmma_desc_sw128(p)                 descriptor of a K-major tile at p (1024-byte aligned):
//                                       rows of 64 16-bit values (128 bytes), 128-byte swizzle
//   wgmma_fence(), wgmma_commit(), wgmma_wait<N>()
//   wgmma_m64n{64,128,256}k16_{f16,bf16}(d, da, db)   d += A @ B: A 64x16, B given as 16 rows of
//                                       N (K-major: B stored (N, K)), both from shared memory
//   wgmma_m64n{64,128,256}k16_{nt,tt}_{f16,bf16}   the same with B (nt) or A and B (tt)
//                                       MN-major (wgmma_desc_sw128_mn): a backward's layouts
//   setmaxnreg_inc<R>(), setmaxnreg_dec<R>()   move registers between warpgroups
//
// wgmma accumulator layout (m64nN, f32): warp w of the warpgroup holds rows 16w..16w+15; within
// them, each 8 columns j repeat the m16n8 C layout above: d[4j + 0..3] = C(16w + g, 8j + 2t),
// C(16w + g, 8j + 2t + 1), C(16w + g + 8, 8j + 2t), C(16w + g + 8, 8j + 2t + 1).
//
// The 128-byte swizzle (what TMA's CU_TENSOR_MAP_SWIZZLE_128B writes and what the descriptor
// tells wgmma to read): 16-byte chunk c of row r sits at chunk c ^ (r % 8) of that row, rows 128
// bytes apart, so 8 rows form a 1024-byte atom. The same XOR as the software swizzle of hgemm_v4.

struct alignas(64) TmaDesc { unsigned long long v[16]; };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(count));
}
// One arrival that also announces `bytes` of TMA transactions to wait for.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}
// Block until the phase with this parity (0, 1, 0, ...: the n-th use waits for n % 2) completes.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n .reg .pred p;\n"
                 "WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra WAIT;\n}\n" :: "r"(smem_u32(bar)), "r"(parity) : "memory");
}
// A barrier of the 128 threads of one warpgroup, named id (1..15; 0 is __syncthreads'), so
// that one consumer warpgroup can synchronise while the producer and the other run on.
__device__ __forceinline__ void warpgroup_sync(int id) {
    asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory");
}
// Make initialised barriers visible to the async proxy (TMA) before anyone uses them.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Order this thread's ordinary shared-memory writes before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* desc, unsigned long long* bar,
                                            int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_u32(dst)), "l"(desc), "r"(x), "r"(y), "r"(smem_u32(bar)) : "memory");
}

// One contiguous copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// src into shared dst by the copy engine, completing on bar like tma_load_2d (no tensor map).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// The other direction, as a reduction: dst[i] += src[i] for `bytes` / 4 floats, shared src to
// global dst (16-byte aligned, a multiple of 16 bytes), done by the copy engine in L2, atomic
// with respect to other reductions. Tracked by bulk groups: bulk_commit() closes this thread's
// group; bulk_wait_read<N>() waits until at most N groups still read their shared source (the
// buffer may then be rewritten); bulk_wait<N>() until at most N are still writing global memory.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
}
// The other direction of tma_load_2d: the box at column x, row y of the tensor map written from
// shared src (laid out as the map's swizzle says); elements outside the matrix are not written.
// Tracked by bulk groups like bulk_reduce_add_f32; order src's writes first (fence_proxy_async).
__device__ __forceinline__ void tma_store_2d(const TmaDesc* desc, const void* src, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 :: "l"(desc), "r"(x), "r"(y), "r"(smem_u32(src)) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// Thread-block clusters (launched with __cluster_dims__): the blocks of a cluster run at the same
// time on one GPC and can read and write each other's shared memory (distributed shared memory).
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// The number of blocks in this block's cluster (1 for a launch without clusters). A kernel
// launched with a cluster dimension at run time (cuLaunchKernelEx: cudabook.launch.run with a
// record's `cluster`) reads its cluster's size here instead of from __cluster_dims__.
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r;
    asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster arrives, then waits for all (release / acquire:
// memory written before it is seen by every block after it). The release also waits for this
// thread's own loads still in flight, so a loop that prefetches must not call it per iteration.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// cluster_sync in two halves, so that work goes between them: what a thread wrote before its
// cluster_arrive() is seen by every thread of the cluster after its cluster_wait(), which
// returns once every thread of the cluster has arrived. Every thread calls both, in this order
// (aligned: all threads of a warp together), once per phase.
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address, in block `rank`'s shared memory, of the variable that p points at in this block's.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
    return r;
}
// 16 bytes stored into another block's shared memory at raddr (from cluster_map) that also
// complete 16 bytes of transactions on that block's mbarrier at rbar (from cluster_map). The
// receiver waits on its own barrier (mbar_expect_tx(bar, 16), then mbar_wait); the sender waits
// for nothing, so its loads in flight stay in flight.
__device__ __forceinline__ void st_async16(unsigned raddr, float4 v, unsigned rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], "
                 "{%1, %2, %3, %4}, [%5];\n"
                 :: "r"(raddr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rbar) : "memory");
}
// All-gather of 16 bytes over the cluster: afterwards inbox[r] holds `mine` of block r, for
// every rank r but this block's own (the caller keeps its `mine`). inbox: cluster_size() float4
// of shared memory at the same offset in every block; bar: this block's mbarrier, initialised
// with one arrival and armed by one thread with mbar_expect_tx(bar, 16 (cluster_size() - 1))
// for this phase (`parity`), and known to exist in every block before any block calls this (a
// cluster barrier after fence_barrier_init). Threads 0..C-1 of a 1-D block send (thread r to
// block r), then every thread waits on bar: no thread reads another block's memory.
__device__ __forceinline__ void cluster_allgather16(float4 mine, float4* inbox,
                                                    unsigned long long* bar, unsigned parity) {
    const unsigned rank = cluster_rank(), C = cluster_size(), t = threadIdx.x;
    if (t < C && t != rank) st_async16(cluster_map(&inbox[rank], t), mine, cluster_map(bar, t));
    mbar_wait(bar, parity);
}
// The n floats at global src into shared buf[0..n), and `pad` into buf[n..round_up(n, 4)),
// returning once they are there (every thread calls it). vec (src 16-byte aligned, n % 4 == 0,
// buf 16-byte aligned): thread 0 arms bar (one arrival, this phase `parity`) and asks the copy
// engine for one bulk copy, which no register holds; otherwise the block's threads load scalars
// (coalesced: rows that are not 16-byte aligned cannot be bulk-copied) and meet at a barrier.
__device__ __forceinline__ void slice_load(float* buf, const float* src, int n, bool vec,
                                           float pad, unsigned long long* bar, unsigned parity) {
    if (vec) {
        if (threadIdx.x == 0) {
            mbar_expect_tx(bar, 4u * n);
            if (n > 0) bulk_load(buf, src, 4u * n, bar);
        }
        mbar_wait(bar, parity);
    } else {
        const int n4 = (n + 3) & ~3;
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += blockDim.x) buf[i] = i < n ? __ldg(src + i) : pad;
        __syncthreads();
    }
}
// A row of N floats split over a cluster (softmax_v6, layernorm_v6, rmsnorm_v3): block `rank`
// of cluster `row` (blocks numbered along x, C = cluster_size() per cluster) holds columns
// [lo, lo + n) in L = round_up(ceil(N / C), 4) floats of dynamic shared memory (n4 float4,
// the last padded); n is 0 for the last ranks of a tiny N. fits: the launch gave it those L
// floats (uniform over the cluster: a kernel writes nothing when it did not).
struct ClusterRow { int C, rank, row, lo, n, n4; bool fits; };
__device__ __forceinline__ ClusterRow cluster_row(int N) {
    ClusterRow cr;
    cr.C = (int)cluster_size();
    cr.rank = (int)cluster_rank();
    cr.row = blockIdx.x / cr.C;
    const int L = ((N + cr.C - 1) / cr.C + 3) & ~3;
    cr.lo = min(N, cr.rank * L);
    cr.n = min(N, cr.lo + L) - cr.lo;
    cr.n4 = (cr.n + 3) / 4;
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    cr.fits = cr.C <= 16 && (unsigned)L * 4u <= dyn;
    return cr;
}
// The start of a split row: bars[0] (the slice's load) and bars[1] (the inbox of the other
// C - 1 blocks' 16 bytes, armed) made; the cluster barrier's first half (cluster_arrive) done,
// so call cluster_wait() before cluster_allgather16(.., &bars[1], 0); the n floats at src in
// slice (padded with pad), by one bulk copy when vec (see slice_load).
__device__ __forceinline__ void cluster_row_start(const float* src, int n, int C, bool vec,
                                                  float pad, float* slice,
                                                  unsigned long long* bars) {
    if (threadIdx.x == 0) {
        mbar_init(&bars[0], 1);
        mbar_init(&bars[1], 1);
        fence_barrier_init();
    }
    __syncthreads();                       // the barriers exist for this block's threads
    if (threadIdx.x == 0) mbar_expect_tx(&bars[1], 16u * (C - 1));
    cluster_arrive();                      // ... and, after cluster_wait, for the cluster's
    slice_load(slice, src, n, vec, pad, &bars[0], 0);
}
#endif  // sm_90

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor bits: 0-13 start address >> 4, 16-29 leading byte offset >> 4 (unused by swizzled
// K-major layouts; 1 by convention), 32-45 stride byte offset >> 4 (1024: from one 8-row atom to
// the next), 62-63 swizzle mode (1 = 128-byte).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* p) {
    unsigned long long a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(R));
}

// One wgmma wrapper per tile width N, written once and instantiated for f16 and bf16 (the
// PTX differs only in the type names). d: N/2 floats per thread (the layout above);
// da, db: descriptors (wgmma_desc_sw128).
#define BOOK_WGMMA_M64N64K16(NAME, T, TRANS)                                           \
__device__ __forceinline__ void NAME(float* d, unsigned long long da,                 \
                                     unsigned long long db) {                        \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"          \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, " TRANS ";\n"  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
                 : "l"(da), "l"(db) : "memory");                                  \
}
#define BOOK_WGMMA_M64N128K16(NAME, T, TRANS)                                                \
__device__ __forceinline__ void NAME(float* d, unsigned long long da,                 \
                                     unsigned long long db) {                        \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {"          \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, " TRANS ";\n"  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
                 : "l"(da), "l"(db) : "memory");                                  \
}
#define BOOK_WGMMA_M64N256K16(NAME, T, TRANS)                                                \
__device__ __forceinline__ void NAME(float* d, unsigned long long da,                 \
                                     unsigned long long db) {                        \
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {"          \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"  \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"  \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"  \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"  \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, " TRANS ";\n"  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
                 : "l"(da), "l"(db) : "memory");                                  \
}
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_f16, "f16", "0, 0")
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_bf16, "bf16", "0, 0")
// d += A (64 x 16) @ B (16 x 64), both from shared memory and both MN-major (imm-trans-a =
// imm-trans-b = 1): A stored (K, M) with M contiguous, B stored (K, N) with N contiguous, each
// described by wgmma_desc_sw128_mn. The dQ = dS K product of attention's backward: dS^T and K
// lie in shared memory with the keys (the reduction axis) as rows.
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_tt_f16, "f16", "1, 1")
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_tt_bf16, "bf16", "1, 1")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_f16, "f16", "0, 0")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_bf16, "bf16", "0, 0")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_f16, "f16", "0, 0")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_bf16, "bf16", "0, 0")
// The layouts of a training step's backward (gemm_train.cu): _nt: B MN-major (imm-trans-b = 1,
// B stored (K, N), the dX = dY W product); _tt: A and B MN-major (dW = dY^T X). MN-major tiles
// are described by wgmma_desc_sw128_mn (below).
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_nt_f16, "f16", "0, 1")
BOOK_WGMMA_M64N64K16(wgmma_m64n64k16_nt_bf16, "bf16", "0, 1")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_nt_f16, "f16", "0, 1")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_nt_bf16, "bf16", "0, 1")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_tt_f16, "f16", "1, 1")
BOOK_WGMMA_M64N128K16(wgmma_m64n128k16_tt_bf16, "bf16", "1, 1")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_nt_f16, "f16", "0, 1")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_nt_bf16, "bf16", "0, 1")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_tt_f16, "f16", "1, 1")
BOOK_WGMMA_M64N256K16(wgmma_m64n256k16_tt_bf16, "bf16", "1, 1")
#undef BOOK_WGMMA_M64N64K16
#undef BOOK_WGMMA_M64N128K16
#undef BOOK_WGMMA_M64N256K16
#endif  // sm_90a

// ===== Hopper (sm_90a), A from registers: the P V product of attention ==========================
//
//   wgmma_desc_sw128_mn(p, lbo)         descriptor of an MN-major tile at p (1024-byte aligned):
//                                       B stored (K, N) with N contiguous, as V is in P V.
//                                       Rows of 64 16-bit values along N (128 bytes) with the
//                                       128-byte swizzle, 8 rows (k) per 1024-byte atom; the next
//                                       8 rows of k follow 1024 bytes on (stride offset), the next
//                                       64 columns of N lbo bytes on (leading offset)
//   wgmma_m64n{64,128}k16_rs_{f16,bf16}(d, a, db)   d += A @ B with A (64 x 16) from registers
//                                       (4 per thread, the layout of an m16n8k16 A fragment for
//                                       the warp's 16 rows) and B (16 x N) from shared memory,
//                                       N-major (imm-trans-b = 1): no transpose of V is needed
//   wgmma_m64n64k16_tt_{f16,bf16}(d, da, db)   d += A @ B, both from shared memory and both
//                                       MN-major (A stored (K, M), B stored (K, N))
//
// The A registers of warp w are rows 16w..16w+15: exactly the accumulator layout above, so two
// neighbouring 8-column groups of an m64nN accumulator, rounded to 16 bits, are the A operand of
// the next product (as with mma.sync; attention.cuh's acc_to_a).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ unsigned long long wgmma_desc_sw128_mn(const void* p, unsigned lbo) {
    unsigned long long a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((1024ull >> 4) << 32) | (1ull << 62);
}
#define BOOK_WGMMA_M64N64K16_RS(NAME, T)                                        \
__device__ __forceinline__ void NAME(float* d, const unsigned* a,          \
                                     unsigned long long db) {             \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"  \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db) : "memory");  \
}
#define BOOK_WGMMA_M64N128K16_RS(NAME, T)                                        \
__device__ __forceinline__ void NAME(float* d, const unsigned* a,          \
                                     unsigned long long db) {             \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {"  \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db) : "memory");  \
}

BOOK_WGMMA_M64N64K16_RS(wgmma_m64n64k16_rs_f16, "f16")
BOOK_WGMMA_M64N64K16_RS(wgmma_m64n64k16_rs_bf16, "bf16")
BOOK_WGMMA_M64N128K16_RS(wgmma_m64n128k16_rs_f16, "f16")
BOOK_WGMMA_M64N128K16_RS(wgmma_m64n128k16_rs_bf16, "bf16")
#undef BOOK_WGMMA_M64N64K16_RS
#undef BOOK_WGMMA_M64N128K16_RS
#endif  // sm_90a

// ===== Hopper (sm_90a), fp8: wgmma with e4m3 inputs ===========================================
//
//   wgmma_m64n{128,256}k32_e4m3(d, da, db)   d += A @ B: A 64x32, B given as 32 rows of N, e4m3
//                                       (1 byte), f32 accumulate, both from shared memory
//
// fp8 wgmma reads both operands K-major only (no transpose immediates: A stored (M, K), B stored
// (N, K)). A k32 slice of 1-byte values is 32 bytes of a row, the same bytes as a k16 slice of
// 16-bit values, so wgmma_desc_sw128 describes these tiles unchanged: 128-byte rows (128 values
// of K), 128-byte swizzle, 8-row atoms 1024 bytes apart; slice kk starts 32 kk bytes along.
// The accumulator layout is the f16 one above (d: N/2 floats per thread).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, unsigned long long da,
                                                      unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float* d, unsigned long long da,
                                                      unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db) : "memory");
}
#endif  // sm_90a (fp8)
