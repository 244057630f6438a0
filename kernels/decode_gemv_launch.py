"""Launching kernels/decode_gemv.cu: the decode step's GEMV with its neighbours fused in.

    dg = cb.load_launch("decode_gemv")
    dg.decode_gemv(x16, W, out=y)                                   # plain, store (gemv_v4)
    dg.decode_gemv(x32, W, ln=(gamma, beta, eps), out=y)            # LayerNorm prologue
    dg.decode_gemv(x32, W, ln=(gamma, beta, eps), out=y, gelu=True) # + GELU epilogue
    dg.decode_gemv(a16, W, residual=x32)                            # x32 += a16 @ W^T
    order = dg.rope_order(H, Hkv, D)                                # W_qkv[order]: pair rows
    dg.decode_gemv(x32, W_qkv[order], ln=(...), rope=dict(q_out=q, k_pool=kp, v_pool=vp,
                   block_table=bt, seq_lens=sl, base=10000.0))     # QKV + RoPE + paged append

    PROLOGUES, EPILOGUES, BATCH_TILES, MAX_B, KERNELS
    config(prologue, epilogue, B, N, K) -> Launch
    rope_order(H, Hkv, D) -> int64 index array
    sanitize_targets()

x is (B, K): fp16 for the plain prologue, the fp32 residual stream for ``ln``. W (N, K) fp16,
K % 8 == 0, 16-byte aligned; B from 1 to 32. Only the four combinations a GPT layer uses are
compiled (``KERNELS``); anything else, bad shapes, dtypes, alignment, K past the LayerNorm's
limit, a rope epilogue whose N is not (H + 2 Hkv) D, are refused before a launch. The results are
those of the unfused kernels the epilogues replace (gemv_v4, add_layernorm_v1, gelu_half_v1,
paged_rope_append_v1), rounded at the same places.
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, row_block

__all__ = ["PROLOGUES", "EPILOGUES", "BATCH_TILES", "MAX_B", "KERNELS", "config",
           "decode_gemv", "rope_order", "sanitize_targets"]

PROLOGUES = ("plain", "ln")
EPILOGUES = ("store", "gelu", "residual", "rope")
BATCH_TILES = (1, 2, 4, 8)
MAX_B = 32
R = 2                                 # weight rows per block
LN_MAX_K = 16 * 128                   # add_layernorm_v1's row in registers, 128 threads at most
#: (prologue, epilogue) -> kernel name stem: the combinations compiled
KERNELS = {("ln", "rope"): "dgemv_ln_rope", ("plain", "residual"): "dgemv_plain_residual",
           ("ln", "gelu"): "dgemv_ln_gelu", ("ln", "store"): "dgemv_ln_store"}


def _tile(B: int) -> int:
    return next((bt for bt in BATCH_TILES if B <= bt), BATCH_TILES[-1])


def config(prologue: str, epilogue: str, B: int, N: int, K: int) -> Launch:
    """grid (N / 2, ceil(B / BT)), 128 threads, BT K fp16 of shared memory for ``ln``."""
    stem = KERNELS.get((prologue, epilogue))
    if stem is None:
        raise LaunchError(f"decode_gemv: no kernel for prologue {prologue!r} with epilogue "
                          f"{epilogue!r}; compiled: {sorted(KERNELS)}")
    bt = _tile(B)
    shared = bt * K * 2 if prologue == "ln" else 0
    return Launch((ceil_div(N, R), ceil_div(B, bt)), (128,), shared=shared,
                  kernel=f"{stem}_b{bt}")


def rope_order(H: int, Hkv: int, D: int) -> np.ndarray:
    """The row order of W_qkv ((H + 2 Hkv) D rows: q heads, k heads, v heads) that puts the pair
    (i, i + D/2) of every head in rows 2p, 2p + 1, p = head * D/2 + i: index W_qkv with it."""
    if D % 2 or min(H, Hkv, D) < 1:
        raise ValueError(f"rope_order: H, Hkv >= 1 and an even D, got {H}, {Hkv}, {D}")
    heads, half = H + 2 * Hkv, D // 2
    j = np.repeat(np.arange(heads), half)
    i = np.tile(np.arange(half), heads)
    return np.stack([j * D + i, j * D + i + half], axis=1).reshape(-1)


def decode_gemv(x, W, out=None, *, ln=None, gelu: bool = False, residual=None, rope=None):
    """y = epilogue(prologue(x) @ W^T); see the module docstring. Returns ``out`` (store, gelu),
    ``residual`` (residual) or ``rope["q_out"]`` (rope)."""
    prologue = "ln" if ln is not None else "plain"
    epilogue = "rope" if rope is not None else "residual" if residual is not None else \
        "gelu" if gelu else "store"
    if sum(v is not None and v is not False for v in (rope, residual, gelu or None)) > 1:
        raise ValueError("decode_gemv: give one epilogue (gelu, residual or rope)")
    cb.expect(W, "W", dtype=np.float16, ndim=2)
    N, K = (int(s) for s in W.shape)
    cb.expect(x, "x", dtype=np.float32 if ln is not None else np.float16, ndim=2)
    B = int(x.shape[0])
    if int(x.shape[1]) != K:
        raise ValueError(f"x has {x.shape[1]} columns, W is {tuple(W.shape)}: W must be (N, K)")
    if not 1 <= B <= MAX_B:
        raise LaunchError(f"decode_gemv: {B} rows of x; it takes 1..{MAX_B}")
    if K % 8 or N < 1 or K < 8:
        raise LaunchError(f"decode_gemv reads 16 bytes at a time: K % 8 == 0 and N >= 1 "
                          f"(got N = {N}, K = {K})")
    if not all(cb.expect_aligned(a, n) for a, n in ((x, "x"), (W, "W"))):
        raise LaunchError("decode_gemv: x and W must start at 16-byte aligned addresses")
    cfg = config(prologue, epilogue, B, N, K)
    mod, arr, i32, f32 = cb.module("decode_gemv"), cb.as_cupy, np.int32, np.float32
    null = np.uint64(0)
    gamma = beta = null
    eps, ln_threads = 0.0, 0
    if ln is not None:
        gamma, beta, eps = ln
        cb.expect(gamma, "gamma", dtype=np.float32, shape=(K,))
        cb.expect(beta, "beta", dtype=np.float32, shape=(K,))
        if K > LN_MAX_K:
            raise LaunchError(f"decode_gemv: the LayerNorm prologue holds a row of at most "
                              f"{LN_MAX_K} in registers, got K = {K}")
        cb.launch.need_shared(cfg.get("shared", 0), cfg.kernel)
        gamma, beta, ln_threads = arr(gamma, "gamma"), arr(beta, "beta"), row_block(K)
    y = res = null
    if epilogue in ("store", "gelu"):
        if out is None:
            out = cb.arrays.empty_like_lib(W, (B, N), "float16")
        cb.expect(out, "out", dtype=np.float16, shape=(B, N))
        y = arr(out, "out")
    if epilogue == "residual":
        cb.expect(residual, "residual", dtype=np.float32, shape=(B, N))
        res = arr(residual, "residual")
    rp = (null, null, null, null, null, i32(0), i32(0), i32(0), i32(0), i32(0), i32(0), f32(0))
    if epilogue == "rope":
        q, kp, vp = rope["q_out"], rope["k_pool"], rope["v_pool"]
        bt, sl = rope["block_table"], rope["seq_lens"]
        cb.expect(q, "q_out", dtype=np.float16, ndim=3)
        _, H, D = (int(s) for s in q.shape)
        cb.expect(q, "q_out", dtype=np.float16, shape=(B, H, D))
        cb.expect(kp, "k_pool", dtype=np.float16, ndim=4)
        NB, Hkv, BS, Dk = (int(s) for s in kp.shape)
        cb.expect(vp, "v_pool", dtype=np.float16, shape=(NB, Hkv, BS, D))
        if Dk != D or D % 2 or Hkv < 1 or H % Hkv:
            raise LaunchError(f"decode_gemv rope: heads (H {H}, Hkv {Hkv}) and head dims (q {D}, "
                              f"pool {Dk}) do not fit: D even, H a multiple of Hkv")
        if N != (H + 2 * Hkv) * D:
            raise ValueError(f"decode_gemv rope: W has {N} rows; (H + 2 Hkv) D = "
                             f"{(H + 2 * Hkv) * D} (W_qkv in rope_order)")
        cb.expect(bt, "block_table", dtype=np.int32, ndim=2)
        if int(bt.shape[0]) != B:
            raise ValueError(f"block_table: {bt.shape[0]} rows for {B} requests")
        cb.expect(sl, "seq_lens", dtype=np.int32, shape=(B,))
        base = float(rope.get("base", 10000.0))
        if not base > 1:
            raise ValueError(f"RoPE base must be > 1, got {base}")
        rp = (arr(q, "q_out"), arr(kp, "k_pool"), arr(vp, "v_pool"), arr(bt, "block_table"),
              arr(sl, "seq_lens"), i32(H), i32(Hkv), i32(D), i32(NB), i32(BS),
              i32(int(bt.shape[1])), f32(math.log2(base)))
    args = (arr(x, "x"), arr(W, "W"), y, res, gamma, beta, f32(eps), i32(ln_threads), i32(B),
            i32(N), i32(K), *rp)
    with cb.arrays.launch_stream(x, W):
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return {"store": out, "gelu": out, "residual": residual,
            "rope": rope["q_out"] if rope else None}[epilogue]


def sanitize_targets():
    """Every compiled combination at a ragged batch (5 rows: tiles of 8, 3 padding rows), K 96,
    a rope epilogue on a pool with a GQA group of 2."""
    import cupy as cp

    rng = np.random.default_rng(0)
    B, K, H, Hkv, D, BS, MB, NB = 5, 96, 4, 2, 16, 4, 3, 16
    x32 = cp.asarray(rng.standard_normal((B, K)), dtype=cp.float32)
    x16 = x32.astype(cp.float16)
    g, be = cp.ones(K, cp.float32), cp.zeros(K, cp.float32)
    W = cp.asarray(rng.standard_normal((40, K)) / 10, dtype=cp.float16)
    y = cp.empty((B, 40), cp.float16)
    yield "dgemv_ln_store (5 rows)", lambda: decode_gemv(x32, W, y, ln=(g, be, 1e-5))
    yield "dgemv_ln_gelu (5 rows)", lambda: decode_gemv(x32, W, y, ln=(g, be, 1e-5), gelu=True)
    W2 = cp.asarray(rng.standard_normal((K, K)) / 10, dtype=cp.float16)
    yield "dgemv_plain_residual (5 rows)", lambda: decode_gemv(x16, W2, residual=x32)
    Wq = cp.asarray(rng.standard_normal(((H + 2 * Hkv) * D, K)) / 10, dtype=cp.float16)
    table = cp.asarray(rng.permutation(NB)[:B * MB].reshape(B, MB).astype(np.int32))
    lens = cp.asarray([1, 4, 5, 9, 12], dtype=cp.int32)
    pools = [cp.zeros((NB, Hkv, BS, D), cp.float16) for _ in range(2)]
    rope = dict(q_out=cp.empty((B, H, D), cp.float16), k_pool=pools[0], v_pool=pools[1],
                block_table=table, seq_lens=lens)
    yield "dgemv_ln_rope (5 rows, GQA 2)", lambda: decode_gemv(x32, Wq, ln=(g, be, 1e-5),
                                                               rope=rope)
