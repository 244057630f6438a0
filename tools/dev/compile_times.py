#!/usr/bin/env python3
"""How long a reader waits for a kernel: cold compile of each version, and the first launch in a
fresh process once the kernel cache holds it.

    PYTHONPATH=. python tools/dev/compile_times.py [op ...] [--cpus 0,1] [--out DIR]

For every ``kernels/<op>_launch.py`` with ``sanitize_targets()`` (default: all of them), two fresh
Python processes run the op's targets one by one, each timed to completion (compile, load,
launch, synchronise; a target's time includes what the op's generator prepared before it,
such as a module it compiles up front): the first with an empty kernel cache
(``CUDABOOK_CACHE_DIR`` in a temporary directory), the second with the cache the first one
filled. Both are pinned to ``--cpus`` (default ``0,1``: two vCPUs, what Colab gives) with
``taskset`` where it exists. The first target of a version in the cold process is that
version's compile; the warm process's first target, plus its ``import cudabook``, is what a
reader waits for in a restarted notebook. Writes
``compile_times.json`` and a markdown table to ``--out`` (default: ``$OUT`` or ``build/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy
import cudabook as cb
t_import = time.perf_counter() - t0
lm = cb.load_launch(sys.argv[1])
rows = []
t = time.perf_counter()          # a target's time includes what the generator did before it
for name, fn in lm.sanitize_targets():
    fn()
    cupy.cuda.Device().synchronize()
    now = time.perf_counter()
    rows.append((name, now - t))
    t = now
print("ROWS" + json.dumps({"import_s": t_import, "targets": rows}))
"""


def ops_with_targets() -> list[str]:
    out = []
    for p in sorted((ROOT / "kernels").glob("*_launch.py")):
        if "def sanitize_targets" in p.read_text():
            out.append(p.stem.removesuffix("_launch"))
    return out


def run_child(op: str, cache: str, cpus: str | None) -> dict:
    env = {**os.environ, "CUDABOOK_CACHE_DIR": cache, "PYTHONPATH": str(ROOT),
           "CUDABOOK_RACE_CHECKS": "0"}
    cmd = [sys.executable, "-c", CHILD, op]
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus] + cmd
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROWS")), None)
    if r.returncode or line is None:
        return {"error": (r.stderr or r.stdout)[-2000:], "wall_s": wall}
    d = json.loads(line[4:])
    d["wall_s"] = wall
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="*")
    ap.add_argument("--cpus", default="0,1")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build"))
    a = ap.parse_args()
    import cudabook as cb

    if not cb.HAS_GPU:
        print("compile_times: needs a CUDA GPU (the launches are timed for real)")
        return 2
    ops = a.ops or ops_with_targets()
    results = {"gpu": cb.env.info().name, "cpus": a.cpus, "ops": {}}
    lines = ["| op | cold: slowest first launch of a version (s) | warm process: import + first "
             "launch (s) | warm: slowest launch (s) |", "|---|---|---|---|"]
    for op in ops:
        cache = tempfile.mkdtemp(prefix=f"cbcache-{op}-")
        try:
            cold = run_child(op, cache, a.cpus)
            warm = run_child(op, cache, a.cpus)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        results["ops"][op] = {"cold": cold, "warm": warm}
        if "error" in cold or "error" in warm:
            lines.append(f"| {op} | error | error | error |")
            print(f"{op}: ERROR\n{cold.get('error') or warm.get('error')}", flush=True)
            continue
        c = max(t for _, t in cold["targets"])
        w0 = warm["import_s"] + warm["targets"][0][1]
        w = max(t for _, t in warm["targets"])
        lines.append(f"| {op} | {c:.2f} | {w0:.2f} | {w:.2f} |")
        print(lines[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_times.json").write_text(json.dumps(results, indent=1))
    (out / "compile_times.md").write_text(
        f"Compile and first-launch times on {results['gpu']}, pinned to CPUs {a.cpus}\n\n"
        + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
