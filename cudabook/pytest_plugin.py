"""pytest plugin of the book, registered through the ``pytest11`` entry point of the package.

Wherever cudabook is installed, ``pytest --nbval-lax notebook.ipynb`` gives the same verdicts as
inside the repository, also for a lone notebook copied out of it (a Colab or download user):

* without a GPU, cells that start with ``%%gpu`` (CuPy / CUDA C++, timings) are reported as
  skipped with a message instead of being compared with outputs stored from a GPU run, and tests
  marked ``gpu`` are skipped; on a GPU, tests marked ``simulator`` (what only simulator mode
  shows: a refusal, a wrong answer the GPU hides) are skipped. These two markers are the one way
  the repository's tests choose between the CPU lane and the GPU lane;
* the failure report of a grader cell (one that calls ``exNN_k(...)`` and carries
  ``# NBVAL_CHECK_OUTPUT``) starts with the exercise and the grader's verdict (``FAIL ex08.2:
  GradeError: ...``, also on pytest's short summary line and in JUnit XML), and the run ends
  with one line per exercise graded: ``PASS ex08.2``, ``FAIL ex08.3: <why>`` or
  ``SKIP ex08.4: <why>``;
* the plugin tells the notebook kernels it starts that it is there (``CUDABOOK_PYTEST_PLUGIN``,
  the pid of the pytest process): a ``%%gpu`` cell that runs under pytest on a machine without a
  GPU and without the plugin (the first run of a lone notebook whose setup cell has just installed
  cudabook, after pytest had loaded its plugins) fails and says to run pytest again, instead of
  printing "skipped" and counting as passed.
"""

from __future__ import annotations

import os
import re

import pytest

GPU_SKIP = "cell needs a CUDA GPU (simulator mode)"
PLUGIN_ENV = "CUDABOOK_PYTEST_PLUGIN"
GRADER_MARK = "NBVAL_CHECK_OUTPUT"
_GRADER_CALL = re.compile(r"\b(ex\d\d)_(\d+)\(")
_GRADES = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU (run in the GPU lane)")
    config.addinivalue_line("markers", "simulator: runs only in simulator mode (the CPU lane)")
    config.stash[_GRADES] = []
    # the notebook kernels nbval starts are children of this process and inherit this
    os.environ[PLUGIN_ENV] = str(os.getpid())


def _cell(item: pytest.Item) -> dict | None:
    return getattr(item, "cell", None)  # nbval's notebook cell items carry their cell


def _is_gpu_cell(item: pytest.Item) -> bool:
    cell = _cell(item)
    return cell is not None and cell.get("source", "").lstrip().startswith("%%gpu")


def exercise_of(item: pytest.Item) -> str | None:
    """``exNN.k`` if ``item`` is the grader cell of an exercise, else None."""
    cell = _cell(item)
    src = cell.get("source", "") if cell is not None else ""
    m = _GRADER_CALL.search(src) if GRADER_MARK in src else None
    return f"{m.group(1)}.{m.group(2)}" if m else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if _is_gpu_cell(it) or it.get_closest_marker("gpu")]
    sim_items = [it for it in items if it.get_closest_marker("simulator")]
    if not gpu_items and not sim_items:
        return
    from cudabook import env  # decides GPU or simulator mode once (probes CuPy)

    if env.HAS_GPU:
        for it in sim_items:
            it.add_marker(pytest.mark.skip(reason="simulator mode only (this machine has a GPU)"))
        return
    for it in gpu_items:
        reason = GPU_SKIP if _is_gpu_cell(it) else "needs a CUDA GPU"
        it.add_marker(pytest.mark.skip(reason=reason))


def _stream_text(item: pytest.Item) -> str:
    outs = getattr(item, "test_outputs", None) or []
    return "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream")


def _error(item: pytest.Item) -> str | None:
    """The exception the cell raised in the kernel, as 'Name: message' (first line only)."""
    for o in getattr(item, "test_outputs", None) or []:
        if o.get("output_type") == "error":
            msg = str(o.get("evalue", "")).strip().splitlines()
            return f"{o.get('ename', 'Error')}: {msg[0] if msg else ''}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    ex = exercise_of(item)
    if ex is None:
        return
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        err = _error(item)
        verdict = f"FAIL {ex}: " + (err or f"the cell's output is not 'PASS {ex}'")
        rep.longrepr = f"{verdict}\n\n{rep.longrepr}"
        item.config.stash[_GRADES].append(verdict)
    elif rep.when == "call" and rep.passed:
        line = next((ln for ln in _stream_text(item).splitlines() if ln.startswith("PASS ")),
                    f"PASS {ex}")
        item.config.stash[_GRADES].append(line)
    elif rep.skipped and rep.when in ("setup", "call"):
        why = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        item.config.stash[_GRADES].append(f"SKIP {ex}: {why.removeprefix('Skipped: ')}")


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    grades = config.stash.get(_GRADES, [])
    if grades:
        terminalreporter.section("exercises graded")
        for line in grades:
            terminalreporter.write_line(line)
