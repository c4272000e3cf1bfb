#!/usr/bin/env bash
# Runs the examples built in the given build folder (default: build): the DataParallel
# tutorial on 1, 2, 3 and 8 virtual CPU devices (or on the GPUs, with --gpus), the MLP
# training example, and the README's example.
set -euo pipefail
build=${1:-build}
gpus=0
[[ ${2:-} == --gpus ]] && gpus=1
run() { echo "== $*"; "$@"; }
if ((gpus)); then
  run "$build/examples/data_parallel_tutorial" --gpus
  run "$build/examples/train_mlp" --gpus
else
  for n in 1 2 3 8; do run "$build/examples/data_parallel_tutorial" --cpu "$n"; done
  run "$build/examples/train_mlp" --cpu 2
fi
run "$build/tests/readme_example"
