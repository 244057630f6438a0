"""cudabook.quant_study (Chapter 10's accuracy study) on the CPU, at small shapes.

The int4 format against cudabook.quant's reference; GPTQ against round-to-nearest (it must win on
its calibration data, and equal it with an identity Hessian); AWQ at alpha = 0 equal to RTN;
SmoothQuant's folding exact in float64; per-token scales against per-tensor on an outlier row;
the outlier construction leaving the model's logits unchanged; the KV cache's rounding bound, its
decode loop against the full forward, and its byte count; every refusal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cudabook import gpt
from cudabook import quant as Q
from cudabook import quant_study as QS

CFG = gpt.GPTConfig(vocab=256, d=128, n_layer=2, n_head=2, ctx=32)   # head_dim 64, fc2 K = 512


def _model(dtype=torch.float32):
    return gpt.build(CFG, seed=3).to(dtype)


def _ids(n=8, seed=0):
    return torch.randint(0, 256, (n, CFG.ctx), generator=torch.Generator().manual_seed(seed))


def _layer(N=32, K=256, n=1024, seed=0):
    """Correlated inputs X (n, K) with 4 large channels, a weight W (N, K)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(K) + 2 * torch.randn(K, K, generator=g) / K ** 0.5
    X = torch.randn(n, K, generator=g) @ mix
    X[:, :4] *= 10
    return X, torch.randn(N, K, generator=g) * 0.02


def _err(X, W, Wh):
    ref = X.double() @ W.double().T
    return float((X.double() @ Wh.double().T - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- the int4 format
def test_round_to_nearest_is_the_chapters_format():
    W = torch.from_numpy(np.random.default_rng(1).standard_t(3, (24, 256)).astype(np.float32))
    W[3] = 0                                                      # an all-zero row: scale 1
    q, s = QS.quantize_groups(W, 4, 128)
    q_ref, s_ref, _ = Q.quantize_reference(W.numpy(), 4, 128)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (24, 2)
    np.testing.assert_array_equal(q.numpy(), q_ref)              # the kernels' q, bit for bit
    np.testing.assert_array_equal(s.numpy(), s_ref.astype(np.float16))   # stored as fp16
    assert (s[3] == 1).all() and (q[3] == 0).all()
    want = (q.float().view(24, 2, 128) * s.float()[..., None]).view(24, 256)
    assert torch.equal(QS.rtn(W), want) and torch.equal(QS.dequantize_groups(q, s, 128), want)


# ----------------------------------------------------------------------------- GPTQ
def test_gptq_beats_round_to_nearest_on_its_calibration_data():
    X, W = _layer()
    H = QS.hessian(X)
    for G in (64, 128):
        q, s = QS.gptq(W, H, 4, G)
        rtn, gq = _err(X, W, QS.rtn(W, 4, G)), _err(X, W, QS.dequantize_groups(q, s, G))
        assert gq < 0.75 * rtn, (G, rtn, gq)            # measured: about half of RTN's error
        assert int(q.abs().max()) <= 7 and s.dtype == torch.float16
    X2, _ = _layer(seed=0, n=1024)
    assert torch.equal(QS.gptq(W, QS.hessian(X2), 4, 128)[0], QS.gptq(W, H, 4, 128)[0])


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    _, W = _layer(N=16, K=256)
    for G, block in ((128, None), (32, 32), (32, 128), (256, None)):
        q, s = QS.gptq(W, torch.eye(256, dtype=torch.float64), 4, G, block=block)
        q0, s0 = QS.quantize_groups(W, 4, G)
        assert torch.equal(q, q0) and torch.equal(s, s0), (G, block)


def test_gptq_on_the_model_is_sequential_deterministic_and_in_format():
    m, ids = _model(), _ids()
    a, info = QS.quantize_weights(m, "gptq", ids)
    b, _ = QS.quantize_weights(m, "gptq", ids)
    assert set(info["weights"]) == set(QS.linear_names(m))
    for n, (q, s) in info["weights"].items():
        W = QS.get_linear(a, n).weight
        assert torch.equal(W, QS.dequantize_groups(q, s, 128)) and int(q.abs().max()) <= 7
        assert torch.equal(W, QS.get_linear(b, n).weight)
    assert torch.equal(QS.get_linear(m, "head").weight, _model().get_submodule("head").weight)


# ----------------------------------------------------------------------------- AWQ
def test_awq_with_alpha_zero_is_round_to_nearest():
    X, W = _layer()
    s, a, errs = QS.awq_search(W, X, 4, 128, alphas=(0.0,))
    assert a == 0.0 and torch.equal(s, torch.ones(256)) and len(errs) == 1
    m, ids = _model(), _ids()
    awq, info = QS.quantize_weights(m, "awq", ids, alphas=(0.0,))
    rtn, _ = QS.quantize_weights(m, "rtn")
    for n in QS.linear_names(m):
        assert torch.equal(QS.get_linear(awq, n).weight, QS.get_linear(rtn, n).weight), n
        assert info["alpha"][n] == 0.0
    with torch.no_grad():
        assert torch.equal(awq(ids), rtn(ids))


def test_awq_search_helps_where_the_inputs_have_large_channels():
    X, W = _layer()
    s, a, errs = QS.awq_search(W, X, 4, 128)
    assert len(errs) == len(QS.AWQ_ALPHAS) and min(errs) == errs[QS.AWQ_ALPHAS.index(a)]
    awq = _err(X, W, QS.rtn(W * s, 4, 128) / s)
    assert a > 0 and min(errs) < errs[0]                  # alpha = 0 (RTN) is on the grid
    assert awq < 0.9 * _err(X, W, QS.rtn(W, 4, 128))


def test_awq_search_agrees_with_the_chapters_numpy_reference():
    """Q.awq_scales (lesson 10's one-layer cell, float64, float32 scales) picks the same alpha and
    the same scales on the same grid, 0, 0.05, .., 1."""
    X, W = _layer(n=512)
    s, a, _ = QS.awq_search(W, X, 4, 128, alphas=tuple(i / 20 for i in range(21)))
    s_ref, a_ref = Q.awq_scales(X.double().numpy(), W.double().numpy(), 4, 128, grid=20)
    assert a == a_ref
    np.testing.assert_allclose(s.double().numpy(), s_ref, rtol=1e-6)


def test_awq_folds_keep_the_float_function():
    m, ids = _model(torch.float64), _ids()
    X = QS.capture_inputs(m, ids)
    f = m.eval()
    with torch.no_grad():
        ref = f(ids)
        for n in QS.linear_names(m):                     # x / s at every producer, W s
            s, _, _ = QS.awq_search(QS.get_linear(m, n).weight, X[n], 4, 128, alphas=(0.5,))
            QS.rescale_input(m, n, 1.0 / s.double())
        assert isinstance(m.blocks[0].fc2, QS.ScaledInput)  # GELU's output took a scale
        torch.testing.assert_close(m(ids), ref, rtol=1e-6, atol=1e-6)   # float32 logits


# ----------------------------------------------------------------------------- W8A8
def test_smoothquant_keeps_the_product_and_lowers_the_activation_max():
    X, W = _layer()
    s = QS.smooth_scales(X.abs().amax(0), W, 0.5)
    np.testing.assert_allclose(s.double().numpy(), Q.smooth_scales(X.abs().amax(0).double().numpy(),
                                                                    W.double().numpy(), 0.5),
                               rtol=1e-6)
    Xd, Wd, sd = X.double(), W.double(), s.double()
    ref = Xd @ Wd.T
    assert float(((Xd / sd) @ (Wd * sd).T - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    assert float((X / s).abs().max()) < float(X.abs().max()) / 5          # the range moved
    m, ids = _model(), _ids()
    plain = QS.w8a8_model(m, "tensor")
    sq = QS.w8a8_model(m, "tensor", smooth=0.5, calib=ids)
    assert isinstance(QS.get_linear(sq, "blocks.0.qkv"), QS.W8A8Linear)
    assert not torch.equal(sq.blocks[0].ln1.weight, plain.blocks[0].ln1.weight)   # folded
    s0 = QS.smooth_scales(QS.capture_absmax(m, ids)["blocks.0.qkv"], m.blocks[0].qkv.weight, 0.5)
    torch.testing.assert_close(sq.blocks[0].ln1.weight, m.blocks[0].ln1.weight / s0)


def test_w8a8_linear_is_the_int8_gemm_reference():
    X, W = _layer(N=17, K=96, n=33)
    for per in ("token", "tensor"):
        y = QS.W8A8Linear(W, per)(X.double())
        want = Q.w8a8_reference(X.numpy(), W.numpy(), per)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_per_token_scales_recover_an_outlier_row_better_than_per_tensor():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    x[5] *= 100.0
    err = {}
    for per in ("token", "tensor"):
        q, s = QS.quantize_act(x, per)
        assert s.shape == ((16, 1) if per == "token" else (1, 1)) and q.abs().max() <= 127
        rest = torch.arange(16) != 5                     # the 15 ordinary rows
        err[per] = float((q * s - x)[rest].norm() / x[rest].norm())
    assert err["token"] < err["tensor"] / 20, err


# ----------------------------------------------------------------------------- outliers
def test_outlier_construction_leaves_the_logits_unchanged():
    ids = _ids()      # float64 weights still rotate in float32 (RoPE) and return float32 logits
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 2e-5)):
        m = _model(dtype)
        out, where = QS.with_outliers(m, n=4, gain=50.0, sites=("ln1", "ln2", "ln_f", "k"))
        with torch.no_grad():
            a, b = m(ids), out(ids)
        assert float((a - b).abs().max()) <= tol * float(a.abs().max()), dtype
        assert len(where["channels"]) == 4 and len(where["key_pairs"]) == 4
    X0, X1 = QS.capture_inputs(m, ids), QS.capture_inputs(out, ids)
    for n in ("blocks.0.qkv", "blocks.1.fc", "head"):    # LayerNorm outputs: outliers now
        assert QS.channel_spread(X0[n]) < 5 and QS.channel_spread(X1[n]) > 20, n
    assert QS.channel_spread(X1["blocks.0.fc2"]) == pytest.approx(
        QS.channel_spread(X0["blocks.0.fc2"]), rel=1e-4)             # GELU's output: untouched
    k0, k1 = QS.key_absmax(m, ids), QS.key_absmax(out, ids)   # 2 layers x 4 pairs x 2 dims
    r = (k1 / k0).flatten()
    assert int((r > 20).sum()) == 2 * 4 * 2 and float(r.median()) == pytest.approx(1.0, rel=1e-4)
    assert QS.channel_spread(k0.flatten()) < 10 and QS.channel_spread(k1.flatten()) > 20
    again, w2 = QS.with_outliers(m, n=4, gain=50.0, sites=("ln1", "ln2", "ln_f", "k"))
    assert w2 == where and torch.equal(again.blocks[1].qkv.weight, out.blocks[1].qkv.weight)


def test_smoothquant_divides_the_layernorm_outliers_out():
    """With outliers at the LayerNorms (x_j * 50, W[:, j] / 50), SmoothQuant's s_j grows by 50 on
    those channels and nowhere else: the smoothed operands x / s and W s are the float model's."""
    m, ids = _model(torch.float64), _ids()
    out, where = QS.with_outliers(m)                      # ln1, ln2, ln_f
    a0, a1 = QS.capture_absmax(m, ids), QS.capture_absmax(out, ids)
    for n in ("blocks.0.qkv", "blocks.1.fc", "head"):
        s0 = QS.smooth_scales(a0[n], QS.get_linear(m, n).weight, 0.5).double()
        s1 = QS.smooth_scales(a1[n], QS.get_linear(out, n).weight, 0.5).double()
        want = torch.ones(128, dtype=torch.float64)
        want[where["channels"]] = 50.0
        torch.testing.assert_close(s1 / s0, want, rtol=1e-5, atol=0)
    assert where["key_pairs"] == [] and len(where["channels"]) == 4


# ----------------------------------------------------------------------------- KV cache
def test_kv_int8_and_int4_round_trip_error_bound():
    x = torch.randn(3, 2, 5, 64, generator=torch.Generator().manual_seed(4)) * 3
    x[..., 7] *= 40                                       # an outlier dimension
    for bits, G in ((8, None), (4, 64), (4, 16)):
        y = QS.kv_quantize(x, bits, G)
        g = x.reshape(*x.shape[:-1], -1, G or 64)
        s32 = g.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
        bound = s32 * (0.5 + (2 ** (bits - 1) - 1) * 2.0 ** -11) * (1 + 1e-6)  # fp16 scale
        assert bool(((y - x).reshape(g.shape).abs() <= bound).all()), (bits, G)
    assert torch.equal(QS.kv_quantize(x, None), x)
    assert torch.equal(QS.kv_quantize(x, 16), x.half().float())


def test_decode_matches_the_forward_and_quantized_caches_stay_close():
    m, ids = _model(), _ids(4)
    with torch.no_grad():
        full = m(ids)
    d32 = QS.decode_logits(m, ids, QS.KV_SCHEMES["fp32"], batch=3)
    torch.testing.assert_close(d32, full, rtol=1e-4, atol=1e-5)
    ref = QS.decode_logits(m, ids, QS.KV_SCHEMES["fp16"])
    tgt = torch.roll(ids, -1, 1)
    ks = QS.key_scales(m, _ids(4, seed=1), 8)
    assert ks.shape == (2, 2, 64) and bool((ks > 0).all())
    r8 = QS.compare(QS.decode_logits(m, ids, QS.KV_SCHEMES["int8"]), ref, tgt)
    r4 = QS.compare(QS.decode_logits(m, ids, QS.KV_SCHEMES["int4 g64"]), ref, tgt)
    rc = QS.compare(QS.decode_logits(m, ids, QS.KV_SCHEMES["int8 K/channel"], ks), ref, tgt)
    assert r8["kl"] < r4["kl"] and r8["agree"] > 0.95 and rc["agree"] > 0.9, (r8, r4, rc)


def test_kv_bytes():
    t = gpt.TINY                                          # 4 layers, d 256, 4 heads of 64
    assert QS.kv_bytes(t, QS.KV_SCHEMES["fp16"]) == 2 * 4 * 256 * 2
    assert QS.kv_bytes(t, QS.KV_SCHEMES["fp32"], 3) == 3 * 2 * 4 * 256 * 4
    assert QS.kv_bytes(t, QS.KV_SCHEMES["int8"]) == 4 * 2 * (256 + 4 * 2)   # a scale per head
    assert QS.kv_bytes(t, QS.KV_SCHEMES["int4 g64"], 10, 2) == 20 * 4 * 2 * (128 + 8)
    assert QS.kv_bytes(t, QS.KV_SCHEMES["int8 K/channel"], 100) == \
        4 * (100 * 256 + 2 * 256 + 100 * (256 + 8))      # static key scales counted once
    assert QS.kv_bytes(t, QS.KV_SCHEMES["int8 K/channel"], static=False) == 4 * (256 + 256 + 8)
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        QS.kv_bytes(t, QS.KV_SCHEMES["int8"], -1)


# ----------------------------------------------------------------------------- the kernels' input
def test_pack_for_qgemv():
    W = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    q, s = QS.quantize_groups(W)
    packed, sc = QS.pack_for_qgemv(q, s)
    assert packed.shape == (8, 128) and packed.dtype == np.uint8 and sc.dtype == np.float16
    np.testing.assert_array_equal(Q.unpack_int4_reference(packed, 8 * 256).reshape(8, 256),
                                  q.numpy())


# ----------------------------------------------------------------------------- refusals
def test_bad_input_is_refused():
    W = torch.randn(4, 96)
    with pytest.raises(ValueError, match="group size 128 does not divide K = 96"):
        QS.quantize_groups(W, 4, 128)
    with pytest.raises(ValueError, match="bits must be an int in 2..8"):
        QS.quantize_groups(W, 9, 32)
    with pytest.raises(ValueError, match="NaN or inf"):
        QS.rtn(torch.tensor([[1.0, float("nan")]]), 4, 2)
    with pytest.raises(ValueError, match="must be 2D"):
        QS.rtn(torch.ones(8), 4, 8)
    with pytest.raises(TypeError, match="float tensor"):
        QS.rtn(torch.ones(2, 8, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="above fp16's 65504"):
        QS.rtn(torch.full((1, 8), 1e6), 4, 8)
    with pytest.raises(ValueError, match=r"H must be a \(96, 96\)"):
        QS.gptq(W, torch.eye(95), 4, 32)
    with pytest.raises(ValueError, match="not positive definite"):
        QS.gptq(W, -torch.eye(96, dtype=torch.float64), 4, 32)
    with pytest.raises(ValueError, match="multiple of the group size"):
        QS.gptq(W, torch.eye(96), 4, 32, block=48)
    with pytest.raises(ValueError, match="damp"):
        QS.gptq(W, torch.eye(96), 4, 32, damp=1.5)
    with pytest.raises(ValueError, match="alphas"):
        QS.awq_search(W, torch.ones(5, 96), 4, 32, alphas=(1.5,))
    with pytest.raises(ValueError, match="X has K = 95"):
        QS.awq_search(W, torch.ones(5, 95), 4, 32)
    with pytest.raises(ValueError, match="per must be"):
        QS.quantize_act(torch.ones(2, 4), "channel")
    with pytest.raises(ValueError, match="shape"):
        QS.dequantize_groups(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 2), 32)
    m, ids = _model(), _ids(2)
    with pytest.raises(ValueError, match="method must be"):
        QS.quantize_weights(m, "hqq", ids)
    with pytest.raises(ValueError, match="needs calibration"):
        QS.quantize_weights(m, "gptq")
    with pytest.raises(ValueError, match="SmoothQuant needs calibration"):
        QS.w8a8_model(m, "token", smooth=0.5)
    with pytest.raises(ValueError, match="gain must be finite and > 0"):
        QS.with_outliers(m, gain=0.0)
    with pytest.raises(ValueError, match="n must be"):
        QS.with_outliers(m, n=1000)
    with pytest.raises(ValueError, match="unknown sites"):
        QS.with_outliers(m, sites=("ln3",))
    with pytest.raises(ValueError, match="unknown layer"):
        QS.get_linear(m, "blocks.7.fc")
    with pytest.raises(ValueError, match="finite and > 0"):
        QS.rescale_input(m, "blocks.0.fc", torch.zeros(128))
    with pytest.raises(TypeError, match="before quantizing"):
        QS.rescale_input(QS.w8a8_model(m), "blocks.0.fc", torch.ones(128))
    with pytest.raises(TypeError, match="the book's GPT"):
        QS.linear_names(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="token ids must be"):
        QS.capture_inputs(m, ids[0])
    with pytest.raises(ValueError, match="1..32 tokens"):
        QS.capture_inputs(m, torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="does not divide head_dim = 64"):
        QS.kv_quantize(torch.ones(2, 64), 8, 48)
    with pytest.raises(ValueError, match="need key_scales"):
        QS.decode_logits(m, ids, QS.KV_SCHEMES["int8 K/channel"])
    with pytest.raises(ValueError, match="need integer bits"):
        QS.decode_logits(m, ids, QS.KVScheme("bad", 16, keys="channel"))
    with pytest.raises(ValueError, match="odd"):
        QS.pack_for_qgemv(torch.zeros(2, 3, dtype=torch.int8), torch.ones(2, 1), 3)
    with pytest.raises(ValueError, match="n_eval must be a positive int"):
        QS.study_tokens(0)
    with pytest.raises(ValueError, match="shapes"):
        QS.compare(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_the_chapters_int4_kernels_run_what_the_methods_write():
    """RTN's weights are qgemv_launch.prepare()'s bit for bit; a GPTQ layer packed by to_qweight
    goes through qgemv (v3, and v7 where the GPU has it) to fp16 rounding of x W^T."""
    import cudabook as cb

    qg = cb.load_launch("qgemv")
    X, W = _layer(N=48, K=384, n=512)
    X, W = X.cuda(), W.cuda()
    theirs = torch.from_dlpack(qg.prepare(W.contiguous(), bits=4, group=128).dequantized())
    assert torch.equal(theirs, QS.rtn(W))
    q, s = QS.gptq(W, QS.hessian(X), 4, 128)
    x = X[:3].half().contiguous()
    ref = x.double() @ QS.dequantize_groups(q, s).double().T
    for ver in ("qgemv_w4_v3", "qgemv_w4_v7"):
        if qg.supports(ver, 3, 384, 128):
            y = qg.qgemv(x, QS.to_qweight(q, s), version=ver)
            assert float((y.double() - ref).norm() / ref.norm()) < 2e-3, ver
