#!/usr/bin/env python3
"""Shows: chapter 9's Hopper kernels (forward attention_v4, backward attention_bwd_v3) checked
against float64 autograd on ragged sizes, grouped-query heads included, then timed against
PyTorch SDPA's cuDNN backend (forward and backward) in the same run.

    python tools/dev/ch09_hopper.py                # checks + timings (H100 / H200 only)
    python tools/dev/ch09_hopper.py --no-check     # timings only
    python tools/dev/ch09_hopper.py --quick        # small checks, one timing configuration
    python tools/dev/ch09_hopper.py --sched        # attention_bwd_v3 with early_dv on and off
    python tools/dev/ch09_hopper.py --diag         # timing only: attention_bwd_v3 with parts
                                                   # removed (wrong numbers), to see their cost

Checks: N = 1, 17, 1000, 4097 (and 16384 for one head), Nq != Nk, causal and not, groups of
query heads per key/value head 1, 4 and 8, outputs NaN-prefilled; three heads of each case
against torch float64 autograd of the same (rounded) inputs. Timings: bf16, B = 8, H = 16,
N = 4096 and 16384, D = 64 and 128, causal and not (FLOPs counted as in al.flops: causal
halved). A log and a JSON of the timings go to $OUT.
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
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ch09_common import OUT, Log, rel, scores  # noqa: E402

al = cb.load_launch("attention")
log = Log("ch09_hopper.log")
DT = {"bf16": torch.bfloat16, "f16": torch.float16}
TOL = {"f16": 5e-3, "bf16": 2e-2}      # relative Frobenius error (bwd: twice)
SUMMARY: list[str] = []
BWD = ("v3",)                          # the Hopper backward versions checked


def reference(q, k, v, do, causal, heads, group):
    """O, lse, dQ, dK, dV in float64 of query heads `heads` (and their key/value heads)."""
    kvh = sorted({h // group for h in heads})
    Q = q[heads].double().requires_grad_()
    K, V = (x[kvh].double().requires_grad_() for x in (k, v))
    idx = torch.tensor([kvh.index(h // group) for h in heads], device=q.device)
    S = scores(Q, K[idx], causal)
    lse = torch.logsumexp(S, -1)
    O = torch.softmax(S, -1) @ V[idx]
    # only the selected query heads contribute: dK, dV of a shared head are partial unless
    # every head of its group is selected (the checks select whole groups)
    dQ, dK, dV = torch.autograd.grad(O, (Q, K, V), do[heads].double())
    return O.detach(), lse.detach(), dQ, dK, dV, kvh


def nan_like(x):
    return torch.full_like(x, float("nan"))


def check_case(BHkv, group, Nq, Nk, D, causal, dt) -> bool:
    g = torch.Generator(device="cuda").manual_seed(BHkv * 7 + Nq + D + causal + group)
    BH = BHkv * group
    q = torch.randn(BH, Nq, D, generator=g, device="cuda", dtype=DT[dt])
    do = torch.randn(BH, Nq, D, generator=g, device="cuda", dtype=DT[dt])
    k, v = (torch.randn(BHkv, Nk, D, generator=g, device="cuda", dtype=DT[dt]) for _ in range(2))
    kv_sel = sorted({0, BHkv - 1})
    heads = [h for kh in kv_sel for h in range(kh * group, (kh + 1) * group)]
    O, lse, dQ, dK, dV, kvh = reference(q, k, v, do, causal, heads, group)
    tag = f"{dt:4s} BH={BH:3d} G={group} Nq={Nq:5d} Nk={Nk:5d} D={D:3d} causal={int(causal)}"
    ok = True
    try:
        o, lo = nan_like(q), torch.full(q.shape[:-1], float("nan"), device="cuda")
        al.forward(q, k, v, causal, "v4", out=(o, lo))
        torch.cuda.synchronize()
        eo, el = rel(o[heads], O), rel(lo[heads], lse)
        good = eo < TOL[dt] and el < 1e-4
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        eo = el = math.inf
        good = False
        log(f"  v4 raised {type(e).__name__}: {e}")
    ok &= good
    log(f"{'ok  ' if good else 'FAIL'} fwd v4 {tag}  O {eo:.1e}  lse {el:.1e}")
    o, lo = al.forward(q, k, v, causal, "v4")
    for ver in BWD:
        try:
            grads = (nan_like(q), nan_like(k), nan_like(v))
            al.backward(q, k, v, o, lo, do, causal, ver, out=grads)
            torch.cuda.synchronize()
            errs = [rel(grads[0][heads], dQ), rel(grads[1][kvh], dK), rel(grads[2][kvh], dV)]
            good = all(e < 2 * TOL[dt] for e in errs)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            errs = [math.inf] * 3
            good = False
            log(f"  bwd {ver} raised {type(e).__name__}: {e}")
        ok &= good
        log(f"{'ok  ' if good else 'FAIL'} bwd {ver} {tag}  dQ {errs[0]:.1e}  dK {errs[1]:.1e}  "
            f"dV {errs[2]:.1e}")
    return ok


def checks(quick: bool) -> None:
    cases = []
    for dt in ("bf16", "f16"):
        for N in ((17, 1000) if quick else (1, 17, 1000, 4097)):
            for D in (64, 128):
                for causal in (False, True):
                    cases.append((2, 1, N, N, D, causal, dt))
    for (Nq, Nk) in ((70, 150), (150, 77), (1, 300), (300, 1)):
        for causal in (False, True):
            cases.append((3, 1, Nq, Nk, 128, causal, "bf16"))
            cases.append((3, 1, Nq, Nk, 64, causal, "bf16"))
    for group in (4, 8):
        for D in (64, 128):
            for causal in (False, True):
                cases.append((2, group, 1000, 1000, D, causal, "bf16"))
                if not quick:
                    cases.append((2, group, 333, 517, D, causal, "f16"))
    if not quick:
        for D in (64, 128):
            cases.append((1, 1, 16384, 16384, D, True, "bf16"))
    fails = sum(not check_case(*c) for c in cases)
    SUMMARY.append(f"checks: {len(cases) - fails} of {len(cases)} cases pass")
    log(SUMMARY[-1])


# ------------------------------------------------------------------------------ timing
def sdpa_fwd(q, k, v, causal):
    def f():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def sdpa_bwd(q, k, v, do, causal):
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)


ROWS: list[dict] = []


def bench_one(name, fn, flop, repeat=20) -> float | None:
    try:
        r = cb.bench({name: fn}, flops=flop, repeat=repeat, quiet=True)[name]
        log(f"    {name:24s} {r.time_us:9.1f} us  {r.value:6.1f} TFLOP/s")
        return r.value
    except Exception as e:  # noqa: BLE001
        log(f"    {name:24s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


def time_config(B, H, N, D, causal, with_v2=True) -> dict:
    g = torch.Generator(device="cuda").manual_seed(D + causal)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    ff = al.flops(B * H, N, N, D, causal)
    fb = al.flops(B * H, N, N, D, causal, backward=True)
    log(f"--- bf16 B={B} H={H} N={N} D={D} causal={causal}")
    res = {"B": B, "H": H, "N": N, "D": D, "causal": causal}
    res["v4"] = bench_one("attention_v4", lambda: al.forward(q, k, v, causal, "v4"), ff)
    res["SDPA cudnn"] = bench_one("SDPA cudnn", sdpa_fwd(q, k, v, causal), ff)
    o, lse = al.forward(q, k, v, causal, "v4")
    res["bwd v3"] = bench_one("attention_bwd_v3",
                              lambda: al.backward(q, k, v, o, lse, do, causal, "v3"), fb)
    res["bwd v3 atomic"] = bench_one(
        "attention_bwd_v3 atomic",
        lambda: al.backward(q, k, v, o, lse, do, causal, "v3", dq_atomic=True), fb)
    if with_v2:
        res["bwd v2"] = bench_one("attention_bwd_v2",
                                  lambda: al.backward(q, k, v, o, lse, do, causal, "v2"), fb)
    res["SDPA cudnn bwd"] = bench_one("SDPA cudnn bwd", sdpa_bwd(q, k, v, do, causal), fb)
    r = lambda a, b: f"{res[a] / res[b]:.3f}" if res.get(a) and res.get(b) else "-"  # noqa: E731
    SUMMARY.append(f"N={N:5d} D={D:3d} causal={int(causal)}  fwd v4 {res['v4'] or 0:5.0f} "
                   f"cudnn {res['SDPA cudnn'] or 0:5.0f} ({r('v4', 'SDPA cudnn')})  |  bwd v3 "
                   f"{res['bwd v3'] or 0:5.0f} v2 {res.get('bwd v2') or 0:5.0f} cudnn "
                   f"{res['SDPA cudnn bwd'] or 0:5.0f} ({r('bwd v3', 'SDPA cudnn bwd')})")
    ROWS.append(res)
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------ diagnosis
#: text edits of attention_backward.cu that take a part of attention_bwd_v3 out (the results are
#: wrong: these only time what is left)
DIAG = {
    "no dQ reduction": [("bulk_reduce_add_f32(dQacc", "if (Nq < 0) bulk_reduce_add_f32(dQacc")],
    "no dS barrier": [("named_sync(1);                            // both", "// both")],
    "no dQ product": [("            wg_tt<T>(dq,", "            if (Nq < 0) wg_tt<T>(dq,")],
    "no dK/dV products": [("wg_rs<D, T>(dv,", "if (Nq < 0) wg_rs<D, T>(dv,"),
                          ("wg_rs<D, T>(dk,", "if (Nq < 0) wg_rs<D, T>(dk,")],
    "no dS store": [("d32[((col / 64) * BC * 64", "if (Nq < 0) d32[((col / 64) * BC * 64")],
    # not a removal: dV, dK waited for after dQ (they overlap the barrier); same results
    "dV/dK wait late": [
        ("wgmma_wait<0>();" + " " * 26 + """// dV, dK done: P^T, dS^T registers are free
        pin_all<D / 2>(dv);
        pin_all<D / 2>(dk);
        pin_all<4 * KR>(&pa[0][0]);
        pin_all<4 * KR>(&da[0][0]);
        named_sync(1);""", "// (late)\n        named_sync(1);"),
        ("""        wgmma_wait<0>();
        pin_all<32>(dq);""", """        wgmma_wait<0>();
        pin_all<32>(dq);
        pin_all<D / 2>(dv);
        pin_all<D / 2>(dk);
        pin_all<4 * KR>(&pa[0][0]);
        pin_all<4 * KR>(&da[0][0]);""")],
}


def diagnose() -> None:
    from cudabook.compile import arch_options, inline_source, kernel_path

    base = inline_source(kernel_path("attention_backward"))
    SUMMARY.append("attention_bwd_v3 with parts removed, bf16 B=8 H=16 N=4096 (TFLOP/s)")
    mods = {}
    for name, edits in DIAG.items():
        src = base
        for old, new in edits:
            if src.count(old) != 1:
                log(f"diag {name}: edit {old!r} matches {src.count(old)} times; skipped")
                break
            src = src.replace(old, new)
        else:
            mods[name] = cb.compile_source(src, arch_options(True) + ("-DCB_ONLY",
                                           "-DCB_ONLY_attention_bwd_v3"), name=f"diag_{len(mods)}")
    for D in (64, 128):
        q, k, v, do = (torch.randn(8, 16, 4096, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        o, lse = al.forward(q, k, v, False, "v4")
        fb = al.flops(128, 4096, 4096, D, False, backward=True)
        line = [f"D={D}"]
        run = lambda: al.backward(q, k, v, o, lse, do, False, "v3")  # noqa: E731
        line.append(f"full {bench_one('bwd v3', run, fb) or 0:.0f}")
        for name, mod in mods.items():
            orig = cb.module

            def patched(fname, *a, mod=mod, orig=orig, **kw):
                return mod if fname == "attention_backward" else orig(fname, *a, **kw)
            cb.module = patched
            try:
                val = bench_one(name, run, fb)
            finally:
                cb.module = orig
            line.append(f"{name} {val or 0:.0f}")
        SUMMARY.append("  ".join(line))


def schedules() -> None:
    """attention_bwd_v3 compiled with dV's product issued before dS^T is computed (early_dv=True)
    and after it (False), at both head dimensions, checked against the committed kernel and timed
    beside it and cuDNN, bf16 B=8 H=16 N=4096 and B=2 N=16384."""
    for edv in (False, True):
        mod = al.module("backward", "v3", early_dv=edv)
        for D in (64, 128):
            r = al.resources(mod, f"attention_bwd_v3_bf16_d{D}")
            log(f"early_dv={edv} D={D}: {r['registers']} registers, {r['local_bytes']} local")
    SUMMARY.append("attention_bwd_v3 with early_dv False / True, bf16, TFLOP/s (ratio to cuDNN)")
    for (B, N) in ((8, 4096), (2, 16384)):
        for D in (64, 128):
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(D + causal)
                q, k, v, do = (torch.randn(B, 16, N, D, generator=g, device="cuda",
                                           dtype=torch.bfloat16) for _ in range(4))
                o, lse = al.forward(q, k, v, causal, "v4")
                fb = al.flops(B * 16, N, N, D, causal, backward=True)

                def run(edv=None):
                    return al.backward(q, k, v, o, lse, do, causal, "v3", early_dv=edv)
                want = run()
                line = [f"B={B} N={N:5d} D={D:3d} causal={int(causal)}"]
                cud = bench_one("SDPA cudnn bwd", sdpa_bwd(q, k, v, do, causal), fb) or 0
                v3 = bench_one("bwd v3", run, fb) or 0
                line.append(f"cudnn {cud:.0f} v3 {v3:.0f} ({v3 / cud:.3f})")
                for edv in (False, True):
                    errs = [rel(a_, b_) for a_, b_ in zip(run(edv), want)]
                    val = bench_one(f"early_dv={edv}", lambda edv=edv: run(edv), fb) or 0
                    bad = "" if max(errs) < 1e-3 else f" WRONG (vs v3 {max(errs):.1e})"
                    line.append(f"early_dv={edv} {val:.0f} ({val / cud:.3f}){bad}")
                SUMMARY.append("  ".join(line))
                log(SUMMARY[-1])
                q = k = v = do = o = lse = want = None
                torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--diag", action="store_true")
    ap.add_argument("--sched", action="store_true")
    a = ap.parse_args()
    if not cb.HAS_GPU or al.hopper_problem(cb.launch.device().cc):
        sys.exit("ch09_hopper: needs an H100 or H200 (compute capability 9.0)")
    t0 = time.time()
    cb.report()
    log(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for which, ver in (("forward", "v4"), ("backward", "v3")):
        m = al.module(which, ver)
        for name in al.kernel_names(which):
            if f"_{ver}_" in name:
                r = al.resources(m, name)
                log(f"{name:34s} {r['registers']:4d} registers {r['local_bytes']:4d} local bytes")
    if a.sched:
        schedules()
        log("\n".join(["", "==== summary", *SUMMARY]))
        return 0
    if a.diag:
        diagnose()
        log("\n".join(["", "==== summary", *SUMMARY]))
        return 0
    if not a.no_check:
        checks(a.quick)
        log(f"[{time.time() - t0:.0f} s]")
    SUMMARY.append("bf16 B=8 H=16, TFLOP/s (ratio to SDPA cuDNN)")
    for D in (64, 128):
        for causal in (False, True):
            time_config(8, 16, 4096, D, causal)
            if a.quick:
                break
    if not a.quick:
        for D in (64, 128):
            time_config(2, 16, 16384, D, True, with_v2=False)
            time_config(2, 16, 16384, D, False, with_v2=False)
    (OUT / "ch09_hopper.json").write_text(json.dumps(ROWS, indent=1))
    log(f"[{time.time() - t0:.0f} s]")
    log("\n".join(["", "==== summary", *SUMMARY]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
