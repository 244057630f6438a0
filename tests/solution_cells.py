"""Reference solutions for the tests, read from ``solutions/*.ipynb``: never a pasted copy.

    from solution_cells import Solution

    sol = Solution("03")                        # solutions/03_*.ipynb
    layernorm = sol.get("ex03.4", "layernorm")  # the reference answer of ex03.4
    src = sol.get("ex03.2", "sum_atomic_src")   # a CUDA C++ answer is a string variable
    # a wrong answer is the reference with an edit: each `old` must occur in the solution's
    # cells exactly once (count=n: n times; count=0: at least once), or the test stops with a
    # message, so a solution that changes cannot leave a test checking nothing
    racy = sol.get("ex03.4", "layernorm",
                   edits=[("    cuda.syncthreads()   # before reuse\\n", "")])
    stub = sol.stub("ex03.4", "layernorm")      # what the exercise notebook holds (generated
                                                # by tools/nbtools.py from the same cells)

The cells that hold ``BEGIN SOLUTION exNN.k`` markers run after the notebook's import
statements, in a namespace of their own; each cell's text is registered with ``linecache`` so
``inspect.getsource`` (and with it every static check of a grader) sees the edited code.
"""

from __future__ import annotations

import ast
import linecache
import re
import sys
from functools import lru_cache
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from nbtools import strip_solutions  # noqa: E402  (the generator of the exercise notebooks)

Edit = tuple  # (old, new) or (old, new, count)


class SolutionError(AssertionError):
    """The solution notebook does not hold what a test expects (it changed)."""


def _code(cell_source: str) -> str:
    """Python of a cell: IPython magics and shell lines dropped."""
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln
                     for ln in cell_source.splitlines())


@lru_cache(maxsize=None)
def _notebook(chapter: str) -> tuple[str, tuple[str, ...]]:
    paths = sorted((ROOT / "solutions").glob(f"{chapter}_*.ipynb"))
    if len(paths) != 1:
        raise SolutionError(f"expected one solutions/{chapter}_*.ipynb, found {paths}")
    nb = nbformat.read(str(paths[0]), as_version=4)
    return str(paths[0].relative_to(ROOT)), tuple(_code(c.source) for c in nb.cells
                                                   if c.cell_type == "code")


class Solution:
    """The reference solutions of one chapter's notebook."""

    def __init__(self, chapter: str):
        self.chapter = chapter
        self.path, self.code = _notebook(chapter)

    def imports(self) -> str:
        """Every top-level import statement of the notebook, in order."""
        out = []
        for src in self.code:
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            out += [ast.get_source_segment(src, n) for n in tree.body
                    if isinstance(n, (ast.Import, ast.ImportFrom))]
        return "\n".join(dict.fromkeys(out))

    def cells(self, ex: str) -> list[str]:
        """The code cells that hold ``BEGIN SOLUTION <ex>``."""
        pat = re.compile(rf"BEGIN SOLUTION {re.escape(ex)}\b")
        found = [src for src in self.code if pat.search(src)]
        if not found:
            raise SolutionError(f"{self.path} has no cell marked BEGIN SOLUTION {ex}")
        return found

    def source(self, ex: str, edits: tuple[Edit, ...] = ()) -> str:
        """The text of ``ex``'s cells, with ``edits`` applied (each checked to apply)."""
        text = "\n\n".join(self.cells(ex))
        for e in edits:
            old, new = e[0], e[1]
            count = e[2] if len(e) > 2 else 1
            n = text.count(old)
            if (count == 0 and n == 0) or (count and n != count):
                want = "at least once" if count == 0 else f"{count} time(s)"
                raise SolutionError(f"edit of {ex} expects {old!r} {want} in {self.path}, found "
                                    f"{n}: the solution changed; update the wrong answer")
            text = text.replace(old, new)
        return text

    def namespace(self, ex: str, edits: tuple[Edit, ...] = ()) -> dict:
        return _namespace(self.chapter, ex, tuple(tuple(e) for e in edits))

    def get(self, ex: str, name: str, edits=()) -> object:
        """The object ``name`` defined by ``ex``'s cells (after ``edits``)."""
        ns = self.namespace(ex, tuple(tuple(e) for e in edits))
        if name not in ns:
            raise SolutionError(f"{ex}'s cells in {self.path} define no {name!r}")
        return ns[name]

    def stub(self, ex: str, name: str) -> object:
        """``name`` as the exercise notebook defines it: the solution regions stripped."""
        ns = _namespace(self.chapter, ex, (), stub=True)
        if name not in ns:
            raise SolutionError(f"{ex}'s stub in {self.path} defines no {name!r}")
        return ns[name]


@lru_cache(maxsize=None)
def _namespace(chapter: str, ex: str, edits: tuple, stub: bool = False) -> dict:
    sol = Solution(chapter)
    body = sol.source(ex, edits)
    if stub:
        body = strip_solutions(body, where=f"{sol.path} {ex}")
    text = sol.imports() + "\n\n" + body
    tag = "stub" if stub else "ref" if not edits else f"variant {abs(hash(edits)) % 10**8}"
    fname = f"<{sol.path} {ex} {tag}>"
    linecache.cache[fname] = (len(text), None, text.splitlines(keepends=True), fname)
    ns: dict = {"__name__": f"solution_{chapter}_{ex.replace('.', '_')}"}
    exec(compile(text, fname, "exec"), ns)  # noqa: S102 - the book's own solution cells
    return ns


def pencil_tests(sol: Solution, questions: tuple, mistakes: list[tuple]) -> tuple:
    """The three tests of a chapter's pencil-and-paper questions, for its test module to bind:

        (test_question_reference_passes, test_question_stub_fails,
         test_question_common_mistake_gets_its_hint) = pencil_tests(SOL, (ex02_5, ex02_6), [
            ("ex02.5", "sectors_s1", 1, "32 bytes, not 128"), ...])

    The solution cell's numbers (named as the grader's parameters) must pass with exactly
    ``PASS exNN.k``; the stub must raise NotImplementedError; each (ex, name, wrong value, hint)
    must fail naming that answer and its hint.
    """
    import inspect

    import pytest

    from cudabook.graders import GradeError

    graders = {g.__name__.replace("_", "."): g for g in questions}

    def answers(ex: str) -> dict:
        ns = sol.namespace(ex)
        return {k: ns[k] for k in inspect.signature(graders[ex]).parameters}

    @pytest.mark.parametrize("ex", sorted(graders))
    def test_question_reference_passes(ex, capsys):
        graders[ex](**answers(ex))
        assert capsys.readouterr().out == f"PASS {ex}\n"

    @pytest.mark.parametrize("ex", sorted(graders))
    def test_question_stub_fails(ex):
        with pytest.raises(NotImplementedError):
            sol.stub(ex, "x")

    @pytest.mark.parametrize("ex, name, value, hint", mistakes)
    def test_question_common_mistake_gets_its_hint(ex, name, value, hint):
        given = answers(ex) | {name: value}
        with pytest.raises(GradeError, match=f"1 of {len(given)} answers wrong(.|\n)*{name}.*"
                           f"{re.escape(hint)}"):
            graders[ex](**given)

    return (test_question_reference_passes, test_question_stub_fails,
            test_question_common_mistake_gets_its_hint)


def exercise_page(chapter: str) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """For each graded exercise of solutions/<chapter>_*.ipynb: the sizes its specification
    states ("(Roughly 8 lines for the kernel, 5 for the launcher.)"), the sizes of the stubs the
    generator writes, and the number of levels of each of its hints cells."""
    from nbtools import hint_cell_ex, render_hints

    (path,) = (ROOT / "solutions").glob(f"{chapter}_*.ipynb")
    cells = nbformat.read(str(path), as_version=4).cells
    graded = [f"{a}.{b}" for c in cells
              if c.cell_type == "code" and "NBVAL_CHECK_OUTPUT" in c.source
              for a, b in re.findall(r"\b(ex\d\d)_(\d+)\(", c.source)]
    out = {}
    for ex in graded:
        spec = [c.source for c in cells if c.cell_type == "markdown"
                and c.source.startswith(f"## {ex} ")]
        said = sorted(int(n) for text in spec for m in re.finditer(r"\([Rr]oughly ([^)]*)\)", text)
                      for n in re.findall(r"\d+", m.group(1)))
        stubs = sorted(int(n) for c in cells if c.cell_type == "code"
                       and f"BEGIN SOLUTION {ex}" in c.source
                       for n in re.findall(rf"TODO {re.escape(ex)} \(roughly (\d+) line",
                                           strip_solutions(c.source)))
        levels = [render_hints(c.source).count("<details>") for c in cells
                  if hint_cell_ex(c) == ex]
        out[ex] = (said, stubs, levels)
    return out


def check_exercise_page(chapter: str, ex: str, page: dict | None = None) -> None:
    """The exercise page's promises for ``ex``: the line counts its specification states match
    the generated stubs, and it has one hints cell of two levels (a nudge, a closer one)."""
    said, stubs, levels = (page or exercise_page(chapter))[ex]
    assert said and said == stubs, f"{ex}: the specification says {said} lines, the stubs {stubs}"
    assert levels == [2], f"{ex}: one hints cell of two levels (a nudge, a closer one): {levels}"
