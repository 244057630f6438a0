"""Races the GPU hides: a second opinion on answers that use shared memory.

A kernel with a missing or misplaced barrier often computes the right numbers on a real GPU
(the warps happen to run in a friendly order), so the value checks pass. Two checks run the
submitted code again, in a subprocess, at small sizes that still cover the edge tiles, and
turn a hazard into a GradeError that says which check caught it:

* ``racecheck(ex, src, kernel, driver)`` (CUDA C++, GPU): ``compute-sanitizer --tool
  racecheck`` runs ``driver(kernel)`` (a module-level function ``"package.module:function"``
  that launches the compiled kernel a few times) and reports shared-memory hazards;
* ``simulate(ex, grader, *answers)`` (Numba, GPU): the answer's source, and the globals it
  uses, are shipped to a Python running the CUDA simulator, where the grader runs again. The
  simulator runs a block's threads one at a time between barriers, so a missing
  ``cuda.syncthreads()`` reads values that were never written there.

Both are skipped where they cannot run (no compute-sanitizer, an answer whose globals cannot be
shipped); with ``CUDABOOK_STRICT_RACECHECK=1`` (the test suite and the GPU lane) such a skip is
an error instead, so the check never switches itself off unnoticed where it must run.
``CUDABOOK_RACE_CHECKS=0`` turns both off on purpose: the GPU lane sets it while it executes the
book's own solutions (their answers pass these checks in tests/test_chNN.py, which run strict),
to keep the lane within its time.
"""

from __future__ import annotations

import dis
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import numpy as np

from .. import env
from ._core import GradeError

__all__ = ["racecheck", "simulate", "ship", "ShipError", "STRICT_ENV", "ENABLE_ENV"]

#: Set to 1 to turn a race check that cannot run into an error.
STRICT_ENV = "CUDABOOK_STRICT_RACECHECK"
#: Set to 0 to turn the race checks off (the GPU lane's notebook steps).
ENABLE_ENV = "CUDABOOK_RACE_CHECKS"
_TIMEOUT = 600
_HAZARD_EXIT = 9


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def _skip(ex: str, why: str) -> None:
    if _strict():
        raise GradeError(f"{ex}: the race check could not run ({why}); "
                         f"{STRICT_ENV}=1 makes that an error")


def _child_env(**extra: str) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(dict.fromkeys([root] + [p for p in sys.path if p]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _last_json(stdout: str) -> dict | None:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


# ----------------------------------------------------------------------------- CUDA C++
def racecheck(ex: str, src: str, kernel: str, driver: str, hint: str) -> None:
    """Run ``driver(compiled kernel)`` under compute-sanitizer racecheck; GradeError on a hazard.

    ``hint`` says what to look for (which barrier) in the kernel of this exercise.
    """
    if not env.HAS_GPU or not _enabled():
        return
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.isfile(p)), None)
    if tool is None:
        return _skip(ex, "compute-sanitizer is not installed")
    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
        f.write(src)
        path = f.name
    cmd = [tool, "--tool", "racecheck", "--racecheck-report", "hazard", "--error-exitcode",
           str(_HAZARD_EXIT), sys.executable, "-c",
           "import sys; from cudabook.graders._race import _racecheck_child; "
           "_racecheck_child(*sys.argv[1:])", ex, path, kernel, driver]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT,
                           env=_child_env())
    except subprocess.TimeoutExpired:
        return _skip(ex, f"racecheck took longer than {_TIMEOUT} s")
    finally:
        os.unlink(path)
    out = r.stdout + r.stderr
    hazards = [ln.split("=========", 1)[-1].strip() for ln in out.splitlines()
               if "Race reported" in ln or "Potential RAW" in ln or "Potential WAR" in ln
               or "Potential WAW" in ln]
    if r.returncode == _HAZARD_EXIT or hazards:
        first = hazards[0] if hazards else "a shared-memory hazard"
        raise GradeError(f"{ex}: the results were right on this GPU, but compute-sanitizer "
                         f"racecheck found a race on shared memory ({first}): {hint}")
    done = _last_json(r.stdout)
    if r.returncode != 0 or done is None:
        tail = (out.strip().splitlines() or ["no output"])[-1]
        return _skip(ex, f"racecheck run failed: {tail}")
    return None


def _racecheck_child(ex: str, path: str, kernel: str, driver: str) -> None:
    """Subprocess entry under compute-sanitizer: compile, launch through ``driver``."""
    import importlib

    from ._core import compile_kernel

    k = compile_kernel(ex, Path(path).read_text(), kernel)
    mod, func = driver.split(":")
    getattr(importlib.import_module(mod), func)(k)
    import cupy

    cupy.cuda.Device().synchronize()
    print(json.dumps({"launched": kernel}), flush=True)


# ----------------------------------------------------------------------------- Numba
class ShipError(Exception):
    """An object whose definition cannot be written out for another process."""


def _global_loads(code: types.CodeType) -> list[str]:
    names = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.append(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _global_loads(c)
    return list(dict.fromkeys(names))


def _literal(name: str, v) -> str | None:
    if v is None or isinstance(v, (bool, int, str)):
        return f"{name} = {v!r}"
    if isinstance(v, float):
        return f"{name} = float({repr(v)!r})" if not math.isfinite(v) else f"{name} = {v!r}"
    if isinstance(v, np.generic) and v.dtype.kind in "biuf":
        return f"{name} = __np.{v.dtype.name}(float({repr(float(v))!r}))"
    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.size <= 4096:
        return f"{name} = __np.array({v.tolist()!r}, dtype=__np.{v.dtype.name})"
    if isinstance(v, tuple) and all(isinstance(e, (int, float, bool)) for e in v):
        return f"{name} = {v!r}"
    return None


def ship(objs: dict[str, object]) -> str:
    """Python source that recreates ``objs`` (Numba kernels, device functions, plain functions)
    in a fresh process: their source, then the globals they load (constants, modules, other
    functions), recursively. ShipError for what cannot be written out (closures, objects)."""
    header = ["import numpy as __np", "import numba as __numba"]
    consts: list[str] = []
    bodies: list[str] = []
    done: set[int] = set()

    def visit(name: str, obj) -> None:
        if id(obj) in done:
            return
        done.add(id(obj))
        fn = getattr(obj, "py_func", obj)
        if not isinstance(fn, types.FunctionType):
            raise ShipError(f"{name} is a {type(obj).__name__}")
        if fn.__closure__:
            raise ShipError(f"{name} is a closure (made inside another function)")
        try:
            src = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as e:
            raise ShipError(f"the source of {name} cannot be read ({e})") from None
        if fn.__name__ != name:
            src += f"\n{name} = {fn.__name__}\n"
        for g in _global_loads(fn.__code__):
            if g not in fn.__globals__:
                continue                              # a builtin
            v = fn.__globals__[g]
            if isinstance(v, types.ModuleType):
                header.append(f"import {v.__name__} as {g}" if v.__name__ != g
                              else f"import {g}")
                continue
            lit = _literal(g, v)
            if lit is not None:
                consts.append(lit)
                continue
            if type(v).__module__.startswith("numba.core.types") or \
                    type(v).__module__.startswith("numba.cuda.types"):
                if not hasattr(__import__("numba").types, str(v)):
                    raise ShipError(f"{g} is the Numba type {v}")
                consts.append(f"{g} = getattr(__numba.types, {str(v)!r})")
                continue
            if isinstance(v, types.BuiltinFunctionType) and getattr(v, "__module__", None):
                consts.append(f"from {v.__module__} import {v.__name__} as {g}")
                continue
            if hasattr(v, "py_func") or isinstance(v, types.FunctionType):
                mod = getattr(getattr(v, "py_func", v), "__module__", None) or ""
                home = sys.modules.get(mod)
                if mod and not mod.startswith(("__main__", "cudabook.kernels")) and \
                        home is not None and getattr(home, "__file__", None) and \
                        getattr(home, getattr(v, "__name__", g), None) is v:
                    consts.append(f"from {mod} import {v.__name__} as {g}")
                else:
                    visit(g, v)
                continue
            raise ShipError(f"{g} is a {type(v).__name__}")
        bodies.append(src)

    for name, obj in objs.items():
        visit(name, obj)
    return "\n".join(dict.fromkeys(header)) + "\n" + "\n".join(dict.fromkeys(consts)) + \
        "\n\n" + "\n\n".join(bodies) + "\n"


def simulate(ex: str, grader: str, answers: list[tuple[str, object]], hint: str) -> None:
    """On a GPU, grade ``answers`` again under the CUDA simulator, in a subprocess.

    ``grader`` is the grader's function name in ``cudabook.graders`` (``"ex03_4"``);
    ``answers`` the (name, object) pairs it is called with, in order.
    """
    if not env.HAS_GPU or not _enabled():
        return                       # in simulator mode the grader has just run there
    try:
        text = ship(dict(answers))
    except ShipError as e:
        return _skip(ex, f"the answer cannot be run in another process: {e}")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        r = subprocess.run([sys.executable, "-c",
                            "import sys; from cudabook.graders._race import _simulate_child; "
                            "_simulate_child(*sys.argv[1:])", path, grader,
                            json.dumps([n for n, _ in answers])],
                           capture_output=True, text=True, timeout=_TIMEOUT,
                           env=_child_env(NUMBA_ENABLE_CUDASIM="1"))
    except subprocess.TimeoutExpired:
        return _skip(ex, f"the simulator took longer than {_TIMEOUT} s")
    finally:
        os.unlink(path)
    res = _last_json(r.stdout)
    if res is None:
        tail = ((r.stdout + r.stderr).strip().splitlines() or ["no output"])[-1]
        return _skip(ex, f"the simulator run failed: {tail}")
    if res.get("error"):
        msg = res["error"]
        msg = msg[len(ex) + 2:] if msg.startswith(f"{ex}: ") else msg
        raise GradeError(f"{ex}: the results were right on this GPU, but the same answer fails "
                         "in the CUDA simulator (which runs a block's threads one at a time "
                         f"between barriers, so it exposes races the GPU hid): {msg} [{hint}]")
    return None


def _simulate_child(path: str, grader: str, names: str) -> None:
    """Subprocess entry (NUMBA_ENABLE_CUDASIM=1): recreate the answer, run the grader."""
    import contextlib
    import io
    import linecache

    import cudabook  # noqa: F401 - decides simulator mode before numba.cuda loads
    from cudabook import graders

    text = Path(path).read_text()
    fname = f"<{grader} answer>"
    linecache.cache[fname] = (len(text), None, text.splitlines(keepends=True), fname)
    ns: dict = {"__name__": "__main__"}
    exec(compile(text, fname, "exec"), ns)  # noqa: S102 - the student's own code, shipped here
    args = [ns[n] for n in json.loads(names)]
    err = None
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            getattr(graders, grader)(*args)
        except graders.GradeError as e:
            err = str(e)
    print(json.dumps({"error": err}), flush=True)
