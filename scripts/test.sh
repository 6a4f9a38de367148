#!/usr/bin/env bash
# The test suite: set up, build, run every test, then build again with AddressSanitizer and
# UndefinedBehaviorSanitizer and run the C++ tests once more.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"

echo "== build and test =="
"$root/scripts/build.sh" "$root/build"
ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"

echo "== build and test under ASan + UBSan =="
# The C++ tests and the CLI's; not the Python extension (an ASan library cannot be loaded into an
# uninstrumented interpreter).
"$root/scripts/build.sh" "$root/build-sanitize" -DMESHFUSE_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMESHFUSE_CUDA=OFF -DMESHFUSE_BUILD_PYTHON=OFF -DMESHFUSE_BUILD_BENCH=OFF
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$root/build-sanitize" --output-on-failure -j "$(nproc)"
