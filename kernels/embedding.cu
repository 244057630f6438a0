// embedding.cu: the token embedding gather that starts a forward pass.
//
//   embedding_v1  x[m, :] = float(wte[tok[m], :]) for m < M: tok (M,) int32, wte (V, d) fp16, x
//                 (M, d) fp32 (the residual stream is kept in fp32). One block per token, the
//                 row copied with 4-byte (half2) loads. Token ids are checked on the host (the
//                 launcher) where they come from the host; ids made on the GPU by the sampler
//                 are < V by construction.
//
// Launch (kernels/embedding_launch.py): grid (M) x 128 threads.
#include <cuda_fp16.h>

extern "C" __global__ void embedding_v1(const int* tok, const __half* wte, float* x, int M, int d) {
    int m = blockIdx.x;
    const __half2* row = reinterpret_cast<const __half2*>(wte + (long long)tok[m] * d);
    float2* dst = reinterpret_cast<float2*>(x + (long long)m * d);
    for (int e = threadIdx.x; e < d / 2; e += blockDim.x) dst[e] = __half22float2(row[e]);
}
