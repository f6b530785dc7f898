#!/usr/bin/env bash
# parity on CPU, then its Python twin on the same machine: amp's Trainer and
# GradScaler against Python's torch.amp + fused=True optimizers, bit for bit.
set -euo pipefail
parity=$1 twin=$2
case "$parity" in /*) ;; *) parity="$PWD/$parity" ;; esac
out=${TEST_TMPDIR:-$(mktemp -d)}
# One thread in both programs: the same reduction order whatever the machine,
# and no OpenMP spinning against the tests Bazel runs beside this one.
export OMP_NUM_THREADS=1
"$parity" "$out" cpu | tee "$out/parity.log"
if grep -q "^parity: skipped" "$out/parity.log"; then exit 0; fi
cpp=$(sed -n 's/^parity: LibTorch \([0-9.]*\) on .*/\1/p' "$out/parity.log")
py=${AMP_PYTHON:-$(command -v python3 || echo /usr/bin/python3)}  # CMake passes the Python it found
pyv=$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null) || {
  echo "amp: parity_python_test needs Python's torch built on the same LibTorch $cpp (Debian: python3-torch)"
  exit 1
}
if [ "$pyv" != "$cpp" ]; then
  echo "amp: Python's torch is $pyv but amp was built against LibTorch $cpp; the comparison needs the same library"
  exit 1
fi
"$py" "$twin" "$out" cpu
