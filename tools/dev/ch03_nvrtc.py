"""Compile Chapter 3's kernels with NVRTC, the compiler CuPy uses, without a GPU.

    LD_LIBRARY_PATH=<dir with libnvrtc.so.13> python tools/dev/ch03_nvrtc.py

nvcc includes math.h implicitly and NVRTC does not (e.g. INFINITY is undefined there), so a file
that compiles with nvcc can still fail in ``cb.load_cuda``; this catches that before a GPU run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cupy_backends.cuda.libs import nvrtc  # noqa: E402

from cudabook.compile import _inline, _kernel_path, cuda_include_dir  # noqa: E402

NAMES = sys.argv[1:] or ["activation", "reduce", "softmax", "layernorm", "conv"]
bad = 0
for name in NAMES:
    src = _inline(_kernel_path(name))
    opts = ["-std=c++17", "-lineinfo", "-arch=compute_90"]
    if cuda_include_dir():
        opts.append(f"-I{cuda_include_dir()}")
    prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
        print(f"{name}: OK")
    except Exception:  # noqa: BLE001
        bad += 1
        print(f"{name}: FAILED\n{nvrtc.getProgramLog(prog)[:2000]}")
sys.exit(1 if bad else 0)
