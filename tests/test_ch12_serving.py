"""Serving on a paged KV cache (capstone): the fused RoPE + paged append against float64, the
paged decode step against chapter 7's dense decoder, every request's tokens under continuous and
static batching equal to running it alone (batch invariance), the accounting of both policies,
and the refusals. The engine needs a GPU; the workload generator does not."""

from __future__ import annotations

import numpy as np
import pytest

import cudabook as cb
from cudabook import serving

gpu = pytest.mark.gpu


def test_workload_is_reproducible_and_within_its_ranges():
    a = serving.workload(20, vocab=100, prompt=(3, 9), new=(1, 5), seed=7)
    b = serving.workload(20, vocab=100, prompt=(3, 9), new=(1, 5), seed=7)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(3 <= len(r.prompt) <= 9 and 1 <= r.max_new_tokens <= 5 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt)
    assert len({r.max_new_tokens for r in a}) > 1


@gpu
@pytest.mark.parametrize("H, Hkv, D", [(4, 4, 64), (8, 2, 128), (6, 3, 16)])
def test_rope_append_matches_float64_at_each_rows_own_position(H, Hkv, D):
    import cupy as cp

    pa = cb.load_launch("paged_attention")
    rng = np.random.default_rng(H + D)
    B, BS, MB, NB = 5, 16, 4, 24
    lens = np.array([1, 16, 17, 33, 64], np.int32)           # block starts, ends, the last slot
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        k = -(-int(n) // BS)
        table[b, :k], ids = ids[:k], ids[k:]
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float16)
    kp = cp.full((NB, Hkv, BS, D), cp.nan, cp.float16)
    vp = cp.full((NB, Hkv, BS, D), cp.nan, cp.float16)
    q = cp.full((B, H, D), cp.nan, cp.float16)
    pa.rope_append(cp.asarray(qkv), q, kp, vp, cp.asarray(table), cp.asarray(lens))
    qr, kr = pa.rope_reference(qkv, lens, H, Hkv, D)
    cb.check(q, qr, atol=2e-3, rtol=2e-3)
    v = qkv.reshape(B, H + 2 * Hkv, D)[:, H + Hkv:]
    t = lens - 1
    blk, off = table[np.arange(B), t // BS], t % BS
    cb.check(kp[cp.asarray(blk), :, cp.asarray(off)], kr, atol=2e-3, rtol=2e-3)
    cb.check(vp[cp.asarray(blk), :, cp.asarray(off)], v, atol=0, rtol=0)
    written = np.zeros((NB, BS), bool)
    written[blk, off] = True                                  # nothing else was touched
    assert bool(cp.isnan(kp.transpose(0, 2, 1, 3)[cp.asarray(~written)]).all())


@gpu
def test_write_prompt_fills_the_prompts_positions_and_nothing_past_its_length():
    import cupy as cp

    pa = cb.load_launch("paged_attention")
    rng = np.random.default_rng(5)
    Hkv, T, D, BS, NB, n = 3, 64, 32, 16, 9, 37             # 37 of 64 rows, 3 blocks of 16
    row = np.array([7, 2, 5, -1, -1], np.int32)
    k, v = (rng.standard_normal((Hkv, T, D)).astype(np.float16) for _ in range(2))
    kp = cp.full((NB, Hkv, BS, D), cp.nan, cp.float16)
    vp = cp.full((NB, Hkv, BS, D), cp.nan, cp.float16)
    pa.write_prompt(cp.asarray(k), cp.asarray(v), kp, vp, cp.asarray(row),
                    cp.asarray([n], cp.int32))
    t = np.arange(n)
    blk, off = row[t // BS], t % BS
    got_k = kp.transpose(0, 2, 1, 3)[cp.asarray(blk), cp.asarray(off)]      # (n, Hkv, D)
    got_v = vp.transpose(0, 2, 1, 3)[cp.asarray(blk), cp.asarray(off)]
    cb.check(got_k, k[:, :n].transpose(1, 0, 2), atol=0, rtol=0)
    cb.check(got_v, v[:, :n].transpose(1, 0, 2), atol=0, rtol=0)
    written = np.zeros((NB, BS), bool)
    written[blk, off] = True
    assert bool(cp.isnan(kp.transpose(0, 2, 1, 3)[cp.asarray(~written)]).all())
    with pytest.raises(ValueError, match="k"):
        pa.write_prompt(cp.asarray(k[:2]), cp.asarray(v), kp, vp, cp.asarray(row),
                        cp.asarray([n], cp.int32))


@gpu
def test_rope_append_refuses_bad_shapes():
    import cupy as cp

    pa = cb.load_launch("paged_attention")
    kp = cp.zeros((4, 2, 16, 64), cp.float16)
    t, sl = cp.zeros((2, 3), cp.int32), cp.ones(2, cp.int32)
    with pytest.raises(ValueError, match="qkv"):
        pa.rope_append(cp.zeros((2, 4 * 64), cp.float16), cp.zeros((2, 4, 64), cp.float16),
                       kp, kp, t, sl)
    with pytest.raises(cb.LaunchError, match="share"):
        pa.rope_append(cp.zeros((2, 7 * 64), cp.float16), cp.zeros((2, 3, 64), cp.float16),
                       kp, kp, t, sl)


def _tiny(seed=0):
    from cudabook import gpt

    return gpt.build(gpt.TINY, seed, "cuda")


@gpu
def test_paged_step_gives_chapter7s_logits():
    """Prefill then one decode step, paged, against KernelGPT's dense cache."""
    import cupy as cp

    from cudabook.decoder import KernelGPT

    model = _tiny(1)
    eng = serving.PagedGPT(model, slots=2, max_len=128)
    prompt = np.random.default_rng(0).integers(0, 256, 37).tolist()
    slot = eng.table.admit(len(prompt))
    tok = eng.prefill(slot, prompt)
    eng.table.grow(slot)
    eng.decode([slot], [tok])
    got = eng.bucket(1).logits[0].astype(cp.float32)
    ref = KernelGPT(model, batch=1, length=128)
    ref.prefill(np.asarray(prompt)[None])
    assert int(ref.tok[0]) == tok
    ref.step()
    cb.check(got, ref.logits[0].astype(cp.float32), atol=2e-2, rtol=2e-2)
    eng.table.retire(slot)


@gpu
@pytest.mark.parametrize("gemv", ["gemv_v6", "gemv_v4"])
def test_every_request_gets_its_solo_tokens_under_both_policies(gemv):
    model = _tiny(2)
    eng = serving.PagedGPT(model, slots=4, max_len=96, block_size=8, gemv=gemv)
    reqs = serving.workload(11, vocab=256, prompt=(1, 40), new=(1, 30), seed=3)
    cont = eng.serve(reqs)
    stat = eng.serve(reqs, policy="static")
    alone = {r.id: eng.serve([r]).tokens[r.id] for r in reqs}
    for r in reqs:
        assert len(cont.tokens[r.id]) == r.max_new_tokens
        assert cont.tokens[r.id] == alone[r.id], f"request {r.id}: batched tokens differ"
        assert stat.tokens[r.id] == alone[r.id], f"request {r.id}: static tokens differ"
    assert eng.table.alloc.free == eng.table.alloc.num_blocks and not eng.table.in_use.any()
    # accounting: continuous computes fewer rows than static padding, all useful but buckets'
    useful = sum(r.max_new_tokens - 1 for r in reqs)
    assert cont.useful_rows == stat.useful_rows == useful
    assert cont.rows < stat.rows and cont.steps < stat.steps
    assert set(cont.done) == set(stat.done) == {r.id for r in reqs}


@gpu
def test_engine_refuses_what_it_cannot_serve():
    from cudabook.batching import Request

    model = _tiny(0)
    with pytest.raises(ValueError, match="slots"):
        serving.PagedGPT(model, slots=33)
    with pytest.raises(ValueError, match="max_len"):
        serving.PagedGPT(model, slots=2, max_len=10_000)
    with pytest.raises(ValueError, match="unknown version"):
        serving.PagedGPT(model, slots=2, max_len=32, gemv="gemv_v9")
    eng = serving.PagedGPT(model, slots=2, max_len=32)
    with pytest.raises(ValueError, match="need 40 positions"):
        eng.serve([Request("a", [1] * 20, 21)])
    with pytest.raises(ValueError, match="outside"):
        eng.serve([Request("a", [1, 300], 2)])
    with pytest.raises(ValueError, match="share an id"):
        eng.serve([Request("a", [1], 2), Request("a", [2], 2)])
    with pytest.raises(ValueError, match="policy"):
        eng.serve([Request("a", [1], 2)], policy="greedy")
    with pytest.raises(ValueError, match="continuous batching fills"):
        eng.serve([Request("a", [1], 2)], batch=1)


# ----------------------------------------------------------------------------- the schedulers
class _FakeEngine(serving.PagedGPT):
    """PagedGPT's schedulers (``_continuous``, ``_static``) over a stand-in model on the CPU:
    prefill writes the prompt's token ids into a pool of ids through the block table, and a
    decode step writes each row's input token at its newest position and reads the whole
    sequence back through the table to choose the next token (a mix-up of blocks or slots
    changes the tokens)."""

    def __init__(self, slots, max_len, block_size, vocab=50):
        from types import SimpleNamespace

        from cudabook.paging import BlockAllocator, PagedTable

        self.slots, self.max_len, self.BS = slots, max_len, block_size
        self.MB = -(-max_len // block_size)
        self.table = PagedTable(BlockAllocator(slots * self.MB, block_size), slots, self.MB)
        self.buckets = {B: SimpleNamespace(B=B) for B in serving.BUCKETS if B < slots} | \
            {slots: SimpleNamespace(B=slots)}
        self.pool = np.full((slots * self.MB, block_size), -1, np.int64)
        self.cfg = SimpleNamespace(vocab=vocab)
        self.calls = []

    def bucket(self, n):
        return self.buckets[min(B for B in self.buckets if B >= n)]

    def _next(self, slot):
        blk, off = self.table.positions(slot).T
        t = self.pool[blk, off]
        assert (t >= 0).all(), "a position was read before it was written"
        return int((t * np.arange(1, t.size + 1)).sum() * 31 + t.size) % self.cfg.vocab

    def prefill(self, slot, prompt):
        blk, off = self.table.positions(slot).T
        self.pool[blk, off] = prompt
        return self._next(slot)

    def decode(self, slots, tokens):
        self.calls.append(len(slots))
        for s, tok in zip(slots, tokens):
            blk, off = self.table.positions(s)[-1]
            self.pool[blk, off] = tok
        return np.array([self._next(s) for s in slots], np.int32)

    def run(self, requests, policy, batch=None):
        reqs = self._fresh(requests)
        run = serving._Run(policy, 0.0)
        if policy == "continuous":
            self._continuous(reqs, run)
        else:
            self._static(reqs, batch or self.slots, run)
        return run.result(reqs, lambda: None)


def _alone(req, vocab=50):
    seq, out = list(req.prompt), []
    while len(out) < req.max_new_tokens:
        t = np.asarray(seq, np.int64)
        out.append(int((t * np.arange(1, t.size + 1)).sum() * 31 + t.size) % vocab)
        if req.eos is not None and out[-1] == req.eos:
            break
        seq.append(out[-1])
    return out


def test_both_schedulers_give_each_request_its_own_sequence_and_count_the_work():
    reqs = serving.workload(23, vocab=50, prompt=(1, 20), new=(1, 25), seed=11)
    eng = _FakeEngine(slots=4, max_len=48, block_size=4)
    cont = eng.run(reqs, "continuous")
    assert max(eng.calls) == 4 and eng.table.alloc.free == eng.table.alloc.num_blocks
    stat = eng.run(reqs, "static")
    for r in reqs:
        assert cont.tokens[r.id] == stat.tokens[r.id] == _alone(r), r.id
    useful = sum(r.max_new_tokens - 1 for r in reqs)
    assert cont.useful_rows == stat.useful_rows == useful
    groups = [reqs[i:i + 4] for i in range(0, len(reqs), 4)]
    assert stat.steps == sum(max(r.max_new_tokens for r in g) - 1 for g in groups)
    assert cont.steps < stat.steps and cont.rows < stat.rows
    assert len(cont.timeline) == cont.steps and set(cont.done) == {r.id for r in reqs}
    assert 0 < cont.peak_blocks <= eng.table.alloc.num_blocks
    assert sum(cont.bucket_rows.values()) == cont.steps


def test_static_batch_stops_when_every_request_hit_its_eos():
    from cudabook.batching import Request

    probe = Request("p", [3, 4, 5], 30)
    eos = _alone(probe)[2]                        # the third token ends it early
    reqs = [Request(i, [3, 4, 5], 30, eos=eos) for i in range(3)]
    eng = _FakeEngine(slots=4, max_len=48, block_size=4)
    stat = eng.run(reqs, "static")
    assert all(stat.tokens[i] == _alone(reqs[i]) for i in range(3))
    assert all(len(stat.tokens[i]) == 3 for i in range(3))
    assert stat.steps == 2                        # not 29: the batch ended with its requests


def test_requests_are_checked_before_anything_runs_and_int64_ids_are_accepted():
    import torch

    from cudabook.batching import Request

    eng = _FakeEngine(slots=2, max_len=16, block_size=4)
    with pytest.raises(ValueError, match="need 20 positions"):
        eng.run([Request("a", [1] * 10, 11)], "continuous")
    with pytest.raises(ValueError, match="outside"):
        eng.run([Request("a", [1, 50], 2)], "continuous")
    with pytest.raises(ValueError, match="share an id"):
        eng.run([Request("a", [1], 2), Request("a", [2], 2)], "static")
    with pytest.raises(ValueError, match="empty prompt"):
        Request("a", [], 2)
    assert eng.table.alloc.free == eng.table.alloc.num_blocks and eng.calls == []
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)      # PyTorch's default dtype
    req = Request("t", ids, 6)
    assert eng.run([req], "continuous").tokens["t"] == _alone(req)
