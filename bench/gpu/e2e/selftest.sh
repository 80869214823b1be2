#!/usr/bin/env bash
# selftest.sh: runs run_e2e.sh end to end without a GPU, against stand-ins, to check the plumbing:
# argument handling, time shares, the common batch, the status of each run, the HuggingFace
# training phase, the trace replay phase, and that report.py writes e2e.md / e2e.json with the
# expected rows and target results.
#
#   bench/gpu/e2e/selftest.sh
#
# Stand-ins (in a temporary directory): a "python" that answers train_seqlen.py with made-up
# results (each configuration OOMs at its own batch; the shim's pluggable run crashes on purpose),
# answers tools/gpu/hf_workloads.py train with made-up results in its JSON format (the
# configuration told apart by its environment; max-split-128mb fails with an OOM on purpose) and
# `import transformers` with success (failure with SELFTEST_NO_TRANSFORMERS=1), and passes
# everything else to python3; a build folder whose tools/gpustitch implements
# `run [--keep-framework-cache] -- CMD` (exec) and `replay --json` (a fixed JSON answer).
# Then the real train_seqlen.py and hf_workloads.py on fake_torch/ (a shape-only torch and
# transformers).
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

# nvidia-smi: memory.used is what the running stand-in wrote to $SELFTEST_NVML (1000 MiB when none
# runs); with -lms, a sample every 50 ms until killed.
cat >"$TMP/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
now() { cat "$SELFTEST_NVML" 2>/dev/null || echo 1000; }
if [[ " $* " == *" -lms "* ]]; then while :; do now; sleep 0.05; done; else now; fi
EOF
chmod +x "$TMP/bin/nvidia-smi"
export NVIDIA_SMI=$TMP/bin/nvidia-smi SELFTEST_NVML=$TMP/nvml_now

cat >"$TMP/bin/python" <<'EOF'
#!/usr/bin/env bash
# in_use MiB: holds the device's memory.used at 1000 + MiB for a moment, as a run's peak would.
in_use() { echo $((1000 + $1)) >"$SELFTEST_NVML"; sleep 0.3; echo 1000 >"$SELFTEST_NVML"; }
if [[ ${1:-} == -c && ${2:-} == *"import transformers"* ]]; then
  if [[ -n ${SELFTEST_NO_TRANSFORMERS:-} ]]; then
    echo "ModuleNotFoundError: No module named 'transformers'" >&2; exit 1
  fi
  echo "0.0-stub"; exit 0
fi
if [[ ${1:-} == *hf_workloads.py && ${2:-} == train ]]; then
  if [[ -n ${SELFTEST_SHIM:-} && -n ${SELFTEST_KEEP:-} ]]; then cfg=gpustitch+pytorch-cache
  elif [[ -n ${SELFTEST_SHIM:-} ]]; then cfg=gpustitch
  elif [[ -n ${GPUSTITCH_LIB:-} ]]; then cfg=gpustitch-pluggable
  else cfg=${PYTORCH_CUDA_ALLOC_CONF:-pytorch-default}; fi
  case $cfg in
    pytorch-default) tps=64000 alloc=13.1 res=24.45 src=torch; in_use 25600 ;;
    expandable_segments:True) tps=63000 alloc=13.1 res=14.5 src=torch; in_use 15360 ;;
    backend:cudaMallocAsync) tps=60000 alloc=13.1 res=15 src=torch; in_use 15872 ;;
    gpustitch+pytorch-cache) tps=62000 alloc=24.4 res=24.6 src=gpustitch; in_use 25700 ;;
    gpustitch) tps=57600 alloc=13.2 res=14 src=gpustitch; in_use 15104 ;;
    max_split_size_mb:128)
      printf 'Traceback (most recent call last):\n  File "hf_workloads.py"\n' >&2
      echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2; exit 1 ;;
    *) echo "selftest: hf_workloads.py run for $cfg, which it has no mode for" >&2; exit 3 ;;
  esac
  python3 -c 'import json, sys
t, a, r, s = sys.argv[1:]
G = 1 << 30
print(json.dumps({"mode": "train", "tokens_per_s": float(t), "source": s,
                  "peak_allocated": int(float(a) * G), "peak_reserved": int(float(r) * G),
                  **({"torch_peak_allocated": int(float(a) * G)} if s == "gpustitch" else {}),
                  "ratio": round(float(r) / float(a), 4)}))' "$tps" "$alloc" "$res" "$src"
  exit 0
fi
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
case $config in  # used: MiB the timed run adds to nvidia-smi's figure, its 1 GiB balloon included
  pytorch-default) limit=5 tps=100000 alloc=20 res=23 used=24576 ;;
  expandable-segments) limit=6 tps=99000 alloc=20 res=21 used=22528 ;;
  max-split-128mb) limit=5 tps=98000 alloc=20 res=24 used=25600 ;;
  cudaMallocAsync) limit=6 tps=97000 alloc=20 res=22 used=23552 ;;
  gpustitch+pytorch-cache) limit=6 tps=99500 alloc=20 res=20.3 used=22272 ;;
  gpustitch) limit=7 tps=96000 alloc=20.1 res=20.2 used=22016 ;;
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
in_use "$used"
python3 - "$config" "$batch" "$tps" "$alloc" "$res" "${SELFTEST_SHIM:-}" <<'PY'
import json, sys
c, b, tps, a, r, shim = sys.argv[1:]
G = 1 << 30
print(json.dumps({"config": c, "batch": int(b), "steps_completed": 16, "oom": False,
                  "balloon_bytes": G,
                  "error": None, "tokens_per_s": float(tps), "peak_allocated_bytes": int(float(a) * G),
                  "peak_reserved_bytes": int(float(r) * G), "shim_active": bool(shim),
                  "fragmentation": 1 - float(a) / float(r),
                  "peak_reserved_source": "gpustitch_get_stats.peak_reserved" if shim else "torch",
                  **({"driver_pool_peak_reserved_bytes": G // 4, "pool_driver_calls_timed": 1234,
                      "pool_driver_ms_timed": 61.34, "pool_driver_bg_ms_timed": 0.0,
                      "pool_fence_syncs_timed": [3, 1.25], "pool_fence_waits_timed": [7, 42.5],
                      "pool_fence_waits_timed_out": 1,
                      # 0.25 GiB went to the driver's pool past the hooks: PyTorch counts it.
                      "torch_peak_allocated_bytes": int(float(a) * G) + G + G // 4,
                      "shim_stats": {"peak_allocated": int(float(a) * G) + G}}
                     if shim and c == "gpustitch" else {}),
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
ROWS_RE='^\| (pytorch-default|expandable-segments|max-split-128mb|cudaMallocAsync|gpustitch\+pytorch-cache|gpustitch|gpustitch-pluggable) \|'
# section SECTION_HEADING FILE: the lines of one "### " section of e2e.md (the GPT table: "").
section() { awk -v h="$1" '/^### /{cur=substr($0,5)} cur==h' "$2"; }
check "7 configuration rows" test "$(section "" "$md" | grep -cE "$ROWS_RE")" -eq 7
check "ladder maximum of gpustitch is 7" grep -q '^| gpustitch | 7 |' "$md"
check "crashed pluggable run reported, not fatal" grep -q '^| gpustitch-pluggable | 0 (crashed)' "$md"
check "reserved over demand of gpustitch (20.2/20)" grep -q '^| gpustitch | 7 | 20.10 | 20.20 | 0.5% | 1.010 |' "$md"
check "in use by nvidia-smi, less the figure before and the balloon (22016 - 1024 MiB)" \
  grep -q '^| gpustitch | 7 | 20.10 | 20.20 | 0.5% | 1.010 | 20.50 |' "$md"
check "nvidia-smi target at the common batch" grep -q \
  'lowest device memory in use (nvidia-smi) of all configurations, at the common batch | 20.50 GiB | PASS | lowest other: expandable-segments 21.00 GiB' \
  "$md"
check "nvidia-smi target, HF" grep -q \
  'lowest device memory in use (nvidia-smi) of all configurations, HF training | 14.75 GiB | PASS | lowest other: expandable-segments 15.00 GiB' \
  "$md"
check "bytes past the pool at the common batch: a miss (0.25 GiB in the driver's pool)" grep -q \
  'every byte PyTorch allocated was served by the pool, at the common batch | 0.25 GiB past it | MISS | PyTorch.s peak allocated 21.35 GiB, the pool.s 21.10 GiB' \
  "$md"
check "bytes past the pool, HF: none" grep -q \
  'every byte PyTorch allocated was served by the pool, HF training | 0.00 GiB past it | PASS' \
  "$md"
check "target 1.02x passes" grep -q 'peak reserved <= 1.02 x peak allocated | 1.010 | PASS' "$md"
check "memory in the driver's default pool is noted" \
  grep -q "^| gpustitch | 7 |.*plus up to 0.25 GiB in the driver's default pool" "$md"
check "the pool's driver time in the timed steps is noted" \
  grep -q "^| gpustitch | 7 |.*driver: 1,234 calls, 61.3 ms in the timed steps;" "$md"
check "the program's waits for the device in the pool are noted" \
  grep -q "^| gpustitch | 7 |.*waits for the device: 3 fences on the program's threads (1.2 ms), 7 for the reclaimer's fence (42.5 ms, 1 ran out) |" "$md"
check "lowest reserved target: gpustitch 20.20 below every other (20.30)" \
  grep -q 'lowest peak reserved of all configurations | 20.20 GiB | PASS' "$md"
check "tokens/s target of the shim without cache (0.96 >= 0.95)" \
  grep -q 'gpustitch: tokens/s >= 0.95 x PyTorch default.s | 0.960 | PASS' "$md"
check "replay table" grep -q '^| cuda-malloc | 2.00 | 1.00 | 50.0% | 0 | 46000 |' "$md"
check "the recorded trace is replayed" grep -q 'train-trace.csv (3 lines), capacity 24 GiB' \
  "$TMP/out/logs/replay_status"
check "shim summaries quoted" grep -q 'gpustitch: summary device 0' "$md"
check "e2e.json parses" python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['common_batch']=='5'" "$TMP/out/e2e.json"
hf=$(section "HF Llama training" "$md")
check "HF table: 7 configuration rows" test "$(grep -cE "$ROWS_RE" <<<"$hf")" -eq 7
check "HF table: gpustitch row (14.00/13.20, 14.00/13.10, 57600/64000)" \
  grep -q '^| gpustitch | 13.20 | 14.00 | 1.061 | 1.069 | 14.75 | 57,600 | 0.900 | figures: pool' <<<"$hf"
check "HF table: default is its own reference" \
  grep -q '^| pytorch-default | 13.10 | 24.45 | 1.866 | 1.866 | 25.00 | 64,000 | 1.000 |' <<<"$hf"
check "HF table: failed run shown as failed, with its error" \
  grep -q '^| max-split-128mb | - | - | - | - | - | - | - | failed: exit 1; torch.OutOfMemoryError' \
  <<<"$hf"
check "HF table: pluggable skipped, hf_workloads.py has no --pluggable" \
  grep -q '^| gpustitch-pluggable | - .*skipped: hf_workloads.py has no --pluggable' <<<"$hf"
check "HF runs: the shim's under gpustitch run, logs and status rows" \
  grep -q 'gpustitch run -- .*hf_workloads.py train --steps 12 --warmup 2' \
  "$TMP/out/logs/gpustitch.hf.out"
check "HF status rows: 5 ok, 1 exit 1, 1 skipped" \
  test "$(awk -F'\t' '$2=="hf"{print $3}' "$TMP/out/logs/status.tsv" | sort | uniq -c |
          awk '{printf "%s:%s ", $1, $2}')" = "1:exit 5:ok 1:skipped: "
check "e2e.json: hf_train figures" python3 -c "
import json, sys
h = {r['config']: r for r in json.load(open(sys.argv[1]))['hf_train']['configs']}
assert len(h) == 7 and h['gpustitch']['ok'] and not h['max-split-128mb']['ok']
assert abs(h['gpustitch']['tokens_per_s_vs_default'] - 0.9) < 1e-9
assert h['gpustitch']['result']['source'] == 'gpustitch'
assert h['gpustitch-pluggable']['status'].startswith('skipped')" "$TMP/out/e2e.json"

# --only and --dry-run: commands printed, nothing written.
out=$("$HERE/run_e2e.sh" "$TMP/build" "$TMP/dry" --dry-run --only '^gpustitch$')
check "dry run writes nothing" test ! -e "$TMP/dry"
check "dry run prints the shim command" grep -q 'gpustitch run -- ' <<<"$out"
check "--only selects one configuration" test "$(grep -c 'train_seqlen.py --config' <<<"$out")" -eq 3
check "dry run prints the HF command" \
  grep -q 'gpustitch run -- .*hf_workloads.py train --steps 12 --warmup 2' <<<"$out"
out=$("$HERE/run_e2e.sh" "$TMP/build" "$TMP/dry" --dry-run --no-hf --hf-steps 7)
check "--no-hf: no HF command" test "$(grep -c 'hf_workloads.py' <<<"$out")" -eq 0
out=$("$HERE/run_e2e.sh" "$TMP/build" "$TMP/dry" --dry-run --only default --hf-steps 7)
check "--hf-steps sets the steps" grep -q 'hf_workloads.py train --steps 7 --warmup 2' <<<"$out"
# shellcheck disable=SC2016  # the inner script's own arguments
check "--hf-steps must exceed the warm-up" \
  bash -c '! "$1" "$2" "$3" --dry-run --hf-steps 2 2>/dev/null' _ \
  "$HERE/run_e2e.sh" "$TMP/build" "$TMP/dry"

# Quick: no ladder, batch 2.
PYTHON=$TMP/bin/python "$HERE/run_e2e.sh" "$TMP/build" "$TMP/quick" --quick --no-replay \
  >"$TMP/quick.log" 2>&1 || { cat "$TMP/quick.log"; fail=1; }
check "quick run uses batch 2 and no ladder" test ! -e "$TMP/quick/logs/pytorch-default.ladder.out" -a \
  -s "$TMP/quick/logs/pytorch-default.timed.out"
check "quick run: HF training of 5 steps" grep -q 'hf_workloads.py train --steps 5 --warmup 2' \
  "$TMP/quick/logs/pytorch-default.hf.out"
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
check "hf_workloads.py on fake torch/transformers: 6 runs gave a result" \
  test "$(grep -l '"tokens_per_s"' "$out2"/logs/*.hf.out | wc -l)" -eq 6
check "hf_workloads.py on fake torch/transformers: reported against the default" \
  grep -q '^| pytorch-default | .* | 1.000 |' <(section "HF Llama training" "$out2/e2e.md")

# An empty trace: the synthetic one is replayed instead.
SELFTEST_NO_TRANSFORMERS=1 PYTHON=$TMP/bin/python \
  "$HERE/run_e2e.sh" "$TMP/build" "$TMP/synth" --only '^gpustitch$' \
  --trace "$TMP/empty.csv" --time-budget 100 >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log"; fail=1; }
check "no usable trace: synthetic trace replayed on 12 GiB" \
  grep -q 'synthetic trace (--generate; .* is empty or missing), capacity 12 GiB' \
  "$TMP/synth/logs/replay_status"
check "no transformers: HF phase skipped and said so" \
  grep -q "^Not run: skipped: transformers does not import (ModuleNotFoundError" \
  <(section "HF Llama training" "$TMP/synth/e2e.md")

if ((fail == 0)); then echo "selftest: all passed"; else echo "selftest: FAILED"; cat "$TMP/run.log"; fi
exit "$fail"
