#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang, AddressSanitizer and UBSan into build-fuzz/
# (or $MESHFUSE_FUZZ_BUILD), then runs each for SECONDS (default 20) from its seed corpus
# (fuzz/corpus/TARGET, copied: the run's finds stay in the build folder). Prints each target's
# executions; exits 1 on the first finding, whose input is left in build-fuzz/findings/.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MESHFUSE_FUZZ_BUILD:-$root/build-fuzz}
seconds=${1:-20}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(model_config names store_server op_args)

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DMESHFUSE_FUZZ=ON -DMESHFUSE_CUDA=OFF \
  -DMESHFUSE_BUILD_TESTS=OFF -DMESHFUSE_BUILD_PYTHON=OFF -DMESHFUSE_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"

mkdir -p "$build/findings"
for t in "${targets[@]}"; do
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  cp -n "$root/fuzz/corpus/$t"/* "$corpus/" 2>/dev/null || true
  log=$build/fuzz_$t.log
  # One process, the run's own corpus; leaks are checked (a finding like any other): after each
  # input, and for store_server at exit only. Its server's threads outlive an input (a handler
  # frees its reply after the client has it), so libFuzzer's per-input check, which counts the
  # mallocs and frees of every thread during the input, reported their buffers; at exit the
  # server has stopped and joined them, and LeakSanitizer checks what is left.
  leaks=1
  [[ $t == store_server ]] && leaks=0
  if ! "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
      -detect_leaks=$leaks -artifact_prefix="$build/findings/${t}-" -print_final_stats=1 \
      "$corpus" >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz: $t found a failure; its input is in $build/findings/"
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  echo "fuzz: $t: ${runs:-?} executions in ${seconds} s, no finding"
done
