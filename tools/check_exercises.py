#!/usr/bin/env python3
"""Exercise notebooks grade as a reader would see them.

    python tools/check_exercises.py exercises/*.ipynb

For each exercise notebook, ``pytest --nbval-lax`` (the reader's command) runs it twice:

* as committed, with the stubs: every grader cell (``# NBVAL_CHECK_OUTPUT``) must FAIL;
* with the solution's code put back into the exercise notebook: every grader cell must PASS,
  printing exactly the ``PASS exNN.k`` line the solution stores (the exercise itself stores no
  output, so that line is put back with the code and nbval compares it).

Cells are paired by id: the exercise leaves out the solution's notes cells.

``--stubs-only`` runs the first half alone (the stubs fail). The CPU lane uses it: there the second
half would repeat what it already checks, since ``nbtools.py exercises --check`` proves each
exercise is generated from its solution, ``notebooks-sim`` runs the solutions' grader cells in the
same environment, and the Colab-like lane grades every exercise both ways, each alone in a fresh
environment.

Without a GPU, ``%%gpu`` grader cells are skipped and reported as such. All the notebooks run in
one pytest session, each in its own kernel, spread over the cores by pytest-xdist (``JOBS``
overrides the number of workers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import ROOT, canonical, is_grader, solved_exercise  # noqa: E402


def run_nbval(paths: list[Path], tmp: Path, jobs: int) -> dict[str, dict[int, str]]:
    """Per notebook file name, per code-cell status ('passed', 'failed', 'skipped'), from one
    ``pytest --nbval-lax`` session over all of ``paths`` (every notebook in its own kernel, as a
    reader's run; ``jobs`` pytest-xdist workers, a notebook's cells in one worker)."""
    xml = tmp / "junit.xml"
    par = ["-n", str(jobs), "--dist", "loadfile"] if jobs > 1 and _have_xdist() else []
    subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax", *map(str, paths),
                    "-p", "no:cacheprovider", f"--rootdir={ROOT}", f"--confcutdir={ROOT}",
                    f"--junitxml={xml}", *par], capture_output=True, text=True, cwd=ROOT)
    status: dict[str, dict[int, str]] = {p.name: {} for p in paths}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        # classname is the notebook's path from the rootdir, dotted: "tmpXYZ.solved_01_a.ipynb"
        cls = tc.get("classname", "")
        name = next((n for n in status if cls == n or cls.endswith("." + n)), None)
        try:
            idx = int(tc.get("name", "").split()[-1])  # "Cell 7": the 8th code cell
        except ValueError:
            continue
        if name is None:
            continue
        if tc.find("failure") is not None or tc.find("error") is not None:
            status[name][idx] = "failed"
        elif tc.find("skipped") is not None:
            status[name][idx] = "skipped"
        else:
            status[name][idx] = "passed"
    return status


def _have_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def main(paths: list[str]) -> int:
    stubs_only = "--stubs-only" in paths
    paths = [p for p in paths if p != "--stubs-only"]
    bad = 0
    counts = {"unsolved fail": 0, "solved pass": 0, "skipped": 0}
    jobs = int(os.environ.get("JOBS", os.cpu_count() or 1))
    runs = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        solved_paths, unsolved_paths = [], []
        for p in paths:
            ex = nbformat.read(p, as_version=4)
            sol = nbformat.read(str(ROOT / "solutions" / Path(p).name), as_version=4)
            solved, missing = solved_exercise(ex, sol)
            for nb, prefix, into in ((ex, "unsolved_", unsolved_paths),
                                     (solved, "solved_", solved_paths)):
                path = Path(tmp) / (prefix + Path(p).name)
                path.write_text(canonical(nb))
                into.append(path)
            runs.append((ex, missing))
        # one pytest session for every notebook (one startup, one tail): the solved ones first,
        # they run longest
        status = run_nbval(unsolved_paths if stubs_only else solved_paths + unsolved_paths,
                           Path(tmp), jobs)
    runs = [(ex, missing, status["unsolved_" + Path(p).name],
             None if stubs_only else status["solved_" + Path(p).name])
            for p, (ex, missing) in zip(paths, runs)]
    for p, (ex, missing, st_unsolved, st_solved) in zip(paths, runs):
        for cid in missing:
            print(f"WRONG: {p}: cell {cid} has no twin in the solution "
                  "(regenerate: python tools/nbtools.py exercises)")
            bad += 1
        code = [c for c in ex.cells if c.cell_type == "code"]  # nbval numbers code cells only
        graders = {i: c for i, c in enumerate(code) if is_grader(c)}
        for i, c in graders.items():
            name = next((w.split("(")[0] for w in c.source.split() if w.startswith("ex")), "?")
            u = st_unsolved.get(i, "not run")
            s = u if st_solved is None else st_solved.get(i, "not run")
            if u == "skipped" and s == "skipped":
                counts["skipped"] += 1
                continue
            if u != "failed":
                bad += 1
                print(f"WRONG: {p} {name}: the unsolved stub {u} its grader (must fail)")
            else:
                counts["unsolved fail"] += 1
            if st_solved is None:
                continue
            if s != "passed":
                bad += 1
                print(f"WRONG: {p} {name}: the solution put back into the exercise {s} "
                      "(must pass)")
            else:
                counts["solved pass"] += 1
    solved = "not run here (--stubs-only)" if stubs_only else f"{counts['solved pass']} pass"
    print(f"exercises: {counts['unsolved fail']} stubs fail, solutions {solved}, "
          f"{counts['skipped']} skipped (need a GPU), {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
