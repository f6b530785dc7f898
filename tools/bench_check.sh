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
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Side by side (one per core); reported in order.
jobs_max=$(nproc 2>/dev/null || echo 2) i=0
for src in "$@"; do
  while [ "$(jobs -pr | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  i=$((i + 1))
  ( "$cxx" "${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$src" >"$tmp/$i.log" 2>&1
    echo $? >"$tmp/$i.status" ) &
done
wait
fails=0 i=0
for src in "$@"; do
  i=$((i + 1))
  if [ "$(cat "$tmp/$i.status")" = 0 ]; then
    echo "ok   $src"
  else
    echo "FAIL $src"; head -20 "$tmp/$i.log"; fails=$((fails + 1))
  fi
done
echo "$# benchmarks, $fails failed"
[ "$fails" -eq 0 ]
