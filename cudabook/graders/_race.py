"""Races the GPU hides: a second opinion on answers that use shared memory.

A kernel with a missing or misplaced barrier often computes the right numbers on a real GPU
(the warps happen to run in a friendly order), so the value checks pass. Two checks run the
submitted code again, in a subprocess, at small sizes that still cover the edge tiles, and
turn a hazard into a GradeError that says which check caught it:

* ``racecheck(ex, src, kernel, driver)`` (CUDA C++, GPU): ``compute-sanitizer --tool
  racecheck`` runs ``driver(kernel)`` (a module-level function ``"package.module:function"``
  that launches the compiled kernel a few times) and reports shared-memory hazards;
* ``simulate(ex, grader, *answers)`` (Numba, GPU): the answer's source, and the globals it
  uses, are shipped (``tracer.Shipment``, as ``cb.trace`` ships a kernel) to a Python running
  the CUDA simulator, where the grader runs again. The
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

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from .. import env
from ._core import GradeError

__all__ = ["racecheck", "simulate", "explain", "first_launch", "STRICT_ENV", "ENABLE_ENV",
           "EXPLAIN_THREADS"]

#: Set to 1 to turn a race check that cannot run into an error.
STRICT_ENV = "CUDABOOK_STRICT_RACECHECK"
#: Set to 0 to turn the race checks off (the GPU lane's notebook steps).
ENABLE_ENV = "CUDABOOK_RACE_CHECKS"
_TIMEOUT = 600
_HAZARD_EXIT = 9
#: the largest launch ``explain`` traces (a grader stays fast: about a second per trace)
EXPLAIN_THREADS = 4096
_EXPLAIN_TIMEOUT = 120


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
def simulate(ex: str, grader: str, answers: list[tuple[str, object]], hint: str) -> None:
    """On a GPU, grade ``answers`` again under the CUDA simulator, in a subprocess.

    ``grader`` is the grader's function name in ``cudabook.graders`` (``"ex03_4"``);
    ``answers`` the (name, object) pairs it is called with, in order. The answers travel as
    ``cb.trace`` sends a kernel (``tracer.Shipment``: source, globals, closures, the functions
    they call).
    """
    if not env.HAS_GPU or not _enabled():
        return                       # in simulator mode the grader has just run there
    err = _simulate_run(ex, grader, answers)
    if err:
        raise GradeError(f"{ex}: the results were right on this GPU, but the same answer fails "
                         "in the CUDA simulator (which runs a block's threads one at a time "
                         f"between barriers, so it exposes races the GPU hid): {err} [{hint}]")


def _simulate_run(ex: str, grader: str, answers: list[tuple[str, object]]) -> str | None:
    """Ship the answers, run ``grader`` on them in a simulator process: its GradeError message
    (without the ``ex: `` prefix), or None when it passed (or could not run: ``_skip``)."""
    from ..tracer import Shipment, TraceError

    sh = Shipment()
    try:
        ids = [sh.add(obj) for _, obj in answers]
    except TraceError as e:
        return _skip(ex, f"the answer cannot be run in another process: {e}")
    if sh.missing():
        return _skip(ex, "the answer cannot be run in another process: "
                     + "; ".join(sh.missing()))
    job = dict(funcs=sh.funcs, namespaces=sh.namespaces, ids=ids)
    with tempfile.TemporaryDirectory(prefix="cbsim_") as tmp:
        path = os.path.join(tmp, "job.pkl")
        with open(path, "wb") as fh:
            pickle.dump(job, fh, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            r = subprocess.run([sys.executable, "-c",
                                "import sys; from cudabook.graders._race import "
                                "_simulate_child; _simulate_child(*sys.argv[1:])", path, grader],
                               capture_output=True, text=True, timeout=_TIMEOUT, cwd=tmp,
                               env=_child_env(NUMBA_ENABLE_CUDASIM="1"))
        except subprocess.TimeoutExpired:
            return _skip(ex, f"the simulator took longer than {_TIMEOUT} s")
    res = _last_json(r.stdout)
    if res is None:
        tail = ((r.stdout + r.stderr).strip().splitlines() or ["no output"])[-1]
        return _skip(ex, f"the simulator run failed: {tail}")
    if res.get("notes"):
        return _skip(ex, "the answer cannot be run in another process: "
                     + "; ".join(res["notes"]))
    msg = res.get("error")
    if msg and msg.startswith(f"{ex}: "):
        msg = msg[len(ex) + 2:]
    return msg or None


def _simulate_child(path: str, grader: str) -> None:
    """Subprocess entry (NUMBA_ENABLE_CUDASIM=1): re-create the answers, run the grader."""
    import cudabook  # noqa: F401 - decides simulator mode before numba.cuda loads
    from cudabook import _traceworker, graders

    with open(path, "rb") as fh:
        job = pickle.load(fh)
    from numba import cuda  # in simulator mode: cudabook decided it above

    with tempfile.TemporaryDirectory(prefix="cbsim_") as tmp:
        made, notes = _traceworker.build_functions(job["funcs"], job["namespaces"], tmp, cuda)
        if notes:
            print(json.dumps({"notes": notes}), flush=True)
            return
        err = None
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                getattr(graders, grader)(*[made[i] for i in job["ids"]])
            except graders.GradeError as e:
                err = str(e)
    print(json.dumps({"error": err}), flush=True)


# ----------------------------------------------------------------------------- findings
#: the findings that explain a failure; holes in the output are what the value checks already
#: report (and name better: "row and col swapped?"), so they add nothing to a message
_EXPLAINING = ("out_of_bounds", "races", "uninitialized", "multiple_writes", "uneven_barriers")


def explain(ex: str, case: str, msg: str, kernel, grid, block, *args, shared: int = 0) -> str:
    """``msg`` (a failure the grader has already found) with what ``cb.trace`` of the same
    launch shows: who wrote an element twice, who read or wrote out of bounds, which thread
    read shared memory before the barrier. For failures only: it never passes or fails an
    answer, only explains one. ``msg`` comes back unchanged when the trace finds none of those
    or cannot run (more than ``EXPLAIN_THREADS`` threads, a kernel that raises, ...).

    A double write, a race or a read of shared memory nobody wrote is the cause, and the value
    check's guess can point elsewhere (a gap left by two blocks covering the same range looks
    like a grid too small; wrong values next to a racy halo look like a missing halo), so then
    only the symptom of ``msg`` (up to its first ": " after the case) is kept, before the
    trace's finding. An out-of-bounds access agrees with the guess (a bounds guard): kept."""
    from ..tracer import _short as short
    from ..tracer import trace

    try:
        t = trace(kernel, grid, block, *args, shared=shared, max_threads=EXPLAIN_THREADS,
                  timeout=_EXPLAIN_TIMEOUT)
        f = t.findings()
        found = [k for k in _EXPLAINING if getattr(f, k)]
        lines = f.messages(limit=2, only=found) if found else []
    except Exception:  # noqa: BLE001 - an explanation that cannot be made is left out
        return msg
    if not lines:
        return msg
    head, rest = f"{ex}: {case}: ", msg
    if msg.startswith(head) and found[0] in ("races", "uninitialized", "multiple_writes"):
        rest = msg[len(head):].split(": ")[0]
        msg = head + rest
    sep = " " if msg.endswith(("?", ".")) else "; "
    return (f"{msg}{sep}cb.trace of the launch {t.kernel}[{short(t.grid)}, {short(t.block)}] "
            f"shows why: {'; and '.join(lines)}")


class _Launch(BaseException):
    """Raised in place of the first kernel launch by ``first_launch`` (a BaseException, so an
    answer's own ``except Exception`` does not swallow it)."""


def first_launch(fn) -> tuple | None:
    """Run ``fn()`` (an answer's launcher) up to its first Numba kernel launch, which is not
    made: returns ``(kernel, grid, block, shared, args)``, or None when ``fn`` launched nothing
    (or failed before). For ``explain``: a launcher's kernel and grid are its own choice."""
    if env.SIM:
        from numba.cuda.simulator import kernel as simk

        cls, attr = simk.FakeCUDAKernel, "__call__"

        def catch(self, *a, **k):
            if self._device or getattr(simk, "_kernel_context", None) is not None:
                return orig(self, *a, **k)
            raise _Launch((self, self.grid_dim, self.block_dim, self.dynshared_size, a))
    else:
        from numba.cuda.dispatcher import CUDADispatcher as cls

        attr = "call"

        def catch(self, args, *rest, **k):
            lc = rest[0] if rest else k.get("launch_config")
            if hasattr(lc, "griddim"):                   # numba-cuda >= 0.2x: a config object
                g, b, sh = lc.griddim, lc.blockdim, lc.sharedmem
            else:                                        # call(args, griddim, blockdim, ...)
                g, b, sh = rest[0], rest[1], (rest[3] if len(rest) > 3 else 0)
            raise _Launch((self, g, b, sh, tuple(args)))
    orig = getattr(cls, attr)
    setattr(cls, attr, catch)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except _Launch as got:
        return got.args[0]
    except Exception:  # noqa: BLE001 - the answer failed before launching: nothing to trace
        return None
    finally:
        setattr(cls, attr, orig)
    return None

