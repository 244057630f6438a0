"""Chapter 1 graders: the reference passes, stubs and plausible wrong answers fail with the hint
that names their mistake. References come from solutions/01_first_kernel.ipynb; wrong answers are
edits of them (tests/solution_cells.py)."""

from __future__ import annotations

import pytest
from solution_cells import Solution, pencil_tests

import cudabook as cb
from cudabook import graders
from cudabook.graders import GradeError, ex01_1, ex01_2, ex01_3, ex01_4

SOL = Solution("01")


def saxpy_launcher(*edits):
    return SOL.get("ex01.1", "launch_saxpy", edits=edits)


# ----------------------------------------------------------------------------- ex01.1
def test_ex01_1_reference_passes(capsys):
    ex01_1(saxpy_launcher())
    assert capsys.readouterr().out == "PASS ex01.1\n"


@pytest.mark.parametrize("edits, hint", [
    ([("    if i < out.size:\n        out[i] = a * x[i] + y[i]", "    out[i] = a * x[i] + y[i]")],
     "missing bounds guard"),
    ([("blocks = (out.size + threads - 1) // threads", "blocks = out.size // threads")],
     "launched with no threads"),                        # floor, not ceil: 0 blocks for n=1
    ([("saxpy[blocks, threads](a, x, y, out)", "saxpy[blocks, threads](a, y, x, out)")],
     "is it a\\*x\\[i\\] \\+ y\\[i\\]"),                                 # x and y swapped
    # sizes hard-coded for small inputs: one block of 1024 threads (n = 2051 in the simulator)
    ([("    threads = 256\n    blocks = (out.size + threads - 1) // threads",
       "    threads = 1024\n    blocks = 1")], "the grid is too small"),
    # a NumPy expression inside the kernel: every thread computes the whole array (right in
    # the simulator, no GPU code)
    ([("    if i < out.size:\n        out[i] = a * x[i] + y[i]", "    out[:] = a * x + y")],
     "uses what runs only on the host: .*the whole array x in arithmetic"),
], ids=["no-guard", "grid-rounded-down", "x-y-swapped", "one-block-of-1024", "array-expression"])
def test_ex01_1_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_1(saxpy_launcher(*edits))


# the grader traces the launch of a failing answer (cb.trace) and says who wrote what
def test_ex01_1_block_offset_missing_is_a_double_write():
    # every block writes elements 0..255: the output check sees a gap at the end, the trace
    # the cause; the value check's guess (a grid too small) is dropped
    with pytest.raises(GradeError, match=r"n=257 .*: element 256, the last, never written; "
                       r"cb\.trace of the launch saxpy\[2, 256\] shows why: out\[0\] written by "
                       r"threads 0 and 256 \(blocks 0 and 1\): two blocks cover the same "
                       r"range") as e:
        ex01_1(saxpy_launcher(("    i = cuda.grid(1)\n", "    i = cuda.threadIdx.x\n")))
    assert "grid is too small" not in str(e.value)


def test_ex01_1_no_guard_names_the_thread():
    # the first size that fails: n = 1 in the simulator (it bounds-checks), a larger one on a
    # GPU (where a write past a short output lands in the canary, or not, by chance)
    with pytest.raises(GradeError, match=r"n=\d+ .*missing bounds guard.* cb\.trace of the "
                       r"launch saxpy\[\d+, 256\] shows why: x\[(\d+)\] read out of bounds "
                       r"\(x has shape \(\1,\)\) by thread \d+ \(block \d+, thread \d+\), line "
                       r"\d+: x\[i\]"):
        ex01_1(saxpy_launcher(("    if i < out.size:\n        out[i] = a * x[i] + y[i]",
                               "    out[i] = a * x[i] + y[i]")))


def test_ex01_1_no_launch_and_array_expression_fail():
    with pytest.raises(GradeError, match="output never written"):
        ex01_1(lambda a, x, y, out: None)
    # the right numbers without a kernel: a NumPy / CuPy expression
    with pytest.raises(GradeError, match="no kernel was launched"):
        ex01_1(lambda a, x, y, out: out.__setitem__(slice(None), a * x + y))


def test_ex01_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex01_1(SOL.stub("ex01.1", "launch_saxpy"))


def test_ex01_1_cached_answer_fails():
    ref, cache = saxpy_launcher(), {}

    def cached(a, x, y, out):           # computes once per length, then replays the first answer
        n = out.size
        if n not in cache:
            ref(a, x, y, out)
            cache[n] = cb.to_numpy(out).copy()
        out[:] = cache[n] if not cb.HAS_GPU else __import__("cupy").asarray(cache[n])
    with pytest.raises(GradeError, match="wrong at"):
        ex01_1(cached)


# ----------------------------------------------------------------------------- ex01.3
def test_ex01_3_reference_passes(capsys):
    ex01_3(SOL.get("ex01.3", "add_row_bias"))
    assert capsys.readouterr().out == "PASS ex01.3\n"


@pytest.mark.parametrize("edit, hint", [
    (("col, row = cuda.grid(2)", "row, col = cuda.grid(2)"), "row and col swapped"),
    (("b[col]", "b[row % b.size]"), "the bias is indexed by row"),
    (("if row < out.shape[0] and col < out.shape[1]:", "if col < out.shape[1]:"),
     "missing bounds guard"),
    (("        out[row, col] = x[row, col] + b[col]", "        out[row] = x[row] + b"),
     "uses what runs only on the host: line \\d+: the whole array b in arithmetic"),
], ids=["swapped", "bias-by-row", "column-guard-only", "row-as-array"])
def test_ex01_3_wrong_answers_fail(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_3(SOL.get("ex01.3", "add_row_bias", edits=[edit]))


def test_ex01_3_block_offsets_missing_is_a_double_write():
    # cuda.threadIdx instead of cuda.grid: the holes look like swapped indices to the value
    # check; the trace shows two blocks writing the same elements
    with pytest.raises(GradeError, match=r"M=3, N=17 .*: 3 elements never written, first at "
                       r"\(0, 16\); cb\.trace of the launch add_row_bias\[2, \(16, 16\)\] shows "
                       r"why: out\[0, 0\] written by thread \(0, 0\) of block \(0, 0\) and by "
                       r"thread \(0, 0\) of block \(1, 0\): two blocks cover the same range") as e:
        ex01_3(SOL.get("ex01.3", "add_row_bias", edits=[
            ("col, row = cuda.grid(2)", "col, row = cuda.threadIdx.x, cuda.threadIdx.y")]))
    assert "swapped" not in str(e.value)


def test_ex01_3_column_guard_only_names_the_thread():
    # the first shape that fails: (1, 1) in the simulator (it bounds-checks), (3, 17) on a GPU
    # (where row 1 of a 1 x 1 output lands in the canary only by chance)
    with pytest.raises(GradeError, match=r"M=\d+, N=\d+ .*missing bounds guard.*cb\.trace of the "
                       r"launch add_row_bias\[\d+, \(16, 16\)\] shows why: x\[(\d+), 0\] read "
                       r"out of bounds \(x has shape \(\1, \d+\)\) by thread \(0, \1\) of block "
                       r"\(0, 0\)"):
        ex01_3(SOL.get("ex01.3", "add_row_bias", edits=[
            ("if row < out.shape[0] and col < out.shape[1]:", "if col < out.shape[1]:")]))


def test_ex01_3_stub_fails():
    # the simulator raises NotImplementedError; on a GPU a raise in a kernel does nothing
    with pytest.raises(GradeError, match="not implemented yet|output never written .* still the "
                       "stub"):
        ex01_3(SOL.stub("ex01.3", "add_row_bias"))


# ----------------------------------------------------------------------------- CUDA C (GPU)
def relu(*edits):
    return SOL.get("ex01.2", "relu_src", edits=edits)


@pytest.mark.gpu
def test_ex01_2_reference_passes(capsys):
    ex01_2(relu())
    assert capsys.readouterr().out == "PASS ex01.2\n"


@pytest.mark.gpu
@pytest.mark.parametrize("edit, hint", [
    (("    if (i < n) {\n        y[i] = x[i] > 0.0f ? x[i] : 0.0f;\n    }",
      "    y[i] = x[i] > 0.0f ? x[i] : 0.0f;"), "missing bounds guard"),
    (("x[i] > 0.0f ? x[i] : 0.0f", "x[i]"), "ReLU keeps x where x > 0"),
    (("y[i] = x[i] > 0.0f ? x[i] : 0.0f;", "y[i] = x[i] > 0.0f ? x[i] : 0.0f"),
     "does not compile"),
    (("if (i < n) {", "if (i < n - 1) {"),
     "the last, never written: does the guard stop one short"),
], ids=["no-guard", "identity", "syntax-error", "guard-off-by-one"])
def test_ex01_2_wrong_answers_fail(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_2(relu(edit))


@pytest.mark.gpu
def test_ex01_2_stub_fails():
    with pytest.raises(GradeError, match="output never written"):
        ex01_2(SOL.stub("ex01.2", "relu_src"))


def sgd(*edits):
    return SOL.get("ex01.4", "sgd_src", edits=edits)


@pytest.mark.gpu
def test_ex01_4_reference_passes(capsys):
    ex01_4(sgd())
    assert capsys.readouterr().out == "PASS ex01.4\n"


@pytest.mark.gpu
@pytest.mark.parametrize("edit, hint", [
    (("for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {",
      "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) {"), "never updated: with a "
     "small grid each thread must loop"),
    (("int stride = blockDim.x * gridDim.x;", "int stride = blockDim.x;"),
     "updated more than once"),
    (("i < n; i += stride", "i < n + 200; i += stride"), "wrote past the end of w"),
], ids=["no-loop", "block-stride", "loop-past-n"])
def test_ex01_4_wrong_answers_fail(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex01_4(sgd(edit))


@pytest.mark.gpu
def test_ex01_4_stub_fails():
    with pytest.raises(GradeError, match="never updated"):
        ex01_4(SOL.stub("ex01.4", "sgd_src"))


@pytest.mark.simulator
def test_cuda_graders_refuse_in_simulator():
    for grader in (ex01_2, ex01_4):
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            grader(relu())


# ----------------------------------------------------------------------------- pencil and paper
(test_question_reference_passes, test_question_stub_fails,
 test_question_common_mistake_gets_its_hint) = pencil_tests(
    SOL, (graders.ex01_5, graders.ex01_6, graders.ex01_7), [
    ("ex01.5", "blocks", 3, "round up"),
    ("ex01.5", "idle_threads", 232, "3 blocks would leave uncovered"),
    ("ex01.6", "div_even_odd", 4, "in every warp"),
    ("ex01.6", "div_below_100", 0, "threads 96..127"),
    ("ex01.6", "div_below_100", 7, "do they agree"),            # no listed mistake: the nudge
    ("ex01.5", "blocks", "4", "should be a number"),
    ("ex01.7", "grid_x", 46, "round up"),
    ("ex01.7", "grid_x", 32, "x walks the columns"),
    ("ex01.7", "row", 69, "the y indices"),
    ("ex01.7", "col", 133, "not its y"),
])
