#!/usr/bin/env bash
# Memory and step time of DistributedDataParallel's optimizer forms on the CPU: the mlp-medium
# step (global batch 512) under mpirun -np N (default 2) with Adam (plain DDP), ZeRO-1
# (ZeroRedundancyOptimizer<Adam>), ZeRO-2 (the same with shard_gradients) and ZeRO-3
# (FullyShardedDataParallel, each Linear a unit, Adam over the shards), in rounds whose order
# rotates (Note [paired rounds] in benchmarks/bench_util.hpp). Prints each run's JSON line, then per
# form rank 0's bytes (parameters, gradients, optimizer state) beside the ZeRO paper's formulas for
# fp32 Adam (Psi parameters: 4 Psi + 4 Psi + 8 Psi; ZeRO-1 4 + 4 + 8/N; ZeRO-2 4 + 4/N + 8/N;
# ZeRO-3 16/N bytes each) and the step-time ratios to ZeRO-1 and to plain DDP as median [min-max].
#   benchmarks/zero_memory.sh [BUILD_DIR] [--rounds R (5)] [--np N (2)] [extra ddp_bench arguments]
set -euo pipefail
build=${1:-build}
shift || true
rounds=5
np=2
while [[ ${1:-} == --rounds || ${1:-} == --np ]]; do
  if [[ $1 == --rounds ]]; then rounds=$2; else np=$2; fi
  shift 2
done
export OPENBLAS_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "load before: $(uptime)"
forms=(adam zero1 zero2 zero3)
lines=()
for ((r = 0; r < rounds; r++)); do
  for ((k = 0; k < ${#forms[@]}; k++)); do
    form=${forms[$(((k + r) % ${#forms[@]}))]}
    line=$(mpirun -np "$np" "$build/benchmarks/ddp_bench" --optimizer "$form" "$@")
    echo "round $r: $line"
    lines+=("$r $line")
  done
done
echo "load after: $(uptime)"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
printf '%s\n' "${lines[@]}" >"$results"
PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" python3 - "$results" "$np" <<'PY'
import json, sys
from bench_rounds import paired_ratios, spread
n = int(sys.argv[2])
runs = {}
for line in open(sys.argv[1]):
    r, text = line.split(" ", 1)
    d = json.loads(text)
    runs.setdefault(d["optimizer"], {})[int(r)] = d
rounds = sorted(runs["zero1"])
psi4 = runs["adam"][rounds[0]]["gradient_bytes"]  # 4 Psi: the fp32 gradients of the whole model
formula = {"adam": (4 + 4 + 8) * psi4 / 4, "zero1": (4 + 4 + 8 / n) * psi4 / 4, "zero2": (4 + 4 / n + 8 / n) * psi4 / 4,
           "zero3": 16 / n * psi4 / 4}
fmt = lambda s: f"{s['median']:.3f}x [{s['min']:.3f}-{s['max']:.3f}]"
print(f"{len(rounds)} rounds, {n} processes; rank 0's bytes after the timed steps (MB = 1e6 bytes):")
for form in ("adam", "zero1", "zero2", "zero3"):
    d = runs[form][rounds[0]]
    ratio = spread(paired_ratios([runs[form][r]["step_ms"] for r in rounds], [runs["zero1"][r]["step_ms"] for r in rounds]))
    to_ddp = spread(paired_ratios([runs[form][r]["step_ms"] for r in rounds], [runs["adam"][r]["step_ms"] for r in rounds]))
    step = spread([runs[form][r]["step_ms"] for r in rounds])
    print(f"  {form:6s} held {d['held_bytes'] / 1e6:7.2f} MB (formula {formula[form] / 1e6:6.2f} MB, "
          f"{d['held_bytes'] / formula[form]:.3f}x), gradients {d['grad_bytes'] / 1e6:6.2f} MB; step "
          f"{step['median']:.1f} ms [{step['min']:.1f}-{step['max']:.1f}], over ZeRO-1's: {fmt(ratio)}, over DDP's: "
          f"{fmt(to_ddp)}")
PY
