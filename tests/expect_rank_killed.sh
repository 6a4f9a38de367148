#!/bin/sh
# Runs a job in which one rank is killed midway (the DistFault test) and checks what the others
# and the launcher did: the job fails, the launcher's output names the dead rank (PATTERN, a
# grep -E expression), and at least SURVIVORS ranks reported an error from their communicator.
# Usage:
#   expect_rank_killed.sh SURVIVORS PATTERN COMMAND ARGS...
survivors=$1 pattern=$2
shift 2
out=$("$@" 2>&1)
code=$?
printf '%s\n' "$out"
[ "$code" -ne 0 ] || { echo "expect_rank_killed: the job exited 0"; exit 1; }
printf '%s\n' "$out" | grep -Eq "$pattern" || { echo "expect_rank_killed: no '$pattern'"; exit 1; }
got=$(printf '%s\n' "$out" | grep -c "survived rank")
[ "$got" -ge "$survivors" ] || { echo "expect_rank_killed: $got of $survivors ranks reported"; exit 1; }
echo "expect_rank_killed: exit $code, the dead rank named, $got ranks reported their error"
