"""Chapter 3: the Numba kernels against numpy/torch (simulator or GPU), the launch helpers (GPU),
and the graders: the reference passes, stubs and plausible wrong answers fail with the hint that
names their mistake. References come from solutions/03_building_blocks.ipynb; wrong answers are
edits of them (tests/solution_cells.py)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32
from solution_cells import Solution, pencil_tests

import cudabook as cb
from cudabook import graders
from cudabook.graders import GradeError, ex03_1, ex03_2, ex03_3, ex03_4, ex03_5, ex03_6
from cudabook.reference import (
    conv1d_reference,
    conv2d_reference,
    gelu_erf_reference,
    gelu_tanh_reference,
    layernorm_reference,
    rmsnorm_reference,
    softmax_reference,
)

SOL = Solution("03")
gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------- Numba kernels
def _nan(shape):
    return np.full(shape, np.nan, np.float32)


def test_activation_kernels():
    nb = cb.load_numba("activation")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(300).astype(np.float32)
    y = _nan(300)
    nb.relu_v1[2, 256](x, y)
    cb.check(y, np.maximum(x, 0))
    nb.gelu_v1[2, 256](x, y)
    cb.check(y, gelu_tanh_reference(x))
    nb.gelu_v2[2, 256](x, y)
    cb.check(y, gelu_erf_reference(x))
    X = rng.standard_normal((5, 19)).astype(np.float32)
    b = rng.standard_normal(19).astype(np.float32)
    Y = _nan((5, 19))
    nb.bias_gelu_v1[(2, 1), (16, 16)](X, b, Y)
    cb.check(Y, gelu_tanh_reference(X.astype(np.float64) + b))
    nb.bias_add_v1[(2, 1), (16, 16)](X, b, Y)
    cb.check(Y, X.astype(np.float64) + b)


def test_reduce_kernels():
    nb = cb.load_numba("reduce")
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    ref = x.astype(np.float64).sum()
    for name in ("reduce_v1", "reduce_v2"):
        p = _nan(2)
        getattr(nb, name)[2, 256](x, p)
        assert abs(p.astype(np.float64).sum() - ref) < 1e-3, name
    p = _nan(1)
    nb.reduce_v3[1, 256](x, p)
    assert abs(p.astype(np.float64).sum() - ref) < 1e-3
    out = np.zeros(1, np.float32)
    nb.reduce_atomic_tree[2, 256](x, out)
    assert abs(out[0] - ref) < 1e-3
    out = np.full(1, -np.inf, np.float32)
    nb.reduce_max_atomic_tree[2, 256](x, out)
    assert out[0] == x.max()


def test_softmax_kernels():
    nb = cb.load_numba("softmax")
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((4, 150)) * 50).astype(np.float32)
    X[0, 3] = 3000.0
    X[1] = -np.inf
    X[2, :40] = -np.inf
    ref = softmax_reference(X)
    for name, cfg in (("softmax_v1", (1, 128)), ("softmax_v2", (4, 128)),
                      ("softmax_v4", (4, 128))):
        Y = _nan(X.shape)
        getattr(nb, name)[cfg](X, Y)
        cb.check(Y, ref, name=name)


def test_row_block_sizes():
    # the block of the register-resident row kernels: at most 16 floats per thread
    assert cb.row_block(1024) == 64 and cb.row_block(32768) == 1024
    assert cb.row_block(1) == 32 and cb.row_block(1001) == 64


def test_norm_kernels():
    nb = cb.load_numba("norm")
    rng = np.random.default_rng(4)
    X = (rng.standard_normal((3, 130)) * 2 + 100).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 130).astype(np.float32)
    b = rng.standard_normal(130).astype(np.float32)
    ref = layernorm_reference(X, g, b, 1e-5)
    for name, cfg in (("layernorm_v1", (1, 128)), ("layernorm_v2", (3, 128))):
        Y = _nan(X.shape)
        getattr(nb, name)[cfg](X, g, b, np.float32(1e-5), Y)
        cb.check(Y, ref, name=name, atol=1e-4, rtol=1e-3)
    Y = _nan(X.shape)
    nb.rmsnorm_v1[3, 128](X, g, np.float32(1e-5), Y)
    cb.check(Y, rmsnorm_reference(X, g, 1e-5))


def test_conv_kernels():
    nb = cb.load_numba("conv")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(100).astype(np.float32)
    w = rng.standard_normal(5).astype(np.float32)
    y = _nan(100)
    nb.conv1d_v1[1, 256](x, w, y)
    cb.check(y, conv1d_reference(x, w))
    X = rng.standard_normal((18, 20)).astype(np.float32)
    W = rng.standard_normal((3, 3)).astype(np.float32)
    ref = conv2d_reference(X, W)
    for k in (nb.conv2d_v1, nb.conv2d_v2):
        Y = _nan(X.shape)
        k[(2, 2), (16, 16)](X, W, Y)
        cb.check(Y, ref)
    Y = _nan(X.shape)
    nb.make_conv2d_v3(W)[(2, 2), (16, 16)](X, Y)
    cb.check(Y, ref)


def test_references_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 9))
    w = rng.standard_normal((5, 5))
    t = torch.nn.functional.conv2d(torch.from_numpy(x)[None, None], torch.from_numpy(w)[None, None],
                                   padding=2)[0, 0].numpy()
    np.testing.assert_allclose(conv2d_reference(x, w), t, atol=1e-12)
    g = rng.uniform(0.5, 1.5, 9)
    t = torch.nn.functional.rms_norm(torch.from_numpy(x), (9,), torch.from_numpy(g), 1e-6)
    np.testing.assert_allclose(rmsnorm_reference(x, g, 1e-6), t.numpy(), rtol=1e-12)


# ----------------------------------------------------------------------------- launch helpers
@gpu
@pytest.mark.parametrize("M, N", [(3, 1), (5, 256), (3, 1001), (2, 4099), (2, 40_000),
                                  (1, 65_536), (2, 100_000)])
def test_row_kernels_any_n(M, N):
    """softmax_v5, layernorm_v3 and rmsnorm_v2 through their launch helpers for any N: float4
    rows, rows that are not 16-byte aligned (N % 4 != 0, and a view one float in), and rows too
    long for the registers (streamed)."""
    import cupy as cp

    sm, nl = cb.load_launch("softmax"), cb.load_launch("norm")
    rng = np.random.default_rng(N)
    xb = cp.asarray((rng.standard_normal(M * N + 1) * 4).astype(np.float32))
    g = cp.asarray(rng.uniform(0.5, 1.5, N + 1).astype(np.float32))
    b = cp.asarray(rng.standard_normal(N + 1).astype(np.float32))
    for off in (0, 1):
        x = xb[off:off + M * N].reshape(M, N)
        gv, bv = g[off:off + N], b[off:off + N]
        xh = cb.to_numpy(x)
        y = cb.empty_nan((M * N + 1,), xp=cp)[off:off + M * N].reshape(M, N)
        sm.softmax(x, y)
        cb.check(y, softmax_reference(xh), atol=1e-6, rtol=1e-4, name=f"softmax_v5 off={off}")
        y.fill(np.nan)
        nl.layernorm(x, gv, bv, 1e-5, y)
        cb.check(y, layernorm_reference(xh, cb.to_numpy(gv), cb.to_numpy(bv), 1e-5), atol=1e-4,
                 rtol=1e-3, name=f"layernorm_v3 off={off}")
        y.fill(np.nan)
        nl.rmsnorm(x, gv, 1e-5, y)
        cb.check(y, rmsnorm_reference(xh, cb.to_numpy(gv), 1e-5), atol=1e-4, rtol=1e-3,
                 name=f"rmsnorm_v2 off={off}")
        for v in ("layernorm_v4", "layernorm_v5")[:1 + (cb.env.cc() >= (9, 0))]:
            y.fill(np.nan)
            nl.layernorm(x, gv, bv, 1e-5, y, version=v)
            cb.check(y, layernorm_reference(xh, cb.to_numpy(gv), cb.to_numpy(bv), 1e-5),
                     atol=1e-4, rtol=1e-3, name=f"{v} off={off}")


@gpu
@pytest.mark.parametrize("M, N", [(1, 32_768), (3, 32_768), (200, 24_576), (1000, 4096),
                                  (133, 32_764), (7, 4), (140, 8), (67, 16_388)])
def test_layernorm_v5_split_rows(M, N):
    """layernorm_v5's split rows (sm_90): fewer rows than pairs of blocks, many rows per pair
    (each inbox and barrier reused), an odd number of float4 per row (the halves differ), a row
    of one float4 (rank 1 owns nothing), and a large mean (the halves' means differ from the
    row's, so a wrong merge shows)."""
    import cupy as cp

    if cb.env.cc() < (9, 0):
        pytest.skip("layernorm_v5 needs compute capability 9.0")
    nl = cb.load_launch("norm")
    rng = np.random.default_rng(M + N)
    ramp = np.linspace(-3, 3, N, dtype=np.float32)          # rank 0's half is lower than rank 1's
    xh = (rng.standard_normal((M, N)) * 2 + 50 + ramp).astype(np.float32)
    gh = rng.uniform(0.5, 1.5, N).astype(np.float32)
    bh = rng.standard_normal(N).astype(np.float32)
    y = cb.empty_nan((M, N), xp=cp)
    nl.layernorm(cp.asarray(xh), cp.asarray(gh), cp.asarray(bh), 1e-5, y, version="layernorm_v5")
    cb.check(y, layernorm_reference(xh, gh, bh, 1e-5), atol=2e-4, rtol=1e-3,
             name=f"layernorm_v5 {M}x{N}")


@gpu
def test_layernorm_v5_refused_before_sm90(monkeypatch):
    import cupy as cp

    nl = cb.load_launch("norm")
    monkeypatch.setattr(cb.env, "cc", lambda: (8, 0))
    x = cp.ones((2, 8), cp.float32)
    with pytest.raises(cb.LaunchError, match=r"layernorm_v5 .*compute capability 9\.0"):
        nl.layernorm(x, cp.ones(8, cp.float32), cp.ones(8, cp.float32), 1e-5,
                     version="layernorm_v5")


@gpu
def test_every_version_through_the_helpers():
    import cupy as cp

    sm, nl, rl = cb.load_launch("softmax"), cb.load_launch("norm"), cb.load_launch("reduce")
    x = cp.random.standard_normal((6, 1003), dtype=cp.float32) * 4
    g = cp.random.uniform(0.5, 1.5, 1003, dtype=cp.float32)
    b = cp.random.standard_normal(1003, dtype=cp.float32)
    xh = cb.to_numpy(x)
    for v in sm.VERSIONS:
        if cb.env.cc() < sm.MIN_CC.get(v, (0, 0)):
            continue
        cb.check(sm.softmax(x, version=v), softmax_reference(xh), atol=1e-6, name=v)
    for v in nl.LAYERNORM_VERSIONS:
        if cb.env.cc() < nl.MIN_CC.get(v, (0, 0)):
            continue
        cb.check(nl.layernorm(x, g, b, 1e-5, version=v),
                 layernorm_reference(xh, cb.to_numpy(g), cb.to_numpy(b), 1e-5), atol=1e-4,
                 rtol=1e-3, name=v)
    for v in nl.RMSNORM_VERSIONS:
        if cb.env.cc() < nl.MIN_CC.get(v, (0, 0)):
            continue
        cb.check(nl.rmsnorm(x, g, 1e-5, version=v), rmsnorm_reference(xh, cb.to_numpy(g), 1e-5),
                 atol=1e-4, rtol=1e-3, name=v)
    v = cp.random.uniform(0, 1, (1 << 20) + 3, dtype=cp.float32)
    ref = float(v.astype(cp.float64).sum())
    for name in rl.LADDER:
        assert abs(float(rl.ladder(v, name)[0]) - ref) < 1e-4 * ref, name
    assert abs(float(rl.total(v)[0]) - ref) < 1e-4 * ref
    assert float(rl.maximum(v)[0]) == float(v.max())


def test_helper_configs_are_launch_records():
    """softmax / norm / reduce config(): launch records with the kernel's name, either spelling
    of a version, and the device facts given as arguments (no GPU needed)."""
    sm, nl, rl = cb.load_launch("softmax"), cb.load_launch("norm"), cb.load_launch("reduce")
    c = sm.config("v3", 10, 100)
    assert c == sm.config("softmax_v3", 10, 100) == ((3,), (128,)) and c.kernel == "softmax_v3"
    assert sm.config("v5", 4, 16_384, vec=True).block == (512,)
    c = nl.config("layernorm_v4", 4, 40_000, optin=99 * 1024)
    assert c.kernel == "layernorm_v4" and c.shared == nl.v4_shared(40_000, 99 * 1024) > 0
    assert nl.config("v5", 100, 20_000, sms=132) == ((132,), (640,))
    assert nl.config("rmsnorm_v2", 3, 1001).block == (64,)
    assert rl.config("v2", 1000) == ((4,), (256,)) and rl.config("reduce_v3", 1000).grid == (2,)
    assert rl.config("v5", 10, sms=10) == ((40,), (512,))
    assert rl.config("reduce_max_v1", 10, grid=4, block=256) == ((4,), (256,))
    with pytest.raises(ValueError, match="unknown version 'v6'; reduce has"):
        rl.config("v6", 10)


@gpu
def test_helpers_refuse_what_the_kernels_cannot_do():
    import cupy as cp

    sm, nl, rl = cb.load_launch("softmax"), cb.load_launch("norm"), cb.load_launch("reduce")
    x = cp.zeros((4, 8), cp.float32)
    with pytest.raises(TypeError, match="expected dtype float32"):
        sm.softmax(x.astype(cp.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        sm.softmax(x.T)
    with pytest.raises(ValueError, match="expected 2 dimensions"):
        sm.softmax(x.ravel())
    with pytest.raises(ValueError, match=r"gamma: expected shape \(8,\)"):
        nl.layernorm(x, cp.ones(7, cp.float32), cp.ones(8, cp.float32), 1e-5)
    with pytest.raises(TypeError, match="eps must be a number > 0"):
        nl.rmsnorm(x, cp.ones(8, cp.float32), "1e-5")
    with pytest.raises(cb.LaunchError, match="16-byte boundary"):
        rl.total(cp.ones(9, cp.float32)[1:])
    with pytest.raises(ValueError, match="unknown version 'v7'; softmax has"):
        sm.softmax(x, version="v7")
    # the short spellings, and the ladder's last pass into a given out
    ones = cp.ones(3000, cp.float32)
    out = cp.zeros(1, cp.float32)
    assert rl.reduce(ones, out, version="v2") is out and float(out[0]) == 3000.0
    assert float(rl.reduce(ones)[0]) == 3000.0
    cb.check(sm.softmax(x, version="v3"), softmax_reference(cb.to_numpy(x)), atol=1e-6)


# ----------------------------------------------------------------------------- ex03.1
def sum_all(*edits):
    return SOL.get("ex03.1", "sum_all", edits=edits)


# one barrier fewer in the tree: a level may read a partial before it is written
TREE_NO_SYNC = ("            s[tid] += s[tid + stride]\n        cuda.syncthreads()\n",
                "            s[tid] += s[tid + stride]\n")
FIXED_TWO_PASSES = ("        x, n = partial, blocks",
                    "        x, n = partial, blocks\n"
                    "        last = cuda.device_array(1, dtype=np.float32)\n"
                    "        block_sum[1, TPB](x, last)\n"
                    "        return float(last.copy_to_host()[0])")


def test_ex03_1_reference_passes(capsys):
    ex03_1(sum_all())
    assert capsys.readouterr().out == "PASS ex03.1\n"


@pytest.mark.parametrize("edits, hint", [
    ([("blocks = (n + TPB - 1) // TPB", "blocks = max(n // TPB, 1)")], "last partial block"),
    ([("s[tid] = x[i] if i < x.size else float32(0)", "s[tid] = x[i]")],
     "missing bounds guard|values past the end read"),
    ([TREE_NO_SYNC], "a cuda.syncthreads\\(\\) after loading the shared array and after every "
                     "level"),
    ([("        if blocks == 1:\n            return float(partial.copy_to_host()[0])\n",
       "        return float(partial.copy_to_host()[0])\n")], "launch again on the partial"),
    # sizes hard-coded for small inputs: exactly two passes (the simulator runs this launcher at
    # 128^3 + 1 elements with the kernel computed exactly; a GPU runs the real kernel there)
    ([FIXED_TWO_PASSES], "the sum of the first 16384 elements only: 2 passes"),
    # one launch, then the partial sums added on the host: right numbers, half the exercise
    ([("        if blocks == 1:\n            return float(partial.copy_to_host()[0])\n",
       "        return float(partial.copy_to_host().sum(dtype=np.float64))\n")],
     "1 launch of the kernel made it where 2 are needed .* added on the host"),
    # the barrier inside the branch of the tree: the idle half of the block never reaches it
    ([("            s[tid] += s[tid + stride]\n        cuda.syncthreads()\n",
       "            s[tid] += s[tid + stride]\n            cuda.syncthreads()\n")],
     "a barrier that not every thread of the block reaches: line \\d+: cuda.syncthreads\\(\\) "
     "inside the branch"),
    # NumPy in the kernel: thread 0 sums the block's slice
    ([("    if tid == 0:\n        partial[cuda.blockIdx.x] = s[0]",
       "    if tid == 0:\n        partial[cuda.blockIdx.x] = s.sum()")],
     "uses what runs only on the host: line \\d+: \\.sum"),
], ids=["grid-rounded-down", "no-guard", "no-barrier-between-levels", "one-level",
        "two-fixed-passes", "host-finish", "barrier-in-branch", "numpy-in-kernel"])
def test_ex03_1_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_1(sum_all(*edits))


def test_ex03_1_cached_answer_and_host_sums_fail():
    ref, cache = sum_all(), {}

    def cached(x):                       # sums once per length, then replays that answer
        if x.size not in cache:
            cache[x.size] = ref(x)
        return cache[x.size]
    with pytest.raises(GradeError, match="the sum of the previous call's data"):
        ex03_1(cached)
    # the right number without the kernel: a prefix sum (or any sum) on the host
    with pytest.raises(GradeError, match="without launching a kernel"):
        ex03_1(lambda x: float(np.cumsum(cb.to_numpy(x), dtype=np.float64)[-1]))


def test_ex03_1_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex03_1(SOL.stub("ex03.1", "sum_all"))


@cuda.jit
def _running_total(x, partial):
    # one thread adds everything in one float32 register: the rounding grows with n
    if cuda.grid(1) == 0:
        t = float32(0)
        for i in range(x.size):
            t += x[i]
        partial[0] = t
    elif cuda.threadIdx.x == 0 and cuda.blockIdx.x < partial.size:
        partial[cuda.blockIdx.x] = float32(0)


@gpu
def test_ex03_1_sequential_float32_sum_gets_the_precision_hint():
    ns = SOL.namespace("ex03.1")
    launcher = SOL.get("ex03.1", "sum_all", edits=[("block_sum[blocks, TPB](x, partial)",
                                                   "running_total[blocks, TPB](x, partial)")])
    launcher.__globals__["running_total"] = _running_total
    assert ns is not launcher.__globals__
    with pytest.raises(GradeError, match="what a running float32 total gives"):
        ex03_1(launcher)


# ----------------------------------------------------------------------------- ex03.3
def softmax_online(*edits):
    return SOL.get("ex03.3", "softmax_online", edits=edits)


NO_MAX = [("                d = d * math.exp(m - v) + float32(1)\n",
           "                d += math.exp(v)\n"),
          ("                d += math.exp(v - m)", "                d += math.exp(v)"),
          ("        if m == NEG_INF:\n            m = float32(0)\n", "        m = float32(0)\n")]
TEXTBOOK_UPDATE = [("            if v > m:\n                d = d * math.exp(m - v) + float32(1)\n"
                    "                m = v\n            elif v != NEG_INF:\n"
                    "                d += math.exp(v - m)\n",
                    "            mn = max(m, v)\n            d = d * math.exp(m - mn) + "
                    "math.exp(v - mn)\n            m = mn\n"),
                   ("        if m == NEG_INF:\n            m = float32(0)\n", "")]


def test_ex03_3_reference_passes(capsys):
    ex03_3(softmax_online())
    assert capsys.readouterr().out == "PASS ex03.3\n"


@pytest.mark.parametrize("edits, hint", [
    (NO_MAX, "subtract the running max"),
    (TEXTBOOK_UPDATE, "NaN from exp\\(-inf - \\(-inf\\)\\)|a row of only -inf must give zeros"),
    ([("d = d * math.exp(m - v) + float32(1)", "d = d + float32(1)")],
     "is the old sum rescaled by exp\\(m_old - m_new\\)"),
    ([("    if r < x.shape[0]:\n", "    if True:\n")], "missing bounds guard"),
    # the running max starts at 0: right until every score of a row is very negative
    ([("        m, d = NEG_INF, float32(0)", "        m, d = float32(0), float32(0)")],
     "very negative scores .*the running max must start at -inf"),
    # NumPy in the kernel: the row's max taken with an array method
    ([("        m, d = NEG_INF, float32(0)", "        m, d = x[r].max(), float32(0)")],
     "uses what runs only on the host: line \\d+: .max"),
], ids=["no-max", "textbook-update", "no-rescale", "no-guard", "max-starts-at-0",
        "numpy-max"])
def test_ex03_3_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_3(softmax_online(*edits))


def test_ex03_3_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex03_3(SOL.stub("ex03.3", "softmax_online"))


# ----------------------------------------------------------------------------- ex03.4
def layernorm(*edits):
    return SOL.get("ex03.4", "layernorm", edits=edits)


VAR = ("math.sqrt(s[0] / N + eps)", )


def test_ex03_4_reference_passes(capsys):
    ex03_4(layernorm())
    assert capsys.readouterr().out == "PASS ex03.4\n"


@pytest.mark.parametrize("edits, hint", [
    ([("        c = x[r, j] - mean\n        q += c * c", "        q += x[r, j] * x[r, j]"),
      (VAR[0], "math.sqrt(s[0] / N - mean * mean + eps)")], "cancels catastrophically"),
    ([(VAR[0], "math.sqrt(s[0] / max(N - 1, 1) + eps)")], "divides by N - 1"),
    ([(VAR[0], "math.sqrt(s[0] / N)")], "eps is missing"),
    ([("y[r, j] = (x[r, j] - mean) * rstd * gamma[j] + beta[j]",
       "y[r, j] = (x[r, j] - mean) * rstd")], "gamma and beta are not applied"),
    # the barrier before the shared total is reused: the race that passed on the H100
    ([("    cuda.syncthreads()                     # everyone has read s[0] before it is "
       "reused\n", "")], "one after every thread has read the shared total"),
    # the barrier of the tree inside its branch (both trees)
    ([("            s[tid] += s[tid + stride]\n        cuda.syncthreads()\n",
       "            s[tid] += s[tid + stride]\n            cuda.syncthreads()\n", 2)],
     "a barrier that not every thread of the block reaches: line \\d+: cuda.syncthreads\\(\\) "
     "inside the branch"),
], ids=["one-pass-variance", "unbiased", "no-eps", "no-affine", "no-barrier-before-reuse",
        "barrier-in-branch"])
def test_ex03_4_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_4(layernorm(*edits))


def test_ex03_4_stub_fails():
    with pytest.raises(GradeError, match="not implemented yet"):
        ex03_4(SOL.stub("ex03.4", "layernorm"))


# ----------------------------------------------------------------------------- CUDA C (GPU)
def sum_atomic(*edits):
    return SOL.get("ex03.2", "sum_atomic_src", edits=edits)


PER_WARP_ATOMICS = ("    if (lane == 0) warp_sums[warp] = v;\n    __syncthreads();\n"
                    "    if (warp == 0) {\n"
                    "        v = (lane < blockDim.x / 32) ? warp_sums[lane] : 0.0f;\n"
                    "        for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, "
                    "v, o);\n        if (lane == 0) atomicAdd(out, v);\n    }\n",
                    "    if (lane == 0) atomicAdd(out, v);\n")
NO_SHUFFLE = ("__shfl_down_sync(0xffffffffu, v, o)", "0.0f", 2)


@gpu
def test_ex03_2_reference_passes(capsys):
    ex03_2(sum_atomic())
    assert capsys.readouterr().out == "PASS ex03.2\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([("i += blockDim.x * gridDim.x", "i += n")], "grid-stride"),
    ([("if (lane == 0) atomicAdd(out, v);", "atomicAdd(out, v);")],
     "made 224 atomicAdd calls \\(one per thread of one warp\\): the rule is one per block"),
    ([PER_WARP_ATOMICS], "\\(one per warp\\): the rule is one per block"),
    ([NO_SHUFFLE], "uses no warp shuffle"),
    # a comment that names the shuffle does not satisfy the rubric
    ([NO_SHUFFLE, ("    float v = 0.0f;", "    float v = 0.0f;  // __shfl_down_sync below")],
     "uses no warp shuffle"),
    ([("v += x[i]", "v += 2.0f * x[i]")], "every element is counted 2 times"),
    ([("    __syncthreads();\n", "")], "racecheck found a race|on repeated runs: a race"),
], ids=["no-grid-stride", "warp-0-all-lanes-add", "one-atomic-per-warp", "no-shuffle",
        "shuffle-only-in-a-comment", "doubled", "no-barrier"])
def test_ex03_2_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_2(sum_atomic(*edits))


def conv_src(*edits):
    return SOL.get("ex03.5", "conv2d_tiled_src", edits=edits)


@gpu
def test_ex03_5_reference_passes(capsys):
    ex03_5(conv_src())
    assert capsys.readouterr().out == "PASS ex03.5\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([("if (r < H && c < W) {", "if (r >= pad && r < H - pad && c >= pad && c < W - pad) {")],
     "only the border is wrong"),
    ([("(rr >= 0 && rr < H && cc >= 0 && cc < W) ? x[rr * W + cc] : 0.0f",
       "x[min(max(rr, 0), H - 1) * W + min(max(cc, 0), W - 1)]")], "only the border is wrong"),
    ([("if (r < H && c < W) {", "{")], "wrote past the end of y"),
    ([("__shared__ float tile", "float tile")], "no __shared__ tile"),
    ([("    __syncthreads();\n", "")], "racecheck found a race|a __syncthreads\\(\\) before "
                                       "computing"),
], ids=["border-skipped", "border-clamped", "no-guard", "no-shared", "no-barrier"])
def test_ex03_5_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_5(conv_src(*edits))


def bias_gelu(*edits):
    return SOL.get("ex03.6", "bias_gelu_src", edits=edits)


@gpu
def test_ex03_6_reference_passes(capsys):
    ex03_6(bias_gelu())
    assert capsys.readouterr().out == "PASS ex03.6\n"


@gpu
@pytest.mark.parametrize("edit, hint", [
    (("0.5f * z * (1.0f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)))",
      "0.5f * z * (1.0f + erff(z * 0.70710678f))"), "erf form"),
    (("b[i % N]", "b[i / N]"), "indexed by row"),
    ((" + b[i % N]", ""), "not added"),
    (("if (i < (long long)M * N) {", "{"), "missing bounds guard"),
    (("        y[i] =", "        // y[i] ="), "never written"),
], ids=["erf", "bias-by-row", "no-bias", "no-guard", "no-store"])
def test_ex03_6_wrong_answers_fail(edit, hint):
    with pytest.raises(GradeError, match=hint):
        ex03_6(bias_gelu(edit))


@gpu
def test_ex03_6_fusion_is_measured():
    """The fused kernel is timed against the unfused pair; a goal no kernel reaches shows the
    message (the reference itself passes with the default goal, test above)."""
    with pytest.raises(GradeError, match="not measurably fused"):
        ex03_6(bias_gelu(), min_speedup=50.0)


@pytest.mark.simulator
@pytest.mark.parametrize("grader", [ex03_2, ex03_5, ex03_6])
def test_cuda_graders_say_they_need_a_gpu(grader):
    with pytest.raises(GradeError, match="needs a CUDA GPU"):
        grader("")


def test_references_are_still_importable_from_the_grader_module():
    """The references moved to cudabook.reference; the grader module still exports each of them
    (``from cudabook.graders.ch03 import softmax_reference``) as the very same function."""
    from cudabook import reference
    from cudabook.graders import ch03

    names = ["softmax_reference", "layernorm_reference", "conv2d_reference",
             "gelu_tanh_reference"]
    for name in names:
        assert name in ch03.__all__, f"{name} is no longer exported by graders.ch03"
        assert getattr(ch03, name) is getattr(reference, name), f"graders.ch03.{name} is a copy"
    from cudabook.graders.ch03 import conv2d_reference as conv2d
    from cudabook.graders.ch03 import gelu_tanh_reference as gelu_tanh
    from cudabook.graders.ch03 import layernorm_reference as layernorm
    from cudabook.graders.ch03 import softmax_reference as softmax

    assert (softmax, layernorm, conv2d, gelu_tanh) == (
        softmax_reference, layernorm_reference, conv2d_reference, gelu_tanh_reference)


# ----------------------------------------------------------------------------- pencil and paper
(test_question_reference_passes, test_question_stub_fails,
 test_question_common_mistake_gets_its_hint) = pencil_tests(
    SOL, (graders.ex03_7, graders.ex03_8, graders.ex03_9), [
    ("ex03.7", "interleaved_s4", 1, "one in 8 lanes of every warp"),
    ("ex03.7", "interleaved_s32", 8, "does not diverge"),
    ("ex03.7", "sequential_s16", 0, "half of warp 0"),
    ("ex03.8", "first_partials", 7812, "round up"),
    ("ex03.8", "launches", 2, "62"),
    ("ex03.9", "bytes_v2", 12, "the write of y counts too"),
    ("ex03.9", "bytes_v4", 16, "read twice"),
    ("ex03.9", "speedup_v5_v2", 3.0, "16 / 8"),
])
