"""Launching kernels/gemm_train.cu: a linear layer's three training products on Hopper's tensor
cores (wgmma, TMA; sm_90a), each operand read where it lies, no transposed copies.

    gt = cb.load_launch("gemm_train")
    y  = gt.gemm(x, W, "nt")               # y (M, N) = x (M, K) @ W (N, K)^T       the forward
    dx = gt.gemm(dy, W, "nn")              # dx (M, K) = dy (M, N) @ W (N, K)        input gradient
    dW = gt.gemm(dy, x, "tn", out=g32)     # dW (N, K) = dy (M, N)^T @ x (M, K)      weight gradient,
                                           # straight into an fp32 gradient buffer

  VERSIONS, WHAT, LAYOUTS, DTYPES
  dims(layout, a_shape, b_shape)   (M, N, K) of C (M, N) = op(A) op(B), or a ValueError
  plan(version, M, N, K, sms)      v2's tile width, stages and split of K for one shape
  config(version, layout, M, N, K, dtype, out_dtype, sms)   the launch record (kernel: the
                                   template instantiation's name, plus BN, STAGES, splits, units)
  gemm(A, B, layout, out, version, work)   the entry point: checks, tensor maps, launch
  Workspace(like, floats, tiles)   the split-K scratch (fp32 partials, tickets) a caller owns:
                                   gemm(..., work=ws) allocates nothing (CUDA-graph capture)
  reference(A, B, layout)          the float64 product (NumPy), for checks
  sanitize_targets()

Layouts (gemm_train.cu's table): "nt" A (M, K), B (N, K); "nn" A (M, K), B (K, N); "tn" A (K, M),
B (K, N); C (M, N) in every case. Inputs bfloat16 or float16 (both the same), C the same dtype or
float32. Refused before a launch, naming the argument: another GPU than compute capability 9.0
(wgmma and setmaxnreg exist on Hopper only; hgemm_v9 or cuBLAS elsewhere), a dtype or shape that
does not fit, a stored row that is not a multiple of 8 values (TMA's 16 bytes), an odd N, views,
host arrays, arrays on two GPUs, an out that overlaps an input, a workspace too small.
v2 is deterministic: a split product is summed in split order by whichever block arrives last,
so every run gives the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "LAYOUTS", "DTYPES", "dims", "plan", "config", "gemm",
           "Workspace", "reference", "flops", "sanitize_targets"]

VERSIONS = ("gemm_train_v1", "gemm_train_v2")
WHAT = {"gemm_train_v1": "hgemm_v9's loop, operands in any layout (wgmma transpose bits), "
                         "128 x 256 tiles",
        "gemm_train_v2": "+ tile width per shape and a deterministic split of K"}
#: layout -> (A MN-major, B MN-major)
LAYOUTS = {"nt": (0, 0), "nn": (0, 1), "tn": (1, 1)}
DTYPES = ("bfloat16", "float16")
_CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
BM, BK, THREADS = 128, 64, 384
#: stages of the ring per (tile width, TMA-store epilogue): STAGES (128 + BN) 128 bytes of
#: operands (+ 2 BN 128 of staged C): 192 KiB without the epilogue's tile, 160-208 KiB with it
STAGES = {(256, False): 4, (128, False): 6, (256, True): 3, (128, True): 5}
MAX_SPLITS = 16
#: a split keeps at least this many k-tiles of 64 (shorter ones are mostly prologue and epilogue)
MIN_KTILES = 8
#: the planner's model (``_cost``), in k-tiles of a 128 x 256 tile, fitted to the GPT-2 shapes
#: on an H200: a k-tile of a 128-wide tile; the epilogue of a 128 x 256 tile stored from
#: registers and by TMA; a split piece's epilogue (partials out, a ticket; the last piece reads
#: every partial back: a cost that grows with the number of splits), for a 128-wide tile
PER_K_128 = 0.52
EPI_DIRECT, EPI_TMA = 3.0, 1.0
SPLIT_BASE, SPLIT_PER = 2.0, 1.85


def _shared(bn: int, epi: bool) -> int:
    return STAGES[bn, epi] * (BM + bn) * BK * 2 + 1024 + (2 * bn * 128 if epi else 0)


def dims(layout: str, a_shape, b_shape) -> tuple[int, int, int]:
    """(M, N, K) of the product for operands of these shapes, or ValueError saying which
    dimension disagrees."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {sorted(LAYOUTS)} (nt: y = x W^T, nn: dx = dy W, "
                         f"tn: dW = dy^T x), got {layout!r}")
    (a0, a1), (b0, b1) = a_shape, b_shape
    if layout == "nt":
        M, K, N, Kb = a0, a1, b0, b1
    elif layout == "nn":
        M, K, Kb, N = a0, a1, b0, b1
    else:
        K, M, Kb, N = a0, a1, b0, b1
    if K != Kb:
        raise ValueError(f"layout {layout!r}: A {tuple(a_shape)} and B {tuple(b_shape)} disagree "
                         f"on the reduction ({K} against {Kb})")
    return int(M), int(N), int(K)


def flops(M: int, N: int, K: int) -> float:
    return 2.0 * M * N * K


def _cost(M: int, N: int, K: int, bn: int, splits: int, epi: bool, sms: int) -> float:
    """A model of the time of one plan, in k-tiles of a 128 x 256 tile: the waves of whole tiles
    (all of K and an epilogue each), then, with splits, one or more waves of the last partial
    wave's tiles in pieces (1 / splits of K and a partial-sum epilogue each)."""
    kt = ceil_div(K, BK)
    tiles = ceil_div(M, BM) * ceil_div(N, bn)
    per_k = 1.0 if bn == 256 else PER_K_128
    epi_cost = (EPI_TMA if epi else EPI_DIRECT) * bn / 256
    if splits == 1:
        return ceil_div(tiles, sms) * (kt * per_k + epi_cost)
    whole = tiles // sms * sms
    rem = tiles - whole
    kts = ceil_div(kt, splits)
    return (whole // sms) * (kt * per_k + epi_cost) + \
        ceil_div(rem * splits, sms) * (kts * per_k + (SPLIT_BASE + SPLIT_PER * splits) * bn / 128)


def plan(version: str, M: int, N: int, K: int, sms: int = 132, out_dtype: str = "bfloat16"
         ) -> dict:
    """v1: 128 x 256 tiles, no split, C stored from registers. v2: the (tile width, split of the
    last wave) of least modelled time (``_cost``), C by TMA where it is 16-bit; splits only with
    128-wide tiles (a 256-wide tile's split path spills registers), only for a partial last
    wave, and only where every piece keeps MIN_KTILES k-tiles."""
    version = version_name(VERSIONS, version, "gemm_train")
    if version == "gemm_train_v1":
        return dict(BN=256, STAGES=STAGES[256, False], EPI=False, whole=ceil_div(M, BM) *
                    ceil_div(N, 256), splits=1)
    epi = out_dtype != "float32"
    kt = ceil_div(K, BK)
    best = None
    for bn in (256, 128):
        tiles = ceil_div(M, BM) * ceil_div(N, bn)
        rem = tiles % sms
        for s in range(1, MAX_SPLITS + 1):
            if s > 1 and (bn != 128 or rem == 0 or ceil_div(kt, s) < MIN_KTILES
                          or ceil_div(kt, ceil_div(kt, s)) != s):
                continue
            c = _cost(M, N, K, bn, s, epi, sms)
            if best is None or c < best[0] - 1e-9:
                best = (c, bn, s, tiles - rem if s > 1 else tiles)
    _, bn, s, whole = best
    return dict(BN=bn, STAGES=STAGES[bn, epi], EPI=epi, whole=whole, splits=s)


def _given(params: dict, M: int, N: int, K: int, out_dtype: str, sms: int) -> dict:
    bn, s = params.get("BN", 256), params.get("splits", 1)
    epi = bool(params.get("EPI", out_dtype != "float32"))
    if bn not in (128, 256):
        raise ValueError(f"params: BN is 128 or 256, got {bn!r}")
    if epi and out_dtype == "float32":
        raise ValueError("params: the TMA-store epilogue (EPI) stages 16-bit outputs only")
    kt = ceil_div(K, BK)
    if not (isinstance(s, int) and 1 <= s <= min(MAX_SPLITS, kt)) or \
            ceil_div(kt, ceil_div(kt, s)) != s:
        raise ValueError(f"params: splits = {s!r} does not divide K = {K} ({kt} k-tiles of 64) "
                         f"into that many non-empty parts of at most {MAX_SPLITS}")
    if s > 1 and bn != 128:
        raise ValueError("params: splits > 1 need BN = 128 (a 256-wide tile's split path "
                         "spills registers)")
    tiles = ceil_div(M, BM) * ceil_div(N, bn)
    whole = params.get("whole", tiles // sms * sms if s > 1 else tiles)
    return dict(BN=bn, STAGES=STAGES[bn, epi], EPI=epi, whole=min(int(whole), tiles), splits=s)


def kernel_name(bn: int, stages: int, layout: str, dtype: str, out_dtype: str, epi: bool = False,
                split: bool = False) -> str:
    ta, tb = LAYOUTS[layout]
    b = lambda x: "true" if x else "false"   # noqa: E731
    return (f"gemm_train_t<{bn}, {stages}, {ta}, {tb}, {b(out_dtype == 'float32')}, {b(epi)}, "
            f"{b(split)}, {_CTYPE[dtype]}>")


def config(version: str, layout: str, M: int, N: int, K: int, dtype: str = "bfloat16",
           out_dtype: str | None = None, sms: int = 132, params: dict | None = None) -> Launch:
    """The launch record of one product: a persistent grid of min(units, sms) blocks of 384
    threads; extras BN, STAGES, EPI, whole, splits, units, tiles and the workspace it needs
    (work_floats, tickets). ``params`` (BN, splits, EPI, whole) replaces the plan (a sweep)."""
    version = version_name(VERSIONS, version, "gemm_train")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {sorted(LAYOUTS)}, got {layout!r}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype: {' or '.join(DTYPES)}, got {dtype}")
    out_dtype = out_dtype or dtype
    if out_dtype not in (dtype, "float32"):
        raise TypeError(f"out: {dtype} (the inputs' dtype) or float32, got {out_dtype}")
    for v, n in (("M", M), ("N", N), ("K", K)):
        if int(n) < 1:
            raise ValueError(f"{v} = {n}: an empty product")
    p = plan(version, M, N, K, sms, out_dtype) if params is None else \
        _given(params, M, N, K, out_dtype, sms)
    tiles = ceil_div(M, BM) * ceil_div(N, p["BN"])
    split = p["splits"] > 1 and p["whole"] < tiles
    rem = tiles - p["whole"] if split else 0
    units = tiles - rem + rem * p["splits"]
    if units > 2**31 - 1:
        raise LaunchError(f"gemm_train: {units} work units exceed an int")
    return Launch((min(units, sms),), (THREADS,), shared=_shared(p["BN"], p["EPI"]),
                  kernel=kernel_name(p["BN"], p["STAGES"], layout, dtype, out_dtype, p["EPI"],
                                     split),
                  units=units, tiles=tiles, work_floats=p["splits"] * rem * BM * p["BN"],
                  tickets=2 * rem, **p)


# ============================================================================ the workspace

class Workspace:
    """The scratch of split products: ``floats`` fp32 partial sums and ``tickets`` int32
    counters (zero, and left zero by every launch), in ``like``'s library and device (a torch
    tensor or a CuPy array). Allocate it before capturing a CUDA graph and pass it to every
    gemm(..., work=ws) of the graph: launches that need no more than it holds allocate nothing."""

    def __init__(self, like: Any, floats: int, tickets: int):
        self.floats, self.tickets = int(floats), int(tickets)
        lib = cb.arrays.lib_of(like)
        if lib == "torch":
            import torch

            dev = like.device
            self.work = torch.empty(max(1, self.floats), dtype=torch.float32, device=dev)
            self.tick = torch.zeros(max(1, self.tickets), dtype=torch.int32, device=dev)
        else:
            import cupy

            self.work = cupy.empty(max(1, self.floats), dtype=cupy.float32)
            self.tick = cupy.zeros(max(1, self.tickets), dtype=cupy.int32)
        self.device_id = cb.describe(self.work, "work").device_id

    @classmethod
    def for_shapes(cls, like: Any, shapes, version: str = "v2", dtype: str = "bfloat16",
                   sms: int | None = None) -> "Workspace":
        """A workspace big enough for every (layout, M, N, K, out_dtype) in ``shapes``."""
        sms = sms or (cb.launch.device().sms if cb.HAS_GPU else 132)
        f = t = 0
        for layout, M, N, K, od in shapes:
            cfg = config(version, layout, M, N, K, dtype, od, sms)
            f, t = max(f, cfg["work_floats"]), max(t, cfg["tickets"])
        return cls(like, f, t)


_WORK: dict = {}                   # device id -> the Workspace gemm() uses when given none


def _default_work(like: Any, floats: int, tickets: int) -> Workspace:
    dev = cb.describe(like, "A").device_id
    ws = _WORK.get(dev)
    if ws is None or ws.floats < floats or ws.tickets < tickets:
        ws = _WORK[dev] = Workspace(like, max(floats, ws.floats if ws else 0),
                                    max(tickets, ws.tickets if ws else 0))
    return ws


# ============================================================================ launching

def _module(name: str):
    return cb.module("gemm_train", a_features=True, name_expressions=(name,))


def _tma(info, rows: int, cols: int, box_rows: int, dtype: str):
    return cb.tma.tensor_map(info.ptr, rows, cols, box_rows, 64, dtype, swizzle=128)


def gemm(A: Any, B: Any, layout: str = "nt", out: Any | None = None, version: str = "v2",
         work: Workspace | None = None, params: dict | None = None):
    """C = op(A) op(B) for ``layout`` (module docstring), into ``out`` (default: a new array of
    A's library and dtype; pass a float32 ``out`` for fp32 results). ``work``: the split-K
    scratch (default: one per GPU, grown when needed; give one under CUDA-graph capture).
    ``params``: config()'s. Returns out. Launches on the inputs' stream; never synchronises."""
    version = version_name(VERSIONS, version, "gemm_train")
    cb.expect(A, "A", ndim=2, device=False)
    cb.expect(B, "B", ndim=2, device=False)
    dt = cb.describe(A, "A").dtype
    if dt not in DTYPES:
        raise TypeError(f"A: expected bfloat16 or float16, got {dt}")
    if cb.describe(B, "B").dtype != dt:
        raise TypeError(f"B: expected {dt} like A, got {cb.describe(B, 'B').dtype}")
    M, N, K = dims(layout, tuple(A.shape), tuple(B.shape))
    if min(M, N, K) < 1:
        raise ValueError(f"an empty product: M, N, K = {M}, {N}, {K}")
    for name, x in (("A", A), ("B", B)):
        if x.shape[1] % 8:
            raise ValueError(f"{name}: rows of {x.shape[1]} values; TMA reads rows of a multiple "
                             f"of 8 (16 bytes): pad the matrix")
    if N % 8:
        raise ValueError(f"N = {N}: C's rows must be a multiple of 8 values (16 bytes, TMA)")
    cc = cb.cc() if cb.HAS_GPU else None
    if cc is not None and tuple(cc) != (9, 0):
        raise cb.launch.LaunchError(
            f"gemm_train needs compute capability 9.0 (wgmma, setmaxnreg); this GPU is "
            f"{cc[0]}.{cc[1]}: use hgemm (kernels/hgemm.cu) or torch.matmul")
    if out is None:
        out = cb.arrays.empty_like_lib(A, (M, N), dt)
    cb.expect(out, "out", ndim=2, shape=(M, N), device=False)
    od = cb.describe(out, "out").dtype
    infos = cb.validate.expect_one_gpu(("A", A), ("B", B), ("out", out))
    ia, ib, io = infos
    for x in (ia, ib):
        if cb.validate.overlaps(x, io):
            raise ValueError(f"out overlaps {x.name}: pass a separate out")
        if x.ptr % 16:
            raise ValueError(f"{x.name}: starts at {x.ptr:#x}, not 16-byte aligned (TMA)")
    if io.ptr % 16:
        raise ValueError(f"out: starts at {io.ptr:#x}, not 16-byte aligned (TMA)")
    sms = cb.launch.device().sms
    cfg = config(version, layout, M, N, K, dt, od, sms, params)
    if cfg["work_floats"]:
        if work is None:
            work = _default_work(A, cfg["work_floats"], cfg["tickets"])
        elif work.floats < cfg["work_floats"] or work.tickets < cfg["tickets"]:
            raise ValueError(f"work: this product needs {cfg['work_floats']} floats and "
                             f"{cfg['tickets']} tickets, the workspace has {work.floats} and "
                             f"{work.tickets} (Workspace.for_shapes sizes one)")
        elif work.device_id != io.device_id:
            raise ValueError("work: on another GPU than the operands")
        wp, tp = cb.describe(work.work).ptr, cb.describe(work.tick).ptr
    else:
        wp = tp = 0
    ta, tb = LAYOUTS[layout]
    bn = cfg["BN"]
    map_a = _tma(ia, K, M, 64, dt) if ta else _tma(ia, M, K, BM, dt)
    map_b = _tma(ib, K, N, 64, dt) if tb else _tma(ib, N, K, bn, dt)
    map_c = _tma(io, M, N, 64, dt) if cfg["EPI"] else map_a     # (unread without EPI)
    kern = _module(cfg["kernel"]).get(cfg["kernel"])
    args = (map_a, map_b, map_c, np.uint64(io.ptr), np.uint64(wp), np.uint64(tp), np.int32(M),
            np.int32(N), np.int32(K), np.int32(cfg["whole"]), np.int32(cfg["splits"]))
    with cb.arrays.launch_stream(A, B, out):
        cb.launch.run(kern, cfg, args)
    return out


# ============================================================================ checking

def reference(A: Any, B: Any, layout: str) -> np.ndarray:
    """The float64 product op(A) op(B) on the host."""
    a = cb.to_numpy(A).astype(np.float64) if not _is_torch(A) else _f64(A)
    b = cb.to_numpy(B).astype(np.float64) if not _is_torch(B) else _f64(B)
    dims(layout, a.shape, b.shape)
    if layout == "nt":
        return a @ b.T
    if layout == "nn":
        return a @ b
    return a.T @ b


def _is_torch(x) -> bool:
    return cb.arrays.lib_of(x) == "torch"


def _f64(t) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def tolerance(A: Any, B: Any, layout: str, out_dtype: str) -> np.ndarray:
    """Per-element bound: one rounding of C plus sqrt(K) fp32 accumulation of |op(A)| |op(B)|."""
    absprod = np.abs(reference(_abs(A), _abs(B), layout))
    K = dims(layout, tuple(A.shape), tuple(B.shape))[2]
    u = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[out_dtype]
    return u * absprod + 4.0 * math.sqrt(K) * 2.0 ** -24 * absprod + 1e-30


def _abs(x):
    return x.abs() if _is_torch(x) else abs(x)


def sanitize_targets():
    """Each layout on a ragged shape (edge tiles zero-filled by TMA, guarded stores), and a split
    product (partials, tickets, the ordered sum) with both output types."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()   # noqa: E731
    for layout, (a, b) in {"nt": ((200, 72), (136, 72)), "nn": ((200, 72), (72, 136)),
                           "tn": ((72, 200), (72, 136))}.items():
        A, B = r(*a), r(*b)
        yield f"gemm_train_v2 {layout} 200 x 136 x 72", (lambda A=A, B=B, lt=layout:
                                                          gemm(A, B, lt))
    A, B = r(4096, 136), r(4096, 264)
    out = torch.empty(136, 264, device="cuda")
    yield "gemm_train_v2 tn split 136 x 264 x 4096 fp32", (lambda: gemm(A, B, "tn", out))
    yield "gemm_train_v2 tn split 136 x 264 x 4096 bf16", (lambda: gemm(A, B, "tn"))
