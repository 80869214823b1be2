#!/usr/bin/env bash
# pack-build.sh: copies what the GPU suite runs out of a build folder into a small one to carry to
# the GPU machine (the device tool carries at most 64 MiB with the working tree), debug info
# stripped, same layout, so that run-suite.sh --build DEST works there.
#
#   tools/gpu/pack-build.sh [BUILD (build)] [DEST (.devbuild)]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
SRC=${1:-build}
DEST=${2:-.devbuild}
[[ -d $SRC ]] || { echo "pack-build: no build folder $SRC" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST"
copied=0
copy() {  # copy PATH-relative-to-SRC
  [[ -f $SRC/$1 ]] || return 0
  mkdir -p "$DEST/$(dirname "$1")"
  cp "$SRC/$1" "$DEST/$1"
  strip --strip-debug "$DEST/$1" 2>/dev/null || true
  copied=$((copied + 1))
}
shopt -s nullglob
for f in "$SRC"/tests/gpu/* "$SRC"/tests/core/* "$SRC"/tests/tools/replay/test_replay_gpu "$SRC"/tools/gpu/* "$SRC"/bench/gpu/* "$SRC"/bench/core/* "$SRC"/bench/preload/*; do
  [[ -f $f && -x $f ]] && copy "${f#"$SRC"/}"
done
for f in "$SRC"/preload/*.so* "$SRC"/tools/gpustitch "$SRC"/daemon/gpustitchd; do
  [[ -f $f ]] && copy "${f#"$SRC"/}"
done
echo "pack-build: $copied files, $(du -sh "$DEST" | cut -f1) in $DEST"
