#!/usr/bin/env bash
# What chorus::profiler costs when compiled in and off, and while recording, against the same
# DataParallel steps with it compiled out (benchmarks/profiler_cost_bench.cpp).
#   benchmarks/profiler_cost.sh BUILD_DIR [profiler_cost_bench options: --rounds R --reps N ...]
set -euo pipefail
build=${1:?usage: profiler_cost.sh BUILD_DIR [options]}
shift
cmake --build "$build" -j2 --target profiler_cost_bench profiler_cost_bench_out
OPENBLAS_NUM_THREADS=1 "$build/benchmarks/profiler_cost_bench" --peer "$build/benchmarks/profiler_cost_bench_out" "$@"
