"""Rows split over a thread-block cluster (Chapter 3's long rows): softmax_v6, layernorm_v6 and
rmsnorm_v3 (sm_90), their launch configuration (cb.launch.row_split) and the cluster launch of the
launch core (cuLaunchKernelEx through ctypes).

The configuration tests run anywhere; the kernels' tests need a GPU of compute capability 9.0
(marked gpu, skipped below it). They have no Numba twins: the simulator has no clusters.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import cudabook as cb
from cudabook.launch import SPLIT_CLUSTERS, kernel_params, row_split, split_max_n
from cudabook.reference import layernorm_reference, rmsnorm_reference, softmax_reference

gpu = pytest.mark.gpu
H100_OPTIN = 227 * 1024           # sharedMemPerBlockOptin of an H100 / H200
SIZES = (4096, 4097, 32_768, 65_536, 131_072, 262_144)


def _launchers():
    return cb.load_launch("softmax"), cb.load_launch("norm")


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("N, C", [(4, 2), (4096, 2), (4097, 2), (32_768, 2), (32_772, 4),
                                  (65_536, 4), (131_072, 8), (131_076, 16), (262_144, 16)])
def test_cluster_size_is_chosen_from_n(N, C):
    """The smallest cluster whose blocks hold at most 16384 floats (64 KiB) of the row."""
    sm, nl = _launchers()
    cfgs = [sm.config("v6", 3, N, optin=H100_OPTIN),
            nl.config("layernorm_v6", 3, N, optin=H100_OPTIN),
            nl.config("rmsnorm_v3", 3, N, optin=H100_OPTIN)]
    for cfg, k in zip(cfgs, ("softmax_v6", "layernorm_v6", "rmsnorm_v3")):
        assert cfg.kernel == k and cfg.cluster == C and cfg.grid == (3 * C,)
        L = cfg.slice
        assert L % 4 == 0 and C * L >= N > (C - 1) * L - 4 and cfg.shared == 4 * L
        T = cfg.block[0]
        assert T % 32 == 0 and max(128, C) <= T <= 512


@pytest.mark.parametrize("N", [1 << k for k in range(12, 19)] + [4097, 100_000, 250_001])
def test_shared_memory_within_the_optin_limit_up_to_262144(N):
    """Every N up to 262144 fits the opt-in shared memory of an H100, three blocks to an SM."""
    cfg = row_split(7, N, "k", optin=H100_OPTIN)
    assert cfg.shared <= 64 * 1024 and 3 * (cfg.shared + 1024 + 1024) <= 228 * 1024
    assert cfg.cluster in SPLIT_CLUSTERS


def test_explicit_cluster_sizes_for_the_crossover():
    """The probe times every cluster size at one N: each is a valid launch while it fits."""
    for C in SPLIT_CLUSTERS:
        cfg = row_split(2, 65_536, "k", cluster=C, optin=H100_OPTIN)
        assert cfg.cluster == C and cfg.slice == 65_536 // C and cfg.grid == (2 * C,)
    assert row_split(1, 10, "k", cluster=16).slice == 4      # ranks past the row hold nothing


def test_refusals_name_the_n_they_take():
    sm, nl = _launchers()
    top = split_max_n(H100_OPTIN)
    assert top == 16 * ((H100_OPTIN - 1024) // 16 * 4) and top > 900_000
    row_split(1, top, "k", optin=H100_OPTIN)
    with pytest.raises(cb.LaunchError, match=rf"softmax_v6 takes 1 <= N <= {top} in clusters "
                                             "of 16"):
        sm.config("v6", 1, top + 64, optin=H100_OPTIN)
    with pytest.raises(cb.LaunchError, match=r"layernorm_v6 takes 1 <= N <= \d+ in clusters of 2 "
                                             r"\(N <= \d+ in clusters of 16\)"):
        nl.config("layernorm_v6", 1, 262_144, optin=99 * 1024, cluster=2)
    with pytest.raises(cb.LaunchError, match="cluster must be one of"):
        nl.config("rmsnorm_v3", 1, 4096, cluster=3)
    with pytest.raises(cb.LaunchError, match="threads must be a multiple of 32"):
        row_split(1, 4096, "k", cluster=16, threads=1024)
    with pytest.raises(cb.LaunchError, match="more blocks than one grid dimension"):
        row_split(2**28, 4096, "k", cluster=16)


def test_ladders_and_min_cc():
    sm, nl = _launchers()
    assert sm.VERSIONS[-1] == "softmax_v6" and sm.MIN_CC["softmax_v6"] == (9, 0)
    assert nl.LAYERNORM_VERSIONS[-1] == "layernorm_v6" and nl.RMSNORM_VERSIONS[-1] == "rmsnorm_v3"
    assert nl.MIN_CC["layernorm_v6"] == nl.MIN_CC["rmsnorm_v3"] == (9, 0)
    src = {f: (cb.compile.KERNELS_DIR / f).read_text() for f in ("softmax.cu", "norm.cu")}
    for f, k in (("softmax.cu", "softmax_v6"), ("norm.cu", "layernorm_v6"),
                 ("norm.cu", "rmsnorm_v3")):
        assert k in cb.compile.kernel_names(src[f])
        head = src[f][:src[f].index("#include")]
        line = " ".join(head.split(f"//   {k}")[1].replace("//", " ").split())[:1000]
        assert "sm_90" in line and "no numba twin" in line.lower(), (k, line)


def test_cluster_launch_structs_and_parameters():
    """cuLaunchKernelEx's CUlaunchConfig (56 bytes) and CUlaunchAttribute (72: an 8-byte id and a
    64-byte union); NumPy scalars go by value, anything else is refused."""
    from cudabook.launch import _launch_structs

    attr, conf = _launch_structs()
    assert ctypes.sizeof(attr) == 72 and ctypes.sizeof(conf) == 56
    assert conf.hStream.offset == 32 and attr.value.offset == 8
    params, keep = kernel_params((np.int32(-7), np.float32(1.5), np.int64(2**40)))
    assert ctypes.c_int32.from_address(params[0]).value == -7
    assert ctypes.c_float.from_address(params[1]).value == 1.5
    assert ctypes.c_int64.from_address(params[2]).value == 2**40
    with pytest.raises(TypeError, match="argument 0 of a cluster launch"):
        kernel_params((7,))


# ----------------------------------------------------------------------------- on the GPU
def _need_sm90():
    if cb.env.cc() < (9, 0):
        pytest.skip("thread-block clusters need compute capability 9.0")


def _rows(N, seed):
    rng = np.random.default_rng(seed)
    return rng, (rng.standard_normal((4, N)) * 3).astype(np.float32)


@gpu
@pytest.mark.parametrize("N", SIZES)
def test_softmax_v6(N):
    """Rows of ordinary values, of large magnitudes (exp(x - max) underflows for most of the row),
    with a huge value near the end and -inf in the first slice, and of only -inf (zeros)."""
    import cupy as cp

    _need_sm90()
    sm, _ = _launchers()
    _, x = _rows(N, N)
    x[1] *= 3000.0
    x[2, -3] = 30_000.0
    x[2, : N // 5] = -np.inf
    x[3] = -np.inf
    y = cb.empty_nan(x.shape, xp=cp)
    sm.softmax(cp.asarray(x), y, version="softmax_v6")
    cb.check(y, softmax_reference(x), atol=1e-6, rtol=1e-4, name=f"softmax_v6 N={N}")


@gpu
@pytest.mark.parametrize("N", SIZES)
def test_layernorm_v6(N):
    """A large mean with a ramp (the slices' means differ from the row's: a wrong merge shows) and
    a constant row (variance 0: y = beta)."""
    import cupy as cp

    _need_sm90()
    _, nl = _launchers()
    rng, x = _rows(N, N + 1)
    x += 50 + np.linspace(-3, 3, N, dtype=np.float32)
    x[1] = 2.5
    g = rng.uniform(0.5, 1.5, N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    y = cb.empty_nan(x.shape, xp=cp)
    nl.layernorm(cp.asarray(x), cp.asarray(g), cp.asarray(b), 1e-5, y, version="layernorm_v6")
    cb.check(y, layernorm_reference(x, g, b, 1e-5), atol=2e-4, rtol=1e-3,
             name=f"layernorm_v6 N={N}")


@gpu
@pytest.mark.parametrize("N", SIZES)
def test_rmsnorm_v3(N):
    import cupy as cp

    _need_sm90()
    _, nl = _launchers()
    rng, x = _rows(N, N + 2)
    x[1] *= 1000.0
    x[2, : N // 3] = 0.0
    g = rng.uniform(0.5, 1.5, N).astype(np.float32)
    y = cb.empty_nan(x.shape, xp=cp)
    nl.rmsnorm(cp.asarray(x), cp.asarray(g), 1e-6, y, version="rmsnorm_v3")
    cb.check(y, rmsnorm_reference(x, g, 1e-6), atol=1e-4, rtol=1e-3, name=f"rmsnorm_v3 N={N}")


@gpu
@pytest.mark.parametrize("C", SPLIT_CLUSTERS)
@pytest.mark.parametrize("M, N", [(300, 4096), (5, 1001), (3, 12), (2, 65_540)])
def test_every_cluster_size(C, M, N):
    """Each cluster size on many rows (more clusters than fit the GPU at once), a ragged row, a
    row shorter than the cluster (the last ranks hold nothing), and a view one float in (rows
    not 16-byte aligned: scalar loads)."""
    import cupy as cp

    _need_sm90()
    sm, nl = _launchers()
    rng = np.random.default_rng(C * N + M)
    xb = cp.asarray((rng.standard_normal(M * N + 1) * 4 + 1).astype(np.float32))
    g = cp.asarray(rng.uniform(0.5, 1.5, N + 1).astype(np.float32))
    b = cp.asarray(rng.standard_normal(N + 1).astype(np.float32))
    for off in (0, 1):
        x = xb[off:off + M * N].reshape(M, N)
        gv, bv, xh = g[off:off + N], b[off:off + N], cb.to_numpy(xb[off:off + M * N]).reshape(M, N)
        what = f"{M}x{N} off={off} in clusters of {C}"
        y = cb.empty_nan((M, N), xp=cp)
        sm.softmax(x, y, version="softmax_v6", cluster=C)
        cb.check(y, softmax_reference(xh), atol=1e-6, rtol=1e-4, name=f"softmax_v6 {what}")
        y = cb.empty_nan((M, N), xp=cp)
        nl.layernorm(x, gv, bv, 1e-5, y, version="layernorm_v6", cluster=C)
        cb.check(y, layernorm_reference(xh, cb.to_numpy(gv), cb.to_numpy(bv), 1e-5), atol=1e-4,
                 rtol=1e-3, name=f"layernorm_v6 {what}")
        y = cb.empty_nan((M, N), xp=cp)
        nl.rmsnorm(x, gv, 1e-5, y, version="rmsnorm_v3", cluster=C)
        cb.check(y, rmsnorm_reference(xh, cb.to_numpy(gv), 1e-5), atol=1e-4, rtol=1e-3,
                 name=f"rmsnorm_v3 {what}")


@gpu
def test_torch_tensors_and_their_stream():
    """Tensors go through the same entry points, on PyTorch's current stream."""
    torch = pytest.importorskip("torch")
    _need_sm90()
    sm, nl = _launchers()
    x = torch.randn(3, 65_536, device="cuda")
    g = torch.rand(65_536, device="cuda") + 0.5
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = sm.softmax(x, version="v6")
        z = nl.rmsnorm(x, g, 1e-6, version="rmsnorm_v3")
    s.synchronize()
    torch.testing.assert_close(y, torch.softmax(x, -1), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(z, torch.nn.functional.rms_norm(x, (65_536,), g, 1e-6),
                               atol=1e-4, rtol=1e-3)


@gpu
def test_refused_before_sm90(monkeypatch):
    import cupy as cp

    sm, nl = _launchers()
    monkeypatch.setattr(cb.env, "cc", lambda: (8, 0))
    x, g = cp.ones((2, 8), cp.float32), cp.ones(8, cp.float32)
    with pytest.raises(cb.LaunchError, match=r"softmax_v6 .*compute capability 9\.0"):
        sm.softmax(x, version="softmax_v6")
    with pytest.raises(cb.LaunchError, match=r"layernorm_v6 .*compute capability 9\.0"):
        nl.layernorm(x, g, g, 1e-5, version="layernorm_v6")
    with pytest.raises(cb.LaunchError, match=r"rmsnorm_v3 .*compute capability 9\.0"):
        nl.rmsnorm(x, g, 1e-5, version="rmsnorm_v3")


@gpu
def test_cluster_argument_only_for_split_rows():
    import cupy as cp

    sm, nl = _launchers()
    x, g = cp.ones((2, 8), cp.float32), cp.ones(8, cp.float32)
    with pytest.raises(ValueError, match="cluster= is softmax_v6's"):
        sm.softmax(x, version="v5", cluster=2)
    with pytest.raises(ValueError, match="does not split a row"):
        nl.rmsnorm(x, g, 1e-5, version="rmsnorm_v2", cluster=2)
