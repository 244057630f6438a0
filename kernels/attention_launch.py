"""Launch helpers of kernels/attention_forward.cu and attention_backward.cu (Chapter 9), and the
PyTorch op built on them.

    al = cb.load_launch("attention")
    o, lse = al.forward(q, k, v, causal=True, version="v3")      # q, k, v: torch CUDA tensors
    dq, dk, dv = al.backward(q, k, v, o, lse, do, causal=True)   # (or CuPy arrays, fp16/fp32)
    o = al.flash_attention(q, k, v, causal=True)                 # differentiable (autograd)
    # grouped-query attention: k, v with fewer heads (H_kv dividing H), forward v4, backward v3

  FWD_VERSIONS, BWD_VERSIONS   the ladders ("v3" or "attention_v3"; "v2" or "attention_bwd_v2")
  FWD_DTYPES, BWD_DTYPES       the dtypes of each step; MIN_CC the compute capability per dtype
  fwd_config(), bwd_config()   a cb.Launch record (grid, block, shared, kernel), or a dict of
                               named records for a plan of several kernels (v1; the backward)
  forward(), backward()        the entry points: check, plan, launch, return the outputs
  flash_attention()            the torch.autograd op (forward v2/v3, backward v1/v2)
  check_qkv()                  the op's checks (below); module(), kernel(), resources()
  sanitize_targets()           every kernel on ragged sizes, for tools/sanitize.py

Inputs: q (B, H, Nq, D) or (BH, Nq, D), k and v (..., Nk, D), one dtype, C-contiguous, on the
GPU; any Nq, Nk >= 1; D = 64 or 128. Forward v1 (naive, three kernels) and v2 (fp32 flash) take
float32, v3 (tensor cores) and v4 (Hopper: wgmma, TMA, warp specialisation; compute capability
9.0 only) float16 or bfloat16; backward v1 float32, v2 float16/bfloat16, v3 (Hopper: wgmma, TMA)
float16/bfloat16. k and v may have fewer heads than q (grouped-query or multi-query attention:
H_kv dividing H, query head h reading key/value head h // (H / H_kv)) in the versions of GQA_VERSIONS.
Every assumption is checked before a launch, with a message that names the argument.

Backward v2's own tiles need 130 KiB (D = 64) and 145 KiB (D = 128) of shared memory per block:
an A100 or an H100 has them. On a GPU with less (L4 / A10 / RTX 30-40: 99 KiB, T4: 64 KiB)
bwd_config() picks the largest smaller instantiation that fits (BWD_V2_FIT) and backward() prints
a note the first time; forward v3 needs at most 64 KiB and fits every GPU from the T4 up.

Each launch compiles only its ladder step (the files' CB_ONLY guards, through cb.module); the
forward file is built for sm_90a on a Hopper GPU (v4's wgmma and setmaxnreg are 'a' features).
16-bit tensors reach the kernels as raw device pointers (cb.describe): CuPy 14 has no bfloat16
dtype, so a bfloat16 tensor cannot cross into CuPy. The kernels run on PyTorch's current stream
when the inputs are torch tensors (cb.arrays.launch_stream).
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, version_name

LOG2E = 1.4426950408889634
#: attention_v3 tiles (queries per block BR, keys per tile BC) per head dimension; the same
#: numbers as the ATTN_V3 lines of attention_forward.cu (tests/test_ch09.py compares them)
V3_TILES = {64: (128, 64), 128: (128, 64)}
#: attention_v4 keys per K/V tile (BC) per head dimension (queries per block: 128), as in the
#: ATTN_V4 lines of attention_forward.cu
V4_TILES = {64: 128, 128: 128}
V4_BR = 128
V4_STAGES = 2
#: attention_bwd_v2 tiles (keys per block BC, queries per tile BR), as in ATTN_BWD_V2: the
#: kernels of GPUs with 163 KiB of shared memory per block or more (A100, H100), two stages
BWD_V2_TILES = {64: (128, 128), 128: (128, 64)}
#: smaller attention_bwd_v2 instantiations (BC, BR, STAGES), largest first, as in the
#: ATTN_BWD_V2_FIT lines: bwd_config() runs the first that fits where BWD_V2_TILES do not
#: (99 KiB per block on an L4 / A10 / RTX 30-40: the first, 64 KiB on a T4: the second)
BWD_V2_FIT = {64: [(128, 64, 2), (64, 64, 2)], 128: [(64, 64, 1), (32, 64, 1)]}
HEAD_DIMS = (64, 128)           # every CUDA version is compiled for these
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
FWD_VERSIONS, BWD_VERSIONS = ("v1", "v2", "v3", "v4"), ("v1", "v2", "v3")
FWD_DTYPES = {"v1": ("float32",), "v2": ("float32",), "v3": ("float16", "bfloat16"),
              "v4": ("float16", "bfloat16")}
BWD_DTYPES = {"v1": ("float32",), "v2": ("float16", "bfloat16"), "v3": ("float16", "bfloat16")}
#: the versions whose kernels take grouped-query heads (k, v with fewer heads than q)
GQA_VERSIONS = {"forward": ("v4",), "backward": ("v3",)}
#: attention_bwd_v3 queries per tile (BR) per head dimension (keys per block: 128, two stages),
#: as in the ATTN_BWD_V3 lines of attention_backward.cu
BWD_V3_BR = {64: 128, 128: 64}
BWD_V3_BC = 128
#: the lowest compute capability of the kernels of each dtype (bfloat16 arithmetic from 8.0);
#: attention_v4 needs 9.0 exactly (hopper_problem)
MIN_CC = {"float32": (7, 5), "float16": (7, 5), "bfloat16": (8, 0)}


# ============================================================================== checks
def check_qkv(q, k, v, dtypes, head_dims=HEAD_DIMS,
              device: bool = True, gqa: bool = False) -> tuple[int, int, int, int]:
    """(BH, Nq, Nk, D) of attention inputs, or a clear error (see the module's docstring);
    ``device=False`` skips the device check (the tests check shapes with CPU tensors);
    ``gqa=True`` lets k and v have fewer heads than q (group_of() gives the group size)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        cb.expect(a, name, device=device)
        if device and not cb.HAS_GPU:       # expect takes host arrays in simulator mode
            raise TypeError(f"{name}: expected a GPU array (a torch tensor on 'cuda' or a CuPy "
                            "array); this is simulator mode, where these kernels cannot run")
        if len(a.shape) not in (3, 4):
            raise ValueError(f"{name}: expected (B, H, N, D) or (BH, N, D), got shape "
                             f"{tuple(a.shape)}")
    dt = [cb.describe(a).dtype for a in (q, k, v)]
    if len(set(dt)) > 1:
        raise TypeError(f"q, k and v must share one dtype, got {dt[0]}, {dt[1]}, {dt[2]}")
    if dt[0] not in dtypes:
        raise TypeError(f"dtype {dt[0]} is not supported by this version; it takes "
                        f"{' or '.join(dtypes)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if len(q.shape) != len(k.shape) or tuple(q.shape[:-3]) != tuple(k.shape[:-3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch "
                         "dimension")
    hq, hk = int(q.shape[-3]), int(k.shape[-3])
    if hq != hk:
        if not gqa:
            raise ValueError(f"q has {hq} heads and k {hk}: grouped-query attention (fewer "
                             "key/value heads) runs in the versions of GQA_VERSIONS only "
                             f"({GQA_VERSIONS})")
        if hk < 1 or hq % hk:
            raise ValueError(f"q has {hq} heads and k {hk}: the key/value heads must divide the "
                             "query heads (each group of H / H_kv query heads shares one)")
    D = int(q.shape[-1])
    if int(k.shape[-1]) != D:
        raise ValueError(f"q and k must have the same head dimension, got {D} and "
                         f"{int(k.shape[-1])}")
    if D not in head_dims:
        raise ValueError(f"head dimension {D} is not supported: the kernels are compiled for "
                         f"{', '.join(map(str, head_dims))}")
    Nq, Nk = int(q.shape[-2]), int(k.shape[-2])
    if Nq < 1 or Nk < 1:
        raise ValueError(f"empty sequence: Nq = {Nq}, Nk = {Nk}")
    BH = int(np.prod([int(x) for x in q.shape[:-2]]))
    if BH > 65535:
        raise cb.LaunchError(f"batch x heads = {BH} exceeds the grid's y limit (65535)")
    if max(Nq, Nk) * D >= 2**31:
        raise cb.LaunchError("a sequence of 2^31 or more elements per head is not supported")
    return BH, Nq, Nk, D


# ============================================================================== launch description
def group_of(q, k) -> int:
    """Query heads per key/value head: 1 for ordinary attention, H for multi-query."""
    return int(q.shape[-3]) // int(k.shape[-3])


def kernel_names(which: str) -> list[str]:
    """Every kernel of attention_{forward,backward}.cu (their macros expand to these names)."""
    dts = ("f16", "bf16")
    if which == "forward":
        return (["attention_v1_scores", "attention_v1_softmax", "attention_v1_pv"]
                + [f"attention_v2_d{d}" for d in HEAD_DIMS]
                + [f"attention_v3_{t}_d{d}" for d in HEAD_DIMS for t in dts]
                + [f"attention_v4_{t}_d{d}" for d in HEAD_DIMS for t in dts]
                + [f"attention_v4_nolap_bf16_d{d}" for d in HEAD_DIMS])
    return (["attention_bwd_v1_preprocess"]
            + [f"attention_bwd_v1_{k}_d{d}" for d in HEAD_DIMS for k in ("dkdv", "dq")]
            + [f"attention_bwd_v2_{k}_{t}" for t in dts for k in ("preprocess", "convert")]
            + [f"attention_bwd_v2_{t}_d{d}" for d in HEAD_DIMS for t in dts]
            + [bwd_v2_name(t, d, *f) for d in HEAD_DIMS for f in BWD_V2_FIT[d] for t in dts]
            + [f"attention_bwd_v3_preprocess_{t}" for t in dts]
            + [f"attention_bwd_v3_convert_{t}" for t in dts]
            + [f"attention_bwd_v3_{t}_d{d}" for d in HEAD_DIMS for t in dts]
            + [f"attention_bwd_v3_atomic_bf16_d{d}" for d in HEAD_DIMS])


def bwd_v2_name(dt: str, D: int, bc: int, br: int, stages: int) -> str:
    """The kernel of one attention_bwd_v2 instantiation (dt: 'f16' or 'bf16'): the BWD_V2_TILES
    ones keep the short name, the smaller ones say their tiles (..._d128_64x64s1)."""
    if (bc, br) == BWD_V2_TILES[D] and stages == 2:
        return f"attention_bwd_v2_{dt}_d{D}"
    return f"attention_bwd_v2_{dt}_d{D}_{bc}x{br}s{stages}"


def bwd_v2_shared(D: int, bc: int, br: int, stages: int = 2) -> int:
    """Dynamic shared memory (bytes) of attention_bwd_v2 with these tiles: K and V (BC x D), Q
    and dO (BR x D per stage), dS^T (BC x BR) in 16 bits, lse and Di (BR per stage) in fp32."""
    return (2 * bc * D + 2 * stages * br * D + bc * br) * 2 + 2 * stages * br * 4


def fwd_config(version: str, BH: int, Nq: int, Nk: int, D: int, dt: str | None = None,
               overlap: bool = True) -> dict:
    """Kernel names, grid, block and dynamic shared memory of a forward version (dt: 'f16',
    'bf16' for v3 and v4). ``overlap=False`` (v4, bfloat16 only): the kernel without the overlap
    of P V with the softmax and without the ping-pong of the two consumer warpgroups."""
    cd = cb.ceil_div
    version = _fwd_version(version)
    if version == "v1":
        return {"scores": Launch((cd(Nk, 32), cd(Nq, 8), BH), (32, 8),
                                 kernel="attention_v1_scores"),
                "softmax": Launch((cd(BH * Nq, 4),), (128,), kernel="attention_v1_softmax"),
                "pv": Launch((cd(D, 32), cd(Nq, 8), BH), (32, 8), kernel="attention_v1_pv")}
    if version == "v2":
        return Launch((cd(Nq, 32), BH), (128,), kernel=f"attention_v2_d{D}")
    if version == "v3":
        br, bc = V3_TILES[D]
        return Launch((cd(Nq, br), BH), (128,), shared=(br + 2 * bc) * D * 2,
                      kernel=f"attention_v3_{dt}_d{D}")
    if version == "v4":
        bc = V4_TILES[D]
        name = f"attention_v4_{dt}_d{D}"
        if not overlap:
            if dt != "bf16":
                raise ValueError("attention_v4 without the overlap is compiled for bfloat16 only")
            name = f"attention_v4_nolap_{dt}_d{D}"
        return Launch((cd(Nq, V4_BR), BH), (384,), shared=(V4_BR + 2 * V4_STAGES * bc) * D * 2
                      + 1024, kernel=name, box_q=V4_BR, box_kv=bc)
    raise ValueError(f"unknown forward version {version!r} (v1, v2, v3, v4)")


def bwd_v3_shared(D: int) -> int:
    """Dynamic shared memory (bytes) of attention_bwd_v3: K and V (128 x D), two stages of Q and
    dO (BR x D), two dS^T buffers (128 x BR), 16 bits each; each consumer's 64 x 64 fp32 piece
    of dQ; 1024 bytes of alignment slack."""
    br = BWD_V3_BR[D]
    return (2 * BWD_V3_BC * D + 2 * 2 * br * D + 2 * BWD_V3_BC * br) * 2 + 2 * 64 * 64 * 4 + 1024


def bwd_config(version: str, BH: int, Nq: int, Nk: int, D: int, dt: str | None = None,
               optin: int | None = None, group: int = 1, dq_atomic: bool = False) -> dict:
    """Kernel names, grid, block and dynamic shared memory of a backward version.

    ``optin``: the shared memory one block may have (default: this GPU's, unlimited without
    one). Where v2's own tiles (BWD_V2_TILES) need more, "main" is the first of BWD_V2_FIT that
    fits, and its entry "fallback" says so; where none fits, the own configuration is returned
    (backward() then refuses it, naming the shared memory it needs)."""
    cd = cb.ceil_div
    version = _bwd_version(version)
    pre = Launch((cd(BH * Nq, 4),), (128,), kernel="attention_bwd_v1_preprocess"
                 if version == "v1" else f"attention_bwd_v2_preprocess_{dt}")
    if version == "v1":
        return {"preprocess": pre,
                "dkdv": Launch((cd(Nk, 32), BH), (128,), kernel=f"attention_bwd_v1_dkdv_d{D}"),
                "dq": Launch((cd(Nq, 32), BH), (128,), kernel=f"attention_bwd_v1_dq_d{D}")}
    if version == "v2":
        bc, br = BWD_V2_TILES[D]
        st = 2
        own = bwd_v2_shared(D, bc, br)
        if optin is None:
            optin = _optin()
        note = None
        if optin is not None and own > optin:
            for fbc, fbr, fst in BWD_V2_FIT[D]:
                need = bwd_v2_shared(D, fbc, fbr, fst)
                if need <= optin:
                    bc, br, st = fbc, fbr, fst
                    note = (f"attention_bwd_v2 at D = {D} needs {own // 1024} KiB of shared "
                            f"memory per block, this GPU allows {optin // 1024} KiB: running "
                            f"{bwd_v2_name(dt, D, bc, br, st)} ({bc} keys x {br} queries, "
                            f"{'one stage' if st == 1 else 'two stages'}, {need / 1024:g} KiB) "
                            "instead")
                    break
        main = Launch((cd(Nk, bc), BH), (2 * bc,), shared=bwd_v2_shared(D, bc, br, st),
                      kernel=bwd_v2_name(dt, D, bc, br, st), **({"fallback": note} if note else {}))
        return {"preprocess": pre,
                "main": main,
                "convert": Launch((cd(BH * Nq * D, 256),), (256,),
                                  kernel=f"attention_bwd_v2_convert_{dt}")}
    if version == "v3":                     # group: query heads per key/value head
        br = BWD_V3_BR[D]
        nq_pad = cd(Nq, br) * br            # statistics and dQ rows padded to whole query tiles
        name = f"attention_bwd_v3_{dt}_d{D}"
        if dq_atomic:
            if dt != "bf16":
                raise ValueError("attention_bwd_v3 with dQ atomics is compiled for bfloat16 only")
            name = f"attention_bwd_v3_atomic_{dt}_d{D}"
        return {"preprocess": Launch((cd(BH * nq_pad, 4),), (128,), nq_pad=nq_pad,
                                     kernel=f"attention_bwd_v3_preprocess_{dt}"),
                "main": Launch((cd(Nk, BWD_V3_BC), BH // group), (384,), shared=bwd_v3_shared(D),
                               kernel=name, br=br, bc=BWD_V3_BC),
                "convert": Launch((cd(cd(Nq, br) * BH * 2048, 256),), (256,),
                                  kernel=f"attention_bwd_v3_convert_{dt}")}
    raise ValueError(f"unknown backward version {version!r} (v1, v2, v3)")


def flops(BH: int, Nq: int, Nk: int, D: int, causal: bool = False,
          backward: bool = False) -> float:
    """4 BH Nq Nk D forward (two products of 2 Nq Nk D), 2.5 times that backward (five).
    Causal: the same count halved, FlashAttention's benchmark convention (and PyTorch's)."""
    f = 4.0 * BH * Nq * Nk * D * (2.5 if backward else 1.0)
    return f / 2 if causal else f


# ============================================================================== launchers
def module(which: str, version: str | None = None, early_dv: bool | None = None):
    """kernels/attention_{forward,backward}.cu through cb.module (once per process, kept in the
    kernel cache): the whole file, or ``version``'s kernels alone (the file's step guards; the
    entry points compile that way). The forward is built for sm_90a on a Hopper GPU.
    ``early_dv`` (backward): attention_bwd_v3's order of products at both head dimensions (True:
    dV issued before dS^T is computed; None: the file's own choice per head dimension)."""
    if which not in ("forward", "backward"):
        raise ValueError(f"module: which is 'forward' or 'backward', got {which!r}")
    if which == "forward":
        if early_dv is not None:
            raise ValueError("module: early_dv is an option of the backward")
        step = () if version is None else f"attention_{_fwd_version(version)}"
        return cb.module("attention_forward", only=step, a_features=True)
    step = () if version is None else f"attention_bwd_{_bwd_version(version)}"
    opts = () if early_dv is None else (f"-DATTN_BWD_EARLY_DV={int(bool(early_dv))}",)
    return cb.module("attention_backward", opts, only=step, a_features=True)


def _fwd_version(version: str) -> str:
    """'v3' for 'v3' or 'attention_v3' (the one naming rule: cudabook.launch.version_name)."""
    try:
        return version_name(FWD_VERSIONS, version, "attention")
    except ValueError:
        raise ValueError(f"unknown forward version {version!r} (v1, v2, v3, v4)") from None


def _bwd_version(version: str) -> str:
    """'v2' for 'v2' or 'attention_bwd_v2'."""
    try:
        return version_name(BWD_VERSIONS, version, "attention_bwd")
    except ValueError:
        raise ValueError(f"unknown backward version {version!r} (v1, v2, v3)") from None


def hopper_problem(cc: tuple[int, int], what: str = "attention_v4",
                   instead: str = "v3") -> str | None:
    """Why a Hopper kernel (attention_v4, attention_bwd_v3) cannot run on a GPU of compute
    capability ``cc`` (None: it can)."""
    if tuple(cc) == (9, 0):
        return None
    return (f"{what} is built from sm_90a instructions (wgmma, TMA, setmaxnreg) that only "
            f"compute capability 9.0 (H100, H200) has; this GPU is {cc[0]}.{cc[1]}: use "
            f"version='{instead}'")


_NOTED: set[str] = set()        # fallback kernels announced once


def _optin() -> int | None:
    """The most dynamic shared memory one block may opt into here (cb.launch.smem_optin; None
    without a GPU). Read through this name so that tests can pretend to be a smaller GPU."""
    return cb.launch.smem_optin()


def kernel(mod, name: str):
    """The RawKernel ``name`` of a compiled module (``mod.get(name)``)."""
    return mod.get(name)


def resources(mod, name: str) -> dict:
    """Registers per thread, static shared and local (spill) bytes of a kernel."""
    r = mod.resources(name)
    return {k: r[k] for k in ("registers", "shared_bytes", "local_bytes")}


def forward(q, k, v, causal: bool = False, version: str = "v3", scale: float | None = None,
            out: tuple | None = None, overlap: bool = True):
    """(o, lse) of softmax(scale q k^T) v with the CUDA C++ forward ``version`` (v1, v2, v3,
    v4; ``overlap=False``: v4 without the softmax / P V overlap and the ping-pong).

    Outputs are allocated by the inputs' library (o like q, lse (..., Nq) float32), or given as
    ``out = (o, lse)`` (NaN-prefilled by a check, say).
    """
    version = _fwd_version(version)
    BH, Nq, Nk, D = check_qkv(q, k, v, FWD_DTYPES[version],
                              gqa=version in GQA_VERSIONS["forward"])
    group = group_of(q, k)
    dt = cb.describe(q).dtype
    cfg = fwd_config(version, BH, Nq, Nk, D, SHORT[dt], overlap)
    if version == "v4":
        why = hopper_problem(cb.launch.device().cc)
        if why:
            raise cb.LaunchError(why)
    cb.need_cc(*MIN_CC[dt], what=f"attention_{version} in {dt}")
    if version in ("v3", "v4"):
        cb.need_shared(cfg["shared"], f"attention_{version}", _optin())
    s = 1 / math.sqrt(D) if scale is None else float(scale)
    mod = cb.module("attention_forward", only=f"attention_{version}", a_features=True)
    if out is None:
        out = (cb.arrays.empty_like_lib(q, tuple(q.shape), dt),
               cb.arrays.empty_like_lib(q, tuple(q.shape[:-1]), "float32"))
    o, lse = out
    cb.expect(o, "o", dtype=dt, shape=tuple(q.shape))
    cb.expect(lse, "lse", dtype="float32", shape=tuple(q.shape[:-1]))
    Q, K, V, O, L = (np.uint64(cb.describe(a).ptr) for a in (q, k, v, o, lse))
    n_q, n_k, c = np.int32(Nq), np.int32(Nk), np.int32(bool(causal))
    with cb.arrays.launch_stream(q):
        if version == "v1":
            S = cb.arrays.empty_like_lib(q, (BH, Nq, Nk), "float32")   # N x N scores: O(N^2)
            P = np.uint64(cb.describe(S).ptr)
            for step, args in (("scores", (Q, K, P, n_q, n_k, np.int32(D), np.float32(s), c)),
                               ("softmax", (P, L, np.int32(BH * Nq), n_k)),
                               ("pv", (P, V, O, n_q, n_k, np.int32(D)))):
                cb.launch.run(mod.get(cfg[step]["kernel"]), cfg[step], args)
            _keep_alive(q, [S])                      # S must outlive its readers
        elif version == "v4":                        # TMA descriptors of (BH N, D) matrices
            tmap = cb.tma.tensor_map                 # 64 columns of 16 bits: 128-byte rows
            tq = tmap(int(Q), BH * Nq, D, cfg["box_q"], 64, dt)
            tk = tmap(int(K), BH // group * Nk, D, cfg["box_kv"], 64, dt)
            tv = tmap(int(V), BH // group * Nk, D, cfg["box_kv"], 64, dt)
            cb.launch.run(mod.get(cfg["kernel"]), cfg,
                          (tq, tk, tv, O, L, n_q, n_k, np.float32(s * LOG2E), c, np.int32(group)))
        else:
            cb.launch.run(mod.get(cfg["kernel"]), cfg,
                          (Q, K, V, O, L, n_q, n_k, np.float32(s * LOG2E), c))
    return o, lse


def backward(q, k, v, o, lse, do, causal: bool = False, version: str = "v2",
             scale: float | None = None, out: tuple | None = None, optin: int | None = None,
             dq_atomic: bool = False, early_dv: bool | None = None):
    """(dq, dk, dv) of softmax(scale q k^T) v given the forward's o and lse and the gradient do
    of o: v1 float32, v2 and v3 (Hopper) float16/bfloat16. ``out = (dq, dk, dv)`` gives the
    outputs. v3 takes grouped-query heads (dk, dv shaped like k, v: summed over each group).

    ``optin``: plan v2's tiles for a GPU that lets a block have this many bytes of shared memory
    (default: this GPU's limit; a smaller GPU's runs its tiles here, for the sanitizer).
    ``dq_atomic`` (v3, bfloat16): dQ added with float4 atomics from the consumer warpgroups
    instead of the copy engine's reductions (the lesson's comparison). ``early_dv`` (v3): issue
    dV's product before dS^T is computed (True) or after (False) at every head dimension; None
    (default): the kernel file's choice, True at D = 128 and False at D = 64 (the lesson's
    comparison of the two orders)."""
    version = _bwd_version(version)
    BH, Nq, Nk, D = check_qkv(q, k, v, BWD_DTYPES[version],
                              gqa=version in GQA_VERSIONS["backward"])
    group = group_of(q, k)
    dt = cb.describe(q).dtype
    if version == "v3":
        why = hopper_problem(cb.launch.device().cc, "attention_bwd_v3", "v2")
        if why:
            raise cb.LaunchError(why)
    cb.need_cc(*MIN_CC[dt], what=f"attention_bwd_{version} in {dt}")
    cb.expect(o, "o", dtype=dt, shape=tuple(q.shape))
    cb.expect(do, "do", dtype=dt, shape=tuple(q.shape))
    cb.expect(lse, "lse", dtype="float32", shape=tuple(q.shape[:-1]))
    limit = _optin()
    if optin is not None:
        limit = optin if limit is None else min(optin, limit)
    cfg = bwd_config(version, BH, Nq, Nk, D, SHORT[dt], limit, group, dq_atomic)
    if version == "v3":
        cb.need_shared(cfg["main"]["shared"], "attention_bwd_v3", limit)
    if version == "v2":
        main = cfg["main"]
        cb.need_shared(main["shared"], "attention_bwd_v2", limit)
        if "fallback" in main and main["kernel"] not in _NOTED:
            _NOTED.add(main["kernel"])
            print(f"note: {main['fallback']}")
    s = 1 / math.sqrt(D) if scale is None else float(scale)
    if early_dv is not None and version != "v3":
        raise ValueError("early_dv is an option of attention_bwd_v3 only")
    mod = module("backward", version, early_dv)
    if out is None:
        out = tuple(cb.arrays.empty_like_lib(q, tuple(a.shape), dt) for a in (q, k, v))
    dq, dk, dv = out
    for name, a, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        cb.expect(a, name, dtype=dt, shape=tuple(like.shape))
    nq_pad = cfg["preprocess"]["nq_pad"] if version == "v3" else Nq
    Di = cb.arrays.empty_like_lib(q, (BH, nq_pad), "float32")
    Q, K, V, O, L, dO, dQ, dK, dV, DI = (np.uint64(cb.describe(a).ptr)
                                         for a in (q, k, v, o, lse, do, dq, dk, dv, Di))
    n_q, n_k, c, sc = np.int32(Nq), np.int32(Nk), np.int32(bool(causal)), np.float32(s)
    keep = [Di]
    with cb.arrays.launch_stream(q):
        if version == "v1":
            plan = (("preprocess", (O, dO, DI, np.int32(BH * Nq), np.int32(D))),
                    ("dkdv", (Q, K, V, dO, L, DI, dK, dV, n_q, n_k, sc, c)),
                    ("dq", (Q, K, V, dO, L, DI, dQ, n_q, n_k, sc, c)))
        elif version == "v2":
            acc = cb.arrays.empty_like_lib(q, (BH, Nq, D), "float32")  # dQ in fp32, summed
            keep.append(acc)                                           # over key blocks
            A = np.uint64(cb.describe(acc).ptr)
            plan = (("preprocess", (O, dO, DI, A, np.int32(BH * Nq), np.int32(D))),
                    ("main", (Q, K, V, dO, L, DI, A, dK, dV, n_q, n_k, sc, c)),
                    ("convert", (A, dQ, np.uint64(BH * Nq * D), sc)))
        else:                                  # v3: TMA descriptors, padded statistics rows
            acc = _zeros_like_lib(q, (BH, nq_pad, D))      # dQ in fp32, tiled (the .cu file)
            lse2 = cb.arrays.empty_like_lib(q, (BH, nq_pad), "float32")
            keep += [acc, lse2]
            A, L2 = (np.uint64(cb.describe(a).ptr) for a in (acc, lse2))
            main = cfg["main"]
            tmap = cb.tma.tensor_map
            tq = tmap(int(Q), BH * Nq, D, main["br"], 64, dt)
            tdo = tmap(int(dO), BH * Nq, D, main["br"], 64, dt)
            tk = tmap(int(K), BH // group * Nk, D, main["bc"], 64, dt)
            tv = tmap(int(V), BH // group * Nk, D, main["bc"], 64, dt)
            plan = (("preprocess", (O, dO, L, DI, L2, np.int32(BH), n_q, np.int32(nq_pad),
                                    np.int32(D))),
                    ("main", (tq, tk, tv, tdo, L2, DI, A, dK, dV, n_q, n_k, sc, c,
                              np.int32(group))),
                    ("convert", (A, dQ, np.int32(BH), n_q, np.int32(D), sc)))
        for step, args in plan:
            cb.launch.run(mod.get(cfg[step]["kernel"]), cfg[step], args)
        _keep_alive(q, keep)
    return dq, dk, dv


def _zeros_like_lib(like, shape: tuple):
    """A zeroed float32 array of the inputs' library, on their stream."""
    if cb.arrays.lib_of(like) == "torch":
        import torch

        return torch.zeros(shape, dtype=torch.float32, device=like.device)
    import cupy

    return cupy.zeros(shape, dtype=cupy.float32)


def _keep_alive(like, bufs: list) -> None:
    """Workspace freed on return must not be reused before the kernels that read it finish."""
    if cb.arrays.lib_of(like) == "torch":
        import torch

        st = torch.cuda.current_stream(like.device)
        for b in bufs:
            b.record_stream(st)
    else:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


# ============================================================================== PyTorch op
def op_versions(dtype: str, cc: tuple[int, int]) -> tuple[str, str]:
    """(forward, backward) versions of the PyTorch op for a dtype on a GPU of compute capability
    cc: the Hopper kernels (v4, v3) on cc 9.0, the tensor-core ones (v3, v2) elsewhere, the fp32
    ones (v2, v1) for float32."""
    if dtype == "float32":
        return "v2", "v1"
    return ("v4", "v3") if tuple(cc) == (9, 0) else ("v3", "v2")


def _torch_function():
    import torch

    class FlashAttention(torch.autograd.Function):
        """softmax(scale q k^T) v with this chapter's kernels (op_versions): on an H100 / H200
        the Hopper forward and backward, elsewhere the mma.sync pair, float32 the fp32 pair.
        Grouped-query heads run natively on Hopper; elsewhere k and v are repeated over each
        group (a note says so once) and dk, dv summed back."""

        @staticmethod
        def forward(ctx, q, k, v, causal=False, scale=None):
            q, k, v = (t.contiguous() for t in (q, k, v))
            dt = cb.describe(q).dtype
            fwd_v, bwd_v = op_versions(dt, tuple(torch.cuda.get_device_capability(q.device)))
            group = group_of(q, k) if q.dim() == k.dim() and q.dim() >= 3 else 1
            ks, vs = k, v
            if group > 1 and (fwd_v not in GQA_VERSIONS["forward"]
                              or bwd_v not in GQA_VERSIONS["backward"]):
                _note_once("gqa", f"grouped-query attention: attention_{fwd_v} / attention_bwd_"
                           f"{bwd_v} take as many key/value heads as query heads, so k and v are "
                           f"repeated over each group of {group} here (the Hopper kernels read "
                           "them shared)")
                ks, vs = (t.repeat_interleave(group, dim=-3) for t in (k, v))
            o, lse = forward(q, ks, vs, causal, fwd_v, scale)
            ctx.save_for_backward(q, ks, vs, o, lse)
            ctx.causal, ctx.scale, ctx.bwd_v = causal, scale, bwd_v
            ctx.fold = group if ks is not k else 1
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.bwd_v,
                                  ctx.scale)
            if ctx.fold > 1:                   # sum the repeated heads' gradients back
                shp = (*dk.shape[:-3], dk.shape[-3] // ctx.fold, ctx.fold, *dk.shape[-2:])
                dk, dv = (t.view(shp).sum(dim=-3) for t in (dk, dv))
            return dq, dk, dv, None, None

    return FlashAttention


_FA = None


def _note_once(key: str, msg: str) -> None:
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {msg}")


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """The PyTorch op: ``F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    enable_gqa=True)`` for CUDA tensors (B, H, N, D), D = 64 or 128, float32 / float16 /
    bfloat16, differentiable; k and v may have H_kv heads, H_kv dividing H."""
    global _FA
    if _FA is None:
        _FA = _torch_function()
    return _FA.apply(q, k, v, causal, scale)


# ============================================================================== sanitizer
def sanitize_targets():
    """(name, launch) pairs for tools/sanitize.py: every CUDA kernel, small ragged sizes
    (Nq = 70, Nk = 45: no multiple of any tile), causal."""
    import cupy as cp

    g = cp.random.default_rng(0)
    BH, N, M, D = 2, 70, 45, 64
    q = g.standard_normal((BH, N, D), dtype=cp.float32)
    k = g.standard_normal((BH, M, D), dtype=cp.float32)
    v = g.standard_normal((BH, M, D), dtype=cp.float32)
    for ver in ("v1", "v2"):
        yield f"attention_{ver}", lambda ver=ver: forward(q, k, v, True, ver)
    o, lse = forward(q, k, v, True, "v2")
    yield "attention_bwd_v1", lambda: backward(q, k, v, o, lse, o, True, "v1")
    if cb.launch.device().cc >= (8, 0):
        qh, kh, vh = (x.astype(cp.float16) for x in (q, k, v))
        oh, lh = forward(qh, kh, vh, True, "v3")
        yield "attention_v3 f16", lambda: forward(qh, kh, vh, True, "v3")
        yield "attention_bwd_v2 f16", lambda: backward(qh, kh, vh, oh, lh, oh, True, "v2")
        if cb.launch.device().cc == (9, 0):     # the Hopper kernels, grouped-query heads too
            for D in HEAD_DIMS:
                qs = g.standard_normal((4, N, D), dtype=cp.float32).astype(cp.float16)
                ks, vs = (g.standard_normal((2, M, D), dtype=cp.float32).astype(cp.float16)
                          for _ in range(2))
                os_, ls_ = forward(qs, ks, vs, True, "v4")
                yield (f"attention_v4 f16 D={D} gqa",
                       lambda qs=qs, ks=ks, vs=vs: forward(qs, ks, vs, True, "v4"))
                yield (f"attention_bwd_v3 f16 D={D} gqa",
                       lambda qs=qs, ks=ks, vs=vs, os_=os_, ls_=ls_:
                       backward(qs, ks, vs, os_, ls_, os_, True, "v3"))
        # the smaller tiles of 99 and 64 KiB GPUs (one stage, fewer warps than row tiles at D 128)
        for D in HEAD_DIMS:
            qs, ks, vs = (g.standard_normal((BH, n, D), dtype=cp.float32).astype(cp.float16)
                          for n in (N, M, M))
            os_, ls_ = forward(qs, ks, vs, True, "v3")
            for kib in (99, 64):
                yield (f"attention_bwd_v2 f16 D={D} ({kib} KiB tiles)",
                       lambda qs=qs, ks=ks, vs=vs, os_=os_, ls_=ls_, kib=kib:
                       backward(qs, ks, vs, os_, ls_, os_, True, "v2", optin=kib * 1024))
