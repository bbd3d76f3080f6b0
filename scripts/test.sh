#!/usr/bin/env bash
# Builds everything and runs every test: ctest (core, CLI, install, examples,
# CUDA host logic), pytest, then the fuzzers and the sanitizer suites.
# MOE_REROUTE_QUICK=1 skips the fuzzers and sanitizers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
install_apt_deps
install_python_deps

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel
ctest --test-dir build --output-on-failure --parallel 2

python3 -m pip install -q --no-build-isolation --root-user-action=ignore .
python3 -m pytest tests/python -q

if [[ ${MOE_REROUTE_QUICK:-0} != 1 ]]; then
  bash scripts/hardening.sh
fi
