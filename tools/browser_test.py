#!/usr/bin/env python3
"""Test the built book as a reader sees it, offline, in a real browser.

    python tools/browser_test.py [_build/html]

1. Without a browser (always): every internal link and anchor resolves; every image file
   exists; every launch button opens a notebook that exists in this repository, at this
   project's address (``repository.url`` in _config.yml); every stable chapter address
   (``lessons/tiling.html``) leads to a page.
2. In headless Chromium (Debian's ``chromium`` and ``chromium-driver``), served from 127.0.0.1
   with every other host unresolvable: every page loads with no JavaScript console error,
   fetches nothing from the network (no CDN), shows every image, and has all its math typeset
   by the bundled MathJax. A screenshot of each page's first screen goes to
   ``_build/screenshots/`` for a person to look at.

Without chromium the browser half is skipped with a message, except under CI (``CI=true``),
where it fails: CI installs the browser (.ci/run) and must not pass without running it.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import REPO_URL, ROOT, owner_repo  # noqa: E402

COLAB = re.compile(r"^https://colab\.research\.google\.com/github/([^/]+)/([^/]+)/blob/([^/]+)/"
                   r"(.+\.ipynb)$")
SKIP_DIRS = ("_static", "_sources", "_images")


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag.attr, url)
        self.redirect = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.ids.add(a["name"])
        if tag == "meta" and a.get("http-equiv", "").lower() == "refresh":
            self.redirect = True
        for attr in ("href", "src"):
            if attr in a and tag in ("a", "img", "script", "link", "iframe", "source"):
                self.links.append((f"{tag}.{attr}", a[attr]))


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(errors="replace"))
    return p


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html")
                  if not any(part in SKIP_DIRS for part in p.relative_to(site).parts))


def static_errors(site: Path) -> list[str]:
    errs: list[str] = []
    owner, repo = owner_repo(REPO_URL)
    launch = 0
    for page in pages(site):
        rel = page.relative_to(site)
        for what, url in parse(page).links:
            u = urlsplit(url)
            if u.scheme in ("http", "https"):
                m = COLAB.match(url)
                if m:
                    launch += 1
                    if (m.group(1), m.group(2)) != (owner, repo):
                        errs.append(f"{rel}: launch button opens {m.group(1)}/{m.group(2)}, not "
                                    f"this project ({REPO_URL})")
                    if not (ROOT / m.group(4)).is_file():
                        errs.append(f"{rel}: launch button opens {m.group(4)}, which is not in "
                                    "the repository")
                continue
            if u.scheme or url.startswith("//") or not (u.path or u.fragment):
                continue  # mailto:, javascript:, data:, bare "#"
            target = (page.parent / unquote(u.path)).resolve() if u.path else page
            if u.path.endswith("/"):
                target = target / "index.html"
            if not target.exists():
                errs.append(f"{rel}: {what} {url}: no such file")
                continue
            if u.fragment and target.suffix == ".html" and u.fragment not in parse(target).ids:
                errs.append(f"{rel}: {what} {url}: no anchor #{u.fragment} in "
                            f"{target.relative_to(site.resolve())}")
    if not launch:
        errs.append("no page has a Colab launch button")
    return errs


# ----------------------------------------------------------------------------- the browser
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/favicon.ico":  # the browser asks by itself; the book has none
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(site))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def find_browser() -> tuple[str, str] | None:
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)),
                   None)
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    return (browser, driver) if browser and driver else None


def start(browser: str, driver_path: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not try to download
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update",
              "--disable-default-apps", "--disable-extensions", "--disable-sync",
              "--no-first-run", "--mute-audio", "--window-size=1280,900",
              # offline: no host but this machine resolves, so a CDN fetch fails loudly
              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    last = None
    for _ in range(2):  # a cold chromium can miss chromedriver's first start-up deadline
        try:
            d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
            d.set_page_load_timeout(60)
            d.set_script_timeout(120)  # MathJax on a long page, on a busy 2-core machine
            return d
        except Exception as e:  # noqa: BLE001
            last = e
            time.sleep(2)
    raise RuntimeError(f"chromium did not start: {last}")


PAGE_STATE = """
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    try { await MathJax.startup.promise; } catch (e) {}
  }
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => {
    i.addEventListener("load", r); i.addEventListener("error", r); setTimeout(r, 10000); })));
  const math = [...document.querySelectorAll(".math")];
  const where = el => { const s = el && el.closest("section[id]"); return s ? "#" + s.id : ""; };
  const clip = t => t.replace(/\\s+/g, " ").trim().slice(0, 90);
  // MathJax's own error nodes: a TeX error (mjx-merror, data-mjx-error) and a macro it does not
  // know, which the noundefined extension draws in red instead of failing
  const tex = new Map();  // typeset box -> its TeX source
  try {
    for (const item of MathJax.startup.document.math) tex.set(item.typesetRoot, item.math);
  } catch (e) {}
  const boxes = new Map();
  for (const m of document.querySelectorAll(
      "mjx-merror, [data-mjx-error], .MathJax_Error, mjx-container [style*='color: red']")) {
    const box = m.closest("mjx-container") || m;
    if (!boxes.has(box)) boxes.set(box, m);
  }
  const texErrors = [...boxes].map(([box, m]) => ({at: where(box),
    text: m.getAttribute("data-mjx-error") ||
          (m.closest("mjx-merror") ? "TeX error" : "unknown macro, drawn in red"),
    tex: clip(tex.get(box) || "")}));
  // TeX left as text: outside typeset math, code and scripts, a "$$", a TeX control word
  // (\\frac, \\mathrm), a "Math input error", or a lone "$" right beside typeset math (what
  // dollarmath makes of display math that starts on the line after prose)
  const SKIP = "script, style, noscript, template, pre, code, kbd, samp, textarea, " +
               "mjx-container, .math, .MathJax";
  const TEX = /\\$\\$|\\\\[A-Za-z]{2,}|Math (input|processing) error/i;
  const isMath = n => n && n.nodeType === 1 && (n.matches(".math") || n.matches("mjx-container"));
  const rawTex = [], seen = new Set();
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const el = n.parentElement, t = n.textContent;
    if (!el || !t.trim() || el.closest(SKIP)) continue;
    const m = TEX.exec(t);
    const lone = (/\\$\\s*$/.test(t) && isMath(n.nextSibling)) ||
                 (/^\\s*\\$/.test(t) && isMath(n.previousSibling));
    const block = el.closest("p, li, dd, td, th, h1, h2, h3, h4, h5, h6") || el;
    if ((m || lone) && !seen.has(block)) {  // the first place in each paragraph
      seen.add(block);
      const i = m ? m.index : t.indexOf("$");
      rawTex.push({at: where(el), text: clip(t.slice(Math.max(0, i - 40), i + 50)),
                   context: clip(block.textContent)});
    }
  }
  done({
    math: math.length,
    untypeset: math.filter(m => !m.querySelector("mjx-container"))
                   .map(m => m.textContent.slice(0, 60)),
    texErrors: texErrors,
    rawTex: rawTex,
    mathjax: !!(window.MathJax && MathJax.version),
    badImages: imgs.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src.slice(0, 100)),
  });
})();
"""


def math_errors(rel: str, st: dict) -> list[str]:
    """Broken math on one page, from what PAGE_STATE read: untypeset math, MathJax's errors, and
    TeX left as text (each names the page, its section and a snippet)."""
    errs = []
    if st["math"] and not st["mathjax"]:
        errs.append(f"{rel}: {st['math']} math elements but MathJax did not load")
    errs += [f"{rel}: math not typeset: {t!r}" for t in st["untypeset"][:5]]
    errs += [f"{rel}{e['at']}: MathJax error «{e['text']}» in «{e['tex']}»"
             for e in st["texErrors"][:5]]
    errs += [f"{rel}{e['at']}: raw TeX in the text (math not parsed: display math on the line "
             f"right after prose?): «{e['text']}» in «{e['context']}»" for e in st["rawTex"][:5]]
    more = len(st["texErrors"][5:]) + len(st["rawTex"][5:])
    if more:
        errs.append(f"{rel}: and {more} more places with broken math")
    return errs


def browser_errors(site: Path, shots: Path, only: list[Path] | None = None
                   ) -> tuple[list[str], int]:
    """The browser half over every page of ``site`` (or the pages ``only``)."""
    found = find_browser()
    if not found:
        raise FileNotFoundError
    import json

    srv, base = serve(site)
    d = start(*found)
    errs: list[str] = []
    shots.mkdir(parents=True, exist_ok=True)
    n = 0
    try:
        for page in (only or pages(site)):
            if parse(page).redirect:
                continue
            rel = page.relative_to(site).as_posix()
            d.get(base + rel)
            st = d.execute_async_script(PAGE_STATE)
            n += 1
            for e in d.get_log("browser"):
                if e.get("level") == "SEVERE":
                    errs.append(f"{rel}: console error: {e.get('message', '')[:300]}")
            for e in d.get_log("performance"):
                msg = json.loads(e["message"])["message"]
                if msg.get("method") == "Network.requestWillBeSent":
                    url = msg["params"]["request"]["url"]
                    if not url.startswith((base, "data:", "blob:", "about:")):
                        errs.append(f"{rel}: fetches {url[:120]} from the network")
            errs += math_errors(rel, st)
            errs += [f"{rel}: image does not load: {s}" for s in st["badImages"]]
            d.save_screenshot(str(shots / (rel[:-5].replace("/", "__") + ".png")))
    finally:
        d.quit()
        srv.shutdown()
    return errs, n


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else ROOT / "_build" / "html").resolve()
    if not (site / "index.html").is_file():
        print(f"browser test: {site} holds no built book (run jupyter-book build first)")
        return 1
    t0 = time.time()
    errs = static_errors(site)
    print(f"links: {len(pages(site))} pages, {len(errs)} problems")
    shots = site.parent / "screenshots"
    try:
        berrs, n = browser_errors(site, shots)
        print(f"browser: {n} pages in headless chromium, {len(berrs)} problems; screenshots in "
              f"{shots.relative_to(ROOT) if shots.is_relative_to(ROOT) else shots}")
        errs += berrs
    except FileNotFoundError:
        msg = ("chromium / chromedriver not found (Debian: apt-get install chromium "
               "chromium-driver)")
        if os.environ.get("CI", "").lower() in ("1", "true"):
            errs.append(f"browser test: {msg}, and CI must run it")
        else:
            print(f"browser: SKIPPED: {msg}")
    for e in errs:
        print("BOOK:", e)
    print(f"browser test: {len(errs)} problems ({time.time() - t0:.0f} s)")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
