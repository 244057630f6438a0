#!/usr/bin/env bash
# The GPU lane. Run from the repository root on a machine with a CUDA GPU:
#
#   bash tools/gpu_lane.sh            every chapter
#   bash tools/gpu_lane.sh 03 04      only these chapters
#   LESSONS_ONLY=1 bash tools/gpu_lane.sh 04    lessons only (execute, nbval, policy)
#   SKIP_NBVAL=1 bash tools/gpu_lane.sh          no second execution (step 3), for a run short of
#                                                device time; the report marks the step skipped
#   SKIP_HELPERS=1 bash tools/gpu_lane.sh 11     no final run of the chapter-free test files
#                                                (the report says so)
#   SOLUTIONS_ONLY=1 bash tools/gpu_lane.sh 04   solutions only: the lessons are neither executed
#                                                nor re-checked (a change that touches no lesson)
#   LANE_RUN_DIR=DIR bash tools/gpu_lane.sh 06   this run's results files and logs in DIR, kept
#   TESTS_ONLY=1 bash tools/gpu_lane.sh 01       nothing executed and nothing stored: graders,
#                                                test files, sanitizer and policy only (a change of
#                                                graders or helpers); no rows are merged
# Several lanes may run at once on a machine of several GPUs, one per GPU
# (CUDA_VISIBLE_DEVICES), each in its own copy of the repository.
#
# It refuses to start without a GPU. Then, chapter by chapter:
#   1. execute lessons/NN_* and solutions/NN_* in place (tools/gpu_execute.py); their bench
#      tables record into a results file of this run, never into reports/benchmarks.json;
#   2. regenerate exercises/ from the executed solutions;
#   3. nbval the lessons and solutions again: the outputs must reproduce;
#   4. every exercise stub must fail its grader, every solution put back must pass it;
#   5. the chapter's whole test files tests/test_chNN*.py (tests marked `gpu` run here, those
#      marked `simulator` are skipped, unmarked tests take their GPU branches), with race checks
#      that cannot run counted as failures;
#   6. compute-sanitizer racecheck and memcheck on the kernels of the chapter (tools/sanitize.py);
#   7. the notebook format policy.
# A chapter whose steps all passed gets its rows in reports/benchmarks.json replaced by this
# run's (tools/results.py merge); a chapter that failed keeps its stored rows. Finally the test
# files of no chapter (tests/test_helpers.py, tests/test_small_gpus.py, tests/test_trace.py) run
# once and the dated report reports/gpu-lane-DATE[-chNN...].md is
# written. Where $OUT is set (the device tool), notebooks, reports and logs are packed into it
# after every chapter, so a run cut short still returns what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
# no MPLBACKEND here: the notebooks' kernels must use the inline backend, or no figure is stored
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDABOOK_STRICT_RACECHECK=1
unset MPLBACKEND CUDABOOK_RESULTS
py=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1 || \
   ! "$py" -c "import sys, cudabook; sys.exit(0 if cudabook.HAS_GPU else 3)" >/dev/null 2>&1; then
  echo "gpu_lane: no usable CUDA GPU here (nvidia-smi or CuPy sees none); nothing was run and" >&2
  echo "nothing was changed. The GPU lane stores the book's outputs: run it on a GPU machine." >&2
  exit 2
fi

chapters=("$@")
if [ ${#chapters[@]} -eq 0 ]; then
  for f in lessons/*.ipynb; do b=$(basename "$f"); chapters+=("${b:0:2}"); done
  suffix=""
else
  suffix="-ch$(IFS=-; echo "${chapters[*]}")"
fi
[ -n "${LESSONS_ONLY:-}" ] && suffix="${suffix}-lessons"
[ -n "${SOLUTIONS_ONLY:-}" ] && suffix="${suffix}-solutions"
[ -n "${TESTS_ONLY:-}" ] && suffix="${suffix}-tests"
if [ -n "${LESSONS_ONLY:-}" ] && { [ -n "${SOLUTIONS_ONLY:-}" ] || [ -n "${TESTS_ONLY:-}" ]; }; then
  echo "gpu_lane: LESSONS_ONLY excludes SOLUTIONS_ONLY and TESTS_ONLY" >&2; exit 2
fi

day=$(date -u +%F)
mkdir -p reports
report="reports/gpu-lane-${day}${suffix}.md"
run=${LANE_RUN_DIR:-$(mktemp -d)}   # this run's results and logs (LANE_RUN_DIR keeps them)
log="$run/logs"; mkdir -p "$log"
declare -a rows
declare -a chapter_rows
status=0
chapter_ok=1

step() {  # step CHAPTER NAME CMD... : run, time, keep the last summary line
  local ch=$1 name=$2; shift 2
  local t0; t0=$(date +%s)
  echo "=== [$ch] $name"
  "$@" 2>&1 | tee "$log/$ch-$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  local last
  last=$(grep -E "passed|failed|error|ok |FAILED|problems|stubs fail|racecheck|memcheck|sanitize" \
         "$log/$ch-$name.log" | tail -n 1)
  if [ "$rc" -ne 0 ]; then status=1; chapter_ok=0; fi
  rows+=("| $ch | $name | $([ "$rc" -eq 0 ] && echo pass || echo FAIL) | ${dt} s | ${last//|/\\|} |")
}

pack() {  # one file: the notebooks, reports, and this run's results and logs (under run/)
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/lane.tgz" lessons solutions exercises reports \
    -C "$run" --transform "s,^\./,run/," .
}

t_start=$(date +%s)
for c in "${chapters[@]}"; do
  chapter_ok=1
  nbs_l=(); nbs_s=(); nbs_e=()
  if [ -z "${SOLUTIONS_ONLY:-}" ] && [ -z "${TESTS_ONLY:-}" ]; then
    for f in lessons/${c}_*.ipynb; do [ -f "$f" ] && nbs_l+=("$f"); done
  fi
  if [ -z "${LESSONS_ONLY:-}" ]; then
    for f in solutions/${c}_*.ipynb; do [ -f "$f" ] && nbs_s+=("$f"); done
  fi
  if [ $(( ${#nbs_l[@]} + ${#nbs_s[@]} )) -eq 0 ] && [ -z "${TESTS_ONLY:-}" ]; then
    echo "gpu_lane: chapter $c has no notebooks; skipped"; continue
  fi
  results="$run/results-ch$c.json"
  if [ -n "${TESTS_ONLY:-}" ]; then
    rows+=("| $c | execute | skipped (TESTS_ONLY=1: no notebook executed or stored) | 0 s | |")
  else
    # the book's own solutions pass the race checks in tests/test_chNN.py (strict, below); while
    # the notebooks run, the checks are off (CUDABOOK_RACE_CHECKS=0): they would add minutes
    CUDABOOK_RESULTS="$results" CUDABOOK_RACE_CHECKS=0 \
      step "$c" execute "$py" tools/gpu_execute.py "${nbs_l[@]}" "${nbs_s[@]}"
  fi
  if [ -z "${LESSONS_ONLY:-}" ]; then
    [ -z "${TESTS_ONLY:-}" ] && step "$c" exercises "$py" tools/nbtools.py exercises
    for f in exercises/${c}_*.ipynb; do [ -f "$f" ] && nbs_e+=("$f"); done
  fi
  if [ -n "${TESTS_ONLY:-}" ]; then
    :
  elif [ -z "${SKIP_NBVAL:-}" ]; then
    CUDABOOK_RACE_CHECKS=0 \
      step "$c" nbval "$py" -m pytest -q -p no:cacheprovider --nbval-lax "${nbs_l[@]}" "${nbs_s[@]}"
  else   # a run short of device time: the report says the outputs were not re-checked here
    rows+=("| $c | nbval | skipped (SKIP_NBVAL=1: outputs not re-executed a second time) | 0 s | |")
  fi
  if [ -z "${LESSONS_ONLY:-}" ]; then
    [ ${#nbs_e[@]} -gt 0 ] && CUDABOOK_RACE_CHECKS=0 \
      step "$c" graders "$py" tools/check_exercises.py "${nbs_e[@]}"
    tests_c=(tests/test_ch${c}*.py)
    [ -f "${tests_c[0]}" ] && step "$c" pytest "$py" -m pytest -q -p no:cacheprovider "${tests_c[@]}"
    if command -v compute-sanitizer >/dev/null; then
      step "$c" sanitize "$py" tools/sanitize.py "$c"
    fi
  fi
  [ -z "${TESTS_ONLY:-}" ] && \
    step "$c" policy "$py" tools/nbtools.py check "${nbs_l[@]}" "${nbs_s[@]}" "${nbs_e[@]}"
  if [ -n "${TESTS_ONLY:-}" ]; then
    chapter_rows+=("| $c | $([ "$chapter_ok" -eq 1 ] && echo pass || echo FAIL) | tests only, no rows |")
  elif [ "$chapter_ok" -eq 1 ] && [ -s "$results" ]; then
    "$py" tools/results.py merge "$results" --chapters "$c" | tee -a "$log/$c-merge.log"
    chapter_rows+=("| $c | pass | rows merged into reports/benchmarks.json |")
  elif [ "$chapter_ok" -eq 1 ]; then
    chapter_rows+=("| $c | pass | no rows recorded |")
  else
    chapter_rows+=("| $c | FAIL | stored rows kept; this run's rows in results-ch$c.json |")
  fi
  pack
done
if [ -n "${SKIP_HELPERS:-}" ]; then
  rows+=("| all | helpers | skipped (SKIP_HELPERS=1) | 0 s | |")
elif [ -z "${LESSONS_ONLY:-}" ]; then
  step all helpers "$py" -m pytest -q -p no:cacheprovider tests/test_helpers.py \
    tests/test_small_gpus.py tests/test_trace.py
fi
t_total=$(( $(date +%s) - t_start ))

"$py" - "$report" "$t_total" "${#rows[@]}" "${rows[@]}" "${chapter_rows[@]}" <<'PYEOF'
import sys, json, subprocess, datetime
sys.path.insert(0, ".")
import cudabook as cb
path, total, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows, chapters = sys.argv[4:4 + n], sys.argv[4 + n:]
d = cb.env.info()
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()[0]
except Exception:  # noqa: BLE001
    smi = "?"
try:
    ex = json.load(open("reports/.last_execute.json"))
except Exception:  # noqa: BLE001
    ex = []
lines = [f"# GPU lane report, {datetime.date.today().isoformat()}", "",
         f"- GPU: {d.name} ({d.arch}, {d.sms} SMs, {d.mem_gb:.0f} GiB)",
         f"- driver {smi} (CUDA {d.driver}), runtime {d.runtime}",
         "- packages: " + ", ".join(f"{k} {v}" for k, v in d.packages.items() if v),
         f"- wall time: {total} s", "",
         "| chapter | result | benchmark rows |", "|---|---|---|", *chapters, "",
         "| chapter | step | result | time | summary |", "|---|---|---|---|---|", *rows, ""]
open(path, "w").write("\n".join(lines))
print("\n".join(lines))
PYEOF
rm -f reports/.last_execute.json
pack
exit $status
