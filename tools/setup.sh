#!/usr/bin/env bash
# Install everything the book needs into the active Python environment (use a fresh venv).
#   bash tools/setup.sh
# On a machine without an NVIDIA driver, PyTorch's CPU build is installed first, so that
# requirements.txt does not pull a multi-GB CUDA build of torch. TORCH_INDEX overrides where the
# CPU build comes from.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
python -m pip install -q --disable-pip-version-check --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_q --retries 0 --timeout 20 --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "torch==2.13.0"
fi
pip_q -r requirements.txt
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # CuPy's run-time compiler, so the CPU lane can compile kernels/ exactly as cb.load_cuda does
  pip_q "nvidia-cuda-nvrtc-cu12>=12.4"
fi
python - <<'PY'
import importlib.metadata as md
for d in ("numpy", "numba-cuda", "cupy-cuda12x", "torch", "jupyter-book", "nbval", "cudabook"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        raise SystemExit(f"setup: {d} did not install")
PY
