// decode_mega.cu: a whole decode step of chapter 7's GPT in ONE persistent kernel (Chapter 12,
// the decode ladder's megakernel). Batch B in {1, 2, 4, 8}, fp16 weights, fp32 residual stream.
//
//   The model (cudabook/gpt.py): token embedding, n_layer pre-norm blocks
//   x += proj(attn(RoPE(qkv(LN1(x))))); x += fc2(gelu_tanh(fc(LN2(x)))), final LN, untied LM head.
//   No Linear has a bias; LayerNorms have gamma and beta; RoPE is half-split (pairs (i, i + D/2)).
//   Weights as cudabook.decoder.KernelGPT holds them: W (N, K) fp16 row-major (nn.Linear's
//   layout), LayerNorm parameters fp32. Caches kc, vc (n_layer, B, H, L, D) fp16.
//
//   decode_mega_v1  the straightforward megakernel. Grid = SMs x blocks per SM (all resident:
//                   the launcher checks the driver's occupancy), 256 threads. Between phases a
//                   grid-wide barrier (an arrival counter and a generation word, below). Per
//                   layer five phases:
//                   1. every block normalises x itself (LN1: warp b does batch row b, from L2)
//                      into shared memory, then its warps compute rows of the QKV GEMV; a warp
//                      owns a RoPE pair of rows (i, i + D/2) of a head, so the epilogue rotates q
//                      and k at the position read from the GPU, writes q (B, H, D) and appends
//                      k, v to the cache at that position;                         barrier
//                   2. attention of the new query over keys 0..pos, split over B H S tasks
//                      (S splits of the keys per head, a block per task); each task writes its
//                      (m, l, o) partial and the last block to finish a head (an atomic ticket)
//                      combines the S partials into the head's output a (B, d) fp16;  barrier
//                   3. a (B, d) into shared memory, output projection, x += half(sum);  barrier
//                   4. LN2 per block, fc GEMV, f = half(gelu(half(sum)));           barrier
//                   5. f (B, 4d) into shared memory, fc2 GEMV, x += half(sum);       barrier
//                   then the final LN per block, the LM head GEMV (logits (B, vocab) fp16) with
//                   a running argmax per warp, a per-block argmax, and the last block to finish
//                   (a ticket) writes the greedy token, history[b, pos + 1] and pos + 1: the next
//                   replay of a captured graph decodes the next token with no host work.
//                   GEMV: a warp owns whole weight rows (NR rows at once, all their 16-byte
//                   loads issued before the first multiply-add), the input rows in shared memory,
//                   fp32 sums in a fixed order (dot8), a warp-shuffle sum; rows are dealt to the
//                   grid's warps round-robin (row r to global warp r mod warps).
//   decode_mega_v2  v1 plus an L2 prefetch of the next phases' weights before each barrier
//                   (cp.async.bulk.prefetch.L2 on sm_90, prefetch.global.L2 lines before), so
//                   HBM keeps streaming while blocks wait; the LM head takes 4 rows per warp at
//                   once (v1: 2).
//   decode_mega_v3  v2 with cheaper synchronisation and attention:
//                   - the grid barrier is one word (grid_barrier_flip: one atom.release.gpu add
//                     per block whose total flips the top bit, an ld.acquire.gpu poll with
//                     __nanosleep backoff): no fence of its own, no reset, no generation
//                     published after the last arrival;
//                   - attention keeps every warp busy (8 lanes a key, 4 keys a thread, so 128
//                     keys a pass, all their K and V loads issued before the first dot product,
//                     an online softmax per key slot) and at most one task per block
//                     (S = grid / (B H));
//                     no ticket and no last-block combine: the proj phase's prologue combines
//                     the S partials of every head (mg_combine), with v2's formula and order;
//                   - phase 1 prefetches this layer's keys and values 0..pos-1 to L2 (written
//                     by earlier steps, so they need not wait for the barrier);
//                   - fc2 (K = 4d): a row a warp at a time with 12 16-byte loads a lane in
//                     flight (v2: 2 rows, 6 loads a lane a pass).
//                   The barrier count (5 a layer) is v2's. a is rounded to fp16 from partials
//                   summed in another order than v2's, so logits may differ from v2's by fp16
//                   ulps.
//   decode_mega_v4  v3 with no K/V prefetch and with the splits chosen from the length:
//                   - no K/V prefetch in phase 1 (attention reads the rows itself, as v2 does);
//                   - the splits follow the length: S = clamp(ceil((pos + 1) / 128), 1, S_max),
//                     128 keys being one pass of v3's attention, so a split is one pass (the
//                     fewest splits that add no second pass) and blocks past the B H S tasks
//                     hold none (v3: S_max = grid / (B H) splits at every length, a few keys
//                     each). pos is read on the GPU (it advances inside a captured graph), so
//                     every block computes S from it (mg_splits_v4); the launcher's S is S_max,
//                     which sizes the partials and shared memory;
//                   - the combine stays in the proj prologue (every block combines all B H
//                     heads: its GEMV needs the whole of a). A separate combine needs one more
//                     barrier, or v2's ticket (a fence, an atomic and the last task's combine
//                     after each head's slowest split, then proj still reads a from L2); the
//                     prologue costs only its L2 reads, and mg_combine_v4 issues them at once:
//                     each (m, l) pair one 8-byte load, together with the first partial outputs
//                     (v3 read each head's S denominators one after another), over S partials a
//                     head, not S_max.
//                   Same formulas and order as v3; where S = S_max (batch 8 on 96 to 191 SMs:
//                   S = 1), the logits are v3's bit for bit; elsewhere the splits differ and
//                   the logits may move by fp16 ulps.
//   decode_mega_v5  v4 with 4 grid barriers a layer: attention needs only its own head's q, k,
//                   v, so the barrier after phase 1 becomes a count per head (mg_heads_ready:
//                   each block adds its pairs with atom.release.gpu after __syncthreads, as a
//                   barrier arrival does; mg_wait_heads: a block with an attention task polls
//                   its head's count with ld.acquire.gpu until all 3 x 32 pairs are in; block 0
//                   zeroes the counts after the next barrier, which every waiter has passed).
//                   The other four cannot go: LN2, the next layer's LN1 and the final LN read
//                   every element of x (all of proj's or fc2's rows), proj reads every head's
//                   output, fc2 every fc output. Arithmetic is v4's: logits are v4's bit for
//                   bit.
//   decode_mega_v6  v4 with the weights ahead of the barriers: each block owns a contiguous share
//                   of every GEMV (QKV's pairs, proj's, fc's and fc2's rows) and copies it
//                   into a ring of MEGA_RING shared-memory slots with cp.async, two weight
//                   phases ahead of the one it computes (mg_ring_issue, below). The copies run
//                   while the block computes, waits at the grid barriers and does attention, so
//                   after a barrier a GEMV waits only for its activations (L2), and its weights
//                   are read from shared memory. The L2 prefetches of v2-v5 go, except the LM
//                   head's (too large for the ring: 77 MB at GPT-2's vocabulary). Rows are dealt
//                   to blocks, not round-robin to the grid's warps, so each row's sum is formed
//                   in the same order as v4's (one warp, a row): logits are v4's bit for bit.
//   decode_mega_v7  v6 with the copy engine filling the ring (sm_90): per slot an mbarrier; one
//                   thread announces the share's bytes and issues one bulk copy of the
//                   contiguous rows (cp.async.bulk; QKV's pairs: a copy a row, from the lanes
//                   of warp 0), and the block waits on the mbarrier's phase. v6's cp.async
//                   keeps at most what the SM's load units track in flight; the copy engine
//                   keeps a whole share (up to 36 KiB at GPT-2's shapes) in flight a copy.
//                   Arithmetic is v6's (and v4's): logits are v4's bit for bit. Compiled
//                   below sm_90 (no bulk copies) it is v6. Neither v6 nor v7 made the step
//                   faster than v4 on the H200: with the copies running, the barriers took
//                   longer by what the GEMV phases saved (reports/gpu-lane-2026-11-29-tp-
//                   graphs-mega-ring.md).
//   decode_mega_v8  v4 with W4A16 weights (chapter 10's int4 format, kernels/qgemv.cu: two
//                   weights a byte, two's complement, an fp16 scale per group of 128 along K)
//                   for QKV, proj, fc, fc2 and the LM head: 4x fewer weight bytes. lp holds 12
//                   pointers a layer (the packed weights where v4 has its fp16 ones, then their
//                   scales) and the LM head's scales after the last layer; `head` is the head's
//                   packed weight. Sums as mg_dot_w4 below; the rest is v4's.
//
// Rounding follows the book's separate kernels (KernelGPT.step): every GEMV output is rounded to
// fp16 where that kernel stores fp16 (qkv, attention output, dx, the GELU input and output,
// logits), the residual stream stays fp32, attention in fp32 in the exp2 domain. Sums are in a
// different order, so logits differ from the book step's by fp32 rounding and the occasional fp16
// ulp it moves.
//
// The grid barrier (grid_barrier below): thread 0 of each block reads the generation g
// (ld.acquire.gpu), fences (__threadfence: the block's writes, ordered before by
// __syncthreads, become visible: release), adds 1 to the counter; the last to arrive sets the
// counter back to 0 and publishes g + 1 (st.release.gpu); the others spin on ld.acquire.gpu
// until the generation moves, then fence. The words return to (0, g + 1) after every barrier,
// so the kernel needs no host reset between launches and a graph replays it as it is. A spin
// that lasts more than MEGA_TIMEOUT_NS (blocks not co-resident) sets an error bit and the
// kernel leaves instead of hanging; the launcher reads the bit and resets the words. Data
// written inside the launch (x, q, a, f, the cache rows, partials) is read with ld.global.cg
// (L2, never a stale L1 line); weights with ld_stream16 (read-only path, no L1 allocation).
//
// Launch (kernels/decode_mega_launch.py): grid (SMs x blocks per SM), 256 threads, dynamic
// shared memory B 4d 2 bytes (the fc2 input, the largest GEMV input; v3: at least B d 2 + 4 B H
// (S + 1), the proj input and mg_combine's weights behind it; v4, v5: B d 2 + 4 B H (2 S + 1),
// mg_combine_v4's m or weights, l and denominators; v6, v7: v4's rounded up to 16 bytes, then
// MEGA_RING slots of the largest share of one GEMV's weights, mg_slot_elems); static shared
// memory for
// attention's scores (MEGA_KSMAX floats) and partial outputs. Compiled per (B, d) with
// -DMEGA_B, -DMEGA_D (defaults 1, 768 for a compile without them). Head dimension 64, d a
// multiple of 128 up to 1024. No Numba twin: a grid-wide barrier inside one launch has no
// counterpart in the simulator (its blocks run one after another).
#include <cuda_fp16.h>
// common.cuh: dot8, warp_sum, block_sum, block_max, ld_stream16, gelu_tanh, rope_angle, ArgMax,
// argmax_before
#include "common.cuh"
// mma.cuh: cp_async_16, cp_async_commit, cp_async_wait (v6's ring; synchronous below sm_80)
#include "mma.cuh"

#ifndef MEGA_B
#define MEGA_B 1
#endif
#ifndef MEGA_D
#define MEGA_D 768
#endif

#define MEGA_THREADS 256
#define MEGA_WARPS (MEGA_THREADS / 32)
#define MEGA_HD 64                          // head dimension
#define MEGA_KSMAX 1024                     // keys of one attention split (scores in shared)
#define MEGA_ATT_PASS 128                   // keys of one pass of mg_attention_v3 (4 x 32 slots)
#define MEGA_TIMEOUT_NS 2000000000ull       // a barrier wait this long means: not co-resident

// sync words (uint32): arrival counter, generation, error bits, the LM head's ticket
#define MEGA_COUNT 0
#define MEGA_GEN 1
#define MEGA_ERR 2
#define MEGA_TICKET 3
// error bits
#define MEGA_ERR_TIMEOUT 1
#define MEGA_ERR_POS 2
#define MEGA_ERR_TOKEN 4
// phases (the `phases` mask; all = 63; the others time one part alone, with wrong results)
#define MEGA_PH_QKV 1
#define MEGA_PH_ATT 2
#define MEGA_PH_PROJ 4
#define MEGA_PH_FC 8
#define MEGA_PH_FC2 16
#define MEGA_PH_HEAD 32
// GEMV epilogues
#define MEGA_EPI_RESID 0
#define MEGA_EPI_GELU 1
#define MEGA_EPI_HEAD 2

// ----------------------------------------------------------------------------- memory order
__device__ __forceinline__ unsigned mg_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mg_st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long mg_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every block of the grid has reached this point, and every write made before it is visible to
// every block after it. Returns false (in every thread of the block) when the wait timed out or
// another block reported a timeout: the caller leaves the kernel.
__device__ __forceinline__ bool grid_barrier(unsigned* sync, unsigned nblocks) {
    __shared__ int ok;
    __syncthreads();                                // the block's phase is done
    if (threadIdx.x == 0) {
        int good = 1;
        const unsigned g = mg_ld_acquire(sync + MEGA_GEN);     // before arriving: it cannot move
        __threadfence();                                      // release the block's writes
        const unsigned arrived = atomicAdd(sync + MEGA_COUNT, 1u);
        if (arrived == nblocks - 1) {
            atomicExch(sync + MEGA_COUNT, 0u);                 // ready for the next barrier
            mg_st_release(sync + MEGA_GEN, g + 1u);            // after the reset, for everyone
        } else {
            const unsigned long long t0 = mg_now_ns();
            unsigned spins = 0;
            while (mg_ld_acquire(sync + MEGA_GEN) == g) {
                if (++spins % 256 == 0) {
                    if (mg_ld_acquire(sync + MEGA_ERR) & MEGA_ERR_TIMEOUT) { good = 0; break; }
                    if (mg_now_ns() - t0 > MEGA_TIMEOUT_NS) {
                        atomicOr(sync + MEGA_ERR, (unsigned)MEGA_ERR_TIMEOUT);
                        good = 0;
                        break;
                    }
                }
            }
        }
        __threadfence();                                      // acquire the others' writes
        ok = good;
    }
    __syncthreads();
    const int r = ok;
    return r != 0;
}

__device__ __forceinline__ unsigned mg_atom_add_release(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
                 : "memory");
    return old;
}

// Poll the word p with ld.acquire.gpu (one thread) until it is done: its top bit differs from
// ref's (FLIP) or it is at least ref (not FLIP). After 64 polls sleep between polls; every 1024
// polls look at the error word and the clock (read only then: the fast path never reads
// %globaltimer). false when another block reported a timeout, or after MEGA_TIMEOUT_NS (then
// this thread reports one).
template <bool FLIP>
__device__ __forceinline__ bool mg_poll(const unsigned* p, unsigned* sync, unsigned ref) {
    unsigned spins = 0;
    unsigned long long t0 = 0;
    while (FLIP ? ((mg_ld_acquire(p) ^ ref) & 0x80000000u) == 0u : mg_ld_acquire(p) < ref) {
        ++spins;
        if (spins > 64) __nanosleep(spins < 4096 ? 20 : 200);
        if ((spins & 1023u) == 0u) {
            if (mg_ld_acquire(sync + MEGA_ERR) & MEGA_ERR_TIMEOUT) return false;
            const unsigned long long now = mg_now_ns();
            if (t0 == 0) t0 = now;
            else if (now - t0 > MEGA_TIMEOUT_NS) {
                atomicOr(sync + MEGA_ERR, (unsigned)MEGA_ERR_TIMEOUT);
                return false;
            }
        }
    }
    return true;
}

// v3's grid barrier, the one cooperative groups' grid.sync() uses, with a timeout: one word.
// Thread 0 of block 0 adds 2^31 - (nblocks - 1), every other block 1, with one
// atom.release.gpu (the block's writes, ordered before it by __syncthreads, are released by the
// add itself: no separate fence); the word's top bit flips exactly when the last block's add
// lands, and its low 31 bits come back to what they were (0 after reset()): no reset, no second
// word, and nobody has to publish a generation after the last arrival (one L2 round trip fewer
// than grid_barrier). Thread 0 polls (mg_poll) until the bit differs from the one its add
// returned.
__device__ __forceinline__ bool grid_barrier_flip(unsigned* sync, unsigned nblocks) {
    __shared__ int ok;
    __syncthreads();                                // the block's phase is done
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (nblocks - 1u) : 1u;
        const unsigned old = mg_atom_add_release(sync + MEGA_COUNT, add);
        ok = mg_poll<true>(sync + MEGA_COUNT, sync, old);
    }
    __syncthreads();
    const int r = ok;
    return r != 0;
}

template <bool FLIP>
__device__ __forceinline__ bool mg_barrier(unsigned* sync, unsigned nblocks) {
    if constexpr (FLIP) return grid_barrier_flip(sync, nblocks);
    else return grid_barrier(sync, nblocks);
}

// Warm the L2 with [base, base + bytes): this block's 1/gridDim.x share (the L2 is shared by all
// SMs, so which block asks for which part does not matter). bytes and base multiples of 16.
__device__ __forceinline__ void mg_prefetch(const void* base, unsigned long long bytes) {
    const unsigned long long G = gridDim.x;
    unsigned long long per = (bytes + G - 1) / G;
    per = (per + 4095ull) & ~4095ull;
    const unsigned long long lo = blockIdx.x * per;
    const unsigned long long hi = lo + per < bytes ? lo + per : bytes;
    const char* p = reinterpret_cast<const char*>(base);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (unsigned long long o = lo + threadIdx.x * 4096ull; o < hi; o += MEGA_THREADS * 4096ull) {
        const unsigned n = (unsigned)(hi - o < 4096ull ? hi - o : 4096ull);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(n) : "memory");
    }
#else
    for (unsigned long long o = lo + threadIdx.x * 128ull; o < hi; o += MEGA_THREADS * 128ull)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
}

// ----------------------------------------------------------------------------- LayerNorm
// xs[b, :] = half(LayerNorm(row b) * gamma + beta) for b < B, warp b doing row b (DM / 128
// float4 per lane, two-pass mean and variance from registers). The row is x[b] (fp32, written in
// this launch: read from L2) or, for layer 0, the embedding row wte[tok[b]] (fp16), which
// x_init (when not null) also receives as the residual stream's first value.
template <int B, int DM>
__device__ __forceinline__ void mg_layernorm(const float* x, const __half* __restrict__ wte,
                                             const int* tok, const float* __restrict__ gamma,
                                             const float* __restrict__ beta, float eps,
                                             __half* xs, float* x_init) {
    constexpr int NK = DM / 128;
    const int lane = threadIdx.x & 31, b = threadIdx.x >> 5;
    if (b >= B) return;
    float v[NK][4];
    if (wte != nullptr) {
        const __half* row = wte + (size_t)__ldcg(tok + b) * DM;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row + 128 * k + 4 * lane));
            const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
            const float2 a = __half22float2(h2[0]), c = __half22float2(h2[1]);
            v[k][0] = a.x; v[k][1] = a.y; v[k][2] = c.x; v[k][3] = c.y;
        }
    } else {
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            const float4 f = __ldcg(reinterpret_cast<const float4*>(x + (size_t)b * DM + 128 * k +
                                                                    4 * lane));
            v[k][0] = f.x; v[k][1] = f.y; v[k][2] = f.z; v[k][3] = f.w;
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < NK; ++k) sum += (v[k][0] + v[k][1]) + (v[k][2] + v[k][3]);
    const float mean = warp_sum(sum) / DM;
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < NK; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) sq += (v[k][e] - mean) * (v[k][e] - mean);
    const float rstd = rsqrtf(warp_sum(sq) / DM + eps);
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        const int i = 128 * k + 4 * lane;
        const float4 g = __ldg(reinterpret_cast<const float4*>(gamma + i));
        const float4 be = __ldg(reinterpret_cast<const float4*>(beta + i));
        __half2 lo = __floats2half2_rn((v[k][0] - mean) * rstd * g.x + be.x,
                                       (v[k][1] - mean) * rstd * g.y + be.y);
        __half2 hi = __floats2half2_rn((v[k][2] - mean) * rstd * g.z + be.z,
                                       (v[k][3] - mean) * rstd * g.w + be.w);
        __half2* dst = reinterpret_cast<__half2*>(xs + (size_t)b * DM + i);
        dst[0] = lo;
        dst[1] = hi;
        if (x_init != nullptr)
            *reinterpret_cast<float4*>(x_init + (size_t)b * DM + i) =
                make_float4(v[k][0], v[k][1], v[k][2], v[k][3]);
    }
}

// xs (B, K) fp16 = src (B, K), written in this launch by other blocks (read from L2)
template <int B, int K>
__device__ __forceinline__ void mg_stage(const __half* src, __half* xs) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < B * K / 8; i += MEGA_THREADS) d[i] = __ldcg(s + i);
}

// ----------------------------------------------------------------------------- GEMV rows
// s[r][b] = sum_k W[rows[r], k] xs[b, k] for NR rows of W (N, K) fp16, in every lane of the
// warp. Each lane reads 16-byte pieces c = lane + 32 i of a row (CPL of them per row and pass,
// all NR CPL loads issued before the first multiply-add), fp32 sums in element order (dot8),
// then a shuffle sum.
template <int B, int NR, int K, int MAXC = 6, bool SM = false>
__device__ __forceinline__ void mg_dot(const __half* __restrict__ W, const int (&rows)[NR],
                                       const __half* xs, float (&s)[NR][B]) {
    constexpr int NC = K / 8;                       // 16-byte pieces per row
    constexpr int CPL0 = (NC + 31) / 32;            // pieces per lane in all
    constexpr int CPL = CPL0 < MAXC ? CPL0 : MAXC;  // per pass (registers: NR CPL uint4)
    const int lane = threadIdx.x & 31;
    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    float acc[NR][B];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
#pragma unroll 1
    for (int c0 = 0; c0 < NC; c0 += 32 * CPL) {
        uint4 w[NR][CPL];
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int c = c0 + lane + 32 * i;
#pragma unroll
            for (int r = 0; r < NR; ++r)
                w[r][i] = c >= NC ? make_uint4(0u, 0u, 0u, 0u)
                          : SM ? *reinterpret_cast<const uint4*>(W + (size_t)rows[r] * K + 8 * c)
                               : ld_stream16(W + (size_t)rows[r] * K + 8 * c);
        }
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int c = c0 + lane + 32 * i;
            if (c < NC) {
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const uint4 xx = xv[b * NC + c];
#pragma unroll
                    for (int r = 0; r < NR; ++r) acc[r][b] = dot8(w[r][i], xx, acc[r][b]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) s[r][b] = warp_sum(acc[r][b]);
}

// v8 (W4A16): the same sums over a weight in chapter 10's int4 format (kernels/qgemv.cu): Q
// (N, K / 2) bytes, k = 2i in the low nibble of byte i and 2i + 1 in the high one, two's
// complement (-8..7); S (N, K / G) fp16 scales, G = MEGA_W4_GROUP. A lane reads 16-byte pieces
// c = lane + 32 i of a row (32 weights, k = 32 c .. 32 c + 31, inside one group), all of its
// NR CPL pieces and their scales before the first product; each piece's 32 products are summed
// in fp32 in k order, multiplied by the piece's scale once and added to the row's sum in piece
// order; then the shuffle sum.
#define MEGA_W4_GROUP 128

__device__ __forceinline__ float mg_dot32_w4(uint4 w, const uint4 (&xx)[4]) {
    const unsigned wd[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {                  // word j: k = 8 j .. 8 j + 7, nibble e = k
        const __half2* h = reinterpret_cast<const __half2*>(&xx[j]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 xf = __half22float2(h[e]);
            const int lo = (int)((wd[j] >> (8 * e)) & 0xFu), hi = (int)((wd[j] >> (8 * e + 4)) & 0xFu);
            acc = fmaf((float)((lo ^ 8) - 8), xf.x, acc);
            acc = fmaf((float)((hi ^ 8) - 8), xf.y, acc);
        }
    }
    return acc;
}

template <int B, int NR, int K>
__device__ __forceinline__ void mg_dot_w4(const unsigned char* __restrict__ Q,
                                          const __half* __restrict__ S, const int (&rows)[NR],
                                          const __half* xs, float (&s)[NR][B]) {
    static_assert(K % MEGA_W4_GROUP == 0 && MEGA_W4_GROUP % 32 == 0, "groups of whole pieces");
    constexpr int NC = K / 32;                      // 16-byte pieces (32 weights) per row
    constexpr int CPL = (NC + 31) / 32;             // pieces per lane
    constexpr int NG = K / MEGA_W4_GROUP;           // scales per row
    const int lane = threadIdx.x & 31;
    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    uint4 w[NR][CPL];
    float sc[NR][CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            w[r][i] = c < NC ? ld_stream16(Q + (size_t)rows[r] * (K / 2) + 16 * c)
                             : make_uint4(0u, 0u, 0u, 0u);
            sc[r][i] = c < NC ? __half2float(__ldg(S + (size_t)rows[r] * NG +
                                                   (32 * c) / MEGA_W4_GROUP))
                              : 0.0f;
        }
    }
    float acc[NR][B];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        if (c < NC) {
#pragma unroll
            for (int b = 0; b < B; ++b) {
                uint4 xx[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) xx[j] = xv[b * (K / 8) + 4 * c + j];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r][b] += sc[r][i] * mg_dot32_w4(w[r][i], xx);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) s[r][b] = warp_sum(acc[r][b]);
}

// nv (1..NR) rows r0, r0 + TW, ... of W through mg_dot and the epilogue EPI:
//   RESID  x[b, row] += half(s)               (N = the residual's width)
//   GELU   out[b, row] = half(gelu(half(s)))
//   HEAD   out[b, row] = half(s), and best[b] = the first largest logit so far (rows ascend)
// SM (v6): W is this block's rows in shared memory, local row r being row r + roff of the
// weight (roff = 0 when W is the global weight).
// WQ (v8): W is the int4 weight's bytes and S its scales (mg_dot_w4).
template <int B, int NR, int K, int EPI, int MAXC = 6, bool SM = false, bool WQ = false>
__device__ __forceinline__ void mg_rows(const __half* __restrict__ W, int r0, int TW, int nv,
                                        const __half* xs, int N, float* x, __half* out,
                                        ArgMax (&best)[B], int roff = 0,
                                        const __half* S = nullptr) {
    if constexpr (NR > 1) {
        if (nv < NR) {
            mg_rows<B, NR - 1, K, EPI, MAXC, SM, WQ>(W, r0, TW, nv, xs, N, x, out, best, roff, S);
            return;
        }
    }
    int rows[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) rows[r] = r0 + r * TW;
    float s[NR][B];
    if constexpr (WQ)
        mg_dot_w4<B, NR, K>(reinterpret_cast<const unsigned char*>(W), S, rows, xs, s);
    else
        mg_dot<B, NR, K, MAXC, SM>(W, rows, xs, s);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const __half h = __float2half_rn(s[r][b]);
            if (EPI == MEGA_EPI_HEAD) {
                const float v = __half2float(h);
                if (v > best[b].v) best[b] = ArgMax{v, rows[r] + roff};
            }
            if (lane != b) continue;                 // lane b writes batch row b
            const size_t o = (size_t)b * N + rows[r] + roff;
            if (EPI == MEGA_EPI_RESID) x[o] = __ldcg(x + o) + __half2float(h);
            if (EPI == MEGA_EPI_GELU) out[o] = __float2half_rn(gelu_tanh(__half2float(h)));
            if (EPI == MEGA_EPI_HEAD) out[o] = h;
        }
}

// all N rows of W, row r to global warp r mod TW, NR at a time
template <int B, int NR, int K, int EPI, int MAXC = 6, bool WQ = false>
__device__ __forceinline__ void mg_gemv(const __half* __restrict__ W, int N, const __half* xs,
                                        float* x, __half* out, ArgMax (&best)[B],
                                        const __half* S = nullptr) {
    const int TW = gridDim.x * MEGA_WARPS;
    const int gw = blockIdx.x * MEGA_WARPS + (threadIdx.x >> 5);
    for (int r = gw; r < N; r += NR * TW) {
        const int left = (N - 1 - r) / TW + 1;      // rows r, r + TW, ... below N
        mg_rows<B, NR, K, EPI, MAXC, false, WQ>(W, r, TW, left < NR ? left : NR, xs, N, x, out,
                                                best, 0, S);
    }
}

// ----------------------------------------------------------------------------- phase 1: QKV
// W (3 d, d): q heads, then k heads, then v heads. Task p = a pair (i, i + 32) of head j; a warp
// takes tasks gw and gw + TW together (both pairs' loads in flight).
// SM (v6): W is the block's pairs in shared memory, pair p at local rows 2 (p - pbase) and
// 2 (p - pbase) + 1 (mg_ring_issue's order).
template <int B, int DM, bool SM = false, bool WQ = false>
__device__ __forceinline__ void mg_qkv_task(const __half* __restrict__ W, int p0, int np,
                                            int TW, const __half* xs, int pos, int L,
                                            float log2_base, __half* q, __half* kc_l,
                                            __half* vc_l, int pbase = 0,
                                            const __half* S = nullptr) {
    constexpr int H = DM / MEGA_HD, D = MEGA_HD, HALF = D / 2;
    const int lane = threadIdx.x & 31;
    int rows[4];
    float s[4][B];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int p = t < np ? p0 + t * TW : p0;
        rows[2 * t] = SM ? 2 * (p - pbase) : (p / HALF) * D + p % HALF;
        rows[2 * t + 1] = SM ? rows[2 * t] + 1 : rows[2 * t] + HALF;
    }
    const unsigned char* Q = reinterpret_cast<const unsigned char*>(W);
    if (np == 2) {
        if constexpr (WQ) mg_dot_w4<B, 4, DM>(Q, S, rows, xs, s);
        else mg_dot<B, 4, DM, 6, SM>(W, rows, xs, s);
    } else {
        int r2[2] = {rows[0], rows[1]};
        float s2[2][B];
        if constexpr (WQ) mg_dot_w4<B, 2, DM>(Q, S, r2, xs, s2);
        else mg_dot<B, 2, DM, 6, SM>(W, r2, xs, s2);
#pragma unroll
        for (int b = 0; b < B; ++b) { s[0][b] = s2[0][b]; s[1][b] = s2[1][b]; }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        if (t >= np) break;
        const int p = p0 + t * TW, j = p / HALF, i = p % HALF;
        float cs = 1.0f, sn = 0.0f;
        if (j < 2 * H) rope_angle(pos, i, D, log2_base, &cs, &sn);
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (lane != b) continue;
            const float x1 = __half2float(__float2half_rn(s[2 * t][b]));
            const float x2 = __half2float(__float2half_rn(s[2 * t + 1][b]));
            __half ya, yb;
            if (j < 2 * H) {                        // q or k: rotated at the position
                ya = __float2half(x1 * cs - x2 * sn);
                yb = __float2half(x2 * cs + x1 * sn);
            } else {
                ya = __float2half(x1);
                yb = __float2half(x2);
            }
            if (j < H) {
                const size_t o = ((size_t)b * H + j) * D;
                q[o + i] = ya;
                q[o + i + HALF] = yb;
            } else {                                // the cache row at pos: (b, head, pos, :)
                const int hh = j < 2 * H ? j - H : j - 2 * H;
                __half* c = j < 2 * H ? kc_l : vc_l;
                const size_t o = (((size_t)b * H + hh) * L + pos) * D;
                c[o + i] = ya;
                c[o + i + HALF] = yb;
            }
        }
    }
}

template <int B, int DM, bool WQ = false>
__device__ __forceinline__ void mg_qkv(const __half* __restrict__ W, const __half* xs, int pos,
                                       int L, float log2_base, __half* q, __half* kc_l,
                                       __half* vc_l, const __half* S = nullptr) {
    constexpr int NP = 3 * DM / 2;                   // pairs: 3 H heads x D/2
    const int TW = gridDim.x * MEGA_WARPS;
    const int gw = blockIdx.x * MEGA_WARPS + (threadIdx.x >> 5);
    for (int p = gw; p < NP; p += 2 * TW)
        mg_qkv_task<B, DM, false, WQ>(W, p, p + TW < NP ? 2 : 1, TW, xs, pos, L, log2_base, q,
                                      kc_l, vc_l, 0, S);
}

// ----------------------------------------------------------------------------- v6: the ring
// Every block owns a contiguous share of each GEMV's work: tasks [n j / G, n (j + 1) / G) of
// block j, the tasks being QKV's pairs (n = 3 d / 2, two rows each) or the rows of proj, fc, fc2
// (n = d, 4 d, d). Those rows are copied into one of MEGA_RING slots of shared memory with
// cp.async (16 bytes a thread at a time, L2 only), MEGA_RING - 1 weight phases ahead of the one
// being computed: weights do not depend on the activations, so they stream from HBM while the
// block computes and waits at the grid barriers, and after a barrier only the activations (in
// L2) are waited for. Weight phase w = 4 layer + (0 qkv, 1 proj, 2 fc, 3 fc2) sits in slot
// w mod MEGA_RING; every thread commits one cp.async group per phase (empty past the last
// layer). Phases 0..MEGA_RING-1 are issued before layer 0, phase w + MEGA_RING right after w is
// computed (into the slot w leaves), so while w is computed w + 1 .. w + MEGA_RING - 1 may still
// be in flight: "phase w has landed" is cp_async_wait<MEGA_RING - 1>.
#ifndef MEGA_RING
#define MEGA_RING 3                         // slots (-DMEGA_RING from the launcher)
#endif

__device__ __forceinline__ int mg_share_lo(int n) {
    return (int)(((long long)n * blockIdx.x) / gridDim.x);
}
__device__ __forceinline__ int mg_share_hi(int n) {
    return (int)(((long long)n * (blockIdx.x + 1)) / gridDim.x);
}

// Elements (fp16) of one ring slot: the largest share of any phase (ceil(n / G) tasks).
template <int DM>
__device__ __forceinline__ int mg_slot_elems() {
    const int G = gridDim.x;
    const int qkv = 2 * ((3 * DM / 2 + G - 1) / G) * DM;
    const int fc = ((4 * DM + G - 1) / G) * DM;         // = proj's at most; fc2: d rows of 4 d
    const int fc2 = ((DM + G - 1) / G) * 4 * DM;
    return max(qkv, max(fc, fc2));
}

// The weight row of local row lr of a share starting at task lo: lo + lr, or for QKV's pairs
// (pair p = lo + lr / 2 of head j = p / 32, i = p % 32) row 64 j + i, then row 64 j + i + 32.
__device__ __forceinline__ int mg_share_row(int lo, int lr, bool pairs) {
    if (!pairs) return lo + lr;
    const int p = lo + (lr >> 1);
    return (p / (MEGA_HD / 2)) * MEGA_HD + p % (MEGA_HD / 2) + (lr & 1) * (MEGA_HD / 2);
}

// Weight phase w's share of this block: its first task lo, its rows and their length K.
template <int DM>
__device__ __forceinline__ void mg_share_of(int w, int& lo, int& nrows, int& K) {
    const int kind = w & 3;                              // 0 qkv, 1 proj, 2 fc, 3 fc2
    const int n = kind == 0 ? 3 * DM / 2 : kind == 2 ? 4 * DM : DM;
    lo = mg_share_lo(n);
    nrows = (kind == 0 ? 2 : 1) * (mg_share_hi(n) - lo);
    K = kind == 3 ? 4 * DM : DM;
}

template <int K>
__device__ __forceinline__ void mg_copy_rows(const __half* __restrict__ W, int lo, int nrows,
                                             bool pairs, __half* slot) {
    constexpr int CPR = K / 8;                           // 16-byte pieces a row
    for (int e = threadIdx.x; e < nrows * CPR; e += MEGA_THREADS) {
        const int lr = e / CPR, c = e - lr * CPR;
        const int g = mg_share_row(lo, lr, pairs);
        cp_async_16(slot + (size_t)lr * K + 8 * c, W + (size_t)g * K + 8 * c);
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MEGA_HAS_TMA 1
#else
#define MEGA_HAS_TMA 0
#endif

// Start copying weight phase w's share of this block into its slot (nothing past the last
// phase). cp.async (v6): every thread copies 16-byte pieces and closes its group either way.
// TMA (v7, sm_90): the copy engine does it, announced on the slot's mbarrier bars[w % RING]:
// lane 0 of warp 0 arrives with the share's byte count (mbar_expect_tx) and issues one bulk copy
// of the contiguous rows (proj, fc, fc2), or the lanes one a row (QKV's pairs, rows i and
// i + 32 of a head side by side); the phase of the mbarrier completes when the bytes are in.
// The caller has passed a __syncthreads since the slot was last read.
template <int DM, bool TMA = false>
__device__ __forceinline__ void mg_ring_issue(const unsigned long long* lp, int w, int nw,
                                              __half* ring, unsigned long long* bars) {
    int lo = 0, nrows = 0, K = DM;
    const __half* W = nullptr;
    __half* slot = ring + (size_t)(w % MEGA_RING) * mg_slot_elems<DM>();
    if (w < nw) {
        mg_share_of<DM>(w, lo, nrows, K);
        W = reinterpret_cast<const __half*>(lp[(size_t)(w >> 2) * 8 + 4 + (w & 3)]);
    }
#if MEGA_HAS_TMA
    if constexpr (TMA) {
        if (w >= nw || threadIdx.x >= 32) return;
        const int lane = threadIdx.x;
        unsigned long long* bar = bars + w % MEGA_RING;
        if (lane == 0) {
            fence_proxy_async();
            mbar_expect_tx(bar, (unsigned)nrows * K * 2);
        }
        if ((w & 3) == 0) {                              // QKV's pairs: a copy a row
            __syncwarp();
            for (int lr = lane; lr < nrows; lr += 32)
                bulk_load(slot + (size_t)lr * DM, W + (size_t)mg_share_row(lo, lr, true) * DM,
                          DM * 2, bar);
        } else if (lane == 0 && nrows) {                 // contiguous rows: one copy
            bulk_load(slot, W + (size_t)lo * K, (unsigned)nrows * K * 2, bar);
        }
        return;
    }
#endif
    if (w < nw) {
        if (K == DM) mg_copy_rows<DM>(W, lo, nrows, (w & 3) == 0, slot);
        else mg_copy_rows<4 * DM>(W, lo, nrows, false, slot);
    }
    cp_async_commit();
}

// Wait until weight phase w has landed (cp.async: in every thread's copies; TMA: the slot's
// mbarrier phase, the (w / RING)-th use of the slot), then __syncthreads; return its slot.
template <int DM, bool TMA = false>
__device__ __forceinline__ const __half* mg_ring_wait(int w, const __half* ring,
                                                     unsigned long long* bars) {
#if MEGA_HAS_TMA
    if constexpr (TMA) mbar_wait(bars + w % MEGA_RING, (unsigned)(w / MEGA_RING) & 1u);
    else
#endif
        cp_async_wait<MEGA_RING - 1>();
    __syncthreads();
    return ring + (size_t)(w % MEGA_RING) * mg_slot_elems<DM>();
}

// The block's rows [lo, hi) of W (N, K) from its slot, a warp per row (NR at once, local rows
// warp, warp + 8, ...), then the epilogue EPI.
template <int B, int NR, int K, int EPI, int MAXC = 6>
__device__ __forceinline__ void mg_gemv_ring(const __half* Ws, int N, const __half* xs, float* x,
                                             __half* out, ArgMax (&best)[B]) {
    const int lo = mg_share_lo(N), n = mg_share_hi(N) - lo;
    for (int r = threadIdx.x >> 5; r < n; r += NR * MEGA_WARPS) {
        const int left = (n - 1 - r) / MEGA_WARPS + 1;
        mg_rows<B, NR, K, EPI, MAXC, true>(Ws, r, MEGA_WARPS, left < NR ? left : NR, xs, N, x,
                                           out, best, lo);
    }
}

// QKV's pairs [lo, hi) from the slot, as mg_qkv (a warp takes two pairs at once).
template <int B, int DM>
__device__ __forceinline__ void mg_qkv_ring(const __half* Ws, const __half* xs, int pos, int L,
                                            float log2_base, __half* q, __half* kc_l,
                                            __half* vc_l) {
    const int lo = mg_share_lo(3 * DM / 2), hi = mg_share_hi(3 * DM / 2);
    for (int p = lo + (threadIdx.x >> 5); p < hi; p += 2 * MEGA_WARPS)
        mg_qkv_task<B, DM, true>(Ws, p, p + MEGA_WARPS < hi ? 2 : 1, MEGA_WARPS, xs, pos, L,
                                 log2_base, q, kc_l, vc_l, lo);
}

// ----------------------------------------------------------------------------- phase 2
// Attention of q (B, H, D) over keys 0..n-1 of this layer's caches (B, H, L, D). Task
// (b, h, s) = block-sized work: split s holds keys [s cs, (s + 1) cs), cs = ceil(n / S) <=
// MEGA_KSMAX (the launcher picks S so). A thread per key for the scores (8 16-byte loads of its
// K row), exp2 with the block's max, then threads (key group g, 8 columns c) sum p_j v_j and the
// groups are added in shared memory. The partial (o[D], m, l) goes to part[(b H + h) S + s];
// the last of the S tasks of (b, h) to finish (atomic ticket cnt[b H + h], back to 0 after)
// combines them: a[b, h D + e] = sum_s 2^(m_s - M) o_s[e] / sum_s 2^(m_s - M) l_s.
template <int B, int DM>
__device__ __forceinline__ void mg_attention(const __half* q, const __half* kc_l,
                                             const __half* vc_l, int L, int n, int S,
                                             float scale_log2, float* part, unsigned* cnt,
                                             __half* a) {
    constexpr int H = DM / MEGA_HD, D = MEGA_HD, NG = MEGA_THREADS / 8;
    __shared__ float qs[D];
    __shared__ float sc[MEGA_KSMAX];
    __shared__ float ored[NG][D];
    __shared__ float red[BLOCK_REDUCE_SMEM];
    __shared__ int last;
    const int t = threadIdx.x;
    const int cs = (n + S - 1) / S;
    for (int task = blockIdx.x; task < B * H * S; task += gridDim.x) {
        const int s = task % S, bh = task / S;
        const int k0 = min(n, s * cs), k1 = min(n, k0 + cs);
        if (t < D) qs[t] = __half2float(__ldcg(q + (size_t)bh * D + t)) * scale_log2;
        __syncthreads();
        const __half* K = kc_l + (size_t)bh * L * D;
        const __half* V = vc_l + (size_t)bh * L * D;
        float m = -INFINITY;
        for (int j = k0 + t; j < k1; j += MEGA_THREADS) {
            const uint4* kr = reinterpret_cast<const uint4*>(K + (size_t)j * D);
            uint4 raw[D / 8];
#pragma unroll
            for (int c = 0; c < D / 8; ++c) raw[c] = __ldcg(kr + c);
            float acc = 0.0f;
#pragma unroll
            for (int c = 0; c < D / 8; ++c) {
                const __half2* k2 = reinterpret_cast<const __half2*>(&raw[c]);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float2 kv = __half22float2(k2[u]);
                    const int e = 8 * c + 2 * u;
                    acc += qs[e] * kv.x + qs[e + 1] * kv.y;
                }
            }
            sc[j - k0] = acc;
            m = fmaxf(m, acc);
        }
        m = block_max(m, red);                     // its barriers also publish sc[]
        float l = 0.0f;
        for (int j = t; j < k1 - k0; j += MEGA_THREADS) {
            const float pj = exp2f(sc[j] - m);
            sc[j] = pj;
            l += pj;
        }
        l = block_sum(l, red);                     // and the probabilities
        const int g = t >> 3, c = t & 7;
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.0f;
        for (int j = k0 + g; j < k1; j += NG) {
            const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(V + (size_t)j * D) + c);
            const float pj = sc[j - k0];
            const __half2* v2 = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float2 vv = __half22float2(v2[u]);
                o[2 * u] += pj * vv.x;
                o[2 * u + 1] += pj * vv.y;
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ored[g][8 * c + e] = o[e];
        __syncthreads();
        float* pp = part + (size_t)task * (D + 2);  // task = bh S + s
        if (t < D) {
            float acc = 0.0f;
            for (int gg = 0; gg < NG; ++gg) acc += ored[gg][t];
            pp[t] = acc;
            if (t == 0) {
                pp[D] = m;
                pp[D + 1] = l;
            }
        }
        __syncthreads();                           // the partial is written by this block
        if (t == 0) {
            __threadfence();                       // ... and visible before the ticket
            const unsigned prev = atomicAdd(cnt + bh, 1u);
            last = prev == (unsigned)(S - 1);
            if (last) atomicExch(cnt + bh, 0u);    // ready for the next layer
        }
        __syncthreads();
        if (last) {
            __threadfence();                       // the other tasks' partials, acquired
            if (t < D) {
                const float* pb = part + (size_t)bh * S * (D + 2);
                float M = -INFINITY;
                for (int k = 0; k < S; ++k) M = fmaxf(M, __ldcg(pb + (size_t)k * (D + 2) + D));
                float num = 0.0f, den = 0.0f;
                for (int k = 0; k < S; ++k) {
                    const float mk = __ldcg(pb + (size_t)k * (D + 2) + D);
                    if (mk == -INFINITY) continue;   // an empty split weighs nothing
                    const float wk = exp2f(mk - M);
                    num += wk * __ldcg(pb + (size_t)k * (D + 2) + t);
                    den += wk * __ldcg(pb + (size_t)k * (D + 2) + D + 1);
                }
                const int b = bh / H, h = bh % H;
                a[(size_t)b * DM + h * D + t] = __float2half(num / den);
            }
        }
        __syncthreads();                           // qs, sc, ored, last free for the next task
    }
}

// ----------------------------------------------------------------------------- v3 attention
// Warm the L2 with the keys and values 0..n-1 of every (b, h) of this layer (n rows of 128
// bytes from (b H + h) L D): they were written by earlier steps, so phase 1 can ask for them
// before the barrier that attention waits on. The row at pos (written in phase 1) is not asked.
template <int B, int DM>
__device__ __forceinline__ void mg_prefetch_kv(const __half* kc_l, const __half* vc_l, int L,
                                               int n) {
    constexpr int BH = B * (DM / MEGA_HD), D = MEGA_HD;
    const unsigned gt = blockIdx.x * MEGA_THREADS + threadIdx.x, GT = gridDim.x * MEGA_THREADS;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned nch = ((unsigned)n * D * 2u + 4095u) / 4096u;    // 4 KiB pieces per (b, h)
    for (unsigned c = gt; c < 2u * BH * nch; c += GT) {
        const unsigned which = c / (BH * nch), r = c % (BH * nch), bh = r / nch, k = r % nch;
        const char* base = reinterpret_cast<const char*>((which ? vc_l : kc_l) +
                                                         (size_t)bh * L * D);
        const unsigned lo = k * 4096u, bytes = (unsigned)n * D * 2u;
        const unsigned sz = bytes - lo < 4096u ? bytes - lo : 4096u;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + lo), "r"(sz)
                     : "memory");
    }
#else
    for (unsigned c = gt; c < 2u * BH * (unsigned)n; c += GT) {    // a 128-byte row each
        const unsigned which = c / (BH * n), r = c % (BH * n), bh = r / n, j = r % n;
        const __half* row = (which ? vc_l : kc_l) + ((size_t)bh * L + j) * D;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row));
    }
#endif
}

// Merge the softmax state (m, l, o[8]) with another (m2, l2, o2) (exp2 domain; -inf: empty).
__device__ __forceinline__ void mg_merge(float& m, float& l, float (&o)[8], float m2, float l2,
                                         const float (&o2)[8]) {
    const float M = fmaxf(m, m2);
    const float a = m == -INFINITY ? 0.0f : exp2f(m - M);
    const float b = m2 == -INFINITY ? 0.0f : exp2f(m2 - M);
    l = l * a + l2 * b;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = o[e] * a + o2[e] * b;
    m = M;
}

// v3's attention: task (b, h, s) per block as in mg_attention (split s holds keys [s cs,
// (s + 1) cs), cs = ceil(n / S), no limit on cs), but with every warp busy: 8 lanes hold one key
// (lane c of the 8: columns 8c..8c+7, one 16-byte load of K and one of V), a warp 4 keys, the
// block 32 key slots; each thread takes KPT keys a pass (slot, slot + 32, ...) and issues all
// their K and V loads before the first dot product. Scores by a 3-step shuffle inside the 8
// lanes; each slot keeps an online softmax (m, l, o[8 columns]); the 4 slots of a warp merge by
// shuffles, the 8 warps in shared memory. The partial (o[D], m, l) goes to part[(b H + h) S + s]
// as in mg_attention; nothing combines here: the proj phase does (mg_combine), after the barrier.
template <int B, int DM>
__device__ __forceinline__ void mg_attention_v3(const __half* q, const __half* kc_l,
                                                const __half* vc_l, int L, int n, int S,
                                                float scale_log2, float* part) {
    constexpr int H = DM / MEGA_HD, D = MEGA_HD, KPT = 4, SLOTS = 4 * MEGA_WARPS;
    static_assert(KPT * SLOTS == MEGA_ATT_PASS, "v4's splits count passes of this loop");
    __shared__ float wm[MEGA_WARPS], wl[MEGA_WARPS];
    __shared__ float wo[MEGA_WARPS][D];
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, c = lane & 7;
    const int slot = w * 4 + (lane >> 3);
    const int cs = (n + S - 1) / S;
    for (int task = blockIdx.x; task < B * H * S; task += gridDim.x) {
        const int s = task % S, bh = task / S;
        const int k0 = min(n, s * cs), k1 = min(n, k0 + cs);
        const uint4* K = reinterpret_cast<const uint4*>(kc_l + (size_t)bh * L * D) + c;
        const uint4* V = reinterpret_cast<const uint4*>(vc_l + (size_t)bh * L * D) + c;
        const uint4 qraw = __ldcg(reinterpret_cast<const uint4*>(q + (size_t)bh * D) + c);
        float qf[8];
        {
            const __half2* q2 = reinterpret_cast<const __half2*>(&qraw);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float2 f = __half22float2(q2[u]);
                qf[2 * u] = f.x * scale_log2;
                qf[2 * u + 1] = f.y * scale_log2;
            }
        }
        float m = -INFINITY, l = 0.0f, o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.0f;
#pragma unroll 1
        for (int j0 = k0; j0 < k1; j0 += KPT * SLOTS) {   // the same trip count in every lane
            uint4 kr[KPT], vr[KPT];
#pragma unroll
            for (int u = 0; u < KPT; ++u) {
                const int j = j0 + slot + u * SLOTS;
                kr[u] = j < k1 ? __ldcg(K + (size_t)j * (D / 8)) : make_uint4(0u, 0u, 0u, 0u);
                vr[u] = j < k1 ? __ldcg(V + (size_t)j * (D / 8)) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < KPT; ++u) {
                const __half2* k2 = reinterpret_cast<const __half2*>(&kr[u]);
                float acc = 0.0f;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 kv = __half22float2(k2[e]);
                    acc += qf[2 * e] * kv.x + qf[2 * e + 1] * kv.y;
                }
                acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                acc += __shfl_xor_sync(0xffffffffu, acc, 4);
                if (j0 + slot + u * SLOTS < k1) {
                    const float M = fmaxf(m, acc);
                    const float a = exp2f(m - M), pj = exp2f(acc - M);   // m = -inf: a = 0
                    const __half2* v2 = reinterpret_cast<const __half2*>(&vr[u]);
                    l = l * a + pj;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float2 vv = __half22float2(v2[e]);
                        o[2 * e] = o[2 * e] * a + pj * vv.x;
                        o[2 * e + 1] = o[2 * e + 1] * a + pj * vv.y;
                    }
                    m = M;
                }
            }
        }
#pragma unroll
        for (int off = 8; off < 32; off *= 2) {            // the warp's 4 slots
            float o2[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, o[e], off);
            const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
            const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
            mg_merge(m, l, o, m2, l2, o2);
        }
        if (lane < 8) {
#pragma unroll
            for (int e = 0; e < 8; ++e) wo[w][8 * c + e] = o[e];
            if (lane == 0) {
                wm[w] = m;
                wl[w] = l;
            }
        }
        __syncthreads();
        if (t < D) {                                        // the 8 warps, in shared memory
            float M = -INFINITY;
#pragma unroll
            for (int k = 0; k < MEGA_WARPS; ++k) M = fmaxf(M, wm[k]);
            float acc = 0.0f, den = 0.0f;
#pragma unroll
            for (int k = 0; k < MEGA_WARPS; ++k) {
                const float wk = wm[k] == -INFINITY ? 0.0f : exp2f(wm[k] - M);
                acc += wk * wo[k][t];
                den += wk * wl[k];
            }
            float* pp = part + (size_t)task * (D + 2);
            pp[t] = acc;
            if (t == 0) {
                pp[D] = M;
                pp[D + 1] = den;
            }
        }
        __syncthreads();                                    // wm, wl, wo free for the next task
    }
}

// The proj phase's prologue in v3: xs (B, d) fp16 = the attention output, combined from the S
// partials of every (b, h) (written before the barrier by other blocks: read from L2), with
// mg_attention's formula and order: a = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s. First
// the weights 2^(m_s - M) and the denominators of all B H heads into shared memory ws (B H S +
// B H floats), then each thread's outputs idx = t, t + 256, ... (idx = (b H + h) D + e, which
// is also a's offset b d + h D + e), NC outputs at a time with KU partials of each in flight.
template <int B, int DM>
__device__ __forceinline__ void mg_combine(const float* part, int S, __half* xs, float* ws) {
    constexpr int H = DM / MEGA_HD, D = MEGA_HD, BH = B * H;
    constexpr int NI = (B * DM + MEGA_THREADS - 1) / MEGA_THREADS;   // outputs per thread
    constexpr int NC = NI < 16 ? NI : 16;                            // outputs per batch
    constexpr int KU = NC >= 24 ? 1 : 24 / NC;                       // splits per batch
    const int t = threadIdx.x;
    float* den = ws + BH * S;
    for (int i = t; i < BH * S; i += MEGA_THREADS)
        ws[i] = __ldcg(part + (size_t)i * (D + 2) + D);               // m_s for now
    __syncthreads();
    for (int bh = t; bh < BH; bh += MEGA_THREADS) {
        float M = -INFINITY;
        for (int k = 0; k < S; ++k) M = fmaxf(M, ws[bh * S + k]);
        float dn = 0.0f;
        for (int k = 0; k < S; ++k) {
            const float mk = ws[bh * S + k];
            const float wk = mk == -INFINITY ? 0.0f : exp2f(mk - M);   // an empty split: 0
            dn += wk * __ldcg(part + ((size_t)bh * S + k) * (D + 2) + D + 1);
            ws[bh * S + k] = wk;
        }
        den[bh] = dn;
    }
    __syncthreads();
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NC) {                            // NC outputs at a time
        float num[NC];
#pragma unroll
        for (int i = 0; i < NC; ++i) num[i] = 0.0f;
        for (int k0 = 0; k0 < S; k0 += KU) {
            float ov[NC][KU];
#pragma unroll
            for (int i = 0; i < NC; ++i) {
                const int idx = t + (i0 + i) * MEGA_THREADS;
#pragma unroll
                for (int u = 0; u < KU; ++u) {
                    const int k = k0 + u;
                    ov[i][u] = i0 + i < NI && idx < B * DM && k < S
                                   ? __ldcg(part + ((size_t)(idx / D) * S + k) * (D + 2) + idx % D)
                                   : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < NC; ++i) {
                const int idx = t + (i0 + i) * MEGA_THREADS;
#pragma unroll
                for (int u = 0; u < KU; ++u)
                    if (i0 + i < NI && idx < B * DM && k0 + u < S)
                        num[i] += ws[(idx / D) * S + k0 + u] * ov[i][u];
            }
        }
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            const int idx = t + (i0 + i) * MEGA_THREADS;
            if (i0 + i < NI && idx < B * DM) xs[idx] = __float2half(num[i] / den[idx / D]);
        }
    }
}

// ----------------------------------------------------------------------------- v4, v5
// v4's splits of a head's n keys: one pass of mg_attention_v3 each (at most MEGA_ATT_PASS keys),
// S = clamp(ceil(n / MEGA_ATT_PASS), 1, smax), smax the launcher's S (grid / (B H): at most one
// task per block; the partials and mg_combine_v4's shared memory are sized for it). n = pos + 1
// is read on the GPU, so every block computes S the same way. (The host mirror:
// decode_mega_launch.active_splits.)
__device__ __forceinline__ int mg_splits_v4(int n, int smax) {
    const int s = (n + MEGA_ATT_PASS - 1) / MEGA_ATT_PASS;
    return s < 1 ? 1 : (s < smax ? s : smax);
}

// v4's combine: mg_combine's formula and order, but no L2 read waits for another. v3's walked
// each head's S denominators one dependent L2 load after another; here every (m, l) pair is one
// 8-byte load (thread i: partial i), issued together with the first NC x KU partial outputs,
// then both go to shared memory; the weights and denominators are computed from there. ws:
// m_s then the weights (B H S floats), l_s (B H S), the denominators (B H).
template <int B, int DM>
__device__ __forceinline__ void mg_combine_v4(const float* part, int S, __half* xs, float* ws) {
    constexpr int H = DM / MEGA_HD, D = MEGA_HD, BH = B * H;
    constexpr int NI = (B * DM + MEGA_THREADS - 1) / MEGA_THREADS;   // outputs per thread
    constexpr int NC = NI < 16 ? NI : 16;                            // outputs per batch
    constexpr int KU = NC >= 24 ? 1 : 24 / NC;                       // splits per batch
    const int t = threadIdx.x, n = BH * S;
    float* ls = ws + n;
    float* den = ls + n;
    float2 ml = make_float2(0.0f, 0.0f);                             // (m, l) of partial t
    if (t < n) ml = __ldcg(reinterpret_cast<const float2*>(part + (size_t)t * (D + 2) + D));
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NC) {                            // NC outputs at a time
        float num[NC];
#pragma unroll
        for (int i = 0; i < NC; ++i) num[i] = 0.0f;
        for (int k0 = 0; k0 < S; k0 += KU) {
            float ov[NC][KU];
#pragma unroll
            for (int i = 0; i < NC; ++i) {
                const int idx = t + (i0 + i) * MEGA_THREADS;
#pragma unroll
                for (int u = 0; u < KU; ++u) {
                    const int k = k0 + u;
                    ov[i][u] = i0 + i < NI && idx < B * DM && k < S
                                   ? __ldcg(part + ((size_t)(idx / D) * S + k) * (D + 2) + idx % D)
                                   : 0.0f;
                }
            }
            if (i0 == 0 && k0 == 0) {              // the first outputs are in flight: weights
                if (t < n) {
                    ws[t] = ml.x;
                    ls[t] = ml.y;
                }
#pragma unroll 1
                for (int i = t + MEGA_THREADS; i < n; i += MEGA_THREADS) {   // grid > 256
                    const float* pi = part + (size_t)i * (D + 2) + D;
                    const float2 v = __ldcg(reinterpret_cast<const float2*>(pi));
                    ws[i] = v.x;
                    ls[i] = v.y;
                }
                __syncthreads();
                for (int bh = t; bh < BH; bh += MEGA_THREADS) {
                    float M = -INFINITY;
                    for (int k = 0; k < S; ++k) M = fmaxf(M, ws[bh * S + k]);
                    float dn = 0.0f;
                    for (int k = 0; k < S; ++k) {
                        const float mk = ws[bh * S + k];
                        const float wk = mk == -INFINITY ? 0.0f : exp2f(mk - M);   // empty: 0
                        dn += wk * ls[bh * S + k];
                        ws[bh * S + k] = wk;
                    }
                    den[bh] = dn;
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < NC; ++i) {
                const int idx = t + (i0 + i) * MEGA_THREADS;
#pragma unroll
                for (int u = 0; u < KU; ++u)
                    if (i0 + i < NI && idx < B * DM && k0 + u < S)
                        num[i] += ws[(idx / D) * S + k0 + u] * ov[i][u];
            }
        }
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            const int idx = t + (i0 + i) * MEGA_THREADS;
            if (i0 + i < NI && idx < B * DM) xs[idx] = __float2half(num[i] / den[idx / D]);
        }
    }
}

// v5: instead of the grid barrier after phase 1, a count per head of the QKV pairs written
// (cnt[h], h < H: 3 x 32 pairs, the q, k and v rows of head h, every batch row). Block k's warps
// hold pairs 8k + w + i TW (mg_qkv, TW = 8 G): each round i, 8 pairs of one q, k or v head (8
// divides a head's 32 pairs, and NP and TW are multiples of 8). After __syncthreads thread 0 adds
// 8 per round with atom.release.gpu (as grid_barrier_flip's add: it releases the whole block's
// writes of q and of the cache rows at pos).
template <int B, int DM>
__device__ __forceinline__ void mg_heads_ready(unsigned* cnt) {
    constexpr int H = DM / MEGA_HD, HALF = MEGA_HD / 2, NP = 3 * DM / 2;
    static_assert(HALF % MEGA_WARPS == 0, "a block's pairs of one round lie in one head");
    __syncthreads();                               // every warp's q, k, v written
    if (threadIdx.x == 0)
        for (int p = blockIdx.x * MEGA_WARPS; p < NP; p += gridDim.x * MEGA_WARPS)
            mg_atom_add_release(cnt + (p / HALF) % H, (unsigned)MEGA_WARPS);
}

// v5: thread 0 waits (mg_poll, ld.acquire.gpu) until the head of each of this block's attention
// tasks (task = (b H + h) S + s, B H S tasks) has all 3 x 32 pairs, then __syncthreads hands the
// acquired writes to the block. Blocks without a task do not wait. false on a timeout.
template <int B, int DM>
__device__ __forceinline__ bool mg_wait_heads(const unsigned* cnt, int S, unsigned* sync) {
    constexpr int H = DM / MEGA_HD;
    __shared__ int ok;
    if (threadIdx.x == 0) {
        int good = 1;
        for (int task = blockIdx.x; good && task < B * H * S; task += gridDim.x)
            good = mg_poll<false>(cnt + (task / S) % H, sync, 3u * (MEGA_HD / 2));
        ok = good;
    }
    __syncthreads();
    const int r = ok;
    return r != 0;
}

// ----------------------------------------------------------------------------- the step
// lp: (n_layer, 8) device pointers per layer: ln1 gamma, ln1 beta, ln2 gamma, ln2 beta (fp32,
// d), W_qkv (3d, d), W_proj (d, d), W_fc (4d, d), W_fc2 (d, 4d) (fp16). x (B, d) fp32; q
// (B, H, D), a (B, d), f (B, 4d) fp16 scratch; part (B H S, D + 2) fp32; cnt (B H) uint32
// zeros (v5: its first H words count each head's QKV pairs); amax_v, amax_i (grid, B); sync (4)
// uint32 zeros; logits (B, vocab) fp16; tok (B) and pos (1) int32 in and out; history
// (B, hist_len) int32 or null. S: the splits of a head's keys (v4, v5: the most, see
// mg_splits_v4).
// STEP: false (v1, v2), true (v3), 4 or 5 (v4, v5). It is an auto parameter so that v1-v3's
// instantiations kept the names they had before v4 (their PTX did not change).
// v6, v7 leave the kernel only with no copy in flight into their shared memory: the phases
// after wdone (the last waited for) up to RING ahead, not past the last.
template <bool RING, bool TMA>
__device__ __forceinline__ void mg_drain(unsigned long long* bars, int wdone, int nw) {
    if constexpr (RING) {
#if MEGA_HAS_TMA
        if constexpr (TMA) {
            for (int w = wdone + 1; w <= wdone + MEGA_RING && w < nw; ++w)
                mbar_wait(bars + w % MEGA_RING, (unsigned)(w / MEGA_RING) & 1u);
            return;
        }
#endif
        cp_async_wait<0>();
    }
}

template <int B, int DM, bool PF, int NRH, auto STEP = false>
__device__ __forceinline__ void decode_mega_body(
    const unsigned long long* __restrict__ lp, const __half* __restrict__ wte,
    const __half* __restrict__ head, const float* __restrict__ lnf_g,
    const float* __restrict__ lnf_b, __half* kc, __half* vc, float* x, __half* q, __half* a,
    __half* f, float* part, unsigned* cnt, float* amax_v, int* amax_i, unsigned* sync,
    __half* logits, int* tok, int* pos, int* history, int hist_len, int n_layer, int L,
    int vocab, int S, float eps, float log2_base, float scale_log2, int phases,
    unsigned long long pf_cap) {
    static_assert(B >= 1 && B <= MEGA_WARPS, "a warp per batch row normalises x");
    static_assert(DM % 128 == 0 && DM <= 1024, "d: a multiple of 128, at most 1024");
    constexpr int H = DM / MEGA_HD;
    constexpr int LADDER = STEP == true ? 3 : (int)STEP;
    constexpr bool V3 = LADDER >= 3, V4 = LADDER >= 4, V5 = LADDER == 5;
    constexpr bool RING = LADDER == 6 || LADDER == 7;
    constexpr bool TMA = LADDER == 7;
    constexpr bool WQ = LADDER == 8;                   // v8: v4 with int4 weights
    constexpr int LPS = WQ ? 12 : 8;                   // pointers a layer in lp
    constexpr unsigned long long WDIV = WQ ? 4 : 1;    // fp16 bytes / weight bytes
    extern __shared__ uint4 mg_dyn[];
    __half* xs = reinterpret_cast<__half*>(mg_dyn);    // (B, <= 4d) fp16: the GEMV's input
    __shared__ float wbv[MEGA_WARPS][B];
    __shared__ int wbi[MEGA_WARPS][B];
    __shared__ int last;
    const unsigned G = gridDim.x;
    const int t = threadIdx.x;

    if (__ldcg(sync + MEGA_ERR) != 0u) return;     // an earlier step failed: wait for a reset
    const int p = __ldcg(pos);                     // every block reads pos and tok here, before
    int bad = p < 0 || p >= L ? MEGA_ERR_POS : 0;  // the first barrier; the last block writes
#pragma unroll                                     // them after the last one
    for (int b = 0; b < B; ++b) {
        const int tk = __ldcg(tok + b);
        if (tk < 0 || tk >= vocab) bad |= MEGA_ERR_TOKEN;
    }
    if (bad) {                                     // the same decision in every block
        if (blockIdx.x == 0 && t == 0) atomicOr(sync + MEGA_ERR, (unsigned)bad);
        return;
    }
    ArgMax best[B];                                // the LM head's running argmax per batch row
#pragma unroll
    for (int b = 0; b < B; ++b) best[b] = ArgMax{-INFINITY, 0x7fffffff};
    const size_t layer_cache = (size_t)B * H * L * MEGA_HD;
    const int Sa = V4 ? mg_splits_v4(p + 1, S) : S;    // the splits of this step's p + 1 keys
    // v6: the ring of weight slots behind xs (v4's dynamic shared memory, rounded to 16 bytes)
    const int xs_bytes = max(B * 4 * DM * 2, B * DM * 2 + 4 * B * H * (2 * S + 1));
    __half* ring = xs + ((xs_bytes + 15) & ~15) / 2;
    const int nw = 4 * n_layer;                        // weight phases
    __shared__ unsigned long long bars[MEGA_RING];     // v7: a slot's copies complete here
    int wdone = -1;                                    // the last weight phase waited for
#if MEGA_HAS_TMA
    if (TMA) {
        if (t < MEGA_RING) mbar_init(bars + t, 1);
        fence_barrier_init();
        __syncthreads();
    }
#endif
    if (RING)
        for (int w = 0; w < MEGA_RING; ++w) mg_ring_issue<DM, TMA>(lp, w, nw, ring, bars);

    for (int layer = 0; layer < n_layer; ++layer) {
        const unsigned long long* P = lp + (size_t)layer * LPS;
        const float* g1 = reinterpret_cast<const float*>(P[0]);
        const float* b1 = reinterpret_cast<const float*>(P[1]);
        const float* g2 = reinterpret_cast<const float*>(P[2]);
        const float* b2 = reinterpret_cast<const float*>(P[3]);
        const __half* Wqkv = reinterpret_cast<const __half*>(P[4]);
        const __half* Wproj = reinterpret_cast<const __half*>(P[5]);
        const __half* Wfc = reinterpret_cast<const __half*>(P[6]);
        const __half* Wfc2 = reinterpret_cast<const __half*>(P[7]);
        // v8: the int4 weights' scales (P[4..7] are then the packed weights' bytes)
        const __half* Sqkv = WQ ? reinterpret_cast<const __half*>(P[8]) : nullptr;
        const __half* Sproj = WQ ? reinterpret_cast<const __half*>(P[9]) : nullptr;
        const __half* Sfc = WQ ? reinterpret_cast<const __half*>(P[10]) : nullptr;
        const __half* Sfc2 = WQ ? reinterpret_cast<const __half*>(P[11]) : nullptr;
        __half* kc_l = kc + layer * layer_cache;
        __half* vc_l = vc + layer * layer_cache;

        const int wq = 4 * layer;                      // v6: this layer's qkv weight phase
        // 1. LN1 (layer 0: of the embedding row; block 0 also writes it to x) + QKV + RoPE + append
        if (RING) {
            if (phases & MEGA_PH_QKV) {
                if (layer == 0)
                    mg_layernorm<B, DM>(nullptr, wte, tok, g1, b1, eps, xs,
                                        blockIdx.x == 0 ? x : nullptr);
                else
                    mg_layernorm<B, DM>(x, nullptr, nullptr, g1, b1, eps, xs, nullptr);
            }
            wdone = wq;
            const __half* Ws = mg_ring_wait<DM, TMA>(wdone, ring, bars);  // (syncs xs too)
            if (phases & MEGA_PH_QKV) mg_qkv_ring<B, DM>(Ws, xs, p, L, log2_base, q, kc_l, vc_l);
            __syncthreads();
            mg_ring_issue<DM, TMA>(lp, wq + MEGA_RING, nw, ring, bars);
        } else if (phases & MEGA_PH_QKV) {
            if (layer == 0)
                mg_layernorm<B, DM>(nullptr, wte, tok, g1, b1, eps, xs,
                                    blockIdx.x == 0 ? x : nullptr);
            else
                mg_layernorm<B, DM>(x, nullptr, nullptr, g1, b1, eps, xs, nullptr);
            __syncthreads();
            mg_qkv<B, DM, WQ>(Wqkv, xs, p, L, log2_base, q, kc_l, vc_l, Sqkv);
            if (V5) mg_heads_ready<B, DM>(cnt);
            if (V3 && !V4) mg_prefetch_kv<B, DM>(kc_l, vc_l, L, p);
            if (PF && !RING) {
                mg_prefetch(Wproj, (unsigned long long)DM * DM * 2 / WDIV);
                mg_prefetch(Wfc, (unsigned long long)4 * DM * DM * 2 / WDIV);
            }
        }
        if (!V5)                                   // v5: a count per head instead
            if (!mg_barrier<V3>(sync, G)) return mg_drain<RING, TMA>(bars, wdone, nw);
        // 2. attention over keys 0..p
        if (phases & MEGA_PH_ATT) {
            if (V5 && (phases & MEGA_PH_QKV))      // (no QKV phase: nothing to wait for)
                if (!mg_wait_heads<B, DM>(cnt, Sa, sync)) return;
            if (V3) mg_attention_v3<B, DM>(q, kc_l, vc_l, L, p + 1, Sa, scale_log2, part);
            else mg_attention<B, DM>(q, kc_l, vc_l, L, p + 1, S, scale_log2, part, cnt, a);
        }
        if (PF && !RING) mg_prefetch(Wfc2, (unsigned long long)4 * DM * DM * 2 / WDIV);
        if (!mg_barrier<V3>(sync, G)) return mg_drain<RING, TMA>(bars, wdone, nw);
        // every wait on this layer's counts is over: zero them for the next layer's phase 1
        // (ordered before it by the next barrier, like any write)
        if (V5 && blockIdx.x == 0 && t < H) cnt[t] = 0u;
        // 3. output projection, x += half(a W_proj^T) (v3: a combined from the partials first)
        if (RING) {
            if (phases & MEGA_PH_PROJ)
                mg_combine_v4<B, DM>(part, Sa, xs, reinterpret_cast<float*>(xs + B * DM));
            wdone = wq + 1;
            const __half* Ws = mg_ring_wait<DM, TMA>(wdone, ring, bars);
            if (phases & MEGA_PH_PROJ)
                mg_gemv_ring<B, 2, DM, MEGA_EPI_RESID>(Ws, DM, xs, x, nullptr, best);
            __syncthreads();
            mg_ring_issue<DM, TMA>(lp, wq + 1 + MEGA_RING, nw, ring, bars);
        } else if (phases & MEGA_PH_PROJ) {
            if (V4) mg_combine_v4<B, DM>(part, Sa, xs, reinterpret_cast<float*>(xs + B * DM));
            else if (V3) mg_combine<B, DM>(part, S, xs, reinterpret_cast<float*>(xs + B * DM));
            else mg_stage<B, DM>(a, xs);
            __syncthreads();
            mg_gemv<B, 2, DM, MEGA_EPI_RESID, 6, WQ>(Wproj, DM, xs, x, nullptr, best, Sproj);
        }
        if (!mg_barrier<V3>(sync, G)) return mg_drain<RING, TMA>(bars, wdone, nw);
        // 4. LN2 + fc + GELU
        if (RING) {
            if (phases & MEGA_PH_FC)
                mg_layernorm<B, DM>(x, nullptr, nullptr, g2, b2, eps, xs, nullptr);
            wdone = wq + 2;
            const __half* Ws = mg_ring_wait<DM, TMA>(wdone, ring, bars);
            if (phases & MEGA_PH_FC) {
                mg_gemv_ring<B, 4, DM, MEGA_EPI_GELU>(Ws, 4 * DM, xs, nullptr, f, best);
                if (layer + 1 == n_layer) {        // the LM head is not in the ring: L2
                    const unsigned long long hb = (unsigned long long)vocab * DM * 2;
                    mg_prefetch(head, hb < pf_cap ? hb : pf_cap);
                }
            }
            __syncthreads();
            mg_ring_issue<DM, TMA>(lp, wq + 2 + MEGA_RING, nw, ring, bars);
        } else if (phases & MEGA_PH_FC) {
            mg_layernorm<B, DM>(x, nullptr, nullptr, g2, b2, eps, xs, nullptr);
            __syncthreads();
            mg_gemv<B, 4, DM, MEGA_EPI_GELU, 6, WQ>(Wfc, 4 * DM, xs, nullptr, f, best, Sfc);
            if (PF) {
                if (layer + 1 < n_layer)
                    mg_prefetch(reinterpret_cast<const void*>(lp[(size_t)(layer + 1) * LPS + 4]),
                                (unsigned long long)3 * DM * DM * 2 / WDIV);
                else {
                    const unsigned long long hb = (unsigned long long)vocab * DM * 2 / WDIV;
                    mg_prefetch(head, hb < pf_cap ? hb : pf_cap);
                }
            }
        }
        if (!mg_barrier<V3>(sync, G)) return mg_drain<RING, TMA>(bars, wdone, nw);
        // 5. fc2, x += half(f W_fc2^T)
        if (RING) {
            if (phases & MEGA_PH_FC2) mg_stage<B, 4 * DM>(f, xs);
            wdone = wq + 3;
            const __half* Ws = mg_ring_wait<DM, TMA>(wdone, ring, bars);
            if (phases & MEGA_PH_FC2)
                mg_gemv_ring<B, 1, 4 * DM, MEGA_EPI_RESID, 12>(Ws, DM, xs, x, nullptr, best);
            __syncthreads();
            mg_ring_issue<DM, TMA>(lp, wq + 3 + MEGA_RING, nw, ring, bars);
        } else if (phases & MEGA_PH_FC2) {
            mg_stage<B, 4 * DM>(f, xs);
            __syncthreads();
            if (V3)                                // d rows, about one a warp: 1 a pass, and
                mg_gemv<B, 1, 4 * DM, MEGA_EPI_RESID, 12, WQ>(Wfc2, DM, xs, x, nullptr, best, Sfc2);
            else                                   // 12 loads a lane in flight (v2: 2, 6)
                mg_gemv<B, 2, 4 * DM, MEGA_EPI_RESID>(Wfc2, DM, xs, x, nullptr, best);
        }
        if (!mg_barrier<V3>(sync, G)) return mg_drain<RING, TMA>(bars, wdone, nw);
    }
    mg_drain<RING, TMA>(bars, wdone, nw);          // (nothing is left in flight here)
    if (!(phases & MEGA_PH_HEAD)) return;

    // final LN, LM head with a running argmax, the greedy token, pos + 1
    mg_layernorm<B, DM>(x, nullptr, nullptr, lnf_g, lnf_b, eps, xs, nullptr);
    __syncthreads();
    mg_gemv<B, NRH, DM, MEGA_EPI_HEAD, 6, WQ>(head, vocab, xs, nullptr, logits, best,
        WQ ? reinterpret_cast<const __half*>(lp[(size_t)n_layer * LPS]) : nullptr);
    const int lane = t & 31, warp = t >> 5;
    if (lane == 0) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
            wbv[warp][b] = best[b].v;
            wbi[warp][b] = best[b].i;
        }
    }
    __syncthreads();
    if (t < B) {                                   // this block's first largest logit of row t
        ArgMax m = {-INFINITY, 0x7fffffff};
        for (int w = 0; w < MEGA_WARPS; ++w)
            if (argmax_before(wbv[w][t], wbi[w][t], m.v, m.i)) m = ArgMax{wbv[w][t], wbi[w][t]};
        amax_v[(size_t)blockIdx.x * B + t] = m.v;
        amax_i[(size_t)blockIdx.x * B + t] = m.i;
    }
    __syncthreads();
    if (t == 0) {
        __threadfence();
        const unsigned prev = atomicAdd(sync + MEGA_TICKET, 1u);
        last = prev == G - 1;
        if (last) atomicExch(sync + MEGA_TICKET, 0u);
    }
    __syncthreads();
    if (last) {                                    // every block's argmax is in: the token
        __threadfence();
        if (t < B) {
            ArgMax m = {-INFINITY, 0x7fffffff};
            for (unsigned k = 0; k < G; ++k) {
                const float v = __ldcg(amax_v + (size_t)k * B + t);
                const int i = __ldcg(amax_i + (size_t)k * B + t);
                if (argmax_before(v, i, m.v, m.i)) m = ArgMax{v, i};
            }
            tok[t] = m.i;
            if (history != nullptr && p + 1 < hist_len) history[(size_t)t * hist_len + p + 1] = m.i;
        }
        if (t == 0) pos[0] = p + 1;
    }
}

#define MEGA_ARGS                                                                              \
    const unsigned long long *__restrict__ lp, const __half *__restrict__ wte,                  \
        const __half *__restrict__ head, const float *__restrict__ lnf_g,                      \
        const float *__restrict__ lnf_b, __half *kc, __half *vc, float *x, __half *q,          \
        __half *a, __half *f, float *part, unsigned *cnt, float *amax_v, int *amax_i,          \
        unsigned *sync, __half *logits, int *tok, int *pos, int *history, int hist_len,        \
        int n_layer, int L, int vocab, int S, float eps, float log2_base, float scale_log2,    \
        int phases, unsigned long long pf_cap
#define MEGA_PASS                                                                              \
    lp, wte, head, lnf_g, lnf_b, kc, vc, x, q, a, f, part, cnt, amax_v, amax_i, sync, logits,   \
        tok, pos, history, hist_len, n_layer, L, vocab, S, eps, log2_base, scale_log2, phases,  \
        pf_cap

#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v1)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v1(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, false, 2>(MEGA_PASS);
}
#endif

#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v2)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v2(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v3)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v3(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, true>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v4)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v4(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, 4>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v5)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v5(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, 5>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v6)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v6(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, 6>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v7)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v7(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, 7>(MEGA_PASS);
}
#endif
#if !defined(CB_ONLY) || defined(CB_ONLY_decode_mega_v8)
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) decode_mega_v8(MEGA_ARGS) {
    decode_mega_body<MEGA_B, MEGA_D, true, 4, 8>(MEGA_PASS);
}
#endif
#undef MEGA_PASS
#undef MEGA_ARGS
