"""Graders of Chapter 5, "Profiling and optimization".

ex05_1  name the bottleneck of five stored Nsight Compute tables                     no GPU needed
ex05_2  an occupancy calculator (blocks per SM from threads, registers, shared memory)
        against stored values in the simulator, and also against the driver on a GPU
ex05_3  capture a chain of kernel launches in a CUDA graph, GRAPH_FACTOR x faster     GPU
ex05_4  fix a timing function: it is fed kernels whose true durations are known       GPU
ex05_5  CUDA C++: profile a slow row sum and fix it past a speed gate (a copy of the same  GPU
        bytes, same run) and, where Nsight Compute reads counters, a sectors-per-byte gate

A wrong answer gets the evidence against it, never the right answer (ex05.1 names the counters
that refute the label given). The rubric checks that need no GPU run first, on the source: ex05.2
may not call an occupancy calculator, ex05.3 may not call cb.graphs.capture, ex05.5 may not
call a library reduction nor hand back the slow kernel's loop.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any, Callable

import numpy as np

from .. import env
from ..check import to_numpy
from ..launch import ceil_div
from ..ncu import KernelProfile, NcuReport
from ..occupancy import ARCHS, Limits
from ..occupancy import occupancy as _occupancy
from ._core import GradeError, fresh_rng, need_gpu, passed
from ._race import racecheck
from ._static import mentions, python_code

__all__ = ["ex05_1", "ex05_2", "ex05_3", "ex05_4", "ex05_5", "LABELS", "NCU_CASES",
           "show_cases", "OCC_TABLE", "DRIVER_SWEEP", "sweep_cases", "GRAPH_FACTOR",
           "CHAIN_LENGTH", "chain_source", "row_sum_slow_source", "row_sum_counters",
           "row_sum_profile", "ROW_SUM_SHAPE", "ROW_SUM_ROWS", "ROW_SUM_MIN_RATIO",
           "ROW_SUM_MAX_SECTORS"]

# ============================================================================ ex05.1

LABELS = ("memory-bound", "compute-bound", "latency-bound", "launch-bound")

try:   # measured on a GPU by tools/dev/ch05_probe.py --write
    from ._ch05_data import DRIVER_SWEEP, GPU, LIMITS, NCU_CASES
except ImportError:      # not generated yet
    GPU, LIMITS, NCU_CASES, DRIVER_SWEEP = "", {}, {}, []

#: the bottleneck of each stored case (the kernels were chosen for it: A LayerNorm over 256 MB,
#: B the tuned SGEMM at 4096, C a copy with one warp per SM, D an add of 1024 floats, E a chain
#: of 512 dependent FMAs per element)
_ANSWERS = {"A": "memory-bound", "B": "compute-bound", "C": "latency-bound",
            "D": "launch-bound", "E": "compute-bound"}


def _against(case: str, label: str) -> str:
    """Why ``label`` (a wrong answer for ``case``) does not fit: the counters of the case that
    speak against that label. It never names the right label nor the evidence for it, so a hint
    cannot be read as the answer."""
    c = NCU_CASES[case]
    v = c["values"]
    sm, mem, dram = v.get("sm_pct", 0), v.get("mem_pct", 0), v.get("dram_pct", 0)
    fma, t = v.get("fma_pct", 0), v.get("time_ns", 0) / 1e3
    if label == "memory-bound":
        return (f"a memory-bound kernel keeps a memory unit near its peak, but memory throughput "
                f"is {mem:.0f}% of peak here (DRAM {dram:.0f}%)")
    if label == "compute-bound":
        return (f"a compute-bound kernel keeps an execution pipe near its peak, but compute (SM) "
                f"throughput is {sm:.0f}% of peak here (FMA pipe {fma:.0f}%)")
    if label == "latency-bound":
        if _ANSWERS[case] == "launch-bound":      # nothing is near its peak there either
            return (f"nothing is near its peak, true; but this kernel runs {t:.1f} us: is the GPU "
                    "busy with it at all between launches? Read the trace line")
        return ("a latency-bound kernel has neither compute nor memory throughput near its peak, "
                f"but here the busier of the two is at {max(sm, mem):.0f}% of its peak: read "
                "those two rows again")
    return (f"a launch-bound kernel is so short that the GPU waits for the next launch, but this "
            f"one runs {t:.0f} us and the trace line says: {c['trace']}")


def _case_report(case: str) -> NcuReport:
    c = NCU_CASES[case]
    return NcuReport([KernelProfile(f"case {case}", dict(c["values"]), dict(c["stalls"]),
                                    c["grid"], c["block"])])


def show_cases() -> None:
    """Print the five stored tables (the same layout as ``NcuReport.show``)."""
    if not NCU_CASES:
        print("no stored cases: cudabook/graders/_ch05_data.py is missing (run "
              "tools/dev/ch05_probe.py --write on a GPU)")
    for case, c in NCU_CASES.items():
        _case_report(case).show()
        print(f"  {'in the trace':<32s} {c['trace']}")
        print()


def ex05_1(name_bottlenecks: Callable[[], dict[str, str]]) -> None:
    """``name_bottlenecks()`` returns, for each stored case ("A" ... "E"), one of ``LABELS``."""
    ex = "ex05.1"
    if not NCU_CASES:
        raise GradeError(f"{ex}: no stored cases (cudabook/graders/ch05.py is incomplete)")
    try:
        got = name_bottlenecks()
    except NotImplementedError:
        raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                         "NotImplementedError)") from None
    if not isinstance(got, dict):
        raise GradeError(f"{ex}: return a dict {{case: label}}, got {type(got).__name__}")
    missing = [c for c in NCU_CASES if c not in got]
    if missing:
        raise GradeError(f"{ex}: no answer for case(s) {missing}")
    wrong = []
    for case in NCU_CASES:
        label = str(got[case]).strip().lower().replace("_", "-").replace(" ", "-")
        if label not in LABELS:
            raise GradeError(f"{ex}: case {case}: {got[case]!r} is not one of {list(LABELS)}")
        if label != _ANSWERS[case]:
            wrong.append(f"case {case}: not {label}: {_against(case, label)}")
    if len(wrong) == 1:
        raise GradeError(f"{ex}: {wrong[0]}")
    if wrong:
        raise GradeError(f"{ex}: {len(wrong)} of {len(NCU_CASES)} cases wrong\n  "
                         + "\n  ".join(wrong))
    passed(ex)


# ============================================================================ ex05.2

#: (arch, threads, registers per thread, shared bytes per block, resident blocks per SM): the
#: answers of cudabook.occupancy, which agrees with the driver on every configuration of the
#: lesson's sweep (sm_90 on an H100); the test suite checks that these values stay in sync.
#: The configurations are chosen so that each rule of the calculation decides some of them.
OCC_CONFIGS = [(256, 32, 0), (128, 24, 0), (32, 16, 0), (1024, 32, 0), (1024, 64, 0),
               (1024, 72, 0), (96, 40, 0), (192, 37, 0), (160, 255, 0), (48, 20, 0),
               (64, 30, 6000), (64, 16, 7000), (128, 32, 49152), (256, 32, 100_000),
               (128, 32, 163_000), (256, 32, 232_448), (100, 16, 1000), (2048, 16, 0),
               (512, 128, 0), (640, 96, 20_000), (96, 168, 3000), (288, 56, 12_345),
               (128, 33, 0), (200, 20, 0)]
OCC_TABLE: list[tuple[str, int, int, int, int]] = [
    (a, th, rg, sm, _occupancy(th, rg, 0, sm, a).blocks) for a in ARCHS
    for th, rg, sm in OCC_CONFIGS]


def _occ_variant(threads: int, regs: int, smem: int, lim: Limits, mistake: str) -> int:
    """The blocks per SM a calculation with one known mistake gives (for the hints)."""
    ws = lim.warp_size
    warps = threads // ws if mistake == "warps rounded down" else -(-threads // ws)
    if warps == 0:
        return -1
    if threads > lim.max_threads_per_block and mistake != "no block-size check":
        return 0
    by_warps = lim.max_warps_per_sm // warps
    if mistake == "threads, not warps":
        by_warps = lim.max_threads_per_sm // threads
    per_warp = regs * ws if mistake == "no register unit" else -(-regs * ws // 256) * 256
    if per_warp * -(-warps // 4) * 4 > lim.regs_per_block:
        return 0
    if not per_warp:
        by_regs = lim.max_blocks_per_sm
    elif mistake in ("no sub-partitions",):
        by_regs = lim.regs_per_sm // (per_warp * warps)
    else:
        by_regs = (lim.regs_per_sm // 4 // per_warp) * 4 // warps
    if smem > (lim.smem_per_block if mistake == "no opt-in" else lim.smem_per_block_optin):
        return 0
    need = smem + (0 if mistake == "no reserved shared memory" else lim.smem_reserved_per_block)
    if mistake != "no shared-memory unit":
        need = -(-need // lim.smem_alloc_unit) * lim.smem_alloc_unit
    by_smem = lim.smem_per_sm // need if need else lim.max_blocks_per_sm
    limits = [by_warps, by_regs, by_smem]
    if mistake != "no block limit":
        limits.append(lim.max_blocks_per_sm)
    return min(limits)


_MISTAKES = {
    "warps rounded down": "a block of 100 threads is 4 warps, not 3: round threads / 32 up",
    "no register unit": "registers are given to a warp in units of lim.reg_alloc_unit (256): "
                        "round regs x 32 up to a multiple of 256",
    "no sub-partitions": "the register file is split between lim.sub_partitions (4) warp "
                         "schedulers: warps per SM = 4 * floor((regs_per_sm / 4) / regs_per_warp)",
    "no reserved shared memory": "the driver reserves lim.smem_reserved_per_block (1 KiB on "
                                 "sm_80+) of shared memory for every block",
    "no shared-memory unit": "shared memory is allocated in units of lim.smem_alloc_unit (128 "
                             "or 256 bytes): round each block's bytes up",
    "no block limit": "an SM holds at most lim.max_blocks_per_sm blocks, however small",
    "no block-size check": "a block of more than lim.max_threads_per_block threads cannot "
                           "launch: 0 blocks",
    "threads, not warps": "an SM holds whole warps: a block of 100 threads takes 4 warps (128 "
                          "thread slots), so count the warps per SM, not the threads",
    "no opt-in": "the kernel opted in to lim.smem_per_block_optin bytes per block: a block may "
                 "use more than lim.smem_per_block (48 KiB, the limit without opting in)",
}

#: what an answer to ex05.2 may not call: the calculator it is asked to write, or the driver's
_OCC_LIBRARY = re.compile(r"(?<![\w.])(?:\w+\s*\.\s*)*(occupancy|blocks_per_sm|kernel_occupancy|"
                          r"driver_blocks_per_sm|compare_with_driver|\w*OccupancyMaxActiveBlocks\w*)"
                          r"\s*\(", re.I)


def _refuse_library(ex: str, fn: Callable) -> None:
    """GradeError when the answer calls an occupancy calculator instead of doing the arithmetic
    (a function the answer defines itself, ``blocks_per_sm`` or a helper, does not count)."""
    code = python_code(ex, fn)
    own = set(re.findall(r"\bdef\s+(\w+)", code))       # the answer's own functions
    code = re.sub(r"\bdef\s+\w+\s*\(", "def (", code)
    m = next((m for m in _OCC_LIBRARY.finditer(code)
              if not (m.group(1) in own and "." not in m.group(0))), None)
    if m:
        raise GradeError(f"{ex}: the answer calls {m.group(0).strip()}...): the exercise is the "
                         "arithmetic itself (warps, registers, shared memory, the block limit), "
                         "not a call of cb.occupancy or the driver's calculator")



def _grade_occupancy(ex: str, fn: Callable, cases: list[tuple[Limits, int, int, int, int]],
                     source: str) -> None:
    got_all, first_bad = [], None
    for lim, th, rg, sm, want in cases:
        try:
            got = fn(th, rg, sm, lim)
        except NotImplementedError:
            raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                             "NotImplementedError)") from None
        except Exception as e:  # noqa: BLE001
            why = ""
            if isinstance(e, ZeroDivisionError) and th < lim.warp_size:
                why = (f": a block of {th} threads is still one warp (round threads / "
                       f"{lim.warp_size} up)")
            elif isinstance(e, ZeroDivisionError) and sm + lim.smem_reserved_per_block == 0:
                why = (": this block needs no shared memory at all (and this SM reserves none "
                       "per block), so shared memory does not limit it: nothing to divide by")
            raise GradeError(f"{ex}: {lim.arch}, threads={th}, regs={rg}, smem={sm} ({source}): "
                             f"raised {type(e).__name__}: {e}{why}") from None
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
            raise GradeError(f"{ex}: return an int (blocks per SM), got {got!r}")
        got_all.append(int(got))
        if int(got) != want and first_bad is None:
            first_bad = (lim, th, rg, sm, want, int(got))
    if first_bad is None:
        return
    lim, th, rg, sm, want, got = first_bad
    o = _occupancy(th, rg, 0, sm, lim)
    for mistake, why in _MISTAKES.items():
        if all(_occ_variant(c[1], c[2], c[3], c[0], mistake) == g for c, g in
               zip(cases, got_all)):
            raise GradeError(f"{ex}: {lim.arch}, threads={th}, regs={rg}, smem={sm} bytes "
                             f"({source}): got {got} blocks, expected {want}: {why}")
    raise GradeError(f"{ex}: {lim.arch}, threads={th}, regs={rg}, smem={sm} bytes ({source}): "
                     f"got {got} blocks, expected {want} (the limits allow "
                     + ", ".join(f"{k}: {v}" for k, v in o.per_limit.items())
                     + f"; {o.limited_by} binds)")


def ex05_2(blocks_per_sm: Callable[[int, int, int, Limits], int]) -> None:
    """``blocks_per_sm(threads, regs, smem, lim)``: resident blocks per SM for a kernel with
    ``threads`` per block, ``regs`` registers per thread and ``smem`` bytes of shared memory per
    block (static + dynamic; assume the kernel opted in to ``lim.smem_per_block_optin``), on an SM
    described by ``lim`` (a ``cudabook.occupancy.Limits``).

    Checked against the stored answers for sm_75 ... sm_90 (24 configurations each); on a GPU,
    also against the driver (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) for compiled
    kernels with several register counts and shared-memory sizes.
    """
    ex = "ex05.2"
    _refuse_library(ex, blocks_per_sm)
    table = [(ARCHS[a], th, rg, sm, want) for a, th, rg, sm, want in OCC_TABLE]
    _grade_occupancy(ex, blocks_per_sm, table, "the calculation of cudabook.occupancy")
    _grade_occupancy(ex, blocks_per_sm, sweep_cases(), f"the driver on an {GPU}, stored")
    if env.HAS_GPU:
        _grade_occupancy(ex, blocks_per_sm, _driver_cases(), "the driver on this GPU")
    passed(ex)


def sweep_cases() -> list[tuple[Limits, int, int, int, int]]:
    """The stored driver answers (DRIVER_SWEEP) for kernels that opted in to the largest shared
    memory per block, as (limits, threads, registers, shared bytes, blocks per SM)."""
    if not DRIVER_SWEEP:
        return []
    lim = Limits(**{k: tuple(v) if isinstance(v, list) else v for k, v in LIMITS.items()})
    return [(lim, th, regs, static + dyn, blocks)
            for regs, static, opted, _maxdyn, maxth, th, dyn, blocks in DRIVER_SWEEP
            if opted and blocks >= 0 and th <= maxth]


def _driver_cases() -> list[tuple[Limits, int, int, int, int]]:
    """Configurations of compiled occupancy probes, answered by the driver on this GPU."""
    from ..compile import load_cuda
    from ..occupancy import device_limits, driver_blocks_per_sm

    lim = device_limits()
    out = []
    for opts in (("-DPROBE_LIVE=16",), ("-DPROBE_LIVE=250", "-maxrregcount=40"),
                 ("-DPROBE_LIVE=250", "-maxrregcount=168"),
                 ("-DPROBE_LIVE=32", "-DPROBE_SMEM=10000")):
        k = load_cuda("profiling", options=opts).get("occupancy_probe")
        static = int(k.attributes["shared_size_bytes"])
        k.max_dynamic_shared_size_bytes = lim.smem_per_block_optin - static
        regs = int(k.attributes["num_regs"])
        for th in (32, 96, 128, 200, 256, 512, 1024):
            if th > int(k.attributes["max_threads_per_block"]):
                continue
            for dyn in (0, 3000, 30_000, 70_000):
                out.append((lim, th, regs, static + dyn, driver_blocks_per_sm(k, th, dyn)))
    return out


# ============================================================================ ex05.3

#: ex05.3: the graph replay must be at least this many times faster than eager launches
GRAPH_FACTOR = 3.0
#: ex05.3: launches in the chain (one y = x * a + b, then y = y * a_i + b_i in place)
CHAIN_LENGTH = 60
CHAIN_N = 4096


def chain_source() -> str:
    """The kernel of the ex05.3 chain: y = x * a + b elementwise (in place when y is x)."""
    return r'''
extern "C" __global__ void affine(const float* x, float* y, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * a + b;
}'''


def _wall_us(fn: Callable[[], Any], repeat: int = 30) -> float:
    import cupy

    dev = cupy.cuda.Device()
    for _ in range(3):
        fn()
    dev.synchronize()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def _capturing() -> bool | None:
    """Whether CuPy's current stream is capturing a graph now (None: the query was refused)."""
    import cupy

    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - an illegal query (the legacy stream during a capture)
        return None


#: ex05.3: the work queued on the current stream ahead of the stream-order trial (ms)
ORDER_SPIN_MS = 20.0


def _refuse_graph_helper(ex: str, capture: Callable) -> None:
    """GradeError when the answer hands the capture to cb.graphs instead of writing it."""
    code = python_code(ex, capture)
    if (mentions(code, "graphs.capture") or mentions(code, "CapturedGraph")
            or re.search(r"from\s+cudabook(?:\.graphs)?\s+import[^\n]*\b(capture|graphs)\b",
                         code)):
        raise GradeError(f"{ex}: the answer calls cb.graphs.capture: the exercise is the lines it "
                         "hides (a non-blocking stream, begin_capture(), the chain inside `with "
                         "stream:`, end_capture(), graph.launch())")


def ex05_3(capture: Callable[[Callable[[], None]], Callable[[], None]],
           factor: float = GRAPH_FACTOR) -> None:
    """``capture(run_chain)`` returns a function that replays, from a CUDA graph, every launch of
    one call of ``run_chain()`` (CHAIN_LENGTH small kernels on the current stream).

    ``run_chain`` must run exactly once while the stream captures (a warm-up inside the capture
    would be replayed every time). The replay must compute the chain on whatever data is in the
    input buffer at replay time (two trials with fresh data, output NaN-filled before each), in
    order on the stream that is current when it is called (the second trial's data lands in x
    behind ORDER_SPIN_MS of work queued there), and one replay + synchronize must be at least
    ``factor`` times faster than ``run_chain()`` + synchronize.
    """
    ex = "ex05.3"
    _refuse_graph_helper(ex, capture)
    need_gpu(ex, "CUDA graphs are captured from CuPy launches")
    import cupy

    from ..compile import compile_source, load_cuda

    k = compile_source(chain_source(), name="ex05.3 chain").get("affine")
    spin = load_cuda("profiling").get("spin")
    mhz = cupy.cuda.Device().attributes["ClockRate"] / 1e3
    rng, seed = fresh_rng()
    n = CHAIN_N
    coef = [(np.float32(rng.uniform(0.9, 1.1)), np.float32(rng.uniform(-0.1, 0.1)))
            for _ in range(CHAIN_LENGTH)]
    x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
    y = cupy.empty(n, cupy.float32)
    grid, block, ni = (ceil_div(n, 256),), (256,), np.int32(n)
    calls: list[bool | None] = []          # per call of run_chain: was the stream capturing?

    def run_chain() -> None:
        calls.append(_capturing())
        k(grid, block, (x, y, coef[0][0], coef[0][1], ni))
        for a, b in coef[1:]:
            k(grid, block, (y, y, a, b, ni))

    def prefix(xh: np.ndarray, m: int) -> np.ndarray:   # the first m launches, in float64
        v = xh.astype(np.float64)
        for a, b in coef[:m]:
            v = v * float(a) + float(b)
        return v

    try:
        replay = capture(run_chain)
        cupy.cuda.Device().synchronize()
    except NotImplementedError:
        raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                         "NotImplementedError)") from None
    except Exception as e:  # noqa: BLE001
        raise GradeError(f"{ex}: capture(run_chain) raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''} (launch the chain inside "
                         "`with stream:` between stream.begin_capture() and "
                         "stream.end_capture(), on a non-blocking stream)") from None
    if not callable(replay):
        raise GradeError(f"{ex}: capture must return a function that replays the graph, got "
                         f"{type(replay).__name__}")
    captured = sum(1 for c in calls if c)
    if captured > 1:
        raise GradeError(f"{ex}: run_chain() ran {captured} times while the stream was capturing: "
                         f"the graph holds {captured} x {CHAIN_LENGTH} launches and every replay "
                         "runs them all (a warm-up inside the capture is replayed too). Warm up "
                         "before begin_capture(); capture one call")
    captured_calls = len(calls)
    x_before = None
    for trial in range(2):
        xh = rng.standard_normal(n, dtype=np.float32)
        y.fill(np.nan)
        case = f"trial {trial + 1} (seed {seed})"
        if trial == 0:
            x[...] = cupy.asarray(xh)
            cupy.cuda.Device().synchronize()
        else:       # the new data lands in x behind ORDER_SPIN_MS of work on the current stream
            xd = cupy.asarray(xh)
            cupy.cuda.Device().synchronize()
            spin((1,), (1,), (np.int64(ORDER_SPIN_MS * 1e3 * mhz),))
            x[...] = xd
            case += f", x refilled on the current stream behind {ORDER_SPIN_MS:.0f} ms of work"
        try:
            replay()
            cupy.cuda.get_current_stream().synchronize()
            cupy.cuda.Device().synchronize()
        except Exception as e:  # noqa: BLE001
            raise GradeError(f"{ex}: the replay raised {type(e).__name__}: {e}") from None
        got = to_numpy(y).astype(np.float64)
        if np.isnan(got).all():
            raise GradeError(f"{ex}: {case}: the replay wrote nothing: the graph is empty. Were "
                             "the launches made on the capturing stream (inside `with stream:`)"
                             "? Launched elsewhere they run at once and are not recorded.")
        want = prefix(xh, CHAIN_LENGTH)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            if x_before is not None and np.allclose(got, prefix(x_before, CHAIN_LENGTH),
                                                    rtol=1e-4, atol=1e-5):
                raise GradeError(f"{ex}: {case}: the replay computed on x as it was before the "
                                 "work queued on the current stream had finished: the graph ran "
                                 "on another stream (graph.launch(stream=...) with the capture "
                                 "stream?). Launch it on the stream current when the replay is "
                                 "called, graph.launch() with no argument, so it runs after the "
                                 "work queued there and before the work queued after it")
            part = next((m for m in range(CHAIN_LENGTH) if np.allclose(got, prefix(xh, m),
                                                                       rtol=1e-4, atol=1e-5)),
                        None)
            if part is not None:
                raise GradeError(f"{ex}: {case}: the replay ran only the first {part} of the "
                                 f"{CHAIN_LENGTH} launches: was the capture ended early?")
            raise GradeError(f"{ex}: {case}: wrong output after the replay (first element "
                             f"{got[0]:.6g}, expected {want[0]:.6g}); does the replay compute "
                             "on the current contents of x (the same buffers as at capture)?")
        x_before = xh
    if len(calls) != captured_calls:
        raise GradeError(f"{ex}: the replay called run_chain() again ({len(calls) - captured_calls}"
                         " extra calls): it must launch the captured graph instead")
    if captured == 0 and None not in calls:
        raise GradeError(f"{ex}: run_chain() never ran while the stream was capturing, yet the "
                         "replay computed the chain: call it between begin_capture() and "
                         "end_capture(), inside `with stream:`")
    t_eager = _wall_us(run_chain)
    t_graph = _wall_us(replay)
    if t_eager < factor * t_graph:
        raise GradeError(f"{ex}: correct, but a replay takes {t_graph:.1f} us against "
                         f"{t_eager:.1f} us for the eager launches ({t_eager / t_graph:.1f}x; "
                         f"the goal is {factor:.0f}x): is the capture done once, in capture(), "
                         "and only graph.launch() left in the replay?")
    passed(ex)


# ============================================================================ ex05.4

SPIN_US = (100.0, 1000.0, 3000.0)
#: ex05.4: the work queued ahead of the last case, which the timer must not count (us)
QUEUED_US = 20_000.0


def _timer_verdict(ex: str, case: str, got: float, want: float, queued_ms: float = 0.0) -> None:
    """GradeError when ``got`` (ms, from the answer) is not the kernel's ``want`` (ms)."""
    if got < 0:
        raise GradeError(f"{ex}: {case}: measured {got:.4f} ms, a negative time: "
                         "cp.cuda.get_elapsed_time(start, end) takes the earlier event first")
    if got < 0.5 * want:
        if 0.5 * want < got * 1e3 < 1.5 * want:
            raise GradeError(f"{ex}: {case}: got {got:.6f}: seconds instead of milliseconds?")
        raise GradeError(f"{ex}: {case}: measured {got:.4f} ms: the timer stopped before "
                         "the GPU finished - the launch is asynchronous; synchronize (or "
                         "wait on an end event) before reading the clock")
    if got > 1.15 * want + 0.03:
        if 0.5 * want < got / 1e3 < 1.5 * want:
            raise GradeError(f"{ex}: {case}: got {got:.1f}: microseconds instead of "
                             "milliseconds?")
        if queued_ms and got > 0.5 * queued_ms:
            raise GradeError(f"{ex}: {case}: measured {got:.3f} ms: the timer counted the "
                             f"{queued_ms:.0f} ms of work queued on the GPU before time_gpu was "
                             "called. Wait for the GPU (synchronize) before starting the clock, "
                             "or record a start event on the stream: the GPU stamps it only "
                             "when the queued work is done")
        for k in (2, 3, 5, 6):
            if abs(got - k * want) < 0.1 * k * want:
                raise GradeError(f"{ex}: {case}: measured {got:.3f} ms, {k} times the kernel's "
                                 f"{want:.3f} ms: the time of several calls (a sum, or the "
                                 "warm-up inside the timed interval)? Return one call's time")
        raise GradeError(f"{ex}: {case}: measured {got:.4f} ms, more than the kernel takes: "
                         "does the timed interval include work queued before fn (wait for "
                         "the GPU before starting the clock) or several calls?")


def ex05_4(time_gpu: Callable[..., float]) -> None:
    """``time_gpu(fn, repeat)`` returns the median time of one call of ``fn()`` in milliseconds,
    all the GPU work that ``fn`` launched included and nothing queued before it.

    Fed kernels that busy-wait a known number of clock cycles (``spin`` of kernels/profiling.cu,
    about 0.1, 1 and 3 ms), whose durations the grader measures with CUDA events first; last, the
    1 ms kernel timed once (repeat=1) right after QUEUED_US of work was queued, unwaited.
    """
    ex = "ex05.4"
    need_gpu(ex, "it times GPU kernels")
    import cupy

    from ..compile import load_cuda

    spin = load_cuda("profiling").get("spin")
    mhz = cupy.cuda.Device().attributes["ClockRate"] / 1e3

    def launcher(us: float) -> Callable[[], None]:
        cycles = np.int64(us * mhz)
        return lambda: spin((1,), (1,), (cycles,))

    def truth_ms(fn: Callable[[], None]) -> float:
        ts = []
        for _ in range(3):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b))
        return statistics.median(ts)

    for us, repeat, queued in [(u, 5, 0.0) for u in SPIN_US] + [(SPIN_US[1], 1, QUEUED_US)]:
        fn = launcher(us)
        want = truth_ms(fn)
        cupy.cuda.Device().synchronize()
        case = f"a kernel that runs {want:.3f} ms"
        if queued:
            launcher(queued)()          # queued ahead of time_gpu, not waited for
            case += f", timed once right after {queued / 1e3:.0f} ms of work was queued"
        try:
            got = time_gpu(fn, repeat)
        except NotImplementedError:
            raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                             "NotImplementedError)") from None
        except Exception as e:  # noqa: BLE001
            hint = (" - an event's time can be read only after the GPU has passed it: "
                    "end.synchronize() first" if "NotReady" in type(e).__name__ + str(e) else "")
            raise GradeError(f"{ex}: kernel of {want:.3f} ms: raised {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}{hint}") from None
        cupy.cuda.Device().synchronize()
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, float, np.floating)):
            raise GradeError(f"{ex}: return the time as a float in milliseconds, got {got!r}")
        _timer_verdict(ex, case, float(got), want, queued / 1e3)
    passed(ex)


# ============================================================================ ex05.5

#: ex05.5: the shape timed (rows x columns, float32: 128 MiB) and the one Nsight Compute profiles
ROW_SUM_SHAPE = (8192, 4096)
ROW_SUM_NCU_SHAPE = (2048, 4096)
#: ex05.5: rows per block of the fixed kernel's launch (256 threads), given in the specification
ROW_SUM_ROWS = 8
#: ex05.5: the fixed kernel must be at least this fast relative to a copy of x timed in the same
#: run (the copy reads and writes M N floats, the row sum only reads them: a kernel that reads
#: at the copy's bandwidth reaches about 2; the slow kernel stays far below 1)
ROW_SUM_MIN_RATIO = 1.0
#: ex05.5: global-load sectors the fixed kernel may request, as a multiple of the sectors that
#: hold the input once (32 bytes each): coalesced loads request each sector once (1.0)
ROW_SUM_MAX_SECTORS = 1.5
#: ex05.5: (rows, columns) of the correctness cases: one row, one column, a warp's worth, one
#: block of rows +- 1, columns that are no multiple of 32, more rows than one block holds
ROW_SUM_CASES = [(1, 1), (1, 33), (7, 1), (8, 31), (9, 32), (3, 1000), (257, 129),
                 (1000, 3), (300, 4097), (17, 65537)]


def _race_ex05_5(k) -> None:
    """Sanitizer driver: ragged shapes, a few blocks."""
    import cupy

    for M, N in ((33, 1000), (8, 31)):
        x = cupy.asarray(np.random.default_rng(0).standard_normal((M, N), dtype=np.float32))
        out = cupy.empty(M, cupy.float32)
        k((ceil_div(M, ROW_SUM_ROWS),), (256,), (x, out, np.int32(M), np.int32(N)))


def row_sum_slow_source() -> str:
    """The slow kernel of ex05.5: one thread per row, each walking its own row."""
    return r'''
// out[row] = x[row, 0] + ... + x[row, N - 1]; x is (M, N), row-major.
// launch: grid (ceil(M / 256)), block 256: one thread per row
extern "C" __global__ void row_sum_slow(const float* x, float* out, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M) return;
    float s = 0.0f;
    for (int j = 0; j < N; j++) s += x[(size_t)row * N + j];
    out[row] = s;
}'''


def _squash(code: str) -> str:
    return re.sub(r"\s+", "", code)


def _row_sum_static(ex: str, src: str) -> None:
    """The rubric that needs no GPU: a CUDA C++ string, no library reduction, not the slow
    kernel's loop."""
    from ._static import cuda_code

    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = cuda_code(src)
    lib = re.search(r"\b(cub|thrust|cooperative_groups::reduce|cg::reduce)\b|#\s*include\s*<"
                    r"(cub|thrust)", code)
    if lib:
        raise GradeError(f"{ex}: the answer calls a library ({lib.group(0).strip()}): the "
                         "exercise is the kernel's own loads and reduction (the profile shows "
                         "what to change in the loads; a warp shuffle or shared memory combines "
                         "the partial sums)")
    slow = _squash(cuda_code(row_sum_slow_source()))
    loop = slow[slow.index("for(intj=0"):slow.index("out[row]=s;")]
    if loop in _squash(code):
        raise GradeError(f"{ex}: this is the slow kernel's loop (each thread walks its own row "
                         "from j = 0 to N - 1): in one load instruction the 32 lanes of a warp "
                         "read 32 different rows, N * 4 bytes apart, so every lane needs its own "
                         "32-byte sector. Make the lanes of a warp read neighbouring elements of "
                         "one row instead")


def _row_sum_check(ex: str, case: str, out, buf, x: np.ndarray) -> None:
    """GradeError naming the likely mistake unless ``out`` holds the row sums of ``x``."""
    from ..check import dot_tolerance
    from ._core import canary_ok, close

    M, N = x.shape
    o = to_numpy(out).astype(np.float64)
    x64 = x.astype(np.float64)
    ref = x64.sum(axis=1)
    if not canary_ok(buf, M):
        raise GradeError(f"{ex}: {case}: wrote past the end of out (M={M}): rows beyond M "
                         "must not write (a guard if (row < M) for the block's last rows?)")
    nan = np.isnan(o)
    if nan.all():
        raise GradeError(f"{ex}: {case}: out never written (all NaN): is the kernel still the "
                         "stub?")
    if nan.any():
        first = int(np.argmax(nan))
        raise GradeError(f"{ex}: {case}: {int(nan.sum())} of {M} rows never written, first "
                         f"row {first}: the grid has ceil(M / {ROW_SUM_ROWS}) blocks of "
                         f"{ROW_SUM_ROWS} rows; does every row of a block get its sum written "
                         f"(row = blockIdx.x * {ROW_SUM_ROWS} + ...)?")
    tol = dot_tolerance(N)
    scale = np.abs(x64).sum(axis=1)
    atol = tol["atol"] * np.maximum(scale / max(N, 1), 1.0)     # per row: rows of 1e30 too
    bad = ~close(o, ref, atol, tol["rtol"])
    if not bad.any():
        return
    r = int(np.argmax(bad))
    msg = (f"{ex}: {case}: row {r}: got {o[r]:.7g}, expected {ref[r]:.7g} ({int(bad.sum())} of "
           f"{M} rows wrong)")
    lane0 = x64[:, ::32].sum(axis=1)
    if N > 32 and close(o, lane0, atol, tol["rtol"])[bad].all():
        raise GradeError(f"{msg}: that is lane 0's share alone (elements 0, 32, 64, ...): "
                         "the 32 lanes' partial sums must be added together (a shuffle "
                         "reduction over the warp) before lane 0 writes")
    if N > 1 and np.isclose(o[r], 2 * ref[r], rtol=1e-3):
        raise GradeError(f"{msg}: twice the sum: an element counted twice, or the reduction "
                         "adds a lane to itself (__shfl_xor_sync with offsets 16, 8, 4, 2, 1)?")
    raise GradeError(f"{msg}: does every element of the row enter the sum exactly once (j from "
                     "lane, stepping by 32, up to N), and do the shuffle offsets halve from 16 "
                     "down to 1?")


def _row_sum_ratio(kern, rows: int = ROW_SUM_ROWS, quiet: bool = True,
                   name: str = "row_sum (yours)") -> tuple[float, float, float]:
    """(ratio, your us, the copy's us) at ROW_SUM_SHAPE, timed in one call of cb.bench; ``rows``
    rows per block of 256 threads."""
    import cupy

    from ..bench import bench

    M, N = ROW_SUM_SHAPE
    x = cupy.random.standard_normal((M, N), dtype=cupy.float32)
    y = cupy.empty_like(x)
    out = cupy.empty(M, cupy.float32)
    grid = (ceil_div(M, rows),)
    t = bench({name: lambda: kern(grid, (256,), (x, out, np.int32(M), np.int32(N)))},
              baseline={"copy of x": lambda: cupy.copyto(y, x)}, bytes=4.0 * M * N,
              repeat=10, quiet=quiet)
    row, base = t[name], t["copy of x"]
    return row.ratio, row.time_us, base.time_us


_NCU_TARGET = '''
import numpy as np, cupy
from cudabook.graders._core import compile_kernel
k = compile_kernel("ex05.5", open({path!r}).read(), {kernel!r})
M, N = {M}, {N}
x = cupy.random.standard_normal((M, N), dtype=cupy.float32)
out = cupy.empty(M, cupy.float32)
k(({grid},), (256,), (x, out, np.int32(M), np.int32(N)))
cupy.cuda.Device().synchronize()
'''


def row_sum_counters(src: str, kernel: str = "row_sum", rows: int = ROW_SUM_ROWS,
                     stalls: bool = False):
    """Nsight Compute's global-load counters of ``kernel`` (ex05.5's signature, ``rows`` rows
    per block of 256 threads) at ROW_SUM_NCU_SHAPE: ``(sectors / the sectors that hold x,
    report)``; the first is None where no counters could be read (``report.message`` says
    why)."""
    import tempfile

    from ..ncu import METRICS, profile

    M, N = ROW_SUM_NCU_SHAPE
    keys = ("time_ns", "gld_sectors", "gld_requests", "dram_bytes", "l1_hit_pct")
    with tempfile.TemporaryDirectory(prefix="cb_ex05_5_") as tmp:
        path = f"{tmp}/row_sum.cu"
        with open(path, "w") as f:
            f.write(src)
        rep = profile(_NCU_TARGET.format(path=path, kernel=kernel, M=M, N=N,
                                         grid=ceil_div(M, rows)),
                      kernel=kernel, stalls=stalls, metrics={k: METRICS[k] for k in keys})
    if not rep or rep[0].get("gld_sectors") is None:
        return None, rep
    return rep[0].get("gld_sectors") / (M * N * 4 / 32), rep


def row_sum_profile(src: str, kernel: str = "row_sum", rows: int = ROW_SUM_ROWS) -> None:
    """Print what ex05.5's grader measures of ``kernel``: its time against a copy of x at
    ROW_SUM_SHAPE, and Nsight Compute's load counters at ROW_SUM_NCU_SHAPE (or why there are
    none)."""
    from ._core import compile_kernel

    kern = compile_kernel("ex05.5", src, kernel)
    ratio, _, _ = _row_sum_ratio(kern, rows, quiet=False, name=kernel)
    print(f"{kernel}: {ratio:.2f} times the speed of the copy (the grader asks for "
          f"{ROW_SUM_MIN_RATIO:g})")
    sectors, rep = row_sum_counters(src, kernel, rows, stalls=True)
    if sectors is None:
        print(rep.message)
        return
    M, N = ROW_SUM_NCU_SHAPE
    print(f"Nsight Compute, {M} x {N}:")
    print(rep.table(columns=("time", "dram", "l1", "sectors", "stall")))
    print(f"global-load sectors: {sectors:.2f} times those that hold x (the grader allows "
          f"{ROW_SUM_MAX_SECTORS:g})")


def ex05_5(src: str, min_ratio: float = ROW_SUM_MIN_RATIO) -> None:
    """``src`` defines ``row_sum(const float* x, float* out, int M, int N)``: out[r] = the sum of
    row r of x (M, N), launched with blocks of 256 threads and grid (ceil(M / ROW_SUM_ROWS)).

    First the source (no GPU needed): no library reduction, not the slow kernel's loop. On a
    GPU: ROW_SUM_CASES twice each with fresh data (rows of 1e30 among them), x followed by zeros
    so that a missing row guard reads no foreign memory, out NaN-filled with a canary; then at
    ROW_SUM_SHAPE at least ``min_ratio`` of the speed of a copy of x in the same run (timed again
    once when the first result is within 20% below the goal); then, where Nsight Compute can
    read counters, at most ROW_SUM_MAX_SECTORS times the global-load sectors that hold the input
    (a correct kernel that is fast enough here but still uncoalesced fails there). Without
    counters the speed decides alone, and a failure says so.
    """
    ex = "ex05.5"
    _row_sum_static(ex, src)
    need_gpu(ex)
    import cupy

    from ._core import compile_kernel, guarded, padded

    kern = compile_kernel(ex, src, "row_sum")
    rng, seed = fresh_rng()
    for M, N in ROW_SUM_CASES:
        for rep in range(2):
            x = rng.standard_normal((M, N), dtype=np.float32)
            if M > 2:
                x[M // 2] *= np.float32(1e30)       # extreme values: still finite sums
            xd = padded(x, ROW_SUM_ROWS * N)
            out, buf = guarded((M,))
            case = f"M={M}, N={N} (seed {seed}, call {rep + 1})"
            try:
                kern((ceil_div(M, ROW_SUM_ROWS),), (256,), (xd, out, np.int32(M), np.int32(N)))
                cupy.cuda.Device().synchronize()
            except Exception as e:  # noqa: BLE001
                raise GradeError(f"{ex}: {case}: the launch failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None
            _row_sum_check(ex, case, out, buf, x)
    racecheck(ex, src, "row_sum", "cudabook.graders.ch05:_race_ex05_5",
              hint="a __syncthreads() between writing the partial sums to shared memory and "
                   "reading them")
    from ..ncu import find_ncu

    no_ncu = ("" if find_ncu() else " (Nsight Compute is not installed here, so the speed "
              "alone is graded)")
    ratio, mine, copy = _row_sum_ratio(kern)
    if 0.8 * min_ratio <= ratio < min_ratio:          # near the goal: a busy moment? once more
        ratio, mine, copy = max((ratio, mine, copy), _row_sum_ratio(kern))
    M, N = ROW_SUM_SHAPE
    if ratio < min_ratio:
        raise GradeError(f"{ex}: correct, but {mine:.0f} us for {M} x {N}: {ratio:.2f} times "
                         f"the speed of a copy of x ({copy:.0f} us, timed in the same run); the "
                         f"goal is {min_ratio:g}. The row sum reads what the copy reads and "
                         "writes almost nothing. Read the profile: are the 32 loads of one "
                         "warp instruction 32 neighbouring floats (lane j reads element j, then "
                         f"j + 32, ...)?{no_ncu}")
    sectors, rep = row_sum_counters(src)
    if sectors is not None and sectors > ROW_SUM_MAX_SECTORS:
        Mc, Nc = ROW_SUM_NCU_SHAPE
        per_request = rep[0].sectors_per_request or 0.0
        raise GradeError(f"{ex}: fast enough on this GPU ({ratio:.2f} times the copy's speed), "
                         f"but Nsight Compute counts {sectors:.1f} times the global-load "
                         f"sectors that hold x ({per_request:.1f} sectors per request, at "
                         f"{Mc} x {Nc}): the loads are still uncoalesced (does each lane walk "
                         "its own stretch of the row?). A warp's load instruction should read "
                         "32 neighbouring floats: 4 sectors, each used whole")
    passed(ex)
