// layernorm_train.cu: LayerNorm for training (the capstone's GPT step). The forward may add the
// residual first and saves the row statistics; the backward gives dx, and dw, db summed over the
// rows in a fixed order (bitwise repeatable, no atomics).
//
// Shapes (row-major, contiguous, every pointer 16-byte aligned; C a multiple of 8, 8 <= C <= 8192):
//   x (M, C) fp32          the residual stream
//   residual (M, C) bf16   the branch's output (optional; null: no add)
//   x_out (M, C) fp32      x + float(residual), written when residual is given (may be x itself)
//                          and then the tensor that is normalised
//   w, b (C,) fp32         LayerNorm's weight and bias
//   y (M, C) bf16          bf16((x - mean) * rstd * w + b), computed in fp32 and rounded once
//   mean, rstd (M,) fp32   biased variance, rstd = 1 / sqrt(var + eps) (torch.layer_norm)
// backward:
//   dy (M, C) bf16         the gradient of y
//   dx (M, C) fp32         dx += grad_x (accumulate = 1: the residual stream sums its branches'
//                          gradients) or dx = grad_x (accumulate = 0: dx is not read)
//   dx16 (M, C) bf16       bf16(dx) after the update (optional; null: not written)
//   dw, db (C,) fp32       += sum over the rows of dy * xhat and of dy
// with xhat = (x - mean) * rstd and
//   grad_x = rstd * (w dy - mean_c(w dy) - xhat * mean_c(w dy xhat))
//
// versions
//   layernorm_train_v1  one warp per row with scalar loads: the forward reads the row three
//                       times (sum, squared deviations, output), the backward's dx kernel
//                       twice; a second kernel, one thread per column, reads dy and x again to
//                       sum dw and db down the columns
//     kernels: layernorm_train_fwd_v1; layernorm_train_bwd_v1 (dx), layernorm_train_dwdb_v1
//   layernorm_train_v2  the row in registers, 16-byte loads and stores: a row group of W warps
//                       owns a row, each thread 8-column chunks c = t, t + 32W, ... (at most
//                       LNT_CHUNKS, so W = ceil(C / (8 * 32 * LNT_CHUNKS)), one warp up to
//                       C = 1024), R = 256 / 32W row groups per block. The backward reads dy and
//                       x once: the same pass gives dx and adds dy * xhat, dy into per-thread
//                       column sums over the block's rows (a block takes rows blockIdx.x * R +
//                       g, then + gridDim.x * R, ...); a block's R groups are combined through
//                       shared memory in group order into part, and a second kernel sums part's
//                       rows in a fixed order into dw, db
//     kernels: layernorm_train_fwd_v2; layernorm_train_bwd_v2, layernorm_train_finalize_v2
//
// Every sum has a fixed order (the warp butterfly, then the group's warps in order; the column
// sums row after row, then by group, then by block), so repeated runs are bitwise equal.
// traffic, forward v2: 4 MC read (+ 2 MC residual, + 4 MC x_out written) + 2 MC written;
// backward v2: 2 MC dy + 4 MC x read, 4 MC dx written (+ 4 MC read when accumulating, + 2 MC
// dx16), plus 8 C per block of partials written and read once by the finalize kernel.
#include "common.cuh"
// mma.cuh: pack_bf162 (two floats rounded into one register of two bf16) and cuda_bf16.h
#include "mma.cuh"

#define LNT_CHUNKS 4        // v2: 8-column chunks per thread (32 floats of the row in registers)
#define LNT_THREADS 256     // v2: threads per block at most (R row groups of 32 W threads)
#define LNT_MAX_WARPS (LNT_THREADS / 32)

// ---------------------------------------------------------------------------- bf16 helpers
// A bf16 is the top half of an fp32: widening is exact, a shift. Element 2i is the low half of
// 32-bit word i (little endian).
__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
}

// 8 bf16 (16 bytes) -> 8 floats
__device__ __forceinline__ void unpack_bf16x8(uint4 u, float* f) {
    const unsigned* p = &u.x;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(p[i] << 16);
        f[2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
    }
}

// 8 floats -> 8 bf16 (16 bytes), each rounded to nearest even
__device__ __forceinline__ uint4 pack_bf16x8(const float* f) {
    return make_uint4(pack_bf162(f[0], f[1]), pack_bf162(f[2], f[3]), pack_bf162(f[4], f[5]),
                      pack_bf162(f[6], f[7]));
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// ---------------------------------------------------------------------------- v1
// launch: grid = ceil_div(M, 4), block = 128 (four warps, one row each), no shared memory
extern "C" __global__ void layernorm_train_fwd_v1(
        const float* x, const unsigned short* residual, float* x_out, const float* w,
        const float* b, unsigned short* y, float* mean, float* rstd, int M, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= M) return;                        // the whole warp leaves: full-mask shuffles
    size_t base = (size_t)row * C;
    const float* src = x + base;                 // the row that is normalised
    float s = 0.0f;
    if (residual) {                              // x_out = x + residual, then normalise x_out
        float* xo = x_out + base;
        for (int j = lane; j < C; j += 32) {
            float v = src[j] + bf16_bits_to_float(residual[base + j]);
            xo[j] = v;                           // read back below by this same lane
            s += v;
        }
        src = xo;
    } else {
        for (int j = lane; j < C; j += 32) s += src[j];
    }
    float mu = warp_sum(s) / C;
    float q = 0.0f;
    for (int j = lane; j < C; j += 32) {
        float d = src[j] - mu;
        q += d * d;
    }
    float rs = rsqrtf(warp_sum(q) / C + eps);
    for (int j = lane; j < C; j += 32)
        y[base + j] = float_to_bf16_bits((src[j] - mu) * rs * w[j] + b[j]);
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

// launch: grid = ceil_div(M, 4), block = 128 (four warps, one row each), no shared memory
extern "C" __global__ void layernorm_train_bwd_v1(
        const unsigned short* __restrict__ dy, const float* __restrict__ x,
        const float* __restrict__ w, const float* __restrict__ mean,
        const float* __restrict__ rstd, float* __restrict__ dx, unsigned short* __restrict__ dx16,
        int M, int C, int accumulate) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= M) return;
    size_t base = (size_t)row * C;
    float mu = mean[row], rs = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;                  // sums of w dy and of w dy xhat
    for (int j = lane; j < C; j += 32) {
        float wd = w[j] * bf16_bits_to_float(dy[base + j]);
        s1 += wd;
        s2 += wd * ((x[base + j] - mu) * rs);
    }
    float m1 = warp_sum(s1) / C, m2 = warp_sum(s2) / C;
    for (int j = lane; j < C; j += 32) {
        float wd = w[j] * bf16_bits_to_float(dy[base + j]);
        float g = rs * (wd - m1 - ((x[base + j] - mu) * rs) * m2);
        float v = accumulate ? dx[base + j] + g : g;
        dx[base + j] = v;
        if (dx16) dx16[base + j] = float_to_bf16_bits(v);
    }
}

// dw[j] += sum_i dy[i, j] xhat[i, j], db[j] += sum_i dy[i, j], rows in order
// launch: grid = ceil_div(C, 128), block = 128 (one thread per column), no shared memory
extern "C" __global__ void layernorm_train_dwdb_v1(
        const unsigned short* __restrict__ dy, const float* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* __restrict__ dw,
        float* __restrict__ db, int M, int C) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int i = 0; i < M; i++) {
        size_t k = (size_t)i * C + j;
        float d = bf16_bits_to_float(dy[k]);
        sw += d * ((x[k] - mean[i]) * rstd[i]);
        sb += d;
    }
    dw[j] += sw;
    db[j] += sb;
}

// ---------------------------------------------------------------------------- v2
// Threads per row group: 32 W with W = ceil(C/8 / (32 LNT_CHUNKS)) warps, so that every thread
// holds at most LNT_CHUNKS chunks of 8 columns (kernels/layernorm_train_launch.py: the same rule)
__device__ __forceinline__ int lnt_group_threads(int C) {
    return 32 * ceil_div(C / 8, 32 * LNT_CHUNKS);
}

// v summed over the row group of this thread (W warps, consecutive in the block); every thread
// of the group gets the sum: the warp butterfly, then the group's W warp sums in order. Every
// thread of the block calls it (barriers when W > 1; W is the same for the whole block).
// s: LNT_MAX_WARPS floats of shared memory, free again when the call returns.
__device__ __forceinline__ float group_sum(float v, float* s, int W) {
    v = warp_sum(v);
    if (W == 1) return v;
    int warp = threadIdx.x >> 5, first = warp - warp % W;
    if ((threadIdx.x & 31) == 0) s[warp] = v;
    __syncthreads();                             // every warp's sum is written
    float r = 0.0f;
    for (int i = 0; i < W; i++) r += s[first + i];
    __syncthreads();                             // everyone has read: s may be written again
    return r;
}

// the same for two values at once (one pair of barriers); s: 2 * LNT_MAX_WARPS floats
__device__ __forceinline__ float2 group_sum2(float a, float b, float* s, int W) {
    a = warp_sum(a);
    b = warp_sum(b);
    if (W == 1) return make_float2(a, b);
    int warp = threadIdx.x >> 5, first = warp - warp % W;
    if ((threadIdx.x & 31) == 0) {
        s[warp] = a;
        s[LNT_MAX_WARPS + warp] = b;
    }
    __syncthreads();
    float ra = 0.0f, rb = 0.0f;
    for (int i = 0; i < W; i++) {
        ra += s[first + i];
        rb += s[LNT_MAX_WARPS + first + i];
    }
    __syncthreads();
    return make_float2(ra, rb);
}

// 8 floats as two float4 stores at p (16-byte aligned)
__device__ __forceinline__ void store_f32x8(float* p, const float* f) {
    float4* q = reinterpret_cast<float4*>(p);
    q[0] = make_float4(f[0], f[1], f[2], f[3]);
    q[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// 8 floats from two float4 loads at p (16-byte aligned)
__device__ __forceinline__ void load_f32x8(const float* p, float* f) {
    const float4* q = reinterpret_cast<const float4*>(p);
    float4 a = q[0], b = q[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 8 floats of w (or b) from two ld_keep16: every row reads them again
__device__ __forceinline__ void keep_f32x8(const float* p, float* f) {
    float4 a = ld_keep16(p), b = ld_keep16(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// The block's column sums a (its R groups' registers) into out (C,): with R > 1 through comb
// (R, C) in shared memory, added in group order. Every thread of the block calls it.
__device__ __forceinline__ void block_columns(const float (&a)[LNT_CHUNKS][8], float* out,
                                              float* comb, int R, int g, int t, int tpr, int C) {
    int C8 = C / 8;
    if (R == 1) {                                // one group: its sums are the block's
#pragma unroll
        for (int k = 0; k < LNT_CHUNKS; k++)
            if (t + k * tpr < C8) store_f32x8(out + 8 * (t + k * tpr), a[k]);
        return;
    }
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++)
        if (t + k * tpr < C8) store_f32x8(comb + (size_t)g * C + 8 * (t + k * tpr), a[k]);
    __syncthreads();                             // every group's sums are in comb
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < R; r++) acc += comb[r * C + j];
        out[j] = acc;
    }
    __syncthreads();                             // comb is read before it is written again
}

// launch: grid = ceil_div(M, R), block = 32 W R (W, R above; at most 256), static shared
// memory 8 floats
extern "C" __global__ void __launch_bounds__(LNT_THREADS) layernorm_train_fwd_v2(
        const float* x, const unsigned short* __restrict__ residual, float* x_out,
        const float* __restrict__ w, const float* __restrict__ b, unsigned short* __restrict__ y,
        float* __restrict__ mean, float* __restrict__ rstd, int M, int C, float eps) {
    __shared__ float s[LNT_MAX_WARPS];
    int C8 = C / 8, tpr = lnt_group_threads(C), W = tpr / 32;
    int t = threadIdx.x % tpr;
    int row = blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    bool ok = row < M;                           // a thread past the last row still reaches
    size_t base = (size_t)(ok ? row : 0) * C;    // the barriers of group_sum
    float v[LNT_CHUNKS][8];
    uint4 ra[LNT_CHUNKS];
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++) {       // issue every load first
        int c = t + k * tpr;
        if (ok && c < C8) {
            load_f32x8(x + base + 8 * c, v[k]);
            if (residual) ra[k] = *reinterpret_cast<const uint4*>(residual + base + 8 * c);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[k][e] = 0.0f;
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++) {
        int c = t + k * tpr;
        if (ok && c < C8) {
            if (residual) {                      // x_out = x + residual (x_out may be x)
                float r[8];
                unpack_bf16x8(ra[k], r);
#pragma unroll
                for (int e = 0; e < 8; e++) v[k][e] += r[e];
                store_f32x8(x_out + base + 8 * c, v[k]);
            }
#pragma unroll
            for (int e = 0; e < 8; e++) sum += v[k][e];
        }
    }
    float mu = group_sum(sum, s, W) / C;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++) {
        if (ok && t + k * tpr < C8) {
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float d = v[k][e] - mu;
                q += d * d;
            }
        }
    }
    float rs = rsqrtf(group_sum(q, s, W) / C + eps);
    if (!ok) return;                             // no barrier follows
    if (t == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++) {
        int c = t + k * tpr;
        if (c < C8) {
            float wv[8], bv[8], o[8];
            keep_f32x8(w + 8 * c, wv);
            keep_f32x8(b + 8 * c, bv);
#pragma unroll
            for (int e = 0; e < 8; e++) o[e] = (v[k][e] - mu) * rs * wv[e] + bv[e];
            *reinterpret_cast<uint4*>(y + base + 8 * c) = pack_bf16x8(o);
        }
    }
}

// dx for the row group's rows, and this block's partial column sums of dy * xhat (dw) and dy
// (db) into part (2, gridDim.x, C): part[0][blockIdx.x] and part[1][blockIdx.x]. A thread adds
// its columns' terms row after row in registers; block_columns adds the R groups in order.
// launch: grid = G = min(ceil_div(M, R), LNT_BWD_BLOCKS of the launcher), block = 32 W R (as
// the forward), static shared memory 16 floats, dynamic shared memory R * C floats when R > 1
// (at most 32 KiB: R W <= 8 and C <= 1024 W), else none
extern "C" __global__ void __launch_bounds__(LNT_THREADS) layernorm_train_bwd_v2(
        const unsigned short* __restrict__ dy, const float* __restrict__ x,
        const float* __restrict__ w, const float* __restrict__ mean,
        const float* __restrict__ rstd, float* __restrict__ dx, unsigned short* __restrict__ dx16,
        float* __restrict__ part, int M, int C, int accumulate) {
    __shared__ float s[2 * LNT_MAX_WARPS];
    extern __shared__ float4 comb4[];            // float4: 16-byte aligned
    int C8 = C / 8, tpr = lnt_group_threads(C), W = tpr / 32;
    int R = blockDim.x / tpr, g = threadIdx.x / tpr, t = threadIdx.x % tpr;
    float dwa[LNT_CHUNKS][8], dba[LNT_CHUNKS][8];
#pragma unroll
    for (int k = 0; k < LNT_CHUNKS; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) dwa[k][e] = dba[k][e] = 0.0f;

    // r0 is the same for the whole block: every thread runs the same iterations (barriers)
    for (int r0 = blockIdx.x * R; r0 < M; r0 += gridDim.x * R) {
        int row = r0 + g;
        bool ok = row < M;
        size_t base = (size_t)(ok ? row : 0) * C;
        float mu = ok ? mean[row] : 0.0f, rs = ok ? rstd[row] : 0.0f;
        float xh[LNT_CHUNKS][8];
        uint4 d16[LNT_CHUNKS];
#pragma unroll
        for (int k = 0; k < LNT_CHUNKS; k++) {   // issue every load first
            int c = t + k * tpr;
            if (ok && c < C8) {
                load_f32x8(x + base + 8 * c, xh[k]);
                d16[k] = *reinterpret_cast<const uint4*>(dy + base + 8 * c);
            }
        }
        float s1 = 0.0f, s2 = 0.0f;              // sums of w dy and of w dy xhat
#pragma unroll
        for (int k = 0; k < LNT_CHUNKS; k++) {
            int c = t + k * tpr;
            if (ok && c < C8) {
                float wv[8], d[8];
                keep_f32x8(w + 8 * c, wv);
                unpack_bf16x8(d16[k], d);
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    xh[k][e] = (xh[k][e] - mu) * rs;
                    float wd = wv[e] * d[e];
                    s1 += wd;
                    s2 += wd * xh[k][e];
                    dwa[k][e] += d[e] * xh[k][e];
                    dba[k][e] += d[e];
                }
            }
        }
        float2 m = group_sum2(s1, s2, s, W);
        float m1 = m.x / C, m2 = m.y / C;
        if (ok) {
#pragma unroll
            for (int k = 0; k < LNT_CHUNKS; k++) {
                int c = t + k * tpr;
                if (c < C8) {
                    float wv[8], d[8], o[8];
                    keep_f32x8(w + 8 * c, wv);
                    unpack_bf16x8(d16[k], d);
#pragma unroll
                    for (int e = 0; e < 8; e++) o[e] = rs * (wv[e] * d[e] - m1 - xh[k][e] * m2);
                    if (accumulate) {
                        float a[8];
                        load_f32x8(dx + base + 8 * c, a);
#pragma unroll
                        for (int e = 0; e < 8; e++) o[e] += a[e];
                    }
                    store_f32x8(dx + base + 8 * c, o);
                    if (dx16) *reinterpret_cast<uint4*>(dx16 + base + 8 * c) = pack_bf16x8(o);
                }
            }
        }
    }
    // the block's partials: part[0][blockIdx.x][:] (dw), then part[1][blockIdx.x][:] (db)
    float* comb = reinterpret_cast<float*>(comb4);
    block_columns(dwa, part + (size_t)blockIdx.x * C, comb, R, g, t, tpr, C);
    block_columns(dba, part + ((size_t)gridDim.x + blockIdx.x) * C, comb, R, g, t, tpr, C);
}

// dw[j] += sum over the P partial rows of part[0][:, j], db[j] likewise with part[1]: thread row
// ty adds partials ty, ty + 8, ... in order, then thread row 0 adds the 8 sums in order.
// launch: grid = (ceil_div(C, 32), 2) (y: dw or db), block = (32, 8), static shared 8 x 33 floats
extern "C" __global__ void layernorm_train_finalize_v2(const float* __restrict__ part,
                                                       float* __restrict__ dw,
                                                       float* __restrict__ db, int P, int C) {
    __shared__ float sh[8][33];
    int tx = threadIdx.x, ty = threadIdx.y, j = blockIdx.x * 32 + tx;
    const float* p = part + (size_t)blockIdx.y * P * C;
    float acc = 0.0f;
    if (j < C)
        for (int i = ty; i < P; i += 8) acc += p[(size_t)i * C + j];
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && j < C) {
        float tot = 0.0f;
        for (int i = 0; i < 8; i++) tot += sh[i][tx];
        float* out = blockIdx.y ? db : dw;
        out[j] += tot;
    }
}
