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
# The first Python with torch: CMake's (AMP_PYTHON), Debian's (python3-torch), the one on PATH.
py=""
for cand in "${AMP_PYTHON:-}" /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && "$cand" -c 'import torch' 2>/dev/null; then py=$cand; break; fi
done
if [ -z "$py" ]; then
  echo "amp: $(basename "$twin") needs Python's torch built on the same LibTorch $cpp (Debian: python3-torch)"
  exit 1
fi
pyv=$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
if [ "$pyv" != "$cpp" ]; then
  echo "amp: Python's torch is $pyv but amp was built against LibTorch $cpp; the comparison needs the same library"
  exit 1
fi
"$py" "$twin" "$out" "$@"
