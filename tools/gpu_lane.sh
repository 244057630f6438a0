#!/usr/bin/env bash
# The GPU lane. Run from the repository root on a machine with a CUDA GPU:
#
#   bash tools/gpu_lane.sh            every chapter
#   bash tools/gpu_lane.sh 01 04      only these chapters
#   LESSONS_ONLY=1 bash tools/gpu_lane.sh    lessons only: steps 1, 3, 7 (when only prose or
#                                            plotting changed and solutions are current)
#
# 1. execute lessons/ and solutions/ in place, keeping their outputs (and the benchmark results,
#    written to reports/benchmarks.json by the lessons' bench tables);
# 2. regenerate exercises/ from the executed solutions (their stored PASS lines);
# 3. nbval the lessons and solutions again: the outputs must reproduce;
# 4. every exercise stub must fail its grader, every solution put back must pass it;
# 5. pytest -m gpu (graders against wrong answers, helper timing);
# 6. compute-sanitizer racecheck and memcheck on the kernels of tests/sanitize_targets.py;
# 7. write the dated report reports/gpu-lane-DATE[-chapters].md.
# Where $OUT is set (the device tool), the changed notebooks and reports are packed into it.
set -uo pipefail
cd "$(dirname "$0")/.."
# no MPLBACKEND here: the notebooks' kernels must use the inline backend, or no figure is stored
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset MPLBACKEND
py=${PYTHON:-python3}

chapters=("$@")
if [ ${#chapters[@]} -eq 0 ]; then
  for f in lessons/*.ipynb; do b=$(basename "$f"); chapters+=("${b:0:2}"); done
  suffix=""
else
  suffix="-ch$(IFS=-; echo "${chapters[*]}")"
fi
[ -n "${LESSONS_ONLY:-}" ] && suffix="${suffix}-lessons"
nbs_l=(); nbs_s=(); nbs_e=(); tests=(tests/test_helpers.py)
for c in "${chapters[@]}"; do
  for f in lessons/${c}_*.ipynb; do [ -f "$f" ] && nbs_l+=("$f"); done
  if [ -z "${LESSONS_ONLY:-}" ]; then
    for f in solutions/${c}_*.ipynb; do [ -f "$f" ] && nbs_s+=("$f"); done
    for f in exercises/${c}_*.ipynb; do [ -f "$f" ] && nbs_e+=("$f"); done
  fi
  [ -f "tests/test_ch${c}.py" ] && tests+=("tests/test_ch${c}.py")
done

day=$(date -u +%F)
mkdir -p reports
report="reports/gpu-lane-${day}${suffix}.md"
log=$(mktemp -d)
declare -a steps
status=0
step() {  # step NAME CMD... : run, time, keep the last summary line
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name"
  "$@" 2>&1 | tee "$log/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  local last=$(grep -E "passed|failed|error|ok |FAILED|problems|stubs fail|racecheck|memcheck" "$log/$name.log" | tail -n 1)
  [ $rc -ne 0 ] && status=1
  steps+=("| $name | $([ $rc -eq 0 ] && echo pass || echo FAIL) | ${dt} s | ${last//|/\\|} |")
}

t_start=$(date +%s)
export CUDABOOK_RESULTS=reports/benchmarks.json
# the results file keeps, per chapter, exactly what this run measures: drop the chapters' old rows
"$py" - "${chapters[@]}" <<'PYEOF'
import json, pathlib, sys
p = pathlib.Path("reports/benchmarks.json")
if p.is_file():
    d = json.loads(p.read_text())
    d["results"] = [e for e in d["results"] if e["chapter"] not in {f"ch{c}" for c in sys.argv[1:]}]
    p.write_text(json.dumps(d, indent=1) + "\n")
PYEOF
step execute "$py" tools/gpu_execute.py "${nbs_l[@]}" "${nbs_s[@]}"
unset CUDABOOK_RESULTS
[ -z "${LESSONS_ONLY:-}" ] && step exercises "$py" tools/nbtools.py exercises
step nbval "$py" -m pytest -q -p no:cacheprovider --nbval-lax "${nbs_l[@]}" "${nbs_s[@]}"
if [ -z "${LESSONS_ONLY:-}" ]; then
  step graders "$py" tools/check_exercises.py "${nbs_e[@]}"
  step pytest-gpu "$py" -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}"
  if command -v compute-sanitizer >/dev/null; then
    step sanitize "$py" tools/sanitize.py "${chapters[@]}"
  fi
fi
step policy "$py" tools/nbtools.py check "${nbs_l[@]}" "${nbs_s[@]}" "${nbs_e[@]}"
t_total=$(( $(date +%s) - t_start ))

"$py" - "$report" "$t_total" "${steps[@]}" <<'PYEOF'
import sys, json, subprocess, platform
sys.path.insert(0, ".")
import cudabook as cb
path, total, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
d = cb.env.info()
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except Exception:
    smi = "?"
try:
    ex = json.load(open("reports/.last_execute.json"))
except Exception:
    ex = []
lines = [f"# GPU lane report, {__import__('datetime').date.today().isoformat()}", "",
         f"- GPU: {d.name} ({d.arch}, {d.sms} SMs, {d.mem_gb:.0f} GiB)",
         f"- driver {smi} (CUDA {d.driver}), runtime {d.runtime}",
         "- packages: " + ", ".join(f"{k} {v}" for k, v in d.packages.items() if v),
         f"- wall time: {total} s", "",
         "| step | result | time | summary |", "|---|---|---|---|", *rows, "",
         "| notebook | executed | seconds |", "|---|---|---|",
         *[f"| {e['notebook']} | {'ok' if e['ok'] else 'FAILED: ' + e['error']} | {e['seconds']} |"
           for e in ex], ""]
open(path, "w").write("\n".join(lines))
print("\n".join(lines))
PYEOF
rm -f reports/.last_execute.json

if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/lane.tgz" lessons solutions exercises reports
  tar czf "$OUT/logs.tgz" -C "$log" .
fi
exit $status
