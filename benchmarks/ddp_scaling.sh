#!/usr/bin/env bash
# DistributedDataParallel's CPU scaling: the mlp-medium step (global batch 512) with 1 and with 2
# processes, one BLAS thread each, in alternating rounds (Note [paired rounds] in
# benchmarks/bench_util.hpp: mpirun -np 1, -np 2, then -np 2, -np 1, ...); prints each run's JSON
# line and the speedup as the median of the per-round speedups with its min-max (goal: >= 1.8x),
# and the same ratio for the computation alone (the no_sync step): the speedup's ceiling.
#   benchmarks/ddp_scaling.sh [BUILD_DIR] [--rounds R (5)] [extra ddp_bench arguments]
set -euo pipefail
build=${1:-build}
shift || true
rounds=5
if [[ ${1:-} == --rounds ]]; then
  rounds=$2
  shift 2
fi
export OPENBLAS_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "load before: $(uptime)"
lines=()
for ((r = 0; r < rounds; r++)); do
  order=(1 2)
  ((r % 2)) && order=(2 1)
  for np in "${order[@]}"; do
    line=$(mpirun -np "$np" "$build/benchmarks/ddp_bench" "$@")
    echo "round $r: $line"
    lines+=("$r $line")
  done
done
echo "load after: $(uptime)"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
printf '%s\n' "${lines[@]}" >"$results"
PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" python3 - "$results" <<'PY'
import json, statistics, sys
from bench_rounds import paired_ratios, spread
runs = {}
for line in open(sys.argv[1]):
    r, text = line.split(" ", 1)
    d = json.loads(text)
    runs.setdefault(d["processes"], {})[int(r)] = d
rounds = sorted(runs[1])
one, two = [runs[1][r] for r in rounds], [runs[2][r] for r in rounds]
fmt = lambda s: f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"
plain = spread(paired_ratios([a["plain_ms"] for a in one], [b["step_ms"] for b in two]))
ddp1 = spread(paired_ratios([a["step_ms"] for a in one], [b["step_ms"] for b in two]))
ceiling = spread(paired_ratios([a["plain_ms"] for a in one], [b["local_ms"] for b in two]))
hidden = statistics.median(b["hidden"] for b in two)
print(f"speedup of 2 DDP processes over the plain 1-process step, {len(rounds)} rounds: {fmt(plain)} (goal >= 1.8x, "
      f"the median); over DDP with 1 process: {fmt(ddp1)}; all-reduce hidden behind backward: {100 * hidden:.0f}% (median)")
print(f"computation alone (the 2-process no_sync step) over the plain 1-process step: {fmt(ceiling)}: "
      f"the ceiling of the speedup before any communication")
PY
