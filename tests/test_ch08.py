"""Chapter 8: the hgemm launch helpers (operand, architecture and parameter checks), the
fp32-accumulation error bound, every kernel of kernels/hgemm.cu on ragged shapes (GPU), and the
graders ex08_1..ex08_5: the reference passes, the stub fails, and wrong answers generated from the
reference fail with the hint for their mistake."""

from __future__ import annotations

import numpy as np
import pytest
from solution_cells import Solution

import cudabook as cb
from cudabook.graders import GradeError, ex08_1, ex08_2, ex08_3, ex08_4, ex08_5
from cudabook.graders._static import cuda_ptx

hg = cb.load_launch("hgemm")
SOL = Solution("08")
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not cb.HAS_GPU, reason="needs a CUDA GPU")
#: NVRTC compiles without a GPU: the graders' PTX rubric runs wherever CuPy is installed
needs_nvrtc = pytest.mark.skipif(cuda_ptx("test", 'extern "C" __global__ void k() {}') is None,
                                 reason="NVRTC (CuPy) is not installed")


# ============================================================================ launch helpers

def _mats(M, N, K, dtype=np.float16):
    return np.zeros((M, K), dtype), np.zeros((N, K), dtype), np.zeros((M, N), dtype)


@pytest.mark.skipif(cb.HAS_GPU, reason="host arrays are refused on a GPU (tested below)")
def test_check_operands_errors():
    A, B, C = _mats(100, 50, 64)
    assert hg.check_operands(A, B, C) == (100, 50, 64, "float16")
    cases = [((A.astype(np.float32), B, C), TypeError, "float16 or bfloat16"),
             ((A, B[:, :32].copy(), C), ValueError, "second dimensions must match"),
             ((A[:, :60].copy(), B[:, :60].copy(), C), ValueError, "not a multiple of 8"),
             ((A, B, C.T), ValueError, "C-contiguous"),
             ((A, B, C[:50].copy()), ValueError, "C must be 100x50"),
             ((A.ravel(), B, C), ValueError, "2D"),
             ((A, B.astype(np.float32), C), TypeError, "float16 or bfloat16"),
             ((A, B, C.astype(np.float32)), TypeError, "float16 or bfloat16"),
             (([1, 2], B, C), TypeError, "expected a GPU array")]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            hg.check_operands(*args)
    buf = np.zeros(100 * 64 + 8, np.float16)
    off = buf[1:1 + 100 * 64].reshape(100, 64)      # a view 2 bytes past an aligned start
    if off.ctypes.data % 16:
        with pytest.raises(ValueError, match="16-byte aligned"):
            hg.check_operands(off, B)


def test_require_names_the_minimum_cc():
    hg.require("v1", (7, 5))
    hg.require("v8", (9, 0), "bfloat16")
    with pytest.raises(hg.UnsupportedError, match="compute capability 8.0"):
        hg.require("v5", (7, 5))
    with pytest.raises(hg.UnsupportedError, match="9.0 exactly"):
        hg.require("v7", (8, 0))
    with pytest.raises(hg.UnsupportedError, match="9.0 exactly"):
        hg.require("v8", (10, 0))
    with pytest.raises(hg.UnsupportedError, match="bf16 tensor-core instructions need compute "
                       "capability 8.0"):
        hg.require("v3", (7, 5), "bfloat16")
    with pytest.raises(hg.UnsupportedError, match="no bf16 kernel"):
        hg.require("v1", (9, 0), "bfloat16")
    with pytest.raises(ValueError, match="unknown version"):
        hg.require("v11", (9, 0))
    assert issubclass(hg.UnsupportedError, cb.LaunchError)


def test_config_and_params():
    assert hg.config("v1", 100, 33, 8)["grid"] == (2, 4)
    assert hg.config("v2", 100, 300, 8)["grid"] == (3, 1)
    c = hg.config("v6", 1000, 777, 520)
    assert c["grid"] == (8 * 4,) and c["block"] == (256,) and c["shared"] == 3 * 384 * 64 * 2
    assert hg.config("v5", 10, 10, 8, dtype="bfloat16")["kernel"] == "hgemm_v5_bf16"
    c = hg.config("v10", 4096, 4096, 4096, dtype="bfloat16")
    assert c["kernel"] == "hgemm_v10_bf16" and c["shared"] == 3 * 384 * 64 * 2
    assert c["grid"] == (32 * 16,) and c["block"] == (256,)
    with pytest.raises(hg.UnsupportedError, match="compute capability 8.0"):
        hg.require("v10", (7, 5))
    c = hg.config("v9", 4096, 4096, 4096, cc=(9, 0), sms=132)
    assert c["grid"] == (132,) and c["block"] == (384,)
    assert c["kernel"] == "hgemm_tma_t<256, 4, true, __half>"
    c = hg.config("v9", 4096, 4096, 4096, cc=(8, 0))
    assert c["kernel"] == "hgemm_mma10_t<128, 256, 3, true, 8, __half>"
    assert c["block"] == (256,) and c["shared"] == 3 * 384 * 128
    c = hg.config("v9", 4096, 4096, 4096, cc=(7, 5))
    assert c["kernel"].startswith("hgemm_mma_t<128, 128, 64, 32, 1, false, 8")
    assert hg.config("v9", 64, 64, 64, cc=(9, 0), params=hg.DEFAULT_SM80)["block"] == (256,)
    for cc in ((7, 5), (8, 0), (9, 0)):
        for p in hg.candidates(cc) + hg.candidates(cc, "mma"):
            hg.check_params(hg.v9_family(cc, p), p)
    with pytest.raises(ValueError, match="DBUF=1"):
        hg.check_params("mma", dict(hg.DEFAULT_SM80, STAGES=2))
    with pytest.raises(ValueError, match="must divide"):
        hg.check_params("mma", dict(hg.DEFAULT_SM80, WN=96))
    with pytest.raises(ValueError, match="128 x 256 or 256 x 128"):
        hg.check_params("mma", dict(hg.DEFAULT_MMA10, BN=128))
    with pytest.raises(ValueError, match="STAGES >= 3"):
        hg.check_params("mma", dict(hg.DEFAULT_MMA10, STAGES=2))
    with pytest.raises(ValueError, match="mma10 parameters"):
        hg.check_params("mma", dict(hg.DEFAULT_MMA10, DBUF=1))
    with pytest.raises(ValueError, match="BN must be"):
        hg.check_params("tma", dict(hg.DEFAULT_SM90, BN=192))


def test_tolerance_separates_fp32_from_fp16_accumulation():
    """The bound passes fp32 accumulation and fails fp16 accumulation at K = 4096 (emulated)."""
    rng = np.random.default_rng(0)
    K = 4096
    a = rng.standard_normal((32, K)).astype(np.float16)
    b = rng.standard_normal((32, K)).astype(np.float16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64.T
    bound = hg.tolerance(np.abs(a64) @ np.abs(b64).T, ref, K)
    c32 = (a.astype(np.float32) @ b.astype(np.float32).T).astype(np.float16)
    acc = np.zeros((32, 32), np.float16)
    for k0 in range(0, K, 16):       # a tensor core's k16 step, the running sum rounded to fp16
        acc = (acc.astype(np.float32) + a[:, k0:k0 + 16].astype(np.float32)
               @ b[:, k0:k0 + 16].astype(np.float32).T).astype(np.float16)
    assert (np.abs(c32 - ref) <= bound).all()
    assert (np.abs(acc - ref) > bound).mean() > 0.1


def test_kernel_header_lists_every_version():
    src = cb.kernel_source("hgemm.cu")
    for v in hg.VERSIONS:
        assert f"hgemm_{v} " in src.split("#include")[0], v


# ============================================================================ kernels (GPU)

# (300, 600, 192): interior blocks (v10's predicate-free path) beside edge blocks
SHAPES = [(1, 1, 8), (127, 129, 72), (1000, 777, 520), (4096, 24, 64), (16, 3000, 136),
          (300, 600, 192)]


@gpu
@needs_gpu
def test_every_version_ragged_fp16_and_bf16():
    import cupy as cp
    import torch

    mod = hg.load()
    rng = np.random.default_rng(3)
    for v in hg.VERSIONS:
        for dtype in ("float16", "bfloat16"):
            try:
                hg.require(v, cb.cc(), dtype)
            except hg.UnsupportedError:
                continue
            for M, N, K in SHAPES:
                a = rng.standard_normal((M, K)).astype(np.float32)
                b = rng.standard_normal((N, K)).astype(np.float32)
                if dtype == "float16":
                    A, B = cp.asarray(a, dtype=cp.float16), cp.asarray(b, dtype=cp.float16)
                    C = cp.full((M, N), cp.nan, cp.float16)
                else:
                    A = torch.tensor(a, device="cuda").bfloat16()
                    B = torch.tensor(b, device="cuda").bfloat16()
                    C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                hg.launch(mod, v, A, B, C)
                hg.check(C, A, B, name=f"{v} {dtype} {M}x{N}x{K}")


@gpu
@needs_gpu
def test_matmul_pads_k_and_takes_torch_and_numba_arrays():
    import cupy as cp
    import torch
    from numba import cuda

    A = cp.random.standard_normal((65, 517), dtype=cp.float32).astype(cp.float16)
    B = cp.random.standard_normal((33, 517), dtype=cp.float32).astype(cp.float16)
    hg.check(hg.matmul(A, B, "v2"), A, B)
    At = torch.randn(70, 64, device="cuda").half()
    Bt = torch.randn(90, 64, device="cuda").half()
    hg.check(hg.matmul(At, Bt), At, Bt)
    Cn = cuda.device_array((70, 90), dtype=np.float16)
    hg.launch(hg.load(), "v4", cuda.as_cuda_array(At), cuda.as_cuda_array(Bt), Cn)
    hg.check(Cn, At, Bt)


@gpu
@needs_gpu
def test_bad_input_refused_before_launch():
    import cupy as cp

    mod = hg.load()
    A = cp.zeros((64, 72), cp.float16)
    B = cp.zeros((32, 72), cp.float16)
    C = cp.zeros((64, 32), cp.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        hg.launch(mod, "v4", cp.zeros(64 * 72 + 8, cp.float16)[1:1 + 64 * 72].reshape(64, 72),
                  B, C)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        hg.launch(mod, "v4", A.astype(cp.float32), B, C)
    with pytest.raises(TypeError, match="host"):
        hg.launch(mod, "v4", cp.asnumpy(A), B, C)
    if cb.cc() != (9, 0):
        with pytest.raises(hg.UnsupportedError, match="9.0"):
            hg.launch(mod, "v8", A, B, C)


# ============================================================================ ex08_2, ex08_3 (CPU)

FRAGS = ("a_frag", "b_frag", "c_frag")


def _frags(edits=()):
    return [SOL.get("ex08.2", f, edits=edits) for f in FRAGS]


def test_ex08_2_reference_passes(capsys):
    ex08_2(*_frags())
    assert capsys.readouterr().out.strip() == "PASS ex08.2"


def test_ex08_2_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex08_2(*[SOL.stub("ex08.2", f) for f in FRAGS])


@pytest.mark.parametrize("edit,hint", [
    (("g, t = lane // 4, lane % 4", "g, t = lane % 4, lane // 4", 3),
     "group and thread swapped"),
    (("return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)",
      "return g + 8 * (reg // 2), 2 * t + half + 8 * (reg % 2)"),
     "register 1 holds row g\\+8"),
    (("return 2 * t + i % 2 + 8 * (i // 2), g", "return 2 * t + i % 2 + 8 * (i // 2), g % 4"),
     "wrong for lanes 16-31 only"),
    (("return g + 8 * (i // 2), 2 * t + i % 2", "return g + 8 * (i % 2), 2 * t + i // 2"),
     "right elements in the wrong order"),
    (("return 2 * t + i % 2 + 8 * (i // 2), g", "return g, 2 * t + i % 2 + 8 * (i // 2)"),
     "the pair is swapped: b_frag returns k, n, in that order"),
    (("2 * t + half + 8 * (reg // 2)", "2 * t + half + 8 * reg"), "lies outside A, which is 16x16"),
    (("2 * t + half + 8 * (reg // 2)", "t + half + 8 * (reg // 2)"), "claimed twice"),
])
def test_ex08_2_wrong_answers(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex08_2(*_frags(edits=[edit]))


def test_ex08_2_names_the_lanes():
    a, b, c = _frags()
    wrong_upper = lambda lane, i: a(lane ^ 1, i) if lane >= 28 else a(lane, i)  # noqa: E731
    with pytest.raises(GradeError, match="lanes 28-31 only"):
        ex08_2(wrong_upper, b, c)


REF_83 = "chunk ^ ((row >> 1) & 3)"        # the solution's line (64-byte rows)


def test_ex08_3_reference_and_an_alternative_pass(capsys):
    ex08_3(SOL.get("ex08.3", "swizzle"))
    ex08_3(SOL.get("ex08.3", "swizzle", edits=[(REF_83, "(chunk + (row >> 1)) % 4")]))
    assert capsys.readouterr().out.split() == ["PASS", "ex08.3"] * 2


def test_ex08_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex08_3(SOL.stub("ex08.3", "swizzle"))


@pytest.mark.parametrize("new,hint", [
    ("chunk ^ (row % 8)", "outside the row \\(chunks 0..3\\)"),     # the lesson's 128-byte one
    ("chunk ^ (row % 4)", "2-way bank conflict.*rows r and r \\+ 1 share"),
    ("chunk", "4-way bank conflict.*same order"),
    ("(chunk + row) % 2", "not a bijection"),
    ("(chunk ^ ((row >> 1) & 3)) / 1", "expected an int"),
    ("chunk ^ (row // 8 % 4)", "same order"),
])
def test_ex08_3_wrong_answers(new, hint):
    with pytest.raises(GradeError, match=hint):
        ex08_3(SOL.get("ex08.3", "swizzle", edits=[(REF_83, new)]))


def test_ex08_3_other_row_widths(capsys):
    """The grader also takes the lesson's 128-byte rows and 256-byte ones, and refuses others."""
    ex08_3(lambda row, chunk: chunk ^ (row % 8), row_bytes=128)
    ex08_3(lambda row, chunk: chunk ^ (row % 8), row_bytes=256)   # 16 chunks: the low 3 bits do
    assert capsys.readouterr().out.split() == ["PASS", "ex08.3"] * 2
    with pytest.raises(GradeError, match="8-way bank conflict for ldmatrix"):
        ex08_3(lambda row, chunk: chunk, row_bytes=128)
    with pytest.raises(ValueError, match="row_bytes must be 64, 128 or 256"):
        ex08_3(SOL.get("ex08.3", "swizzle"), row_bytes=96)


def test_lesson_swizzle_is_the_kernels():
    """The lesson's swizzle of 128-byte rows, chunk ^ (row % 8), is the one hgemm.cu's tile_index
    uses: the kernel's return expression, its ternary made Python, evaluated on a tile's 64 rows x
    8 chunks gives each chunk's physical place, and it must equal the lesson's."""
    import re

    src = cb.kernel_source("hgemm.cu", "tile_index")
    m = re.search(r"int tile_index\(int r, int c\) \{\s*return (.+?);\s*\}", src)
    assert m, f"tile_index changed shape; update this test:\n{src}"
    expr, n = re.subn(r"\(SWZ \? (.+?) : c\)", r"((\1) if SWZ else c)", m.group(1))
    assert n == 1, f"tile_index's 'SWZ ? ... : c' is gone: {m.group(1)}"
    index = eval(f"lambda r, c, SWZ: {expr}")  # noqa: S307  (the kernel's own arithmetic)
    def swizzle(row, chunk):          # the lesson's (its figure and text); ex08.3 asks for 64 bytes
        return chunk ^ (row % 8)

    for r in range(64):
        for c in range(8):
            assert index(r, c, False) == r * 64 + 8 * c, (r, c)      # plain: chunk c at c
            got = index(r, c, True) - r * 64
            assert got % 8 == 0 and got // 8 == swizzle(r, c), \
                f"row {r} chunk {c}: tile_index puts it at element {got}, the lesson at " \
                f"chunk {swizzle(r, c)}"


# ============================================================================ ex08_1 rubric (CPU)

#: a plausible answer without tensor cores: one thread per element of C, a scalar loop over K
SCALAR_1 = """    const int m0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
    for (int e = threadIdx.x; e < 32 * 32; e += 128) {
        const int r = m0 + e / 32, c = n0 + e % 32;
        if (r >= M || c >= N) continue;
        float sum = 0.0f;
        for (int k = 0; k < K; k++)
            sum += __half2float(A[(size_t)r * K + k]) * __half2float(B[(size_t)c * K + k]);
        C[(size_t)r * N + c] = sum;
    }
"""
BEGIN_1, END_1 = "    // BEGIN SOLUTION ex08.1\n", "    // END SOLUTION\n"


def _src_1(edits):
    return SOL.get("ex08.1", "wmma_tile_src", edits=edits)


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the grader goes on (test_ex08_1_reference_passes)")
@needs_nvrtc
def test_ex08_1_reference_meets_the_rubric_on_a_cpu():
    """The code and PTX rubric runs before the GPU is needed: the reference gets that far."""
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        ex08_1(_src_1([]))


@pytest.mark.parametrize("edits,hint", [
    # the stub: the region is gone
    ([(BEGIN_1, BEGIN_1 + "/*"), (END_1, "*/\n" + END_1)], "still the stub"),
    # a scalar loop gives the right numbers without tensor cores
    ([(BEGIN_1, BEGIN_1 + "/*"), (END_1, "*/\n" + SCALAR_1 + END_1)],
     "no tensor-core instruction in the code"),
    # ... also when a comment still names wmma::mma_sync
    ([(BEGIN_1, BEGIN_1 + "/*"), (END_1, "*/\n" + SCALAR_1 + "    // wmma::mma_sync(acc, a, b, "
                                  "acc); __syncthreads();\n" + END_1)],
     "no tensor-core instruction in the code"),
    # barriers removed: nothing orders the tile loads and the fragment loads
    ([("        __syncthreads();\n", "", 2)], "no __syncthreads"),
])
def test_ex08_1_rubric_from_the_code(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex08_1(_src_1(edits))


@needs_nvrtc
@pytest.mark.parametrize("edits,hint", [
    # the WMMA attempt kept under #if 0, a scalar loop doing the work: only the PTX tells
    ([(BEGIN_1, BEGIN_1 + "#if 0\n"), (END_1, "#endif\n" + SCALAR_1 + END_1)],
     "compiled kernel has no tensor-core instruction"),
    ([("typedef float acc_t;", "typedef half acc_t;")], "accumulates in fp16.*fp16 accumulation"),
])
def test_ex08_1_rubric_from_the_ptx(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex08_1(_src_1(edits))


# ============================================================================ ex08_1, ex08_4 (GPU)

@gpu
@needs_gpu
def test_ex08_1_reference_passes(capsys):
    ex08_1(SOL.get("ex08.1", "wmma_tile_src"))
    assert capsys.readouterr().out.strip().endswith("PASS ex08.1")


WRONG_1 = [
    ([], "still the stub"),
    ([("typedef float acc_t;", "typedef half acc_t;")], "fp16 accumulation"),
    ([("        wmma::mma_sync(acc, a, b, acc);\n        __syncthreads();\n",
       "        wmma::mma_sync(acc, a, b, acc);\n")], "__syncthreads"),
    ([("if (r < M && c < N) C[", "C[")], "store guard|past the end"),
    # the loads skip the elements outside A and B instead of writing zeros: stale tile values
    ([("As[e] = (m0 + r < M && k0 + c < K) ? A[(size_t)(m0 + r) * K + k0 + c] : "
       "__float2half(0.0f);",
       "if (m0 + r < M && k0 + c < K) As[e] = A[(size_t)(m0 + r) * K + k0 + c];"),
      ("Bs[e] = (n0 + r < N && k0 + c < K) ? B[(size_t)(n0 + r) * K + k0 + c] : "
       "__float2half(0.0f);",
       "if (n0 + r < N && k0 + c < K) Bs[e] = B[(size_t)(n0 + r) * K + k0 + c];")],
     "[Zz]ero-fill the loads"),
    # B read as row-major: the fragment holds B^T's transpose, so C = A @ B-ish garbage
    ([("wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b;",
       "wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b;")], "wrong products"),
    # the result rounded through half on its way to C: inf where C is beyond fp16's range
    ([("= (float)Cs[warp][e];", "= __half2float(__float2half(Cs[warp][e]));")],
     "beyond fp16's largest value"),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("edits,hint", WRONG_1)
def test_ex08_1_wrong_answers(edits, hint):
    src = SOL.stub("ex08.1", "wmma_tile_src") if not edits else \
        SOL.get("ex08.1", "wmma_tile_src", edits=edits)
    with pytest.raises(GradeError, match=hint):
        ex08_1(src)


_STEADY_WAIT = ("        cp_async_wait<STAGES - 2>();                          // my copies of "
                "tile kt")
_DRAIN_WAIT = "        cp_async_wait_upto<STAGES - 2>(KT - 1 - kt);\n"
_DRAIN_SYNC = ("        __syncthreads();                                      // everyone's copies "
               "of tile kt have landed\n")
_MMA = "        mma_stage(As + (kt % STAGES) * BM * BK, Bs + (kt % STAGES) * BN * BK, acc);\n"
#: the lesson's loop, pasted in: right values, but it commits empty groups and never drains
_LESSON_LOOP = """    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) {
            copy_tile<BM>(As + s * BM * BK, A, M, K, m0, s * BK);
            copy_tile<BN>(Bs + s * BN * BK, B, N, K, n0, s * BK);
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1, ns = nk % STAGES;
        if (nk < KT) {
            copy_tile<BM>(As + ns * BM * BK, A, M, K, m0, nk * BK);
            copy_tile<BN>(Bs + ns * BN * BK, B, N, K, n0, nk * BK);
        }
        cp_async_commit();
        mma_stage(As + (kt % STAGES) * BM * BK, Bs + (kt % STAGES) * BN * BK, acc);
    }
"""


def _with_loop(body: str) -> str:
    """ex08.4's source with its whole solution region replaced by ``body``."""
    src = SOL.get("ex08.4", "hgemm_pipe_src")
    a = src.index("    // BEGIN SOLUTION ex08.4\n") + len("    // BEGIN SOLUTION ex08.4\n")
    return src[:a] + body + src[src.index("    // END SOLUTION"):]


@gpu
@needs_gpu
def test_ex08_4_reference_passes(capsys):
    if cb.cc() < (8, 0):
        pytest.skip("cp.async needs compute capability 8.0")
    ex08_4(SOL.get("ex08.4", "hgemm_pipe_src"))
    assert capsys.readouterr().out.strip().endswith("PASS ex08.4")


@pytest.mark.parametrize("edits,hint", [
    ([], "main loop is missing"),
    ([(_STEADY_WAIT, "        //"), (_DRAIN_WAIT, "")], "no cp_async_wait"),
    ([("        __syncthreads();", "        //", 2)], "no __syncthreads"),
    # the one-stage wait, and a count right for one depth only: numbers written in
    ([("cp_async_wait<STAGES - 2>();", "cp_async_wait<0>();")], "cp_async_wait<0>\\(\\) waits with "
     "a number written in(.|\n)*one-stage loop"),
    ([("cp_async_wait<STAGES - 2>();", "cp_async_wait<1>();")], "cp_async_wait<1>\\(\\) waits with "
     "a number written in"),
])
def test_ex08_4_static_checks(edits, hint):
    """Caught from the source before anything runs (CPU too): the stub, no wait, no barrier, a
    wait count written as a number."""
    src = SOL.stub("ex08.4", "hgemm_pipe_src") if not edits else \
        SOL.get("ex08.4", "hgemm_pipe_src", edits=edits)
    with pytest.raises(GradeError, match=hint):
        ex08_4(src)


@needs_nvrtc
@pytest.mark.parametrize("src,hint", [
    # the lesson's loop: always STAGES - 2, empty groups at the tail
    (lambda: _with_loop(_LESSON_LOOP), "at STAGES = 3 the compiled kernel waits with the counts "
     "\\[1\\], a peeled pipeline with \\[0, 1\\]"),
    # a drain that waits for everything: right values, less overlap, the wrong counts at 4
    (lambda: SOL.get("ex08.4", "hgemm_pipe_src", edits=[(_DRAIN_WAIT, "        cp_async_wait_upto"
                                                          "<0>(0);\n")]),
     "at STAGES = 3 the compiled kernel waits with the counts \\[0\\]|at STAGES = 4 .*\\[0, 2\\]"),
    # one group too few waited for: tile kt may still be in flight
    (lambda: SOL.get("ex08.4", "hgemm_pipe_src", edits=[
        ("cp_async_wait<STAGES - 2>();", "cp_async_wait<STAGES - 1>();")]),
     "at STAGES = 2 the kernel waits with cp.async.wait_group 1"),
], ids=["lesson-loop", "drain-waits-all", "too-few-waited"])
def test_ex08_4_wait_counts_read_from_the_ptx(src, hint):
    with pytest.raises(GradeError, match=hint):
        ex08_4(src())


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the grader goes on (test_ex08_4_reference_passes)")
@needs_nvrtc
def test_ex08_4_reference_meets_the_rubric_on_a_cpu():
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        ex08_4(SOL.get("ex08.4", "hgemm_pipe_src"))


WRONG_4 = [
    # the next tile's copies go into the stage about to be read
    ([("const int nk = kt + STAGES - 1, ns = nk % STAGES;",
       "const int nk = kt + STAGES - 1, ns = kt % STAGES;")],
     "wrong products|racecheck|initcheck"),
    # the drain multiplies the stage after the one that holds tile kt
    ([(_DRAIN_SYNC + _MMA, _DRAIN_SYNC + _MMA.replace("(kt % STAGES)", "((kt + 1) % STAGES)"))],
     "wrong products|never written|all zeros"),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("edits,hint", WRONG_4, ids=["copy-into-read-stage",
                                                      "drain-wrong-stage"])
def test_ex08_4_wrong_answers(edits, hint):
    if cb.cc() < (8, 0):
        pytest.skip("cp.async needs compute capability 8.0")
    with pytest.raises(GradeError, match=hint):
        ex08_4(SOL.get("ex08.4", "hgemm_pipe_src", edits=edits))


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the wrong answers run in full (above)")
@needs_nvrtc
@pytest.mark.parametrize("grader,ex,name,edits,hint",
                         [(ex08_1, "ex08.1", "wmma_tile_src", e, h) for e, h in WRONG_1 if e]
                         + [(ex08_4, "ex08.4", "hgemm_pipe_src", e, h) for e, h in WRONG_4])
def test_gpu_wrong_answers_still_apply(grader, ex, name, edits, hint):
    """On a CPU: each GPU-only wrong answer's edits still apply to the solution, and the answer
    gets through the code and PTX rubric to the GPU checks (or is caught there with its hint)."""
    with pytest.raises(GradeError, match=f"needs a CUDA GPU|{hint}"):
        grader(SOL.get(ex, name, edits=edits))


# ============================================================================ ex08.5: wgmma

_WG_CALL = ("            wgmma_m64n64k16_f16(d, wgmma_desc_sw128(As + 16 * kk), "
            "wgmma_desc_sw128(Bs + 16 * kk));\n")
_SWIZZLED = "at = r * 64 + 8 * (c ^ (r % 8));"

#: caught from the source and its sm_90a PTX, before anything runs (CPU too, with NVRTC)
STATIC_5 = [
    ([], "still the stub"),
    # a warp's mma.sync in place of the warpgroup's wgmma
    ([(_WG_CALL, "            mma_m16n8k16_f16(d, nullptr, nullptr);\n")], "mma.sync / WMMA"),
    # a scalar product: the same numbers, no tensor core
    ([(_WG_CALL, "            for (int e = 0; e < 16; e++) d[e] += __half2float(As[16 * kk + e])"
                 " * __half2float(Bs[e]);\n")], "no wgmma_m64n64k16_f16 call"),
    ([("        wgmma_fence();\n", "")], "no wgmma_fence\\(\\)"),
    ([("        wgmma_commit();\n", "")], "no wgmma_commit\\(\\)"),
    ([("        wgmma_wait<0>();", "        //")], "no wgmma_wait<0>\\(\\)"),
    ([("wgmma_wait<0>();", "wgmma_wait<1>();")], "wgmma_wait<1>\\(\\), which lets 1 group"),
    ([("        fence_proxy_async();", "        //")], "no fence_proxy_async\\(\\)"),
    ([("        __syncthreads();                   // before the next k-step", "        //")],
     "fewer than two __syncthreads"),
]


@needs_nvrtc
@pytest.mark.parametrize("edits,hint", STATIC_5, ids=["stub", "mma-sync", "scalar", "no-fence",
                                                       "no-commit", "no-wait", "wait-1",
                                                       "no-proxy-fence", "one-barrier"])
def test_ex08_5_refused_from_the_source(edits, hint):
    src = SOL.stub("ex08.5", "wgmma_tile_src") if not edits else \
        SOL.get("ex08.5", "wgmma_tile_src", edits=edits)
    with pytest.raises(GradeError, match=hint):
        ex08_5(src)


def _hopper():
    if cb.cc() != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")


@gpu
@needs_gpu
def test_ex08_5_reference_passes(capsys):
    _hopper()
    ex08_5(SOL.get("ex08.5", "wgmma_tile_src"))
    assert capsys.readouterr().out.strip().endswith("PASS ex08.5")


#: right rubric, wrong values: named by the pattern they leave in C
WRONG_5 = [
    ([(_SWIZZLED, "at = r * 64 + 8 * c;")], "without the 128-byte swizzle"),
    ([(_WG_CALL, "            wgmma_m64n64k16_f16(d, wgmma_desc_sw128(As), "
                 "wgmma_desc_sw128(Bs));\n")], "every k16 slice read the same 16 columns"),
    ([(_WG_CALL, "            wgmma_m64n64k16_f16(d, wgmma_desc_sw128(Bs + 16 * kk), "
                 "wgmma_desc_sw128(As + 16 * kk));\n")], "tile of C came out transposed"),
    ([("k0 < K; k0 += 64", "k0 < 64; k0 += 64")], "only the first 64 of the K columns"),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("edits,hint", WRONG_5, ids=["no-swizzle", "descriptor-fixed",
                                                      "swapped", "first-k-tile"])
def test_ex08_5_wrong_answers(edits, hint):
    _hopper()
    with pytest.raises(GradeError, match=hint):
        ex08_5(SOL.get("ex08.5", "wgmma_tile_src", edits=edits))


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the reference and wrong answers run in full")
@needs_nvrtc
@pytest.mark.parametrize("edits,hint", [([], "")] + WRONG_5)
def test_ex08_5_gpu_answers_pass_the_rubric_on_a_cpu(edits, hint):
    """On a CPU: the reference and each GPU-only wrong answer get through the source and PTX
    rubric to the GPU checks (their edits still apply to the solution)."""
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        ex08_5(SOL.get("ex08.5", "wgmma_tile_src", edits=edits))


def test_ex08_5_swizzle_pattern_is_what_wgmma_reads():
    """The grader's model of an unswizzled tile: logical chunk c of row r is read from physical
    chunk c ^ (r % 8), which holds logical chunk c ^ (r % 8)."""
    from cudabook.graders.ch08 import _swizzle_off

    X = np.arange(16 * 128).reshape(16, 128)
    Y = _swizzle_off(X)
    for r in (0, 3, 9):
        for t in (0, 1):
            for c in range(8):
                got = Y[r, 64 * t + 8 * c: 64 * t + 8 * c + 8]
                want = X[r, 64 * t + 8 * (c ^ (r % 8)): 64 * t + 8 * (c ^ (r % 8)) + 8]
                assert (got == want).all()


def test_ex08_5_states_its_stub_size():
    from solution_cells import exercise_page

    said, stubs, levels = exercise_page("08")["ex08.5"]
    assert said == stubs and levels == [2], (said, stubs, levels)
