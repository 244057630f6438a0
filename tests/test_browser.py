"""What a reader sees in a browser: display math that MyST can parse, one output box per stream,
the footer that names each page's GPU, and the browser test that fails on a page with broken math
(raw TeX in the text, MathJax errors)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import book_site  # noqa: E402
import browser_test  # noqa: E402
import nbtools  # noqa: E402

GOOD_MATH = """\
Symmetric quantization maps a group of weights to integers with one scale:

$$s = \\frac{\\max |w|}{q_{\\max}}$$

$$
\\hat w = s\\,q
$$
$$q = \\operatorname{round}(w / s)$$
A fenced block is not prose:
```text
$$ not math
```
"""
BAD_MATH = """\
For one layer, with $X$ = `cols`:
$$Z = X W + \\mathbf{1} b^\\top,\\qquad
W \\in \\mathbb{R}^{K^2C \\times C_o}.$$
Given $dY$, and likewise $j = w - e + p$:
$$dx = \\sum_a dX$$
"""


def _policy(tmp_path: Path, nb) -> list[str]:
    """The policy over ``nb`` stored as lessons/09_x.ipynb of a repository at ``tmp_path``."""
    (tmp_path / "lessons").mkdir(exist_ok=True)
    p = tmp_path / "lessons" / "09_x.ipynb"
    p.write_text(nbtools.canonical(nb))
    old = nbtools.ROOT
    nbtools.ROOT = tmp_path
    try:
        return nbtools.policy_errors(p)
    finally:
        nbtools.ROOT = old


# ----------------------------------------------------------------------------- display math
def test_display_math_after_a_prose_line_is_found_with_its_line():
    assert nbtools.display_math_errors(GOOD_MATH) == []
    errs = nbtools.display_math_errors(BAD_MATH)
    assert [n for n, _ in errs] == [2, 5], errs  # not line 3, which is inside the display math
    assert errs[0][1].startswith("$$Z = X W")


def test_policy_names_notebook_cell_and_line_of_display_math_after_prose(tmp_path):
    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n")
    nb.cells += [nbformat.v4.new_markdown_cell(GOOD_MATH, id="good-md"),
                 nbformat.v4.new_markdown_cell(BAD_MATH, id="bad-md")]
    errs = [e for e in _policy(tmp_path, nb) if "display math" in e]
    assert len(errs) == 2, errs
    assert errs[0].startswith("lessons/09_x.ipynb: cell 2 (bad-md) line 2: display math")
    assert "blank line" in errs[0] and "line 5" in errs[1]


# ----------------------------------------------------------------------------- streams
def _split_cell():
    out = nbformat.v4.new_output
    c = nbformat.v4.new_code_cell("print(...)", id="split", execution_count=1)
    c.outputs = [out("stream", name="stdout", text="a\n"), out("stream", name="stdout", text="b"),
                 out("stream", name="stdout", text="c\n"),
                 out("display_data", data={"text/plain": "<Figure>"}),
                 out("stream", name="stdout", text="d\n"), out("stream", name="stderr", text="e\n"),
                 out("stream", name="stderr", text="\rf\n")]
    return c


def test_coalesce_joins_adjacent_outputs_of_one_stream_and_changes_no_text():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# x"), _split_cell()]
    assert nbtools.split_streams(nb) == [(1, "split", "stdout", 2), (1, "split", "stderr", 1)]
    assert nbtools.coalesce_streams(nb) == 3
    got = [(o.output_type, o.get("name"), o.get("text")) for o in nb.cells[1].outputs]
    assert got == [("stream", "stdout", "a\nbc\n"), ("display_data", None, None),
                   ("stream", "stdout", "d\n"), ("stream", "stderr", "e\n\rf\n")]
    assert nbtools.split_streams(nb) == [] and nbtools.coalesce_streams(nb) == 0


def test_policy_flags_split_streams_and_the_coalesce_command_fixes_them(tmp_path):
    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n")
    nb.cells.append(_split_cell())
    errs = [e for e in _policy(tmp_path, nb) if "not merged" in e]
    assert len(errs) == 2 and "cell 1 (split): 2 stdout outputs" in errs[0], errs
    assert "nbtools.py coalesce lessons/09_x.ipynb" in errs[0]
    p = tmp_path / "lessons" / "09_x.ipynb"
    assert nbtools.main(["coalesce", str(p)]) == 0
    fixed = nbtools.read(p)
    assert nbtools.split_streams(fixed) == []
    assert p.read_text() == nbtools.canonical(fixed)
    assert [o.get("text") for o in fixed.cells[1].outputs][0] == "a\nbc\n"


def test_gpu_execute_stores_one_output_per_stream(tmp_path, monkeypatch):
    import gpu_execute

    class Client:  # what nbclient leaves when a cell prints in several flushes
        def __init__(self, nb, **kw):
            self.nb = nb

        def execute(self):
            self.nb.cells[1].outputs = _split_cell().outputs

    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n# %%\nprint(1)\n")
    p = tmp_path / "x.ipynb"
    p.write_text(nbtools.canonical(nb))
    (tmp_path / "reports").mkdir()
    monkeypatch.setattr(gpu_execute, "gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(gpu_execute.nbclient, "NotebookClient", Client)
    monkeypatch.setattr(gpu_execute, "ROOT", tmp_path)
    assert gpu_execute.main([str(p)]) == 0
    done = nbtools.read(p)
    assert nbtools.split_streams(done) == [] and done.metadata.cudabook["gpu"] == "Test GPU"
    assert len(done.cells[1].outputs) == 4


# ----------------------------------------------------------------------------- the footer
REPORT = ("GPU      : NVIDIA H200 (sm_90, 132 SMs, 140 GiB, L2 60 MiB)\n"
          "CUDA     : driver 13.0, runtime 13.2\n")


def _notebook(path: Path, report: str | None, gpu: str | None = None) -> None:
    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n# %%\ncb.report()\n")
    if report:
        nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=report)]
    if gpu:
        nb.metadata["cudabook"] = {"gpu": gpu, "date": "2026-11-24", "seconds": 1.0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbtools.canonical(nb))


def test_footer_names_the_gpu_of_the_page_own_report(tmp_path):
    _notebook(tmp_path / "lessons" / "09_x.ipynb", REPORT, gpu="NVIDIA H200")
    _notebook(tmp_path / "solutions" / "09_x.ipynb", None, gpu="NVIDIA H100 80GB HBM3")
    _notebook(tmp_path / "solutions" / "08_y.ipynb", None)
    _notebook(tmp_path / "lessons" / "08_y.ipynb", REPORT.replace("H200", "B200"))
    _notebook(tmp_path / "exercises" / "09_x.ipynb", None)
    assert book_site.notebook_gpu(tmp_path / "lessons" / "09_x.ipynb") == (
        "NVIDIA H200 (sm_90, 132 SMs, 140 GiB, L2 60 MiB)", "2026-11-24")
    lesson = book_site.page_outputs(tmp_path, "lessons/09_x")
    assert "<b>NVIDIA H200 (sm_90, 132 SMs, 140 GiB, L2 60 MiB)</b>" in lesson
    assert "2026-11-24" in lesson
    # no report output: the GPU the run stamped, then the chapter's lesson
    assert "<b>NVIDIA H100 80GB HBM3</b>" in book_site.page_outputs(tmp_path, "solutions/09_x")
    sol = book_site.page_outputs(tmp_path, "solutions/08_y")
    assert "chapter's lesson" in sol and "NVIDIA B200" in sol
    assert "no outputs" in book_site.page_outputs(tmp_path, "exercises/09_x")
    assert book_site.page_outputs(tmp_path, "book/intro") == ""
    page = book_site.footer("v1.0", True, "https://github.com/o/r", lesson, "2026-11-24")
    assert "release <code>v1.0</code>" in page and "NVIDIA H200" in page
    assert "GPU run of 2026-11-24" in book_site.footer("main", False, "", "", "2026-11-24")


def test_every_lesson_and_solution_names_its_gpu():
    for d in ("lessons", "solutions"):
        for p in sorted((ROOT / d).glob("*.ipynb")):
            gpu, _ = book_site.notebook_gpu(p)
            assert gpu.startswith("NVIDIA"), f"{p.relative_to(ROOT)} names no GPU: {gpu!r}"


# ----------------------------------------------------------------------------- the browser
def test_math_errors_name_page_section_and_snippet():
    st = {"math": 2, "mathjax": True, "untypeset": [], "badImages": [],
          "texErrors": [{"at": "#s", "text": "Double exponent", "tex": "x^2^3"}],
          "rawTex": [{"at": "#q", "text": "q_{\\max} = 127", "context": "with q_{\\max} = 127"}]}
    errs = browser_test.math_errors("lessons/10_q.html", st)
    assert errs[0] == "lessons/10_q.html#s: MathJax error «Double exponent» in «x^2^3»"
    assert errs[1].startswith("lessons/10_q.html#q: raw TeX in the text") and "127" in errs[1]
    assert browser_test.math_errors("a.html", {**st, "texErrors": [], "rawTex": []}) == []


M = '<span class="math notranslate nohighlight">'  # how Sphinx writes math for MathJax
BROKEN_PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>t</title>
<script>window.MathJax = {"options": {"processHtmlClass": "tex2jax_process|mathjax_process|math"}}
</script><script defer src="_static/mathjax/tex-chtml.js"></script></head><body>
<section class="tex2jax_ignore mathjax_ignore" id="sec">
<p>Fine: M\\(\\frac{a}{b}\\)</span>, and <code>$$ \\n</code>.</p>
%s</section></body></html>""".replace("M\\(", M + "\\(")
# what MyST made of display math on the line after prose (lessons/10, before the fix), raw TeX
# left in the text, a TeX error and a macro MathJax does not know
BROKEN = """<p>Symmetric quantization maps a group of weights to integers with one scale:
$M\\(s = 1\\)</span>M\\(
with \\)</span>q_{\\max} = 127M\\( for int8\\)</span></p>
<p>Left as text: $$x = \\mathrm{d}y$$</p>
<p>Error: M\\(x^2^3\\)</span></p>
<p>Unknown: M\\(\\nosuchmacro{x}\\)</span></p>""".replace("M\\(", M + "\\(")


def test_browser_test_fails_on_a_page_with_broken_math(tmp_path):
    if not browser_test.find_browser():
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("chromium / chromedriver not found, and CI must run the browser test")
        pytest.skip("chromium / chromedriver not found (Debian: apt-get install chromium "
                    "chromium-driver): the browser check of broken math is not run")
    dist = md.distribution("sphinx-mathjax-offline")
    mathjax = Path(dist.locate_file("sphinx-mathjax-offline/static/mathjax"))
    site = tmp_path / "html"
    (site / "_static").mkdir(parents=True)
    (site / "_static" / "mathjax").symlink_to(mathjax)  # the MathJax the book bundles
    (site / "index.html").write_text(BROKEN_PAGE % "")
    (site / "broken.html").write_text(BROKEN_PAGE % BROKEN)
    browser_test.parse.cache_clear()
    errs, n = browser_test.browser_errors(site, tmp_path / "shots")
    assert n == 2
    assert not [e for e in errs if e.startswith("index.html")], errs  # good math passes
    text = "\n".join(errs)
    raw = [e for e in errs if "raw TeX" in e]
    assert len(raw) == 2, text
    assert raw[0].startswith("broken.html#sec: raw TeX") and "one scale: $" in raw[0]
    assert "$$x = \\mathrm{d}y$$" in raw[1]
    tex = [e for e in errs if "MathJax error" in e]
    assert len(tex) == 2, text
    assert "Double exponent" in tex[0] and "x^2^3" in tex[0]
    assert "\\nosuchmacro" in tex[1]
    assert (tmp_path / "shots" / "broken.png").is_file()
    json.dumps(errs)
