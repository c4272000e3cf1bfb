#!/usr/bin/env bash
# Resharding checkpoints (Note [resharding checkpoints]): a FullyShardedDataParallel job, and a
# ZeRO-2 job, train 3 steps on 4 ranks and save; resumed on 4 ranks each ends bitwise where an
# uninterrupted 4-rank run does; resumed on 2 and on 3 ranks it ends where an uninterrupted run
# on that world does, to rounding (the sums' order); the FSDP consolidated file holds the model
# the 4 ranks held at the save.
#   reshard_check.sh MPIEXEC DIST_RESHARD
set -u
mpiexec=$1 prog=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "reshard_check: FAIL: $*"; exit 1; }
run() { local np=$1; shift; "$mpiexec" -n "$np" "$prog" "$@" || fail "mpiexec -n $np dist_reshard $*"; }
run 4 train "$work/ckpt" 3
[[ -e "$work/ckpt/index.json" ]] || fail "no index.json"
run 4 resume "$work/ckpt" 6 "$work/resumed4.safetensors"
run 4 straight 6 "$work/straight4.safetensors"
"$prog" compare "$work/resumed4.safetensors" "$work/straight4.safetensors" 0 || fail "resumed on 4 ranks differs"
for m in 2 3; do
  run "$m" resume "$work/ckpt" 6 "$work/resumed$m.safetensors"
  run "$m" straight 6 "$work/straight$m.safetensors"
  "$prog" compare "$work/resumed$m.safetensors" "$work/straight$m.safetensors" 1e-12 ||
    fail "resumed on $m ranks differs from the $m-rank run"
done
"$prog" consolidate "$work/ckpt" "$work/one.safetensors" || fail "consolidate_sharded"
"$prog" compare "$work/one.safetensors" "$work/ckpt.full.safetensors" 0 || fail "the consolidated file differs"
# ZeRO-2 (DistributedDataParallel::shard_gradients + ZeroRedundancyOptimizer::save_sharded).
run 4 zero-train "$work/zero" 3
[[ -e "$work/zero/index.json" ]] || fail "no ZeRO index.json"
run 4 zero-resume "$work/zero" 6 "$work/zero-resumed4.safetensors"
run 4 zero-straight 6 "$work/zero-straight4.safetensors"
"$prog" compare "$work/zero-resumed4.safetensors" "$work/zero-straight4.safetensors" 0 ||
  fail "ZeRO resumed on 4 ranks differs"
for m in 2 3; do
  run "$m" zero-resume "$work/zero" 6 "$work/zero-resumed$m.safetensors"
  run "$m" zero-straight 6 "$work/zero-straight$m.safetensors"
  "$prog" compare "$work/zero-resumed$m.safetensors" "$work/zero-straight$m.safetensors" 1e-12 ||
    fail "ZeRO resumed on $m ranks differs from the $m-rank run"
done
echo "reshard ok: FSDP and ZeRO-2 saved on 4 ranks; resumed on 4 bitwise, on 2 and 3 within 1e-12; FSDP consolidated bitwise"
