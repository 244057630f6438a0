#!/usr/bin/env python3
"""Chapter 4 GPU check: correctness of every matmul version on ragged shapes, timings against
cuBLAS, a tile-size sweep of matmul_v10, and (with --graders) the ch04 graders.

    python tools/dev/ch04_gpu.py [--sweep] [--graders] [--sizes 1024,2048,4096]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

if not hasattr(np, "row_stack"):   # numpy >= 2.5 on the device breaks numba-cuda 0.30
    np.row_stack = np.vstack

import cudabook as cb  # noqa: E402

T0 = time.time()
SUMMARY: list[str] = []


def say(s):
    print(s, flush=True)
    SUMMARY.append(s)


def correctness(mod, mm):
    import cupy
    from numba import cuda
    shapes = [(1, 1, 1), (1023, 1025, 517), (4096, 16, 64), (16, 4096, 300), (129, 257, 33),
              (512, 512, 512), (130, 4, 1000), (7, 1001, 5)]
    rng = np.random.default_rng(0)
    bad = []
    for (M, N, K) in shapes:
        A = cupy.asarray(rng.standard_normal((M, K), dtype=np.float32))
        B = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32))
        ref = A.astype(cupy.float64) @ B.astype(cupy.float64)
        for v in mm.VERSIONS:
            C = cb.empty_nan((M, N), np.float32, xp=cupy)
            try:
                mm.launch_cupy(mod, v, A, B, C)
                cupy.cuda.runtime.deviceSynchronize()
                cb.check(C, ref, **mm.tolerance(K))
            except Exception as e:  # noqa: BLE001
                bad.append(f"cupy {v} {M}x{N}x{K}: {str(e)[:200]}")
        for v in mm.NUMBA_VERSIONS:
            if M * N * K > 2e9 and v == "v1":
                continue
            C = cb.empty_nan((M, N), np.float32, xp=cupy)
            try:
                mm.launch_numba(v, cuda.as_cuda_array(A), cuda.as_cuda_array(B),
                                cuda.as_cuda_array(C))
                cuda.synchronize()
                cb.check(C, ref, **mm.tolerance(K))
            except Exception as e:  # noqa: BLE001
                bad.append(f"numba {v} {M}x{N}x{K}: {str(e)[:200]}")
    # a misaligned operand (offset view) takes the scalar path
    M = N = K = 260
    base = cupy.asarray(rng.standard_normal(M * K + 1, dtype=np.float32))
    A = base[1:].reshape(M, K)
    B = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32))
    ref = A.astype(cupy.float64) @ B.astype(cupy.float64)
    for v in mm.VERSIONS:
        C = cb.empty_nan((M, N), np.float32, xp=cupy)
        try:
            mm.launch_cupy(mod, v, A, B, C)
            cb.check(C, ref, **mm.tolerance(K))
        except Exception as e:  # noqa: BLE001
            bad.append(f"cupy {v} misaligned A: {str(e)[:200]}")
    say(f"correctness: {len(bad)} failures" + ("".join("\n  " + b for b in bad)))


def timings(mod, mm, sizes, numba=True):
    import cupy
    from numba import cuda
    rows = {}
    for n in sizes:
        rng = np.random.default_rng(1)
        A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
        B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
        C = cupy.empty((n, n), dtype=cupy.float32)
        ref = A[:128].astype(cupy.float64) @ B.astype(cupy.float64)
        fns = {v: (lambda v=v: mm.launch_cupy(mod, v, A, B, C)) for v in mm.VERSIONS}
        if numba:
            dA, dB, dC = (cuda.as_cuda_array(x) for x in (A, B, C))
            for v in mm.NUMBA_VERSIONS:
                fns[f"nb_{v}"] = (lambda v=v: mm.launch_numba(v, dA, dB, dC))
        t = cb.bench(fns, baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)},
                     flops=2.0 * n ** 3, repeat=5 if n >= 4096 else 10, quiet=True,
                     check=lambda name: cb.check(C[:128], ref, **mm.tolerance(n)))
        rows[n] = t
    say("\nTFLOP/s (ratio to cuBLAS) per size")
    names = [r.name for r in rows[sizes[0]].rows]
    say(f"{'version':10s}" + "".join(f"{n:>18d}" for n in sizes))
    for name in names:
        line = f"{name:10s}"
        for n in sizes:
            r = rows[n][name]
            line += f"{r.value:10.2f} ({(r.ratio or 1) * 100:4.0f}%)"
        say(line)
    return rows


def resources(mod, mm):
    say("\nresources: version regs static_smem dyn_smem local")
    for v in mm.VERSIONS:
        r = mod.resources(f"matmul_{v}")
        cfg = mm.config(v, 4096, 4096, 4096, mod.__dict__.get("params"))
        say(f"  {v:4s} {r['registers']:4d} {r['shared_bytes']:6d} {cfg['shared']:6d} "
            f"{r['local_bytes']:4d}")
    for v in mm.NUMBA_VERSIONS:
        k = getattr(mm, f"matmul_{v}")
        try:
            say(f"  nb_{v} regs {k.get_regs_per_thread()} local {k.get_local_mem_per_thread()} "
                f"shared {k.get_shared_mem_per_block()}")
        except Exception as e:  # noqa: BLE001
            say(f"  nb_{v} resources: {e}")


# the sweeps of the first two GPU runs, relative to the tile sizes v9 uses
OLD = dict(BM=128, BN=128, BK=16, WM=64, WN=32, TM=8, TN=8, STAGES=2, ASYNC=1, MINB=2)

SWEEP2 = [
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, BK=8, ASYNC=0),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, BK=16, ASYNC=0),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, BK=8),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, BK=8, STAGES=3),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, STAGES=3),
    dict(BN=256, WM=64, WN=64, TN=16, MINB=1, BK=32),
    dict(BN=256, WM=32, WN=128, TN=16, MINB=1),
    dict(BN=256, WM=32, WN=128, TN=16, MINB=1, BK=8, ASYNC=0),
    dict(BM=256, WM=128, WN=32, TM=16, MINB=1, BK=8, ASYNC=0),
    dict(BM=256, WM=128, WN=32, TM=16, MINB=1),
    dict(BK=8, ASYNC=0),
    dict(BK=8, ASYNC=0, MINB=1),
    dict(BK=16, ASYNC=0, MINB=1),
    dict(BN=256, MINB=1, BK=16, ASYNC=0),
    dict(BN=256, MINB=1, BK=16),
    dict(BM=256, MINB=1, BK=16, ASYNC=0),
    dict(BM=256, MINB=1, BK=16),
    dict(BM=64, BN=256, WM=32, WN=128, TN=16, MINB=2, BK=8, ASYNC=0),
    dict(BM=64, BN=256, WM=32, WN=128, TN=16, MINB=2, BK=16),
]

SWEEP = [
    {},
    dict(ASYNC=0),
    dict(BK=8),
    dict(BK=8, ASYNC=0),
    dict(STAGES=3),
    dict(BK=8, STAGES=4),
    dict(WM=32, WN=64),
    dict(WM=32, WN=64, STAGES=3),
    dict(BN=256, WM=64, WN=64, TM=8, TN=16, MINB=1),
    dict(BM=256, WM=64, WN=64, TM=16, TN=8, MINB=1),
    dict(BM=64, BN=128, WM=32, WN=64, MINB=4),
    dict(BM=128, BN=64, WM=64, WN=32, MINB=4),
    dict(BM=128, BN=64, WM=64, WN=32, MINB=4, STAGES=3),
    dict(WM=32, WN=32, TM=8, TN=4, MINB=1),
    dict(BK=32),
]


def sweep(mm, n=4096, configs=SWEEP):
    t0 = time.time()
    res = mm.autotune([{**OLD, **c} for c in configs], n=n, repeat=10)
    say(f"\nsweep at {n} ({time.time() - t0:.1f} s, {len(configs)} configs)")
    for e in res:
        p = e["params"]
        if "error" in e:
            say(f"  {mm.params_label(p)} MINB{p['MINB']}: {e['error']}")
        else:
            say(f"  {mm.params_label(p)} MINB{p['MINB']}: {e['tflops']:6.2f} TF "
                f"{100 * e['ratio']:4.0f}%  regs {e['registers']} spill {e['spill_bytes']} "
                f"smem {e['shared']}")
    return res


def numba_variants(mm, n=4096):
    """Numba register-tiled variants (the kernel of matmul_v5 with other tile sizes)."""
    import cupy
    from numba import cuda, float32

    def make(BM, BN, BK, TM, TN):
        NT = (BM // TM) * (BN // TN)
        BMP = BM + 4
        SM, SN = BM // (TM // 4), BN // (TN // 4)

        @cuda.jit
        def k(A, B, C):
            As = cuda.shared.array((BK, BMP), float32)
            Bs = cuda.shared.array((BK, BN), float32)
            acc = cuda.local.array((TM, TN), float32)
            ra = cuda.local.array(TM, float32)
            rb = cuda.local.array(TN, float32)
            M, K = A.shape
            N = B.shape[1]
            tid = cuda.threadIdx.x
            m0 = cuda.blockIdx.y * BM
            n0 = cuda.blockIdx.x * BN
            tr = tid // (BN // TN)
            tc = tid % (BN // TN)
            for i in range(TM):
                for j in range(TN):
                    acc[i, j] = float32(0.0)
            for k0 in range(0, K, BK):
                for l in range(BM * BK // NT):
                    idx = tid + l * NT
                    r = idx // BK
                    c = idx % BK
                    As[c, r] = A[m0 + r, k0 + c] if m0 + r < M and k0 + c < K else float32(0.0)
                for l in range(BK * BN // NT):
                    idx = tid + l * NT
                    r = idx // BN
                    c = idx % BN
                    Bs[r, c] = B[k0 + r, n0 + c] if k0 + r < K and n0 + c < N else float32(0.0)
                cuda.syncthreads()
                for kk in range(BK):
                    for i in range(TM):
                        ra[i] = As[kk, (i // 4) * SM + tr * 4 + i % 4]
                    for j in range(TN):
                        rb[j] = Bs[kk, (j // 4) * SN + tc * 4 + j % 4]
                    for i in range(TM):
                        for j in range(TN):
                            acc[i, j] += ra[i] * rb[j]
                cuda.syncthreads()
            for i in range(TM):
                r = m0 + (i // 4) * SM + tr * 4 + i % 4
                for j in range(TN):
                    c = n0 + (j // 4) * SN + tc * 4 + j % 4
                    if r < M and c < N:
                        C[r, c] = acc[i, j]
        return k, NT

    rng = np.random.default_rng(5)
    A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = cupy.empty((n, n), dtype=cupy.float32)
    ref = A[:128].astype(cupy.float64) @ B.astype(cupy.float64)
    dA, dB, dC = (cuda.as_cuda_array(x) for x in (A, B, C))
    fns = {}
    for cfg in [(128, 128, 8, 8, 8), (64, 64, 8, 4, 4), (128, 128, 16, 8, 8), (128, 64, 8, 8, 4),
                (64, 128, 8, 4, 8), (128, 128, 8, 8, 4)]:
        k, nt = make(*cfg)
        grid = ((n + cfg[1] - 1) // cfg[1], (n + cfg[0] - 1) // cfg[0])
        fns["nb" + "x".join(map(str, cfg))] = (lambda k=k, grid=grid, nt=nt:
                                               k[grid, nt](dA, dB, dC))
    t = cb.bench(fns, baseline={"cuBLAS": lambda: cupy.matmul(A, B, out=C)}, flops=2.0 * n ** 3,
                 repeat=5, quiet=True,
                 check=lambda name: cb.check(C[:128], ref, **mm.tolerance(n)))
    say("\nNumba variants at 4096 (BM BN BK TM TN)")
    for r in t.rows:
        say(f"  {r.name:18s} {r.value:6.2f} TF {100 * (r.ratio or 1):4.0f}%")


def pytest_gpu():
    import subprocess
    import tempfile
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write("import numpy as np\nif not hasattr(np, 'row_stack'): np.row_stack = np.vstack\n")
    env = dict(os.environ, PYTHONPATH=d + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/test_ch04.py",
                        "-p", "no:cacheprovider"], capture_output=True, text=True, env=env,
                       cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    say("\npytest tests/test_ch04.py on the GPU:\n" + "\n".join(
        (r.stdout + r.stderr).strip().splitlines()[-25:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep2", action="store_true")
    ap.add_argument("--numba-variants", action="store_true")
    ap.add_argument("--pytest", action="store_true")
    ap.add_argument("--graders", action="store_true")
    ap.add_argument("--sizes", default="1024,2048,4096")
    args = ap.parse_args()
    cb.report()
    say(f"CUPY_TF32={os.environ.get('CUPY_TF32')!r} cc={cb.cc()}")
    mm = cb.load_numba("matmul")
    t = time.time()
    mod = cb.load_cuda("matmul")
    say(f"compile matmul.cu: {time.time() - t:.1f} s")
    for step in (lambda: correctness(mod, mm), lambda: resources(mod, mm),
                 (lambda: timings(mod, mm, [int(s) for s in args.sizes.split(",")]))
                 if args.sizes else None,
                 (lambda: sweep(mm)) if args.sweep else None,
                 (lambda: sweep(mm, configs=SWEEP2)) if args.sweep2 else None,
                 (lambda: numba_variants(mm)) if args.numba_variants else None,
                 pytest_gpu if args.pytest else None,
                 (lambda: graders()) if args.graders else None):
        if step is None:
            continue
        try:
            step()
        except Exception:  # noqa: BLE001
            say("STEP FAILED:\n" + traceback.format_exc()[-2000:])
    say(f"\ntotal {time.time() - T0:.0f} s")
    print("\n======== SUMMARY ========")
    print("\n".join(SUMMARY))


def graders():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    import test_ch04 as T
    T.run_gpu_checks(say)


if __name__ == "__main__":
    main()
