// optim.cu: the parameter updates, SGD and AdamW, one thread per parameter (Chapter 6).
//
// Shapes: p, g, m, v are float32 vectors of n elements, contiguous. The book keeps every
// parameter of a model in ONE flat buffer (each weight and bias a view into it) and every
// gradient in another, so one launch updates the whole model ("multi-tensor apply" by layout).
//
// AdamW (Loshchilov & Hutter), at step t = 1, 2, ... (the order of torch.optim.AdamW):
//     p  = p * (1 - lr wd)                         decoupled weight decay
//     m  = m + (1 - b1) (g - m)                    first moment
//     v  = b2 v + (1 - b2) g^2                     second moment
//     p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)    bias-corrected
// The step count t lives in device memory (adamw_count_step adds 1 and computes the two
// corrections once), so a CUDA graph that replays the step sees t grow without re-capture.
//
// kernels
//   sgd_v1              p -= lr (g + wd p)
//   adamw_count_step    one thread: t += 1; coef = {lr / (1 - b1^t), sqrt(1 - b2^t)} (double)
//   adamw_v1            one thread per parameter, coef from adamw_count_step
//
// traffic: sgd 12 n bytes; adamw reads p, g, m, v and writes p, m, v: 28 n bytes.
// common.cuh: adamw_coef, adamw_param (shared with mlp_step.cu)
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void sgd_v1(float* __restrict__ p, const float* __restrict__ g, int n,
                                  float lr, float wd) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] -= lr * (g[i] + wd * p[i]);
}

// launch: grid = 1, block = 1 (before adamw_v1, on the same stream)
extern "C" __global__ void adamw_count_step(int* step, float* coef, float lr, float beta1,
                                            float beta2) {
    int t = step[0] + 1;
    step[0] = t;
    adamw_coef(t, lr, beta1, beta2, coef);     // common.cuh
}

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void adamw_v1(float* __restrict__ p, const float* __restrict__ g,
                                    float* __restrict__ m, float* __restrict__ v, int n,
                                    float lr, float beta1, float beta2, float eps, float wd,
                                    const float* __restrict__ coef) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_param(pi, g[i], mi, vi, lr, beta1, beta2, eps, wd, coef[0], coef[1]);   // common.cuh
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
}
