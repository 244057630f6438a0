"""One grader per exercise, ``exNN_k``, collected from the chapter modules ``chNN.py``.

    from cudabook.graders import ex01_1
    ex01_1(my_kernel)          # prints "PASS ex01.1" or raises GradeError with the reason
"""

from __future__ import annotations

import importlib
import pkgutil

from ._core import GradeError

__all__ = ["GradeError"]

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch")):
    _mod = importlib.import_module(f"{__name__}.{_m}")
    for _name in dir(_mod):
        if _name.startswith("ex") and callable(getattr(_mod, _name)):
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
