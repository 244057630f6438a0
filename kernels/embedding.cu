// embedding.cu: the token embedding gather that starts a forward pass.
//
//   embedding_v1  x[m, :] = float(wte[tok[m], :]) for m < M: tok (M,) int32, wte (V, d) fp16, x
//                 (M, d) fp32 (the residual stream is kept in fp32). One block per token, the
//                 row copied with 4-byte (half2) loads. An id outside [0, V) is never read
//                 from: its row of x is NaN (a kernel cannot raise; the launcher refuses such
//                 ids where it may read them back, and ids the sampler makes are < V).
//
// Launch (kernels/embedding_launch.py): grid (M) x 128 threads.
#include <cuda_fp16.h>

extern "C" __global__ void embedding_v1(const int* tok, const __half* wte, float* x, int M,
                                        int d, int V) {
    int m = blockIdx.x;
    int t = tok[m];
    float2* dst = reinterpret_cast<float2*>(x + (long long)m * d);
    if (t < 0 || t >= V) {                                   // a bad id: a NaN row, no read
        const float nan = __int_as_float(0x7fc00000);
        for (int e = threadIdx.x; e < d / 2; e += blockDim.x) dst[e] = make_float2(nan, nan);
        return;
    }
    const __half2* row = reinterpret_cast<const __half2*>(wte + (long long)t * d);
    for (int e = threadIdx.x; e < d / 2; e += blockDim.x) dst[e] = __half22float2(row[e]);
}
