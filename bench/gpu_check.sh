#!/usr/bin/env bash
# The GPU check, in one call: builds the CUDA backend, runs its tests (the
# bad-count, empty and inverse cases again under compute-sanitizer memcheck
# when it is installed), then prints the benchmark tables: the operator
# against cudaMemcpyAsync of the same bytes, and the torch peers
# (index_select, split + cat; skipped where torch has no CUDA).
#
# Environment: BUILD (build dir, default build-gpu), JOBS (default nproc),
# ARCHS (CUDA architectures, default 90 for the H200), REPS (default 50).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
ARCHS=${ARCHS:-90}
REPS=${REPS:-50}
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi

step() { printf '\n== %s (%ds)\n' "$1" "$SECONDS"; }

step "configure"
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_REROUTE_CUDA=ON \
  -DMOE_REROUTE_CUDA_ARCHITECTURES="$ARCHS" -DMOE_REROUTE_BUILD_TESTS=ON \
  -DMOE_REROUTE_BUILD_BENCH=ON > "$BUILD.configure.log" || { cat "$BUILD.configure.log"; exit 1; }
step "build"
cmake --build "$BUILD" -j"$JOBS" --target moe_reroute_cuda_launch_test moe_reroute_cuda_gpu_test \
  moe_reroute_gpu_bench
step "host-side tests"
"$BUILD"/tests/cuda/moe_reroute_cuda_launch_test --gtest_brief=1
step "GPU tests"
timeout 240 "$BUILD"/tests/cuda/moe_reroute_cuda_gpu_test
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
if [[ -n "$sanitizer" ]]; then
  step "GPU tests under compute-sanitizer memcheck"
  timeout 120 "$sanitizer" --tool memcheck --error-exitcode 1 \
    "$BUILD"/tests/cuda/moe_reroute_cuda_gpu_test \
    --gtest_filter='*BadCounts*:*EmptyInputs*:*Inverse*:*Graph*' --gtest_brief=1
else
  step "compute-sanitizer not found: memcheck skipped"
fi
step "benchmark: operator vs cudaMemcpyAsync"
timeout 120 "$BUILD"/src/cuda/moe_reroute_gpu_bench "$REPS"
step "benchmark: torch peers"
timeout 120 python3 bench/gpu_torch_peers.py "$REPS" || echo "torch peers failed or torch missing"
step "done"
