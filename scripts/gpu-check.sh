#!/usr/bin/env bash
# The GPU check, in one device call: first the carried archive unpacked into a temporary folder
# (Note [packed carry] in gpu_check.py), then the CUDA tests (test_cuda, test_cuda_layers,
# test_cuda_ops, each its own stage; each failing test rerun alone with CHORUS_DEBUG_SYNC=1), the
# tutorial on the GPUs, DistributedDataParallel over NCCL on one GPU
# (scripts/gpu-check-distributed.sh), the GPU benchmarks side by side with PyTorch, and last
# compute-sanitizer memcheck of the kernel tests (MEMCHECK_PLAN in gpu_check.py) with the caching
# allocator off. All stages, the unpack included, share a 540 s budget (Note [time budget]: each
# stage keeps the later ones' floors); OUTDIR/summary.json and OUTDIR/logs.tar.gz are rewritten
# after every stage, so a timeout still returns what ran, and OUTDIR never holds more than those
# two files.
#
# Verdicts (summary.json: "verdicts", one line per stage; "stages": the details and "counts":
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
#       CUDA test binary runs (and skips), that every memcheck pattern names a test, and that
#       OUTDIR would come back whole.
#   scripts/gpu-check.sh OUTDIR [BUILD]           on the GPU machine (BUILD defaults to .gpu-carry;
#       a BUILD without the archive, e.g. a build folder, is used as it is).
#
# LD_LIBRARY_PATH is set for the chorus binaries only (the unpacked lib/, then the CUDA
# libraries found next to nvcc, in /usr/local/cuda and in python3's nvidia-* wheels); python3 and
# the PyTorch peer keep their own environment. The work is in scripts/gpu_check.py.
#
# The next session with an H200 (the device tool's `run`; see /work/.library/device/README.md):
#   1. here:  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90
#             cmake --build build -j2 --target test_cuda test_cuda_layers test_cuda_ops \
#                 data_parallel_tutorial_cuda chorus_gpu_bench test_distributed_cuda train_mlp_cuda
#                                         (BINARIES in gpu_check.py; the last two need MPI)
#             scripts/gpu-check.sh --dry-run out/gpu-dry build        (must print "dry run: ok")
#   2. device run, exactly:
#        command:   scripts/gpu-check.sh "$OUT" .gpu-carry
#        carry:     [".gpu-carry"]
#        timeout_s: 600
#      then read summary.json (tests, reruns, tutorial, benchmark ratios vs PyTorch, memcheck) and
#      unpack logs.tar.gz from the files that come back; call give_back unless rerunning at once.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ $# -lt 1 || ( "$1" == "--dry-run" && $# -ne 3 ) ]]; then
  echo "usage: $0 OUTDIR [BUILD]  |  $0 --dry-run OUTDIR BUILD" >&2
  exit 2
fi
# No LD_LIBRARY_PATH is exported here: python3 must load PyTorch's CUDA libraries, not ours.
exec python3 -u "$here/gpu_check.py" "$@"
