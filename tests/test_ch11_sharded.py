"""Chapter 11, sharded data parallelism (cudabook.sharded): ZeRO-1, ZeRO-2 and ZeRO-3 against the
all-reduce baseline, PyTorch's DDP and FSDP2 and one process on all the batches, on gloo CPU
processes at N = 2, 3 and 4 (each world size spawned once, for every check), the memory ledger
against the paper model and its bound, the bytes per step against the formula and against the
ring's own messages, one rank in process, and bad input: a wrong world size, a different model
on one rank, a dead or stuck peer."""

from __future__ import annotations

import functools
import os
import time

import numpy as np
import pytest
import torch

from cudabook import dist, sharded

# one spawn per world size: N = 2 (AdamW; PyTorch's DDP and FSDP2 beside), N = 3 (biases, so the
# layers are 56 elements, and the chapter's ring), N = 4 (SGD with momentum); the model is 7 x 7
# x 5 = 245 weights (+ 35 biases), which none of 2, 3, 4 divides per layer
CASES = {
    2: dict(runs=(*sharded.STAGES, "torch_ddp", "fsdp2"), optimizer="adamw", bias=False),
    3: dict(runs=(*sharded.STAGES, "zero1/ring", "zero3/ring"), optimizer="adamw", bias=True),
    4: dict(runs=(*sharded.STAGES, "torch_ddp"), optimizer="sgd", bias=False),
}
WORLDS = sorted(CASES)


@functools.cache
def result(world: int) -> dict:
    return sharded.compare(world, steps=3, timeout=60, **CASES[world])


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ============================================================================ same as DDP

@pytest.mark.parametrize("world", WORLDS)
def test_every_stage_follows_ddp(world):
    res = result(world)
    base = res["runs"]["ddp"]
    assert base[0]["losses"][-1] < base[0]["losses"][0], "the baseline does not train"
    for name, per in res["runs"].items():
        for r, (got, ref) in enumerate(zip(per, base)):
            np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} rank {r}: losses differ from ddp's")
            np.testing.assert_allclose(got["params"], ref["params"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} rank {r}: parameters differ from ddp's")


@pytest.mark.parametrize("world", WORLDS)
def test_every_run_has_the_loss_of_one_process(world):
    """One process that trains on every rank's batch at once (the mean of the ranks' losses, so
    its gradient is their average, as the all-reduce makes it) gives each rank's loss at every
    step and the final parameters: every run, the ring's included, to float32 rounding."""
    cfg = CASES[world]
    model = sharded.make_model(7, 5, bias=cfg["bias"], dtype=torch.float32)
    opt = sharded._optimizer(list(model.parameters()), cfg["optimizer"], 1e-2)
    xs = [sharded._batch(r, 8, 7) for r in range(world)]
    want = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        per = [sharded._loss(model(x)) for x in xs]
        torch.stack(per).mean().backward()
        opt.step()
        want.append([float(v.detach()) for v in per])
    want = np.array(want)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    for name, per in result(world)["runs"].items():
        for r, got in enumerate(per):
            np.testing.assert_allclose(got["losses"], want[:, r], rtol=2e-6, atol=1e-9,
                                       err_msg=f"{name} rank {r}: losses differ from one "
                                               "process's")
            np.testing.assert_allclose(got["params"], params, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} rank {r}: parameters differ from one "
                                               "process's")


@pytest.mark.parametrize("world", WORLDS)
def test_gathered_parameters_are_bit_identical_on_every_rank(world):
    for name, per in result(world)["runs"].items():
        assert len(per) == world
        assert per[0]["params"].size == result(world)["params"]
        for r in range(1, world):
            assert np.array_equal(_bits(per[0]["params"]), _bits(per[r]["params"])), \
                f"{name}: rank {r}'s parameters are not rank 0's bits"


# ============================================================================ memory

@pytest.mark.parametrize("world", WORLDS)
def test_memory_ledger_matches_the_model_and_the_bound(world):
    res = result(world)
    peaks = {}
    for stage in sharded.STAGES:
        paper = sharded.memory_model(res["model"], stage, world, res["optimizer"])
        for r, rep in enumerate(res["runs"][stage]):
            got = rep["memory"]
            for k in ("peak", "peak_params", "peak_grads", "peak_optimizer"):
                assert got[k] == paper[k], f"{stage} rank {r}: {k} {got[k]} != model {paper[k]}"
        peaks[stage] = paper
    assert peaks["ddp"]["peak"] > peaks["zero1"]["peak"] > peaks["zero2"]["peak"] \
        > peaks["zero3"]["peak"]
    z3 = peaks["zero3"]
    assert z3["within_bound"] and z3["peak"] <= z3["ddp"] / world + z3["layer_bytes"]
    # zero1 and zero2 keep the replicated parameters: not within 1/N
    pad = -res["params"] % world                  # zero1 pads the whole flat buffer to N x shard
    assert peaks["zero1"]["peak_params"] == peaks["ddp"]["peak_params"] + 4 * pad


def test_memory_model_by_hand():
    # 7 x 7 x 5 float32, AdamW, N = 4: each layer 49 -> 52 elements padded, a 13-element shard
    model = sharded.make_model(7, 5, dtype=torch.float32)
    ddp = sharded.memory_model(model, "ddp", 4)
    assert ddp["peak"] == 245 * 4 * 2 + 5 * (2 * 49 * 4 + 4)          # p, g, (m, v, step) x 5
    z3 = sharded.memory_model(model, "zero3", 4)
    shard = 5 * 13 * 4
    assert z3["peak"] == shard + shard + 5 * (2 * 13 * 4 + 4) + 2 * 52 * 4   # + 2 gathered layers
    assert z3["peak_params"] == shard + 2 * 52 * 4
    sgd = sharded.memory_model(model, "zero1", 4, "sgd")
    assert sgd["peak_optimizer"] == (248 // 4) * 4                  # one momentum shard of 62


def test_memory_and_bytes_of_the_gpu_model_on_paper():
    # ddp_train's model (8192 x 8192 x 8, bf16) on the meta device: no memory, no time
    model = sharded.make_model(device="meta")
    P = 8 * 8192 * 8192
    for n in range(1, 9):
        for opt in sharded.OPTIMIZERS:
            z3 = sharded.memory_model(model, "zero3", n, opt)
            assert z3["within_bound"], (n, opt, z3)
        b = {s: sharded.step_bytes(model, s, n)["total"] for s in sharded.STAGES}
        exact = (8192 * 8192) % n == 0            # no padding: the ratios are exact
        for s, k in (("ddp", 2), ("zero1", 3), ("zero2", 2), ("zero3", 3)):
            want = k * (n - 1) * 2 * P / n                 # k passes of (N-1)/N of 2 P bytes
            assert b[s] == want if exact else b[s] == pytest.approx(want, rel=1e-6), (s, n)
    z3 = sharded.memory_model(model, "zero3", 8)
    assert z3["ratio_to_ddp"] < 0.2                 # 1/8 of 16 B/param + two 128 MiB layers


# ============================================================================ bytes

@pytest.mark.parametrize("world", WORLDS)
def test_bytes_per_step_match_the_formula_and_the_ring(world):
    res = result(world)
    for name, per in res["runs"].items():
        stage = name.split("/")[0]
        if stage not in sharded.STAGES:
            continue
        paper = sharded.step_bytes(res["model"], stage, world)
        for r, rep in enumerate(per):
            assert rep["bytes_per_step"] == paper, f"{name} rank {r}"
            if name.endswith("/ring"):      # counted from the messages Comm.sendrecv logged
                assert rep["ring_sent_bytes_per_step"] == paper["total"], f"{name} rank {r}"
    z2, z3 = (sharded.step_bytes(res["model"], s, world)["total"] for s in ("zero2", "zero3"))
    assert 2 * z3 == 3 * z2


@pytest.mark.parametrize("world", WORLDS)
def test_report_names_the_collectives_that_ran(world):
    for name, per in result(world)["runs"].items():
        if name.split("/")[0] not in sharded.STAGES:
            continue
        used = per[0]["collectives"]
        want = {"ddp": {"all_reduce"}, "zero1": {"all_reduce", "all_gather"},
                "zero2": {"reduce_scatter", "all_gather"},
                "zero3": {"reduce_scatter", "all_gather"}}[name.split("/")[0]]
        assert set(used) == want, name
        for how in used.values():
            assert ("ring" in how) if name.endswith("/ring") else ("(gloo)" in how), how


def _zero3_live_buffers(comm, algo):
    """Zero3 on this rank with every buffer it gathers (a layer's full weights) and every full
    gradient buffer watched by a finalizer on its storage: how many are really alive (freed, not
    just dropped from the ledger) when each layer asks for its weights and when each gradient
    buffer is made. The cyclic garbage collector is off during the steps, so a buffer counts as
    freed only once nothing refers to it (as on a GPU, where a lingering reference holds memory
    that torch.cuda.max_memory_allocated counts)."""
    import gc
    import weakref

    layers = 5
    eng = sharded.shard(sharded.make_model(8, layers, dtype=torch.float32), "zero3", comm,
                        algo=algo)
    live = {"full": 0, "grad": 0}
    seen = []                                        # (where, layer, full alive, grads alive)

    def gone(kind):
        live[kind] -= 1

    def settled(limit=2):
        # gloo's worker thread lets go of a finished Work (and the buffer it gathered into) a
        # moment after wait() returns: give it that moment; a buffer something keeps stays
        deadline = time.monotonic() + 0.5
        while live["full"] + live["grad"] > limit and time.monotonic() < deadline:
            time.sleep(0.002)
        return live["full"], live["grad"]

    def watch(kind, t):
        live[kind] += 1
        weakref.finalize(t.untyped_storage(), gone, kind)

    gather, grad_buffer, weights = eng._gather, eng.grad_buffer, eng.weights

    def counted_gather(u):
        had = u in eng.full
        gather(u)
        if u in eng.full and not had:
            watch("full", eng.full[u][0])

    def counted_grad_buffer(u):
        buf = grad_buffer(u)
        watch("grad", buf)
        seen.append(("grad", u, *settled()))
        return buf

    def counted_weights(u, backward):
        out = weights(u, backward)
        seen.append(("backward" if backward else "forward", u, *settled()))
        return out

    eng._gather, eng.grad_buffer, eng.weights = counted_gather, counted_grad_buffer, counted_weights
    x = sharded._batch(comm.rank, 8, 8)
    after = []
    gc.disable()
    try:
        for _ in range(3):
            eng.step(x)
            full, grads = settled(0)
            after.append({"full": full, "grad": grads})
    finally:
        gc.enable()
    return {"seen": seen, "after": after, "layers": layers}


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_zero3_holds_at_most_two_layers_full_at_once(algo):
    """What the ledger says zero3 holds is what it really holds: at most two layers' full weights
    (the one in use and the prefetched one), or one layer's weights and one full gradient, alive
    at any time, and none after a step. (A per-call class around torch's Work once kept every
    gathered buffer of a step alive until Python's cyclic collector ran: 11,968 MiB against
    FSDP2's 4,800 on two H200s.)"""
    for r, got in enumerate(dist.spawn(_zero3_live_buffers, 2, algo, timeout=30)):
        seen = got["seen"]
        assert len(seen) == 3 * 3 * got["layers"], f"rank {r}: {len(seen)} checkpoints"
        for where, u, full, grads in seen:
            assert full + grads <= 2, (f"rank {r}: {full} layers' full weights and {grads} full "
                                       f"gradients alive at layer {u}'s {where} (at most 2)")
            assert grads <= 1, f"rank {r}: {grads} full gradients alive at layer {u}'s {where}"
        assert max(full for _, _, full, _ in seen) == 2, f"rank {r}: no prefetch seen"
        assert got["after"] == [{"full": 0, "grad": 0}] * 3, \
            f"rank {r}: full buffers alive after a step: {got['after']}"


# ============================================================================ one rank

def test_one_rank_in_process_needs_no_group():
    x = sharded._batch(0, 8, 7)
    out = {}
    for stage in sharded.STAGES:
        eng = sharded.shard(sharded.make_model(7, 5, dtype=torch.float32), stage)
        losses = [float(eng.step(x)) for _ in range(3)]
        out[stage] = (losses, eng.gathered().numpy(), eng.report())
    for stage in sharded.STAGES:
        np.testing.assert_allclose(out[stage][0], out["ddp"][0], rtol=1e-6, err_msg=stage)
        np.testing.assert_allclose(out[stage][1], out["ddp"][1], rtol=1e-6, atol=1e-7,
                                   err_msg=stage)
        assert out[stage][2]["bytes_per_step"]["total"] == 0 and out[stage][2]["world"] == 1


def test_make_model_is_ddp_trains():
    from cudabook.dist_scripts.ddp_train import make_model

    a, b = make_model(16, 3, "cpu"), sharded.make_model(16, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.dtype == q.dtype == torch.bfloat16 and torch.equal(p, q)


# ============================================================================ bad input

def test_bad_world_sizes_and_names_are_refused():
    model = sharded.make_model(7, 2, dtype=torch.float32)
    for w in (0, -1, 2.5, True, "2", 10**6):
        with pytest.raises(ValueError, match="world size must be an int in 1..64"):
            sharded.compare(w)
        with pytest.raises(ValueError, match="world size must be an int"):
            sharded.memory_model(model, "zero3", w)
    with pytest.raises(ValueError, match="the chapter runs 1..8 ranks on one host"):
        sharded.compare(max(9, (os.cpu_count() or 1) + 1))
    with pytest.raises(ValueError, match="unknown run 'zero4'"):
        sharded.compare(2, runs=["zero4"])
    with pytest.raises(ValueError, match="unknown run 'ddp/ring'"):
        sharded.compare(2, runs=["ddp/ring"])
    with pytest.raises(ValueError, match="optimizer must be one of"):
        sharded.compare(2, optimizer="adam")
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        sharded.compare(2, steps=1)
    with pytest.raises(ValueError, match="stage must be one of"):
        sharded.shard(model, "zero4")
    with pytest.raises(ValueError, match="pass comm"):
        sharded.Collectives(0, 2, algo="ring")
    with pytest.raises(ValueError, match="algo must be one of"):
        sharded.shard(model, "zero1", algo="tree")
    conv = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(TypeError, match="has parameters but is not nn.Linear"):
        sharded.shard(conv, "zero3")
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        sharded.shard(torch.nn.Linear(4, 4), "zero2")


def _mismatch(comm, what):
    odd = comm.rank == 1
    width = 8 if (what == "shape" and odd) else 7
    seed = 1 if (what == "seed" and odd) else 0
    stage = "zero2" if (what == "stage" and odd) else "zero3"
    sharded.shard(sharded.make_model(width, 3, dtype=torch.float32, seed=seed), stage, comm)


@pytest.mark.parametrize("what, match", [
    ("stage", r"the ranks run different engines: rank (1 runs zero2|0 runs zero3) with adamw over "
              r"the native collectives, rank (0 zero3|1 zero2)"),
    ("shape", "the model differs between ranks: rank 1 has 3 parameter tensors of 192"),
    ("seed", "the initial weights differ between rank 0 and rank 1: build the model with the "
             "same seed"),
])
def test_a_different_model_on_one_rank_is_refused(what, match):
    with pytest.raises(dist.DistError, match=match):
        dist.spawn(_mismatch, 2, what, timeout=20)


def _peer_stops(comm, how):
    eng = sharded.shard(sharded.make_model(7, 5, dtype=torch.float32), "zero3", comm)
    x = sharded._batch(comm.rank, 8, 7)
    eng.step(x)
    if comm.rank == 2:
        if how == "dies":
            os._exit(3)
        time.sleep(60)                   # alive, but never joins the next collective
    for _ in range(3):
        eng.step(x)


@pytest.mark.parametrize("how, timeout, match", [
    ("dies", 20, r"rank 2 died \(exit code 3\)|a peer stopped"),
    ("stuck", 2, r"did not finish within 2 s|a peer stopped"),
])
def test_a_dead_or_stuck_peer_is_an_error_not_a_hang(how, timeout, match):
    t0 = time.monotonic()
    with pytest.raises(dist.DistError, match=match):
        dist.spawn(_peer_stops, 3, how, timeout=timeout)
    assert time.monotonic() - t0 < timeout + 5


# ============================================================================ GPUs

@pytest.mark.gpu
def test_gpu_timing_against_ddp_and_fsdp2():
    if not dist.need_gpus(2, "the sharded timing"):
        pytest.skip("needs 2 GPUs of one host")
    r = sharded.gpu_timing(2, width=2048, layers=4, batch=2048, steps=5, warmup=2)
    assert set(r["modes"]) == {"ddp", "allreduce", "zero1", "zero2", "zero3", "fsdp2"}
    for m, row in r["modes"].items():
        assert row["ms"] > 0 and row["peak_mib"] > 0, m
        np.testing.assert_allclose(row["losses"], r["modes"]["ddp"]["losses"], rtol=2e-2,
                                   err_msg=f"{m}: bf16 losses drift from ddp's")
    led = {m: r["modes"][m]["ledger"]["peak"] for m in ("allreduce", "zero1", "zero2", "zero3")}
    assert led["zero3"] < led["zero2"] < led["zero1"] < led["allreduce"]
    assert r["modes"]["zero3"]["peak_mib"] < r["modes"]["allreduce"]["peak_mib"]
