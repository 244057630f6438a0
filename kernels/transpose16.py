"""Numba twins of kernels/transpose16.cu: out (cols, rows) = a (rows, cols) transposed, for
16-bit elements held as uint16 bit patterns (NumPy has no bfloat16, and a transpose only moves
bits: pass a bf16 tensor as ``t.view(torch.int16).numpy().view(np.uint16)``). Exact, like the
CUDA kernels.

versions
  transpose16_v1      the same algorithm as transpose16_v1: a 32 x 32 tile padded to 32 x 34,
                      block (32, 8)
  transpose16_tile64  transpose16_v2's tile and thread map (64 x 64 tile held as 32-bit pairs,
                      33 words per row; loads by 8-column chunks, two output rows per thread,
                      the halves unpacked with shifts where v2 uses __byte_perm), element by
                      element: Numba has no 16-byte vectors. Block (256,)
Both launch with a 1D grid over the tiles: ceil_div(rows, T) * ceil_div(cols, T), T the tile.
"""

from numba import cuda, uint16, uint32

TILE = 32
ROWS = 8
TILE_PAD = TILE + 2     # a global int is a compile-time constant for Numba (shared.array)
T2 = 64
WORDS = 33


@cuda.jit
def transpose16_v1(a, out):
    tile = cuda.shared.array((TILE, TILE_PAD), uint16)
    rows, cols = a.shape
    tiles_c = (cols + TILE - 1) // TILE
    b = cuda.blockIdx.x
    by, bx = (b // tiles_c) * TILE, (b % tiles_c) * TILE
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    for j in range(0, TILE, ROWS):
        r, c = by + ty + j, bx + tx
        if r < rows and c < cols:
            tile[ty + j, tx] = a[r, c]
    cuda.syncthreads()                      # every element of the tile is loaded
    for j in range(0, TILE, ROWS):
        c, r = bx + ty + j, by + tx         # swapped roles: the warp writes along out's row
        if c < cols and r < rows:
            out[c, r] = tile[tx, ty + j]


@cuda.jit
def transpose16_tile64(a, out):
    tile = cuda.shared.array((T2, WORDS), uint32)
    rows, cols = a.shape
    tiles_c = (cols + T2 - 1) // T2
    b = cuda.blockIdx.x
    r0, c0 = (b // tiles_c) * T2, (b % tiles_c) * T2
    t = cuda.threadIdx.x
    k = t & 7                               # chunk: input columns c0 + 8k .. c0 + 8k + 7
    for i in range(t >> 3, T2, 32):         # tile rows t / 8 and t / 8 + 32
        r = r0 + i
        for q in range(4):                  # word 4k + q: columns c0 + 8k + 2q (low), + 1 (high)
            c = c0 + 8 * k + 2 * q
            lo = uint32(a[r, c]) if r < rows and c < cols else uint32(0)
            hi = uint32(a[r, c + 1]) if r < rows and c + 1 < cols else uint32(0)
            tile[i, 4 * k + q] = lo | (hi << uint32(16))
    cuda.syncthreads()                      # every word of the tile is written
    lane, w = t & 31, t >> 5
    ch = (lane >> 3) + 4 * (w & 1)          # output columns r0 + 8ch .. r0 + 8ch + 7
    p = (lane & 7) + 8 * (w >> 1)           # output rows c0 + 2p (low halves), c0 + 2p + 1 (high)
    r = r0 + 8 * ch
    for e in range(2):
        c = c0 + 2 * p + e
        if c < cols and r < rows:
            for q in range(8):
                if r + q < rows:
                    out[c, r + q] = (tile[8 * ch + q, p] >> uint32(16 * e)) & uint32(0xFFFF)
