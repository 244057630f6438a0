#!/usr/bin/env python3
"""Notebook tools of the book.

  python tools/nbtools.py exercises          regenerate exercises/ from solutions/
  python tools/nbtools.py exercises --check  fail if exercises/ drifted from solutions/
  python tools/nbtools.py check [NB ...]     the notebook format policy (see POLICY below)
  python tools/nbtools.py from-py SRC.py OUT.ipynb   percent-format script -> notebook
  python tools/nbtools.py to-py NB.ipynb OUT.py      notebook -> percent-format script
  python tools/nbtools.py canon NB.ipynb ...         rewrite notebooks in canonical form

Solution regions
  Python:  ### BEGIN SOLUTION ex01.1   ...   ### END SOLUTION
  CUDA C++ (inside a source string):  // BEGIN SOLUTION ex01.2   ...   // END SOLUTION
A Python region becomes ``raise NotImplementedError("ex01.1: ...")``; a C++ region becomes a
TODO comment that leaves the kernel's output unwritten (never __trap(), which would poison the
CUDA context for every later cell).

POLICY
  * every notebook is canonical nbformat 4 (as written by ``canon``) and has the shared
    metadata (kernel python3, Colab asks for a GPU), and starts with the setup cell;
  * lessons/ and solutions/ have every code cell executed, on a GPU (``metadata.cudabook``
    names it), with outputs; a lesson stores at least one figure;
  * exercises/ have no outputs except on grader cells (``# NBVAL_CHECK_OUTPUT``), whose
    stored line is ``PASS exNN.k``; every grader cell of a solution stores that line.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SETUP_MARK = "CUDABOOK_SRC"
GRADER_MARK = "NBVAL_CHECK_OUTPUT"

METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                   "name": "python3"},
    "language_info": {"name": "python"},
    "accelerator": "GPU",
    "colab": {"gpuType": "T4", "provenance": []},
}

SETUP_CELL = '''\
# Setup. Where the book's helper package cudabook is missing (a fresh Colab runtime), install
# it from the repository, or from $CUDABOOK_SRC if set. Where it is installed: nothing to do.
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("cudabook") is None:
    src = os.environ.get("CUDABOOK_SRC", "git+https://github.com/cuda-dl-book/cuda-dl-book")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", src], check=True)
    importlib.invalidate_caches()'''

_PY_BEGIN = re.compile(r"^(\s*)### BEGIN SOLUTION (ex\d\d\.\d+)\s*$")
_PY_END = re.compile(r"^\s*### END SOLUTION\s*$")
_C_BEGIN = re.compile(r"^(\s*)// BEGIN SOLUTION (ex\d\d\.\d+)\s*$")
_C_END = re.compile(r"^\s*// END SOLUTION\s*$")


# ----------------------------------------------------------------------------- canonical form
def canonical(nb) -> str:
    nb = copy.deepcopy(nb)
    nb.metadata = {**nb.metadata, **METADATA,
                   **({"cudabook": nb.metadata["cudabook"]} if "cudabook" in nb.metadata
                      else {})}
    for k in list(nb.metadata):
        if k not in METADATA and k != "cudabook":
            del nb.metadata[k]
    for i, c in enumerate(nb.cells):
        c.id = c.get("id") or f"cell-{i:03d}"
        if c.cell_type == "code" and SETUP_MARK in c.source and i <= 1:
            c.source = SETUP_CELL  # one text for every notebook, written once here
        c.metadata = {k: v for k, v in c.metadata.items() if k in ("tags",)}
        if c.cell_type == "code":
            for o in c.outputs:
                if "metadata" in o and o.output_type in ("display_data", "execute_result"):
                    o.metadata = {k: v for k, v in o.metadata.items() if k != "collapsed"}
    nb.nbformat, nb.nbformat_minor = 4, 5
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def read(path: Path):
    return nbformat.read(str(path), as_version=4)


def write(nb, path: Path) -> None:
    Path(path).write_text(canonical(nb))


# ----------------------------------------------------------------------------- percent format
def from_py(text: str):
    """`# %%` starts a code cell, `# %% [markdown]` a markdown cell (lines start with '# ')."""
    nb = nbformat.v4.new_notebook()
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
            continue
        if not cells:
            continue
        cells[-1][1].append(line)
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if kind == "markdown":
            src = "\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines)
            nb.cells.append(nbformat.v4.new_markdown_cell(src))
        else:
            nb.cells.append(nbformat.v4.new_code_cell("\n".join(lines)))
    for i, c in enumerate(nb.cells):
        c.id = f"cell-{i:03d}"
    nb.metadata = dict(METADATA)
    return nb


def to_py(nb) -> str:
    out = []
    for c in nb.cells:
        if c.cell_type == "markdown":
            out.append("# %% [markdown]")
            out += [("# " + ln) if ln else "#" for ln in c.source.splitlines()]
        else:
            out.append("# %%")
            out += c.source.splitlines()
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- exercises
def strip_solutions(src: str, where: str = "") -> str:
    lines, out, i = src.splitlines(), [], 0
    while i < len(lines):
        m = _PY_BEGIN.match(lines[i]) or _C_BEGIN.match(lines[i])
        if not m:
            if _PY_END.match(lines[i]) or _C_END.match(lines[i]):
                raise ValueError(f"{where}: END SOLUTION without BEGIN at line {i + 1}")
            out.append(lines[i])
            i += 1
            continue
        indent, ex, is_c = m.group(1), m.group(2), bool(_C_BEGIN.match(lines[i]))
        end = _C_END if is_c else _PY_END
        j = i + 1
        while j < len(lines) and not end.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{where}: BEGIN SOLUTION {ex} is never closed")
        n = sum(1 for ln in lines[i + 1:j] if ln.strip() and not ln.strip().startswith(
            ("#", "//")))
        size = f"roughly {n} line{'s' if n != 1 else ''}"
        if is_c:
            out.append(f"{indent}// TODO {ex} ({size}). Until then the output stays unwritten.")
        else:
            out.append(f"{indent}# TODO {ex} ({size})")
            out.append(f'{indent}raise NotImplementedError("{ex}")')
        i = j + 1
    return "\n".join(out)


def is_grader(cell) -> bool:
    return cell.cell_type == "code" and GRADER_MARK in cell.source


def make_exercise(sol):
    nb = copy.deepcopy(sol)
    for c in nb.cells:
        c.source = strip_solutions(c.source, where=f"cell {c.get('id')}")
        if c.cell_type != "code":
            continue
        if not is_grader(c):
            c.execution_count = None  # nbval compares only cells that were run: graders keep it
        if is_grader(c):
            c.outputs = [o for o in c.outputs if o.output_type == "stream"
                         and o.get("name") == "stdout" and o.text.startswith("PASS ")]
        else:
            c.outputs = []
    nb.metadata.pop("cudabook", None)
    return nb


def cmd_exercises(check: bool) -> int:
    bad = 0
    for sol in sorted((ROOT / "solutions").glob("*.ipynb")):
        ex_path = ROOT / "exercises" / sol.name
        want = canonical(make_exercise(read(sol)))
        have = ex_path.read_text() if ex_path.is_file() else ""
        if want == have:
            continue
        if check:
            bad += 1
            diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(),
                                             f"exercises/{sol.name}", "generated", lineterm="",
                                             n=1))[:30]
            print(f"DRIFT: exercises/{sol.name} differs from what solutions/{sol.name} "
                  "generates. Run: python tools/nbtools.py exercises\n" + "\n".join(diff))
        else:
            ex_path.write_text(want)
            print(f"wrote exercises/{sol.name}")
    for ex in sorted((ROOT / "exercises").glob("*.ipynb")):
        if not (ROOT / "solutions" / ex.name).is_file():
            bad += 1
            print(f"ORPHAN: exercises/{ex.name} has no solutions/{ex.name}")
    if check and not bad:
        print("exercises/ in sync with solutions/")
    return 1 if bad else 0


# ----------------------------------------------------------------------------- policy
def policy_errors(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    errs: list[str] = []
    text = path.read_text()
    nb = read(path)
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        errs.append(f"{rel}: invalid nbformat: {e.message}")
    if canonical(nb) != text:
        errs.append(f"{rel}: not canonical (run: python tools/nbtools.py canon {rel})")
    for k, v in METADATA.items():
        if nb.metadata.get(k) != v:
            errs.append(f"{rel}: metadata.{k} should be {v}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not code or code[0].source != SETUP_CELL or nb.cells.index(code[0]) > 1:
        errs.append(f"{rel}: must start with the setup cell (the one that reads {SETUP_MARK})")
    kind = rel.parts[0]
    graders = [c for c in code if is_grader(c)]
    if kind in ("lessons", "solutions"):
        gpu = nb.metadata.get("cudabook", {}).get("gpu")
        if not gpu:
            errs.append(f"{rel}: not executed on a GPU (metadata.cudabook.gpu missing): run "
                        "tools/gpu_lane.sh on a GPU machine and commit its outputs")
        unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                 and c.execution_count is None]
        if unrun:
            errs.append(f"{rel}: code cells {unrun[:5]} were not executed")
        if not any(c.outputs for c in code):
            errs.append(f"{rel}: has no outputs")
        if kind == "lessons" and not any("image/png" in o.get("data", {}) for c in code
                                         for o in c.outputs):
            errs.append(f"{rel}: has no figure (a lesson plots its results; was it executed with "
                        "MPLBACKEND=Agg?)")
    if kind == "exercises":
        for i, c in enumerate(nb.cells):
            if c.cell_type == "code" and c.outputs and not is_grader(c):
                errs.append(f"{rel}: cell {i} has outputs (only grader cells keep theirs)")
            if c.cell_type == "code" and (c.execution_count is None) == is_grader(c):
                errs.append(f"{rel}: cell {i}: only grader cells keep an execution count (nbval "
                            "compares only cells that were run)")
    if kind in ("exercises", "solutions"):
        if not graders:
            errs.append(f"{rel}: has no grader cell ({GRADER_MARK})")
        for c in graders:
            lines = "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            m = re.search(r"\b(ex\d\d_\d+)\(", c.source)
            want = f"PASS {m.group(1).replace('_', '.')}" if m else None
            if not want or lines.strip() != want:
                errs.append(f"{rel}: grader cell {c.get('id')} must store exactly '{want}', "
                            f"has {lines.strip()!r}")
    return errs


def cmd_check(only: list[str] | None = None) -> int:
    """The policy over every notebook, or over the given notebook paths."""
    errs = []
    paths = sorted(Path(p).resolve() for p in only) if only else sorted(
        p for d in ("lessons", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
    for p in paths:
        errs += policy_errors(p)
    for e in errs:
        print("POLICY:", e)
    print(f"notebook policy: {len(paths)} notebooks, {len(errs)} problems")
    return 1 if errs else 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "exercises":
        return cmd_exercises("--check" in rest)
    if cmd == "check":
        return cmd_check(rest)
    if cmd == "from-py":
        write(from_py(Path(rest[0]).read_text()), Path(rest[1]))
        return 0
    if cmd == "to-py":
        Path(rest[1]).write_text(to_py(read(Path(rest[0]))))
        return 0
    if cmd == "canon":
        for p in rest:
            write(read(Path(p)), Path(p))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
