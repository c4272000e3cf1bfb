#!/usr/bin/env bash
# Runs the examples built in the given build folder (default: build): the DataParallel
# tutorial on 1, 2, 3 and 8 virtual CPU devices, the MLP training example on 2, the
# character-level language model (train_lm, a short run of each model) on 2, and the README's
# example. `cmake --build BUILD --target examples` builds exactly these.
# With --gpus: the nvcc builds (data_parallel_tutorial_cuda, train_mlp_cuda) on all GPUs.
set -euo pipefail
build=${1:-build}
gpus=0
[[ ${2:-} == --gpus ]] && gpus=1
run() {
  if [[ ! -x $1 ]]; then
    echo "run-examples: $1 is not built (cmake --build $build --target ${1##*/})" >&2
    exit 1
  fi
  echo "== $*"
  "$@"
}
if ((gpus)); then
  run "$build/examples/data_parallel_tutorial_cuda" --gpus
  run "$build/examples/train_mlp_cuda" --gpus
else
  for n in 1 2 3 8; do run "$build/examples/data_parallel_tutorial" --cpu "$n"; done
  run "$build/examples/train_mlp" --cpu 2
  for model in lstm transformer; do
    run "$build/examples/train_lm" --model "$model" --cpu 2 --epochs 2 --steps 10 --batch 16 --sample 80 \
      --out "$build/examples/train_lm_out/$model"
  done
fi
run "$build/tests/readme_example"
