#!/usr/bin/env bash
# Configures and builds meshfuse into build/ (or $1), passing the remaining args to CMake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build}
shift || true
# The Python extension is built for the python3 on PATH (the one setup.sh installed packages for).
cmake -S "$root" -B "$dir" -G Ninja -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)"
