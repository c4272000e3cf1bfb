#!/usr/bin/env bash
# The GPU check, in two device calls on one warm machine (Note [time budget] in gpu_check.py),
# each at most 240 s with its own summary, so that a failure in the first leaves the time to fix,
# rebuild and rerun it within one 15-minute loan:
#   1. correctness: the CUDA tests (test_cuda, test_cuda_layers, test_cuda_ops, each its own
#      stage; each failing test rerun alone with CHORUS_DEBUG_SYNC=1), the tutorial on the GPUs,
#      train_lm on the GPUs for a few steps (its validation loss must fall), and
#      DistributedDataParallel over NCCL on one GPU (scripts/gpu-check-distributed.sh);
#   2. speed: the GPU benchmarks side by side with PyTorch, then compute-sanitizer memcheck of
#      the kernel tests (MEMCHECK_PLAN in gpu_check.py) with the caching allocator off.
# Each part first unpacks the carried archive into a temporary folder (Note [packed carry]);
# within a part every stage keeps the later ones' floors. OUTDIR/summary-PART.json and
# OUTDIR/logs-PART.tar.gz are rewritten after every stage, so a timeout still returns what ran,
# and OUTDIR never holds more than those two files.
#
# Verdicts (summary-PART.json: "verdicts", one line per stage; "stages": the details and "counts":
# ran / passed / failed / skipped / crashed / timed_out). A test stage passes only when its binary
# exited 0, wrote its GoogleTest JSON report and passed at least one test, with none failed,
# crashed or (on a GPU machine) skipped; otherwise it says "did not start" (no report, no test:
# exit 127 for a missing library), "crashed", "failed (exit status -11 after writing its
# report)", "failed (ran no test)", "failed (N test(s) skipped on the GPU)" or "timed out".
# Memcheck adds "errors found" and reports a cut by the time limit as "timed out", not as an
# error. The exit status is non-zero unless every stage passed. tests/scripts/test_gpu_check.py
# checks these verdicts with fake binaries (CTest: gpu_check_verdicts).
#
#   scripts/gpu-check.sh --dry-run OUTDIR BUILD   here, without a GPU: packs BUILD's CUDA
#       binaries (BINARIES in gpu_check.py) and the libraries they need that the GPU machine may
#       lack (OpenBLAS, gfortran, quadmath, MPI; the C++ runtime as a fallback) into one archive,
#       .gpu-carry/chorus-gpu.tar.xz (xz through Python's tarfile: ~63 MiB packed into ~10 MiB;
#       .gpu-carry is ignored by git), then unpacks it as the GPU run does and checks that the
#       unpacked folder is the one packed, that every library of every binary resolves from it +
#       the CUDA libraries, that only the shared cudart is linked, that tree + .gpu-carry fit the
#       tool's 64 MiB less an 8 MiB margin, that test_cuda starts with that environment, that each
#       CUDA test binary runs (and skips), that every memcheck pattern names a test, that both
#       parts' time plans fit their budget, and that OUTDIR would come back whole.
#   scripts/gpu-check.sh correctness OUTDIR [BUILD]   on the GPU machine, first (BUILD defaults
#   scripts/gpu-check.sh speed OUTDIR [BUILD]         to .gpu-carry; a BUILD without the archive,
#       e.g. a build folder, is used as it is), then the second on the same warm machine.
#
# LD_LIBRARY_PATH is set for the chorus binaries only (the unpacked lib/, then the CUDA
# libraries found next to nvcc, in /usr/local/cuda and in python3's nvidia-* wheels); python3 and
# the PyTorch peer keep their own environment. The work is in scripts/gpu_check.py.
#
# The next session with an H200 (the device tool's `run`; see /work/.library/device/README.md):
#   1. here:  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90
#             cmake --build build -j2 --target test_cuda test_cuda_layers test_cuda_ops \
#                 data_parallel_tutorial_cuda train_lm_cuda chorus_gpu_bench test_distributed_cuda \
#                 train_mlp_cuda          (BINARIES in gpu_check.py; the last two need MPI)
#             scripts/gpu-check.sh --dry-run out/gpu-dry build        (must print "dry run: ok")
#   2. device runs, exactly, one after the other (the machine stays warm between them):
#        command:   scripts/gpu-check.sh correctness "$OUT" .gpu-carry      then
#        command:   scripts/gpu-check.sh speed "$OUT" .gpu-carry
#        carry:     [".gpu-carry"]
#        timeout_s: 300
#      after each, read summary-PART.json (its verdicts are also the output's last lines) and
#      unpack logs-PART.tar.gz from the files that come back; fix and rerun correctness before
#      speed where it failed; call give_back unless running again at once.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ ! ( ( "${1:-}" == "--dry-run" && $# -eq 3 ) || ( ( "${1:-}" == correctness || "${1:-}" == speed ) && ( $# -eq 2 || $# -eq 3 ) ) ) ]]; then
  echo "usage: $0 correctness|speed OUTDIR [BUILD]  |  $0 --dry-run OUTDIR BUILD" >&2
  exit 2
fi
# No LD_LIBRARY_PATH is exported here: python3 must load PyTorch's CUDA libraries, not ours.
exec python3 -u "$here/gpu_check.py" "$@"
