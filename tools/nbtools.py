#!/usr/bin/env python3
"""Notebook tools of the book.

  python tools/nbtools.py exercises          regenerate exercises/ from solutions/
  python tools/nbtools.py exercises --check  fail if exercises/ drifted from solutions/
  python tools/nbtools.py check [NB ...]     the notebook format policy (see POLICY below)
  python tools/nbtools.py from-py SRC.py OUT.ipynb   percent-format script -> notebook
  python tools/nbtools.py to-py NB.ipynb OUT.py      notebook -> percent-format script
  python tools/nbtools.py canon NB.ipynb ...         rewrite notebooks in canonical form
  python tools/nbtools.py coalesce [NB ...]  join adjacent outputs of one stream (stdout after
                                             stdout) into one, as Jupyter shows them; default:
                                             every notebook of lessons/, solutions/, exercises/
  python tools/nbtools.py urls               fail where a file carries another project address
  python tools/nbtools.py set-url URL [OLD]  a fork's address: _config.yml, then every copy
  python tools/nbtools.py stamp REF [LAUNCH] publish time: setup cells install cudabook at REF,
                                             launch buttons open the notebooks at LAUNCH (or REF)
  python tools/nbtools.py check-stamp SITE REF [LAUNCH]   the built book carries that stamp

The project's address lives once, in _config.yml (repository.url); the setup cell below and the
publish workflow read it, the book's buttons too, and ``urls`` fails CI where README.md, a page,
a notebook or CITATION.cff carries another.

Solution regions
  Python:  ### BEGIN SOLUTION ex01.1   ...   ### END SOLUTION
  CUDA C++ (inside a source string):  // BEGIN SOLUTION ex01.2   ...   // END SOLUTION
A Python region becomes ``raise NotImplementedError("ex01.1: ...")``; a C++ region becomes a
TODO comment that leaves the kernel's output unwritten (never __trap(), which would poison the
CUDA context for every later cell).

Conventions of a solutions/ notebook that the generator turns into the exercise page
  Grader cell (``# NBVAL_CHECK_OUTPUT`` and a call ``exNN_k(...)``): the solution stores its
    ``PASS exNN.k`` line; the exercise stores no output and no execution count (nbval then only
    fails it when it raises, as every grader does on a wrong answer), so the unsolved page never
    shows a PASS that was not earned. A comment line tells the reader what running it does.
  Hints: a markdown cell whose first line is ``**Hints exNN.k**`` followed by a numbered list,
    one item per level (``1. ...``, ``2. ...``; an item may run over several lines), becomes
    collapsed ``<details>`` blocks, one per level (Jupyter, Colab and the built book all render
    them closed). The solution page shows the list as written.
  Solution notes: a markdown cell whose first line starts with ``**Solution notes exNN.k**``
    (the design choice, the common wrong answer, the measured effect) is left out of the
    exercise. Cells keep their ids, so a tool can pair exercise and solution cells by id.

POLICY
  * every notebook is canonical nbformat 4 (as written by ``canon``) and has the shared
    metadata (kernel python3, Colab asks for a GPU), and starts with the setup cell;
  * lessons/ and solutions/ have every code cell executed, on a GPU (``metadata.cudabook``
    names it), with outputs (a cell that needs no GPU and was added between two GPU runs may
    store a CPU run's output, tagged ``cpu-run``: tools/cpu_cells.py; a tagged cell that needs
    a GPU or times something is refused); a lesson stores at least one figure;
  * a lesson or solution cell that shows kernels/ source (``cb.show_source("f.cu", "k")``)
    stores that source as it is now: the book shows the code under test, so a kernel edited
    after the run needs a new run;
  * a markdown cell never starts display math (a ``$$`` line) on the line right after a line of
    prose: MyST then reads it as inline ``$`` pairs and the page shows raw TeX;
  * a code cell stores one output per run of one stream: adjacent stdout outputs are joined
    (``coalesce``; the GPU lane's gpu_execute.py does it), or the page draws one box per print;
  * exercises/ have no outputs and no execution counts (grader cells included: a stored
    ``PASS`` would be a pass the reader has not earned); every grader cell of a solution
    (``# NBVAL_CHECK_OUTPUT``) stores ``PASS exNN.k``;
  * every graded exercise of a solution has a hints cell (``**Hints exNN.k**``) of two or more
    levels: a first nudge, then one closer to the answer, never the answer.
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

CONFIG = ROOT / "_config.yml"


def _block(text: str, section: str) -> re.Match | None:
    """The body of the top-level ``section:`` of a YAML text (no YAML library: the GPU machine
    that runs this module has none)."""
    return re.search(rf"^{section}:[ \t]*(?:#.*)?\n((?:[ #].*\n|\n)*)", text, re.M)


def _get_key(text: str, section: str, key: str) -> str:
    m = _block(text, section)
    k = m and re.search(rf"^\s+{key}:[ \t]*(\"[^\"]*\"|[^\s#]*)", m.group(1), re.M)
    return k.group(1).strip('"') if k else ""


def repo_url(config: Path = CONFIG) -> str:
    """The project's address, ``repository.url`` of _config.yml (the one place it is kept)."""
    url = _get_key(config.read_text(), "repository", "url")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url or ""):
        raise SystemExit(f"{config}: repository.url must be https://github.com/OWNER/REPO, "
                         f"not {url!r}")
    return url


def owner_repo(url: str) -> tuple[str, str]:
    owner, repo = url.rstrip("/").split("/")[-2:]
    return owner, repo


def book_url(url: str) -> str:
    """Where GitHub Pages serves the book of the repository ``url``."""
    owner, repo = owner_repo(url)
    return f"https://{owner.lower()}.github.io/{repo}/"


def setup_cell(url: str, ref: str | None = None) -> str:
    """The first code cell of every notebook; ``ref`` (a tag or commit) only in published copies:
    the committed notebooks install the default branch, a published page installs the release it
    was built from (``stamp``)."""
    where = (f"it from the repository at {ref}, the release this page was built from, or from "
             "$CUDABOOK_SRC\n# if set." if ref else
             "it from the repository, or from $CUDABOOK_SRC if set.")
    return f'''\
# Setup. Where the book's helper package cudabook is missing (a fresh Colab runtime), install
# {where} Where it is installed: nothing to do.
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("cudabook") is None:
    src = os.environ.get("CUDABOOK_SRC", "git+{url}{"@" + ref if ref else ""}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", src], check=True)
    importlib.invalidate_caches()'''


REPO_URL = repo_url()
SETUP_CELL = setup_cell(REPO_URL)

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


_HINTS = re.compile(r"^\*\*Hints (ex\d\d\.\d+)\*\*[ \t]*$")
_NOTES = re.compile(r"^\*\*Solution notes (ex\d\d\.\d+)")
_ITEM = re.compile(r"^(\d+)\.[ \t]+")
GRADER_NOTE = ("# Run this cell after your answer: it prints PASS {ex} when the answer is right, "
               "or\n# raises an error that names the failing case and the likely mistake.")


def hint_cell_ex(cell) -> str | None:
    """exNN.k if ``cell`` is a hints cell of the convention (``**Hints exNN.k**`` first line)."""
    if cell.cell_type != "markdown" or not cell.source:
        return None
    m = _HINTS.match(cell.source.splitlines()[0])
    return m.group(1) if m else None


def is_solution_notes(cell) -> bool:
    return cell.cell_type == "markdown" and bool(_NOTES.match(cell.source))


def render_hints(src: str, where: str = "") -> str:
    """``**Hints exNN.k**`` + a numbered list -> one collapsed ``<details>`` block per level."""
    lines = src.splitlines()
    ex = _HINTS.match(lines[0]).group(1)
    items: list[list[str]] = []
    for ln in lines[1:]:
        m = _ITEM.match(ln)
        if m:
            if int(m.group(1)) != len(items) + 1:
                raise ValueError(f"{where}: hints of {ex} must be numbered 1, 2, ...")
            items.append([ln[m.end():]])
        elif ln.strip() and items:
            items[-1].append(ln.strip())
        elif ln.strip():
            raise ValueError(f"{where}: hints of {ex}: text before the first numbered item")
    if not items:
        raise ValueError(f"{where}: hints of {ex} have no numbered item")
    out = []
    for k, item in enumerate(items, 1):
        label = "a first nudge" if k == 1 else ("closer to the answer" if k < len(items)
                                                else "almost the answer")
        out.append(f"<details><summary>Hint {k} for {ex} ({label})</summary>\n\n"
                   + "\n".join(item) + "\n\n</details>")
    return "\n\n".join(out)


def _grader_note(src: str) -> str:
    m = re.search(r"\b(ex\d\d)_(\d+)\(", src)
    if not m:
        return src
    note = GRADER_NOTE.format(ex=f"{m.group(1)}.{m.group(2)}")
    lines = src.splitlines()
    at = 1 if lines and lines[0].startswith("%%") else 0  # a cell magic stays first
    return "\n".join(lines[:at] + [note] + lines[at:])


def solved_exercise(ex, sol):
    """The exercise with the solution put back: each cell takes the source of the solution cell of
    the same id (the exercise leaves out the solution-notes cells, so cells pair by id, not by
    position), and each grader the PASS output the solution stores (nbval compares it). Returns
    (notebook, ids of exercise cells that have no twin of their type in the solution)."""
    solved = nbformat.from_dict(copy.deepcopy(ex))
    by_id = {c.get("id"): c for c in sol.cells}
    missing = []
    for c_ex in solved.cells:
        c_sol = by_id.get(c_ex.get("id"))
        if c_sol is None or c_sol.cell_type != c_ex.cell_type:
            missing.append(c_ex.get("id"))
            continue
        c_ex.source = c_sol.source
        if is_grader(c_sol):
            c_ex.outputs = c_sol.outputs
            c_ex.execution_count = c_sol.execution_count
    return solved, missing


def make_exercise(sol):
    nb = copy.deepcopy(sol)
    nb.cells = [c for c in nb.cells if not is_solution_notes(c)]
    for c in nb.cells:
        where = f"cell {c.get('id')}"
        c.source = strip_solutions(c.source, where=where)
        if hint_cell_ex(c):
            c.source = render_hints(c.source, where=where)
        if c.cell_type != "code":
            continue
        if is_grader(c):
            c.source = _grader_note(c.source)
        c.execution_count = None  # an exercise stores no run: no PASS the reader did not earn
        c.outputs = []
        tags = c.metadata.get("tags")
        if tags and "cpu-run" in tags:           # a tag about stored outputs, which it has none of
            c.metadata["tags"] = [t for t in tags if t != "cpu-run"]
            if not c.metadata["tags"]:
                del c.metadata["tags"]
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


# ----------------------------------------------------------------------------- page form
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def display_math_errors(src: str) -> list[tuple[int, str]]:
    """(line number, line) of each ``$$`` line that starts display math right after a line of
    prose (the rule of shared/hooks/before-stop): MyST's dollarmath then pairs the dollars as
    inline math, and the page shows raw TeX. A blank line before it, or a previous line that ends
    in ``$$``, is fine; lines inside display math and code fences are not prose."""
    out, fence, in_math, prev = [], None, False, ""
    for n, line in enumerate(src.splitlines(), 1):
        f = _FENCE.match(line)
        if fence:
            if f and f.group(1)[0] == fence[0] and len(f.group(1)) >= len(fence):
                fence = None
            prev = ""
            continue
        if f and not in_math:
            fence, prev = f.group(1), ""
            continue
        if not in_math and line.lstrip().startswith("$$") and prev.strip() \
                and not prev.rstrip().endswith("$$"):
            out.append((n, line))
        if line.count("$$") % 2:
            in_math = not in_math
        prev = line
    return out


def split_streams(nb) -> list[tuple[int, str, str, int]]:
    """(cell index, cell id, stream name, outputs that could be joined to the one before) for
    each code cell that stores adjacent outputs of one stream."""
    out = []
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        runs: dict[str, int] = {}
        for a, b in zip(c.outputs, c.outputs[1:]):
            if a.output_type == b.output_type == "stream" and a.name == b.name:
                runs[a.name] = runs.get(a.name, 0) + 1
        out += [(i, c.get("id"), name, k) for name, k in runs.items()]
    return out


def coalesce_streams(nb) -> int:
    """Join adjacent stream outputs of one stream in every code cell, text unchanged (what
    nbconvert's coalesce_streams does, without its carriage-return editing); returns how many
    outputs were joined into the one before them."""
    joined = 0
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        outs = []
        for o in c.outputs:
            last = outs[-1] if outs else None
            if (last is not None and o.output_type == last.output_type == "stream"
                    and o.name == last.name):
                last.text += o.text
                joined += 1
            else:
                outs.append(o)
        c.outputs = outs
    return joined


def cmd_coalesce(paths: list[str]) -> int:
    files = [Path(p) for p in paths] or sorted(
        p for d in ("lessons", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
    total = 0
    for p in files:
        nb = read(p)
        k = coalesce_streams(nb)
        if k:
            write(nb, p)
            total += k
            print(f"coalesce: {p}: {k} outputs joined to the one before")
    print(f"coalesce: {len(files)} notebooks, {total} outputs joined")
    return 0


# ----------------------------------------------------------------------------- policy
#: what a cell stored from a CPU run (tools/cpu_cells.py, tag cpu-run) may not contain
CPU_REFUSED = re.compile(r"^\s*%%gpu|\bimport cupy\b|\bcb\.bench\(|\bcb\.report\(", re.M)


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
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            for n, line in display_math_errors(c.source):
                errs.append(f"{rel}: cell {i} ({c.get('id')}) line {n}: display math starts "
                            f"right after a prose line and renders as raw TeX; put a blank line "
                            f"before it: {line.strip()[:60]!r}")
    for i, cid, name, k in split_streams(nb):
        errs.append(f"{rel}: cell {i} ({cid}): {k} {name} output{'s' if k > 1 else ''} right after "
                    f"another {name} output, not merged: the page draws a box for each "
                    f"(run: python tools/nbtools.py coalesce {rel})")
    kind = rel.parts[0]
    graders = [c for c in code if is_grader(c)]
    for i, c in enumerate(nb.cells):
        if "cpu-run" in (c.metadata.get("tags") or []) and (
                kind == "exercises" or c.cell_type != "code" or CPU_REFUSED.search(c.source)):
            errs.append(f"{rel}: cell {i} ({c.get('id')}) is tagged cpu-run (its output from a CPU "
                        "run) but needs a GPU, times something, or stores nothing: only "
                        "tools/cpu_cells.py tags cells, and only those that need no GPU")
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
        errs += stale_source_errors(nb, rel)
        if kind == "lessons" and not any("image/png" in o.get("data", {}) for c in code
                                         for o in c.outputs):
            errs.append(f"{rel}: has no figure (a lesson plots its results; was it executed with "
                        "MPLBACKEND=Agg?)")
    if kind == "exercises":
        for i, c in enumerate(nb.cells):
            if c.cell_type == "code" and (c.outputs or c.execution_count is not None):
                errs.append(f"{rel}: cell {i} has outputs or an execution count (an exercise "
                            "stores no run: a stored PASS would be one the reader did not earn)")
    if kind in ("exercises", "solutions"):
        if not graders:
            errs.append(f"{rel}: has no grader cell ({GRADER_MARK})")
    if kind == "solutions":
        levels: dict[str, int] = {}
        for c in nb.cells:
            ex = hint_cell_ex(c)
            if ex:
                try:
                    levels[ex] = render_hints(c.source, where=f"{rel} cell {c.get('id')}") \
                        .count("<details>")
                except ValueError as e:
                    errs.append(str(e))
        for c in graders:
            for a, b in re.findall(r"\b(ex\d\d)_(\d+)\(", c.source):
                ex = f"{a}.{b}"
                if levels.get(ex, 0) < 2:
                    errs.append(f"{rel}: {ex} has {levels.get(ex, 0)} hint levels; every graded "
                                "exercise has a '**Hints exNN.k**' cell with two or more (a first "
                                "nudge, then one closer to the answer)")
        for c in graders:
            lines = "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            m = re.search(r"\b(ex\d\d_\d+)\(", c.source)
            want = f"PASS {m.group(1).replace('_', '.')}" if m else None
            if not want or lines.strip() != want:
                errs.append(f"{rel}: grader cell {c.get('id')} must store exactly '{want}', "
                            f"has {lines.strip()!r}")
    return errs


SHOW_SOURCE = re.compile(r'show_source\(\s*"([^"]+)"\s*(?:,\s*"([^"]+)"\s*)?\)')


def stale_source_errors(nb, rel) -> list[str]:
    """Cells whose stored ``cb.show_source`` output is not the source in kernels/ now."""
    from cudabook.source import kernel_source

    errs = []
    for c in nb.cells:
        calls = SHOW_SOURCE.findall(c.source) if c.cell_type == "code" else []
        shown = "".join(o.get("data", {}).get("text/markdown", "") + o.get("text", "")
                        for o in c.get("outputs", []))
        for f, k in calls:
            what = f"kernels/{f}" + (f" ({k})" if k else "")
            try:
                src = kernel_source(f, k or None)
            except (OSError, ValueError, KeyError) as e:
                errs.append(f"{rel}: cell {c.get('id')} shows {what}, which is gone: {e}")
                continue
            if src not in shown:
                errs.append(f"{rel}: cell {c.get('id')} shows {what} as it was when executed, "
                            "not as it is now: re-execute the notebook on a GPU")
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


# ----------------------------------------------------------------------------- the address
def _set_key(text: str, section: str, key: str, value: str) -> str:
    """Set ``key`` inside the top-level ``section:`` block of a YAML text, keeping comments."""
    m = _block(text, section)
    if not m:
        raise SystemExit(f"_config.yml has no {section}: block")
    block, n = re.subn(rf"^(\s+{key}:[ \t]*)(\"[^\"]*\"|[^\s#]*)(.*)$",
                       lambda k: k.group(1) + value + k.group(3), m.group(1), count=1,
                       flags=re.M)
    if not n:
        raise SystemExit(f"_config.yml: {section}.{key} is missing")
    return text[:m.start(1)] + block + text[m.end(1):]


def _carriers() -> list[Path]:
    """Every file that may carry the project's address."""
    files = [ROOT / f for f in ("README.md", "CITATION.cff", "CONTRIBUTING.md", "pyproject.toml")]
    files += sorted((ROOT / "book").rglob("*.md"))
    files += sorted(p for d in ("lessons", "solutions", "exercises") for p in (ROOT / d).glob(
        "*.ipynb"))
    files += sorted((ROOT / "cudabook").rglob("*.py")) + sorted((ROOT / ".github").rglob(
        "*.yml"))
    return [f for f in files if f.is_file()]


_GH = re.compile(r"github\.com/([\w-]+)/([\w.-]*\w)", re.I)
_IO = re.compile(r"([\w-]+)\.github\.io/([\w.-]*\w)", re.I)


def url_errors(url: str) -> list[str]:
    """Files that carry an address of this project other than ``url`` (a stale copy of an old
    address, as a fork would leave): any github.com/OWNER/REPO or OWNER.github.io/REPO link whose
    owner or repository name is this project's but which is not this project's address. Links to
    other projects (NVIDIA/cutlass, karpathy/llm.c) pass."""
    owner, repo = (s.lower() for s in owner_repo(url))
    errs = []
    for f in _carriers():
        text = f.read_text(errors="replace")
        for rx, what in ((_GH, url), (_IO, book_url(url))):
            for m in rx.finditer(text):
                o, r = m.group(1).lower(), m.group(2).lower()
                if (o == owner or r == repo) and (o, r) != (owner, repo):
                    line = text.count("\n", 0, m.start()) + 1
                    errs.append(f"{f.relative_to(ROOT)}:{line}: {m.group(0)} is not this "
                                f"project's address ({what}, from _config.yml)")
    readme = (ROOT / "README.md").read_text()
    if book_url(url) not in readme:
        errs.append(f"README.md does not say where the book is read ({book_url(url)})")
    return errs


def cmd_urls() -> int:
    errs = url_errors(REPO_URL)
    for e in errs:
        print("ADDRESS:", e)
    print(f"project address {REPO_URL}: {len(_carriers())} files, {len(errs)} problems")
    if errs:
        print(f"Fix: python tools/nbtools.py set-url {REPO_URL} OLD_ADDRESS  (rewrites every "
              "copy of OLD_ADDRESS)")
    return 1 if errs else 0


def cmd_set_url(new: str, old: str | None = None) -> int:
    """A fork's address: _config.yml first, then every file that carries the old one (``old``,
    by default the address _config.yml holds now)."""
    for u in (new, old):
        if u is not None and not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", u):
            raise SystemExit(f"set-url: {u!r} is not https://github.com/OWNER/REPO")
    text = CONFIG.read_text()
    old = old or repo_url()
    CONFIG.write_text(_set_key(text, "repository", "url", new))
    n = 0
    for f in _carriers():
        t = f.read_text()
        t2 = t.replace(old, new).replace(book_url(old), book_url(new))
        if t2 != t:
            f.write_text(t2)
            n += 1
    print(f"set-url: {old} -> {new} in _config.yml and {n} other files")
    return 0


def cmd_stamp(ref: str, launch: str | None) -> int:
    """Publish time (the workflow, on its own checkout): every notebook's setup cell installs
    cudabook at ``ref``, the launch buttons open the notebooks at ``launch`` (a commit that holds
    these stamped notebooks; default ``ref``), the footer names the release."""
    if not re.fullmatch(r"[\w.+/-]+", ref) or (launch and not re.fullmatch(r"[\w.+/-]+",
                                                                           launch)):
        raise SystemExit(f"stamp: {ref!r} / {launch!r} is not a tag or commit")
    cell = setup_cell(REPO_URL, ref)
    n = 0
    for p in sorted(p for d in ("lessons", "solutions", "exercises") for p in
                    (ROOT / d).glob("*.ipynb")):
        nb = read(p)
        code = [c for c in nb.cells if c.cell_type == "code"]
        if not code or SETUP_MARK not in code[0].source:
            raise SystemExit(f"stamp: {p.relative_to(ROOT)} has no setup cell")
        code[0].source = cell
        p.write_text(nbformat.writes(nb, version=4) + "\n")
        n += 1
    text = _set_key(CONFIG.read_text(), "repository", "branch", launch or ref)
    CONFIG.write_text(re.sub(r"^(\s+cudabook_release:\s*).*$", lambda m: m.group(1) + f'"{ref}"',
                             text, count=1, flags=re.M))
    print(f"stamp: {n} notebooks install cudabook at {ref}; launch buttons open {launch or ref}")
    return 0


def stamp_errors(site: Path, ref: str, launch: str) -> list[str]:
    """A built book whose notebooks and buttons are not stamped with ``ref`` / ``launch``."""
    errs = []
    want = setup_cell(REPO_URL, ref)
    srcs = sorted((site / "_sources").rglob("*.ipynb"))
    if not srcs:
        errs.append(f"{site}/_sources holds no notebook")
    for p in srcs:
        code = [c for c in read(p).cells if c.cell_type == "code"]
        if not code or code[0].source != want:
            errs.append(f"{p.relative_to(site)}: the setup cell does not install cudabook at {ref}")
    colab = re.compile(r"colab\.research\.google\.com/github/([^\"'<> ]+?\.ipynb)")
    for page in sorted(site.rglob("*.html")):
        for m in colab.finditer(page.read_text(errors="replace")):
            o, r = owner_repo(REPO_URL)
            if not m.group(1).startswith(f"{o}/{r}/blob/{launch}/"):
                errs.append(f"{page.relative_to(site)}: Colab button opens {m.group(1)}, not the "
                            f"{launch} copy")
    return errs


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
    if cmd == "urls":
        return cmd_urls()
    if cmd == "set-url" and len(rest) in (1, 2):
        return cmd_set_url(*rest)
    if cmd == "stamp" and len(rest) in (1, 2):
        return cmd_stamp(rest[0], rest[1] if len(rest) == 2 else None)
    if cmd == "check-stamp" and len(rest) in (2, 3):
        errs = stamp_errors(Path(rest[0]), rest[1], rest[2] if len(rest) == 3 else rest[1])
        for e in errs:
            print("STAMP:", e)
        print(f"stamp {rest[1]}: {len(errs)} problems")
        return 1 if errs else 0
    if cmd == "coalesce":
        return cmd_coalesce(rest)
    if cmd == "canon":
        for p in rest:
            write(read(Path(p)), Path(p))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
