#!/usr/bin/env bash
# Install everything the book needs into the active Python environment (use a fresh venv).
#   bash tools/setup.sh
#
# It decides by itself what a fresh machine needs:
# * the CuPy wheel that matches the NVIDIA driver: cupy-cuda13x for a CUDA 13 driver,
#   cupy-cuda12x for a CUDA 12 driver and for a machine without a driver (the CPU lane's
#   choice, what Colab uses); requirements.txt names cupy-cuda12x and this script swaps the
#   name, keeping the version bounds. CUDABOOK_CUDA=12|13|cpu overrides the detection;
# * without a driver, PyTorch's CPU build first, so that requirements.txt does not pull a
#   multi-GB CUDA build of torch (TORCH_INDEX overrides where the CPU build comes from);
# * the CUDA compiler the CPU lane uses (tools/cuda-compiler.txt, pip wheels of nvcc and the
#   toolkit headers), so the lane needs no system toolkit, and the NVRTC wheel CuPy compiles with.
# It ends by importing what it installed (numba.cuda next to numba included), so a pair of
# versions that cannot work together fails here and not in the first notebook.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's output without the noise: this machine's empty local indexes, and setuptools' banner about
# the editable install mapping kernels/ into the package (cudabook.kernels), which is deliberate
pip_q() {
  python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -e "is ignored: it is neither" \
    -e "editable_wheel.py" -e "^ *!!$" -e "^ *\*\*\*\*" -e "careful with folders" -e "name as your package" \
    -e "WheelFile(wheel_path" || true
}

driver_cuda() {  # the CUDA major version the driver supports, or "cpu"
  python - <<'PY'
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    print(v.value // 1000 if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value else "cpu")
except OSError:
    print("cpu")
PY
}
cuda=${CUDABOOK_CUDA:-$(driver_cuda)}
case $cuda in
  cpu) cupy=cupy-cuda12x; nvrtc="nvidia-cuda-nvrtc-cu12>=12.4,<13"; why="no NVIDIA driver" ;;
  12)  cupy=cupy-cuda12x; nvrtc="nvidia-cuda-nvrtc-cu12>=12.4,<13"; why="CUDA 12 driver" ;;
  1[3-9]) cupy=cupy-cuda13x; nvrtc="nvidia-cuda-nvrtc>=13,<14"; why="CUDA $cuda driver" ;;
  *) echo "setup: the NVIDIA driver supports CUDA $cuda; CuPy 14 needs CUDA 12 or newer." \
          "Update the driver (or set CUDABOOK_CUDA=cpu to use the simulator only)." >&2
     exit 1 ;;
esac
echo "setup: $why -> $cupy"

pip_q --upgrade pip
if [ "$cuda" = cpu ]; then
  pip_q --retries 0 --timeout 20 --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "torch==2.13.0"
fi
# a venv made for another driver keeps its old wheel: two CuPy wheels in one env break both
for other in cupy-cuda11x cupy-cuda12x cupy-cuda13x; do
  if [ "$other" != "$cupy" ] && python -m pip show -q "$other" >/dev/null 2>&1; then
    python -m pip uninstall -q -y "$other"
  fi
done
req=$(mktemp)
trap 'rm -f "$req"' EXIT
sed -E "s/^cupy-cuda12x/$cupy/" requirements.txt > "$req"
pip_q -r "$req"
pip_q "$nvrtc" -r tools/cuda-compiler.txt

python - "$cupy" <<'PY'
import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

for d in ("numpy", "numba", "numba-cuda", sys.argv[1], "torch", "jupyter-book", "nbval",
          "selenium", "cudabook"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        raise SystemExit(f"setup: {d} did not install") from None
nvcc = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "nvcc"
if not nvcc.is_file():
    raise SystemExit(f"setup: the CPU lane's compiler did not install ({nvcc} is missing)")
print(f"  nvcc {md.version('nvidia-cuda-nvcc')} ({nvcc})")
# numba-cuda next to numba, in both modes: a pair pip admits can still fail to import
for sim in ("1", "0"):
    r = subprocess.run([sys.executable, "-c", "import numba.cuda"], capture_output=True,
                       text=True, env={**os.environ, "NUMBA_ENABLE_CUDASIM": sim})
    if r.returncode:
        raise SystemExit(f"setup: numba-cuda {md.version('numba-cuda')} does not import next to "
                         f"numba {md.version('numba')} (NUMBA_ENABLE_CUDASIM={sim}):\n"
                         + r.stderr[-1500:])
print("setup: ok")
PY
