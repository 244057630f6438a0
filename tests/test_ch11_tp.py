"""Chapter 11, scaling out: tensor parallelism (cudabook.tensor_parallel) against the unsplit GPT
on gloo CPU processes (world 2, 3, 4; each world size spawned once, every check batched inside)
and on threads of one process; the corrected multi-node cost model (collectives); the torchrun
multi-node command lines (dist); Ray Train's loop (ray_train) under dist.spawn, and fit() where
Ray is installed. The GPU tests (marked gpu) run the one-host all-reduce (the book's one-shot
below a threshold, NCCL above) and the crossover measurement."""

from __future__ import annotations

import os
import shlex
import sys

import pytest
import torch
import torch.nn.functional as F

from cudabook import collectives as co
from cudabook import dist, gpt, ray_train
from cudabook import tensor_parallel as tp

CFG = gpt.GPTConfig(vocab=32, d=48, n_layer=2, n_head=12, ctx=8)   # 12 heads, hidden 192
B, T = 2, 5
TOL = 2e-6          # largest |split - unsplit| / largest |unsplit|: fp32 rounding of the sums


def _rel(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _rows(w, r, n):
    """Rank r's block of n along dim 0 (the test's own slicing, not the module's)."""
    k = w.shape[0] // n
    return w[r * k:(r + 1) * k]


def _cols(w, r, n):
    k = w.shape[1] // n
    return w[:, r * k:(r + 1) * k]


def _qkv_rows(w, r, n):
    H, D, d = CFG.n_head, CFG.head_dim, CFG.d
    h = H // n
    return w.reshape(3, H, D, d)[:, r * h:(r + 1) * h].reshape(-1, d)


def _checks(rank: int, world: int, ar, dev: str = "cpu") -> dict:
    """Every check of one rank: MLP, attention, block and the whole GPT split over the ranks
    against the unsplit model (the same weights and inputs on every rank), forward and every
    gradient; and how many all-reduces each ran. Returns {name: relative error} and counts."""
    model = gpt.build(CFG, seed=0, device=dev)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, T, CFG.d, generator=g).to(dev)
    wy = torch.randn(B, T, CFG.d, generator=g).to(dev)     # loss = sum(y * wy): rich gradients
    ids = torch.randint(0, CFG.vocab, (B, T), generator=g).to(dev)
    wl = torch.randn(B, T, CFG.vocab, generator=g).to(dev)
    cos, sin = model.cos[:T], model.sin[:T]
    blk = model.blocks[0]
    err, logs = {}, {}

    def run(fn_ref, fn_tp, weight, grads, name, mod):
        model.zero_grad(set_to_none=True)
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr = fn_ref(xr)
        (yr * weight).sum().backward()
        yt = fn_tp(xt)
        logs[name + " forward"] = [e[0] for e in mod.log]
        (yt * weight).sum().backward()
        logs[name] = [e[0] for e in mod.log]
        err[f"{name} y"] = _rel(yt, yr)
        if xt.grad is not None:
            err[f"{name} dx"] = _rel(xt.grad, xr.grad)
        for label, got, want in grads():
            err[f"{name} {label}"] = _rel(got, want)

    mlp = tp.ParallelMLP(blk.fc, blk.fc2, rank, world, ar)
    run(lambda v: blk.fc2(F.gelu(blk.fc(v), approximate="tanh")), mlp, wy,
        lambda: [("d fc", mlp.fc.weight.grad, _rows(blk.fc.weight.grad, rank, world)),
                 ("d fc2", mlp.fc2.weight.grad, _cols(blk.fc2.weight.grad, rank, world))],
        "mlp", mlp)

    att = tp.ParallelAttention(blk.qkv, blk.proj, CFG.n_head, rank, world, ar)

    run(lambda v: _att_only(blk, v), lambda v: att(v, cos, sin), wy,
        lambda: [("d qkv", att.qkv.weight.grad, _qkv_rows(blk.qkv.weight.grad, rank, world)),
                 ("d proj", att.proj.weight.grad, _cols(blk.proj.weight.grad, rank, world))],
        "attention", att)

    pb = tp.ParallelBlock(blk, rank, world, ar)
    run(lambda v: blk(v, cos, sin), lambda v: pb(v, cos, sin), wy,
        lambda: [("d ln1.w", pb.ln1.weight.grad, blk.ln1.weight.grad),
                 ("d ln1.b", pb.ln1.bias.grad, blk.ln1.bias.grad),
                 ("d ln2.w", pb.ln2.weight.grad, blk.ln2.weight.grad),
                 ("d fc", pb.mlp.fc.weight.grad, _rows(blk.fc.weight.grad, rank, world)),
                 ("d qkv", pb.attn.qkv.weight.grad, _qkv_rows(blk.qkv.weight.grad, rank, world))],
        "block", pb)

    net = tp.ParallelGPT(model, rank, world, ar)
    last = model.blocks[-1]
    run(lambda v: model(ids), lambda v: net(ids), wl,
        lambda: [("d wte", net.wte.weight.grad, model.wte.weight.grad),
                 ("d head", net.head.weight.grad, model.head.weight.grad),
                 ("d ln_f", net.ln_f.weight.grad, model.ln_f.weight.grad),
                 ("d last fc2", net.blocks[-1].mlp.fc2.weight.grad,
                  _cols(last.fc2.weight.grad, rank, world)),
                 ("d last proj", net.blocks[-1].attn.proj.weight.grad,
                  _cols(last.proj.weight.grad, rank, world))],
        "gpt", net)
    return {"err": err, "logs": logs, "rank": rank}


def _att_only(blk, v):
    """The unsplit attention of a block (qkv, RoPE, causal SDPA, proj), no LayerNorm/residual."""
    Bv, Tv, d = v.shape
    H, D = CFG.n_head, CFG.head_dim
    cos, sin = gpt.rope_tables(CFG, Tv, v.device)
    q, k, w = blk.qkv(v).view(Bv, Tv, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k = gpt._rope(q, cos, sin), gpt._rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, w, is_causal=True)
    return blk.proj(o.transpose(1, 2).reshape(Bv, Tv, d))


def _rank(comm, with_ddp: bool):
    out = _checks(comm.rank, comm.world, tp.TorchAllReduce())
    if with_ddp:      # the Ray Train loop on the same gloo group (no Ray needed)
        out["ddp"] = ray_train.train_loop({"width": 16, "layers": 2, "tokens": 8, "steps": 2,
                                           "warmup": 1})
    return out


def _assert_all(results, world, tol=TOL):
    for res in results:
        bad = {k: v for k, v in res["err"].items() if not v <= tol}
        assert not bad, f"world {world}, rank {res['rank']}: split != unsplit: {bad}"
        lg = res["logs"]
        # Megatron: one all-reduce in forward (g), one in backward (f), per split layer
        assert lg["mlp forward"] == ["forward g"] and lg["mlp"] == ["forward g", "backward f"]
        assert lg["attention"] == ["forward g", "backward f"]
        assert lg["block forward"] == ["forward g"] * 2 and sorted(lg["block"]) == \
            ["backward f"] * 2 + ["forward g"] * 2
        assert len(lg["gpt"]) == 4 * CFG.n_layer and len(lg["gpt forward"]) == 2 * CFG.n_layer


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_equals_unsplit_on_gloo(world):
    """MLP, attention, block and GPT over gloo processes: forward and every gradient equal the
    unsplit model's to fp32 rounding, 2 all-reduces per block each way (world 2 also runs the
    Ray Train loop, DDP on the same processes)."""
    res = dist.spawn(_rank, world, world == 2, timeout=60)
    _assert_all(res, world)
    if world == 2:
        d = [r["ddp"] for r in res]
        assert all(m["replicas_equal"] and m["world"] == 2 and m["backend"] == "gloo"
                   for m in d), d
        assert d[0]["ms"] == d[1]["ms"] > 0 and d[0]["params"] == 2 * 16 * 16


def test_split_equals_unsplit_on_threads():
    """The same checks with the ranks as threads of one process (ThreadGroup, the reference
    list reducer): the path the book's one-shot kernel takes on GPUs of one host."""
    grp = tp.ThreadGroup(2, tp.local_sum, timeout=30)
    res = tp.run_threads(lambda r, ar: _checks(r, 2, ar), grp)
    _assert_all(res, 2)


# ============================================================================ refusals

def _noop(t):
    return None


def test_bad_splits_are_refused_with_the_reason():
    small = gpt.build(gpt.GPTConfig(vocab=8, d=12, n_layer=1, n_head=3, ctx=4), seed=0)
    b = small.blocks[0]
    with pytest.raises(tp.TensorParallelError,
                       match=r"3 heads cannot be split over 2 ranks.*one of \[1, 3\]"):
        tp.ParallelAttention(b.qkv, b.proj, 3, 0, 2, _noop)
    with pytest.raises(tp.TensorParallelError, match="3 heads cannot be split over 2 ranks"):
        tp.ParallelGPT(small, 1, 2, _noop)
    with pytest.raises(tp.TensorParallelError, match="hidden size 48 is not divisible by world=5"):
        tp.ParallelMLP(b.fc, b.fc2, 0, 5, _noop)
    with pytest.raises(tp.TensorParallelError, match=r"rank 2 is not in 0\.\.1"):
        tp.ParallelMLP(b.fc, b.fc2, 2, 2, _noop)
    with pytest.raises(tp.TensorParallelError, match="world must be an int >= 1"):
        tp.ParallelMLP(b.fc, b.fc2, 0, 0, _noop)
    with pytest.raises(tp.TensorParallelError, match="allreduce must be a callable"):
        tp.ParallelMLP(b.fc, b.fc2, 0, 2, None)
    with pytest.raises(tp.TensorParallelError, match="world=4 but the all-reduce spans 2"):
        tp.ParallelMLP(b.fc, b.fc2, 0, 4, tp.ThreadGroup(2, tp.local_sum).member(0))
    with pytest.raises(tp.TensorParallelError, match=r"expected shape \(12, 48\)"):
        tp.ParallelMLP(b.fc, b.fc, 0, 1, _noop)
    with pytest.raises(tp.TensorParallelError, match="cannot be split over 5 ranks"):
        tp.split(torch.zeros(12, 3), 0, 5, 0)
    mlp = tp.ParallelMLP(b.fc, b.fc2, 0, 1, _noop)
    with pytest.raises(tp.TensorParallelError, match=r"expects x of shape \(\.\.\., 12\)"):
        mlp(torch.zeros(2, 5, 13))
    att = tp.ParallelAttention(b.qkv, b.proj, 3, 0, 1, _noop)
    with pytest.raises(tp.TensorParallelError, match="cos and sin must be"):
        att(torch.zeros(1, 3, 12), *gpt.rope_tables(small.cfg, 4))
    with pytest.raises(tp.TensorParallelError, match="torch.distributed is not initialised"):
        tp.TorchAllReduce()
    with pytest.raises(tp.TensorParallelError, match="max_bytes must be an int"):
        tp.Threshold(_noop, _noop, -1)


def test_threshold_sends_small_and_large_messages_apart():
    seen = []
    def size(t):
        return (t[0] if isinstance(t, list) else t).numel()

    th = tp.Threshold(lambda t: seen.append(("small", size(t))),
                      lambda t: seen.append(("large", size(t))), max_bytes=64)
    th(torch.zeros(16))                   # 64 bytes: small
    th(torch.zeros(17))                   # 68 bytes: large
    th([torch.zeros(4, dtype=torch.float64)] * 2)   # a list reducer's call: 32 bytes per rank
    assert seen == [("small", 16), ("large", 17), ("small", 4)]
    assert th.calls == {"small": 2, "large": 1}


def test_threads_fail_fast_never_hang():
    def one_fails(r, ar):
        if r == 1:
            raise ValueError("boom on rank 1")
        ar(torch.ones(3))                 # rank 0 waits here for rank 1, which never comes

    with pytest.raises(tp.TensorParallelError, match="rank 1 of 2 failed: ValueError: boom"):
        tp.run_threads(one_fails, tp.ThreadGroup(2, tp.local_sum, timeout=20))

    def sizes_differ(r, ar):
        ar(torch.ones(3 + r))

    grp = tp.ThreadGroup(2, tp.local_sum, timeout=20)
    with pytest.raises(tp.TensorParallelError, match="every rank must reduce a tensor of the same"):
        tp.run_threads(sizes_differ, grp)

    def ok(r, ar):
        t = torch.full((3,), float(r + 1))
        ar(t)
        return t.tolist()

    assert tp.run_threads(ok, grp) == [[3.0] * 3] * 2         # the group works again


def test_gpu_parts_say_why_they_skip(capsys):
    if dist.gpu_count() >= 2:
        pytest.skip("this machine has 2 or more GPUs: the gpu tests below run instead")
    assert tp.measure_crossover() is None
    assert "skipped: the one-shot / NCCL crossover needs 2 or more GPUs" in capsys.readouterr().out
    import cudabook as cb

    with pytest.raises(cb.LaunchError, match="needs 2 or more GPUs of one host"):
        tp.one_host()
    with pytest.raises(tp.TensorParallelError, match="threshold_bytes .* > the one-shot's"):
        tp.one_host(threshold_bytes=1 << 30)
    with pytest.raises(tp.TensorParallelError, match="large is 'nccl' or 'ring'"):
        tp.one_host(large="tree")


def test_tp_train_script_on_gloo():
    """dist_scripts/tp_train.py (the lesson's GPU timing) end to end on 2 gloo CPU processes at a
    tiny size: every part ran, the split matched the unsplit model, torch's own split too."""
    cfg = gpt.GPTConfig(vocab=64, d=32, n_layer=2, n_head=4, ctx=16)
    r = tp.gpu_timing(2, batch=2, seq=16, steps=1, warmup=1, device="cpu", cfg=cfg, timeout=240)
    assert r["world"] == 2 and r["backend"] == "gloo" and r["tokens"] == 32
    assert set(r["ms"]) == {"mlp book", "mlp torch TP", "block book", "gpt book", "all-reduce"}
    assert all(v > 0 for k, v in r["ms"].items() if k != "all-reduce"), r["ms"]
    c = r["check"]
    for k in ("mlp output", "mlp torch TP output", "block output"):
        assert c[k] <= 1e-5 * max(c["block scale"], c["mlp scale"]), (k, c)
    assert c["mlp fc grad"] <= 1e-6, c
    assert abs(c["gpt loss"][0] - c["gpt loss"][1]) <= 1e-5 * abs(c["gpt loss"][1]), c
    assert r["message_bytes"] == 32 * 32 * 4
    with pytest.raises(tp.TensorParallelError, match="world must divide n_head"):
        tp.gpu_timing(3, device="cpu", cfg=cfg)


# ============================================================================ across nodes

def test_internode_bound_worked_example():
    """8-GPU node with 8 ConnectX-7 (400 Gb/s) against the same node with one card: published
    NVLink 4 (900 GB/s both ways, 450 one way) and NIC speeds."""
    assert co.NVLINK4_GBS == 450.0 and co.CONNECTX7_GBIT == 400.0
    eight = co.internode_bus_bound(co.NVLINK4_GBS, 8)
    one = co.internode_bus_bound(co.NVLINK4_GBS, 1)
    assert (eight.network_gbs, eight.bus_gbs, eight.limit) == (400.0, 400.0, "network")
    assert (one.network_gbs, one.bus_gbs, one.limit) == (50.0, 50.0, "network")
    assert co.internode_bus_bound(300.0, 8).limit == "NVLink"
    assert co.internode_bus_bound(300.0, 8).bus_gbs == 300.0
    assert str(eight) == "bus <= min(NVLink 450, 8 NICs x 50 = 400) = 400 GB/s (network-bound)"
    # 1 GiB across 2 nodes x 8 GPUs, no latency: 2 (N-1)/N S / bus
    s = 1 << 30
    t8 = co.multinode_ring_cost(s, 2, 8, 0.0, co.NVLINK4_GBS, 8)
    t1 = co.multinode_ring_cost(s, 2, 8, 0.0, co.NVLINK4_GBS, 1)
    assert t8 == pytest.approx(2 * 15 / 16 * s / 400e9) and t1 == pytest.approx(8 * t8)
    # one node: NVLink only, whatever the cards; and the existing ring_cost is unchanged
    assert co.multinode_ring_cost(s, 1, 8, 5.0, 450.0, 1) == co.ring_cost(s, 8, 5.0, 450.0)
    assert co.ring_cost(1e9, 1, 10, 100) == 0.0
    for bad, match in [(dict(nvlink_gbs=0, nics_per_node=8), "nvlink_gbs must be a positive"),
                       (dict(nvlink_gbs=450, nics_per_node=0), "nics_per_node must be an int"),
                       (dict(nvlink_gbs=450, nics_per_node=8, nic_gbit=-1), "nic_gbit must")]:
        with pytest.raises(ValueError, match=match):
            co.internode_bus_bound(**bad)
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        co.multinode_ring_cost(s, 0, 8, 0.0, 450.0, 8)


def test_torchrun_multinode_command_lines():
    lines = dist.torchrun_commands("ddp_train", 8, 2, "head:29500", rdzv_id="job7",
                                   args=["--width", "8192"])
    assert lines == [
        f"torchrun --nnodes 2 --node-rank {i} --nproc-per-node 8 --rdzv-backend c10d "
        "--rdzv-endpoint head:29500 --rdzv-id job7 -m cudabook.dist_scripts.ddp_train "
        "--width 8192" for i in (0, 1)]
    slurm = dist.torchrun_commands("ddp_train", 8, 4, "$HEAD_NODE:29500",
                                   node_rank="$SLURM_NODEID")
    assert slurm == ['torchrun --nnodes 4 --node-rank "$SLURM_NODEID" --nproc-per-node 8 '
                     '--rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:29500" --rdzv-id cudabook '
                     '-m cudabook.dist_scripts.ddp_train']
    assert dist.torchrun_command("allreduce_sweep", 2) == [
        "torchrun", "--standalone", "--nproc-per-node", "2", "-m",
        "cudabook.dist_scripts.allreduce_sweep"]
    # torchrun's own parser reads them as meant
    from torch.distributed.run import get_args_parser

    a = get_args_parser().parse_args(shlex.split(lines[1])[1:])
    assert (a.nnodes, a.node_rank, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint,
            a.rdzv_id, a.module, a.training_script, a.training_script_args) == (
        "2", 1, "8", "c10d", "head:29500", "job7", True, "cudabook.dist_scripts.ddp_train",
        ["--width", "8192"])
    for kw, match in [(dict(nnodes=2), "2 nodes need rdzv_endpoint"),
                      (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), r"not in 0\.\.1"),
                      (dict(nnodes=2, rdzv_endpoint="head"), "must be host:port"),
                      (dict(nnodes=2, rdzv_endpoint="head:99999"), "must be host:port"),
                      (dict(nnodes=2, rdzv_endpoint="h:1", rdzv_id="a b"), "non-empty word"),
                      (dict(nnodes=2, node_rank="one", rdzv_endpoint="h:1"), "shell variable")]:
        with pytest.raises(ValueError, match=match):
            dist.torchrun_command("ddp_train", 8, **kw)
    static = dist.torchrun_command("ddp_train", 4, 2, 1, "head:29500", rdzv_backend="static")
    assert static[1:9] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
                           "--master-addr", "head"] and "--rdzv-id" not in static
    with pytest.raises(ValueError, match="rdzv_backend is 'c10d' or 'static'"):
        dist.torchrun_command("ddp_train", 8, 2, 0, "h:1", rdzv_backend="etcd")
    with pytest.raises(ValueError, match="nproc must be an int >= 1"):
        dist.torchrun_command("ddp_train", 0)
    with pytest.raises(FileNotFoundError, match="no script"):
        dist.torchrun_command("ddp_trian", 2)


_TWO_NODES = """
import os, torch, torch.distributed as td
td.init_process_group("gloo")
x = torch.tensor([float(td.get_rank() + 1)])
td.all_reduce(x)
print("RESULT", td.get_rank(), td.get_world_size(), os.environ["GROUP_RANK"], float(x[0]))
td.destroy_process_group()
"""


@pytest.mark.skipif(os.environ.get("CUDABOOK_RDZV_TEST") != "1",
                    reason="two torchrun 'nodes' on this machine take 6-20 s: "
                           "CUDABOOK_RDZV_TEST=1 runs it")
def test_torchrun_multinode_lines_rendezvous_for_real(tmp_path):
    """The lines of two nodes, started as two torchrun processes on this machine (c10d
    rendezvous over 127.0.0.1, one gloo worker each), join one group of 2 and sum."""
    import socket
    import subprocess

    (tmp_path / "two.py").write_text(_TWO_NODES)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    launcher = (sys.executable, "-m", "torch.distributed.run")
    ps = [subprocess.Popen(dist.torchrun_command(tmp_path / "two.py", 1, 2, i,
                                                 f"127.0.0.1:{port}", "t", launcher=launcher),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    outs = []
    try:
        for p in ps:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    res = sorted(ln.split()[1:] for o in outs for ln in o.splitlines()
                 if ln.startswith("RESULT"))
    assert res == [["0", "2", "0", "3.0"], ["1", "2", "1", "3.0"]], outs


# ============================================================================ Ray Train

def test_ray_is_optional_and_named_when_missing(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "ray", None)              # as if it were not installed
    importlib.reload(ray_train)                                # importing it needs no Ray
    with pytest.raises(ImportError, match=r'pip install "ray\[train\]"'):
        ray_train.fit(num_workers=2)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        ray_train.fit(num_workers=0)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ray_train.train_loop({})


def test_ray_train_fit_when_installed(tmp_path):
    ray = pytest.importorskip("ray", reason='Ray Train is not installed (pip install '
                                            '"ray[train]")')
    pytest.importorskip("ray.train.torch", reason='Ray Train is not installed (pip install '
                                                  '"ray[train]")')
    try:
        m = ray_train.fit(num_workers=2, use_gpu=False, storage_path=str(tmp_path),
                          config={"width": 16, "layers": 2, "tokens": 8, "steps": 2,
                                  "warmup": 1})
    finally:
        ray.shutdown()
    assert m["replicas_equal"] and m["world"] == 2 and m["backend"] == "gloo", m
    assert m["ms"] > 0 and m["params"] == 2 * 16 * 16


# ============================================================================ GPUs (the lane)

@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [tp.ONE_SHOT_THRESHOLD, 0])
def test_one_host_split_equals_unsplit_on_gpus(threshold):
    """Every GPU of the host a rank (threads), the all-reduce the book's one-shot up to the
    threshold and NCCL above (threshold 0: NCCL only): the same checks as on gloo."""
    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    w = dist.gpu_count() if CFG.n_head % dist.gpu_count() == 0 else 2
    grp = tp.one_host(list(range(w)), threshold_bytes=threshold)

    res = tp.run_threads(lambda r, ar: _checks(r, w, ar, f"cuda:{r}"), grp, devices=grp.devices)
    _assert_all(res, w, tol=1e-5)            # GPU GEMMs and SDPA round differently per shape
    small, large = grp.reduce.calls["small"], grp.reduce.calls["large"]
    assert (small > 0 and large == 0) if threshold else (small == 0 and large > 0), grp.reduce.calls


@pytest.mark.gpu
def test_tp_train_on_gpus():
    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    cfg = gpt.GPTConfig(vocab=512, d=256, n_layer=2, n_head=4, ctx=256)
    one = tp.gpu_timing(1, batch=2, seq=256, steps=3, warmup=1, cfg=cfg)
    two = tp.gpu_timing(2, batch=2, seq=256, steps=3, warmup=1, cfg=cfg)
    assert set(one["ms"]) == {"mlp unsplit", "block unsplit", "gpt unsplit", "mlp unsplit graph",
                              "block unsplit graph"}, one["graph_errors"]
    assert {"mlp book", "mlp torch TP", "block book", "gpt book", "all-reduce", "mlp book graph",
            "block book graph"} <= set(two["ms"]), two["graph_errors"]
    c = two["check"]
    assert c["mlp output"] <= 2e-2 * c["mlp scale"] and c["block output"] <= 2e-2 * c["block scale"]
    assert abs(c["gpt loss"][0] - c["gpt loss"][1]) <= 1e-2 * c["gpt loss"][1]


@pytest.mark.gpu
def test_measure_crossover_on_gpus():
    if dist.gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs of one host")
    res = tp.measure_crossover(sizes=[4 << 10, 64 << 10, 1 << 20])
    assert res["world"] == dist.gpu_count() and len(res["rows"]) == 3
    assert all(r["one_shot_us"] > 0 for r in res["rows"])
    assert res["threshold_bytes"] in (0, 4 << 10, 64 << 10, 1 << 20)


def test_spawn_after_a_gpu_backward_starts_new_interpreters(monkeypatch):
    """After a backward on a GPU, PyTorch refuses autograd in forked children: dist.spawn then
    starts the ranks as new interpreters, which import the function by name (a module's runs; a
    local one is refused with the reason). Simulated: the fork probe answers "unsafe"."""
    monkeypatch.setattr(dist, "_autograd_fork_safe", lambda: False)
    cfg = gpt.GPTConfig(vocab=32, d=16, n_layer=1, n_head=2, ctx=16)
    r = dist.spawn(tp.compare_split, 2, cfg, timeout=120)
    assert r[0]["fc"] == (32, 16) and max(x["logits"] for x in r) < 1e-5

    def local_rank(comm):
        return comm.rank

    with pytest.raises(dist.DistError, match="cannot be imported. Define it in a module"):
        dist.spawn(local_rank, 2)


def _decode_rank(comm, steps):
    """One rank: the split decoder and the unsplit static-cache decoder from the same prompt."""
    from cudabook.decoder import StaticCacheDecoder

    model = gpt.build(CFG, seed=0)
    ids = torch.randint(0, CFG.vocab, (2, 3), generator=torch.Generator().manual_seed(5))
    ref = StaticCacheDecoder(model, batch=2)
    dec = tp.ParallelDecoder(model, comm.rank, comm.world, tp.TorchAllReduce(), batch=2)
    ref.prefill(ids)
    dec.prefill(ids)
    err, toks = 0.0, []
    for _ in range(steps):
        ref.step()
        dec.step()
        err = max(err, _rel(dec.logits, ref.logits))
        toks.append((dec.tok.view(-1).tolist(), ref.tok.view(-1).tolist()))
    return {"err": err, "toks": toks, "pos": int(dec.pos), "log": dec.log[:2],
            "k": tuple(dec.k.shape)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parallel_decoder_equals_the_static_cache_step(world):
    """Tensor-parallel decode (heads and MLP split, two all-reduces a block) gives the unsplit
    static-cache decoder's logits to fp32 rounding and the same greedy tokens, step after step."""
    res = dist.spawn(_decode_rank, world, 4, timeout=120)
    for r in res:
        assert r["err"] < TOL, r["err"]
        assert all(a == b for a, b in r["toks"]), r["toks"]
        assert r["pos"] == 3 + 4
        assert r["k"] == (CFG.n_layer, 2, CFG.n_head // world, CFG.ctx, CFG.head_dim)
        assert [e[0] for e in r["log"]] == ["decode proj", "decode fc2"]
        assert r["log"][0][1] == 2 * CFG.d                    # one token a sequence, (B, 1, d)
    with pytest.raises(tp.TensorParallelError, match="world must divide n_head"):
        tp.ParallelDecoder(gpt.build(CFG, seed=0), 0, 5, lambda t: None)


def test_tp_decode_script_on_gloo():
    """dist_scripts/tp_decode.py end to end on 2 gloo CPU processes (the eager check only)."""
    cfg = gpt.GPTConfig(vocab=64, d=32, n_layer=2, n_head=4, ctx=64)
    r = tp.decode_timing(2, prompt=8, steps=4, device="cpu", cfg=cfg, timeout=240)
    assert r["world"] == 2 and r["check"]["same_tokens"] == r["check"]["steps"] == 8
    assert r["check"]["max_logit_diff"] < 1e-5 * max(1.0, r["check"]["logit_scale"])
    assert r["message_bytes"] == 32 * 4 and r["allreduces_per_step"] == 4
    assert "us_per_token" not in r                      # no CUDA graph on the CPU
    with pytest.raises(tp.TensorParallelError, match="divides n_head"):
        tp.decode_timing(3, device="cpu", cfg=cfg)
