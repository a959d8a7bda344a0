# Cross build for AArch64 Linux from an x86-64 Debian/Ubuntu host (tests/emu/run_aarch64.sh):
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DKT_JIT_BUILD_TESTS=ON
# Needs g++-aarch64-linux-gnu and libasmjit-dev:arm64 (dpkg --add-architecture arm64; tools/setup.sh
# installs both). GoogleTest is compiled from /usr/src/googletest. The result targets baseline
# armv8-a: every SIMD instruction beyond it comes from the generator at run time.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Multiarch packages (libasmjit-dev:arm64) live under the host's /usr/lib/aarch64-linux-gnu.
set(asmjit_DIR /usr/lib/aarch64-linux-gnu/cmake/asmjit CACHE PATH "asmjit for the target")
# pkg-config must not hand out the build host's x86-64 libraries.
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
set(ENV{PKG_CONFIG_PATH} "")

set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
