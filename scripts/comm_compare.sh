#!/usr/bin/env bash
# For a machine with two NVIDIA GPUs: builds with CUDA and NCCL, runs the nccl communicator tests
# on two ranks, then bench/comm_compare.py (meshfuse's nccl backend against torch.distributed with
# NCCL, all_reduce and all_gather at 1 MB..1 GB, in one job), writing logs and JSON to $OUT (or
# ./gpu-results). Extra arguments go to comm_compare.py (e.g. --dtype bf16).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-results}
build=${MESHFUSE_GPU_BUILD:-$root/build-gpu}
mkdir -p "$out"

"$root/scripts/build.sh" "$build" -DMESHFUSE_CUDA=ON -DMESHFUSE_NCCL=ON -DMESHFUSE_BUILD_BENCH=OFF
meshfuse=$build/apps/meshfuse/meshfuse
status=0
"$meshfuse" launch -n 2 -- "$build/tests/meshfuse_tests" --gtest_filter='DistNccl*' 2>&1 \
  | tee "$out/dist_nccl_test.log" || status=1
"$meshfuse" launch -n 2 --no-prefix -- python3 "$root/bench/comm_compare.py" \
  --meshfuse "$meshfuse" --json "$out/comm_compare.json" "$@" 2>&1 \
  | tee "$out/comm_compare.txt" || status=1
exit $status
