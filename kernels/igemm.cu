// igemm.cu: 8-bit GEMM, C = A @ B^T: int8 in, int32 out (what torch._int_mm computes), and
// fp8 e4m3 in, bf16 out with per-tensor scales (what torch._scaled_mm computes).
//
//   A is (M, K), B is (N, K), both row-major 8-bit (B as nn.Linear's weight; torch._int_mm's
//   column-major b is this same memory). C is (M, N) row-major: int32 (igemm), bf16 (fp8gemm,
//   C = (A @ B^T) * scale_a * scale_b with fp32 accumulation, the scales read from device).
//
//   igemm_v1   dp4a on the CUDA cores: 64x64 tiles in shared memory, 4x4 outputs per thread,
//              each dp4a multiplies 4 int8 pairs and adds them to an int32 (sm_61+)
//   igemm_v2   tensor cores: mma.sync m16n8k32 (s8 in, s32 accumulate, mma.cuh) fed by ldmatrix,
//              128x128 tiles of 128-byte rows (XOR swizzle), 8 warps of 64x32, 3-stage cp.async
//              (sm_80+)
//   igemm_v3   v2 with 128x256 tiles and 64x64 warp tiles: twice the math per byte loaded
//   fp8gemm_v1 v2's kernel with e4m3 inputs: mma.sync m16n8k32 e4m3, f32 accumulate (sm_89+)
//   fp8gemm_v2 v3's tiles with e4m3 inputs (sm_89+)
//   fp8gemm_v3 Hopper: wgmma m64n128k32 e4m3 from shared memory fed by TMA (128-byte swizzle,
//              k-tiles of 128 bytes), a producer and two consumer warpgroups (setmaxnreg),
//              5-stage mbarrier ring, persistent grid in groups of 8 tile rows, C staged through
//              shared memory; each 128-deep partial sum added into fp32 registers (the tensor
//              cores' fp8 accumulator is shorter than fp32; torch._scaled_mm does the same).
//              fp8gemm_v3_fast: 128x256 tiles, 3 stages, no promotion (use_fast_accum) (sm_90a)
//
//   Shared tiles hold 128 bytes of K per row (eight 16-byte chunks; chunk c of row r stored at
//   c ^ (r % 8)), the byte layout of hgemm.cu's fp16 tiles: ldmatrix moves 8-bit data as pairs of
//   bytes, and one k16 step of fp16 is one k32 step of int8. K % 16 == 0 (16-byte rows); any M, N.
//
// Launches (kernels/igemm_launch.py): v1 grid (ceil(N/64), ceil(M/64)) x 256; v2/v3/fp8 a 1D
// grid of ceil(M/BM) * ceil(N/BN) tiles x 256 threads, dynamic shared memory
// STAGES * (BM + BN) * 128 bytes (128x128: 96 KiB, 128x256: 144 KiB: the launcher raises the limit).
// fp8gemm_v3: see its section (384 threads, one block per SM, tensor maps from the launcher).
// Each version's kernels sit inside #if !defined(CB_ONLY) || defined(CB_ONLY_<version>) (with
// the step each falls back to where its shared memory does not fit: igemm_v3 brings igemm_v2,
// fp8gemm_v2 brings fp8gemm_v1; fp8gemm_v3 is both of its kernels), so a launch can compile its
// version alone (cudabook.compile.module(..., only=...)); the template fp8gemm_tma_t costs
// nothing until named.
#include "mma.cuh"
#include "common.cuh"
// gemm.cuh: load_tile, chunk_index (v2, v3, fp8 v1, v2) and tma_ws_gemm (fp8 v3), shared with
// hgemm.cu
#include "gemm.cuh"

// ----------------------------------------------------------------------------- v1: dp4a
#if !defined(CB_ONLY) || defined(CB_ONLY_igemm_v1)
// launch: grid (ceil(N/64), ceil(M/64)), block 256 (16 x 16); thread (ty, tx) computes rows
// ty + 16 i and columns tx + 16 j (i, j < 4) of the block's 64x64 tile. K % 4 == 0.
extern "C" __global__ void __launch_bounds__(256)
igemm_v1(const signed char* __restrict__ A, const signed char* __restrict__ B,
         int* __restrict__ C, int M, int N, int K) {
    constexpr int BM = 64, BK = 32, W = BK / 4;            // a tile row: 32 bytes = 8 words
    __shared__ int As[BM][W + 1], Bs[BM][W + 1];           // +1: rows land on distinct banks
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int m0 = blockIdx.y * BM, n0 = blockIdx.x * BM;
    int acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int e = threadIdx.x; e < BM * W; e += 256) {  // 512 words of A and of B
            int r = e / W, w = e % W, k = k0 + 4 * w;
            bool okk = k < K;
            As[r][w] = (m0 + r < M && okk) ? *reinterpret_cast<const int*>(A + (size_t)(m0 + r) * K + k) : 0;
            Bs[r][w] = (n0 + r < N && okk) ? *reinterpret_cast<const int*>(B + (size_t)(n0 + r) * K + k) : 0;
        }
        __syncthreads();                                   // the tiles are complete
#pragma unroll
        for (int w = 0; w < W; ++w) {
            int a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[ty + 16 * i][w];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[tx + 16 * j][w];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = __dp4a(a[i], b[j], acc[i][j]);
        }
        __syncthreads();                                   // everyone is done reading them
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int r = m0 + ty + 16 * i, c = n0 + tx + 16 * j;
            if (r < M && c < N) C[(size_t)r * N + c] = acc[i][j];
        }
}
#endif

// ----------------------------------------------------------------------------- v2, v3, fp8
extern __shared__ __align__(128) unsigned char ig_smem[];

template <bool FP8> struct Acc8 { using T = int; };
template <> struct Acc8<true> { using T = float; };

// BM x BN tile of C per block (1D grid, row by row), warps of WM x WN, k-steps of 128 bytes,
// a cp.async ring of STAGES tiles.
template <int BM, int BN, int WM, int WN, int STAGES, bool FP8>
__device__ __forceinline__ void gemm8(const unsigned char* __restrict__ A,
                                      const unsigned char* __restrict__ B, void* __restrict__ Cv,
                                      int M, int N, int K, const float* sa, const float* sb) {
    using AccT = typename Acc8<FP8>::T;
    constexpr int BK = 128, WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
    constexpr int FM = WM / 16, FN = WN / 8;
    unsigned char* As = ig_smem;                   // [STAGES][BM * 128]
    unsigned char* Bs = ig_smem + STAGES * BM * BK; // [STAGES][BN * 128]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    const int tiles_n = (N + BN - 1) / BN;
    const int m0 = (blockIdx.x / tiles_n) * BM, n0 = (blockIdx.x % tiles_n) * BN;
    const int KT = (K + BK - 1) / BK;
    AccT acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0;
    auto load_stage = [&](int s, int kt) {
        load_tile<BM, THREADS, true, true>(As + s * BM * BK, A, M, K, m0, kt * BK);
        load_tile<BN, THREADS, true, true>(Bs + s * BN * BK, B, N, K, n0, kt * BK);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {         // prologue: STAGES - 1 tiles in flight
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();               // my copies of tile kt have landed
        __syncthreads();                           // everyone's have; stage (kt - 1) is free
        const int nk = kt + STAGES - 1;
        if (nk < KT) load_stage(nk % STAGES, nk);
        cp_async_commit();                         // (possibly empty: keeps the group count)
        const unsigned char* as = As + (kt % STAGES) * BM * BK;
        const unsigned char* bs = Bs + (kt % STAGES) * BN * BK;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {           // four k32 slices of 32 bytes
            unsigned a[FM][4], b[FN][2];
#pragma unroll
            for (int i = 0; i < FM; i++)
                ldmatrix_x4(a[i], smem_u32(as + chunk_index<true, unsigned char>(
                                                  wm + 16 * i + (lane & 15), 2 * kk + (lane >> 4))));
#pragma unroll
            for (int j = 0; j < FN / 2; j++) {
                unsigned r[4];
                ldmatrix_x4(r, smem_u32(bs + chunk_index<true, unsigned char>(
                                               wn + 16 * j + (lane & 7) + ((lane >> 4) << 3),
                                               2 * kk + ((lane >> 3) & 1))));
                b[2 * j][0] = r[0];
                b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2];
                b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    if constexpr (FP8) mma_m16n8k32_e4m3(acc[i][j], a[i], b[j]);
                    else mma_m16n8k32_s8(acc[i][j], a[i], b[j]);
                }
        }
    }
    // store: lane (g, t) holds C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1) of each m16n8 tile
    const int g = lane >> 2, t = lane & 3;
    float scale = 1.0f;
    if constexpr (FP8) scale = sa[0] * sb[0];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = m0 + wm + 16 * i + g + 8 * h, c = n0 + wn + 8 * j + 2 * t;
                if (r >= M || c >= N) continue;
                if constexpr (FP8) {
                    __nv_bfloat16* C = reinterpret_cast<__nv_bfloat16*>(Cv) + (size_t)r * N + c;
                    C[0] = __float2bfloat16_rn(acc[i][j][2 * h] * scale);
                    if (c + 1 < N) C[1] = __float2bfloat16_rn(acc[i][j][2 * h + 1] * scale);
                } else {
                    int* C = reinterpret_cast<int*>(Cv) + (size_t)r * N + c;
                    if (c + 1 < N && (N & 1) == 0) {
                        *reinterpret_cast<int2*>(C) = make_int2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                    } else {
                        C[0] = acc[i][j][2 * h];
                        if (c + 1 < N) C[1] = acc[i][j][2 * h + 1];
                    }
                }
            }
}

#if !defined(CB_ONLY) || defined(CB_ONLY_igemm_v2) || defined(CB_ONLY_igemm_v3)
extern "C" __global__ void __launch_bounds__(256)
igemm_v2(const unsigned char* A, const unsigned char* B, int* C, int M, int N, int K) {
    gemm8<128, 128, 64, 32, 3, false>(A, B, C, M, N, K, nullptr, nullptr);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_igemm_v3)
extern "C" __global__ void __launch_bounds__(256)
igemm_v3(const unsigned char* A, const unsigned char* B, int* C, int M, int N, int K) {
    gemm8<128, 256, 64, 64, 3, false>(A, B, C, M, N, K, nullptr, nullptr);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_fp8gemm_v1) || defined(CB_ONLY_fp8gemm_v2)
extern "C" __global__ void __launch_bounds__(256)
fp8gemm_v1(const unsigned char* A, const unsigned char* B, __nv_bfloat16* C, int M, int N, int K,
           const float* scale_a, const float* scale_b) {
    gemm8<128, 128, 64, 32, 3, true>(A, B, C, M, N, K, scale_a, scale_b);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_fp8gemm_v2)
extern "C" __global__ void __launch_bounds__(256)
fp8gemm_v2(const unsigned char* A, const unsigned char* B, __nv_bfloat16* C, int M, int N, int K,
           const float* scale_a, const float* scale_b) {
    gemm8<128, 256, 64, 64, 3, true>(A, B, C, M, N, K, scale_a, scale_b);
}
#endif

// ----------------------------------------------------------------------------- v3: Hopper
// wgmma m64nNk32 e4m3 (mma.cuh) fed by TMA: hgemm_v8/v9's warp-specialised loop (gemm.cuh's
// tma_ws_gemm: 384 threads, a TMA producer warpgroup and two consumer warpgroups of 64 rows, a
// ring of STAGES stages guarded by mbarriers) with 1-byte elements: a k-tile is 128 values of K,
// one 128-byte swizzled row per row of A (128 rows) or B (BN rows), so TMA's boxes are 128 bytes
// wide and wgmma_desc_sw128 describes the tiles as it does hgemm's. A consumer issues 4 wgmma
// per stage (k32 slices, 32 bytes apart) and, without PROMOTE, keeps one stage's group in
// flight (wgmma.wait_group 1) as hgemm does. PROMOTE: the fp8 tensor-core accumulator keeps
// fewer bits than fp32 (cuBLAS calls it fast accumulation), so each k-tile's 4 wgmma start from
// zero, the consumer waits for them (wait_group 0), releases the stage and adds the partial sums
// into fp32 registers: twice the accumulator registers (128 x 256 tiles no longer fit: 256 per
// thread) and a drain of the wgmma pipeline per k-tile. The epilogue multiplies by
// scale_a * scale_b, rounds to bf16 and stores the rows < M, columns < N: straight from the
// registers (4-byte stores), or, EPI, through a shared 64 x BN tile per consumer so that each
// thread stores 16 contiguous bytes of a row.
// PERSIST: a grid of one block per SM walks the tiles (the producer fetches the next tile while
// the consumers store this one). Tiles are ordered in groups of GROUP tile rows (L2 reuse).
// Tensor maps: igemm_launch.py (tensor_map), uint8, boxes of 128 bytes x 128 (A) or BN (B) rows.
// Dynamic shared memory: STAGES * (128 + BN) * 128 + 1024 bytes (1024: alignment slack), plus
// 2 * 64 * (2 BN + 16) with EPI.

// The first 1024-byte boundary in dynamic shared memory (the 128-byte swizzle repeats every
// 1024 bytes, and TMA and wgmma compute it from the address).
__device__ __forceinline__ unsigned char* ig_smem_1024() { return align_1024(ig_smem); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The EPI epilogue of one consumer warpgroup (tid 0..127, consumer c): its 64 x BN accumulators,
// scaled and rounded to bf16, into its shared tile (rows 2 BN + 16 bytes apart: the 8 rows g of a
// store land 4 banks apart, so the 32 lanes hit 32 banks), a barrier of its 128 threads, then
// rows out in 16-byte chunks (element stores where N % 8 or the alignment does not allow them).
template <int BN>
__device__ __forceinline__ void fp8_store_staged(__nv_bfloat16* C, const float* d, float scale,
                                                 int M, int N, int r0, int c0,
                                                 unsigned char* stage_c, int c, int tid) {
    constexpr int LD = 2 * BN + 16, CH = BN / 8;
    unsigned char* cs = stage_c + c * 64 * LD;
    const int lane = tid & 31, g = lane >> 2, t = lane & 3, w = tid >> 5;
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + c) : "memory");   // last tile's reads done
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            *reinterpret_cast<unsigned*>(cs + (16 * w + g + 8 * h) * LD + 16 * j + 4 * t) =
                pack_bf162(d[4 * j + 2 * h] * scale, d[4 * j + 2 * h + 1] * scale);
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + c) : "memory");
    const bool vec = (N & 7) == 0 && (reinterpret_cast<size_t>(C) & 15) == 0;
#pragma unroll 4
    for (int q = tid; q < 64 * CH; q += 128) {
        const int r = q / CH, col = (q % CH) * 8, gr = r0 + r, gc = c0 + col;
        if (gr >= M || gc >= N) continue;
        const unsigned char* src = cs + r * LD + col * 2;
        __nv_bfloat16* dst = C + (size_t)gr * N + gc;
        if (vec) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < 8 && gc + e < N; e++)
                dst[e] = reinterpret_cast<const __nv_bfloat16*>(src)[e];
        }
    }
}

template <int BN>
__device__ __forceinline__ void wgmma_e4m3(float* d, unsigned long long da, unsigned long long db) {
    static_assert(BN == 128 || BN == 256, "fp8 wgmma wrappers exist for N = 128, 256");
    if constexpr (BN == 256) wgmma_m64n256k32_e4m3(d, da, db);
    else wgmma_m64n128k32_e4m3(d, da, db);
}
#endif

template <int BN, int STAGES, bool PERSIST, int GROUP, bool EPI, bool PROMOTE>
__device__ __forceinline__ void fp8_tma_ws(const TmaDesc& ta, const TmaDesc& tb,
                                           __nv_bfloat16* __restrict__ C, int M, int N, int K,
                                           const float* sa, const float* sb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128, BK = 128;                       // BK: bytes = e4m3 values of K
    constexpr unsigned A_BYTES = BM * BK, B_BYTES = BN * BK;
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    unsigned char* As = ig_smem_1024();
    unsigned char* Bs = As + STAGES * A_BYTES;
    tma_ws_gemm<BN, STAGES, PERSIST, GROUP, PROMOTE>(
        ta, tb, As, Bs, full, empty, M, N, K,
        [](float* d, const unsigned char* a, const unsigned char* b) {
#pragma unroll
            for (int kk = 0; kk < 4; kk++)      // 4 wgmma: k32 slices, 32 bytes apart
                wgmma_e4m3<BN>(d, wgmma_desc_sw128(a + 32 * kk), wgmma_desc_sw128(b + 32 * kk));
        },
        [&](int c, int tid) {                   // once per consumer thread: its epilogue
            const float scale = sa[0] * sb[0];
            const bool pairs = (N & 1) == 0 && (reinterpret_cast<size_t>(C) & 3) == 0;
            const int lane = tid & 31, g = lane >> 2, t = lane & 3;
            return [=](const float* d, int bm, int bn) {
                if constexpr (EPI) {
                    fp8_store_staged<BN>(C, d, scale, M, N, bm * BM + c * 64, bn * BN,
                                         Bs + STAGES * B_BYTES, c, tid);
                    return;
                }
                // accumulator layout (mma.cuh): warp w holds rows 16w..16w+15 of the 64
                const int r0 = bm * BM + c * 64 + 16 * (tid >> 5) + g, c0 = bn * BN + 2 * t;
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = r0 + 8 * h, col = c0 + 8 * j;
                        if (r >= M || col >= N) continue;
                        const float lo = d[4 * j + 2 * h] * scale;
                        const float hi = d[4 * j + 2 * h + 1] * scale;
                        __nv_bfloat16* p = C + (size_t)r * N + col;
                        if (pairs) {
                            *reinterpret_cast<unsigned*>(p) = pack_bf162(lo, hi);
                        } else {
                            p[0] = __float2bfloat16_rn(lo);
                            if (col + 1 < N) p[1] = __float2bfloat16_rn(hi);
                        }
                    }
            };
        });
#endif
}

#if !defined(CB_ONLY) || defined(CB_ONLY_fp8gemm_v3)
// v3: 128 x 128 tiles, 5 stages, persistent, staged epilogue, fp32 promotion every k-tile (the
// numerics of torch._scaled_mm). v3_fast: 128 x 256 tiles, 3 stages, the tensor cores' own
// accumulation (torch._scaled_mm(..., use_fast_accum=True)).
extern "C" __global__ void __launch_bounds__(384, 1)
fp8gemm_v3(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb,
           __nv_bfloat16* C, int M, int N, int K, const float* scale_a, const float* scale_b) {
    fp8_tma_ws<128, 5, true, 8, true, true>(ta, tb, C, M, N, K, scale_a, scale_b);
}
extern "C" __global__ void __launch_bounds__(384, 1)
fp8gemm_v3_fast(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb,
                __nv_bfloat16* C, int M, int N, int K, const float* scale_a,
                const float* scale_b) {
    fp8_tma_ws<256, 3, true, 8, true, false>(ta, tb, C, M, N, K, scale_a, scale_b);
}
#endif

// v3's family, for the probe (instantiated by name from igemm_launch.py).
template <int BN, int STAGES, bool PERSIST, int GROUP, bool EPI, bool PROMOTE>
__global__ void __launch_bounds__(384, 1)
fp8gemm_tma_t(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb,
              __nv_bfloat16* C, int M, int N, int K, const float* scale_a, const float* scale_b) {
    fp8_tma_ws<BN, STAGES, PERSIST, GROUP, EPI, PROMOTE>(ta, tb, C, M, N, K, scale_a, scale_b);
}
