"""Sphinx extension of the book, loaded through ``_config.yml`` (``sphinx.local_extensions``).

* Substitutions for the pages, from the one address in ``_config.yml`` (``repository.url``):
  ``{{ repo_url }}``, ``{{ book_url }}`` (where GitHub Pages serves the book), ``{{ release }}``
  (the tag or commit stamped at publish time, ``main`` in an unpublished build) and
  ``{{ gpu_date }}`` (the date of the latest GPU run whose outputs the lessons show).
* The footer of every page: the release, the GPU its outputs come from (read from the notebook's
  own stored ``cb.report()`` output, the ``GPU      :`` line, and the date of its run), the
  licences.
* Worked-solution pages (``solutions/*``) look different from the exercise pages they answer: the
  title says "worked solutions" instead of "exercises", a banner under it sends the reader to the
  exercises first, and ``_static/cudabook.css`` draws a coloured border beside the page.
* Stable addresses: a chapter's file name starts with its number (``lessons/04_tiling``), which
  moves when a chapter is inserted before it. Every such page also gets a number-free address
  (``lessons/tiling.html``) that sends the reader on to it; links and citations use those. Pages
  renamed later keep their old addresses through ``cudabook_redirects`` (old -> new docname).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform

NUMBERED = re.compile(r"^(?P<dir>(?:.*/)?)\d+_(?P<slug>[^/]+)$")


def stable_name(docname: str) -> str | None:
    """``lessons/04_tiling`` -> ``lessons/tiling``; None for a page without a number."""
    m = NUMBERED.match(docname)
    return m.group("dir") + m.group("slug") if m else None


def _book_url(repo_url: str) -> str:
    owner, repo = repo_url.rstrip("/").split("/")[-2:]
    return f"https://{owner.lower()}.github.io/{repo}/"


def _gpu_date(srcdir: Path) -> str:
    dates = []
    for p in sorted((srcdir / "lessons").glob("*.ipynb")):
        meta = json.loads(p.read_text()).get("metadata", {}).get("cudabook", {})
        if meta.get("date"):
            dates.append(str(meta["date"]))
    return max(dates) if dates else "not yet run"


REPORT_GPU = re.compile(r"^GPU {6}: (.+)$", re.M)  # cb.report()'s first line on a GPU


def notebook_gpu(path: Path) -> tuple[str, str]:
    """(GPU, date) a notebook's stored outputs come from: the ``GPU      :`` line that its setup
    cell's ``cb.report()`` printed (first match over the stored outputs), else the GPU the run
    stamped in ``metadata.cudabook``; "" where it names none."""
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return "", ""
    meta = nb.get("metadata", {}).get("cudabook", {}) or {}
    for c in nb.get("cells", []):
        for o in c.get("outputs", []) if c.get("cell_type") == "code" else []:
            text = o.get("text", "")
            m = REPORT_GPU.search("".join(text) if isinstance(text, list) else text)
            if m:
                return m.group(1).strip(), str(meta.get("date", ""))
    return str(meta.get("gpu", "")), str(meta.get("date", ""))


def page_outputs(srcdir: Path, docname: str) -> str:
    """The footer's sentence on where this page's outputs come from."""
    nb = srcdir / f"{docname}.ipynb"
    if not nb.is_file():
        return ""
    if docname.startswith("exercises/"):
        return "This page stores no outputs: run it to see your GPU's."
    gpu, date = notebook_gpu(nb)
    run = f" in the GPU run of {html.escape(date)}" if date else ""
    if gpu:
        return f"The outputs on this page were computed on the GPU <b>{html.escape(gpu)}</b>{run}."
    lesson = srcdir / "lessons" / nb.name
    if docname.startswith("solutions/") and lesson.is_file():
        gpu, date = notebook_gpu(lesson)
        if gpu:
            return ("The outputs on this page come from the GPU named in the chapter's lesson: "
                    f"<b>{html.escape(gpu)}</b>.")
    return "This page names no GPU for its outputs."


def footer(release: str, published: bool, repo: str, outputs: str, gpu_date: str) -> str:
    what = ("release <code>" + html.escape(release) + "</code>" if published
            else "an unpublished build of <code>main</code>")
    where = outputs or f"The chapters' outputs come from the GPU run of {gpu_date}."
    return (f"<p>This is {what}. {where} "
            f'Text <a href="https://creativecommons.org/licenses/by/4.0/">CC BY 4.0</a>, code MIT '
            f'(<a href="{html.escape(repo)}">repository</a>).</p>')


def _config_inited(app: Sphinx, config) -> None:
    opts = dict(config.html_theme_options or {})
    repo = opts.get("repository_url", "")
    release = config.cudabook_release or "main"
    subs = {
        "repo_url": repo,
        "book_url": _book_url(repo) if repo else "",
        "release": release,
        "gpu_date": _gpu_date(Path(app.srcdir)),
    }
    config.myst_substitutions = {**(config.myst_substitutions or {}), **subs}
    # every page's own footer is made in _page_context; this one is the theme's default
    opts["extra_footer"] = footer(release, bool(config.cudabook_release), repo, "",
                                  subs["gpu_date"])
    config.html_theme_options = opts
    # the theme's start-up script falls back to this when the reader never chose light or dark;
    # left empty, it logs a console error on the first page a reader opens
    config.html_context = {"default_mode": "auto", **(config.html_context or {})}


def _dedupe_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """Jupyter Book 1.x renders the inline scripts that sphinx-thebe and sphinx-togglebutton add
    while the builder starts twice: a second ``const THEBE_JS_URL`` is a SyntaxError on every
    page. Keep the first of identical scripts."""
    seen, out = set(), []
    for js in context.get("script_files", []):
        key = (str(getattr(js, "filename", None) or ""), tuple(sorted((k, str(v)) for k, v in
                                     getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            out.append(js)
    context["script_files"][:] = out  # in place: the list is the builder's


def _page_context(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """The footer of this page: it names the GPU this page's own outputs come from."""
    if not context.get("theme_extra_footer"):
        return
    cfg = app.config
    context["theme_extra_footer"] = footer(
        cfg.cudabook_release or "main", bool(cfg.cudabook_release),
        (cfg.html_theme_options or {}).get("repository_url", ""),
        page_outputs(Path(app.srcdir), pagename),
        cfg.myst_substitutions.get("gpu_date", "") if cfg.myst_substitutions else "")


SOLUTIONS_TITLE = re.compile(r"^(Chapter \d+) exercises\b")


class SolutionsBanner(SphinxTransform):
    """On a ``solutions/NN_topic`` page: "Chapter N exercises: ..." becomes "Chapter N worked
    solutions: ..." (page title, sidebar, browser tab), and a banner under the title links to
    the exercise page of the same stem. Runs while the page is read, before its title is
    collected for the table of contents."""

    default_priority = 500

    def apply(self, **kwargs) -> None:
        doc = self.env.docname
        if not doc.startswith("solutions/"):
            return
        section = next(iter(self.document.findall(nodes.section)), None)
        title = section[0] if section is not None and section.children else None
        if not isinstance(title, nodes.title):
            return
        text = next(iter(title.findall(nodes.Text)), None)
        if text is not None and SOLUTIONS_TITLE.match(text.astext()):
            text.parent.replace(text, nodes.Text(SOLUTIONS_TITLE.sub(
                r"\1 worked solutions", text.astext(), count=1)))
        else:
            title += nodes.Text(" (worked solutions)")
        exercise = "exercises/" + doc.split("/", 1)[1]
        link = addnodes.pending_xref("", nodes.inline("", "the exercise page"), refdomain="std",
                                     reftype="doc", reftarget="/" + exercise, refexplicit=True,
                                     refwarn=True, refdoc=doc)
        banner = nodes.admonition("", classes=["tip", "cudabook-solutions"])
        banner += nodes.title("", "Worked solutions — try the exercises first")
        banner += nodes.paragraph("", "", nodes.Text(
            "This page shows every answer. Each exercise teaches more when you try it first on "),
            link, nodes.Text(", which has the same cells without the solutions, and come back "
                             "here to compare."))
        section.insert(1, banner)


REDIRECT = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<link rel="canonical" href="{target}">
<meta http-equiv="refresh" content="0; url={target}">
<script>location.replace("{target}" + location.hash);</script>
</head><body><p>This page is at <a href="{target}">{target}</a>.</p></body></html>
"""


def redirects(app: Sphinx) -> dict[str, str]:
    """Stable or old docname -> the docname that holds the page now."""
    docs = set(app.env.found_docs)
    out = {}
    for doc in sorted(docs):
        stable = stable_name(doc)
        if stable and stable not in docs:
            out[stable] = doc
    for old, new in (app.config.cudabook_redirects or {}).items():
        if new not in docs:
            raise ValueError(f"cudabook_redirects: {old} -> {new}, but {new} is not a page")
        if old not in docs:
            out[old] = new
    return out


def _build_finished(app: Sphinx, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    for src, dst in redirects(app).items():
        page = outdir / f"{src}.html"
        rel = Path(dst + ".html").relative_to(Path(dst).parent) if "/" in dst else Path(
            dst + ".html")
        depth = src.count("/")
        target = ("../" * depth) + (dst + ".html") if Path(src).parent != Path(dst).parent \
            else str(rel)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(REDIRECT.format(title=html.escape(dst), target=html.escape(target)))


def setup(app: Sphinx) -> dict:
    app.add_config_value("cudabook_release", "", "html")
    app.add_config_value("cudabook_redirects", {}, "html")
    app.connect("config-inited", _config_inited)
    app.connect("html-page-context", _dedupe_scripts, priority=900)  # after those that add
    app.connect("html-page-context", _page_context)
    app.add_transform(SolutionsBanner)
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
