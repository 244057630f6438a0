"""kernels/hgemm_launch.py: the launch helpers of kernels/hgemm.cu (Chapter 8): C = A @ B^T on the tensor cores.

A is (M, K), B is (N, K) (nn.Linear's weight layout: ``y = x @ W.T``), C is (M, N); fp16 (or
bf16), row-major, contiguous; products accumulated in fp32, C rounded once.

Numba's Python has no tensor-core API: no WMMA, no ``mma.sync``, no ``wgmma`` and no inline PTX (a
Numba kernel can reach them only by calling a CUDA C++ or PTX device function through
``cuda.declare_device`` and ``link=``), so this chapter has no Numba twins. The interop route
instead: ``matmul``/``launch`` take CuPy arrays, PyTorch CUDA tensors (fp16 and bf16) and Numba
device arrays alike, read their device pointers (no copy) and launch on the stream their library
is using (``cudabook.arrays``).

  VERSIONS, WHAT, MIN_CC        the ladder, one line per step, and the architecture each needs
                                (a version is "v9" or "hgemm_v9")
  config(version, M, N, K)      the launch record (grid, block, shared, kernel) of a launch (a
                                smaller variant where the GPU's shared memory is too small:
                                FALLBACKS); sms/optin/cc are arguments, read from the GPU when
                                there is one
  matmul(A, B, version)         the entry point: pads K to a multiple of 8 if needed, returns C
  launch(mod, version, A, B, C) check, then launch into C (tensor maps built for v8/v9 on Hopper);
                                ``mod`` None compiles only the launched kernel (kernel_module)
  check_operands(A, B, C)       dtype / shape / layout / alignment / device checks, clear errors
  require(version, cc, dtype)   refuse a version the GPU cannot run, naming the minimum cc or the
                                shared memory it needs
  runnable(cc)                  the versions this GPU can run, with the reason for each other
  load(cc)                      hgemm.cu whole, compiled for this GPU (-arch=sm_90a on Hopper)
  tensor_map(...)               a TMA descriptor (cudabook/tma.py, the book's one builder)
  autotune(n, candidates)       v9: time the template's candidates against cuBLAS, keep the best
  tolerance(A, B, K, dtype)     the per-element error bound of fp32 accumulation (check())
  sanitize_targets()            the shared-memory versions on a ragged shape, for tools/sanitize.py
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10")

#: what each step changes (one line each, for tables and plots)
WHAT = {
    "v1": "WMMA, fragments from global memory",
    "v2": "WMMA, 128x128 shared-memory tiles",
    "v3": "mma.sync + ldmatrix (PTX)",
    "v4": "+ XOR swizzle (no bank conflicts)",
    "v5": "+ cp.async 3-stage pipeline",
    "v6": "+ 64x64 warp tiles, register double buffer",
    "v7": "wgmma from shared memory (cp.async loads)",
    "v8": "TMA + mbarriers + warp specialisation",
    "v9": "autotuned final version",
    "v10": "v6 rebuilt: lean loop, early copies, staged C",
}

#: the lowest compute capability each version runs on
MIN_CC = {"v1": (7, 0), "v2": (7, 0), "v3": (7, 5), "v4": (7, 5), "v5": (8, 0), "v6": (8, 0),
          "v7": (9, 0), "v8": (9, 0), "v9": (7, 5), "v10": (8, 0)}
#: versions built from sm_90a instructions (wgmma, setmaxnreg): Hopper (cc 9.0) only, since wgmma
#: exists on no other target (Blackwell has tcgen05 instead; TMA and setmaxnreg it keeps)
HOPPER_ONLY = ("v7", "v8")
#: versions with a bf16 kernel (bf16 tensor-core instructions start at cc 8.0)
BF16 = ("v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10")

#: block tiles (rows, cols of C), threads and stages of the fixed versions
_FIXED = {"v3": (128, 128, 256, 1), "v4": (128, 128, 256, 1), "v5": (128, 128, 256, 3),
          "v6": (128, 256, 256, 3), "v7": (128, 128, 256, 4), "v8": (128, 256, 384, 4),
          "v10": (128, 256, 256, 3)}
BK = 64
MAX_STATIC_SHARED = 48 * 1024

#: v9's defaults per architecture before (or without) autotuning
DEFAULT_SM90 = dict(BN=256, STAGES=4, PERSIST=1)
#: hgemm_mma_t (the template of v3-v6): sm_80+ and sm_75 defaults
DEFAULT_SM80 = dict(BM=128, BN=256, WM=64, WN=64, STAGES=3, DBUF=1, GROUP=8)
DEFAULT_SM75 = dict(BM=128, BN=128, WM=64, WN=32, STAGES=1, DBUF=0, GROUP=8)
#: hgemm_mma10_t (the template of v10, 8 warps of 64 x 64): v9's default on sm_80+ off Hopper
DEFAULT_MMA10 = dict(BM=128, BN=256, STAGES=3, EPI=1, GROUP=8)

#: The most dynamic shared memory one block may opt into (``sharedMemPerBlockOptin``, bytes):
#: v6 and v10 (and v9's default on sm_80+) need 144 KiB (3 stages of 128 x 256 x 64 tiles).
SMEM_OPTIN = {"T4 (7.5)": 64 * 1024, "L4, A10, RTX 30/40 (8.6, 8.9)": 99 * 1024,
              "A100 (8.0)": 163 * 1024, "H100 (9.0)": 227 * 1024}
#: hgemm_mma10_t's smallest STAGES (the static_assert of gemm_mma10 in hgemm.cu)
MMA10_MIN_STAGES = 3
#: What config() launches when a version's own kernel needs more shared memory than the GPU
#: allows (the L4, A10 and RTX 30/40 allow 99 KiB), tried in order; each is an instantiation of
#: the version's own template, launched under its name with a one-time printed note.
#:   v6: hgemm_mma_t on 128 x 128 tiles, 4 warps of 64 x 64, 3 stages, register double buffer,
#:       groups of 8 (96 KiB): v6's warp tiles and pipeline at half its block width, so a
#:       third more bytes come from L2 per flop ((BM + BN) / (BM BN): 1/64 against 3/256) and
#:       a block has 4 warps instead of 8 (one 96 KiB block per SM on sm_86/89: 4 warps per
#:       SM to hide latency). The shape is CUTLASS's usual sm_80 tile (128 x 128 x 64, 3 stages).
#:   v10: 2 stages (96 KiB): the copies of tile k+1 are issued at the start of tile k and waited
#:       for at its last k-slice (3/4 of a tile of math to hide them, instead of 1 3/4). Offered
#:       only when hgemm.cu's gemm_mma10 accepts STAGES = 2 (MMA10_MIN_STAGES); until then v10
#:       is refused on such GPUs with a message naming the 144 KiB it needs.
#: tools/dev/small_gpu_probe.py times both fallbacks against their full-size versions and cuBLAS
#: fp16 in one run (v10 with 2 stages from a patched copy of hgemm.cu, checked on ragged and
#: interior shapes, fp16 and bf16). On a GPU that holds two 96 KiB blocks per SM (an H100) its
#: numbers are not those of an L4, which holds one.
FALLBACKS = {"v6": [dict(BM=128, BN=128, WM=64, WN=64, STAGES=3, DBUF=1, GROUP=8)],
             "v10": [dict(BM=128, BN=256, STAGES=2, EPI=1, GROUP=8)]}

_TUNED: dict[tuple, dict] = {}   # (cc, dtype) -> the parameters autotune() found best


class UnsupportedError(LaunchError):
    """This GPU lacks the instructions a kernel needs (the message names the minimum cc)."""


# ============================================================================ operands

_DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def check_operands(A: Any, B: Any, C: Any | None = None) -> tuple[int, int, int, str]:
    """(M, N, K, dtype) of C = A @ B^T, or TypeError/ValueError saying what is wrong.

    A (M, K) and B (N, K) must live on the GPU, share a 16-bit dtype (float16 or bfloat16) and
    be C-contiguous with 16-byte aligned starts; K must be a multiple of 8 (16-byte rows:
    ``matmul`` pads it). C (M, N) has their dtype and a 4-byte aligned start.
    """
    ops = []
    for x, name in ((A, "A"), (B, "B"), (C, "C")):
        if x is None:
            continue
        o = cb.describe(x, name) if hasattr(x, "shape") else None    # the launch core's view
        # on the GPU (a NumPy array only in simulator mode, where shapes are checked without one)
        if o is None or not (o.on_device or (o.lib == "numpy" and not cb.HAS_GPU)):
            raise TypeError(f"{name}: expected a GPU array (CuPy, PyTorch CUDA tensor, Numba "
                            f"device array), got {type(x).__module__}.{type(x).__name__}"
                            + ("" if o is None else " on the host: move it with "
                               "cupy.asarray(...) or .to('cuda')"))
        ops.append(o)
        if len(o.shape) != 2:
            raise ValueError(f"{o.name}: expected a 2D matrix, got shape {o.shape}")
        if o.dtype not in _DTYPES:
            raise TypeError(f"{o.name}: dtype {o.dtype} is not supported: the tensor-core kernels "
                            "take float16 or bfloat16 (convert with .astype(cupy.float16) or "
                            ".half() / .bfloat16())")
        if not o.contiguous:
            raise ValueError(f"{o.name}: expected a C-contiguous matrix (a strided view would be "
                             "read as if it were dense); pass a contiguous copy")
    a, b = ops[0], ops[1]
    if a.dtype != b.dtype:
        raise TypeError(f"A is {a.dtype} but B is {b.dtype}: both inputs must have one dtype")
    (M, K), (N, K2) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"A is {M}x{K} and B is {N}x{K2}: B must be (N, K) (C = A @ B^T, B in "
                         "nn.Linear's weight layout), so their second dimensions must match")
    if min(M, N, K) < 1:
        raise ValueError(f"empty problem M, N, K = {M}, {N}, {K}")
    if K % 8:
        raise ValueError(f"K = {K} is not a multiple of 8: rows of A and B must be 16-byte "
                         "multiples for 16-byte loads, cp.async and TMA. hgemm.matmul() pads K "
                         "with zeros (one copy of A and B)")
    for o in (a, b):
        if o.ptr % 16:
            raise ValueError(f"{o.name}: its data starts at an address that is not 16-byte "
                             f"aligned (0x{o.ptr:x}): a view at an odd offset? Pass a fresh copy")
    if C is not None:
        c = ops[2]
        if c.dtype != a.dtype:
            raise TypeError(f"C is {c.dtype} but the inputs are {a.dtype}: C must match them")
        if c.shape != (M, N):
            raise ValueError(f"C must be {M}x{N} (M x N), got {c.shape}")
        if c.ptr % 4:
            raise ValueError(f"C: its data is not 4-byte aligned (0x{c.ptr:x})")
    return M, N, K, a.dtype


def require(version: str, cc: tuple[int, int], dtype: str = "float16",
            optin: int | None = None, params: dict | None = None) -> None:
    """Raise ``UnsupportedError`` (naming the minimum compute capability, or the shared memory
    needed) unless ``version`` with ``dtype`` inputs runs on a GPU of compute capability ``cc``
    that lets a block opt into ``optin`` bytes of shared memory (default: this GPU's, when ``cc``
    is its compute capability; not checked without a GPU); ``params``: v9's, if not its own."""
    version = version_name(VERSIONS, version, "hgemm")
    need = MIN_CC[version]
    if version in HOPPER_ONLY and tuple(cc) != (9, 0):
        raise UnsupportedError(
            f"hgemm_{version} needs compute capability 9.0 exactly (Hopper, sm_90a: wgmma, TMA, "
            f"setmaxnreg); this GPU is {cc[0]}.{cc[1]}. The sm_90a instructions exist on no other "
            "architecture: use v6 (cc 8.0+) or v9, which picks its family for your GPU")
    if tuple(cc) < need:
        raise UnsupportedError(f"hgemm_{version} needs compute capability {need[0]}.{need[1]} or "
                               f"newer ({WHAT[version]}); this GPU is {cc[0]}.{cc[1]}")
    if dtype == "bfloat16":
        if version not in BF16:
            raise UnsupportedError(f"hgemm_{version} has no bf16 kernel (WMMA versions are fp16 "
                                   f"only); bf16 versions: {', '.join(BF16)}")
        if tuple(cc) < (8, 0):
            raise UnsupportedError(f"bf16 tensor-core instructions need compute capability 8.0 "
                                   f"or newer; this GPU is {cc[0]}.{cc[1]}")
    if optin is None:
        optin = _smem_optin(cc)
    if optin is not None:
        need = config(version, 1, 1, 8, cc, params, sms=1, dtype=dtype, optin=optin)["shared"]
        if need > optin:
            raise UnsupportedError(_smem_message(version, need, optin))


def _smem_message(version: str, need: int, optin: int) -> str:
    """Why ``version`` cannot launch: the shared memory it needs and the GPU allows (the first
    clause says both: the lesson prints the message up to its first semicolon)."""
    why = (f"its template needs {MMA10_MIN_STAGES} or more stages of 128 x 256 x 64 tiles "
           "(hgemm.cu's gemm_mma10)" if version == "v10"
           else "fewer stages or smaller tiles would fit")
    return (f"hgemm_{version} needs {need // 1024} KiB of shared memory per block, this GPU "
            f"allows {optin // 1024} KiB; {why} (per block: H100 227 KiB, A100 163, L4 / A10 / "
            "RTX 30-40 99, T4 64). v9 picks tiles that fit")


def runnable(cc: tuple[int, int] | None = None, dtype: str = "float16",
             quiet: bool = False) -> list[str]:
    """The versions a GPU of compute capability ``cc`` (default: this one) runs with ``dtype``
    inputs, in ladder order; each other version is printed with the reason (unless ``quiet``)."""
    cc = tuple(cc or cb.cc())
    names = []
    for v in VERSIONS:
        try:
            require(v, cc, dtype)
        except UnsupportedError as e:
            if not quiet:
                print(f"{v}: skipped: {e}")
            continue
        names.append(v)
    return names


# ============================================================================ configuration

def v9_family(cc: tuple[int, int], params: dict | None = None) -> str:
    """The template family v9 instantiates: "tma" (hgemm_tma_t) or "mma" (mma.sync: hgemm_mma_t,
    or hgemm_mma10_t for a parameter set with EPI). Given parameters say which (a tma set has
    PERSIST); without, the architecture decides (tma on cc 9.0, the only one with wgmma)."""
    if params is not None:
        return "tma" if "PERSIST" in params else "mma"
    return "tma" if tuple(cc) == (9, 0) else "mma"


def v9_params(cc: tuple[int, int], dtype: str = "float16", params: dict | None = None,
              optin: int | None = None) -> dict:
    """v9's parameters: ``params``, else what autotune() found here, else the defaults; where
    the default needs more shared memory than ``optin`` (default: this GPU's opt-in limit) the
    first candidate() that fits (on an L4: 128 x 128 tiles, 96 KiB, see FALLBACKS)."""
    if params is not None:
        return dict(params)
    if (tuple(cc), dtype) in _TUNED:
        return dict(_TUNED[(tuple(cc), dtype)])
    if (tuple(cc), "float16") in _TUNED:
        return dict(_TUNED[(tuple(cc), "float16")])
    if v9_family(cc) == "tma":
        d = DEFAULT_SM90
    else:
        d = DEFAULT_MMA10 if tuple(cc) >= (8, 0) else DEFAULT_SM75
    if optin is None:
        optin = _smem_optin(cc)
    if optin is not None and params_shared(d) > optin:
        fit = [c for c in candidates(cc, optin=optin) if params_shared(c) <= optin]
        if fit:
            return dict(fit[0])
    return dict(d)


def _family(cc: tuple[int, int], dtype: str, params: dict | None,
            optin: int | None = None) -> tuple[str, dict]:
    p = v9_params(cc, dtype, params, optin)
    return v9_family(cc, p), p


def params_shared(p: dict) -> int:
    """Dynamic shared memory (bytes) of one block of a template instantiation."""
    if "PERSIST" in p:
        return p["STAGES"] * (128 + p["BN"]) * BK * 2 + 1024
    return p["STAGES"] * (p["BM"] + p["BN"]) * BK * 2


def variants(version: str) -> list[dict | None]:
    """The configurations config() may launch for a fixed version, in order of preference: None
    (its own kernel), then FALLBACKS that hgemm.cu can instantiate."""
    fb = [p for p in FALLBACKS.get(version, ())
          if "EPI" not in p or p["STAGES"] >= MMA10_MIN_STAGES]
    return [None, *fb]


def template_name(family: str, p: dict, dtype: str = "float16") -> str:
    """The C++ name of one instantiation (CuPy name expression)."""
    t = _DTYPES[dtype]
    b = lambda x: "true" if x else "false"   # noqa: E731
    if family == "tma":
        return f"hgemm_tma_t<{p['BN']}, {p['STAGES']}, {b(p['PERSIST'])}, {t}>"
    if "EPI" in p:
        return (f"hgemm_mma10_t<{p['BM']}, {p['BN']}, {p['STAGES']}, {b(p['EPI'])}, "
                f"{p['GROUP']}, {t}>")
    return (f"hgemm_mma_t<{p['BM']}, {p['BN']}, {p['WM']}, {p['WN']}, {p['STAGES']}, "
            f"{b(p['DBUF'])}, {p['GROUP']}, {t}>")


def check_params(family: str, p: dict) -> None:
    """ValueError naming the rule a v9 parameter set breaks."""
    if family == "tma":
        if set(p) != set(DEFAULT_SM90):
            raise ValueError(f"tma parameters are {sorted(DEFAULT_SM90)}, got {sorted(p)}")
        if p["BN"] not in (64, 128, 256):
            raise ValueError("BN must be 64, 128 or 256 (the wgmma wrappers of mma.cuh)")
        if not 2 <= p["STAGES"] <= 8:
            raise ValueError("STAGES must be 2..8")
        return
    if "EPI" in p:                       # hgemm_mma10_t: 8 warps of 64 x 64
        if set(p) != set(DEFAULT_MMA10):
            raise ValueError(f"mma10 parameters are {sorted(DEFAULT_MMA10)}, got {sorted(p)}")
        if (p["BM"], p["BN"]) not in ((128, 256), (256, 128)):
            raise ValueError(f"{p}: BM x BN must be 128 x 256 or 256 x 128 (8 warps of 64 x 64)")
        if p["STAGES"] < MMA10_MIN_STAGES or p["GROUP"] < 1:
            raise ValueError(f"{p}: STAGES >= {MMA10_MIN_STAGES} (hgemm.cu's gemm_mma10) and "
                             "GROUP >= 1")
        return
    if set(p) != set(DEFAULT_SM80):
        raise ValueError(f"mma parameters are {sorted(DEFAULT_SM80)} (or {sorted(DEFAULT_MMA10)}"
                         f" for v10's template), got {sorted(p)}")
    bm, bn, wm, wn = p["BM"], p["BN"], p["WM"], p["WN"]
    threads = (bm // wm) * (bn // wn) * 32 if wm and wn else 0
    rules = [(bm % wm == 0 and bn % wn == 0, "the warp tile WMxWN must divide BMxBN"),
             (wm % 16 == 0 and wn % 16 == 0, "WM and WN must be multiples of 16"),
             (32 <= threads <= 1024, "a block must have 1..32 warps"),
             (threads and (bm * 8) % threads == 0 and (bn * 8) % threads == 0,
              "the 16-byte chunks of a tile (8 per row) must divide among the threads"),
             (p["STAGES"] >= 1, "STAGES >= 1"), (p["GROUP"] >= 1, "GROUP >= 1"),
             (not p["DBUF"] or p["STAGES"] == 1 or p["STAGES"] >= 3,
              "register double buffering (DBUF=1) needs STAGES >= 3 (or 1, where it is off)")]
    for ok, why in rules:
        if not ok:
            raise ValueError(f"{p}: {why}")


def shared_bytes(version: str, cc: tuple[int, int] = (9, 0), params: dict | None = None,
                 dtype: str = "float16") -> int:
    """Dynamic shared memory of one block (bytes)."""
    version = version_name(VERSIONS, version, "hgemm")
    if version in ("v1", "v2"):
        return 0
    if version == "v9":
        return params_shared(v9_params(cc, dtype, params))
    bm, bn, _, stages = _FIXED[version]
    extra = 1024 if version in HOPPER_ONLY else 0
    return stages * (bm + bn) * BK * 2 + extra


def _threads(p: dict) -> int:
    """Threads of a block of an mma.sync template instantiation (v10's: 8 warps)."""
    return 256 if "EPI" in p else (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32


def config(version: str, M: int, N: int, K: int, cc: tuple[int, int] = (9, 0),
           params: dict | None = None, sms: int | None = None, dtype: str = "float16",
           optin: int | None = None) -> Launch:
    """The launch record (grid, block, shared, kernel; v9 and fallbacks: params) of a launch;
    ``sms`` sizes v9's persistent grid (default: this GPU's SM count, ``cb.launch.device()``;
    without a GPU it must be given).

    ``optin``: the shared memory a block may have (default: this GPU's when ``cc`` is its
    compute capability, else unlimited). A fixed version whose kernel needs more launches the
    first of its FALLBACKS that fits (v6 on an L4: 128 x 128 tiles; the entry "fallback" says
    so); v9's defaults are chosen to fit. When nothing fits, the version's own configuration is
    returned and launch() refuses it with the shared memory it needs."""
    version = version_name(VERSIONS, version, "hgemm")
    if optin is None:
        optin = _smem_optin(cc)
    if version == "v1":
        return Launch((ceil_div(N, 32), ceil_div(M, 32)), (128,), kernel="hgemm_v1")
    if version == "v2":
        return Launch((ceil_div(N, 128), ceil_div(M, 128)), (256,), kernel="hgemm_v2")
    if version == "v9":
        fam, p = _family(cc, dtype, params, optin)
        check_params(fam, p)
        if fam == "tma":
            tiles = ceil_div(M, 128) * ceil_div(N, p["BN"])
            if p["PERSIST"] and sms is None:
                if not cb.HAS_GPU:
                    raise ValueError("config: v9's persistent grid is one block per SM: pass sms= "
                                     "(there is no GPU here to read it from)")
                sms = cb.launch.device().sms
            return Launch((min(tiles, sms) if p["PERSIST"] else tiles,), (384,),
                          shared=shared_bytes("v9", cc, p), kernel=template_name("tma", p, dtype),
                          params=p)
        return Launch((ceil_div(M, p["BM"]) * ceil_div(N, p["BN"]),), (_threads(p),),
                      shared=shared_bytes("v9", cc, p), kernel=template_name("mma", p, dtype),
                      params=p)
    bm, bn, threads, _ = _FIXED[version]
    own = shared_bytes(version)
    if optin is not None and own > optin:
        for p in variants(version)[1:]:
            if params_shared(p) > optin:
                continue
            return Launch((ceil_div(M, p["BM"]) * ceil_div(N, p["BN"]),), (_threads(p),),
                          shared=params_shared(p), kernel=template_name("mma", p, dtype), params=p,
                          fallback=f"hgemm_{version} needs {own // 1024} KiB of shared memory per "
                                   f"block, this GPU allows {optin // 1024} KiB: running "
                                   f"{params_label(p)} ({params_shared(p) // 1024} KiB) instead")
    sfx = "_bf16" if dtype == "bfloat16" else ""
    return Launch((ceil_div(M, bm) * ceil_div(N, bn),), (threads,), shared=own,
                  kernel=f"hgemm_{version}{sfx}")


# ============================================================================ compiling

def load(cc: tuple[int, int] | None = None, name_expressions: tuple[str, ...] = ()):
    """kernels/hgemm.cu whole, with v9's template instantiations (default: v9's and the
    fallbacks config() picks on a GPU of compute capability ``cc``, default this one), compiled
    for this GPU once per process (and kept in the kernel cache; -arch=sm_90a on Hopper: the
    launch core's rule). Launches with ``mod=None`` compile less: ``kernel_module``."""
    cc = tuple(cc or cb.cc())
    exprs = tuple(name_expressions) or _default_exprs(cc)
    return _tag(cb.module("hgemm", a_features=True, name_expressions=exprs), cc, exprs)


def kernel_module(name: str, cc: tuple[int, int] | None = None):
    """The module holding kernel ``name`` alone: a template instantiation (``hgemm_tma_t<...>``)
    by its name expression with every ladder step left out (``only`` names no step of the
    file: the templates cost nothing until named), a fixed version's kernels by the file's step
    guard (``hgemm_v3_bf16``: ``-DCB_ONLY_hgemm_v3``). What a launch compiles the first time."""
    cc = tuple(cc or cb.cc())
    if "<" in name:
        mod = cb.module("hgemm", a_features=True, only="hgemm_templates", name_expressions=(name,))
        return _tag(mod, cc, (name,))
    step = re.match(r"(hgemm_v\d+|mma_layout_probe|mma_peak)", name)
    if step is None:
        raise ValueError(f"hgemm.cu has no kernel {name!r}")
    tok = "hgemm_probe" if step.group(1).startswith("mma_") else step.group(1)
    return _tag(cb.module("hgemm", a_features=True, only=tok), cc, ())


def _tag(mod, cc: tuple[int, int], exprs: tuple[str, ...]):
    """What launch() reads from a module: the cc it plans for, whether it was compiled for
    sm_90a (``cudabook.compile.arch_options``, the rule cb.module applied), its instantiations."""
    mod.cc, mod.sm90a, mod.exprs = cc, cb.compile.arch_options(True) != (), exprs
    return mod


def _default_exprs(cc: tuple[int, int]) -> tuple[str, ...]:
    """v9's default instantiations, and the fallbacks config() picks on this GPU (one compile)."""
    dts = ("float16", "bfloat16") if tuple(cc) >= (8, 0) else ("float16",)
    names = [template_name(*_family(cc, d, None), d) for d in dts]
    for v in FALLBACKS:
        if tuple(cc) >= MIN_CC[v]:
            names += [config(v, 1, 1, 8, cc, dtype=d)["kernel"] for d in dts]
    return tuple(dict.fromkeys(n for n in names if "<" in n))


# ============================================================================ TMA descriptors

def tensor_map(ptr: int, rows: int, cols: int, box_rows: int, dtype: str = "float16",
               box_cols: int = BK) -> np.void:
    """A TMA descriptor of a row-major (rows, cols) 16-bit matrix at ``ptr``: boxes of
    ``box_rows`` x ``box_cols`` (64 values: 128 bytes), 128-byte swizzle, zeros outside the
    matrix. Encoded by the driver (``cudabook/tma.py``, the book's one builder) and passed by
    value to a ``const __grid_constant__ TmaDesc`` kernel parameter."""
    return cb.tma.tensor_map(ptr, rows, cols, box_rows, box_cols, dtype, swizzle=128)


# ============================================================================ launching

def launch(mod, version: str, A: Any, B: Any, C: Any, params: dict | None = None) -> Launch:
    """Check the operands and the GPU, then launch ``version`` computing C = A @ B^T (what
    matmul() runs; K must already be a multiple of 8). Returns the launch record.

    ``mod``: a module from load(), or None: the launch compiles the one kernel it needs
    (``kernel_module``, once per process and machine). ``version``: "v9" or "hgemm_v9".
    Refuses (UnsupportedError) a version this GPU cannot run, and (TypeError/ValueError) bad
    operands, before anything reaches the GPU.
    """
    version = version_name(VERSIONS, version, "hgemm")
    M, N, K, dtype = check_operands(A, B, C)
    cc = tuple(getattr(mod, "cc", None) or cb.cc())
    require(version, cc, dtype, params=params)
    fam = _family(cc, dtype, params)[0] if version == "v9" else None
    if fam == "tma" and cc != (9, 0):
        raise UnsupportedError(f"v9's tma family (wgmma, TMA) needs compute capability 9.0 "
                               f"exactly; this GPU is {cc[0]}.{cc[1]}: give mma parameters")
    needs_90a = version in HOPPER_ONLY or fam == "tma"
    if needs_90a and mod is not None and not getattr(mod, "sm90a", False):
        raise UnsupportedError(f"hgemm_{version} was not compiled for sm_90a: load the module "
                               "with hgemm.load() (it passes -arch=sm_90a on Hopper)")
    optin = _smem_optin()
    sms = cb.launch.device().sms
    key = (version, M, N, K, cc, dtype, sms, optin) if params is None else None
    cfg = _CONFIGS.get(key) if key else None
    if cfg is None:                     # config() is pure: planned once per shape (prefill
        cfg = config(version, M, N, K, cc, params, sms=sms, dtype=dtype, optin=optin)
        if key:                         # launches ~50 GEMMs of a handful of shapes)
            _CONFIGS[key] = cfg
    if optin is not None and cfg["shared"] > optin:
        raise UnsupportedError(_smem_message(version, cfg["shared"], optin))
    if "fallback" in cfg and cfg["kernel"] not in _NOTED:
        _NOTED.add(cfg["kernel"])
        print(f"note: {cfg['fallback']}")
    kern = kernel(module_for(mod, cfg["kernel"]), cfg["kernel"])
    a, b, c = (cb.describe(x).ptr for x in (A, B, C))
    dims = (np.int32(M), np.int32(N), np.int32(K))
    if version == "v8" or fam == "tma":
        bn = 256 if version == "v8" else cfg["params"]["BN"]
        args = (tensor_map(a, M, K, 128, dtype), tensor_map(b, N, K, bn, dtype), np.uint64(c),
                *dims)
    else:
        args = (np.uint64(a), np.uint64(b), np.uint64(c), *dims)
    with cb.arrays.launch_stream(A, B, C):      # PyTorch's current stream for torch tensors
        cb.launch.run(kern, cfg, args)
    return cfg


def kernel(mod, name: str):
    """The RawKernel ``name`` of a module from load() (a name expression for a template)."""
    return mod.get(name)


def module_for(mod, name: str):
    """``mod``, or (for a v9 instantiation it was not compiled with) the module of load() that
    adds it: an extra NVRTC compile the first time a new parameter set is launched; for ``mod``
    None, the module of that kernel alone (``kernel_module``)."""
    if mod is None:
        return kernel_module(name)
    if "<" in name and name not in getattr(mod, "exprs", ()):
        return load(mod.cc, (*getattr(mod, "exprs", ()), name))
    return mod


def resources(mod, name: str) -> dict:
    """Registers per thread, static shared bytes, local (spill) bytes of kernel ``name``."""
    a = kernel(mod, name).attributes
    return {"registers": a["num_regs"], "shared_bytes": a["shared_size_bytes"],
            "local_bytes": a["local_size_bytes"]}


_NOTED: set[str] = set()                              # fallback kernels announced once
_CONFIGS: dict = {}                                   # launch(): config() per shape


def _smem_optin(cc: tuple[int, int] | None = None) -> int | None:
    """This GPU's opt-in shared memory per block (``cb.launch.device().smem_optin``, bytes);
    None without a GPU, or when ``cc`` is not this GPU's compute capability (config() and
    require() then plan for that GPU without a limit). The one place hgemm reads it:
    tests/test_small_gpus.py replaces it to plan for other GPUs' limits."""
    if not cb.HAS_GPU:
        return None
    dev = cb.launch.device()
    return dev.smem_optin if cc is None or tuple(cc) == dev.cc else None


def pad_k(X: Any, K8: int):
    """X (R, K) copied into a zero-filled (R, K8) matrix (same library, same dtype)."""
    if cb.arrays.lib_of(X) == "torch":
        import torch

        return torch.nn.functional.pad(X, (0, K8 - X.shape[1]))
    import cupy

    Y = cupy.zeros((X.shape[0], K8), dtype=X.dtype)
    Y[:, :X.shape[1]] = cb.as_cupy(X, "X")
    return Y


def matmul(A: Any, B: Any, version: str = "v9", out: Any | None = None, mod=None,
           params: dict | None = None):
    """The entry point: C = A @ B^T with the chosen version (v9 by default, "v9" or "hgemm_v9";
    ``params``: v9's, if not its own), for CuPy arrays, PyTorch CUDA tensors or Numba device
    arrays; returns C. ``mod``: as in launch() (None: compile only the kernel launched).

    K not a multiple of 8 is padded with zeros (a copy of A and B: 2(M + N)K bytes read and
    written once more, which the timings of the lesson count). ``out`` defaults to a new array of
    the inputs' library and dtype.
    """
    K = A.shape[1] if hasattr(A, "shape") and len(A.shape) == 2 else None
    if K is not None and K % 8 and hasattr(B, "shape") and B.shape[-1] == K:
        K8 = (K + 7) // 8 * 8
        A, B = pad_k(A, K8), pad_k(B, K8)
    if out is None:
        M, N, _, dtype = check_operands(A, B)
        out = cb.arrays.empty_like_lib(A, (M, N), dtype)
    launch(mod, version, A, B, out, params=params)
    return out


# ============================================================================ correctness

#: unit roundoff of each format (half an ulp at 1): fp16 and TF32 keep 10 mantissa bits, bf16 7
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "tf32": 2.0 ** -11,
                 "float32": 2.0 ** -24}


def tolerance(absprod, ref, K: int, out_dtype: str = "float16", acc: str = "float32",
              lam: float = 4.0):
    """Per-element error bound of C = A @ B^T with 16-bit inputs, ``acc`` accumulation and a
    result rounded to ``out_dtype``: ``u_out |ref| + lam sqrt(K) u_acc (|A| |B|^T)``.

    The products of two fp16 (or bf16) values are exact in fp32, so the error comes from the
    additions (a random walk of K roundings: sqrt(K), Higham and Mary 2019; ``lam`` = 4 covers
    the tails, and u_acc is doubled for the tensor cores' truncating adders) and from rounding C.
    ``absprod`` = |A| @ |B|^T and ``ref`` the float64 product, same shape.
    """
    u_acc = 2 * UNIT_ROUNDOFF[acc]
    return UNIT_ROUNDOFF[out_dtype] * abs(ref) + lam * math.sqrt(K) * u_acc * absprod


def check(C: Any, A: Any, B: Any, rows: slice | None = None, name: str = "C",
          acc: str = "float32") -> float:
    """Raise ``cudabook.CheckError`` unless C = A @ B^T within ``tolerance``; returns the largest
    error relative to the bound (< 1 passes). ``rows`` restricts the check to a band of rows."""
    a, b, c = (_as_f64(x) for x in (A, B, C))
    if rows is not None:
        a, c = a[rows], c[rows]
    xp = _xp(a)
    ref = a @ b.T
    bound = tolerance(xp.abs(a) @ xp.abs(b).T, ref, a.shape[1], cb.describe(C, "C").dtype, acc)
    err = xp.abs(c - ref)
    bad = ~(err <= bound)
    if bool(bad.any()):
        idx = cb.to_numpy(xp.argwhere(bad))
        i, j = (int(v) for v in idx[0])
        n_nan = int(xp.isnan(c).sum())
        raise cb.CheckError(
            f"{name}: {len(idx)} of {c.size} elements outside the fp32-accumulation bound"
            + (f" ({n_nan} NaN: never written)" if n_nan else "")
            + f"; first at ({i}, {j}): got {float(c[i, j]):.6g}, expected {float(ref[i, j]):.6g}"
              f" +- {float(bound[i, j]):.2g}")
    return float((err / (bound + 1e-300)).max())


def _xp(x):
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _as_f64(x):
    """float64 copy of a CuPy / PyTorch (bf16 too) / Numba / NumPy matrix, on the GPU when it
    lives there (CuPy), else on the host (NumPy)."""
    if type(x).__module__.startswith("torch"):
        t = x.detach().double()
        if t.is_cuda:
            import cupy

            return cupy.asarray(t)
        return t.numpy()
    if type(x).__module__.startswith("cupy"):
        return x.astype("float64")
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy.asarray(x).astype("float64")
    return np.asarray(x, dtype=np.float64)


def flops(M: int, N: int, K: int) -> float:
    return 2.0 * M * N * K


# ============================================================================ autotuning

def candidates(cc: tuple[int, int], family: str | None = None,
               optin: int | None = None) -> list[dict]:
    """The parameter sets autotune() tries on this architecture (``family`` "mma" on Hopper:
    the mma.sync template's); autotune() skips those that need more shared memory than it has.
    Where some need more than ``optin`` (default: this GPU's limit; the L4's 99 KiB), sets of
    96 KiB are added (FALLBACKS: 128 x 128 tiles; v10's loop with 2 stages if hgemm.cu has it)."""
    if (family or v9_family(cc)) == "tma":
        return [dict(BN=256, STAGES=4, PERSIST=1), dict(BN=256, STAGES=3, PERSIST=1),
                dict(BN=256, STAGES=4, PERSIST=0), dict(BN=128, STAGES=4, PERSIST=1)]
    if tuple(cc) >= (8, 0):   # v10's template, and v6's tiles in the template of v3-v6
        cands = [dict(BM=128, BN=256, STAGES=3, EPI=1, GROUP=8),
                 dict(BM=256, BN=128, STAGES=3, EPI=1, GROUP=8),
                 dict(BM=128, BN=256, STAGES=4, EPI=1, GROUP=8),
                 dict(BM=128, BN=256, WM=64, WN=64, STAGES=3, DBUF=1, GROUP=8)]
        if optin is None:
            optin = _smem_optin(cc)
        if optin is not None and params_shared(DEFAULT_MMA10) > optin:   # the L4's 99 KiB
            cands += [p for v in ("v10", "v6") for p in variants(v)[1:]]
            cands.append(dict(BM=128, BN=128, WM=64, WN=32, STAGES=3, DBUF=1, GROUP=8))
        return cands
    return [dict(BM=128, BN=128, WM=64, WN=32, STAGES=1, DBUF=0, GROUP=g) for g in (1, 8)] + [
            dict(BM=128, BN=128, WM=64, WN=64, STAGES=1, DBUF=0, GROUP=8),
            dict(BM=64, BN=128, WM=32, WN=64, STAGES=1, DBUF=0, GROUP=8)]


def autotune(n: int = 4096, cands: list[dict] | None = None, repeat: int = 10,
             quiet: bool = False, family: str | None = None) -> list[dict]:
    """Compile every candidate of v9's template for this GPU (one NVRTC call), check each on a
    ragged shape, time it at n x n x n against cuBLAS fp16 in the same run, keep the fastest for
    v9. Returns one entry per candidate (params, TFLOP/s, ratio or error), best first."""
    import cupy

    cc = tuple(cb.cc())
    optin = _smem_optin() or MAX_STATIC_SHARED
    cands = [dict(c) for c in (cands or candidates(cc, family, optin))]
    fam = v9_family(cc, cands[0])
    fits = [c for c in cands if shared_bytes("v9", cc, c) <= optin]
    mod = load(cc, tuple(template_name(fam, c) for c in fits))
    g = np.random.default_rng(n)
    a = cupy.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cupy.float16)
    b = cupy.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cupy.float16)
    ra = cupy.asarray(g.standard_normal((300, 200), dtype=np.float32)).astype(cupy.float16)
    rb = cupy.asarray(g.standard_normal((77, 200), dtype=np.float32)).astype(cupy.float16)
    out, rout = cupy.empty((n, n), cupy.float16), cupy.empty((300, 77), cupy.float16)
    out_ref = cupy.empty((n, n), cupy.float16)
    res = [dict(params=c, error=f"needs {shared_bytes('v9', cc, c)} B of shared memory, the "
                f"GPU allows {optin}") for c in cands if c not in fits]
    base = None
    for c in fits:
        e = dict(params=c)
        try:
            rout.fill(cupy.nan)
            launch(mod, "v9", ra, rb, rout, params=c)
            check(rout, ra, rb, name=f"v9 {c}")
            t = cb.bench({"v9": lambda c=c: launch(mod, "v9", a, b, out, params=c)},
                         baseline={"cuBLAS fp16": lambda: cupy.matmul(a, b.T, out=out_ref)},
                         flops=flops(n, n, n), repeat=repeat, quiet=True)
            base = t["cuBLAS fp16"].value
            e.update(tflops=t["v9"].value, ratio=t["v9"].ratio, time_us=t["v9"].time_us,
                     shared=shared_bytes("v9", cc, c))
        except Exception as ex:  # noqa: BLE001
            e["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:120]}"
        res.append(e)
    ok = sorted((r for r in res if "tflops" in r), key=lambda r: -r["tflops"])
    if ok and fam == v9_family(cc):      # v9 keeps the best of its own family
        _TUNED[(cc, "float16")] = dict(ok[0]["params"])
    if not quiet and base:
        print(f"cuBLAS fp16 at n = {n}: {base:.1f} TFLOP/s")
    return ok + [r for r in res if "tflops" not in r]


def params_label(p: dict) -> str:
    if "PERSIST" in p:
        return f"128x{p['BN']}x64, {p['STAGES']} stages, {'persistent' if p['PERSIST'] else 'one tile/block'}"
    if "EPI" in p:
        return (f"{p['BM']}x{p['BN']}x64, warps 64x64, {p['STAGES']} stages, v10's loop"
                f"{', staged C' if p['EPI'] else ''}, group {p['GROUP']}")
    return (f"{p['BM']}x{p['BN']}x64, warps {p['WM']}x{p['WN']}, {p['STAGES']} stage(s)"
            f"{', reg. double buffer' if p['DBUF'] else ''}, group {p['GROUP']}")


# ============================================================================ sanitizer

def sanitize_targets():
    """(name, launch) pairs for tools/sanitize.py: the versions that use shared memory, on a
    ragged shape (racecheck finds a missing barrier, memcheck an unguarded load or store)."""
    import cupy as cp

    cc = tuple(cb.cc())
    mod = load(cc)
    M, N, K = 131, 67, 72
    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    A = cp.asarray(rng.random((M, K)).astype(np.float16))
    B = cp.asarray(rng.random((N, K)).astype(np.float16))
    C = cp.empty((M, N), cp.float16)
    ok = runnable(cc, quiet=True)    # by compute capability and shared memory per block
    for v in ("v1", "v2", "v3", "v4", "v5", "v6", "v10"):
        if v in ok:
            yield f"hgemm_{v}", (lambda v=v: launch(mod, v, A, B, C))
    if "v10" in ok:   # v10's predicate-free path runs only in blocks with no edge
        A2 = cp.asarray(rng.random((256, 128)).astype(np.float16))
        B2 = cp.asarray(rng.random((512, 128)).astype(np.float16))
        C2 = cp.empty((256, 512), cp.float16)
        yield "hgemm_v10 (interior blocks)", lambda: launch(mod, "v10", A2, B2, C2)
