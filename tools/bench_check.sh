#!/usr/bin/env bash
# The benchmarks compile (-fsyntax-only, -Wall -Wextra -Werror on amp's code),
# so that none can rot: `bazel test //...` checks them this way instead of
# building them at -O2 (`bazel build //bench/...` or `bazel run //bench:NAME`
# does that, for a measurement).
#   bench_check.sh [--pch=HEADER] FLAGS_FILE SRC...
# Each SRC is parsed to its end as its own unit, where a static assertion stops
# the compiler (-Wfatal-errors) before it instantiates templates: every name
# it uses is declared by what it includes. Then all of them in one unit
# (tools/one_unit.sh), compiled to the end: their templates instantiated.
set -u
pch=()
case "${1:-}" in --pch=*) pch=(-include "${1#--pch=}"); shift ;; esac
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
common=("${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude)
for src in "$@"; do common+=(-iquote "$(dirname "$src")"); done  # their "..." includes, from a copy
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
sentinel="amp benchmark check: parsed to the end"
# Side by side (one per core); reported in order.
jobs_max=$(nproc 2>/dev/null || echo 2) i=0
for src in "$@"; do
  while [ "$(jobs -pr | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  i=$((i + 1))
  { printf '#line 1 "%s"\n' "$src"; cat "$src"; printf 'static_assert(sizeof(char) == 0, "%s");\n' "$sentinel"; } >"$tmp/$i.cc"
  ( "$cxx" "${common[@]}" -Wfatal-errors "$tmp/$i.cc" >"$tmp/$i.log" 2>&1
    grep -m1 -E 'error:' "$tmp/$i.log" | grep -qF "$sentinel"; echo $? >"$tmp/$i.status" ) &
done
bash "$(dirname "$0")/one_unit.sh" "$@" >"$tmp/all.cc"
wait
fails=0 i=0
for src in "$@"; do
  i=$((i + 1))
  if [ "$(cat "$tmp/$i.status")" = 0 ]; then
    echo "ok   $src"
  else
    echo "FAIL $src"; grep -v "$sentinel" "$tmp/$i.log" | head -20; fails=$((fails + 1))
  fi
done
if log=$("$cxx" "${common[@]}" "$tmp/all.cc" 2>&1); then
  echo "ok   the $# benchmarks in one unit, compiled to the end"
else
  echo "FAIL: the $# benchmarks in one unit, compiled to the end:"; echo "$log" | head -40; fails=$((fails + 1))
fi
echo "$# benchmarks, $fails failed"
[ "$fails" -eq 0 ]
