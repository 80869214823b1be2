#!/usr/bin/env bash
# run_e2e.sh: the end-to-end benchmark of issue 7 (item 3, and item 2's trace replay), on the GPU.
#
#   bench/gpu/e2e/run_e2e.sh BUILD OUTDIR [--quick] [--dry-run] [--only REGEX] [--budget-gb G]
#                            [--ladder LIST] [--ladder-steps N] [--steps N] [--warmup N]
#                            [--time-budget S] [--trace FILE] [--synthetic-capacity-gb G]
#                            [--no-replay] [--no-hf] [--hf-steps N]
#
#   BUILD          build folder (relative to the repo root or absolute) holding
#                  preload/libgpustitch.so and tools/gpustitch (e.g. .devbuild from
#                  tools/gpu/pack-build.sh); shim configurations are skipped without them
#   OUTDIR         where e2e.md, e2e.json and logs/ go (created; relative to the current
#                  directory)
#   --quick        smoke run (about 100 s): no ladder, every configuration at batch 2 for a
#                  few steps, the replay only if time is left
#   --dry-run      print the plan and the commands instead of running them
#   --only REGEX   run only the configurations whose name matches (extended regex)
#   --budget-gb    device memory left to training by the balloon (default 24)
#   --ladder       ascending batch sizes tried per configuration (default 1,2,3,4,5,6,7,8,10,12,16)
#   --ladder-steps steps each rung must complete without OOM (default 12)
#   --steps        steps of the timed run at the common batch (default 16), --warmup of them
#                  untimed (default 3)
#   --time-budget  seconds the whole script may take (default 450; --quick: 160; with --no-hf
#                  330 and 100); each run gets its share of what is left, and work that no
#                  longer fits is skipped and marked so in the table
#   --trace FILE   replay this allocation trace (capacity: the budget) instead of recording one
#   --synthetic-capacity-gb G  device size for the synthetic trace replayed when no trace could
#                  be recorded (default 12)
#   --no-replay    skip the trace replay
#   --no-hf        skip the HuggingFace training phase (C)
#   --hf-steps N   steps of each HuggingFace training run (default 12; --quick: 5), the first 2
#                  untimed
#
# Phases: (A) per configuration, the batch ladder in one process (train_seqlen.py --ladder), which
# stops at the first OOM; (B) the common batch = the largest batch every configuration survived,
# and per configuration a fresh timed run there: peak allocated, peak reserved, fragmentation,
# tokens/s; (C) if transformers imports: per configuration a HuggingFace Llama-style training run,
# `tools/gpu/hf_workloads.py train --steps N --warmup 2` (batch 2, lengths 256..8192, no balloon),
# under the configuration's environment and prefix: peak allocated, peak reserved, tokens/s
# (configurations that need an option hf_workloads.py lacks, e.g. --pluggable, are skipped and
# marked so); (D) if `gpustitch replay` exists: a trace recorded from the shim run at the common
# batch (no balloon), replayed on the GPU with the budget as capacity (`gpustitch replay --gpu`):
# peak reserved and time per operation for native cudaMalloc, cudaMallocAsync and gpustitch (if
# the shim wrote no trace, the synthetic transformer trace of `replay --generate` instead);
# (E) report.py writes OUTDIR/e2e.md and OUTDIR/e2e.json.
#
# Everything is addressed relative to the repo root this script lives in, so the repo and its
# build folder can be copied to any absolute path.
set -uo pipefail

CALLER_PWD=$PWD
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT" || exit 2

usage() { sed -n '2,48p' "$0"; }
POS=()
QUICK=0
DRY=0
ONLY=""
BUDGET_GB=24
LADDER=1,2,3,4,5,6,7,8,10,12,16
LADDER_STEPS=12
STEPS=16
WARMUP=3
TIME_BUDGET=""
TRACE=""
REPLAY=1
HF=1
HF_STEPS=""
HF_WARMUP=2
SYNTH_CAP_GB=12
PY=${PYTHON:-python3}
while (($#)); do
  case $1 in
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --only) ONLY=$2; shift 2 ;;
    --budget-gb) BUDGET_GB=$2; shift 2 ;;
    --ladder) LADDER=$2; shift 2 ;;
    --ladder-steps) LADDER_STEPS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --time-budget) TIME_BUDGET=$2; shift 2 ;;
    --trace) TRACE=$2; shift 2 ;;
    --no-replay) REPLAY=0; shift ;;
    --no-hf) HF=0; shift ;;
    --hf-steps) HF_STEPS=$2; shift 2 ;;
    --synthetic-capacity-gb) SYNTH_CAP_GB=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run_e2e: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) POS+=("$1"); shift ;;
  esac
done
if ((${#POS[@]} != 2)); then usage >&2; exit 2; fi
BUILD=${POS[0]}
OUTDIR=${POS[1]}
[[ $BUILD = /* ]] || BUILD=$ROOT/$BUILD
[[ $OUTDIR = /* ]] || OUTDIR=$CALLER_PWD/$OUTDIR
if ((QUICK)); then
  STEPS=5; WARMUP=2
  [[ -n $HF_STEPS ]] || HF_STEPS=5
  [[ -n $TIME_BUDGET ]] || TIME_BUDGET=$( ((HF)) && echo 160 || echo 100)
fi
[[ -n $HF_STEPS ]] || HF_STEPS=12
[[ -n $TIME_BUDGET ]] || TIME_BUDGET=$( ((HF)) && echo 450 || echo 330)
if ! [[ $HF_STEPS =~ ^[0-9]+$ ]] || ((HF_STEPS <= HF_WARMUP)); then
  echo "run_e2e: --hf-steps must be a number above $HF_WARMUP (the untimed warm-up steps)" >&2
  exit 2
fi
[[ -n $TRACE && $TRACE != /* ]] && TRACE=$CALLER_PWD/$TRACE

LIB=$BUILD/preload/libgpustitch.so
GS=$BUILD/tools/gpustitch
TRAIN=$HERE/train_seqlen.py
HFW=$ROOT/tools/gpu/hf_workloads.py
LOGS=$OUTDIR/logs
SHIM_CONF=log_level:info
HAVE_SHIM=0
[[ -f $LIB && -x $GS ]] && HAVE_SHIM=1

# ---- configurations: NAME|ENV (space-separated K=V)|PREFIX (command words before python)|ARGS --
CONFIGS=(
  "pytorch-default|||"
  "expandable-segments|PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True||"
  "max-split-128mb|PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128||"
  "cudaMallocAsync|PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync||"
  "gpustitch+pytorch-cache|GPUSTITCH_CONF=$SHIM_CONF GPUSTITCH_LIBRARY=$LIB|$GS run --keep-framework-cache --|"
  "gpustitch|GPUSTITCH_CONF=$SHIM_CONF GPUSTITCH_LIBRARY=$LIB|$GS run --|"
  "gpustitch-pluggable|GPUSTITCH_CONF=$SHIM_CONF GPUSTITCH_LIB=$LIB||--pluggable"
)
SELECTED=()
for c in "${CONFIGS[@]}"; do
  name=${c%%|*}
  if [[ -n $ONLY ]] && ! [[ $name =~ $ONLY ]]; then continue; fi
  SELECTED+=("$c")
done
if ((${#SELECTED[@]} == 0)); then echo "run_e2e: no configuration matches '$ONLY'" >&2; exit 2; fi
NCONF=${#SELECTED[@]}

is_shim() { [[ $1 == gpustitch* ]]; }

# ---- time keeping: phase ends as fractions of the budget; each run gets a fair share ---------
# With the HF phase the default budget is larger (450 s, quick 160 s) and the fractions are such
# that the GPT phases keep about the seconds they have without it (330 s: 55% / 88%).
T0=$SECONDS
PCT_A=55 PCT_B=88 PCT_H=88
((QUICK)) && PCT_A=0 PCT_B=80 PCT_H=80
if ((HF)); then
  PCT_A=40 PCT_B=64 PCT_H=91
  ((QUICK)) && PCT_A=0 PCT_B=50 PCT_H=88
fi
END_A=$((T0 + TIME_BUDGET * PCT_A / 100))
END_B=$((T0 + TIME_BUDGET * PCT_B / 100))
END_H=$((T0 + TIME_BUDGET * PCT_H / 100))
END_C=$((T0 + TIME_BUDGET - 8))
MIN_RUN=12   # seconds: less than this cannot start python + torch + CUDA and do a few steps
((QUICK)) && MIN_RUN=10
share() {    # share PHASE_END RUNS_LEFT: seconds for the next run (0: no time)
  local left=$(($1 - SECONDS))
  local s=$((left / $2))
  ((s < MIN_RUN)) && s=$MIN_RUN
  ((left >= MIN_RUN)) && echo "$s" || echo 0
}

STATUS=$LOGS/status.tsv   # config phase status seconds: read by report.py
if ((!DRY)); then
  mkdir -p "$LOGS"
  : >"$STATUS"
fi
log() { echo "run_e2e [$((SECONDS - T0))s]: $*" >&2; }

# split_cfg CONFIG: sets NAME and the arrays ENV_A, PRE_A, EXTRA_A from a CONFIGS entry.
split_cfg() {
  local rest envs prefix extra
  NAME=${1%%|*}; rest=${1#*|}
  envs=${rest%%|*}; rest=${rest#*|}
  prefix=${rest%%|*}; extra=${rest#*|}
  ENV_A=() PRE_A=() EXTRA_A=()
  read -r -a ENV_A <<<"$envs"
  read -r -a PRE_A <<<"$prefix"
  read -r -a EXTRA_A <<<"$extra"
}

# run_cfg CONFIG PHASE SECONDS ARGS...: runs train_seqlen.py in a configuration with a timeout.
run_cfg() {
  local c=$1 phase=$2 secs=$3; shift 3
  split_cfg "$c"
  local cmd=(env PYTHONUNBUFFERED=1 "${ENV_A[@]}" timeout -k 5 "$secs" "${PRE_A[@]}" "$PY" "$TRAIN"
             --config "$NAME" "${EXTRA_A[@]}" "$@" --time-limit $((secs > 6 ? secs - 3 : 3)))
  run_cmd "$NAME" "$phase" "$secs" "${cmd[@]}"
}

# run_hf CONFIG SECONDS: runs hf_workloads.py train in a configuration with a timeout (it has no
# time limit of its own; the configuration's extra arguments are for train_seqlen.py and are
# checked against hf_workloads.py before this is called).
run_hf() {
  local c=$1 secs=$2
  split_cfg "$c"
  local cmd=(env PYTHONUNBUFFERED=1 "${ENV_A[@]}" timeout -k 5 "$secs" "${PRE_A[@]}" "$PY" "$HFW"
             train --steps "$HF_STEPS" --warmup "$HF_WARMUP")
  run_cmd "$NAME" hf "$secs" "${cmd[@]}"
}

# run_cmd NAME PHASE SECONDS COMMAND...: runs (or, --dry-run, prints) one command, output in
# logs/NAME.PHASE.out and .err, and appends its row to status.tsv.
run_cmd() {
  local name=$1 phase=$2 secs=$3; shift 3
  local cmd=("$@")
  local base=$LOGS/$name.$phase
  if ((DRY)); then
    printf '%q ' "${cmd[@]}"; echo
    return 0
  fi
  if is_shim "$name" && ((!HAVE_SHIM)); then
    printf '%s\t%s\tskipped: no %s\t0\n' "$name" "$phase" "${LIB#"$ROOT"/}" >>"$STATUS"
    return 0
  fi
  if ((secs == 0)); then
    printf '%s\t%s\tskipped: time budget spent\t0\n' "$name" "$phase" >>"$STATUS"
    log "$name $phase: skipped (time budget spent)"
    return 0
  fi
  log "$name $phase (timeout ${secs}s)"
  local t=$SECONDS sampler=""
  { printf '# command:'; printf ' %q' "${cmd[@]}"; echo; } >"$base.out"
  # The device memory in use while the timed and HF runs go, as nvidia-smi shows it: every byte
  # the process holds, whoever allocated it (cuBLAS's workspaces, which only the pool counts, the
  # CUDA context), so that configurations compare on what an SRE sees. Device-wide, sampled every
  # 50 ms; the first line is the figure before the run.
  if [[ $phase == timed || $phase == hf ]] && command -v "$NVSMI" >/dev/null; then
    { printf 'idle '; nvsmi_used; } >"$base.nvml"
    "$NVSMI" --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 50 \
      >>"$base.nvml" 2>/dev/null &
    sampler=$!
  fi
  "${cmd[@]}" >>"$base.out" 2>"$base.err"
  local rc=$? st
  if [[ -n $sampler ]]; then
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
  fi
  case $rc in
    0) st=ok ;;
    124|137) st=timeout ;;
    *) st="exit $rc" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$phase" "$st" $((SECONDS - t)) >>"$STATUS"
  log "$name $phase: $st in $((SECONDS - t))s: $("$PY" "$HERE/report.py" brief "$base.out")"
}

NVSMI=${NVIDIA_SMI:-nvidia-smi}
nvsmi_used() { "$NVSMI" --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -n1; }

# ---- meta ---------------------------------------------------------------------------------------
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
      head -n1)
CMDLINE="bench/gpu/e2e/run_e2e.sh ${BUILD#"$ROOT"/} OUTDIR"
((QUICK)) && CMDLINE+=" --quick"
[[ -n $ONLY ]] && CMDLINE+=" --only '$ONLY'"
CMDLINE+=" --budget-gb $BUDGET_GB --ladder $LADDER --ladder-steps $LADDER_STEPS --steps $STEPS"
CMDLINE+=" --warmup $WARMUP --time-budget $TIME_BUDGET"
((HF)) && CMDLINE+=" --hf-steps $HF_STEPS" || CMDLINE+=" --no-hf"
((REPLAY)) || CMDLINE+=" --no-replay"
if ((DRY)); then
  echo "# plan: $NCONF configurations, time budget ${TIME_BUDGET}s," \
       "shim: $([[ $HAVE_SHIM == 1 ]] && echo "${LIB#"$ROOT"/}" || echo "not found (skipped)")"
  echo "# phase A (ladder) until ${TIME_BUDGET}*${PCT_A}%," \
       "phase B (common batch) until ${PCT_B}%," \
       "$( ((HF)) && echo "phase C (HF training) until ${PCT_H}%," || echo "phase C (HF) skipped,")" \
       "phase D (replay) until the end"
fi
NAMES=()
for c in "${SELECTED[@]}"; do NAMES+=("${c%%|*}"); done
if ((!DRY)); then
  "$PY" - "$OUTDIR/meta.json" "$GPU" "$CMDLINE" "$BUDGET_GB" "$LADDER" "$LADDER_STEPS" "$STEPS" \
    "$WARMUP" "$QUICK" "${LIB#"$ROOT"/}" "$HAVE_SHIM" "$HF" "$HF_STEPS" "$HF_WARMUP" \
    "${NAMES[@]}" <<'EOF'
import datetime, json, platform, sys
(out, gpu, cmd, budget, ladder, lsteps, steps, warmup, quick, lib, have_shim, hf, hf_steps,
 hf_warmup), names = sys.argv[1:15], sys.argv[15:]
json.dump({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "gpu": gpu, "host": platform.node(), "command": cmd, "budget_gb": float(budget),
           "ladder": ladder, "ladder_steps": int(lsteps), "steps": int(steps),
           "warmup": int(warmup), "quick": quick == "1", "shim_library": lib,
           "have_shim": have_shim == "1", "hf": hf == "1", "hf_steps": int(hf_steps),
           "hf_warmup": int(hf_warmup), "configs": names}, open(out, "w"), indent=1)
EOF
  # Warm the file cache and the driver once, so the first configuration does not pay for it.
  log "warming up: import torch, CUDA init"
  timeout -k 5 $((TIME_BUDGET / 5)) "$PY" -c 'import torch; torch.cuda.init(); print(torch.__version__, torch.cuda.get_device_name(0))' \
    >"$LOGS/warmup.out" 2>&1 || log "warm-up failed: $(tail -n1 "$LOGS/warmup.out")"
fi

# ---- phase A: ladders ---------------------------------------------------------------------------
if ((!QUICK)); then
  i=0
  for c in "${SELECTED[@]}"; do
    secs=$(share "$END_A" $((NCONF - i)))
    ((DRY)) && secs=60
    run_cfg "$c" ladder "$secs" --ladder "$LADDER" --steps "$LADDER_STEPS" --warmup 2 \
      --budget-gb "$BUDGET_GB"
    i=$((i + 1))
  done
fi

# ---- phase B: the common batch ------------------------------------------------------------------
if ((QUICK)); then
  COMMON=2
elif ((DRY)); then
  COMMON='<common>'
else
  COMMON=$("$PY" "$HERE/report.py" common "$OUTDIR")
fi
((DRY)) || echo "$COMMON" >"$LOGS/common_batch"
if [[ $COMMON == 0 ]]; then
  log "no batch survived by every configuration: no timed runs"
else
  ((DRY)) && echo "# common batch: the largest batch every configuration survived in phase A"
  i=0
  for c in "${SELECTED[@]}"; do
    secs=$(share "$END_B" $((NCONF - i)))
    ((DRY)) && secs=40
    run_cfg "$c" timed "$secs" --batch "$COMMON" --steps "$STEPS" --warmup "$WARMUP" \
      --budget-gb "$BUDGET_GB"
    i=$((i + 1))
  done
fi

# ---- phase C: HuggingFace Llama training --------------------------------------------------------
# hf_supports CONFIG: true if hf_workloads.py accepts every extra option of the configuration
# (the options train_seqlen.py takes, e.g. --pluggable); its --help runs before torch is imported.
HF_HELP=""
hf_supports() {
  split_cfg "$1"
  local o
  for o in "${EXTRA_A[@]}"; do
    [[ $o == --* ]] || continue
    [[ -n $HF_HELP ]] || HF_HELP=$("$PY" "$HFW" --help 2>&1)
    [[ $HF_HELP == *"$o"* ]] || { HF_MISSING=$o; return 1; }
  done
  return 0
}
HF_STATUS="not run"
if ((!HF)); then
  HF_STATUS="skipped (--no-hf)"
elif [[ ! -f $HFW ]]; then
  HF_STATUS="skipped: no ${HFW#"$ROOT"/}"
else
  HF_OK=1
  if ((!DRY)); then
    # Once: is transformers there? (Also warms the file cache for the first configuration.)
    secs=$(share "$END_H" $((NCONF + 1)))
    if ((secs == 0)); then
      HF_OK=0; HF_STATUS="skipped: time budget spent"
    elif ! timeout -k 5 "$secs" "$PY" -c 'import transformers; print(transformers.__version__)' \
           >"$LOGS/hf-check.out" 2>&1; then
      HF_OK=0
      why=$(tail -n1 "$LOGS/hf-check.out" | cut -c1-160)
      HF_STATUS="skipped: transformers does not import ($why)"
    else
      HF_STATUS="transformers $(tail -n1 "$LOGS/hf-check.out" | cut -c1-40)"
    fi
    ((HF_OK)) || log "HF training: $HF_STATUS"
  else
    echo "# phase C: HF Llama training, $HF_STEPS steps (the first $HF_WARMUP untimed), no balloon"
    HF_STATUS="dry run"
  fi
  if ((HF_OK)); then
    HF_RUN=()
    for c in "${SELECTED[@]}"; do
      if ! hf_supports "$c"; then
        what="skipped: ${HFW##*/} has no $HF_MISSING"
        if ((DRY)); then echo "# $NAME: $what"
        else printf '%s\thf\t%s\t0\n' "$NAME" "$what" >>"$STATUS"; fi
      else
        HF_RUN+=("$c")
      fi
    done
    i=0
    for c in "${HF_RUN[@]}"; do
      secs=$(share "$END_H" $((${#HF_RUN[@]} - i)))
      ((DRY)) && secs=60
      run_hf "$c" "$secs"
      i=$((i + 1))
    done
  fi
fi
((DRY)) || echo "$HF_STATUS" >"$LOGS/hf_status"

# ---- phase D: trace replay on the GPU ------------------------------------------------------------
REPLAY_STATUS="not run"
if ((!REPLAY)); then
  REPLAY_STATUS="skipped (--no-replay)"
elif ((!HAVE_SHIM)) && ((!DRY)); then
  REPLAY_STATUS="skipped: no ${LIB#"$ROOT"/}"
elif ! ((DRY)) && [[ $("$GS" replay --help 2>&1) != *--capacity-gb* ]]; then
  REPLAY_STATUS="skipped: this gpustitch has no replay command"
else
  REC=$TRACE
  CAP=$BUDGET_GB
  if [[ -z $REC && $COMMON != 0 ]]; then
    REC=$OUTDIR/train-trace.csv
    secs=$(share "$END_C" 2)
    ((DRY)) && secs=40
    # No balloon: the trace is the program's demand; the replay applies the budget as capacity.
    rec_cmd=(env PYTHONUNBUFFERED=1 GPUSTITCH_CONF="$SHIM_CONF,trace:$REC" GPUSTITCH_LIBRARY="$LIB"
             timeout -k 5 "$secs" "$GS" run -- "$PY" "$TRAIN" --config trace-record
             --batch "$COMMON" --steps 4 --warmup 1 --budget-gb 0)
    if ((DRY)); then
      printf '%q ' "${rec_cmd[@]}"; echo
    elif ((secs > 0)); then
      log "recording a trace at batch $COMMON (timeout ${secs}s)"
      rm -f "$REC"
      "${rec_cmd[@]}" >"$LOGS/trace-record.out" 2>"$LOGS/trace-record.err"
    fi
  fi
  lines=0
  [[ -n $REC && -f $REC ]] && lines=$(wc -l <"$REC")
  if ((lines > 1)); then
    rp_cmd=("$GS" replay --json --gpu --capacity-gb "$CAP" "$REC")
    what="trace ${REC#"$OUTDIR"/} ($lines lines)"
  else
    # No recorded trace (this build has no trace writer, or no time): the synthetic transformer
    # trace of `gpustitch replay --generate`, on the device size its documentation uses.
    CAP=$SYNTH_CAP_GB
    rp_cmd=("$GS" replay --json --gpu --capacity-gb "$CAP" --generate "$OUTDIR/synthetic-trace.csv")
    what="synthetic trace (--generate; no recorded trace: see logs/trace-record.err)"
    [[ -n $TRACE ]] && what="synthetic trace (--generate; $TRACE is empty or missing)"
  fi
  secs=$(share "$END_C" 1)
  ((DRY)) && secs=60
  if ((DRY)); then
    echo "# replay: the recorded trace if it holds events, else:"
    printf '%q ' timeout -k 5 "$secs" "$GS" replay --json --gpu --capacity-gb "$SYNTH_CAP_GB" \
      --generate "$OUTDIR/synthetic-trace.csv"; echo
    REPLAY_STATUS="dry run"
  elif ((secs == 0)); then
    REPLAY_STATUS="skipped: time budget spent"
  else
    log "replaying the $what on the GPU, capacity $CAP GiB (timeout ${secs}s)"
    t=$SECONDS
    timeout -k 5 "$secs" "${rp_cmd[@]}" >"$OUTDIR/replay.json" 2>"$LOGS/replay.err"
    rc=$?
    REPLAY_STATUS="exit $rc after $((SECONDS - t))s"
    ((rc == 0)) && REPLAY_STATUS="$((SECONDS - t))s"
    REPLAY_STATUS+=", $what, capacity $CAP GiB"
  fi
  # Keep the traces (to replay elsewhere: `gpustitch replay FILE`), compressed.
  for f in "$OUTDIR/train-trace.csv" "$OUTDIR/synthetic-trace.csv"; do
    [[ -f $f ]] && ! ((DRY)) && gzip -f "$f" 2>/dev/null
  done
fi
((DRY)) || echo "$REPLAY_STATUS" >"$LOGS/replay_status"

# ---- phase E: report ------------------------------------------------------------------------------
if ((DRY)); then
  echo "$PY $HERE/report.py write $OUTDIR"
  exit 0
fi
log "total $((SECONDS - T0))s"
"$PY" "$HERE/report.py" write "$OUTDIR"
