"""Numba twins of kernels/layernorm_train.cu: LayerNorm for training, forward and backward.

bf16 is awkward in Numba, so the twins take and write float32 arrays: the bf16 inputs (residual,
dy) arrive as float32 arrays holding bf16 values (exact), and the bf16 outputs (y, dx16) are
written unrounded in float32; the launcher's forward_numba / backward_numba round them to bf16
afterwards, which is where the CUDA kernels round (once, at the store). The simulator has no
warp shuffles, so a "warp sum" here is 32 partials in shared memory added in lane order (the
CUDA kernels use the butterfly): the same sums in another fixed order.

  forward_warp_rows       layernorm_train_fwd_v1: a warp (32 threads) per row, WARPS per block
  backward_dx_warp_rows   layernorm_train_bwd_v1: dx, a warp per row
  backward_dwdb_columns   layernorm_train_dwdb_v1: dw, db += column sums, a thread per column
  forward_row_groups      layernorm_train_fwd_v2's row groups: 32 W threads per row, thread t
                          owning the 8-column chunks t, t + 32 W, ... (at most CHUNKS), R rows per
                          block (scalar loads where the kernel loads 16 bytes)
  backward_row_groups     layernorm_train_bwd_v2: dx and the block's dw/db partials, rows
                          blockIdx.x * R + g, then + gridDim.x * R, ..., groups added in order
  backward_finalize       layernorm_train_finalize_v2: dw, db += the partials' column sums,
                          block (32, 8), in the kernel's order

The launcher (layernorm_train_launch.py) sizes the grids: row_group(C) gives (32 W, R).
"""

import math

from numba import cuda, float32

WARPS = 4             # rows (warps) per block of the v1 twins
CHUNKS = 4            # LNT_CHUNKS
THREADS = 256         # LNT_THREADS: the most threads of a v2 block
COMB = 8192           # floats of the v2 backward's combine buffer: R * C <= 8 * 1024


@cuda.jit(device=True)
def _group_sum(s, v, first, n, tid):
    """v summed over threads first .. first + n - 1 of the block, in thread order; every thread
    of the block calls it; s holds one float per thread."""
    s[tid] = v
    cuda.syncthreads()
    r = float32(0)
    for i in range(n):
        r += s[first + i]
    cuda.syncthreads()                       # everyone has read s before it is written again
    return r


@cuda.jit
def forward_warp_rows(x, residual, has_res, x_out, w, b, eps, y, mean, rstd):
    # launch: [ceil_div(M, WARPS), 32 * WARPS]
    s = cuda.shared.array(32 * WARPS, float32)
    tid = cuda.threadIdx.x
    lane, first = tid % 32, tid - tid % 32
    M, C = x.shape
    row = cuda.blockIdx.x * WARPS + tid // 32
    ok = row < M                             # every thread reaches the barriers
    acc = float32(0)
    if ok:
        for j in range(lane, C, 32):
            v = x[row, j]
            if has_res:                      # x_out = x + residual, then x_out is normalised
                v += residual[row, j]
                x_out[row, j] = v
            acc += v
    mu = _group_sum(s, acc, first, 32, tid) / float32(C)
    q = float32(0)
    if ok:
        for j in range(lane, C, 32):
            d = (x_out[row, j] if has_res else x[row, j]) - mu
            q += d * d
    rs = float32(1) / math.sqrt(_group_sum(s, q, first, 32, tid) / float32(C) + eps)
    if ok:
        for j in range(lane, C, 32):
            v = x_out[row, j] if has_res else x[row, j]
            y[row, j] = (v - mu) * rs * w[j] + b[j]
        if lane == 0:
            mean[row] = mu
            rstd[row] = rs


@cuda.jit
def backward_dx_warp_rows(dy, x, w, mean, rstd, accumulate, dx):
    # launch: [ceil_div(M, WARPS), 32 * WARPS]
    s = cuda.shared.array(32 * WARPS, float32)
    tid = cuda.threadIdx.x
    lane, first = tid % 32, tid - tid % 32
    M, C = x.shape
    row = cuda.blockIdx.x * WARPS + tid // 32
    ok = row < M
    mu = mean[row] if ok else float32(0)
    rs = rstd[row] if ok else float32(0)
    s1 = float32(0)                          # sum of w dy
    s2 = float32(0)                          # sum of w dy xhat
    if ok:
        for j in range(lane, C, 32):
            wd = w[j] * dy[row, j]
            s1 += wd
            s2 += wd * ((x[row, j] - mu) * rs)
    m1 = _group_sum(s, s1, first, 32, tid) / float32(C)
    m2 = _group_sum(s, s2, first, 32, tid) / float32(C)
    if ok:
        for j in range(lane, C, 32):
            g = rs * (w[j] * dy[row, j] - m1 - ((x[row, j] - mu) * rs) * m2)
            dx[row, j] = dx[row, j] + g if accumulate else g


@cuda.jit
def backward_dwdb_columns(dy, x, mean, rstd, dw, db):
    # launch: [ceil_div(C, 32), 32]
    j = cuda.grid(1)
    M, C = x.shape
    if j >= C:
        return
    sw = float32(0)
    sb = float32(0)
    for i in range(M):                       # rows in order
        d = dy[i, j]
        sw += d * ((x[i, j] - mean[i]) * rstd[i])
        sb += d
    dw[j] += sw
    db[j] += sb


@cuda.jit(device=True)
def _group_threads(C):
    """32 W: the threads of a row group (lnt_group_threads in the .cu)."""
    return 32 * ((C // 8 + 32 * CHUNKS - 1) // (32 * CHUNKS))


@cuda.jit
def forward_row_groups(x, residual, has_res, x_out, w, b, eps, y, mean, rstd):
    # launch: [ceil_div(M, R), 32 W R] with (32 W, R) = row_group(C)
    s = cuda.shared.array(THREADS, float32)
    v = cuda.local.array((CHUNKS, 8), float32)
    tid = cuda.threadIdx.x
    M, C = x.shape
    C8, tpr = C // 8, _group_threads(C)
    t, first = tid % tpr, tid - tid % tpr
    row = cuda.blockIdx.x * (cuda.blockDim.x // tpr) + tid // tpr
    ok = row < M
    acc = float32(0)
    for k in range(CHUNKS):
        c = t + k * tpr
        for e in range(8):
            val = float32(0)
            if ok and c < C8:
                val = x[row, 8 * c + e]
                if has_res:
                    val += residual[row, 8 * c + e]
                    x_out[row, 8 * c + e] = val
            v[k, e] = val
            acc += val
    mu = _group_sum(s, acc, first, tpr, tid) / float32(C)
    q = float32(0)
    for k in range(CHUNKS):
        if ok and t + k * tpr < C8:
            for e in range(8):
                d = v[k, e] - mu
                q += d * d
    rs = float32(1) / math.sqrt(_group_sum(s, q, first, tpr, tid) / float32(C) + eps)
    if ok:
        if t == 0:
            mean[row] = mu
            rstd[row] = rs
        for k in range(CHUNKS):
            c = t + k * tpr
            if c < C8:
                for e in range(8):
                    j = 8 * c + e
                    y[row, j] = (v[k, e] - mu) * rs * w[j] + b[j]


@cuda.jit(device=True)
def _block_columns(a, part, which, comb, R, g, t, tpr, C, tid):
    """The block's column sums a (CHUNKS, 8) of its R groups into part[which, blockIdx.x, :]:
    through comb (R, C) and added in group order when R > 1 (block_columns in the .cu)."""
    C8, bid = C // 8, cuda.blockIdx.x
    if R == 1:
        for k in range(CHUNKS):
            c = t + k * tpr
            if c < C8:
                for e in range(8):
                    part[which, bid, 8 * c + e] = a[k, e]
        return
    for k in range(CHUNKS):
        c = t + k * tpr
        if c < C8:
            for e in range(8):
                comb[g * C + 8 * c + e] = a[k, e]
    cuda.syncthreads()
    for j in range(tid, C, cuda.blockDim.x):
        acc = float32(0)
        for r in range(R):
            acc += comb[r * C + j]
        part[which, bid, j] = acc
    cuda.syncthreads()


@cuda.jit
def backward_row_groups(dy, x, w, mean, rstd, accumulate, dx, part):
    # launch: [G, 32 W R] with (32 W, R) = row_group(C); part (2, G, C)
    s = cuda.shared.array(THREADS, float32)
    comb = cuda.shared.array(COMB, float32)
    xh = cuda.local.array((CHUNKS, 8), float32)
    dwa = cuda.local.array((CHUNKS, 8), float32)
    dba = cuda.local.array((CHUNKS, 8), float32)
    tid = cuda.threadIdx.x
    M, C = x.shape
    C8, tpr = C // 8, _group_threads(C)
    R = cuda.blockDim.x // tpr
    g, t, first = tid // tpr, tid % tpr, tid - tid % tpr
    for k in range(CHUNKS):
        for e in range(8):
            dwa[k, e] = float32(0)
            dba[k, e] = float32(0)
    r0 = cuda.blockIdx.x * R
    while r0 < M:                            # the same iterations for the whole block
        row = r0 + g
        ok = row < M
        mu = mean[row] if ok else float32(0)
        rs = rstd[row] if ok else float32(0)
        s1 = float32(0)
        s2 = float32(0)
        for k in range(CHUNKS):
            c = t + k * tpr
            if ok and c < C8:
                for e in range(8):
                    j = 8 * c + e
                    d = dy[row, j]
                    xh[k, e] = (x[row, j] - mu) * rs
                    wd = w[j] * d
                    s1 += wd
                    s2 += wd * xh[k, e]
                    dwa[k, e] += d * xh[k, e]
                    dba[k, e] += d
        m1 = _group_sum(s, s1, first, tpr, tid) / float32(C)
        m2 = _group_sum(s, s2, first, tpr, tid) / float32(C)
        if ok:
            for k in range(CHUNKS):
                c = t + k * tpr
                if c < C8:
                    for e in range(8):
                        j = 8 * c + e
                        o = rs * (w[j] * dy[row, j] - m1 - xh[k, e] * m2)
                        dx[row, j] = dx[row, j] + o if accumulate else o
        r0 += cuda.gridDim.x * R
    _block_columns(dwa, part, 0, comb, R, g, t, tpr, C, tid)
    _block_columns(dba, part, 1, comb, R, g, t, tpr, C, tid)


@cuda.jit
def backward_finalize(part, dw, db):
    # launch: [(ceil_div(C, 32), 2), (32, 8)]; part (2, P, C)
    sh = cuda.shared.array((8, 33), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    which = cuda.blockIdx.y
    P, C = part.shape[1], part.shape[2]
    j = cuda.blockIdx.x * 32 + tx
    acc = float32(0)
    if j < C:
        for i in range(ty, P, 8):
            acc += part[which, i, j]
    sh[ty, tx] = acc
    cuda.syncthreads()
    if ty == 0 and j < C:
        tot = float32(0)
        for i in range(8):
            tot += sh[i, tx]
        if which == 0:
            dw[j] += tot
        else:
            db[j] += tot
