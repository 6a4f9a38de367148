#!/usr/bin/env bash
# Arm64: cross-compiles the library and its tests with Debian's aarch64 toolchain
# (cmake/aarch64-linux-gnu.cmake) into build-arm64/ (or $1), then runs the cpu op suites under
# qemu-user once per Arm SIMD target of the kernels. qemu's default CPU ("max") has SVE2 with
# 512-bit vectors; the runs:
#   sve2      plain: Highway's SVE2 target, the best one there
#   sve2_128  128-bit vectors (QEMU_CPU sve-default-vector-length=16): SVE2_128 (Neoverse N2, V2)
#   sve_256   256-bit vectors: SVE_256 (Neoverse V1)
#   sve, neon, scalar   MESHFUSE_CPU_TARGET pins them
# The suites: the op kernels' (tests/CMakeLists.txt's MESHFUSE_OP_SUITES: softmax, cross_entropy,
# rmsnorm, swiglu, elementwise, gemm, recurrent, fused linear cross entropy, pack_sequence,
# continuous count, CpuMath, CpuTargets), without the CUDA and torch cases. Not the communicator,
# executor and multi-process tests: they are no kernel code, and their ranks, sockets and timeouts
# test the host's processes more than the emulated CPU. qemu runs the tests some 50x slower than the
# CPU would, and the double-precision reference of a few large shapes dominates: $slow (most of a
# 45-minute run on a busy 2-core VM) is left out unless ARM64_ALL=1; the same kernels run at the
# smaller shapes. docs/kernels/cpu_simd.md (Arm64) says what ran and what it found.
# Installs what is missing first (apt, like scripts/setup.sh). CI does not run it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build-arm64}
shift || true

# libdnnl2:arm64, not libdnnl-dev:arm64: the -dev package cannot be installed beside the amd64 one
# (their dnnl_config.h differ: Debian's arm64 oneDNN has no OpenCL runtime). Its headers and CMake
# config are unpacked into the build directory below.
packages=(cmake ninja-build g++-aarch64-linux-gnu qemu-user libhwy-dev:arm64 libfmt-dev:arm64
  libopenblas-dev:arm64 libdnnl2:arm64 libgtest-dev:arm64 libgmock-dev:arm64)
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $sudo dpkg --add-architecture arm64
  $sudo apt-get update -qq
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "arm64: installing ${missing[*]}"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi
dnnl=$dir/deps/dnnl
if [[ ! -f $dnnl/usr/lib/aarch64-linux-gnu/cmake/dnnl/dnnl-config.cmake ]]; then
  mkdir -p "$dir/deps"
  (cd "$dir/deps" && apt-get download -qq -o APT::Sandbox::User=root libdnnl-dev:arm64)
  dpkg-deb -x "$dir"/deps/libdnnl-dev_*_arm64.deb "$dnnl"
  # The config names the shared library beside itself: the installed libdnnl2:arm64's.
  ln -sf /usr/lib/aarch64-linux-gnu/libdnnl.so.* "$dnnl/usr/lib/aarch64-linux-gnu/"
fi

cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" \
  -Ddnnl_DIR="$dnnl/usr/lib/aarch64-linux-gnu/cmake/dnnl" -DMESHFUSE_CUDA=OFF \
  -DMESHFUSE_BUILD_PYTHON=OFF -DMESHFUSE_BUILD_BENCH=OFF -DMESHFUSE_BUILD_APPS=OFF \
  -DMESHFUSE_GLOO=OFF -DMESHFUSE_MPI=OFF "$@" >/dev/null
cmake --build "$dir" --target meshfuse_tests  # -j: CMAKE_BUILD_PARALLEL_LEVEL, else ninja's

# The op suites without CUDA and torch cases, as tests/CMakeLists.txt's cpu_target_* runs take them.
filter=$(<"$dir/tests/op_suites_filter")
slow='*EveryTransposeWithAndWithoutC*:Gemm.GemmLargerThanOneScratchBlock*:*AtV262144*'
slow+=':*EveryReductionOptionAndLabelDType*:*WideVocabularyRows*:*DeterministicRunToRun*'
slow+=':*VocabularyShardsCombine*'
[[ ${ARM64_ALL:-} == 1 ]] || filter+=:$slow
failed=()
run() {  # name, then VAR=value settings for the run; its output goes to $dir/arm64-<name>.log
  local name=$1 t=$SECONDS
  local log=$dir/arm64-$name.log
  shift
  if env "$@" qemu-aarch64 -L / "$dir/tests/meshfuse_tests" --gtest_brief=1 \
    --gtest_filter="$filter" >"$log" 2>&1; then
    echo "arm64: $name: $(grep -E '^\[  PASSED  \]' "$log"), $(grep -cE ': Skipped$' "$log")" \
      "skipped (no GPU, no torch), $((SECONDS - t)) s"
  else
    grep -E -B2 -A8 'Failure$' "$log" | head -60
    echo "arm64: $name: $(grep -E '^\[  FAILED  \] [0-9]+ test' "$log") (see $log)"
    failed+=("$name")
  fi
}
start=$SECONDS
run sve2
run sve2_128 QEMU_CPU=max,sve-default-vector-length=16
run sve_256 QEMU_CPU=max,sve-default-vector-length=32
run sve MESHFUSE_CPU_TARGET=sve
run neon MESHFUSE_CPU_TARGET=neon
run scalar MESHFUSE_CPU_TARGET=scalar
echo "arm64: $((SECONDS - start)) s; failed: ${failed[*]:-none}"
((${#failed[@]} == 0))
