#!/bin/sh
# Runs a job in which one rank is killed midway (the DistFault test) and checks what the others
# and the launcher did: the job fails, the launcher's output names the dead rank (PATTERN, a
# grep -E expression), at least SURVIVORS ranks reported the error they expected, and none
# failed a check or had to be stopped.
# Usage:
#   expect_rank_killed.sh SURVIVORS PATTERN COMMAND ARGS...
survivors=$1 pattern=$2
shift 2
out=$("$@" 2>&1)
code=$?
printf '%s\n' "$out"
[ "$code" -ne 0 ] || { echo "expect_rank_killed: the job exited 0"; exit 1; }
printf '%s\n' "$out" | grep -Eq "$pattern" || { echo "expect_rank_killed: no '$pattern'"; exit 1; }
# A survivor whose test failed, or that did not exit 0 by itself (the launcher names it after the
# dead rank, "; then rank N ..."), fails the check.
if printf '%s\n' "$out" | grep -Eq '\[  FAILED  \]|; then rank'; then
  echo "expect_rank_killed: a surviving rank failed"
  exit 1
fi
got=$(printf '%s\n' "$out" | grep -c "survived rank")
[ "$got" -ge "$survivors" ] || { echo "expect_rank_killed: $got of $survivors ranks reported"; exit 1; }
echo "expect_rank_killed: exit $code, the dead rank named, $got ranks reported their error"
