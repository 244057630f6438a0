#!/usr/bin/env bash
# The CPU lane (what CI runs, no GPU needed), from the repository root, in an environment made by
# tools/setup.sh. Numba runs on the CUDA simulator; cells marked %%gpu are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export NUMBA_ENABLE_CUDASIM=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1
pass=0; fail=0; failed=()
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  if "$@"; then pass=$((pass + 1)); echo "--- $name ok ($((SECONDS - t0)) s)"
  else fail=$((fail + 1)); failed+=("$name"); echo "--- $name FAILED ($((SECONDS - t0)) s)"; fi
}
nbs() { ls $1/*.ipynb 2>/dev/null; }

step lint          ruff check cudabook kernels tests tools conftest.py
step sync          python tools/nbtools.py exercises --check
step policy        python tools/nbtools.py check
step nvcc          bash tools/compile_kernels.sh
step nvrtc         python tools/nvrtc_check.py
step unit-tests    python -m pytest -q -p no:cacheprovider tests
step notebooks-sim python -m pytest -q -p no:cacheprovider --nbval-lax $(nbs lessons) $(nbs solutions)
step exercises     python tools/check_exercises.py $(nbs exercises)
rm -rf _build
step book          jupyter-book build . -n -W --keep-going -q

echo
[ $fail -eq 0 ] || echo "failed steps: ${failed[*]}"
echo "cpu lane: $pass passed, $fail failed"
[ $fail -eq 0 ]
