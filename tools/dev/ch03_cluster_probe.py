"""Rows split over a cluster against a copy of the same bytes: softmax v5/v6, layernorm v4/v5/v6 and
rmsnorm v2/v3 at N = 4096 ... 262144 with constant bytes (4096 x 32768 floats by default), as a
fraction of the copy bandwidth measured in the same run, beside PyTorch (eager, captured in a
CUDA graph, torch.compile'd then captured); --clusters also times every cluster size of the v6
kernels at each N (the crossover the launcher's choice should follow).

    PYTHONPATH=. python tools/dev/ch03_cluster_probe.py [--sizes 4096 65536] [--clusters]
        [--floats 134217728] [--no-compile] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import cudabook as cb
from cudabook.reference import layernorm_reference, rmsnorm_reference, softmax_reference

EPS = 1e-5
CHECK_ROWS = 3            # rows checked against float64 (first, middle, last) before/after timing


def _torch_rows(name, fn, keep, compile_too):
    """PyTorch's ways of running fn (returns the output, which keep stores for the check):
    eager, captured, compiled and captured."""
    rows = {f"torch {name}": lambda: keep(fn()),
            f"torch {name} graph": cb.baselines.torch_graph(lambda: keep(fn()))}
    if compile_too:
        f, why = cb.baselines.torch_compiled(fn)
        if f is None:
            print(f"  (no torch.compile row: {why})")
        else:
            rows[f"torch {name} compiled graph"] = cb.baselines.torch_graph(lambda: keep(f()))
    return rows


def probe(N: int, floats: int, clusters: bool, compile_too: bool) -> list[dict]:
    import cupy as cp
    import torch
    import torch.nn.functional as F

    sm, nl = cb.load_launch("softmax"), cb.load_launch("norm")
    M = max(1, floats // N)
    rng = np.random.default_rng(N)
    x = cp.asarray(rng.standard_normal((M, N), dtype=np.float32) * 2 + 0.5)
    g = cp.asarray(rng.uniform(0.5, 1.5, N).astype(np.float32))
    b = cp.asarray(rng.standard_normal(N).astype(np.float32))
    tx, tg, tb = torch.from_dlpack(x), torch.from_dlpack(g), torch.from_dlpack(b)
    sel = sorted({0, M // 2, M - 1})[:CHECK_ROWS]
    xh, gh, bh = cb.to_numpy(x[sel]), cb.to_numpy(g), cb.to_numpy(b)
    refs = {"softmax": softmax_reference(xh), "layernorm": layernorm_reference(xh, gh, bh, EPS),
            "rmsnorm": rmsnorm_reference(xh, gh, EPS)}
    gbs = cb.roofline.copy_gbs(4 * M * N)
    out: dict[str, object] = {}

    def ours(op, version, cluster=None):
        name = version + (f" C={cluster}" if cluster else "")
        y = out.setdefault(name, cp.empty_like(x))
        if op == "softmax":
            return name, lambda: sm.softmax(x, y, version=version, cluster=cluster)
        if op == "layernorm":
            return name, lambda: nl.layernorm(x, g, b, EPS, y, version=version, cluster=cluster)
        return name, lambda: nl.rmsnorm(x, g, EPS, y, version=version, cluster=cluster)

    torch_fns = {"softmax": lambda: torch.softmax(tx, -1),
                 "layernorm": lambda: F.layer_norm(tx, (N,), tg, tb, EPS),
                 "rmsnorm": lambda: F.rms_norm(tx, (N,), tg, EPS)}

    plan = {"softmax": ["softmax_v5", "softmax_v6"],
            "layernorm": ["layernorm_v4", "layernorm_v5", "layernorm_v6"],
            "rmsnorm": ["rmsnorm_v2", "rmsnorm_v3"]}
    results = []
    for op, versions in plan.items():
        fns = {}
        for v in versions:
            if cb.env.cc() < (sm.MIN_CC | nl.MIN_CC).get(v, (0, 0)):
                continue
            name, f = ours(op, v)
            fns[name] = f
            if clusters and v in ("softmax_v6", "layernorm_v6", "rmsnorm_v3"):
                for C in cb.launch.SPLIT_CLUSTERS:
                    try:
                        cb.launch.row_split(M, N, v, cluster=C)
                    except cb.LaunchError:
                        continue                     # this C's slice does not fit
                    name, f = ours(op, v, C)
                    fns[name] = f
        base = _torch_rows(op, torch_fns[op], lambda t, op=op: out.__setitem__(f"torch {op}", t),
                           compile_too)

        def check(name, op=op):
            y = out[f"torch {op}"] if name.startswith("torch") else out[name]
            yh = cb.to_numpy(y[sel] if not name.startswith("torch") else
                             cp.from_dlpack(y.detach())[sel])
            cb.check(yh, refs[op], atol=2e-4, rtol=1e-3, name=f"{name} N={N}")

        nbytes = 8 * M * N + (8 * N if op == "layernorm" else 4 * N if op == "rmsnorm" else 0)
        t = cb.bench(fns, baseline=base, bytes=nbytes, check=check, repeat=10, quiet=True,
                     size=[M, N])
        for r in t.rows:
            frac = r.value / gbs
            vs = "(baseline)" if r.ratio is None else f"{r.ratio:5.2f}x torch best"
            print(f"N={N:7d} M={M:6d}  {r.name:34s} {r.value / 1000:6.2f} TB/s  "
                  f"{frac:5.2f} of copy ({gbs / 1000:.2f} TB/s)  {vs}")
            results.append({"N": N, "M": M, "op": op, "name": r.name, "gbs": r.value,
                            "copy_gbs": gbs, "fraction_of_copy": frac, "ratio": r.ratio})
    out.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1 << k for k in range(12, 19)])
    ap.add_argument("--floats", type=int, default=4096 * 32768,
                    help="floats of x at every N (rows = floats / N)")
    ap.add_argument("--clusters", action="store_true", help="time every cluster size of v6")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--out", help="write the rows as JSON")
    a = ap.parse_args()
    cb.report()
    rows = []
    for N in a.sizes:
        rows += probe(N, a.floats, a.clusters, not a.no_compile)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": cb.env.info().name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
