// rope.cu: rotary position embedding (RoPE), half-split convention; fp16 in and out, fp32 math.
//
//   A head vector x of dimension D at position p has its pairs (x[i], x[i + D/2]), i < D/2,
//   rotated by the angle p * theta_i, theta_i = base^(-2i/D):
//       y[i]       = x[i] cos - x[i + D/2] sin
//       y[i + D/2] = x[i + D/2] cos + x[i] sin
//   (GPT-NeoX and Llama pair i with i + D/2; GPT-J pairs 2i with 2i+1, "interleaved": not here.)
//
//   rope_v1      in place on rows of heads: x is (R, H, D) with a row stride (elements); row r is
//                at position pos0 + r % T (+ *pos_dev when pos_dev is not null). One thread per
//                pair: reads 2 halves, writes 2.
//   rope_qkv_v1  the QKV matmul's output split into heads, rotated and appended to the KV cache
//                in one pass: qkv (B*T, 3, H, D) -> q (B, H, T, D) rotated; k rotated and v
//                copied into the caches kc, vc (B, H, L, D) at positions pos..pos+T-1, and into
//                k_out, v_out (B, H, T, D) when they are not null (for prefill attention).
//                Replaces rope_v1 on q, rope_v1 on k and kv_append_v1 (kvcache.cu): 3 launches,
//                and qkv's q and k read and written twice, become 1.
//
// Launches (kernels/rope_launch.py): one thread per pair, grid ceil(pairs / 256) x 256.
// The angle is computed in fp32 (sincosf, not the fast __sincosf: positions up to 10^4 radians).
#include <cuda_fp16.h>
// common.cuh: rope_angle
#include "common.cuh"

// x: (R, H, D) fp16, row r at x + r * row_stride; R * H * D/2 threads
extern "C" __global__ void rope_v1(__half* x, int R, int T, int H, int D, long long row_stride,
                                   int pos0, const int* pos_dev, float log2_base) {
    int half_d = D / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * H * half_d) return;
    int i = (int)(idx % half_d);
    int h = (int)((idx / half_d) % H);
    int r = (int)(idx / ((long long)half_d * H));
    int p = pos0 + r % T + (pos_dev ? *pos_dev : 0);
    __half* row = x + r * row_stride + (long long)h * D;
    float c, s;
    rope_angle(p, i, D, log2_base, &c, &s);
    float a = __half2float(row[i]), b = __half2float(row[i + half_d]);
    row[i] = __float2half(a * c - b * s);
    row[i + half_d] = __float2half(b * c + a * s);
}

// qkv: (B*T, 3, H, D); q, k_out, v_out: (B, H, T, D); kc, vc: (B, H, L, D); B * T * H * D/2 threads
extern "C" __global__ void rope_qkv_v1(const __half* qkv, __half* q, __half* kc, __half* vc,
                                       __half* k_out, __half* v_out, int B, int T, int H, int D,
                                       int L, int pos0, const int* pos_dev, float log2_base) {
    int half_d = D / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * T * H * half_d) return;
    int i = (int)(idx % half_d);
    int h = (int)((idx / half_d) % H);
    int t = (int)((idx / ((long long)half_d * H)) % T);
    int b = (int)(idx / ((long long)half_d * H * T));
    int p = pos0 + t + (pos_dev ? *pos_dev : 0);
    if (p >= L) return;                       // the launcher refuses this; never write past the cache
    const __half* src = qkv + ((long long)b * T + t) * 3 * H * D + (long long)h * D;
    float c, s;
    rope_angle(p, i, D, log2_base, &c, &s);
    float q1 = __half2float(src[i]), q2 = __half2float(src[i + half_d]);
    const __half* ks = src + H * D;
    const __half* vs = src + 2 * H * D;
    float k1 = __half2float(ks[i]), k2 = __half2float(ks[i + half_d]);
    long long o = (((long long)b * H + h) * T + t) * D;          // (b, h, t, 0) of q, k_out, v_out
    long long oc = (((long long)b * H + h) * L + p) * D;         // (b, h, p, 0) of the caches
    __half qa = __float2half(q1 * c - q2 * s), qb = __float2half(q2 * c + q1 * s);
    __half ka = __float2half(k1 * c - k2 * s), kb = __float2half(k2 * c + k1 * s);
    q[o + i] = qa;
    q[o + i + half_d] = qb;
    kc[oc + i] = ka;
    kc[oc + i + half_d] = kb;
    vc[oc + i] = vs[i];
    vc[oc + i + half_d] = vs[i + half_d];
    if (k_out) {
        k_out[o + i] = ka;
        k_out[o + i + half_d] = kb;
        v_out[o + i] = vs[i];
        v_out[o + i + half_d] = vs[i + half_d];
    }
}
