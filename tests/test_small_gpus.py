"""Every lesson kernel on the GPUs readers have, not only the H100: shared memory per block.

A block may opt into 64 KiB of shared memory on a T4 (cc 7.5), 99 KiB on an L4, A10 or RTX 30/40
(cc 8.6, 8.9), 163 KiB on an A100 (8.0) and 227 KiB on an H100 (9.0). The launch helpers read the
limit (``hgemm_launch._smem_optin``, ``igemm_launch._optin``); these tests set it to each GPU's
and check that every version Chapter 8's ladder lists either fits (its own kernel, or a fallback
that config() names) or is refused with a message naming the shared memory it needs.

Chapter 9's attention kernels: forward v3 fits everywhere, backward v2 runs smaller tiles below
163 KiB (``attention_launch.bwd_config``, its limit read by ``_optin``) and prints a note.

CPU tests run anywhere. The GPU tests launch the fallbacks on the GPU at hand with the limit
lowered (an H100 runs the L4's and the T4's configurations: it has more of everything).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import cudabook as cb

hg = cb.load_launch("hgemm")
ig = cb.load_launch("igemm")
gpu = pytest.mark.gpu

KIB = 1024
#: (GPU, compute capability, opt-in shared memory per block in KiB)
GPUS = [("T4", (7, 5), 64), ("L4", (8, 9), 99), ("A10", (8, 6), 99), ("A100", (8, 0), 163),
        ("H100", (9, 0), 227)]
SMEM_REFUSAL = re.compile(r"needs (\d+) KiB of shared memory per block, this GPU allows (\d+) KiB")


def _limit(monkeypatch, kib: int) -> None:
    """Pretend this machine's GPU lets a block opt into ``kib`` KiB (hgemm and igemm)."""
    monkeypatch.setattr(hg, "_smem_optin", lambda cc=None: kib * KIB)
    monkeypatch.setattr(ig, "_optin", lambda: kib * KIB)
    monkeypatch.setattr(hg, "_NOTED", set())
    monkeypatch.setattr(ig, "_NOTED", set())


def _ladder(cc) -> list[str]:
    """The versions lesson 8's ladder cell launches (its filter, as written in the cell)."""
    return [v for v in hg.VERSIONS if cc >= hg.MIN_CC[v]
            and (v not in hg.HOPPER_ONLY or cc == (9, 0))]


# ============================================================================ hgemm (CPU)

@pytest.mark.parametrize("name, cc, kib", GPUS)
def test_hgemm_every_version_fits_or_names_its_shared_memory(monkeypatch, name, cc, kib):
    _limit(monkeypatch, kib)
    dtypes = ("float16", "bfloat16") if cc >= (8, 0) else ("float16",)
    for v in _ladder(cc):
        for dt in dtypes:
            if dt == "bfloat16" and v not in hg.BF16:
                continue
            try:
                hg.require(v, cc, dt)
            except hg.UnsupportedError as e:
                # the lesson prints the message up to its first ';': the need and the limit
                m = SMEM_REFUSAL.search(str(e).split(";")[0])
                assert m, f"{name}: {v} refused without naming its shared memory: {e}"
                assert int(m.group(1)) > kib and int(m.group(2)) == kib
                continue
            cfg = hg.config(v, 4096, 4096, 4096, cc, sms=58, dtype=dt)
            assert cfg["shared"] <= kib * KIB, (name, v, dt, cfg)


def test_hgemm_on_99_kib_v6_falls_back_v10_is_refused_v9_fits(monkeypatch):
    _limit(monkeypatch, 99)
    cc = (8, 9)
    c = hg.config("v6", 1000, 777, 520, cc)
    assert c["kernel"] == "hgemm_mma_t<128, 128, 64, 64, 3, true, 8, __half>"
    assert c["shared"] == 96 * KIB and c["block"] == (128,) and c["grid"] == (8 * 7,)
    assert "hgemm_v6 needs 144 KiB" in c["fallback"] and "(96 KiB)" in c["fallback"]
    assert hg.config("v6", 64, 64, 64, cc, dtype="bfloat16")["kernel"].endswith(
        "__nv_bfloat16>")
    assert hg.config("v5", 64, 64, 64, cc)["kernel"] == "hgemm_v5"      # 96 KiB: its own
    if hg.MMA10_MIN_STAGES > 2:
        with pytest.raises(hg.UnsupportedError, match="hgemm_v10 needs 144 KiB of shared memory"):
            hg.require("v10", cc)
    else:
        c = hg.config("v10", 4096, 4096, 4096, cc)
        assert c["kernel"] == "hgemm_mma10_t<128, 256, 2, true, 8, __half>"
    p = hg.v9_params(cc)
    assert hg.params_shared(p) <= 99 * KIB
    assert hg.config("v9", 4096, 4096, 4096, cc)["shared"] <= 99 * KIB
    cands = hg.candidates(cc)
    assert any(hg.params_shared(c) <= 99 * KIB for c in cands)
    for c in cands:
        hg.check_params("mma", c)
    # the module compiled by load() holds the instantiations these launches need
    exprs = hg._default_exprs(cc)
    assert hg.config("v6", 1, 1, 8, cc)["kernel"] in exprs
    assert hg.config("v9", 1, 1, 8, cc, dtype="bfloat16")["kernel"] in exprs


@pytest.mark.parametrize("name, cc, kib", [g for g in GPUS if g[2] >= 163])
def test_hgemm_unchanged_where_it_fits(monkeypatch, name, cc, kib):
    """The A100 and the H100 launch exactly what they launched before the fallbacks."""
    _limit(monkeypatch, kib)
    for v in ("v6", "v10"):
        c = hg.config(v, 4096, 4096, 4096, cc)
        assert c["kernel"] == f"hgemm_{v}" and "fallback" not in c
    want = hg.DEFAULT_SM90 if cc == (9, 0) else hg.DEFAULT_MMA10
    assert hg.v9_params(cc) == want
    assert len(hg.candidates(cc)) == 4


def test_hgemm_t4_ladder_fits_64_kib(monkeypatch):
    _limit(monkeypatch, 64)
    cc = (7, 5)
    assert _ladder(cc) == ["v1", "v2", "v3", "v4", "v9"]
    assert hg.runnable(cc, quiet=True) == _ladder(cc)
    assert hg.config("v9", 4096, 4096, 4096, cc)["shared"] == 32 * KIB
    assert all(hg.params_shared(c) <= 64 * KIB for c in hg.candidates(cc))


def test_hgemm_runnable_prints_each_skipped_version(monkeypatch, capsys):
    _limit(monkeypatch, 99)
    names = hg.runnable((8, 9))
    out = capsys.readouterr().out
    assert "v7: skipped: hgemm_v7 needs compute capability 9.0 exactly" in out
    if hg.MMA10_MIN_STAGES > 2:
        assert names == ["v1", "v2", "v3", "v4", "v5", "v6", "v9"]
        assert "v10: skipped: hgemm_v10 needs 144 KiB of shared memory per block, this GPU " \
               "allows 99 KiB" in out


@pytest.mark.simulator
def test_hgemm_launch_refuses_before_compiling(monkeypatch):
    """launch() on an L4 refuses v10 with the message, before any module is touched."""
    _limit(monkeypatch, 99)

    class L4Module:
        cc, sm90a, exprs = (8, 9), False, ()

    A, B, C = (np.zeros(s, np.float16) for s in ((64, 64), (64, 64), (64, 64)))
    if hg.MMA10_MIN_STAGES > 2:
        with pytest.raises(hg.UnsupportedError, match="needs 144 KiB of shared memory per "
                           "block, this GPU allows 99 KiB"):
            hg.launch(L4Module(), "v10", A, B, C)
    with pytest.raises(hg.UnsupportedError, match="needs 96 KiB of shared memory per block, "
                       "this GPU allows 64 KiB"):
        _limit(monkeypatch, 64)
        hg.launch(L4Module(), "v9", A, B, C, params=hg.FALLBACKS["v6"][0])


# ============================================================================ igemm (CPU)

def test_igemm_128x256_versions_fall_back_on_99_kib():
    assert ig.config("igemm_v3", 4096, 4096).shared == 144 * KIB
    assert ig.kernel_for("igemm_v3", 163 * KIB) == "igemm_v3"
    assert ig.kernel_for("igemm_v3", 99 * KIB) == "igemm_v2"
    assert ig.kernel_for("fp8gemm_v2", 99 * KIB) == "fp8gemm_v1"
    assert ig.kernel_for("igemm_v2", 99 * KIB) == "igemm_v2"
    assert ig.kernel_for("igemm_v1", 64 * KIB) == "igemm_v1"
    with pytest.raises(cb.LaunchError, match="igemm_v3 needs 144 KiB of shared memory per block, "
                       "this GPU allows 64 KiB"):
        ig.kernel_for("igemm_v3", 64 * KIB)


# ============================================================================ on a GPU

SHAPES = [(1, 1, 8), (127, 129, 72), (1000, 777, 520), (300, 600, 192), (512, 512, 256)]


def _operands(M, N, K, dtype, rng):
    import cupy as cp
    import torch

    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "float16":
        return (cp.asarray(a, dtype=cp.float16), cp.asarray(b, dtype=cp.float16),
                cp.full((M, N), cp.nan, cp.float16))
    return (torch.tensor(a, device="cuda").bfloat16(), torch.tensor(b, device="cuda").bfloat16(),
            torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16))


@gpu
@gpu
@pytest.mark.parametrize("name, cc, kib", [("L4", (8, 9), 99), ("T4", (7, 5), 64)])
def test_hgemm_ladder_under_a_smaller_limit(monkeypatch, capsys, name, cc, kib):
    """The ladder of a GPU with ``kib`` KiB per block, launched here (compiled for this GPU's
    architecture; the launch configurations and the shared-memory limits are the small GPU's)."""
    if cb.cc() < cc:
        pytest.skip(f"this GPU ({cb.cc()}) cannot run {name}'s kernels")
    _limit(monkeypatch, kib)
    mod = hg.load(cc)
    rng = np.random.default_rng(5)
    ran = []
    for v in _ladder(cc):
        try:
            hg.require(v, cc)
        except hg.UnsupportedError as e:
            assert SMEM_REFUSAL.search(str(e)), e
            continue
        for dt in ("float16", "bfloat16") if cc >= (8, 0) and v in hg.BF16 else ("float16",):
            for M, N, K in SHAPES:
                A, B, C = _operands(M, N, K, dt, rng)
                cfg = hg.launch(mod, v, A, B, C)
                assert cfg["shared"] <= kib * KIB
                hg.check(C, A, B, name=f"{name} {v} {dt} {M}x{N}x{K} ({cfg['kernel']})")
        ran.append(v)
    assert ran == hg.runnable(cc, quiet=True)
    if name == "L4":
        assert "v6" in ran and "note: hgemm_v6 needs 144 KiB" in capsys.readouterr().out


@gpu
@gpu
def test_hgemm_v10_two_stage_fallback():
    """v10 with 2 stages (96 KiB), once hgemm.cu accepts STAGES = 2 (MMA10_MIN_STAGES)."""
    if hg.MMA10_MIN_STAGES > 2:
        pytest.skip("hgemm.cu's gemm_mma10 needs 3+ stages: v10 has no 99 KiB variant yet")
    if cb.cc() < (8, 0):
        pytest.skip("v10 needs cc 8.0")
    p = hg.FALLBACKS["v10"][0]
    mod = hg.load(cb.cc(), (hg.template_name("mma", p), hg.template_name("mma", p, "bfloat16")))
    rng = np.random.default_rng(6)
    for dt in ("float16", "bfloat16"):
        for M, N, K in SHAPES:
            A, B, C = _operands(M, N, K, dt, rng)
            hg.launch(mod, "v9", A, B, C, params=p)
            hg.check(C, A, B, name=f"v10 2 stages {dt} {M}x{N}x{K}")


@gpu
@gpu
def test_igemm_fallback_under_99_kib(monkeypatch, capsys):
    import cupy as cp

    if cb.cc() < (8, 0):
        pytest.skip("igemm_v2/v3 need cc 8.0")
    _limit(monkeypatch, 99)
    rng = cp.random.default_rng(0)
    for M, N, K in ((130, 70, 160), (300, 520, 256)):
        A = rng.integers(-128, 128, (M, K), dtype=cp.int8)
        B = rng.integers(-128, 128, (N, K), dtype=cp.int8)
        exact = cp.asnumpy(A).astype(np.int64) @ cp.asnumpy(B).astype(np.int64).T
        assert (cp.asnumpy(ig.int8_matmul(A, B, version="igemm_v3")) == exact).all()
    assert "note: igemm_v3 needs 144 KiB" in capsys.readouterr().out
    if cb.cc() >= (8, 9):
        A8 = rng.integers(0, 0x70, (130, 160), dtype=cp.uint8)      # finite e4m3 bytes
        B8 = rng.integers(0, 0x70, (70, 160), dtype=cp.uint8)
        one = cp.ones(1, cp.float32)
        got = ig.fp8_matmul(A8, B8, one, one, version="fp8gemm_v2")
        monkeypatch.setattr(ig, "_optin", lambda: 227 * KIB)
        want = ig.fp8_matmul(A8, B8, one, one, version="fp8gemm_v1")
        assert (got == want).all()


@gpu
@gpu
def test_decode_attention_long_cache_opts_in_or_is_refused():
    import cupy as cp
    import torch

    kl = cb.load_launch("kvcache")
    B, H, D = 1, 2, 64
    L = 16384                         # 64 KiB of scores: past 48 KiB, the block must opt in
    kc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
    vc = cp.random.standard_normal((B, H, L, D), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((B, H, D), dtype=cp.float32).astype(cp.float16)
    out = cp.full((B, H * D), np.nan, cp.float16)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    static = int(kl._module().get("decode_attention_v2").attributes["shared_size_bytes"])
    if 4 * L + static > props["sharedMemPerBlockOptin"]:
        with pytest.raises(cb.LaunchError, match="at most L = "):
            kl.decode_attention(q, kc, vc, out, L)
        return
    kl.decode_attention(q, kc, vc, out, L)
    t = lambda x: torch.as_tensor(x, device="cuda").double()   # noqa: E731
    ref = torch.nn.functional.scaled_dot_product_attention(t(q)[:, :, None], t(kc), t(vc))
    torch.testing.assert_close(t(out), ref[:, :, 0].reshape(B, -1), atol=3e-3, rtol=3e-3)
    big = cp.zeros((1, 1, 70000, 8), cp.float16)          # 273 KiB of scores: no GPU has it
    with pytest.raises(cb.LaunchError, match="at most L = "):
        kl.decode_attention(cp.zeros((1, 1, 8), cp.float16), big, big,
                            cp.zeros((1, 8), cp.float16), 1)


# ============================================================================ attention (Ch. 9)

al = cb.load_launch("attention")
ATTN_REFUSAL = re.compile(r"attention_(bwd_v2|v3) needs (\d+) KiB of shared memory per block, "
                          r"this GPU allows (\d+) KiB")


def _attn_limit(monkeypatch, kib: int) -> None:
    """Pretend this machine's GPU lets a block opt into ``kib`` KiB (attention_launch)."""
    monkeypatch.setattr(al, "_optin", lambda: kib * KIB)
    monkeypatch.setattr(al, "_NOTED", set())


@pytest.mark.parametrize("name, cc, kib", GPUS)
def test_attention_every_config_fits(name, cc, kib):
    """Forward v3 fits every GPU (64 KiB at D = 128: a T4's limit exactly); backward v2 runs its
    own tiles from 163 KiB up and smaller ones below; v4 exists on the H100 only."""
    for D in al.HEAD_DIMS:
        for dt in ("f16", "bf16"):
            assert al.fwd_config("v3", 4, 1000, 1000, D, dt)["shared"] <= kib * KIB
            c = al.bwd_config("v2", 4, 1000, 1000, D, dt, optin=kib * KIB)["main"]
            assert c["shared"] <= kib * KIB, (name, D, c)
            assert ("fallback" in c) == (kib < 163), (name, D, c)
        if cc == (9, 0):
            assert al.fwd_config("v4", 4, 1000, 1000, D, "bf16")["shared"] <= kib * KIB


# ============================================================================ attention (GPU)

def _attn_reference(q, k, v, do, causal):
    """O, dQ, dK, dV in float64 (PyTorch's SDPA on float64 leaves: its math path)."""
    import torch

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return (o.detach(), *torch.autograd.grad(o, leaves, do.double()))


def _attn_rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-3 * ref.numel() ** 0.5))


@gpu
@gpu
@pytest.mark.parametrize("name, kib", [("L4", 99), ("T4", 64)])
def test_attention_smaller_tiles_under_a_smaller_limit(monkeypatch, capsys, name, kib):
    """Forward v3 and backward v2 with ``kib`` KiB per block: v3 its own kernel, v2 the smaller
    tiles bwd_config() picks (with the note printed once per kernel), both against float64."""
    import torch

    if cb.cc() < (8, 0):
        pytest.skip("the float16 / bfloat16 kernels are checked on a cc 8.0+ GPU here")
    _attn_limit(monkeypatch, kib)
    ran = set()
    for dt, tol in (("float16", 5e-3), ("bfloat16", 2e-2)):
        for D in al.HEAD_DIMS:
            for BH, Nq, Nk in ((3, 17, 17), (1, 130, 77), (2, 200, 333)):
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(Nq + D + causal)
                    mk = lambda n: torch.randn(BH, n, D, generator=g, device="cuda",  # noqa: E731
                                               dtype=getattr(torch, dt))
                    q, k, v, do = mk(Nq), mk(Nk), mk(Nk), mk(Nq)
                    O, dQ, dK, dV = _attn_reference(q, k, v, do, causal)
                    o, lse = al.forward(q, k, v, causal, "v3")
                    what = f"{name} {dt} D={D} {BH}x{Nq}x{Nk} causal={causal}"
                    assert _attn_rel(o, O) < tol, what
                    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
                    al.backward(q, k, v, o, lse, do, causal, "v2", out=grads)
                    for gr, ref, w in zip(grads, (dQ, dK, dV), ("dQ", "dK", "dV")):
                        assert _attn_rel(gr, ref) < 2 * tol, f"{what} {w}: {_attn_rel(gr, ref)}"
                    cfg = al.bwd_config("v2", BH, Nq, Nk, D, al.SHORT[dt])["main"]
                    assert cfg["shared"] <= kib * KIB and "fallback" in cfg
                    ran.add(cfg["kernel"])
    out = capsys.readouterr().out
    assert len(ran) == 4, ran                      # both head dimensions, both dtypes
    for kern in ran:
        assert out.count(f"running {kern} (") == 1, (kern, out)
    assert f"this GPU allows {kib} KiB" in out


@gpu
@gpu
def test_attention_refused_when_nothing_fits(monkeypatch):
    """48 KiB per block: no backward v2 tiles fit (the smallest needs 52.5 KiB at D = 128), nor
    forward v3 at D = 128 (64 KiB): refused with the shared memory needed, nothing launched."""
    import torch

    if cb.cc() < (8, 0):
        pytest.skip("needs a cc 8.0+ GPU for bfloat16")
    _attn_limit(monkeypatch, 48)
    q = torch.randn(2, 50, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(cb.LaunchError, match=ATTN_REFUSAL) as e:
        al.forward(q, q, q, version="v3")
    assert ATTN_REFUSAL.search(str(e.value)).groups() == ("v3", "64", "48")
    monkeypatch.setattr(al, "_optin", lambda: 227 * KIB)
    o, lse = al.forward(q, q, q, version="v3")
    _attn_limit(monkeypatch, 48)
    with pytest.raises(cb.LaunchError, match=ATTN_REFUSAL) as e:
        al.backward(q, q, q, o, lse, o, version="v2")
    assert ATTN_REFUSAL.search(str(e.value)).groups() == ("bwd_v2", "145", "48")
