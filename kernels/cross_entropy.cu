// cross_entropy.cu: softmax cross-entropy, forward and backward in one kernel (Chapter 6).
//
// Shapes: z (M, C) logits, row-major, contiguous; labels (M,) int32 in [0, C); dz (M, C) the
// gradient, a separate buffer (never z itself); loss (1,) accumulated with atomicAdd, so the
// launcher zeroes it first. With p = softmax(z_r) and lse = log sum_j exp(z_rj):
//     loss   += scale * (lse - z_r,y_r)              scale = 1/M: the mean over the batch
//     dz_rj   = scale * (p_j - [j == y_r])           the gradient of that mean
// The backward needs nothing but p, which the forward has just computed: fusing them reads z
// once for both (and the gradient of the mean is written before anyone asks for it).
//
// kernels
//   cross_entropy_v1    one warp per row: max and sum of exp by warp shuffles (z - max <= 0,
//                       so exp never overflows), the row's loss, then the row's gradient
//   cross_entropy_f64   cross_entropy_v1 in double (torch.autograd.gradcheck runs in float64)
//
// A label outside [0, C) makes the row's loss and its gradient NaN (a kernel cannot raise; the
// launcher checks labels when asked), so a bad label is never a plausible number. dz may be null (loss only), loss may be null (gradient only).
// traffic: reads 4 M C bytes (three passes over a row that stays in L1), writes 4 M C bytes.
// common.cuh: warp_sum, warp_max (float and double)
#include "common.cuh"

__device__ __forceinline__ float ce_exp(float v) { return expf(v); }
__device__ __forceinline__ double ce_exp(double v) { return exp(v); }
__device__ __forceinline__ float ce_log(float v) { return logf(v); }
__device__ __forceinline__ double ce_log(double v) { return log(v); }
__device__ __forceinline__ float ce_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double ce_nan(double) {
    return __longlong_as_double(0x7ff8000000000000ll);
}

template <typename T>
__device__ void cross_entropy_row(const T* __restrict__ z, const int* __restrict__ labels,
                                  T* loss, T* __restrict__ dz, int M, int C, T scale) {
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= M) return;                                // the whole warp leaves together
    const T* zr = z + row * C;
    T m = -INFINITY;
    for (int j = lane; j < C; j += 32) m = m > zr[j] ? m : zr[j];
    m = warp_max(m);
    T s = 0;
    for (int j = lane; j < C; j += 32) s += ce_exp(zr[j] - m);
    s = warp_sum(s);
    int y = labels[row];
    bool ok = y >= 0 && y < C;
    if (loss && lane == 0) {
        T l = ok ? ce_log(s) + m - zr[y] : ce_nan(s);
        atomicAdd(loss, scale * l);
    }
    if (dz) {
        T inv = (T)1 / s;
        T* dr = dz + row * C;
        for (int j = lane; j < C; j += 32)        // a bad label: the row's gradient is NaN too
            dr[j] = ok ? scale * (ce_exp(zr[j] - m) * inv - (j == y ? (T)1 : (T)0)) : ce_nan(s);
    }
}

// launch: grid = ceil_div(M, 4), block = 128 (4 warps, one row each), no shared memory
extern "C" __global__ void cross_entropy_v1(const float* z, const int* labels, float* loss,
                                            float* dz, int M, int C, float scale) {
    cross_entropy_row<float>(z, labels, loss, dz, M, C, scale);
}

// launch: as cross_entropy_v1
extern "C" __global__ void cross_entropy_f64(const double* z, const int* labels, double* loss,
                                             double* dz, int M, int C, double scale) {
    cross_entropy_row<double>(z, labels, loss, dz, M, C, scale);
}
