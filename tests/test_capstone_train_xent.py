"""The language model's cross-entropy over the vocabulary, fused with its gradient written over
the logits (kernels/cross_entropy_vocab.cu, capstone part 2): the float64 reference and the
Numba twins on the CPU (simulator), the refusals, and on a GPU both CUDA versions against
PyTorch's float64 F.cross_entropy and its autograd gradient (padded vocabularies, int32 and int64
targets, ignored rows, out-of-range targets, in place and separate, bitwise repeats, the mean,
a CUDA graph capture and replay)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cudabook as cb
from cudabook.compile import KERNELS_DIR

gpu = pytest.mark.gpu
xl = cb.load_launch("cross_entropy_vocab")
SIZES = [(10, 16), (1000, 1000), (50257, 50304)]       # (V, Vp): tiny, unpadded, GPT-2


# ----------------------------------------------------------------------------- host side
def _logits(M, V, Vp, seed, pad=30.0):
    """bf16 values in float32; the padding columns hold a value that would dominate the softmax
    if a kernel read them."""
    rng = np.random.default_rng(seed)
    z = xl.bf16_round(rng.standard_normal((M, Vp)).astype(np.float32) * 2)
    z[:, V:] = pad
    return z


def _targets(M, V, dtype, seed, ignore=True):
    """Random classes, with the last (V - 1: in the last, partial chunk of 8) and the first
    column; row 1 ignored (-1) when there are 3 rows or more."""
    t = np.random.default_rng(seed + 1).integers(0, V, M)
    t[0] = V - 1
    if M > 1:
        t[-1] = 0
    if ignore and M >= 3:
        t[1] = -1
    return t.astype(dtype)


def test_reference_on_uniform_logits():
    z = np.zeros((3, 8))
    t = np.array([4, -1, 5])                  # row 2: target V, out of range
    loss, g = xl.reference(z, t, 5, scale=0.5)
    assert np.allclose(loss[0], math.log(5)) and loss[1] == 0 and np.isnan(loss[2])
    assert np.allclose(g[0], [0.1, 0.1, 0.1, 0.1, -0.4, 0, 0, 0])
    assert (g[1] == 0).all() and np.isnan(g[2, :5]).all() and (g[2, 5:] == 0).all()


def test_bf16_round_is_round_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -2.5, np.inf, 3.4e38, np.nan],
                 np.float32)
    r = xl.bf16_round(x)
    assert r[0] == 1 and r[1] == 1 and r[2] == 1 + 2**-6 and r[3] == 1 and r[4] == -2.5
    assert r[5] == np.inf and r[6] == np.inf and np.isnan(r[7])   # 3.4e38 rounds past the max
    torch = pytest.importorskip("torch")
    y = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    want = torch.from_numpy(y).to(torch.bfloat16).float().numpy()
    assert np.array_equal(xl.bf16_round(y), want)


def test_config_and_kernel_names():
    src = (KERNELS_DIR / "cross_entropy_vocab.cu").read_text()
    for version in ("v1", "v2"):
        for tdt in ("int32", "int64"):
            cfg = xl.config(version, 8192, 50304, tdt)
            assert f"void {cfg.kernel}(" in src and cfg.grid == (8192,)
    assert xl.config("v1", 3, 16).block == (xl.V1_THREADS,)
    assert xl.config("v2", 3, 50304, "int64").block == (xl.V2_MAX_THREADS,)
    assert xl.config("v2", 3, 16).block == (32,)
    assert xl.config("v2", 3, 8 * 4 * 100).block == (128,)            # 4 chunks per thread
    m = xl.config("cross_entropy_vocab_mean")
    assert m.grid == (1,) and f"void {m.kernel}(" in src
    with pytest.raises(ValueError, match="unknown version"):
        xl.config("v3")
    with pytest.raises(TypeError, match="int32 or int64"):
        xl.config("v2", 3, 16, "int16")


# ----------------------------------------------------------------------------- Numba twins
def _check_rows(loss, g, ref_loss, ref_g, V, scale, atol_g, rtol_g, atol_l=1e-5):
    """Valid rows within tolerance; ignored rows exactly 0; rows with a bad target NaN over
    j < V; the padding exactly 0 everywhere."""
    bad = np.isnan(ref_loss)
    ok = ~bad
    cb.check(loss[ok], ref_loss[ok], atol=atol_l, rtol=1e-5, name="losses")
    cb.check(g[ok], ref_g[ok], atol=atol_g * scale, rtol=rtol_g, name="gradient")
    assert np.isnan(loss[bad]).all() and np.isnan(g[bad, :V]).all()
    assert (g[:, V:] == 0).all(), "padding columns of the gradient must be 0"


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("V, Vp", [(10, 16), (37, 40), (200, 200)])
@pytest.mark.parametrize("tdt", [np.int32, np.int64])
def test_numba_twins_match_the_reference(version, V, Vp, tdt):
    M = 5
    z = _logits(M, V, Vp, seed=V)
    t = _targets(M, V, tdt, seed=V)
    t[3] = V if tdt == np.int32 else 2**40       # out of range (int64: past int32 too)
    scale = 1 / 3                                # three rows counted
    ref_loss, ref_g = xl.reference(z, t, V, scale)
    assert ref_loss[1] == 0 and (ref_g[1] == 0).all()
    loss, g = xl.forward_backward_numba(z, t, V, scale, version=version)
    _check_rows(loss, g, ref_loss, ref_g, V, scale, atol_g=1e-6, rtol_g=1e-5)
    loss2, g2 = xl.forward_backward_numba(z, t, V, scale, version=version, in_place=True)
    assert np.array_equal(loss2, loss, equal_nan=True) and np.array_equal(g2, g, equal_nan=True)


@pytest.mark.parametrize("M", [1, 33, 1000])
def test_numba_mean_matches_float64(M):
    losses = np.random.default_rng(M).random(M).astype(np.float32) * 12
    got = xl.mean_numba(losses)
    assert abs(got - losses.astype(np.float64).mean()) <= 1e-6 * losses.mean()
    losses[M // 2] = np.nan
    assert np.isnan(xl.mean_numba(losses))


# ----------------------------------------------------------------------------- refusals
def _torch():
    torch = pytest.importorskip("torch")
    return torch, "cuda" if cb.HAS_GPU else "cpu"


def _args(M=3, Vp=16, **kw):
    torch, dev = _torch()
    a = {"logits": torch.zeros(M, Vp, dtype=torch.bfloat16, device=dev),
         "targets": torch.zeros(M, dtype=torch.int64, device=dev),
         "losses": torch.zeros(M, dtype=torch.float32, device=dev), "V": 10}
    a.update(kw)
    return a


def _refusals():
    torch, dev = _torch()
    z = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt, device=dev)
    flat = z(3 * 16 + 8)
    buf = z(4, 16)
    return [
        ({"logits": z(3, 16, dt=torch.float16)}, TypeError, "logits: expected dtype bfloat16"),
        ({"logits": z(3, 16, dt=torch.float32)}, TypeError, "logits: expected dtype bfloat16"),
        ({"logits": z(48)}, ValueError, "logits: expected 2 dimensions"),
        ({"logits": z(0, 16), "targets": z(0, dt=torch.int64), "losses": z(0, dt=torch.float32)},
         ValueError, "empty"),
        ({"targets": z(3, dt=torch.float32)}, TypeError, "targets: expected int32 or int64"),
        ({"targets": z(3, dt=torch.int16)}, TypeError, "targets: expected int32 or int64"),
        ({"targets": z(4, dt=torch.int64)}, ValueError, "targets: expected shape"),
        ({"targets": z(6, dt=torch.int64)[::2]}, ValueError, "targets: expected a C-contiguous"),
        ({"losses": z(3, dt=torch.float64)}, TypeError, "losses: expected dtype float32"),
        ({"losses": z(3, 1, dt=torch.float32)}, ValueError, "losses: expected shape"),
        ({"V": 17}, ValueError, "V = 17: the vocabulary must hold 1 to Vp = 16"),
        ({"V": 0}, ValueError, "V = 0"),
        ({"V": True}, TypeError, "V must be an int"),
        ({"V": 10.0}, TypeError, "V must be an int"),
        ({"logits": z(3, 12)}, ValueError, "multiple of 8 \\(16\\)"),
        ({"logits": z(3, 24)[:, :16]}, ValueError, "logits: expected a C-contiguous"),
        ({"logits": flat[1:1 + 48].view(3, 16)}, ValueError, "logits: .*16-byte aligned"),
        ({"dlogits": z(3, 16, dt=torch.float16)}, TypeError, "dlogits: expected dtype bfloat16"),
        ({"dlogits": z(3, 8)}, ValueError, "dlogits: expected shape"),
        ({"dlogits": flat[1:1 + 48].view(3, 16)}, ValueError, "dlogits: .*16-byte aligned"),
        ({"logits": buf[:3], "dlogits": buf[1:]}, ValueError, "dlogits overlaps logits"),
        ({"scale": float("nan")}, TypeError, "scale must be a finite number"),
        ({"scale": "0.5"}, TypeError, "scale must be a finite number"),
        ({"scale": True}, TypeError, "scale must be a finite number"),
        ({"version": "v3"}, ValueError, "unknown version 'v3'"),
    ]


def test_forward_backward_refuses_what_the_kernels_would_read_wrongly():
    for kw, exc, match in _refusals():
        with pytest.raises(exc, match=match):
            xl.forward_backward(**_args(**kw))


def test_mean_refuses_bad_arrays():
    torch, dev = _torch()
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)
    for losses, out, exc, match in [
            (z(5, dt=torch.float64), z(1), TypeError, "losses: expected dtype float32"),
            (z(5, 1), z(1), ValueError, "losses: expected 1 dimensions"),
            (z(0), z(1), ValueError, "losses: empty"),
            (z(5), z(2), ValueError, "out: expected shape"),
            (z(5), z(1, dt=torch.float64), TypeError, "out: expected dtype float32"),
            (z(10)[::2], z(1), ValueError, "losses: expected a C-contiguous")]:
        with pytest.raises(exc, match=match):
            xl.mean(losses, out)


# ----------------------------------------------------------------------------- GPU
def _case(M, V, Vp, tdt, seed, ignore=True):
    """bf16 logits (M, Vp) on the GPU (randn x 2, the padding 30: it would dominate the softmax
    if read) and targets of ``tdt`` (as _targets)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    z = (torch.randn(M, Vp, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    z[:, V:] = 30.0
    t = torch.from_numpy(_targets(M, V, np.int64, seed, ignore)).to("cuda")
    return z, t.to(getattr(torch, tdt))


def _torch_ref(z, t, V, scale):
    """float64 losses (M,) and gradient (M, Vp) from F.cross_entropy (ignore_index=-1) and
    autograd of sum(losses) * scale; rows whose target is outside [-1, V) are left out (0)."""
    import torch

    tl = t.long()
    tl = torch.where((tl >= 0) & (tl < V), tl, torch.full_like(tl, -1))
    x = z[:, :V].double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x, tl, ignore_index=-1, reduction="none")
    (gx,) = torch.autograd.grad(loss.sum() * scale, x)
    g = torch.zeros(z.shape, dtype=torch.float64, device=z.device)
    g[:, :V] = gx
    return loss.detach(), g


def _check_gpu(losses, g, ref_loss, ref_g, V, scale, bad=()):
    """losses within 1e-4 + 1e-5 |ref| (fp32 sums over V); the gradient within half a bf16 ulp
    of its value plus fp32's error (2^-8 |ref|), and 1e-5 * scale near 0 (the target column's
    p - 1 cancels); ignored rows exactly 0; ``bad`` rows NaN over j < V; the padding 0."""
    import torch

    M = g.shape[0]
    ok = torch.ones(M, dtype=torch.bool, device=g.device)
    for r in bad:
        ok[r] = False
    lo, ref_lo = losses[ok].double(), ref_loss[ok]
    lerr = (lo - ref_lo).abs() - (1e-4 + 1e-5 * ref_lo.abs())
    assert (lerr <= 0).all(), f"loss off by {lerr.max().item():.3g} beyond the tolerance"
    gd, rg = g[ok].double(), ref_g[ok]
    excess = (gd - rg).abs() - (2.0**-8 * rg.abs() + 1e-5 * scale)
    if not (excess <= 0).all():            # NaN fails here too
        i = int(torch.nan_to_num(excess, nan=math.inf).argmax())
        r, c = divmod(i, g.shape[1])
        raise AssertionError(f"gradient wrong at (valid row {r}, column {c}): "
                             f"{gd[r, c].item():.6g} vs {rg[r, c].item():.6g}")
    for r in bad:
        assert math.isnan(losses[r].item()) and torch.isnan(g[r, :V]).all()
    assert (g[:, V:] == 0).all(), "padding columns of the gradient must be 0"


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("M", [1, 3, 1000])
@pytest.mark.parametrize("V, Vp", SIZES)
@pytest.mark.parametrize("tdt", ["int32", "int64"])
def test_kernels_match_torch_float64(version, M, V, Vp, tdt):
    import torch

    z, t = _case(M, V, Vp, tdt, seed=M + V)
    scale = 1.0 / int((t != -1).sum())
    ref_loss, ref_g = _torch_ref(z, t, V, scale)
    losses = torch.full((M,), math.nan, device="cuda")
    g = z.clone()
    assert xl.forward_backward(g, t, losses, V, scale=scale, version=version) is losses
    torch.cuda.synchronize()
    _check_gpu(losses, g, ref_loss, ref_g, V, scale)
    if M >= 3:
        assert losses[1].item() == 0 and (g[1] == 0).all()     # the ignored row


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("tdt", ["int32", "int64"])
def test_out_of_range_target_gives_nan_in_that_row_only(version, tdt):
    import torch

    M, V, Vp = 6, 50257, 50304
    z, t = _case(M, V, Vp, tdt, seed=7)
    t[2], t[3] = V, -2
    bad = [2, 3]
    if tdt == "int64":
        t[4] = 2**32 + 5                 # would wrap to a valid class if narrowed to int32
        bad.append(4)
    scale = 1 / 3
    ref_loss, ref_g = _torch_ref(z, t, V, scale)
    losses = torch.full((M,), math.nan, device="cuda")
    g = z.clone()
    xl.forward_backward(g, t, losses, V, scale=scale, version=version)
    torch.cuda.synchronize()
    _check_gpu(losses, g, ref_loss, ref_g, V, scale, bad=bad)
    out = torch.zeros(1, device="cuda")
    assert math.isnan(xl.mean(losses, out).item())       # the mean says so too


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_separate_dlogits_equal_in_place_and_leave_the_logits(version):
    import torch

    V, Vp = 50257, 50304
    z, t = _case(257, V, Vp, "int64", seed=3)
    z0 = z.clone()
    g = torch.full_like(z, math.nan)
    l1, l2 = torch.empty(257, device="cuda"), torch.empty(257, device="cuda")
    xl.forward_backward(z, t, l1, V, dlogits=g, version=version)
    w = z.clone()
    xl.forward_backward(w, t, l2, V, version=version)
    torch.cuda.synchronize()
    assert torch.equal(z, z0), "logits changed although dlogits was given"
    assert torch.equal(g, w) and torch.equal(l1, l2)


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_bitwise_repeatable(version):
    import torch

    V, Vp = 50257, 50304
    z, t = _case(1000, V, Vp, "int32", seed=5)
    runs = []
    for _ in range(2):
        g, losses, out = z.clone(), torch.empty(1000, device="cuda"), torch.empty(1, device="cuda")
        xl.forward_backward(g, t, losses, V, version=version)
        xl.mean(losses, out)
        runs.append((g, losses, out))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@gpu
@pytest.mark.parametrize("M", [1, 1000, 8192, 100003])
def test_mean_matches_float64(M):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(M)
    losses = torch.rand(M, generator=gen, device="cuda") * 12
    out = torch.full((1,), math.nan, device="cuda")
    assert xl.mean(losses, out) is out
    ref = losses.double().mean().item()
    assert abs(out.item() - ref) <= 1e-6 * ref
    out2 = torch.empty(1, device="cuda")
    xl.mean(losses, out2)
    assert torch.equal(out, out2)


@gpu
def test_capture_in_a_cuda_graph_and_replay():
    import torch

    from cudabook.baselines import torch_graph

    M, V, Vp = 64, 50257, 50304
    src, t = _case(M, V, Vp, "int64", seed=11)
    work = torch.empty_like(src)
    losses, out = torch.empty(M, device="cuda"), torch.empty(1, device="cuda")
    count = int((t != -1).sum())

    def step():
        work.copy_(src)
        xl.forward_backward(work, t, losses, V, scale=1.0 / count)
        xl.mean(losses, out)

    g = torch_graph(step, warmup=2)
    new_src, new_t = _case(M, V, Vp, "int64", seed=12)
    src.copy_(new_src)
    t.copy_(new_t)                         # the same rows ignored (_targets): the same count
    g()
    torch.cuda.synchronize()
    e, el, eo = new_src.clone(), torch.empty(M, device="cuda"), torch.empty(1, device="cuda")
    xl.forward_backward(e, new_t, el, V, scale=1.0 / count)
    xl.mean(el, eo)
    torch.cuda.synchronize()
    assert torch.equal(work, e) and torch.equal(losses, el) and torch.equal(out, eo)
    ref_loss, ref_g = _torch_ref(new_src, new_t, V, 1.0 / count)
    _check_gpu(losses, work, ref_loss, ref_g, V, 1.0 / count)
    assert abs(out.item() - ref_loss.mean().item()) <= 1e-4 * ref_loss.mean().item()
