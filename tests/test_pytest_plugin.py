"""The book's pytest plugin as a reader meets it: ``pytest --nbval-lax`` on a notebook.

A grader cell's failure starts with its exercise and verdict, the run ends
with one PASS/FAIL/SKIP line per exercise; a ``%%gpu`` cell on a machine without a GPU is skipped
with the plugin and fails with a "run again" message without it (a lone notebook's first run,
when its setup cell has just installed cudabook after pytest loaded its plugins).
"""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat

CELLS = [
    "import cudabook",
    "# NBVAL_CHECK_OUTPUT\ndef ex01_1(x):\n    print('PASS ex01.1')\nex01_1(1)",
    "# NBVAL_CHECK_OUTPUT\ndef ex01_2(x):\n    raise AssertionError('ex01.2: wrong at 3, a hint')\n"
    "ex01_2(1)",
    "%%gpu\n# NBVAL_CHECK_OUTPUT\nex01_1(1)",
]


def _run(tmp_path, *extra):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nb.cells[1].execution_count = 1
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS ex01.1\n")]
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("CUDABOOK_PYTEST_PLUGIN", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "--nbval-lax", "nb.ipynb", *extra], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300).stdout


def test_graders_are_named_and_summed_up(tmp_path):
    out = _run(tmp_path)
    assert "nb.ipynb::Cell 2 - FAIL ex01.2: AssertionError" in out, out[-3000:]    # short summary
    assert "FAIL ex01.2: AssertionError: ex01.2: wrong at 3, a hint" in out, out[-3000:]
    summary = out[out.index("exercises graded"):]
    assert "PASS ex01.1" in summary
    assert "SKIP ex01.1: cell needs a CUDA GPU" in summary        # the %%gpu grader cell
    assert "1 failed, 2 passed, 1 skipped" in out, out[-1500:]


def test_gpu_cell_without_the_plugin_fails_and_says_run_again(tmp_path):
    out = _run(tmp_path, "-p", "no:cudabook")
    assert "Run the same pytest command again" in out, out[-3000:]
    assert "2 failed, 2 passed" in out, out[-1500:]
