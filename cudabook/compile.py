"""Loading kernels: compile CUDA C++ with CuPy (NVRTC), import the Numba twins and launch modules.

``load_cuda("matmul")`` compiles ``kernels/matmul.cu``. Local ``#include "x.cuh"`` lines are
inlined with ``#line`` markers (``inline_source``), so NVRTC error messages name the real file
and line. The CUDA toolkit's include directory is found at run time and passed with ``-I``
(NVRTC alone cannot find ``<mma.h>`` or ``<cuda_fp16.h>`` on some installs); ``nvrtc_options``
gives the exact option list, which the tools reuse.

``module("attention_forward", only=("attention_v4",), a_features=True)`` is what launchers
call: it compiles one ladder step of a file (the file wraps each step in
``#if !defined(CB_ONLY) || defined(CB_ONLY_<step>)``, so the other steps are left out of that
compile), with the architecture rule (``arch_options``) written once, once per process.

**The kernel cache.** Compiled modules are also kept on disk, so a fresh process, a restarted
notebook runtime or the next chapter loads them in milliseconds instead of compiling again. The
directory is ``$CUDABOOK_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/cudabook/kernels`` (default
``~/.cache/cudabook/kernels``; on Colab, point it at a mounted Drive folder to keep kernels
across sessions). An entry is keyed by a SHA-256 of everything that decides the machine code:
the inlined source (every included header), the options, the name expressions, the GPU
architecture and the NVRTC and CuPy versions, so a changed source or option compiles afresh and
never loads a stale binary. Entries are written atomically and checked against their hash when
read (a damaged file is compiled again). ``CUDABOOK_KERNEL_CACHE=0`` turns the cache off (CuPy's
own cache still applies); ``clear_cache()`` empties it.

``load_numba("matmul")`` imports ``kernels/matmul.py`` (the Numba twins) and
``load_launch("matmul")`` imports ``kernels/matmul_launch.py`` (the host-side launch helpers).

Showing source is ``cudabook.source``; reading PTX is ``cudabook.ptx``.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from . import env

__all__ = ["KERNELS_DIR", "kernel_path", "inline_source", "nvrtc_options", "cuda_include_dir",
           "CudaModule", "compile_source", "load_cuda", "cuda_module", "load_numba", "load_launch",
           "load_module", "kernel_names", "arch_options", "module", "cache_dir", "clear_cache"]

_HERE = Path(__file__).resolve().parent
# In a clone the kernels live at the repository root; in an installed wheel, inside the package.
KERNELS_DIR: Path = (_HERE.parent / "kernels") if (_HERE.parent / "kernels").is_dir() \
    else (_HERE / "kernels")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(//.*)?$')
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                        r'(\w+)')


def _need_str(value, what: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what}: expected a name (str), got {type(value).__name__}")
    return str(value)


def kernel_path(name: str) -> Path:
    """The file ``kernels/<name>.cu`` (or ``name`` itself if it has a suffix or is absolute)."""
    p = Path(_need_str(name, "kernel file"))
    if not p.suffix:
        p = p.with_suffix(".cu")
    if not p.is_absolute():
        p = KERNELS_DIR / p
    if not p.is_file():
        have = sorted(x.name for x in KERNELS_DIR.glob("*.cu"))
        raise FileNotFoundError(f"no kernel file {p}; kernels/ has {have}")
    return p


def inline_source(path: Path | str, seen: set[Path] | None = None) -> str:
    """The source of ``path`` with local includes inlined and ``#line`` markers kept."""
    path = Path(path).resolve()
    seen = set() if seen is None else seen
    if path in seen:  # include guard for the inliner itself
        return ""
    seen.add(path)
    out = [f'#line 1 "{_display(path)}"']
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        if m and (path.parent / m.group(1)).is_file():
            out.append(inline_source(path.parent / m.group(1), seen))
            out.append(f'#line {no + 1} "{_display(path)}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(KERNELS_DIR.parent))
    except ValueError:
        return path.name


def kernel_names(source: str) -> list[str]:
    """The ``extern "C" __global__`` kernels a CUDA C++ source defines."""
    return _KERNEL_RE.findall(source)


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
    except Exception:  # noqa: BLE001 - no CuPy, or CuPy without a toolkit: try the usual places
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


def nvrtc_options(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The NVRTC options ``load_cuda`` compiles with (C++17, line info, the toolkit headers)."""
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
        """The kernel ``name``; AttributeError naming the kernels defined if there is none."""
        # cupy.cuda.driver is an attribute, not a module, in CuPy 14: import from where it lives
        from cupy_backends.cuda.api.driver import CUDADriverError

        try:
            return self.raw.get_function(_need_str(name, "kernel name"))
        except CUDADriverError as e:
            if "NOT_FOUND" not in str(e):
                raise                        # a real driver problem: not a missing name
            raise AttributeError(f"{self.label} has no kernel {name!r}; it defines "
                                 f"{kernel_names(self.source)}") from None

    __getitem__ = get

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("raw", "source", "label"):
            raise AttributeError(name)
        return self.get(name)

    def resources(self, name: str) -> dict:
        """Registers per thread, static shared memory and local (spill) bytes of a kernel."""
        a = self.get(name).attributes
        return {"registers": a["num_regs"], "shared_bytes": a["shared_size_bytes"],
                "local_bytes": a["local_size_bytes"], "max_threads": a["max_threads_per_block"]}


def _need_gpu(what: str) -> None:
    if not env.HAS_GPU:
        raise RuntimeError(f"{what} needs a CUDA GPU: CuPy compiles and launches CUDA C++ only on "
                           "a real device (this is simulator mode). Skip this cell or use a GPU "
                           "runtime.")


def compile_source(source: str, options: tuple[str, ...] = (), name: str = "<notebook>",
                   name_expressions: tuple[str, ...] | None = None,
                   cache: bool = True) -> CudaModule:
    """Compile a CUDA C++ source string written in a notebook (``cache``: keep the binary in
    the kernel cache, see the module's docstring)."""
    if not isinstance(source, str):
        raise TypeError(f"compile_source: expected the CUDA C++ source as a str, got "
                        f"{type(source).__name__}")
    if isinstance(options, str):
        raise TypeError("compile_source: options is a tuple of strings, e.g. ('-DTILE=32',)")
    _need_gpu(f"compiling {name}")
    import cupy

    src = f'#line 1 "{name}"\n{source}'
    opts = nvrtc_options(tuple(options))
    exprs = tuple(name_expressions) if name_expressions else None
    try:
        if cache and _cache_on():
            raw = _cached_compile(src, opts, exprs, name)
        else:
            raw = cupy.RawModule(code=src, options=opts, name_expressions=exprs)
            raw.compile()
    except cupy.cuda.compiler.CompileException as e:
        raise RuntimeError(f"NVRTC could not compile {name}:\n{e}") from None
    return CudaModule(raw, source, name)


# ----------------------------------------------------------------------------- the kernel cache
def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module's docstring)."""
    d = os.environ.get("CUDABOOK_CACHE_DIR")
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cudabook" / "kernels"


def _cache_on() -> bool:
    return os.environ.get("CUDABOOK_KERNEL_CACHE", "1").strip().lower() not in ("0", "off",
                                                                               "false", "no")


def clear_cache() -> int:
    """Delete every entry of the kernel cache; returns how many files were removed."""
    n = 0
    d = cache_dir()
    if d.is_dir():
        for p in d.iterdir():
            if p.suffix in (".cubin", ".json", ".tmp"):
                p.unlink(missing_ok=True)
                n += 1
    return n


class _CachedRaw:
    """A module loaded from the kernel cache: a CuPy ``RawModule`` on the cached binary whose
    ``get_function`` and ``get_global`` also take the name expressions it was compiled with
    (looked up in the mangled names NVRTC recorded)."""

    def __init__(self, path: Path, mapping: dict | None):
        import cupy

        self.path = path
        self.mapping = dict(mapping or {})
        self.module = cupy.RawModule(path=str(path))

    def get_function(self, name: str):
        return self.module.get_function(self.mapping.get(name, name))

    def get_global(self, name: str):
        return self.module.get_global(self.mapping.get(name, name))

    def compile(self, *a, **k) -> None:       # already compiled
        return None


def _arch() -> str:
    """The architecture CuPy compiles for on this GPU (its own rule, read from CuPy)."""
    from cupy.cuda import compiler

    try:
        return str(compiler._get_arch())
    except Exception:  # noqa: BLE001 - a CuPy without the helper: the device's own
        import cupy

        return str(cupy.cuda.Device().compute_capability)


def _cache_key(src: str, opts: tuple, exprs: tuple | None, arch: str) -> str:
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    h = hashlib.sha256()
    for part in (src, "\0".join(opts), "\0".join(sorted(exprs or ())), arch,
                 ".".join(map(str, nvrtc.getVersion())), cupy.__version__, "v1"):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()[:40]


def _cached_compile(src: str, opts: tuple, exprs: tuple | None, label: str):
    from cupy.cuda import compiler

    arch = _arch()
    key = _cache_key(src, opts, exprs, arch)
    d = cache_dir()
    binp, metap = d / f"{key}.cubin", d / f"{key}.json"
    try:
        meta = json.loads(metap.read_text())
        binary = binp.read_bytes()
        if meta.get("sha256") == hashlib.sha256(binary).hexdigest():
            return _CachedRaw(binp, meta.get("mapping"))
    except (OSError, ValueError):
        pass                                  # not there, or damaged: compile it again
    # exactly what cupy.RawModule(code=...) compiles: CuPy adds -ftz=true and its -arch
    out = compiler.compile_using_nvrtc(src, tuple(opts) + ("-ftz=true",), arch,
                                       name_expressions=list(exprs) if exprs else None)
    binary, mapping = out if isinstance(out, tuple) else (out, None)
    if isinstance(binary, str):
        binary = binary.encode()
    try:
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write(binp, binary)
        _atomic_write(metap, json.dumps({"sha256": hashlib.sha256(binary).hexdigest(),
                                         "mapping": mapping or {}, "label": label,
                                         "arch": arch, "options": list(opts)}).encode())
    except OSError:                           # a read-only cache: load from memory instead
        import cupy

        raw = cupy.RawModule(code=src, options=opts, name_expressions=exprs)
        raw.compile()
        return raw
    return _CachedRaw(binp, mapping)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_cuda(name: str, options: tuple[str, ...] = (),
              name_expressions: tuple[str, ...] | None = None) -> CudaModule:
    """Compile ``kernels/<name>.cu`` (local includes inlined) and return its module."""
    path = kernel_path(name)
    return compile_source(inline_source(path), options, _display(path), name_expressions)


def arch_options(a_features: bool = False, cc: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The architecture rule, written once: ``-arch=sm_90a`` on compute capability 9.0 for a
    file with sm_90a-only instructions (``a_features``: wgmma, setmaxnreg, TMA multicast), else
    nothing (CuPy compiles for the GPU's own architecture)."""
    if not a_features:
        return ()
    if cc is None:
        if not env.HAS_GPU:
            return ()
        cc = env.cc()
    return ("-arch=sm_90a",) if tuple(cc) == (9, 0) else ()


@lru_cache(maxsize=None)
def _module(name: str, options: tuple[str, ...], name_expressions: tuple[str, ...] | None):
    return load_cuda(name, options, name_expressions)


def module(name: str, options: tuple[str, ...] = (), *, only: tuple[str, ...] | str = (),
           name_expressions: tuple[str, ...] | None = None,
           a_features: bool = False) -> CudaModule:
    """``kernels/<name>.cu`` compiled once per process (and kept in the kernel cache).

    ``only``: the ladder steps to compile (``"attention_v4"`` or a tuple); the file's other
    steps are left out (``-DCB_ONLY -DCB_ONLY_<step>``). ``name_expressions``: template kernels
    to instantiate. ``a_features``: the file has sm_90a-only instructions (``arch_options``).
    A failed compile is not cached (the next call tries again)."""
    if isinstance(only, str):
        only = (only,)
    opts = tuple(options) + arch_options(a_features)
    if only:
        for step in only:
            if not re.fullmatch(r"\w+", str(step)):
                raise ValueError(f"module: a ladder step is a C identifier, got {step!r}")
        opts += ("-DCB_ONLY",) + tuple(f"-DCB_ONLY_{s}" for s in only)
    exprs = tuple(name_expressions) if name_expressions else None
    return _module(_need_str(name, "kernel file"), opts, exprs)


def cuda_module(name: str, options: tuple[str, ...] = ()) -> CudaModule:
    """``load_cuda(name, options)`` compiled once per process: the whole file (``module`` with
    nothing left out)."""
    return _module(_need_str(name, "kernel file"), tuple(options), None)


def _import_kernels_py(stem: str, what: str) -> ModuleType:
    path = KERNELS_DIR / f"{stem}.py"
    if not path.is_file():
        have = sorted(p.stem for p in KERNELS_DIR.glob("*.py") if p.stem != "__init__")
        raise FileNotFoundError(f"no {what} {path}; kernels/ has {have}")
    modname = f"cudabook.kernels.{stem}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[modname]              # a failed import must not leave half a module
        raise
    return mod


def load_module(stem: str) -> ModuleType:
    """Import ``kernels/<stem>.py`` (a Numba twin file or a host module such as
    ``matmul_tune``), once: later calls return the same module."""
    return _import_kernels_py(_need_str(stem, "load_module"), "module")


def load_numba(name: str) -> ModuleType:
    """Import the Numba twins ``kernels/<name>.py`` (after the mode is decided)."""
    return _import_kernels_py(_need_str(name, "load_numba"), "Numba twin")


def load_launch(name: str) -> ModuleType:
    """Import ``kernels/<name>_launch.py``: the launch helpers of ``kernels/<name>.cu``."""
    name = _need_str(name, "load_launch")
    stem = name if name.endswith("_launch") else f"{name}_launch"
    return _import_kernels_py(stem, "launch module")


_MOVED = {"kernel_source": "source", "show_source": "source", "cuda_ptx": "ptx",
          "ptx_mix": "ptx", "_inline": None, "_options": None, "_kernel_path": None}


def __getattr__(name: str):
    """Names that lived here before the split (source display, PTX) still resolve."""
    if name not in _MOVED:
        raise AttributeError(f"module 'cudabook.compile' has no attribute {name!r}")
    if _MOVED[name] is None:
        return {"_inline": inline_source, "_options": nvrtc_options,
                "_kernel_path": kernel_path}[name]
    return getattr(importlib.import_module(f"cudabook.{_MOVED[name]}"), name)
