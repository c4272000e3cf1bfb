#!/usr/bin/env bash
# Compile times of user programs (the README example, the DataParallel tutorial, train_lm and the
# CUDA tutorial) in chorus's compiled and header-only forms, beside the same programs written
# for LibTorch (Debian's libtorch-dev), compiled in the same run, one at a time, in interleaved
# rounds: wall time and peak memory of the exact commands CMake runs in a Release build.
# usage: scripts/compile-times.sh [BUILD_DIR=build-compile-times] [--rounds N] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-compile-times
if [[ $# -gt 0 && $1 != --* ]]; then
  build=$1
  shift
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
exec python3 scripts/compile_times.py "$build" "$@"
