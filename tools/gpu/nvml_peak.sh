#!/usr/bin/env bash
# nvml_peak.sh: runs a command and prints, after its own output, the GPU's peak used memory while
# it ran as NVML reports it (nvidia-smi, device-wide, sampled every 50 ms), as one JSON line:
#   {"nvml_peak_used_mib": N, "nvml_idle_used_mib": M}
# The device-wide figure counts every byte the process holds (its CUDA context, memory that
# bypassed any allocator), which is what "served by the pool" is checked against.
#
#   tools/gpu/nvml_peak.sh COMMAND [ARGS...]
set -uo pipefail
command -v nvidia-smi >/dev/null || { echo "nvml_peak: no nvidia-smi" >&2; exit 2; }
samples=$(mktemp)
trap 'rm -f "$samples"' EXIT
idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -1)
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 50 >"$samples" &
smi=$!
"$@"
rc=$?
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null
peak=$(sort -n "$samples" | tail -1)
echo "{\"nvml_peak_used_mib\": ${peak:-null}, \"nvml_idle_used_mib\": ${idle:-null}}"
exit "$rc"
