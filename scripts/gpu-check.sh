#!/usr/bin/env bash
# On a machine with a GPU: runs the CUDA tests (also under compute-sanitizer memcheck with the
# caching allocator off), the tutorial on the GPUs, and the GPU benchmarks side by side with
# PyTorch; writes the logs and a JSON summary into OUTDIR.
#
#   scripts/gpu-check.sh OUTDIR [BUILD=build]
# BUILD must hold a CUDA build (cmake -DCMAKE_CUDA_ARCHITECTURES=90; targets test_cuda,
# chorus_gpu_bench, data_parallel_tutorial_cuda). Python's torch is needed for the peer.
set -uo pipefail
out=${1:?usage: gpu-check.sh OUTDIR [BUILD]}
build=${2:-build}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
here=$(cd "$(dirname "$0")/.." && pwd)
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

echo "== CUDA tests"
"$build/tests/test_cuda" --gtest_output=json:"$out/test_cuda.json" > "$out/test_cuda.log" 2>&1 || status=1
tail -3 "$out/test_cuda.log"

echo "== CUDA tests under compute-sanitizer memcheck (caching allocator off)"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
CHORUS_CUDA_CACHING_ALLOCATOR=0 timeout 900 "$sanitizer" --tool memcheck --leak-check full --error-exitcode 1 \
  "$build/tests/test_cuda" > "$out/memcheck.log" 2>&1 || status=1
grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -3

echo "== tutorial on the GPUs"
"$build/examples/data_parallel_tutorial_cuda" --gpus > "$out/tutorial.log" 2>&1 || status=1
head -5 "$out/tutorial.log"

echo "== GPU benchmarks: chorus, then PyTorch"
"$build/benchmarks/chorus_gpu_bench" --json "$out/chorus_gpu.json" > "$out/chorus_gpu.log" 2>&1 || status=1
python3 "$here/benchmarks/pytorch_gpu_bench.py" --json "$out/pytorch_gpu.json" > "$out/pytorch_gpu.log" 2>&1 || status=1
python3 "$here/scripts/compare_benchmarks.py" "$out/chorus_gpu.json" "$out/pytorch_gpu.json" "$out/compare.json" \
  | tee "$out/compare.txt"

python3 - "$out" "$status" <<'PY'
import json, os, re, sys
out, status = sys.argv[1], int(sys.argv[2])
def read(name):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else ""
summary = {"status": "ok" if status == 0 else "failed"}
try:
    t = json.load(open(os.path.join(out, "test_cuda.json")))
    summary["tests"] = {"total": t.get("tests"), "failures": t.get("failures"), "disabled": t.get("disabled"),
                        "skipped": sum(1 for s in t["testsuites"] for c in s["testsuite"] if c.get("result") == "SKIPPED")}
except Exception as e:
    summary["tests"] = f"unreadable: {e}"
m = re.search(r"ERROR SUMMARY: (\d+) error", read("memcheck.log"))
summary["memcheck_errors"] = int(m.group(1)) if m else "no summary (see memcheck.log)"
try:
    summary["benchmarks"] = json.load(open(os.path.join(out, "compare.json")))
except Exception as e:
    summary["benchmarks"] = f"unreadable: {e}"
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps(summary, indent=2)[:3000])
PY
exit $status
