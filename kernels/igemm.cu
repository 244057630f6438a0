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
//
//   Shared tiles hold 128 bytes of K per row (eight 16-byte chunks; chunk c of row r stored at
//   c ^ (r % 8)), the byte layout of hgemm.cu's fp16 tiles: ldmatrix moves 8-bit data as pairs of
//   bytes, and one k16 step of fp16 is one k32 step of int8. K % 16 == 0 (16-byte rows); any M, N.
//
// Launches (kernels/igemm_launch.py): v1 grid (ceil(N/64), ceil(M/64)) x 256; v2/v3/fp8 a 1D
// grid of ceil(M/BM) * ceil(N/BN) tiles x 256 threads, dynamic shared memory
// STAGES * (BM + BN) * 128 bytes (128x128: 96 KiB, 128x256: 144 KiB: the launcher raises the limit).
#include "mma.cuh"
#include "common.cuh"

// ----------------------------------------------------------------------------- v1: dp4a
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

// ----------------------------------------------------------------------------- v2, v3, fp8
extern __shared__ __align__(128) unsigned char ig_smem[];

// byte offset of 16-byte chunk c of row r in a swizzled tile of 128-byte rows
__device__ __forceinline__ int ig_index(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// rows [r0, r0 + ROWS) x bytes [k0, k0 + 128) of X (R x K) into a tile; zeros outside X
template <int ROWS, int THREADS>
__device__ __forceinline__ void ig_load_tile(unsigned char* tile, const unsigned char* X, int R,
                                             int K, int r0, int k0) {
#pragma unroll
    for (int i = 0; i < ROWS * 8 / THREADS; i++) {
        const int e = threadIdx.x + i * THREADS, r = e >> 3, c = e & 7;
        const bool ok = r0 + r < R && k0 + c * 16 < K;
        const unsigned char* src = X + (ok ? (size_t)(r0 + r) * K + k0 + c * 16 : 0);
        cp_async_16_zfill(tile + ig_index(r, c), src, ok);
    }
}

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
        ig_load_tile<BM, THREADS>(As + s * BM * BK, A, M, K, m0, kt * BK);
        ig_load_tile<BN, THREADS>(Bs + s * BN * BK, B, N, K, n0, kt * BK);
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
                ldmatrix_x4(a[i], smem_u32(as + ig_index(wm + 16 * i + (lane & 15),
                                                         2 * kk + (lane >> 4))));
#pragma unroll
            for (int j = 0; j < FN / 2; j++) {
                unsigned r[4];
                ldmatrix_x4(r, smem_u32(bs + ig_index(wn + 16 * j + (lane & 7) + ((lane >> 4) << 3),
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

extern "C" __global__ void __launch_bounds__(256)
igemm_v2(const unsigned char* A, const unsigned char* B, int* C, int M, int N, int K) {
    gemm8<128, 128, 64, 32, 3, false>(A, B, C, M, N, K, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(256)
igemm_v3(const unsigned char* A, const unsigned char* B, int* C, int M, int N, int K) {
    gemm8<128, 256, 64, 64, 3, false>(A, B, C, M, N, K, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(256)
fp8gemm_v1(const unsigned char* A, const unsigned char* B, __nv_bfloat16* C, int M, int N, int K,
           const float* scale_a, const float* scale_b) {
    gemm8<128, 128, 64, 32, 3, true>(A, B, C, M, N, K, scale_a, scale_b);
}
extern "C" __global__ void __launch_bounds__(256)
fp8gemm_v2(const unsigned char* A, const unsigned char* B, __nv_bfloat16* C, int M, int N, int K,
           const float* scale_a, const float* scale_b) {
    gemm8<128, 256, 64, 64, 3, true>(A, B, C, M, N, K, scale_a, scale_b);
}
