// norm.cu: the normalisations of a row, LayerNorm and RMSNorm, forward (Chapter 3).
//
// x, y: float32 (M, N) row-major, contiguous; gamma, beta: (N,). For each row r:
//   LayerNorm  y = (x - mean) / sqrt(var + eps) * gamma + beta   (var biased, as in torch)
//   RMSNorm    y = x / sqrt(mean(x^2) + eps) * gamma
//
// kernels, simplest first (each line: what changed)
//   layernorm_v1  naive: one thread per row, two passes for the statistics and one to write;
//                 uncoalesced (neighbouring threads read addresses N apart)
//   layernorm_v2  one block per row, Welford: one pass gives count, mean and M2 per thread,
//                 merged across the block (Chan's formula); a second pass writes with the
//                 affine transform fused (gamma, beta applied in the same pass)
//   layernorm_v3  the row held in registers (up to 32 floats per thread): x is read once, the
//                 exact two-pass statistics come from registers, the fused affine pass writes
//                 y. float4 when N % 4 == 0 and x, y, gamma, beta are 16-byte aligned (rows
//                 up to 32 * blockDim.x), scalar loads otherwise (up to 16 * blockDim.x); a
//                 longer row is streamed through v2's body
//   layernorm_v4  for long rows: 32 floats of the row per thread in registers and the rest in
//                 dynamic shared memory (each thread keeps its own float4 there: no barrier, no
//                 bank conflict), so rows up to 90k columns are read once (v3 streams them twice
//                 past 32k); x is read around L1, which then keeps gamma and beta for the next
//                 row (at N = 32k they are 256 KiB, as much as L1 holds). float4 rows; others
//                 take v3's paths
//   layernorm_v5  (sm_90) a row split over a cluster of two blocks on two SMs: each block owns
//                 one half of the columns of every row, so an SM reads only half of gamma and
//                 beta (128 KiB at N = 32k), which ld_keep16 asks L1 to keep from row to row.
//                 Each block computes its half's mean and M2 from registers and sends them to
//                 its partner's shared memory with st.async, which signals the partner's
//                 mbarrier; both merge the halves (welford_merge) in the same order, so both
//                 write with the same mean and rstd. Persistent (one pair of blocks per two
//                 SMs): the next row's half is loaded into registers before this row's
//                 reductions. float4 rows up to 32 T columns; other rows are right but streamed
//                 (v2's body per block). Below sm_90 it compiles to an empty body that writes
//                 nothing: launch it through norm_launch.layernorm, which refuses below compute
//                 capability 9.0
//   layernorm_v6  (sm_90) a row split over a cluster of C blocks (C = 2, 4, 8, 16, chosen by
//                 the launcher from N, given at launch time): each block copies its slice of the
//                 row (N / C floats) into shared memory with one bulk copy, so x is read once
//                 whatever N (up to 262144 columns in 64 KiB per block; v5 holds 32k). Each
//                 block's (count, mean, M2) comes from its slice in two passes over shared
//                 memory, goes to every other block through distributed shared memory
//                 (cluster_allgather16: st.async on the receivers' mbarriers) and the C parts are
//                 merged at once in rank order (Chan's formula: mean from the parts' sums, M2 =
//                 sum of M2_r + n_r (mean_r - mean)^2), so all blocks write with the same mean
//                 and rstd. One row per cluster, not persistent. Rows that are not float4 rows
//                 are right but loaded and stored as scalars. Empty below sm_90 as v5; no Numba
//                 twin (the simulator has no clusters)
//   rmsnorm_v1    RMSNorm, one block per row, any N (one statistic: no mean to subtract)
//   rmsnorm_v2    RMSNorm with the row in registers, as layernorm_v3 (longer rows: v1's body)
//   rmsnorm_v3    (sm_90) RMSNorm with the row split over a cluster as layernorm_v6: each block's
//                 sum of squares of its slice, exchanged and added in rank order. Empty below
//                 sm_90; no Numba twin
//
// Sums over the block are common.cuh's block_sum; layernorm_v2 merges Welford triples
// (count, mean, M2) instead (common.cuh's block_reduce with WelfordOp), layernorm_v5 merges its
// two halves with welford_merge, and layernorm_v6 its C parts with Chan's formula at once.
//
// traffic: 4 MN read + 4 MN written (+ 8 N for gamma, beta) at best (v3, rmsnorm_v2; v6 and
// rmsnorm_v3 read gamma and beta again for every row, from L2).
// Accuracy: var = E[x^2] - E[x]^2 in one pass cancels catastrophically when |mean| >> std;
// Welford and the two-pass form do not.
#include "common.cuh"
// mma.cuh: the mbarriers, bulk copy and cluster primitives of layernorm_v5, v6, rmsnorm_v3 (sm_90)
#include "mma.cuh"

// launch: grid = ceil_div(M, 128), block = 128, no shared memory
extern "C" __global__ void layernorm_v1(const float* x, const float* gamma, const float* beta,
                                        float* y, int M, int N, float eps) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M) return;
    const float* xr = x + (size_t)r * N;
    float* yr = y + (size_t)r * N;
    float s = 0.0f;
    for (int j = 0; j < N; j++) s += xr[j];
    float mean = s / N;
    float q = 0.0f;
    for (int j = 0; j < N; j++) { float c = xr[j] - mean; q += c * c; }
    float rstd = rsqrtf(q / N + eps);
    for (int j = 0; j < N; j++) yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
}

// One row of LayerNorm by the whole block: Welford in one pass, merged across the block, then
// the fused normalise + affine pass. sbuf: 99 floats
__device__ __forceinline__ void layernorm_row_welford(const float* xr, const float* gamma,
                                                      const float* beta, float* yr, int N,
                                                      float eps, float* sbuf) {
    Welford w = {0.0f, 0.0f, 0.0f};
    for (int j = threadIdx.x; j < N; j += blockDim.x) welford_add(w, xr[j]);
    block_reduce(w, WelfordOp{sbuf}, [=](Welford r) {
        sbuf[32] = r.mean;
        sbuf[65] = rsqrtf(r.m2 / N + eps);
    });
    float mean = sbuf[32], rstd = sbuf[65];
    for (int j = threadIdx.x; j < N; j += blockDim.x)       // fused: normalise and affine
        yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
}

// launch: grid = M, block = 256 (multiple of 32, <= 1024), static shared memory 99 floats
extern "C" __global__ void layernorm_v2(const float* x, const float* gamma, const float* beta,
                                        float* y, int M, int N, float eps) {
    __shared__ float sbuf[3 * 33];
    layernorm_row_welford(x + (size_t)blockIdx.x * N, gamma, beta, y + (size_t)blockIdx.x * N,
                          N, eps, sbuf);
}

#define NORM_REGS 32                       // floats of the row each thread holds in registers
#define NORM_REGS_SCALAR 16                // the same without float4 (32 would spill: the
                                           // scalar path needs an index per element)

// One row of LayerNorm by the whole block, held in registers with scalar loads (rows that
// are not 16-byte aligned), N <= NORM_REGS_SCALAR * blockDim.x. sbuf: 33 floats
__device__ __forceinline__ void layernorm_row_regs_scalar(const float* xr, const float* gamma,
                                                          const float* beta, float* yr, int N,
                                                          float eps, float* sbuf) {
    float r[NORM_REGS_SCALAR];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REGS_SCALAR; k++) {
        int j = threadIdx.x + k * blockDim.x;
        r[k] = (j < N) ? xr[j] : 0.0f;
        s += r[k];
    }
    float mean = block_sum(s, sbuf) / N;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REGS_SCALAR; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < N) { float c = r[k] - mean; q += c * c; }
    }
    float rstd = rsqrtf(block_sum(q, sbuf) / N + eps);
#pragma unroll
    for (int k = 0; k < NORM_REGS_SCALAR; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < N) yr[j] = (r[k] - mean) * rstd * gamma[j] + beta[j];
    }
}

// launch: grid = M, block = T, a multiple of 32 <= 1024 with N <= 16 T for the row to stay in
// registers (T = row_block(N) does that up to N = 16384; the float4 path holds up to 32 T);
// static shared memory 99 floats. Any N is right: a longer row is streamed.
extern "C" __global__ void __launch_bounds__(1024) layernorm_v3(
        const float* x, const float* gamma, const float* beta, float* y, int M, int N,
        float eps) {
    __shared__ float sbuf[3 * 33];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma) &&
               aligned16(beta);                                    // uniform over the grid
    if (N > (vec ? NORM_REGS : NORM_REGS_SCALAR) * (int)blockDim.x) {
        layernorm_row_welford(xr, gamma, beta, yr, N, eps, sbuf);   // does not fit: stream it
        return;
    }
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        float4* y4 = reinterpret_cast<float4*>(yr);
        const float4* g4 = reinterpret_cast<const float4*>(gamma);
        const float4* b4 = reinterpret_cast<const float4*>(beta);
        int N4 = N / 4;
        float4 r[NORM_REGS / 4];
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            r[k] = (j < N4) ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            s += (r[k].x + r[k].y) + (r[k].z + r[k].w);
        }
        float mean = block_sum(s, sbuf) / N;
        float q = 0.0f;                    // second pass over registers: sum (x - mean)^2
#pragma unroll
        for (int k = 0; k < NORM_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N4) {
                float a = r[k].x - mean, b = r[k].y - mean, c = r[k].z - mean, d = r[k].w - mean;
                q += (a * a + b * b) + (c * c + d * d);
            }
        }
        float rstd = rsqrtf(block_sum(q, sbuf) / N + eps);
#pragma unroll
        for (int k = 0; k < NORM_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N4) {
                float4 g = g4[j], b = b4[j], v = r[k];
                v.x = (v.x - mean) * rstd * g.x + b.x;
                v.y = (v.y - mean) * rstd * g.y + b.y;
                v.z = (v.z - mean) * rstd * g.z + b.z;
                v.w = (v.w - mean) * rstd * g.w + b.w;
                y4[j] = v;
            }
        }
    } else {                               // rows not 16-byte aligned: the same with scalars
        layernorm_row_regs_scalar(xr, gamma, beta, yr, N, eps, sbuf);
    }
}

// x of layernorm_v4: read once, so around L1 (ld_stream16): L1 keeps gamma and beta, which
// every row reads again
__device__ __forceinline__ float4 v4_load_x(const float4* p) {
    uint4 u = ld_stream16(p);
    return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                       __uint_as_float(u.w));
}

#define NORM_V4_REGS 8             // float4 of the row per thread in registers (32 floats)
#define NORM_V4_SMEM_MAX 14        // float4 per thread in shared memory at most (224 KiB at 1024)

// launch: grid = M, block = T = row_block(N) (a multiple of 32 <= 1024), dynamic shared memory
// S T 16 bytes with S = max(0, ceil(N/4 / T) - 8) float4 per thread (0 when S > 14: the row is
// then streamed). Rows that are not float4 rows take v3's paths. Any N is right.
extern "C" __global__ void __launch_bounds__(1024) layernorm_v4(
        const float* x, const float* gamma, const float* beta, float* y, int M, int N,
        float eps) {
    extern __shared__ float4 rowbuf[];     // [S][T]: float4 8 + k of thread t at [k T + t]
    __shared__ float sbuf[3 * 33];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    const int T = blockDim.x, t = threadIdx.x;
    bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma) &&
               aligned16(beta);                                    // uniform over the grid
    const int N4 = N / 4;
    const int S = max(0, (N4 + T - 1) / T - NORM_V4_REGS);
    unsigned dyn;                          // the dynamic shared memory this launch was given
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (!vec || S > NORM_V4_SMEM_MAX || (unsigned)S * T * 16u > dyn) {
        if (!vec && N <= NORM_REGS_SCALAR * T)
            layernorm_row_regs_scalar(xr, gamma, beta, yr, N, eps, sbuf);
        else
            layernorm_row_welford(xr, gamma, beta, yr, N, eps, sbuf);
        return;
    }
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    float4* y4 = reinterpret_cast<float4*>(yr);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    const float4* b4 = reinterpret_cast<const float4*>(beta);
    float4 r[NORM_V4_REGS];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_V4_REGS; k++) {
        int j = t + k * T;
        r[k] = (j < N4) ? v4_load_x(x4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        s += (r[k].x + r[k].y) + (r[k].z + r[k].w);
    }
#pragma unroll 4
    for (int k = 0; k < S; k++) {          // the rest of the row: into this thread's slots
        int j = t + (k + NORM_V4_REGS) * T;
        float4 v = (j < N4) ? v4_load_x(x4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        rowbuf[k * T + t] = v;
        s += (v.x + v.y) + (v.z + v.w);
    }
    float mean = block_sum(s, sbuf) / N;
    float q = 0.0f;                        // second pass, registers and shared memory
#pragma unroll
    for (int k = 0; k < NORM_V4_REGS; k++) {
        if (t + k * T < N4) {
            float a = r[k].x - mean, b = r[k].y - mean, c = r[k].z - mean, d = r[k].w - mean;
            q += (a * a + b * b) + (c * c + d * d);
        }
    }
#pragma unroll 4
    for (int k = 0; k < S; k++) {
        if (t + (k + NORM_V4_REGS) * T < N4) {
            float4 v = rowbuf[k * T + t];
            float a = v.x - mean, b = v.y - mean, c = v.z - mean, d = v.w - mean;
            q += (a * a + b * b) + (c * c + d * d);
        }
    }
    float rstd = rsqrtf(block_sum(q, sbuf) / N + eps);
#pragma unroll
    for (int k = 0; k < NORM_V4_REGS; k++) {
        int j = t + k * T;
        if (j < N4) {
            float4 g = g4[j], b = b4[j], v = r[k];
            v.x = (v.x - mean) * rstd * g.x + b.x;
            v.y = (v.y - mean) * rstd * g.y + b.y;
            v.z = (v.z - mean) * rstd * g.z + b.z;
            v.w = (v.w - mean) * rstd * g.w + b.w;
            y4[j] = v;
        }
    }
#pragma unroll 4
    for (int k = 0; k < S; k++) {
        int j = t + (k + NORM_V4_REGS) * T;
        if (j < N4) {
            float4 g = g4[j], b = b4[j], v = rowbuf[k * T + t];
            v.x = (v.x - mean) * rstd * g.x + b.x;
            v.y = (v.y - mean) * rstd * g.y + b.y;
            v.z = (v.z - mean) * rstd * g.z + b.z;
            v.w = (v.w - mean) * rstd * g.w + b.w;
            y4[j] = v;
        }
    }
}

#define NORM_V5_REGS 4             // float4 of the block's half row per thread (and 4 of the next row's)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTER_OF_TWO __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_OF_TWO                  // no clusters before sm_90: the kernel is empty there
#endif

// launch (sm_90): grid = 2 P blocks, P = min(M, SMs / 2) pairs (clusters of 2), block T (a
// multiple of 32 <= 1024) with ceil(N / 8) <= 4 T float4 per half row (T = 1024 at N = 32768),
// no dynamic shared memory. Rows that are not float4 rows, or longer than 32 T, are right but
// streamed: each block then does whole rows with v2's body.
extern "C" __global__ void CLUSTER_OF_TWO __launch_bounds__(1024, 1) layernorm_v5(
        const float* x, const float* gamma, const float* beta, float* y, int M, int N,
        float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float sbuf[3 * 33];
    __shared__ float4 inbox[2];            // the partner's (count, mean, M2) of its half, by row parity
    __shared__ __align__(8) unsigned long long arrived[2];  // their mbarriers
    const int T = blockDim.x, t = threadIdx.x, N4 = N / 4;
    const int H = (N4 + 1) / 2;            // float4 columns of rank 0; rank 1 has N4 - H
    bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma) &&
               aligned16(beta);                                    // uniform over the grid
    if (!vec || H > NORM_V5_REGS * T) {
        for (int row = blockIdx.x; row < M; row += gridDim.x)
            layernorm_row_welford(x + (size_t)row * N, gamma, beta, y + (size_t)row * N, N, eps,
                                  sbuf);
        return;
    }
    const unsigned rank = cluster_rank(), other = rank ^ 1u;
    const int lo = rank ? H : 0, hi = rank ? N4 : H;
    const float cnt = 4.0f * (hi - lo);    // 0 only for rank 1 when N = 4
    const int pairs = gridDim.x / 2;
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    const float4* b4 = reinterpret_cast<const float4*>(beta);
    if (t == 0) {
        mbar_init(&arrived[0], 1);
        mbar_init(&arrived[1], 1);
        fence_barrier_init();
    }
    cluster_sync();                        // both blocks' barriers exist before either sends
    float4 cur[NORM_V5_REGS], nxt[NORM_V5_REGS];
    int row = blockIdx.x / 2;
    if (row < M) {
        const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)row * N);
#pragma unroll
        for (int k = 0; k < NORM_V5_REGS; k++) {
            int j = lo + t + k * T;
            cur[k] = j < hi ? __ldg(x4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    for (int it = 0; row < M; row += pairs, it++) {
        const int p = it & 1;              // the inbox and barrier of this row; the n-th use of
        const unsigned phase = (it >> 1) & 1;   // a barrier waits for parity n % 2
        const int next = row + pairs;
        if (next < M) {                    // in flight during this row's reductions and writes
            const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)next * N);
#pragma unroll
            for (int k = 0; k < NORM_V5_REGS; k++) {
                int j = lo + t + k * T;
                nxt[k] = j < hi ? __ldg(x4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_V5_REGS; k++) s += (cur[k].x + cur[k].y) + (cur[k].z + cur[k].w);
        s = block_sum(s, sbuf);
        const float mh = cnt > 0.0f ? s / cnt : 0.0f;          // this half's mean
        float q = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_V5_REGS; k++) {
            if (lo + t + k * T < hi) {
                float a = cur[k].x - mh, b = cur[k].y - mh, c = cur[k].z - mh, d = cur[k].w - mh;
                q += (a * a + b * b) + (c * c + d * d);
            }
        }
        q = block_sum(q, sbuf);                                 // this half's M2
        const Welford mine = {cnt, mh, q};
        if (t == 0) {   // the partner writes inbox[p] again two rows on, after our next message,
                        // which waits for block_sum's barriers: every thread has read it by then
            mbar_expect_tx(&arrived[p], 16);
            st_async16(cluster_map(&inbox[p], other), make_float4(mine.n, mine.mean, mine.m2, 0.f),
                       cluster_map(&arrived[p], other));
        }
        mbar_wait(&arrived[p], phase);
        const float4 o = inbox[p];
        const Welford theirs = {o.x, o.y, o.z};
        const Welford w = rank ? welford_merge(theirs, mine)        // rank 0's half first in both
                               : welford_merge(mine, theirs);       // blocks: the same mean, rstd
        const float mean = w.mean, rstd = rsqrtf(w.m2 / N + eps);
        float4* y4 = reinterpret_cast<float4*>(y + (size_t)row * N);
#pragma unroll
        for (int k = 0; k < NORM_V5_REGS; k++) {
            int j = lo + t + k * T;
            if (j < hi) {
                float4 g = ld_keep16(g4 + j), bb = ld_keep16(b4 + j), v = cur[k];
                v.x = (v.x - mean) * rstd * g.x + bb.x;
                v.y = (v.y - mean) * rstd * g.y + bb.y;
                v.z = (v.z - mean) * rstd * g.z + bb.z;
                v.w = (v.w - mean) * rstd * g.w + bb.w;
                y4[j] = v;
            }
            cur[k] = nxt[k];
        }
    }
    cluster_sync();                        // no block leaves while its partner may still write
#endif
}

// launch (sm_90): grid = C M blocks in clusters of C along x (a launch-time cluster dimension,
// C = 2, 4, 8 or 16; 16 is a non-portable size), block T (a multiple of 32, C <= T <= 512),
// dynamic shared memory 4 L bytes with L = round_up(ceil(N / C), 4): block r of cluster m holds
// columns [r L, min(N, (r + 1) L)) of row m. A launch with less dynamic shared memory than that
// writes nothing.
extern "C" __global__ void __launch_bounds__(512) layernorm_v6(
        const float* x, const float* gamma, const float* beta, float* y, int M, int N,
        float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float4 slice4[];     // [L / 4]: this block's columns of the row
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    __shared__ float4 inbox[16];           // block r's (count, mean, M2, sum) at [r]
    __shared__ __align__(8) unsigned long long bars[2];
    float* slice = reinterpret_cast<float*>(slice4);
    const bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma) &&
                     aligned16(beta);                              // uniform over the grid
    const ClusterRow cr = cluster_row(N);
    if (!cr.fits || cr.row >= M) return;                         // uniform over the cluster
    cluster_row_start(x + (size_t)cr.row * N + cr.lo, cr.n, cr.C, vec, 0.0f, slice, bars);
    const int T = blockDim.x, t = threadIdx.x, n = cr.n, n4 = cr.n4;
    float s = 0.0f;                        // the slice's tail is padded with 0: no mask
#pragma unroll 4
    for (int j = t; j < n4; j += T) {
        float4 v = slice4[j];
        s += (v.x + v.y) + (v.z + v.w);
    }
    const float cnt = (float)n;
    s = block_sum(s, sbuf);
    const float mh = n > 0 ? s / cnt : 0.0f;        // the slice's mean
    float q = 0.0f;                        // second pass, over shared memory: sum (x - mh)^2
#pragma unroll 4
    for (int j = t; j < n4; j += T) {
        float4 v = slice4[j];
        float a = v.x - mh, b = 4 * j + 1 < n ? v.y - mh : 0.0f;
        float c = 4 * j + 2 < n ? v.z - mh : 0.0f, d = 4 * j + 3 < n ? v.w - mh : 0.0f;
        q += (a * a + b * b) + (c * c + d * d);
    }
    q = block_sum(q, sbuf);
    cluster_wait();                        // every block's inbox barrier exists
    const float4 mine = make_float4(cnt, mh, q, s);
    cluster_allgather16(mine, inbox, &bars[1], 0);
    // the row's mean and M2 from the C parts (count n_r, mean m_r, M2_r, sum s_r), in rank order
    // in every block: mean = sum s_r / N, M2 = sum M2_r + n_r (m_r - mean)^2 (Chan's merge of C
    // parts at once: one division instead of one per merge)
    float tot = 0.0f;
    for (int r = 0; r < cr.C; r++) tot += r == cr.rank ? s : inbox[r].w;
    const float mean = tot / N;
    float m2 = 0.0f;
    for (int r = 0; r < cr.C; r++) {
        float4 p = inbox[r];
        if (r == cr.rank) p = mine;        // its own part (inbox[rank] stays unwritten)
        const float dm = p.y - mean;
        m2 += p.z + p.x * dm * dm;
    }
    cluster_arrive();                      // the exit barrier's first half: no st.async in flight
    const float rstd = rsqrtf(m2 / N + eps);
    const size_t at = (size_t)cr.row * N + cr.lo;
    if (vec) {
        float4* y4 = reinterpret_cast<float4*>(y + at);
        const float4* g4 = reinterpret_cast<const float4*>(gamma + cr.lo);
        const float4* b4 = reinterpret_cast<const float4*>(beta + cr.lo);
#pragma unroll 4
        for (int j = t; j < n4; j += T) {
            float4 v = slice4[j], g = __ldg(g4 + j), bb = __ldg(b4 + j);
            v.x = (v.x - mean) * rstd * g.x + bb.x;
            v.y = (v.y - mean) * rstd * g.y + bb.y;
            v.z = (v.z - mean) * rstd * g.z + bb.z;
            v.w = (v.w - mean) * rstd * g.w + bb.w;
            y4[j] = v;
        }
    } else {
        for (int j = t; j < n4; j += T) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int i = 4 * j + c;
                if (i < n)
                    y[at + i] = (slice[i] - mean) * rstd * __ldg(gamma + cr.lo + i) +
                                __ldg(beta + cr.lo + i);
            }
        }
    }
    cluster_wait();                        // no block leaves while a partner may still send
#endif
}

// One row of RMSNorm by the whole block, streamed: sum of squares, then the scaled write.
// sbuf: 33 floats
__device__ __forceinline__ void rmsnorm_row(const float* xr, const float* gamma, float* yr,
                                            int N, float eps, float* sbuf) {
    float q = 0.0f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) q += xr[j] * xr[j];
    float rrms = rsqrtf(block_sum(q, sbuf) / N + eps);
    for (int j = threadIdx.x; j < N; j += blockDim.x) yr[j] = xr[j] * rrms * gamma[j];
}

// launch: grid = M, block = 256 (multiple of 32, <= 1024), static shared memory 33 floats
extern "C" __global__ void rmsnorm_v1(const float* x, const float* gamma, float* y, int M, int N,
                                      float eps) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    rmsnorm_row(x + (size_t)blockIdx.x * N, gamma, y + (size_t)blockIdx.x * N, N, eps, sbuf);
}

// launch: as layernorm_v3 (block T = row_block(N) keeps the row in registers); any N is right
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_v2(
        const float* x, const float* gamma, float* y, int M, int N, float eps) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma);
    if (N > (vec ? NORM_REGS : NORM_REGS_SCALAR) * (int)blockDim.x) {
        rmsnorm_row(xr, gamma, yr, N, eps, sbuf);
        return;
    }
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        float4* y4 = reinterpret_cast<float4*>(yr);
        const float4* g4 = reinterpret_cast<const float4*>(gamma);
        int N4 = N / 4;
        float4 r[NORM_REGS / 4];
        float q = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            r[k] = (j < N4) ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            q += (r[k].x * r[k].x + r[k].y * r[k].y) + (r[k].z * r[k].z + r[k].w * r[k].w);
        }
        float rrms = rsqrtf(block_sum(q, sbuf) / N + eps);
#pragma unroll
        for (int k = 0; k < NORM_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N4) {
                float4 g = g4[j], v = r[k];
                y4[j] = make_float4(v.x * rrms * g.x, v.y * rrms * g.y, v.z * rrms * g.z,
                                    v.w * rrms * g.w);
            }
        }
    } else {
        float r[NORM_REGS_SCALAR];
        float q = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_REGS_SCALAR; k++) {
            int j = threadIdx.x + k * blockDim.x;
            r[k] = (j < N) ? xr[j] : 0.0f;
            q += r[k] * r[k];
        }
        float rrms = rsqrtf(block_sum(q, sbuf) / N + eps);
#pragma unroll
        for (int k = 0; k < NORM_REGS_SCALAR; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N) yr[j] = r[k] * rrms * gamma[j];
        }
    }
}

// launch (sm_90): as layernorm_v6 (clusters of C along x, block T, dynamic shared memory 4 L
// bytes); a launch with less dynamic shared memory writes nothing
extern "C" __global__ void __launch_bounds__(512) rmsnorm_v3(
        const float* x, const float* gamma, float* y, int M, int N, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float4 slice4[];     // [L / 4]: this block's columns of the row
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    __shared__ float4 inbox[16];           // block r's sum of squares at [r].x
    __shared__ __align__(8) unsigned long long bars[2];
    float* slice = reinterpret_cast<float*>(slice4);
    const bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y) && aligned16(gamma);
    const ClusterRow cr = cluster_row(N);
    if (!cr.fits || cr.row >= M) return;                         // uniform over the cluster
    cluster_row_start(x + (size_t)cr.row * N + cr.lo, cr.n, cr.C, vec, 0.0f, slice, bars);
    const int T = blockDim.x, t = threadIdx.x, n = cr.n, n4 = cr.n4;
    float q = 0.0f;                        // the slice's tail is padded with 0: no mask
#pragma unroll 4
    for (int j = t; j < n4; j += T) {
        float4 v = slice4[j];
        q += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
    }
    q = block_sum(q, sbuf);
    cluster_wait();                        // every block's inbox barrier exists
    const float4 mine = make_float4(q, 0.0f, 0.0f, 0.0f);
    cluster_allgather16(mine, inbox, &bars[1], 0);
    float ss = 0.0f;                       // the row's, added in rank order in every block
    for (int r = 0; r < cr.C; r++) ss += r == cr.rank ? q : inbox[r].x;
    cluster_arrive();                      // the exit barrier's first half: no st.async in flight
    const float rrms = rsqrtf(ss / N + eps);
    const size_t at = (size_t)cr.row * N + cr.lo;
    if (vec) {
        float4* y4 = reinterpret_cast<float4*>(y + at);
        const float4* g4 = reinterpret_cast<const float4*>(gamma + cr.lo);
#pragma unroll 4
        for (int j = t; j < n4; j += T) {
            float4 v = slice4[j], g = __ldg(g4 + j);
            y4[j] = make_float4(v.x * rrms * g.x, v.y * rrms * g.y, v.z * rrms * g.z,
                                v.w * rrms * g.w);
        }
    } else {
        for (int j = t; j < n4; j += T) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int i = 4 * j + c;
                if (i < n) y[at + i] = slice[i] * rrms * __ldg(gamma + cr.lo + i);
            }
        }
    }
    cluster_wait();                        // no block leaves while a partner may still send
#endif
}
