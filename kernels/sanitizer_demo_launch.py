"""Launching kernels/sanitizer_demo.cu: four seeded bugs, each beside its fixed twin (Chapter 5).

    sd = cb.load_launch("sanitizer_demo")
    x, want = sd.example("shift")              # a seeded input and its float64 answer
    y = sd.demo("shift", x)                    # shift_fix; fixed=False launches shift_bug
    sd.TOOL["shift"]                           # "memcheck": the tool that finds shift_bug

    CASES, TOOL, WHAT                          the four cases, their tools, one line each
    config(case, sizes...)                     -> Launch(grid, block, kernel=None)
    demo(case, x, out=None, fixed=True)        the entry point: checks, config, launch, out
    example(case, seed=0)                      (x on the GPU, the float64 reference on the host)
    reference(case, x)                         the float64 answer (NumPy)
    sanitize_targets()                         the *_fix kernels only

The *_bug kernels are wrong on purpose: run them only under compute-sanitizer, in a process of
their own (Chapter 5 does; blocksum_bug's barrier in a branch is undefined behaviour and may hang).
sanitize_targets() yields the fixed twins alone, so tools/sanitize.py keeps the lane clean.

The checks, before anything is launched: a known case; x float32, C-contiguous, on the GPU, 1D
(rowmax: 2D with at least one column), not empty, fewer than 2^31 elements; out float32 of the
output's shape (x's; rowmax: (rows,); blocksum: (ceil(n / 256),), one sum per block).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div

__all__ = ["CASES", "TOOL", "WHAT", "config", "demo", "example", "reference",
           "sanitize_targets"]

#: the tool that finds each case's bug
TOOL = {"shift": "memcheck", "reverse": "racecheck", "rowmax": "initcheck",
        "blocksum": "synccheck"}
CASES = tuple(TOOL)
WHAT = {
    "shift": "y[i + 1] = x[i]; the bug guards i < n, so thread n - 1 writes y[n]",
    "reverse": "each block reverses 256 elements through shared memory; the bug has no "
               "__syncthreads() between the writes and the reads",
    "rowmax": "out[row] = max of the row; the bug takes fmaxf(out[row], ...) on an out "
              "nobody initialised",
    "blocksum": "each block sums its 256 elements by a tree in shared memory; the bug's "
                "__syncthreads() sits inside if (t < s), so the threads t >= s skip it",
}
_BLOCK = {"shift": 256, "reverse": 256, "rowmax": 128, "blocksum": 256}   # the .cu file's launches


def _module():
    return cb.module("sanitizer_demo")     # the whole file, compiled once per process


def _case(case: str) -> str:
    if case not in TOOL:
        raise LaunchError(f"sanitizer_demo: case is one of {', '.join(CASES)}, got {case!r}")
    return case


def config(case: str, n: int) -> Launch:
    """Grid and block of ``case`` over n items (rowmax: n rows): one thread per item, 256 per
    block (rowmax 128), the reverse tiles and the blocksum blocks of 256 items one block each."""
    block = _BLOCK[_case(case)]
    return Launch((max(1, ceil_div(n, block)),), (block,))


def _out_shape(case: str, x) -> tuple[int, ...]:
    if case == "blocksum":
        return (ceil_div(int(x.shape[0]), _BLOCK[case]),)   # one sum per block
    return (int(x.shape[0]),) if case == "rowmax" else tuple(int(s) for s in x.shape)


def demo(case: str, x, out=None, fixed: bool = True):
    """Launch ``<case>_fix`` (or ``<case>_bug`` with ``fixed=False``) on x; returns out."""
    case = _case(case)
    ndim = 2 if case == "rowmax" else 1
    cb.expect(x, "x", dtype=np.float32, ndim=ndim)
    if x.size >= 2**31:
        raise LaunchError(f"sanitizer_demo: the kernels index with int; x has {x.size} >= 2^31 "
                          "elements")
    if case == "rowmax" and x.shape[1] == 0:
        raise LaunchError("sanitizer_demo: rowmax needs at least one column (the max of no "
                          "elements would be -inf)")
    if x.shape[0] == 0:                    # a launch would still write y[0] (shift, blocksum)
        raise LaunchError(f"sanitizer_demo: x is empty (shape {tuple(x.shape)})")
    shape = _out_shape(case, x)
    if out is None:
        out = cb.arrays.empty_like_lib(x, shape, "float32")
    cb.expect(out, "out", dtype=np.float32, shape=shape)
    kernel = _module().get(f"{case}_{'fix' if fixed else 'bug'}")
    cfg = config(case, int(x.shape[0]))
    sizes = (np.int32(x.shape[0]), np.int32(x.shape[1])) if case == "rowmax" else \
        (np.int32(x.shape[0]),)
    cb.launch.run(kernel, cfg, (cb.as_cupy(x, "x"), cb.as_cupy(out, "out"), *sizes),
                  stream=cb.stream_for(x, out))
    return out


def reference(case: str, x) -> np.ndarray:
    """The float64 answer of ``case`` on x (any array library; computed on the host)."""
    case = _case(case)
    v = np.asarray(cb.to_numpy(x), dtype=np.float64)
    if case == "shift":
        return np.concatenate([[0.0], v[:-1]])[:v.shape[0]]
    if case == "reverse":
        pad = np.zeros(ceil_div(v.shape[0], 256) * 256)
        pad[:v.shape[0]] = v
        return pad.reshape(-1, 256)[:, ::-1].reshape(-1)[:v.shape[0]]
    if case == "rowmax":
        return v.max(axis=1)
    pad = np.zeros(ceil_div(v.shape[0], 256) * 256)   # blocksum: x read as 0 past n
    pad[:v.shape[0]] = v
    return pad.reshape(-1, 256).sum(axis=1)


#: the example sizes: ragged, so the last block is partial (blocksum's last sum has 232 terms,
#: then 24 zeros); shift's y is 4000 bytes, not a multiple of CuPy's allocation unit, so its
#: stray write lands in the pool's rounding with the pool on, and past the end of a cudaMalloc
#: of 4000 bytes without it
_SIZES = {"shift": (1000,), "reverse": (1000,), "rowmax": (300, 37), "blocksum": (1000,)}


def example(case: str, seed: int = 0):
    """A seeded input of ``case`` on the GPU (CuPy) and its float64 reference (NumPy). rowmax's
    rows are drawn around -3, so most row maxima are negative: a max taken from a zeroed out
    instead of -inf is then wrong, visibly."""
    import cupy as cp

    case = _case(case)
    g = np.random.default_rng(seed)
    x = g.standard_normal(_SIZES[case], dtype=np.float32)
    if case == "rowmax":
        x -= 3.0
    return cp.asarray(x), reference(case, x)


def sanitize_targets():
    """The fixed twins on the example sizes (the bugs never run in the lane)."""
    for case in CASES:
        x, _ = example(case)
        yield f"{case}_fix ({TOOL[case]}'s case, n = {x.shape})", \
            (lambda case=case, x=x: demo(case, x))
