"""Launching kernels/paged_attention.cu (and its Numba twins): decode attention over a paged KV
cache, split over the keys, with grouped-query heads.

    pa = cb.load_launch("paged_attention")
    pa.append(k, v, k_pool, v_pool, block_table, seq_lens)       # the new token's K, V
    pa.rope_append(qkv, q, k_pool, v_pool, block_table, seq_lens)  # RoPE + append, fused
    pa.write_prompt(k, v, k_pool, v_pool, row, n)                # a prefill's K, V into blocks
    out = pa.decode(q, k_pool, v_pool, block_table, seq_lens)    # split + merge, two launches
    work = pa.Workspace(B, H, D, splits)                         # partials, for a CUDA graph
    pa.decode(q, ..., out=out, work=work)                        # allocates nothing
    pa.decode_numba(q, ...)                                      # the twins (simulator or GPU)
    pa.rope_append_numba(...), pa.write_prompt_numba(...)        # likewise, NumPy in and out
    pa.reference(q, k_pool, v_pool, block_table, seq_lens)       # float64 NumPy, dense

    VERSIONS, HEAD_DIMS, GMAX, THREADS, MAX_SPLIT_KEYS
    plan(B, Hkv, MB, BS, splits=None) -> (splits, blocks per split)
    config(kernel, ...)  -> Launch(grid, block, shared, kernel)
    check_table(block_table, seq_lens, num_blocks, block_size)   the host check (not in a graph)
    sanitize_targets()

Shapes (paged_attention.cu): q (B, H, D) fp16; k_pool, v_pool (NB, Hkv, BS, D) fp16; block_table
(B, MB) int32; seq_lens (B,) int32; out (B, H, D) fp16. Refused before a launch: dtypes, shapes and
layouts; D not in HEAD_DIMS; H not a multiple of Hkv, or more than GMAX query heads per KV head;
a split of more than MAX_SPLIT_KEYS keys; with ``check=True`` (host copies: not inside a graph
capture) a block id outside the pool, a block owned twice, an empty or too long sequence. What
the kernels meet at run time without the check (a bad id, a sequence longer than its table) makes
that query head's output NaN.
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name
from cudabook.validate import expect_aligned

__all__ = ["VERSIONS", "HEAD_DIMS", "GMAX", "THREADS", "MAX_SPLIT_KEYS", "Workspace", "plan",
           "config", "check_table", "append", "rope_append", "write_prompt", "rope_append_numba",
           "write_prompt_numba", "decode", "decode_numba",
           "reference", "rope_reference", "sanitize_targets"]

VERSIONS = ("paged_decode_v1", "paged_decode_v2")
HEAD_DIMS = (16, 32, 64, 128)
GMAX = 8                    # PAGED_GMAX in the .cu
THREADS = 128               # PAGED_THREADS
MAX_SPLIT_KEYS = 512        # keys per split: their scores sit in shared memory


def _module():
    return cb.module("paged_attention")


def _dims(q, k_pool, v_pool, block_table, seq_lens, half: bool = True):
    dt = np.float16 if half else None
    cb.expect(q, "q", dtype=dt, ndim=3, device=half)
    B, H, D = (int(s) for s in q.shape)
    cb.expect(k_pool, "k_pool", dtype=dt, ndim=4, device=half)
    NB, Hkv, BS, Dk = (int(s) for s in k_pool.shape)
    if Dk != D:
        raise ValueError(f"k_pool: head dimension {Dk}, q has {D}")
    cb.expect(v_pool, "v_pool", dtype=dt, shape=(NB, Hkv, BS, D), device=half)
    cb.expect(block_table, "block_table", dtype=np.int32, ndim=2, device=half)
    if int(block_table.shape[0]) != B:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {B} requests")
    MB = int(block_table.shape[1])
    cb.expect(seq_lens, "seq_lens", dtype=np.int32, shape=(B,), device=half)
    if Hkv < 1 or H % Hkv:
        raise LaunchError(f"{H} query heads cannot share {Hkv} KV heads evenly (H must be a "
                          "multiple of Hkv)")
    if H // Hkv > GMAX:
        raise LaunchError(f"{H // Hkv} query heads per KV head; the kernels hold at most {GMAX}")
    if half and D not in HEAD_DIMS:
        raise LaunchError(f"head dimension {D}: the kernels take {HEAD_DIMS} (16-byte rows, "
                          f"and {THREADS} threads a multiple of D)")
    if min(B, NB, BS, MB) < 1:
        raise LaunchError(f"empty input: B={B}, NB={NB}, BS={BS}, MB={MB}")
    return B, H, D, NB, Hkv, BS, MB


class Workspace:
    """The split partials m, l (B, H, S) and o (B, H, S, D), float32 on the GPU: allocated once
    so that a captured decode step allocates nothing."""

    def __init__(self, B: int, H: int, D: int, splits: int):
        import cupy as cp

        self.shape = (int(B), int(H), int(D), int(splits))
        self.m = cp.empty((B, H, splits), cp.float32)
        self.l = cp.empty((B, H, splits), cp.float32)
        self.o = cp.empty((B, H, splits, D), cp.float32)


def plan(B: int, Hkv: int, MB: int, BS: int, splits: int | None = None) -> tuple[int, int]:
    """(S, bps): how many splits and how many blocks each. By default enough splits that the
    grid (Hkv, B, S) has about two blocks per SM, and no more splits than blocks; a split holds
    at most MAX_SPLIT_KEYS keys, so a long table gets more splits than asked."""
    if splits is None:
        sms = cb.launch.device().sms if cb.env.HAS_GPU else 132
        splits = max(1, min(MB, ceil_div(2 * sms, B * Hkv)))
    if isinstance(splits, bool) or int(splits) != splits or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    if BS > MAX_SPLIT_KEYS:
        raise LaunchError(f"blocks of {BS} tokens: a split holds at most {MAX_SPLIT_KEYS} keys "
                          "(their scores sit in shared memory)")
    bps = min(ceil_div(MB, int(splits)), MAX_SPLIT_KEYS // BS)   # more splits past the cap
    return ceil_div(MB, bps), bps


def _shared(G: int, D: int, bps: int, BS: int, kernel: str = "paged_decode_v1") -> int:
    parts = THREADS // D if kernel == "paged_decode_v1" else THREADS // 32   # P V partials
    return 4 * (G * D + G * bps * BS + parts * G * D) + 4 * bps + 16


def config(kernel: str, B: int = 1, H: int = 1, Hkv: int = 1, D: int = 64, S: int = 1,
           bps: int = 1, BS: int = 16) -> Launch:
    """paged_decode_v1, _v2: grid (Hkv, B, S), THREADS threads, the split's scores in shared memory
    (v2 instantiated for the group size rounded up to a power of two: paged_decode_v2_g1..g8);
    paged_merge_v1: grid (H, B), 128 threads; paged_append_v1: a thread per element;
    paged_rope_append_v1: a thread per rotated pair of the query and key heads."""
    if kernel in VERSIONS:
        G = H // Hkv
        name = kernel if kernel == "paged_decode_v1" else f"{kernel}_g{1 << (G - 1).bit_length()}"
        return Launch((Hkv, B, S), (THREADS,), shared=_shared(G, D, bps, BS, kernel),
                      kernel=name)
    if kernel == "paged_merge_v1":
        return Launch((H, B), (128,), kernel=kernel)
    if kernel == "paged_append_v1":
        return Launch((ceil_div(B * Hkv * D, 256),), (256,), kernel=kernel)
    if kernel == "paged_write_v1":
        return Launch((ceil_div(Hkv * S * (D // 8), 256),), (256,), kernel=kernel)   # S: T
    if kernel == "paged_rope_append_v1":
        return Launch((ceil_div(B * (H + Hkv) * (D // 2), 256),), (256,), kernel=kernel)
    raise ValueError(f"unknown kernel {kernel!r}; paged_attention.cu has {', '.join(VERSIONS)}, "
                     "paged_merge_v1, paged_append_v1, paged_rope_append_v1")


def check_table(block_table, seq_lens, num_blocks: int, block_size: int) -> None:
    """Refuse, on the host, a table the kernels would read wrongly: a sequence empty or longer
    than its row, a used entry outside [0, num_blocks), one block in two places."""
    bt, sl = cb.to_numpy(block_table), cb.to_numpy(seq_lens)
    MB = bt.shape[1]
    for b, n in enumerate(sl):
        if not 1 <= n <= MB * block_size:
            raise ValueError(f"request {b}: {n} tokens; a request holds 1 to {MB * block_size} "
                             f"({MB} blocks of {block_size})")
    used = [bt[b, :ceil_div(int(n), block_size)] for b, n in enumerate(sl)]
    flat = np.concatenate(used)
    bad = flat[(flat < 0) | (flat >= num_blocks)]
    if bad.size:
        raise ValueError(f"block ids {sorted(set(bad.tolist()))[:5]} outside the pool "
                         f"[0, {num_blocks}) in a request's used blocks")
    vals, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"blocks {vals[counts > 1][:5].tolist()} are used by two positions: "
                         "requests would read each other's keys")


def append(k, v, k_pool, v_pool, block_table, seq_lens) -> None:
    """Write the new token's k, v (B, Hkv, D) fp16 into the pool at position seq_lens[b] - 1 of
    each request (grow the table and seq_lens first: cudabook.paging.PagedTable.grow)."""
    NB, Hkv, BS, D = (int(s) for s in k_pool.shape)
    B = int(block_table.shape[0])
    cb.expect(k, "k", dtype=np.float16, shape=(B, Hkv, D))
    cb.expect(v, "v", dtype=np.float16, shape=(B, Hkv, D))
    cb.expect(k_pool, "k_pool", dtype=np.float16, ndim=4)
    cb.expect(v_pool, "v_pool", dtype=np.float16, shape=(NB, Hkv, BS, D))
    cb.expect(block_table, "block_table", dtype=np.int32, ndim=2)
    cb.expect(seq_lens, "seq_lens", dtype=np.int32, shape=(B,))
    MB = int(block_table.shape[1])
    cfg = config("paged_append_v1", B=B, Hkv=Hkv, D=D)
    arr, i = cb.as_cupy, np.int32
    cb.launch.run(_module().get(cfg.kernel), cfg,
                  (arr(k, "k"), arr(v, "v"), arr(k_pool, "k_pool"), arr(v_pool, "v_pool"),
                   arr(block_table, "block_table"), arr(seq_lens, "seq_lens"), i(B), i(Hkv),
                   i(D), i(NB), i(BS), i(MB)), stream=cb.stream_for(k, k_pool))


def rope_append(qkv, q_out, k_pool, v_pool, block_table, seq_lens, base: float = 10000.0
                ) -> None:
    """The QKV projection of each request's new token, qkv (B, (H + 2 Hkv) D) fp16 (query
    heads, key heads, value heads): q and k rotated (RoPE, half-split pairs) at each request's
    own position seq_lens[b] - 1, q into q_out (B, H, D), k and v into the pool there. Grow the
    table and seq_lens first. One launch of paged_rope_append_v1."""
    cb.expect(q_out, "q_out", dtype=np.float16, ndim=3)
    B, H, D = (int(s) for s in q_out.shape)
    cb.expect(k_pool, "k_pool", dtype=np.float16, ndim=4)
    NB, Hkv, BS, Dk = (int(s) for s in k_pool.shape)
    if Dk != D or D % 2:
        raise ValueError(f"k_pool: head dimension {Dk}; q_out has {D} (an even number is needed)")
    if Hkv < 1 or H % Hkv:
        raise LaunchError(f"{H} query heads cannot share {Hkv} KV heads evenly")
    cb.expect(qkv, "qkv", dtype=np.float16, shape=(B, (H + 2 * Hkv) * D))
    cb.expect(v_pool, "v_pool", dtype=np.float16, shape=(NB, Hkv, BS, D))
    cb.expect(block_table, "block_table", dtype=np.int32, ndim=2)
    if int(block_table.shape[0]) != B:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {B} requests")
    cb.expect(seq_lens, "seq_lens", dtype=np.int32, shape=(B,))
    if not base > 1:
        raise ValueError(f"RoPE base must be > 1, got {base}")
    MB = int(block_table.shape[1])
    cfg = config("paged_rope_append_v1", B=B, H=H, Hkv=Hkv, D=D)
    arr, i = cb.as_cupy, np.int32
    with cb.arrays.launch_stream(qkv, k_pool, q_out):
        cb.launch.run(_module().get(cfg.kernel), cfg,
                      (arr(qkv, "qkv"), arr(q_out, "q_out"), arr(k_pool, "k_pool"),
                       arr(v_pool, "v_pool"), arr(block_table, "block_table"),
                       arr(seq_lens, "seq_lens"), i(B), i(H), i(Hkv), i(D), i(NB), i(BS), i(MB),
                       np.float32(math.log2(base))))


def write_prompt(k, v, k_pool, v_pool, row, n) -> None:
    """A prompt's keys and values from prefill, k, v (Hkv, T, D) fp16 (dense, T >= its length),
    into the blocks of ``row`` (MB,) int32 at positions 0..n-1; ``n`` is (1,) int32 on the GPU
    (a padded prefill's length, read there: capturable). One launch of paged_write_v1."""
    cb.expect(k_pool, "k_pool", dtype=np.float16, ndim=4)
    NB, Hkv, BS, D = (int(s) for s in k_pool.shape)
    cb.expect(v_pool, "v_pool", dtype=np.float16, shape=(NB, Hkv, BS, D))
    cb.expect(k, "k", dtype=np.float16, ndim=3)
    T = int(k.shape[1])
    cb.expect(k, "k", dtype=np.float16, shape=(Hkv, T, D), contiguous=True)
    cb.expect(v, "v", dtype=np.float16, shape=(Hkv, T, D), contiguous=True)
    if D % 8 or T < 1:
        raise LaunchError(f"write_prompt: head dimension {D} must be a multiple of 8 and T >= 1 "
                          f"(got T = {T})")
    if not all(expect_aligned(a, nm) for a, nm in ((k, "k"), (v, "v"), (k_pool, "k_pool"),
                                                    (v_pool, "v_pool"))):
        raise LaunchError("write_prompt copies 16 bytes at a time: k, v and the pools must start "
                          "at 16-byte aligned addresses")
    cb.expect(row, "row", dtype=np.int32, ndim=1)
    cb.expect(n, "n", dtype=np.int32, shape=(1,))
    cfg = config("paged_write_v1", Hkv=Hkv, D=D, S=T)
    arr, i = cb.as_cupy, np.int32
    with cb.arrays.launch_stream(k, k_pool):
        cb.launch.run(_module().get(cfg.kernel), cfg,
                      (arr(k, "k"), arr(v, "v"), arr(k_pool, "k_pool"), arr(v_pool, "v_pool"),
                       arr(row, "row"), arr(n, "n"), i(T), i(Hkv), i(D), i(NB), i(BS),
                       i(int(row.shape[0]))))


def rope_reference(qkv, seq_lens, H: int, Hkv: int, D: int, base: float = 10000.0):
    """Float64 NumPy: (q (B, H, D), k (B, Hkv, D)) rotated at positions seq_lens - 1."""
    x = cb.to_numpy(qkv).astype(np.float64).reshape(len(seq_lens), H + 2 * Hkv, D)
    p = cb.to_numpy(seq_lens).astype(np.float64) - 1
    i = np.arange(D // 2)
    ang = p[:, None, None] * base ** (-2.0 * i / D)[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :D // 2], x[..., D // 2:]
    y = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return y[:, :H], y[:, H:H + Hkv]


def decode(q, k_pool, v_pool, block_table, seq_lens, out=None, splits: int | None = None,
           work: Workspace | None = None, check: bool = False, version: str = "v2"):
    """out (B, H, D) fp16 = softmax(q K^T / sqrt(D)) V over each request's cached keys:
    paged_decode_vN (``version``, default the fastest) over (Hkv, B, S) blocks, then
    paged_merge_v1. Returns out."""
    kernel = version_name(VERSIONS, version, "paged_decode")
    B, H, D, NB, Hkv, BS, MB = _dims(q, k_pool, v_pool, block_table, seq_lens)
    if work is not None and work.shape[:3] != (B, H, D):
        raise ValueError(f"work: made for (B, H, D) = {work.shape[:3]}, not {(B, H, D)}")
    S, bps = plan(B, Hkv, MB, BS, work.shape[3] if work is not None else splits)
    if work is not None and work.shape[3] != S:
        raise ValueError(f"work holds {work.shape[3]} splits; at this table {S} are needed")
    if check:
        check_table(block_table, seq_lens, NB, BS)
    cb.launch.need_shared(_shared(H // Hkv, D, bps, BS, kernel), kernel)
    work = work or Workspace(B, H, D, S)
    if out is None:
        out = cb.arrays.empty_like_lib(q, (B, H, D), "float16")
    cb.expect(out, "out", dtype=np.float16, shape=(B, H, D))
    mod, arr, i = _module(), cb.as_cupy, np.int32
    cfg = config(kernel, B=B, H=H, Hkv=Hkv, D=D, S=S, bps=bps, BS=BS)
    with cb.arrays.launch_stream(q, k_pool, out):
        cb.launch.run(mod.get(cfg.kernel), cfg,
                      (arr(q, "q"), arr(k_pool, "k_pool"), arr(v_pool, "v_pool"),
                       arr(block_table, "block_table"), arr(seq_lens, "seq_lens"), work.m,
                       work.l, work.o, i(H), i(Hkv), i(D), i(NB), i(BS), i(MB), i(bps),
                       np.float32(math.log2(math.e) / math.sqrt(D))))
        mcfg = config("paged_merge_v1", B=B, H=H)
        cb.launch.run(mod.get(mcfg.kernel), mcfg,
                      (work.m, work.l, work.o, arr(out, "out"), i(H), i(D), i(S)))
    return out


def decode_numba(q, k_pool, v_pool, block_table, seq_lens, splits: int = 2):
    """The Numba twins (float32, on the simulator without a GPU): returns (out, m, l, o) as
    NumPy arrays, out (B, H, D) and the split partials."""
    from numba import cuda

    B, H, D, NB, Hkv, BS, MB = _dims(q, k_pool, v_pool, block_table, seq_lens, half=False)
    S, bps = plan(B, Hkv, MB, BS, splits)
    nb = cb.load_numba("paged_attention")
    if bps * BS > nb.TSMAX:
        raise LaunchError(f"the Numba twin holds {nb.TSMAX} keys per split, not {bps * BS}")
    host = [np.ascontiguousarray(cb.to_numpy(a)) for a in (q, k_pool, v_pool)]
    q_, k_, v_ = (cuda.to_device(a.astype(np.float32)) for a in host)
    bt = cuda.to_device(np.ascontiguousarray(cb.to_numpy(block_table)))
    sl = cuda.to_device(np.ascontiguousarray(cb.to_numpy(seq_lens)))
    m = cuda.to_device(np.full((B, H, S), np.nan, np.float32))
    l_ = cuda.to_device(np.full((B, H, S), np.nan, np.float32))
    o = cuda.to_device(np.full((B, H, S, D), np.nan, np.float32))
    out = cuda.to_device(np.full((B, H, D), np.nan, np.float32))
    nb.paged_decode_split[(Hkv, B, S), 32](q_, k_, v_, bt, sl, bps, np.float32(1 / math.sqrt(D)),
                                           m, l_, o)
    nb.paged_merge[(H, B), 32](m, l_, o, out)
    return out.copy_to_host(), m.copy_to_host(), l_.copy_to_host(), o.copy_to_host()


def rope_append_numba(qkv, q_out, k_pool, v_pool, block_table, seq_lens,
                      base: float = 10000.0):
    """The Numba twin of ``rope_append`` (float32; the simulator without a GPU): NumPy arrays in,
    (q_out, k_pool, v_pool) NumPy arrays out (copies, updated)."""
    from numba import cuda

    nb = cb.load_numba("paged_attention")
    B, H, D = (int(s) for s in q_out.shape)
    Hkv = int(k_pool.shape[1])
    x = np.ascontiguousarray(cb.to_numpy(qkv), np.float32).reshape(B, H + 2 * Hkv, D)
    dev = [cuda.to_device(np.ascontiguousarray(cb.to_numpy(a), np.float32))
           for a in (q_out, k_pool, v_pool)]
    bt, sl = (cuda.to_device(np.ascontiguousarray(cb.to_numpy(a), np.int32))
              for a in (block_table, seq_lens))
    n = B * (H + Hkv) * (D // 2)
    nb.paged_rope_append[ceil_div(n, 64), 64](cuda.to_device(x), *dev, bt, sl,
                                               np.float32(math.log2(base)))
    return tuple(d.copy_to_host() for d in dev)


def write_prompt_numba(k, v, k_pool, v_pool, row, n):
    """The Numba twin of ``write_prompt`` (float32): NumPy in, (k_pool, v_pool) NumPy out."""
    from numba import cuda

    nb = cb.load_numba("paged_attention")
    kk, vv = (cuda.to_device(np.ascontiguousarray(cb.to_numpy(a), np.float32)) for a in (k, v))
    pools = [cuda.to_device(np.ascontiguousarray(cb.to_numpy(a), np.float32))
             for a in (k_pool, v_pool)]
    r = cuda.to_device(np.ascontiguousarray(cb.to_numpy(row), np.int32))
    nn = cuda.to_device(np.array([int(n)], np.int32))
    total = int(np.prod(kk.shape))
    nb.paged_write[ceil_div(total, 64), 64](kk, vv, *pools, r, nn)
    return tuple(p.copy_to_host() for p in pools)


def reference(q, k_pool, v_pool, block_table, seq_lens) -> np.ndarray:
    """Float64 NumPy: each request's keys gathered through its block table into a dense
    sequence, then softmax(q K^T / sqrt(D)) V per query head (head h reads KV head h // G)."""
    q, kp, vp = (cb.to_numpy(a).astype(np.float64) for a in (q, k_pool, v_pool))
    bt, sl = cb.to_numpy(block_table), cb.to_numpy(seq_lens)
    B, H, D = q.shape
    Hkv, BS = kp.shape[1], kp.shape[2]
    G = H // Hkv
    out = np.empty((B, H, D))
    for b in range(B):
        t = np.arange(int(sl[b]))
        blk, off = bt[b, t // BS], t % BS
        for h in range(H):
            K, V = kp[blk, h // G, off], vp[blk, h // G, off]
            s = K @ q[b, h] / math.sqrt(D)
            p = np.exp(s - s.max())
            out[b, h] = p @ V / p.sum()
    return out


def sanitize_targets():
    """A ragged paged batch (lengths at and past block boundaries, shuffled blocks, GQA group 4,
    3 splits): memcheck the 16-byte row loads and the table reads, racecheck the score buffer."""
    import cupy as cp

    rng = np.random.default_rng(0)
    B, H, Hkv, D, BS, MB, NB = 3, 8, 2, 64, 16, 4, 16
    lens = np.array([1, 17, 64], np.int32)
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        nblk = ceil_div(int(n), BS)
        table[b, :nblk], ids = ids[:nblk], ids[nblk:]
    q = cp.asarray(rng.standard_normal((B, H, D)), dtype=cp.float16)
    kp = cp.asarray(rng.standard_normal((NB, Hkv, BS, D)), dtype=cp.float16)
    vp = cp.asarray(rng.standard_normal((NB, Hkv, BS, D)), dtype=cp.float16)
    bt, sl = cp.asarray(table), cp.asarray(lens)
    for v in VERSIONS:
        yield f"{v} + paged_merge_v1 (3 requests, GQA 4, 3 splits)", (
            lambda v=v: decode(q, kp, vp, bt, sl, splits=3, version=v))
    k1 = cp.asarray(rng.standard_normal((B, Hkv, D)), dtype=cp.float16)
    yield "paged_append_v1 (3 requests)", (lambda: append(k1, k1, kp, vp, bt, sl))
    kd = cp.asarray(rng.standard_normal((Hkv, 40, D)), dtype=cp.float16)
    yield "paged_write_v1 (a prompt of 33 in a padded 40)", (
        lambda: write_prompt(kd, kd, kp, vp, bt[2], cp.asarray([33], cp.int32)))
    qkv = cp.asarray(rng.standard_normal((B, (H + 2 * Hkv) * D)), dtype=cp.float16)
    qo = cp.empty((B, H, D), cp.float16)
    yield "paged_rope_append_v1 (3 requests, GQA 4)", (
        lambda: rope_append(qkv, qo, kp, vp, bt, sl))
