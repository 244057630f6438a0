"""Sphinx extension of the book, loaded through ``_config.yml`` (``sphinx.local_extensions``).

* Substitutions for the pages, from the one address in ``_config.yml`` (``repository.url``):
  ``{{ repo_url }}``, ``{{ book_url }}`` (where GitHub Pages serves the book), ``{{ release }}``
  (the tag or commit stamped at publish time, ``main`` in an unpublished build) and
  ``{{ gpu_date }}`` (the date of the latest GPU run whose outputs the lessons show).
* The footer of every page: the release, the date of the GPU run, the licences.
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

from sphinx.application import Sphinx

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
    published = ("release <code>" + html.escape(release) + "</code>" if config.cudabook_release
                 else "an unpublished build of <code>main</code>")
    opts["extra_footer"] = (
        f"<p>This is {published}; the outputs come from the GPU run of {subs['gpu_date']}. "
        f'Text <a href="https://creativecommons.org/licenses/by/4.0/">CC BY 4.0</a>, code MIT '
        f'(<a href="{html.escape(repo)}">repository</a>).</p>')
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
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
