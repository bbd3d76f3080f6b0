#!/usr/bin/env bash
# The GPU check, in one call meant to end within 8 minutes on an H100 or H200
# with 16 cores, needing only the CUDA toolkit, CMake and a C++ compiler (the
# torch steps also torch, nanobind, pytest and ml_dtypes, when there):
#
#   preflight      the GPU, the driver and runtime versions, what is installed
#   configure      the core, the CUDA backend, the GPU programs (no GTest, no CLI11)
#   build          bench/gpu_correctness.cu and bench/gpu_bench.cu
#   build_torch    the torch operators, in the background (optional)
#   build_ptx80    the correctness program from compute_80 PTX only, in the background (optional)
#   correctness    every group of bench/gpu_correctness.cu, against the naive reference
#   memcheck       compute-sanitizer memcheck on a reduced list of groups
#   synccheck      compute-sanitizer synccheck on a reduced list of groups
#   gpu_bench      timings beside a device copy in the same process
#   torch_gpu_test tests/python/test_cuda.py on the torch operators of this build
#   torch_peers    the torch operator against index_select
#   pdl_ptx80      the two-kernel path from compute_80 PTX JIT-compiled here: no PDL, right rows
#
# Every step runs under `timeout`, its output kept in OUT_DIR/STEP.log; a step
# that fails never stops a later one (one that needs what failed is skipped).
# One summary table at the end; the exit status is 1 when a step failed.
#
# Usage: bench/gpu_check.sh [--dry-run] OUT_DIR   (flags in any position)
#   --dry-run  configure and build, then print the plan of every step,
#              launching nothing: runs without a GPU (ctest gpu_check_dry_run).
# Environment: BUILD (default OUT_DIR/build), JOBS (default nproc), ARCHS
# (default 90), REPS (default 30), BUDGET (seconds, default 470).
set -uo pipefail
usage() {
  echo "usage: bench/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
}
dry_run=0
positional=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h | --help) usage ;;
    -*) echo "gpu_check.sh: unknown flag $arg" >&2 && usage ;;
    *) positional+=("$arg") ;;
  esac
done
((${#positional[@]} == 1)) || usage
cd "$(dirname "$0")/.."
out=$(mkdir -p "${positional[0]}" && cd "${positional[0]}" && pwd)
BUILD=${BUILD:-$out/build}
JOBS=${JOBS:-$(nproc)}
ARCHS=${ARCHS:-90}
REPS=${REPS:-30}
deadline=$((SECONDS + ${BUDGET:-470}))
exec > >(tee "$out/gpu_check.log") 2>&1

# One row per step: name, result, seconds.
rows=()
record() { rows+=("$(printf '%-15s %-34s %5ss' "$1" "$2" "$3")"); }
limit_for() {  # a step's limit, cut to what is left of the budget
  local left=$((deadline - SECONDS))
  echo $(($1 < left ? $1 : left))
}
verdict() {  # the result of exit status $1 under limit $2
  case "$1" in
    0) echo ok ;;
    124) echo "TIMED OUT after ${2}s" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}
# run NAME SECONDS CMD...: in the foreground, output to the screen and NAME.log.
run() {
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  printf '\n== %s (at %ds, limit %ds)\n' "$name" "$SECONDS" "$limit"
  if ((limit < 5)); then
    record "$name" "skipped: out of time" 0
    return 1
  fi
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  record "$name" "$(verdict "$rc" "$limit")" $((SECONDS - start))
  return "$rc"
}
# background NAME SECONDS CMD...: started now into NAME.log; finish_background
# NAME waits for it and records it.
declare -A bg_pid bg_start bg_limit
background() {
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  printf '\n== %s: in the background into %s (limit %ds)\n' "$name" "$out/$name.log" "$limit"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 &
  bg_pid[$name]=$!
  bg_start[$name]=$SECONDS
  bg_limit[$name]=$limit
}
finish_background() {
  local name=$1
  [[ -n "${bg_pid[$name]:-}" ]] || return 1
  wait "${bg_pid[$name]}"
  local rc=$?
  record "$name" "$(verdict "$rc" "${bg_limit[$name]}")" $((SECONDS - bg_start[$name]))
  ((rc != 0)) && tail -20 "$out/$name.log"
  return "$rc"
}
skip() { record "$1" "skipped: $2" 0; }
plan() {
  printf '\n== %s (dry run)\n%s\n' "$1" "$2"
  record "$1" "planned" 0
}
have() { command -v "$1" > /dev/null 2>&1; }

printf '\n== preflight\n'
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
python=$(command -v python3 || true)
gpu=0 torch=0 nanobind=0 pytest=0 generator=()
if have nvidia-smi && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap \
  --format=csv,noheader; then
  gpu=1
  nvidia-smi | sed -n 's/.*\(CUDA Version: [0-9.]*\).*/driver supports \1/p'
fi
[[ -n "$python" ]] && "$python" -c "import torch" 2> /dev/null && torch=1
[[ -n "$python" ]] && "$python" -c "import nanobind" 2> /dev/null && nanobind=1
[[ -n "$python" ]] && "$python" -c "import pytest, ml_dtypes" 2> /dev/null && pytest=1
have ninja && generator=(-G Ninja)
printf '%-18s %s\n' gpu "$( ((gpu)) && echo yes || echo "NONE: nothing can run")" \
  nvcc "$("$nvcc" --version 2> /dev/null | tail -1 || echo missing)" \
  cmake "$(cmake --version 2> /dev/null | head -1 || echo missing)" \
  python3 "${python:-missing}" \
  torch "$( ((torch)) && "$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available:", torch.cuda.is_available())' || echo "no: torch steps skipped")" \
  nanobind "$( ((nanobind)) && echo yes || echo "no: torch operators not built")" \
  "pytest+ml_dtypes" "$( ((pytest)) && echo yes || echo "no: torch GPU tests skipped")" \
  compute-sanitizer "${sanitizer:-no: memcheck and synccheck skipped}"
if ((gpu || dry_run)); then
  record preflight "ok$( ((gpu)) || echo ", no GPU (dry run)")" 0
else
  record preflight "FAILED: no GPU" 0
fi

# The torch operators build in the same tree when torch and nanobind are in
# python3 (CMake's Python pinned to it); a configure that fails with them is
# retried without.
common=(-DCMAKE_BUILD_TYPE=Release -DMOE_REROUTE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc"
  -DMOE_REROUTE_BUILD_TESTS=OFF -DMOE_REROUTE_BUILD_TOOLS=OFF -DMOE_REROUTE_BUILD_BENCH=OFF
  -DMOE_REROUTE_BUILD_EXAMPLES=OFF -DMOE_REROUTE_INSTALL=OFF -DMOE_REROUTE_BUILD_GPU_BENCH=ON)
python_flags=()
((torch && nanobind)) && python_flags=(-DMOE_REROUTE_BUILD_PYTHON=ON
  -DMOE_REROUTE_CUDA_STATIC_RUNTIME=ON -DPython_EXECUTABLE="$python")
configure=(cmake -S . -B "$BUILD" "${generator[@]}" "${common[@]}"
  -DMOE_REROUTE_CUDA_ARCHITECTURES="$ARCHS")
built=0
if run configure 120 "${configure[@]}" "${python_flags[@]}" ||
  { ((${#python_flags[@]})) && python_flags=() &&
    run configure_without_torch 120 "${configure[@]}" -DMOE_REROUTE_BUILD_PYTHON=OFF; }; then
  # A dry run (CI, two busy cores) may take longer than a GPU machine's 16 cores.
  run build $((dry_run ? 600 : 240)) cmake --build "$BUILD" -j"$JOBS" --target moe_reroute_gpu_correctness \
    moe_reroute_gpu_bench && built=1
else
  skip build "configure failed"
fi
correctness="$BUILD/bench/moe_reroute_gpu_correctness"

# Both background builds use the CPUs while the GPU checks run; the timings
# wait for them. A dry run plans them.
ptx80="$out/build-ptx80"
if ((dry_run)); then
  plan build_torch "cmake --build $BUILD --target _core _torch_ops$( ((${#python_flags[@]})) || echo ": skipped, no torch or nanobind")"
  plan build_ptx80 "configure $ptx80 with MOE_REROUTE_CUDA_ARCHITECTURES=80-virtual, build moe_reroute_gpu_correctness"
elif ((built && ${#python_flags[@]})); then
  background build_torch 300 cmake --build "$BUILD" -j"$JOBS" --target _core _torch_ops
else
  skip build_torch "$( ((built)) && echo "no torch or nanobind" || echo "build failed")"
fi
if ((!dry_run && built)) && [[ "$ARCHS" == 90* ]]; then
  background build_ptx80 300 bash -c "cmake -S . -B '$ptx80' ${generator[*]} ${common[*]} \
    -DMOE_REROUTE_CUDA_ARCHITECTURES=80-virtual && \
    cmake --build '$ptx80' -j$JOBS --target moe_reroute_gpu_correctness"
elif ((!dry_run)); then
  skip build_ptx80 "$( ((built)) && echo "ARCHS is not sm_90" || echo "build failed")"
fi

# The sanitizers' reduced list: small cases of every kind of access (one
# rank and one expert, both paths of the inverse, bad counts on both paths,
# the routing operators' kernels on bad and then good values) for memcheck;
# both launch paths and their barriers for synccheck.
memcheck_groups=(edges inverse bad_counts init_bad_ids finalize_bad_rows)
synccheck_groups=(blocks alignment)
if ((dry_run)); then
  plan correctness "$correctness, every group (--list):"
  "$correctness" --list
  plan memcheck "${sanitizer:-compute-sanitizer} --tool memcheck $correctness ${memcheck_groups[*]}"
  plan synccheck "${sanitizer:-compute-sanitizer} --tool synccheck $correctness ${synccheck_groups[*]}"
  plan gpu_bench "$BUILD/bench/moe_reroute_gpu_bench --reps $REPS, its shapes:"
  "$BUILD/bench/moe_reroute_gpu_bench" --dry-run
  plan torch_gpu_test "python3 -m pytest tests/python/test_cuda.py on the staged torch operators"
  plan torch_peers "python3 bench/gpu_torch_peers.py --reps $REPS"
  plan pdl_ptx80 "$ptx80/bench/moe_reroute_gpu_correctness blocks capture bad_counts: the two-kernel path without PDL (compute_80 code has no wait)"
elif ((gpu && built)); then
  run correctness 120 "$correctness"
  if [[ -n "$sanitizer" ]]; then
    run memcheck 60 "$sanitizer" --tool memcheck --error-exitcode 1 "$correctness" \
      "${memcheck_groups[@]}"
    run synccheck 60 "$sanitizer" --tool synccheck --error-exitcode 1 "$correctness" \
      "${synccheck_groups[@]}"
  else
    skip memcheck "no compute-sanitizer"
    skip synccheck "no compute-sanitizer"
  fi
else
  skip correctness "no GPU or no build"
fi

staged=0
if finish_background build_torch; then
  staged=1
  rm -rf "$out/python" && mkdir -p "$out/python" && cp -r python/moe_reroute "$out/python/"
  cp "$BUILD"/python/_core*.so "$BUILD"/python/_torch_ops.so "$out/python/moe_reroute/"
  export PYTHONPATH="$out/python${PYTHONPATH:+:$PYTHONPATH}"
fi
dry=()
((dry_run)) && dry=(--dry-run)
if ((!dry_run && gpu && built)); then
  run gpu_bench 180 "$BUILD/bench/moe_reroute_gpu_bench" --reps "$REPS" --tsv "$out/gpu_bench.tsv"
elif ((!dry_run)); then
  skip gpu_bench "no GPU or no build"
fi
if ((!dry_run && staged && pytest && gpu)); then
  run torch_gpu_test 120 "$python" -m pytest tests/python/test_cuda.py -q -p no:cacheprovider
elif ((!dry_run)); then
  skip torch_gpu_test "no GPU, staged torch operators, pytest or ml_dtypes"
fi
if ((!dry_run && torch && gpu)); then
  run torch_peers 120 "$python" bench/gpu_torch_peers.py --reps "$REPS" --tsv "$out/torch_peers.tsv"
elif ((!dry_run)); then
  skip torch_peers "no GPU or torch"
fi
if finish_background build_ptx80 && ((!dry_run && gpu)); then
  run pdl_ptx80 60 "$ptx80/bench/moe_reroute_gpu_correctness" blocks capture bad_counts
elif ((!dry_run)); then
  skip pdl_ptx80 "no GPU or no compute_80 build"
fi

if ((dry_run)); then
  plan table "the timings of $out/gpu_bench.tsv beside $out/torch_peers.tsv"
elif [[ -s "$out/gpu_bench.tsv" ]]; then
  printf '\n== table\n'
  "$python" - "$out/gpu_bench.tsv" "$out/torch_peers.tsv" << 'EOF' | tee "$out/table.txt"
import csv, math, sys
ours = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
try:
    peers = {(r["shape"], r["A"], r["dtype"]): r
             for r in csv.DictReader(open(sys.argv[2]), delimiter="\t")}
except OSError:
    peers = {}
f = lambda v: float(v) if v not in ("", "nan") else math.nan
print(f"{'shape':<9} {'A':>7} {'dtype':<12} {'k':>4} {'valid':>7} {'op_us':>8} {'graph_us':>8} "
      f"{'copy_us':>8} {'vs_copy':>7} {'torch_op':>8} {'isel_us':>8} {'isel_gr':>8} "
      f"{'vs_isel':>7} ok")
for r in ours:
    op, graph, copy = f(r["op_us"]), f(r["graph_us"]), f(r["copy_us"])
    p = peers.get((r["shape"], r["A"], r["dtype"])) if r["k"] == "1" and r["valid"] == r["A"] else None
    torch_op = f(p["ours_us"]) if p else math.nan
    isel, isel_graph = (f(p["isel_us"]), f(p["isel_graph_us"])) if p else (math.nan, math.nan)
    print(f"{r['shape']:<9} {r['A']:>7} {r['dtype']:<12} {r['k']:>4} {r['valid']:>7} {op:>8.2f} "
          f"{graph:>8.2f} {copy:>8.2f} {copy / op:>7.3f} {torch_op:>8.2f} {isel:>8.2f} "
          f"{isel_graph:>8.2f} {isel / op:>7.3f} {r['verified']}")
print("op = plain launch, graph = CUDA graph replay, copy = cudaMemcpyAsync of the same bytes,")
print("torch_op = torch.ops.moe_reroute.moe_re_routing, isel = torch.index_select (plain, graph);")
print("oneN / twoN: decode at N x E = N blocks in one launch / two kernels")
print("targets: prefill >= 0.90x the copy; decode graph replay <= 5 us at A = 256 bf16;"
      " ahead of index_select (vs_isel > 1) at both")
EOF
fi

printf '\n== summary%s\n' "$( ((dry_run)) && echo ", dry run")"
failed=0
for row in "${rows[@]}"; do
  echo "  $row"
  [[ "$row" == *FAILED* || "$row" == *"TIMED OUT"* ]] && failed=1
done
echo "everything is in $out"
exit "$failed"
