"""The book as a product: the one project address, the publish stamp, the workflow that publishes
(which CI cannot run, so it is checked here), the browser test's link checks, the Colab-like
lane's floors, and the pytest plugin that grades a lone notebook."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import book_site  # noqa: E402
import browser_test  # noqa: E402
import colab_lane  # noqa: E402
import nbtools  # noqa: E402

WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\n```\n(.+?)\n```\n<!-- /{marker} -->", text, re.S)
    assert m, f"README.md has no {marker} block"
    return m.group(1).strip()


# ----------------------------------------------------------------------------- the workflow
@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_workflow_triggers(workflow):
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert on["push"]["branches"] == ["main"]
    assert "v*" in on["push"]["tags"]
    assert "pull_request" in on


def test_workflow_builds_with_the_readme_command_and_tests_before_publishing(workflow):
    steps = workflow["jobs"]["build"]["steps"]
    runs = [s.get("run", "") for s in steps]
    book = readme_command("book-command")
    assert "--keep-going" in book and "-n -W" in book
    i_build = next(i for i, r in enumerate(runs) if r.strip() == book)
    i_browser = next(i for i, r in enumerate(runs) if "browser_test.py" in r)
    i_stamp = next(i for i, r in enumerate(runs) if "nbtools.py stamp" in r)
    i_rebuild = next(i for i, r in enumerate(runs) if "check-stamp" in r)
    assert i_build < i_browser < i_stamp < i_rebuild
    assert "browser_test.py" in runs[i_rebuild] and "jupyter-book build" in runs[i_rebuild]
    assert "execute" not in " ".join(runs)  # no step executes a notebook (no GPU there)
    upload = next(s for s in steps if "upload-pages-artifact" in s.get("uses", ""))
    assert upload["with"]["path"] == "_build/html"
    assert "PUBLISH" in upload["if"]
    publish = workflow["jobs"]["build"]["env"]["PUBLISH"]
    assert "pull_request" in publish and "refs/heads/main" in publish


def test_workflow_deploys_only_on_push(workflow):
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert "github.event_name != 'pull_request'" in deploy["if"]
    assert any("deploy-pages" in s.get("uses", "") for s in deploy["steps"])
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}


def test_workflow_checks_the_address_from_config_yml(workflow):
    step = next(s for s in workflow["jobs"]["build"]["steps"] if "_config.yml" in s.get(
        "name", ""))
    assert "github.repository" in step["run"] and "set-url" in step["run"]
    # the step's own extraction of repository.url finds the value nbtools reads
    sed = re.search(r"sed -n '([^']+)' _config.yml", step["run"]).group(1)
    out = subprocess.run(["sed", "-n", sed, str(ROOT / "_config.yml")], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == nbtools.REPO_URL


# ----------------------------------------------------------------------------- the address
def _mini_repo(tmp_path: Path) -> Path:
    """A copy of what nbtools reads and writes: config, README, a notebook per folder."""
    for rel in ("_config.yml", "README.md", "CITATION.cff", "tools/nbtools.py",
                "book/setup.md", "book/intro.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for d in ("lessons", "solutions", "exercises"):
        (tmp_path / d).mkdir()
        shutil.copy(ROOT / d / "01_first_kernel.ipynb", tmp_path / d)
    return tmp_path


def _nbtools(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "tools" / "nbtools.py"), *args],
                          capture_output=True, text=True, cwd=repo)


def test_committed_files_carry_the_one_address():
    assert nbtools.url_errors(nbtools.REPO_URL) == []
    assert nbtools.SETUP_CELL == nbtools.setup_cell(nbtools.REPO_URL)
    assert f"git+{nbtools.REPO_URL}\"" in nbtools.SETUP_CELL


def test_urls_catches_a_stale_copy_and_set_url_fixes_every_copy(tmp_path):
    repo = _mini_repo(tmp_path)
    assert _nbtools(repo, "urls").returncode == 0
    readme = repo / "README.md"
    owner, name = nbtools.owner_repo(nbtools.REPO_URL)
    readme.write_text(readme.read_text() + f"\nhttps://github.com/someone-else/{name}\n")
    r = _nbtools(repo, "urls")
    assert r.returncode == 1 and f"someone-else/{name}" in r.stdout
    readme.write_text(readme.read_text().replace(f"someone-else/{name}", f"{owner}/{name}"))
    r = _nbtools(repo, "set-url", "https://github.com/forker/cudabook-fork")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _nbtools(repo, "urls").returncode == 0
    nb = nbformat.read(str(repo / "lessons" / "01_first_kernel.ipynb"), as_version=4)
    assert "git+https://github.com/forker/cudabook-fork\"" in nb.cells[0].source \
        or "git+https://github.com/forker/cudabook-fork\"" in nb.cells[1].source
    assert "https://forker.github.io/cudabook-fork/" in readme.read_text()
    assert nbtools.REPO_URL not in (repo / "_config.yml").read_text()


def test_stamp_pins_the_helper_and_the_launch_buttons(tmp_path):
    repo = _mini_repo(tmp_path)
    sha, launch = "0123456789abcdef0123456789abcdef01234567", "89abcdef" * 5
    r = _nbtools(repo, "stamp", sha, launch)
    assert r.returncode == 0, r.stdout + r.stderr
    for d in ("lessons", "solutions", "exercises"):
        nb = nbformat.read(str(repo / d / "01_first_kernel.ipynb"), as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "code")
        assert first.source == nbtools.setup_cell(nbtools.REPO_URL, sha)
        assert f"@{sha}\"" in first.source
    cfg = yaml.safe_load((repo / "_config.yml").read_text())
    assert cfg["repository"]["branch"] == launch
    assert cfg["sphinx"]["config"]["cudabook_release"] == sha
    assert cfg["repository"]["url"] == nbtools.REPO_URL
    assert _nbtools(repo, "stamp", "main; rm -rf /").returncode != 0


def test_check_stamp_reads_the_built_notebooks_and_buttons(tmp_path):
    site = tmp_path / "html"
    (site / "_sources" / "lessons").mkdir(parents=True)
    nb = nbformat.read(str(ROOT / "lessons" / "01_first_kernel.ipynb"), as_version=4)
    next(c for c in nb.cells if c.cell_type == "code").source = nbtools.setup_cell(
        nbtools.REPO_URL, "v1.0")
    nbformat.write(nb, str(site / "_sources" / "lessons" / "01_first_kernel.ipynb"))
    o, r = nbtools.owner_repo(nbtools.REPO_URL)
    page = ('<a href="https://colab.research.google.com/github/{}/{}/blob/{}/lessons/'
            '01_first_kernel.ipynb">')
    (site / "a.html").write_text(page.format(o, r, "abc123"))
    assert nbtools.stamp_errors(site, "v1.0", "abc123") == []
    errs = nbtools.stamp_errors(site, "v1.1", "main")
    assert len(errs) == 2 and "v1.1" in errs[0] and "main" in errs[1]


# ----------------------------------------------------------------------------- the site
def test_stable_names():
    assert book_site.stable_name("lessons/04_tiling") == "lessons/tiling"
    assert book_site.stable_name("exercises/10_quantization") == "exercises/quantization"
    assert book_site.stable_name("book/intro") is None


def test_static_checks_find_broken_links_anchors_and_launch_buttons(tmp_path):
    site = tmp_path / "html"
    (site / "lessons").mkdir(parents=True)
    o, r = nbtools.owner_repo(nbtools.REPO_URL)
    colab = "https://colab.research.google.com/github/{}/{}/blob/main/{}"
    (site / "index.html").write_text(
        '<div id="top"></div><a href="lessons/a.html#ok">ok</a>'
        '<a href="lessons/a.html#gone">anchor</a><a href="lessons/missing.html">file</a>'
        '<img src="_images/none.png"><a href="#top">self</a><a href="mailto:x@y">m</a>'
        f'<a href="{colab.format(o, r, "lessons/01_first_kernel.ipynb")}">good</a>'
        f'<a href="{colab.format(o, r, "lessons/99_nothing.ipynb")}">bad</a>'
        f'<a href="{colab.format("other", r, "lessons/01_first_kernel.ipynb")}">fork</a>')
    (site / "lessons" / "a.html").write_text('<h1 id="ok">x</h1>')
    browser_test.parse.cache_clear()
    errs = browser_test.static_errors(site)
    text = "\n".join(errs)
    assert len(errs) == 5, text
    for what in ("#gone", "missing.html", "none.png", "99_nothing.ipynb", "other/"):
        assert what in text


# ----------------------------------------------------------------------------- requirements
def _reqs(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~].*)?$", line)
        if m:
            out[m.group(1).lower()] = (m.group(2) or "").replace(" ", "")
    return out


def test_floors_are_what_colab_ships_and_the_package_agrees():
    req = _reqs((ROOT / "requirements.txt").read_text())
    pins = dict(p.split("==") for p in colab_lane.floors(ROOT / "requirements.txt"))
    assert pins["numba-cuda"] == "0.22" and pins["cupy-cuda12x"] == "14.0"
    assert "<0.66" in req["numba"]  # numba-cuda < 0.30.4 fails to import with numba 0.66
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        name, spec = re.match(r"^([A-Za-z0-9_.-]+)(.*)$", d).groups()
        assert req[name.lower()] == spec.replace(" ", ""), (name, spec, req[name.lower()])
    assert re.search(r"^cupy-cuda12x", (ROOT / "requirements.txt").read_text(), re.M)


# ----------------------------------------------------------------------------- lone notebook
def test_lone_notebook_skips_gpu_graders_through_the_installed_plugin(tmp_path):
    """Outside the repository (no conftest.py), the package's pytest11 plugin skips a %%gpu
    grader cell without a GPU instead of failing it against the PASS line stored from a GPU."""
    import importlib.metadata as md

    if not any(e.name == "cudabook" for e in md.entry_points(group="pytest11")):
        pytest.skip("cudabook is installed without its pytest11 entry point: re-run setup.sh")
    nb = nbformat.v4.new_notebook(metadata=nbformat.read(
        str(ROOT / "exercises" / "01_first_kernel.ipynb"), as_version=4).metadata)
    grader = nbformat.v4.new_code_cell("%%gpu\n# NBVAL_CHECK_OUTPUT\nprint('PASS ex99.1')",
                                       execution_count=2)
    grader.outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS ex99.1\n")]
    nb.cells = [nbformat.v4.new_code_cell("import cudabook"), grader]
    (tmp_path / "lone.ipynb").write_text(nbformat.writes(nb))
    xml = tmp_path / "r.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--nbval-lax", "lone.ipynb", f"--junitxml={xml}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    import cudabook

    if not cudabook.HAS_GPU:
        skipped = xml.read_text().count("<skipped")
        assert skipped == 1 and "simulator mode" in xml.read_text(), r.stdout[-2000:]


def test_config_reads_the_address_once():
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["repository"]["url"] == nbtools.REPO_URL
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["repository-code"] == nbtools.REPO_URL
    assert cff["url"] == nbtools.book_url(nbtools.REPO_URL)
    assert "sphinx-mathjax-offline" in cfg["sphinx"]["extra_extensions"]
    assert not cfg["sphinx"]["config"]["mathjax_path"].startswith("http")
    json.dumps(cfg)  # plain data


def test_release_checklist_and_readme_say_how_the_book_is_published():
    page = (ROOT / "book" / "maintainers.md").read_text()
    steps = page.split("## Releasing", 1)[1]
    for what in ("gpu_lane.sh", "reports/gpu-lane-DATE.md", "git tag", "book.yml", ".ci/run"):
        assert what in steps, f"the release checklist does not mention {what}"
    readme = (ROOT / "README.md").read_text()
    assert nbtools.book_url(nbtools.REPO_URL) in readme          # where the book is read
    assert re.search(r"GPU-lane run of\s+\*\*\d{4}-\d\d-\d\d\*\*", readme)  # and from when
    assert "set-url" in readme and "3.13" in readme
