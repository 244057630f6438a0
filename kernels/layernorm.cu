// layernorm.cu: LayerNorm and RMSNorm forward over the last dimension (Chapter 3).
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
//   layernorm_v3  the row held in registers (float4, up to 32 floats per thread): x is read
//                 once, the exact two-pass statistics come from registers, the fused affine
//                 pass writes y. Needs N % 4 == 0 and N <= 32 * blockDim.x
//   rmsnorm_v1    RMSNorm, one block per row, any N (one statistic: no mean to subtract)
//   rmsnorm_v2    RMSNorm with the row in registers, as layernorm_v3
//
// traffic: 4 MN read + 4 MN written (+ 8 N for gamma, beta) at best (v3, rmsnorm_v2).
// Accuracy: var = E[x^2] - E[x]^2 in one pass cancels catastrophically when |mean| >> std;
// Welford and the two-pass form do not.
#include "common.cuh"

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

// Welford state of a set of values: count, mean, M2 = sum (v - mean)^2
struct Welford { float n, mean, m2; };

__device__ __forceinline__ void welford_add(Welford& w, float v) {
    w.n += 1.0f;
    float delta = v - w.mean;
    w.mean += delta / w.n;
    w.m2 += delta * (v - w.mean);
}

// Chan et al.: merge two Welford states
__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
    float n = a.n + b.n;
    if (n == 0.0f) return a;
    float delta = b.mean - a.mean, fb = b.n / n;
    Welford r;
    r.n = n;
    r.mean = a.mean + delta * fb;
    r.m2 = a.m2 + b.m2 + delta * delta * a.n * fb;
    return r;
}

__device__ __forceinline__ Welford welford_shfl(Welford w, int o) {
    Welford r;
    r.n = __shfl_xor_sync(0xffffffffu, w.n, o);
    r.mean = __shfl_xor_sync(0xffffffffu, w.mean, o);
    r.m2 = __shfl_xor_sync(0xffffffffu, w.m2, o);
    return r;
}

// launch: grid = M, block = 256 (multiple of 32, <= 1024), static shared memory 99 floats
extern "C" __global__ void layernorm_v2(const float* x, const float* gamma, const float* beta,
                                        float* y, int M, int N, float eps) {
    __shared__ float sbuf[3 * 33];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    Welford w = {0.0f, 0.0f, 0.0f};
    for (int j = threadIdx.x; j < N; j += blockDim.x) welford_add(w, xr[j]);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) w = welford_merge(w, welford_shfl(w, o));
    if (lane == 0) { sbuf[warp] = w.n; sbuf[33 + warp] = w.mean; sbuf[66 + warp] = w.m2; }
    __syncthreads();
    if (warp == 0) {
        w.n = lane < nw ? sbuf[lane] : 0.0f;
        w.mean = lane < nw ? sbuf[33 + lane] : 0.0f;
        w.m2 = lane < nw ? sbuf[66 + lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) w = welford_merge(w, welford_shfl(w, o));
        if (lane == 0) { sbuf[32] = w.mean; sbuf[65] = rsqrtf(w.m2 / N + eps); }
    }
    __syncthreads();
    float mean = sbuf[32], rstd = sbuf[65];
    for (int j = threadIdx.x; j < N; j += blockDim.x)       // fused: normalise and affine
        yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
}

// sum over the block, returned to every thread. sbuf: 33 floats
__device__ __forceinline__ float ln_block_allsum(float v, float* sbuf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sbuf[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = (lane < nw) ? sbuf[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) sbuf[32] = w;
    }
    __syncthreads();
    float r = sbuf[32];
    __syncthreads();
    return r;
}

#define LN_VEC 8                           // float4 per thread held in registers (32 floats)

// launch: grid = M, block = T with N / 4 <= 8 T (T a multiple of 32, <= 1024, e.g.
// T = clamp(round_up(N / 16, 32), 32, 1024)), static shared memory 33 floats; N % 4 == 0
extern "C" __global__ void __launch_bounds__(1024) layernorm_v3(
        const float* x, const float* gamma, const float* beta, float* y, int M, int N,
        float eps) {
    __shared__ float sbuf[33];
    const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * N);
    float4* y4 = reinterpret_cast<float4*>(y + (size_t)blockIdx.x * N);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    const float4* b4 = reinterpret_cast<const float4*>(beta);
    int N4 = N / 4;
    float4 r[LN_VEC];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < LN_VEC; k++) {
        int j = threadIdx.x + k * blockDim.x;
        r[k] = (j < N4) ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        s += (r[k].x + r[k].y) + (r[k].z + r[k].w);
    }
    float mean = ln_block_allsum(s, sbuf) / N;
    float q = 0.0f;                        // second pass over registers: sum (x - mean)^2
#pragma unroll
    for (int k = 0; k < LN_VEC; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < N4) {
            float a = r[k].x - mean, b = r[k].y - mean, c = r[k].z - mean, d = r[k].w - mean;
            q += (a * a + b * b) + (c * c + d * d);
        }
    }
    float rstd = rsqrtf(ln_block_allsum(q, sbuf) / N + eps);
#pragma unroll
    for (int k = 0; k < LN_VEC; k++) {
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
}

// launch: grid = M, block = 256 (multiple of 32, <= 1024), static shared memory 33 floats
extern "C" __global__ void rmsnorm_v1(const float* x, const float* gamma, float* y, int M, int N,
                                      float eps) {
    __shared__ float sbuf[33];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    float q = 0.0f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) q += xr[j] * xr[j];
    float rrms = rsqrtf(ln_block_allsum(q, sbuf) / N + eps);
    for (int j = threadIdx.x; j < N; j += blockDim.x) yr[j] = xr[j] * rrms * gamma[j];
}

// launch: as layernorm_v3 (block T with N / 4 <= 8 T), N % 4 == 0
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_v2(
        const float* x, const float* gamma, float* y, int M, int N, float eps) {
    __shared__ float sbuf[33];
    const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * N);
    float4* y4 = reinterpret_cast<float4*>(y + (size_t)blockIdx.x * N);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    int N4 = N / 4;
    float4 r[LN_VEC];
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < LN_VEC; k++) {
        int j = threadIdx.x + k * blockDim.x;
        r[k] = (j < N4) ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        q += (r[k].x * r[k].x + r[k].y * r[k].y) + (r[k].z * r[k].z + r[k].w * r[k].w);
    }
    float rrms = rsqrtf(ln_block_allsum(q, sbuf) / N + eps);
#pragma unroll
    for (int k = 0; k < LN_VEC; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < N4) {
            float4 g = g4[j], v = r[k];
            y4[j] = make_float4(v.x * rrms * g.x, v.y * rrms * g.y, v.z * rrms * g.z,
                                v.w * rrms * g.w);
        }
    }
}
