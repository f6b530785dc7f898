#!/usr/bin/env bash
# The README's build recipes, taken from its text and run as a user would: the
# C++ block of "## The Trainer in 10 lines" is app.cc, built (1) with the plain
# compiler line and (2) with the CMake recipe (the install command line, then
# the ```cmake block as the app's CMakeLists.txt); each program must run, print
# its progress and write its checkpoint. Only paths and the standard change:
# amp's checkout is ./amp as in the README, /opt/amp is a temporary prefix,
# -std=c++17 becomes -std=c++20 from the LibTorch the README names. Bazel's recipe:
# tests/bazel_consumer_test.sh. LIBTORCH_PREFIX: a downloaded LibTorch (the
# README's $TORCH flags are added to the compiler line).
#   readme_build_test.sh [README.md [tests/readme_recipes.sh]]
set -euo pipefail
readme=$(readlink -f "${1:-README.md}")
recipes=$(readlink -f "${2:-tests/readme_recipes.sh}")
recipe() { bash "$recipes" "$readme" "$1"; }
work=${TEST_TMPDIR:-}
if [ -z "$work" ]; then work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT; fi
cd "$work"
# A user's clone of amp: the tree this README is in (under Bazel, where its
# runfile links to), less .git and what .gitignore's top-level lines name.
mkdir -p amp
tar -C "$(dirname "$readme")" --exclude=./.git --exclude='./bazel-*' --exclude='./build*' --exclude=./out -cf - . |
  tar -C amp -xf -
recipe app >app.cc

# The LibTorch line's standard, as the README states it: "`-std=c++20` from LibTorch X.Y".
since=$(recipe cxx20-since)
cxx=${CXX:-g++}
torch_api=${LIBTORCH_PREFIX:-/usr}/include/torch/csrc/api/include
read -r major minor < <(printf '#include <torch/version.h>\nTORCH_VERSION_MAJOR TORCH_VERSION_MINOR\n' |
  "$cxx" -E -P -isystem "$torch_api" -x c++ - | tail -1)
if [ "$major" -gt "${since%.*}" ] || { [ "$major" -eq "${since%.*}" ] && [ "$minor" -ge "${since#*.}" ]; }; then
  std=c++20
else
  std=c++17
fi
echo "LibTorch $major.$minor: -std=$std (the README: c++20 from $since)"

# Runs program $2 in directory $1: it must exit 0, print the Trainer's progress
# line at step 200 (on stderr: the precision string, the step, the loss) and
# write its checkpoint.
run_app() {
  local dir=$1 bin=$2 what=$3 out
  out=$(cd "$dir" && rm -f model.pt && "$bin" 2>&1) || { echo "FAIL: $what exited with $?"; exit 1; }
  printf '%s:\n%s\n' "$what" "$out"
  grep -q '^bf16-mixed 200 loss ' <<<"$out" || { echo "FAIL: $what printed no progress line for step 200"; exit 1; }
  [ "$(head -c 2 "$dir/model.pt" 2>/dev/null)" = PK ] || { echo "FAIL: $what wrote no model.pt checkpoint"; exit 1; }
}

# (1) The plain compiler line.
line=$(recipe gxx)
line=${line/-std=c++17/-std=$std}
[ -z "${LIBTORCH_PREFIX:-}" ] || line="$line $(recipe gxx-torch)"
echo "g++ recipe: $line"
mkdir -p gxx && cp app.cc gxx/ && ln -s ../amp gxx/amp
(cd gxx && TORCH=${LIBTORCH_PREFIX:-} bash -c "$line") >gxx.log 2>&1 || { cat gxx.log; echo "FAIL: the README's compiler line"; exit 1; }
run_app "$work/gxx" ./a.out "the compiler line's program"
echo "PASS: the README's compiler line built the Trainer block, which ran"

# (2) CMake: install amp, then the README's CMakeLists.txt.
install=$(recipe cmake-install)
install=${install//\/opt\/amp/$work/prefix}
echo "CMake recipe: $install"
bash -c "$install" >install.log 2>&1 || { cat install.log; echo "FAIL: the README's CMake install line"; exit 1; }
mkdir -p app && cp app.cc app/ && recipe cmake >app/CMakeLists.txt
if ! { cmake -S app -B app/build -DCMAKE_PREFIX_PATH="$work/prefix${LIBTORCH_PREFIX:+;$LIBTORCH_PREFIX}" &&
  cmake --build app/build; } >app.log 2>&1; then
  cat app.log; echo "FAIL: the README's CMakeLists.txt"; exit 1
fi
run_app "$work/app" "$work/app/build/app" "the CMake recipe's program"
echo "PASS: the README's CMake recipe installed amp and built the Trainer block, which ran"
