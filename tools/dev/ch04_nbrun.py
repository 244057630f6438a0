#!/usr/bin/env python3
"""Run the code cells of notebooks as plain Python (no Jupyter needed), timing each cell.

    python tools/dev/ch04_nbrun.py lessons/04_tiling.ipynb solutions/04_tiling.ipynb

A leading ``%%gpu`` line is dropped (this is for a GPU machine). Full outputs go to
$OUT/<name>.txt when $OUT is set; a per-cell timing summary and any error are printed.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np  # noqa: E402

if not hasattr(np, "row_stack"):   # numpy >= 2.5 on the device breaks numba-cuda 0.30
    np.row_stack = np.vstack


def run(path: str) -> tuple[float, list[str]]:
    nb = json.load(open(path))
    ns: dict = {"__name__": "__main__"}
    out_dir = os.environ.get("OUT")
    log = io.StringIO()
    summary = []
    t_all = time.time()
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        lines = src.splitlines()
        if lines and lines[0].startswith("%%gpu"):
            lines = lines[1:]
        code = "\n".join(lines)
        buf = io.StringIO()
        t0 = time.time()
        err = None
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                exec(compile(code, f"{os.path.basename(path)}[cell {i}]", "exec"), ns)  # noqa: S102
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()[-1500:]
        dt = time.time() - t0
        text = buf.getvalue()
        log.write(f"\n===== cell {i} ({dt:.1f} s)\n{code[:200]}\n----- output\n{text}\n")
        if err:
            log.write(f"----- ERROR\n{err}\n")
        first = code.strip().splitlines()[0][:60] if code.strip() else ""
        summary.append(f"  cell {i:3d} {dt:6.1f} s {'ERROR' if err else 'ok   '} {first}")
        if err:
            summary.append("    " + err.strip().splitlines()[-1][:300])
    total = time.time() - t_all
    if out_dir:
        name = os.path.basename(path).replace(".ipynb", "")
        with open(os.path.join(out_dir, f"{os.path.dirname(path).replace('/', '_')}_{name}.txt"),
                  "w") as f:
            f.write(log.getvalue())
    return total, summary


def main(paths):
    for p in paths:
        total, summary = run(p)
        print(f"\n### {p}: {total:.1f} s")
        print("\n".join(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
