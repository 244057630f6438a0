"""Launching kernels/optim.cu (and the Numba twins): SGD and AdamW on flat parameter buffers.

    op = cb.load_launch("optim")
    op.sgd(p, g, lr=0.1)                          # p -= lr (g + wd p)
    opt = op.AdamW(p.size, lr=1e-3, weight_decay=1e-2)   # m, v, the step count on the device
    opt.step(p, g)                                # two launches: count the step, update
    op.adamw(p, g, m, v, t, coef, lr=...)         # the update itself, state passed in
    op.adamw_numba(p, g, m, v, t, lr=...)         # the Numba twin (step t passed as a number)

    KERNELS                        sgd_v1, adamw_count_step, adamw_v1
    config(kernel, n)              -> Launch(grid, block, kernel=kernel): a thread per parameter
                                   (adamw_count_step: one thread)
    sgd(p, g, lr, weight_decay) / adamw(p, g, m, v, t, coef, ...)
                                   the entry points: checks, config, launch (in place)
    AdamW(n, ...)                  the optimiser's state on the device; step(p, g) calls adamw
    adamw_numba(...)               the Numba twin, adamw_scalar_step
    sanitize_targets()

p, g (and m, v) are contiguous float32 vectors of the same length, on the GPU, with 1 to 2^31 - 1
elements: the whole model's parameters and gradients as two flat buffers (cudabook's training
loop keeps them so). Those are the checks, made before anything is launched; the step count t is
int32 (1,) and the two bias corrections ``coef`` float32 (2,).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div

__all__ = ["KERNELS", "sgd", "adamw", "AdamW", "adamw_numba", "config", "sanitize_targets"]

KERNELS = ("sgd_v1", "adamw_count_step", "adamw_v1")


def _module():
    return cb.module("optim")     # the whole file, compiled once per process


def config(kernel: str, n: int) -> Launch:
    """Grid and block of ``kernel`` for n parameters: blocks of 256 threads, a parameter each;
    adamw_count_step is one thread (it counts the step and the bias corrections)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; optim.cu has {KERNELS}")
    if kernel == "adamw_count_step":
        return Launch((1,), (1,), kernel=kernel)
    return Launch((ceil_div(n, 256),), (256,), kernel=kernel)


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
    cfg = config("sgd_v1", n)
    cb.launch.run(_module().get(cfg.kernel), cfg,
                  (cb.as_cupy(p, "p"), cb.as_cupy(g, "g"), np.int32(n), np.float32(lr),
                   np.float32(weight_decay)), stream=cb.stream_for(p, g))


def adamw(p, g, m, v, t, coef, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step in place: adamw_count_step (t += 1 and the bias corrections into
    ``coef``, on the device) then adamw_v1 (p, m, v updated); the state is the caller's."""
    n = _flat(p, g)
    cb.expect(m, "m", dtype=np.float32, shape=(n,))
    cb.expect(v, "v", dtype=np.float32, shape=(n,))
    cb.expect(t, "t", dtype=np.int32, shape=(1,))
    cb.expect(coef, "coef", dtype=np.float32, shape=(2,))
    _adamw(n, p, g, m, v, t, coef, lr, betas, eps, weight_decay)


def _adamw(n: int, p, g, m, v, t, coef, lr, betas, eps, weight_decay) -> None:
    f, arr = np.float32, cb.as_cupy
    mod = _module()
    with cb.arrays.launch_stream(p, g):
        cb.launch.run(mod.get("adamw_count_step"), config("adamw_count_step", n),
                      (arr(t, "t"), arr(coef, "coef"), f(lr), f(betas[0]), f(betas[1])))
        cb.launch.run(mod.get("adamw_v1"), config("adamw_v1", n),
                      (arr(p, "p"), arr(g, "g"), arr(m, "m"), arr(v, "v"), np.int32(n), f(lr),
                       f(betas[0]), f(betas[1]), f(eps), f(weight_decay), arr(coef, "coef")))


class AdamW:
    """AdamW state for ``n`` parameters: m, v (zeros), the step count and the two bias
    corrections, all on the device; ``step(p, g)`` launches adamw_count_step and adamw_v1
    (``adamw``). A stateful object is right here: the optimiser's state lives between steps."""

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
        """``adamw(p, g, m, v, t, coef, ...)`` with this object's state (p and g checked)."""
        _adamw(_flat(p, g, self.n), p, g, self.m, self.v, self.t, self.coef, self.lr,
               (self.beta1, self.beta2), self.eps, self.wd)


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
