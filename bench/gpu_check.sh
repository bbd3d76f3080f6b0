#!/usr/bin/env bash
# The GPU check, in one call that ends within 8 minutes on an H200: checks
# what the machine has, builds only what needs nothing missing (the core, the
# CUDA backend and the GPU benchmark need only the CUDA toolkit; the torch
# module when nanobind and torch are there; the GTest suite when GTest and
# CLI11 are), runs the benchmarks first (each verifies its outputs byte for
# byte against the naive reference before timing), prints one table, then
# runs what may fail (the GTest GPU suite, compute-sanitizer, the torch
# operators' GPU tests when pytest is there). Everything is
# tee'd into OUT_DIR. A step that fails is reported and the next one runs.
#
# Usage: bench/gpu_check.sh [--dry-run] OUT_DIR
#   --dry-run  configure, build and print the plan of every run, launching
#              nothing: runs without a GPU (ctest label gpu_check).
# Environment: BUILD (default OUT_DIR/build), JOBS (default nproc), ARCHS
# (default 90), REPS (default 30), BUDGET (seconds, default 470).
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
if [[ $# -ne 1 ]]; then
  echo "usage: bench/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
BUILD=${BUILD:-$out/build}
JOBS=${JOBS:-$(nproc)}
ARCHS=${ARCHS:-90}
REPS=${REPS:-30}
deadline=$((SECONDS + ${BUDGET:-470}))
exec > >(tee "$out/gpu_check.log") 2>&1

results=()
step() { printf '\n== %s (%ds)\n' "$1" "$SECONDS"; }
# run NAME SECONDS CMD...: at most SECONDS and what is left of the budget,
# output into OUT_DIR/NAME.log too; the result goes to the final list.
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  ((limit > left)) && limit=$left
  step "$name"
  if ((limit < 5)); then
    results+=("$name: skipped, out of time")
    return 1
  fi
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    results+=("$name: ok")
  elif ((rc == 124)); then
    results+=("$name: TIMED OUT after ${limit}s")
  else
    results+=("$name: FAILED (exit $rc)")
  fi
  return "$rc"
}
have() { command -v "$1" > /dev/null 2>&1; }
cmake_package() {  # a CMake package config anywhere cmake looks by default
  find /usr/lib /usr/lib64 /usr/local /usr/share /opt -ipath "*cmake*" -iname "$1Config.cmake" \
    -print -quit 2> /dev/null | grep -q .
}

step "what this machine has"
have nvidia-smi && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
torch=0 nanobind=0 gtest=0 generator=()
python3 -c "import torch" 2> /dev/null && torch=1
python3 -c "import nanobind" 2> /dev/null && nanobind=1
cmake_package GTest && cmake_package CLI11 && gtest=1
have ninja && generator=(-G Ninja)
printf '%-18s %s\n' nvcc "$("$nvcc" --version 2> /dev/null | tail -1 || echo missing)" \
  cmake "$(cmake --version 2> /dev/null | head -1 || echo missing)" \
  ninja "$(have ninja && echo yes || echo "no (make)")" \
  torch "$( ((torch)) && python3 -c 'import torch; print(torch.__version__, "cuda:", torch.cuda.is_available())' || echo no)" \
  nanobind "$( ((nanobind)) && echo yes || echo "no: torch op not built")" \
  "GTest + CLI11" "$( ((gtest)) && echo yes || echo "no: GTest GPU suite skipped")" \
  compute-sanitizer "${sanitizer:-no}"

# The summary of every step, then exit: non-zero when one failed.
finish() {
  step "summary$( ((dry_run)) && echo ", dry run")"
  local failed=0 r
  for r in "${results[@]}"; do
    echo "  $r"
    [[ "$r" == *FAILED* || "$r" == *"TIMED OUT"* ]] && failed=1
  done
  echo "everything is in $out"
  exit "$failed"
}

python_flags=()
((torch && nanobind)) && python_flags=(-DMOE_REROUTE_BUILD_PYTHON=ON -DMOE_REROUTE_CUDA_STATIC_RUNTIME=ON)
configure=(cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_REROUTE_CUDA=ON
  -DCMAKE_CUDA_COMPILER="$nvcc" -DMOE_REROUTE_CUDA_ARCHITECTURES="$ARCHS"
  -DMOE_REROUTE_BUILD_TESTS=OFF -DMOE_REROUTE_BUILD_TOOLS=OFF -DMOE_REROUTE_BUILD_BENCH=OFF
  -DMOE_REROUTE_BUILD_EXAMPLES=OFF -DMOE_REROUTE_INSTALL=OFF -DMOE_REROUTE_BUILD_GPU_BENCH=ON)
if ! run configure 120 "${configure[@]}" "${python_flags[@]}"; then
  ((${#python_flags[@]})) || finish
  python_flags=()
  run configure-without-python 120 "${configure[@]}" -DMOE_REROUTE_BUILD_PYTHON=OFF || finish
fi
targets=(moe_reroute_gpu_bench)
((${#python_flags[@]})) && targets+=(_core _torch_ops)
run build 240 cmake --build "$BUILD" -j"$JOBS" --target "${targets[@]}" || finish
run ptxas 60 scripts/ptxas.sh "$ARCHS"

# Our torch operator from this build, staged as a package beside its Python files.
staged=0
if ((${#python_flags[@]})) && ls "$BUILD"/python/_core*.so "$BUILD"/python/_torch_ops.so > /dev/null 2>&1; then
  staged=1
  rm -rf "$out/python" && mkdir -p "$out/python" && cp -r python/moe_reroute "$out/python/"
  cp "$BUILD"/python/_core*.so "$BUILD"/python/_torch_ops.so "$out/python/moe_reroute/"
  export PYTHONPATH="$out/python${PYTHONPATH:+:$PYTHONPATH}"
fi

dry=()
((dry_run)) && dry=(--dry-run)
run gpu_bench 180 "$BUILD"/bench/moe_reroute_gpu_bench "${dry[@]}" --reps "$REPS" \
  --tsv "$out/gpu_bench.tsv"
if ((torch)); then
  run torch_peers 150 python3 bench/gpu_torch_peers.py "${dry[@]}" --reps "$REPS" \
    --tsv "$out/torch_peers.tsv"
else
  results+=("torch_peers: skipped, no torch")
fi

step "table"
if ((dry_run)); then
  echo "dry run: no timings; the table joins $out/gpu_bench.tsv and $out/torch_peers.tsv"
elif [[ -s "$out/gpu_bench.tsv" ]]; then
  python3 - "$out/gpu_bench.tsv" "$out/torch_peers.tsv" << 'EOF' | tee "$out/table.txt"
import csv, math, sys
ours = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
try:
    peers = {(r["shape"], r["A"], r["dtype"]): r
             for r in csv.DictReader(open(sys.argv[2]), delimiter="\t")}
except OSError:
    peers = {}
f = lambda v: float(v) if v not in ("", "nan") else math.nan
print(f"{'shape':<8} {'A':>7} {'dtype':<9} {'k':>4} {'valid':>7} {'op_us':>8} {'graph_us':>8} "
      f"{'copy_us':>8} {'vs_copy':>7} {'torch_op':>8} {'isel_us':>8} {'isel_gr':>8} "
      f"{'vs_isel':>7} ok")
for r in ours:
    op, graph, copy = f(r["op_us"]), f(r["graph_us"]), f(r["copy_us"])
    p = peers.get((r["shape"], r["A"], r["dtype"])) if r["k"] == "1" and r["valid"] == r["A"] else None
    torch_op = f(p["ours_us"]) if p else math.nan
    isel, isel_graph = (f(p["isel_us"]), f(p["isel_graph_us"])) if p else (math.nan, math.nan)
    print(f"{r['shape']:<8} {r['A']:>7} {r['dtype']:<9} {r['k']:>4} {r['valid']:>7} {op:>8.2f} "
          f"{graph:>8.2f} {copy:>8.2f} {copy / op:>7.3f} {torch_op:>8.2f} {isel:>8.2f} "
          f"{isel_graph:>8.2f} {isel / op:>7.3f} {r['verified']}")
print("op = plain launch, graph = CUDA graph replay, copy = cudaMemcpyAsync of the same bytes,")
print("torch_op = torch.ops.moe_reroute.moe_re_routing, isel = torch.index_select (plain, graph)")
print("targets: prefill >= 0.90x the copy; decode graph replay <= 5 us at A = 256 bf16;"
      " ahead of index_select (vs_isel > 1) at both")
EOF
else
  echo "no benchmark table: see $out/gpu_bench.log"
fi

# What may fail comes last.
if ((gtest)); then
  if ((dry_run)); then
    step "GTest GPU suite"
    echo "dry run: would configure $out/build-tests with tests on, build moe_reroute_cuda_gpu_test, run it"
    [[ -n "$sanitizer" ]] && echo "dry run: then its bad-count, empty, round-trip and graph cases under compute-sanitizer"
  elif run configure-tests 90 cmake -S . -B "$out/build-tests" "${generator[@]}" \
         -DCMAKE_BUILD_TYPE=Release -DMOE_REROUTE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
         -DMOE_REROUTE_CUDA_ARCHITECTURES="$ARCHS" -DMOE_REROUTE_BUILD_TESTS=ON \
         -DMOE_REROUTE_BUILD_BENCH=OFF -DMOE_REROUTE_BUILD_EXAMPLES=OFF &&
       run build-tests 180 cmake --build "$out/build-tests" -j"$JOBS" \
         --target moe_reroute_cuda_gpu_test; then
    run gpu_test 120 "$out/build-tests/tests/cuda/moe_reroute_cuda_gpu_test"
    if [[ -n "$sanitizer" ]]; then
      run memcheck 90 "$sanitizer" --tool memcheck --error-exitcode 1 \
        "$out/build-tests/tests/cuda/moe_reroute_cuda_gpu_test" \
        --gtest_filter='*BadCounts*:*EmptyInputs*:*RoundTrip*:*Graph*' --gtest_brief=1
    fi
  fi
else
  results+=("gpu_test: skipped, GTest or CLI11 missing (the benchmark's verification stands)")
fi
# The torch operators' GPU tests (tests/python/test_cuda.py) on the staged module.
if ((staged)) && python3 -c "import pytest, ml_dtypes" 2> /dev/null; then
  if ((dry_run)); then
    step "torch GPU tests"
    echo "dry run: would run python3 -m pytest tests/python/test_cuda.py on the staged module"
  else
    run torch_gpu_test 150 python3 -m pytest tests/python/test_cuda.py -q -p no:cacheprovider
  fi
else
  results+=("torch_gpu_test: skipped, no staged torch module, pytest or ml_dtypes")
fi
finish
