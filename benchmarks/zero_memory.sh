#!/usr/bin/env bash
# Memory and step time of the ZeRO forms on the CPU, beside the ZeRO paper's formulas for fp32
# Adam (Psi parameters; per device: DDP 4 Psi + 4 Psi + 8 Psi; ZeRO-1 4 + 4 + 8/N; ZeRO-2
# 4 + 4/N + 8/N; ZeRO-3 16/N bytes each), in rounds whose order rotates (Note [paired rounds] in
# benchmarks/bench_util.hpp); step-time ratios as median [min-max].
#
# DistributedDataParallel (default): the mlp-medium step (global batch 512) under mpirun -np N
# (default 2) with Adam (plain DDP), ZeRO-1 (ZeroRedundancyOptimizer<Adam>), ZeRO-2 (the same with
# shard_gradients) and ZeRO-3 (FullyShardedDataParallel, each Linear a unit, Adam over the shards);
# prints rank 0's bytes. Other workloads through ddp_bench's arguments: `--width 4096 --batch 64`
# (mlp-large's layers), `--workload transformer-lm --batch 16` (each encoder layer a unit).
#
# DataParallel (--data-parallel WORKLOADS, e.g. mlp-medium,mlp-large,transformer-lm): one process,
# N CPU devices, plain Adam, ZeRO-1 (parallel::ShardedOptimizer<Adam>), ZeRO-2 (the same with
# DataParallel::shard_gradients) and, on the mlp workloads, ZeRO-3 (parallel::FullyShardedDataParallel,
# each Linear a unit: every device holds its shard of the parameters too); prints every device's
# gradients (where grad() is) and optimizer state, and the bytes it holds. On CPU devices the replicas read the primary's parameters in place
# and a gradient sum is made in the memory of the replica that computed a term (Note [host
# aliases]), so the 4 Psi of parameters is on device 0 only and the held bytes of plain and ZeRO-1
# are spread over the devices; on GPUs every device also holds its replica's 4 Psi. --check: exit 1
# when a device's gradients or state, or all devices' bytes together, are more than 10 % off.
#   benchmarks/zero_memory.sh [BUILD_DIR] [--rounds R (5)] [--np N (2)] [--data-parallel WORKLOADS]
#                             [--check] [extra ddp_bench / dp_memory_bench arguments]
set -euo pipefail
build=${1:-build}
shift || true
rounds=5
np=2
data_parallel=""
check=0
while [[ ${1:-} == --rounds || ${1:-} == --np || ${1:-} == --data-parallel || ${1:-} == --check ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --data-parallel) data_parallel=$2; shift 2 ;;
    --check) check=1; shift ;;
  esac
done
export OPENBLAS_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

if [[ -n $data_parallel ]]; then
  echo "load before: $(uptime)"
  results=$(mktemp)
  trap 'rm -f "$results"' EXIT
  for w in ${data_parallel//,/ }; do
    "$build/benchmarks/dp_memory_bench" --workload "$w" --devices "$np" --rounds "$rounds" "$@" | tee -a "$results"
  done
  echo "load after: $(uptime)"
  PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" python3 - "$results" "$check" <<'PY'
import json, sys
from bench_rounds import paired_ratios, spread
runs = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    runs.setdefault(d["workload"], {}).setdefault(d["form"], {})[d["round"]] = d
fmt = lambda s: f"{s['median']:.3f}x [{s['min']:.3f}-{s['max']:.3f}]"
bad = []
for w, forms in runs.items():
    first = next(iter(forms.values()))
    n, psi4 = first[0]["devices"], first[0]["param_bytes"]
    rounds = sorted(first)
    print(f"{w}: {n} CPU devices, batch {first[0]['batch']}, {len(rounds)} rounds, 4 Psi = {psi4 / 1e6:.2f} MB; "
          "per device (MB = 1e6 bytes): gradients kept there, optimizer state there [formula]; bytes held:")
    for form in ("adam", "zero1", "zero2", "zero3"):
        if form not in forms:
            continue
        d = forms[form][rounds[0]]
        grads = {"adam": (psi4, 0), "zero1": (psi4, 0), "zero2": (psi4 / n, psi4 / n), "zero3": (psi4 / n, psi4 / n)}[form]
        state = {"adam": (2 * psi4, 0)}.get(form, (2 * psi4 / n, 2 * psi4 / n))
        cells = []

        def near(what, got, want):
            if (abs(got - want) > 0.1 * want) if want else got > 0.01 * psi4:
                bad.append(f"{w} {form} {what}: {got / 1e6:.2f} MB against {want / 1e6:.2f} MB")

        for r in range(n):
            k = 0 if r == 0 else 1
            near(f"device {r} gradients", d["grad_bytes"][r], grads[k])
            near(f"device {r} optimizer state", d["state_bytes"][r], state[k])
            cells.append(f"{d['grad_bytes'][r] / 1e6:6.2f} [{grads[k] / 1e6:6.2f}], "
                         f"{d['state_bytes'][r] / 1e6:6.2f} [{state[k] / 1e6:6.2f}]; {d['held_bytes'][r] / 1e6:6.2f}")
        total = psi4 + sum(grads[0 if r == 0 else 1] + state[0 if r == 0 else 1] for r in range(n))
        near("bytes held on all devices", sum(d["held_bytes"]), total)
        line = f"  {form:5s} " + " | ".join(cells) + f" (all: {sum(d['held_bytes']) / 1e6:.2f} [{total / 1e6:.2f}])"
        step = spread([forms[form][r]["step_ms"] for r in rounds])
        line += f"; step {step['median']:.1f} ms [{step['min']:.1f}-{step['max']:.1f}]"
        if form != "adam" and "adam" in forms:
            line += ", over plain Adam's: " + fmt(spread(paired_ratios([forms[form][r]["step_ms"] for r in rounds],
                                                                       [forms["adam"][r]["step_ms"] for r in rounds])))
        if form == "zero2" and "zero1" in forms:
            line += ", over ZeRO-1's: " + fmt(spread(paired_ratios([forms[form][r]["step_ms"] for r in rounds],
                                                                   [forms["zero1"][r]["step_ms"] for r in rounds])))
        print(line)
if bad:
    print("more than 10 % off the formula:\n  " + "\n  ".join(bad))
    if sys.argv[2] == "1":
        sys.exit(1)
PY
  exit
fi

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
print(f"{runs['zero1'][rounds[0]]['workload']}: {len(rounds)} rounds, {n} processes; rank 0's bytes after the timed steps (MB = 1e6 bytes):")
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
