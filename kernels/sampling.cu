// sampling.cu: choosing the next token on the GPU: temperature, top-k, top-p (nucleus), greedy.
//
//   logits (B, V) fp16, one row per sequence; u (B,) uniform numbers in [0, 1) (the random
//   source, so a fixed seed gives a fixed choice); out (B,) int32 token ids.
//   The k largest logits are found in order (larger first; equal logits: the lower id first),
//   turned into probabilities p_r ~ exp((z_r - z_0) / temperature), cut to the shortest prefix
//   whose probability reaches top_p, and token r is chosen where the cumulative probability
//   first exceeds u * (kept total): inverse-CDF sampling of the truncated distribution.
//   k = 1 is greedy (argmax; ties to the lowest id, as torch.argmax).
//
//   sample_topk_v1  one block per row: k rounds of a block-wide argmax (common.cuh's
//                   block_reduce with ArgMaxOp) over the elements after the previous winner in
//                   (value desc, id asc) order; O(k V / threads) reads, no sort and no
//                   per-element marks. Then thread 0 walks the k winners.
//
// Launch (kernels/sampling_launch.py): grid (B) x 1024 threads; k <= SAMPLE_KMAX.
#include <cuda_fp16.h>
#include "common.cuh"

#define SAMPLE_KMAX 64

extern "C" __global__ void __launch_bounds__(1024) sample_topk_v1(
        const __half* logits, int V, float inv_temp, int k, float top_p, const float* u,
        int* out) {
    __shared__ float wv[SAMPLE_KMAX];
    __shared__ int wi[SAMPLE_KMAX];
    __shared__ float rv[32];
    __shared__ int ri[32];
    int b = blockIdx.x;
    const __half* z = logits + (long long)b * V;
    float last_v = INFINITY;
    int last_i = -1;
    for (int r = 0; r < k; r++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
#pragma unroll 4
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float v = __half2float(z[j]);
            bool after = argmax_before(last_v, last_i, v, j); // not chosen yet
            if (after && argmax_before(v, j, bv, bi)) { bv = v; bi = j; }
        }
        block_reduce(ArgMax{bv, bi}, ArgMaxOp{rv, ri}, [&](ArgMax w) {   // block argmax
            wv[r] = w.v;
            wi[r] = w.i;
        });
        last_v = wv[r];
        last_i = wi[r];
        __syncthreads();                                      // rv/ri reused next round
    }
    if (threadIdx.x == 0) {
        float p[SAMPLE_KMAX], tot = 0.0f;
        int kk = k;
        for (int r = 0; r < k; r++) { p[r] = exp2f((wv[r] - wv[0]) * inv_temp * 1.4426950408889634f); tot += p[r]; }
        float cum = 0.0f;                                     // top-p: the shortest prefix >= top_p
        for (int r = 0; r < k; r++) {
            cum += p[r];
            if (cum >= top_p * tot) { kk = r + 1; break; }
        }
        float kept = 0.0f;
        for (int r = 0; r < kk; r++) kept += p[r];
        float target = u[b] * kept;
        int choice = wi[kk - 1];
        cum = 0.0f;
        for (int r = 0; r < kk; r++) {
            cum += p[r];
            if (target < cum) { choice = wi[r]; break; }
        }
        out[b] = choice;
    }
}
