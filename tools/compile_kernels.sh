#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for each target architecture (no GPU needed).
#   bash tools/compile_kernels.sh            sm_75 sm_80 sm_90, one job per core
#   ARCHS="90" JOBS=1 bash tools/compile_kernels.sh
# Each file is one nvcc job that compiles it for every architecture (one -gencode per
# architecture: the host side is preprocessed and compiled once, not once per architecture), the
# largest files first; a failing job prints its own compiler output.
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

gencode=()
for a in $archs; do gencode+=(-gencode "arch=compute_$a,code=sm_$a"); done
export GENCODE="${gencode[*]}"

compile_one() {  # compile_one FILE: quiet on success, the compiler's output on failure
  local f=$1 o
  o="$tmp/$(basename "$f" .cu)"
  # shellcheck disable=SC2086  # GENCODE is a list of words
  if nvcc -std=c++17 $GENCODE -Ikernels -Werror all-warnings -c "$f" -o "$o.o" >"$o.log" 2>&1
  then echo ok >"$o.ok"
  else echo "FAILED: $f for sm_${archs// /, sm_}"; cat "$o.log"; return 1
  fi
}
export -f compile_one
export archs

status=0
ls -S kernels/*.cu | xargs -n 1 -P "$jobs" bash -c 'compile_one "$0"' || status=$?
nfiles=$(find "$tmp" -name '*.ok' | wc -l)
n=$(( nfiles * $(echo $archs | wc -w) ))
total=$(( $(ls kernels/*.cu | wc -l) * $(echo $archs | wc -w) ))
for f in kernels/*.cu; do
  [ -f "$tmp/$(basename "$f" .cu).ok" ] && echo "compiled $f for sm_${archs// /, sm_}"
done
if [ $status -ne 0 ] || [ "$n" -ne "$total" ]; then
  echo "nvcc: $n of $total compilations ok ($jobs at a time)" >&2
  exit 1
fi
echo "nvcc: $n compilations ok ($jobs at a time)"
