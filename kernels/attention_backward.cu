// attention_backward.cu: gradients of O = softmax(scale * Q K^T) V (Chapter 9).
//
// Inputs as in attention_forward.cu: Q (BH, Nq, D), K and V (BH, Nk, D), O and dO (BH, Nq, D),
// lse (BH, Nq) float32 from the forward. Outputs dQ (BH, Nq, D), dK and dV (BH, Nk, D).
// Nothing N x N is stored: P is recomputed tile by tile from Q, K and the saved lse,
//     P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - Di),  Di = rowsum(dO * O),
//     dQ = scale dS K,  dK = scale dS^T Q
// (Di = sum_j P[i, j] dP[i, j], the softmax's backward, is cheaper as rowsum(dO * O)).
//
// versions, simplest first (each line: what changed)
//   attention_bwd_v1_*   fp32, three kernels: preprocess (Di), dkdv (one block per 32 keys, loops
//                        over the queries: dK, dV in registers, no atomics) and dq (one block per
//                        32 queries, loops over the keys). S and dP are computed twice, once per
//                        kernel, which buys a deterministic dQ without atomics
//   attention_bwd_v2_*   tensor cores (mma.sync, fp16/bf16, fp32 accumulate), the FA2 split: one
//                        block per 128 keys holds K, V and dK, dV; it loops over query tiles (64
//                        rows at D = 128, 128 at D = 64; double-buffered by cp.async), computes
//                        S^T, dP^T, dV, dK with the keys as
//                        the rows of every product, puts dS^T in shared memory and adds its share
//                        of dQ = dS K into a float32 buffer with atomicAdd. A last kernel scales
//                        dQ and rounds it to 16 bits
//   attention_bwd_v2_*_d{D}_{BC}x{BR}s{STAGES}   the same kernel with smaller tiles for GPUs
//                        with less shared memory per block (the launcher picks the largest that
//                        fits: L4 / A10 / RTX 30-40 99 KiB, T4 64 KiB); STAGES = 1 loads the next
//                        query tile into the one buffer while dQ is computed, not during the tile
//   attention_bwd_v3_*   Hopper (sm_90a): the same split with every product on wgmma. K, V, and a
//                        2-stage ring of Q, dO and the statistics arrive by TMA and the copy engine
//                        (a producer warpgroup, mbarriers); two consumer warpgroups own 64 keys
//                        each; S^T, dP^T from shared memory, dV and dK with P^T and dS^T straight
//                        from registers, dQ = dS K from dS^T in shared memory (both operands
//                        MN-major). Grouped-query heads: a block sums dK, dV over its group.
//                        At D = 128, dV's product is issued as soon as P^T is ready and runs
//                        while dS^T is computed (EARLY_DV); at D = 64 that order spills and loses
//
// work (non-causal): 10 Nq Nk D flops (five products: S, dP, dV, dK, dQ); causal about half.
// Each version's kernels sit inside #if !defined(CB_ONLY) || defined(CB_ONLY_attention_bwd_vN):
// the launcher compiles the one version it launches (cudabook.compile.module(..., only=...)).
#include "attention.cuh"

#if !defined(CB_ONLY) || defined(CB_ONLY_attention_bwd_v1)
// ======================================================================================= v1
// launch: block 128 (4 warps, one row each), grid ceil(BH * Nq / 4). Di = sum_c dO[i, c] O[i, c].
extern "C" __global__ void attention_bwd_v1_preprocess(const float* __restrict__ O,
                                                       const float* __restrict__ dO,
                                                       float* __restrict__ Di, int rows, int D) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    float acc = 0.f;
    for (int c = lane; c < D; c += 32) acc += O[(size_t)r * D + c] * dO[(size_t)r * D + c];
    acc = warp_sum(acc);
    if (lane == 0) Di[r] = acc;
}
#endif

// launch: block 128 = 32 keys x 4 threads, grid (ceil(Nk / 32), BH), static shared memory
// 2 * 32 * D + 64 floats. Thread (r = tid / 4, part) holds elements part, part + 4, ... of its
// key's k, v, dk and dv (the interleaving of attention_v2). Per query i of a tile (Q, dO, lse,
// Di in shared memory, read by every thread at once: broadcasts):
//   p = exp(scale q_i . k - lse_i),  dv += p dO_i,  dp = dO_i . v,  dk += p (dp - Di) q_i
template <int D>
__device__ __forceinline__ void bwd_dkdv_fp32(const float* __restrict__ Q,
                                              const float* __restrict__ K,
                                              const float* __restrict__ V,
                                              const float* __restrict__ dO,
                                              const float* __restrict__ lse,
                                              const float* __restrict__ Di, float* __restrict__ dK,
                                              float* __restrict__ dV, int Nq, int Nk, float scale,
                                              int causal) {
    constexpr int BR = 32, BC = 32, P = 4, DP = D / P;
    __shared__ float Qs[BR][D], dOs[BR][D], ls[BR], ds[BR];
    int r = threadIdx.x / P, part = threadIdx.x % P;
    int bh = blockIdx.y, key = blockIdx.x * BC + r;
    size_t kr = (size_t)bh * Nk + min(key, Nk - 1);
    float k[DP], v[DP], dk[DP], dv[DP];
#pragma unroll
    for (int c = 0; c < DP; c++) {
        k[c] = K[kr * D + part + P * c] * scale;
        v[c] = V[kr * D + part + P * c];
        dk[c] = dv[c] = 0.f;
    }
    int i_begin = causal ? (blockIdx.x * BC / BR) * BR : 0;   // causal: earlier queries see none
    for (int i0 = i_begin; i0 < Nq; i0 += BR) {
        __syncthreads();
        for (int e = threadIdx.x; e < BR * D; e += blockDim.x) {
            int ii = e / D, c = e % D;
            bool ok = i0 + ii < Nq;
            size_t g = ((size_t)bh * Nq + i0 + ii) * D + c;
            Qs[ii][c] = ok ? Q[g] : 0.f;
            dOs[ii][c] = ok ? dO[g] : 0.f;
        }
        if (threadIdx.x < BR) {
            bool ok = i0 + threadIdx.x < Nq;
            ls[threadIdx.x] = ok ? lse[(size_t)bh * Nq + i0 + threadIdx.x] : 0.f;
            ds[threadIdx.x] = ok ? Di[(size_t)bh * Nq + i0 + threadIdx.x] : 0.f;
        }
        __syncthreads();
        int n = min(BR, Nq - i0);
        for (int ii = 0; ii < n; ii++) {
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int c = 0; c < DP; c++) {
                s += k[c] * Qs[ii][part + P * c];
                dp += v[c] * dOs[ii][part + P * c];
            }
            s = quad_sum(s);                      // the key's 4 threads
            dp = quad_sum(dp);
            bool seen = key < Nk && !(causal && key > i0 + ii);
            float p = seen ? __expf(s - ls[ii]) : 0.f;
            float dsv = p * (dp - ds[ii]);
#pragma unroll
            for (int c = 0; c < DP; c++) {
                dv[c] += p * dOs[ii][part + P * c];
                dk[c] += dsv * Qs[ii][part + P * c];
            }
        }
    }
    if (key < Nk) {
#pragma unroll
        for (int c = 0; c < DP; c++) {
            dK[kr * D + part + P * c] = dk[c] * scale;
            dV[kr * D + part + P * c] = dv[c];
        }
    }
}

// launch: block 128 = 32 queries x 4 threads, grid (ceil(Nq / 32), BH), static shared memory
// 2 * 32 * D floats. The mirror image of dkdv: a query's q, dO and dq in registers, K and V
// tiles in shared memory; dq += p (dp - Di) k_j over the keys it sees.
template <int D>
__device__ __forceinline__ void bwd_dq_fp32(const float* __restrict__ Q, const float* __restrict__ K,
                                            const float* __restrict__ V,
                                            const float* __restrict__ dO,
                                            const float* __restrict__ lse,
                                            const float* __restrict__ Di, float* __restrict__ dQ,
                                            int Nq, int Nk, float scale, int causal) {
    constexpr int BR = 32, BC = 32, P = 4, DP = D / P;
    __shared__ float Ks[BC][D], Vs[BC][D];
    int r = threadIdx.x / P, part = threadIdx.x % P;
    int bh = blockIdx.y, row = blockIdx.x * BR + r;
    size_t qr = (size_t)bh * Nq + min(row, Nq - 1);
    float q[DP], g[DP], dq[DP];
#pragma unroll
    for (int c = 0; c < DP; c++) {
        q[c] = Q[qr * D + part + P * c] * scale;
        g[c] = dO[qr * D + part + P * c];
        dq[c] = 0.f;
    }
    float l = lse[qr], di = Di[qr];
    int kv_end = causal ? min(Nk, min(Nq, (int)(blockIdx.x + 1) * BR)) : Nk;
    for (int j0 = 0; j0 < kv_end; j0 += BC) {
        __syncthreads();
        for (int e = threadIdx.x; e < BC * D; e += blockDim.x) {
            int jj = e / D, c = e % D;
            bool ok = j0 + jj < Nk;
            size_t gi = ((size_t)bh * Nk + j0 + jj) * D + c;
            Ks[jj][c] = ok ? K[gi] : 0.f;
            Vs[jj][c] = ok ? V[gi] : 0.f;
        }
        __syncthreads();
        int n = min(BC, Nk - j0);
        for (int jj = 0; jj < n; jj++) {
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int c = 0; c < DP; c++) {
                s += q[c] * Ks[jj][part + P * c];
                dp += g[c] * Vs[jj][part + P * c];
            }
            s = quad_sum(s);                      // the query's 4 threads
            dp = quad_sum(dp);
            bool seen = !(causal && j0 + jj > row);
            float p = seen ? __expf(s - l) : 0.f;
            float dsv = p * (dp - di);
#pragma unroll
            for (int c = 0; c < DP; c++) dq[c] += dsv * Ks[jj][part + P * c];
        }
    }
    if (row < Nq) {
#pragma unroll
        for (int c = 0; c < DP; c++) dQ[qr * D + part + P * c] = dq[c] * scale;
    }
}

#define ATTN_BWD_V1(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attention_bwd_v1_dkdv_d##D(                \
        const float* Q, const float* K, const float* V, const float* dO, const float* lse,      \
        const float* Di, float* dK, float* dV, int Nq, int Nk, float scale, int causal) {        \
        bwd_dkdv_fp32<D>(Q, K, V, dO, lse, Di, dK, dV, Nq, Nk, scale, causal);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attention_bwd_v1_dq_d##D(                  \
        const float* Q, const float* K, const float* V, const float* dO, const float* lse,      \
        const float* Di, float* dQ, int Nq, int Nk, float scale, int causal) {                   \
        bwd_dq_fp32<D>(Q, K, V, dO, lse, Di, dQ, Nq, Nk, scale, causal);                          \
    }
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_bwd_v1)
ATTN_BWD_V1(64)
ATTN_BWD_V1(128)
#endif

// ======================================================================================= v2
// launch: block 128 (4 warps, one row each), grid ceil(BH * Nq / 4). Di = rowsum(dO * O) in
// fp32, and the row of the fp32 dQ accumulator zeroed (the main kernel adds into it).
template <typename T>
__device__ __forceinline__ void bwd_preprocess(const T* __restrict__ O, const T* __restrict__ dO,
                                               float* __restrict__ Di, float* __restrict__ dQacc,
                                               int rows, int D) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    float acc = 0.f;
    for (int c = lane; c < D; c += 32) {
        acc += Mma<T>::to_float(O[(size_t)r * D + c]) * Mma<T>::to_float(dO[(size_t)r * D + c]);
        dQacc[(size_t)r * D + c] = 0.f;
    }
    acc = warp_sum(acc);
    if (lane == 0) Di[r] = acc;
}

// attention_bwd_v3's preprocess. launch: block 128, grid ceil(BH * Nq_pad / 4), Nq_pad = Nq
// rounded up to the query tile: Di as bwd_preprocess, both statistics into padded rows that the
// copy engine can fetch a tile at a time (16-byte aligned, whole tiles): Di (0 past Nq) and
// lse2 = lse * log2(e) (+inf past Nq, so P = 0 for those queries). (v3's dQ accumulator is
// zeroed by a memset: it is laid out in tiles, below.)
template <typename T>
__device__ __forceinline__ void bwd_preprocess_padded(const T* __restrict__ O,
                                                      const T* __restrict__ dO,
                                                      const float* __restrict__ lse,
                                                      float* __restrict__ Di,
                                                      float* __restrict__ lse2, int BH, int Nq,
                                                      int Nq_pad, int D) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= BH * Nq_pad) return;
    const int bh = r / Nq_pad, i = r % Nq_pad;
    if (i >= Nq) {
        if (lane == 0) { Di[r] = 0.f; lse2[r] = INFINITY; }
        return;
    }
    const size_t row = (size_t)bh * Nq + i;
    float acc = 0.f;
    for (int c = lane; c < D; c += 32) {
        acc += Mma<T>::to_float(O[row * D + c]) * Mma<T>::to_float(dO[row * D + c]);
    }
    acc = warp_sum(acc);
    if (lane == 0) { Di[r] = acc; lse2[r] = lse[row] * ATTN_LOG2E; }
}

// launch: block 256, grid ceil(n / 256). dQ = scale * dQacc, rounded to 16 bits.
template <typename T>
__device__ __forceinline__ void bwd_convert(const float* __restrict__ dQacc, T* __restrict__ dQ,
                                            size_t n, float scale) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dQ[i] = Mma<T>::from_float(dQacc[i] * scale);
}

// launch: block NW * 32 = 2 BC, grid (ceil(Nk / BC), BH), dynamic shared memory
// (2 BC D + 2 STAGES BR D + BC BR) * 2 + 2 STAGES BR * 4 bytes (BC = 128, 2 stages: 130 KiB at
// D = 64 (BR = 128), 145 KiB at D = 128 (BR = 64): both need cc 8.0's 163 KiB; the smaller
// instantiations below fit 99 and 64 KiB).
// Warp w owns keys [16 w, 16 w + 16) of the block's BC = 16 NW: per query tile it computes
// S^T = K_w Q^T and dP^T = V_w dO^T (16 x BR accumulators each), P^T and dS^T from them, then
// dV += P^T dO and dK += dS^T Q with P^T and dS^T as A operands straight from the accumulators.
// dS^T goes to shared memory; after a barrier, warp w computes a 16 x (D / (NW / (BR / 16)))
// piece of dQ_i = dS K and adds it to dQacc with atomicAdd (other key blocks add theirs); with
// fewer warps than 16-row tiles of queries (NW < BR / 16), warp w takes row tiles w, w + NW, ...
// each 16 x D. STAGES = 2: Q, dO, lse, Di double-buffered, the next tile loads during this one;
// STAGES = 1: one buffer, refilled once the tile's last reader (the dS^T barrier) is past, so the
// load overlaps the dQ product only.
template <typename T, int D, int BC, int BR, int NW, int STAGES>
__device__ __forceinline__ void flash_bwd_mma(const T* __restrict__ Q, const T* __restrict__ K,
                                              const T* __restrict__ V, const T* __restrict__ dO,
                                              const float* __restrict__ lse,
                                              const float* __restrict__ Di,
                                              float* __restrict__ dQacc, T* __restrict__ dK,
                                              T* __restrict__ dV, int Nq, int Nk, float scale,
                                              int causal) {
    constexpr int NT = NW * 32, KD = D / 16, NQ = BR / 8, ND = D / 8;
    constexpr int QM = BR / 16, DG = NW >= QM ? NW / QM : 1, DC = D / DG;   // dQ split: QM row
    constexpr int UNITS = QM * DG;                                          // tiles x DG groups
    static_assert(BC == 16 * NW && UNITS % NW == 0 && DC % 16 == 0 && BR % 64 == 0 && NT >= BR,
                  "tile shape");
    static_assert(STAGES == 1 || STAGES == 2, "one or two query-tile buffers");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    T* Ks = reinterpret_cast<T*>(attn_smem);      // BC x D
    T* Vs = Ks + BC * D;                          // BC x D
    T* Qs = Vs + BC * D;                          // STAGES x BR x D (double buffer at 2)
    T* dOs = Qs + STAGES * BR * D;                // STAGES x BR x D
    T* dSs = dOs + STAGES * BR * D;               // BC x BR: dS^T, keys as rows
    float* ls = reinterpret_cast<float*>(dSs + BC * BR);   // STAGES x BR: lse in log2 units
    float* dis = ls + STAGES * BR;                // STAGES x BR: Di
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int bh = blockIdx.y, j0 = blockIdx.x * BC, kw = warp * 16;
    float scale_log2 = scale * ATTN_LOG2E;
    const T* Qh = Q + (size_t)bh * Nq * D;
    const T* dOh = dO + (size_t)bh * Nq * D;
    const float* lh = lse + (size_t)bh * Nq;
    const float* dh = Di + (size_t)bh * Nq;

    int i_begin = causal ? (j0 / BR) * BR : 0;    // causal: queries before j0 see none of these keys
    int n_tiles = Nq > i_begin ? ceil_div(Nq - i_begin, BR) : 0;
    auto fetch = [&](int i0, int buf) {           // the query tile i0 into buffer buf
        load_tile<T, BR, D, NT>(Qs + buf * BR * D, Qh, i0, Nq);
        load_tile<T, BR, D, NT>(dOs + buf * BR * D, dOh, i0, Nq);
        if (threadIdx.x < BR) {                   // past the end: lse = +inf makes P = 0 there
            int i = i0 + threadIdx.x;
            float l = i < Nq ? lh[i] : INFINITY;
            ls[buf * BR + threadIdx.x] = l == -INFINITY ? INFINITY : l * ATTN_LOG2E;
            dis[buf * BR + threadIdx.x] = i < Nq ? dh[i] : 0.f;
        }
    };
    load_tile<T, BC, D, NT>(Ks, K + (size_t)bh * Nk * D, j0, Nk);
    load_tile<T, BC, D, NT>(Vs, V + (size_t)bh * Nk * D, j0, Nk);
    if (n_tiles > 0) fetch(i_begin, 0);
    cp_async_commit();

    float dk[ND][4], dv[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[nd][e] = dv[nd][e] = 0.f;
    // per-lane ldmatrix addresses (see attention_forward.cu: k steps flip bit 5, d steps bit 4)
    unsigned ka_addr = smem_u32(Ks + swz<D>(kw + lane % 16, 8 * (lane / 16)));   // A = K_w
    unsigned va_addr = smem_u32(Vs + swz<D>(kw + lane % 16, 8 * (lane / 16)));   // A = V_w
    unsigned qb_off = 2 * swz<D>(lane % 8 + 8 * (lane / 16), 8 * ((lane / 8) % 2)); // B = Q^T, dO^T
    unsigned qt_off = 2 * swz<D>(lane % 8 + 8 * ((lane / 8) % 2), 8 * (lane / 16)); // B = Q, dO
    int qm = warp % QM, dg = warp / QM;           // this warp's (first) piece of dQ
    unsigned dsa_addr = smem_u32(dSs + swz<BR>(lane % 8 + 8 * (lane / 16), qm * 16 + 8 * ((lane / 8) % 2)));
    unsigned kb_addr = smem_u32(Ks + swz<D>(lane % 8 + 8 * ((lane / 8) % 2), dg * DC + 8 * (lane / 16)));

    for (int it = 0; it < n_tiles; it++) {
        int i0 = i_begin + it * BR, buf = STAGES == 2 ? it & 1 : 0;
        cp_async_wait<0>();
        __syncthreads();                          // tile it has landed; dSs and buffer buf^1 are free
        if (STAGES == 2 && it + 1 < n_tiles) {    // the next tile arrives during this one's math
            fetch(i0 + BR, buf ^ 1);
            cp_async_commit();
        }
        unsigned q_addr = smem_u32(Qs + buf * BR * D), do_addr = smem_u32(dOs + buf * BR * D);
        const float* lsb = ls + buf * BR;
        const float* dsb = dis + buf * BR;

        // S^T = K_w Q_i^T and dP^T = V_w dO_i^T: 16 keys x BR queries each
        float st[NQ][4], dpt[NQ][4];
#pragma unroll
        for (int nq = 0; nq < NQ; nq++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[nq][e] = dpt[nq][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            unsigned ak[4], av[4];
            ldmatrix_x4(ak, ka_addr ^ (kk << 5));
            ldmatrix_x4(av, va_addr ^ (kk << 5));
#pragma unroll
            for (int nq = 0; nq < NQ; nq += 2) {
                unsigned bq[4], bo[4];            // Q and dO are (N, K) with K contiguous
                ldmatrix_x4(bq, (q_addr + qb_off + nq * 8 * D * 2) ^ (kk << 5));
                ldmatrix_x4(bo, (do_addr + qb_off + nq * 8 * D * 2) ^ (kk << 5));
                Mma<T>::mma(st[nq], ak, bq);
                Mma<T>::mma(st[nq + 1], ak, bq + 2);
                Mma<T>::mma(dpt[nq], av, bo);
                Mma<T>::mma(dpt[nq + 1], av, bo + 2);
            }
        }
        // P^T = exp2(S^T scale log2e - lse2) and dS^T = P^T (dP^T - Di), in place
        bool mask = j0 + BC > Nk || (causal && j0 + BC - 1 > i0);
#pragma unroll
        for (int nq = 0; nq < NQ; nq++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = j0 + kw + g + 8 * (e / 2), qc = nq * 8 + 2 * t + (e % 2);
                float p = exp2f(fmaf(st[nq][e], scale_log2, -lsb[qc]));
                if (mask && (key >= Nk || (causal && key > i0 + qc))) p = 0.f;
                st[nq][e] = p;
                dpt[nq][e] = p * (dpt[nq][e] - dsb[qc]);
            }
        // dV += P^T dO_i and dK += dS^T Q_i: k runs over the tile's queries
#pragma unroll
        for (int kq = 0; kq < BR / 16; kq++) {
            unsigned pa[4], sa[4];
            acc_to_a<T>(pa, st[2 * kq], st[2 * kq + 1]);
            acc_to_a<T>(sa, dpt[2 * kq], dpt[2 * kq + 1]);
#pragma unroll
            for (int nd = 0; nd < ND; nd += 2) {  // dO and Q as (K, N), N contiguous: .trans
                unsigned bo[4], bq[4];
                ldmatrix_x4_trans(bo, ((do_addr + qt_off) ^ (nd << 4)) + kq * 16 * D * 2);
                ldmatrix_x4_trans(bq, ((q_addr + qt_off) ^ (nd << 4)) + kq * 16 * D * 2);
                Mma<T>::mma(dv[nd], pa, bo);
                Mma<T>::mma(dv[nd + 1], pa, bo + 2);
                Mma<T>::mma(dk[nd], sa, bq);
                Mma<T>::mma(dk[nd + 1], sa, bq + 2);
            }
            // dS^T rows kw + g, kw + g + 8 of this 16-query slice, for the dQ product
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int rr = kw + g + 8 * h;
                *reinterpret_cast<unsigned*>(dSs + swz<BR>(rr, kq * 16 + 2 * t)) = sa[h];
                *reinterpret_cast<unsigned*>(dSs + swz<BR>(rr, kq * 16 + 8 + 2 * t)) = sa[2 + h];
            }
        }
        __syncthreads();                          // all of dS^T is in shared memory
        if (STAGES == 1 && it + 1 < n_tiles) {    // Q, dO, lse, Di of this tile are read: refill
            fetch(i0 + BR, 0);
            cp_async_commit();
        }
        // dQ_i[16 qm.., DC dg..] += dS K: A = dS, stored transposed (.trans); B = K as (K, N).
        // One pass when NW >= QM; else also the row tiles qm + NW, qm + 2 NW, ... (u > 0)
#pragma unroll
        for (int u = 0; u < UNITS / NW; u++) {
            float dq[DC / 8][4];
#pragma unroll
            for (int nd = 0; nd < DC / 8; nd++)
#pragma unroll
                for (int e = 0; e < 4; e++) dq[nd][e] = 0.f;
            int qmu = qm + u * NW;
            unsigned dsa = u == 0 ? dsa_addr
                : smem_u32(dSs + swz<BR>(lane % 8 + 8 * (lane / 16), qmu * 16 + 8 * ((lane / 8) % 2)));
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                unsigned a[4];
                ldmatrix_x4_trans(a, dsa + kk * 16 * BR * 2);
#pragma unroll
                for (int nd = 0; nd < DC / 8; nd += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, (kb_addr ^ (nd << 4)) + kk * 16 * D * 2);
                    Mma<T>::mma(dq[nd], a, b);
                    Mma<T>::mma(dq[nd + 1], a, b + 2);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = i0 + qmu * 16 + g + 8 * h;
                if (row < Nq) {
                    float* out = dQacc + ((size_t)bh * Nq + row) * D + dg * DC + 2 * t;
#pragma unroll
                    for (int nd = 0; nd < DC / 8; nd++) {
                        atomicAdd(out + nd * 8, dq[nd][2 * h]);
                        atomicAdd(out + nd * 8 + 1, dq[nd][2 * h + 1]);
                    }
                }
            }
        }
    }
    // dK = scale dS^T Q, dV: rows kw + g (+ 8) of the block, straight from the accumulators
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = j0 + kw + g + 8 * h;
        if (row < Nk) {
            size_t base = ((size_t)bh * Nk + row) * D + 2 * t;
            unsigned* pk = reinterpret_cast<unsigned*>(dK + base);
            unsigned* pv = reinterpret_cast<unsigned*>(dV + base);
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                pk[nd * 4] = Mma<T>::pack(dk[nd][2 * h] * scale, dk[nd][2 * h + 1] * scale);
                pv[nd * 4] = Mma<T>::pack(dv[nd][2 * h], dv[nd][2 * h + 1]);
            }
        }
    }
}

#define ATTN_BWD_V2_TYPE(TN, T)                                                                  \
    extern "C" __global__ void attention_bwd_v2_preprocess_##TN(                                 \
        const T* O, const T* dO, float* Di, float* dQacc, int rows, int D) {                     \
        bwd_preprocess<T>(O, dO, Di, dQacc, rows, D);                                            \
    }                                                                                            \
    extern "C" __global__ void attention_bwd_v2_convert_##TN(const float* dQacc, T* dQ,         \
                                                            size_t n, float scale) {             \
        bwd_convert<T>(dQacc, dQ, n, scale);                                                     \
    }
#define ATTN_BWD_V2_KERNEL(NAME, T, D, BC, BR, STAGES)                                           \
    extern "C" __global__ void __launch_bounds__(BC * 2) NAME(                                   \
        const T* Q, const T* K, const T* V, const T* dO, const float* lse, const float* Di,     \
        float* dQacc, T* dK, T* dV, int Nq, int Nk, float scale, int causal) {                   \
        flash_bwd_mma<T, D, BC, BR, BC / 16, STAGES>(Q, K, V, dO, lse, Di, dQacc, dK, dV, Nq, Nk, \
                                                     scale, causal);                             \
    }
// the kernels of GPUs with 163 KiB per block or more (A100, H100), two stages
#define ATTN_BWD_V2(TN, T, D, BC, BR) ATTN_BWD_V2_KERNEL(attention_bwd_v2_##TN##_d##D, T, D, BC, BR, 2)
// smaller tiles: attention_bwd_v2_f16_d128_64x64s1 is D = 128, BC = 64, BR = 64, one stage
#define ATTN_BWD_V2_FIT(TN, T, D, BC, BR, STAGES)                                                \
    ATTN_BWD_V2_KERNEL(attention_bwd_v2_##TN##_d##D##_##BC##x##BR##s##STAGES, T, D, BC, BR, STAGES)
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_bwd_v2)
ATTN_BWD_V2_TYPE(f16, __half)
ATTN_BWD_V2_TYPE(bf16, __nv_bfloat16)
ATTN_BWD_V2(f16, __half, 64, 128, 128)
ATTN_BWD_V2(bf16, __nv_bfloat16, 64, 128, 128)
ATTN_BWD_V2(f16, __half, 128, 128, 64)
ATTN_BWD_V2(bf16, __nv_bfloat16, 128, 128, 64)
// 99 KiB (L4, A10, RTX 30-40): 81 KiB at D = 64, 72.5 KiB at D = 128
ATTN_BWD_V2_FIT(f16, __half, 64, 128, 64, 2)
ATTN_BWD_V2_FIT(bf16, __nv_bfloat16, 64, 128, 64, 2)
ATTN_BWD_V2_FIT(f16, __half, 128, 64, 64, 1)
ATTN_BWD_V2_FIT(bf16, __nv_bfloat16, 128, 64, 64, 1)
// 64 KiB (T4; float16 only there, but the bfloat16 twins serve any GPU with this limit):
// 57 KiB at D = 64, 52.5 KiB at D = 128
ATTN_BWD_V2_FIT(f16, __half, 64, 64, 64, 2)
ATTN_BWD_V2_FIT(bf16, __nv_bfloat16, 64, 64, 64, 2)
ATTN_BWD_V2_FIT(f16, __half, 128, 32, 64, 1)
ATTN_BWD_V2_FIT(bf16, __nv_bfloat16, 128, 32, 64, 1)
#endif

// ======================================================================================= v3
// v3's fp32 dQ accumulator is laid out in tiles, so that a consumer's whole 64 x 64 piece of a
// query tile is 16 contiguous KiB that the copy engine adds with one reduction: for head bh and
// query tile qt (BR rows), 2 pieces of 4096 floats at (bh n_qt + qt) BR D; piece p holds rows
// 64 p .. of the tile at D = 64 (BR = 128), columns 64 p .. at D = 128 (BR = 64). Inside a piece,
// row r's 16-byte chunk c sits at chunk c ^ swz(r): the float4 stores that fill the piece in
// shared memory (rows r, r + 8 of a quad pair, chunks 2 j, 2 j + 1) then hit 8 different bank
// groups per 8 lanes. Rows past Nq hold zeros (P = 0 there).
__device__ __forceinline__ int dq_piece_index(int r, int cc) {
    const int swz = 2 * (2 * (r % 4) + (r / 8) % 2);
    return r * 64 + ((((cc >> 2) ^ swz)) << 2) + (cc & 3);
}
// launch: block 256, grid ceil(BH n_qt 2048 / 256), n_qt = ceil(Nq / BR). dQ (BH, Nq, D) =
// scale * the tiled accumulator. A query tile holds BR D = 8192 floats at either head dim, 2048
// 16-byte chunks: thread e takes chunk e % 2048 of tile e / 2048 (shifts, no 64-bit division),
// one float4 load (a chunk's 4 floats stay together under the swizzle) and one 8-byte store of
// 4 rounded values (4 single stores where dQ is not 8-byte aligned).
template <typename T>
__device__ __forceinline__ void bwd_convert_tiled(const float* __restrict__ dQacc,
                                                  T* __restrict__ dQ, int BH, int Nq, int D,
                                                  float scale) {
    const int BR = D == 64 ? 128 : 64, n_qt = ceil_div(Nq, BR);
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t tile = e >> 11;
    if (tile >= (size_t)BH * n_qt) return;
    const int q = (int)(e & 2047), bh = (int)(tile / n_qt), qt = (int)(tile % n_qt);
    const int rt = q / (D / 4), d = (q % (D / 4)) * 4, i = qt * BR + rt;
    if (i >= Nq) return;
    const int p = D == 64 ? rt / 64 : d / 64, r = D == 64 ? rt % 64 : rt, cc = d % 64;
    const float4 v = *reinterpret_cast<const float4*>(dQacc + tile * BR * D + p * 4096 +
                                                      dq_piece_index(r, cc));
    T* out = dQ + ((size_t)bh * Nq + i) * D + d;
    if ((reinterpret_cast<size_t>(dQ) & 7) == 0) {
        *reinterpret_cast<uint2*>(out) = make_uint2(Mma<T>::pack(v.x * scale, v.y * scale),
                                                    Mma<T>::pack(v.z * scale, v.w * scale));
    } else {
        out[0] = Mma<T>::from_float(v.x * scale);
        out[1] = Mma<T>::from_float(v.y * scale);
        out[2] = Mma<T>::from_float(v.z * scale);
        out[3] = Mma<T>::from_float(v.w * scale);
    }
}

// Hopper (sm_90a). launch: block 384 = 3 warpgroups, grid (ceil(Nk / 128), BH / G) where G =
// query heads per key/value head (1: ordinary attention; H: multi-query), dynamic shared memory
// (2 BC D + 2 ST BR D + 2 BC BR) * 2 + 2 * 64 * 64 * 4 + 1024 bytes: K and V, ST stages of Q and
// dO, two buffers of dS^T, each consumer's dQ piece, 1024 for alignment (BC = 128, ST = 2:
// 193 KiB at D = 64 with BR = 128 and at D = 128 with BR = 64). Q, K, V and dO arrive by TMA (tensor maps of (rows, D), boxes of 64
// columns, the 128-byte swizzle), as in attention_v4; lse and Di go into shared memory by plain
// loads of the producer's second warp.
//
// The FA2 split of attention_bwd_v2 with every product on wgmma. Warpgroup 0 is the producer:
// K and V of the block's 128 keys once, then Q_i, dO_i, lse_i, Di_i of each query tile into a
// ring of ST stages ("full" barrier: the bytes landed and the 32 statistics stores are done;
// "empty": both consumers are done with the stage). For grouped-query attention the block walks
// the query tiles of all G heads that share its K and V, so dK and dV are summed over the group
// in registers, without atomics. Warpgroups 1 and 2 are consumers: consumer c owns keys
// 64 c .. 64 c + 63 of the block and holds their dK and dV in registers. Per query tile:
//   S^T = K_c Q^T, dP^T = V_c dO^T             wgmma, both operands in shared (K-major)
//   P^T = exp2(S^T scale_log2 - lse_log2),  dS^T = P^T * (dP^T - Di)     (registers)
//   dV_c += P^T dO,  dK_c += dS^T Q            wgmma, A from registers, B = dO, Q as they lie
//                                              (N-major: no transpose); EARLY_DV: dV is issued
//                                              before dS^T is computed, and runs during it
//   dS^T -> shared (16 bits), both consumers meet (named barrier 1)
//   dQ_i += dS K                               wgmma, A = dS^T and B = K both MN-major in shared;
//                                              D = 64 (BR = 128): consumer c takes query rows
//                                              64 c .., D = 128 (BR = 64): columns 64 c ..
//   dQ_i's 64 x 64 piece: stored to shared memory (16 KiB per consumer), then the producer's
//   second warp adds it to the fp32 accumulator with one reduction of the copy engine
//   (cp.reduce.async.bulk: atomic in L2 with respect to the other key blocks adding theirs) and
//   hands the buffer back (mbarriers dq_full / dq_empty); attention_bwd_v3_convert scales,
//   rounds and un-tiles it afterwards. The _atomic kernels add the piece with float4 atomics
//   from the consumers instead.
// Two dS^T buffers alternate, so one barrier per tile suffices: a consumer overwrites a buffer
// two tiles later, after the other has passed the barrier that follows its own dQ wait.
// Causal: the block's first query tile is the one holding query k0 (query i sees keys j <= i),
// and only tiles that cross the diagonal, or the ragged ends, pay for the mask. Query rows past
// Nq read lse = +inf (P = 0); key rows past Nk are masked; neither is stored.
template <typename T, int D, int BR, int ST, bool BULK, bool EARLY_DV>
__device__ __forceinline__ void flash_bwd_wgmma(const TmaDesc& tq, const TmaDesc& tk,
                                                const TmaDesc& tv, const TmaDesc& tdo,
                                                const float* __restrict__ lse2,
                                                const float* __restrict__ Di,
                                                float* __restrict__ dQacc, T* __restrict__ dK,
                                                T* __restrict__ dV, int Nq, int Nk, float scale,
                                                int causal, int group) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BC = 128, SL = D / 64, NR = BR / 8, ND = D / 8, KR = BR / 16;
    static_assert((D == 64 && BR == 128) || (D == 128 && BR == 64), "tiles of the two head dims");
    constexpr unsigned KV_BYTES = 2 * BC * D * sizeof(T), QD_BYTES = 2 * BR * D * sizeof(T);
    __shared__ __align__(8) unsigned long long kvbar, full[ST], empty[ST], dq_full[2], dq_empty[2];
    __shared__ __align__(16) float lse_s[ST][BR], di_s[ST][BR];
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    // slab sl of a tile of R rows: R x 64 values at offset sl * R * 64 (the TMA boxes)
    T* Ks = reinterpret_cast<T*>(align_1024(attn_smem));
    T* Vs = Ks + BC * D;
    T* Qs = Vs + BC * D;                          // ST stages of BR x D
    T* dOs = Qs + ST * BR * D;                    // ST stages of BR x D
    T* dSs = dOs + ST * BR * D;                   // 2 buffers of dS^T: BC rows (keys) x BR
    float* dQs = reinterpret_cast<float*>(dSs + 2 * BC * BR);   // each consumer's dQ piece
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int bhk = blockIdx.y, k0 = blockIdx.x * BC;
    const int n_qt = ceil_div(Nq, BR), Nq_pad = n_qt * BR;
    const int qt0 = causal ? min(k0 / BR, n_qt) : 0;   // the first tile with a query >= k0
    const int per_head = n_qt - qt0, n_it = per_head * group;
    if (threadIdx.x == 0) {
        mbar_init(&kvbar, 1);
        for (int s = 0; s < ST; s++) {
            mbar_init(&full[s], 1);                // the producer's arrive (+ the bytes)
            mbar_init(&empty[s], 256);             // every consumer thread: each read lse, Di
        }
        for (int c = 0; c < 2; c++) {
            mbar_init(&dq_full[c], 128);           // consumer c's threads stored the piece
            mbar_init(&dq_empty[c], 1);            // the copy engine has read it
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {                                // ---------------------------------- producer
        setmaxnreg_dec<24>();
        if (tid == 0) {
            mbar_expect_tx(&kvbar, KV_BYTES);
            for (int sl = 0; sl < SL; sl++) {
                tma_load_2d(Ks + sl * BC * 64, &tk, &kvbar, 64 * sl, bhk * Nk + k0);
                tma_load_2d(Vs + sl * BC * 64, &tv, &kvbar, 64 * sl, bhk * Nk + k0);
            }
            for (int it = 0; it < n_it; it++) {
                const int s = it % ST, use = it / ST;
                const int bh = bhk * group + it / per_head, q0 = (qt0 + it % per_head) * BR;
                if (use > 0) mbar_wait(&empty[s], (use - 1) & 1);
                mbar_expect_tx(&full[s], QD_BYTES + 2 * BR * 4);
                for (int sl = 0; sl < SL; sl++) {
                    tma_load_2d(Qs + s * BR * D + sl * BR * 64, &tq, &full[s], 64 * sl, bh * Nq + q0);
                    tma_load_2d(dOs + s * BR * D + sl * BR * 64, &tdo, &full[s], 64 * sl,
                                bh * Nq + q0);
                }
                const size_t row = (size_t)bh * Nq_pad + q0;     // padded statistics rows
                bulk_load(lse_s[s], lse2 + row, BR * 4, &full[s]);
                bulk_load(di_s[s], Di + row, BR * 4, &full[s]);
            }
        } else if (BULK && tid == 32) {           // warp 1: each dQ piece into dQacc
            for (int it = 0; it < n_it; it++) {
                const int bh = bhk * group + it / per_head, qt = qt0 + it % per_head;
                for (int c = 0; c < 2; c++) {
                    mbar_wait(&dq_full[c], it & 1);
                    bulk_reduce_add_f32(dQacc + ((size_t)bh * n_qt + qt) * BR * D + c * 4096,
                                        dQs + c * 4096, 4096 * 4);
                    bulk_commit();
                    bulk_wait_read<0>();
                    mbar_arrive(&dq_empty[c]);
                }
            }
            bulk_wait<0>();                       // the last reductions are done
        }
        return;
    }
    setmaxnreg_inc<240>();                         // ---------------------------------- consumers
    const int c = wg - 1, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int kr = 64 * c + 16 * warp + g;        // this thread's key rows kr, kr + 8 (block)
    const float scale_log2 = scale * ATTN_LOG2E;
    float dv[D / 2], dk[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dv[i] = dk[i] = 0.f;
    mbar_wait(&kvbar, 0);

    float dq[32];
    // dq holds tile itq's 64 x 64 piece of dQ: into this consumer's shared buffer for the copy
    // engine (or, _atomic, straight into the accumulator). Lanes t and t ^ 1 trade halves so
    // that an even lane holds 4 neighbouring columns of its row rl and an odd lane those of row
    // rl + 8 (columns 8 j + 4 (t / 2) .. of the piece)
    auto store_dq = [&](int itq) {
        const int bh = bhk * group + itq / per_head, q0 = (qt0 + itq % per_head) * BR;
        const int rl = 16 * warp + g + 8 * (t & 1), cl = 4 * (t / 2);
        // dq_piece_index(rl, 8 j + cl) = rl 64 + 8 (j ^ f) + cl with f = swz(rl) / 2
        const int f = 2 * (rl % 4) + (rl / 8) % 2;
        float* piece = (BULK ? dQs + c * 4096
                             : dQacc + ((size_t)bh * n_qt + q0 / BR) * BR * D + c * 4096) +
                       rl * 64 + cl;
        if (BULK && itq > 0) mbar_wait(&dq_empty[c], (itq - 1) & 1);   // the last one was read
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // even t keeps its row-rl pair and takes its neighbour's; odd t the row-rl+8 ones
            const float s0 = (t & 1) ? dq[4 * j] : dq[4 * j + 2];
            const float s1 = (t & 1) ? dq[4 * j + 1] : dq[4 * j + 3];
            const float o0 = __shfl_xor_sync(0xffffffffu, s0, 1);
            const float o1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            const float4 v = (t & 1) ? make_float4(o0, o1, dq[4 * j + 2], dq[4 * j + 3])
                                     : make_float4(dq[4 * j], dq[4 * j + 1], o0, o1);
            float4* at = reinterpret_cast<float4*>(piece + 8 * (j ^ f));
            if constexpr (BULK) *at = v;
            else atomicAdd(at, v);                // _atomic: straight into global memory
        }
        if constexpr (BULK) {
            fence_proxy_async();                  // the stores, before the copy engine reads
            mbar_arrive(&dq_full[c]);
        }
    };

    for (int it = 0; it < n_it; it++) {
        const int s = it % ST, b = it & 1;
        const int q0 = (qt0 + it % per_head) * BR;
        const T* Qt = Qs + s * BR * D;
        const T* dOt = dOs + s * BR * D;
        T* dSt = dSs + b * BC * BR;
        float st[BR / 2], dpt[BR / 2];
#pragma unroll
        for (int i = 0; i < BR / 2; i++) st[i] = dpt[i] = 0.f;
        mbar_wait(&full[s], (it / ST) & 1);
        wgmma_fence();                            // S^T = K_c Q^T, then dP^T = V_c dO^T
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wg_ss<BR, T>(st, wgmma_desc_sw128(Ks + (kk / 4) * BC * 64 + c * 64 * 64 + 16 * (kk % 4)),
                         wgmma_desc_sw128(Qt + (kk / 4) * BR * 64 + 16 * (kk % 4)));
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wg_ss<BR, T>(dpt, wgmma_desc_sw128(Vs + (kk / 4) * BC * 64 + c * 64 * 64 + 16 * (kk % 4)),
                         wgmma_desc_sw128(dOt + (kk / 4) * BR * 64 + 16 * (kk % 4)));
        wgmma_commit();
        wgmma_wait<1>();                          // S^T is done (dP^T may still run)
        pin_all<BR / 2>(st);
        // P^T: rows are keys k0 + kr (+ 8), columns queries q0 + 8 j + 2 t (+ 1)
        const bool edge = k0 + BC > Nk || (causal && k0 + BC - 1 > q0);
#pragma unroll
        for (int j = 0; j < NR; j++) {
            const float2 l2 = *reinterpret_cast<const float2*>(&lse_s[s][8 * j + 2 * t]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = exp2f(fmaf(st[4 * j + e], scale_log2, -((e & 1) ? l2.y : l2.x)));
                if (edge) {
                    const int key = k0 + kr + 8 * (e / 2), query = q0 + 8 * j + 2 * t + (e & 1);
                    if (key >= Nk || (causal && key > query)) p = 0.f;
                }
                st[4 * j + e] = p;
            }
        }
        unsigned pa[KR][4], da[KR][4];            // P^T and dS^T as 16-bit A fragments
        if constexpr (EARLY_DV) {                 // dV += P^T dO runs while dS^T is computed
#pragma unroll
            for (int kk = 0; kk < KR; kk++) acc_to_a<T>(pa[kk], &st[8 * kk], &st[8 * kk + 4]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KR; kk++)
                wg_rs<D, T>(dv, pa[kk], wgmma_desc_sw128_mn(dOt + kk * 16 * 64, BR * 64 * sizeof(T)));
            wgmma_commit();
            wgmma_wait<1>();                      // dP^T is done (dV may still run)
        } else {
            wgmma_wait<0>();                      // dP^T is done
        }
        pin_all<BR / 2>(dpt);
#pragma unroll
        for (int j = 0; j < NR; j++) {
            const float2 d2 = *reinterpret_cast<const float2*>(&di_s[s][8 * j + 2 * t]);
#pragma unroll
            for (int e = 0; e < 4; e++)
                dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        }
#pragma unroll
        for (int kk = 0; kk < KR; kk++) {
            if constexpr (!EARLY_DV) acc_to_a<T>(pa[kk], &st[8 * kk], &st[8 * kk + 4]);
            acc_to_a<T>(da[kk], &dpt[8 * kk], &dpt[8 * kk + 4]);
        }
        wgmma_fence();                            // (dV += P^T dO), dK += dS^T Q
        if constexpr (!EARLY_DV) {
#pragma unroll
            for (int kk = 0; kk < KR; kk++)
                wg_rs<D, T>(dv, pa[kk], wgmma_desc_sw128_mn(dOt + kk * 16 * 64, BR * 64 * sizeof(T)));
        }
#pragma unroll
        for (int kk = 0; kk < KR; kk++)
            wg_rs<D, T>(dk, da[kk], wgmma_desc_sw128_mn(Qt + kk * 16 * 64, BR * 64 * sizeof(T)));
        wgmma_commit();
        // dS^T into shared: row kr (+ 8), query columns 16 kk + 2 t (+ 8), panels of 64 queries
        unsigned* d32 = reinterpret_cast<unsigned*>(dSt);
#pragma unroll
        for (int kk = 0; kk < KR; kk++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int row = kr + 8 * (r & 1), col = 16 * kk + 8 * (r / 2) + 2 * t;
                d32[((col / 64) * BC * 64 + swz<64>(row, col % 64)) / 2] = da[kk][r];
            }
        fence_proxy_async();                      // the stores, before wgmma reads them
        wgmma_wait<0>();                          // dV, dK done: P^T, dS^T registers are free
        pin_all<D / 2>(dv);
        pin_all<D / 2>(dk);
        pin_all<4 * KR>(&pa[0][0]);
        pin_all<4 * KR>(&da[0][0]);
        named_sync(1);                            // both consumers' halves of dS^T are in place
#pragma unroll
        for (int i = 0; i < 32; i++) dq[i] = 0.f;
        // D = 64: rows 64 c .. of dQ_i (panel c of dS^T), all 64 columns of K;
        // D = 128: all 64 rows (panel 0), columns 64 c .. (slab c of K)
        const T* As = dSt + (D == 64 ? c * BC * 64 : 0);
        const T* Bs = Ks + (D == 64 ? 0 : c * BC * 64);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++)
            wg_tt<T>(dq, wgmma_desc_sw128_mn(As + kk * 16 * 64, BC * 64 * sizeof(T)),
                     wgmma_desc_sw128_mn(Bs + kk * 16 * 64, BC * 64 * sizeof(T)));
        wgmma_commit();
        wgmma_wait<0>();
        pin_all<32>(dq);
        mbar_arrive(&empty[s]);                   // Q_i, dO_i, lse_i, Di_i are free
        store_dq(it);
    }
    // dK = scale dS^T Q and dV, rows k0 + kr (+ 8), summed over the group's heads
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = k0 + kr + 8 * h;
        if (row < Nk) {
            const size_t base = ((size_t)bhk * Nk + row) * D + 2 * t;
            unsigned* pk = reinterpret_cast<unsigned*>(dK + base);
            unsigned* pv = reinterpret_cast<unsigned*>(dV + base);
#pragma unroll
            for (int j = 0; j < ND; j++) {
                pk[j * 4] = Mma<T>::pack(dk[4 * j + 2 * h] * scale, dk[4 * j + 2 * h + 1] * scale);
                pv[j * 4] = Mma<T>::pack(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
            }
        }
    }
#endif
}

#define ATTN_BWD_V3_KERNEL(NAME, T, D, BR, BULK, EARLY_DV)                                       \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                   \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,                  \
        const __grid_constant__ TmaDesc tv, const __grid_constant__ TmaDesc tdo,                 \
        const float* lse2, const float* Di, float* dQacc, T* dK, T* dV, int Nq, int Nk,          \
        float scale, int causal, int group) {                                                    \
        flash_bwd_wgmma<T, D, BR, 2, BULK, EARLY_DV>(tq, tk, tv, tdo, lse2, Di, dQacc, dK, dV,   \
                                                     Nq, Nk, scale, causal, group);              \
    }
// EARLY_DV per head dimension: on at D = 128 only (tools/dev/ch09_hopper.py --sched times both at
// both; ATTN_BWD_EARLY_DV = 0 or 1 overrides the choice, for that comparison)
#ifdef ATTN_BWD_EARLY_DV
#define ATTN_BWD_EDV(D, X) (ATTN_BWD_EARLY_DV != 0)
#else
#define ATTN_BWD_EDV(D, X) X
#endif
#define ATTN_BWD_V3(TN, T, D, BR, EDV)                                                           \
    ATTN_BWD_V3_KERNEL(attention_bwd_v3_##TN##_d##D, T, D, BR, true, ATTN_BWD_EDV(D, EDV))
// the same kernel adding dQ with float4 atomics from the consumers: the lesson's comparison
#define ATTN_BWD_V3_ATOMIC(TN, T, D, BR, EDV)                                                    \
    ATTN_BWD_V3_KERNEL(attention_bwd_v3_atomic_##TN##_d##D, T, D, BR, false, ATTN_BWD_EDV(D, EDV))
#define ATTN_BWD_V3_TYPE(TN, T)                                                                  \
    extern "C" __global__ void attention_bwd_v3_preprocess_##TN(                                 \
        const T* O, const T* dO, const float* lse, float* Di, float* lse2, int BH, int Nq,       \
        int Nq_pad, int D) {                                                                     \
        bwd_preprocess_padded<T>(O, dO, lse, Di, lse2, BH, Nq, Nq_pad, D);                       \
    }                                                                                            \
    extern "C" __global__ void attention_bwd_v3_convert_##TN(const float* dQacc, T* dQ, int BH,  \
                                                            int Nq, int D, float scale) {        \
        bwd_convert_tiled<T>(dQacc, dQ, BH, Nq, D, scale);                                       \
    }
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_bwd_v3)
ATTN_BWD_V3_TYPE(f16, __half)
ATTN_BWD_V3_TYPE(bf16, __nv_bfloat16)
ATTN_BWD_V3(f16, __half, 64, 128, false)
ATTN_BWD_V3(bf16, __nv_bfloat16, 64, 128, false)
ATTN_BWD_V3(f16, __half, 128, 64, true)
ATTN_BWD_V3(bf16, __nv_bfloat16, 128, 64, true)
ATTN_BWD_V3_ATOMIC(bf16, __nv_bfloat16, 64, 128, false)
ATTN_BWD_V3_ATOMIC(bf16, __nv_bfloat16, 128, 64, true)
#endif
