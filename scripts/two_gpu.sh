#!/usr/bin/env bash
# For a machine with two NVIDIA GPUs (issue "Two H200s"): builds with CUDA and NCCL, then
#   1. the distributed and executor tests on two ranks: nccl (two processes) and CUDA local (one
#      process, one GPU per rank), and meshfuse run on nccl in every overlap form (every output
#      checked against one device);
#   2. comm-bench on nccl against torch.distributed (bench/comm_compare.py), 1 MiB..1 GiB;
#   3. AG+GEMM and GEMM+RS (bench/overlap_compare.py: meshfuse none/collective/ring on nccl
#      against torch's sequential plan and its fused async-TP ops) and the same on CUDA local
#      with one GPU per rank (bench/overlap --spread); the llama-3.1-8b MLP block and head, forward
#      and backward, on nccl and on local, per overlap form (meshfuse run).
# Logs and JSON go to $OUT (or ./gpu-results), with everything also in one two_gpu.tgz.
# NVLink multicast stays off in every process (the machine's rule).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-results}
build=${MESHFUSE_GPU_BUILD:-$root/build-gpu}
mkdir -p "$out/two_gpu"
log=$out/two_gpu
status=0
step() {  # step NAME COMMAND...: runs it, output to $log/NAME.txt, a failure noted
  echo "== $1 =="
  local name=$1
  shift
  "$@" > "$log/$name.txt" 2>&1 || { status=1; echo "   failed: $*"; tail -n 20 "$log/$name.txt"; }
}

"$root/scripts/build.sh" "$build" -DMESHFUSE_CUDA=ON -DMESHFUSE_NCCL=ON -DMESHFUSE_BUILD_BENCH=ON \
  -DMESHFUSE_BUILD_PYTHON=OFF || exit 1
meshfuse=$build/apps/meshfuse/meshfuse
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$log/gpus.txt"
nvidia-smi topo -m >> "$log/gpus.txt" 2>&1

step test_nccl "$meshfuse" launch -n 2 -- "$build/tests/meshfuse_tests" --gtest_filter='DistNccl*'
step test_local_cuda ctest --test-dir "$build" -R 'DistLocalCuda|ExecutorCuda' --output-on-failure
for form in none collective ring; do
  step "run_nccl_$form" "$meshfuse" launch -n 2 --no-prefix -- "$meshfuse" run \
    --model llama-3.1-8b --backend nccl --device cuda --tokens 8192 --overlap "$form" --chunks 4 \
    --repeats 5 --format json
  step "run_local_$form" "$meshfuse" run --model llama-3.1-8b --backend local --device cuda \
    --ranks 2 --tokens 8192 --overlap "$form" --chunks 4 --repeats 5 --format json
done
step comm_compare "$meshfuse" launch -n 2 --no-prefix -- python3 "$root/bench/comm_compare.py" \
  --meshfuse "$meshfuse" --ops all_reduce,all_gather,reduce_scatter --dtype bf16 \
  --json "$log/comm_compare.json"
step overlap_compare "$meshfuse" launch -n 2 --no-prefix -- python3 \
  "$root/bench/overlap_compare.py" --overlap "$build/bench/overlap" --json "$log/overlap_compare.json"
step overlap_local "$build/bench/overlap" --device cuda --spread --json

tar czf "$out/two_gpu.tgz" -C "$out" two_gpu
grep -h "" "$log/comm_compare.txt" "$log/overlap_compare.txt" 2>/dev/null | tail -n 40
exit $status
