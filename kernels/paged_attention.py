"""Paged decode attention (Chapter 12): the Numba twins of paged_attention.cu's split and merge,
in float32 with the natural exponential (the CUDA C++ kernels use exp2 with a scaled query; the
partials of each twin are consistent with its own merge). They run on the CUDA simulator too,
which is where CI checks the algorithm: the block table, the splits, the grouped heads.

Layouts as in paged_attention.cu: q (B, H, D); k_pool, v_pool (NB, Hkv, BS, D); block_table
(B, MB) int32; seq_lens (B,) int32; partials m, l (B, H, S) and o (B, H, S, D) float32.

Numba
  paged_decode_split  one block per (KV head, request, split): scores of the split's keys for the
                      G query heads of the KV head, their max m and sum l of exp(s - m), and
                      o = sum_j exp(s_j - m) v_j
  paged_merge         one block per (query head, request): the splits combined, each rescaled by
                      exp(m_s - M) to the largest max M
  paged_rope_append   a thread per rotated pair of a request's new token: q and k rotated (RoPE,
                      half-split pairs) at the request's own position seq_lens[b] - 1, q to q_out,
                      k and v into the pool there (float32; paged_rope_append_v1's indexing)
  paged_write         a thread per (KV head, position, column) of a prompt: its keys and values
                      into the blocks of its table row at positions 0..n-1 (paged_write_v1's)
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

GMAX = 8        # query heads per KV head, at most
TSMAX = 256     # keys per split, at most (bps * BS)


@cuda.jit
def paged_decode_split(q, k_pool, v_pool, block_table, seq_lens, bps, scale, m_part, l_part,
                       o_part):
    kvh, b, s = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    H, D = q.shape[1], q.shape[2]
    NB, Hkv, BS = k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]
    MB = block_table.shape[1]
    G = H // Hkv
    TS = bps * BS
    sc = cuda.shared.array((GMAX, TSMAX), float32)
    bad = cuda.shared.array(1, int32)
    length = seq_lens[b]
    t0 = s * TS
    n = min(length, min(MB * BS, t0 + TS)) - t0
    if n <= 0:                                        # an empty split weighs nothing
        for e in range(tid, G * D, nt):
            o_part[b, kvh * G + e // D, s, e % D] = 0.0
        if tid < G:
            m_part[b, kvh * G + tid, s] = -math.inf
            l_part[b, kvh * G + tid, s] = math.nan if (length > MB * BS or length <= 0) else 0.0
        return
    if tid == 0:
        bad[0] = 1 if length > MB * BS else 0
    cuda.syncthreads()
    for j in range(tid, n, nt):                       # a thread per key: G scores
        t = t0 + j
        blk = block_table[b, t // BS]
        ok = 0 <= blk < NB
        if not ok:
            bad[0] = 1
        for g in range(G):
            acc = float32(0.0)
            if ok:
                for e in range(D):
                    acc += float32(q[b, kvh * G + g, e]) * float32(k_pool[blk, kvh, t % BS, e])
            sc[g, j] = acc * scale
    cuda.syncthreads()
    for g in range(tid, G, nt):                       # a thread per query head: m, l, exp
        m = -math.inf
        for j in range(n):
            m = max(m, sc[g, j])
        lsum = float32(0.0)
        for j in range(n):
            p = math.exp(sc[g, j] - m)
            sc[g, j] = p
            lsum += p
        m_part[b, kvh * G + g, s] = math.nan if bad[0] else m
        l_part[b, kvh * G + g, s] = math.nan if bad[0] else lsum
    cuda.syncthreads()
    for e in range(tid, G * D, nt):                   # a thread per (query head, d): P V
        g, d = e // D, e % D
        acc = float32(0.0)
        for j in range(n):
            t = t0 + j
            blk = block_table[b, t // BS]
            if 0 <= blk < NB:
                acc += sc[g, j] * float32(v_pool[blk, kvh, t % BS, d])
        o_part[b, kvh * G + g, s, d] = acc


@cuda.jit
def paged_merge(m_part, l_part, o_part, out):
    h, b = cuda.blockIdx.x, cuda.blockIdx.y
    S, D = m_part.shape[2], out.shape[2]
    M = -math.inf
    nan = False
    for s in range(S):
        if math.isnan(m_part[b, h, s]) or math.isnan(l_part[b, h, s]):
            nan = True
        else:
            M = max(M, m_part[b, h, s])
    den = float32(0.0)
    if not nan:
        for s in range(S):
            den += math.exp(m_part[b, h, s] - M) * l_part[b, h, s]
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        num = float32(0.0)
        if not nan:
            for s in range(S):
                num += math.exp(m_part[b, h, s] - M) * o_part[b, h, s, d]
        out[b, h, d] = math.nan if nan or den == 0.0 else num / den


@cuda.jit
def paged_rope_append(qkv, q_out, k_pool, v_pool, block_table, seq_lens, log2_base):
    # qkv (B, H + 2 Hkv, D): query heads, key heads, value heads of each request's new token
    i = cuda.grid(1)
    B, H, D = q_out.shape[0], q_out.shape[1], q_out.shape[2]
    NB, Hkv, BS = k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]
    MB, half = block_table.shape[1], D // 2
    if i >= B * (H + Hkv) * half:
        return
    c, j, b = i % half, (i // half) % (H + Hkv), i // (half * (H + Hkv))
    t = seq_lens[b] - 1
    ang = float32(max(t, 0)) * math.pow(float32(2.0), -2.0 * c / D * log2_base)
    cs, sn = math.cos(ang), math.sin(ang)
    x1, x2 = float32(qkv[b, j, c]), float32(qkv[b, j, c + half])
    ya, yb = x1 * cs - x2 * sn, x2 * cs + x1 * sn
    if j < H:
        q_out[b, j, c] = ya
        q_out[b, j, c + half] = yb
        return
    if t < 0 or t >= MB * BS:
        return
    blk = block_table[b, t // BS]
    if blk < 0 or blk >= NB:
        return
    kvh = j - H
    k_pool[blk, kvh, t % BS, c] = ya
    k_pool[blk, kvh, t % BS, c + half] = yb
    v_pool[blk, kvh, t % BS, c] = qkv[b, H + Hkv + kvh, c]
    v_pool[blk, kvh, t % BS, c + half] = qkv[b, H + Hkv + kvh, c + half]


@cuda.jit
def paged_write(k, v, k_pool, v_pool, row, n):
    # k, v (Hkv, T, D) a prompt's keys and values; row (MB,) its blocks; n (1,) its length
    i = cuda.grid(1)
    Hkv, T, D = k.shape[0], k.shape[1], k.shape[2]
    NB, BS, MB = k_pool.shape[0], k_pool.shape[2], row.shape[0]
    if i >= Hkv * T * D:
        return
    d, t, h = i % D, (i // D) % T, i // (D * T)
    if t >= n[0] or t >= MB * BS:
        return
    blk = row[t // BS]
    if blk < 0 or blk >= NB:
        return
    k_pool[blk, h, t % BS, d] = k[h, t, d]
    v_pool[blk, h, t % BS, d] = v[h, t, d]
