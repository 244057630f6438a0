"""kernels/sanitizer_demo.cu (Chapter 5's seeded bugs): the launcher's names, references,
launch records and refusals on the CPU; on a GPU the fixed twins against float64 (blocksum_fix
also bit for bit against its tree order in float32). The *_bug kernels run only under
compute-sanitizer in a process of their own (the lesson does that): blocksum_bug's barrier in a
branch is undefined behaviour, and may hang a plain launch."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import cudabook as cb

sd = cb.load_launch("sanitizer_demo")
gpu = pytest.mark.gpu
SRC = Path(__file__).resolve().parent.parent / "kernels" / "sanitizer_demo.cu"


def _tree_sum_f32(x) -> np.ndarray:
    """blocksum_fix's arithmetic on the host: per block of 256 (0 past n), buf[t] += buf[t + s]
    for s = 128, 64, ..., 1, in float32 (adds only: the GPU's results are the same bits)."""
    v = np.asarray(x, dtype=np.float32)
    buf = np.zeros(-(-v.shape[0] // 256) * 256, np.float32)
    buf[:v.shape[0]] = v
    buf = buf.reshape(-1, 256)
    s = 128
    while s > 0:
        buf[:, :s] = buf[:, :s] + buf[:, s:2 * s]
        s //= 2
    return buf[:, 0].copy()


def test_launch_module_names_match_the_kernel_file():
    src = SRC.read_text()
    kernels = re.findall(r'extern "C" __global__ void (\w+)\(', src)
    assert kernels == [f"{c}_{w}" for c in sd.CASES for w in ("bug", "fix")]
    assert set(sd.WHAT) == set(sd.TOOL) == set(sd.CASES)
    assert set(sd.TOOL.values()) == {"memcheck", "racecheck", "initcheck", "synccheck"}
    assert src.count("// launch:") == len(kernels)


def test_reference_answers():
    x = np.arange(1, 601, dtype=np.float32)
    assert np.array_equal(sd.reference("shift", x), np.concatenate([[0], x[:-1]]))
    r = sd.reference("reverse", x)
    assert r[0] == 256 and r[255] == 1 and r[256] == 512
    s = sd.reference("blocksum", x)             # blocks 1..256, 257..512, 513..600 (+ 168 zeros)
    assert s.dtype == np.float64
    assert list(s) == [256 * 257 / 2, (257 + 512) * 128, (513 + 600) * 88 / 2]
    assert list(sd.reference("blocksum", np.ones(1000, np.float32))) == [256, 256, 256, 232]
    m = np.array([[-5, -2, -9], [1, 7, 3]], dtype=np.float32)
    assert list(sd.reference("rowmax", m)) == [-2, 7]


def test_config_and_refusals():
    assert tuple(sd.config("shift", 1000)) == ((4,), (256,))
    assert tuple(sd.config("rowmax", 300)) == ((3,), (128,))
    assert tuple(sd.config("blocksum", 1000)) == ((4,), (256,))   # one block per sum
    with pytest.raises(cb.LaunchError, match="case is one of shift, reverse, rowmax, blocksum"):
        sd.config("oob", 10)


def test_blocksum_tree_order_stays_within_the_float32_bound():
    """The host copy of blocksum_fix's order (the GPU test compares it bit for bit) against the
    float64 sums: a tree of 8 levels errs by at most about 8 u sum|x| per block (u = 2^-24)."""
    x = np.random.default_rng(0).standard_normal(1000, dtype=np.float32)
    got, want = _tree_sum_f32(x).astype(np.float64), sd.reference("blocksum", x)
    bound = 8 * 2.0**-24 * sd.reference("blocksum", np.abs(x))
    assert got.shape == want.shape == (4,)
    assert np.all(np.abs(got - want) <= bound)


def test_sanitize_targets_never_yield_a_bug(monkeypatch):
    monkeypatch.setattr(sd, "example", lambda case, seed=0: (np.zeros(8, np.float32), None))
    names = [n for n, _ in sd.sanitize_targets()]
    assert len(names) == 4 and all("_fix" in n and "_bug" not in n for n in names)


@gpu
@pytest.mark.parametrize("case", sd.CASES)
def test_fixed_twins_give_the_float64_answer(case):
    x, want = sd.example(case)
    got = cb.to_numpy(sd.demo(case, x)).astype(np.float64)
    assert got.shape == want.shape
    if case == "blocksum":                 # sums of 256 float32 terms: a float32 tree's error
        bound = 8 * 2.0**-24 * sd.reference(case, np.abs(cb.to_numpy(x)))
        assert np.all(np.abs(got - want) <= bound)
        assert np.array_equal(got, _tree_sum_f32(cb.to_numpy(x)))   # the same adds, in order
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@gpu
def test_bad_input_is_refused_before_a_launch():
    import cupy as cp

    with pytest.raises(cb.LaunchError, match="at least one column"):
        sd.demo("rowmax", cp.zeros((3, 0), cp.float32))
    with pytest.raises((TypeError, ValueError, cb.LaunchError)):
        sd.demo("shift", cp.zeros(8, cp.float64))
    for case in ("shift", "blocksum"):     # a launch on no elements would still write y[0]
        with pytest.raises(cb.LaunchError, match="x is empty"):
            sd.demo(case, cp.zeros(0, cp.float32))
    with pytest.raises(ValueError, match=r"expected shape \(4,\)"):   # one sum per block
        sd.demo("blocksum", cp.zeros(1000, cp.float32), out=cp.zeros(1000, cp.float32))
