#!/usr/bin/env python3
"""Compile every kernels/*.cu with NVRTC, the compiler CuPy uses at run time, with no GPU.

    python tools/nvrtc_check.py [op ...]

nvcc and NVRTC differ: nvcc includes the CUDA runtime and math headers implicitly, NVRTC does not
(``INFINITY``, for one, is undefined there), so a kernel that nvcc accepts can still fail in
``cb.load_cuda``. This compiles exactly the source ``cb.load_cuda`` builds (local includes
inlined, the same options) for compute_75, compute_80 and compute_90, one process per core
(``JOBS`` overrides).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupy_backends.cuda.libs import nvrtc  # noqa: E402

from cudabook.compile import KERNELS_DIR, inline_source, nvrtc_options  # noqa: E402

ARCHS = ("compute_75", "compute_80", "compute_90")


def compile_one(job: tuple[str, str]) -> str | None:
    """Compile kernels/<name>.cu for ``arch``: None if it compiles, else NVRTC's message and log."""
    name, arch = job
    src = inline_source(KERNELS_DIR / f"{name}.cu")
    prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*nvrtc_options(), f"-arch={arch}"])
        return None
    except Exception as e:  # noqa: BLE001
        return f"NVRTC {name}.cu ({arch}): {e}\n{nvrtc.getProgramLog(prog)}"
    finally:
        nvrtc.destroyProgram(prog)


def main(names: list[str]) -> int:
    names = names or sorted(p.stem for p in KERNELS_DIR.glob("*.cu"))
    # one compilation per (file, architecture), one process per core (JOBS overrides); the
    # largest sources first, so that no long compile starts last
    jobs = [(name, arch) for name in names for arch in ARCHS]
    order = sorted(jobs, key=lambda j: -len(inline_source(KERNELS_DIR / f"{j[0]}.cu")))
    workers = max(1, int(os.environ.get("JOBS", os.cpu_count() or 1)))
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
            errors = dict(zip(order, pool.map(compile_one, order)))
    else:
        errors = {job: compile_one(job) for job in order}
    bad = n = 0
    for name in names:
        bad_before = bad
        for arch in ARCHS:
            if errors[(name, arch)] is None:
                n += 1
            else:
                bad += 1
                print(errors[(name, arch)])
        if bad == bad_before:
            print(f"nvrtc: kernels/{name}.cu ok for {', '.join(ARCHS)}")
    print(f"nvrtc {'.'.join(map(str, nvrtc.getVersion()))}: {n} compilations ok, {bad} failed "
          f"({workers} at a time)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
