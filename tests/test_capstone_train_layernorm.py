"""The training step's LayerNorm (kernels/layernorm_train): forward with the saved statistics and
the fused residual add, backward with dx (accumulated or not, its bf16 copy) and dw, db summed in a
fixed order. The refusals and the launch plans (on the CPU), the Numba twins against float64 NumPy
(on the simulator, or a GPU), and the CUDA kernels on the GPU against PyTorch float64 autograd of
F.layer_norm, bitwise repeatability and a CUDA graph replay.

Tolerances. y is bf16: one bf16 ulp relative (2^-7 |ref|; rounding alone is at most half of it)
plus 1e-5 for the fp32 arithmetic before the rounding. Elsewhere fp32: mean 1e-5 (absolute and
relative), rstd 2e-5 relative (the variance's sums and rsqrtf's 2 ulp), dx 1e-5 absolute and
relative (terms of order 1, sums of at most C = 8192 fp32 values), dw and db, sums over up to
M = 8192 rows: 1e-6 of the sum of the terms' magnitudes plus 1e-5 relative."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cudabook as cb
from cudabook.launch import ceil_div

gpu = pytest.mark.gpu
lt = cb.load_launch("layernorm_train")

Y_RTOL, Y_ATOL = 2.0 ** -7, 1e-5


def _dev() -> str:
    """Where the refusal tests put their tensors: the GPU when there is one (so the checks after
    the device check are reached), else the CPU."""
    import torch

    return "cuda" if cb.HAS_GPU and torch.cuda.is_available() else "cpu"


def _case(M, C, seed=0):
    """x (offset and scaled, as a residual stream), w, b, a bf16 residual and dy (float32
    holding bf16 values), and a dx to add to."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, C)) * 2 + 0.5).astype(np.float32)
    w = rng.uniform(0.5, 1.5, C).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    r = lt.bf16_round(rng.standard_normal((M, C)))
    dy = lt.bf16_round(rng.standard_normal((M, C)))
    dx0 = rng.standard_normal((M, C)).astype(np.float32)
    return x, w, b, r, dy, dx0


def _dwdb_tol(dy, xhat):
    """atol of dw, db: 1e-6 of the largest column's sum of |terms| (fp32 sums of M rows)."""
    dy, xhat = np.asarray(dy, np.float64), np.asarray(xhat, np.float64)
    return 1e-6 * max(np.abs(dy * xhat).sum(axis=0).max(), np.abs(dy).sum(axis=0).max())


# ----------------------------------------------------------------------------- plans (CPU)
def test_constants_match_the_cu_file():
    src = (cb.KERNELS_DIR / "layernorm_train.cu").read_text()
    for name, value in (("LNT_CHUNKS", lt.CHUNKS), ("LNT_THREADS", lt.THREADS)):
        assert int(re.search(rf"#define {name} (\d+)", src).group(1)) == value, name
    for v in lt.VERSIONS:
        for k in lt.KERNELS[v]:
            assert re.search(rf'extern "C" __global__ void (__launch_bounds__\(\w+\) )?{k}\(',
                             src), k


def test_v2_row_groups_cover_every_width_once():
    """Every C from 8 to MAX_C: thread t of a row group owns chunks t + k tpr (k < CHUNKS); these
    cover the C / 8 chunks, whole warps, at most THREADS per block, the backward's combine buffer
    under 48 KiB (no opt-in), and the scratch has G <= BWD_BLOCKS rows."""
    for C in range(8, lt.MAX_C + 1, 8):
        tpr, R = lt.row_group(C)
        C8 = C // 8
        assert tpr % 32 == 0 and tpr * R <= lt.THREADS and tpr * lt.CHUNKS >= C8, C
        assert tpr == 32 or (tpr - 32) * lt.CHUNKS < C8, C     # the fewest warps that fit
        cfg = lt.config("v2", 8192, C)
        assert cfg["forward"].block == (tpr * R,) and cfg["backward"].block == (tpr * R,)
        assert cfg["backward"].shared == (4 * R * C if R > 1 else 0) <= 32 * 1024, C
    assert lt.row_group(768) == (32, 8) and lt.row_group(1032) == (64, 4)
    assert lt.row_group(2056) == (96, 2) and lt.row_group(8192) == (256, 1)
    assert lt.scratch_shape("v2", 8192, 768) == (2, 256, 768)
    assert lt.scratch_shape("v2", 7, 768) == (2, 1, 768)
    assert lt.scratch_shape("v2", 1000, 4096) == (2, 256, 4096)
    assert lt.scratch_shape("layernorm_train_v1", 8192, 768) is None
    c1 = lt.config("v1", 1001, 768)
    assert c1["forward"].grid == (ceil_div(1001, 4),) and c1["dwdb"].grid == (6,)


def test_bf16_round_is_torchs_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 100,
                        np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895314e38, 0.0,
                                  -0.0, np.inf, 1e-40], np.float32)])    # ties, overflow, tiny
    want = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
    got = lt.bf16_round(a)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_references_are_torch_float64_autograd():
    torch = pytest.importorskip("torch")
    x, w, b, r, dy, _ = _case(5, 24, seed=2)
    y, mean, rstd, xo = lt.reference_forward(x, w, b, residual=r)
    assert np.array_equal(xo, x + r)
    t = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (xo, w, b)]
    yt = torch.nn.functional.layer_norm(t[0], (24,), t[1], t[2], 1e-5)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    assert np.allclose(y, yt.detach().numpy(), atol=1e-12, rtol=1e-12)
    gx, dw, db = lt.reference_backward(dy, xo, w)
    for got, want in ((gx, t[0].grad), (dw, t[1].grad), (db, t[2].grad)):
        assert np.allclose(got, want.numpy(), atol=1e-12, rtol=1e-10)
    x64 = xo.astype(np.float64)
    assert np.allclose(mean, x64.mean(1)) and np.allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5))


# ----------------------------------------------------------------------------- refusals
def _fwd_args(M=3, C=16, dev=None):
    import torch

    dev = dev or _dev()
    return dict(x=torch.randn(M, C, device=dev), w=torch.ones(C, device=dev),
                b=torch.zeros(C, device=dev),
                y=torch.empty(M, C, dtype=torch.bfloat16, device=dev),
                mean=torch.empty(M, device=dev), rstd=torch.empty(M, device=dev))


def _bwd_args(M=3, C=16):
    import torch

    dev = _dev()
    return dict(dy=torch.randn(M, C, device=dev).bfloat16(), x=torch.randn(M, C, device=dev),
                w=torch.ones(C, device=dev), mean=torch.zeros(M, device=dev),
                rstd=torch.ones(M, device=dev), dx=torch.zeros(M, C, device=dev),
                dw=torch.zeros(C, device=dev), db=torch.zeros(C, device=dev))


def _misaligned(t):
    """A contiguous tensor like t whose data starts 4 bytes past a 16-byte boundary."""
    flat = t.new_empty(t.numel() + 4)
    return flat[1:1 + t.numel()].view(t.shape)


@pytest.mark.parametrize("edit, err, match", [
    (lambda a: a.update(x=a["x"].double()), TypeError, "x: expected dtype float32"),
    (lambda a: a.update(x=a["x"][:, :12].contiguous()), cb.LaunchError, "multiple of 8"),
    (lambda a: a.update(**_fwd_args(2, 8200)), cb.LaunchError, "from 8 to 8192"),
    (lambda a: a.update(**_fwd_args(0, 16)), cb.LaunchError, "no rows"),
    (lambda a: a.update(y=a["y"].float()), TypeError, "y: expected dtype bfloat16"),
    (lambda a: a.update(w=a["w"][:8]), ValueError, r"w: expected shape \(16,\)"),
    (lambda a: a.update(rstd=a["mean"]), ValueError, "rstd and mean are the same memory"),
    (lambda a: a.update(residual=a["y"]), ValueError, "residual given without x_out"),
    (lambda a: a.update(x_out=a["x"]), ValueError, "x_out is written only when a residual"),
    (lambda a: a.update(residual=a["y"].float(), x_out=a["x"]), TypeError,
     "residual: expected dtype bfloat16"),
    (lambda a: a.update(x=_misaligned(a["x"])), ValueError, "x: address .* multiple of 16"),
    (lambda a: a.update(eps=0.0), TypeError, "eps must be a number > 0"),
    (lambda a: a.update(version="v3"), ValueError, "unknown version 'v3'"),
])
def test_forward_refuses(edit, err, match):
    a = _fwd_args()
    edit(a)
    with pytest.raises(err, match=match):
        lt.forward(**a)


def test_forward_refuses_a_strided_x():
    a = _fwd_args(16, 16)
    a["x"] = a["x"].t()                               # (16, 16) but column-major
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        lt.forward(**a)


@pytest.mark.parametrize("edit, err, match", [
    (lambda a: a.update(dy=a["dy"].float()), TypeError, "dy: expected dtype bfloat16"),
    (lambda a: a.update(dx=a["dx"][:2]), ValueError, r"dx: expected shape \(3, 16\)"),
    (lambda a: a.update(dx=a["x"]), ValueError, "dx and x are the same memory"),
    (lambda a: a.update(dx16=a["dx"]), TypeError, "dx16: expected dtype bfloat16"),
    (lambda a: a.update(db=a["dw"]), ValueError, "db and dw are the same memory"),
    (lambda a: a.update(dw=_misaligned(a["dw"])), ValueError, "dw: address"),
    (lambda a: a.update(accumulate=1), TypeError, "accumulate must be True"),
    (lambda a: a.update(mean=a["mean"].double()), TypeError, "mean: expected dtype float32"),
])
def test_backward_refuses(edit, err, match):
    a = _bwd_args()
    edit(a)
    with pytest.raises(err, match=match):
        lt.backward(**a)


def test_twins_refuse_a_bad_width():
    x = np.zeros((2, 20), np.float32)
    with pytest.raises(cb.LaunchError, match="multiple of 8"):
        lt.forward_numba(x, np.ones(20, np.float32), np.zeros(20, np.float32))


# ----------------------------------------------------------------------------- Numba twins
@pytest.mark.parametrize("M, C, blocks", [(5, 8, None), (9, 72, 2), (2, 1032, 1)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_numba_twins_match_float64(version, M, C, blocks):
    """C = 8 (one chunk), 72 (lanes past the row's end), 1032 (two warps per row, four rows per
    block, two of them past the last row); blocks = 2 or 1: a row group takes several rows, as in
    backward v2 past its 256 blocks. Wider rows (2056, 8192: three and eight warps) are checked on
    the GPU only: the simulator takes half a minute per case there."""
    if version == "v1" and C > 1032:
        pytest.skip("v1's twin has nothing new at this width")
    x, w, b, r, dy, dx0 = _case(M, C, seed=M + C)
    y, mean, rstd, xo = lt.forward_numba(x, w, b, residual=r, version=version)
    yr, mr, rr, xor = lt.reference_forward(x, w, b, residual=r)
    assert np.array_equal(xo, xor)                    # x + residual in fp32, exactly
    cb.check(y, yr, atol=Y_ATOL, rtol=Y_RTOL, name="y")
    assert np.array_equal(y, lt.bf16_round(y))        # bf16 values
    cb.check(mean, mr, atol=1e-5, rtol=1e-5, name="mean")
    cb.check(rstd, rr, atol=0, rtol=2e-5, name="rstd")
    dx, dw, db, dx16 = lt.backward_numba(dy, xo, w, mean, rstd, dx=dx0, version=version,
                                         blocks=blocks)
    gx, dwr, dbr = lt.reference_backward(dy, xo, w)
    cb.check(dx, dx0 + gx, atol=1e-5, rtol=1e-5, name="dx")
    xh = (xo - mr[:, None]) * rr[:, None]
    cb.check(dw, dwr, atol=_dwdb_tol(dy, xh), rtol=1e-5, name="dw")
    cb.check(db, dbr, atol=_dwdb_tol(dy, xh), rtol=1e-5, name="db")
    assert np.array_equal(dx16, lt.bf16_round(dx))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_numba_twins_without_residual_and_dx_overwritten(version):
    M, C = 6, 40
    x, w, b, _, dy, _ = _case(M, C, seed=7)
    y, mean, rstd, xo = lt.forward_numba(x, w, b, version=version)
    assert xo is not None and np.array_equal(xo, x)
    yr, mr, rr, _ = lt.reference_forward(x, w, b)
    cb.check(y, yr, atol=Y_ATOL, rtol=Y_RTOL, name="y")
    dx, dw, db, _ = lt.backward_numba(dy, x, w, mean, rstd, accumulate=False, version=version)
    gx, dwr, dbr = lt.reference_backward(dy, x, w)
    cb.check(dx, gx, atol=1e-5, rtol=1e-5, name="dx (NaN before: not read)")
    xh = (x - mr[:, None]) * rr[:, None]
    cb.check(dw, dwr, atol=_dwdb_tol(dy, xh), rtol=1e-5, name="dw")
    cb.check(db, dbr, atol=_dwdb_tol(dy, xh), rtol=1e-5, name="db")


# ----------------------------------------------------------------------------- CUDA (GPU)
def _torch_case(M, C, seed=0):
    import torch

    x, w, b, r, dy, dx0 = _case(M, C, seed)
    t = [torch.from_numpy(a).cuda() for a in (x, w, b, r, dy, dx0)]
    t[3], t[4] = t[3].bfloat16(), t[4].bfloat16()     # exact: the values are bf16 already
    return t


def _torch_reference(xo, w, b, dy, eps=1e-5):
    """float64 autograd of F.layer_norm: y, mean, rstd, grad_x, grad_w, grad_b (torch, GPU)."""
    import torch

    x64, w64, b64 = (a.double().requires_grad_() for a in (xo, w, b))
    y = torch.nn.functional.layer_norm(x64, (xo.shape[1],), w64, b64, eps)
    y.backward(dy.double())
    with torch.no_grad():
        mean = x64.mean(1)
        rstd = torch.rsqrt(x64.var(1, unbiased=False) + eps)
    return y.detach(), mean, rstd, x64.grad, w64.grad, b64.grad


def _outputs(M, C):
    import torch

    return (torch.full((M, C), float("nan"), device="cuda").bfloat16(),
            torch.full((M,), float("nan"), device="cuda"),
            torch.full((M,), float("nan"), device="cuda"))


def _check_all(version, M, C, residual, accumulate, seed=0):
    import torch

    x, w, b, r, dy, dx0 = _torch_case(M, C, seed)
    x_before = x.clone()
    y, mean, rstd = _outputs(M, C)
    if residual:
        xo = torch.full_like(x, float("nan"))
        lt.forward(x, w, b, y, mean, rstd, residual=r, x_out=xo, version=version)
        assert torch.equal(x, x_before)                    # x is not modified
        assert torch.equal(xo, x + r.float())              # the fp32 add, exactly
    else:
        xo = x
        lt.forward(x, w, b, y, mean, rstd, version=version)
    yr, mr, rr, gx, gw, gb = _torch_reference(xo, w, b, dy)
    cb.check(y, yr, atol=Y_ATOL, rtol=Y_RTOL, name=f"y {version} {M}x{C}")
    cb.check(mean, mr, atol=1e-5, rtol=1e-5, name="mean")
    cb.check(rstd, rr, atol=0, rtol=2e-5, name="rstd")
    dw0, db0 = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
    dw, db = dw0.clone(), db0.clone()
    dx = dx0.clone() if accumulate else torch.full_like(dx0, float("nan"))
    dx16 = torch.full((M, C), float("nan"), device="cuda").bfloat16()
    out = lt.backward(dy, xo, w, mean, rstd, dx, dw, db, dx16=dx16, accumulate=accumulate,
                      version=version)
    assert out is dx
    want = dx0.double() + gx if accumulate else gx
    cb.check(dx, want, atol=1e-5, rtol=1e-5, name=f"dx {version} {M}x{C}")
    assert torch.equal(dx16, dx.bfloat16())                # bf16(dx after the update)
    xh = ((xo.double() - mr[:, None]) * rr[:, None]).cpu().numpy()
    tol = _dwdb_tol(dy.float().cpu().numpy(), xh)
    cb.check(dw, dw0.double() + gw, atol=tol, rtol=1e-5, name="dw (added to)")
    cb.check(db, db0.double() + gb, atol=tol, rtol=1e-5, name="db (added to)")


@gpu
@pytest.mark.parametrize("C", [8, 768, 1000, 4096])
@pytest.mark.parametrize("M", [1, 7, 1000, 8192])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cuda_layernorm_matches_torch_float64(version, M, C):
    """Every (M, C): a single row, rows not a multiple of a block's rows, more rows than backward
    v2's blocks take at once (C = 768, 1000: 8192 > 256 x 8); the residual and accumulate=False
    on alternate cases."""
    odd = (M + C // 8) % 2 == 1
    _check_all(version, M, C, residual=odd, accumulate=not odd, seed=M + C)


@gpu
@pytest.mark.parametrize("M, C", [(7, 2056), (1000, 2056), (7, 8192), (300, 8192), (5, 1032)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cuda_layernorm_other_row_groups(version, M, C):
    """Three warps per row (two rows per block of 192), eight (one row per block), two (four)."""
    _check_all(version, M, C, residual=True, accumulate=True, seed=C)


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cuda_residual_in_place(version):
    import torch

    M, C = 33, 768
    x, w, b, r, _, _ = _torch_case(M, C, seed=5)
    want = x + r.float()
    y, mean, rstd = _outputs(M, C)
    lt.forward(x, w, b, y, mean, rstd, residual=r, x_out=x, version=version)
    assert torch.equal(x, want)
    yr, mr, rr = _torch_reference(want, w, b, torch.zeros_like(r))[:3]
    cb.check(y, yr, atol=Y_ATOL, rtol=Y_RTOL, name="y (in place)")


@gpu
@pytest.mark.parametrize("M, C", [(8192, 768), (1000, 4096)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cuda_backward_is_bitwise_repeatable(version, M, C):
    import torch

    x, w, b, r, dy, dx0 = _torch_case(M, C, seed=11)
    y, mean, rstd = _outputs(M, C)
    lt.forward(x, w, b, y, mean, rstd, version=version)
    runs = []
    for _ in range(2):
        dx, dw, db = dx0.clone(), torch.ones(C, device="cuda"), torch.ones(C, device="cuda")
        lt.backward(dy, x, w, mean, rstd, dx, dw, db, version=version)
        runs.append((dx, dw, db))
    for a, b_, name in zip(*runs, ("dx", "dw", "db")):
        assert torch.equal(a, b_), name


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cuda_graph_capture_and_replay(version):
    """Forward (residual) + backward (dx overwritten, dx16) captured once, replayed on new
    inputs: bitwise what the same calls give outside the graph."""
    import torch

    M, C = 2100, 768
    x, w, b, r, dy, _ = _torch_case(M, C, seed=13)
    xo, dx = torch.empty_like(x), torch.empty_like(x)
    y, mean, rstd = _outputs(M, C)
    dx16 = torch.empty_like(dy)
    dw, db = torch.zeros(C, device="cuda"), torch.zeros(C, device="cuda")

    def step(o):
        lt.forward(x, w, b, o[0], o[1], o[2], residual=r, x_out=o[3], version=version)
        lt.backward(dy, o[3], w, o[1], o[2], o[4], o[5], o[6], dx16=o[7], accumulate=False,
                    version=version)

    graph_out = (y, mean, rstd, xo, dx, dw, db, dx16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                         # warm-up: compiles the module
        step(graph_out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_out)
    x2, _, _, r2, dy2, _ = _torch_case(M, C, seed=14)
    for a, new in ((x, x2), (r, r2), (dy, dy2)):
        a.copy_(new)
    dw.zero_()
    db.zero_()
    graph.replay()
    eager = (torch.empty_like(y), torch.empty_like(mean), torch.empty_like(rstd),
             torch.empty_like(x), torch.empty_like(x), torch.zeros_like(dw),
             torch.zeros_like(db), torch.empty_like(dx16))
    step(eager)
    torch.cuda.synchronize()
    names = ("y", "mean", "rstd", "x_out", "dx", "dw", "db", "dx16")
    for a, e, name in zip(graph_out, eager, names):
        assert torch.equal(a, e), name
    assert torch.equal(xo, x2 + r2.float())


@gpu
def test_cuda_refuses_host_and_misaligned_tensors():
    a = _fwd_args(dev="cuda")
    a["w"] = a["w"].cpu()
    with pytest.raises(TypeError, match="w: expected a GPU array"):
        lt.forward(**a)
    a = _fwd_args(dev="cuda")
    a["y"] = _misaligned(a["y"])
    with pytest.raises(ValueError, match="y: address"):
        lt.forward(**a)
