#!/usr/bin/env bash
# The main job: set up, build, and benchmark one llama-3.2-1b layer on this machine's CPU against
# the reference backend. Extra arguments go to `meshfuse bench`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
"$root/build/apps/meshfuse/meshfuse" bench --model llama-3.2-1b "$@"
