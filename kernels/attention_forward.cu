// attention_forward.cu: O = softmax(scale * Q K^T) V, and its logsumexp (Chapter 9).
//
// Q: (BH, Nq, D), K and V: (BH, Nk, D), O: (BH, Nq, D), all row-major and contiguous (a PyTorch
// (B, H, N, D) tensor is the same memory); lse: (BH, Nq) float32, lse[i] = log sum_j exp(S[i, j]).
// causal != 0: query i sees keys j <= i (top-left aligned, as torch's is_causal). Any Nq, Nk >= 1:
// tiles that hang over the end of a sequence are zero-filled and their scores masked to -inf.
//
// versions, simplest first (each line: what changed)
//   attention_v1_*      naive, three kernels: scores S = scale Q K^T written to memory (BH Nq Nk
//                       floats: O(N^2) memory), softmax of each row in place (and the lse), O = P V
//   attention_v2_d{64,128}   FlashAttention in fp32: one block per 32 queries; K and V stream
//                       through shared memory in tiles of 32 keys; the online softmax keeps a running
//                       max m and sum l per query and rescales O by exp(m_old - m_new): S never
//                       leaves the chip, memory is O(N). Causal blocks skip the tiles above the
//                       diagonal. 4 threads per query, each a quarter of the head dimension
//   attention_v3_{f16,bf16}_d{64,128}   tensor cores (mma.sync m16n8k16, fp32 accumulate, the FA2
//                       work split): 4 warps, each owns 32 query rows of a 128-row block; Q, K, V
//                       tiles arrive by cp.async into swizzled shared memory and are read with
//                       ldmatrix; S = Q K^T stays in registers, and its accumulators become the A
//                       operand of P V without leaving them. Loads of the next K (and of V) overlap
//                       the math. Needs sm_80 for bf16 (f16 runs from sm_75)
//   attention_v4_{f16,bf16}_d{64,128}   Hopper (sm_90a): wgmma, TMA, warp specialisation. A
//                       producer warpgroup loads K/V tiles by TMA into a 2-stage ring guarded by
//                       mbarriers; two consumer warpgroups (64 query rows each) compute S = Q K^T
//                       with wgmma from shared memory and O += P V with P from registers; P V of
//                       one tile overlaps the softmax of the next, and the two consumers take
//                       turns issuing their products (ping-pong)
//
// Grouped-query attention (v4): K and V may have fewer heads than Q; the kernel's last
// argument `group` = query heads per key/value head (1: ordinary attention), and query head bh
// (of BH = B H) reads key/value head bh / group (of B H / group): the (B, H, N, D) layout makes
// b H + h over group equal b (H / group) + h / group.
//
// work (non-causal): 4 Nq Nk D flops (two matrix products); causal about half.
// Each version's kernels sit inside #if !defined(CB_ONLY) || defined(CB_ONLY_attention_vN): the
// launcher compiles the one version it launches (cudabook.compile.module(..., only=...)).
#include "attention.cuh"

#if !defined(CB_ONLY) || defined(CB_ONLY_attention_v1)
// ======================================================================================= v1
// launch: block (32, 8), grid (ceil(Nk / 32), ceil(Nq / 8), BH). One thread per score.
// S: (BH, Nq, Nk) float32. A warp reads one row of Q (a broadcast) and 32 rows of K D floats
// apart: uncoalesced, as naive as it gets; the point of v1 is the N x N matrix it writes.
extern "C" __global__ void attention_v1_scores(const float* __restrict__ Q,
                                               const float* __restrict__ K,
                                               float* __restrict__ S, int Nq, int Nk, int D,
                                               float scale, int causal) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y * blockDim.y + threadIdx.y;
    int bh = blockIdx.z;
    if (i >= Nq || j >= Nk) return;
    const float* q = Q + ((size_t)bh * Nq + i) * D;
    const float* k = K + ((size_t)bh * Nk + j) * D;
    float acc = 0.f;
    for (int c = 0; c < D; c++) acc += q[c] * k[c];
    S[((size_t)bh * Nq + i) * Nk + j] = (causal && j > i) ? -INFINITY : acc * scale;
}

// launch: block 128 (4 warps, one row each), grid ceil(BH * Nq / 4). P = softmax(S) in place,
// three passes over the row (max, sum, write) as softmax_v3 of Chapter 3; lse = m + log(l).
extern "C" __global__ void attention_v1_softmax(float* __restrict__ S, float* __restrict__ lse,
                                                int rows, int Nk) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;                       // whole warps leave together
    float* s = S + (size_t)r * Nk;
    float m = -INFINITY;
    for (int j = lane; j < Nk; j += 32) m = fmaxf(m, s[j]);
    m = warp_max(m);
    float mb = m == -INFINITY ? 0.f : m;         // a fully masked row: zeros, not NaN
    float l = 0.f;
    for (int j = lane; j < Nk; j += 32) l += __expf(s[j] - mb);
    l = warp_sum(l);
    float inv = l > 0.f ? 1.f / l : 0.f;
    for (int j = lane; j < Nk; j += 32) s[j] = __expf(s[j] - mb) * inv;
    if (lane == 0) lse[r] = l > 0.f ? mb + logf(l) : -INFINITY;
}

// launch: block (32, 8), grid (ceil(D / 32), ceil(Nq / 8), BH). O[i, c] = sum_j P[i, j] V[j, c]:
// a warp reads one P[i, j] (broadcast) and 32 neighbouring V[j, c] (coalesced).
extern "C" __global__ void attention_v1_pv(const float* __restrict__ P,
                                           const float* __restrict__ V, float* __restrict__ O,
                                           int Nq, int Nk, int D) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y * blockDim.y + threadIdx.y;
    int bh = blockIdx.z;
    if (i >= Nq || c >= D) return;
    const float* p = P + ((size_t)bh * Nq + i) * Nk;
    const float* v = V + (size_t)bh * Nk * D + c;
    float acc = 0.f;
    for (int j = 0; j < Nk; j++) acc += p[j] * v[(size_t)j * D];
    O[((size_t)bh * Nq + i) * D + c] = acc;
}
#endif

// ======================================================================================= v2
// launch: block 128 = 32 queries x 4 threads, grid (ceil(Nq / 32), BH), static shared memory
// 2 * 32 * D floats (32 KiB at D = 128).
// Thread (r = tid / 4, part = tid % 4) holds the elements part, part + 4, ... of its query's q
// and o (interleaved: the 4 threads of a query read 4 neighbouring words of a K row, while the 8
// queries of a warp read the same row: a broadcast, no bank conflict). A dot product is 4
// partial sums joined by two shuffles.
template <int D>
__device__ __forceinline__ void flash_fp32(const float* __restrict__ Q, const float* __restrict__ K,
                                           const float* __restrict__ V, float* __restrict__ O,
                                           float* __restrict__ lse, int Nq, int Nk,
                                           float scale_log2, int causal) {
    constexpr int BR = 32, BC = 32, P = 4, DP = D / P;
    __shared__ float Ks[BC][D], Vs[BC][D];
    int r = threadIdx.x / P, part = threadIdx.x % P;
    int qb = gridDim.x - 1 - blockIdx.x;          // causal: the longest blocks start first
    int bh = blockIdx.y;
    int row = qb * BR + r;
    const float* q = Q + ((size_t)bh * Nq + min(row, Nq - 1)) * D;
    const float* Kh = K + (size_t)bh * Nk * D;
    const float* Vh = V + (size_t)bh * Nk * D;
    float qr[DP], o[DP];
#pragma unroll
    for (int c = 0; c < DP; c++) {
        qr[c] = q[part + P * c] * scale_log2;     // scores come out in log2 units
        o[c] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    // causal: the block's last query is qb * BR + 31, so keys from there on are never seen
    int kv_end = causal ? min(Nk, min(Nq, qb * BR + BR)) : Nk;
    for (int j0 = 0; j0 < kv_end; j0 += BC) {
        __syncthreads();                          // everyone is done with the previous tile
        for (int e = threadIdx.x; e < BC * D; e += blockDim.x) {
            int jj = e / D, c = e % D;
            bool ok = j0 + jj < Nk;               // past the end: zeros (masked below)
            Ks[jj][c] = ok ? Kh[(size_t)(j0 + jj) * D + c] : 0.f;
            Vs[jj][c] = ok ? Vh[(size_t)(j0 + jj) * D + c] : 0.f;
        }
        __syncthreads();
        float s[BC], mt = -INFINITY;              // this tile's scores of my query
#pragma unroll
        for (int jj = 0; jj < BC; jj++) {
            float acc = 0.f;
#pragma unroll
            for (int c = 0; c < DP; c++) acc += qr[c] * Ks[jj][part + P * c];
            acc = quad_sum(acc);                  // the query's 4 threads
            int key = j0 + jj;
            s[jj] = (key < Nk && !(causal && key > row)) ? acc : -INFINITY;
            mt = fmaxf(mt, s[jj]);
        }
        float m_new = fmaxf(m, mt);
        if (m_new == -INFINITY) continue;         // nothing visible yet: keep (m, l, o) = (-inf, 0, 0)
        float alpha = exp2f(m - m_new);           // rescale what was summed against the old max
        l *= alpha;
#pragma unroll
        for (int c = 0; c < DP; c++) o[c] *= alpha;
#pragma unroll
        for (int jj = 0; jj < BC; jj++) {
            float p = exp2f(s[jj] - m_new);
            l += p;
#pragma unroll
            for (int c = 0; c < DP; c++) o[c] += p * Vs[jj][part + P * c];
        }
        m = m_new;
    }
    if (row < Nq) {
        float inv = l > 0.f ? 1.f / l : 0.f;
        float* out = O + ((size_t)bh * Nq + row) * D;
#pragma unroll
        for (int c = 0; c < DP; c++) out[part + P * c] = o[c] * inv;
        if (part == 0) lse[(size_t)bh * Nq + row] = l > 0.f ? (m + log2f(l)) * ATTN_LN2 : -INFINITY;
    }
}

#define ATTN_V2(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(128) attention_v2_d##D(                         \
        const float* Q, const float* K, const float* V, float* O, float* lse, int Nq, int Nk,   \
        float scale_log2, int causal) {                                                          \
        flash_fp32<D>(Q, K, V, O, lse, Nq, Nk, scale_log2, causal);                              \
    }
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_v2)
ATTN_V2(64)
ATTN_V2(128)
#endif

// ======================================================================================= v3
// launch: block NW * 32 = 128, grid (ceil(Nq / BR), BH), dynamic shared memory
// (BR + 2 BC) * D * 2 bytes (Q, K and V tiles; 32 KiB at D = 64, 64 KiB at D = 128).
// Warp w owns query rows [w * 16 MT, (w + 1) * 16 MT) of the block: MT m16 tiles. Per K/V tile
// it computes S (MT x BC/8 accumulators of 16 x 8), the online softmax on them (a row's values
// sit in the 4 lanes of a quad: two shuffles give its max), then O += P V with P taken straight
// from the accumulators (acc_to_a). Everything indexed by a loop counter is unrolled, so these
// arrays stay in registers.
template <typename T, int D, int BR, int BC, int NW>
__device__ __forceinline__ void flash_mma(const T* __restrict__ Q, const T* __restrict__ K,
                                          const T* __restrict__ V, T* __restrict__ O,
                                          float* __restrict__ lse, int Nq, int Nk,
                                          float scale_log2, int causal) {
    constexpr int NT = NW * 32, MT = BR / (16 * NW), KD = D / 16, NB = BC / 8, ND = D / 8;
    static_assert(BR % (16 * NW) == 0 && BC % 16 == 0 && D % 64 == 0, "tile shape");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    T* Qs = reinterpret_cast<T*>(attn_smem);      // BR x D
    T* Ks = Qs + BR * D;                          // BC x D
    T* Vs = Ks + BC * D;                          // BC x D
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
    int q0 = qb * BR, wr = warp * MT * 16;        // first row of the block, of this warp
    const T* Kh = K + (size_t)bh * Nk * D;
    const T* Vh = V + (size_t)bh * Nk * D;

    load_tile<T, BR, D, NT>(Qs, Q + (size_t)bh * Nq * D, q0, Nq);
    load_tile<T, BC, D, NT>(Ks, Kh, 0, Nk);
    cp_async_commit();

    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nd = 0; nd < ND; nd++) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }
    // Per-lane shared addresses of the first ldmatrix of each operand (mma.cuh gives the rows and
    // columns each lane points at). Moving k by 16 columns flips address bit 5 (c ^ (r % 8) with
    // r % 8 fixed per lane), moving n by 16 columns of V flips bit 4.. the others are plain adds.
    unsigned q_addr = smem_u32(Qs + swz<D>(wr + lane % 16, 8 * (lane / 16)));
    unsigned k_addr = smem_u32(Ks + swz<D>(lane % 8 + 8 * (lane / 16), 8 * ((lane / 8) % 2)));
    unsigned v_addr = smem_u32(Vs + swz<D>(lane % 8 + 8 * ((lane / 8) % 2), 8 * (lane / 16)));
    int kv_end = causal ? min(Nk, min(Nq, q0 + BR)) : Nk;   // causal: skip tiles past the block
    int n_tiles = ceil_div(kv_end, BC);
    for (int jt = 0; jt < n_tiles; jt++) {
        int j0 = jt * BC;
        cp_async_wait<0>();
        __syncthreads();                          // K_j has landed; nobody reads V_{j-1} any more
        load_tile<T, BC, D, NT>(Vs, Vh, j0, Nk);  // V_j arrives while S = Q K_j^T is computed
        cp_async_commit();

        float s[MT][NB][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nb = 0; nb < NB; nb++) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)       // A = Q rows, (M, K) with K contiguous
                ldmatrix_x4(a[mt], (q_addr ^ (kk << 5)) + mt * 16 * D * 2);
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {  // B = K^T: K is (N, K) with K contiguous
                unsigned b[4];
                ldmatrix_x4(b, (k_addr ^ (kk << 5)) + nb * 8 * D * 2);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    Mma<T>::mma(s[mt][nb], a[mt], b);
                    Mma<T>::mma(s[mt][nb + 1], a[mt], b + 2);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();                          // V_j has landed; nobody reads K_j any more
        if (jt + 1 < n_tiles) {                   // K_{j+1} arrives during softmax and P V
            load_tile<T, BC, D, NT>(Ks, Kh, j0 + BC, Nk);
            cp_async_commit();
        }

        if (j0 + BC > Nk || (causal && j0 + BC - 1 > q0)) {   // only edge tiles pay for the mask
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int row = q0 + wr + mt * 16 + g + 8 * (e / 2);
                        int col = j0 + nb * 8 + 2 * t + (e % 2);
                        if (col >= Nk || (causal && col > row)) s[mt][nb][e] = -INFINITY;
                    }
        }
        // online softmax: h = 0 is row g of the m16 tile (c[0], c[1]), h = 1 row g + 8 (c[2], c[3])
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float mx = -INFINITY;
#pragma unroll
                for (int nb = 0; nb < NB; nb++) mx = fmaxf(mx, fmaxf(s[mt][nb][2 * h], s[mt][nb][2 * h + 1]));
                mx = quad_max(mx);                // the quad holds the row
                float m_new = fmaxf(m[mt][h], mx * scale_log2);
                float base = m_new == -INFINITY ? 0.f : m_new;          // all masked: no NaN
                float alpha = exp2f(m[mt][h] - base);
                m[mt][h] = m_new;
                l[mt][h] *= alpha;
#pragma unroll
                for (int nd = 0; nd < ND; nd++) {
                    o[mt][nd][2 * h] *= alpha;
                    o[mt][nd][2 * h + 1] *= alpha;
                }
                float sum = 0.f;                  // this lane's part; the quad is summed at the end
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; e++) {
                        float p = exp2f(fmaf(s[mt][nb][e], scale_log2, -base));
                        s[mt][nb][e] = p;
                        sum += p;
                    }
                l[mt][h] += sum;
            }
        // O += P V: k runs over the tile's keys, 16 at a time
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) acc_to_a<T>(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int nd = 0; nd < ND; nd += 2) {  // B = V, (K, N) with N contiguous: .trans
                unsigned b[4];
                ldmatrix_x4_trans(b, (v_addr ^ (nd << 4)) + kk * 16 * D * 2);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    Mma<T>::mma(o[mt][nd], pa[mt], b);
                    Mma<T>::mma(o[mt][nd + 1], pa[mt], b + 2);
                }
            }
        }
    }
    // O = o / l and lse, written straight from the accumulators (2 values per 32-bit store)
    T* Oh = O + (size_t)bh * Nq * D;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = quad_sum(l[mt][h]);
            float inv = sum > 0.f ? 1.f / sum : 0.f;
            int row = q0 + wr + mt * 16 + g + 8 * h;
            if (row < Nq) {
                unsigned* out = reinterpret_cast<unsigned*>(Oh + (size_t)row * D + 2 * t);
#pragma unroll
                for (int nd = 0; nd < ND; nd++)
                    out[nd * 4] = Mma<T>::pack(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv);
                if (t == 0)
                    lse[(size_t)bh * Nq + row] = sum > 0.f ? (m[mt][h] + log2f(sum)) * ATTN_LN2 : -INFINITY;
            }
        }
}

// Tile shapes (BR queries per block, BC keys per tile, 4 warps), the fastest of those timed by
// tools/dev/ch09_bench.py --variants on an H100. Registers: S takes MT * BC / 2 and O MT * D / 2
// floats per thread (MT = 2 m16 tiles per warp).
#define ATTN_V3(NAME, T, D, BR, BC)                                                              \
    extern "C" __global__ void __launch_bounds__(128) NAME(const T* Q, const T* K, const T* V,   \
                                                         T* O, float* lse, int Nq, int Nk,       \
                                                         float scale_log2, int causal) {         \
        flash_mma<T, D, BR, BC, 4>(Q, K, V, O, lse, Nq, Nk, scale_log2, causal);                 \
    }
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_v3)
ATTN_V3(attention_v3_f16_d64, __half, 64, 128, 64)
ATTN_V3(attention_v3_bf16_d64, __nv_bfloat16, 64, 128, 64)
ATTN_V3(attention_v3_f16_d128, __half, 128, 128, 64)
ATTN_V3(attention_v3_bf16_d128, __nv_bfloat16, 128, 128, 64)
#endif

// ======================================================================================= v4
// Hopper (sm_90a). launch: block 384 = 3 warpgroups, grid (ceil(Nq / 128), BH), dynamic shared
// memory (128 D + 2 ST BC D) * 2 + 1024 bytes (Q, ST stages of K and of V, 1024 for alignment);
// 81 KiB at D = 64, 161 KiB at D = 128 (ST = 2, BC = 128). Q, K and V arrive by TMA through 2D tensor maps of
// (BH N, D) with boxes of 64 columns (128 bytes, the 128-byte swizzle wgmma reads): a tile of
// D = 128 is two slabs of 64 columns. A box that hangs over the end of a sequence reads the next
// head's rows (or zeros past the last head): those keys are masked to -inf, those queries never
// stored, so the ragged end costs nothing but the mask.
//
// Warpgroup 0 is the producer: it gives registers away (setmaxnreg.dec) and one thread issues the
// TMA copies: Q once, then K_j and V_j into a ring of ST stages, each stage guarded by a "full"
// barrier (the bytes landed) and an "empty" one (both consumers are done with it). Warpgroups 1
// and 2 are consumers (setmaxnreg.inc), 64 query rows each. Per tile j a consumer computes
// S_j = Q K_j^T with wgmma (both operands from shared memory, K-major), the online softmax on
// the accumulators, P_j rounded to 16 bits in registers, and O += P_j V_j with wgmma taking P
// from registers and V from shared memory as it lies (N-major: no transpose). With OVERLAP the
// product P_{j-1} V_{j-1} runs on the tensor cores while the softmax of S_j runs on the ALUs:
// S_j is issued first, then P_{j-1} V_{j-1}; the consumer waits for S_j only, and for the
// P V product just before O is rescaled. With PINGPONG the two consumers take turns issuing
// their products (named barriers 1 and 2), so that one's softmax tends to run while the other's
// products occupy the tensor cores. ST: stages of the K/V ring.

template <typename T, int D, int BC, int ST, bool OVERLAP, bool PINGPONG>
__device__ __forceinline__ void flash_wgmma(const TmaDesc& tq, const TmaDesc& tk,
                                            const TmaDesc& tv, T* __restrict__ O,
                                            float* __restrict__ lse, int Nq, int Nk,
                                            float scale_log2, int causal, int group) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BR = 128, SL = D / 64, NB = BC / 8, ND = D / 8, KP = BC / 16;
    constexpr unsigned Q_BYTES = BR * D * sizeof(T), KV_BYTES = BC * D * sizeof(T);
    __shared__ __align__(8) unsigned long long qbar, kfull[ST], vfull[ST], kempty[ST], vempty[ST];
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    // slab sl of a tile of R rows: R x 64 values at offset sl * R * 64
    T* Qs = reinterpret_cast<T*>(attn_smem + ((1024u - (smem_u32(attn_smem) & 1023u)) & 1023u));
    T* Ks = Qs + BR * D;                          // ST stages of BC x D
    T* Vs = Ks + ST * BC * D;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, q0 = qb * BR;
    const int kv_end = causal ? min(Nk, min(Nq, q0 + BR)) : Nk;
    const int n_tiles = ceil_div(kv_end, BC);
    if (threadIdx.x == 0) {
        mbar_init(&qbar, 1);
        for (int s = 0; s < ST; s++) {
            mbar_init(&kfull[s], 1);               // the producer's arrive (+ the TMA bytes)
            mbar_init(&vfull[s], 1);
            mbar_init(&kempty[s], 2);              // one arrive per consumer warpgroup
            mbar_init(&vempty[s], 2);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {                                // ---------------------------------- producer
        setmaxnreg_dec<24>();
        if (tid == 0) {
            mbar_expect_tx(&qbar, Q_BYTES);
            for (int sl = 0; sl < SL; sl++)
                tma_load_2d(Qs + sl * BR * 64, &tq, &qbar, 64 * sl, bh * Nq + q0);
            for (int jt = 0; jt < n_tiles; jt++) {
                const int s = jt % ST, use = jt / ST, row = (bh / group) * Nk + jt * BC;
                if (use > 0) mbar_wait(&kempty[s], (use - 1) & 1);
                mbar_expect_tx(&kfull[s], KV_BYTES);
                for (int sl = 0; sl < SL; sl++)
                    tma_load_2d(Ks + s * BC * D + sl * BC * 64, &tk, &kfull[s], 64 * sl, row);
                if (use > 0) mbar_wait(&vempty[s], (use - 1) & 1);
                mbar_expect_tx(&vfull[s], KV_BYTES);
                for (int sl = 0; sl < SL; sl++)
                    tma_load_2d(Vs + s * BC * D + sl * BC * 64, &tv, &vfull[s], 64 * sl, row);
            }
        }
        return;
    }
    setmaxnreg_inc<240>();                         // ---------------------------------- consumers
    const int c = wg - 1, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int rw = q0 + 64 * c;                   // this warpgroup's first row
    const int r0 = rw + 16 * (tid / 32) + g;      // this thread's rows: r0 (h = 0), r0 + 8 (h = 1)
    float o[D / 2], sacc[BC / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    unsigned pa[KP][4];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;

    auto issue_s = [&](int s) {                   // sacc = Q K^T of stage s (asynchronous)
#pragma unroll
        for (int i = 0; i < BC / 2; i++) sacc[i] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wg_ss<BC, T>(sacc,
                         wgmma_desc_sw128(Qs + (kk / 4) * BR * 64 + c * 64 * 64 + 16 * (kk % 4)),
                         wgmma_desc_sw128(Ks + s * BC * D + (kk / 4) * BC * 64 + 16 * (kk % 4)));
        wgmma_commit();
    };
    auto issue_pv = [&](int s) {                  // o += P V of stage s (asynchronous)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KP; kk++)
            wg_rs<D, T>(o, pa[kk], wgmma_desc_sw128_mn(Vs + s * BC * D + kk * 16 * 64,
                                                        BC * 64 * sizeof(T)));
        wgmma_commit();
    };
    // mask, online softmax of sacc (tile jt), P into pa; returns alpha of each row (O's rescale)
    auto softmax = [&](int jt, float* alpha) {
        const int j0 = jt * BC;
        if (j0 + BC > Nk || (causal && j0 + BC - 1 > rw)) {   // only edge tiles pay for the mask
#pragma unroll
            for (int j = 0; j < NB; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int row = r0 + 8 * (e / 2), col = j0 + 8 * j + 2 * t + (e % 2);
                    if (col >= Nk || (causal && col > row)) sacc[4 * j + e] = -INFINITY;
                }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < NB; j++) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]));
            mx = quad_max(mx);                    // the quad holds the row
            const float m_new = fmaxf(m[h], mx * scale_log2);
            const float base = m_new == -INFINITY ? 0.f : m_new;    // all masked: no NaN
            alpha[h] = exp2f(m[h] - base);
            m[h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < NB; j++)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; e++) {
                    const float p = exp2f(fmaf(sacc[4 * j + e], scale_log2, -base));
                    sacc[4 * j + e] = p;
                    sum += p;
                }
            l[h] = l[h] * alpha[h] + sum;
        }
    };
    auto rescale = [&](const float* alpha) {
#pragma unroll
        for (int j = 0; j < ND; j++) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    };
    auto to_pa = [&]() {
#pragma unroll
        for (int kk = 0; kk < KP; kk++) acc_to_a<T>(pa[kk], &sacc[8 * kk], &sacc[8 * kk + 4]);
    };

    // PINGPONG: consumer c issues its products only on its turn (named barrier 1 + c) and then
    // hands the turn to the other, so one's softmax runs while the other's products do
    auto turn = [&]() { if constexpr (PINGPONG) named_sync(1 + c); };
    auto pass = [&]() { if constexpr (PINGPONG) named_arrive(2 - c); };
    if (PINGPONG && c == 1) named_arrive(1);      // consumer 0 goes first

    mbar_wait(&qbar, 0);
    float alpha[2];
    if constexpr (OVERLAP) {
        mbar_wait(&kfull[0], 0);
        turn();
        issue_s(0);
        pass();
        wgmma_wait<0>();
        pin_all<BC / 2>(sacc);
        if (tid == 0) mbar_arrive(&kempty[0]);
        softmax(0, alpha);
        to_pa();
        for (int jt = 1; jt < n_tiles; jt++) {
            const int s = jt % ST, sp = (jt - 1) % ST;
            mbar_wait(&kfull[s], (jt / ST) & 1);
            mbar_wait(&vfull[sp], ((jt - 1) / ST) & 1);
            turn();
            issue_s(s);                            // S_j on the tensor cores ...
            issue_pv(sp);                          // ... then P_{j-1} V_{j-1} behind it
            pass();
            wgmma_wait<1>();                       // S_j is done (P V may still run)
            pin_all<BC / 2>(sacc);                 // (no read of S may move above the wait)
            if (tid == 0) mbar_arrive(&kempty[s]);
            softmax(jt, alpha);                    // the ALUs work while P V runs
            wgmma_wait<0>();
            pin_all<D / 2>(o);
            pin_all<4 * KP>(&pa[0][0]);            // (nor may P's registers be reused before it)
            if (tid == 0) mbar_arrive(&vempty[sp]);
            rescale(alpha);
            to_pa();
        }
        const int sl = (n_tiles - 1) % ST;
        mbar_wait(&vfull[sl], ((n_tiles - 1) / ST) & 1);
        turn();
        issue_pv(sl);
        pass();
        wgmma_wait<0>();
        pin_all<D / 2>(o);
        pin_all<4 * KP>(&pa[0][0]);
        if (tid == 0) mbar_arrive(&vempty[sl]);
    } else {
        for (int jt = 0; jt < n_tiles; jt++) {
            const int s = jt % ST, ph = (jt / ST) & 1;
            mbar_wait(&kfull[s], ph);
            turn();
            issue_s(s);
            pass();
            wgmma_wait<0>();
            pin_all<BC / 2>(sacc);
            if (tid == 0) mbar_arrive(&kempty[s]);
            softmax(jt, alpha);
            rescale(alpha);
            to_pa();
            mbar_wait(&vfull[s], ph);
            turn();
            issue_pv(s);
            pass();
            wgmma_wait<0>();
            pin_all<D / 2>(o);
            pin_all<4 * KP>(&pa[0][0]);
            if (tid == 0) mbar_arrive(&vempty[s]);
        }
    }
    // O = o / l and lse, straight from the accumulators (layout: mma.cuh, wgmma accumulators)
    T* Oh = O + (size_t)bh * Nq * D;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = quad_sum(l[h]);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int row = r0 + 8 * h;
        if (row < Nq) {
            unsigned* out = reinterpret_cast<unsigned*>(Oh + (size_t)row * D + 2 * t);
#pragma unroll
            for (int j = 0; j < ND; j++)
                out[j * 4] = Mma<T>::pack(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
            if (t == 0)
                lse[(size_t)bh * Nq + row] = sum > 0.f ? (m[h] + log2f(sum)) * ATTN_LN2 : -INFINITY;
        }
    }
#endif
}

// BC = 128 keys per tile, 2 stages: tools/dev/ch09_v4_probe.py --variants times the alternatives
// (3 stages, the overlap and the ping-pong one at a time). The _nolap kernels (neither the overlap
// nor the ping-pong) are for the lesson's comparison.
#define ATTN_V4(NAME, T, D, SCHED)                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                   \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,                  \
        const __grid_constant__ TmaDesc tv, T* O, float* lse, int Nq, int Nk, float scale_log2,  \
        int causal, int group) {                                                                 \
        flash_wgmma<T, D, 128, 2, SCHED, SCHED>(tq, tk, tv, O, lse, Nq, Nk, scale_log2, causal,  \
                                                group);                                          \
    }
#if !defined(CB_ONLY) || defined(CB_ONLY_attention_v4)
ATTN_V4(attention_v4_f16_d64, __half, 64, true)
ATTN_V4(attention_v4_bf16_d64, __nv_bfloat16, 64, true)
ATTN_V4(attention_v4_f16_d128, __half, 128, true)
ATTN_V4(attention_v4_bf16_d128, __nv_bfloat16, 128, true)
ATTN_V4(attention_v4_nolap_bf16_d64, __nv_bfloat16, 64, false)
ATTN_V4(attention_v4_nolap_bf16_d128, __nv_bfloat16, 128, false)
#endif
