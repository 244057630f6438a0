#!/usr/bin/env python3
"""Chapter 8 on a GPU in one call: every hgemm version checked on ragged and tall-skinny shapes,
then timed against cuBLAS fp16 at 1024..8192, v9's autotuning sweep, bf16, SASS instruction
counts (HGMMA / HMMA / LDSM), and, with --ncu, the Nsight Compute counters of each version.

    python tools/dev/ch08_bench.py [--quick] [--ncu]
    python tools/dev/ch08_bench.py --ncu-only [v1 v2 ...]

Shows: which versions are correct, their TFLOP/s and ratio to cuBLAS fp16 per size (table last);
writes bench.json, sass.txt, debug.npz under $OUT; --ncu (or --ncu-only [v1 v2 ...]) writes the
Nsight Compute counters the lesson prints to reports/ch08_ncu.csv.
Hopper kernels are first checked in a child process with a time limit, so a deadlocked pipeline
cannot stall the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp/ch08_out"))

SHAPES = [(1, 1, 8), (128, 128, 64), (127, 129, 72), (1000, 777, 520), (4096, 24, 64),
          (16, 3000, 136), (300, 200, 1000), (257, 513, 4104)]


def log(*a):
    print(*a, flush=True)


def check_versions(versions, dtype="float16", shapes=SHAPES, debug=None):
    """{version: 'ok' or the error} on every shape; fp16 through CuPy, bf16 through torch."""
    import cupy as cp
    import numpy as np
    import torch

    import cudabook as cb
    hg = cb.load_launch("hgemm")
    mod = hg.load()
    res = {}
    for v in versions:
        try:
            hg.require(v, cb.cc(), dtype)
        except hg.UnsupportedError as e:
            res[v] = f"skip: {e}"
            continue
        worst = 0.0
        try:
            for M, N, K in shapes:
                g = np.random.default_rng(M * 7 + N * 3 + K)
                a = g.standard_normal((M, K)).astype(np.float32)
                b = g.standard_normal((N, K)).astype(np.float32)
                if dtype == "float16":
                    A, B = cp.asarray(a).astype(cp.float16), cp.asarray(b).astype(cp.float16)
                    C = cp.full((M, N), cp.nan, cp.float16)
                else:
                    A = torch.tensor(a, device="cuda").bfloat16()
                    B = torch.tensor(b, device="cuda").bfloat16()
                    C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                hg.launch(mod, v, A, B, C)
                cp.cuda.Device().synchronize()
                try:
                    worst = max(worst, hg.check(C, A, B, name=f"{v} {dtype} {M}x{N}x{K}"))
                except Exception:
                    if debug is not None and dtype == "float16":
                        debug[f"{v}_{M}x{N}x{K}_A"] = cp.asnumpy(A)
                        debug[f"{v}_{M}x{N}x{K}_B"] = cp.asnumpy(B)
                        debug[f"{v}_{M}x{N}x{K}_C"] = cp.asnumpy(C)
                    raise
            # K not a multiple of 8: matmul() pads
            g = np.random.default_rng(5)
            if dtype == "float16":
                A = cp.asarray(g.standard_normal((65, 517)), dtype=cp.float16)
                B = cp.asarray(g.standard_normal((33, 517)), dtype=cp.float16)
                C = hg.matmul(A, B, v, mod=mod)
                worst = max(worst, hg.check(C, A, B, name=f"{v} padded K=517"))
            res[v] = f"ok (worst error {worst:.2f} of the bound)"
        except Exception as e:  # noqa: BLE001
            res[v] = f"FAIL: {type(e).__name__}: {str(e)[:300]}"
    return res


def child_check(versions):
    """Entry of the child process: check versions, print one JSON line."""
    import numpy as np

    dbg = {}
    out = {"float16": check_versions(versions, debug=dbg)}
    out["bfloat16"] = check_versions(versions, "bfloat16")
    if dbg:
        np.savez_compressed(OUT / "debug.npz", **dbg)
    print("CHILD " + json.dumps(out), flush=True)


def run_child(versions, timeout=120):
    try:
        r = subprocess.run([sys.executable, __file__, "--child", *versions], capture_output=True,
                           text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"float16": {v: "FAIL: timed out (deadlock?)" for v in versions}, "bfloat16": {}}
    for ln in r.stdout.splitlines():
        if ln.startswith("CHILD "):
            return json.loads(ln[6:])
    return {"float16": {v: f"FAIL: child rc={r.returncode}: {r.stderr[-800:]}" for v in versions},
            "bfloat16": {}}


def sass_counts():
    """HGMMA / HMMA / LDSM / LDGSTS / UTMALDG counts per kernel in the sm_90a SASS (nvcc)."""
    cub = OUT / "hgemm.cubin"
    r = subprocess.run(["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                        "-Ikernels", "-Xptxas", "-v", "kernels/hgemm.cu", "-o", str(cub)],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        return f"nvcc failed: {r.stderr[-500:]}"
    s = subprocess.run(["cuobjdump", "-sass", str(cub)], capture_output=True, text=True).stdout
    cub.unlink()
    lines, cur, counts = [], None, {}
    for ln in s.splitlines():
        if "Function :" in ln:
            cur = ln.split("Function :")[1].strip()
            counts[cur] = {k: 0 for k in ("HGMMA", "HMMA", "LDSM", "LDGSTS", "UTMALDG", "BAR")}
        elif cur:
            for k in counts[cur]:
                if f" {k}" in ln:
                    counts[cur][k] += 1
    for f, c in counts.items():
        lines.append(f"{f[:60]:60s} " + " ".join(f"{k}={v}" for k, v in c.items()))
    (OUT / "sass.txt").write_text("\n".join(lines) + "\n\nptxas:\n" + r.stderr)
    return "\n".join(lines)


def bench(versions, sizes, repeat):
    import cupy as cp
    import numpy as np

    import cudabook as cb
    hg = cb.load_launch("hgemm")
    mod = hg.load()
    rows = {}
    for n in sizes:
        g = np.random.default_rng(n)
        a = cp.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cp.float16)
        b = cp.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cp.float16)
        outs = {v: cp.full((n, n), cp.nan, cp.float16) for v in ["cuBLAS fp16", *versions]}
        fns = {v: (lambda v=v: hg.launch(mod, v, a, b, outs[v])) for v in versions}
        band = slice(n - 64, n)
        base = {"cuBLAS fp16": lambda: cp.matmul(a, b.T, out=outs["cuBLAS fp16"])}
        t = cb.bench(fns, baseline=base,
                     flops=hg.flops(n, n, n), repeat=repeat, quiet=True, size=n,
                     check=lambda v: hg.check(outs[v], a, b, rows=band, name=v))
        rows[n] = {r.name: dict(tflops=r.value, ratio=r.ratio, us=r.time_us) for r in t.rows}
        log(f"n={n}: " + ", ".join(f"{k} {v['tflops']:.0f}" for k, v in rows[n].items()))
    return rows


def bench_bf16(versions, n=4096, repeat=10):
    import torch

    import cudabook as cb
    hg = cb.load_launch("hgemm")
    mod = hg.load()
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    fns = {f"{v} bf16": (lambda v=v: hg.launch(mod, v, a, b, c)) for v in versions}
    t = cb.bench(fns, baseline={"cuBLAS bf16 (torch)": lambda: torch.matmul(a, b.T)},
                 flops=hg.flops(n, n, n), repeat=repeat, quiet=True, size=n)
    return {r.name: dict(tflops=r.value, ratio=r.ratio) for r in t.rows}


def tensor_metrics() -> dict[str, str]:
    """The tensor-pipe counters this ncu has for this GPU: every ``*pipe_tensor*cycles_active``
    (busy cycles, as % of peak: hmma is mma.sync and WMMA, the Hopper ones count wgmma)."""
    from cudabook.ncu import _available_metrics, find_ncu

    have = _available_metrics(find_ncu() or "ncu") or set()
    names = sorted(m for m in have if "pipe_tensor" in m and m.endswith("cycles_active"))
    log("tensor-pipe metrics available:", names)
    return {m.split("__pipe_")[-1].replace("_cycles_active", "") + "_busy_pct":
            m + ".avg.pct_of_peak_sustained_active" for m in names[:6]}


def raw_columns(raw: str, names: list[str]) -> list[dict]:
    """Per launch (in order), the values of metric columns ``names`` in ncu's raw CSV."""
    import csv
    import io

    rows = list(csv.reader(io.StringIO(raw)))
    if not rows:
        return []
    head = rows[0]
    col = {h: i for i, h in enumerate(head)}
    out = []
    for r in rows[1:]:
        if len(r) != len(head) or not r[col["ID"]].strip():
            continue
        vals = {}
        for n in names:
            try:
                vals[n] = float(r[col[n]].replace(",", ""))
            except (KeyError, ValueError):
                vals[n] = None
        out.append(vals)
    return out
NCU_TARGET = """
import cupy as cp
import cudabook as cb
hg = cb.load_launch("hgemm")
mod = hg.load()
n = {n}
a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
c = cp.empty((n, n), cp.float16)
for v in {versions!r}:
    hg.launch(mod, v, a, b, c)
cp.cuda.Device().synchronize()
"""


def ncu(versions, n=4096, path=ROOT / "reports" / "ch08_ncu.csv"):
    """Nsight Compute counters of one launch of each version at n^3 (cb.ncu.profile), written as
    a small CSV the lesson prints: tensor-pipe activity, issue slots, occupancy, bank conflicts,
    the top warp stalls."""
    import csv
    import datetime

    import cudabook as cb

    tensor = tensor_metrics()
    metrics = {**cb.ncu.METRICS, **tensor}
    rep = cb.ncu.profile(NCU_TARGET.format(n=n, versions=list(versions)), "regex:hgemm",
                         launch_count=len(versions), metrics=metrics, timeout=400)
    log(f"ncu: {len(rep)} launches in {rep.seconds:.0f} s; dropped metrics {rep.dropped}; "
        f"{rep.message}")
    if not rep:
        return
    tens = raw_columns(rep.raw, list(tensor.values()))
    rows = []
    for i, (v, k) in enumerate(zip(versions, rep.kernels)):
        g = k.values.get
        tv = {lab: (tens[i].get(m) if i < len(tens) else None) for lab, m in tensor.items()}
        busy = [x for x in tv.values() if x is not None]
        rows.append({"version": v, "kernel": k.name[:40], "time_us": k.time_us,
                     "tensor_pct": max(busy) if busy else None,
                     "tensor_pipe": max(tv, key=lambda t: tv[t] or -1).replace("_busy_pct", "")
                     if busy else "",
                     **tv, "issue_pct": g("issue_pct"),
                     "occupancy_pct": g("occ_pct"), "regs": g("regs"),
                     "smem_kib": None if k.smem_bytes is None else k.smem_bytes / 1024,
                     "bank_conflicts_ld": g("bank_ld"), "bank_conflicts_st": g("bank_st"),
                     "dram_pct": g("dram_pct"), "l2_hit_pct": g("l2_hit_pct"),
                     "top_stalls": "; ".join(f"{s} {p:.0f}%" for s, p in k.top_stalls(3))})
    with open(path, "w", newline="") as f:
        f.write(f"# Nsight Compute, one launch of each hgemm version at n = {n} (fp16), "
                f"{cb.env.info().name}, {datetime.date.today().isoformat()}; made by "
                "tools/dev/ch08_bench.py --ncu (cudabook.ncu.profile, clocks not locked)\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    log(open(path).read())


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        child_check(args[1:])
        return
    if args and args[0] == "--ncu-only":
        ncu(list(args[1:]) or ["v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9"])
        return
    OUT.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in args
    import cudabook as cb
    cb.report()
    hg = cb.load_launch("hgemm")
    t0 = time.time()
    mod = hg.load()
    log(f"compiled hgemm.cu ({cb.compile.arch_options(True)}) in {time.time() - t0:.1f} s")
    for name in [f"hgemm_{v}" for v in ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8")]:
        try:
            log(name, hg.resources(mod, name))
        except Exception as e:  # noqa: BLE001
            log(name, "resources:", e)
    report = {"device": cb.env.info().name}
    try:
        report["sass"] = sass_counts()
        log(report["sass"])
    except Exception as e:  # noqa: BLE001
        log("sass:", e)
    safe = [v for v in hg.VERSIONS if v not in ("v7", "v8", "v9")]
    checks = {"float16": check_versions(safe), "bfloat16": check_versions(safe, "bfloat16")}
    child = run_child(["v7", "v8", "v9"])
    for dt in checks:
        checks[dt].update(child.get(dt, {}))
    report["checks"] = checks
    for dt, r in checks.items():
        for v, s in r.items():
            log(f"check {dt:8s} {v}: {s}")
    good = [v for v in hg.VERSIONS if checks["float16"].get(v, "").startswith("ok")]
    try:
        tuned = hg.autotune(4096, repeat=10, quiet=True) if "v9" in good or True else []
        report["autotune"] = tuned
        for e in tuned:
            log("tune", hg.params_label(e["params"]), e.get("tflops"), e.get("ratio"),
                e.get("error", ""))
    except Exception:  # noqa: BLE001
        log("autotune failed:", traceback.format_exc()[-800:])
    sizes = [1024, 4096] if quick else [1024, 2048, 4096, 8192]
    try:
        report["bench"] = bench(good, sizes, repeat=5 if quick else 10)
    except Exception:  # noqa: BLE001
        log("bench failed:", traceback.format_exc()[-1500:])
    try:
        bgood = [v for v in ("v6", "v8", "v9") if checks["bfloat16"].get(v, "").startswith("ok")]
        report["bf16"] = bench_bf16(bgood)
        log("bf16:", report["bf16"])
    except Exception:  # noqa: BLE001
        log("bf16 bench failed:", traceback.format_exc()[-800:])
    (OUT / "bench.json").write_text(json.dumps(report, indent=1, default=str))
    if "--ncu" in args:
        ncu(good)
    # the compact table, last
    b = report.get("bench", {})
    if b:
        log("\nTFLOP/s (ratio to cuBLAS fp16), C = A @ B^T, fp16 in, fp32 accumulate")
        log(f"{'version':12s}" + "".join(f"{f'n={n}':>16s}" for n in b))
        names = list(next(iter(b.values())).keys())
        for v in names:
            log(f"{v:12s}" + "".join(f"{b[n][v]['tflops']:8.1f} ({b[n][v]['ratio'] or 1:4.2f})"
                                     for n in b))
    for dt, r in checks.items():
        bad = {v: s for v, s in r.items() if not s.startswith(("ok", "skip"))}
        log(f"{dt}: {len(r) - len(bad)} of {len(r)} versions ok or skipped" +
            (f"; FAILED: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
