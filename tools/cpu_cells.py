#!/usr/bin/env python3
"""Execute chosen cells of a lesson that need no GPU, and store their outputs (nothing else).

    python tools/cpu_cells.py lessons/11_multi_gpu.ipynb CELL_ID [CELL_ID ...]
    python tools/cpu_cells.py solutions/09_flash_attention.ipynb --context cell-002 CELL_ID ...

A lesson's outputs come from a GPU run (tools/gpu_execute.py). Some cells never touch a GPU: CPU
processes joined by gloo, a figure drawn from formulas, a table of published numbers, a Numba
exercise graded in the CUDA simulator. When such cells are added to a notebook between two GPU
runs, this script runs them for real, on this machine, in a fresh kernel: first the notebook's
setup cell, then the ``--context`` cells (imports and definitions the chosen cells use), their
outputs not kept, then each chosen cell in notebook order. It writes back only the chosen cells'
outputs and execution counts; every other cell, and the notebook's metadata (the GPU its outputs
come from), is left as it was. Refused: ``%%gpu`` cells, cells that import CuPy or call a timing
helper, and a cell that fails (then nothing is written). Each chosen cell gets the tag
``cpu-run`` until the next GPU run of the whole notebook, which stores their outputs from then
on and drops the tag.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbtools  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU_TAG = "cpu-run"
_GPU_ONLY = nbtools.CPU_REFUSED           # what the notebook policy refuses in a cpu-run cell


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    path, rest = Path(argv[0]), argv[1:]
    context: list[str] = []
    while "--context" in rest:
        k = rest.index("--context")
        context += rest[k + 1].split(",")
        rest = rest[:k] + rest[k + 2:]
    ids = rest
    nb = nbformat.read(str(path), as_version=4)
    by_id = {c.get("id"): (i, c) for i, c in enumerate(nb.cells)}
    missing = [i for i in ids + context if i not in by_id]
    if missing:
        sys.exit(f"cpu_cells: no cell with id {missing} in {path}")
    chosen = sorted((by_id[i] for i in ids), key=lambda t: t[0])
    for _, c in chosen:
        if c.cell_type != "code":
            sys.exit(f"cpu_cells: cell {c.get('id')} is not a code cell")
        if _GPU_ONLY.search(c.source):
            sys.exit(f"cpu_cells: cell {c.get('id')} needs a GPU or times something; its output "
                     "must come from tools/gpu_execute.py")
    setup = next(c for c in nb.cells if c.cell_type == "code")
    run = nbformat.v4.new_notebook(metadata=nb.metadata)
    before = [nbformat.v4.new_code_cell(setup.source)] + \
        [nbformat.v4.new_code_cell(c.source) for _, c in
         sorted((by_id[i] for i in context), key=lambda t: t[0])]
    run.cells = before + [nbformat.v4.new_code_cell(c.source) for _, c in chosen]
    os.environ.pop("MPLBACKEND", None)      # the inline backend stores figures
    os.environ["CUDABOOK_PROGRESS"] = "0"
    client = nbclient.NotebookClient(run, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    try:
        client.execute()
    except Exception as e:  # noqa: BLE001
        sys.exit(f"cpu_cells: a cell failed, nothing written:\n{str(e)[-3000:]}")
    nbtools.coalesce_streams(run)
    for (_, c), done in zip(chosen, run.cells[len(before):]):
        c.outputs = done.outputs
        c.execution_count = done.execution_count
        tags = c.metadata.setdefault("tags", [])
        if CPU_TAG not in tags:
            tags.append(CPU_TAG)
        print(f"cpu_cells: {c.get('id')}: {len(done.outputs)} outputs")
    nbtools.write(nb, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
