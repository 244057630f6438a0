"""Unit tests of the helper package and the notebook tools (CPU; GPU parts marked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import cudabook as cb
from cudabook.check import CheckError

cbench = sys.modules["cudabook.bench"]  # the module (cb.bench is the function)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import nbtools  # noqa: E402


# ----------------------------------------------------------------------------- check
def test_check_passes_within_tolerance():
    ref = np.linspace(-1, 1, 1000)
    assert cb.check(ref.astype(np.float32), ref) < 1e-6


def test_check_catches_unwritten_nan_and_names_index():
    out = cb.empty_nan(10)
    out[:7] = np.arange(7)
    with pytest.raises(CheckError, match=r"3 are NaN: never written") as e:
        cb.check(out, np.arange(10.0))
    assert "at 7: got nan" in str(e.value)


def test_check_reports_2d_index_and_shape_mismatch():
    ref = np.zeros((3, 4))
    out = np.zeros((3, 4), np.float32)
    out[2, 1] = 1
    with pytest.raises(CheckError, match=r"at \(2, 1\)"):
        cb.check(out, ref)
    with pytest.raises(CheckError, match="shape"):
        cb.check(out.T, ref)


def test_check_tolerance_depends_on_dtype():
    ref = np.full(4, 1.0)
    cb.check(np.full(4, 1.004, np.float16), ref)            # fine for half precision
    with pytest.raises(CheckError):
        cb.check(np.full(4, 1.004, np.float32), ref)        # not for float32


def test_check_accepts_matching_infinities_rejects_wrong_sign():
    ref = np.array([np.inf, -np.inf, 1.0])
    cb.check(np.array([np.inf, -np.inf, 1.0], np.float32), ref)
    with pytest.raises(CheckError):
        cb.check(np.array([-np.inf, -np.inf, 1.0], np.float32), ref)


def test_empty_nan_integers_use_minus_one():
    assert (cb.empty_nan(5, np.int32) == -1).all()
    assert np.isnan(cb.empty_nan((2, 3))).all()


# ----------------------------------------------------------------------------- mode and sizes
def test_simulator_mode_and_pick():
    if cb.HAS_GPU:
        pytest.skip("GPU machine")
    assert cb.SIM and cb.pick(gpu=1 << 20, sim=16) == 16
    assert not cb.require_gpu("a CuPy cell")


def test_report_prints_mode(capsys):
    cb.report()
    out = capsys.readouterr().out
    assert ("SIMULATOR" in out) != cb.HAS_GPU
    assert "numpy" in out


def test_ceil_div():
    assert [cb.ceil_div(n, 256) for n in (1, 256, 257, 0)] == [1, 1, 2, 0]


# ----------------------------------------------------------------------------- kernel sources
def test_every_cu_file_has_a_header_listing_its_versions():
    for f in sorted((ROOT / "kernels").glob("*.cu")):
        text = f.read_text()
        names = sorted(set(__import__("re").findall(r"__global__\s+void\s+(?:__launch_bounds__"
                                                    r"\([^)]*\)\s*)?(\w+_v\d+)\b", text)))
        header = text.split("#include")[0] if "#include" in text else text[:3000]
        missing = [n for n in names if n not in header]
        assert not missing, f"{f.name}: versions missing from the header block: {missing}"


def test_inline_includes_keeps_line_markers():
    from cudabook.compile import KERNELS_DIR, _inline

    src = _inline(KERNELS_DIR / "vector_add.cu")
    assert '#line 1 "kernels/common.cuh"' in src
    assert "warp_sum" in src
    # after the include, line numbers resume at the line below it in vector_add.cu
    lines = (KERNELS_DIR / "vector_add.cu").read_text().splitlines()
    inc = next(i for i, s in enumerate(lines, 1) if s.startswith("#include"))
    assert f'#line {inc + 1} "kernels/vector_add.cu"' in src


def test_show_source_extracts_one_kernel():
    c = cb.kernel_source("vector_add.cu", "vector_add_v2")
    assert "gridDim.x * blockDim.x" in c and "vector_add_v1" not in c
    assert c.rstrip().endswith("}")
    p = cb.kernel_source("vector_add.py", "vector_add_v1")
    assert p.startswith("@cuda.jit") and "vector_add_v2" not in p
    assert "def vector_add_v1(x, y, z):" in p and p.rstrip().endswith("z[i] = x[i] + y[i]")


def test_load_numba_twin_runs_in_simulator_or_gpu():
    nb = cb.load_numba("vector_add")
    x = np.arange(300, dtype=np.float32)
    z = cb.empty_nan(300)
    from numba import cuda

    dz = cuda.to_device(z)
    nb.vector_add_v1[2, 256](cuda.to_device(x), cuda.to_device(x), dz)
    cb.check(dz.copy_to_host(), 2.0 * x)


def test_compile_source_without_gpu_says_why():
    if cb.HAS_GPU:
        pytest.skip("GPU machine")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        cb.compile_source('extern "C" __global__ void k() {}')
    with pytest.raises(cb.BenchError, match="needs a CUDA GPU"):
        cb.bench({"x": lambda: None})


def test_load_cuda_unknown_file():
    with pytest.raises(FileNotFoundError, match="kernels/ has"):
        cb.load_cuda("no_such_op")


# ----------------------------------------------------------------------------- results file
def test_record_merges_and_replaces(tmp_path):
    p = tmp_path / "b.json"
    e1 = {"chapter": "ch01", "kernel": "v1", "metric": "GB/s", "value": 1.0, "baseline": "b",
          "baseline_value": 2.0, "ratio": 0.5, "size": 10}
    cbench.record([e1], p)
    cbench.record([dict(e1, value=1.5, ratio=0.75)], p)
    cbench.record([dict(e1, kernel="v2")], p)
    data = json.loads(p.read_text())
    assert {"gpu", "date", "results"} <= set(data)
    assert len(data["results"]) == 2
    assert data["results"][0]["value"] == 1.5


def test_bench_table_ratio_and_text():
    rows = [cbench.Row("cuBLAS", 100.0, 50.0, "TFLOP/s", is_baseline=True),
            cbench.Row("v7", 125.0, 40.0, "TFLOP/s", "cuBLAS", 50.0)]
    t = cbench.BenchTable(rows)
    assert t["v7"].ratio == pytest.approx(0.8)
    assert "= 80% of cuBLAS (50.0)" in str(t)
    assert t.best().name == "v7"


# ----------------------------------------------------------------------------- notebook tools
def test_strip_solutions_python_and_cuda():
    src = ("def f(x):\n    ### BEGIN SOLUTION ex09.1\n    y = x + 1\n    return y\n"
           "    ### END SOLUTION\n\n"
           "s = r'''\n__global__ void k() {\n    // BEGIN SOLUTION ex09.2\n    int i = 0;\n"
           "    // END SOLUTION\n}\n'''")
    out = nbtools.strip_solutions(src)
    assert '    raise NotImplementedError("ex09.1")' in out
    assert "# TODO ex09.1 (roughly 2 lines)" in out
    assert "    // TODO ex09.2 (roughly 1 line)" in out
    assert "y = x + 1" not in out and "int i = 0" not in out
    assert "__trap" not in out


def test_strip_solutions_unclosed_region_is_an_error():
    with pytest.raises(ValueError, match="never closed"):
        nbtools.strip_solutions("### BEGIN SOLUTION ex09.1\nx = 1\n")


def test_make_exercise_keeps_only_grader_pass_lines():
    import nbformat

    sol = nbtools.from_py("# %%\nimport os  # " + nbtools.SETUP_MARK + "\n# %%\nprint('hi')\n"
                          "# %%\n# NBVAL_CHECK_OUTPUT\nex09_1(f)\n")
    sol.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    sol.cells[1].execution_count = 2
    sol.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS ex09.1\n")]
    sol.cells[2].execution_count = 3
    ex = nbtools.make_exercise(sol)
    assert ex.cells[1].outputs == [] and ex.cells[1].execution_count is None
    assert ex.cells[2].outputs[0].text == "PASS ex09.1\n"
    assert ex.cells[2].execution_count == 3   # nbval only compares cells that were run


def test_repository_notebooks_follow_policy_except_gpu_stamp():
    errs = []
    for d in ("lessons", "solutions", "exercises"):
        for p in sorted((ROOT / d).glob("*.ipynb")):
            errs += [e for e in nbtools.policy_errors(p)
                     if "not executed on a GPU" not in e]
    assert not errs, "\n".join(errs)


def test_policy_rejects_outputs_in_exercises(tmp_path):
    import nbformat

    (tmp_path / "exercises").mkdir()
    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n# %%\nprint(1)\n")
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    p = tmp_path / "exercises" / "09_x.ipynb"
    p.write_text(nbtools.canonical(nb))
    old = nbtools.ROOT
    nbtools.ROOT = tmp_path
    try:
        errs = nbtools.policy_errors(p)
    finally:
        nbtools.ROOT = old
    assert any("has outputs" in e for e in errs)
    assert any("no grader cell" in e for e in errs)


def test_exercises_in_sync():
    assert nbtools.cmd_exercises(check=True) == 0


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_bench_refuses_a_wrong_kernel():
    import cupy as cp

    out = cp.zeros(1000, cp.float32)
    with pytest.raises(cb.BenchError, match="refusing to time bad"):
        cb.bench({"bad": lambda: out.fill(1)}, bytes=4000,
                 check=lambda name: cb.check(out, np.zeros(1000)))


@pytest.mark.gpu
def test_bench_hides_numba_launch_overhead():
    """The same kernel launched from Numba (slow host launch) and CuPy times about the same."""
    import cupy as cp
    from numba import cuda

    n = 1 << 22
    mod, nb = cb.load_cuda("vector_add"), cb.load_numba("vector_add")
    x, y = cp.random.rand(n, dtype=cp.float32), cp.random.rand(n, dtype=cp.float32)
    z1, z2 = cp.empty_like(x), cp.empty_like(x)
    # a Numba launch costs ~100+ us of host work, more than this kernel takes on the GPU
    nx, ny, nz = (cuda.as_cuda_array(a) for a in (x, y, z2))
    t = cb.bench({"numba": lambda: nb.vector_add_v1[n // 256, 256](nx, ny, nz),
                  "cupy": lambda: mod.vector_add_v1((n // 256,), (256,), (x, y, z1, np.int32(n)))},
                 bytes=12 * n, quiet=True)
    assert t["numba"].time_us < 1.5 * t["cupy"].time_us, str(t)


@pytest.mark.gpu
def test_compile_error_points_at_real_file_and_line():
    with pytest.raises(RuntimeError, match=r"mine\.cu\(3\)"):
        cb.compile_source('extern "C" __global__ void k(float* x) {\n'
                          '    x[0] = 1.0f;\n    this is not C++;\n}\n', name="mine.cu")


@pytest.mark.gpu
def test_toolkit_include_dir_found_and_mma_compiles():
    assert cb.cuda_include_dir() is not None
    src = ('#include <mma.h>\n#include <cuda_fp16.h>\nextern "C" __global__ void k(half* x) '
           '{ x[0] = __float2half(1.0f); }\n')
    cb.compile_source(src, name="mma_include.cu").get("k")


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("arr, kw, err, msg", [
    (np.zeros(4, np.float64), dict(dtype=np.float32), TypeError, "expected dtype float32"),
    (np.zeros((4, 2), np.float32), dict(ndim=1), ValueError, "expected 1 dimensions"),
    (np.zeros((4, 2), np.float32), dict(shape=(None, 3)), ValueError, r"shape \('\*', 3\)"),
    (np.zeros((4, 4), np.float32)[:, ::2], dict(), ValueError, "C-contiguous"),
    ([1.0, 2.0], dict(), TypeError, "expected an array"),
])
def test_expect_rejects_bad_input(arr, kw, err, msg):
    with pytest.raises(err, match=msg):
        cb.expect(arr, "x", device=False, **kw)


def test_expect_accepts_good_input_and_torch():
    import torch

    cb.expect(np.zeros((3, 5), np.float32), "x", dtype=np.float32, shape=(3, None), device=False)
    cb.expect(torch.zeros(3, 5), "t", dtype=np.float32, ndim=2, device=False)
    with pytest.raises(ValueError, match="C-contiguous"):
        cb.expect(torch.zeros(3, 5).t(), "t", device=False)


@pytest.mark.gpu
def test_expect_rejects_host_arrays_on_a_gpu():
    with pytest.raises(TypeError, match="expected a GPU array"):
        cb.expect(np.zeros(3, np.float32), "x")


# ----------------------------------------------------------------------------- %%gpu magic
def test_gpu_cell_magic_runs_skips_and_raises(monkeypatch, capsys):
    from IPython.testing.globalipapp import get_ipython

    import cudabook

    ip = get_ipython()
    cudabook._register_magic()
    monkeypatch.setattr(cudabook.env, "HAS_GPU", True)       # pretend: run the body
    ip.run_cell("%%gpu\na = 2\nb = a * 21\nb")
    assert ip.user_ns["b"] == 42
    r = ip.run_cell("%%gpu\nc = 1\nc + 1;")                   # ';' hides the value
    assert r.result is None and ip.user_ns["c"] == 1
    assert ip.run_cell("%%gpu\nc + 1").result == 2
    r = ip.run_cell("%%gpu\nraise ValueError('boom')")         # errors propagate: nbval sees them
    assert isinstance(r.error_in_exec, ValueError)
    monkeypatch.setattr(cudabook.env, "HAS_GPU", False)
    capsys.readouterr()
    ip.run_cell("%%gpu\nd = 1")
    assert "d" not in ip.user_ns and "skipped" in capsys.readouterr().out


def test_cuda_ptx_and_instruction_mix():
    """NVRTC compiles without a GPU; the mix finds the unrolled inner loop of the tiled matmul."""
    ptx = cb.cuda_ptx("matmul", "compute_75")
    v1, v5 = cb.ptx_mix(ptx, "matmul_v1"), cb.ptx_mix(ptx, "matmul_v5")
    assert v1["fma"] >= 1 and v1["ld.global"] >= 2          # naive: global loads per FMA
    assert v5["fma"] >= 64 and v5["ld.global"] == 0        # register tile fed from shared memory
    assert v5["int"] < v5["fma"]
