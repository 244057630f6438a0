#!/usr/bin/env python3
"""Run kernels/matmul.cu on the CPU: one std::thread per CUDA thread, std::barrier for
__syncthreads, blocks one after another. No GPU needed; checks indexing, edge handling and
barrier placement of every version on ragged shapes (the cp.async path is not emulated: on
the host __CUDA_ARCH__ is undefined, so v9/v10 take their register-staging path).

    python tools/dev/ch04_emulate.py                       # v1..v10 (v10 with its defaults)
    python tools/dev/ch04_emulate.py -D BM=128 -D BN=256 -D TN=16 -D WN=64 -D MINB=1
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

PRELUDE = r'''
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
using std::max; using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
std::barrier<>* g_bar;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
alignas(16) static float4 g_dyn[1 << 16];
'''

MAIN = r'''
using Kern = void (*)(const float*, const float*, float*, int, int, int);
static void launch(Kern k, dim3 grid, dim3 block, const float* A, const float* B, float* C,
                   int M, int N, int K) {
    gridDim = grid; blockDim = block;
    int nt = block.x * block.y * block.z;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> bar(nt);
            g_bar = &bar;
            std::vector<std::thread> ts;
            for (int t = 0; t < nt; ++t)
                ts.emplace_back([&, t] {
                    threadIdx = {unsigned(t) % block.x, (unsigned(t) / block.x) % block.y, 0};
                    blockIdx = {bx, by, 0};
                    k(A, B, C, M, N, K);
                });
            for (auto& th : ts) th.join();
        }
}
struct Case { const char* name; Kern k; dim3 grid, block; int M, N, K, offset; };
int main() {
    Case cases[] = { CASES };
    int bad = 0;
    std::mt19937 g(1);
    std::normal_distribution<float> d;
    for (auto& c : cases) {
        std::vector<float> a(c.M * c.K + 4), b(c.K * c.N), out(c.M * c.N + 4096, NAN);
        for (auto& x : a) x = d(g);
        for (auto& x : b) x = d(g);
        const float* A = a.data() + c.offset;
        launch(c.k, c.grid, c.block, A, b.data(), out.data(), c.M, c.N, c.K);
        int wrong = 0, first = -1;
        for (int i = 0; i < c.M; ++i)
            for (int j = 0; j < c.N; ++j) {
                double r = 0;
                for (int k = 0; k < c.K; ++k) r += double(A[i * c.K + k]) * b[k * c.N + j];
                double o = out[i * c.N + j];
                if (!(std::fabs(o - r) <= 1e-5 + 5e-7 * c.K + 1e-4 * std::fabs(r))) {
                    if (first < 0) first = i * c.N + j;
                    ++wrong;
                }
            }
        int canary = 0;
        for (int i = c.M * c.N; i < c.M * c.N + 4096; ++i) canary += !std::isnan(out[i]);
        bool ok = wrong == 0 && canary == 0;
        bad += !ok;
        std::printf("%-5s %5dx%5dx%5d%s: %s", c.name, c.M, c.N, c.K,
                    c.offset ? " (A misaligned)" : "", ok ? "ok" : "WRONG");
        if (!ok) std::printf(" (%d wrong, first at (%d, %d), %d canary writes)", wrong,
                             first < 0 ? -1 : first / c.N, first < 0 ? -1 : first % c.N, canary);
        std::printf("\n");
    }
    std::printf("%d failing cases\n", bad);
    return bad != 0;
}
'''

SHAPES = [(1, 1, 1), (33, 65, 9), (130, 4, 37), (5, 300, 20), (257, 129, 17), (260, 132, 16)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-D", action="append", default=[], help="tile parameter of v10, e.g. BM=128")
    ap.add_argument("--versions", default="")
    ap.add_argument("--source", help="another .cu file (an exercise answer) instead of matmul.cu")
    ap.add_argument("--kernel", help="its kernel name")
    ap.add_argument("--tile", default="128x128", help="its block tile of C, rows x cols")
    ap.add_argument("--threads", type=int, default=256)
    args = ap.parse_args()
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import cudabook as cb

    mm = cb.load_numba("matmul")
    params = {k: int(v) for k, v in (d.split("=") for d in args.D)}
    p = mm.tuned_params(params)
    only = bool(params)
    versions = args.versions.split(",") if args.versions else (["v10"] if only else
                                                               list(mm.VERSIONS))
    cases = []
    if args.source:
        bm, bn = (int(x) for x in args.tile.split("x"))
        for i, (M, N, K) in enumerate(SHAPES):
            off = 1 if i == len(SHAPES) - 1 else 0
            grid = f"{{{(N + bn - 1) // bn}, {(M + bm - 1) // bm}, 1}}"
            cases.append(f'{{"{args.kernel[:5]}", {args.kernel}, {grid}, '
                         f'{{{args.threads}, 1, 1}}, {M}, {N}, {K}, {off}}}')
        versions = []
    for v in versions:
        for i, (M, N, K) in enumerate(SHAPES):
            cfg = mm.config(v, M, N, K, p)
            gx, gy = cfg["grid"]
            blk = tuple(cfg["block"]) + (1,) * (3 - len(cfg["block"]))
            off = 1 if i == len(SHAPES) - 1 else 0       # last shape: A not 16-byte aligned
            cases.append(f'{{"{v}", matmul_{v}, {{{gx}, {gy}, 1}}, {{{blk[0]}, {blk[1]}, 1}}, '
                         f"{M}, {N}, {K}, {off}}}")
    src = open(args.source or os.path.join(ROOT, "kernels", "matmul.cu")).read()
    src = src.replace("extern __shared__ float4 smem4[];", "float4* smem4 = g_dyn;")
    src = re.sub(r'#include "common.cuh"', open(os.path.join(ROOT, "kernels", "common.cuh"))
                 .read().replace("#pragma once", ""), src)
    code = PRELUDE + src + MAIN.replace("CASES", ",\n".join(cases))
    d = tempfile.mkdtemp()
    cpp, exe = os.path.join(d, "mm.cpp"), os.path.join(d, "mm")
    open(cpp, "w").write(code)
    opts = [f"-DMM_{k}={v}" for k, v in p.items()] + (["-DMM_ONLY_TUNED"] if only else [])
    r = subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-w", *opts, cpp, "-o", exe],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-4000:])
        return 1
    print(f"v10 tile parameters: {mm.params_label(p)}")
    return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
