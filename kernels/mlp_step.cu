// mlp_step.cu: a whole training step of Chapter 6's MLP in two kernels (Chapter 6).
//
// The model: x (M, K) -> h = x W1 + b1 (M, H) -> a = gelu_tanh(h) -> z = a W2 + b2 (M, C)
// -> mean softmax cross-entropy against labels y (M,) int32; then AdamW on every parameter.
// P, G, m, v are ONE flat float32 buffer each (Chapter 6's layout): W1 (K, H) row-major at oW1,
// b1 (H,) at ob1, W2 (H, C) at oW2, b2 (C,) at ob2; n floats in all, the gaps between views
// zero. G receives the step's gradient (it is an output, kept for inspection).
//
// Why two kernels. Everything up to the first layer's input gradient is row-local: a row's
// logits need only that row of x and the weights; its loss gradient dz = (softmax - onehot) / M
// only its logits; dh = (dz W2^T) * gelu'(h) only dz and h. Only the weight gradients sum over
// rows. So kernel 1 gives each block R rows and takes them forward and back, ending with the
// block's share of every gradient (x_r^T dh_r, a_r^T dz_r, the bias sums): R rows never leave
// shared memory. Kernel 2 sums the shares in a fixed order (deterministic: no atomics) and
// applies AdamW to the flat buffer. Chapter 6's step, as separate kernels, writes h, a, z, dz,
// da and dh to global memory and launches 15 kernels; here the only intermediate in memory is
// the grid's gradient shares, read once.
//
// kernels
//   mlp_step_v1_rows     forward, loss, backward of MLP_ROWS rows per block; the block's share
//                        of every gradient into part[block]; block 0 counts the AdamW step
//   mlp_step_v1_update   G = the shares summed (block order); AdamW on P, m, v; the mean loss
//
// limits: C <= 32 (a lane per class), blockDim 256, smem 4 (R (K4 + 2H + C) + R + H C) bytes;
// the launcher (mlp_step_launch.py) checks them. A label outside [0, C) makes the loss and that
// row's gradient NaN, as cross_entropy_v1 does (a kernel cannot raise).
// traffic per step: x once, the weights once per block (from L2), part written and read once
// (blocks x n floats), P, G, m, v (28 n bytes).
// common.cuh: gelu_tanh, gelu_tanh_grad, warp_max, warp_sum, adamw_coef, adamw_param
#include "common.cuh"

#ifndef MLP_ROWS
#define MLP_ROWS 8          // rows of the batch per block of mlp_step_v1_rows
#endif

// launch: grid = ceil_div(M, MLP_ROWS), block = 256,
//         dynamic smem = 4 * (MLP_ROWS * (K4 + 2 H + C) + MLP_ROWS + H * C) bytes, K4 = K
//         rounded up to a multiple of 4 (the rows of x are read as float4)
extern "C" __global__ void __launch_bounds__(256) mlp_step_v1_rows(
    const float* __restrict__ x, const int* __restrict__ y, const float* __restrict__ P,
    float* __restrict__ part, float* __restrict__ loss_part, int* step, float* coef, int M,
    int K, int H, int C, int oW1, int ob1, int oW2, int ob2, int n, float inv_m, float lr,
    float beta1, float beta2) {
    constexpr int R = MLP_ROWS;
    const int K4 = (K + 3) & ~3;
    extern __shared__ float4 sm4[];
    float* xs = reinterpret_cast<float*>(sm4);   // (R, K4) the block's rows of x, zero-padded
    float* hs = xs + R * K4;      // (R, H) h, then dh in place
    float* as = hs + R * H;       // (R, H) a = gelu(h)
    float* ds = as + R * H;       // (R, C) dz
    float* ls = ds + R * C;       // (R,)   each row's loss
    float* w2 = ls + R;           // (H, C) W2: every warp walks all of it, twice
    const int r0 = blockIdx.x * R, tid = threadIdx.x, nt = blockDim.x;
    const float *W1 = P + oW1, *b1 = P + ob1, *W2 = P + oW2, *b2 = P + ob2;

    for (int e = tid; e < R * K4; e += nt) {                  // zeros past M and past K
        int r = e / K4, k = e - r * K4;
        xs[e] = r0 + r < M && k < K ? x[(long long)(r0 + r) * K + k] : 0.0f;
    }
    for (int e = tid; e < H * C; e += nt) w2[e] = W2[e];     // one coalesced pass, then smem
    __syncthreads();

    // 1. h = x W1 + b1 and a = gelu(h): a thread per column j, R rows at once (W1 read once);
    //    four k per pass: a float4 of each row of x, four loads of W1 in flight
    for (int j = tid; j < H; j += nt) {
        float acc[R] = {};
#pragma unroll 4
        for (int k = 0; k < K4; k += 4) {
            float w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) w[i] = k + i < K ? W1[(k + i) * H + j] : 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float4 xv = *reinterpret_cast<const float4*>(xs + r * K4 + k);
                acc[r] += xv.x * w[0] + xv.y * w[1] + xv.z * w[2] + xv.w * w[3];
            }
        }
        float bj = b1[j];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float h = acc[r] + bj;
            hs[r * H + j] = h;
            as[r * H + j] = gelu_tanh(h);
        }
    }
    __syncthreads();

    // 2. z = a W2 + b2, the row's loss and dz = (softmax(z) - onehot) / M: a warp per row,
    //    a lane per class (C <= 32); four partial sums break the chain of dependent adds
    const int lane = tid & 31, warp = tid >> 5;
    for (int r = warp; r < R; r += nt >> 5) {
        bool live = r0 + r < M;                               // the same for the whole warp
        float z = -INFINITY;
        if (lane < C) {
            float acc[4] = {b2[lane], 0.0f, 0.0f, 0.0f};
            const float* ar = as + r * H;
            int j = 0;
#pragma unroll 2
            for (; j + 4 <= H; j += 4)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] += ar[j + i] * w2[(j + i) * C + lane];
            for (; j < H; ++j) acc[0] += ar[j] * w2[j * C + lane];
            z = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        float mx = warp_max(z);                               // z - mx <= 0: exp cannot overflow
        float e = lane < C ? expf(z - mx) : 0.0f;
        float s = warp_sum(e);
        int yr = live ? y[r0 + r] : 0;
        bool ok = yr >= 0 && yr < C;
        float zy = __shfl_sync(0xffffffffu, z, ok ? yr : 0);
        float nan = __int_as_float(0x7fc00000);
        if (lane < C)
            ds[r * C + lane] = !live ? 0.0f : ok ? (e / s - (lane == yr ? 1.0f : 0.0f)) * inv_m : nan;
        if (lane == 0) ls[r] = !live ? 0.0f : ok ? logf(s) + mx - zy : nan;
    }
    __syncthreads();

    // 3. dh = (dz W2^T) * gelu'(h), written over h (each thread its own columns)
    for (int j = tid; j < H; j += nt) {
        float acc[R] = {};
        for (int c = 0; c < C; ++c) {
            float w = w2[j * C + c];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += ds[r * C + c] * w;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) hs[r * H + j] = acc[r] * gelu_tanh_grad(hs[r * H + j]);
    }
    __syncthreads();

    // 4. the block's share of each gradient, into its own slice of part (layout of P)
    float* g = part + (long long)blockIdx.x * n;
    for (int j = tid; j < H; j += nt) {
        float d[R], db = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            d[r] = hs[r * H + j];
            db += d[r];
        }
        g[ob1 + j] = db;                                      // db1 = sum_r dh
        for (int k = 0; k < K4; k += 4) {                     // dW1 = x^T dh, four rows of it
            float s[4] = {};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float4 xv = *reinterpret_cast<const float4*>(xs + r * K4 + k);
                s[0] += xv.x * d[r];
                s[1] += xv.y * d[r];
                s[2] += xv.z * d[r];
                s[3] += xv.w * d[r];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (k + i < K) g[oW1 + (k + i) * H + j] = s[i];
        }
    }
    for (int e = tid; e < H * C; e += nt) {                   // dW2 = a^T dz
        int j = e / C, c = e - j * C;
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) s += as[r * H + j] * ds[r * C + c];
        g[oW2 + e] = s;
    }
    if (tid < C) {                                            // db2 = sum_r dz
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) s += ds[r * C + tid];
        g[ob2 + tid] = s;
    }
    if (tid == 0) {
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) s += ls[r];
        loss_part[blockIdx.x] = s;
        if (blockIdx.x == 0) {            // the step count, for kernel 2's bias corrections
            int t = step[0] + 1;
            step[0] = t;
            adamw_coef(t, lr, beta1, beta2, coef);
        }
    }
}

// launch: grid = ceil_div(n, 256), block = 256. part is (nblk, n), zero in the gaps
extern "C" __global__ void mlp_step_v1_update(float* __restrict__ P, float* __restrict__ G,
                                              float* __restrict__ m, float* __restrict__ v,
                                              const float* __restrict__ part, int nblk, int n,
                                              const float* __restrict__ loss_part, float* loss,
                                              float inv_m, float lr, float beta1, float beta2,
                                              float eps, float wd, const float* coef) {
    if (blockIdx.x == 0 && threadIdx.x < 32) {                // the mean loss, in a fixed order
        float s = 0.0f;
        for (int b = threadIdx.x; b < nblk; b += 32) s += loss_part[b];
        s = warp_sum(s);
        if (threadIdx.x == 0) loss[0] = s * inv_m;
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gi = 0.0f;
#pragma unroll 16
    for (int b = 0; b < nblk; ++b) gi += part[(long long)b * n + i];
    G[i] = gi;
    float pi = P[i], mi = m[i], vi = v[i];
    adamw_param(pi, gi, mi, vi, lr, beta1, beta2, eps, wd, coef[0], coef[1]);   // common.cuh
    P[i] = pi;
    m[i] = mi;
    v[i] = vi;
}
