"""The training step's GELU on bf16 (kernels/gelu_train) and its optimizer step over one flat
buffer (kernels/adamw_flat: global gradient norm, clipping, AdamW, the bf16 shadow): the
refusals (on the CPU, or on the GPU where there is one), the Numba twins against float64 NumPy
(on the simulator, or a GPU), and the CUDA kernels on the GPU against PyTorch: autograd of
gelu(approximate="tanh") on bf16, torch.optim.AdamW with clip_grad_norm_, a float64 norm,
bitwise repeatability and a CUDA graph replayed three times."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda

import cudabook as cb
from cudabook.compile import kernel_path
from cudabook.launch import ceil_div
from cudabook.reference import gelu_tanh_reference

gpu = pytest.mark.gpu
gt = cb.load_launch("gelu_train")
af = cb.load_launch("adamw_flat")
gtn = cb.load_numba("gelu_train")
afn = cb.load_numba("adamw_flat")

K, C = 0.7978845608028654, 0.044715


def _dev() -> str:
    """Where the refusal tests put their tensors: the GPU when there is one (so that the checks
    before the device check are reached), else the CPU."""
    import torch

    return "cuda" if cb.HAS_GPU and torch.cuda.is_available() else "cpu"


def _bf16(x) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), held in float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _gelu_grad64(z):
    """d/dz of gelu_tanh in float64 (the backward's reference)."""
    z = np.asarray(z, np.float64)
    t = np.tanh(K * (z + C * z**3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * K * (1 + 3 * C * z * z)


# ============================================================================== GELU: refusals
def test_gelu_refuses_wrong_dtype_shape_layout_and_version():
    import torch

    d = _dev()
    h = torch.randn(64, device=d).to(torch.bfloat16)
    with pytest.raises(TypeError, match="h: expected dtype bfloat16, got float32"):
        gt.forward(h.float())
    with pytest.raises(ValueError, match=r"g: expected shape \(64,\)"):
        gt.forward(h, torch.empty(63, device=d, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dh: expected dtype bfloat16"):
        gt.backward(h.clone(), h, torch.empty(64, device=d))
    with pytest.raises(ValueError, match="h: expected shape"):
        gt.backward(h.clone(), h[:32], h.clone())
    with pytest.raises(ValueError, match="C-contiguous"):
        gt.forward(h.view(8, 8).t())
    with pytest.raises(ValueError, match="unknown version 'v3'"):
        gt.forward(h, version="v3")


def test_gelu_refuses_misaligned_v2_and_overlapping_outputs():
    import torch

    d = _dev()
    buf = torch.randn(80, device=d).to(torch.bfloat16)
    with pytest.raises(ValueError, match="h: gelu_train_fwd_v2 .* 16-byte aligned .* 2 bytes"):
        gt.forward(buf[1:65])
    with pytest.raises(ValueError, match="dg: gelu_train_bwd_v2 .* 16-byte aligned"):
        gt.backward(buf[1:65], buf[:64].clone(), version="v2")
    with pytest.raises(ValueError, match="g overlaps h"):
        gt.forward(buf[:64], buf[8:72])
    with pytest.raises(ValueError, match="g overlaps h"):
        gt.forward(buf[:64], buf[:64])
    h = buf[:64].clone()
    with pytest.raises(ValueError, match="dh overlaps h"):
        gt.backward(buf[:64], h, h)
    with pytest.raises(ValueError, match="dh overlaps part of dg"):
        gt.backward(buf[:64], h, buf[8:72])


def test_gelu_refuses_host_tensors():
    import torch

    h = torch.randn(16).to(torch.bfloat16)
    with pytest.raises(TypeError, match="on the host"):
        gt.forward(h, torch.empty_like(h))
    with pytest.raises(TypeError, match="on the host"):
        gt.backward(h.clone(), h, version="v1")


def test_gelu_config_covers_every_element():
    for n in (1, 7, 8, 4097, 8192 * 3072):
        assert gt.config("gelu_train_fwd_v1", n).grid[0] * 256 >= n
        g2 = gt.config("gelu_train_bwd_v2", n).grid[0]
        assert g2 * 256 * 8 >= n and (g2 - 1) * 256 * 8 < n          # no empty block
    with pytest.raises(ValueError, match="unknown version"):
        gt.config("gelu_v1", 10)


# ============================================================================== GELU: twins
@cuda.jit
def _round_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = gtn.bf16_round(x[i])


def test_bf16_round_twin_is_round_to_nearest_even():
    rng = np.random.default_rng(0)
    one = np.float32(1.0).view(np.uint32)
    ties = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001],
                    np.uint32).view(np.float32)          # 1 + half an ulp: down; 1 + 3/2: up
    x = np.concatenate([ties, -ties, [0.0, -0.0, 3.0e38, 1e-30],
                        rng.standard_normal(2000) * 10.0 ** rng.integers(-6, 6, 2000)])
    x = x.astype(np.float32)
    y = np.zeros_like(x)
    _round_kernel[ceil_div(x.size, 256), 256](x, y)
    assert np.array_equal(y.view(np.uint32), _bf16(x).view(np.uint32))
    assert y[0] == 1.0 and y[1] == np.float32(1 + 2 * 2.0**-7)     # ties to even


def test_gelu_grad_reference_is_the_derivative():
    z = np.linspace(-8, 8, 161)
    eps = 1e-6
    fd = (gelu_tanh_reference(z + eps) - gelu_tanh_reference(z - eps)) / (2 * eps)
    assert np.allclose(_gelu_grad64(z), fd, atol=1e-8, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 8, 2056, 4097])
def test_gelu_twins_match_float64_with_one_bf16_rounding(n):
    rng = np.random.default_rng(n)
    h = _bf16(rng.standard_normal(n) * 3)
    dg = _bf16(rng.standard_normal(n))
    ref_g = gelu_tanh_reference(h.astype(np.float64))
    ref_dh = dg.astype(np.float64) * _gelu_grad64(h)
    outs = {}
    for name, kern, per in (("fwd_one", gtn.gelu_fwd_one, 1),
                            ("fwd_chunk8", gtn.gelu_fwd_chunk8, 8)):
        g = np.full(n, np.nan, np.float32)
        kern[ceil_div(ceil_div(n, per), 256), 256](h, g)
        outs[name] = g
    for name, kern, per in (("bwd_one", gtn.gelu_bwd_one, 1),
                            ("bwd_chunk8", gtn.gelu_bwd_chunk8, 8)):
        dh = np.full(n, np.nan, np.float32)
        kern[ceil_div(ceil_div(n, per), 256), 256](dg, h, dh)
        outs[name] = dh
    dgi = dg.copy()                                       # the backward in place: dh is dg
    gtn.gelu_bwd_chunk8[ceil_div(ceil_div(n, 8), 256), 256](dgi, h, dgi)
    assert np.array_equal(outs["fwd_one"], outs["fwd_chunk8"])
    assert np.array_equal(outs["bwd_one"], outs["bwd_chunk8"])
    assert np.array_equal(dgi, outs["bwd_one"])
    for name, ref in (("fwd_chunk8", ref_g), ("bwd_chunk8", ref_dh)):
        out = outs[name]
        assert np.array_equal(_bf16(out), out), f"{name}: not bf16 values"
        # one rounding to bf16: within half a bf16 ulp of ref, plus fp32 noise
        half_ulp = np.ldexp(1.0, np.frexp(ref)[1] - 9)     # |ref| = f 2^e, 0.5 <= f < 1
        err = np.abs(out - ref)
        assert (err <= half_ulp * (1 + 1e-3) + 1e-7).all(), \
            f"{name}: worst {err.max():.3g} at {int(err.argmax())}"


# ============================================================================== AdamW: refusals
class _Huge:
    """A device array of 2^31 float32 elements in shape only (never launched on)."""
    shape, dtype = (2**31,), np.dtype(np.float32)
    __cuda_array_interface__ = {"shape": (2**31,), "typestr": "<f4", "data": (256, False),
                                "version": 3, "strides": None}


def _flat_set(n, d, dtype=None):
    import torch

    p = torch.randn(n, device=d, dtype=dtype or torch.float32)
    return (p, torch.randn(n, device=d), torch.zeros(n, device=d), torch.zeros(n, device=d),
            torch.empty(n, device=d, dtype=torch.bfloat16),
            torch.zeros(af.STATE_INTS, device=d, dtype=torch.int32))


def test_adamw_refuses_wrong_dtypes_shapes_and_sizes():
    import torch

    d = _dev()
    p, g, m, v, sh, st = _flat_set(64, d)
    with pytest.raises(TypeError, match="params: expected dtype float32, got float64"):
        af.step(p.double(), g, m, v, sh, st, 32, 1e-3)
    with pytest.raises(TypeError, match="shadow: expected dtype bfloat16, got float32"):
        af.step(p, g, m, v, p.clone(), st, 32, 1e-3)
    with pytest.raises(ValueError, match=r"m: expected shape \(64,\)"):
        af.step(p, g, m[:63], v, sh, st, 32, 1e-3)
    with pytest.raises(ValueError, match="params: expected 1 dimensions"):
        af.step(p.view(8, 8), g, m, v, sh, st, 32, 1e-3)
    with pytest.raises(TypeError, match="state: expected dtype int32"):
        af.step(p, g, m, v, sh, st.float(), 32, 1e-3)
    with pytest.raises(ValueError, match="C-contiguous"):
        af.step(p, torch.randn(2 * 64, device=d)[::2], m, v, sh, st, 32, 1e-3)
    with pytest.raises(cb.LaunchError, match="1 to 2\\^31 - 1"):
        af.step(p[:0], g[:0], m[:0], v[:0], sh[:0], st, 0, 1e-3)
    with pytest.raises(cb.LaunchError, match="2147483648 elements"):
        af.step(_Huge(), g, m, v, sh, st, 0, 1e-3)
    with pytest.raises(cb.LaunchError, match="2147483648 elements"):
        af.grad_norm(_Huge())
    with pytest.raises(ValueError, match="unknown version"):
        af.step(p, g, m, v, sh, st, 32, 1e-3, version="v3")


def test_adamw_refuses_bad_hyperparameters():
    import torch

    d = _dev()
    p, g, m, v, sh, st = _flat_set(64, d)
    for kw, msg in ((dict(n_decay=65), "n_decay must be an int in \\[0, n = 64\\]"),
                    (dict(n_decay=-1), "n_decay must be"), (dict(n_decay=True), "n_decay must be"),
                    (dict(lr=-1e-3), "lr must be in"), (dict(beta1=1.0), "beta1 must be in"),
                    (dict(beta2=-0.1), "beta2 must be in"), (dict(eps=-1.0), "eps must be in"),
                    (dict(weight_decay=-0.1), "weight_decay must be in"),
                    (dict(max_norm=0.0), "max_norm must be > 0"),
                    (dict(max_norm=None, norm=torch.ones(1, device=d)), "norm given without")):
        args = {"n_decay": 32, "lr": 1e-3}
        args.update({k: w for k, w in kw.items() if k in ("n_decay", "lr")})
        rest = {k: w for k, w in kw.items() if k not in ("n_decay", "lr")}
        with pytest.raises(ValueError, match=msg):
            af.step(p, g, m, v, sh, st, args["n_decay"], args["lr"], **rest)
    with pytest.raises(TypeError, match="lr must be a finite number"):
        af.step(p, g, m, v, sh, st, 32, float("nan"))
    with pytest.raises(TypeError, match="lr: expected dtype float32"):
        af.step(p, g, m, v, sh, st, 32, torch.ones(1, device=d, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"lr: expected shape \(1,\)"):
        af.step(p, g, m, v, sh, st, 32, torch.ones(2, device=d))
    with pytest.raises(ValueError, match=r"norm: expected shape \(1,\)"):
        af.step(p, g, m, v, sh, st, 32, 1e-3, norm=torch.ones(2, device=d))


def test_adamw_refuses_misaligned_v2_overlap_and_host():
    import torch

    d = _dev()
    p, g, m, v, sh, st = _flat_set(64, d)
    buf = torch.randn(80, device=d)
    with pytest.raises(ValueError, match="params: adamw_flat_v2 .* 16-byte aligned .* 4 bytes"):
        af.step(buf[1:65], g, m, v, sh, st, 32, 1e-3)
    shb = torch.empty(80, device=d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shadow: adamw_flat_v2 .* 8-byte aligned .* 2 bytes"):
        af.step(p, g, m, v, shb[1:65], st, 32, 1e-3)
    with pytest.raises(ValueError, match="grads: grad_norm_v2 .* 16-byte aligned"):
        af.grad_norm(buf[1:65])
    with pytest.raises(ValueError, match="grads and m overlap"):
        af.step(p, g, g, v, sh, st, 32, 1e-3)
    with pytest.raises(ValueError, match="params and v overlap"):
        af.step(buf[:64], g, m, buf[16:80], sh, st, 32, 1e-3, version="v1")
    with pytest.raises(TypeError, match="on the host"):
        af.step(*_flat_set(64, "cpu"), 32, 1e-3, version="v1")
    with pytest.raises(TypeError, match="on the host"):
        af.grad_norm(torch.randn(64), version="v1")


def test_adamw_config_records():
    assert af.config("grad_norm_v2", 10**8).grid == (af.NORM_V2_BLOCKS,)
    assert af.config("grad_norm_v2", 4099).parts == ceil_div(ceil_div(4099, 4), 256)
    assert af.config("grad_norm_v1", 4099).parts == ceil_div(4099, 256)
    assert af.config("grad_norm_finish", 5).block == (1024,)
    assert af.config("adamw_flat_count_step", 5).grid == (1,)
    assert af.config("adamw_flat_v2", 4099).grid == (ceil_div(4099, 1024),)
    with pytest.raises(ValueError, match="unknown kernel"):
        af.config("adamw_v1", 5)
    src = kernel_path("adamw_flat").read_text()         # the launcher's numbers are the file's
    assert f"#define ADAMW_STATE_INTS {af.STATE_INTS}\n" in src
    assert f"#define GRAD_NORM_V2_BLOCKS {af.NORM_V2_BLOCKS}\n" in src


# ============================================================================== AdamW: twins
def _norm_twin(g, version, blocks_cap=1024):
    n = g.size
    if version == "one":
        grid = ceil_div(n, afn.TPB)
        parts = np.full(grid, np.nan, np.float32)
        afn.sumsq_partial_one[grid, afn.TPB](g, parts)
    else:
        grid = max(1, min(ceil_div(ceil_div(n, 4), afn.TPB), blocks_cap))
        parts = np.full(grid, np.nan, np.float32)
        afn.sumsq_partial_chunk4[grid, afn.TPB](g, parts)
    out = np.full(1, np.nan, np.float32)
    afn.sumsq_finish[1, afn.FINISH_THREADS](parts, out)
    return out[0]


@pytest.mark.parametrize("n, cap", [(3, 1024), (515, 1024), (1031, 1)])
def test_norm_twins_match_float64(n, cap):
    """cap 1: fewer threads than chunks (258 of 4 for 256 threads), so the grid-stride loop of
    grad_norm_v2 runs, with a tail of 3."""
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    ref = math.sqrt((g.astype(np.float64) ** 2).sum())
    for version in ("one", "chunk4"):
        got = _norm_twin(g, version, cap)
        assert abs(got - ref) <= 1e-6 * ref, (version, got, ref)


def _adamw64(p, g, m, v, t, lr, b1, b2, eps, wd, n_decay, max_norm):
    """One step of torch.optim.AdamW after clip_grad_norm_, in float64 (returns new p, m, v)."""
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    if max_norm is not None:
        g = g * min(1.0, max_norm / (math.sqrt((g**2).sum()) + 1e-6))
    wdv = np.where(np.arange(p.size) < n_decay, wd, 0.0)
    p = p * (1 - lr * wdv)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    return p, m, v


@pytest.mark.parametrize("scale, max_norm", [(1.0, 1.0), (1e-3, 1.0), (1.0, None)])
def test_adamw_twins_match_float64_torch_order(scale, max_norm):
    """n = 131 (a tail of 3), n_decay = 66 (inside a chunk of 4); 3 steps; gradients whose norm
    exceeds max_norm (clipped), stays below it, or no clipping."""
    n, nd, lr, b1, b2, eps, wd = 131, 66, 1e-2, 0.9, 0.95, 1e-8, 0.1
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(3)]
    norms = [np.array([_norm_twin(g, "chunk4")], np.float32) for g in grads]
    results = {}
    for version, kern, per in (("one", afn.adamw_flat_one, 1),
                               ("chunk4", afn.adamw_flat_chunk4, 4)):
        p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        sh = np.full(n, np.nan, np.float32)
        state = np.zeros(afn.STATE_SLOTS, np.float64)
        for g, norm in zip(grads, norms):
            afn.count_step[1, 1](state, lr, b1, b2, norm, -1.0 if max_norm is None else max_norm)
            kern[ceil_div(ceil_div(n, per), afn.TPB), afn.TPB](p, g, m, v, sh, state, nd, b1,
                                                                b2, eps, wd)
        assert state[0] == 3
        assert np.array_equal(sh, _bf16(p)), f"{version}: shadow is not bf16(params)"
        results[version] = (p, m, v)
    rp, rm, rv = p0, np.zeros(n), np.zeros(n)
    for t, g in enumerate(grads, 1):
        rp, rm, rv = _adamw64(rp, g, rm, rv, t, lr, b1, b2, eps, wd, nd, max_norm)
    for a, b in zip(results["one"], results["chunk4"]):      # the same arithmetic per element
        assert np.array_equal(a, b)
    for name, got, ref in zip("pmv", results["chunk4"], (rp, rm, rv)):
        cb.check(got, ref, atol=1e-6 * np.abs(ref).max(), rtol=1e-5, name=name)
    if max_norm is not None and scale == 1.0:                 # clipped: g scaled by ~1/11
        assert np.abs(rm).max() < 0.1 * np.abs(grads[-1]).max() / 4


# ============================================================================== GPU: GELU
def _bf16_close(ours, ref, slack):
    """ours (bf16) within one bf16 ulp of ref (bf16), plus ``slack`` (float32, absolute);
    returns the fraction of elements that are bitwise equal."""
    import torch

    o, r = ours.float(), ref.float()
    _, e = torch.frexp(r)                                  # |r| = f 2^e, 0.5 <= f < 1
    ulp = torch.where(r != 0, torch.ldexp(torch.ones_like(r), e - 8),
                      torch.full_like(r, 2.0**-133))
    err = (o - r).abs()
    bad = err > ulp + slack
    assert not bad.any(), (f"{int(bad.sum())} elements more than one bf16 ulp off; first at "
                           f"{int(bad.nonzero()[0, 0])}: {o.flatten()[bad.flatten()][:4].tolist()} "
                           f"vs {r.flatten()[bad.flatten()][:4].tolist()}")
    return float((ours.view(torch.int16) == ref.view(torch.int16)).float().mean())


@gpu
@pytest.mark.parametrize("shape", [(1,), (7,), (4097,), (8192, 3072)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_gelu_matches_torch_autograd(shape, version):
    """Within one bf16 ulp of torch, not bitwise: the fp32 arithmetic is common.cuh's gelu_tanh
    (c v v v, its own FMA contractions), torch's is x x x c in another order, so the fp32 values
    differ by a few fp32 ulps and one that lies near a bf16 rounding midpoint rounds the other
    way. Where 1 + tanh(u) cancels (h below about -4) one fp32 ulp of tanh (2^-24) is many bf16
    ulps of the result, and tanhf may differ by an ulp between the CUDA versions that built
    PyTorch and NVRTC: ``slack`` allows 2-4 fp32 ulps of tanh, propagated."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    h = (torch.randn(shape, device="cuda") * 2).to(torch.bfloat16)
    dg = torch.randn(shape, device="cuda").to(torch.bfloat16)
    hr = h.clone().requires_grad_(True)
    ref = F.gelu(hr, approximate="tanh")
    ref.backward(dg)
    g = torch.full_like(h, float("nan"))
    assert gt.forward(h, g, version=version) is g
    hf = h.float().abs()
    frac = _bf16_close(g, ref.detach(), hf * 2.0**-23)
    assert frac > 0.9 or h.numel() < 4096, f"only {frac:.4f} of the forward bitwise equal"
    dh = torch.full_like(h, float("nan"))
    assert gt.backward(dg, h, dh, version=version) is dh
    sens = dg.float().abs() * (0.5 + hf * K * (1 + 3 * C * hf * hf))
    frac = _bf16_close(dh, hr.grad, sens * 2.0**-22)
    assert frac > 0.9 or h.numel() < 4096, f"only {frac:.4f} of the backward bitwise equal"
    dgi = dg.clone()
    assert gt.backward(dgi, h, dgi, version=version) is dgi           # in place
    assert torch.equal(dgi, dh)
    assert torch.equal(gt.forward(h, version=version), g)             # repeatable, g allocated


@gpu
def test_gelu_versions_agree_bitwise_and_views_work():
    import torch

    torch.manual_seed(1)
    big = (torch.randn(3, 4099, device="cuda") * 3).to(torch.bfloat16)
    h = big[1]                       # a row of a larger tensor: 8198 bytes in, not 16-aligned
    assert h.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        gt.forward(h)
    g1 = gt.forward(h, version="v1")
    g2 = gt.forward(h.clone(), version="v2")
    assert torch.equal(g1, g2)


# ============================================================================== GPU: AdamW
@gpu
@pytest.mark.parametrize("n", [1, 3, 4099, 10_000_019])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_grad_norm_matches_float64_and_repeats_bitwise(n, version):
    import torch

    torch.manual_seed(n)
    g = torch.randn(n, device="cuda")
    out = torch.full((1,), float("nan"), device="cuda")
    assert af.grad_norm(g, out, version=version) is out
    ref = g.double().pow(2).sum().sqrt().item()
    assert abs(out.item() - ref) <= 1e-6 * ref, (out.item(), ref)
    again = af.grad_norm(g, version=version)
    assert torch.equal(again, out)


def _torch_adamw(p0, grads, nd, lr, max_norm):
    """torch.optim.AdamW on the flat p0 split into two parameters: [0, nd) with weight decay 0.1,
    [nd, n) without (two param groups); clip_grad_norm_ over both before each step."""
    import torch

    a = torch.nn.Parameter(p0[:nd].clone())
    b = torch.nn.Parameter(p0[nd:].clone())
    opt = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1},
                             {"params": [b], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    for g in grads:
        a.grad, b.grad = g[:nd].clone(), g[nd:].clone()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([a, b], max_norm)
        opt.step()
    cat = lambda key: torch.cat([opt.state[a][key], opt.state[b][key]])
    return torch.cat([a.detach(), b.detach()]), cat("exp_avg"), cat("exp_avg_sq")


@gpu
@pytest.mark.parametrize("scale, max_norm, given_norm",
                         [(1.0, 1.0, False), (1.0, 1.0, True), (1e-3, 1.0, False),
                          (1.0, None, False)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_adamw_matches_torch_over_five_steps(scale, max_norm, given_norm, version):
    """n = 262147 (a tail of 3), n_decay = 131074 (inside a chunk of 4); gradients of norm about
    512 (clipped to 1), 0.5 (not clipped) or not clipped at all; the norm from grad_norm() or
    computed inside step(). Relative tolerance 2e-6 (with an absolute floor of 1e-6 of the
    largest value, for moments that cancel to near 0): torch forms 1 - beta and the bias
    corrections from the Python doubles, the kernel from their float32 values (2.4e-7 of m's
    and v's increments), the FMAs differ, and the norm is summed in another order (the clip
    coefficient, squared in v). A float32 emulation of the kernel against torch on the CPU
    used at most 55% of a 1e-6 tolerance."""
    import torch

    n, nd, lr = 262147, 131074, 1e-3
    torch.manual_seed(3)
    p0 = torch.randn(n, device="cuda")
    grads = [torch.randn(n, device="cuda") * scale for _ in range(5)]
    keep = [g.clone() for g in grads]
    p, m, v = p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    sh = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    st = af.new_state(p)
    norm = torch.empty(1, device="cuda")
    for g in grads:
        if given_norm:
            af.grad_norm(g, norm, version=version)
        assert af.step(p, g, m, v, sh, st, nd, lr, max_norm=max_norm,
                       norm=norm if given_norm else None, version=version) is p
    rp, rm, rv = _torch_adamw(p0, keep, nd, lr, max_norm)
    assert af.step_count(st) == 5
    assert all(torch.equal(g, k) for g, k in zip(grads, keep)), "grads were rewritten"
    assert torch.equal(sh, p.bfloat16()), "shadow is not params.bfloat16()"
    for name, got, ref in (("params", p, rp), ("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6 * ref.abs().max().item(),
                                   msg=lambda s, name=name: f"{name}: {s}")


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_adamw_step_is_bitwise_repeatable(version):
    import torch

    n, nd = 100_003, 50_001
    torch.manual_seed(5)
    p0, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    outs = []
    for _ in range(2):
        p, m, v = p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        sh = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        st = af.new_state(p)
        for _ in range(2):
            af.step(p, g, m, v, sh, st, nd, 1e-3, version=version)
        outs.append((p, m, v, sh, st))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@gpu
def test_adamw_step_captured_in_a_cuda_graph_replays_like_eager():
    """The step (grad_norm, then step with the norm and a device lr) captured once and replayed
    3 times, the lr tensor changed between replays; the same steps eagerly with Python lrs: the
    step count advances on the device and every buffer is bitwise equal."""
    import torch

    n, nd = 100_003, 50_001
    torch.manual_seed(6)
    p0, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def fresh():
        return (p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"),
                torch.empty(n, device="cuda", dtype=torch.bfloat16), af.new_state(p0))

    A, B = fresh(), fresh()
    lr_t = torch.full((1,), 1e-3, device="cuda")
    norm = torch.empty(1, device="cuda")

    def step_b():
        af.grad_norm(g, norm)
        af.step(B[0], g, B[1], B[2], B[3], B[4], nd, lr_t, norm=norm)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                       # warm-up (loads the module): step 1
        step_b()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_b()
    af.step(A[0], g, A[1], A[2], A[3], A[4], nd, 1e-3)
    assert af.step_count(B[4]) == 1                  # capturing ran nothing
    for lr in (1e-3, 5e-4, 2e-4):
        lr_t.fill_(lr)
        graph.replay()
        af.step(A[0], g, A[1], A[2], A[3], A[4], nd, lr)
    torch.cuda.synchronize()
    assert af.step_count(B[4]) == 4 and af.step_count(A[4]) == 4
    for a, b, name in zip(A, B, ("params", "m", "v", "shadow", "state")):
        assert torch.equal(a, b), name
    assert torch.equal(B[3], B[0].bfloat16())
