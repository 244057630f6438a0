// cast16.cu: bfloat16 <-> float32, elementwise over n elements (any shape, contiguous): the
// mixed precision of the GPT training step. Weight gradients come out of the bf16 matmul in
// bf16 and are summed into the fp32 gradients (bf16_to_f32_v1 with accumulate); the fp32 master
// weights are rounded to the bf16 copies the matmuls read (f32_to_bf16_v1).
//
// versions, simplest first (one step each: a memory-bound conversion, vectorised from the start)
//   bf16_to_f32_v1  dst = float(src), or dst += float(src) when accumulate != 0 (one fp32 add per
//                   element, no atomics: deterministic). A bf16 is the top half of a float32, so
//                   the conversion is a 16-bit shift, exact. 8 elements per thread: one 16-byte
//                   load, two 16-byte stores (and two loads when accumulating)
//   f32_to_bf16_v1  dst = bf16(src) rounded to nearest even (__float2bfloat16_rn: cvt.rn.bf16x2
//                   from sm_80, the same rounding in software on sm_75; a NaN becomes 0x7fff, as
//                   PyTorch's CUDA conversion gives). 8 per thread: two 16-byte loads, one store
//
// Every thread i < n / 8 converts the 16-byte vector i; thread n / 8 converts the n % 8 tail one
// element at a time. Needs src and dst 16-byte aligned (cast16_launch.py checks). The index is
// 64-bit (n may pass 2^31).
#include <cuda_bf16.h>

// the float32 of the bf16 in the low (hi = false) or high half of a 32-bit word
__device__ __forceinline__ float cast16_half(unsigned int w, bool hi) {
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}

// launch: block = (256,), grid = (ceil_div(n / 8 + 1, 256),); no shared memory
extern "C" __global__ void bf16_to_f32_v1(const unsigned short* __restrict__ src,
                                          float* __restrict__ dst, long long n, int accumulate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nv = n / 8;
    if (i < nv) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        float4 lo = make_float4(cast16_half(v.x, false), cast16_half(v.x, true),
                                cast16_half(v.y, false), cast16_half(v.y, true));
        float4 hi = make_float4(cast16_half(v.z, false), cast16_half(v.z, true),
                                cast16_half(v.w, false), cast16_half(v.w, true));
        float4* d = reinterpret_cast<float4*>(dst) + 2 * i;
        if (accumulate) {
            const float4 a = d[0], b = d[1];
            lo.x += a.x; lo.y += a.y; lo.z += a.z; lo.w += a.w;
            hi.x += b.x; hi.y += b.y; hi.z += b.z; hi.w += b.w;
        }
        d[0] = lo;
        d[1] = hi;
    } else if (i == nv) {                        // the tail: n % 8 elements
        for (long long j = 8 * nv; j < n; ++j) {
            const float f = __uint_as_float((unsigned int)src[j] << 16);
            dst[j] = accumulate ? dst[j] + f : f;
        }
    }
}

// a and b rounded to bf16, packed into a 32-bit word (a in the low half: the lower address)
__device__ __forceinline__ unsigned int cast16_pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned int*>(&h);
}

// launch: block = (256,), grid = (ceil_div(n / 8 + 1, 256),); no shared memory
extern "C" __global__ void f32_to_bf16_v1(const float* __restrict__ src,
                                          __nv_bfloat16* __restrict__ dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nv = n / 8;
    if (i < nv) {
        const float4* s = reinterpret_cast<const float4*>(src) + 2 * i;
        const float4 a = s[0], b = s[1];
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(cast16_pack(a.x, a.y), cast16_pack(a.z, a.w),
                                                      cast16_pack(b.x, b.y), cast16_pack(b.z, b.w));
    } else if (i == nv) {                        // the tail: n % 8 elements
        for (long long j = 8 * nv; j < n; ++j) dst[j] = __float2bfloat16_rn(src[j]);
    }
}
