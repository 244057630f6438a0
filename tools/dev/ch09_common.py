"""What the chapter-9 dev scripts share (ch09_bench.py, ch09_v4_probe.py, ch09_hopper.py): the
output folder and log, the relative error they compare with, and the float64 scores.

    from ch09_common import OUT, Log, rel, scores
    log = Log("ch09_bench.log")          # prints and appends to $OUT/ch09_bench.log
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/ch09_out"))


class Log:
    """A print that also writes the line to $OUT/name (mode "w": a new file, "a": appended)."""

    def __init__(self, name: str, mode: str = "w"):
        OUT.mkdir(parents=True, exist_ok=True)
        self.file = open(OUT / name, mode)

    def __call__(self, *a) -> None:
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        self.file.write(s + "\n")
        self.file.flush()


def rel(a, b) -> float:
    """||a - b|| / ||b||, with ||b|| floored at 1e-3 sqrt(n): a gradient that is exactly zero
    (one visible key: softmax of one element) leaves only rounding noise, not a relative error."""
    a = a.double()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-3 * math.sqrt(b.numel())))


def scores(Q, K, causal: bool):
    """S = Q K^T / sqrt(D) of float64 (..., Nq, D) and (..., Nk, D), masked top-left when causal."""
    S = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).triu(1),
                          -math.inf)
    return S
