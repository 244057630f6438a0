"""Chapter 6: the digits data and reference model, the Numba kernels against PyTorch autograd
(simulator or GPU), the CUDA C++ kernels through their launch helpers and torchops (GPU), and the
graders: the reference passes, stubs and plausible wrong answers fail with the hint that names
their mistake. References come from solutions/06_training.ipynb; wrong answers are edits of them
(tests/solution_cells.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numba import cuda
from solution_cells import Solution, check_exercise_page

import cudabook as cb
from cudabook import digits, torchops
from cudabook.graders import GradeError, ex06_1, ex06_2, ex06_3, ex06_4, ex06_5
from cudabook.graders._core import xp as grader_xp
from cudabook.graders.ch06 import layernorm_backward_reference

# the grader tests read the reference answers from the solutions notebook, which is committed
# with the outputs of its GPU run; until then they are skipped (the kernel tests still run)
SOL_PATH = Path(__file__).resolve().parents[1] / "solutions" / "06_training.ipynb"
SOL = Solution("06") if SOL_PATH.exists() else None
needs_solutions = pytest.mark.skipif(SOL is None, reason="solutions/06_training.ipynb is not in "
                                     "this checkout yet (committed after its GPU run)")
gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------- digits
def test_digits_split_is_fixed_and_disjoint():
    a, b = digits.load(), digits.load()
    assert (a.n_train, a.n_test) == (1438, 359)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert a.x_train.dtype == np.float32 and 0 <= a.x_train.min() and a.x_train.max() <= 1
    assert not np.array_equal(digits.load(seed=1).y_train, a.y_train)


def test_init_and_batch_order_are_seeded():
    p, q = digits.init_params(seed=4), digits.init_params(seed=4)
    assert [W.shape for W, _ in p] == [(64, 256), (256, 10)]
    assert all(np.array_equal(W, V) for (W, _), (V, _) in zip(p, q))
    assert np.abs(p[0][0]).max() <= 1 / 8 and np.abs(p[1][0]).max() <= 1 / 16
    order = list(digits.batch_order(100, 30, 2))
    assert len(order) == 6 and all(len(i) == 30 for i in order)
    assert len(set(np.concatenate(order[:3]))) == 90
    with pytest.raises(ValueError, match="batch 200 > 100"):
        list(digits.batch_order(100, 200, 1))


def test_torch_reference_trains():
    data = digits.load()
    out = digits.train_torch(digits.MLP(digits.init_params()), data, steps=30)
    assert out["steps"] == 30 and out["losses"][-1] < out["losses"][0] / 2


# ----------------------------------------------------------------------------- Numba kernels
def _ce_ref(z, y):
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    loss = F.cross_entropy(zt, torch.tensor(y, dtype=torch.int64))
    (dz,) = torch.autograd.grad(loss, zt)
    return float(loss.detach()), dz.numpy()


def test_numba_cross_entropy_and_bias_grad_match_autograd():
    cel, bg = cb.load_launch("cross_entropy"), cb.load_numba("bias_grad")
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((9, 5)) * 3).astype(np.float32)
    y = rng.integers(0, 5, 9).astype(np.int32)
    loss, dz = cuda.to_device(np.zeros(1, np.float32)), cuda.to_device(np.full((9, 5), np.nan,
                                                                               np.float32))
    cel.cross_entropy_numba(cuda.to_device(z), cuda.to_device(y), loss, dz)
    ref_loss, ref_dz = _ce_ref(z, y)
    cb.check(loss.copy_to_host(), np.array([ref_loss]))
    cb.check(dz.copy_to_host(), ref_dz)
    cel.cross_entropy_numba(cuda.to_device(z), cuda.to_device(y), loss, dz, reduction="sum")
    cb.check(dz.copy_to_host(), 9 * ref_dz)
    dzm = rng.standard_normal((7, 11))
    db = cuda.to_device(np.full(11, np.nan))
    bg.bias_grad_v1[1, 256](cuda.to_device(dzm), db)
    cb.check(db.copy_to_host(), dzm.sum(0), atol=1e-12, rtol=1e-12)


def test_numba_updates_match_torch_optim():
    optl, nb = cb.load_launch("optim"), cb.load_numba("optim")
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(37)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    pt = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.AdamW([pt], **hp, foreach=False)
    p, m, v = (cuda.to_device(a) for a in (p0.copy(), np.zeros(37), np.zeros(37)))
    for t in (1, 2, 3):
        g = rng.standard_normal(37)
        pt.grad = torch.tensor(g)
        opt.step()
        optl.adamw_numba(p, cuda.to_device(g), m, v, t, **hp)
        cb.check(p.copy_to_host(), pt.detach().numpy(), atol=1e-13, rtol=1e-12)
    with pytest.raises(ValueError, match="1 at the first step"):
        optl.adamw_numba(p, p, m, v, 0)
    q, g = p0.copy(), rng.standard_normal(37)
    nb.sgd_v1[1, 256](q, g, 0.1, 0.01)
    cb.check(q, p0 - 0.1 * (g + 0.01 * p0), atol=1e-13, rtol=1e-12)


def test_cross_entropy_helper_refuses_bad_input():
    cel = cb.load_launch("cross_entropy")
    m = grader_xp()                           # device arrays on a GPU, NumPy in the simulator
    z = m.zeros((4, 3), np.float32)
    y = m.zeros(4, np.int32)
    loss = m.zeros(1, np.float32)
    with pytest.raises(TypeError, match="expected dtype int32"):
        cel.cross_entropy_numba(z, y.astype(np.int64), loss, m.zeros_like(z))
    with pytest.raises(ValueError, match=r"dz: expected shape \(4, 3\)"):
        cel.cross_entropy_numba(z, y, loss, m.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="reduction"):
        cel.cross_entropy_numba(z, y, loss, m.zeros_like(z), reduction="avg")
    with pytest.raises(TypeError, match="float32 or float64"):
        cel.cross_entropy_numba(z.astype(np.float16), y, loss, m.zeros_like(z))


@pytest.mark.parametrize("label", [3, 12, -1])
def test_cross_entropy_bad_label_is_nan_never_a_number(label):
    # a label outside [0, C) for C = 3: the loss and that row's gradient are NaN (a kernel
    # cannot raise); the other rows' gradients are untouched. -1 would wrap to z[r, C - 1]
    from numba import cuda

    cel = cb.load_launch("cross_entropy")
    rng = np.random.default_rng(label + 7)
    z = rng.standard_normal((4, 3)).astype(np.float32)
    y = np.array([0, label, 2, 1], np.int32)
    loss = cuda.to_device(np.zeros(1, np.float32))
    dz = cuda.to_device(np.zeros((4, 3), np.float32))
    cel.cross_entropy_numba(cuda.to_device(z), cuda.to_device(y), loss, dz)
    d = dz.copy_to_host()
    assert np.isnan(loss.copy_to_host()[0]) and np.isnan(d[1]).all()
    assert np.isfinite(d[[0, 2, 3]]).all()
    if cb.HAS_GPU:                                   # the CUDA C++ kernel, int64 labels too
        import cupy as cp

        for lab in (cp.asarray(y), torch.as_tensor(y.astype(np.int64), device="cuda")):
            lc, dc = cel.cross_entropy(cp.asarray(z), lab)
            dc = cp.asnumpy(dc)
            assert np.isnan(float(lc[0])) and np.isnan(dc[1]).all()
            assert np.isfinite(dc[[0, 2, 3]]).all()
        good = np.array([0, 1, 2, 1])
        lc, _ = cel.cross_entropy(cp.asarray(z), torch.as_tensor(good, device="cuda"))
        ref = torch.nn.functional.cross_entropy(torch.as_tensor(z, dtype=torch.float64),
                                                torch.as_tensor(good))
        assert abs(float(lc[0]) - float(ref)) < 1e-5


# ----------------------------------------------------------------------------- torchops (CPU)
def test_dlpack_bridge_is_zero_copy_on_cpu():
    t = torch.randn(4, 6).t()
    a = torchops.as_array(t)
    assert a.ctypes.data == t.data_ptr() and a.shape == (6, 4)
    back = torchops.as_tensor(a)
    assert back.data_ptr() == t.data_ptr()
    a[0, 0] = 123.0
    assert t[0, 0].item() == 123.0


def test_functions_ask_for_the_gpu():
    with pytest.raises(TypeError, match=r"\.to\('cuda'\)"):
        torchops.Matmul.apply(torch.randn(2, 3), torch.randn(3, 4))


def test_thin_matmul_says_why_it_cannot_run():
    th = cb.load_launch("thin_matmul")
    xp = grader_xp()                                    # device arrays on a GPU, NumPy otherwise
    f32 = np.float32
    A, B, G = xp.zeros((37, 44), f32), xp.zeros((44, 10), f32), xp.zeros((37, 10), f32)
    assert th.why_not("nn", A, B) is None and th.why_not("tn", A, G) is None
    assert th.why_not("nt", G, B) is None
    assert "multiple of 4" in th.why_not("nn", xp.zeros((37, 47), f32), xp.zeros((47, 10), f32))
    assert "1 <= N <= 16" in th.why_not("nn", A, xp.zeros((44, 17), f32))
    assert "dtype float32" in th.why_not("tn", A.astype(np.float64), G)
    assert "inner dimensions differ" in th.why_not("nn", A, xp.zeros((40, 10), f32))
    assert "same number of rows" in th.why_not("tn", A, xp.zeros((36, 10), f32))
    assert "C-contiguous" in th.why_not("nt", G, B.T.copy().T)
    assert th.tn_workspace(64, 256, 10) == 0            # one slice: tn writes C directly
    plan = th.config("tn", 4096, 4096, 10, sms=132)     # 17 slices, summed by thin_tn_reduce
    assert plan["main"] == ((32, 17), (32, 4)) and plan["main"].rows == 241
    assert plan["reduce"].kernel == "thin_tn_reduce"
    assert th.tn_workspace(4096, 4096, 10, sms=132) == 17 * 4096 * 10
    assert th.config("nn", 203, 132, 10) == ((7,), (256,))
    with pytest.raises(ValueError, match="unknown product"):
        th.why_not("tt", A, B)


def test_numba_thin_products_match_float64():
    nb_th = cb.load_numba("thin_matmul")
    g = np.random.default_rng(11)
    M, K, N = 13, 9, 3                                  # tiny: the simulator runs every thread
    A, B, G = (g.standard_normal(s).astype(np.float32) for s in ((M, K), (K, N), (M, N)))
    for kern, x, y, shape, ref in ((nb_th.thin_nn_per_output, A, B, (M, N), A @ B),
                                   (nb_th.thin_tn_per_output, A, G, (K, N), A.T @ G),
                                   (nb_th.thin_nt_per_output, G, B, (M, K), G @ B.T)):
        out = cuda.to_device(np.full(shape, np.nan, np.float32))
        kern[(cb.ceil_div(shape[0], 16), cb.ceil_div(shape[1], 16)), (16, 16)](
            cuda.to_device(x), cuda.to_device(y), out)
        cb.check(out.copy_to_host(), ref.astype(np.float64), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU: helpers
def _t64(a):
    return torch.tensor(np.asarray(a), dtype=torch.float64)


@gpu
def test_cuda_kernels_match_autograd_in_float32_and_float64():
    import cupy as cp

    cel, bgl, al = (cb.load_launch(n) for n in ("cross_entropy", "bias_grad", "activation"))
    rng = np.random.default_rng(2)
    z = rng.standard_normal((37, 45)) * 3          # C > 32: a warp loops over the row
    y = rng.integers(0, 45, 37)
    ref_loss, ref_dz = _ce_ref(z, y)
    for dt, tol in ((cp.float32, 1e-5), (cp.float64, 1e-12)):
        loss, dz = cel.cross_entropy(cp.asarray(z, dt), cp.asarray(y, cp.int32))
        cb.check(loss, np.array([ref_loss]), atol=tol, rtol=tol)
        cb.check(dz, ref_dz, atol=tol, rtol=tol)
        h, b, dy = rng.standard_normal((37, 29)), rng.standard_normal(29), rng.standard_normal(
            (37, 29))
        ht, bt = _t64(h).requires_grad_(), _t64(b).requires_grad_()
        F.gelu(ht + bt, approximate="tanh").backward(_t64(dy))
        dh = al.gelu_backward(cp.asarray(h, dt), cp.asarray(b, dt), cp.asarray(dy, dt))
        cb.check(dh, ht.grad.numpy(), atol=10 * tol, rtol=10 * tol)
        for v in (("bias_grad_v1", "bias_grad_v2") if dt == cp.float32 else ("f64",)):
            cb.check(bgl.bias_grad(dh, version=v), bt.grad.numpy(), atol=100 * tol,
                     rtol=10 * tol, name=v)
    loss, _ = cel.cross_entropy(cp.asarray(z, cp.float32), cp.asarray(y, cp.int32), dz=False)
    cb.check(loss, np.array([ref_loss]), atol=1e-5, rtol=1e-5)


@gpu
def test_adamw_kernel_matches_torch_and_counts_steps_on_the_device():
    import cupy as cp

    optl = cb.load_launch("optim")
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(1003).astype(np.float32)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    pt = torch.tensor(p0, device="cuda", requires_grad=True)
    topt = torch.optim.AdamW([pt], **hp, foreach=False)
    opt = optl.AdamW(1003, **hp)
    p = cp.asarray(p0)
    for t in range(1, 4):
        g = rng.standard_normal(1003).astype(np.float32)
        pt.grad = torch.tensor(g, device="cuda")
        topt.step()
        opt.step(p, cp.asarray(g))
        assert int(opt.t[0]) == t
        cb.check(p, pt.detach().cpu().numpy(), atol=1e-6, rtol=1e-6)


@gpu
def test_helpers_refuse_what_the_kernels_cannot_do():
    import cupy as cp

    cel, bgl, al, optl = (cb.load_launch(n) for n in ("cross_entropy", "bias_grad",
                                                      "activation", "optim"))
    z = cp.zeros((4, 8), cp.float32)
    y = cp.zeros(4, cp.int32)
    with pytest.raises(ValueError, match="dz overlaps z"):
        cel.cross_entropy(z, y, dz=z)
    with pytest.raises(ValueError, match="C-contiguous"):
        cel.cross_entropy(z.T, y)
    with pytest.raises(TypeError, match="GPU array"):
        cel.cross_entropy(np.zeros((4, 8), np.float32), y)
    with pytest.raises(ValueError, match="labels must lie in"):
        cel.cross_entropy(z, y + 8, check_labels=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        bgl.bias_grad(z.T)
    with pytest.raises(TypeError, match="float32 or float64"):
        bgl.bias_grad(z.astype(cp.float16))
    with pytest.raises(ValueError, match=r"b: expected shape \(8,\)"):
        al.gelu_backward(z, cp.zeros(7, cp.float32), z)
    with pytest.raises(ValueError, match=r"g: expected shape \(8,\)"):
        optl.sgd(cp.zeros(8, cp.float32), cp.zeros(9, cp.float32), 0.1)


# ----------------------------------------------------------------------------- GPU: torchops
@gpu
def test_torchops_functions_pass_gradcheck_and_are_zero_copy():
    t = torch.randn(5, 7, device="cuda")
    a = torchops.as_array(t)
    assert a.data.ptr == t.data_ptr() and torchops.as_tensor(a).data_ptr() == t.data_ptr()
    kw = dict(device="cuda", dtype=torch.float64, requires_grad=True)
    x, W = torch.randn(6, 5, **kw), torch.randn(5, 3, **kw)
    h, b = torch.randn(6, 3, **kw), torch.randn(3, **kw)
    yl = torch.randint(0, 3, (6,), device="cuda")
    assert torch.autograd.gradcheck(torchops.Matmul.apply, (x, W), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(torchops.BiasGelu.apply, (h, b), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(torchops.BiasAdd.apply, (h, b), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(lambda z: torchops.SoftmaxCrossEntropy.apply(z, yl), (h,),
                                    eps=1e-6, atol=1e-7)
    # a non-contiguous grad_output (the transpose of a contiguous one) is made contiguous
    x32 = torch.randn(6, 5, device="cuda", requires_grad=True)
    W32 = torch.randn(5, 4, device="cuda", requires_grad=True)
    r = torch.randn(4, 6, device="cuda")
    (torchops.Matmul.apply(x32, W32).t() * r).sum().backward()
    xr, Wr = x32.detach().requires_grad_(), W32.detach().requires_grad_()
    ((xr @ Wr).t() * r).sum().backward()
    cb.check(x32.grad, xr.grad.cpu().numpy(), atol=1e-5, rtol=1e-4)
    cb.check(W32.grad, Wr.grad.cpu().numpy(), atol=1e-5, rtol=1e-4)


@gpu
@pytest.mark.parametrize("M, K, N", [(203, 132, 10), (1, 4, 1), (517, 1028, 16), (64, 256, 7)])
def test_thin_matmul_matches_float64(M, K, N):
    import cupy as cp

    th = cb.load_launch("thin_matmul")
    g = np.random.default_rng(M + K + N)
    A, B, G = (cp.asarray(g.standard_normal(s), cp.float32) for s in ((M, K), (K, N), (M, N)))
    A64, B64, G64 = (x.get().astype(np.float64) for x in (A, B, G))
    tol = cb.load_launch("matmul").tolerance
    for _ in range(2):                                  # a second call on the same outputs
        cb.check(th.nn(A, B, cb.empty_nan((M, N), np.float32, xp=cp)), A64 @ B64, **tol(K))
        cb.check(th.tn(A, G, cb.empty_nan((K, N), np.float32, xp=cp)), A64.T @ G64, **tol(M))
        cb.check(th.nt(G, B, cb.empty_nan((M, K), np.float32, xp=cp)), G64 @ B64.T, **tol(N))


@gpu
def test_thin_matmul_refuses_misaligned_and_short_workspace():
    import cupy as cp

    th = cb.load_launch("thin_matmul")
    flat = cp.zeros(64 * 132 + 1, cp.float32)
    A = flat[1:].reshape(64, 132)                       # contiguous, 4 bytes past alignment
    B, G = cp.zeros((132, 10), cp.float32), cp.zeros((64 * 9, 10), cp.float32)
    with pytest.raises(cb.LaunchError, match="16-byte aligned"):
        th.nn(A, B)
    A9 = cp.zeros((64 * 9, 132), cp.float32)
    if th.tn_workspace(64 * 9, 132, 10):
        with pytest.raises(cb.LaunchError, match="work holds 3 floats"):
            th.tn(A9, G, work=cp.zeros(3, cp.float32))
    with pytest.raises(ValueError, match=r"C: expected shape \(132, 10\)"):
        th.tn(A9, G, cp.zeros((10, 132), cp.float32))


@gpu
def test_torchops_matmul_takes_the_thin_path_for_a_thin_layer():
    x = torch.randn(70, 36, device="cuda", requires_grad=True)
    W = torch.randn(36, 10, device="cuda", requires_grad=True)
    r = torch.randn(70, 10, device="cuda")
    (torchops.Matmul.apply(x, W) * r).sum().backward()
    xr, Wr = x.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ((xr @ Wr) * r.double()).sum().backward()
    cb.check(x.grad, xr.grad.cpu().numpy(), atol=1e-5, rtol=1e-4)
    cb.check(W.grad, Wr.grad.cpu().numpy(), atol=1e-4, rtol=1e-4)


@gpu
def test_wrapped_model_trains_like_the_reference():
    data = digits.load()
    ref = digits.train_torch(digits.MLP(digits.init_params(), device="cuda"), data, steps=60)
    own = digits.train_torch(torchops.MLP(digits.init_params()), data, steps=60,
                             loss=torchops.cross_entropy)
    rel = np.abs(np.array(own["losses"]) - ref["losses"]) / np.array(ref["losses"])
    assert rel.max() < 1e-4, rel.max()


# ----------------------------------------------------------------------------- im2col, the CNN
def _im2col_ref(x, K, pad, g):
    """cols of NHWC x by torch's unfold (columns reordered to (a, e, c)), and d<cols, g>/dx."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    B, _, _, C = x.shape
    u = F.unfold(xt.permute(0, 3, 1, 2), K, padding=pad)            # (B, C K K, Ho Wo)
    L = u.shape[2]
    cols = u.reshape(B, C, K, K, L).permute(0, 4, 2, 3, 1).reshape(B * L, K * K * C)
    (dx,) = torch.autograd.grad(cols, xt, torch.tensor(g, dtype=torch.float64))
    return cols.detach().numpy(), dx.numpy()


IM2COL_SHAPES = [((2, 5, 4, 3), 3, 1), ((1, 4, 6, 2), 3, 0), ((2, 3, 5, 1), 5, 2)]


@pytest.mark.parametrize("shape, K, pad", IM2COL_SHAPES)
def test_numba_im2col_col2im_match_autograd(shape, K, pad):
    ic = cb.load_launch("im2col")
    rng = np.random.default_rng(sum(shape) + K)
    x = rng.standard_normal(shape)
    Ho, Wo = ic.out_size(shape[1], shape[2], K, pad)
    g = rng.standard_normal((shape[0] * Ho * Wo, K * K * shape[3]))
    ref_cols, ref_dx = _im2col_ref(x, K, pad, g)
    cols = cuda.to_device(np.full(ref_cols.shape, np.nan))
    dx = cuda.to_device(np.full(shape, np.nan))
    ic.im2col_numba(cuda.to_device(x), cols, K, pad)
    ic.col2im_numba(cuda.to_device(g), dx, K, pad)
    cb.check(cols.copy_to_host(), ref_cols, atol=0, rtol=0)
    cb.check(dx.copy_to_host(), ref_dx, atol=1e-12, rtol=1e-12)


def test_im2col_helpers_refuse_bad_input():
    ic = cb.load_launch("im2col")
    m = grader_xp()                           # device arrays on a GPU, NumPy in the simulator
    x = m.zeros((2, 5, 4, 3), np.float32)
    cols = m.zeros((40, 27), np.float32)
    with pytest.raises(ValueError, match="4D NHWC"):
        ic.im2col_numba(m.zeros((2, 5, 4), np.float32), cols, 3)
    with pytest.raises(TypeError, match="float32 or float64"):
        ic.im2col_numba(x.astype(np.float16), cols, 3)
    with pytest.raises(TypeError, match="expected dtype float32"):
        ic.im2col_numba(x, cols.astype(np.float64), 3)
    with pytest.raises(ValueError, match=r"cols: expected shape \(40, 27\)"):
        ic.im2col_numba(x, m.zeros((27, 40), np.float32), 3)
    with pytest.raises(ValueError, match="C-contiguous"):
        ic.im2col_numba(m.zeros((2, 3, 4, 5), np.float32).transpose(0, 2, 3, 1), cols, 3)
    with pytest.raises(ValueError, match="0 <= pad < K"):
        ic.out_size(5, 4, 3, pad=3)
    with pytest.raises(ValueError, match="does not fit a 5x4 image"):
        ic.out_size(5, 4, 7, pad=0)
    with pytest.raises(ValueError, match="K must be a positive int"):
        ic.out_size(5, 4, 2.0)
    with pytest.raises(ValueError, match=r"dcols: expected shape \(40, 27\)"):
        ic.col2im_numba(m.zeros((40, 9), np.float32), x, 3)


def test_cnn_twin_is_im2col_times_the_weight_matrix():
    # digits.conv2d_nhwc (PyTorch's conv2d on the stored weight matrix) == unfold @ W + b
    p = digits.init_cnn_params(seed=2, dtype=np.float64)
    assert [W.shape for W, _ in p] == [(9, 8), (72, 16), (1024, 128), (128, 10)]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 7, 8))
    W, b = p[1]
    y = digits.conv2d_nhwc(torch.tensor(x), torch.tensor(W), torch.tensor(b))
    cols, _ = _im2col_ref(x, 3, 1, np.zeros((2 * 42, 72)))
    cb.check(y.reshape(-1, 16).numpy(), cols @ W + b, atol=1e-12, rtol=1e-12)
    out = digits.CNN(p, dtype=torch.float64)(torch.tensor(rng.standard_normal((3, 64))))
    assert out.shape == (3, 10)


@gpu
@pytest.mark.parametrize("shape, K, pad", IM2COL_SHAPES + [((3, 7, 5, 8), 3, 1)])
def test_cuda_im2col_col2im_match_autograd(shape, K, pad):
    import cupy as cp

    ic = cb.load_launch("im2col")
    rng = np.random.default_rng(sum(shape) + K + 1)
    x = rng.standard_normal(shape)
    Ho, Wo = ic.out_size(shape[1], shape[2], K, pad)
    g = rng.standard_normal((shape[0] * Ho * Wo, K * K * shape[3]))
    ref_cols, ref_dx = _im2col_ref(x, K, pad, g)
    for dt, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        cols = ic.im2col(cp.asarray(x, dt), K, pad)
        dx = ic.col2im(cp.asarray(g, dt), shape, K, pad)
        assert cols.dtype == dt and dx.dtype == dt
        cb.check(cp.asnumpy(cols), ref_cols, atol=tol, rtol=tol)
        cb.check(cp.asnumpy(dx), ref_dx, atol=tol, rtol=tol)
    d1 = ic.col2im(cp.asarray(g, np.float32), shape, K, pad)
    d2 = ic.col2im(cp.asarray(g, np.float32), shape, K, pad)
    assert bool((d1 == d2).all())                       # a gather: the same bits every run


@gpu
def test_im2col_function_passes_gradcheck_and_the_cnn_matches_its_twin():
    x = torch.randn(2, 5, 4, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torchops.Im2col.apply(t, 3, 1), (x,))
    with pytest.raises(ValueError, match="C-contiguous|4D NHWC"):
        cb.load_launch("im2col").im2col(torchops.as_array(x.detach()).transpose(0, 3, 1, 2), 3)
    p = digits.init_cnn_params(seed=5, dtype=np.float64)
    own = torchops.CNN(p, dtype=torch.float64)
    ref = digits.CNN(p, device="cuda", dtype=torch.float64)
    xb = torch.rand(6, 64, dtype=torch.float64, device="cuda")
    yb = torch.randint(0, 10, (6,), device="cuda")
    for m, loss in ((own, torchops.cross_entropy), (ref, F.cross_entropy)):
        loss(m(xb), yb).backward()
    for a, b in zip(own.parameters(), ref.parameters()):
        cb.check(a.grad.cpu().numpy(), b.grad.cpu().numpy(), atol=1e-10, rtol=1e-10)


@gpu
def test_own_cnn_trains_like_the_twin():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    data = digits.load()
    ref = digits.train_torch(digits.CNN(digits.init_cnn_params(), device="cuda"), data, steps=60)
    own = digits.train_torch(torchops.CNN(digits.init_cnn_params()), data, steps=60,
                             loss=torchops.cross_entropy)
    rel = np.abs(np.array(own["losses"]) - ref["losses"]) / np.array(ref["losses"])
    assert rel.max() < 1e-4, rel.max()


# ----------------------------------------------------------------------------- ex06.1
def ce(*edits):
    return SOL.get("ex06.1", "cross_entropy", edits=edits)


@needs_solutions
def test_ex06_1_reference_passes(capsys):
    ex06_1(ce())
    assert capsys.readouterr().out == "PASS ex06.1\n"


@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([("cuda.atomic.add(loss, 0, (math.log(s) + m - z[r, y]) / M)",
       "cuda.atomic.add(loss, 0, math.log(s) + m - z[r, y])"),
      ("dz[r, j] = (math.exp(z[r, j] - m) / s - onehot) / M",
       "dz[r, j] = math.exp(z[r, j] - m) / s - onehot")], "the gradient of the SUM"),
    ([("cuda.atomic.add(loss, 0, (math.log(s) + m - z[r, y]) / M)",
       "cuda.atomic.add(loss, 0, math.log(s) + m - z[r, y])")], "is the SUM of the row losses"),
    ([("        m = z[r, 0]\n        for j in range(1, C):\n            m = max(m, z[r, j])\n",
       "        m = float32(0)\n")], "subtract the row's maximum"),
    ([("dz[r, j] = (math.exp", "z[r, j] = (math.exp")], "writes into its input"),
    ([("    if r < M:\n", "    if True:\n")], "missing bounds guard"),
    ([("        for j in range(C):\n            onehot", "        for j in range(C - 1):\n"
       "            onehot")], "never written"),
    ([("(math.exp(z[r, j] - m) / s - onehot) / M", "(onehot - math.exp(z[r, j] - m) / s) / M")],
     "wrong sign"),
    # right except at extreme values: a maximum started at 0 (every logit near -1000)
    ([("        m = z[r, 0]\n        for j in range(1, C):\n",
       "        m = float32(0)\n        for j in range(C):\n")],
     r"every logit near -1000 .*start the maximum from the row's first logit"),
    # right except at extreme values: the loss as -log(p_y) (the label's p underflows to 0)
    ([("cuda.atomic.add(loss, 0, (math.log(s) + m - z[r, y]) / M)",
       "cuda.atomic.add(loss, 0, -math.log(math.exp(z[r, y] - m) / s) / M)")],
     r"one logit 1000 above the rest.*never as log\(p_y\)"),
    ([("cuda.atomic.add(loss, 0, (math.log(s) + m - z[r, y]) / M)",
       "loss[0] += (math.log(s) + m - z[r, y]) / M")], "never calls cuda.atomic.add"),
    ([("(math.log(s) + m - z[r, y]) / M", "(math.log(s) - z[r, y]) / M")],
     "off by the mean of the rows' maxima.*add m back"),
], ids=["sum-not-mean", "loss-sum", "no-max", "in-place-into-z", "no-guard", "last-column",
        "sign", "max-from-zero", "log-of-p", "plain-add", "loss-without-max"])
def test_ex06_1_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex06_1(ce(*edits))


def _ce_not_a_kernel(z, labels, loss, dz):
    raise AssertionError("never called")


@needs_solutions
def test_ex06_1_wants_a_kernel_of_your_own():
    with pytest.raises(GradeError, match="expected a @cuda.jit kernel"):
        ex06_1(_ce_not_a_kernel)
    book = cb.load_numba("cross_entropy").cross_entropy_thread_per_row
    with pytest.raises(GradeError, match=r"the book's own kernel .*kernels/cross_entropy\.py"):
        ex06_1(book)


@needs_solutions
def test_ex06_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex06_1(SOL.stub("ex06.1", "cross_entropy"))


# ----------------------------------------------------------------------------- ex06.2
def bgrad(*edits):
    return SOL.get("ex06.2", "bias_grad", edits=edits)


@needs_solutions
def test_ex06_2_reference_passes(capsys):
    ex06_2(bgrad())
    assert capsys.readouterr().out == "PASS ex06.2\n"


@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([("        db[j] = total\n", "        db[j] = total / M\n")], "MEAN of each column"),
    ([("s += dz[i, j]", "s += dz[j, i]")], r"sums of the ROWS of dz \(a transposition\)"),
    ([("    if j < N:\n        for i", "    if True:\n        for i"),
      ("    if ty == 0 and j < N:\n", "    if ty == 0:\n")], "missing guard"),
    ([("        for k in range(1, BG_ROWS):\n            total += part[k, tx]\n", "")],
     "partial sum of one thread row only"),
    ([("    part[ty, tx] = s\n    cuda.syncthreads()\n", "    part[ty, tx] = s\n")],
     r"cuda\.syncthreads\(\) between writing the partial sums"),
    # the barrier moved after the reduction: row 0 reads partials not yet written
    ([("    part[ty, tx] = s\n    cuda.syncthreads()\n", "    part[ty, tx] = s\n"),
      ("        db[j] = total\n", "        db[j] = total\n    cuda.syncthreads()\n")],
     # on a busy GPU the race may read other rows' partials as stale values instead of NaN:
     # then the verdict is the one-row sum, whose hint asks for the same missing barrier
     r"is NaN, but not when shared memory starts at 0: thread row 0 reads partials before|"
     r"shared memory read before it was written, or a cuda\.syncthreads\(\) between|"
     r"or is a cuda\.syncthreads\(\) between writing the partial sums .* missing"),
    # partials added straight into shared memory that nobody zeroed
    ([("    s = float32(0)\n    if j < N:\n        for i in range(ty, M, BG_ROWS):\n"
       "            s += dz[i, j]\n    part[ty, tx] = s\n",
       "    if j < N:\n        for i in range(ty, M, BG_ROWS):\n"
       "            part[ty, tx] += dz[i, j]\n")],
     r"is NaN, but not when shared memory starts at 0: the sums are right only if|"
     r"shared memory read before it was written"),
    # the barrier inside the column guard: threads of columns past N never reach it
    ([("    part[ty, tx] = s\n    cuda.syncthreads()\n",
       "    if j < N:\n        part[ty, tx] = s\n        cuda.syncthreads()\n")],
     r"only \d+ of the block's 128 threads reached every cuda\.syncthreads\(\)"
     r".*outside `if j < N`"),
    ([("        db[j] = total\n", "        cuda.atomic.add(db, j, total)\n")],
     "db stays NaN: cuda.atomic.add adds to what db holds"),
    ([("        for k in range(1, BG_ROWS):", "        for k in range(BG_ROWS):")],
     "counts the partial of thread row 0 twice"),
    ([("for i in range(ty, M, BG_ROWS)", "for i in range(ty, M, BG_COLS)")],
     r"Rows skipped or counted twice \(thread row ty adds rows ty, ty \+ 4"),
    ([("    part = cuda.shared.array((BG_ROWS, BG_COLS), float32)\n", "")],
     "the kernel has no shared array"),
], ids=["mean-not-sum", "transposed", "no-guard", "one-partial", "no-barrier", "barrier-late",
        "uninitialised-shared", "barrier-in-branch", "atomics-into-db", "row-0-twice",
        "wrong-stride", "no-shared-memory"])
def test_ex06_2_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex06_2(bgrad(*edits))


@needs_solutions
def test_ex06_2_refuses_the_book_kernel():
    # bias_grad_v1 (one thread per column, no shared memory) even gives the right sums here
    with pytest.raises(GradeError, match=r"the book's own kernel bias_grad_v1 .*bias_grad\.py"):
        ex06_2(cb.load_numba("bias_grad").bias_grad_v1)


@needs_solutions
def test_ex06_2_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex06_2(SOL.stub("ex06.2", "bias_grad"))


# ----------------------------------------------------------------------------- ex06.3
def adamw(*edits):
    return SOL.get("ex06.3", "adamw_update", edits=edits)


_ADAMW_LAUNCH = ("    adamw_kernel[(cb.ceil_div(C, 16), cb.ceil_div(R, 16)), (16, 16)](\n"
                 "        p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt)\n")
_ADAMW_ARRAYS = ("    p *= 1 - lr * weight_decay\n    m += (1 - beta1) * (g - m)\n"
                 "    v *= beta2\n    v += (1 - beta2) * g * g\n"
                 "    p -= step_size * (m / (np.sqrt(v) / bc2_sqrt + eps))\n")


@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([("step_size = lr / (1 - beta1 ** t)", "step_size = lr"),
      ("bc2_sqrt = math.sqrt(1 - beta2 ** t)", "bc2_sqrt = 1.0")], "no bias correction"),
    ([("gi = g[i, j]\n", "gi = g[i, j] + wd * p[i, j]\n"),
      ("p[i, j] * (1 - lr * wd)", "p[i, j]")], r"Adam \+ L2"),
    ([("p[i, j] * (1 - lr * wd)", "p[i, j]")], "no weight decay"),
    ([("    R, C = p.shape\n", "    p, g, m, v = (a.reshape(1, -1) for a in (p, g, m, v))\n"
       "    R, C = p.shape\n")], r"reshape\(-1\) of it is a COPY"),
    ([("beta1 ** t", "beta1 ** (t - 1)"), ("beta2 ** t", "beta2 ** (t - 1)")],
     "t counts from 1"),
    ([("        m[i, j] = mi\n        v[i, j] = vi\n", "")], "are m and v updated in place"),
    # right except at extreme values: where sqrt(v) is below eps, the place of eps decides
    ([("(math.sqrt(vi) / bc2_sqrt + eps)", "math.sqrt(vi / (bc2_sqrt * bc2_sqrt) + eps)")],
     "eps is inside the square root"),
    ([("(math.sqrt(vi) / bc2_sqrt + eps)", "((math.sqrt(vi) + eps) / bc2_sqrt)")],
     "eps is added before the bias correction"),
    # no kernel at all: in-place array arithmetic (NumPy here, CuPy on a GPU)
    ([(_ADAMW_LAUNCH, _ADAMW_ARRAYS)], "no kernel was launched"),
    # a kernel launched on copies, the update done by array arithmetic
    ([(_ADAMW_LAUNCH, _ADAMW_LAUNCH.replace("p, g, m, v,", "p.copy(), g, m.copy(), v.copy(),")
       + _ADAMW_ARRAYS)], "p, m, v changed outside the kernel"),
    # the kernel on contiguous copies, written back: right values, but not the kernel's writes
    ([(_ADAMW_LAUNCH, "    pc, mc, vc = p.copy(), m.copy(), v.copy()\n"
       + _ADAMW_LAUNCH.replace("p, g, m, v,", "pc, g.copy(), mc, vc,")
       + "    p[...] = pc\n    m[...] = mc\n    v[...] = vc\n")],
     "p, m, v changed outside the kernel .*a copy written back"),
    # the book's AdamW kernel (kernels/optim.py) on flat views
    ([(_ADAMW_LAUNCH, "    k = cb.load_numba('optim').adamw_scalar_step\n"
       "    k[cb.ceil_div(p.size, 256), 256](p.reshape(-1), g.reshape(-1), m.reshape(-1),\n"
       "        v.reshape(-1), lr, beta1, beta2, eps, weight_decay, t)\n")],
     r"launches a kernel of the book \(kernels/optim\.py\)"),
], ids=["no-bias-correction", "l2-not-decoupled", "no-decay", "contiguous-only", "t-from-0",
        "moments-not-kept", "eps-inside-sqrt", "eps-before-correction", "array-arithmetic",
        "dummy-kernel", "copy-back", "book-kernel"])
def test_ex06_3_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex06_3(adamw(*edits))


@needs_solutions
def test_ex06_3_reference_passes(capsys):
    ex06_3(adamw())
    assert capsys.readouterr().out == "PASS ex06.3\n"


@needs_solutions
def test_ex06_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex06_3(SOL.stub("ex06.3", "adamw_update"))


# ----------------------------------------------------------------------------- ex06.4
def linear(*edits):
    return SOL.get("ex06.4", "Linear", edits=edits)


@needs_solutions
def test_ex06_4_reference_passes(capsys):
    ex06_4(linear())
    assert capsys.readouterr().out == "PASS ex06.4\n"


@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([("dW = xa.T @ d", "dW = d.T @ xa")], "wrong shape.*a transposition"),
    ([("dx = d @ Wa.T", "dx = d @ Wa")], "wrong shape.*a transposition"),
    ([("db = d.sum(0)", "db = d.mean(0)")], "db is the MEAN"),
    ([("db = d.sum(0)", "db = d.cumsum(axis=0, out=d)[-1]")], "changed grad_output in place"),
    ([("        xa, Wa, ba = (torchops.as_array(t) for t in (x, W, b))\n"
       "        return torchops.as_tensor(xa @ Wa + ba)\n", "        return x @ W + b\n")],
     r"forward computes with torch operations \(matmul, add\)"),
    # one dummy as_array call, the arithmetic in torch
    ([("        xa, Wa, ba = (torchops.as_array(t) for t in (x, W, b))\n"
       "        return torchops.as_tensor(xa @ Wa + ba)\n",
       "        torchops.as_array(x)\n        return x @ W + b\n")],
     r"forward computes with torch operations \(matmul, add\)"),
    ([("        dx = d @ Wa.T\n", "        dx = torchops.as_array(dy @ W.t())\n")],
     r"backward computes with torch operations \(matmul\)"),
    ([("        db = d.sum(0)\n", "        db = torchops.as_array(dy.sum(0))\n")],
     r"backward computes with torch operations \(sum\)"),
    ([("(torchops.as_array(t) for t in (x, W, b))", "(t.detach().numpy() for t in (x, W, b))")],
     r"forward copies tensors out of torch \(\.numpy\(\)\)"),
    ([("        return torchops.as_tensor(xa @ Wa + ba)\n",
       "        return torch.from_numpy(xa @ Wa + ba)\n")],
     "not a tensor made by torchops.as_tensor|forward raised"),
    ([("torchops.as_tensor(dx), torchops.as_tensor(dW)",
       "torch.tensor(dx), torchops.as_tensor(dW)")],
     "backward's dx is not a tensor made by torchops.as_tensor|backward raised"),
    ([("        return torchops.as_tensor(dx), torchops.as_tensor(dW), torchops.as_tensor(db)\n",
       "        return torchops.as_tensor(dx), torchops.as_tensor(dW)\n")],
     r"backward returned 2 value\(s\)"),
], ids=["dW-transposed", "dx-no-transpose", "db-mean", "in-place-grad-output", "no-dlpack",
        "dummy-as-array", "torch-in-backward", "torch-sum-in-backward", "numpy-copies",
        "from-numpy", "torch-tensor-grad", "two-grads"])
def test_ex06_4_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex06_4(linear(*edits))


@needs_solutions
def test_ex06_4_square_transposition_is_caught_by_values():
    # dW = (x^T dy)^T has the right shape only on a square layer; the grader's square case
    # catches it even if the non-square ones were skipped
    from cudabook.graders import ch06

    bad = linear(("dW = xa.T @ d", "dW = (xa.T @ d).T"))
    with pytest.raises(GradeError, match="transposition|wrong shape"):
        ch06.ex06_4(bad)


@needs_solutions
def test_ex06_4_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex06_4(SOL.stub("ex06.4", "Linear"))


# ----------------------------------------------------------------------------- the exercise page
@needs_solutions
@pytest.mark.parametrize("ex", ["ex06.1", "ex06.2", "ex06.3", "ex06.4"])
def test_exercise_states_its_stub_sizes_and_has_two_hints(ex):
    check_exercise_page("06", ex)



# ----------------------------------------------------------------------------- ex06.5 (CUDA C++)
def ln_src(*edits):
    return SOL.get("ex06.5", "layernorm_bwd_src", edits=edits)


#: the column sums of layernorm_bwd_params kept in half precision
LN_HALF = [("// The LayerNorm backward.", "#include <cuda_fp16.h>\n// The LayerNorm backward."),
           ("float sg = 0.f, sb = 0.f;", "__half sg = __float2half(0.f), sb = sg;"),
           ("sg += d * (x[(size_t)r * C + c] - mean[r]) * rstd[r];",
            "sg = __hadd(sg, __float2half(d * (x[(size_t)r * C + c] - mean[r]) * rstd[r]));"),
           ("sb += d;", "sb = __hadd(sb, __float2half(d));"),
           ("sg += part[0][k][tx];", "sg = __hadd(sg, __float2half(part[0][k][tx]));"),
           ("sb += part[1][k][tx];", "sb = __hadd(sb, __float2half(part[1][k][tx]));"),
           ("dgamma[c] = sg;", "dgamma[c] = __half2float(sg);"),
           ("dbeta[c] = sb;", "dbeta[c] = __half2float(sb);")]
LN_DX = "dxr[c] = rs * (dyr[c] * gamma[c] - mean_g - xhat * mean_gx);"


def test_layernorm_backward_reference_matches_autograd():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 13))
    gamma, beta, dy = rng.standard_normal(13), rng.standard_normal(13), rng.standard_normal((6, 13))
    xt, gt, bt = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    F.layer_norm(xt, (13,), gt, bt, 1e-5).backward(torch.tensor(dy))
    mean, rstd = x.mean(1), 1 / np.sqrt(x.var(1) + 1e-5)
    dx, dg, db = layernorm_backward_reference(dy, x, gamma, mean, rstd)
    for got, want in ((dx, xt.grad), (dg, gt.grad), (db, bt.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([("// The LayerNorm backward.", "#include <cub/block/block_reduce.cuh>\n// The LayerNorm")],
     r"includes <cub/block/block_reduce\.cuh>, a library"),
    ([("float mu = mean[r], rs = rstd[r];",
       "float mu = mean[r], rs = rstd[r];\n    cub::BlockReduce<float, 128> br;")],
     "library namespace cub::"),
    # the barriers only in comments: the rubric reads the code without them
    ([("__syncthreads();", "// __syncthreads();", 3)], r"no __syncthreads\(\) in the code"),
], ids=["cub-header", "cub-namespace", "barriers-in-comments"])
def test_ex06_5_rubric_refuses_on_any_machine(edits, hint):
    with pytest.raises(GradeError, match=f"ex06.5: .*{hint}"):
        ex06_5(ln_src(*edits))


@needs_solutions
def test_ex06_5_stub_fails():
    with pytest.raises(GradeError, match=r"ex06\.5: .*still the stub"):
        ex06_5(SOL.stub("ex06.5", "layernorm_bwd_src"))


@needs_solutions
@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the grader runs the kernels")
def test_ex06_5_needs_a_gpu():
    with pytest.raises(GradeError, match=r"ex06\.5: needs a CUDA GPU"):
        ex06_5(ln_src())


@gpu
@needs_solutions
def test_ex06_5_reference_passes(capsys):
    ex06_5(ln_src())
    assert capsys.readouterr().out == "PASS ex06.5\n"


@gpu
@needs_solutions
@pytest.mark.parametrize("edits, hint", [
    ([(LN_DX, LN_DX.replace(" - mean_g", ""))], r"the term -mean\(g\) is missing"),
    ([(LN_DX, LN_DX.replace(" - xhat * mean_gx", ""))],
     r"the term -xhat \* mean\(g \* xhat\) is missing"),
    ([("float g = dyr[c] * gamma[c];", "float g = dyr[c];"),
      (LN_DX, LN_DX.replace("dyr[c] * gamma[c]", "dyr[c]"))], r"dy was used where g = dy \* gamma"),
    ([(LN_DX, LN_DX.replace(");", ") / rows;"))], "dx is divided by rows"),
    ([("mean_g = red[0][0] / C, mean_gx = red[1][0] / C;",
       "mean_g = red[0][0] / blockDim.x, mean_gx = red[1][0] / blockDim.x;")],
     "the means divide by the 128 threads"),
    ([("dgamma[c] = sg;", "dgamma[c] = sg / rows;"), ("dbeta[c] = sb;", "dbeta[c] = sb / rows;")],
     "MEAN over the rows"),
    ([("dgamma[c] = sg;", "dgamma[c] += sg;"), ("dbeta[c] = sb;", "dbeta[c] += sb;")],
     "does not zero them"),
    (LN_HALF, r"half precision \(fp16\)"),
    # x near 1e4: sum(g x) - mean sum(g) cancels
    ([("sum_gx += g * (xr[c] - mu) * rs;", "sum_gx += g * xr[c];"),
      ("mean_gx = red[1][0] / C;", "mean_gx = (red[1][0] - mu * red[0][0]) * rs / C;")],
     "cancels every significant digit"),
    ([("dgamma[c] = sg;\n        dbeta[c] = sb;", "dgamma[c] = sb;\n        dbeta[c] = sg;")],
     "swapped"),
    ([("sg += d * (x[(size_t)r * C + c] - mean[r]) * rstd[r];",
       "sg += d * x[(size_t)r * C + c];")], r"dgamma summed dy \* x"),
    ([("for (int c = t; c < C; c += blockDim.x) {\n        float xhat",
       "for (int c = t; c < C && c < 128; c += blockDim.x) {\n        float xhat")],
     "columns past the first 128 never written"),
    # the first barrier of the row reduction missing: the tree reads partials not yet written
    ([("    red[1][t] = sum_gx;\n    __syncthreads();\n", "    red[1][t] = sum_gx;\n")],
     "racecheck found a race"),
    # the barrier of the column sums missing (the dx kernel keeps its barriers)
    ([("    part[1][ty][tx] = sb;\n    __syncthreads();\n", "    part[1][ty][tx] = sb;\n")],
     "racecheck found a race"),
], ids=["no-mean-g", "no-xhat-term", "no-gamma", "dx-by-rows", "means-by-threads",
        "params-mean", "params-added-to-nan", "half-accumulator", "expanded-cancels",
        "params-swapped", "dgamma-of-x", "dx-first-128-columns", "race-dx", "race-params"])
def test_ex06_5_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=f"ex06.5: .*{hint}"):
        ex06_5(ln_src(*edits))


@needs_solutions
def test_ex06_5_states_its_stub_sizes_and_has_two_hints():
    check_exercise_page("06", "ex06.5")


# ----------------------------------------------------------------------------- the fused step
def _mlp_params(sizes, seed):
    rng = np.random.default_rng(seed)
    K, H, C = sizes
    return [(rng.standard_normal((K, H)) * 0.3, rng.standard_normal(H) * 0.1),
            (rng.standard_normal((H, C)) * 0.3, rng.standard_normal(C) * 0.1)]


def _float64_loss_and_grads(ps, x, y):
    """The loss and gradients of the MLP at parameters ``ps`` [W1, b1, W2, b2], float64 autograd."""
    ps = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in ps]
    h = F.gelu(torch.tensor(x, dtype=torch.float64) @ ps[0] + ps[1], approximate="tanh")
    loss = F.cross_entropy(h @ ps[2] + ps[3], torch.tensor(y).long())
    loss.backward()
    return loss.item(), [p.grad.numpy() for p in ps]


@gpu
@pytest.mark.parametrize("M, sizes", [(37, (29, 44, 13)), (3, (5, 300, 2)), (512, (64, 256, 10)),
                                      (17, (8, 16, 32))])
def test_fused_mlp_step_matches_float64_autograd_and_adamw(M, sizes):
    """Each of 3 steps in isolation: the loss and gradients against float64 autograd at the
    kernel's own parameters, and the update against float64 AdamW fed the kernel's gradient."""
    ms = cb.load_launch("mlp_step")
    rng = np.random.default_rng(M + 1)
    x, y = rng.standard_normal((M, sizes[0])).astype(np.float32), rng.integers(0, sizes[2], M)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    st = ms.MLPStep(_mlp_params(sizes, seed=M), batch=M, lr=lr, betas=(b1, b2), eps=eps,
                    weight_decay=wd)
    st.set_batch(x, y)
    m = [np.zeros(p.shape) for p in (st.W[0], st.b[0], st.W[1], st.b[1])]
    v = [np.zeros(p.shape) for p in m]
    for t in range(1, 4):
        before = [p.get().astype(np.float64) for p in (st.W[0], st.b[0], st.W[1], st.b[1])]
        loss, grads = _float64_loss_and_grads(before, x, y)
        st.step()
        assert int(st.opt.t[0]) == t
        cb.check(st.loss, np.array([loss]), atol=1e-5, rtol=1e-5)
        for k, (g, ref) in enumerate(zip((st.dW[0], st.db[0], st.dW[1], st.db[1]), grads)):
            cb.check(g, ref, atol=1e-4 * np.abs(ref).max() + 1e-7, rtol=1e-3)
            gk = g.get().astype(np.float64)
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk * gk
            want = before[k] * (1 - lr * wd) - lr / (1 - b1**t) * m[k] / (
                np.sqrt(v[k]) / np.sqrt(1 - b2**t) + eps)
            cb.check((st.W[0], st.b[0], st.W[1], st.b[1])[k], want, atol=2e-6, rtol=1e-5)
    gaps = np.ones(st.n, bool)                   # the flat buffer's gaps stay zero
    for o, size in zip(st.offsets, (p.size for p in m)):
        gaps[o:o + size] = False
    assert not st.P.get()[gaps].any() and not st.G.get()[gaps].any()


@gpu
def test_fused_mlp_step_is_deterministic_and_nan_on_a_bad_label():
    import cupy as cp

    ms = cb.load_launch("mlp_step")
    params = _mlp_params((29, 44, 13), seed=1)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((100, 29)).astype(np.float32), rng.integers(0, 13, 100)
    a, b = ms.MLPStep(params, 100), ms.MLPStep(params, 100)
    for st in (a, b):
        st.set_batch(x, y)
        for _ in range(4):
            st.step()
    assert cp.array_equal(a.P, b.P) and cp.array_equal(a.G, b.G)      # bit for bit: no atomics
    a.y[5] = 13                                  # past the set_batch check, as a kernel sees it
    a.step()
    assert np.isnan(float(a.loss[0]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 13\)"):
        a.set_batch(x, np.full(100, 13))


def test_fused_mlp_step_refuses_what_it_cannot_do():
    ms = cb.load_launch("mlp_step")
    p = _mlp_params((8, 16, 10), seed=0)
    with pytest.raises(cb.LaunchError, match="one hidden layer"):
        ms.MLPStep(p + p[1:], 4)
    with pytest.raises(cb.LaunchError, match="33 classes"):
        ms.MLPStep(_mlp_params((8, 16, 33), seed=0), 4)
    with pytest.raises(cb.LaunchError, match="b1 has shape"):
        ms.MLPStep([(p[0][0], p[0][1][:3]), p[1]], 4)
    with pytest.raises(cb.LaunchError, match="batch must be a positive int"):
        ms.MLPStep(p, 0)
    assert ms.layout((8, 16, 10)) == ((0, 128, 192, 384), 448)
    cfg = ms.config("mlp_step_v1_rows", 37, (29, 44, 13), 0)
    assert cfg.grid == (5,) and cfg.shared == 4 * (8 * (32 + 88 + 13) + 8 + 44 * 13)
