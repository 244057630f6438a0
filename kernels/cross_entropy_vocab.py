"""Numba twins of kernels/cross_entropy_vocab.cu: the language model's cross-entropy over a padded
vocabulary, forward and backward fused, the gradient written over the logits (capstone).

Numba has no bfloat16: the twins take the logits as a float32 (M, Vp) array holding bf16 values
(what the CUDA kernels convert them to) and write the gradient in float32, where the CUDA kernels
round it to bf16 (cross_entropy_vocab_launch.bf16_round does that rounding on the host). g may
be z itself (in place), as in the CUDA kernels. targets (M,) int32 or int64; -1 ignores a row
(loss 0, gradient 0); outside [-1, V) gives a NaN loss and a NaN gradient over j < V; the
padding columns j >= V are never read and get 0. One block of TPB threads per row.

versions
  xent_three_pass   cross_entropy_vocab_v1: max, sum of exp, gradient, each pass strided over
                    the block, common.py's tree_max / tree_sum between them
  xent_online       cross_entropy_vocab_v2: a running (m, d) per thread over groups of 8 columns
                    (the 16-byte chunks of the CUDA kernel), merged over the block by a tree of
                    softmax.py's merge, then the gradient pass over the same groups
  xent_mean         cross_entropy_vocab_mean: one block, each thread sums a fixed stride in
                    float64, then a tree: the same order on every run
"""

import math

from numba import cuda, float32, float64

from cudabook.compile import load_module

common = load_module("common")           # tree_sum / tree_max, the twins of common.cuh's
softmax = load_module("softmax")         # merge: two running (max, sum) pairs, online softmax

TPB = 32                                 # threads per block: a power of two (the trees)
NEG_INF = float32(-math.inf)
NAN = float32(math.nan)


@cuda.jit(device=True)
def _fill_row(g, loss, r, t, V, tid):
    """An ignored row (t == -1: 0) or an invalid target (NaN) over j < V; 0 in the padding."""
    f = float32(0) if t == -1 else NAN
    for j in range(tid, g.shape[1], TPB):
        g[r, j] = f if j < V else float32(0)
    if tid == 0:
        loss[r] = f


@cuda.jit
def xent_three_pass(z, targets, loss, g, V, scale):
    # launch: [M, TPB]; z, g (M, Vp) float32 (g may be z); targets (M,); loss (M,) float32
    s = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    t = targets[r]
    if t < 0 or t >= V:                      # the same for the whole block: all return
        _fill_row(g, loss, r, t, V, tid)
        return
    zt = z[r, t]                             # read before the first barrier: before any write
    m = NEG_INF
    for j in range(tid, V, TPB):
        m = max(m, z[r, j])
    s[tid] = m
    m = common.tree_max(s, tid)
    d = float32(0)
    for j in range(tid, V, TPB):
        d += math.exp(z[r, j] - m)
    s[tid] = d
    d = common.tree_sum(s, tid)
    inv = float32(1) / d
    for j in range(tid, g.shape[1], TPB):
        gj = float32(0)
        if j < V:
            gj = (math.exp(z[r, j] - m) * inv - (float32(1) if j == t else float32(0))) * scale
        g[r, j] = gj
    if tid == 0:
        loss[r] = math.log(d) + m - zt


@cuda.jit
def xent_online(z, targets, loss, g, V, scale):
    # launch: [M, TPB]; as xent_three_pass, with Vp a multiple of 8 (groups of 8 columns)
    sm = cuda.shared.array(TPB, float32)
    sd = cuda.shared.array(TPB, float32)
    r, tid = cuda.blockIdx.x, cuda.threadIdx.x
    nc = g.shape[1] // 8
    t = targets[r]
    if t < 0 or t >= V:
        _fill_row(g, loss, r, t, V, tid)
        return
    zt = z[r, t]
    m, d = NEG_INF, float32(0)
    for c in range(tid, nc, TPB):            # pass 1: running max and rescaled sum
        cm = NEG_INF
        for k in range(8):
            if 8 * c + k < V:
                cm = max(cm, z[r, 8 * c + k])
        if cm > m:
            d = d * math.exp(m - cm)
            m = cm
        ms = m if m != NEG_INF else float32(0)
        for k in range(8):
            if 8 * c + k < V:
                d += math.exp(z[r, 8 * c + k] - ms)
    sm[tid], sd[tid] = m, d
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:                        # the block's (m, d)
        if tid < stride:
            sm[tid], sd[tid] = softmax.merge(sm[tid], sd[tid], sm[tid + stride], sd[tid + stride])
        cuda.syncthreads()
        stride //= 2
    m, d = sm[0], sd[0]
    inv = float32(1) / d
    for c in range(tid, nc, TPB):            # pass 2: the gradient, group by group
        for k in range(8):
            j = 8 * c + k
            gj = float32(0)
            if j < V:
                gj = (math.exp(z[r, j] - m) * inv - (float32(1) if j == t else float32(0))) * scale
            g[r, j] = gj
    if tid == 0:
        loss[r] = math.log(d) + m - zt


@cuda.jit
def xent_mean(losses, out):
    # launch: [1, TPB]; losses (M,) float32, out (1,) float32
    s = cuda.shared.array(TPB, float64)
    tid = cuda.threadIdx.x
    M = losses.shape[0]
    acc = float64(0)
    for i in range(tid, M, TPB):
        acc += float64(losses[i])
    s[tid] = acc
    total = common.tree_sum(s, tid)
    if tid == 0:
        out[0] = float32(total / M)
