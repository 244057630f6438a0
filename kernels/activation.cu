// activation.cu: element-wise activations and the first kernel fusion (Chapter 3).
//
// Shapes: x, y are float32, contiguous; n = number of elements. For the bias versions x and y
// are (M, N) row-major and b has N elements (one bias per column, as after a Linear layer).
//
// kernels (one op family, "apply an activation"; versions count within each op)
//   relu_v1        y = max(x, 0)                                   one thread per element
//   gelu_v1        GELU, tanh approximation (GPT-2, torch approximate="tanh")
//   gelu_v2        GELU, exact erf form (torch default)
//   bias_add_v1    y = x + b[col]: the first of the two unfused kernels (then gelu_v1)
//   bias_gelu_v1   fused y = gelu_tanh(x + b[col]): one read and one write instead of two each
//   bias_gelu_v2   bias_gelu_v1 with float4 loads/stores and a grid-stride loop (when N % 4 == 0
//                  and x, b, y are 16-byte aligned; otherwise the same loop with scalars)
//   gelu_backward_v1  (Chapter 6) the backward of bias_gelu: dh = dy * gelu_tanh'(h + b[col]),
//                  from the saved input h (before the bias), so the forward stores nothing extra
//   bias_add_f64, bias_gelu_f64, gelu_backward_f64   (Chapter 6) the same in double, for
//                  torch.autograd.gradcheck
//
// traffic: every kernel reads 4 n and writes 4 n bytes (b is tiny and stays in cache), so all
// are memory-bound. The unfused pair bias_add_v1 + gelu_v1 moves 16 n bytes (the intermediate
// x + b goes to memory and comes back); the fused kernel moves 8 n: at best 2x faster.
// common.cuh: gelu_tanh, gelu_tanh_grad
#include "common.cuh"

// launch: grid = ceil_div(n, 256), block = 256, no shared memory
extern "C" __global__ void relu_v1(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i], 0.0f);
}

// launch: grid = ceil_div(n, 256), block = 256
extern "C" __global__ void gelu_v1(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = gelu_tanh(x[i]);
}

// launch: grid = ceil_div(n, 256), block = 256
// 0.5 x (1 + erf(x / sqrt(2))): erff costs more instructions than tanhf, still memory-bound.
extern "C" __global__ void gelu_v2(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    }
}

// launch: grid = ceil_div(M * N, 256), block = 256. x, y: (M, N) row-major; b: (N,)
extern "C" __global__ void bias_add_v1(const float* x, const float* b, float* y, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) y[i] = x[i] + b[i % N];     // column of element i is i % N
}

// launch: grid = ceil_div(M * N, 256), block = 256
// The fusion: x + b lives in a register between the two operations instead of in memory.
extern "C" __global__ void bias_gelu_v1(const float* x, const float* b, float* y, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) y[i] = gelu_tanh(x[i] + b[i % N]);
}

// launch: grid = min(ceil_div(M * N / 4, 256), 8 * SMs), block = 256. Each thread moves 16
// bytes per load (fewer instructions per byte) and loops over the array (grid-stride), so a
// grid of a few blocks per SM covers any size. float4 needs N % 4 == 0 and 16-byte aligned
// x, b, y (whole CuPy/torch allocations are); otherwise the same loop runs on scalars.
extern "C" __global__ void bias_gelu_v2(const float* x, const float* b, float* y, int M, int N) {
    if ((N & 3) || !aligned16(x) || !aligned16(b) || !aligned16(y)) {   // uniform: no float4
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < (long long)M * N; i += (long long)gridDim.x * blockDim.x)
            y[i] = gelu_tanh(x[i] + b[i % N]);
        return;
    }
    long long n4 = (long long)M * N / 4;
    int N4 = N / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4* y4 = reinterpret_cast<float4*>(y);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 v = x4[i];
        float4 c = b4[i % N4];
        v.x = gelu_tanh(v.x + c.x);
        v.y = gelu_tanh(v.y + c.y);
        v.z = gelu_tanh(v.z + c.z);
        v.w = gelu_tanh(v.w + c.w);
        y4[i] = v;
    }
}

// ------------------------------------------------------------------ Chapter 6: the backward

// launch: grid = ceil_div(M * N, 256), block = 256. h, dy, dh: (M, N); b: (N,)
extern "C" __global__ void gelu_backward_v1(const float* h, const float* b, const float* dy,
                                            float* dh, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) dh[i] = dy[i] * gelu_tanh_grad<float>(h[i] + b[i % N]);
}

template <typename T>
__device__ __forceinline__ void add_bias(const T* x, const T* b, T* y, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) y[i] = x[i] + b[i % N];
}

// launch: as bias_add_v1 (the same element-wise add, in double)
extern "C" __global__ void bias_add_f64(const double* x, const double* b, double* y, int M,
                                        int N) {
    add_bias<double>(x, b, y, M, N);
}

// launch: as bias_gelu_v1
extern "C" __global__ void bias_gelu_f64(const double* x, const double* b, double* y, int M,
                                         int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) {
        double z = x[i] + b[i % N];
        y[i] = gelu_tanh(z);                               // common.cuh's, in double
    }
}

// launch: as gelu_backward_v1
extern "C" __global__ void gelu_backward_f64(const double* h, const double* b, const double* dy,
                                             double* dh, int M, int N) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)M * N) dh[i] = dy[i] * gelu_tanh_grad<double>(h[i] + b[i % N]);
}
