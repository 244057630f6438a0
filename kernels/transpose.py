"""Numba twins of kernels/transpose.cu: out = in^T, in of shape (rows, cols) (Chapter 2).

versions
  transpose_v1  naive: coalesced reads, writes strided by `rows`
  transpose_v2  32 x 32 shared-memory tile: coalesced both ways, 32-way bank conflicts
  transpose_v3  tile padded to 32 x 33: conflict-free
All launch with block (32, 8) and grid (ceil_div(cols, 32), ceil_div(rows, 32)).
transpose_v4 and transpose_v5 of transpose.cu (more loads in flight) have no Numba twins.
"""

from numba import cuda, float32

TILE = 32
ROWS = 8
TILE_PAD = TILE + 1     # a global int is a compile-time constant for Numba; an expression
#                         such as TILE + 1 inside the kernel is not, and shared.array needs one


@cuda.jit
def transpose_v1(a, out):
    rows, cols = a.shape
    c = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    r0 = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    for j in range(0, TILE, ROWS):
        r = r0 + j
        if r < rows and c < cols:
            out[c, r] = a[r, c]


@cuda.jit
def transpose_v2(a, out):
    tile = cuda.shared.array((TILE, TILE), float32)
    rows, cols = a.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    bx, by = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
    for j in range(0, TILE, ROWS):
        r, c = by + ty + j, bx + tx
        if r < rows and c < cols:
            tile[ty + j, tx] = a[r, c]
    cuda.syncthreads()                      # every element of the tile is loaded
    for j in range(0, TILE, ROWS):
        c, r = bx + ty + j, by + tx         # swapped roles: the warp writes along out's row
        if c < cols and r < rows:
            out[c, r] = tile[tx, ty + j]    # a tile column: 32 lanes, one bank


@cuda.jit
def transpose_v3(a, out):
    tile = cuda.shared.array((TILE, TILE_PAD), float32)   # one padding column
    rows, cols = a.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    bx, by = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
    for j in range(0, TILE, ROWS):
        r, c = by + ty + j, bx + tx
        if r < rows and c < cols:
            tile[ty + j, tx] = a[r, c]
    cuda.syncthreads()
    for j in range(0, TILE, ROWS):
        c, r = bx + ty + j, by + tx
        if c < cols and r < rows:
            out[c, r] = tile[tx, ty + j]    # bank (tx + ty + j) % 32: all different
