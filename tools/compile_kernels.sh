#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for each target architecture (no GPU needed).
#   bash tools/compile_kernels.sh            sm_75 sm_80 sm_90, one job per core
#   ARCHS="90" JOBS=1 bash tools/compile_kernels.sh
# Each (file, architecture) pair is one nvcc job; a failing job prints its own compiler output.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null; then
  echo "nvcc not found: install the CUDA toolkit (or put its bin/ on PATH) to compile kernels/" >&2
  exit 1
fi
archs=${ARCHS:-"75 80 90"}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export tmp

compile_one() {  # compile_one FILE ARCH: quiet on success, the compiler's output on failure
  local f=$1 a=$2 o
  o="$tmp/$(basename "$f" .cu).sm_$a"
  if nvcc -std=c++17 -arch="sm_$a" -Ikernels -Werror all-warnings -c "$f" -o "$o.o" >"$o.log" 2>&1
  then echo ok >"$o.ok"
  else echo "FAILED: $f for sm_$a"; cat "$o.log"; return 1
  fi
}
export -f compile_one

status=0
for f in kernels/*.cu; do for a in $archs; do printf '%s\n%s\n' "$f" "$a"; done; done |
  xargs -n 2 -P "$jobs" bash -c 'compile_one "$0" "$1"' || status=$?
n=$(find "$tmp" -name '*.ok' | wc -l)
total=$(( $(ls kernels/*.cu | wc -l) * $(echo $archs | wc -w) ))
for f in kernels/*.cu; do
  ok=1
  for a in $archs; do [ -f "$tmp/$(basename "$f" .cu).sm_$a.ok" ] || ok=0; done
  [ $ok -eq 1 ] && echo "compiled $f for sm_${archs// /, sm_}"
done
if [ $status -ne 0 ] || [ "$n" -ne "$total" ]; then
  echo "nvcc: $n of $total compilations ok ($jobs at a time)" >&2
  exit 1
fi
echo "nvcc: $n compilations ok ($jobs at a time)"
