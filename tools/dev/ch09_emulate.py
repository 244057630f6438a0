#!/usr/bin/env python3
"""Run kernels/attention_forward.cu and attention_backward.cu on the CPU (no GPU needed), every
version, on ragged sizes, causal and not, against a float64 reference of PyTorch's autograd.

    python tools/dev/ch09_emulate.py              # the quick set (about a minute on 2 cores)
    python tools/dev/ch09_emulate.py --full       # more sizes (N = 1, 17, 130, 200; both D)

Built from ch09_emu.h: one std::thread per CUDA thread, blocks one after another, the warp-wide
ldmatrix / mma.sync / shuffles emulated lane by lane as the PTX ISA lays out their fragments
(kernels/mma.cuh is replaced by the emulated one). It checks indexing, masking, the swizzle, the
fragment bookkeeping and barrier placement, not speed, and not NVRTC-only compile errors.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
import cudabook as cb  # noqa: E402,F401  (the mode first)

at = cb.load_launch("attention")

SHIMS = r'''
#include "ch09_emu.h"
#include "attention_forward.cu"
#include "attention_backward.cu"
#define G dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz}
#define B dim3{(unsigned)bx, (unsigned)by, 1}
#define LAUNCH(call) emu_launch(G, B, [&] { call; })
extern "C" {
void e_v1_scores(int gx, int gy, int gz, int bx, int by, const float* Q, const float* K, float* S,
                 int Nq, int Nk, int D, float scale, int causal) {
    LAUNCH(attention_v1_scores(Q, K, S, Nq, Nk, D, scale, causal)); }
void e_v1_softmax(int gx, int gy, int gz, int bx, int by, float* S, float* lse, int rows, int Nk) {
    LAUNCH(attention_v1_softmax(S, lse, rows, Nk)); }
void e_v1_pv(int gx, int gy, int gz, int bx, int by, const float* P, const float* V, float* O,
             int Nq, int Nk, int D) {
    LAUNCH(attention_v1_pv(P, V, O, Nq, Nk, D)); }
#define FWD(NAME, T)                                                                           \
void e_##NAME(int gx, int gy, int gz, int bx, int by, const void* Q, const void* K,            \
              const void* V, void* O, float* lse, int Nq, int Nk, float sl2, int causal) {     \
    LAUNCH(NAME((const T*)Q, (const T*)K, (const T*)V, (T*)O, lse, Nq, Nk, sl2, causal)); }
FWD(attention_v2_d64, float) FWD(attention_v2_d128, float)
FWD(attention_v3_f16_d64, __half) FWD(attention_v3_bf16_d64, __nv_bfloat16)
FWD(attention_v3_f16_d128, __half) FWD(attention_v3_bf16_d128, __nv_bfloat16)
void e_attention_bwd_v1_preprocess(int gx, int gy, int gz, int bx, int by, const float* O,
                                   const float* dO, float* Di, int rows, int D) {
    LAUNCH(attention_bwd_v1_preprocess(O, dO, Di, rows, D)); }
#define BWD1(D)                                                                                \
void e_attention_bwd_v1_dkdv_d##D(int gx, int gy, int gz, int bx, int by, const float* Q,      \
        const float* K, const float* V, const float* dO, const float* lse, const float* Di,    \
        float* dK, float* dV, int Nq, int Nk, float scale, int causal) {                       \
    LAUNCH(attention_bwd_v1_dkdv_d##D(Q, K, V, dO, lse, Di, dK, dV, Nq, Nk, scale, causal)); } \
void e_attention_bwd_v1_dq_d##D(int gx, int gy, int gz, int bx, int by, const float* Q,        \
        const float* K, const float* V, const float* dO, const float* lse, const float* Di,    \
        float* dQ, int Nq, int Nk, float scale, int causal) {                                  \
    LAUNCH(attention_bwd_v1_dq_d##D(Q, K, V, dO, lse, Di, dQ, Nq, Nk, scale, causal)); }
BWD1(64) BWD1(128)
#define BWD2T(TN, T)                                                                           \
void e_attention_bwd_v2_preprocess_##TN(int gx, int gy, int gz, int bx, int by, const void* O, \
        const void* dO, float* Di, float* dQacc, int rows, int D) {                            \
    LAUNCH(attention_bwd_v2_preprocess_##TN((const T*)O, (const T*)dO, Di, dQacc, rows, D)); } \
void e_attention_bwd_v2_convert_##TN(int gx, int gy, int gz, int bx, int by,                   \
        const float* acc, void* dQ, size_t n, float scale) {                                   \
    LAUNCH(attention_bwd_v2_convert_##TN(acc, (T*)dQ, n, scale)); }
BWD2T(f16, __half) BWD2T(bf16, __nv_bfloat16)
#define BWD2(NAME, T)                                                                          \
void e_##NAME(int gx, int gy, int gz, int bx, int by, const void* Q, const void* K,            \
        const void* V, const void* dO, const float* lse, const float* Di, float* dQacc,        \
        void* dK, void* dV, int Nq, int Nk, float scale, int causal) {                         \
    LAUNCH(NAME((const T*)Q, (const T*)K, (const T*)V, (const T*)dO, lse, Di, dQacc, (T*)dK,   \
                (T*)dV, Nq, Nk, scale, causal)); }
BWD2(attention_bwd_v2_f16_d64, __half) BWD2(attention_bwd_v2_bf16_d64, __nv_bfloat16)
BWD2(attention_bwd_v2_f16_d128, __half) BWD2(attention_bwd_v2_bf16_d128, __nv_bfloat16)
}
'''


def build() -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp(prefix="ch09emu"))
    kd = ROOT / "kernels"
    (tmp / "common.cuh").write_text((kd / "common.cuh").read_text())
    (tmp / "mma.cuh").write_text("#pragma once\n")         # ch09_emu.h provides its functions
    (tmp / "attention.cuh").write_text((kd / "attention.cuh").read_text())
    dyn = re.compile(r"extern __shared__ __align__\(\d+\) unsigned char attn_smem\[\];")
    for f in ("attention_forward.cu", "attention_backward.cu"):
        src = (kd / f).read_text()
        src = dyn.sub("unsigned char* attn_smem = emu_dyn_smem;", src)
        (tmp / f).write_text(src)
    (tmp / "shims.cpp").write_text(SHIMS)
    so = tmp / "emu.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{tmp}",
           f"-I{ROOT / 'tools' / 'dev'}", "-w", str(tmp / "shims.cpp"), "-o", str(so)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(so))


LIB: ctypes.CDLL | None = None


def p(a: np.ndarray):
    return ctypes.c_void_p(a.ctypes.data)


def launch(name: str, cfg: dict, *args) -> None:
    g = tuple(cfg["grid"]) + (1,) * (3 - len(cfg["grid"]))
    b = tuple(cfg["block"]) + (1,) * (2 - len(cfg["block"]))
    conv = []
    for a in args:
        if isinstance(a, np.ndarray):
            conv.append(p(a))
        elif isinstance(a, float):
            conv.append(ctypes.c_float(a))
        elif isinstance(a, np.uint64):
            conv.append(ctypes.c_size_t(int(a)))
        else:
            conv.append(ctypes.c_int(int(a)))
    getattr(LIB, f"e_{name}")(*[ctypes.c_int(v) for v in (*g, *b[:2])], *conv)


def to16(x: np.ndarray, dt: str) -> np.ndarray:
    t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16 if dt == "bf16" else torch.float16)
    return t.view(torch.int16).numpy().copy()


def from16(a: np.ndarray, dt: str) -> np.ndarray:
    t = torch.from_numpy(a).view(torch.bfloat16 if dt == "bf16" else torch.float16)
    return t.float().numpy().astype(np.float64)


def reference(q, k, v, do, causal):
    """O, lse, dQ, dK, dV in float64 through torch autograd (inputs as given, upcast)."""
    Q, K, V = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    S = Q @ K.transpose(-1, -2) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        S = S.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(S, -1)
    O = torch.softmax(S, -1) @ V
    O.backward(torch.from_numpy(do.astype(np.float64)))
    return (O.detach().numpy(), lse.detach().numpy(), Q.grad.numpy(), K.grad.numpy(),
            V.grad.numpy())


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.isnan(a).any():
        return math.inf
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_case(BH, Nq, Nk, D, causal, versions, rng) -> list[str]:
    fails = []
    q, k, v, do = (rng.standard_normal((BH, n, D)).astype(np.float32)
                   for n in (Nq, Nk, Nk, Nq))
    q *= 2.0                                    # sharper softmax: masks and maxima matter more
    O, lse, dQ, dK, dV = reference(q, k, v, do, causal)
    scale = 1 / math.sqrt(D)
    tag = f"BH={BH} Nq={Nq} Nk={Nk} D={D} causal={int(causal)}"

    def report(name, errs, tol):
        bad = {k_: e for k_, e in errs.items() if not e <= tol}
        line = f"{'FAIL' if bad else 'ok  '} {name:26s} {tag}  " + " ".join(
            f"{k_}={e:.1e}" for k_, e in errs.items())
        print(line, flush=True)
        if bad:
            fails.append(line)

    if "v1" in versions:
        S = np.full((BH, Nq, Nk), np.nan, np.float32)
        lo = np.full((BH, Nq), np.nan, np.float32)
        o = np.full((BH, Nq, D), np.nan, np.float32)
        c = at.fwd_config("v1", BH, Nq, Nk, D)
        launch("v1_scores", c["scores"], q, k, S, Nq, Nk, D, scale, int(causal))
        launch("v1_softmax", c["softmax"], S, lo, BH * Nq, Nk)
        launch("v1_pv", c["pv"], S, v, o, Nq, Nk, D)
        report("attention_v1", {"O": rel(o, O), "lse": rel(lo, lse)}, 1e-5)
    if "v2" in versions and D in (64, 128):
        c = at.fwd_config("v2", BH, Nq, Nk, D)
        lo = np.full((BH, Nq), np.nan, np.float32)
        o = np.full((BH, Nq, D), np.nan, np.float32)
        launch(c["kernel"], c, q, k, v, o, lo, Nq, Nk, scale * at.LOG2E, int(causal))
        report(c["kernel"], {"O": rel(o, O), "lse": rel(lo, lse)}, 1e-5)
    if "bwd1" in versions and D in (64, 128):
        c = at.bwd_config("v1", BH, Nq, Nk, D)
        o32 = O.astype(np.float32)
        l32 = lse.astype(np.float32)
        Di = np.full((BH, Nq), np.nan, np.float32)
        dq, dk, dv = (np.full(x.shape, np.nan, np.float32) for x in (q, k, v))
        launch("attention_bwd_v1_preprocess", c["preprocess"], o32, do, Di, BH * Nq, D)
        launch(c["dkdv"]["kernel"], c["dkdv"], q, k, v, do, l32, Di, dk, dv, Nq, Nk, scale,
               int(causal))
        launch(c["dq"]["kernel"], c["dq"], q, k, v, do, l32, Di, dq, Nq, Nk, scale, int(causal))
        report("attention_bwd_v1", {"dQ": rel(dq, dQ), "dK": rel(dk, dK), "dV": rel(dv, dV)},
               1e-5)
    for dt in ("bf16", "f16"):
        if f"v3_{dt}" not in versions:
            continue
        q16, k16, v16, do16 = (to16(x, dt) for x in (q, k, v, do))
        q_, k_, v_, do_ = (from16(x, dt) for x in (q16, k16, v16, do16))
        O_, lse_, dQ_, dK_, dV_ = reference(q_, k_, v_, do_, causal)  # same rounded inputs
        c = at.fwd_config("v3", BH, Nq, Nk, D, dt)
        o16 = np.full((BH, Nq, D), -1, np.int16)
        lo = np.full((BH, Nq), np.nan, np.float32)
        launch(c["kernel"], c, q16, k16, v16, o16, lo, Nq, Nk, scale * at.LOG2E, int(causal))
        tol = 1e-2 if dt == "bf16" else 2e-3
        report(c["kernel"], {"O": rel(from16(o16, dt), O_), "lse": rel(lo, lse_)}, tol)
        # backward v2 from the reference O and lse (rounded as the forward would store O)
        c = at.bwd_config("v2", BH, Nq, Nk, D, dt)
        o16r = to16(O_.astype(np.float32), dt)
        l32 = lse_.astype(np.float32)
        Di = np.full((BH, Nq), np.nan, np.float32)
        acc = np.full((BH, Nq, D), np.nan, np.float32)
        dq16, dk16, dv16 = (np.full(x.shape, -1, np.int16) for x in (q, k, v))
        launch(f"attention_bwd_v2_preprocess_{dt}", c["preprocess"], o16r, do16, Di, acc,
               BH * Nq, D)
        launch(c["main"]["kernel"], c["main"], q16, k16, v16, do16, l32, Di, acc, dk16, dv16,
               Nq, Nk, scale, int(causal))
        launch(f"attention_bwd_v2_convert_{dt}", c["convert"], acc, dq16,
               np.uint64(BH * Nq * D), scale)
        report(c["main"]["kernel"], {"dQ": rel(from16(dq16, dt), dQ_),
                                     "dK": rel(from16(dk16, dt), dK_),
                                     "dV": rel(from16(dv16, dt), dV_)}, 2 * tol)
    return fails


def main() -> int:
    global LIB
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--only", default="v1,v2,bwd1,v3_bf16,v3_f16")
    a = ap.parse_args()
    LIB = build()
    rng = np.random.default_rng(0)
    versions = set(a.only.split(","))
    cases = [(2, 17, 17, 64, False), (1, 130, 130, 64, True), (1, 70, 150, 128, False),
             (1, 150, 150, 128, True)]
    if a.full:
        cases += [(2, 1, 1, 64, False), (1, 1, 5, 128, True), (1, 200, 200, 64, True),
                  (1, 200, 77, 128, False), (3, 65, 65, 128, True)]
    fails = []
    for c in cases:
        fails += run_case(*c, versions=versions, rng=rng)
    print(f"\n{len(fails)} failures")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
