"""The digits data set and the PyTorch reference MLP that Chapter 6 trains on its own kernels.

    from cudabook import digits
    data = digits.load()                       # fixed split: 1438 train / 359 test, in [0, 1]
    params = digits.init_params((64, 256, 10), seed=0)   # [(W (in, out), b (out,)), ...] NumPy
    model = digits.MLP(params)                 # PyTorch: x @ W + b, GELU (tanh) between layers
    for idx in digits.batch_order(data.n_train, batch=64, epochs=2, seed=0): ...
    out = digits.train_torch(model, data, epochs=30)      # {"losses": [...], "test_acc": ...}

The data are scikit-learn's copy of the UCI handwritten digits (1,797 images of 8 x 8 pixels, 16
grey levels, ten classes), shipped inside the scikit-learn package: nothing is downloaded. Where
scikit-learn is not installed, ``load`` reads the arrays from the ``.npz`` file named by the
environment variable ``CUDABOOK_DIGITS_NPZ`` (written by ``save_npz`` on a machine that has it).

Everything that makes two runs comparable is fixed here, once: the split (a seeded permutation),
the initial weights (drawn with NumPy from a seed, PyTorch's default ``nn.Linear`` ranges), the
batch order (a seeded permutation per epoch, the last partial batch dropped, so every step has
the same shape and a CUDA graph can replay it), and the hyperparameters (``HPARAMS``). Weights
are stored (in, out), so a layer is ``x @ W + b``: the row-major product the book's matmul computes.

Chapter 10 imports ``load``, ``init_params``, ``MLP`` and ``train_torch`` from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["SEED", "SIZES", "HPARAMS", "Digits", "load", "save_npz", "init_params",
           "batch_order", "MLP", "make_optimizer", "train_torch", "accuracy",
           "CNN_CHANNELS", "CNN_HEAD", "init_cnn_params", "conv2d_nhwc", "CNN"]

#: the seed of the split, the initial weights and the batch order
SEED = 0
#: layer widths of the reference MLP: 64 pixels -> 256 hidden -> 10 classes
SIZES = (64, 256, 10)
#: the training recipe both runs (PyTorch and the book's kernels) follow
HPARAMS = dict(batch=64, epochs=30, lr=5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Digits:
    """The fixed split. x: float32 (n, 64) pixels scaled to [0, 1]; y: int64 (n,) labels 0..9."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])


def _raw() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        path = os.environ.get("CUDABOOK_DIGITS_NPZ")
        if path and os.path.exists(path):
            with np.load(path) as f:
                return f["data"], f["target"]
        raise ImportError("cudabook.digits needs scikit-learn (it ships the digits data): "
                          "pip install scikit-learn, or point CUDABOOK_DIGITS_NPZ at a file "
                          "written by cudabook.digits.save_npz") from None
    d = load_digits()
    return d.data, d.target


def save_npz(path: str) -> None:
    """Write the raw arrays to ``path`` (for a machine without scikit-learn)."""
    data, target = _raw()
    np.savez_compressed(path, data=data.astype(np.uint8), target=target.astype(np.int64))


def load(seed: int = SEED, test_fraction: float = TEST_FRACTION) -> Digits:
    """The digits split by a seeded permutation (same seed, same split, on every machine)."""
    data, target = _raw()
    x = (np.asarray(data, np.float64) / 16.0).astype(np.float32)
    y = np.asarray(target, np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    return Digits(np.ascontiguousarray(x[train]), y[train], np.ascontiguousarray(x[test]), y[test])


def init_params(sizes: Sequence[int] = SIZES, seed: int = SEED,
                dtype: Any = np.float32) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(W (in, out), b (out,)), ...] drawn uniformly from +-1/sqrt(in), as ``nn.Linear`` does."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        W = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dtype)
        b = rng.uniform(-bound, bound, fan_out).astype(dtype)
        params.append((W, b))
    return params


def batch_order(n: int, batch: int, epochs: int, seed: int = SEED) -> Iterator[np.ndarray]:
    """Index arrays of the batches: a seeded permutation per epoch, the partial batch dropped."""
    if batch > n:
        raise ValueError(f"batch {batch} > {n} examples")
    rng = np.random.default_rng(seed + 1)
    for _ in range(epochs):
        perm = rng.permutation(n)
        for s in range(0, n - batch + 1, batch):
            yield perm[s:s + batch]


def _torch():
    import torch

    return torch




def MLP(params: Sequence[tuple[np.ndarray, np.ndarray]], device: str = "cpu",
        dtype: Any = None, linear: Any = None):
    """The PyTorch reference: ``h = x @ W + b`` per layer, GELU (tanh form) between layers.

    ``params`` as from ``init_params`` (copied). ``linear(x, W, b)`` replaces the layer's
    ``x @ W + b`` (Chapter 6 passes its own autograd Function); the default is PyTorch's.
    """
    torch = _torch()

    class _MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            dt = dtype or torch.float32
            self.W = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.tensor(np.asarray(W), dtype=dt, device=device))
                 for W, _ in params])
            self.b = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.tensor(np.asarray(b), dtype=dt, device=device))
                 for _, b in params])
            self.linear = linear

        def forward(self, x):
            n = len(self.W)
            for i, (W, b) in enumerate(zip(self.W, self.b)):
                x = self.linear(x, W, b) if self.linear is not None else x @ W + b
                if i < n - 1:
                    x = torch.nn.functional.gelu(x, approximate="tanh")
            return x

    return _MLP()


def make_optimizer(model: Any, kind: str = "adamw", **hp: Any):
    """``torch.optim.AdamW`` (or ``SGD``) with ``HPARAMS``, updated by ``hp``."""
    torch = _torch()
    h = {**HPARAMS, **hp}
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                 weight_decay=h["weight_decay"], foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=h["lr"])
    raise ValueError(f"unknown optimizer {kind!r}: 'adamw' or 'sgd'")


def accuracy(logits: Any, y: Any) -> float:
    """Fraction of rows whose largest logit is the label (NumPy, CuPy or torch)."""
    pred = logits.argmax(1)
    return float((pred == y).sum()) / int(y.shape[0])


def train_torch(model: Any, data: Digits, *, epochs: int | None = None, steps: int | None = None,
                optimizer: str = "adamw", seed: int = SEED, loss: Any = None,
                **hp: Any) -> dict:
    """Train ``model`` on ``data.x_train`` in ``batch_order``; mean cross-entropy per batch.

    Stops after ``steps`` steps if given; ``loss(logits, y)`` replaces ``F.cross_entropy``.
    Returns ``{"losses": [float per step], "test_acc": float, "steps": int}``. The model's
    device and dtype are used for the data.
    """
    torch = _torch()
    h = {**HPARAMS, **hp}
    epochs = h["epochs"] if epochs is None else epochs
    p0 = next(model.parameters())
    x_train = torch.tensor(data.x_train, dtype=p0.dtype, device=p0.device)
    y_train = torch.tensor(data.y_train, device=p0.device)
    opt = make_optimizer(model, optimizer, **hp)
    loss_fn = loss or torch.nn.functional.cross_entropy
    losses = []
    for idx in batch_order(data.n_train, h["batch"], epochs, seed):
        if steps is not None and len(losses) >= steps:
            break
        i = torch.as_tensor(idx, device=p0.device)
        value = loss_fn(model(x_train[i]), y_train[i])
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    with torch.no_grad():
        x_test = torch.tensor(data.x_test, dtype=p0.dtype, device=p0.device)
        acc = accuracy(model(x_test).cpu(), torch.tensor(data.y_test))
    return {"losses": losses, "test_acc": acc, "steps": len(losses)}


#: the small CNN of Chapter 6's advanced section: 3x3 convolutions 1 -> 8 -> 16 channels on the
#: 8 x 8 image (padding 1, GELU after each), then the MLP head 8 * 8 * 16 = 1024 -> 128 -> 10
CNN_CHANNELS = (1, 8, 16)
CNN_HEAD = (128, 10)
CNN_K = 3


def init_cnn_params(channels: Sequence[int] = CNN_CHANNELS, head: Sequence[int] = CNN_HEAD,
                    K: int = CNN_K, side: int = 8, seed: int = SEED,
                    dtype: Any = np.float32) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(W, b), ...]: first one (W (K K Cin, Cout), b (Cout,)) per convolution, then the head's
    layers (W (in, out), b (out,)) on the flattened NHWC map (side * side * channels[-1] inputs).

    A convolution's weights are stored as the matrix im2col multiplies (row (a, e, c) = a K Cin +
    e Cin + c), drawn from +-1/sqrt(K K Cin) as ``nn.Conv2d`` draws them. ``conv2d_nhwc`` turns the
    matrix into PyTorch's (Cout, Cin, K, K) filter."""
    rng = np.random.default_rng(seed)
    params = []
    fans = [(K * K * ci, co) for ci, co in zip(channels[:-1], channels[1:])]
    sizes = (side * side * channels[-1], *head)
    fans += list(zip(sizes[:-1], sizes[1:]))
    for fan_in, fan_out in fans:
        bound = 1.0 / np.sqrt(fan_in)
        W = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dtype)
        b = rng.uniform(-bound, bound, fan_out).astype(dtype)
        params.append((W, b))
    return params


def conv2d_nhwc(x: Any, W: Any, b: Any, K: int = CNN_K, pad: int | None = None) -> Any:
    """PyTorch's convolution (cuDNN on a GPU) on NHWC ``x`` (B, H, W, Cin) with the im2col weight
    matrix ``W`` (K K Cin, Cout): y (B, Ho, Wo, Cout), NHWC (a permuted view)."""
    torch = _torch()
    pad = K // 2 if pad is None else pad
    cin, cout = int(x.shape[3]), int(W.shape[1])
    w = W.reshape(K, K, cin, cout).permute(3, 2, 0, 1)          # (Cout, Cin, K, K)
    y = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w, b, padding=pad)
    return y.permute(0, 2, 3, 1)


def CNN(params: Sequence[tuple[np.ndarray, np.ndarray]], n_conv: int = len(CNN_CHANNELS) - 1,
        side: int = 8, K: int = CNN_K, device: str = "cpu", dtype: Any = None):
    """The PyTorch twin of the small CNN: per convolution ``gelu(conv2d_nhwc(x, W, b))``, then
    the head as ``MLP`` (x @ W + b, GELU between layers) on the flattened NHWC map.

    ``params`` as from ``init_cnn_params``; the first ``n_conv`` are convolutions (``model.W`` and
    ``model.b`` hold all layers, in that order, as ``MLP``'s do). Rows of the input are the
    ``side * side`` pixels of an image."""
    torch = _torch()
    gelu = torch.nn.functional.gelu
    base = MLP(params, device=device, dtype=dtype)

    class _CNN(type(base)):
        def forward(self, x):
            x = x.reshape(x.shape[0], self.side, self.side, 1)
            layers = list(zip(self.W, self.b))
            for W, b in layers[:self.n_conv]:
                x = gelu(conv2d_nhwc(x, W, b, self.K), approximate="tanh")
            x = x.reshape(x.shape[0], -1)
            head = layers[self.n_conv:]
            for i, (W, b) in enumerate(head):
                x = x @ W + b
                if i < len(head) - 1:
                    x = gelu(x, approximate="tanh")
            return x

    base.__class__ = _CNN
    base.n_conv, base.side, base.K = n_conv, side, K
    return base
