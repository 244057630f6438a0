"""Numba twins of kernels/matmul.cu: C[M, N] = A[M, K] @ B[K, N], float32 (Chapter 4).

Row-major, contiguous, any M, N, K >= 1. Launch them with ``launch_numba`` of
kernels/matmul_launch.py (it checks the operands and computes the grid).

kernels (a twin that is a different algorithm from the CUDA C++ version of the same rung has
its own name)
  matmul_v1                naive, the grid's x index walks rows (uncoalesced), as CUDA v1
  matmul_v2                naive, the grid's x index walks columns (coalesced), as CUDA v2
  matmul_smem16            shared-memory tiles of 16 x 16 (CUDA v3 uses 32 x 32)
  matmul_reg8x8            2D register tiling: 128 x 128 block tile, BK = 8, 8 x 8 outputs per
                           thread, A transposed and padded in shared memory, 4x4 pieces spaced so
                           a warp's shared reads are conflict-free (CUDA v5 + v7, without float4)
  matmul_reg8x8_prefetch   what Numba can add to it: the loop over the tile's k written out (an
                           inlined device function called with a literal k, so shared addresses
                           fold to constants), the next tiles' global loads issued into registers
                           before this tile's FMAs, branch-free (clamped addresses), BK = 16
  matmul_reg8x8_unsigned   reg8x8_prefetch with unsigned run-time indices (no negative-index
                           wraparound, so ptxas merges the shared reads into 128-bit LDS.128)
                           and plain loads for blocks wholly inside A and B
Numba has no float4 type to load through, no inline PTX (cp.async) and no launch bounds, so it
stops here.
"""

from numba import cuda, float32, uint64

# Shapes are module-level ints: Numba needs compile-time constants for shared.array and
# local.array shapes, and an expression inside a kernel is not one.
SMEM16_TILE = 16                           # matmul_smem16
REG_BM, REG_BN, REG_BK = 128, 128, 8       # matmul_reg8x8: block tile and k-step
REG_TM, REG_TN = 8, 8                      # outputs per thread
REG_THREADS = (REG_BM // REG_TM) * (REG_BN // REG_TN)     # 256
REG_PAD = 4
REG_BM_PADDED = REG_BM + REG_PAD           # padded row of the transposed A tile
PREFETCH_BK = 16                           # matmul_reg8x8_prefetch: half the barriers per FMA
PREFETCH_A_LOADS = REG_BM * PREFETCH_BK // REG_THREADS   # A-tile elements per thread (8)
PREFETCH_B_LOADS = PREFETCH_BK * REG_BN // REG_THREADS   # B-tile elements per thread (8)


@cuda.jit
def matmul_v1(A, B, C):
    # launch: [(ceil(M/16), ceil(N/16)), (16, 16)]; x walks rows -> neighbours 4K bytes apart
    row, col = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        acc = float32(0.0)
        for k in range(A.shape[1]):
            acc += A[row, k] * B[k, col]
        C[row, col] = acc


@cuda.jit
def matmul_v2(A, B, C):
    # launch: [(ceil(N/16), ceil(M/16)), (16, 16)]; x walks columns -> coalesced B and C
    col, row = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        acc = float32(0.0)
        for k in range(A.shape[1]):
            acc += A[row, k] * B[k, col]
        C[row, col] = acc


@cuda.jit
def matmul_smem16(A, B, C):
    # launch: [(ceil(N/16), ceil(M/16)), (16, 16)]; 2 x 16 x 16 x 4 = 2 KiB shared
    As = cuda.shared.array((SMEM16_TILE, SMEM16_TILE), float32)
    Bs = cuda.shared.array((SMEM16_TILE, SMEM16_TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = B.shape[1]
    row = cuda.blockIdx.y * SMEM16_TILE + ty
    col = cuda.blockIdx.x * SMEM16_TILE + tx
    acc = float32(0.0)
    for k0 in range(0, K, SMEM16_TILE):
        # load one element of each tile per thread, zero past the edges
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else float32(0.0)
        cuda.syncthreads()                       # the tiles are complete
        for k in range(SMEM16_TILE):
            acc += As[ty, k] * Bs[k, tx]
        cuda.syncthreads()                       # everyone is done before they are refilled
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def matmul_reg8x8(A, B, C):
    # launch: [(ceil(N/128), ceil(M/128)), 256]; shared (8 x 132 + 8 x 128) x 4 = 8.1 KiB
    As = cuda.shared.array((REG_BK, REG_BM_PADDED), float32)          # transposed: As[k, m]
    Bs = cuda.shared.array((REG_BK, REG_BN), float32)
    acc = cuda.local.array((REG_TM, REG_TN), float32)            # registers once unrolled
    ra = cuda.local.array(REG_TM, float32)
    rb = cuda.local.array(REG_TN, float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * REG_BM
    n0 = cuda.blockIdx.x * REG_BN
    tr = tid // (REG_BN // REG_TN)
    tc = tid % (REG_BN // REG_TN)
    for i in range(REG_TM):
        for j in range(REG_TN):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, REG_BK):
        for l in range(REG_BM * REG_BK // REG_THREADS):           # 4 elements of A per thread
            idx = tid + l * REG_THREADS
            r = idx // REG_BK
            c = idx % REG_BK
            As[c, r] = A[m0 + r, k0 + c] if m0 + r < M and k0 + c < K else float32(0.0)
        for l in range(REG_BK * REG_BN // REG_THREADS):           # 4 elements of B per thread
            idx = tid + l * REG_THREADS
            r = idx // REG_BN
            c = idx % REG_BN
            Bs[r, c] = B[k0 + r, n0 + c] if k0 + r < K and n0 + c < N else float32(0.0)
        cuda.syncthreads()
        for k in range(REG_BK):
            for i in range(4):                                 # rows tr*4.. and 64 + tr*4..
                ra[i] = As[k, tr * 4 + i]
                ra[4 + i] = As[k, REG_BM // 2 + tr * 4 + i]
                rb[i] = Bs[k, tc * 4 + i]
                rb[4 + i] = Bs[k, REG_BN // 2 + tc * 4 + i]
            for i in range(REG_TM):
                for j in range(REG_TN):
                    acc[i, j] += ra[i] * rb[j]
        cuda.syncthreads()
    for i in range(REG_TM):
        r = m0 + (i // 4) * (REG_BM // 2) + tr * 4 + i % 4
        for j in range(REG_TN):
            c = n0 + (j // 4) * (REG_BN // 2) + tc * 4 + j % 4
            if r < M and c < N:
                C[r, c] = acc[i, j]


@cuda.jit(device=True, inline="always")
def _outer_product_step(As, Bs, acc, ra, rb, k, ar, bc):
    # one k of the 8 x 8 outer product; k is a literal at each call site, so once this is
    # inlined the shared-memory addresses are constants plus ar / bc
    for i in range(4):
        ra[i] = As[k, ar + i]
        ra[4 + i] = As[k, REG_BM // 2 + ar + i]
        rb[i] = Bs[k, bc + i]
        rb[4 + i] = Bs[k, REG_BN // 2 + bc + i]
    for i in range(REG_TM):
        for j in range(REG_TN):
            acc[i, j] += ra[i] * rb[j]

@cuda.jit(device=True, inline="always")
def _fetch_next_tiles(A, B, va, vb, tid, m0, n0, k0, M, N, K):
    # this thread's 8 elements of the next A tile and 8 of the next B tile, into registers. The
    # addresses are clamped into the matrices, so every load is unconditional and all eight can be
    # in flight at once; elements past an edge are zeroed afterwards (a branch around each load
    # would make each wait for the one before).
    for l in range(PREFETCH_A_LOADS):
        idx = tid + l * REG_THREADS
        r, c = m0 + idx // PREFETCH_BK, k0 + idx % PREFETCH_BK
        v = A[min(r, M - 1), min(c, K - 1)]
        va[l] = v if r < M and c < K else float32(0.0)
    for l in range(PREFETCH_B_LOADS):
        idx = tid + l * REG_THREADS
        r, c = k0 + idx // REG_BN, n0 + idx % REG_BN
        v = B[min(r, K - 1), min(c, N - 1)]
        vb[l] = v if r < K and c < N else float32(0.0)


@cuda.jit
def matmul_reg8x8_prefetch(A, B, C):
    # launch: as matmul_reg8x8; shared (16 x 132 + 16 x 128) x 4 = 16.3 KiB. Three changes: the
    # k loop is written out (_outer_product_step with a literal k), the next tiles' global loads
    # are issued before the FMAs of this tile (into registers), so their latency hides behind
    # 1024 FMAs, and BK = 16 halves the barriers per FMA.
    As = cuda.shared.array((PREFETCH_BK, REG_BM_PADDED), float32)
    Bs = cuda.shared.array((PREFETCH_BK, REG_BN), float32)
    acc = cuda.local.array((REG_TM, REG_TN), float32)
    ra = cuda.local.array(REG_TM, float32)
    rb = cuda.local.array(REG_TN, float32)
    va = cuda.local.array(PREFETCH_A_LOADS, float32)
    vb = cuda.local.array(PREFETCH_B_LOADS, float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * REG_BM
    n0 = cuda.blockIdx.x * REG_BN
    tr = tid // (REG_BN // REG_TN)
    tc = tid % (REG_BN // REG_TN)
    ar, bc = tr * 4, tc * 4
    for i in range(REG_TM):
        for j in range(REG_TN):
            acc[i, j] = float32(0.0)
    _fetch_next_tiles(A, B, va, vb, tid, m0, n0, 0, M, N, K)
    for k0 in range(0, K, PREFETCH_BK):
        for l in range(PREFETCH_A_LOADS):          # registers -> shared memory
            idx = tid + l * REG_THREADS
            As[idx % PREFETCH_BK, idx // PREFETCH_BK] = va[l]
        for l in range(PREFETCH_B_LOADS):
            idx = tid + l * REG_THREADS
            Bs[idx // REG_BN, idx % REG_BN] = vb[l]
        cuda.syncthreads()
        # the next tiles, in flight from now on
        _fetch_next_tiles(A, B, va, vb, tid, m0, n0, k0 + PREFETCH_BK, M, N, K)
        # a `for k in range(PREFETCH_BK)` loop stays rolled in Numba, recomputing 64-bit addresses
        # of every shared read at each k (see the lesson's PTX count); written out, k is a literal
        _outer_product_step(As, Bs, acc, ra, rb, 0, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 1, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 2, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 3, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 4, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 5, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 6, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 7, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 8, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 9, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 10, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 11, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 12, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 13, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 14, ar, bc)
        _outer_product_step(As, Bs, acc, ra, rb, 15, ar, bc)
        cuda.syncthreads()
    for i in range(REG_TM):
        r = m0 + (i // 4) * (REG_BM // 2) + tr * 4 + i % 4
        for j in range(REG_TN):
            c = n0 + (j // 4) * (REG_BN // 2) + tc * 4 + j % 4
            if r < M and c < N:
                C[r, c] = acc[i, j]


# ------------------------------------------------------------------------ matmul_reg8x8_unsigned
# The same tiles as matmul_reg8x8_prefetch, with the instructions around the FMAs cut:
#   - every run-time index is unsigned (uint64(...)): Numba wraps a negative signed index
#     around (i < 0 -> i + size, a compare and a select per index) and an unsigned one cannot
#     be negative, so the shared-memory addresses become base + constant, and ptxas (PTX to
#     SASS) merges the four neighbouring 32-bit shared loads of a 4x4 piece into one LDS.128;
#   - a block whose tiles lie wholly inside A and B loads them without clamps or tests
#     (the test is uniform per block and tile); edge blocks keep the clamped path.


@cuda.jit(device=True, inline="always")
def _outer_product_step_u(As, Bs, acc, ra, rb, k, ar, bc):
    # ar, bc: unsigned; k: a literal. uint64(x + i) keeps each index unsigned
    for i in range(4):
        ra[i] = As[k, uint64(ar + i)]
        ra[4 + i] = As[k, uint64(ar + (REG_BM // 2 + i))]
        rb[i] = Bs[k, uint64(bc + i)]
        rb[4 + i] = Bs[k, uint64(bc + (REG_BN // 2 + i))]
    for i in range(REG_TM):
        for j in range(REG_TN):
            acc[i, j] += ra[i] * rb[j]


@cuda.jit(device=True, inline="always")
def _fetch_tiles_u(A, B, va, vb, tid, m0, n0, k0, M, N, K):
    if m0 + REG_BM <= M and n0 + REG_BN <= N and k0 + PREFETCH_BK <= K:
        for l in range(PREFETCH_A_LOADS):           # inside: plain loads
            idx = tid + l * REG_THREADS
            va[l] = A[uint64(m0 + idx // PREFETCH_BK), uint64(k0 + idx % PREFETCH_BK)]
        for l in range(PREFETCH_B_LOADS):
            idx = tid + l * REG_THREADS
            vb[l] = B[uint64(k0 + idx // REG_BN), uint64(n0 + idx % REG_BN)]
    else:
        _fetch_next_tiles(A, B, va, vb, tid, m0, n0, k0, M, N, K)


@cuda.jit
def matmul_reg8x8_unsigned(A, B, C):
    # launch: as matmul_reg8x8; shared (16 x 132 + 16 x 128) x 4 = 16.3 KiB
    As = cuda.shared.array((PREFETCH_BK, REG_BM_PADDED), float32)
    Bs = cuda.shared.array((PREFETCH_BK, REG_BN), float32)
    acc = cuda.local.array((REG_TM, REG_TN), float32)
    ra = cuda.local.array(REG_TM, float32)
    rb = cuda.local.array(REG_TN, float32)
    va = cuda.local.array(PREFETCH_A_LOADS, float32)
    vb = cuda.local.array(PREFETCH_B_LOADS, float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * REG_BM
    n0 = cuda.blockIdx.x * REG_BN
    tr = tid // (REG_BN // REG_TN)
    tc = tid % (REG_BN // REG_TN)
    ar, bc = uint64(tr * 4), uint64(tc * 4)
    for i in range(REG_TM):
        for j in range(REG_TN):
            acc[i, j] = float32(0.0)
    _fetch_tiles_u(A, B, va, vb, tid, m0, n0, 0, M, N, K)
    for k0 in range(0, K, PREFETCH_BK):
        for l in range(PREFETCH_A_LOADS):          # registers -> shared memory
            idx = tid + l * REG_THREADS
            As[idx % PREFETCH_BK, idx // PREFETCH_BK] = va[l]
        for l in range(PREFETCH_B_LOADS):
            idx = tid + l * REG_THREADS
            Bs[idx // REG_BN, idx % REG_BN] = vb[l]
        cuda.syncthreads()
        _fetch_tiles_u(A, B, va, vb, tid, m0, n0, k0 + PREFETCH_BK, M, N, K)
        _outer_product_step_u(As, Bs, acc, ra, rb, 0, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 1, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 2, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 3, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 4, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 5, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 6, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 7, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 8, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 9, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 10, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 11, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 12, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 13, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 14, ar, bc)
        _outer_product_step_u(As, Bs, acc, ra, rb, 15, ar, bc)
        cuda.syncthreads()
    for i in range(REG_TM):
        r = m0 + (i // 4) * (REG_BM // 2) + tr * 4 + i % 4
        for j in range(REG_TN):
            c = n0 + (j // 4) * (REG_BN // 2) + tc * 4 + j % 4
            if r < M and c < N:
                C[r, c] = acc[i, j]
