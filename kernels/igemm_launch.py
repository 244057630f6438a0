"""Launching kernels/igemm.cu: 8-bit GEMMs, C = A @ B^T.

    ig = cb.load_launch("igemm")
    C = ig.int8_matmul(A, B)                  # int8 (M, K), (N, K) -> int32 (M, N), igemm_v3
    C = ig.int8_matmul(A, B, version="v1")    # igemm_v1: dp4a on the CUDA cores
    D = ig.fp8_matmul(A8, B8, sa, sb)         # e4m3 (M, K), (N, K), float32 scalar scales on the
                                              # GPU -> bf16 (M, N) = (A @ B^T) * sa * sb
                                              # (fp8gemm_v3 on sm_90, fp8gemm_v2 on sm_89)

A and B are row-major (B in nn.Linear's layout: torch._int_mm(a, b) with b = B.t() is the
same product). CuPy arrays or torch CUDA tensors (int8; float8_e4m3fn for fp8, or their bytes
as uint8). K must be a multiple of 16 (16-byte rows); M and N any.

  VERSIONS, FP8_VERSIONS, WHAT, MIN_CC   the two ladders (a version is "igemm_v3" or "v3" for
                                int8_matmul, "fp8gemm_v3" or "v3" for fp8_matmul)
  config(version, M, N)         the launch record (grid, block, shared, kernel); ``sms`` (the
                                persistent grid of fp8gemm_v3) read from the GPU unless given
  int8_matmul, fp8_matmul       the entry points: check, pick the kernel, launch on the inputs'
                                stream, return C (a new array of the inputs' library by default)
  kernel_for(version)           the kernel that runs a version here (its FALLBACK where the
                                shared memory does not fit)
  module()                      igemm.cu whole (the entry points compile one step at a time)
  tensor_map(...)               a TMA descriptor of an 8-bit matrix (cudabook/tma.py)
  sanitize_targets()            each version on a ragged shape, for tools/sanitize.py

Checks, before anything reaches the GPU: 8-bit 2D C-contiguous GPU arrays, B (N, K) with A's K,
K % 16 == 0, 16-byte aligned starts, one float32 per scale, C of the right shape and dtype.
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
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

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


def _version(version: str) -> str:
    """A version of either ladder by its name; "vN" names an int8 one (igemm_vN)."""
    return version_name(VERSIONS + FP8_VERSIONS, version, "igemm")


def config(version: str, M: int, N: int, sms: int | None = None, fast: bool = False) -> Launch:
    """The launch record (grid, block, shared: dynamic shared bytes, kernel) of ``version``
    (igemm.cu's launch comment); ``sms``: the GPU's multiprocessors (the persistent grid of
    fp8gemm_v3; default: this GPU's, ``cb.launch.device()``), ``fast``: v3's fast-accumulation
    kernel."""
    version = _version(version)
    if version == "igemm_v1":
        return Launch((ceil_div(N, 64), ceil_div(M, 64)), (256,), kernel=version)
    if version in HOPPER:
        return _tma_config(TMA_KERNELS[bool(fast)][0], M, N, sms)
    bm, bn = TILES[version]
    return Launch((ceil_div(M, bm) * ceil_div(N, bn),), (256,), shared=STAGES * (bm + bn) * 128,
                  kernel=version)


def _tma_config(name: str, M: int, N: int, sms: int | None = None) -> Launch:
    """The launch record of fp8gemm_v3, its fast variant, or an instantiation ``name`` of their
    family, fp8gemm_tma_t<BN, STAGES, PERSIST, GROUP, EPI, PROMOTE> (parameters read from the
    name): 384 threads, a persistent grid of at most one block per SM; ``bn`` rides along."""
    _, bn, stages = TMA_KERNELS[name == TMA_KERNELS[True][0]]
    persist, epi = True, True
    if "<" in name:
        p = [x.strip() for x in name.split("<")[1].rstrip(">").split(",")]
        bn, stages, persist, epi = int(p[0]), int(p[1]), p[2] == "true", p[4] == "true"
    tiles = ceil_div(M, 128) * ceil_div(N, bn)
    if persist:
        tiles = max(1, min(tiles, cb.launch.device().sms if sms is None else sms))
    smem = stages * (128 + bn) * 128 + 1024 + (2 * 64 * (2 * bn + 16) if epi else 0)
    return Launch((tiles,), (384,), shared=smem, kernel=name, bn=bn)


def _optin() -> int:
    """This GPU's opt-in shared memory per block (``cb.launch.device().smem_optin``, bytes;
    48 KiB without a GPU). The one place igemm reads it: tests/test_small_gpus.py replaces it
    to plan for other GPUs' limits."""
    return cb.launch.device().smem_optin if cb.HAS_GPU else 48 * 1024


def kernel_for(version: str, optin: int | None = None) -> str:
    """The kernel that runs ``version`` on a GPU whose blocks may have ``optin`` bytes of shared
    memory (default: this GPU's; a plan for another GPU's limit too): the version's own, else
    its FALLBACK, else LaunchError naming the shared memory it needs."""
    version = _version(version)
    optin = _optin() if optin is None else optin
    smem = config(version, 1, 1, sms=1).shared
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
    """kernels/igemm.cu whole, compiled once per process (and kept in the kernel cache), with
    -arch=sm_90a on compute capability 9.0 (fp8gemm_v3's wgmma, TMA and setmaxnreg: the launch
    core's architecture rule); ``name_expressions``: template kernels to instantiate too
    (``fp8gemm_tma_t<BN, STAGES, PERSIST, GROUP>``, for probes)."""
    return cb.module("igemm", name_expressions=tuple(name_expressions) or None, a_features=True)


def _kernel(name: str):
    """The RawKernel ``name``, compiled with its ladder step alone (igemm.cu's step guards;
    fp8gemm_v3_fast is v3's step); a template instantiation (a probe's) with the whole file."""
    if "<" in name:
        return module((name,)).get(name)
    steps = tuple(dict.fromkeys((name.removesuffix("_fast"), name)))
    return cb.module("igemm", only=steps, a_features=True).get(name)


def tensor_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 128) -> np.void:
    """A TMA descriptor of a row-major (rows, cols) 8-bit matrix at ``ptr``: boxes of
    ``box_rows`` x ``box_cols`` bytes, 128-byte swizzle, zeros outside the matrix (the edge
    tiles); built by the book's one builder, ``cudabook/tma.py``."""
    return cb.tma.tensor_map(ptr, rows, cols, box_rows, box_cols, "uint8", swizzle=128)


def _bytes(a: Any, name: str, want: tuple[str, ...]):
    """The CuPy view (no copy) of an 8-bit matrix on the GPU (torch float8 tensors viewed as
    uint8), refused unless its dtype is one of ``want`` and it is 2D and C-contiguous."""
    if cb.arrays.lib_of(a) == "torch" and str(a.dtype) == "torch.float8_e4m3fn":
        import torch

        a = a.view(torch.uint8)
    c = cb.as_cupy(a, name)
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


def _launch(version, A, B, C, M, N, K, extra=(), arrays=()):
    """``version`` (or its FALLBACK, announced once) on the stream of ``arrays``' library."""
    name = kernel_for(version)
    if name != version and version not in _NOTED:
        _NOTED.add(version)
        print(f"note: {version} needs {config(version, 1, 1).shared // 1024} KiB of shared memory "
              f"per block, this GPU allows {_optin() // 1024} KiB: running {name} "
              f"({WHAT[name]}) instead")
    with cb.arrays.launch_stream(*arrays):
        cb.launch.run(_kernel(name), config(name, M, N),
                      (A, B, C, np.int32(M), np.int32(N), np.int32(K)) + extra)


def int8_matmul(A: Any, B: Any, C: Any = None, version: str = "igemm_v3"):
    """The int8 entry point: int32 C = A @ B^T of int8 A (M, K) and B (N, K); ``version``
    "igemm_v3" or "v3"; C (M, N) int32 is written and returned (default: a new array of A's
    library)."""
    version = version_name(VERSIONS, version, "igemm")
    _need(version)
    Ac, Bc = _bytes(A, "A", ("int8",)), _bytes(B, "B", ("int8",))
    M, N, K = _shapes(Ac, Bc)
    if C is None:
        C = cb.arrays.empty_like_lib(A, (M, N), "int32")
    cb.expect(C, "C", dtype=np.int32, shape=(M, N))
    _launch(version, Ac, Bc, cb.as_cupy(C, "C"), M, N, K, arrays=(A, B, C))
    return C


def default_fp8() -> str:
    """The fp8 version fp8_matmul runs by default: v3 on compute capability 9.0, else v2."""
    return "fp8gemm_v3" if cb.HAS_GPU and cb.cc() == (9, 0) else "fp8gemm_v2"


def fp8_matmul(A: Any, B: Any, scale_a: Any, scale_b: Any, C: Any = None,
               version: str | None = None, use_fast_accum: bool = False,
               kernel: str | None = None):
    """The fp8 entry point: bf16 C = (A @ B^T) * scale_a * scale_b of e4m3 A (M, K), B (N, K);
    fp32 accumulation. C (M, N), 2-byte (bf16 bits), is written and returned (default: a new
    torch bfloat16 tensor for torch inputs, else a CuPy uint16 array: CuPy has no bfloat16).

    ``version``: "fp8gemm_v2" or "v2" (default_fp8() when None). ``use_fast_accum``
    (fp8gemm_v3 only, as in torch._scaled_mm): keep the whole sum in the tensor cores'
    accumulator, whose fp8 sums carry fewer bits than fp32, instead of adding each 128-deep
    partial product into fp32 registers. v1/v2 (mma.sync) accumulate in fp32 either way.
    ``kernel``: for probes, an fp8gemm_tma_t<...> instantiation to run in v3's place
    (module(name_expressions))."""
    version = default_fp8() if version is None else version_name(FP8_VERSIONS, version, "fp8gemm")
    if cb.HAS_GPU and cb.cc() < (8, 9):
        raise LaunchError(f"fp8 (e4m3) tensor-core GEMM needs compute capability 8.9+ (Ada, "
                          f"Hopper); this GPU is {cb.cc()[0]}.{cb.cc()[1]}")
    _need(version)
    Ac, Bc = _bytes(A, "A", ("uint8",)), _bytes(B, "B", ("uint8",))
    M, N, K = _shapes(Ac, Bc)
    sa, sb = cb.as_cupy(scale_a, "scale_a"), cb.as_cupy(scale_b, "scale_b")
    for name, s in (("scale_a", sa), ("scale_b", sb)):
        cb.expect(s, name, dtype=np.float32)
        if s.size != 1:
            raise LaunchError(f"{name}: one float32 per tensor (per-tensor scaling), got "
                              f"{s.size} values")
    if C is None:
        C = cb.arrays.empty_like_lib(A, (M, N), "bfloat16") if cb.arrays.lib_of(A) == "torch" \
            else cb.arrays.empty_like_lib(A, (M, N), "uint16")
    c = cb.describe(C, "C")
    if c.shape != (M, N) or c.itemsize != 2:
        raise ValueError(f"C must be a 2-byte (bf16) ({M}, {N}) array, got {c.dtype} "
                         f"{c.shape}")
    if c.lib == "torch":                               # CuPy has no bfloat16: its bits
        import torch

        Cc = cb.as_cupy(C.view(torch.int16), "C")
    else:
        Cc = cb.as_cupy(C, "C")
    cb.expect(Cc, "C")
    if version in HOPPER:
        _launch_tma(kernel or TMA_KERNELS[bool(use_fast_accum)][0], Ac, Bc, Cc, M, N, K,
                    (sa, sb), arrays=(A, B, C))
    else:
        _launch(version, Ac, Bc, Cc, M, N, K, (sa, sb), arrays=(A, B, C))
    return C


def _launch_tma(name, A, B, C, M, N, K, extra, arrays=()):
    """fp8gemm_v3 (v3_fast), or an instantiation ``name`` of its family,
    fp8gemm_tma_t<BN, STAGES, PERSIST, GROUP, EPI, PROMOTE>: its launch record (a persistent grid
    of one block per SM, the shared memory of its ring of stages), then the two tensor maps."""
    cfg = _tma_config(name, M, N)
    cb.need_shared(cfg.shared, name, limit=_optin())
    ta = tensor_map(A.data.ptr, M, K, 128)          # boxes of 128 rows x 128 bytes of K
    tb = tensor_map(B.data.ptr, N, K, cfg.bn)       # BN rows x 128 bytes
    with cb.arrays.launch_stream(*arrays):
        cb.launch.run(_kernel(name), cfg,
                      (ta, tb, C, np.int32(M), np.int32(N), np.int32(K)) + extra)


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
