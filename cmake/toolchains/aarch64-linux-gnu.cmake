# Cross build for aarch64 (arm64) Linux with Debian's cross toolchain, from an x86_64 machine.
#
#   apt-get install g++-aarch64-linux-gnu qemu-user-static
#   dpkg --add-architecture arm64 && apt-get update
#   apt-get install libspdlog-dev:arm64 libfmt-dev:arm64 libgtest-dev:arm64 libgmock-dev:arm64 \
#                   libsystemd-dev:arm64
#   cmake --preset aarch64 && cmake --build --preset aarch64 && ctest --preset aarch64
#
# (tools/install-deps.sh --aarch64 does the apt-get part.) Libraries come from Debian's multiarch
# packages: the cross compiler searches /usr/lib/aarch64-linux-gnu and /usr/include, where
# libfoo-dev:arm64 puts them, and CMake finds their package files under
# /usr/lib/aarch64-linux-gnu/cmake. Header-only libraries (Boost, nlohmann-json, CLI11) are the
# build machine's own: Debian ships the same headers for every architecture. The CUDA headers are
# the x86_64 toolkit's, which describe the same API on every architecture; nothing links libcuda
# or libcudart (the driver is dlopen'ed), so no aarch64 toolkit is needed.
#
# Debian's multiarch layout needs no sysroot: the target's files live beside the build machine's.
#
# Programs built here run on the build machine under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR):
# ctest prefixes every test with it, and tests that start child programs start them through it
# too (GPUSTITCH_TEST_EMULATOR, tests/CMakeLists.txt), because qemu-user does not follow execve
# into another foreign binary and CI containers have no binfmt_misc to do it for them. The
# statically linked qemu-aarch64-static is used so that LD_PRELOAD and LD_LIBRARY_PATH in a
# test's environment reach the emulated program's loader and not the emulator's.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Installed (and packaged) under Debian's multiarch library directory, as natively: GNUInstallDirs
# picks lib/<multiarch> only when not cross-compiling, and plain lib otherwise.
set(CMAKE_INSTALL_LIBDIR lib/aarch64-linux-gnu CACHE PATH "Object code libraries")

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# pkg-config (libsystemd) reads the target's .pc files, not the build machine's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")

# The emulated programs' loader and libc are libc6:arm64's (/lib/ld-linux-aarch64.so.1,
# /lib/aarch64-linux-gnu), at the paths the aarch64 loader looks in: qemu needs no -L prefix.
set(GPUSTITCH_TARGET_LOADER /lib/ld-linux-aarch64.so.1)
find_program(GPUSTITCH_QEMU_AARCH64 qemu-aarch64-static)
if(GPUSTITCH_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${GPUSTITCH_QEMU_AARCH64})
else()
  # The test binaries list their tests at build time (gtest_discover_tests) by running them.
  message(WARNING "qemu-aarch64-static not found (package qemu-user-static): the tests cannot "
                  "run; configure with -DGPUSTITCH_BUILD_TESTS=OFF to build without them")
endif()

# CUDA device code is not cross-built (the GPU programs are built on the GPU machine).
set(CMAKE_CUDA_COMPILER "" CACHE FILEPATH "No CUDA compiler for the aarch64 cross build")
