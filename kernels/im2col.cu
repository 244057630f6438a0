// im2col.cu: a convolution's patches as the rows of a matrix, and their gradient (Chapter 6).
//
// Layout NHWC, as the matmul leaves it: x (B, H, W, C) row-major, contiguous. A K x K filter,
// stride 1, zero padding `pad` (0 <= pad < K) gives Ho = H + 2 pad - K + 1 by Wo = W + 2 pad - K + 1
// outputs per image (pad = K / 2: the input's size). im2col copies each output pixel's patch into
// one row:
//   cols (B Ho Wo, K K C):  cols[(b, i, j), (a, e, c)] = x[b, i + a - pad, j + e - pad, c]
//                           (0 where the patch hangs over the border)
// so the layer is one matmul, y = cols @ Wc + bias with Wc (K K C, CO), and y (B Ho Wo, CO) is NHWC
// again: the next layer's input, no transpose. Like torch.nn.functional.conv2d it is a
// cross-correlation (the filter is not flipped).
//
// col2im is the adjoint of im2col. Each x element was copied into up to K*K entries of cols, so
// its gradient is the sum of theirs:
//   dx[b, h, w, c] = sum over (a, e) with 0 <= h - a + pad < Ho and 0 <= w - e + pad < Wo of
//                    dcols[(b, h - a + pad, w - e + pad), (a, e, c)]
// Written as a gather (each thread owns one dx element and reads its K*K terms) it needs no
// atomics and adds in a fixed order: the result is the same bit for bit on every run. The
// scatter form (each dcols entry atomicAdd-ed into its x element) would add in whatever order
// the threads arrive.
//
// kernels
//   im2col_v1    one thread per cols element; consecutive threads write consecutive columns
//                (coalesced) and read neighbouring channels of one pixel
//   col2im_v1    one thread per dx element, gathering its K*K terms (no atomics, deterministic)
//   im2col_f64, col2im_f64   the same in double (the float64 checks against autograd)
//
// traffic: im2col reads 4 B H W C bytes (each K*K times, mostly from the cache) and writes
// 4 B Ho Wo K^2 C; col2im the reverse. Indices are 64-bit: cols passes 2^31 elements early.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void im2col_body(const T* __restrict__ x, T* __restrict__ cols, int B,
                                            int H, int W, int C, int K, int pad, int Ho,
                                            int Wo) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long KC = (long long)K * K * C;
    if (t >= (long long)B * Ho * Wo * KC) return;
    long long row = t / KC;                     // the output pixel (b, i, j)
    int col = (int)(t - row * KC);              // the patch entry (a, e, c)
    int j = (int)(row % Wo), i = (int)((row / Wo) % Ho), b = (int)(row / ((long long)Ho * Wo));
    int c = col % C, e = (col / C) % K, a = col / (C * K);
    int h = i + a - pad, w = j + e - pad;
    cols[t] = (h >= 0 && h < H && w >= 0 && w < W) ? x[(((long long)b * H + h) * W + w) * C + c]
                                                   : T(0);     // the zero border
}

template <typename T>
__device__ __forceinline__ void col2im_body(const T* __restrict__ dcols, T* __restrict__ dx,
                                            int B, int H, int W, int C, int K, int pad, int Ho,
                                            int Wo) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)B * H * W * C) return;
    int c = (int)(t % C);
    long long p = t / C;                        // the input pixel (b, h, w)
    int w = (int)(p % W), h = (int)((p / W) % H), b = (int)(p / ((long long)H * W));
    long long KC = (long long)K * K * C;
    T s = T(0);
    for (int a = 0; a < K; a++) {
        int i = h - a + pad;                    // the output row whose patch row a holds x row h
        if (i < 0 || i >= Ho) continue;
        for (int e = 0; e < K; e++) {
            int j = w - e + pad;
            if (j < 0 || j >= Wo) continue;
            s += dcols[(((long long)b * Ho + i) * Wo + j) * KC + (a * K + e) * C + c];
        }
    }
    dx[t] = s;
}

// launch: grid = ceil_div(B Ho Wo K K C, 256), block = 256
extern "C" __global__ void im2col_v1(const float* x, float* cols, int B, int H, int W, int C,
                                     int K, int pad, int Ho, int Wo) {
    im2col_body<float>(x, cols, B, H, W, C, K, pad, Ho, Wo);
}

// launch: grid = ceil_div(B H W C, 256), block = 256
extern "C" __global__ void col2im_v1(const float* dcols, float* dx, int B, int H, int W, int C,
                                     int K, int pad, int Ho, int Wo) {
    col2im_body<float>(dcols, dx, B, H, W, C, K, pad, Ho, Wo);
}

// launch: as im2col_v1
extern "C" __global__ void im2col_f64(const double* x, double* cols, int B, int H, int W, int C,
                                      int K, int pad, int Ho, int Wo) {
    im2col_body<double>(x, cols, B, H, W, C, K, pad, Ho, Wo);
}

// launch: as col2im_v1
extern "C" __global__ void col2im_f64(const double* dcols, double* dx, int B, int H, int W,
                                      int C, int K, int pad, int Ho, int Wo) {
    col2im_body<double>(dcols, dx, B, H, W, C, K, pad, Ho, Wo);
}
