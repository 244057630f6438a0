"""pytest glue of the repository (notebooks through nbval, and the unit tests).

The skipping rules live in the package, ``cudabook/pytest_plugin.py`` (registered through the
``pytest11`` entry point), so that a lone notebook grades the same outside the repository. This
file only imports cudabook first, so that it decides GPU or simulator mode before any test
imports ``numba.cuda``, and registers the plugin where an older install lacks the entry point.
"""

import cudabook  # noqa: F401  (decides GPU or simulator mode before numba.cuda is imported)
from cudabook import pytest_plugin


def pytest_configure(config):
    if not any(p is pytest_plugin for p in config.pluginmanager.get_plugins()):
        config.pluginmanager.register(pytest_plugin, "cudabook")
        pytest_plugin.pytest_configure(config)
