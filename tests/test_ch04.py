"""Chapter 4: the matmul kernels (Numba in the simulator, CuPy on a GPU), the launch
description, and the graders ex04_1..ex04_4 (reference passes, stub fails, plausible wrong
answers fail with the expected hint)."""
# ruff: noqa: I001  (cudabook must be imported before numba.cuda)

import numpy as np
import pytest

import cudabook as cb  # first: decides GPU or simulator mode
from cudabook import env
from cudabook.graders import GradeError, ex04_1, ex04_2, ex04_3, ex04_4
from numba import cuda, float32

mm = cb.load_numba("matmul")
gpu = pytest.mark.gpu


# ============================================================================ kernels, launcher

@pytest.mark.parametrize("shape", [(1, 1, 1), (33, 17, 9), (17, 130, 20), (130, 5, 3)])
@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v5", "v6"])
def test_numba_kernels(version, shape):
    M, N, K = shape
    if env.SIM and version == "v3" and M * N > 1000:
        pytest.skip("slow in the simulator; covered by the other shapes")
    rng = np.random.default_rng(7)
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = cb.empty_nan((M, N))
    if not env.SIM:
        A, B, C = (cuda.to_device(x) for x in (A, B, C))
    mm.launch_numba(version, A, B, C)
    cb.check(C, A.astype(np.float64) @ B if env.SIM else
             cb.to_numpy(A).astype(np.float64) @ cb.to_numpy(B), **mm.tolerance(K))


def test_check_operands_errors():
    A = np.zeros((4, 5), np.float32)
    B = np.zeros((5, 6), np.float32)
    C = np.zeros((4, 6), np.float32)
    assert mm.check_operands(A, B, C) == (4, 6, 5)
    with pytest.raises(ValueError, match="inner dimensions"):
        mm.check_operands(A, np.zeros((4, 6), np.float32), C)
    with pytest.raises(TypeError, match="float32 only"):
        mm.check_operands(A.astype(np.float64), B, C)
    with pytest.raises(ValueError, match="C-contiguous"):
        mm.check_operands(A, np.zeros((6, 5), np.float32).T, C)
    with pytest.raises(ValueError, match="C must be 4x6"):
        mm.check_operands(A, B, np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match="2D"):
        mm.check_operands(A.ravel(), B, C)


def test_config_and_params():
    assert mm.config("v1", 100, 33, 7)["grid"] == (4, 2)
    assert mm.config("v2", 100, 33, 7)["grid"] == (2, 4)
    c = mm.config("v9", 1023, 1025, 517)
    assert c["grid"] == (9, 8) and c["block"] == (256,) and c["shared"] == 2 * 16 * 260 * 4
    c = mm.config("v10", 1000, 1000, 10, dict(BM=64, BN=128, WM=32, WN=64, TM=8, TN=8))
    assert c["grid"] == (8, 16) and c["block"] == (128,)
    with pytest.raises(ValueError, match="32 lanes"):
        mm.tuned_params(dict(TM=8))
    with pytest.raises(ValueError, match="divide"):
        mm.tuned_params(dict(BM=192))
    with pytest.raises(ValueError, match="unknown tile"):
        mm.tuned_params(dict(BX=1))
    with pytest.raises(ValueError, match="STAGES"):
        mm.tuned_params(dict(STAGES=3, ASYNC=0))
    with pytest.raises(ValueError, match="unknown version"):
        mm.config("v11", 1, 1, 1)
    assert "-DMM_BK=8" in mm.tuned_options() and "-DMM_ONLY_TUNED" in mm.tuned_options(
        only_tuned=True)


def test_tuned_defaults_match_the_cu_file():
    """matmul_v10 compiled without -D options must be launched with the same tile sizes."""
    import re

    src = cb.kernel_source("matmul.cu")
    found = {k: int(v) for k, v in re.findall(r"#ifndef MM_(\w+)\n#define MM_\1 (\d+)", src)}
    assert found == mm.TUNED_DEFAULT


@gpu
def test_cupy_versions_ragged():
    import cupy

    mod = cb.load_cuda("matmul")
    rng = np.random.default_rng(3)
    for M, N, K in [(1, 1, 1), (1023, 1025, 517), (4096, 16, 64), (16, 4096, 300),
                    (130, 4, 1000)]:
        A = cupy.asarray(rng.standard_normal((M, K), dtype=np.float32))
        B = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32))
        ref = A.astype(cupy.float64) @ B.astype(cupy.float64)
        for v in mm.VERSIONS:
            C = cb.empty_nan((M, N), np.float32, xp=cupy)
            mm.launch_cupy(mod, v, A, B, C)
            cb.check(C, ref, name=f"{v} {M}x{N}x{K}", **mm.tolerance(K))


@gpu
def test_cupy_tuned_variant():
    import cupy

    mod = mm.load_tuned(dict(BM=64, BN=128, BK=16, WM=32, WN=64, TM=8, TN=8, MINB=4, STAGES=3,
                              ASYNC=1))
    A = cupy.random.standard_normal((300, 200), dtype=cupy.float32)
    B = cupy.random.standard_normal((200, 77), dtype=cupy.float32)
    C = cb.empty_nan((300, 77), np.float32, xp=cupy)
    mm.launch_cupy(mod, "v10", A, B, C)
    cb.check(C, A.astype(cupy.float64) @ B.astype(cupy.float64), **mm.tolerance(200))


# ============================================================================ ex04_1 (Numba)

T = 16
TP = T + 1          # padded row (a literal for Numba's shared.array)


@cuda.jit
def abt_ref(A, Bt, C):
    As = cuda.shared.array((T, T), float32)
    Bs = cuda.shared.array((T, TP), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = Bt.shape[0]
    row = cuda.blockIdx.y * T + ty
    col = cuda.blockIdx.x * T + tx
    n0 = cuda.blockIdx.x * T
    acc = float32(0.0)
    for k0 in range(0, K, T):
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else float32(0.0)
        cuda.syncthreads()
        for k in range(T):
            acc += As[ty, k] * Bs[tx, k]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def abt_stub(A, Bt, C):
    raise NotImplementedError("ex04.1")


@cuda.jit
def abt_nosync(A, Bt, C):
    As = cuda.shared.array((T, T), float32)
    Bs = cuda.shared.array((T, TP), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = Bt.shape[0]
    row = cuda.blockIdx.y * T + ty
    col = cuda.blockIdx.x * T + tx
    n0 = cuda.blockIdx.x * T
    acc = float32(0.0)
    for k0 in range(0, K, T):
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else float32(0.0)
        for k in range(T):
            acc += As[ty, k] * Bs[tx, k]
    if row < M and col < N:
        C[row, col] = acc


@cuda.jit
def abt_noguard_store(A, Bt, C):
    As = cuda.shared.array((T, T), float32)
    Bs = cuda.shared.array((T, TP), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = Bt.shape[0]
    row = cuda.blockIdx.y * T + ty
    col = cuda.blockIdx.x * T + tx
    n0 = cuda.blockIdx.x * T
    acc = float32(0.0)
    for k0 in range(0, K, T):
        As[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else float32(0.0)
        cuda.syncthreads()
        for k in range(T):
            acc += As[ty, k] * Bs[tx, k]
        cuda.syncthreads()
    C[row, col] = acc


@cuda.jit
def abt_early_return(A, Bt, C):
    As = cuda.shared.array((T, T), float32)
    Bs = cuda.shared.array((T, TP), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = Bt.shape[0]
    row = cuda.blockIdx.y * T + ty
    col = cuda.blockIdx.x * T + tx
    n0 = cuda.blockIdx.x * T
    if row >= M or col >= N:      # these threads no longer help load the tiles
        return
    acc = float32(0.0)
    for k0 in range(0, K, T):
        As[ty, tx] = A[row, k0 + tx] if k0 + tx < K else float32(0.0)
        Bs[ty, tx] = Bt[n0 + ty, k0 + tx] if n0 + ty < N and k0 + tx < K else float32(0.0)
        cuda.syncthreads()
        for k in range(T):
            acc += As[ty, k] * Bs[tx, k]
        cuda.syncthreads()
    C[row, col] = acc


@cuda.jit
def abt_no_kzero(A, Bt, C):
    # the last partial k-tile keeps what the previous tile left in shared memory
    As = cuda.shared.array((T, T), float32)
    Bs = cuda.shared.array((T, TP), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    M, K = A.shape
    N = Bt.shape[0]
    row = cuda.blockIdx.y * T + ty
    col = cuda.blockIdx.x * T + tx
    n0 = cuda.blockIdx.x * T
    acc = float32(0.0)
    for k0 in range(0, K, T):
        if row < M and k0 + tx < K:
            As[ty, tx] = A[row, k0 + tx]
        if n0 + ty < N and k0 + tx < K:
            Bs[ty, tx] = Bt[n0 + ty, k0 + tx]
        cuda.syncthreads()
        for k in range(T):
            acc += As[ty, k] * Bs[tx, k]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


def test_ex04_1_reference(capsys):
    ex04_1(abt_ref)
    assert capsys.readouterr().out.strip() == "PASS ex04.1"


@pytest.mark.parametrize("kernel, hint", [
    (abt_stub, "not implemented"),
    (abt_nosync, "syncthreads"),
    (abt_noguard_store, "bounds guard"),
    (abt_early_return, "zero-fill|wrong at|edge tiles"),
    (abt_no_kzero, "zero-fill|wrong at"),
])
def test_ex04_1_wrong(kernel, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_1(kernel)


# ============================================================================ ex04_3 (Numba)

RB, RK, RT = 32, 8, 4


@cuda.jit
def ragged_ref(A, B, C):
    As = cuda.shared.array((RB, RK), float32)
    Bs = cuda.shared.array((RK, RB), float32)
    acc = cuda.local.array((RT, RT), float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    tr, tc = tid // 8, tid % 8
    m0, n0 = cuda.blockIdx.y * RB, cuda.blockIdx.x * RB
    for i in range(RT):
        for j in range(RT):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, RK):
        for step in range(RB * RK // 64):
            idx = tid + step * 64
            ar, ac = idx // RK, idx % RK
            br, bc = idx // RB, idx % RB
            As[ar, ac] = A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else float32(0.0)
            Bs[br, bc] = B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else float32(0.0)
        cuda.syncthreads()
        for k in range(RK):
            for i in range(RT):
                for j in range(RT):
                    acc[i, j] += As[tr * RT + i, k] * Bs[k, tc * RT + j]
        cuda.syncthreads()
    for i in range(RT):
        for j in range(RT):
            r, c = m0 + tr * RT + i, n0 + tc * RT + j
            if r < M and c < N:
                C[r, c] = acc[i, j]


@cuda.jit
def ragged_unguarded(A, B, C):
    # correct only when M, N are multiples of 32 and K of 8: the simulator's bounds check
    # raises IndexError at the first ragged shape
    As = cuda.shared.array((RB, RK), float32)
    Bs = cuda.shared.array((RK, RB), float32)
    acc = cuda.local.array((RT, RT), float32)
    K = A.shape[1]
    tid = cuda.threadIdx.x
    tr, tc = tid // 8, tid % 8
    m0, n0 = cuda.blockIdx.y * RB, cuda.blockIdx.x * RB
    for i in range(RT):
        for j in range(RT):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, RK):
        for step in range(RB * RK // 64):
            idx = tid + step * 64
            As[idx // RK, idx % RK] = A[m0 + idx // RK, k0 + idx % RK]
            Bs[idx // RB, idx % RB] = B[k0 + idx // RB, n0 + idx % RB]
        cuda.syncthreads()
        for k in range(RK):
            for i in range(RT):
                for j in range(RT):
                    acc[i, j] += As[tr * RT + i, k] * Bs[k, tc * RT + j]
        cuda.syncthreads()
    for i in range(RT):
        for j in range(RT):
            C[m0 + tr * RT + i, n0 + tc * RT + j] = acc[i, j]


@cuda.jit
def ragged_whole_tiles(A, B, C):
    # guards that skip every partial tile: safe, but the edges of C stay unwritten
    As = cuda.shared.array((RB, RK), float32)
    Bs = cuda.shared.array((RK, RB), float32)
    acc = cuda.local.array((RT, RT), float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    tr, tc = tid // 8, tid % 8
    m0, n0 = cuda.blockIdx.y * RB, cuda.blockIdx.x * RB
    for i in range(RT):
        for j in range(RT):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, RK):
        for step in range(RB * RK // 64):
            idx = tid + step * 64
            ar, ac = idx // RK, idx % RK
            br, bc = idx // RB, idx % RB
            As[ar, ac] = A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else float32(0.0)
            Bs[br, bc] = B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else float32(0.0)
        cuda.syncthreads()
        for k in range(RK):
            for i in range(RT):
                for j in range(RT):
                    acc[i, j] += As[tr * RT + i, k] * Bs[k, tc * RT + j]
        cuda.syncthreads()
    if m0 + RB <= M and n0 + RB <= N:
        for i in range(RT):
            for j in range(RT):
                C[m0 + tr * RT + i, n0 + tc * RT + j] = acc[i, j]


@cuda.jit
def ragged_partial_store(A, B, C):
    # stores only the first row of each thread's 4x4 block
    As = cuda.shared.array((RB, RK), float32)
    Bs = cuda.shared.array((RK, RB), float32)
    acc = cuda.local.array((RT, RT), float32)
    M, K = A.shape
    N = B.shape[1]
    tid = cuda.threadIdx.x
    tr, tc = tid // 8, tid % 8
    m0, n0 = cuda.blockIdx.y * RB, cuda.blockIdx.x * RB
    for i in range(RT):
        for j in range(RT):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, RK):
        for step in range(RB * RK // 64):
            idx = tid + step * 64
            ar, ac = idx // RK, idx % RK
            br, bc = idx // RB, idx % RB
            As[ar, ac] = A[m0 + ar, k0 + ac] if m0 + ar < M and k0 + ac < K else float32(0.0)
            Bs[br, bc] = B[k0 + br, n0 + bc] if k0 + br < K and n0 + bc < N else float32(0.0)
        cuda.syncthreads()
        for k in range(RK):
            for i in range(RT):
                for j in range(RT):
                    acc[i, j] += As[tr * RT + i, k] * Bs[k, tc * RT + j]
        cuda.syncthreads()
    for j in range(RT):
        r, c = m0 + tr * RT, n0 + tc * RT + j
        if r < M and c < N:
            C[r, c] = acc[0, j]


def test_ex04_3_reference(capsys):
    ex04_3(ragged_ref)
    assert capsys.readouterr().out.strip() == "PASS ex04.3"


@pytest.mark.parametrize("kernel, hint", [
    (ragged_unguarded, "M=1, N=1, K=1"),
    (ragged_whole_tiles, "edge tiles"),
    (ragged_partial_store, "only part of C"),
])
def test_ex04_3_wrong(kernel, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_3(kernel)


# ============================================================================ CUDA C (GPU)

REG2D = r'''
#define BM 64
#define BN 64
#define BK 8
#define TM 4
#define TN 4
extern "C" __global__ void __launch_bounds__(256)
matmul_reg2d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
             int M, int N, int K) {
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tr = tid / (BN / TN), tc = tid % (BN / TN);
    float acc[TM][TN] = {{0.f}};
    float ra[TM], rb[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int l = 0; l < BM * BK / 256; ++l) {
            int idx = tid + l * 256;
            int r = idx / BK, c = idx % BK;
            As[r][c] = (m0 + r < M && k0 + c < K) ? A[(m0 + r) * K + k0 + c] : 0.f;
            r = idx / BN; c = idx % BN;
            Bs[r][c] = (k0 + r < K && n0 + c < N) ? B[(k0 + r) * N + n0 + c] : 0.f;
        }
        SYNC1
        for (int k = 0; k < BK; ++k) {
            for (int i = 0; i < TM; ++i) ra[i] = As[tr * TM + i][k];
            for (int j = 0; j < TN; ++j) rb[j] = Bs[k][tc * TN + j];
            for (int i = 0; i < TM; ++i)
                for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        SYNC2
    }
    for (int i = 0; i < ROWS; ++i)
        for (int j = 0; j < TN; ++j) {
            int r = m0 + tr * TM + i, c = n0 + tc * TN + j;
            if (GUARD) C[r * N + c] = acc[i][j];
        }
}
'''


def reg2d(sync1="__syncthreads();", sync2="__syncthreads();", rows="TM",
          guard="r < M && c < N"):
    return (REG2D.replace("SYNC1", sync1).replace("SYNC2", sync2).replace("ROWS", rows)
            .replace("GUARD", guard))


@gpu
def test_ex04_2_reference(capsys):
    ex04_2(reg2d())
    assert capsys.readouterr().out.strip() == "PASS ex04.2"


@gpu
@pytest.mark.parametrize("src, hint", [
    (reg2d(sync1=""), "syncthreads"),
    (reg2d(sync2=""), "syncthreads"),
    (reg2d(rows="1"), "only part of C"),
    (reg2d(guard="true"), "past the end|wrong at"),
    (reg2d(guard="r < M && c < N").replace("// ", "").replace(
        "for (int k = 0; k < BK; ++k) {", "for (int k = 0; k < BK; ++k) { break;"),
     "wrong at"),
])
def test_ex04_2_wrong(src, hint):
    with pytest.raises(GradeError, match=hint):
        ex04_2(src)


FAST = r'''
extern "C" __global__ void __launch_bounds__(256)
matmul_fast(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
            int M, int N, int K) {
    // float4 global loads, A transposed into a padded tile, 4x4 pieces 64 apart (v6 + v7)
    constexpr int BM = 128, BN = 128, BK = 8, PAD = 4;
    __shared__ __align__(16) float As[BK][BM + PAD];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const bool vecA = K % 4 == 0 && (reinterpret_cast<size_t>(A) & 15) == 0;
    const bool vecB = N % 4 == 0 && (reinterpret_cast<size_t>(B) & 15) == 0;
    const int ar = tid / 2, ac = (tid % 2) * 4, br = tid / 32, bc = (tid % 32) * 4;
    float acc[8][8] = {{0.f}};
    for (int k0 = 0; k0 < K; k0 += BK) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (m0 + ar < M) {
            const float* pa = A + (m0 + ar) * K + k0 + ac;
            if (vecA && k0 + ac + 3 < K) a = *reinterpret_cast<const float4*>(pa);
            else {
                if (k0 + ac < K) a.x = pa[0];
                if (k0 + ac + 1 < K) a.y = pa[1];
                if (k0 + ac + 2 < K) a.z = pa[2];
                if (k0 + ac + 3 < K) a.w = pa[3];
            }
        }
        if (k0 + br < K) {
            const float* pb = B + (k0 + br) * N + n0 + bc;
            if (vecB && n0 + bc + 3 < N) b = *reinterpret_cast<const float4*>(pb);
            else {
                if (n0 + bc < N) b.x = pb[0];
                if (n0 + bc + 1 < N) b.y = pb[1];
                if (n0 + bc + 2 < N) b.z = pb[2];
                if (n0 + bc + 3 < N) b.w = pb[3];
            }
        }
        As[ac][ar] = a.x; As[ac + 1][ar] = a.y; As[ac + 2][ar] = a.z; As[ac + 3][ar] = a.w;
        *reinterpret_cast<float4*>(&Bs[br][bc]) = b;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float4 a0 = *reinterpret_cast<const float4*>(&As[k][tr * 4]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[k][64 + tr * 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[k][tc * 4]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[k][64 + tc * 4]);
            float ra[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float rb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int r = m0 + (i / 4) * 64 + tr * 4 + i % 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            int c = n0 + (j / 4) * 64 + tc * 4 + j % 4;
            if (r < M && c < N) C[r * N + c] = acc[i][j];
        }
    }
}
'''

@gpu
def test_ex04_4_reference(capsys):
    ex04_4(FAST)
    assert capsys.readouterr().out.strip() == "PASS ex04.4"


@gpu
def test_ex04_4_wrong():
    stub = FAST.split("    float acc[8][8]")[0] + "}\n"
    with pytest.raises(GradeError, match="never written"):
        ex04_4(stub)
    with pytest.raises(GradeError, match="the goal is"):
        ex04_4(FAST, fraction=5.0)           # correct but (of course) not 5x cuBLAS


def test_cuda_graders_need_gpu():
    if env.HAS_GPU:
        pytest.skip("GPU present")
    for g in (ex04_2, ex04_4):
        with pytest.raises(GradeError, match="needs a CUDA GPU"):
            g("")
