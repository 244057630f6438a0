"""Chapter 9: the Numba FlashAttention twin (simulator), the launch description and argument checks
of the CUDA C++ kernels, the graders ex09_1..ex09_7 (reference passes, stub fails, wrong answers
generated from the reference fail with their hint) and, on a GPU, every CUDA C++ version and the
PyTorch op against float64 references and autograd."""
# ruff: noqa: I001  (cudabook must be imported before numba.cuda)

import math
import re

import numpy as np
import pytest

import cudabook as cb  # first: decides GPU or simulator mode
from cudabook import env
from cudabook.graders import GradeError, ex09_1, ex09_2, ex09_3, ex09_4, ex09_5, ex09_6, ex09_7
from cudabook.graders.ch09 import attention_reference, merge_reference, partial_softmax
from solution_cells import Solution

at = cb.load_numba("attention")
al = cb.load_launch("attention")
SOL = Solution("09")
gpu = pytest.mark.gpu
# a missing barrier reads tiles nobody wrote in the simulator; on a GPU the grader's simulate()
# second opinion catches it (tested through the stricter lane)
SIM_ONLY = pytest.mark.skipif(cb.HAS_GPU, reason="simulator-only wrong answer")


# ============================================================================ references
def test_attention_reference_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (5, 7, 7))
    for causal in (False, True):
        o, lse = attention_reference(q, k, v, causal)
        t = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), is_causal=causal).numpy()
        np.testing.assert_allclose(o, t, atol=1e-12)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(8)
        if causal:
            s = np.where(np.tri(5, 7, dtype=bool), s, -np.inf)
        np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), atol=1e-12)


def test_causal_alignment_top_left_and_bottom_right():
    """The kernels' mask is top-left (j <= i, torch's is_causal); a decode step needs it shifted
    by Nk - Nq (bottom-right, torch's causal_lower_right), which for one query is no mask."""
    torch = pytest.importorskip("torch")
    bias = pytest.importorskip("torch.nn.attention.bias")
    rng = np.random.default_rng(3)
    for nq, nk in ((1, 6), (3, 7), (5, 5)):
        q, k, v = (rng.standard_normal((2, n, 4)) for n in (nq, nk, nk))
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        top_left, _ = attention_reference(q, k, v, causal=True)
        bottom_right, _ = attention_reference(q, k, v, causal=True, shift=nk - nq)
        np.testing.assert_allclose(top_left, sdpa(tq, tk, tv, is_causal=True).numpy(), atol=1e-12)
        np.testing.assert_allclose(bottom_right, sdpa(tq, tk, tv, attn_mask=bias.causal_lower_right(
            nq, nk)).numpy(), atol=1e-12)
        if nq == nk:                                   # the two conventions agree
            np.testing.assert_allclose(top_left, bottom_right, atol=1e-12)
    q, k, v = (rng.standard_normal((1, n, 4)) for n in (1, 6, 6))
    np.testing.assert_allclose(attention_reference(q, k, v, causal=True)[0][0, 0], v[0, 0])
    np.testing.assert_allclose(attention_reference(q, k, v, causal=True, shift=5)[0],
                               attention_reference(q, k, v)[0], atol=1e-12)


def test_kernel_comments_carry_no_timings():
    """Timings live in reports/benchmarks.json, not in the source the book shows."""
    timing = re.compile(r"TFLOP/s|GB/s|\b\d+(\.\d+)?\s*(us|µs|ms)\b|timed on an? [AH]\d+", re.I)
    for name in ("attention_forward.cu", "attention_backward.cu", "attention.cuh"):
        for n, line in enumerate((cb.KERNELS_DIR / name).read_text().splitlines(), 1):
            comment = line.split("//", 1)[1] if "//" in line else ""
            assert not timing.search(comment), f"{name}:{n}: a timing in a comment: {line.strip()}"


def test_merge_of_partials_is_the_whole():
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((4, 9)) * 5, rng.standard_normal((9, 3))
    whole = partial_softmax(s, v)
    merged = merge_reference(*partial_softmax(s[:, :4], v[:4]), *partial_softmax(s[:, 4:], v[4:]))
    for a, b in zip(merged, whole):
        np.testing.assert_allclose(a, b, rtol=1e-12)


# ============================================================================ Numba twin
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 17, 40, 16), (1, 33, 5, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_numba_flash_fwd_fp32(shape, causal):
    BH, Nq, Nk, D = shape
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((BH, n, D)).astype(np.float32) for n in (Nq, Nk, Nk))
    o, lse = cb.empty_nan((BH, Nq, D)), cb.empty_nan((BH, Nq))
    if env.SIM:
        at.launch_numba(q, k, v, o, lse, causal)
    else:
        from numba import cuda

        dev = [cuda.to_device(x) for x in (q, k, v, o, lse)]
        at.launch_numba(*dev, causal=causal)
        o, lse = dev[3].copy_to_host(), dev[4].copy_to_host()
    ref, rl = attention_reference(q, k, v, causal)
    cb.check(o, ref, atol=1e-5, rtol=1e-4)
    cb.check(lse, rl, atol=1e-5, rtol=1e-5)


def test_numba_launcher_refuses_bad_input():
    q = np.zeros((2, 5, 8), np.float32)
    o, lse = np.zeros((2, 5, 8), np.float32), np.zeros((2, 5), np.float32)
    if cb.HAS_GPU:
        pytest.skip("host arrays are refused on a GPU before the shapes are looked at")
    with pytest.raises(TypeError, match="dtype"):
        at.launch_numba(q.astype(np.float64), q, q, o, lse)
    with pytest.raises(ValueError, match="k and v"):
        at.launch_numba(q, q, np.zeros((2, 6, 8), np.float32), o, lse)
    with pytest.raises(ValueError, match="D <= 128"):
        at.launch_numba(*(np.zeros((1, 2, 130), np.float32),) * 3, np.zeros((1, 2, 130),
                                                                            np.float32),
                        np.zeros((1, 2), np.float32))


# ============================================================================ launch description
def test_tiles_match_the_cu_files():
    """The launchers' tile tables must be the ones the kernels were compiled with."""
    fwd = cb.kernel_source("attention_forward.cu")
    found = {int(d): (int(br), int(bc)) for d, br, bc in
             re.findall(r"ATTN_V3\(attention_v3_bf16_d\d+, __nv_bfloat16, (\d+), (\d+), (\d+)\)",
                        fwd)}
    assert found == al.V3_TILES
    bwd = cb.kernel_source("attention_backward.cu")
    found = {int(d): (int(bc), int(br)) for d, bc, br in
             re.findall(r"ATTN_BWD_V2\(bf16, __nv_bfloat16, (\d+), (\d+), (\d+)\)", bwd)}
    assert found == al.BWD_V2_TILES
    found = {int(d): sched for d, sched in
             re.findall(r"ATTN_V4\(attention_v4_bf16_d(\d+), __nv_bfloat16, \d+, (\w+)\)", fwd)}
    assert found == {64: "true", 128: "true"}          # both with overlap and ping-pong
    assert re.search(r"flash_wgmma<T, D, (\d+), (\d+), SCHED, SCHED>", fwd).groups() == \
        (str(al.V4_TILES[64]), str(al.V4_STAGES))
    for which in ("forward", "backward"):
        src = cb.kernel_source(f"attention_{which}.cu")
        for name in al.kernel_names(which):
            stem = re.sub(r"_(f16|bf16)(_d\d+)?(_\d+x\d+s\d)?$|_d\d+$", "", name)
            assert stem in src, name


def test_bwd_v2_smaller_tiles_match_the_cu_file():
    """BWD_V2_FIT lists the ATTN_BWD_V2_FIT instantiations, both dtypes, largest first: each
    needs less shared memory than the one before, the own tiles need more than an L4's 99 KiB,
    the first smaller ones fit 99 KiB and the last a T4's 64 KiB."""
    bwd = cb.kernel_source("attention_backward.cu")
    for tn in ("f16", "bf16"):
        found: dict[int, list] = {}
        for d, bc, br, st in re.findall(rf"ATTN_BWD_V2_FIT\({tn}, \w+, (\d+), (\d+), (\d+), "
                                        r"(\d+)\)", bwd):
            found.setdefault(int(d), []).append((int(bc), int(br), int(st)))
        assert found == al.BWD_V2_FIT, tn
    for D, fits in al.BWD_V2_FIT.items():
        sizes = [al.bwd_v2_shared(D, *al.BWD_V2_TILES[D])] + [al.bwd_v2_shared(D, *f) for f in fits]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
        assert sizes[0] > 99 * 1024 and sizes[1] <= 99 * 1024 and sizes[-1] <= 64 * 1024
    assert al.bwd_v2_shared(64, 128, 128) == 130 * 1024      # as the kernel's comment says
    assert al.bwd_v2_shared(128, 128, 64) == 145 * 1024
    assert al.bwd_v2_name("bf16", 128, 64, 64, 1) == "attention_bwd_v2_bf16_d128_64x64s1"
    assert al.bwd_v2_name("f16", 64, 128, 128, 2) == "attention_bwd_v2_f16_d64"


@pytest.mark.parametrize("D", [64, 128])
def test_bwd_config_runs_the_largest_tiles_that_fit(D):
    kib = 1024
    own = al.bwd_config("v2", 2, 300, 300, D, "f16", optin=227 * kib)["main"]
    assert own["kernel"] == f"attention_bwd_v2_f16_d{D}" and "fallback" not in own
    assert al.bwd_config("v2", 2, 300, 300, D, "f16", optin=163 * kib)["main"] == own
    for limit, (bc, br, st) in zip((99, 64), al.BWD_V2_FIT[D]):
        c = al.bwd_config("v2", 2, 300, 300, D, "bf16", optin=limit * kib)["main"]
        assert c["kernel"] == al.bwd_v2_name("bf16", D, bc, br, st)
        assert c["block"] == (2 * bc,) and c["grid"] == (cb.ceil_div(300, bc), 2)
        assert c["shared"] == al.bwd_v2_shared(D, bc, br, st) <= limit * kib
        assert c["fallback"].startswith(f"attention_bwd_v2 at D = {D} needs "
                                        f"{own['shared'] // kib} KiB of shared memory per block, "
                                        f"this GPU allows {limit} KiB: running {c['kernel']}")
    # nothing fits 48 KiB: the own configuration, which backward() refuses with its size
    c = al.bwd_config("v2", 2, 300, 300, D, "f16", optin=48 * kib)["main"]
    assert c == own


def test_configs_and_flops():
    c = al.fwd_config("v3", 128, 4097, 4097, 128, "bf16")
    assert c["grid"] == (33, 128) and c["block"] == (128,) and c["shared"] == 256 * 128 * 2
    c = al.bwd_config("v2", 3, 1000, 77, 64, "f16")
    assert c["main"]["grid"] == (1, 3) and c["main"]["block"] == (256,)
    assert c["convert"]["grid"] == (cb.ceil_div(3 * 1000 * 64, 256),)
    assert al.fwd_config("v1", 2, 17, 33, 64)["scores"]["grid"] == (2, 3, 2)
    assert al.flops(1, 10, 20, 64) == 4 * 10 * 20 * 64
    assert al.flops(1, 10, 20, 64, causal=True, backward=True) == 2.5 * 4 * 10 * 20 * 64 / 2
    with pytest.raises(ValueError, match="unknown forward version"):
        al.fwd_config("v9", 1, 1, 1, 64)
    c = al.fwd_config("v4", 128, 4097, 4097, 128, "bf16")
    assert c["grid"] == (33, 128) and c["block"] == (384,)
    assert c["shared"] == (128 + 4 * 128) * 128 * 2 + 1024 < 227 * 1024
    assert al.fwd_config("v4", 2, 17, 17, 64, "bf16", overlap=False)["kernel"] == \
        "attention_v4_nolap_bf16_d64"
    with pytest.raises(ValueError, match="bfloat16 only"):
        al.fwd_config("v4", 2, 17, 17, 128, "f16", overlap=False)


def test_v4_refuses_every_gpu_but_hopper():
    assert al.hopper_problem((9, 0)) is None
    for cc in ((7, 5), (8, 0), (8, 9), (10, 0), (12, 0)):
        msg = al.hopper_problem(cc)
        assert f"this GPU is {cc[0]}.{cc[1]}" in msg and "version='v3'" in msg
        msg = al.hopper_problem(cc, "attention_bwd_v3", "v2")
        assert msg.startswith("attention_bwd_v3") and "version='v2'" in msg


def test_bwd_v3_config_and_op_versions():
    """attention_bwd_v3's plan: one block per 128 keys of each key/value head, statistics rows
    padded to whole query tiles, the shared memory the .cu file's comment gives."""
    for D, br in ((64, 128), (128, 64)):
        cfg = al.bwd_config("v3", 32, 1000, 700, D, "bf16", group=4)
        main = cfg["main"]
        assert main["grid"] == (6, 8) and main["block"] == (384,) and main["br"] == br
        assert main["kernel"] == f"attention_bwd_v3_bf16_d{D}"
        assert main["shared"] == al.bwd_v3_shared(D) <= 227 * 1024
        assert cfg["preprocess"]["nq_pad"] == -(-1000 // br) * br
        assert cfg["convert"]["kernel"] == "attention_bwd_v3_convert_bf16"
        # one thread per 16-byte chunk of each 8192-float query tile
        assert cfg["convert"]["grid"] == (-(-1000 // br) * 32 * 2048 // 256,)
    src = (cb.KERNELS_DIR / "attention_backward.cu").read_text()
    for D, br in al.BWD_V3_BR.items():          # dV issued early at D = 128 only
        assert f"ATTN_BWD_V3(bf16, __nv_bfloat16, {D}, {br}, {str(D == 128).lower()})" in src
    assert "193 KiB at D = 64" in src and al.bwd_v3_shared(64) // 1024 == 193
    names = al.kernel_names("backward")
    assert "attention_bwd_v3_f16_d128" in names and "attention_bwd_v3_preprocess_bf16" in names
    assert al.op_versions("bfloat16", (9, 0)) == ("v4", "v3")
    assert al.op_versions("float16", (8, 0)) == ("v3", "v2")
    assert al.op_versions("float32", (9, 0)) == ("v2", "v1")


def test_check_qkv_messages():
    torch = pytest.importorskip("torch")
    t = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt)  # noqa: E731
    chk = lambda *a, **kw: al.check_qkv(*a, dtypes=("float16", "bfloat16"), device=False, **kw)  # noqa: E731
    assert chk(t(2, 4, 100, 64), t(2, 4, 77, 64), t(2, 4, 77, 64)) == (8, 100, 77, 64)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        chk(t(2, 5, 64), t(2, 5, 64), t(2, 6, 64))
    with pytest.raises(ValueError, match="q has 2 heads and k 3: grouped-query"):
        chk(t(2, 5, 64), t(3, 5, 64), t(3, 5, 64))
    with pytest.raises(ValueError, match="same batch dimension"):
        chk(t(2, 4, 5, 64), t(3, 4, 5, 64), t(3, 4, 5, 64))
    # grouped-query heads: the key/value heads must divide the query heads
    assert chk(t(2, 8, 5, 64), t(2, 2, 7, 64), t(2, 2, 7, 64), gqa=True) == (16, 5, 7, 64)
    assert al.group_of(t(2, 8, 5, 64), t(2, 2, 7, 64)) == 4
    with pytest.raises(ValueError, match="must divide the query heads"):
        chk(t(2, 8, 5, 64), t(2, 3, 5, 64), t(2, 3, 5, 64), gqa=True)
    with pytest.raises(ValueError, match="head dimension 96 is not supported"):
        chk(*(t(2, 5, 96),) * 3)
    with pytest.raises(ValueError, match="same head dimension"):
        chk(t(2, 5, 64), t(2, 5, 128), t(2, 5, 128))
    with pytest.raises(TypeError, match="float32 is not supported"):
        chk(*(t(2, 5, 64, dt=torch.float32),) * 3)
    with pytest.raises(TypeError, match="share one dtype"):
        chk(t(2, 5, 64), t(2, 5, 64, dt=torch.float16), t(2, 5, 64))
    with pytest.raises(ValueError, match="C-contiguous"):
        chk(t(2, 64, 5).transpose(1, 2), t(2, 5, 64), t(2, 5, 64))
    with pytest.raises(ValueError, match="expected \\(B, H, N, D\\)"):
        chk(t(5, 64), t(5, 64), t(5, 64))
    with pytest.raises(TypeError, match="GPU array"):
        al.check_qkv(t(2, 5, 64), t(2, 5, 64), t(2, 5, 64), dtypes=("bfloat16",))


# ============================================================================ ex09_1
def test_ex09_1_reference_passes(capsys):
    ex09_1(SOL.get("ex09.1", "merge"))
    assert capsys.readouterr().out == "PASS ex09.1\n"


@pytest.mark.parametrize("edits, hint", [
    ([("    l = a1 * l1 + a2 * l2\n", "    l = l1 + l2\n"),
      ("    o = a1[:, None] * o1 + a2[:, None] * o2\n", "    o = o1 + o2\n")],
     "the running-max rescale"),
    ([("base = np.where(np.isneginf(m), np.float32(0), m)", "base = np.zeros_like(m)")],
     "overflows"),
    ([("base = np.where(np.isneginf(m), np.float32(0), m)", "base = m")], "empty partial"),
    ([("m = np.maximum(m1, m2)", "m = np.minimum(m1, m2)")], "max\\(m1, m2\\)"),
    # o rescaled with the other side's factor
    ([("    o = a1[:, None] * o1 + a2[:, None] * o2\n",
       "    o = a2[:, None] * o1 + a1[:, None] * o2\n")],
     "o must be rescaled exactly as l"),
    # a factor per row multiplied into (R, D) without a new axis
    ([("    o = a1[:, None] * o1 + a2[:, None] * o2\n", "    o = a1 * o1 + a2 * o2\n")],
     "broadcast.*a1\\[:, None\\]"),
])
def test_ex09_1_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_1(SOL.get("ex09.1", "merge", edits=edits))


def test_ex09_1_stub_fails():
    def stub(*a):
        raise NotImplementedError("ex09.1")
    with pytest.raises(GradeError, match="not implemented yet"):
        ex09_1(stub)


# ============================================================================ ex09_2 (GPU)
@gpu
def test_ex09_2_reference_passes(capsys):
    ex09_2(SOL.get("ex09.2", "merge_splits_src"))
    assert capsys.readouterr().out == "PASS ex09.2\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    ([("float base = M == NEG_INF ? 0.f : M;", "float base = M;")], "every split empty|only empty"),
    ([("L += __expf(m[s * R + r] - base) * l[s * R + r];", "L += l[s * R + r];"),
      ("acc += __expf(m[s * R + r] - base) * o", "acc += o")], "its own max"),
    ([("c < D; c += blockDim.x", "c <= D; c += blockDim.x")], "past the end"),
    ([("base + logf(L)", "logf(L)")], "lse = M \\+ log"),
    ([("    float inv = L > 0.f ? 1.f / L : 0.f;\n", "    float inv = 1.f;\n")],
     "then out = O / L"),
])
def test_ex09_2_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_2(SOL.get("ex09.2", "merge_splits_src", edits=edits))


def test_ex09_2_needs_a_gpu_or_fails_its_stub():
    src = re.sub(r"// BEGIN SOLUTION ex09\.2.*// END SOLUTION", "",
                 SOL.get("ex09.2", "merge_splits_src"), flags=re.S)
    with pytest.raises(GradeError, match="needs a CUDA GPU|never written"):
        ex09_2(src)


# ============================================================================ ex09_3
def test_ex09_3_reference_passes(capsys):
    ex09_3(SOL.get("ex09.3", "flash_fwd"))
    assert capsys.readouterr().out == "PASS ex09.3\n"


LOAD_GUARD = ("            if j0 + jj < Nk:\n                Ks[jj, c] = k[bh, j0 + jj, c]",
              "            if True:\n                Ks[jj, c] = k[bh, j0 + jj, c]")
NO_RESCALE = ("        alpha = math.exp(m - m_new)\n", "        alpha = float32(1)\n")


#: a per-query kernel without tiles: two passes over K straight from global memory (right values)
UNTILED = """    bh, row = cuda.blockIdx.y, cuda.blockIdx.x * BR + cuda.threadIdx.x
    Nq, D, Nk = q.shape[1], q.shape[2], k.shape[1]
    if row < Nq:
        m = NEG_INF
        for j in range(Nk):
            x = float32(0)
            for c in range(D):
                x += q[bh, row, c] * k[bh, j, c]
            m = max(m, x * scale)
        l = float32(0)
        for c in range(D):
            acc[c] = float32(0)
        for j in range(Nk):
            x = float32(0)
            for c in range(D):
                x += q[bh, row, c] * k[bh, j, c]
            p = math.exp(x * scale - m)
            l += p
            for c in range(D):
                acc[c] += p * v[bh, j, c]
        for c in range(D):
            o[bh, row, c] = acc[c] / l
        lse[bh, row] = m + math.log(l)
"""
#: the tiled kernel in two passes: the max over every tile first, then the sums (K read twice)
TWO_PASS = ("    m, l = NEG_INF, float32(0)\n    for j0 in range(0, Nk, BC):\n",
            "    m, l = NEG_INF, float32(0)\n"
            "    for j0 in range(0, Nk, BC):\n"
            "        cuda.syncthreads()\n"
            "        for e in range(tid, BC * D, BR):\n"
            "            jj, c = e // D, e % D\n"
            "            if j0 + jj < Nk:\n"
            "                Ks[jj, c] = k[bh, j0 + jj, c]\n"
            "        cuda.syncthreads()\n"
            "        for jj in range(BC):\n"
            "            if j0 + jj < Nk:\n"
            "                x = float32(0)\n"
            "                for c in range(D):\n"
            "                    x += q[bh, qr, c] * Ks[jj, c]\n"
            "                m = max(m, x * scale)\n"
            "    for j0 in range(0, Nk, BC):\n")
#: library code inside the kernel: the simulator runs it, a GPU cannot compile it
WITH_NUMPY = """    bh, row = cuda.blockIdx.y, cuda.blockIdx.x * BR + cuda.threadIdx.x
    if row < q.shape[1]:
        x = (k[bh] @ q[bh, row]) * scale
        p = np.exp(x - x.max())
        o[bh, row] = (p @ v[bh]) / p.sum()
        lse[bh, row] = x.max() + math.log(p.sum())
"""


def _replace_region(ex, new):
    """The edit that replaces ``ex``'s whole solution region by ``new`` (a wrong answer)."""
    body, begin = SOL.source(ex), f"    ### BEGIN SOLUTION {ex}\n"
    i, j = body.index(begin), body.index("    ### END SOLUTION")
    return [(body[i:j], begin + new)]


@pytest.mark.parametrize("edits, hint", [
    ([NO_RESCALE], "rescaled by exp\\(m_old - m_new\\)"),
    ([NO_RESCALE, ("p = math.exp(s[jj] - m_new)", "p = math.exp(s[jj])"),
      ("lse[bh, row] = m + math.log(l)", "lse[bh, row] = math.log(l)")], "exp\\(s\\) overflows"),
    pytest.param([LOAD_GUARD], "read past the end of a sequence", marks=SIM_ONLY),
    pytest.param([("        cuda.syncthreads()\n", "", 2)], "syncthreads", marks=SIM_ONLY),
    # lse without the max
    ([("lse[bh, row] = m + math.log(l)", "lse[bh, row] = math.log(l)")], "lse = m \\+ log\\(l\\)"),
    # the dot product over MAXD instead of D: right only for D = 64
    pytest.param([("for c in range(D):\n                    x += q[bh, qr, c] * Ks[jj, c]",
                   "for c in range(MAXD):\n                    x += q[bh, qr, c] * Ks[jj, c]")],
                 "past the head dimension", marks=SIM_ONLY),
    # structure (cb.trace): right values, not the kernel the exercise asks for
    (_replace_region("ex09.3", UNTILED), "every thread reads K from global memory itself"),
    ([TWO_PASS], "read 2 times from global memory by one thread.*passes over the keys"),
    ([("                acc[c] += p * Vs[jj, c]",
       "                acc[c] += p * v[bh, min(j0 + jj, Nk - 1), c]")],
     "every thread reads V from global memory itself"),
    # no zeros past Nk: V's tail rows are read uninitialised (times p = 0)
    ([("            else:\n                Ks[jj, c] = float32(0)\n                Vs[jj, c] = "
       "float32(0)\n", "")], "before any thread of the block wrote it.*fill the rows"),
    # a barrier only the threads with a query reach
    ([("        cuda.syncthreads()\n        mt = NEG_INF\n",
       "        if row < Nq:\n            cuda.syncthreads()\n        mt = NEG_INF\n")],
     "different numbers of cuda.syncthreads.*must reach every"),
    (_replace_region("ex09.3", WITH_NUMPY), "the @ operator.*a GPU cannot compile it"),
])
def test_ex09_3_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_3(SOL.get("ex09.3", "flash_fwd", edits=edits))


def test_ex09_3_stub_fails():
    from numba import cuda

    @cuda.jit
    def stub(q, k, v, o, lse, scale):
        raise NotImplementedError("ex09.3")
    with pytest.raises(GradeError, match="not implemented yet|never written"):
        ex09_3(stub)


# ============================================================================ ex09_4
def test_ex09_4_reference_passes(capsys):
    ex09_4(SOL.get("ex09.4", "flash_fwd_causal"))
    assert capsys.readouterr().out == "PASS ex09.4\n"


@pytest.mark.parametrize("edits, hint", [
    ([("j0 + jj <= row:", "j0 + jj < row:")],
     "off by one on the diagonal: the diagonal is masked|is the diagonal masked"),
    ([("j0 + jj <= row:", "j0 + jj <= row + 1:")], "off by one on the diagonal: the mask lets"),
    ([("kv_end = min(Nk, (cuda.blockIdx.x + 1) * BR)", "kv_end = Nk")], "skipped, not loaded"),
    # the loop stops a tile early: block 0 sees no key at all
    ([("kv_end = min(Nk, (cuda.blockIdx.x + 1) * BR)", "kv_end = min(Nk, cuda.blockIdx.x * BR)")],
     "own diagonal tile"),
    # the bottom-right aligned mask (a decode step's), loop bound moved with it
    ([("kv_end = min(Nk, (cuda.blockIdx.x + 1) * BR)",
       "kv_end = min(Nk, (cuda.blockIdx.x + 1) * BR + Nk - Nq)"),
      ("j0 + jj <= row:", "j0 + jj <= row + Nk - Nq:")], "bottom-right aligned mask"),
    # per query, straight from global memory, up to the diagonal
    (_replace_region("ex09.4", UNTILED.replace("range(Nk)", "range(min(Nk, row + 1))")),
     "every thread reads K from global memory itself"),
])
def test_ex09_4_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_4(SOL.get("ex09.4", "flash_fwd_causal", edits=edits))


def test_ex09_4_hint_when_the_diagonal_is_masked_on_a_gpu():
    """On a GPU, log(0) is -inf and 0 / 0 NaN (the simulator raises instead): a kernel that masks
    the diagonal leaves row 0 NaN; alone (Nq = 1) the whole output is NaN."""
    from cudabook.graders.ch09 import _fwd_hint

    rng = np.random.default_rng(3)
    for Nq in (1, 17):
        q, k, v = (rng.standard_normal((1, Nq, 8)).astype(np.float32) for _ in range(3))
        got, _ = attention_reference(q, k, v, True, shift=-1)
        got[:, 0] = np.nan
        assert "diagonal" in _fwd_hint(got, None, None, q, k, v, True, "BH=1")


# ============================================================================ ex09_5
def test_ex09_5_reference_passes(capsys):
    ex09_5(SOL.get("ex09.5", "bwd_tile"))
    assert capsys.readouterr().out == "PASS ex09.5\n"


@pytest.mark.parametrize("edits, hint", [
    ([("p = math.exp(s * scale - lse[i])", "p = math.exp(s * scale)")],
     "ignores the logsumexp"),
    ([("dp[i, j] = g\n", "dp[i, j] = g * p\n")], "dP = dO V\\^T"),
    ([("p = math.exp(s * scale - lse[i])", "p = math.exp((s - lse[i]) * scale)")],
     "scale before subtracting lse"),
    pytest.param([("    if j < k.shape[0]:\n", "    if True:\n")], "guard with j < k.shape|"
                 "index out of range", marks=SIM_ONLY),
    # dv summed into without zeroing it first (the grader's outputs start as NaN)
    ([("        for c in range(D):\n            dv[j, c] = float32(0)\n", "")],
     "without setting it to 0 first"),
    # dp stored transposed
    pytest.param([("dp[i, j] = g\n", "dp[j, i] = g\n")], "dp\\[i, j\\] for query i and key j",
                 marks=SIM_ONLY),
    # lse divided out after the exp: overflows for scores near 800
    ([("p = math.exp(s * scale - lse[i])", "p = math.exp(s * scale) / math.exp(lse[i])")],
     "subtract lse inside the exp"),
    # a library call inside the kernel
    ([("                s += q[i, c] * k[j, c]\n", ""),
      ("            p = math.exp(s * scale - lse[i])",
       "            p = math.exp(np.dot(q[i], k[j]) * scale - lse[i])")],
     "np.dot \\(NumPy\\).*a GPU cannot compile it"),
])
def test_ex09_5_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_5(SOL.get("ex09.5", "bwd_tile", edits=edits))


# ============================================================================ GPU: CUDA C++
def _torch_ref(q, k, v, do, causal):
    import torch

    Q, K, V = (x.double().requires_grad_() for x in (q, k, v))
    S = Q @ K.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).triu(1),
                          -math.inf)
    O = torch.softmax(S, -1) @ V
    return (O.detach(), torch.logsumexp(S, -1).detach(),
            *torch.autograd.grad(O, (Q, K, V), do.double()))


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-3 * math.sqrt(b.numel())))


@gpu
@pytest.mark.parametrize("dt, fwd, bwd, tol", [("float32", "v1", "v1", 1e-4),
                                               ("float32", "v2", "v1", 1e-4),
                                               ("bfloat16", "v3", "v2", 2e-2),
                                               ("float16", "v3", "v2", 5e-3)])
@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 17, 17), (1, 130, 77), (2, 200, 333)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_versions(dt, fwd, bwd, tol, shape, D, causal):
    import torch

    if dt == "bfloat16" and cb.cc() < (8, 0):
        pytest.skip("bfloat16 needs compute capability 8.0")
    BH, Nq, Nk = shape
    g = torch.Generator(device="cuda").manual_seed(Nq + D)
    mk = lambda n: torch.randn(BH, n, D, generator=g, device="cuda", dtype=getattr(torch, dt))  # noqa: E731
    q, k, v, do = mk(Nq), mk(Nk), mk(Nk), mk(Nq)
    O, lse, dQ, dK, dV = _torch_ref(q, k, v, do, causal)
    o = torch.full_like(q, float("nan"))
    lo = torch.full(q.shape[:-1], float("nan"), device="cuda")
    al.forward(q, k, v, causal, fwd, out=(o, lo))
    assert _rel(o, O) < tol and _rel(lo, lse) < 1e-4
    grads = al.backward(q, k, v, o, lo, do, causal, bwd)
    for gr, r in zip(grads, (dQ, dK, dV)):
        assert _rel(gr, r) < 2 * tol


@gpu
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 17, 17), (2, 1000, 1000), (1, 4097, 4097),
                                   (3, 150, 77), (3, 1, 300)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_v4(dt, shape, D, causal):
    """attention_v4 (wgmma, TMA) against float64 on ragged lengths; on other GPUs, its refusal."""
    import torch

    BH, Nq, Nk = shape
    g = torch.Generator(device="cuda").manual_seed(Nq + D + causal)
    mk = lambda n: torch.randn(BH, n, D, generator=g, device="cuda", dtype=getattr(torch, dt))  # noqa: E731
    q, k, v = mk(Nq), mk(Nk), mk(Nk)
    if al.hopper_problem(cb.cc()):
        with pytest.raises(cb.LaunchError, match="compute capability 9.0"):
            al.forward(q, k, v, causal, "v4")
        return
    O, lse = _torch_ref(q, k, v, torch.zeros_like(q), causal)[:2]
    o = torch.full_like(q, float("nan"))
    lo = torch.full(q.shape[:-1], float("nan"), device="cuda")
    al.forward(q, k, v, causal, "v4", out=(o, lo))
    assert _rel(o, O) < (2e-2 if dt == "bfloat16" else 5e-3) and _rel(lo, lse) < 1e-4
    if dt == "bfloat16" and Nq > 1:          # without overlap and ping-pong: the same numbers
        o2, _ = al.forward(q, k, v, causal, "v4", overlap=False)
        assert _rel(o2, O) < 2e-2


@gpu
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (3, 1, 17, 17), (2, 1, 1000, 1000),
                                   (1, 1, 4097, 4097), (3, 1, 150, 77), (3, 1, 1, 300),
                                   (2, 4, 333, 517), (1, 8, 200, 200)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_bwd_v3(dt, shape, D, causal):
    """attention_bwd_v3 (wgmma, TMA) against float64 autograd on ragged lengths, Nq != Nk and
    grouped-query heads (shape: key/value heads, group, Nq, Nk); elsewhere, its refusal."""
    import torch

    BHkv, G, Nq, Nk = shape
    g = torch.Generator(device="cuda").manual_seed(Nq + D + causal + G)
    mk = lambda b, n: torch.randn(b, n, D, generator=g, device="cuda",  # noqa: E731
                                  dtype=getattr(torch, dt))
    q, do, k, v = mk(BHkv * G, Nq), mk(BHkv * G, Nq), mk(BHkv, Nk), mk(BHkv, Nk)
    if al.hopper_problem(cb.cc()):
        o, lse = al.forward(q, k.repeat_interleave(G, 0), v.repeat_interleave(G, 0), causal)
        with pytest.raises(cb.LaunchError, match="compute capability 9.0"):
            al.backward(q, k, v, o, lse, do, causal, "v3")
        return
    kr, vr = (x.repeat_interleave(G, 0) for x in (k, v))
    O, lse, dQ, dK, dV = _torch_ref(q, kr, vr, do, causal)
    dK, dV = (x.view(BHkv, G, Nk, D).sum(1) for x in (dK, dV))
    o, lo = al.forward(q, k, v, causal, "v4")
    tol = 2e-2 if dt == "bfloat16" else 5e-3
    assert _rel(o, O) < tol and _rel(lo, lse) < 1e-4
    grads = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    al.backward(q, k, v, o, lo, do, causal, "v3", out=grads)
    for gr, r in zip(grads, (dQ, dK, dV)):
        assert _rel(gr, r) < 2 * tol


@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_bwd_v3_both_orders(D):
    """attention_bwd_v3 compiled with dV's product before dS^T (early_dv=True) and after it
    (False) gives the default's dK and dV bit for bit (the same products, the same order of
    additions) and its dQ to the last bits (dQ's additions across blocks are unordered); v2
    refuses the option."""
    import torch

    if al.hopper_problem(cb.cc()):
        pytest.skip("attention_bwd_v3 needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(D)
    q, do = (torch.randn(6, 333, D, generator=g, device="cuda", dtype=torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(3, 517, D, generator=g, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    o, lse = al.forward(q, k, v, True, "v4")
    want = al.backward(q, k, v, o, lse, do, True, "v3")
    for early in (True, False):
        dq, dk, dv = al.backward(q, k, v, o, lse, do, True, "v3", early_dv=early)
        assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])
        assert _rel(dq, want[0].double()) < 1e-5
    with pytest.raises(ValueError, match="early_dv is an option of attention_bwd_v3"):
        al.backward(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), o, lse, do, True,
                    "v2", early_dv=True)


@gpu
def test_launchers_refuse_bad_input():
    import torch

    t = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda").to(dt)  # noqa: E731
    q = t(2, 3, 50, 64)
    with pytest.raises(TypeError, match="takes float32"):
        al.forward(q, q, q, version="v2")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        al.forward(*(t(2, 50, 64, dt=torch.float32),) * 3, version="v3")
    with pytest.raises(ValueError, match="head dimension 80"):
        al.forward(*(t(2, 50, 80),) * 3)
    with pytest.raises(ValueError, match="C-contiguous"):
        al.forward(t(2, 64, 50).transpose(1, 2), q[0], q[0])
    with pytest.raises(TypeError, match="GPU array"):
        al.forward(q.cpu(), q.cpu(), q.cpu())
    if not al.hopper_problem(cb.cc()):
        with pytest.raises(TypeError, match="float16 or bfloat16"):
            al.forward(*(t(2, 50, 64, dt=torch.float32),) * 3, version="v4")
        with pytest.raises(ValueError, match="head dimension 96"):
            al.forward(*(t(2, 50, 96),) * 3, version="v4")
        with pytest.raises(ValueError, match="C-contiguous"):
            al.forward(t(2, 64, 50).transpose(1, 2), q[0], q[0], version="v4")
    with pytest.raises(ValueError, match="unknown backward version"):
        al.backward(q, q, q, q, q[..., 0].float(), q, version="v4")
    kv = t(2, 2, 50, 64)                           # grouped-query heads: v4 and bwd v3 only
    with pytest.raises(ValueError, match="3 heads and k 2: grouped-query attention"):
        al.forward(q, kv, kv, version="v3")
    with pytest.raises(ValueError, match="grouped-query attention"):
        al.forward(*(x.float() for x in (q, kv, kv)), version="v2")
    if not al.hopper_problem(cb.cc()):
        with pytest.raises(ValueError, match="3 heads and k 2.*must divide"):
            al.forward(q, kv, kv, version="v4")
    o, lse = al.forward(q, q, q)
    with pytest.raises(ValueError, match="lse: expected shape"):
        al.backward(q, q, q, o, lse[..., :-1].contiguous(), o)


@gpu
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_torch_op_against_autograd(dt):
    import torch

    if dt == "bfloat16" and cb.cc() < (8, 0):
        pytest.skip("bfloat16 needs compute capability 8.0")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 100, 64, device="cuda", dtype=getattr(torch, dt),
                           requires_grad=True) for _ in range(3))
    out = al.flash_attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    rgrads = torch.autograd.grad(ref, leaves, g.double())
    tol = 1e-4 if dt == "float32" else 2e-2
    assert _rel(out, ref) < tol
    for a, b in zip(grads, rgrads):
        assert _rel(a, b.double()) < 2 * tol


@gpu
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_torch_op_grouped_query_heads(dt, capsys):
    """The op against SDPA(enable_gqa=True) in float64: native on Hopper, k and v repeated over
    each group elsewhere (with a note)."""
    import torch

    if dt == "bfloat16" and cb.cc() < (8, 0):
        pytest.skip("bfloat16 needs compute capability 8.0")
    torch.manual_seed(1)
    q = torch.randn(2, 8, 90, 128, device="cuda", dtype=getattr(torch, dt), requires_grad=True)
    k, v = (torch.randn(2, 2, 90, 128, device="cuda", dtype=getattr(torch, dt),
                        requires_grad=True) for _ in range(2))
    out = al.flash_attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True,
                                                           enable_gqa=True)
    rgrads = torch.autograd.grad(ref, leaves, g.double())
    tol = 1e-4 if dt == "float32" else 2e-2
    assert _rel(out, ref) < tol
    for a, b in zip(grads, rgrads):
        assert a.shape == b.shape and _rel(a, b.double()) < 2 * tol


@gpu
def test_sanitize_targets_run():
    names = [name for name, launch in al.sanitize_targets() if launch() or True]
    assert "attention_v2" in names and "attention_bwd_v1" in names


# ============================================================================ ex09_6
def _window(edits=()):
    """The reference of ex09.6 (or, with ``edits``, a wrong answer) from the solution notebook."""
    return SOL.get("ex09.6", "flash_fwd_window", edits=tuple(edits))


def test_ex09_6_stub_fails():
    # the simulator raises NotImplementedError; on a GPU a raise in a kernel does nothing
    with pytest.raises(GradeError, match="not implemented yet|still the stub"):
        ex09_6(SOL.stub("ex09.6", "flash_fwd_window"))


def test_ex09_6_reference_passes(capsys):
    ex09_6(_window())
    assert capsys.readouterr().out == "PASS ex09.6\n"


@pytest.mark.parametrize("edits, hint", [
    # no guard: a tile wholly outside a query's window gives exp(-inf + inf) = NaN
    ([("        if m_new > NEG_INF:                           # a tile wholly outside this "
       "query's window\n", "        if True:\n")], "skip the update while m_new is -inf"),
    # the tiles below the window loaded and masked instead of skipped
    ([("kv_start = max(0, q0 - W + 1) // BC * BC", "kv_start = 0")],
     "in a tile none of its queries sees"),
])
def test_ex09_6_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_6(_window(edits))


# ============================================================================ ex09_7
_DS = "            ds = math.exp(s * scale - lse[i]) * (g - delta[i])\n"
#: D_i summed over the tile's own keys (what the tile can see) instead of the delta passed in
_TILE_D = """            di = float32(0)
            for jj in range(n):
                sj = float32(0)
                gj = float32(0)
                for c in range(D):
                    sj += q[i, c] * k[jj, c]
                    gj += do[i, c] * v[jj, c]
                di += math.exp(sj * scale - lse[i]) * gj
            ds = math.exp(s * scale - lse[i]) * (g - di)
"""


def test_ex09_7_stub_fails():
    # the simulator raises NotImplementedError; on a GPU a raise in a kernel does nothing
    with pytest.raises(GradeError, match="not implemented yet|still the stub"):
        ex09_7(SOL.stub("ex09.7", "bwd_dkdq"))


def test_ex09_7_reference_passes(capsys):
    ex09_7(SOL.get("ex09.7", "bwd_dkdq"))
    assert capsys.readouterr().out == "PASS ex09.7\n"


def test_ex09_7_tiles_sum_to_autograd():
    """The grader's per-tile reference: dS from autograd, summed over the tiles, is dQ."""
    from cudabook.graders.ch09 import _dkdq_reference

    rng = np.random.default_rng(4)
    q, K, V, do = (rng.standard_normal((n, 5)) for n in (7, 20, 20, 7))
    dq = sum(_dkdq_reference(q, K, V, do, j0, 8)[2] @ K[j0:j0 + 8] for j0 in (0, 8, 16))
    lse, delta, dS, dK = _dkdq_reference(q, K, V, do, 0, 20)
    torch = pytest.importorskip("torch")
    Q, Kt, Vt = (torch.tensor(x, requires_grad=True) for x in (q, K, V))
    O = torch.nn.functional.scaled_dot_product_attention(Q[None], Kt[None], Vt[None])[0]
    gq, gk = torch.autograd.grad(O, (Q, Kt), torch.tensor(do))
    np.testing.assert_allclose(dq / math.sqrt(5), gq.numpy(), atol=1e-12)
    np.testing.assert_allclose(dK, gk.numpy(), atol=1e-12)
    np.testing.assert_allclose(delta, (do * O.detach().numpy()).sum(1), atol=1e-12)


@pytest.mark.parametrize("edits, hint", [
    ([("* (g - delta[i])", "* g", 2)], "forgets the softmax's second term"),
    ([(_DS, _TILE_D, 2)], "summed over this tile's keys only"),
    ([("dk[t, c] += scale * ds * q[i, c]", "dk[t, c] += ds * q[i, c]")],
     "dk is wrong.*the scale is missing"),
    ([("dq[i, c] += scale * ds * k[j, c]", "dq[i, c] += ds * k[j, c]")],
     "dq is wrong.*the scale is missing"),
    # dq set to this tile's share instead of added to
    ([("        for j in range(n):\n",
       "        for c in range(D):\n            dq[i, c] = float32(0)\n"
       "        for j in range(n):\n")],
     "holds only this tile's contribution"),
    # lse divided out after the exp: overflows for scores near 800
    ([("math.exp(s * scale - lse[i])", "math.exp(s * scale) / math.exp(lse[i])", 2)],
     "subtract lse inside the exp"),
    pytest.param([("    if t < n:", "    if True:")], "guard with j < k.shape", marks=SIM_ONLY),
    # dk summed into without zeroing it first (the grader's outputs start as NaN)
    ([("        for c in range(D):\n            dk[t, c] = float32(0)\n", "")],
     "without setting it to 0 first"),
    ([("                dq[i, c] += scale * ds * k[j, c]",
       "                dq[i, c] += scale * ds * np.sum(k[j, c])")],
     "np.sum \\(NumPy\\).*a GPU cannot compile it"),
])
def test_ex09_7_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_7(SOL.get("ex09.7", "bwd_dkdq", edits=edits))


# ============================================================================ ex09_8 (CUDA C++)
# The whole backward of one tile in one block. Its rubric (no library, shared memory, a barrier,
# the outputs written at all) is read from the code, so those wrong answers are graded on a CPU
# too; the values and racecheck need a GPU.
from cudabook.graders import ex09_8  # noqa: E402

_BWD_SRC = ("ex09.8", "bwd_tile_src")
_SYNC = "    __syncthreads();\n"
_PRODUCTS = "    for (int e = t; e < Bc * D; e += nt) {"     # the loop of dV and dK


def test_ex09_8_stub_fails():
    with pytest.raises(GradeError, match="ex09.8: not implemented yet"):
        ex09_8(SOL.stub(*_BWD_SRC))


@pytest.mark.parametrize("edits, hint", [
    ([("#define BR_MAX", "#include <cub/block/block_reduce.cuh>\n#define BR_MAX")],
     "includes <cub/block/block_reduce.cuh>, a library"),
    ([(_SYNC, "", 2)], "no __syncthreads\\(\\) in the code"),
])
def test_ex09_8_rubric_refuses_on_any_machine(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_8(SOL.get(*_BWD_SRC, edits=edits))


def test_ex09_8_answer_is_not_in_the_lesson():
    """The lesson derives the five products; the kernel that computes them is the reader's."""
    import json
    from pathlib import Path

    from cudabook.graders._static import cuda_code

    src = SOL.get(*_BWD_SRC)
    body = src.split("BEGIN SOLUTION ex09.8", 1)[1].split("END SOLUTION", 1)[0]
    lines = [" ".join(ln.split()) for ln in cuda_code(body).splitlines()]
    lines = [ln for ln in lines if len(ln) >= 12]
    pairs = [f"{a} {b}" for a, b in zip(lines, lines[1:])]   # two lines running: an answer
    root = Path(__file__).resolve().parents[1]
    lesson = json.loads((root / "lessons" / "09_flash_attention.ipynb").read_text())
    text = []
    for c in lesson["cells"]:
        text.append("".join(c["source"]))
        for o in c.get("outputs", []):
            text.append("".join(o.get("text", "")) + json.dumps(o.get("data", {})))
    flat = " ".join(" ".join(text).split())
    assert len(pairs) >= 10
    found = [ln for ln in pairs if ln in flat]
    assert not found, f"the lesson holds lines of ex09.8's answer: {found}"


@gpu
def test_ex09_8_reference_passes(capsys):
    ex09_8(SOL.get(*_BWD_SRC))
    assert capsys.readouterr().out == "PASS ex09.8\n"


@gpu
@pytest.mark.parametrize("edits, hint", [
    # dS = P * dP: the D term left out
    ([("sdS[i][j] = p * (dp - Di[i]);", "sdS[i][j] = p * dp;")],
     "dK is wrong.*leaves out the softmax's second term"),
    ([("dK[e] = scale * k;", "dK[e] = k;")], "dK is wrong.*the scale is missing"),
    ([("dQ[e] = scale * q;", "dQ[e] = q;")], "dQ is wrong.*the scale is missing"),
    # dK = dS Q: dS read across its other axis (square tile first: the values name it)
    ([("k += sdS[i][j] * sQ[i][c];", "k += sdS[j][i] * sQ[i][c];")],
     "dK is wrong.*sums over the queries.*the wrong axis"),
    # P from a fresh maximum over the tile's keys instead of the saved lse
    ([("float p = expf(scale * s - lse[i]);",
       "float m = -1e30f;\n"
       "        for (int jj = 0; jj < Bc; jj++) {\n"
       "            float x = 0.f;\n"
       "            for (int c = 0; c < D; c++) x += sQ[i][c] * sK[jj][c];\n"
       "            m = fmaxf(m, scale * x);\n"
       "        }\n"
       "        float p = expf(scale * s - m);")],
     "dV is wrong.*a maximum \\(and sum\\) over this tile's keys"),
    ([("float p = expf(scale * s - lse[i]);", "float p = expf(scale * s);")],
     "dV is wrong.*ignores the saved logsumexp"),
    # the barrier between P, dS and the products that read them
    ([(_SYNC + _PRODUCTS, _PRODUCTS)], "racecheck found a race"),
    # a stride of 256 instead of blockDim.x: the grader's second call has 128 threads
    ([("e += nt", "e += 256", 5)], "stride the loops by blockDim.x"),
])
def test_ex09_8_wrong_answers_fail(edits, hint):
    with pytest.raises(GradeError, match=hint):
        ex09_8(SOL.get(*_BWD_SRC, edits=edits))


def test_ex09_8_states_its_stub_size_and_has_two_hints():
    from solution_cells import check_exercise_page

    check_exercise_page("09", "ex09.8")
