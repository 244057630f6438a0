"""The tile-size sweep of matmul_v10 and matmul_v11 (Chapter 4): compile each configuration, time it against
cuBLAS in the same run, and rank them. Launching is kernels/matmul_launch.py (``matmul``, ``load_tuned``:
one compile per tile configuration, kept for the process).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb

__all__ = ["autotune", "params_label"]


def _launch():
    return cb.load_launch("matmul")


def autotune(configs: list[dict], n: int = 4096, repeat: int = 10, vs_cublas: bool = True,
             version: str = "v10") -> list[dict]:
    """Compile and time matmul_<version> (v10 or v11: both take their tile sizes from the same
    -D macros) for each tile configuration on n x n x n (a progress bar).

    Each entry of the result: the parameters, threads, shared bytes, registers, spill bytes,
    time (us), TFLOP/s and ratio to cuBLAS (timed in the same call), or "error" for a
    configuration that does not compile, launch or check. Sorted best first.
    """
    import cupy

    ml = _launch()
    version = cb.launch.version_name(("v10", "v11"), version, "matmul")   # or "matmul_v10"
    rng = np.random.default_rng(0)
    A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = cupy.empty((n, n), dtype=cupy.float32)
    ref = A[:128].astype(cupy.float64) @ B.astype(cupy.float64)    # first rows only: fast
    work = 2.0 * n ** 3
    base = None
    if vs_cublas:
        base = cb.bench({}, baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)}, flops=work,
                        repeat=repeat, quiet=True).rows[0].value
    out = []
    for cfg in cb.progress(configs, "autotune"):
        entry = {"params": {**ml.TUNED_DEFAULT, **cfg}}
        try:
            entry["params"] = ml.tuned_params(cfg)
            mod = ml.load_tuned(cfg)
            res = mod.resources(f"matmul_{version}")
            C.fill(np.nan)
            t = cb.bench({version: lambda: ml.matmul(A, B, C, version=version, mod=mod)},
                         flops=work, repeat=repeat, quiet=True,
                         check=lambda _: cb.check(C[:128], ref, **ml.tolerance(n)))
            row = t.rows[0]
            entry.update(threads=ml.tuned_threads(entry["params"]),
                         shared=ml.config(version, n, n, n, entry["params"]).shared,
                         registers=res["registers"],
                         spill_bytes=res["local_bytes"], time_us=row.time_us,
                         tflops=row.value, ratio=(row.value / base) if base else None)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        out.append(entry)
    out.sort(key=lambda e: -(e.get("tflops") or 0.0))
    return out


def params_label(p: dict) -> str:
    return (f"{p['BM']}x{p['BN']}x{p['BK']} warp {p['WM']}x{p['WN']} thread {p['TM']}x{p['TN']}"
            f" st{p['STAGES']}{' async' if p['ASYNC'] else ''}")
