"""Graders of Chapter 8, "Tensor cores: from WMMA to mma.sync to Hopper's wgmma".

ex08_1  CUDA C++: a WMMA tile kernel, C = A @ B^T, fp16 in, fp32 accumulate         GPU
        (its tensor-core and fp32-accumulator rubric is checked on the CPU: NVRTC's PTX)
ex08_2  Python: the fragment layout of mma.sync.m16n8k16 (lane, value -> element)    CPU
ex08_3  Python: a swizzle of 64-byte shared-memory rows (bijective, conflict-free)     CPU
        (also the lesson's 128-byte rows and 256-byte ones: ``row_bytes``)
ex08_4  CUDA C++: a peeled cp.async pipeline, STAGES a template parameter graded at    GPU, sm_80+
        2, 3 and 4 (the wait counts of each depth read from the PTX on the CPU), reaching
        FAST_FRACTION of cuBLAS fp16 at 3 stages
ex08_5  CUDA C++: one warpgroup's wgmma tile, C = A @ B^T from swizzled shared tiles     GPU, sm_90
        (its wgmma, fence, commit, wait and proxy-fence rubric is checked on the CPU: the
        sm_90a PTX NVRTC makes of it)

The CUDA C++ graders check ragged and tall-skinny shapes against the float64 product with the
error bound of fp32 accumulation (``hgemm_launch.tolerance``): a kernel that accumulates in fp16
fails it as soon as K is large, and is told so. They fill C with NaN followed by a NaN canary,
call twice with fresh data, and end with compute-sanitizer (racecheck, synccheck, initcheck) on
small ragged sizes (a missing barrier that happens to give the right numbers, a barrier some
threads skip, a shared element read before anyone wrote it).

Before anything runs (so on a CPU too) they read the answer's code, comments and strings
removed, and the PTX that NVRTC makes of it (which needs no GPU): ex08_1 must reach a
tensor-core instruction (a scalar loop gives the same numbers; a ``wmma::mma_sync`` in dead
code or under ``#if 0`` leaves none in the PTX) whose accumulator is fp32; ex08_4 must wait
with STAGES - 2, then STAGES - 3 ... 0 in its drain, at each depth (``cp.async.wait_group``).
"""

from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np

from .. import env
from ..check import to_numpy
from ..launch import ceil_div
from ._core import GradeError, canary_ok, fresh_rng, need_gpu, passed, sync
from ._race import racecheck
from ._static import calls, cuda_code, cuda_ptx, ptx_instructions

__all__ = ["ex08_1", "ex08_2", "ex08_3", "ex08_4", "ex08_5", "FAST_FRACTION", "FAST_N",
           "pipe_ratio", "with_mma_header", "SMEM_5", "STAGES_4", "TIMED_STAGES", "smem_4"]

#: ex08_4: the fraction of cuBLAS fp16 (same run, n = FAST_N) the pipelined kernel must reach.
#: It lies between the lesson's single-stage kernel (v4) and its 3-stage one (v5), so a working
#: pipeline passes and a single stage does not; their measured ratios are in the lesson's ladder,
#: reports/ch08_bench.json (tools/dev/ch08_bench.py) and reports/benchmarks.json, and the
#: reference solution's in the run of solutions/08_tensor_cores.ipynb.
FAST_FRACTION = 0.40
FAST_N = 4096
U16 = 2.0 ** -11          # unit roundoff of fp16
FP16_MAX = 65504.0        # the largest finite fp16


# ============================================================================ shared helpers

def with_mma_header(src: str) -> str:
    """``src`` with ``#include "mma.cuh"`` replaced by the header's text (NVRTC compiles a
    notebook string without the kernels/ include path)."""
    from ..source import kernel_source

    if '#include "mma.cuh"' not in src:
        return src
    return src.replace('#include "mma.cuh"', kernel_source("mma.cuh"), 1)


def _compile(ex: str, src: str, name: str):
    from ..compile import compile_source

    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    try:
        mod = compile_source(with_mma_header(src), name=f"{ex} source")
    except RuntimeError as e:
        raise GradeError(f"{ex}: does not compile:\n{e}") from None
    try:
        return mod.raw.get_function(name)
    except Exception:  # noqa: BLE001
        raise GradeError(f"{ex}: the source defines no kernel {name!r} (extern \"C\" "
                         "__global__ void ...)") from None


def _mats(rng, M: int, N: int, K: int, big: bool = False):
    """fp16 inputs and their float64 references. ``big``: entries in [12, 24], so that with
    K = 256 the elements of C lie beyond fp16's range (about 8.3e4 > FP16_MAX), and K is small
    enough that fp32 accumulation of all-positive terms stays well inside the bound."""
    if big:
        A = rng.uniform(12, 24, (M, K)).astype(np.float16)
        B = rng.uniform(12, 24, (N, K)).astype(np.float16)
    else:
        A = rng.standard_normal((M, K)).astype(np.float16)
        B = rng.standard_normal((N, K)).astype(np.float16)
    a64, b64 = A.astype(np.float64), B.astype(np.float64)
    return A, B, a64 @ b64.T, np.abs(a64) @ np.abs(b64).T


def _bound(ref, absprod, K: int, out: str, acc: str = "float32"):
    u = {"float32": 2.0 ** -24, "float16": U16}
    return u[out] * np.abs(ref) + 4.0 * math.sqrt(K) * 2 * u[acc] * absprod


def _diagnose(ex: str, case: str, out, ref, absprod, K: int, out_dtype: str, buf=None,
              tile: tuple[int, int] = (32, 32), hint_sync: str = "") -> None:
    """GradeError naming the likely mistake unless ``out`` is within the fp32-accumulation bound."""
    o = to_numpy(out).astype(np.float64)
    M, N = ref.shape
    if buf is not None and not canary_ok(buf, M * N):
        raise GradeError(f"{ex}: {case}: wrote past the end of C: missing store guard "
                         "(if (r < M && c < N))?")
    over = ~np.isfinite(o) & ~np.isnan(o) & (np.abs(ref) > FP16_MAX)
    if out_dtype == "float32" and over.any():
        i, j = (int(v[0]) for v in np.nonzero(over))
        raise GradeError(f"{ex}: {case}: C[{i}, {j}] is {o[i, j]:g}, expected {ref[i, j]:.6g}: "
                         f"beyond fp16's largest value ({FP16_MAX:g}), so the result went "
                         "through half on its way (an fp16 accumulator, or a conversion to half "
                         "before the store): keep it in float all the way to C")
    nan = np.isnan(o)
    if nan.all():
        raise GradeError(f"{ex}: {case}: C never written (all NaN): is the kernel still the "
                         "stub?")
    if nan.any():
        rows, cols = np.nonzero(nan)
        edge = M >= tile[0] and N >= tile[1] and \
            ((rows >= M // tile[0] * tile[0]) | (cols >= N // tile[1] * tile[1])).all()
        raise GradeError(f"{ex}: {case}: {rows.size} of {M * N} elements of C never written, "
                         f"first at ({rows[0]}, {cols[0]})" +
                         (": all in the edge tiles (a guard that drops partial tiles?)" if edge
                          else ": does every warp store its whole tile?"))
    if not np.abs(o).any() and np.abs(ref).any():
        raise GradeError(f"{ex}: {case}: C is all zeros: no product was accumulated (the main "
                         "loop is missing?)")
    err = np.abs(o - ref)
    bad = err > _bound(ref, absprod, K, out_dtype)
    if not bad.any():
        return
    i, j = (int(v[0]) for v in np.nonzero(bad))
    msg = (f"{ex}: {case}: {int(bad.sum())} of {M * N} elements outside the fp32-accumulation "
           f"bound, first at ({i}, {j}): got {o[i, j]:.6g}, expected {ref[i, j]:.6g}")
    half_bound = _bound(ref, absprod, K, out_dtype, acc="float16")
    # fp16 accumulation: most elements off, each by no more than an fp16 running sum allows
    # (a race or a missing tile leaves most elements right, or misses by far more)
    if bad.mean() > 0.1 and (err <= half_bound).all():
        raise GradeError(f"{msg}; the errors fit fp16 accumulation (they grow with K = {K}): "
                         "accumulate in fp32 (an accumulator fragment of float, the .f32 "
                         "accumulator of mma.sync) and round only the result")
    rows, cols = np.nonzero(bad)
    interior = M >= tile[0] and N >= tile[1]     # else every tile is an edge tile: no evidence
    if interior and ((rows >= M // tile[0] * tile[0]) | (cols >= N // tile[1] * tile[1])).all():
        raise GradeError(f"{msg}: errors only in the edge tiles (M={M}, N={N} are not multiples "
                         "of the tile): zero-fill the tile loads outside A and B?")
    raise GradeError(f"{msg}: wrong products{'; ' + hint_sync if hint_sync else ''}")


def _guarded(shape, dtype):
    import cupy

    from ._core import CANARY

    n = int(np.prod(shape))
    buf = cupy.full(n + CANARY, np.nan, dtype=dtype)
    return buf[:n].reshape(shape), buf


# ============================================================================ ex08_1: WMMA

#: (M, N, K, big): the first has entries in [12, 24], so C lies beyond fp16's range
_SHAPES_1 = [(40, 24, 256, True), (16, 16, 16, False), (32, 32, 16, False), (1, 1, 1, False),
             (33, 31, 17, False), (100, 70, 300, False), (4096, 24, 40, False),
             (20, 2000, 64, False), (256, 256, 4096, False)]
_HINT_1 = ("a __syncthreads() between filling the shared tiles and reading them, and another "
           "before they are overwritten?")
_HINT_K = ("right while K was a multiple of 16, wrong now: the last k-step's tile columns past K "
           "must hold zeros. Zero-fill the loads outside A and B (a load that is skipped leaves "
           "the previous step's values, or garbage, in the tile); if it is not that: " + _HINT_1)


def _launch_1(kern, A, B, C, M, N, K):
    kern((ceil_div(N, 32), ceil_div(M, 32)), (128,),
         (A, B, C, np.int32(M), np.int32(N), np.int32(K)))


def _mma_dtype(op: str) -> str:
    """The accumulator (D) type of a wmma.mma / mma.sync instruction: the first type after its
    shape (``wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32`` -> ``f32``)."""
    parts = op.split(".")
    at = next((i for i, p in enumerate(parts) if re.fullmatch(r"m\d+n\d+k\d+", p)), None)
    if at is None:
        return "?"
    rest = [p for p in parts[at + 1:] if p not in ("row", "col", "satfinite")]
    return rest[0] if rest else "?"


def _rubric_1(ex: str, src: str) -> None:
    """ex08.1's rubric from the source and its PTX (CPU): a tensor-core instruction that the
    compiler kept, an fp32 accumulator, barriers around the shared tiles."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = cuda_code(src)
    if not (calls(code, "mma_sync") or re.search(r'\basm\b[^;]*"[^"]*\bmma\.sync', code)):
        raise GradeError(f"{ex}: no tensor-core instruction in the code (no wmma::mma_sync): is "
                         "the kernel still the stub? A loop of scalar multiply-adds gives the "
                         "same numbers, but the exercise is the tensor-core kernel: fragments "
                         "loaded from the shared tiles with wmma::load_matrix_sync, multiplied "
                         "with wmma::mma_sync into an accumulator fragment")
    if calls(code, "__syncthreads") == 0:
        raise GradeError(f"{ex}: no __syncthreads() in the code: all 128 threads fill the shared "
                         "tiles and every warp reads them, so the block needs a barrier before "
                         "the tiles are read and another before they are overwritten")
    cc = env.cc() if env.HAS_GPU else (8, 0)      # on a CPU: the architecture most readers have
    ptx = cuda_ptx(ex, with_mma_header(src), f"compute_{cc[0]}{cc[1]}")
    if ptx is None:                  # no NVRTC here: the GPU run below compiles and checks
        return
    ops = [i.split()[0] for i in ptx_instructions(ex, ptx, "wmma_tile")]
    mma = [op for op in ops if op.startswith(("wmma.mma.", "mma.sync."))]
    if not mma:
        raise GradeError(f"{ex}: the compiled kernel has no tensor-core instruction (no "
                         "wmma.mma.sync or mma.sync in its PTX): the mma_sync of the source is "
                         "never reached (dead code, or under #if 0?), so something else computes "
                         "C; the exercise is the tensor-core kernel")
    half = [op for op in mma if _mma_dtype(op) == "f16"]
    if half:
        raise GradeError(f"{ex}: the compiled kernel accumulates in fp16 ({half[0]}: its "
                         "accumulator type is .f16): fp16 accumulation loses digits as K grows "
                         "and overflows past 65504; accumulate in fp32 (an accumulator fragment "
                         "of float, acc_t = float) and round only the result")


def ex08_1(src: str) -> None:
    """``src`` defines ``wmma_tile(const half* A, const half* B, float* C, int M, int N, int K)``:
    C = A @ B^T (A (M, K), B (N, K), fp16; C (M, N) fp32) with WMMA, fp32 accumulation. Block
    of 128 threads (4 warps, 2x2, each a 16x16 tile of C), grid (ceil(N/32), ceil(M/32)).
    First the rubric from the code and its PTX (on a CPU too: a tensor-core instruction the
    compiler kept, an fp32 accumulator, barriers); then on a GPU sums beyond fp16's range,
    ragged, tall-skinny and deep (K = 4096) shapes, each twice with fresh data; then racecheck.
    """
    ex = "ex08.1"
    _rubric_1(ex, src)
    need_gpu(ex)
    import cupy

    kern = _compile(ex, src, "wmma_tile")
    rng, seed = fresh_rng()
    whole_k = False                     # a case with K a multiple of 16 has passed
    for M, N, K, big in _SHAPES_1:
        for rep in range(2):
            A, B, ref, absprod = _mats(rng, M, N, K, big)
            C, buf = _guarded((M, N), np.float32)
            case = (f"M={M}, N={N}, K={K}{', entries in [12, 24]: C beyond fp16' if big else ''}"
                    f" (seed {seed}, call {rep + 1})")
            dA, dB = cupy.asarray(A), cupy.asarray(B)
            _call(ex, case, lambda: _launch_1(kern, dA, dB, C, M, N, K))
            _diagnose(ex, case, C, ref, absprod, K, "float32", buf,
                      hint_sync=_HINT_K if K % 16 and whole_k else _HINT_1)
            whole_k |= K % 16 == 0
    racecheck(ex, with_mma_header(src), "wmma_tile", "cudabook.graders.ch08:_race_ex08_1",
              hint=_HINT_1)
    passed(ex)


def _race_ex08_1(kern) -> None:
    """racecheck driver: two small ragged launches of ex08.1's kernel."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for M, N, K in [(33, 31, 40), (64, 64, 32)]:
        A = cupy.asarray(rng.standard_normal((M, K)).astype(np.float16))
        B = cupy.asarray(rng.standard_normal((N, K)).astype(np.float16))
        C = cupy.empty((M, N), cupy.float32)
        _launch_1(kern, A, B, C, M, N, K)


def _call(ex: str, case: str, fn: Callable[[], object]) -> None:
    try:
        fn()
        sync()
    except GradeError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        raise GradeError(f"{ex}: {case}: the launch failed: {type(e).__name__}: {msg}") from None


# ============================================================================ ex08_2: fragments

def _a_gt(g: int, t: int, i: int) -> tuple[int, int]:
    return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)


def _b_gt(g: int, t: int, i: int) -> tuple[int, int]:
    return 2 * t + i % 2 + 8 * (i // 2), g


def _c_gt(g: int, t: int, i: int) -> tuple[int, int]:
    return g + 8 * (i // 2), 2 * t + i % 2


def _a_swapped(g: int, t: int, i: int) -> tuple[int, int]:
    """A with registers 1 and 2 exchanged (k 8-15 before rows 8-15)."""
    return g + 8 * (i // 4), 2 * t + i % 2 + 8 * ((i // 2) % 2)


#: name -> (layout as a function of (g, t, i), values per lane, what, shape)
_FRAGS = {"a_frag": (_a_gt, 8, "A (16x16: row, k)", (16, 16)),
          "b_frag": (_b_gt, 4, "B (16x8: k, n)", (16, 8)),
          "c_frag": (_c_gt, 4, "C (16x8: row, col)", (16, 8))}


def _lanes(ls: list[int]) -> str:
    ls = sorted(ls)
    runs, start = [], ls[0]
    for a, b in zip(ls, ls[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)


def ex08_2(a_frag: Callable, b_frag: Callable, c_frag: Callable) -> None:
    """Three functions ``(lane, i) -> (row, col)``: the element of A, B or C that value ``i`` of
    lane ``lane`` holds in mma.sync.aligned.m16n8k16 (A: 8 values, 4 registers of two halves,
    the lower half first; B: 4 values; C: 4 floats). Graded on the CPU against the PTX ISA."""
    ex = "ex08.2"
    for name, fn in (("a_frag", a_frag), ("b_frag", b_frag), ("c_frag", c_frag)):
        lay, n, what, shape = _FRAGS[name]
        wrong, seen = {}, {}
        for lane in range(32):
            for i in range(n):
                got = _value(ex, name, fn, lane, i)
                seen.setdefault(got, []).append((lane, i))
                if got != lay(lane // 4, lane % 4, i):
                    wrong.setdefault(lane, []).append((i, got))
        if not wrong:
            continue
        lane0 = min(wrong)
        i, got = wrong[lane0][0]
        g, t = lane0 // 4, lane0 % 4
        where = (f"wrong for lanes {_lanes(list(wrong))} only" if len(wrong) < 32
                 else "wrong for every lane")
        msg = (f"{ex}: {name} of {what} is {where}: {name}({lane0}, {i}) = {got}, the "
               f"instruction puts {lay(g, t, i)} there")
        dup = [e for e, who in seen.items() if len(who) > 1]
        outside = [(ln, i_, got_) for ln, ws in wrong.items() for i_, got_ in ws
                   if not (0 <= got_[0] < shape[0] and 0 <= got_[1] < shape[1])]
        if all(got_ == lay(ln % 4, ln // 4, i_) for ln, ws in wrong.items() for i_, got_ in ws):
            msg += "; group and thread swapped? g = lane / 4 (the row), t = lane % 4"
        elif all(got_ == lay(ln // 4, ln % 4, i_)[::-1] for ln, ws in wrong.items()
                 for i_, got_ in ws):
            msg += (f"; the pair is swapped: {name} returns {what.split(': ')[1].rstrip(')')}, "
                    "in that order")
        elif outside:
            ln, i_, got_ = outside[0]
            msg += (f"; {name}({ln}, {i_}) = {got_} lies outside {what.split(' (')[0]}, which is "
                    f"{shape[0]}x{shape[1]}: each + 8 (the second block of 8 rows, or of k) "
                    "takes one bit of the register number i // 2, so no index passes 15")
        elif name == "a_frag" and all(got_ == _a_swapped(ln // 4, ln % 4, i_)
                                      for ln, ws in wrong.items() for i_, got_ in ws):
            msg += ("; the registers of A are ordered (rows g, k 0-7), (rows g+8, k 0-7), "
                    "(rows g, k 8-15), (rows g+8, k 8-15): register 1 holds row g+8")
        elif all(sorted(_value(ex, name, fn, ln, i_) for i_ in range(n))
                 == sorted(lay(ln // 4, ln % 4, i_) for i_ in range(n)) for ln in wrong):
            msg += ("; each lane names the right elements in the wrong order: value i is "
                    "register i // 2, half i % 2 (the lower half first), and the two halves of "
                    "a register are neighbours along k (A, B) or along a row (C)")
        elif dup:
            msg += (f"; {len(dup)} elements are claimed twice, e.g. {dup[0]} by (lane, value) "
                    f"{seen[dup[0]][0]} and {seen[dup[0]][1]}: each element lives in exactly "
                    "one place")
        raise GradeError(msg)
    passed(ex)


def _value(ex: str, name: str, fn: Callable, lane: int, i: int) -> tuple[int, int]:
    try:
        got = fn(lane, i)
    except NotImplementedError:
        raise GradeError(f"{ex}: {name} is not implemented yet (the stub still raises "
                         "NotImplementedError)") from None
    except Exception as e:  # noqa: BLE001
        raise GradeError(f"{ex}: {name}({lane}, {i}) raised {type(e).__name__}: {e}") from None
    try:
        return int(got[0]), int(got[1])
    except (TypeError, ValueError, IndexError):
        raise GradeError(f"{ex}: {name}({lane}, {i}) returned {got!r}; expected a (row, col) "
                         "pair of ints") from None


# ============================================================================ ex08_3: swizzle

def ex08_3(swizzle: Callable[[int, int], int], rows: int = 64, row_bytes: int = 64) -> None:
    """``swizzle(row, chunk)``: where 16-byte chunk ``chunk`` of row ``row`` of a tile with
    ``row_bytes``-byte rows (64, 128 or 256: 4, 8 or 16 chunks; the exercise's is 64) is stored
    in that row. Graded on the CPU: a bijection of each row's chunks, and conflict-free for
    ldmatrix (8 rows r0..r0+7, one logical chunk: 8 different 16-byte bank groups; the 16-byte
    stores of cp.async, 8 lanes over consecutive chunks, are then conflict-free too)."""
    ex = "ex08.3"
    if row_bytes not in (64, 128, 256):
        raise ValueError(f"ex08_3: row_bytes must be 64, 128 or 256, got {row_bytes!r}")
    if not isinstance(rows, int) or rows < 8 or rows % 8:
        raise ValueError(f"ex08_3: rows must be a positive multiple of 8, got {rows!r}")
    n = row_bytes // 16
    phys = np.zeros((rows, n), dtype=np.int64)
    for r in range(rows):
        for c in range(n):
            try:
                v = swizzle(r, c)
            except NotImplementedError:
                raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                                 "NotImplementedError)") from None
            except Exception as e:  # noqa: BLE001
                raise GradeError(f"{ex}: swizzle({r}, {c}) raised {type(e).__name__}: {e}") \
                    from None
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise GradeError(f"{ex}: swizzle({r}, {c}) returned {v!r}; expected an int "
                                 f"chunk index 0..{n - 1}")
            if not 0 <= int(v) < n:
                raise GradeError(f"{ex}: swizzle({r}, {c}) = {v} is outside the row (chunks "
                                 f"0..{n - 1}): the data would land in another row")
            phys[r, c] = int(v)
    for r in range(rows):
        if len(set(phys[r])) < n:
            vals, counts = np.unique(phys[r], return_counts=True)
            s = int(vals[counts > 1][0])
            cs = [int(c) for c in np.nonzero(phys[r] == s)[0]]
            raise GradeError(f"{ex}: not a bijection: in row {r}, chunks {cs} are stored at "
                             f"chunk {s}, so one overwrites the other (each row's {n} chunks "
                             f"must go to {n} different places)")
    # ldmatrix: lanes 8m..8m+7 read rows r0..r0+7 (r0 a multiple of 8) at one logical chunk;
    # 16-byte accesses, 8 per wavefront: conflict-free iff the 8 bank groups (addr / 16) % 8 differ
    why = ("a row is 128 bytes, all 32 banks, so only the chunk decides the bank: the 8 rows "
           "need 8 different chunks" if n == 8 else
           f"a row is {row_bytes} bytes, so chunk p of row r is in bank group ({n} r + p) % 8"
           + (": rows r and r + 1 share one 128-byte line of banks" if n == 4 else ""))
    for r0 in range(0, rows, 8):
        for c in range(n):
            groups = [(r * n + int(phys[r, c])) % 8 for r in range(r0, r0 + 8)]
            ways = max(groups.count(x) for x in groups)
            if ways > 1 and all((phys[r] == phys[r0]).all() for r in range(r0, r0 + 8)):
                raise GradeError(f"{ex}: {ways}-way bank conflict for ldmatrix: rows "
                                 f"{r0}..{r0 + 7} all store their chunks in the same order "
                                 f"{phys[r0].tolist()}, so chunk {c} of the 8 rows lands on "
                                 f"bank groups {groups}; the swizzle must change from row to "
                                 "row within a group of 8 (the low bits of the row), not only "
                                 "between groups")
            if ways > 1:
                raise GradeError(f"{ex}: {ways}-way bank conflict for ldmatrix: rows "
                                 f"{r0}..{r0 + 7} at chunk {c} land on bank groups {groups} "
                                 f"({why}); XOR the chunk with bits of the row?")
    passed(ex)


# ============================================================================ ex08_4: pipeline

_SHAPES_4 = [(128, 128, 64), (1, 1, 8), (127, 129, 72), (130, 70, 136), (1000, 777, 520),
             (4096, 24, 64), (16, 3000, 136), (300, 200, 1000)]
#: the pipeline depths ex08.4 is graded at: its kernels hgemm_pipe2, hgemm_pipe3, hgemm_pipe4
STAGES_4 = (2, 3, 4)
#: the depth timed against cuBLAS
TIMED_STAGES = 3
_HINT_4 = ("wait for a stage's copies with cp_async_wait<STAGES - 2>() (in the drain: one group "
           "fewer per step) and then __syncthreads() (other threads' copies, and the stage about "
           "to be overwritten) before reading it")


def smem_4(stages: int) -> int:
    """Dynamic shared memory of hgemm_pipe<stages>: the A and B tiles of every stage."""
    return stages * (128 + 128) * 64 * 2


def _launch_4(kern, A, B, C, M, N, K, stages: int = TIMED_STAGES):
    kern.max_dynamic_shared_size_bytes = smem_4(stages)
    kern((ceil_div(M, 128) * ceil_div(N, 128),), (256,),
         (A, B, C, np.int32(M), np.int32(N), np.int32(K)), shared_mem=smem_4(stages))


def _body(code: str, name: str) -> str:
    """The body of the function ``name`` in ``code`` (braces matched), or all of ``code`` where
    there is none."""
    m = re.search(rf"(?<!\w){name}\s*\([^;{{]*\)\s*{{", code)
    if not m:
        return code
    depth, i = 1, m.end()
    while i < len(code) and depth:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
    return code[m.end():i]


def _waits_4(ex: str, src: str) -> dict[int, list[int]] | None:
    """{stages: the cp.async.wait_group counts in hgemm_pipe<stages>'s PTX} (sm_80), or None
    where NVRTC is missing."""
    ptx = cuda_ptx(ex, with_mma_header(src), "compute_80")     # cp.async is real from sm_80
    if ptx is None:
        return None
    return {st: sorted({int(w.split()[1]) if len(w.split()) > 1 else 0
                        for w in ptx_instructions(ex, ptx, f"hgemm_pipe{st}")
                        if w.startswith(("cp.async.wait_group", "cp.async.wait_all"))})
            for st in STAGES_4}


def _rubric_4(ex: str, src: str) -> None:
    """ex08.4's rubric from the source and its PTX (CPU): a main loop, a wait written in terms
    of STAGES, barriers, and per depth the wait counts of a peeled pipeline: STAGES - 2 in the
    steady state, then STAGES - 3, ..., 0 in the drain."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = _body(cuda_code(src), "main_loop")
    if not re.search(r"(?<!\w)mma_stage\s*\(", code):
        raise GradeError(f"{ex}: the main loop is missing: main_loop never calls mma_stage (is "
                         "the kernel still the stub?)")
    if not re.search(r"(?<!\w)cp_async_wait(?:_upto)?\s*<", code):
        raise GradeError(f"{ex}: no cp_async_wait<...>() in main_loop: a thread must wait for "
                         "its copies of a stage before anyone reads it (" + _HINT_4 + ")")
    if calls(code, "__syncthreads") == 0:
        raise GradeError(f"{ex}: no __syncthreads() in main_loop: cp_async_wait covers only "
                         "this thread's copies, so the block must sync before reading a stage "
                         "other threads filled, and before refilling one others still read")
    literal = re.search(r"(?<!\w)cp_async_wait\s*<\s*(\d+)\s*>", code)
    if literal:
        one = (" Waiting for all copies (0) in every step is the one-stage loop: nothing is in "
               "flight while a tile is multiplied." if literal.group(1) == "0" else "")
        raise GradeError(f"{ex}: cp_async_wait<{literal.group(1)}>() waits with a number written "
                         f"in, which is right for one depth at most: the kernel is built for "
                         f"STAGES = 2, 3 and 4. Write the count in terms of STAGES "
                         f"(cp_async_wait<STAGES - 2>() in the steady state, "
                         f"cp_async_wait_upto<STAGES - 2>(n) in the drain).{one}")
    waits = _waits_4(ex, src)
    if waits is None:                # no NVRTC here: the GPU run below compiles and checks
        return
    for st, ws in waits.items():
        want = list(range(st - 1))
        if not ws:
            continue                 # no wait at all: the source check above named it
        if max(ws) > st - 2:
            raise GradeError(f"{ex}: at STAGES = {st} the kernel waits with cp.async.wait_group "
                             f"{max(ws)}: with STAGES - 1 = {st - 1} tiles in flight at the top "
                             f"of a step, tile kt has landed only when at most STAGES - 2 = "
                             f"{st - 2} groups are still pending; waiting for fewer reads a "
                             "tile whose copies may not have arrived")
        if ws != want:
            raise GradeError(f"{ex}: at STAGES = {st} the compiled kernel waits with the counts "
                             f"{ws}, a peeled pipeline with {want}: once the last tile's copies "
                             "are issued nothing new is committed, so each of the last "
                             "STAGES - 1 steps has one group fewer in flight. Peel those steps "
                             "off the loop into a drain that waits with "
                             "cp_async_wait_upto<STAGES - 2>(the tiles after kt), instead of "
                             "committing empty groups (or waiting for all of them)")


def ex08_4(src: str, fraction: float = FAST_FRACTION) -> None:
    """``src`` defines ``main_loop<STAGES>`` (the peeled cp.async pipeline) of the kernels
    ``hgemm_pipe2``, ``hgemm_pipe3`` and ``hgemm_pipe4`` (C = A @ B^T, fp16, 128x128x64 tiles,
    256 threads, 1D grid of tiles, dynamic shared memory smem_4(STAGES)). First the rubric from
    the source and its PTX (on a CPU too: the wait counts of each depth); then at each depth
    that fits this GPU's shared memory, ragged shapes twice with fresh data; the sanitizers;
    and at STAGES = TIMED_STAGES at least ``fraction`` of cuBLAS fp16 at FAST_N^3 in the same
    run. Needs sm_80+ (on older GPUs the grader says so and stops)."""
    ex = "ex08.4"
    _rubric_4(ex, src)
    need_gpu(ex)
    if env.cc() < (8, 0):
        print(f"skipped: {ex} needs compute capability 8.0+ (cp.async); this GPU is "
              f"{env.cc()[0]}.{env.cc()[1]}")
        return
    import cupy

    from ..bench import bench

    optin = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    depths = [st for st in STAGES_4 if smem_4(st) <= optin]
    kerns = {st: _compile(ex, src, f"hgemm_pipe{st}") for st in depths}
    rng, seed = fresh_rng()
    for st in depths:
        for M, N, K in _SHAPES_4:
            for rep in range(2):
                A, B, ref, absprod = _mats(rng, M, N, K)
                C, buf = _guarded((M, N), np.float16)
                case = f"STAGES={st}, M={M}, N={N}, K={K} (seed {seed}, call {rep + 1})"
                dA, dB = cupy.asarray(A), cupy.asarray(B)
                _call(ex, case, lambda: _launch_4(kerns[st], dA, dB, C, M, N, K, st))
                _diagnose(ex, case, C, ref, absprod, K, "float16", buf, tile=(128, 128),
                          hint_sync=_HINT_4)
    racecheck(ex, with_mma_header(src), ",".join(f"hgemm_pipe{st}" for st in depths),
              "cudabook.graders.ch08:_race_ex08_4", hint=_HINT_4)
    ratio, mine, base = _ratio(kerns[TIMED_STAGES], FAST_N, bench)
    if ratio < fraction:
        raise GradeError(f"{ex}: correct, but at {FAST_N}^3 with STAGES = {TIMED_STAGES} it "
                         f"reaches {mine:.0f} TFLOP/s = {100 * ratio:.0f}% of cuBLAS fp16 "
                         f"({base:.0f}); the goal is {100 * fraction:.0f}%. Are STAGES - 1 "
                         "tiles in flight while one is computed (one barrier per k-step, the "
                         "next copies issued right after it)?")
    passed(ex)


def _race_ex08_4(*kerns) -> None:
    """Sanitizer driver: small ragged launches of ex08.4's kernels, STAGES = 2, 3, ... in order
    (several k-steps, and a K shorter than the pipeline)."""
    import cupy

    rng = np.random.default_rng(0)      # data made on the host: no other kernel to instrument
    for st, kern in zip(STAGES_4, kerns):
        for M, N, K in [(130, 70, 200), (64, 200, 72)]:
            A = cupy.asarray(rng.standard_normal((M, K)).astype(np.float16))
            B = cupy.asarray(rng.standard_normal((N, K)).astype(np.float16))
            C = cupy.empty((M, N), cupy.float16)
            _launch_4(kern, A, B, C, M, N, K, st)


def _ratio(kern, n: int, bench, quiet: bool = True) -> tuple[float, float, float]:
    import cupy

    a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
    c, c0 = cupy.empty((n, n), cupy.float16), cupy.empty((n, n), cupy.float16)
    t = bench({"yours": lambda: _launch_4(kern, a, b, c, n, n, n)},
              baseline={"cuBLAS fp16": lambda: cupy.matmul(a, b.T, out=c0)},
              flops=2.0 * n ** 3, repeat=10, quiet=quiet)
    return t["yours"].ratio, t["yours"].value, t["cuBLAS fp16"].value


def pipe_ratio(src: str, n: int = FAST_N) -> float:
    """The ratio to cuBLAS fp16 that ex08_4 measures at STAGES = TIMED_STAGES (printed, for
    the notebook)."""
    from ..bench import bench

    kern = _compile("ex08.4", src, f"hgemm_pipe{TIMED_STAGES}")
    return _ratio(kern, n, bench, quiet=False)[0]


# ============================================================================ ex08_5: wgmma

#: (M, N, K, big): multiples of the 64 x 64 x 64 tile; several tiles of C, several k-steps
_SHAPES_5 = [(64, 64, 64, False), (64, 64, 64, True), (128, 64, 128, False),
             (64, 192, 64, False), (192, 128, 512, False), (64, 64, 2048, False)]
SMEM_5 = 2 * 64 * 64 * 2 + 1024          # two 8 KiB tiles, and slack to a 1024-byte boundary
_WGMMA_CALL = re.compile(r"(?<!\w)wgmma_m64n\d+k16_(?:f16|bf16)\s*\(")
_SYNC_5 = ("a __syncthreads() after fence_proxy_async() (every thread's stores are in the tiles "
           "before wgmma reads them) and one after wgmma_wait<0>() (before the next k-step "
           "overwrites them)")


def _launch_5(kern, A, B, C, M, N, K):
    kern((N // 64, M // 64), (128,), (A, B, C, np.int32(M), np.int32(N), np.int32(K)),
         shared_mem=SMEM_5)


def _rubric_5(ex: str, src: str) -> None:
    """ex08.5's rubric from the source and its sm_90a PTX (CPU): wgmma through mma.cuh, its
    fence, commit and wait, the proxy fence after ordinary stores, two barriers per k-step."""
    if not isinstance(src, str):
        raise GradeError(f"{ex}: expected the CUDA C++ source as a str, got {type(src).__name__}")
    code = cuda_code(src)
    if not _WGMMA_CALL.search(code):
        other = re.search(r"(?<!\w)(mma_m16n8k\d+_\w+|wmma::mma_sync|mma_sync)\s*\(|"
                          r"\bmma\.sync\b", code)
        if other:
            raise GradeError(f"{ex}: the answer multiplies with {other.group(0).rstrip('(')} "
                             "(a warp's mma.sync / WMMA): the exercise is Hopper's warpgroup "
                             "instruction, wgmma_m64n64k16_f16 of mma.cuh, whose operands come "
                             "from shared memory through two descriptors")
        raise GradeError(f"{ex}: no wgmma_m64n64k16_f16 call in the code: is the kernel still "
                         "the stub? A loop of scalar multiply-adds gives the same numbers, but "
                         "the exercise is one warpgroup's wgmma on the shared tiles")
    if calls(code, "__syncthreads") < 2:
        raise GradeError(f"{ex}: fewer than two __syncthreads() in the code: the 128 threads "
                         f"fill the tiles that the warpgroup's wgmma reads, so each k-step needs "
                         f"{_SYNC_5}")
    ptx = cuda_ptx(ex, with_mma_header(src), "compute_90a")
    if ptx is None:                  # no NVRTC here: the GPU run below compiles and checks
        return
    ops = [i.split()[0] for i in ptx_instructions(ex, ptx, "wgmma_tile")]
    if not any(op.startswith("wgmma.mma_async") for op in ops):
        raise GradeError(f"{ex}: the compiled kernel has no wgmma.mma_async: the call in the "
                         "source is never reached (dead code, or under #if 0?)")
    scalar = [op for op in ops if op.startswith(("mma.sync", "wmma.mma", "fma.rn.f32"))]
    if scalar:
        raise GradeError(f"{ex}: besides wgmma the kernel multiplies with {scalar[0]}: the "
                         "product must come from wgmma alone")
    waits = [int(w.split()[1]) for w in ptx_instructions(ex, ptx, "wgmma_tile")
             if w.startswith("wgmma.wait_group") and len(w.split()) > 1]
    missing = [(name, why) for name, op, why in [
        ("wgmma_fence()", "wgmma.fence", "before the first wgmma of a k-step: it orders the "
         "accumulator registers (written by other instructions, here the zeros) before the "
         "tensor cores use them"),
        ("wgmma_commit()", "wgmma.commit_group", "after the four wgmma: it closes them into a "
         "group that wgmma_wait can wait for (an uncommitted wgmma is waited for by nobody)"),
        ("wgmma_wait<0>()", "wgmma.wait_group", "after the commit: wgmma runs asynchronously, so "
         "the accumulators are not final, and the tiles still being read, until it returns"),
        ("fence_proxy_async()", "fence.proxy.async", "after the ordinary stores into the tiles "
         "and before the barrier: the stores go through the generic proxy, wgmma reads "
         "through the async proxy, and only this fence orders the two")]
        if not any(o.startswith(op) for o in ops)
        and not (op == "fence.proxy.async" and any(o.startswith("cp.async.bulk") for o in ops))]
    if missing:
        raise GradeError(f"{ex}: no {missing[0][0]} in the compiled kernel: it belongs "
                         f"{missing[0][1]}")
    if waits and min(waits) > 0:
        raise GradeError(f"{ex}: the kernel waits with wgmma_wait<{min(waits)}>(), which lets "
                         f"{min(waits)} group(s) still run: this kernel has one group per "
                         "k-step, and its tiles are overwritten (and its accumulators stored) "
                         "right after, so wait for all of them: wgmma_wait<0>()")


def _swizzle_off(X: np.ndarray) -> np.ndarray:
    """What wgmma reads when a tile of X was stored without the swizzle its descriptor promises:
    logical chunk c of row r comes from physical chunk c ^ (r % 8), in every 64-wide k-tile."""
    R, K = X.shape
    v = X.reshape(R, K // 64, 8, 8)
    r = np.arange(R)[:, None] % 8
    idx = np.arange(8)[None, :] ^ r                     # (R, 8): physical chunk per logical
    return np.take_along_axis(v, idx[:, None, :, None].repeat(K // 64, 1).repeat(8, 3),
                              axis=2).reshape(R, K)


def _wgmma_pattern(A64, B64, o: np.ndarray, absprod, K: int) -> str | None:
    """The hint of the wgmma mistake whose result ``o`` matches (within the fp32 bound)."""
    M, N = o.shape
    tiles = lambda X: X.reshape(M // 64, 64, N // 64, 64)       # noqa: E731
    cands = {
        "the tiles were stored without the 128-byte swizzle that wgmma_desc_sw128 promises: "
        "wgmma reads 16-byte chunk c of row r from chunk c ^ (r % 8) of that row, so store it "
        "there": _swizzle_off(A64) @ _swizzle_off(B64).T,
        "every k16 slice read the same 16 columns of the tiles: the descriptor's start moves 16 "
        "halves (32 bytes) along the rows per slice, wgmma_desc_sw128(As + 16 * kk)":
        4 * sum(A64[:, k:k + 16] @ B64[:, k:k + 16].T for k in range(0, K, 64)),
        "each 64 x 64 tile of C came out transposed: the first descriptor is A's (the 64 rows "
        "of M), the second B's (the columns of N)":
        tiles(A64 @ B64.T).transpose(0, 3, 2, 1).reshape(M, N) if M == N == 64 else None,
        "only the first 64 of the K columns were multiplied: the k-loop runs k0 = 0, 64, ... "
        "while k0 < K": A64[:, :64] @ B64[:, :64].T if K > 64 else None,
        "only the last 64 of the K columns count: are the accumulators zeroed inside the "
        "k-loop?": A64[:, -64:] @ B64[:, -64:].T if K > 64 else None,
    }
    bound = _bound(A64 @ B64.T, absprod, K, "float32")
    for hint, ref in cands.items():
        if ref is not None and (np.abs(o - ref) <= bound + 1e-3 * np.abs(ref)).all():
            return hint
    return None


def ex08_5(src: str) -> None:
    """``src`` defines ``wgmma_tile(const half* A, const half* B, float* C, int M, int N,
    int K)``: C = A @ B^T (A (M, K), B (N, K), fp16; C fp32), M, N, K multiples of 64, one
    warpgroup (128 threads) per 64 x 64 tile of C, grid (N / 64, M / 64), dynamic shared memory
    SMEM_5 (two 64 x 64 tiles in the 128-byte swizzle, wgmma_m64n64k16_f16 on them).
    First the rubric from the code and its sm_90a PTX (on a CPU too); then on a Hopper GPU the
    shapes of _SHAPES_5 twice each with fresh data (a wrong result that matches a known wgmma
    mistake is named: no swizzle, a descriptor that does not move along K, A and B swapped); then
    the sanitizers. On another GPU the grader says so and stops."""
    ex = "ex08.5"
    _rubric_5(ex, src)
    need_gpu(ex)
    if env.cc() != (9, 0):
        print(f"skipped: {ex} needs a Hopper GPU (compute capability 9.0: wgmma exists on "
              f"sm_90a only); this GPU is {env.cc()[0]}.{env.cc()[1]}")
        return
    import cupy

    from ..compile import arch_options, compile_source

    opts = arch_options(a_features=True)
    try:
        kern = compile_source(with_mma_header(src), opts, name=f"{ex} source").get("wgmma_tile")
    except (RuntimeError, AttributeError) as e:
        raise GradeError(f"{ex}: {e}") from None
    rng, seed = fresh_rng()
    passed_before = False
    for M, N, K, big in _SHAPES_5:
        for rep in range(2):
            A, B, ref, absprod = _mats(rng, M, N, K, big)
            C, buf = _guarded((M, N), np.float32)
            case = (f"M={M}, N={N}, K={K}{', entries in [12, 24]' if big else ''} (seed {seed}, "
                    f"call {rep + 1})")
            dA, dB = cupy.asarray(A), cupy.asarray(B)
            _call(ex, case, lambda: _launch_5(kern, dA, dB, C, M, N, K))
            o = to_numpy(C).astype(np.float64)
            if np.isfinite(o).all():
                hint = _wgmma_pattern(A.astype(np.float64), B.astype(np.float64), o, absprod, K)
                if hint and not np.allclose(o, ref, rtol=1e-3, atol=1e-2):
                    raise GradeError(f"{ex}: {case}: C is wrong in a pattern: {hint}")
            _diagnose(ex, case, C, ref, absprod, K, "float32", buf, tile=(64, 64),
                      hint_sync=("the same shapes passed before: a race? " + _SYNC_5
                                 if passed_before else
                                 "check the loads (row m0 + r, column k0 + 8 c), the swizzle "
                                 "(chunk c of row r at chunk c ^ (r % 8)) and the descriptors "
                                 "(one per k16 slice, 32 bytes apart)"))
            passed_before = True
    racecheck(ex, with_mma_header(src), "wgmma_tile", "cudabook.graders.ch08:_race_ex08_5",
              hint=_SYNC_5, options=opts)
    passed(ex)


def _race_ex08_5(kern) -> None:
    """Sanitizer driver: two launches of ex08.5's kernel, several tiles and k-steps."""
    import cupy

    rng = np.random.default_rng(0)
    for M, N, K in [(64, 128, 128), (128, 64, 64)]:
        A = cupy.asarray(rng.standard_normal((M, K)).astype(np.float16))
        B = cupy.asarray(rng.standard_normal((N, K)).astype(np.float16))
        C = cupy.empty((M, N), cupy.float32)
        _launch_5(kern, A, B, C, M, N, K)
