"""Launching kernels/igemm.cu: 8-bit GEMMs, C = A @ B^T.

    ig = cb.load_launch("igemm")
    C = ig.int8_matmul(A, B)                  # int8 (M, K), (N, K) -> int32 (M, N), igemm_v3
    C = ig.int8_matmul(A, B, version="igemm_v1")   # dp4a on the CUDA cores
    D = ig.fp8_matmul(A8, B8, sa, sb)         # e4m3 (M, K), (N, K), float32 scalar scales on the
                                              # GPU -> bf16 (M, N) = (A @ B^T) * sa * sb
                                              # (fp8gemm_v3 on sm_90, fp8gemm_v2 on sm_89)

A and B are row-major (B in nn.Linear's layout: torch._int_mm(a, b) with b = B.t() is the
same product). CuPy arrays or torch CUDA tensors (int8; float8_e4m3fn for fp8, or their bytes
as uint8). K must be a multiple of 16 (16-byte rows); M and N any.
Refused with a message: igemm_v2/v3 below compute capability 8.0 (int8 mma.sync m16n8k32),
fp8 below 8.9 (no fp8 tensor-core instructions: Ada and Hopper have them), fp8gemm_v3 anywhere
but compute capability 9.0 (wgmma, TMA and setmaxnreg: sm_90a; the module is compiled with
-arch=sm_90a there).
Shared memory: the 128x256 versions need 144 KiB per block; where the GPU allows less (the L4,
A10 and RTX 30/40 allow 99 KiB) they run their 128x128 step instead (FALLBACK, a printed note).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, smem_optin

__all__ = ["VERSIONS", "FP8_VERSIONS", "WHAT", "MIN_CC", "FALLBACK", "HOPPER", "int8_matmul",
           "fp8_matmul", "default_fp8", "module", "tensor_map", "config", "kernel_for",
           "sanitize_targets"]

VERSIONS = ("igemm_v1", "igemm_v2", "igemm_v3")
FP8_VERSIONS = ("fp8gemm_v1", "fp8gemm_v2", "fp8gemm_v3")
WHAT = {
    "igemm_v1": "dp4a, 64x64 tiles, 4x4 per thread",
    "igemm_v2": "mma.sync s8 m16n8k32, 128x128, 3-stage cp.async",
    "igemm_v3": "v2 with 128x256 tiles, 64x64 warp tiles",
    "fp8gemm_v1": "mma.sync e4m3 m16n8k32, 128x128",
    "fp8gemm_v2": "mma.sync e4m3, 128x256",
    "fp8gemm_v3": "wgmma e4m3 + TMA, warp-specialised, persistent, fp32 promotion, 128x128",
}
MIN_CC = {"igemm_v1": (6, 1), "igemm_v2": (8, 0), "igemm_v3": (8, 0), "fp8gemm_v1": (8, 9),
          "fp8gemm_v2": (8, 9), "fp8gemm_v3": (9, 0)}
TILES = {"igemm_v2": (128, 128), "igemm_v3": (128, 256), "fp8gemm_v1": (128, 128),
         "fp8gemm_v2": (128, 256), "fp8gemm_v3": (128, 128)}
STAGES = 3
#: Versions that exist only for compute capability 9.0 exactly (sm_90a: wgmma, setmaxnreg; not
#: on sm_100 and later), with their TMA pipeline: 384 threads (a producer and two consumer
#: warpgroups), a ring of stages of (128 + BN) x 128 bytes, a 64 x BN bf16 tile per consumer for
#: the epilogue (rows padded by 16 bytes), one block per SM walking the tiles.
HOPPER = ("fp8gemm_v3",)
#: fp8gemm_v3's kernels: (BN, stages) with fp32 promotion of each 128-deep partial product
#: (torch._scaled_mm's numerics), and without (``use_fast_accum=True``: the tensor cores' own,
#: shorter accumulator over the whole K).
TMA_KERNELS = {False: ("fp8gemm_v3", 128, 5), True: ("fp8gemm_v3_fast", 256, 3)}
#: The kernel a 128x256 version runs where its 144 KiB of shared memory do not fit: the step
#: below it, the same 3-stage pipeline on 128x128 tiles (96 KiB) with 64x32 warp tiles instead of
#: 64x64. Cost: a third more bytes from L2 per multiply-add ((BM + BN) / (BM BN): 1/64 against
#: 3/256) and more ldmatrix per mma in a warp (lesson 10 times both tile sizes; the numbers are
#: in reports/benchmarks.json, ch10).
FALLBACK = {"igemm_v3": "igemm_v2", "fp8gemm_v2": "fp8gemm_v1"}
_NOTED: set[str] = set()


def config(version: str, M: int, N: int, sms: int | None = None, fast: bool = False) -> Launch:
    """The launch record (grid, block, shared: dynamic shared bytes) of ``version`` (igemm.cu's
    launch comment); ``sms``: the GPU's multiprocessors (the persistent grid of fp8gemm_v3;
    default: this GPU's), ``fast``: v3's fast-accumulation kernel."""
    if version == "igemm_v1":
        return Launch((ceil_div(N, 64), ceil_div(M, 64)), (256,), kernel=version)
    if version in HOPPER:
        _, bn, stages = TMA_KERNELS[bool(fast)]
        tiles = ceil_div(M, 128) * ceil_div(N, bn)
        sms = _sms() if sms is None else sms
        return Launch((max(1, min(tiles, sms)),), (384,),
                      shared=stages * (128 + bn) * 128 + 1024 + 2 * 64 * (2 * bn + 16))
    if version in TILES:
        bm, bn = TILES[version]
        return Launch((ceil_div(M, bm) * ceil_div(N, bn),), (256,),
                      shared=STAGES * (bm + bn) * 128, kernel=version)
    raise ValueError(f"unknown version {version!r}; igemm.cu has {VERSIONS + FP8_VERSIONS}")


def _optin() -> int:
    """The most dynamic shared memory one block may opt into on this GPU (bytes)."""
    return smem_optin() or 48 * 1024


def kernel_for(version: str, optin: int | None = None) -> str:
    """The kernel that runs ``version`` on a GPU whose blocks may have ``optin`` bytes of shared
    memory (default: this GPU's): the version's own, else its FALLBACK, else LaunchError naming
    the shared memory it needs."""
    optin = _optin() if optin is None else optin
    smem = config(version, 1, 1).shared
    if smem <= optin:
        return version
    fb = FALLBACK.get(version)
    if fb is not None and config(fb, 1, 1).shared <= optin:
        return fb
    raise LaunchError(f"{version} needs {smem // 1024} KiB of shared memory per block, this GPU "
                      f"allows {optin // 1024} KiB")


def _need(version: str) -> None:
    major, minor = MIN_CC[version]
    cb.need_cc(major, minor, f"{version} ({WHAT[version]})")
    if version in HOPPER and cb.cc() != (9, 0):
        raise LaunchError(f"{version} ({WHAT[version]}) needs compute capability 9.0 exactly "
                          f"(wgmma and setmaxnreg are sm_90a features); this GPU is "
                          f"{cb.cc()[0]}.{cb.cc()[1]}: use fp8gemm_v2")


def module(name_expressions: tuple[str, ...] = ()):
    """kernels/igemm.cu compiled once per process (and kept in the kernel cache), with
    -arch=sm_90a on compute capability 9.0 (fp8gemm_v3's wgmma, TMA and setmaxnreg: the launch
    core's architecture rule); ``name_expressions``: template kernels to instantiate too
    (``fp8gemm_tma_t<BN, STAGES, PERSIST, GROUP>``, for probes)."""
    return cb.module("igemm", name_expressions=tuple(name_expressions) or None, a_features=True)


def tensor_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 128) -> np.void:
    """A TMA descriptor of a row-major (rows, cols) 8-bit matrix at ``ptr``: boxes of
    ``box_rows`` x ``box_cols`` bytes, 128-byte swizzle, zeros outside the matrix (the edge
    tiles); built by the book's one builder, ``cudabook/tma.py``."""
    return cb.tma.tensor_map(ptr, rows, cols, box_rows, box_cols, "uint8", swizzle=128)


def _sms() -> int:
    return cb.launch.device().sms


def _bytes(a: Any, name: str, want: tuple[str, ...]):
    """The CuPy view of an 8-bit matrix (torch float8 tensors viewed as uint8)."""
    if type(a).__module__.startswith("torch"):
        import torch

        if a.dtype in (torch.float8_e4m3fn,):
            a = a.view(torch.uint8)
    c = cb.load_launch("gemv").as_cupy(a, name)[0]
    if str(c.dtype) not in want:
        raise TypeError(f"{name}: expected {' or '.join(want)}, got {c.dtype}")
    cb.expect(c, name, ndim=2)
    return c


def _shapes(A, B) -> tuple[int, int, int]:
    (M, K), (N, K2) = (int(s) for s in A.shape), (int(s) for s in B.shape)
    if K != K2:
        raise ValueError(f"A is {M}x{K} and B is {N}x{K2}: B must be (N, K) (C = A @ B^T)")
    if min(M, N, K) < 1:
        raise LaunchError(f"empty problem M, N, K = {M}, {N}, {K}")
    if K % 16:
        raise LaunchError(f"K = {K} is not a multiple of 16: rows must be whole 16-byte chunks "
                          "(pad K with zeros)")
    for name, a in (("A", A), ("B", B)):
        if a.data.ptr % 16:
            raise LaunchError(f"{name}: not 16-byte aligned (a view at an offset? pass a copy)")
    return M, N, K


def _launch(mod, version, A, B, C, M, N, K, extra=()):
    name = kernel_for(version)
    if name != version and version not in _NOTED:
        _NOTED.add(version)
        print(f"note: {version} needs {config(version, 1, 1).shared // 1024} KiB of shared memory "
              f"per block, this GPU allows {_optin() // 1024} KiB: running {name} "
              f"({WHAT[name]}) instead")
    cb.launch.run(mod.get(name), config(name, M, N),
                  (A, B, C, np.int32(M), np.int32(N), np.int32(K)) + extra)


def int8_matmul(A: Any, B: Any, C: Any = None, version: str = "igemm_v3"):
    """int32 C = A @ B^T of int8 A (M, K) and B (N, K)."""
    import cupy as cp

    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; int8 kernels: {VERSIONS}")
    mod = module()
    _need(version)
    Ac, Bc = _bytes(A, "A", ("int8",)), _bytes(B, "B", ("int8",))
    M, N, K = _shapes(Ac, Bc)
    if C is None:
        C = cp.empty((M, N), cp.int32)
    cb.expect(C, "C", dtype=np.int32, shape=(M, N))
    _launch(mod, version, Ac, Bc, C, M, N, K)
    return C


def default_fp8() -> str:
    """The fp8 version fp8_matmul runs by default: v3 on compute capability 9.0, else v2."""
    return "fp8gemm_v3" if cb.HAS_GPU and cb.cc() == (9, 0) else "fp8gemm_v2"


def fp8_matmul(A: Any, B: Any, scale_a: Any, scale_b: Any, C: Any = None,
               version: str | None = None, use_fast_accum: bool = False,
               kernel: str | None = None):
    """bf16 C = (A @ B^T) * scale_a * scale_b of e4m3 A (M, K), B (N, K); fp32 accumulation.

    ``version``: default_fp8() when None. ``use_fast_accum`` (fp8gemm_v3 only, as in
    torch._scaled_mm): keep the whole sum in the tensor cores' accumulator, whose fp8 sums carry
    fewer bits than fp32, instead of adding each 128-deep partial product into fp32 registers.
    v1/v2 (mma.sync) accumulate in fp32 either way. ``kernel``: for probes, an
    fp8gemm_tma_t<...> instantiation to run in v3's place (module(name_expressions))."""
    import cupy as cp

    version = default_fp8() if version is None else version
    if version not in FP8_VERSIONS:
        raise ValueError(f"unknown version {version!r}; fp8 kernels: {FP8_VERSIONS}")
    if cb.HAS_GPU and cb.cc() < (8, 9):
        raise LaunchError(f"fp8 (e4m3) tensor-core GEMM needs compute capability 8.9+ (Ada, "
                          f"Hopper); this GPU is {cb.cc()[0]}.{cb.cc()[1]}")
    _need(version)
    mod = module((kernel,) if kernel else ())
    Ac, Bc = _bytes(A, "A", ("uint8",)), _bytes(B, "B", ("uint8",))
    M, N, K = _shapes(Ac, Bc)
    gv = cb.load_launch("gemv")
    sa, sb = gv.as_cupy(scale_a, "scale_a")[0], gv.as_cupy(scale_b, "scale_b")[0]
    for name, s in (("scale_a", sa), ("scale_b", sb)):
        cb.expect(s, name, dtype=np.float32)
        if s.size != 1:
            raise LaunchError(f"{name}: one float32 per tensor (per-tensor scaling), got "
                              f"{s.size} values")
    if C is None:
        C = cp.empty((M, N), dtype=cp.uint16)          # bf16 bits (CuPy has no bfloat16)
    Cc = gv.as_cupy(C, "C")[0] if not type(C).__module__.startswith("torch") else \
        cp.asarray(C.view(__import__("torch").int16))
    if Cc.shape != (M, N) or Cc.dtype.itemsize != 2:
        raise ValueError(f"C must be a 2-byte (bf16) ({M}, {N}) array, got {Cc.dtype} "
                         f"{tuple(Cc.shape)}")
    if version in HOPPER:
        _launch_tma(mod, kernel or TMA_KERNELS[bool(use_fast_accum)][0], Ac, Bc, Cc, M, N, K,
                    (sa, sb))
    else:
        _launch(mod, version, Ac, Bc, Cc, M, N, K, (sa, sb))
    return C


def _launch_tma(mod, name, A, B, C, M, N, K, extra):
    """fp8gemm_v3, or an instantiation ``name`` of its family,
    fp8gemm_tma_t<BN, STAGES, PERSIST, GROUP, EPI, PROMOTE> (its parameters read from the name)."""
    fast = name == TMA_KERNELS[True][0]
    _, bn, stages = TMA_KERNELS[fast]
    persist, epi = True, True
    if "<" in name:
        p = [x.strip() for x in name.split("<")[1].rstrip(">").split(",")]
        bn, stages, persist, epi = int(p[0]), int(p[1]), p[2] == "true", p[4] == "true"
    tiles = ceil_div(M, 128) * ceil_div(N, bn)
    grid, block = ((max(1, min(tiles, _sms())) if persist else tiles),), (384,)
    smem = stages * (128 + bn) * 128 + 1024 + (2 * 64 * (2 * bn + 16) if epi else 0)
    if smem > _optin():
        raise LaunchError(f"{name} needs {smem // 1024} KiB of shared memory per block, this GPU "
                          f"allows {_optin() // 1024} KiB")
    kern = mod.get(name)
    kern.max_dynamic_shared_size_bytes = smem
    ta = tensor_map(A.data.ptr, M, K, 128)
    tb = tensor_map(B.data.ptr, N, K, bn)
    kern(grid, block, (ta, tb, C, np.int32(M), np.int32(N), np.int32(K)) + extra,
         shared_mem=smem)


def bf16_to_float(c) -> Any:
    """bf16 bits (uint16/int16 CuPy) -> float32: the upper half of a float32."""
    import cupy as cp

    return (c.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)


def sanitize_targets():
    """Each version on ragged M, N and a K of one partial tile."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    M, N, K = 130, 70, 160
    A = rng.integers(-128, 128, (M, K), dtype=cp.int8)
    B = rng.integers(-128, 128, (N, K), dtype=cp.int8)
    for v in VERSIONS:
        if cb.cc() >= MIN_CC[v]:
            yield f"{v} ({M}x{N}x{K})", (lambda v=v: int8_matmul(A, B, version=v))
    if cb.cc() >= (8, 9):
        A8 = rng.integers(0, 0x70, (M, K), dtype=cp.uint8)        # finite e4m3 bytes
        B8 = rng.integers(0, 0x70, (N, K), dtype=cp.uint8)
        one = cp.ones(1, cp.float32)
        for v in FP8_VERSIONS:
            if v not in HOPPER or cb.cc() == (9, 0):
                yield f"{v} ({M}x{N}x{K})", (lambda v=v: fp8_matmul(A8, B8, one, one, version=v))
