#!/usr/bin/env bash
# The main job: builds moe-reroute-bench (bench/), the C++ benchmark of the
# core, and runs it. It verifies every case against the naive reference
# (testing/reference) before timing it, then prints the ratio table (operator
# vs a plain copy of the same bytes and a per-row gather), the sizes where
# streaming stores pay, and the static-shape costs. The default workload is
# the original's example (A = 16384 int8 tokens of H = 7168, 16 x 16 counts,
# float32 scales, top-k weights); extra arguments go to moe-reroute-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
install_apt_deps

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel --target moe-reroute-bench
./build/bench/moe-reroute-bench "$@"
