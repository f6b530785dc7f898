#!/usr/bin/env bash
# Stage what a CUDA machine without Debian's packages needs to build amp with CMake
# against a pip wheel's LibTorch: Boost.Hana, CLI11, GoogleTest/GoogleMock and
# Google Benchmark, copied from this machine's Debian packages into a prefix.
#
#   tools/gpu/stage-deps.sh [DIR]      (default DIR: .gpu-deps in the checkout; git-excluded)
#
# Then, on the CUDA machine, from the checkout (DIR travels with it):
#   tools/gpu/check.sh DIR   or by hand:
#   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMP_BUILD_BENCHMARKS=ON \
#     -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)');$PWD/DIR/usr" \
#     -DCMAKE_CXX_FLAGS="-isystem $PWD/DIR/usr/include"
set -euo pipefail
top=$(git rev-parse --show-toplevel); dir=${1:-.gpu-deps}
case "$dir" in /*) ;; *) dir=$top/$dir ;; esac
grep -qxF "/$(basename "$dir")/" "$top/.git/info/exclude" 2>/dev/null || echo "/$(basename "$dir")/" >> "$top/.git/info/exclude"
need=(libboost-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev)
for p in "${need[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ -n "${missing[*]:-}" ]; then apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; fi
L=/usr/lib/x86_64-linux-gnu; d=$dir/usr
rm -rf "$dir"; mkdir -p "$top/.git/info"; mkdir -p "$d/include/boost" "$d/lib/x86_64-linux-gnu/cmake" "$d/share/cmake"
cp -r /usr/include/boost/hana /usr/include/boost/hana.hpp /usr/include/boost/version.hpp \
      /usr/include/boost/config /usr/include/boost/config.hpp "$d/include/boost/"
cp -r /usr/include/CLI /usr/include/gtest /usr/include/gmock /usr/include/benchmark "$d/include/"
cp -P $L/libgtest*.a $L/libgmock*.a $L/libbenchmark*.a $L/libbenchmark*.so* "$d/lib/x86_64-linux-gnu/"
cp -r $L/cmake/GTest $L/cmake/benchmark $L/cmake/Boost-1.74.0 $L/cmake/boost_headers-1.74.0 \
      $L/cmake/BoostDetectToolset-1.74.0.cmake "$d/lib/x86_64-linux-gnu/cmake/"
cp -r /usr/share/cmake/CLI11 "$d/share/cmake/"
du -sh "$dir"
