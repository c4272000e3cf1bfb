#!/usr/bin/env bash
# Checks that chorus::distributed works on MPICH too (the code uses the MPI standard only; CI
# runs Open MPI). Debian installs MPICH beside Open MPI (mpicxx.mpich, mpiexec.mpich; the
# `mpi` alternatives keep Open MPI the default, priority 50 against MPICH's 40), so this builds
# the distributed tests against MPICH's wrapper in their own build folder and runs them with
# MPICH's mpiexec (Hydra).
#   scripts/check-mpich.sh [BUILD_DIR]     (default: build-mpich)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-mpich}

missing=()
for p in mpich libmpich-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCHORUS_ENABLE_CUDA=OFF -DCHORUS_BUILD_EXAMPLES=OFF \
  -DCHORUS_BUILD_BENCHMARKS=OFF -DMPI_CXX_COMPILER="$(command -v mpicxx.mpich)" \
  -DMPIEXEC_EXECUTABLE="$(command -v mpiexec.mpich)"
# The tests must really link MPICH, not whichever MPI is the default.
grep -q "mpich" "$build/CMakeCache.txt" || { echo "check-mpich: CMake did not pick MPICH" >&2; exit 1; }
cmake --build "$build" -j2 --target test_distributed dist_failures dist_user_mpi test_dist_local
libs=$(ldd "$build/tests/distributed/test_distributed")
[[ $libs == *libmpich* ]] || { echo "check-mpich: test_distributed is not linked to MPICH" >&2; exit 1; }
ctest --test-dir "$build" -L distributed --output-on-failure
echo "check-mpich: the distributed tests pass on $(mpichversion 2>/dev/null | head -1 || echo MPICH)"
