#!/usr/bin/env bash
# What chorus::profiler costs when compiled in and off, and while recording, against the same
# DataParallel steps with it compiled out (benchmarks/profiler_cost_bench.cpp). Two runs: the
# compiled-out build drives (its own steps beside the served compiled-in ones: the off/out ratio),
# then the compiled-in build drives (off, recording and the served compiled-out steps: the
# recording/off ratio, both in one process). The served side's steps can run slower than the
# driver's (mlp-small: 15 % in one arrangement), so each ratio is read from the run that holds
# both of its sides in the driver, or is measured both ways.
#   benchmarks/profiler_cost.sh BUILD_DIR [profiler_cost_bench options: --rounds R --reps N ...]
set -euo pipefail
build=${1:?usage: profiler_cost.sh BUILD_DIR [options]}
shift
cmake --build "$build" -j2 --target profiler_cost_bench profiler_cost_bench_out
bench="$build/benchmarks"
echo "--- the compiled-out build drives"
OPENBLAS_NUM_THREADS=1 "$bench/profiler_cost_bench_out" --peer "$bench/profiler_cost_bench" --json profiler_cost_out.json "$@"
echo "--- the compiled-in build drives"
OPENBLAS_NUM_THREADS=1 "$bench/profiler_cost_bench" --peer "$bench/profiler_cost_bench_out" --json profiler_cost_in.json "$@"
