"""The GPT training step's data movement (capstone part 2): kernels/transpose16 (a 16-bit
transpose, for the operands of hgemm's C = A @ B^T), kernels/heads (the matmuls' rows <->
attention's (B*H, T, D) heads) and kernels/cast16 (bf16 <-> fp32).

On the CPU: every refusal, with CPU tensors (the checks of dtype, shape, layout and alignment
come before the device check, so each message is reached without a GPU), and the Numba twins on
the simulator against NumPy, bitwise. NumPy has no bfloat16: the twins move 16-bit elements as
uint16 bit patterns, and the casts are checked as bit patterns too (float32 viewed as uint32,
the bf16 rounding against an independent NumPy reference built from the two neighbours in
float64, itself checked against PyTorch's CPU rounding).

On the GPU: every entry point against PyTorch (``.t().contiguous()``, view / permute,
``.float()``, ``.bfloat16()``), bitwise, on ragged sizes; round trips; a view that starts 2 bytes
in (transpose16_v2's element path); overlapping outputs refused; sizes past 2^31 elements (the
64-bit indices); every call captured in a torch.cuda.CUDAGraph and replayed on new inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cudabook as cb

gpu = pytest.mark.gpu
t16 = cb.load_launch("transpose16")
hl = cb.load_launch("heads")
c16 = cb.load_launch("cast16")

bf16, fp16 = torch.bfloat16, torch.float16


# ============================================================================ refusals (CPU)
def test_transpose_refuses_bad_input():
    a = torch.zeros(4, 6, dtype=bf16)
    with pytest.raises(TypeError, match="a: expected dtype bfloat16 or float16, got float32"):
        t16.transpose(torch.zeros(4, 6))
    with pytest.raises(TypeError, match="a: expected dtype bfloat16 or float16, got uint16"):
        t16.transpose(np.zeros((4, 6), np.uint16))
    with pytest.raises(ValueError, match="a: expected 2 dimensions"):
        t16.transpose(torch.zeros(24, dtype=bf16))
    with pytest.raises(ValueError, match=r"a: shape \(0, 6\) is empty"):
        t16.transpose(torch.zeros(0, 6, dtype=bf16))
    with pytest.raises(ValueError, match="a: expected a C-contiguous array"):
        t16.transpose(a.t())
    with pytest.raises(ValueError, match=r"out: expected shape \(6, 4\), got \(4, 6\)"):
        t16.transpose(a, torch.zeros(4, 6, dtype=bf16))
    with pytest.raises(TypeError, match="out: expected dtype bfloat16, got float16"):
        t16.transpose(a, torch.zeros(6, 4, dtype=fp16))
    with pytest.raises(ValueError, match="out: expected a C-contiguous array"):
        t16.transpose(a, torch.zeros(4, 6, dtype=bf16).t())
    with pytest.raises(ValueError, match="unknown version 'v3'"):
        t16.transpose(a, version="v3")
    with pytest.raises(TypeError, match="a: expected a GPU array .* on the host"):
        t16.transpose(a, torch.zeros(6, 4, dtype=bf16))
    with pytest.raises(TypeError, match="a: expected a GPU array"):
        t16.transpose(a, version="transpose16_v1")


def _heads_args(B=2, T=3, H=2, D=16, dtype=bf16):
    qkv = torch.zeros(B * T, 3 * H * D, dtype=dtype)
    return qkv, [torch.zeros(B * H, T, D, dtype=dtype) for _ in range(3)]


def test_heads_refuse_bad_input():
    qkv, (q, k, v) = _heads_args()
    with pytest.raises(TypeError, match="B must be an int >= 1, got 0"):
        hl.split_qkv(qkv, 0, 3, 2, q, k, v)
    with pytest.raises(TypeError, match="H must be an int >= 1, got 2.0"):
        hl.split_qkv(qkv, 2, 3, 2.0, q, k, v)
    q32 = [t.float() for t in (q, k, v)]
    with pytest.raises(TypeError, match="q: expected dtype bfloat16 .*got float32"):
        hl.split_qkv(qkv.float(), 2, 3, 2, *q32)
    with pytest.raises(TypeError, match="k: expected dtype bfloat16, got float16"):
        hl.split_qkv(qkv, 2, 3, 2, q, k.half(), v)
    with pytest.raises(TypeError, match="qkv: expected dtype bfloat16, got float16"):
        hl.split_qkv(qkv.half(), 2, 3, 2, q, k, v)
    q12, k12, v12 = (torch.zeros(4, 3, 12, dtype=bf16) for _ in range(3))
    with pytest.raises(ValueError, match="head dimension D = 12 must be a multiple of 8"):
        hl.split_qkv(torch.zeros(6, 72, dtype=bf16), 2, 3, 2, q12, k12, v12)
    with pytest.raises(ValueError, match=r"v: expected shape \(B\*H, T, D\) = \(4, 3, 16\)"):
        hl.split_qkv(qkv, 2, 3, 2, q, k, torch.zeros(4, 4, 16, dtype=bf16))
    with pytest.raises(ValueError, match=r"qkv: expected shape \(B\*T, 3\*H\*D\) = \(6, 96\)"):
        hl.split_qkv(torch.zeros(6, 64, dtype=bf16), 2, 3, 2, q, k, v)
    with pytest.raises(ValueError, match=r"out: expected shape \(B\*T, 1\*H\*D\) = \(6, 32\)"):
        hl.merge(q, 2, 3, 2, torch.zeros(6, 96, dtype=bf16))
    with pytest.raises(ValueError, match="dk: expected a C-contiguous array"):
        hl.merge_qkv(q, torch.zeros(4, 16, 3, dtype=bf16).transpose(1, 2), v, 2, 3, 2, qkv)
    buf = torch.zeros(4 * 3 * 16 + 1, dtype=bf16)
    with pytest.raises(ValueError, match="out: its first element is not 16-byte aligned"):
        hl.split(torch.zeros(6, 32, dtype=bf16), 2, 3, 2, buf[1:].view(4, 3, 16))
    with pytest.raises(TypeError, match="qkv: expected a GPU array .* on the host"):
        hl.split_qkv(qkv, 2, 3, 2, q, k, v)
    with pytest.raises(TypeError, match="dqkv: expected a GPU array"):
        hl.merge_qkv(q, k, v, 2, 3, 2, qkv)
    with pytest.raises(TypeError, match="out: expected a GPU array"):   # (B, H, T, D) accepted
        hl.merge(q.view(2, 2, 3, 16), 2, 3, 2, torch.zeros(2, 3, 32, dtype=bf16))


def test_casts_refuse_bad_input():
    h, f = torch.zeros(8, dtype=bf16), torch.zeros(8)
    with pytest.raises(TypeError, match="src: expected dtype bfloat16, got float32"):
        c16.to_f32(f, f)
    with pytest.raises(TypeError, match="dst: expected dtype float32, got float16"):
        c16.to_f32(h, torch.zeros(8, dtype=fp16))
    with pytest.raises(TypeError, match="src: expected dtype float32, got bfloat16"):
        c16.to_bf16(h, h)
    with pytest.raises(ValueError, match="dst has 7 elements, src 8"):
        c16.to_f32(h, torch.zeros(7))
    with pytest.raises(ValueError, match="dst has 9 elements, src 8"):
        c16.to_bf16(f, torch.zeros(9, dtype=bf16))
    with pytest.raises(ValueError, match="src: expected a C-contiguous array"):
        c16.to_bf16(torch.zeros(4, 4).t(), torch.zeros(16, dtype=bf16))
    with pytest.raises(ValueError, match="dst: its first element is not 16-byte aligned"):
        c16.to_f32(h, torch.zeros(9)[1:])
    with pytest.raises(TypeError, match="accumulate must be a bool, got 1"):
        c16.to_f32(h, f, accumulate=1)
    with pytest.raises(TypeError, match="src: expected a GPU array .* on the host"):
        c16.to_f32(h.view(2, 4), f)                         # shapes may differ: n counts
    with pytest.raises(TypeError, match="src: expected a GPU array"):
        c16.to_bf16(f, h)


# ============================================================================ twins (simulator)
SIM_SHAPES = [(1, 1), (1, 70), (33, 65), (65, 17), (64, 128), (70, 9)]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("R, C", SIM_SHAPES)
def test_transpose_twins_match_numpy(R, C, version):
    """transpose16_v1 and transpose16_tile64 (v2's map) on uint16 patterns; the output starts at
    0xFFFF, a value the input never holds, so a missed element shows."""
    a = np.random.default_rng(R * 1000 + C).integers(0, 0xFFFF, (R, C), dtype=np.uint16)
    out = t16.transpose_numba(a, version)
    assert out.shape == (C, R) and np.array_equal(out, a.T)


@pytest.mark.parametrize("B, T, H, D, P", [(1, 1, 1, 8, 3), (2, 3, 2, 16, 3), (2, 5, 3, 8, 1),
                                           (1, 2, 2, 64, 3)])
def test_heads_twins_match_numpy(B, T, H, D, P):
    x = np.random.default_rng(B * T * H).integers(0, 0xFFFF, (B * T, P * H * D), dtype=np.uint16)
    ys = hl.split_numba(x, B, T, H, P)
    ref = x.reshape(B, T, P, H, D).transpose(2, 0, 3, 1, 4).reshape(P, B * H, T, D)
    assert np.array_equal(ys, ref)
    assert np.array_equal(hl.merge_numba(ref, B, T, H), x)


def _bf16_specials() -> np.ndarray:
    """bf16 patterns at the edges: zeros, the smallest and largest subnormals, the smallest
    normal, one, the largest finite, infinities, NaNs (quiet and signalling payloads)."""
    v = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0x7F80, 0x7FC0, 0x7F81, 0x7FFF]
    return np.array(v + [x | 0x8000 for x in v], np.uint16)


def test_to_f32_twin_matches_numpy():
    rng = np.random.default_rng(1)
    bits = np.concatenate([_bf16_specials(),
                           rng.integers(0, 0x10000, 1500, dtype=np.uint32).astype(np.uint16)])
    ref = (bits.astype(np.uint32) << 16).view(np.float32)        # the bf16 values, exactly
    nan = np.isnan(ref)
    out = c16.to_f32_numba(bits)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    d0 = (rng.standard_normal(bits.size) * 1e3).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ref2 = d0 + ref                                          # one float32 add each
    out2 = c16.to_f32_numba(bits, d0, accumulate=True)
    nan2 = np.isnan(ref2)
    assert np.array_equal(np.isnan(out2), nan2)
    assert np.array_equal(out2[~nan2].view(np.uint32), ref2[~nan2].view(np.uint32))


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of float32 x rounded to nearest, ties to even, chosen between the two
    bf16 neighbours of |x| by their distances in float64 (past the largest finite, the upper
    neighbour is 2^128: rounding there gives inf); NaN -> 0x7fff (cuda_bf16.h's NaN)."""
    u = x.view(np.uint32).astype(np.int64)
    mag = u & 0x7FFFFFFF
    lo = mag & 0x7FFF0000                       # towards zero
    hi = lo + 0x10000                           # away from zero
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.abs(x.astype(np.float64))
        vlo = lo.astype(np.uint32).view(np.float32).astype(np.float64)
        vhi = np.where(hi == 0x7F800000, 2.0 ** 128,
                       hi.astype(np.uint32).view(np.float32).astype(np.float64))
        dlo, dhi = a - vlo, vhi - a
    up = (dhi < dlo) | ((dhi == dlo) & ((lo >> 16) & 1 == 1))
    r = (np.where(up, hi, lo) >> 16) | ((u >> 16) & 0x8000)
    r = np.where(np.isinf(x), u >> 16, r)
    r = np.where(np.isnan(x), 0x7FFF, r)
    return r.astype(np.uint16)


def _f32_cases(n: int, seed: int) -> np.ndarray:
    """Float32 across the whole range, and the cases rounding gets wrong: exact ties (low 16 bits
    0x8000) to an even and an odd neighbour, one bit either side of a tie, the tie past the
    largest finite bf16 (rounds to inf), subnormals, zeros, infinities, NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-44, 38, n)).astype(np.float32)
    special = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x7F7F7FFF,
                        0x7F7FFFFF, 0x00008000, 0x00018000, 0x00000001, 0x007FFFFF, 0x00000000,
                        0x7F800000, 0x7FC00000, 0x7F800001], np.uint32)
    s = np.concatenate([special, special | 0x80000000]).view(np.float32)
    return np.concatenate([s, x])


def test_bf16_reference_agrees_with_torch():
    x = _f32_cases(4000, 2)
    fin = ~np.isnan(x)
    t = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_bf16_rne(x)[fin], t[fin])


def test_to_bf16_twin_matches_numpy():
    x = _f32_cases(1500, 3)
    assert np.array_equal(c16.to_bf16_numba(x), _bf16_rne(x))


# ============================================================================ GPU
SIZES = [(1, 1), (1, 1000), (33, 65), (8192, 768), (768, 50304), (1000, 1), (64, 64), (7, 9)]
HEADS = [(1, 1, 1, 64), (2, 17, 3, 64), (8, 1024, 12, 64), (2, 5, 2, 128)]


def _same(x, y) -> bool:
    """Bitwise equality of two tensors of one dtype (and shape)."""
    iv = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(iv), y.view(iv))


def _nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@gpu
@pytest.mark.parametrize("dtype", [bf16, fp16])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("R, C", SIZES)
def test_transpose_matches_torch(R, C, version, dtype):
    g = torch.Generator(device="cuda").manual_seed(R * 7 + C)
    a = torch.randn(R, C, device="cuda", generator=g).to(dtype)
    ref = a.t().contiguous()
    out = _nan_like((C, R), dtype)
    assert t16.transpose(a, out, version) is out and _same(out, ref)
    assert _same(t16.transpose(a, version=version), ref)          # out allocated
    t16.transpose(a, out, version)                                 # twice: same bits
    assert _same(out, ref)


@gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("R, C", [(64, 64), (33, 72), (16, 40)])
def test_transpose_of_views_at_two_bytes(R, C, version):
    """a and out starting 2 bytes into their storage: v2 takes its element path."""
    buf = torch.randn(R * C + 1, device="cuda").bfloat16()
    ob = _nan_like((R * C + 1,), bf16)
    a, out = buf[1:].view(R, C), ob[1:].view(C, R)
    t16.transpose(a, out, version)
    assert _same(out, a.t().contiguous()) and torch.isnan(ob[0].float())


@gpu
def test_transpose_refuses_an_overlapping_out():
    a = torch.zeros(8, 8, dtype=bf16, device="cuda")
    with pytest.raises(ValueError, match="out overlaps a"):
        t16.transpose(a, a)


def _heads_ref(rows, B, T, H, P):
    """The P head tensors (B*H, T, D) of rows (B*T, P*H*D), by PyTorch's view and permute."""
    D = rows.shape[1] // (P * H)
    return rows.view(B, T, P, H, D).permute(2, 0, 3, 1, 4).reshape(P, B * H, T, D)


@gpu
@pytest.mark.parametrize("B, T, H, D", HEADS)
def test_split_and_merge_qkv_match_torch(B, T, H, D):
    g = torch.Generator(device="cuda").manual_seed(B * T * H + D)
    qkv = torch.randn(B * T, 3 * H * D, device="cuda", generator=g).bfloat16()
    q, k, v = (_nan_like((B * H, T, D), bf16) for _ in range(3))
    got = hl.split_qkv(qkv, B, T, H, q, k, v)
    assert len(got) == 3 and all(x is y for x, y in zip(got, (q, k, v)))
    ref = _heads_ref(qkv, B, T, H, 3)
    assert all(_same(x, ref[i]) for i, x in enumerate((q, k, v)))
    dqkv = _nan_like((B * T, 3 * H * D), bf16)
    assert hl.merge_qkv(q, k, v, B, T, H, dqkv) is dqkv and _same(dqkv, qkv)   # round trip
    dq, dk, dv = (torch.randn(B * H, T, D, device="cuda", generator=g).bfloat16()
                  for _ in range(3))
    hl.merge_qkv(dq, dk, dv, B, T, H, dqkv)
    want = torch.stack([dq, dk, dv]).view(3, B, H, T, D).permute(1, 3, 0, 2, 4)
    assert _same(dqkv, want.reshape(B * T, 3 * H * D))


@gpu
@pytest.mark.parametrize("B, T, H, D", HEADS)
def test_merge_and_split_match_torch(B, T, H, D):
    g = torch.Generator(device="cuda").manual_seed(B + T + H + D)
    o = torch.randn(B * H, T, D, device="cuda", generator=g).bfloat16()
    out = _nan_like((B * T, H * D), bf16)
    assert hl.merge(o, B, T, H, out) is out
    assert _same(out, o.view(B, H, T, D).permute(0, 2, 1, 3).reshape(B * T, H * D))
    back = _nan_like((B * H, T, D), bf16)
    assert hl.split(out, B, T, H, back) is back and _same(back, o)             # round trip
    o4 = _nan_like((B, H, T, D), bf16)                                         # 4D views
    hl.split(out.view(B, T, H * D), B, T, H, o4)
    assert _same(o4.view(B * H, T, D), o)


@gpu
def test_heads_refuse_overlapping_outputs():
    B, T, H, D = 1, 4, 2, 64
    qkv = torch.zeros(B * T, 3 * H * D, dtype=bf16, device="cuda")
    q, k = (torch.zeros(B * H, T, D, dtype=bf16, device="cuda") for _ in range(2))
    with pytest.raises(ValueError, match="q overlaps k"):          # k is q
        hl.split_qkv(qkv, B, T, H, q, q, k)
    flat = qkv.view(-1)
    with pytest.raises(ValueError, match="out overlaps x"):          # split in place
        hl.split(flat[:B * T * H * D].view(B * T, H * D), B, T, H,
                 flat[:B * H * T * D].view(B * H, T, D))


CAST_SIZES = [1, 7, 8, 9, 1000, 8192 * 768 + 3]


@gpu
@pytest.mark.parametrize("n", CAST_SIZES)
def test_to_f32_matches_torch(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    h = torch.randn(n, device="cuda", generator=g).bfloat16()
    dst = _nan_like((n,), torch.float32)
    assert c16.to_f32(h, dst) is dst and _same(dst, h.float())
    d0 = torch.randn(n, device="cuda", generator=g)
    acc = d0.clone()
    c16.to_f32(h, acc, accumulate=True)
    assert _same(acc, d0 + h.float())


@gpu
def test_to_f32_keeps_every_bit_pattern():
    """All 65536 bf16 patterns (NaN payloads included: the conversion is a shift), into a
    (256, 256) dst from a flat src."""
    h = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(bf16)
    dst = _nan_like((256, 256), torch.float32)
    c16.to_f32(h, dst)
    assert _same(dst.view(-1), h.float())


@gpu
@pytest.mark.parametrize("n", CAST_SIZES)
def test_to_bf16_matches_torch(n):
    x = torch.from_numpy(_f32_cases(n, n)[:n].copy()).cuda() if n > 30 else \
        torch.randn(n, device="cuda")
    out = _nan_like((n,), bf16)
    assert c16.to_bf16(x, out) is out
    ref = x.bfloat16()
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(out.float()), nan)
    assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
    assert (out.view(torch.int16)[nan] == 0x7FFF).all()


@gpu
def test_casts_refuse_an_overlapping_dst():
    f = torch.zeros(16, device="cuda")
    with pytest.raises(ValueError, match="dst overlaps src"):
        c16.to_bf16(f, f.view(bf16)[:16])


def _need_gib(gib: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")


@gpu
def test_past_2_31_elements():
    """The 64-bit indices: each op on a tensor of more than 2^31 elements."""
    _need_gib(40)
    n = 2**31 + 9
    h = torch.randint(-32768, 32768, (n,), dtype=torch.int16, device="cuda").view(bf16)
    f = torch.empty(n, device="cuda")
    c16.to_f32(h, f)
    assert _same(f, h.float())                 # every pattern, NaN payloads too: a shift
    del f
    x = h.float()
    back = torch.empty(n, dtype=bf16, device="cuda")
    c16.to_bf16(x, back)                       # bf16 values round to themselves; NaN -> 0x7fff
    want = torch.where(torch.isnan(x), torch.full_like(h.view(torch.int16), 0x7FFF),
                       h.view(torch.int16))
    assert torch.equal(back.view(torch.int16), want)
    del x, back, want, h
    torch.cuda.empty_cache()
    R, C = 32776, 65539                        # 2^31 + ...; rows a multiple of 8, cols odd
    a = torch.randn(R, C, device="cuda").bfloat16()
    out = t16.transpose(a)
    assert _same(out, a.t().contiguous())
    del a, out
    torch.cuda.empty_cache()
    B, T, H, D = 2, 174763, 16, 128            # B*T*3*H*D = 2^31 + 4096
    qkv = torch.randn(B * T, 3 * H * D, device="cuda").bfloat16()
    q, k, v = (torch.empty(B * H, T, D, dtype=bf16, device="cuda") for _ in range(3))
    hl.split_qkv(qkv, B, T, H, q, k, v)
    ref = _heads_ref(qkv, B, T, H, 3)
    assert all(_same(x, ref[i]) for i, x in enumerate((q, k, v)))


@gpu
def test_capture_in_a_cuda_graph_and_replay():
    """Every entry point inside one torch.cuda.graph; new inputs copied in, replayed twice (the
    accumulating cast doubles), compared with PyTorch."""
    B, T, H, D = 2, 17, 3, 64
    dev = dict(device="cuda")
    a = torch.randn(33, 65, **dev).bfloat16()
    at1, at2 = (torch.empty(65, 33, dtype=bf16, **dev) for _ in range(2))
    qkv = torch.randn(B * T, 3 * H * D, **dev).bfloat16()
    q, k, v, o2 = (torch.empty(B * H, T, D, dtype=bf16, **dev) for _ in range(4))
    o = torch.empty(B * T, H * D, dtype=bf16, **dev)
    dqkv = torch.empty_like(qkv)
    x = torch.randn(1003, **dev)
    h = torch.empty(1003, dtype=bf16, **dev)
    acc = torch.zeros(1003, **dev)

    def step():
        t16.transpose(a, at1, "v1")
        t16.transpose(a, at2, "v2")
        hl.split_qkv(qkv, B, T, H, q, k, v)
        hl.merge(q, B, T, H, o)
        hl.split(o, B, T, H, o2)
        hl.merge_qkv(q, k, v, B, T, H, dqkv)
        c16.to_bf16(x, h)
        c16.to_f32(h, acc, accumulate=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                 # compile and load every kernel first
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    a.copy_(torch.randn(33, 65, **dev))
    qkv.copy_(torch.randn(B * T, 3 * H * D, **dev))
    x.copy_(torch.randn(1003, **dev))
    acc.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    ref = _heads_ref(qkv, B, T, H, 3)
    assert _same(at1, a.t().contiguous()) and _same(at2, a.t().contiguous())
    assert all(_same(t, ref[i]) for i, t in enumerate((q, k, v)))
    assert _same(o, q.view(B, H, T, D).permute(0, 2, 1, 3).reshape(B * T, H * D))
    assert _same(o2, q) and _same(dqkv, qkv)
    assert _same(h, x.bfloat16())
    assert _same(acc, 2 * h.float())           # two replays: h + h, exact
