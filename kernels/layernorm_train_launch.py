"""Launching kernels/layernorm_train.cu: LayerNorm for training, forward (statistics saved, the
residual added first if given) and backward (dx, and dw, db summed in a fixed order).

    lt = cb.load_launch("layernorm_train")
    lt.forward(x, w, b, y, mean, rstd)                          # y = bf16(LayerNorm(x))
    lt.forward(x, w, b, y, mean, rstd, residual=r, x_out=x)     # x += r (in place), then y
    lt.backward(dy, x, w, mean, rstd, dx, dw, db, dx16=dx16)    # dx += grad_x; dw, db +=
    lt.backward(..., accumulate=False)                          # dx = grad_x

  VERSIONS            ("layernorm_train_v1", "layernorm_train_v2"); "v1" or "v2" also work
  config(version, M, C)   {"forward", "backward", "dwdb": Launch records}; v2's "backward"
                      carries partials = G (rows of the dw/db scratch), "dwdb" is its finalize
  scratch_shape(version, M, C)   (2, G, C) float32 for v2 (allocated by backward), None for v1
  row_group(C)        (threads per row, rows per block) of the v2 kernels
  forward(), backward()   the entry points: check, launch on the inputs' stream, return y / dx
  reference_forward(), reference_backward()   float64 NumPy
  forward_numba(), backward_numba()   the Numba twins (kernels/layernorm_train.py), NumPy in/out
  bf16_round(a)       float32 rounded to bfloat16 (nearest even), as float32, in NumPy
  sanitize_targets()

Shapes: x (M, C) float32; w, b (C,) float32; y (M, C) bfloat16; mean, rstd (M,) float32;
residual (M, C) bfloat16 with x_out (M, C) float32 (may be x); dy (M, C) bfloat16; dx (M, C)
float32; dw, db (C,) float32; dx16 (M, C) bfloat16. C a multiple of 8 from 8 to MAX_C, any
M >= 1. Every array C-contiguous, on one GPU, its address a multiple of 16 bytes: anything else
is refused (TypeError / ValueError naming the argument) before a launch.

Inputs are PyTorch CUDA tensors in the training step (CuPy has no bfloat16: the 16-bit arrays
reach the kernels as raw pointers); every launch runs on their stream (cb.arrays.launch_stream),
nothing is copied to the host or synchronised, so a torch.cuda.CUDAGraph captures both entry
points (compile once before capturing: call each once). Backward v2 allocates its scratch,
scratch_shape() floats, from the inputs' library on that stream (inside a capture: the graph's
pool). dw and db are always added to (+=) with the same fixed-order sums on every run.
"""

from __future__ import annotations

import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "CHUNKS", "THREADS", "MAX_C", "BWD_BLOCKS", "row_group", "config",
           "scratch_shape", "forward", "backward", "reference_forward", "reference_backward",
           "forward_numba", "backward_numba", "bf16_round", "sanitize_targets"]

VERSIONS = ("layernorm_train_v1", "layernorm_train_v2")
CHUNKS = 4            # LNT_CHUNKS: 8-column chunks per thread in v2 (32 floats in registers)
THREADS = 256         # LNT_THREADS: threads per v2 block at most
MAX_C = 8192          # widest row: 8 warps per row, each thread LNT_CHUNKS chunks
#: most blocks of backward v2, so the rows of its dw/db partials: a constant (not the GPU's
#: SM count) so that the sums' order, and so dw and db, are the same on every GPU
BWD_BLOCKS = 256
KERNELS = {"layernorm_train_v1": ("layernorm_train_fwd_v1", "layernorm_train_bwd_v1",
                                  "layernorm_train_dwdb_v1"),
           "layernorm_train_v2": ("layernorm_train_fwd_v2", "layernorm_train_bwd_v2",
                                  "layernorm_train_finalize_v2")}


def _module():
    return cb.module("layernorm_train")


def row_group(C: int) -> tuple[int, int]:
    """(threads per row, rows per block) of the v2 kernels: 32 W threads with W =
    ceil(C / 8 / (32 CHUNKS)) warps (lnt_group_threads in the .cu), THREADS // (32 W) rows."""
    tpr = 32 * ceil_div(C // 8, 32 * CHUNKS)
    return tpr, max(1, THREADS // tpr)


def config(version: str, M: int, C: int) -> dict:
    """The launch records of ``version`` for an (M, C) input: "forward", "backward" (dx; v2:
    with dw/db partials, ``partials`` = G blocks) and "dwdb" (v1: the column kernel; v2: the
    finalize kernel summing the G partials). See the launch comments in layernorm_train.cu."""
    version = version_name(VERSIONS, version, "layernorm_train")
    fwd, bwd, dwdb = KERNELS[version]
    if version == "layernorm_train_v1":
        rows = Launch((ceil_div(M, 4),), (128,))                 # a warp per row
        return {"forward": Launch(*rows, kernel=fwd), "backward": Launch(*rows, kernel=bwd),
                "dwdb": Launch((ceil_div(C, 128),), (128,), kernel=dwdb)}
    tpr, R = row_group(C)
    G = min(ceil_div(M, R), BWD_BLOCKS)
    return {"forward": Launch((ceil_div(M, R),), (tpr * R,), kernel=fwd),
            "backward": Launch((G,), (tpr * R,), shared=4 * R * C if R > 1 else 0,
                               kernel=bwd, partials=G),
            "dwdb": Launch((ceil_div(C, 32), 2), (32, 8), kernel=dwdb)}


def scratch_shape(version: str, M: int, C: int) -> tuple | None:
    """The float32 scratch backward ``version`` allocates: (2, G, C) for v2 (dw's and db's
    partial sums per block, G = min(ceil(M / rows per block), BWD_BLOCKS)), None for v1."""
    cfg = config(version, M, C)
    return (2, cfg["backward"]["partials"], C) if "partials" in cfg["backward"] else None


# ---------------------------------------------------------------------------- checks
def _width(C: int) -> None:
    if C % 8 or not 8 <= C <= MAX_C:
        raise LaunchError(f"row width C = {C}: the kernels take a multiple of 8 from 8 to "
                          f"{MAX_C} (16-byte bf16 chunks of 8 columns, at most 8 warps per row); "
                          "pad the rows to a multiple of 8")


def _rows(x, name: str) -> tuple[int, int]:
    cb.expect(x, name, dtype=np.float32, ndim=2)
    M, C = (int(s) for s in cb.describe(x, name).shape)
    if M < 1:
        raise LaunchError(f"{name} has shape {(M, C)}: no rows to normalise")
    if M >= 2**31:
        raise LaunchError(f"{name}: {M} rows is more than a grid dimension holds")
    _width(C)
    return M, C


def _same_place(arrays: dict) -> None:
    """Every array 16-byte aligned and on the first array's device; no output at another's
    address (x_out = x is checked by the caller)."""
    dev = None
    seen: dict = {}
    for name, a in arrays.items():
        info = cb.describe(a, name)
        if info.ptr % 16:
            raise ValueError(f"{name}: address {info.ptr:#x} is not a multiple of 16 bytes "
                             "(16-byte loads); pass a freshly allocated or .clone()d tensor")
        if info.device_id is not None:
            if dev is not None and info.device_id != dev[1]:
                raise ValueError(f"{name} is on GPU {info.device_id}, {dev[0]} on GPU {dev[1]}; "
                                 "put every argument on one GPU")
            dev = dev or (name, info.device_id)
        if info.ptr and info.ptr in seen:
            raise ValueError(f"{name} and {seen[info.ptr]} are the same memory; each output "
                             "needs its own buffer")
        seen[info.ptr] = name


def _ptr(a) -> np.uint64:
    return np.uint64(cb.describe(a).ptr if a is not None else 0)


def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise TypeError(f"eps must be a number > 0, got {eps!r}")
    return float(eps)


# ---------------------------------------------------------------------------- entry points
def forward(x, w, b, y, mean, rstd, residual=None, x_out=None, eps: float = 1e-5,
            version: str = "v2"):
    """y = bf16((x - mean) * rstd * w + b) over each row of x (fp32 arithmetic, one rounding),
    mean and rstd = 1 / sqrt(biased var + eps) saved for the backward. With ``residual`` (bf16),
    x_out = x + float(residual) is written first and normalised instead (``x_out`` may be x: an
    in-place add; x is otherwise not modified). Returns y."""
    version = version_name(VERSIONS, version, "layernorm_train")
    M, C = _rows(x, "x")
    for name, a in (("w", w), ("b", b)):
        cb.expect(a, name, dtype=np.float32, shape=(C,))
    cb.expect(y, "y", dtype="bfloat16", shape=(M, C))
    for name, a in (("mean", mean), ("rstd", rstd)):
        cb.expect(a, name, dtype=np.float32, shape=(M,))
    arrays = {"x": x, "w": w, "b": b, "y": y, "mean": mean, "rstd": rstd}
    if residual is None:
        if x_out is not None:
            raise ValueError("x_out is written only when a residual is added; pass residual "
                             "too, or leave x_out out")
    else:
        cb.expect(residual, "residual", dtype="bfloat16", shape=(M, C))
        if x_out is None:
            raise ValueError("residual given without x_out: pass x_out (M, C) float32 for "
                             "x + residual (x_out=x adds in place)")
        cb.expect(x_out, "x_out", dtype=np.float32, shape=(M, C))
        arrays["residual"] = residual
        if cb.describe(x_out).ptr != cb.describe(x).ptr:
            arrays["x_out"] = x_out
    eps = _eps(eps)
    _same_place(arrays)
    cfg = config(version, M, C)["forward"]
    mod = _module()
    args = (_ptr(x), _ptr(residual), _ptr(x_out), _ptr(w), _ptr(b), _ptr(y), _ptr(mean),
            _ptr(rstd), np.int32(M), np.int32(C), np.float32(eps))
    with cb.arrays.launch_stream(x):
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return y


def backward(dy, x, w, mean, rstd, dx, dw, db, dx16=None, accumulate: bool = True,
             version: str = "v2"):
    """The gradients of forward's y = LayerNorm(x) given dy (bf16): dx (fp32) += grad_x
    (``accumulate=False``: dx = grad_x, dx is not read), dw += sum_rows dy * xhat and db +=
    sum_rows dy (always added to; fixed-order sums, bitwise repeatable), and, if ``dx16`` is
    given, dx16 = bf16(dx) after the update. x is the tensor the forward normalised (its x_out
    when a residual was added); mean, rstd the forward's. Returns dx."""
    version = version_name(VERSIONS, version, "layernorm_train")
    M, C = _rows(x, "x")
    cb.expect(dy, "dy", dtype="bfloat16", shape=(M, C))
    cb.expect(w, "w", dtype=np.float32, shape=(C,))
    for name, a in (("mean", mean), ("rstd", rstd)):
        cb.expect(a, name, dtype=np.float32, shape=(M,))
    cb.expect(dx, "dx", dtype=np.float32, shape=(M, C))
    for name, a in (("dw", dw), ("db", db)):
        cb.expect(a, name, dtype=np.float32, shape=(C,))
    arrays = {"dy": dy, "x": x, "w": w, "mean": mean, "rstd": rstd, "dx": dx, "dw": dw,
              "db": db}
    if dx16 is not None:
        cb.expect(dx16, "dx16", dtype="bfloat16", shape=(M, C))
        arrays["dx16"] = dx16
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate must be True (dx +=) or False (dx =), got {accumulate!r}")
    _same_place(arrays)
    cfgs = config(version, M, C)
    mod = _module()
    acc = np.int32(bool(accumulate))
    Dy, X, Wt, Mu, Rs, Dx, Dx16, Dw, Db = (_ptr(a) for a in (dy, x, w, mean, rstd, dx, dx16,
                                                              dw, db))
    m, c = np.int32(M), np.int32(C)
    with cb.arrays.launch_stream(x):
        main, dwdb = cfgs["backward"], cfgs["dwdb"]
        if version == "layernorm_train_v1":
            cb.launch.run(mod.get(main.kernel), main, (Dy, X, Wt, Mu, Rs, Dx, Dx16, m, c, acc))
            cb.launch.run(mod.get(dwdb.kernel), dwdb, (Dy, X, Mu, Rs, Dw, Db, m, c))
        else:
            # the partials, allocated on this stream: freed on return, their memory is reused
            # only by later work on the same stream (PyTorch's and CuPy's pools are per stream)
            part = cb.arrays.empty_like_lib(x, (2, main["partials"], C), "float32")
            P = _ptr(part)
            cb.launch.run(mod.get(main.kernel), main,
                          (Dy, X, Wt, Mu, Rs, Dx, Dx16, P, m, c, acc))
            cb.launch.run(mod.get(dwdb.kernel), dwdb,
                          (P, Dw, Db, np.int32(main["partials"]), c))
    return dx


# ---------------------------------------------------------------------------- references
def bf16_round(a) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even, as __float2bfloat16_rn and
    torch's .to(torch.bfloat16)), returned as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, r)


def reference_forward(x, w, b, residual=None, eps: float = 1e-5):
    """(y, mean, rstd, x_out) in float64 of the rows of x_out = float32(x + residual) (x
    without a residual): y unrounded, x_out float32 as the kernels write it."""
    xo = np.asarray(cb.to_numpy(x), np.float32)
    if residual is not None:
        xo = xo + np.asarray(cb.to_numpy(residual), np.float32)      # the fp32 add of the kernel
    x64 = xo.astype(np.float64)
    mean = x64.mean(axis=1)
    rstd = 1.0 / np.sqrt(((x64 - mean[:, None]) ** 2).mean(axis=1) + eps)
    w64, b64 = (np.asarray(cb.to_numpy(a), np.float64) for a in (w, b))
    y = (x64 - mean[:, None]) * rstd[:, None] * w64 + b64
    return y, mean, rstd, xo


def reference_backward(dy, x, w, eps: float = 1e-5):
    """(grad_x, dw, db) in float64: the gradient of LayerNorm(x) * w + b given dy, the
    statistics recomputed from x; dw, db are the increments (sums over the rows)."""
    x64, dy64 = (np.asarray(cb.to_numpy(a), np.float64) for a in (x, dy))
    w64 = np.asarray(cb.to_numpy(w), np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x64 - mean) ** 2).mean(axis=1, keepdims=True) + eps)
    xh = (x64 - mean) * rstd
    wdy = w64 * dy64
    gx = rstd * (wdy - wdy.mean(axis=1, keepdims=True)
                 - xh * (wdy * xh).mean(axis=1, keepdims=True))
    return gx, (dy64 * xh).sum(axis=0), dy64.sum(axis=0)


# ---------------------------------------------------------------------------- Numba twins
def _twin_shape(x) -> tuple[int, int]:
    M, C = (int(s) for s in np.shape(x))
    if M < 1:
        raise LaunchError(f"x has shape {(M, C)}: no rows to normalise")
    _width(C)
    return M, C


def forward_numba(x, w, b, residual=None, eps: float = 1e-5, version: str = "v2"):
    """The Numba twin of forward ``version`` (float32; the simulator without a GPU): NumPy
    arrays in (residual: float32 holding bf16 values), (y, mean, rstd, x_out) out, y rounded to
    bf16 here, where the CUDA kernel rounds (once, at the store)."""
    from numba import cuda

    version = version_name(VERSIONS, version, "layernorm_train")
    M, C = _twin_shape(x)
    nb = cb.load_numba("layernorm_train")
    f32 = [np.ascontiguousarray(cb.to_numpy(a), np.float32) for a in (x, w, b)]
    has_res = residual is not None
    r = np.ascontiguousarray(cb.to_numpy(residual), np.float32) if has_res else f32[0]
    dx_, dw_, db_, dr = (cuda.to_device(a) for a in (*f32, r))
    xo = cuda.to_device(np.full((M, C), np.nan, np.float32))
    y = cuda.to_device(np.full((M, C), np.nan, np.float32))
    mean, rstd = (cuda.to_device(np.full(M, np.nan, np.float32)) for _ in range(2))
    args = (dx_, dr, has_res, xo, dw_, db_, np.float32(_eps(eps)), y, mean, rstd)
    if version == "layernorm_train_v1":
        nb.forward_warp_rows[ceil_div(M, nb.WARPS), 32 * nb.WARPS](*args)
    else:
        tpr, R = row_group(C)
        nb.forward_row_groups[ceil_div(M, R), tpr * R](*args)
    x_out = xo.copy_to_host() if has_res else f32[0]
    return bf16_round(y.copy_to_host()), mean.copy_to_host(), rstd.copy_to_host(), x_out


def backward_numba(dy, x, w, mean, rstd, dx=None, accumulate: bool = True, version: str = "v2",
                   blocks: int | None = None):
    """The Numba twins of backward ``version`` (float32; the simulator without a GPU): NumPy
    arrays in (dy: float32 holding bf16 values; dx: the gradient to add to when accumulating),
    (dx, dw, db, dx16) out, dw and db the increments (the twins add to zeros), dx16 = bf16(dx)
    rounded here. ``blocks`` (v2): the number of blocks instead of config's G, so that a row
    group takes several rows in a small test."""
    from numba import cuda

    version = version_name(VERSIONS, version, "layernorm_train")
    M, C = _twin_shape(x)
    nb = cb.load_numba("layernorm_train")
    h = [np.ascontiguousarray(cb.to_numpy(a), np.float32) for a in (dy, x, w, mean, rstd)]
    d = [cuda.to_device(a) for a in h]
    if accumulate:
        if dx is None:
            raise ValueError("accumulate=True adds to dx: pass dx")
        dxd = cuda.to_device(np.ascontiguousarray(cb.to_numpy(dx), np.float32))
    else:
        dxd = cuda.to_device(np.full((M, C), np.nan, np.float32))   # not read
    dw, db = (cuda.to_device(np.zeros(C, np.float32)) for _ in range(2))
    if version == "layernorm_train_v1":
        nb.backward_dx_warp_rows[ceil_div(M, nb.WARPS), 32 * nb.WARPS](*d, bool(accumulate), dxd)
        nb.backward_dwdb_columns[ceil_div(C, 32), 32](d[0], d[1], d[3], d[4], dw, db)
    else:
        tpr, R = row_group(C)
        G = config(version, M, C)["backward"]["partials"] if blocks is None else int(blocks)
        part = cuda.to_device(np.full((2, G, C), np.nan, np.float32))
        nb.backward_row_groups[G, tpr * R](*d, bool(accumulate), dxd, part)
        nb.backward_finalize[(ceil_div(C, 32), 2), (32, 8)](part, dw, db)
    out = dxd.copy_to_host()
    return out, dw.copy_to_host(), db.copy_to_host(), bf16_round(out)


# ---------------------------------------------------------------------------- sanitizer
def sanitize_targets():
    """Both versions on ragged shapes (PyTorch tensors: CuPy has no bfloat16): C = 8, 1000 (a
    warp's last chunks past the row's end), 1032 (two warps per row, four rows per block), 3080
    (three warps, two rows per block), 8192 (eight warps, one row); 2100 x 768 gives backward v2
    more rows than its 256 blocks take at once. Forward with the residual; backward accumulating,
    with dx16, on the statistics of a forward run here first."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = {"device": "cuda"}
    for M, C in ((7, 8), (7, 1000), (5, 1032), (3, 3080), (2, 8192), (2100, 768)):
        x = torch.randn(M, C, generator=g, **dev)
        r = torch.randn(M, C, generator=g, **dev).to(torch.bfloat16)
        w, b = torch.rand(C, generator=g, **dev) + 0.5, torch.randn(C, generator=g, **dev)
        y, dy = torch.empty(M, C, dtype=torch.bfloat16, **dev), r.clone()
        mean, rstd = torch.empty(M, **dev), torch.empty(M, **dev)
        xo, dx = torch.empty_like(x), torch.zeros_like(x)
        dw, db = torch.zeros(C, **dev), torch.zeros(C, **dev)
        dx16 = torch.empty(M, C, dtype=torch.bfloat16, **dev)
        forward(x, w, b, y, mean, rstd, residual=r, x_out=xo)    # the backward's inputs
        for v in VERSIONS:
            yield f"{KERNELS[v][0]} ({M}x{C}, residual)", (
                lambda v=v, x=x, w=w, b=b, y=y, mean=mean, rstd=rstd, r=r, xo=xo:
                forward(x, w, b, y, mean, rstd, residual=r, x_out=xo, version=v))
            yield f"{KERNELS[v][1]} + {KERNELS[v][2]} ({M}x{C}, dx16)", (
                lambda v=v, dy=dy, xo=xo, w=w, mean=mean, rstd=rstd, dx=dx, dw=dw, db=db,
                dx16=dx16: backward(dy, xo, w, mean, rstd, dx, dw, db, dx16=dx16, version=v))
