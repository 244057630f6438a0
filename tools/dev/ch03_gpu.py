"""Chapter 3 on a GPU, without Jupyter: run the lesson and the solutions as scripts, tune launch
choices, run the GPU tests, and print a compact table of the measurements.

    PYTHONPATH=. python tools/dev/ch03_gpu.py [--skip-tests]

The code cells of lessons/03_building_blocks.ipynb and solutions/03_building_blocks.ipynb run in
order (the ``%%gpu`` line dropped); every timing in the lesson checks its kernel against torch or
CuPy before and after timing. With $OUT set, the benchmark records go to $OUT/benchmarks.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import types

T0 = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
if os.environ.get("OUT"):
    os.environ.setdefault("CUDABOOK_RESULTS", os.path.join(os.environ["OUT"], "benchmarks.json"))

try:
    import tqdm  # noqa: F401
except ImportError:
    m = types.ModuleType("tqdm")
    m.tqdm = lambda it, **k: it
    sys.modules["tqdm"] = m
try:
    import matplotlib

    matplotlib.use("Agg")
except ImportError:
    from unittest import mock

    sys.modules["matplotlib"] = mock.MagicMock()
    sys.modules["matplotlib.pyplot"] = mock.MagicMock()


def say(*a):
    print(*a, flush=True)


def run_notebook(path: str) -> dict:
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    ns: dict = {"__name__": "__main__"}
    for i, c in enumerate(cells):
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        lines = src.splitlines()
        if lines and lines[0].strip().startswith("%%gpu"):
            lines = lines[1:]
        t = time.time()
        try:
            exec(compile("\n".join(lines), f"{path}#cell{i}", "exec"), ns)  # noqa: S102
            status = "ok"
        except Exception:  # noqa: BLE001
            status = "FAILED"
            traceback.print_exc()
        say(f"[{path} code cell {i}: {status}, {time.time() - t:.1f} s]")
        try:
            import matplotlib.pyplot as plt

            plt.close("all")
        except Exception:  # noqa: BLE001
            pass
    return ns


def tune_rows() -> list[str]:
    """Threads per row for the register-resident softmax_v5 / layernorm_v3 (T >= N / 32)."""
    import cupy as cp

    import cudabook as cb

    smx, ln = cb.load_cuda("softmax"), cb.load_cuda("layernorm")
    out = []
    for N in (1024, 4096, 16384, 32768):
        M = (1 << 25) // N
        x = cp.random.standard_normal((M, N), dtype=cp.float32)
        y = cp.empty_like(x)
        g = cp.ones(N, cp.float32)
        b = cp.zeros(N, cp.float32)
        cands = sorted({t for t in (N // 32, N // 16, N // 8, N // 4, 128, 256, 512, 1024)
                        if N // 32 <= t <= 1024 and t % 32 == 0})
        fns = {}
        for t in cands:
            fns[f"softmax T={t}"] = (lambda t=t: smx.softmax_v5(
                (M,), (t,), (x, y, cp.int32(M), cp.int32(N))))
            fns[f"layernorm T={t}"] = (lambda t=t: ln.layernorm_v3(
                (M,), (t,), (x, g, b, y, cp.int32(M), cp.int32(N), cp.float32(1e-5))))
        tb = cb.bench(fns, bytes=8 * M * N, repeat=5, quiet=True)
        out.append(f"N={N}: " + ", ".join(f"{r.name} {r.value:.0f}" for r in tb.rows))
        say(out[-1])
    return out


def main():
    summary: list[str] = []
    ns = run_notebook("lessons/03_building_blocks.ipynb")
    say(f"(lesson done at {time.time() - T0:.0f} s)")
    run_notebook("solutions/03_building_blocks.ipynb")
    say(f"(solutions done at {time.time() - T0:.0f} s)")
    try:
        tuned = tune_rows()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        tuned = []
    say(f"(tuning done at {time.time() - T0:.0f} s)")
    if "--skip-tests" not in sys.argv:
        for marks in ("gpu", "not gpu"):
            left = 236 - (time.time() - T0)
            if left < 10:
                say(f"pytest -m '{marks}': no time left")
                continue
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marks, "-rfE",
                                    "tests/test_ch03.py", "-p", "no:cacheprovider"],
                                   capture_output=True, text=True, timeout=left)
                say(f"\n== pytest -m '{marks}' tests/test_ch03.py ==\n" + r.stdout[-2500:]
                    + r.stderr[-600:])
            except subprocess.TimeoutExpired:
                say(f"pytest -m '{marks}': timed out")
            except Exception as e:  # noqa: BLE001
                say("pytest: could not run:", e)

    def add(label, t):
        if t is None:
            return
        for r in t.rows:
            s = f"{label:14s} {r.name:34s} {r.time_us:9.1f} us"
            if r.value is not None:
                s += f" {r.value:8.1f} {r.unit}"
            if r.ratio is not None:
                s += f"  {r.ratio:5.2f}x {r.baseline}"
            summary.append(s)

    copy = ns.get("COPY_GBS")
    summary.append(f"copy bandwidth {copy}")
    add("bias+gelu", ns.get("t_act"))
    add("sum 256MiB", ns.get("t_red"))
    add("max 256MiB", ns.get("t_max"))
    for key, label in (("sw_sm", "softmax"), ("sw_ln", "layernorm"), ("sw_rms", "rmsnorm")):
        sw = ns.get(key)
        if sw is not None:
            for size, t in zip(sw.sizes, sw.tables):
                add(f"{label} N={size}", t)
    add("conv layer", ns.get("t_conv"))
    add("conv TF32", ns.get("t_tf32"))
    add("matmul 2048", ns.get("t_mm"))
    say("\n== SUMMARY ==")
    say(f"reduce_v5 best launch {ns.get('best_v5')}")
    for s in summary + tuned:
        say(s)
    say(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
