#!/usr/bin/env python3
"""The Colab-like lane: every notebook alone, in a fresh environment with the oldest versions
``requirements.txt`` admits, the helper package installed by the notebook's own setup cell.

    python tools/colab_lane.py [NN ...]        (chapters; default: every notebook found)

1. A fresh virtual environment gets the floor of every run-time requirement (``numpy``,
   ``numba``, ``numba-cuda``, ``cupy-cuda12x``, ``matplotlib``, ...: ``name>=X`` installs
   ``name==X``; what Colab ships) and PyTorch's CPU build (older CPU builds of torch are not on
   PyPI; Colab ships its own). No cudabook.
2. ``numba.cuda`` must import next to the ``numba`` pip chose, in both modes (and, at the end,
   next to the newest ``numba`` the bounds admit: the pair that breaks without the bound).
3. Each lesson ``lessons/*.ipynb`` is copied alone into an empty folder and run there with
   ``pytest --nbval-lax``, ``CUDABOOK_SRC`` pointing at a copy of this clone's files (so that
   pip's build writes nothing into the clone while other steps run): the first one's setup cell
   installs cudabook (as a wheel, not the clone), and the %%gpu cells of that first run fail and
   ask for a second run (pytest loaded its plugins before cudabook existed), which the lane does,
   as a reader is told to; without a GPU, cudabook picks simulator mode. After the first lesson,
   the notebooks run one per core (``JOBS`` overrides), each alone in its own folder.
4. Each exercise ``exercises/*.ipynb`` is copied alone and graded twice, as a reader would: as
   given, every grader cell fails (or is skipped, for a ``%%gpu`` grader without a GPU); with the
   solution's code put back, every cell passes or is skipped. The skips come from the plugin the
   installed package registers (``cudabook/pytest_plugin.py``), not from this repository.

Python 3.13 (Colab's) is not available on the machines CI runs on: the lane uses the Python it
is started with.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import GRADER_MARK, ROOT, solved_exercise  # noqa: E402

# what a notebook needs at run time (the rest of requirements.txt builds and checks the book)
RUNTIME = ("numpy", "numba", "numba-cuda", "cupy-cuda12x", "matplotlib", "tqdm", "ipykernel",
           "nbformat", "nbclient", "nbval", "pytest", "scikit-learn")   # Colab ships scikit-learn
TORCH = ["--extra-index-url", os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu"),
         "torch==2.13.0"]


def floors(req: Path) -> list[str]:
    """``name==X`` for every run-time requirement ``name>=X`` of requirements.txt."""
    out = []
    for line in req.read_text().splitlines():
        line = line.split("#")[0].strip()
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", line)
        if not m or m.group(1).lower() not in RUNTIME:
            continue
        lo = re.search(r">=\s*([\w.]+)", m.group(2))
        if not lo:
            raise SystemExit(f"requirements.txt: {line!r} has no floor (>=) for the lane")
        out.append(f"{m.group(1)}=={lo.group(1)}")
    missing = set(RUNTIME) - {f.split("==")[0].lower() for f in out}
    if missing:
        raise SystemExit(f"requirements.txt lacks {sorted(missing)}")
    return out


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def pip(vpy: Path, *args: str) -> None:
    r = run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])
    if r.returncode:
        raise SystemExit(f"colab lane: pip install {' '.join(args)} failed:\n{r.stdout[-2000:]}"
                         f"{r.stderr[-3000:]}")


SIM_KERNEL = """
from numba import cuda
import numpy as np
@cuda.jit
def k(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 2 * i
a = np.zeros(40, np.float32)
k[2, 32](a)
assert a[39] == 78, a
"""


def newest_numba_corner(vpy: Path, env: dict[str, str]) -> list[str]:
    """The other corner of what requirements.txt admits: the oldest numba-cuda next to the newest
    numba the bounds allow (the pair that breaks without the bound). Imports in both modes and a
    kernel on the simulator."""
    spec = next(ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text()
                .splitlines() if re.match(r"^numba\s*[<>=]", ln))
    pip(vpy, "--upgrade", spec)
    v = run([str(vpy), "-c", "import importlib.metadata as m; print(m.version('numba'), "
             "m.version('numba-cuda'))"], env=env).stdout.split()
    errs = []
    for sim, code in (("1", SIM_KERNEL), ("0", "import numba.cuda")):
        r = run([str(vpy), "-c", code], env={**env, "NUMBA_ENABLE_CUDASIM": sim})
        if r.returncode:
            errs.append(f"numba-cuda {v[1]} next to numba {v[0]} ({spec}) fails "
                        f"(NUMBA_ENABLE_CUDASIM={sim}): {r.stderr.strip().splitlines()[-1]}")
    print(f"  numba-cuda {v[1]} next to numba {v[0]}, the newest {spec!r} admits: "
          f"{'ok' if not errs else 'FAILS'}")
    return errs


# what a clone holds that is not the clone: environments, build outputs, caches, the temporary
# folders of other steps (tools/check_exercises.py writes its notebooks in tmp* at the top)
_NOT_SOURCE = {".git", ".venv", "_build", "build", ".whl", ".pytest_cache", ".ruff_cache"}


def source_copy(dest: Path) -> Path:
    """A copy of this clone's files for the setup cell to install cudabook from, so that pip's
    build (build/, cudabook.egg-info) happens there and not in the clone, where other steps of
    the CPU lane may be running at the same time."""
    def ignore(d: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _NOT_SOURCE or n == "__pycache__" or
                n.endswith(".egg-info") or (Path(d) == ROOT and n.startswith("tmp"))}
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def lane_env(venv: Path, src: Path = ROOT) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        "VIRTUAL_ENV", "PYTHONPATH", "NUMBA_ENABLE_CUDASIM", "CUDA_PATH", "CUDA_HOME")}
    main_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [p for p in env.get("PATH", "").split(
        os.pathsep) if p != main_bin])
    env.update(CUDABOOK_SRC=str(src), MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    return env


def nbval(vpy: Path, nb, name: str, env: dict[str, str]) -> tuple[dict[int, str], str]:
    """Run ``pytest --nbval-lax`` on ``nb`` alone in an empty folder: per code cell, 'passed',
    'failed' or 'skipped'; and the output for the log."""
    with tempfile.TemporaryDirectory(prefix="lone-") as d:
        path = Path(d) / name
        nbformat.write(nb, str(path))
        xml = Path(d) / "junit.xml"
        r = run([str(vpy), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                 name, f"--junitxml={xml}"], cwd=d, env=env, timeout=1800)
        status: dict[int, str] = {}
        if xml.is_file():
            for tc in ET.parse(xml).getroot().iter("testcase"):
                try:
                    idx = int(tc.get("name", "").split()[-1])  # "Cell 7": the 8th code cell
                except ValueError:
                    continue
                status[idx] = ("failed" if tc.find("failure") is not None
                               or tc.find("error") is not None else
                               "skipped" if tc.find("skipped") is not None else "passed")
        first = r.stdout.find("\n___")  # the first failure's report, where the cause is
        return status, (r.stdout[first:first + 4000] if first >= 0 else r.stdout[-3000:]) + \
            r.stderr[-1500:]


def is_gpu(cell) -> bool:
    return cell.source.lstrip().startswith("%%gpu")


def main(chapters: list[str]) -> int:
    t0 = time.time()
    pick = (lambda p: any(p.name.startswith(c) for c in chapters)) if chapters else bool
    lessons = [p for p in sorted((ROOT / "lessons").glob("*.ipynb")) if pick(p)]
    exercises = [p for p in sorted((ROOT / "exercises").glob("*.ipynb")) if pick(p)]
    work = Path(tempfile.mkdtemp(prefix="colab-lane-"))
    bad: list[str] = []
    try:
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        vpy = venv / "bin" / "python"
        env = lane_env(venv, source_copy(work / "src"))
        pins = floors(ROOT / "requirements.txt")
        pip(vpy, "--upgrade", "pip")
        pip(vpy, "--retries", "0", "--timeout", "20", *TORCH)  # as tools/setup.sh does
        pip(vpy, *pins)
        have = run([str(vpy), "-m", "pip", "list", "--format=freeze"], env=env).stdout
        vers = dict(ln.split("==", 1) for ln in have.split() if "==" in ln)
        print("colab lane: " + ", ".join(f"{k} {vers.get(k, '?')}" for k in (
            "numpy", "numba", "numba-cuda", "cupy-cuda12x", "torch", "matplotlib")) +
            f" (python {sys.version.split()[0]}; Colab's 3.13 is not available here)")
        if "cudabook" in vers:
            raise SystemExit("colab lane: cudabook is installed before any notebook ran")
        for sim in ("1", "0"):
            r = run([str(vpy), "-c", "import numba.cuda"], env={**env, "NUMBA_ENABLE_CUDASIM": sim})
            if r.returncode:
                bad.append(f"numba.cuda does not import (NUMBA_ENABLE_CUDASIM={sim}): "
                           f"{r.stderr.strip().splitlines()[-1]}")
        if bad:
            return report(bad, t0)

        def lesson(i: int, p: Path) -> tuple[list[str], str]:
            t1 = time.time()
            out, problems = [], []
            try:
                st, log = nbval(vpy, nbformat.read(str(p), as_version=4), p.name, env)
                if i == 0 and "Run the same pytest command again" in log:
                    # the setup cell installed cudabook after pytest loaded its plugins, so
                    # %%gpu cells failed and asked for a second run, as a reader is asked
                    out.append(f"  lessons/{p.name}: first run installed cudabook; run again")
                    st, log = nbval(vpy, nbformat.read(str(p), as_version=4), p.name, env)
            except Exception as e:  # noqa: BLE001  (unreadable, or past the time limit)
                st, log = {}, f"{type(e).__name__}: {e}"
            failed = [k for k, v in st.items() if v == "failed"]
            if not st or failed:
                problems.append(f"lessons/{p.name}: cells {failed} failed alone\n{log}")
            out.append(f"  lessons/{p.name}: {sum(v == 'passed' for v in st.values())} passed, "
                       f"{sum(v == 'skipped' for v in st.values())} skipped, {len(failed)} "
                       f"failed ({time.time() - t1:.0f} s)")
            return problems, "\n".join(out)

        def exercise(p: Path) -> tuple[list[str], str]:
            t1 = time.time()
            problems = []
            try:
                ex = nbformat.read(str(p), as_version=4)
                sol = nbformat.read(str(ROOT / "solutions" / p.name), as_version=4)
                solved, missing = solved_exercise(ex, sol)
                if missing:
                    raise ValueError(f"cells {missing} have no twin in the solution")
                st_u, log_u = nbval(vpy, ex, p.name, env)
                st_s, log_s = nbval(vpy, solved, p.name, env)
            except Exception as e:  # noqa: BLE001  (no solution, cells out of step, time limit)
                return [f"exercises/{p.name}: {type(e).__name__}: {e}"], \
                    f"  exercises/{p.name}: not graded"
            code = [c for c in ex.cells if c.cell_type == "code"]
            for k, c in enumerate(code):
                u, s = st_u.get(k, "not run"), st_s.get(k, "not run")
                if GRADER_MARK in c.source and u not in ("failed", "skipped"):
                    problems.append(f"exercises/{p.name} cell {k}: the unsolved grader {u} alone")
                if is_gpu(c) and (u != "skipped" or s != "skipped"):
                    problems.append(f"exercises/{p.name} cell {k}: a %%gpu cell {u}/{s} alone "
                                    "(must be skipped without a GPU)")
                if s not in ("passed", "skipped"):
                    problems.append(f"exercises/{p.name} cell {k}: with the solution put back it "
                                    f"{s} alone\n{log_s}")
            gr = [k for k, c in enumerate(code) if GRADER_MARK in c.source]
            return problems, (f"  exercises/{p.name}: {len(gr)} graders; unsolved "
                              f"{sum(st_u.get(k) == 'failed' for k in gr)} fail, solved "
                              f"{sum(st_s.get(k) == 'passed' for k in gr)} pass, "
                              f"{sum(st_s.get(k) == 'skipped' for k in gr)} skipped "
                              f"({time.time() - t1:.0f} s)")

        # the first lesson alone: its setup cell installs cudabook, as on a fresh runtime; then
        # every other notebook, each alone in its own folder, one per core
        if lessons:
            problems, text = lesson(0, lessons[0])
            bad += problems
            print(text, flush=True)
            where = run([str(vpy), "-c", "import cudabook; print(cudabook.__file__)"], env=env,
                        cwd=work).stdout.strip()
            if not where.startswith(str(venv)):
                bad.append(f"the setup cell did not install cudabook into the fresh "
                           f"environment (import finds {where or 'nothing'})")
        jobs = [(lesson, (i, p)) for i, p in enumerate(lessons) if i > 0] + \
            [(exercise, (p,)) for p in exercises]
        n_jobs = max(1, int(os.environ.get("JOBS", os.cpu_count() or 1)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs) as pool:
            for problems, text in pool.map(lambda job: job[0](*job[1]), jobs):
                bad += problems
                print(text, flush=True)
        bad += newest_numba_corner(vpy, env)
    finally:
        if os.environ.get("COLAB_LANE_KEEP"):
            print(f"colab lane: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return report(bad, t0, len(lessons), len(exercises))


def report(bad: list[str], t0: float, n_les: int = 0, n_ex: int = 0) -> int:
    for b in bad:
        print("COLAB:", b)
    print(f"colab lane: {n_les} lessons, {n_ex} exercises alone, {len(bad)} problems "
          f"({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
