"""kernels/sanitizer_demo.cu (Chapter 5's seeded bugs): the launcher's names, references,
launch records and refusals on the CPU; on a GPU the fixed twins against float64. The *_bug
kernels run only under compute-sanitizer in a process of their own (the lesson does that)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import cudabook as cb

sd = cb.load_launch("sanitizer_demo")
gpu = pytest.mark.gpu
SRC = Path(__file__).resolve().parent.parent / "kernels" / "sanitizer_demo.cu"


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
    s = sd.reference("smooth", x)
    assert s[0] == pytest.approx((0 + 1 + 2) / 3) and s[-1] == pytest.approx((599 + 600) / 3)
    assert s[10] == pytest.approx(11)
    m = np.array([[-5, -2, -9], [1, 7, 3]], dtype=np.float32)
    assert list(sd.reference("rowmax", m)) == [-2, 7]


def test_config_and_refusals():
    assert tuple(sd.config("shift", 1000)) == ((4,), (256,))
    assert tuple(sd.config("rowmax", 300)) == ((3,), (128,))
    with pytest.raises(cb.LaunchError, match="case is one of shift, reverse, rowmax, smooth"):
        sd.config("oob", 10)


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
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@gpu
def test_bad_input_is_refused_before_a_launch():
    import cupy as cp

    with pytest.raises(cb.LaunchError, match="at least one column"):
        sd.demo("rowmax", cp.zeros((3, 0), cp.float32))
    with pytest.raises((TypeError, ValueError, cb.LaunchError)):
        sd.demo("shift", cp.zeros(8, cp.float64))
