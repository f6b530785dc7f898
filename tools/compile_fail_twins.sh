#!/usr/bin/env bash
# The passing twins of the compile-fail tests (tools/compile_fail_test.sh):
# every SRC, as is (without AMP_SHOULD_FAIL), must compile cleanly (-Wall
# -Wextra -Werror), which proves the harness and the sources sound. They
# compile to the end in one unit (tools/one_unit.sh), so LibTorch's and amp's
# templates are instantiated once for all; an error names its source and line.
# Each SRC's own includes are checked by its failing build, which must reach
# its rule's static assertion.
#   compile_fail_twins.sh [--pch=HEADER] FLAGS_FILE SRC...
set -u
pch=()
case "${1:-}" in --pch=*) pch=(-include "${1#--pch=}"); shift ;; esac
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")  # -std= comes with them
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bash "$(dirname "$0")/one_unit.sh" "$@" >"$tmp/twins.cc"
if log=$("$cxx" "${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$tmp/twins.cc" 2>&1); then
  printf 'PASS: %s\n' "$@"
  echo "the $# passing twins compile (one unit, to the end)"
  exit 0
fi
echo "FAIL: a passing twin does not compile (of: $*):"
echo "$log" | head -40
exit 1
