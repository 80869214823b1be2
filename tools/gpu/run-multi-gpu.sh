#!/usr/bin/env bash
# run-multi-gpu.sh: the shim's two-GPU checks (tools/gpu/multi_gpu.py), natively and under the
# shim through `gpustitch run` (PyTorch's cache off, so every tensor is a pool allocation), with
# the shim's exit summary (log_level:info) as evidence of what the pool served on each device.
#
#   tools/gpu/run-multi-gpu.sh [BUILD (.devbuild)]
#
# CUDA IPC runs with PyTorch's cache on (--keep-framework-cache): with the cache off PyTorch itself
# cannot share a CUDA tensor ("invalid device pointer", natively too: its uncached allocations are
# not in the table its IPC path looks them up in). Twice: with the default ipc:pool (expected: a
# clear error, since pool memory cannot be exported through cudaIpcGetMemHandle) and with the
# documented workaround ipc:native.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
BUILD=${1:-.devbuild}
CLI=$BUILD/tools/gpustitch
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
fails=0
row() {  # row CHECK LABEL [EXTRA_CONF [RUN_FLAG]]
  local check=$1 label=$2 conf="log_level:info${3:+,$3}" flags=()
  [[ -n ${4:-} ]] && flags=("$4")
  local nat shim nat_sum shim_sum summary
  nat=$(timeout 300 "$PY" tools/gpu/multi_gpu.py "$check" 2>&1)
  shim=$(timeout 300 "$CLI" run "${flags[@]}" --conf "$conf" -- "$PY" tools/gpu/multi_gpu.py "$check" \
    2>&1)
  nat_sum=$(grep -m1 '^checksum:' <<<"$nat" | cut -d' ' -f2)
  shim_sum=$(grep -m1 '^checksum:' <<<"$shim" | cut -d' ' -f2)
  summary=$(grep -a 'gpustitch: summary' <<<"$shim" | sed 's/^.*summary //' | cut -c1-110 | paste -sd';' -)
  printf '| %s | %s | %s | %s | %s | %s |\n' "$check" "$label" \
    "$(grep -m1 -E '^(PASS|FAIL)' <<<"$nat" | cut -c1-120)" \
    "$(grep -m1 -E '^(PASS|FAIL)' <<<"$shim" | cut -c1-160)" \
    "$([[ -n $nat_sum && $nat_sum == "$shim_sum" ]] && echo identical || echo "$nat_sum vs $shim_sum")" \
    "${summary:-no summary}"
  grep -q '^PASS' <<<"$shim" || [[ $check == ipc && $conf != *ipc:native* ]] || fails=$((fails + 1))
}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
echo "| check | shim configuration | native | shim | results | pool-served (shim exit summary per device) |"
echo "| --- | --- | --- | --- | --- | --- |"
row pools "caching off"
row peer "caching off"
row ddp "caching off"
row ipc "PyTorch's cache on, ipc:pool (default)" "" --keep-framework-cache
row ipc "PyTorch's cache on, ipc:native" ipc:native --keep-framework-cache
echo "multi-gpu: $fails unexpected failure(s)"
exit $((fails > 0))
