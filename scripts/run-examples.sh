#!/usr/bin/env bash
# Runs the examples built in the given build folder (default: build).
set -euo pipefail
build=${1:-build}
ran=0
for ex in "$build"/tests/readme_example; do
  [[ -x $ex ]] || continue
  echo "== $(basename "$ex")"
  CHORUS_CPU_DEVICES=${CHORUS_CPU_DEVICES:-2} "$ex"
  ran=$((ran + 1))
done
echo "run-examples: $ran example(s) ran"
