"""pytest glue for the notebooks (nbval) and the unit tests.

Without a GPU, cells that start with ``%%gpu`` (CuPy / CUDA C++, timings) are reported as
skipped instead of being compared with outputs stored from a GPU run.
"""

import pytest

import cudabook  # noqa: F401  (decides GPU or simulator mode before numba.cuda is imported)
from cudabook import env


def pytest_collection_modifyitems(config, items):
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is not None and not env.HAS_GPU and cell.get("source", "").lstrip() \
                .startswith("%%gpu"):
            item.add_marker(pytest.mark.skip(reason="cell needs a CUDA GPU (simulator mode)"))
        if item.get_closest_marker("gpu") and not env.HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
