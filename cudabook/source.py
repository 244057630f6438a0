"""Showing the code under test: a whole ``kernels/`` file, or one kernel of it (C++ or Python).

The book never keeps a second copy of a kernel: a notebook calls ``show_source`` on the file
that ``load_cuda`` / ``load_numba`` compile.
"""

from __future__ import annotations

import re
from pathlib import Path

from .compile import KERNELS_DIR

__all__ = ["kernel_source", "show_source"]


def kernel_source(file: str, kernel: str | None = None) -> str:
    """The text of ``kernels/<file>`` or of one function in it (C++ or Python)."""
    if not isinstance(file, str):
        raise TypeError(f"kernel_source: expected a file name such as 'matmul.cu', got "
                        f"{type(file).__name__}")
    if kernel is not None and not isinstance(kernel, str):
        raise TypeError(f"kernel_source: the kernel is named by a str, got "
                        f"{type(kernel).__name__}")
    path = KERNELS_DIR / file
    if not path.is_file():
        have = sorted(p.name for p in KERNELS_DIR.iterdir() if p.suffix in (".cu", ".cuh", ".py"))
        raise FileNotFoundError(f"no file kernels/{file}; kernels/ has {have}")
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
