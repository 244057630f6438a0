"""Static checks of a submitted answer's source, proof against comments and strings.

A rubric such as "uses a warp shuffle" or "calls cuda.syncthreads()" is checked on the code
with comments and string literals removed, so a comment that mentions ``__shfl`` or a docstring
that says ``syncthreads`` satisfies nothing. One helper per language:

    code = cuda_code(src)                 # CUDA C++ source string -> code without comments
    code = python_code(ex, kernel)        # Numba kernel or Python function -> its code
    calls(code, "__syncthreads")          # how many times a function is called
    mentions(code, "__shared__")          # the word appears in the code

``python_code`` raises GradeError when the source cannot be read (a function made with exec):
a rubric never switches itself off silently.
"""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize

from ._core import GradeError

__all__ = ["cuda_code", "python_code", "calls", "mentions", "refuse_stub"]


def cuda_code(src: str) -> str:
    """C/C++ source with ``//`` and ``/* */`` comments removed (string literals kept whole)."""
    if not isinstance(src, str):
        raise TypeError(f"cuda_code: expected the source as a str, got {type(src).__name__}")
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":                       # a string or char literal: copy it to its end
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j            # keep the newline: line numbers stay
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * src.count("\n", i, j) or " ")
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _source(obj) -> str | None:
    fn = getattr(obj, "py_func", obj)
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def python_code(ex: str, obj) -> str:
    """The code of a Python function or Numba kernel: comments and strings blanked."""
    src = _source(obj)
    if src is None:
        raise GradeError(f"{ex}: cannot read the source of {getattr(obj, '__name__', obj)!r} "
                         "(was it made with exec?); define it in a notebook cell or a .py file "
                         "so its rubric can be checked")
    lines = src.splitlines(keepends=True)
    spans = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                spans.append((tok.start, tok.end, tok.type))
    except (tokenize.TokenError, IndentationError):
        return "\n".join(ln.split("#")[0] for ln in src.splitlines())
    for (r0, c0), (r1, c1), kind in reversed(spans):
        fill = "" if kind == tokenize.COMMENT else '""'
        if r0 == r1:
            ln = lines[r0 - 1]
            lines[r0 - 1] = ln[:c0] + fill + ln[c1:]
        else:                                 # a multi-line string: keep the line count
            lines[r0 - 1] = lines[r0 - 1][:c0] + fill + "\n"
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
            lines[r1 - 1] = lines[r1 - 1][c1:]
    return "".join(lines)


def calls(code: str, name: str) -> int:
    """How many times ``name(`` is called in ``code`` (``cuda.syncthreads`` or ``atomicAdd``)."""
    return len(re.findall(rf"(?<!\w){re.escape(name)}\s*\(", code))


def mentions(code: str, word: str) -> bool:
    """True when ``word`` appears in ``code`` as a whole word (or as a prefix: ``__shfl``)."""
    return re.search(rf"(?<!\w){re.escape(word)}", code) is not None


def refuse_stub(ex: str, kernel) -> None:
    """GradeError if a Numba kernel is still the exercise's stub. (On a GPU a ``raise`` inside a
    kernel is not propagated: the kernel just writes nothing, which would read as a wrong
    answer.)"""
    if re.search(r"\braise\s+NotImplementedError\b", python_code(ex, kernel)):
        raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                         "NotImplementedError)")
