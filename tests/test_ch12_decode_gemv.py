"""The decode step's fused GEMVs (kernels/decode_gemv.cu): each epilogue against the unfused
kernels it replaces (gemv_v4, add_layernorm_v1, gelu_half_v1, paged_rope_append_v1) and against
float64, at ragged batches; the fused serving engine against the unfused one; the refusals and
the RoPE row order (on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import cudabook as cb

gpu = pytest.mark.gpu
dg = cb.load_launch("decode_gemv")


def test_rope_order_pairs_each_heads_halves():
    order = dg.rope_order(H=2, Hkv=1, D=4)
    # 4 heads (2 q, 1 k, 1 v) of D = 4: pairs (0, 2), (1, 3) of head 0, then (4, 6), (5, 7), ...
    assert order[:8].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert sorted(order.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="even D"):
        dg.rope_order(2, 1, 5)


def test_config_names_the_instantiation_and_refuses_other_pairs():
    cfg = dg.config("ln", "rope", B=5, N=2304, K=768)
    assert cfg.kernel == "dgemv_ln_rope_b8" and cfg.grid == (1152, 1)
    assert cfg.get("shared") == 8 * 768 * 2
    assert dg.config("plain", "residual", B=32, N=768, K=3072).grid == (384, 4)
    with pytest.raises(cb.LaunchError, match="no kernel"):
        dg.config("plain", "rope", 1, 8, 8)


def _rng_case(B, N, K, seed=0):
    import cupy as cp

    rng = np.random.default_rng(seed)
    x32 = cp.asarray(rng.standard_normal((B, K)) * 2 + 0.5, dtype=cp.float32)
    W = cp.asarray(rng.standard_normal((N, K)) / np.sqrt(K), dtype=cp.float16)
    g = cp.asarray(1 + rng.standard_normal(K) / 10, dtype=cp.float32)
    be = cp.asarray(rng.standard_normal(K) / 10, dtype=cp.float32)
    return x32, W, g, be


@gpu
@pytest.mark.parametrize("B", [1, 3, 8, 13, 32])
def test_ln_store_and_gelu_are_the_unfused_kernels(B):
    import cupy as cp

    res, gv, gh = (cb.load_launch(n) for n in ("residual", "gemv", "gelu_half"))
    x32, W, g, be = _rng_case(B, 520, 768, seed=B)
    h = cp.empty((B, 768), cp.float16)
    res.add_layernorm(x32.copy(), None, g, be, h, 1e-5)
    ref = gv.gemv(h, W)
    got = dg.decode_gemv(x32, W, ln=(g, be, 1e-5))
    assert bool((got == ref).all()), f"ln + store differs from add_layernorm + gemv: " \
        f"{int((got != ref).sum())} of {ref.size}"
    ref_g = gh.gelu_half(ref.copy())
    got_g = dg.decode_gemv(x32, W, ln=(g, be, 1e-5), gelu=True)
    assert bool((got_g == ref_g).all())
    # and against float64
    x = x32.get().astype(np.float64)
    hn = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    hn = hn * g.get() + be.get()
    cb.check(got, hn @ W.get().astype(np.float64).T, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("B", [1, 5, 32])
def test_residual_epilogue_adds_what_add_layernorm_would(B):
    import cupy as cp

    gv = cb.load_launch("gemv")
    _, W, _, _ = _rng_case(B, 768, 3072, seed=7)
    x32 = cp.asarray(np.random.default_rng(2).standard_normal((B, 768)), dtype=cp.float32)
    a = cp.asarray(np.random.default_rng(1).standard_normal((B, 3072)), dtype=cp.float16)
    want = x32 + gv.gemv(a, W).astype(cp.float32)
    got = x32.copy()
    dg.decode_gemv(a, W, residual=got)
    assert bool((got == want).all())


@gpu
@pytest.mark.parametrize("H, Hkv, D", [(12, 12, 64), (8, 2, 32)])
def test_rope_epilogue_is_gemv_then_paged_rope_append(H, Hkv, D):
    import cupy as cp

    pa, res, gv = (cb.load_launch(n) for n in ("paged_attention", "residual", "gemv"))
    B, BS, MB, NB, K = 5, 16, 4, 30, 256
    rng = np.random.default_rng(H)
    x32, _, g, be = _rng_case(B, 8, K, seed=H)
    Wqkv = cp.asarray(rng.standard_normal(((H + 2 * Hkv) * D, K)) / 16, dtype=cp.float16)
    table = cp.asarray(rng.permutation(NB)[:B * MB].reshape(B, MB).astype(np.int32))
    lens = cp.asarray([1, 16, 17, 33, 64], dtype=cp.int32)
    pools = [cp.full((NB, Hkv, BS, D), cp.nan, cp.float16) for _ in range(4)]
    q_ref, q_got = (cp.full((B, H, D), cp.nan, cp.float16) for _ in range(2))
    h = cp.empty((B, K), cp.float16)
    res.add_layernorm(x32.copy(), None, g, be, h, 1e-5)
    pa.rope_append(gv.gemv(h, Wqkv), q_ref, pools[0], pools[1], table, lens)
    order = cp.asarray(dg.rope_order(H, Hkv, D))
    dg.decode_gemv(x32, cp.ascontiguousarray(Wqkv[order]), ln=(g, be, 1e-5),
                   rope=dict(q_out=q_got, k_pool=pools[2], v_pool=pools[3], block_table=table,
                             seq_lens=lens))
    # RoPE's products may be contracted differently in the two kernels: one fp16 ulp apart at most
    def within_ulp(a, b):
        a32, b32 = a.astype(cp.float32), b.astype(cp.float32)
        ulp = cp.maximum(cp.abs(b32), 6.1e-5) * 2.0**-10
        return (cp.abs(a32 - b32) <= ulp) | (cp.isnan(a32) & cp.isnan(b32))
    assert bool(within_ulp(q_got, q_ref).all())
    for ref, got in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert bool(within_ulp(got, ref).all())           # untouched slots stay NaN


@gpu
def test_decode_gemv_refuses_bad_input():
    import cupy as cp

    x32, W, g, be = _rng_case(2, 16, 64)
    with pytest.raises(TypeError, match="float16"):
        dg.decode_gemv(x32, W)                          # plain prologue reads fp16
    with pytest.raises(cb.LaunchError, match="1..32"):
        dg.decode_gemv(cp.zeros((33, 64), cp.float16), W)
    with pytest.raises(cb.LaunchError, match="K % 8"):
        dg.decode_gemv(cp.zeros((2, 12), cp.float16), cp.zeros((16, 12), cp.float16))
    with pytest.raises(ValueError, match="one epilogue"):
        dg.decode_gemv(x32, W, ln=(g, be, 1e-5), gelu=True, residual=cp.zeros((2, 16), cp.float32))
    with pytest.raises(cb.LaunchError, match="at most"):
        big = cp.zeros((1, 4096), cp.float32)
        dg.decode_gemv(big, cp.zeros((8, 4096), cp.float16),
                       ln=(cp.ones(4096, cp.float32), cp.zeros(4096, cp.float32), 1e-5))


@gpu
def test_fused_engine_step_gives_the_unfused_engines_logits():
    import cupy as cp

    from cudabook import gpt, serving

    model = gpt.build(gpt.TINY, 4, "cuda")
    # four requests admitted together, two new tokens each: the prefill (the same kernels in both
    # engines) gives the first, one decode step of 4 rows the second
    reqs = serving.workload(4, vocab=256, prompt=(1, 40), new=(2, 2), seed=5)
    plain = serving.PagedGPT(model, slots=4, max_len=96, block_size=8)
    fused = serving.PagedGPT(model, slots=4, max_len=96, block_size=8, fused=True)
    a, b = plain.serve(reqs), fused.serve(reqs)
    assert [a.tokens[r.id][0] for r in reqs] == [b.tokens[r.id][0] for r in reqs]
    # that decode step's logits: RoPE one fp16 ulp apart (see serving's docstring) moves them by
    # far less than the fp16 tolerance of a 4-layer step
    la, lb = (e.bucket(4).logits.astype(cp.float32) for e in (plain, fused))
    scale = float(cp.sqrt((la**2).mean()))
    assert float(cp.abs(la - lb).max()) <= 0.02 * scale, "the fused step drifted from the unfused"
