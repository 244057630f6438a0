"""Chapter 13's exercises (training the GPT): the graders of ex13.1 (LayerNorm's backward dx, a
block per row) and ex13.2 (the cross-entropy over a padded vocabulary, its gradient over the
logits). The reference answers come from solutions/13_training_gpt.ipynb, the stubs from the
same cells as the exercise page has them, and each wrong answer is an edit of the reference
(tests/solution_cells.py) that must get the hint naming its mistake. Both are Numba kernels:
they run on the CUDA simulator without a GPU, with cases sized for it."""

from __future__ import annotations

import pytest
from solution_cells import Solution, check_exercise_page, exercise_page

import cudabook as cb
from cudabook.graders import GradeError, ex13_1, ex13_2

SOL = Solution("13")
PAGE = exercise_page("13")


def layernorm_backward(*edits):
    return SOL.get("ex13.1", "layernorm_backward", edits=edits)


def cross_entropy_rows(*edits):
    return SOL.get("ex13.2", "cross_entropy_rows", edits=edits)


@pytest.mark.parametrize("ex", ["ex13.1", "ex13.2"])
def test_exercise_page_states_the_stub_sizes_and_has_two_hint_levels(ex):
    check_exercise_page("13", ex, PAGE)


# ----------------------------------------------------------------------------- ex13.1
def test_ex13_1_reference_passes(capsys):
    ex13_1(layernorm_backward())
    assert capsys.readouterr().out == "PASS ex13.1\n"


def test_ex13_1_stub_fails():
    with pytest.raises(GradeError, match="ex13.1: not implemented yet"):
        ex13_1(SOL.stub("ex13.1", "layernorm_backward"))


_DX = "dx[row, j] = rs * (w[j] * dy[row, j] - m1 - xh * m2)"
_RESET = "        a = float32(0)\n        b = float32(0)\n"


@pytest.mark.parametrize("edits, hint", [
    ([(_DX, "dx[row, j] = rs * (w[j] * dy[row, j] - xh * m2)")],
     r"the term -mean_c\(w dy\) is missing"),
    ([(_DX, "dx[row, j] = rs * (w[j] * dy[row, j] - m1)")],
     r"the term -xhat \* mean_c\(w dy xhat\) is missing"),
    ([(_DX, "dx[row, j] = w[j] * dy[row, j] - m1 - xh * m2")],
     "the leading factor rstd is missing"),
    ([("s1[0] / C", "s1[0] / LN_T"), ("s2[0] / C", "s2[0] / LN_T")],
     "the means divide by the 128 threads of the block"),
    ([("g = w[j] * dy[row, j]", "g = dy[row, j]"), (_DX, _DX.replace("w[j] * dy", "dy"))],
     r"dy was used where g = w \* dy belongs"),
    # one row per block: rows past the grid never written
    ([("range(cuda.blockIdx.x, M, cuda.gridDim.x)", "range(cuda.blockIdx.x, cuda.blockIdx.x + 1)")],
     r"rows 2\.\.2 never written: the grid has G = 2 blocks for M = 3 rows"),
    # the partial sums started once, before the row loop
    ([(_RESET, ""), ("    for row in range(", "    a = float32(0)\n    b = float32(0)\n"
                                             "    for row in range(")],
     "start each thread's partial sums from 0 for every row"),
    # no barrier between writing the partials and the tree reading them: NaN from the
    # simulator's poisoned shared memory
    ([("        cuda.syncthreads()                  # every partial written before the tree "
       "reads it\n", "")],
     "dx holds NaN that the kernel computed: a thread read an element of s1 or s2 that no "
     "thread had written"),
    # no barrier before the next row overwrites the totals
    ([("        cuda.syncthreads()                  # s1[0], s2[0] read by all before the next "
       "row\n", "")],
     "a block's last row is right and its earlier rows wrong"),
    # the tree's barrier inside its branch
    ([("                s2[tid] += s2[tid + stride]\n            cuda.syncthreads()",
       "                s2[tid] += s2[tid + stride]\n                cuda.syncthreads()")],
     r"a barrier that not every thread of the block reaches: line \d+: cuda.syncthreads\(\) "
     "inside the branch"),
    # sum(g xhat) expanded as rstd (sum(g x) - mean sum(g)): cancels near 1e4
    ([("b += g * ((x[row, j] - mu) * rs)", "b += g * x[row, j]"),
      ("m2 = s2[0] / C", "m2 = (s2[0] - mu * s1[0]) * rs / C")],
     "wrong where x is near 1e4 with a spread of 1e-2"),
], ids=["no-mean-term", "no-xhat-term", "no-rstd", "means-by-threads", "dy-not-w-dy",
        "one-row-per-block", "sums-not-reset", "no-barrier-before-tree",
        "no-barrier-before-next-row", "barrier-in-branch", "expanded-sum"])
def test_ex13_1_wrong_answer_gets_its_hint(edits, hint):
    with pytest.raises(GradeError, match=f"ex13.1: .*{hint}"):
        ex13_1(layernorm_backward(*edits))


# ----------------------------------------------------------------------------- ex13.2
def test_ex13_2_reference_passes(capsys):
    ex13_2(cross_entropy_rows())
    assert capsys.readouterr().out == "PASS ex13.2\n"


def test_ex13_2_stub_fails():
    with pytest.raises(GradeError, match="ex13.2: not implemented yet"):
        ex13_2(SOL.stub("ex13.2", "cross_entropy_rows"))


_LOSS = "losses[i] = math.log(d) + m - zt"
_GRAD = "g = (math.exp(logits[i, j] - m) / d - (1.0 if j == t else 0.0)) * scale"
_ZT = "    zt = logits[i, t]                       # read before the gradient overwrites it\n"
_IGNORE = ("    if t == -1:                             # an ignored row: no loss, no gradient\n"
           "        losses[i] = 0.0\n        for j in range(Vp):\n            logits[i, j] = 0.0\n"
           "        return\n")


@pytest.mark.parametrize("edits, hint", [
    ([("math.exp(logits[i, j] - m)", "math.exp(logits[i, j])", 2),
      (_LOSS, "losses[i] = math.log(d) - zt")],
     "logits near \\+1000.*exp overflowed: subtract the row's maximum"),
    ([("m = -math.inf", "m = 0.0")],
     "logits near -1000.*start the running maximum at -inf"),
    ([("for j in range(V):", "for j in range(Vp):", 2)],
     "the padding columns j >= V took part in the softmax"),
    ([("    for j in range(Vp):                     # the gradient",
       "    for j in range(V):                      # the gradient")],
     "the padding columns j >= V still hold their logits"),
    ([(" - (1.0 if j == t else 0.0)", "")], "the one-hot term is missing"),
    ([(_GRAD, _GRAD.replace(" * scale", ""))], "the gradient is not multiplied by scale"),
    ([(_GRAD, "g = ((1.0 if j == t else 0.0) - math.exp(logits[i, j] - m) / d) * scale")],
     "the gradient has the wrong sign"),
    ([(_LOSS, "losses[i] = zt - m - math.log(d)")], "the loss has the wrong sign"),
    ([(_LOSS, "losses[i] = (math.log(d) + m - zt) * scale")], "the loss is multiplied by scale"),
    # the loss computed last, from the target's logit the gradient loop has overwritten
    ([(_ZT, ""), (f"    {_LOSS}\n", ""),
      ("        logits[i, j] = g\n",
       "        logits[i, j] = g\n    losses[i] = math.log(d) + m - logits[i, t]\n")],
     r"the loss read logits\[i, t\] after the gradient loop had overwritten it"),
    ([(_IGNORE, "")], "whose target is -1.*a target of -1 marks an ignored row"),
    ([("    if i >= logits.shape[0]:                # the grid rounds M up to whole blocks of 32\n"
       "        return\n", "")],
     # the simulator checks every index; on a GPU the writes past the rows land in the canaries
     "wrote past the end of logits: the guard i < M" if cb.HAS_GPU else "index out of range"),
], ids=["no-max", "max-from-zero", "padding-in-softmax", "padding-not-zeroed", "no-one-hot",
        "no-scale", "gradient-sign", "loss-sign", "loss-scaled", "target-read-after-write",
        "ignore-not-handled", "no-row-guard"])
def test_ex13_2_wrong_answer_gets_its_hint(edits, hint):
    with pytest.raises(GradeError, match=f"ex13.2: .*{hint}"):
        ex13_2(cross_entropy_rows(*edits))
