"""Launching kernels/gelu_train.cu: GELU (tanh approximation) forward and backward on bf16, the
MLP activation of the training step.

    gt = cb.load_launch("gelu_train")
    gt.forward(h, g)            # g = bf16(gelu_tanh(float(h)))
    gt.backward(dg, h, dh)      # dh = bf16(float(dg) * gelu_tanh'(float(h))); dh may be dg

  FWD_VERSIONS, BWD_VERSIONS, WHAT   the ladders ("v2" or "gelu_train_fwd_v2", ...)
  config(version, n)                 a cb.Launch record: blocks of 256 threads, 1 or 8 elements each
  forward(), backward()              the entry points: check, launch on the inputs' stream, return
  sanitize_targets()                 every version on sizes 1, 7 and 4097 (the tail paths)

Arrays are bfloat16 PyTorch CUDA tensors (CuPy has no bfloat16), contiguous, of one shape, on one
GPU; v2 reads and writes 16 bytes at a time, so it needs 16-byte aligned starts (a fresh tensor
has one; a view that starts mid-way may not: v1 takes any). g must not overlap h (the backward
needs h); dh may be dg exactly (in place) and must not overlap h or part of dg. Each is refused
before anything is launched, naming the argument. Nothing is copied or synchronised: the entry
points may be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, grid_1d, version_name

__all__ = ["FWD_VERSIONS", "BWD_VERSIONS", "WHAT", "config", "forward", "backward",
           "sanitize_targets"]

FWD_VERSIONS = ("gelu_train_fwd_v1", "gelu_train_fwd_v2")
BWD_VERSIONS = ("gelu_train_bwd_v1", "gelu_train_bwd_v2")
WHAT = {
    "gelu_train_fwd_v1": "one element per thread",
    "gelu_train_fwd_v2": "8 elements per thread: 16-byte loads and stores, the tail singly",
    "gelu_train_bwd_v1": "one element per thread",
    "gelu_train_bwd_v2": "8 elements per thread: 16-byte loads of dg and h, the tail singly",
}
PER_THREAD = {"v1": 1, "v2": 8}


def config(version: str, n: int) -> Launch:
    """Grid and block of ``version`` (forward or backward) for n elements: 256 threads per
    block, one element per thread (v1) or 8 (v2)."""
    if version not in FWD_VERSIONS + BWD_VERSIONS:
        raise ValueError(f"unknown version {version!r}; gelu_train.cu has "
                         f"{FWD_VERSIONS + BWD_VERSIONS}")
    return Launch(grid_1d(n, 256, PER_THREAD[version[-2:]]), (256,), kernel=version)


def _check(arrays, version: str) -> int:
    """The elements of the bf16 arrays ``arrays`` ((name, array) pairs, the first the reference
    shape), or a TypeError/ValueError naming the argument: dtype, shape, contiguity, v2's
    alignment (the device: cb.validate.expect_one_gpu, after the op's own checks)."""
    name0, a0 = arrays[0]
    cb.expect(a0, name0, dtype="bfloat16")
    shape = tuple(int(s) for s in a0.shape)
    for name, a in arrays[1:]:
        cb.expect(a, name, dtype="bfloat16", shape=shape)
    infos = [cb.describe(a, name) for name, a in arrays]
    if version.endswith("v2"):
        for info in infos:
            if info.ptr % 16:
                raise ValueError(f"{info.name}: {version} reads and writes 16 bytes at a time and "
                                 f"needs a 16-byte aligned start (this one is {info.ptr % 16} "
                                 "bytes past one); pass a fresh tensor or version='v1'")
    return infos[0].size






def forward(h, g=None, version: str = "v2"):
    """g = bf16(gelu_tanh(float(h))) for bf16 h of any shape (torch's gelu(approximate="tanh")
    on bf16: fp32 math, one rounding). ``g``: the output, same shape (allocated when None).
    Returns g."""
    version = version_name(FWD_VERSIONS, version, "gelu_train_fwd")
    cb.expect(h, "h", dtype="bfloat16")
    if g is None:
        g = cb.arrays.empty_like_lib(h, tuple(h.shape), "bfloat16")
    n = _check([("h", h), ("g", g)], version)
    if cb.validate.overlaps(h, g, 2 * n):
        raise ValueError("g overlaps h: pass a separate output (the backward reads h)")
    cb.validate.expect_one_gpu(("h", h), ("g", g))
    if n:
        cfg = config(version, n)
        with cb.arrays.launch_stream(h):
            cb.launch.run(cb.module("gelu_train").get(version), cfg,
                          (np.uint64(cb.describe(h).ptr), np.uint64(cb.describe(g).ptr),
                           np.int64(n)))
    return g


def backward(dg, h, dh=None, version: str = "v2"):
    """dh = bf16(float(dg) * gelu_tanh'(float(h))) for bf16 dg, h of one shape (torch autograd's
    gelu(approximate="tanh") backward on bf16: fp32 math, one rounding). ``dh`` may be ``dg``
    (in place); allocated when None. Returns dh."""
    version = version_name(BWD_VERSIONS, version, "gelu_train_bwd")
    cb.expect(dg, "dg", dtype="bfloat16")
    if dh is None:
        dh = cb.arrays.empty_like_lib(dg, tuple(dg.shape), "bfloat16")
    n = _check([("dg", dg), ("h", h), ("dh", dh)], version)
    if cb.validate.overlaps(dh, h, 2 * n):
        raise ValueError("dh overlaps h: pass dg (in place) or a separate output")
    if cb.validate.overlaps(dh, dg, 2 * n) and cb.describe(dh).ptr != cb.describe(dg).ptr:
        raise ValueError("dh overlaps part of dg: pass dg itself (in place) or a separate output")
    cb.validate.expect_one_gpu(("dg", dg), ("h", h), ("dh", dh))
    if n:
        cfg = config(version, n)
        with cb.arrays.launch_stream(dg):
            cb.launch.run(cb.module("gelu_train").get(version), cfg,
                          tuple(np.uint64(cb.describe(a).ptr) for a in (dg, h, dh))
                          + (np.int64(n),))
    return dh


def sanitize_targets():
    """Every version on 1, 7 and 4097 elements (memcheck: the v2 tail and the bounds guards);
    the backward in place."""
    import torch

    for n in (1, 7, 4097):
        h = torch.randn(n, device="cuda").to(torch.bfloat16)
        g = torch.empty_like(h)
        dg = torch.randn(n, device="cuda").to(torch.bfloat16)
        for v in ("v1", "v2"):
            yield f"gelu_train_fwd_{v} ({n})", (lambda h=h, g=g, v=v: forward(h, g, version=v))
            yield f"gelu_train_bwd_{v} ({n}, in place)", (
                lambda dg=dg, h=h, v=v: backward(dg, h, dg, version=v))
