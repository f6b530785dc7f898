#!/usr/bin/env bash
# Every public header compiles on its own (as Hana checks for each of its headers),
# with -Wall -Wextra -Werror on amp's code.
#   header_test.sh [--std=c++20] [--full] [--aten-pch=HEADER] FLAGS_FILE HEADER...
# The standard is FLAGS_FILE's (the LibTorch line's) unless --std overrides it.
# Each header is the first thing its translation unit includes (twice: it is
# include-guarded) and is parsed to the end, where a static assertion stops
# the compiler (-Wfatal-errors) before it instantiates LibTorch's templates at
# the end of the unit: every name a header uses must be declared by what it
# includes, and every warning in its code is an error. The instantiations are
# checked where the headers meet: --full compiles one unit that includes every
# HEADER given, to the end (header_umbrella: all public headers; header_cxx20).
# --aten-pch=HEADER (//tools:aten_pch, <ATen/ATen.h> precompiled with
# FLAGS_FILE): a header whose first line of code is `#include <ATen/ATen.h>`
# (after comments and #pragma once) has its unit load that .gch first. That is
# the unit the header alone makes (its own include of ATen is then a no-op), so
# the check is the same, without parsing ATen again; other headers never load it.
set -u
std=() full=0 aten_pch=""
while :; do
  case "${1:-}" in
    --std=*) std=("-std=${1#--std=}"); shift ;;
    --full) full=1; shift ;;
    --aten-pch=*) aten_pch=${1#--aten-pch=}; shift ;;
    *) break ;;
  esac
done
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
read -r -a more_flags <<<"${AMP_CXXFLAGS:-}"; torch_flags+=("${more_flags[@]}")  # the build's --copt (compile_check_run.sh)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
sentinel="amp header test: parsed to the end"
check() {
  local h=$1 rel=${1#include/}
  local tu="$tmp/$(echo "$rel" | tr '/.' '__').cc"
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" > "$tu"
  printf 'static_assert(sizeof(char) == 0, "%s");\n' "$sentinel" >> "$tu"
  local pch=()
  if [ -n "$aten_pch" ] && [ ${#std[@]} -eq 0 ] &&
    [ "$(grep -vE '^[[:space:]]*(//.*)?$|^#pragma once$' "$h" | head -1)" = "#include <ATen/ATen.h>" ]; then
    pch=(-include "$aten_pch" -Winvalid-pch)
  fi
  log=$("$cxx" "${torch_flags[@]}" "${std[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude -Wfatal-errors "$tu" 2>&1)
  first=$(printf '%s\n' "$log" | grep -m1 -E 'error:')
  case "$first" in *"$sentinel"*) echo "ok   $rel"; return 0 ;; esac
  echo "FAIL $rel"; echo "$log" | head -20; return 1
}
fails=0
if [ "$full" -eq 1 ]; then
  tu="$tmp/all.cc"
  for h in "$@"; do printf '#include <%s>\n#include <%s>\n' "${h#include/}" "${h#include/}"; done > "$tu"
  if log=$("$cxx" "${torch_flags[@]}" "${std[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$tu" 2>&1); then
    echo "ok   $# headers in one unit, compiled to the end"; exit 0
  fi
  echo "FAIL: $# headers in one unit:"; echo "$log" | head -40; exit 1
fi
for h in "$@"; do check "$h" || fails=$((fails + 1)); done
echo "$# headers, $fails failed"
[ "$fails" -eq 0 ]
