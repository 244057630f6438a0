// gemm_train.cu: the three products of a linear layer's training step on Hopper's tensor cores
// (wgmma, sm_90a), 16-bit inputs (bf16 or fp16), fp32 accumulation, with no transposed copy of
// any operand. For a layer y = x W^T, x (M, K) and W (N, K), both row-major:
//
//   layout  product          A (rows of C x reduction)      B (columns of C x reduction)
//   "nt"    y  = x W^T       x  stored (M, K): K-major       W  stored (N, K): K-major
//   "nn"    dx = dy W        dy stored (M, N): K-major       W  stored (N, K) = (reduction, cols):
//                                                            MN-major
//   "tn"    dW = dy^T x      dy stored (M, N) = (reduction,  x  stored (M, K) = (reduction, cols):
//                            rows): MN-major                 MN-major
//
// (the names read like BLAS's for C = op(A) op(B) with column-major storage; here: "nt" is what
// hgemm computes, C = A B^T). A K-major tile is what hgemm's kernels read: rows of the tile
// along the reduction, 128 bytes (64 values) per row, 128-byte swizzle. An MN-major tile is the
// transpose as it lies in memory: TMA copies boxes of 64 reduction rows x 64 values of M (or N),
// and wgmma reads them with its transpose bit set (imm-trans-a / imm-trans-b) through a
// descriptor whose leading offset steps from one 64-wide box to the next (mma.cuh:
// wgmma_desc_sw128_mn). So the backward of a linear layer reads dy, W and x where they are,
// and the transposes a C = A B^T-only GEMM needs (chapter 13's first step) disappear.
//
//   gemm_train_v1  hgemm_v9's warp-specialised loop (gemm.cuh's tma_ws_loop: one TMA producer
//                  warpgroup, two consumer warpgroups of 64 rows, a ring of mbarrier-guarded
//                  stages, persistent grid) with the three layouts; one tile, 128 x 256;
//                  output rounded to 16 bits or stored as fp32                              sm_90a
//   gemm_train_v2  v1 with a tile width chosen per shape (128 or 256 columns), C written by
//                  TMA from a swizzled shared tile (a consumer hands its tile to the copy
//                  engine and goes on to the next while the stores drain), and the last,
//                  partial wave of tiles split over K (split-K on the tail: a weight gradient
//                  of 144 tiles on 132 SMs does 132 whole tiles, then 12 tiles in 11 pieces
//                  each, instead of a second wave of 12). Split s of a tile writes its fp32
//                  partial sums to a workspace and takes a ticket; the last of the tile's splits
//                  to arrive adds the partials in split order 0, 1, ..., S - 1 and stores C: no
//                  float atomics, so the result is bitwise the same on every run and for any
//                  arrival order                                                          sm_90a
//
// The kernel is one template, gemm_train_t<BN, STAGES, TA, TB, F32, EPI, SPLIT, T> (TA, TB: 1 =
// the operand is MN-major; F32: C is fp32, else T; EPI: the TMA-store epilogue, 16-bit C only;
// SPLIT: the split-K path compiled in, the launcher refusing splits > 1 without it),
// named by kernels/gemm_train_launch.py, which plans (BN, STAGES, whole, splits) per shape
// (config) and builds the tensor maps. Launch: a grid of min(units, SMs) blocks of 384 threads
// (persistent: a block walks the units, gemm.cuh's tma_ws_loop), dynamic shared memory
// STAGES (128 + BN) 128 + 1024 bytes, plus 2 BN 128 with EPI.
// Arguments: ta, tb, tc (TMA maps of A and B as they lie in memory, boxes: K-major 64 x 128 (A)
// or 64 x BN (B) rows, MN-major 64 x 64; of C (EPI), boxes of 64 x 64), C, work (splits x rem
// tiles of 128 x BN floats, rem = tiles - whole), tickets (2 rem ints, zero before the launch
// and left zero after), M, N, K, whole (tiles done whole), splits (pieces of each other tile).
// M, N, K >= 1; every stored row a multiple of 8 values (16 bytes, TMA), N even.
#include "mma.cuh"
#include "gemm.cuh"

extern __shared__ __align__(16) unsigned char gt_smem[];

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T> struct gt_bf16 { static constexpr bool value = false; };
template <> struct gt_bf16<__nv_bfloat16> { static constexpr bool value = true; };

// d += A (64 x 16) @ B (16 x BN), the layout (TA, TB) chosen at compile time.
template <int BN, int TA, int TB, typename T>
__device__ __forceinline__ void gt_wgmma(float* d, unsigned long long da, unsigned long long db) {
    static_assert(BN == 128 || BN == 256, "gemm_train tiles are 128 or 256 columns wide");
    static_assert(TA <= TB, "layouts: nt (0, 0), nn (0, 1), tn (1, 1)");
    constexpr bool B16 = gt_bf16<T>::value;
    if constexpr (TA == 0 && TB == 0) {
        if constexpr (BN == 256) { if constexpr (B16) wgmma_m64n256k16_bf16(d, da, db); else wgmma_m64n256k16_f16(d, da, db); }
        else { if constexpr (B16) wgmma_m64n128k16_bf16(d, da, db); else wgmma_m64n128k16_f16(d, da, db); }
    } else if constexpr (TA == 0) {
        if constexpr (BN == 256) { if constexpr (B16) wgmma_m64n256k16_nt_bf16(d, da, db); else wgmma_m64n256k16_nt_f16(d, da, db); }
        else { if constexpr (B16) wgmma_m64n128k16_nt_bf16(d, da, db); else wgmma_m64n128k16_nt_f16(d, da, db); }
    } else {
        if constexpr (BN == 256) { if constexpr (B16) wgmma_m64n256k16_tt_bf16(d, da, db); else wgmma_m64n256k16_tt_f16(d, da, db); }
        else { if constexpr (B16) wgmma_m64n128k16_tt_bf16(d, da, db); else wgmma_m64n128k16_tt_f16(d, da, db); }
    }
}

// The descriptor of k16 slice kk of a stage's tile at p: K-major, 16 values (32 bytes) along the
// 128-byte rows; MN-major, 16 rows of 128 bytes (2048 bytes) on, boxes of 64 x 64 values
// (8192 bytes) apart along M or N.
template <int TRANS, typename T>
__device__ __forceinline__ unsigned long long gt_desc(const T* p, int kk) {
    if constexpr (TRANS) return wgmma_desc_sw128_mn(p + kk * 16 * 64, 64 * 64 * sizeof(T));
    else return wgmma_desc_sw128(p + 16 * kk);
}

// Two fp32 accumulators (columns c, c + 1 of row r) to C: fp32 as a float2, else rounded to T.
template <bool F32, typename T>
__device__ __forceinline__ void gt_put(void* C, size_t at, float x, float y) {
    if constexpr (F32) {
        *reinterpret_cast<float2*>(static_cast<float*>(C) + at) = make_float2(x, y);
    } else {
        *reinterpret_cast<unsigned*>(static_cast<T*>(C) + at) =
            gt_bf16<T>::value ? pack_bf162(x, y) : pack_half2(x, y);
    }
}
#endif

// One consumer's 64 x BN accumulators rounded to T into its staging tile (BN / 64 boxes of 64 rows
// x 128 bytes, TMA's 128-byte swizzle: pair j of row r at chunk (j % 8) ^ (r % 8) of box j / 8),
// then written out by TMA, one box at a time (rows and columns outside C are not written).
// The staging tile is reused per tile: the previous tile's stores must have read it first.
template <int BN, typename T>
__device__ __forceinline__ void gt_store_tma(const TmaDesc* tc, unsigned char* cs, const float* d,
                                             int row0, int col0, int c, int tid) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int w = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
    if (tid == 0) bulk_wait_read<0>();
    warpgroup_sync(1 + c);
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 16 * w + g + 8 * h;
            *reinterpret_cast<unsigned*>(cs + (j / 8) * 8192 + r * 128 + (((j % 8) ^ g) << 4) +
                                         4 * t) =
                gt_bf16<T>::value ? pack_bf162(d[4 * j + 2 * h], d[4 * j + 2 * h + 1])
                                  : pack_half2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    fence_proxy_async();                    // these writes, before the copy engine reads them
    warpgroup_sync(1 + c);
    if (tid == 0) {
#pragma unroll
        for (int b = 0; b < BN / 64; b++) tma_store_2d(tc, cs + b * 8192, col0 + 64 * b, row0);
        bulk_commit();
    }
#endif
}

template <int BN, int STAGES, int TA, int TB, bool F32, bool EPI, bool SPLIT, typename T>
__global__ void __launch_bounds__(384, 1)
gemm_train_t(const __grid_constant__ TmaDesc ta, const __grid_constant__ TmaDesc tb,
             const __grid_constant__ TmaDesc tc, void* C, float* work, int* tickets, int M, int N,
             int K, int whole, int splits) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128, BK = 64;
    static_assert(!(EPI && F32), "the TMA-store epilogue stages 16-bit outputs");
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    __shared__ int last[2];                     // per consumer: this unit arrived last
    T* As = reinterpret_cast<T*>(align_1024(gt_smem));
    T* Bs = As + STAGES * BM * BK;
    unsigned char* Cs = reinterpret_cast<unsigned char*>(Bs + STAGES * BN * BK);  // EPI staging
    int* lst = last;                            // (a lambda copying an array would copy it)
    const TmaDesc* pc = &tc;                    // (and the descriptor must stay a parameter)
    tma_ws_loop<BN, STAGES, true, 8, false>(
        As, Bs, full, empty, M, N, K, whole, splits,
        [&](T* sa, T* sb, unsigned long long* bar, int bm, int bn, int kt) {
            if constexpr (TA) {                 // (K, M) in memory: two boxes of 64 x 64
                tma_load_2d(sa, &ta, bar, bm * BM, kt * BK);
                tma_load_2d(sa + 64 * BK, &ta, bar, bm * BM + 64, kt * BK);
            } else {
                tma_load_2d(sa, &ta, bar, kt * BK, bm * BM);
            }
            if constexpr (TB) {                 // (K, N) in memory: BN / 64 boxes of 64 x 64
#pragma unroll
                for (int i = 0; i < BN / 64; i++)
                    tma_load_2d(sb + i * 64 * BK, &tb, bar, bn * BN + 64 * i, kt * BK);
            } else {
                tma_load_2d(sb, &tb, bar, kt * BK, bn * BN);
            }
        },
        [](float* d, const T* a, const T* b) {  // a: this consumer's 64 rows (box c when TA)
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                gt_wgmma<BN, TA, TB, T>(d, gt_desc<TA>(a, kk), gt_desc<TB>(b, kk));
        },
        [&](int c, int tid) {
            const int w = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
            const int lr = c * 64 + 16 * w + g;          // this thread's first row in the tile
            unsigned char* cs = Cs + c * BN * 128;       // this consumer's staging tile
            return [=](float* d, int bm, int bn, int split, int idx) {
                const int r0 = bm * BM + lr, c0 = bn * BN + 2 * t;
                auto put = [&]() {                       // C from registers, ragged edges skipped
#pragma unroll
                    for (int j = 0; j < BN / 8; j++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int r = r0 + 8 * h, col = c0 + 8 * j;
                            if (r < M && col < N)
                                gt_put<F32, T>(C, (size_t)r * N + col, d[4 * j + 2 * h],
                                               d[4 * j + 2 * h + 1]);
                        }
                };
                if (!SPLIT || split < 0) {               // a whole tile: C straight away
                    if constexpr (EPI)
                        gt_store_tma<BN, T>(pc, cs, d, bm * BM + c * 64, bn * BN, c, tid);
                    else
                        put();
                    return;
                }
                if constexpr (!SPLIT) return;
                // split s of split tile idx: its 128 x BN fp32 partials to slot s * rem + idx of
                // the workspace (a dense tile), then a ticket; the last of the tile's splits to
                // arrive reads all the partials back in split order and stores C
                const int tiles = ((M + BM - 1) / BM) * ((N + BN - 1) / BN);
                const int rem = tiles - min(whole, tiles);
                constexpr size_t TILE = (size_t)BM * BN;
                const int lc = 2 * t;
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        __stcg(reinterpret_cast<float2*>(work + (split * rem + idx) * TILE +
                                                         (lr + 8 * h) * BN + lc + 8 * j),
                               make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
                __threadfence();
                warpgroup_sync(1 + c);
                int* ticket = tickets + 2 * idx + c;
                if (tid == 0) lst[c] = atomicAdd(ticket, 1) == splits - 1;
                warpgroup_sync(1 + c);
                if (!lst[c]) return;
                __threadfence();
                for (int s = 0; s < splits; s++) {       // in split order: the same bits always
                    const float* p = work + (s * rem + idx) * TILE;
#pragma unroll
                    for (int j = 0; j < BN / 8; j++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const float2 v = __ldcg(reinterpret_cast<const float2*>(
                                p + (lr + 8 * h) * BN + lc + 8 * j));
                            d[4 * j + 2 * h] = s ? d[4 * j + 2 * h] + v.x : v.x;
                            d[4 * j + 2 * h + 1] = s ? d[4 * j + 2 * h + 1] + v.y : v.y;
                        }
                }
                put();
                if (tid == 0) *ticket = 0;      // ready for the next launch
            };
        });
    if constexpr (EPI) {
        if (threadIdx.x >= 128 && (threadIdx.x & 127) == 0) bulk_wait<0>();   // stores done
    }
#endif
}
