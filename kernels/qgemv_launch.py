"""Launching kernels/qgemv.cu: weight-only quantized GEMV for decode, W8A16 and W4A16.

    qg = cb.load_launch("qgemv")
    w8 = qg.prepare(W, bits=8, group=K)      # per-channel int8 weights + fp16 scales (QWeight)
    w4 = qg.prepare(W, bits=4, group=128)    # int4 packed two per byte, fp16 scales per group
    f8 = qg.prepare(W, bits=8, group=K, fmt="e4m3")   # fp8 e4m3 weights (weight-only fp8)
    y = qg.qgemv(x, w4)                      # x (B, K) fp16, B 1..16 -> y (B, N) fp16
    y = qg.qgemv(x, w4, bias, out=y, version="qgemv_w4_v3")
    qg.supports("qgemv_w4_v5", B, K)         # False where a version does not take (B, K)
    y = qg.qgemv(x, w4, version="qgemv_w4_v6")   # sm_80+, B <= 8: tensor cores as the dot product
    y = qg.qgemv(x, w4, version="qgemv_w4_v7")   # v6's math over w4.tiles(), its own layout

  VERSIONS, WHAT, V6_MIN_CC  the ladders per weight kind (8, 4, "e4m3"), one line per step, and
                             the compute capability of the mma.sync steps (w4_v6, w4_v7)
  config()                   a cb.Launch record: grid, block and the instantiation (kernel_name)
  qgemv()                    the entry point: check, pick the instantiation, launch, return y
  prepare(), QWeight         the quantized weight the kernels read; supports() which versions
                             take a (B, K, G)
  sanitize_targets()         every version on ragged shapes, for tools/sanitize.py

Each launch compiles only its version's kernels (qgemv.cu's CB_ONLY guards, through cb.module)
and runs on PyTorch's current stream when x is a torch tensor (cb.arrays.launch_stream).

``prepare`` quantizes a float (N, K) weight on the GPU (kernels/quant.cu, symmetric,
round to nearest; fp8 through PyTorch's float8_e4m3fn with s = max|w| / 448) and keeps what the kernels read: q (int8, or packed uint8 (N, K / 2)), the
scales as fp16 (N, K / G), and the group size. ``dequantized()`` gives the float32 weight the
kernel effectively multiplies by (the float64 reference uses it).

Refused before launching: a group size that does not divide K or is not a multiple of 16 (W8)
or 32 (W4: 16 bytes of packed weights must fall in one group), odd K for packed int4, dtypes
other than fp16 activations, B outside 1..16, misaligned or strided arrays; qgemv_w4_v4 beyond
B = 4, qgemv_w4_v5 beyond B = 1 or K = 32768, qgemv_w4_v6 beyond B = 8 or K = 2^21 or
below compute capability 8.0 (mma.sync m16n8k16); qgemv_w4_v7 as v6, and also where K or the
group size is not a multiple of 128 (one scale per tile of 128 values of k).
qgemv_w4_v6 with G % 128 != 0 scales the weights in fp16 (|q s| below 65504: |w| up to ~57000).
qgemv_w4_v3, v4 and v5 sum 4 products in fp16 before the fp32 sum: activations above about 2000
in magnitude could overflow those partials; v2 (fp32 products) has no such limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "WHAT", "MAX_B", "QWeight", "prepare", "qgemv", "config", "kernel_name",
           "module",
           "supports", "sanitize_targets"]

VERSIONS = {8: ("qgemv_w8_v1", "qgemv_w8_v2"),
            4: ("qgemv_w4_v1", "qgemv_w4_v2", "qgemv_w4_v3", "qgemv_w4_v4", "qgemv_w4_v5",
                "qgemv_w4_v6", "qgemv_w4_v7"),
            "e4m3": ("qgemv_f8_v2",)}
DEFAULT = {8: "qgemv_w8_v2", 4: "qgemv_w4_v3", "e4m3": "qgemv_f8_v2"}
WHAT = {
    "qgemv_w8_v1": "warp per row, byte per lane, int->float per weight",
    "qgemv_w8_v2": "16-byte loads, magic-number dequant, split K, fp32",
    "qgemv_f8_v2": "w8_v2 with fp8 e4m3 weights (shift + one fp16 multiply)",
    "qgemv_w4_v1": "warp per row, byte per lane, shifts for the nibbles",
    "qgemv_w4_v2": "16-byte loads, half2 magic-number dequant, fp32 products",
    "qgemv_w4_v3": "v2 with fp16 products summed by 4 (HFMA2)",
    "qgemv_w4_v4": "v3's math, a warp per row, 8 loads in flight per lane (B <= 4)",
    "qgemv_w4_v5": "B = 1: x kept in registers, rows walked by one wave of blocks",
    "qgemv_w4_v6": "tensor cores (mma.sync) as the dot product, x as the 8 columns (B <= 8)",
    "qgemv_w4_v7": "v6's math over a weight stored in the order a warp loads it (512 B per load)",
}
MAX_B = 16
BATCH_TILES = (1, 2, 4, 8, 16)
V5_THREADS = 256
V5_ROWS = {1: (4, 8), 2: (2, 4), 4: (2,)}    #: qgemv_w4_v5: rows per step for CPT chunks/thread
# rows per step by CPT: 4 loads of 16 bytes in flight per thread (1 x 4, 2 x 2), chosen over 8
# (1 x 8, 2 x 4) by timing both; CPT = 4 has R = 2 only
V5_DEFAULT_ROWS = {1: 4, 2: 2, 4: 2}
V6_MAX_B = 8                                 #: qgemv_w4_v6: the rows of x are the mma's 8 columns
V6_MAX_K = 1 << 21                           #: its chunk -> group multiply-high is exact below this
V6_MIN_CC = (8, 0)                           #: mma.sync m16n8k16 with fp16 inputs
V6_SPLITS = (4, 8, 16)                       #: warps per block (each a slice of K), instantiated
#: qgemv_w4_v6: (warps per block S, quads of 128 k in flight per lane U) by N, chosen by timing
#: S = 8 and 16 at B = 1, g128: S = 8 for large N; S = 16 for smaller N (4096 x 14336), where 16
#: rows per block leave only 256 blocks and more warps per block keep more loads in flight
V6_DEFAULT = {"small_n": (16, 1), "large_n": (8, 1)}
V6_LARGE_N = 6144
#: (S, U, GQ) instantiated in qgemv.cu
V6_KERNELS = {(8, 1, 1), (8, 1, 0), (16, 1, 1), (16, 1, 0)}
V7_SPLITS = (16, 8, 4)                       #: qgemv_w4_v7: warps per block, instantiated
#: qgemv_w4_v7 is launched with __launch_bounds__(32 S, 32 / S): 32 warps per SM fit at any S,
#: so S is the largest split whose ceil(N / 16) blocks fit in one wave (a second, partial wave
#: leaves SMs idle at its end): S = 8 at 8192 x 8192, 16 at 4096 x 14336, 4 at 14336 x 4096
_RESIDENT: dict[str, int] = {}               # kernel name -> blocks per SM (driver's answer)


def v5_cpt(K: int) -> int:
    """qgemv_w4_v5's chunks (of 32 weights) per thread for rows of K: 1, 2 or 4."""
    nc = K // 32
    for cpt in (1, 2, 4):
        if nc <= V5_THREADS * cpt:
            return cpt
    raise LaunchError(f"qgemv_w4_v5 keeps x in registers: K = {K} is more than its "
                      f"{32 * V5_THREADS * 4} columns; use qgemv_w4_v3")


def supports(version: str, B: int, K: int, G: int | None = None) -> bool:
    """Whether ``version`` takes B rows of x and rows of K weights (v4: B <= 4; v5: B = 1,
    K <= 32768; v6: B <= 8, sm_80+; v7: as v6 with K and the group size G multiples of 128;
    the others: any B up to MAX_B)."""
    if version == "qgemv_w4_v4":
        return B <= 4
    if version == "qgemv_w4_v5":
        return B == 1 and K <= 32 * V5_THREADS * 4
    if version == "qgemv_w4_v6":
        return 1 <= B <= V6_MAX_B and K <= V6_MAX_K and _cc_ok()
    if version == "qgemv_w4_v7":
        return (1 <= B <= V6_MAX_B and K % 128 == 0 and (G is None or G % 128 == 0)
                and _cc_ok())
    return 1 <= B <= MAX_B


@dataclass
class QWeight:
    """A weight quantized for qgemv: q (N, K) int8, packed (N, K / 2) uint8 (int4) or (N, K)
    e4m3 bytes (uint8), scales (N, K / G) fp16, bits, group G, (N, K) and fmt ("int", "e4m3")."""
    q: Any
    scales: Any
    bits: int
    group: int
    N: int
    K: int
    fmt: str = "int"
    _tiled: Any = field(default=None, repr=False, compare=False)

    @property
    def kind(self):
        """The key of VERSIONS: 8, 4 or "e4m3"."""
        return "e4m3" if self.fmt == "e4m3" else self.bits

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads for the weight: q and the scales."""
        return int(self.q.nbytes + self.scales.nbytes)

    def dequantized(self):
        """The float32 (N, K) weight the kernel multiplies by: q * fp16 scale (CuPy)."""
        import cupy as cp

        q = self.q
        if self.fmt == "e4m3":
            import torch

            f = torch.from_dlpack(q).view(torch.float8_e4m3fn).float()
            q = cp.from_dlpack(f)
        elif self.bits == 4:
            q = cb.load_launch("quant").unpack_int4(q, self.N * self.K).reshape(self.N, self.K)
        s = self.scales.astype(cp.float32)
        return (q.astype(cp.float32).reshape(self.N, -1, self.group) * s[:, :, None]).reshape(
            self.N, self.K)

    def tiles(self):
        """(tiles, scales) of qgemv_w4_v7 (qgemv.cu's v7 comment), built on the GPU once and
        kept: uint8 tiles of 16 rows x 128 k (1024 bytes each, in the order a warp loads them,
        nibbles offset by 8 in the order k0 k2 k4 k6 k1 k3 k5 k7 per 32-bit word; rows past N
        are zero) and fp16 scales, one (row g, row g + 8) pair per tile and g."""
        if self._tiled is None:
            import cupy as cp

            if self.bits != 4 or self.fmt != "int":
                raise LaunchError("qgemv_w4_v7 reads int4 weights (prepare(W, bits=4, group))")
            N, K, G = self.N, self.K, self.group
            if K % 128 or G % 128:
                raise LaunchError(f"qgemv_w4_v7 takes tiles of 128 values of k with one scale "
                                  f"each: K = {K} and the group size {G} must be multiples of "
                                  "128; use qgemv_w4_v6")
            Np, nq = ceil_div(N, 16) * 16, K // 128
            q = cb.load_launch("quant").unpack_int4(self.q, N * K)
            n = cp.full((Np, K), 8, cp.uint8)                        # q + 8; padded rows: q = 0
            n[:N] = (q.astype(cp.int16) + 8).astype(cp.uint8).reshape(N, K)
            n = n.reshape(Np, K // 8, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]
            b = (n[:, :, 0::2] | (n[:, :, 1::2] << 4)).reshape(Np // 16, 2, 8, nq, 4, 16)
            s = cp.zeros((Np, nq), cp.float16)
            s[:N] = cp.repeat(self.scales, G // 128, axis=1)
            s = s.reshape(Np // 16, 2, 8, nq)
            self._tiled = (cp.ascontiguousarray(b.transpose(0, 3, 1, 2, 4, 5)).reshape(-1),
                           cp.ascontiguousarray(s.transpose(0, 3, 2, 1)).reshape(-1))
        return self._tiled


def _check_group(bits: int, K: int, group: int) -> None:
    if bits not in (4, 8):
        raise LaunchError(f"qgemv has W8A16 and W4A16 kernels: bits must be 8 or 4, got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise TypeError(f"group must be a positive int (K for per-channel), got {group!r}")
    chunk = 16 if bits == 8 else 32
    if bits == 4 and K % 2:
        raise LaunchError(f"K = {K} is odd: packed int4 holds two values per byte, so each row "
                          "needs an even K (pad the weight with a zero column)")
    if K % group:
        raise LaunchError(f"group size {group} does not divide K = {K}")
    if group % chunk:
        raise LaunchError(f"group size {group} is not a multiple of {chunk}: a 16-byte load holds "
                          f"{chunk} int{bits} weights, which must share one scale")


def prepare(W: Any, bits: int = 4, group: int = 128, fmt: str = "int") -> QWeight:
    """Quantize the float (N, K) weight W (fp16 or fp32; CuPy or torch) symmetrically for
    qgemv: per-group scales stored as fp16. group = K is per-channel. fmt="e4m3" (bits 8):
    fp8 weights, w / s rounded to e4m3 with s = max|w| / 448 per group."""
    import cupy as cp

    cb.expect(W, "W", ndim=2)
    Wc = cb.as_cupy(W, "W")
    if Wc.dtype not in (cp.float16, cp.float32):
        raise TypeError(f"W: expected float16 or float32, got {Wc.dtype}")
    N, K = (int(s) for s in Wc.shape)
    _check_group(bits, K, group)
    if fmt not in ("int", "e4m3") or (fmt == "e4m3" and bits != 8):
        raise LaunchError(f"fmt must be 'int' or 'e4m3' (with bits=8), got {fmt!r}, bits={bits}")
    if fmt == "e4m3":
        import torch

        w = cp.ascontiguousarray(Wc, dtype=cp.float32).reshape(N, K // group, group)
        amax = cp.abs(w).max(axis=2)
        s = cp.where(amax > 0, amax / cp.float32(448), cp.float32(1)).astype(cp.float16)
        t = torch.from_dlpack(w / s.astype(cp.float32)[:, :, None]).clamp(-448, 448)
        q = cp.from_dlpack(t.to(torch.float8_e4m3fn).view(torch.uint8).reshape(N, K))
        return QWeight(cp.ascontiguousarray(q), s, 8, int(group), N, K, "e4m3")
    qt = cb.load_launch("quant")
    q, s, _ = qt.quantize(cp.ascontiguousarray(Wc, dtype=cp.float32), bits=bits, group=group)
    if bits == 4:
        q = qt.pack_int4(q).reshape(N, K // 2)
    return QWeight(q, s.astype(cp.float16), bits, int(group), N, K)


def batch_tile(B: int) -> int:
    for bt in BATCH_TILES:
        if B <= bt:
            return bt
    return BATCH_TILES[-1]


def kernel_name(version: str, B: int, rows: int | None = None, K: int | None = None,
                G: int | None = None, N: int = 1 << 30) -> str:
    """The instantiation of ``version`` for batch B (and, for qgemv_w4_v5, rows of K; for
    qgemv_w4_v6, the (N, K) weight's groups of G)."""
    if version.endswith("_v1"):
        return version
    if version == "qgemv_w4_v5":
        if B != 1:
            raise LaunchError(f"qgemv_w4_v5 keeps one row of x in registers: B must be 1, got "
                              f"B = {B}; use qgemv_w4_v3")
        if K is None:
            raise ValueError("qgemv_w4_v5: kernel_name needs K (its instantiation depends on it)")
        cpt = v5_cpt(K)
        r = V5_DEFAULT_ROWS[cpt] if rows is None else rows
        if r not in V5_ROWS[cpt]:
            raise ValueError(f"qgemv_w4_v5 with K = {K}: rows per step one of {V5_ROWS[cpt]}, "
                             f"got {rows}")
        return f"qgemv_w4_v5_c{cpt}_r{r}"
    if version in ("qgemv_w4_v6", "qgemv_w4_v7"):
        if rows is not None:
            raise ValueError(f"{version} always takes 16 rows per block (one mma tile): "
                             f"rows must be None, got {rows}")
        return v6_name(B, K, G, N) if version == "qgemv_w4_v6" else (
            f"qgemv_w4_v7_s{v7_split(N, B)}")
    rows = 2 if rows is None else rows
    if version == "qgemv_w4_v4":
        if B > 4:
            raise LaunchError(f"qgemv_w4_v4 takes B <= 4 (one warp keeps B sums), got B = {B}; "
                              "use qgemv_w4_v3")
        return f"qgemv_w4_v4_b{batch_tile(B)}"
    if rows not in (2, 4) or (rows == 4 and batch_tile(B) != 1):
        raise ValueError(f"{version}: rows per block 2 (any batch) or 4 (batch 1), got {rows}")
    return f"{version}_b{batch_tile(B)}_r{rows}"


def config(version: str, B: int, N: int, rows: int | None = None, K: int | None = None,
           resident: int | None = None, G: int | None = None) -> Launch:
    """The launch of ``version`` (qgemv.cu's launch comment): grid, block and the kernel
    (kernel_name()). qgemv_w4_v5 needs K and the blocks that fit at once on the GPU
    (``resident``: SMs x blocks per SM): one wave. qgemv_w4_v6 needs K and G: a block of S
    warps per 16 rows."""
    name = kernel_name(version, B, rows, K, G, N)
    if version.endswith("_v1"):
        grid, block = (ceil_div(N, 4), B), (128,)
    elif version == "qgemv_w4_v5":
        if resident is None or resident < 1:
            raise ValueError("qgemv_w4_v5: config needs resident = SMs x blocks per SM")
        grid, block = (min(ceil_div(N, int(name.rsplit("_r", 1)[1])), resident),), (V5_THREADS,)
    elif version == "qgemv_w4_v6":
        grid, block = (ceil_div(N, 16),), (32 * v6_config(N, K, G, B)[0],)
    elif version == "qgemv_w4_v7":
        grid, block = (ceil_div(N, 16),), (32 * v7_split(N, B),)
    elif version == "qgemv_w4_v4":
        grid, block = (ceil_div(N, 4), 1), (128,)
    else:
        rows = 2 if rows is None else rows
        grid, block = (ceil_div(N, rows), ceil_div(B, batch_tile(B))), (128,)
    return Launch(grid, block, kernel=name)


def _cc_ok() -> bool:
    try:
        return cb.launch.device().cc >= V6_MIN_CC
    except Exception:  # noqa: BLE001  (no GPU: the simulator cannot run CUDA C++ anyway)
        return False


def v6_config(N: int, K: int | None, G: int | None, B: int = 1,
              split: int | None = None, quads: int | None = None) -> tuple[int, int, int]:
    """(S warps per block, U quads in flight per lane, GQ) of qgemv_w4_v6 for an (N, K) weight
    with groups of G, after checking B and K. GQ = 1 where G % 128 == 0 (one scale per quad of
    128 values of k: applied to the fp32 sums); 0 scales the weights in fp16 first."""
    if not 1 <= B <= V6_MAX_B:
        raise LaunchError(f"qgemv_w4_v6 takes B <= {V6_MAX_B} (the rows of x are the 8 columns "
                          f"of one mma), got B = {B}; use qgemv_w4_v3")
    if K is None or G is None:
        raise ValueError("qgemv_w4_v6: its instantiation depends on K and the group size G")
    if K > V6_MAX_K:
        raise LaunchError(f"qgemv_w4_v6 finds a chunk's scale by a multiply-high that is exact "
                          f"for K <= {V6_MAX_K}, got K = {K}; use qgemv_w4_v3")
    S, U = V6_DEFAULT["large_n" if N >= V6_LARGE_N else "small_n"]
    S, U = split or S, quads or U
    gq = int(G % 128 == 0)
    if (S, U, gq) not in V6_KERNELS:
        have = sorted((s_, u_) for s_, u_, g_ in V6_KERNELS if g_ == gq)
        raise ValueError(f"qgemv_w4_v6 (G = {G}) is instantiated for (S, U) in {have}, "
                         f"got {(S, U)}")
    return S, U, gq


def v7_split(N: int, B: int = 1, sms: int | None = None) -> int:
    """qgemv_w4_v7's warps per block S for N rows: the largest of V7_SPLITS whose ceil(N / 16)
    blocks fit in one wave (32 / S per SM), else the smallest; after checking B."""
    if not 1 <= B <= V6_MAX_B:
        raise LaunchError(f"qgemv_w4_v7 takes B <= {V6_MAX_B} (the rows of x are the 8 columns "
                          f"of one mma), got B = {B}; use qgemv_w4_v3")
    sms = cb.launch.device().sms if sms is None else sms
    for S in V7_SPLITS:
        if ceil_div(N, 16) <= sms * (32 // S):
            return S
    return V7_SPLITS[-1]


def v6_name(B: int, K: int | None, G: int | None, N: int = 1 << 30,
            split: int | None = None, quads: int | None = None) -> str:
    """The instantiation of qgemv_w4_v6 that qgemv launches for (B, N, K, G)."""
    S, U, gq = v6_config(N, K, G, B, split, quads)
    return f"qgemv_w4_v6_s{S}_u{U}_g{gq}"


def _resident(mod, name: str) -> int:
    """SMs x resident blocks per SM of kernel ``name`` (the driver's occupancy, cached)."""
    if name not in _RESIDENT:
        per_sm = cb.occupancy.driver_blocks_per_sm(mod.get(name), V5_THREADS)
        _RESIDENT[name] = max(1, per_sm) * cb.launch.device().sms
    return _RESIDENT[name]


def qgemv(x: Any, w: QWeight, bias: Any = None, out: Any = None, *, version: str | None = None,
          rows: int | None = None):
    """y = x @ dequant(w)^T (+ bias): x (B, K) fp16, B 1..16; y (B, N) fp16 (returned).
    ``version``: one of VERSIONS[w.kind] ("qgemv_w4_v3" or "w4_v3"; default DEFAULT[w.kind])."""
    if not isinstance(w, QWeight):
        raise TypeError(f"w: expected a QWeight from qgemv.prepare(W, bits, group), got "
                        f"{type(w).__name__}")
    cb.expect(x, "x", dtype=np.float16, ndim=2)
    xc = cb.as_cupy(x, "x")
    B, K = (int(s) for s in xc.shape)
    if K != w.K:
        raise ValueError(f"x has K = {K} columns but the weight is ({w.N}, {w.K})")
    if not 1 <= B <= MAX_B:
        raise LaunchError(f"qgemv: batch B = {B}; these kernels take 1..{MAX_B} rows of x")
    _check_group(w.bits, K, w.group)
    version = _version(w, version)
    qdt = np.int8 if (w.bits == 8 and w.fmt == "int") else np.uint8
    cb.expect(w.q, "w.q", dtype=qdt, shape=(w.N, K if w.bits == 8 else K // 2))
    cb.expect(w.scales, "w.scales", dtype=np.float16, shape=(w.N, K // w.group))
    if not version.endswith("_v1") and not (cb.expect_aligned(x, "x", 16)
                                            and cb.expect_aligned(w.q, "w.q", 16)):
        raise LaunchError(f"{version} reads 16 bytes at a time: x and w.q must be 16-byte "
                          "aligned (pass fresh arrays, not views at an offset)")
    bc = np.uint64(0)
    if bias is not None:
        cb.expect(bias, "bias", dtype=np.float16, shape=(w.N,))
        bc = cb.as_cupy(bias, "bias")
    if out is None:
        out = cb.arrays.empty_like_lib(x, (B, w.N), "float16")
    cb.expect(out, "out", dtype=np.float16, shape=(B, w.N))
    oc = cb.as_cupy(out, "out")
    if version in ("qgemv_w4_v6", "qgemv_w4_v7") and not _cc_ok():
        raise LaunchError(f"{version} multiplies with mma.sync m16n8k16 (fp16 in, fp32 sums): it "
                          "needs compute capability 8.0+; this GPU is "
                          f"{'.'.join(map(str, cb.launch.device().cc))}: use qgemv_w4_v3")
    name = kernel_name(version, B, rows, K, w.group, w.N)
    q, s = w.tiles() if version == "qgemv_w4_v7" else (w.q, w.scales)
    mod = module(version)                   # this version's kernels alone
    resident = _resident(mod, name) if version == "qgemv_w4_v5" else None
    cfg = config(version, B, w.N, rows, K, resident, w.group)
    args = (xc, q, s, bc, oc, np.int32(B), np.int32(w.N), np.int32(K), np.int32(w.group))
    with cb.arrays.launch_stream(x):
        cb.launch.run(mod.get(cfg.kernel), cfg, args)
    return out


def _version(w: QWeight, version: str | None) -> str:
    """The version of VERSIONS[w.kind] that ``version`` names (either spelling; None: the
    default); ValueError naming the choices for another kind's kernel."""
    kinds = VERSIONS[w.kind]
    if version is None:
        return DEFAULT[w.kind]             # w4_v5 is not the default: lesson 10 times it
    try:
        return version_name(kinds, version, "qgemv")
    except ValueError:
        raise ValueError(f"{version!r} is not a kernel for {w.kind} weights; choose from "
                         f"{kinds}") from None


def module(version: str | None = None):
    """kernels/qgemv.cu through cb.module (once per process, kept in the kernel cache):
    ``version``'s kernels alone (qgemv.cu's CB_ONLY guards: one family per version), or the
    whole file."""
    if version is None:
        return cb.module("qgemv")
    if not any(version in v for v in VERSIONS.values()):
        raise ValueError(f"unknown version {version!r}; qgemv.cu has "
                         f"{tuple(v for vs in VERSIONS.values() for v in vs)}")
    return cb.module("qgemv", only=version)


def sanitize_targets():
    """Every version on a ragged N, per-channel and grouped scales, partly filled batch tiles."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    for B, N, K, G in ((1, 7, 256, 64), (11, 3, 128, 32), (3, 21, 384, 128)):
        x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32)
        for bits, fmt in ((8, "int"), (4, "int"), (8, "e4m3")):
            w = prepare(W, bits, G, fmt)
            for v in VERSIONS[w.kind]:
                if not supports(v, B, K, G):
                    continue
                yield (f"{v} ({B}x{N}x{K}, g{G})",
                       (lambda v=v, w=w, x=x: qgemv(x, w, version=v)))
