#!/usr/bin/env bash
# DistributedDataParallel's CPU scaling: the mlp-medium step (global batch 512) with 1 and with 2
# processes, one BLAS thread each; prints both JSON lines and the speedup (goal: >= 1.8x).
#   benchmarks/ddp_scaling.sh [BUILD_DIR] [extra ddp_bench arguments]
set -euo pipefail
build=${1:-build}
shift || true
export OPENBLAS_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "load before: $(uptime)"
one=$(mpirun -np 1 "$build/benchmarks/ddp_bench" "$@")
two=$(mpirun -np 2 "$build/benchmarks/ddp_bench" "$@")
echo "$one"
echo "$two"
echo "load after: $(uptime)"
python3 - "$one" "$two" <<'PY'
import json, sys
a, b = (json.loads(s) for s in sys.argv[1:3])
print(f"speedup of 2 DDP processes over the plain 1-process step: {a['plain_ms'] / b['step_ms']:.2f}x "
      f"(goal >= 1.8x; over DDP with 1 process: {a['step_ms'] / b['step_ms']:.2f}x); "
      f"all-reduce hidden behind backward: {100 * b['hidden']:.0f}%")
PY
