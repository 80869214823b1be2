#!/usr/bin/env bash
# Builds gpustitch and runs its test suite (everything but the GPU-labelled tests, which need a
# GPU: run them with `ctest --preset gpu`). Usage: tools/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)"
ctest --preset default -j"$(nproc)"
