"""Chapter 11 at any world size: every data-parallel algorithm of the chapter on gloo CPU
processes at N = 1, 2, 3 and 4 against one process that trains on all the ranks' batches at once
(the same losses to float32 rounding) with bit-identical replicas, one spawn per world size:
the naive and one-shot all-reduces (bit for bit the rank-order sum), the DDP loop that Ray Train
runs (``ray_train.train_loop``), ``ddp_train.py``'s own buckets after and during the backward,
and the sharded script's every mode (``ray_train.sharded_loop``: PyTorch's DDP, the all-reduce
baseline, ZeRO-1, 2, 3, FSDP2). Then N = 1 ... 8 where no process is needed (the ring's
schedule, the tensor-parallel MLP on threads), ``sharded_train.py`` under torchrun on gloo, and
Ray Train's ``fit`` for the sharded loop (skipped, with the reason, where Ray is not installed).
The ring all-reduce itself is graded at N = 2, 3, 4 by ex11.1 (tests/test_ch11.py), the sharded
engines' memory and bytes in tests/test_ch11_sharded.py, tensor parallelism in
tests/test_ch11_tp.py."""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cudabook import collectives as co
from cudabook import dist, gpt, ray_train, sharded
from cudabook import tensor_parallel as tp
from cudabook.dist_scripts import ddp_train, sharded_train

WORLDS = [1, 2, 3, 4]
N_AR = 1003                      # all-reduce length: no world size of 2..4 divides it
DDP_CFG = {"width": 16, "layers": 2, "tokens": 8, "steps": 2, "warmup": 1, "lr": 0.1}
# 7 x 7 x 3 float32: a layer of 49 elements, which 2, 3, 4 do not divide (the padding is used)
SHARD_CFG = {"width": 7, "layers": 3, "tokens": 8, "steps": 2, "warmup": 1, "lr": 1e-2,
             "optimizer": "adamw"}
# sharded_train's modes that run an engine of cudabook.sharded, and its stage ("ddp" and "fsdp2"
# are PyTorch's own, without a ledger)
ENGINE_STAGE = {"allreduce": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}
BUCKET_CFG = {"width": 16, "layers": 3, "tokens": 8, "steps": 3, "lr": 0.1,
              "cap": 1500}        # two 1 KiB float32 weights fill a bucket: buckets of 2 and 1


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _ar_input(rank: int) -> np.ndarray:
    return np.random.default_rng([11, rank]).standard_normal(N_AR).astype(np.float32)


def _buckets_rank(comm, mode: str) -> dict:
    """ddp_train.py's step with its own buckets (``Buckets``: all-reduced after the backward,
    or each as soon as its gradients are ready), float32 on the CPU."""
    c = BUCKET_CFG
    model = ddp_train.make_model(c["width"], c["layers"], "cpu").float()
    hooks = ddp_train.Buckets(list(model.parameters()), c["cap"], comm.world,
                              overlap=(mode == "overlap"))
    opt = torch.optim.SGD(model.parameters(), lr=c["lr"])
    x = sharded._batch(comm.rank, c["tokens"], c["width"])
    losses = []
    for _ in range(c["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = sharded._loss(model(x))
        loss.backward()
        hooks.finish()
        opt.step()
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "params": flat.numpy().copy(),
            "buckets": [len(b) for b in hooks.buckets]}


def _rank(comm) -> dict:
    """Every algorithm on this rank, one after the other, on the same gloo group."""
    out: dict = {}
    x = torch.from_numpy(_ar_input(comm.rank))
    for name, f in (("naive", co.naive_allreduce), ("one_shot", co.one_shot_allreduce),
                    ("gloo", lambda t, cm: cm.all_reduce(t))):
        t = x.clone()
        f(t, comm)
        out[name] = t.numpy().copy()
    out["train_loop"] = ray_train.train_loop(DDP_CFG)
    for mode in ("after", "overlap"):
        out[f"buckets {mode}"] = _buckets_rank(comm, mode)
    for mode in sharded_train.MODES:
        out[mode] = ray_train.sharded_loop({**SHARD_CFG, "mode": mode})
    return out


@functools.cache
def result(world: int) -> list:
    # import here what every rank would import (the optimizers, FSDP2): the forks inherit it
    import importlib

    sharded._optimizer([torch.zeros(1, requires_grad=True)], "adamw", 1e-2)
    importlib.import_module("torch.distributed.fsdp")

    return dist.spawn(_rank, world, timeout=60)


def _one_process(make, opt_of, world: int, tokens: int, width: int, steps: int) -> tuple:
    """One process, every rank's batch at once: the loss is the mean of the ranks' losses, so its
    gradient is the ranks' gradients averaged, as the all-reduce gives them. Returns each rank's
    loss at every step (steps x world) and the parameters at the end, flat."""
    model = make()
    opt = opt_of(list(model.parameters()))
    xs = [sharded._batch(r, tokens, width) for r in range(world)]
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        per = [sharded._loss(model(x)) for x in xs]
        torch.stack(per).mean().backward()
        opt.step()
        losses.append([float(v.detach()) for v in per])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return np.array(losses), flat.numpy()


def _same_losses(got: list, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9,
                               err_msg=f"{what}: the losses differ from one process's")


# ============================================================================ the all-reduces

@pytest.mark.parametrize("world", WORLDS)
def test_naive_and_one_shot_are_the_rank_order_sum_bit_for_bit(world):
    """Both add the ranks' buffers in rank order on every rank: the bits of the one-process sum
    x_0 + x_1 + ... on every rank; gloo's own all-reduce gives every rank the same bits."""
    res = result(world)
    ref = _ar_input(0).copy()
    for r in range(1, world):
        ref += _ar_input(r)                       # float32, in rank order
    for r, got in enumerate(res):
        for name in ("naive", "one_shot"):
            assert np.array_equal(_bits(got[name]), _bits(ref)), \
                f"world {world}, rank {r}: {name} is not the rank-order sum bit for bit"
        assert np.array_equal(_bits(got["gloo"]), _bits(res[0]["gloo"])), \
            f"world {world}: gloo's all-reduce gave ranks 0 and {r} different bits"
        np.testing.assert_allclose(got["gloo"], ref, rtol=1e-5, atol=1e-5 * world)


# ============================================================================ DDP

@pytest.mark.parametrize("world", WORLDS)
def test_ddp_loop_of_ray_train_has_the_loss_of_one_process(world):
    c = DDP_CFG
    steps = c["warmup"] + c["steps"]
    want, _ = _one_process(lambda: ddp_train.make_model(c["width"], c["layers"], "cpu").float(),
                           lambda ps: torch.optim.SGD(ps, lr=c["lr"]), world, c["tokens"],
                           c["width"], steps)
    assert want[-1].mean() < want[0].mean(), "the one-process reference does not train"
    for r, got in enumerate(result(world)):
        m = got["train_loop"]
        assert m["world"] == world and m["backend"] == "gloo" and m["replicas_equal"], m
        assert m["loss"] == m["losses"][-1] and m["ms"] > 0
        _same_losses(m["losses"], want[:, r], f"train_loop, world {world}, rank {r}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["after", "overlap"])
def test_ddp_train_buckets_have_the_loss_of_one_process(world, mode):
    """ddp_train.py's buckets (the lesson's "after" and "overlap" rows), in backward order:
    the losses of one process and bit-identical weights on every rank."""
    c = BUCKET_CFG
    want, params = _one_process(
        lambda: ddp_train.make_model(c["width"], c["layers"], "cpu").float(),
        lambda ps: torch.optim.SGD(ps, lr=c["lr"]), world, c["tokens"], c["width"], c["steps"])
    per = [got[f"buckets {mode}"] for got in result(world)]
    assert per[0]["buckets"] == [2, 1], per[0]["buckets"]
    for r, got in enumerate(per):
        _same_losses(got["losses"], want[:, r], f"buckets {mode}, world {world}, rank {r}")
        assert np.array_equal(_bits(got["params"]), _bits(per[0]["params"])), \
            f"buckets {mode}, world {world}: rank {r}'s weights are not rank 0's bits"
        np.testing.assert_allclose(got["params"], params, rtol=1e-5, atol=1e-6)


# ============================================================================ sharded

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", sharded_train.MODES)
def test_sharded_script_modes_have_the_loss_of_one_process(world, mode):
    """sharded_train.py's build for every mode (ray_train.sharded_loop, the loop Ray Train runs):
    the losses of one process on all the batches, every rank's gathered parameters the same
    bits; the engines' bytes and ledger as counted on paper."""
    c = SHARD_CFG
    steps = c["warmup"] + c["steps"]
    want, _ = _one_process(
        lambda: sharded.make_model(c["width"], c["layers"], dtype=torch.float32),
        lambda ps: sharded._optimizer(ps, c["optimizer"], c["lr"]), world, c["tokens"],
        c["width"], steps)
    paper = sharded.make_model(c["width"], c["layers"], dtype=torch.float32)
    for r, got in enumerate(result(world)):
        m = got[mode]
        assert m["mode"] == mode and m["world"] == world and m["replicas_equal"], m
        assert m["params"] == c["layers"] * c["width"] ** 2
        _same_losses(m["losses"], want[:, r], f"{mode}, world {world}, rank {r}")
        stage = ENGINE_STAGE.get(mode)
        if stage:
            assert m["bytes_per_step"] == sharded.step_bytes(paper, stage, world)["total"]
            assert m["peak_bytes"] == sharded.memory_model(paper, stage, world)["peak"]
        else:
            assert m["bytes_per_step"] is None and m["peak_bytes"] is None


# ============================================================================ N = 1 ... 8

@pytest.mark.parametrize("world", range(1, 9))
def test_ring_schedule_and_chunks_at_every_world_size(world):
    """On labels, no process: after the ring's 2 (N - 1) steps every rank holds every rank's
    contribution to every chunk, each rank sends one chunk a step, and the chunks of a ragged
    length cover it exactly."""
    steps = co.ring_schedule(world)
    assert len(steps) == 2 * (world - 1)
    have = [[{r} for _ in range(world)] for r in range(world)]
    for k, step in enumerate(steps):
        assert sorted(s for s, _, _ in step) == list(range(world))
        msgs = [(dst, c, set(have[src][c])) for src, dst, c in step]
        for dst, c, s in msgs:
            have[dst][c] = have[dst][c] | s if k < world - 1 else s
    assert all(have[r][c] == set(range(world)) for r in range(world) for c in range(world))
    bounds = [co.chunk_bounds(N_AR, world, c) for c in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == N_AR
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(world - 1))


CFG_TP = gpt.GPTConfig(vocab=16, d=12, n_layer=1, n_head=3, ctx=4)     # MLP hidden 48


@pytest.mark.parametrize("world", range(1, 9))
def test_tensor_parallel_mlp_at_every_world_size(world):
    """The MLP split over N threads of this process (the reference list reducer), N = 1 ... 8:
    equal to the unsplit MLP to float32 rounding where N divides the hidden size 48 (1, 2, 3,
    4, 6, 8); refused with the sizes that would work where it does not (5, 7)."""
    blk = gpt.build(CFG_TP, seed=0).blocks[0]
    x = torch.randn(2, 3, CFG_TP.d, generator=torch.Generator().manual_seed(3))
    if 48 % world:
        with pytest.raises(tp.TensorParallelError, match=f"not divisible by world={world}"):
            tp.ParallelMLP(blk.fc, blk.fc2, 0, world, lambda t: None)
        return
    with torch.no_grad():
        ref = blk.fc2(F.gelu(blk.fc(x), approximate="tanh"))
        grp = tp.ThreadGroup(world, tp.local_sum, timeout=30)
        outs = tp.run_threads(lambda r, ar: tp.ParallelMLP(blk.fc, blk.fc2, r, world, ar)(x), grp)
    for r, y in enumerate(outs):
        assert float((y.detach() - ref).abs().max()) <= 2e-6 * float(ref.abs().max()), r


# ============================================================================ the script

def test_sharded_train_script_on_gloo():
    """dist_scripts/sharded_train.py end to end under torchrun on 2 gloo CPU processes
    (--device cpu): every mode ran, followed DDP's losses, and the engines' bytes and ledger are
    the counts on paper of the script's own model."""
    args = ["--device", "cpu", "--width", "7", "--layers", "3", "--batch", "8", "--steps", "1",
            "--warmup", "2", "--lr", "1e-2"]
    r = dist.torchrun("sharded_train", 2, args=args, timeout=120)
    assert r["world"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
    assert set(r["modes"]) == set(sharded_train.MODES)
    for m, row in r["modes"].items():
        assert row["ms"] > 0 and row["peak_mib"] is None, m
        np.testing.assert_allclose(row["losses"], r["modes"]["ddp"]["losses"], rtol=2e-6,
                                   err_msg=f"{m}: losses differ from DDP's")
        stage = ENGINE_STAGE.get(m)
        if stage:
            assert row["bytes_per_step"] == r["step_bytes"][stage], m
            assert row["ledger"]["peak"] == r["memory_model"][stage]["peak"], m


# ============================================================================ Ray Train

def test_sharded_loop_is_refused_with_the_reason(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "ray", None)              # as if it were not installed
    importlib.reload(ray_train)
    with pytest.raises(ValueError, match=r"loop must be one of \('ddp', 'sharded'\)"):
        ray_train.fit(num_workers=2, loop="fsdp")
    with pytest.raises(ValueError, match=r"config\['mode'\] must be one of"):
        ray_train.fit(num_workers=2, loop="sharded", config={"mode": "zero4"})
    with pytest.raises(ImportError, match=r'pip install "ray\[train\]"'):
        ray_train.fit(num_workers=2, loop="sharded", config={"mode": "zero2"})
    with pytest.raises(RuntimeError, match="sharded_loop: torch.distributed is not initialised"):
        ray_train.sharded_loop({})


def test_ray_train_fit_sharded_when_installed(tmp_path):
    ray = pytest.importorskip("ray", reason='Ray Train is not installed (pip install '
                                            '"ray[train]"): Ray is an optional extra')
    pytest.importorskip("ray.train.torch", reason='Ray Train is not installed (pip install '
                                                  '"ray[train]"): Ray is an optional extra')
    try:
        m = ray_train.fit(num_workers=2, use_gpu=False, loop="sharded",
                          storage_path=str(tmp_path), config={**SHARD_CFG, "mode": "zero3"})
    finally:
        ray.shutdown()
    assert m["replicas_equal"] and m["world"] == 2 and m["backend"] == "gloo", m
    assert m["mode"] == "zero3" and m["params"] == SHARD_CFG["layers"] * SHARD_CFG["width"] ** 2
    want, _ = _one_process(
        lambda: sharded.make_model(SHARD_CFG["width"], SHARD_CFG["layers"], dtype=torch.float32),
        lambda ps: sharded._optimizer(ps, "adamw", SHARD_CFG["lr"]), 2, SHARD_CFG["tokens"],
        SHARD_CFG["width"], SHARD_CFG["warmup"] + SHARD_CFG["steps"])
    _same_losses(m["losses"], want[:, 0], "Ray Train, zero3, rank 0")
