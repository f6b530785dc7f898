#!/usr/bin/env bash
# The benchmarks compile (-fsyntax-only, -Wall -Wextra -Werror on amp's code),
# so that none can rot: `bazel test //...` checks them this way instead of
# building them at -O2 (`bazel build //bench/...` or `bazel run //bench:NAME`
# does that, for a measurement).
#   bench_check.sh [--pch=HEADER] FLAGS_FILE SRC...
set -u
pch=()
case "${1:-}" in --pch=*) pch=(-include "${1#--pch=}"); shift ;; esac
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
fails=0
for src in "$@"; do
  if log=$("$cxx" "${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$src" 2>&1); then
    echo "ok   $src"
  else
    echo "FAIL $src"; echo "$log" | head -20; fails=$((fails + 1))
  fi
done
echo "$# benchmarks, $fails failed"
[ "$fails" -eq 0 ]
