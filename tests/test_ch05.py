"""Chapter 5: the profiling helpers (the occupancy calculator against the driver's stored answers,
the Nsight Compute parser and its one-line messages, the PyTorch-trace reader, CUDA graph
capture) and the graders ex05_1..ex05_5: the reference from solutions/05_profiling.ipynb passes,
the stub fails, wrong answers generated from the reference fail with the hint of their mistake."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from solution_cells import Solution, check_exercise_page, exercise_page

import cudabook as cb
from cudabook import env, ncu, torchtrace
from cudabook import occupancy as oc
from cudabook.graders import GradeError, ch05, ex05_1, ex05_2, ex05_3, ex05_4, ex05_5

SOL = Solution("05")
gpu = pytest.mark.gpu
HAS_DATA = pytest.mark.skipif(not ch05.NCU_CASES or not ch05.DRIVER_SWEEP,
                              reason="cudabook/graders/_ch05_data.py not generated yet")


# ============================================================================ occupancy

@pytest.mark.parametrize("arch, threads, regs, smem, blocks, limited_by", [
    ("sm_90", 256, 32, 0, 8, "warps"),          # 64 warps / 8 per block
    ("sm_90", 128, 255, 0, 2, "registers"),     # 8192 per warp, 2 warps per sub-partition
    ("sm_90", 1024, 64, 0, 1, "registers"),     # 2048 per warp: 32 warps fit, not 64
    ("sm_90", 1024, 72, 0, 0, "registers"),     # 2304 x 32 warps > 65536: cannot launch
    ("sm_90", 64, 16, 7000, 28, "shared memory"),   # (7000 + 1024) -> 8064 bytes per block
    ("sm_90", 32, 16, 0, 32, "blocks"),
    ("sm_75", 1024, 32, 0, 1, "warps"),         # a T4 holds 32 warps
    ("sm_75", 256, 32, 0, 4, "warps"),
    ("sm_75", 256, 32, 20_000, 3, "shared memory"),   # 20224 bytes (unit 256), 64 KiB per SM
    ("sm_80", 256, 32, 232_448, 0, "shared memory"),  # more than an A100 block may have
    ("sm_86", 128, 48, 0, 10, "registers"),    # 1536 per warp: 10 per sub-partition = 40 warps
    ("sm_90", 2048, 16, 0, 0, "warps"),         # more than 1024 threads per block
])
def test_occupancy_cases(arch, threads, regs, smem, blocks, limited_by):
    o = oc.occupancy(threads, regs, 0, smem, arch)
    assert (o.blocks, o.limited_by) == (blocks, limited_by), str(o)
    assert oc.blocks_per_sm(threads, regs, smem, arch) == blocks
    assert f"{blocks} blocks/SM" in str(o)


def test_occupancy_refuses_bad_input():
    with pytest.raises(ValueError, match="no occupancy limits for 'sm_70'"):
        oc.limits("sm_70")
    with pytest.raises(ValueError, match="regs must be a non-negative int"):
        oc.occupancy(128, -1, dev="sm_90")
    with pytest.raises(ValueError, match="at least one thread"):
        oc.occupancy(0, 32, dev="sm_90")
    with pytest.raises(ValueError, match="threads must be a non-negative int"):
        oc.occupancy(128.0, 32, dev="sm_90")


def test_shared_memory_allocation_unit():
    """256 B on compute capability 7.x, 128 B from 8.x on: cudaOccSMemAllocationGranularity in the
    toolkit's cuda_occupancy.h (the CUDA Occupancy Calculator). 4900 bytes is a size where the unit
    decides the answer on sm_75."""
    assert oc.ARCHS["sm_75"].smem_alloc_unit == 256
    assert {oc.ARCHS[a].smem_alloc_unit for a in ("sm_80", "sm_86", "sm_89", "sm_90")} == {128}
    o = oc.occupancy(32, 16, 0, 4900, "sm_75")
    assert (o.smem_per_block, o.per_limit["shared memory"]) == (5120, 12)
    in_128 = oc.occupancy(32, 16, 0, 4900, replace(oc.ARCHS["sm_75"], smem_alloc_unit=128))
    assert (in_128.smem_per_block, in_128.per_limit["shared memory"]) == (4992, 13)
    o = oc.occupancy(32, 16, 0, 4900, "sm_90")          # + the 1 KiB reserve, in units of 128
    assert o.smem_per_block == 6016


def test_occupancy_kernel_limits():
    # a launch may not ask for more dynamic shared memory than the kernel allows
    assert oc.occupancy(128, 32, 0, 60_000, "sm_90", max_dynamic=48 * 1024 - 0).blocks == 0
    assert oc.occupancy(128, 32, 0, 60_000, "sm_90").blocks == 3
    # __launch_bounds__(256): 512 threads cannot launch
    assert oc.occupancy(512, 32, 0, 0, "sm_90", max_threads=256).blocks == 0
    # a preferred carve-out of 50% of 228 KiB -> the 132 KiB configuration
    assert oc.occupancy(128, 32, 0, 40_000, "sm_90", carveout=50).blocks == 3


@HAS_DATA
def test_calculator_matches_the_stored_driver_sweep():
    """Every configuration the driver answered on the GPU of the probe run."""
    lim = oc.Limits(**{k: tuple(v) if isinstance(v, list) else v
                       for k, v in ch05.LIMITS.items()})
    bad = []
    for regs, static, _opted, maxdyn, maxth, th, dyn, blocks in ch05.DRIVER_SWEEP:
        ours = oc.occupancy(th, regs, static, dyn, lim, max_dynamic=maxdyn,
                            max_threads=maxth).blocks
        if ours != max(blocks, 0):
            bad.append((regs, static, maxdyn, th, dyn, ours, blocks))
    assert len(ch05.DRIVER_SWEEP) > 2000
    assert not bad, f"{len(bad)} mismatches, first {bad[:5]}"


def test_stored_table_is_the_calculator():
    for arch, th, rg, sm, want in ch05.OCC_TABLE:
        assert oc.occupancy(th, rg, 0, sm, arch).blocks == want
    # each rule decides some configuration (so a formula without it fails the grader)
    for mistake in ch05._MISTAKES:
        assert any(ch05._occ_variant(th, rg, sm, oc.ARCHS[a], mistake) != want
                   for a, th, rg, sm, want in ch05.OCC_TABLE), mistake


@gpu
def test_calculator_matches_the_driver_here():
    dev = oc.device_limits()
    k = cb.load_cuda("profiling", options=("-DPROBE_LIVE=250", "-maxrregcount=72")) \
        .get("occupancy_probe")
    rows = oc.compare_with_driver(k, [32, 96, 128, 256, 1000], [0, 5000, 40_000], dev)
    assert all(ours == max(theirs, 0) for _, _, ours, theirs in rows), rows


# ============================================================================ Nsight Compute

def _csv(rows: list[dict[str, str]]) -> str:
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC"] + list(ncu.METRICS.values()) + \
        [ncu._STALL.format(r) for r in ("long_scoreboard", "barrier", "not_selected")]
    units = {m: "" for m in head}
    units.update({ncu.METRICS["time_ns"]: "nsecond", ncu.METRICS["dram_bytes"]: "byte"})
    q = lambda vals: ",".join(f'"{v}"' for v in vals)
    lines = ["==PROF== Connected to process 1 (python3)", q(head),
             q([units[m] if m in units else "" for m in head])]
    for r in rows:
        lines.append(q([r.get(h, "") for h in head]))
    lines.append("==PROF== Disconnected from process 1")
    return "\n".join(lines)


def test_parse_csv_and_table():
    M = ncu.METRICS
    row = {"ID": "0", "Kernel Name": "matmul_v1", "Block Size": "(32, 32, 1)",
           "Grid Size": "(64, 64, 1)", M["time_ns"]: "35,000,000", M["sm_pct"]: "12.5",
           M["mem_pct"]: "95.1", M["dram_bytes"]: "70000000", M["gld_sectors"]: "3200",
           M["gld_requests"]: "100", M["occ_pct"]: "98.2", M["occ_limit_warps"]: "2",
           M["occ_limit_blocks"]: "32", M["occ_limit_regs"]: "2", M["occ_limit_smem"]: "16",
           M["max_warps"]: "64", M["block"]: "1024",
           M["regs"]: "32", M["smem_static"]: "0", M["smem_dynamic"]: "1024",
           M["bank_ld"]: "0", M["bank_st"]: "n/a",
           ncu._STALL.format("long_scoreboard"): "61.0", ncu._STALL.format("barrier"): "2",
           ncu._STALL.format("not_selected"): "70"}
    ks = ncu.parse_csv(_csv([row, dict(row, ID="1", **{"Kernel Name": "matmul_v2(float*)"})]))
    assert [k.name for k in ks] == ["matmul_v1", "matmul_v2"]
    k = ks[0]
    assert k.time_us == pytest.approx(35_000.0)
    assert k.dram_gbs == pytest.approx(2.0)              # 70 MB in 35 ms
    assert k.sectors_per_request == pytest.approx(32.0)
    assert k.smem_bytes == 1024 and k.bank_conflicts == 0
    assert k.top_stalls(1) == [("long_scoreboard", 61.0)]   # not_selected is not a stall
    assert k.theoretical_occupancy == pytest.approx(100.0)      # 2 blocks of 32 warps of 64
    rep = ncu.NcuReport(ks)
    text = rep.table()
    assert "matmul_v1" in text and "long_scoreboard 61%" in text and "32.0" in text
    assert "v1" in rep.table(columns=("time", "sectors"), names=["v1", "v2"])
    with pytest.raises(ValueError, match="unknown column"):
        rep.table(columns=("nope",))
    with pytest.raises(ValueError, match="2 launches"):
        rep.table(names=["only one"])
    with pytest.raises(KeyError, match="no profiled launch"):
        rep["matmul_v9"]
    assert ncu.parse_csv("no csv here\n") == []


def test_reports_without_counters_print_one_line(capsys):
    msg = ncu._why_not("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission", 1)
    assert "no permission" in msg and "\n" not in msg
    rep = ncu.NcuReport([], msg)
    assert not rep and str(rep) == msg
    rep.show()
    assert capsys.readouterr().out.strip() == msg
    assert ncu._why_not("==ERROR== Failed to find metric foo\n", 1) == \
        "Nsight Compute failed: Failed to find metric foo"
    assert ncu._unknown_metrics("==ERROR== Failed to find metric sm__nope.sum\n") == \
        {"sm__nope.sum"}
    assert "no kernel launch matched" in ncu._why_not("==WARNING== No kernels were profiled.", 0)


def test_profile_without_gpu_or_ncu(monkeypatch):
    def target():
        import cupy  # noqa: F401

    if not env.HAS_GPU:
        rep = ncu.profile(target)
        assert not rep and "needs a CUDA GPU" in rep.message
    monkeypatch.setattr(env, "HAS_GPU", True)
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    rep = ncu.profile(target)
    assert not rep and "not installed" in rep.message
    with pytest.raises(ValueError, match="clock_control"):
        ncu.profile(target, clock_control="max")


def test_profile_command_line(monkeypatch, tmp_path):
    """What cb.ncu.profile asks of ncu: the clocks left free (so durations compare with cb.bench)
    unless clock_control="base", and no --cache-control, so ncu's default (all: caches flushed
    before every replay pass) applies. The command is kept on the report."""
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(env, "HAS_GPU", True)
    monkeypatch.setattr(ncu, "find_ncu", lambda: str(fake))
    rep = ncu.profile("x = 1", kernel="regex:matmul_v", launch_count=3)
    cmd = rep.command
    assert not rep and cmd[0] == str(fake)
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--launch-count") + 1] == "3"
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:matmul_v"
    assert not any(a.startswith("--cache-control") for a in cmd)
    cmd = ncu.profile("x = 1", clock_control="base").command
    assert cmd[cmd.index("--clock-control") + 1] == "base"


def _standalone():
    x = 1
    return x


def test_script_of_a_function():
    s = ncu._script(_standalone)
    assert "def _standalone" in s or "import _standalone" in s
    assert s.rstrip().endswith("_standalone()")
    assert "print(1)" in ncu._script("print(1)")
    with pytest.raises(TypeError, match="lambda"):
        ncu._script(lambda: None)
    with pytest.raises(TypeError, match="function or a string"):
        ncu._script(3)


@gpu
def test_profile_one_kernel():
    def add_once():
        import cupy as cp
        import numpy as np

        import cudabook as cb

        va = cb.load_cuda("vector_add")
        x = cp.ones(4096, cp.float32)
        va.vector_add_v1((16,), (256,), (x, x, x, np.int32(4096)))
        cp.cuda.Device().synchronize()

    rep = ncu.profile(add_once, kernel="vector_add_v1")
    if not rep and ("permission" in rep.message or "not installed" in rep.message):
        pytest.skip(rep.message)
    assert len(rep) == 1 and rep[0].name == "vector_add_v1", rep.message
    assert rep[0].time_us > 0 and rep[0].get("regs") > 0


# ============================================================================ traces

def _ev(cat, name, ts, dur, corr=None, **args):
    a = dict(args)
    if corr is not None:
        a["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": a}


def _trace():
    return [_ev("user_annotation", "step", 0, 100),
            _ev("cuda_runtime", "cudaLaunchKernel", 10, 5, corr=1),
            _ev("cuda_driver", "cuLaunchKernel", 20, 4, corr=2),
            _ev("cuda_runtime", "cudaMemcpyAsync", 30, 8, corr=3),
            _ev("cuda_runtime", "cudaLaunchKernel", 200, 5, corr=4),      # outside "step"
            _ev("kernel", "gemm", 15, 10, corr=1),
            _ev("kernel", "bias_gelu_v1", 40, 10, corr=2),
            _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 50, 20, corr=3,
                bytes=2_000_000),
            _ev("kernel", "gemm", 210, 10, corr=4),
            {"ph": "i", "name": "instant", "ts": 3}]


def test_trace_summary_within_a_range():
    evs = torchtrace.events({"traceEvents": _trace()})
    assert all(e["ph"] == "X" for e in evs)
    s = torchtrace.summary(evs, within="step",
                           origin=lambda n: "CuPy" if n.startswith("bias") else "PyTorch")
    assert [(k[0], k[1], k[2]) for k in s.kernels] == [("gemm", "PyTorch", 1),
                                                       ("bias_gelu_v1", "CuPy", 1)]
    assert s.copies[0][0].startswith("Memcpy HtoD") and s.copies[0][4] == pytest.approx(100.0)
    assert s.window_us == 55 and s.busy_us == 40 and s.gaps == [15]
    assert s.host_us == 100 and s.busy_pct == pytest.approx(100 * 40 / 55)
    assert "bias_gelu_v1" in str(s) and "cuLaunchKernel" in str(s)
    with pytest.raises(KeyError, match="no record_function range 'nope'"):
        torchtrace.select(evs, "nope")
    with pytest.raises(TypeError, match="expected a profiler"):
        torchtrace.events(42)


def test_trace_timeline_draws():
    import matplotlib

    matplotlib.use("Agg")
    ax = torchtrace.timeline(torchtrace.events(_trace()), within="step", origin=lambda n: "x")
    assert len(ax.get_yticklabels()) == 4


def test_trace_of_a_real_profile():
    """The reader on what torch.profiler writes (a CPU-only profile works anywhere)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as p:
        with record_function("step"):
            torch.ones(64, 64) @ torch.ones(64, 64)
    evs = torchtrace.events(p)
    s = torchtrace.summary(evs, within="step")
    assert s.host_us > 0 and not s.kernels


# ============================================================================ graphs

def test_graphs_need_a_gpu():
    if env.HAS_GPU:
        pytest.skip("simulator-mode behaviour")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        cb.graphs.capture(lambda: None)
    assert cb.graphs.graph_nodes(object()) is None


@gpu
def test_capture_and_replay():
    import cupy as cp

    va = cb.load_cuda("vector_add")
    x = cp.ones(1000, cp.float32)

    def chain():
        for _ in range(10):
            va.vector_add_v1((4,), (256,), (x, x, x, np.int32(1000)))   # x doubles 10 times

    g = cb.graphs.capture(chain)           # runs chain once (x = 1024), then captures
    assert g.nodes == 10
    x.fill(1)
    g()
    g.synchronize()
    assert float(x[0]) == 1024.0
    with pytest.raises(RuntimeError, match="the graph is empty"):
        cb.graphs.capture(lambda: None)
    assert cb.graphs.wall_us(g, repeat=5) > 0
    x.fill(1)
    assert g.replay_us(repeat=2) > 0       # one warm-up replay and two timed: x doubled 30 times
    assert float(x[0]) == 2.0 ** 30


# ============================================================================ graders

def test_ex05_1_reference_passes(capsys):
    if not ch05.NCU_CASES:
        pytest.skip("no stored cases")
    ex05_1(SOL.get("ex05.1", "name_bottlenecks"))
    assert capsys.readouterr().out.strip() == "PASS ex05.1"


#: wrong answers of ex05.1 (one label changed) and the hint each must get: the counters that speak
#: against the label given, never the right label
_BOTTLENECK_WRONG = [
    ("C", "memory-bound", r"case C: not memory-bound: .*but memory throughput is \d+% of peak"),
    ("A", "compute-bound", r"case A: not compute-bound: .*compute \(SM\) throughput is \d+% of "
                           r"peak here \(FMA pipe \d+%\)"),
    ("D", "latency-bound", r"case D: not latency-bound: nothing is near its peak, true; but this "
                           r"kernel runs [\d.]+ us: .*Read the trace line"),
    ("B", "memory-bound", r"case B: not memory-bound: .*memory throughput is \d+% of peak"),
    ("E", "latency-bound", r"case E: not latency-bound: .*the busier of the two is at \d+% of its "
                           r"peak"),
    ("C", "launch-bound", r"case C: not launch-bound: .*runs \d+ us and the trace line says: "
                          r"launched back to back"),
]


@HAS_DATA
@pytest.mark.parametrize("case, label, match", _BOTTLENECK_WRONG,
                         ids=[f"{c}-{lab}" for c, lab, _ in _BOTTLENECK_WRONG])
def test_ex05_1_wrong_label_gets_the_counters_against_it(case, label, match):
    right = ch05._ANSWERS[case]
    fn = SOL.get("ex05.1", "name_bottlenecks", edits=[(f'"{case}": "{right}"',
                                                       f'"{case}": "{label}"')])
    with pytest.raises(GradeError, match=match) as e:
        ex05_1(fn)
    assert right not in str(e.value)


@HAS_DATA
def test_ex05_1_hints_never_name_the_answer():
    """Every wrong label of every case: the message refutes that label and names no label but it."""
    for case, right in ch05._ANSWERS.items():
        for label in ch05.LABELS:
            if label == right:
                continue
            answer = dict(ch05._ANSWERS, **{case: label})
            with pytest.raises(GradeError) as e:
                ex05_1(lambda answer=answer: answer)
            msg = str(e.value)
            assert msg.startswith(f"ex05.1: case {case}: not {label}: "), msg
            assert not [w for w in ch05.LABELS if w in msg.replace(f"not {label}", "")
                        .replace(f"a {label} kernel", "")], msg


@HAS_DATA
@pytest.mark.parametrize("edits, match", [
    ([('"C": "latency-bound"', '"C": "memory-bound"'), ('"D": "launch-bound"',
                                                          '"D": "compute-bound"')],
     r"2 of 5 cases wrong\n  case C: not memory-bound: .*\n  case D: not compute-bound"),
    ([('"B": "compute-bound"', '"B": "fast"')], r"case B: 'fast' is not one of"),
    ([('"E": "compute-bound"', '')], r"no answer for case\(s\) \['E'\]"),
    ([('"compute-bound"}', '"compute-bound"}.values()')], "return a dict"),
], ids=["two-wrong", "not-a-label", "missing-case", "not-a-dict"])
def test_ex05_1_malformed_answers(edits, match):
    fn = SOL.get("ex05.1", "name_bottlenecks", edits=edits)
    with pytest.raises(GradeError, match=match):
        ex05_1(fn)


@HAS_DATA
def test_ex05_1_accepts_spelling_variants(capsys):
    ex05_1(lambda: {k: v.upper().replace("-", " ") for k, v in ch05._ANSWERS.items()})
    assert capsys.readouterr().out.strip() == "PASS ex05.1"


def test_ex05_1_stub_fails():
    if not ch05.NCU_CASES:
        pytest.skip("no stored cases")
    stub = SOL.get("ex05.1", "name_bottlenecks",
                   edits=[("    return {", '    raise NotImplementedError\n    return {')])
    with pytest.raises(GradeError, match="not implemented yet"):
        ex05_1(stub)


def test_ex05_2_reference_passes(capsys):
    ex05_2(SOL.get("ex05.2", "blocks_per_sm"))
    assert capsys.readouterr().out.strip() == "PASS ex05.2"


_OCC_WRONG = [
    ("warps = -(-threads // lim.warp_size)", "warps = threads // lim.warp_size",
     "round threads / 32 up"),
    ("regs_per_warp = -(-regs * lim.warp_size // lim.reg_alloc_unit) * lim.reg_alloc_unit",
     "regs_per_warp = regs * lim.warp_size", "units of lim.reg_alloc_unit"),
    ("(lim.regs_per_sm // parts // regs_per_warp) * parts // warps",
     "lim.regs_per_sm // (regs_per_warp * warps)", "sub_partitions"),
    ("(smem + lim.smem_reserved_per_block)", "(smem)", "reserves lim.smem_reserved_per_block"),
    ("need = -(-(smem + lim.smem_reserved_per_block) // lim.smem_alloc_unit) * "
     "lim.smem_alloc_unit", "need = smem + lim.smem_reserved_per_block",
     "units of lim.smem_alloc_unit"),
    ("min(by_warps, by_regs, by_smem, lim.max_blocks_per_sm)", "min(by_warps, by_regs, by_smem)",
     "at most lim.max_blocks_per_sm blocks"),
    ("    if threads > lim.max_threads_per_block or regs", "    if regs",
     "more than lim.max_threads_per_block threads cannot launch"),
    ("by_smem = lim.smem_per_sm // need if need else lim.max_blocks_per_sm",
     "by_smem = lim.smem_per_sm // need", "needs no shared memory at all"),
    ("by_warps = lim.max_warps_per_sm // warps", "by_warps = lim.max_threads_per_sm // threads",
     "count the warps per SM, not the threads"),
    ("or smem > lim.smem_per_block_optin:", "or smem > lim.smem_per_block:",
     "opted in to lim.smem_per_block_optin"),
]


@pytest.mark.parametrize("old, new, match", _OCC_WRONG, ids=[w[2][:20] for w in _OCC_WRONG])
def test_ex05_2_wrong_formulas(old, new, match):
    with pytest.raises(GradeError, match=match):
        ex05_2(SOL.get("ex05.2", "blocks_per_sm", edits=[(old, new)]))


def test_ex05_2_answers_that_fit_one_configuration():
    with pytest.raises(GradeError, match=r"got 8 blocks, expected .* binds"):
        ex05_2(lambda threads, regs, smem, lim: 8)          # right for 256 x 32 on an H100
    warps_only = SOL.get("ex05.2", "blocks_per_sm", edits=[(
        "    return min(by_warps, by_regs, by_smem, lim.max_blocks_per_sm)",
        "    return by_warps")])
    with pytest.raises(GradeError, match="expected"):
        ex05_2(warps_only)
    with pytest.raises(GradeError, match="return an int"):
        ex05_2(lambda threads, regs, smem, lim: 8.0)


def _delegates(threads, regs, smem, lim):
    return oc.occupancy(threads, regs, 0, smem, lim).blocks     # right, but not the arithmetic


def _asks_the_library(threads, regs, smem, lim):
    import cudabook as cb

    return cb.occupancy.blocks_per_sm(threads, regs, smem, lim)


def test_ex05_2_refuses_a_call_of_the_calculator():
    for fn, what in ((_delegates, r"oc\.occupancy\(\.\.\.\)"),
                     (_asks_the_library, r"cb\.occupancy\.blocks_per_sm\(\.\.\.\)")):
        with pytest.raises(GradeError, match=f"calls {what}: the exercise is the arithmetic"):
            ex05_2(fn)


def test_ex05_2_stub_fails():
    stub = SOL.get("ex05.2", "blocks_per_sm", edits=[(
        "    warps = -(-threads", '    raise NotImplementedError\n    warps = -(-threads')])
    with pytest.raises(GradeError, match="not implemented yet"):
        ex05_2(stub)


@gpu
def test_ex05_3(capsys):
    ex05_3(SOL.get("ex05.3", "capture"))
    assert capsys.readouterr().out.strip() == "PASS ex05.3"


@gpu
@pytest.mark.parametrize("edits, match", [
    ([("    with stream:\n        stream.begin_capture()\n        run_chain()"
       "                               # recorded, not run\n        graph = stream.end_capture()",
       "    stream.begin_capture()\n    run_chain()\n    graph = stream.end_capture()")],
     "the replay wrote nothing|capture\\(run_chain\\) raised"),
    ([("return lambda: graph.launch()", "return run_chain")], "called run_chain\\(\\) again"),
    ([("    import cupy as cp\n", '    raise NotImplementedError\n    import cupy as cp\n')],
     "not implemented yet"),
])
def test_ex05_3_wrong(edits, match):
    with pytest.raises(GradeError, match=match):
        ex05_3(SOL.get("ex05.3", "capture", edits=edits))


@gpu
@pytest.mark.parametrize("edits, match", [
    # the warm-up moved inside the capture: the graph holds the chain twice, and replays it twice
    ([("        stream.begin_capture()\n",
       "        stream.begin_capture()\n        run_chain()\n")],
     r"run_chain\(\) ran 2 times while the stream was capturing"),
    # the replay on the capture stream (as CuPy's docstring shows): not ordered with the caller's
    ([("return lambda: graph.launch()", "return lambda: graph.launch(stream)")],
     "the graph ran on another stream"),
    ([("return lambda: graph.launch()",
       "return lambda: (graph.launch(stream), stream.synchronize())")],
     "the graph ran on another stream"),
], ids=["warm-up-captured", "replay-on-capture-stream", "replay-on-capture-stream-synced"])
def test_ex05_3_capture_and_stream_mistakes(edits, match):
    with pytest.raises(GradeError, match=match):
        ex05_3(SOL.get("ex05.3", "capture", edits=edits))


def _with_the_helper(run_chain):
    import cudabook as cb

    g = cb.graphs.capture(run_chain)
    return g


def _with_the_helper_imported(run_chain):
    from cudabook.graphs import capture as cap  # the capture the exercise asks to write

    return cap(run_chain)


def test_ex05_3_refuses_the_book_helper_without_a_gpu():
    """The rubric "do not use cb.graphs.capture" is checked on the source, before the GPU is
    needed, so it holds (and is tested) on any machine."""
    for fn in (_with_the_helper, _with_the_helper_imported):
        with pytest.raises(GradeError, match="calls cb.graphs.capture: the exercise is the lines"):
            ex05_3(fn)
    if not env.HAS_GPU:                  # the reference passes the rubric, then needs the GPU
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            ex05_3(SOL.get("ex05.3", "capture"))


@gpu
def test_ex05_3_rejects_a_replay_without_work():
    def eager_once(run_chain):           # right output once, then a replay that does nothing
        run_chain()
        return lambda: None

    with pytest.raises(GradeError, match="the replay wrote nothing"):
        ex05_3(eager_once)


@gpu
def test_ex05_4(capsys):
    ex05_4(SOL.get("ex05.4", "time_gpu"))
    assert capsys.readouterr().out.strip() == "PASS ex05.4"


_EVENTS = ("        start, end = cp.cuda.Event(), cp.cuda.Event()\n        start.record()\n"
           "        fn()\n        end.record()\n        end.synchronize()"
           "                     # the GPU has passed `end`: both stamps exist\n"
           "        times.append(cp.cuda.get_elapsed_time(start, end))\n")


@gpu
@pytest.mark.parametrize("new, match", [
    # the host clock, synchronized after fn only: counts whatever was queued before it
    ("        import time\n        t0 = time.perf_counter()\n        fn()\n"
     "        cp.cuda.Device().synchronize()\n"
     "        times.append(1e3 * (time.perf_counter() - t0))\n",
     "the timer counted the 20 ms of work queued"),
    (_EVENTS.replace("cp.cuda.get_elapsed_time(start, end)",
                     "cp.cuda.get_elapsed_time(end, start)"),
     "a negative time"),
    ("        import time\n        t0 = time.perf_counter()\n        fn()\n"
     "        times.append(1e3 * (time.perf_counter() - t0))\n", "the timer stopped before"),
    (_EVENTS.replace("        end.synchronize()", "        pass"), "end.synchronize\\(\\) first"),
    (_EVENTS.replace("cp.cuda.get_elapsed_time(start, end)",
                     "cp.cuda.get_elapsed_time(start, end) / 1e3"), "seconds instead"),
    ('        raise NotImplementedError("ex05.4")\n', "not implemented yet"),
])
def test_ex05_4_wrong(new, match):
    with pytest.raises(GradeError, match=match):
        ex05_4(SOL.get("ex05.4", "time_gpu", edits=[(_EVENTS, new)]))


@gpu
def test_ex05_4_sum_of_the_calls():
    fn = SOL.get("ex05.4", "time_gpu", edits=[("return float(np.median(times))",
                                               "return float(np.sum(times))")])
    with pytest.raises(GradeError, match="5 times the kernel's"):
        ex05_4(fn)


@pytest.mark.parametrize("got, want, queued, match", [
    (-1.0, 1.0, 0.0, "a negative time: cp.cuda.get_elapsed_time\\(start, end\\)"),
    (0.001, 1.0, 0.0, "seconds instead of milliseconds"),
    (0.02, 1.0, 0.0, "the timer stopped before the GPU finished"),
    (1000.0, 1.0, 0.0, "microseconds instead of milliseconds"),
    (22.0, 1.0, 20.0, "counted the 20 ms of work queued on the GPU before time_gpu was called"),
    (5.0, 1.0, 0.0, "5 times the kernel's 1.000 ms: the time of several calls"),
    (2.0, 1.0, 0.0, "2 times the kernel's"),
    (1.6, 1.0, 0.0, "more than the kernel takes"),
], ids=["negative", "seconds", "no-sync", "microseconds", "queued-work", "sum", "warm-up",
        "too-long"])
def test_ex05_4_verdicts(got, want, queued, match):
    """The hint for each kind of wrong time, without a GPU (the GPU tests above feed real ones)."""
    with pytest.raises(GradeError, match=match):
        ch05._timer_verdict("ex05.4", "case", got, want, queued)
    ch05._timer_verdict("ex05.4", "case", 1.05 * want, want, queued)     # within the tolerance


def test_lesson_headings_carry_no_numbers():
    """Jupyter Book numbers the sections itself ("5.1 Timing done right"): a heading that carries
    its own number reads "5.1 1. ...", and prose that says "section 3" goes stale when one moves."""
    nb = json.loads((Path(__file__).resolve().parent.parent / "lessons" / "05_profiling.ipynb")
                    .read_text())
    md = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    numbered = [ln for text in md for ln in text.splitlines() if re.match(r"#+\s*\d", ln)]
    by_number = [m.group(0) for text in md for m in re.finditer(r"\bsections? \d+", text)]
    assert not numbered, numbered
    assert not by_number, by_number


# ============================================================================ ex05.5

_ROWS_LOOP = ("    for (int j = lane; j < N; j += 32) s += r[j];     // one load: 32 neighbours, "
              "128 bytes\n")
_SHUFFLE = "    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);\n"


def _slow_as_answer(edit=("", "")):
    return ch05.row_sum_slow_source().replace("row_sum_slow", "row_sum").replace(*edit)


@pytest.mark.parametrize("src, match", [
    (lambda: _slow_as_answer(), "the slow kernel's loop"),
    (lambda: SOL.get("ex05.5", "row_sum_src", edits=[(
        _SHUFFLE, "    s = cub::WarpReduce<float>(tmp).Sum(s);\n")]), "calls a library \\(cub"),
    (lambda: 42, "expected the CUDA C\\+\\+ source as a str"),
], ids=["slow-kernel", "cub", "not-a-string"])
def test_ex05_5_refused_from_the_source(src, match):
    """Caught before anything runs (CPU too): the slow loop handed back, a library reduction."""
    with pytest.raises(GradeError, match=match):
        ex05_5(src())


def test_ex05_5_slow_kernel_shown_is_the_one_refused():
    assert "for (int j = 0; j < N; j++) s += x[(size_t)row * N + j];" in \
        ch05.row_sum_slow_source()


@gpu
def test_ex05_5_reference_passes(capsys):
    ex05_5(SOL.get("ex05.5", "row_sum_src"))
    assert capsys.readouterr().out.strip().endswith("PASS ex05.5")


#: the lanes of a warp each sum their own contiguous stretch of the row: correct, and L1 keeps
#: most of the reuse, but every load instruction still touches 32 sectors
_STRETCH = ("    const int per = (N + 31) / 32;\n"
            "    for (int j = lane * per; j < min(N, (lane + 1) * per); j++) s += r[j];\n")

WRONG_5 = [
    ([], "never written \\(all NaN\\): is the kernel still the stub"),
    ([("    if (row >= M) return;", "    //")], "wrote past the end of out"),
    ([(_SHUFFLE, "")], "lane 0's share alone"),
    ([("o > 0; o >>= 1", "o > 1; o >>= 1")], "wrong"),
    ([(_ROWS_LOOP, _STRETCH)], "correct, but .* the speed of a copy|Nsight Compute counts"),
]


@gpu
@pytest.mark.parametrize("edits,hint", WRONG_5, ids=["stub", "no-guard", "no-shuffle",
                                                      "short-shuffle", "per-lane-stretch"])
def test_ex05_5_wrong_answers(edits, hint):
    src = SOL.stub("ex05.5", "row_sum_src") if not edits else \
        SOL.get("ex05.5", "row_sum_src", edits=edits)
    with pytest.raises(GradeError, match=hint):
        ex05_5(src)


@gpu
def test_ex05_5_slow_kernel_with_a_changed_loop_fails_the_speed_gate():
    with pytest.raises(GradeError, match="correct, but .* the speed of a copy of x"):
        ex05_5(_slow_as_answer(("j++", "++j")))


@pytest.mark.skipif(env.HAS_GPU, reason="on a GPU the wrong answers run in full (above)")
@pytest.mark.parametrize("edits,hint", [w for w in WRONG_5 if w[0]])
def test_ex05_5_wrong_answers_still_apply(edits, hint):
    """On a CPU: the GPU-only wrong answers' edits still apply to the solution, and each passes
    the source rubric (or is caught there with its hint)."""
    with pytest.raises(GradeError, match=f"needs a CUDA GPU|{hint}"):
        ex05_5(SOL.get("ex05.5", "row_sum_src", edits=edits))


# ============================================================================ the exercise page

PAGE = exercise_page("05")


@pytest.mark.parametrize("ex", sorted(PAGE))
def test_exercise_states_its_stub_sizes_and_has_two_hints(ex):
    check_exercise_page("05", ex, PAGE)


def test_spec_counts_the_configurations_the_grader_checks():
    import nbformat

    (path,) = (Path(__file__).resolve().parents[1] / "solutions").glob("05_*.ipynb")
    text = "".join(c.source for c in nbformat.read(str(path), as_version=4).cells
                   if c.source.startswith("## ex05.2 "))
    assert f"checks {len(ch05.OCC_CONFIGS)} configurations" in text
