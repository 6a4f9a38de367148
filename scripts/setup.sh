#!/usr/bin/env bash
# Installs everything meshfuse needs to build and test, from Debian packages and PyPI. Idempotent: runs
# apt-get / pip only when a package is missing. The CUDA toolkit is optional and not installed here.
set -euo pipefail

# libdnnl-dev: oneDNN, the CPU GEMM; its CMake config also wants OpenCL (ocl-icd-opencl-dev), as
# Debian builds it with the OpenCL GPU runtime. libgloo-dev, libopenmpi-dev, openmpi-bin: the gloo
# and mpi communicator backends. libhwy-dev: Google Highway, the cpu kernels' portable SIMD. clang
# with its runtimes (libFuzzer, the sanitizers) and OpenMP: the fuzz targets (scripts/fuzz.sh).
# libssl-dev: OpenSSL's libcrypto, the HMAC by which the rendezvous store's ends prove the secret.
packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libhwy-dev
  clang libclang-rt-14-dev libomp-14-dev
  libgloo-dev libopenmpi-dev openmpi-bin
  libssl-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python: the bindings (nanobind), `pip install .` without build isolation (scikit-build-core) and
# the tests (pytest, numpy, torch, transformers for meshfuse.torch.patch). PyPI's torch for x86-64
# Linux is the CUDA build: about 5 GB with its nvidia-* wheels, 7 minutes to install on a 2-core
# machine; its tests run on the CPU.
python_packages=(nanobind scikit-build-core pytest numpy torch transformers)
if ! python3 -c "import nanobind, scikit_build_core, pytest, numpy, torch, transformers" \
  2>/dev/null; then
  echo "setup: pip installing ${python_packages[*]}"
  python3 -m pip install --quiet --disable-pip-version-check "${python_packages[@]}"
fi

# Intel MKL on x86-64: the cpu backend's f32 GEMMs run on it where it is installed, as PyTorch's do
# (src/ops/gemm/cpu_blas.h). CMake finds it under the Python prefix; the tests cover it, and
# oneDNN's sgemm pinned (ctest's cpu_blas_onednn). About 700 MB installed.
if [[ $(uname -m) == x86_64 ]] && ! python3 -m pip show mkl >/dev/null 2>&1; then
  echo "setup: pip installing mkl"
  python3 -m pip install --quiet --disable-pip-version-check mkl
fi
