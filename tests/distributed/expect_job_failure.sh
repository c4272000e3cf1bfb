#!/usr/bin/env bash
# Runs a job that must fail: passes when the command exits non-zero within MAX_SECONDS (and,
# with --expect REGEX, its output matches REGEX); fails when it succeeds or hangs.
#   expect_job_failure.sh MAX_SECONDS [--expect REGEX] -- COMMAND...
set -u
max=$1
shift
expect=""
if [[ "${1:-}" == --expect ]]; then
  expect=$2
  shift 2
fi
[[ "${1:-}" == -- ]] && shift
out=$(mktemp)
start=$(date +%s%3N)
timeout --kill-after=5 "$((max * 3))" "$@" >"$out" 2>&1
rc=$?
elapsed_ms=$(($(date +%s%3N) - start))
elapsed="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
cat "$out"
echo "expect_job_failure: exit status $rc after ${elapsed} s (limit ${max} s)"
status=0
if [[ $rc -eq 0 ]]; then
  echo "expect_job_failure: FAIL: the job succeeded"; status=1
elif [[ $rc -eq 124 ]] || ((elapsed_ms >= max * 3000)); then
  echo "expect_job_failure: FAIL: the job hung and was killed by timeout"; status=1
elif ((elapsed_ms > max * 1000)); then
  echo "expect_job_failure: FAIL: the job took longer than ${max} s to end"; status=1
fi
if [[ -n "$expect" ]] && ! grep -Eq "$expect" "$out"; then
  echo "expect_job_failure: FAIL: output does not match '$expect'"; status=1
fi
rm -f "$out"
exit $status
