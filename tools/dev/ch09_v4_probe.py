#!/usr/bin/env python3
"""Shows: Chapter 9's Hopper forward attention_v4 (both overlap choices) checked against float64
on ragged sizes, then timed against attention_v3 and SDPA's flash and cuDNN backends (bf16, B = 8,
H = 16, N = 4096, D = 64 and 128, causal and not), in one run on an H100.

    python tools/dev/ch09_v4_probe.py [--check-only | --time-only | --variants]

--variants times other instantiations of flash_wgmma (stages, overlap, ping-pong of the two
consumer warpgroups) at the same shapes, each first compared with the default kernel.
v4 without the overlap exists in bf16 only (the launcher refuses f16): in f16 only the default
v4 is checked, and the probe says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import cudabook as cb  # noqa: E402, I001
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ch09_common import OUT, Log, rel, scores  # noqa: E402

al = cb.load_launch("attention")
log = Log("ch09_v4_probe.log", "a")
DT = {"bf16": torch.bfloat16, "f16": torch.float16}
TOL = {"f16": 5e-3, "bf16": 2e-2}


def ref(q, k, v, causal, heads):
    Q, K, V = (x[heads].double() for x in (q, k, v))
    S = scores(Q, K, causal)
    return torch.softmax(S, -1) @ V, torch.logsumexp(S, -1)


NOLAP_DTYPES = ("bf16",)   # attention_launch.fwd_config: "compiled for bfloat16 only"


def check(BH, Nq, Nk, D, causal, dt, overlap=True) -> bool | None:
    """True if v4 matches float64 here; None (after saying so) for a variant the launcher
    refuses. ``overlap`` is the launcher's: True (its default) or False, never None (falsy)."""
    if not overlap and dt not in NOLAP_DTYPES:
        log(f"skip v4 overlap=False {dt}: compiled for {', '.join(NOLAP_DTYPES)} only")
        return None
    g = torch.Generator(device="cuda").manual_seed(BH + Nq + D + causal)
    mk = lambda n: torch.randn(BH, n, D, generator=g, device="cuda", dtype=DT[dt])  # noqa: E731
    q, k, v = mk(Nq), mk(Nk), mk(Nk)
    heads = sorted({0, BH // 2, BH - 1})
    O, L = ref(q, k, v, causal, heads)
    o = torch.full_like(q, float("nan"))
    lo = torch.full(q.shape[:-1], float("nan"), device="cuda")
    try:
        al.forward(q, k, v, causal, "v4", out=(o, lo), overlap=overlap)
        torch.cuda.synchronize()
        eo, el = rel(o[heads], O), rel(lo[heads], L)
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        eo = el = math.inf
    good = eo < TOL[dt] and el < 1e-4
    tag = "" if overlap else " overlap=False"
    log(f"{'ok  ' if good else 'FAIL'} v4{tag} {dt} BH={BH} Nq={Nq} "
        f"Nk={Nk} D={D} causal={int(causal)}  O {eo:.1e}  lse {el:.1e}")
    return good


def checks() -> None:
    n = bad = skipped = 0
    cases = [(2, 17, 17), (2, 1, 1), (2, 1000, 1000), (192, 1000, 1000), (2, 4097, 4097),
             (3, 70, 150), (3, 150, 77), (3, 1, 300), (3, 300, 1)]
    for dt in ("bf16", "f16"):
        for BH, Nq, Nk in cases:
            for D in (64, 128):
                for causal in (False, True):
                    if dt == "f16" and BH == 192:
                        continue
                    n += 1
                    bad += not check(BH, Nq, Nk, D, causal, dt)
    for dt in DT:
        if dt not in NOLAP_DTYPES:
            log(f"skip v4 overlap=False {dt}: compiled for {', '.join(NOLAP_DTYPES)} only")
            skipped += 1
            continue
        for BH, Nq, Nk in cases[:5]:
            for D in (64, 128):
                for causal in (False, True):
                    n += 1
                    bad += not check(BH, Nq, Nk, D, causal, dt, overlap=False)
    log(f"checks: {n - bad} of {n} pass" + (f" (no-overlap kernel skipped in {skipped} dtype)"
                                            if skipped else ""))


def bench(name, fn, flop):
    try:
        r = cb.bench({name: fn}, flops=flop, repeat=20, quiet=True)[name]
        log(f"    {name:22s} {r.time_us:9.1f} us  {r.value:6.1f} TFLOP/s")
        return r.value
    except Exception as e:  # noqa: BLE001
        log(f"    {name:22s} failed: {type(e).__name__}: {str(e)[:300]}")
        return None


def timings() -> None:
    B, H, N = 8, 16, 4096
    rows, summ = [], []
    for D in (64, 128):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(D)
            q, k, v = (torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            f = al.flops(B * H, N, N, D, causal)
            log(f"--- bf16 B={B} H={H} N={N} D={D} causal={causal}")
            res = {"v3": bench("attention_v3", lambda: al.forward(q, k, v, causal, "v3"), f),
                   "v4": bench("attention_v4", lambda: al.forward(q, k, v, causal, "v4"), f),
                   "v4 other": bench("attention_v4 no overlap",
                                     lambda: al.forward(q, k, v, causal, "v4",
                                                        overlap=False), f)}
            for bn, be in (("SDPA flash", SDPBackend.FLASH_ATTENTION),
                           ("SDPA cudnn", SDPBackend.CUDNN_ATTENTION)):
                def fn(be=be):
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                res[bn] = bench(bn, fn, f)
            rows.append({"D": D, "causal": causal, **res})
            r = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
            summ.append(f"D={D:3d} causal={int(causal)} v3 {res['v3'] or 0:4.0f} v4 "
                        f"{res['v4'] or 0:4.0f} other {res['v4 other'] or 0:4.0f} flash "
                        f"{res['SDPA flash'] or 0:4.0f} cudnn {res['SDPA cudnn'] or 0:4.0f} | "
                        f"v4/cudnn {r(res['v4'], res['SDPA cudnn'])} "
                        f"other/cudnn {r(res['v4 other'], res['SDPA cudnn'])} "
                        f"v4/flash {r(res['v4'], res['SDPA flash'])}")
            torch.cuda.empty_cache()
    (OUT / "ch09_v4_timings.json").write_text(json.dumps(rows, indent=1))
    log("==== summary (TFLOP/s)\n" + "\n".join(summ))


VARIANTS = [(st, ov, pp) for st in (2, 3) for ov in (False, True) for pp in (False, True)]


def variants() -> None:
    import numpy as np

    from cudabook.compile import inline_source, kernel_path

    names, extra = [], []
    for D in (64, 128):
        for st, ov, pp in VARIANTS:
            n = f"var_d{D}_st{st}_ov{int(ov)}_pp{int(pp)}"
            names.append((n, D, st))
            b = lambda x: "true" if x else "false"  # noqa: E731
            extra.append(f'extern "C" __global__ void __launch_bounds__(384, 1) {n}('
                         "const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, "
                         "const __grid_constant__ TmaDesc tv, __nv_bfloat16* O, float* lse, "
                         "int Nq, int Nk, float sl2, int causal) { flash_wgmma<__nv_bfloat16, "
                         f"{D}, 128, {st}, {b(ov)}, {b(pp)}>(tq, tk, tv, O, lse, Nq, Nk, sl2, "
                         "causal); }")
    src = inline_source(kernel_path("attention_forward")) + "\n" + "\n".join(extra)
    mod = cb.compile_source(src, options=("-arch=sm_90a",), name="attention_v4_variants")
    tmap = cb.load_launch("hgemm").tensor_map

    def fn(name, D, st):
        smem = (128 + 2 * st * 128) * D * 2 + 1024
        kern = al.kernel(mod, name)
        kern.max_dynamic_shared_size_bytes = smem

        def f(q, k, v, causal):
            BH, N = q.shape[0] * q.shape[1], q.shape[2]
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], device="cuda")
            t = [tmap(x.data_ptr(), BH * N, D, 128, "bfloat16", box_cols=64) for x in (q, k, v)]
            kern((cb.ceil_div(N, 128), BH), (384,),
                 (*t, np.uint64(o.data_ptr()), np.uint64(lse.data_ptr()), np.int32(N),
                  np.int32(N), np.float32(al.LOG2E / math.sqrt(D)), np.int32(causal)),
                 shared_mem=smem)
            return o
        return f

    fns = {n: (D, fn(n, D, st)) for n, D, st in names}
    for D in (64, 128):
        q, k, v = (torch.randn(2, 3, 1000, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            o, _ = al.forward(q, k, v, causal, "v4")
            for n, (d, f) in fns.items():
                if d == D:
                    log(f"{n} causal={int(causal)}: rel. difference to v4 "
                        f"{rel(f(q, k, v, causal), o.double()):.1e}")
    B, H, N = 8, 16, 4096
    summ = []
    for D in (64, 128):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(D)
            q, k, v = (torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            fl = al.flops(B * H, N, N, D, causal)
            log(f"--- variants bf16 B={B} H={H} N={N} D={D} causal={causal}")
            res = {n: bench(n, lambda f=f: f(q, k, v, causal), fl)
                   for n, (d, f) in fns.items() if d == D}
            res["v4"] = bench("attention_v4", lambda: al.forward(q, k, v, causal, "v4"), fl)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            res["cudnn"] = bench("SDPA cudnn", cudnn, fl)
            summ.append(f"D={D} causal={int(causal)}: " + "  ".join(
                f"{n.replace('var_', '')} {x:.0f}" for n, x in res.items() if x))
    log("==== variants (TFLOP/s)\n" + "\n".join(summ))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--variants", action="store_true")
    a = ap.parse_args()
    m = al.module("forward")
    for name in al.kernel_names("forward"):
        if "v4" in name:
            r = al.resources(m, name)
            log(f"{name:30s} {r['registers']} registers {r['local_bytes']} local bytes")
    if a.variants:
        variants()
        return 0
    if not a.time_only:
        checks()
    if not a.check_only:
        timings()
    return 0


if __name__ == "__main__":
    sys.exit(main())
