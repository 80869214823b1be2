#!/usr/bin/env bash
# Installs the Debian packages gpustitch builds and tests with. Idempotent; run as root (or with
# sudo available). The CUDA toolkit itself (headers only are needed) is expected under
# /usr/local/cuda or wherever CMake's FindCUDAToolkit looks.
#
# --aarch64: also what the aarch64 cross build (CMake preset aarch64) needs: Debian's cross
# compiler, qemu-user (statically linked: see cmake/toolchains/aarch64-linux-gnu.cmake) to run its
# tests, and the arm64 builds of the libraries that are not header-only, from Debian's multiarch
# archive (dpkg --add-architecture arm64).
set -euo pipefail
aarch64=0
[[ ${1:-} == --aarch64 ]] && aarch64=1
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  build-essential cmake ninja-build pkg-config clang clang-format
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libboost-dev libunwind-dev nlohmann-json3-dev libcli11-dev
  libsystemd-dev systemd dpkg-dev file python3
  python3-yaml shellcheck librsvg2-bin
  prometheus
)
if ((aarch64)); then
  pkgs+=(g++-aarch64-linux-gnu qemu-user-static libspdlog-dev:arm64 libfmt-dev:arm64
         libgtest-dev:arm64 libgmock-dev:arm64 libsystemd-dev:arm64)
  # Its packages are then missing below, so the package lists are updated for it.
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  $SUDO apt-get update -qq
  # policy-rc.d exit 101: installing prometheus (the tests run their own server on loopback) must
  # not start its system service here. Removed again afterwards.
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod 755 "$policy"
    own_policy=1
  fi
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if ((own_policy)); then $SUDO rm -f "$policy"; fi
fi
echo "install-deps: all build and test packages present"
