#!/usr/bin/env bash
# libgpustitch.so in an older userland than the build machine's: a Debian bullseye root (glibc
# 2.31; tools/old-userland-root.sh), entered with chroot, no GPU. Checks that
#  - the root's own /bin/true and python3 start with the library preloaded (an unmet glibc symbol
#    version would make the dynamic loader refuse them);
#  - the C API allocates, writes, reads back and frees on the simulated backend, and
#    gpustitch_get_stats accounts for it (old_userland_check.py, with the root's python3);
#  - a malformed GPUSTITCH_CONF leaves the program running.
# Usage: old_userland_test.sh LIB ROOT VERSION
# Exits 77 (ctest: skipped) when the root is missing and cannot be built here (not root, no
# mmdebstrap, no network), unless GPUSTITCH_REQUIRE_OLD_USERLAND=1 (CI) makes that a failure.
set -uo pipefail
lib="$1" root="$2" version="$3"
here="$(cd "$(dirname "$0")" && pwd)"
skip() {
  if [[ "${GPUSTITCH_REQUIRE_OLD_USERLAND:-0}" == 1 ]]; then
    echo "old-userland: FAILED: $1 (GPUSTITCH_REQUIRE_OLD_USERLAND=1)"
    exit 1
  fi
  echo "old-userland: skipped: $1"
  exit 77
}
[[ $(id -u) -eq 0 ]] || skip "chroot needs root"
if ! "$here/../../tools/old-userland-root.sh" "$root"; then
  skip "cannot build the old userland root at $root"
fi

work="$(mktemp -d "$root/tmp/gpustitch-test.XXXXXX")" || exit 1
trap 'rm -rf "$work"' EXIT
cp "$lib" "$work/libgpustitch.so"
cp "$here/old_userland_check.py" "$work/"
inside="/tmp/${work##*/}"
sim="backend:sim,sim_devices:1,sim_capacity_mb:1024"
failed=0
# run NAME EXPECTED_OUTPUT_REGEX ENV... -- CMD...: runs CMD in the root with only the given
# environment; passes when it exits 0 and its output matches the regex.
run() {
  local name="$1" expect="$2"
  shift 2
  local envs=()
  while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  local out rc
  out="$(chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin "${envs[@]}" "$@" 2>&1)"
  rc=$?
  if [[ $rc -ne 0 ]] || ! grep -Eq -- "$expect" <<<"$out"; then
    echo "--- $name: FAILED (exit $rc, expected output matching '$expect'):"
    echo "$out"
    failed=1
  else
    echo "--- $name: ok"
    if [[ -n "$out" ]]; then
      while IFS= read -r line; do echo "    $line"; done <<<"$out"
    fi
  fi
}

echo "old-userland: $(chroot "$root" /usr/bin/ldd --version | head -1)"
pre="LD_PRELOAD=$inside/libgpustitch.so"
# /bin/true prints nothing: any output (a loader complaint) fails, as does its exit status.
run "/bin/true" '^$' "$pre" -- /bin/true
run "python3 starts" '^started$' "$pre" -- python3 -c 'print("started")'
run "C API on the simulated backend" '^old-userland: api ok' "$pre" "GPUSTITCH_CONF=$sim" \
  -- python3 "$inside/old_userland_check.py" api "$version"
for conf in 'backend:sim,sim_devices:two,,=,no_such_key:1,sim_capacity_mb:-5' \
  ':::,,,backend' 'enable:maybe,log_level:loud'; do
  run "malformed GPUSTITCH_CONF '$conf'" 'malformed configuration survived' "$pre" \
    "GPUSTITCH_CONF=$conf" -- python3 "$inside/old_userland_check.py" malformed
  run "/bin/true, GPUSTITCH_CONF '$conf'" '^$' "$pre" "GPUSTITCH_CONF=$conf" -- /bin/true
done
if [[ $failed -ne 0 ]]; then
  echo "old-userland: FAILED"
  exit 1
fi
echo "old-userland: all passed"
