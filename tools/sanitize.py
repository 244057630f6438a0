#!/usr/bin/env python3
"""compute-sanitizer over the book's CUDA C++ kernels (the GPU lane's sanitizer step).

    python tools/sanitize.py 03 04        racecheck and memcheck on the kernels of these chapters
    python tools/sanitize.py              every target
    python tools/sanitize.py --list       which targets exist, and their chapters
    python tools/sanitize.py --tools initcheck,synccheck mlp_step_launch
                                          other tools; a kernels/*_launch stem picks one module

The registry is collected in one place, here, from the kernels themselves: every
``kernels/<name>.py`` that defines ``sanitize_targets()`` contributes its (name, launch) pairs
(each launches one kernel once, on a small ragged size, through CuPy). A kernel's chapters are
the notebooks that load its op (``load_cuda("op")``, ``load_launch("op")``,
``show_source("op.cu")``), so a new chapter's kernels are covered as soon as its launch module
defines the function.

memcheck runs with CuPy's memory pool off (``cp.cuda.set_allocator(None)``): with the pool on,
an out-of-bounds access usually lands in another pooled buffer and goes unseen. racecheck finds
shared-memory hazards (a missing ``__syncthreads()``), which a run's numbers may not show.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNELS = ROOT / "kernels"
_USES = (r'(?:load_cuda|load_launch|load_numba|load_module)\(\\?["\']{op}\\?["\']'
         r'|show_source\(\\?["\']{op}\.cu')


def registry() -> dict[str, list[str]]:
    """{module stem: chapters that use its op} for every kernels/*.py with sanitize_targets()."""
    notebooks = sorted((ROOT / "lessons").glob("*.ipynb")) + \
        sorted((ROOT / "solutions").glob("*.ipynb"))
    texts = {p: p.read_text() for p in notebooks}
    out = {}
    for p in sorted(KERNELS.glob("*.py")):
        if not re.search(r"^def sanitize_targets\(", p.read_text(), re.M):
            continue
        op = re.sub(r"_launch$", "", p.stem)
        pat = re.compile(_USES.format(op=re.escape(op)))
        out[p.stem] = sorted({nb.name[:2] for nb, t in texts.items() if pat.search(t)})
    return out


def modules_for(chapters: list[str]) -> list[str]:
    """The modules of these chapters ("06") and the modules named (``mlp_step_launch``)."""
    reg = registry()
    if not chapters:
        return sorted(reg)
    unknown = [c for c in chapters if not re.fullmatch(r"\d\d", c) and c not in reg]
    if unknown:
        raise SystemExit(f"sanitize: {unknown} are neither chapters nor modules with "
                         f"sanitize_targets(); see --list")
    return sorted(m for m, chs in reg.items() if set(chs) & set(chapters) or m in chapters)


def inner(modules: list[str]) -> None:
    import cupy as cp

    import cudabook as cb

    cp.cuda.set_allocator(None)      # pooled buffers would hide out-of-bounds accesses
    for stem in modules:
        for name, launch in cb.load_module(stem).sanitize_targets():
            launch()
            cp.cuda.Device().synchronize()
            print(f"launched {name}", flush=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--inner":
        inner(argv[1:])
        return 0
    if argv and argv[0] == "--list":
        print(json.dumps(registry(), indent=1))
        return 0
    tools = ("racecheck", "memcheck")
    if argv and argv[0] == "--tools":
        tools = tuple(argv[1].split(","))
        bad_tools = set(tools) - {"racecheck", "memcheck", "initcheck", "synccheck"}
        if bad_tools:
            raise SystemExit(f"sanitize: unknown tools {sorted(bad_tools)}")
        argv = argv[2:]
    modules = modules_for(argv)
    if not modules:
        print(f"sanitize: no targets for chapters {' '.join(argv)}")
        return 0
    bad = 0
    for tool in tools:
        r = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "7",
                            sys.executable, __file__, "--inner", *modules],
                           capture_output=True, text=True, cwd=ROOT)
        n = r.stdout.count("launched ")
        errs = [ln for ln in r.stdout.splitlines() if "ERROR SUMMARY" in ln or "Race" in ln
                or "Invalid" in ln][:10]
        ok = r.returncode == 0
        bad += not ok
        print(f"{tool}: {'clean' if ok else 'ERRORS'} over {n} kernel launches "
              f"({', '.join(modules)})")
        if not ok:
            print("\n".join(errs) or (r.stdout[-2000:] + r.stderr[-2000:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
