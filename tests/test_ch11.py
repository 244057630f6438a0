"""Chapter 11: the gloo process runner (results, errors, timeouts, size checks), the collectives
helpers (chunks, the ring's schedule, one-shot and naive all-reduce, bus bandwidth, alpha-beta),
the P2P kernels' launch checks, and the graders ex11_1..ex11_3: the reference from
solutions/11_multi_gpu.ipynb passes, the stub fails, wrong answers generated from the reference
fail with the hint of their mistake (a deadlock by a timeout, never a hang)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from solution_cells import Solution

from cudabook import collectives as co
from cudabook import dist
from cudabook.graders import GradeError, ch11, ex11_1, ex11_2, ex11_3

SOL = Solution("11")


# ============================================================================ dist.spawn

def _sum_rank(comm):
    x = torch.full((4,), float(comm.rank + 1))
    comm.all_reduce(x)
    return x.numpy()


def test_spawn_returns_in_rank_order_any_world():
    for w in (1, 2, 3):
        out = dist.spawn(_sum_rank, w)
        assert len(out) == w and all(np.allclose(o, w * (w + 1) / 2) for o in out)


def _deadlock(comm):
    x, y = torch.ones(8), torch.empty(8)
    comm.send(x, (comm.rank + 1) % comm.world)
    comm.recv(y, (comm.rank - 1) % comm.world)


def test_spawn_deadlock_is_a_timeout_with_a_message():
    with pytest.raises(dist.DistTimeout, match="did not finish within 3 s: a deadlock"):
        dist.spawn(_deadlock, 2, timeout=3)


def _mismatch(comm):
    x, y = torch.ones(8 + comm.rank), torch.empty(8)
    comm.sendrecv(x, (comm.rank + 1) % comm.world, y, (comm.rank - 1) % comm.world)


def test_spawn_mismatched_sizes_name_the_ranks():
    with pytest.raises(dist.DistError, match="sizes differ between ranks"):
        dist.spawn(_mismatch, 3, timeout=20)


def _raises(comm):
    if comm.rank == 1:
        raise ValueError("boom on one rank")
    comm.barrier()


def test_spawn_error_on_one_rank_stops_the_group():
    with pytest.raises(dist.DistError, match="rank 1 of 2 failed: ValueError: boom"):
        dist.spawn(_raises, 2, timeout=20)


def _self_send(comm):
    comm.send(torch.ones(2), comm.rank)


def test_comm_refuses_itself_and_bad_world():
    with pytest.raises(dist.DistError, match="send to itself"):
        dist.spawn(_self_send, 2, timeout=20)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        dist.spawn(_sum_rank, 0)


def test_need_gpus_says_why(capsys):
    assert dist.need_gpus(10**6, "the NCCL sweep") is False
    assert "needs 1000000 or more GPUs" in capsys.readouterr().out


# ============================================================================ collectives

@pytest.mark.parametrize("n, w", [(10, 3), (7, 7), (1003, 4), (8, 2), (5, 4)])
def test_chunk_bounds_cover_everything(n, w):
    b = [co.chunk_bounds(n, w, c) for c in range(w)]
    assert b[0][0] == 0 and b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(w - 1))
    assert max(h - lo for lo, h in b) - min(h - lo for lo, h in b) <= 1


@pytest.mark.parametrize("w", [2, 3, 5])
def test_ring_schedule_reduces_every_chunk(w):
    # simulate on sets: after the schedule every rank holds every chunk's full contribution set
    have = [[{r} for _ in range(w)] for r in range(w)]
    steps = co.ring_schedule(w)
    assert len(steps) == 2 * (w - 1)
    for k, step in enumerate(steps):
        msgs = [(dst, c, set(have[src][c])) for src, dst, c in step]
        for dst, c, s in msgs:
            have[dst][c] = have[dst][c] | s if k < w - 1 else s
    assert all(have[r][c] == set(range(w)) for r in range(w) for c in range(w))


def _simple(comm, which):
    x = torch.arange(6, dtype=torch.float32) * (comm.rank + 1)
    getattr(co, which)(x, comm)
    return x.numpy()


@pytest.mark.parametrize("which", ["naive_allreduce", "one_shot_allreduce"])
def test_simple_allreduces(which):
    out = dist.spawn(_simple, 3, which)
    assert all(np.allclose(o, np.arange(6) * 6) for o in out)


def test_bus_bandwidth_and_alpha_beta():
    assert co.bus_factor(2) == 1.0 and co.bus_factor(4) == 1.5 and co.bus_factor(1) == 0.0
    assert co.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5)
    sizes = np.array([4e3, 64e3, 1e6, 16e6, 256e6])
    fit = co.fit_alpha_beta(sizes, 20e-6 + sizes / 300e9)
    assert fit.alpha_us == pytest.approx(20, rel=1e-3) and fit.gbs == pytest.approx(300, rel=1e-3)
    assert co.ring_cost(1e9, 1, 10, 100) == 0.0
    with pytest.raises(ValueError, match="two or more"):
        co.fit_alpha_beta([1.0], [1.0])


# ============================================================================ ex11.1

def test_ex11_1_reference_passes(capsys):
    ex11_1(SOL.get("ex11.1", "ring_allreduce"))
    assert capsys.readouterr().out.strip() == "PASS ex11.1"


def test_ex11_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex11_1(SOL.stub("ex11.1", "ring_allreduce"))


@pytest.mark.parametrize("edits, match", [
    ([("range(w - 1)", "range(1)", 2)], "although world size 2 passed: a ring for two ranks"),
    ([("starts = [c * base + min(c, extra) for", "starts = [c * base for")],
     "the chunks drop the remainder"),
    ([("    if average:\n        x /= w", "    x /= w")], "average=False asks for the sum"),
    ([("    if average:\n        x /= w", "    pass")], "average=True asks for the mean"),
    ([("comm.sendrecv(chunk(send_c), right, incoming, left)",
       "comm.send(chunk(send_c), right); comm.recv(incoming, left)")],
     "did not finish within .* s .*sendrecv"),
])
def test_ex11_1_wrong_answers(edits, match):
    with pytest.raises(GradeError, match=match):
        ex11_1(SOL.get("ex11.1", "ring_allreduce", edits=edits))


def _all_reduce_answer(x, comm, average=False):
    comm.all_reduce(x)
    if average:
        x /= comm.world


def test_ex11_1_refuses_the_library_all_reduce():
    with pytest.raises(GradeError, match="called comm.all_reduce"):
        ex11_1(_all_reduce_answer)


# ============================================================================ ex11.2

def test_ex11_2_reference_passes(capsys):
    ex11_2(SOL.get("ex11.2", "make_buckets"))
    assert capsys.readouterr().out.strip() == "PASS ex11.2"


def test_ex11_2_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex11_2(SOL.stub("ex11.2", "make_buckets"))


@pytest.mark.parametrize("edits, match", [
    ([("reversed(range(len(params)))", "range(len(params))")], "forward .registration. order"),
    ([("size += p.numel() * p.element_size()", "size += p.numel()")], "in elements, not bytes"),
    ([("        if not p.requires_grad:\n            continue\n", "")], "requires_grad=False"),
    ([("        current.append(i)\n        size += p.numel() * p.element_size()\n"
       "        if size >= bucket_bytes:\n            buckets.append(current)\n"
       "            current, size = [], 0\n",
       "        nb = p.numel() * p.element_size()\n"
       "        if current and size + nb > bucket_bytes:\n            buckets.append(current)\n"
       "            current, size = [], 0\n        current.append(i)\n        size += nb\n")],
     "never close a bucket before adding"),
])
def test_ex11_2_wrong_answers(edits, match):
    with pytest.raises(GradeError, match=match):
        ex11_2(SOL.get("ex11.2", "make_buckets", edits=edits))


def test_reference_buckets_big_parameter_alone():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 1000, 10, 10)]
    assert ch11.reference_buckets(ps, 100) == [[3, 2, 1], [0]]


# ============================================================================ ex11.3

def test_ex11_3_reference_passes(capsys):
    ex11_3(SOL.get("ex11.3", "attach_overlap"))
    assert capsys.readouterr().out.strip() == "PASS ex11.3"


def test_ex11_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex11_3(SOL.stub("ex11.3", "attach_overlap"))


@pytest.mark.parametrize("edits, match", [
    ([("            state[\"pending\"].append((b, flat, comm.all_reduce(flat, async_op=True)))",
       "            state[\"pending\"].append((b, flat, None))"),
      ("            handle.wait()\n", "            comm.all_reduce(flat)\n")],
     "after the whole backward: no overlap"),
    ([("            flat /= comm.world\n", "")], "the gradient is the sum over ranks"),
    ([("== len(buckets[b]):", "== 1:")], "started before the gradient of"),
    ([("        state[\"ready\"] = [0] * len(buckets)\n", "")], "reset the per-bucket counters"),
])
def test_ex11_3_wrong_answers(edits, match):
    with pytest.raises(GradeError, match=match):
        ex11_3(SOL.get("ex11.3", "attach_overlap", edits=edits))


# ============================================================================ bad input

def test_allreduce_configs():
    import cudabook as cb

    ar = cb.load_launch("allreduce")
    assert ar.config("ring_step_add", 1 << 24, 132) == ((528,), (256,))     # 4 blocks per SM
    assert ar.config("ring_step_copy_bf16", 3, 132).grid == (1,)
    assert ar.config("one_shot_v2", 1 << 20, 132).grid == (ar.MAX_ONE_SHOT_BLOCKS,)
    assert ar.config("one_shot_v1", 1 << 20, 16).grid == (16,)             # all resident


def test_peer_group_refuses_fewer_than_two_gpus():
    import cudabook as cb

    ar = cb.load_launch("allreduce")
    if dist.gpu_count() >= 2:
        pytest.skip("this machine has 2 or more GPUs")
    with pytest.raises(cb.LaunchError, match="needs 2 or more GPUs of one host"):
        ar.PeerGroup()


def test_torchrun_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        dist.torchrun("allreduce_sweep", 0)
    with pytest.raises(FileNotFoundError, match="no script"):
        dist.torchrun(tmp_path / "missing.py", 2)
    with pytest.raises(FileNotFoundError,
                       match=r"scripts are \['allreduce_sweep', 'ddp_train', 'sharded_train', "
                             r"'tp_decode', 'tp_train'\]"):
        dist.torchrun("ddp_trian", 2)


def test_package_scripts_found_by_name():
    for name in ("allreduce_sweep", "ddp_train", "ddp_train.py"):
        p = dist.script_path(name)
        assert p.is_file() and p.parent.name == "dist_scripts", p


def test_torchrun_turns_a_hang_into_a_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(dist.DistTimeout, match="did not finish within 3 s"):
        dist.torchrun(script, 1, timeout=3)


# ============================================================================ GPUs (the lane)

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 1000, 4097, 1 << 20])
def test_p2p_allreduce_every_gpu_of_the_host(n):
    """The ring and both one-shots on every GPU of the host (2, 4, 8: any world size), at sizes
    that do not divide by the world and smaller than it: every GPU holds the exact sum."""
    import cupy as cp

    import cudabook as cb

    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    ar = cb.load_launch("allreduce")
    g = ar.PeerGroup()
    w = g.world
    want = (np.arange(n) % 61).astype(np.float32) * (w * (w + 1) // 2)
    for algo in ("ring", "v1", "v2"):
        ins, outs = [], []
        for r, d in enumerate(g.devices):
            with cp.cuda.Device(d):
                ins.append((cp.arange(n, dtype=cp.float32) % 61) * (r + 1))
                outs.append(cp.full(n, np.nan, cp.float32))
        if algo == "ring":
            g.ring(ins)
            outs = ins
        else:
            g.one_shot(ins, outs, version=algo)
        g.synchronize()
        for r, d in enumerate(g.devices):
            with cp.cuda.Device(d):
                np.testing.assert_array_equal(cp.asnumpy(outs[r]), want,
                                              err_msg=f"{algo} on GPU {d} of {w}, n={n}")


@pytest.mark.gpu
def test_p2p_ring_bf16_torch_tensors_and_refusals():
    """The ring on PyTorch bf16 tensors (zero copy): small integers, exact in bf16, sum exactly
    on every GPU, at a length with a ragged tail; mixed dtypes, 2-D and CPU tensors are refused."""
    import cudabook as cb

    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    g = cb.load_launch("allreduce").PeerGroup()
    w, n = g.world, 10007
    ts = [(torch.arange(n, device=f"cuda:{d}") % 13).to(torch.bfloat16) * (r + 1)
          for r, d in enumerate(g.devices)]
    g.ring(ts)
    g.synchronize()
    want = (torch.arange(n) % 13).float() * (w * (w + 1) // 2)
    for d, t in zip(g.devices, ts):
        assert torch.equal(t.float().cpu(), want), f"bf16 ring wrong on GPU {d}"
    with pytest.raises(cb.LaunchError, match="must all be float32 or all bfloat16"):
        g.ring([ts[0]] + [t.float() for t in ts[1:]])
    with pytest.raises(cb.LaunchError, match="1-D contiguous CUDA tensor"):
        g.ring([t.reshape(1, -1) for t in ts])
    with pytest.raises(cb.LaunchError, match="1-D contiguous CUDA tensor"):
        g.ring([t.cpu() for t in ts])


@pytest.mark.gpu
def test_dataparallel_p2p_replicas_stay_identical():
    """Training with the own ring on every GPU: after the steps every replica holds the same
    weights (the same summed gradients everywhere), and the timings are positive."""
    from cudabook import dataparallel

    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    r = dataparallel.train_p2p(list(range(dist.gpu_count())), steps=2, warmup=1, width=256,
                               layers=3, tokens=128)
    assert r["max_weight_spread"] == 0.0, r
    assert r["ms"] > 0 and r["ms_single"] > 0 and r["world"] == dist.gpu_count()


@pytest.mark.gpu
def test_cupy_nccl_or_a_reason(capsys):
    nccl = dist.cupy_nccl()
    if nccl is None:
        assert "skipped: CuPy finds no NCCL" in capsys.readouterr().out
    else:
        assert hasattr(nccl, "NcclCommunicator")


# ============================================================================ wrong answers that
# passed an earlier grader: each is rejected with the hint of its mistake (batched: each
# grader call spawns its gloo groups, about a second each)

_RING_WRONG = [
    # all of the remainder in the last chunk: right sums, but a chunk beyond ceil(n / world)
    ([("starts = [c * base + min(c, extra) for c in range(w + 1)]",
       "starts = [c * base for c in range(w)] + [n]"),
      ("buf = torch.empty(base + 1, dtype=x.dtype)", "buf = torch.empty(n, dtype=x.dtype)")],
     r"more than ceil\(n / world\).*not all to the last"),
    # the same chunking with the book's buffer, and a scratch buffer one element short
    ([("starts = [c * base + min(c, extra) for c in range(w + 1)]",
       "starts = [c * base for c in range(w)] + [n]")],
     r"another size than it expected.*not the last chunk all of the remainder"),
    ([("buf = torch.empty(base + 1, dtype=x.dtype)", "buf = torch.empty(base, dtype=x.dtype)")],
     r"scratch buffer must hold the largest chunk"),
    # the mean computed into a new tensor: the caller's x keeps the sum
    ([("        x /= w", "        x = x / w")], r"in place: x /= world"),
]


def test_ex11_1_more_wrong_answers():
    for edits, match in _RING_WRONG:
        with pytest.raises(GradeError, match=match):
            ex11_1(SOL.get("ex11.1", "ring_allreduce", edits=edits))


_BUCKET_WRONG = [
    # closes at > bucket_bytes: differs only when a running size hits the limit exactly
    ([("if size >= bucket_bytes:", "if size > bucket_bytes:")], r"\(>=, not >\)"),
    # a frozen parameter's bytes counted
    ([("        if not p.requires_grad:\n            continue\n        current.append(i)\n"
       "        size += p.numel() * p.element_size()\n",
       "        size += p.numel() * p.element_size()\n        if not p.requires_grad:\n"
       "            continue\n        current.append(i)\n")], "frozen parameter .* were counted"),
    # the last, smaller bucket dropped
    ([("    if current:\n        buckets.append(current)\n", "")], "the last bucket is missing"),
    # 4 bytes per element whatever the dtype
    ([("size += p.numel() * p.element_size()", "size += p.numel() * 4")],
     "every element counted as 4 bytes"),
]


def test_ex11_2_more_wrong_answers():
    for edits, match in _BUCKET_WRONG:
        with pytest.raises(GradeError, match=match):
            ex11_2(SOL.get("ex11.2", "make_buckets", edits=edits))


_OVERLAP_WRONG = [
    # the handle waited for in the hook: non-blocking in name, blocking in effect
    ([("state[\"pending\"].append((b, flat, comm.all_reduce(flat, async_op=True)))",
       "h = comm.all_reduce(flat, async_op=True)\n            h.wait()\n"
       "            state[\"pending\"].append((b, flat, h))")], "wait.. ran before the backward"),
    # finish() never waits: reads a flat tensor whose all-reduce may still run
    ([("            handle.wait()\n", "")], r"0 wait\(\) calls"),
    # the all-reduced values never copied back
    ([("                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))\n",
       "                q.grad.div_(comm.world)\n")], "own gradient / world: the all-reduced"),
]


def test_ex11_3_more_wrong_answers():
    for edits, match in _OVERLAP_WRONG:
        with pytest.raises(GradeError, match=match):
            ex11_3(SOL.get("ex11.3", "attach_overlap", edits=edits))


def _overlap_hook_on_last_listed(model, buckets, comm):
    """A wrong answer: launches each bucket from a hook on its last-listed parameter, assuming
    that this gradient arrives last (true for a Sequential, not in general)."""
    state = {"pending": []}

    def launch(b):
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[b]])
        state["pending"].append((b, flat, comm.all_reduce(flat, async_op=True)))

    for b, bk in enumerate(buckets):
        bk[-1].register_post_accumulate_grad_hook(lambda p, b=b: launch(b))

    def finish():
        for b, flat, h in state["pending"]:
            h.wait()
            flat /= comm.world
            o = 0
            for q in buckets[b]:
                q.grad.copy_(flat[o:o + q.numel()].view_as(q.grad))
                o += q.numel()
        state["pending"] = []
    return finish


def test_ex11_3_refuses_a_hook_on_the_last_listed_parameter_only():
    with pytest.raises(GradeError, match="layers registered last first.*count the bucket's"):
        ex11_3(_overlap_hook_on_last_listed)



# ============================================================================ ex11.4 (CUDA C++)
# The one-shot's flags, every rank on one GPU. The rubric (out written, a release, flags read
# with loads the compiler cannot hoist) is read from NVRTC's PTX, so it is graded on a CPU where
# CuPy is installed; the runs need a GPU. Wrong answers move or change the reference's phases,
# found by their comments.
from cudabook.graders import ex11_4  # noqa: E402
from cudabook.graders._static import cuda_ptx  # noqa: E402

_ONE_SHOT = ("ex11.4", "one_shot_src")
_RELEASE = ('asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(theirs), "r"(epoch) : '
            '"memory");')
_ACQUIRE = ('asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : '
            '"memory");')
gpu = pytest.mark.gpu
needs_nvrtc = pytest.mark.skipif(cuda_ptx("test", 'extern "C" __global__ void k() {}') is None,
                                 reason="NVRTC (CuPy) is not installed")


def _at(src: str, mark: str) -> int:
    """Where the line holding ``mark`` starts."""
    return src.rfind("\n", 0, src.index(mark)) + 1


def _phase(src: str, mark: str, until: str) -> str:
    """The lines from the one holding ``mark`` to the one holding ``until`` (not included)."""
    return src[_at(src, mark):_at(src, until)]


def _line(src: str, mark: str) -> str:
    return src[_at(src, mark):src.index("\n", src.index(mark)) + 1]


def _swap(src: str, a: tuple, b: tuple) -> list:
    """An edit that exchanges two adjacent phases, ``a`` then ``b``, each (mark, until)."""
    pa, pb = _phase(src, *a), _phase(src, *b)
    return [(pa + pb, pb + pa)]


_PUBLISH = ("// 1. publish", "// 2. announce")
_ANNOUNCE = ("// 2. announce", "// 3. wait")
_WAIT = ("// 3. wait", "// every peer's part is in")


def test_ex11_4_stub_fails():
    with pytest.raises(GradeError, match="ex11.4: not implemented yet"):
        ex11_4(SOL.stub(*_ONE_SHOT))


@needs_nvrtc
@pytest.mark.parametrize("make, hint", [
    # the flag raised with a plain store, nothing ordering the data before it
    (lambda s: [(_line(s, "__threadfence();"), ""),
                (_RELEASE, "*(volatile unsigned int*)theirs = epoch;")], "has no release"),
    # the flag polled with a plain load: the compiler may read it once
    (lambda s: [(_ACQUIRE, "v = *mine;")], "read with plain loads only"),
])
def test_ex11_4_rubric_refuses_on_any_machine(make, hint):
    with pytest.raises(GradeError, match=hint):
        ex11_4(SOL.get(*_ONE_SHOT, edits=make(SOL.get(*_ONE_SHOT))))


def test_ex11_4_hints_from_values_and_stamps():
    """The diagnosis of a wrong sum, on made-up runs: who finished before the late rank began,
    stale parts, the order of the additions, nothing written."""
    g = np.random.default_rng(0)
    data = [g.standard_normal(64).astype(np.float32) for _ in range(3)]
    prev = [g.standard_normal(64).astype(np.float32) for _ in range(3)]
    want = data[0] + data[1] + data[2]
    late = 2                                      # stamps: starts of ranks 0..2, then ends
    early = np.array([5, 5, 100, 10, 10, 200])    # ranks 0, 1 ended before rank 2 began
    waited = np.array([5, 5, 100, 150, 160, 200])
    stale = data[0] + data[1] + prev[2]
    hint = ch11._flag_hint
    assert "its wait did not wait" in hint(stale, want, data, prev, 0, late, early, 3, 0)
    assert "a flag left raised by an earlier call" in hint(stale, want, data, prev, 0, late,
                                                           early, 3, 1)
    assert "not yet all published" in hint(stale, want, data, prev, 0, late, waited, 3, 1)
    own_first = data[1] + (data[0] + data[2])
    assert not np.array_equal(own_first, want)
    assert "not in rank order" in hint(own_first, want, data, prev, 1, late, waited, 3, 0)
    assert "never written" in hint(np.full(64, np.nan, np.float32), want, data, prev, 0, late,
                                   waited, 3, 0)


@gpu
def test_ex11_4_reference_passes(capsys):
    ex11_4(SOL.get(*_ONE_SHOT))
    assert capsys.readouterr().out == "PASS ex11.4\n"


@gpu
@pytest.mark.parametrize("make, hint", [
    # waiting on its own slot (raised by itself) instead of the peer's
    (lambda s: [("flags[rank] + (size_t)threadIdx.x * G + b",
                 "flags[rank] + (size_t)rank * G + b")],
     "finished before rank \\d had even started: its wait did not wait"),
    # a constant flag, never reset: the second call sees the first call's flags
    (lambda s: [('"r"(epoch)', '"r"(1u)'), ("} while (v < epoch);", "} while (v < 1u);")],
     "a flag left raised by an earlier call"),
    # the flag raised before the part is published
    (lambda s: _swap(s, _PUBLISH, _ANNOUNCE), "not yet all published"),
    # the barrier after the wait left out: other threads read before the flags were seen
    (lambda s: [(_line(s, "// every peer's part is in"), "")], "not yet all published"),
    # wait, then announce: every rank waits for the others (stopped, with a hint)
    (lambda s: _swap(s, _ANNOUNCE, _WAIT), "waited for each other forever"),
    # its own part first: right to rounding, other bits on each rank
    (lambda s: [("for (int p = 0; p < world; ++p) s += pub[p][i];",
                 "for (int p = 0; p < world; ++p) s += pub[(rank + p) % world][i];")],
     "not in rank order"),
])
def test_ex11_4_wrong_answers_fail(make, hint):
    with pytest.raises(GradeError, match=hint):
        ex11_4(SOL.get(*_ONE_SHOT, edits=make(SOL.get(*_ONE_SHOT))))


def test_ex11_4_states_its_stub_size_and_has_two_hints():
    from solution_cells import check_exercise_page

    check_exercise_page("11", "ex11.4")


def test_torchrun_error_names_the_workers_exception(tmp_path):
    """A worker that raises: torchrun's summary says only "exitcode 1"; the DistError carries the
    worker's own traceback, even when the summary fills the last lines of the output."""
    script = tmp_path / "boom.py"
    script.write_text("import os\n"
                      "for i in range(40):\n    print('noise', i)\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    raise ValueError('boom on rank 0')\n")
    with pytest.raises(dist.DistError, match=r"(?s)first worker traceback.*ValueError: boom on "
                                             r"rank 0"):
        dist.torchrun(script, 2, timeout=120)
    log = "\n".join(["noise"] * 5 + ["Traceback (most recent call last):", '  File "x.py", line 1',
                                      "    boom()", "RuntimeError: the cause"]
                    + [f"torchrun summary {i}" for i in range(60)])
    msg = dist._tail(log)
    assert "RuntimeError: the cause" in msg and "torchrun summary 59" in msg
    assert "torchrun summary 10" not in msg             # the tail is still only the last lines
