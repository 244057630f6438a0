"""kernels/rope_train*: RoPE on (BH, T, D) heads for training, forward and backward."""

from __future__ import annotations

import numpy as np
import pytest

import cudabook as cb


def _tables(T, D, base=10000.0):
    inv = base ** (-np.arange(0, D // 2, dtype=np.float64) * 2 / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _ref(x, c, s, sign):
    h = x.shape[-1] // 2
    a, b = x[..., :h].astype(np.float64), x[..., h:].astype(np.float64)
    T = x.shape[1]
    c, s = c[:T].astype(np.float64), s[:T].astype(np.float64)
    return np.concatenate([a * c - sign * b * s, b * c + sign * a * s], -1)


@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 17, 64), (2, 5, 128)])
def test_numba_twin_rotates_and_its_inverse_undoes_it(shape):
    from kernels import rope_train

    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    c, s = _tables(shape[1] + 3, shape[2])
    y = rope_train.rope(x.copy(), c, s)
    np.testing.assert_allclose(y, _ref(x, c, s, 1), rtol=1e-5, atol=1e-5)
    z = rope_train.rope(y.copy(), c, s, inverse=True)
    np.testing.assert_allclose(z, x, rtol=1e-5, atol=1e-5)


def test_launcher_refuses_bad_input():
    if not cb.HAS_GPU:
        pytest.skip("the launcher's checks read device arrays")
    import torch

    rl = cb.load_launch("rope_train")
    c, s = (torch.from_numpy(t).cuda() for t in _tables(8, 32))
    x = torch.zeros(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        rl.rope(x.half(), c, s)
    with pytest.raises(ValueError, match="columns"):
        rl.rope(torch.zeros(2, 8, 32, device="cuda", dtype=torch.bfloat16), c, s)
    with pytest.raises(ValueError, match="positions"):
        rl.rope(torch.zeros(2, 9, 64, device="cuda", dtype=torch.bfloat16), c, s)
    with pytest.raises(ValueError, match="even"):
        rl.rope(torch.zeros(2, 8, 63, device="cuda", dtype=torch.bfloat16), c, s)


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 17, 64), (24, 256, 64), (2, 5, 128)])
def test_cuda_matches_pytorchs_rope_and_its_autograd(version, shape):
    import torch

    from cudabook import gpt

    rl = cb.load_launch("rope_train")
    BH, T, D = shape
    cfg = gpt.GPTConfig(vocab=256, d=D * 2, n_layer=1, n_head=2, ctx=T + 3)
    cos, sin = gpt.rope_tables(cfg, T + 3, "cuda")
    x = torch.randn(1, BH, T, D, device="cuda").bfloat16().requires_grad_()
    want = gpt._rope(x, cos[:T], sin[:T])
    dy = torch.randn_like(want)
    want.backward(dy)
    got = x.detach()[0].clone()
    rl.rope(got, cos, sin, version=version)
    assert torch.equal(got, want.detach()[0]), (got.float() - want[0].float()).abs().max()
    dx = dy[0].clone()
    rl.rope(dx, cos, sin, inverse=True, version=version)
    # autograd rotates the fp32 gradient and rounds once, as the kernel does
    assert torch.equal(dx, x.grad[0]), (dx.float() - x.grad[0].float()).abs().max()
