"""Numba twins of kernels/quant.cu (Chapter 10): quantize, dequantize, int4 pack/unpack.

The conventions are quant.cu's (and cudabook.quant's references): w (rows, K) float32, groups of
G consecutive elements of a row, scale and zero (rows, K // G) float32, q one byte per value.
``round`` rounds to nearest, ties to even, on the GPU (llrint) and in the simulator (Python's
round) alike, as numpy.rint and __float2int_rn do.

  group_scales_thread  one thread per group (quant.cu's group_scales uses a warp per group:
                       the simulator has no warp shuffles), symmetric or asymmetric
  quantize             one thread per element: q = clamp(round(w / s) + z, qmin, qmax)
  dequantize           one thread per element: w' = (q - z) * s
  pack_int4            one thread per output byte: element 2i low nibble, 2i + 1 high nibble
  unpack_int4          one thread per value, the nibble's sign bit extended

Launch: [cb.grid_1d(count), 256] with count the groups, elements, bytes or values.
"""

from numba import cuda, float32, int32


@cuda.jit
def group_scales_thread(w, scale, zero, G, bits, asym):
    # w (rows, K) float32; scale, zero (rows, K // G) float32; launch [grid_1d(rows * K // G), 256]
    i = cuda.grid(1)
    ng = w.shape[1] // G
    if i >= w.shape[0] * ng:
        return
    r = i // ng
    k0 = (i % ng) * G
    lo = float32(0)
    hi = float32(0)
    for k in range(k0, k0 + G):
        v = w[r, k]
        lo = min(lo, v)
        hi = max(hi, v)
    z = float32(0)
    if asym:
        levels = float32((1 << bits) - 1)
        s = (hi - lo) / levels if hi > lo else float32(1)
        z = float32(round(-lo / s))
    else:
        amax = max(hi, -lo)
        s = amax / float32((1 << (bits - 1)) - 1) if amax > 0 else float32(1)
    scale[r, i % ng] = s
    zero[r, i % ng] = z


@cuda.jit
def quantize(w, scale, zero, q, G, qmin, qmax):
    # q (rows, K) int8 or uint8; launch [grid_1d(rows * K), 256]
    i = cuda.grid(1)
    K = w.shape[1]
    if i >= w.shape[0] * K:
        return
    r = i // K
    k = i % K
    v = int32(round(w[r, k] / scale[r, k // G])) + int32(zero[r, k // G])
    q[r, k] = min(max(v, qmin), qmax)


@cuda.jit
def dequantize(q, scale, zero, w, G):
    # w (rows, K) float32; launch [grid_1d(rows * K), 256]
    i = cuda.grid(1)
    K = q.shape[1]
    if i >= q.shape[0] * K:
        return
    r = i // K
    k = i % K
    w[r, k] = (float32(q[r, k]) - zero[r, k // G]) * scale[r, k // G]


@cuda.jit
def pack_int4(q, p):
    # q (n,) int8 in -8..7; p (ceil(n / 2),) uint8; launch [grid_1d(ceil(n / 2)), 256]
    i = cuda.grid(1)
    n = q.shape[0]
    if i >= p.shape[0]:
        return
    lo = int32(q[2 * i]) & 0xF
    hi = int32(q[2 * i + 1]) & 0xF if 2 * i + 1 < n else 0
    p[i] = lo | (hi << 4)


@cuda.jit
def unpack_int4(p, q):
    # p (ceil(n / 2),) uint8; q (n,) int8; launch [grid_1d(n), 256]
    i = cuda.grid(1)
    if i >= q.shape[0]:
        return
    nib = (int32(p[i // 2]) >> (4 * (i % 2))) & 0xF
    q[i] = nib - 16 if nib >= 8 else nib
