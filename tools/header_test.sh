#!/usr/bin/env bash
# Every public header compiles on its own (as Hana checks for each of its headers),
# with -Wall -Wextra -Werror on amp's code.  header_test.sh [--std=c++20] FLAGS_FILE HEADER...
# The standard is FLAGS_FILE's (the LibTorch line's) unless --std overrides it.
set -u
std=()
case "${1:-}" in --std=*) std=("-std=${1#--std=}"); shift ;; esac
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
check() {
  local h=$1 rel=${1#include/}
  local tu="$tmp/$(echo "$rel" | tr '/.' '__').cc"
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" > "$tu"   # and include-guarded
  if log=$("$cxx" "${torch_flags[@]}" "${std[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$tu" 2>&1); then
    echo "ok   $rel"
  else
    echo "FAIL $rel"; echo "$log" | head -20; return 1
  fi
}
fails=0
for h in "$@"; do check "$h" || fails=$((fails + 1)); done
echo "$# headers, $fails failed"
[ "$fails" -eq 0 ]
