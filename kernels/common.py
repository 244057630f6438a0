"""Numba twin of kernels/common.cuh: the shared-memory tree reductions the block-per-row kernels use.

  tree_sum(s, tid)   s[0] becomes the sum of s[0 .. len(s)), every thread returns it
  tree_max(s, tid)   the same with max

Contract (as block_sum in common.cuh): every thread of the block calls it after writing its own
s[tid]; len(s) equals the block size and is a power of two; s may be rewritten right after the call
(the closing barrier is inside). A ladder step that *teaches* a tree (reduce_v1..v3 in reduce.py)
keeps its own loop on purpose.
"""

from numba import cuda


@cuda.jit(device=True)
def tree_sum(s, tid):
    cuda.syncthreads()
    stride = s.shape[0] // 2
    while stride > 0:
        if tid < stride:
            s[tid] += s[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = s[0]
    cuda.syncthreads()                       # everyone has read s[0] before s is reused
    return total


@cuda.jit(device=True)
def tree_max(s, tid):
    cuda.syncthreads()
    stride = s.shape[0] // 2
    while stride > 0:
        if tid < stride:
            s[tid] = max(s[tid], s[tid + stride])
        cuda.syncthreads()
        stride //= 2
    top = s[0]
    cuda.syncthreads()
    return top
