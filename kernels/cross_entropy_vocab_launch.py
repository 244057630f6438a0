"""Launching kernels/cross_entropy_vocab.cu (and its Numba twins): the language model's
cross-entropy over a padded vocabulary, the gradient written in place of the logits.

    xl = cb.load_launch("cross_entropy_vocab")
    xl.forward_backward(logits, targets, losses, V)      # losses (M,); logits become dlogits
    xl.forward_backward(logits, targets, losses, V, scale=1 / count, dlogits=g, version="v1")
    xl.mean(losses, out)                                 # out (1,) = mean of losses
    xl.forward_backward_numba(z, targets, V)             # the twins (simulator or GPU), NumPy
    xl.reference(z, targets, V)                          # float64 NumPy (losses, gradient)

    VERSIONS, V1_THREADS, V2_MAX_THREADS, MEAN_THREADS
    config(kernel, M, Vp, target_dtype)   -> Launch(grid, block, kernel=name)
    bf16_round(x)                         float32 rounded to bfloat16 values (NumPy, RNE)
    sanitize_targets()

Shapes: logits (M, Vp) torch.bfloat16 on the GPU, C-contiguous, 16-byte aligned, Vp a multiple
of 8 (GPT-2: V = 50257 padded to Vp = 50304; columns j >= V are not part of the softmax);
targets (M,) int32 or int64 (each read by its own kernel, no conversion copy); losses (M,)
float32; dlogits (M, Vp) bfloat16, by default the logits themselves. In fp32 from the bf16 values:

    losses[i] = logsumexp(logits[i, :V]) - logits[i, t_i]
    g[i, j]   = bf16((softmax(logits[i, :V])_j - [j == t_i]) * scale)  for j < V, 0 for j >= V

scale defaults to 1/M (the gradient of the mean loss). targets[i] == -1 ignores row i (loss 0,
gradient 0, like ignore_index=-1: pass scale = 1/count, count the rows not ignored). A target
outside [-1, V) cannot raise inside a CUDA graph: that row's loss is NaN and its gradient NaN
over j < V, never a plausible number (mean() of the losses is then NaN too).

Refused before a launch (TypeError / ValueError naming the argument): dtypes, shapes, V outside
[1, Vp], Vp not a multiple of 8, non-contiguous or misaligned arrays, arrays on different
devices, a dlogits that overlaps the logits without being them, a scale that is not a finite
number. Each launch runs on the stream of its first tensor (PyTorch's current stream), allocates
nothing, copies nothing to the host and never synchronises: the calls are capture-safe.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, row_block, version_name
from cudabook.validate import dtype_name, expect_aligned

__all__ = ["VERSIONS", "V1_THREADS", "V2_MAX_THREADS", "MEAN_THREADS", "config",
           "forward_backward", "mean", "forward_backward_numba", "mean_numba", "reference",
           "bf16_round", "sanitize_targets"]

VERSIONS = ("cross_entropy_vocab_v1", "cross_entropy_vocab_v2")
V1_THREADS = 256            # v1: one block of 256 threads per row
V2_MAX_THREADS = 512        # v2: about 4 chunks of 8 bf16 per thread, at most 512 threads
MEAN_THREADS = 256
_TARGETS = {"int32": "i32", "int64": "i64"}


def _module():
    return cb.module("cross_entropy_vocab")     # the whole file, compiled once per process


def config(kernel: str, M: int = 1, Vp: int = 8, target_dtype: str = "int32") -> Launch:
    """cross_entropy_vocab_v1 / _v2: grid (M,), one block per row (v1: V1_THREADS; v2: enough
    threads for about 4 chunks of 8 each, a multiple of 32 up to V2_MAX_THREADS), the kernel of
    the targets' dtype (_i32, _i64); cross_entropy_vocab_mean: one block of MEAN_THREADS."""
    if kernel == "cross_entropy_vocab_mean":
        return Launch((1,), (MEAN_THREADS,), kernel=kernel)
    kernel = version_name(VERSIONS, kernel, "cross_entropy_vocab")
    if target_dtype not in _TARGETS:
        raise TypeError(f"targets: expected int32 or int64, got {target_dtype}")
    name = f"{kernel}_{_TARGETS[target_dtype]}"
    if kernel == "cross_entropy_vocab_v1":
        return Launch((M,), (V1_THREADS,), kernel=name)
    return Launch((M,), (row_block(ceil_div(Vp, 8), per_thread=4, max_threads=V2_MAX_THREADS),),
                  kernel=name)


def _range(info) -> tuple[int, int]:
    return info.ptr, info.ptr + info.size * info.itemsize


def _check(logits, targets, losses, V, scale, dlogits) -> tuple[int, int, str, float]:
    """(M, Vp, targets' dtype, scale) or a clear error (see the module's docstring)."""
    cb.expect(logits, "logits", dtype="bfloat16", ndim=2)
    M, Vp = (int(s) for s in logits.shape)
    if M < 1 or Vp < 1:
        raise ValueError(f"logits: empty, shape {(M, Vp)}; the loss needs at least one row and "
                         "one class")
    if isinstance(V, bool) or not isinstance(V, numbers.Integral):
        raise TypeError(f"V must be an int (the vocabulary size, <= the logits' {Vp} columns), "
                        f"got {V!r}")
    if not 1 <= V <= Vp:
        raise ValueError(f"V = {V}: the vocabulary must hold 1 to Vp = {Vp} columns (the "
                         "logits' width; columns >= V are padding)")
    if Vp % 8:
        raise LaunchError(f"logits: {Vp} columns; the kernels read 16-byte rows of 8 bf16: pad "
                          f"the vocabulary to a multiple of 8 ({ceil_div(Vp, 8) * 8})")
    if Vp >= 2**31:
        raise LaunchError(f"logits: {Vp} columns; the kernels index a row with int")
    info = cb.describe(logits, "logits")
    cb.expect(targets, "targets", shape=(M,))
    tdt = dtype_name(targets.dtype)
    if tdt not in _TARGETS:
        raise TypeError(f"targets: expected int32 or int64 class indices, got {tdt}")
    cb.expect(losses, "losses", dtype=np.float32, shape=(M,))
    arrays = [("targets", targets), ("losses", losses)]
    if dlogits is not None:
        cb.expect(dlogits, "dlogits", dtype="bfloat16", shape=(M, Vp))
        ginfo = cb.describe(dlogits, "dlogits")
        if ginfo.ptr != info.ptr:
            (a0, a1), (b0, b1) = _range(info), _range(ginfo)
            if a0 < b1 and b0 < a1:
                raise ValueError("dlogits overlaps logits without being them: pass dlogits=None "
                                 "(in place) or a separate buffer")
        arrays.append(("dlogits", dlogits))
    devs = {info.device_id} | {cb.describe(a, n).device_id for n, a in arrays}
    if len(devs) > 1:
        raise ValueError(f"logits, targets, losses (and dlogits) must be on one device, got "
                         f"devices {sorted(devs, key=str)}")
    for name, a in (("logits", logits), ("dlogits", dlogits)):
        if a is not None and not expect_aligned(a, name):
            raise LaunchError(f"{name}: its first element is not 16-byte aligned (the kernels "
                              "read and write 8 bf16 at a time): pass a tensor that starts at "
                              "an aligned address (a fresh tensor, or .clone())")
    if scale is None:
        scale = 1.0 / M
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or \
            not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number (1/M for the mean loss), got {scale!r}")
    return M, Vp, tdt, float(scale)


def _ptr(a) -> np.uint64:
    return np.uint64(cb.describe(a).ptr)


def forward_backward(logits, targets, losses, V, scale=None, dlogits=None, version="v2"):
    """losses (M,) = logsumexp(logits[:, :V]) - logits[i, targets[i]], in fp32; the gradient
    (softmax - onehot) * scale, rounded to bf16, written into dlogits (default: over the logits,
    in place), 0 in the padding columns. scale defaults to 1/M. targets -1: ignored row (loss 0,
    gradient 0); outside [-1, V): NaN loss and NaN gradient row. ``version``: "v1" (three passes)
    or "v2" (online softmax, 16-byte loads; the default). Returns losses."""
    kernel = version_name(VERSIONS, version, "cross_entropy_vocab")
    M, Vp, tdt, scale = _check(logits, targets, losses, V, scale, dlogits)
    g = logits if dlogits is None else dlogits
    cfg = config(kernel, M, Vp, tdt)
    with cb.arrays.launch_stream(logits):
        cb.launch.run(_module().get(cfg.kernel), cfg,
                      (_ptr(logits), _ptr(targets), _ptr(losses), _ptr(g), np.int32(V),
                       np.int32(Vp), np.float32(scale)))
    return losses


def mean(losses, out):
    """out (1,) float32 = the mean of losses (M,) float32, summed in double in a fixed order by
    one block (bitwise the same on every run, capture-safe). Returns out."""
    cb.expect(losses, "losses", dtype=np.float32, ndim=1)
    M = int(losses.shape[0])
    if M < 1:
        raise ValueError("losses: empty; the mean of no losses is undefined")
    if M >= 2**31:
        raise LaunchError(f"losses: {M} rows; the kernel counts them with int")
    cb.expect(out, "out", dtype=np.float32, shape=(1,))
    if cb.describe(out).device_id != cb.describe(losses).device_id:
        raise ValueError("losses and out must be on one device")
    cfg = config("cross_entropy_vocab_mean")
    with cb.arrays.launch_stream(losses):
        cb.launch.run(_module().get(cfg.kernel), cfg, (_ptr(losses), _ptr(out), np.int32(M)))
    return out


# ============================================================================== host side
def bf16_round(x) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32 (NaN stays
    NaN): what __float2bfloat16_rn gives."""
    a = np.ascontiguousarray(x, np.float32)
    b = a.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), r)


def reference(z, targets, V: int, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 NumPy (losses (M,), gradient (M, Vp)) of the logits z (M, Vp): the formulas of the
    module's docstring, ignored rows 0, rows with a target outside [-1, V) NaN (over j < V)."""
    x = np.asarray(cb.to_numpy(z), np.float64)
    t = np.asarray(cb.to_numpy(targets)).astype(np.int64)
    M, Vp = x.shape
    scale = 1.0 / M if scale is None else float(scale)
    losses, g = np.zeros(M), np.zeros((M, Vp))
    for i in range(M):
        if t[i] == -1:
            continue
        if not 0 <= t[i] < V:
            losses[i], g[i, :V] = np.nan, np.nan
            continue
        row = x[i, :V]
        m = row.max()
        e = np.exp(row - m)
        losses[i] = np.log(e.sum()) + m - row[t[i]]
        g[i, :V] = e / e.sum() * scale
        g[i, t[i]] -= scale
    return losses, g


def forward_backward_numba(z, targets, V: int, scale: float | None = None,
                           version: str = "v2", in_place: bool = False):
    """The Numba twins (float32; the simulator without a GPU): z (M, Vp) holding bf16 values,
    NumPy in; (losses (M,), gradient (M, Vp)) NumPy out, the gradient in float32 (unrounded:
    bf16_round gives the CUDA kernel's rounding). ``in_place``: the twin writes over z's copy."""
    from numba import cuda

    kernel = version_name(VERSIONS, version, "cross_entropy_vocab")
    x = np.ascontiguousarray(cb.to_numpy(z), np.float32)
    t = np.ascontiguousarray(cb.to_numpy(targets))
    if x.ndim != 2 or t.shape != x.shape[:1] or dtype_name(t.dtype) not in _TARGETS:
        raise ValueError(f"z (M, Vp) and targets (M,) int32/int64, got {x.shape}, {t.shape} "
                         f"{t.dtype}")
    M, Vp = x.shape
    if not 1 <= V <= Vp or Vp % 8:
        raise ValueError(f"V = {V}, Vp = {Vp}: need 1 <= V <= Vp and Vp a multiple of 8")
    nb = cb.load_numba("cross_entropy_vocab")
    zd = cuda.to_device(x)
    gd = zd if in_place else cuda.to_device(np.full_like(x, np.nan))
    ld = cuda.to_device(np.full(M, np.nan, np.float32))
    fn = nb.xent_three_pass if kernel.endswith("v1") else nb.xent_online
    fn[M, nb.TPB](zd, cuda.to_device(t), ld, gd, V, np.float32(1.0 / M if scale is None
                                                                else scale))
    return ld.copy_to_host(), gd.copy_to_host()


def mean_numba(losses) -> np.float32:
    """The Numba twin of mean (NumPy in, the float32 mean out)."""
    from numba import cuda

    nb = cb.load_numba("cross_entropy_vocab")
    out = cuda.to_device(np.full(1, np.nan, np.float32))
    nb.xent_mean[1, nb.TPB](cuda.to_device(np.ascontiguousarray(losses, np.float32)), out)
    return out.copy_to_host()[0]


def sanitize_targets():
    """Both versions and both target dtypes on ragged rows (V not a multiple of 8, an ignored
    row, an invalid target), in place and into a separate buffer; the mean. The tensors are
    PyTorch views of CuPy allocations (tools/sanitize.py turns CuPy's pool off, so that an
    access past an array's end is seen; PyTorch's caching allocator would hide it)."""
    import cupy as cp
    import torch

    def own(a):                                   # a torch view of a fresh CuPy copy of a
        if a.dtype == torch.bfloat16:
            buf = cp.empty(tuple(a.shape), cp.uint16)
            torch.from_dlpack(buf).view(torch.bfloat16).copy_(a)
            return torch.from_dlpack(buf).view(torch.bfloat16)
        return torch.from_dlpack(cp.asarray(a.cpu().numpy()))

    M, V, Vp = 3, 1001, 1008
    for version in ("v1", "v2"):
        for tdt in (torch.int32, torch.int64):
            z = own(torch.randn(M, Vp, device="cuda").to(torch.bfloat16))
            g = own(torch.zeros(M, Vp, dtype=torch.bfloat16, device="cuda"))
            t = own(torch.tensor([V - 1, -1, V], dtype=tdt))
            loss = own(torch.zeros(M))
            yield (f"cross_entropy_vocab_{version} {str(tdt)[6:]} {M}x{V}/{Vp}",
                   lambda z=z, t=t, loss=loss, version=version: forward_backward(
                       z, t, loss, V, version=version))
            yield (f"cross_entropy_vocab_{version} {str(tdt)[6:]} separate dlogits",
                   lambda z=z, t=t, loss=loss, g=g, version=version: forward_backward(
                       z, t, loss, V, dlogits=g, version=version))
    losses, out = own(torch.rand(1001)), own(torch.zeros(1))
    yield "cross_entropy_vocab_mean 1001", lambda: mean(losses, out)
