// allreduce.cu: all-reduce of float32 (and, for the ring, bf16) buffers over the GPUs of one host, through peer access
// (each GPU reads the others' memory over NVLink or PCIe), driven by one process (Chapter 11).
//
// versions, simplest first
//   ring_step_add   one reduce-scatter step of the ring: own[lo:hi] += left[lo:hi], where `left`
//                   is the left neighbour's buffer, on another GPU (a pull: the reads cross the
//                   link, the writes stay local). 2 (world - 1) such steps of n / world elements
//                   (half of them ring_step_copy) make the ring all-reduce; the host orders them
//                   with events (allreduce_launch.PeerGroup.ring)
//   ring_step_copy  one all-gather step: own[lo:hi] = left[lo:hi]. Alone, on a whole buffer, it
//                   is the "kernel that reads a peer's memory" whose bandwidth the lesson measures
//   ring_step_*_bf16  the same two steps on bf16 buffers (gradients of data-parallel training):
//                   8 values per 16-byte load, each sum in float32 rounded to bf16 once per step
//   one_shot_v1     out = in_0 + in_1 + ... + in_{world-1} in one kernel: every GPU reads every
//                   peer's whole input. Per-block flags in each GPU's memory make two barriers
//                   across the GPUs (everyone's input is ready; everyone has finished reading),
//                   so no host synchronisation is needed: one launch per GPU per all-reduce. For
//                   small messages, where the ring's 2 (world - 1) steps cost more than the bytes.
//                   Each barrier is a round trip over the link, and each remote load another
//   one_shot_v2     push instead of pull, flags inside the data (NCCL's "LL" idea): every GPU
//                   writes its input into a receive area on every peer as 16-byte lines of
//                   {float, epoch, float, epoch}, one store each; a reader polls its own, local
//                   memory until both flags of a line hold this call's epoch, then adds. One
//                   one-way trip over the link, no barrier: the receive areas alternate between
//                   two halves by the epoch's parity, so a fast rank can never overwrite a line
//                   that a slow rank has yet to read (it would need the slow rank's next call).
//                   Moves twice the bytes (a flag per float): for messages up to about 1 MB
//
// traffic per GPU for n floats: the ring reads 2 (world - 1) n / world floats over the links
// (the bus-bandwidth numerator); one_shot_v1 reads (world - 1) n, one_shot_v2 writes 2 (world - 1) n. All kernels need sm_70+
// (release/acquire at system scope for the flags) and compile for sm_75, sm_80, sm_90.
#include "common.cuh"

// The element types of the ring: float32, and bf16 held as its 16-bit pattern (data-parallel
// training keeps gradients in bf16, as DDP does). A bf16 sum is formed in float32 and rounded to
// bf16 (to nearest even) once per ring step, as NCCL's bf16 all-reduce does; as bits, bf16 needs
// no header and compiles for sm_75 like the rest.
__device__ __forceinline__ float bf16_bits_to_float(unsigned int h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ unsigned int float_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;   // NaN stays a (quiet) NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                     // round to nearest even
}

struct RingF32 {                      // 4 values per 16-byte word
    using E = float;
    static constexpr int V = 4;
    __device__ static E add(E a, E b) { return a + b; }
    __device__ static unsigned int add_word(unsigned int a, unsigned int b) {
        return __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
    }
};

struct RingBF16 {                     // 8 values per 16-byte word, 2 per 32-bit lane
    using E = unsigned short;
    static constexpr int V = 8;
    __device__ static E add(E a, E b) {
        return (E)float_to_bf16_bits(bf16_bits_to_float(a) + bf16_bits_to_float(b));
    }
    __device__ static unsigned int add_word(unsigned int a, unsigned int b) {
        unsigned int lo = float_to_bf16_bits(bf16_bits_to_float(a & 0xffffu) + bf16_bits_to_float(b & 0xffffu));
        unsigned int hi = float_to_bf16_bits(bf16_bits_to_float(a >> 16) + bf16_bits_to_float(b >> 16));
        return lo | (hi << 16);
    }
};

// 4 16-byte loads in flight per thread before any store: the link's latency (~1 us) is hidden by
// bytes in flight, not by arithmetic. Scalar head and tail where lo/hi are not multiples of T::V.
template <bool ADD, class T>
__device__ __forceinline__ void ring_body(typename T::E* __restrict__ own,
                                          const typename T::E* __restrict__ left,
                                          long long lo, long long hi) {
    constexpr long long V = T::V;
    long long a = (lo + V - 1) & ~(V - 1);            // first 16-byte aligned element (buffers are)
    if (a > hi) a = hi;
    long long b = a + ((hi - a) & ~(V - 1));          // end of the 16-byte body
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nth = (long long)gridDim.x * blockDim.x;
    if (tid < a - lo) { long long i = lo + tid; own[i] = ADD ? T::add(own[i], left[i]) : left[i]; }
    if (tid < hi - b) { long long i = b + tid;  own[i] = ADD ? T::add(own[i], left[i]) : left[i]; }
    const uint4* l4 = reinterpret_cast<const uint4*>(left + a);
    uint4* o4 = reinterpret_cast<uint4*>(own + a);
    long long n4 = (b - a) / V;
    for (long long i = tid; i < n4; i += 4 * nth) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (i + k * nth < n4) v[k] = l4[i + k * nth];       // remote loads, all in flight
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (i + k * nth >= n4) continue;
            uint4 r = v[k];
            if (ADD) {
                uint4 m = o4[i + k * nth];
                r.x = T::add_word(r.x, m.x); r.y = T::add_word(r.y, m.y);
                r.z = T::add_word(r.z, m.z); r.w = T::add_word(r.w, m.w);
            }
            o4[i + k * nth] = r;
        }
    }
}

// launch: grid = min(ceil_div(hi - lo, 4 * 256 * 4), 4 * SMs), block = 256, on own's GPU
extern "C" __global__ void ring_step_add(float* own, const float* left, long long lo, long long hi) {
    ring_body<true, RingF32>(own, left, lo, hi);
}

// launch: as ring_step_add
extern "C" __global__ void ring_step_copy(float* own, const float* left, long long lo, long long hi) {
    ring_body<false, RingF32>(own, left, lo, hi);
}

// launch: as ring_step_add; own and left hold bf16 values (as their 16-bit patterns)
extern "C" __global__ void ring_step_add_bf16(unsigned short* own, const unsigned short* left,
                                              long long lo, long long hi) {
    ring_body<true, RingBF16>(own, left, lo, hi);
}

// launch: as ring_step_add
extern "C" __global__ void ring_step_copy_bf16(unsigned short* own, const unsigned short* left,
                                               long long lo, long long hi) {
    ring_body<false, RingBF16>(own, left, lo, hi);
}

// A barrier across GPUs for block blockIdx.x: tell every rank p (slot [rank][block] of p's flags)
// that this block reached `epoch`, then wait until every rank has written `epoch` into our slots.
// flags[p] points to rank p's world x gridDim.x flags; every rank launches the same grid.
__device__ __forceinline__ void peer_barrier(unsigned int* const* flags, int rank, int world,
                                             unsigned int epoch) {
    __syncthreads();                                   // the block's earlier reads are done
    if (threadIdx.x < world) {
        int p = threadIdx.x;
        unsigned int* theirs = flags[p] + (size_t)rank * gridDim.x + blockIdx.x;
        unsigned int* mine = flags[rank] + (size_t)p * gridDim.x + blockIdx.x;
        __threadfence_system();
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(theirs), "r"(epoch) : "memory");
        unsigned int v;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
        } while (v < epoch);
    }
    __syncthreads();
}

// launch: grid = the same on every rank, at most one block per SM (all blocks must be resident:
// they wait for each other's peers), block = 256 >= world. ins[p]: rank p's input (on GPU p),
// out: this rank's output (not any input). epoch: odd, +2 per call (two barriers per call).
extern "C" __global__ void one_shot_v1(const float* const* __restrict__ ins, float* __restrict__ out,
                                    unsigned int* const* flags, int rank, int world, long long n,
                                    unsigned int epoch) {
    peer_barrier(flags, rank, world, epoch);           // every rank's input is ready
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nth = (long long)gridDim.x * blockDim.x;
    long long n4 = n >> 2;
    for (long long i = tid; i < n4; i += nth) {
        float4 s = reinterpret_cast<const float4*>(ins[0])[i];
        for (int p = 1; p < world; ++p) {              // rank order: the same bits on every rank
            float4 v = reinterpret_cast<const float4*>(ins[p])[i];
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
        reinterpret_cast<float4*>(out)[i] = s;
    }
    for (long long i = 4 * n4 + tid; i < n; i += nth) {
        float s = ins[0][i];
        for (int p = 1; p < world; ++p) s += ins[p][i];
        out[i] = s;
    }
    peer_barrier(flags, rank, world, epoch + 1);       // every rank has finished reading
}

// launch: grid = the same on every rank, at most one block per SM (a block polls for lines that
// the same block of every peer writes: all must be resident), block = 256. lines[p] points to
// rank p's receive area of 2 x world x cap 16-byte lines (zeroed once); in may be out (each
// thread reads its elements before it writes them). epoch: 1, 2, 3, ... (never 0: the zeros).
extern "C" __global__ void one_shot_v2(const float* __restrict__ in, float* __restrict__ out,
                                       uint4* const* lines, int rank, int world, long long n,
                                       long long cap, unsigned int epoch) {
    long long m = (n + 1) >> 1;                        // lines of two floats
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nth = (long long)gridDim.x * blockDim.x;
    long long half = (long long)(epoch & 1u) * world;
    for (long long i = tid; i < m; i += nth) {         // 1. push my line i to every rank
        float a = in[2 * i];
        float b = 2 * i + 1 < n ? in[2 * i + 1] : 0.0f;
        unsigned int x = __float_as_uint(a), z = __float_as_uint(b);
        for (int p = 0; p < world; ++p) {
            uint4* dst = lines[p] + (half + rank) * cap + i;
            asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                         :: "l"(dst), "r"(x), "r"(epoch), "r"(z), "r"(epoch) : "memory");
        }
    }
    for (long long i = tid; i < m; i += nth) {         // 2. wait for every rank's line i, add
        float sa = 0.0f, sb = 0.0f;
        for (int p = 0; p < world; ++p) {              // rank order: the same bits everywhere
            const uint4* src = lines[rank] + (half + p) * cap + i;
            unsigned int x, y, z, w;
            do {
                asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(src) : "memory");
            } while (y != epoch || w != epoch);
            sa += __uint_as_float(x);
            sb += __uint_as_float(z);
        }
        out[2 * i] = sa;
        if (2 * i + 1 < n) out[2 * i + 1] = sb;
    }
}
