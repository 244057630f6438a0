"""The tracing subprocess of ``cb.trace``: runs one kernel under the Numba CUDA simulator and
records every global, shared and constant-memory access of every thread.

Run as ``python -c "import runpy; runpy.run_path(THIS, run_name='__main__')" JOB RESULT``
(by path, not as ``cudabook._traceworker``, so the package and its GPU probe are not imported).
JOB is a pickle written by ``cudabook.tracer``; RESULT receives a pickle of plain data.
``build_functions`` (re-create the functions of a ``tracer.Shipment``) is also imported, as
``cudabook._traceworker``, by the simulator process of ``cudabook.graders._race.simulate``;
importing the module changes nothing: the patches and the simulator switch are in ``main``.

How the record is made (numba-cuda 0.22 to 0.30 simulator internals, all read-only here):

* every simulated CUDA thread is a ``BlockThread`` (a Python thread) carrying ``blockIdx``,
  ``threadIdx`` and ``thread_id`` (its linear index in the block); the patched ``__init__`` adds
  a barrier counter (the *phase*) that the patched ``syncthreads`` increments on the way out;
* array arguments are passed as ``Traced`` proxies (the simulator passes any object that is not
  an ``ndarray`` through unchanged); ``cuda.shared.array`` and ``cuda.const.array_like`` are
  patched to hand out proxies too, and ``cuda.atomic.*`` unwraps them and logs one atomic access;
* an access site is the source position of the subscript (line and columns, from the caller's
  bytecode offset): in effect an instruction. The k-th execution of a site by a thread has
  occurrence k, so the lanes of a warp with the same (site, k) form one warp-wide request.
"""

from __future__ import annotations

import builtins
import importlib
import itertools
import linecache
import operator
import os
import pickle
import re
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

READ, WRITE, ATOMIC = 0, 1, 2

LOG: list[tuple] = []        # (array, kind, flat index, block, thread, phase, site, occurrence)
OOB: list[tuple] = []        # (array, kind, index tuple, block, thread, phase, site, wrapped)
ARRAYS: list[dict] = []      # name, space, shape, dtype, base ndarray, line
SITES: dict = {}             # (code, lasti) and source position -> site id
SITE_INFO: list[tuple] = []  # (file, line, function, first column, end column)
THREADS: list = []           # every simulated thread, for the barrier counts
FILES: dict[str, str] = {}   # temp kernel file -> the file the source came from
STATE = {"max": 1_000_000, "over": False, "grid": (1, 1, 1)}
_lock = threading.Lock()


class TraceLimit(RuntimeError):
    pass


def _site(frame) -> int:
    key = (frame.f_code, frame.f_lasti)
    s = SITES.get(key)
    if s is None:
        with _lock:
            s = SITES.get(key)
            if s is None:
                s = SITES[key] = _site_of_position(frame)
    return s


def _site_of_position(frame) -> int:
    """Sites are source positions (line and columns of the subscript): Python 3.11+ moves
    ``f_lasti`` when it specialises an instruction, but the position stays."""
    code = frame.f_code
    pos: tuple = (frame.f_lineno,)
    if hasattr(code, "co_positions"):
        got = next(itertools.islice(code.co_positions(), frame.f_lasti // 2, None), None)
        if got and got[0] is not None:
            pos = got
    key = (code.co_filename, code.co_name, pos)
    s = SITES.get(key)
    if s is None:
        s = SITES[key] = len(SITE_INFO)
        cols = (pos[2], pos[3]) if len(pos) == 4 and pos[1] == pos[0] else (None, None)
        SITE_INFO.append((FILES.get(code.co_filename, code.co_filename), pos[0], code.co_name,
                          *cols))
    return s


def _who():
    t = threading.current_thread()
    blk = getattr(t, "_cb_block", None)
    if blk is None:     # an access from outside a kernel launch (should not happen)
        return None, 0, 0, 0
    return t, blk, t.thread_id, t._cb_phase


def _record(aid: int, kind: int, flat: int, frame) -> None:
    t, blk, tid, phase = _who()
    if t is None:
        return
    site = _site(frame)
    occ = t._cb_occ.get(site, 0)
    t._cb_occ[site] = occ + 1
    LOG.append((aid, kind, flat, blk, tid, phase, site, occ))
    if len(LOG) > STATE["max"]:
        STATE["over"] = True
        raise TraceLimit(f"more than {STATE['max']} memory accesses")


def _record_oob(aid: int, kind: int, idx: tuple, frame, wrapped: bool) -> None:
    t, blk, tid, phase = _who()
    if t is None:
        return
    OOB.append((aid, kind, idx, blk, tid, phase, _site(frame), wrapped))


def _as_index(k):
    """A tuple of ints, or None when ``k`` holds a slice, an array or fewer indices."""
    if not isinstance(k, tuple):
        k = (k,)
    out = []
    for v in k:
        try:
            out.append(operator.index(v))
        except TypeError:
            return None
    return tuple(out)


class Traced:
    """An array proxy that logs each element access with the thread that made it."""

    __slots__ = ("_a", "_aid", "_off", "_st", "shape", "ndim", "size", "dtype")

    def __init__(self, a: np.ndarray, aid: int, off: int = 0):
        self._a, self._aid, self._off = a, aid, off
        self._st = tuple(s // a.itemsize for s in a.strides)
        self.shape, self.ndim, self.size, self.dtype = a.shape, a.ndim, a.size, a.dtype

    def __len__(self):
        return self.shape[0]

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def T(self):   # noqa: N802 - numpy's name
        return self._view(self._a.T)

    def _view(self, sub: np.ndarray) -> Traced:
        base = ARRAYS[self._aid]["base"]
        off = (sub.__array_interface__["data"][0] - base.__array_interface__["data"][0])
        return Traced(sub, self._aid, off // base.itemsize)

    def _locate(self, idx, kind, frame):
        """(index into self._a, flat index into the base) or (None, None) when out of bounds."""
        if len(idx) != self.ndim:
            raise IndexError(f"{len(idx)} indices for a {self.ndim}-d array")
        fixed, wrapped = [], False
        for v, n in zip(idx, self.shape):
            if 0 <= v < n:
                fixed.append(v)
            elif -n <= v < 0:            # Numba wraps negative indices, as NumPy does
                fixed.append(v + n)
                wrapped = True
            else:
                _record_oob(self._aid, kind, idx, frame, False)
                return None, None
        if wrapped:
            _record_oob(self._aid, kind, idx, frame, True)
        fixed = tuple(fixed)
        return fixed, self._off + sum(v * s for v, s in zip(fixed, self._st))

    def __getitem__(self, k):
        idx = _as_index(k)
        if idx is None or len(idx) < self.ndim:
            return self._view(self._a[k])
        frame = sys._getframe(1)
        fixed, flat = self._locate(idx, READ, frame)
        if fixed is None:
            return np.array(np.nan if self.dtype.kind in "fc" else 0, self.dtype)[()]
        _record(self._aid, READ, flat, frame)
        return self._a[fixed]

    def __setitem__(self, k, v):
        idx = _as_index(k)
        if idx is None or len(idx) < self.ndim:
            raise TypeError("cb.trace: only single elements of an array can be assigned in a "
                            "traced kernel")
        frame = sys._getframe(1)
        fixed, flat = self._locate(idx, WRITE, frame)
        if fixed is None:
            return
        _record(self._aid, WRITE, flat, frame)
        self._a[fixed] = v


def _new_array(a: np.ndarray, name: str, space: str, line: int | None) -> Traced:
    names = {d["name"] for d in ARRAYS}
    base, i = name, 2
    while name in names:
        name, i = f"{base}_{i}", i + 1
    ARRAYS.append(dict(name=name, space=space, shape=a.shape, dtype=a.dtype.str, base=a,
                       line=line))
    return Traced(a, len(ARRAYS) - 1)


def _name_on_line(frame, what: str) -> tuple[str, int]:
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    m = re.match(r"\s*(\w+)\s*=\s*\w+\." + what, line)
    return (m.group(1) if m else f"{what.split('.')[0]}@{frame.f_lineno}"), frame.f_lineno


def _patch_simulator() -> None:
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernel as simk
    from numba.cuda.simulator import kernelapi as sima

    try:
        from numba.cuda import types as nbtypes
    except ImportError:  # pragma: no cover - older layouts
        from numba.core import types as nbtypes

    gx, gy, _ = STATE["grid"]
    init0, sync0 = simk.BlockThread.__init__, simk.BlockThread.syncthreads

    def init(self, *a, **kw):
        init0(self, *a, **kw)
        b = self.blockIdx
        self._cb_block = b.x + gx * (b.y + gy * b.z)
        self._cb_phase = 0
        self._cb_occ = {}
        THREADS.append(self)

    def syncthreads(self):
        sync0(self)
        self._cb_phase += 1

    simk.BlockThread.__init__ = init
    simk.BlockThread.syncthreads = syncthreads

    shared0 = sima.FakeCUDAShared.array

    def shared_array(self, shape, dtype, alignment=None):
        if isinstance(dtype, nbtypes.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        name, line = _name_on_line(frame, "shared.array")
        # dynamic shared memory (shape 0) is one buffer for every such call
        key = "dynamic" if shape == 0 else (frame.f_code.co_filename, frame.f_lineno)
        cache = self.__dict__.setdefault("_cb_arrays", {})
        with _lock:
            hit = cache.get(key)
            if hit is None:
                if shape == 0:
                    raw = shared0(self, 0, dtype)
                else:
                    raw = np.empty(shape, np.dtype(dtype))
                    raw[...] = np.nan if raw.dtype.kind in "fc" else 0
                hit = cache[key] = _new_array(raw, name, "shared", line)
        return hit

    def const_array_like(self, ary):
        frame = sys._getframe(1)
        key = (frame.f_code.co_filename, frame.f_lineno)
        cache = self.__dict__.setdefault("_cb_arrays", {})
        with _lock:
            hit = cache.get(key)
            if hit is None:
                name, line = _name_on_line(frame, "const.array_like")
                hit = cache[key] = _new_array(np.array(ary), name, "const", line)
        return hit

    sima.FakeCUDAShared.array = shared_array
    sima.FakeCUDAConst.array_like = const_array_like

    def atomic(name, fn):
        def wrapper(self, array, *rest):
            if not isinstance(array, Traced):
                return fn(self, array, *rest)
            idx = (0,) * array.ndim if name == "compare_and_swap" else _as_index(rest[0])
            frame = sys._getframe(1)
            fixed, flat = array._locate(idx, ATOMIC, frame)
            if fixed is None:
                return array.dtype.type(0)
            _record(array._aid, ATOMIC, flat, frame)
            if name == "compare_and_swap":
                return fn(self, array._a, *rest)
            return fn(self, array._a, fixed, *rest[1:])
        return wrapper

    for name, fn in list(vars(sima.FakeCUDAAtomic).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(sima.FakeCUDAAtomic, name, atomic(name, fn))


def build_functions(funcs: list[dict], namespaces: dict[int, dict], tmp: str,
                    cuda) -> tuple[dict[int, object], list[str]]:
    """Re-create the functions of a ``tracer.Shipment`` (its ``funcs`` and ``namespaces``):
    returns ({id: kernel, device function or Python function}, notes about globals that could
    not be sent). The sources are written to files in ``tmp`` (so ``inspect.getsource`` and
    tracebacks work while it exists); ``cuda`` is ``numba.cuda``. Also used by
    ``cudabook.graders._race`` to re-create an answer in the simulator."""
    spaces: dict[int, dict] = {}
    notes: list[str] = []
    for nsid, ns in namespaces.items():
        g = {"__name__": f"cbtrace_ns{nsid}", "__builtins__": builtins}
        for name, mod in ns["modules"].items():
            try:
                g[name] = importlib.import_module(mod)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name}: module {mod} does not import here ({e})")
        for name, blob in ns["values"].items():
            try:
                g[name] = pickle.loads(blob)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name}: {type(e).__name__}: {e}")
        notes += [f"{name}: {why}" for name, why in ns["missing"].items()]
        spaces[nsid] = g
    made = {}
    for f in funcs:     # dependencies first
        path = os.path.join(tmp, f"f{f['id']}_{f['name']}.py")
        with open(path, "w") as fh:
            fh.write(f["source"])
        FILES[path] = f["filename"]
        g = spaces[f["ns"]]
        exec(compile(f["source"], path, "exec"), g)  # noqa: S102
        py = g[f["name"]]
        made[f["id"]] = {"device": lambda p: cuda.jit(device=True)(p), "kernel": cuda.jit,
                         "python": lambda p: p}[f["kind"]](py)
        g[f["name"]] = made[f["id"]]
        for nsid, ns in namespaces.items():
            for name, fid in ns["funcs"].items():
                if fid == f["id"]:
                    spaces[nsid][name] = made[fid]
    return made, notes


def _error_text(e: BaseException, notes: list[str]) -> str:
    frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename in FILES]
    where = "".join(f"\n  {FILES[fr.filename]}, line {fr.lineno}, in {fr.name}: "
                    f"{(fr.line or '').strip()}" for fr in frames)
    msg = f"{e}{where}"
    if notes and isinstance(e, NameError):
        msg += "\n(globals of the kernel that could not be sent to the tracing process: " + \
               "; ".join(notes) + ")"
    return msg


def main(job_path: str, out_path: str) -> None:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"         # before numba.cuda is imported
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    with open(job_path, "rb") as fh:
        job = pickle.load(fh)
    STATE["max"], STATE["grid"] = job["max_accesses"], job["grid"]
    from numba import cuda

    _patch_simulator()
    result: dict = {"error": None}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cbtrace_") as tmp:
        notes: list[str] = []
        try:
            made, notes = build_functions(job["funcs"], job["namespaces"], tmp, cuda)
            kernel = made[job["kernel"]]
            args = []
            for kind, name, val in job["args"]:
                args.append(_new_array(val, name, "global", None) if kind == "array" else val)
            kernel[job["grid"], job["block"], 0, job["shared"]](*args)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            if STATE["over"]:
                result["error"] = ("limit", f"the kernel made more than {STATE['max']} memory "
                                   "accesses")
            else:
                result["error"] = (type(e).__name__, _error_text(e, notes))
    result["seconds"] = time.perf_counter() - t0
    result["log"] = np.array(LOG, dtype=np.int64).reshape(-1, 8)
    result["oob"] = OOB
    result["arrays"] = [dict(name=d["name"], space=d["space"], shape=d["shape"],
                             dtype=d["dtype"], line=d["line"],
                             after=d["base"] if d["space"] != "shared" else None)
                        for d in ARRAYS]
    result["sites"] = SITE_INFO
    result["barriers"] = [(t._cb_block, t.thread_id, t._cb_phase) for t in THREADS]
    with open(out_path, "wb") as fh:
        pickle.dump(result, fh, protocol=pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
