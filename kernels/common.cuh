// common.cuh: device code shared by the kernels of every chapter, defined once.
// Inlined by cudabook.load_cuda (and found by nvcc through -I kernels/).
//
//   ceil_div(n, b)          blocks needed to cover n items with b per block
//   aligned16(p)            p is a multiple of 16 bytes (a float4 access is allowed)
//   gelu_tanh(v)            GELU, tanh approximation, float or double (activation.cu,
//                           gelu_half.cu)
//   gelu_tanh_grad(z)       its derivative (activation.cu, mlp_step.cu)
//   adamw_coef(t, ...)      AdamW's two bias corrections at step t (optim.cu, mlp_step.cu)
//   adamw_param(...)        one parameter's AdamW update (optim.cu, mlp_step.cu)
//   rope_angle(p, i, ...)   cos and sin of RoPE's angle for pair i at position p (rope.cu,
//                           paged_attention.cu, decode_gemv.cu)
//   dot8(w, x, acc)         acc + the dot product of 8 halves of w and 8 of x (16-byte loads), in
//                           fp32, in a fixed order (gemv.cu, decode_gemv.cu)
//   warp_reduce<R>(v)       v combined by the operator R over the 32 lanes of a warp; every lane
//                           gets the result
//   warp_sum(v), warp_max(v)      the same for + and max, float or double
//   block_reduce(v, op, publish)  THE block reduction of the book, templated over the operator
//                           and its value type (below); block_sum and block_max are built on it
//   block_sum(v, sbuf), block_max(v, sbuf)
//                           over the whole block: THE block-reduction contract of the book:
//                           * every thread of the block must call it (it has barriers);
//                           * blockDim.x is a multiple of 32, up to 1024 (whole warps: the
//                             shuffles use the full mask);
//                           * sbuf is BLOCK_REDUCE_SMEM floats of shared memory;
//                           * every thread gets the result, and sbuf may be reused (even by
//                             the next block_sum) as soon as the call returns.
//   safe_max(m)             a row maximum usable in exp(x - m): 0 for a row of only -inf
//   ld_stream16(p)          16 bytes read once (streamed weights): bypass L1 allocation
//   ld_keep16(p)            16 bytes that every row reads again (gamma, beta): kept in L1 longest
//   INFINITY, NAN           for NVRTC, which has no math.h
//
// The operators of warp_reduce / block_reduce, one struct each (value type: what it reduces):
//   Sum<T>, Max<T>          float or double (block_sum, block_max, warp_sum, warp_max)
//   WelfordOp               Welford (count, mean, M2), merged by Chan's formula (norm.cu)
//   SumMaxOp                SumMax (running sum d of exp(x - m), running max m) of the online
//                           softmax (softmax.cu)
//   ArgMaxOp                ArgMax (value, index): the larger value, then the lower index
//                           (sampling.cu)
//
// Ladder steps that teach a reduction (reduce_v1..v4 in reduce.cu) keep their own code on
// purpose; every other kernel reduces a warp or a block through warp_reduce / block_reduce.
#pragma once

#ifndef INFINITY  // NVRTC (CuPy) has no math.h: build +inf from its bit pattern
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN       // and a quiet NaN likewise
#define NAN __int_as_float(0x7fc00000)
#endif

// blocks needed to cover n items with b per block
__host__ __device__ inline int ceil_div(int n, int b) { return (n + b - 1) / b; }

// RoPE's rotation for pair i (of D/2) at position p: the angle p * base^(-2i/D), in fp32 with the
// accurate sincosf (positions reach 10^4 radians, where __sincosf is off)
__device__ __forceinline__ void rope_angle(int p, int i, int D, float log2_base, float* c,
                                           float* s) {
    float inv = exp2f(-2.0f * (float)i / (float)D * log2_base);   // base^(-2i/D)
    sincosf((float)p * inv, s, c);
}

// acc + dot(8 halves of w, 8 halves of x), fp32 multiply-adds in element order (needs cuda_fp16.h)
#ifdef __CUDA_FP16_H__
__device__ __forceinline__ float dot8(uint4 w, uint4 xv, float acc) {
    const __half2* wh = reinterpret_cast<const __half2*>(&w);
    const __half2* xh = reinterpret_cast<const __half2*>(&xv);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 wf = __half22float2(wh[i]), xf = __half22float2(xh[i]);
        acc = fmaf(wf.x, xf.x, acc);
        acc = fmaf(wf.y, xf.y, acc);
    }
    return acc;
}
#endif

// p is 16-byte aligned: float4 loads and stores from it are allowed
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// GELU, tanh approximation (GPT-2, torch approximate="tanh"), in float or double:
// 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
template <typename T>
__device__ __forceinline__ T gelu_tanh(T v) {
    return (T)0.5 * v * ((T)1 + tanh((T)0.7978845608028654 * (v + (T)0.044715 * v * v * v)));
}

// gelu_tanh'(z), its derivative (the backward of activation.cu, mlp_step.cu):
// d/dz gelu_tanh(z) with u = k (z + c z^3), t = tanh(u):
//     0.5 (1 + t) + 0.5 z (1 - t^2) k (1 + 3 c z^2)
template <typename T>
__device__ __forceinline__ T gelu_tanh_grad(T z) {
    T k = (T)0.7978845608028654, c = (T)0.044715;
    T t = tanh(k * (z + c * z * z * z));
    return (T)0.5 * ((T)1 + t) + (T)0.5 * z * ((T)1 - t * t) * k * ((T)1 + (T)3 * c * z * z);
}

// AdamW (Loshchilov & Hutter) at step t = 1, 2, ..., in the order of torch.optim.AdamW.
// adamw_coef: the two bias corrections, {lr / (1 - b1^t), sqrt(1 - b2^t)}, in double once per step
__device__ __forceinline__ void adamw_coef(int t, float lr, float beta1, float beta2,
                                           float* coef) {
    coef[0] = (float)((double)lr / (1.0 - pow((double)beta1, (double)t)));
    coef[1] = (float)sqrt(1.0 - pow((double)beta2, (double)t));
}

// adamw_param: one parameter p with gradient g and moments m, v (updated in place), given the
// step's coef = {step_size, bc2_sqrt} from adamw_coef:
//     p = p (1 - lr wd);  m += (1 - b1)(g - m);  v = b2 v + (1 - b2) g^2
//     p -= step_size m / (sqrt(v) / bc2_sqrt + eps)
__device__ __forceinline__ void adamw_param(float& p, float g, float& m, float& v, float lr,
                                            float beta1, float beta2, float eps, float wd,
                                            float step_size, float bc2_sqrt) {
    float pi = p * (1.0f - lr * wd);
    float mi = m + (1.0f - beta1) * (g - m);
    float vi = beta2 * v + (1.0f - beta2) * g * g;
    m = mi;
    v = vi;
    p = pi - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
}

// ----- reductions, templated over the operator -------------------------------------------------
// An operator R is a struct that defines, for its value type V:
//   static V combine(V mine, V other)   associative; mine is this lane's value
//   static V shfl(V v, int o)           v of lane ^ o (one __shfl_xor_sync per member)
//   put(w, v)                           warp w's partial into shared memory, at the addresses
//                                       the instance was built with (block_reduce only)
//   get(w, have)                        warp w's partial if have, else the identity (the value
//                                       of absent warps: combine(x, identity) == x)

// v combined over the 32 lanes of a warp (butterfly: every lane gets the result)
template <typename R, typename V>
__device__ __forceinline__ V warp_reduce(V v) {
    for (int o = 16; o > 0; o >>= 1) v = R::combine(v, R::shfl(v, o));
    return v;
}

// v combined over the whole block (the contract of block_sum below): every warp combines its
// lanes, lane 0 puts the warp's partial, warp 0 combines the partials and its lane 0 calls
// publish(result), which writes the result to shared memory where the caller reads it.
// block_reduce returns after a barrier, so every thread may read it then; the caller adds one
// more barrier, once everyone has read, before that memory or op's partials are written again.
template <typename Op, typename V, typename Publish>
__device__ __forceinline__ void block_reduce(V v, const Op& op, Publish publish) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_reduce<Op>(v);
    if (lane == 0) op.put(warp, v);
    __syncthreads();                 // every warp's partial is written
    if (warp == 0) {
        v = op.get(lane, lane < nw);     // the identity past the last warp
        v = warp_reduce<Op>(v);
        if (lane == 0) publish(v);
    }
    __syncthreads();                 // the result is written
}

// + over float or double; block_reduce keeps the partials at s[0..31]
template <typename T>
struct Sum {
    T* s;
    static __device__ __forceinline__ T combine(T a, T b) { return a + b; }
    static __device__ __forceinline__ T shfl(T v, int o) {
        return __shfl_xor_sync(0xffffffffu, v, o);
    }
    __device__ __forceinline__ void put(int w, T v) const { s[w] = v; }
    __device__ __forceinline__ T get(int w, bool have) const { return have ? s[w] : T(0); }
};

// max over float or double (fmax: a NaN loses to a number); partials at s[0..31]
template <typename T>
struct Max {
    T* s;
    static __device__ __forceinline__ T combine(T a, T b) { return fmax(a, b); }
    static __device__ __forceinline__ T shfl(T v, int o) {
        return __shfl_xor_sync(0xffffffffu, v, o);
    }
    __device__ __forceinline__ void put(int w, T v) const { s[w] = v; }
    __device__ __forceinline__ T get(int w, bool have) const { return have ? s[w] : -INFINITY; }
};

// sum of v over the 32 lanes of a warp; every lane gets the total
template <typename T>
__device__ inline T warp_sum(T v) { return warp_reduce<Sum<T>>(v); }

// max of v over the 32 lanes of a warp; every lane gets the result
template <typename T>
__device__ inline T warp_max(T v) { return warp_reduce<Max<T>>(v); }

// shared memory (floats) that block_sum / block_max need: one slot per warp and the result
#define BLOCK_REDUCE_SMEM 33

// sum of v over the block, returned to every thread (the contract above)
__device__ __forceinline__ float block_sum(float v, float* sbuf) {
    block_reduce(v, Sum<float>{sbuf}, [=](float r) { sbuf[32] = r; });
    float r = sbuf[32];
    __syncthreads();                 // everyone has read it: sbuf may be reused
    return r;
}

// max of v over the block, returned to every thread (the contract above)
__device__ __forceinline__ float block_max(float v, float* sbuf) {
    block_reduce(v, Max<float>{sbuf}, [=](float r) { sbuf[32] = r; });
    float r = sbuf[32];
    __syncthreads();
    return r;
}

// Welford state of a set of values: count, mean, M2 = sum (v - mean)^2
struct Welford { float n, mean, m2; };

__device__ __forceinline__ void welford_add(Welford& w, float v) {
    w.n += 1.0f;
    float delta = v - w.mean;
    w.mean += delta / w.n;
    w.m2 += delta * (v - w.mean);
}

// Chan et al.: merge two Welford states
__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
    float n = a.n + b.n;
    if (n == 0.0f) return a;
    float delta = b.mean - a.mean, fb = b.n / n;
    Welford r;
    r.n = n;
    r.mean = a.mean + delta * fb;
    r.m2 = a.m2 + b.m2 + delta * delta * a.n * fb;
    return r;
}

// Welford triples; partials n at s[w], mean at s[33 + w], M2 at s[66 + w] (99 floats)
struct WelfordOp {
    float* s;
    static __device__ __forceinline__ Welford combine(Welford a, Welford b) {
        return welford_merge(a, b);
    }
    static __device__ __forceinline__ Welford shfl(Welford w, int o) {
        Welford r;
        r.n = __shfl_xor_sync(0xffffffffu, w.n, o);
        r.mean = __shfl_xor_sync(0xffffffffu, w.mean, o);
        r.m2 = __shfl_xor_sync(0xffffffffu, w.m2, o);
        return r;
    }
    __device__ __forceinline__ void put(int w, Welford v) const {
        s[w] = v.n;
        s[33 + w] = v.mean;
        s[66 + w] = v.m2;
    }
    __device__ __forceinline__ Welford get(int w, bool have) const {   // identity: (0, 0, 0)
        return {have ? s[w] : 0.0f, have ? s[33 + w] : 0.0f, have ? s[66 + w] : 0.0f};
    }
};

// The statistics of the online softmax: the running sum d of exp(x - m) and max m
struct SumMax { float d, m; };

// merge two partial (m, d): the smaller max's sum is rescaled to the larger max
__device__ __forceinline__ void online_merge(float& m, float& d, float m2, float d2) {
    float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;           // both empty: keep (-inf, 0), avoid exp(NaN)
    d = d * __expf(m - mn) + d2 * __expf(m2 - mn);
    m = mn;
}

// (m, d) pairs; partials m at s[w], d at s[32 + w] (64 floats)
struct SumMaxOp {
    float* s;
    static __device__ __forceinline__ SumMax combine(SumMax a, SumMax b) {
        online_merge(a.m, a.d, b.m, b.d);
        return a;
    }
    static __device__ __forceinline__ SumMax shfl(SumMax v, int o) {
        SumMax r;
        r.m = __shfl_xor_sync(0xffffffffu, v.m, o);
        r.d = __shfl_xor_sync(0xffffffffu, v.d, o);
        return r;
    }
    __device__ __forceinline__ void put(int w, SumMax v) const { s[w] = v.m; s[32 + w] = v.d; }
    __device__ __forceinline__ SumMax get(int w, bool have) const {    // identity: (-inf, 0)
        SumMax r;
        r.m = have ? s[w] : -INFINITY;
        r.d = have ? s[32 + w] : 0.0f;
        return r;
    }
};

// (v, i) comes before (w, j) in an argmax: the larger value first, then the lower index
__device__ __forceinline__ bool argmax_before(float v, int i, float w, int j) {
    return v > w || (v == w && i < j);
}

// A value and its index
struct ArgMax { float v; int i; };

// the first (value, index) in argmax_before order; partials at v[0..31], i[0..31]
struct ArgMaxOp {
    float* v;
    int* i;
    static __device__ __forceinline__ ArgMax combine(ArgMax a, ArgMax b) {
        if (argmax_before(b.v, b.i, a.v, a.i)) a = b;
        return a;
    }
    static __device__ __forceinline__ ArgMax shfl(ArgMax a, int o) {
        return {__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
    }
    __device__ __forceinline__ void put(int w, ArgMax a) const { v[w] = a.v; i[w] = a.i; }
    __device__ __forceinline__ ArgMax get(int w, bool have) const {   // identity: (-inf, max int)
        return {have ? v[w] : -INFINITY, have ? i[w] : 0x7fffffff};
    }
};

// the maximum to subtract before exp: a row of only -inf (fully masked) uses 0, so every
// exp(-inf - 0) is 0 instead of exp(-inf - (-inf)) = NaN
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

// 16 bytes (p 16-byte aligned) that this thread reads once, such as a weight matrix streamed
// by a GEMV: read-only path without allocating in L1, so L1 keeps what is reused (activations)
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16 bytes (p 16-byte aligned) that the same block reads again and again, such as the gamma and
// beta of a norm applied row after row: read-only path, allocated in L1 with eviction priority
// evict_last, so streamed data is evicted before them
__device__ __forceinline__ float4 ld_keep16(const void* p) {
    float4 r;
    asm("ld.global.nc.L1::evict_last.v4.f32 {%0, %1, %2, %3}, [%4];\n"
        : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}
