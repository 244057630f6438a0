"""cb.trace: known access patterns give known records, findings and drawings.

Every trace runs the CUDA simulator in a subprocess (about half a second each), so each kernel is
traced once per module (fixtures) and the sizes are a few blocks.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda, float32  # noqa: E402

import cudabook as cb  # noqa: E402
from cudabook import tracedraw, tracemem  # noqa: E402
from cudabook.tracer import READ, WRITE, TraceError, trace  # noqa: E402

N = 200                      # 4 blocks of 64: the last block has 56 idle threads
HALF = 32                    # the test kernels' shared arrays


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ----------------------------------------------------------------------------- test kernels
@cuda.jit
def overlap(x, out):
    i = cuda.blockIdx.x * 32 + cuda.threadIdx.x     # blocks of 64 threads step by 32
    if i < out.size:
        out[i] = x[i]


@cuda.jit
def no_guard(x, out):
    i = cuda.grid(1)
    out[i] = x[i]


def _reduce_v2_without_its_first_barrier(tpb: int = 64):
    """kernels/reduce.py's reduce_v2, generated from its source with the barrier after the load
    deleted (thread 0 may then add s[32] before thread 32 stored it) and TPB set to ``tpb`` (a
    small block for the trace). Each edit must apply exactly once: a changed kernel stops here."""
    import ast
    import linecache

    path = cb.KERNELS_DIR / "reduce.py"
    text = path.read_text()
    tree = ast.parse(text)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "reduce_v2")
    lines = text.splitlines(keepends=True)
    src = "".join(lines[fn.decorator_list[0].lineno - 1:fn.end_lineno])
    barrier = "float32(0)\n    cuda.syncthreads()\n"
    assert src.count(barrier) == 1, f"{path}: reduce_v2's barrier after the load moved"
    src = src.replace(barrier, "float32(0)\n")
    imports = [ast.get_source_segment(text, n) for n in tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) == "TPB = 256" for n in tree.body)
    code = "\n".join(imports) + f"\nTPB = {tpb}\n\n" + src
    fname = f"<kernels/reduce.py reduce_v2 without its first barrier, TPB={tpb}>"
    linecache.cache[fname] = (len(code), None, code.splitlines(keepends=True), fname)
    ns: dict = {"__name__": "reduce_no_barrier"}
    exec(compile(code, fname, "exec"), ns)  # noqa: S102  (the book's own kernel, edited)
    return ns["reduce_v2"]


reduce_no_barrier = _reduce_v2_without_its_first_barrier()


@cuda.jit
def reverse_small_block(x, out):
    s = cuda.shared.array(64, float32)        # sized for 64 threads, launched with 32
    tid = cuda.threadIdx.x
    s[tid] = x[cuda.grid(1)]
    cuda.syncthreads()
    out[cuda.grid(1)] = s[63 - tid]


@cuda.jit
def early_return(x, out):
    s = cuda.shared.array(64, float32)
    i = cuda.grid(1)
    if i >= x.size:
        return                                  # before the barrier: uneven barrier counts
    s[cuda.threadIdx.x] = x[i]
    cuda.syncthreads()
    out[i] = s[cuda.threadIdx.x]


@cuda.jit
def shift_left(x):
    i = cuda.grid(1)
    if i + 1 < x.size:
        x[i] = x[i + 1]                         # in place: reads what a neighbour writes


@cuda.jit
def neighbour(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i - 1]                       # x[-1] at i = 0: Numba wraps it


@cuda.jit(device=True)
def _twice(v):
    return v * SCALE


SCALE = 2.0


def _make_add(k):
    @cuda.jit
    def add_k(x, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = _twice(x[i]) + k
    return add_k


@cuda.jit
def stub(x):
    raise NotImplementedError("ex99.1")


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def nb():
    return {m: cb.load_numba(m) for m in ("vector_add", "copy", "transpose", "reduce")}


def _vec(n=N):
    x = np.arange(n, dtype=np.float32)
    return x, np.ones(n, np.float32), np.full(n, np.nan, np.float32)


@pytest.fixture(scope="module")
def t_v1(nb):
    x, y, z = _vec()
    t = trace(nb["vector_add"].vector_add_v1, cb.ceil_div(N, 64), 64, x, y, z)
    assert np.isnan(z).all()                    # the arguments are not modified
    return t


@pytest.fixture(scope="module")
def t_gridstride(nb):
    return trace(nb["vector_add"].vector_add_v2, 2, 32, *_vec())


@pytest.fixture(scope="module")
def t_transpose(nb):
    a = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
    return {v: trace(getattr(nb["transpose"], f"transpose_v{v}"), 1, (32, 8), a,
                     np.zeros((32, 32), np.float32)) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def t_reduce(nb):
    return trace(nb["reduce"].reduce_v2, 1, 256, np.ones(256, np.float32),
                 np.zeros(1, np.float32))


# ----------------------------------------------------------------------------- the record
def test_index_map(t_v1):
    t = t_v1
    i = np.arange(N)
    assert (t.writer("z", "block") == i // 64).all()
    assert (t.writer("z", "thread") == i).all()
    assert (t.counts("x", READ) == 1).all() and (t.counts("z", WRITE) == 1).all()
    assert np.allclose(t.array("z").after, np.arange(N) + 1)
    assert t.findings().ok
    assert "256 threads" in repr(t)


def test_grid_stride_loop(t_gridstride):
    t = t_gridstride
    i = np.arange(N)
    assert (t.writer("z", "thread") == i % 64).all()       # 64 threads walk 200 elements
    per_thread = np.bincount(t.gid(*[t.accesses("z", WRITE)[c] for c in ("block", "thread")]))
    assert per_thread.tolist() == [4] * 8 + [3] * 56
    assert t.findings().ok


def test_coalesced_strided_offset_sectors(nb):
    cp = nb["copy"]
    x = np.arange(64 * 4 + 1, dtype=np.float32)
    y = np.zeros(64, np.float32)
    got = {}
    for name, k, args in (("coalesced", cp.copy_v1, (x[:64].copy(), y)),
                          ("stride 4", cp.copy_strided, (x, y, 4)),
                          ("offset 1", cp.copy_offset, (x, y, 1))):
        r = tracemem.summary(trace(k, 1, 64, *args)).row("x", "read")
        got[name] = (r["requests"], r["sectors"], r["ideal"])
    assert got == {"coalesced": (2, 4.0, 4.0), "stride 4": (2, 16.0, 4.0),
                   "offset 1": (2, 5.0, 4.0)}


def test_transpose_sectors_and_bank_conflicts(t_transpose):
    s1 = tracemem.summary(t_transpose[1])
    assert s1.row("a", "read")["sectors"] == 4 and s1.row("out", "write")["sectors"] == 32
    s2, s3 = tracemem.summary(t_transpose[2]), tracemem.summary(t_transpose[3])
    assert s2.row("tile", "write")["wavefronts"] == 1
    assert s2.row("tile", "read")["wavefronts"] == 32           # a column of a 32 x 32 tile
    assert s3.row("tile", "read")["wavefronts"] == 1            # padded to 32 x 33
    assert s2.row("out", "write")["sectors"] == 4               # the tile made it coalesced
    for v in (2, 3):
        assert t_transpose[v].findings().ok
        assert (t_transpose[v].array("out").after == np.arange(1024.0).reshape(32, 32).T).all()


def test_reduction_tree(t_reduce):
    t = t_reduce
    assert t.array("partial").after[0] == 256
    w = t.accesses("s", WRITE)
    assert [int((w["phase"] == p).sum()) for p in range(9)] == [256, 128, 64, 32, 16, 8, 4, 2,
                                                                  1]
    active_warps = [np.unique(w["thread"][w["phase"] == p] // 32).size for p in range(9)]
    assert active_warps == [8, 4, 2, 1, 1, 1, 1, 1, 1]          # sequential addressing packs
    assert (t.barriers == 9).all()
    assert t.findings().ok


# ----------------------------------------------------------------------------- findings
def test_missing_barrier_is_a_race():
    x = np.ones(128, np.float32)
    t = trace(reduce_no_barrier, 2, 64, x, np.zeros(2, np.float32))
    f = t.findings()
    assert not f.ok and f.counts["races"] == 64                 # s[32..63] in both blocks
    r = f.races[0]
    assert r.space == "shared" and r.kind == "read-write" and 32 <= r.index[0] < 64
    writer, reader = r.first, r.second
    assert writer[1] == r.index[0] and reader[1] == r.index[0] - 32
    msg = f.message()
    assert msg.startswith(f"race on shared s[{r.index[0]}] in block 0") and \
        "missing barrier" in msg and "s[tid + stride]" in msg
    # (the sums themselves depend on how the simulator's threads happened to interleave)


def test_out_of_bounds_with_its_thread():
    x = np.arange(N, dtype=np.float32)
    t = trace(no_guard, 4, 64, x, np.zeros(N, np.float32))
    f = t.findings()
    assert f.counts["out_of_bounds"] == 2 * 56                  # a read and a write per thread
    o = f.out_of_bounds[0]
    assert (o.array, o.kind, o.index, o.block, o.thread) == ("x", "read", (200,), 3, 8)
    assert f.message().startswith("x[200] read out of bounds (x has shape (200,)) by thread "
                                  "200 (block 3, thread 8), line")
    assert "missing bounds guard" in f.message()


def test_negative_index_is_flagged():
    x = np.arange(64, dtype=np.float32)
    t = trace(neighbour, 1, 64, x, np.zeros(64, np.float32))
    o = t.findings().out_of_bounds
    assert len(o) == 1 and o[0].index == (-1,) and o[0].wrapped and o[0].thread == 0
    assert t.array("out").after[0] == 63                         # Numba's wraparound


@pytest.fixture(scope="module")
def t_overlap():
    return trace(overlap, 4, 64, np.arange(N, dtype=np.float32), np.zeros(N, np.float32))


def test_two_blocks_write_one_element(t_overlap):
    f = t_overlap.findings()
    assert f.message() == ("out[32] written by threads 32 and 64 (blocks 0 and 1): two blocks "
                           "cover the same range (96 elements written more than once in all)")
    assert f.never_written["out"].tolist() == list(range(160, 200))
    assert f.message(only={"never_written", "races"}).startswith("out[160..199] never written")
    assert f.message(only={"races"}) is None
    assert "out[160..199] never written (40 of 200 elements)" in f.messages()[1]


def test_uninitialised_shared_read():
    x = np.arange(64, dtype=np.float32)
    f = trace(reverse_small_block, 2, 32, x, np.zeros(64, np.float32)).findings()
    u = f.uninitialized[0]
    assert (u.array, u.index, u.block, u.thread) == ("s", (32,), 0, 31)   # s[63 - tid]
    assert f.counts["uninitialized"] == 64 and "before any thread of the block wrote it" in \
        f.message()


def test_uneven_barriers_and_global_race():
    x = np.arange(40, dtype=np.float32)
    f = trace(early_return, 1, 64, x, np.zeros(40, np.float32)).findings()
    assert f.uneven_barriers[0].counts == {0: 24, 1: 40}
    assert "different numbers of cuda.syncthreads()" in f.message()
    g = trace(shift_left, 2, 32, np.arange(64, dtype=np.float32)).findings()
    assert g.counts["races"] == 62                      # x[1..62]: written by i, read by i - 1
    assert g.races[0].space == "global" and g.races[0].index == (1,)
    assert g.message().startswith("race on x[1]: thread 1 (block 0, thread 1) writes it") and \
        g.message().endswith("no cuda.syncthreads() between them (62 races in all)")
    across = [r for r in g.races if r.index == (32,)][0]      # written in block 1, read in 0
    assert (across.first[0], across.second[0]) == (1, 0)


def test_atomics_do_not_race(nb):
    x = np.ones(600, np.float32)
    t = trace(nb["reduce"].reduce_atomic_tree, 2, 256, x, np.zeros(1, np.float32))
    assert t.array("out").after[0] == 600
    assert t.findings().ok and t.counts("out", "atomic")[0] == 2


# ----------------------------------------------------------------------------- shipping, limits
def test_closure_device_function_global_and_device_array():
    x = np.arange(64, dtype=np.float32)
    t = trace(_make_add(5.0), 1, 64, x, cuda.to_device(np.zeros(64, np.float32)))
    assert (t.array("out").after == 2 * x + 5).all()


def _launch_add(x):                          # a plain function that reads the module cb
    return cb.ceil_div(x.size, 64), _make_add(0.0)


def test_shipment_by_source_and_by_name():
    """One shipper (tracer.Shipment) for cb.trace and the graders' simulator check: functions
    from a notebook or a test file travel as source, library functions by name."""
    from solution_cells import Solution

    from cudabook.tracer import Shipment

    sh = Shipment()
    launcher = Solution("01").get("ex01.1", "launch_saxpy")     # defined in a solution cell
    sh.add(launcher)
    assert [(f["name"], f["kind"]) for f in sh.funcs] == [("saxpy", "kernel"),
                                                            ("launch_saxpy", "python")]
    sh.add(_make_add(1.0))
    assert [f["kind"] for f in sh.funcs[2:]] == ["device", "kernel"] and not sh.missing()
    ns = sh.namespaces[sh.funcs[-1]["ns"]]
    assert set(ns["funcs"]) == {"_twice"} and set(ns["values"]) == {"k"}   # the closure's k
    sh.add(_launch_add)
    assert "cb" in sh.namespaces[sh.funcs[-1]["ns"]]["modules"]


def test_simulator_check_ships_the_answer(monkeypatch):
    """graders._race.simulate (on a GPU) grades a Numba answer again in a simulator process;
    here its core runs in the CPU lane: a launcher and its kernel from a solution cell pass,
    a barrier before the halo fails there, and an answer that cannot travel is a skip (an
    error under CUDABOOK_STRICT_RACECHECK=1)."""
    from solution_cells import Solution

    from cudabook.graders import GradeError, _race

    ok = Solution("01").get("ex01.1", "launch_saxpy")
    assert _race._simulate_run("ex01.1", "ex01_1", [("launch_saxpy", ok)]) is None
    racy = Solution("02").get("ex02.4", "moving_average", edits=[
        ("    cuda.syncthreads()\n    if i < n:", "    if i < n:"),
        ("    if t < R:\n", "    cuda.syncthreads()\n    if t < R:\n")])
    msg = _race._simulate_run("ex02.4", "ex02_4", [("moving_average", racy)])
    assert "shows why: race on shared tile[1] in block 0" in msg
    lock = __import__("threading").Lock()

    @cuda.jit
    def locked(x):
        if lock:
            x[0] = 1.0
    assert _race._simulate_run("ex02.4", "ex02_4", [("moving_average", locked)]) is None
    monkeypatch.setenv(_race.STRICT_ENV, "1")
    with pytest.raises(GradeError, match="could not run .*lock: lock cannot be pickled"):
        _race._simulate_run("ex02.4", "ex02_4", [("moving_average", locked)])


def test_limits_and_errors(nb):
    x, y, z = _vec(10_000)
    with pytest.raises(TraceError, match="limited to 4096 threads"):
        trace(nb["vector_add"].vector_add_v1, 40, 256, x, y, z)
    with pytest.raises(TraceError, match="more than 100 memory accesses"):
        trace(nb["vector_add"].vector_add_v1, 1, 64, x, y, z, max_accesses=100)
    with pytest.raises(TraceError, match="takes 3 arguments"):
        trace(nb["vector_add"].vector_add_v1, 1, 64, x, y)
    with pytest.raises(NotImplementedError, match="ex99.1"):
        trace(stub, 1, 4, x)


# ----------------------------------------------------------------------------- drawings
def test_drawings(t_v1, t_gridstride, t_transpose, t_reduce):
    ax = tracedraw.writers(t_v1, "z", by="block")
    assert "56 of 256 threads touched no memory" in ax.get_title()
    assert [tx.get_text() for tx in ax.texts[:3]] == ["0", "1", "2"]   # threadIdx.x labels
    ax = tracedraw.writers(t_gridstride, "z", by="thread", label="thread", wrap=64)
    assert [tx.get_text() for tx in ax.texts[64:67]] == ["0", "1", "2"]   # row 2 restarts
    ax = tracedraw.sectors(t_transpose[1], "out", kind="write")
    assert "32 sectors" in ax.get_title()
    _, bars = tracedraw.banks(t_transpose[2], "tile", line=t_transpose[2].sites[2].line)
    assert max(p.get_height() for p in bars.patches) == 32
    _, bars = tracedraw.banks(t_transpose[3], "tile", line=t_transpose[3].sites[2].line)
    assert max(p.get_height() for p in bars.patches) == 1
    ax = tracedraw.phases(t_reduce, "s")
    assert [tx.get_text() for tx in ax.texts][:2] == ["256 threads in 8 warps",
                                                       "128 threads in 4 warps"]
    tracedraw.reads(t_v1, "x")
    tracedraw.flow(t_transpose[1], "a", "out", threads=range(4))


def test_drawing_of_gaps_and_double_writes(t_overlap):
    ax = tracedraw.writers(t_overlap, "out", by="count")
    assert "40 never written" in ax.get_title() and "96 written by several threads" in \
        ax.get_title()


# ----------------------------------------------------------------------------- compute-sanitizer
# graders._race.racecheck runs compute-sanitizer's racecheck, synccheck and initcheck on a CUDA
# C++ answer. The parsing of their reports runs here on stored report text (no GPU); the tools
# themselves run on the GPU below, on ex02.1's transpose with a mistake seeded into it.

_SYNC_REPORT = """========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in block
=========     at 0x1b0 in ex02.1 source:12:transpose_tiled
=========     by thread (16,0,0) in block (0,0,0)
=========
========= Barrier error detected. Divergent thread(s) in block
=========     at 0x90 in cupy_copy__float32_float32
=========     by thread (3,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 2 errors
"""
_INIT_REPORT = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x150 in cupy_random_xorwow
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Host API memory access error at host access to 0x7f14c9e00200 of size 16 bytes
=========     Uninitialized access at 0x7f14c9e00200 on access by cudaMemcpy source
=========
========= Uninitialized __shared__ memory read of size 4 bytes
=========     at transpose_tiled+0x200 in ex02.1 source:14
=========     by thread (31,7,0) in block (1,0,0)
=========     Address 0x1080
=========
========= ERROR SUMMARY: 3 errors
"""


def test_sanitizer_findings_are_those_of_the_answers_kernel():
    from cudabook.graders import _race

    sync = _race.findings("synccheck", _SYNC_REPORT, ["transpose_tiled"])
    assert len(sync) == 1 and sync[0].startswith("Barrier error detected. Divergent thread(s)")
    assert "transpose_tiled" in sync[0]
    init = _race.findings("initcheck", _INIT_REPORT, ["transpose_tiled"])
    assert init == ["Uninitialized __shared__ memory read of size 4 bytes at transpose_tiled"
                    "+0x200 in ex02.1 source:14"]
    assert _race.findings("initcheck", _INIT_REPORT, ["transpose"]) == []   # a whole name
    assert _race.findings("synccheck", "========= ERROR SUMMARY: 0 errors\n",
                          ["transpose_tiled"]) == []
    msg = _race._message("ex02.1", "initcheck", init, "", dict(_race.HINTS))
    assert msg.startswith("ex02.1: compute-sanitizer initcheck found a read of shared memory")
    assert "skipped instead of writing a zero" in msg
    msg = _race._message("ex02.1", "synccheck", sync, "", dict(_race.HINTS))
    assert "synccheck found a barrier that not every thread of the block reaches" in msg


def test_sanitizer_commands(monkeypatch):
    """initcheck watches shared memory too where the installed tool can (2025.4+), and the
    notes say so where it cannot."""
    from cudabook.graders import _race

    monkeypatch.setattr(_race, "_help", lambda tool: "--initcheck-address-space arg")
    cmd = _race._command("cs", "initcheck", ["python"])
    assert cmd[:2] == ["cs", "--tool"] and cmd[-3:] == ["--initcheck-address-space", "all",
                                                        "python"]
    assert "--racecheck-report" in _race._command("cs", "racecheck", ["python"])
    assert "--initcheck-address-space" not in _race._command("cs", "synccheck", ["python"])
    monkeypatch.setattr(_race, "_sanitizer", lambda: "cs")
    assert _race.sanitizer_notes() == []
    monkeypatch.setattr(_race, "_help", lambda tool: "")
    assert "--initcheck-address-space" not in _race._command("cs", "initcheck", ["python"])
    assert "global memory only" in _race.sanitizer_notes()[0]


def _transpose(edits=()):
    from solution_cells import Solution

    return Solution("02").get("ex02.1", "transpose_src", edits=list(edits))


_BARRIER_02_1 = "    __syncthreads();                             // the whole tile is loaded\n"


def _sanitize(src, tools=None):
    from cudabook.graders import _race

    kw = {} if tools is None else {"tools": tools}
    return _race.racecheck("ex02.1", src, "transpose_tiled", "cudabook.graders.ch02:_race_ex02_1",
                           hint="a barrier", **kw)


@pytest.mark.gpu
def test_sanitizers_pass_the_reference(monkeypatch):
    from cudabook.graders import _race

    monkeypatch.setenv(_race.STRICT_ENV, "1")
    assert _sanitize(_transpose()) is None


@pytest.mark.gpu
def test_synccheck_finds_a_barrier_some_threads_skip(monkeypatch):
    """__syncthreads() inside if (threadIdx.x < 16): half of every warp skips it."""
    from cudabook.graders import GradeError, _race

    monkeypatch.setenv(_race.STRICT_ENV, "1")
    monkeypatch.setattr(_race, "_TIMEOUT", 90)     # a barrier some threads skip may hang
    src = _transpose([(_BARRIER_02_1, "    if (threadIdx.x < 16) __syncthreads();\n")])
    with pytest.raises(GradeError, match="synccheck found a barrier that not every thread"):
        _sanitize(src, tools=("synccheck",))
    with pytest.raises(GradeError, match="synccheck found"):   # reported before the races
        _sanitize(src)


@pytest.mark.gpu
def test_initcheck_finds_a_shared_read_nobody_wrote(monkeypatch):
    """The read one column to the right: at threadIdx.y + j = 31 it reads the tile's padding
    column, which no thread writes. The barrier is in place, so racecheck has no second access to
    pair it with, and the address lies inside the array (memcheck is silent too)."""
    from cudabook.graders import GradeError, _race

    if _race.sanitizer_notes():
        pytest.skip(_race.sanitizer_notes()[0])
    monkeypatch.setenv(_race.STRICT_ENV, "1")
    src = _transpose([("tile[threadIdx.x][threadIdx.y + j]",
                       "tile[threadIdx.x][threadIdx.y + j + 1]")])
    assert _sanitize(src, tools=("racecheck",)) is None
    with pytest.raises(GradeError, match="initcheck found a read of shared memory that was never "
                       "written .*__shared__"):
        _sanitize(src)
