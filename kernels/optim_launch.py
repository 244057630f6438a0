"""Launching kernels/optim.cu (and the Numba twins): SGD and AdamW on flat parameter buffers.

    op = cb.load_launch("optim")
    op.sgd(p, g, lr=0.1)                          # p -= lr (g + wd p)
    opt = op.AdamW(p.size, lr=1e-3, weight_decay=1e-2)   # m, v, the step count on the device
    opt.step(p, g)                                # two launches: count the step, update
    op.adamw_numba(p, g, m, v, t, lr=...)         # the Numba twin (step t passed as a number)

p, g (and m, v) are contiguous float32 vectors of the same length: the whole model's
parameters and gradients as two flat buffers (cudabook's training loop keeps them so).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import LaunchError, ceil_div

__all__ = ["sgd", "AdamW", "adamw_numba", "sanitize_targets"]


def _module():
    return cb.module("optim")     # compiled once per process


def _flat(p, g, n: int | None = None) -> int:
    cb.expect(p, "p", dtype=np.float32, ndim=1)
    n = int(p.shape[0]) if n is None else n
    cb.expect(p, "p", dtype=np.float32, shape=(n,))
    cb.expect(g, "g", dtype=np.float32, shape=(n,))
    if n == 0 or n >= 2**31:
        raise LaunchError(f"optim: {n} parameters (the kernels index with int)")
    return n


def sgd(p, g, lr: float, weight_decay: float = 0.0) -> None:
    """p -= lr (g + weight_decay p), in place."""
    n = _flat(p, g)
    _module().get("sgd_v1")((ceil_div(n, 256),), (256,),
                            (p, g, np.int32(n), np.float32(lr), np.float32(weight_decay)))


class AdamW:
    """AdamW state for ``n`` parameters: m, v (zeros), the step count and the two bias
    corrections, all on the device; ``step(p, g)`` launches adamw_count_step and adamw_v1."""

    def __init__(self, n: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        import cupy as cp

        self.n = int(n)
        self.lr, (self.beta1, self.beta2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = cp.zeros(self.n, cp.float32)
        self.v = cp.zeros(self.n, cp.float32)
        self.t = cp.zeros(1, cp.int32)           # the step count, read by the kernels
        self.coef = cp.zeros(2, cp.float32)      # lr / (1 - b1^t), sqrt(1 - b2^t)

    def step(self, p, g) -> None:
        n = _flat(p, g, self.n)
        f = np.float32
        mod = _module()
        mod.get("adamw_count_step")((1,), (1,), (self.t, self.coef, f(self.lr), f(self.beta1),
                                                f(self.beta2)))
        mod.get("adamw_v1")((ceil_div(n, 256),), (256,),
                            (p, g, self.m, self.v, np.int32(n), f(self.lr), f(self.beta1),
                             f(self.beta2), f(self.eps), f(self.wd), self.coef))


def adamw_numba(p, g, m, v, t: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """The Numba twin ``adamw_scalar_step`` at step ``t`` (1 for the first step)."""
    n = int(p.shape[0])
    for a, name in ((p, "p"), (g, "g"), (m, "m"), (v, "v")):
        cb.expect(a, name, ndim=1, shape=(n,))
    if t < 1:
        raise ValueError(f"t is the step count, 1 at the first step; got {t}")
    nb = cb.load_numba("optim")
    nb.adamw_scalar_step[ceil_div(n, 256), 256](p, g, m, v, lr, betas[0], betas[1], eps,
                                                weight_decay, t)


def sanitize_targets():
    """SGD and AdamW on a length that is not a multiple of the block (memcheck: the guards)."""
    import cupy as cp

    p = cp.random.standard_normal(1003, dtype=cp.float32)
    g = cp.random.standard_normal(1003, dtype=cp.float32)
    opt = AdamW(1003)
    yield "sgd_v1 (1003)", (lambda: sgd(p, g, 0.1))
    yield "adamw_v1 (1003)", (lambda: opt.step(p, g))
