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

# The Python package against the pinned torch (scripts/deps.sh): every test.
python3 -m pip install -q --no-build-isolation --root-user-action=ignore .
python3 -m pytest tests/python -q

# The torch operators against the newest torch and nanobind on PyPI, in a
# virtual environment created once (a large download the first time), built
# there against them: the operator tests (docs/torch.md).
newest="${MOE_REROUTE_NEWEST_TORCH_VENV:-$HOME/.cache/moe_reroute/torch-newest}"
make_venv "$newest" "${MOE_REROUTE_NEWEST_TORCH_PACKAGES[@]}"
"$newest/bin/python" -m pip install -q --no-build-isolation --root-user-action=ignore \
  -C build-dir=build-py/newest-torch .
"$newest/bin/python" -m pytest tests/python/test_torch_op.py -q

# The NumPy part alone, where torch is not installed: README's plain
# `pip install .` (an isolated build with the newest nanobind that
# pyproject.toml allows, from a fresh build directory: the
# isolated environment's paths change from one build to the next) in a virtual
# environment without torch, then the NumPy tests there.
numpy_only="${MOE_REROUTE_NUMPY_ONLY_VENV:-$HOME/.cache/moe_reroute/numpy-only}"
make_venv "$numpy_only" "${MOE_REROUTE_TEST_PACKAGES[@]}"
rm -rf build-py/numpy-only
"$numpy_only/bin/python" -m pip install -q --root-user-action=ignore \
  -C build-dir=build-py/numpy-only -C cmake.define.MOE_REROUTE_CUDA=OFF .
"$numpy_only/bin/python" -m pytest tests/python/test_reroute.py -q

if [[ ${MOE_REROUTE_QUICK:-0} != 1 ]]; then
  bash scripts/hardening.sh
fi
