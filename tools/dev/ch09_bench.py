#!/usr/bin/env python3
"""Shows: every Chapter 9 attention kernel checked against float64 on ragged sizes, then the bf16
forward and backward timed against PyTorch SDPA's flash, cuDNN and memory-efficient backends
(B = 8, H = 16, N = 4096, D = 64 and 128, causal and not), in one run; tile variants optional.

    python tools/dev/ch09_bench.py                 # checks + timings (about 2 minutes on an H100)
    python tools/dev/ch09_bench.py --variants      # also time other tile shapes of v3 / bwd v2
    python tools/dev/ch09_bench.py --no-check      # timings only

Checks: N = 1, 17, 1000, 4097 (no multiple of a tile); batch x heads = 2 and 192 (below and
above the H100's 132 SMs); three heads of each case against a float64 autograd reference of the
same (rounded) inputs, outputs NaN-prefilled. Full logs and a JSON of the timings go to $OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import cudabook as cb  # noqa: E402, I001  (first: the mode)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ch09_common import OUT, Log, rel, scores  # noqa: E402

al = cb.load_launch("attention")
log = Log("ch09_bench.log")
DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 2e-2}      # relative Frobenius error
SUMMARY: list[str] = []


def reference(q, k, v, do, causal, heads):
    """O, lse, dQ, dK, dV of the given heads in float64 (torch autograd on the GPU)."""
    Q, K, V = (x[heads].double().requires_grad_() for x in (q, k, v))
    S = scores(Q, K, causal)
    lse = torch.logsumexp(S, -1)
    O = torch.softmax(S, -1) @ V
    dQ, dK, dV = torch.autograd.grad(O, (Q, K, V), do[heads].double())
    return O.detach(), lse.detach(), dQ, dK, dV


def nan_like(x, shape=None, dtype=None):
    return torch.full(shape or x.shape, float("nan"), dtype=dtype or x.dtype, device=x.device)


def check_case(BH, Nq, Nk, D, causal, dt, fwd_versions, bwd_version) -> bool:
    g = torch.Generator(device="cuda").manual_seed(BH * 7 + Nq + D + causal)
    mk = lambda n: torch.randn(BH, n, D, generator=g, device="cuda", dtype=DT[dt])  # noqa: E731
    q, k, v, do = mk(Nq), mk(Nk), mk(Nk), mk(Nq)
    heads = sorted({0, BH // 2, BH - 1})
    O, lse, dQ, dK, dV = reference(q, k, v, do, causal, heads)
    ok = True
    tag = f"{dt:4s} BH={BH:3d} Nq={Nq:4d} Nk={Nk:4d} D={D:3d} causal={int(causal)}"
    for ver in fwd_versions:
        o, lo = nan_like(q), nan_like(q, q.shape[:-1], torch.float32)
        try:
            al.forward(q, k, v, causal, ver, out=(o, lo))
            torch.cuda.synchronize()
            eo, el = rel(o[heads], O), rel(lo[heads], lse)
            good = eo < TOL[dt] and el < 1e-4
        except Exception as e:  # noqa: BLE001
            eo = el = math.inf
            good = False
            log(traceback.format_exc())
            log(f"  {ver} raised {type(e).__name__}: {e}")
        ok &= good
        log(f"{'ok  ' if good else 'FAIL'} fwd {ver} {tag}  O {eo:.1e}  lse {el:.1e}")
    if bwd_version:
        o, lo = al.forward(q, k, v, causal, fwd_versions[-1])
        grads = tuple(nan_like(x) for x in (q, k, v))
        try:
            al.backward(q, k, v, o, lo, do, causal, bwd_version, out=grads)
            torch.cuda.synchronize()
            errs = [rel(gr[heads], r) for gr, r in zip(grads, (dQ, dK, dV))]
            good = all(e < 2 * TOL[dt] for e in errs)
        except Exception as e:  # noqa: BLE001
            errs = [math.inf] * 3
            good = False
            log(traceback.format_exc())
            log(f"  bwd {bwd_version} raised {type(e).__name__}: {e}")
        ok &= good
        log(f"{'ok  ' if good else 'FAIL'} bwd {bwd_version} {tag}  dQ {errs[0]:.1e}  "
            f"dK {errs[1]:.1e}  dV {errs[2]:.1e}")
    if dt != "f32" and Nq == Nk and Nq > 1:      # SDPA flash's own error, for scale
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qg[None], kg[None], vg[None], is_causal=causal)
        gq, gk, gv = torch.autograd.grad(out, (qg, kg, vg), do[None])
        log(f"     SDPA flash {tag}  O {rel(out[0][heads], O):.1e}  dQ {rel(gq[heads], dQ):.1e}  "
            f"dK {rel(gk[heads], dK):.1e}  dV {rel(gv[heads], dV):.1e}")
    return ok


def checks() -> None:
    fails = 0
    n = 0
    for dt, fv, bv in (("f32", ("v1", "v2"), "v1"), ("bf16", ("v3",), "v2"),
                       ("f16", ("v3",), "v2")):
        for N in (1, 17, 1000, 4097):
            for D in (64, 128):
                for causal in (False, True):
                    big = N in (17, 1000) or (N == 4097 and dt == "bf16")
                    for BH in ((2, 192) if big else (2,)):
                        vers = fv if not (N == 4097 and dt == "f32") else ("v2",)
                        n += 1
                        fails += not check_case(BH, N, N, D, causal, dt, vers, bv)
    for dt, fv, bv in (("f32", ("v1", "v2"), "v1"), ("bf16", ("v3",), "v2")):
        for (Nq, Nk) in ((70, 150), (150, 77), (1, 300)):     # Nq != Nk
            for causal in (False, True):
                n += 1
                fails += not check_case(3, Nq, Nk, 128, causal, dt, fv, bv)
    SUMMARY.append(f"checks: {n - fails} of {n} cases pass")
    log(SUMMARY[-1])


# ------------------------------------------------------------------------------ timing
def sdpa_fwd(backend, q, k, v, causal):
    def f():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def sdpa_bwd(backend, q, k, v, do, causal):
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)


BACKENDS = {"SDPA flash": SDPBackend.FLASH_ATTENTION, "SDPA cudnn": SDPBackend.CUDNN_ATTENTION,
            "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION}
ROWS: list[dict] = []


def bench_one(name, fn, flop, repeat=20) -> float | None:
    try:
        t = cb.bench({name: fn}, flops=flop, repeat=repeat, quiet=True)
        r = t[name]
        log(f"    {name:28s} {r.time_us:9.1f} us  {r.value:6.1f} TFLOP/s")
        return r.value
    except Exception as e:  # noqa: BLE001
        log(f"    {name:28s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


def time_config(variants: dict, B: int, H: int, N: int, D: int, causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(D + causal)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    ff = al.flops(B * H, N, N, D, causal)
    fb = al.flops(B * H, N, N, D, causal, backward=True)
    log(f"--- bf16 B={B} H={H} N={N} D={D} causal={causal}")
    res = {"v3": bench_one("attention_v3", lambda: al.forward(q, k, v, causal, "v3"), ff)}
    for bn, be in BACKENDS.items():
        res[bn] = bench_one(bn, sdpa_fwd(be, q, k, v, causal), ff)
    for vn, vf in variants.get(("fwd", D), {}).items():
        res[vn] = bench_one(vn, lambda vf=vf: vf(q, k, v, causal), ff)
    o, lse = al.forward(q, k, v, causal, "v3")
    res["bwd v2"] = bench_one("attention_bwd_v2",
                              lambda: al.backward(q, k, v, o, lse, do, causal, "v2"), fb)
    for bn in ("SDPA flash", "SDPA cudnn"):
        res[bn + " bwd"] = bench_one(bn + " bwd", sdpa_bwd(BACKENDS[bn], q, k, v, do, causal), fb)
    for vn, vf in variants.get(("bwd", D), {}).items():
        res[vn] = bench_one(vn, lambda vf=vf: vf(q, k, v, o, lse, do, causal), fb)
    return res


def timings(variants: dict, B=8, H=16, N=4096) -> None:
    table = []
    for D in (64, 128):
        for causal in (False, True):
            res = time_config(variants, B, H, N, D, causal)
            table.append((D, causal, res))
            ROWS.append({"D": D, "causal": causal, **res})
            torch.cuda.empty_cache()
    SUMMARY.append("bf16 B=8 H=16 N=4096, TFLOP/s (ratio of ours to SDPA flash, fwd and bwd)")
    for D, causal, res in table:
        fl, cu = res.get("SDPA flash"), res.get("SDPA cudnn")
        v3, b2, fb = res.get("v3"), res.get("bwd v2"), res.get("SDPA flash bwd")
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        extra = " ".join(f"{k}={v:.0f}" for k, v in res.items() if k.startswith("var") and v)
        SUMMARY.append(f"D={D:3d} causal={int(causal)}  v3 {v3 or 0:5.0f}  flash {fl or 0:5.0f}  "
                       f"cudnn {cu or 0:5.0f}  eff {res.get('SDPA efficient') or 0:4.0f}  "
                       f"v3/flash {ratio(v3, fl)}  v3/cudnn {ratio(v3, cu)} | "
                       f"bwd v2 {b2 or 0:5.0f}  flash {fb or 0:5.0f}  "
                       f"cudnn {res.get('SDPA cudnn bwd') or 0:5.0f}  bwd/flash {ratio(b2, fb)} "
                       f"{extra}")


# ------------------------------------------------------------------------------ variants
def make_variants() -> dict:
    """Other tile shapes of v3 and bwd v2, compiled from the same source with extra
    instantiations: {("fwd"|"bwd", D): {name: fn}}."""
    fwd = [("var_f64_128x128", 64, 128, 128, 4), ("var_f64_64x64", 64, 64, 64, 4),
           ("var_f64_128x128w8", 64, 128, 128, 8), ("var_f128_128x32", 128, 128, 32, 4),
           ("var_f128_128x64w8", 128, 128, 64, 8), ("var_f128_64x64", 128, 64, 64, 4)]
    bwd = [("var_b64_128x64", 64, 128, 64), ("var_b128_64x64", 128, 64, 64)]
    extra = []
    for name, D, br, bc, nw in fwd:
        extra.append(f'extern "C" __global__ void __launch_bounds__({nw * 32}) {name}('
                     "const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V, "
                     "__nv_bfloat16* O, float* lse, int Nq, int Nk, float sl2, int causal) { "
                     f"flash_mma<__nv_bfloat16, {D}, {br}, {bc}, {nw}>(Q, K, V, O, lse, Nq, Nk, "
                     "sl2, causal); }")
    for name, D, bc, br in bwd:
        extra.append(f'extern "C" __global__ void __launch_bounds__({bc * 2}) {name}('
                     "const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V, "
                     "const __nv_bfloat16* dO, const float* lse, const float* Di, float* dQacc, "
                     "__nv_bfloat16* dK, __nv_bfloat16* dV, int Nq, int Nk, float scale, "
                     "int causal) { flash_bwd_mma<__nv_bfloat16, "
                     f"{D}, {bc}, {br}, {bc // 16}>(Q, K, V, dO, lse, Di, dQacc, dK, dV, Nq, Nk, "
                     "scale, causal); }")
    mods = {}
    for which in ("forward", "backward"):
        from cudabook.compile import inline_source, kernel_path

        src = inline_source(kernel_path(f"attention_{which}"))
        src += "\n" + "\n".join(e for e in extra if ("flash_bwd" in e) == (which == "backward"))
        mods[which] = cb.compile_source(src, name=f"attention_{which}_variants")
    out: dict = {}
    P = lambda t: np.uint64(t.data_ptr())  # noqa: E731

    def fwd_fn(name, D, br, bc, nw):
        smem = (br + 2 * bc) * D * 2
        kern = al.kernel(mods["forward"], name)
        kern.max_dynamic_shared_size_bytes = smem

        def f(q, k, v, causal):
            B, H, N, _ = q.shape
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], device="cuda")
            kern((cb.ceil_div(N, br), B * H), (nw * 32,),
                 (P(q), P(k), P(v), P(o), P(lse), np.int32(N), np.int32(N),
                  np.float32(al.LOG2E / math.sqrt(D)), np.int32(causal)), shared_mem=smem)
            return o
        return f

    def bwd_fn(name, D, bc, br):
        smem = (2 * bc * D + 4 * br * D + bc * br) * 2 + 4 * br * 4
        kern = al.kernel(mods["backward"], name)
        kern.max_dynamic_shared_size_bytes = smem
        pre = al.kernel(mods["backward"], "attention_bwd_v2_preprocess_bf16")
        conv = al.kernel(mods["backward"], "attention_bwd_v2_convert_bf16")

        def f(q, k, v, o, lse, do, causal):
            B, H, N, _ = q.shape
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            di = torch.empty(q.shape[:-1], device="cuda")
            acc = torch.empty(q.shape, device="cuda")
            s = np.float32(1 / math.sqrt(D))
            pre((cb.ceil_div(B * H * N, 4),), (128,), (P(o), P(do), P(di), P(acc),
                                                      np.int32(B * H * N), np.int32(D)))
            kern((cb.ceil_div(N, bc), B * H), (2 * bc,),
                 (P(q), P(k), P(v), P(do), P(lse), P(di), P(acc), P(dk), P(dv), np.int32(N),
                  np.int32(N), s, np.int32(causal)), shared_mem=smem)
            conv((cb.ceil_div(B * H * N * D, 256),), (256,), (P(acc), P(dq),
                                                             np.uint64(B * H * N * D), s))
            return dq, dk, dv
        return f

    for name, D, br, bc, nw in fwd:
        r = al.resources(mods["forward"], name)
        log(f"variant {name}: {r['registers']} registers, {r['local_bytes']} local bytes")
        out.setdefault(("fwd", D), {})[name] = fwd_fn(name, D, br, bc, nw)
    for name, D, bc, br in bwd:
        r = al.resources(mods["backward"], name)
        log(f"variant {name}: {r['registers']} registers, {r['local_bytes']} local bytes")
        out.setdefault(("bwd", D), {})[name] = bwd_fn(name, D, bc, br)
    # a variant must compute the same thing: compare with v3 / bwd v2 once
    for (kind, D), fns in out.items():
        q, k, v, do = (torch.randn(2, 3, 1000, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        o, lse = al.forward(q, k, v, True, "v3")
        ref = (o,) if kind == "fwd" else al.backward(q, k, v, o, lse, do, True, "v2")
        for vn, vf in fns.items():
            got = vf(q, k, v, True) if kind == "fwd" else vf(q, k, v, o, lse, do, True)
            got = (got,) if kind == "fwd" else got
            e = max(rel(a, b.double()) for a, b in zip(got, ref))
            log(f"variant {vn}: max rel. difference to the default {e:.1e}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    cb.report()
    log(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for which in ("forward", "backward"):
        m = al.module(which)
        for name in al.kernel_names(which):
            r = al.resources(m, name)
            log(f"{name:32s} {r['registers']:4d} registers {r['local_bytes']:4d} local bytes "
                f"{r['shared_bytes']:6d} static shared")
    if not a.no_check:
        checks()
        log(f"[{time.time() - t0:.0f} s]")
    variants = {}
    if a.variants:
        try:
            variants = make_variants()
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
    timings(variants)
    (OUT / "ch09_timings.json").write_text(json.dumps(ROWS, indent=1))
    log(f"[{time.time() - t0:.0f} s]")
    log("\n".join(["", "==== summary", *SUMMARY]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
