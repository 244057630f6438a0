#!/usr/bin/env bash
# Several GPU lanes at once on a machine of several GPUs: group i runs on GPU i, in its own copy of
# the repository (/tmp/gI), under a time limit; what each group leaves (notebooks, reports, its
# results files and logs) is packed into $OUT/gI.tgz, or ./gpu-groups/gI.tgz without $OUT.
#
#   bash tools/gpu_groups.sh LIMIT_S "GROUP_CMD" ["GROUP_CMD" ...]
#   e.g. bash tools/gpu_groups.sh 540 "SKIP_HELPERS=1 bash tools/gpu_lane.sh 06" \
#            "SKIP_HELPERS=1 bash tools/gpu_lane.sh 02 10" "TESTS_ONLY=1 bash tools/gpu_lane.sh 03"
#
# Nothing in the repository itself changes: bring a group's notebooks back by hand and merge its
# rows with `python tools/results.py merge gI/run/results-chNN.json --chapters NN`, for the
# chapters whose steps all passed. Lanes on different GPUs share the host's CPUs and PCIe: a
# host-to-device copy measured in one may see another's traffic. At most one group per GPU.
# Wheels carried in .whl/ (../shared/gpu/fetch-wheels) are installed first when present.
set -u
limit=${1:?usage: gpu_groups.sh LIMIT_S GROUP_CMD ...}; shift
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_groups: no CUDA GPU here; nothing was run" >&2; exit 2
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
nvidia-smi -L
n=$(nvidia-smi -L | wc -l)
[ $# -le "$n" ] || { echo "$# groups for $n GPUs: give at most one group per GPU" >&2; exit 2; }
out=${OUT:-$PWD/gpu-groups}; mkdir -p "$out"
root=$PWD
t0=$SECONDS
i=0
for cmd in "$@"; do
  d=/tmp/g$i; rm -rf "$d"; mkdir -p "$d"
  tar cf - --exclude=./.whl --exclude=./.git --exclude=./gpu-groups . | (cd "$d" && tar xf -)
  ( cd "$d" && export CUDA_VISIBLE_DEVICES=$i LANE_RUN_DIR=$d/run && unset OUT && mkdir -p run &&
    timeout "$limit" bash -c "$cmd" > "$d/group.log" 2>&1; echo "rc=$?" >> "$d/group.log"
    tar czf "$root/.gout-g$i.tgz" lessons solutions exercises reports group.log run ) &
  i=$((i + 1))
done
wait
for j in $(seq 0 $((i - 1))); do
  mv "$root/.gout-g$j.tgz" "$out/g$j.tgz"
  echo "=== group $j (GPU $j): $(tail -n 1 /tmp/g$j/group.log)"
  grep -E "^\| [0-9a-z]+ \| [a-z]+ \| (pass|FAIL|skipped)|passed|failed|FAIL" /tmp/g$j/group.log \
    | grep -E "FAIL|failed|^\| " | tail -n 40
done
echo "all groups: $((SECONDS - t0)) s"
