# Cross-compiling for Arm64 Linux on Debian with its aarch64 toolchain (g++-aarch64-linux-gnu) and
# the arm64 multiarch -dev packages (/usr/lib/aarch64-linux-gnu, /usr/include/aarch64-linux-gnu).
# The tests run under qemu-user (ctest and gtest_discover_tests go through the emulator).
# scripts/arm64.sh installs all of it and uses this file.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# The multiarch subdirectory searched under every prefix (<prefix>/lib/aarch64-linux-gnu/cmake/...):
# Debian's arm64 packages install their libraries and CMake configs there, beside the host's.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Libraries, headers and packages only from the cross toolchain's root and the multiarch paths
# (CMAKE_LIBRARY_ARCHITECTURE), never the host's x86-64 ones; programs (ninja, qemu) from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# Test programs run under qemu with the arm64 multiarch C library (libc6:arm64, which the arm64
# -dev packages pull in): its loader /lib/ld-linux-aarch64.so.1 and libc.so.6 in
# /lib/aarch64-linux-gnu, so the sysroot prefix is / (-L /). Not -L /usr/aarch64-linux-gnu: the
# cross toolchain's loader there searches /lib/aarch64-linux-gnu too, finds the multiarch libc.so.6
# of another glibc build, and the two disagree on private data (pthread_create then loops forever
# on a corrupt stack-cache list: OpenBLAS's thread pool hung at load). qemu's default CPU ("max")
# has SVE and SVE2, so every Arm target of the kernels can run.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /)
