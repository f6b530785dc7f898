#!/usr/bin/env bash
# The build action of bazel/compile_check.bzl: runs a compile-only check and
# records its output and verdict (exit status 0 or 1: the check's scripts
# exit 1 when the check fails), then names the amp headers the check's
# sources cannot reach (tools/unused_headers.py), which Bazel then ignores.
#   compile_check_run.sh LOG UNUSED SCANNER HEADERS_LIST ROOTS_LIST CXXFLAGS SCRIPT ARGS...
# CXXFLAGS (the build's --copt values) reach the script as AMP_CXXFLAGS.
# Any other status (126/127: the script could not run) fails the action, so
# that a broken environment is never cached as a result.
set -u
log=$1 unused=$2 scanner=$3 headers=$4 roots=$5 script=$7
export AMP_CXXFLAGS=$6
shift 7
s=0
bash "$script" "$@" >"$log" 2>&1 || s=$?
echo "exit status $s" >>"$log"
if [ "$s" -gt 1 ]; then cat "$log"; exit "$s"; fi
python3 "$scanner" "$headers" "$roots" >"$unused"
