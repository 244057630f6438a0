"""``cb.trace``: run a Numba kernel on the CUDA simulator and record who touched what.

Every global, shared and constant-memory access of every thread is recorded with its index,
the thread that made it, the barrier phase it happened in (how many ``cuda.syncthreads()`` the
thread had passed) and the source line. The run happens in a subprocess under
``NUMBA_ENABLE_CUDASIM=1``, so it works on any machine, also next to a real GPU where
``numba.cuda`` is already in GPU mode. Sizes must stay small: a few blocks.

    import cudabook as cb
    from cudabook import tracedraw, tracemem

    t = cb.trace(vector_add_v1, 4, 64, x, y, z)     # grid, block, then the kernel's arguments
    t                                               # one line: kernel, launch, accesses, time
    t.findings().messages()                         # races, double writes, gaps, out of bounds
    tracedraw.writers(t, "z", by="block")           # the output coloured by who wrote it
    tracemem.summary(t)                             # sectors per warp load, bank conflicts

The arguments are the kernel's: NumPy arrays, CuPy / torch / Numba device arrays (copied to the
host, as C-contiguous arrays: addresses are those of a row-major layout) and scalars. They are
not modified: the values after the run are in ``t.array("z").after``. Arrays are named by the
kernel's parameters; shared arrays by the variable they are assigned to
(``tile = cuda.shared.array(...)`` is ``"tile"``).

How the kernel gets to the subprocess: its source (``inspect.getsource``) with the decorators
removed, re-decorated there with ``cuda.jit``; the globals and closure variables it reads are
sent by value (pickle), modules by name, and the device functions it calls the same way,
recursively. So kernels defined in a notebook cell, in ``kernels/*.py`` or inside a factory
function all work. Caveats: the source must be readable (not typed at a bare ``python``
prompt), a global that cannot be pickled is reported when the kernel reads it, and the kernel
sees the values of its globals at the time of the ``trace`` call.

What the simulator cannot show: warp shuffles and votes (it has none), timing, caches, the
order of threads within a phase (the record says which accesses are unordered, not which came
first), and local arrays (registers) are not recorded.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["trace", "Trace", "ArrayInfo", "Site", "TraceError", "MAX_THREADS", "MAX_ACCESSES",
           "READ", "WRITE", "ATOMIC"]

#: the default limits: a trace is for a few blocks, not a benchmark size
MAX_THREADS = 4096
MAX_ACCESSES = 1_000_000
READ, WRITE, ATOMIC = 0, 1, 2
KIND_NAMES = {READ: "read", WRITE: "write", ATOMIC: "atomic"}

_WORKER = Path(__file__).with_name("_traceworker.py")
_MAX_GLOBAL_BYTES = 64 << 20

#: the columns of ``Trace.acc``, one row per access
ACCESS_DTYPE = np.dtype([("array", np.int32), ("kind", np.int8), ("index", np.int64),
                         ("block", np.int32), ("thread", np.int32), ("phase", np.int32),
                         ("site", np.int32), ("occ", np.int32)])


class TraceError(RuntimeError):
    """The kernel could not be traced: too big, source unreadable, or it raised (message says
    where, with the kernel's file and line)."""


@dataclass
class ArrayInfo:
    """One array the kernel touched: an argument (``"global"``), a ``cuda.shared.array``
    (``"shared"``) or a ``cuda.const.array_like`` (``"const"``)."""

    id: int
    name: str
    space: str
    shape: tuple[int, ...]
    dtype: np.dtype
    line: int | None = None            # where a shared/const array is declared
    after: np.ndarray | None = None    # the values after the run (global and const)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def index(self, flat: int) -> tuple[int, ...]:
        """The element index of a flat (row-major) position."""
        return tuple(int(v) for v in np.unravel_index(int(flat), self.shape))

    def fmt(self, flat: int) -> str:
        """``out[7]`` or ``tile[3, 4]``."""
        return f"{self.name}[{', '.join(str(v) for v in self.index(flat))}]"


@dataclass
class Site:
    """Where an access is in the source: file, line, function and the line's text."""

    file: str
    line: int
    function: str
    text: str = ""
    col: int | None = None        # the subscript's columns on the line, where Python says
    end: int | None = None

    @property
    def expr(self) -> str:
        """The subscript itself (``a[r, c]``), or the whole line when columns are unknown."""
        if self.col is not None and self.end is not None and self.text:
            return self.text[self.col:self.end]
        return self.text.split("#")[0].strip()

    def __str__(self) -> str:
        return f"line {self.line}: {self.expr}" if self.text else f"line {self.line}"


@dataclass
class OutOfBounds:
    array: str
    kind: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    block: int
    thread: int
    phase: int
    site: Site
    wrapped: bool     # a negative index that Numba wrapped to the other end


@dataclass
class Trace:
    """The record of one traced launch. ``acc`` has one row per in-bounds access with the
    columns of ``ACCESS_DTYPE``: array id, kind (READ/WRITE/ATOMIC), flat row-major index into
    the array, linear block id, linear thread id in the block (x fastest, as ``thread_id``),
    phase (barriers passed), site id (``sites``) and occurrence (the k-th execution of that
    site by that thread; a warp's lanes with the same site and k form one memory request)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    arrays: list[ArrayInfo]
    acc: np.ndarray
    sites: list[Site]
    oob: list[OutOfBounds]
    barriers: np.ndarray            # (blocks, threads per block): barriers each thread passed
    seconds: float
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ launch geometry
    @property
    def nblocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def nthreads(self) -> int:
        """Threads per block."""
        return self.block[0] * self.block[1] * self.block[2]

    def gid(self, block, thread) -> Any:
        """Global linear thread id: ``block * threads_per_block + thread`` (arrays work too).
        In a 1D launch this is ``cuda.grid(1)``."""
        return np.asarray(block) * self.nthreads + np.asarray(thread)

    def block_index(self, block: int) -> tuple[int, int, int]:
        gx, gy, _ = self.grid
        return block % gx, (block // gx) % gy, block // (gx * gy)

    def thread_index(self, thread: int) -> tuple[int, int, int]:
        bx, by, _ = self.block
        return thread % bx, (thread // bx) % by, thread // (bx * by)

    def who(self, block: int, thread: int) -> str:
        """``thread 263 (block 1, thread 7)``, or with (x, y) indices in a 2D launch."""
        if self.grid[1:] == (1, 1) and self.block[1:] == (1, 1):
            return f"thread {int(self.gid(block, thread))} (block {block}, thread {thread})"
        bi, ti = self.block_index(block), self.thread_index(thread)
        nd = 3 if (self.grid[2] > 1 or self.block[2] > 1) else 2
        return f"thread {tuple(ti[:nd])} of block {tuple(bi[:nd])}"

    # ------------------------------------------------------------------ queries
    def array(self, name: str) -> ArrayInfo:
        for a in self.arrays:
            if a.name == name:
                return a
        raise KeyError(f"{self.kernel} touched no array called {name!r}; it has "
                       f"{[a.name for a in self.arrays]}")

    def accesses(self, name: str | None = None, kind: int | str | None = None, *,
                 block: int | None = None, phase: int | None = None) -> np.ndarray:
        """The rows of ``acc`` for one array (and kind, block, phase), in record order."""
        m = np.ones(len(self.acc), bool)
        if name is not None:
            m &= self.acc["array"] == self.array(name).id
        if kind is not None:
            k = {v: k for k, v in KIND_NAMES.items()}[kind] if isinstance(kind, str) else kind
            m &= self.acc["kind"] == k
        if block is not None:
            m &= self.acc["block"] == block
        if phase is not None:
            m &= self.acc["phase"] == phase
        return self.acc[m]

    def counts(self, name: str, kind: int | str = WRITE, *, block: int | None = None,
               phase: int | None = None) -> np.ndarray:
        """How many times each element was accessed (array of the array's shape)."""
        a = self.array(name)
        r = self.accesses(name, kind, block=block, phase=phase)
        return np.bincount(r["index"], minlength=a.size).reshape(a.shape)

    def writer(self, name: str, by: str = "thread", *, block: int | None = None,
               phase: int | None = None) -> np.ndarray:
        """Per element, who wrote it last (-1: never): ``by`` is "thread" (global id),
        "block", "warp" (global warp id: block * warps per block + warp), "lane", "local"
        (thread id within its block) or "local_warp" (warp within its block)."""
        a = self.array(name)
        r = self.accesses(name, None, block=block, phase=phase)
        r = r[r["kind"] != READ]
        who = self._by(r, by)
        out = np.full(a.size, -1, np.int64)
        out[r["index"]] = who          # later rows win: the last writer in record order
        return out.reshape(a.shape)

    def _by(self, r: np.ndarray, by: str) -> np.ndarray:
        wpb = -(-self.nthreads // 32)
        return {"thread": lambda: self.gid(r["block"], r["thread"]),
                "block": lambda: r["block"].astype(np.int64),
                "warp": lambda: r["block"].astype(np.int64) * wpb + r["thread"] // 32,
                "lane": lambda: r["thread"].astype(np.int64) % 32,
                "local": lambda: r["thread"].astype(np.int64),
                "local_warp": lambda: r["thread"].astype(np.int64) // 32,
                "phase": lambda: r["phase"].astype(np.int64)}[by]()

    def findings(self, outputs: list[str] | None = None):
        """Races, double writes, gaps, out-of-bounds accesses: a ``tracefind.Findings``.
        ``outputs``: the arrays checked for elements never written (default: every global
        array the kernel writes)."""
        from .tracefind import analyse

        return analyse(self, outputs)

    def __repr__(self) -> str:
        ev = len(self.acc)
        return (f"<Trace {self.kernel}[grid {_short(self.grid)}, block {_short(self.block)}]: "
                f"{self.nblocks * self.nthreads} threads, {ev} accesses to "
                f"{', '.join(a.name for a in self.arrays)}; {self.seconds:.2f} s>")


def _short(d: tuple[int, ...]) -> str:
    d = tuple(d)
    while len(d) > 1 and d[-1] == 1:
        d = d[:-1]
    return str(d[0]) if len(d) == 1 else str(d)


# ============================================================================ shipping the kernel
def _py_func(obj) -> types.FunctionType | None:
    f = getattr(obj, "py_func", None)
    return f if isinstance(f, types.FunctionType) else None


def _is_device(obj) -> bool:
    if hasattr(obj, "_device"):                       # the simulator's FakeCUDAKernel
        return bool(obj._device)
    return bool(getattr(obj, "targetoptions", {}).get("device", False))


def _global_names(code: types.CodeType) -> set[str]:
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _source(py: types.FunctionType) -> str:
    """The function's source with its decorators blanked and its lines where they were."""
    try:
        lines, first = inspect.getsourcelines(py)
    except (OSError, TypeError) as e:
        raise TraceError(f"cb.trace: cannot read the source of {py.__name__} (defined in "
                         f"{py.__code__.co_filename}): define the kernel in a file or a "
                         f"notebook cell ({e})") from None
    src = textwrap.dedent("".join(lines))
    import ast

    node = ast.parse(src).body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TraceError(f"cb.trace: the source of {py.__name__} is not a def statement")
    out = src.splitlines()
    for d in node.decorator_list:
        for i in range(d.lineno - 1, d.end_lineno):
            out[i] = ""
    # a decorator spanning the lines before `def` (e.g. `@cuda.jit(` ... `)`) is blank now
    for i in range(node.lineno - 1):
        if out[i].lstrip().startswith("@") or not out[i].strip():
            out[i] = ""
    return "\n" * (first - 1) + "\n".join(out) + "\n"


class Shipment:
    """What a fresh Python process needs to re-create some functions: their sources and the
    globals they read. The one way the book sends code to another process: ``cb.trace`` sends
    a kernel to the tracing process, ``graders._race.simulate`` an answer to the simulator.

    ``add(obj)`` takes a Numba kernel or device function (GPU or simulator mode) or a plain
    Python function and returns its id. Its source travels with the decorators removed (a
    Numba function is re-decorated there with ``cuda.jit``, ``device=True`` where it was); the
    globals and closure variables it reads travel by value (pickle; GPU arrays as NumPy
    arrays), modules by name, and the functions it calls the same way, recursively: Numba
    functions and functions defined in a notebook or ``kernels/`` by source, functions of an
    importable module by reference. What cannot be sent is listed in ``missing()``.
    ``_traceworker.build_functions`` re-creates everything on the other side.
    """

    def __init__(self) -> None:
        self.funcs: list[dict] = []
        self.ids: dict[int, int] = {}
        self.namespaces: dict[int, dict] = {}
        self._ns_of: dict[int, int] = {}

    def _namespace(self, py: types.FunctionType) -> int:
        key = id(py.__globals__)
        if py.__closure__:       # closure values shadow globals: a namespace of its own
            key = id(py)
        if key not in self._ns_of:
            self._ns_of[key] = len(self.namespaces)
            self.namespaces[self._ns_of[key]] = dict(values={}, modules={}, funcs={},
                                                     missing={})
        return self._ns_of[key]

    def add(self, obj) -> int:
        """Ship ``obj`` (a Numba function or a plain Python function); returns its id."""
        py = _py_func(obj)
        kind = ("device" if _is_device(obj) else "kernel") if py is not None else "python"
        if py is None and isinstance(obj, types.FunctionType):
            py = obj
        if py is None:
            raise TraceError(f"{obj!r} is not a Numba @cuda.jit function or a Python function")
        if id(py) in self.ids:
            return self.ids[id(py)]
        src = _source(py)                 # before any id is taken: a TraceError leaves no trace
        fid = len(self.ids)
        self.ids[id(py)] = fid
        nsid = self._namespace(py)
        ns = self.namespaces[nsid]
        refs = {n: py.__globals__[n] for n in _global_names(py.__code__) if n in py.__globals__}
        for name, cell in zip(py.__code__.co_freevars, py.__closure__ or ()):
            try:
                refs[name] = cell.cell_contents
            except ValueError:
                ns["missing"][name] = "closure variable not set yet"
        for name, val in refs.items():
            self._classify(ns, name, val)
        self.funcs.append(dict(id=fid, name=py.__name__, source=src, ns=nsid,
                               filename=py.__code__.co_filename, kind=kind))
        return fid

    def missing(self) -> list[str]:
        """``name: why`` for every global that could not be sent."""
        return [f"{n}: {why}" for ns in self.namespaces.values()
                for n, why in ns["missing"].items()]

    def _classify(self, ns: dict, name: str, val) -> None:
        if isinstance(val, types.ModuleType):
            ns["modules"][name] = val.__name__
            return
        if _py_func(val) is not None and type(val).__module__.startswith("numba"):
            ns["funcs"][name] = self.add(val)     # a device function or kernel: its source too
            return
        if isinstance(val, types.FunctionType) and not _importable(val):
            try:
                ns["funcs"][name] = self.add(val)  # defined in a notebook or kernels/: source
                return
            except TraceError:
                pass                               # a lambda: pickle decides below
        if hasattr(val, "__cuda_array_interface__") or \
                type(val).__module__.startswith(("torch", "cupy")):
            from .check import to_numpy

            val = np.array(to_numpy(val))          # the other process has no GPU arrays
        try:
            blob = pickle.dumps(val, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            ns["missing"][name] = f"{type(val).__name__} cannot be pickled ({e})"
            return
        if len(blob) > _MAX_GLOBAL_BYTES:
            ns["missing"][name] = f"{len(blob) >> 20} MiB is too big to send"
            return
        ns["values"][name] = blob


def _importable(fn: types.FunctionType) -> bool:
    """A function that a fresh process can import by name (pickle sends it by reference):
    not defined in a notebook, a solution cell or a ``kernels/`` file loaded by path."""
    mod = sys.modules.get(fn.__module__ or "")
    return (mod is not None and getattr(mod, "__file__", None) is not None and
            not fn.__module__.startswith(("__main__", "cudabook.kernels")) and
            getattr(mod, fn.__qualname__, None) is fn)


# ============================================================================ launch
def _dim3(d, what: str) -> tuple[int, int, int]:
    if isinstance(d, (int, np.integer)):
        d = (int(d),)
    d = tuple(int(v) for v in d)
    if not 1 <= len(d) <= 3 or any(v < 1 for v in d):
        raise ValueError(f"cb.trace: {what} must be 1 to 3 positive ints, got {d}")
    return d + (1,) * (3 - len(d))


def _host(a):
    if isinstance(a, (bool, int, float, complex, np.generic)):
        return "value", a
    from .check import to_numpy

    if isinstance(a, np.ndarray) or hasattr(a, "__cuda_array_interface__") or \
            hasattr(a, "copy_to_host") or type(a).__module__.startswith(("torch", "cupy")):
        h = np.array(to_numpy(a), copy=True, order="C")   # flat indices are row-major
        if h.ndim == 0:
            return "value", h[()]
        return "array", h
    return "value", a


def trace(kernel, grid, block, *args, shared: int = 0, max_threads: int = MAX_THREADS,
          max_accesses: int = MAX_ACCESSES, timeout: float = 300.0) -> Trace:
    """Launch ``kernel[grid, block, 0, shared](*args)`` on the CUDA simulator in a subprocess
    and return the record of every memory access (a ``Trace``).

    ``kernel``: a Numba ``@cuda.jit`` kernel (GPU or simulator mode, from a file or a notebook
    cell). ``grid`` and ``block``: ints or tuples, as in a launch. ``shared``: dynamic shared
    memory in bytes. Refuses launches of more than ``max_threads`` threads (default 4096: a few
    blocks) and stops a kernel after ``max_accesses`` accesses. Raises ``TraceError`` when the
    kernel cannot be traced, and the kernel's own exception type (``NotImplementedError``,
    ``ZeroDivisionError``, ...) with its file and line when it raises one.
    """
    g, b = _dim3(grid, "grid"), _dim3(block, "block")
    total = int(np.prod(g)) * int(np.prod(b))
    if total > max_threads:
        raise TraceError(
            f"cb.trace: grid {_short(g)} x block {_short(b)} = {total} threads; a trace records "
            f"every access of every thread on the CPU, so it is limited to {max_threads} "
            "threads (a few blocks): shrink the problem (the pattern is the same at a small "
            "size), or pass max_threads= if you must.")
    if int(np.prod(b)) > 1024:
        raise TraceError(f"cb.trace: a block has at most 1024 threads, got {_short(b)}")
    py = _py_func(kernel)
    if py is None:
        raise TraceError(f"cb.trace: {kernel!r} is not a Numba @cuda.jit kernel (pass the "
                         "kernel itself, not kernel[grid, block])")
    params = list(inspect.signature(py).parameters)
    if len(args) != len(params):
        raise TraceError(f"cb.trace: {py.__name__}({', '.join(params)}) takes {len(params)} "
                         f"arguments, got {len(args)}")
    sh = Shipment()
    kid = sh.add(kernel)
    job_args = [(kind, n, val) for n, (kind, val) in zip(params, map(_host, args))]
    job = dict(funcs=sh.funcs, namespaces=sh.namespaces, kernel=kid, grid=g, block=b,
               shared=int(shared), args=job_args, max_accesses=int(max_accesses))
    res = _run(job, timeout, py.__name__)
    return _assemble(res, py.__name__, g, b, sh)


def _run(job: dict, timeout: float, name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="cbtrace_") as tmp:
        jp, rp = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.pkl")
        with open(jp, "wb") as fh:
            pickle.dump(job, fh, protocol=pickle.HIGHEST_PROTOCOL)
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        cmd = [sys.executable, "-c", "import runpy, sys; "
               f"runpy.run_path({str(_WORKER)!r}, run_name='__main__')", jp, rp]
        try:
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TraceError(f"cb.trace: {name} ran longer than {timeout:.0f} s in the simulator"
                             ": make the problem smaller (or pass timeout=)") from None
        if p.returncode != 0 or not os.path.exists(rp):
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-12:])
            raise TraceError(f"cb.trace: the tracing process failed (exit {p.returncode}):\n"
                             f"{tail}")
        with open(rp, "rb") as fh:
            res = pickle.load(fh)
    if res["error"] is not None:
        kind, msg = res["error"]
        if kind == "limit":
            raise TraceError(f"cb.trace: {name}: {msg}; shrink the problem or pass "
                             "max_accesses=")
        exc = getattr(builtins, kind, None)
        text = f"{name} raised {kind} in the simulator: {msg}"
        if isinstance(exc, type) and issubclass(exc, Exception) and exc is not TraceError:
            try:
                err = exc(text)
            except Exception:  # noqa: BLE001 - an exception type with another signature
                err = TraceError(text)
        else:
            err = TraceError(text)
        raise err
    return res


def _assemble(res: dict, name: str, g, b, sh: Shipment) -> Trace:
    arrays = [ArrayInfo(id=i, name=d["name"], space=d["space"], shape=tuple(d["shape"]),
                        dtype=np.dtype(d["dtype"]), line=d["line"], after=d["after"])
              for i, d in enumerate(res["arrays"])]
    log = res["log"]
    acc = np.empty(len(log), ACCESS_DTYPE)
    for j, col in enumerate(ACCESS_DTYPE.names):
        acc[col] = log[:, j]
    srcs = {(f["filename"], f["name"]): f["source"].splitlines() for f in sh.funcs}
    sites = []
    for file, line, fn, col, end in res["sites"]:
        lines = srcs.get((file, fn), [])
        text = lines[line - 1] if 0 < line <= len(lines) else ""
        sites.append(Site(file, line, fn, text, col, end))
    nb, nt = int(np.prod(g)), int(np.prod(b))
    barriers = np.zeros((nb, nt), np.int32)
    for blk, tid, ph in res["barriers"]:
        barriers[blk, tid] = ph
    oob = [OutOfBounds(arrays[a].name, KIND_NAMES[k], tuple(int(v) for v in idx),
                       arrays[a].shape, blk, tid, ph, sites[s], wr)
           for a, k, idx, blk, tid, ph, s, wr in res["oob"]]
    return Trace(name, g, b, arrays, acc, sites, oob, barriers, res["seconds"])

