"""pytest plugin of the book, registered through the ``pytest11`` entry point of the package.

Wherever cudabook is installed, ``pytest --nbval-lax notebook.ipynb`` gives the same verdicts as
inside the repository, also for a lone notebook copied out of it (a Colab or download user):
without a GPU, cells that start with ``%%gpu`` (CuPy / CUDA C++, timings) are reported as
skipped with a message instead of being compared with outputs stored from a GPU run, and tests
marked ``gpu`` are skipped.
"""

from __future__ import annotations

import pytest

GPU_SKIP = "cell needs a CUDA GPU (simulator mode)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU (run in the GPU lane)")


def _is_gpu_cell(item: pytest.Item) -> bool:
    cell = getattr(item, "cell", None)  # nbval's notebook cell items carry their cell
    return cell is not None and cell.get("source", "").lstrip().startswith("%%gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if _is_gpu_cell(it) or it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from cudabook import env  # decides GPU or simulator mode once (probes CuPy)

    if env.HAS_GPU:
        return
    for it in gpu_items:
        reason = GPU_SKIP if _is_gpu_cell(it) else "needs a CUDA GPU"
        it.add_marker(pytest.mark.skip(reason=reason))
