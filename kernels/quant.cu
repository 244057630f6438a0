// quant.cu: quantize and dequantize weights; pack and unpack int4 (two per byte).
//
//   w is (rows, K) float32, row-major. Quantization groups are G consecutive elements of a row
//   (G divides K): per-channel is G = K, per-group G = 32, 64, 128, ...; per-tensor is one
//   scale for everything (the launcher passes rows = 1, K = G = the element count to
//   group_scales, or any scale it computed). scale and zero are (rows, K / G) float32.
//
//   symmetric   q = clamp(rint(w / s), -qmax, qmax),        s = amax / qmax    (qmax = 2^(b-1)-1)
//   asymmetric  q = clamp(rint(w / s) + z, 0, 2^b - 1),     s = (hi - lo) / (2^b - 1),
//                                                           z = rint(-lo / s), lo <= 0 <= hi
//   A group of zeros (amax = 0, or hi = lo) gets s = 1 (so q = 0, z = 0): never a division by 0.
//   rint rounds to nearest, ties to even (__float2int_rn), the rounding numpy.rint uses.
//   q is stored as one byte: signed for symmetric (int8), unsigned for asymmetric (uint8).
//
//   group_scales   one warp per (row, group): the group's max |w| (or min and max), s and z
//   quantize       elementwise: q from w, s, z (z may be null: symmetric)
//   dequantize     elementwise: w' = (q - z) * s, as float32
//   pack_int4      n signed 4-bit values (int8 in [-8, 7]) -> ceil(n / 2) bytes: element 2i in
//                  the low nibble of byte i, element 2i + 1 in the high nibble (odd n: the
//                  last high nibble is 0)
//   unpack_int4    the inverse: nibble -> int8 with the sign bit (bit 3) extended
//
// Launches (kernels/quant_launch.py): group_scales grid ceil(rows * K / G / 4) x 128 (a warp
// per group); the others a grid-stride 1D grid of 256 threads.
#include "common.cuh"

extern "C" __global__ void group_scales(const float* __restrict__ w, float* __restrict__ scale,
                                        float* __restrict__ zero, int rows, int K, int G,
                                        int bits, int asym) {
    int lane = threadIdx.x & 31;
    long long grp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int ng = K / G;
    if (grp >= (long long)rows * ng) return;      // the whole warp leaves together
    long long r = grp / ng, g = grp % ng;
    const float* p = w + r * K + g * G;
    float lo = 0.0f, hi = 0.0f;                   // 0 always representable: lo <= 0 <= hi
    for (int i = lane; i < G; i += 32) {
        float v = p[i];
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
    }
    lo = -warp_max(-lo);
    hi = warp_max(hi);
    if (lane == 0) {
        float s, z = 0.0f;
        if (asym) {
            float levels = (float)((1 << bits) - 1);
            s = (hi > lo) ? (hi - lo) / levels : 1.0f;
            z = rintf(-lo / s);
        } else {
            float amax = fmaxf(hi, -lo), qmax = (float)((1 << (bits - 1)) - 1);
            s = (amax > 0.0f) ? amax / qmax : 1.0f;
        }
        scale[grp] = s;
        if (zero) zero[grp] = z;
    }
}

extern "C" __global__ void quantize(const float* __restrict__ w, const float* __restrict__ scale,
                                    const float* __restrict__ zero, unsigned char* __restrict__ q,
                                    long long n, int K, int G, int qmin, int qmax) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long grp = (i / K) * (K / G) + (i % K) / G;
        int v = __float2int_rn(w[i] / scale[grp]);      // IEEE division, then round to nearest
        if (zero) v += (int)zero[grp];
        v = min(max(v, qmin), qmax);
        q[i] = (unsigned char)(v & 0xFF);               // the byte: int8 or uint8 by the caller
    }
}

extern "C" __global__ void dequantize(const unsigned char* __restrict__ q,
                                      const float* __restrict__ scale,
                                      const float* __restrict__ zero, float* __restrict__ w,
                                      long long n, int K, int G, int is_signed) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long grp = (i / K) * (K / G) + (i % K) / G;
        int v = is_signed ? (int)(signed char)q[i] : (int)q[i];
        float z = zero ? zero[grp] : 0.0f;
        w[i] = ((float)v - z) * scale[grp];
    }
}

// one thread per output byte
extern "C" __global__ void pack_int4(const signed char* __restrict__ q,
                                     unsigned char* __restrict__ p, long long n) {
    long long nb = (n + 1) / 2;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nb;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned lo = (unsigned)q[2 * i] & 0xFu;                       // two's complement nibble
        unsigned hi = (2 * i + 1 < n) ? ((unsigned)q[2 * i + 1] & 0xFu) : 0u;
        p[i] = (unsigned char)(lo | (hi << 4));
    }
}

// one thread per output value
extern "C" __global__ void unpack_int4(const unsigned char* __restrict__ p,
                                       signed char* __restrict__ q, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int nib = (p[i >> 1] >> (4 * (i & 1))) & 0xF;
        q[i] = (signed char)((nib << 28) >> 28);   // bit 3 copied into bits 4..31: -8..7
    }
}
