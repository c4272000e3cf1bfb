#!/usr/bin/env bash
# Installs what chorus needs on a Debian machine, skipping what is already there.
# CUDA Toolkit 13.0 and NCCL (under /usr/local/cuda) are expected to be present already;
# without them the CPU library, tests and examples still build and run.
set -euo pipefail

packages=(cmake make g++ libopenblas-dev libgtest-dev nlohmann-json3-dev)
packages+=(openmpi-bin libopenmpi-dev)  # chorus::distributed (optional for the library, used by the tests)
packages+=(libdnnl-dev)  # oneDNN: CPU float32 convolutions (optional for the library; CI uses it)
packages+=(doxygen)  # the API reference (cmake -DCHORUS_BUILD_DOCS=ON, target docs)
if ! python3 -m pip --version >/dev/null 2>&1; then
  packages+=(python3 python3-pip)  # for the safetensors interoperability test
fi
if [[ "${CHORUS_WITH_LIBTORCH:-0}" == 1 ]]; then
  packages+=(libtorch-dev)  # the CPU peer of the benchmarks
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The safetensors interoperability test reads and writes files with Python's safetensors; the
# profiler's pictures (scripts/plot_trace.py, test train_mlp_profile) are drawn with matplotlib.
if ! python3 -c "import safetensors, numpy, matplotlib" 2>/dev/null; then
  echo "install-deps: installing the Python packages safetensors, numpy and matplotlib"
  python3 -m pip install --quiet safetensors numpy matplotlib 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages safetensors numpy matplotlib
fi
