#!/usr/bin/env bash
# Installs amp with CMake into a temporary prefix and builds a consumer that
# uses find_package(amp) and amp::amp, as a LibTorch user's project would.
set -euo pipefail
work=${TEST_TMPDIR:-$(mktemp -d)}
# Under Bazel the sources are symlinks: install from a real copy, as a user would.
src="$work/src"
mkdir -p "$src"
cp -rL CMakeLists.txt cmake include "$src"/
mkdir -p "$src/tests" && cp -rL tests/cmake_consumer "$src/tests/"
cmake -S "$src" -B "$work/build" -DAMP_BUILD_TESTS=OFF -DAMP_BUILD_EXAMPLES=OFF \
  -DCMAKE_INSTALL_PREFIX="$work/prefix" ${LIBTORCH_PREFIX:+-DCMAKE_PREFIX_PATH="$LIBTORCH_PREFIX"} >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --install "$work/build" >"$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
test -f "$work/prefix/include/amp/amp.h" || { echo "FAIL: amp/amp.h not installed"; exit 1; }
ls "$work"/prefix/lib*/cmake/amp/ampConfig.cmake >/dev/null || { echo "FAIL: no ampConfig.cmake installed"; exit 1; }
cmake -S "$src/tests/cmake_consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix${LIBTORCH_PREFIX:+;$LIBTORCH_PREFIX}" \
  >"$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; exit 1; }
cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; exit 1; }
out=$("$work/consumer/consumer")
[ "$out" = "bf16-mixed" ] || { echo "FAIL: consumer printed '$out'"; exit 1; }
echo "PASS: installed amp found by find_package(amp); consumer printed $out"
