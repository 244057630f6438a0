// softmax.cu: row-wise softmax y[r, :] = exp(x[r, :] - m) / sum(exp(x[r, :] - m)) (Chapter 3).
//
// x, y: float32 (M, N) row-major, contiguous. m is the row maximum: subtracting it makes every
// exponent <= 0, so exp never overflows (exp(89) is already inf in float32), and the result is
// unchanged because the factor exp(-m) cancels between numerator and denominator.
// Rows of -inf (a fully masked attention row): the max is -inf and x - m would be
// -inf - (-inf) = NaN. All versions then use m = 0, so every exp is 0, the sum is 0, and they
// write 0 (the convention of fused attention kernels; torch.softmax returns NaN there).
//
// kernels, simplest first (each line: what changed)
//   softmax_v1   naive: one thread per row, three passes over the row (max, sum, write);
//                neighbouring threads read addresses N apart: uncoalesced
//   softmax_v2   one block per row: the three passes are strided over the block's threads
//                (coalesced) and combined with shuffle + shared-memory block reductions
//   softmax_v3   one warp per row: warp shuffles only, no shared memory and no __syncthreads;
//                best for short rows (N <= ~1k) where a whole block per row would idle
//   softmax_v4   online softmax: ONE pass computes max and sum together (running max m and
//                running sum d, rescaled by exp(m_old - m_new) when the max grows), then one
//                pass writes. Reads x twice instead of three times. float4 when N % 4 == 0
//   softmax_v5   the row held in registers: x is read from memory exactly once. float4 when
//                N % 4 == 0 and x, y are 16-byte aligned (up to 32 floats per thread), scalar
//                loads otherwise (up to 16); a longer row does not fit and is streamed twice
//                instead (softmax_row_online, v4's body), so any N is right
//   softmax_v6   (sm_90) a row split over a thread-block cluster of C blocks (C = 2, 4, 8, 16,
//                chosen by the launcher from N, given at launch time): each block copies its
//                slice of the row (N / C floats) into shared memory with one bulk copy, so x is
//                read once whatever N (up to 262144 columns in 64 KiB per block). Each block's
//                (max, sum) of its slice, computed online, goes to every other block of the
//                cluster through distributed shared memory (st.async on the receivers'
//                mbarriers); every block merges the C pairs in rank order, so all of them scale
//                with the same max and sum. exp is taken once per element: the slice's
//                exp(x - the thread's max) stays in shared memory and is rescaled on the way
//                out. Rows that are not float4 rows are right but loaded and stored as scalars.
//                Below sm_90 it compiles to an empty body: launch it through
//                softmax_launch.softmax, which refuses below compute capability 9.0. No Numba
//                twin (the simulator has no clusters)
//
// The block reductions are common.cuh's block_max / block_sum; block_online merges (max, sum)
// pairs (common.cuh's block_reduce with SumMaxOp), which only the online softmax needs.
//
// traffic: at best 4 MN bytes read + 4 MN written = 8 MN (v5 up to 32k columns, v6). v2/v3 read
// x three times and v4 twice; the re-reads hit L1/L2 when the rows in flight fit there, and DRAM
// when they do not.
#include "common.cuh"
// mma.cuh: the mbarriers, bulk copy and cluster primitives of softmax_v6 (sm_90)
#include "mma.cuh"

// launch: grid = ceil_div(M, 128), block = 128, no shared memory
extern "C" __global__ void softmax_v1(const float* x, float* y, int M, int N) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M) return;
    const float* xr = x + (size_t)r * N;
    float* yr = y + (size_t)r * N;
    float m = -INFINITY;
    for (int j = 0; j < N; j++) m = fmaxf(m, xr[j]);            // pass 1: max
    m = safe_max(m);
    float d = 0.0f;
    for (int j = 0; j < N; j++) d += __expf(xr[j] - m);         // pass 2: sum
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < N; j++) yr[j] = __expf(xr[j] - m) * inv; // pass 3: write
}

// launch: grid = M, block = 256 (a multiple of 32, <= 1024), static shared memory 33 floats
extern "C" __global__ void softmax_v2(const float* x, float* y, int M, int N) {
    __shared__ float sbuf[BLOCK_REDUCE_SMEM];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < N; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = safe_max(block_max(m, sbuf));                    // common.cuh
    float d = 0.0f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) d += __expf(xr[j] - m);
    d = block_sum(d, sbuf);
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) yr[j] = __expf(xr[j] - m) * inv;
}

// launch: grid = ceil_div(M, 4), block = 128 (4 warps, one row each), no shared memory
extern "C" __global__ void softmax_v3(const float* x, float* y, int M, int N) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= M) return;                    // whole warps leave together: shuffles stay safe
    const float* xr = x + (size_t)r * N;
    float* yr = y + (size_t)r * N;
    float m = -INFINITY;
    for (int j = lane; j < N; j += 32) m = fmaxf(m, xr[j]);
    m = safe_max(warp_max(m));
    float d = 0.0f;
    for (int j = lane; j < N; j += 32) d += __expf(xr[j] - m);
    d = warp_sum(d);
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = lane; j < N; j += 32) yr[j] = __expf(xr[j] - m) * inv;
}

// online update: add value v to the running (m, d)
__device__ __forceinline__ void online_add(float& m, float& d, float v) {
    if (v > m) {                           // new max: rescale the sum collected so far
        d = d * __expf(m - v) + 1.0f;      // m = -inf at the start: exp(-inf) = 0, d = 1
        m = v;
    } else if (v != -INFINITY) {           // -inf adds exp(-inf) = 0 (and would give NaN)
        d += __expf(v - m);
    }
}

// (m, d) over the block, returned to every thread (common.cuh's block_reduce with SumMaxOp).
// sbuf: 66 floats
__device__ __forceinline__ void block_online(float& m, float& d, float* sbuf) {
    block_reduce(SumMax{d, m}, SumMaxOp{sbuf}, [=](SumMax r) {
        sbuf[64] = r.m;
        sbuf[65] = r.d;
    });
    m = sbuf[64];
    d = sbuf[65];
    __syncthreads();                       // everyone has read them: sbuf may be reused
}

// One row of the online softmax, by the whole block: one pass for (max, sum), one to write.
// float4 when the row and y are 16-byte aligned (N % 4 == 0 and aligned bases). sbuf: 66 floats
__device__ __forceinline__ void softmax_row_online(const float* xr, float* yr, int N,
                                                   float* sbuf) {
    float m = -INFINITY, d = 0.0f;
    bool vec = (N & 3) == 0 && aligned16(xr) && aligned16(yr);   // uniform over the block
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int j = threadIdx.x; j < N / 4; j += blockDim.x) {
            float4 v = x4[j];
            online_add(m, d, v.x); online_add(m, d, v.y);
            online_add(m, d, v.z); online_add(m, d, v.w);
        }
    } else {
        for (int j = threadIdx.x; j < N; j += blockDim.x) online_add(m, d, xr[j]);
    }
    block_online(m, d, sbuf);              // one pass gave both statistics
    m = safe_max(m);
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        float4* y4 = reinterpret_cast<float4*>(yr);
        for (int j = threadIdx.x; j < N / 4; j += blockDim.x) {
            float4 v = x4[j];
            v.x = __expf(v.x - m) * inv; v.y = __expf(v.y - m) * inv;
            v.z = __expf(v.z - m) * inv; v.w = __expf(v.w - m) * inv;
            y4[j] = v;
        }
    } else {
        for (int j = threadIdx.x; j < N; j += blockDim.x) yr[j] = __expf(xr[j] - m) * inv;
    }
}

// launch: grid = M, block = 256 (multiple of 32, <= 1024), static shared memory 66 floats
extern "C" __global__ void softmax_v4(const float* x, float* y, int M, int N) {
    __shared__ float sbuf[66];
    softmax_row_online(x + (size_t)blockIdx.x * N, y + (size_t)blockIdx.x * N, N, sbuf);
}

#define SOFTMAX_V5_REGS 32                 // floats of the row each thread holds in registers
#define SOFTMAX_V5_REGS_SCALAR 16          // the same without float4 (an index per element)

// launch: grid = M, block = T, a multiple of 32 <= 1024 with N <= 16 T for the row to stay in
// registers (T = row_block(N) = clamp(round_up(N / 16, 32), 32, 1024) does that up to N = 16384;
// the float4 path holds up to 32 T); static shared memory 66 floats. Any N is right: a longer
// row is streamed.
extern "C" __global__ void __launch_bounds__(1024) softmax_v5(const float* x, float* y, int M,
                                                                 int N) {
    __shared__ float sbuf[66];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y);        // uniform over the grid
    if (N > (vec ? SOFTMAX_V5_REGS : SOFTMAX_V5_REGS_SCALAR) * (int)blockDim.x) {
        softmax_row_online(xr, yr, N, sbuf);          // does not fit in registers: v4's way
        return;
    }
    float d = 0.0f, m = -INFINITY;
    if (vec) {                                        // float4: 8 vectors per thread
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        float4* y4 = reinterpret_cast<float4*>(yr);
        int N4 = N / 4;
        float4 r[SOFTMAX_V5_REGS / 4];
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS / 4; k++) {      // unrolled: r[] stays in registers
            int j = threadIdx.x + k * blockDim.x;
            r[k] = (j < N4) ? x4[j] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
            m = fmaxf(m, fmaxf(fmaxf(r[k].x, r[k].y), fmaxf(r[k].z, r[k].w)));
        }
        // with the row in registers, max then sum costs no extra memory traffic
        m = safe_max(block_max(m, sbuf));
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS / 4; k++) {
            r[k].x = __expf(r[k].x - m); r[k].y = __expf(r[k].y - m);
            r[k].z = __expf(r[k].z - m); r[k].w = __expf(r[k].w - m);
            d += (r[k].x + r[k].y) + (r[k].z + r[k].w);
        }
        d = block_sum(d, sbuf);
        float inv = d > 0.0f ? 1.0f / d : 0.0f;
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS / 4; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N4) y4[j] = make_float4(r[k].x * inv, r[k].y * inv, r[k].z * inv,
                                            r[k].w * inv);
        }
    } else {                                                // rows not 16-byte aligned: scalars
        float r[SOFTMAX_V5_REGS_SCALAR];
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS_SCALAR; k++) {
            int j = threadIdx.x + k * blockDim.x;
            r[k] = (j < N) ? xr[j] : -INFINITY;
            m = fmaxf(m, r[k]);
        }
        m = safe_max(block_max(m, sbuf));
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS_SCALAR; k++) {
            r[k] = __expf(r[k] - m);
            d += r[k];
        }
        d = block_sum(d, sbuf);
        float inv = d > 0.0f ? 1.0f / d : 0.0f;
#pragma unroll
        for (int k = 0; k < SOFTMAX_V5_REGS_SCALAR; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < N) yr[j] = r[k] * inv;
        }
    }
}

// launch (sm_90): grid = C M blocks in clusters of C along x (a launch-time cluster dimension,
// C = 2, 4, 8 or 16; 16 is a non-portable size), block T (a multiple of 32, C <= T <= 512),
// dynamic shared memory 4 L bytes with L = round_up(ceil(N / C), 4): block r of cluster m holds
// columns [r L, min(N, (r + 1) L)) of row m (none for a tiny N's last ranks). A launch with less
// dynamic shared memory than that writes nothing.
extern "C" __global__ void __launch_bounds__(512) softmax_v6(const float* x, float* y, int M,
                                                                int N) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float4 slice4[];     // [L / 4]: this block's columns of the row
    __shared__ float sbuf[66];
    __shared__ float4 inbox[16];           // block r's (max, sum) at [r]
    __shared__ __align__(8) unsigned long long bars[2];    // [0]: the slice's load, [1]: inbox
    const ClusterRow cr = cluster_row(N);
    if (!cr.fits || cr.row >= M) return;                         // uniform over the cluster
    const int T = blockDim.x, t = threadIdx.x, row = cr.row, n = cr.n, n4 = cr.n4;
    const bool vec = (N & 3) == 0 && aligned16(x) && aligned16(y);   // uniform over the grid
    float* slice = reinterpret_cast<float*>(slice4);
    cluster_row_start(x + (size_t)row * N + cr.lo, n, cr.C, vec, -INFINITY, slice, bars);
    float m = -INFINITY;                   // this thread's max, then its sum of exp(x - m)
#pragma unroll 4
    for (int j = t; j < n4; j += T) {
        float4 v = slice4[j];
        m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    const float mt = safe_max(m);          // -inf (no element, or all -inf): exp gives 0
    float d = 0.0f;
#pragma unroll 4
    for (int j = t; j < n4; j += T) {      // exp once per element, kept for the write
        float4 v = slice4[j];
        v.x = __expf(v.x - mt); v.y = __expf(v.y - mt);
        v.z = __expf(v.z - mt); v.w = __expf(v.w - mt);
        d += (v.x + v.y) + (v.z + v.w);
        slice4[j] = v;
    }
    float mb = m, db = d;                  // (-inf, 0) is the identity of the merge
    block_online(mb, db, sbuf);            // this block's slice
    cluster_wait();                        // every block's inbox barrier exists
    const float4 mine = make_float4(mb, db, 0.0f, 0.0f);
    cluster_allgather16(mine, inbox, &bars[1], 0);
    float rm = -INFINITY, rd = 0.0f;       // the row's, merged in rank order in every block
    for (int r = 0; r < cr.C; r++) {
        float4 p = inbox[r];
        if (r == cr.rank) p = mine;        // its own part (inbox[rank] stays unwritten)
        online_merge(rm, rd, p.x, p.y);
    }
    cluster_arrive();                      // the exit barrier's first half: no st.async in flight
    rm = safe_max(rm);
    const float inv = rd > 0.0f ? 1.0f / rd : 0.0f;
    const float scale = m == -INFINITY ? 0.0f : __expf(m - rm) * inv;   // m <= rm: no overflow
    if (vec) {
        float4* y4 = reinterpret_cast<float4*>(y + (size_t)row * N + cr.lo);
#pragma unroll 4
        for (int j = t; j < n4; j += T) {
            float4 v = slice4[j];
            y4[j] = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
        }
    } else {
        float* yr = y + (size_t)row * N + cr.lo;
        for (int j = t; j < n4; j += T) {
#pragma unroll
            for (int c = 0; c < 4; c++)
                if (4 * j + c < n) yr[4 * j + c] = slice[4 * j + c] * scale;
        }
    }
    cluster_wait();                        // no block leaves while a partner may still send
#endif
}
