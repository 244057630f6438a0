// hgemm.cu: C = A @ B^T on the tensor cores, 16-bit inputs, 32-bit accumulation.
//
//   A is (M, K), B is (N, K) (the layout of nn.Linear's weight: y = x W^T), C is (M, N); all
//   row-major and contiguous, fp16 (bf16 for the _bf16 kernels). Every product is accumulated in
//   fp32 and C is rounded to 16 bits once, at the end. Any M, N >= 1; K >= 1 a multiple of 8
//   (rows of 16 bytes, for 16-byte loads, cp.async and TMA: kernels/hgemm.py pads K otherwise, at
//   the cost of one copy of A and B). Tiles that hang over an edge are zero-filled on load and
//   only the stores are guarded, so full tiles pay nothing for ragged sizes.
//
//   hgemm_v1  WMMA: one warp per 16x16 tile of C, fragments straight from global memory     sm_70+
//   hgemm_v2  WMMA with 128x128x32 shared-memory tiles, 8 warps of 64x32 each, the next
//             tile's global loads in registers during the math                           sm_70+
//   hgemm_v3  mma.sync m16n8k16 + ldmatrix (inline PTX, mma.cuh), 128x128x64 tiles,
//             row-major shared tiles: each ldmatrix is an 8-way bank conflict              sm_75+
//   hgemm_v4  v3 with the XOR swizzle (chunk c of row r at c ^ r%8): conflict-free          sm_75+
//   hgemm_v5  v4 with a 3-stage cp.async pipeline: loads skip registers and overlap math   sm_80+
//   hgemm_v6  v5 with 64x64 warp tiles in 128x256 blocks, fragments double-buffered in
//             registers, blocks ordered in groups of 8 tile rows (L2 reuse)                sm_80+
//   hgemm_v7  wgmma: a warpgroup (4 warps) multiplies 64x128 from shared memory; loads
//             still cp.async, 4 stages, into the 128-byte swizzle wgmma reads              sm_90a
//   hgemm_v8  TMA loads completing on mbarriers, warp specialisation: 1 producer and 2
//             consumer warpgroups (setmaxnreg), 128x256x64 tiles, 4 stages                 sm_90a
//   hgemm_v9  the autotuned final version: instantiations of hgemm_tma_t (sm_90: tile
//             width, stages, persistent grid) or hgemm_mma_t (elsewhere), picked by
//             hgemm.autotune on the reader's GPU
//   hgemm_v10 v6's tiles and pipeline with the loop rebuilt for issue rate: per-thread copy and
//             ldmatrix addresses computed once (one register + immediates, XOR per k-slice),
//             predicate-free copies in interior blocks, each tile's copies issued right after
//             the barrier that frees its stage, C staged through shared memory for 16-byte
//             stores: the best mma.sync kernel                                              sm_80+
//   _bf16: the same kernel for bf16 inputs and output (v3-v8, v10; sm_80+).
//   mma_layout_probe  not a step: writes out which elements each lane holds in mma.m16n8k16
//   mma_peak          not a step: mma.sync throughput from registers (the mma.sync ceiling)
//
// Launches (kernels/hgemm.py, config()): v1 grid (ceil(N/32), ceil(M/32)) x 128 threads;
// v2 grid (ceil(N/128), ceil(M/128)) x 256; v3-v10 a 1D grid of tiles (v9 persistent: one block
// per SM), dynamic shared memory as config() says (over 48 KiB: the launcher raises the limit).
// The non-template kernels of each version sit inside #if !defined(CB_ONLY) ||
// defined(CB_ONLY_hgemm_vN) (the probes: CB_ONLY_hgemm_probe): a launch compiles its version
// alone (cudabook.compile.module(..., only=...)); the templates cost nothing until named.
#include "mma.cuh"
// gemm.cuh: load_tile (v3-v7, v10) and tma_ws_gemm (v8, v9), shared with igemm.cu
#include "gemm.cuh"
#include <mma.h>

using namespace nvcuda;

extern __shared__ __align__(16) unsigned char hg_smem[];

// ----- 16-bit element types ------------------------------------------------------------------
template <typename T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    if constexpr (is_bf16<T>::value) return pack_bf162(lo, hi);
    else return pack_half2(lo, hi);
}
template <typename T> __device__ __forceinline__ void mma16816(float* c, const unsigned* a,
                                                              const unsigned* b) {
    if constexpr (is_bf16<T>::value) mma_m16n8k16_bf16(c, a, b);
    else mma_m16n8k16_f16(c, a, b);
}

// ============================================================================ v1, v2: WMMA

#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v1)
// launch: grid (ceil(N/32), ceil(M/32)), block 128: warps 2x2, each one 16x16 tile of C
extern "C" __global__ void __launch_bounds__(128)
hgemm_v1(const __half* A, const __half* B, __half* C, int M, int N, int K) {
    __shared__ __align__(32) __half stage[4][2][16 * 16];   // per warp: edge tiles of A and B
    __shared__ __align__(32) float cs[4][16 * 16];           // per warp: C before rounding
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = blockIdx.y * 32 + (warp >> 1) * 16, n0 = blockIdx.x * 32 + (warp & 1) * 16;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;   // B^T: (k, n) at n*K + k
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    // load_matrix_sync from global memory needs a whole tile and 32-byte aligned rows
    const bool direct = m0 + 16 <= M && n0 + 16 <= N && K % 16 == 0 &&
                        (reinterpret_cast<size_t>(A) & 31) == 0 &&
                        (reinterpret_cast<size_t>(B) & 31) == 0;
    for (int k = 0; k < K; k += 16) {
        if (direct) {
            wmma::load_matrix_sync(a, A + (size_t)m0 * K + k, K);
            wmma::load_matrix_sync(b, B + (size_t)n0 * K + k, K);
        } else {   // an edge tile: copy it through shared memory, zeros outside the matrices
            for (int e = lane; e < 256; e += 32) {
                const int r = e >> 4, c = e & 15;
                stage[warp][0][e] = (m0 + r < M && k + c < K) ? A[(size_t)(m0 + r) * K + k + c]
                                                              : __float2half(0.0f);
                stage[warp][1][e] = (n0 + r < N && k + c < K) ? B[(size_t)(n0 + r) * K + k + c]
                                                              : __float2half(0.0f);
            }
            __syncwarp();
            wmma::load_matrix_sync(a, stage[warp][0], 16);
            wmma::load_matrix_sync(b, stage[warp][1], 16);
            __syncwarp();
        }
        wmma::mma_sync(acc, a, b, acc);
    }
    // the accumulator's register layout is unspecified: go through shared memory to round and guard
    wmma::store_matrix_sync(cs[warp], acc, 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
        const int r = m0 + (e >> 4), c = n0 + (e & 15);
        if (r < M && c < N) C[(size_t)r * N + c] = __float2half(cs[warp][e]);
    }
}
#endif

#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v2)
constexpr int V2_LD = 40;   // 32 halves of a tile row + 8 of padding: rows 80 bytes apart

// launch: grid (ceil(N/128), ceil(M/128)), block 256: warps 2 (rows) x 4 (columns) of 64x32.
// Per 32-deep step: the tiles go from registers to shared memory, the next step's global loads
// are issued into registers (so they are in flight during the math), then 4 x 2 fragments of
// 16x16 per warp and 16-deep slice.
extern "C" __global__ void __launch_bounds__(256, 2)
hgemm_v2(const __half* A, const __half* B, __half* C, int M, int N, int K) {
    __shared__ __align__(128) __half As[128 * V2_LD];   // A[m0.., k0..k0+31], row-major
    __shared__ __align__(128) __half Bs[128 * V2_LD];   // B[n0.., k0..k0+31]: B^T column-major
    __shared__ __align__(32) float cs[8][16 * 16];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.y * 128, n0 = blockIdx.x * 128;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[4];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    // 128 rows x 4 chunks of 8 halves per matrix: 2 chunks per thread, zeros outside
    uint4 ra[2], rb[2];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + i * 256, r = e >> 2, c = (e & 3) * 8;
            ra[i] = rb[i] = make_uint4(0, 0, 0, 0);
            if (m0 + r < M && k0 + c < K)
                ra[i] = *reinterpret_cast<const uint4*>(A + (size_t)(m0 + r) * K + k0 + c);
            if (n0 + r < N && k0 + c < K)
                rb[i] = *reinterpret_cast<const uint4*>(B + (size_t)(n0 + r) * K + k0 + c);
        }
    };
    fetch(0);
    for (int k0 = 0; k0 < K; k0 += 32) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + i * 256, r = e >> 2, c = (e & 3) * 8;
            *reinterpret_cast<uint4*>(As + r * V2_LD + c) = ra[i];
            *reinterpret_cast<uint4*>(Bs + r * V2_LD + c) = rb[i];
        }
        __syncthreads();                                  // the tiles are complete
        if (k0 + 32 < K) fetch(k0 + 32);                  // next step's loads, in flight now
#pragma unroll
        for (int kk = 0; kk < 32; kk += 16) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                wmma::load_matrix_sync(a[i], As + (wm + 16 * i) * V2_LD + kk, V2_LD);
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(b[j], Bs + (wn + 16 * j) * V2_LD + kk, V2_LD);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();                                  // everyone is done reading them
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(cs[warp], acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int r = m0 + wm + 16 * i + (e >> 4), c = n0 + wn + 16 * j + (e & 15);
                if (r < M && c < N) C[(size_t)r * N + c] = __float2half(cs[warp][e]);
            }
            __syncwarp();
        }
}
#endif

// ============================================================================ v3-v6: mma.sync

// Shared tiles hold 64 values (128 bytes, eight 16-byte chunks) per row. Element offset of chunk
// c of row r: plain, or swizzled (chunk c stored at c ^ (r % 8), the layout TMA's 128-byte
// swizzle also writes). Eight rows read by one ldmatrix then fall on eight different
// 16-byte bank groups instead of all on the same one.
template <bool SWZ>
__device__ __forceinline__ int tile_index(int r, int c) {
    return r * 64 + ((SWZ ? (c ^ (r & 7)) : c) << 3);
}

// The fragments of k16 slice kk (0..3) of a warp's (16 FM) x (8 FN) tile: FM ldmatrix.x4 of A
// (lane l points at row l%16, k-chunk l/16: a[0..3] in order), FN/2 of B (two n8 tiles each:
// n row l%8 (+8 for lanes 16..31), k-chunk (l/8)%2 gives b[0..1] of both).
template <int FM, int FN, bool SWZ, typename T>
__device__ __forceinline__ void load_frags(unsigned (&a)[FM][4], unsigned (&b)[FN][2],
                                           const T* As, const T* Bs, int kk, int wm, int wn,
                                           int lane) {
#pragma unroll
    for (int i = 0; i < FM; i++)
        ldmatrix_x4(a[i], smem_u32(As + tile_index<SWZ>(wm + 16 * i + (lane & 15),
                                                        2 * kk + (lane >> 4))));
#pragma unroll
    for (int j = 0; j < FN / 2; j++) {
        unsigned r[4];
        ldmatrix_x4(r, smem_u32(Bs + tile_index<SWZ>(wn + 16 * j + (lane & 7) + ((lane >> 4) << 3),
                                                     2 * kk + ((lane >> 3) & 1))));
        b[2 * j][0] = r[0];
        b[2 * j][1] = r[1];
        b[2 * j + 1][0] = r[2];
        b[2 * j + 1][1] = r[3];
    }
}

template <int FM, int FN, typename T>
__device__ __forceinline__ void mma_frags(float (&acc)[FM][FN][4], const unsigned (&a)[FM][4],
                                          const unsigned (&b)[FN][2]) {
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++) mma16816<T>(acc[i][j], a[i], b[j]);
}

// One 64-deep step of a warp's tile: four k16 slices, each loaded, then multiplied.
template <int FM, int FN, bool SWZ, typename T>
__device__ __forceinline__ void warp_tile_step(const T* As, const T* Bs, float (&acc)[FM][FN][4],
                                               int wm, int wn, int lane) {
    unsigned a[FM][4], b[FN][2];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        load_frags<FM, FN, SWZ>(a, b, As, Bs, kk, wm, wn, lane);
        mma_frags<FM, FN, T>(acc, a, b);
    }
}

// Round a warp's accumulators (m16n8 layout, mma.cuh) to T and store the rows < M, columns < N.
template <int FM, int FN, typename T>
__device__ __forceinline__ void store_c(T* C, const float (&acc)[FM][FN][4], int M, int N,
                                        int r0, int c0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const bool pairs = (N & 1) == 0 && (reinterpret_cast<size_t>(C) & 3) == 0;
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 16 * i + g + 8 * h, c = c0 + 8 * j + 2 * t;
                if (r >= M || c >= N) continue;
                T* p = C + (size_t)r * N + c;
                if (pairs) {
                    *reinterpret_cast<unsigned*>(p) = pack2<T>(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                } else {
                    p[0] = from_float<T>(acc[i][j][2 * h]);
                    if (c + 1 < N) p[1] = from_float<T>(acc[i][j][2 * h + 1]);
                }
            }
}

// The mma.sync GEMM of v3-v6 and of hgemm_mma_t: a BM x BN tile of C per block, warps of
// WM x WN, k-steps of 64. STAGES = 1: load, barrier, compute, barrier. STAGES > 1: a cp.async
// ring of STAGES tiles, STAGES - 1 in flight while one is computed, one barrier per step.
// DBUF (with STAGES >= 3): fragments double-buffered in registers, across tiles too.
// Dynamic shared memory: STAGES * (BM + BN) * 64 * sizeof(T) bytes.
template <int BM, int BN, int WM, int WN, int STAGES, bool SWZ, bool DBUF, int GROUP, typename T>
__device__ __forceinline__ void gemm_mma(const T* __restrict__ A, const T* __restrict__ B,
                                         T* __restrict__ C, int M, int N, int K) {
    constexpr int BK = 64, WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
    constexpr int FM = WM / 16, FN = WN / 8;
    T* As = reinterpret_cast<T*>(hg_smem);   // [STAGES][BM * BK]
    T* Bs = As + STAGES * BM * BK;           // [STAGES][BN * BK]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    int bm, bn;
    tile_of<GROUP>(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, bm, bn);
    const int m0 = bm * BM, n0 = bn * BN, KT = (K + BK - 1) / BK;
    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    auto load_stage = [&](int stage, int kt) {
        load_tile<BM, THREADS, SWZ, (STAGES > 1)>(As + stage * BM * BK, A, M, K, m0, kt * BK);
        load_tile<BN, THREADS, SWZ, (STAGES > 1)>(Bs + stage * BN * BK, B, N, K, n0, kt * BK);
    };
    if constexpr (STAGES == 1) {
        for (int kt = 0; kt < KT; kt++) {
            load_stage(0, kt);
            __syncthreads();                       // the tile is complete
            warp_tile_step<FM, FN, SWZ>(As, Bs, acc, wm, wn, lane);
            __syncthreads();                       // everyone is done reading it
        }
    } else if constexpr (!DBUF) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {     // prologue: STAGES - 1 tiles in flight
            if (s < KT) load_stage(s, s);
            cp_async_commit();
        }
        for (int kt = 0; kt < KT; kt++) {
            cp_async_wait<STAGES - 2>();           // my copies of tile kt have landed
            __syncthreads();                       // everyone's have; stage (kt-1) is free
            const int nk = kt + STAGES - 1;
            if (nk < KT) load_stage(nk % STAGES, nk);
            cp_async_commit();                     // (possibly empty: keeps the group count)
            const int s = kt % STAGES;
            warp_tile_step<FM, FN, SWZ>(As + s * BM * BK, Bs + s * BN * BK, acc, wm, wn, lane);
        }
    } else {
        // Register double buffering: slice kk+1's fragments load while slice kk multiplies,
        // across tiles too: before the last slice of tile kt, wait for tile kt+1 (one tile less
        // of prefetch distance than above, hence STAGES - 3 groups left in flight) and load its
        // first slice, so the barrier's wait hides behind the last slice's mma.
        static_assert(STAGES >= 3, "register double buffering across tiles needs 3+ stages");
        unsigned a[2][FM][4], b[2][FN][2];
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < KT) load_stage(s, s);
            cp_async_commit();
        }
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_frags<FM, FN, SWZ>(a[0], b[0], As, Bs, 0, wm, wn, lane);
        for (int kt = 0; kt < KT; kt++) {
            const int s = kt % STAGES;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if (kk < 3) {
                    load_frags<FM, FN, SWZ>(a[(kk + 1) & 1], b[(kk + 1) & 1], As + s * BM * BK,
                                            Bs + s * BN * BK, kk + 1, wm, wn, lane);
                } else {
                    cp_async_wait<STAGES - 3>();   // my copies of tile kt+1 have landed
                    __syncthreads();               // everyone's; stage (kt-1) is free
                    const int nk = kt + STAGES - 1;
                    if (nk < KT) load_stage(nk % STAGES, nk);
                    cp_async_commit();
                    const int n = (kt + 1) % STAGES;   // (past the last tile: unused reads)
                    load_frags<FM, FN, SWZ>(a[0], b[0], As + n * BM * BK, Bs + n * BN * BK, 0,
                                            wm, wn, lane);
                }
                mma_frags<FM, FN, T>(acc, a[kk & 1], b[kk & 1]);
            }
        }
    }
    store_c<FM, FN>(C, acc, M, N, m0 + wm, n0 + wn, lane);
}

#define HG_MMA_KERNEL(name, T, THREADS, ...)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
    name(const T* A, const T* B, T* C, int M, int N, int K) {                                     \
        gemm_mma<__VA_ARGS__, T>(A, B, C, M, N, K);                                               \
    }
//        kernel           type            threads BM   BN   WM  WN  STAGES SWZ    DBUF   GROUP
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v3)
HG_MMA_KERNEL(hgemm_v3,      __half,        256,   128, 128, 64, 32, 1,     false, false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v4)
HG_MMA_KERNEL(hgemm_v4,      __half,        256,   128, 128, 64, 32, 1,     true,  false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v5)
HG_MMA_KERNEL(hgemm_v5,      __half,        256,   128, 128, 64, 32, 3,     true,  false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v6)
HG_MMA_KERNEL(hgemm_v6,      __half,        256,   128, 256, 64, 64, 3,     true,  true,  8)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v3)
HG_MMA_KERNEL(hgemm_v3_bf16, __nv_bfloat16, 256,   128, 128, 64, 32, 1,     false, false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v4)
HG_MMA_KERNEL(hgemm_v4_bf16, __nv_bfloat16, 256,   128, 128, 64, 32, 1,     true,  false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v5)
HG_MMA_KERNEL(hgemm_v5_bf16, __nv_bfloat16, 256,   128, 128, 64, 32, 3,     true,  false, 1)
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v6)
HG_MMA_KERNEL(hgemm_v6_bf16, __nv_bfloat16, 256,   128, 256, 64, 64, 3,     true,  true,  8)
#endif

// The autotuner's family (instantiated by name from hgemm.py): swizzled, any tile shape.
template <int BM, int BN, int WM, int WN, int STAGES, bool DBUF, int GROUP, typename T>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)
hgemm_mma_t(const T* A, const T* B, T* C, int M, int N, int K) {
    gemm_mma<BM, BN, WM, WN, STAGES, true, DBUF, GROUP, T>(A, B, C, M, N, K);
}

// ============================================================================ v10: mma.sync, tuned

// v10: v6's instruction stream rebuilt for issue rate, same tiles (8 warps of 64 x 64 in
// BM x BN blocks, k-steps of 64, the XOR swizzle). Everything that is the same on every k-step is
// computed once: each thread copies the same column chunk of rows tid/8 + 32i, so its shared
// offsets are one register plus immediates and its global addresses one pointer plus a stride;
// interior tiles (no edge in M, N or this k-step) copy without predicates. ldmatrix addresses are
// one register per operand: slice kk is an XOR with kk << 5 (the swizzle), fragment i an
// immediate. The next tile's copies are issued right after the barrier that frees their stage
// (prefetch distance STAGES - 1.25 tiles instead of v6's STAGES - 2), fragments are
// double-buffered as in v6, and EPI stages C through shared memory so that each warp stores whole
// 512-byte rows with 16-byte stores. Dynamic shared memory: STAGES * (BM + BN) * 128 bytes.
template <int BM, int BN, int STAGES, bool EPI, int GROUP, bool FAST, typename T>
__device__ __forceinline__ void gemm_mma10(const T* __restrict__ A, const T* __restrict__ B,
                                           T* __restrict__ C, int M, int N, int K) {
    constexpr int BK = 64, WM = 64, WN = 64, WARPS_N = BN / WN, THREADS = 256;
    static_assert((BM / WM) * (BN / WN) == 8, "8 warps of 64 x 64");
    static_assert(STAGES >= 3, "the copies of a tile are issued one step before its stage frees");
    constexpr int FM = 4, FN = 8;
    constexpr unsigned A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2;
    constexpr int CA = BM / 32, CB = BN / 32;          // 16-byte chunks per thread and k-step
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    int bm, bn;
    tile_of<GROUP>(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, bm, bn);
    const int m0 = bm * BM, n0 = bn * BN, KT = (K + BK - 1) / BK;
    const unsigned smem = smem_u32(hg_smem);

    // copies: chunk column c = tid % 8 of rows r = tid / 8 + 32 i (i < CA for A, < CB for B)
    const int cr = tid >> 3, cc = tid & 7;
    const unsigned cp_off = cr * 128 + ((cc ^ (cr & 7)) << 4);   // + 4096 i: rows 32 apart
    const T* ga = A + (size_t)min(m0 + cr, M - 1) * K + cc * 8;
    const T* gb = B + (size_t)min(n0 + cr, N - 1) * K + cc * 8;
    const size_t rows32 = (size_t)32 * K;
    auto load_stage = [&](unsigned stage, int kt) {
        const int k0 = kt * BK;
        if constexpr (FAST) {
            const T* pa = ga + k0;
#pragma unroll
            for (int i = 0; i < CA; i++, pa += rows32)
                cp_async_16_s(smem + stage * STAGE_BYTES + cp_off + 4096 * i, pa);
            const T* pb = gb + k0;
#pragma unroll
            for (int i = 0; i < CB; i++, pb += rows32)
                cp_async_16_s(smem + stage * STAGE_BYTES + A_BYTES + cp_off + 4096 * i, pb);
        } else {
            T* st = reinterpret_cast<T*>(hg_smem + stage * STAGE_BYTES);
            load_tile<BM, THREADS, true, true>(st, A, M, K, m0, k0);
            load_tile<BN, THREADS, true, true>(st + BM * BK, B, N, K, n0, k0);
        }
    };

    // ldmatrix: A lane l -> row wm + l%16, chunk l/16; B lane l -> row wn + l%8 + 8(l/16),
    // chunk (l/8)%2 (mma.cuh). Rows are 128-byte aligned, so slice kk's chunk 2kk + h swizzled
    // is (h ^ r%8) ^ 2kk: the address of slice 0 XOR (kk << 5).
    const int ra = wm + (lane & 15), rb = wn + (lane & 7) + ((lane >> 4) << 3);
    const unsigned lda = ra * 128 + ((((lane >> 4)) ^ (ra & 7)) << 4);
    const unsigned ldb = A_BYTES + rb * 128 + ((((lane >> 3) & 1) ^ (rb & 7)) << 4);
    unsigned a[2][FM][4], b[2][FN][2];
    auto load_frags10 = [&](int buf, unsigned stage_base, int kk) {
        const unsigned pa = stage_base + (lda ^ (kk << 5)), pb = stage_base + (ldb ^ (kk << 5));
#pragma unroll
        for (int i = 0; i < FM; i++) ldmatrix_x4(a[buf][i], pa + 2048 * i);
#pragma unroll
        for (int j = 0; j < FN / 2; j++) {
            unsigned r[4];
            ldmatrix_x4(r, pb + 2048 * j);
            b[buf][2 * j][0] = r[0];
            b[buf][2 * j][1] = r[1];
            b[buf][2 * j + 1][0] = r[2];
            b[buf][2 * j + 1][1] = r[3];
        }
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {         // prologue: STAGES - 1 tiles in flight
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();                   // tile 0 has landed
    __syncthreads();
    load_frags10(0, smem, 0);
    int rs = 0;                                    // the stage of tile kt
    for (int kt = 0; kt < KT; kt++) {
        const unsigned base = smem + rs * STAGE_BYTES;
        const int next = rs + 1 == STAGES ? 0 : rs + 1;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if (kk < 3) {
                load_frags10((kk + 1) & 1, base, kk + 1);
            } else {
                cp_async_wait<STAGES - 2>();       // my copies of tile kt+1 have landed
                __syncthreads();                   // everyone's; and stage rs-1 is free
                load_frags10(0, smem + next * STAGE_BYTES, 0);   // (past the end: unused)
            }
            if (kk == 0) {                         // tile kt+STAGES-1 into the stage of
                const int nk = kt + STAGES - 1;    // tile kt-1, freed by the last barrier
                if (nk < KT) load_stage(rs == 0 ? STAGES - 1 : rs - 1, nk);
                cp_async_commit();
            }
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int jj = 0; jj < FN; jj++) {  // serpentine: one operand reused
                    const int j = (i & 1) ? FN - 1 - jj : jj;
                    mma16816<T>(acc[i][j], a[kk & 1][i], b[kk & 1][j]);
                }
        }
        rs = next;
    }

    if constexpr (EPI) {
        if ((N & 7) == 0 && (reinterpret_cast<size_t>(C) & 15) == 0) {
            // round into a shared C tile (rows of BN + 8 halves: the 8 rows of one store land
            // in 8 different 4-bank groups), then whole rows out with 16-byte stores
            constexpr int LDC = BN + 8;
            cp_async_wait<0>();
            __syncthreads();                           // every warp is done with the stages
            T* cs = reinterpret_cast<T*>(hg_smem);
            const int g = lane >> 2, t = lane & 3;
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        *reinterpret_cast<unsigned*>(cs + (wm + 16 * i + g + 8 * h) * LDC + wn +
                                                     8 * j + 2 * t) =
                            pack2<T>(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            __syncthreads();
            constexpr int CPR = BN / 8;                // 16-byte chunks per row
#pragma unroll 4
            for (int q = tid; q < BM * CPR; q += THREADS) {
                const int r = q / CPR, c = (q % CPR) * 8;
                if (m0 + r < M && n0 + c < N)
                    *reinterpret_cast<uint4*>(C + (size_t)(m0 + r) * N + n0 + c) =
                        *reinterpret_cast<const uint4*>(cs + r * LDC + c);
            }
            return;
        }
    }
    store_c<FM, FN>(C, acc, M, N, m0 + wm, n0 + wn, lane);
}

// FAST (no predicates) for blocks with no edge in M or N and K a multiple of 64; the other
// instantiation copies with v5's zero-filling load_tile.
template <int BM, int BN, int STAGES, bool EPI, int GROUP, typename T>
__device__ __forceinline__ void gemm_mma10_any(const T* A, const T* B, T* C, int M, int N, int K) {
    int bm, bn;
    tile_of<GROUP>(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, bm, bn);
    if ((bm + 1) * BM <= M && (bn + 1) * BN <= N && K % 64 == 0)
        gemm_mma10<BM, BN, STAGES, EPI, GROUP, true, T>(A, B, C, M, N, K);
    else
        gemm_mma10<BM, BN, STAGES, EPI, GROUP, false, T>(A, B, C, M, N, K);
}

#define HG_MMA10_KERNEL(name, T, ...)                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1)                                          \
    name(const T* A, const T* B, T* C, int M, int N, int K) {                                     \
        gemm_mma10_any<__VA_ARGS__, T>(A, B, C, M, N, K);                                         \
    }
//              kernel          type            BM   BN   STAGES EPI   GROUP
#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v10)
HG_MMA10_KERNEL(hgemm_v10,      __half,         128, 256, 3,     true, 8)
HG_MMA10_KERNEL(hgemm_v10_bf16, __nv_bfloat16,  128, 256, 3,     true, 8)
#endif

// v10's family, for the probe and the autotuner (instantiated by name from hgemm_launch.py).
template <int BM, int BN, int STAGES, bool EPI, int GROUP, typename T>
__global__ void __launch_bounds__(256, 1)
hgemm_mma10_t(const T* A, const T* B, T* C, int M, int N, int K) {
    gemm_mma10_any<BM, BN, STAGES, EPI, GROUP, T>(A, B, C, M, N, K);
}

// ============================================================================ layout probe

#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_probe)
// Not a ladder step: which elements of A (16x16), B (16x8) and C (16x8) each lane holds in
// mma.m16n8k16, measured. A(m, k) = 16 m + k and B(k, n) = 8 k + n (exact in fp16) are loaded
// with ldmatrix exactly as hgemm_v3 does and each lane writes its registers out; then two mma of
// 0/1 matrices give each C value its row (A = row number in column 0, B = ones in row 0) and its
// column (A = ones, B = column number).
// launch: grid 1, block 32. a_out[32][8], b_out[32][4]: element numbers; c_out[32][8]: rows, cols
extern "C" __global__ void __launch_bounds__(32)
mma_layout_probe(float* a_out, float* b_out, float* c_out) {
    __shared__ __align__(16) __half As[16 * 16];   // A, row-major (m, k)
    __shared__ __align__(16) __half Bs[8 * 16];    // B stored (n, k), as hgemm.cu keeps B
    const int lane = threadIdx.x;
    unsigned a[4], b[2];
    for (int pass = 0; pass < 3; pass++) {
        for (int e = lane; e < 256; e += 32) {
            const int m = e / 16, k = e % 16;
            const float v = pass == 0 ? e : (k == 0 ? (pass == 1 ? m : 1) : 0);
            As[e] = __float2half(v);
        }
        for (int e = lane; e < 128; e += 32) {
            const int n = e / 16, k = e % 16;
            const float v = pass == 0 ? 8 * k + n : (k == 0 ? (pass == 1 ? 1 : n) : 0);
            Bs[e] = __float2half(v);
        }
        __syncwarp();
        ldmatrix_x4(a, smem_u32(As + (lane & 15) * 16 + 8 * (lane >> 4)));
        ldmatrix_x2(b, smem_u32(Bs + (lane & 7) * 16 + 8 * ((lane >> 3) & 1)));
        __syncwarp();
        if (pass == 0) {
            for (int r = 0; r < 4; r++) {
                const __half2 h = *reinterpret_cast<const __half2*>(&a[r]);
                a_out[lane * 8 + 2 * r] = __low2float(h);
                a_out[lane * 8 + 2 * r + 1] = __high2float(h);
            }
            for (int r = 0; r < 2; r++) {
                const __half2 h = *reinterpret_cast<const __half2*>(&b[r]);
                b_out[lane * 4 + 2 * r] = __low2float(h);
                b_out[lane * 4 + 2 * r + 1] = __high2float(h);
            }
        } else {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_m16n8k16_f16(c, a, b);
            for (int i = 0; i < 4; i++) c_out[lane * 8 + 4 * (pass - 1) + i] = c[i];
        }
    }
}

// Not a ladder step: the throughput of mma.sync alone. Each warp keeps 8 independent m16n8k16
// accumulations going on constant fragments, with no memory traffic in the loop: the ceiling of
// any kernel built on mma.sync (v3-v6, v10). 2 * 16 * 8 * 16 * 8 * iters flops per warp.
// launch: any grid, block 256; out is written only if the sums take an impossible value.
extern "C" __global__ void __launch_bounds__(256)
mma_peak(float* out, int iters) {
    const unsigned one2 = 0x3c003c00u;   // two fp16 ones
    const unsigned a[4] = {one2, one2, one2, one2}, b[2] = {one2, one2};
    float c[8][4] = {};
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < 8; j++) mma_m16n8k16_f16(c[j], a, b);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (s == -1.0f) out[threadIdx.x] = s;
}
#endif

// ============================================================================ v7-v9: Hopper

// The first 1024-byte boundary in dynamic shared memory (the 128-byte swizzle repeats every
// 1024 bytes, and wgmma and TMA compute it from the address): launches add 1024 bytes of slack.
__device__ __forceinline__ unsigned char* smem_1024() { return align_1024(hg_smem); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d += A (64 x 16) @ B (16 x BN) for one warpgroup, both from shared memory.
template <int BN, typename T>
__device__ __forceinline__ void wgmma_tile(float* d, unsigned long long da, unsigned long long db) {
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma wrappers exist for N = 64, 128, 256");
    if constexpr (is_bf16<T>::value) {
        if constexpr (BN == 256) wgmma_m64n256k16_bf16(d, da, db);
        else if constexpr (BN == 128) wgmma_m64n128k16_bf16(d, da, db);
        else wgmma_m64n64k16_bf16(d, da, db);
    } else {
        if constexpr (BN == 256) wgmma_m64n256k16_f16(d, da, db);
        else if constexpr (BN == 128) wgmma_m64n128k16_f16(d, da, db);
        else wgmma_m64n64k16_f16(d, da, db);
    }
}

// The four k16 slices of a 64-deep stage: 32 bytes further along the 128-byte rows each.
template <int BN, typename T>
__device__ __forceinline__ void wgmma_stage(float* d, const T* a, const T* b) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wgmma_tile<BN, T>(d, wgmma_desc_sw128(a + 16 * kk), wgmma_desc_sw128(b + 16 * kk));
}

// Round one warpgroup's accumulators (rows r0..r0+63, columns c0..c0+BN-1; layout: mma.cuh)
// to T and store the rows < M, columns < N. tid: 0..127 within the warpgroup.
template <int BN, typename T>
__device__ __forceinline__ void store_wg(T* C, const float* d, int M, int N, int r0, int c0,
                                         int tid) {
    const int lane = tid & 31, g = lane >> 2, t = lane & 3;
    const bool pairs = (N & 1) == 0 && (reinterpret_cast<size_t>(C) & 3) == 0;
    r0 += 16 * (tid >> 5);
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + g + 8 * h, c = c0 + 8 * j + 2 * t;
            if (r >= M || c >= N) continue;
            T* p = C + (size_t)r * N + c;
            if (pairs) {
                *reinterpret_cast<unsigned*>(p) = pack2<T>(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            } else {
                p[0] = from_float<T>(d[4 * j + 2 * h]);
                if (c + 1 < N) p[1] = from_float<T>(d[4 * j + 2 * h + 1]);
            }
        }
}
#endif  // sm_90a

// v7: 256 threads = 2 warpgroups, each 64 rows x BN of a 128 x BN tile. All threads load the
// stages with cp.async (into the 128-byte swizzle), then each warpgroup issues 4 wgmma per stage.
// Dynamic shared memory: STAGES * (128 + BN) * 64 * sizeof(T) + 1024 bytes.
template <int BN, int STAGES, typename T>
__device__ __forceinline__ void gemm_wgmma(const T* __restrict__ A, const T* __restrict__ B,
                                           T* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128, BK = 64, THREADS = 256;
    T* As = reinterpret_cast<T*>(smem_1024());
    T* Bs = As + STAGES * BM * BK;
    const int wg = threadIdx.x >> 7;
    int bm, bn;
    tile_of<8>(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, bm, bn);
    const int m0 = bm * BM, n0 = bn * BN, KT = (K + BK - 1) / BK;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) {
            load_tile<BM, THREADS, true, true>(As + s * BM * BK, A, M, K, m0, s * BK);
            load_tile<BN, THREADS, true, true>(Bs + s * BN * BK, B, N, K, n0, s * BK);
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();      // my cp.async writes, before the tensor cores (async proxy) read
        __syncthreads();
        const int nk = kt + STAGES - 1, ns = nk % STAGES;
        if (nk < KT) {
            load_tile<BM, THREADS, true, true>(As + ns * BM * BK, A, M, K, m0, nk * BK);
            load_tile<BN, THREADS, true, true>(Bs + ns * BN * BK, B, N, K, n0, nk * BK);
        }
        cp_async_commit();
        const int s = kt % STAGES;
        wgmma_fence();
        wgmma_stage<BN, T>(d, As + s * BM * BK + wg * 64 * BK, Bs + s * BN * BK);
        wgmma_commit();
        wgmma_wait<0>();          // done reading stage s before the next barrier frees it
    }
    store_wg<BN, T>(C, d, M, N, m0 + wg * 64, n0, threadIdx.x & 127);
#endif
}

#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v7)
extern "C" __global__ void __launch_bounds__(256)
hgemm_v7(const __half* A, const __half* B, __half* C, int M, int N, int K) {
    gemm_wgmma<128, 4, __half>(A, B, C, M, N, K);
}
extern "C" __global__ void __launch_bounds__(256)
hgemm_v7_bf16(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int M, int N,
              int K) {
    gemm_wgmma<128, 4, __nv_bfloat16>(A, B, C, M, N, K);
}
#endif

// v8/v9: 384 threads = 3 warpgroups, gemm.cuh's tma_ws_gemm. Warpgroup 0 is the producer:
// after giving most of its registers away (setmaxnreg.dec), one thread issues the TMA copies of
// A (128 x 64) and B (BN x 64) into a ring of STAGES stages; full[s] completes when a stage's
// bytes have landed. Warpgroups 1 and 2 are consumers (setmaxnreg.inc): each waits on full[s],
// multiplies its 64 rows with 4 wgmma (wgmma_stage) and arrives on empty[s] when the tensor
// cores are done with the stage. PERSIST: a grid of one block per SM walks the tiles, so the
// producer fetches the next tile while the consumers store this one (store_wg). Tensor maps:
// hgemm.py (tensor_map), 128-byte swizzle, boxes of 64 columns x 128 (A) or BN (B) rows, zero
// fill outside the matrices.
// Dynamic shared memory: STAGES * (128 + BN) * 64 * sizeof(T) + 1024 bytes.
template <int BN, int STAGES, bool PERSIST, typename T>
__device__ __forceinline__ void gemm_tma_ws(const TmaDesc& ta, const TmaDesc& tb,
                                            T* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    T* As = reinterpret_cast<T*>(smem_1024());
    tma_ws_gemm<BN, STAGES, PERSIST, 8, false>(
        ta, tb, As, As + STAGES * 128 * 64, full, empty, M, N, K,
        [](float* d, const T* a, const T* b) { wgmma_stage<BN, T>(d, a, b); },
        [&](int c, int tid) {                  // consumer c's store of its 64 rows of a tile
            return [=](const float* d, int bm, int bn) {
                store_wg<BN, T>(C, d, M, N, bm * 128 + c * 64, bn * BN, tid);
            };
        });
#endif
}

#if !defined(CB_ONLY) || defined(CB_ONLY_hgemm_v8)
extern "C" __global__ void __launch_bounds__(384, 1)
hgemm_v8(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb, __half* C, int M,
         int N, int K) {
    gemm_tma_ws<256, 4, false, __half>(ta, tb, C, M, N, K);
}
extern "C" __global__ void __launch_bounds__(384, 1)
hgemm_v8_bf16(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb,
              __nv_bfloat16* C, int M, int N, int K) {
    gemm_tma_ws<256, 4, false, __nv_bfloat16>(ta, tb, C, M, N, K);
}
#endif

// The autotuner's Hopper family (instantiated by name from hgemm.py).
template <int BN, int STAGES, bool PERSIST, typename T>
__global__ void __launch_bounds__(384, 1)
hgemm_tma_t(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb, T* C, int M,
            int N, int K) {
    gemm_tma_ws<BN, STAGES, PERSIST, T>(ta, tb, C, M, N, K);
}
