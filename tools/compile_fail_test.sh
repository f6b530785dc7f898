#!/usr/bin/env bash
# Compile-fail test (Eigen's failtest idea), run by Bazel's sh_test.
#   compile_fail_test.sh [--pch=HEADER] SRC FLAGS_FILE [EXPECTED_MESSAGE]
# EXPECTED_MESSAGE defaults to the text after `// expect: ` in SRC.
# SRC with -DAMP_SHOULD_FAIL must fail, and its FIRST error must be a static
# assertion carrying EXPECTED_MESSAGE. A build that fails for any other reason
# first (typo, missing include) fails this test. It stops at its first error
# (-Wfatal-errors): nothing after it is read. SRC as is (the passing twin)
# must compile cleanly: bazel/amp.bzl's compile_fail_twins_test checks every
# twin of a package in one unit (tools/compile_units.sh --unit-only).
# --pch=HEADER: the build first loads HEADER's precompiled .gch
# (//tools:torch_pch, <torch/torch.h>), instead of parsing LibTorch again;
# not for a source that includes only amp/core/ and standard headers (c10's
# small headers: cheaper to parse than LibTorch's templates are to instantiate).
set -u
pch=()
case "${1:-}" in --pch=*) pch=(-include "${1#--pch=}"); shift ;; esac
src=$1 flags_file=$2 expect=${3:-}
if ! grep -E '^#include' "$src" | grep -vqE '^#include [<"](amp/core/[a-z_]+\.h|[a-z_]+)[>"]'; then pch=(); fi
if [ -z "$expect" ]; then
  expect=$(sed -n 's|^// expect: ||p' "$src")
  if [ -z "$expect" ] || [ "$(printf '%s\n' "$expect" | wc -l)" -ne 1 ]; then
    echo "FAIL: $src needs exactly one '// expect: amp: ...' line"; exit 1
  fi
fi
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")  # -std= comes with them
read -r -a more_flags <<<"${AMP_CXXFLAGS:-}"; torch_flags+=("${more_flags[@]}")  # the build's --copt (compile_check_run.sh)
common=("${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude)

if fail_log=$("$cxx" "${common[@]}" -Wfatal-errors -DAMP_SHOULD_FAIL "$src" 2>&1); then
  echo "FAIL: $src compiled with -DAMP_SHOULD_FAIL; expected: $expect"
  exit 1
fi
first_error=$(printf '%s\n' "$fail_log" | grep -m1 -E 'error:')
case "$first_error" in
  *"static assertion failed"*"$expect"* | *"static_assert failed"*"$expect"*)
    echo "PASS: $src -> $first_error"
    exit 0 ;;
esac
echo "FAIL: $src failed to compile, but its first error is not the static assertion"
echo "  expected: $expect"
echo "  first error: $first_error"
printf '%s\n' "$fail_log" | head -40
exit 1
