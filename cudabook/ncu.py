"""Nsight Compute from a notebook: the counters that explain a kernel's speed, as a table.

    def ladder():                               # self-contained: its own imports
        import cupy as cp, cudabook as cb
        ...                                     # launch the kernels once each

    rep = cb.ncu.profile(ladder, kernel="regex:matmul_v", launch_count=10)
    print(rep)                                  # one row per launch: the key counters
    rep.show("matmul_v10")                      # one launch, section by section

``profile`` writes the function (or a string of Python source) to a script and runs it under
``ncu`` in a subprocess, which replays each selected kernel launch once per group of counters
(caches flushed before each replay), and parses ``ncu --csv --page raw``. The function runs in a
fresh interpreter: it must import what it needs and cannot see the notebook's variables.

Where counters cannot be read - no ``ncu``, no permission to the performance counters (most
cloud notebooks, containers without ``CAP_SYS_ADMIN``: ``ERR_NVGPUCTRPERM``), simulator mode -
the report is empty, says why in one line, and printing it prints that line: cells still run.
"""

from __future__ import annotations

import csv
import glob
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import env

__all__ = ["METRICS", "STALLS", "KernelProfile", "NcuReport", "find_ncu", "profile", "parse_csv"]

#: label -> Nsight Compute metric (units: --print-units base, so ns, bytes, percent)
METRICS: dict[str, str] = {
    "time_ns": "gpu__time_duration.sum",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes": "dram__bytes.sum",
    "fma_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "issue_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "occ_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "occ_limit_warps": "launch__occupancy_limit_warps",          # blocks per SM each limit
    "occ_limit_blocks": "launch__occupancy_limit_blocks",        # allows (the theoretical
    "occ_limit_regs": "launch__occupancy_limit_registers",       # occupancy is their minimum)
    "occ_limit_smem": "launch__occupancy_limit_shared_mem",
    "max_warps": "device__attribute_max_warps_per_multiprocessor",
    "regs": "launch__registers_per_thread",
    "smem_static": "launch__shared_mem_per_block_static",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "block": "launch__block_size",
    "grid": "launch__grid_size",
    "l1_hit_pct": "l1tex__t_sector_hit_rate.pct",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "gld_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "gld_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "bank_ld": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "bank_st": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
}

#: warp-stall reasons: smsp__warp_issue_stalled_<reason>_per_warp_active.pct is the percentage
#: of the cycles a warp was resident in which it could not issue for that reason
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "wait", "not_selected", "dispatch_stall", "no_instruction",
          "branch_resolving", "membar", "drain", "imc_miss", "tex_throttle", "sleeping", "misc")
_STALL = "smsp__warp_issue_stalled_{}_per_warp_active.pct"


@dataclass
class KernelProfile:
    """The counters of one profiled kernel launch (``values`` by label, see ``METRICS``)."""
    name: str
    values: dict[str, float]
    stalls: dict[str, float] = field(default_factory=dict)   # reason -> % of warp cycles
    grid: str = ""
    block: str = ""

    def get(self, label: str, default: float | None = None) -> float | None:
        return self.values.get(label, default)

    @property
    def time_us(self) -> float | None:
        t = self.values.get("time_ns")
        return None if t is None else t / 1e3

    @property
    def dram_gbs(self) -> float | None:
        b, t = self.values.get("dram_bytes"), self.values.get("time_ns")
        return None if b is None or not t else b / t          # bytes per ns = GB/s

    @property
    def sectors_per_request(self) -> float | None:
        s, r = self.values.get("gld_sectors"), self.values.get("gld_requests")
        return None if s is None or not r else s / r

    @property
    def theoretical_occupancy(self) -> float | None:
        """Resident warps per SM the launch's limits allow, in % of the SM's maximum."""
        lims = [self.values.get(k) for k in ("occ_limit_warps", "occ_limit_blocks",
                                             "occ_limit_regs", "occ_limit_smem")]
        mw, threads = self.values.get("max_warps"), self.values.get("block")
        if None in lims or not mw or not threads:
            return self.values.get("occ_theory_pct")
        return 100.0 * min(lims) * -(-threads // 32) / mw

    @property
    def smem_bytes(self) -> float | None:
        a, b = self.values.get("smem_static"), self.values.get("smem_dynamic")
        return None if a is None and b is None else (a or 0) + (b or 0)

    @property
    def bank_conflicts(self) -> float | None:
        a, b = self.values.get("bank_ld"), self.values.get("bank_st")
        return None if a is None and b is None else (a or 0) + (b or 0)

    def top_stalls(self, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` largest stall reasons (``not_selected`` is a warp that was ready but lost
        the issue slot to another one: not a stall of the kernel, so it is left out)."""
        items = [(k, v) for k, v in self.stalls.items() if k not in ("not_selected",)]
        return sorted(items, key=lambda kv: -kv[1])[:n]

    def sections(self) -> list[tuple[str, str]]:
        """(what, value) lines of the key sections, for ``NcuReport.show``."""
        v, f = self.values, _fmt
        lines = [
            ("duration", f"{f(self.time_us, '.1f')} us"),
            ("compute (SM) throughput", f"{f(v.get('sm_pct'), '.1f')} % of peak"),
            ("memory throughput", f"{f(v.get('mem_pct'), '.1f')} % of peak  (DRAM "
             f"{f(v.get('dram_pct'), '.1f')} %, {f(self.dram_gbs, '.0f')} GB/s)"),
            ("FMA pipe busy", f"{f(v.get('fma_pct'), '.1f')} % of active cycles"),
            ("issue slots busy", f"{f(v.get('issue_pct'), '.1f')} % of active cycles"),
            ("achieved occupancy", f"{f(v.get('occ_pct'), '.1f')} % (theoretical "
             f"{f(self.theoretical_occupancy, '.1f')} %)"),
            ("registers / thread", f(v.get("regs"), ".0f")),
            ("shared memory / block", f"{f(self.smem_bytes, '.0f')} bytes"),
            ("L1 hit rate / L2 hit rate", f"{f(v.get('l1_hit_pct'), '.1f')} % / "
             f"{f(v.get('l2_hit_pct'), '.1f')} %"),
            ("global load sectors / request", f(self.sectors_per_request, ".1f")),
            ("shared bank conflicts (ld + st)", f"{f(v.get('bank_ld'), '.0f')} + "
             f"{f(v.get('bank_st'), '.0f')}"),
            ("top warp stalls", ", ".join(f"{k} {s:.0f}%" for k, s in self.top_stalls()) or "-"),
        ]
        return lines


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


#: the columns of ``NcuReport.table``: header, width, function of a KernelProfile
_COLUMNS: dict[str, tuple[str, int, Callable[[KernelProfile], str]]] = {
    "time": ("time us", 9, lambda k: _fmt(k.time_us, ".1f")),
    "sm": ("SM %", 5, lambda k: _fmt(k.get("sm_pct"), ".0f")),
    "mem": ("mem %", 5, lambda k: _fmt(k.get("mem_pct"), ".0f")),
    "dram": ("DRAM GB/s", 9, lambda k: _fmt(k.dram_gbs, ".0f")),
    "fma": ("FMA %", 5, lambda k: _fmt(k.get("fma_pct"), ".0f")),
    "occ": ("occ %", 9, lambda k: f"{_fmt(k.get('occ_pct'), '.0f')}/"
                                  f"{_fmt(k.theoretical_occupancy, '.0f')}"),
    "regs": ("regs", 4, lambda k: _fmt(k.get("regs"), ".0f")),
    "smem": ("smem KiB", 8, lambda k: _fmt(None if k.smem_bytes is None
                                           else k.smem_bytes / 1024, ".1f")),
    "l1": ("L1 hit", 6, lambda k: _fmt(k.get("l1_hit_pct"), ".0f")),
    "l2": ("L2 hit", 6, lambda k: _fmt(k.get("l2_hit_pct"), ".0f")),
    "sectors": ("sect/req", 8, lambda k: _fmt(k.sectors_per_request, ".1f")),
    "banks": ("bank confl", 10, lambda k: _fmt(k.bank_conflicts, ".0f")),
    "stall": ("top stall", 22, lambda k: ", ".join(f"{n} {v:.0f}%" for n, v in
                                                   k.top_stalls(1)) or "-"),
}
DEFAULT_COLUMNS = ("time", "sm", "mem", "dram", "occ", "regs", "smem", "l1", "l2", "sectors",
                   "banks", "stall")


@dataclass
class NcuReport:
    """Kernel launches profiled by ``profile``; empty with ``message`` when none could be."""
    kernels: list[KernelProfile]
    message: str = ""
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)   # metrics this ncu/GPU does not have
    raw: str = ""                                      # ncu's CSV output, as printed

    def __bool__(self) -> bool:
        return bool(self.kernels)

    def __len__(self) -> int:
        return len(self.kernels)

    def __getitem__(self, key: int | str) -> KernelProfile:
        if isinstance(key, int):
            return self.kernels[key]
        for k in self.kernels:
            if k.name == key:
                return k
        raise KeyError(f"no profiled launch of {key!r}; have {[k.name for k in self.kernels]}")

    def table(self, columns=DEFAULT_COLUMNS, names: list[str] | None = None) -> str:
        """One row per launch; ``names`` relabels the rows (same order as the launches)."""
        if not self.kernels:
            return self.message
        unknown = [c for c in columns if c not in _COLUMNS]
        if unknown:
            raise ValueError(f"unknown column(s) {unknown}; known: {list(_COLUMNS)}")
        labels = list(names) if names is not None else [k.name for k in self.kernels]
        if len(labels) != len(self.kernels):
            raise ValueError(f"{len(labels)} names for {len(self.kernels)} launches")
        w = max(6, max(len(s) for s in labels))
        head = f"{'kernel':<{w}}" + "".join(f" {_COLUMNS[c][0]:>{_COLUMNS[c][1]}}"
                                            for c in columns)
        rows = [head]
        for lab, k in zip(labels, self.kernels):
            rows.append(f"{lab:<{w}}" + "".join(f" {_COLUMNS[c][2](k):>{_COLUMNS[c][1]}}"
                                                for c in columns))
        return "\n".join(rows)

    def show(self, key: int | str = 0) -> None:
        """Print one launch's key sections."""
        if not self.kernels:
            print(self.message)
            return
        k = self[key]
        print(f"{k.name}   grid {k.grid}  block {k.block}")
        for what, val in k.sections():
            print(f"  {what:<32s} {val}")

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


# ----------------------------------------------------------------------------- running ncu

def find_ncu() -> str | None:
    """Path of the ``ncu`` executable: $PATH, the CUDA toolkit, /opt/nvidia/nsight-compute."""
    p = shutil.which("ncu")
    if p:
        return p
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "ncu"))
    cands += ["/usr/local/cuda/bin/ncu"]
    cands += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    cands += sorted(glob.glob("/usr/local/cuda-*/bin/ncu"), reverse=True)
    return next((c for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)


_AVAILABLE: dict[str, set[str] | None] = {}


def _available_metrics(ncu: str) -> set[str] | None:
    """Base names of the metrics this ncu offers for the current GPU (None: unknown)."""
    if ncu not in _AVAILABLE:
        try:
            r = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True,
                               timeout=60)
            names = {ln.split()[0] for ln in r.stdout.splitlines()
                     if ln[:1].isalpha() and "__" in ln.split()[0]}
            _AVAILABLE[ncu] = names or None
        except (OSError, subprocess.SubprocessError):
            _AVAILABLE[ncu] = None
    return _AVAILABLE[ncu]


def _script(target: Callable[[], object] | str) -> str:
    """Python source that runs ``target`` once."""
    root = str(Path(__file__).resolve().parent.parent)
    head = f"import sys\nsys.path.insert(0, {root!r})\n"
    if isinstance(target, str):
        return head + textwrap.dedent(target) + "\n"
    if not callable(target):
        raise TypeError(f"profile: target must be a function or a string of Python source, "
                        f"got {type(target).__name__}")
    mod = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if mod and mod != "__main__" and name and not name.startswith("<") and \
            getattr(sys.modules.get(mod), name, None) is target:
        return head + f"from {mod} import {name}\n{name}()\n"
    try:
        src = textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError) as e:
        raise TypeError(f"profile: cannot read the source of {name!r} ({e}); define it in a "
                        "plain cell (not a %%gpu cell), or pass its source as a string") from None
    if not src.lstrip().startswith("def "):
        raise TypeError("profile: target must be a plain function (def ...), not a lambda")
    return head + src + f"\n{name}()\n"


def _num(s: str) -> float | None:
    s = s.strip().replace(",", "")
    if not s or s.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(s)
    except ValueError:
        return None


def parse_csv(text: str) -> list[KernelProfile]:
    """Kernel launches from the output of ``ncu --csv --page raw`` (other lines ignored)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    body = [ln for ln in lines[start:] if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(body))))
    head, data = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(head)}
    label_of = {m: k for k, m in METRICS.items()}
    stall_of = {_STALL.format(r): r for r in STALLS}
    out = []
    for row in data:
        if len(row) != len(head) or not row[col["ID"]].strip():
            continue                                 # the units row, or a truncated line
        vals, stalls = {}, {}
        for h, i in col.items():
            if h in label_of:
                v = _num(row[i])
                if v is not None:
                    vals[label_of[h]] = v
            elif h in stall_of:
                v = _num(row[i])
                if v is not None:
                    stalls[stall_of[h]] = v
        name = row[col["Kernel Name"]] if "Kernel Name" in col else "?"
        out.append(KernelProfile(name.split("(")[0].strip(), vals, stalls,
                                 row[col["Grid Size"]] if "Grid Size" in col else "",
                                 row[col["Block Size"]] if "Block Size" in col else ""))
    return out


def _unknown_metrics(text: str) -> set[str]:
    """Metric names an ncu error message says it cannot find."""
    out = set()
    for ln in text.splitlines():
        if "==ERROR==" in ln and "metric" in ln.lower() and ("find" in ln or "not" in ln):
            out |= set(re.findall(r"[a-z0-9_]+__[a-z0-9_.]+", ln))
    return out


def _why_not(text: str, rc: int) -> str:
    if "ERR_NVGPUCTRPERM" in text:
        return ("Nsight Compute: no permission to read the GPU's performance counters here "
                "(ERR_NVGPUCTRPERM; usual on Colab and in containers) - counters skipped.")
    errs = [ln.replace("==ERROR==", "").strip() for ln in text.splitlines()
            if "==ERROR==" in ln]
    if errs:
        return f"Nsight Compute failed: {errs[0]}"
    if "No kernels were profiled" in text or "==WARNING== No kernels" in text:
        return "Nsight Compute: no kernel launch matched the kernel filter - nothing profiled."
    tail = " | ".join(ln for ln in text.strip().splitlines()[-3:])
    return f"Nsight Compute: no counters (exit code {rc}): {tail[:300]}"


def profile(target: Callable[[], object] | str, kernel: str | None = None, *,
            launch_count: int = 1, launch_skip: int = 0, metrics: dict[str, str] | None = None,
            stalls: bool = True, clock_control: str = "none", timeout: float = 300,
            extra_args: tuple[str, ...] = ()) -> NcuReport:
    """Profile kernel launches of ``target`` (a self-contained function, or Python source) with
    Nsight Compute in a subprocess.

    ``kernel``: the kernel name to profile, or ``"regex:..."``; None profiles every launch.
    ``launch_count`` launches are profiled after skipping ``launch_skip`` matching ones.
    ``clock_control="none"`` leaves the GPU's clocks as they are (so durations compare with
    ``cb.bench``); ``"base"`` (ncu's default) locks them to the base clock for steadier numbers.
    Never raises for a machine without counters: the report is empty and says why.
    """
    if launch_count < 1 or launch_skip < 0:
        raise ValueError("profile: launch_count >= 1 and launch_skip >= 0")
    if clock_control not in ("none", "base"):
        raise ValueError("profile: clock_control is 'none' or 'base'")
    script = _script(target)
    if not env.HAS_GPU:
        return NcuReport([], "Nsight Compute needs a CUDA GPU (simulator mode) - counters "
                             "skipped.")
    ncu = find_ncu()
    if ncu is None:
        return NcuReport([], "Nsight Compute (ncu) is not installed here - counters skipped. "
                             "It ships with the CUDA toolkit (or: apt install nsight-compute).")
    wanted = dict(METRICS if metrics is None else metrics)
    names = list(wanted.values()) + ([_STALL.format(r) for r in STALLS] if stalls else [])
    have = _available_metrics(ncu)
    dropped = []
    if have is not None:
        keep = [m for m in names if m.startswith(("launch__", "device__"))
                or m.split(".")[0] in have]
        dropped = [m for m in names if m not in keep]
        names = keep
    with tempfile.TemporaryDirectory(prefix="cudabook-ncu-") as tmp:
        path = Path(tmp) / "target.py"
        path.write_text(script)
        cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control",
               clock_control, "--launch-skip", str(launch_skip), "--launch-count",
               str(launch_count), "--metrics", ",".join(names), *extra_args]
        if kernel:
            cmd += ["--kernel-name", kernel]
        cmd += [sys.executable, str(path)]
        run_env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        run_env["PYTHONPATH"] = root + os.pathsep + run_env.get("PYTHONPATH", "")
        t0 = time.perf_counter()
        for _ in range(3):     # a metric this ncu does not know is dropped, and ncu runs again
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   env=run_env, cwd=os.getcwd())
            except subprocess.TimeoutExpired:
                return NcuReport([], f"Nsight Compute did not finish in {timeout:.0f} s - "
                                     "counters skipped.", time.perf_counter() - t0, cmd, dropped)
            unknown = [m for m in names if m in _unknown_metrics(r.stdout + r.stderr)]
            if not unknown:
                break
            dropped += unknown
            names = [m for m in names if m not in unknown]
            cmd[cmd.index("--metrics") + 1] = ",".join(names)
        secs = time.perf_counter() - t0
    text = r.stdout + "\n" + r.stderr
    kernels = parse_csv(r.stdout)
    raw = "\n".join(ln for ln in r.stdout.splitlines() if ln.startswith('"'))
    if not kernels:
        return NcuReport([], _why_not(text, r.returncode), secs, cmd, dropped, raw)
    if r.returncode != 0:    # the target failed after some launches were profiled
        return NcuReport(kernels, _why_not(text, r.returncode), secs, cmd, dropped, raw)
    return NcuReport(kernels, "", secs, cmd, dropped, raw)
