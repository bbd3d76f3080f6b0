#!/usr/bin/env bash
# Hardening checks, each in its own build dir, with one PASS/FAIL line per
# step at the end and a non-zero exit if any failed:
#   fuzz   clang + libFuzzer + ASan/UBSan (build-fuzz): every fuzz target
#          replays its seed corpus, then fuzzes for MOE_REROUTE_FUZZ_SECONDS
#          (default 40) each; a finding is saved under build-fuzz/findings/.
#   asan   the whole ctest suite under ASan + UBSan (build-asan, g++).
#   tsan   the whole ctest suite under TSan (build-tsan, clang + libomp).
# The sanitizer suites run ctest only (no Python) and exclude the label
# `large` (the > 4 GiB test; too slow and too big under a sanitizer).
# MOE_REROUTE_HARDENING_STEPS picks steps (default "fuzz asan tsan").
set -uo pipefail
cd "$(dirname "$0")/.."

fuzz_seconds=${MOE_REROUTE_FUZZ_SECONDS:-40}
steps=${MOE_REROUTE_HARDENING_STEPS:-fuzz asan tsan}
jobs=${MOE_REROUTE_JOBS:-$(nproc)}
fuzz_targets=(reroute inverse init_routing finalize_routing npy)

# Everything the top level builds with tests on, minus CUDA and Python.
common_flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_REROUTE_BUILD_TESTS=ON
              -DMOE_REROUTE_CUDA=OFF -DMOE_REROUTE_BUILD_PYTHON=OFF -DMOE_REROUTE_INSTALL=OFF)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}
# Open MPI's own leaks at exit (the MPI example's ctest cases); see the file.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/hardening/lsan.supp:fast_unwind_on_malloc=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# libomp is not instrumented; its Archer tool tells TSan about OpenMP's own
# synchronisation (see cmake/sanitize.cmake).
export TSAN_OPTIONS=${TSAN_OPTIONS:-ignore_noninstrumented_modules=1:halt_on_error=1:second_deadlock_stack=1}

results=()
failed=0

# run_step NAME COMMAND...: runs it, records PASS or FAIL with its time.
run_step() {
  local name=$1 start=$SECONDS
  shift
  echo "==> hardening: $name"
  if "$@"; then
    results+=("PASS  $name ($((SECONDS - start)) s)")
  else
    results+=("FAIL  $name ($((SECONDS - start)) s)")
    failed=1
  fi
}

fuzz_build() {
  CC=clang CXX=clang++ cmake -S . -B build-fuzz "${common_flags[@]}" \
    -DMOE_REROUTE_SANITIZE=address,undefined -DMOE_REROUTE_FUZZ=ON \
    -DMOE_REROUTE_BUILD_BENCH=OFF -DMOE_REROUTE_BUILD_EXAMPLES=OFF >/dev/null &&
    cmake --build build-fuzz --parallel "$jobs" --target "${fuzz_targets[@]/#/fuzz_}"
}

# fuzz_target NAME: replays the seed corpus, then fuzzes into a scratch copy.
fuzz_target() {
  local name=$1 binary=build-fuzz/tests/fuzz/fuzz_$1 seeds=tests/fuzz/corpus/$1
  local scratch=build-fuzz/corpus/$1 findings=build-fuzz/findings/$1 dict=()
  [[ -f tests/fuzz/$1.dict ]] && dict=(-dict="tests/fuzz/$1.dict")
  mkdir -p "$scratch" "$findings"
  "$binary" -runs=0 "$seeds" 2>&1 | tail -n 3 || return 1
  "$binary" -max_total_time="$fuzz_seconds" -timeout=10 -rss_limit_mb=4096 "${dict[@]}" \
    -print_final_stats=1 -artifact_prefix="$findings/" "$scratch" "$seeds" \
    >"build-fuzz/fuzz_$name.log" 2>&1
  local rc=$?
  grep -E "^(Done|stat::number_of_executed_units|stat::average_exec_per_sec)" \
    "build-fuzz/fuzz_$name.log"
  if ((rc != 0)); then
    tail -n 40 "build-fuzz/fuzz_$name.log"
    echo "fuzz_$name: finding saved in $findings/ (replay: $binary <file>)"
  fi
  return $rc
}

# sanitizer_suite DIR SANITIZERS COMPILER: builds everything and runs ctest.
sanitizer_suite() {
  local dir=$1 sanitize=$2 cxx=$3 cc=gcc
  [[ $cxx == clang++ ]] && cc=clang
  CC=$cc CXX=$cxx cmake -S . -B "$dir" "${common_flags[@]}" \
    -DMOE_REROUTE_SANITIZE="$sanitize" >/dev/null &&
    cmake --build "$dir" --parallel "$jobs" &&
    ctest --test-dir "$dir" --output-on-failure --parallel "$jobs" -LE large --timeout 900
}

for step in $steps; do
  case $step in
    fuzz)
      run_step "fuzz: build" fuzz_build
      for name in "${fuzz_targets[@]}"; do
        if [[ -x build-fuzz/tests/fuzz/fuzz_$name ]]; then
          run_step "fuzz: $name (corpus replay + ${fuzz_seconds} s)" fuzz_target "$name"
        else
          results+=("FAIL  fuzz: $name (not built)")
          failed=1
        fi
      done
      ;;
    asan) run_step "ctest under ASan + UBSan (build-asan)" sanitizer_suite build-asan address,undefined g++ ;;
    tsan) run_step "ctest under TSan (build-tsan)" sanitizer_suite build-tsan thread clang++ ;;
    *)
      results+=("FAIL  unknown step '$step'")
      failed=1
      ;;
  esac
done

echo "==> hardening summary"
printf '%s\n' "${results[@]}"
if ((failed)); then
  echo "hardening: FAILED"
  exit 1
fi
echo "hardening: all passed"
