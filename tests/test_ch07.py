"""Chapter 7: the tiny GPT (cudabook.gpt) and its KV cache in PyTorch, the Numba twins of RoPE and
the KV-cache append (simulator), the graders ex07_1..ex07_3 (reference passes, stub fails, wrong
answers generated from the reference fail with their hint) and, on a GPU, every CUDA C++ kernel
of the chapter against float64/PyTorch references and the own-kernel decoder against PyTorch."""
# ruff: noqa: I001  (cudabook must be imported before numba.cuda)

import math

import numpy as np
import pytest

import cudabook as cb  # first: decides GPU or simulator mode
from cudabook import gpt
from cudabook.graders import GradeError, ex07_1, ex07_2, ex07_3, ex07_4
from cudabook.graders.ch07 import (decode_attention_reference, decode_reference, rope_reference,
                                   topk_reference)
from solution_cells import Solution, check_exercise_page

torch = pytest.importorskip("torch")
SOL = Solution("07")
gpu = pytest.mark.gpu
SIM_ONLY = pytest.mark.simulator   # a wrong answer only the simulator shows
SMALL = gpt.GPTConfig(vocab=256, d=128, n_layer=2, n_head=2, ctx=64)


# ============================================================================ cudabook.gpt
def test_build_is_deterministic_and_sized():
    a, b = gpt.build(SMALL, seed=3), gpt.build(SMALL, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert sum(p.numel() for p in a.parameters()) == SMALL.params()
    g2 = gpt.GPT2_SMALL
    assert g2.d == 768 and g2.n_layer == 12 and g2.head_dim == 64 and g2.vocab == 50257


def test_kv_cache_decode_equals_full_forward():
    m = gpt.build(SMALL, seed=1)
    prompt = gpt.encode("def f(x):")
    new, steps = m.generate(prompt, 12, return_logits=True)
    full = m(torch.cat([prompt, new])[None])[0, len(prompt) - 1:-1]
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=1e-4)
    assert torch.equal(new, full.argmax(-1))


def test_rope_tables_are_half_split():
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    cos, sin = gpt.rope_tables(gpt.GPTConfig(d=8, n_head=1), 5)
    got = gpt._rope(x, cos.double(), sin.double())[0, 0].numpy()
    ref = rope_reference(x[0, 0, :, None].numpy(), np.arange(5))[:, 0]
    np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("ids, msg", [
    ([], "empty prompt"),
    ([1, 256], "token id 256 is outside the vocabulary"),
    ([-1, 3], "token id -1 is outside"),
    (list(range(64)) * 2, "do not fit the cache"),
])
def test_bad_input_is_refused(ids, msg):
    m = gpt.build(SMALL)
    with pytest.raises(ValueError, match=msg):
        m(torch.tensor([ids], dtype=torch.long).reshape(1, -1))


def test_generate_refuses_running_past_the_cache():
    with pytest.raises(ValueError, match="longer than the cache"):
        gpt.build(SMALL).generate(gpt.encode("x" * 60), 10)


def test_corpus_split_and_perplexity():
    data = gpt.corpus(1 << 18)
    assert len(data) == 1 << 18 and data.startswith(b"# file: ")
    train, held = gpt._split(data)
    assert train + held == data and 0.04 < len(held) / len(data) < 0.06
    h = gpt.heldout(1000, 1 << 18)
    assert h.dtype == torch.long and len(h) == 1000 and bytes(h.tolist()) == held[:1000]
    r = gpt.perplexity(gpt.build(SMALL), h, ctx=64)
    assert r["tokens"] == 960 and math.isclose(r["perplexity"], math.exp(r["nats"]))
    assert 4.5 < r["nats"] < 6.5      # random weights: about log(256) = 5.5


def test_load_tiny_without_training_is_random_and_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDABOOK_CACHE", str(tmp_path))
    m, how = gpt.load_tiny(device="cpu", train_if_missing=False)
    assert how == "random" and "deterministic random" in capsys.readouterr().out
    torch.save(m.state_dict(), gpt.cache_path(gpt.TINY))
    m2, how2 = gpt.load_tiny(device="cpu")
    assert how2 == "cache" and all(torch.equal(a, b) for a, b in
                                   zip(m.state_dict().values(), m2.state_dict().values()))


@pytest.mark.simulator
def test_decoder_needs_a_gpu():
    from cudabook import decoder

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        decoder.KernelGPT(gpt.build(SMALL))



# ============================================================================ PyTorch, run fast
def test_static_cache_step_matches_the_forward():
    """The static-cache step (position on the device, index_copy_, mask over the full cache)
    gives the logits of the model's own forward, for 3 positions, on the CPU in float32."""
    from cudabook import decoder

    m = gpt.build(SMALL, seed=1)
    ids = torch.randint(0, SMALL.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    sd = decoder.StaticCacheDecoder(m, 2, length=20)
    first = sd.prefill(ids)[:, -1]
    seq, steps = ids, [sd.logits.clone()]
    for _ in range(3):
        seq = torch.cat([seq, sd.tok], 1)
        sd.step()
        steps.append(sd.logits.clone())
    assert int(sd.pos) == 12 and sd.host_pos == 9        # step() alone leaves host_pos alone
    with torch.no_grad():
        full = m(seq)[:, 8:12]                            # logits at positions 8..11, no cache
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first, full[:, 0], atol=1e-4, rtol=1e-4)
    err, frac = decoder.compare_static(m, ids, steps=3)
    assert err < 1e-4 and frac < 0.05


def test_static_cache_refuses_bad_input():
    from cudabook import decoder

    m = gpt.build(SMALL)
    with pytest.raises(ValueError, match="does not fit the static cache"):
        decoder.StaticCacheDecoder(m, 1, length=16).prefill(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \(2, T\)"):
        decoder.StaticCacheDecoder(m, 2).prefill(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="RoPE tables"):
        decoder.StaticCacheDecoder(m, 1, length=SMALL.ctx + 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.StaticCacheDecoder(m, 1).prefill(torch.tensor([[1, 999]]))
    sd = decoder.StaticCacheDecoder(m, 1, length=8)
    sd.prefill(torch.arange(6)[None])
    run = sd.runner(sd.step)
    run()
    run()
    with pytest.raises(ValueError, match="run past the static cache of 8"):
        run()
    decoder.check_next_token(sd.logits, sd.tok)
    bad = sd.logits.clone()
    bad[0, 3] = bad.max() + 1
    with pytest.raises(cb.CheckError, match="not with the largest logit's"):
        decoder.check_next_token(bad, sd.tok)
    bad[0, 5] = float("nan")
    with pytest.raises(cb.CheckError, match="NaN"):
        decoder.check_next_token(bad, sd.tok)


def test_timed_step_checks_before_and_after_and_resets(monkeypatch):
    """timed_step: one checked call from the reset state, the timing from it, one checked call
    after; a failed check raises and no time comes back."""
    from cudabook import decoder

    log = []
    monkeypatch.setattr(decoder, "per_step_us", lambda step, n: log.append(f"time {n}") or 7.0)
    step, reset = (lambda: log.append("step")), (lambda: log.append("reset"))
    assert decoder.timed_step(step, reset, lambda when: log.append(when), n=5) == 7.0
    assert log == ["reset", "step", "before timing", "reset", "time 5", "reset", "step",
                   "after timing", "reset"]

    def check(when):
        if when == "after timing":
            raise cb.CheckError("wrong token")

    with pytest.raises(cb.CheckError, match="wrong token"):
        decoder.timed_step(step, reset, check, n=5)


def test_static_cache_step_us_decodes_the_same_positions_each_run(monkeypatch):
    """StaticCacheDecoder.step_us on the CPU (the graph capture and the clock replaced): every
    run starts at the prefill's position and token, and both are restored afterwards."""
    from cudabook import decoder

    m = gpt.build(SMALL, seed=2)
    sd = decoder.StaticCacheDecoder(m, 1, length=24)
    sd.prefill(torch.arange(5, 13)[None])
    tok0, starts = sd.tok.clone(), []

    def per_step_us(step, n):
        starts.append((int(sd.pos), int(sd.tok)))
        for _ in range(n + 2):                      # per_step_us's 2 warm-up calls, then n
            step()
        return 3.0

    monkeypatch.setattr(decoder, "per_step_us", per_step_us)
    monkeypatch.setattr(sd, "capture", lambda compiled=False: (sd.runner(sd.step, "eager"), None))
    assert sd.step_us(n=4) == (3.0, None)
    assert starts == [(8, int(tok0))] and sd.host_pos == 8 and int(sd.pos) == 8
    assert torch.equal(sd.tok, tok0)
    with pytest.raises(ValueError, match="run past the static cache"):
        sd.step_us(n=20)                            # 8 + 20 + 3 > 24


def test_step_bytes_counts_the_model_tensors():
    from cudabook import decoder

    m = gpt.build(gpt.GPT2_SMALL, dtype=torch.float16)
    b = decoder.step_bytes(m, 1, 512)
    ln = 2 * (2 * gpt.GPT2_SMALL.n_layer + 1) * 768        # LayerNorm weights and biases
    assert b["weights"] == decoder.weight_bytes(gpt.GPT2_SMALL) + 2 * (ln + 768)
    assert b["cache"] == decoder.cache_bytes(gpt.GPT2_SMALL, 512, 1)
    assert decoder.step_bytes(m, 32, 512)["cache"] == 32 * b["cache"]

# ============================================================================ Numba twins
@pytest.mark.parametrize("R, H, D", [(1, 1, 2), (3, 2, 6), (5, 3, 16)])
def test_numba_rope_v1(R, H, D):
    rp = cb.load_numba("rope")
    rng = np.random.default_rng(R)
    x = rng.standard_normal((R, H, D)).astype(np.float32)
    pos = rng.integers(0, 2000, R).astype(np.int32)
    ref = rope_reference(x, pos)
    d = x
    if cb.HAS_GPU:
        from numba import cuda

        d = cuda.to_device(x)
        rp.rope(d, cuda.to_device(pos))
        got = d.copy_to_host()
    else:
        rp.rope(d, pos)
        got = d
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_numba_kv_append_v1():
    kv = cb.load_numba("kvcache")
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    v = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    kc, vc = np.full((2, 2, 9, 4), 7, np.float32), np.full((2, 2, 9, 4), 7, np.float32)
    dev = (lambda a: a) if not cb.HAS_GPU else __import__("numba").cuda.to_device
    dk, dv = dev(kc), dev(vc)
    kv.kv_append(dev(k), dev(v), dk, dv, 5)
    if cb.HAS_GPU:
        kc, vc = dk.copy_to_host(), dv.copy_to_host()
    np.testing.assert_array_equal(kc[:, :, 5:8], k.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(vc[:, :, 5:8], v.transpose(0, 2, 1, 3))
    assert (kc[:, :, :5] == 7).all() and (kc[:, :, 8:] == 7).all()
    with pytest.raises(cb.LaunchError, match="do not fit the cache"):
        kv.kv_append(dev(k), dev(v), dk, dv, 7)


# ============================================================================ references
def test_decode_reference_is_causal_attention():
    rng = np.random.default_rng(0)
    B, H, L, D, pos = 1, 2, 6, 4, 3
    q, kn, vn = (rng.standard_normal((B, H, D)) for _ in range(3))
    kc, vc = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, L, D))
    o, k2, v2 = decode_reference(q, kc, vc, kn, vn, pos, 0.5)
    t = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q)[:, :, None], torch.from_numpy(k2[:, :, :pos + 1]),
        torch.from_numpy(v2[:, :, :pos + 1]), scale=0.5)[:, :, 0].numpy()
    np.testing.assert_allclose(o, t, atol=1e-12)


def test_topk_reference_distribution_and_ties():
    z = np.array([[2.0, 1.0, 0.5, 0.5, -1.0, 3.0]])
    us = (np.arange(1000) + 0.5) / 1000
    got = np.array([topk_reference(z, [u], 1 / 0.7, 4)[0][0] for u in us])
    p = np.exp(z[0, [5, 0, 1, 2]] / 0.7)
    p /= p.sum()
    for tok, pr in zip([5, 0, 1, 2], p):
        assert abs((got == tok).mean() - pr) < 2e-3
    assert 3 not in got                     # tie at 0.5: id 2 is kept, id 3 is not


# ============================================================================ ex07_1
def test_ex07_1_reference_passes(capsys):
    ex07_1(SOL.get("ex07.1", "rope"))
    assert capsys.readouterr().out == "PASS ex07.1\n"


@pytest.mark.parametrize("edits, hint", [
    ([("a, b = x[r, h, i], x[r, h, i + half]", "a, b = x[r, h, 2 * i], x[r, h, 2 * i + 1]"),
      ("out[r, h, i] = a * c - b * s", "out[r, h, 2 * i] = a * c - b * s"),
      ("out[r, h, i + half] = b * c + a * s", "out[r, h, 2 * i + 1] = b * c + a * s")],
     "interleaved pairs"),
    ([("c, s = math.cos(ang), math.sin(ang)", "c, s = math.cos(ang), -math.sin(ang)")],
     "rotated by -angle"),
    ([("base ** (-2.0 * i / D)", "base ** (-1.0 * i / D)")], "exponent is -2i/D"),
    ([("ang = pos[r] *", "ang = r *")], "row index, not pos"),
    ([("        out[r, h, i + half] = b * c + a * s\n", "")], "second half of each head"),
    pytest.param([("    if t < R * H * half:\n", "    if True:\n")], "guard|index out of range",
                 marks=SIM_ONLY),
    # a variable overwritten before its second use: y[i + D/2] from the rotated y[i]
    ([("        out[r, h, i] = a * c - b * s\n        out[r, h, i + half] = b * c + a * s",
       "        a = a * c - b * s\n        b = b * c + a * s\n        out[r, h, i] = a\n"
       "        out[r, h, i + half] = b")], "already rotated y.i."),
    ([("base ** (-2.0 * i / D)", "base ** (-2.0 * i / half)")], r"not D/2"),
    ([("base ** (-2.0 * i / D)", "base ** (-2 * i // D)")], "integer division"),
    # a library call inside the kernel: runs in the simulator, does not compile on a GPU
    ([("c, s = math.cos(ang), math.sin(ang)", "c, s = np.cos(ang), np.sin(np.array([ang]))[0]")],
     r"np.array \(NumPy\).*GPU cannot compile"),
])
def test_ex07_1_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex07_1(SOL.get("ex07.1", "rope", edits=edits))


def test_ex07_1_stub_fails():
    from numba import cuda

    @cuda.jit
    def stub(x, pos, out, base):
        raise NotImplementedError("ex07.1")
    with pytest.raises(GradeError, match="not implemented yet|never written|nothing was written"):
        ex07_1(stub)


# ============================================================================ ex07_2
def test_ex07_2_reference_passes(capsys):
    ex07_2(SOL.get("ex07.2", "decode_step"))
    assert capsys.readouterr().out == "PASS ex07.2\n"


@pytest.mark.parametrize("edits, hint", [
    ([("for j in range(pos + 1):", "for j in range(kc.shape[2]):", 2)], "see the future"),
    ([("for j in range(pos + 1):", "for j in range(pos + 2):", 2)], "sees the future"),
    ([("for j in range(pos + 1):", "for j in range(pos):", 2)], "must also see itself"),
    ([("kc[b, h, pos, t] = k_new[b, h, t]", "kc[b, h, pos + 1, t] = k_new[b, h, t]")],
     "wrong position"),
    ([("s += q[b, h, c] * kc[b, h, j, c]\n        m = max(m, s * scale)",
       "s += q[b, h, c] * kc[b, h, j, c]\n        m = max(m, s)"),
      ("p = math.exp(s * scale - m)", "p = math.exp(s - m)")], "not multiplied by scale"),
    ([("    out[b, h, t] = acc / l", "    if t > 0:\n        out[b, h, t] = acc / l")],
     "some elements of out never written"),
    pytest.param([("    cuda.syncthreads()\n", "")], "syncthreads|old row", marks=SIM_ONLY),
    # extreme scores: the max must start at -inf, and be subtracted before exp
    ([("    m = -math.inf\n", "    m = 0.0\n")], r"near -1000.*start it at -inf"),
    ([("        p = math.exp(s * scale - m)", "        p = math.exp(s * scale)")],
     r"overflowed .*subtract\s+the largest score"),
    # a barrier inside divergent code: thread 0 writes the row, and only it waits
    ([("    kc[b, h, pos, t] = k_new[b, h, t]\n    vc[b, h, pos, t] = v_new[b, h, t]\n"
       "    cuda.syncthreads()\n",
       "    if t == 0:\n        for c in range(D):\n            kc[b, h, pos, c] = k_new[b, h, c]\n"
       "            vc[b, h, pos, c] = v_new[b, h, c]\n        cuda.syncthreads()\n")],
     r"inside the branch .* differs between the threads.*Every thread of the block must reach"),
    ([("    cuda.syncthreads()\n", "    if t >= D:\n        return\n    cuda.syncthreads()\n")],
     "after the return on line .* only some threads"),
    # a library call for the dot product
    ([("        s = 0.0\n        for c in range(D):\n            s += q[b, h, c] * kc[b, h, j, c]\n"
       "        m = max(m, s * scale)",
       "        s = np.dot(q[b, h], kc[b, h, j])\n        m = max(m, s * scale)")],
     r"np.dot \(NumPy\)"),
])
def test_ex07_2_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex07_2(SOL.get("ex07.2", "decode_step", edits=edits))


def test_ex07_2_stub_fails():
    from numba import cuda

    @cuda.jit
    def stub(q, k_new, v_new, kc, vc, pos, out, scale):
        raise NotImplementedError("ex07.2")
    with pytest.raises(GradeError, match="not implemented yet|nothing was written"):
        ex07_2(stub)


# ============================================================================ ex07_3
def test_ex07_3_reference_passes(capsys):
    ex07_3(SOL.get("ex07.3", "sample_topk"))
    assert capsys.readouterr().out == "PASS ex07.3\n"


@pytest.mark.parametrize("edits, hint", [
    ([("p[r] = math.exp((p[r] - zmax) * inv_temp)", "p[r] = math.exp(p[r] - zmax)")],
     "ignores temperature"),
    ([("(v == bv and j < bi)", "(v == bv and j > bi)"),
      ("(v == last_v and j > last_i)", "(v == last_v and j < last_i)")], "lower id first"),
    ([("if target < c:", "if u[b] * tot - target < c:")], "greedy decoding"),
    ([("        out[b] = choice", "        if b % 2 == 0:\n            out[b] = choice")],
     "some rows never written"),
    pytest.param([("    if b < z.shape[0]:\n", "    if True:\n")], "guard|index out of range",
                 marks=SIM_ONLY),
    # logits x 1/T beyond the range of exp: no z_max subtracted
    ([("p[r] = math.exp((p[r] - zmax) * inv_temp)", "p[r] = math.exp(p[r] * inv_temp)")],
     r"about \+-1200.*subtract the largest logit"),
    ([("p[r] = math.exp((p[r] - zmax) * inv_temp)",
       "p[r] = math.exp((p[r] - zmax) / inv_temp)")],
     "divided by inv_temp"),
    ([("after = v < last_v or (v == last_v and j > last_i)", "after = v < last_v")],
     "equal logits were skipped"),
    # the library sorts: works in the simulator only
    ([("        last_v, last_i = math.inf, -1\n",
       "        order = np.argsort(-z[b])\n        last_v, last_i = math.inf, -1\n")],
     r"np.argsort \(NumPy\)"),
])
def test_ex07_3_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex07_3(SOL.get("ex07.3", "sample_topk", edits=edits))


def test_ex07_3_hint_for_sampling_from_all_tokens():
    from cudabook.graders.ch07 import _topk_hint

    rng = np.random.default_rng(4)
    z = rng.standard_normal((6, 30)).astype(np.float32)
    u = rng.random(6).astype(np.float32)
    got = topk_reference(z, u, 1.0, 30)[0]
    assert "keep only the k largest" in _topk_hint(got, z, u, 1.0, 3, 30)


def test_ex07_3_stub_fails():
    from numba import cuda

    @cuda.jit
    def stub(z, u, inv_temp, k, out):
        raise NotImplementedError("ex07.3")
    with pytest.raises(GradeError, match="not implemented yet|nothing was written"):
        ex07_3(stub)


# ============================================================================ GPU: CUDA C++
def _t(a):
    import cupy as cp

    return torch.as_tensor(cp.asnumpy(a))


@gpu
def test_cuda_rope_and_rope_qkv():
    import cupy as cp

    rl = cb.load_launch("rope")
    B, T, H, D, L = 2, 5, 3, 64, 40
    cfg = gpt.GPTConfig(d=H * D, n_head=H)
    cos, sin = gpt.rope_tables(cfg, L)
    x = cp.random.standard_normal((B * T, H, D), dtype=cp.float32).astype(cp.float16)
    ref = rope_reference(cp.asnumpy(x).astype(np.float64), np.tile(np.arange(3, 3 + T), B))
    rl.rope(x, 3, T)
    np.testing.assert_allclose(cp.asnumpy(x).astype(np.float64), ref, atol=3e-3, rtol=3e-3)
    qkv = cp.random.standard_normal((B * T, 3 * H * D), dtype=cp.float32).astype(cp.float16)
    q, ko, vo = (cp.full((B, H, T, D), np.nan, cp.float16) for _ in range(3))
    kc, vc = cp.zeros((B, H, L, D), cp.float16), cp.zeros((B, H, L, D), cp.float16)
    rl.rope_qkv(qkv, q, kc, vc, 7, None, ko, vo)
    t = _t(qkv).double().view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
    rq, rk = (gpt._rope(t[i], cos[7:7 + T].double(), sin[7:7 + T].double()) for i in (0, 1))
    for got, want in ((q, rq), (ko, rk), (kc[:, :, 7:7 + T], rk), (vc[:, :, 7:7 + T], t[2]),
                      (vo, t[2])):
        torch.testing.assert_close(_t(got).double(), want, atol=3e-3, rtol=3e-3)
    assert float(abs(kc[:, :, :7]).max()) == 0 and float(abs(kc[:, :, 7 + T:]).max()) == 0
    with pytest.raises(cb.LaunchError, match="do not fit the cache"):
        rl.rope_qkv(qkv, q, kc, vc, L - 2)


@gpu
@pytest.mark.parametrize("version", ["decode_attention_v1", "decode_attention_v2"])
@pytest.mark.parametrize("B, H, L, D, n", [(1, 1, 8, 64, 1), (2, 3, 70, 64, 67),
                                           (3, 2, 300, 128, 300)])
def test_cuda_decode_attention(version, B, H, L, D, n):
    import cupy as cp

    kl = cb.load_launch("kvcache")
    kc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
    vc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((B, H, D), dtype=cp.float32).astype(cp.float16)
    out = cp.full((B, H * D), np.nan, cp.float16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        _t(q).double()[:, :, None], _t(kc).double()[:, :, :n], _t(vc).double()[:, :, :n]
    )[:, :, 0].reshape(B, -1)
    kl.decode_attention(q, kc, vc, out, n, version=version)
    torch.testing.assert_close(_t(out).double(), ref, atol=3e-3, rtol=3e-3)
    out[...] = np.nan
    kl.decode_attention(q, kc, vc, out, 0, cp.asarray([n - 1], cp.int32), version=version)
    torch.testing.assert_close(_t(out).double(), ref, atol=3e-3, rtol=3e-3)


@gpu
def test_cuda_sampling_greedy_ties_and_topk():
    import cupy as cp

    sl = cb.load_launch("sampling")
    z = cp.asarray(np.array([[1, 3, 3, 2, -1]] * 3, np.float16))
    assert sl.sample(z, cp.zeros(3, cp.float32), temperature=0).tolist() == [1, 1, 1]
    zz = cp.random.standard_normal((4, 50257), dtype=cp.float32).astype(cp.float16)
    assert sl.sample(zz, cp.zeros(4, cp.float32), temperature=0).tolist() == \
        _t(zz).float().argmax(-1).tolist()
    rng = np.random.default_rng(0)
    zr = rng.standard_normal((64, 300)).astype(np.float16)
    zr[:, 5] = zr[:, 9] = zr.max(1)
    u = rng.random(64).astype(np.float32)
    got = sl.sample(cp.asarray(zr), cp.asarray(u), temperature=0.8, top_k=7).get()
    ref = topk_reference(zr.astype(np.float64), u, 1 / 0.8, 7)[0]
    assert (got == ref).mean() > 0.95          # float32 sums vs float64 at a boundary: rare
    for bad in (dict(top_k=0), dict(top_k=65), dict(temperature=-1), dict(top_p=0)):
        with pytest.raises(ValueError):
            sl.sample(cp.asarray(zr), cp.asarray(u), **bad)
    # float32 logits (a PyTorch head's) are taken, the same choice as their fp16 copy; values
    # past fp16's range are refused rather than read as infinity
    z32 = torch.as_tensor(zr.astype(np.float32), device="cuda")
    assert sl.sample(z32, cp.asarray(u), temperature=0.8, top_k=7).get().tolist() == got.tolist()
    z32[3, 4] = 7e4
    with pytest.raises(ValueError, match="beyond fp16's range"):
        sl.sample(z32, cp.asarray(u), temperature=0)


@gpu
def test_cuda_residual_gelu_embedding_merge():
    import cupy as cp

    rs, gl = cb.load_launch("residual"), cb.load_launch("gelu_half")
    M, N = 7, 768
    x = cp.random.standard_normal((M, N), dtype=cp.float32)
    dx = cp.random.standard_normal((M, N), dtype=cp.float32).astype(cp.float16)
    g = cp.random.uniform(0.5, 1.5, N, dtype=cp.float32)
    b = cp.random.standard_normal(N, dtype=cp.float32)
    y = cp.empty((M, N), cp.float16)
    x0 = _t(x).double() + _t(dx).double()
    rs.add_layernorm(x, dx, g, b, y)
    ref = torch.nn.functional.layer_norm(x0, (N,), _t(g).double(), _t(b).double(), 1e-5)
    torch.testing.assert_close(_t(y).double(), ref, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(_t(x).double(), x0, atol=1e-6, rtol=1e-6)
    f = cp.random.standard_normal((3, 3072), dtype=cp.float32).astype(cp.float16)
    ref = torch.nn.functional.gelu(_t(f).double(), approximate="tanh")
    gl.gelu_half(f)
    torch.testing.assert_close(_t(f).double(), ref, atol=2e-3, rtol=2e-3)
    el = cb.load_launch("embedding")
    wte = cp.random.standard_normal((50, 8), dtype=cp.float32).astype(cp.float16)
    tok = cp.asarray([3, 49, 0], cp.int32)
    assert bool((el.embedding(tok, wte) == wte[tok].astype(cp.float32)).all())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        el.embedding(cp.asarray([50], cp.int32), wte)
    # PyTorch's int64 ids are taken; bad ones are refused, or (unchecked) give NaN rows, never
    # another token's row
    t64 = torch.tensor([3, 49, 0], device="cuda")
    assert bool((el.embedding(t64, wte) == wte[tok].astype(cp.float32)).all())
    with pytest.raises(ValueError, match="token id -1 is outside"):
        el.embedding(torch.tensor([2, -1], device="cuda"), wte)
    for bad in (cp.asarray([1, 50, -3], cp.int32), torch.tensor([1, 2**40, -3], device="cuda")):
        x = el.embedding(bad, wte, check_ids=False)
        assert bool((x[0] == wte[1].astype(cp.float32)).all()) and bool(cp.isnan(x[1:]).all())
    o = cp.random.standard_normal((2, 3, 5, 4), dtype=cp.float32).astype(cp.float16)
    yy = cp.empty((10, 12), cp.float16)
    cb.load_launch("kvcache").merge_heads(o, yy)
    assert torch.equal(_t(yy), _t(o).transpose(1, 2).reshape(10, 12))


@gpu
def test_kernel_gpt_matches_pytorch_and_refuses_bad_input():
    from cudabook import decoder

    cfg = gpt.GPTConfig(vocab=256, d=128, n_layer=2, n_head=2, ctx=96)
    m = gpt.build(cfg, seed=2, device="cuda")
    prompt = gpt.encode("for i in range(")
    new, ref = m.generate(prompt, 24, return_logits=True)
    for graph in (False, True):
        run = decoder.KernelGPT(m, 1)
        ids, lg = run.generate(prompt, 24, graph=graph)
        err = np.abs(lg[:, 0] - ref.cpu().numpy()).max()
        assert err < 0.05 and (ids[0] == new.numpy()).mean() > 0.9, (graph, err)
    run = decoder.KernelGPT(m, 1)
    for ids, msg in (([[]], "empty prompt"), ([[300]], "outside the vocabulary"),
                     ([list(range(100))], "does not fit the cache")):
        with pytest.raises(ValueError, match=msg):
            run.prefill(np.array(ids, dtype=np.int64).reshape(1, -1))
    run.prefill(np.arange(90)[None])
    with pytest.raises(ValueError, match="run past the cache"):
        run.decode(10)


@gpu
def test_sanitize_targets_run():
    for mod in ("kvcache", "sampling", "residual"):
        names = []
        for name, launch in cb.load_launch(mod).sanitize_targets():
            launch()
            names.append(name)
        assert names, mod



# ============================================================================ ex07_4 (CUDA C++)
def attn_src(*edits):
    return SOL.get("ex07.4", "decode_attn_src", edits=edits)


ATTN_SYNC = "    __syncthreads();\n    float M = NEG_INF"


def test_decode_attention_reference_is_masked_softmax():
    rng = np.random.default_rng(2)
    q, kc, vc = rng.standard_normal((3, 8)), rng.standard_normal((3, 10, 8)), rng.standard_normal(
        (3, 10, 8))
    lens = np.array([10, 4, 1])
    o, mag = decode_attention_reference(q, kc, vc, lens, 0.3)
    for bh, n in enumerate(lens):
        s = 0.3 * kc[bh, :n] @ q[bh]
        p = np.exp(s - s.max())
        np.testing.assert_allclose(o[bh], p @ vc[bh, :n] / p.sum(), rtol=1e-12)
        np.testing.assert_allclose(mag[bh], p @ np.abs(vc[bh, :n]) / p.sum(), rtol=1e-12)
    assert np.isnan(decode_attention_reference(q, kc, vc, lens, 0.3, n=lens - 1)[0][2]).all()


@pytest.mark.parametrize("edits, hint", [
    ([("#include <cuda_fp16.h>", "#include <cuda_fp16.h>\n#include <cub/warp/warp_reduce.cuh>")],
     r"includes <cub/warp/warp_reduce\.cuh>, a library"),
    ([("    __shared__ float wm[WARPS]", "    extern __shared__ float sc[];\n"
       "    __shared__ float wm[WARPS]")], "extern __shared__ array"),
    # the barrier only in a comment: the rubric reads the code without it
    ([("    __syncthreads();\n", "    // __syncthreads();\n")],
     r"no __syncthreads\(\) in the code"),
], ids=["cub-header", "extern-shared", "barrier-in-a-comment"])
def test_ex07_4_rubric_refuses_on_any_machine(edits, hint):
    with pytest.raises(GradeError, match=f"ex07.4: .*{hint}"):
        ex07_4(attn_src(*edits))


def test_ex07_4_stub_fails():
    with pytest.raises(GradeError, match=r"ex07\.4: .*still the stub"):
        ex07_4(SOL.stub("ex07.4", "decode_attn_src"))


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the grader runs the kernel")
def test_ex07_4_needs_a_gpu():
    with pytest.raises(GradeError, match=r"ex07\.4: needs a CUDA GPU"):
        ex07_4(attn_src())


@gpu
def test_ex07_4_reference_passes(capsys):
    ex07_4(attn_src())
    assert capsys.readouterr().out == "PASS ex07.4\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([("float a = __expf(m - m_new), p = __expf(s - m_new);", "float a = 1.f, p = __expf(s);"),
      ("__expf(wm[w] - M)", "1.f", 2)], "exp.1000. overflows float32"),
    ([("float m = NEG_INF, l = 0.f;", "float m = 0.f, l = 0.f;")],
     "start it at -INFINITY, not at 0"),
    ([("int n = lens[bh], P", "int n = L, P")], "attended over the whole cache"),
    ([("for (int j = warp; j < n;", "for (int j = warp; j <= n;")], "one key too many"),
    ([("for (int j = warp; j < n;", "for (int j = warp; j < n - 1;")],
     "single key .* are NaN|one key too few"),
    ([("        s *= scale;\n", "")], "not multiplied by scale"),
    ([("o[(size_t)bh * D + e] = sum / tot;", "o[(size_t)bh * D + e] = sum;")],
     "multiple of the right one"),
    # the online softmax without its rescaling: right only while the max never grows
    ([("l = l * a + p;", "l += p;"),
      ("acc[c].x = acc[c].x * a + p * vv.x;", "acc[c].x += p * vv.x;"),
      ("acc[c].y = acc[c].y * a + p * vv.y;", "acc[c].y += p * vv.y;")], "rescale its sum l"),
    ([("e < D; e += blockDim.x", "e <= D; e += blockDim.x")], "wrote past the end of o"),
    # the barrier before the warps write their results instead of after
    ([("    if (lane == 0) {\n        wm[warp] = m;",
       "    __syncthreads();\n    if (lane == 0) {\n        wm[warp] = m;"),
      (ATTN_SYNC, "    float M = NEG_INF")], "racecheck found a race"),
], ids=["no-max-shift", "max-from-zero", "whole-cache", "one-key-too-many", "one-key-too-few",
        "no-scale", "not-normalised", "no-rescale", "past-the-end", "race"])
def test_ex07_4_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=f"ex07.4: .*{hint}"):
        ex07_4(attn_src(*edits))


def test_ex07_4_states_its_stub_size_and_has_two_hints():
    check_exercise_page("07", "ex07.4")
