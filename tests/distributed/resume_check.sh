#!/usr/bin/env bash
# Crash and resume (Note [checkpointer]): runs dist_resume once without a crash, then again with
# the last rank SIGKILLed before a random step, relaunched (as torchrun's --max-restarts does)
# until it finishes; passes when the resumed job's final model is bitwise the uninterrupted one's.
#   resume_check.sh MPIEXEC NP DIST_RESUME
set -u
mpiexec=$1 np=$2 prog=$3
steps=20 max_restarts=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() { "$mpiexec" -n "$np" "$prog" "$@"; }
run "$work/a" "$steps" -1 "$work/a.safetensors" || { echo "resume_check: FAIL: the uninterrupted run failed"; exit 1; }
kill_at=${CHORUS_RESUME_KILL_AT:-$((RANDOM % (steps - 2) + 1))}  # 1 ... steps - 2 (or as given, to rerun a case)
echo "resume_check: the last of $np rank(s) is killed before step $kill_at"
restarts=0
until run "$work/b" "$steps" "$kill_at" "$work/b.safetensors"; do
  restarts=$((restarts + 1))
  if ((restarts > max_restarts)); then echo "resume_check: FAIL: more than $max_restarts restarts"; exit 1; fi
  echo "resume_check: the job failed; restart $restarts"
done
[[ -e "$work/b/killed" ]] || { echo "resume_check: FAIL: no rank was killed"; exit 1; }
((restarts >= 1)) || { echo "resume_check: FAIL: the job with a killed rank reported success"; exit 1; }
cmp "$work/a.safetensors" "$work/b.safetensors" || { echo "resume_check: FAIL: the resumed parameters differ"; exit 1; }
echo "resume ok: killed before step $kill_at, $restarts restart(s), final parameters bitwise equal"
