"""The GPT's token + position embedding for training (kernels/embedding_train.cu): the Numba twins
on the simulator (or a GPU) against float64 NumPy, the stable counting sort of backward v2 step
by step, the refusals on the CPU; the CUDA C++ kernels (GPU) against float64 PyTorch autograd of
F.embedding + wpe, at GPT-2 small's shape with a token that occurs thousands of times, int32 and
int64 ids, accumulation, bit-for-bit repeatability, a CUDA graph capture and bad ids.

Tolerances: the forward is one float32 addition, so x is within half an ulp of the float64 sum
(|err| <= 2^-24 |ref|) and equal to PyTorch's float32 x bit for bit. A gradient row of a token
that occurs n times is n float32 additions in position order plus one into the accumulator:
|err| <= gamma_(n+1) (sum of |dx| + |dwte0|), gamma_k = k u / (1 - k u), u = 2^-24
(reference_backward's bounds); dwpe likewise with n = B. Rows of absent tokens: exact.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import cudabook as cb

gpu = pytest.mark.gpu
et = cb.load_launch("embedding_train")
U = 2.0 ** -24
SPACE = 220                  # GPT-2's id of " ": the most frequent token of English text


def _tokens(B, T, Vp, seed=0, dtype=np.int64):
    """Ids with repeats: 40% of the positions hold one token (thousands of times at GPT-2's
    shape, across many chunks of the sort), a tenth a second one, the rest uniform; the first
    and last vocabulary rows appear where there is room."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, Vp, (B, T))
    r = rng.random((B, T))
    tok[r < 0.4] = min(SPACE, Vp - 1)
    tok[(r >= 0.4) & (r < 0.5)] = Vp // 3
    flat = tok.reshape(-1)
    flat[-1] = Vp - 1
    if flat.size > 2:
        flat[1] = 0
    return tok.astype(dtype)


def _case(B, T, Vp, C, seed=0, extra_pos=3):
    rng = np.random.default_rng(seed + 1)
    f = np.float32
    shapes = ((Vp, C), (T + extra_pos, C), (B * T, C), (Vp, C), (T + extra_pos, C))
    return tuple(rng.standard_normal(s).astype(f) for s in shapes)   # wte, wpe, dx, dwte0, dwpe0


def _misaligned(shape, dtype=np.float32):
    """A C-contiguous array whose first element is 4 bytes past a 16-byte boundary."""
    n = int(np.prod(shape))
    buf = np.zeros(n + 8, dtype)
    off = next(k for k in range(8) if (buf.ctypes.data + 4 * k) % 16 == 4)
    return buf[off:off + n].reshape(shape)


# ----------------------------------------------------------------------------- constants
def test_constants_match_the_cuda_source_and_the_twins():
    src = (cb.compile.KERNELS_DIR / "embedding_train.cu").read_text()
    assert int(re.search(r"#define EMB_CHUNK (\d+)", src).group(1)) == et.CHUNK
    assert int(re.search(r"#define EMB_WARPS (\d+)", src).group(1)) == et.WARPS
    assert cb.load_numba("embedding_train").CHUNK == et.CHUNK
    for steps in et.STEPS.values():
        for k in steps:
            names = [f"{k}_i32", f"{k}_i64"] if k in et._READS_IDS else [k]
            for n in names:
                assert f'extern "C" __global__ void {n}(' in src, n


def test_config_and_scratch_size():
    B, T, Vp, C = 8, 1024, 50304, 768
    assert et.config("embedding_fwd_v1", B, T, Vp, C)[0] == (8192 * 192 // 256,)
    assert et.config("embedding_bwd_v1", B, T, Vp, C)[0] == (Vp, 2)
    assert et.config("embedding_bwd_v2_rank", B, T, Vp, C)[:2] == ((32,), (256,))
    assert et.config("embedding_bwd_v2_sum", B, T, Vp, C)[:2] == ((Vp // 8, 6), (256,))
    assert et.scratch_size(B, T, Vp) == (Vp + 1) + 2 * 8192 + 32 * Vp
    lay = et.scratch_layout(2, 300, 7)            # 600 positions: 3 chunks
    assert lay == {"start": (0, 8), "rank": (8, 600), "order": (608, 600),
                   "table": (1208, 21)}
    with pytest.raises(ValueError, match="unknown kernel"):
        et.config("embedding_bwd_v3")


# ----------------------------------------------------------------------------- twins
@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_numba_forward_matches_the_reference_and_bad_ids_give_nan(dt):
    B, T, Vp, C = 3, 7, 50, 8
    wte, wpe, *_ = _case(B, T, Vp, C)
    tok = _tokens(B, T, Vp, dtype=dt)
    x = et.forward_numba(tok, wte, wpe)
    ref = et.reference_forward(tok, wte, wpe)
    cb.check(x, ref, atol=0, rtol=U)
    assert (x == wte[tok.reshape(-1)] + np.tile(wpe[:T], (B, 1))).all()     # float32, exactly
    bad = tok.copy()
    bad[0, 2], bad[2, 6] = -1, Vp
    x = et.forward_numba(bad, wte, wpe)
    rows = np.isnan(x).all(axis=1)
    assert rows[2] and rows[2 * T + 6] and rows.sum() == 2
    cb.check(np.delete(x, [2, 2 * T + 6], 0), np.delete(ref, [2, 2 * T + 6], 0), atol=0, rtol=U)


@pytest.mark.parametrize("B, T, Vp, C", [(1, 1, 8, 4), (2, 17, 100, 12)])   # several chunks:
@pytest.mark.parametrize("dt", [np.int32, np.int64])                # the test after this one
def test_numba_backward_versions_agree_bitwise_and_match_float64(B, T, Vp, C, dt):
    wte, wpe, dx, dwte0, dwpe0 = _case(B, T, Vp, C, seed=B * T)
    tok = _tokens(B, T, Vp, seed=T, dtype=dt)
    ref_w, ref_p, bound = et.reference_backward(tok, dx, dwte0, dwpe0)
    out = {v: et.backward_numba(tok, dx, dwte0, dwpe0, version=v) for v in ("v1", "v2")}
    for v, (w, p, _) in out.items():
        assert (np.abs(w - ref_w) <= bound["dwte"]).all(), f"{v}: dwte beyond gamma_(n+1)"
        assert (np.abs(p - ref_p) <= bound["dwpe"]).all(), f"{v}: dwpe beyond gamma_(B+1)"
        absent = np.bincount(tok.reshape(-1), minlength=Vp) == 0
        assert (w[absent] == dwte0[absent]).all() and (p[T:] == dwpe0[T:]).all()
    assert (out["v1"][0] == out["v2"][0]).all() and (out["v1"][1] == out["v2"][1]).all()


def test_numba_v2_sort_is_stable_across_chunks_and_skips_bad_ids():
    B, T, Vp, C = 3, 300, 61, 4                    # 900 positions: 4 chunks of 256
    _, _, dx, dwte0, dwpe0 = _case(B, T, Vp, C)
    tok = _tokens(B, T, Vp, seed=5)
    tok[0, 0], tok[1, 9], tok[2, 299] = -3, Vp, 2**40    # bad ids, one past 32 bits
    w, p, s = et.backward_numba(tok, dx, dwte0, dwpe0, version="v2")
    lay = et.scratch_layout(B, T, Vp)
    flat = tok.reshape(-1)
    ok = (flat >= 0) & (flat < Vp)
    n = int(ok.sum())
    start = s[lay["start"][0]:lay["start"][0] + Vp + 1]
    order = s[lay["order"][0]:lay["order"][0] + B * T]
    counts = np.bincount(flat[ok], minlength=Vp)
    assert (start == np.concatenate([[0], np.cumsum(counts)])).all()
    assert (order[:n] == np.argsort(np.where(ok, flat, Vp), kind="stable")[:n]).all()
    assert counts[min(SPACE, Vp - 1)] > et.CHUNK    # the frequent token spans every chunk
    ref_w, ref_p, bound = et.reference_backward(tok, dx, dwte0, dwpe0)
    assert (np.abs(w - ref_w) <= bound["dwte"]).all()
    assert (np.abs(p - ref_p) <= bound["dwpe"]).all()      # bad ids' rows still reach dwpe
    w1, p1, _ = et.backward_numba(tok, dx, dwte0, dwpe0, version="v1")
    assert (w1 == w).all() and (p1 == p).all()


# ----------------------------------------------------------------------------- refusals
def _good(B=2, T=5, Vp=16, C=8):
    wte, wpe, dx, dwte0, dwpe0 = _case(B, T, Vp, C)
    return _tokens(B, T, Vp, dtype=np.int32), wte, wpe, dx, dwte0, dwpe0


@pytest.mark.parametrize("edit, err, match", [
    (lambda a: a.update(tok=a["tok"].astype(np.float32)), TypeError,
     "tokens: expected int32 or int64"),
    (lambda a: a.update(tok=a["tok"].astype(np.int16)), TypeError,
     "tokens: expected int32 or int64"),
    (lambda a: a.update(tok=a["tok"].reshape(-1)), ValueError, "tokens: expected 2 dimensions"),
    (lambda a: a.update(tok=a["tok"][:, :0]), ValueError, "B and T must be >= 1"),
    (lambda a: a.update(tok=np.asfortranarray(a["tok"])), ValueError,
     "tokens: expected a C-contiguous"),
    (lambda a: a.update(w=a["w"].astype(np.float64)), TypeError, "{w}: expected dtype float32"),
    (lambda a: a.update(w=a["w"][:, :6].copy(), p=a["p"][:, :6].copy(), r=a["r"][:, :6].copy()),
     ValueError, "{w}: shape .* multiple of 4"),
    (lambda a: a.update(p=a["p"][:4].copy()), ValueError, "{p}: 4 positions, .* T = 5"),
    (lambda a: a.update(p=a["p"][:, :4].copy()), ValueError, "{p}: expected shape"),
    (lambda a: a.update(r=a["r"][:9].copy()), ValueError, r"{r}: expected shape \(10, 8\)"),
    (lambda a: a.update(r=np.asfortranarray(a["r"])), ValueError, "{r}: expected a C-contiguous"),
    (lambda a: a.update(w=_misaligned(a["w"].shape)), ValueError, "{w}: .* not 16-byte aligned"),
    (lambda a: a.update(r=_misaligned(a["r"].shape)), ValueError, "{r}: .* not 16-byte aligned"),
    (lambda a: None, TypeError, "tokens: expected a GPU array"),   # valid, but host arrays
])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_refusals_name_the_argument(edit, err, match, which):
    tok, wte, wpe, dx, dwte0, dwpe0 = _good()
    a = {"tok": tok, "w": wte if which == "forward" else dwte0,
         "p": wpe if which == "forward" else dwpe0, "r": np.zeros_like(dx) if which ==
         "forward" else dx}
    edit(a)
    names = {"w": "wte", "p": "wpe", "r": "x"} if which == "forward" else \
        {"w": "dwte", "p": "dwpe", "r": "dx"}
    match = match.format(**names)
    with pytest.raises(err, match=match):
        if which == "forward":
            et.forward(a["tok"], a["w"], a["p"], a["r"])
        else:
            et.backward(a["tok"], a["r"], a["w"], a["p"])


def test_refusals_of_scratch_and_version():
    tok, wte, wpe, dx, dwte0, dwpe0 = _good()
    need = et.scratch_size(2, 5, 16)
    with pytest.raises(ValueError, match=rf"scratch_size\(2, 5, 16\) = {need}"):
        et.backward(tok, dx, dwte0, dwpe0, scratch=np.zeros(need - 1, np.int32))
    with pytest.raises(TypeError, match="scratch: expected dtype int32"):
        et.backward(tok, dx, dwte0, dwpe0, scratch=np.zeros(need, np.int64))
    with pytest.raises(ValueError, match="unknown version 'v3'"):
        et.backward(tok, dx, dwte0, dwpe0, version="v3")
    with pytest.raises(ValueError, match="unknown version 'v2'"):
        et.forward(tok, wte, wpe, np.zeros_like(dx), version="v2")
    with pytest.raises(TypeError, match="tokens: expected a GPU array"):   # the scratch fits
        et.backward(tok, dx, dwte0, dwpe0, scratch=np.zeros(need, np.int32))


def test_torch_cpu_tensors_are_refused():
    torch = pytest.importorskip("torch")
    tok, wte, wpe, dx, *_ = _good()
    with pytest.raises(TypeError, match="tokens: expected a GPU array"):
        et.forward(*(torch.from_numpy(a) for a in (tok, wte, wpe, np.zeros_like(dx))))


# ----------------------------------------------------------------------------- GPU
SHAPES = [(1, 1, 8, 4), (2, 17, 1000, 12), (8, 1024, 50304, 768)]


def _gpu_case(B, T, Vp, C, seed=0):
    import torch

    dev = "cuda"
    extra = 0 if T == 1024 else 3
    wte, wpe, dx, dwte0, dwpe0 = (torch.from_numpy(a).to(dev)
                                  for a in _case(B, T, Vp, C, seed, extra_pos=extra))
    tok = torch.from_numpy(_tokens(B, T, Vp, seed)).to(dev)
    return tok, wte, wpe, dx, dwte0, dwpe0


def _autograd_reference(tok, wte, wpe, dx, dwte0, dwpe0):
    """float64 PyTorch: x, dwte0 + dwte, dwpe0 + dwpe (autograd of F.embedding + wpe) and the
    elementwise bounds gamma_(n+1) (sum |dx| + |acc0|) (the module's docstring)."""
    import torch
    import torch.nn.functional as F

    B, T = tok.shape
    C = wte.shape[1]
    w64 = wte.double().requires_grad_()
    p64 = wpe.double().requires_grad_()
    x = (F.embedding(tok.long(), w64) + p64[:T]).reshape(B * T, C)
    x.backward(dx.double())
    ref_w, ref_p = dwte0.double() + w64.grad, dwpe0.double() + p64.grad
    flat = tok.reshape(-1).long()
    n = torch.bincount(flat, minlength=wte.shape[0]).double()[:, None]
    sw = torch.zeros_like(ref_w).index_add_(0, flat, dx.double().abs())
    sp = dx.double().abs().reshape(B, T, C).sum(0)

    def gamma(k):
        return k * U / (1 - k * U)

    bw = gamma(n + 1) * (sw + dwte0.double().abs()) * (n > 0)
    bp = torch.zeros_like(ref_p)
    bp[:T] = gamma(B + 1) * (sp + dwpe0[:T].double().abs())
    return x.detach(), ref_w, ref_p, bw, bp


def _within(got, ref, bound, what):
    err = (got.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond the summation bound, "
                           f"worst {float((err - bound).max()):.3g} past it")


@gpu
@pytest.mark.parametrize("B, T, Vp, C", SHAPES)
def test_cuda_forward_matches_autograd_reference(B, T, Vp, C):
    import torch

    tok, wte, wpe, dx, dwte0, dwpe0 = _gpu_case(B, T, Vp, C)
    ref = _autograd_reference(tok, wte, wpe, dx, dwte0, dwpe0)[0]
    exact = (torch.nn.functional.embedding(tok.long(), wte) + wpe[:T]).reshape(B * T, C)
    for dt in (torch.int32, torch.int64):
        x = torch.full((B * T, C), float("nan"), device="cuda")
        assert et.forward(tok.to(dt), wte, wpe, x) is x
        _within(x, ref, U * ref.abs(), f"x ({dt})")
        assert torch.equal(x, exact), f"x ({dt}) differs from PyTorch's float32 sum"


@gpu
@pytest.mark.parametrize("B, T, Vp, C", SHAPES)
def test_cuda_backward_matches_autograd_and_repeats_bitwise(B, T, Vp, C):
    import torch

    tok, wte, wpe, dx, dwte0, dwpe0 = _gpu_case(B, T, Vp, C, seed=1)
    _, ref_w, ref_p, bw, bp = _autograd_reference(tok, wte, wpe, dx, dwte0, dwpe0)
    if B * T > 1000:
        assert int((tok == SPACE).sum()) > 3000    # one token thousands of times
    first = None
    for v in et.BWD_VERSIONS:
        for dt in (torch.int32, torch.int64):
            runs = []
            for _ in range(2):
                w, p = dwte0.clone(), dwpe0.clone()
                assert et.backward(tok.to(dt), dx, w, p, version=v) == (w, p)
                runs.append((w, p))
            torch.cuda.synchronize()
            w, p = runs[0]
            _within(w, ref_w, bw, f"dwte ({v}, {dt})")
            _within(p, ref_p, bp, f"dwpe ({v}, {dt})")
            assert torch.equal(w, runs[1][0]) and torch.equal(p, runs[1][1]), \
                f"{v} ({dt}): two runs differ (not deterministic)"
            first = first or (w, p)
            assert torch.equal(w, first[0]) and torch.equal(p, first[1]), \
                f"{v} ({dt}) differs from {et.BWD_VERSIONS[0]} (int32): the order of a sum changed"


@gpu
def test_cuda_backward_v2_with_given_scratch_and_cupy_inputs():
    import cupy as cp

    B, T, Vp, C = 3, 300, 517, 20                # 900 positions: 4 chunks; C/4 = 5 columns
    wte, wpe, dx, dwte0, dwpe0 = _case(B, T, Vp, C, seed=4)
    tok = _tokens(B, T, Vp, seed=4, dtype=np.int32)
    ref_w, ref_p, bound = et.reference_backward(tok, dx, dwte0, dwpe0)
    s = cp.full(et.scratch_size(B, T, Vp) + 5, -1, cp.int32)
    w, p = cp.asarray(dwte0), cp.asarray(dwpe0)
    et.backward(cp.asarray(tok), cp.asarray(dx), w, p, scratch=s)
    assert (np.abs(w.get() - ref_w) <= bound["dwte"]).all()
    assert (np.abs(p.get() - ref_p) <= bound["dwpe"]).all()
    lay = et.scratch_layout(B, T, Vp)
    o = s[lay["order"][0]:lay["order"][0] + B * T].get()
    assert (o == np.argsort(tok.reshape(-1), kind="stable")).all()


@gpu
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_cuda_graph_capture_and_replay(id_dtype):
    import torch

    B, T, Vp, C = 8, 1024, 50304, 768
    tok, wte, wpe, dx, dwte0, dwpe0 = _gpu_case(B, T, Vp, C, seed=2)
    dt = getattr(torch, id_dtype)
    s_tok, s_dx = tok.to(dt), dx.clone()
    x = torch.empty(B * T, C, device="cuda")
    w, p = torch.zeros_like(dwte0), torch.zeros_like(dwpe0)

    def step():
        et.forward(s_tok, wte, wpe, x)
        et.backward(s_tok, s_dx, w, p)            # scratch from the graph's pool

    g = cb.baselines.torch_graph(step, warmup=2)
    tok2, dx2 = (_gpu_case(B, T, Vp, C, seed=3)[k] for k in (0, 3))
    s_tok.copy_(tok2.to(dt))
    s_dx.copy_(dx2)
    w.zero_()
    p.zero_()
    g()
    torch.cuda.synchronize()
    x_e, w_e, p_e = torch.empty_like(x), torch.zeros_like(w), torch.zeros_like(p)
    et.forward(tok2.to(dt), wte, wpe, x_e)
    et.backward(tok2.to(dt), dx2, w_e, p_e)
    torch.cuda.synchronize()
    assert torch.equal(x, x_e) and torch.equal(w, w_e) and torch.equal(p, p_e)
    g()                                           # replay again: the gradients accumulate
    et.backward(tok2.to(dt), dx2, w_e, p_e)
    torch.cuda.synchronize()
    assert torch.equal(w, w_e) and torch.equal(p, p_e)


@gpu
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_cuda_bad_ids_give_nan_rows_and_are_skipped_in_dwte(id_dtype):
    import torch

    B, T, Vp, C = 2, 17, 1000, 12
    tok, wte, wpe, dx, dwte0, dwpe0 = _gpu_case(B, T, Vp, C, seed=5)
    bad = tok.clone()
    bad[0, 3], bad[1, 16] = -1, Vp
    if id_dtype == "int64":
        bad[1, 0] = 2**32 + 5                     # would be id 5 if narrowed to 32 bits
    bad = bad.to(getattr(torch, id_dtype))
    x = torch.zeros(B * T, C, device="cuda")
    et.forward(bad, wte, wpe, x)
    ref = et.reference_forward(bad.cpu().numpy(), wte.cpu().numpy(), wpe.cpu().numpy())
    xs = x.cpu().numpy()
    nan_rows = np.isnan(xs).all(axis=1)
    assert (nan_rows == np.isnan(ref).all(axis=1)).all() and not np.isnan(xs[~nan_rows]).any()
    cb.check(xs[~nan_rows], ref[~nan_rows], atol=0, rtol=U)
    args = [a.cpu().numpy() for a in (bad, dx, dwte0, dwpe0)]
    ref_w, ref_p, bound = et.reference_backward(*args)
    for v in et.BWD_VERSIONS:
        w, p = dwte0.clone(), dwpe0.clone()
        et.backward(bad, dx, w, p, version=v)
        assert (np.abs(w.cpu().numpy() - ref_w) <= bound["dwte"]).all(), v
        assert (np.abs(p.cpu().numpy() - ref_p) <= bound["dwpe"]).all(), v


@gpu
def test_cuda_refuses_misaligned_noncontiguous_and_mixed_devices():
    import torch

    tok, wte, wpe, dx, dwte0, dwpe0 = _gpu_case(2, 17, 1000, 12)
    x = torch.empty_like(dx)
    off = torch.empty(wte.numel() + 1, device="cuda")[1:].view(wte.shape)
    with pytest.raises(ValueError, match="wte: its first element is not 16-byte aligned"):
        et.forward(tok, off, wpe, x)
    with pytest.raises(ValueError, match="dx: expected a C-contiguous"):
        et.backward(tok, dx.t().contiguous().t(), dwte0, dwpe0)
    with pytest.raises(TypeError, match="dwpe: expected a GPU array"):
        et.backward(tok, dx, dwte0, dwpe0.cpu())
    with pytest.raises(TypeError, match="tokens: expected int32 or int64"):
        et.forward(tok.to(torch.int16), wte, wpe, x)
