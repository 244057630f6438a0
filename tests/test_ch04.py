"""Chapter 4: the matmul kernels (Numba in the simulator, CuPy on a GPU), the launch
description, and the graders ex04_1..ex04_4: the reference passes, the stub fails, plausible
wrong answers fail with the hint that names their mistake. References come from
solutions/04_tiling.ipynb; wrong answers are edits of them (tests/solution_cells.py)."""
# ruff: noqa: I001  (cudabook must be imported before numba.cuda)

import re

import numpy as np
import pytest
from solution_cells import Solution, pencil_tests, strip_solutions

import cudabook as cb  # first: decides GPU or simulator mode
from cudabook import env
from cudabook import graders
from cudabook.graders import GradeError, ex04_1, ex04_2, ex04_3, ex04_4
from cudabook.graders.ch04 import diagnose_2d
from numba import cuda

mm = cb.load_launch("matmul")
gpu = pytest.mark.gpu
SOL = Solution("04")
# the two messages that say a barrier is missing: the values showed it, or racecheck did
BARRIER = (r"racecheck found a race|missing __syncthreads\(\)/cuda.syncthreads\(\)|"
           r"exposes races the GPU hid")


# ============================================================================ kernels, launcher

@pytest.mark.parametrize("shape", [(1, 1, 1), (33, 17, 9), (17, 130, 20), (130, 5, 3)])
@pytest.mark.parametrize("version", ["v1", "v2", "smem16", "reg8x8", "reg8x8_prefetch",
                                     "reg8x8_unsigned"])
def test_numba_kernels(version, shape):
    M, N, K = shape
    if env.SIM and version == "smem16" and M * N > 1000:
        pytest.skip("slow in the simulator; covered by the other shapes")
    rng = np.random.default_rng(7)
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = cb.empty_nan((M, N))
    if not env.SIM:
        A, B, C = (cuda.to_device(x) for x in (A, B, C))
    mm.launch_numba(version, A, B, C)
    cb.check(C, A.astype(np.float64) @ B if env.SIM else
             cb.to_numpy(A).astype(np.float64) @ cb.to_numpy(B), **mm.tolerance(K))


def test_check_operands_errors():
    A = np.zeros((4, 5), np.float32)
    B = np.zeros((5, 6), np.float32)
    C = np.zeros((4, 6), np.float32)
    assert mm.check_operands(A, B, C) == (4, 6, 5) == mm.check_operands(A, B)
    if cb.HAS_GPU:                       # the CUDA C++ launch reads GPU memory only
        with pytest.raises(TypeError, match="A is a numpy array on the host"):
            mm.check_operands(A, B, C, device=True)
    with pytest.raises(ValueError, match="inner dimensions"):
        mm.check_operands(A, np.zeros((4, 6), np.float32), C)
    with pytest.raises(TypeError, match="float32 only"):
        mm.check_operands(A.astype(np.float64), B, C)
    with pytest.raises(ValueError, match="C-contiguous"):
        mm.check_operands(A, np.zeros((6, 5), np.float32).T, C)
    with pytest.raises(ValueError, match="C must be 4x6"):
        mm.check_operands(A, B, np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match="2D"):
        mm.check_operands(A.ravel(), B, C)


def test_numba_versions_are_the_kernels_of_matmul_py():
    nb = cb.load_numba("matmul")
    assert all(hasattr(nb, f"matmul_{v}") for v in mm.NUMBA_VERSIONS)
    assert cb.roofline.gemm_flops(2, 3, 4) == 48 and cb.roofline.gemm_min_bytes(2, 3, 4) == 104


def test_config_and_params():
    assert mm.config("v1", 100, 33, 7)["grid"] == (4, 2)
    assert mm.config("v2", 100, 33, 7)["grid"] == (2, 4)
    c = mm.config("v9", 1023, 1025, 517)
    assert c["grid"] == (9, 8) and c["block"] == (256,) and c["shared"] == 2 * 16 * 260 * 4
    assert c == mm.config("matmul_v9", 1023, 1025, 517) and c.kernel == "matmul_v9"
    grid, block = mm.numba_config("matmul_reg8x8", 100, 100)      # either spelling, a record
    assert mm.numba_config("reg8x8", 100, 100) == (grid, block)
    c = mm.config("v10", 1000, 1000, 10, dict(BM=64, BN=128, WM=32, WN=64, TM=8, TN=8))
    assert c["grid"] == (8, 16) and c["block"] == (128,)
    with pytest.raises(ValueError, match="32 lanes"):
        mm.tuned_params(dict(TM=8))
    with pytest.raises(ValueError, match="divide"):
        mm.tuned_params(dict(BM=192))
    with pytest.raises(ValueError, match="unknown tile"):
        mm.tuned_params(dict(BX=1))
    with pytest.raises(ValueError, match="STAGES"):
        mm.tuned_params(dict(STAGES=3, ASYNC=0))
    with pytest.raises(ValueError, match="unknown version"):
        mm.config("v12", 1, 1, 1)
    assert "-DMM_BK=8" in mm.tuned_options() and "-DMM_ONLY_TUNED" in mm.tuned_options(
        only_tuned=True)


def test_tuned_defaults_match_the_cu_file():
    """matmul_v10 compiled without -D options must be launched with the same tile sizes."""

    src = cb.kernel_source("matmul.cu")
    found = {k: int(v) for k, v in re.findall(r"#ifndef MM_(\w+)\n#define MM_\1 (\d+)", src)}
    assert found == mm.TUNED_DEFAULT


def test_ladder_plot_styles():
    """The ladder figure's series: CUDA C++ solid and Numba dash-dotted with hollow markers, the
    baseline black and dashed, no two series in one colour, the legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cudabook.bench import BenchTable, Row, Sweep

    names = ["cuBLAS", *mm.VERSIONS, *(f"numba {v}" for v in mm.NUMBA_VERSIONS)]
    st = cb.plot.styles(names, "cuBLAS")
    assert st["cuBLAS"]["color"] == "black" and st["cuBLAS"]["ls"] == "--"
    colours = [st[n]["color"] for n in names]
    assert len(set(colours)) == len(names), "two series share a colour"
    for n in names[1:]:
        numba = n.startswith("numba")
        assert (st[n]["ls"] == "-.") == numba and (st[n].get("mfc") == "white") == numba, n
    many = cb.plot.styles([f"v{i}" for i in range(40)])
    assert len({s["color"] for s in many.values()}) == 40
    tables = [BenchTable([Row(n, 1.0, float(i + k + 1), "TFLOP/s", is_baseline=(i == 0))
                          for i, n in enumerate(names)], size=k) for k in (1024, 2048)]
    sw = Sweep([1024, 2048], tables, xlabel="n")
    fig, axes = plt.subplots(1, 2)
    for ax in (cb.plot.perf(sw), cb.plot.perf(sw, ax=axes[0]), cb.plot.perf(sw, ax=axes[1])):
        ax.figure.canvas.draw()
        box = ax.get_legend().get_window_extent()
        frame = ax.get_window_extent()
        assert box.x0 >= frame.x1 or box.y1 <= frame.y0, "the legend overlaps the data"
    plt.close("all")


@gpu
def test_cupy_versions_ragged():
    import cupy

    mod = cb.load_cuda("matmul")
    rng = np.random.default_rng(3)
    for M, N, K in [(1, 1, 1), (1023, 1025, 517), (4096, 16, 64), (16, 4096, 300),
                    (130, 4, 1000)]:
        A = cupy.asarray(rng.standard_normal((M, K), dtype=np.float32))
        B = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32))
        ref = A.astype(cupy.float64) @ B.astype(cupy.float64)
        for v in mm.VERSIONS:
            C = cb.empty_nan((M, N), np.float32, xp=cupy)
            mm.launch_cupy(mod, v, A, B, C)
            cb.check(C, ref, name=f"{v} {M}x{N}x{K}", **mm.tolerance(K))


@gpu
def test_cupy_tuned_variant():
    import cupy

    mod = mm.load_tuned(dict(BM=64, BN=128, BK=16, WM=32, WN=64, TM=8, TN=8, MINB=4, STAGES=3,
                              ASYNC=1))
    A = cupy.random.standard_normal((300, 200), dtype=cupy.float32)
    B = cupy.random.standard_normal((200, 77), dtype=cupy.float32)
    C = cb.empty_nan((300, 77), np.float32, xp=cupy)
    mm.launch_cupy(mod, "v10", A, B, C)
    cb.check(C, A.astype(cupy.float64) @ B.astype(cupy.float64), **mm.tolerance(200))
    # the entry point: C allocated, v10 compiled alone with these tile sizes (or the defaults)
    for params in (mod.params, None):
        C2 = mm.matmul(A, B, version="matmul_v10", params=params)
        cb.check(C2, A.astype(cupy.float64) @ B.astype(cupy.float64), **mm.tolerance(200))
    with pytest.raises(TypeError, match="A is a numpy array on the host"):
        mm.matmul(cupy.asnumpy(A), B)


@gpu
def test_cupy_v11_and_numba_unsigned_ragged():
    """matmul_v11 (default and 128x128 tiles) and the Numba reg8x8_unsigned twin on shapes that
    are not multiples of any tile (edge blocks take the guarded loads, inner ones the fast
    path), with K % 4 != 0 (no float4 loads at all) and at 4096 (every block inside)."""
    import cupy

    mods = [mm.load_tuned(), mm.load_tuned(dict(BM=128, BN=128, BK=8, WM=64, WN=32, TM=8, TN=8,
                                                  MINB=2))]
    rng = np.random.default_rng(11)
    for M, N, K in [(1000, 1736, 777), (1023, 1025, 516), (257, 129, 1000), (1, 1, 1),
                    (4096, 4096, 4096)]:
        A = cupy.asarray(rng.standard_normal((M, K), dtype=np.float32))
        B = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32))
        rows = M if M < 4096 else 256                  # at 4096: a band of rows
        ref = A[:rows].astype(cupy.float64) @ B.astype(cupy.float64)
        for mod in mods:
            C = cb.empty_nan((M, N), np.float32, xp=cupy)
            mm.launch_cupy(mod, "v11", A, B, C)
            cb.check(C[:rows], ref, name=f"v11 {mod.params['BM']}x{mod.params['BN']} {M}x{N}x{K}",
                     **mm.tolerance(K))
        C = cb.empty_nan((M, N), np.float32, xp=cupy)
        mm.launch_numba("reg8x8_unsigned", *(cuda.as_cuda_array(x) for x in (A, B, C)))
        cb.check(C[:rows], ref, name=f"numba reg8x8_unsigned {M}x{N}x{K}", **mm.tolerance(K))


# ============================================================================ ex04_1 (Numba)

def matmul_abt(*edits):
    return SOL.get("ex04.1", "matmul_abt", edits=edits)


SECOND_BARRIER = ("            acc += As[ty, k] * Bs[tx, k]\n        cuda.syncthreads()\n",
                  "            acc += As[ty, k] * Bs[tx, k]\n")


def test_ex04_1_reference(capsys):
    ex04_1(matmul_abt())
    assert capsys.readouterr().out.strip() == "PASS ex04.1"


@pytest.mark.parametrize("edits, hint", [
    ([("        cuda.syncthreads()\n", "", 2)], "missing __syncthreads\\(\\)/cuda.syncthreads"),
    ([SECOND_BARRIER], BARRIER),                     # one barrier of two: the race the GPU hid
    ([("    if row < M and col < N:\n        C[row, col] = acc",
       "    C[row, col] = acc")], "missing bounds guard"),
    ([("    acc = float32(0.0)\n", "    if row >= M or col >= N:\n        return\n"
                                   "    acc = float32(0.0)\n")],
     "a thread returns before the tile loop"),
    ([("        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)",
       "        if row < M and k0 + tx < K:\n            As[ty, tx] = A[row, k0 + tx]"),
      ("        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else "
       "float32(0.0)", "        if n0 + ty < N and k0 + tx < K:\n"
                       "            Bs[ty, tx] = Bt[n0 + ty, k0 + tx]")],
     "zero-fill|load zeros for k >= K"),
    # loads and the first barrier under the store's guard: the edge threads skip the barrier
    ([("        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)\n"
       "        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else "
       "float32(0.0)\n        cuda.syncthreads()\n",
       "        if row < M and col < N:\n"
       "            As[ty, tx] = A[row, k0 + tx] if k0 + tx < K else float32(0.0)\n"
       "            Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else "
       "float32(0.0)\n            cuda.syncthreads()\n")],
     "a barrier that not every thread of the block reaches: line \\d+: cuda.syncthreads\\(\\) "
     "inside the branch"),
    # NumPy in the kernel: the dot product of a row and a column, no tiles
    ([("    if row < M and col < N:\n        C[row, col] = acc",
       "    if row < M and col < N:\n        C[row, col] = np.dot(A[row], Bt[col])")],
     "uses what runs only on the host: line \\d+: np\\.dot"),
], ids=["no-barriers", "second-barrier-missing", "no-store-guard", "early-return",
        "no-zero-fill", "barrier-in-guard", "numpy-dot"])
def test_ex04_1_wrong(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_1(matmul_abt(*edits))


def test_ex04_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented"):
        ex04_1(SOL.stub("ex04.1", "matmul_abt"))


def test_low_precision_gets_its_own_hint():
    """float16 products or sums: small errors everywhere, not an edge or a race."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((65, 40)).astype(np.float32)
    B = rng.standard_normal((40, 70)).astype(np.float32)
    ref = A.astype(np.float64) @ B
    half = (A.astype(np.float16) @ B.astype(np.float16)).astype(np.float32)
    for syncs in (2, 1):
        with pytest.raises(GradeError, match="lower-precision arithmetic") as e:
            diagnose_2d("ex", "case", half, ref, tile=(16, 16), K=40, ktile=16, syncs=syncs)
        assert "edge tiles" not in str(e.value) and "race" not in str(e.value)


def test_all_zero_output_is_not_called_an_edge_problem():
    ref = np.ones((1, 1)) * 3.0
    with pytest.raises(GradeError, match="C is all zeros"):
        diagnose_2d("ex", "case", np.zeros((1, 1), np.float32), ref, tile=(64, 64), K=1,
                    ktile=8, syncs=2)


# ============================================================================ ex04_3 (Numba)

def matmul_ragged(*edits):
    return SOL.get("ex04.3", "matmul_ragged", edits=edits)


def test_ex04_3_reference(capsys):
    ex04_3(matmul_ragged())
    assert capsys.readouterr().out.strip() == "PASS ex04.3"


@pytest.mark.parametrize("edits, hint", [
    ([("A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else float32(0.0)",
       "A[m0 + ar, k0 + ac]"),
      ("B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else float32(0.0)",
       "B[k0 + br, n0 + bc]"),
      ("            if r < M and c < N:\n                C[r, c] = acc[i, j]",
       "            C[r, c] = acc[i, j]")], "M=1, N=1, K=1 .*(missing bounds guard|index out)"),
    ([("            if r < M and c < N:", "            if m0 + RB <= M and n0 + RB <= N:")],
     "a store guard that drops (partial|whole) tiles"),
    ([("    for i in range(RT):\n        for j in range(RT):\n            r, c = m0",
       "    for i in range(1):\n        for j in range(RT):\n            r, c = m0")],
     "only part of C is written"),
    # the loads skipped, not zero-filled: stale values (NaN in the simulator's fresh shared
    # memory) enter the sum, the same on every run
    ([("A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else float32(0.0)",
       "A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else As[ar, ac]"),
      ("B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else float32(0.0)",
       "B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else Bs[br, bc]")],
     # on a GPU the stale values are the previous tile's, and the first case (K = 1) says so
     "zero-fill every tile element that lies outside A or B|load zeros for k >= K"),
], ids=["unguarded", "whole-tiles-only", "first-row-only", "skipped-loads"])
def test_ex04_3_wrong(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_3(matmul_ragged(*edits))


def test_ex04_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented"):
        ex04_3(SOL.stub("ex04.3", "matmul_ragged"))


# ============================================================================ CUDA C (GPU)

def reg2d(*edits):
    return SOL.get("ex04.2", "reg2d_src", edits=edits)


FIRST_BARRIER_2 = ("        __syncthreads();\n        // BEGIN SOLUTION ex04.2",
                   "        // BEGIN SOLUTION ex04.2")
SECOND_BARRIER_2 = ("        // END SOLUTION\n        __syncthreads();", "        // END SOLUTION")
HALF_ACCUMULATOR = [("#define BM 64", "#include <cuda_fp16.h>\n#define BM 64"),
                    ("acc[i][j] += ra[i] * rb[j];",
                     "acc[i][j] = __half2float(__float2half(acc[i][j] + ra[i] * rb[j]));")]


@gpu
def test_ex04_2_reference(capsys):
    ex04_2(reg2d())
    assert capsys.readouterr().out.strip() == "PASS ex04.2"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([FIRST_BARRIER_2], BARRIER),
    ([SECOND_BARRIER_2], BARRIER),
    ([("    for (int i = 0; i < TM; ++i)\n        for (int j = 0; j < TN; ++j) {\n"
       "            int r", "    for (int i = 0; i < 1; ++i)\n        for (int j = 0; j < TN; "
       "++j) {\n            int r")], "only part of C is written"),
    ([("if (r < M && c < N) C[r * N + c] = acc[i][j];", "C[r * N + c] = acc[i][j];")],
     "wrote past the end of C"),
    ([("for (int k = 0; k < BK; ++k) {", "for (int k = 0; k < BK; ++k) { break;")],
     "C is all zeros"),
    (HALF_ACCUMULATOR, "lower-precision arithmetic"),
], ids=["first-barrier-missing", "second-barrier-missing", "first-row-only", "no-store-guard",
        "no-products", "half-accumulator"])
def test_ex04_2_wrong(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_2(reg2d(*edits))


@gpu
def test_ex04_2_stub_fails():
    with pytest.raises(GradeError, match="C is all zeros|never written"):
        ex04_2(SOL.stub("ex04.2", "reg2d_src"))


def fast(*edits):
    return SOL.get("ex04.4", "fast_src", edits=edits)


@gpu
def test_ex04_4_reference(capsys):
    ex04_4(fast())
    assert capsys.readouterr().out.strip() == "PASS ex04.4"


@gpu
def test_ex04_4_wrong():
    with pytest.raises(GradeError, match="never written"):
        ex04_4(SOL.stub("ex04.4", "fast_src"))
    with pytest.raises(GradeError, match="the goal is"):
        ex04_4(fast(), fraction=5.0)           # correct but (of course) not 5x cuBLAS
    # one barrier of two missing: the race that printed PASS on the H100
    with pytest.raises(GradeError, match=BARRIER):
        ex04_4(fast(("        // END SOLUTION\n        __syncthreads();\n    }",
                     "        // END SOLUTION\n    }")))
    # the layout half-done: the new pieces in the math, the old consecutive rows in the store
    with pytest.raises(GradeError, match="check which rows of A and columns of B"):
        ex04_4(fast(("int r = m0 + (i / 4) * 64 + tr * 4 + i % 4;", "int r = m0 + tr * 8 + i;")))


def test_ex04_4_is_scaffolded():
    """The stub keeps v6's loads and the k-loop; what is left is the step the spec names."""
    text = strip_solutions(SOL.source("ex04.4"))
    assert "As[ac][ar] = a.x" in text and "for (int k0 = 0; k0 < K; k0 += BK)" in text
    assert text.count("// TODO ex04.4") == 2 and "acc[i][j] +=" not in text


@pytest.mark.simulator
def test_cuda_graders_need_gpu():
    for g in (ex04_2, ex04_4):
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            g("")


# ----------------------------------------------------------------------------- pencil and paper
(test_question_reference_passes, test_question_stub_fails,
 test_question_common_mistake_gets_its_hint) = pencil_tests(
    SOL, (graders.ex04_5, graders.ex04_6, graders.ex04_7), [
    ("ex04.5", "blocks_130", 2, "rounded up to 4352"),
    ("ex04.5", "blocks_127", 8, "the registers fewer"),
    ("ex04.5", "occupancy_130", 12.5, "not a percentage"),
    ("ex04.6", "intensity_64", 8, "two FLOPs"),
    ("ex04.6", "intensity_128", 128, "per byte, not per float"),
    ("ex04.7", "waves", 3, "need a fourth"),
    ("ex04.7", "last_wave_sms", 16, "idle"),
    ("ex04.7", "efficiency", 116 / 132, "the last wave alone"),
    ("ex04.7", "efficiency", 96.97, "not a percentage"),
])


def test_a_tiny_output_never_gets_the_low_precision_verdict():
    """One stale shared-memory value that happens to be small looks like rounding on a 1x1 C:
    under 16 wrong elements the grader does not call it lower precision."""
    ref = np.array([[0.776523]])
    got = np.array([[0.776706]], np.float32)
    with pytest.raises(GradeError) as e:
        diagnose_2d("ex", "case", got, ref, tile=(16, 16), K=1, ktile=16, syncs=2)
    assert "lower-precision" not in str(e.value) and "load zeros for k >= K" in str(e.value)


def test_a_tiny_case_is_reported_only_when_no_larger_case_fails():
    from cudabook.graders.ch04 import _HeldBack

    def fail(msg):
        def f():
            raise GradeError(msg)
        return f

    held = _HeldBack()
    held.check(1, fail("tiny"))
    with pytest.raises(GradeError, match="large"):
        held.check(16 * 16, fail("large"))
    held = _HeldBack()
    held.check(1, fail("tiny"))
    held.check(16 * 16, lambda: None)
    with pytest.raises(GradeError, match="tiny"):
        held.raise_if_any()
