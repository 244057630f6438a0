"""cudabook: the helper package of the executable book "CUDA for Deep Learning".

Import it first in every notebook: it decides between GPU mode and the Numba CUDA simulator
before ``numba.cuda`` is imported.

    import cudabook as cb
    cb.report()                               # device, versions, problems and their fixes
    mod = cb.load_cuda("vector_add")          # kernels/vector_add.cu through CuPy/NVRTC
    nb = cb.load_numba("vector_add")          # its Numba twin, kernels/vector_add.py
    sm = cb.load_launch("softmax")            # launch helpers, kernels/softmax_launch.py
    cb.check(out, ref64)                      # float64 reference, NaN-prefilled outputs
    cb.bench({"v1": f1}, baseline={"cupy": f0}, bytes=...)   # same-run ratio to the vendor
"""

from __future__ import annotations

# ruff: noqa: I001  (env must be imported first: it decides the mode before numba.cuda loads)
from . import env
from .env import HAS_GPU, SIM, cc, pick, report, require_cc, require_gpu
from .check import CheckError, check, empty_nan, to_numpy
from .compile import (KERNELS_DIR, compile_source, cuda_include_dir, cuda_module, load_cuda,
                      load_launch, load_module, load_numba, module)
from .source import kernel_source, show_source
from .ptx import cuda_ptx, ptx_mix
from .results import record
from .bench import BenchError, bench, flush_l2, progress, sweep
from .validate import expect, expect_aligned
from .launch import (Launch, LaunchError, ceil_div, grid_1d, grid_2d, need_cc, need_shared,
                     round_up, row_block)
from . import arrays
from .arrays import as_cupy, describe, stream_for
from . import reference
from . import baselines  # noqa: F401  (torch graphs, torch.compile, the bound: cheap to import)
from . import quant
from . import roofline
from . import plot
from .tracer import trace  # noqa: F401  (cb.trace; cudabook.tracedraw draws it)

__version__ = "0.1.0"

__all__ = ["env", "SIM", "HAS_GPU", "cc", "pick", "report", "require_gpu", "require_cc",
           "check", "empty_nan", "to_numpy", "CheckError", "KERNELS_DIR", "load_cuda",
           "compile_source", "cuda_module", "load_numba", "load_launch", "load_module",
           "show_source", "kernel_source", "cuda_include_dir", "cuda_ptx", "ptx_mix",
           "bench", "sweep", "progress", "flush_l2", "record", "BenchError", "plot", "ceil_div",
           "round_up",
           "grid_1d", "grid_2d", "row_block", "need_cc", "LaunchError", "expect",
           "expect_aligned", "reference", "quant", "roofline", "baselines", "module", "Launch",
           "need_shared", "arrays", "as_cupy", "describe", "stream_for", "tma",
           "gpu_cells_need"]

# Chapter modules load when first used (``cb.graphs``, ``from cudabook import dist``), so that
# importing cudabook in chapter 1 neither pays for them nor runs what they set up.
_LAZY = {"tma",                                          # TMA descriptors (Hopper chapters)
         "graphs", "ncu", "occupancy", "torchtrace",   # Chapter 5: profiling
         "quant_study",                                # Chapter 10: the accuracy study (torch)
         "collectives", "dist", "sharded", "tensor_parallel"}   # Chapter 11: multi-GPU


def __getattr__(name: str):
    """``cb.<chapter module>``: import it on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)


def _ends_with_semicolon(cell: str) -> bool:
    """True if the cell's last token, comments aside, is ';' (IPython then shows no value)."""
    import io
    import tokenize

    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
            tokenize.INDENT, tokenize.DEDENT}
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(cell).readline)
                if t.type not in skip]
    except (tokenize.TokenError, SyntaxError):
        return cell.rstrip().endswith(";")
    return bool(toks) and toks[-1].string == ";"


def _under_pytest_without_plugin() -> bool:
    """This kernel was started by a pytest run (nbval) that did not load cudabook's plugin.

    nbval's kernel is a child of the pytest process. Where /proc exists (Linux, Colab) the
    parent's command line says whether it is pytest with nbval; elsewhere PYTEST_VERSION, which
    pytest 8.2 on exports to the processes it starts, stands for it. The plugin exports
    CUDABOOK_PYTEST_PLUGIN, the pid of the pytest process that loaded it."""
    import os

    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        under = any(b"pytest" in a for a in argv) and any(b"nbval" in a for a in argv)
    except OSError:
        under = "PYTEST_VERSION" in os.environ
    return under and os.environ.get("CUDABOOK_PYTEST_PLUGIN") != str(ppid)


_CELLS_NEED: tuple[int, int, str] | None = None   # set by gpu_cells_need()


def gpu_cells_need(major: int, minor: int = 0, what: str = "the cells below") -> bool:
    """From now on, ``%%gpu`` cells run only on a GPU of compute capability >= major.minor; on an
    older one each says it is skipped (a chapter whose every GPU cell needs, say, bf16 tensor
    cores states it once). Returns whether this GPU qualifies (False in simulator mode)."""
    global _CELLS_NEED
    if not (isinstance(major, int) and isinstance(minor, int)):
        raise TypeError(f"gpu_cells_need: major and minor are ints, got {major!r}, {minor!r}")
    _CELLS_NEED = (major, minor, what)
    if not env.HAS_GPU:
        return False
    ok = tuple(env.cc()) >= (major, minor)
    if not ok:
        print(f"{what} need compute capability {major}.{minor}+; this {env.info().name} is "
              f"{env.cc()[0]}.{env.cc()[1]}: the GPU cells of this page will say they are skipped.")
    return ok


def _gpu_cell(line: str, cell: str):
    """%%gpu: run the cell on a GPU; in simulator mode, or on a GPU older than what
    ``gpu_cells_need`` asked for, say why it is skipped."""
    if env.HAS_GPU and _CELLS_NEED is not None and tuple(env.cc()) < _CELLS_NEED[:2]:
        print(f"skipped: {_CELLS_NEED[2]} need compute capability {_CELLS_NEED[0]}."
              f"{_CELLS_NEED[1]}+; this GPU is {env.cc()[0]}.{env.cc()[1]}.")
        return None
    if not env.HAS_GPU:
        what = line.strip() or "this cell (CuPy / CUDA C++ or timing)"
        if _under_pytest_without_plugin():
            raise RuntimeError(
                f"{what} needs a CUDA GPU and this is simulator mode, but pytest runs this "
                "notebook without cudabook's plugin, which would report the cell as skipped: "
                "cudabook was most likely installed by this run's setup cell, after pytest had "
                "loaded its plugins. Run the same pytest command again.")
        print(f"skipped: {what} needs a CUDA GPU; this is simulator mode.")
        return None
    import ast
    import builtins

    from IPython import get_ipython

    ip = get_ipython()
    tree = ip.compile.ast_parse(ip.transform_cell(cell))
    tree = ip.transform_ast(tree)
    last = None   # a final expression is the cell's value, unless a ';' hides it (as in IPython)
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(cell):
        last = ast.Expression(tree.body.pop().value)
    # builtins.compile: the name `compile` in this package is the module cudabook.compile
    exec(builtins.compile(tree, "<%%gpu cell>", "exec"), ip.user_ns)  # noqa: S102
    if last is not None:
        return eval(builtins.compile(last, "<%%gpu cell>", "eval"), ip.user_ns)  # noqa: S307
    return None


def _register_magic() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        ip.register_magic_function(_gpu_cell, magic_kind="cell", magic_name="gpu")


_register_magic()
