#!/usr/bin/env bash
# The CPU lane (what CI runs, no GPU needed), from the repository root, in an environment made by
# tools/setup.sh. Numba runs on the CUDA simulator; cells marked %%gpu are skipped. Each step
# prints its time; a table of them closes the run.
set -uo pipefail
cd "$(dirname "$0")/.."
export NUMBA_ENABLE_CUDASIM=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1
pass=0; fail=0; failed=(); times=()
t_lane=$SECONDS
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  if "$@"; then pass=$((pass + 1)); echo "--- $name ok ($((SECONDS - t0)) s)"
  else fail=$((fail + 1)); failed+=("$name"); echo "--- $name FAILED ($((SECONDS - t0)) s)"; fi
  times+=("$(printf '%-14s %5d s' "$name" $((SECONDS - t0)))")
}
nbs() { ls $1/*.ipynb 2>/dev/null; }

# The CUDA compiler the lane uses is the pip toolkit tools/setup.sh installs
# (tools/cuda-compiler.txt), for nvcc and for NVRTC's headers alike, not whatever the machine has.
cu=$(python -c 'import sysconfig, pathlib; p = pathlib.Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13"; print(p if (p / "bin" / "nvcc").is_file() else "")')
if [ -n "$cu" ]; then
  export PATH="$cu/bin:$PATH" CUDA_PATH="$cu"
  echo "toolkit: $cu (pip, tools/cuda-compiler.txt)"
else
  echo "toolkit: the pip toolkit is missing (run tools/setup.sh); nvcc is $(command -v nvcc || echo absent)"
fi

# The Colab-like lane (tools/colab_lane.py) needs nothing the steps below make: it builds its own
# environment and runs each notebook alone in an empty folder. It starts now, in the background
# and at a lower priority (nice 5), so that its pip installs and notebooks use the cores the steps
# below leave idle (compiles and tests waiting on their slowest file, the book build on one core);
# its step, last, waits for it and prints its report. COLAB_LANE_BACKGROUND=0 runs it last, in
# the foreground.
lane_pid=
if [ "${COLAB_LANE_BACKGROUND:-1}" = 1 ]; then
  lane_log=$(mktemp)
  t_lane_start=$SECONDS
  nice -n "${COLAB_LANE_NICE:-5}" python tools/colab_lane.py >"$lane_log" 2>&1 &
  lane_pid=$!
  trap 'kill "$lane_pid" 2>/dev/null; rm -f "$lane_log"' INT TERM
  trap 'rm -f "$lane_log"' EXIT
  echo "colab-lane: started in the background (pid $lane_pid)"
fi
colab_lane_wait() {
  local rc=0
  wait "$lane_pid" || rc=$?
  cat "$lane_log"
  echo "colab-lane: ran $((SECONDS - t_lane_start)) s in the background, exit $rc"
  return $rc
}

step lint          ruff check cudabook kernels tests tools conftest.py
step sync          python tools/nbtools.py exercises --check
step policy        python tools/nbtools.py check
step addresses     python tools/nbtools.py urls
step nvcc          bash tools/compile_kernels.sh
step nvrtc         python tools/nvrtc_check.py
# tests and notebooks on every core (pytest-xdist); a notebook's cells stay in one process
par=()
python -c "import xdist" 2>/dev/null && par=(-n "${JOBS:-auto}" --dist loadfile)
# the test files that take longest first, the rest in name order (pytest-xdist would otherwise
# hand out the files with the most tests first, and the single 40 s test of test_setup_cell.py
# last, on one core while the other idles)
tests=()
for f in tests/test_setup_cell.py tests/test_ch09.py tests/test_ch03.py tests/test_trace.py \
         tests/test_ch04.py tests/test_ch01.py tests/test_*.py; do
  [ -f "$f" ] && [[ " ${tests[*]} " != *" $f "* ]] && tests+=("$f")
done
step unit-tests    python -m pytest -q -p no:cacheprovider "${par[@]}" ${par:+--no-loadscope-reorder} "${tests[@]}"
step notebooks-sim python -m pytest -q -p no:cacheprovider "${par[@]}" --nbval-lax $(nbs lessons) $(nbs solutions)
# the stubs must fail; the solutions' side is notebooks-sim (solutions/) and the Colab-like lane
step exercises     python tools/check_exercises.py --stubs-only $(nbs exercises)
rm -rf _build
step book          jupyter-book build . -n -W --keep-going -q
step browser       python tools/browser_test.py _build/html
if [ -n "$lane_pid" ]; then step colab-lane colab_lane_wait
else step colab-lane python tools/colab_lane.py; fi

echo
echo "step times:"
printf '  %s\n' "${times[@]}"
printf '  %-14s %5d s\n' total $((SECONDS - t_lane))
[ $fail -eq 0 ] || echo "failed steps: ${failed[*]}"
echo "cpu-lane: $pass passed, $fail failed"
[ $fail -eq 0 ]
