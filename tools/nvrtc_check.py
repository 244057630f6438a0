#!/usr/bin/env python3
"""Compile every kernels/*.cu with NVRTC, the compiler CuPy uses at run time, with no GPU.

    python tools/nvrtc_check.py [op ...]

nvcc and NVRTC differ: nvcc includes the CUDA runtime and math headers implicitly, NVRTC does not
(``INFINITY``, for one, is undefined there), so a kernel that nvcc accepts can still fail in
``cb.load_cuda``. This compiles exactly the source ``cb.load_cuda`` builds (local includes
inlined, the same options) for compute_75, compute_80 and compute_90.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupy_backends.cuda.libs import nvrtc  # noqa: E402

from cudabook.compile import KERNELS_DIR, inline_source, nvrtc_options  # noqa: E402

ARCHS = ("compute_75", "compute_80", "compute_90")


def main(names: list[str]) -> int:
    names = names or sorted(p.stem for p in KERNELS_DIR.glob("*.cu"))
    bad = n = 0
    for name in names:
        src = inline_source(KERNELS_DIR / f"{name}.cu")
        bad_before = bad
        for arch in ARCHS:
            prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
            try:
                nvrtc.compileProgram(prog, [*nvrtc_options(), f"-arch={arch}"])
                n += 1
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"NVRTC {name}.cu ({arch}): {e}\n{nvrtc.getProgramLog(prog)}")
            finally:
                nvrtc.destroyProgram(prog)
        if bad == bad_before:
            print(f"nvrtc: kernels/{name}.cu ok for {', '.join(ARCHS)}")
    print(f"nvrtc {'.'.join(map(str, nvrtc.getVersion()))}: {n} compilations ok, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
