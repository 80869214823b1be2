#!/usr/bin/env bash
# run-suite.sh: everything gpustitch runs on the GPU machine, in one command.
#
#   tools/gpu/run-suite.sh OUTDIR [--build DIR] [--lib PATH] [--quick] [--skip-matrix]
#
# Steps (binaries run directly, paths relative to this repo's root, so the repo and its carried
# build folder may sit at any absolute path):
#   1. GPU tests: the CUDA backend's unit test, the stitched-kernel test, and every test program
#      in BUILD/tests/core run with GPUSTITCH_TEST_BACKEND=cuda (the pool suite on the real GPU);
#   2. vmm_probe (map-offset support, VMM call and stitching costs);
#   3. alloc_latency, static and shared CUDA runtime, natively and (when the shim is built)
#      under LD_PRELOAD=libgpustitch.so;
#   4. run-matrix.sh (the shim's compatibility matrix).
# OUTDIR receives few files (the device tool returns at most 8): report.md (every table and the
# verdict of each step), alloc_latency-*.json, and logs.tar.gz with each step's full output.
# About 5-8 minutes on an H200; --quick is a smoke run of a minute or two.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
OUTDIR=${1:-}
[[ -n $OUTDIR && $OUTDIR != --* ]] || { sed -n '2,17p' "$0"; exit 2; }
shift
BUILD=build
LIB=${GPUSTITCH_LIB:-}
QUICK=()
MATRIX=1
while (($#)); do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --lib) LIB=$2; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    --skip-matrix) MATRIX=0; shift ;;
    *) echo "run-suite: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $BUILD = /* ]] || BUILD=$ROOT/$BUILD
[[ -n $LIB ]] || LIB=$BUILD/preload/libgpustitch.so
[[ $LIB = /* ]] || LIB=$ROOT/$LIB
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpustitch-suite.XXXXXX")
REPORT=$OUTDIR/report.md
export PYTHONUNBUFFERED=1
START=$(date +%s)

STEPS=()
record() {  # record NAME RC LOG
  local verdict=PASS
  [[ $2 -eq 0 ]] || verdict="FAIL (exit $2)"
  [[ $2 -eq 124 || $2 -eq 137 ]] && verdict="TIMEOUT"
  STEPS+=("| $1 | $verdict | logs/$(basename "$3") |")
  echo "run-suite: $1: $verdict" >&2
}
# step NAME LOG TIMEOUT CMD...: runs CMD with output to LOG (also on our stderr's tail).
step() {
  local name=$1 log=$2 limit=$3; shift 3
  echo "run-suite: $name ..." >&2
  { echo "# $*"; } >"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  record "$name" "$rc" "$log"
  return $rc
}

{
  echo "# gpustitch GPU suite"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    2>/dev/null | head -n1)"
  echo "- build: ${BUILD#"$ROOT"/}; shim: $([[ -f $LIB ]] && echo "${LIB#"$ROOT"/}" || echo "not built")"
  echo "- commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >"$WORK/head.md"

# The shared-runtime build needs libcudart.so.13: take the toolkit's, else the one in the
# nvidia-cuda-runtime wheel PyTorch brings.
if ! ldconfig -p 2>/dev/null | grep -q 'libcudart.so.13'; then
  cudart=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib \
    $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
    -name 'libcudart.so.13*' 2>/dev/null | head -n1)
  [[ -n $cudart ]] && export LD_LIBRARY_PATH=$(dirname "$cudart")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# 1. GPU tests.
step "gpu test: cuda_backend" "$WORK/gpu_cuda_backend_test.log" 300 \
  env GPUSTITCH_TEST_BACKEND=cuda "$BUILD/tests/gpu/gpu_cuda_backend_test"
step "gpu test: stitch_kernel" "$WORK/gpu_stitch_kernel.log" 300 "$BUILD/tests/gpu/gpu_stitch_kernel"
if [[ -d $BUILD/tests/core ]]; then
  while IFS= read -r -d '' t; do
    name=$(basename "$t")
    step "pool suite on CUDA: $name" "$WORK/core_$name.log" 300 \
      env GPUSTITCH_TEST_BACKEND=cuda "$t"
  done < <(find "$BUILD/tests/core" -maxdepth 1 -type f -perm -u+x -print0 | sort -z)
fi

# 2. VMM facts.
step "vmm_probe" "$WORK/vmm_probe.log" 300 "$BUILD/tools/gpu/vmm_probe"

# 3. Allocation latency: static and shared runtime, natively and under the shim.
for link in static shared; do
  bin=$BUILD/bench/gpu/alloc_latency
  [[ $link == shared ]] && bin=${bin}_shared
  step "alloc_latency ($link cudart)" "$WORK/alloc_latency-$link.log" 300 \
    "$bin" "${QUICK[@]}" --json "$OUTDIR/alloc_latency-$link.json"
  if [[ -f $LIB ]]; then
    step "alloc_latency ($link cudart, LD_PRELOAD shim)" "$WORK/alloc_latency-$link-shim.log" 300 \
      env LD_PRELOAD="$LIB" GPUSTITCH_CONF=log_level:info \
      "$bin" "${QUICK[@]}" --json "$OUTDIR/alloc_latency-$link-shim.json"
  fi
done

# 4. Compatibility matrix.
if ((MATRIX)); then
  step "run-matrix" "$WORK/run-matrix.log" 480 "$ROOT/tools/gpu/run-matrix.sh" \
    --build "$BUILD" --lib "$LIB" --out "$WORK/matrix.md" --logs "$WORK/matrix-logs" "${QUICK[@]}"
fi

# Report: the verdicts, then each step's tables (markdown lines of its output).
{
  cat "$WORK/head.md"
  echo "- wall: $(($(date +%s) - START)) s"
  echo
  echo "| step | result | log |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${STEPS[@]}"
  for f in "$WORK"/gpu_*.log "$WORK"/core_*.log; do
    [[ -f $f ]] || continue
    echo
    echo "## $(basename "$f" .log)"
    echo
    echo '```'
    grep -aE '^(PASS|FAIL|\[  (FAILED|PASSED) |\[ +OK|device [0-9]|cuMemMap|backend|trimmed)' "$f" |
      head -n 80
    if grep -aqE '^(FAIL|\[  FAILED)|Failure$|timeout:' "$f" || ! grep -aqE '^(PASS|\[  PASSED)' "$f"; then
      echo "--- last lines ---"
      tail -n 40 "$f"
    fi
    echo '```'
  done
  for f in "$WORK"/vmm_probe.log "$WORK"/alloc_latency-*.log; do
    [[ -f $f ]] || continue
    echo
    grep -av '^  \|^alloc_latency: measuring\|^# ' "$f"
  done
  for link in static shared; do
    if [[ -f $OUTDIR/alloc_latency-$link.json && -f $OUTDIR/alloc_latency-$link-shim.json ]]; then
      echo
      python3 "$ROOT/tools/gpu/compare_latency.py" "$OUTDIR/alloc_latency-$link.json" \
        "$OUTDIR/alloc_latency-$link-shim.json"
    fi
  done
  if [[ -f $WORK/matrix.md ]]; then
    echo
    cat "$WORK/matrix.md"
  fi
} >"$REPORT"

mkdir -p "$WORK/logs"
mv "$WORK"/*.log "$WORK/logs/" 2>/dev/null
[[ -d $WORK/matrix-logs ]] && mv "$WORK/matrix-logs" "$WORK/logs/"
[[ -f $WORK/matrix.md ]] && cp "$WORK/matrix.md" "$WORK/logs/"
tar -C "$WORK" -czf "$OUTDIR/logs.tar.gz" logs
rm -rf "$WORK"
cat "$REPORT"
failed=0
for s in "${STEPS[@]}"; do [[ $s == *"| PASS |"* ]] || failed=$((failed + 1)); done
echo
echo "run-suite: ${#STEPS[@]} steps, $failed not passing, $(($(date +%s) - START)) s; report: $REPORT"
((failed == 0))
