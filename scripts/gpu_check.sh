#!/usr/bin/env bash
# For a machine with an NVIDIA GPU: builds with the cuda backend, then runs the steps named as
# arguments (default: all of them), writing logs and JSON to $OUT (or ./gpu-results):
#   test      the whole test suite (CUDA tests included) through CTest
#   sanitize  the CUDA tests under compute-sanitizer memcheck and racecheck
#   bench     `meshfuse bench --device cuda` at llama-3.1-8b, 16384 tokens, bf16
#   compare   bench/torch_compare.py: meshfuse vs PyTorch eager and torch.compile (needs torch)
#   numerics  bench/numerics.py: meshfuse's and PyTorch's error against fp64 (needs torch)
#   python    `pip install .` from this build folder (nothing compiles again), then the Python
#             tests (opcheck, torch.compile on CUDA) against the installed package
# Installs nothing (GPU machines are often offline): it needs what scripts/setup.sh installs,
# plus nvcc; run scripts/setup.sh first where the package registries are reachable. The python
# step needs scikit-build-core: installed, or its wheels in .whl/ (pip download -d .whl
# scikit-build-core, where PyPI is reachable).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-results}
build=${MESHFUSE_GPU_BUILD:-$root/build-gpu}
mkdir -p "$out"
steps=("$@")
((${#steps[@]})) || steps=(test sanitize bench compare numerics python)

"$root/scripts/build.sh" "$build" -DMESHFUSE_CUDA=ON -DMESHFUSE_BUILD_BENCH=OFF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  | tee "$out/gpu.txt"

status=0
for step in "${steps[@]}"; do
  echo "== $step =="
  case $step in
    test)
      ctest --test-dir "$build" --output-on-failure -j 8 2>&1 | tee "$out/ctest.log" || status=1 ;;
    sanitize)
      # Both tools ($MESHFUSE_SANITIZE_TOOLS) at once, each over $MESHFUSE_SANITIZE_SHARDS
      # GoogleTest shards (default 6) spread over the visible GPUs: serially the suite takes an
      # hour under racecheck.
      # racecheck leaves out the tests of 64-bit addressing (names with "2To31" or
      # "TwoToThe31": tensors past 2^31 elements): under its shared-memory tracking they run for
      # hours (the recurrent one had not finished after 400 s in a shard of its own), and their
      # kernels are the ones the smaller tests race-check. memcheck runs them. racecheck also
      # leaves out the tests that call cuBLAS (gemm, bmm, linear, fused linear cross-entropy):
      # compute-sanitizer 2025.3's racecheck fails inside cuBLAS's sm_90 GEMM kernels ("failed to
      # handle a hardware exception", even with them filtered out of its checks), which leaves the
      # process's context unusable for every later test. Their other kernels are cross_entropy's
      # and linear's grad_bias column sum, race-checked by their own tests (LinearGradBias
      # calls no cuBLAS). The overlapped MLP block on local ranks is left out of racecheck too:
      # its bf16 GEMMs pick cuBLAS nvjet kernels in which racecheck reports hazards (cuBLAS's
      # own shared memory; meshfuse's kernels in the same test report none under memcheck and
      # the rest of racecheck). memcheck runs with --report-api-errors no: NCCL probes its
      # kernels at ncclCommInitRank and gets cudaErrorNoKernelImageForDevice, which memcheck
      # would count as errors; meshfuse checks every CUDA call's status itself and throws.
      # Skipped tests are listed: four fused linear cross-entropy cases are for 16-bit weights
      # only.
      shards=${MESHFUSE_SANITIZE_SHARDS:-6}
      ((shards >= 1)) || { echo "gpu_check: MESHFUSE_SANITIZE_SHARDS must be >= 1" >&2; exit 2; }
      # The GPUs this script was given: CUDA_VISIBLE_DEVICES when set, else every one.
      IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES-$(nvidia-smi --query-gpu=index \
        --format=csv,noheader | paste -sd,)}"
      ((${#gpus[@]})) || { echo "gpu_check: no GPU to sanitize on" >&2; exit 2; }
      rm -f "$out"/sanitize-*.log
      pids=()
      for tool in ${MESHFUSE_SANITIZE_TOOLS:-memcheck racecheck}; do
        # CUDA cases: the cross-backend suites' parameters end in cuda_<dtype> (or
        # reference_cuda_<dtype>), and the CUDA-only tests carry Cuda in their names.
        filter='*Cuda*:*cuda*'
        if [[ $tool == racecheck ]]; then
          filter='*Cuda*:*cuda*:-*2To31*:*TwoToThe31*:*Gemm*:*FusedLinear*'
          filter+=':*OverlappedMlpBlockOnLocalRanks*'
        fi
        api_errors=()
        [[ $tool == memcheck ]] && api_errors=(--report-api-errors no)
        for ((i = 0; i < shards; ++i)); do
          CUDA_VISIBLE_DEVICES=${gpus[${#pids[@]} % ${#gpus[@]}]} GTEST_TOTAL_SHARDS=$shards \
            GTEST_SHARD_INDEX=$i compute-sanitizer --tool "$tool" "${api_errors[@]}" --error-exitcode 1 \
            "$build/tests/meshfuse_tests" --gtest_filter="$filter" --gtest_brief=1 \
            > "$out/sanitize-$tool-$i.log" 2>&1 &
          pids+=($!)
        done
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      for log in "$out"/sanitize-*.log; do
        echo "$(basename "$log"): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)" \
          "$(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \] [0-9]' "$log" | tr '\n' ' ')"
      done | tee "$out/sanitize.txt" ;;
    bench)
      "$build/apps/meshfuse/meshfuse" bench --device cuda --model llama-3.1-8b --tokens 16384 \
        --dtype bf16 | tee "$out/bench.txt" || status=1
      "$build/apps/meshfuse/meshfuse" bench --device cuda --model llama-3.1-8b --tokens 16384 \
        --dtype bf16 --format json > "$out/bench.json" || status=1 ;;
    compare)
      PYTHONPATH="$build/python" python3 "$root/bench/torch_compare.py" --device cuda \
        --tokens 16384 --compile --seconds 2 --json "$out/torch_compare.json" 2>&1 \
        | tee "$out/torch_compare.txt" || status=1 ;;
    numerics)
      PYTHONPATH="$build/python" python3 "$root/bench/numerics.py" --device cuda --loss-dtype f32 \
        --json "$out/numerics-cuda.json" 2>&1 | tee "$out/numerics-cuda.txt" || status=1 ;;
    python)
      python3 -c "import scikit_build_core" 2>/dev/null ||
        python3 -m pip install --quiet --no-index --find-links "$root/.whl" scikit-build-core
      # The build's own options again (CUDA on, bench off), so that nothing is rebuilt.
      python3 -m pip install --quiet --no-build-isolation --no-index -Cbuild-dir="$build" \
        -Ccmake.define.MESHFUSE_CUDA=ON -Ccmake.define.MESHFUSE_BUILD_TESTS=ON \
        -Ccmake.define.MESHFUSE_BUILD_BENCH=OFF "$root" 2>&1 | tee "$out/pip.log" || status=1
      (cd "$root" && python3 -m pytest -q -p no:cacheprovider python/tests) 2>&1 \
        | tee "$out/pytest.log" || status=1 ;;
    *)
      echo "gpu_check: unknown step '$step' (test, sanitize, bench, compare, numerics, python)" >&2
      exit 2 ;;
  esac
done
exit $status
