#!/usr/bin/env python3
"""The results file, reports/benchmarks.json: merge a run's rows in, chapter by chapter.

    python tools/results.py merge RUN.json --chapters 08          RUN's ch08 rows replace ch08's
    python tools/results.py merge RUN.json --chapters 03 04 --into reports/benchmarks.json
    python tools/results.py show [FILE]                           rows per chapter

A run (the GPU lane, a device call) writes its rows to a file of its own (``$CUDABOOK_RESULTS``).
``merge`` replaces, in the book's file, only the rows of the chapters named; every other
chapter's rows stay as they are. A chapter with no row in the run is refused, so a failed run
never empties a chapter.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cudabook import results  # noqa: E402

DEFAULT = ROOT / "reports" / "benchmarks.json"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="replace chapters' rows by a run's rows")
    m.add_argument("run")
    m.add_argument("--chapters", nargs="+", required=True, help="e.g. 08 or ch08")
    m.add_argument("--into", default=str(DEFAULT))
    s = sub.add_parser("show", help="rows per chapter")
    s.add_argument("file", nargs="?", default=str(DEFAULT))
    a = ap.parse_args(argv)
    if a.cmd == "show":
        data = results.read(a.file)
        counts = collections.Counter(e["chapter"] for e in data["results"])
        print(f"{a.file}: {data.get('gpu')}, {data.get('date')}")
        for ch, n in sorted(counts.items()):
            print(f"  {ch}: {n} rows")
        return 0
    try:
        summary = results.merge(a.run, a.into, a.chapters)
    except (ValueError, FileNotFoundError) as e:
        print(f"results merge: {e}", file=sys.stderr)
        return 1
    for ch, (before, after) in summary.items():
        print(f"{ch}: {before} rows replaced by {after} from {a.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
