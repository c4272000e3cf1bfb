#!/usr/bin/env bash
# On a machine with a GPU: DistributedDataParallel over NCCL, launched two ways on one GPU (one
# H200 allows one rank per GPU; with a launcher even a world of one goes through NCCL):
#   1. mpirun -np 1   (MPI bootstrap: NCCL unique id broadcast over MPI)
#   2. torchrun's environment (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, no MPI
#      launcher: NCCL only), and the real torchrun when PyTorch is installed
# each running test_distributed_cuda and train_mlp_cuda --distributed; writes the logs, the
# GoogleTest JSON reports and distributed.json into OUTDIR. Called by gpu-check.sh, which judges
# the runs (scripts/gpu_check.py, distributed_stage): distributed.json holds each run's exit
# status ({"rc": N, "timed_out": false}) or why it did not run ({"not_run": "no mpirun"}).
#
#   scripts/gpu-check-distributed.sh OUTDIR [BUILD=build]
# BUILD must hold a CUDA build with MPI (targets test_distributed_cuda, train_mlp_cuda).
#
# Time: every run gets CHORUS_DIST_CHECK_TIMEOUT_S (default 120 s), cut to what is left of
# CHORUS_DIST_BUDGET_S (default 600 s) for all of them, so that the script ends inside the limit
# its caller gives it; a run is not started with under 5 s left ("not_run": "time").
# GNU timeout runs each in a process group of its own and kills that whole group (mpirun's
# ranks included) when the limit passes.
set -uo pipefail
out=${1:?usage: gpu-check-distributed.sh OUTDIR [BUILD]}
build=${2:-build}
mkdir -p "$out"
# The carried libraries first (BUILD/lib, then what the caller put first), the system's CUDA
# folders only as a fallback behind them.
ld=${LD_LIBRARY_PATH:-}
[[ -d "$build/lib" ]] && ld="$(cd "$build/lib" && pwd)${ld:+:$ld}"
export LD_LIBRARY_PATH="${ld:+$ld:}/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none
export CHORUS_DIST_TIMEOUT_S=${CHORUS_DIST_TIMEOUT_S:-120}  # a hang becomes an error, not a stuck check
epochs=${CHORUS_DIST_CHECK_EPOCHS:-2}
per_run=${CHORUS_DIST_CHECK_TIMEOUT_S:-120}
deadline=$((SECONDS + ${CHORUS_DIST_BUDGET_S:-600}))
test_bin="$build/tests/distributed/test_distributed_cuda"
mlp_bin="$build/examples/train_mlp_cuda"
declare -A results

check() {  # check NAME COMMAND...: runs it with a time limit, logs into OUTDIR/NAME.log
  local name=$1
  shift
  local left=$((deadline - SECONDS - 2))
  local limit=$((left < per_run ? left : per_run))
  if ((left < 5)); then
    results[$name]='{"not_run": "time"}'
    echo "== $name: not run (the time is up)"
    return
  fi
  echo "== $name (limit ${limit} s): $*"
  timeout -k 3 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local to=false
  ((rc == 124 || rc == 137)) && to=true
  results[$name]="{\"rc\": $rc, \"timed_out\": $to}"
  tail -3 "$out/$name.log"
}
torchrun_env=(env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u PMI_RANK -u PMIX_RANK -u MPI_LOCALNRANKS RANK=0 WORLD_SIZE=1
              LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531)

# A GPU machine may have no MPI launcher (the binaries still load the carried libmpi): the
# torchrun-environment runs need none; the mpirun ones run where mpirun exists.
check torchrun_env_tests "${torchrun_env[@]}" "$test_bin" --gtest_output=json:"$out/torchrun_env_tests.json"
check torchrun_env_train_mlp "${torchrun_env[@]}" "$mlp_bin" --distributed --epochs "$epochs"
if command -v mpirun > /dev/null; then
  check mpirun_tests mpirun -np 1 "$test_bin" --gtest_output=json:"$out/mpirun_tests.json"
  check mpirun_train_mlp mpirun -np 1 "$mlp_bin" --distributed --epochs "$epochs"
else
  results[mpirun_tests]='{"not_run": "no mpirun"}'
  results[mpirun_train_mlp]='{"not_run": "no mpirun"}'
fi
if command -v torchrun > /dev/null; then
  check torchrun_train_mlp torchrun --no-python --nproc-per-node=1 --master-port=29541 "$mlp_bin" --distributed \
    --epochs "$epochs"
else
  results[torchrun_train_mlp]='{"not_run": "no torchrun"}'
fi

{
  echo "{"
  first=1
  for k in "${!results[@]}"; do
    ((first)) || echo ","
    first=0
    printf '  "%s": %s' "$k" "${results[$k]}"
  done
  echo
  echo "}"
} > "$out/distributed.json"
cat "$out/distributed.json"
# The backend each run used (the tests print it): NCCL must have been exercised.
grep -h "backend" "$out"/*_tests.log 2>/dev/null | sort -u
# The verdict is gpu_check.py's (it reads the reports); here: non-zero when a run failed.
status=0
for k in "${!results[@]}"; do
  [[ ${results[$k]} == *'"rc": 0,'* || ${results[$k]} == *'"not_run": "no '* ]] || status=1
done
exit $status
