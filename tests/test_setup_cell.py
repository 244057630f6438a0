"""The setup cell installs the helper package where it is missing (as on a fresh Colab runtime).

A lone lesson notebook is copied into an empty folder and run by a Python that sees every
dependency but not cudabook; CUDABOOK_SRC points the setup cell at this clone. The notebook must
then run top to bottom, using the kernels/ files that travelled inside the built package.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUNNER = r'''
import sys, nbformat, nbclient
nb = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": sys.argv[2]}}).execute()
out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "stream")
print(out)
'''


def test_lone_notebook_installs_cudabook_and_runs(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    vsite = Path(subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                 "['purelib'])"], capture_output=True, text=True,
                                check=True).stdout.strip())
    # every dependency stays visible; cudabook's editable hook (a .pth in our site-packages) does
    # not, because .pth files in a directory added this way are not processed
    deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]
            if Path(p).is_dir()]
    # numba-cuda's own .pth hook (which makes numba.cuda the numba-cuda package, as on Colab) is
    # one of those .pth files: run it here
    hook = ("import importlib.util as _u; _u.find_spec('_numba_cuda_redirector') and "
            "__import__('_numba_cuda_redirector')")
    (vsite / "deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n" + hook + "\n")
    probe = subprocess.run([str(vpy), "-c", "import importlib.util as u; "
                            "print(u.find_spec('cudabook') is None, u.find_spec('numpy') is None)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True)
    assert probe.stdout.split() == ["True", "False"], probe.stdout

    work = tmp_path / "empty"
    work.mkdir()
    nb = work / "01_first_kernel.ipynb"
    shutil.copy(ROOT / "lessons" / "01_first_kernel.ipynb", nb)
    env = dict(os.environ, CUDABOOK_SRC=str(ROOT), NUMBA_ENABLE_CUDASIM="1", PYTHONPATH="")
    env.pop("PYTEST_VERSION", None)     # the runner stands for Jupyter, not for a pytest run
    r = subprocess.run([str(vpy), "-c", RUNNER, str(nb), str(work)], capture_output=True,
                       text=True, cwd=work, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SIMULATOR" in r.stdout
    assert "numba vector_add_v1: OK" in r.stdout
    installed = subprocess.run([str(vpy), "-c", "import cudabook, pathlib; "
                                "print(cudabook.KERNELS_DIR)"], capture_output=True, text=True,
                               cwd=work, env=env, check=True).stdout.strip()
    assert installed.startswith(str(venv)), installed          # the wheel, not the clone
    assert (Path(installed) / "vector_add.cu").is_file()
