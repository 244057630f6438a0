"""Launching kernels/adamw_flat.cu: the optimizer step of the training step over ONE flat fp32
buffer: the global gradient norm, clipping as torch.nn.utils.clip_grad_norm_, AdamW as
torch.optim.AdamW, and the bf16 copy of the weights written in the same pass.

    af = cb.load_launch("adamw_flat")
    state = af.new_state(params)                  # the step count and the step's scalars
    norm = af.grad_norm(grads, norm)              # (1,) float32: sqrt(sum g^2), deterministic
    af.step(params, grads, m, v, shadow, state, n_decay, lr, norm=norm)    # clip + AdamW

  NORM_VERSIONS, STEP_VERSIONS, WHAT   the ladders ("v2" or "grad_norm_v2" / "adamw_flat_v2")
  STATE_INTS                           the state's int32 words (as ADAMW_STATE_INTS in the .cu)
  config(kernel, n)                    a cb.Launch record for any kernel of the file
  grad_norm(), step()                  the entry points: check, launch on the inputs' stream
  new_state(like)                      a zeroed state on like's device (torch or CuPy)
  step_count(state)                    the step count, read back (a host copy: not in a graph)
  sanitize_targets()                   both ladders on ragged sizes, n_decay inside a chunk

params, grads, m, v are float32 (n,) and shadow bfloat16 (n,), contiguous, on one GPU, with
1 <= n < 2^31 (the kernels index with int); elements [0, n_decay) get weight decay, [n_decay, n)
do not. v2 reads and writes 16 bytes at a time: params, grads, m, v 16-byte aligned, shadow
8-byte aligned (fresh tensors are; v1 takes any). lr is a number or a (1,) float32 tensor on the
GPU, read by the kernel at each launch (a schedule may change it between replays of a graph).
Each assumption is refused before anything is launched, naming the argument. Nothing is copied to
the host or synchronised, and the scratch of the norm (one float per block) comes from the
inputs' library (PyTorch's caching allocator under capture): step() may be captured in a CUDA
graph, and each replay advances the step count held in ``state``.
"""

from __future__ import annotations

import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["NORM_VERSIONS", "STEP_VERSIONS", "WHAT", "STATE_INTS", "NORM_V2_BLOCKS", "config",
           "grad_norm", "step", "new_state", "step_count", "sanitize_targets"]

NORM_VERSIONS = ("grad_norm_v1", "grad_norm_v2")
STEP_VERSIONS = ("adamw_flat_v1", "adamw_flat_v2")
WHAT = {
    "grad_norm_v1": "one element per thread, a partial per block of 256, then grad_norm_finish",
    "grad_norm_v2": "float4, grid-stride over at most 1024 blocks, then grad_norm_finish",
    "adamw_flat_v1": "one element per thread",
    "adamw_flat_v2": "4 elements per thread: 16-byte loads and stores, the tail singly",
}
KERNELS = NORM_VERSIONS + ("grad_norm_finish", "adamw_flat_count_step") + STEP_VERSIONS
STATE_INTS = 8          # ADAMW_STATE_INTS
NORM_V2_BLOCKS = 1024   # GRAD_NORM_V2_BLOCKS
FINISH_THREADS = 1024


def config(kernel: str, n: int) -> Launch:
    """Grid and block of ``kernel`` for n parameters (blocks of 256 threads; grad_norm_finish one
    block of 1024, adamw_flat_count_step one thread). The norm's records carry ``parts``, the
    partial sums it writes."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; adamw_flat.cu has {KERNELS}")
    if kernel == "adamw_flat_count_step":
        return Launch((1,), (1,), kernel=kernel)
    if kernel == "grad_norm_finish":
        return Launch((1,), (FINISH_THREADS,), kernel=kernel)
    if kernel == "grad_norm_v1":
        g = max(1, ceil_div(n, 256))
        return Launch((g,), (256,), kernel=kernel, parts=g)
    if kernel == "grad_norm_v2":
        g = max(1, min(ceil_div(ceil_div(n, 4), 256), NORM_V2_BLOCKS))
        return Launch((g,), (256,), kernel=kernel, parts=g)
    per = 4 if kernel == "adamw_flat_v2" else 1
    return Launch((max(1, ceil_div(n, 256 * per)),), (256,), kernel=kernel)


def _ptr(a) -> np.uint64:
    return np.uint64(cb.describe(a).ptr)


def _flat(arrays, dtypes) -> int:
    """n of the 1-D arrays ((name, array) pairs, each of dtype ``dtypes[name]`` or float32), or a
    TypeError / ValueError / LaunchError naming the argument."""
    name0, a0 = arrays[0]
    cb.expect(a0, name0, dtype=dtypes.get(name0, "float32"), ndim=1)
    n = int(a0.shape[0])
    if not 1 <= n < 2**31:
        raise LaunchError(f"adamw_flat: {name0} has {n} elements; the kernels take 1 to 2^31 - 1 "
                          "(they index with int): split a larger model into several buffers")
    for name, a in arrays[1:]:
        cb.expect(a, name, dtype=dtypes.get(name, "float32"), shape=(n,))
    return n




def _aligned(arrays, version: str) -> None:
    """v2's 16-byte accesses (8 bytes for shadow): refuse a start that is not aligned."""
    for name, a, nbytes in arrays:
        off = cb.describe(a, name).ptr % nbytes
        if off:
            raise ValueError(f"{name}: {version} accesses it {nbytes} bytes at a time and needs a "
                             f"{nbytes}-byte aligned start (this one is {off} bytes past one); "
                             "pass a fresh tensor or version='v1'")


def _number(x, name: str, lo: float = 0.0, hi: float | None = None) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not np.isfinite(x):
        raise TypeError(f"{name} must be a finite number, got {x!r}")
    if x < lo or (hi is not None and x >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {x!r}")
    return float(x)


def _norm_launch(grads, out, n: int, version: str) -> None:
    """The two launches of the norm (partials, finish) on the current stream."""
    mod = cb.module("adamw_flat")
    cfg = config(version, n)
    parts = cb.arrays.empty_like_lib(grads, (cfg.parts,), "float32")
    cb.launch.run(mod.get(version), cfg, (_ptr(grads), _ptr(parts), np.int32(n)))
    cb.launch.run(mod.get("grad_norm_finish"), config("grad_norm_finish", n),
                  (_ptr(parts), np.int32(cfg.parts), _ptr(out)))
    # parts is freed on return: torch's and CuPy's pools give its memory only to later work of
    # this same stream, which runs after grad_norm_finish has read it


def grad_norm(grads, out=None, version: str = "v2"):
    """out (1,) float32 = sqrt(sum grads^2) for grads float32 (n,), deterministic (a fixed grid
    for a given n, partials added by one block in a fixed order; no atomics). ``out`` is
    allocated when None. Returns out."""
    version = version_name(NORM_VERSIONS, version, "grad_norm")
    n = _flat([("grads", grads)], {})
    if out is None:
        out = cb.arrays.empty_like_lib(grads, (1,), "float32")
    cb.expect(out, "out", dtype="float32", shape=(1,))
    if version == "grad_norm_v2":
        _aligned([("grads", grads, 16)], version)
    cb.validate.expect_one_gpu(("grads", grads), ("out", out))
    with cb.arrays.launch_stream(grads):
        _norm_launch(grads, out, n, version)
    return out


def new_state(like):
    """A zeroed optimizer state (int32 (STATE_INTS,): the step count, then the step's float32
    scalars as bits) on the device of ``like`` (a torch tensor or a CuPy array)."""
    s = cb.arrays.empty_like_lib(like, (STATE_INTS,), "int32")
    s[...] = 0
    return s


def step_count(state) -> int:
    """The step count held in ``state`` (read back to the host: outside a graph capture)."""
    cb.expect(state, "state", dtype="int32", shape=(STATE_INTS,))
    return int(state[0].item()) if cb.arrays.lib_of(state) == "torch" else int(state[0])


def step(params, grads, m, v, shadow, state, n_decay: int, lr, beta1: float = 0.9,
         beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1,
         max_norm: float | None = 1.0, norm=None, version: str = "v2"):
    """One optimizer step in place on the flat buffers: the step count in ``state`` += 1; with
    ``max_norm``, the gradients scaled by min(1, max_norm / (norm + 1e-6)) as they are read
    (``norm`` (1,) float32 from grad_norm(), or computed here when None; grads is not
    rewritten); AdamW (torch.optim.AdamW's order) with weight decay on [0, n_decay) only; then
    shadow = bf16(params). ``lr``: a number or a (1,) float32 GPU tensor. Returns params.

    Three launches (five when the norm is computed here), all on the inputs' stream."""
    version = version_name(STEP_VERSIONS, version, "adamw_flat")
    arrays = [("params", params), ("grads", grads), ("m", m), ("v", v), ("shadow", shadow)]
    n = _flat(arrays, {"shadow": "bfloat16"})
    cb.expect(state, "state", dtype="int32", shape=(STATE_INTS,))
    if isinstance(n_decay, bool) or not isinstance(n_decay, numbers.Integral) or \
            not 0 <= n_decay <= n:
        raise ValueError(f"n_decay must be an int in [0, n = {n}] (the decayed prefix), got "
                         f"{n_decay!r}")
    lr_dev = None
    if not isinstance(lr, numbers.Real):              # a device tensor: read by the kernel
        cb.expect(lr, "lr", dtype="float32", shape=(1,))
        lr_dev, lr = lr, 0.0
    lr = _number(lr, "lr")
    beta1, beta2 = _number(beta1, "beta1", 0.0, 1.0), _number(beta2, "beta2", 0.0, 1.0)
    eps, wd = _number(eps, "eps"), _number(weight_decay, "weight_decay")
    if max_norm is not None:
        max_norm = _number(max_norm, "max_norm")
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0 (or None: no clipping), got {max_norm}")
        if norm is not None:
            cb.expect(norm, "norm", dtype="float32", shape=(1,))
    elif norm is not None:
        raise ValueError("norm given without max_norm: pass max_norm to clip, or no norm")
    if version == "adamw_flat_v2":
        _aligned([("params", params, 16), ("grads", grads, 16), ("m", m, 16), ("v", v, 16),
                  ("shadow", shadow, 8)], version)
    spans = [(name, cb.describe(a).ptr, n * cb.describe(a).itemsize) for name, a in arrays]
    for i, (na, pa, ba) in enumerate(spans):
        for nb, pb, bb in spans[i + 1:]:
            if pa < pb + bb and pb < pa + ba:
                raise ValueError(f"{na} and {nb} overlap: params, grads, m, v and shadow must "
                                 "be five separate buffers")
    extra = [("state", state)] + [(k, a) for k, a in (("lr", lr_dev), ("norm", norm))
                                  if a is not None]
    cb.validate.expect_one_gpu(*arrays, *extra)
    mod = cb.module("adamw_flat")
    f32 = np.float32
    with cb.arrays.launch_stream(params):
        if max_norm is not None and norm is None:
            norm = cb.arrays.empty_like_lib(grads, (1,), "float32")
            _norm_launch(grads, norm, n, "grad_norm_v2" if version == "adamw_flat_v2"
                         else "grad_norm_v1")
        cb.launch.run(mod.get("adamw_flat_count_step"), config("adamw_flat_count_step", n),
                      (_ptr(state), np.uint64(0) if lr_dev is None else _ptr(lr_dev), f32(lr),
                       f32(beta1), f32(beta2), np.uint64(0) if norm is None else _ptr(norm),
                       f32(0.0 if max_norm is None else max_norm)))
        cb.launch.run(mod.get(version), config(version, n),
                      tuple(_ptr(a) for _, a in arrays)
                      + (_ptr(state), np.int32(n), np.int32(n_decay), f32(beta1), f32(beta2),
                         f32(eps), f32(wd)))
    return params


def sanitize_targets():
    """Both ladders on n = 1, 4099 (tails of 1 and 3) and 5000 with n_decay inside a chunk of
    4 (memcheck: the guards, the tails, the norm's partials; racecheck: the block reductions)."""
    import torch

    for n, nd in ((1, 1), (4099, 4097), (5000, 2501)):
        p, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        sh = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        st, out = new_state(p), torch.empty(1, device="cuda")
        for ver in ("v1", "v2"):
            yield f"grad_norm_{ver} + grad_norm_finish ({n})", (
                lambda g=g, out=out, ver=ver: grad_norm(g, out, version=ver))
            yield f"adamw_flat_count_step + adamw_flat_{ver} ({n}, n_decay {nd})", (
                lambda p=p, g=g, m=m, v=v, sh=sh, st=st, nd=nd, ver=ver: step(
                    p, g, m, v, sh, st, nd, 1e-3, version=ver))
