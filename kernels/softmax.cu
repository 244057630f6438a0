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
//
// The block reductions are common.cuh's block_max / block_sum; block_online merges (max, sum)
// pairs (common.cuh's block_reduce with SumMaxOp), which only the online softmax needs.
//
// traffic: at best 4 MN bytes read + 4 MN written = 8 MN (v5). v2/v3 read x three times and v4
// twice; the re-reads hit L1/L2 when the rows in flight fit there, and DRAM when they do not.
#include "common.cuh"

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
