"""kernels/gemm_train: a linear layer's three training products (nt, nn, tn) on wgmma with the
operands read where they lie, and v2's deterministic split of K.

On the CPU: the planner (tile width and split per shape, the workspace it needs), the shapes of
each layout, and every refusal that comes before the device check. On the GPU (Hopper only: the
kernels are sm_90a): each layout and version against float64 on ragged shapes (edge tiles
zero-filled by TMA), bf16 and fp16, bf16 and fp32 outputs; split products bitwise equal across
runs and equal to the unsplit sum within fp32 rounding; the GPT-2 shapes of the training step;
a CUDA-graph capture with a caller's workspace; the tickets left at zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cudabook as cb

gpu = pytest.mark.gpu
gt = cb.load_launch("gemm_train")
bf16, fp16 = torch.bfloat16, torch.float16


# ============================================================================ planning (CPU)
def test_dims_per_layout():
    assert gt.dims("nt", (5, 16), (7, 16)) == (5, 7, 16)
    assert gt.dims("nn", (5, 16), (16, 7)) == (5, 7, 16)
    assert gt.dims("tn", (16, 5), (16, 7)) == (5, 7, 16)
    with pytest.raises(ValueError, match="disagree on the reduction"):
        gt.dims("nn", (5, 16), (7, 16))
    with pytest.raises(ValueError, match="layout: one of"):
        gt.dims("tt", (5, 16), (7, 16))


def test_plan_splits_the_last_wave():
    # a 768 x 768 weight gradient over 8192 tokens: 36 tiles of 128 x 128 on 132 SMs -> split
    cfg = gt.config("v2", "tn", 768, 768, 8192, "bfloat16", "float32", 132)
    assert cfg["splits"] > 1 and cfg["BN"] == 128 and cfg["whole"] == 0
    assert cfg["units"] == cfg["tiles"] * cfg["splits"] and cfg.grid[0] == min(cfg["units"], 132)
    assert cfg["work_floats"] == cfg["splits"] * cfg["tiles"] * 128 * 128
    assert cfg["tickets"] == 2 * cfg["tiles"] and "true, __nv_bfloat16>" in cfg["kernel"]
    # 144 tiles: 132 whole, the other 12 in pieces
    cfg = gt.config("v2", "tn", 3072, 768, 8192, "bfloat16", "float32", 132)
    assert cfg["whole"] == 132 and cfg["splits"] > 1
    assert cfg["units"] == 132 + 12 * cfg["splits"] and cfg["tickets"] == 24
    # a forward product with thousands of tiles: no split, no workspace, C by TMA
    cfg = gt.config("v2", "nt", 8192, 50304, 768, "bfloat16", "bfloat16", 132)
    assert cfg["splits"] == 1 and cfg["work_floats"] == 0 and cfg["tickets"] == 0
    assert cfg["EPI"] and cfg["whole"] == cfg["tiles"]
    # every split keeps MIN_KTILES k-tiles; v1 never splits, never stages C
    for K in (64, 512, 1000, 8192, 50304):
        p = gt.plan("v2", 256, 256, K, 132)
        kt = (K + 63) // 64
        assert p["splits"] == 1 or (kt + p["splits"] - 1) // p["splits"] >= gt.MIN_KTILES
        p1 = gt.plan("v1", 256, 256, K, 132)
        assert (p1["BN"], p1["splits"], p1["EPI"]) == (256, 1, False)
    # fp32 outputs are stored from registers
    assert not gt.plan("v2", 8192, 768, 768, 132, "float32")["EPI"]
    # a wave-quantisation case: 8192 x 768 (384 tiles of 128 x 128 against 192 of 128 x 256)
    assert gt.plan("v2", 8192, 768, 768, 132)["BN"] == 128


def test_params_are_checked():
    with pytest.raises(ValueError, match="splits > 1 need BN = 128"):
        gt.config("v2", "tn", 768, 768, 8192, "bfloat16", "float32", params=dict(BN=256,
                                                                                 splits=2))
    with pytest.raises(ValueError, match="EPI. stages 16-bit outputs only"):
        gt.config("v2", "tn", 768, 768, 8192, "bfloat16", "float32", params=dict(EPI=True))
    with pytest.raises(ValueError, match="does not divide K"):
        gt.config("v2", "tn", 768, 768, 640, "bfloat16", "float32", params=dict(BN=128,
                                                                                splits=6))
    cfg = gt.config("v2", "tn", 768, 768, 8192, "bfloat16", "bfloat16",
                    params=dict(BN=128, splits=4, whole=10))
    assert cfg["whole"] == 10 and cfg["units"] == 10 + 26 * 4 and cfg["tickets"] == 52


def test_config_names_the_instantiation():
    cfg = gt.config("v2", "nn", 8192, 768, 3072, "bfloat16", None, 132)
    assert cfg["kernel"].startswith("gemm_train_t<") and cfg["kernel"].endswith(
        ", 0, 1, false, true, false, __nv_bfloat16>")
    cfg = gt.config("v1", "tn", 100, 200, 300, "float16", "float32", 132)
    assert cfg["kernel"] == "gemm_train_t<256, 4, 1, 1, true, false, false, __half>"
    assert cfg.shared == 4 * (128 + 256) * 64 * 2 + 1024 and cfg.block == (384,)
    with pytest.raises(TypeError, match="out: bfloat16 .* or float32, got float16"):
        gt.config("v2", "nt", 8, 8, 8, "bfloat16", "float16")
    with pytest.raises(ValueError, match="unknown version"):
        gt.config("v3", "nt", 8, 8, 8)


def test_refusals_before_the_gpu():
    a = torch.zeros(64, 32, dtype=bf16)
    b = torch.zeros(48, 32, dtype=bf16)
    with pytest.raises(TypeError, match="A: expected bfloat16 or float16, got float32"):
        gt.gemm(a.float(), b)
    with pytest.raises(TypeError, match="B: expected bfloat16 like A, got float16"):
        gt.gemm(a, b.half())
    with pytest.raises(ValueError, match="disagree on the reduction"):
        gt.gemm(a, b, "nn")
    with pytest.raises(ValueError, match="A: rows of 30 values; TMA reads rows of a multiple of 8"):
        gt.gemm(torch.zeros(64, 30, dtype=bf16), torch.zeros(48, 30, dtype=bf16))
    with pytest.raises(ValueError, match="N = 47: C's rows must be a multiple of 8"):
        gt.gemm(a, torch.zeros(47, 32, dtype=bf16))
    with pytest.raises(ValueError, match="A: expected a C-contiguous array"):
        gt.gemm(torch.zeros(32, 64, dtype=bf16).t(), b)
    with pytest.raises(ValueError, match="A: expected 2 dimensions"):
        gt.gemm(torch.zeros(2, 64, 32, dtype=bf16), b)
    with pytest.raises(ValueError, match="layout: one of"):
        gt.gemm(a, b, "tt")


# ============================================================================ GPU
def _need_hopper():
    if tuple(cb.cc()) != (9, 0):
        pytest.skip("gemm_train runs on compute capability 9.0 only")


def _check(C, A, B, layout):
    ref = gt.reference(A, B, layout)
    tol = gt.tolerance(A, B, layout, cb.describe(C).dtype)
    err = np.abs(C.double().cpu().numpy() - ref)
    bad = err > tol
    assert not bad.any(), (f"{layout}: {bad.sum()} of {bad.size} elements off, worst "
                           f"{err.max():.3g} (bound there {tol.flat[err.argmax()]:.3g})")


def _operands(layout, M, N, K, dtype, g):
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)   # noqa: E731
    a = r(M, K) if layout in ("nt", "nn") else r(K, M)
    b = r(N, K) if layout == "nt" else r(K, N)
    return a, b


@gpu
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [bf16, fp16])
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (200, 136, 72), (128, 256, 64), (333, 520, 1000),
                                   (1024, 1280, 256)])
def test_layouts_against_float64(layout, version, dtype, M, N, K):
    _need_hopper()
    if layout == "tn" and M % 8:
        M += 8 - M % 8                      # tn: A stored (K, M), rows of M values
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    A, B = _operands(layout, M, N, K, dtype, g)
    _check(gt.gemm(A, B, layout, version=version), A, B, layout)
    out = torch.full((M, N), float("nan"), device="cuda")
    _check(gt.gemm(A, B, layout, out=out, version=version), A, B, layout)


@gpu
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
@pytest.mark.parametrize("whole", [0, 5])
def test_split_products_are_deterministic(layout, whole):
    """Every tile split (whole = 0), or the first 5 whole and the other 7 split: bitwise the
    same on every run, equal to the unsplit product within fp32 rounding, in both outputs."""
    _need_hopper()
    M, N, K = 264, 520, 6000                 # 3 x 5 = 15 tiles of 128 x 128 (the last ragged)
    params = dict(BN=128, splits=6, whole=whole)
    g = torch.Generator(device="cuda").manual_seed(3)
    A, B = _operands(layout, M, N, K, bf16, g)
    outs = [gt.gemm(A, B, layout, out=torch.empty(M, N, device="cuda"), params=params)
            for _ in range(3)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "a split product differs between runs"
    _check(outs[0], A, B, layout)
    one = gt.gemm(A, B, layout, out=torch.empty(M, N, device="cuda"), version="v1")
    rel = ((outs[0] - one).abs().max() / one.abs().max()).item()
    assert rel < 1e-5, f"split and unsplit sums differ by {rel:.2e} (relative)"
    bf = gt.gemm(A, B, layout, params=params)          # whole tiles by TMA, split ones rounded
    assert torch.equal(bf, outs[0].bfloat16())         # by the last arrival
    assert int(gt._WORK[torch.cuda.current_device()].tick.abs().sum()) == 0


@gpu
def test_gpt2_training_shapes():
    """The twelve products of a GPT-2-small layer and the head, at 2048 tokens (the planner's
    choices for M = 8192 are exercised by the step's own tests)."""
    _need_hopper()
    g = torch.Generator(device="cuda").manual_seed(0)
    M, d, V = 2048, 768, 50304
    for n_out, k_in in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (V, d)):
        x = torch.randn(M, k_in, device="cuda", generator=g).bfloat16()
        W = (torch.randn(n_out, k_in, device="cuda", generator=g) * 0.02).bfloat16()
        dy = torch.randn(M, n_out, device="cuda", generator=g).bfloat16()
        y = gt.gemm(x, W, "nt")
        torch.testing.assert_close(y.float(), (x.float() @ W.float().t()), rtol=2e-2, atol=2e-2)
        dx = gt.gemm(dy, W, "nn")
        torch.testing.assert_close(dx.float(), dy.float() @ W.float(), rtol=2e-2, atol=2e-2)
        dW = gt.gemm(dy, x, "tn", out=torch.empty(n_out, k_in, device="cuda"))
        ref = dy.double().t() @ x.double()
        torch.testing.assert_close(dW.double(), ref, rtol=1e-4, atol=1e-3)


@gpu
def test_graph_capture_with_a_workspace():
    _need_hopper()
    M, N, K = 768, 768, 8192
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(K, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(K, N, device="cuda", generator=g).bfloat16()
    ws = gt.Workspace.for_shapes(dy, [("tn", M, N, K, "float32")])
    out = torch.empty(M, N, device="cuda")
    gt.gemm(dy, x, "tn", out=out, work=ws)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gt.gemm(dy, x, "tn", out=out, work=ws)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    assert int(ws.tick.abs().sum()) == 0
    small = gt.Workspace(dy, 16, 2)
    with pytest.raises(ValueError, match="work: this product needs"):
        gt.gemm(dy, x, "tn", out=out, work=small)


@gpu
def test_refuses_overlap_and_misalignment():
    _need_hopper()
    buf = torch.zeros(64 * 64 + 8, device="cuda", dtype=bf16)
    a = buf[:64 * 64].view(64, 64)
    with pytest.raises(ValueError, match="out overlaps A"):
        gt.gemm(a, a.clone(), "nt", out=buf[8:8 + 64 * 64].view(64, 64))
    with pytest.raises(ValueError, match="A: starts at .*, not 16-byte aligned"):
        gt.gemm(buf[1:1 + 64 * 64].view(64, 64), a.clone())
    with pytest.raises(ValueError, match="out: starts at .*, not 16-byte aligned"):
        gt.gemm(a, a.clone(), out=torch.empty(64 * 64 + 1, device="cuda", dtype=bf16)[1:]
                .view(64, 64))
