#!/usr/bin/env bash
# Builds the moe-reroute tool and runs its benchmark, the main job: the
# reference library's example workload, verified against the naive reference
# first. Extra arguments go to `moe-reroute bench` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
install_apt_deps

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel --target moe-reroute
./build/tools/moe-reroute bench "$@"
