"""Numba twins of kernels/embedding_train.cu: the token + position embedding of training, its
forward and its deterministic backward. Same algorithms and the same order of every float32 sum
(so the twins of v1 and v2 agree bit for bit, as the CUDA kernels do), one scalar per thread
where the CUDA kernels move a float4 (Numba has no float4). They run on the CUDA simulator too,
which is where CI checks the counting sort without a GPU.

Layouts as in embedding_train.cu: tokens (M,) int32 or int64 (the (B, T) array flattened); wte,
dwte (Vp, C); wpe, dwpe (Tmax, C); x, dx (M, C), float32. An id outside [0, Vp) gives a NaN row
of x and adds nothing to dwte.

Numba
  embedding_fwd          a thread per element of x (embedding_fwd_v1's indexing)
  embedding_bwd_wpe      a thread per element of dwpe's first T rows: dx summed over b in order
  embedding_bwd_v1       block (v, y), 32 threads: column c = 32 y + tx of token v, every token
                         read, dx added in increasing position
  embedding_bwd_v2_rank, _offsets, _scan, _scatter, _sum
                         the stable counting sort and the per-token sums of embedding_bwd_v2;
                         the scan runs SCAN_THREADS threads (the CUDA kernel 1024) with the
                         segment totals scanned by thread 0 (integers: the same result), the sum
                         a thread per (token, column) instead of a warp per (token, 32 float4s)
"""

from __future__ import annotations

from numba import cuda, float32, int32

CHUNK = 256          # EMB_CHUNK: positions per chunk = threads of the rank kernel
SCAN_THREADS = 32    # threads of the twin's one-block scan


@cuda.jit
def embedding_fwd(tokens, wte, wpe, x, T):
    # launch: [ceil_div(M * C, 64), 64]
    i = cuda.grid(1)
    M, C = x.shape
    Vp = wte.shape[0]
    if i >= M * C:
        return
    m, c = i // C, i % C
    v = tokens[m]
    if v < 0 or v >= Vp:
        x[m, c] = float32(float("nan"))
        return
    x[m, c] = wte[v, c] + wpe[m % T, c]


@cuda.jit
def embedding_bwd_wpe(dx, dwpe, B, T):
    # launch: [ceil_div(T * C, 64), 64]
    i = cuda.grid(1)
    C = dx.shape[1]
    if i >= T * C:
        return
    t, c = i // C, i % C
    acc = float32(0.0)
    for b in range(B):
        acc += dx[b * T + t, c]
    dwpe[t, c] += acc


@cuda.jit
def embedding_bwd_v1(tokens, dx, dwte):
    # launch: [(Vp, ceil_div(C, 32)), 32]
    v = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    M, C = dx.shape
    if c >= C:
        return
    acc = float32(0.0)
    seen = False
    for p in range(M):
        if tokens[p] == v:                   # a bad id equals no row: skipped
            acc += dx[p, c]
            seen = True
    if seen:                                 # an absent token's row is left as it is
        dwte[v, c] += acc


@cuda.jit
def embedding_bwd_v2_rank(tokens, rank, table, Vp):
    # launch: [NCH, CHUNK]; table (NCH, Vp)
    ids = cuda.shared.array(CHUNK, int32)
    c, i = cuda.blockIdx.x, cuda.threadIdx.x
    p = c * CHUNK + i
    M = tokens.shape[0]
    for v in range(i, Vp, CHUNK):
        table[c, v] = 0
    v = -1
    if p < M and tokens[p] >= 0 and tokens[p] < Vp:
        v = tokens[p]
    ids[i] = v                               # -1 past M and for bad ids: matches no token
    cuda.syncthreads()
    if v < 0:
        return
    before = 0
    total = 0
    for j in range(CHUNK):
        if ids[j] == v:
            total += 1
            if j < i:
                before += 1
    rank[p] = before
    if before == 0:
        table[c, v] = total


@cuda.jit
def embedding_bwd_v2_offsets(table, start):
    # launch: [ceil_div(Vp, 64), 64]; start (Vp + 1,)
    v = cuda.grid(1)
    nch, Vp = table.shape
    if v >= Vp:
        return
    run = 0
    for c in range(nch):
        n = table[c, v]
        table[c, v] = run
        run += n
    start[v] = run


@cuda.jit
def embedding_bwd_v2_scan(start):
    # launch: [1, SCAN_THREADS]; start (Vp + 1,): counts -> where each run begins, start[Vp] total
    seg = cuda.shared.array(SCAN_THREADS, int32)
    tx, nt = cuda.threadIdx.x, cuda.blockDim.x
    Vp = start.shape[0] - 1
    per = (Vp + nt - 1) // nt
    lo = min(Vp, tx * per)
    hi = min(Vp, lo + per)
    s = 0
    for v in range(lo, hi):
        s += start[v]
    seg[tx] = s
    cuda.syncthreads()
    if tx == 0:                              # the segment totals -> exclusive offsets
        run = 0
        for k in range(nt):
            n = seg[k]
            seg[k] = run
            run += n
        start[Vp] = run
    cuda.syncthreads()
    run = seg[tx]
    for v in range(lo, hi):
        n = start[v]
        start[v] = run
        run += n


@cuda.jit
def embedding_bwd_v2_scatter(tokens, rank, table, start, order):
    # launch: [ceil_div(M, 64), 64]
    p = cuda.grid(1)
    M = tokens.shape[0]
    Vp = table.shape[1]
    if p >= M:
        return
    v = tokens[p]
    if v < 0 or v >= Vp:                     # a bad id has no slot
        return
    order[start[v] + table[p // CHUNK, v] + rank[p]] = p


@cuda.jit
def embedding_bwd_v2_sum(dx, start, order, dwte):
    # launch: [(Vp, ceil_div(C, 32)), 32]
    v = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    C = dx.shape[1]
    lo, hi = start[v], start[v + 1]
    if c >= C or lo == hi:
        return
    acc = float32(0.0)
    for k in range(lo, hi):
        acc += dx[order[k], c]
    dwte[v, c] += acc
