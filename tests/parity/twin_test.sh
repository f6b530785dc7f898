#!/usr/bin/env bash
# A parity pair: the C++ half, then its Python twin on the same LibTorch, bit for bit.
#   twin_test.sh CPP_HALF TWIN.py [ARGS...]
# Runs `CPP_HALF OUT ARGS...` (it prints "<name>: LibTorch X.Y on ...", or
# "skipped: ..." where this LibTorch cannot run it), then `TWIN.py OUT ARGS...`
# with the first Python whose torch is the same X.Y; the twin exits 1 on any difference.
set -euo pipefail
cpp_half=$1 twin=$2
shift 2
case "$cpp_half" in /*) ;; *) cpp_half="$PWD/$cpp_half" ;; esac
out=${TEST_TMPDIR:-$(mktemp -d)}
# One thread in both programs: the same reduction order whatever the machine,
# and no OpenMP spinning against the tests Bazel runs beside this one.
export OMP_NUM_THREADS=1
"$cpp_half" "$out" "$@" | tee "$out/cpp_half.log"
if grep -q '^skipped: ' "$out/cpp_half.log"; then exit 0; fi
cpp=$(sed -n 's/^[a-z0-9_]*: LibTorch \([0-9.]*\) on .*/\1/p' "$out/cpp_half.log")
. "$(dirname "${BASH_SOURCE[0]}")/twin_python.sh"
twin_python "$cpp" "$twin" torch
"$py" "$twin" "$out" "$@"
