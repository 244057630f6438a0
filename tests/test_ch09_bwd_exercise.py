"""Chapter 9's ex09.9: one step of FlashAttention-2's backward loop in one block (Numba), dS
written and dV, dK, dQ added to the sums of the earlier steps. The reference answer comes from
solutions/09_flash_attention.ipynb, the stub from the same cell as the exercise page has it, and
each wrong answer is an edit of the reference (tests/solution_cells.py) that must get the hint
naming its mistake. It runs on the CUDA simulator without a GPU."""
# ruff: noqa: I001  (cudabook must be imported before numba.cuda)

from __future__ import annotations

import pytest
from solution_cells import Solution, check_exercise_page

import cudabook as cb  # decides GPU or simulator mode first
from cudabook.graders import GradeError, ex09_9

SOL = Solution("09")
# a missing barrier gives NaN in the simulator; on a GPU the grader's simulate() second opinion
# catches it (tested through the stricter lane)
SIM_ONLY = pytest.mark.skipif(cb.HAS_GPU, reason="simulator-only wrong answer")


def bwd_step(*edits):
    return SOL.get("ex09.9", "bwd_step", edits=edits)


def test_ex09_9_states_its_stub_size_and_has_two_hints():
    check_exercise_page("09", "ex09.9")


def test_ex09_9_reference_passes(capsys):
    ex09_9(bwd_step())
    assert capsys.readouterr().out == "PASS ex09.9\n"


def test_ex09_9_stub_fails():
    with pytest.raises(GradeError, match="ex09.9: not implemented yet"):
        ex09_9(SOL.stub("ex09.9", "bwd_step"))


_P = "        p = math.exp(scale * s - lse[i])"
#: P against a maximum over the tile's keys, instead of the saved lse
_TILE_MAX = """        m = float32(-1e30)
        for jj in range(Bc):
            x = float32(0)
            for c in range(D):
                x += q[i, c] * k[jj, c]
            m = max(m, scale * x)
        p = math.exp(scale * s - m)"""
_SYNC = ("    cuda.syncthreads()                          # every P and dS written before any is "
         "read\n")


@pytest.mark.parametrize("edits, hint", [
    # dS = P * dP: the D term left out
    ([("dSs[i, j] = p * (dp - delta[i])", "dSs[i, j] = p * dp")],
     "ds is wrong.*leaves out the softmax's second term"),
    # dS without the scale in the products (dk checked first, then dq alone)
    ([("dk[j, c] += scale * b", "dk[j, c] += b"), ("dq[i, c] += scale * a", "dq[i, c] += a")],
     "dk is wrong.*dS without the scale"),
    ([("dq[i, c] += scale * a", "dq[i, c] += a")], "dq is wrong.*dS without the scale"),
    # dK = dS Q instead of dS^T Q (the square tile comes first), and dQ = dS^T K
    ([("b += dSs[i, j] * q[i, c]", "b += dSs[j, i] * q[i, c]")],
     "dk is wrong.*dS Q .*the wrong axis"),
    ([("a += dSs[i, j] * k[j, c]", "a += dSs[j, i] * k[j, c]")],
     "dq is wrong.*dS\\^T K .*the wrong axis"),
    # P recomputed without the saved lse: wrong values, then (divided after exp) an overflow
    ([(_P, "        p = math.exp(scale * s)")], "ds is wrong.*ignores the saved logsumexp"),
    ([(_P, "        p = math.exp(scale * s) / math.exp(lse[i])")],
     "scores near 800.*subtract lse inside the exp"),
    ([(_P, _TILE_MAX)], "ds is wrong.*a maximum over this tile's keys"),
    ([(_P, "        p = math.exp(s - lse[i])")], "ds is wrong.*the scale is missing inside"),
    # dV forgotten, or scaled
    ([("        dv[j, c] += a\n", "")], "dv is wrong.*unchanged.*dV forgotten"),
    ([("dv[j, c] += a", "dv[j, c] += scale * a")], "dv is wrong.*has no scale in it"),
    # an accumulated output overwritten with this step's share
    ([("dk[j, c] += scale * b", "dk[j, c] = scale * b")],
     "dk is wrong.*holds only this step's share"),
    # ds (NaN-filled) summed into instead of written
    ([("ds[i, j] = dSs[i, j]", "ds[i, j] += dSs[i, j]")],
     "ds is NaN everywhere.*summed into with \\+="),
    # no barrier between writing Ps, dSs and reading them: NaN from poisoned shared memory
    pytest.param([(_SYNC, "")], "dv is wrong.*holds NaN that the kernel computed: a thread read "
                 "an element of Ps or dSs.*cb.trace of the launch bwd_step.*race on shared Ps",
                 marks=SIM_ONLY),
    # a fixed stride: right with 64 threads, pairs added twice with 96
    ([("t, nt = cuda.threadIdx.x, cuda.blockDim.x", "t, nt = cuda.threadIdx.x, 64")],
     "96 threads.*right with blocks of 64 threads, wrong with 96: stride the loops by "
     "cuda.blockDim.x"),
    # one pair per thread, no loop: 65 pairs and 64 threads leave the last one out
    ([("for e in range(t, Br * Bc, nt):", "for e in range(t, min(t + 1, Br * Bc)):")],
     "65 pairs.*1 of 65 pairs never written, first \\(i, j\\) = \\(12, 4\\)"),
    # the barrier inside a branch some threads skip
    ([(_SYNC, "    if t < Br * Bc:\n        cuda.syncthreads()\n")],
     "not every thread of the block reaches"),
    # a library call inside the kernel
    ([("dq[i, c] += scale * a", "dq[i, c] += scale * np.sum(dSs[i, :Bc] * k[:Bc, c])")],
     "np.sum"),
], ids=["no-D-term", "dk-no-scale", "dq-no-scale", "dk-wrong-axis", "dq-wrong-axis", "no-lse",
        "lse-after-exp", "tile-max", "no-scale-in-exp", "no-dv", "dv-scaled", "dk-overwritten",
        "ds-accumulated", "no-barrier", "fixed-stride", "no-pair-loop", "barrier-in-branch",
        "numpy-in-kernel"])
def test_ex09_9_wrong_answer_gets_its_hint(edits, hint):
    with pytest.raises(GradeError, match=f"ex09.9: .*{hint}"):
        ex09_9(bwd_step(*edits))
