"""Static checks of a submitted answer's source, proof against comments and strings.

A rubric such as "uses a warp shuffle" or "calls cuda.syncthreads()" is checked on the code
with comments and string literals removed, so a comment that mentions ``__shfl`` or a docstring
that says ``syncthreads`` satisfies nothing. One helper per language:

    code = cuda_code(src)                 # CUDA C++ source string -> code without comments
    code = python_code(ex, kernel)        # Numba kernel or Python function -> its code
    calls(code, "__syncthreads")          # how many times a function is called
    mentions(code, "__shared__")          # the word appears in the code
    foreign_calls(ex, kernel)             # NumPy, PyTorch, @ ... in a Numba kernel (simulator-only)
    cuda_ptx(ex, src, "compute_80")       # what NVRTC compiles the source to (no GPU needed)
    ptx_instructions(ex, ptx, "kernel")   # the instructions the compiler kept for one kernel

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

__all__ = ["cuda_code", "python_code", "calls", "mentions", "refuse_stub", "foreign_calls",
           "cuda_ptx", "ptx_instructions", "thread_divergent_barriers", "refuse_library",
           "whole_array_ops", "kernel_not_gpu_code", "refuse_host_code", "python_tree"]


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


def python_tree(ex: str, obj):
    """The ``ast.FunctionDef`` of a Python function or Numba kernel, parsed from its source.
    Comments are not in the tree, and a string is a ``Constant`` (a docstring that says
    ``astype(np.float16)`` calls nothing), so rules read from the tree are proof against both;
    unlike ``python_code``, string arguments such as ``astype("float16")`` keep their text.
    Raises GradeError when the source cannot be read or holds no function definition."""
    import ast

    src = _source(obj)
    if src is None:
        python_code(ex, obj)                  # raises the message about exec
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise GradeError(f"{ex}: cannot parse the source of {getattr(obj, '__name__', obj)!r} "
                         f"({e.msg})") from None
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))), None)
    if fn is None:
        raise GradeError(f"{ex}: {getattr(obj, '__name__', obj)!r} is not a function defined "
                         "with def (a lambda cannot be checked); write it with def")
    return fn


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



_NUMPY_OK = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                       "uint8", "uint16", "uint32", "uint64", "bool_", "inf", "nan", "pi", "e"})
#: Python builtins that Numba's CUDA target compiles
_BUILTINS_OK = frozenset({"abs", "bool", "complex", "enumerate", "float", "int", "len", "max",
                          "min", "print", "range", "round", "zip", "slice"})
#: array methods and attributes of NumPy's arrays (the simulator's), not of device arrays
_ARRAY_METHODS = frozenset({"sum", "dot", "max", "min", "mean", "std", "var", "argmax",
                            "argmin", "exp", "log", "transpose", "reshape", "copy", "astype",
                            "cumsum", "tolist", "item", "clip", "prod", "all", "any", "sort",
                            "argsort", "matmul", "T"})
#: modules a kernel may use freely
_MODULES_OK = frozenset({"math", "cmath", "numba"})
_LIBRARY_NAMES = {"numpy": "NumPy", "torch": "PyTorch", "cupy": "CuPy", "scipy": "SciPy",
                  "jax": "JAX", "tensorflow": "TensorFlow", "cudabook": "the book's helpers"}


def _resolve(py, name: str):
    """(found, value) of a free name of ``py``: closure, then globals, then builtins."""
    import builtins

    if name in py.__code__.co_freevars and py.__closure__:
        cell = py.__closure__[py.__code__.co_freevars.index(name)]
        try:
            return True, cell.cell_contents
        except ValueError:
            return False, None
    if name in py.__globals__:
        return True, py.__globals__[name]
    if hasattr(builtins, name):
        return True, getattr(builtins, name)
    return False, None


def _library(value) -> str | None:
    """The library a module, function or object belongs to, when it is not GPU code."""
    mod = value.__name__ if inspect.ismodule(value) else (
        getattr(value, "__module__", None) or type(value).__module__ or "")
    return _LIBRARY_NAMES.get(str(mod).split(".")[0])


def foreign_calls(ex: str, kernel) -> list[str]:
    """What a Numba kernel does that is no GPU code, each as ``"line N: what"``: NumPy (beyond
    its scalar types, constants and ufuncs such as ``np.exp``), PyTorch, CuPy or SciPy, the
    ``@`` operator, array methods (``x.sum()``, ``x.T``), imports, plain Python functions (not
    ``@cuda.jit(device=True)``) and builtins that Numba's CUDA target does not compile
    (``sum``, ``sorted``).

    The CUDA simulator runs a kernel as Python, so all of these work there: an answer that
    hands the work to a library passes a value check in the simulator and fails to compile on a
    GPU. Empty list: none found. Raises GradeError when the source cannot be read
    (``python_code``)."""
    import ast

    py = getattr(kernel, "py_func", kernel)
    tree = ast.parse(python_code(ex, kernel))
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))), None)
    if fn is None or not hasattr(py, "__code__"):
        return []
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            local.add(n.id)
    found: list[str] = []

    def add(node, what: str) -> None:
        item = f"line {node.lineno}: {what}"
        if item not in found:
            found.append(item)

    body = [n for stmt in fn.body for n in ast.walk(stmt)]
    for n in body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            add(n, "an import inside the kernel")
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
            add(n, "the @ operator (a matrix product of whole arrays)")
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                and n.value.id not in local:
            ok, val = _resolve(py, n.value.id)
            if ok and inspect.ismodule(val):
                root = val.__name__.split(".")[0]
                if root == "numpy" and n.attr not in _NUMPY_OK \
                        and type(getattr(val, n.attr, None)).__name__ != "ufunc":
                    add(n, f"{n.value.id}.{n.attr} (NumPy)")
                elif root not in _MODULES_OK and root != "numpy":
                    lib = _LIBRARY_NAMES.get(root, f"the module {val.__name__}")
                    add(n, f"{n.value.id}.{n.attr} ({lib})")
            elif n.attr in _ARRAY_METHODS:
                add(n, f"{n.value.id}.{n.attr} (an array method of NumPy)")
        elif isinstance(n, ast.Attribute) and n.attr in _ARRAY_METHODS:
            add(n, f".{n.attr} (an array method of NumPy)")
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
            ok, val = _resolve(py, n.id)
            if not ok or inspect.ismodule(val) or hasattr(val, "py_func"):
                continue                      # modules: judged by their attributes above
            lib = _library(val) if callable(val) else None    # constants are fine
            if lib == "NumPy" and (n.id in _NUMPY_OK or type(val).__name__ == "ufunc"):
                lib = None                    # a scalar type or a ufunc: Numba compiles them
            if lib:
                add(n, f"{n.id} ({lib})")
            elif inspect.isbuiltin(val) and getattr(val, "__module__", "") == "builtins" \
                    and n.id not in _BUILTINS_OK:
                add(n, f"Python's {n.id}()")
            elif inspect.isfunction(val):
                add(n, f"{n.id}, a plain Python function (a GPU calls only "
                       "@cuda.jit(device=True) functions)")
    return found


def cuda_ptx(ex: str, src: str, arch: str = "compute_75",
             options: tuple[str, ...] = ()) -> str | None:
    """The PTX NVRTC makes of a CUDA C++ answer (no GPU needed), with the options ``load_cuda``
    uses, or None where NVRTC cannot be loaded (no CuPy). A compile error is a GradeError with
    NVRTC's log. What the compiler kept is what runs: a call in dead code or under ``#if 0``
    leaves no instruction (``ptx_instructions``)."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got "
                         f"{type(src).__name__}")
    if not re.fullmatch(r"compute_\d+a?", str(arch)):
        raise ValueError(f"cuda_ptx: arch must look like 'compute_80', got {arch!r}")
    try:
        from cupy_backends.cuda.libs import nvrtc

        from ..compile import nvrtc_options

        prog = nvrtc.createProgram(src, f"{ex} source", [], [])
    except Exception:  # noqa: BLE001 - no CuPy, or no libnvrtc: nothing to compile with
        return None
    try:
        nvrtc.compileProgram(prog, [*nvrtc_options(tuple(options)), f"-arch={arch}"])
        ptx = nvrtc.getPTX(prog)
    except Exception:  # noqa: BLE001 - NVRTC raises its own error type; the log says why
        raise GradeError(f"{ex}: does not compile:\n{nvrtc.getProgramLog(prog)}") from None
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


_PTX_FUNC = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+|\.extern[ \t]+)*"
                       r"\.(entry|func)[ \t]+(?:\([^)]*\)[ \t]*)?([\w$]+)", re.M)
_PTX_CALL = re.compile(r"\bcall(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?([\w$]+)")


def ptx_instructions(ex: str, ptx: str, entry: str) -> list[str]:
    """The instructions of kernel ``entry`` in ``ptx`` and of the functions it calls, each as
    its text without the predicate and the ``;`` (``"cp.async.wait_group 1"``,
    ``"wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {...}"``). GradeError when ``ptx``
    defines no kernel ``entry``."""
    starts = [(m.start(), m.group(1), m.group(2)) for m in _PTX_FUNC.finditer(ptx)]
    bodies = {name: ptx[s:(starts[i + 1][0] if i + 1 < len(starts) else len(ptx))]
              for i, (s, _, name) in enumerate(starts)}
    if entry not in bodies or not any(k == "entry" and n == entry for _, k, n in starts):
        have = [n for _, k, n in starts if k == "entry"]
        raise GradeError(f"{ex}: the source defines no kernel {entry!r} (extern \"C\" "
                         f"__global__ void {entry}(...)); it has {have}")
    out: list[str] = []
    todo, seen = [entry], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        body = bodies[name]
        todo += _PTX_CALL.findall(body)
        for line in body.splitlines():
            s = line.split("//")[0].strip().rstrip(";").strip()
            if not s or s[0] in ".{}()$" or s.endswith(":"):
                continue
            if s.startswith("@"):
                s = s.split(None, 1)[1] if " " in s else ""
            if s and s[0].isalpha():
                out.append(s)
    return out


# ----------------------------------------------------------------------------- Numba kernels
_THREAD_WORDS = ("threadIdx", "laneid")     # cuda.threadIdx.x, cuda.laneid: per thread
_THREAD_CALLS = ("grid",)                   # cuda.grid(n): per thread


def _kernel_def(ex: str, kernel):
    import ast

    tree = ast.parse(python_code(ex, kernel))
    return next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))), None)


def _names(node) -> set[str]:
    import ast

    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _per_thread(node, tainted: set[str]) -> bool:
    """``node`` (an expression) differs between the threads of a block."""
    import ast

    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in _THREAD_WORDS:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and n.func.attr in _THREAD_CALLS:
            return True
        if isinstance(n, ast.Name) and n.id in tainted:
            return True
    return False


def thread_divergent_barriers(ex: str, kernel, barrier: str = "syncthreads") -> list[str]:
    """Barriers of a Numba kernel that not every thread of a block reaches, each as
    ``"line N: why"``: a ``cuda.syncthreads()`` inside an ``if``, ``while`` or ``for`` whose
    condition or range differs between threads (it depends on ``cuda.threadIdx``,
    ``cuda.grid``, ``cuda.laneid`` or a variable computed from them), or after a ``return``
    taken by some threads only. On a GPU such a barrier hangs or silently synchronises nothing;
    the simulator runs it without complaint. A branch or loop that every thread of a block
    takes alike (``while stride > 0``, ``if n > 0``) is not flagged. Empty list: none found.
    Raises GradeError when the source cannot be read (``python_code``)."""
    import ast

    fn = _kernel_def(ex, kernel)
    if fn is None:
        return []
    tainted: set[str] = set()
    changed = True
    while changed:                        # names computed from per-thread values, to a fixpoint
        changed = False
        for n in ast.walk(fn):
            targets, value = [], None
            if isinstance(n, ast.Assign):
                targets, value = n.targets, n.value
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                targets, value = [n.target], n.value
            elif isinstance(n, ast.For):
                targets, value = [n.target], n.iter
            if value is None or not _per_thread(value, tainted):
                continue
            for t in targets:
                new = {x.id for x in ast.walk(t) if isinstance(x, ast.Name)} - tainted
                if new and not isinstance(t, ast.Subscript):
                    tainted |= new
                    changed = True
    found: list[str] = []

    def is_barrier(n) -> bool:
        return isinstance(n, ast.Call) and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == barrier)
            or (isinstance(n.func, ast.Name) and n.func.id == barrier))

    def visit(stmts, why: str | None, returned: str | None) -> str | None:
        for s in stmts:
            for n in ast.walk(s) if not isinstance(s, (ast.If, ast.While, ast.For)) else []:
                if is_barrier(n) and (why or returned):
                    found.append(f"line {n.lineno}: cuda.{barrier}() "
                                 f"{why or 'after ' + returned}")
            if isinstance(s, (ast.If, ast.While)):
                inner = why
                if inner is None and _per_thread(s.test, tainted):
                    inner = (f"inside the branch on line {s.lineno}, whose condition differs "
                             "between the threads of a block")
                r = visit(s.body, inner, returned)
                r2 = visit(s.orelse, inner, returned)
                if returned is None and (r or r2) and inner and not why:
                    returned = (f"the return on line {r or r2}, which only some threads of a "
                                "block take")
            elif isinstance(s, ast.For):
                inner = why
                if inner is None and _per_thread(s.iter, tainted):
                    inner = (f"inside the loop on line {s.lineno}, whose range differs between "
                             "the threads of a block")
                visit(s.body, inner, returned)
                visit(s.orelse, inner, returned)
            elif isinstance(s, ast.Return) and why:
                return str(s.lineno)
        return None

    visit(fn.body, None, None)
    return list(dict.fromkeys(found))


def whole_array_ops(ex: str, kernel, arrays) -> list[str]:
    """Arithmetic on whole arrays in a Numba kernel, each as ``"line N: what"``: an array
    parameter (named in ``arrays``) used as an operand without an index (``a * x + y``), or a
    slice assigned to (``out[:] = ...``). The simulator runs them as NumPy (every thread
    computing the whole result); Numba's CUDA target compiles neither. Empty list: none found."""
    import ast

    fn = _kernel_def(ex, kernel)
    if fn is None:
        return []
    arrays = set(arrays)
    found: list[str] = []
    for n in ast.walk(fn):
        if isinstance(n, (ast.BinOp, ast.UnaryOp)):
            ops = [n.left, n.right] if isinstance(n, ast.BinOp) else [n.operand]
            for o in ops:
                if isinstance(o, ast.Name) and o.id in arrays:
                    found.append(f"line {n.lineno}: the whole array {o.id} in arithmetic "
                                 f"(index it: {o.id}[i])")
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Subscript) and any(
                        isinstance(s, ast.Slice) for s in ast.walk(t.slice)):
                    found.append(f"line {n.lineno}: a slice assigned to (one element per "
                                 "thread: out[i] = ...)")
    return list(dict.fromkeys(found))


def refuse_library(ex: str, kernel, what: str) -> None:
    """GradeError when a Numba answer hands the work to a library (``foreign_calls``); ``what``
    says what the kernel itself should do instead."""
    found = foreign_calls(ex, kernel)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise GradeError(f"{ex}: the kernel uses {found[0]}{more}: the CUDA simulator runs a "
                         "kernel as Python, so that works here, but a GPU cannot compile it, and "
                         f"the exercise asks for the kernel itself: {what}")


def kernel_not_gpu_code(ex: str, kernel, arrays=()) -> str | None:
    """None, or the message of a GradeError for a Numba kernel that computes its result with
    something a GPU does not run: ``foreign_calls`` and ``whole_array_ops`` together."""
    found = foreign_calls(ex, kernel) + whole_array_ops(ex, kernel, arrays)
    if not found:
        return None
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None),
                                                        "__name__", "the kernel")
    return (f"{ex}: the kernel {name} uses what runs only on the host: "
            + "; ".join(found[:4]) + ". The CUDA simulator runs a kernel as Python, so this "
            "computes the right numbers here, but Numba cannot compile it for a GPU, and the "
            "exercise asks for the work done by GPU threads, each on its own elements")


def refuse_host_code(ex: str, kernel, args=(), barriers: bool = True) -> None:
    """GradeError if a Numba kernel does its work with host-only code (``kernel_not_gpu_code``;
    the array parameters are those whose value in ``args``, the launch's arguments, is an
    array) or, with ``barriers``, calls ``cuda.syncthreads()`` where not every thread of a
    block reaches it (``thread_divergent_barriers``)."""
    py = getattr(kernel, "py_func", kernel)
    try:
        params = list(inspect.signature(py).parameters)
    except (TypeError, ValueError):
        params = []
    arrays = [p for p, a in zip(params, args) if getattr(a, "ndim", 0) >= 1]
    msg = kernel_not_gpu_code(ex, kernel, arrays)
    if msg:
        raise GradeError(msg)
    found = thread_divergent_barriers(ex, kernel) if barriers else []
    if found:
        raise GradeError(f"{ex}: a barrier that not every thread of the block reaches: "
                         + "; ".join(found[:3]) + ". Every thread of a block must call "
                         "cuda.syncthreads() the same number of times: on a GPU a barrier in "
                         "divergent code hangs or synchronises nothing (the simulator runs it "
                         "regardless). Keep the barrier outside the branch: guard the loads "
                         "and stores, not the barrier")
