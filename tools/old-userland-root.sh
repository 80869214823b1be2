#!/usr/bin/env bash
# Builds the old userland that tests/preload/old_userland_test.sh preloads libgpustitch.so into: a
# minimal Debian bullseye root (glibc 2.31, python3.9), from Debian's package registry with
# mmdebstrap (apt-get install mmdebstrap), as root. Usage: tools/old-userland-root.sh DIR
# Reuses DIR when a previous run completed it (the stamp lists what it was built with), so CI
# builds it once and every stage and rerun reuses it. About a minute (40-70 s) and 140 MB.
set -euo pipefail
dir="${1:?usage: $0 DIR}"
suite=bullseye
packages=python3
stamp="$dir/.gpustitch-old-userland"
want="suite=$suite packages=$packages"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "old-userland-root: $dir ($want) already built"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "old-userland-root: needs root (chroot and device nodes)" >&2
  exit 2
fi
if ! command -v mmdebstrap >/dev/null; then
  echo "old-userland-root: mmdebstrap not installed (apt-get install mmdebstrap)" >&2
  exit 2
fi
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
# essential: the Essential: yes packages (coreutils' /bin/true among them) and what the includes
# need, without apt. Documentation is left out: nothing reads it. No mirror is named: mmdebstrap
# takes Debian's default.
mmdebstrap --quiet --variant=essential --include="$packages" --mode=root \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' "$suite" "$dir"
echo "$want" >"$stamp"
echo "old-userland-root: built $dir ($want)"
