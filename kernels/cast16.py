"""Numba twins of kernels/cast16.cu: bfloat16 <-> float32, one element per thread (the CUDA
kernels convert 8 per thread with 16-byte vectors). NumPy and Numba have no bfloat16, so the
bf16 side is a uint16 array of bit patterns (``t.view(torch.int16).numpy().view(np.uint16)``),
and f32_to_bf16_rn reads float32 as its uint32 bit patterns (``x.view(np.uint32)`` on the host:
Numba cannot reinterpret a float's bits inside a kernel).

versions
  bf16_to_f32     bf16_to_f32_v1's math: the float32 of each bit pattern (exact: sign, exponent
                  and 7 mantissa bits, built with ldexp since a kernel cannot shift bits into a
                  float; a NaN comes out as a NaN, its payload not kept), dst = it, or dst += it
                  as one float32 add when accumulate
  f32_to_bf16_rn  f32_to_bf16_v1's rounding (__float2bfloat16_rn) by integer arithmetic on the
                  bits: round to nearest, ties to even; a NaN becomes 0x7fff as in cuda_bf16.h
Both: 1D, block any (64), grid ceil_div(n, block), over flat arrays.
"""

import math

from numba import cuda, float32, uint32


@cuda.jit
def bf16_to_f32(src, dst, accumulate):
    i = cuda.grid(1)
    if i < src.shape[0]:
        h = int(src[i])                          # the bit pattern, 0..0xffff
        s = -1.0 if h & 0x8000 else 1.0
        e = (h >> 7) & 0xFF
        m = h & 0x7F
        if e == 0xFF:
            v = s * math.inf if m == 0 else math.nan
        elif e == 0:                             # subnormal: m / 128 * 2^-126
            v = s * math.ldexp(float(m), -133)
        else:                                    # (1 + m / 128) * 2^(e - 127)
            v = s * math.ldexp(float(128 + m), e - 134)
        f = float32(v)                           # exact: v is a bf16 value
        if accumulate:
            dst[i] = dst[i] + f                  # one float32 add, as the CUDA kernel
        else:
            dst[i] = f


@cuda.jit
def f32_to_bf16_rn(src_bits, dst):
    i = cuda.grid(1)
    if i < src_bits.shape[0]:
        u = uint32(src_bits[i])
        if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            dst[i] = 0x7FFF                      # NaN: the canonical quiet NaN
        else:                                    # + half an ulp, + 1 more on an odd result
            dst[i] = (u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16)
