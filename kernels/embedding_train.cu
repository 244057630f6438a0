// embedding_train.cu: the GPT's token + position embedding for training, forward and a
// deterministic backward (kernels/embedding.cu is the inference gather; this file is the
// training step's).
//
//   embedding_fwd_v1   x[b*T + t, :] = wte[tokens[b, t], :] + wpe[t, :]: a thread per float4 of
//                      x. An id outside [0, Vp) is never read from: its row of x is NaN.
//   embedding_bwd_v1   dwte[v, :] += sum of dx[p, :] over the positions p with tokens[p] == v, in
//                      increasing p: a block per (vocabulary row, 128 float4 columns) that scans
//                      every token, O(Vp * M) token reads. Slow, deterministic, obviously right.
//   embedding_bwd_v2   the same sums in the same order, from a stable counting sort of the
//                      positions by token: per-chunk counts and in-chunk ranks (no atomics),
//                      the counts scanned into each token's run, each position scattered to its
//                      fixed place, then a warp per (token, 128 columns) adds its run in order.
//                      Bit for bit equal to v1, with O(M * CHUNK + Vp * M / CHUNK) work.
//   embedding_bwd_wpe  dwpe[t, :] += sum over b = 0, 1, ..., B-1 of dx[b*T + t, :] (both
//                      backward versions): a thread per float4 of dwpe's first T rows.
//
// Shapes and layouts (row-major, contiguous, float32 16-byte aligned):
//   tokens (B, T) int32 or int64 (each kernel that reads them has an _i32 and an _i64 form);
//   wte, dwte (Vp, C); wpe, dwpe (Tmax, C) with T <= Tmax; x, dx (M, C) with M = B*T; C % 4 == 0.
// dwte and dwpe are ACCUMULATED (+=). An id outside [0, Vp) adds nothing to dwte (skipped);
// dwpe still gets its row of dx. A vocabulary row whose token does not occur is left untouched
// (not even += 0, so v1 and v2 write the same bits).
//
// Why no float atomics: atomicAdd into dwte[v] would add a token's positions in whatever order
// the warps arrive, so two runs of the same step would differ in the last bits. Here every sum
// runs in increasing position order, one thread per output element: run twice, same bits.
//
// Backward v2's int32 scratch (kernels/embedding_train_launch.py: scratch_layout), NCH =
// ceil(M / EMB_CHUNK) chunks of positions:
//   start (Vp + 1)    counts, then (scanned) where each token's run begins; start[Vp] = the
//                     number of valid positions
//   rank (M)          how many earlier positions of the same chunk hold the same token
//   order (M)         the positions sorted by token, stably (increasing p within a token)
//   table (NCH, Vp)   how often each token occurs in each chunk, then (scanned over the chunks)
//                     how many of its positions lie in earlier chunks
// Kernels of v2, in order: rank, offsets, scan, scatter, sum (+ embedding_bwd_wpe).
#include "common.cuh"

#define EMB_CHUNK 256     // positions per chunk of v2's sort = threads of its rank kernel
#define EMB_WARPS 8       // warps per block of v2's sum kernel (one token each)

// An id as a vocabulary row, or -1 outside [0, Vp) (compared in the id's own width: an int64 id
// of 2^32 must not wrap to 0)
template <typename Id>
__device__ __forceinline__ int valid_id(Id id, int Vp) {
    return (id >= 0 && id < (Id)Vp) ? (int)id : -1;
}

__device__ __forceinline__ void add4(float4& a, float4 b) {
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
}

// ============================================================================ forward
// launch: grid (ceil_div(M * C/4, 256)), block 256, no shared memory
template <typename Id>
__device__ __forceinline__ void fwd_v1(const Id* tokens, const float* wte, const float* wpe,
                                       float* x, int M, int T, int C, int Vp) {
    int C4 = C / 4;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // float4 i of x
    if (i >= (long long)M * C4) return;
    int m = (int)(i / C4), c4 = (int)(i % C4), t = m % T;
    int v = valid_id(tokens[m], Vp);
    float4* x4 = reinterpret_cast<float4*>(x);
    if (v < 0) {                                  // a bad id: a NaN row, nothing read
        x4[i] = make_float4(NAN, NAN, NAN, NAN);
        return;
    }
    float4 a = reinterpret_cast<const float4*>(wte)[(long long)v * C4 + c4];
    float4 p = reinterpret_cast<const float4*>(wpe)[(long long)t * C4 + c4];
    add4(a, p);
    x4[i] = a;
}

extern "C" __global__ void embedding_fwd_v1_i32(const int* tokens, const float* wte,
                                                const float* wpe, float* x, int M, int T, int C,
                                                int Vp) {
    fwd_v1(tokens, wte, wpe, x, M, T, C, Vp);
}

extern "C" __global__ void embedding_fwd_v1_i64(const long long* tokens, const float* wte,
                                                const float* wpe, float* x, int M, int T, int C,
                                                int Vp) {
    fwd_v1(tokens, wte, wpe, x, M, T, C, Vp);
}

// ============================================================================ backward: dwpe
// launch: grid (ceil_div(T * C/4, 256)), block 256, no shared memory
// dwpe[t] += dx[t] + dx[T + t] + ... + dx[(B-1) T + t], added in that order from 0
extern "C" __global__ void embedding_bwd_wpe(const float* dx, float* dwpe, int B, int T, int C) {
    int C4 = C / 4;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // float4 i of dwpe
    if (i >= (long long)T * C4) return;
    int t = (int)(i / C4), c4 = (int)(i % C4);
    const float4* d4 = reinterpret_cast<const float4*>(dx);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int b = 0; b < B; ++b) add4(acc, d4[((long long)b * T + t) * C4 + c4]);
    float4* w4 = reinterpret_cast<float4*>(dwpe);
    float4 w = w4[i];
    add4(w, acc);
    w4[i] = w;
}

// ============================================================================ backward v1: dwte
// launch: grid (Vp, ceil_div(C/4, 128)), block 128, no shared memory
// Block (v, y): thread c4 = 128 y + threadIdx.x reads every token (the same address across the
// warp: one broadcast load) and adds dx[p, c4] where tokens[p] == v, in increasing p.
template <typename Id>
__device__ __forceinline__ void bwd_v1(const Id* tokens, const float* dx, float* dwte, int M,
                                       int C) {
    int C4 = C / 4, v = blockIdx.x, c4 = blockIdx.y * blockDim.x + threadIdx.x;
    if (c4 >= C4) return;
    const float4* d4 = reinterpret_cast<const float4*>(dx);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    bool seen = false;
    for (int p = 0; p < M; ++p) {
        if (tokens[p] == (Id)v) {                 // a bad id equals no row: skipped
            add4(acc, d4[(long long)p * C4 + c4]);
            seen = true;
        }
    }
    if (!seen) return;                            // an absent token's row is left as it is
    float4* w4 = reinterpret_cast<float4*>(dwte) + (long long)v * C4 + c4;
    float4 w = *w4;
    add4(w, acc);
    *w4 = w;
}

extern "C" __global__ void embedding_bwd_v1_i32(const int* tokens, const float* dx, float* dwte,
                                                int M, int C) {
    bwd_v1(tokens, dx, dwte, M, C);
}

extern "C" __global__ void embedding_bwd_v1_i64(const long long* tokens, const float* dx,
                                                float* dwte, int M, int C) {
    bwd_v1(tokens, dx, dwte, M, C);
}

// ============================================================================ backward v2: sort
// 1. rank. launch: grid (NCH), block EMB_CHUNK, shared EMB_CHUNK ints (static)
// Block c zeroes its row of the table, then each of its positions p = c EMB_CHUNK + i counts the
// chunk's earlier positions with its token (rank[p]) and, at the token's first position in the
// chunk, writes the token's count in the chunk to table[c, v]: one writer per entry, no atomics.
template <typename Id>
__device__ __forceinline__ void bwd_v2_rank(const Id* tokens, int* rank, int* table, int M,
                                            int Vp) {
    __shared__ int ids[EMB_CHUNK];
    int c = blockIdx.x, i = threadIdx.x, p = c * EMB_CHUNK + i;
    int* row = table + (long long)c * Vp;
    for (int v = i; v < Vp; v += EMB_CHUNK) row[v] = 0;
    int v = p < M ? valid_id(tokens[p], Vp) : -1;
    ids[i] = v;                                   // -1 past M and for bad ids: matches no token
    __syncthreads();                              // ids complete, row zeroed (block-visible)
    if (v < 0) return;
    int before = 0, total = 0;
#pragma unroll 8
    for (int j = 0; j < EMB_CHUNK; ++j) {
        int e = ids[j] == v;                      // every thread reads ids[j]: a broadcast
        total += e;
        before += j < i ? e : 0;
    }
    rank[p] = before;
    if (before == 0) row[v] = total;
}

extern "C" __global__ void embedding_bwd_v2_rank_i32(const int* tokens, int* rank, int* table,
                                                     int M, int Vp) {
    bwd_v2_rank(tokens, rank, table, M, Vp);
}

extern "C" __global__ void embedding_bwd_v2_rank_i64(const long long* tokens, int* rank,
                                                     int* table, int M, int Vp) {
    bwd_v2_rank(tokens, rank, table, M, Vp);
}

// 2. offsets. launch: grid (ceil_div(Vp, 256)), block 256, no shared memory
// Thread v walks its column of the table down the chunks: table[c, v] becomes the number of v's
// positions in chunks before c (an exclusive scan), start[v] the count of v.
extern "C" __global__ void embedding_bwd_v2_offsets(int* table, int* start, int nch, int Vp) {
    int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= Vp) return;
    int run = 0;
    for (int c = 0; c < nch; ++c) {               // coalesced: neighbouring threads, neighbouring v
        long long k = (long long)c * Vp + v;
        int n = table[k];
        table[k] = run;
        run += n;
    }
    start[v] = run;
}

// 3. scan. launch: grid (1), block 1024, no dynamic shared memory
// start[0..Vp) in place from counts to their exclusive prefix sums (where each token's run
// begins in order), start[Vp] = the total. Thread i owns a contiguous segment of the counts; the
// 1024 segment sums are scanned with warp shuffles (integers: exact in any order).
extern "C" __global__ void embedding_bwd_v2_scan(int* start, int Vp) {
    __shared__ int warp_off[32];
    int per = ceil_div(Vp, blockDim.x);
    int lo = min(Vp, (int)threadIdx.x * per), hi = min(Vp, lo + per);
    int sum = 0;
    for (int v = lo; v < hi; ++v) sum += start[v];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = sum;                               // inclusive scan over the warp's lanes
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_off[warp] = incl;        // the warp's total
    __syncthreads();
    if (warp == 0) {                              // the warps' totals -> exclusive offsets
        int w = lane < nw ? warp_off[lane] : 0, wi = w;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += y;
        }
        warp_off[lane] = wi - w;
    }
    __syncthreads();
    int run = warp_off[warp] + incl - sum;        // what comes before this thread's segment
    for (int v = lo; v < hi; ++v) {
        int n = start[v];
        start[v] = run;
        run += n;
    }
    if (threadIdx.x == blockDim.x - 1) start[Vp] = run;   // empty segments past Vp: the total
}

// 4. scatter. launch: grid (ceil_div(M, 256)), block 256, no shared memory
// Position p with token v goes to order[start[v] + table[p / EMB_CHUNK, v] + rank[p]]: the
// positions of v before p are exactly those of earlier chunks plus those earlier in p's chunk,
// so every token's run is in increasing p (a stable sort), each slot written once.
template <typename Id>
__device__ __forceinline__ void bwd_v2_scatter(const Id* tokens, const int* rank,
                                               const int* table, const int* start, int* order,
                                               int M, int Vp) {
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= M) return;
    int v = valid_id(tokens[p], Vp);
    if (v < 0) return;                            // a bad id has no slot
    order[start[v] + table[(long long)(p / EMB_CHUNK) * Vp + v] + rank[p]] = p;
}

extern "C" __global__ void embedding_bwd_v2_scatter_i32(const int* tokens, const int* rank,
                                                        const int* table, const int* start,
                                                        int* order, int M, int Vp) {
    bwd_v2_scatter(tokens, rank, table, start, order, M, Vp);
}

extern "C" __global__ void embedding_bwd_v2_scatter_i64(const long long* tokens, const int* rank,
                                                        const int* table, const int* start,
                                                        int* order, int M, int Vp) {
    bwd_v2_scatter(tokens, rank, table, start, order, M, Vp);
}

// 5. sum. launch: grid (ceil_div(Vp, EMB_WARPS), ceil_div(C/4, 32)), block 32 EMB_WARPS, no
// shared memory
// Warp w of block (bx, y) takes token v = EMB_WARPS bx + w and columns c4 = 32 y + lane: 32
// positions of v's run are read at once (one coalesced load), broadcast one by one with a
// shuffle, and 8 rows of dx are loaded before they are added, in run order (= increasing p, as
// v1). A token with n positions is n dependent adds per lane: the most frequent token is the
// longest warp.
extern "C" __global__ void embedding_bwd_v2_sum(const float* dx, const int* start,
                                                const int* order, float* dwte, int Vp, int C) {
    int lane = threadIdx.x & 31, v = blockIdx.x * EMB_WARPS + (threadIdx.x >> 5);
    if (v >= Vp) return;                          // whole warps: the shuffles stay full
    int lo = start[v], hi = start[v + 1];
    if (lo == hi) return;                         // an absent token's row is left as it is
    int C4 = C / 4, c4 = blockIdx.y * 32 + lane;
    bool mine = c4 < C4;                          // lanes past the row shuffle but load nothing
    const float4* d4 = reinterpret_cast<const float4*>(dx);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = lo; base < hi; base += 32) {
        int n = min(32, hi - base);
        int mypos = lane < n ? order[base + lane] : 0;
        for (int j0 = 0; j0 < n; j0 += 8) {
            float4 r[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                int p = __shfl_sync(0xffffffffu, mypos, j0 + k);       // j0 + k <= 31
                r[k] = mine && j0 + k < n ? d4[(long long)p * C4 + c4]
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (mine && j0 + k < n) add4(acc, r[k]);
        }
    }
    if (!mine) return;
    float4* w4 = reinterpret_cast<float4*>(dwte) + (long long)v * C4 + c4;
    float4 w = *w4;
    add4(w, acc);
    *w4 = w;
}
