#!/usr/bin/env bash
# Registers, spills, stack and shared memory of every CUDA kernel as ptxas
# reports them for one architecture (default sm_90), one line a kernel.
# Needs only nvcc: compiles src/cuda/kernels.cu and src/cuda/routing.cu on
# their own, no build dir.
# Usage: scripts/ptxas.sh [ARCH]   e.g. scripts/ptxas.sh 80
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
log=$(mktemp)
trap 'rm -f "$log" "$log.o"' EXIT
: > "$log"
for source in src/cuda/kernels.cu src/cuda/routing.cu; do
  "$nvcc" -std=c++20 -O3 -arch="sm_$arch" -Iinclude -Isrc -c "$source" -o "$log.o" \
    -Xptxas -v 2>> "$log"
done
echo "ptxas, sm_$arch ($("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
printf '%-34s %5s %13s %12s %6s %6s\n' kernel regs spill_stores spill_loads stack smem
# Each entry's "Function properties" line (stack, spills) comes before its
# "Used N registers" line.
awk '
  /Compiling entry function/ {
    match($0, /_ZN[^'\'']*/); name = substr($0, RSTART, RLENGTH)
    kernel = name
    if (match(name, /(fused|tables|move|count|scan|place|gather|check_rows|finalize)_kernel/))
      kernel = substr(name, RSTART, RLENGTH)
    args = ""
    if (name ~ /kernelIi/) args = "int32"
    if (name ~ /kernelIl/) args = "int64"
    if (name ~ /Lb1EE/) args = args (args == "" ? "" : ",") "cs"
    if (name ~ /Lb0EE/) args = args (args == "" ? "" : ",") "plain"
    if (match(name, /gather_kernelI[^E]*E/)) {
      word = substr(name, RSTART + 14, RLENGTH - 15)
      args = (word == "5uint4" ? 16 : word == "5uint2" ? 8 : word == "j" ? 4 : word == "t" ? 2 : 1) "-byte"
    }
    if (name ~ /finalize_kernelI.*4Half/) args = "float16"
    if (name ~ /finalize_kernelI.*8BFloat16ES5_/) args = "bfloat16"
    if (name ~ /finalize_kernelI.*8BFloat16ENS.*7Float32/) args = "bfloat16,float32"
    if (name ~ /finalize_kernelI.*7Float32ES5_/) args = "float32"
    if (args != "") kernel = kernel "<" args ">"
  }
  /bytes stack frame/ { stack = $1; stores = $5; loads = $9 }
  /Used [0-9]+ registers/ {
    regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
    smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
    printf "%-34s %5s %13s %12s %6s %6s\n", kernel, regs, stores, loads, stack, smem
  }' "$log"
