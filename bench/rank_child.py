"""What the torch-against-meshfuse comparisons share (comm_compare.py, overlap_compare.py): each
rank times torch, then runs one of meshfuse's programs as a child process with the same rank
environment on a fresh port, and rank 0 gets its JSON."""

import json
import os
import socket
import subprocess
import sys


def quantile(samples, p):
    """The p-th quantile (p in [0, 1]), linearly interpolated (numpy.quantile's default)."""
    s = sorted(samples)
    pos = p * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_child(command, port, who):
    """This rank's part of `command` (a meshfuse program printing JSON on rank 0) with its store on
    `port`; the JSON records on rank 0, [] elsewhere; exits naming `who` if the child fails."""
    env = dict(os.environ, MASTER_PORT=str(port),
               MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # meshfuse serves its own store on MASTER_PORT
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"{who}: {' '.join(command)} failed with status {result.returncode}")
    return json.loads(result.stdout) if result.stdout.strip() else []
