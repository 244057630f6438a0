"""What the CUDA C++ exercises of Chapters 6 and 7 (ex06.5, ex07.4) share: the static rubric
read from the answer's code, before anything is compiled or launched (so on a CPU too).

    code = rubric(ex, src, "the column sums in the kernel's own loops", shared=True)

``rubric`` refuses a source that is not a str, one that hands the work to a library (a CUB,
CUTLASS, cuBLAS, Thrust, cuDNN or PyTorch header, or a call into one of their namespaces), and,
with ``shared``, one without a ``__shared__`` array or a ``__syncthreads()``. It reads the code
with comments removed (``_static.cuda_code``): a comment that names ``__syncthreads`` satisfies
nothing, and a commented-out include refuses nothing.
"""

from __future__ import annotations

import re

from ._core import GradeError
from ._static import calls, cuda_code, mentions

__all__ = ["LIBRARIES", "rubric"]

#: headers and namespaces of libraries that would do an exercise's work for the kernel
LIBRARIES = ("cub", "cutlass", "cute", "cublas", "cublasLt", "thrust", "cudnn", "torch", "ATen",
             "c10")


def rubric(ex: str, src: str, what: str, shared: bool = True, why_shared: str = "") -> str:
    """The answer's code without comments, after the static checks (GradeError on the first
    that fails). ``what`` says what the kernel itself should do instead of a library;
    ``why_shared`` why the exercise needs shared memory and a barrier."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = cuda_code(src)
    for inc in re.findall(r"#\s*include\s*[<\"]([^>\"]+)[>\"]", code):
        if any(re.search(rf"(^|/){re.escape(lib)}", inc, re.I) for lib in LIBRARIES):
            raise GradeError(f"{ex}: the source includes <{inc}>, a library: the exercise asks "
                             f"for {what} (no CUB, CUTLASS, cuBLAS, Thrust or PyTorch)")
    used = re.search(r"\b(" + "|".join(LIBRARIES) + r")\s*::", code)
    if used:
        raise GradeError(f"{ex}: the code calls into the library namespace {used.group(1)}::: "
                         f"the exercise asks for {what}")
    if shared and not mentions(code, "__shared__"):
        raise GradeError(f"{ex}: no __shared__ array in the code (is the kernel still the "
                         f"stub?): {why_shared}")
    if shared and calls(code, "__syncthreads") == 0:
        raise GradeError(f"{ex}: no __syncthreads() in the code (is the kernel still the "
                         f"stub?): {why_shared}")
    return code
