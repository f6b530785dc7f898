#!/usr/bin/env bash
# The test half of bazel/amp.bzl's compile_check_test: prints the record a
# build action made of a compile-only check and exits with its status.
#   compile_check_report.sh LOG
set -u
log=$1
cat "$log"
status=$(sed -n 's/^exit status \([0-9]*\)$/\1/p' "$log" | tail -n 1)
[ -n "$status" ] || { echo "FAIL: $log has no exit status line"; exit 1; }
exit "$status"
