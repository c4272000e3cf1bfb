#!/usr/bin/env bash
# Fuzzes the safetensors loader with libFuzzer (clang, -fsanitize=fuzzer,address,undefined)
# for a bounded time. usage: scripts/fuzz-safetensors.sh [SECONDS=600] [WORKDIR=build-fuzz]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
work=${2:-build-fuzz}
mkdir -p "$work/corpus" "$work/crashes"

clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -Iinclude tests/fuzz/safetensors_fuzzer.cpp -lopenblas -lpthread -o "$work/safetensors_fuzzer"

# Seeds: a valid file for the fuzz target's module, and a few near misses.
seed() {  # seed NAME HEADER DATA_BYTES
  local header=$2 n=${#2}
  {
    printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' $((n & 255)) $((n >> 8 & 255)) $((n >> 16 & 255)) $((n >> 24 & 255)))"
    printf '%s' "$header"
    head -c "$3" /dev/zero
  } > "$work/corpus/$1"
}
seed valid '{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"F64","shape":[3],"data_offsets":[16,40]},"n":{"dtype":"I64","shape":[],"data_offsets":[40,48]}}' 48
seed meta '{"__metadata__":{"k":"v"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}' 16
seed f16 '{"w":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}}' 8
seed empty '{}' 0

"$work/safetensors_fuzzer" -max_total_time="$seconds" -print_final_stats=1 -dict=tests/fuzz/safetensors.dict \
  -artifact_prefix="$work/crashes/" -max_len=4096 -timeout=10 "$work/corpus" 2>&1 | tee "$work/fuzz.log" | tail -25
