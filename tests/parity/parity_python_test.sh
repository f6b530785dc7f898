#!/usr/bin/env bash
# parity on CPU, then its Python twin on the same machine: amp's Trainer and
# GradScaler against Python's torch.amp (the runs this LibTorch has), bit for bit.
set -euo pipefail
parity=$1 twin=$2
case "$parity" in /*) ;; *) parity="$PWD/$parity" ;; esac
out=${TEST_TMPDIR:-$(mktemp -d)}
# One thread in both programs: the same reduction order whatever the machine,
# and no OpenMP spinning against the tests Bazel runs beside this one.
export OMP_NUM_THREADS=1
"$parity" "$out" cpu | tee "$out/parity.log"
cpp=$(sed -n 's/^parity: LibTorch \([0-9.]*\) on .*/\1/p' "$out/parity.log")
# The first Python with torch: CMake's (AMP_PYTHON), Debian's (python3-torch), the one on PATH.
py=""
for cand in "${AMP_PYTHON:-}" /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && "$cand" -c 'import torch' 2>/dev/null; then py=$cand; break; fi
done
if [ -z "$py" ]; then
  echo "amp: parity_python_test needs Python's torch built on the same LibTorch $cpp (Debian: python3-torch)"
  exit 1
fi
pyv=$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
if [ "$pyv" != "$cpp" ]; then
  echo "amp: Python's torch is $pyv but amp was built against LibTorch $cpp; the comparison needs the same library"
  exit 1
fi
"$py" "$twin" "$out" cpu
