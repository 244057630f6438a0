"""The results file: same-run ratios to the vendor baselines, ``reports/benchmarks.json``.

A bench table records its rows with ``BenchTable.record("chNN")``; rows go to the file named by
``$CUDABOOK_RESULTS`` (the GPU lane sets it to a file of its own for each run). ``merge`` then
moves one run's rows into the book's file, chapter by chapter: a chapter's stored rows are
replaced only by rows of a run of that chapter, and no other chapter's rows are touched.

    {"gpu": "NVIDIA H200", "date": "2026-11-26",
     "results": [{"chapter": "ch04", "kernel": "v10", "metric": "TFLOP/s", "value": 43.1,
                  "baseline": "cuBLAS", "baseline_value": 50.2, "ratio": 0.859,
                  "size": 4096, "time_us": 3190.2,
                  "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-23"}, ...]}

Each row names the GPU and the day it was measured on (chapters are re-run one at a time, so one
file can hold rows of several machines); the top-level "gpu" and "date" are those of the newest
merge.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Iterable

__all__ = ["RESULTS_ENV", "FIELDS", "record", "read", "write", "merge", "chapters_in"]

#: When this environment variable names a file, ``record`` (and ``BenchTable.record``) write there.
RESULTS_ENV = "CUDABOOK_RESULTS"

#: The keys of one row.
FIELDS = ("chapter", "kernel", "metric", "value", "baseline", "baseline_value", "ratio", "size",
          "time_us", "gpu", "date")


def _key(e: dict) -> tuple:
    return (e["chapter"], e["kernel"], e["metric"], json.dumps(e.get("size")))


def _sort(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda e: (e["chapter"], e["kernel"], json.dumps(e.get("size"))))


def _validate(entries) -> list[dict]:
    if isinstance(entries, dict) or not isinstance(entries, Iterable):
        raise TypeError("record: expected a list of result rows (dicts with the keys "
                        f"{', '.join(FIELDS)}), got {type(entries).__name__}")
    rows = list(entries)
    for i, e in enumerate(rows):
        if not isinstance(e, dict):
            raise TypeError(f"record: row {i} is a {type(e).__name__}, not a dict")
        missing = [k for k in ("chapter", "kernel", "metric", "value") if k not in e]
        if missing:
            raise ValueError(f"record: row {i} lacks {missing} (a row has {', '.join(FIELDS)})")
        if not (isinstance(e["chapter"], str) and e["chapter"].startswith("ch")):
            raise ValueError(f"record: row {i}: chapter must look like 'ch03', got "
                             f"{e['chapter']!r}")
    return rows


def read(path: str | os.PathLike) -> dict:
    """The results file at ``path`` ({"gpu", "date", "results"}); an empty one if it is absent."""
    p = Path(path)
    if not p.is_file():
        return {"gpu": None, "date": None, "results": []}
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{p} is not a results file (no 'results' list)")
    return data


def write(data: dict, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data["results"] = _sort(data["results"])
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(p)                      # atomic: a crash never leaves half a file
    return p


def record(entries: list[dict], path: str | os.PathLike | None = None) -> Path | None:
    """Merge ``entries`` into the results file (same chapter+kernel+metric+size replaced).

    The file is ``path``, else ``$CUDABOOK_RESULTS``; with neither, nothing is written.
    """
    rows = _validate(entries)
    path = path or os.environ.get(RESULTS_ENV)
    if not path:
        return None
    from . import env

    data = read(path)
    gpu, day = env.info().name, _dt.date.today().isoformat()
    rows = [{**e, "gpu": e.get("gpu") or gpu, "date": e.get("date") or day} for e in rows]
    new = {_key(e) for e in rows}
    data["results"] = [e for e in data["results"] if _key(e) not in new] + rows
    data["gpu"], data["date"] = gpu, day
    return write(data, path)


def chapters_in(path: str | os.PathLike) -> list[str]:
    """The chapters ('ch03', ...) that have rows in the results file."""
    return sorted({e["chapter"] for e in read(path)["results"]})


def merge(run: str | os.PathLike, into: str | os.PathLike, chapters: Iterable[str]) -> dict:
    """Replace the rows of ``chapters`` in ``into`` by the rows of ``run`` for those chapters.

    ``chapters`` are 'ch08' or '08'. A chapter with no row in ``run`` is refused (its stored
    rows would be dropped for nothing); other chapters' rows in ``into`` stay as they are.
    Returns {chapter: (rows before, rows after)}.
    """
    chs = sorted({c if str(c).startswith("ch") else f"ch{int(c):02d}" for c in chapters})
    if not chs:
        raise ValueError("merge: name at least one chapter, e.g. 08")
    src, dst = read(run), read(into)
    if not src["results"]:
        raise ValueError(f"merge: {run} holds no results")
    _validate(src["results"])
    absent = [c for c in chs if not any(e["chapter"] == c for e in src["results"])]
    if absent:
        raise ValueError(f"merge: {run} has no rows of {absent} (it has "
                         f"{sorted({e['chapter'] for e in src['results']})}); nothing merged")
    summary = {c: (sum(e["chapter"] == c for e in dst["results"]),
                   sum(e["chapter"] == c for e in src["results"])) for c in chs}
    stamp = {"gpu": src.get("gpu"), "date": src.get("date")}
    dst["results"] = [e for e in dst["results"] if e["chapter"] not in chs] + \
        [{**stamp, **{k: v for k, v in e.items() if v is not None or k not in stamp}}
         for e in src["results"] if e["chapter"] in chs]
    dst["gpu"] = src.get("gpu") or dst.get("gpu")
    dst["date"] = max(filter(None, [dst.get("date"), src.get("date")]), default=None)
    write(dst, into)
    return summary
