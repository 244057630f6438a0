#!/usr/bin/env python3
"""compute-sanitizer over the book's CUDA C++ kernels (GPU lane, step 6).

    python tools/sanitize.py 01 02        racecheck and memcheck on these chapters' targets

Each target launches one kernel once, on a small ragged size, through CuPy. memcheck runs with
CuPy's memory pool off (``cp.cuda.set_allocator(None)``): with the pool on, an out-of-bounds
access usually lands in another pooled buffer and goes unseen. racecheck finds shared-memory
hazards (a missing ``__syncthreads()``), which the simulator cannot.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ch01():
    import cupy as cp
    import numpy as np

    import cudabook as cb

    mod = cb.load_cuda("vector_add")
    n = 1000
    x, y, z = (cp.random.rand(n, dtype=np.float32) for _ in range(3))
    yield "vector_add_v1", lambda: mod.vector_add_v1((4,), (256,), (x, y, z, np.int32(n)))
    yield "vector_add_v2", lambda: mod.vector_add_v2((2,), (128,), (x, y, z, np.int32(n)))


def _from_kernels(op: str):
    """Targets a chapter declares in kernels/<op>.py as ``sanitize_targets()``."""
    def gen():
        import cudabook as cb

        m = cb.load_numba(op)
        yield from m.sanitize_targets()
    return gen


TARGETS = {"01": [_ch01]}
for _ch, _ops in {"02": ["copy", "transpose"], "03": ["reduce", "softmax", "layernorm", "conv"],
                  "04": ["matmul"]}.items():
    for _op in _ops:
        if (ROOT / "kernels" / f"{_op}.py").is_file() and "def sanitize_targets" in \
                (ROOT / "kernels" / f"{_op}.py").read_text():
            TARGETS.setdefault(_ch, []).append(_from_kernels(_op))


def inner(chapters: list[str]) -> None:
    import cupy as cp

    cp.cuda.set_allocator(None)      # pooled buffers would hide out-of-bounds accesses
    for ch in chapters:
        for gen in TARGETS.get(ch, []):
            for name, launch in gen():
                launch()
                cp.cuda.Device().synchronize()
                print(f"launched {name}", flush=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--inner":
        inner(argv[1:])
        return 0
    chapters = [c for c in (argv or sorted(TARGETS)) if TARGETS.get(c)]
    if not chapters:
        print(f"sanitize: no targets for chapters {' '.join(argv)}")
        return 0
    bad = 0
    for tool in ("racecheck", "memcheck"):
        r = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "7",
                            sys.executable, __file__, "--inner", *chapters],
                           capture_output=True, text=True, cwd=ROOT)
        n = r.stdout.count("launched ")
        errs = [ln for ln in r.stdout.splitlines() if "ERROR SUMMARY" in ln or "Race" in ln
                or "Invalid" in ln][:10]
        ok = r.returncode == 0
        bad += not ok
        print(f"{tool}: {'clean' if ok else 'ERRORS'} over {n} kernel launches "
              f"(chapters {' '.join(chapters)})")
        if not ok:
            print("\n".join(errs) or (r.stdout[-2000:] + r.stderr[-2000:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
