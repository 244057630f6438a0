"""The decode megakernel (kernels/decode_mega.cu): its refusals and launch record on the CPU, and
v4's splits against the kernel's constants; on a GPU (cc 8.0+) its logits against the book's
step and a float64 PyTorch reference at positions 0, 1, 2, 511 and ragged ones, batch 1 and 8,
graph replay against launches, greedy tokens against the book's engine, the later versions
against the earlier ones, the error word, and the timed step (step_us)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cudabook as cb
from cudabook import gpt

gpu = pytest.mark.gpu
dm = cb.load_launch("decode_mega")


# ----------------------------------------------------------------------------- CPU
def test_config_is_one_block_per_sm_with_the_fc2_input_in_shared_memory():
    cfg = dm.config(gpt.GPT2_SMALL, 1, 1024, "v1", sms=132)
    assert cfg.grid == (132,) and cfg.block == (dm.THREADS,) and cfg.kernel == "decode_mega_v1"
    assert cfg.shared == 1 * 4 * 768 * 2
    assert cfg.options == ("-DMEGA_B=1", "-DMEGA_D=768")
    assert cfg.splits == 11                       # 132 blocks / 12 heads
    c8 = dm.config(gpt.GPT2_SMALL, 8, 4096, sms=132, blocks_per_sm=2)
    assert c8.grid == (264,) and c8.kernel == "decode_mega_v2" and c8.shared == 8 * 3072 * 2
    assert c8.splits == max(-(-264 // 96), 4096 // dm.KSMAX)


@pytest.mark.parametrize("batch, match", [(3, "pad the batch to 4"), (0, "got 0"),
                                          (16, "got 16")])
def test_refuses_batches_it_is_not_compiled_for(batch, match):
    with pytest.raises(cb.LaunchError, match=match):
        dm.check_model(gpt.GPT2_SMALL, batch, 1024)


@pytest.mark.parametrize("cfg, match", [
    (gpt.GPTConfig(d=256, n_head=8), "head dimension 64"),
    (gpt.GPTConfig(d=192, n_head=3), "multiple of 128"),
    (gpt.GPTConfig(d=1280, n_head=20), "up to 1024"),
    (gpt.GPTConfig(d=250, n_head=4), "not a multiple of n_head"),
])
def test_refuses_shapes_with_the_reason(cfg, match):
    with pytest.raises(cb.LaunchError, match=match):
        dm.check_model(cfg, 1, 64)


def test_refuses_a_cache_too_short_and_unknown_versions():
    with pytest.raises(cb.LaunchError, match="at least 2"):
        dm.check_model(gpt.TINY, 1, 1)
    with pytest.raises(ValueError, match="unknown version"):
        dm.config(gpt.TINY, 1, 64, "v9")
    with pytest.raises(TypeError, match="batch must be an int"):
        dm.check_model(gpt.TINY, 1.0, 64)


def test_entry_point_checks_shapes_before_touching_cuda():
    model = gpt.build(gpt.GPTConfig(vocab=32, d=256, n_head=8, n_layer=1, ctx=16))
    with pytest.raises(cb.LaunchError, match="head dimension 64"):
        dm.megakernel(model)
    tiny = gpt.build(gpt.GPTConfig(vocab=32, d=128, n_head=2, n_layer=1, ctx=16))
    with pytest.raises(cb.LaunchError, match="pad the batch to 8"):
        dm.megakernel(tiny, batch=5)
    with pytest.raises(TypeError, match="gpt.GPT model or a decoder.KernelGPT"):
        dm.megakernel(object())
    if not cb.HAS_GPU:
        with pytest.raises(cb.LaunchError, match="needs a CUDA GPU"):
            dm.megakernel(tiny, batch=1)


def test_v3_takes_one_task_per_block_and_room_for_the_combine():
    c = dm.config(gpt.GPT2_SMALL, 1, 1024, "v3", sms=132)
    assert c.kernel == "decode_mega_v3" and c.splits == 132 // 12
    assert c.shared == 4 * 768 * 2                # the fc2 input is the larger need here
    c8 = dm.config(gpt.GPT2_SMALL, 8, 4096, "v3", sms=132)
    assert c8.splits == 1                         # 96 tasks <= 132 blocks, no KSMAX limit
    t = dm.config(gpt.TINY, 1, 64, "v3", sms=132)  # many splits of a few heads
    S, H, d = t.splits, gpt.TINY.n_head, gpt.TINY.d
    assert S == 132 // H and t.shared == max(4 * d * 2, d * 2 + 4 * H * (S + 1))


@pytest.mark.parametrize("version", ["v4", "v5"])
def test_v4_sizes_for_the_most_splits_and_room_for_its_combine(version):
    c = dm.config(gpt.GPT2_SMALL, 1, 1024, version, sms=132)
    assert c.kernel == f"decode_mega_{version}"
    assert c.splits == dm.config(gpt.GPT2_SMALL, 1, 1024, "v3", sms=132).splits == 132 // 12
    assert c.shared == 4 * 768 * 2                # the fc2 input is the larger need here
    assert dm.config(gpt.GPT2_SMALL, 8, 4096, version, sms=132).splits == 1
    t = dm.config(gpt.TINY, 1, 64, version, sms=132)   # many splits of a few heads
    S, H, d = t.splits, gpt.TINY.n_head, gpt.TINY.d
    assert S == 132 // H and t.shared == max(4 * d * 2, d * 2 + 4 * H * (2 * S + 1))
    # where the combine's part is the larger (many splits): v3's m, v4's m and l a split
    assert dm.shared_bytes(gpt.TINY, 1, 200, "v3") == d * 2 + 4 * H * (200 + 1)
    assert dm.shared_bytes(gpt.TINY, 1, 200, version) == d * 2 + 4 * H * (2 * 200 + 1)


def test_v6_puts_a_ring_of_weight_slots_behind_v4s_shared_memory():
    c4 = dm.config(gpt.GPT2_SMALL, 1, 1024, "v4", sms=132)
    c6 = dm.config(gpt.GPT2_SMALL, 1, 1024, "v6", sms=132)
    assert c6.kernel == "decode_mega_v6" and c6.splits == c4.splits
    # the largest share of 132 blocks: 24 rows of fc (3072 / 132) or 6 rows of fc2 (768 / 132),
    # each 36 KiB; QKV's 9 pairs (1152 / 132) are 18 rows, proj's 6 rows
    assert dm.slot_bytes(gpt.GPT2_SMALL, 132) == 24 * 768 * 2 == 6 * 3072 * 2
    assert c6.shared == (c4.shared + 15) // 16 * 16 + dm.RING * 24 * 768 * 2
    # fewer SMs, larger shares: the slot grows with the share, the refusal is the launcher's
    assert dm.slot_bytes(gpt.GPT2_SMALL, 58) == 14 * 3072 * 2          # 14 rows of fc2
    c8 = dm.config(gpt.GPT2_SMALL, 8, 1024, "v6", sms=132)
    assert c8.shared == dm.config(gpt.GPT2_SMALL, 8, 1024, "v4", sms=132).shared + 3 * 36864
    # the ring's depth is a compile option of the ring versions only
    c5 = dm.config(gpt.GPT2_SMALL, 1, 1024, "v7", sms=132, ring=5)
    assert "-DMEGA_RING=5" in c5.options and c5.shared == c6.shared + 2 * 36864
    assert not any("MEGA_RING" in o for o in c4.options)
    for bad in (1, 9):
        with pytest.raises(cb.LaunchError, match="2 to 8 slots"):
            dm.config(gpt.GPT2_SMALL, 1, 1024, "v7", sms=132, ring=bad)
    with pytest.raises(TypeError, match="ring must be an int"):
        dm.megakernel(gpt.build(gpt.TINY), version="v7", ring=2.5)
    # a grid on fewer SMs is refused before anything touches CUDA when it is not a count
    with pytest.raises(cb.LaunchError, match="at least one SM"):
        dm.megakernel(gpt.build(gpt.TINY), version="v4", sms=0)
    with pytest.raises(TypeError, match="sms must be an int"):
        dm.megakernel(gpt.build(gpt.TINY), version="v4", sms=99.5)


def test_v4_splits_are_one_pass_each_within_the_most():
    P = dm.ATT_PASS
    S = dm.splits(gpt.GPT2_SMALL, 1, 1024, 132, "v4")
    assert S == 11
    got = {n: dm.active_splits(n, S) for n in (1, 2, P - 1, P, P + 1, 2 * P, 2 * P + 1, 513,
                                               1024, 10 * P + 1, 11 * P, 5000)}
    assert got == {1: 1, 2: 1, P - 1: 1, P: 1, P + 1: 2, 2 * P: 2, 2 * P + 1: 3, 513: 5,
                   1024: 8, 10 * P + 1: 11, 11 * P: 11, 5000: 11}
    for n in range(1, 3000):                      # one pass a split, unless S is at its most
        s = dm.active_splits(n, S)
        assert 1 <= s <= S and (-(-n // s) <= P or s == S), n
        assert s == 1 or -(-n // (s - 1)) > P or s == S, n   # and no fewer splits would do
    assert all(dm.active_splits(n, 1) == 1 for n in (1, 129, 4096))   # batch 8 on 132 SMs
    with pytest.raises(ValueError, match=">= 1"):
        dm.active_splits(0, S)


def test_the_launchers_constants_are_the_kernels():
    src = (cb.compile.KERNELS_DIR / "decode_mega.cu").read_text()
    const = {k: int(v) for k, v in re.findall(r"^#define (MEGA_\w+) (\d+)\b", src, re.M)}
    assert const["MEGA_ATT_PASS"] == dm.ATT_PASS    # mg_splits_v4 and active_splits agree
    assert const["MEGA_THREADS"] == dm.THREADS and const["MEGA_HD"] == dm.HEAD_DIM
    assert const["MEGA_KSMAX"] == dm.KSMAX
    ph = {k[len("MEGA_PH_"):].lower(): v for k, v in const.items() if k.startswith("MEGA_PH_")}
    assert ph == {"att" if k == "attention" else k: v for k, v in dm.PHASES.items()}


def test_phase_mask_names_every_phase_once():
    bits = list(dm.PHASES.values())
    assert sorted(bits) == [1 << i for i in range(6)] and sum(bits) == dm.ALL_PHASES


# ----------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def small():
    """GPT-2-small shapes, fp16, random weights; a float64 copy of those fp16 weights for the
    reference."""
    import copy

    import torch

    if cb.env.cc() < dm.MIN_CC:
        pytest.skip(f"decode_mega needs compute capability {dm.MIN_CC}")
    model = gpt.build(gpt.GPT2_SMALL, 0, "cuda", torch.float16)
    model64 = copy.deepcopy(model).double()
    return model, model64


def _pair(model, batch, version, length=1024):
    from cudabook import decoder

    mk = dm.megakernel(model, batch=batch, length=length, version=version)
    book = decoder.KernelGPT(model, batch=batch, length=length, share=mk.run)
    return mk, book


def _assert_close(e, what):
    assert e["mega_vs_ref"] <= 2 * e["book_vs_ref"] + 1e-3, (
        f"{what}: the megakernel's logits are {e['mega_vs_ref']:.3g} from float64, the book's "
        f"step {e['book_vs_ref']:.3g} (positions {e['positions']}); mega-book "
        f"{e['mega_vs_book']:.3g}: a wrong index, a missing barrier or a stale read?")


@gpu
@pytest.mark.parametrize("version", dm.VERSIONS + dm.RING_VERSIONS)
def test_logits_from_position_0_and_after_511_and_ragged_prompts(small, version):
    model, model64 = small
    mk, book = _pair(model, 1, version)
    e = dm.compare(mk, book, model64, None, steps=3, start=464)
    assert e["positions"] == [0, 1, 2]
    _assert_close(e, f"{version} at positions 0, 1, 2")
    rng = np.random.default_rng(1)
    for T in (511, 37):
        e = dm.compare(mk, book, model64, rng.integers(0, 50257, (1, T)), steps=2)
        assert e["positions"] == [T, T + 1]
        _assert_close(e, f"{version} after a prompt of {T}")


@gpu
@pytest.mark.parametrize("version", ["v2", "v3", "v4", "v5", "v6", "v7"])
def test_batch_8_rows_each_match(small, version):
    model, model64 = small
    mk, book = _pair(model, 8, version)
    prompt = np.random.default_rng(2).integers(0, 50257, (8, 45))
    _assert_close(dm.compare(mk, book, model64, prompt, steps=2), "batch 8")


@gpu
@pytest.mark.parametrize("version", dm.VERSIONS + dm.RING_VERSIONS)
def test_graph_replays_are_the_launches_bit_for_bit(small, version):
    import cupy as cp

    model, _ = small
    mk, _ = _pair(model, 1, version)
    mk.run.prefill(np.arange(100, 140))
    state = [a.copy() for a in (mk.run.kc, mk.run.vc, mk.run.tok, mk.run.pos)]
    eager = []
    for _ in range(4):
        mk.step()
        eager.append((mk.run.logits.copy(), int(mk.run.tok[0])))
    for a, b in zip((mk.run.kc, mk.run.vc, mk.run.tok, mk.run.pos), state):
        a[...] = b
    g = mk.capture()
    for i in range(4):
        g()
        assert bool((mk.run.logits == eager[i][0]).all()) and int(mk.run.tok[0]) == eager[i][1], \
            f"replay {i} differs from launch {i}"
    assert int(mk.run.pos[0]) == 44 and mk.errors() is None
    cp.cuda.Device().synchronize()


@gpu
@pytest.mark.parametrize("version", ["v2", "v3", "v4", "v5"])
@pytest.mark.parametrize("cfg", ["tiny", "small"])
def test_greedy_tokens_are_the_book_engines(small, cfg, version):
    import torch

    model = small[0] if cfg == "small" else gpt.build(gpt.TINY, 0, "cuda", torch.float16)
    mk, book = _pair(model, 1, version, length=model.cfg.ctx)
    prompt = np.random.default_rng(3).integers(0, model.cfg.vocab, 20)
    r = dm.greedy_agreement(mk, book, prompt, 32)
    if not r["same"]:
        assert r["book_top2_gap"] <= 4e-3, (
            f"tokens part at step {r['first_difference']} where the book's top two logits are "
            f"{r['book_top2_gap']:.3g} apart (not a near tie): {r['mega']} vs {r['book']}")


@gpu
def test_a_position_past_the_cache_sets_the_error_word_and_reset_clears_it(small):
    model, _ = small
    mk, _ = _pair(model, 1, "v1", length=64)
    mk.run.prefill(np.arange(5))
    mk.run.pos[...] = 64
    mk.step()
    assert "outside the cache" in (mk.errors() or "")
    mk.run.pos[...] = 5
    mk.step()                                     # still refused until reset
    assert int(mk.run.pos[0]) == 5
    mk.reset()
    mk.step()
    assert int(mk.run.pos[0]) == 6 and mk.errors() is None


@gpu
def test_step_us_times_checked_steps_from_the_prefills_position(small):
    """MegaStep.step_us and KernelGPT.step_us (decoder.timed_step): a time, the position back
    where the prefill left it, no error; a wrong step (NaN logits) raises instead of timing;
    too little cache is refused before anything runs."""
    model, _ = small
    mk, book = _pair(model, 1, "v4", length=256)
    ids = np.random.default_rng(6).integers(0, 50257, (1, 100))
    assert mk.step_us(ids, n=20) > 0 and int(mk.run.pos[0]) == 100 and mk.errors() is None
    assert book.step_us(ids, n=20) > 0 and int(book.pos[0]) == 100 and book.graph.nodes > 1
    with pytest.raises(ValueError, match="run past the cache of 256"):
        mk.step_us(np.zeros((1, 200), np.int64), n=100)
    mk.run.lnf[0][...] = float("nan")             # every logit NaN (shared with the book's)
    with pytest.raises(cb.CheckError, match="NaN"):
        mk.step_us(ids, n=20)
    mk.reset()


def _generate(model, batch, versions, prompt, n=8):
    """(ids, logits, S, keys) of ``n`` greedy tokens after ``prompt`` from each version."""
    import cupy as cp

    out = {}
    for version in versions:
        mk, _ = _pair(model, batch, version)
        ids, logits = mk.generate(prompt, n)
        mk.check()
        T = prompt.shape[-1]
        out[version] = (ids, logits, mk.launch.splits, range(T + 1, T + n))
        del mk
    cp.cuda.Device().synchronize()
    return out


@gpu
@pytest.mark.parametrize("version", ["v3", "v4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_v3_v4_logits_are_v2s_to_fp16_rounding_and_their_tokens_the_same(small, batch, version):
    """v3 sums attention in another order, v4 also over other splits: their logits may move by
    fp16 ulps, never more. After 125 tokens v4's steps cross 128 keys (at batch 1: 1 split,
    then 2)."""
    model, _ = small
    prompt = np.random.default_rng(4).integers(0, 50257, (batch, 125))
    out = _generate(model, batch, ("v2", version), prompt)
    (i2, l2, _, _), (i3, l3, _, _) = out["v2"], out[version]
    u = 2.0 ** -11                                # compare()'s tolerance, v2 as the reference
    tol = 4 * (model.cfg.n_layer + 1) * u * np.sqrt((l2 ** 2).mean(-1, keepdims=True)) + \
        u * np.abs(l2)
    worst = float((np.abs(l3 - l2) / tol).max())
    assert worst <= 1, f"{version}'s logits are {worst:.2f} of fp16 rounding's tolerance from " \
        "v2's: a wrong partial, split or combine weight?"
    if not (i2 == i3).all():
        first = int(np.flatnonzero((i2 != i3).any(0))[0])
        top = np.sort(l2[first], -1)[:, -2:]
        gap = float((top[:, 1] - top[:, 0]).min())
        assert gap <= 4e-3, f"greedy tokens part at step {first}, not a near tie (gap {gap:.3g})"


@gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_v5_is_v4_bit_for_bit_and_v4_is_v3_where_their_splits_agree(small, batch):
    """v5 only replaces a barrier by counts per head: a head read before its q, k, v are all
    written would change the logits. v4 takes v3's arithmetic over fewer splits: where it takes
    as many as v3 (batch 8 on 96 to 191 SMs: 1 split), its logits are v3's."""
    model, _ = small
    prompt = np.random.default_rng(5).integers(0, 50257, (batch, 125))
    out = _generate(model, batch, ("v3", "v4", "v5"), prompt)
    (_, l3, S, keys), (i4, l4, _, _), (i5, l5, _, _) = out["v3"], out["v4"], out["v5"]
    assert (i5 == i4).all() and np.array_equal(l5, l4), \
        f"v5 differs from v4 by {float(np.abs(l5 - l4).max()):.3g}: a head's attention read " \
        "its q, k or v before the count said they were written?"
    if all(dm.active_splits(n, S) == S for n in keys):
        assert np.array_equal(l4, l3), f"v4 with v3's {S} splits differs from v3 by " \
            f"{float(np.abs(l4 - l3).max()):.3g}"


def test_v8_is_v4s_launch_with_int4_weights():
    c4 = dm.config(gpt.GPT2_SMALL, 1, 1024, "v4", sms=132)
    c8 = dm.config(gpt.GPT2_SMALL, 1, 1024, "v8", sms=132)
    assert c8.kernel == "decode_mega_v8" and (c8.shared, c8.splits) == (c4.shared, c4.splits)
    assert gpt.GPT2_SMALL.d % dm.W4_GROUP == 0 and "decode_mega_v8" in dm.WHAT


@gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_v8_logits_are_the_dequantized_models_to_fp16_rounding(small, batch):
    """v8 multiplies by int4 weights times their fp16 scales, so its reference is the model with
    those weights dequantized, in float64. From position 0 (every cached key is the megakernel's
    own), 130 steps: from one split of the keys (128) to two. A nibble read in the wrong order,
    a scale of the wrong group or a row's bytes off would be far outside fp16 rounding."""
    import cupy as cp

    model, _ = small
    mk = dm.megakernel(model, batch=batch, length=256, version="v8")
    ref_model = dm.dequantized_model(model, mk)
    run = mk.run
    run.tok[...] = cp.asarray(np.random.default_rng(8).integers(0, model.cfg.vocab, batch),
                              dtype=cp.int32)
    run.pos[...] = 0
    run.host_pos = 0
    feed, got = [], []
    for _ in range(130):
        feed.append(cp.asnumpy(run.tok))
        mk.step()
        got.append(cp.asnumpy(run.logits).astype(np.float64))
        run.host_pos += 1
    mk.check()
    ref = dm.reference_logits(ref_model, None, np.stack(feed, 1), run.L)
    got = np.stack(got)
    u = 2.0 ** -11
    tol = 4 * (model.cfg.n_layer + 1) * u * np.sqrt((ref ** 2).mean(-1, keepdims=True)) + \
        u * np.abs(ref)
    worst = float((np.abs(got - ref) / tol).max())
    assert worst <= 1, f"v8's logits are {worst:.2f} of fp16 rounding's tolerance from the " \
        "dequantized model's: a nibble, a scale or a row read wrong?"
    with pytest.raises(ValueError, match="keeps fp16 weights"):
        dm.dequantized_model(model, _pair(model, 1, "v4")[0])


@gpu
@pytest.mark.parametrize("version", ["v6", "v7"])
@pytest.mark.parametrize("batch", [1, 8])
def test_v6_v7_are_v4_bit_for_bit(small, batch, version):
    """v6 and v7 only move where the weights come from (the block's share in shared memory,
    copied ahead by cp.async or by the copy engine): each row's sum is v4's, in v4's order. A
    slot read before its copy landed, a share off by a row or a pair's rows swapped would change
    the logits."""
    model, _ = small
    prompt = np.random.default_rng(6).integers(0, 50257, (batch, 125))
    out = _generate(model, batch, ("v4", version), prompt)
    (i4, l4, _, _), (i6, l6, _, _) = out["v4"], out[version]
    assert (i6 == i4).all() and np.array_equal(l6, l4), \
        f"{version} differs from v4 by {float(np.abs(l6 - l4).max()):.3g}: a weight slot read " \
        "before its copy landed, or a block's share of rows off?"


@gpu
@pytest.mark.parametrize("version", dm.VERSIONS + dm.RING_VERSIONS)
def test_capture_right_after_launches_does_not_race_them(small, version):
    """graphs.capture warms up on a new non-blocking stream; MegaStep.capture synchronises first,
    so the warm-up step never runs beside the launches queued before it (two grids on one
    barrier word: a timeout where two blocks fit an SM)."""
    model, _ = small
    mk, _ = _pair(model, 1, version)
    mk.run.prefill(np.arange(300))
    for _ in range(6):
        mk.step()                                 # queued, not waited for
    mk.run.host_pos += 6
    g = mk.capture()
    for _ in range(3):
        g()
    assert mk.errors() is None and int(mk.run.pos[0]) == 309
