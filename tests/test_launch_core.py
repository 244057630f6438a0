"""The launch core: the launch record, version names, array descriptions, TMA argument checks,
the module loader's options and the kernel cache (CPU; GPU parts marked)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cudabook as cb
from cudabook import compile as cc_mod
from cudabook.launch import Launch, LaunchError, version_name

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- Launch
def test_launch_record_is_a_grid_block_tuple_with_fields():
    cfg = Launch(4, (128,), shared=2048, kernel="k_v1", tile=32)
    grid, block = cfg
    assert (grid, block) == ((4,), (128,)) and cfg == ((4,), (128,))
    assert cfg[0] == (4,) and cfg[1] == (128,)
    assert cfg.shared == 2048 and cfg["kernel"] == "k_v1" and cfg.get("tile") == 32
    assert cfg.get("missing", 7) == 7 and cfg.threads == 128
    assert "tile" in cfg and "missing" not in cfg and (4,) in cfg
    assert set(cfg.keys()) == {"grid", "block", "shared", "kernel", "tile"}
    assert pickle.loads(pickle.dumps(cfg)).as_dict() == cfg.as_dict()
    assert cfg.replace(shared=0).shared == 0 and cfg.shared == 2048
    assert "shared=2048" in repr(cfg)


def test_launch_record_names_what_it_has():
    cfg = Launch((1, 2), (32, 4))
    with pytest.raises(KeyError, match="has no 'smem'.*'shared'"):
        cfg["smem"]
    with pytest.raises(AttributeError, match="has no 'smem'"):
        _ = cfg.smem
    assert cfg.threads == 128 and cfg.kernel is None


# ----------------------------------------------------------------------------- versions
@pytest.mark.parametrize("given", ["v3", "softmax_v3"])
def test_version_name_takes_both_spellings(given):
    assert version_name(("softmax_v1", "softmax_v3"), given, "softmax") == "softmax_v3"
    assert version_name(("v1", "v3"), given, "softmax") == "v3"


def test_version_name_refuses_with_the_ladder():
    with pytest.raises(ValueError, match=r"unknown version 'v9'; softmax has \('softmax_v1',"):
        version_name(("softmax_v1",), "v9", "softmax")
    with pytest.raises(TypeError, match="must be a str"):
        version_name(("v1",), 1, "op")


# ----------------------------------------------------------------------------- arrays
def test_describe_reads_numpy_and_torch_alike():
    a = np.zeros((3, 4), np.float32)
    info = cb.describe(a, "a")
    assert (info.lib, info.shape, info.dtype, info.contiguous, info.on_device) == \
        ("numpy", (3, 4), "float32", True, False)
    assert info.ptr == a.ctypes.data and info.itemsize == 4 and info.size == 12
    assert not cb.describe(a.T, "aT").contiguous
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 5, dtype=torch.bfloat16)
    ti = cb.describe(t, "t")
    assert (ti.lib, ti.shape, ti.dtype, ti.on_device, ti.itemsize) == \
        ("torch", (2, 5), "bfloat16", False, 2)
    assert not cb.describe(t.t(), "tT").contiguous


def test_describe_refuses_what_is_not_an_array():
    with pytest.raises(TypeError, match=r"x: expected an array .*builtins.list"):
        cb.describe([1, 2, 3], "x")


def test_expect_compares_torch_dtypes_by_name():
    torch = pytest.importorskip("torch")
    cb.expect(torch.zeros(3, dtype=torch.bfloat16), "t", dtype=torch.bfloat16, device=False)
    with pytest.raises(TypeError, match="t: expected dtype float16, got bfloat16"):
        cb.expect(torch.zeros(3, dtype=torch.bfloat16), "t", dtype=torch.float16, device=False)


# ----------------------------------------------------------------------------- TMA
@pytest.mark.parametrize("args, msg", [
    ((8, 64, 64, 64, 64, "float16"), "16-byte aligned rows and start address"),
    ((0, 64, 60, 64, 64, "int8"), "16-byte aligned"),
    ((0, 64, 64, 300, 64, "float16"), "1..256 elements a side"),
    ((0, 64, 128, 64, 128, "float16"), "wider than the 128-byte swizzle"),
    ((0, 64, 64, 64, 64, "float64"), "is not one of"),
    ((0, 0, 64, 64, 64, "float16"), "an empty matrix"),
])
def test_tensor_map_refuses_what_tma_cannot_describe(args, msg):
    with pytest.raises(LaunchError, match=msg):
        cb.tma.tensor_map(*args)


# ----------------------------------------------------------------------------- modules
def test_arch_rule_is_sm90a_on_hopper_only():
    assert cc_mod.arch_options(True, (9, 0)) == ("-arch=sm_90a",)
    assert cc_mod.arch_options(True, (8, 0)) == ()
    assert cc_mod.arch_options(True, (10, 0)) == ()
    assert cc_mod.arch_options(False, (9, 0)) == ()


def test_module_composes_the_options_once(monkeypatch):
    seen = []
    monkeypatch.setattr(cc_mod, "_module", lambda n, o, e: seen.append((n, o, e)) or "mod")
    monkeypatch.setattr(cc_mod, "arch_options", lambda a=False, cc=None: ("-arch=sm_90a",) if a
                        else ())
    assert cc_mod.module("attention_forward", only="attention_v4", a_features=True) == "mod"
    assert cc_mod.module("qgemv", ("-DX=1",), only=("qgemv_w4_v7", "qgemv_w8_v1"),
                         name_expressions=["k<1>"]) == "mod"
    assert seen == [("attention_forward", ("-arch=sm_90a", "-DCB_ONLY",
                                           "-DCB_ONLY_attention_v4"), None),
                    ("qgemv", ("-DX=1", "-DCB_ONLY", "-DCB_ONLY_qgemv_w4_v7",
                               "-DCB_ONLY_qgemv_w8_v1"), ("k<1>",))]
    with pytest.raises(ValueError, match="a ladder step is a C identifier"):
        cc_mod.module("qgemv", only="v7; rm -rf")


# ----------------------------------------------------------------------------- kernel cache
def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDABOOK_CACHE_DIR", str(tmp_path / "k"))
    assert cc_mod.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("CUDABOOK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cc_mod.cache_dir() == tmp_path / "cudabook" / "kernels"
    monkeypatch.setenv("CUDABOOK_KERNEL_CACHE", "0")
    assert not cc_mod._cache_on()


def test_cache_key_changes_with_everything_that_decides_the_binary():
    pytest.importorskip("cupy")
    base = cc_mod._cache_key("src", ("-O3",), ("k<1>",), "90")
    assert base == cc_mod._cache_key("src", ("-O3",), ("k<1>",), "90")
    others = {cc_mod._cache_key("src ", ("-O3",), ("k<1>",), "90"),
              cc_mod._cache_key("src", ("-O2",), ("k<1>",), "90"),
              cc_mod._cache_key("src", ("-O3",), ("k<2>",), "90"),
              cc_mod._cache_key("src", ("-O3",), ("k<1>",), "80")}
    assert base not in others and len(others) == 4


class _FakeCompiler:
    def __init__(self):
        self.calls = 0

    def compile_using_nvrtc(self, src, opts, arch, name_expressions=None):
        self.calls += 1
        return b"BINARY-" + src.encode(), {"k<1>": "_Z1kILi1EEvv"}


def test_cache_compiles_once_then_loads_and_recompiles_a_damaged_entry(monkeypatch, tmp_path):
    pytest.importorskip("cupy")
    import cupy.cuda

    fake = _FakeCompiler()
    monkeypatch.setattr(cupy.cuda, "compiler", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda.compiler", fake)
    monkeypatch.setattr(cc_mod, "_arch", lambda: "90")
    loaded = []

    class Raw:
        def __init__(self, path, mapping):
            loaded.append((Path(path).read_bytes(), mapping))

    monkeypatch.setattr(cc_mod, "_CachedRaw", Raw)
    monkeypatch.setenv("CUDABOOK_CACHE_DIR", str(tmp_path))
    cc_mod._cached_compile("A", ("-O3",), ("k<1>",), "t.cu")
    cc_mod._cached_compile("A", ("-O3",), ("k<1>",), "t.cu")
    assert fake.calls == 1 and loaded[0] == loaded[1] == (b"BINARY-A",
                                                          {"k<1>": "_Z1kILi1EEvv"})
    cc_mod._cached_compile("B", ("-O3",), ("k<1>",), "t.cu")        # another source
    assert fake.calls == 2
    (binary,) = [p for p in tmp_path.glob("*.cubin") if p.read_bytes() == b"BINARY-A"]
    binary.write_bytes(b"BINARY-X")                                  # damaged on disk
    cc_mod._cached_compile("A", ("-O3",), ("k<1>",), "t.cu")
    assert fake.calls == 3 and loaded[-1][0] == b"BINARY-A"
    meta = json.loads(binary.with_suffix(".json").read_text())
    assert meta["options"] == ["-O3"] and meta["arch"] == "90"
    assert not list(tmp_path.glob("*.tmp"))
    assert cc_mod.clear_cache.__doc__ and cc_mod.clear_cache() == 4
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_a_fresh_process_loads_compiled_kernels_from_the_cache(tmp_path):
    """Two fresh processes launch the same kernel: the first compiles it into an empty cache,
    the second loads it without calling the compiler."""
    script = textwrap.dedent("""
        import json, sys
        import cupy
        import cudabook as cb
        from cupy.cuda import compiler
        calls = []
        real = compiler.compile_using_nvrtc
        compiler.compile_using_nvrtc = lambda *a, **k: calls.append(1) or real(*a, **k)
        sm = cb.load_launch("softmax")
        x = cupy.random.standard_normal((4, 1000), dtype=cupy.float32)
        y = sm.softmax(x)
        ok = bool(abs(float(y.sum()) - 4.0) < 1e-3)
        print(json.dumps({"compiles": len(calls), "ok": ok}))
    """)
    env = {**os.environ, "CUDABOOK_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0] == {"compiles": 1, "ok": True}, runs
    assert runs[1] == {"compiles": 0, "ok": True}, runs
