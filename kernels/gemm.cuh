// gemm.cuh: the GEMM building blocks shared by hgemm.cu (16-bit inputs) and igemm.cu (8-bit
// inputs), written once and templated over the element type. Inlined by cudabook.load_cuda (and
// found by nvcc through -I kernels/).
//
//   chunk_index<SWZ, T>(r, c)   element offset of 16-byte chunk c of row r in a shared tile of
//                               128-byte rows (64 fp16 or 128 int8 / fp8 values); SWZ: chunk c
//                               stored at c ^ (r % 8), the XOR swizzle (the layout TMA's 128-byte
//                               swizzle writes and wgmma reads)
//   load_tile<ROWS, THREADS, SWZ, ASYNC>(tile, X, R, K, r0, k0)
//                               rows [r0, r0 + ROWS) x 128 bytes from column k0 of X into a
//                               shared tile, zeros outside X, by cp.async (ASYNC) or through
//                               registers: hgemm v3-v7 and v10's edge blocks, igemm v2, v3 and
//                               fp8gemm v1, v2
//   tma_ws_gemm<...>(...)       the warp-specialised TMA loop: one producer warpgroup, two
//                               consumer warpgroups, a ring of stages guarded by mbarriers
//                               (hgemm_v8, v9's hgemm_tma_t, fp8gemm_v3); sm_90a
//   tma_ws_loop<...>(...)       the same loop with the loads and the split of K given by the
//                               caller: any operand layout (gemm_train.cu); sm_90a
#pragma once
#include "mma.cuh"

// Element offset of 16-byte chunk c (0..7) of row r in a shared tile of 128-byte rows of T:
// plain, or swizzled (SWZ: chunk c stored at c ^ (r % 8)). Eight rows read by one ldmatrix then
// fall on eight different 16-byte bank groups instead of all on the same one.
template <bool SWZ, typename T>
__device__ __forceinline__ int chunk_index(int r, int c) {
    constexpr int E = 16 / sizeof(T);              // elements per chunk
    return r * (8 * E) + (SWZ ? (c ^ (r & 7)) : c) * E;
}

// Copy rows [r0, r0 + ROWS) x columns [k0, k0 + 128 bytes) of X (R x K elements of T,
// row-major) into a shared tile, 16 bytes per copy, zeros outside X. ASYNC: cp.async (sm_80+);
// else through registers.
template <int ROWS, int THREADS, bool SWZ, bool ASYNC, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* X, int R, int K, int r0, int k0) {
    constexpr int E = 16 / sizeof(T);
    static_assert((ROWS * 8) % THREADS == 0, "chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * 8 / THREADS; i++) {
        const int e = threadIdx.x + i * THREADS, r = e >> 3, c = e & 7;
        const bool ok = r0 + r < R && k0 + c * E < K;
        const T* src = X + (ok ? (size_t)(r0 + r) * K + k0 + c * E : 0);
        T* dst = tile + chunk_index<SWZ, T>(r, c);
        if constexpr (ASYNC) {
            cp_async_16_zfill(dst, src, ok);
        } else {
            *reinterpret_cast<uint4*>(dst) =
                ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
        }
    }
}

// The loop of tma_ws_gemm (below, where it is described), for any operand layout and a split of
// K (gemm_train.cu). Tiles are taken in tile_of's order; the first `whole` of them are one work
// unit each (all of K), the other rem = tiles - whole are cut into `splits` units each: unit
// whole + s * rem + i is split s of tile whole + i and covers the k-tiles [s kts, min(KT,
// (s + 1) kts)), kts = ceil(KT / splits). (whole = tiles or splits = 1: no split. A persistent
// grid of one block per SM does the whole tiles in full waves and shares the last, partial wave's
// tiles out in pieces: the tail of a wave costs 1 / splits of a tile.)
// The producer calls load(sa, sb, bar, bm, bn, kt) to issue the TMA copies of k-tile kt of
// tile (bm, bn) into the stage's A and B buffers, STAGE_BYTES in all (zero-filled bytes count);
// each consumer thread calls make_store(c, tid) once, then store(d, bm, bn, split, i) per unit:
// split -1 for a whole tile, else split s of the i-th split tile (i = t - whole).
template <int BN, int STAGES, bool PERSIST, int GROUP, bool PROMOTE, class E, class L, class F,
          class G>
__device__ __forceinline__ void tma_ws_loop(E* As, E* Bs, unsigned long long* full,
                                            unsigned long long* empty, int M, int N, int K,
                                            int whole, int splits, L load, F stage,
                                            G make_store) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128, BK = 128 / sizeof(E);   // k-tiles of 128 bytes
    constexpr unsigned STAGE_BYTES = (BM + BN) * BK * sizeof(E);   // zero-filled bytes count too
    constexpr unsigned A_STAGE = BM * BK, B_STAGE = BN * BK;        // elements of E per stage
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int tiles = tiles_m * tiles_n, KT = (K + BK - 1) / BK;
    whole = min(whole, tiles);
    const int rem = tiles - whole, kts = (KT + splits - 1) / splits;
    const int units = whole + rem * splits;
    // unit u -> tile t (tile_of's order), its k-tiles [k0, k1), split (-1: whole)
    auto unit = [&](int u, int& t, int& k0, int& k1, int& split) {
        if (u < whole || splits == 1) {
            t = u, k0 = 0, k1 = KT, split = -1;
        } else {
            split = (u - whole) / rem;
            t = whole + (u - whole) % rem;
            k0 = split * kts, k1 = min(KT, k0 + kts);
        }
    };
    const int step = PERSIST ? gridDim.x : units;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);   // the producer's arrive (+ the TMA bytes)
            mbar_init(&empty[s], 2);  // one arrive per consumer warpgroup
        }
        fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<40>();
        if (tid == 0) {
            int it = 0;   // stage uses so far: stage it % STAGES, its use number it / STAGES
            for (int u = blockIdx.x; u < units; u += step) {
                int bm, bn, t, k0, k1, split;
                unit(u, t, k0, k1, split);
                tile_of<GROUP>(t, tiles_m, tiles_n, bm, bn);
                for (int kt = k0; kt < k1; kt++, it++) {
                    const int s = it % STAGES, use = it / STAGES;
                    if (use > 0) mbar_wait(&empty[s], (use - 1) & 1);   // consumers released it
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    load(As + s * A_STAGE, Bs + s * B_STAGE, &full[s], bm, bn, kt);
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int c = wg - 1;   // this consumer's 64 rows of the 128-row tile
        auto store = make_store(c, tid);
        int it = 0;
        for (int u = blockIdx.x; u < units; u += step) {
            int bm, bn, t, k0, k1, split;
            unit(u, t, k0, k1, split);
            tile_of<GROUP>(t, tiles_m, tiles_n, bm, bn);
            float d[BN / 2], acc[PROMOTE ? BN / 2 : 1];
#pragma unroll
            for (int i = 0; i < BN / 2; i++) d[i] = 0.0f;
            if constexpr (PROMOTE) {
#pragma unroll
                for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
            }
            int prev = -1;
            for (int kt = k0; kt < k1; kt++, it++) {
                const int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                const E* a = As + s * A_STAGE + c * 64 * BK;   // this consumer's 64 rows
                const E* b = Bs + s * B_STAGE;
                wgmma_fence();
                stage(d, a, b);
                wgmma_commit();
                if constexpr (PROMOTE) {
                    wgmma_wait<0>();
                    if (tid == 0) mbar_arrive(&empty[s]);
#pragma unroll
                    for (int i = 0; i < BN / 2; i++) {   // the k-tile's sums into fp32
                        acc[i] += d[i];
                        d[i] = 0.0f;
                    }
                } else {
                    wgmma_wait<1>();      // the previous stage's wgmma are done: release it
                    if (prev >= 0 && tid == 0) mbar_arrive(&empty[prev]);
                    prev = s;
                }
            }
            if constexpr (PROMOTE) {
#pragma unroll
                for (int i = 0; i < BN / 2; i++) d[i] = acc[i];
            } else {
                wgmma_wait<0>();
                if (tid == 0 && prev >= 0) mbar_arrive(&empty[prev]);
            }
            store(d, bm, bn, split, t - whole);
        }
    }
#endif
}

// The warp-specialised GEMM loop (sm_90a): C = A @ B^T, A (M, K) and B (N, K) of elements E read
// by TMA through tensor maps ta, tb (128-byte swizzle, boxes of BK = 128 bytes x 128 rows of A,
// x BN rows of B, zeros outside the matrices) into a ring of STAGES stages: As holds the
// STAGES A tiles (128 x BK), Bs the STAGES B tiles (BN x BK), both 1024-byte aligned in dynamic
// shared memory; full[STAGES] and empty[STAGES] are the stages' mbarriers (shared memory).
// 384 threads = 3 warpgroups. Warpgroup 0 is the producer: after giving most of its registers
// away (setmaxnreg.dec), one thread issues the TMA copies of A and B into stage it % STAGES;
// full[s] completes when the stage's bytes (zero-filled ones included) have landed. Warpgroups 1
// and 2 are consumers (setmaxnreg.inc), 64 rows of the 128-row tile each: per k-tile a consumer
// waits on full[s], issues the stage's wgmma, stage(d, a, b) (a: its 64 rows of the A tile, b:
// the B tile), and arrives on empty[s] once the tensor cores are done with the stage. Without
// PROMOTE it keeps one wgmma group in flight (wgmma_wait<1>) and releases the previous stage.
// PROMOTE: each k-tile's products start from zero in d and are waited for (wgmma_wait<0>), the
// stage is released and d is added into fp32 registers (fp8's tensor-core accumulator is
// shorter than fp32). PERSIST: a grid of one block per SM walks the tiles, so the producer
// fetches the next tile while the consumers store this one; tiles are ordered GROUP tile rows
// at a time (tile_of: L2 reuse). Each consumer thread calls make_store(c, tid) once (c: consumer
// 0 or 1, tid: 0..127 in its warpgroup), then store(d, bm, bn) per tile (bm, bn) with its BN / 2
// accumulators (layout: mma.cuh, wgmma accumulators).
template <int BN, int STAGES, bool PERSIST, int GROUP, bool PROMOTE, class E, class F, class G>
__device__ __forceinline__ void tma_ws_gemm(const TmaDesc& ta, const TmaDesc& tb, E* As, E* Bs,
                                            unsigned long long* full, unsigned long long* empty,
                                            int M, int N, int K, F stage, G make_store) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128, BK = 128 / sizeof(E);
    tma_ws_loop<BN, STAGES, PERSIST, GROUP, PROMOTE>(
        As, Bs, full, empty, M, N, K, 1 << 30, 1,
        [&](E* sa, E* sb, unsigned long long* bar, int bm, int bn, int kt) {
            tma_load_2d(sa, &ta, bar, kt * BK, bm * BM);
            tma_load_2d(sb, &tb, bar, kt * BK, bn * BN);
        },
        stage,
        [&](int c, int tid) {
            auto store = make_store(c, tid);
            return [=](const float* d, int bm, int bn, int, int) { store(d, bm, bn); };
        });
#endif
}
