"""Reading what the compiler made of a kernel: its PTX, and the instruction mix of its inner loop.

NVRTC compiles without a GPU, so ``cuda_ptx`` works in simulator mode too.
"""

from __future__ import annotations

import re

from . import env
from .compile import _display, inline_source, kernel_path, nvrtc_options

__all__ = ["cuda_ptx", "ptx_mix"]


def cuda_ptx(name: str, arch: str | None = None, options: tuple[str, ...] = ()) -> str:
    """PTX of ``kernels/<name>.cu`` as ``load_cuda`` would compile it (NVRTC; no launch needed).

    ``arch`` defaults to the current device's (``compute_90`` on an H100; ``compute_75``
    without a GPU).
    """
    from cupy_backends.cuda.libs import nvrtc

    if arch is None:
        major, minor = env.cc() if env.HAS_GPU else (7, 5)
        arch = f"compute_{major}{minor}"
    if not isinstance(arch, str) or not re.fullmatch(r"compute_\d+a?", arch):
        raise ValueError(f"cuda_ptx: arch must look like 'compute_80', got {arch!r}")
    path = kernel_path(name)
    prog = nvrtc.createProgram(inline_source(path), _display(path), [], [])
    try:
        nvrtc.compileProgram(prog, [*nvrtc_options(tuple(options)), f"-arch={arch}"])
        ptx = nvrtc.getPTX(prog)
    except Exception as e:  # noqa: BLE001 - NVRTC raises its own error type; the log says why
        raise RuntimeError(f"NVRTC could not compile {name}:\n{nvrtc.getProgramLog(prog)}") from e
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def ptx_mix(ptx: str, entry: str | None = None) -> dict[str, int]:
    """Instruction mix of the busiest basic block (the one with the most FMAs) of a kernel's PTX.

    Counts: ``instructions``, ``fma``, ``ld.shared``, ``ld.global``, ``int`` (integer, address,
    compare and move instructions: the overhead that competes with the FMAs for issue slots).
    """
    if not isinstance(ptx, str):
        raise TypeError(f"ptx_mix: expected PTX text (str), got {type(ptx).__name__}")
    if entry is not None:
        i = ptx.find(f".entry {entry}(")
        if i < 0:
            have = re.findall(r"\.entry (\w+)\(", ptx)
            raise KeyError(f"ptx_mix: no entry {entry!r} in this PTX; it has {have}")
        j = ptx.find(".entry", i + 1)
        ptx = ptx[i:j if j > 0 else None]
    blocks = re.split(r"\n\$[\w]+:", ptx)
    block = max(blocks, key=lambda b: b.count("fma.rn.f32"))
    mix = {"instructions": 0, "fma": 0, "ld.shared": 0, "ld.global": 0, "int": 0}
    for line in block.splitlines():
        parts = line.split()
        if not parts or not re.match(r"[@a-z]", parts[0]) or parts[0].startswith("."):
            continue
        op = parts[1] if parts[0].startswith("@") else parts[0]
        mix["instructions"] += 1
        if op.startswith("fma"):
            mix["fma"] += 1
        elif op.startswith("ld.shared"):
            mix["ld.shared"] += 1
        elif op.startswith("ld.global"):
            mix["ld.global"] += 1
        elif re.match(r"(add|sub|mul|mad|shl|shr|and|or|xor|setp|selp|cvt|mov|neg)\.", op) \
                and not re.search(r"\.f(16|32|64)\b", op):
            mix["int"] += 1
    return mix
