"""Launching kernels/norm.cu: LayerNorm and RMSNorm over the last dimension of a float32 (M, N) x.

    nl = cb.load_launch("norm")
    y = nl.layernorm(x, gamma, beta, 1e-5)          # layernorm_v3, any N
    y = nl.rmsnorm(x, gamma, 1e-6)                  # rmsnorm_v2, any N
    nl.layernorm(x, gamma, beta, 1e-5, y, version="layernorm_v2")   # or version="v2"
    nl.layernorm(x, gamma, beta, 1e-5, y, version="layernorm_v4")   # rows past 32k columns (lesson 3: below v3 up to 16k)
    nl.layernorm(x, gamma, beta, 1e-5, y, version="layernorm_v5")   # sm_90: float4 rows of 16k-32k columns
    nl.layernorm(x, gamma, beta, 1e-5, y, version="layernorm_v6")   # sm_90: a row over 2-16 blocks
    nl.rmsnorm(x, gamma, 1e-6, y, version="rmsnorm_v3")             # sm_90: the same for RMSNorm

    LAYERNORM_VERSIONS, RMSNORM_VERSIONS, MIN_CC   the two ladders; layernorm_v5, layernorm_v6
                                        and rmsnorm_v3 need cc 9.0
    config(version, M, N, sms, optin, cluster=None)   -> Launch(grid, block, shared=,
                                        kernel=version; cluster= for layernorm_v6 and
                                        rmsnorm_v3: cb.launch.row_split's C from N)
    layernorm(x, gamma, beta, eps, y=None, version, cluster=None) /
    rmsnorm(x, gamma, eps, y=None, version, cluster=None)
                                        the entry points: checks, config, launch, return y
    v4_shared(N, optin)                 layernorm_v4's dynamic shared memory
    sanitize_targets()

The checks, before anything is launched: x float32, 2D, C-contiguous, on the GPU, with at least
one row and one column; gamma and beta float32 (N,); y of x's shape (allocated by x's library
when not given); eps a number > 0. layernorm_v5, layernorm_v6 and rmsnorm_v3 need compute
capability 9.0 (thread-block clusters) and say so below that; layernorm_v6 and rmsnorm_v3 refuse
a row whose slice does not fit a block's shared memory (N past about 925k columns on an H100)
with the N they take. Versions are spelled "layernorm_v3" or "v3" ("rmsnorm_v2" or "v2").
"""

from __future__ import annotations

import numbers

import numpy as np

import cudabook as cb
from cudabook.launch import (
    Launch,
    LaunchError,
    ceil_div,
    row_block,
    row_split,
    smem_optin,
    version_name,
)

__all__ = ["LAYERNORM_VERSIONS", "RMSNORM_VERSIONS", "MIN_CC", "SPLIT", "layernorm", "rmsnorm",
           "config", "v4_shared", "sanitize_targets"]

LAYERNORM_VERSIONS = ("layernorm_v1", "layernorm_v2", "layernorm_v3", "layernorm_v4",
                      "layernorm_v5", "layernorm_v6")
RMSNORM_VERSIONS = ("rmsnorm_v1", "rmsnorm_v2", "rmsnorm_v3")
#: the versions that need more than the book's minimum GPU
MIN_CC = {"layernorm_v5": (9, 0), "layernorm_v6": (9, 0), "rmsnorm_v3": (9, 0)}
#: the versions that split a row over a thread-block cluster (cb.launch.row_split)
SPLIT = ("layernorm_v6", "rmsnorm_v3")
#: layernorm_v4 (norm.cu): float4 per thread in registers, and in shared memory at most
V4_REGS, V4_SMEM_MAX = 8, 14
#: layernorm_v5 (norm.cu): float4 of a half row per thread
V5_REGS = 4


def _version(version: str) -> str:
    """The name in either ladder: "rmsnorm_v2", "layernorm_v3" or "v3" (a bare "vN": LayerNorm)."""
    if isinstance(version, str) and version.startswith("rmsnorm"):
        return version_name(RMSNORM_VERSIONS, version, "rmsnorm")
    return version_name(LAYERNORM_VERSIONS, version, "layernorm")


def config(version: str, M: int, N: int, sms: int | None = None,
           optin: int | None = None, cluster: int | None = None) -> Launch:
    """Grid, block and dynamic shared memory of ``version`` for an (M, N) input (see the launch
    comments in norm.cu). ``sms``: the GPU's SM count, which layernorm_v5's persistent grid needs;
    ``optin``: the shared memory a block may opt into, which sizes layernorm_v4's and the split
    rows' (both default to this GPU's); ``cluster``: layernorm_v6's and rmsnorm_v3's cluster size
    (2, 4, 8, 16; default: chosen from N)."""
    version = _version(version)
    if version in SPLIT:                           # the row over a cluster, slices in shared memory
        return row_split(M, N, version, cluster=cluster, optin=optin)
    if version == "layernorm_v1":
        return Launch((ceil_div(M, 128),), (128,), kernel=version)
    if version in ("layernorm_v3", "rmsnorm_v2"):
        return Launch((M,), (row_block(N),), kernel=version)   # the row in registers, <= 16 each
    if version == "layernorm_v2":
        return Launch((M,), (256 if N <= 4096 else 512,), kernel=version)
    if version == "layernorm_v4":                  # the rest of the row in shared memory
        if optin is None:
            optin = smem_optin() or 48 * 1024
        return Launch((M,), (row_block(N),), shared=v4_shared(N, optin), kernel=version)
    if version == "rmsnorm_v1":
        return Launch((M,), (512,), kernel=version)
    # layernorm_v5: pairs of blocks, each half of every row
    if sms is None:
        sms = cb.launch.device().sms
    half = ceil_div(ceil_div(N, 4), 2)             # float4 of a half row
    t = ceil_div(ceil_div(half, V5_REGS), 32) * 32
    t = 512 if N % 4 or t > 1024 else max(128, t)  # 512: the streamed fallback
    return Launch((2 * min(M, max(1, sms // 2)),), (t,), kernel=version)


def v4_shared(N: int, optin: int = 227 * 1024) -> int:
    """Dynamic shared memory (bytes) of layernorm_v4 for rows of N: the float4 of the row past
    the registers' 8 per thread; 0 (the kernel then streams the row) when a row needs more than
    14 per thread, or more than ``optin`` bytes (the GPU's opt-in limit, less 1 KiB of static
    shared memory) would allow."""
    t = row_block(N)
    s = max(0, ceil_div(N // 4, t) - V4_REGS)
    need = s * t * 16
    return 0 if s > V4_SMEM_MAX or need > optin - 1024 else need


def _check(x, y, params, eps):
    _module()                         # first: without a GPU this says so
    cb.expect(x, "x", dtype=np.float32, ndim=2)
    M, N = (int(s) for s in x.shape)
    if M == 0 or N == 0:
        raise LaunchError(f"x has shape {(M, N)}; a row needs at least one element")
    if M >= 2**31:
        raise LaunchError(f"{M} rows is more than one grid dimension holds")
    for name, p in params:
        cb.expect(p, name, dtype=np.float32, shape=(N,))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise TypeError(f"eps must be a number > 0, got {eps!r}")
    if y is None:
        y = cb.arrays.empty_like_lib(x, (M, N), "float32")
    cb.expect(y, "y", dtype=np.float32, shape=(M, N))
    return M, N, y


def _run(cfg: Launch, arrays: tuple, M: int, N: int, eps: float) -> None:
    args = tuple(cb.as_cupy(a) for a in arrays) + (np.int32(M), np.int32(N), np.float32(eps))
    cb.launch.run(_module().get(cfg.kernel), cfg, args, stream=cb.stream_for(*arrays))


def _need(version: str, cluster) -> None:
    if cluster is not None and version not in SPLIT:
        raise ValueError(f"cluster= is for {SPLIT}; {version} does not split a row")
    if version in MIN_CC:
        what = "clusters of two blocks" if version == "layernorm_v5" else "thread-block clusters"
        cb.need_cc(*MIN_CC[version], f"{version} ({what})")


def layernorm(x, gamma, beta, eps: float, y=None, version: str = "layernorm_v3",
              cluster: int | None = None):
    """LayerNorm over the last dimension (biased variance, as torch) into ``y`` (returned);
    ``version``: "layernorm_v3" or "v3"; ``cluster``: layernorm_v6's cluster size (default:
    from N)."""
    version = version_name(LAYERNORM_VERSIONS, version, "layernorm")
    M, N, y = _check(x, y, (("gamma", gamma), ("beta", beta)), eps)
    _need(version, cluster)
    _run(config(version, M, N, cluster=cluster), (x, gamma, beta, y), M, N, eps)
    return y


def rmsnorm(x, gamma, eps: float, y=None, version: str = "rmsnorm_v2",
            cluster: int | None = None):
    """RMSNorm over the last dimension into ``y`` (returned); ``version``: "rmsnorm_v2" or
    "v2"; ``cluster``: rmsnorm_v3's cluster size (default: from N)."""
    version = version_name(RMSNORM_VERSIONS, version, "rmsnorm")
    M, N, y = _check(x, y, (("gamma", gamma),), eps)
    _need(version, cluster)
    _run(config(version, M, N, cluster=cluster), (x, gamma, y), M, N, eps)
    return y


def _module():
    return cb.module("norm")     # the whole file, compiled once per process


def sanitize_targets():
    """Every version on shapes that take each path of v3 / rmsnorm_v2: float4, scalar
    (N = 1001), and a row too long for the registers (streamed); on sm_90 also layernorm_v5's
    split rows with about three rows per pair of blocks, so each inbox is used twice, and
    layernorm_v6 / rmsnorm_v3 in clusters of 2, 4, 8 and 16 on small rows."""
    import cupy as cp

    sm90 = cb.env.cc() >= (9, 0)
    for M, N in ((5, 256), (3, 1001), (2, 40_000), (2, 100_000)):
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        g = cp.random.uniform(0.5, 1.5, N, dtype=cp.float32)
        b = cp.random.standard_normal(N, dtype=cp.float32)
        y = cp.empty_like(x)
        for v in LAYERNORM_VERSIONS:
            if v == "layernorm_v1" and N > 1001:
                continue
            if v in MIN_CC and not sm90:
                continue
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, g=g, b=b, y=y:
                                     layernorm(x, g, b, 1e-5, y, version=v))
        for v in RMSNORM_VERSIONS:
            if v in MIN_CC and not sm90:
                continue
            yield f"{v} ({M}x{N})", (lambda v=v, x=x, g=g, y=y: rmsnorm(x, g, 1e-5, y, version=v))
    if sm90:
        for C, N in ((2, 4), (4, 1001), (8, 4096), (16, 4100)):
            x = cp.random.standard_normal((3, N), dtype=cp.float32)
            g = cp.random.uniform(0.5, 1.5, N, dtype=cp.float32)
            b = cp.random.standard_normal(N, dtype=cp.float32)
            y = cp.empty_like(x)
            yield f"layernorm_v6 (3x{N}, clusters of {C})", (
                lambda x=x, g=g, b=b, y=y, C=C: layernorm(x, g, b, 1e-5, y, "layernorm_v6", C))
            yield f"rmsnorm_v3 (3x{N}, clusters of {C})", (
                lambda x=x, g=g, y=y, C=C: rmsnorm(x, g, 1e-5, y, "rmsnorm_v3", C))
    if sm90:
        M, N = 3 * (cb.launch.device().sms // 2) + 1, 1028
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        g = cp.random.uniform(0.5, 1.5, N, dtype=cp.float32)
        b = cp.random.standard_normal(N, dtype=cp.float32)
        y = cp.empty_like(x)
        yield f"layernorm_v5 ({M}x{N})", lambda: layernorm(x, g, b, 1e-5, y, version="layernorm_v5")
