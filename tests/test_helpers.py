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


@pytest.mark.parametrize("out, msg", [
    (None, "out is NoneType, not an array"),
    ("1.0", "out is str, not an array"),
    ({"a": 1}, "out is dict, not an array"),
    (np.ones(3, np.complex64), "out is complex"),
    (np.array(["a", "b", "c"]), "has dtype <U1; expected numbers"),
])
def test_check_says_what_it_expected(out, msg):
    with pytest.raises(TypeError, match=msg):
        cb.check(out, np.ones(3))


def test_check_validates_tolerances_and_reference():
    with pytest.raises(TypeError, match="atol must be a number >= 0, got 'x'"):
        cb.check(np.ones(3), np.ones(3), atol="x")
    with pytest.raises(TypeError, match="rtol must be a number >= 0"):
        cb.check(np.ones(3), np.ones(3), rtol=-1)
    with pytest.raises(TypeError, match="ref is NoneType"):
        cb.check(np.ones(3), None)
    with pytest.raises(TypeError, match="name must be a str"):
        cb.check(np.ones(3), np.ones(3), name=3)


def test_public_helpers_validate_their_arguments():
    with pytest.raises(TypeError, match="shape must be an int or a tuple"):
        cb.empty_nan("3")
    with pytest.raises(TypeError, match="not a real number type"):
        cb.empty_nan(3, np.complex64)
    with pytest.raises(TypeError, match="ceil_div: b must be an int >= 1"):
        cb.ceil_div(3, 0)
    with pytest.raises(TypeError, match="ceil_div: a must be an int"):
        cb.ceil_div(3.5, 2)
    with pytest.raises(TypeError, match="expected a list of result rows"):
        cb.record({"chapter": "ch01"})
    with pytest.raises(ValueError, match="lacks"):
        cb.record([{"chapter": "ch01"}])
    with pytest.raises(TypeError, match="expected a name"):
        cb.load_cuda(3)
    with pytest.raises(TypeError, match="expected a file name"):
        cb.show_source(None)
    with pytest.raises(TypeError, match="expect: name must be a str"):
        cb.expect(np.zeros(2), 2)
    with pytest.raises(KeyError, match="no entry 'nope'"):
        cb.ptx_mix(".entry k(\n)", "nope")


def test_bench_and_sweep_validate_before_they_need_a_gpu():
    with pytest.raises(TypeError, match="fns must be a dict"):
        cb.bench([lambda: None])
    with pytest.raises(TypeError, match="maps names \\(str\\) to functions"):
        cb.bench({"a": 3})
    with pytest.raises(ValueError, match="baseline is an empty dict"):
        cb.bench({"a": lambda: None}, baseline={})
    with pytest.raises(TypeError, match="bytes must be a positive number"):
        cb.bench({"a": lambda: None}, bytes="12")
    with pytest.raises(ValueError, match="not both"):
        cb.bench({"a": lambda: None}, bytes=1, flops=1)
    with pytest.raises(TypeError, match="repeat must be an int >= 1"):
        cb.bench({"a": lambda: None}, repeat=0)
    with pytest.raises(TypeError, match="setup must be a function"):
        cb.sweep([1], {"fns": {}})
    with pytest.raises(ValueError, match="no sizes"):
        cb.sweep([], lambda n: {})


def test_launch_arithmetic():
    assert cb.grid_1d(1000, 256) == (4,) and cb.grid_1d(0, 256) == (1,)
    assert cb.grid_2d(33, 70, 32) == (3, 2) and cb.grid_2d(130, 131, (128, 64)) == (3, 2)
    assert cb.round_up(33, 32) == 64
    assert [cb.row_block(n) for n in (1, 512, 1024, 16384, 40000)] == [32, 32, 64, 1024, 1024]
    if not cb.HAS_GPU:
        with pytest.raises(cb.LaunchError, match="needs a CUDA GPU"):
            cb.need_cc(8, 0, "cp.async")


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
    from cudabook.compile import KERNELS_DIR, inline_source

    src = inline_source(KERNELS_DIR / "vector_add.cu")
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


def test_old_import_paths_still_resolve():
    import cudabook.compile as comp

    assert comp.show_source is cb.show_source and comp.cuda_ptx is cb.cuda_ptx
    assert comp._inline is comp.inline_source
    assert cbench.record is cb.record


def test_no_kernel_is_defined_twice_under_two_names():
    """Every extern "C" kernel body and every __device__ function name of the chapter 1-4 files
    appears once."""
    import re

    mine = {"common.cuh", "vector_add.cu", "copy.cu", "transpose.cu", "reduce.cu", "softmax.cu",
            "norm.cu", "activation.cu", "conv.cu", "matmul.cu", "fma_chain.cu"}
    bodies, devices = {}, {}
    for f in sorted(p for p in (ROOT / "kernels").iterdir() if p.name in mine):
        text = f.read_text()
        for name in re.findall(r'__device__\s+(?:__forceinline__\s+|inline\s+)*[\w:<>]+\s+'
                               r'(\w+)\s*\(', text):
            devices.setdefault(name, set()).add(f.name)
        for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?'
                             r'(\w+)\(([^{]*)\{', text):
            body = cb.kernel_source(f.name, m.group(1)).split("{", 1)[1]
            key = re.sub(r"\s+|//[^\n]*", "", body)
            bodies.setdefault(key, []).append(f"{f.name}:{m.group(1)}")
    same = [v for v in bodies.values() if len(v) > 1]
    assert not same, f"kernels with one body under several names: {same}"
    twice = {n: fs for n, fs in devices.items() if len(fs) > 1}
    assert not twice, f"device functions defined in several files: {twice}"


# ----------------------------------------------------------------------------- results file
def test_record_merges_and_replaces(tmp_path):
    p = tmp_path / "b.json"
    e1 = {"chapter": "ch01", "kernel": "v1", "metric": "GB/s", "value": 1.0, "baseline": "b",
          "baseline_value": 2.0, "ratio": 0.5, "size": 10}
    cb.record([e1], p)
    cb.record([dict(e1, value=1.5, ratio=0.75)], p)
    cb.record([dict(e1, kernel="v2")], p)
    data = json.loads(p.read_text())
    assert {"gpu", "date", "results"} <= set(data)
    assert len(data["results"]) == 2
    assert data["results"][0]["value"] == 1.5


def test_every_stored_row_names_its_gpu_and_day():
    rows = json.loads((ROOT / "reports" / "benchmarks.json").read_text())["results"]
    unnamed = [(e["chapter"], e["kernel"]) for e in rows if not (e.get("gpu") and e.get("date"))]
    assert not unnamed, f"rows without the GPU and day they were measured on: {unnamed[:5]}"


def test_bound_is_the_fraction_of_the_physical_limit():
    from cudabook.baselines import Bound

    b = Bound("decode", own_us=500.0, nbytes=250e6, gbs=4000.0)     # 250 MB at 4 TB/s = 62.5 us
    assert b.kind == "memory bound" and b.bound_us == pytest.approx(62.5)
    assert b.fraction == pytest.approx(0.125) and "12% of the bound" in str(b)
    e = b.entry("ch07", size=1)
    assert (e["baseline"], e["ratio"], e["time_us"]) == ("memory bound", 0.125, 500.0)
    c = Bound("gemm", own_us=100.0, flops=70e9, tflops=700.0)       # 70 GFLOP at 700 TFLOP/s
    assert c.kind == "compute bound" and c.fraction == pytest.approx(1.0)
    for bad in (dict(nbytes=1.0), dict(nbytes=1.0, gbs=1.0, flops=1.0, tflops=1.0),
                dict(nbytes=-1.0, gbs=1.0), dict(nbytes=1.0, gbs=float("nan"))):
        with pytest.raises(ValueError, match="Bound"):
            Bound("x", own_us=1.0, **bad)
    with pytest.raises(ValueError, match="positive"):
        Bound("x", own_us=0.0, nbytes=1.0, gbs=1.0)


def test_results_merge_replaces_only_the_chapters_named(tmp_path):
    from cudabook import results

    book, run = tmp_path / "book.json", tmp_path / "run.json"
    row = {"chapter": "ch03", "kernel": "k", "metric": "GB/s", "value": 1.0, "baseline": None,
           "baseline_value": None, "ratio": None, "size": 1, "time_us": 1.0}
    results.write({"gpu": "A", "date": "2026-01-01",
                   "results": [row, dict(row, kernel="k2"), dict(row, chapter="ch04")]}, book)
    results.write({"gpu": "B", "date": "2026-02-02",
                   "results": [dict(row, value=9.0), dict(row, chapter="ch04", value=7.0)]}, run)
    assert results.merge(run, book, ["03"]) == {"ch03": (2, 1)}
    data = results.read(book)
    assert sorted((e["chapter"], e["kernel"], e["value"]) for e in data["results"]) == \
        [("ch03", "k", 9.0), ("ch04", "k", 1.0)]
    # each row keeps the machine and day it was measured on: the merged row is run B's, the
    # chapter left alone keeps no stamp it never had
    by_ch = {e["chapter"]: e for e in data["results"]}
    assert (by_ch["ch03"]["gpu"], by_ch["ch03"]["date"]) == ("B", "2026-02-02")
    assert "gpu" not in by_ch["ch04"]
    with pytest.raises(ValueError, match="has no rows of \\['ch08'\\]"):
        results.merge(run, book, ["08"])            # a chapter the run did not measure
    assert len(results.read(book)["results"]) == 2  # nothing dropped
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), "merge", str(run),
                        "--chapters", "04", "--into", str(book)], capture_output=True, text=True)
    assert r.returncode == 0 and "ch04: 1 rows replaced by 1" in r.stdout, r.stdout + r.stderr


def test_gpu_lane_refuses_without_a_gpu(tmp_path):
    if cb.HAS_GPU:
        pytest.skip("GPU machine")
    import subprocess

    before = (ROOT / "reports" / "benchmarks.json").read_bytes()
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_lane.sh"), "01"], capture_output=True,
                       text=True, env={**__import__("os").environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "no usable CUDA GPU" in r.stderr
    assert (ROOT / "reports" / "benchmarks.json").read_bytes() == before


def test_sanitizer_registry_finds_every_kernel_with_shared_memory_or_atomics():
    sys.path.insert(0, str(ROOT / "tools"))
    import re

    import sanitize

    reg = sanitize.registry()
    for f in sorted((ROOT / "kernels").glob("*.cu")):
        text = f.read_text()
        if re.search(r"__shared__|atomic\w*\(", text) and (ROOT / "kernels" /
                                                           f"{f.stem}_launch.py").is_file():
            assert f"{f.stem}_launch" in reg, f"{f.name} has no sanitizer targets"
    for op in ("reduce", "softmax", "norm", "conv", "transpose", "matmul"):
        assert f"{op}_launch" in reg and reg[f"{op}_launch"], op


def test_bench_table_ratio_and_text():
    rows = [cbench.Row("cuBLAS", 100.0, 50.0, "TFLOP/s", is_baseline=True),
            cbench.Row("v7", 125.0, 40.0, "TFLOP/s", "cuBLAS", 50.0)]
    t = cbench.BenchTable(rows)
    assert t["v7"].ratio == pytest.approx(0.8)
    assert "= 80% of cuBLAS (50.0)" in str(t)
    assert t.best().name == "v7"


def test_bench_takes_the_fastest_of_several_baselines(monkeypatch):
    # no GPU needed: the timer is replaced by fixed times (us); 1e6 bytes gives GB/s = 1e3 / t
    times = {"graph": 200.0, "compiled": 100.0, "ours": 80.0}
    order = []

    def fake_time(fn, repeat, warmup, flush):
        order.append(fn())
        return times[order[-1]], 1.0

    monkeypatch.setattr(cbench, "_time", fake_time)
    fns = {k: (lambda k=k: k) for k in times}
    rows = cbench._bench_rows({"ours": fns["ours"]},
                              {"graph": fns["graph"], "compiled": fns["compiled"]},
                              1e-3, "GB/s", None, 1, 0, False)
    t = cbench.BenchTable(rows)
    assert [r.name for r in t.rows] == ["compiled", "graph", "ours"]
    assert t.rows[0].is_baseline and not t["graph"].is_baseline and t["graph"].alternative
    assert t["ours"].baseline == "compiled" and t["ours"].ratio == pytest.approx(1.25)
    assert t["graph"].ratio == pytest.approx(0.5)
    assert t.best().name == "ours"
    assert [e["kernel"] for e in t.entries("ch07")] == ["ours"]
    assert [e["kernel"] for e in t.entries("ch07", ["graph"])] == ["graph"]


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


def test_make_exercise_stores_no_unearned_pass():
    import nbformat

    sol = nbtools.from_py("# %%\nimport os  # " + nbtools.SETUP_MARK + "\n# %%\nprint('hi')\n"
                          "# %%\n%%gpu\n# NBVAL_CHECK_OUTPUT\nex09_1(f)\n")
    sol.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    sol.cells[1].execution_count = 2
    sol.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS ex09.1\n")]
    sol.cells[2].execution_count = 3
    ex = nbtools.make_exercise(sol)
    assert ex.cells[1].outputs == [] and ex.cells[1].execution_count is None
    # the grader stores nothing (nbval does not compare an unrun cell; a wrong answer raises)
    assert ex.cells[2].outputs == [] and ex.cells[2].execution_count is None
    assert ex.cells[2].source.startswith("%%gpu\n# Run this cell after your answer: it prints "
                                         "PASS ex09.1")


def test_make_exercise_hints_collapse_and_notes_stay_out():
    sol = nbtools.from_py("# %% [markdown]\n# **Hints ex09.1**\n#\n# 1. Look at the index.\n"
                          "#    It runs past n.\n# 2. Guard with `i < n`.\n"
                          "# %% [markdown]\n# **Solution notes ex09.1.** The guard.\n"
                          "# %%\nx = 1\n")
    ex = nbtools.make_exercise(sol)
    assert len(ex.cells) == 2 and ex.cells[1].source == "x = 1"
    src = ex.cells[0].source
    assert src.count("<details>") == 2 and src.count("</details>") == 2
    assert "<summary>Hint 1 for ex09.1" in src and "Look at the index.\nIt runs past n." in src
    bad = nbtools.from_py("# %% [markdown]\n# **Hints ex09.1**\n#\n# 2. skipped one\n")
    with pytest.raises(ValueError, match="numbered 1, 2"):
        nbtools.make_exercise(bad)


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


def test_smem_optin_is_none_without_a_gpu_and_the_limit_with_one():
    from cudabook.launch import smem_optin

    got = smem_optin()
    if cb.HAS_GPU:
        assert isinstance(got, int) and got >= 48 * 1024 and smem_optin() == got
    else:
        assert got is None


def test_policy_rejects_a_stale_kernel_source():
    import nbformat

    nb = nbtools.from_py('# %%\ncb.show_source("vector_add.cu", "vector_add_v2")\n')
    src = cb.kernel_source("vector_add.cu", "vector_add_v2")
    md = f"`kernels/vector_add.cu`\n```cuda\n{src}```"
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": md})]
    assert nbtools.stale_source_errors(nb, "lessons/09_x.ipynb") == []
    nb.cells[0].outputs[0].data["text/markdown"] = md.replace("i < n", "i <= n")
    errs = nbtools.stale_source_errors(nb, "lessons/09_x.ipynb")
    assert len(errs) == 1 and "as it was when executed" in errs[0]
    nb.cells[0].source = 'cb.show_source("vector_add.cu", "no_such_kernel")'
    assert "which is gone" in nbtools.stale_source_errors(nb, "lessons/09_x.ipynb")[0]


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
    r = ip.run_cell("%%gpu\nc + 1;   # a comment after the ';'")    # still hidden, as in IPython
    assert r.result is None
    assert ip.run_cell("%%gpu\nc + 1  # a ';' inside a comment hides nothing").result == 2
    r = ip.run_cell("%%gpu\nraise ValueError('boom')")         # errors propagate: nbval sees them
    assert isinstance(r.error_in_exec, ValueError)
    monkeypatch.setattr(cudabook.env, "HAS_GPU", False)
    capsys.readouterr()
    ip.run_cell("%%gpu\nd = 1")
    assert "d" not in ip.user_ns and "skipped" in capsys.readouterr().out


def test_gpu_cells_need_skips_the_cells_of_an_older_gpu(monkeypatch, capsys):
    from IPython.testing.globalipapp import get_ipython

    import cudabook

    ip = get_ipython()
    cudabook._register_magic()
    monkeypatch.setattr(cudabook, "_CELLS_NEED", None)
    monkeypatch.setattr(cudabook.env, "HAS_GPU", True)
    monkeypatch.setattr(cudabook.env, "cc", lambda: (7, 5))
    monkeypatch.setattr(cudabook.env, "info", lambda: type("I", (), {"name": "Tesla T4"})())
    assert cudabook.gpu_cells_need(8, 0, "bf16 training") is False
    assert "7.5" in capsys.readouterr().out
    ip.run_cell("%%gpu\ne = 1")
    assert "e" not in ip.user_ns
    assert "skipped: bf16 training need compute capability 8.0+" in capsys.readouterr().out
    monkeypatch.setattr(cudabook.env, "cc", lambda: (9, 0))
    assert cudabook.gpu_cells_need(8, 0, "bf16 training") is True
    ip.run_cell("%%gpu\ne = 1")
    assert ip.user_ns["e"] == 1
    with pytest.raises(TypeError):
        cudabook.gpu_cells_need(8.0)


def test_cuda_ptx_and_instruction_mix():
    """NVRTC compiles without a GPU; the mix finds the unrolled inner loop of the tiled matmul."""
    ptx = cb.cuda_ptx("matmul", "compute_75")
    v1, v5 = cb.ptx_mix(ptx, "matmul_v1"), cb.ptx_mix(ptx, "matmul_v5")
    assert v1["fma"] >= 1 and v1["ld.global"] >= 2          # naive: global loads per FMA
    assert v5["fma"] >= 64 and v5["ld.global"] == 0        # register tile fed from shared memory
    assert v5["int"] < v5["fma"]


def test_cuda_module_compiles_once_and_never_caches_a_failure():
    if cb.HAS_GPU:
        assert cb.cuda_module("vector_add") is cb.cuda_module("vector_add")
    else:       # no GPU: each call refuses again (nothing half-made is kept)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
                cb.cuda_module("vector_add")


@pytest.mark.gpu
def test_bench_times_pytorch_work_whatever_stream_is_current():
    """A failed capture must not leave PyTorch on its capture stream, and cb.bench must time
    PyTorch work on the stream its events are recorded on (else a graph replay reads ~1 us)."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    a = torch.randn(2048, 2048, device="cuda")
    with pytest.raises(RuntimeError):        # a sync inside a capture (torch.AcceleratorError)
        cb.baselines.torch_graph(lambda: (a @ a).sum().item())
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    g = cb.baselines.torch_graph(lambda: a @ a)
    flops = 2.0 * 2048 ** 3                                # 17 GFLOP: far above 1 us at any peak
    floor_us = flops / 2e15 * 1e6                          # even at 2 PFLOP/s
    assert cb.bench({"g": g}, flops=flops, quiet=True)["g"].time_us > floor_us
    with cp.cuda.Stream(non_blocking=True):                # CuPy elsewhere: events follow it
        t = cb.bench({"g": g, "eager": lambda: a @ a}, flops=flops, quiet=True)
    assert min(r.time_us for r in t.rows) > floor_us, str(t)


# ----------------------------------------------------------------------------- imports
def test_import_cudabook_changes_no_environment_and_loads_no_chapter_module():
    """A fresh interpreter: importing cudabook (what chapter 1 does) leaves os.environ as it was
    and loads neither chapter 11's modules nor chapter 5's; they load on first use. The mode
    variables that cudabook.env sets on purpose are given beforehand, so any change is a leak."""
    import os
    import subprocess

    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import cudabook as cb\n"
        "changed = sorted(k for k in set(before) | set(os.environ)\n"
        "                 if before.get(k) != os.environ.get(k))\n"
        "loaded = sorted(m for m in ('cudabook.dist', 'cudabook.collectives', 'cudabook.graphs',\n"
        "                            'cudabook.ncu', 'cudabook.occupancy', 'cudabook.torchtrace')\n"
        "                if m in sys.modules)\n"
        "first = dict(os.environ)\n"
        "from cudabook import dist\n"
        "ok = (cb.graphs.__name__ == 'cudabook.graphs' and dist is cb.dist\n"
        "      and 'ncu' in dir(cb) and dict(os.environ) == first)\n"
        "print(json.dumps({'changed': changed, 'loaded': loaded, 'lazy_ok': ok}))\n")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS": "0",
           "NUMBA_CUDA_WARN_ON_IMPLICIT_COPY": "0"}
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.pop(k, None)                 # absent, so that setting them at import would show
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["changed"] == [], f"importing cudabook changed os.environ: {out['changed']}"
    assert out["loaded"] == [], f"importing cudabook loaded {out['loaded']}"
    assert out["lazy_ok"], "cb.graphs / from cudabook import dist / dir(cb) / env after dist"


def _rank_env(comm):
    import os

    return {k: os.environ.get(k) for k in cb.dist.SAFE_ENV}


def test_multi_gpu_code_runs_with_nvlink_multicast_off(tmp_path, monkeypatch, capsys):
    """What cudabook.dist starts gets SAFE_ENV (NCCL_NVLS_ENABLE=0, ...) even where the caller's
    environment says otherwise: spawn's ranks and torchrun's workers; and this process once
    cupy_nccl hands out NCCL (its communicators are created here)."""
    import importlib.util
    import os

    pytest.importorskip("torch")
    from cudabook import dist

    for k in dist.SAFE_ENV:
        monkeypatch.setenv(k, "caller")
    assert dist.spawn(_rank_env, 2, timeout=60) == [dist.SAFE_ENV] * 2
    script = tmp_path / "env.py"
    script.write_text("import os\nfrom cudabook.dist import SAFE_ENV, write_result\n"
                      "write_result({k: os.environ.get(k) for k in SAFE_ENV})\n")
    assert dist.torchrun(script, 1, timeout=120) == dist.SAFE_ENV
    assert all(os.environ[k] == "caller" for k in dist.SAFE_ENV)   # the notebook's own: as set
    if importlib.util.find_spec("cupy") is not None:
        dist.cupy_nccl()                 # NCCL's module, or None after saying why: either way
        capsys.readouterr()
        assert {k: os.environ.get(k) for k in dist.SAFE_ENV} == dist.SAFE_ENV


def test_cpu_cells_runs_only_the_chosen_cells_and_refuses_gpu_ones(tmp_path):
    """tools/cpu_cells.py: the chosen cells get this run's outputs and the cpu-run tag, every
    other cell keeps its stored output; a %%gpu cell is refused and nothing is written."""
    import subprocess

    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n# %%\nx = 6 * 7\n# %%\nprint(x)\n"
                         "# %%\nprint('kept')\n# %%\n%%gpu\nprint('gpu')\n")
    import nbformat

    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored\n")]
    nb.cells[3].execution_count = 9
    p = tmp_path / "nb.ipynb"
    p.write_text(nbtools.canonical(nb))
    tool = [sys.executable, str(ROOT / "tools" / "cpu_cells.py"), str(p)]
    ids = [c.id for c in nb.cells]
    r = subprocess.run(tool + [ids[4]], capture_output=True, text=True)
    assert r.returncode != 0 and "needs a GPU" in r.stderr + r.stdout
    assert p.read_text() == nbtools.canonical(nb)                 # nothing written
    r = subprocess.run(tool + ["--context", ids[1], ids[2]], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    after = nbtools.read(p)
    assert "".join(o.get("text", "") for o in after.cells[2].outputs) == "42\n"
    assert after.cells[2].metadata.get("tags") == ["cpu-run"]
    assert after.cells[3].outputs[0]["text"] == "stored\n" and after.cells[3].execution_count == 9
    assert not after.cells[1].outputs                             # a context cell keeps none


def test_policy_refuses_a_cpu_run_tag_on_a_cell_that_needs_a_gpu(tmp_path):
    """A cell may store a CPU run's output (tag cpu-run) only if it needs no GPU."""
    (tmp_path / "lessons").mkdir()
    nb = nbtools.from_py("# %%\n" + nbtools.SETUP_CELL + "\n# %%\n%%gpu\nprint(1)\n"
                         "# %%\nprint(2)\n")
    for c in nb.cells[1:]:
        c.metadata["tags"] = ["cpu-run"]
    p = tmp_path / "lessons" / "09_x.ipynb"
    p.write_text(nbtools.canonical(nb))
    old = nbtools.ROOT
    nbtools.ROOT = tmp_path
    try:
        errs = [e for e in nbtools.policy_errors(p) if "cpu-run" in e]
    finally:
        nbtools.ROOT = old
    assert len(errs) == 1 and "cell 1" in errs[0], errs


def test_expect_one_gpu_and_overlaps():
    from cudabook import validate

    a = np.zeros(10, np.float32)
    assert validate.overlaps(a[:5], a[3:]) and not validate.overlaps(a[:5], a[5:])
    assert validate.overlaps(a[:2], a[4:], nbytes=20) and not validate.overlaps(a[:2], a[5:], 20)
    with pytest.raises(TypeError, match="x: expected a GPU array .* on the host"):
        validate.expect_one_gpu(("x", a))


def _block_total_kernel():
    """A kernel whose shared array every thread of a block writes once: the simulator resolves
    ``cuda`` through the function's module globals, so it is compiled from this module's."""
    return _BLOCK_TOTAL


@pytest.mark.simulator
def test_poisoned_memory_gives_every_thread_of_a_block_the_same_shared_array():
    """The simulator makes a block's shared array when the first thread reaches its line, with no
    lock: under frequent thread switches two threads can each make one, and a NaN-filled array
    that no other thread writes then fails a right kernel. poisoned_memory makes it under a lock
    (without it, 7 to 9 of 30 such launches came out wrong here)."""
    from cudabook.graders import _core

    kernel = _block_total_kernel()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            out = np.zeros(4, np.float32)
            with _core.poisoned_memory():
                kernel[4, 64](out)
            assert (out == 64).all(), out
    finally:
        sys.setswitchinterval(old)


def _block_total(out):
    s = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    s[t] = 1.0
    cuda.syncthreads()
    if t == 0:
        acc = 0.0
        for i in range(64):
            acc += s[i]
        out[cuda.blockIdx.x] = acc


from numba import cuda, float32  # noqa: E402  (after cudabook: it picks the simulator first)

_BLOCK_TOTAL = cuda.jit(_block_total)
