"""Probe (GPU): v10 with 2 stages (96 KiB, fits an L4's 99 KiB) from hgemm.cu with gemm_mma10's
static_assert relaxed to STAGES >= 2 (a patched copy compiled here; hgemm.cu is not changed),
checked on ragged and interior shapes in fp16 and bf16; then one same-run timing at n = 4096 of
v6, v10 and their 96 KiB fallbacks against cuBLAS fp16. The timings are of THIS GPU (an H100
has room for two 96 KiB blocks per SM, an L4 for one): they show what the smaller tiles cost
here, not on an L4.   python tools/dev/small_gpu_probe.py
"""
from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.compile import arch_options, compile_source, inline_source, kernel_path

hg = cb.load_launch("hgemm")
cc = tuple(cb.cc())
src = inline_source(kernel_path("hgemm"))
old = 'static_assert(STAGES >= 3, "the copies of a tile'
patched = src.replace(old, 'static_assert(STAGES >= 2, "the copies of a tile')
print("hgemm.cu patched (STAGES >= 2):", old in src)
p2 = dict(BM=128, BN=256, STAGES=2, EPI=1, GROUP=8)
p6 = hg.FALLBACKS["v6"][0]
exprs = tuple(hg.template_name("mma", p, d) for p in (p2, p6) for d in ("float16", "bfloat16"))
mod2 = compile_source(patched, arch_options(True, cc), "hgemm.cu (gemm_mma10 STAGES >= 2)",
                      exprs)
mod2.cc, mod2.sm90a, mod2.exprs = cc, cc == (9, 0), exprs
hg.MMA10_MIN_STAGES = 2
import cupy as cp  # noqa: E402
import torch  # noqa: E402

rng = np.random.default_rng(1)
worst = {}
for dt in ("float16", "bfloat16"):
    for M, N, K in [(1, 1, 8), (127, 129, 72), (1000, 777, 520), (4096, 24, 64),
                    (16, 3000, 136), (300, 600, 192), (512, 512, 256), (256, 512, 4096)]:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K)).astype(np.float32)
        if dt == "float16":
            A, B = cp.asarray(a, dtype=cp.float16), cp.asarray(b, dtype=cp.float16)
            C = cp.full((M, N), cp.nan, cp.float16)
        else:
            A, B = (torch.tensor(x, device="cuda").bfloat16() for x in (a, b))
            C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        for name, p in (("v10 2 stages", p2), ("v6 128x128", p6)):
            hg.launch(mod2, "v9", A, B, C, params=p)
            e = hg.check(C, A, B, name=f"{name} {dt} {M}x{N}x{K}")
            worst[(name, dt)] = max(worst.get((name, dt), 0.0), e)
for k, e in worst.items():
    print(f"{k[0]:14s} {k[1]:9s} correct on 8 shapes, largest error {e:.2f} of the bound")

mod = hg.load()
for n in (4096,):
    g = np.random.default_rng(n)
    a = cp.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cp.float16)
    b = cp.asarray(g.standard_normal((n, n), dtype=np.float32)).astype(cp.float16)
    outs = {k: cp.empty((n, n), cp.float16) for k in ("ref", "v6", "v6f", "v10", "v10f")}
    band = slice(n - 64, n)
    fns = {"v6 (144 KiB)": lambda: hg.launch(mod, "v6", a, b, outs["v6"]),
           "v6 fallback 128x128 (96 KiB)":
               lambda: hg.launch(mod2, "v9", a, b, outs["v6f"], params=p6),
           "v10 (144 KiB)": lambda: hg.launch(mod, "v10", a, b, outs["v10"]),
           "v10 2 stages (96 KiB)": lambda: hg.launch(mod2, "v9", a, b, outs["v10f"], params=p2)}
    key = {"v6 (144 KiB)": "v6", "v6 fallback 128x128 (96 KiB)": "v6f", "v10 (144 KiB)": "v10",
           "v10 2 stages (96 KiB)": "v10f", "cuBLAS fp16": "ref"}
    t = cb.bench(fns, baseline={"cuBLAS fp16": lambda: cp.matmul(a, b.T, out=outs["ref"])},
                 flops=hg.flops(n, n, n), repeat=10, quiet=True,
                 check=lambda k: hg.check(outs[key[k]], a, b, rows=band, name=k))
    for r in t.rows:
        print(f"n={n} {r.name:30s} {r.value:7.1f} TFLOP/s"
              + ("" if r.is_baseline else f"  {r.ratio:.3f}x cuBLAS fp16"))
