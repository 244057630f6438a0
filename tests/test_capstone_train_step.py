"""cudabook.gpt_train: the GPT's training step on the book's kernels against PyTorch's."""

from __future__ import annotations

import pytest

import cudabook as cb
from cudabook import gpt, gpt_train

gpu = pytest.mark.gpu


def test_param_order_covers_every_weight_of_the_model_once():
    torch = pytest.importorskip("torch")
    cfg = gpt.GPTConfig(vocab=100, d=64, n_layer=2, n_head=1, ctx=16)
    names = [n for n, _ in gpt_train.param_order(cfg)]
    model = gpt.GPT(cfg)
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sorted(names) == sorted(want)
    assert dict(gpt_train.param_order(cfg)) == want
    assert isinstance(torch.zeros(1), torch.Tensor)


def test_step_flops_counts_six_flops_per_weight_per_token_plus_attention():
    cfg = gpt.GPT2_SMALL
    f = gpt_train.step_flops(cfg, 8, 1024)
    weights = 12 * 12 * 768 * 768 + 768 * 50257
    assert f > 6 * weights * 8192
    assert f < 6 * weights * 8192 * 1.1


def _batch(cfg, B, T, seed):
    """Sequences a model can learn: each row counts up by a step of its own from a random
    start (mod the vocabulary), so the next token follows from the two before it."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (B, 1), device="cuda", generator=g)
    step = torch.randint(1, 4, (B, 1), device="cuda", generator=g)
    xy = (start + step * torch.arange(T + 1, device="cuda")) % cfg.vocab
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


SMALL = gpt.GPTConfig(vocab=300, d=128, n_layer=2, n_head=2, ctx=128)


@gpu
def test_gradients_match_pytorch_autocast():
    ref = gpt_train.TorchStep(SMALL, 4, 96)
    own = gpt_train.BookStep(SMALL, 4, 96)
    own.load(ref.model)
    x, y = _batch(SMALL, 4, 96, 0)
    want, got = ref.gradients(x, y), own.gradients(x, y)
    assert abs(got["loss"] - want["loss"]) < 2e-3 * abs(want["loss"])
    bad = []
    for name, g in want["grads"].items():
        e = ((got["grads"][name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        if e > 3e-2:
            bad.append(f"{name}: {e:.2e}")
    assert not bad, "gradients differ from PyTorch's: " + "; ".join(bad)


@gpu
def test_captured_steps_follow_pytorchs_losses():
    import torch

    ref = gpt_train.TorchStep(SMALL, 4, 96)
    own = gpt_train.BookStep(SMALL, 4, 96)
    own.load(ref.model)
    run = own.graph()
    lt, lo = [], []
    for s in range(30):
        x, y = _batch(SMALL, 4, 96, s)
        lt.append(float(ref.step(x, y)))
        lo.append(float(run(x, y)))
    rel = max(abs(a - b) / a for a, b in zip(lt, lo))
    assert rel < 1e-2, (lt, lo)
    assert lo[-1] < lo[0] - 0.3, lo
    assert torch.isfinite(own.params).all()


@gpu
def test_step_is_bitwise_repeatable():
    ref = gpt_train.TorchStep(SMALL, 2, 64)
    x, y = _batch(SMALL, 2, 64, 3)
    out = []
    for _ in range(2):
        own = gpt_train.BookStep(SMALL, 2, 64)
        own.load(ref.model)
        for _ in range(3):
            own.step(x, y)
        out.append(own.params.clone())
    assert bool((out[0] == out[1]).all())


@gpu
def test_refuses_what_it_cannot_train():
    with pytest.raises(ValueError, match="head dimension"):
        gpt_train.BookStep(gpt.GPTConfig(vocab=64, d=96, n_layer=1, n_head=1, ctx=8), 1, 8)
    with pytest.raises(ValueError, match="context"):
        gpt_train.BookStep(SMALL, 1, 129)
    own = gpt_train.BookStep(SMALL, 2, 16)
    import torch
    with pytest.raises(ValueError, match=r"\(2, 16\)"):
        own.step(torch.zeros(2, 15, dtype=torch.long, device="cuda"),
                 torch.zeros(2, 15, dtype=torch.long, device="cuda"))
    assert cb.HAS_GPU
