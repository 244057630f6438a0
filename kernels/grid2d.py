"""Numba twin of kernels/grid2d.cu (Chapter 1).

  who_am_i_2d  records blockIdx.x/.y and threadIdx.x/.y of the thread that wrote each element
               of a rows x cols matrix: x walks columns, y walks rows
"""

from numba import cuda


@cuda.jit
def who_am_i_2d(who):
    # launch: [(ceil_div(cols, bx), ceil_div(rows, by)), (bx, by)]; who is int32[rows, cols, 4]
    col, row = cuda.grid(2)              # cuda.grid(2) returns (x, y): x first, the column
    if row < who.shape[0] and col < who.shape[1]:
        who[row, col, 0] = cuda.blockIdx.x
        who[row, col, 1] = cuda.blockIdx.y
        who[row, col, 2] = cuda.threadIdx.x
        who[row, col, 3] = cuda.threadIdx.y
