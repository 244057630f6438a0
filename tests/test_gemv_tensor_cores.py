"""gemv_v5 (kernels/gemv.cu): the tensor-core GEMV for decode batches. Its instantiations, and on
a GPU every tile count at batches that fill one tile, spill into a second and leave rows empty,
ragged N and K, bias, and the batch invariance the serving engine relies on."""

import numpy as np
import pytest

import cudabook as cb

gpu = pytest.mark.gpu


def test_v5_instantiation_and_launch():
    gv = cb.load_launch("gemv")
    assert "gemv_v5" in gv.VERSIONS and "gemv_v5" in gv.WHAT
    assert gv.kernel_name("gemv_v5", 16, N=768) == "gemv_v5_m1_n1"
    assert gv.kernel_name("gemv_v5", 17, N=768) == "gemv_v5_m2_n1"
    assert gv.kernel_name("gemv_v5", 32, nt=4) == "gemv_v5_m2_n4"
    # tiles depend on N alone: at least 256 blocks, else one tile
    assert [gv.v5_tiles(N) for N in (768, 2304, 4096, 8192, 50257)] == [1, 1, 2, 4, 4]
    assert gv.config("gemv_v5", 5, 50257) == ((1571,), (256,))
    assert gv.config("gemv_v5", 5, 45, nt=2) == ((3,), (256,))
    with pytest.raises(ValueError, match="nt must be one of"):
        gv.kernel_name("gemv_v5", 1, nt=3)
    with pytest.raises(ValueError, match="give N"):
        gv.kernel_name("gemv_v5", 1)


def _case(rng, B: int, N: int, K: int):
    """x (B, K), W (N, K), bias (N,) fp16 from ``rng``; x @ W.T in float64; the fp16 tolerance."""
    import cupy as cp

    x = rng.standard_normal((B, K), dtype=cp.float32).astype(cp.float16)
    W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
    b = rng.standard_normal(N, dtype=cp.float32).astype(cp.float16)
    ref = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(W).astype(np.float64).T
    return x, W, b, ref, dict(atol=1e-2 + 1e-3 * np.sqrt(K), rtol=1e-2)


@gpu
@pytest.mark.parametrize("nt", [1, 2, 4])
def test_v5_against_float64(nt):
    import cupy as cp

    gv = cb.load_launch("gemv")
    rng = cp.random.default_rng(nt)
    for B, N, K in ((1, 37, 264), (7, 45, 776), (16, 64, 512), (17, 9, 40), (32, 100, 3072),
                    (32, 8, 8)):
        x, W, b, ref, tol = _case(rng, B, N, K)
        cb.check(gv.gemv(x, W, version="gemv_v5", nt=nt), ref, **tol)
        y = cp.full((B, N), cp.nan, cp.float16)            # every element must be written
        gv.gemv(x, W, b, out=y, version="gemv_v5", nt=nt)
        cb.check(y, ref + cp.asnumpy(b).astype(np.float64), **tol)


@gpu
def test_v5_large_values_and_1d_x():
    import cupy as cp

    gv = cb.load_launch("gemv")
    x = cp.full(1024, 2.0, cp.float16)
    W = cp.full((24, 1024), 30.0, cp.float16)               # 61,440: inside fp16's range
    y = gv.gemv(x, W, version="gemv_v5")
    assert y.shape == (24,) and bool((y == 61440.0).all())


@gpu
def test_v5_rows_do_not_depend_on_the_batch():
    """The engine serves a request with the same kernel at every batch size: its row of y must
    be the same bits alone and among 31 others (it is summed the same way in every tile)."""
    import cupy as cp

    gv = cb.load_launch("gemv")
    rng = cp.random.default_rng(5)
    for N, K in ((768, 768), (3072, 768), (768, 3072)):
        x = rng.standard_normal((32, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
        full = gv.gemv(x, W, version="gemv_v5")
        for B in (1, 3, 16, 17):
            part = gv.gemv(x[:B].copy(), W, version="gemv_v5")
            assert bool((part == full[:B]).all()), (N, K, B)


def test_v6_splits_depend_on_k_alone_and_tiles_fill_the_gpu():
    gv = cb.load_launch("gemv")
    assert [gv.v6_splits(K) for K in (8, 768, 3072, 4096, 8192, 14336)] == [1, 1, 3, 4, 8, 8]
    assert gv.v6_tiles(768, 3, 132) == 1 and gv.v6_tiles(50257, 1, 132) == 8
    assert gv.v6_tiles(4096, 4, 132) == 4 and gv.v6_tiles(8192, 8, 132) == 8
    c = gv.config("gemv_v6", 32, 768, K=3072, sms=132)
    assert c == ((96, 3), (256,)) and c.kernel == "gemv_v6_m2_n1" and c.ks == 3
    assert gv.config("gemv_v6", 1, 768, K=3072, sms=132).ks == 3      # the same split at B = 1
    with pytest.raises(ValueError, match="ks must be"):
        gv.config("gemv_v6", 1, 768, ks=9)
    with pytest.raises(ValueError, match="give K"):
        gv.config("gemv_v6", 1, 768)


@gpu
@pytest.mark.parametrize("nt,ks", [(1, 1), (1, 3), (2, 8), (4, 2), (8, 5), (None, None)])
def test_v6_against_float64(nt, ks):
    import cupy as cp

    gv = cb.load_launch("gemv")
    rng = cp.random.default_rng(7)
    for B, N, K in ((1, 37, 264), (7, 45, 776), (16, 64, 512), (17, 9, 40), (32, 100, 3072),
                    (32, 8, 8), (3, 70, 4096)):
        x, W, b, ref, tol = _case(rng, B, N, K)
        for _ in range(2):                  # the tickets are back at zero after each launch
            y = cp.full((B, N), cp.nan, cp.float16)
            gv.gemv(x, W, b, out=y, version="gemv_v6", nt=nt, ks=ks)
            cb.check(y, ref + cp.asnumpy(b).astype(np.float64), **tol)
        assert int(gv.workspace(0, 0)[1].max()) == 0


@gpu
def test_v6_rows_do_not_depend_on_the_batch_or_the_tiles():
    import cupy as cp

    gv = cb.load_launch("gemv")
    rng = cp.random.default_rng(8)
    for N, K in ((768, 768), (768, 3072), (2304, 4096)):
        x = rng.standard_normal((32, K), dtype=cp.float32).astype(cp.float16)
        W = rng.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
        full = gv.gemv(x, W, version="gemv_v6")
        for B, nt in ((1, 1), (3, 8), (16, 2), (17, 4), (32, 1)):
            part = gv.gemv(x[:B].copy(), W, version="gemv_v6", nt=nt)
            assert bool((part == full[:B]).all()), (N, K, B, nt)


@gpu
def test_v6_refuses_a_workspace_too_small():
    import cupy as cp

    gv = cb.load_launch("gemv")
    x, W = cp.ones((4, 4096), cp.float16), cp.ones((64, 4096), cp.float16)
    with pytest.raises(cb.LaunchError, match="work must be"):
        gv.gemv(x, W, version="gemv_v6", work=(cp.empty(10, cp.float32), cp.zeros(8, cp.uint32)))
    y = gv.gemv(x, W, version="gemv_v6",
                work=(cp.empty(4 * 4 * 64, cp.float32), cp.zeros(64, cp.uint32)))
    assert bool((y == 4096.0).all())
