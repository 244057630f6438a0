"""Chapter 10 "Quantization": references, Numba twins, launch helpers' refusals, and every
grader against the reference solution, the stub and the wrong answers a reader would write.

All graders of this chapter run in the simulator. References come from
solutions/10_quantization.ipynb; wrong answers are edits of them (tests/solution_cells.py).
CUDA C++ kernels are checked on a GPU only (marked gpu).
"""

from __future__ import annotations

import numpy as np
import pytest
from solution_cells import Solution

import cudabook as cb
from cudabook import quant as Q
from cudabook.graders import GradeError, ex10_1, ex10_2, ex10_3, ex10_4, ex10_5
from cudabook.graders.ch10 import GROUP_SIZES, group_table

gpu = pytest.mark.gpu
SOL = Solution("10")


# ----------------------------------------------------------------------------- references
def test_quantize_reference_conventions():
    w = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 0.25], [3.0, 1.49, -1.5, 0.0]],
                 np.float32)
    q, s, z = Q.quantize_reference(w, 8, 4)
    assert s[0, 0] == 1.0 and (q[0] == 0).all()                     # all-zero row: scale 1
    assert s[1, 0] == np.float32(2.0) / np.float32(127) and q[1, 1] == -127
    assert (z == 0).all()
    q4, s4, _ = Q.quantize_reference(w, 4, 2)
    assert s4.shape == (3, 2) and q4.min() >= -7 and q4.max() <= 7
    qa, sa, za = Q.quantize_reference(w, 4, None, symmetric=False)
    assert sa.shape == (1, 1) and qa.dtype == np.uint8 and qa.max() <= 15
    w2 = Q.dequantize_reference(qa, sa, za, None)
    assert np.abs(w2 - w).max() <= sa[0, 0] / 2 + 1e-7
    with pytest.raises(ValueError, match="does not divide K"):
        Q.quantize_reference(w, 8, 3)


def test_int4_pack_reference_round_trip_and_order():
    q = np.array([1, -1, -8, 7, 3], np.int8)
    p = Q.pack_int4_reference(q)
    assert list(p) == [0xF1, 0x78, 0x03]                             # low nibble = even index
    assert (Q.unpack_int4_reference(p, 5) == q).all()
    with pytest.raises(ValueError, match="-8..7"):
        Q.pack_int4_reference(np.array([8], np.int8))


def test_fp8_reference():
    v = Q.fp8_reference(np.array([0.1, 1.3, 1000.0, -500.0], np.float32), "e4m3")
    assert v[2] == 448.0 and v[3] == -448.0 and abs(v[1] - 1.25) < 1e-6


# ----------------------------------------------------------------------------- Numba twins
def test_numba_quant_twins_match_references():
    nb = cb.load_numba("quant")
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, (6, 64)) * 0.05).astype(np.float32)
    w[2] = 0
    for sym in (True, False):
        for bits, G in ((8, 64), (4, 32)):
            s = np.zeros((6, 64 // G), np.float32)
            z = np.zeros_like(s)
            nb.group_scales_thread[cb.grid_1d(s.size), 256](w, s, z, G, bits, 0 if sym else 1)
            q = np.zeros((6, 64), np.int8 if sym else np.uint8)
            qmax = 2 ** (bits - 1) - 1 if sym else 2 ** bits - 1
            nb.quantize[cb.grid_1d(w.size), 256](w, s, z, q, G, -qmax if sym else 0, qmax)
            qr, sr, zr = Q.quantize_reference(w, bits, G, sym)
            assert (q == qr).all() and (s == sr).all() and (z == zr).all(), (sym, bits)
            d = np.zeros_like(w)
            nb.dequantize[cb.grid_1d(w.size), 256](q, s, z, d, G)
            np.testing.assert_allclose(d, Q.dequantize_reference(qr, sr, zr, G), rtol=1e-6)
    q4 = rng.integers(-8, 8, 13).astype(np.int8)
    p = np.zeros(7, np.uint8)
    nb.pack_int4[1, 256](q4, p)
    assert (p == Q.pack_int4_reference(q4)).all()
    u = np.zeros(13, np.int8)
    nb.unpack_int4[1, 256](p, u)
    assert (u == q4).all()


# ----------------------------------------------------------------------------- launch helpers
def test_launch_helpers_refuse_bad_input_before_the_gpu():
    qg = cb.load_launch("qgemv")
    with pytest.raises(cb.LaunchError, match="odd"):
        qg._check_group(4, 255, 255)
    with pytest.raises(cb.LaunchError, match="does not divide"):
        qg._check_group(4, 256, 96)
    with pytest.raises(cb.LaunchError, match="multiple of 32"):
        qg._check_group(4, 256, 16)
    with pytest.raises(cb.LaunchError, match="8 or 4"):
        qg._check_group(3, 256, 32)
    with pytest.raises(cb.LaunchError, match="B <= 4"):
        qg.kernel_name("qgemv_w4_v4", 5)
    assert qg.kernel_name("qgemv_w4_v3", 16) == "qgemv_w4_v3_b16_r2"
    # v5 keeps one row of x in registers: B = 1 only, instantiated per chunks per thread
    assert qg.kernel_name("qgemv_w4_v5", 1, K=8192) == "qgemv_w4_v5_c1_r4"
    assert qg.kernel_name("qgemv_w4_v5", 1, K=14336) == "qgemv_w4_v5_c2_r2"
    assert qg.config("qgemv_w4_v5", 1, 8192, K=8192, resident=396) == ((396,), (256,))
    assert qg.config("qgemv_w4_v5", 1, 100, K=8192, resident=396) == ((25,), (256,))
    with pytest.raises(cb.LaunchError, match="B must be 1"):
        qg.kernel_name("qgemv_w4_v5", 2, K=8192)
    with pytest.raises(cb.LaunchError, match="use qgemv_w4_v3"):
        qg.kernel_name("qgemv_w4_v5", 1, K=65536)
    with pytest.raises(ValueError, match="rows per step"):
        qg.kernel_name("qgemv_w4_v5", 1, rows=3, K=8192)
    assert qg.supports("qgemv_w4_v5", 1, 8192) and not qg.supports("qgemv_w4_v5", 2, 8192)
    qt = cb.load_launch("quant")
    with pytest.raises(cb.LaunchError, match="does not divide K"):
        qt._group(100, 300, 64)
    with pytest.raises(TypeError, match="positive int"):
        qt._group(100, 300, 0)
    ig = cb.load_launch("igemm")
    with pytest.raises(ValueError, match="unknown version"):
        ig.config("igemm_v9", 64, 64)
    gv = cb.load_launch("gemv")
    assert gv.kernel_name("gemv_v4", 11) == "gemv_v4_b8_r2"
    assert gv.config("gemv_v4", 11, 1001) == ((501, 2), (128,))
    assert ig.config("igemm_v3", 4096, 4096).shared == 3 * 384 * 128


@gpu
def test_gemv_qgemv_igemm_on_gpu():
    import cupy as cp

    gv, qg, ig = (cb.load_launch(n) for n in ("gemv", "qgemv", "igemm"))
    rng = cp.random.default_rng(0)
    for B, N, K in ((1, 37, 264), (3, 19, 520), (11, 6, 1000), (2, 5, 97)):
        x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
        ref = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(W).astype(np.float64).T
        for v in gv.VERSIONS:
            if v in ("gemv_v3", "gemv_v4", "gemv_v5", "gemv_v6") and K % 8:
                continue
            cb.check(gv.gemv(x, W, version=v), ref, atol=1e-2 + 1e-3 * np.sqrt(K), rtol=1e-2)
    with pytest.raises(cb.LaunchError, match="1..32"):
        gv.gemv(cp.zeros((33, 64), cp.float16), cp.zeros((8, 64), cp.float16))
    with pytest.raises(TypeError, match="float16"):
        gv.gemv(cp.zeros((1, 64), cp.float32), cp.zeros((8, 64), cp.float16))
    W = rng.standard_normal((70, 256), dtype=cp.float32)
    x = rng.standard_normal((3, 256), dtype=cp.float32).astype(cp.float16)
    for bits in (8, 4):
        w = qg.prepare(W, bits, 64)
        for xb in (x, x[:1].copy()):                   # B = 3, and B = 1 (qgemv_w4_v5)
            ref = (cp.asnumpy(xb).astype(np.float64)
                   @ cp.asnumpy(w.dequantized()).astype(np.float64).T)
            for v in qg.VERSIONS[bits]:
                if qg.supports(v, xb.shape[0], 256, 64):
                    cb.check(qg.qgemv(xb, w, version=v), ref, atol=2e-3 * np.abs(ref).max(),
                             rtol=1e-2)
    with pytest.raises(cb.LaunchError, match="B must be 1"):
        qg.qgemv(x, qg.prepare(W, 4, 64), version="qgemv_w4_v5")
    A = rng.integers(-128, 128, (130, 160), dtype=cp.int8)
    B = rng.integers(-128, 128, (70, 160), dtype=cp.int8)
    ref = cp.asnumpy(A).astype(np.int64) @ cp.asnumpy(B).astype(np.int64).T
    for v in ig.VERSIONS:
        if cb.cc() >= ig.MIN_CC[v]:
            assert (cp.asnumpy(ig.int8_matmul(A, B, version=v)) == ref).all(), v
    with pytest.raises(cb.LaunchError, match="multiple of 16"):
        ig.int8_matmul(A[:, :100].copy(), B[:, :100].copy())


# ----------------------------------------------------------------------------- ex10.1
def quantizer(*edits):
    return SOL.get("ex10.1", "quantize_rows", edits=edits)


def test_ex10_1_reference_passes(capsys):
    ex10_1(quantizer())
    assert capsys.readouterr().out.strip() == "PASS ex10.1"


def test_ex10_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex10_1(SOL.stub("ex10.1", "quantize_rows"))


@pytest.mark.parametrize("edits, hint", [
    ([("v = round(w[r, k] / s)", "v = int(w[r, k] / s)")], "rounded toward zero"),
    ([("if amax > 0 else float32(1)", "if amax >= 0 else float32(1)")], "all-zero row"),
    ([("    if r >= w.shape[0]:\n        return\n", "")], "out of range|bounds guard"),
    ([("for k in range(w.shape[1]):\n        amax",
       "for k in range(w.size):\n        amax"),
      ("amax = max(amax, abs(w[r, k]))", "amax = max(amax, abs(w[k // w.shape[1], "
                                           "k % w.shape[1]]))")], "per-tensor"),
    ([("import math", "import math")] if False else
     [("v = round(w[r, k] / s)", "v = math.floor(w[r, k] / s)"),
      ("from numba import cuda, float32", "import math\nfrom numba import cuda, float32")],
     "rounded down"),
    # a precomputed reciprocal: off by one step next to the halfway points the grader plants
    ([("v = round(w[r, k] / s)", "v = round(w[r, k] * (float32(1) / s))")],
     "multiplication by a rounded reciprocal"),
    ([("v = round(w[r, k] / s)",
       "v = round(w[r, k] * (float32(127) / amax if amax > 0 else float32(1)))")],
     "multiplication by a rounded reciprocal"),
    # the largest weight, not the largest magnitude
    ([("amax = max(amax, abs(w[r, k]))", "amax = max(amax, w[r, k])")],
     "not the largest magnitude"),
    # round half up, by hand
    ([("v = round(w[r, k] / s)", "v = int(w[r, k] / s + float32(0.5))")],
     r"int\(v \+ 0.5\) rounds negative values"),
    ([("v = round(w[r, k] / s)", "v = math.floor(w[r, k] / s + float32(0.5))"),
      ("from numba import cuda, float32", "import math\nfrom numba import cuda, float32")],
     "ties to the even neighbour"),
    # the library finds the maximum: runs in the simulator only
    ([("    for k in range(w.shape[1]):\n        amax = max(amax, abs(w[r, k]))\n",
       "    amax = float32(abs(w[r]).max())\n")], r"\.max \(an array method of NumPy\)"),
])
def test_ex10_1_wrong_answers(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_1(quantizer(*edits))


# ----------------------------------------------------------------------------- ex10.2
def packers(*edits):
    ns = SOL.namespace("ex10.2", tuple(tuple(e) for e in edits))
    return ns["pack_int4"], ns["unpack_int4"]


def test_ex10_2_reference_passes(capsys):
    ex10_2(*packers())
    assert capsys.readouterr().out.strip() == "PASS ex10.2"


def test_ex10_2_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex10_2(SOL.stub("ex10.2", "pack_int4"), SOL.stub("ex10.2", "unpack_int4"))


@pytest.mark.parametrize("edits, hint", [
    ([("p[i] = lo | (hi << 4)", "p[i] = hi | (lo << 4)")], "nibble order swapped"),
    ([("    q[i] = nib - 16 if nib >= 8 else nib", "    q[i] = nib")], "sign extension"),
    ([("hi = int32(q[2 * i + 1]) & 0xF if 2 * i + 1 < n else 0",
       "hi = int32(q[2 * i + 1]) & 0xF")], "out of range|odd"),
    ([("lo = int32(q[2 * i]) & 0xF", "lo = int32(q[2 * i])"),
      ("hi = int32(q[2 * i + 1]) & 0xF if", "hi = int32(q[2 * i + 1]) if")],
     "spill into the other nibble"),
    ([("nib = (int32(p[i // 2]) >> (4 * (i % 2))) & 0xF",
       "nib = (int32(p[i // 2]) >> (4 * (1 - i % 2))) & 0xF")], "nibble order swapped"),
    ([("    if i >= p.shape[0]:\n        return\n", "")], "out of range|bounds guard"),
    # operator precedence: 4 * i % 2 is always 0
    ([("nib = (int32(p[i // 2]) >> (4 * (i % 2))) & 0xF",
       "nib = (int32(p[i // 2]) >> (4 * i % 2)) & 0xF")], "operator precedence"),
    # off by one in the sign extension
    ([("q[i] = nib - 16 if nib >= 8 else nib", "q[i] = nib - 16 if nib > 8 else nib")],
     "-8 came back as 8"),
    ([("q[i] = nib - 16 if nib >= 8 else nib", "q[i] = nib - 15 if nib >= 8 else nib")],
     "not nib - 15"),
])
def test_ex10_2_wrong_answers(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_2(*packers(*edits))


# ----------------------------------------------------------------------------- ex10.3
def gemv(*edits):
    return SOL.get("ex10.3", "w4_gemv", edits=edits)


def test_ex10_3_reference_passes(capsys):
    ex10_3(gemv())
    assert capsys.readouterr().out.strip() == "PASS ex10.3"


def test_ex10_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex10_3(SOL.stub("ex10.3", "w4_gemv"))


@pytest.mark.parametrize("edits, hint", [
    ([("scales[n, k // G]", "scales[0, 0]"), ("scales[n, (k + 1) // G]", "scales[0, 0]")],
     "one scale per tensor"),
    ([("scales[n, k // G]", "scales[n, 0]"), ("scales[n, (k + 1) // G]", "scales[n, 0]")],
     "per-channel"),
    ([("lo = b & 0xF\n", "lo = (b >> 4) & 0xF\n"), ("hi = (b >> 4) & 0xF\n", "hi = b & 0xF\n")],
     "nibble order swapped"),
    ([("        lo = lo - 16 if lo >= 8 else lo\n        hi = hi - 16 if hi >= 8 else hi\n",
       "")], "sign extension"),
    ([("    if n >= y.shape[0]:\n        return\n", "")], "out of range|bounds guard"),
    ([("    y[n] = acc\n", "    if n > 0:\n        y[n] = acc\n")], "never written"),
    # odd group sizes: the two weights of a byte in different groups
    ([("scales[n, (k + 1) // G]", "scales[n, k // G]")], "with an odd G"),
    ([("scales[n, k // G]", "scales[n, i // G]"), ("scales[n, (k + 1) // G]", "scales[n, i // G]")],
     "indexed by the byte index|taken from the byte index"),
    ([("for i in range(p.shape[1]):", "for i in range(p.shape[1] - 1):")],
     "last byte of each row was left out"),
    ([("        acc += x[k] * float32(lo) * scales[n, k // G]\n",
       "        acc += np.float32(np.dot(x[k:k + 1], np.array([lo]))) * scales[n, k // G]\n")],
     r"np.dot .*GPU cannot compile"),
])
def test_ex10_3_wrong_answers(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_3(gemv(*edits))


# ----------------------------------------------------------------------------- ex10.4
def test_ex10_4_answers(capsys):
    table = group_table()
    assert list(table) == list(GROUP_SIZES)
    ex10_4(SOL.get("ex10.4", "group"))
    assert capsys.readouterr().out.strip() == "PASS ex10.4"
    with pytest.raises(GradeError, match="fewer bits"):
        ex10_4(32)
    with pytest.raises(GradeError, match="over the budget"):
        ex10_4(128)
    with pytest.raises(GradeError, match="not in the table"):
        ex10_4(48)
    with pytest.raises(GradeError, match="as an int"):
        ex10_4("64")
    # the smallest error (not the fewest bits), the fewest bits (over the budget), a float
    with pytest.raises(GradeError, match="fewer bits"):
        ex10_4(16)
    with pytest.raises(GradeError, match="over the budget"):
        ex10_4(1024)
    with pytest.raises(GradeError, match="as an int"):
        ex10_4(64.0)
    with pytest.raises(GradeError, match="as an int"):
        ex10_4(True)


def test_numba_gemv_twins():
    nb = cb.load_numba("gemv")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    W = rng.standard_normal((5, 100)).astype(np.float32)
    ref = x.astype(np.float64) @ W.T.astype(np.float64)
    y = np.full((3, 5), np.nan, np.float32)
    nb.gemv_v1[(1, 3), 128](x, W, y)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    y[:] = np.nan
    nb.gemv_block_per_row[(5, 3), nb.TPB](x, W, y)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- fp8 GEMM
def test_fp8gemm_v3_launcher_without_gpu():
    ig = cb.load_launch("igemm")
    assert ig.FP8_VERSIONS[-1] == "fp8gemm_v3" and ig.MIN_CC["fp8gemm_v3"] == (9, 0)
    # persistent: one block per SM (at most one per tile), 3 warpgroups, 5 stages of 128 + 128
    # rows of 128 bytes, 1 KiB of alignment slack, two 64 x 128 bf16 C tiles (rows + 16 bytes);
    # use_fast_accum: 128 x 256 tiles, 3 stages
    smem = 5 * 256 * 128 + 1024 + 2 * 64 * (2 * 128 + 16)
    assert ig.config("fp8gemm_v3", 4096, 4096, sms=132) == ((132,), (384,))
    assert ig.config("fp8gemm_v3", 4096, 4096, sms=132).shared == smem
    smem = 3 * 384 * 128 + 1024 + 2 * 64 * (2 * 256 + 16)
    assert ig.config("fp8gemm_v3", 4096, 4096, sms=132, fast=True) == ((132,), (384,))
    assert ig.config("fp8gemm_v3", 4096, 4096, sms=132, fast=True).shared == smem
    assert ig.config("fp8gemm_v3", 1, 8, sms=132)[0] == (1,)
    assert ig.config("fp8gemm_v3", 4097, 511, sms=132, fast=True)[0] == (66,)
    if not cb.HAS_GPU:
        assert ig.default_fp8() == "fp8gemm_v2"
        with pytest.raises(cb.LaunchError, match="needs a CUDA GPU"):
            ig.fp8_matmul(np.zeros((4, 16), np.uint8), np.zeros((4, 16), np.uint8),
                          np.ones(1, np.float32), np.ones(1, np.float32), version="fp8gemm_v3")
    with pytest.raises(ValueError, match="unknown version"):
        ig.fp8_matmul(None, None, None, None, version="fp8gemm_v9")


@gpu
def test_fp8gemm_on_gpu_against_float64():
    import cupy as cp
    import torch

    ig = cb.load_launch("igemm")
    if cb.cc() < (8, 9):
        pytest.skip("fp8 tensor-core GEMM needs compute capability 8.9+")
    versions = [v for v in ig.FP8_VERSIONS if v != "fp8gemm_v3" or cb.cc() == (9, 0)]
    assert ig.default_fp8() == ("fp8gemm_v3" if cb.cc() == (9, 0) else "fp8gemm_v2")
    sa, sb = cp.full(1, 0.5, cp.float32), cp.full(1, 0.375, cp.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    # ragged M and N (edge tiles zero-filled on load, stores guarded), odd N (no paired
    # stores), K not a multiple of the 128-byte k-tile, M = 1
    runs = [(v, False) for v in versions] + [("fp8gemm_v3", True)] * ("fp8gemm_v3" in versions)
    for M, N, K in ((1000, 1736, 1024), (257, 511, 400), (1, 8, 16), (3, 70, 4112)):
        A = (2 * torch.randn(M, K, device="cuda", generator=g)).to(torch.float8_e4m3fn)
        B = (2 * torch.randn(N, K, device="cuda", generator=g)).to(torch.float8_e4m3fn)
        ref = (A.double() @ B.double().t()) * (0.5 * 0.375)
        absprod = (A.double().abs() @ B.double().abs().t()) * (0.5 * 0.375)
        for v, fast in runs:
            C = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            ig.fp8_matmul(A, B, sa, sb, C, version=v, use_fast_accum=fast)
            err = (C.double() - ref).abs()
            assert not torch.isnan(C).any(), (v, M, N, K)
            # bf16 rounding (2^-8 relative) plus the accumulation's error in units of sum |a b|:
            # measured on the H100 at most 5e-5 for mma.sync and for wgmma with fp32 promotion
            # (torch._scaled_mm's own), 4e-4 for the fast accumulation at K = 4096
            bound = ref.abs() * 2.0 ** -8 + absprod * 2.0 ** (-10 if fast else -13)
            assert bool((err <= bound).all()), (v, fast, M, N, K, float((err - bound).max()))
    A8 = cp.zeros((64, 100), cp.uint8)
    with pytest.raises(cb.LaunchError, match="multiple of 16"):
        ig.fp8_matmul(A8[:, :100], A8[:, :100], sa, sb)
    with pytest.raises(cb.LaunchError, match="16-byte aligned"):
        ig.fp8_matmul(cp.zeros(64 * 32 + 1, cp.uint8)[1:].reshape(64, 32), A8[:, :32].copy(),
                      sa, sb)
    with pytest.raises(TypeError, match="uint8"):
        ig.fp8_matmul(cp.zeros((8, 32), cp.float16), cp.zeros((8, 32), cp.uint8), sa, sb)
    if cb.cc() != (9, 0):
        with pytest.raises(cb.LaunchError, match="9.0 exactly"):
            ig.fp8_matmul(A8[:, :32].copy(), A8[:, :32].copy(), sa, sb, version="fp8gemm_v3")

def _w4_against_float64(version: str, seed: int, shapes) -> list:
    """W4A16 ``version`` on each (B, N, K, G), with and without bias, against the float64
    reference of the dequantized weight; the weights it built."""
    import cupy as cp

    qg = cb.load_launch("qgemv")
    rng = cp.random.default_rng(seed)
    weights = []
    for B, N, K, G in shapes:
        x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
        w = qg.prepare(rng.standard_normal((N, K), dtype=cp.float32) * 0.02, 4, G)
        bias = rng.standard_normal(N, dtype=cp.float32).astype(cp.float16)
        ref = Q.qgemv_reference(cp.asnumpy(x), cp.asnumpy(w.dequantized()))
        for b in (None, bias):
            want = ref if b is None else ref + cp.asnumpy(b).astype(np.float64)
            y = cp.full((B, N), cp.nan, cp.float16)
            qg.qgemv(x, w, b, out=y, version=version)
            cb.check(y, want, atol=2e-3 * np.abs(want).max(), rtol=1e-2,
                     name=f"{version} B={B} N={N} K={K} G={G}")
        weights.append(w)
    return weights


def _refused_below_sm80(version: str) -> bool:
    """On a GPU below sm_80, check that ``version`` (mma.sync) is refused and return True."""
    import cupy as cp

    qg = cb.load_launch("qgemv")
    if cb.cc() >= qg.V6_MIN_CC:
        return False
    with pytest.raises(cb.LaunchError, match="8.0"):
        qg.qgemv(cp.zeros((1, 128), cp.float16), qg.prepare(cp.ones((8, 128), cp.float32), 4, 128),
                 version=version)
    return True


# ----------------------------------------------------------------------------- qgemv_w4_v6
def test_qgemv_w4_v6_launcher_checks():
    qg = cb.load_launch("qgemv")
    S, U = qg.V6_DEFAULT["large_n"]
    assert qg.kernel_name("qgemv_w4_v6", 3, K=8192, G=128, N=8192) == (
        f"qgemv_w4_v6_s{S}_u{U}_g1")
    assert qg.kernel_name("qgemv_w4_v6", 1, K=8192, G=32, N=8192).endswith("_g0")
    assert qg.kernel_name("qgemv_w4_v6", 1, K=1152, G=384, N=8).endswith("_g1")
    with pytest.raises(cb.LaunchError, match="B <= 8"):
        qg.kernel_name("qgemv_w4_v6", 9, K=256, G=64)
    with pytest.raises(cb.LaunchError, match="use qgemv_w4_v3"):
        qg.kernel_name("qgemv_w4_v6", 1, K=1 << 22, G=128)
    with pytest.raises(ValueError, match="depends on K and the group"):
        qg.kernel_name("qgemv_w4_v6", 1, K=256)
    with pytest.raises(ValueError, match="instantiated"):
        qg.v6_name(1, 256, 64, split=4)
    # a block of S warps (slices of K) per 16 rows of W
    S = qg.V6_DEFAULT["small_n"][0]
    assert qg.config("qgemv_w4_v6", 1, 4096, K=14336, G=128) == ((256,), (32 * S,))
    assert qg.config("qgemv_w4_v6", 2, 17, K=64, G=64)[0] == (2,)
    assert not qg.supports("qgemv_w4_v6", 9, 8192)
    with pytest.raises(ValueError, match="16 rows per block"):
        qg.kernel_name("qgemv_w4_v6", 1, rows=2, K=256, G=64)
    assert "qgemv_w4_v6" in qg.VERSIONS[4] and "qgemv_w4_v6" in qg.WHAT


@gpu
def test_qgemv_w4_v6_irregular_shapes_on_gpu():
    import cupy as cp

    qg = cb.load_launch("qgemv")
    if _refused_below_sm80("qgemv_w4_v6"):
        return
    # N not a multiple of the 16 rows per block, groups 32/64/128/384 and per-channel (the
    # fp16-scaled and the per-quad-scaled kernels), K / 32 not a multiple of 4 (a ragged quad),
    # B = 1..8, with and without bias
    _w4_against_float64("qgemv_w4_v6", 5, (
        (1, 7, 256, 64), (2, 37, 1024, 32), (4, 130, 2048, 128), (3, 5, 512, 512), (1, 1, 32, 32),
        (1, 259, 14336, 128), (2, 301, 8192, 64), (4, 1029, 4096, 32), (1, 2053, 1344, 64),
        (8, 77, 1344, 64), (5, 33, 1152, 384), (8, 6000, 2048, 128)))
    w = qg.prepare(cp.ones((8, 256), cp.float32), 4, 64)
    with pytest.raises(cb.LaunchError, match="B <= 8"):
        qg.qgemv(cp.zeros((9, 256), cp.float16), w, version="qgemv_w4_v6")
    buf = cp.zeros(2 * 257, cp.float16)
    with pytest.raises(cb.LaunchError, match="16-byte"):
        qg.qgemv(buf[1:257].reshape(1, 256), w, version="qgemv_w4_v6")


# ----------------------------------------------------------------------------- qgemv_w4_v7
def test_qgemv_w4_v7_launcher_checks():
    qg = cb.load_launch("qgemv")
    # the largest split whose blocks (one per 16 rows) fit in one wave at 32 / S per SM
    assert qg.v7_split(8192, 1, sms=132) == 8          # 512 blocks: 16 -> 264 slots, 8 -> 528
    assert qg.v7_split(4096, 1, sms=132) == 16         # 256 blocks
    assert qg.v7_split(14336, 1, sms=132) == 4         # 896 blocks
    assert qg.v7_split(10 ** 6, 1, sms=132) == 4       # more than one wave at any split
    with pytest.raises(cb.LaunchError, match="B <= 8"):
        qg.v7_split(4096, 9, sms=132)
    assert qg.supports("qgemv_w4_v7", 1, 256, 128) == qg.supports("qgemv_w4_v6", 1, 256)
    assert not qg.supports("qgemv_w4_v7", 1, 256, 64)  # one scale per tile of 128 k
    assert not qg.supports("qgemv_w4_v7", 1, 320)
    assert not qg.supports("qgemv_w4_v7", 9, 256)
    with pytest.raises(ValueError, match="16 rows per block"):
        qg.kernel_name("qgemv_w4_v7", 1, rows=2, K=256, G=128, N=64)
    assert "qgemv_w4_v7" in qg.VERSIONS[4] and "qgemv_w4_v7" in qg.WHAT


@gpu
def test_qgemv_w4_v7_irregular_shapes_on_gpu():
    import cupy as cp

    qg = cb.load_launch("qgemv")
    if _refused_below_sm80("qgemv_w4_v7"):
        return
    # N not a multiple of 16 (padded tiles), groups of 128/256/384 and per-channel, B = 1..8,
    # one tile of k, K with an odd number of tiles, with and without bias
    for w in _w4_against_float64("qgemv_w4_v7", 7, (
            (1, 7, 128, 128), (2, 37, 1024, 256), (4, 130, 2048, 128), (3, 5, 1152, 384),
            (1, 259, 14336, 128), (8, 77, 1280, 1280), (5, 33, 896, 128), (8, 6000, 2048, 128),
            (1, 4099, 4096, 4096))):
        t, _ = w.tiles()
        assert t.nbytes == -(-w.N // 16) * 16 * w.K // 2 and w.tiles()[0] is t   # built once
    w = qg.prepare(cp.ones((8, 256), cp.float32), 4, 64)
    with pytest.raises(cb.LaunchError, match="multiples of 128"):
        qg.qgemv(cp.zeros((1, 256), cp.float16), w, version="qgemv_w4_v7")
    w = qg.prepare(cp.ones((8, 256), cp.float32), 4, 128)
    with pytest.raises(cb.LaunchError, match="B <= 8"):
        qg.qgemv(cp.zeros((9, 256), cp.float16), w, version="qgemv_w4_v7")
    with pytest.raises(ValueError, match="not a kernel for 8"):
        qg.qgemv(cp.zeros((1, 256), cp.float16), qg.prepare(cp.ones((8, 256), cp.float32), 8, 128),
                 version="qgemv_w4_v7")


# ----------------------------------------------------------------------------- ex10.5
_W = "    w = words[..., None] >> np.array([0, 4, 8, 12], np.uint32)"
_H = "    h = ((w & 0x000F000F) | 0x64006400).view(np.float16)"
_OUT = "    out = h - np.float16(1032)"
# one nibble per value (correct bits, but in the word's slot order k0 k2 k4 k6 k1 k3 k5 k7)
_SLOTS = [(_W, "    n = (words[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 0xF"),
          (_H, "    h = (n | 0x6400).astype(np.uint16).view(np.float16)")]


def dequant(*edits):
    return SOL.get("ex10.5", "dequant_magic", edits=edits)


def test_ex10_5_w4o_references_and_format():
    from cudabook.graders.ch10 import w4o_pack_reference, w4o_unpack_reference
    assert int(w4o_pack_reference(np.arange(-8, 0))[0]) == 0x75316420   # the spec's example
    q = np.random.default_rng(5).integers(-8, 8, (3, 24))
    assert (w4o_unpack_reference(w4o_pack_reference(q)) == q).all()
    with pytest.raises(TypeError, match="uint32"):
        w4o_unpack_reference(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="-8..7"):
        w4o_pack_reference(np.full(8, 8))
    # the reference answer on the spec's example, and its stub
    out = dequant()(np.array([0x75316420], np.uint32))
    assert out.dtype == np.float16 and out.tolist() == list(range(-8, 0))


def test_ex10_5_reference_passes(capsys):
    ex10_5(dequant())
    assert capsys.readouterr().out.strip() == "PASS ex10.5"
    # the rules are read from code: a comment or a docstring naming what is refused counts not
    ex10_5(dequant((_OUT, "    # not out = n.astype(np.float16) - 8, nor for i in range(n)\n"
                          '    """np.float32(x) / 2"""\n' + _OUT)))
    assert capsys.readouterr().out.strip() == "PASS ex10.5"
    # one nibble per value, put in k order by a fancy index: also right
    ex10_5(dequant(*_SLOTS,
                   (_OUT, "    out = (h - np.float16(1032))[..., [0, 4, 1, 5, 2, 6, 3, 7]]")))
    assert capsys.readouterr().out.strip() == "PASS ex10.5"


def test_ex10_5_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex10_5(SOL.stub("ex10.5", "dequant_magic"))


@pytest.mark.parametrize("edits, hint", [
    # fp32's magic number (2^23 = 0x4B000000) in fp16
    ([("0x64006400", "0x4B004B00")], "0x4B00 is the top half of fp32's magic"),
    ([("np.float16(1032)", "np.float16(1024)")], "forgot the offset"),
    ([("h - np.float16(1032)", "h")], "subtraction is missing"),
    # the xor of qgemv_w4_v2's format (two's complement nibbles) on biased nibbles
    ([("words[..., None] >>", "(words[..., None] ^ 0x88888888) >>")], "two's complement"),
    # the interleave ignored: one nibble per value, in the order of the bits
    (_SLOTS, "interleave of the format was ignored"),
    ([("(w & 0x000F000F)", "(((w >> 16) | (w << 16)) & 0x000F000F)")], "pair are swapped"),
    # the kernel's high-nibble mask (0x00F000F0, then an FMA by 1/16) without the FMA
    ([("[0, 4, 8, 12]", "[0, 0, 8, 8]"),
      ("(w & 0x000F000F)", "(w & np.array([0x000F000F, 0x00F000F0] * 2, np.uint32))")],
     "16 n - 8"),
    ([("[0, 4, 8, 12]", "[0, 8, 4, 12]")], "right values of each word in the wrong order"),
    ([("    return out.reshape(words.shape[:-1] + (8 * words.shape[-1],))",
       "    return out")], "returned shape"),
    # conversions: the values come out right, the rule is broken
    ([(_H, "    h = (w & 0x000F000F).view(np.uint16).astype(np.float16)"),
      (_OUT, "    out = h - np.float16(8)")], r"\.astype\(float16\) .*converts integers"),
    ([(_H, "    h = np.float16((w & 0x000F000F).view(np.uint16))"),
      (_OUT, "    out = h - np.float16(8)")], r"float16\(\.\.\.\) of a variable"),
    ([(_H, "    h = np.asarray((w & 0x000F000F).view(np.uint16), dtype='e')"),
      (_OUT, "    out = h - np.float16(8)")], "converts integers"),
    ([(_H, "    one = np.float16(1)\n    h = (w & 0x000F000F).view(np.uint16) * one"),
      (_OUT, "    out = h - np.float16(8)")], "float scale"),
    # sign by arithmetic shifts of the signed int, then a conversion
    ([(_H, "    h = ((w.view(np.int32) << 28) >> 28).astype(np.half)")], "converts integers"),
    # the subtraction in float32, cast back: right values, not one fp16 subtraction
    ([(_OUT, "    out = (h.astype(np.float32) - 1032).astype(np.float16)")],
     "float32 .*one float16 subtraction"),
    ([(_OUT, "    out = h - np.float16(1032)\n    out = out.astype('f4').astype(np.float16)")],
     "one float16 subtraction"),
    ([(_OUT, "    out = h / 1 - 1032")], "the operator /"),
    # Python loops over the data
    ([(_OUT, "    out = np.array([v - np.float16(1032) for v in h.ravel()])")],
     "Python loop over the data"),
    ([(_OUT, "    out = h.copy()\n    for i in range(h.size):\n"
             "        out.flat[i] -= np.float16(1032)")], "Python loop over the data"),
    ([(_OUT, "    out = np.vectorize(lambda v: v - np.float16(1032))(h)")], "vectorize"),
])
def test_ex10_5_wrong_answers(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_5(dequant(*edits))


# ============================================================================ ex10.6 (CUDA C++)
# A W8A8 GEMM on the int8 tensor cores. The rubric (C written, an int8 mma.sync, no dp4a, no
# int8 value widened alone) is read from NVRTC's PTX, so those wrong answers are graded on a CPU
# where CuPy is installed; the values need a GPU of compute capability 8.0 or more.
from cudabook.graders import ex10_6  # noqa: E402
from cudabook.graders._static import cuda_ptx  # noqa: E402

_W8A8 = ("ex10.6", "w8a8_src")
_STORE = "C[(size_t)row * N + col] = (float)c[i] * sa[row] * sb[col];"
_MMA_LOOP = "    for (int k0 = 0; k0 < K; k0 += 32) {"
_SCALAR = ("    for (int i = 0; i < 4; ++i) {\n"
           "        int row = m0 + g + 8 * (i / 2), col = n0 + 2 * t + (i % 2);\n"
           "        for (int k = 0; k < K; ++k)\n"
           "            c[i] += A[(size_t)row * K + k] * B[(size_t)col * K + k];\n"
           "    }\n")
needs_nvrtc = pytest.mark.skipif(cuda_ptx("test", 'extern "C" __global__ void k() {}') is None,
                                 reason="NVRTC (CuPy) is not installed")


def test_ex10_6_stub_fails():
    with pytest.raises(GradeError, match="ex10.6: not implemented yet"):
        ex10_6(SOL.stub(*_W8A8))


@needs_nvrtc
@pytest.mark.parametrize("edits, hint", [
    # a scalar int loop instead of the tensor cores
    ([("        mma_s8(c, af, bf);\n", ""), (_MMA_LOOP, _SCALAR + "    if (false)\n" + _MMA_LOOP)],
     "no int8 tensor-core instruction"),
    # the same loop beside a mma that does nothing useful (the compiler makes dp4a of it)
    ([(_MMA_LOOP, _SCALAR + _MMA_LOOP)], "holds dp4a.*a scalar loop"),
    # a scalar loop of float products beside the mma
    ([(_MMA_LOOP, _SCALAR.replace("c[i] += A", "sa_f += (float)A").replace(" * B", " * (float)B")
       .replace("    for (int i", "    float sa_f = 0.f;\n    for (int i") + _MMA_LOOP),
      (_STORE, "C[(size_t)row * N + col] = (float)c[i] * sa[row] * sb[col] + 0.f * sa_f;")],
     "widens int8 values one at a time"),
    # the CUDA cores' int8 dot product
    ([("        mma_s8(c, af, bf);\n",
       "        mma_s8(c, af, bf);\n        c[0] = __dp4a((int)af[0], (int)bf[0], c[0]);\n")],
     "holds dp4a"),
])
def test_ex10_6_rubric_refuses_on_any_machine(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_6(SOL.get(*_W8A8, edits=edits))


@gpu
def test_ex10_6_reference_passes(capsys):
    ex10_6(SOL.get(*_W8A8))
    assert capsys.readouterr().out == "PASS ex10.6\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([(_STORE, "C[(size_t)row * N + col] = (float)c[i];")], "quantised units: dequantise"),
    ([(_STORE, "C[(size_t)row * N + col] = (float)c[i] * sa[row];")],
     "only one of the two scales"),
    # A's registers 1 and 2 exchanged
    ([("af[1] = *", "af[9] = *"), ("af[2] = *", "af[1] = *"), ("af[9] = *", "af[2] = *")],
     "A's registers 1 and 2 are exchanged"),
    # k + 8 for the second half, fp16's offset in elements
    ([("a + k0 + 16)", "a + k0 + 8)"), ("8 * (size_t)K + 16)", "8 * (size_t)K + 8)"),
      ("b + k0 + 16)", "b + k0 + 8)")], "the second half of k starts at 16, not 8"),
    ([("b + k0 + 16)", "b + k0 + 8)")], "B's register 1 starts at k = 8 \\+ 4t"),
    ([("row = m0 + g + 8 * (i / 2), col = n0 + 2 * t + (i % 2)",
       "row = m0 + g + 8 * (i % 2), col = n0 + 2 * t + (i / 2)")],
     "the accumulators are stored in the wrong places"),
])
def test_ex10_6_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex10_6(SOL.get(*_W8A8, edits=edits))


def test_ex10_6_states_its_stub_size_and_has_two_hints():
    from solution_cells import check_exercise_page

    check_exercise_page("10", "ex10.6")


def test_ex10_6_fragment_model():
    """The grader's model of a warp's m16n8k32 (true layout: the product itself) and of the
    fragment mistakes its hints name (each a different product)."""
    from cudabook.graders.ch10 import _FRAG_MISTAKES, _mma_with

    g = np.random.default_rng(1)
    A = g.integers(-128, 128, (32, 64), dtype=np.int8)
    B = g.integers(-128, 128, (16, 64), dtype=np.int8)
    ref = A.astype(np.int64) @ B.astype(np.int64).T
    assert (_mma_with(A, B) == ref).all()
    for a_map, b_map, c_map, hint in _FRAG_MISTAKES:
        assert not (_mma_with(A, B, a_map, b_map, c_map) == ref).all(), hint


# ============================================================================ outliers (CPU)
# W8A8 with per-token activation scales, SmoothQuant's smoothing and AWQ's scale search
# (cudabook.quant), as the lesson's outlier study runs them on the CPU.
def _outlier_case(seed=0, T=512, K=128, N=256, channels=(5, 40, 77, 120), gain=50.0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((T, K))
    w = g.standard_normal((N, K)) * 0.05
    xo = x.copy()
    xo[:, list(channels)] *= gain
    return x, xo, w


def test_activation_quantizers_refuse_bad_input():
    x = np.ones((4, 8))
    w = np.ones((3, 8))
    with pytest.raises(ValueError, match="must be 2D"):
        Q.quantize_activations(np.ones(8))
    with pytest.raises(ValueError, match="NaN or inf"):
        Q.quantize_activations(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="per must be 'token' or 'tensor'"):
        Q.quantize_activations(x, per="channel")
    with pytest.raises(TypeError, match="real numbers"):
        Q.quantize_activations(np.ones((2, 2), np.complex64))
    with pytest.raises(ValueError, match="same K"):
        Q.w8a8_reference(x, np.ones((3, 7)))
    with pytest.raises(ValueError, match="bits must be 2..8"):
        Q.w8a8_reference(x, w, bits=16)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        Q.smooth_scales(np.ones(8), w, alpha=1.5)
    with pytest.raises(ValueError, match="one entry per input channel"):
        Q.smooth_scales(np.ones(7), w)
    with pytest.raises(ValueError, match=">= 0"):
        Q.smooth_scales(-np.ones(8), w)
    with pytest.raises(ValueError, match="finite and > 0"):
        Q.smooth(x, w, np.zeros(8))
    with pytest.raises(ValueError, match="must share K"):
        Q.smooth(x, w, np.ones(7))
    with pytest.raises(ValueError, match="grid must be a positive int"):
        Q.awq_scales(x, w, grid=0)
    with pytest.raises(ValueError, match="shapes differ"):
        Q.relative_error(np.ones(3), np.ones(4))


def test_smoothquant_leaves_the_product_unchanged_in_float64():
    _, x, w = _outlier_case()
    ref = x @ w.T
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        s = Q.smooth_scales(np.abs(x).max(axis=0), w, alpha)
        xs, ws = Q.smooth(x, w, s)
        assert np.abs(xs @ ws.T - ref).max() <= 1e-12 * np.abs(ref).max(), alpha
    # alpha = 0.5 balances the two sides channel by channel: max|x_j / s_j| = max|w_j s_j|
    xs, ws = Q.smooth(x, w, Q.smooth_scales(np.abs(x).max(axis=0), w, 0.5))
    np.testing.assert_allclose(np.abs(xs).max(axis=0), np.abs(ws).max(axis=0), rtol=1e-12)
    # a channel that is all zero (in x or in w) keeps s = 1: never 0, inf or NaN
    x0, w0 = x.copy(), w.copy()
    x0[:, 0] = 0
    w0[:, 1] = 0
    s = Q.smooth_scales(np.abs(x0).max(axis=0), w0, 0.5)
    assert s[0] == 1.0 and s[1] == 1.0 and np.isfinite(s).all()


def test_per_token_scales_handle_one_huge_row():
    g = np.random.default_rng(3)
    x = g.standard_normal((16, 64))
    big = x.copy()
    big[5] *= 1000.0
    q, s = Q.quantize_activations(x, per="token")
    qb, sb = Q.quantize_activations(big, per="token")
    assert s.shape == (16, 1) and q.dtype == np.int8
    others = np.arange(16) != 5
    assert (qb[others] == q[others]).all() and (sb[others] == s[others]).all()  # untouched
    assert sb[5, 0] > 500 * s[5, 0]
    err = np.abs(qb * sb.astype(np.float64) - big)
    assert (err <= sb.astype(np.float64) / 2 * (1 + 1e-6)).all()      # half a step, row by row
    # one scale per tensor: the huge row sets it, and the other rows round to (almost) nothing
    qt, st = Q.quantize_activations(big, per="tensor")
    assert st.shape == (1, 1) and np.abs(qt[others]).max() <= 1


def test_w8a8_reference_is_the_int8_gemm():
    _, x, w = _outlier_case(seed=1, T=33, K=96, N=17, channels=(3, 50))
    for per in ("token", "tensor"):
        qx, sx = Q.quantize_activations(x, per=per)
        qw, sw, _ = Q.quantize_reference(w, 8, w.shape[1])
        acc = qx.astype(np.int64) @ qw.astype(np.int64).T               # the int32 accumulator
        want = acc * sx.astype(np.float64) * sw.astype(np.float64).T
        np.testing.assert_array_equal(Q.w8a8_reference(x, w, per), want)


def test_outlier_error_ordering():
    x, xo, w = _outlier_case()
    cal_x, cal_xo, _ = _outlier_case(seed=7)                # calibration: other tokens
    errors = {}
    for case, xe, xc in (("plain", x, cal_x), ("outliers", xo, cal_xo)):
        ref = xe @ w.T
        e = {per: Q.relative_error(Q.w8a8_reference(xe, w, per), ref)
             for per in ("tensor", "token")}
        xs, ws = Q.smooth(xe, w, Q.smooth_scales(np.abs(xc).max(axis=0), w, 0.5))
        for per in ("tensor", "token"):
            e[f"sq {per}"] = Q.relative_error(Q.w8a8_reference(xs, ws, per), ref)
        errors[case] = e
    p, o = errors["plain"], errors["outliers"]
    assert max(p.values()) < 2 * min(p.values())            # no outliers: every scheme is close
    assert o["tensor"] > o["token"] > o["sq token"]         # per tensor worst, smoothing best
    assert o["tensor"] > 3 * p["tensor"]                     # the outliers ruin per-tensor scales
    assert o["sq tensor"] < o["tensor"] / 3 and o["sq token"] < 1.5 * p["token"]


def test_awq_search_never_worse_on_calibration_and_helps_with_outliers():
    x, xo, w = _outlier_case(K=256)
    for xe in (x, xo):
        ref = xe @ w.T
        q, sc, z = Q.quantize_reference(w, 4, 128)
        rtn = Q.relative_error(xe @ Q.dequantize_reference(q, sc, z, 128).T, ref)
        s, alpha = Q.awq_scales(xe, w, bits=4, group=128, grid=10)
        q, sc, z = Q.quantize_reference(w * s, 4, 128)
        awq = Q.relative_error(xe @ (Q.dequantize_reference(q, sc, z, 128) / s).T, ref)
        assert awq <= rtn and 0.0 <= alpha <= 1.0 and s.shape == (256,)
    assert awq < rtn / 1.5                                  # the outlier case gains clearly
