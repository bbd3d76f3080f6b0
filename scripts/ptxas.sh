#!/usr/bin/env bash
# Registers, spills, stack and shared memory of every CUDA kernel as ptxas
# reports them for one architecture (default sm_90), one line a kernel.
# Needs only nvcc: compiles src/cuda/kernels.cu on its own, no build dir.
# Usage: scripts/ptxas.sh [ARCH]   e.g. scripts/ptxas.sh 80
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
log=$(mktemp)
trap 'rm -f "$log" "$log.o"' EXIT
"$nvcc" -std=c++20 -O3 -arch="sm_$arch" -Iinclude -Isrc -c src/cuda/kernels.cu -o "$log.o" \
  -Xptxas -v 2> "$log"
echo "ptxas, sm_$arch ($("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
printf '%-28s %5s %13s %12s %6s %6s\n' kernel regs spill_stores spill_loads stack smem
# Each entry's "Function properties" line (stack, spills) comes before its
# "Used N registers" line.
awk '
  /Compiling entry function/ {
    match($0, /_ZN[^'\'']*/); name = substr($0, RSTART, RLENGTH)
    kernel = name
    if (match(name, /(fused|tables|move)_kernel/)) kernel = substr(name, RSTART, RLENGTH)
    args = ""
    if (name ~ /kernelIi/) args = "int32"
    if (name ~ /kernelIl/) args = "int64"
    if (name ~ /Lb1EE/) args = args (args == "" ? "" : ",") "cs"
    if (name ~ /Lb0EE/) args = args (args == "" ? "" : ",") "plain"
    if (args != "") kernel = kernel "<" args ">"
  }
  /bytes stack frame/ { stack = $1; stores = $5; loads = $9 }
  /Used [0-9]+ registers/ {
    regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
    smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
    printf "%-28s %5s %13s %12s %6s %6s\n", kernel, regs, stores, loads, stack, smem
  }' "$log"
