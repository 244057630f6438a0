#!/usr/bin/env python3
"""Execute notebooks in place on a GPU machine and keep their outputs (the GPU lane's step 1).

    python tools/gpu_execute.py lessons/01_first_kernel.ipynb solutions/01_first_kernel.ipynb

Each notebook runs top to bottom in a fresh kernel with the repository root as working
directory. On success its adjacent outputs of one stream are joined (``nbtools.coalesce_streams``:
a cell that prints several times stores one stdout output, which the book draws as one box) and
it is written back in canonical form, stamped with ``metadata.cudabook = {gpu, date, seconds}``
(the format policy requires both on lessons and solutions). A notebook that fails is left
untouched and the script exits non-zero.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbtools  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def gpu_name() -> str:
    import cudabook

    if not cudabook.HAS_GPU:
        sys.exit("gpu_execute: no GPU here; the book's outputs must come from a GPU run")
    return cudabook.env.info().name


def main(paths: list[str]) -> int:
    os.environ.pop("MPLBACKEND", None)   # the kernels must use the inline backend to store figures
    os.environ["CUDABOOK_PROGRESS"] = "0"  # no progress bars (stderr) in the stored outputs
    gpu = gpu_name()
    results, bad = [], 0
    for p in paths:
        path = Path(p)
        nb = nbformat.read(str(path), as_version=4)
        t0 = time.perf_counter()
        client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                         resources={"metadata": {"path": str(ROOT)}})
        try:
            client.execute()
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001
            ok, err = False, str(e).splitlines()[-1] if str(e) else type(e).__name__
            msg = str(e)
            print(f"FAILED {p}:\n{msg[-3000:]}", flush=True)
        secs = time.perf_counter() - t0
        results.append({"notebook": p, "ok": ok, "seconds": round(secs, 1), "error": err})
        if ok:
            nbtools.coalesce_streams(nb)
            for c in nb.cells:    # outputs of tools/cpu_cells.py are now this run's
                tags = c.metadata.get("tags")
                if tags and "cpu-run" in tags:
                    tags.remove("cpu-run")
                    if not tags:
                        del c.metadata["tags"]
            nb.metadata["cudabook"] = {"gpu": gpu, "date": dt.date.today().isoformat(),
                                       "seconds": round(secs, 1)}
            nbtools.write(nb, path)
            print(f"ok     {p}  {secs:6.1f} s", flush=True)
        else:
            bad += 1
    Path(ROOT / "reports" / ".last_execute.json").write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
