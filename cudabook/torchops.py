"""The book's kernels inside PyTorch: a zero-copy DLPack bridge and ``torch.autograd.Function``s.

    from cudabook import torchops as to
    a = to.as_array(t)          # torch -> CuPy (GPU) or NumPy (CPU): the same memory, no copy
    t = to.as_tensor(a)         # and back
    y = to.Matmul.apply(x, W)   # x @ W: SGEMM of Chapter 4 (float32; the thin kernels of
                                #   Chapter 6 when W has at most 16 columns), matmul_f64 (float64)
    y = to.BiasGelu.apply(h, b) # gelu_tanh(h + b): Chapter 3's fused kernel, gelu_backward_v1
    y = to.BiasAdd.apply(h, b)  # h + b; the bias gradient is bias_grad_v2
    loss = to.SoftmaxCrossEntropy.apply(logits, labels)   # fused forward + backward (mean)
    model = to.MLP(digits.init_params())                  # the digits MLP on these ops
    cols = to.Im2col.apply(x, 3, 1)   # NHWC x -> (B H W, 9 C) patches; backward col2im_v1
    model = to.CNN(digits.init_cnn_params())              # the small CNN: im2col + matmul

Zero copy: ``as_array`` and ``as_tensor`` check that the result starts at the same address as
their argument (``cudabook.describe``'s ``ptr``) and refuse otherwise. Every Function passes its
inputs through ``.contiguous()`` first (a no-op for contiguous tensors): the kernels read raw
row-major memory, and a transposed or sliced tensor (a ``grad_output`` often is one) would be
read as if dense. Launches go to CuPy's current stream; every Function runs its kernels inside
``on_torch_stream(tensors)``, which makes it PyTorch's current stream of the tensors' device
(``cudabook.arrays.launch_stream``; nothing changes when both are the default stream).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import env
from .arrays import describe, launch_stream
from .compile import load_launch

__all__ = ["as_array", "as_tensor", "on_torch_stream", "Matmul", "BiasGelu", "BiasAdd",
           "SoftmaxCrossEntropy", "linear", "cross_entropy", "MLP", "Im2col", "conv_gelu", "CNN"]

MATMUL_VERSION = "v10"    # Chapter 4's SGEMM with its tuned tile sizes (any shape)


def as_array(t: Any):
    """A CuPy array (CUDA tensor) or NumPy array (CPU tensor) on the same memory as ``t``."""
    t = t.detach()
    if t.is_cuda:
        import cupy

        a = cupy.from_dlpack(t)
    else:
        a = np.from_dlpack(t)
    if t.numel() and describe(a).ptr != describe(t).ptr:
        raise RuntimeError("as_array: DLPack returned a copy (the addresses differ)")
    return a


def as_tensor(a: Any):
    """A torch tensor on the same memory as the CuPy or NumPy array ``a``."""
    import torch

    t = torch.from_dlpack(a)
    if t.numel() and describe(a).ptr != describe(t).ptr:
        raise RuntimeError("as_tensor: DLPack returned a copy (the addresses differ)")
    return t


def on_torch_stream(*tensors: Any):
    """A context manager: CuPy launches on PyTorch's current CUDA stream inside the block, the
    stream of the tensors' device (default: the current device's). A no-op when CuPy is on it
    already (both start on the default stream). Built on ``cudabook.arrays.launch_stream``."""
    if not tensors:
        import torch

        tensors = (torch.empty(0, device="cuda"),)     # no memory: names the current device
    return launch_stream(*tensors)


def _arrays(*ts: Any) -> list:
    return [as_array(t.contiguous()) for t in ts]


def _need_gpu(*ts: Any) -> None:
    for t in ts:
        if not t.is_cuda:
            raise TypeError("cudabook.torchops: the kernels run on the GPU; move the tensors with "
                            ".to('cuda')" + ("" if env.HAS_GPU else " (there is no GPU here)"))


def _matmul_module():
    """matmul.cu compiled once per process: matmul_v10 alone with its tuned tile sizes
    (``matmul_launch.load_tuned``), or the whole ladder for another MATMUL_VERSION."""
    from .compile import module

    if MATMUL_VERSION == "v10":
        return load_launch("matmul").load_tuned()
    return module("matmul")


def _matmul(A, B):
    """A @ B for CuPy arrays: SGEMM (float32, contiguous), thin_nn when B has at most 16 columns
    (and the thin kernel's checks pass), or matmul_f64 (float64, strided)."""
    import cupy

    if A.dtype == np.float64:
        return load_launch("matmul_f64").matmul_f64(A, B)
    A, B = cupy.ascontiguousarray(A), cupy.ascontiguousarray(B)
    th = load_launch("thin_matmul")
    if th.why_not("nn", A, B) is None:
        return th.nn(A, B)
    C = cupy.empty((A.shape[0], B.shape[1]), cupy.float32)
    load_launch("matmul").launch_cupy(_matmul_module(), MATMUL_VERSION, A, B, C)
    return C


def _matmul_tn(A, G):
    """A^T @ G (the weight gradient x^T dy): thin_tn without a transposed copy when G is thin,
    else a transpose kernel and the SGEMM."""
    th = load_launch("thin_matmul")
    if A.dtype == np.float32 and th.why_not("tn", A, G) is None:
        return th.tn(A, G)
    return _matmul(_transpose(A), G)


def _matmul_nt(G, W):
    """G @ W^T (the input gradient dy W^T): thin_nt when G is thin, else transpose + SGEMM."""
    th = load_launch("thin_matmul")
    if G.dtype == np.float32 and th.why_not("nt", G, W) is None:
        return th.nt(G, W)
    return _matmul(G, _transpose(W))


def _transpose(A):
    """A.T as a contiguous array: Chapter 2's transpose_v5 (float32), a strided view (float64)."""
    if A.dtype == np.float64:
        return A.T
    return load_launch("transpose").transpose(A)


class _Lazy(type):
    """Builds each Function class on first use, so importing cudabook does not import torch."""

    def __getattr__(cls, name: str):
        return getattr(cls._build(), name)


def _make_functions() -> dict:
    import torch

    class Matmul(torch.autograd.Function):
        """y = x @ W. Backward: dx = dy @ W^T, dW = x^T @ dy (each transpose is a kernel, except
        for a thin W: thin_nt and thin_tn read the operands as they are)."""

        @staticmethod
        def forward(ctx, x, W):
            _need_gpu(x, W)
            ctx.save_for_backward(x, W)
            with on_torch_stream(x):
                a, w = _arrays(x, W)
                return as_tensor(_matmul(a, w))

        @staticmethod
        def backward(ctx, dy):
            x, W = ctx.saved_tensors
            with on_torch_stream(dy):
                d, a, w = _arrays(dy, x, W)
                dx = as_tensor(_matmul_nt(d, w)) if ctx.needs_input_grad[0] else None
                dW = as_tensor(_matmul_tn(a, d)) if ctx.needs_input_grad[1] else None
            return dx, dW

    class BiasGelu(torch.autograd.Function):
        """y = gelu_tanh(h + b). Backward: dh = dy gelu'(h + b), db = sum of dh over rows."""

        @staticmethod
        def forward(ctx, h, b):
            _need_gpu(h, b)
            ctx.save_for_backward(h, b)
            al = load_launch("activation")
            with on_torch_stream(h):
                a, c = _arrays(h, b)
                y = al.bias_gelu_f64(a, c) if a.dtype == np.float64 else al.bias_gelu(a, c)
                return as_tensor(y)

        @staticmethod
        def backward(ctx, dy):
            h, b = ctx.saved_tensors
            with on_torch_stream(dy):
                d, a, c = _arrays(dy, h, b)
                dh = load_launch("activation").gelu_backward(a, c, d)
                db = load_launch("bias_grad").bias_grad(dh)
                return as_tensor(dh), as_tensor(db)

    class BiasAdd(torch.autograd.Function):
        """y = h + b. Backward: dh = dy (a new tensor, never dy itself), db = column sums."""

        @staticmethod
        def forward(ctx, h, b):
            _need_gpu(h, b)
            with on_torch_stream(h):
                a, c = _arrays(h, b)
                return as_tensor(load_launch("activation").bias_add(a, c))

        @staticmethod
        def backward(ctx, dy):
            with on_torch_stream(dy):
                (d,) = _arrays(dy)
                db = load_launch("bias_grad").bias_grad(d)
            return dy.clone(), as_tensor(db)

    class SoftmaxCrossEntropy(torch.autograd.Function):
        """Mean cross-entropy of logits (M, C) and integer labels (M,). The forward kernel also
        writes d loss / d logits; backward scales it by the incoming gradient."""

        @staticmethod
        def forward(ctx, logits, labels):
            _need_gpu(logits, labels)
            ce = load_launch("cross_entropy")
            with on_torch_stream(logits):
                (z,) = _arrays(logits)
                lab = as_array(labels.to(torch.int32).contiguous())
                loss, dz = ce.cross_entropy(z, lab)
            ctx.save_for_backward(as_tensor(dz))
            return as_tensor(loss).reshape(())

        @staticmethod
        def backward(ctx, dloss):
            (dz,) = ctx.saved_tensors
            return dz * dloss, None

    return {"Matmul": Matmul, "BiasGelu": BiasGelu, "BiasAdd": BiasAdd,
            "SoftmaxCrossEntropy": SoftmaxCrossEntropy}


_FUNCTIONS: dict = {}


def _function(name: str):
    if not _FUNCTIONS:
        _FUNCTIONS.update(_make_functions())
    return _FUNCTIONS[name]


class Matmul(metaclass=_Lazy):
    """``Matmul.apply(x, W)``: x @ W on the book's kernels (see the module docstring)."""

    @classmethod
    def _build(cls):
        return _function("Matmul")


class BiasGelu(metaclass=_Lazy):
    """``BiasGelu.apply(h, b)``: gelu_tanh(h + b) on the book's kernels."""

    @classmethod
    def _build(cls):
        return _function("BiasGelu")


class BiasAdd(metaclass=_Lazy):
    """``BiasAdd.apply(h, b)``: h + b on the book's kernels."""

    @classmethod
    def _build(cls):
        return _function("BiasAdd")


class SoftmaxCrossEntropy(metaclass=_Lazy):
    """``SoftmaxCrossEntropy.apply(logits, labels)``: mean cross-entropy, fused backward."""

    @classmethod
    def _build(cls):
        return _function("SoftmaxCrossEntropy")


def linear(x: Any, W: Any, b: Any) -> Any:
    """x @ W + b on the book's kernels (the ``linear`` argument of ``digits.MLP``)."""
    return BiasAdd.apply(Matmul.apply(x, W), b)


def cross_entropy(logits: Any, labels: Any) -> Any:
    """Mean softmax cross-entropy on the book's fused kernel (``F.cross_entropy``'s place)."""
    return SoftmaxCrossEntropy.apply(logits, labels)


def MLP(params: Sequence[tuple[np.ndarray, np.ndarray]], device: str = "cuda", dtype: Any = None):
    """``digits.MLP`` whose every op is a kernel of the book: Matmul, then BiasGelu between
    layers and BiasAdd after the last. Train it with ``digits.train_torch(model, data,
    loss=torchops.cross_entropy)``."""
    import torch

    from .digits import MLP as _TorchMLP

    base = _TorchMLP(params, device=device, dtype=dtype)

    class _OwnMLP(type(base)):
        def forward(self, x):
            n = len(self.W)
            for i, (W, b) in enumerate(zip(self.W, self.b)):
                h = Matmul.apply(x, W)
                x = BiasGelu.apply(h, b) if i < n - 1 else BiasAdd.apply(h, b)
            return x

    base.__class__ = _OwnMLP
    assert isinstance(base, torch.nn.Module)
    return base


def _make_im2col():
    import torch

    class Im2col(torch.autograd.Function):
        """cols = im2col(x) for NHWC x (B, H, W, C), K x K patches, zero padding ``pad``, stride 1
        (im2col_v1 / im2col_f64). Backward: dx = col2im(dcols), a gather without atomics."""

        @staticmethod
        def forward(ctx, x, K, pad):
            _need_gpu(x)
            ctx.K, ctx.pad, ctx.x_shape = K, pad, tuple(x.shape)
            ic = load_launch("im2col")
            with on_torch_stream(x):
                (a,) = _arrays(x)
                return as_tensor(ic.im2col(a, K, pad))

        @staticmethod
        def backward(ctx, dcols):
            ic = load_launch("im2col")
            with on_torch_stream(dcols):
                (d,) = _arrays(dcols)
                dx = as_tensor(ic.col2im(d, ctx.x_shape, ctx.K, ctx.pad))
            return dx, None, None

    return Im2col


class Im2col(metaclass=_Lazy):
    """``Im2col.apply(x, K, pad)``: the patches of NHWC ``x`` as rows (im2col.cu)."""

    @classmethod
    def _build(cls):
        if "Im2col" not in _FUNCTIONS:
            _FUNCTIONS["Im2col"] = _make_im2col()
        return _FUNCTIONS["Im2col"]


def conv_gelu(x: Any, W: Any, b: Any, K: int = 3, pad: int | None = None) -> Any:
    """gelu_tanh(conv(x) + b) on the book's kernels, NHWC in and out: Im2col, then Matmul with
    the weight matrix W (K K Cin, Cout), then BiasGelu (the ``conv_gelu`` of ``digits.CNN``)."""
    pad = K // 2 if pad is None else pad
    B, H, Wd, _ = (int(s) for s in x.shape)
    Ho, Wo = load_launch("im2col").out_size(H, Wd, K, pad)
    y = BiasGelu.apply(Matmul.apply(Im2col.apply(x, K, pad), W), b)
    return y.reshape(B, Ho, Wo, int(W.shape[1]))


def CNN(params: Sequence[tuple[np.ndarray, np.ndarray]], device: str = "cuda",
        dtype: Any = None, **kw: Any):
    """``digits.CNN`` whose every op is a kernel of the book: ``conv_gelu`` per convolution, then
    the head as ``MLP`` (Matmul, BiasGelu between layers, BiasAdd after the last). Train it with
    ``digits.train_torch(model, data, loss=torchops.cross_entropy)``."""
    from .digits import CNN as _TorchCNN

    base = _TorchCNN(params, device=device, dtype=dtype, **kw)

    class _OwnCNN(type(base)):
        def forward(self, x):
            x = x.reshape(x.shape[0], self.side, self.side, 1)
            layers = list(zip(self.W, self.b))
            for W, b in layers[:self.n_conv]:
                x = conv_gelu(x, W, b, self.K)
            x = x.reshape(x.shape[0], -1)
            head = layers[self.n_conv:]
            for i, (W, b) in enumerate(head):
                h = Matmul.apply(x, W)
                x = BiasGelu.apply(h, b) if i < len(head) - 1 else BiasAdd.apply(h, b)
            return x

    base.__class__ = _OwnCNN
    return base
