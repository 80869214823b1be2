#!/usr/bin/env bash
# glibc_latency.sh: the GPU side of "the glibc compatibility layer costs the hot path nothing".
# Runs bench/gpu/alloc_latency (static and shared CUDA runtime) under LD_PRELOAD of the library as
# shipped (with the layer) and of one built without it, interleaved round by round until the time
# budget is spent, then prints the per-row medians over the rounds side by side
# (tools/gpu/latency_rounds.py).
#
#   tools/gpu/glibc_latency.sh --build .devbuild --nocompat LIB --out DIR [--budget-s 420] [--quick]
#
# LIB: a libgpustitch.so built with -DGPUSTITCH_GLIBC_COMPAT=OFF (README, "Distributions").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=build NOCOMPAT="" OUT="" BUDGET=420 QUICK=()
while (($#)); do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --nocompat) NOCOMPAT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    *) echo "glibc_latency: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $OUT && -f $NOCOMPAT ]] || { echo "usage: see the top of $0" >&2; exit 2; }
mkdir -p "$OUT"
COMPAT=$BUILD/preload/libgpustitch.so
start=$SECONDS
round=0
while ((SECONDS - start < BUDGET)); do
  round=$((round + 1))
  for link in shared static; do
    bin=$BUILD/bench/gpu/alloc_latency
    [[ $link == shared ]] && bin=${bin}_shared
    # Alternate which library goes first, so that a drift in the machine's speed falls on both.
    libs=(compat nocompat)
    ((round % 2 == 0)) && libs=(nocompat compat)
    for which in "${libs[@]}"; do
      lib=$COMPAT
      [[ $which == nocompat ]] && lib=$NOCOMPAT
      LD_PRELOAD=$lib GPUSTITCH_CONF=log_level:warn "$bin" "${QUICK[@]}" \
        --json "$OUT/$which-$link-$round.json" > "$OUT/$which-$link-$round.log" 2>&1 ||
        echo "glibc_latency: $which $link round $round failed (see its log)" >&2
    done
  done
  echo "glibc_latency: round $round done after $((SECONDS - start)) s" >&2
done
python3 "$ROOT/tools/gpu/latency_rounds.py" "$OUT"
