#!/usr/bin/env python3
"""Chapter 5 on a GPU: what the chapter relies on, and the stored data of its graders.

    python tools/dev/ch05_probe.py [--write] [--out DIR]

Checks Nsight Compute (found, permitted, metric names on this GPU and on the T4/A100/L4 chips,
seconds per profiled launch, --clock-control none against base), the occupancy calculator
against the driver over a sweep, a 64-kernel chain eager vs CUDA graph, the PyTorch profiler's
event categories for CuPy launches on PyTorch's stream, and CUDA-graph capture of Numba launches.
With --write it regenerates cudabook/graders/_ch05_data.py: the five Nsight Compute tables of
ex05.1 and the driver's answers of the sweep (stored values for the tests and the simulator).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import cudabook as cb  # noqa: E402


def section(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def cases_target():
    """The five launches of ex05.1 (profiled by ncu, one each)."""
    import cupy as cp
    import numpy as np

    import cudabook as cb

    nl, ml = cb.load_launch("norm"), cb.load_launch("matmul")
    copy, va, fma = cb.load_cuda("copy"), cb.load_cuda("vector_add"), cb.load_cuda("fma_chain")
    x = cp.random.standard_normal((16384, 4096), dtype=cp.float32)          # A: 256 MB
    g, b = cp.ones(4096, cp.float32), cp.zeros(4096, cp.float32)
    nl.layernorm(x, g, b, 1e-5, cp.empty_like(x), version="layernorm_v3")
    n = 4096                                                                # B
    A, B = cp.random.rand(n, n, dtype=cp.float32), cp.random.rand(n, n, dtype=cp.float32)
    mod = cb.load_cuda("matmul")
    ml.launch_cupy(mod, "v10", A, B, cp.empty((n, n), cp.float32))
    big = 64 * 2**20                                                        # C: 132 warps
    xs, ys = cp.random.rand(big, dtype=cp.float32), cp.empty(big, cp.float32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    copy.copy_v2((sms,), (32,), (xs, ys, np.int32(big)))
    t = 1024                                                                # D
    a1, a2, a3 = (cp.random.rand(t, dtype=cp.float32) for _ in range(3))
    va.vector_add_v1((4,), (256,), (a1, a2, a3, np.int32(t)))
    m = 16 * 2**20                                                          # E
    xf, yf = cp.random.rand(m, dtype=cp.float32), cp.empty(m, cp.float32)
    fma.fma_chain((cb.ceil_div(m // 4, 256),), (256,), (xf, yf, np.int32(m), np.int32(512),
                                                        np.float32(0.999), np.float32(0.001)))
    cp.cuda.Device().synchronize()


def launch_interval_us(fn, k: int = 50) -> float:
    """Wall microseconds per launch of k back-to-back launches (the host's pace)."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    cp.cuda.Device().synchronize()
    return 1e6 * (time.perf_counter() - t0) / k


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args(argv)
    import cupy as cp

    cb.report()
    out = Path(a.out) if a.out else None

    section("Nsight Compute")
    ncu = cb.ncu.find_ncu()
    print("ncu:", ncu)
    if ncu:
        print(subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip()
              .splitlines()[-1])
        t0 = time.perf_counter()
        have = cb.ncu._available_metrics(ncu)
        print(f"--query-metrics: {time.perf_counter() - t0:.1f} s, {len(have or ())} base names")
        names = list(cb.ncu.METRICS.values()) + [cb.ncu._STALL.format(r) for r in cb.ncu.STALLS]
        for chip in (None, "tu104", "ga100", "ad102"):
            if chip is None:
                base = have or set()
            else:
                r = subprocess.run([ncu, "--query-metrics", "--chip", chip], capture_output=True,
                                   text=True)
                base = {ln.split()[0] for ln in r.stdout.splitlines()
                        if ln[:1].isalpha() and "__" in ln.split()[0]}
            miss = [m for m in names if not m.startswith("launch__") and
                    m.split(".")[0] not in base]
            print(f"  chip {chip or 'this GPU'}: {len(base)} names; missing {miss}")

    section("ex05.1 cases (ncu)")
    pick = "regex:^(layernorm_v3|matmul_v10|copy_v2|vector_add_v1|fma_chain)$"
    rep = cb.ncu.profile(cases_target, kernel=pick, launch_count=5)
    print(f"{len(rep)} launches in {rep.seconds:.1f} s; message: {rep.message!r}; dropped "
          f"{rep.dropped}")
    keep = {}
    for k in rep.kernels:
        if k.name in ("layernorm_v3", "matmul_v10", "copy_v2", "vector_add_v1", "fma_chain"):
            keep[k.name] = k
    if rep:
        print(rep.table())
        for name in keep:
            cb.ncu.NcuReport([keep[name]]).show()
    base_rep = cb.ncu.profile(cases_target, kernel="vector_add_v1", clock_control="base",
                              stalls=False)
    if base_rep and "vector_add_v1" in keep:
        print(f"vector_add_v1: {keep['vector_add_v1'].time_us:.2f} us (clocks as they are) vs "
              f"{base_rep[0].time_us:.2f} us (--clock-control base)")
    if out and rep:
        (out / "ncu_raw.csv").write_text(rep.raw)
    # the pace of back-to-back launches from Python, per case
    nl, ml = cb.load_launch("norm"), cb.load_launch("matmul")
    copy, va, fma = cb.load_cuda("copy"), cb.load_cuda("vector_add"), cb.load_cuda("fma_chain")
    x = cp.random.standard_normal((16384, 4096), dtype=cp.float32)
    g, b = cp.ones(4096, cp.float32), cp.zeros(4096, cp.float32)
    y = cp.empty_like(x)
    n = 4096
    A, B = cp.random.rand(n, n, dtype=cp.float32), cp.random.rand(n, n, dtype=cp.float32)
    C = cp.empty((n, n), cp.float32)
    mod = cb.load_cuda("matmul")
    big = 64 * 2**20
    xs, ys = cp.random.rand(big, dtype=cp.float32), cp.empty(big, cp.float32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    a1, a2, a3 = (cp.random.rand(1024, dtype=cp.float32) for _ in range(3))
    m = 16 * 2**20
    xf, yf = cp.random.rand(m, dtype=cp.float32), cp.empty(m, cp.float32)
    launches = {
        "layernorm_v3": lambda: nl.layernorm(x, g, b, 1e-5, y, version="layernorm_v3"),
        "matmul_v10": lambda: ml.launch_cupy(mod, "v10", A, B, C),
        "copy_v2": lambda: copy.copy_v2((sms,), (32,), (xs, ys, np.int32(big))),
        "vector_add_v1": lambda: va.vector_add_v1((4,), (256,), (a1, a2, a3, np.int32(1024))),
        "fma_chain": lambda: fma.fma_chain((cb.ceil_div(m // 4, 256),), (256,),
                                           (xf, yf, np.int32(m), np.int32(512),
                                            np.float32(0.999), np.float32(0.001))),
    }
    pace = {k: launch_interval_us(f, 20 if k in ("matmul_v10", "copy_v2") else 50)
            for k, f in launches.items()}
    print("launch interval (us):", {k: round(v, 1) for k, v in pace.items()})

    section("occupancy: calculator vs driver")
    dev = cb.occupancy.device_limits()
    print(dev)
    threads = [1, 32, 33, 64, 96, 100, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1000, 1024]
    smem = [0, 1, 1000, 2048, 5000, 16_384, 30_000, 40_000, 48 * 1024 - 10_000, 48 * 1024,
            60_000, 100_000, 150_000, dev.smem_per_block_optin - 40_000, dev.smem_per_block_optin]
    variants = [("-DPROBE_LIVE=4",), ("-DPROBE_LIVE=16",)] + \
        [("-DPROBE_LIVE=250", f"-maxrregcount={r}") for r in (32, 40, 56, 64, 72, 96, 128, 168,
                                                              255)] + \
        [("-DPROBE_LIVE=32", "-DPROBE_SMEM=10000"),
         ("-DPROBE_LIVE=250", "-DPROBE_SMEM=40000", "-maxrregcount=64")]
    rows, bad = [], []
    t0 = time.perf_counter()
    for opts in variants:
        k = cb.load_cuda("profiling", options=opts).get("occupancy_probe")
        at = k.attributes
        for opt_in in (False, True):
            if opt_in:
                k.max_dynamic_shared_size_bytes = dev.smem_per_block_optin - at["shared_size_bytes"]
            for th, sm, ours, theirs in cb.occupancy.compare_with_driver(k, threads, smem, dev):
                rows.append((at["num_regs"], at["shared_size_bytes"], int(opt_in),
                             int(k.attributes["max_dynamic_shared_size_bytes"]),
                             int(at["max_threads_per_block"]), th, sm, theirs))
                if ours != max(theirs, 0):
                    bad.append((at["num_regs"], at["shared_size_bytes"], opt_in, th, sm, ours,
                                theirs))
    print(f"{len(rows)} configurations in {time.perf_counter() - t0:.1f} s; mismatches "
          f"{len(bad)}; driver refused {sum(r[-1] == -1 for r in rows)}")
    print("attributes seen:", sorted(k.attributes))
    for m_ in bad[:20]:
        print("  MISMATCH regs %d static %d opt-in %s threads %d smem %d: ours %d driver %d" % m_)
    if out:
        (out / "occupancy_sweep.json").write_text(json.dumps({"limits": dev.__dict__,
                                                              "rows": rows}))

    section("CUDA graph: 64 small kernels")
    act, ln = cb.load_cuda("activation"), cb.load_cuda("norm")
    M, N = 4, 1024
    xg = cp.random.standard_normal((M, N), dtype=cp.float32)
    x2, h = cp.empty_like(xg), cp.empty_like(xg)
    gm, bt, b1, b2 = (cp.random.rand(N, dtype=cp.float32) for _ in range(4))
    lg, lb = nl.config("layernorm_v3", M, N)
    blocks = (cb.ceil_div(M * N, 256),)
    Mi, Ni, ni = np.int32(M), np.int32(N), np.int32(M * N)

    def layer():
        for r in range(16):
            src, dst = (xg, x2) if r % 2 == 0 else (x2, xg)
            ln.layernorm_v3(lg, lb, (src, gm, bt, h, Mi, Ni, np.float32(1e-5)))
            act.bias_gelu_v1(blocks, (256,), (h, b1, h, Mi, Ni))
            act.bias_add_v1(blocks, (256,), (h, b2, h, Mi, Ni))
            va.vector_add_v1(blocks, (256,), (src, h, dst, ni))

    graph = cb.graphs.capture(layer)
    te, tg = cb.graphs.wall_us(layer), cb.graphs.wall_us(graph)
    gpu = cb.bench({"graph": graph}, flush_l2=False, repeat=10, quiet=True).rows[0].time_us
    print(f"nodes {graph.nodes}: eager {te:.1f} us, graph {tg:.1f} us ({te / tg:.1f}x), GPU "
          f"time of the graph {gpu:.1f} us")

    section("PyTorch profiler: CuPy kernels on PyTorch's stream")
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    xt = torch.randn(64, 1024, device="cuda")
    bt_ = torch.randn(1024, device="cuda")
    lin = torch.nn.Linear(1024, 1024).cuda()

    def step():
        hh = lin(xt)
        with record_function("book bias_gelu"), \
                cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            hc = cp.from_dlpack(hh.detach())
            act.bias_gelu_v1((cb.ceil_div(hh.numel(), 256),), (256,),
                             (hc, cp.from_dlpack(bt_), hc, np.int32(64), np.int32(1024)))
        return hh.cpu()

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            with record_function("step"):
                step()
            torch.cuda.synchronize()
    evs = cb.torchtrace.events(p)
    cats = {}
    for e in evs:
        cats.setdefault(e.get("cat"), set()).add(e.get("name"))
    for c, ns in sorted(cats.items(), key=lambda kv: str(kv[0])):
        print(f"  {c}: {sorted(ns)[:6]}")
    summ = cb.torchtrace.summary(evs, within="step")
    print(summ)
    cupy_seen = any(k[0].startswith("bias_gelu") for k in summ.kernels)
    print("CuPy kernel in the step's summary:", cupy_seen)

    section("Numba launches: eager and captured")
    from numba import cuda

    act_nb = cb.load_numba("activation")
    hn = cp.random.rand(64, 1024, dtype=cp.float32)
    bn, yn = cp.random.rand(1024, dtype=cp.float32), cp.empty((64, 1024), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    ns = cuda.external_stream(s.ptr)
    dh, db, dy = (cuda.as_cuda_array(v) for v in (hn, bn, yn))

    def nchain():
        for _ in range(50):
            act_nb.bias_gelu_v1[(64, 4), (16, 16), ns](dh, db, dy)

    nchain()
    s.synchronize()
    try:
        gn = cb.graphs.capture(nchain, stream=s)
        print(f"captured {gn.nodes} nodes; eager {cb.graphs.wall_us(nchain, 20):.1f} us, graph "
              f"{cb.graphs.wall_us(gn, 20):.1f} us")
    except Exception as e:  # noqa: BLE001
        print(f"capture failed: {type(e).__name__}: {e}")

    section("matmul_v10: __launch_bounds__ and -maxrregcount")
    for label, params, extra in (("MINB=1", {}, ()), ("MINB=2", dict(MINB=2), ()),
                                 ("MINB=1 -maxrregcount=128", {}, ("-maxrregcount=128",))):
        p_ = ml.tuned_params(params)
        mod_ = cb.load_cuda("matmul", options=ml.tuned_options(p_, only_tuned=True) + extra)
        print(f"  {label}: {mod_.resources('matmul_v10')}")

    problems = []
    if bad:
        problems.append(f"{len(bad)} occupancy mismatches")
    if not cupy_seen:
        problems.append("CuPy kernels missing from the PyTorch trace")
    if len(keep) < 5:
        problems.append(f"ncu profiled {sorted(keep)} of the five cases")
    if a.write and len(keep) == 5:
        write_data(keep, pace, rows, dev)
        if out:
            (out / "_ch05_data.py").write_text((ROOT / "cudabook/graders/_ch05_data.py")
                                               .read_text())
    print("\nPROBLEMS:", problems or "none")
    return 3 if problems else 0


def write_data(keep, pace, rows, dev) -> None:
    """cudabook/graders/_ch05_data.py: the ex05.1 tables and the driver's sweep answers."""
    order = {"A": "layernorm_v3", "B": "matmul_v10", "C": "copy_v2", "D": "vector_add_v1",
             "E": "fma_chain"}
    cases = {}
    for case, name in order.items():
        k = keep[name]
        busy = min(1.0, k.time_us / pace[name])
        cases[case] = {"values": {kk: round(v, 3) for kk, v in k.values.items()},
                       "stalls": {kk: round(v, 2) for kk, v in k.stalls.items()},
                       "grid": k.grid, "block": k.block,
                       "trace": f"launched back to back from Python: one launch every "
                                f"{pace[name]:.1f} us; the GPU busy {100 * busy:.0f}% of the time"}
    keep_th = {1, 32, 33, 96, 100, 256, 640, 1000, 1024}
    keep_sm = {0, 1000, 5000, 30_000, 48 * 1024 - 10_000, 48 * 1024, 60_000, 150_000,
               dev.smem_per_block_optin - 40_000, dev.smem_per_block_optin}
    rows = [tuple(r) for r in rows if r[5] in keep_th and r[6] in keep_sm]
    p = ROOT / "cudabook/graders/_ch05_data.py"
    p.write_text(format_data(cb.env.info().name, dict(dev.__dict__), cases, rows))
    print(f"wrote {p.relative_to(ROOT)}: {len(cases)} cases, {len(rows)} sweep rows")


def format_data(gpu: str, limits: dict, cases: dict, rows: list[tuple]) -> str:
    """The text of cudabook/graders/_ch05_data.py (lines of at most 100 characters)."""
    import pprint

    fmt = lambda x: pprint.pformat(x, width=96, sort_dicts=False)
    text = ['"""Stored measurements of Chapter 5\'s graders, written by tools/dev/ch05_probe.py '
            "--write", f"on an {gpu}; do not edit by hand.", "",
            "NCU_CASES: the Nsight Compute counters of the five launches of ex05.1 (ncu",
            "--clock-control none), with the pace of back-to-back launches from Python.",
            "DRIVER_SWEEP: cuOccupancyMaxActiveBlocksPerMultiprocessor over the occupancy_probe",
            "sweep: (registers, static shared bytes, opted in, max dynamic shared bytes, max",
            "threads per block, threads, dynamic shared bytes, blocks per SM; -1 = refused).",
            '"""', "", f"GPU = {gpu!r}", f"LIMITS = {fmt(limits)}", f"NCU_CASES = {fmt(cases)}",
            "DRIVER_SWEEP = ["]
    text += ["    " + ", ".join(repr(tuple(r)) for r in rows[i:i + 2]) + ","
             for i in range(0, len(rows), 2)]
    return "\n".join(text + ["]"]) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
