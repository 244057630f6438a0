"""Launching kernels/mlp_step.cu: Chapter 6's MLP training step (forward, loss, backward, AdamW)
fused into two kernels.

    ms = cb.load_launch("mlp_step")
    st = ms.MLPStep(params, batch=512, lr=1e-3)     # [(W1, b1), (W2, b2)]: flat P, G, AdamW state
    st.set_batch(x, labels)                         # copies into st.x, st.y (checked, int64 ok)
    st.step()                                       # two launches; a CUDA graph captures them
    float(st.loss[0]); st.W[0], st.dW[0], st.b[1]   # the loss of that step; views into P and G

    VERSIONS                       ("mlp_step_v1",): rows kernel + update kernel
    ROWS                           rows of the batch per block of mlp_step_v1_rows
    ALIGN                          floats: every view of the flat buffers starts at a multiple
    layout(sizes)                  -> (offsets of W1, b1, W2, b2; n): the flat layout
    config(kernel, M, sizes, n)    -> Launch(grid, block, shared, kernel)
    MLPStep(params, batch, ...)    the state and the entry point, step()
    sanitize_targets()

What the kernels assume, checked when an MLPStep is built (nothing is launched before): one
hidden layer, params [(W1 (K, H), b1 (H,)), (W2 (H, C), b2 (C,))] with 1 <= C <= 32 (a lane per
class), a batch of 1 or more rows, and the rows kernel's shared memory, 4 (ROWS (K4 + 2H + C) +
ROWS + H C) bytes with K4 = K rounded up to a multiple of 4, within what the GPU allows a block.
The flat buffers are laid out as Chapter 6's OwnMLP lays them out, so P and G can be compared
with it element for element. A label outside [0, C) makes the loss NaN (the kernel cannot
raise); ``set_batch`` refuses it on the host.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, round_up

__all__ = ["VERSIONS", "ROWS", "ALIGN", "layout", "config", "MLPStep", "sanitize_targets"]

VERSIONS = ("mlp_step_v1",)
ROWS = 8          # MLP_ROWS in mlp_step.cu
ALIGN = 64        # floats (256 bytes), as OwnMLP in Chapter 6
THREADS = 256
MAX_CLASSES = 32


def _module():
    return cb.module("mlp_step", (f"-DMLP_ROWS={ROWS}",))


def layout(sizes) -> tuple[tuple[int, int, int, int], int]:
    """Offsets of W1, b1, W2, b2 in the flat buffer for ``sizes = (K, H, C)``, and its length n."""
    K, H, C = (int(s) for s in sizes)
    offs, n = [], 0
    for count in (K * H, H, H * C, C):
        offs.append(n)
        n += round_up(count, ALIGN)
    return tuple(offs), n


def _shared(sizes) -> int:
    K, H, C = sizes
    return 4 * (ROWS * (round_up(K, 4) + 2 * H + C) + ROWS + H * C)


def config(kernel: str, M: int, sizes, n: int) -> Launch:
    """The rows kernel: a block per ROWS rows of the batch, 256 threads, its shared memory; the
    update kernel: a thread per element of the flat buffer."""
    if kernel == "mlp_step_v1_rows":
        return Launch((ceil_div(M, ROWS),), (THREADS,), shared=_shared(sizes), kernel=kernel)
    if kernel == "mlp_step_v1_update":
        return Launch((ceil_div(n, THREADS),), (THREADS,), kernel=kernel)
    raise ValueError(f"unknown kernel {kernel!r}; mlp_step.cu has mlp_step_v1_rows and "
                     "mlp_step_v1_update")


def _sizes(params) -> tuple[int, int, int]:
    if len(params) != 2:
        raise LaunchError(f"mlp_step: the fused step has one hidden layer, [(W1, b1), (W2, b2)]; "
                          f"got {len(params)} layers (Chapter 6's OwnMLP takes any number)")
    (W1, b1), (W2, b2) = params
    K, H = (int(s) for s in np.shape(W1))
    C = int(np.shape(W2)[1]) if np.ndim(W2) == 2 else -1
    for name, a, want in (("W1", W1, (K, H)), ("b1", b1, (H,)), ("W2", W2, (H, C)),
                          ("b2", b2, (C,))):
        if tuple(np.shape(a)) != want:
            raise LaunchError(f"mlp_step: {name} has shape {tuple(np.shape(a))}, expected {want} "
                              f"for W1 {(K, H)}")
    if not 1 <= C <= MAX_CLASSES:
        raise LaunchError(f"mlp_step: {C} classes; the loss gives each class a lane of one warp, "
                          f"so 1 to {MAX_CLASSES}")
    if min(K, H) < 1:
        raise LaunchError(f"mlp_step: empty layer, W1 {(K, H)}")
    return K, H, C


def _on_device(a):
    """a (NumPy, CuPy or a PyTorch tensor) as a float32 CuPy array."""
    import cupy as cp

    if hasattr(a, "__cuda_array_interface__"):
        return cp.asarray(a).astype(cp.float32, copy=False)
    return cp.asarray(np.asarray(cb.to_numpy(a), dtype=np.float32))


class MLPStep:
    """Everything one fused step touches, allocated once: P, G (flat, ``layout``), the AdamW state
    (Chapter 6's ``optim`` AdamW: m, v, the step count), the batch ``x`` (batch, K) and ``y``
    (batch,) int32, the loss, and the rows kernel's gradient shares (blocks x n floats)."""

    def __init__(self, params, batch: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        self.sizes = _sizes(params)
        if isinstance(batch, bool) or int(batch) != batch or batch < 1:
            raise LaunchError(f"mlp_step: batch must be a positive int, got {batch!r}")
        self.batch = int(batch)
        cb.launch.need_shared(_shared(self.sizes), f"mlp_step_v1_rows at sizes {self.sizes}")
        import cupy as cp

        (self.offsets, self.n) = layout(self.sizes)
        K, H, C = self.sizes
        if self.n >= 2**31:
            raise LaunchError(f"mlp_step: {self.n} parameters (the kernels index with int)")
        self.lr, self.betas, self.eps, self.wd = float(lr), tuple(betas), float(eps), \
            float(weight_decay)
        self.P, self.G = cp.zeros(self.n, cp.float32), cp.zeros(self.n, cp.float32)
        shapes = ((K, H), (H,), (H, C), (C,))
        views = [buf[o:o + int(np.prod(s))].reshape(s) for buf in (self.P, self.G)
                 for o, s in zip(self.offsets, shapes)]
        self.W, self.b, self.dW, self.db = views[0:4:2], views[1:4:2], views[4::2], views[5::2]
        for (W, b), Wd, bd in zip(params, self.W, self.b):
            Wd[...] = _on_device(W)
            bd[...] = _on_device(b)
        self.opt = cb.load_launch("optim").AdamW(self.n, lr=lr, betas=betas, eps=eps,
                                                 weight_decay=weight_decay)
        self.x = cp.zeros((self.batch, K), cp.float32)
        self.y = cp.zeros(self.batch, cp.int32)
        self.loss = cp.zeros(1, cp.float32)
        self.rows_cfg = config("mlp_step_v1_rows", self.batch, self.sizes, self.n)
        self.update_cfg = config("mlp_step_v1_update", self.batch, self.sizes, self.n)
        self.blocks = self.rows_cfg.grid[0]
        self.part = cp.zeros((self.blocks, self.n), cp.float32)     # the gaps stay zero
        self.loss_part = cp.zeros(self.blocks, cp.float32)

    def set_batch(self, x, labels) -> None:
        """Copy a batch in: x (batch, K) float32, labels (batch,) of any integer type, each in
        [0, C) (checked here, on the host: not inside a CUDA graph capture)."""
        import cupy as cp

        K, _, C = self.sizes
        cb.expect(x, "x", shape=(self.batch, K), device=False)
        lab = cb.to_numpy(labels)
        if lab.shape != (self.batch,) or lab.dtype.kind not in "iu":
            raise ValueError(f"labels: expected ({self.batch},) integers, got {lab.shape} "
                             f"{lab.dtype}")
        if lab.min() < 0 or lab.max() >= C:
            raise ValueError(f"labels must lie in [0, {C}); found {lab.min()}..{lab.max()}")
        self.x[...] = _on_device(x)
        self.y[...] = cp.asarray(lab.astype(np.int32))

    def step(self) -> None:
        """One training step on (x, y): mlp_step_v1_rows, then mlp_step_v1_update."""
        mod = _module()
        (K, H, C), (oW1, ob1, oW2, ob2), n = self.sizes, self.offsets, self.n
        f, i = np.float32, np.int32
        b1, b2 = self.betas
        cb.launch.run(mod.get("mlp_step_v1_rows"), self.rows_cfg,
                      (self.x, self.y, self.P, self.part, self.loss_part, self.opt.t,
                       self.opt.coef, i(self.batch), i(K), i(H), i(C), i(oW1), i(ob1), i(oW2),
                       i(ob2), i(n), f(1.0 / self.batch), f(self.lr), f(b1), f(b2)))
        cb.launch.run(mod.get("mlp_step_v1_update"), self.update_cfg,
                      (self.P, self.G, self.opt.m, self.opt.v, self.part, i(self.blocks), i(n),
                       self.loss_part, self.loss, f(1.0 / self.batch), f(self.lr), f(b1), f(b2),
                       f(self.eps), f(self.wd), self.opt.coef))


def sanitize_targets():
    """A ragged batch (the last block's rows past M) at odd sizes (memcheck: every guard;
    racecheck: the three barriers of the rows kernel)."""
    import cupy as cp

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((29, 44)) * 0.2, rng.standard_normal(44) * 0.1),
              (rng.standard_normal((44, 13)) * 0.2, rng.standard_normal(13) * 0.1)]
    st = MLPStep(params, batch=37)
    st.set_batch(cp.asarray(rng.standard_normal((37, 29)), dtype=cp.float32),
                 rng.integers(0, 13, 37))
    yield "mlp_step_v1 (37 rows, 29 -> 44 -> 13)", st.step
