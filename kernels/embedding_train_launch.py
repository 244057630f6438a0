"""Launching kernels/embedding_train.cu (and its Numba twins): the GPT's token + position
embedding for training, the forward and a deterministic backward.

    et = cb.load_launch("embedding_train")
    et.forward(tokens, wte, wpe, x)                  # x[b*T + t] = wte[tokens[b, t]] + wpe[t]
    et.backward(tokens, dx, dwte, dwpe)              # dwte, dwpe += their gradients (v2)
    et.backward(tokens, dx, dwte, dwpe, scratch=s)   # s: scratch_size(B, T, Vp) int32, given
    et.forward_numba(...), et.backward_numba(...)    # the twins (simulator or GPU), NumPy out
    et.reference_forward(...), et.reference_backward(...)   # float64 NumPy

    FWD_VERSIONS, BWD_VERSIONS, CHUNK, WARPS
    config(kernel, B, T, Vp, C)  -> Launch(grid, block, shared, kernel)
    scratch_layout(B, T, Vp), scratch_size(B, T, Vp)    backward v2's int32 scratch
    sanitize_targets()

Inputs: tokens (B, T) int32 or int64 (both read natively: no conversion copy), wte and dwte
(Vp, C), wpe and dwpe (Tmax, C) with T <= Tmax, x and dx (B*T, C), all float32; C a multiple of
4 (float4 loads), B, T >= 1; every array C-contiguous, on one GPU, the float32 ones 16-byte
aligned. Refused before a launch, with the argument named: dtypes, shapes, layouts, alignment,
host arrays, arrays on two devices, scratch of the wrong dtype or too small.

The ids are not checked on the host (that would be a copy and a sync: not inside a CUDA graph).
An id outside [0, Vp) gives a NaN row of x (never another token's row) and adds nothing to dwte
(skipped: the row of dx at that position is lost to dwte, as it has no row); dwpe still gets it.

Backward versions (both deterministic: every sum runs in increasing position order, one thread
per output element, no float atomics; v1 and v2 give the same bits):
  v1  a block per (vocabulary row, 128 float4 columns) scanning all tokens: O(Vp * M)
  v2  a stable counting sort of the positions by token (rank, offsets, scan, scatter: integer
      work, no atomics), then a warp per (token, 128 columns) adding its run of positions; its
      scratch: (Vp + 1) + 2 M + ceil(M / CHUNK) Vp int32 (6.7 MB at M = 8192, Vp = 50304),
      allocated by dx's library when not given (inside a torch graph capture: from the graph's
      pool). Freed scratch is reused only by later work on the same stream (PyTorch's and CuPy's
      pools are stream-ordered), so it is not kept alive past the call.
Every launch runs on the inputs' stream (PyTorch's current stream for torch tensors:
cb.arrays.launch_stream); nothing is synchronised or read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name
from cudabook.validate import dtype_name, expect_aligned

__all__ = ["FWD_VERSIONS", "BWD_VERSIONS", "CHUNK", "WARPS", "config", "scratch_layout",
           "scratch_size", "forward", "backward", "forward_numba", "backward_numba",
           "reference_forward", "reference_backward", "sanitize_targets"]

FWD_VERSIONS = ("embedding_fwd_v1",)
BWD_VERSIONS = ("embedding_bwd_v1", "embedding_bwd_v2")
CHUNK = 256          # EMB_CHUNK in the .cu: positions per chunk of v2's sort
WARPS = 8            # EMB_WARPS: warps (tokens) per block of v2's sum
ID_DTYPES = {"int32": "i32", "int64": "i64"}
#: the kernels of each version, in launch order (those that read the ids: _i32 / _i64 forms)
STEPS = {"embedding_fwd_v1": ("embedding_fwd_v1",),
         "embedding_bwd_v1": ("embedding_bwd_v1", "embedding_bwd_wpe"),
         "embedding_bwd_v2": ("embedding_bwd_v2_rank", "embedding_bwd_v2_offsets",
                              "embedding_bwd_v2_scan", "embedding_bwd_v2_scatter",
                              "embedding_bwd_v2_sum", "embedding_bwd_wpe")}
_READS_IDS = ("embedding_fwd_v1", "embedding_bwd_v1", "embedding_bwd_v2_rank",
              "embedding_bwd_v2_scatter")


def _module():
    return cb.module("embedding_train")      # the whole file, compiled once per process


# ============================================================================== plans
def config(kernel: str, B: int = 1, T: int = 1, Vp: int = 1, C: int = 4) -> Launch:
    """Grid, block and shared memory of one kernel of the file (the name without _i32/_i64)."""
    M, C4 = B * T, C // 4
    if kernel == "embedding_fwd_v1":
        return Launch((ceil_div(M * C4, 256),), (256,), kernel=kernel)
    if kernel == "embedding_bwd_wpe":
        return Launch((ceil_div(T * C4, 256),), (256,), kernel=kernel)
    if kernel == "embedding_bwd_v1":
        return Launch((Vp, ceil_div(C4, 128)), (128,), kernel=kernel)
    if kernel == "embedding_bwd_v2_rank":
        return Launch((ceil_div(M, CHUNK),), (CHUNK,), kernel=kernel)
    if kernel == "embedding_bwd_v2_offsets":
        return Launch((ceil_div(Vp, 256),), (256,), kernel=kernel)
    if kernel == "embedding_bwd_v2_scan":
        return Launch((1,), (1024,), kernel=kernel)
    if kernel == "embedding_bwd_v2_scatter":
        return Launch((ceil_div(M, 256),), (256,), kernel=kernel)
    if kernel == "embedding_bwd_v2_sum":
        return Launch((ceil_div(Vp, WARPS), ceil_div(C4, 32)), (32 * WARPS,), kernel=kernel)
    raise ValueError(f"unknown kernel {kernel!r}; embedding_train.cu has "
                     f"{sorted({k for s in STEPS.values() for k in s})}")


def scratch_layout(B: int, T: int, Vp: int) -> dict[str, tuple[int, int]]:
    """Backward v2's int32 scratch: {part: (offset, length)} in elements, in this order:
    start (Vp + 1), rank (M), order (M), table (ceil(M / CHUNK) * Vp)."""
    M = int(B) * int(T)
    parts = (("start", Vp + 1), ("rank", M), ("order", M), ("table", ceil_div(M, CHUNK) * Vp))
    out, off = {}, 0
    for name, n in parts:
        out[name] = (off, int(n))
        off += int(n)
    return out


def scratch_size(B: int, T: int, Vp: int) -> int:
    """int32 elements of backward v2's scratch (the sum of scratch_layout's lengths)."""
    off, n = scratch_layout(B, T, Vp)["table"]
    return off + n


# ============================================================================== checks
def _shapes(tokens, table, pos, rows, names: tuple[str, str, str]) -> tuple[int, int, int, int]:
    """(B, T, Vp, C) after the dtype, shape, layout and alignment checks (no device check)."""
    tname, pname, rname = names
    cb.expect(tokens, "tokens", ndim=2, device=False)
    dt = dtype_name(tokens.dtype)
    if dt not in ID_DTYPES:
        raise TypeError(f"tokens: expected int32 or int64 ids, got {dt}")
    B, T = (int(s) for s in tokens.shape)
    if B < 1 or T < 1:
        raise ValueError(f"tokens: shape {(B, T)} is empty; B and T must be >= 1")
    cb.expect(table, tname, dtype=np.float32, ndim=2, device=False)
    Vp, C = (int(s) for s in table.shape)
    if Vp < 1 or C < 4 or C % 4:
        raise ValueError(f"{tname}: shape {(Vp, C)}; the width C must be a positive multiple "
                         "of 4 (rows are moved as float4) and Vp >= 1")
    cb.expect(pos, pname, dtype=np.float32, shape=(None, C), device=False)
    if int(pos.shape[0]) < T:
        raise ValueError(f"{pname}: {int(pos.shape[0])} positions, but tokens has T = {T}; "
                         f"{pname} needs at least T rows")
    if rows is not None:                         # None: the twin allocates x itself
        cb.expect(rows, rname, dtype=np.float32, shape=(B * T, C), device=False)
    if B * T * C >= 2**31 or ceil_div(B * T, CHUNK) * Vp + 2 * B * T + Vp + 1 >= 2**31:
        raise LaunchError(f"{B * T} positions x {C} columns (Vp = {Vp}): the kernels index "
                          "positions and their scratch with 32-bit integers")
    for a, name in ((table, tname), (pos, pname), (rows, rname)):
        if a is not None and not expect_aligned(a, name):
            raise ValueError(f"{name}: its first element is not 16-byte aligned (the kernels "
                             "move float4); pass a fresh or .clone()d array, not an offset view")
    return B, T, Vp, C


def _on_one_gpu(*named) -> None:
    """TypeError for a host array (and in simulator mode, where these kernels cannot run),
    ValueError for arrays on two devices."""
    devs = {}
    for a, name in named:
        info = cb.describe(a, name)
        if not info.on_device or not cb.HAS_GPU:
            why = ("" if cb.HAS_GPU else "; this is simulator mode, where the CUDA C++ kernels "
                   "cannot run (forward_numba / backward_numba run the twins)")
            raise TypeError(f"{name}: expected a GPU array (a torch tensor on 'cuda' or a CuPy "
                            f"array), got a {info.lib} array on the host{why}")
        if info.device_id is not None:
            devs[name] = info.device_id
    if len(set(devs.values())) > 1:
        raise ValueError(f"the arrays are on different GPUs: {devs}; put them on one device")


def _ptr(a) -> np.uint64:
    return np.uint64(cb.describe(a).ptr)


# ============================================================================== entry points
def forward(tokens, wte, wpe, x, version: str = "v1"):
    """x[b*T + t] = wte[tokens[b, t]] + wpe[t] (float32; an id outside [0, Vp): a NaN row).
    Returns x."""
    version = version_name(FWD_VERSIONS, version, "embedding_fwd")
    B, T, Vp, C = _shapes(tokens, wte, wpe, x, ("wte", "wpe", "x"))
    _on_one_gpu((tokens, "tokens"), (wte, "wte"), (wpe, "wpe"), (x, "x"))
    ids = ID_DTYPES[dtype_name(tokens.dtype)]
    cfg = config(version, B, T, Vp, C)
    i = np.int32
    with cb.arrays.launch_stream(x, tokens, wte):
        cb.launch.run(_module().get(f"{version}_{ids}"), cfg,
                      (_ptr(tokens), _ptr(wte), _ptr(wpe), _ptr(x), i(B * T), i(T), i(C),
                       i(Vp)))
    return x


def backward(tokens, dx, dwte, dwpe, scratch=None, version: str = "v2"):
    """dwte[v] += the sum of dx[p] over the positions p with tokens[p] == v, dwpe[t] += the sum
    over b of dx[b*T + t], each in increasing position (deterministic). ``scratch``: v2's int32
    scratch of at least scratch_size(B, T, Vp) elements (allocated when None; v1 needs none).
    Returns (dwte, dwpe)."""
    version = version_name(BWD_VERSIONS, version, "embedding_bwd")
    B, T, Vp, C = _shapes(tokens, dwte, dwpe, dx, ("dwte", "dwpe", "dx"))
    named = [(tokens, "tokens"), (dx, "dx"), (dwte, "dwte"), (dwpe, "dwpe")]
    need = scratch_size(B, T, Vp)
    if version == "embedding_bwd_v2" and scratch is not None:
        cb.expect(scratch, "scratch", dtype=np.int32, ndim=1, device=False)
        if int(scratch.shape[0]) < need:
            raise ValueError(f"scratch: {int(scratch.shape[0])} int32 elements, backward v2 "
                             f"needs scratch_size({B}, {T}, {Vp}) = {need}")
        named.append((scratch, "scratch"))
    _on_one_gpu(*named)
    ids = ID_DTYPES[dtype_name(tokens.dtype)]
    M, i = B * T, np.int32
    mod = _module()

    def run(kernel, args):
        name = f"{kernel}_{ids}" if kernel in _READS_IDS else kernel
        cb.launch.run(mod.get(name), config(kernel, B, T, Vp, C), args)

    with cb.arrays.launch_stream(dx, tokens, dwte):
        tok, d, w = _ptr(tokens), _ptr(dx), _ptr(dwte)
        if version == "embedding_bwd_v1":
            run("embedding_bwd_v1", (tok, d, w, i(M), i(C)))
        else:
            if scratch is None:     # on the launch stream: its pool orders the reuse after us
                scratch = cb.arrays.empty_like_lib(dx, (need,), "int32")
            base = int(cb.describe(scratch).ptr)
            part = {k: np.uint64(base + 4 * off)
                    for k, (off, _) in scratch_layout(B, T, Vp).items()}
            start, rank, order, table = (part[k] for k in ("start", "rank", "order", "table"))
            run("embedding_bwd_v2_rank", (tok, rank, table, i(M), i(Vp)))
            run("embedding_bwd_v2_offsets", (table, start, i(ceil_div(M, CHUNK)), i(Vp)))
            run("embedding_bwd_v2_scan", (start, i(Vp)))
            run("embedding_bwd_v2_scatter", (tok, rank, table, start, order, i(M), i(Vp)))
            run("embedding_bwd_v2_sum", (d, start, order, w, i(Vp), i(C)))
        run("embedding_bwd_wpe", (d, _ptr(dwpe), i(B), i(T), i(C)))
    return dwte, dwpe


# ============================================================================== twins
def _host(a, dtype=None) -> np.ndarray:
    h = np.ascontiguousarray(cb.to_numpy(a))
    return h if dtype is None else h.astype(dtype)


def forward_numba(tokens, wte, wpe) -> np.ndarray:
    """The twin of forward (simulator or GPU): x (B*T, C) float32 as a NumPy array."""
    from numba import cuda

    B, T, Vp, C = _shapes(tokens, wte, wpe, None, ("wte", "wpe", "x"))
    nb = cb.load_numba("embedding_train")
    x = cuda.to_device(np.full((B * T, C), 7.0, np.float32))     # every element is written
    nb.embedding_fwd[ceil_div(B * T * C, 64), 64](
        cuda.to_device(_host(tokens).reshape(-1)), cuda.to_device(_host(wte)),
        cuda.to_device(_host(wpe)), x, T)
    return x.copy_to_host()


def backward_numba(tokens, dx, dwte, dwpe, version: str = "v2"):
    """The twins of backward (simulator or GPU), NumPy in and out: (dwte, dwpe, scratch), the
    gradients accumulated into copies of dwte and dwpe, scratch v2's int32 scratch after the run
    (sliced by scratch_layout; None for v1)."""
    from numba import cuda

    version = version_name(BWD_VERSIONS, version, "embedding_bwd")
    B, T, Vp, C = _shapes(tokens, dwte, dwpe, dx, ("dwte", "dwpe", "dx"))
    nb = cb.load_numba("embedding_train")
    M = B * T
    tok = cuda.to_device(_host(tokens).reshape(-1))
    d = cuda.to_device(_host(dx))
    w, wp = cuda.to_device(_host(dwte)), cuda.to_device(_host(dwpe))
    scratch = None
    if version == "embedding_bwd_v1":
        nb.embedding_bwd_v1[(Vp, ceil_div(C, 32)), 32](tok, d, w)
    else:
        lay = scratch_layout(B, T, Vp)
        s = cuda.to_device(np.full(scratch_size(B, T, Vp), -7, np.int32))   # garbage first
        start, rank, order, table = (s[lay[k][0]:lay[k][0] + lay[k][1]]
                                     for k in ("start", "rank", "order", "table"))
        table = table.reshape(ceil_div(M, CHUNK), Vp)
        nb.embedding_bwd_v2_rank[ceil_div(M, CHUNK), CHUNK](tok, rank, table, Vp)
        nb.embedding_bwd_v2_offsets[ceil_div(Vp, 64), 64](table, start)
        nb.embedding_bwd_v2_scan[1, nb.SCAN_THREADS](start)
        nb.embedding_bwd_v2_scatter[ceil_div(M, 64), 64](tok, rank, table, start, order)
        nb.embedding_bwd_v2_sum[(Vp, ceil_div(C, 32)), 32](d, start, order, w)
        scratch = s.copy_to_host()
    nb.embedding_bwd_wpe[ceil_div(T * C, 64), 64](d, wp, B, T)
    return w.copy_to_host(), wp.copy_to_host(), scratch


# ============================================================================== references
def reference_forward(tokens, wte, wpe) -> np.ndarray:
    """Float64 NumPy x (B*T, C); NaN rows for ids outside [0, Vp)."""
    tok = _host(tokens).astype(np.int64)
    B, T = tok.shape
    wte64, wpe64 = _host(wte, np.float64), _host(wpe, np.float64)
    ok = (tok >= 0) & (tok < wte64.shape[0])
    x = wte64[np.where(ok, tok, 0)] + wpe64[None, :T]
    x[~ok] = np.nan
    return x.reshape(B * T, -1)


def reference_backward(tokens, dx, dwte, dwpe) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Float64 NumPy (dwte + its gradient, dwpe + its gradient, bounds): bounds["dwte"] and
    bounds["dwpe"] bound a float32 result's error elementwise by gamma_k (the sum of |terms|),
    gamma_k = k u / (1 - k u), u = 2^-24, k = n + 1: the n terms of dx added one after another,
    then their sum into the accumulator (n = B for dwpe, the token's count for dwte; Higham's
    bound for recursive summation). A token that does not occur: bound 0 (left untouched). Ids
    outside [0, Vp) are skipped."""
    tok = _host(tokens).astype(np.int64)
    B, T = tok.shape
    g = _host(dx, np.float64)
    w, wp = _host(dwte, np.float64), _host(dwpe, np.float64)
    Vp = w.shape[0]
    flat = tok.reshape(-1)
    ok = (flat >= 0) & (flat < Vp)
    gw, aw = np.zeros_like(w), np.zeros_like(w)
    np.add.at(gw, flat[ok], g[ok])
    np.add.at(aw, flat[ok], np.abs(g[ok]))
    n = np.bincount(flat[ok], minlength=Vp).astype(np.float64)[:, None]
    gp = g.reshape(B, T, -1).sum(axis=0)
    ap = np.abs(g).reshape(B, T, -1).sum(axis=0)
    def gamma(k):
        return k * 2.0 ** -24 / (1 - k * 2.0 ** -24)

    out_w, out_p = w + gw, wp.copy()
    out_p[:T] += gp
    bw = gamma(n + 1) * (aw + np.abs(w)) * (n > 0)     # an absent token: unchanged, exactly
    bp = np.zeros_like(wp)
    bp[:T] = gamma(B + 1) * (ap + np.abs(wp[:T]))
    return out_w, out_p, {"dwte": bw, "dwpe": bp}


# ============================================================================== sanitizer
def sanitize_targets():
    """Forward and both backward versions on ragged sizes (B T not a multiple of a chunk, C/4
    not a multiple of 32, a repeated token, a bad id in the forward), int32 and int64 ids."""
    import cupy as cp

    rng = np.random.default_rng(0)
    B, T, Vp, C = 3, 100, 301, 36
    tok = rng.integers(0, Vp, (B, T)).astype(np.int32)
    tok[:, ::3] = 7
    wte = cp.asarray(rng.standard_normal((Vp, C), np.float32))
    wpe = cp.asarray(rng.standard_normal((T + 5, C), np.float32))
    dx = cp.asarray(rng.standard_normal((B * T, C), np.float32))
    x = cp.empty((B * T, C), cp.float32)
    for dt in (np.int32, np.int64):
        t = cp.asarray(tok.astype(dt))
        bad = t.copy()
        bad[1, 4] = Vp
        yield f"embedding_fwd_v1 ({dt.__name__}, a bad id)", \
            (lambda bad=bad: forward(bad, wte, wpe, x))
        for v in BWD_VERSIONS:
            yield f"{v} ({dt.__name__}, {B}x{T}, Vp {Vp}, C {C})", \
                (lambda t=t, v=v: backward(t, dx, cp.zeros((Vp, C), cp.float32),
                                           cp.zeros((T + 5, C), cp.float32), version=v))
