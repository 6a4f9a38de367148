#!/usr/bin/env bash
# The main job: set up, build, benchmark one llama-3.2-1b layer on this machine's CPU against the
# reference backend (extra arguments go to `meshfuse bench`), then run its MLP block and head
# sharded over 4 ranks, forward and backward, against one device (`meshfuse run`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
"$root/build/apps/meshfuse/meshfuse" bench --model llama-3.2-1b "$@"
"$root/build/apps/meshfuse/meshfuse" run --model llama-3.2-1b
