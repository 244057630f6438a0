"""Races the GPU hides: a second opinion on answers that use shared memory.

A kernel with a missing or misplaced barrier often computes the right numbers on a real GPU
(the warps happen to run in a friendly order), so the value checks pass. Two checks run the
submitted code again, in a subprocess, at small sizes that still cover the edge tiles, and
turn a hazard into a GradeError that says which check caught it:

* ``racecheck(ex, src, kernel, driver)`` (CUDA C++, GPU): three compute-sanitizer tools run
  ``driver(kernel)`` (a module-level function ``"package.module:function"`` that launches the
  compiled kernel a few times, with CuPy's memory pool off so that every buffer is a fresh
  allocation), side by side, one process each:

  - ``--tool racecheck``: shared-memory hazards (a missing or misplaced barrier);
  - ``--tool synccheck``: a ``__syncthreads()`` that only some threads of a block reach (a
    barrier inside ``if (threadIdx.x < 16)``, or after an early return);
  - ``--tool initcheck``: reads of memory no thread or copy ever wrote. Plain initcheck watches
    global memory only, where the graders' NaN-filled outputs already expose a read of an
    unwritten output; a kernel that reads a *shared* element it never wrote (an edge tile's
    skipped load) is invisible to racecheck (no second access to conflict with) and to
    memcheck (the address is inside the array). compute-sanitizer 2025.4 (CUDA 13.1) added
    ``--initcheck-address-space shared|global|all``, which catches exactly that read; it is
    passed (``all``) where the installed tool has it, and where it has not, the check covers
    global memory and says so (``sanitizer_notes()``). With compute-sanitizer 2025.3 (CUDA
    13.0) no tool reports such a read: racecheck, initcheck and synccheck were all silent on
    ex02.1's transpose reading its tile's padding column (tests/test_trace.py).
    synccheck reports a barrier inside ``if (threadIdx.x < 16)`` as "Divergent thread(s) in
    warp" and stops the kernel (the driver then fails with a launch failure, which is why a
    finding is read before the run's own success).

  Only findings in the answer's own kernel count (CuPy's kernels of the driver are not the
  reader's). The first finding, in the order synccheck, racecheck, initcheck (a barrier that
  some threads skip also makes races), becomes the GradeError, naming the tool and the likely
  mistake;
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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from functools import lru_cache
from pathlib import Path

from .. import env
from ._core import GradeError

__all__ = ["racecheck", "simulate", "explain", "first_launch", "STRICT_ENV", "ENABLE_ENV",
           "EXPLAIN_THREADS", "TOOLS", "HINTS", "sanitizer_notes", "findings"]

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
#: the compute-sanitizer tools ``racecheck`` runs, in the order their findings are reported
TOOLS = ("synccheck", "racecheck", "initcheck")

#: the likely mistake behind each kind of finding (a grader may pass its own in ``hints``)
HINTS = {
    "synccheck": ("every thread of the block must reach every __syncthreads(): a barrier inside "
                  "a branch that depends on the thread (if (threadIdx.x < 16) ..., or after an "
                  "early return) is reached by some threads only. Keep the barrier outside the "
                  "branch and guard only the work"),
    "initcheck shared": ("a thread reads a shared-memory element that no thread wrote: an edge "
                         "tile whose loads were skipped instead of writing a zero, or a read "
                         "past the part of the array the block fills?"),
    "initcheck global": ("the kernel reads global memory nobody wrote: an output used before "
                         "it is written (C += ... on an output that was never zeroed)?"),
}

#: a finding's first line, per tool (the racecheck lines are those of ``_hazards``)
_FINDING = {
    "synccheck": re.compile(r"Barrier error|Divergent thread"),
    "initcheck": re.compile(r"Uninitiali[sz]ed __(\w+)__ memory (?:read|access)"),
}
_SHARED_SPACE = "--initcheck-address-space"


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.isfile(p)), None)


@lru_cache(maxsize=None)
def _help(tool: str) -> str:
    """``compute-sanitizer --help`` (the options this version has)."""
    try:
        r = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout + r.stderr


def sanitizer_notes() -> list[str]:
    """What the installed compute-sanitizer cannot check (empty where it checks everything)."""
    tool = _sanitizer()
    if tool is None:
        return ["compute-sanitizer is not installed: no sanitizer checks"]
    if _SHARED_SPACE not in _help(tool):
        return ["this compute-sanitizer has no --initcheck-address-space (2025.4, CUDA 13.1, "
                "added it): initcheck covers global memory only, so a read of shared memory "
                "no thread wrote goes unseen"]
    return []


def _command(tool: str, which: str, child: list[str]) -> list[str]:
    cmd = [tool, "--tool", which, "--error-exitcode", str(_HAZARD_EXIT)]
    if which == "racecheck":
        cmd += ["--racecheck-report", "hazard"]
    if which == "initcheck" and _SHARED_SPACE in _help(tool):
        cmd += [_SHARED_SPACE, "all"]
    return cmd + child


def _hazards(out: str) -> list[str]:
    return [ln.split("=========", 1)[-1].strip() for ln in out.splitlines()
            if "Race reported" in ln or "Potential RAW" in ln or "Potential WAR" in ln
            or "Potential WAW" in ln]


def findings(which: str, out: str, kernels: list[str]) -> list[str]:
    """The findings of ``which`` (synccheck or initcheck) in its output ``out`` that lie in one
    of ``kernels``: each as its first line and the line that names the place. A report names
    the function on one of the lines after its first ("at 0x1a0 in kernel" or "at
    kernel+0x1a0"); findings in other kernels (CuPy's, while the driver made its inputs) and
    in host API calls are left out."""
    lines = [ln.split("=========", 1)[-1].strip() if "=========" in ln else ln.strip()
             for ln in out.splitlines()]
    pat = _FINDING[which]
    names = [re.compile(rf"(?<![\w$]){re.escape(k)}(?![\w$])") for k in kernels]
    got = []
    for i, ln in enumerate(lines):
        if not pat.search(ln):
            continue
        where = []
        for nxt in lines[i + 1:i + 6]:
            if not nxt or pat.search(nxt) or nxt.startswith("ERROR SUMMARY"):
                break
            where.append(nxt)
        place = next((w for w in where if any(n.search(w) for n in names)), None)
        if place is not None or any(n.search(ln) for n in names):
            got.append(f"{ln} {place}" if place else ln)
    return got


def _message(ex: str, which: str, found: list[str], hint: str, hints: dict) -> str:
    first = found[0]
    if which == "racecheck":
        return (f"{ex}: the results were right on this GPU, but compute-sanitizer racecheck "
                f"found a race on shared memory ({first}): {hint}")
    n = f"{len(found)} report{'s' if len(found) != 1 else ''}, the first: {first}"
    if which == "synccheck":
        return (f"{ex}: compute-sanitizer synccheck found a barrier that not every thread of "
                f"the block reaches ({n}): {hints['synccheck']}")
    space = "shared" if "__shared__" in first else "global"
    return (f"{ex}: compute-sanitizer initcheck found a read of {space} memory that was never "
            f"written ({n}): {hints[f'initcheck {space}']}")


def racecheck(ex: str, src: str, kernel: str, driver: str, hint: str, *,
              tools: tuple[str, ...] = TOOLS, hints: dict | None = None,
              options: tuple[str, ...] = ()) -> None:
    """Run ``driver(compiled kernel)`` under compute-sanitizer: racecheck, synccheck and
    initcheck side by side (``tools``), one process each; GradeError on the first finding.

    ``hint`` says what to look for (which barrier) when racecheck finds a race in the kernel
    of this exercise; ``hints`` replaces entries of ``HINTS`` for the other tools. ``kernel``
    may name several kernels of the source, comma-separated: ``driver`` then receives them all,
    in that order. ``options``: NVRTC options of the compile (``-arch=sm_90a`` for wgmma).
    """
    if not env.HAS_GPU or not _enabled():
        return
    tool = _sanitizer()
    if tool is None:
        return _skip(ex, "compute-sanitizer is not installed")
    hints = {**HINTS, **(hints or {})}
    names = [k.strip() for k in kernel.split(",") if k.strip()]
    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
        f.write(src)
        path = f.name
    child = [sys.executable, "-c", "import sys; from cudabook.graders._race import "
             "_racecheck_child; _racecheck_child(*sys.argv[1:])", ex, path, kernel, driver,
             json.dumps(list(options))]
    problems = []
    with tempfile.TemporaryDirectory(prefix="cbsan_") as tmp:
        runs = {}
        try:
            for which in tools:   # side by side: the lane waits for the slowest, not the sum
                with open(os.path.join(tmp, which), "w") as log:
                    runs[which] = subprocess.Popen(_command(tool, which, child), stdout=log,
                                                   stderr=subprocess.STDOUT, text=True,
                                                   env=_child_env(), start_new_session=True)
            deadline = time.monotonic() + _TIMEOUT
            for which, p in runs.items():      # in the order of ``tools``: the first finding
                try:                           # is reported, the other runs are stopped
                    rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rc = None
                out = Path(tmp, which).read_text(errors="replace")
                found = (_hazards(out) or (["a shared-memory hazard"] if rc == _HAZARD_EXIT
                                           else [])
                         if which == "racecheck" else findings(which, out, names))
                if found:
                    raise GradeError(_message(ex, which, found, hint, hints))
                if rc is None:
                    problems.append(f"{which} took longer than {_TIMEOUT} s")
                elif _last_json(out) is None or (rc != 0 and which == "racecheck"):
                    tail = (out.strip().splitlines() or ["no output"])[-1]
                    problems.append(f"{which} run failed: {tail}")
        finally:
            for p in runs.values():    # the sanitizer and the Python it runs: one group each
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            os.unlink(path)
    if problems:
        return _skip(ex, "; ".join(problems))
    return None


def _racecheck_child(ex: str, path: str, kernel: str, driver: str, options: str = "[]") -> None:
    """Subprocess entry under compute-sanitizer: compile, launch through ``driver`` with CuPy's
    memory pool off (a pooled buffer reuses memory an earlier array wrote, which would hide a
    read of an output nobody wrote from initcheck)."""
    import importlib

    import cupy

    from ._core import compile_kernel

    cupy.cuda.set_allocator(None)
    src = Path(path).read_text()
    ks = [compile_kernel(ex, src, k.strip(), tuple(json.loads(options)))
          for k in kernel.split(",") if k.strip()]
    mod, func = driver.split(":")
    getattr(importlib.import_module(mod), func)(*ks)
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

