#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for each target architecture (no GPU needed).
#   bash tools/compile_kernels.sh            sm_75 sm_80 sm_90
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null; then
  echo "nvcc not found: install the CUDA toolkit (or put its bin/ on PATH) to compile kernels/" >&2
  exit 1
fi
archs=${ARCHS:-"75 80 90"}
tmp=$(mktemp -d)
n=0
for f in kernels/*.cu; do
  for a in $archs; do
    nvcc -std=c++17 -arch=sm_$a -Ikernels -Werror all-warnings -c "$f" -o "$tmp/k.o"
    n=$((n + 1))
  done
  echo "compiled $f for sm_${archs// /, sm_}"
done
rm -rf "$tmp"
echo "nvcc: $n compilations ok"
