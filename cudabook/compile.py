"""Compile CUDA C++ with CuPy (NVRTC), and show the exact source under test.

``load_cuda("matmul")`` compiles ``kernels/matmul.cu``. Local ``#include "x.cuh"`` lines are
inlined with ``#line`` markers, so NVRTC error messages name the real file and line. The CUDA
toolkit's include directory is found at run time and passed with ``-I`` (NVRTC alone cannot
find ``<mma.h>`` or ``<cuda_fp16.h>`` on some installs).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from . import env

__all__ = ["KERNELS_DIR", "load_cuda", "compile_source", "load_numba", "show_source",
           "kernel_source", "cuda_include_dir", "CudaModule", "cuda_ptx", "ptx_mix"]

_HERE = Path(__file__).resolve().parent
# In a clone the kernels live at the repository root; in an installed wheel, inside the package.
KERNELS_DIR: Path = (_HERE.parent / "kernels") if (_HERE.parent / "kernels").is_dir() \
    else (_HERE / "kernels")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _kernel_path(name: str) -> Path:
    p = Path(name)
    if not p.suffix:
        p = p.with_suffix(".cu")
    if not p.is_absolute():
        p = KERNELS_DIR / p
    if not p.is_file():
        have = sorted(x.name for x in KERNELS_DIR.glob("*.cu"))
        raise FileNotFoundError(f"no kernel file {p}; kernels/ has {have}")
    return p


def _inline(path: Path, seen: set[Path] | None = None) -> str:
    """Return the source of ``path`` with local includes inlined and #line markers kept."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:  # include guard for the inliner itself
        return ""
    seen.add(path)
    out = [f'#line 1 "{_display(path)}"']
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        if m and (path.parent / m.group(1)).is_file():
            out.append(_inline(path.parent / m.group(1), seen))
            out.append(f'#line {no + 1} "{_display(path)}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(KERNELS_DIR.parent))
    except ValueError:
        return path.name


@lru_cache(maxsize=1)
def cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory (holding cuda_fp16.h, mma.h), or None."""
    cands: list[str] = []
    for var in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "include"))
    try:
        import cupy

        p = cupy.cuda.get_cuda_path()
        if p:
            cands.append(os.path.join(p, "include"))
    except Exception:  # noqa: BLE001
        pass
    cands += ["/usr/local/cuda/include"] + sorted(glob.glob("/usr/local/cuda-*/include"),
                                                   reverse=True)
    # pip wheels of the toolkit headers (nvidia-cuda-runtime-cu12, cuda-toolkit for CUDA 13)
    for sp in sys.path:
        cands += glob.glob(os.path.join(sp, "nvidia", "cu1*", "include"))
        cands += glob.glob(os.path.join(sp, "nvidia", "cuda_runtime", "include"))
    for c in cands:
        if os.path.isfile(os.path.join(c, "cuda_fp16.h")) and \
                os.path.isfile(os.path.join(c, "mma.h")):
            return c
    return None


def _options(extra: tuple[str, ...]) -> tuple[str, ...]:
    opts = ["-std=c++17", "-lineinfo"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    opts += [str(o) for o in extra]
    return tuple(opts)


class CudaModule:
    """A compiled CuPy ``RawModule``; ``mod.name`` or ``mod[name]`` gives a ``RawKernel``."""

    def __init__(self, raw, source: str, label: str):
        self.raw, self.source, self.label = raw, source, label

    def get(self, name: str):
        try:
            return self.raw.get_function(name)
        except Exception as e:  # noqa: BLE001
            pat = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)'
            names = re.findall(pat,
                               self.source)
            raise AttributeError(f"{self.label} has no kernel {name!r}; it defines {names}. "
                                 f"({e})") from None

    __getitem__ = get

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("raw", "source", "label"):
            raise AttributeError(name)
        return self.get(name)

    def resources(self, name: str) -> dict:
        """Registers per thread, static shared memory and local (spill) bytes of a kernel."""
        k = self.get(name)
        a = k.attributes
        return {"registers": a["num_regs"], "shared_bytes": a["shared_size_bytes"],
                "local_bytes": a["local_size_bytes"], "max_threads": a["max_threads_per_block"]}


def _need_gpu(what: str) -> None:
    if not env.HAS_GPU:
        raise RuntimeError(f"{what} needs a CUDA GPU: CuPy compiles and launches CUDA C++ only on "
                           "a real device (this is simulator mode). Skip this cell or use a GPU "
                           "runtime.")


def compile_source(source: str, options: tuple[str, ...] = (), name: str = "<notebook>",
                   name_expressions: tuple[str, ...] | None = None) -> CudaModule:
    """Compile a CUDA C++ source string written in a notebook."""
    _need_gpu(f"compiling {name}")
    import cupy

    src = f'#line 1 "{name}"\n{source}'
    try:
        raw = cupy.RawModule(code=src, options=_options(options),
                             name_expressions=name_expressions)
        raw.compile()
    except cupy.cuda.compiler.CompileException as e:
        raise RuntimeError(f"NVRTC could not compile {name}:\n{e}") from None
    return CudaModule(raw, source, name)


def load_cuda(name: str, options: tuple[str, ...] = (),
              name_expressions: tuple[str, ...] | None = None) -> CudaModule:
    """Compile ``kernels/<name>.cu`` (local includes inlined) and return its module."""
    path = _kernel_path(name)
    return compile_source(_inline(path), options, _display(path), name_expressions)


def load_numba(name: str) -> ModuleType:
    """Import the Numba twin ``kernels/<name>.py`` (after the mode is decided)."""
    path = KERNELS_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no Numba twin {path}")
    modname = f"cudabook.kernels.{name}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def kernel_source(file: str, kernel: str | None = None) -> str:
    """The text of ``kernels/<file>`` or of one function in it (C++ or Python)."""
    path = KERNELS_DIR / file
    text = path.read_text()
    if kernel is None:
        return text
    lines = text.splitlines()
    if path.suffix == ".py":
        return _py_block(lines, kernel, path)
    return _c_block(lines, kernel, path)


def _py_block(lines: list[str], name: str, path: Path) -> str:
    """The decorators, comments and body of the top-level function ``name``."""
    line = next((i for i, s in enumerate(lines) if re.match(rf"(async\s+)?def {name}\b", s)),
                None)
    if line is None:
        raise KeyError(f"{name} not found in {path.name}")
    start = line
    while start > 0 and (lines[start - 1].startswith("@") or lines[start - 1].startswith("#")):
        start -= 1
    end = line + 1
    while end < len(lines) and (not lines[end] or lines[end][0] in " \t)"):
        end += 1
    return "\n".join(lines[start:end]).rstrip() + "\n"


def _c_block(lines: list[str], name: str, path: Path) -> str:
    pat = re.compile(rf"\b{name}\s*\(")
    start = next((i for i, s in enumerate(lines) if pat.search(s) and not s.strip().startswith(
        "//") and (("__global__" in s) or ("__device__" in s) or i + 1 < len(lines))
        and _is_definition(lines, i)), None)
    if start is None:
        raise KeyError(f"{name} not found in {path.name}")
    # take the comment block and template line just above the signature
    while start > 0 and (lines[start - 1].lstrip().startswith("//")
                         or lines[start - 1].lstrip().startswith("template")
                         or lines[start - 1].lstrip().startswith("extern")):
        start -= 1
    depth, end, opened = 0, start, False
    for end in range(start, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        opened = opened or "{" in lines[end]
        if opened and depth == 0:
            break
    return "\n".join(lines[start:end + 1]) + "\n"


def _is_definition(lines: list[str], i: int) -> bool:
    # a definition: the signature's parenthesis is followed by '{' before the next ';'
    rest = "\n".join(lines[i:i + 12])
    brace, semi = rest.find("{"), rest.find(";")
    return brace != -1 and (semi == -1 or brace < semi)


def show_source(file: str, kernel: str | None = None) -> None:
    """Display the code under test: a whole file of kernels/ or one kernel of it."""
    src = kernel_source(file, kernel)
    lang = "python" if file.endswith(".py") else "cuda"
    try:
        from IPython.display import Markdown, display

        display(Markdown(f"`kernels/{file}`" + (f" · `{kernel}`" if kernel else "")
                         + f"\n```{lang}\n{src}```"))
    except ImportError:
        print(src)


def cuda_ptx(name: str, arch: str | None = None, options: tuple[str, ...] = ()) -> str:
    """PTX of ``kernels/<name>.cu`` as ``load_cuda`` would compile it (NVRTC; no launch needed).

    ``arch`` defaults to the current device's (``compute_90`` on an H100).
    """
    from cupy_backends.cuda.libs import nvrtc

    if arch is None:
        major, minor = env.cc() if env.HAS_GPU else (7, 5)
        arch = f"compute_{major}{minor}"
    path = _kernel_path(name)
    prog = nvrtc.createProgram(_inline(path), _display(path), [], [])
    try:
        nvrtc.compileProgram(prog, [*_options(options), f"-arch={arch}"])
        ptx = nvrtc.getPTX(prog)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"NVRTC could not compile {name}:\n{nvrtc.getProgramLog(prog)}") from e
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def ptx_mix(ptx: str, entry: str | None = None) -> dict[str, int]:
    """Instruction mix of the busiest basic block (the one with the most FMAs) of a kernel's PTX.

    Counts: ``instructions``, ``fma``, ``ld.shared``, ``ld.global``, ``int`` (integer, address,
    compare and move instructions: the overhead that competes with the FMAs for issue slots).
    """
    if entry is not None:
        i = ptx.index(f".entry {entry}(")
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
