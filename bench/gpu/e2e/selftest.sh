#!/usr/bin/env bash
# selftest.sh: runs run_e2e.sh end to end without a GPU, against stand-ins, to check the plumbing:
# argument handling, time shares, the common batch, the status of each run, the trace replay
# phase, and that report.py writes e2e.md / e2e.json with the expected rows and target results.
#
#   bench/gpu/e2e/selftest.sh
#
# Stand-ins (in a temporary directory): a "python" that answers train_seqlen.py with made-up
# results (each configuration OOMs at its own batch; the shim's pluggable run crashes on purpose)
# and passes everything else to python3; a build folder whose tools/gpustitch implements
# `run [--keep-framework-cache] -- CMD` (exec) and `replay --json` (a fixed JSON answer).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TMP=$(mktemp -d)
trap '[[ -n ${KEEP:-} ]] || rm -rf "$TMP"' EXIT
mkdir -p "$TMP/build/preload" "$TMP/build/tools" "$TMP/bin"
: >"$TMP/build/preload/libgpustitch.so"

cat >"$TMP/build/tools/gpustitch" <<'EOF'
#!/usr/bin/env bash
case $1 in
  run) shift; [[ $1 == --keep-framework-cache ]] && { export SELFTEST_KEEP=1; shift; }
       [[ $1 == -- ]] && shift
       export SELFTEST_SHIM=1; exec "$@" ;;
  replay) [[ ${2:-} == --help ]] && { echo "  --capacity-gb FLOAT"; exit 0; }
          echo '{"trace":"t.csv","events":10,"policies":[{"policy":"cuda-malloc","peak_reserved_bytes":2147483648,"peak_allocated_bytes":1073741824,"fragmentation_at_peak":0.5,"ooms":0,"ns_per_op":46000.0,"ns_per_alloc":50000,"ns_per_free":42000}]}' ;;
  *) exit 2 ;;
esac
EOF
chmod +x "$TMP/build/tools/gpustitch"

cat >"$TMP/bin/python" <<'EOF'
#!/usr/bin/env bash
if [[ ${1:-} != *train_seqlen.py ]]; then exec python3 "$@"; fi
shift
config="" ladder="" batch="" trace=0
while (($#)); do
  case $1 in
    --config) config=$2; shift 2 ;;
    --ladder) ladder=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --budget-gb) [[ $2 == 0 ]] && trace=1; shift 2 ;;
    *) shift ;;
  esac
done
if ((trace)); then
  conf=${GPUSTITCH_CONF#*trace:}; printf 'Thread,Time,Action\n1,0,allocate\n1,0,free\n' >"$conf"
  exit 0
fi
case $config in
  pytorch-default) limit=5 tps=100000 alloc=20 res=23 ;;
  expandable-segments) limit=6 tps=99000 alloc=20 res=21 ;;
  max-split-128mb) limit=5 tps=98000 alloc=20 res=24 ;;
  cudaMallocAsync) limit=6 tps=97000 alloc=20 res=22 ;;
  gpustitch+pytorch-cache) limit=6 tps=99500 alloc=20 res=20.3 ;;
  gpustitch) limit=7 tps=96000 alloc=20.1 res=20.2 ;;
  gpustitch-pluggable) echo "Segmentation fault" >&2; exit 139 ;;
esac
[[ -n ${SELFTEST_SHIM:-} ]] && echo "gpustitch: summary device 0: allocs 10, cache hits 9" >&2
if [[ -n $ladder ]]; then
  max=0
  for b in ${ladder//,/ }; do
    if ((b > limit)); then
      echo "rung {\"batch\": $b, \"ok\": false, \"oom\": \"CUDA out of memory\"}"
      echo "{\"config\": \"$config\", \"max_ok_batch\": $max, \"stopped\": \"oom\", \"oom\": true}"
      exit 0
    fi
    echo "rung {\"batch\": $b, \"ok\": true, \"steps\": 12}"; max=$b
  done
  echo "{\"config\": \"$config\", \"max_ok_batch\": $max, \"stopped\": \"done\"}"
  exit 0
fi
python3 - "$config" "$batch" "$tps" "$alloc" "$res" "${SELFTEST_SHIM:-}" <<'PY'
import json, sys
c, b, tps, a, r, shim = sys.argv[1:]
G = 1 << 30
print(json.dumps({"config": c, "batch": int(b), "steps_completed": 16, "oom": False,
                  "error": None, "tokens_per_s": float(tps), "peak_allocated_bytes": int(float(a) * G),
                  "peak_reserved_bytes": int(float(r) * G), "shim_active": bool(shim),
                  "fragmentation": 1 - float(a) / float(r),
                  "peak_reserved_source": "gpustitch_get_stats.peak_reserved" if shim else "torch",
                  "model": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 8192,
                            "min_len": 256, "max_len": 8192}, "torch": "fake"}))
PY
EOF
chmod +x "$TMP/bin/python"

fail=0
check() {  # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi
}

PYTHON=$TMP/bin/python "$HERE/run_e2e.sh" "$TMP/build" "$TMP/out" --time-budget 200 \
  >"$TMP/run.log" 2>&1 || { cat "$TMP/run.log"; echo "FAIL: run_e2e.sh exited non-zero"; exit 1; }
md=$TMP/out/e2e.md
check "e2e.md and e2e.json written" test -s "$md" -a -s "$TMP/out/e2e.json"
check "common batch is the smallest survived batch (5)" grep -qx 5 "$TMP/out/logs/common_batch"
check "7 configuration rows" test "$(grep -cE '^\| (pytorch-default|expandable-segments|max-split-128mb|cudaMallocAsync|gpustitch\+pytorch-cache|gpustitch|gpustitch-pluggable) \|' "$md")" -eq 7
check "ladder maximum of gpustitch is 7" grep -q '^| gpustitch | 7 |' "$md"
check "crashed pluggable run reported, not fatal" grep -q '^| gpustitch-pluggable | 0 (crashed)' "$md"
check "reserved over demand of gpustitch (20.2/20)" grep -q '^| gpustitch | 7 | 20.10 | 20.20 | 0.5% | 1.010 |' "$md"
check "target 1.02x passes" grep -q 'peak reserved <= 1.02 x peak allocated | 1.010 | PASS' "$md"
check "lowest reserved target: gpustitch 20.20 below every other (20.30)" \
  grep -q 'lowest peak reserved of all configurations | 20.20 GiB | PASS' "$md"
check "tokens/s target of the shim without cache (0.96 >= 0.95)" \
  grep -q 'gpustitch: tokens/s >= 0.95 x PyTorch default.s | 0.960 | PASS' "$md"
check "replay table" grep -q '^| cuda-malloc | 2.00 | 1.00 | 50.0% | 0 | 46000 |' "$md"
check "the recorded trace is replayed" grep -q 'train-trace.csv (3 lines), capacity 24 GiB' \
  "$TMP/out/logs/replay_status"
check "shim summaries quoted" grep -q 'gpustitch: summary device 0' "$md"
check "e2e.json parses" python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['common_batch']=='5'" "$TMP/out/e2e.json"

# --only and --dry-run: commands printed, nothing written.
out=$("$HERE/run_e2e.sh" "$TMP/build" "$TMP/dry" --dry-run --only '^gpustitch$')
check "dry run writes nothing" test ! -e "$TMP/dry"
check "dry run prints the shim command" grep -q 'gpustitch run -- ' <<<"$out"
check "--only selects one configuration" test "$(grep -c 'train_seqlen.py --config' <<<"$out")" -eq 3

# Quick: no ladder, batch 2.
PYTHON=$TMP/bin/python "$HERE/run_e2e.sh" "$TMP/build" "$TMP/quick" --quick --no-replay \
  >"$TMP/quick.log" 2>&1 || { cat "$TMP/quick.log"; fail=1; }
check "quick run uses batch 2 and no ladder" test ! -e "$TMP/quick/logs/pytorch-default.ladder.out" -a \
  -s "$TMP/quick/logs/pytorch-default.timed.out"
# The real train_seqlen.py on the shape-only fake torch (fake_torch/): OOM above 5 x 8192 tokens.
out2=$TMP/real
PYTHONPATH=$HERE/fake_torch FAKE_TORCH_TOKENS=$((5 * 8192)) "$HERE/run_e2e.sh" "$TMP/build" "$out2" \
  --time-budget 200 --no-replay >"$TMP/real.log" 2>&1 || { cat "$TMP/real.log"; fail=1; }
check "train_seqlen.py on fake torch: every ladder found a limit" \
  test "$(grep -c '"stopped": "oom"' "$out2"/logs/*.ladder.out | grep -c ':1$')" -eq 7
check "train_seqlen.py on fake torch: common batch 5" grep -qx 5 "$out2/logs/common_batch"
check "train_seqlen.py on fake torch: timed runs measured tokens/s" \
  test "$(grep -l '"tokens_per_s"' "$out2"/logs/*.timed.out | wc -l)" -eq 7
check "pluggable without statistics: reported as unavailable, not invented" \
  grep -q '"peak_reserved_source": "unavailable"' "$out2/logs/gpustitch-pluggable.timed.out"

# An empty trace: the synthetic one is replayed instead.
PYTHON=$TMP/bin/python "$HERE/run_e2e.sh" "$TMP/build" "$TMP/synth" --only '^gpustitch$' \
  --trace "$TMP/empty.csv" --time-budget 100 >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log"; fail=1; }
check "no usable trace: synthetic trace replayed on 12 GiB" \
  grep -q 'synthetic trace (--generate; .* is empty or missing), capacity 12 GiB' \
  "$TMP/synth/logs/replay_status"

if ((fail == 0)); then echo "selftest: all passed"; else echo "selftest: FAILED"; cat "$TMP/run.log"; fi
exit "$fail"
