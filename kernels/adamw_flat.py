"""Numba twins of kernels/adamw_flat.cu: the global gradient norm (deterministic partials, then
one block), clipping and AdamW over one flat buffer with the bf16 shadow of the weights.

Differences from the CUDA kernels, on purpose:
  * the block sums are common.py's shared-memory tree (tree_sum), where the CUDA kernels use
    common.cuh's warp-shuffle block_sum: a fixed order too, not the same order;
  * the state is a float64 array of STATE_SLOTS (the CUDA state is int32 words holding the step
    count and float32 bits): [0] the step count, [1] step_size, [2] bc2_sqrt, [3] lr, [4] clip;
  * Numba has no bfloat16: the shadow is a float32 array holding bf16 values, rounded with
    gelu_train.py's bf16_round where the CUDA kernel rounds.

versions
  sumsq_partial_one     grad_norm_v1's schedule: one element per thread, a partial per block
  sumsq_partial_chunk4  grad_norm_v2's schedule: chunks of 4, grid-stride, the tail by block 0
  sumsq_finish          grad_norm_finish: one block, thread j adds partials j, j + FINISH_THREADS,
                        ... in float64, then the block's tree; out[0] = sqrt(sum). Its block is
                        FINISH_THREADS = 64, where the CUDA kernel's is 1024: the simulator runs a
                        Python thread per GPU thread
  count_step            adamw_flat_count_step: one thread, t += 1 and the step's scalars
  adamw_flat_one        adamw_flat_v1's schedule: one element per thread
  adamw_flat_chunk4     adamw_flat_v2's schedule: 4 elements per thread, the tail singly
"""

import math

from numba import cuda, float32, float64

from cudabook.compile import load_module

common = load_module("common")              # tree_sum, the twin of common.cuh's block_sum
gelu_train = load_module("gelu_train")      # bf16_round

TPB = 256               # threads per block of the partials and the update
FINISH_THREADS = 64     # the twin's block (grad_norm_finish: 1024)
STATE_SLOTS = 5


@cuda.jit
def sumsq_partial_one(g, partial):
    # launch: [ceil_div(n, TPB), TPB]; partial (grid,)
    s = cuda.shared.array(TPB, float32)
    i = cuda.grid(1)
    x = g[i] if i < g.size else float32(0)
    s[cuda.threadIdx.x] = x * x
    total = common.tree_sum(s, cuda.threadIdx.x)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit
def sumsq_partial_chunk4(g, partial):
    # launch: [min(ceil_div(ceil_div(n, 4), TPB), 1024), TPB]; partial (grid,)
    s = cuda.shared.array(TPB, float32)
    tid = cuda.threadIdx.x
    n = g.size
    n4 = n // 4
    acc = float32(0)
    c = cuda.grid(1)
    while c < n4:                           # the CUDA kernel: one float4 load
        for j in range(4):
            acc += g[4 * c + j] * g[4 * c + j]
        c += cuda.gridsize(1)
    if cuda.blockIdx.x == 0 and tid < n - 4 * n4:          # the tail: at most 3 elements
        acc += g[4 * n4 + tid] * g[4 * n4 + tid]
    s[tid] = acc
    total = common.tree_sum(s, tid)
    if tid == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit
def sumsq_finish(partial, out):
    # launch: [1, FINISH_THREADS]; out (1,)
    s = cuda.shared.array(FINISH_THREADS, float64)
    tid = cuda.threadIdx.x
    acc = float64(0)
    for j in range(tid, partial.size, FINISH_THREADS):
        acc += float64(partial[j])
    s[tid] = acc
    total = common.tree_sum(s, tid)
    if tid == 0:
        out[0] = math.sqrt(total)


@cuda.jit
def count_step(state, lr, beta1, beta2, norm, max_norm):
    # launch: [1, 1]; state (STATE_SLOTS,) float64; norm (1,), read only when max_norm > 0
    t = state[0] + 1.0
    state[0] = t
    state[1] = lr / (1.0 - beta1 ** t)
    state[2] = math.sqrt(1.0 - beta2 ** t)
    state[3] = lr
    c = 1.0
    if max_norm > 0.0:
        c = max_norm * (1.0 / (norm[0] + 1e-6))
    state[4] = 1.0 if c > 1.0 else c


@cuda.jit(device=True, inline=True)
def _update(p, g, m, v, shadow, state, i, wd, beta1, beta2, eps):
    # common.cuh's adamw_param on the clipped gradient, then the shadow
    gi = g[i] * state[4]
    lr = state[3]
    pi = p[i] * (1.0 - lr * wd)
    mi = m[i] + (1.0 - beta1) * (gi - m[i])
    vi = beta2 * v[i] + (1.0 - beta2) * gi * gi
    pi = pi - state[1] * (mi / (math.sqrt(vi) / state[2] + eps))
    p[i], m[i], v[i] = pi, mi, vi
    shadow[i] = gelu_train.bf16_round(p[i])


@cuda.jit
def adamw_flat_one(p, g, m, v, shadow, state, n_decay, beta1, beta2, eps, wd):
    # launch: [ceil_div(n, TPB), TPB]
    i = cuda.grid(1)
    if i < p.size:
        _update(p, g, m, v, shadow, state, i, wd if i < n_decay else 0.0, beta1, beta2, eps)


@cuda.jit
def adamw_flat_chunk4(p, g, m, v, shadow, state, n_decay, beta1, beta2, eps, wd):
    # launch: [ceil_div(ceil_div(n, 4), TPB), TPB]; thread t owns [4t, 4t + 4)
    i = 4 * cuda.grid(1)
    n = p.size
    if i + 4 <= n:
        for j in range(4):                  # n_decay may fall inside these 4
            k = i + j
            _update(p, g, m, v, shadow, state, k, wd if k < n_decay else 0.0, beta1, beta2, eps)
    else:
        while i < n:
            _update(p, g, m, v, shadow, state, i, wd if i < n_decay else 0.0, beta1, beta2, eps)
            i += 1
