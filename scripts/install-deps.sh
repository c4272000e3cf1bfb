#!/usr/bin/env bash
# Installs what chorus needs on a Debian machine, skipping what is already there.
# CUDA Toolkit 13.0 and NCCL (under /usr/local/cuda) are expected to be present already;
# without them the CPU library, tests and examples still build and run.
set -euo pipefail

packages=(cmake make g++ libopenblas-dev libgtest-dev)
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
