// transpose16.cu: out = in^T for a row-major matrix of 16-bit elements (bfloat16 or float16,
// moved as raw 16-bit patterns: an exact copy), in of shape (rows, cols), out of shape
// (cols, rows): out[c * rows + r] = in[r * cols + c]. The last step of Chapter 2's fp32 ladder
// (transpose.cu: padded tiles, more bytes in flight per thread) for 16-bit elements. The GPT
// training step needs it where it runs on chapter 8's hgemm, which computes C = A @ B^T only (a
// weight gradient dW = dY^T X then takes dY^T and X^T as its row-major operands; on Hopper the
// step's gemm_train reads them in place instead).
//
// versions, simplest first
//   transpose16_v1  a 32 x 32 tile through shared memory, padded to 32 x 34 elements: a tile
//                   row is 17 words (4-byte banks), an odd number, so the 32 lanes reading a
//                   tile column meet 32 different banks; one element per load and store
//   transpose16_v2  a 64 x 64 tile, 16-byte loads and stores (8 elements): the tile is held as
//                   32-bit pairs (64 x 33 words, one pad word per row), each thread writes two
//                   output rows, packing their halves with __byte_perm. The vector path is taken
//                   where the rows allow it (cols, resp. rows, a multiple of 8 and the pointer
//                   16-byte aligned, decided in the kernel); ragged edges and other shapes go
//                   element by element through the same tile
//
// traffic: 2 bytes read + 2 written per element, like a copy. Indices are 64-bit (rows * cols
// may pass 2^31); both grids are 1D over the tiles (tile row-major: blockIdx.x / tiles per row
// is the tile row), so neither dimension meets the grid's 65535 limit.
#include "common.cuh"

#define T16_TILE 32      // transpose16_v1: tile edge (one warp per tile row)
#define T16_ROWS 8       // transpose16_v1: threads per block in y (TILE / ROWS = 4 rows each)
#define T16_V2_TILE 64   // transpose16_v2: tile edge
#define T16_V2_WORDS 33  // transpose16_v2: 32-bit words per tile row (32 pairs + 1 pad)

// launch: block = (32, 8), grid = (ceil_div(rows, 32) * ceil_div(cols, 32)),
//         static shared memory 32 x 34 x 2 = 2176 bytes
// Thread (tx, ty) loads elements (ty + 8 j, tx) of the tile, j = 0..3 (a warp reads 64
// contiguous bytes of a row), then writes out row c = bx + ty + 8 j at column by + tx from tile
// column ty + 8 j: element (i, j) sits in 4-byte word 17 i + j / 2, bank (17 i + j / 2) % 32,
// distinct for the 32 lanes i = 0..31 since 17 is odd. (A pad of one element, 33, would put a
// row at 16.5 words and lanes 0 and 31 in one bank for odd j.)
extern "C" __global__ void transpose16_v1(const unsigned short* __restrict__ in,
                                          unsigned short* __restrict__ out, long long rows,
                                          long long cols) {
    __shared__ unsigned short tile[T16_TILE][T16_TILE + 2];
    const long long b = blockIdx.x, tiles_c = (cols + T16_TILE - 1) / T16_TILE;
    const long long by = (b / tiles_c) * T16_TILE, bx = (b % tiles_c) * T16_TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int j = 0; j < T16_TILE; j += T16_ROWS) {
        long long r = by + ty + j, c = bx + tx;
        if (r < rows && c < cols) tile[ty + j][tx] = in[r * cols + c];
    }
    __syncthreads();                          // every element of the tile is loaded
    for (int j = 0; j < T16_TILE; j += T16_ROWS) {
        long long c = bx + ty + j, r = by + tx;                 // swapped roles
        if (c < cols && r < rows) out[c * rows + r] = tile[tx][ty + j];
    }
}

// launch: block = (256,), grid = (ceil_div(rows, 64) * ceil_div(cols, 64)),
//         static shared memory 64 x 33 x 4 = 8448 bytes
// Load: thread t moves chunk k = t % 8 (input columns c0 + 8k .. c0 + 8k + 7) of tile rows
// t / 8 and t / 8 + 32: a warp reads 4 rows x 128 contiguous bytes, and stores 4 words per
// thread into the tile at word 33 i + 4k + q, bank (i + 4k + q) % 32: the warp's 4 rows i and 8
// chunks k cover the 32 banks once. tile[i][w] holds input columns c0 + 2w (low half) and
// c0 + 2w + 1 (high half) of input row r0 + i.
// Store: thread t holds pair p (output rows c0 + 2p, c0 + 2p + 1) and chunk ch (output columns
// r0 + 8ch .. r0 + 8ch + 7): it reads the 8 words tile[8ch + j][p], j = 0..7 (bank
// (8ch + j + p) % 32; a warp's lanes are 4 chunks x 8 pairs, lane = 8 (ch % 4) + p % 8: 32
// banks), and writes the low halves as one 16-byte vector of row c0 + 2p, the high halves as one
// of row c0 + 2p + 1. A warp writes 16 rows x 64 contiguous bytes (whole 32-byte sectors).
extern "C" __global__ void transpose16_v2(const unsigned short* __restrict__ in,
                                          unsigned short* __restrict__ out, long long rows,
                                          long long cols) {
    __shared__ unsigned int tile[T16_V2_TILE][T16_V2_WORDS];
    const long long b = blockIdx.x, tiles_c = (cols + T16_V2_TILE - 1) / T16_V2_TILE;
    const long long r0 = (b / tiles_c) * T16_V2_TILE, c0 = (b % tiles_c) * T16_V2_TILE;
    const int t = threadIdx.x;
    // a whole input (output) row is made of 16-byte chunks: every chunk inside is aligned
    const bool vec_in = (cols % 8 == 0) && aligned16(in);
    const bool vec_out = (rows % 8 == 0) && aligned16(out);

    const int k = t & 7;
    for (int i = t >> 3; i < T16_V2_TILE; i += 32) {
        const long long r = r0 + i, c = c0 + 8 * k;
        uint4 v;
        if (vec_in && r < rows && c < cols) {         // cols % 8 == 0: the chunk is all inside
            v = *reinterpret_cast<const uint4*>(in + r * cols + c);
        } else {                                      // ragged edge: zeros outside the matrix
            unsigned int e[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) e[q] = (r < rows && c + q < cols) ? in[r * cols + c + q] : 0u;
            v = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16,
                           e[6] | e[7] << 16);
        }
        tile[i][4 * k + 0] = v.x;
        tile[i][4 * k + 1] = v.y;
        tile[i][4 * k + 2] = v.z;
        tile[i][4 * k + 3] = v.w;
    }
    __syncthreads();                                  // every word of the tile is written

    const int lane = t & 31, w = t >> 5;
    const int ch = (lane >> 3) + 4 * (w & 1), p = (lane & 7) + 8 * (w >> 1);
    unsigned int x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = tile[8 * ch + j][p];
    const long long r = r0 + 8 * ch;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const long long c = c0 + 2 * p + e;                 // output row = input column
        if (c >= cols || r >= rows) continue;
        unsigned short* dst = out + c * rows + r;
        if (vec_out) {                                // rows % 8 == 0: the chunk is all inside
            const unsigned int sel = e ? 0x7632u : 0x5410u; // high halves : low halves
            *reinterpret_cast<uint4*>(dst) =
                make_uint4(__byte_perm(x[0], x[1], sel), __byte_perm(x[2], x[3], sel),
                           __byte_perm(x[4], x[5], sel), __byte_perm(x[6], x[7], sel));
        } else {
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (r + q < rows) dst[q] = (unsigned short)(x[q] >> (16 * e));
        }
    }
}
