// heads.cu: between the matmuls' row layout and attention's head layout, for 16-bit elements
// (bfloat16 or float16, moved as raw 16-bit patterns: an exact copy), 8 elements per 16-byte
// vector. P parts (P = 3: the QKV matmul's q | k | v heads; P = 1: one tensor):
//   rows  x (B*T, P*H*D): row b*T + t, column p*H*D + h*D + d
//   heads y_p (B*H, T, D), p = 0..P-1: y_p[b*H + h, t, d] = x[b*T + t, p*H*D + h*D + d]
//
// versions, simplest first (one step each: a permutation of 16-byte vectors is already a copy)
//   heads_split_v1  rows -> heads (split_qkv: P = 3; split: P = 1): a thread per 16-byte vector,
//                   read in the rows' order (a warp reads 512 contiguous bytes), written as runs
//                   of D / 8 vectors (D * 2 contiguous bytes: 128 at D = 64)
//   heads_merge_v1  heads -> rows (merge_qkv: P = 3; merge: P = 1): the same map the other way,
//                   written in the rows' order
//
// Needs D a multiple of 8 and every pointer 16-byte aligned (heads_launch.py checks both).
// Traffic: 2 bytes read + 2 written per element. The vector index is 64-bit (B*T*P*H*D may pass
// 2^31); rows B*T and B*H heads fit in 32 bits.

// Where vector i of the rows layout (elements 8i .. 8i + 7 of x) lives in the heads layout:
// returns the element offset in y_p and sets *part = p. W = P*H*D / 8 vectors per row.
__device__ __forceinline__ long long heads_offset(long long i, int W, int T, int H, int D,
                                                  int* part) {
    const long long m = i / W;                // row b*T + t
    const int col = (int)(i - m * W) * 8;     // column p*H*D + h*D + d
    const int HD = H * D;
    const int p = col / HD, hd = col - p * HD;
    const int h = hd / D, d = hd - h * D;
    const long long b = m / T, t = m - b * T;
    *part = p;
    return ((b * H + h) * T + t) * D + d;
}

// launch: block = (256,), grid = (ceil_div(n, 256),), n = B*T*P*H*D / 8 vectors; no shared
// memory. y1, y2 are unused (may be 0) when P = 1.
extern "C" __global__ void heads_split_v1(const uint4* __restrict__ x, unsigned short* y0,
                                          unsigned short* y1, unsigned short* y2, long long n,
                                          int P, int T, int H, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int p;
    const long long o = heads_offset(i, P * H * D / 8, T, H, D, &p);
    unsigned short* y = p == 0 ? y0 : (p == 1 ? y1 : y2);
    *reinterpret_cast<uint4*>(y + o) = x[i];
}

// launch: block = (256,), grid = (ceil_div(n, 256),), n = B*T*P*H*D / 8 vectors; no shared
// memory. y1, y2 are unused (may be 0) when P = 1.
extern "C" __global__ void heads_merge_v1(const unsigned short* y0, const unsigned short* y1,
                                          const unsigned short* y2, uint4* __restrict__ x,
                                          long long n, int P, int T, int H, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int p;
    const long long o = heads_offset(i, P * H * D / 8, T, H, D, &p);
    const unsigned short* y = p == 0 ? y0 : (p == 1 ? y1 : y2);
    x[i] = *reinterpret_cast<const uint4*>(y + o);
}
