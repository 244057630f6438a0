"""cudabook.roofline without a GPU: the published tensor-core table, ridge points, the compute
roofs a lesson passes to draw(), and the old FP32-only call path."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cudabook as cb  # noqa: E402
from cudabook.roofline import (  # noqa: E402
    TC_DATASHEET,
    TC_FLOP_PER_CLK,
    Roof,
    draw,
    measured_roof,
    published_roofs,
    ridge,
)

A100 = Roof("A100", 108, 64, 1.41, 1555.0, 5000.0)


def test_table_matches_the_published_datasheet_peaks():
    """SMs x flop/clk/SM x boost clock gives back NVIDIA's dense figure to 0.2%."""
    assert TC_DATASHEET.keys() == TC_FLOP_PER_CLK.keys()
    for cc, (gpu, sms, ghz, tflops) in TC_DATASHEET.items():
        assert tflops.keys() == TC_FLOP_PER_CLK[cc].keys(), gpu
        for p, tf in tflops.items():
            got = dict(published_roofs([p], cc=cc, sms=sms, clock_ghz=ghz))
            assert got[f"{p} tensor core (published peak)"] == pytest.approx(tf, rel=2e-3), \
                (gpu, p)


@pytest.mark.parametrize("cc, sms, ghz, want", [
    ((7, 5), 40, 1.59, {"fp16": 65.1, "int8": 130.3}),                    # T4
    ((8, 0), 108, 1.41, {"fp16": 311.9, "bf16": 311.9, "tf32": 156.0, "int8": 623.7}),  # A100
    ((9, 0), 132, 1.83, {"fp16": 989.4, "bf16": 989.4, "tf32": 494.7, "fp8": 1978.9,
                         "int8": 1978.9}),                                # H100 / H200 SXM
])
def test_known_gpus(cc, sms, ghz, want):
    got = published_roofs(cc=cc, sms=sms, clock_ghz=ghz)
    assert [n for n, _ in got] == [f"{p} tensor core (published peak)" for p in want]
    for (_, tf), w in zip(got, want.values()):
        assert tf == pytest.approx(w, abs=0.1)


def test_unlisted_compute_capability_gives_no_published_roof():
    assert published_roofs(cc=(8, 6), sms=82, clock_ghz=1.7) == []
    with pytest.raises(ValueError, match=r"no published bf16 tensor-core peak for sm_86"):
        published_roofs("bf16", cc=(8, 6), sms=82, clock_ghz=1.7)
    with pytest.raises(ValueError, match=r"no published fp8 .* sm_80 \(published here: fp16"):
        published_roofs(["fp8"], cc=(8, 0), sms=108, clock_ghz=1.41)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"unknown precision 'fp4'; one of fp16, bf16"):
        published_roofs(["fp4"], cc=(9, 0), sms=132, clock_ghz=1.83)
    with pytest.raises(ValueError, match="bandwidth must be > 0 GB/s, got -1"):
        ridge(100.0, -1.0)
    with pytest.raises(ValueError, match="compute roof must be > 0"):
        ridge(0.0, 100.0)
    with pytest.raises(ValueError, match="dram_gbs must be > 0 GB/s, got -5"):
        Roof("x", 1, 64, 1.0, -5.0)
    with pytest.raises(ValueError, match="l2_gbs must be > 0"):
        Roof("x", 1, 64, 1.0, 5.0, 0.0)
    with pytest.raises(ValueError, match="sms and clock_ghz must be > 0"):
        published_roofs(cc=(8, 0), sms=0, clock_ghz=1.41)
    with pytest.raises(ValueError, match="cuBLAS bf16: TFLOP/s must be > 0"):
        measured_roof("cuBLAS bf16", -3.0)
    with pytest.raises(ValueError, match=r"each roof is \(name, TFLOP/s\)"):
        draw(A100, roofs=[300.0])
    plt.close("all")


def test_ridge_points():
    assert ridge(312.0, 1555.0) == pytest.approx(312e3 / 1555)
    assert A100.ridge == pytest.approx(ridge(A100.peak_tflops, 1555.0))
    assert A100.peak_tflops == pytest.approx(108 * 64 * 2 * 1.41 / 1e3)
    assert measured_roof("cuBLAS bf16", 280) == ("cuBLAS bf16 (measured)", 280.0)


def test_old_call_path_draws_the_same_figure():
    """draw(roof, ...) without roofs: the FP32 line, the L2 line on request and one ridge."""
    fig, ax = plt.subplots()
    assert draw(A100, ax=ax, imin=0.1, imax=100, l2=True) is ax
    lines = ax.get_lines()
    assert len(lines) == 3
    xs = np.logspace(-1, 2, 200)
    np.testing.assert_allclose(lines[0].get_ydata(), np.minimum(A100.peak_tflops,
                                                                xs * 1555.0 / 1e3))
    assert lines[0].get_label() == f"DRAM roof 1555 GB/s, FP32 peak {A100.peak_tflops:.1f}"
    assert lines[1].get_label() == "L2 roof 5000 GB/s"
    assert lines[2].get_xdata()[0] == pytest.approx(A100.ridge)
    assert len(draw(A100).get_lines()) == 2
    plt.close("all")


def test_draw_several_roofs_headless():
    roofs = published_roofs(cc=(8, 0), sms=108, clock_ghz=1.41) + [measured_roof("cuBLAS bf16",
                                                                                 250.0)]
    ax = draw(A100, imin=0.1, imax=1e4, roofs=roofs)
    ax.figure.canvas.draw()
    lines = ax.get_lines()
    assert len(lines) == 2 + 2 * len(roofs)                  # a roof and a ridge line each
    labels = [ln.get_label() for ln in lines]
    assert sum("(published peak)" in lb for lb in labels) == 4
    assert any(lb.startswith("cuBLAS bf16 (measured) 250 TFLOP/s, ridge 161") for lb in labels)
    top = lines[2].get_ydata()
    assert top.max() == pytest.approx(roofs[0][1])           # flat at the published peak
    ridges = [ln.get_xdata()[0] for ln in lines[3::2]]
    np.testing.assert_allclose(ridges, [tf * 1e3 / 1555.0 for _, tf in roofs])
    plt.close("all")


def test_published_roofs_without_a_gpu_says_why(monkeypatch):
    monkeypatch.setattr(cb.env, "HAS_GPU", False)
    with pytest.raises(RuntimeError, match="no GPU; pass cc, sms and clock_ghz"):
        published_roofs()
