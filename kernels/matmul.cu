// matmul.cu: C[M, N] = A[M, K] @ B[K, N] in float32, all row-major and contiguous (Chapter 4).
//
// versions, simplest first (each adds one idea to the previous one)
//   matmul_v1   naive: one thread per output, threadIdx.x walks ROWS -> uncoalesced loads of A
//   matmul_v2   coalesced: threadIdx.x walks COLUMNS, so a warp reads 32 neighbours of B and C
//   matmul_v3   shared-memory tiles 32x32: each loaded element is reused 32 times from shared
//   matmul_v4   1D register tiling: 64x64 block tile, BK=8, each thread computes 8 outputs (a column)
//   matmul_v5   2D register tiling: 128x128 block tile, each thread an 8x8 outer product
//   matmul_v6   float4 global loads; A stored transposed in shared memory (float4 shared reads)
//   matmul_v7   bank-conflict avoidance: padded A tile, each thread's 8x8 split in 4x4 pieces
//   matmul_v8   warp tiling: each warp owns a 64x32 piece of the block tile, BK=16
//   matmul_v9   double buffering: two shared stages; cp.async on sm_80+, registers before that
//   matmul_v10  v9 with its tile sizes set by -D macros (MM_BM ...), for the autotuning sweep
//   matmul_v11  v10 with the pipeline kept full across tiles: fragments double-buffered in
//               registers, one barrier per tile placed before its last k-step (same macros)
//
// Every version is correct for any M, N, K >= 1: tiles that run past an edge are zero-filled
// on load and guarded on store. float4 paths are taken only when the row length is a multiple
// of 4 and the pointer is 16-byte aligned (checked in the kernel, uniformly per launch);
// otherwise the same kernel falls back to scalar loads. Indices are int: the launcher
// (kernels/matmul.py, launch_cupy) refuses matrices with 2^31 or more elements.
//
// work: 2 M N K flops; minimum traffic 4 (M K + K N + M N) bytes.
#include "common.cuh"
// mma.cuh: the cp.async wrappers of matmul_v9-v11
#include "mma.cuh"

// ------------------------------------------------------------------------------------ helpers

// 4 consecutive elements p[row * ld + col .. col + 3]; zeros outside [0, rows) x [0, cols).
// vec: the float4 load is allowed (ld % 4 == 0 and p 16-byte aligned).
__device__ __forceinline__ float4 load4(const float* __restrict__ p, int row, int col, int rows,
                                        int cols, int ld, bool vec) {
    if (row < rows && vec && col + 3 < cols) {
        return *reinterpret_cast<const float4*>(p + row * ld + col);
    }
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < rows) {
        const float* q = p + row * ld;
        if (col + 0 < cols) v.x = q[col + 0];
        if (col + 1 < cols) v.y = q[col + 1];
        if (col + 2 < cols) v.z = q[col + 2];
        if (col + 3 < cols) v.w = q[col + 3];
    }
    return v;
}

// store v to p[row * ld + col .. col + 3], skipping what lies outside [0, rows) x [0, cols)
__device__ __forceinline__ void store4(float* __restrict__ p, int row, int col, int rows,
                                       int cols, int ld, bool vec, float4 v) {
    if (row >= rows) return;
    if (vec && col + 3 < cols) {
        *reinterpret_cast<float4*>(p + row * ld + col) = v;
        return;
    }
    float* q = p + row * ld;
    if (col + 0 < cols) q[col + 0] = v.x;
    if (col + 1 < cols) q[col + 1] = v.y;
    if (col + 2 < cols) q[col + 2] = v.z;
    if (col + 3 < cols) q[col + 3] = v.w;
}

// aligned16(p) is in common.cuh

// ------------------------------------------------------------------------------------ v1, v2
// (-DMM_ONLY_TUNED compiles matmul_v10 and v11 alone: the autotuning sweep builds many variants)
#ifndef MM_ONLY_TUNED

// launch: block (32, 32), grid (ceil(M/32), ceil(N/32)), no shared memory.
// threadIdx.x walks rows: the 32 threads of a warp read A[row..row+31][k], 32 rows apart in
// memory (32 separate 32-byte sectors per load), and write C 32 rows apart.
extern "C" __global__ void matmul_v1(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ C, int M, int N, int K) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
        C[row * N + col] = acc;
    }
}

// launch: block (32, 32), grid (ceil(N/32), ceil(M/32)), no shared memory.
// threadIdx.x walks columns: a warp reads one A element (broadcast) and 32 consecutive floats
// of B (one 128-byte line), and writes 32 consecutive floats of C.
extern "C" __global__ void matmul_v2(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ C, int M, int N, int K) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
        C[row * N + col] = acc;
    }
}

// ------------------------------------------------------------------------------------ v3

#define V3_TILE 32
// launch: block (32, 32), grid (ceil(N/32), ceil(M/32)), 2 x 32 x 32 x 4 = 8 KiB static shared.
// The block loads a 32x32 tile of A and of B once (one element per thread, coalesced), then
// every thread reads 32 of each from shared memory: global loads drop 32-fold.
extern "C" __global__ void matmul_v3(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[V3_TILE][V3_TILE];
    __shared__ float Bs[V3_TILE][V3_TILE];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * V3_TILE + ty;
    int col = blockIdx.x * V3_TILE + tx;
    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += V3_TILE) {
        // zero-fill past the edges, so the inner loop needs no test
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.f;
        __syncthreads();                       // the tiles are complete
#pragma unroll
        for (int k = 0; k < V3_TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();                       // nobody still reads them before they are refilled
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

// ------------------------------------------------------------------------------------ v4

#define V4_BM 64
#define V4_BN 64
#define V4_BK 8
#define V4_TM 8
// launch: block (V4_BM * V4_BN / V4_TM = 512), grid (ceil(N/64), ceil(M/64)),
//         (64x8 + 8x64) x 4 = 4 KiB static shared.
// Each thread computes TM = 8 outputs of one column: per k it reads one B value from shared
// memory and reuses it 8 times from a register (8 FMAs per 1 + 8 shared loads, the A values
// being broadcast to the whole warp).
extern "C" __global__ void __launch_bounds__(512)
matmul_v4(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    __shared__ float As[V4_BM][V4_BK];
    __shared__ float Bs[V4_BK][V4_BN];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * V4_BM, n0 = blockIdx.x * V4_BN;
    const int tcol = tid % V4_BN, trow = tid / V4_BN;          // trow in [0, 8)
    const int ar = tid / V4_BK, ac = tid % V4_BK;              // one A element per thread
    const int br = tid / V4_BN, bc = tid % V4_BN;              // one B element per thread
    float acc[V4_TM] = {0.f};
    for (int k0 = 0; k0 < K; k0 += V4_BK) {
        As[ar][ac] = (m0 + ar < M && k0 + ac < K) ? A[(m0 + ar) * K + k0 + ac] : 0.f;
        Bs[br][bc] = (k0 + br < K && n0 + bc < N) ? B[(k0 + br) * N + n0 + bc] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < V4_BK; ++k) {
            float b = Bs[k][tcol];
#pragma unroll
            for (int i = 0; i < V4_TM; ++i) acc[i] += As[trow * V4_TM + i][k] * b;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < V4_TM; ++i) {
        int r = m0 + trow * V4_TM + i, c = n0 + tcol;
        if (r < M && c < N) C[r * N + c] = acc[i];
    }
}

// ------------------------------------------------------------------------------------ v5

#define V5_BM 128
#define V5_BN 128
#define V5_BK 8
#define V5_TM 8
#define V5_TN 8
// launch: block (V5_BM * V5_BN / (V5_TM * V5_TN) = 256), grid (ceil(N/128), ceil(M/128)),
//         (128x8 + 8x128) x 4 = 8 KiB static shared.
// Each thread computes an 8x8 block of C as a sum of outer products: per k, 8 A values and
// 8 B values from shared memory feed 64 FMAs held in 64 accumulator registers.
extern "C" __global__ void __launch_bounds__(256)
matmul_v5(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    __shared__ float As[V5_BM][V5_BK];
    __shared__ float Bs[V5_BK][V5_BN];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * V5_BM, n0 = blockIdx.x * V5_BN;
    const int tr = tid / (V5_BN / V5_TN), tc = tid % (V5_BN / V5_TN);   // 16 x 16 threads
    float acc[V5_TM][V5_TN] = {{0.f}};
    float ra[V5_TM], rb[V5_TN];
    for (int k0 = 0; k0 < K; k0 += V5_BK) {
        // 1024 elements of each tile, 4 per thread, coalesced
#pragma unroll
        for (int l = 0; l < V5_BM * V5_BK / 256; ++l) {
            int idx = tid + l * 256;
            int r = idx / V5_BK, c = idx % V5_BK;
            As[r][c] = (m0 + r < M && k0 + c < K) ? A[(m0 + r) * K + k0 + c] : 0.f;
        }
#pragma unroll
        for (int l = 0; l < V5_BK * V5_BN / 256; ++l) {
            int idx = tid + l * 256;
            int r = idx / V5_BN, c = idx % V5_BN;
            Bs[r][c] = (k0 + r < K && n0 + c < N) ? B[(k0 + r) * N + n0 + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < V5_BK; ++k) {
#pragma unroll
            for (int i = 0; i < V5_TM; ++i) ra[i] = As[tr * V5_TM + i][k];
#pragma unroll
            for (int j = 0; j < V5_TN; ++j) rb[j] = Bs[k][tc * V5_TN + j];
#pragma unroll
            for (int i = 0; i < V5_TM; ++i)
#pragma unroll
                for (int j = 0; j < V5_TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < V5_TM; ++i)
#pragma unroll
        for (int j = 0; j < V5_TN; ++j) {
            int r = m0 + tr * V5_TM + i, c = n0 + tc * V5_TN + j;
            if (r < M && c < N) C[r * N + c] = acc[i][j];
        }
}

// ------------------------------------------------------------------------------------ v6, v7

// The body of v6 and v7: 128x128 block tile, BK = 8, 256 threads, 8x8 outputs per thread.
// Global loads are float4 (one of A and one of B per thread per tile). A is stored transposed,
// As[k][m], so the 8 A values a thread needs at step k are contiguous: two float4 shared loads
// instead of eight scalar ones.
//   SPLIT = false, PAD = 0 (v6): thread (tr, tc) owns rows tr*8..+7 and columns tc*8..+7.
//     Writing A transposed is a 2-way bank conflict (rows 128 floats apart share a bank), and
//     the float4 reads of B by 16 lanes 32 bytes apart need twice the shared wavefronts.
//   SPLIT = true, PAD = 4 (v7): As rows are padded to 132 floats, so the transposed writes of
//     a warp hit 32 different banks; the thread owns rows tr*4..+3 and 64+tr*4..+3, columns
//     tc*4..+3 and 64+tc*4..+3, so the lanes of a warp read consecutive float4s (no conflict).
template <bool SPLIT, int PAD>
__device__ __forceinline__ void tile2d_float4(const float* __restrict__ A,
                                              const float* __restrict__ B, float* __restrict__ C,
                                              int M, int N, int K) {
    constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8;
    __shared__ __align__(16) float As[BK][BM + PAD];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tr = tid / 16, tc = tid % 16;
    const bool vecA = (K % 4 == 0) && aligned16(A);
    const bool vecB = (N % 4 == 0) && aligned16(B);
    const bool vecC = (N % 4 == 0) && aligned16(C);
    const int ar = tid / (BK / 4), ac = (tid % (BK / 4)) * 4;     // A: 128 rows x 2 float4
    const int br = tid / (BN / 4), bc = (tid % (BN / 4)) * 4;     // B: 8 rows x 32 float4
    // the rows and columns of this thread's outputs, as two groups of 4 each
    const int row_g[2] = {SPLIT ? tr * 4 : tr * 8, SPLIT ? 64 + tr * 4 : tr * 8 + 4};
    const int col_g[2] = {SPLIT ? tc * 4 : tc * 8, SPLIT ? 64 + tc * 4 : tc * 8 + 4};
    float acc[TM][TN] = {{0.f}};
    for (int k0 = 0; k0 < K; k0 += BK) {
        float4 a = load4(A, m0 + ar, k0 + ac, M, K, K, vecA);
        As[ac + 0][ar] = a.x;                                      // transpose on the way in
        As[ac + 1][ar] = a.y;
        As[ac + 2][ar] = a.z;
        As[ac + 3][ar] = a.w;
        *reinterpret_cast<float4*>(&Bs[br][bc]) = load4(B, k0 + br, n0 + bc, K, N, N, vecB);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float ra[TM], rb[TN];
#pragma unroll
            for (int g = 0; g < 2; ++g) {
                float4 x = *reinterpret_cast<const float4*>(&As[k][row_g[g]]);
                float4 y = *reinterpret_cast<const float4*>(&Bs[k][col_g[g]]);
                ra[4 * g + 0] = x.x; ra[4 * g + 1] = x.y; ra[4 * g + 2] = x.z; ra[4 * g + 3] = x.w;
                rb[4 * g + 0] = y.x; rb[4 * g + 1] = y.y; rb[4 * g + 2] = y.z; rb[4 * g + 3] = y.w;
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            float4 v = make_float4(acc[i][4 * g], acc[i][4 * g + 1], acc[i][4 * g + 2],
                                   acc[i][4 * g + 3]);
            store4(C, m0 + row_g[i / 4] + i % 4, n0 + col_g[g], M, N, N, vecC, v);
        }
}

// launch: block (256), grid (ceil(N/128), ceil(M/128)), 8 KiB static shared.
extern "C" __global__ void __launch_bounds__(256)
matmul_v6(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    tile2d_float4<false, 0>(A, B, C, M, N, K);
}

// launch: block (256), grid (ceil(N/128), ceil(M/128)), 8.1 KiB static shared (padded As).
extern "C" __global__ void __launch_bounds__(256)
matmul_v7(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    tile2d_float4<true, 4>(A, B, C, M, N, K);
}

#endif  // MM_ONLY_TUNED

// ------------------------------------------------------------------------------------ v8..v10

// The warp-tiled body shared by v8, v9 and v10.
//   block tile BM x BN, k-step BK, NT = (BM/WM) * (BN/WN) * 32 threads;
//   each warp owns a WM x WN piece; its 32 lanes form an LR x LC grid (LR = WM/TM, LC = WN/TN)
//   and each lane owns TM x TN outputs as (TM/4) x (TN/4) pieces of 4x4, spaced LR*4 rows and
//   LC*4 columns apart, so a warp's float4 shared reads are consecutive (conflict-free);
//   shared memory (dynamic): STAGES x (As[BK][BM + 4] transposed, Bs[BK][BN]).
//   STAGES = 1: load, sync, compute, sync (v8).
//   STAGES >= 2 (double buffering): the next tile is fetched while this one is computed.
//     ASYNC and sm_80+: cp.async straight into shared memory, STAGES - 1 tiles in flight;
//     otherwise (STAGES = 2): global loads into registers before the math, stored into the
//     other stage after it.
template <int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES, bool ASYNC>
__device__ __forceinline__ void gemm_warptile(const float* __restrict__ A,
                                              const float* __restrict__ B, float* __restrict__ C,
                                              int M, int N, int K) {
    constexpr int PAD = 4;
    constexpr int NT = (BM / WM) * (BN / WN) * 32;
    constexpr int LR = WM / TM, LC = WN / TN;
    static_assert(LR * LC == 32, "a warp tile must hold 32 lanes: (WM/TM) * (WN/TN) == 32");
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0, "TM, TN, BK: multiples of 4");
    static_assert(BM % WM == 0 && BN % WN == 0, "the warp tile must divide the block tile");
    constexpr int A_IT = BM * BK / 4 / NT, B_IT = BK * BN / 4 / NT;   // float4 per thread
    static_assert(A_IT * NT * 4 == BM * BK && B_IT * NT * 4 == BK * BN,
                  "each thread must load a whole number of float4 of each tile");
    constexpr int AS = BK * (BM + PAD), BS = BK * BN, STAGE = AS + BS;   // floats
#if __CUDA_ARCH__ >= 800
    constexpr bool kAsync = ASYNC && STAGES >= 2;
#else
    constexpr bool kAsync = false;                  // register staging uses 2 of the stages
#endif
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    const int lr = lane / LC, lc = lane % LC;
    const bool vecA = (K % 4 == 0) && aligned16(A);
    const bool vecB = (N % 4 == 0) && aligned16(B);
    const bool vecC = (N % 4 == 0) && aligned16(C);
    const int ntiles = (K + BK - 1) / BK;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    // --- fetching tile t into stage s
    auto issue_async = [&](int t, int s) {          // cp.async (only used when kAsync)
        float* As = smem + s * STAGE;
        float* Bs = As + AS;
        const int k0 = t * BK;
#pragma unroll
        for (int l = 0; l < A_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
            bool rok = m0 + r < M;
#pragma unroll
            for (int e = 0; e < 4; ++e) {           // 4-byte copies: transposed on the way in
                bool ok = rok && k0 + c + e < K;
                cp_async_4_zfill(&As[(c + e) * (BM + PAD) + r],
                                 ok ? A + (m0 + r) * K + k0 + c + e : A, ok);
            }
        }
#pragma unroll
        for (int l = 0; l < B_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
            int gr = k0 + r, gc = n0 + c;
            if (vecB) {
                int bytes = (gr < K) ? 4 * max(0, min(4, N - gc)) : 0;
                cp_async_16_part(&Bs[r * BN + c], bytes ? B + gr * N + gc : B, bytes);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    bool ok = gr < K && gc + e < N;
                    cp_async_4_zfill(&Bs[r * BN + c + e], ok ? B + gr * N + gc + e : B, ok);
                }
            }
        }
    };
    float4 ra_st[A_IT], rb_st[B_IT];                // register staging (when not kAsync)
    auto load_regs = [&](int t) {
        const int k0 = t * BK;
#pragma unroll
        for (int l = 0; l < A_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
            ra_st[l] = load4(A, m0 + r, k0 + c, M, K, K, vecA);
        }
#pragma unroll
        for (int l = 0; l < B_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
            rb_st[l] = load4(B, k0 + r, n0 + c, K, N, N, vecB);
        }
    };
    auto store_regs = [&](int s) {
        float* As = smem + s * STAGE;
        float* Bs = As + AS;
#pragma unroll
        for (int l = 0; l < A_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
            As[(c + 0) * (BM + PAD) + r] = ra_st[l].x;
            As[(c + 1) * (BM + PAD) + r] = ra_st[l].y;
            As[(c + 2) * (BM + PAD) + r] = ra_st[l].z;
            As[(c + 3) * (BM + PAD) + r] = ra_st[l].w;
        }
#pragma unroll
        for (int l = 0; l < B_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[r * BN + c]) = rb_st[l];
        }
    };
    // --- the math on stage s: BK outer products of TM x TN
    auto compute = [&](int s) {
        const float* As = smem + s * STAGE;
        const float* Bs = As + AS;
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float ra[TM], rb[TN];
#pragma unroll
            for (int i = 0; i < TM / 4; ++i) {
                float4 x = *reinterpret_cast<const float4*>(
                    &As[k * (BM + PAD) + wm + i * LR * 4 + lr * 4]);
                ra[4 * i + 0] = x.x; ra[4 * i + 1] = x.y; ra[4 * i + 2] = x.z; ra[4 * i + 3] = x.w;
            }
#pragma unroll
            for (int j = 0; j < TN / 4; ++j) {
                float4 y = *reinterpret_cast<const float4*>(
                    &Bs[k * BN + wn + j * LC * 4 + lc * 4]);
                rb[4 * j + 0] = y.x; rb[4 * j + 1] = y.y; rb[4 * j + 2] = y.z; rb[4 * j + 3] = y.w;
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
        }
    };

    if constexpr (kAsync) {
        // prologue: STAGES - 1 tiles in flight (one commit group each, empty ones included)
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < ntiles) issue_async(s, s);
            cp_async_commit();
        }
        for (int t = 0; t < ntiles; ++t) {
            cp_async_wait<STAGES - 2>();            // my copies of tile t have landed
            __syncthreads();                        // ...and everyone's; stage (t-1) is free
            int nt = t + STAGES - 1;
            if (nt < ntiles) issue_async(nt, nt % STAGES);
            cp_async_commit();
            compute(t % STAGES);
        }
    } else if constexpr (STAGES >= 2) {
        load_regs(0);
        store_regs(0);
        __syncthreads();
        for (int t = 0; t < ntiles; ++t) {
            if (t + 1 < ntiles) load_regs(t + 1);  // in flight during the math below
            compute(t % 2);
            if (t + 1 < ntiles) store_regs((t + 1) % 2);
            __syncthreads();                        // one barrier per tile is enough
        }
    } else {
        for (int t = 0; t < ntiles; ++t) {
            load_regs(t);
            store_regs(0);
            __syncthreads();
            compute(0);
            __syncthreads();
        }
    }

    // --- epilogue: float4 stores of each 4x4 piece
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int r = m0 + wm + (i / 4) * LR * 4 + lr * 4 + i % 4;
#pragma unroll
        for (int j = 0; j < TN / 4; ++j) {
            int c = n0 + wn + j * LC * 4 + lc * 4;
            store4(C, r, c, M, N, N, vecC, make_float4(acc[i][4 * j], acc[i][4 * j + 1],
                                                       acc[i][4 * j + 2], acc[i][4 * j + 3]));
        }
    }
}

#ifndef MM_ONLY_TUNED
// launch: block (256), grid (ceil(N/128), ceil(M/128)),
//         dynamic shared 16 x (132 + 128) x 4 = 16.25 KiB (one stage).
// 8 warps as 2 x 4, each owning 64 x 32 outputs; lanes 8 x 4, each 8 x 8 as 2 x 2 pieces of 4x4.
extern "C" __global__ void __launch_bounds__(256)
matmul_v8(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    gemm_warptile<128, 128, 16, 64, 32, 8, 8, 1, false>(A, B, C, M, N, K);
}

// launch: as v8, with dynamic shared 2 x 16.25 = 32.5 KiB (two stages); 2 blocks per SM.
extern "C" __global__ void __launch_bounds__(256, 2)
matmul_v9(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K) {
    gemm_warptile<128, 128, 16, 64, 32, 8, 8, 2, true>(A, B, C, M, N, K);
}
#endif  // MM_ONLY_TUNED

#ifndef MM_BM
#define MM_BM 256
#endif
#ifndef MM_BN
#define MM_BN 128
#endif
#ifndef MM_BK
#define MM_BK 8
#endif
#ifndef MM_WM
#define MM_WM 128
#endif
#ifndef MM_WN
#define MM_WN 32
#endif
#ifndef MM_TM
#define MM_TM 16
#endif
#ifndef MM_TN
#define MM_TN 8
#endif
#ifndef MM_STAGES
#define MM_STAGES 2
#endif
#ifndef MM_ASYNC
#define MM_ASYNC 0
#endif
#ifndef MM_MINB
#define MM_MINB 1
#endif
#define MM_NT ((MM_BM / MM_WM) * (MM_BN / MM_WN) * 32)
// v10: the same kernel with its tile sizes set at compile time. The defaults above (the best
// configuration of the sweep on an H100: 256x128 block tile, BK = 8, warps of 128x32, 16x8
// outputs per thread, two stages staged through registers, one block per SM) must equal
// TUNED_DEFAULT in kernels/matmul.py (a test checks). Other sizes, e.g.
//   cb.load_cuda("matmul", options=("-DMM_BM=128", "-DMM_BN=256", ...))
// launch: block (MM_NT), grid (ceil(N/MM_BN), ceil(M/MM_BM)),
//         dynamic shared MM_STAGES x MM_BK x (MM_BM + 4 + MM_BN) x 4 bytes
//         (above 48 KiB the launcher raises the kernel's dynamic shared memory limit).
extern "C" __global__ void __launch_bounds__(MM_NT, MM_MINB)
matmul_v10(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K) {
    gemm_warptile<MM_BM, MM_BN, MM_BK, MM_WM, MM_WN, MM_TM, MM_TN, MM_STAGES, (MM_ASYNC != 0)>(
        A, B, C, M, N, K);
}

// ------------------------------------------------------------------------------------ v11

// The body of v11: v10's warp tiling and register-staged double buffering, with the pipeline
// kept full across the tile boundary.
//   1. The fragments (a lane's TM values of A and TN values of B at one k) are double-buffered
//      in registers: the float4 shared loads of step k + 1 are issued before the FMAs of step k.
//   2. One barrier per tile, placed before the LAST k-step: the next tile (loaded into
//      registers at the start of this one) is stored into the other stage, the block syncs,
//      and the first fragments of the next tile are loaded; the FMAs of the last k-step then
//      run while those loads are in flight. In v10 the FMA pipe drains at every tile: the
//      math ends, the stores and the barrier follow, and the first shared loads of the next
//      tile must land before any FMA can issue.
//      Why it is safe: stage s ^ 1 was last read (fragments of its steps 1..BK-1) before the
//      previous tile's barrier, so it may be overwritten after it; stage s, read during this
//      tile, is only overwritten after this tile's barrier, by the next tile.
//   3. A block tile that lies wholly inside A and B (and float4-aligned) loads with
//      unconditional float4 loads; only edge tiles take load4's guarded path.
template <int BM, int BN, int BK, int WM, int WN, int TM, int TN>
__device__ __forceinline__ void gemm_fragpipe(const float* __restrict__ A,
                                              const float* __restrict__ B, float* __restrict__ C,
                                              int M, int N, int K) {
    constexpr int PAD = 4;
    constexpr int NT = (BM / WM) * (BN / WN) * 32;
    constexpr int LR = WM / TM, LC = WN / TN;
    static_assert(LR * LC == 32, "a warp tile must hold 32 lanes: (WM/TM) * (WN/TN) == 32");
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0, "TM, TN, BK: multiples of 4");
    static_assert(BM % WM == 0 && BN % WN == 0, "the warp tile must divide the block tile");
    constexpr int A_IT = BM * BK / 4 / NT, B_IT = BK * BN / 4 / NT;   // float4 per thread
    static_assert(A_IT * NT * 4 == BM * BK && B_IT * NT * 4 == BK * BN,
                  "each thread must load a whole number of float4 of each tile");
    constexpr int AS = BK * (BM + PAD), BS = BK * BN, STAGE = AS + BS;   // floats
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    const int lr = lane / LC, lc = lane % LC;
    const bool vecA = (K % 4 == 0) && aligned16(A);
    const bool vecB = (N % 4 == 0) && aligned16(B);
    const bool vecC = (N % 4 == 0) && aligned16(C);
    // rows of A and columns of B of this block lie wholly inside the matrices
    const bool inside = vecA && vecB && m0 + BM <= M && n0 + BN <= N;
    const int ntiles = (K + BK - 1) / BK;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    float4 ra_st[A_IT], rb_st[B_IT];                // the next tile, on its way to shared
    auto load_regs = [&](int t) {
        const int k0 = t * BK;
        if (inside && k0 + BK <= K) {               // uniform per block and tile
#pragma unroll
            for (int l = 0; l < A_IT; ++l) {
                int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
                ra_st[l] = *reinterpret_cast<const float4*>(A + (m0 + r) * K + k0 + c);
            }
#pragma unroll
            for (int l = 0; l < B_IT; ++l) {
                int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
                rb_st[l] = *reinterpret_cast<const float4*>(B + (k0 + r) * N + n0 + c);
            }
        } else {
#pragma unroll
            for (int l = 0; l < A_IT; ++l) {
                int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
                ra_st[l] = load4(A, m0 + r, k0 + c, M, K, K, vecA);
            }
#pragma unroll
            for (int l = 0; l < B_IT; ++l) {
                int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
                rb_st[l] = load4(B, k0 + r, n0 + c, K, N, N, vecB);
            }
        }
    };
    auto store_regs = [&](int s) {
        float* As = smem + s * STAGE;
        float* Bs = As + AS;
#pragma unroll
        for (int l = 0; l < A_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
            As[(c + 0) * (BM + PAD) + r] = ra_st[l].x;          // transposed on the way in
            As[(c + 1) * (BM + PAD) + r] = ra_st[l].y;
            As[(c + 2) * (BM + PAD) + r] = ra_st[l].z;
            As[(c + 3) * (BM + PAD) + r] = ra_st[l].w;
        }
#pragma unroll
        for (int l = 0; l < B_IT; ++l) {
            int idx = tid + l * NT, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[r * BN + c]) = rb_st[l];
        }
    };
    // the fragments of step k of stage s, into fa / fb (float4 shared loads, conflict-free)
    float fa[2][TM], fb[2][TN];
    auto load_frag = [&](int s, int k, float* a, float* b) {
        const float* As = smem + s * STAGE;
        const float* Bs = As + AS;
#pragma unroll
        for (int i = 0; i < TM / 4; ++i) {
            float4 x = *reinterpret_cast<const float4*>(
                &As[k * (BM + PAD) + wm + i * LR * 4 + lr * 4]);
            a[4 * i + 0] = x.x; a[4 * i + 1] = x.y; a[4 * i + 2] = x.z; a[4 * i + 3] = x.w;
        }
#pragma unroll
        for (int j = 0; j < TN / 4; ++j) {
            float4 y = *reinterpret_cast<const float4*>(&Bs[k * BN + wn + j * LC * 4 + lc * 4]);
            b[4 * j + 0] = y.x; b[4 * j + 1] = y.y; b[4 * j + 2] = y.z; b[4 * j + 3] = y.w;
        }
    };

    load_regs(0);
    store_regs(0);
    __syncthreads();
    load_frag(0, 0, fa[0], fb[0]);
    // No branch in the loop: after the last tile, load_regs reads nothing (a tile past K is
    // all zero-fill) and the stage written and read at its end is never used again. (A branch
    // around them would let the compiler sink the FMAs of the last step above the loads.)
    for (int t = 0; t < ntiles; ++t) {
        const int s = t & 1;
        load_regs(t + 1);                           // in flight during this tile's math
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const int cur = k & 1, nxt = cur ^ 1;   // compile-time after unrolling
            if (k < BK - 1) {
                load_frag(s, k + 1, fa[nxt], fb[nxt]);
            } else {                                // the last step: the tile boundary
                store_regs(s ^ 1);
                __syncthreads();
                load_frag(s ^ 1, 0, fa[nxt], fb[nxt]);
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(fa[cur][i], fb[cur][j], acc[i][j]);
        }
    }

    // --- epilogue: float4 stores of each 4x4 piece
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int r = m0 + wm + (i / 4) * LR * 4 + lr * 4 + i % 4;
#pragma unroll
        for (int j = 0; j < TN / 4; ++j) {
            int c = n0 + wn + j * LC * 4 + lc * 4;
            store4(C, r, c, M, N, N, vecC, make_float4(acc[i][4 * j], acc[i][4 * j + 1],
                                                       acc[i][4 * j + 2], acc[i][4 * j + 3]));
        }
    }
}

// v11: v10's tile sizes (the same MM_* macros; the launcher passes v11's own defaults),
// fragments double-buffered in registers and one barrier per tile before its last k-step.
// launch: block (MM_NT), grid (ceil(N/MM_BN), ceil(M/MM_BM)),
//         dynamic shared 2 x MM_BK x (MM_BM + 4 + MM_BN) x 4 bytes (always two stages).
extern "C" __global__ void __launch_bounds__(MM_NT, MM_MINB)
matmul_v11(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K) {
    gemm_fragpipe<MM_BM, MM_BN, MM_BK, MM_WM, MM_WN, MM_TM, MM_TN>(A, B, C, M, N, K);
}
