#!/usr/bin/env bash
# memory_compare.sh: peak reserved and tokens/s of the pool against PyTorch's allocators, side by
# side in one run, on a GPU machine. Two workloads, each configuration once per round, the rounds
# interleaved (configuration order rotates) so that the GPU's drift is shared:
#   gpt  bench/gpu/e2e/train_seqlen.py, batch 5, 24 GiB budget (the seeds' dynamic-length case);
#   hf   tools/gpu/hf_workloads.py train (a HuggingFace Llama-style model, lengths 256..8192).
#
#   tools/gpu/memory_compare.sh --build BUILD [--rounds N] [--only REGEX] [--conf NAME=CONF]...
#
#   --build   build folder holding preload/libgpustitch.so and tools/gpustitch (e.g. .devbuild
#             from tools/gpu/pack-build.sh)
#   --rounds  rounds (default 1)
#   --only    run only the configurations whose name matches (extended regex)
#   --workloads  which workloads, comma-separated (default gpt,hf)
#   --steps   steps per run, the first --warmup untimed (default 10 for gpt, 12 for hf)
#   --warmup  untimed steps (default 2); e.g. --steps 40 --warmup 30 times the pool once it has
#             settled (its moves stop after the first steps; replay's "second half" figures)
#   --conf    add a gpustitch configuration NAME with GPUSTITCH_CONF=CONF (repeatable); without
#             any, one "gpustitch" row with the defaults. NAME=CONF|TORCH also sets
#             PYTORCH_CUDA_ALLOC_CONF=TORCH for that row (e.g. "async=|backend:cudaMallocAsync");
#             TORCH "nocache" sets PYTORCH_NO_CUDA_MEMORY_CACHING=1 instead (PyTorch's cache off)
#
# Prints one JSON line per run (the workload's own line plus "config", "workload", "round").
# At the end, README's table of them on stderr (tools/gpu/memory_table.py: ratios within each round).
# Configurations: pytorch (default caching allocator), expandable (expandable_segments:True),
# async (backend:cudaMallocAsync without gpustitch: the route `gpustitch run` gives PyTorch, so
# that a gpustitch row's speed can be told apart from that of PyTorch's backend), then the
# gpustitch rows under `gpustitch run` (PyTorch as run sets it: backend:cudaMallocAsync).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
BUILD="" ROUNDS=1 ONLY="" CONFS=() WORKLOADS="gpt hf" STEPS="" WARMUP=2
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --workloads) WORKLOADS=${2//,/ }; shift 2 ;;
    --conf) CONFS+=("$2"); shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "memory_compare: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $BUILD ]] || { echo "memory_compare: --build is required" >&2; exit 2; }
[[ $WARMUP =~ ^[0-9]+$ ]] || { echo "memory_compare: --warmup takes a step count" >&2; exit 2; }
BUILD=$(cd "$BUILD" && pwd) || exit 2
LIB=$BUILD/preload/libgpustitch.so
CLI=$BUILD/tools/gpustitch
[[ -f $LIB && -x $CLI ]] || { echo "memory_compare: no $LIB or $CLI" >&2; exit 2; }
[[ ${#CONFS[@]} -gt 0 ]] || CONFS=("gpustitch=")

NAMES=(pytorch expandable async)
for c in "${CONFS[@]}"; do NAMES+=("${c%%=*}"); done
declare -A WORKLOAD=(
  [gpt]="bench/gpu/e2e/train_seqlen.py --batch 5 --steps ${STEPS:-10} --warmup $WARMUP --budget-gb 24"
  [hf]="tools/gpu/hf_workloads.py train --steps ${STEPS:-12} --warmup $WARMUP"
)

run_one() {  # config workload round
  local name=$1 wl=$2 round=$3 conf="" torch="" line
  for c in "${CONFS[@]}"; do [[ ${c%%=*} == "$name" ]] && conf=${c#*=}; done
  if [[ $conf == *"|"* ]]; then torch=${conf#*|} conf=${conf%%|*}; fi
  local cmd="python3 ${WORKLOAD[$wl]} --config $name"
  [[ $wl == hf ]] && cmd="python3 ${WORKLOAD[$wl]}"
  case $name in
    pytorch) line=$(env -u PYTORCH_CUDA_ALLOC_CONF $cmd 2>&1) ;;
    expandable) line=$(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $cmd 2>&1) ;;
    async) line=$(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync $cmd 2>&1) ;;
    *)
      if [[ $torch == nocache ]]; then
        line=$(env -u PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING=1 GPUSTITCH_LIBRARY=$LIB GPUSTITCH_CONF=$conf "$CLI" run -- $cmd 2>&1)
      elif [[ -n $torch ]]; then
        line=$(PYTORCH_CUDA_ALLOC_CONF=$torch GPUSTITCH_LIBRARY=$LIB GPUSTITCH_CONF=$conf "$CLI" run -- $cmd 2>&1)
      else
        line=$(env -u PYTORCH_CUDA_ALLOC_CONF GPUSTITCH_LIBRARY=$LIB GPUSTITCH_CONF=$conf "$CLI" run -- $cmd 2>&1)
      fi
      ;;
  esac
  local json summary
  json=$(grep '^{' <<<"$line" | tail -1)
  summary=$(grep -o 'summary device 0:.*' <<<"$line" | tail -1)  # the shim's, at exit
  # No result: the run's last line of output says why (a traceback's last line).
  [[ -n $json ]] || json=$(python3 -c 'import json,sys; print(json.dumps({"error": "no result: " + sys.argv[1][-300:]}))' "$(tail -1 <<<"$line")")
  line=$json
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(config=sys.argv[2], workload=sys.argv[3], round=int(sys.argv[4]), gpustitch_conf=sys.argv[5], torch_conf=sys.argv[6]); d.update({"shim_summary": sys.argv[7]} if sys.argv[7] else {}); print(json.dumps(d), flush=True)' \
    "$line" "$name" "$wl" "$round" "$conf" "$torch" "$summary"
}

LINES=$(mktemp)
trap 'rm -f "$LINES"' EXIT
for ((r = 0; r < ROUNDS; ++r)); do
  for wl in $WORKLOADS; do
    n=${#NAMES[@]}
    for ((i = 0; i < n; ++i)); do
      name=${NAMES[$(((i + r) % n))]}
      [[ -z $ONLY || $name =~ $ONLY ]] || continue
      run_one "$name" "$wl" "$r" | tee -a "$LINES"
    done
  done
done
# The table of all rounds, on stderr so that stdout stays one JSON line per run.
python3 "$ROOT/tools/gpu/memory_table.py" "$LINES" >&2 || true
